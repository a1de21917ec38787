import json
import os
import re
from pathlib import Path

import pytest
import yaml
from dsstage.cli import main as cli
from dsstage.config import load, model
from dsstage.config import names as config_names
from dsstage.config import source as config_source
from dsstage.errors import ConfigError
from dsstage.slurm import conf as slurmconf
from dsstage.slurm.conf import check_host

ROOT = Path(__file__).resolve().parents[2]


def base(**over):
    data = {"state_dir": "/shared/dsstage",
            "tiers": {"nvme": {"path": "/local/nvme/{node}", "capacity": "3.5TB",
                               "high_watermark": "90%", "low_watermark": "75%"},
                      "ram": {"path": "/dev/shm/dsstage", "capacity": "64GB"}},
            "datasets": {"imagenet22t": {"source": "/lustre/datasets/imagenet22t", "tier": "nvme",
                                         "groups": ["ml"], "verify": "quick"}}}
    data.update(over)
    return data


def dataset(**spec):
    spec.setdefault("source", "/data/x")
    spec.setdefault("tier", "nvme")
    return base(datasets={"x": spec})


def error(data) -> str:
    with pytest.raises(ConfigError) as exc:
        load.from_dict(data, origin="/etc/dsstage/dsstage.yaml")
    return str(exc.value)


def test_valid_config():
    c = load.from_dict(base())
    assert c.tiers["nvme"].capacity == 3_500_000_000_000
    assert c.tiers["nvme"].root("n7") == "/local/nvme/n7"
    ds = c.datasets["imagenet22t"]
    assert ds.groups == ("ml",) and ds.verify == "quick" and ds.on_failure == "fallback"
    assert ds.source.kind == "local"
    assert c.slurm_bin == "/usr/bin" and c.slurm_command("scontrol") == "/usr/bin/scontrol"
    assert c.prolog_budget == 300.0 and c.source_user is None


def test_slurm_bin_prolog_budget_and_source_user():
    c = load.from_dict(base(slurm_bin="/opt/slurm/bin/", prolog_budget=120, source_user="dsstage-svc"))
    assert c.slurm_command("squeue") == "/opt/slurm/bin/squeue"
    assert c.prolog_budget == 120.0 and c.source_user == "dsstage-svc"
    assert load.from_dict(base(source_user="svc.data@ad")).source_user == "svc.data@ad"


def test_report_fleet_and_metrics_sections():
    c = load.from_dict(base())
    assert (c.report.user, c.report.interval, c.report.max_age) == (None, 5.0, 900.0)
    assert c.fleet.command == ("dsstage",) and c.fleet.port == 22 and c.metrics.textfile is None
    c = load.from_dict(base(report={"user": "dsstage", "max_age": "10m"},
                              fleet={"user": "admin", "port": 2222, "key": "/etc/dsstage/key",
                                     "connect_timeout": "5s", "parallel": 8, "command": ["/opt/ds/bin/dsstage"]},
                              metrics={"textfile": "/var/lib/prometheus/node-exporter/dsstage.prom"}))
    assert (c.report.user, c.report.max_age) == ("dsstage", 600.0)
    assert (c.fleet.user, c.fleet.port, c.fleet.key, c.fleet.connect_timeout, c.fleet.parallel) == \
        ("admin", 2222, "/etc/dsstage/key", 5.0, 8)
    assert c.fleet.command == ("/opt/ds/bin/dsstage",)
    assert c.burst_buffer.user is None
    assert load.from_dict(base(burst_buffer={"user": "slurm"})).burst_buffer.user == "slurm"
    assert c.metrics.textfile == "/var/lib/prometheus/node-exporter/dsstage.prom"


