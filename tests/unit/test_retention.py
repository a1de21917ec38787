"""The retention planner: a table of cases, each asserting the decision and its reason."""

from __future__ import annotations

import pytest
from dsstage.policy.retention import Asked, Copy, Demand, Plan, Policy, Space, Want, keeper_of, plan, used

NOW = 1_800_000_000.0
GB = 10**9
HOUR = 3600.0
DAY = 86400.0


def copy(name: str, size_gb: float = 10, *, idle: float = DAY, version: str = "", **kw: object) -> Copy:
    return Copy(dataset=name, version=version or f"{name[:4]:0<4}".encode().hex()[:8] + "00000000",
                bytes=int(size_gb * GB), last_used=NOW - idle, tier="nvme", **kw)  # type: ignore[arg-type]


def pending(job: str, *, start_in: float | None = 600, nodes: tuple[str, ...] = ("n1",),
            partition: str = "gpu") -> Want:
    return Want(job_id=job, state="pending", partition=partition, start=None if start_in is None else NOW + start_in,
                nodes=nodes)


def decide(copies: list[Copy], *, capacity_gb: float = 100, wants: dict[str, list[Want]] | None = None,
           stale: bool = False, need_gb: float = 0, policy: Policy = Policy(), **asked: object) -> tuple[Plan, dict]:
    p = plan(copies, Demand(wants=wants or {}, stale=stale, age=7200 if stale else 10),
             Space(capacity=int(capacity_gb * GB), high=0.9, low=0.75, need=int(need_gb * GB)), NOW,
             policy=policy, node="n1", asked=Asked(**asked))  # type: ignore[arg-type]
    return p, {d.copy.dataset + ("" if d.copy.current else "@old"): (d.action, d.reason) for d in p.decisions}


# -- without pressure ---------------------------------------------------------------------

CASES = [
    # (what, copies, wants, expected action of "a", a fragment of its reason)
    ("leased", [copy("a", leases=("123",))], {}, "keep", "leased by job 123"),
    ("leased by several", [copy("a", leases=("1", "2"))], {}, "keep", "leased by jobs 1, 2"),
    ("wanted soon here", [copy("a")], {"a": [pending("456", start_in=20 * 60)]}, "keep",
     "wanted by pending job 456 (partition gpu, expected in 20 min, planned on this node)"),
    ("wanted elsewhere", [copy("a")], {"a": [pending("456", nodes=("n7",))]}, "keep", "planned elsewhere"),
    ("wanted, not placed", [copy("a")], {"a": [pending("456", nodes=(), start_in=None)]}, "keep",
     "wanted by pending job 456 (partition gpu, not placed yet)"),
    ("running elsewhere", [copy("a")], {"a": [Want("9", "running", nodes=("n2",))]}, "keep",
     "in use by running job 9 on other nodes"),
    ("idle, no demand, room", [copy("a", idle=3 * DAY)], {}, "keep", "no demand, idle 3 d: kept while there is room"),
    ("recently used", [copy("a", idle=60)], {}, "keep", "used 1 min ago (min_keep 10 min)"),
    ("flagged bad", [copy("a", ready=False)], {}, "evict", "flagged bad, no lease"),
]


@pytest.mark.parametrize("what,copies,wants,action,reason", CASES, ids=[c[0] for c in CASES])
def test_without_pressure(what, copies, wants, action, reason):
    _p, d = decide(copies, wants=wants)
    assert d["a"][0] == action and reason in d["a"][1], d["a"]


def test_old_version_goes_once_the_current_one_is_ready():
    _p, d = decide([copy("a", version="1111"), copy("a", version="0000", current=False)])
    assert d["a@old"] == ("evict", "old version (the current one is ready here), no lease")
    assert d["a"][0] == "keep"


def test_old_version_stays_while_the_current_one_is_not_here():
    _p, d = decide([copy("a", version="0000", current=False)])
    assert d["a@old"][0] == "keep" and "reuses its files" in d["a@old"][1]


def test_old_version_with_a_lease_stays():
    _p, d = decide([copy("a", version="1111"), copy("a", version="0000", current=False, leases=("7",))])
    assert d["a@old"] == ("keep", "leased by job 7")


