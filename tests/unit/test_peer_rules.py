"""The decisions of the fan-out between a job's nodes (dsstage.transfer.peers): who stages with whom,
who copies what from the source, the daemon's configuration, the secret's checks, the
configuration section, and what an rsync run against a peer means."""

import os

import pytest
from dsstage.config import load, model
from dsstage.config.manifest import Entry
from dsstage.errors import ConfigError
from dsstage.slurm.conf import check_host
from dsstage.transfer import peerd, peers
from dsstage.transfer.rsync import TransferStats
from dsstage.transfer.transport import Copied
from test_config import base, error


class NoArea:
    """A staging area where nothing ever lands (peers.Landing)."""

    path = "/nonexistent"
    deadline = None

    def present(self, todo):
        return []

    def check(self, got):
        return []

    def remove(self, bad):
        return None

    def copying(self):
        return None


def entries(n: int) -> list[Entry]:
    return [Entry(path=f"d{i % 3}/f{i:03d}", size=1000 * (i % 7 + 1), mtime_ns=0, hash=f"{i:064x}")
            for i in range(n)]


def test_plan_needs_peers_on_two_nodes_and_this_node_among_them():
    on = model.Peers(enabled=True)
    assert peers.plan(model.Peers(), ["n1", "n2"], "n1") == (None, "peers.enabled is off")
    assert peers.plan(on, ["n1"], "n1") == (None, "the job has one node")
    group, why = peers.plan(on, ["n3", "n1", "n2", "n1"], "n2")
    assert group == ("n1", "n2", "n3") and why == "staging with 2 peer(s)"
    group, why = peers.plan(on, ["n1", "n2"], "gpu7")
    assert group is None and "not in the job's node list" in why


def test_shares_are_the_same_everywhere_disjoint_complete_and_balanced():
    es = entries(100)
    nodes = ("n1", "n2", "n3")
    a = peers.shares(es, nodes)
    assert a == peers.shares(list(reversed(es)), nodes)  # the manifest's order does not matter
    paths = [e.path for n in nodes for e in a[n]]
    assert sorted(paths) == sorted(e.path for e in es) and len(set(paths)) == len(es)
    sizes = [sum(e.size for e in a[n]) for n in nodes]
    assert max(sizes) - min(sizes) <= 7000  # at most about one file apart
    few = peers.shares(entries(2), nodes)
    assert [len(few[n]) for n in nodes] == [1, 1, 0]


def test_others_start_after_this_node():
    g = peers.Group(nodes=("n1", "n2", "n3", "n4"), me="n3", conf=model.Peers(enabled=True), secret="x")
    assert g.others() == ["n4", "n1", "n2"]
    assert g.url("n4", "nvme-staging", "ds.abc") == "rsync://dsstage@n4:873/nvme-staging/ds.abc/"
    g = peers.Group(nodes=("n1", "n2"), me="n1", conf=model.Peers(enabled=True, hosts={"n2": "10.0.0.2:9000"}),
                    secret="x")
    assert g.url("n2", "nvme-datasets", "ds/abc") == "rsync://dsstage@10.0.0.2:9000/nvme-datasets/ds/abc/"


def test_the_daemon_serves_only_the_tiers_data_read_only_to_the_secret():
    c = load.from_dict(base(peers={"enabled": True}))
    text = peerd.daemon_config(c, "n7", "/run/x/secrets", ["10.0.0.7", "10.1.0.0/16"], "/run/x/rsyncd.lock")
    for line in ("hosts allow = 10.0.0.7 10.1.0.0/16", "hosts deny = *", "max connections = 64",
                 "lock file = /run/x/rsyncd.lock", "read only = yes", "list = no", "auth users = dsstage:ro",
                 "secrets file = /run/x/secrets",
                 "strict modes = yes", "use chroot = yes", "[nvme-staging]", "path = /local/nvme/n7/staging",
                 "[nvme-datasets]", "path = /local/nvme/n7/datasets", "[ram-staging]",
                 "path = /dev/shm/dsstage/datasets"):
        assert line in text.splitlines(), line
    assert "leases" not in text and "locks" not in text
    with pytest.raises(ConfigError, match="would accept anyone: set peers.allow"):
        peerd.daemon_config(c, "n7", "/run/x/secrets", [])


