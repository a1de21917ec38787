"""A breaker per source (dsstage.node.breaker): the rule, the key, and what the hook blames."""

from __future__ import annotations

from dsstage.config.load import from_dict
from dsstage.hooks import abandoned, bounded
from dsstage.node import breaker


def test_a_breaker_is_closed_open_while_someone_probes_and_probed_otherwise() -> None:
    assert breaker.state(None, 100.0).kind == "closed" == breaker.state({}, 100.0).kind
    tripped = {"by": "n1", "since": 40.0, "reason": "hung", "probe_after": 40.0}
    st = breaker.state(tripped, 100.0)
    assert st.kind == "probe" and st.since == 40.0 and "found by node n1 60 s ago: hung" in st.reason
    probing = {**tripped, "probe_after": 103.0, "probe_by": "n7"}
    st = breaker.state(probing, 100.0)
    assert st.kind == "open" and "node n7 is probing it now" in st.reason
    assert breaker.state(probing, 103.0).kind == "probe"  # a probe that never came back frees the next one


def test_a_breaker_is_the_declared_sources_else_the_datasets_own(tmp_path) -> None:
    conf = from_dict({"state_dir": str(tmp_path), "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}},
                      "sources": {"lustre": {"prefix": "/lustre/", "max_in_flight": 64},
                                  "proj": {"prefix": "/lustre/proj/", "max_in_flight": 8}},
                      "datasets": {"a": {"source": "/lustre/a"}, "b": {"source": "/lustre/proj/b"},
                                   "c": {"source": "/nfs/c"}}})
    assert [breaker.key_of(conf, conf.datasets[n]) for n in "abc"] == ["source.lustre", "source.proj", "dataset.c"]


def test_the_hook_blames_the_source_it_was_staging_from_when_its_work_stopped() -> None:
    said = ["staging dataset.a", "staged", "staging source.lustre"]
    assert abandoned.hung_source(bounded.Outcome(None, said)) == "source.lustre"
    assert abandoned.hung_source(bounded.Outcome(None, [*said, "staged", "decided run"])) is None
    assert abandoned.hung_source(bounded.Outcome(None, [])) is None


def test_a_tripped_breaker_is_read_back_and_a_foreign_file_is_none(tmp_path) -> None:
    breaker.trip(str(tmp_path), "dataset.c", "n1", "dsstage's prolog did not finish\nwithin 12s", 50.0)
    record = breaker.read(str(tmp_path), "dataset.c")
    assert record is not None and record["reason"] == "dsstage's prolog did not finish within 12s"
    assert breaker.all_open(str(tmp_path)) == {"dataset.c": record}
    (tmp_path / "sources" / "dataset.d.json").write_text('{"format": 99}')
    assert breaker.read(str(tmp_path), "dataset.d") is None and list(breaker.all_open(str(tmp_path))) == ["dataset.c"]
    assert breaker.reset(str(tmp_path), "dataset.c") and not breaker.reset(str(tmp_path), "dataset.c")


def test_after_a_failed_probe_no_node_probes_for_a_cooldown_that_doubles() -> None:
    """A probe that found the source still hung keeps the breaker open, without a probe, for
    COOLDOWN s, then twice that after the next failed probe, up to COOLDOWN_MAX: the Prologs
    meanwhile decide at once instead of each spending PROBE_TIMEOUT (bench/scale: 7.2 s per
    later job before, the probe each time)."""
    tripped = {"by": "n1", "since": 40.0, "reason": "hung", "probe_after": 40.0}
    once = breaker.after_failed_probe({**tripped, "probe_by": "n2"}, "n2", 100.0)
    st = breaker.state(once, 101.0)
    assert st.kind == "open" and "node n2 probed it 1 s ago, the next probe in 14 s" in st.reason, st.reason
    assert breaker.state(once, 100.0 + breaker.COOLDOWN).kind == "probe"
    twice = breaker.after_failed_probe(once, "n3", 200.0)
    assert twice["probe_after"] == 200.0 + 2 * breaker.COOLDOWN and twice["failed_probes"] == 2
    many = twice
    for i in range(10):
        many = breaker.after_failed_probe(many, "n4", 1000.0 * (i + 1))
    assert many["probe_after"] == 10000.0 + breaker.COOLDOWN_MAX
    claimed = {**once, "probe_after": 120.0, "probe_by": "n5"}  # a node probes after the cooldown
    assert "node n5 is probing it now" in breaker.state(claimed, 116.0).reason
