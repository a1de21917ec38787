"""One demand poller acts at a time: a lease in the shared state directory.

Sites run slurmctld in pairs (two ``SlurmctldHost`` lines) and install the poller's service on
both, or on a login node as well. Were every poller to act, each would rewrite the snapshot and
the node features; were only the primary's, none would act after a failover until an admin
noticed. So each poller, each round, reads ``<state_dir>/poller.json`` (host, pid, time of the
acting poller's last round) and acts only if the lease is its own, missing or damaged, or older
than ``ttl`` (its holder stopped: a controller that failed, a stopped service). It then writes
the lease as its own and reads it back: of two pollers that both found the lease free, the one
whose write landed last acts, the other stands by from the next round. The file is written by
plain create-and-rename, which NFS with ``root_squash`` allows ``report.user`` to do, and no
lock that a dead host could keep.

``decide`` is the rule, a pure function of the lease, this poller and the time.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from dsstage.fs import formats
from dsstage.fs.safe import read_json, write_json

LEASE = "poller.json"
#: a lease is taken over once it is older than this many rounds (and at least MIN_TTL seconds)
ROUNDS = 3
MIN_TTL = 30.0


@dataclass(frozen=True)
class Me:
    host: str
    pid: int

    @classmethod
    def here(cls) -> Me:
        return cls(socket.gethostname(), os.getpid())


@dataclass(frozen=True)
class Decision:
    act: bool
    reason: str


def ttl(interval: float) -> float:
    return max(MIN_TTL, ROUNDS * interval)


def decide(lease: dict[str, Any], me: Me, now: float, ttl_s: float) -> Decision:
    """Whether this poller acts this round, and why."""
    host, pid, time = lease.get("host"), lease.get("pid"), lease.get("time")
    if not isinstance(host, str) or not isinstance(pid, int) or not isinstance(time, (int, float)):
        return Decision(True, "no poller holds the lease")
    if host == me.host and pid == me.pid:
        return Decision(True, "this poller holds the lease")
    age = now - time
    if age > ttl_s:
        return Decision(True, f"the poller on {host} (pid {pid}) last acted {age:.0f}s ago (more than "
                              f"{ttl_s:.0f}s): taken over")
    return Decision(False, f"the poller on {host} (pid {pid}) acts (its last round {max(0.0, age):.0f}s ago); "
                           f"this one stands by and takes over if that one stops for {ttl_s:.0f}s")


def path(state_dir: str) -> str:
    return os.path.join(state_dir, LEASE)


def round_(state_dir: str, me: Me, now: float, ttl_s: float) -> Decision:
    """Decide this round; when acting, write the lease as this poller's and keep acting only
    if it still reads as ours (another poller may have written in the same instant)."""
    decision = decide(read_json(path(state_dir)), me, now, ttl_s)
    if not decision.act:
        return decision
    write_json(path(state_dir), formats.stamp("poller-lease", {"host": me.host, "pid": me.pid, "time": now}),
               fsync=False)
    after = read_json(path(state_dir))
    if after.get("host") != me.host or after.get("pid") != me.pid:
        return Decision(False, f"the poller on {after.get('host')} (pid {after.get('pid')}) took the lease "
                               "in the same round; this one stands by")
    return decision
