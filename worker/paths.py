"""Where the worker keeps what it derives: XDG cache and state dirs, never the source tree."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Derived, re-creatable data (assembled model, tokenizer and weight caches)."""
    base = os.environ.get("EMBER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ember"
    )
    return _private_dir(Path(base))


def state_dir() -> Path:
    """Data worth keeping across restarts (KV files, crash archive)."""
    base = os.environ.get("EMBER_STATE_DIR") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "ember"
    )
    return _private_dir(Path(base))


def model_cache_dir(fingerprint: str) -> Path:
    """Per-model cache folder, keyed by the model fingerprint so a changed file never hits stale data."""
    return _private_dir(cache_dir() / "models" / fingerprint)


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path
