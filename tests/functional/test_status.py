"""`dsstage status` against nodes in a known state: real stores staged and leased on three
nodes, their reports, a demand snapshot; then the plain 80-column text (golden), the JSON
fields, stale reports, filters and a job's explanation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from dsstage.cluster import status, status_view
from dsstage.config.catalog import User
from dsstage.node import inventory, staging
from dsstage.policy import demand
from dsstage.slurm.fake import FakeSlurm
from dsstage.slurm.records import Job, Node
from helpers import Env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "status-golden.txt"
NOW = 1_800_000_000.0


def _files(prefix: str, n: int, size: int) -> dict[str, bytes]:
    return {f"{prefix}/{i:03d}.bin": bytes([i % 251]) * size for i in range(n)}


@pytest.fixture
def cluster(env: Env) -> Env:
    """n1: coco (leased by job 101) and in22k; n2: coco; n3: coco, its report 1 h old;
    job 200 pending for coco on n[2-3] in 20 min, job 101 running on n1."""
    env.add("coco", _files("train", 20, 50_000))
    env.add("in22k", _files("img", 10, 200_000))
    env.extra["tiers"] = {"nvme": {"path": str(env.nvme) + "/{node}", "capacity": "10MB", "root_filesystem": True}}
    env.write()
    env.cli("manifest", "build", "coco")
    env.cli("manifest", "build", "in22k")
    me = User.lookup(os.getuid())
    for node, names in (("n1", ["coco", "in22k"]), ("n2", ["coco"]), ("n3", ["coco"])):
        store = env.store(node=node, clock=lambda: NOW)
        for name in names:
            staging.stage(store, name,
                          staging.StageRequest(user=me, job_id="101" if node == "n1" and name == "coco" else "1"))
            if not (node == "n1" and name == "coco"):
                store.release(name, "1")
        inventory.refresh(store)
    for node, age in (("n1", 5), ("n2", 8), ("n3", 3600)):
        path = env.state / "nodes" / f"{node}.json"
        rep = json.loads(path.read_text())
        rep["time"] = NOW - age
        path.write_text(json.dumps(rep))
    jobs = [Job("200", "ana", "PENDING", ("coco",), partition="gpu", priority=10, start_time=NOW + 1200,
                sched_nodes="n[2-3]"),
            Job("101", "bo", "RUNNING", ("coco",), partition="gpu", nodes="n1")]
    demand.write(str(env.state), demand.build(jobs, NOW - 10))
    return env


def collect(env: Env, down: dict[str, str] | None = None) -> status.Status:
    slurm = FakeSlurm(node_table={n: Node(n, "127.0.0.1", s) for n, s in (down or {}).items()})
    return status.collect(env.config(), slurm, clock=lambda: NOW)


def test_plain_text_is_the_golden_80_column_view(cluster: Env):
    st = collect(cluster)
    text = status_view.render_plain(st, status_view.sections(st, show_queue=True, plain=True))
    text = text.replace(str(cluster.tmp), "<tmp>")
    assert all(len(line) <= 80 for line in text.splitlines())
    if os.environ.get("DSSTAGE_REGOLD"):  # to update it on purpose: DSSTAGE_REGOLD=1, then review the diff
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_json_fields_and_a_stale_node(cluster: Env):
    data = status.to_json(collect(cluster))
    assert data["format"] == 1 and data["time"] == NOW
    nodes = {n["node"]: n for n in data["nodes"]}
    assert nodes["n1"]["stale"] is None and nodes["n1"]["age"] == 5
    assert nodes["n3"]["stale"] == "report 1 h old"  # older than report.max_age (15 min)
    tier = nodes["n1"]["tiers"][0]
    assert tier["tier"] == "nvme" and tier["capacity"] == 10_000_000 and tier["used"] == 3_000_000
    assert {"free", "reserved", "high", "low", "path"} <= set(tier)
    n1_coco = next(c for c in data["copies"] if c["node"] == "n1" and c["dataset"] == "coco")
    assert n1_coco["state"] == "ready" and n1_coco["current"] is True and n1_coco["bytes"] == 1_000_000
    assert [(x["job_id"], x["user"]) for x in n1_coco["leases"]] == [("101", User.lookup(os.getuid()).name)]
    assert n1_coco["decision"] == {"action": "keep", "reason": "leased by job 101"}
    assert all(c["stale"] == (c["node"] == "n3") for c in data["copies"])
    groups = {(g["dataset"], g["state"]): g for g in data["datasets"]}
    assert groups[("coco", "ready")]["nodes"] == "n[1-2]" and groups[("coco", "ready")]["count"] == 2
    assert groups[("coco", "stale")]["nodes"] == "n3"  # not counted as there: its report is stale
    q = data["queue"]
    assert q["source"] == "snapshot" and q["age"] == 10 and q["error"] is None
    assert [(j["job_id"], j["state"], j["nodes"], j["datasets"]) for j in q["jobs"]] == [
        ("200", "pending", "n[2-3]", ["coco"]), ("101", "running", "n1", ["coco"])]


def test_each_node_says_which_dsstage_wrote_its_report_and_a_mixed_cluster_is_named(cluster: Env):
    import dsstage
    data = status.to_json(collect(cluster))
    assert {n["node"]: n["dsstage"] for n in data["nodes"]} == dict.fromkeys(("n1", "n2", "n3"), dsstage.__version__)
    st = collect(cluster)
    assert "dsstage " not in status_view.headline(st)  # one version: nothing to say
    # an upgrade halfway: n2's report is of a version before reports said (the key absent),
    # n1's of a newer one; n3's is stale, so it is not counted
    for node, version in (("n1", "9.0.0"), ("n2", None), ("n3", "0.0.1")):
        path = cluster.state / "nodes" / f"{node}.json"
        rep = json.loads(path.read_text())
        rep.pop("dsstage")
        if version:
            rep["dsstage"] = version
        path.write_text(json.dumps(rep))
    st = collect(cluster)
    assert status.versions(st) == {"9.0.0": ["n1"], "before 0.2.0": ["n2"]}
    assert status_view.headline(st).startswith(
        "3 nodes reporting, 1 stale; dsstage 9.0.0 on n1, before 0.2.0 on n2; queue from")


def test_a_node_slurm_says_is_down_is_stale_whatever_its_reports_age(cluster: Env):
    st = collect(cluster, down={"n2": "down*", "n1": "mixed"})
    stale = {r["node"]: r["stale"] for r in st.nodes}
    assert stale == {"n1": None, "n2": "node down, not responding", "n3": "report 1 h old"}


def test_filters_by_dataset_node_user_and_job(cluster: Env):
    st = collect(cluster)
    only = status.select(st, status.Filter.parse(dataset="in22k"))
    assert {(r["node"], c["dataset"]) for r in only.nodes for c in r["copies"]} == {("n1", "in22k")}
    assert only.queue == []
    only = status.select(st, status.Filter.parse(nodes="n[2-3]"))
    assert [r["node"] for r in only.nodes] == ["n2", "n3"] and [q["job_id"] for q in only.queue] == ["200"]
    only = status.select(st, status.Filter.parse(user="ana"))
    assert [q["job_id"] for q in only.queue] == ["200"]
    assert not any(r["copies"] for r in only.nodes)  # ana leases nothing
    only = status.select(st, status.Filter.parse(job="200"))
    assert [r["node"] for r in only.nodes] == ["n2", "n3"]
    assert {c["dataset"] for r in only.nodes for c in r["copies"]} == {"coco"}
    with pytest.raises(Exception, match="Slurm hostlist"):
        status.Filter.parse(nodes="n[1-")


def test_a_job_is_explained_in_one_paragraph(cluster: Env):
    st = collect(cluster)
    text = status.explain_job(st, "200")
    assert text.startswith("Job 200 (ana, pending in gpu) wants coco. Slurm expects it to start in 20 min on n[2-3].")
    assert "coco is ready on n2" in text and "not yet on n3" in text
    assert "reports from n3 are stale, so what they hold is unknown" in text
    assert "\n" not in text
    assert "is not in the queue's demand" in status.explain_job(st, "999")


def test_cli_status_plain_json_and_job(cluster: Env):
    res = cluster.cli("status", "--no-queue")
    assert res.stdout.startswith("3 nodes reporting") and "Wanted by the queue" not in res.stdout
    assert all(len(line) <= 80 for line in res.stdout.splitlines())
    data = json.loads(cluster.cli("status", "--json", "--no-queue", "--node", "n[1-2]").stdout)
    assert [n["node"] for n in data["nodes"]] == ["n1", "n2"]
    bad = cluster.cli("status", "--node", "n[1-", check=False)
    assert bad.returncode != 0 and "Slurm hostlist" in bad.stderr


def test_offline_status_never_asks_slurm_and_says_the_snapshot_is_stale(cluster: Env):
    """What a Slurm callback may run: dsstage's own files only, whatever their age."""
    class NoSlurm(FakeSlurm):
        def queue(self):  # type: ignore[override]
            raise AssertionError("asked Slurm")

        def nodes(self):  # type: ignore[override]
            raise AssertionError("asked Slurm")
    st = status.collect(cluster.config(), None, lambda: NOW + 3600, offline=True)
    assert [q["job_id"] for q in st.queue] == ["200", "101"] and st.demand_source == "snapshot"
    assert "older than retention.demand_max_age" in st.queue_note
    text = status_view.render_plain(st, status_view.sections(st, show_queue=True, plain=True))
    assert "stale)" in text and "Out of date?" in text and "200" in text