def test_max_idle_evicts_an_unwanted_idle_copy_but_not_a_wanted_one():
    policy = Policy(max_idle=2 * DAY)
    _p, d = decide([copy("a", idle=3 * DAY), copy("b", idle=3 * DAY)], wants={"b": [pending("5")]}, policy=policy)
    assert d["a"] == ("evict", "idle 3 d, no demand")
    assert d["b"][0] == "keep"


def test_max_idle_does_nothing_on_a_stale_snapshot():
    _p, d = decide([copy("a", idle=3 * DAY)], stale=True, policy=Policy(max_idle=DAY))
    assert d["a"][0] == "keep" and "demand unknown (snapshot 2 h old)" in d["a"][1]


# -- under pressure --------------------------------------------------------------------

def test_over_high_watermark_evicts_down_to_the_low_one_unwanted_first():
    # 95 GB of 100: evict until <= 75 GB; "w" is wanted, "x", "y" are not
    copies = [copy("w", 30, idle=5 * DAY), copy("x", 30, idle=2 * DAY), copy("y", 35, idle=3 * DAY)]
    p, d = decide(copies, wants={"w": [pending("456")]})
    assert d["y"][0] == "evict" and "over high watermark (90% of 100.0 GB" not in d["y"][1]
    assert d["y"][1].startswith("over high watermark (90% of 93.1 GiB); no demand, idle 3 d")
    assert d["x"][0] == "keep" and d["w"][0] == "keep"  # 60 GB left: below the low watermark already
    assert p.usage_before == 95 * GB and p.usage_after == 60 * GB


def test_below_high_watermark_nothing_goes_for_space():
    p, d = decide([copy("x", 40), copy("y", 45)])  # 85 GB of 100
    assert not p.evictions()


def test_leased_copies_survive_any_pressure():
    p, d = decide([copy("x", 60, leases=("1",)), copy("y", 39, leases=("2",))])
    assert not p.evictions() and p.usage_after == 99 * GB
    assert d["x"] == ("keep", "leased by job 1")


def test_superseded_versions_go_first_under_pressure():
    copies = [copy("x", 45, idle=9 * DAY), copy("a", 50, version="0000", current=False, idle=60)]
    p, d = decide(copies)
    assert d["a@old"][0] == "evict" and d["a@old"][1].endswith("old version, idle 1 min")
    assert d["x"][0] == "keep"


def test_min_keep_protects_recent_data_from_pressure():
    p, d = decide([copy("x", 50, idle=60), copy("y", 45, idle=120)])
    assert not p.evictions() and "min_keep" in d["x"][1]


def test_min_keep_does_not_block_a_stage():
    # the example of the bug: a copy used 1 min ago, no lease, no demand, failed the stage
    p = plan([Copy("a", "v", 80, NOW - 60)], Demand(), Space(100, need=50), NOW)
    assert p.fits and p.decisions[0].evict
    assert "within min_keep 10 min, but the stage cannot fit otherwise" in p.decisions[0].reason


def test_a_stage_takes_recent_copies_last_and_never_a_recent_wanted_one():
    copies = [copy("recent", 30, idle=60), copy("old", 30, idle=DAY), copy("w", 30, idle=60)]
    p, d = decide(copies, need_gb=20, wants={"w": [pending("1")]})  # 110 GB: one 30 GB copy reaches 80
    assert [e.copy.dataset for e in p.evictions()] == ["old"] and p.fits
    p, d = decide(copies, need_gb=45, wants={"w": [pending("1")]})  # 135 GB: two copies needed
    assert [e.copy.dataset for e in p.evictions()] == ["recent", "old"] and p.fits and d["w"][0] == "keep"
    p, d = decide([copy("w", 80, idle=60)], need_gb=50, wants={"w": [pending("1")]})
    assert not p.evictions() and not p.fits


