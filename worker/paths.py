"""Where the worker keeps what it derives, never the source tree: the contract's cache and state dirs
(ember.ops.contract: the same ones the daemon and ops use), made private (0700) on first use."""

from __future__ import annotations

from pathlib import Path

from ember.ops import contract


def cache_dir() -> Path:
    """Derived, re-creatable data (assembled model, tokenizer and weight caches)."""
    return contract.private_dir(contract.cache_dir())


def state_dir() -> Path:
    """Data worth keeping across restarts (KV files, crash archive)."""
    return contract.private_dir(contract.state_dir())


def model_cache_dir(fingerprint: str) -> Path:
    """Per-model cache folder, keyed by the model fingerprint so a changed file never hits stale data."""
    return contract.private_dir(cache_dir() / "models" / fingerprint)
