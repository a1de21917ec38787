"""Who is asking on this node: its Slurm name, and the holder of a stage run by hand.

Standard library only: the fast path of ``dsstage stage`` (dsstage.cli.fast) needs both
before it knows whether to load anything else.
"""

from __future__ import annotations

import os


def node_name() -> str:
    """This node's Slurm name (``SLURMD_NODENAME`` in a Prolog), else the short host name."""
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]


def default_holder() -> tuple[str, int]:
    """A lease id and pid for a stage run by hand: the calling shell holds it."""
    ppid = os.getppid()
    return f"pid-{os.uname().nodename}-{ppid}", ppid  # uname's node name is gethostname()'s, without socket's import
