"""``scontrol show bbstat``: dsstage's status as burst_buffer.lua answers it.

slurmctld holds locks that submissions need while ``slurm_bb_get_status`` runs, so the
answer must take no time and never call back into Slurm (an ``squeue`` from there waits out
MessageTimeout, and every ``sbatch`` with it). burst_buffer.lua therefore only reads an
answer computed before: a file per question in ``burst_buffer.status_dir`` (on the
controller's own disk), whose first line says when it was computed. When the answer is
missing or older than ``burst_buffer.status_max_age``, the Lua starts ``dsstage bb status
KEY`` in the background (at most once per key at a time: a marker file) and answers with
what it has, saying how old it is. The refresh (this module) reads only dsstage's own files
(node reports, the demand snapshot; status.collect ``offline``), runs at most ``SLOTS`` at
once, whatever the questions, and keeps at most ``KEEP`` answers.

A question is its key: ``all``, ``job=ID``, ``dataset=NAME`` or ``node=HOSTLIST``, and
``@UID`` when Slurm told who asks (23.02 and later). Where Slurm's PrivateData hides jobs,
the answer to a caller shows their own jobs and counts of the rest, and to a caller nobody
knows (Slurm 22.05 does not say) only the counts.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass

from dsstage.cluster import status, status_view
from dsstage.config.model import Config
from dsstage.errors import DsstageError
from dsstage.fs import safe

#: refreshes running at once, over every question
SLOTS = 2
#: answers kept (the oldest go first): one per question asked recently
KEEP = 500
HEADER = "-- dsstage bbstat "
MARK = ".refreshing"
_KEY = re.compile(r"(all|(job|dataset|node)=([A-Za-z0-9\[\],._-]{1,200}))(?:@(\d{1,10}))?")


@dataclass(frozen=True)
class Question:
    key: str
    what: str  # "" (all), "job", "dataset" or "node"
    value: str
    uid: int | None


def parse_key(key: str) -> Question:
    """The question a key asks; DsstageError for anything else."""
    m = _KEY.fullmatch(key)
    if m is None:
        raise DsstageError(f"{key!r} is not a bbstat question (all, job=ID, dataset=NAME or node=HOSTLIST, "
                           "optionally @UID)")
    return Question(key, m.group(2) or "", m.group(3) or "", int(m.group(4)) if m.group(4) else None)


def answer(config: Config, q: Question, clock: Callable[[], float] = time.time) -> str:
    """The text of the answer: status for the question, from dsstage's own files only."""
    st = status.collect(config, None, clock, offline=True)
    st = status.as_seen_by(config, st, q.uid)
    filt = status.Filter.parse(job=q.value if q.what == "job" else None,
                               dataset=q.value if q.what == "dataset" else None,
                               nodes=q.value if q.what == "node" else None)
    shown = status.select(st, filt) if filt else st
    text = status_view.render_plain(shown, status_view.sections(shown, show_queue=True, plain=True))
    if q.what == "job":
        text += "\n" + textwrap.fill(status.explain_job(st, q.value), status_view.WIDTH) + "\n"
    return text


def refresh(config: Config, key: str, clock: Callable[[], float] = time.time) -> bool:
    """Compute the answer to ``key`` into the status directory; False when every slot is
    busy (the question is asked again later). The directory must be the caller's or root's
    and writable by nobody else: what is written there reaches every bbstat caller."""
    q = parse_key(key)
    dfd = _open_dir(config.burst_buffer.status_dir)
    try:
        slot = _take_slot(dfd)
        if slot is None:
            return False
        try:
            try:
                text = answer(config, q, clock)
            except DsstageError as exc:
                text = f"dsstage: error: {exc}\n"
            except Exception as exc:  # noqa: BLE001 - a bug: the caller still gets an answer, not silence
                text = f"dsstage: internal error: {type(exc).__name__}: {exc}\n"
            safe.write_at(dfd, key, f"{HEADER}{int(clock())}\n{text}", mode=0o600, fsync=False)
            _prune(dfd)
        finally:
            os.close(slot)
    finally:
        safe.unlink_at(dfd, key + MARK)
        os.close(dfd)
    return True


def _open_dir(path: str) -> int:
    try:
        fd = os.open(path, safe.O_DIR)
    except OSError as exc:
        raise DsstageError(f"burst_buffer.status_dir {path}: {exc.strerror}: `dsstage export-catalog`, run as root "
                           "on the controller, makes it") from None
    st = os.fstat(fd)
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise DsstageError(f"burst_buffer.status_dir {path} belongs to uid {st.st_uid} or others may write to it "
                           f"(mode {stat.S_IMODE(st.st_mode):o}): it must be root's or Slurm's SlurmUser's alone")
    return fd


def _take_slot(dfd: int) -> int | None:
    for i in range(SLOTS):
        fd = os.open(f".slot-{i}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
    return None


def _prune(dfd: int) -> None:
    answers = []
    with os.scandir(dfd) as it:
        for e in it:
            if not e.name.startswith(".") and not e.name.endswith(MARK):
                try:
                    answers.append((e.stat(follow_symlinks=False).st_mtime, e.name))
                except FileNotFoundError:
                    continue
    for _mtime, name in sorted(answers)[:max(0, len(answers) - KEEP)]:
        safe.unlink_at(dfd, name)
