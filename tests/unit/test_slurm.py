import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
from dsstage import hostlist
from dsstage.errors import CommandError
from dsstage.slurm import client
from dsstage.slurm import hold as slurm_hold
from dsstage.slurm import records as slurm_records
from dsstage.slurm.fake import FakeSlurm
from dsstage.slurm.records import Job

DATA = Path(__file__).resolve().parent.parent / "data"


def test_datasets_of_admin_comment():
    assert slurm_records.datasets_of("site=abc dsstage=coco,imagenet22t") == ("coco", "imagenet22t")
    assert slurm_records.datasets_of("") == ()
    assert slurm_records.datasets_of("nodsstage=x") == ()


@pytest.mark.parametrize("admin,expected", [
    ("site note: foo=bar dsstage=a,b", ("a", "b")),  # the site's text before the tag
    ("dsstage=a,b dsstage held this job: x=y -- once that is fixed: scontrol release 7", ("a", "b")),  # dsstage's after
    ("site note: foo=bar dsstage=a,b dsstage held this job: dsstage:c", ("a", "b")),  # a defused reason
    ("site|note\nsecond line dsstage=sample", ("sample",)),  # a line break before the tag
    ("site note: x=ydsstage=a", ()),  # not a word of its own
])
def test_datasets_of_finds_the_tag_among_other_text(admin, expected):
    assert slurm_records.datasets_of(admin) == expected


def test_expand_nodes_with_nodeset():
    assert hostlist.expand_nodes("n[1-3,5],gpu01") == ["gpu01", "n1", "n2", "n3", "n5"]
    assert hostlist.expand_nodes("c[08-10]") == ["c08", "c09", "c10"]
    assert hostlist.expand_nodes("rack[1-2]-n[01-02]") == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
    assert hostlist.expand_nodes("n3,n1,n3") == ["n1", "n3"]
    assert hostlist.expand_nodes("") == []
    for bad in ("n[1-", "n[3-1]", "@gpus", "n[1-4]!n2", "n1&n2", "n1^n2"):
        with pytest.raises(ValueError):
            hostlist.expand_nodes(bad)


def test_job_node_names():
    job = Job("5", "u", "PENDING", ("a",), nodes="", sched_nodes="n[1-2]")
    assert job.node_names("scheduled") == ["n1", "n2"] and job.node_names() == []
    assert Job("2", "u", "RUNNING", (), nodes="n[1-2],n3").node_names("allocated") == ["n1", "n2", "n3"]
    with pytest.raises(ValueError):
        job.node_names("planned")  # type: ignore[arg-type]


# -- holding a job ------------------------------------------------------------------------

def saved_squeue() -> dict[str, str]:
    """Real ``squeue -h -t all -j ID -O JOB_FORMAT`` outputs (Slurm 22.05.8), by job id."""
    out: dict[str, str] = {}
    for section in (DATA / "squeue-job-records.txt").read_text().split("## ")[1:]:
        command, _, text = section.partition("\n")
        assert command.endswith(slurm_records.JOB_FORMAT)
        out[command.split(" -j ")[1].split()[0]] = text
    return out


def test_parse_job_records_on_saved_squeue_output():
    saved = saved_squeue()
    # a held batch job whose name and comment forge scontrol fields and records (see below)
    held = slurm_records.parse_job_records(saved["25"])["25"]
    assert (held.state, held.batch, held.requeue, held.datasets) == ("PENDING", True, True, ("sample",))
    assert held.admin_comment == ("dsstage=sample\nsecond line| dsstage held this job: source /x is gone"
                                  " -- once that is fixed: scontrol release 25")
    no_requeue = slurm_records.parse_job_records(saved["26"])["26"]
    assert (no_requeue.batch, no_requeue.requeue) == (True, False)
    assert no_requeue.admin_comment == "site=a|b x=y dsstage=sample"
    alloc = slurm_records.parse_job_records(saved["27"])["27"]
    assert (alloc.state, alloc.batch, alloc.admin_comment) == ("RUNNING", False, "")  # "(null)"
    array = slurm_records.parse_job_records(saved["28"])  # the first task's id lists the whole array
    assert sorted(array) == ["28", "29", "30"] and array["28"].state == "PENDING"
    assert slurm_records.parse_job_records(saved["31"])["31"].state == "CANCELLED"
    assert slurm_records.parse_job_records("") == {}


