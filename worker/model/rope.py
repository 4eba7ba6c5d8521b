"""RoPE frequencies, decided once per model for both backends: the global layers' (with linear or
YaRN scaling and a file's per-dimension factors) and the sliding-window layers' own.

YaRN as llama.cpp computes it (ggml's rope_yarn): dimension pair i turns at theta_i = base^(-2i/d);
pairs that turn fast (many times over the trained context) keep it, slow ones are interpolated by
1/factor, and a linear ramp between the corr dims (beta_fast, beta_slow turns; 32 and 1 by default)
blends the two. Every cos and sin is scaled by attn_factor (1 + 0.1 ln(factor)).
"""

from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig, Yarn


def _yarn_corr_dim(n_dims: int, n_ctx_orig: int, turns: float, base: float) -> float:
    return n_dims * math.log(n_ctx_orig / (turns * 2 * math.pi)) / (2 * math.log(base))


def yarn_factors(n_dims: int, base: float, yarn: Yarn) -> tuple[np.ndarray, float]:
    """(per-pair multipliers of the frequencies, the cos/sin scale) of YaRN."""
    low = max(0.0, math.floor(_yarn_corr_dim(n_dims, yarn.n_ctx_orig, yarn.beta_fast, base)))
    high = min(n_dims - 1.0, math.ceil(_yarn_corr_dim(n_dims, yarn.n_ctx_orig, yarn.beta_slow, base)))
    pair = np.arange(n_dims // 2, dtype=np.float64)
    # 1: extrapolate (keep the frequency), 0: interpolate by 1/factor
    ramp = (1.0 - np.clip((pair - low) / max(0.001, high - low), 0.0, 1.0)) * yarn.ext_factor
    mscale = yarn.attn_factor * (1.0 + 0.1 * math.log(yarn.factor) if yarn.ext_factor != 0.0 else 1.0)
    return (1.0 / yarn.factor) * (1.0 - ramp) + ramp, mscale


def inv_frequencies(config: ModelConfig,
                    freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """(global layers' inverse frequencies, local layers', the cos/sin scale) in float64; freq_factors:
    a file's rope_freqs tensor (llama 3.1), dividing the global frequencies."""
    d = config.head_dim
    exponents = np.arange(d // 2, dtype=np.float64) * 2.0 / d
    inv_global = config.rope_scale / (config.rope_base**exponents)
    if freq_factors is not None:
        inv_global = inv_global / np.asarray(freq_factors, np.float64)
    inv_local = 1.0 / (config.rope_base_local**exponents)
    mscale = 1.0
    if config.rope_yarn is not None:
        mult, mscale = yarn_factors(d, config.rope_base, config.rope_yarn)
        inv_global = inv_global * mult
        if config.rope_yarn.local:
            inv_local = inv_local * mult
    return inv_global, inv_local, mscale
