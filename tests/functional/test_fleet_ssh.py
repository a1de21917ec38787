"""dsstage.cluster.fleet against a real OpenSSH server on 127.0.0.1 (key auth, a non-default port).

The remote "dsstage" is a small Python script written into the test's directory: it answers
with its argv as JSON, sends progress lines, fails, or hangs, as its first argument says.
Every node name maps to 127.0.0.1 (or to 127.0.0.2, where nothing listens).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from dsstage.cluster import fleet, fleet_view
from dsstage.cluster import ssh as cluster_ssh
from dsstage.config.model import Fleet

REMOTE = """\
#!{python}
import json, os, sys, time
args = sys.argv[1:]
node = args[args.index("--node") + 1]
verb = args[args.index("--node") + 2]
marks = {marks!r}
open(os.path.join(marks, node + ".pid"), "w").write(str(os.getpid()))
start = time.time()
if verb == "echo":
    for done in (0, 512, 1024):
        print(json.dumps({{"progress": {{"phase": "staging", "done": done, "total": 1024}}}}), file=sys.stderr,
              flush=True)
    print("dsstage: a message for a human", file=sys.stderr, flush=True)
    try:
        time.sleep(float(args[-1]))  # "echo ... 0.3": take that long
    except ValueError:
        pass
    print(json.dumps({{"argv": args, "start": start, "end": time.time()}}))
elif verb == "fail":
    print("dsstage: error: unknown dataset 'x' (did you mean 'y'?)", file=sys.stderr)
    sys.exit(2)
elif verb == "hang":
    while True:  # like a long staging: progress every tenth of a second, no result
        print(json.dumps({{"progress": {{"phase": "staging", "done": 1, "total": 2}}}}), file=sys.stderr,
              flush=True)
        time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the fleet tests log in as root to a test sshd: run them as root (packaging/run-tests)")
    if not (shutil.which("sshd") or os.path.exists("/usr/sbin/sshd")) or not shutil.which("ssh-keygen"):
        pytest.fail("sshd or ssh-keygen is missing: install openssh-server and openssh-client "
                    "(packaging/run-tests does)")
    from servers import SshServer
    server = SshServer(tmp_path_factory.mktemp("fleet") / "sshd")
    yield server
    server.stop()