def test_bbstat_answers_are_computed_into_the_status_dir_a_slot_at_a_time(cluster: Env):
    import fcntl

    from dsstage.cluster import bbstat
    from dsstage.errors import DsstageError
    answers = cluster.tmp / "bbstat"
    answers.mkdir(mode=0o700)
    cluster.extra["burst_buffer"] = {"status_dir": str(answers)}
    cluster.write()
    conf = cluster.config()
    (answers / "dataset=in22k.refreshing").write_text("1\n")
    assert bbstat.refresh(conf, "dataset=in22k", lambda: NOW)
    text = (answers / "dataset=in22k").read_text()
    assert text.startswith(f"-- dsstage bbstat {int(NOW)}\n") and "in22k" in text
    datasets = text.split("Tiers")[0]
    assert "coco" not in datasets, "the filter filters"
    assert not (answers / "dataset=in22k.refreshing").exists()
    assert bbstat.refresh(conf, "job=200", lambda: NOW)
    assert "Job 200 (ana, pending in gpu) wants coco" in (answers / "job=200").read_text()
    held = [os.open(answers / f".slot-{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(bbstat.SLOTS)]
    try:
        for fd in held:
            fcntl.flock(fd, fcntl.LOCK_EX)
        assert not bbstat.refresh(conf, "all", lambda: NOW), "every slot busy: nothing computed"
        assert not (answers / "all").exists()
    finally:
        for fd in held:
            os.close(fd)
    for bad in ("all;rm", "node=n1/../x", "job=", "dataset=" + "x" * 201):
        with pytest.raises(DsstageError):
            bbstat.refresh(conf, bad)
    os.chmod(answers, 0o777)
    with pytest.raises(DsstageError, match="others may write"):
        bbstat.refresh(conf, "all")


def test_where_slurm_hides_jobs_a_user_sees_their_own_and_counts_of_the_rest(cluster: Env):
    st = status.collect(cluster.config(), None, lambda: NOW, offline=True)
    summary = demand.read_summary(str(cluster.state))
    assert summary == {"coco": {"pending": 1, "running": 1}}
    mine = status.private_view(st, "ana", summary)
    assert [q["job_id"] for q in mine.queue] == ["200"] and mine.hidden == {"coco": {"pending": 0, "running": 1}}
    nobody = status.private_view(st, None, summary)
    assert nobody.queue == [] and nobody.hidden == {"coco": {"pending": 1, "running": 1}}
    text = status_view.render_plain(nobody, status_view.sections(nobody, show_queue=True, plain=True))
    assert "Other users' jobs are not shown (Slurm's PrivateData=jobs); they want coco: 1 pending, 1 running" \
        in " ".join(text.split())
    assert "101" not in text and "ana" not in text and "bo " not in text
    assert all(set(x) == {"since"} for r in nobody.nodes for c in r["copies"] for x in c["leases"])


def test_a_held_job_is_explained_as_held_not_as_unplanned(cluster: Env):
    jobs = [Job("300", "ana", "PENDING", ("coco",), partition="gpu", priority=0, reason="JobHeldUser"),
            Job("301", "ana", "PENDING", ("coco",), partition="gpu", priority=0, reason="Resources")]
    demand.write(str(cluster.state), demand.build(jobs, NOW - 10))
    text = status.explain_job(collect(cluster), "300")
    assert "It is held: it starts only once released (scontrol release 300)" in text, text
    assert "has not planned" not in text
    assert "It is held" not in status.explain_job(collect(cluster), "301"), "priority 0 alone is no hold"


def test_a_job_in_a_bounded_wait_for_its_data_shows_as_waiting(cluster: Env):
    """The poller's marker in AdminComment (dsstage.policy.datawait) reaches the snapshot,
    the queue's data column and the job's paragraph; a job that waited once does not."""
    jobs = [Job("400", "ana", "PENDING", ("coco",), partition="gpu", priority=10, start_time=NOW + 600,
                sched_nodes="n2", admin_comment="dsstage-datasets=coco dsstage-wait=%d:n[1,3]" % (NOW - 310)),
            Job("401", "ana", "PENDING", ("coco",), partition="gpu", priority=10, start_time=NOW + 600,
                sched_nodes="n2", admin_comment="dsstage-datasets=coco dsstage-waited=%d" % (NOW - 900))]
    demand.write(str(cluster.state), demand.build(jobs, NOW - 10))
    st = collect(cluster)
    text = status.explain_job(st, "400")
    assert "It has been waiting 5 min for nodes that hold its data (placement.wait_for_data)" in text, text
    assert "waiting" not in status.explain_job(st, "401")
    rows = {r[0]: r for r in status_view.sections(st, show_queue=True, plain=True)[-1].rows}
    assert rows["400"][-1] == "1/1 ready, waiting for it" and rows["401"][-1] == "1/1 ready", rows
    queue = status.to_json(st)["queue"]["jobs"]
    assert [q["waiting"] for q in queue if q["job_id"] in ("400", "401")] == [NOW - 310, None]