def test_retention_defaults_and_durations():
    r = load.from_dict(base()).retention
    assert (r.min_keep, r.max_idle, r.demand_max_age, r.poll_interval) == (600, 0, 300, 30)
    r = load.from_dict(base(retention={"min_keep": "1h", "max_idle": "3d", "demand_max_age": "10m",
                                         "poll_interval": 60, "manifest_keep": "2w"})).retention
    assert (r.min_keep, r.max_idle, r.demand_max_age, r.poll_interval, r.manifest_keep) == \
        (3600, 3 * 86400, 600, 60, 14 * 86400)


def test_example_config_is_valid():
    c = load.from_dict(yaml.safe_load((ROOT / "conf" / "dsstage.yaml.example").read_text()))
    assert c.datasets and c.tiers
    assert c.prolog_budget == 300 and c.slurm_bin == "/usr/bin" and c.source_user is None


def test_the_example_installed_as_the_live_configuration_has_no_ram_tier():
    """Issue 54: the packages install the example as /etc/dsstage/dsstage.yaml, and it had a
    64 GB tier in /dev/shm, memory outside every job's cgroup: shipped commented out now."""
    c = load.from_dict(yaml.safe_load((ROOT / "conf" / "dsstage.yaml.example").read_text()))
    assert not [t.name for t in c.tiers.values() if t.path.startswith(("/dev/shm", "/run", "/tmp"))]
    assert "#   path: /dev/shm/dsstage" in (ROOT / "conf" / "dsstage.yaml.example").read_text()


@pytest.mark.parametrize("data,needle", [
    (dataset(tier="nvm"), "datasets.x.tier: unknown tier 'nvm' (tiers: nvme, ram); did you mean 'nvme'?"),
    (dataset(source="datasets/x"), "datasets.x.source: 'datasets/x' is a relative path"),
    (dataset(source="host:data/x"), "relative to a home directory"),
    (dataset(source="rsync://host"), "lacks a module"),
    (dataset(source="/data/../etc"), "contains '..'"),
    (dataset(verify="fast"), "datasets.x.verify: 'fast' is not one of quick, full"),
    (dataset(groups="  "), "datasets.x.groups"),
    (dataset(groups=[]), "datasets.x.groups: must be a list of Unix group names"),
    (dataset(on_failure="crash"), "datasets.x.on_failure"),
    (dataset(sorce="/x"), "datasets.x.sorce: unknown key; did you mean 'source'?"),
    (base(datasets={"ImageNet": {"source": "/x", "tier": "nvme"}}), "dataset name 'ImageNet' is not allowed"),
    (base(datasets={"../etc": {"source": "/x", "tier": "nvme"}}), "is not allowed"),
    (base(tiers={"nvme": {"path": "/l", "capacity": "lots"}}), "tiers.nvme.capacity: 'lots' is not a size"),
    (base(tiers={"nvme": {"path": "/l", "capacity": "1TB", "high_watermark": "70%", "low_watermark": "80%"}}),
     "tiers.nvme.low_watermark: 80% must be below high_watermark 70%"),
    (base(tiers={"nvme": {"path": "relative", "capacity": "1TB"}}), "tiers.nvme.path: 'relative' is not an absolute"),
    (base(tiers={"nvme": {"path": "/", "capacity": "1TB"}}), "refusing the filesystem root"),
    (base(tiers={}), "tiers: define at least one storage tier"),
    (base(state_dir=None), "state_dir: missing"),
    (base(state_dir="rel"), "state_dir: 'rel' is not an absolute path"),
    (base(statedir="/x"), "statedir: unknown key; did you mean 'state_dir'?"),
    (base(on_failure="maybe"), "on_failure: 'maybe' is not one of fallback, hold"),
    (base(transfer={"streams": 0}), "transfer.streams: 0 is not a number >= 1"),
    ([1, 2], "the file must be a YAML mapping"),
    (base(slurm_bin="bin"), "slurm_bin: 'bin' is not an absolute path"),
    (base(prolog_budget=0), "prolog_budget: 0 is not a number >= 1"),
    (base(prolog_budget="5m"), "prolog_budget: '5m' is not a number >= 1"),
    (base(prologbudget=60), "prologbudget: unknown key; did you mean 'prolog_budget'?"),
    (base(source_user="1000"), "source_user: '1000' is not a Unix user name"),
    (base(source_user="-svc"), "is not a Unix user name"),
    (base(source_user="svc data"), "source_user: 'svc data' is not a Unix user name"),
    (base(source_user="svc\n"), "source_user: 'svc\\n' is not a Unix user name"),
    (base(source_user=""), "source_user: '' is not a Unix user name"),
    (dataset(groups=["ml\n"]), "datasets.x.groups: must be a list of Unix group names"),
    (base(retention={"min_keep": "soon"}), "retention.min_keep: 'soon' is not a duration: write e.g. 90s"),
    (base(retention={"minkeep": "1h"}), "retention.minkeep: unknown key; did you mean 'min_keep'?"),
    (base(retention={"poll_interval": "0.5"}), "retention.poll_interval: must be at least 1s"),
    (base(retention={"poll_interval": "1m", "demand_max_age": "90s"}),
     "retention.demand_max_age: 90s is less than two poll intervals (120s)"),
    (base(retention=[]), "retention: must be a mapping"),
    (base(report={"max_age": "30s"}), "report.max_age: 30s is too short"),
    (base(report={"user": "svc data"}), "report.user: 'svc data' is not a Unix user name"),
    (base(burst_buffer={"user": "slurm user"}), "burst_buffer.user: 'slurm user' is not a Unix user name"),
    (base(burst_buffer={"users": "slurm"}), "burst_buffer.users: unknown key; did you mean 'user'?"),
    (base(fleet={"port": 70000}), "fleet.port: 70000 is not a TCP port"),
    (base(fleet={"command": "dsstage --config x"}), "fleet.command: give the remote dsstage command as a list"),
    (base(fleet={"command": []}), "fleet.command: give the remote dsstage command as a list"),
    (base(fleet={"key": "id_ed25519"}), "fleet.key: 'id_ed25519' is not an absolute path"),
    (base(metrics={"textfile": "dsstage.prom"}), "metrics.textfile: 'dsstage.prom' is not an absolute path"),
])
def test_config_errors_name_file_key_and_fix(data, needle):
    msg = error(data)
    assert msg.startswith("/etc/dsstage/dsstage.yaml: ")
    assert needle in msg


