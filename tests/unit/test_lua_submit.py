"""dsstage_submit.lua under a real Lua 5.1, with the catalog dsstage generates."""

import grp
import logging
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest
from dsstage.config import load
from dsstage.errors import DsstageError
from dsstage.slurm import luacatalog

ROOT = Path(__file__).resolve().parents[2]
LUA = shutil.which("lua5.1")
pytestmark = pytest.mark.skipif(LUA is None, reason="lua5.1 is not installed (packaging/run-tests installs it)")

CONF = load.from_dict({
    "state_dir": "/s", "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}},
    "datasets": {"imagenet22t": {"source": "/d/i", "groups": ["daemon", "ml"]}, "coco": {"source": "/d/c"}}})

# the directory as plain data: alice is listed in ml, carol has ml as her primary group
GROUPS = {"ml": grp.struct_group(("ml", "x", 2000, ["alice", "ghost"])),
          "daemon": grp.struct_group(("daemon", "x", 1, []))}
USERS = [pwd.struct_passwd((n, "x", uid, gid, "", "/", "/bin/sh"))
         for n, uid, gid in [("daemon", 1, 1), ("alice", 1001, 1001), ("bob", 1002, 1002), ("carol", 1003, 2000)]]
GENERATED = 1_700_000_000  # 2023-11-14 22:13:20 UTC


def getpwnam(name):
    for entry in USERS:
        if entry.pw_name == name:
            return entry
    raise KeyError(name)


def render(conf=CONF, groups=GROUPS, slurm_version=None, sized=None):
    return luacatalog.render(conf, getgrnam=groups.__getitem__, getpwnam=getpwnam, getpwall=lambda: USERS,
                             now=lambda: GENERATED, slurm_version=slurm_version, sized=sized)

HARNESS = """
slurm = {{ SUCCESS = 0, ERROR = -1 }}
package.path = "{sbatch_ext}/?.lua;" .. package.path
local d = require("dsstage_submit")
d.catalog_path = "{catalog}"
local env = {{}}
local i = 0
for entry in string.gmatch("{env}", "[^|]+") do env[i] = entry; i = i + 1 end
local job = {{ spank_job_env = (i > 0) and env or nil, admin_comment = "{admin}" }}
if "{prefer}" ~= "" then job.prefer = "{prefer}" end
if "{array}" ~= "" then job.array_inx = "{array}" end
if "{features}" ~= "" then job.features = "{features}" end
if "{nodes}" ~= "" then job.req_nodes = "{nodes}" end
if "{min_nodes}" ~= "" then job.min_nodes = tonumber("{min_nodes}") end
local script = [==[{script}]==]
if script ~= "" then job.script = script end
if "{tasks}" ~= "" then job.num_tasks = tonumber("{tasks}"); job.ntasks_per_node = tonumber("{per_node}") end
if "{partition}" ~= "" then job.partition = "{partition}" end
-- slurmctld's part_list: records keyed by name, read through a metatable that raises on a
-- field it does not know ("NAME" or "NAME:default" per entry)
local parts = nil
if "{parts}" ~= "" then
  parts = {{}}
  for entry in string.gmatch("{parts}", "[^,]+") do
    local name, dflt = string.match(entry, "^([^:]*):?(.*)$")
    parts[name] = setmetatable({{}}, {{ __index = function(_, k)
      if k == "name" then return name end
      if k == "flag_default" then return (dflt == "default") and 1 or 0 end
      error("no field " .. k)
    end }})
  end
end
local rc, msg = d.check(job, {uid}, parts)
print(rc, msg or "", job.admin_comment or "", job.prefer or "")
"""


def check(tmp_path, env: list[str], uid: int = 0, admin: str = "") -> tuple[int, str, str]:
    rc, msg, comment, _prefer = run_check(tmp_path, env, uid, admin)
    return rc, msg, comment


def run_check(tmp_path, env: list[str], uid: int = 0, admin: str = "", prefer: str = "",
              conf=CONF, array: str = "", features: str = "", nodes: str = "", min_nodes: str = "",
              tasks: str = "", per_node: str = "", sized=None, script: str = "", partition: str = "",
              parts: str = "") -> tuple[int, str, str, str]:
    catalog = tmp_path / "dsstage_catalog.lua"
    if not catalog.exists():
        catalog.write_text(render(conf, sized=sized))
    script = HARNESS.format(sbatch_ext=ROOT / "sbatch_ext", catalog=catalog, env="|".join(env), uid=uid,
                            admin=admin, prefer=prefer, array=array, features=features, nodes=nodes,
                            min_nodes=min_nodes, tasks=tasks, per_node=per_node, script=script,
                            partition=partition, parts=parts)
    out = subprocess.run([LUA, "-e", script], capture_output=True, text=True, check=True).stdout
    rc, msg, comment, prefer_out = out.rstrip("\n").split("\t")
    return int(rc), msg, comment, prefer_out


