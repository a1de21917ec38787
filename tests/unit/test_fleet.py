"""dsstage.cluster.fleet's pure parts: node lists, addresses, the remote command, answers, summaries."""

from __future__ import annotations

import errno
import io
import shlex
import socket

import paramiko
import pytest
from dsstage.cluster import fleet, fleet_view
from dsstage.cluster import ssh as cluster_ssh
from dsstage.cluster.fleet import Answer
from dsstage.config.model import Fleet
from dsstage.errors import ConfigError, DsstageError
from dsstage.slurm import records


def test_expand_hostlists():
    assert fleet.parse_nodes_arg("n[1-3,5],gpu01") == ["gpu01", "n1", "n2", "n3", "n5"]
    assert fleet.parse_nodes_arg(" c[08-10] ") == ["c08", "c09", "c10"]
    assert fleet.parse_nodes_arg("n1,n1") == ["n1"]


@pytest.mark.parametrize("bad", ["", "  ", "n[1-", "n[3-1]", "@gpus", "n[1-4]!n2", "n1&n2", "n;reboot",
                                 "n[1-200000]", "-oProxyCommand=x"])
def test_expand_refuses_what_is_no_node_list(bad):
    with pytest.raises(DsstageError) as exc:
        fleet.parse_nodes_arg(bad)
    assert "node" in str(exc.value)


@pytest.mark.parametrize("name", ["n1", "gpu-01.cluster", "rack1_n01", "A9"])
def test_node_names_accepted(name):
    assert fleet.check_node(name) == name


@pytest.mark.parametrize("name", ["", "-n1", ".n1", "n 1", "n1;id", "n1\n", "n/1", "n$(id)", "a" * 300])
def test_node_names_refused(name):
    with pytest.raises(DsstageError, match="is not a node name"):
        fleet.check_node(name)


def test_node_addresses_skip_what_is_no_host(caplog):
    nodes = records.parse_nodes("n1|10.0.0.1|idle\nn2|10.0.0.2|mixed\nn1|10.0.0.9|idle\nn10|n10-ib.cluster|down*\n"
                              "gpu01||idle\nn3|10.0.0.3 extra|idle\n\nn4|$(reboot)|idle\nn5 junk\n")
    assert fleet.node_addresses(nodes) == {"n1": "10.0.0.1", "n2": "10.0.0.2", "n10": "n10-ib.cluster",
                                           "gpu01": "gpu01"}
    assert "ignoring node" in caplog.text
    assert nodes["n10"].down == "down, not responding" and nodes["n2"].down == ""


def test_node_addresses_take_ipv6():
    assert fleet.node_addresses(records.parse_nodes("n1|fd00::1|idle\n")) == {"n1": "fd00::1"}


def test_addresses_without_slurm_are_the_names():
    assert fleet.addresses(["n1", "n2"], None) == {"n1": "n1", "n2": "n2"}
    with pytest.raises(DsstageError):
        fleet.addresses(["n1", "bad name"], None)


def test_remote_command_quotes_every_argument():
    cmd = fleet.remote_command(("/opt/dsstage/bin/dsstage", "--config", "/etc/ds s.yaml"), "n1",
                               ["warm", "x y", "it's", "$(reboot)", "a;b", "--json"])
    assert shlex.split(cmd) == ["/opt/dsstage/bin/dsstage", "--config", "/etc/ds s.yaml", "--node", "n1",
                                "warm", "x y", "it's", "$(reboot)", "a;b", "--json"]
    assert "$(reboot)" not in cmd.replace("'$(reboot)'", "")  # every occurrence is quoted


@pytest.mark.parametrize("arg", ["a\nb", "a\rb", "a\0b"])
def test_remote_command_refuses_line_breaks_and_nul(arg):
    with pytest.raises(DsstageError, match="cannot be passed over SSH"):
        fleet.remote_command(("dsstage",), "n1", ["verify", arg])


def test_remote_command_refuses_a_bad_node_and_an_empty_command():
    with pytest.raises(DsstageError):
        fleet.remote_command(("dsstage",), "n1 --all", [])
    with pytest.raises(ConfigError):
        fleet.remote_command((), "n1", [])