INJECTED = "\nexport LD_PRELOAD=/tmp/evil.so"


@pytest.mark.parametrize("data,key", [
    (base(state_dir="/shared/dsstage" + INJECTED), "state_dir"),
    (base(tiers={"nvme": {"path": "/local/nvme" + INJECTED, "capacity": "1TB"}}), "tiers.nvme.path"),
    (dataset(source="/data/x" + INJECTED), "datasets.x.source"),
    (dataset(source="fs01:/export/x" + INJECTED), "datasets.x.source"),
    (dataset(source="rsync://fs01/datasets/x" + INJECTED), "datasets.x.source"),
    (dataset(source="/data/x\r"), "datasets.x.source"),
    (dataset(description="line one\nline two"), "datasets.x.description"),
    (base(transfer={"rsh": "ssh\t-o BatchMode=yes"}), "transfer.rsh"),
    (base(slurm_bin="/usr/bin\x7f"), "slurm_bin"),
    (base(state_dir="/shared/\x1b[2Jdsstage"), "state_dir"),
])
def test_control_characters_are_refused_with_the_key(data, key):
    msg = error(data)
    assert msg.startswith(f"/etc/dsstage/dsstage.yaml: {key}: ")
    assert "contains a control character" in msg and "printable characters only" in msg


def test_control_character_message_says_where():
    assert config_names.control_char("/ok/path") is None
    assert "(U+000A at position 3)" in config_names.control_char("/a\nb")
    assert "(U+007F at position 1)" in config_names.control_char("\x7f")


