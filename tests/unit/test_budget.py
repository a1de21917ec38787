"""A source's budget of requests in flight, the cluster's (dsstage.node.budget): what is free,
how grants expire, a dead taker's lock, and the wait that ends at the deadline."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from dsstage.config.load import from_dict
from dsstage.errors import OutOfTime
from dsstage.node import budget
from helpers import releases


def test_free_slots_are_the_budget_less_the_unexpired_grants() -> None:
    grants = {"a": {"slots": 4, "until": 110.0}, "b": {"slots": 3, "until": 90.0},  # b expired
              "c": {"slots": "x", "until": 200.0}, "d": {"slots": True, "until": 200.0}, "e": {}}
    assert budget.free(grants, 100.0, 10) == 6
    assert budget.free(grants, 120.0, 10) == 10  # a dead node's grant expires by itself
    assert budget.free({"a": {"slots": 12, "until": 200.0}}, 100.0, 10) == 0


def _conf(tmp_path):
    import os
    import pwd
    # the grants' directory must be root's or report.user's: as an ordinary user, that user is it
    me = {} if os.geteuid() == 0 else {"report": {"user": pwd.getpwuid(os.geteuid()).pw_name}}
    return from_dict({**me, "state_dir": str(tmp_path), "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}},
                      "sources": {"nfs": {"prefix": "/nfs/", "max_in_flight": 5}},
                      "datasets": {"d": {"source": "/nfs/d"}}})


def test_grants_add_up_to_the_budget_and_a_full_one_waits_until_its_deadline(tmp_path) -> None:
    conf = _conf(tmp_path)
    nfs = conf.sources["nfs"]
    first = budget.take(conf, nfs, "n1", 4, None)
    second = budget.take(conf, nfs, "n2", 4, None)
    assert (first.slots, second.slots) == (4, 1)  # what is free, at least one
    slept: list[float] = []
    with pytest.raises(OutOfTime, match="sources.nfs has no request in flight to spare"):
        budget.take(conf, nfs, "n3", 1, time.monotonic() + 2.5, sleep=slept.append)
    assert slept  # it waited before it gave up
    budget.release(first)
    assert budget.take(conf, nfs, "n3", 8, None).slots == 4
    # a node that died holding its slots: they are free again once its grant expires
    later = budget.take(conf, nfs, "n4", 5, time.monotonic() + 1.5,
                        clock=lambda: time.time() + budget.TTL + 1, sleep=lambda s: None)
    assert later.slots == 5


def test_a_listing_counts_the_grants_and_a_stage_that_waits_takes_no_lock_and_opens_none(tmp_path, monkeypatch):
    """A grant's name says its slots and until when: takers add them up from one listing, and
    while none is free they neither make the lock (a dozen requests over NFS) nor open grants.
    A grant of a taker before 0.3.0 (its name without them) is opened and counted; a grant's
    content says the same as its name, for those takers."""
    conf = _conf(tmp_path)
    nfs = conf.sources["nfs"]
    held = budget.take(conf, nfs, "n1", 3, None)
    where = tmp_path / "budget" / "nfs"
    name = os.path.basename(held.path)
    assert budget.GRANT_NAME.match(name) and name.startswith("@3.") and ".n1." in name
    content = json.loads(Path(held.path).read_text())
    assert content["slots"] == 3 and content["until"] == float(name.split(".")[1]) and content["node"] == "n1"
    old = where / "n9.0123456789ab.json"  # a 0.2.0 node's grant of the other 2
    old.write_text(json.dumps({"format": 1, "node": "n9", "slots": 2, "until": time.time() + 60, "pid": 1}))
    opened: list[str] = []
    locked: list[str] = []
    real_read = budget.untrusted.read_json
    monkeypatch.setattr(budget.untrusted, "read_json", lambda path, cap: opened.append(path) or real_read(path, cap))
    monkeypatch.setattr(budget.shared, "create_once", lambda *a: locked.append(a[1]) or True)
    with pytest.raises(OutOfTime):
        budget.take(conf, nfs, "n2", 1, time.monotonic() + 2.5, sleep=lambda s: None)
    assert not locked  # no slot free: no lock made
    assert set(opened) == {str(old)}  # the old grant alone was opened, once a try
    monkeypatch.undo()
    during: list[tuple[int, list[str]]] = []  # while both names show: counted once
    assert budget.renew(held, sleep=lambda s: during.append(
        (budget.free(budget._grants(str(where)), time.time(), 5), sorted(os.listdir(where)))))
    renewed = os.path.basename(held.path)
    assert renewed != name and renewed.startswith("@3.") and not (where / name).exists()
    assert during == [(0, sorted([name, renewed, old.name]))]
    assert json.loads(Path(held.path).read_text())["until"] == float(renewed.split(".")[1])
    budget.release(held)
    old.unlink()
    assert budget.take(conf, nfs, "n2", 9, None).slots == 5


def test_a_dead_takers_lock_is_broken(tmp_path) -> None:
    conf = _conf(tmp_path)
    where = tmp_path / "budget" / "nfs"
    where.mkdir(parents=True)
    lock = where / budget.LOCK
    lock.write_text('{"time": 1.0, "pid": 1}')
    with pytest.raises(OutOfTime):  # a live taker's (made just now): waited for, not broken
        budget.take(conf, conf.sources["nfs"], "n1", 2, time.monotonic() + 1.5)
    assert lock.exists()
    os.utime(lock, (1.0, 1.0))  # old by its attributes (NFS may cache them), its taker says otherwise
    lock.write_text(json.dumps({"time": time.time(), "pid": 1}))
    os.utime(lock, (1.0, 1.0))
    with pytest.raises(OutOfTime):
        budget.take(conf, conf.sources["nfs"], "n1", 2, time.monotonic() + 1.5)
    assert lock.exists()
    lock.write_text('{"time": 1.0, "pid": 1}')  # left by a taker that died long ago: old both ways
    os.utime(lock, (1.0, 1.0))
    grant = budget.take(conf, conf.sources["nfs"], "n1", 2, time.monotonic() + 5)
    assert grant.slots == 2 and not (where / budget.LOCK).exists()
    assert budget.renew(grant) and grant.record["until"] > time.time()
    budget.release(grant)
    assert not budget.renew(grant)  # gone: a stall past TTL is said


def test_a_node_whose_clock_is_ahead_does_not_take_slots_another_holds(tmp_path, monkeypatch) -> None:
    """Grants are timed by the state directory's clock (its offset from the host's, measured by
    touching a probe there), not each node's: a node whose clock runs 2 x TTL ahead would
    otherwise see every other grant as expired and take the whole budget again. Each "node"
    here is this process with another clock, so the measured offset is forgotten in between
    (a process measures its own host's)."""
    from dsstage.fs import shared
    conf = _conf(tmp_path)
    nfs = conf.sources["nfs"]
    held = budget.take(conf, nfs, "n1", 4, None)
    real = time.time
    monkeypatch.setattr(shared, "_offsets", {}, raising=False)
    monkeypatch.setattr(time, "time", lambda: real() + 2 * budget.TTL)  # n2's clock
    ahead = budget.take(conf, nfs, "n2", 5, None)
    assert (held.slots, ahead.slots) == (4, 1)  # only what is free by the directory's clock
    assert budget.renew(held)  # n1's grant has not expired
    monkeypatch.setattr(shared, "_offsets", {}, raising=False)
    monkeypatch.setattr(time, "time", lambda: real() - 2 * budget.TTL)  # a clock behind: no grant kept longer
    assert budget.renew(ahead)
    assert abs(ahead.record["until"] - (real() + budget.TTL)) < 5
    assert not [p for p in (tmp_path / "budget" / "nfs").iterdir() if p.name.startswith(".clock")]  # not listed


def test_a_claim_is_aged_by_the_state_directorys_clock(tmp_path, monkeypatch) -> None:
    """A node whose clock runs ahead by more than peers.wait takes a claim made a moment ago for
    an old one whose node stopped (its report shows nothing) and reads the source itself:
    the claim's and the report's file times against the directory's clock decide instead."""
    from dsstage.fs import shared
    from dsstage.node import stagers
    conf = _conf(tmp_path)
    assert stagers.claim(conf, "d", "0123456789abcdef", "n1") == "n1"
    real = time.time
    monkeypatch.setattr(shared, "_offsets", {}, raising=False)
    monkeypatch.setattr(time, "time", lambda: real() + 4 * conf.peers.wait)  # n2's clock
    assert stagers.claim(conf, "d", "0123456789abcdef", "n2") == "n1"  # young by the directory's clock


def test_a_holder_is_aged_by_the_state_directorys_clock(tmp_path, monkeypatch) -> None:
    """A holder's report, published a moment ago by a node whose clock runs an hour behind,
    says it was written an hour ago: by the times the reports say, a reader drops it as stale
    (and reads the source); by the report file's time against the directory's clock
    (``server_now``, as dsstage.node.staging.reports_clock gives it) it is fresh. And a dead
    holder's report, last written long ago by a clock an hour ahead, is stale whatever it says."""
    import os

    from dsstage.fs import shared
    from dsstage.node import report
    state = tmp_path / "state"
    (state / "nodes").mkdir(parents=True)
    vid = "0123456789abcdef"

    def publish(node: str, said: float, written: float) -> None:
        path = report.published_path(str(state), node)
        copies = [{"dataset": "d", "version": vid, "state": "ready"}]
        with open(path, "w") as fh:
            json.dump({"node": node, "time": said, "copies": copies}, fh)
        os.utime(path, (written, written))
    now = time.time()
    publish("behind", now - 3600, now)  # alive; its clock an hour behind
    publish("dead", now + 3600 - 600, now - 600)  # stopped 10 min ago; its clock an hour ahead
    by_their_clocks = report.holders(str(state), "d", vid, now, 300)
    assert by_their_clocks == []  # "behind" taken for stale (the old rule); "dead" for the future
    clock = shared.server_clock(str(state / "nodes"))
    assert clock is not None
    # (the clock's probe, .clock.<host> beside the reports, is no report: not listed)
    assert report.holders(str(state), "d", vid, now, 300, server_now=clock()) == ["behind"]


def test_one_probe_measures_the_clock_of_every_directory_on_a_filesystem(tmp_path, monkeypatch) -> None:
    """nodes/, staging/ and budget/ of one state directory are on one server, with one clock:
    a cold stage that reads the three touches one probe, not three."""
    import socket

    from dsstage.fs import shared
    monkeypatch.setattr(shared, "_offsets", {})
    monkeypatch.setattr(shared, "_devs", {})
    dirs = [tmp_path / d for d in ("nodes", "staging", "budget")]
    for d in dirs:
        d.mkdir()
    clocks = [shared.server_clock(str(d)) for d in dirs]
    assert all(clocks) and abs(clocks[2]() - time.time()) < 5  # type: ignore[misc]
    probe = f".clock.{socket.gethostname()}"
    assert [(d / probe).exists() for d in dirs] == [True, False, False]
    monkeypatch.setattr(shared, "_offsets", {})  # measured too long ago: the next reading measures again
    assert shared.server_offset(str(dirs[1])) is not None and (dirs[1] / probe).exists()


def _previous_budget_module():
    """dsstage.node.budget as the previous release (packaging/releases) shipped it, from the
    checkout's git history, run against this checkout's other modules."""
    import subprocess
    import types
    top = Path(__file__).resolve().parents[2]
    version, commit, _day = releases()[-1]
    shown = subprocess.run(["git", "-C", str(top), "show", f"{commit}:lib/dsstage/node/budget.py"],
                           capture_output=True, text=True)
    if shown.returncode != 0:
        pytest.fail(f"the previous release {version} ({commit}) is not in this checkout's history: "
                    f"{shown.stderr.strip()} (git fetch --unshallow --tags)", pytrace=False)
    import sys
    name = f"budget_of_{version.replace('.', '_')}"
    module = sys.modules[name] = types.ModuleType(name)  # dataclasses look their module up
    try:
        exec(compile(shown.stdout, f"budget.py of {version}", "exec"), module.__dict__)  # noqa: S102 - our own release
    finally:
        del sys.modules[name]
    return version, module


def test_the_previous_releases_takers_and_this_ones_count_each_others_grants(tmp_path) -> None:
    """An upgrade one node at a time: grants of both releases in one source's directory add
    up for takers of either, renewed or not."""
    version, old = _previous_budget_module()
    conf = _conf(tmp_path)
    nfs = conf.sources["nfs"]
    where = str(tmp_path / "budget" / "nfs")
    new_grant = budget.take(conf, nfs, "n1", 3, None)
    assert old.free(old._grants(where), time.time(), 5) == 2, f"{version} misses this release's grant"
    old_grant = old.take(conf, nfs, "n2", 5, None)
    assert old_grant.slots == 2
    assert budget.free(budget._grants(where), time.time(), 5) == 0, f"this release misses {version}'s grant"
    for taker in (budget, old):
        with pytest.raises(OutOfTime):
            taker.take(conf, nfs, "n3", 1, time.monotonic() + 1.2, sleep=lambda s: None)
    time.sleep(1.1)  # a renewal in another second: a new name
    assert budget.renew(new_grant, sleep=lambda s: None) and old.renew(old_grant)
    assert old.free(old._grants(where), time.time(), 5) == 0 == budget.free(budget._grants(where), time.time(), 5)
    budget.release(new_grant)
    assert old.free(old._grants(where), time.time(), 5) == 3
