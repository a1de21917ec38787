"""Every configuration key and every `dsstage` verb the documentation names exists: a guide
that names a key the loader refuses, or a verb the command does not have, sends an admin
down a wrong path (docs/*.md and README.md; the guides' commands are also run, elsewhere)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from dsstage.cli.main import build_parser
from dsstage.config import load, sections

TOP = Path(__file__).resolve().parents[2]
DOCS = sorted((TOP / "docs").glob("*.md")) + [TOP / "README.md"]

#: section -> its keys, as the loader takes them
SECTIONS = {
    "transfer": load._TRANSFER_KEYS, "retention": load._RETENTION_KEYS, "report": load._REPORT_KEYS,
    "fleet": sections._FLEET_KEYS, "metrics": sections._METRICS_KEYS, "prefetch": sections._PREFETCH_KEYS,
    "placement": sections._PLACEMENT_KEYS, "rollout": sections._ROLLOUT_KEYS,
    "burst_buffer": sections._BURST_BUFFER_KEYS, "peers": sections._PEERS_KEYS,
}
#: spans that look like section.key but name code (a module's function, a file)
CODE = {"report.read_all", "retention.plan", "metrics.export", "status.fold"}
#: `burst_buffer.lua`, `retention.py`: files, not keys
FILE_SUFFIXES = {"lua", "py", "json", "conf", "md", "toml", "yaml", "so", "c"}


def spans(path: Path) -> list[str]:
    text = path.read_text()
    return re.findall(r"`([^`\n]+)`", text)


def test_the_sections_are_the_loaders():
    assert set(SECTIONS) | {"sources", "tiers", "datasets"} <= set(load._TOP_KEYS)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_a_doc_names_exists(doc: Path):
    wrong = []
    for span in spans(doc):
        m = re.fullmatch(r"([a-z_]+)\.([a-z_]+)", span)
        if m and m.group(1) in SECTIONS and span not in CODE and m.group(2) not in FILE_SUFFIXES \
                and m.group(2) not in SECTIONS[m.group(1)]:
            wrong.append(span)
    assert not wrong, f"{doc.name} names configuration keys the loader does not take: {wrong}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_dsstage_verb_a_doc_names_exists(doc: Path):
    verbs = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    wrong = []
    for span in spans(doc):
        words = span.split()
        if len(words) < 2 or words[0] != "dsstage" or " / " in span:  # a ratio's name (benchmarks.md)
            continue
        rest = words[1:]
        while rest and rest[0].startswith("-"):  # global options: --node NAME, --config FILE, --json
            rest = rest[2:] if rest[0] in ("--node", "--config") else rest[1:]
        if rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]) and rest[0] not in verbs:
            wrong.append(span)
    assert not wrong, f"{doc.name} names dsstage verbs that do not exist: {wrong}"
