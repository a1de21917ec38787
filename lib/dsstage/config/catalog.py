"""The dataset catalog as users meet it: parsing ``--dataset`` values, names, access."""

from __future__ import annotations

import difflib
import grp
import os
import pwd
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dsstage.config.model import Config, Dataset
from dsstage.config.names import check_name
from dsstage.errors import AccessDenied, UnknownDataset
from dsstage.fs.groups import group_names
from dsstage.fs.layout import BLANKS, REQUEST_MAX

#: the longest --dataset value accepted (the same bound is in the generated Lua catalog)
VALUE_MAX = REQUEST_MAX  # the rule of dsstage.ready.request, with messages (tests/unit/test_name_rule.py)


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    groups: frozenset[str]

    @classmethod
    def lookup(cls, who: str | int | None = None) -> User:
        """The user by name or uid (default: the caller), with all of their group names."""
        try:
            if who is None:
                pw = pwd.getpwuid(os.getuid())
            elif isinstance(who, int) or str(who).isdigit():
                pw = pwd.getpwuid(int(who))
            else:
                pw = pwd.getpwnam(str(who))
        except KeyError:
            raise AccessDenied(f"unknown user {who!r}: this node's passwd database does not know it") from None
        return cls(name=pw.pw_name, uid=pw.pw_uid, groups=frozenset(group_names(pw.pw_name, pw.pw_gid)))


def parse_request(value: str) -> list[str]:
    """Split a ``--dataset`` value (``a,b``) into names; raises UnknownDataset when malformed."""
    if value is None or not value.strip(BLANKS):
        raise UnknownDataset("--dataset is empty: name at least one dataset (see `dsstage ls`)")
    if len(value) > VALUE_MAX:
        raise UnknownDataset(f"--dataset value is {len(value)} characters long; at most {VALUE_MAX} are accepted")
    names: list[str] = []
    for part in value.split(","):
        name = part.strip(BLANKS)
        problem = check_name(name)
        if problem:
            raise UnknownDataset(f"--dataset: {problem}")
        if name not in names:
            names.append(name)
    return names


def suggest(name: str, known: list[str]) -> str:
    """A ' (did you mean X?)' suffix, or ''."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def lookup(config: Config, name: str) -> Dataset:
    """The catalog entry for ``name``; UnknownDataset with a suggestion otherwise."""
    problem = check_name(name)
    if problem:
        raise UnknownDataset(problem)
    try:
        return config.datasets[name]
    except KeyError:
        raise UnknownDataset(f"unknown dataset {name!r}{suggest(name, sorted(config.datasets))}; "
                             "`dsstage ls` lists the catalog") from None


def may_use(dataset: Dataset, user: User) -> bool:
    """Whether ``user`` may use ``dataset`` (root always may)."""
    return dataset.groups is None or user.uid == 0 or bool(user.groups & set(dataset.groups))


@dataclass(frozen=True)
class Members:
    """Who is in a set of groups, as uids, and what could not be resolved."""

    uids: frozenset[int]
    missing_groups: tuple[str, ...]  # no such group (or the directory service did not answer)
    unknown_users: tuple[str, ...]  # listed as a group's member, unknown to passwd


def group_members(groups: Iterable[str], passwd: Iterable[Any], *,
                  getgrnam: Callable[[str], Any] = grp.getgrnam,
                  getpwnam: Callable[[str], Any] = pwd.getpwnam) -> Members:
    """The uids of everyone in any of ``groups``: each group's listed members, and every
    ``passwd`` entry (``pwd.getpwall()``, read once by the caller) whose primary group it is.

    Used where slurmctld must not look anyone up itself (job_submit.lua); the lookups are
    arguments so that tests pass plain data."""
    uids: set[int] = set()
    gids: set[int] = set()
    missing: list[str] = []
    unknown: list[str] = []
    for name in groups:
        try:
            group = getgrnam(name)
        except KeyError:
            missing.append(name)
            continue
        gids.add(group.gr_gid)
        for member in group.gr_mem:
            try:
                uids.add(getpwnam(member).pw_uid)
            except KeyError:
                unknown.append(member)
    uids.update(entry.pw_uid for entry in passwd if entry.pw_gid in gids)
    return Members(frozenset(uids), tuple(missing), tuple(dict.fromkeys(unknown)))


def authorize(dataset: Dataset, user: User) -> None:
    if not may_use(dataset, user):
        raise AccessDenied(f"dataset {dataset.name!r} is restricted to group(s) {', '.join(dataset.groups or ())}; "
                           f"user {user.name!r} is in none of them: ask the dataset's owners for access")


def resolve(config: Config, value: str, user: User) -> list[Dataset]:
    """Parse a request, look every name up and check the user may use it."""
    datasets = [lookup(config, name) for name in parse_request(value)]
    for ds in datasets:
        authorize(ds, user)
    return datasets