def test_scontrol_show_job_can_be_forged_by_the_user():
    # job 25 above, as scontrol prints it: name and comment hold line breaks and fields;
    # why nothing parses scontrol show job, and squeue is asked for fixed fields only
    text = (DATA / "scontrol-show-job-forged.txt").read_text()
    assert "AdminComment=evil BatchFlag=0" in text and "\n1|0|0|RUNNING|evil|" in text
    assert not any(hasattr(m, "parse_show_job") for m in (slurm_records, client))


@pytest.mark.parametrize("text,expected", [
    ("source /x is gone", "source /x is gone"),
    ("two\nlines\r\n\tand  tabs", "two lines and tabs"),
    ("red \x1b[31malert\x1b[0m bell\x07 c1\x9b", "red [31malert[0m bell c1"),
    ("bidi \u202egnp.exe\u202c zero\u200bwidth", "bidi gnp.exe zerowidth"),
    ("tag dsstage=imagenet forged", "tag dsstage:imagenet forged"),
    ("keeps x-dsstage=1 and ünïcode", "keeps x-dsstage=1 and ünïcode"),
])
def test_hold_reason_is_one_clean_line(text, expected):
    assert slurm_hold.clean_reason(text) == expected


def test_hold_reason_is_bounded():
    long = slurm_hold.clean_reason("word " * 1000)
    assert len(long) == slurm_hold.MAX_REASON and long.endswith("...")
    assert slurm_hold.clean_reason("abcdef", limit=5) == "ab..."


def test_hold_message_says_what_was_done():
    assert slurm_hold.hold_message(Job("7", "u", "RUNNING", ()), "gone") == \
        "dsstage held this job: gone -- once that is fixed: scontrol release 7"
    assert slurm_hold.hold_message(Job("7", "u", "RUNNING", (), batch=False), "gone") == \
        "dsstage cancelled this job: gone (an interactive allocation cannot be requeued)"
    assert slurm_hold.hold_message(Job("7", "u", "RUNNING", (), requeue=False), "gone") == \
        "dsstage stopped this job: gone (it was submitted with --no-requeue)"


def test_merge_admin_comment_keeps_what_is_there_and_replaces_its_own_part():
    assert slurm_hold.merge_admin_comment("", "dsstage held this job: a") == "dsstage held this job: a"
    merged = slurm_hold.merge_admin_comment("site=a|b x=y dsstage=coco", "dsstage held this job: a")
    assert merged == "site=a|b x=y dsstage=coco dsstage held this job: a"
    assert slurm_records.datasets_of(merged) == ("coco",)
    again = slurm_hold.merge_admin_comment(merged, "dsstage cancelled this job: b")
    assert again == "site=a|b x=y dsstage=coco dsstage cancelled this job: b"
    assert slurm_hold.merge_admin_comment("dsstage=coco\n dsstage stopped this job: x", "dsstage held this job: y") == \
        "dsstage=coco dsstage held this job: y"


class Recorder:
    """proc.run for CliSlurm: the saved squeue answer for the job, success for the rest."""

    def __init__(self, squeue: str, squeue_rc: int = 0, squeue_err: str = "") -> None:
        self.calls: list[list[str]] = []
        self.envs: list[dict[str, str]] = []
        self.squeue = (squeue, squeue_rc, squeue_err)

    def __call__(self, argv, *, timeout=None, check=True, env=None, **kw):
        argv = list(argv)
        self.calls.append(argv)
        self.envs.append(dict(env or {}))
        out, rc, err = self.squeue if argv[0].endswith("/squeue") else ("", 0, "")
        if check and rc:
            raise CommandError(argv, rc, out, err)
        return subprocess.CompletedProcess(argv, rc, out, err)


