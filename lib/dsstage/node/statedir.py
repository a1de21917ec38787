"""The shared state directory's layout: who owns what, made by one command, checked per role.

Where NFS exports ``state_dir`` with ``root_squash``, root on every client writes as nobody,
so everything the nodes and the controller write there is written as ``report.user``
(setfsuid: dsstage.fs.identity.writing_as), and the ``#BB_LUA`` records as
``burst_buffer.user`` (Slurm's SlurmUser, who runs burst_buffer.lua's callbacks). The layout
gives each of them the directories they write, and nothing else:

========================  =====================  =============================================
``state_dir``             report.user, 0755      the demand snapshot, the poller's lease, the
                                                 cluster-wide switch (the controller's role)
``nodes/``                report.user, 0755      the nodes' reports
``jobs/``                 report.user, 0755      a multi-node job's versions, hold claim, plan
``staging/``              report.user, 0755      who reads a version from its source now
``sources/``              report.user, 0755      the sources' breakers
``budget/``               report.user, 0755      the sources' requests in flight
``manifests/``            report.user, 0755      manifests (a dataset's own directory may be
                                                 its owner's: manifest build as that owner)
``bb/``                   burst_buffer.user      the ``#BB_LUA`` records (where it is set)
========================  =====================  =============================================

Without ``report.user`` every one of them is root's. ``dsstage state-dir init`` makes what is
missing and gives each its owner (run it where chown works: on the NFS server, or on a client
whose root is not squashed); ``check-config`` tries each as its writer would (a file created
and removed as that user: the only test NFS answers truly) and names the fix.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from dsstage.config.model import Config
from dsstage.errors import ConfigError


@dataclass(frozen=True)
class Place:
    rel: str  # "" for state_dir itself
    user: str | None  # who writes it (None: root)
    key: str  # the configuration key that names that user
    what: str


def layout(conf: Config) -> list[Place]:
    """The directories of ``state_dir`` dsstage writes, and who writes each."""
    u, key = conf.report.user, "report.user"
    out = [Place("", u, key, "the demand snapshot, the poller's lease, the cluster-wide switch"),
           Place("nodes", u, key, "the nodes' reports"),
           Place("jobs", u, key, "a multi-node job's versions, hold claim and shard plan"),
           Place("staging", u, key, "who reads a version from its source now"),
           Place("sources", u, key, "the sources' breakers"),
           Place("budget", u, key, "the sources' requests in flight"),
           Place("manifests", u, key, "the manifests")]
    if conf.burst_buffer.user:
        out.append(Place("bb", conf.burst_buffer.user, "burst_buffer.user", "the #BB_LUA records"))
    return out


def _ids(user: str | None, key: str) -> tuple[int, int]:
    if not user:
        return 0, 0
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise ConfigError(f"{key}: user {user!r} does not exist on this host: create it (the same uid on every "
                          "node and the controller), or fix the configuration") from None
    return pw.pw_uid, pw.pw_gid


def init(conf: Config) -> list[str]:
    """Make every directory of the layout that is missing (0755) and give each its owner; what
    was done, one line each. Raises OSError where a directory cannot be made or given (run it
    on the NFS server, or on a client whose root is not squashed)."""
    done = []
    for p in layout(conf):
        path = os.path.join(conf.state_dir, p.rel)
        uid, gid = _ids(p.user, p.key)
        if not os.path.isdir(path):
            os.makedirs(path, mode=0o755, exist_ok=True)
            done.append(f"made {path}")
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, "not a directory (a symbolic link?): remove it", path)
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.chown(path, uid, gid, follow_symlinks=False)
            done.append(f"gave {path} to {p.user or 'root'}")
        if st.st_mode & 0o7777 != 0o755:
            os.chmod(path, 0o755)
            done.append(f"made {path} mode 0755")
    return done


@contextmanager
def _as(user: str | None) -> Iterator[None]:
    from dsstage.fs.identity import writing_as
    with writing_as(user):
        yield


def problems(conf: Config) -> list[tuple[str, str, str]]:
    """(level, key, message) for each directory of the layout its writer cannot write: tried
    as that writer (as root only: the try switches identity), so that NFS's answer, squash
    included, is the one that counts. A directory that does not exist yet is a note."""
    if os.geteuid() != 0:
        return [("note", "state_dir", "the layout of the state directory is checked as root only (each "
                 "directory is tried as its writer)")]
    out = []
    for p in layout(conf):
        path = os.path.join(conf.state_dir, p.rel)
        key = f"state_dir{'/' + p.rel if p.rel else ''}"
        if not os.path.isdir(path):
            out.append(("note", key, f"{path} ({p.what}) does not exist yet: `dsstage state-dir init` makes it"))
            continue
        probe = os.path.join(path, f".dsstage-probe-{os.getpid()}")
        try:
            with _as(p.user):
                fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                os.close(fd)
                os.unlink(probe)
        except ConfigError as exc:
            out.append(("error", p.key, str(exc)))
        except OSError as exc:
            who = p.user or "root"
            out.append(("error", key, f"{path} ({p.what}) cannot be written by {who}, as dsstage writes it "
                        f"({exc.strerror}): run `dsstage state-dir init` on the NFS server (or where root is "
                        f"not squashed), or `chown {who} {path}` there"))
    return out
