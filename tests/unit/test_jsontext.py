"""dsstage.fs.jsontext gives what the json package gives, text for text and error for error."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from dsstage.fs import jsontext

VALUES = [
    {}, [], "", 0, -1, 2**70, 1.5, -0.0, 1e300, True, False, None,
    {"b": 1, "a": [1, 2.25, "x"], "c": {"z": None, "y": True}},
    {"ünïcödé": "\u2603 snow \U0001f600", "ctl": "\x00\x1f\"\\/\n\t", "k": "é" * 3},
    {"nested": [[[[{"deep": [1, {"deeper": []}]}]]]]},
    {"10": 1, "9": 2, "a": 3, "B": 4},
]


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("sort_keys", [False, True])
def test_dumps_is_json_dumps(value, sort_keys):
    text = jsontext.dumps(value, sort_keys=sort_keys)
    assert text == json.dumps(value, sort_keys=sort_keys)
    assert jsontext.loads(text) == json.loads(text)


@pytest.mark.parametrize("value", VALUES)
def test_loads_is_json_loads_for_text_bytes_and_surrounding_blanks(value):
    text = json.dumps(value, indent=1)
    assert jsontext.loads(text) == json.loads(text)
    assert jsontext.loads(f" \n{text}\n\t".encode()) == json.loads(text)


def test_the_constants_and_indentation_go_as_json_has_them():
    assert math.isnan(jsontext.loads("NaN")) and jsontext.loads("[-Infinity, Infinity]") == [-math.inf, math.inf]
    assert jsontext.dumps([math.inf, math.nan]) == "[Infinity, NaN]"
    assert jsontext.dumps({"b": [1], "a": 2}, sort_keys=True, indent=1) == json.dumps({"b": [1], "a": 2},
                                                                                      sort_keys=True, indent=1)


@pytest.mark.parametrize("text", ["", "{", '{"a": 1} x', '{"a": 1}{}', "[1,]", "'x'", '"\x01"', "\ufeff{}", "01",
                                  '{"a" 1}', b"\xff\xfe"])
def test_bad_text_raises_jsons_own_error(text):
    with pytest.raises(ValueError) as ours:
        jsontext.loads(text)
    with pytest.raises(ValueError) as theirs:
        json.loads(text)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("value,kwargs", [({"a": {1, 2}}, {}), ([math.nan], {"allow_nan": False}), (object(), {})])
def test_what_json_cannot_write_raises_jsons_own_error(value, kwargs):
    with pytest.raises((TypeError, ValueError)) as ours:
        jsontext.dumps(value, **kwargs)
    with pytest.raises((TypeError, ValueError)) as theirs:
        json.dumps(value, **kwargs)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


def test_circular_values_raise_like_json():
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference"):
        jsontext.dumps(loop)


def test_it_imports_neither_json_nor_re():
    res = subprocess.run([sys.executable, "-X", "importtime", "-c",
                          "from dsstage.fs import jsontext; jsontext.loads(jsontext.dumps({'a': [1.5, None]}))"],
                         capture_output=True, text=True, check=True)
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "dsstage.fs.jsontext" in imported and not imported & {"json", "re", "enum"}, sorted(imported)
