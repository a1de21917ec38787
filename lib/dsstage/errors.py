"""One exception tree for dsstage.

Every error says what failed and what the reader can do about it. Each class carries
the exit code the command line uses and a ``blame`` that tells the Prolog whether the
failure is the user's or the source's (never drain the node) or the node's own
(a broken local disk: draining is right).
"""

from __future__ import annotations

import errno


class DsstageError(Exception):
    """Base of every error dsstage raises on purpose."""

    exit_code = 1
    #: who is at fault: "user" (bad request), "config" (the admin's configuration), "source"
    #: (the dataset's source), "site" (shared state directory, a full tier, an unsafe store
    #: path, the time budget: not this node's hardware), "node" (the local store fails).
    #: The Prolog drains a node only for "node" (see hooks.on_failure).
    blame = "user"


class ConfigError(DsstageError):
    """The configuration file is missing, unreadable, unsafe or invalid."""

    exit_code = 78  # EX_CONFIG
    blame = "config"


class UnknownDataset(DsstageError):
    """A dataset name that the catalog does not know."""

    exit_code = 2


class AccessDenied(DsstageError):
    """The user may not use this dataset."""

    exit_code = 77  # EX_NOPERM


class NotPermitted(DsstageError):
    """The command needs root, or write access the caller lacks: a usage error, not a fault
    of the disk or of dsstage."""

    exit_code = 2


class ManifestError(DsstageError):
    """A manifest is missing, malformed or does not describe a safe tree."""

    exit_code = 65  # EX_DATAERR
    blame = "source"


class SourceError(DsstageError):
    """The dataset source cannot be read, or it no longer matches its manifest."""

    exit_code = 69  # EX_UNAVAILABLE
    blame = "source"


class VerifyError(SourceError):
    """Staged data does not match the manifest, even after fetching it again."""

    exit_code = 65


class StateError(DsstageError):
    """The shared state directory (manifests, CURRENT) cannot be read."""

    exit_code = 69  # EX_UNAVAILABLE
    blame = "site"


class StoreError(DsstageError):
    """The node-local store cannot be used (unwritable, broken)."""

    exit_code = 74  # EX_IOERR
    blame = "node"


class UnsafeStore(StoreError):
    """A store path a user could steer (planted symlink, wrong owner, writable by others)."""

    # a user can plant it: draining would hand every user a way to drain nodes
    blame = "site"


class OutOfTime(DsstageError):
    """Staging could not finish within the Prolog's time budget (it resumes next time)."""

    exit_code = 75  # EX_TEMPFAIL
    blame = "site"


class NoSpace(StoreError):
    """A tier has no room for a dataset."""

    exit_code = 75  # EX_TEMPFAIL
    # a full tier is a capacity problem, not a broken node: do not drain for it
    blame = "site"


class OutOfDescriptors(StoreError):
    """The process ran out of file descriptors (its RLIMIT_NOFILE, or the system's)."""

    exit_code = 75  # EX_TEMPFAIL
    # a limit set too low for the work, not a broken disk: never a drain
    blame = "site"


class LockTimeout(DsstageError):
    """Waited too long for another process that is staging the same dataset."""

    exit_code = 75
    blame = "site"


class CommandError(DsstageError):
    """An external command failed; carries argv, exit code and output."""

    exit_code = 70

    def __init__(self, argv: list[str], returncode: int | None, stdout: str, stderr: str,
                 message: str | None = None) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        tail = (stderr or stdout).strip().splitlines()[-3:]
        what = message or (f"{argv[0]} exited with {returncode}" if returncode is not None
                           else f"{argv[0]} timed out")
        super().__init__(what + (": " + " | ".join(tail) if tail else ""))


def local_error(exc: OSError, what: str) -> StoreError:
    """An OSError of the node's own store as dsstage's error: a full filesystem is NoSpace and
    running out of descriptors OutOfDescriptors (never a drain; what was staged so far is
    kept), anything else the node's StoreError."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"{what}: the tier's filesystem is full ({exc.strerror}); what was staged so far is kept: "
                       "free space or lower the tier's capacity")
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return OutOfDescriptors(f"{what}: {exc.strerror}; what was staged so far is kept: raise the descriptor "
                                "limit (LimitNOFILE= of slurmd.service, or ulimit -n) or lower transfer.max_parallel")
    return StoreError(f"{what}: {exc.strerror or exc}; check the local disk of this node")
