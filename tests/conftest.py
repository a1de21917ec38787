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