@pytest.mark.parametrize("want,evicted", [
    (pending("1", nodes=("n1",)), False),  # planned here: it will read this copy
    (pending("1", nodes=()), False),  # not planned yet: it may land here
    (pending("1", nodes=("n2",)), True),  # planned on n2: it reads n2's copy
    (Want("1", "running", nodes=("n2",)), True),  # running on n2: same
])
def test_a_stage_may_take_a_recent_copy_only_jobs_elsewhere_want(want, evicted):
    p, d = decide([copy("w", 80, idle=60)], need_gb=50, wants={"w": [want]})
    assert p.fits is evicted and d["w"][0] == ("evict" if evicted else "keep"), d


@pytest.mark.parametrize("first,second,wants", [
    # no demand before demand; far demand before near; elsewhere before here
    ("free", "wanted", {"wanted": [pending("1")]}),
    ("later", "sooner", {"later": [pending("1", start_in=3 * DAY)], "sooner": [pending("2", start_in=60)]}),
    ("there", "here", {"there": [pending("1", nodes=("n9",))], "here": [pending("2", nodes=("n1",))]}),
    ("one", "many", {"one": [pending("1")], "many": [pending("2"), pending("3"), pending("4")]}),
])
def test_order_weighs_demand(first, second, wants):
    # 96 GB: evicting one 48 GB copy reaches the low watermark; which one goes?
    p, d = decide([copy(second, 48, idle=9 * DAY), copy(first, 48, idle=DAY)], wants=wants)
    assert d[first][0] == "evict" and d[second][0] == "keep", d


def test_ties_go_to_the_least_recently_used_then_the_larger():
    p, d = decide([copy("new", 48, idle=DAY), copy("old", 48, idle=2 * DAY)])
    assert d["old"][0] == "evict" and d["new"][0] == "keep"
    p, d = decide([copy("small", 20, idle=DAY), copy("big", 30, idle=DAY), copy("mid", 45, idle=DAY)],
                  wants={"mid": [pending("1")]})
    assert d["big"][0] == "evict" and d["small"][0] == "keep"


def test_among_copies_nothing_wants_the_less_used_goes_first_whatever_the_size():
    # "big" was used more recently on this node, but by fewer jobs in the cluster
    uses = {"often": 12.0, "big": 2.0}
    p = plan([copy("often", 35, idle=3 * DAY), copy("big", 60, idle=HOUR)], Demand(uses=uses, age=10),
             Space(capacity=100 * GB, high=0.9, low=0.75), NOW, node="n1")
    d = {x.copy.dataset: x for x in p.decisions}
    assert d["big"].evict and not d["often"].evict
    assert d["big"].reason == ("over high watermark (90% of 93.1 GiB); no demand; used by 2 jobs in the cluster "
                               "(decayed count, half-life 7 d), idle 1 h")
    assert d["often"].reason.startswith("no demand; used by 12 jobs in the cluster")
    # a pending job's want still comes before any count
    p = plan([copy("often", 48, idle=DAY), copy("rare", 48, idle=DAY)],
             Demand(wants={"rare": [pending("1")]}, uses={"often": 50.0}, age=10),
             Space(capacity=100 * GB, high=0.95, low=0.90), NOW, node="n1")
    assert [x.copy.dataset for x in p.evictions()] == ["often"]


def test_a_stale_snapshot_still_ranks_by_its_counts():
    p = plan([copy("often", 48, idle=3 * DAY), copy("rare", 48, idle=DAY)],
             Demand(wants={"rare": [pending("1")]}, stale=True, age=7200, uses={"often": 5.0, "rare": 0.5}),
             Space(capacity=100 * GB, high=0.95, low=0.90), NOW, node="n1")
    d = {x.copy.dataset: x for x in p.decisions}
    assert d["rare"].evict and "no demand; used by <1 job" in d["rare"].reason
    assert d["often"].reason.startswith("demand unknown (snapshot 2 h old); used by 5 jobs")


def test_stale_snapshot_ranks_by_recency_alone_and_says_so():
    p, d = decide([copy("wanted", 48, idle=3 * DAY), copy("recent", 48, idle=DAY)],
                  wants={"wanted": [pending("1")]}, stale=True)
    assert d["wanted"][0] == "evict" and "no demand" in d["wanted"][1]
    assert "demand unknown" in d["recent"][1]