def cli_with(monkeypatch, squeue: str, **kw) -> tuple[client.CliSlurm, Recorder]:
    rec = Recorder(squeue, **kw)
    monkeypatch.setattr(client.proc, "run", rec)
    return client.CliSlurm(bin_dir="/opt/slurm/bin", timeout=5), rec


def running(job_id: str, *, batch: str = "1", requeue: str = "1", admin: str = "dsstage=coco") -> str:
    return f"{job_id}|{batch}|{requeue}|RUNNING|{admin}|\n"


def test_cli_hold_requeues_and_holds_a_batch_job(monkeypatch):
    cli, rec = cli_with(monkeypatch, running("42", admin="site=x dsstage=coco"))
    assert cli.hold("42", "source /x is\ngone") == slurm_hold.HELD
    assert rec.calls == [
        ["/opt/slurm/bin/squeue", "-h", "-t", "all", "-j", "42", "-O", slurm_records.JOB_FORMAT],
        ["/opt/slurm/bin/scontrol", "update", "JobId=42", "AdminComment=site=x dsstage=coco dsstage held this job: "
         "source /x is gone -- once that is fixed: scontrol release 42"],
        ["/opt/slurm/bin/scontrol", "requeuehold", "Incomplete", "42"]]
    assert not any("Comment=" in a and not a.startswith("AdminComment=") for c in rec.calls for a in c)


def test_cli_hold_leaves_a_job_another_node_requeued(monkeypatch):
    cli, rec = cli_with(monkeypatch, "42|1|1|COMPLETING|dsstage=coco|\n")
    assert cli.hold("42", "gone") == slurm_hold.ALREADY_HELD
    assert rec.calls[-1][1:] == ["requeuehold", "Incomplete", "42"]  # a no-op for Slurm: seen


def test_cli_hold_cancels_an_allocation_after_telling_its_terminal(monkeypatch):
    cli, rec = cli_with(monkeypatch, saved_squeue()["27"])  # salloc, running
    assert cli.hold("27", "gone") == slurm_hold.CANCELLED
    message = "dsstage cancelled this job: gone (an interactive allocation cannot be requeued)"
    assert rec.calls[1:] == [["/opt/slurm/bin/scontrol", "update", "JobId=27", f"AdminComment={message}"],
                             ["/opt/slurm/bin/scontrol", "notify", "27", message],
                             ["/opt/slurm/bin/scancel", "27"]]


def test_cli_hold_leaves_a_no_requeue_batch_job_to_its_taskprolog(monkeypatch):
    cli, rec = cli_with(monkeypatch, saved_squeue()["26"])
    assert cli.hold("26", "gone") == slurm_hold.NOT_REQUEUED
    assert [c[1] for c in rec.calls[1:]] == ["update"]
    assert rec.calls[1][3] == ("AdminComment=site=a|b x=y dsstage=sample "
                               "dsstage stopped this job: gone (it was submitted with --no-requeue)")


def test_cli_hold_of_a_gone_job_does_nothing(monkeypatch):
    cli, rec = cli_with(monkeypatch, "", squeue_rc=1, squeue_err="slurm_load_jobs error: Invalid job id specified")
    assert cli.hold("9", "gone") == slurm_hold.GONE and len(rec.calls) == 1
    cli, rec = cli_with(monkeypatch, saved_squeue()["31"])  # cancelled meanwhile
    assert cli.hold("31", "gone") == slurm_hold.GONE and len(rec.calls) == 1


def test_cli_hold_raises_when_slurm_cannot_be_asked(monkeypatch):
    cli, _ = cli_with(monkeypatch, "", squeue_rc=1, squeue_err="Unable to contact slurm controller")
    with pytest.raises(CommandError):
        cli.hold("42", "gone")


