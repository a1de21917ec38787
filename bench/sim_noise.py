"""How much the mean queue wait moves when the scheduler prefers nodes for reasons that have
nothing to do with the caches: the spread that any change of node choice gives the
simulated schedule, against which placement ``prefer``'s change of the wait is read.

    .venv/bin/python bench/sim_noise.py [--seeds 1 2 3] [--draws 6]

For each generated trace (``dsstage simulate``'s defaults) it runs LRU with unaware
placement, then LRU with ``prefer`` where each dataset's "feature" is a fixed random set of
1 to half the nodes (seeded), unrelated to where the data is, and prints the mean queue
wait of each draw over the unaware one. See docs/simulation.md, "Queue wait".
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

from dsstage.policy.sim import trace as tr
from dsstage.policy.sim.replay import Features, Lru, Setup, Tier, simulate


def spread(seed: int, draws: int) -> list[float]:
    t = tr.generate(jobs=3000, nodes=16, draws=tr.Draws(seed=seed))
    cap = int(0.33 * t.working_set())
    base, _ = simulate(t.jobs, t.nodes, 1, t.sizes, cap, 2e9, Lru())
    out = []
    for k in range(draws):
        rng = random.Random(k)
        drawn = {d: frozenset(rng.sample(range(t.nodes), rng.randint(1, t.nodes // 2))) for d in sorted(t.sizes)}

        class Blind(Features):
            def __init__(self, tiers: Sequence[Tier], interval: float):
                super().__init__(tiers, interval)
                self.held = drawn

            def before(self, now: float) -> None:
                pass  # never looks at the tiers

        res, _ = simulate(t.jobs, t.nodes, 1, t.sizes, cap, 2e9, Lru(), Setup("prefer", features_of=Blind))
        out.append(res.queue_wait_mean / base.queue_wait_mean)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--draws", type=int, default=6)
    args = p.parse_args()
    for seed in args.seeds:
        ratios = spread(seed, args.draws)
        print(f"seed {seed}: mean queue wait with cache-blind preferences / unaware: "
              + " ".join(f"{r:.3f}" for r in ratios) + f"  (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