def test_accepted_request_prefers_nodes_holding_the_data(tmp_path):
    env = ["DSSTAGE_DATASETS=coco,imagenet22t"]
    assert run_check(tmp_path, env)[3] == "ds_coco&ds_imagenet22t"
    assert run_check(tmp_path, env, prefer="gpu_a100")[3] == "gpu_a100"  # the user's own is left alone
    assert run_check(tmp_path, ["DSSTAGE_DATASETS=nope"])[3] == ""  # a refused request gets none
    off = load.from_dict({"state_dir": "/s", "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}},
                            "datasets": {"coco": {"source": "/d/c"}},
                            "placement": {"prefer": False, "prefix": "data-"}})
    (tmp_path / "dsstage_catalog.lua").unlink()
    assert run_check(tmp_path, ["DSSTAGE_DATASETS=coco"], conf=off)[3] == ""


@pytest.mark.parametrize("version, prefer", [("22.05.8", ""), (None, ""), ("23.02.1", "ds_coco"),
                                             ("24.11.6", "ds_coco")])
def test_a_job_array_prefers_the_data_only_where_slurm_can_schedule_it(tmp_path, version, prefer):
    """Slurm 22.05 leaves an array that prefers a feature no node has pending for good
    (BadConstraints, seen on the devcluster); 23.02 and later start it anywhere."""
    (tmp_path / "dsstage_catalog.lua").write_text(render(slurm_version=version))
    assert run_check(tmp_path, ["DSSTAGE_DATASETS=coco"], array="0-2")[3] == prefer
    assert run_check(tmp_path, ["DSSTAGE_DATASETS=coco"])[3] == "ds_coco"  # not an array: always


@pytest.mark.parametrize("constraint, prefer", [
    ("gpu", "gpu&ds_coco"), ("gpu&nvme", "gpu&nvme&ds_coco"), ("a100|h100", "(a100|h100)&ds_coco"),
    ("[rack1|rack2]", ""), ("gpu*2", ""), ("gpu,nvme", ""), ("!gpu", "")])
def test_the_preference_keeps_the_users_constraint(tmp_path, constraint, prefer):
    """Slurm's --prefer overrides --constraint where it can (sbatch(1); -C gpu --prefer=ds_x ran on
    a node without gpu on 22.05, 24.11 and 26.05): the preference carries the constraint, or is
    left out where --prefer cannot say it."""
    assert run_check(tmp_path, ["DSSTAGE_DATASETS=coco"], features=constraint)[3] == prefer


def test_a_job_that_names_its_nodes_gets_no_preference(tmp_path):
    """-w n1 with a preference n1 cannot meet: BadConstraints on 24.11+ while n1 is busy."""
    assert run_check(tmp_path, ["DSSTAGE_DATASETS=coco"], nodes="n1")[3] == ""
    assert run_check(tmp_path, ["DSSTAGE_DATASETS=coco"], nodes="n1", features="gpu")[3] == ""


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


@pytest.mark.parametrize("uid", [1001, 1003, 1])  # a listed member, a primary group, the other group
def test_restricted_dataset_allowed_by_uid(tmp_path, uid):
    env = ["DSSTAGE_DATASETS=coco,imagenet22t"]
    assert check(tmp_path, env, uid=uid) == (0, "", "dsstage=coco,imagenet22t")


def test_restricted_dataset_refused_with_the_catalog_age(tmp_path):
    rc, msg, comment = check(tmp_path, ["DSSTAGE_DATASETS=coco,imagenet22t"], uid=1002)  # bob
    assert (rc, comment) == (-1, "")
    assert msg == ("dsstage: dataset 'imagenet22t' is restricted to group(s) daemon, ml; you are in none of them: "
                   "ask the dataset's owners for access; group changes take effect when `dsstage export-catalog` "
                   "regenerates the catalog (a timer runs it; this catalog is from 2023-11-14 22:13 UTC)")
    assert check(tmp_path, ["DSSTAGE_DATASETS=imagenet22t"], uid=65534)[0] == -1


