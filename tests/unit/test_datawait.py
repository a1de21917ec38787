"""The bounded wait for data (dsstage.policy.datawait, dsstage.cluster.datawait): which
pending job waits for the nodes holding its dataset, when the wait is lifted, and what the
poller asks of Slurm for it."""

from __future__ import annotations

import logging

import pytest
from dsstage.cluster import datawait as cluster_datawait
from dsstage.cluster import poller
from dsstage.hostlist import expand_nodes, fold_nodes
from dsstage.policy import datawait
from dsstage.policy.datawait import Marker, NodeState, PendingJob, decide, marker, with_marker
from dsstage.slurm.fake import FakeSlurm
from dsstage.slurm.hold import OWN_PART, hold_message, merge_admin_comment
from dsstage.slurm.records import Job, Node, Placing, datasets_of, parse_nodes, parse_placing

NOW = 1_800_000_000.0
HOUR = 3600.0


def fold(names) -> str:
    return fold_nodes(list(names))


def nodes(busy: dict[str, float] | None = None, states: dict[str, str] | None = None,
          features: dict[str, set[str]] | None = None) -> dict[str, NodeState]:
    busy, states, features = busy or {}, states or {}, features or {}
    return {f"n{i}": NodeState(f"n{i}", states.get(f"n{i}", "allocated"), ("batch",),
                               frozenset(features.get(f"n{i}", set())), busy.get(f"n{i}", 0.0))
            for i in range(1, 5)}


def job(jid: str = "7", **kw) -> PendingJob:
    base = dict(job_id=jid, datasets=("img",), nodes=1, partitions=("batch",), held=False,
                expected_start=NOW + 60, admin_comment="dsstage=img")
    base.update(kw)
    return PendingJob(**base)


def run(jobs, ns, holders, now=NOW, bound=HOUR) -> list[datawait.Action]:
    return decide(jobs, ns, holders, now, bound, fold=fold, expand=expand_nodes)


def test_a_job_waits_for_the_busy_node_that_holds_its_data_when_it_frees_in_time() -> None:
    ns = nodes(busy={"n1": NOW + 600, "n2": NOW + 9 * HOUR, "n3": NOW + 5 * HOUR, "n4": NOW + 5 * HOUR})
    [act] = run([job()], ns, {"img": {"n1"}})
    assert act.kind == "wait" and act.exclude == "n[2-4]" and act.holders == ("n1",)
    assert act.marker == Marker(True, int(NOW), "n[2-4]")
    assert "starts waiting for n1, which hold img" in act.reason
    # the next round with nothing changed: nothing to do in Slurm
    comment = with_marker("dsstage=img", act.marker)
    [again] = run([job(exc_nodes="n[2-4]", admin_comment=comment)], ns, {"img": {"n1"}}, now=NOW + 30)
    assert again.kind == "keep" and "waiting since 30 s" in again.reason


@pytest.mark.parametrize(("case", "changes", "holders", "busy", "why"), [
    ("holder busy too long", {}, {"n1"}, {"n1": NOW + 2 * HOUR}, "0 of the nodes holding img are expected free"),
    ("too few holders", {"nodes": 2}, {"n1"}, {}, "1 node(s) up hold img, it needs 2"),
    ("no holder", {}, set(), {}, "0 node(s) up hold img"),
    ("held", {"held": True}, {"n1"}, {}, "held"),
    ("names its nodes", {"req_nodes": "n2"}, {"n1"}, {}, "names its nodes"),
    ("excludes nodes", {"exc_nodes": "n4"}, {"n1"}, {}, "excludes nodes of its own"),
    ("constraint with or", {"constraint": "gpu|big"}, {"n1"}, {}, "not a plain list"),
    ("not planned", {"expected_start": None}, {"n1"}, {}, ""),
    ("planned late", {"expected_start": NOW + 2 * HOUR}, {"n1"}, {}, "only after placement.wait_for_data"),
    ("in a reservation", {"reservation": "maint"}, {"n1"}, {}, "reservation"),
    ("holder lacks the constraint", {"constraint": "gpu"}, {"n1"}, {}, "0 node(s) up hold img"),
    ("other partition", {"partitions": ("gpu",)}, {"n1"}, {}, "0 node(s) up hold img"),
])
def test_a_job_does_not_wait_and_a_waiting_one_is_let_go(case, changes, holders, busy, why) -> None:
    ns = nodes(busy=busy)
    assert run([job(**changes)], ns, {"img": holders}) == [], case  # never starts waiting
    mark = Marker(True, int(NOW - 60), "n[2-4]")
    exc = changes.get("exc_nodes", "n[2-4]")
    waiting = job(**{**changes, "exc_nodes": exc, "admin_comment": with_marker("dsstage=img", mark)})
    [act] = run([waiting], ns, {"img": holders})
    if not why:  # a waiting job without a plan goes on: backfill plans it again
        assert act.kind == "keep", (case, act)
        return
    if case == "excludes nodes":  # someone changed the exclusion dsstage set: it is theirs
        assert act.kind == "lift" and not act.restore and "changed by someone else" in act.reason
    else:
        assert act.kind == "lift" and act.restore and why in act.reason, (case, act)
    assert act.marker == Marker(False, int(NOW - 60))


