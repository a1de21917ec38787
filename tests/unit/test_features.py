"""Node features of ready datasets (dsstage.cluster.features): what changes, in how many Slurm calls."""

from __future__ import annotations

from dsstage.cluster.features import changes, held
from dsstage.slurm.fake import FakeSlurm
from dsstage.slurm.records import Node, parse_nodes

NOW = 1_000_000.0


def rep(node: str, *ready: str, age: float = 10, other: tuple[tuple[str, str, bool], ...] = ()) -> dict:
    copies = [{"dataset": d, "state": "ready", "current": True} for d in ready]
    copies += [{"dataset": d, "state": s, "current": cur} for d, s, cur in other]
    return {"node": node, "time": NOW - age, "copies": copies}


def test_held_counts_ready_current_copies_of_current_reports() -> None:
    reports = [rep("n1", "a", other=(("b", "staging", True), ("c", "ready", False))), rep("n2", "b", age=3600),
               rep("n3", "c"), rep("n4")]
    assert held(reports, "ds_", NOW, 900, {"n3": "down"}) == {"n1": {"ds_a"}, "n4": set()}


def test_changes_keep_site_features_and_group_equal_lists() -> None:
    current = {n: (f, f) for n, f in {"n1": ("gpu", "ds_old"), "n2": ("gpu",), "n3": ("gpu", "ds_a"), "n4": ("ds_a",),
                                      "n5": ("gpu",)}.items()}
    wanted = {"n1": {"ds_a"}, "n2": {"ds_a"}, "n3": {"ds_a"}, "n4": set(), "n6": {"ds_a"}}
    assert changes(current, wanted, "ds_") == [(["n1", "n2"], ["gpu", "ds_a"], ["gpu", "ds_a"]), (["n4"], [], [])]
    assert changes({"n1": (("gpu", "ds_a"),) * 2}, {"n1": {"ds_a"}}, "ds_") == []  # nothing changed: no call


def test_changes_leave_every_feature_not_ours_as_slurm_had_it() -> None:
    """A NodeFeaturesPlugins node (KNL modes: available quad,snc2, active quad) or an admin's
    features that differ between available and active: written back as they are, in order;
    only ours change, in both lists."""
    current = {"n1": (("knl", "quad", "snc2", "ds_old"), ("knl", "quad", "ds_old")),
               "n2": (("gpu", "bigmem"), ("gpu",))}
    wanted = {"n1": {"ds_a"}, "n2": set()}
    assert changes(current, wanted, "ds_") == [(["n1"], ["knl", "quad", "snc2", "ds_a"], ["knl", "quad", "ds_a"])]
    # a node whose features (ours) are as wanted is not touched, whatever the site's are
    assert changes({"n2": (("gpu", "bigmem", "ds_a"), ("gpu", "ds_a"))}, {"n2": {"ds_a"}}, "ds_") == []


def test_sinfo_features_are_read() -> None:
    nodes = parse_nodes("n1|10.0.0.1|idle|gpu,ds_a|gpu\nn2|n2|mixed|(null)|(null)\nn3|n3|idle|gpu\n")
    assert nodes["n1"].features == ("gpu", "ds_a") and nodes["n1"].active_features == ("gpu",)
    assert nodes["n2"].features == () == nodes["n2"].active_features
    assert nodes["n3"].active_features == ("gpu",)  # no active field: as available


def test_fake_slurm_records_one_call_per_group() -> None:
    fake = FakeSlurm(node_table={n: Node(n, n, "idle") for n in ("n1", "n2")})
    fake.set_features("n[1-2]", ["ds_a", "x"], ["ds_a"])
    assert fake.feature_calls == [("n[1-2]", ["ds_a", "x"], ["ds_a"])]
    assert fake.nodes()["n2"].features == ("ds_a", "x") and fake.nodes()["n2"].active_features == ("ds_a",)


def test_the_switches_take_every_dataset_feature_off_the_nodes_outside() -> None:
    """A pilot (rollout) keeps features only on its nodes; `dsstage disable` on none. A node
    outside loses ours even without a report (a copy left from before the pilot shrank), and
    the site's own stay."""
    from dsstage.cluster.features import in_scope

    nodes = {"n1": Node("n1", "n1", "idle", partitions=("pilot", "batch")),
             "n2": Node("n2", "n2", "idle", partitions=("batch",)),
             "n3": Node("n3", "n3", "idle", partitions=("pilot",))}
    wanted = {"n1": {"ds_a"}, "n2": {"ds_a"}}
    assert in_scope(wanted, nodes, None, None, None) == wanted
    assert in_scope(wanted, nodes, None, ("pilot",), None) == {"n1": {"ds_a"}, "n2": set()}
    assert in_scope(wanted, nodes, None, None, ["n2", "n3"]) == {"n1": set(), "n2": {"ds_a"}}
    assert in_scope(wanted, nodes, {"reason": "x"}, None, None) == {"n1": set(), "n2": set(), "n3": set()}
    current = {"n1": (("gpu", "ds_a"),) * 2, "n2": (("ds_a",),) * 2, "n3": ((), ())}
    assert changes(current, in_scope(wanted, nodes, None, ("pilot",), None), "ds_") == [(["n2"], [], [])]