def test_cli_job_alive_is_not_fooled_by_a_forged_job_name(monkeypatch):
    cli, rec = cli_with(monkeypatch, saved_squeue()["25"])
    assert cli.job_alive("25")
    assert rec.calls == [["/opt/slurm/bin/squeue", "-h", "-t", "all", "-j", "25", "-O", slurm_records.JOB_FORMAT]]
    cli, _ = cli_with(monkeypatch, saved_squeue()["31"])
    assert not cli.job_alive("31")
    cli, _ = cli_with(monkeypatch, "", squeue_rc=1, squeue_err="slurm_load_jobs error: Invalid job id specified")
    assert not cli.job_alive("9")
    cli, _ = cli_with(monkeypatch, "", squeue_rc=1, squeue_err="Unable to contact slurm controller")
    assert cli.job_alive("9")  # cannot tell: keep the lease


def test_cli_runs_slurm_clients_with_a_fixed_environment(monkeypatch):
    monkeypatch.setenv("SQUEUE_USERS", "nobody")  # seen: filters what squeue lists
    monkeypatch.setenv("SCANCEL_USER", "nobody")
    monkeypatch.setenv("SLURM_TIME_FORMAT", "relative")
    monkeypatch.setenv("SLURM_CLUSTERS", "other")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/test.conf")
    cli, rec = cli_with(monkeypatch, running("42"))
    assert cli.hold("42", "gone") == slurm_hold.HELD
    assert len(rec.envs) == 3
    for env in rec.envs:
        assert env["SLURM_TIME_FORMAT"] == "%s" and env["SLURM_CONF"] == "/etc/slurm/test.conf"
        assert not {"SQUEUE_USERS", "SCANCEL_USER", "SLURM_CLUSTERS"} & set(env)


def test_cli_slurm_calls_clients_by_absolute_path_only():
    with pytest.raises(ValueError):
        client.CliSlurm(bin_dir="bin")
    c = client.client(bin_dir="/opt/slurm/bin")
    assert isinstance(c, client.CliSlurm) and c.bin_dir == "/opt/slurm/bin"
    assert client.client().bin_dir == "/usr/bin"  # type: ignore[attr-defined]


def test_fake_hold_follows_the_same_rules():
    s = FakeSlurm()
    s.submit(Job("1", "a", "RUNNING", ("coco",), admin_comment="dsstage=coco"))
    s.submit(Job("2", "a", "RUNNING", ("coco",), batch=False))
    s.submit(Job("3", "a", "RUNNING", ("coco",), requeue=False))
    s.submit(Job("4", "a", "COMPLETED", ("coco",)))
    assert s.hold("1", "source\ngone") == slurm_hold.HELD
    assert s.jobs["1"].state == "PENDING" and s.held == {"1": "source gone"}
    assert s.jobs["1"].admin_comment == \
        "dsstage=coco dsstage held this job: source gone -- once that is fixed: scontrol release 1"
    assert s.hold("1", "still gone") == slurm_hold.ALREADY_HELD
    assert s.jobs["1"].admin_comment.endswith("still gone -- once that is fixed: scontrol release 1")
    assert s.hold("2", "gone") == slurm_hold.CANCELLED
    assert s.jobs["2"].state == "CANCELLED" and s.cancelled == {"2": "gone"}
    assert s.notified["2"].startswith("dsstage cancelled this job: gone")
    assert s.hold("3", "gone") == slurm_hold.NOT_REQUEUED and s.jobs["3"].state == "RUNNING"
    assert "3" not in s.held and "3" not in s.cancelled
    assert s.hold("4", "gone") == slurm_hold.GONE
    assert s.hold("99", "never submitted") == slurm_hold.HELD and s.held["99"] == "never submitted"


# -- the queue ----------------------------------------------------------------------------

