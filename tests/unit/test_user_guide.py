"""Every command in docs/user-guide.md is run by a named test or by packaging/demo, and the
messages it quotes are the ones the code prints.

The guide's commands are the ``$ `` lines of its ``console`` blocks, the ``#SBATCH`` and
``#BB_LUA`` lines of its ``bash`` (job script) blocks, and inline code in its prose that
starts with a command name. Each must have an entry in COVERAGE naming where it runs: a
test function (whose source must contain the given pieces of the command) or a script.
What is checked here is that the named place exists and runs that command; the cluster
tests themselves run with ``-m cluster``. A ``dsstage`` command is also parsed by the real
build_parser(), which is weaker than running it but catches a renamed option at once.
"""

from __future__ import annotations

import re

import pytest
from dsstage.config import model
from dsstage.fs import layout, runfiles
from guides import TOP, Runs, check_coverage, check_parses, check_runs, fenced, inline_commands, prose

GUIDE = TOP / "docs" / "user-guide.md"
COMMANDS = ("sbatch", "srun", "salloc", "squeue", "scontrol", "dsstage")

CLUSTER = "tests/cluster/test_cluster.py"
HOLD = "tests/cluster/test_hold.py"
PRESTAGE = "tests/cluster/test_prestage.py"
DEMO = "packaging/demo"

#: guide command -> where it runs (at least one place)
COVERAGE: dict[str, list[Runs]] = {
    # job scripts
    "#SBATCH --dataset=imagenet22t": [Runs(CLUSTER, "HASH_JOB", ("#SBATCH --dataset=sample",))],
    "#BB_LUA dataset=imagenet22t": [Runs(PRESTAGE, "test_a_burst_buffer_directive_is_validated_and_staged",
                                         ("#BB_LUA dataset=bbd\\n",))],
    # submitting
    "sbatch train.sbatch": [Runs(CLUSTER, "test_job_reads_the_verified_local_copy", ("cluster.submit(hash_job()",)),
                            Runs(DEMO, None, ('id=$(sbatch --parsable -o "$jobs/demo-%j.out" "$@" "$f")',))],
    "sbatch --dataset=imagenet22t train.sbatch": [
        Runs(CLUSTER, "test_forbidden_dataset_is_rejected", ('"--dataset=private", user="daemon"',))],
    "srun --dataset=imagenet22t python eval.py": [
        Runs(HOLD, "test_prolog_cancels_an_interactive_allocation_with_the_reason_on_its_terminal",
             ('["srun", "--comment=mine", "-w", "n3", "echo", "RAN"]', 'f"--dataset={gone_source}"')),
        Runs("tests/cluster/test_job_kinds.py", "test_an_interactive_job_reads_the_dataset",
             ('cluster.run(argv[0], "--dataset=sample"',))],
    "sbatch --array=0-99 --dataset=imagenet22t": [
        Runs("tests/cluster/test_job_kinds.py", "test_each_task_of_an_array_reads_the_dataset_on_its_node",
             ('"--dataset=sample", "--array=0-2"',))],
    "sbatch --dataset=sampel train.sbatch": [
        Runs(CLUSTER, "test_unknown_dataset_is_rejected_by_sbatch", ('"--dataset=sampel"',)),
        Runs(DEMO, None, ('sbatch --dataset=sampel "$jobs/typo.sbatch"',))],
    # asking why
    "dsstage ls": [Runs("tests/functional/test_stage.py", "test_cli_errors_are_one_line", ('env.cli("ls"',),
                        note="only with a configuration it refuses (exit 78)")],
    "dsstage status": [Runs(CLUSTER, "test_status_shows_copies_and_queue", ('cluster.dsstage("status")',)),
                       Runs(DEMO, None, ("\ndsstage status\n",))],
    "dsstage status --job 4": [Runs(DEMO, None, ('dsstage status --job "$next"',))],
    "dsstage status --job ID": [Runs(DEMO, None, ('dsstage status --job "$next"',))],
    "dsstage status --dataset imagenet22t": [
        Runs(PRESTAGE, "test_a_job_starts_where_its_data_is", ('"status", "--json", "--dataset", "plc"',),
             note="with --json"),
        Runs("tests/cluster/test_fleet_ops.py", "test_warm_on_three_nodes_and_one_unreachable",
             ('"status", "--json", "--dataset", DATASET, "--no-queue"',), note="with --json --no-queue")],
    "dsstage status --dataset NAME": [
        Runs(PRESTAGE, "test_a_job_starts_where_its_data_is", ('"status", "--json", "--dataset", "plc"',),
             note="with --json")],
    "scontrol show bbstat dataset imagenet22t": [
        Runs(PRESTAGE, "test_a_burst_buffer_directive_is_validated_and_staged",
             ('cluster.bbstat("dataset", "bbd", user="root")',))],
    "scontrol show bbstat dataset NAME": [
        Runs(PRESTAGE, "test_a_burst_buffer_directive_is_validated_and_staged",
             ('cluster.bbstat("dataset", "bbd", user="root")',))],
    # a held job
    "squeue -h -j 1234 -o %r": [Runs(HOLD, "test_hold_requeues_and_holds_a_running_batch_job",
                                     ('"squeue", "-h", "-j", job, "-o", "%r", user=USER',))],
    "scontrol show job 1234": [Runs(HOLD, "user_view", ('"scontrol", "show", "job", job_id, user=USER',)),
                               Runs(HOLD, "test_prolog_holds_a_batch_job_and_keeps_its_comment",
                                    ("user_view(cluster, job)",))],
    "scontrol show job": [Runs(HOLD, "user_view", ('"scontrol", "show", "job", job_id, user=USER',))],
    "scontrol show job ID": [Runs(HOLD, "user_view", ('"scontrol", "show", "job", job_id, user=USER',))],
    "scontrol release 1234": [Runs(HOLD, "test_hold_requeues_and_holds_a_running_batch_job",
                                   ('"scontrol", "release", job, user=USER',)),
                              Runs(CLUSTER, "test_unreadable_source_with_hold_requeues_and_holds",
                                   ('"scontrol", "release", job',))],
}

