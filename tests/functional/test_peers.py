"""Fan-out between the nodes of a job (dsstage.transfer.peers) with real rsync daemons on loopback:
the source serves a dataset about once, every byte from a peer is verified, and a peer
that dies or serves a corrupt file costs a retry, never a wrong byte.

The nodes are Store objects for n1..n3 (the tier is per node through {node}), each with
its own `dsstage peers serve` daemon; the source is a latencyfs mount, whose count of
bytes read is what the source served.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import latencyfs
import pytest
from dsstage.fs import layout
from dsstage.node import staging, verifying
from dsstage.transfer import peerd, peers
from helpers import Env, random_tree
from latencyfs import LatencyFS
from servers import free_port, wait_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store and the daemons are root's: run as root")

FILES, SIZE = 60, 100_000
NODES = ("n1", "n2", "n3")


class Peers:
    """The daemons of the nodes, each in a process group of its own, stopped by pid."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.ports = {n: free_port() for n in NODES}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str, *extra: str) -> subprocess.Popen[bytes]:
        """``dsstage peers serve`` for ``node``; with ``extra``, the rsync command it would
        run (same configuration and secret), with those options added."""
        env = dict(self.env.env(), SLURMD_NODENAME=node)
        log = open(self.env.tmp / f"peer-{node}.log", "ab")
        if extra:
            work = self.env.tmp / f"peer-{node}"
            work.mkdir(mode=0o700)
            argv = [*peerd.serve_argv(self.env.config(), node, str(work)), *extra]
        else:
            argv = [sys.executable, "-m", "dsstage", "peers", "serve"]
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[node] = proc
        wait_port(self.ports[node], proc, f"peer daemon of {node}")
        return proc

    def kill(self, node: str) -> None:
        """Kill the daemon and the connections it forked (its process group) at once."""
        proc = self.procs[node]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


@contextlib.contextmanager
def peered(env: Env, tmp_path: Path, name: str, enabled: bool = True, options: str = "", **spec: object):
    """Dataset ``name`` (``spec``: its catalog entry's extras) on a latencyfs source (mounted
    with ``options``), peers on (``enabled``) for n1..n3, their daemons not started:
    (backing tree, latencyfs, Peers)."""
    latencyfs.require()
    backing = random_tree(tmp_path / "backing", FILES, SIZE, fanout=20)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    secret = tmp_path / "peers.secret"
    secret.write_text("s3cret-for-tests-" + "x" * 24 + "\n")
    secret.chmod(0o600)
    peers = Peers(env)
    env.extra["peers"] = {"enabled": enabled, "secret_file": str(secret), "wait": 30, "timeout": 20,
                          "hosts": {n: f"127.0.0.1:{p}" for n, p in peers.ports.items()}}
    with LatencyFS(backing, mnt, delay_us=0, extra_options=options) as fs:
        env.add(name, source=str(mnt), **spec)
        env.cli("manifest", "build", name)
        fs.remount()
        fs.reset()
        try:
            yield backing, fs, peers
        finally:
            peers.stop()


@pytest.fixture
def cluster(env: Env, tmp_path: Path):
    """Dataset "shared" on a latencyfs source, peers on for n1..n3, their daemons not started."""
    with peered(env, tmp_path, "shared") as (_backing, fs, peers):
        yield env, fs, peers


def stage(env: Env, node: str, job: str, nodes: str) -> object:
    from dsstage.config import catalog
    return staging.stage(env.store(node=node), "shared",
                         staging.StageRequest(user=catalog.User.lookup(0), job_id=job, nodes=nodes))


