"""Which groups a user is in: the one lookup the catalog's access checks and the warm Prolog use.

Imports only the standard library: the warm Prolog uses it.
"""

from __future__ import annotations

import grp
import os


def group_names(user: str, gid: int) -> set[str]:
    """Every group name of ``user`` (primary ``gid`` included)."""
    names = set()
    for g in os.getgrouplist(user, gid):
        try:
            names.add(grp.getgrgid(g).gr_name)
        except KeyError:
            continue
    return names