#: (text in the guide, file, text in that file): what the guide quotes is what the code says
QUOTES = [
    ("sbatch: error: dsstage: unknown dataset 'sampel' (did you mean 'sample'?)", CLUSTER,
     "sbatch: error: dsstage: unknown dataset 'sampel' (did you mean 'sample'?)"),
    ("; `dsstage ls` lists the catalog", "sbatch_ext/dsstage_submit.lua", "; `dsstage ls` lists the catalog"),
    ("dsstage: dataset 'private' is restricted to group(s) daemon; you are in none of them", CLUSTER,
     "dsstage: dataset 'private' is restricted to group(s) daemon; you are in none of them"),
    ("; you are in none of them: ask the dataset's owners for access", "sbatch_ext/dsstage_submit.lua",
     "; you are in none of them: ask the dataset's owners for access"),
    ("group changes take effect when `dsstage export-catalog` regenerates the catalog (a timer runs it; "
     "this catalog is from ", "sbatch_ext/dsstage_submit.lua",
     "group changes take effect when `dsstage export-catalog` regenerates the catalog ("),
    ("dsstage: #BB_LUA capacity=1TB: unknown option; write #BB_LUA dataset=NAME[,NAME...]",
     "sbatch_ext/dsstage_submit.lua", ": unknown option; write #BB_LUA dataset=NAME[,NAME...]"),
    ("--dataset=sample,: empty dataset name", "sbatch_ext/dsstage_spank.c", "--dataset=%s: empty dataset name"),
    ("dataset names use lower-case\nletters, digits, ...", "sbatch_ext/dsstage_spank.c",
     "dataset names use lower-case letters, digits, "),
    ("dsstage: warning: could not stage 'flaky' (", "lib/dsstage/hooks/decisions.py", "print dsstage: warning: "),
    ("could not stage 'flaky' (...); reading /data/flaky directly, which is slower", "lib/dsstage/hooks/decisions.py",
     'f"could not stage {name!r} ({error}); reading {ds.source.path} directly, which is slower"'),
    ("`dsstage: error: <why>`", "lib/dsstage/hooks/decisions.py", 'f"print dsstage: error: {_one_line(o.reason)}"'),
    ("dsstage held this job: <why> -- once that is fixed: scontrol release 1234", "lib/dsstage/slurm/hold.py",
     'f"dsstage held this job: {reason} -- once that is fixed: scontrol release {job.job_id}"'),
    ("AdminComment=dsstage=imagenet22t dsstage held this job: ", HOLD,
     'admin.startswith(f"dsstage={gone_source} dsstage held this job: ")'),
    ("`salloc: dsstage cancelled this job: <why> (an interactive allocation cannot be requeued)`",
     "lib/dsstage/slurm/hold.py",
     'f"dsstage cancelled this job: {reason} (an interactive allocation cannot be requeued)"'),
    ("job requeued in held state\n", HOLD, 'assert reason == "job requeued in held state"'),
    ("`DSSTAGE_BB_DATASETS`", "sbatch_ext/burst_buffer.lua", "DSSTAGE_BB_DATASETS"),
    ("Slurm expects it to start in 1 min\non n2.", "lib/dsstage/cluster/status.py",
     'f"Slurm expects it to start {when} on {job[\'nodes\']}."'),
    ("Its Prolog stages what is\nmissing on each node before the job starts; if that fails the job falls back to\n"
     "the source or is held, as the dataset's on_failure says.", "lib/dsstage/cluster/status.py",
     '"Its Prolog stages what is missing on each node before the job starts; if that fails the job "'),
]


