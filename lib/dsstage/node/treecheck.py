"""What is in a tree on this node's disk that its manifest does not list (``extras``), and
removing it (``sweep_extras``); whether the listed files are right is
dsstage.transfer.check.check_tree.

``verify --full``, the stager and the fast ``verify --full`` of a ready copy
(dsstage.cli.fast) share it; it imports neither the configuration nor the staging machinery,
so that the fast path does not pay for them.
"""

from __future__ import annotations

import stat
from collections.abc import Generator, Sequence

from dsstage.config.manifest import Entry
from dsstage.fs import safe
from dsstage.fs.beneath import Tree
from dsstage.node.publish import dirs_of


def extras(root_fd: int, entries: Sequence[Entry]) -> Generator[tuple[int, str], None, None]:
    """What is below ``root_fd`` that the manifest does not list, as (its directory's
    descriptor, its name), from the directories' listings: a directory that holds no listed
    file, a file not listed, anything that is neither a directory nor a regular file. The
    descriptor is open until the next item."""
    wanted = {e.path for e in entries}
    dirs = dirs_of(wanted)
    with Tree(root_fd) as tree:
        for fd, found in tree.listing(descend=lambda rel: rel in dirs):
            for name, rel, kind in found:
                keep = rel in dirs if kind == stat.S_IFDIR else kind == stat.S_IFREG and rel in wanted
                if not keep:
                    yield fd, name


def sweep_extras(root_fd: int, entries: Sequence[Entry]) -> int:
    """Remove everything below ``root_fd`` that the manifest does not list (extras); return
    the count (a published copy checked by ``verify --full``, which is sealed again only if
    this or the check changed it)."""
    removed = 0
    for fd, name in extras(root_fd, entries):
        safe.remove_at(fd, name)
        removed += 1
    return removed