def test_root_may_use_every_dataset(tmp_path):
    assert check(tmp_path, ["DSSTAGE_DATASETS=imagenet22t"], uid=0) == (0, "", "dsstage=imagenet22t")


def test_unrestricted_dataset_has_no_uids_and_allows_everyone(tmp_path):
    text = render()
    assert '["coco"] = { groups = nil },' in text
    assert check(tmp_path, ["DSSTAGE_DATASETS=coco"], uid=1002) == (0, "", "dsstage=coco")
    assert check(tmp_path, ["DSSTAGE_DATASETS=coco"], uid=65534)[0] == 0


def test_catalog_without_uids_for_a_restricted_dataset_is_an_admin_message(tmp_path):
    (tmp_path / "dsstage_catalog.lua").write_text(
        'return { datasets = { ["imagenet22t"] = { groups = {"ml"} }, ["coco"] = { groups = nil } } }\n')
    rc, msg, _ = check(tmp_path, ["DSSTAGE_DATASETS=imagenet22t"], uid=1001)
    assert rc == -1 and "lists no users for 'imagenet22t'; an admin must run `dsstage export-catalog`" in msg
    assert check(tmp_path, ["DSSTAGE_DATASETS=imagenet22t"], uid=0)[0] == 0
    assert check(tmp_path, ["DSSTAGE_DATASETS=coco"], uid=1001)[0] == 0


def test_the_lua_starts_no_program():
    # slurmctld runs this for every submission: it must never wait on a command or a lookup
    for path in (ROOT / "sbatch_ext").glob("*.lua"):
        text = path.read_text()
        if path.name == "burst_buffer.lua":
            # its callbacks that run inside slurmctld; the others run in slurmscriptd's processes
            import re
            text = "".join(m.group(0) for m in re.finditer(
                r"(?ms)^function slurm_bb_(job_process|paths|pools)\(.*?^end$", text))
            assert text.count("function slurm_bb_") == 3
            assert "command(" not in text
        for word in ("popen", "execute"):
            assert word not in text, f"{path.name} mentions {word}"


def test_catalog_lists_the_uids_of_the_groups(caplog):
    with caplog.at_level(logging.WARNING, logger="dsstage"):
        text = render()
    assert "  generated = 1700000000,\n" in text
    assert ('["imagenet22t"] = { groups = {"daemon", "ml"}, uids = {[1] = true, [1001] = true, [1003] = true} },'
            in text)
    assert "members ghost of its groups are unknown to passwd" in caplog.text


def test_a_missing_group_is_a_warning_and_no_group_at_all_an_error(caplog):
    with caplog.at_level(logging.WARNING, logger="dsstage"):
        text = render(groups={"daemon": GROUPS["daemon"]})
    assert '["imagenet22t"] = { groups = {"daemon", "ml"}, uids = {[1] = true} },' in text
    assert "group ml (dataset imagenet22t) does not exist here" in caplog.text
    with pytest.raises(DsstageError, match=r"no group of any restricted dataset resolves \(daemon, ml\)"):
        render(groups={})


def test_missing_or_damaged_catalog_is_an_admin_message(tmp_path):
    (tmp_path / "dsstage_catalog.lua").write_text("return 42\n")
    rc, msg, _ = check(tmp_path, ["DSSTAGE_DATASETS=coco"])
    assert rc == -1 and "is damaged; an admin must run `dsstage export-catalog`" in msg


SEARCH_HARNESS = """
local logged = {{}}
slurm = {{ SUCCESS = 0, ERROR = -1, log_error = function(fmt, ...) table.insert(logged, string.format(fmt, ...)) end }}
package.path = "{sbatch_ext}/?.lua;" .. package.path
local d = require("dsstage_submit")
d.catalog_search = {{ "{first}", "{second}" }}
for _ = 1, 3 do
    local job = {{ spank_job_env = {{ [0] = "DSSTAGE_DATASETS=coco" }} }}
    local rc, msg = d.check(job, 0)
    print(rc, msg or "")
end
print(#logged, logged[1] or "")
"""


def search(tmp_path, first: Path, second: Path) -> list[str]:
    code = SEARCH_HARNESS.format(sbatch_ext=ROOT / "sbatch_ext", first=first, second=second)
    return subprocess.run([LUA, "-e", code], capture_output=True, text=True, check=True).stdout.splitlines()


