"""The engine's limits: what the server sizes for this model and device, and the settings it takes as
configured (config.EngineSettings: the loop guard and speculative decoding, declared once there)."""

from __future__ import annotations

from ..config import EngineSettings


class EngineLimits(EngineSettings, kw_only=True):
    max_seqs: int = 8
    max_queue: int = 64
    max_step_tokens: int = 512  # tokens per backend step (decode tokens + prefill chunks)
    prefill_chunk: int = 256  # fixed, or the most when sized to the decode-latency target (itl_target_s)
    itl_target_s: float | None = None  # size each step's prefill so that decoding streams wait about this long
    context: int = 8192
    # the loop guard's longest block: a block of up to this many tokens repeated back to back
    # max(loop_guard_repeats, loop_guard_min_span / length) times is a loop (see WorkerConfig.loop_guard)
    loop_guard_period: int = 64

    @classmethod
    def configured(cls, settings: EngineSettings, **limits) -> EngineLimits:
        """These limits with the engine's settings as `settings` has them (a WorkerConfig)."""
        return cls(**{name: getattr(settings, name) for name in EngineSettings.__struct_fields__}, **limits)