def test_shared_bytes_are_counted_once_and_freed_with_both_versions():
    old = copy("a", 40, version="0000", current=False)
    new = copy("a", 40, version="1111", shared={"0000": 30 * GB})
    assert used([old, new]) == 50 * GB and used([new]) == 40 * GB and used([old]) == 40 * GB
    p, d = decide([old, new, copy("x", 55, idle=3 * DAY)])  # 105 GB in use
    # the old version goes (rule 2), freeing only its 10 GB of own bytes: 95 GB, still over the high mark
    assert d["a@old"][0] == "evict" and d["x"][0] == "evict" and p.usage_after == 40 * GB


# -- a stage that needs room (the Prolog) ----------------------------------------------------

def test_stage_makes_room_to_fit_only():
    copies = [copy("x", 30, idle=3 * DAY), copy("y", 30, idle=2 * DAY), copy("z", 20, idle=DAY)]
    p, d = decide(copies, need_gb=25)  # 105 GB: evicting x reaches 75 <= 100
    assert [e.copy.dataset for e in p.evictions()] == ["x"] and p.fits
    assert d["x"][1].startswith("room for the stage in progress (23.3 GiB in a tier of 93.1 GiB); no demand")
    # 5 GB over: one copy, not the two it would take to get below the high watermark (90 GB)
    copies = [copy("x", 10, idle=3 * DAY), copy("y", 30, idle=2 * DAY), copy("z", 50, idle=DAY)]
    p, _d = decide(copies, need_gb=15)
    assert [e.copy.dataset for e in p.evictions()] == ["x"] and p.usage_after == 95 * GB


def test_stage_takes_the_headroom_without_evicting():
    # 80 GB of copies and a 15 GB stage: above the high watermark (90 GB), within the capacity.
    # The stage evicts nothing (its Prolog does no eviction work); the next Epilog frees the
    # headroom again, down to the low watermark, off any job's path.
    copies = [copy("x", 30, idle=3 * DAY), copy("y", 30, idle=2 * DAY), copy("z", 20, idle=DAY)]
    p, d = decide(copies, need_gb=15)
    assert not p.evictions() and p.fits and p.usage_after == 95 * GB
    assert Space(100, high=0.9, need=15).over(80) is False and Space(100, high=0.9).over(95) is True
    p, d = decide(copies + [copy("new", 15, idle=0)])
    assert [e.copy.dataset for e in p.evictions()] == ["x"] and p.usage_after <= 75 * GB
    assert d["x"][1].startswith("over high watermark (90% of")


def test_stage_that_cannot_fit_evicts_nothing_and_says_what_holds_the_space():
    copies = [copy("x", 60, leases=("123",)), copy("y", 30, idle=DAY)]
    p, _d = decide(copies, need_gb=50)
    assert not p.evictions() and not p.fits
    assert "x " in p.holding() and "leased by job 123" in p.holding()


def test_stage_protects_the_dataset_it_stages():
    copies = [copy("a", 50, version="0000", current=False), copy("x", 40, idle=DAY)]
    _p, d = decide(copies, need_gb=20, protect=("a",))
    assert d["a@old"] == ("keep", "its files are reused by the stage in progress") and d["x"][0] == "evict"


# -- dsstage evict NAME ----------------------------------------------------------------

def test_asked_eviction_refuses_a_wanted_copy_without_force():
    _p, d = decide([copy("a")], wants={"a": [pending("456")]}, evict=("a",))
    assert d["a"][0] == "keep" and d["a"][1].endswith("not evicted without --force")
    _p, d = decide([copy("a")], wants={"a": [pending("456")]}, evict=("a",), force=True)
    assert d["a"][0] == "evict" and "with --force, although wanted by pending job 456" in d["a"][1]


def test_asked_eviction_never_takes_a_leased_copy():
    _p, d = decide([copy("a", leases=("9",))], evict=("a",), force=True)
    assert d["a"] == ("keep", "leased by job 9")


def test_asked_eviction_of_an_unwanted_copy():
    _p, d = decide([copy("a", idle=60)], evict=("a",))
    assert d["a"] == ("evict", "asked to evict")