def test_the_wait_is_bounded_from_its_first_round_and_never_comes_back() -> None:
    ns = nodes(busy={"n1": NOW + 600})
    mark = Marker(True, int(NOW - HOUR), "n[2-4]")
    [act] = run([job(exc_nodes="n[2-4]", admin_comment=with_marker("dsstage=img", mark))], ns, {"img": {"n1"}})
    assert act.kind == "lift" and act.restore and "waited 3600 s" in act.reason
    done = with_marker("dsstage=img", act.marker)
    assert done == f"dsstage=img dsstage-waited={int(NOW - HOUR)}"
    assert run([job(admin_comment=done)], ns, {"img": {"n1"}}) == []


def test_switching_the_wait_off_lets_every_waiting_job_go() -> None:
    ns = nodes(busy={"n1": NOW + 600})
    mark = Marker(True, int(NOW), "n[2-4]")
    waiting = job(exc_nodes="n[2-4]", admin_comment=with_marker("dsstage=img", mark))
    [act] = run([waiting], ns, {"img": {"n1"}}, bound=0)
    assert act.kind == "lift" and act.restore and "off" in act.reason
    assert run([job()], ns, {"img": {"n1"}}, bound=0) == []


def test_holders_that_go_down_or_lose_the_data_end_the_wait() -> None:
    mark = Marker(True, int(NOW), "n[3-4]")
    waiting = job(nodes=2, exc_nodes="n[3-4]", admin_comment=with_marker("dsstage=img", mark))
    for state in ("drained", "down*", "idle*", "draining", "maint"):
        ns = nodes(busy={"n1": NOW + 60}, states={"n2": state})
        [act] = run([waiting], ns, {"img": {"n1", "n2"}})
        assert act.kind == "lift" and "1 node(s) up hold img, it needs 2" in act.reason, state
    ns = nodes(busy={"n1": NOW + 60}, states={"n2": "mixed"})
    assert run([waiting], ns, {"img": {"n1", "n2"}})[0].kind == "keep"
    # a third node gets the data: the exclusion follows
    [act] = run([waiting], ns, {"img": {"n1", "n2", "n3"}})
    assert act.kind == "wait" and act.exclude == "n4" and act.marker == Marker(True, int(NOW), "n4")


def test_a_job_of_several_datasets_waits_for_nodes_that_hold_all_of_them() -> None:
    ns = nodes(busy={"n1": NOW + 60, "n2": NOW + 60})
    [act] = run([job(datasets=("img", "txt"))], ns, {"img": {"n1", "n2"}, "txt": {"n2", "n3"}})
    assert act.kind == "wait" and act.holders == ("n2",) and act.exclude == "n[1,3-4]"
    # the holders must have the job's features too
    ns = nodes(busy={"n1": NOW + 60}, features={"n1": {"gpu", "nvme"}, "n2": {"gpu"}})
    [act] = run([job(constraint="gpu&nvme")], ns, {"img": {"n1", "n2"}})
    assert act.holders == ("n1",)


def test_markers_sit_before_dsstages_hold_message_and_keep_the_rest() -> None:
    held = merge_admin_comment("site=x dsstage=img", hold_message(Job("7", "u", "PENDING", ()), "source down"))
    text = with_marker(held, Marker(True, 5, "n[2-4]"), OWN_PART)
    assert text.startswith("site=x dsstage=img dsstage-wait=5:n[2-4] dsstage held this job: source down")
    assert marker(text) == Marker(True, 5, "n[2-4]") and datasets_of(text) == ("img",)
    text = with_marker(text, Marker(False, 5), OWN_PART)
    assert "dsstage-wait=" not in text and marker(text) == Marker(False, 5)
    assert with_marker(text, None, OWN_PART) == held
    assert marker("dsstage=img") is None and marker("xdsstage-wait=5:n1") is None


