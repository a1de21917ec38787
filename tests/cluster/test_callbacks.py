"""What runs inside or beside Slurm, attacked by ordinary users on a real cluster: bbstat
loops while another user submits, bbstat's filters, a SPANK plugin of the user's own from
their own SLURM_CONF, a job submitted from inside a --dataset job, and PrivateData=jobs.

Users: ``daemon`` plays the attacker or the other user, ``nobody`` the one who submits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


def files(tag: str, n: int = 5, size: int = 20_000) -> dict[str, bytes]:
    return {f"{tag}/{i:03d}.bin": os.urandom(size) for i in range(n)}


def as_user(user: str, *cmd: str) -> list[str]:
    import pwd
    return ["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}", "--init-groups", "--", *cmd]


def dsstage_as(cluster, user: str, *args: str) -> str:
    """dsstage run by ``user``, from this checkout's venv wherever it is (under /root, 0700, in
    CI): the user keeps CAP_DAC_READ_SEARCH to reach it, which also lets it read the files
    PrivateData makes private (their modes are checked apart), so what it shows is decided
    by dsstage itself."""
    import pwd
    argv = ["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}", "--init-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--"]
    if cluster.series != "22.05":  # bubblewrap refuses a caller with capabilities: drop to the user inside
        return cluster.run(*cluster.in_root(*argv, "/opt/dsstage-venv/bin/dsstage", *args)).stdout
    return cluster.run(*argv, str(cluster.venv_bin / "dsstage"), *args).stdout


def test_a_users_bbstat_loops_never_delay_anothers_submissions(cluster):
    """Four shells of `while :; do scontrol show bbstat; done` (they made every sbatch of
    another user time out after MessageTimeout, 10 s): submissions are answered at once."""
    loop = ("end=$((SECONDS+25)); n=0; while [ $SECONDS -lt $end ]; do "
            "scontrol show bbstat node 'n[1-3]' >/dev/null 2>&1; scontrol show bbstat >/dev/null 2>&1; "
            "n=$((n+2)); done; echo $n")
    loops = [subprocess.Popen(as_user("daemon", "bash", "-c", loop), env=cluster.env, cwd="/",
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    jobs = []
    try:
        time.sleep(3)
        for _ in range(5):
            t = time.monotonic()
            res = cluster.run(*as_user("nobody", "sbatch", "--parsable", "-o", "/dev/null", "--hold", "--wrap",
                                       "true"), check=False)
            took = time.monotonic() - t
            assert res.returncode == 0, res.stderr
            jobs.append(res.stdout.strip().split(";")[0])
            assert took < 3, f"sbatch took {took:.1f} s while bbstat loops ran"
    finally:
        asked = [int(p.communicate(timeout=60)[0].strip() or 0) for p in loops]
        if jobs:
            cluster.run("scancel", *jobs, check=False)
    assert min(asked) > 20, f"the loops were not asking: {asked}"


def test_bbstat_filters_filter_on_every_series(cluster):
    cluster.add_dataset("bbfa", files("bbfa"))
    cluster.add_dataset("bbfb", files("bbfb"))
    for name, node in (("bbfa", "n1"), ("bbfb", "n2")):
        job = cluster.submit("true\n", f"--dataset={name}", "-w", node)
        assert cluster.wait(job)["JobState"] == "COMPLETED"
    since = time.time()  # the Epilogs have published the nodes' reports
    for words, shown, hidden in ((("dataset", "bbfa"), "bbfa", "bbfb"), (("node", "n2"), "bbfb", "bbfa")):
        out = cluster.bbstat(*words, since=since)
        datasets = out.split("Tiers")[0]
        assert shown in datasets and hidden not in datasets, out
    assert "usage: scontrol show bbstat" in cluster.run("scontrol", "show", "bbstat", "nodes", "n1").stdout
    # a hostlist of 10^8 names is refused from its text, before a name is made (it took gigabytes)
    t = time.monotonic()
    out = cluster.bbstat("node", "n[1-99999999]")
    assert "names 99999999 nodes, more than 100000" in out and time.monotonic() - t < 20, out


SPANK_FORGER = r"""
#include <slurm/spank.h>
SPANK_PLUGIN(forger, 1);
int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
    (void)ac; (void)av;
    if (spank_context() == S_CTX_ALLOCATOR || spank_context() == S_CTX_LOCAL)
        spank_job_control_setenv(sp, "SPANK_DSSTAGE_DATASETS", "forged", 1);
    return 0;
}
"""


def test_a_spank_plugin_of_the_users_own_cannot_change_what_is_staged(cluster, tmp_path):
    """The user points SLURM_CONF at their own copy whose plugstack also loads their own plugin,
    which sets SPANK_DSSTAGE_DATASETS: slurmd would pass it to the Prolog as it is, a request
    job_submit.lua never checked nor recorded. It is refused at submit."""
    cluster.add_dataset("forged", files("forged"))
    mine = Path(cluster.jobs) / f"forger-{os.getpid()}"
    mine.mkdir(mode=0o755, exist_ok=True)
    (mine / "forger.c").write_text(SPANK_FORGER)
    # against the cluster's own Slurm: a plugin is of one series
    subprocess.run(cluster.in_root("gcc", "-shared", "-fPIC", "-o", str(mine / "forger.so"), str(mine / "forger.c")),
                   check=True)
    plugstack = (cluster.etc / "plugstack.conf").read_text()
    (mine / "plugstack.conf").write_text(plugstack + f"required {mine / 'forger.so'}\n")
    conf = "".join(line for line in (cluster.etc / "slurm.conf").read_text().splitlines(keepends=True)
                   if not line.startswith("PlugStackConfig="))
    (mine / "slurm.conf").write_text(conf + f"PlugStackConfig={mine / 'plugstack.conf'}\n")
    for p in mine.iterdir():
        p.chmod(0o755 if p.suffix == ".so" else 0o644)
    env = dict(cluster.env, SLURM_CONF=str(mine / "slurm.conf"))
    try:
        res = subprocess.run(as_user("daemon", "sbatch", "--parsable", "-o", "/dev/null", "--dataset=sample",
                                     "--wrap", "true"), env=env, cwd="/", text=True, capture_output=True, timeout=60)
        assert res.returncode != 0, f"accepted as job {res.stdout}"
        assert "SPANK_DSSTAGE_DATASETS, which only Slurm may" in res.stderr, res.stderr
    finally:
        shutil.rmtree(mine, ignore_errors=True)


def test_a_job_submitted_from_a_dataset_job_asks_for_no_dataset(cluster):
    """Slurm exports --dataset to the tasks as the variable sbatch reads it from: a child
    `sbatch --wrap` (workflow engines, job chains) was recorded, staged and leased for the
    parent's datasets. It asks for none unless it names one."""
    script = ("sbatch --parsable -o /dev/null --hold --wrap true\n"
              "sbatch --parsable -o /dev/null --hold --dataset=sample --wrap true\n")
    job = cluster.submit(script, "--dataset=sample", "-w", "n1", user="daemon")
    assert cluster.wait(job)["JobState"] == "COMPLETED", cluster.output(job)
    child, named = cluster.output(job).split()[:2]
    try:
        assert "dsstage=" not in cluster.job(child).get("AdminComment", ""), cluster.job(child)
        assert cluster.job(named).get("AdminComment", "").strip() == "dsstage=sample"
    finally:
        cluster.run("scancel", child, named, check=False)


