"""Shared fixtures (helpers live in helpers.py, importable from every test directory)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from dsstage.transfer import native
from helpers import Env, write_tree


@pytest.fixture(autouse=True)
def _native_copier_looked_up_afresh():
    """Each test finds the native copier itself: one that sets DSSTAGE_NATIVE_COPY, or whose
    helper failed and was turned off, changes nothing for the next."""
    yield
    native.forget()


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


@pytest.fixture
def tree() -> Callable[..., Path]:
    return write_tree


@pytest.fixture
def on_root_filesystem():
    """A fresh directory on the filesystem of ``/`` (as an unmounted disk's mount point is),
    made by the test itself: ``tmp_path`` is on a tmpfs where /tmp is one (Debian 13's
    default). Removed afterwards."""
    import os
    import shutil
    import tempfile
    root_dev = os.stat("/").st_dev
    for parent in ("/var/tmp", "/var/cache", "/root", "/opt", "/srv", "/"):
        try:
            if os.stat(parent).st_dev == root_dev and os.access(parent, os.W_OK):
                break
        except OSError:
            continue
    else:
        pytest.fail("no writable directory on the root filesystem")
    where = Path(tempfile.mkdtemp(prefix="dsstage-rootfs-", dir=parent))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)
