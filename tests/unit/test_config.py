import os
from pathlib import Path

import pytest
import yaml
from dsstage import config
from dsstage.errors import ConfigError

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
        config.from_dict(data, origin="/etc/dsstage/dsstage.yaml")
    return str(exc.value)


def test_valid_config():
    c = config.from_dict(base())
    assert c.tiers["nvme"].capacity == 3_500_000_000_000
    assert c.tiers["nvme"].root("n7") == "/local/nvme/n7"
    ds = c.datasets["imagenet22t"]
    assert ds.groups == ("ml",) and ds.verify == "quick" and ds.on_failure == "fallback"
    assert ds.source.kind == "local"


def test_example_config_is_valid():
    c = config.from_dict(yaml.safe_load((ROOT / "conf" / "dsstage.yaml.example").read_text()))
    assert c.datasets and c.tiers


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
])
def test_config_errors_name_file_key_and_fix(data, needle):
    msg = error(data)
    assert msg.startswith("/etc/dsstage/dsstage.yaml: ")
    assert needle in msg


def test_tier_is_optional_with_one_tier():
    data = base(tiers={"nvme": {"path": "/l", "capacity": "90%"}}, datasets={"x": {"source": "/x"}})
    c = config.from_dict(data)
    assert c.datasets["x"].tier == "nvme"
    assert c.tiers["nvme"].capacity == 0.9


def test_sources_are_classified():
    assert config.parse_source("/lustre/a/").kind == "local"
    assert config.parse_source("fs01:/export/a").kind == "ssh"
    assert config.parse_source("user@fs01:/export/a").kind == "ssh"
    s = config.parse_source("rsync://fs01:8730/datasets/a")
    assert s.kind == "daemon" and s.rsync_base() == "rsync://fs01:8730/datasets/a/"


def write(tmp_path, text, mode=0o644):
    p = tmp_path / "dsstage.yaml"
    p.write_text(text)
    os.chmod(p, mode)
    return str(p)


def test_load_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="no such file; copy conf/dsstage.yaml.example"):
        config.load(str(tmp_path / "nope.yaml"))


def test_load_bad_yaml_gives_line(tmp_path):
    path = write(tmp_path, "state_dir: /x\ntiers: [\n")
    with pytest.raises(ConfigError, match=r"not valid YAML.*line"):
        config.load(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="ownership checks are about root")
def test_writable_config_is_refused(tmp_path):
    path = write(tmp_path, yaml.safe_dump(base()), mode=0o666)
    with pytest.raises(ConfigError, match=r"writable by group or others.*chmod go-w"):
        config.load(path)
    os.chmod(path, 0o644)
    os.chown(path, 65534, 0)
    with pytest.raises(ConfigError, match=r"owned by uid 65534.*chown root:root"):
        config.load(path)
    os.chown(path, 0, 0)
    assert config.load(path).datasets


def test_env_var_selects_file(tmp_path, monkeypatch):
    path = write(tmp_path, yaml.safe_dump(base()))
    monkeypatch.setenv("DSSTAGE_CONFIG", path)
    assert config.config_path() == path
    assert config.load().origin == path
