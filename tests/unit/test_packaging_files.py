"""The packaging's files agree with the code: the units run commands dsstage has, every
timer has its service, and the RPM spec parses, has dsstage's version and lists every unit.
(The .deb is built, installed and run by packaging/run-tests; see tests/cluster/test_package.py.)"""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import dsstage
import pytest
from dsstage.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "packaging" / "systemd"
SPEC = ROOT / "packaging" / "dsstage.spec"


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


@pytest.mark.parametrize("service", sorted(UNITS.glob("*.service")), ids=lambda p: p.name)
def test_a_service_runs_a_dsstage_command_that_exists(service: Path):
    argv = shlex.split(unit(service)["Service"]["ExecStart"])
    assert argv[0] == "/usr/bin/dsstage", "where both packages install the command"
    args = build_parser().parse_args(argv[1:])  # exits (SystemExit) on an unknown verb or option
    assert callable(getattr(args, "handler", None)), argv


@pytest.mark.parametrize("timer", sorted(UNITS.glob("*.timer")), ids=lambda p: p.name)
def test_a_timer_has_its_service_and_a_schedule(timer: Path):
    service = timer.with_suffix(".service")
    assert service.exists()
    assert "Install" not in unit(service), "the timer starts it; it is not enabled on its own"
    sections = unit(timer)
    assert {"OnUnitActiveSec", "OnCalendar"} & set(sections["Timer"]) and \
        sections["Install"]["WantedBy"] == "timers.target"


def test_the_rpm_spec_parses_with_dsstage_s_version_and_every_unit():
    if not shutil.which("rpmspec"):
        pytest.fail("rpmspec is missing: install the rpm package (packaging/run-tests does)")
    res = subprocess.run(["rpmspec", "-P", str(SPEC)], text=True, capture_output=True)
    assert res.returncode == 0, res.stderr
    version = re.search(r"^Version:\s*(\S+)$", res.stdout, re.M)
    assert version and version.group(1) == dsstage.__version__.replace(".dev", "~dev")  # ~: before the release
    files = res.stdout.split("\n%files", 1)[1]
    for path in UNITS.iterdir():
        assert re.search(r"^/usr/lib/systemd/system/dsstage-\*\." + path.suffix[1:] + "$", files, re.M), path.name
    assert "%config(noreplace) /etc/dsstage/dsstage.yaml" in files


LOCK = ROOT / "packaging" / "requirements.lock"


def locked() -> dict[str, tuple[str, list[str]]]:
    """The lock's packages: normalized name -> (version, its hashes)."""
    out: dict[str, tuple[str, list[str]]] = {}
    text = LOCK.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", line)
        assert m, f"packaging/requirements.lock: not a pinned, hashed requirement: {line[:80]!r}"
        out[re.sub(r"[-_.]+", "-", m.group(1).lower())] = (m.group(2), re.findall(r"[0-9a-f]{64}", m.group(3)))
    return out


def test_the_lock_pins_every_runtime_dependency_at_a_version_pyproject_allows():
    """packaging/requirements.lock (packaging/lock-deps) pins each dependency of pyproject.toml,
    with hashes, at a version its specifier allows: a dependency added or raised without a new
    lock would leave the packages' venv without it, or hash-checking would refuse the build."""
    import tomllib
    from packaging.requirements import Requirement
    pins = locked()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        req = Requirement(dep)
        name = re.sub(r"[-_.]+", "-", req.name.lower())
        assert name in pins, f"{req.name} is not in packaging/requirements.lock: run packaging/lock-deps"
        version, hashes = pins[name]
        assert req.specifier.contains(version, prereleases=True), \
            f"{req.name}=={version} in the lock does not satisfy {dep!r}: run packaging/lock-deps"
        assert hashes


def test_both_packages_install_the_lock_and_the_rpm_ships_the_native_helper():
    rules = (ROOT / "packaging" / "debian" / "rules").read_text()
    assert "--requirements=packaging/requirements.lock" in rules
    spec = SPEC.read_text()
    assert "--require-hashes -r packaging/requirements.lock" in spec and "--no-deps ." in spec
    assert re.search(r"^%make_build -C native ", spec, re.M)
    assert "make -C native install DESTDIR=%{buildroot} LIBEXEC_DIR=%{_libexecdir}/dsstage" in spec
    from dsstage.transfer import native
    assert native.LIBEXEC == "/usr/libexec/dsstage"  # where the RPM puts it (%{_libexecdir} is /usr/libexec)


def test_the_plugin_builds_against_a_slurm_built_from_source(tmp_path: Path):
    """A site whose Slurm is built from source (./configure --prefix=DIR) builds the SPANK plugin
    with `make -C sbatch_ext SLURM_PREFIX=DIR install`: its headers, its lib/slurm. Emulated with
    a prefix holding a copy of this machine's slurm headers and nothing of Debian's paths."""
    headers = Path("/usr/include/slurm")
    if not (headers / "spank.h").exists():
        pytest.fail("slurm/spank.h is missing: install libslurm-dev (packaging/run-tests does)")
    prefix = tmp_path / "opt" / "slurm"
    shutil.copytree(headers, prefix / "include" / "slurm")
    src = tmp_path / "sbatch_ext"
    shutil.copytree(ROOT / "sbatch_ext", src, ignore=shutil.ignore_patterns("*.so", "plugstack.conf"))
    for hook in ("prolog", "epilog"):
        shutil.copytree(ROOT / hook, tmp_path / hook)
    dry = subprocess.run(["make", "-n", "-C", str(src), f"SLURM_PREFIX={prefix}", "dsstage_spank.so"],
                         text=True, capture_output=True)
    assert dry.returncode == 0 and f"-I{prefix}/include" in dry.stdout, dry.stdout + dry.stderr
    dest = tmp_path / "dest"
    res = subprocess.run(["make", "-C", str(src), f"SLURM_PREFIX={prefix}", f"DESTDIR={dest}", "install"],
                         text=True, capture_output=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (dest / str(prefix / "lib" / "slurm" / "dsstage_spank.so").lstrip("/")).is_file()
    line = [x for x in (src / "plugstack.conf").read_text().splitlines() if x and not x.startswith("#")]
    assert line == [f"optional {prefix}/lib/slurm/dsstage_spank.so"], line


def test_the_dsstage_package_installs_beside_a_slurm_built_from_source():
    """A site whose Slurm is not Debian's installs the dsstage package (no Slurm package among
    what it depends on: slurm-client is only recommended) and builds the plugin itself; only
    dsstage-spank is tied to Debian's Slurm."""
    stanzas = (ROOT / "packaging" / "debian" / "control").read_text().split("\n\n")
    dsstage_pkg = next(s for s in stanzas if re.search(r"^Package: dsstage$", s, re.M))
    depends = re.search(r"^Depends:(.*?)(?=^\S)", dsstage_pkg + "\nEnd:", re.M | re.S)
    assert depends and "slurm" not in depends.group(1).lower(), depends
    assert re.search(r"^Recommends:.*slurm-client", dsstage_pkg, re.M)
    install = (ROOT / "docs" / "install.md").read_text()
    assert "make -C sbatch_ext SLURM_PREFIX=/opt/slurm install" in install
