"""A path inside a dataset as one line of text: how a manifest writes each file's path, and how
a sharded view's files list (dsstage.shards.views) writes each file, so that no name can split
into two lines (a file named ``x\\n/etc/shadow`` would otherwise add a line ``/etc/shadow``).

A backslash, newline, tab and carriage return are written ``\\\\``, ``\\n``, ``\\t``, ``\\r``;
every other character as it is. A loader that reads a files list line by line undoes it with
``unescape`` (the user guide's recipe), and a name without those characters is unchanged.

Imports nothing: the warm Prolog writes views.
"""

from __future__ import annotations

_ESC = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_UNESC = {"\\": "\\", "n": "\n", "t": "\t", "r": "\r"}


def escape(path: str) -> str:
    if not any(c in path for c in _ESC):
        return path
    return "".join(_ESC.get(c, c) for c in path)


def unescape(text: str) -> str:
    if "\\" not in text:
        return text
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            nxt = text[i + 1:i + 2]
            if nxt not in _UNESC:
                raise ValueError(f"bad escape in {text!r}")
            out.append(_UNESC[nxt])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)
