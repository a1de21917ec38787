"""Root's commands parse the YAML of a configuration file once per state of the file
(dsstage.fs.runfiles.keep_parsed_config): a second command does not import yaml and does
the same; an edit is seen by the next command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from dsstage.fs import runfiles
from helpers import Env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the parsed configuration is kept by root only")

PROBE = ("import json, sys\n"
         "from dsstage.cli.main import main\n"
         "rc = main(sys.argv[1:])\n"
         "print(json.dumps({'rc': rc, 'yaml': 'yaml' in sys.modules}), file=sys.stderr)\n")


def probe(env: Env, *args: str) -> tuple[dict[str, object], object]:
    res = subprocess.run([sys.executable, "-c", PROBE, *args, "--json"], env=env.env(), text=True,
                         capture_output=True, check=False)
    assert res.stdout, res.stderr
    return json.loads(res.stderr.strip().splitlines()[-1]), json.loads(res.stdout)


def test_root_parses_the_yaml_once_per_state_of_the_file(env: Env):
    env.add("coco", {"a": b"1" * 10, "b/c": b"2"})
    env.cli("manifest", "build", "coco")
    env.cli("stage", "coco", "--job-id", "1")
    time.sleep(runfiles.SETTLED + 0.2)  # a file changed just now is parsed every time
    # -v: the full command (a plain verify --full of a matching copy is the fast path's)
    first, verified = probe(env, "-v", "verify", "coco", "--full")
    again, verified_again = probe(env, "-v", "verify", "coco", "--full")
    assert first == {"rc": 0, "yaml": True}
    assert again == {"rc": 0, "yaml": False}
    assert verified == verified_again and verified["ok"]
    kept = env.run / runfiles.CONFIG_PARSED
    assert kept.stat().st_mode & 0o777 == 0o600

    conf = yaml.safe_load(env.config_path.read_text())
    conf["datasets"]["coco"]["verify"] = "full"  # an edit: seen by the very next command
    env.config_path.write_text(yaml.safe_dump(conf))
    edited, listed = probe(env, "ls")
    assert edited == {"rc": 0, "yaml": True}
    assert [(r["name"], r["verify"]) for r in listed] == [("coco", "full")]
