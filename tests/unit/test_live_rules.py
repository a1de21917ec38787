"""``start: at-once`` (dsstage.node.live): which datasets may start at once, what a view may link,
and what `dsstage status` says of a live view."""

from __future__ import annotations

import os
import stat

import pytest
from dsstage.cluster.status_view import _live_text
from dsstage.config import load
from dsstage.errors import ConfigError
from dsstage.node import live


def conf(**top):
    data = {"state_dir": "/shared/dsstage", "tiers": {"nvme": {"path": "/local/{node}", "capacity": "1TB"}},
            "datasets": {"mounted": {"source": "/lustre/a"}, "remote": {"source": "host:/export/b"},
                         "daemon": {"source": "rsync://srv/mod/c"}, "split": {"source": "/lustre/d", "shards": 4}}}
    for name, spec in top.pop("datasets", {}).items():
        data["datasets"][name].update(spec)
    data.update(top)
    return data


def test_by_default_every_dataset_waits():
    c = load.from_dict(conf())
    assert {d.start for d in c.datasets.values()} == {"wait"}
    assert c.start_budget == 1.0


def test_the_sites_default_applies_to_the_mounted_whole_datasets_only():
    c = load.from_dict(conf(start="at-once", start_budget=2))
    assert {n: d.start for n, d in c.datasets.items()} == {"mounted": "at-once", "remote": "wait", "daemon": "wait",
                                                            "split": "wait"}
    assert c.start_budget == 2.0
    c = load.from_dict(conf(start="at-once", datasets={"mounted": {"start": "wait"}}))
    assert c.datasets["mounted"].start == "wait"


@pytest.mark.parametrize(("name", "why"), [("remote", "is not mounted on the nodes"),
                                           ("daemon", "is not mounted on the nodes"),
                                           ("split", "a sharded dataset's part is staged whole")])
def test_at_once_asked_for_a_dataset_a_job_cannot_read_while_it_stages_is_refused(name, why):
    with pytest.raises(ConfigError) as exc:
        load.from_dict(conf(datasets={name: {"start": "at-once"}}), origin="/etc/dsstage/dsstage.yaml")
    assert f"datasets.{name}.start" in str(exc.value) and why in str(exc.value) and "leave start out" in str(exc.value)


@pytest.mark.parametrize(("top", "says"), [({"start": "now"}, "is not one of wait, at-once"),
                                           ({"start_budget": -1}, "is not a number >= 0"),
                                           ({"start_budget": 400}, "is not below prolog_budget (300s)")])
def test_a_wrong_start_setting_is_refused_with_the_fix(top, says):
    with pytest.raises(ConfigError) as exc:
        load.from_dict(conf(**top))
    assert says in str(exc.value)


def fake_stat(mode: int, uid: int = 0) -> os.stat_result:
    return os.stat_result((mode, 1, 1, 1, uid, 0, 10, 0, 0, 0))


@pytest.mark.parametrize(("st", "linked"), [
    (fake_stat(stat.S_IFREG | 0o444), True),
    (fake_stat(stat.S_IFREG | 0o644), False),  # still writable: not sealed yet
    (fake_stat(stat.S_IFREG | 0o444, uid=1000), False),  # not root's
    (fake_stat(stat.S_IFLNK | 0o777), False),
    (fake_stat(stat.S_IFIFO | 0o444), False),
    (fake_stat(stat.S_IFREG | 0o440), True),  # what the dataset's access allows is the top directory's
])
def test_only_a_sealed_regular_file_of_roots_is_linked_into_a_view(st, linked):
    assert live.sealed(st) is linked


def test_status_shows_a_live_views_progress_and_why_it_stopped():
    assert _live_text(None) == ""
    assert _live_text({"files": 400, "local": 120, "state": "filling"}) == "; live 120/400 local"
    assert _live_text({"files": 400, "local": 120, "state": "failed", "reason": "x"}) == "; live 120/400 local, failed"
    assert _live_text({"files": 4, "local": 0, "state": "stopped"}) == "; live 0/4 local, stopped"


def test_a_live_view_is_a_transport_that_wraps_one_whose_files_land_verified():
    """dsstage.node.live.Switching: the switcher begins as the copy does (stager.fill calls
    copy once what an earlier stage left was checked again), what comes wrong is fetched from
    the wrapped transport's origin, and a transport whose files stand unverified at their
    names (rsync, peers) is refused: the view then switches when the version is published."""
    from dsstage.transfer.transport import Area, Copied

    class Inner:
        verified_on_arrival, checks_all = True, False

        def __init__(self):
            self.asked = []

        @property
        def origin(self):
            return self

        def copy(self, entries):
            self.asked.append(list(entries))
            return Copied()

    class Switcher:
        def __init__(self):
            self.began = []

        def begin(self, fd):
            self.began.append(fd)
    inner, switcher = Inner(), Switcher()
    t = live.Switching(inner, switcher, Area(7, "/staging/x"))  # type: ignore[arg-type]
    assert t.verified_on_arrival and not t.checks_all and t.origin is inner
    assert switcher.began == []
    t.copy(["a"])  # type: ignore[list-item]
    assert switcher.began == [7] and inner.asked == [["a"]]
    rsync = Inner()
    rsync.verified_on_arrival = False
    with pytest.raises(ValueError, match="verified as they land"):
        live.Switching(rsync, switcher, Area(7, "/staging/x"))  # type: ignore[arg-type]
