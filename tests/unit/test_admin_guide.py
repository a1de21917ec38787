"""Every command in docs/admin-guide.md, and every slurm.conf line it tells admins to add,
is run by a named test or by a script of packaging/ (devcluster, demo, run-tests, build-deb).

The guide's commands are the shell lines of its code blocks (fenced ``bash``/``console``
blocks, and indented blocks, whose other lines are messages and layouts), the slurm.conf
lines of its indented blocks (``Key=value``) and prose (``JobSubmitPlugins=lua``), and
inline code in its prose that starts with a command name. Each must have an entry in
COVERAGE naming where it runs, as in tests/unit/test_user_guide.py: a slurm.conf line
where packaging/devcluster writes it, a command in a test function (whose source must
contain the given pieces) or a script; the cluster tests themselves run with
``-m cluster``. A ``dsstage`` command is also parsed by the real build_parser(), each
``[optional part]`` left out and put in. What no other test runs is run at the end here.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from dsstage.hooks import bbrequest
from dsstage.node import jobrecord, report
from guides import TOP, Runs, check_coverage, check_parses, check_runs, fenced, inline_commands, prose

GUIDE = TOP / "docs" / "admin-guide.md"
COMMANDS = ("dsstage", "scontrol", "sbatch", "squeue", "sinfo", "make", "systemctl", "journalctl", "python3",
            "install", "mkdir", "apt-get")
SLURM_CONF_KEYS = ("Prolog", "TaskProlog", "Epilog", "PrologFlags", "PrologEpilogTimeout", "PlugStackConfig",
                   "JobSubmitPlugins", "BurstBufferType", "SchedulerType", "SchedulerParameters")
SLURM_CONF = re.compile(r"[A-Z][A-Za-z]*=\S")
SHELL = re.compile(r"[a-z][\w./-]*( |$)")

DEVCLUSTER = "packaging/devcluster"
CLUSTER = "tests/cluster/test_cluster.py"
FLEET = "tests/cluster/test_fleet_ops.py"
HOLD = "tests/cluster/test_hold.py"
CALLBACKS = "tests/cluster/test_callbacks.py"
PRESTAGE = "tests/cluster/test_prestage.py"
RETENTION = "tests/cluster/test_queue_retention.py"
STAGE = "tests/functional/test_stage.py"
HERE = "tests/unit/test_admin_guide.py"
UNITS = "tests/unit/test_packaging_files.py"


def conf(line: str) -> list[Runs]:
    """A slurm.conf line: where packaging/devcluster writes it."""
    return [Runs(DEVCLUSTER, None, (f'echo "{line}',))]


#: guide command or slurm.conf line -> where it runs (at least one place)
LIFECYCLE = "tests/functional/test_manifest_lifecycle.py"
LIFE_TEST = "test_versions_are_listed_a_rollback_is_staged_and_a_moved_source_is_found"

COVERAGE: dict[str, list[Runs]] = {
    # slurm.conf
    "PrologFlags=Alloc": conf("PrologFlags=Alloc"),
    "Prolog=/etc/slurm/prolog.d/*": [
        Runs("tests/unit/test_slurm_conffile.py", "test_the_hooks_may_be_lists_globs_or_a_site_wrapper",
             ('main.write_text(f"Prolog=site-prolog,prolog.d/*',), note="a glob of Prologs, checked by check-config")],
    "Prolog=/usr/libexec/dsstage/dsstage-prolog": conf("Prolog=$hooks/dsstage-prolog"),
    "TaskProlog=/usr/libexec/dsstage/dsstage-taskprolog": conf("TaskProlog=$hooks/dsstage-taskprolog"),
    "Epilog=/usr/libexec/dsstage/dsstage-epilog": conf("Epilog=$hooks/dsstage-epilog"),
    "Prolog=": conf("Prolog="), "TaskProlog=": conf("TaskProlog="), "Epilog=": conf("Epilog="),
    "PrologEpilogTimeout=...": conf("PrologEpilogTimeout=900"),
    "PlugStackConfig=": conf("PlugStackConfig=$ETC/plugstack.conf"),
    "JobSubmitPlugins=lua": conf("JobSubmitPlugins=lua"),
    "BurstBufferType=burst_buffer/lua": conf("BurstBufferType=burst_buffer/lua"),
    "SchedulerType=sched/backfill": conf("SchedulerType=sched/backfill"),
    "SchedulerParameters=ignore_prefer_validation": conf("SchedulerParameters=ignore_prefer_validation,"),
    # installing
    "python3 -m venv /usr/lib/dsstage/venv && /usr/lib/dsstage/venv/bin/pip install .": [
        Runs("packaging/lib.sh", None, ('python3 -m venv "$DSSTAGE_VENV"', '-m pip install'),
             note="into .venv, editable; devcluster and run-tests call it (ensure_venv)")],
    "make -C sbatch_ext install": [
        Runs(HERE, "test_make_install_puts_the_plugin_in_the_multiarch_directory", ('"install"',)),
        Runs(DEVCLUSTER, None, ('make -s -C "$DSSTAGE_TOP/sbatch_ext" install install-hooks',))],
    "make -C sbatch_ext clean install": [
        Runs(HERE, "test_make_install_puts_the_plugin_in_the_multiarch_directory", ('"clean", "install"',))],
    "make -C sbatch_ext install-hooks": [
        Runs("tests/unit/test_hook_scripts.py", "installed", ('"-C", str(TOP / "sbatch_ext"), "install-hooks"',)),
        Runs(DEVCLUSTER, None, ('make -s -C "$DSSTAGE_TOP/sbatch_ext" install install-hooks',))],
    "install -d -o dsstage -g dsstage -m 0755 /shared/dsstage/nodes /shared/dsstage/jobs": [
        Runs(HERE, "test_the_report_directory_as_the_guide_makes_it_takes_reports_as_report_user",
             ('shown("install -d ")',))],
    "mkdir -m 0755 <state_dir>/bb; chown slurm <state_dir>/bb": [
        Runs(HERE, "test_the_bb_directory_as_the_guide_makes_it_takes_slurmusers_records",
             ('shown("mkdir -m 0755 <state_dir>/bb")',))],
    "dsstage check-config": [Runs("tests/unit/test_config.py", "test_check_config_command",
                                  ('cli.main(["--config", path, "check-config"])',))],
    "dsstage export-catalog": [Runs("tests/cluster/conftest.py", "Cluster", ('self.dsstage("export-catalog", "-o"',))],
    "dsstage export-catalog -o /var/lib/dsstage/dsstage_catalog.lua": [
        Runs(DEVCLUSTER, None, ('"$DSSTAGE" export-catalog -o "$ETC/dsstage_catalog.lua"',)),
        Runs("tests/cluster/conftest.py", "Cluster", ('self.dsstage("export-catalog", "-o"',))],
    # manifests and copies
    "dsstage manifest build": [Runs(DEVCLUSTER, None, ('"$DSSTAGE" manifest build sample',))],
    "dsstage manifest build NAME": [Runs(DEVCLUSTER, None, ('"$DSSTAGE" manifest build sample',))],
    "dsstage manifest build coco": [Runs(DEVCLUSTER, None, ('"$DSSTAGE" manifest build sample',))],
    "dsstage manifest build NAME --from /mounted/path": [
        Runs(STAGE, "test_ssh_source", ('env.cli("manifest", "build", "remote", "--from", str(src))',))],
    "dsstage stage": [Runs("tests/functional/test_fast_stage.py",
                           "test_a_ready_copy_is_leased_without_the_configuration",
                           ('cli_main.main(["stage", "coco,secret", "--job-id", "2", "--json"])',),
                           note="the fast path of a ready copy")],
    "dsstage verify": [Runs("tests/functional/test_fast_stage.py",
                            "test_a_quick_verify_of_a_ready_copy_answers_as_the_full_command",
                            ('cli_main.main(["verify", "coco", "--json"])',), note="the fast path of a ready copy")],
    "dsstage verify NAME [--full]": [
        Runs(STAGE, "test_flipped_byte_is_found_by_full_verify_and_repaired",
             ('env.cli_json("verify", "ds")', 'env.cli_json("verify", "ds", "--full")'))],
    "dsstage evict NAME": [Runs(RETENTION, "Lab", ('self.cluster.dsstage("--node", NODE, "evict", name, "--force")',),
                                note="with --force"),
                           Runs(STAGE, "test_evict_removes_only_copies_without_leases",
                                ('env.cli_json("evict", "ds")',))],
    "dsstage evict": [Runs("tests/functional/test_eviction.py", "test_evict_without_a_name_shows_the_plan",
                           ('env.cli("evict")',))],
    "dsstage evict --dry-run": [Runs(RETENTION, "Lab", ('"evict", "--dry-run", "--json"',)),
                                Runs("tests/functional/test_eviction.py", "test_evict_without_a_name_shows_the_plan",
                                     ('env.cli("evict", "--dry-run")',))],
    "dsstage reclaim": [Runs(CLUSTER, "test_reclaim_removes_leases_of_gone_jobs_only", ('"reclaim", "--json"',))],
    "dsstage simulate": [Runs("tests/unit/test_simulate.py", "test_dsstage_simulate_runs_the_simulator",
                              ('cli.main(["simulate"',))],
    # the services
    "dsstage demand-poller": [
        Runs("tests/unit/test_demand.py", "test_the_systemd_unit_runs_the_poller_verb",
             ('args.handler.__name__ == "cmd_demand_poller" and not args.once',)),
        Runs("tests/unit/test_demand.py", "test_poller_loop_sleeps_the_rest_of_its_interval",
             ("poller.run(c, Counting(), clock=", "sleep=sleep)"), note="the loop, with a fake Slurm")],
    "dsstage demand-poller --once": [Runs(PRESTAGE, "test_a_job_starts_where_its_data_is",
                                          ('cluster.dsstage("demand-poller", "--once")',))],
    "dsstage manifest list NAME": [Runs(LIFECYCLE, LIFE_TEST, ('env.cli("manifest", "list", "coco")',))],
    "dsstage manifest use NAME VERSION": [
        Runs(LIFECYCLE, LIFE_TEST, ('env.cli("manifest", "use", "coco", first[:10])',))],
    "dsstage manifest check NAME": [Runs(LIFECYCLE, LIFE_TEST, ('env.cli("manifest", "check", "coco")',))],
    "systemctl enable --now dsstage-manifest-check@NAME.timer": [
        Runs("tests/unit/test_packaging_files.py", "test_a_timer_has_its_service_and_a_schedule",
             ('sections["Install"]["WantedBy"] == "timers.target"',), note="the unit files; systemd is not run here")],
    "dsstage state-dir init": [
        Runs("tests/functional/test_state_dir.py",
             "test_state_dir_init_gives_each_directory_its_writer_and_check_config_tries_them",
             ('env.cli("state-dir", "init", "--json")',))],
    'dsstage disable --reason "NVMe firmware update until 14:00"': [
        Runs("tests/functional/test_rollout.py", "test_the_cluster_wide_switch_sends_jobs_to_their_sources_and_back",
             ('env.cli("disable", "--reason", "NVMe firmware update until 14:00")',))],
    "dsstage disable --reason TEXT": [
        Runs("tests/functional/test_rollout.py", "test_the_cluster_wide_switch_sends_jobs_to_their_sources_and_back",
             ('env.cli("disable", "--reason", "NVMe firmware update until 14:00")',))],
    "dsstage enable": [
        Runs("tests/functional/test_rollout.py", "test_the_cluster_wide_switch_sends_jobs_to_their_sources_and_back",
             ('env.cli("enable")',))],
    "dsstage prolog --dry-run --job ID": [
        Runs("tests/cluster/test_dry_run.py", "test_a_prolog_dry_run_says_what_the_hook_would_do_and_changes_nothing",
             ('"prolog", "--dry-run", "--job", job',))],
    "dsstage epilog --dry-run --job ID": [
        Runs("tests/cluster/test_dry_run.py", "test_an_epilog_dry_run_names_the_leases_it_would_release_and_keeps_them",
             ('"epilog", "--dry-run", "--job", job',))],
    "dsstage prefetch": [
        Runs(UNITS, "test_a_service_runs_a_dsstage_command_that_exists", ("build_parser().parse_args(argv[1:])",),
             note="the unit's command, parsed"),
        Runs(PRESTAGE, "test_a_pending_jobs_dataset_is_prefetched_on_its_planned_node",
             ('"prefetch", "--once"',), note="one round of it")],
    "dsstage peers serve": [
        Runs("tests/functional/test_peers.py", "Peers", ('"-m", "dsstage", "peers", "serve"',),
             note="every node's daemon in the fan-out tests")],
    "dsstage prefetch --once": [Runs(PRESTAGE, "test_a_pending_jobs_dataset_is_prefetched_on_its_planned_node",
                                     ('cluster.dsstage("--node", "n2", "prefetch", "--once")',))],
    "dsstage prefetch --dry-run [--json]": [
        Runs(PRESTAGE, "test_a_pending_jobs_dataset_is_prefetched_on_its_planned_node",
             ('"prefetch", "--dry-run", "--json"',))],
    "dsstage report": [Runs(PRESTAGE, "test_a_job_starts_where_its_data_is",
                            ('cluster.dsstage("--node", node, "report")',))],
    "dsstage status": [Runs(CLUSTER, "test_status_shows_copies_and_queue", ('cluster.dsstage("status")',)),
                       Runs("packaging/demo", None, ("\ndsstage status\n",))],
    # fleet
    "dsstage warm": [Runs("tests/functional/test_prefetch.py",
                          "test_stage_and_warm_of_a_sharded_dataset_stage_this_nodes_part",
                          ('env.cli_json("warm", "big")',))],
    "dsstage warm NAME --nodes HOSTLIST": [Runs(FLEET, "test_warm_on_three_nodes_and_one_unreachable",
                                                ('"warm", DATASET, "--nodes", "n[1-3]"',))],
    "dsstage evict NAME --nodes ...": [Runs(FLEET, "test_evict_refuses_wanted_and_leased_copies",
                                            ('"evict", DATASET, "--nodes", "n[1-3]"',))],
    "dsstage verify NAME --nodes ... [--full]": [Runs(FLEET, "test_verify_full_on_the_nodes",
                                                      ('"verify", DATASET, "--nodes", "n[1-3]", "--full"',))],
    "dsstage status --live": [Runs(FLEET, "test_status_live_asks_the_nodes", ('"status", "--live"',))],
    # Slurm
    "scontrol show job": [Runs(HOLD, "user_view", ('"scontrol", "show", "job", job_id',))],
    "scontrol release JOBID": [Runs(HOLD, "test_hold_requeues_and_holds_a_running_batch_job",
                                    ('"scontrol", "release", job',))],
    "scontrol update": [
        Runs(HOLD, "test_prolog_holds_a_batch_job_and_keeps_its_comment",
             ('admin.startswith(f"dsstage={gone_source} dsstage held this job: ")',),
             note="the Prolog runs it (CliSlurm.hold: the AdminComment)"),
        Runs("tests/unit/test_slurm.py", "test_cli_hold_requeues_and_holds_a_batch_job",
             ('"/opt/slurm/bin/scontrol", "update", "JobId=42"',))],
    "scontrol requeuehold": [
        Runs(HOLD, "test_prolog_holds_a_batch_job_and_keeps_its_comment",
             ('info["Reason"] == "job_requeued_in_held_state"',), note="the Prolog runs it (CliSlurm.hold)"),
        Runs("tests/unit/test_slurm.py", "test_cli_hold_requeues_and_holds_a_batch_job",
             ('"/opt/slurm/bin/scontrol", "requeuehold", "Incomplete", "42"',))],
    "scontrol notify": [
        Runs(HOLD, "test_prolog_cancels_an_interactive_allocation_with_the_reason_on_its_terminal",
             ('dsstage cancelled this job: " in terminal',), note="the Prolog runs it (CliSlurm.hold)"),
        Runs("tests/unit/test_slurm.py", "test_cli_hold_cancels_an_allocation_after_telling_its_terminal",
             ('scontrol", "notify", "27", message',))],
    "sinfo -R": [Runs("tests/cluster/test_cluster.py",
                      "test_a_tier_whose_disk_is_not_mounted_drains_the_node_and_nothing_is_written",
                      ('cluster.run("sinfo", "-h", "-R", "-n", "n3", "-o", "%E")',))],
    "scontrol update NodeName=... State=RESUME": [
        Runs("tests/cluster/test_cluster.py",
             "test_a_tier_whose_disk_is_not_mounted_drains_the_node_and_nothing_is_written",
             ('cluster.run("scontrol", "update", "NodeName=n3", "State=RESUME", check=False)',))],
    "scontrol update NodeName=<hostlist> AvailableFeatures=... ActiveFeatures=...": [
        Runs(PRESTAGE, "test_a_job_starts_where_its_data_is",
             ('cluster.dsstage("demand-poller", "--once")', 'assert "ds_plc" in feats["n3"]'),
             note="the poller runs it (CliSlurm.set_features)"),
        Runs("lib/dsstage/slurm/client.py", "CliSlurm", ('"scontrol", "update", f"NodeName={nodes}"',))],
    "scontrol reconfigure": [Runs(PRESTAGE, "test_a_job_starts_where_its_data_is",
                                  ('cluster.run("scontrol", "reconfigure")',))],
    "sbatch --dataset=...": [
        Runs("tests/cluster/test_series.py",
             "test_a_plugin_built_for_another_series_costs_only_dataset_and_check_config_says_rebuild",
             ('"sbatch", "--dataset=sample", "--wrap", "true"', "unrecognized option '--dataset=sample'"),
             note="with a plugin built for another series, loaded optional")],
    "sbatch --bb \"#BB_LUA dataset=NAME\"": [
        Runs("tests/unit/test_lua_submit.py", "test_job_submit_records_burst_buffer_directives",
             ('burst_buffer = "#BB_LUA dataset=coco"',),
             note="the job_desc.burst_buffer sbatch --bb fills, through job_submit.lua; not through sbatch")],
    "scontrol show bbstat [JOBID | job ID | dataset NAME | node HOSTLIST]": [
        Runs(PRESTAGE, "test_a_burst_buffer_directive_is_validated_and_staged",
             ('cluster.bbstat("dataset", "bbd", user="root")',), note="the dataset form only")],
    "scontrol show bbstat": [
        Runs(CALLBACKS, "test_a_users_bbstat_loops_never_delay_anothers_submissions",
             ('"scontrol show bbstat node \'n[1-3]\' >/dev/null 2>&1; scontrol show bbstat',)),
        Runs(CALLBACKS, "test_where_slurm_hides_jobs_dsstage_hides_them_too", ('cluster.bbstat(user="nobody")',))],
    "dsstage bb status": [
        Runs("tests/unit/test_lua_submit.py", "test_bbstat_reads_its_answer_and_starts_one_refresh_in_the_background",
             ("\"'bb' 'status' 'dataset=coco'\" in rows[0][2]",)),
        Runs("tests/functional/test_status.py",
             "test_bbstat_answers_are_computed_into_the_status_dir_a_slot_at_a_time",
             ('bbstat.refresh(conf, "dataset=in22k", lambda: NOW)',), note="what the command runs")],
    "dsstage bb record JOBID NAMES": [
        Runs(PRESTAGE, "test_a_burst_buffer_directive_is_validated_and_staged",
             ('#BB_LUA dataset=bbd\\necho', 'any("#BB_LUA request bbd" in line for line in log)')),
        Runs("sbatch_ext/burst_buffer.lua", None, ('command({ "bb", "record", tostring(job_id), value })',))],
    "dsstage bb nudge JOBID": [
        Runs("tests/unit/test_bbrequest.py", "test_the_bb_nudge_verb_replaces_the_file_the_poller_watches",
             ('cli.main(["--config", str(config), "bb", "nudge", "77"])',)),
        Runs("tests/unit/test_bbrequest.py", "test_data_in_nudges_the_acting_poller_instead_of_running_a_round",
             ("poller.wait(state, 30, sleep) is True",), note="the poller's wait ends on it"),
        Runs("sbatch_ext/burst_buffer.lua", None, ('command({ "bb", "nudge", tostring(job_id) })',))],
    "dsstage bb forget JOBID": [
        Runs(PRESTAGE, "test_a_burst_buffer_directive_is_validated_and_staged",
             ('assert not record.exists(), "teardown left the job\'s #BB_LUA record"',)),
        Runs("sbatch_ext/burst_buffer.lua", None, ('command({ "bb", "forget", tostring(job_id) })',))],
    "journalctl -t dsstage": [
        Runs("tests/unit/test_hook_scripts.py", "test_prolog_and_epilog_log_to_syslog_with_the_job_id",
             ('re.compile(r"^<(2[4-9]|30|31)>dsstage\\[\\d+\\]: job 7: ")',),
             note="what it selects: the tag dsstage on the syslog socket; no journald here")],
}

#: a verb the guide names without its arguments, and a command line of it
VERB_ONLY = {"dsstage manifest build": "dsstage manifest build NAME", "dsstage bb status": "dsstage bb status all",
             "dsstage warm": "dsstage warm NAME", "dsstage stage": "dsstage stage NAME",
             "dsstage verify": "dsstage verify NAME"}


def guide() -> str:
    return GUIDE.read_text()


def indented_blocks(text: str) -> list[str]:
    """The bodies of indented code blocks (four spaces more than the text around them:
    lines indented by four or more after a blank line), outside fenced blocks."""
    blocks: list[list[str]] = []
    in_block, blank = False, True
    for line in prose(text).splitlines():
        if re.match(r" {4,}\S", line) and (in_block or blank):
            if not in_block:
                blocks.append([])
            blocks[-1].append(line.strip())
            in_block = True
        else:
            in_block = False
        blank = not line.strip()
    return ["\n".join(b) for b in blocks]


def block_lines(lang: str, body: str) -> list[str]:
    """The commands and slurm.conf lines of one code block, without trailing comments."""
    out = []
    for line in body.splitlines():
        line = line.strip()
        if lang == "console":
            if not line.startswith(("$ ", "# ")):
                continue
            line = line[2:]
        elif not line or line.startswith("#"):
            continue
        line = re.sub(r"\s+# .*$", "", line)
        if SLURM_CONF.match(line) or SHELL.match(line):
            out.append(line)
    return out


def guide_commands(text: str) -> list[str]:
    out: list[str] = []
    for lang, body in fenced(text):
        if lang in ("bash", "sh", "console"):
            out += block_lines(lang, body)
    for body in indented_blocks(text):
        out += block_lines("", body)
    out += inline_commands(text, COMMANDS)
    out += [span for span in re.findall(r"`([^`\n]+)`", prose(text))
            if re.fullmatch(r"[A-Z][A-Za-z]*=\S*", span) and span.split("=", 1)[0] in SLURM_CONF_KEYS]
    return out




def test_the_guide_has_commands_and_slurm_conf_lines():
    cmds = guide_commands(guide())
    assert len(cmds) >= 40, cmds
    assert {"PrologFlags=Alloc", "Epilog=/usr/libexec/dsstage/dsstage-epilog", "make -C sbatch_ext install",
            "mkdir -m 0755 <state_dir>/bb; chown slurm <state_dir>/bb", "dsstage export-catalog -o "
            "/var/lib/dsstage/dsstage_catalog.lua", "JobSubmitPlugins=lua"} <= set(cmds)
    assert not [c for c in cmds if c.startswith(("dsstage:", "<root>"))], "messages and layouts are no commands"


def test_every_command_in_the_guide_has_a_place_that_runs_it():
    check_coverage("docs/admin-guide.md", guide_commands(guide()), COVERAGE)


@pytest.mark.parametrize("command", sorted(COVERAGE))
def test_the_named_place_runs_the_command(command):
    check_runs(command, COVERAGE[command])


def expansions(command: str) -> list[str]:
    """``a [--x]`` as ``a`` and ``a --x``: each optional part left out and put in."""
    m = re.search(r" \[([^][|]+)\]", command)
    if not m:
        return [command]
    return [*expansions(command[:m.start()] + command[m.end():]),
            *expansions(command[:m.start()] + " " + m.group(1) + command[m.end():])]


@pytest.mark.parametrize("command", sorted(c for c in COVERAGE if c.startswith("dsstage")))
def test_dsstage_commands_parse(command):
    for line in expansions(VERB_ONLY.get(command, command)):
        check_parses(line)


def test_the_status_synopsis_parses():
    [synopsis] = [body for lang, body in fenced(guide()) if body.startswith("dsstage status ")]
    check_parses(" ".join(synopsis.replace("[", "").replace("]", "").split()))


def test_every_unit_is_in_services():
    section = guide().split("### Services\n", 1)[1].split("\n### ", 1)[0]
    for unit in sorted((TOP / "packaging" / "systemd").iterdir()):
        assert f"`{unit.name}`" in section, f"docs/admin-guide.md, Services, does not name {unit.name}"
    assert "python -I -m dsstage.node.background purge" in section  # the trash needs no unit
    assert '"dsstage.node.background", *args' in (TOP / "lib" / "dsstage" / "node" / "background.py").read_text()


# -- what the guide shows that no other test runs ------------------------------------------------

def shown(prefix: str) -> str:
    [line] = [c for c in guide_commands(guide()) if c.startswith(prefix)]
    return line


def test_make_install_puts_the_plugin_in_the_multiarch_directory(tmp_path):
    """``make -C sbatch_ext clean install``, on a copy of sbatch_ext, into DESTDIR."""
    if not (shutil.which("make") and shutil.which("gcc") and Path("/usr/include/slurm/spank.h").exists()):
        pytest.skip("needs make, gcc and libslurm-dev")
    src = tmp_path / "sbatch_ext"
    shutil.copytree(TOP / "sbatch_ext", src, ignore=shutil.ignore_patterns("*.so", "plugstack.conf"))
    subprocess.run(["make", "-s", "-C", str(src), "clean", "install", f"DESTDIR={tmp_path}/root"], check=True,
                   capture_output=True)
    multiarch = subprocess.run(["dpkg-architecture", "-qDEB_HOST_MULTIARCH"], capture_output=True, text=True)
    arch = multiarch.stdout.strip() or subprocess.run(["gcc", "-print-multiarch"], capture_output=True,
                                                      text=True).stdout.strip()
    plugin = f"/usr/lib/{arch}/slurm-wlm/dsstage_spank.so"
    assert (tmp_path / "root" / plugin.lstrip("/")).is_file()
    lines = [x for x in (src / "plugstack.conf").read_text().splitlines() if x and not x.startswith("#")]
    assert lines == [f"optional {plugin}"]
    # the release it was built for, where check-config reads it (dsstage.slurm.spank)
    from dsstage.slurm import spank
    header = Path("/usr/include/slurm/slurm_version.h").read_text()
    number = int(header.split("#define SLURM_VERSION_NUMBER", 1)[1].split()[0], 16)
    built = spank.built_for((tmp_path / "root" / plugin.lstrip("/")).read_bytes())
    assert built == ((number >> 16) & 0xFF, (number >> 8) & 0xFF, number & 0xFF)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A state directory nobody can reach: tmp_path's parents are root's 0700."""
    top = Path(tempfile.mkdtemp(prefix="dsstage-guide-", dir="/tmp"))
    os.chmod(top, 0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="makes files of other owners")