def test_squeue_placing_fields_are_read_constraint_last() -> None:
    text = ("12|12|PENDING|2|N/A||||gpu|big\n"
            "13|13|PENDING|1-4|N/A|n1|n[2-3]|maint|(null)\n"
            "9|6_3|RUNNING|1|1795851599||||(null)\n"
            "6|6_[4-9]|PENDING|1|N/A||||\n"
            "20|20+1|PENDING|1|N/A|||(null)|\n"
            "garbage line\n")
    p = parse_placing(text)
    assert p["12"] == Placing("12", "12", "PENDING", 2, None, "", "", "", "gpu|big")
    assert p["13"].nodes == 1 and p["13"].req_nodes == "n1" and p["13"].exc_nodes == "n[2-3]"
    assert p["13"].constraint == "" and p["13"].reservation == "maint"
    assert p["9"].end_time == 1795851599 and p["9"].job_ref == "6_3" and not p["9"].array_pending
    assert p["6"].array_pending and p["20"].heterogeneous and not p["12"].heterogeneous
    assert set(p) == {"12", "13", "9", "6", "20"}


def test_a_hold_reason_cannot_pass_for_a_wait_marker() -> None:
    from dsstage.slurm.hold import clean_reason

    text = clean_reason("source down: dsstage-wait=1:n1 dsstage-waited=2 dsstage=x")
    assert text == "source down: dsstage-wait:1:n1 dsstage-waited:2 dsstage:x"
    assert marker(text) is None


def test_sinfo_partitions_are_collected_per_node() -> None:
    ns = parse_nodes("n1|n1|idle|gpu|gpu|batch\nn1|n1|idle|gpu|gpu|debug\nn2|n2|mixed|(null)|(null)|batch\n")
    assert ns["n1"].partitions == ("batch", "debug") and ns["n2"].partitions == ("batch",)
    assert parse_nodes("n3|n3|idle\n")["n3"].partitions == ()


def _cluster(wait: str = "1h"):
    fake = FakeSlurm(node_table={n: Node(n, n, "allocated", partitions=("batch",)) for n in ("n1", "n2", "n3")})
    blockers = {"1": "n1", "2": "n2", "3": "n3"}
    for jid, node in blockers.items():
        fake.submit(Job(jid, "u", "RUNNING", (), nodes=node, partition="batch", priority=1))
        fake.placing_table[jid] = Placing(jid, jid, "RUNNING", 1, NOW + (300 if node == "n3" else 9 * HOUR),
                                          node, "", "", "")
    fake.submit(Job("7", "u", "PENDING", ("img",), partition="batch", priority=100, admin_comment="dsstage=img",
                    start_time=NOW + 300))
    fake.placing_table["7"] = Placing("7", "7", "PENDING", 1, None, "", "", "", "")
    return fake