def saved_queue() -> tuple[str, str]:
    """The command line and output of CliSlurm.queue on a real Slurm 22.05.8 (devcluster):
    running, suspended, pending with a backfill plan, --begin, held, requeue-held, an array,
    --no-requeue, salloc; AdminComments set by job_submit.lua, by hand and by hold."""
    _, command, out = (DATA / "squeue-queue.txt").read_text().split("\n", 2)
    return command.removeprefix("## "), out


def test_saved_queue_output_is_of_the_command_queue_runs():
    command, _ = saved_queue()
    argv = client.CliSlurm(bin_dir="/usr/bin").queue_argv()
    assert command == "SLURM_TIME_FORMAT=%s " + shlex.join(["squeue", *argv[1:]])
    assert argv[-1] == slurm_records.QUEUE_FORMAT and argv[-1].endswith(",admin_comment:|")


def test_parse_queue_on_saved_squeue_output():
    jobs = slurm_records.parse_job_records(saved_queue()[1], slurm_records.QUEUE_FORMAT)
    assert list(jobs) == ["5", "6", "9", "10", "11", "7", "4", "2", "8", "12", "3"]
    # pending, as another user, with backfill's plan: two nodes and an expected start
    assert jobs["5"] == Job("5", "nobody", "PENDING", ("sample",), nodes="", partition="debug",
                            admin_comment="dsstage=sample", priority=4294901755, start_time=1795333155.0,
                            sched_nodes="n[1-2]")
    assert jobs["5"].node_names("scheduled") == ["n1", "n2"] and jobs["5"].node_names() == []
    # --begin=now+1hour: its begin time, no planned nodes ("(null)")
    assert (jobs["6"].start_time, jobs["6"].sched_nodes) == (1795334965.0, "")
    # the site's text before the tag, and a | and a line break before it
    assert (jobs["9"].admin_comment, jobs["9"].datasets) == ("site note: x=y dsstage=sample", ("sample",))
    assert (jobs["10"].admin_comment, jobs["10"].datasets) == ("site|note\nsecond line dsstage=sample", ("sample",))
    assert (jobs["11"].requeue, jobs["11"].sched_nodes) == (False, "n1")
    # held by its user (sbatch -H) and requeued-held by dsstage: priority 0, no start ("N/A")
    assert (jobs["7"].priority, jobs["7"].start_time) == (0, None)
    assert (jobs["4"].priority, jobs["4"].start_time, jobs["4"].datasets) == (0, None, ("sample",))
    assert "dsstage held this job: source /data/x is gone" in jobs["4"].admin_comment
    # running: allocated nodes and the start; no tag: no datasets ("(null)")
    assert (jobs["2"].state, jobs["2"].nodes, jobs["2"].start_time, jobs["2"].sched_nodes) == \
        ("RUNNING", "n[1-2]", 1795331355.0, "")
    assert (jobs["8"].datasets, jobs["8"].admin_comment) == ((), "")
    assert (jobs["12"].batch, jobs["12"].nodes) == (False, "n3")  # salloc
    # suspended: Slurm shows priority 0, but a job that ran keeps its start
    assert (jobs["3"].state, jobs["3"].priority, jobs["3"].start_time) == ("SUSPENDED", 0, 1795331355.0)


def test_a_requeued_held_job_has_no_start():
    # seen just after 'scontrol requeuehold' (not in the saved output, taken later): the job
    # shows a StartTime, the end of its requeue delay, though it will not start until released
    line = "4|root|PENDING|debug|0|1795331487|(null)||1|1|dsstage=sample dsstage held this job: x|\n"
    job = slurm_records.parse_job_records(line, slurm_records.QUEUE_FORMAT)["4"]
    assert (job.priority, job.start_time, job.datasets) == (0, None, ("sample",))
    running = "2|root|RUNNING|debug|0|1795331355|(null)|n1|1|1|(null)|\n"  # only a pending job waits
    assert slurm_records.parse_job_records(running, slurm_records.QUEUE_FORMAT)["2"].start_time == 1795331355.0