def names(text: str, job: str) -> bool:
    """Whether TEXT names job JOB as a word of its own: a job id may well occur inside a version's
    hash ('12' in '53e9312dd64d')."""
    return re.search(rf"(?<![0-9A-Za-z]){re.escape(job)}(?![0-9A-Za-z])", text) is not None


def test_where_slurm_hides_jobs_dsstage_hides_them_too(cluster):
    """PrivateData=jobs: another user's status and bbstat show counts, not the jobs; the demand
    snapshot is not theirs to read; the published node reports name no job or user."""
    conf = cluster.etc / "slurm.conf"
    kept = conf.read_text()
    state = cluster.dir / "dsstage-state"
    snapshots = {name: (state / name).read_bytes() if (state / name).exists() else None
                 for name in ("demand.json", "demand-summary.json")}
    conf.write_text(kept + "PrivateData=jobs\n")
    cluster.run("scontrol", "reconfigure")
    pending = None
    try:
        job = cluster.submit("true\n", "--dataset=sample", "-w", "n3", user="daemon")
        assert cluster.wait(job)["JobState"] == "COMPLETED"
        pending = cluster.submit("true\n", "--dataset=sample", "--hold", user="daemon")
        cluster.dsstage("demand-poller", "--once")
        assert stat.S_IMODE((state / "demand.json").stat().st_mode) == 0o600
        assert json.loads((state / "demand-summary.json").read_text())["datasets"]["sample"]["pending"] >= 1
        report = (state / "nodes" / "n3.json").read_text()
        assert "daemon" not in report and f'"{job}"' not in report, report
        out = dsstage_as(cluster, "nobody", "status")
        assert not names(out, pending) and "daemon" not in out, out
        assert "Other users' jobs are not shown" in out and "sample: 1 pending" in " ".join(out.split()), out
        out = cluster.bbstat(user="nobody")
        assert not names(out, pending) and "daemon" not in out and "Other users' jobs are not shown" in out, out
        own = dsstage_as(cluster, "daemon", "status")
        assert names(own, pending), own
    finally:
        if pending:
            cluster.run("scancel", pending, check=False)
        conf.write_text(kept)
        cluster.run("scontrol", "reconfigure")
        for name, data in snapshots.items():  # the other tests' queue, as it was
            if data is None:
                (state / name).unlink(missing_ok=True)
            else:
                (state / name).write_bytes(data)
        for node in ("n1", "n2", "n3"):  # and their reports with the jobs named again
            cluster.dsstage("--node", node, "report")