def test_wanted_copies_go_only_as_far_as_the_high_watermark():
    # 95 GB; the unwanted y alone leaves 80 (> low 75, <= high 90): the wanted w stays
    p, d = decide([copy("w", 50, idle=5 * DAY), copy("y", 15, idle=DAY), copy("z", 30, leases=("1",))],
                  capacity_gb=100, wants={"w": [pending("456")]})
    assert d["y"][0] == "evict" and d["w"][0] == "keep" and p.usage_after == 80 * GB
    # and when even that is over the high watermark, the wanted copy goes too
    p, d = decide([copy("w", 50, idle=5 * DAY), copy("y", 5, idle=DAY), copy("z", 41, leases=("1",))],
                  capacity_gb=100, wants={"w": [pending("456")]})
    assert d["y"][0] == "evict" and d["w"][0] == "evict" and "wanted by pending job 456" in d["w"][1]


def test_without_any_snapshot_the_reason_says_so():
    p = plan([copy("a")], Demand(stale=True, age=float("inf")), Space(capacity=100 * GB), NOW)
    assert "demand unknown (no snapshot)" in p.decisions[0].reason


def test_a_job_running_on_this_node_is_not_demand_from_other_nodes():
    """The snapshot an Epilog reads was taken while the ending job ran here: it is in it as
    running on this node. Its copy is not "in use on other nodes" (seen on the devcluster:
    ``evicted ry (...; in use by running job 3 on other nodes)`` from job 3's own Epilog, and
    ``dsstage evict rx`` refused after job 6 on n1 ended)."""
    here = Want("7", "running", nodes=("n1",))
    p, d = decide([copy("a", 95)], wants={"a": [here]})
    assert d["a"][0] == "evict" and "other nodes" not in d["a"][1]
    _p, d = decide([copy("a")], wants={"a": [here]}, evict=("a",))
    assert d["a"] == ("evict", "asked to evict")
    _p, d = decide([copy("a")], wants={"a": [here, Want("8", "running", nodes=("n2",))]})
    assert d["a"][1] == "in use by running job 8 on other nodes"


def test_a_shard_copy_counts_only_the_pending_jobs_whose_plan_gives_it_this_node():
    """Two shards of one dataset on n1, over the high watermark; pending job 456, planned on
    n1 and n2, would give n1 shard s1 only (not_for on s2): s2 goes first, with no demand of
    its own, and s1 stays, wanted by the job."""
    s1 = copy("big", 40, version="s1" * 8, idle=2 * DAY)
    s2 = copy("big", 40, version="s2" * 8, idle=3 * DAY, not_for=frozenset({"456"}))
    other = copy("x", 15, idle=5 * DAY)
    p = plan([s1, s2, other], Demand(wants={"big": [pending("456", nodes=("n1", "n2"))], "x": [pending("457")]}),
             Space(capacity=100 * GB, high=0.9, low=0.75), NOW, node="n1")
    got = {d.copy.version: (d.action, d.reason) for d in p.decisions}
    assert got["s2" * 8][0] == "evict" and "no demand" in got["s2" * 8][1], got
    assert got["s1" * 8] == ("keep", "wanted by pending job 456 (partition gpu, expected in 10 min, planned on "
                                     "this node)"), got
    assert got[other.version][0] == "keep"  # wanted here: the shard nobody will read goes instead
    # without what the plan says (the dataset's demand for every shard), both shards count as
    # wanted here, and x, the least recently used, goes instead of the shard nobody will read
    p = plan([s1, copy("big", 40, version="s2" * 8, idle=3 * DAY), other],
             Demand(wants={"big": [pending("456", nodes=("n1", "n2"))], "x": [pending("457")]}),
             Space(capacity=100 * GB, high=0.9, low=0.75), NOW, node="n1")
    assert {d.copy.version: d.action for d in p.decisions} == {"s1" * 8: "keep", "s2" * 8: "keep",
                                                               other.version: "evict"}


