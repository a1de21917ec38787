"""The Prolog, Epilog and TaskProlog scripts (prolog/, epilog/), run for real.

Root runs the Prolog and Epilog from slurmd's working directory: Python must start
isolated, so that nothing planted there (or named by PYTHON* variables) is imported. The
TaskProlog runs as the job's user with the job's environment: it takes no path from it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dsstage.hooks import bbrequest
from dsstage.hooks.__main__ import CODE

TOP = Path(__file__).resolve().parents[2]
PROLOG = TOP / "prolog" / "dsstage-prolog"
EPILOG = TOP / "epilog" / "dsstage-epilog"
TASKPROLOG = TOP / "prolog" / "dsstage-taskprolog"
HOOKS = (PROLOG, EPILOG, TASKPROLOG)
SAFE_PATH = "PATH=/usr/sbin:/usr/bin:/sbin:/bin"
EVIL = 'open({marker!r}, "w").write("imported from " + __file__)\n'


@pytest.mark.parametrize("script", HOOKS, ids=lambda p: p.name)
def test_hook_scripts_set_their_own_path_first(script):
    commands = [line for line in script.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert commands[0] == SAFE_PATH


def job_env(tmp_path: Path) -> dict[str, str]:
    """What slurmd gives the Prolog, and a defaults file naming this test's Python and
    configuration (a dataset without a manifest: the Prolog falls back to the source at once)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_text("a")
    (tmp_path / "dsstage.yaml").write_text(
        f"state_dir: {tmp_path}/state\non_failure: fallback\n"
        f"tiers:\n  nvme:\n    path: {tmp_path}/nvme/{{node}}\n    capacity: 1GB\n    root_filesystem: true\n"
        f"datasets:\n  sample:\n    source: {tmp_path}/src\n")
    (tmp_path / "defaults").write_text(
        f"DSSTAGE_PYTHON={sys.executable}\nDSSTAGE_CONFIG={tmp_path}/dsstage.yaml\n"
        f"DSSTAGE_RUN_DIR={tmp_path}/run\nDSSTAGE_LOG={tmp_path}/hooks.log\n")
    return {"DSSTAGE_DEFAULTS": str(tmp_path / "defaults"), "SPANK_DSSTAGE_DATASETS": "sample",
            "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1", "SLURM_JOB_UID": str(os.getuid()),
            "SLURM_JOB_GID": str(os.getgid()), "SLURM_JOB_USER": "root", "SLURM_CONF": "/nonexistent"}


def plant(where: Path, kind: str, marker: Path) -> None:
    code = EVIL.format(marker=str(marker))
    if kind == "module":
        (where / "dsstage.py").write_text(code)
    else:
        for sub in ("", "hooks", "warm"):
            (where / "dsstage" / f"{sub or '__init__'}.py").parent.mkdir(parents=True, exist_ok=True)
            (where / "dsstage" / f"{sub or '__init__'}.py").write_text(code)


