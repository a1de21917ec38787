"""check-config reads the Slurm configuration an admin actually has: Include files, a
configless node's copy, Prolog/Epilog lines with lists and globs, one TaskProlog, the last
SchedulerParameters, and a RAM tier job_container/tmpfs would hide."""

from __future__ import annotations

from pathlib import Path

from dsstage.config import load
from dsstage.slurm import conffile
from dsstage.slurm.conf import check_host

HOOKS = "Prolog={d}/dsstage-prolog\nEpilog={d}/dsstage-epilog\nTaskProlog={d}/dsstage-taskprolog\n"


def conf(tmp_path: Path, **extra):
    return load.from_dict({"state_dir": "/s", "prolog_budget": 60, "slurm_bin": str(tmp_path),
                           "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}},
                           "datasets": {"coco": {"source": "/d/c"}}, **extra})


def hooks_dir(tmp_path: Path) -> Path:
    d = tmp_path / "libexec"
    d.mkdir(exist_ok=True)
    for name in ("dsstage-prolog", "dsstage-epilog", "dsstage-taskprolog"):
        (d / name).write_text("#!/bin/sh\n")
    return d


def problems(c, path: Path, key: str | None = None) -> list[str]:
    return [f"{p.level}: {p.message}" for p in check_host(c, str(path))[1] if key is None or p.key == key]


def test_include_files_are_read_in_place_globs_and_nesting_included(tmp_path: Path):
    (tmp_path / "slurm.conf.d").mkdir()
    (tmp_path / "slurm.conf.d" / "10-timeouts.conf").write_text("PrologEpilogTimeout=100\ninclude more.conf\n")
    (tmp_path / "more.conf").write_text("SchedulerParameters=ignore_prefer_validation\n")
    main = tmp_path / "slurm.conf"
    main.write_text("PrologEpilogTimeout=900\nInclude slurm.conf.d/*.conf\n")
    read = conffile.read(str(main))
    assert read.files == [str(main), str(tmp_path / "slurm.conf.d" / "10-timeouts.conf"), str(tmp_path / "more.conf")]
    # the included timeout comes later and wins: 60 s + 30 s margin is not below 100
    assert problems(conf(tmp_path), main, "prolog_budget") == []
    (tmp_path / "slurm.conf.d" / "10-timeouts.conf").write_text("PrologEpilogTimeout=80\n")
    assert problems(conf(tmp_path), main, "prolog_budget")[0].startswith("error: 60 s plus a safety margin")


def test_a_configless_node_is_checked_against_slurmds_copy(tmp_path: Path):
    cache = tmp_path / "run-slurm-conf"
    cache.mkdir()
    (cache / "slurm.conf").write_text("PrologEpilogTimeout=900\n")
    path, configless = conffile.locate(str(tmp_path / "etc" / "slurm.conf"), (str(cache),))
    assert (path, configless) == (str(cache / "slurm.conf"), True)


def test_the_hooks_may_be_lists_globs_or_a_site_wrapper(tmp_path: Path):
    d = hooks_dir(tmp_path)
    main = tmp_path / "slurm.conf"
    c = conf(tmp_path)
    main.write_text("SchedulerParameters=ignore_prefer_validation\n" + HOOKS.format(d=d))
    assert problems(c, main, "hooks") == []
    (tmp_path / "prolog.d").mkdir()
    (tmp_path / "prolog.d" / "50-dsstage").symlink_to(d / "dsstage-prolog")
    (tmp_path / "site-prolog").write_text("#!/bin/sh\n")
    wrapper = tmp_path / "site-taskprolog"
    wrapper.write_text(f"#!/bin/sh\n/site/taskprolog\n{d}/dsstage-taskprolog\n")
    main.write_text(f"Prolog=site-prolog,prolog.d/*\nEpilog={d}/dsstage-epilog\nTaskProlog={wrapper}\n")
    assert problems(c, main, "hooks") == []
    main.write_text(f"Prolog={tmp_path}/site-prolog\nTaskProlog=/site/taskprolog\n")
    got = problems(c, main, "hooks")
    assert len(got) == 3, got
    assert "no Prolog runs dsstage's (Prolog: " + str(tmp_path / "site-prolog") in got[0]
    assert "no Epilog runs dsstage's (Epilog: none)" in got[1]
    assert "TaskProlog=/site/taskprolog does not run dsstage's: Slurm runs one TaskProlog" in got[2]


def test_only_the_last_scheduler_parameters_line_counts(tmp_path: Path):
    main = tmp_path / "slurm.conf"
    main.write_text("SchedulerParameters=ignore_prefer_validation\nSchedulerParameters=bf_interval=30\n")
    assert problems(conf(tmp_path), main, "placement.prefer")[0].startswith("error: ")
    main.write_text("SchedulerParameters=bf_interval=30\nSchedulerParameters=bf_interval=5,ignore_prefer_validation\n")
    assert problems(conf(tmp_path), main, "placement.prefer") == []


def test_a_ram_tier_under_dev_shm_is_hidden_by_job_container_tmpfs(tmp_path: Path):
    c = conf(tmp_path, tiers={"ram": {"path": "/dev/shm/dsstage", "capacity": "10GB"}},
             datasets={"coco": {"source": "/d/c", "tier": "ram"}})
    main = tmp_path / "slurm.conf"
    main.write_text("JobContainerType=job_container/tmpfs\n")
    got = problems(c, main, "tiers.ram")
    assert got and "gives each job its own /dev/shm" in got[0] and got[0].startswith("error: ")
    main.write_text("JobContainerType=job_container/none\n")
    assert problems(c, main, "tiers.ram") == []


def test_the_largest_job_is_the_largest_partition_or_every_node():
    from dsstage.slurm.conf import largest_job
    nodes = "NodeName=DEFAULT CPUs=4\nNodeName=gpu[01-32] Gres=gpu:8\nNodeName=cpu[1-8]\n"
    assert largest_job(nodes) == 40
    assert largest_job(nodes + "PartitionName=gpu Nodes=gpu[01-32] MaxNodes=16\nPartitionName=cpu MaxNodes=4\n") == 16
    assert largest_job(nodes + "PartitionName=all MaxNodes=UNLIMITED\nPartitionName=b MaxNodes=2\n") == 40
    assert largest_job("PartitionName=x MaxNodes=3\n") is None