def test_whom_a_daemon_allows_and_where_it_binds(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("x" * 32 + "\n")
    secret.chmod(0o600)
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    slurm_addrs = {"n1": "10.0.0.1", "n2": "10.0.0.2", "n7": "10.0.0.7"}
    conf = model.Peers(enabled=True, hosts={"n2": "192.168.9.2:900"})
    assert peerd.allowed(conf, slurm_addrs) == ["10.0.0.1", "10.0.0.7", "192.168.9.2"]
    assert peerd.allowed(model.Peers(allow=("10.0.0.0/8",)), slurm_addrs) == ["10.0.0.0/8"]
    if os.geteuid() != 0:
        return  # the work directory must be root's
    c = load.from_dict(base(peers={"enabled": True, "secret_file": str(secret)}))
    argv = peerd.serve_argv(c, "n7", str(work), slurm_addrs)
    assert "--address=10.0.0.7" in argv and "--port=873" in argv  # its own address, not every interface
    assert "hosts allow = 10.0.0.1 10.0.0.2 10.0.0.7" in (work / "rsyncd.conf").read_text()
    assert oct((work / "secrets").stat().st_mode & 0o777) == "0o600"


def test_peers_allow_and_max_connections_are_checked():
    p = load.from_dict(base(peers={"allow": ["10.1.0.0/16", "gpu01"], "max_connections": 8})).peers
    assert (p.allow, p.max_connections) == (("10.1.0.0/16", "gpu01"), 8)
    assert "peers.allow: must be a list" in error(base(peers={"allow": "10.0.0.0/8"}))
    assert "peers.allow: must be a list" in error(base(peers={"allow": ["a b"]}))
    assert "peers.max_connections: " in error(base(peers={"max_connections": 0}))


def test_the_secret_must_be_roots_alone(tmp_path):
    path = tmp_path / "secret"
    with pytest.raises(ConfigError, match="cannot open"):
        peerd.read_secret(str(path))
    path.write_text("hunter2\nignored\n")
    path.chmod(0o600)
    if os.geteuid() == 0:
        with pytest.raises(ConfigError, match="give at least 32 random"):
            peerd.read_secret(str(path))
        path.write_text("x" * 32 + "\nignored\n")
        assert peerd.read_secret(str(path)) == "x" * 32
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 0600"):
        peerd.read_secret(str(path))
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(ConfigError, match="cannot open"):
        peerd.read_secret(str(link))
    if os.geteuid() == 0:
        empty = tmp_path / "empty"
        empty.write_text("\n")
        empty.chmod(0o600)
        with pytest.raises(ConfigError, match="first line must be the secret"):
            peerd.read_secret(str(empty))


def test_peers_section_defaults_and_errors():
    p = load.from_dict(base()).peers
    assert (p.enabled, p.port, p.secret_file, p.wait, p.timeout, p.parallel) == \
        (False, 873, "/etc/dsstage/peers.secret", 120.0, 60.0, 8)
    p = load.from_dict(base(peers={"enabled": True, "port": 9000, "hosts": {"n1": "10.1.0.1"},
                                     "wait": "5m", "parallel": 4})).peers
    assert (p.enabled, p.port, dict(p.hosts), p.wait, p.parallel) == (True, 9000, {"n1": "10.1.0.1"}, 300.0, 4)
    assert "peers.enabled: 'yes' is not true or false" in error(base(peers={"enabled": "yes"}))
    assert "peers.port: 70000 is not a TCP port" in error(base(peers={"port": 70000}))
    assert "peers.hosts.n1: 'a b' is not a host name" in error(base(peers={"hosts": {"n1": "a b"}}))
    assert "peers.hosts.n1: 'h:0' is not a host name" in error(base(peers={"hosts": {"n1": "h:0"}}))
    assert "peers.parallel: " in error(base(peers={"parallel": 0}))
    assert "peers.secrets: unknown key; did you mean 'secret_file'?" in error(base(peers={"secrets": "/x"}))


@pytest.mark.parametrize("rc,stderr,failure,missing", [
    (0, "", "", False),
    # files or the version not there (yet): decided by the exit code, whatever the text says
    (23, 'rsync: [sender] link_stat "/x" (in nvme-staging) failed: No such file or directory (2)', "", True),
    (3, 'rsync: [sender] change_dir "/ds.abc/" (in nvme-staging) failed: No such file or directory (2)', "", True),
    (3, "", "", True),
    (23, 'rsync: [sender] change_dir "/ds/abc/" (in nvme-datasets) failed: No such file or directory (2)', "", True),
    (23, "rsync: keine solche Datei (in einer anderen Sprache)", "", True),
    (5, "@ERROR: auth failed on module nvme-staging", "peers.secret_file must be the same", False),
    (5, "", "its daemon refused this node", False),
    (10, "rsync: failed to connect to n2 (127.0.0.1): Connection refused (111)", "rsync exit 10", False),
    (None, "timed out", "rsync exit None", False),
])
def test_what_a_round_against_a_peer_means(rc, stderr, failure, missing):
    r = peers.Round(rc, stderr)
    assert (failure in r.failure()) if failure else r.failure() == ""
    assert r.missing(progressed=False) is missing
    assert r.missing(progressed=True) is (rc == 3)  # files came: the place is right


def test_a_refusing_daemon_is_waited_out_a_few_times_then_given_up():
    busy = peers.Round(5, "@ERROR: max connections (64) reached -- try again later")
    assert peers.after_round(busy, progressed=False, idle_for=1, wait=120, poll=0.5, refused=1).action == "wait"
    assert peers.after_round(busy, progressed=False, idle_for=1, wait=120, poll=0.5, refused=2).action == "wait"
    gone = peers.after_round(busy, progressed=False, idle_for=1, wait=120, poll=0.5, refused=3)
    assert gone.action == "give up" and "3 times in a row" in gone.reason


def test_check_config_names_a_missing_secret_only_when_peers_are_on(tmp_path):
    slurm_conf = tmp_path / "slurm.conf"
    slurm_conf.write_text("PrologEpilogTimeout=900\n")
    off = load.from_dict(base(slurm_bin=str(tmp_path)))
    assert not [p for p in check_host(off, str(slurm_conf))[1] if p.key.startswith("peers")]
    on = load.from_dict(base(slurm_bin=str(tmp_path),
                               peers={"enabled": True, "secret_file": str(tmp_path / "none")}))
    problems = [p for p in check_host(on, str(slurm_conf))[1] if p.key == "peers.secret_file"]
    assert [p.level for p in problems] == ["error"] and "stages from the source alone" in problems[0].message
    high = load.from_dict(base(slurm_bin=str(tmp_path), peers={"enabled": True, "hosts": {"n1": "h:8873"}}))
    assert [p.level for p in check_host(high, str(slurm_conf))[1] if p.key == "peers.port"] == ["note"]
    assert not [p for p in check_host(on, str(slurm_conf))[1] if p.key == "peers.port"]


MISSING = 'rsync: [sender] change_dir "/ds.abc/" (in nvme-staging) failed: No such file or directory (2)'


@pytest.mark.parametrize("rnd,progressed,idle_for,expected", [
    (peers.Round(5, "@ERROR: auth failed on module nvme-staging"), True, 0.0, ("wait", False)),  # a first refusal
    (peers.Round(10, "Connection refused"), True, 0.0, ("give up", False)),
    (peers.Round(0, ""), True, 0.0, ("again", False)),
    (peers.Round(3, MISSING), True, 0.0, ("again", True)),  # published meanwhile: the other place next
    (peers.Round(3, MISSING), False, 1.0, ("probe", True)),  # not here: the other place, at once
    (peers.Round(23, ""), False, 1.0, ("probe", True)),  # nothing came: maybe published, the other place at once
    (peers.Round(23, ""), True, 1.0, ("again", False)),
    (peers.Round(23, ""), False, 121.0, ("give up", False)),
])
def test_after_a_round_against_a_peer(rnd, progressed, idle_for, expected):
    step = peers.after_round(rnd, progressed=progressed, idle_for=idle_for, wait=120.0, poll=0.5)
    assert (step.action, step.move) == expected and step.reason
    assert step.delay == (0.5 if step.action == "wait" else 0.0)
    if step.action == "give up" and rnd.rc == 23:
        assert step.reason == "no peer of the job added anything for 120s"


@pytest.mark.parametrize("rnd", [peers.Round(3, MISSING), peers.Round(23, "")])
def test_after_a_probe_that_found_nothing_either_the_fetch_waits_back_at_the_first_place(rnd):
    step = peers.after_round(rnd, progressed=False, idle_for=1.0, wait=120.0, poll=0.5, probed=True)
    assert (step.action, step.move, step.delay) == ("wait", True, 0.5)


def test_a_peer_still_staging_is_polled_where_it_stages_every_time(monkeypatch):
    """The peer stages: each poll at its staging area finds nothing new (rsync exit 23), and
    the published place does not exist yet (exit 3). Every wait is followed by a round at
    the staging area; the published place is asked only as a probe, right after."""
    import threading
    now = [0.0]
    lock = threading.Lock()
    asked: list[tuple[float, str]] = []

    def sleep(seconds: float) -> None:
        with lock:
            now[0] += seconds

    def fetch(group, node, module, rel, *a):
        asked.append((now[0], module))
        return peers.Round(23, "") if module.endswith("-staging") else peers.Round(3, MISSING)
    monkeypatch.setattr(peers, "fetch_round", fetch)
    group = peers.Group(nodes=("n1", "n2"), me="n1", conf=model.Peers(enabled=True, wait=10.0), secret="s")
    entries = [Entry(f"f{i}", 10, 0, "0" * 64) for i in range(4)]
    peers.cooperate(group, peers.Where("ds", "a" * 64, "nvme"), NoArea(), entries,
                    lambda todo: Copied(TransferStats(files=len(todo))), clock=lambda: now[0], sleep=sleep)
    modules = [m for _t, m in asked]
    assert modules[:6] == ["nvme-staging", "nvme-datasets"] * 3
    # after every wait the staging area comes first: the probe never takes the poll's turn
    for (t0, m0), (t1, m1) in zip(asked, asked[1:]):
        if t1 > t0:
            assert m1 == "nvme-staging", asked


def test_fallbacks_skip_the_given_up_and_the_peer_itself():
    g = peers.Group(conf=model.Peers(enabled=True), nodes=("n1", "n2", "n3", "n4"), me="n1", secret="s" * 32)
    assert peers.fallbacks(g, "n2", {"n2", "n4"}) == ["n3"]
    assert peers.fallbacks(g, "n3", set()) == ["n2", "n4"]


def test_peers_that_lack_the_version_cost_the_job_one_wait_and_linear_rounds(monkeypatch):
    """16 peers, none of which has the version (their Prologs failed), fetched one at a time:
    the job waits about peers.wait once, not once per peer, and asks O(N) rounds, not O(N^2)."""
    import threading
    now = [0.0]
    lock = threading.Lock()

    def clock() -> float:
        with lock:
            return now[0]

    def sleep(seconds: float) -> None:
        with lock:
            now[0] += seconds
    rounds = []
    monkeypatch.setattr(peers, "fetch_round", lambda group, node, *a: rounds.append(node) or peers.Round(3, MISSING))
    nodes = tuple(f"n{i:02d}" for i in range(17))
    group = peers.Group(nodes=nodes, me="n00", conf=model.Peers(enabled=True, wait=10.0, parallel=1), secret="s")
    entries = [Entry(f"f{i:03d}", 10, 0, "0" * 64) for i in range(170)]
    from_source: list[str] = []

    def source(todo):
        from_source.extend(e.path for e in todo)
        return Copied(TransferStats(files=len(todo)))
    out = peers.cooperate(group, peers.Where("ds", "a" * 64, "nvme"), NoArea(), entries, source, clock=clock,
                          sleep=sleep)
    assert sorted(from_source) == [e.path for e in entries]  # every file still arrives, from the source
    assert len(out.given_up) == 16
    assert now[0] <= 2 * 10.0  # one wait for the job (before: about 10 s for each of the 16 peers)
    assert len(rounds) <= 16 + 16  # the first peer's polls, then one round each (before: hundreds)


def test_a_source_that_is_gone_ends_the_stage_at_once_even_with_an_empty_share_of_its_own(monkeypatch):
    """A dataset of one file over two nodes: this node's share is empty, its peer's Prolog
    fails on the same gone source. The source is asked anyway, and its error ends the fill
    without waiting peers.wait for a peer that will never serve (seen: 120 s on Slurm 24.11)."""
    import time

    from dsstage.errors import SourceError
    monkeypatch.setattr(peers, "fetch_round", lambda group, node, *a: peers.Round(3, MISSING))
    entries = [Entry("only", 10, 0, "0" * 64)]
    empty = next(n for n, share in peers.shares(entries, ("n1", "n2")).items() if not share)
    group = peers.Group(nodes=("n1", "n2"), me=empty, conf=model.Peers(enabled=True, wait=120.0), secret="s")
    asked: list[list[str]] = []

    def source(todo):
        asked.append([e.path for e in todo])
        raise SourceError("source /d is not reachable from this node")
    start = time.monotonic()
    with pytest.raises(SourceError):
        peers.cooperate(group, peers.Where("ds", "a" * 64, "nvme"), NoArea(), entries, source)
    assert asked == [[]]  # its own (empty) share asked, not the peer's file after peers.wait
    assert time.monotonic() - start < 30  # the peer thread's wait is cut short (real time)


@pytest.mark.parametrize("rnd", [peers.Round(3, MISSING), peers.Round(23, "")])
def test_a_holder_with_the_version_in_neither_place_is_given_up_at_once(rnd):
    """A holder's report showed the version ready; it is not staging it, so nothing in either
    place means it was evicted since: not waited for as a peer still staging is."""
    first = peers.after_round(rnd, progressed=False, idle_for=1.0, wait=120.0, poll=0.5, holder=True)
    assert first.action == "probe"
    step = peers.after_round(rnd, progressed=False, idle_for=1.0, wait=120.0, poll=0.5, probed=True, holder=True)
    assert step.action == "give up" and "no longer holds the version" in step.reason


def test_holders_outside_the_job_make_the_split_and_spread_over_the_stagers():
    conf = model.Peers(enabled=True, parallel=2)
    chosen = {me: peers.choose_holders(["h1", "h2", "h3", "h4", "n1"], ["n1", "n2"], me, 2) for me in ("n1", "n2")}
    assert all(len(c) == 2 and "n1" not in c for c in chosen.values())  # a node of the job is no holder
    assert peers.choose_holders(["h1", "h2"], ["n1"], "n1", 2) == peers.choose_holders(["h2", "h1"], ["n1"], "n1", 2)
    seen = {h for me in (f"x{i}" for i in range(20)) for h in peers.choose_holders(["h1", "h2", "h3", "h4"], [me],
                                                                                    me, 1)}
    assert len(seen) > 1  # twenty stagers do not all ask the same holder
    g = peers.Group(nodes=("n1",), me="n1", conf=conf, secret="x", holders=("h2", "h1"))
    assert g.others() == ["h2", "h1"] and g.split_among() == ("h2", "h1")
    assert peers.Group(nodes=("n1", "n2"), me="n1", conf=conf, secret="x").split_among() == ("n1", "n2")


def test_a_claim_to_read_a_version_from_the_source_stands_while_its_node_shows_the_stage():
    from dsstage.node.stagers import current
    limits = (900.0, 3600.0, 120.0)  # report.max_age, lock_timeout, peers.wait
    claim = {"node": "n1", "time": 1000.0}
    staging_row = {"node": "n1", "time": 1500.0, "copies": [{"dataset": "d", "version": "v", "state": "staging"}]}
    assert current(claim, {}, "d", "v", 1100.0, limits)  # within peers.wait: its report may lag
    assert current(claim, staging_row, "d", "v", 1600.0, limits)
    assert not current(claim, {**staging_row, "copies": []}, "d", "v", 1600.0, limits)  # it stopped
    assert not current(claim, {**staging_row, "node": "n2"}, "d", "v", 1600.0, limits)
    assert not current(claim, staging_row, "d", "v", 2500.0, limits)  # its report is stale
    assert not current(claim, {**staging_row, "time": 4700.0}, "d", "v", 4700.0, limits)  # past lock_timeout
    assert not current(None, staging_row, "d", "v", 1600.0, limits)