def test_dataset_names_with_one_environment_variable_are_refused():
    data = base(datasets={"a.b": {"source": "/d/1", "tier": "nvme"}, "a-c": {"source": "/d/2", "tier": "nvme"},
                          "a-b": {"source": "/d/3", "tier": "nvme"}})
    msg = error(data)
    assert msg == ("/etc/dsstage/dsstage.yaml: datasets.a-b: gives the same environment variable DSSTAGE_PATH_A_B "
                   "as dataset 'a.b' ('.', '-' and '_' all become '_'): rename one of the two")
    del data["datasets"]["a.b"]
    assert sorted(load.from_dict(data).datasets) == ["a-b", "a-c"]


SLURM_CONF = """
# PrologEpilogTimeout=5  (a comment)
ClusterName=dev
prologepilogtimeout=120
PrologFlags=Alloc  PROLOGEPILOGTIMEOUT = 600   # the last one wins
NodeName=n1 Port=17001  # PrologEpilogTimeout=7
"""


@pytest.mark.parametrize("text,seconds", [
    (SLURM_CONF, 600.0),
    ("ClusterName=dev\n", None),  # absent: slurmd waits forever
    ("PrologEpilogTimeout=65534\n", None),  # NO_VAL16, what 22.05 stores when it is absent
    ("PrologEpilogTimeout=0\n", None),  # a zero timeout is a blocking wait
    ("PrologEpilogTimeout=UNLIMITED\n", 65535.0),  # INFINITE16: slurmd waits 65535 s
    ("PrologEpilogTimeout=infinite\n", 65535.0),
    ('PrologEpilogTimeout="90"\n', 90.0),
    ("PrologEpilogTimeout=0x3c\n", 60.0),  # strtoul(value, 0)
    ("PrologEpilogTimeout=010\n", 8.0),
    ("Prolog=/x \\\n  PrologEpilogTimeout=45\n", 45.0),
    ("#PrologEpilogTimeout=45\n", None),
])
def test_prolog_epilog_timeout_from_slurm_conf(text, seconds):
    assert slurmconf.prolog_epilog_timeout(text) == seconds


@pytest.mark.parametrize("text", ["PrologEpilogTimeout=5min\n", "PrologEpilogTimeout=70000\n",
                                  "PrologEpilogTimeout=-1\n"])
def test_prolog_epilog_timeout_slurm_would_refuse(text):
    with pytest.raises(ValueError, match="PrologEpilogTimeout="):
        slurmconf.prolog_epilog_timeout(text)


def test_prolog_budget_against_the_timeout():
    where = "/etc/slurm/slurm.conf"
    assert slurmconf.budget_problem(300, None, where) is None
    assert slurmconf.budget_problem(300, 331, where) is None
    msg = slurmconf.budget_problem(300, 330, where)
    assert msg == ("300 s plus a safety margin of 30 s is not below PrologEpilogTimeout=330 in /etc/slurm/slurm.conf: "
                   "slurmd would kill a Prolog that used its budget and drain the node; lower prolog_budget below "
                   "300 or raise PrologEpilogTimeout in /etc/slurm/slurm.conf above 330")
    assert "lower prolog_budget" not in slurmconf.budget_problem(60, 20, where)


