"""The prefetch's decisions (dsstage.cluster.prefetch): what to stage, what to spare, when a plan changed."""

from __future__ import annotations

from dsstage.cluster.prefetch import Candidate, Prefetcher, select, spare_rule, still_wanted
from dsstage.config import load
from dsstage.policy.retention import Copy, Demand, Want

NOW = 1_000_000.0


def want(job: str, state: str = "pending", start: float | None = NOW + 60, nodes: tuple[str, ...] = ("n1",),
         priority: int = 0) -> Want:
    return Want(job_id=job, state=state, start=start, nodes=nodes, priority=priority, user="ana")


def test_select_earliest_job_per_dataset_planned_here_within_the_horizon() -> None:
    dem = Demand(wants={
        "a": [want("1", start=NOW + 300), want("2", start=NOW + 100)],
        "b": [want("3", nodes=("n2",))],  # elsewhere
        "c": [want("4", start=None)],  # no expected start
        "d": [want("5", start=NOW + 7200)],  # beyond the horizon
        "e": [want("6", start=NOW - 5)],  # due: the plan is late
        "f": [want("7")],  # ready here
        "g": [want("8")],  # not in the catalog
        "h": [want("9", state="running")],
    })
    cands, skips = select(dem, "n1", NOW, 3600, catalog=["a", "b", "c", "d", "e", "f", "h"], ready={"f"})
    assert [(c.dataset, c.job_id) for c in cands] == [("e", "6"), ("a", "2")]
    assert cands[0].reason == "pending job 6 planned on n1, due now"
    assert {s.dataset: s.reason for s in skips} == {
        "d": "job 5 expected in 2 h, beyond the horizon (1 h)", "f": "ready here already",
        "g": "not in this node's catalog"}


def test_select_nothing_on_a_stale_snapshot() -> None:
    assert select(Demand(wants={"a": [want("1")]}, stale=True), "n1", NOW, 3600, catalog=["a"], ready=set()) == \
        ([], [])


def test_spare_keeps_what_a_sooner_or_running_job_needs_here() -> None:
    spare = spare_rule("n1", NOW + 600)
    copy = Copy("x", "v1", 10, NOW)
    assert spare(copy, Demand(wants={"x": [want("1", start=NOW + 60)]})) == "which pending job 1 needs sooner"
    assert spare(copy, Demand(wants={"x": [want("1", start=NOW + 60, nodes=())]})) != ""  # not placed yet
    assert spare(copy, Demand(wants={"x": [want("1", start=NOW + 900)]})) == ""  # later than ours
    assert spare(copy, Demand(wants={"x": [want("1", nodes=("n2",))]})) == ""  # planned elsewhere
    assert spare(copy, Demand(wants={"x": [want("1", state="running")]})) != ""
    assert spare(copy, Demand(stale=True)) != ""


def test_still_wanted_until_the_plan_moves() -> None:
    c = Candidate("x", "1", "ana", NOW + 60, "")
    assert still_wanted(Demand(wants={"x": [want("1")]}), "n1", NOW, 3600, c) == ""
    assert still_wanted(Demand(wants={"x": [want("1", state="running")]}), "n1", NOW, 3600, c) == ""
    assert still_wanted(Demand(stale=True), "n1", NOW, 3600, c) == ""
    assert "the plan changed" in still_wanted(Demand(wants={"x": [want("1", nodes=("n2",))]}), "n1", NOW, 3600, c)
    assert "the plan changed" in still_wanted(Demand(wants={}), "n1", NOW, 3600, c)


def test_a_job_planned_on_several_nodes_is_prefetched_through_the_peers():
    """The candidate carries the job's planned nodes, so each node's prefetch reads its share
    from the source and the rest from the others (the child stages with them)."""
    dem = Demand(wants={"x": [Want("9", "pending", start=NOW + 60, nodes=("n1", "n2", "n3"))],
                        "y": [Want("8", "pending", start=NOW + 60, nodes=("n2",))]})
    got, _ = select(dem, "n2", NOW, 3600, catalog=["x", "y"], ready=set())
    assert {(c.dataset, c.nodes) for c in got} == {("x", "n[1-3]"), ("y", "")}
    p = Prefetcher(load.from_dict({"state_dir": "/s", "tiers": {"nvme": {"path": "/t", "capacity": "1GB"}}}), "n2",
                   python="/py")
    argv = p.child_argv(next(c for c in got if c.dataset == "x"))
    assert argv[argv.index("--nodes") + 1] == "n[1-3]"
    assert "--nodes" not in p.child_argv(next(c for c in got if c.dataset == "y"))