def on_every_node(fn: Callable[[str], object]) -> dict[str, Any]:
    """``fn(node)`` for n1..n3 at once, in threads: node -> its result (the first error raised)."""
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def one(node: str) -> None:
        try:
            results[node] = fn(node)
        except BaseException as exc:  # raised below
            errors.append(exc)
    threads = [threading.Thread(target=one, args=(n,)) for n in NODES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    return results


def verified(env: Env, node: str) -> bool:
    return verifying.verify(env.store(node=node), "shared", full=True).ok


def dataset_bytes(env: Env) -> int:
    return FILES * (SIZE + 8)  # random_tree adds 8 bytes to every file


def test_three_nodes_read_the_source_about_once_and_all_end_verified(cluster):
    env, fs, peers = cluster
    for n in NODES:
        peers.start(n)
    results = on_every_node(lambda node: stage(env, node, "700", "n[1-3]"))
    total = dataset_bytes(env)
    source_read = fs.stats()["bytes_read"]
    # three independent stages would read 3x
    assert total <= source_read <= 1.1 * total, (source_read, total)
    for n in NODES:
        r = results[n]
        assert r.action == "staged" and r.peer_files > 0, r  # type: ignore[attr-defined]
        assert r.transferred_files + r.peer_files == FILES, r  # type: ignore[attr-defined]
        assert verified(env, n)
    assert sum(r.transferred_bytes for r in results.values()) == total  # type: ignore[attr-defined]


def share_of(env: Env, node: str, nodes: tuple[str, ...]) -> list[str]:
    """The files of ``node``'s share when ``nodes`` stage together."""
    store = env.store(node=node)
    manifest = store.load_manifest("shared", store.current("shared"))
    return [e.path for e in peers.shares(manifest.entries, nodes)[node]]


def test_a_peer_killed_mid_transfer_costs_a_fetch_from_the_source(cluster, caplog):
    env, fs, peers = cluster
    stage(env, "n1", "800", "")  # n1 holds the whole dataset, published
    peers.start("n1", "--bwlimit=150")  # KiB/s: slow enough to be killed mid-way
    share = share_of(env, "n1", ("n1", "n2"))
    staging = env.tier_root("n2") / "staging"
    fs.reset()
    done: dict[str, object] = {}
    caplog.set_level(logging.INFO, logger="dsstage")
    worker = threading.Thread(target=lambda: done.setdefault("r", stage(env, "n2", "801", "n[1-2]")))
    worker.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the first file of n1's share has landed on n2
        if any((d / rel).exists() for d in staging.glob("shared.*") for rel in share):
            break
        time.sleep(0.05)
    else:
        pytest.fail("no file of n1's share arrived from n1 within 60s")
    peers.kill("n1")
    worker.join(120)
    r = done["r"]
    assert r.action == "staged" and 0 < r.peer_files < len(share), r  # type: ignore[attr-defined]
    assert r.peer_files + r.transferred_files == FILES  # type: ignore[attr-defined]
    assert verified(env, "n2")
    given_up = [m for m in caplog.messages if m.startswith("peer n1: rsync exit")]
    assert given_up and "come from the other peers or the source" in given_up[0], caplog.messages
    # what n1 did not send came from the source, once
    assert fs.stats()["bytes_read"] == r.transferred_bytes  # type: ignore[attr-defined]


def test_a_peer_serving_a_corrupt_file_is_caught_named_and_the_file_refetched(cluster, caplog):
    env, fs, peers = cluster
    first = stage(env, "n1", "900", "")
    share = share_of(env, "n1", ("n1", "n2"))
    victim = Path(first.path) / share[0]  # type: ignore[attr-defined]
    st = victim.stat()
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF  # same size, same mtime: only the hash tells
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    victim.chmod(0o444)
    peers.start("n1")
    fs.reset()
    caplog.set_level(logging.INFO, logger="dsstage")
    r = stage(env, "n2", "901", "n[1-2]")
    assert r.action == "staged" and verified(env, "n2")  # type: ignore[attr-defined]
    named = [m for m in caplog.messages if m.startswith("peer n1 served 1 file(s) of shared that do not match")]
    assert named and share[0] in named[0], caplog.messages
    # the rest of n1's share came from n1; n2's own share and the corrupt file from the source
    assert r.peer_files == len(share) - 1, r  # type: ignore[attr-defined]
    assert r.transferred_files == FILES - len(share) + 1, r  # type: ignore[attr-defined]


def test_without_peers_enabled_a_multi_node_stage_reads_everything_from_the_source(cluster):
    env, fs, peers = cluster
    env.extra["peers"]["enabled"] = False
    env.write()
    r = stage(env, "n2", "950", "n[1-3]")
    assert r.peer_files == 0 and r.transferred_files == FILES  # type: ignore[attr-defined]
    assert fs.stats()["bytes_read"] == dataset_bytes(env)


def test_what_a_stage_cut_short_left_from_a_peer_is_hashed_again(cluster):
    """A peer's files land before they are hashed: a Prolog killed in between leaves them in
    the staging area, and the next stage (with peers) must not publish them unchecked."""
    from servers import RsyncDaemon
    env, fs, peers = cluster
    stage(env, "n1", "980", "")
    peers.start("n1")
    # an rsync source: its files are hashed only after the copy, so only the check of what a
    # stage cut short left catches the planted file
    daemon = RsyncDaemon(env.tmp, Path(str(fs.backing)))
    env.datasets["shared"]["source"] = daemon.url("")
    env.write()
    store = env.store(node="n2")
    digest = store.current("shared")
    share = share_of(env, "n1", ("n1", "n2"))
    left = env.tier_root("n2") / "staging" / layout.staging_name("shared", digest)
    planted = left / share[0]
    planted.parent.mkdir(parents=True, mode=0o700)
    os.chmod(env.tier_root("n2") / "staging", 0o700)
    size = (Path(str(fs.backing)) / share[0]).stat().st_size
    planted.write_bytes(b"\0" * size)  # whole in size, wrong in content: as a corrupt peer's copy
    try:
        r = stage(env, "n2", "981", "n[1-2]")
    finally:
        daemon.stop()
    assert r.action == "staged" and verified(env, "n2"), r  # type: ignore[attr-defined]


# -- who may reach a daemon, and how many at once -------------------------------------------------

def rsync_list(peer_port: int, secret: str, source_address: str = "") -> subprocess.CompletedProcess[str]:
    """A real rsync client asking a daemon for a module's listing, from ``source_address``."""
    argv = ["rsync", "--list-only", "--contimeout=10", "--timeout=10",
            *([f"--address={source_address}"] if source_address else []),
            f"rsync://{peers.USER}@127.0.0.1:{peer_port}/nvme-datasets/"]
    return subprocess.run(argv, env=dict(os.environ, RSYNC_PASSWORD=secret, LC_ALL="C"), capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def one_daemon(env: Env, tmp_path: Path):
    """n1's daemon from `dsstage peers serve`, its tier made, at most one connection at once."""
    secret = tmp_path / "peers.secret"
    secret.write_text("s3cret-for-tests-" + "x" * 24 + "\n")
    secret.chmod(0o600)
    daemons = Peers(env)
    env.extra["peers"] = {"enabled": True, "secret_file": str(secret), "max_connections": 1,
                          "hosts": {n: f"127.0.0.1:{p}" for n, p in daemons.ports.items()}}
    env.add("shared", {"a": b"a"})
    (env.tier_root("n1") / "datasets").mkdir(parents=True)
    try:
        daemons.start("n1")
        yield daemons.ports["n1"], secret.read_text().strip()
    finally:
        daemons.stop()


def test_a_daemon_answers_only_the_nodes_addresses(one_daemon):
    port, secret = one_daemon
    assert rsync_list(port, secret).returncode == 0
    stranger = rsync_list(port, secret, source_address="127.0.0.9")  # anyone else who reaches the port
    # refused; newer rsync daemons say the module is unknown to a denied host, older ones "access denied"
    assert stranger.returncode == 5 and ("access denied" in stranger.stderr or "Unknown module" in stranger.stderr)


def test_a_daemon_serves_at_most_max_connections_at_once(one_daemon):
    import socket
    port, secret = one_daemon
    held = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        assert held.recv(64).startswith(b"@RSYNCD:")
        held.sendall(b"@RSYNCD: 31.0\nnvme-datasets\n")
        assert b"AUTHREQD" in held.recv(256)  # the module's slot is taken; its answer never comes
        busy = rsync_list(port, secret)
        assert busy.returncode != 0 and "max connections (1) reached" in busy.stderr
    finally:
        held.close()
    deadline = time.monotonic() + 10
    while (res := rsync_list(port, secret)).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.2)  # the daemon's child for the closed connection exits
    assert res.returncode == 0, res.stderr


def test_the_nodes_a_pending_job_is_planned_on_prefetch_it_reading_the_source_once(cluster):
    """Three nodes' prefetch children for one pending job planned on n[1-3], as the prefetch
    supervisors start them: the shared filesystem serves the dataset about once, not three
    times, and every node ends with a verified copy."""
    env, fs, peers = cluster
    for n in NODES:
        peers.start(n)
    children = [subprocess.Popen([sys.executable, "-m", "dsstage.cluster.prefetch", "child", "--node", n,
                                  "--dataset", "shared", "--job", "901", "--user", "root", "--start",
                                  repr(time.time() + 600), "--nodes", "n[1-3]", "--config", str(env.config_path)],
                                 env=dict(env.env(), SLURMD_NODENAME=n), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for n in NODES]
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
    total = dataset_bytes(env)
    source_read = fs.stats()["bytes_read"]
    assert total <= source_read <= 1.1 * total, (source_read, total)  # three separate prefetches: 3x
    for n in NODES:
        assert verified(env, n)


def published(env: Env, node: str) -> None:
    """The node's report rebuilt and published, as its Prolog and Epilog do after a stage."""
    from dsstage.node import inventory
    inventory.refresh(env.store(node=node))


def test_any_nodes_ready_copy_serves_another_jobs_stage_and_the_source_serves_nothing(cluster, caplog):
    """Peers across jobs: n1 staged the version for one job; n2, in a one-node job of its own,
    fetches every file from n1 (its published report shows the copy ready), verifies each,
    and the source serves nothing. A holder that evicted the copy since its report is given up
    at once (not after peers.wait) and the source serves what it would have."""
    env, fs, peers = cluster
    stage(env, "n1", "1000", "")
    published(env, "n1")
    peers.start("n1")
    fs.reset()
    caplog.set_level(logging.INFO, logger="dsstage")
    r = stage(env, "n2", "1001", "")
    assert r.action == "staged" and r.peer_files == FILES and r.transferred_files == 0, r  # type: ignore[attr-defined]
    assert fs.stats()["bytes_read"] == 0 and verified(env, "n2")
    assert any("from peers (n1)" in m for m in caplog.messages), caplog.messages
    # n1 evicts its copy; its published report still says ready: n3 asks it, finds nothing, goes on
    from dsstage.node import eviction
    store1 = env.store(node="n1")
    store1.release_job("1000")
    eviction.evict(store1, "shared")
    env.extra["peers"]["wait"] = 60
    env.write()
    published(env, "n2")  # n2 is a holder too now: stopped, so that only n1 is asked
    os.unlink(os.path.join(str(env.state), "nodes", "n2.json"))
    fs.reset()
    t = time.monotonic()
    r = stage(env, "n3", "1002", "")
    took = time.monotonic() - t
    assert r.action == "staged" and r.peer_files == 0 and r.transferred_files == FILES, r  # type: ignore[attr-defined]
    assert took < 30, took  # given up at once, not after peers.wait (60 s)
    assert fs.stats()["bytes_read"] == dataset_bytes(env) and verified(env, "n3")
    assert any("peer n1: it no longer holds the version" in m for m in caplog.messages), caplog.messages


def test_a_cold_stage_reads_the_reports_of_the_holders_the_snapshot_lists_not_every_nodes(cluster, monkeypatch):
    """Issue 53: a stage looking for holders read every node's report (a metadata operation per
    node on the shared filesystem, per cold stage). With the poller's ``copies`` in a fresh
    snapshot it reads only the listed holders' reports: n2 reads n1's alone and fetches from
    it; a snapshot that lists no holder of the version makes n3 read no holder's report (the
    source, or a claimer, serves it); without ``copies`` every report is read, as before."""
    from dsstage.node import report
    from dsstage.policy import demand
    env, fs, peers = cluster
    stage(env, "n1", "1100", "")
    published(env, "n1")
    peers.start("n1")
    vid = staging.version_id(env.store(node="n1").current("shared"))
    for other in ("n7", "n8"):  # reports of nodes that hold nothing of it
        Path(report.published_path(str(env.state), other)).write_text(
            json.dumps({"node": other, "time": time.time(), "copies": []}))
    read: list[str] = []
    real = report.untrusted.read_json_dated

    def counting(path, *a, **k):
        if os.sep + report.NODES + os.sep in str(path):
            read.append(os.path.basename(str(path)))
        return real(path, *a, **k)
    monkeypatch.setattr(report.untrusted, "read_json_dated", counting)
    demand.write(str(env.state), demand.build((), time.time(), copies={"shared": {vid: "n1"}}))
    r = stage(env, "n2", "1101", "")
    assert r.peer_files == FILES and r.transferred_files == 0, r  # type: ignore[attr-defined]
    assert "n1.json" in read and not {"n7.json", "n8.json"} & set(read), read
    demand.write(str(env.state), demand.build((), time.time(), copies={"shared": {"0" * 16: "n1"}}))
    read.clear()
    staging.from_whom(env.store(node="n3"), "shared", env.store(node="n3").current("shared"))
    assert not {"n7.json", "n8.json"} & set(read), read  # (n1's is read for its claim: dsstage.node.stagers)
    demand.write(str(env.state), demand.build((), time.time()))
    read.clear()
    staging.from_whom(env.store(node="n3"), "shared", env.store(node="n3").current("shared"))
    assert {"n1.json", "n7.json", "n8.json"} <= set(read), read


def test_one_node_jobs_that_start_at_once_on_cold_nodes_read_the_source_once(env: Env, tmp_path: Path, caplog):
    """The first wave of an array: three one-node jobs of their own start together on three
    cold nodes. The first to get there claims the version (dsstage.node.stagers) and reads it
    from the source; the two others fetch it from that node as its files land, verified. The
    source serves the dataset once, not three times."""
    from dsstage.config import catalog
    with peered(env, tmp_path, "wave", options="rate=3000000") as (_backing, fs, daemons):
        for n in NODES:
            daemons.start(n)
        caplog.set_level(logging.INFO, logger="dsstage")
        results = on_every_node(lambda node: staging.stage(env.store(node=node), "wave",
                                                           staging.StageRequest(user=catalog.User.lookup(0),
                                                                                job_id=f"30{node[-1]}", nodes="")))
        total = dataset_bytes(env)
        assert fs.stats()["bytes_read"] <= 1.1 * total, (fs.stats()["bytes_read"], total)
        assert sorted(r.transferred_files for r in results.values()) == [0, 0, FILES], results
        for n in NODES:
            assert results[n].peer_files + results[n].transferred_files == FILES, results[n]
            assert verifying.verify(env.store(node=n), "wave", full=True).ok
        # the claim stays with the node that read the source: it holds the copy now
        [claim] = [p for p in (env.state / "staging").iterdir() if not p.name.startswith(".")]  # (.clock.*)
        assert json.loads(claim.read_text())["node"] == next(n for n, r in results.items() if r.transferred_files)


@pytest.mark.parametrize("with_peers", [True, False])
def test_replicas_of_a_shard_share_its_transfer_through_the_peers(env: Env, tmp_path: Path, with_peers: bool):
    """A dataset of 2 shards for a 3-node job: one shard is on two nodes (replicas). With
    peers, those two share its transfer (one reads part of it from the other) and the source
    serves the dataset about once; without, it serves that shard twice."""
    from dsstage.config import catalog
    from dsstage.hooks import shardjob
    # uncached: two nodes reading one shard through one mount never share a page of it, as
    # two NFS clients would not
    with peered(env, tmp_path, "twin", with_peers, "uncached", shards=2) as (backing, fs, daemons):
        for n in NODES if with_peers else ():
            daemons.start(n)
        results = on_every_node(lambda node: shardjob.stage(
            shardjob.Job("720", node, "n[1-3]", 0, 0), env.store(node=node), "twin", {}, catalog.User.lookup(0), None))
        source_read = fs.stats()["bytes_read"]
    total = dataset_bytes(env)
    shards = {n: dict(results[n].exports)["SHARDS"] for n in NODES}  # type: ignore[attr-defined]
    assert sorted(shards.values()) in (["0", "0", "1"], ["0", "1", "1"]), shards
    if with_peers:
        assert total <= source_read <= 1.1 * total, (source_read, total)
    else:
        assert source_read >= 1.3 * total, (source_read, total)  # the replicated shard twice
    for n in NODES:
        view = Path(results[n].path)  # type: ignore[attr-defined]
        listed = Path(dict(results[n].exports)["FILES"]).read_text().splitlines()  # type: ignore[attr-defined]
        assert all((backing / os.path.relpath(p, view)).read_bytes() == Path(p).read_bytes() for p in listed)