def test_check_host(tmp_path):
    conf = load.from_dict(base(prolog_budget=600, slurm_bin=str(tmp_path)))
    slurm_conf = tmp_path / "slurm.conf"

    def check(c=conf):
        found, problems = check_host(c, str(slurm_conf))
        return found, [p for p in problems if p.key not in ("PrivateData", "PrologFlags", "spank", "hooks")]
    slurm_conf.write_text("PrologEpilogTimeout=600\nSchedulerParameters=bf_interval=5,ignore_prefer_validation\n")
    found, problems = check()
    assert found == {"slurm_conf": str(slurm_conf), "read": True, "prolog_epilog_timeout": 600.0,
                     "prolog_timeout_key": "PrologEpilogTimeout", "prolog_flags": [], "private_jobs": False,
                     "files": [str(slurm_conf)], "largest_job": None}
    assert [(p.level, p.key) for p in problems] == [("error", "prolog_budget"), ("note", "slurm_bin")]
    assert f"{tmp_path}/scontrol is not an executable" in problems[1].message
    slurm_conf.write_text("PrologEpilogTimeout=900\nSchedulerParameters=ignore_prefer_validation\n")
    assert [p.level for p in check()[1]] == ["note"]
    slurm_conf.write_text("PrologEpilogTimeout=900\n")
    assert [(p.level, p.key) for p in check()[1]] == [("error", "placement.prefer"), ("note", "slurm_bin")]
    no_prefer = load.from_dict(base(prolog_budget=600, slurm_bin=str(tmp_path), placement={"prefer": False}))
    assert [p.level for p in check(no_prefer)[1]] == ["note"]
    slurm_conf.write_text("include timeouts.conf\n")
    problems = check(no_prefer)[1]
    message = problems[0].message
    assert problems[0].level == "note" and f"Include {tmp_path}/timeouts.conf: No such file" in message, message
    found, problems = check_host(conf, str(tmp_path / "none.conf"))
    assert found["read"] is False
    assert problems[0].level == "note" and "cannot read" in problems[0].message


@pytest.mark.parametrize("text, key, seconds", [
    ("PrologEpilogTimeout=600\n", "PrologEpilogTimeout", 600.0),
    ("PrologEpilogTimeout=600\nPrologTimeout=120\nEpilogTimeout=900\n", "PrologTimeout", 120.0),  # 25.05
    ("PrologTimeout=0\n", "PrologTimeout", None),
])
def test_the_prolog_is_bounded_by_prologtimeout_where_slurm_has_it(text, key, seconds):
    assert slurmconf.prolog_timeout(text) == (key, seconds)
    conf = load.from_dict(base(prolog_budget=300))
    msg = slurmconf.budget_problem(300, 120, "/s", key)
    assert msg is not None and f"not below {key}=120" in msg and f"raise {key} in /s" in msg
    assert conf.prolog_budget == 300


@pytest.mark.parametrize("flags, errors", [
    ("PrologFlags=Alloc", []), ("PrologFlags=alloc,serial", []), ("PrologFlags=Contain", []),
    ("PrologFlags=X11", []), ("", ["no PrologFlags=Alloc"]), ("PrologFlags=Serial", ["no PrologFlags=Alloc"]),
    ("PrologFlags=Alloc,RunInJob", ["RunInJob"]), ("PrologFlags=RunInJob", ["RunInJob"]),
])
def test_check_host_refuses_prologs_that_do_not_run_at_allocation_or_run_in_the_job(tmp_path, flags, errors):
    slurm_conf = tmp_path / "slurm.conf"
    slurm_conf.write_text(f"PrologEpilogTimeout=900\nSchedulerParameters=ignore_prefer_validation\n{flags}\n")
    _found, problems = check_host(load.from_dict(base(prolog_budget=600)), str(slurm_conf))
    got = [p for p in problems if p.key == "PrologFlags"]
    assert [p.level for p in got] == ["error"] * len(errors)
    for p, needle in zip(got, errors):
        assert needle in p.message and ("add PrologFlags=Alloc" in p.message or "remove RunInJob" in p.message)


@pytest.mark.parametrize("line, hidden", [("PrivateData=jobs", True), ("privatedata=usage,Jobs,users", True),
                                          ("PrivateData=usage", False), ("#PrivateData=jobs", False),
                                          ("PrivateData=jobs\nPrivateData=usage", False), ("", False)])