@pytest.fixture
def setup(sshd, tmp_path):
    """(conf, host_keys, marks): a Fleet that reaches the test sshd and runs the fake dsstage."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "remote-dsstage"
    script.write_text(REMOTE.format(python=sys.executable, marks=str(marks)))
    script.chmod(0o755)
    known = tmp_path / "known_hosts"
    known.write_text(sshd.known_hosts_line + "\n")
    conf = Fleet(port=sshd.port, key=str(sshd.key), known_hosts=str(known), connect_timeout=5, timeout=30,
                 command=(str(script),))
    # only the test's known_hosts: root's own files must not decide these tests
    return conf, cluster_ssh.load_host_keys(conf, system_files=()), marks


def run(conf, targets, argv_of, **kw):
    kw.setdefault("host_keys", cluster_ssh.load_host_keys(conf, system_files=()))
    return cluster_ssh.run(conf, targets, argv_of, **kw)


def test_nodes_in_parallel_each_with_its_name(setup):
    conf, keys, _marks = setup
    conf = replace(conf, parallel=2)
    nodes = ["n1", "n2", "n3", "n4"]
    progress: dict[str, list[dict]] = {n: [] for n in nodes}
    done: list[str] = []
    lock = threading.Lock()

    def on_progress(node, p):
        with lock:
            progress[node].append(p)

    answers = cluster_ssh.run(conf, {n: "127.0.0.1" for n in nodes}, lambda node: ["echo", "--json", "0.3"],
                        on_progress=on_progress, on_done=lambda a: done.append(a.node), host_keys=keys)
    assert list(answers) == nodes and sorted(done) == nodes
    for node, a in answers.items():
        assert a.ok and a.exit_code == 0 and a.error == "" and a.address == "127.0.0.1", a
        assert a.result["argv"] == ["--node", node, "echo", "--json", "0.3"]
        assert a.stderr == "dsstage: a message for a human"  # progress lines are not kept
        assert progress[node] == [{"phase": "connecting"}, {"phase": "running"},
                                  *[{"phase": "staging", "done": d, "total": 1024} for d in (0, 512, 1024)]]
    spans = [(a.result["start"], a.result["end"]) for a in answers.values()]
    at_once = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert at_once == 2  # in parallel, and never more than fleet.parallel
    assert fleet.exit_code(answers) == 0


def test_arguments_arrive_as_one_argv_element_each(setup):
    conf, keys, marks = setup
    tricky = ["it's a \"test\"", "$HOME `id` $(touch pwned); echo x", "*", "", " lead", "back\\slash", "é ü"]
    answers = cluster_ssh.run(conf, {"n1": "127.0.0.1"}, lambda node: ["echo", *tricky], host_keys=keys)
    assert answers["n1"].ok, answers["n1"]
    assert answers["n1"].result["argv"] == ["--node", "n1", "echo", *tricky]
    assert not any(Path(p).exists() for p in ("pwned", "/root/pwned", marks / "pwned"))


def test_unreachable_node_while_others_answer(setup):
    conf, keys, _marks = setup
    answers = cluster_ssh.run(conf, {"n1": "127.0.0.1", "n2": "127.0.0.2", "n3": "127.0.0.1"},
                        lambda node: ["echo"], host_keys=keys)
    assert answers["n1"].ok and answers["n3"].ok
    assert not answers["n2"].ok and answers["n2"].error == "unreachable: connection refused"
    assert answers["n2"].exit_code is None and answers["n2"].result is None
    assert fleet.exit_code(answers) == 1
    assert fleet_view.summary_line(answers) == "3 nodes: 2 ok, 1 failed (n2: unreachable: connection refused)"
    rows = fleet_view.fold_rows(fleet_view.summary_rows(answers, lambda r: "echoed"))
    assert [r[:2] for r in rows] == [("n[1,3]", "ok"), ("n2", "failed")]


def test_unknown_host_key_is_refused_and_the_hint_works(setup, tmp_path):
    conf, _keys, marks = setup
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    conf = replace(conf, known_hosts=str(empty))
    answers = run(conf, {"n1": "127.0.0.1"}, lambda node: ["echo"])
    a = answers["n1"]
    hint = f"ssh-keyscan -p {conf.port} 127.0.0.1 >> {empty}"
    assert not a.ok and a.error.startswith(
        f"host key of n1 (127.0.0.1:{conf.port}) is not in known_hosts: add it with {hint}"), a.error
    assert not (marks / "n1.pid").exists()  # nothing ran
    # what the message says to do makes it work
    subprocess.run(hint, shell=True, check=True, stderr=subprocess.DEVNULL, timeout=30)
    assert run(conf, {"n1": "127.0.0.1"}, lambda node: ["echo"])["n1"].ok


def test_changed_host_key_is_refused(setup, tmp_path):
    conf, _keys, marks = setup
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    kind, blob = (tmp_path / "other.pub").read_text().split()[:2]
    known = tmp_path / "stale_known_hosts"
    known.write_text(f"[127.0.0.1]:{conf.port} {kind} {blob}\n")
    a = run(replace(conf, known_hosts=str(known)), {"n1": "127.0.0.1"}, lambda node: ["echo"])["n1"]
    assert not a.ok and a.error.startswith(f"host key of n1 (127.0.0.1:{conf.port}) does not match known_hosts")
    assert not (marks / "n1.pid").exists()


def test_host_key_listed_under_the_node_name(setup, sshd, tmp_path):
    """known_hosts written by ``ssh n1`` names the node; Slurm gives its address."""
    conf, _keys, _marks = setup
    known = tmp_path / "by_name"
    known.write_text(sshd.known_hosts_line.replace("[127.0.0.1]", "[n1]") + "\n")
    answers = run(replace(conf, known_hosts=str(known)), {"n1": "127.0.0.1", "n2": "127.0.0.1"},
                  lambda node: ["echo"])
    assert answers["n1"].ok
    assert "is not in known_hosts" in answers["n2"].error  # n1's key does not vouch for n2


def test_wrong_key_is_an_authentication_failure(setup, tmp_path):
    conf, keys, _marks = setup
    other = tmp_path / "not_authorized"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    a = cluster_ssh.run(replace(conf, key=str(other)), {"n1": "127.0.0.1"}, lambda node: ["echo"], host_keys=keys)["n1"]
    assert not a.ok and a.error.startswith(f"authentication failed for root@127.0.0.1:{conf.port} with the key {other}")


def test_command_timeout_closes_the_session(setup):
    conf, keys, marks = setup
    conf = replace(conf, timeout=1.0)
    seen: list[dict] = []
    t0 = time.monotonic()
    a = cluster_ssh.run(conf, {"n1": "127.0.0.1"}, lambda node: ["hang"], host_keys=keys,
                  on_progress=lambda node, p: seen.append(p))["n1"]
    assert time.monotonic() - t0 < 5
    assert not a.ok and a.exit_code is None and a.error.startswith("command timed out after 1s"), a
    assert 1.0 <= a.seconds < 5 and {"phase": "staging", "done": 1, "total": 2} in seen
    # the remote command does not outlive its session: it dies at its next write
    pid = int((marks / "n1.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the remote command still runs after its session was closed"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_remote_failure_is_reported_with_its_message(setup):
    conf, keys, _marks = setup
    a = cluster_ssh.run(conf, {"n1": "127.0.0.1"}, lambda node: ["fail", "x"], host_keys=keys)["n1"]
    assert not a.ok and a.exit_code == 2 and a.result is None
    assert a.error == "remote exit 2: dsstage: error: unknown dataset 'x' (did you mean 'y'?)"
    assert a.stderr.endswith("dsstage: error: unknown dataset 'x' (did you mean 'y'?)")


def test_missing_remote_command(setup):
    conf, keys, _marks = setup
    conf = replace(conf, command=("/nonexistent/dsstage",))
    a = cluster_ssh.run(conf, {"n1": "127.0.0.1"}, lambda node: ["echo"], host_keys=keys)["n1"]
    assert not a.ok and a.exit_code == 127 and a.error.startswith("remote exit 127: ")
    assert "/nonexistent/dsstage" in a.error and "check fleet.command" in a.error


def test_silent_server_times_out_connecting():
    """A port that accepts connections but never says anything (a hung sshd)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        conf = Fleet(port=server.getsockname()[1], connect_timeout=0.5)
        t0 = time.monotonic()
        a = cluster_ssh.run(conf, {"n1": "127.0.0.1"}, lambda node: ["echo"],
                      host_keys=cluster_ssh.load_host_keys(conf, system_files=()))["n1"]
    assert time.monotonic() - t0 < 3
    assert not a.ok and a.error.startswith("timed out after 0.5s"), a.error


