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

How old a lease is does not come from comparing two hosts' clocks (a controller whose clock
is minutes behind would look stopped, or never stopped, to the other): it is the age of the
lease file by the state directory's own clock, its modification time against that of a
probe this poller touches now (``utime`` without a time: the file server sets it,
``SET_TO_SERVER_TIME`` over NFS) (``server_age``). The lease's ``time`` is shown, never
compared; where the probe cannot be written, the poller's own clock stands in.

``decide`` is the rule, a pure function of the lease, its age, this poller and the time.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsstage.fs import formats, shared
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


def decide(lease: dict[str, Any], me: Me, now: float, ttl_s: float, age: float | None = None) -> Decision:
    """Whether this poller acts this round, and why. ``age``: how long ago the lease was
    written, by the state directory's clock (``server_age``); None: ``now`` minus its time."""
    host, pid, time = lease.get("host"), lease.get("pid"), lease.get("time")
    if not isinstance(host, str) or not isinstance(pid, int) or not isinstance(time, (int, float)):
        return Decision(True, "no poller holds the lease")
    if host == me.host and pid == me.pid:
        return Decision(True, "this poller holds the lease")
    age = now - time if age is None else age
    if age > ttl_s:
        return Decision(True, f"the poller on {host} (pid {pid}) last acted {age:.0f}s ago (more than "
                              f"{ttl_s:.0f}s): taken over")
    return Decision(False, f"the poller on {host} (pid {pid}) acts (its last round {max(0.0, age):.0f}s ago); "
                           f"this one stands by and takes over if that one stops for {ttl_s:.0f}s")


def path(state_dir: str) -> str:
    return os.path.join(state_dir, LEASE)


def probe_path(state_dir: str, me: Me) -> str:
    return os.path.join(state_dir, f".poller-clock.{me.host}")


def server_age(state_dir: str, me: Me) -> float | None:
    """How long ago the lease file was written, by the state directory's own clock: its
    modification time against that of this poller's probe, touched now with the server's
    time; None where either cannot be had (no lease, a probe that cannot be written)."""
    try:
        # opened, not stat'd: an NFS client revalidates a file's attributes at open
        fd = os.open(path(state_dir), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            written = os.fstat(fd).st_mtime
        finally:
            os.close(fd)
        return max(0.0, shared.touch_time(probe_path(state_dir, me)) - written)
    except OSError:
        return None


def round_(state_dir: str, me: Me, now: float, ttl_s: float,
           age_of: Callable[[str, Me], float | None] = server_age) -> Decision:
    """Decide this round; when acting, write the lease as this poller's and keep acting only
    if it still reads as ours (another poller may have written in the same instant).
    ``age_of``: the lease's age by the state directory's clock (tests give their own)."""
    lease = read_json(path(state_dir))
    decision = decide(lease, me, now, ttl_s, age_of(state_dir, me) if lease else None)
    if not decision.act:
        return decision
    write_json(path(state_dir), formats.stamp("poller-lease", {"host": me.host, "pid": me.pid, "time": now}),
               fsync=False)
    after = read_json(path(state_dir))
    if after.get("host") != me.host or after.get("pid") != me.pid:
        return Decision(False, f"the poller on {after.get('host')} (pid {after.get('pid')}) took the lease "
                               "in the same round; this one stands by")
    return decision