def test_parse_job_records_takes_known_fields_only():
    with pytest.raises(ValueError):
        slurm_records.parse_job_records("", "JobID:|,Name:|,admin_comment:|")  # a user's free text
    with pytest.raises(ValueError):
        slurm_records.parse_job_records("", "admin_comment:|,JobID:|")  # free text not last


def test_cli_queue_runs_one_squeue_with_a_fixed_environment(monkeypatch):
    monkeypatch.setenv("SQUEUE_USERS", "nobody")  # seen: filters what squeue lists
    monkeypatch.setenv("SQUEUE_ARRAY", "1")
    monkeypatch.setenv("SLURM_TIME_FORMAT", "relative")
    monkeypatch.setenv("SLURM_CLUSTERS", "other")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/test.conf")
    cli, rec = cli_with(monkeypatch, saved_queue()[1])
    jobs = cli.queue()
    assert [j.job_id for j in jobs] == ["5", "6", "9", "10", "11", "7", "4", "2", "8", "12", "3"]
    assert rec.calls == [cli.queue_argv()] and rec.calls[0][0] == "/opt/slurm/bin/squeue"
    env = rec.envs[0]
    assert env["SLURM_TIME_FORMAT"] == "%s" and env["SLURM_CONF"] == "/etc/slurm/test.conf"
    assert not {"SQUEUE_USERS", "SQUEUE_ARRAY", "SLURM_CLUSTERS"} & set(env)


def test_cli_queue_raises_when_slurm_cannot_be_asked(monkeypatch):
    cli, _ = cli_with(monkeypatch, "", squeue_rc=1, squeue_err="Unable to contact slurm controller")
    with pytest.raises(CommandError):
        cli.queue()


def test_fake_queue_lists_the_active_jobs():
    s = FakeSlurm()
    s.submit(Job("1", "a", "PENDING", ("coco",), sched_nodes="n1"))
    s.submit(Job("2", "a", "RUNNING", ("coco",), nodes="n2", batch=False))
    s.submit(Job("3", "a", "COMPLETED", ("coco",)))
    assert [j.job_id for j in s.queue()] == ["1", "2"]
    s.hold("2", "gone")  # an allocation is cancelled
    s.finish("1")
    assert s.queue() == []


# -- pyslurm ------------------------------------------------------------------------------

#: the attributes of pyslurm.Job (24.11.0, pyslurm/core/job/job.pyx) that PySlurm may read
PYSLURM_JOB = ["id", "user_id", "user_name", "state", "partition", "priority", "start_time", "scheduled_nodes",
               "allocated_nodes", "admin_comment", "is_batch_job", "is_requeueable", "cluster"]


def pyslurm_job(mocker, **kw):
    values = dict(user_id=0, user_name="root", partition="debug", priority=4294901755, start_time=None,
                  scheduled_nodes=None, allocated_nodes=None, admin_comment=None, is_batch_job=True,
                  is_requeueable=True, cluster="dev")
    values.update(kw)
    job = mocker.NonCallableMock(spec_set=PYSLURM_JOB)
    for name, value in values.items():
        setattr(job, name, value)
    return job


@pytest.fixture
def fake_pyslurm(mocker):
    """A pyslurm module with the job API PySlurm targets; ``loaded`` is what Jobs.load() returns."""
    module = types.ModuleType("pyslurm")
    module.PyslurmError = type("PyslurmError", (Exception,), {})  # type: ignore[attr-defined]
    module.RPCError = type("RPCError", (module.PyslurmError,), {})  # type: ignore[attr-defined]
    module.Jobs = mocker.Mock(spec_set=["load"])  # type: ignore[attr-defined]
    mocker.patch.dict(sys.modules, {"pyslurm": module})
    return module