@root_only
def test_the_report_directory_as_the_guide_makes_it_takes_reports_as_report_user(shared):
    line = shown("install -d ")
    nobody = pwd.getpwnam("nobody")
    argv = shlex.split(line.replace("/shared/dsstage", str(shared)))
    argv[argv.index("-o") + 1], argv[argv.index("-g") + 1] = "nobody", grp.getgrgid(nobody.pw_gid).gr_name
    subprocess.run(argv, check=True)
    assert report.publish(str(shared), "n1", {"node": "n1"}, "nobody")
    assert os.stat(report.published_path(str(shared), "n1")).st_uid == nobody.pw_uid
    # a multi-node job's record, written and trusted as report.user
    assert jobrecord.pin(str(shared), "7", "n[1-2]", "n1", {"d": "a" * 64}, "nobody") == {"d": "a" * 64}
    assert jobrecord.pin(str(shared), "7", "n[1-2]", "n2", {"d": "b" * 64}, "nobody") == {"d": "a" * 64}
    assert os.stat(shared / "jobs" / "7.json").st_uid == nobody.pw_uid


@root_only
def test_the_bb_directory_as_the_guide_makes_it_takes_slurmusers_records(shared):
    line = shown("mkdir -m 0755 <state_dir>/bb")
    slurm = pwd.getpwnam("slurm")  # SlurmUser on Debian
    subprocess.run(["sh", "-c", line.replace("<state_dir>", str(shared))], check=True)
    path = bbrequest.write(str(shared), "5", ["a"])
    os.chown(path, slurm.pw_uid, slurm.pw_gid)  # as SlurmUser's `dsstage bb record` leaves it
    assert bbrequest.read(str(shared), "5", slurm.pw_uid) == "a"