SINFO = """\
#!/bin/sh
echo "$@" > {log}
echo "SINFO_FORMAT=$SINFO_FORMAT" >> {log}
[ -e {fail} ] && {{ echo "sinfo: error: slurmctld is down" >&2; exit 1; }}
printf 'n1|10.0.0.1|idle\\nn2|10.0.0.2|idle\\nn1|10.0.0.1|idle\\n'
"""


def test_addresses_ask_sinfo_once(tmp_path, monkeypatch):
    log = tmp_path / "sinfo.log"
    (tmp_path / "sinfo").write_text(SINFO.format(log=log, fail=tmp_path / "fail"))
    (tmp_path / "sinfo").chmod(0o755)
    monkeypatch.setenv("SINFO_FORMAT", "%P")  # a user's setting must not change what is parsed
    assert fleet.addresses(["n1", "n2", "n3"], str(tmp_path)) == {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "n3"}
    assert log.read_text().splitlines() == ["-h -a -N -o %N|%o|%T|%f|%b|%R", "SINFO_FORMAT="]
    (tmp_path / "fail").touch()
    assert fleet.addresses(["n1", "n2"], str(tmp_path)) == {"n1": "n1", "n2": "n2"}
    assert fleet.addresses(["n1"], str(tmp_path / "nowhere")) == {"n1": "n1"}