def guide() -> str:
    return GUIDE.read_text()


def guide_commands(text: str) -> list[str]:
    out: list[str] = []
    for lang, body in fenced(text):
        for line in body.splitlines():
            if lang == "console" and line.startswith("$ "):
                out.append(line[2:].strip())
            elif lang == "bash" and line.startswith(("#SBATCH --dataset", "#BB_LUA")):
                out.append(line.strip())
    out += inline_commands(text, COMMANDS)
    out += [span for span in re.findall(r"`([^`\n]+)`", prose(text)) if span == "dsstage"]
    return out


def test_the_guide_has_commands_and_blocks():
    cmds = guide_commands(guide())
    assert len(cmds) >= 15, cmds
    assert {"dsstage status --job 4", "sbatch --dataset=sampel train.sbatch", "scontrol release 1234",
            "#BB_LUA dataset=imagenet22t", "dsstage status --job ID"} <= set(cmds)


def test_every_command_in_the_guide_has_a_place_that_runs_it():
    check_coverage("docs/user-guide.md", guide_commands(guide()), COVERAGE)


@pytest.mark.parametrize("command", sorted(COVERAGE))
def test_the_named_place_runs_the_command(command):
    check_runs(command, COVERAGE[command])


@pytest.mark.parametrize("command", sorted(c for c in COVERAGE if c.startswith("dsstage")))
def test_dsstage_commands_parse(command):
    check_parses(command)


def test_the_guide_quotes_what_the_code_says():
    text = guide()
    for in_guide, path, in_code in QUOTES:
        assert in_guide in text, f"docs/user-guide.md no longer has {in_guide!r}: update QUOTES"
        assert in_code in (TOP / path).read_text(), f"{path} no longer says {in_code!r}: update docs/user-guide.md"


def test_the_guide_states_the_codes_numbers():
    text = " ".join(guide().split())
    assert layout.env_var("coco-2017") == "DSSTAGE_PATH_COCO_2017" and "`DSSTAGE_PATH_COCO_2017`" in text
    assert layout.NAME_MAX == 64 and "at most 64 characters" in text
    assert model.DEFAULT_PROLOG_BUDGET == 300 and "`prolog_budget`, 300 seconds" in text
    assert runfiles.export_lines([("a", "/x"), ("b", "/y")])[-1] == "export DSSTAGE_DATASET_DIR=/x"
    assert "`DSSTAGE_DATASET_DIR` | the same as `DSSTAGE_PATH_<NAME>` of the first dataset" in text
