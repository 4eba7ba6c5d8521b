"""The layout the project card fixes, and the import rules of docs/architecture.md."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_python_package_folder_is_packaged():
    cfg = _pyproject()["tool"]["setuptools"]
    mapping = cfg["package-dir"]
    declared = set(cfg["packages"])
    for top, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([top, *rel.parts]) if rel.parts else top
            assert name in declared, f"{init.parent} is not listed in pyproject's packages"


def test_card_folders_exist():
    for folder in ("daemon", "worker", "kernels", "ops", "tests"):
        assert (ROOT / folder).is_dir()


def _imports_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_daemon_never_imports_the_worker_or_cuda():
    loaded = _imports_after("ember.daemon.cli")
    assert not {m for m in loaded if m.startswith(("ember.worker", "ember.kernels", "cuda"))}


def test_kernels_import_nothing_of_the_worker():
    loaded = _imports_after("ember.kernels.reference, ember.kernels.quants")
    assert not {m for m in loaded if m.startswith(("ember.worker", "ember.daemon"))}


def test_cli_help_and_version():
    out = subprocess.run([sys.executable, "-m", "ember.daemon.cli_main", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "generate" in out.stdout
    v = subprocess.run([sys.executable, "-m", "ember.daemon.cli_main", "--version"], capture_output=True, text=True)
    assert v.returncode == 0 and v.stdout.startswith("ember ")
    bad = subprocess.run([sys.executable, "-m", "ember.daemon.cli_main", "frobnicate"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command" in bad.stderr and "Traceback" not in bad.stderr


def test_worker_verbs_reach_the_worker():
    out = subprocess.run([sys.executable, "-m", "ember.daemon.cli_main", "generate", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "--max-tokens" in out.stdout
    out = subprocess.run([sys.executable, "-m", "ember.daemon.cli_main", "bench", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "make-model" in out.stdout and "speed" in out.stdout
