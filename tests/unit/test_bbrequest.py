"""#BB_LUA requests recorded for the Prolog (dsstage.hooks.bbrequest): read only what root or
burst_buffer.user wrote, never through a planted link."""

from __future__ import annotations

import json
import os

import pytest
from dsstage.errors import ConfigError, StateError, UnsafeStore
from dsstage.hooks import bbrequest

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files of other owners")


def test_recorded_request_reads_back_and_is_forgotten(tmp_path):
    path = bbrequest.write(str(tmp_path), "123", ["imagenet", "coco"])
    assert path == str(tmp_path / "bb" / "123")
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    assert bbrequest.read(str(tmp_path), "123", os.geteuid()) == "imagenet,coco"
    assert bbrequest.read(str(tmp_path), "124", os.geteuid()) is None
    assert bbrequest.remove(str(tmp_path), "123") is True
    assert bbrequest.remove(str(tmp_path), "123") is False
    assert bbrequest.read(str(tmp_path), "123", os.geteuid()) is None


def test_no_directory_is_no_request(tmp_path):
    assert bbrequest.read(str(tmp_path), "5") is None


@pytest.mark.parametrize("job", ["", "12a", "../x", "1/2", "9" * 30])
def test_a_job_id_that_is_not_one_is_refused(tmp_path, job):
    with pytest.raises(StateError, match="not a job id"):
        bbrequest.write(str(tmp_path), job, ["a"])
    with pytest.raises(StateError, match="not a job id"):
        bbrequest.read(str(tmp_path), job)


def test_a_symlink_in_place_of_the_record_is_never_followed(tmp_path):
    bbrequest.write(str(tmp_path), "1", ["a"])
    (tmp_path / "elsewhere").write_text(json.dumps({"job": "2", "datasets": "secret"}))
    os.symlink(tmp_path / "elsewhere", tmp_path / "bb" / "2")
    with pytest.raises(UnsafeStore, match="cannot be opened safely"):
        bbrequest.read(str(tmp_path), "2", os.geteuid())


def test_a_symlinked_directory_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    bbrequest.write(str(tmp_path / "real"), "1", ["a"])
    (tmp_path / "state").mkdir()
    os.symlink(tmp_path / "real" / "bb", tmp_path / "state" / "bb")
    with pytest.raises(UnsafeStore, match="symbolic link"):
        bbrequest.read(str(tmp_path / "state"), "1", os.geteuid())


def test_a_record_others_could_write_is_refused(tmp_path):
    path = bbrequest.write(str(tmp_path), "3", ["a"])
    os.chmod(path, 0o666)
    with pytest.raises(UnsafeStore, match="writable by group or others"):
        bbrequest.read(str(tmp_path), "3", os.geteuid())


def test_a_directory_others_could_write_is_refused(tmp_path):
    bbrequest.write(str(tmp_path), "3", ["a"])
    os.chmod(tmp_path / "bb", 0o1777)
    with pytest.raises(UnsafeStore, match="writable by group or others"):
        bbrequest.read(str(tmp_path), "3", os.geteuid())


@root_only
def test_only_root_and_the_burst_buffer_user_may_own_it(tmp_path):
    path = bbrequest.write(str(tmp_path), "4", ["a"])
    os.chown(path, 4242, 4242)
    with pytest.raises(UnsafeStore, match="belongs to uid 4242"):
        bbrequest.read(str(tmp_path), "4")
    assert bbrequest.read(str(tmp_path), "4", 4242) == "a"
    os.chown(tmp_path / "bb", 4343, 4343)
    with pytest.raises(UnsafeStore, match="belongs to uid 4343"):
        bbrequest.read(str(tmp_path), "4", 4242)


@pytest.mark.parametrize("text", ["not json", json.dumps({"job": "9", "datasets": "a"}),
                                  json.dumps({"job": "6", "datasets": ["a"]}), json.dumps(["a"])])
def test_a_damaged_or_misplaced_record_is_the_sites_error(tmp_path, text):
    bbrequest.write(str(tmp_path), "6", ["a"])
    (tmp_path / "bb" / "6").write_text(text)
    with pytest.raises(StateError, match="is not a dsstage burst-buffer record for job 6"):
        bbrequest.read(str(tmp_path), "6", os.geteuid())


def test_flagged_is_what_the_hook_script_tested(tmp_path):
    bbrequest.write(str(tmp_path), "8", ["a"])
    where = str(tmp_path / "bb")
    assert bbrequest.flagged({bbrequest.ENV: where, "SLURM_JOB_ID": "8"})
    assert not bbrequest.flagged({bbrequest.ENV: where, "SLURM_JOB_ID": "9"})
    assert not bbrequest.flagged({"SLURM_JOB_ID": "8"})
    assert not bbrequest.flagged({bbrequest.ENV: where, "SLURM_JOB_ID": "../bb/8"})


def test_writer_uid():
    assert bbrequest.writer_uid(None) == 0
    assert bbrequest.writer_uid("root") == 0
    with pytest.raises(ConfigError, match="burst_buffer.user 'nosuchuser-x' is not a user"):
        bbrequest.writer_uid("nosuchuser-x")


def test_data_in_nudges_the_acting_poller_instead_of_running_a_round(tmp_path):
    """Issue 54: data_in ran a whole poller round per job (``demand-poller --once``: snapshot,
    features, waits, GC), outside the leader's lease. It now replaces a file the acting
    poller watches while it waits between rounds: its wait ends early, and it takes the round."""
    from dsstage.cluster import poller
    state = str(tmp_path)
    os.makedirs(bbrequest.directory(state))
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        if len(slept) == 3:  # a job's data_in, 3 s into a 30 s wait
            poller.nudge(state, "77")
    assert poller.NUDGE.split(os.sep)[0] == bbrequest.DIR  # where the callbacks' user may write
    assert poller.wait(state, 30, sleep) is True and len(slept) == 3
    slept.clear()
    assert poller.wait(state, 5.5, lambda s: slept.append(s)) is False  # nobody asked: the whole wait
    assert slept == [1.0] * 5 + [0.5]
    with pytest.raises(StateError):
        poller.nudge(state, "../x")


def test_the_bb_nudge_verb_replaces_the_file_the_poller_watches(tmp_path, capsys):
    """What burst_buffer.lua's data_in runs: ``dsstage bb nudge JOBID``."""
    import yaml
    from dsstage.cli import main as cli
    from dsstage.cluster import poller
    state = tmp_path / "state"
    (state / bbrequest.DIR).mkdir(parents=True)
    config = tmp_path / "dsstage.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(state), "tiers": {"n": {"path": "/l", "capacity": "1TB"}},
                                      "datasets": {"a": {"source": "/d"}}}))
    before = poller.nudge_key(str(state))
    assert cli.main(["--config", str(config), "bb", "nudge", "77"]) == 0
    assert poller.nudge_key(str(state)) not in (None, before)
    assert "the acting demand poller takes its next round now" in capsys.readouterr().out
