"""The parsed configuration kept in root's run directory (dsstage.fs.runfiles.keep_parsed_config):
used only for the very state of the file it was kept for, only by root, only when it is
root's and private, and never for data JSON would give back as something else."""

import contextlib
import json
import os
import time

import pytest
import yaml
from dsstage.config import load
from dsstage.errors import ConfigError
from dsstage.fs import runfiles

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the parsed configuration is kept by root only")

CONF = {"state_dir": "/shared/dsstage",
        "tiers": {"nvme": {"path": "/local/nvme/{node}", "capacity": "3.5TB"}},
        "datasets": {"imagenet": {"source": "/lustre/datasets/imagenet", "tier": "nvme"}}}


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o755)
    return str(d)


def write(tmp_path, data) -> str:
    p = tmp_path / "dsstage.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    os.chmod(p, 0o644)
    return str(p)


@pytest.fixture
def later(monkeypatch):
    """Every keeping happens as if the file had settled."""
    monkeypatch.setattr(runfiles, "SETTLED", -3600.0)


def parses(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = load.parse

    def counted(path, text):
        calls.append(path)
        return real(path, text)
    monkeypatch.setattr(load, "parse", counted)
    return calls


def test_second_load_of_the_same_file_does_not_parse_it(tmp_path, run_dir, monkeypatch, later):
    path = write(tmp_path, CONF)
    calls = parses(monkeypatch)
    first = load.load(path, run_dir=run_dir)
    second = load.load(path, run_dir=run_dir)
    assert calls == [path]
    assert first == second
    kept = os.stat(os.path.join(run_dir, runfiles.CONFIG_PARSED))
    assert kept.st_uid == 0 and kept.st_mode & 0o777 == 0o600


def test_an_edited_file_is_parsed_again(tmp_path, run_dir, monkeypatch, later):
    path = write(tmp_path, CONF)
    load.load(path, run_dir=run_dir)
    other = dict(CONF, datasets={"coco": {"source": "/lustre/datasets/coco", "tier": "nvme"}})
    write(tmp_path, other)
    calls = parses(monkeypatch)
    conf = load.load(path, run_dir=run_dir)
    assert calls == [path]
    assert list(conf.datasets) == ["coco"]


def test_a_chmod_alone_is_seen(tmp_path, run_dir, monkeypatch, later):
    path = write(tmp_path, CONF)
    load.load(path, run_dir=run_dir)
    os.chmod(path, 0o666)
    with pytest.raises(ConfigError, match="writable by group or others"):
        load.load(path, run_dir=run_dir)


def test_a_file_changed_just_now_is_not_kept(tmp_path, run_dir):
    path = write(tmp_path, CONF)
    st = os.stat(path)
    assert not runfiles.keep_parsed_config(run_dir, path, st, CONF, now=st.st_ctime + runfiles.SETTLED / 2)
    assert not os.path.exists(os.path.join(run_dir, runfiles.CONFIG_PARSED))
    assert runfiles.keep_parsed_config(run_dir, path, st, CONF, now=st.st_ctime + runfiles.SETTLED + 1)
    assert runfiles.parsed_config(run_dir, path, st) == CONF


@pytest.mark.parametrize("text", [
    "state_dir: /s\ntiers: {nvme: {path: /n, capacity: 1TB}}\ndatasets: {2024: {source: /d, tier: nvme}}\n",
    "state_dir: /s\ntiers: {nvme: {path: /n, capacity: 1TB}}\ndatasets: {}\ncreated: 2024-01-02\n",
])
def test_what_json_would_change_is_parsed_every_time(tmp_path, run_dir, monkeypatch, later, text):
    path = write(tmp_path, text)
    calls = parses(monkeypatch)
    for _ in range(2):
        # the integer name is the validator's to refuse; the unknown key (a date) it ignores
        with contextlib.suppress(ConfigError):
            load.load(path, run_dir=run_dir)
    assert calls == [path, path]
    assert not os.path.exists(os.path.join(run_dir, runfiles.CONFIG_PARSED))


def plant(run_dir, path, data, *, mode=0o600, uid=0):
    record = {"origin": path, "key": runfiles.stat_key(os.stat(path)), "data": data}
    p = os.path.join(run_dir, runfiles.CONFIG_PARSED)
    with open(p, "w") as fh:
        json.dump(record, fh)
    os.chmod(p, mode)
    os.chown(p, uid, -1)


@pytest.mark.parametrize("mode,uid", [(0o644, 0), (0o600, 1000)])
def test_a_kept_file_others_could_read_or_wrote_is_not_used(tmp_path, run_dir, monkeypatch, mode, uid):
    path = write(tmp_path, CONF)
    forged = dict(CONF, datasets={"forged": {"source": "/etc", "tier": "nvme"}})
    plant(run_dir, path, forged, mode=mode, uid=uid)
    assert list(load.load(path, run_dir=run_dir).datasets) == ["imagenet"]


def test_a_kept_file_of_another_path_or_state_is_not_used(tmp_path, run_dir):
    path = write(tmp_path, CONF)
    forged = dict(CONF, datasets={"forged": {"source": "/etc", "tier": "nvme"}})
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(CONF))
    plant(run_dir, str(other), forged)
    assert list(load.load(path, run_dir=run_dir).datasets) == ["imagenet"]
    plant(run_dir, path, forged)
    time.sleep(0.01)
    write(tmp_path, CONF)  # same content, new state
    assert list(load.load(path, run_dir=run_dir).datasets) == ["imagenet"]


def test_not_root_never_reads_it(tmp_path, run_dir, monkeypatch):
    path = write(tmp_path, CONF)
    forged = dict(CONF, datasets={"forged": {"source": "/etc", "tier": "nvme"}})
    plant(run_dir, path, forged)
    assert runfiles.parsed_config(run_dir, path, os.stat(path)) == forged
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert runfiles.parsed_config(run_dir, path, os.stat(path)) is None


def test_without_a_run_directory_it_parses_and_keeps_nothing(tmp_path, monkeypatch, later):
    path = write(tmp_path, CONF)
    calls = parses(monkeypatch)
    missing = str(tmp_path / "no-run-dir")
    load.load(path, run_dir=missing)
    load.load(path, run_dir=missing)
    assert calls == [path, path]
    assert not os.path.exists(missing)


def test_bad_yaml_is_never_kept(tmp_path, run_dir, later):
    path = write(tmp_path, "state_dir: /x\ntiers: [\n")
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"not valid YAML.*line"):
            load.load(path, run_dir=run_dir)
    assert not os.path.exists(os.path.join(run_dir, runfiles.CONFIG_PARSED))
