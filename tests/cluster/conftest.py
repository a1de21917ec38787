"""A real Slurm cluster on this machine (packaging/devcluster) for the cluster tests.

It is started once per session in its own directory and on its own ports, and stopped by
pid at the end. Set DSSTAGE_SKIP_CLUSTER=1 to skip these tests on a machine without
Slurm packages (CI installs them).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
#: burst_buffer.status_max_age in packaging/devcluster's configuration
BBSTAT_MAX_AGE = 2
#: bytes/s the cluster's slow source (Cluster.slowfs) delivers
SLOW_RATE = 2 << 20


class Cluster:
    def __init__(self, directory: Path, top: Path = ROOT) -> None:
        self.dir = directory
        self.etc = directory / "etc"
        self.jobs = directory / "jobs"
        self.env = dict(os.environ, SLURM_CONF=str(self.etc / "slurm.conf"),
                        DSSTAGE_CONFIG=str(self.etc / "dsstage.yaml"), DSSTAGE_RUN_DIR=str(directory / "dsstage-run"))
        # the package pass (packaging/run-tests, DSSTAGE_FROM_PACKAGE=1) runs the installed command too
        from_package = os.environ.get("DSSTAGE_FROM_PACKAGE", "0") not in ("", "0")
        self.venv_bin = Path("/usr/bin") if from_package else top / ".venv" / "bin"
        #: the Slurm series (packaging/devcluster, DEVCLUSTER_SLURM): another than this machine's
        #: runs in a Debian root of its own, and its commands (and dsstage) are $DIR/bin's
        self.series = os.environ.get("DEVCLUSTER_SLURM") or "22.05"
        self.hangfs: Any = None  # a latencyfs that can stop answering (hangable_mount), if any
        self.slowfs: Any = None  # a latencyfs that delivers SLOW_RATE bytes/s (a busy shared filesystem), if any
        self.devcluster: tuple[str, dict[str, str]] = ("", {})  # the script and environment that brought it up
        if self.series != "22.05":
            self.venv_bin = directory / "bin"
            self.env["PATH"] = f"{directory / 'bin'}:{self.env.get('PATH', '/usr/bin:/bin')}"

    def up_again(self, **settings: str) -> str:
        """`devcluster down`, then `up` in the same directory with the DEVCLUSTER_* ``settings``
        changed (PREVIOUS_NODES="n2": an upgrade's next step); what `up` said."""
        script, env = self.devcluster
        env.update({f"DEVCLUSTER_{k}": v for k, v in settings.items()})
        down = subprocess.run([script, "down"], env=env, text=True, capture_output=True, timeout=120)
        assert down.returncode == 0, f"devcluster down failed:\n{down.stderr}"
        up = subprocess.run([script, "up"], env=env, text=True, capture_output=True, timeout=600)
        assert up.returncode == 0, f"devcluster up failed:\n{up.stdout}\n{up.stderr}"
        return up.stderr

    def bbstat(self, *words: str, user: str = "daemon", since: float | None = None, timeout: float = 60) -> str:
        """`scontrol show bbstat WORDS` as ``user``: an answer computed after ``since`` (epoch
        seconds; default: now), asking again while it is computed (bbstat answers at once with
        what it has, and starts a newer answer in the background)."""
        since = time.time() if since is None else since
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            out = self.run("scontrol", "show", "bbstat", *words, user=user).stdout
            age = re.match(r"\(computed (\d+) s ago", out)
            # an answer given as current is at most status_max_age (the devcluster's: 2 s) old
            computed = time.time() - (int(age.group(1)) if age else BBSTAT_MAX_AGE)
            if not out.startswith("dsstage: the answer is being computed") and computed >= since - 1:
                return out.split("\n", 1)[1] if age else out
            time.sleep(0.5)
        raise AssertionError(f"bbstat {words} never answered with what came after {since}: {out}")

    def in_root(self, *argv: str) -> list[str]:
        """``argv`` where this cluster's Slurm is: in its series' root, or here (22.05)."""
        return [str(self.dir / "bin" / "in-root"), *argv] if self.series != "22.05" else list(argv)

    # -- commands ------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, user: str | None = None,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        cmd = list(argv)
        if user:
            import pwd
            gid = pwd.getpwnam(user).pw_gid
            cmd = ["setpriv", f"--reuid={user}", f"--regid={gid}", "--init-groups", "--", *cmd]
        res = subprocess.run(cmd, env=self.env, text=True, capture_output=True, timeout=kw.pop("timeout", 120),
                             cwd=kw.pop("cwd", str(self.jobs)), **kw)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} -> {res.returncode}\n{res.stdout}\n{res.stderr}")
        return res

    def dsstage(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(str(self.venv_bin / "dsstage"), *args)

    def sbatch(self, script: str, *opts: str, check: bool = True,
               user: str | None = None) -> subprocess.CompletedProcess[str]:
        path = self.jobs / f"job-{time.monotonic_ns()}.sh"
        path.write_text("#!/bin/bash\n" + script)
        path.chmod(0o755)
        return self.run("sbatch", "--parsable", "-o", str(self.jobs / "%j.out"), *opts, str(path),
                        check=check, user=user)

    def submit(self, script: str, *opts: str, user: str | None = None) -> str:
        return self.sbatch(script, *opts, user=user).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` of a job the test submitted, as Key=Value pairs: only for
        the tests' own jobs, whose names and comments hold no forged fields (dsstage itself
        reads squeue's fixed fields, see dsstage.slurm.parse_job_records)."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout.strip()
        out: dict[str, str] = {}
        matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=", line))
        for i, m in enumerate(matches):  # values may hold spaces (Comment=...)
            end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
            out.setdefault(m.group(1), line[m.end():end].strip())
        return out

    def wait(self, job_id: str, states: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                              "NODE_FAIL", "OUT_OF_MEMORY"),
             timeout: float = 180, held: bool = False) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if held and info.get("JobState") == "PENDING" and "held" in info.get("Reason", "").lower():
                return info
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} did not finish: {self.job(job_id)}")

    def state(self, job_id: str, state: str, timeout: float = 60) -> dict[str, str]:
        """Wait until the job is in ``state`` (a job shows RUNNING while its Prolog may still
        be at work); its ``job()`` record then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") == state:
                return info
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} never {state}: {self.job(job_id)}")

    def cancel_active(self, job_ids: list[str]) -> None:
        """scancel those of ``job_ids`` still pending, configuring or running (a test's end)."""
        active = [j for j in job_ids if self.job(j).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING")]
        if active:
            self.run("scancel", *active, check=False)

    def output(self, job_id: str) -> str:
        return (self.jobs / f"{job_id}.out").read_text()

    def start_now(self, job_id: str, node: str) -> None:
        """Start a released, requeued job now instead of after Slurm's requeue delay (BeginTime).
        The delay has a reason: slurmd remembers the kill of the first run, by the second, and
        refuses to launch the same job id again in that second ("Job N already killed, do not
        launch batch job"; the job ends FAILED, exit 1, run time 0, Restarts=1). So wait for
        ``node`` to be done with the first run and for the next second first (starting in the
        kill's second failed 4 times in 20 on the packages)."""
        deadline = time.monotonic() + 60
        while "completing" in self.node_state(node).lower() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.1 - time.time() % 1)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def node_state(self, node: str) -> str:
        return self.run("sinfo", "-h", "-N", "-n", node, "-o", "%T").stdout.strip()

    # -- catalog -----------------------------------------------------------------------

    def configure(self, **settings: Any) -> dict[str, Any]:
        """Set top-level keys of the cluster's dsstage.yaml; what they were (None: unset)."""
        conf_path = self.etc / "dsstage.yaml"
        conf = yaml.safe_load(conf_path.read_text())
        before = {k: conf.get(k) for k in settings}
        for k, v in settings.items():
            if v is None:
                conf.pop(k, None)
            else:
                conf[k] = v
        conf_path.write_text(yaml.safe_dump(conf))
        return before

    def add_dataset(self, name: str, files: dict[str, bytes], *, src: Path | None = None, **spec: Any) -> Path:
        """Add dataset NAME with ``files`` written to ``src`` (default: the cluster's data
        directory); a given ``src`` without ``files`` is taken as it is."""
        src = src or self.dir / "data" / name
        if src.exists() and files:
            shutil.rmtree(src)
        for rel, data in files.items():
            p = src / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        src.mkdir(parents=True, exist_ok=True)
        conf_path = self.etc / "dsstage.yaml"
        conf = yaml.safe_load(conf_path.read_text())
        conf["datasets"][name] = {"source": str(src), **spec}
        conf_path.write_text(yaml.safe_dump(conf))
        self.dsstage("manifest", "build", name)
        self.dsstage("export-catalog", "-o", str(self.etc / "dsstage_catalog.lua"))
        return src


def skip_without_cluster() -> None:
    if os.environ.get("DSSTAGE_SKIP_CLUSTER"):
        pytest.skip("DSSTAGE_SKIP_CLUSTER is set")
    if os.geteuid() != 0:
        pytest.skip("the cluster runs its daemons as root")


@contextmanager
def devcluster(name: str, port: int, *, top: Path = ROOT, sample_files: int = 300,
               services: bool = False, nodes: int = 3, backup: bool = False,
               previous: str = "") -> Iterator[Cluster]:
    """`packaging/devcluster up` of checkout TOP in /var/tmp/NAME-<pid> on PORT, of ``nodes``
    nodes; down and removed at the end. Without ``services`` the demand poller, prefetch and
    report refresh do not run: the tests run them at the moment they choose. ``backup``: two
    controllers (DEVCLUSTER_BACKUP). ``previous``: the nodes that run the previous release
    (DEVCLUSTER_PREVIOUS_NODES); ``Cluster.up_again`` changes them."""
    directory = Path(f"/var/tmp/{name}-{os.getpid()}")
    env = dict(os.environ, DEVCLUSTER_DIR=str(directory), DEVCLUSTER_PORT=str(port), DEVCLUSTER_NODES=str(nodes),
               DEVCLUSTER_SAMPLE_FILES=str(sample_files), DEVCLUSTER_SERVICES="1" if services else "0",
               DEVCLUSTER_BACKUP="1" if backup else "0", DEVCLUSTER_PREVIOUS_NODES=previous)
    script = str(top / "packaging" / "devcluster")
    up = subprocess.run([script, "up"], env=env, text=True, capture_output=True, timeout=1800)
    try:
        assert up.returncode == 0, f"devcluster up failed:\n{up.stdout}\n{up.stderr}"
        c = Cluster(directory, top)
        c.devcluster = (script, env)
        yield c
    finally:
        subprocess.run([script, "down"], env=env, timeout=120)
        left = daemons_of(directory)
        for pid in left:  # stopped by pid, so that the next cluster on this port can start
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)
        assert not left, f"processes of the cluster in {directory} outlived `devcluster down`: {left}"


def daemons_of(directory: Path) -> list[int]:
    """Pids of the running processes whose command line names a file of the cluster in
    ``directory`` (its slurm.conf, its munge key)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.startswith(os.fsencode(f"{directory}/etc/")) or a.startswith(os.fsencode(f"--key-file={directory}/"))
               for a in argv):
            found.append(int(proc.name))
    return found


@contextmanager
def hangable_mount(name: str, rate: int = 0, allow_other: bool = False) -> Iterator[Any]:
    """A latencyfs of /tmp/NAME-<pid>/backing on /tmp/NAME-<pid>/mnt that a test can make stop
    answering (``hang()``), or None where latencyfs cannot run (a test that needs it calls
    ``latencyfs.require()``); ``rate``: its bytes/s, all readers together (0: unlimited);
    ``allow_other``: jobs' users may read it (as a job under fallback or on a live view). Mounted
    before the cluster starts: a series' root binds /tmp
    when its slurmd starts, and sees only the mounts that were there then."""
    import latencyfs
    if latencyfs.unavailable() is not None:
        yield None
        return
    top = Path(f"/tmp/{name}-{os.getpid()}")
    (top / "backing").mkdir(parents=True, exist_ok=True)
    try:
        with latencyfs.LatencyFS(top / "backing", top / "mnt", delay_us=0, rate=rate,
                                 allow_other=allow_other) as fs:
            yield fs
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    skip_without_cluster()
    with hangable_mount("dsstage-hangfs") as fs, \
            hangable_mount("dsstage-slowfs", rate=SLOW_RATE, allow_other=True) as slow, \
            devcluster("dsstage-cluster-test", 26817) as c:
        c.hangfs, c.slowfs = fs, slow
        yield c


@pytest.fixture(name="daemons_of")
def daemons_of_fixture() -> Any:
    """daemons_of() itself."""
    return daemons_of


@pytest.fixture
def another_devcluster() -> Any:
    """devcluster() itself, for a test that needs a cluster of its own."""
    skip_without_cluster()
    return devcluster
