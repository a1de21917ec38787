"""Slurm hostlists: expand ``n[01-03],gpu7`` to names and fold names back, through ClusterShell;
the natural order of node names. The one place dsstage reads or writes a hostlist.

Imports only the standard library and ClusterShell.
"""

from __future__ import annotations

import re

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

#: the most node names a hostlist may stand for: more is a typo (n[1-100000000]), and
#: ClusterShell would hold every one of them in memory before anything could count them
MAX_NODES = 100_000


class TooManyNodes(ValueError):
    """A hostlist standing for more names than dsstage will make (MAX_NODES)."""


_GROUP = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?(?:/\d+)?")


def count(nodelist: str) -> int:
    """How many names ``nodelist`` stands for at most (repeats counted), from its text alone:
    the product of each bracket's range sizes, summed over the comma-separated items. Raises
    ValueError for a bracket that holds no ranges."""
    total = 0
    depth, start = 0, 0
    items = []
    for i, c in enumerate(nodelist + ","):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    for item in items:
        n = 1
        for group in _GROUP.findall(item):
            size = 0
            for part in group.split(","):
                m = _RANGE.fullmatch(part.strip())
                if not m:
                    raise ValueError(f"not a Slurm hostlist: {nodelist!r}")
                first, last = int(m.group(1)), int(m.group(2) or m.group(1))
                if last < first:  # counted as nothing, it would let the rest of the item through unbounded
                    raise ValueError(f"not a Slurm hostlist: {nodelist!r} ({part.strip()} runs backwards)")
                size += last - first + 1
            n *= size
        total += n if item else 0
    return total


def expand_nodes(nodelist: str, limit: int = MAX_NODES) -> list[str]:
    """The node names of a Slurm hostlist: ``n[1-3,5],gpu01`` -> [gpu01, n1, n2, n3, n5].

    ClusterShell's NodeSet does it (any bracket depth and padding, as Slurm prints them);
    the names come sorted and once each. Raises ValueError for text that is no hostlist, for
    NodeSet's own syntax (``@group``, ``!``, ``&``, ``^``), which Slurm never prints, and for a
    list of more than ``limit`` names, counted from the text before any is made.
    """
    # imported here: the Prolog, which only holds jobs, does not depend on ClusterShell
    from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet, NodeSetException

    if any(c in nodelist for c in "@!&^"):
        raise ValueError(f"not a Slurm hostlist: {nodelist!r}")
    n = count(nodelist)
    if n > limit:
        raise TooManyNodes(f"{nodelist[:60]!r} names {n} nodes, more than {limit}: is there a typo?")
    try:
        return list(NodeSet(nodelist, resolver=RESOLVER_NOGROUP))
    except NodeSetException as exc:
        raise ValueError(f"not a Slurm hostlist: {nodelist!r}: {exc}") from None


_NODE_NAME = re.compile(r"([A-Za-z0-9_.-]*?[^0-9\[\],]|)([0-9]+)")


def fold_nodes(nodes: Iterable[str]) -> str:
    """Node names as one Slurm hostlist (n[1-3,5]), as ClusterShell's NodeSet folds them.

    Names of the common shape (a prefix, then digits of one width, or unpadded) are folded
    here: NodeSet parses every name, which for 1,000 nodes' copies was most of status's
    time. Anything else (several digit groups, mixed padding) goes to NodeSet."""
    names = list(nodes)
    by_prefix: dict[str, set[str]] = {}
    for n in names:
        m = _NODE_NAME.fullmatch(n)
        if m is None:
            return _fold_nodeset(names)
        by_prefix.setdefault(m.group(1), set()).add(m.group(2))
    out = []
    for prefix in sorted(by_prefix):
        digits = by_prefix[prefix]
        widths = {len(d) for d in digits}
        if len(widths) > 1 and any(d[0] == "0" and len(d) > 1 for d in digits):
            return _fold_nodeset(names)  # mixed zero padding: NodeSet's rules
        width = widths.pop() if len(widths) == 1 else 0
        seq = sorted(int(d) for d in digits)
        ranges, start = [], 0
        for i in range(1, len(seq) + 1):
            if i == len(seq) or seq[i] != seq[i - 1] + 1:
                a, b = seq[start], seq[i - 1]
                ranges.append(f"{a:0{width}d}" if a == b else f"{a:0{width}d}-{b:0{width}d}")
                start = i
        out.append(prefix + ranges[0] if len(seq) == 1 else f"{prefix}[{','.join(ranges)}]")
    return ",".join(out)


def natural_key(name: str) -> list[Any]:
    """Sort key putting n2 before n10 (re.split with a group alternates text and digits)."""
    return [int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", name))]


def _fold_nodeset(names: list[str]) -> str:
    from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet, NodeSetException
    try:
        return str(NodeSet.fromlist(names, resolver=RESOLVER_NOGROUP))
    except NodeSetException:  # a name NodeSet cannot fold is shown as it is
        return ",".join(sorted(names, key=natural_key))
