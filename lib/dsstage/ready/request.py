"""A job's request: the ``--dataset`` value, ``NAME[,NAME...]``.

The one Python form of the rule the SPANK plugin (``sbatch_ext/dsstage_spank.c``) applies at
submission and ``dsstage_submit.lua`` in slurmctld: at most VALUE_MAX characters, names
separated by commas, blanks around a name ignored, each name ``dsstage.fs.layout.name_ok``
(``[a-z0-9][a-z0-9._-]*``, at most 64 characters). tests/unit/test_name_rule.py runs the C
and the Lua rule on the same values.
"""

from __future__ import annotations

from dsstage.fs import layout

#: the longest ``--dataset`` value accepted (the SPANK plugin's DSSTAGE_VALUE_MAX, the Lua module's value_max)
VALUE_MAX = layout.REQUEST_MAX
#: what is stripped around a name (C's isspace in the C locale, Lua's %s)
BLANKS = layout.BLANKS


def requested_names(request: str) -> list[str] | None:
    """The dataset names of a request (``a,b``), each once, in order; None if it is malformed."""
    if len(request) > VALUE_MAX:
        return None
    names: list[str] = []
    for part in request.split(","):
        name = part.strip(BLANKS)
        if not layout.name_ok(name):
            return None
        if name not in names:
            names.append(name)
    return names