def test_client_uses_pyslurm_where_it_imports_with_the_job_api(fake_pyslurm):
    c = client.client(bin_dir="/opt/slurm/bin")
    assert isinstance(c, client.PySlurm) and c.pyslurm is fake_pyslurm and c.bin_dir == "/opt/slurm/bin"


def test_client_falls_back_to_the_cli(mocker):
    mocker.patch.dict(sys.modules, {"pyslurm": None})  # import pyslurm raises ImportError
    assert isinstance(client.client(), client.CliSlurm)
    old = types.ModuleType("pyslurm")  # 17.x/18.x: pyslurm.job(), no pyslurm.Jobs
    old.job = object  # type: ignore[attr-defined]
    mocker.patch.dict(sys.modules, {"pyslurm": old})
    assert isinstance(client.client(), client.CliSlurm)


def test_pyslurm_queue(fake_pyslurm, mocker):
    loaded = {
        5: pyslurm_job(mocker, id=5, user_name="nobody", state="PENDING", start_time=1795333155,
                       scheduled_nodes="n[1-2]", admin_comment="site note: x=y dsstage=sample"),
        7: pyslurm_job(mocker, id=7, state="PENDING", priority=0, start_time=1795331487, admin_comment="dsstage=a"),
        2: pyslurm_job(mocker, id=2, state="RUNNING", start_time=1795331355, allocated_nodes="n[1-2]",
                       admin_comment="dsstage=a,b dsstage held this job: x"),
        12: pyslurm_job(mocker, id=12, user_name=None, user_id=1234, state="RUNNING", allocated_nodes="n3",
                        is_batch_job=False, priority=None),
        1: pyslurm_job(mocker, id=1, state="COMPLETED", admin_comment="dsstage=a"),
    }
    fake_pyslurm.Jobs.load.return_value = mocker.Mock(spec_set=["values"], values=loaded.values)
    jobs = {j.job_id: j for j in client.client().queue()}
    assert sorted(jobs) == ["12", "2", "5", "7"]  # COMPLETED is not in the queue
    assert jobs["5"] == Job("5", "nobody", "PENDING", ("sample",), nodes="", partition="debug",
                            admin_comment="site note: x=y dsstage=sample", priority=4294901755,
                            start_time=1795333155.0, sched_nodes="n[1-2]")
    assert (jobs["7"].priority, jobs["7"].start_time) == (0, None)  # held: no start
    assert (jobs["2"].nodes, jobs["2"].start_time, jobs["2"].datasets) == ("n[1-2]", 1795331355.0, ("a", "b"))
    assert (jobs["12"].user, jobs["12"].batch, jobs["12"].priority, jobs["12"].admin_comment) == \
        ("1234", False, 0, "")
    fake_pyslurm.Jobs.load.assert_called_once_with()


def test_pyslurm_queue_error_is_a_command_error(fake_pyslurm):
    fake_pyslurm.Jobs.load.side_effect = fake_pyslurm.RPCError("Unable to contact slurm controller")
    with pytest.raises(CommandError, match="pyslurm cannot load the jobs"):
        client.client().queue()


def test_pyslurm_holds_and_checks_jobs_through_the_cli(fake_pyslurm, mocker):
    c = client.client(bin_dir="/opt/slurm/bin")
    assert isinstance(c, client.PySlurm)
    hold = mocker.patch.object(client.CliSlurm, "hold", return_value=slurm_hold.HELD)
    alive = mocker.patch.object(client.CliSlurm, "job_alive", return_value=False)
    assert c.hold("42", "gone") == slurm_hold.HELD and not c.job_alive("42")
    hold.assert_called_once_with("42", "gone")
    alive.assert_called_once_with("42")
    fake_pyslurm.Jobs.load.assert_not_called()


