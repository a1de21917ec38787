"""The catalog that slurmctld's job_submit.lua checks, generated from the YAML.

The catalog is kept in one place (the YAML); ``dsstage export-catalog`` renders what the
Lua needs (names and groups) so it is never maintained twice.
"""

from __future__ import annotations

import blake3

from .catalog import VALUE_MAX
from .config import NAME_MAX, Config


def _lua_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render(config: Config) -> str:
    """Lua source returning ``{datasets = {name = {groups = {...}}}, ...}``."""
    body = ["return {", f"  value_max = {VALUE_MAX},", f"  name_max = {NAME_MAX},", "  datasets = {"]
    for name in sorted(config.datasets):
        ds = config.datasets[name]
        groups = "nil" if ds.groups is None else "{" + ", ".join(_lua_str(g) for g in ds.groups) + "}"
        body.append(f"    [{_lua_str(name)}] = {{ groups = {groups} }},")
    body += ["  },", "}", ""]
    text = "\n".join(body)
    stamp = blake3.blake3(text.encode()).hexdigest()[:16]
    # the first line changes with the content: job_submit.lua re-reads the file when it does
    return f"-- dsstage catalog {stamp}, generated from {config.origin}: edit that file, not this one\n" + text
