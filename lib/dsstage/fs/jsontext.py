"""JSON text for the warm paths, without importing the ``json`` package.

``import json`` imports ``re`` (and ``enum``) and compiles its patterns: 11-15 ms on this
project's development machine, a third of a fast ``dsstage verify`` of a ready copy and a
sixth of a warm Prolog (docs/benchmarks.md, "What a command costs before its work"). The
work itself is done by the json package's C speedups, the ``_json`` module, which needs
neither: ``loads`` and ``dumps`` here call its scanner and encoder as ``json.loads`` and
``json.dumps`` do for text without indentation, and give the json package the call
whenever the result could differ: ``_json`` missing (another Python implementation) or
refusing these arguments, indentation asked for, or any error, so that the error raised
is json's own. tests/unit/test_jsontext.py checks both against the json package.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from typing import Any

#: JSON's whitespace (json.decoder.WHITESPACE)
_BLANK = " \t\n\r"


class _Decoding:
    """The context ``_json.make_scanner`` reads its settings from (json.JSONDecoder's defaults)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__


def _unserializable(o: object) -> object:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


_scan: Any
_quote: Any
_make_encoder: Any
try:
    import _json

    _scan = _json.make_scanner(_Decoding())  # type: ignore[arg-type]  # any object with these attributes
    _quote = _json.encode_basestring_ascii
    _make_encoder = _json.make_encoder
except (ImportError, AttributeError, TypeError):  # pragma: no cover - CPython has them
    _scan = _quote = _make_encoder = None


def loads(text: str | bytes) -> Any:
    """``json.loads(text)``."""
    if _scan is not None:
        try:
            s = (text.decode() if isinstance(text, bytes) else text).strip(_BLANK)
            value, end = _scan(s, 0)
            if end == len(s):
                return value
        except Exception:  # noqa: BLE001,S110 - json.loads below raises its own error for this text
            pass
    import json
    return json.loads(text)


def dumps(value: Any, *, sort_keys: bool = False, allow_nan: bool = True, indent: int | None = None) -> str:
    """``json.dumps(value, sort_keys=..., allow_nan=..., indent=...)``."""
    if _make_encoder is not None and indent is None:
        try:
            encode = _make_encoder({}, _unserializable, _quote, None, ": ", ", ", sort_keys, False, allow_nan)
            return "".join(encode(value, 0))
        except Exception:  # noqa: BLE001,S110 - json.dumps below raises its own error for this value
            pass
    import json
    return json.dumps(value, sort_keys=sort_keys, allow_nan=allow_nan, indent=indent)