@pytest.mark.parametrize("vector", ["cwd", "PYTHONPATH"])
@pytest.mark.parametrize("kind", ["module", "package"])
@pytest.mark.parametrize("script", [PROLOG, EPILOG], ids=lambda p: p.name)
def test_root_python_imports_nothing_from_cwd_or_pythonpath(tmp_path, script, kind, vector):
    env = job_env(tmp_path)
    cwd, planted, marker = tmp_path / "cwd", tmp_path / "planted", tmp_path / "marker"
    cwd.mkdir()
    if vector == "cwd":
        planted = cwd
    else:
        planted.mkdir()
        env["PYTHONPATH"] = str(planted)
    plant(planted, kind, marker)

    # the plant works: a Python started as the scripts used to start it picks it up
    res = subprocess.run([sys.executable, "-c", CODE, "prolog"], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=60)
    assert marker.exists(), res.stderr
    marker.unlink()

    res = subprocess.run([str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert not marker.exists(), marker.read_text()
    assert res.returncode == 0, res.stderr + (tmp_path / "hooks.log").read_text()
    if script == PROLOG and os.geteuid() == 0:  # the real dsstage ran: it left the job's TaskProlog lines
        task = (tmp_path / "run" / "n1" / "jobs" / "7.task").read_text()
        assert f"export DSSTAGE_DATASET_DIR={tmp_path}/src\n" in task


# -- a #BB_LUA dataset= job: no SPANK request, a record from burst_buffer.lua's pre_run ------------

def bb_job_env(tmp_path: Path, *, python: str = sys.executable) -> dict[str, str]:
    env = job_env(tmp_path)
    del env["SPANK_DSSTAGE_DATASETS"]
    defaults = tmp_path / "defaults"
    defaults.write_text(defaults.read_text().replace(f"DSSTAGE_PYTHON={sys.executable}", f"DSSTAGE_PYTHON={python}")
                        + f"DSSTAGE_BB_REQUESTS={tmp_path}/state/bb\n")
    return env


@pytest.mark.parametrize("script", [PROLOG, EPILOG], ids=lambda p: p.name)
def test_a_job_without_request_or_record_starts_no_python(tmp_path, script):
    env = bb_job_env(tmp_path, python="/bin/false")  # started, it would fail the hook
    assert subprocess.run([str(script)], env=env, cwd="/", timeout=30).returncode == 0
    bbrequest.write(str(tmp_path / "state"), "8", ["sample"])  # another job's record
    assert subprocess.run([str(script)], env=env, cwd="/", timeout=30).returncode == 0
    env["SLURM_JOB_ID"] = "../bb/8"
    assert subprocess.run([str(script)], env=env, cwd="/", timeout=30).returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the store is root's: the real Prolog runs as root")
def test_a_bb_job_is_staged_from_its_record_and_released_by_its_epilog(tmp_path):
    env = bb_job_env(tmp_path)
    bbrequest.write(str(tmp_path / "state"), "7", ["sample"])
    res = subprocess.run([str(PROLOG)], env=env, cwd="/", capture_output=True, text=True, timeout=120)
    log = (tmp_path / "hooks.log").read_text()
    assert res.returncode == 0, res.stderr + log
    assert "job 7: #BB_LUA request sample" in log
    task = tmp_path / "run" / "n1" / "jobs" / "7.task"
    assert f"export DSSTAGE_DATASET_DIR={tmp_path}/src\n" in task.read_text()  # no manifest: the fallback
    res = subprocess.run([str(EPILOG)], env=env, cwd="/", capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert not task.exists()
    assert "job 7: released" in (tmp_path / "hooks.log").read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="the store is root's: the real Prolog runs as root")
def test_a_directive_next_to_dataset_asks_for_both(tmp_path):
    env = {**bb_job_env(tmp_path), "SPANK_DSSTAGE_DATASETS": "sample"}
    bbrequest.write(str(tmp_path / "state"), "7", ["sampel"])
    res = subprocess.run([str(PROLOG)], env=env, cwd="/", capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    task = (tmp_path / "run" / "n1" / "jobs" / "7.task").read_text()
    assert "unknown dataset 'sampel'" in task and "# dsstage: hold" in task, task


@pytest.mark.skipif(os.geteuid() != 0, reason="the store is root's: the real Prolog runs as root")
def test_a_planted_record_holds_the_job_and_says_why(tmp_path):
    env = bb_job_env(tmp_path)
    bbrequest.write(str(tmp_path / "state"), "1", ["sample"])
    (tmp_path / "state" / "bb" / "7").symlink_to(tmp_path / "state" / "bb" / "1")
    res = subprocess.run([str(PROLOG)], env=env, cwd="/", capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr  # the site's problem: never a drain
    task = (tmp_path / "run" / "n1" / "jobs" / "7.task").read_text()
    assert "# dsstage: hold" in task
    assert "cannot read the job's #BB_LUA request" in task and "cannot be opened safely" in task


# -- the TaskProlog, installed the way sites and the devcluster install it ----------------------

@pytest.fixture
def installed(tmp_path: Path) -> Path:
    """install-hooks into tmp_path/hooks, reading tmp_path/etc/defaults (run dir tmp_path/run)."""
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "defaults").write_text(f"DSSTAGE_RUN_DIR={tmp_path}/run\n")
    subprocess.run(["make", "-s", "-C", str(TOP / "sbatch_ext"), "install-hooks", f"HOOK_DIR={tmp_path}/hooks",
                    f"DEFAULTS={tmp_path}/etc/defaults"], check=True, capture_output=True)
    return tmp_path / "hooks" / "dsstage-taskprolog"


def task_file(root: Path, job: str, text: str, node: str = "n1") -> Path:
    path = root / "run" / node / "jobs" / f"{job}.task"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def taskprolog(script: Path, **env: str) -> subprocess.CompletedProcess[str]:
    env = {"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n1", **env}
    return subprocess.run([str(script)], env=env, cwd="/", capture_output=True, text=True, timeout=30)


BAD_JOB = "print dsstage: error: SLURM_JOB_ID is not a job id; no task started\n"
BAD_NODE = "print dsstage: error: SLURMD_NODENAME is not a node name; no task started\n"
HELD = "export DSSTAGE_DATASET_DIR=/data/x\nprint dsstage: error: source down\n# dsstage: hold\n"


def test_installed_taskprolog_names_its_defaults_file(installed, tmp_path):
    assert f"\ndefaults={tmp_path}/etc/defaults\n" in installed.read_text()
    assert os.access(installed, os.X_OK)


def test_taskprolog_prints_the_task_file_and_stops_a_held_job(installed, tmp_path):
    task_file(tmp_path, "42", "export DSSTAGE_DATASET_DIR=/data/x")  # no final newline
    res = taskprolog(installed)
    assert (res.returncode, res.stdout) == (0, "export DSSTAGE_DATASET_DIR=/data/x\n")
    task_file(tmp_path, "42", HELD)
    res = taskprolog(installed)
    assert (res.returncode, res.stdout) == (1, HELD)
    res = taskprolog(installed, SLURM_JOB_ID="43")
    assert (res.returncode, res.stdout) == (0, "")


def test_taskprolog_stops_a_burst_buffer_job_whose_prolog_staged_nothing(installed, tmp_path):
    """A #BB_LUA dataset= job's own request (burst_buffer.lua sets both variables) with no task
    file: this node's Prolog never saw it (no DSSTAGE_BB_REQUESTS): no task, and a line that
    says what the admins must set. A job it submitted inherits the variables, not the request."""
    res = taskprolog(installed, DSSTAGE_BB_DATASETS="coco,imagenet", DSSTAGE_BB_JOB="42")
    assert res.returncode == 1
    assert res.stdout == ("print dsstage: error: this job asked for coco,imagenet with #BB_LUA but no Prolog staged "
                          f"it on n1: the admins must set DSSTAGE_BB_REQUESTS in {tmp_path}/etc/defaults (the bb "
                          "directory of dsstage's state_dir); no task started\n")
    child = taskprolog(installed, DSSTAGE_BB_DATASETS="coco", DSSTAGE_BB_JOB="41")
    assert (child.returncode, child.stdout) == (0, "")
    forged = taskprolog(installed, DSSTAGE_BB_DATASETS="coco\nexport LD_PRELOAD=/tmp/x.so", DSSTAGE_BB_JOB="42")
    assert forged.returncode == 1 and forged.stdout.count("\n") == 1 and "LD_PRELOAD" not in forged.stdout
    task_file(tmp_path, "42", "export DSSTAGE_DATASET_DIR=/data/x\n")  # the Prolog did stage it
    res = taskprolog(installed, DSSTAGE_BB_DATASETS="coco", DSSTAGE_BB_JOB="42")
    assert (res.returncode, res.stdout) == (0, "export DSSTAGE_DATASET_DIR=/data/x\n")


def test_taskprolog_ignores_run_dir_and_defaults_from_the_jobs_environment(installed, tmp_path):
    task_file(tmp_path, "42", HELD)
    evil = tmp_path / "evil"
    task_file(evil, "42", "export LD_PRELOAD=/tmp/evil.so\n")
    (evil / "defaults").write_text(f"DSSTAGE_RUN_DIR={evil}/run\necho export FROM_DEFAULTS=1\n")
    (evil / "empty").mkdir()
    for attack in ({"DSSTAGE_RUN_DIR": str(evil / "empty")},  # no task file there: the hold mark unseen
                   {"DSSTAGE_RUN_DIR": str(evil / "run")},
                   {"DSSTAGE_DEFAULTS": str(evil / "defaults")},
                   {"DSSTAGE_DEFAULTS": str(evil / "defaults"), "DSSTAGE_RUN_DIR": str(evil / "run")}):
        res = taskprolog(installed, **attack)
        assert (res.returncode, res.stdout) == (1, HELD), attack


@pytest.mark.parametrize("job", ["", "../42", "42/../../42", "4 2", "$(id)", "42\n", "-42", "42.task",
                                 "1\nexport LD_PRELOAD=/tmp/x.so"])
def test_taskprolog_refuses_a_job_id_that_is_not_one(installed, tmp_path, job):
    task_file(tmp_path, "42", "export DSSTAGE_DATASET_DIR=/data/x\n")
    res = taskprolog(installed, SLURM_JOB_ID=job)
    assert (res.returncode, res.stdout) == (1, BAD_JOB)


@pytest.mark.parametrize("node", ["..", ".", "../n1", "n1/..", "n1/x", "n 1", ".hidden", "n1\n"])
def test_taskprolog_refuses_a_node_name_that_is_not_one(installed, tmp_path, node):
    task_file(tmp_path, "42", HELD, node="n1")
    res = taskprolog(installed, SLURMD_NODENAME=node)
    assert (res.returncode, res.stdout) == (1, BAD_NODE)


@pytest.mark.parametrize("job,node", [("42_7", "n1"), ("42+1", "gpu-01.cluster_a"), ("42", "")])
def test_taskprolog_accepts_array_and_het_ids_and_dotted_node_names(installed, tmp_path, job, node):
    task_file(tmp_path, job, HELD, node=node or "node")
    res = taskprolog(installed, SLURM_JOB_ID=job, SLURMD_NODENAME=node)
    assert (res.returncode, res.stdout) == (1, HELD)


# -- logs: syslog (journald reads it), with the job id on every line ------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="the store is root's: the real Prolog runs as root")
def test_prolog_and_epilog_log_to_syslog_with_the_job_id(tmp_path):
    import socket
    sock_path = tmp_path / "log.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    try:
        env = {**job_env(tmp_path), "DSSTAGE_SYSLOG": str(sock_path)}
        for script in (PROLOG, EPILOG):
            res = subprocess.run([str(script)], env=env, cwd="/", capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, res.stderr
        lines = []
        while True:
            try:
                lines.append(sock.recv(65536).decode())
            except TimeoutError:
                break
    finally:
        sock.close()
    assert lines, "nothing reached the syslog socket"
    import re
    pattern = re.compile(r"^<(2[4-9]|30|31)>dsstage\[\d+\]: job 7: ")  # facility daemon, tag dsstage
    assert all(pattern.match(line) for line in lines), lines
    assert any(line.startswith("<28>") and "has no manifest yet" in line for line in lines), lines  # a warning
    assert any("released" in line for line in lines), lines  # the Epilog
    # and the file the defaults name has the same lines
    text = (tmp_path / "hooks.log").read_text()
    assert all(line.split(": ", 1)[1] in text for line in lines), (lines, text)


def test_taskprolog_drops_what_dsstage_exports_inherited_by_any_job(installed, tmp_path):
    """Issue 54: a job submitted from inside a dsstage job (a chain) inherits its parent's
    DSSTAGE_* and read a copy it held no lease on; a node whose Prolog left no file ran its
    tasks with the batch node's DSSTAGE_FILES_<NAME>. The TaskProlog now unsets every variable
    dsstage exports, for every job (not only heterogeneous ones), before this node's own."""
    inherited = {"DSSTAGE_DATASET_DIR": "/n1/views/big/x", "DSSTAGE_PATH_BIG": "/n1/views/big/x",
                 "DSSTAGE_FILES_BIG": "/run/dsstage/n1/jobs/7.files", "DSSTAGE_FILES": "/f",
                 "DSSTAGE_SHARDS_BIG": "0,3", "DSSTAGE_MIN_FILES": "8", "DSSTAGE_SHARD_MAP_BIG": "/m",
                 "DSSTAGE_CONFIG": "/etc/mine.yaml"}
    res = taskprolog(installed, **inherited)  # no file for job 42 on this node
    assert res.returncode == 0
    assert sorted(res.stdout.splitlines()) == sorted(f"unset {k}" for k in inherited if k != "DSSTAGE_CONFIG")
    task_file(tmp_path, "42", "export DSSTAGE_PATH_COCO=/n2/coco\nexport DSSTAGE_DATASET_DIR=/n2/coco\n")
    lines = taskprolog(installed, **inherited).stdout.splitlines()
    assert lines[-2:] == ["export DSSTAGE_PATH_COCO=/n2/coco", "export DSSTAGE_DATASET_DIR=/n2/coco"]
    assert all(line.startswith("unset ") for line in lines[:-2]) and "unset DSSTAGE_CONFIG" not in lines
    assert taskprolog(installed, SLURM_JOB_ID="43").stdout == ""  # nothing inherited, no file: nothing


def test_the_hook_scripts_start_python_with_the_hooks_code():
    """The scripts run ``python -I -c CODE prolog|epilog`` (not ``-m``: runpy's imports cost
    the warm Prolog about 6 ms), with the one CODE of dsstage.hooks.__main__."""
    for script, which in ((PROLOG, "prolog"), (TOP / "epilog" / "dsstage-epilog", "epilog")):
        last = script.read_text().rstrip().splitlines()[-1]
        assert last == f'exec "${{DSSTAGE_PYTHON:-/usr/lib/dsstage/venv/bin/python}}" -I -c \'{CODE}\' {which}', last
