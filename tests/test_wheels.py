"""The locked dependency set (installer/requirements.lock) and the wheel check CI runs over it
(installer/check_wheels.py: every locked package has a wheel for linux-x86_64 and linux-aarch64)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "installer"))
import check_wheels  # noqa: E402


def _locked() -> dict[str, list[str]]:
    """name -> the versions pinned (a package may have one per marker, numpy by Python version)."""
    out: dict[str, list[str]] = {}
    for line in (ROOT / "installer" / "requirements.lock").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9._-]+)==([^ ;]+)", line)
        if m:
            out.setdefault(canonicalize_name(m.group(1)), []).append(m.group(2))
    return out


def test_the_lock_pins_every_dependency_within_pyproject_ranges():
    """A dependency added or narrowed in pyproject.toml without regenerating the lock fails here."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["cuda"]]
    locked = _locked()
    for req in wanted:
        versions = locked.get(canonicalize_name(req.name))
        assert versions, f"{req.name} is not in installer/requirements.lock: regenerate it (see its header)"
        for v in versions:
            assert req.specifier.contains(v, prereleases=True), f"{req.name}=={v} is outside {req}"


def test_platform_tags_cover_every_older_glibc():
    tags = check_wheels.platform_tags("aarch64", (2, 35))
    assert tags[0] == "manylinux_2_17_aarch64" and "manylinux_2_28_aarch64" in tags
    assert "manylinux_2_35_aarch64" in tags and "manylinux_2_36_aarch64" not in tags
    assert "manylinux2014_aarch64" in tags


def test_a_missing_wheel_is_named():
    err = ("ERROR: Could not find a version that satisfies the requirement llguidance==1.9.1 (from versions: 1.6.0)\n"
           "ERROR: No matching distribution found for llguidance==1.9.1\n")
    assert check_wheels.missing_package(err) == "llguidance==1.9.1"
    assert check_wheels.missing_package("ERROR: something else") is None


def test_a_bad_glibc_is_a_usage_error(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        check_wheels.main(["--glibc", "two"])
    assert e.value.code == 2 and "--glibc takes MAJOR.MINOR" in capsys.readouterr().err
