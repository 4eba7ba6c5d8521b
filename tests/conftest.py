"""Shared fixtures. Tests run real components against the embedded model (assembled once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    override = os.environ.get("EMBER_TEST_MODEL")
    if override:
        return Path(override)
    from ember.worker.model.embedded import default_model_path as embedded

    return embedded(quiet=True)
