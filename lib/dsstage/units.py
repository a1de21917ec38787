"""Sizes with units, as admins write them in the configuration."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    # SI, as disk vendors and `df -H` count
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    # IEC; bare K/M/G/T/P mean the same, as in Slurm's own configuration
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from ``3.5TB``, ``64GiB``, ``512M`` or a plain integer. Raises ValueError."""
    if isinstance(text, bool):
        raise ValueError("expected a size such as 3.5TB or 64GiB")
    if isinstance(text, int):
        if text < 0:
            raise ValueError("a size cannot be negative")
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size: write e.g. 3.5TB, 64GiB, 512M or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_percent(text: str | float) -> float:
    """A fraction in [0, 1] from ``90%``. Raises ValueError."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$", str(text))
    if not m:
        raise ValueError(f"{text!r} is not a percentage: write e.g. 90%")
    value = float(m.group(1)) / 100
    if value > 1:
        raise ValueError(f"{text!r} is over 100%")
    return value


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)?\s*$", re.I)
_SECONDS = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str | int | float) -> float:
    """Seconds from ``90``, ``90s``, ``10m``, ``1.5h``, ``3d`` or ``1w``. Raises ValueError."""
    if isinstance(text, bool):
        raise ValueError("expected a duration such as 90s, 10m, 1h or 3d")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError("a duration cannot be negative")
        return float(text)
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a duration: write e.g. 90s, 10m, 1h, 3d or a number of seconds")
    return float(m.group(1)) * _SECONDS[(m.group(2) or "").lower()]


def human(n: float) -> str:
    """``1.5 GiB`` style rendering of a byte count."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def human_duration(seconds: float) -> str:
    """A duration for people: 42 s, 20 min, 1.5 h, 3 d (negative counts as 0)."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s / 3600:.1f} h".replace(".0 h", " h")
    return f"{s / 86400:.1f} d".replace(".0 d", " d")