def test_parse_progress():
    assert fleet.parse_progress('{"progress": {"phase": "staging", "done": 1, "total": 2}}\n') == {
        "phase": "staging", "done": 1, "total": 2}
    for other in ("dsstage: error: no", '{"progress": 3}', '{"progress": {}, "x": 1}', "{not json progress",
                  '["progress"]'):
        assert fleet.parse_progress(other) is None


def test_progress_state_takes_only_sane_counts():
    assert fleet_view.progress_state({"phase": "staging", "done": 5, "total": 10}) == ("staging", 5, 10)
    assert fleet_view.progress_state({"phase": "hashing", "done": 50, "total": 10}) == ("hashing", 10, 10)
    assert fleet_view.progress_state({"done": -1, "total": 10}) == ("running", None, None)
    assert fleet_view.progress_state({"phase": "x", "done": True, "total": 10}) == ("x", None, None)
    assert fleet_view.progress_state({"phase": "\x1b[2Jevil\nline"}) == ("[2Jevil line", None, None)


def test_judge():
    assert fleet.judge(0, '{"a": 1}\n', []) == (True, {"a": 1}, "")
    # a login banner before the document
    assert fleet.judge(0, 'Welcome\n{"a": 1}\n', []) == (True, {"a": 1}, "")
    ok, result, error = fleet.judge(2, "", ["warning: x", "dsstage: error: unknown dataset 'x'", ""])
    assert not ok and result is None and error == "remote exit 2: dsstage: error: unknown dataset 'x'"
    assert fleet.judge(1, '{"error": "x"}', [])[1:] == ({"error": "x"}, "remote exit 1: no message")
    ok, _r, error = fleet.judge(0, "not json", ["usage: dsstage"])
    assert not ok and "printed no JSON" in error and error.endswith(": usage: dsstage")
    assert "killed by a signal" in fleet.judge(None, "", [])[2]
    error = fleet.judge(127, "", ["bash: line 1: dsstage: command not found"])[2]
    assert error.startswith("remote exit 127: bash: line 1: dsstage: command not found") and "fleet.command" in error


def test_one_line_drops_terminal_control():
    assert fleet.one_line("a\x1b]0;title\x07b\u202ec\n d") == "a]0;titlebc d"
    assert fleet.one_line("x" * 50, 10) == "xxxxxxx..."


CONF = Fleet(port=2222, connect_timeout=10, key="/etc/dsstage/fleet_key", known_hosts="/etc/dsstage/known_hosts")


def classify(exc: BaseException, phase: str = "connecting", conf: Fleet = CONF) -> str:
    return cluster_ssh.classify(exc, node="n3", address="10.0.0.3", conf=conf, phase=phase)


def test_classify_unreachable():
    refused = paramiko.ssh_exception.NoValidConnectionsError({("10.0.0.3", 2222): ConnectionRefusedError(
        errno.ECONNREFUSED, "Connection refused")})
    assert classify(refused) == "unreachable: connection refused"
    assert classify(ConnectionRefusedError(errno.ECONNREFUSED, "x")) == "unreachable: connection refused"
    no_route = paramiko.ssh_exception.NoValidConnectionsError({("10.0.0.3", 2222): OSError(
        errno.EHOSTUNREACH, "No route to host")})
    assert classify(no_route) == "unreachable: no route to host"
    assert classify(socket.gaierror(socket.EAI_NONAME, "Name or service not known")) == \
        "unreachable: cannot resolve 10.0.0.3: Name or service not known"
    assert classify(OSError(errno.ENETDOWN, "Network is down")) == "unreachable: Network is down"


def test_classify_timeouts():
    assert classify(socket.timeout("timed out")) == "timed out after 10s connecting"
    assert classify(TimeoutError()) == "timed out after 10s connecting"
    assert classify(paramiko.SSHException("No existing session")).startswith("timed out after 10s in the SSH handshake")
    assert classify(paramiko.AuthenticationException("Authentication timeout.")) == \
        "timed out after 10s authenticating as root@10.0.0.3:2222"
    banner = paramiko.SSHException("Error reading SSH protocol banner")
    assert classify(banner).startswith("no SSH banner from 10.0.0.3:2222 (is it an SSH server?)")


