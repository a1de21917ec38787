import grp
import pwd

import pytest
from dsstage.config import catalog, load
from dsstage.config.catalog import User
from dsstage.errors import AccessDenied, UnknownDataset

CONF = load.from_dict({
    "state_dir": "/s", "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}},
    "datasets": {"imagenet22t": {"source": "/d/i", "groups": ["ml", "vision"]}, "coco": {"source": "/d/c"}}})

ALICE = User("alice", 1000, frozenset({"alice", "ml"}))
BOB = User("bob", 1001, frozenset({"bob"}))


def test_parse_request():
    assert catalog.parse_request("imagenet22t, coco,coco") == ["imagenet22t", "coco"]


@pytest.mark.parametrize("value,needle", [
    ("", "--dataset is empty"), (" , ", "must be a non-empty"), ("a" * 2000, "at most 1024"),
    ("coco;rm -rf /", "is not allowed"), ("../etc", "is not allowed"), ("COCO", "is not allowed"),
])
def test_malformed_requests(value, needle):
    with pytest.raises(UnknownDataset, match=needle):
        catalog.parse_request(value)


def test_unknown_dataset_suggests():
    with pytest.raises(UnknownDataset, match=r"unknown dataset 'imagenet22k' \(did you mean 'imagenet22t'\?\)"):
        catalog.resolve(CONF, "imagenet22k", ALICE)


def test_group_access():
    assert [d.name for d in catalog.resolve(CONF, "imagenet22t,coco", ALICE)] == ["imagenet22t", "coco"]
    with pytest.raises(AccessDenied, match=r"restricted to group\(s\) ml, vision; user 'bob' is in none"):
        catalog.resolve(CONF, "coco,imagenet22t", BOB)
    assert catalog.may_use(CONF.datasets["imagenet22t"], User("root", 0, frozenset()))


def test_user_lookup():
    root = User.lookup(0)
    assert root.name == "root" and "root" in root.groups
    with pytest.raises(AccessDenied, match="unknown user"):
        User.lookup("no-such-user-dsstage")


def test_group_members_are_listed_members_and_primary_groups():
    groups = {"ml": grp.struct_group(("ml", "x", 2000, ["alice", "ghost", "ghost"])),
              "vision": grp.struct_group(("vision", "x", 2001, ["alice"]))}
    users = {n: pwd.struct_passwd((n, "x", uid, gid, "", "/", "/bin/sh"))
             for n, uid, gid in [("alice", 1000, 1000), ("bob", 1001, 1001), ("carol", 1002, 2001)]}
    members = catalog.group_members(["ml", "vision", "nosuch"], users.values(),
                                    getgrnam=groups.__getitem__, getpwnam=users.__getitem__)
    assert members.uids == {1000, 1002}
    assert members.missing_groups == ("nosuch",) and members.unknown_users == ("ghost",)
    assert catalog.group_members([], users.values()).uids == frozenset()


def test_group_members_with_the_system_lookups():
    root = catalog.group_members(["root"], pwd.getpwall())
    assert 0 in root.uids and not root.missing_groups
