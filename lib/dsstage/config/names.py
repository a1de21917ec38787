"""What a name may look like in the configuration: dataset and tier names, users and groups, and
text that goes into a file or environment line (no control character).
"""

from __future__ import annotations

import re
from typing import Any

from dsstage.fs.layout import NAME_MAX, name_ok

# fullmatch, never match: "$" would let a name end in a newline
GROUP_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]*\$?")
USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.@-]*\$?")
USER_MAX = 256


def check_name(name: Any, what: str = "dataset") -> str | None:
    """Why ``name`` is not a valid dataset/tier name, or None when it is."""
    if not isinstance(name, str) or not name:
        return f"a {what} name must be a non-empty string"
    if len(name) > NAME_MAX:
        return f"{what} name {name[:20]!r}... is longer than {NAME_MAX} characters"
    if not name_ok(name):
        return (f"{what} name {name!r} is not allowed: use lower-case letters, digits, '.', '_' and '-', "
                "starting with a letter or digit")
    return None


def control_char(text: str) -> str | None:
    """Why ``text`` cannot go into a file line or an environment line, or None when it can.

    A newline in a path would add a line to what the TaskProlog prints (``export ...``)."""
    for i, c in enumerate(text):
        if ord(c) < 0x20 or ord(c) == 0x7F:
            return (f"{text!r} contains a control character (U+{ord(c):04X} at position {i + 1}); "
                    "write it on one line with printable characters only")
    return None