def test_a_count_that_has_decayed_a_little_reads_as_whole_jobs():
    """A job counted a minute ago has decayed to 0.9999: one job, not "<1 job"."""
    p = plan([copy("once", 48, idle=DAY), copy("twice", 48, idle=DAY), copy("half", 48, idle=DAY)],
             Demand(uses={"once": 0.9999, "twice": 1.9999, "half": 0.4}, age=10), Space(capacity=100 * GB), NOW,
             node="n1")
    d = {x.copy.dataset: x.reason for x in p.decisions}
    assert "used by 1 job in the cluster" in d["once"]
    assert "used by 2 jobs in the cluster" in d["twice"]
    assert "used by <1 job in the cluster" in d["half"]


# -- the last copy in the cluster (issue 55: peers across jobs make other nodes' copies a source) --

def _copies(**held: tuple[str, ...]) -> dict:
    """dataset -> {version: nodes}, with each dataset's version as ``copy`` makes it."""
    return {name: {copy(name).version: frozenset(nodes)} for name, nodes in held.items()}


def _not_keeper(name: str, holders: tuple[str, ...]) -> str:
    """A node of ``holders`` that is not the one keeper_of picks for ``name``'s copy."""
    pick = keeper_of(name, copy(name).version, holders)
    return next(h for h in holders if h != pick)


def test_a_copy_other_nodes_hold_goes_before_the_last_one_in_the_cluster():
    """Two copies on this node: "a" is the last in the cluster, "b" is held elsewhere too and
    kept there. With the copies known (peers on) the Epilog evicts "b" first, although a job
    planned here soon wants it more (a peer serves b again, only the source a), and keeps "a"
    saying why; without them (peers off, or an older poller) the order is the usual one:
    demand first, so "a" goes."""
    here = _not_keeper("b", ("n1", "n2"))
    other = "n2" if here == "n1" else "n1"
    copies = [copy("a", 50, idle=2 * DAY), copy("b", 50, idle=DAY)]
    wants = {"a": [pending("1", nodes=("n5",))], "b": [pending("2", start_in=60, nodes=(here,))]}
    space = Space(capacity=100 * GB, high=0.9, low=0.75)
    known = plan(copies, Demand(wants=wants, age=10, copies=_copies(a=(here,), b=(here, other))), space, NOW,
                 node=here)
    d = {x.copy.dataset: x for x in known.decisions}
    assert d["b"].evict and not d["a"].evict
    assert d["a"].reason.endswith("; the last copy in the cluster")
    unknown = plan(copies, Demand(wants=wants, age=10), space, NOW, node=here)
    assert [x.copy.dataset for x in unknown.evictions()] == ["a"]


def test_the_last_copy_rule_needs_a_fresh_snapshot():
    """Nothing wants "a" and the cluster has not used it: being the last copy keeps it all the
    same (the next job that asks for it would read the source); on a stale snapshot the copies
    are as old as its queue and count for nothing."""
    copies = [copy("a", 50, idle=2 * DAY), copy("b", 50, idle=DAY)]
    space = Space(capacity=100 * GB, high=0.9, low=0.75)
    node = _not_keeper("b", ("n0", "n1"))
    held = _copies(a=(node,), b=("n0", "n1"))
    idle = plan(copies, Demand(age=10, copies=held), space, NOW, node=node)
    assert [x.copy.dataset for x in idle.evictions()] == ["b"]
    kept = {x.copy.dataset: x.reason for x in idle.decisions}["a"]
    assert kept.startswith("the last copy in the cluster, idle 2 d"), kept
    stale = plan(copies, Demand(age=7200, stale=True, copies=held, uses={"a": 1.0, "b": 1.0}), space, NOW,
                 node=node)
    assert [x.copy.dataset for x in stale.evictions()] == ["a"]