def test_the_catalog_is_read_from_dsstages_own_directory_first(tmp_path):
    """The generated catalog lives under /var/lib/dsstage, which configuration management
    owning /etc/slurm does not purge; one beside the Lua is read when that one is missing.
    None at all: every --dataset job is refused, and slurmctld's log says it once."""
    first, second = tmp_path / "var" / "dsstage_catalog.lua", tmp_path / "etc" / "dsstage_catalog.lua"
    out = search(tmp_path, first, second)
    assert out[0].startswith("-1\tdsstage: the dataset catalog " f"{first} or {second} is missing"), out
    assert f"run `dsstage export-catalog -o {first}`" in out[0]
    assert out[3].startswith("1\tdsstage: the dataset catalog"), out  # logged once for three jobs
    second.parent.mkdir()
    second.write_text(render())
    assert search(tmp_path, first, second)[:3] == ["0\t"] * 3
    first.parent.mkdir()
    first.write_text("return 42\n")  # the one in /var/lib/dsstage wins, here a damaged one
    assert f"catalog {first} is damaged" in search(tmp_path, first, second)[0]
    assert Path(ROOT / "sbatch_ext" / "dsstage_submit.lua").read_text().count(
        'M.catalog_search = { "/var/lib/dsstage/dsstage_catalog.lua" }') == 1