def test_classify_host_keys():
    key = paramiko.ECDSAKey.generate()
    msg = classify(cluster_ssh.UnknownHostKey("[10.0.0.3]:2222", key))
    assert msg.startswith("host key of n3 (10.0.0.3:2222) is not in known_hosts: add it with "
                          "ssh-keyscan -p 2222 10.0.0.3 >> /etc/dsstage/known_hosts")
    assert key.fingerprint in msg
    msg = classify(cluster_ssh.UnknownHostKey("10.0.0.3", key), conf=Fleet())
    assert "ssh-keyscan 10.0.0.3 >> ~/.ssh/known_hosts" in msg and "10.0.0.3:22" not in msg
    msg = classify(paramiko.BadHostKeyException("10.0.0.3", key, key))
    assert msg.startswith("host key of n3 (10.0.0.3:2222) does not match known_hosts")
    assert "ssh-keygen -R '[10.0.0.3]:2222'" in msg


def test_classify_authentication():
    msg = classify(paramiko.AuthenticationException("Authentication failed."))
    assert msg.startswith("authentication failed for root@10.0.0.3:2222 with the key /etc/dsstage/fleet_key")
    msg = classify(paramiko.BadAuthenticationType("Bad authentication type", ["password"]), conf=Fleet())
    assert "the SSH agent and ~/.ssh keys" in msg and "allows only: password" in msg


def test_classify_by_phase():
    assert classify(EOFError(), phase="running").startswith("connection lost while the command ran")
    assert classify(EOFError()) == "10.0.0.3:2222 closed the connection during the SSH handshake"
    assert classify(paramiko.SSHException("Negotiation failed.")) == "ssh: Negotiation failed."
    assert classify(KeyError("x")).startswith("internal error: KeyError")


def test_host_key_name():
    assert cluster_ssh.host_key_name("10.0.0.3", 22) == "10.0.0.3"
    assert cluster_ssh.host_key_name("10.0.0.3", 2222) == "[10.0.0.3]:2222"


def test_load_host_keys_requires_the_configured_file(tmp_path):
    with pytest.raises(ConfigError, match="fleet.known_hosts .*cannot read"):
        cluster_ssh.load_host_keys(Fleet(known_hosts=str(tmp_path / "missing")), system_files=())
    assert len(cluster_ssh.load_host_keys(Fleet(), system_files=[str(tmp_path / "missing")])) == 0
    bad = tmp_path / "bad"
    bad.write_text("n1 ssh-ed25519 !!!notbase64\n")
    with pytest.raises(ConfigError, match="not a known_hosts file"):
        cluster_ssh.load_host_keys(Fleet(known_hosts=str(bad)), system_files=())
    assert len(cluster_ssh.load_host_keys(Fleet(), system_files=[str(bad)])) == 0  # a warning, not an error


def test_run_checks_arguments_before_connecting():
    with pytest.raises(DsstageError, match="line break"):
        cluster_ssh.run(Fleet(), {"n1": "10.0.0.1"}, lambda node: ["a\nb"], host_keys=paramiko.HostKeys())
    with pytest.raises(DsstageError, match="not a host name"):
        cluster_ssh.run(Fleet(), {"n1": "-oProxyCommand=x"}, lambda node: [], host_keys=paramiko.HostKeys())
    with pytest.raises(ConfigError, match="fleet.key"):
        cluster_ssh.run(Fleet(key="/nonexistent/key"), {"n1": "10.0.0.1"}, lambda node: [],
                  host_keys=paramiko.HostKeys())
    assert cluster_ssh.run(Fleet(), {}, lambda node: [], host_keys=paramiko.HostKeys()) == {}


def answers(*specs: tuple[str, bool, float, str]) -> dict[str, Answer]:
    out = {}
    for node, ok, seconds, text in specs:
        out[node] = Answer(node=node, address=node, ok=ok, exit_code=0 if ok else None, seconds=seconds,
                           result={"staged": text} if ok else None, error="" if ok else text)
    return out