def test_check_host_says_what_privatedata_hides(tmp_path, line, hidden):
    slurm_conf = tmp_path / "slurm.conf"
    slurm_conf.write_text(f"PrologEpilogTimeout=900\n{line}\n")
    found, problems = check_host(load.from_dict(base(prolog_budget=600)), str(slurm_conf))
    note = next(p for p in problems if p.key == "PrivateData")
    assert found["private_jobs"] is hidden and note.level == "note"
    assert ("dsstage hides other users' jobs too" if hidden else "every user sees every queued job") in note.message


def test_slurm_conf_path():
    assert slurmconf.slurm_conf_path({}) == "/etc/slurm/slurm.conf"
    assert slurmconf.slurm_conf_path({"SLURM_CONF": "/x/slurm.conf"}) == "/x/slurm.conf"


def test_check_config_command(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, yaml.safe_dump(base(prolog_budget=600)))
    slurm_conf = tmp_path / "slurm.conf"
    slurm_conf.write_text("PrologEpilogTimeout=600\n")
    monkeypatch.setenv("SLURM_CONF", str(slurm_conf))
    assert cli.main(["--config", path, "check-config", "--json"]) == 78
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["ok"] is False and data["prolog_budget"] == 600.0 and data["slurm_bin"] == "/usr/bin"
    assert data["source_user"] is None and data["slurm"]["prolog_epilog_timeout"] == 600.0
    assert [p["level"] for p in data["problems"] if p["key"] == "prolog_budget"] == ["error"]
    assert err.startswith(f"dsstage: error: {path}: prolog_budget: 600 s plus a safety margin")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent.conf"))
    assert cli.main(["--config", path, "check-config"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"{path}: OK\n") and "prolog_budget  600s (PrologEpilogTimeout: not read" in out
    assert "note: prolog_budget: cannot read" in out and err == ""


def test_tier_is_optional_with_one_tier():
    data = base(tiers={"nvme": {"path": "/l", "capacity": "90%"}}, datasets={"x": {"source": "/x"}})
    c = load.from_dict(data)
    assert c.datasets["x"].tier == "nvme"
    assert c.tiers["nvme"].capacity == 0.9


def test_sources_are_classified():
    assert config_source.parse_source("/lustre/a/").kind == "local"
    assert config_source.parse_source("fs01:/export/a").kind == "ssh"
    assert config_source.parse_source("user@fs01:/export/a").kind == "ssh"
    s = config_source.parse_source("rsync://fs01:8730/datasets/a")
    assert s.kind == "daemon" and s.rsync_base() == "rsync://fs01:8730/datasets/a/"


def write(tmp_path, text, mode=0o644):
    p = tmp_path / "dsstage.yaml"
    p.write_text(text)
    os.chmod(p, mode)
    return str(p)


def test_load_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="no such file; copy conf/dsstage.yaml.example"):
        load.load(str(tmp_path / "nope.yaml"))


def test_load_bad_yaml_gives_line(tmp_path):
    path = write(tmp_path, "state_dir: /x\ntiers: [\n")
    with pytest.raises(ConfigError, match=r"not valid YAML.*line"):
        load.load(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="ownership checks are about root")
def test_writable_config_is_refused(tmp_path):
    path = write(tmp_path, yaml.safe_dump(base()), mode=0o666)
    with pytest.raises(ConfigError, match=r"writable by group or others.*chmod go-w"):
        load.load(path)
    os.chmod(path, 0o644)
    os.chown(path, 65534, 0)
    with pytest.raises(ConfigError, match=r"owned by uid 65534.*chown root:root"):
        load.load(path)
    os.chown(path, 0, 0)
    assert load.load(path).datasets


def test_env_var_selects_file(tmp_path, monkeypatch):
    path = write(tmp_path, yaml.safe_dump(base()))
    monkeypatch.setenv("DSSTAGE_CONFIG", path)
    assert load.config_path() == path
    assert load.load().origin == path


