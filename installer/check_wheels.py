"""Whether every package of the locked set (installer/requirements.lock) has a wheel for a platform:
linux on x86_64 or aarch64 (DGX Spark, Grace), a CPython version, and a glibc no newer than the
oldest distribution ember supports. pip resolves the pinned set for that platform without installing
anything (--dry-run, wheels only); where one package has no wheel, this names it in one line and exits 1.

    python installer/check_wheels.py --arch aarch64 --python 3.11 3.12

Standard library only: CI runs it before ember is installed, and a user can run it on any machine.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LOCK = Path(__file__).resolve().parent / "requirements.lock"
# Ubuntu 22.04's glibc: the oldest distribution the installer supports (DGX OS 7 is Ubuntu 24.04, 2.39)
DEFAULT_GLIBC = (2, 35)
_MISSING = re.compile(r"No matching distribution found for (\S+)")


def platform_tags(arch: str, glibc: tuple[int, int]) -> list[str]:
    """Every manylinux tag a machine with this glibc accepts (pip does not widen --platform itself)."""
    major, minor = glibc
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(17, minor + 1)]
    return tags + [f"manylinux2014_{arch}", f"linux_{arch}"]


def missing_package(pip_output: str) -> str | None:
    """The pinned requirement pip found no wheel for, from its error output."""
    m = _MISSING.search(pip_output)
    return m.group(1) if m else None


def check(lock: Path, arch: str, python: str, glibc: tuple[int, int]) -> tuple[bool, str]:
    """(ok, one line) for one platform."""
    where = f"linux-{arch}, CPython {python}, glibc <= {glibc[0]}.{glibc[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--no-deps",
               "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
               "--target", str(Path(tmp) / "target"), "--report", str(report), "-r", str(lock)]
        for tag in platform_tags(arch, glibc):
            cmd += ["--platform", tag]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            name = missing_package(run.stderr)
            if name:
                return False, f"{name} has no wheel for {where}"
            tail = run.stderr.strip().splitlines()[-1:] or ["(no output)"]
            return False, f"pip could not resolve the locked set for {where}: {tail[0]}"
        wheels = json.loads(report.read_text())["install"]
    native = sum("none-any" not in w["download_info"]["url"] for w in wheels)
    return True, f"{where}: all {len(wheels)} locked packages have wheels ({native} built for the platform)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lock", type=Path, default=LOCK, help=f"the locked set (default {LOCK.name})")
    p.add_argument("--arch", nargs="+", default=["x86_64", "aarch64"], help="machines (default x86_64 aarch64)")
    p.add_argument("--python", nargs="+", default=["3.11", "3.12"], help="CPython versions (default 3.11 3.12)")
    p.add_argument("--glibc", default="{}.{}".format(*DEFAULT_GLIBC), help="the oldest glibc to cover")
    args = p.parse_args(argv)
    try:
        glibc = tuple(int(x) for x in args.glibc.split("."))
        if len(glibc) != 2:
            raise ValueError
    except ValueError:
        p.error(f"--glibc takes MAJOR.MINOR, not {args.glibc!r}")
    if not args.lock.is_file():
        print(f"check_wheels: no lock file at {args.lock}", file=sys.stderr)
        return 2
    failed = False
    for arch in args.arch:
        for python in args.python:
            ok, line = check(args.lock, arch, python, (glibc[0], glibc[1]))
            print(("ok: " if ok else "check_wheels: ") + line, file=sys.stdout if ok else sys.stderr)
            failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
