"""The hooks' log file: every line has its time, the file is not for every user to read, and
a link planted in its place is not followed."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from dsstage.hooks import joblog


def test_a_line_has_its_time_and_the_file_is_0640(tmp_path: Path):
    log = tmp_path / "dsstage.log"
    joblog.write("staged coco", job_id="7", env={"DSSTAGE_LOG": str(log), "DSSTAGE_SYSLOG": "off"})
    line = log.read_text()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4} dsstage-\d+: INFO: job 7: staged coco\n", line), line
    assert stat.S_IMODE(log.stat().st_mode) == 0o640


def test_a_log_an_older_version_left_readable_by_all_is_closed_to_others(tmp_path: Path):
    log = tmp_path / "dsstage.log"
    log.write_text("old\n")
    os.chmod(log, 0o644)
    joblog.write("x", env={"DSSTAGE_LOG": str(log), "DSSTAGE_SYSLOG": "off"})
    assert stat.S_IMODE(log.stat().st_mode) == 0o640 and log.read_text().startswith("old\n")


def test_a_planted_link_is_not_followed(tmp_path: Path, capsys):
    target = tmp_path / "target"
    target.write_text("")
    log = tmp_path / "dsstage.log"
    log.symlink_to(target)
    joblog.write("secret", env={"DSSTAGE_LOG": str(log), "DSSTAGE_SYSLOG": "off"})
    assert target.read_text() == "" and "secret" in capsys.readouterr().err  # stderr instead