def test_summary_rows_in_node_order():
    got = fleet_view.summary_rows(answers(("n10", True, 2.0, "1 GiB"), ("n2", False, 0.1, "unreachable: x"),
                                     ("n1", True, 1.0, "1 GiB")), lambda r: f"staged {r['staged']}")
    assert got == [("n1", "ok", 1.0, "staged 1 GiB"), ("n2", "failed", 0.1, "unreachable: x"),
                   ("n10", "ok", 2.0, "staged 1 GiB")]


def test_summary_rows_survive_a_describe_that_fails():
    (row,) = fleet_view.summary_rows(answers(("n1", True, 1.0, "x")), lambda r: r["missing"])
    assert row[1] == "ok" and row[3].startswith("(cannot describe the answer: KeyError")


def test_fold_rows_groups_nodes_with_the_same_outcome():
    a = answers(*[(f"n{i}", True, 1.0 + i / 10, "1 GiB") for i in (1, 2, 4, 5, 6, 7, 8)],
                ("n3", False, 10.0, "unreachable: connection refused"), ("n9", True, 1.0, "2 GiB"))
    rows = fleet_view.fold_rows(fleet_view.summary_rows(a, lambda r: r["staged"]))
    assert rows == [("n[1-2,4-8]", "ok", "1.1-1.8s", "1 GiB"), ("n9", "ok", "1.0s", "2 GiB"),
                    ("n3", "failed", "10.0s", "unreachable: connection refused")]


def test_summary_line():
    a = answers(*[(f"n{i}", True, 1.0, "") for i in (1, 2, 4, 5, 6, 7, 8)],
                ("n3", False, 1.0, "unreachable: connection refused"))
    assert fleet_view.summary_line(a) == "8 nodes: 7 ok, 1 failed (n3: unreachable: connection refused)"
    assert fleet_view.summary_line(answers(("n1", True, 1.0, ""))) == "1 node: 1 ok, 0 failed"
    many = answers(*[(f"n{i}", False, 1.0, "refused" if i < 3 else f"reason {i}") for i in range(1, 8)])
    assert fleet_view.summary_line(many) == ("7 nodes: 0 ok, 7 failed (n[1-2]: refused; n3: reason 3; n4: reason 4; "
                                        "3 more reasons above)")


def test_print_summary_does_not_interpret_markup():
    from rich.console import Console
    out = io.StringIO()
    a = answers(("n1", True, 1.0, "[bold]x[/bold]"), ("n2", False, 1.0, "remote exit 2: [red]no"))
    fleet_view.print_summary(a, lambda r: r["staged"], console=Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "[bold]x[/bold]" in text and "[red]no" in text
    assert text.rstrip().endswith("2 nodes: 1 ok, 1 failed (n2: remote exit 2: [red]no)")


def test_exit_code():
    assert fleet.exit_code(answers(("n1", True, 1.0, ""), ("n2", True, 1.0, ""))) == 0
    assert fleet.exit_code(answers(("n1", True, 1.0, ""), ("n2", False, 1.0, "x"))) == 1


def test_progress_view_draws_nothing_off_a_terminal(capsys):
    with fleet_view.progress_view(["n1"], "warm x") as (on_progress, on_done):
        on_progress("n1", {"phase": "staging", "done": 1, "total": 2})
        on_done(Answer(node="n1", address="n1", ok=True))
    assert capsys.readouterr() == ("", "")


def test_progress_view_on_a_terminal(monkeypatch):
    """The callbacks survive every kind of progress, unknown nodes and both outcomes."""
    from rich.console import Console
    out = io.StringIO()
    # its own terminal, whatever the caller's: rich turns live output off where TERM is dumb or unset
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setattr(fleet_view.sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("dsstage.ui.err_console", lambda: Console(file=out, force_terminal=True, width=120))
    with fleet_view.progress_view(["n1", "n2"], "warm x") as (on_progress, on_done):
        on_progress("n1", {"phase": "connecting"})
        on_progress("n1", {"phase": "staging", "done": 512, "total": 2048})
        on_progress("n9", {"phase": "staging"})
        on_done(Answer(node="n1", address="n1", ok=True))
        on_done(Answer(node="n2", address="n2", error="unreachable: connection refused"))
        on_done(Answer(node="n9", address="n9", ok=True))
    assert "n1" in out.getvalue()

