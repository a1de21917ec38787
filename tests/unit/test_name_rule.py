"""One rule for a ``--dataset`` value, in three languages: the SPANK plugin's C
(``check_value`` in sbatch_ext/dsstage_spank.c: its source, cut from the file and compiled here),
``dsstage_submit.lua``'s ``parse`` under a real Lua 5.1, and dsstage.ready.request (the
Prolog's). Each value is accepted by all three or refused by all three."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from dsstage.config.catalog import parse_request
from dsstage.errors import UnknownDataset
from dsstage.ready.request import VALUE_MAX, requested_names
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
LUA, GCC = shutil.which("lua5.1"), shutil.which("gcc")
pytestmark = pytest.mark.skipif(LUA is None or GCC is None,
                                reason="needs lua5.1 and gcc (packaging/run-tests installs them)")

C_HARNESS = r"""
#include <ctype.h>
#include <stdio.h>
#include <string.h>
static void slurm_error(const char *fmt, ...) { (void)fmt; }
%s
int main(void)
{
	static char buf[1 << 20];
	size_t n = fread(buf, 1, sizeof(buf) - 1, stdin), start = 0, i;
	for (i = 0; i < n; i++) {
		if (buf[i] == '\0') {
			putchar(check_value(buf + start) == 0 ? '1' : '0');
			start = i + 1;
		}
	}
	return 0;
}
"""

LUA_HARNESS = """
slurm = { SUCCESS = 0, ERROR = -1, log_error = function() end }
package.path = "%s/?.lua;" .. package.path
local d = require("dsstage_submit")
local data = io.read("*a")
local out = {}
for value in string.gmatch(data, "([^%%z]*)%%z") do
	out[#out + 1] = d.parse(value) and "1" or "0"
end
io.write(table.concat(out))
"""


@pytest.fixture(scope="module")
def rules(tmp_path_factory):
    """A function running the C and the Lua rule on a list of values: their verdicts."""
    where = tmp_path_factory.mktemp("name-rule")
    source = (ROOT / "sbatch_ext" / "dsstage_spank.c").read_text()
    rule = source[source.index("#define DSSTAGE_VALUE_MAX"):source.index("static int dataset_cb")]
    assert "static int check_value(const char *v)" in rule
    (where / "harness.c").write_text(C_HARNESS.replace("%s", rule, 1))
    subprocess.run([GCC, "-std=c99", "-Wall", "-Werror", "-Wno-unused-variable", "-o", str(where / "c-rule"),
                    str(where / "harness.c")], check=True)
    (where / "rule.lua").write_text(LUA_HARNESS % (ROOT / "sbatch_ext"))

    def run(values: list[str]) -> tuple[list[bool], list[bool]]:
        data = b"".join(v.encode() + b"\0" for v in values)
        c = subprocess.run([str(where / "c-rule")], input=data, capture_output=True, check=True).stdout.decode()
        lua = subprocess.run([LUA, str(where / "rule.lua")], input=data, capture_output=True,
                             check=True).stdout.decode()
        assert len(c) == len(lua) == len(values)
        return [x == "1" for x in c], [x == "1" for x in lua]
    return run


KNOWN = [
    ("coco", True), ("imagenet22t,coco", True), ("a", True), ("0day", True), ("a.b_c-d", True),
    (" coco , imagenet22t ", True), ("coco\t", True), ("coco,coco", True), ("x" * 64, True),
    ("x" * 65, False), ("", False), ("  ", False), ("coco,", False), (",coco", False), ("a,,b", False),
    ("Coco", False), ("_coco", False), (".coco", False), ("-coco", False), ("co co", False), ("co/co", False),
    ("../x", False), ("caf\u00e9", False), ("a\0b", False), (",".join(["abcdefgh"] * 113), True),
    (",".join(["abcdefgh"] * 114), False),  # 1025 characters: over VALUE_MAX
]


def test_known_values_have_one_verdict_in_c_lua_and_python(rules):
    values = [v for v, _ in KNOWN if "\0" not in v]
    c, lua = rules(values)
    for value, want, in_c, in_lua in zip(values, [w for v, w in KNOWN if "\0" not in v], c, lua, strict=True):
        assert (requested_names(value) is not None, in_c, in_lua) == (want, want, want), value
    assert requested_names("a\0b") is None  # C never sees one: a C string ends there
    assert len(",".join(["abcdefgh"] * 114)) == VALUE_MAX + 1


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.text(alphabet="abz09._-, \tA/\u00e9", max_size=80), min_size=50, max_size=50))
def test_generated_values_have_one_verdict_in_c_lua_and_python(rules, values):
    c, lua = rules(values)
    for value, in_c, in_lua in zip(values, c, lua, strict=True):
        py = requested_names(value) is not None
        assert (in_c, in_lua) == (py, py), repr(value)


def full_rule(value: str) -> bool:
    """Whether the full Prolog's parser (dsstage.config.catalog.parse_request, which says what
    is wrong) accepts ``value``."""
    try:
        parse_request(value)
    except UnknownDataset:
        return False
    return True


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.text(alphabet="abz09._-, \tA/\u00e9\u00a0\x1c\x85", max_size=80))
def test_the_full_prologs_parser_has_the_warm_paths_rule(value):
    """The full Prolog's parser and the warm paths' (dsstage.ready.request) accept the same
    values, Unicode blanks (which str.strip() would take) included."""
    assert full_rule(value) == (requested_names(value) is not None), repr(value)
    assert full_rule("x" * 64 + "," + "y" * 64) and not full_rule(",".join(["abcdefgh"] * 114))
