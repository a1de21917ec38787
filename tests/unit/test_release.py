"""Versions and releases: ``dsstage.__version__``, CHANGELOG.md's headings and
packaging/releases agree, and ``packaging/release`` tags a release and opens the next one."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import dsstage
import pytest
from helpers import releases

TOP = Path(__file__).resolve().parents[2]
VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.dev(\d+))?$")


def _key(version: str) -> tuple[int, ...]:
    m = VERSION.match(version)
    assert m, f"{version!r} is not MAJOR.MINOR.PATCH[.devN]"
    return tuple(int(x) for x in m.groups()[:3])


def headings(top: Path = TOP) -> list[str]:
    return re.findall(r"^## (.+)$", (top / "CHANGELOG.md").read_text(), re.M)


def test_the_version_the_changelog_and_the_list_of_releases_agree():
    listed = releases()
    for version, commit, day in listed:
        assert re.fullmatch(r"[0-9a-f]{40}", commit) and re.fullmatch(r"\d{4}-\d\d-\d\d", day)
        assert f"{version} ({day})" in headings(), f"CHANGELOG.md has no '## {version} ({day})' section"
    assert [_key(v) for v, _, _ in listed] == sorted({_key(v) for v, _, _ in listed}), "releases in order, once"
    if (TOP / ".git").exists():  # each release's tag, where this clone has it, is the commit listed
        for version, commit, _ in listed:
            tag = subprocess.run(["git", "-C", str(TOP), "rev-parse", "-q", "--verify", f"v{version}^{{commit}}"],
                                 capture_output=True, text=True)
            assert tag.returncode != 0 or tag.stdout.strip() == commit, f"v{version} is not {commit}"
    previous = listed[-1][0] if listed else "0.1.0"  # 0.1.0 was never tagged
    top = headings()[0]
    m = VERSION.match(dsstage.__version__)
    assert m, dsstage.__version__
    if m.group(4) is not None:  # main between releases: NEXT.devN, after the last release
        assert top == f"Unreleased (after {previous})"
        assert _key(dsstage.__version__) > _key(previous)
    else:  # the release commit itself
        assert re.fullmatch(rf"{re.escape(dsstage.__version__)} \(\d{{4}}-\d\d-\d\d\)", top)


def _git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.org", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.org")
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


@pytest.mark.skipif(shutil.which("git") is None or not (TOP / ".git").exists(),
                    reason="needs a git checkout (the README's test command runs in one)")
def test_packaging_release_tags_the_release_and_opens_the_next(tmp_path: Path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(TOP), str(clone)], check=True)
    before = _git(clone, "rev-parse", "HEAD").strip()
    current = _key(re.sub(r"\.dev\d+$", "", dsstage.__version__))
    version = f"{current[0]}.{current[1] + 5}.0"  # after anything this tree could have released
    nxt = f"{current[0]}.{current[1] + 6}.0"
    env = dict(os.environ, DSSTAGE_VENV=sys.prefix, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.org",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.org")
    res = subprocess.run([str(clone / "packaging" / "release"), version, nxt], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    tagged = _git(clone, "rev-parse", f"v{version}^{{commit}}").strip()
    assert _git(clone, "rev-list", "--parents", "-n1", tagged).split()[1] == before
    assert _git(clone, "show", f"{tagged}:lib/dsstage/__init__.py").count(f'__version__ = "{version}"') == 1
    spec = _git(clone, "show", f"{tagged}:packaging/dsstage.spec")
    assert re.search(rf"^Version:\s+{re.escape(version)}$", spec, re.M)
    assert re.search(rf"^Version:\s+{re.escape(nxt)}~dev0$", (clone / "packaging/dsstage.spec").read_text(), re.M)
    v = re.escape(version)
    assert re.search(rf"^\* .* - {v}-1\n- Release {v}: see CHANGELOG.md.$", spec, re.M)
    assert f'"dsstage {version}"' in _git(clone, "show", f"{tagged}:packaging/man/dsstage.1").splitlines()[0]
    released = re.findall(r"^## (.+)$", _git(clone, "show", f"{tagged}:CHANGELOG.md"), re.M)[0]
    assert re.fullmatch(rf"{re.escape(version)} \(\d{{4}}-\d\d-\d\d\)", released)
    # then main is at NEXT.dev0, the release listed with its commit, the changelog reopened
    assert (clone / "lib/dsstage/__init__.py").read_text().count(f'__version__ = "{nxt}.dev0"') == 1
    assert releases(clone)[-1][:2] == (version, tagged)
    assert headings(clone)[:2] == [f"Unreleased (after {version})", released]
    assert _git(clone, "status", "--porcelain") == ""
    # the release commit and main after it each pass the check above, as this tree does
    assert f'"dsstage {nxt}.dev0"' in (clone / "packaging/man/dsstage.1").read_text().splitlines()[0]
    again = subprocess.run([str(clone / "packaging" / "release"), version, nxt], cwd=clone, env=env,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and f"v{version} is tagged already" in again.stderr