def test_prefetch_and_placement_sections():
    base = yaml.safe_load((ROOT / "conf" / "dsstage.yaml.example").read_text())
    c = load.from_dict(base)
    assert c.prefetch == model.Prefetch(horizon=1800, interval=30, bwlimit=0, io_class="idle")
    assert c.placement == model.Placement(features=True, prefer=True, prefix="ds_")
    c = load.from_dict({**base, "prefetch": {"bwlimit": "500MB", "io_class": "best-effort"},
                          "placement": {"prefer": False}})
    assert c.prefetch.bwlimit == 500_000_000 and c.prefetch.io_class == "best-effort" and not c.placement.prefer
    for bad, needle in [({"prefetch": {"io_class": "rt"}}, "prefetch.io_class: 'rt' is not one of idle, best-effort"),
                        ({"prefetch": {"interval": "0s"}}, "prefetch.interval: must be at least 1s"),
                        ({"placement": {"prefer": "yes"}}, "placement.prefer: 'yes' is not true or false"),
                        ({"placement": {"prefix": "ds&"}}, "placement.prefix: 'ds&'"),
                        ({"prefetch": {"horizont": "1h"}}, "prefetch.horizont")]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load.from_dict({**base, **bad})


def test_sources_budgets_are_checked_and_matched_by_the_longest_prefix():
    conf = load.from_dict(base(sources={"lustre": {"prefix": "/lustre/", "max_in_flight": 512},
                                        "scratch": {"prefix": "/lustre/scratch/", "max_in_flight": 64}}))
    assert conf.budget_of(model.Source(raw="/lustre/scratch/x", kind="local", path="/lustre/scratch/x")).name == \
        "scratch"
    assert conf.budget_of(model.Source(raw="/lustre/proj/x", kind="local", path="/lustre/proj/x")).name == "lustre"
    assert conf.budget_of(model.Source(raw="/data/x", kind="local", path="/data/x")) is None
    assert "sources.a.max_in_flight: " in error(base(sources={"a": {"prefix": "/x", "max_in_flight": 0}}))
    assert load.from_dict(base(sources={"a": {"prefix": "/x", "max_in_flight": 3, "limit": 3}})).unknown_keys == \
        ("sources.a.limit",)  # like no key known: a newer version's, ignored (test_a_newer_versions_key...)
    assert "sources.a.prefix: " in error(base(sources={"a": {"prefix": "", "max_in_flight": 3}}))


def test_watermarks_default_to_99_and_97_and_a_high_mark_alone_stays_valid():
    def marks(**spec: str) -> tuple[float, float]:
        t = load.from_dict(base(tiers={"nvme": {"path": "/l", "capacity": "1TB", **spec}})).tiers["nvme"]
        return t.high_watermark, t.low_watermark
    assert marks() == (0.99, 0.97)
    # a configuration written for the former defaults, with only its high mark, still loads
    assert marks(high_watermark="90%") == (0.90, 0.88)
    assert marks(high_watermark="3%") == (0.03, 0.01)
    assert marks(high_watermark="1%") == (0.01, 0.0)
    assert marks(high_watermark="80%", low_watermark="50%") == (0.80, 0.50)


def test_a_tier_says_whether_it_may_be_on_the_root_filesystem():
    tiers = load.from_dict(base(tiers={"nvme": {"path": "/local/nvme", "capacity": "1TB"},
                                       "test": {"path": "/var/tmp/t", "capacity": "1GB", "root_filesystem": True}}))
    assert tiers.tiers["nvme"].root_filesystem is False and tiers.tiers["test"].root_filesystem is True
    msg = error(base(tiers={"nvme": {"path": "/l", "capacity": "1TB", "root_filesystem": "yes"}}))
    assert "tiers.nvme.root_filesystem" in msg and "is not true or false" in msg