def test_one_holder_keeps_a_version():
    """Two holders of the only copies of two datasets under pressure at once, each the keeper
    of one (keeper_of): each evicts the one the other keeps, so both versions stay; the
    keeper says so."""
    names = [f"d{i}" for i in range(40)]
    a = next(n for n in names if keeper_of(n, copy(n).version, ("n1", "n2")) == "n1")
    b = next(n for n in names if keeper_of(n, copy(n).version, ("n1", "n2")) == "n2")
    copies = [copy(a, 50, idle=2 * DAY), copy(b, 50, idle=DAY)]
    space = Space(capacity=100 * GB, high=0.9, low=0.75)
    held = {**_copies(**{a: ("n1", "n2")}), **_copies(**{b: ("n1", "n2")})}
    plans = {n: {x.copy.dataset: x for x in plan(copies, Demand(age=10, copies=held), space, NOW, node=n).decisions}
             for n in ("n1", "n2")}
    assert [d for d, x in plans["n1"].items() if x.evict] == [b]
    assert [d for d, x in plans["n2"].items() if x.evict] == [a]
    assert plans["n1"][a].reason.startswith("the copy the cluster keeps (on this node, 1 of its 2 holders)")
    assert plans["n1"][b].reason.endswith("; held on 1 other node, idle 1 d"), plans["n1"][b].reason


def test_a_keeper_others_also_hold_goes_before_the_last_copy_and_an_admin_hears_what_they_evict():
    """Among the cluster's copies, one this node keeps but others hold too goes before the last
    copy in the cluster (they still serve it); ``dsstage evict NAME`` of a last copy says so."""
    node = "n1"
    shared = next(n for n in (f"s{i}" for i in range(40)) if keeper_of(n, copy(n).version, (node, "n2")) == node)
    copies = [copy(shared, 50, idle=DAY), copy("last", 50, idle=2 * DAY)]
    held = {**_copies(**{shared: (node, "n2")}), **_copies(last=(node,))}
    p = plan(copies, Demand(age=10, copies=held), Space(capacity=100 * GB, high=0.9, low=0.75), NOW, node=node)
    assert [x.copy.dataset for x in p.evictions()] == [shared]
    asked = plan(copies, Demand(age=10, copies=held), Space(capacity=1000 * GB), NOW, node=node,
                 asked=Asked(evict=("last",)))
    assert [x.reason for x in asked.evictions()] == ["asked to evict; it was the last copy in the cluster"]


def test_the_keeper_of_each_version_is_spread_over_its_holders():
    """Rendezvous hashing: the same pick whatever the order the holders come in; over many
    versions each of 16 nodes keeps about its share (the first by name kept all before); a
    holder that goes moves only the versions it kept."""
    nodes = [f"n{i:03d}" for i in range(16)]
    picks = {f"d{i}": keeper_of(f"d{i}", "ab12", nodes) for i in range(1600)}
    assert all(keeper_of(d, "ab12", list(reversed(nodes))) == p for d, p in picks.items())
    share = {n: sum(1 for p in picks.values() if p == n) for n in nodes}
    assert min(share.values()) > 60 and max(share.values()) < 140, share
    gone = [n for n in nodes if n != "n005"]
    moved = [d for d, p in picks.items() if keeper_of(d, "ab12", gone) != p]
    assert moved and all(picks[d] == "n005" for d in moved)


def test_a_stage_takes_a_recent_copy_other_nodes_hold_before_the_cluster_s_keeper():
    """For a stage that cannot fit otherwise, a copy used a minute ago that another node holds
    and no pending job wants here goes before the last copy in the cluster, idle for days:
    min_keep yields to the keeper rule (a peer serves the recent one again)."""
    node = _not_keeper("r", ("n1", "n2"))
    copies = [copy("last", 40, idle=3 * DAY), copy("r", 40, idle=60)]
    space = Space(capacity=100 * GB, high=0.9, low=0.75, need=40 * GB)
    p = plan(copies, Demand(age=10, copies=_copies(last=(node,), r=("n1", "n2"))), space, NOW, node=node)
    assert [x.copy.dataset for x in p.evictions()] == ["r"] and p.fits
    assert p.evictions()[0].reason.endswith("; held on 1 other node, idle 1 min (within min_keep 10 min, but other "
                                            "nodes hold it: it goes before the copy the cluster keeps)")
    without = plan(copies, Demand(age=10), space, NOW, node=node)
    assert [x.copy.dataset for x in without.evictions()] == ["last"]
