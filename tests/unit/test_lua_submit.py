"""dsstage_submit.lua under a real Lua 5.1, with the catalog dsstage generates."""

import shutil
import subprocess
from pathlib import Path

import pytest
from dsstage import config, luacatalog

ROOT = Path(__file__).resolve().parents[2]
LUA = shutil.which("lua5.1")
pytestmark = pytest.mark.skipif(LUA is None, reason="lua5.1 is not installed (packaging/run-tests installs it)")

CONF = config.from_dict({
    "state_dir": "/s", "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}},
    "datasets": {"imagenet22t": {"source": "/d/i", "groups": ["daemon", "ml"]}, "coco": {"source": "/d/c"}}})

HARNESS = """
slurm = {{ SUCCESS = 0, ERROR = -1 }}
package.path = "{sbatch_ext}/?.lua;" .. package.path
local d = require("dsstage_submit")
d.catalog_path = "{catalog}"
local env = {{}}
local i = 0
for entry in string.gmatch("{env}", "[^|]+") do env[i] = entry; i = i + 1 end
local job = {{ spank_job_env = (i > 0) and env or nil, admin_comment = "{admin}" }}
local rc, msg = d.check(job, {uid})
print(rc, msg or "", job.admin_comment or "")
"""


def check(tmp_path, env: list[str], uid: int = 0, admin: str = "") -> tuple[int, str, str]:
    catalog = tmp_path / "dsstage_catalog.lua"
    if not catalog.exists():
        catalog.write_text(luacatalog.render(CONF))
    script = HARNESS.format(sbatch_ext=ROOT / "sbatch_ext", catalog=catalog, env="|".join(env), uid=uid,
                            admin=admin)
    out = subprocess.run([LUA, "-e", script], capture_output=True, text=True, check=True).stdout
    rc, msg, comment = out.rstrip("\n").split("\t")
    return int(rc), msg, comment


def test_no_dataset_is_accepted_untouched(tmp_path):
    assert check(tmp_path, []) == (0, "", "")
    assert check(tmp_path, ["OTHER=1"]) == (0, "", "")


def test_accepted_request_is_recorded(tmp_path):
    env = ["DSSTAGE_DATASETS=coco,imagenet22t", "_SLURM_SPANK_OPTION_dsstage_dataset=coco,imagenet22t"]
    assert check(tmp_path, env) == (0, "", "dsstage=coco,imagenet22t")
    assert check(tmp_path, env, admin="site=x dsstage=old") == (0, "", "site=x dsstage=coco,imagenet22t")


def test_unknown_dataset_suggests(tmp_path):
    rc, msg, _ = check(tmp_path, ["DSSTAGE_DATASETS=imagenet22k"])
    assert rc == -1
    assert msg == "dsstage: unknown dataset 'imagenet22k' (did you mean 'imagenet22t'?); `dsstage ls` lists the catalog"
    assert "did you mean 'coco'" in check(tmp_path, ["DSSTAGE_DATASETS=cooc"])[1]


@pytest.mark.parametrize("value,needle", [
    ("", "--dataset is empty"), ("a" * 1100, "at most 1024"), ("coco,,x", "empty dataset name"),
    ("../etc", "is not allowed"), ("Coco", "is not allowed"), ("coco;id", "is not allowed"),
])
def test_malformed_values(tmp_path, value, needle):
    rc, msg, comment = check(tmp_path, [f"DSSTAGE_DATASETS={value}"])
    assert rc == -1 and needle in msg and comment == ""


def test_conflicting_values_are_rejected(tmp_path):
    rc, msg, _ = check(tmp_path, ["DSSTAGE_DATASETS=coco", "_SLURM_SPANK_OPTION_dsstage_dataset=imagenet22t"])
    assert rc == -1 and "conflicting --dataset values" in msg


def test_groups_are_checked_with_the_system(tmp_path):
    rc, msg, _ = check(tmp_path, ["DSSTAGE_DATASETS=imagenet22t"], uid=65534)  # nobody
    assert rc == -1
    assert msg == ("dsstage: dataset 'imagenet22t' is restricted to group(s) daemon, ml; you are in none of them: "
                   "ask the dataset's owners for access")
    assert check(tmp_path, ["DSSTAGE_DATASETS=imagenet22t"], uid=1)[0] == 0  # daemon
    assert check(tmp_path, ["DSSTAGE_DATASETS=coco"], uid=65534)[0] == 0


def test_missing_or_damaged_catalog_is_an_admin_message(tmp_path):
    (tmp_path / "dsstage_catalog.lua").write_text("return 42\n")
    rc, msg, _ = check(tmp_path, ["DSSTAGE_DATASETS=coco"])
    assert rc == -1 and "is damaged; an admin must run `dsstage export-catalog`" in msg


def test_generated_catalog_is_stamped_by_content():
    text = luacatalog.render(CONF)
    assert text.startswith("-- dsstage catalog ")
    assert '["imagenet22t"] = { groups = {"daemon", "ml"} }' in text
    assert '["coco"] = { groups = nil }' in text
    other = config.from_dict({**{"state_dir": "/s", "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}}},
                              "datasets": {"coco": {"source": "/d/c"}}})
    assert luacatalog.render(other).splitlines()[0] != text.splitlines()[0]