def test_the_poller_round_sets_and_lifts_the_exclusion_in_slurm(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    fake = _cluster()
    conf = _conf(tmp_path, "1h")
    wanted = {"n1": set(), "n2": set(), "n3": {"ds_img"}}
    acts = cluster_datawait.sync(conf, fake, fake.queue(), fake.nodes(), wanted, NOW)
    assert [a.kind for a in acts] == ["wait"]
    assert fake.exclusion_calls == [("7", "n[1-2]", f"dsstage=img dsstage-wait={int(NOW)}:n[1-2]")]
    # the comment is merged into what the job has when it is written: a hold message
    # written since the round read the queue stays
    assert "job 7 waits for its data" in caplog.text
    # the data leaves n3: the exclusion goes, the job is marked done
    acts = cluster_datawait.sync(conf, fake, fake.queue(), fake.nodes(), {"n3": set()}, NOW + 30)
    assert fake.exclusion_calls[-1] == ("7", "", f"dsstage=img dsstage-waited={int(NOW)}")
    assert "job 7 no longer waits for its data: 0 node(s) up hold img" in caplog.text
    n = len(fake.exclusion_calls)
    cluster_datawait.sync(conf, fake, fake.queue(), fake.nodes(), wanted, NOW + 60)
    assert len(fake.exclusion_calls) == n  # never again


def test_the_round_writes_into_the_comment_slurm_has_now_and_leaves_foreign_exclusions(tmp_path) -> None:
    from dataclasses import replace

    fake = _cluster()
    conf = _conf(tmp_path, "1h")
    jobs = fake.queue()  # the round's read; a Prolog elsewhere then holds job 7
    held = merge_admin_comment("dsstage=img", "dsstage held this job: source down -- once that is fixed: x")
    fake.jobs["7"] = replace(fake.jobs["7"], admin_comment=held)
    cluster_datawait.sync(conf, fake, jobs, fake.nodes(), {"n3": {"ds_img"}}, NOW)
    assert fake.jobs["7"].admin_comment == (f"dsstage=img dsstage-wait={int(NOW)}:n[1-2] "
                                            "dsstage held this job: source down -- once that is fixed: x")
    # its user changes the exclusion: the next round drops the marker and leaves ExcNodeList alone
    fake.placing_table["7"] = replace(fake.placing_table["7"], exc_nodes="n1")
    cluster_datawait.sync(conf, fake, fake.queue(), fake.nodes(), {"n3": {"ds_img"}}, NOW + 30)
    assert fake.exclusion_calls[-1][:2] == ("7", None) and "dsstage-waited=" in fake.exclusion_calls[-1][2]


def test_a_second_job_waiting_for_the_same_node_is_let_go_when_backfill_plans_it_too_late() -> None:
    ns = nodes(busy={"n1": NOW + 600})
    mark = Marker(True, int(NOW), "n[2-4]")
    second = job("8", exc_nodes="n[2-4]", admin_comment=with_marker("dsstage=img", mark),
                 expected_start=NOW + 600 + HOUR)  # behind job 7 on n1
    [act] = run([second], ns, {"img": {"n1"}}, now=NOW + 60)
    assert act.kind == "lift" and "only after placement.wait_for_data" in act.reason
    # the holders are judged against the first round's deadline, not against now
    late = nodes(busy={"n1": NOW + HOUR + 60})
    [act] = run([job(exc_nodes="n[2-4]", admin_comment=with_marker("dsstage=img", mark))], late, {"img": {"n1"}},
                now=NOW + 120)
    assert act.kind == "lift" and "expected free within 3600 s of its first round" in act.reason


def test_with_the_features_off_the_poller_lifts_every_wait(tmp_path) -> None:
    fake = _cluster()
    mark = with_marker("dsstage=img", Marker(True, int(NOW), "n[1-2]"))
    fake.jobs["7"] = Job("7", "u", "PENDING", ("img",), partition="batch", priority=100, admin_comment=mark,
                         start_time=NOW + 300)
    from dataclasses import replace
    fake.placing_table["7"] = replace(fake.placing_table["7"], exc_nodes="n[1-2]")
    conf = _conf(tmp_path, "1h", features=False)
    poller.poll_once(conf, fake, clock=lambda: NOW + 30)
    assert fake.exclusion_calls == [("7", "", f"dsstage=img dsstage-waited={int(NOW)}")]
    assert fake.feature_calls == []


def test_with_the_wait_off_the_poller_asks_slurm_nothing_more(tmp_path) -> None:
    fake = _cluster()
    fake.placing_table.clear()  # placing() would give nothing: it must not even be asked
    conf = _conf(tmp_path, "0")
    assert cluster_datawait.sync(conf, fake, fake.queue(), fake.nodes(), {"n3": {"ds_img"}}, NOW) == []
    assert fake.exclusion_calls == []


def test_a_refused_update_is_logged_and_the_round_goes_on(tmp_path, caplog) -> None:
    from dsstage.errors import CommandError

    fake = _cluster()

    def refuse(job_id, job_ref, exclude, comment):
        raise CommandError(["scontrol"], 1, "", "Job has already finished")
    fake.set_exclusion = refuse  # type: ignore[method-assign]
    acts = cluster_datawait.sync(_conf(tmp_path, "1h"), fake, fake.queue(), fake.nodes(),
                                 {"n3": {"ds_img"}}, NOW)
    assert [a.kind for a in acts] == ["wait"] and "job 7: wait: not done" in caplog.text


def test_poll_once_runs_the_wait_after_the_features(tmp_path) -> None:
    fake = _cluster()
    conf = _conf(tmp_path, "1h")
    _n3_holds_img(tmp_path)
    poller.poll_once(conf, fake, clock=lambda: NOW)
    assert fake.nodes()["n3"].features == ("ds_img",)
    assert fake.exclusion_calls and fake.exclusion_calls[0][:2] == ("7", "n[1-2]")


def _n3_holds_img(tmp_path) -> None:
    """The nodes' reports: n3 holds img ready, n1 and n2 nothing."""
    import json
    reports = tmp_path / "state" / "nodes"
    reports.mkdir(parents=True, exist_ok=True)
    for n in ("n1", "n2", "n3"):
        copies = [{"dataset": "img", "state": "ready", "current": True}] if n == "n3" else []
        (reports / f"{n}.json").write_text(json.dumps({"node": n, "time": NOW - 5, "copies": copies}))


def _conf(tmp_path, wait: str, features: bool = True):
    from dsstage.config.load import from_dict

    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    return from_dict({"state_dir": str(state), "placement": {"wait_for_data": wait, "features": features},
                      "tiers": {"nvme": {"path": str(tmp_path / "nvme"), "capacity": "1GB"}},
                      "datasets": {"img": {"source": "/srv/img", "tier": "nvme"}}}, origin="dsstage.yaml")


def test_the_configuration_takes_a_duration_and_refuses_nonsense(tmp_path) -> None:
    from dsstage.errors import ConfigError

    assert _conf(tmp_path, "90m").placement.wait_for_data == 5400
    assert _conf(tmp_path, "0").placement.wait_for_data == 0
    for bad in ("-1", "8d", "soon"):
        with pytest.raises(ConfigError, match="placement.wait_for_data"):
            _conf(tmp_path, bad)


def _pilot_conf(tmp_path, partitions):
    from dsstage.config.load import from_dict

    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    return from_dict({"state_dir": str(state), "placement": {"wait_for_data": "1h"},
                      "rollout": {"partitions": partitions},
                      "tiers": {"nvme": {"path": str(tmp_path / "nvme"), "capacity": "1GB"}},
                      "datasets": {"img": {"source": "/srv/img", "tier": "nvme"}}}, origin="dsstage.yaml")


def test_a_job_outside_the_pilot_waits_for_nothing_and_one_waiting_is_let_go(tmp_path, caplog) -> None:
    """rollout.partitions: a job of another partition behaves as if dsstage were not installed;
    one that waits when the pilot shrinks is let go at the next round."""
    caplog.set_level(logging.INFO)
    fake = _cluster()
    wanted = {"n1": set(), "n2": set(), "n3": {"ds_img"}}
    assert cluster_datawait.sync(_pilot_conf(tmp_path, ["gpu-pilot"]), fake, fake.queue(), fake.nodes(), wanted,
                                 NOW) == []
    assert fake.exclusion_calls == []
    # in the pilot it waits; the pilot then shrinks to another partition: the wait is lifted
    [act] = cluster_datawait.sync(_pilot_conf(tmp_path, ["gpu-pilot", "batch"]), fake, fake.queue(), fake.nodes(),
                                  wanted, NOW)
    assert act.kind == "wait"
    [act] = cluster_datawait.sync(_pilot_conf(tmp_path, ["gpu-pilot"]), fake, fake.queue(), fake.nodes(), wanted,
                                  NOW + 30)
    assert act.kind == "lift" and "outside the rollout" in act.reason
    assert fake.exclusion_calls[-1] == ("7", "", f"dsstage=img dsstage-waited={int(NOW)}")


def test_after_dsstage_disable_no_job_waits_and_no_node_keeps_a_dataset_feature(tmp_path) -> None:
    from dsstage.node import rollout

    fake = _cluster()
    conf = _conf(tmp_path, "1h")
    _n3_holds_img(tmp_path)
    poller.poll_once(conf, fake, clock=lambda: NOW)
    assert fake.nodes()["n3"].features == ("ds_img",) and fake.exclusion_calls[0][:2] == ("7", "n[1-2]")
    rollout.write_switch(conf.state_dir, {"reason": "NFS maintenance", "by": "root"})
    poller.poll_once(conf, fake, clock=lambda: NOW + 30)
    assert fake.nodes()["n3"].features == ()
    assert fake.exclusion_calls[-1] == ("7", "", f"dsstage=img dsstage-waited={int(NOW)}")