def test_generated_catalog_is_stamped_by_content():
    text = render()
    assert text.startswith("-- dsstage catalog ")
    other = load.from_dict({**{"state_dir": "/s", "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}}},
                              "datasets": {"coco": {"source": "/d/c"}}})
    assert render(other).splitlines()[0] != text.splitlines()[0]
    fewer = {**GROUPS, "ml": grp.struct_group(("ml", "x", 2000, []))}
    assert render(groups=fewer).splitlines()[0] != text.splitlines()[0]  # a membership change reloads it


BB_HARNESS = """
slurm = {{ SUCCESS = 0, ERROR = -1, log_info = function() end }}
dofile("{sbatch_ext}/burst_buffer.lua")
require("dsstage_submit").catalog_path = "{catalog}"
local rc, msg = slurm_bb_job_process("{script}", {uid})
print(rc, msg or "")
"""


def bb_process(tmp_path, script: str, uid: str = "nil") -> tuple[int, str]:
    catalog = tmp_path / "dsstage_catalog.lua"
    if not catalog.exists():
        catalog.write_text(render())
    path = tmp_path / "job.sh"
    path.write_text(script)
    code = BB_HARNESS.format(sbatch_ext=ROOT / "sbatch_ext", catalog=catalog, script=path, uid=uid)
    out = subprocess.run([LUA, "-e", code], capture_output=True, text=True, check=True).stdout
    rc, msg = out.rstrip("\n").split("\t")
    return int(rc), msg


def test_burst_buffer_directive_is_validated_like_dataset(tmp_path):
    assert bb_process(tmp_path, "#!/bin/sh\n#BB_LUA dataset=coco\ntrue\n") == (0, "")
    assert bb_process(tmp_path, "#!/bin/sh\ntrue\n") == (0, "")  # no directive: nothing to do
    rc, msg = bb_process(tmp_path, "#!/bin/sh\n#BB_LUA dataset=imagenet22k\n")
    assert rc == -1 and msg.startswith("dsstage: unknown dataset 'imagenet22k' (did you mean 'imagenet22t'?)")
    rc, msg = bb_process(tmp_path, "#!/bin/sh\n#BB_LUA capacity=1TB\n")
    assert rc == -1 and "#BB_LUA capacity=1TB: unknown option" in msg
    for bare in ("#BB_LUA", "#BB_LUA   "):  # a directive with no option says so, not "#BB_LUA #BB_LUA"
        rc, msg = bb_process(tmp_path, f"#!/bin/sh\n{bare}\ntrue\n")
        assert (rc, msg) == (-1, "dsstage: #BB_LUA with no option; write #BB_LUA dataset=NAME[,NAME...]"), msg
    # 22.05 passes no uid (nil): restricted datasets are left to job_submit and the Prolog;
    # 23.02+ passes it
    assert bb_process(tmp_path, "#BB_LUA dataset=imagenet22t\n")[0] == 0
    assert bb_process(tmp_path, "#BB_LUA dataset=imagenet22t\n", uid='"1002"')[0] == -1


def test_job_submit_records_burst_buffer_directives(tmp_path):
    catalog = tmp_path / "dsstage_catalog.lua"
    catalog.write_text(render())
    code = f"""
slurm = {{ SUCCESS = 0, ERROR = -1 }}
package.path = "{ROOT / 'sbatch_ext'}/?.lua;" .. package.path
local d = require("dsstage_submit")
d.catalog_path = "{catalog}"
local job = {{ script = "#!/bin/sh\\n#BB_LUA dataset=coco\\ntrue\\n", burst_buffer = "#BB_LUA dataset=coco" }}
local rc, msg = d.check(job, 0)
print(rc, msg or "", job.admin_comment or "", job.prefer or "")
"""
    out = subprocess.run([LUA, "-e", code], capture_output=True, text=True, check=True).stdout
    assert out.rstrip("\n").split("\t") == ["0", "", "dsstage=coco", "ds_coco"]


@pytest.mark.parametrize("entry", ["SPANK_DSSTAGE_DATASETS=imagenet22t",
                                   "SPANK__SLURM_SPANK_OPTION_dsstage_dataset=imagenet22t"])
def test_an_entry_the_prolog_would_read_as_set_by_another_plugin_is_refused(tmp_path, entry):
    """slurmd passes an entry already named SPANK_... to the Prolog as it is: a user's own
    SPANK plugin would hand the Prolog a request this check never saw."""
    rc, msg, comment = check(tmp_path, ["DSSTAGE_DATASETS=coco", "_SLURM_SPANK_OPTION_dsstage_dataset=coco", entry])
    assert rc == -1 and "only Slurm may" in msg and entry.split("=")[0] in msg
    assert comment == ""


BBSTAT_HARNESS = """
slurm = {{ SUCCESS = 0, ERROR = -1 }}
local started = {{}}
os.execute = function(cmd) started[#started + 1] = cmd; return 0 end
dofile("{script}")
local function show(...)
    local rc, text = slurm_bb_get_status(...)
    io.write(rc, "|", #started, "|", started[#started] or "", "|", text, "\\n@@\\n")
end
{calls}
"""


def bbstat(tmp_path: Path, calls: str, slurm_version: str | None = None) -> list[tuple[int, int, str, str]]:
    """burst_buffer.lua's slurm_bb_get_status under Lua 5.1, with os.execute recorded, not run."""
    etc = tmp_path / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "sbatch_ext" / "burst_buffer.lua", etc)
    shutil.copy(ROOT / "sbatch_ext" / "dsstage_submit.lua", etc)
    answers = tmp_path / "answers"
    answers.mkdir(exist_ok=True)
    conf = load.from_dict({"state_dir": "/s", "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}},
                           "burst_buffer": {"status_dir": str(answers), "status_max_age": 10},
                           "datasets": {"coco": {"source": "/d/c"}}})
    (etc / "dsstage_catalog.lua").write_text(luacatalog.render(conf, command=["/usr/bin/dsstage"],
                                                               slurm_version=slurm_version))
    out = subprocess.run([LUA, "-"], input=BBSTAT_HARNESS.format(script=etc / "burst_buffer.lua", calls=calls),
                         capture_output=True, text=True, check=True).stdout
    rows = []
    for chunk in out.split("\n@@\n")[:-1]:
        rc, n, cmd, text = chunk.split("|", 3)
        rows.append((int(rc), int(n), cmd, text))
    return rows


def test_bbstat_reads_its_answer_and_starts_one_refresh_in_the_background(tmp_path):
    import time
    rows = bbstat(tmp_path, 'show("dataset", "coco")\nshow("dataset", "coco")')
    assert rows[0][1] == 1 and "setsid -f timeout" in rows[0][2] and "'bb' 'status' 'dataset=coco'" in rows[0][2]
    assert "being computed" in rows[0][3]
    assert rows[1][1] == 1, "a refresh already under way is not started twice"
    (tmp_path / "answers" / "dataset=coco").write_text(f"-- dsstage bbstat {int(time.time())}\nfresh answer\n")
    (tmp_path / "answers" / "all").write_text(f"-- dsstage bbstat {int(time.time()) - 100}\nold answer\n")
    rows = bbstat(tmp_path, 'show("dataset", "coco")\nshow()')
    assert rows[0][1] == 0 and rows[0][3] == "fresh answer\n"
    assert rows[1][1] == 1 and "'all'" in rows[1][2]
    assert rows[1][3].startswith("(computed 10") and rows[1][3].endswith("old answer\n")
    (tmp_path / "answers" / "all").write_text("no header\n")  # damaged: still an answer, never a Lua error
    rows = bbstat(tmp_path, 'show()')
    assert rows[0][0] == 0 and rows[0][3].startswith("(computed at an unknown time;")


