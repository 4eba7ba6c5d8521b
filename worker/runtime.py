"""A loaded model on a backend, and single-sequence helpers on top of it.

`Runtime` ties a Model to a backend and a block allocator. `Sequence` is the simplest client of
the backend interface: it prefills in chunks and decodes one token at a time. The scheduler of the
worker drives many sequences through the same interface; `ember generate` and the correctness tests
use `Sequence` directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .backends.base import Backend, SeqChunk
from .backends.numpy.backend import NumpyBackend
from .engine.kv_blocks import BlockPool
from .engine.sampling import Sampler, SamplingParams
from .model.loader import Model, open_model
from .model.weights import LoadTimer, load_weights

DEFAULT_BLOCK_SIZE = 16
DEFAULT_PREFILL_CHUNK = 256


class Runtime:
    def __init__(self, model: Model, backend: Backend):
        self.model, self.backend = model, backend
        self.config = model.config
        self.allocator = BlockPool(backend.n_blocks, backend.block_size)

    @classmethod
    def load(
        cls, path: str | None, *, backend: str = "numpy", kv_tokens: int = 8192, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> Runtime:
        model = open_model(path)
        if backend != "numpy":
            raise ValueError(f"unknown backend {backend!r} (available: numpy)")
        weights = load_weights(model.gguf, model.config, progress=LoadTimer("ember: preparing weights"))
        n_blocks = max(2, -(-kv_tokens // block_size))
        return cls(model, NumpyBackend(model.config, weights, n_blocks=n_blocks, block_size=block_size))

    def sequence(self) -> Sequence:
        return Sequence(self)


@dataclass
class Sequence:
    runtime: Runtime
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)

    def _ensure_blocks(self, length: int) -> None:
        bs = self.runtime.backend.block_size
        need = -(-length // bs) - len(self.blocks)
        if need > 0:
            self.blocks.extend(self.runtime.allocator.allocate(need))

    def feed(self, new: list[int], *, logits: str = "last", chunk: int = DEFAULT_PREFILL_CHUNK) -> Iterator[np.ndarray]:
        """Append tokens, running the model chunk by chunk; yields each chunk's logits."""
        for i in range(0, len(new), chunk):
            part = new[i : i + chunk]
            start = len(self.tokens)
            self._ensure_blocks(start + len(part))
            mode = logits if (logits == "all" or i + chunk >= len(new)) else "none"
            (out,) = self.runtime.backend.forward(
                [SeqChunk(np.asarray(part, dtype=np.int32), start, self.blocks, mode)]
            )
            self.tokens.extend(part)
            if isinstance(out, np.ndarray):  # a chunk asking for logits (no sampling on the device here)
                yield out

    def prefill(self, new: list[int]) -> np.ndarray:
        *_, last = self.feed(new, logits="last")
        return last[-1]

    def close(self) -> None:
        self.runtime.allocator.release(self.blocks)
        self.blocks = []


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes from the prefill's logits, so decode steps = generated - 1
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0


def generate(
    runtime: Runtime, prompt: list[int], params: SamplingParams, max_tokens: int, stats: GenerationStats | None = None
) -> Iterator[int]:
    """Yield sampled token ids until an end-of-generation token or max_tokens."""
    stats = stats if stats is not None else GenerationStats()
    seq = runtime.sequence()
    sampler = Sampler(params)
    stop_ids = runtime.model.tokenizer.eot_ids
    ctx = runtime.config.context_length
    try:
        t0 = time.perf_counter()
        logits = seq.prefill(prompt)
        stats.prompt_tokens, stats.prefill_s = len(prompt), time.perf_counter() - t0
        t1 = time.perf_counter()
        history = list(prompt)
        for i in range(max_tokens):
            token = sampler.sample(logits, history)
            if token in stop_ids:
                break
            history.append(token)
            stats.generated_tokens += 1
            yield token
            if i + 1 >= max_tokens or len(seq.tokens) + 1 >= ctx:
                break
            (logits,) = seq.feed([token])
            logits = logits[-1]
            stats.decode_s = time.perf_counter() - t1
    finally:
        seq.close()


__all__ = ["Runtime", "Sequence", "generate", "open_model", "GenerationStats"]
