"""Shared fixtures (helpers live in helpers.py, importable from every test directory)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import Env, write_tree


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


@pytest.fixture
def tree() -> Callable[..., Path]:
    return write_tree
