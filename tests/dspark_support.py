"""The tiny synthetic DeepSeek V4 trunk and its DSpark block drafter (`ember bench make-model --arch deepseek4
--dspark-out`), made and loaded as the test files that hold a drafter to its twin need them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from ember.worker.bench.synth import make_model
from ember.worker.model.dspark_file import DSparkFile, open_dspark_file
from ember.worker.model.loader import Model, open_model
from ember.worker.model.weights import load_weights


class DSparkPair(NamedTuple):
    model: Model  # the trunk
    weights: object  # the trunk's dequantized weights (the numpy backend's)
    file: DSparkFile  # the drafter
    drafter_weights: object  # the drafter's (DSparkFile.weights)


def make_pair(folder: Path) -> tuple[Path, Path]:
    """(the trunk's file, the drafter's file), written into `folder`."""
    drafter = folder / "dspark.gguf"
    return make_model("deepseek4", "tiny", folder / "trunk.gguf", dspark_out=drafter), drafter


def load_pair(trunk: Path, drafter: Path, cache: Path) -> DSparkPair:
    """Both files opened and dequantized, through `cache` as the weights' cache (the test's own)."""
    before = os.environ.get("EMBER_CACHE_DIR")
    os.environ["EMBER_CACHE_DIR"] = str(cache)
    try:
        m = open_model(str(trunk))
        w = load_weights(m.gguf, m.config)
        f = open_dspark_file(drafter, m)
        return DSparkPair(m, w, f, f.weights(w))
    finally:
        if before is None:
            del os.environ["EMBER_CACHE_DIR"]
        else:
            os.environ["EMBER_CACHE_DIR"] = before