def test_check_config_refuses_a_tier_found_on_the_root_filesystem(tmp_path, monkeypatch, capsys, on_root_filesystem):
    """A directory on the root filesystem, as an unmounted disk's mount point is (made by the
    test: tmp_path is on a tmpfs where /tmp is one)."""
    (on_root_filesystem / "nvme").mkdir()
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent.conf"))
    for flag, rc in ((False, 78), (True, 0)):
        data = base(prolog_budget=600, tiers={"nvme": {"path": str(on_root_filesystem / "nvme"), "capacity": "1GB",
                                                       "root_filesystem": flag}})
        path = write(tmp_path, yaml.safe_dump(data))
        assert cli.main(["--config", path, "check-config"]) == rc
        _out, err = capsys.readouterr()
        assert ("tiers.nvme: " in err and "is on the root filesystem: is the disk mounted?" in err) is (not flag), err


def test_the_budget_is_checked_against_epilog_timeout_too(tmp_path):
    from dsstage.slurm.conf import check_host
    c = load.from_dict({"state_dir": "/s", "tiers": {"n": {"path": "/l", "capacity": "1TB"}},
                        "datasets": {"a": {"source": "/d"}}, "prolog_budget": 300, "placement": {"prefer": False}})
    conf = tmp_path / "slurm.conf"
    conf.write_text("PrologTimeout=900\nEpilogTimeout=120\nPrologFlags=Alloc\n")
    problems = [p for p in check_host(c, str(conf))[1] if p.key == "prolog_budget"]
    assert len(problems) == 1 and "EpilogTimeout=120" in problems[0].message and "an Epilog" in problems[0].message
    conf.write_text("PrologTimeout=900\nEpilogTimeout=900\nPrologFlags=Alloc\n")
    assert not [p for p in check_host(c, str(conf))[1] if p.key == "prolog_budget"]


def test_a_tier_on_the_jobs_scratch_filesystem_is_said_with_the_fix(tmp_path):
    """A node-local disk shared with job scratch (TmpFS, job_container/tmpfs's BasePath): the
    tier fills to its watermark whatever jobs wrote, so check-config says so and how to leave
    them room; a tier on another filesystem is not named."""
    from dsstage.slurm.conf import scratch_problems
    tier = tmp_path / "nvme" / "n1"
    tier.mkdir(parents=True)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    conf = load.from_dict(base(tiers={"nvme": {"path": str(tmp_path / "nvme" / "{node}"), "capacity": "100GB"}}))
    where = str(tmp_path / "slurm.conf")
    [p] = scratch_problems(conf, f"TmpFS={scratch}\n", where, "n1")
    assert p.key == "tiers.nvme" and f"where jobs write scratch ({scratch}, from {where})" in p.message
    assert "a capacity below the disk by what jobs write (a reserve), or a quota" in p.message
    # job_container/tmpfs: its BasePath beside slurm.conf counts too
    (tmp_path / "job_container.conf").write_text(f"AutoBasePath=true\nBasePath={scratch}\n")
    found = scratch_problems(conf, "TmpFS=/nonexistent\nJobContainerType=job_container/tmpfs\n", where, "n1")
    assert [q.key for q in found] == ["tiers.nvme"]
    assert scratch_problems(conf, f"TmpFS={scratch}\n", where, "n2") == []  # no tier of n2 on this host
    if os.stat("/proc").st_dev != os.stat(tier).st_dev:
        assert scratch_problems(conf, "TmpFS=/proc\n", where, "n1") == []  # another filesystem: nothing said


def test_a_newer_versions_key_is_ignored_and_said_a_misspelt_one_refused():
    """Upgrades one node at a time: a key a newer dsstage added (like none this version knows)
    must not hold every dataset job on a node not upgraded yet; it is ignored and kept in
    unknown_keys (check-config and the hooks say it). A key like a known one is a typo: refused."""
    conf = load.from_dict(base(live_views={"start": "at-once"}, fleet={"bastion": "b1"}, retention={"min_keep": "1h"}))
    assert conf.unknown_keys == ("live_views", "fleet.bastion")
    assert "retention.minkeep: unknown key; did you mean 'min_keep'?" in error(base(retention={"minkeep": "1h"}))