def test_bbstat_reads_the_arguments_as_each_series_passes_them(tmp_path):
    """22.05 passes only the words after bbstat; 23.02 and later the caller's uid and gid first."""
    rows = bbstat(tmp_path, 'show("node", "n[1-2]")\nshow(1000, 1000, "node", "n[1-2]")\nshow("42")\n'
                            'show(1000, 1000)\nshow("node", "n1;rm")\nshow("dataset")')
    assert "'node=n[1-2]'" in rows[0][2]
    assert "'node=n[1-2]@1000'" in rows[1][2]
    assert "'job=42'" in rows[2][2]
    assert "'all@1000'" in rows[3][2]
    assert rows[4][3].startswith("usage:") and rows[5][3].startswith("usage:") and rows[5][1] == rows[3][1]


#: what slurmctld requires of burst_buffer.lua before it starts: 23.02's eleven functions, and
#: the two 24.05 added (a slurmctld of 24.05 or later does not start without them)
REQUIRED_BB = {"22.05": ["job_process", "pools", "job_teardown", "setup", "data_in", "real_size", "paths",
                         "pre_run", "post_run", "data_out", "get_status"]}
REQUIRED_BB["24.05"] = REQUIRED_BB["22.05"] + ["test_data_in", "test_data_out"]


@pytest.mark.parametrize("series", sorted(REQUIRED_BB))
def test_burst_buffer_lua_defines_every_function_slurm_requires(tmp_path, series):
    script = ROOT / "sbatch_ext" / "burst_buffer.lua"
    probe = (f'slurm = {{ SUCCESS = 0, ERROR = -1 }}\ndofile("{script}")\n'
             + "".join(f'io.write(type(slurm_bb_{f}), " ")\n' for f in REQUIRED_BB[series])
             + 'io.write(select("#", slurm_bb_test_data_in(7)), " ", tostring(slurm_bb_test_data_in(7)), "\\n")\n')
    out = subprocess.run([LUA, "-"], input=probe, capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout.split()
    assert out[:len(REQUIRED_BB[series])] == ["function"] * len(REQUIRED_BB[series])
    assert out[-2:] == ["1", "0"], "stage-in is done at once: SUCCESS, never BUSY"


def test_bbstat_reads_the_uid_only_where_the_catalogs_slurm_passes_one(tmp_path):
    """24.11 passes uid and gid as strings; on 22.05 two numbers are a caller's words, never an
    identity it could claim (the catalog says which series export-catalog found)."""
    rows = bbstat(tmp_path, 'show("0", "0", "dataset", "coco")\nshow("1000", "1000")', slurm_version="24.11")
    assert "'dataset=coco@0'" in rows[0][2] and "'all@1000'" in rows[1][2]
    rows = bbstat(tmp_path / "old", 'show("1000", "1000")\nshow("dataset", "coco")', slurm_version="22.05")
    assert rows[0][3].startswith("usage:") and "@" not in rows[1][2] and "'dataset=coco'" in rows[1][2]


SIZED = {"imagenet22t": {"bytes": 22_200 * 10**9, "room": 3_100 * 10**9, "size": "20.2 TiB", "room_text": "2.8 TiB",
                         "shards": 1024, "least": 8},
         "coco": {"bytes": 5_000 * 10**9, "room": 3_100 * 10**9, "size": "4.5 TiB", "room_text": "2.8 TiB"}}


@pytest.mark.parametrize("opts, ok", [
    ({}, False), ({"min_nodes": "4"}, False), ({"min_nodes": "8"}, True), ({"min_nodes": "16"}, True),
    ({"tasks": "64", "per_node": "8"}, True), ({"tasks": "64", "per_node": "16"}, False),
    ({"min_nodes": str(0xfffffffe)}, False)])
def test_a_job_whose_nodes_cannot_hold_a_sharded_dataset_is_told_how_many_to_ask_for(tmp_path, opts, ok):
    rc, msg, _c, _p = run_check(tmp_path, ["DSSTAGE_DATASETS=imagenet22t"], sized=SIZED, **opts)
    if ok:
        assert rc == 0, msg
    else:
        assert rc != 0 and msg == ("dsstage: imagenet22t is 20.2 TiB in 1024 shards; each node holds 2.8 TiB: ask "
                                   "for at least 8 nodes (--nodes=8)"), msg


@pytest.mark.parametrize("min_nodes, ok", [("4", False), ("8", True)])
def test_a_bb_lua_directive_gets_the_same_fit_check(tmp_path, min_nodes, ok):
    rc, msg, _c, _p = run_check(tmp_path, [], sized=SIZED, min_nodes=min_nodes,
                                script="#!/bin/bash\n#BB_LUA dataset=imagenet22t\nsrun train.py\n")
    assert (rc == 0) == ok, msg
    assert ok or msg.endswith("ask for at least 8 nodes (--nodes=8)"), msg


def test_a_dataset_larger_than_a_node_without_shards_is_refused_saying_what_admins_can_do(tmp_path):
    rc, msg, _c, _p = run_check(tmp_path, ["DSSTAGE_DATASETS=coco"], sized=SIZED, min_nodes="4")
    assert rc != 0 and "coco is 4.5 TiB, more than a node holds (2.8 TiB)" in msg and "shards: N" in msg
    (tmp_path / "unsized").mkdir()
    rc, msg, _c, _p = run_check(tmp_path / "unsized", ["DSSTAGE_DATASETS=coco"])
    assert rc == 0, msg  # no size in the catalog (a tier sized as a share of the disk): no check


def test_the_catalog_sizes_datasets_from_their_manifests(tmp_path):
    from dsstage.config.manifest import Catalog, Entry, Manifest, compute_digest
    from dsstage.shards import index as shard_index
    conf = load.from_dict({"state_dir": str(tmp_path), "tiers": {"nvme": {"path": "/l", "capacity": "3000B",
                                                                         "high_watermark": "90%"}},
                           "datasets": {"big": {"source": "/d/b", "shards": 4}, "small": {"source": "/d/s"},
                                        "none": {"source": "/d/n"}}})
    catalog = Catalog(str(tmp_path))
    for name, n in (("big", 40), ("small", 3)):
        entries = [Entry(f"f{i:03d}", 100, 0, f"{i:064x}") for i in range(n)]
        m = Manifest(name, compute_digest(entries), entries, 100 * n, 0.0)
        if name == "big":
            shard_index.publish(catalog, m, 4)
        catalog.publish(m)
    got = luacatalog.sizes(conf)
    assert got["big"]["least"] == 2 and got["big"]["room"] == 2700 and got["small"]["bytes"] == 300
    assert "none" not in got and "least" not in got["small"]


LOADER = """
slurm = {{ SUCCESS = 0, ERROR = -1, errors = {{}}, users = {{}} }}
function slurm.log_error(fmt, ...) slurm.errors[#slurm.errors + 1] = string.format(fmt, ...) end
function slurm.log_user(fmt, ...) slurm.users[#slurm.users + 1] = string.format(fmt, ...) end
dofile("{job_submit}")
for _, job in ipairs({{ {{}}, {{ spank_job_env = {{ [0] = "_SLURM_SPANK_OPTION_dsstage_dataset=coco" }} }},
                       {{ script = "#!/bin/sh\\n#BB_LUA dataset=coco\\nhostname\\n" }},
                       {{ spank_job_env = {{ [0] = "OTHER=1" }}, script = "#!/bin/sh\\nhostname\\n" }} }}) do
    print(slurm_job_submit(job, {{}}, 1001))
end
print(#slurm.errors, slurm.errors[1] or "", slurm.users[1] or "")
"""


@pytest.mark.parametrize("module_there", [False, True])
def test_job_submit_lua_without_its_module_refuses_only_dataset_jobs(tmp_path, module_there):
    """Issue 54: ``require("dsstage_submit")`` was unprotected, so a job_submit.lua whose module
    was purged (Puppet, the package removed) failed to load and slurmctld died at start or
    takeover. Now loading succeeds either way; without the module only the jobs that ask for
    a dataset are refused, saying why."""
    shutil.copy(ROOT / "sbatch_ext" / "job_submit.lua", tmp_path / "job_submit.lua")
    if module_there:
        shutil.copy(ROOT / "sbatch_ext" / "dsstage_submit.lua", tmp_path / "dsstage_submit.lua")
        (tmp_path / "dsstage_catalog.lua").write_text(render())
    script = LOADER.format(job_submit=tmp_path / "job_submit.lua")
    res = subprocess.run([LUA, "-e", script], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    if module_there:
        assert lines[0] == "0" and lines[3] == "0" and lines[4].startswith("0")  # the module decides the rest
    else:
        assert lines[:4] == ["0", "-1", "-1", "0"], lines  # refused: the --dataset and the #BB_LUA job only
        assert "cannot load dsstage_submit.lua" in lines[4] and "submit without --dataset" in lines[4], lines


def _pilot(outside: str = "source"):
    return load.from_dict({**_BASE, "rollout": {"partitions": ["gpu-pilot"], "outside": outside}})


_BASE = {"state_dir": "/s", "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}},
         "datasets": {"coco": {"source": "/d/c"}}}


@pytest.mark.parametrize("partition, parts, acts", [
    ("gpu-pilot", "", True), ("batch", "", False), ("batch,gpu-pilot", "", True),
    ("", "batch:default,gpu-pilot", False), ("", "batch,gpu-pilot:default", True),
    ("", "", True),  # neither given nor known: as without a pilot
])
def test_outside_the_pilot_a_job_is_as_without_dsstage(tmp_path, partition, parts, acts):
    """rollout.partitions: a job that can run only outside the pilot is checked (unknown names
    are still refused) but gets no preference and no record; its default partition comes
    from slurmctld's part_list."""
    rc, msg, comment, prefer = run_check(tmp_path, ["DSSTAGE_DATASETS=coco"], conf=_pilot(), partition=partition,
                                         parts=parts)
    assert (rc, msg) == (0, "")
    assert (comment, prefer) == (("dsstage=coco", "ds_coco") if acts else ("", ""))
    rc, msg, _c, _p = run_check(tmp_path, ["DSSTAGE_DATASETS=cocoa"], conf=_pilot(), partition=partition,
                                parts=parts)
    assert rc == -1 and "unknown dataset 'cocoa'" in msg


def test_outside_the_pilot_the_admins_may_refuse_datasets(tmp_path):
    rc, msg, comment, _p = run_check(tmp_path, ["DSSTAGE_DATASETS=coco"], conf=_pilot("refuse"), partition="batch")
    assert rc == -1 and msg == ("dsstage: datasets are staged only in partition(s) gpu-pilot for now; submit to "
                                "one of them (--partition=...) or without --dataset")
    assert run_check(tmp_path, ["DSSTAGE_DATASETS=coco"], conf=_pilot("refuse"), partition="gpu-pilot")[0] == 0
    assert run_check(tmp_path, [], conf=_pilot("refuse"), partition="batch")[:2] == (0, "")


BB_LOADER = """
slurm = {{ SUCCESS = 0, ERROR = -1, errors = {{}} }}
function slurm.log_error(fmt, ...) slurm.errors[#slurm.errors + 1] = string.format(fmt, ...) end
function slurm.log_info() end
dofile("{bb}")
local asking = "{asking}"
local plain = "{plain}"
print(slurm_bb_job_process(plain, 1001, 1001))
print(slurm_bb_job_process(asking, 1001, 1001))
print(slurm_bb_pre_run(7, asking, 1001, 1001))
print(slurm_bb_pre_run(8, plain, 1001, 1001))
print(#slurm.errors, slurm.errors[1] or "")
"""


def test_burst_buffer_lua_without_its_module_refuses_only_dataset_requests(tmp_path):
    """Issue 54, item 4, for burst_buffer.lua too: its require was unprotected, so a purged
    dsstage_submit.lua broke the burst-buffer plugin at slurmctld's start or takeover. Now it
    loads; a #BB_LUA dataset= job is refused at submit, saying why, and one that was accepted
    before stops at pre_run rather than run without its datasets; other jobs pass."""
    shutil.copy(ROOT / "sbatch_ext" / "burst_buffer.lua", tmp_path / "burst_buffer.lua")
    asking, plain = tmp_path / "asking.sh", tmp_path / "plain.sh"
    asking.write_text("#!/bin/sh\n#BB_LUA dataset=coco\nhostname\n")
    plain.write_text("#!/bin/sh\nhostname\n")
    script = BB_LOADER.format(bb=tmp_path / "burst_buffer.lua", asking=asking, plain=plain)
    res = subprocess.run([LUA, "-e", script], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "0", lines
    assert lines[1].startswith("-1\tdsstage: datasets cannot be requested now") and "#BB_LUA" in lines[1], lines
    assert lines[2].startswith("-1\tdsstage: datasets cannot be requested now"), lines
    assert lines[3] == "0", lines
    assert lines[4].startswith("1\tdsstage: cannot load dsstage_submit.lua"), lines