@pytest.mark.parametrize("names", [
    ["n1", "n2", "n3", "n5"], ["n0001", "n0002", "n0010"], ["gpu01", "n7", "gpu02", "n8", "n9"],
    ["n1"], ["n9", "n10", "n11"], ["a-b.c1", "a-b.c2"], ["login", "n1"], ["n1a2", "n1a3"],
    ["n01", "n1"], ["n099", "n100", "n0100"], ["node", "node"],
])
def test_status_folds_node_names_as_nodeset_does(names):
    from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet
    from dsstage.hostlist import fold_nodes as fold
    assert fold(names) == str(NodeSet.fromlist(names, resolver=RESOLVER_NOGROUP))


def test_a_hostlist_is_counted_before_any_name_is_made(monkeypatch):
    """n[1-99999999] (a typo, or bbstat's node filter from any user) is refused from its text:
    ClusterShell would hold every name in memory before it could count them."""
    from ClusterShell import NodeSet
    assert hostlist.count("n[1-3,5],gpu01,rack[1-2]-n[01-04]") == 4 + 1 + 8
    assert hostlist.count("") == 0
    made = []
    monkeypatch.setattr(NodeSet, "NodeSet", lambda *a, **k: made.append(a) or [])
    with pytest.raises(hostlist.TooManyNodes, match="names 99999999 nodes, more than 100000"):
        hostlist.expand_nodes("n[1-99999999]")
    assert made == []
    from dsstage.cluster.status import Filter
    from dsstage.errors import DsstageError
    with pytest.raises(DsstageError, match="more than 100000"):
        Filter.parse(nodes="n[1-99999999]")


def test_a_backwards_range_is_no_hostlist_rather_than_nothing():
    """Counted as zero, n[1-100000000]x[5-1] would have passed the bound and ClusterShell
    would have built the first range before refusing the second."""
    with pytest.raises(ValueError, match="runs backwards"):
        hostlist.count("n[1-100000000]x[5-1]")
    with pytest.raises(ValueError):
        hostlist.expand_nodes("n[1-100000000]x[5-1]")


def _flaky(tmp_path, name: str, failures: int, message: str):
    """A Slurm client ``name`` in tmp_path/bin that fails ``failures`` times with ``message``,
    then succeeds with no output; the file counting its runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    count = tmp_path / f"{name}.count"
    count.write_text("0")
    script = bin_dir / name
    script.write_text(f'#!/bin/sh\nn=$(cat {count}); echo $((n + 1)) > {count}\n'
                      f'if [ "$n" -lt {failures} ]; then echo "{name}: error: {message}" >&2; exit 1; fi\nexit 0\n')
    script.chmod(0o755)
    return str(bin_dir), count


def test_a_busy_controller_is_asked_again_with_backoff_within_the_timeout(tmp_path):
    """Issue 54: ``scancel: ... Socket timed out on send/recv operation`` failed a hold on a
    loaded machine. A client that failed because the controller did not answer is run again
    after 0.5, 1, ... s while the timeout allows; any other failure is not."""
    from dsstage.errors import CommandError
    from dsstage.slurm.client import CliSlurm
    bin_dir, count = _flaky(tmp_path, "squeue", 2, "slurm_load_jobs error: Socket timed out on send/recv operation")
    assert CliSlurm(bin_dir=bin_dir, timeout=10).queue() == [] and count.read_text().strip() == "3"
    bin_dir, count = _flaky(tmp_path, "squeue", 5, "Invalid user for SlurmUser")
    with pytest.raises(CommandError, match="Invalid user"):
        CliSlurm(bin_dir=bin_dir, timeout=10).queue()
    assert count.read_text().strip() == "1"  # not the controller's silence: not asked again
    bin_dir, count = _flaky(tmp_path, "squeue", 100, "Unable to contact slurm controller (connect failure)")
    with pytest.raises(CommandError, match="Unable to contact"):
        CliSlurm(bin_dir=bin_dir, timeout=2).queue()
    assert 2 <= int(count.read_text()) <= 3  # 0.5 s, then 1 s: the timeout ends it
