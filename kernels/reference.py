"""Numpy twins of the compute kernels: the reference math every device kernel must reproduce.

All functions take and return float32 arrays. numpy 2 keeps float32 when mixed with Python
scalars, but not with numpy float64 scalars or arrays, so constants are cast explicitly.
"""

from __future__ import annotations

import math

import numpy as np

from .constants import KERNEL_FLOATS

_SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    ms = np.add.reduce(x * x, axis=-1, keepdims=True) * np.float32(1.0 / x.shape[-1])
    return (x * (1.0 / np.sqrt(ms + np.float32(eps)))) * weight


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x [n, in] @ weight[out, in].T (+ bias): the matmul every projection uses."""
    y = x @ weight.T
    return y + bias if bias is not None else y


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., cols] (cols a multiple of 32) -> (q int8 [..., cols], d float32 [..., cols / 32]): per
    32 columns, d = max|x| / 127 and q = round-half-away(x * (1 / d)) in float32, as the int8 matvecs
    (matvec_k.cu kq8) and ggml's q8_0 / q8_1 quantize their input (d itself stays float32 here)."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = np.max(np.abs(blocks), axis=-1) / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    scaled = blocks * inv[..., None]
    mag = np.abs(scaled)
    whole = np.floor(mag)
    q = (np.sign(scaled) * (whole + np.floor(2 * (mag - whole)))).astype(np.int8)  # exact roundf
    return q.reshape(x.shape), d.astype(np.float32)


def dequantize_q8(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The values an int8-quantized x stands for (float64: q * d is exact there)."""
    blocks = q.astype(np.float64).reshape(*q.shape[:-1], -1, 32) * d.astype(np.float64)[..., None]
    return blocks.reshape(q.shape)


def linear_q8(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """What an int8-activation matvec computes: x quantized per 32 columns, times weight (float64)."""
    return (dequantize_q8(*quantize_q8(x)) @ np.asarray(weight, dtype=np.float64).T)


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [n, head_dim/2] for the given positions, times `scale` (YaRN's); angles in float64 for
    long contexts."""
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return (np.cos(angles) * scale).astype(np.float32), (np.sin(angles) * scale).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, neox: bool) -> np.ndarray:
    """Rotary embedding of x [n, heads, head_dim]. neox rotates (i, i + d/2) pairs; the
    "normal" (llama) flavour rotates adjacent (2i, 2i + 1) pairs."""
    c, s = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    if neox:
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def attention(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, q_pos: np.ndarray, *, window: int, scale: float,
    key_offset: int = 0, sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Causal grouped-query attention for one sequence.

    q [n, heads, d] at positions q_pos; keys/values [L, kv_heads, d] hold positions
    key_offset .. key_offset + L - 1. A key at position j is visible to a query at p when j <= p
    and, with a sliding window, p - j < window (llama.cpp's rule). Query head h reads kv head
    h // (heads / kv_heads). sinks [heads]: a logit per head that joins every softmax's denominator
    and nothing else (gpt-oss; a query may so give less than all of its weight to the keys).
    Returns [n, heads, d].
    """
    n, heads, d = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    lo = max(key_offset, int(q_pos.min()) - window + 1) if window else key_offset  # older keys: outside every window
    hi = int(q_pos.max()) + 1
    mask = None
    if n > 1:  # one query sees exactly [lo, hi); several need the causal (and window) mask
        key_pos = np.arange(lo, hi)
        visible = key_pos[None, :] <= q_pos[:, None]
        if window:
            visible &= (q_pos[:, None] - key_pos[None, :]) < window
        mask = np.repeat(visible, group, axis=0)  # rows ordered (query, group)
    out = np.empty((n, heads, d), dtype=np.float32)
    for h in range(kv_heads):
        heads_of_h = slice(h * group, (h + 1) * group)
        qh = q[:, heads_of_h, :].reshape(n * group, d) * np.float32(scale)
        k = keys[lo - key_offset : hi - key_offset, h, :]  # strided views go straight to BLAS
        v = values[lo - key_offset : hi - key_offset, h, :]
        scores = _rows_times(qh, k.T, k)  # [n*group, L']
        if mask is not None:
            scores = np.where(mask, scores, np.float32(-np.inf))
        if sinks is not None:
            sink = np.tile(sinks[heads_of_h].astype(np.float32), n)[:, None]  # rows are (query, head)
            top = np.maximum(scores.max(axis=-1, keepdims=True), sink)
            e = np.exp(scores - top)
            p = e / (e.sum(axis=-1, keepdims=True) + np.exp(sink - top))
        else:
            p = softmax(scores)
        out[:, heads_of_h, :] = _rows_times(p, v).reshape(n, group, d)
    return out


def attention_partials(q: np.ndarray, keys: np.ndarray, values: np.ndarray, pos: int, *, window: int, scale: float,
                       split: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One decode row's split-K parts, as attention.cu's CTAs write them: q [heads, d] at `pos`, keys and
    values [pos + 1, kv_heads, d] (positions 0 .. pos); the visible keys (the window's) cut into runs of
    `split` from the first. Per part s and head h: acc[s, h] = sum p v and ml[s, h] = (m, l), p = e^(score
    - m) with m the part's max score and l = sum p; an empty part (past the last key) is (-inf, 0) with
    acc 0. Returns (acc [S, heads, d], m [S, heads], l [S, heads])."""
    heads, d = q.shape
    group = heads // keys.shape[1]
    lo = max(0, pos + 1 - window) if window else 0
    S = -(-(pos + 1 - lo) // split)
    acc = np.zeros((S, heads, d), np.float32)
    m = np.full((S, heads), -np.inf, np.float32)
    lsum = np.zeros((S, heads), np.float32)
    for s in range(S):
        a, b = lo + s * split, min(pos + 1, lo + (s + 1) * split)
        for h in range(heads):
            scores = keys[a:b, h // group] @ (q[h] * np.float32(scale))
            m[s, h] = scores.max()
            p = np.exp(scores - m[s, h])
            lsum[s, h] = p.sum()
            acc[s, h] = p @ values[a:b, h // group]
    return acc, m, lsum


def attention_merge(acc: np.ndarray, m: np.ndarray, lsum: np.ndarray, sinks: np.ndarray | None = None) -> np.ndarray:
    """The split-K parts of one row merged, as attn_combine (and attn_warp's cluster merge) does: M the
    largest m of the parts that saw a key (and the head's sink logit, where the model has sinks), out =
    sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) l_s + e^(sink - M)). acc [S, heads, d], m and l [S, heads];
    returns [heads, d]. With one part and no sink: acc / l."""
    seen = lsum > 0
    M = np.where(seen, m, -np.inf).max(axis=0)
    if sinks is not None:
        M = np.maximum(M, sinks.astype(np.float32))
    f = np.where(seen, np.exp(np.where(seen, m, 0) - M), 0).astype(np.float32)
    num = (f[..., None] * acc).sum(axis=0)
    den = (f * lsum).sum(axis=0) + (np.exp(sinks.astype(np.float32) - M) if sinks is not None else 0)
    return (num / den[:, None]).astype(np.float32)


def flash_rows(q: np.ndarray, keys: np.ndarray, values: np.ndarray, q_pos: np.ndarray, *, window: int, scale: float,
               tile: int, sinks: np.ndarray | None = None) -> np.ndarray:
    """flash.cu's online softmax for consecutive query rows of one sequence: keys (positions 0 ..) taken
    `tile` at a time from the tile holding the first row's first visible key, scores in log2 units (the
    scale times log2(e) folded into q), a running max per row rescaling the sums as it grows; at the end
    the head's sink logit (times log2(e)) joins each row's denominator. q [n, heads, d], keys and values
    [L, kv_heads, d]. Without 16-bit rounding (the kernel rounds q and p to f16). Returns [n, heads, d]."""
    n, heads, d = q.shape
    group = heads // keys.shape[1]
    log2e = np.float32(1.4426950408889634)
    p0, plast = int(q_pos[0]), int(q_pos[-1])
    first = max(0, p0 - window + 1) if window else 0
    out = np.empty((n, heads, d), np.float32)
    for h in range(heads):
        qs = q[:, h] * np.float32(scale * math.log2(math.e))
        m = np.full(n, -np.inf, np.float32)
        lsum = np.zeros(n, np.float32)
        o = np.zeros((n, d), np.float32)
        for t0 in range(first // tile * tile, plast + 1, tile):
            j = np.arange(t0, min(t0 + tile, plast + 1))
            s = qs @ keys[j, h // group].T
            seen = (j[None, :] <= q_pos[:, None]) & ((q_pos[:, None] - j[None, :] < window) if window else True)
            s = np.where(seen, s, -np.inf)
            mx = np.maximum(m, s.max(axis=1))
            base = np.where(mx == -np.inf, 0, mx)
            corr = np.exp2(m - base)
            p = np.exp2(s - base[:, None])
            lsum = lsum * corr + p.sum(axis=1)
            o = o * corr[:, None] + p @ values[j, h // group]
            m = mx
        inv = np.where(lsum > 0, 1 / np.where(lsum > 0, lsum, 1), 0)
        if sinks is not None:
            sk = np.float32(sinks[h]) * log2e
            M = np.maximum(m, sk)
            f = np.exp2(m - M)
            inv = f / (lsum * f + np.exp2(sk - M))
        out[:, h] = o * inv[:, None]
    return out


def _rows_times(a: np.ndarray, b: np.ndarray, b_t: np.ndarray | None = None) -> np.ndarray:
    """a @ b. OpenBLAS's gemm is slow for a handful of rows (decode steps): there, b_t @ a.T (b_t
    is b transposed with contiguous rows, so the small side is the gemm's narrow one) or one gemv
    per row is several times faster."""
    if a.shape[0] > 16:
        return a @ b
    if b_t is not None:
        return (b_t @ a.T).T
    return np.stack([row @ b for row in a])


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + np.float32(0.044715) * x * x * x)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = KERNEL_FLOATS["SWIGLU_OAI_ALPHA"], KERNEL_FLOATS["SWIGLU_OAI_LIMIT"]


def swiglu_oai(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gpt-oss's gated activation: the gate clamped above and up both ways at the limit, then
    gate * sigmoid(alpha * gate) * (up + 1)."""
    g = np.minimum(gate, np.float32(SWIGLU_OAI_LIMIT))
    u = np.clip(up, np.float32(-SWIGLU_OAI_LIMIT), np.float32(SWIGLU_OAI_LIMIT))
    return g / (np.float32(1.0) + np.exp(np.float32(-SWIGLU_OAI_ALPHA) * g)) * (u + np.float32(1.0))


def gated(gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray:
    """act(gate) * up, or gpt-oss's clamped form (act "swiglu_oai")."""
    if act == "swiglu_oai":
        return swiglu_oai(gate, up)
    return (silu(gate) if act == "silu" else gelu_tanh(gate)) * up


def gated_mlp(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, *, act: str,
              biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, q8_inputs: bool = False) -> np.ndarray:
    """down(act(gate(x)) * up(x)), with act "silu" (llama, qwen), "gelu_tanh" (gemma) or "swiglu_oai"
    (gpt-oss); biases: (gate, up, down) ones, where the model has them. q8_inputs: gate and up take x
    quantized to int8 per 32 columns (linear_q8, no biases), as the CUDA int8 matvecs do."""
    bg, bu, bd = biases or (None, None, None)
    if q8_inputs:
        if bg is not None or bu is not None:
            raise ValueError("the int8 products take no biases")
        return linear(gated(linear_q8(x, w_gate), linear_q8(x, w_up), act), w_down, bd)
    return linear(gated(linear(x, w_gate, bg), linear(x, w_up, bu), act), w_down, bd)


def gated_mlp_stacked(x: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray, *, act: str) -> np.ndarray:
    """gated_mlp with the gate and up projections stacked by rows into one matrix."""
    gu = linear(x, w_gate_up)
    half = gu.shape[-1] // 2
    return linear(gated(gu[..., :half], gu[..., half:], act), w_down)


MOE_WEIGHT_SUM_MIN = 6.103515625e-5  # llama.cpp clamps the chosen weights' sum below by this (2^-14)


def moe_route(x: np.ndarray, router: np.ndarray, *, k: int, gating: str = "softmax", norm_topk: bool = True,
              bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k experts (best first) and their weights, from the router's logits x @ router.T + bias
    (see route)."""
    return route(linear(x, router, bias), k=k, gating=gating, norm_topk=norm_topk)


def route(logits: np.ndarray, *, k: int, gating: str = "softmax", norm_topk: bool = True,
          select_bias: np.ndarray | None = None, scale: float = 1.0,
          chosen: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k experts (best first) and their weights, from the router's logits [n, experts].
    gating "softmax": a softmax over all the logits, then the k largest (qwen3moe); "softmax-topk": the
    k largest logits, then a softmax over those (gpt-oss); "sqrt-softplus": sqrt(softplus(logit)), the k
    largest of it plus select_bias, the weights unbiased (deepseek4), or the experts `chosen` [n, k] (its
    hash routing: a table's row for the token). norm_topk scales the k weights to sum to 1; then x scale."""
    if gating == "softmax":
        probs = softmax(logits)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        weights = np.take_along_axis(probs, top, axis=-1)
    elif gating == "softmax-topk":
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        weights = softmax(np.take_along_axis(logits, top, axis=-1))
    elif gating == "sqrt-softplus":
        probs = np.sqrt(np.logaddexp(np.float32(0), logits))
        if chosen is not None:
            top = np.asarray(chosen, np.int64)
        else:
            ranked = probs if select_bias is None else probs + select_bias
            top = np.argsort(-ranked, axis=-1, kind="stable")[:, :k]
        weights = np.take_along_axis(probs, top, axis=-1)
    else:
        raise ValueError(f"unknown expert gating {gating!r}")
    if norm_topk:
        weights = weights / np.maximum(weights.sum(axis=-1, keepdims=True), MOE_WEIGHT_SUM_MIN)
    return top, (weights * np.float32(scale)).astype(np.float32)


def moe_mlp(x: np.ndarray, router: np.ndarray, gate_exps: np.ndarray, up_exps: np.ndarray, down_exps: np.ndarray,
            *, k: int, act: str, gating: str = "softmax", norm_topk: bool = True,
            biases: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
            q8_inputs: bool = False) -> np.ndarray:
    """A mixture-of-experts MLP: each row through its k experts' gated MLPs (gate/up_exps [experts,
    ffn, hidden], down_exps [experts, hidden, ffn]), their outputs summed by the router's weights.
    biases: (router [experts], gate, up [experts, ffn], down [experts, hidden]) where the model has
    them; q8_inputs: gate and up take int8 inputs (gated_mlp). The rows are grouped by expert, so each
    expert's weights are read once per call."""
    rb, gb, ub, db = biases or (None, None, None, None)
    top, weights = moe_route(x, router, k=k, gating=gating, norm_topk=norm_topk, bias=rb)
    out = np.zeros((x.shape[0], down_exps.shape[1]), dtype=np.float32)
    for e in np.unique(top):
        rows, slot = np.nonzero(top == e)
        eb = None if gb is None or ub is None or db is None else (gb[e], ub[e], db[e])
        y = gated_mlp(x[rows], gate_exps[e], up_exps[e], down_exps[e], act=act, biases=eb, q8_inputs=q8_inputs)
        out[rows] += weights[rows, slot, None] * y
    return out


# -- sampling on the device (sampling.cu sample_f32) ------------------------------------------------------


def _order_keys(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.uint32)
    keys = np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000)).astype(np.uint32)
    return np.where(np.isnan(x), np.uint32(0), keys)


def gumbel_noise(seed: int, step: int, n: int) -> np.ndarray:
    """The device's noise: splitmix64's finaliser over (seed, step, index), as float32 Gumbel draws."""
    with np.errstate(over="ignore"):
        z = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + (np.uint64(step) << np.uint64(32))
             + np.arange(n, dtype=np.uint64))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = ((z >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 16777216.0)
    return -np.log(-np.log(u))


def sample_floor(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> float:
    """The smallest logit a draw may pick: top-k, then top-p of what is left, then min-p."""
    x = x.astype(np.float32)
    m = float(np.max(x))
    if temperature <= 0:
        return m
    floor = -np.inf
    if 0 < top_k < x.size:
        floor = float(np.partition(x, x.size - top_k)[x.size - top_k])
    if top_p < 1.0:
        kept = np.sort(x[x >= floor])[::-1]
        mass = np.cumsum(np.exp(kept.astype(np.float64) - m))
        cut = int(np.searchsorted(mass, top_p * mass[-1]))
        floor = max(floor, float(kept[min(cut, kept.size - 1)]))
    if min_p > 0.0:
        floor = max(floor, float(np.float32(m + np.log(np.float32(min_p)))))
    return floor


def sample_rows(x: np.ndarray, temperature, top_k, top_p, min_p, seed, step) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, floors) per row: the draw argmax(x / T + gumbel_noise) over x >= floor."""
    tokens, floors = [], []
    for r in range(x.shape[0]):
        floor = sample_floor(x[r], temperature[r], top_k[r], top_p[r], min_p[r])
        row = x[r].astype(np.float32)
        if temperature[r] > 0:
            score = row * (np.float32(1.0) / np.float32(temperature[r])) + gumbel_noise(seed[r], step[r], row.size)
        else:
            score = row.copy()
        score[row < floor] = -np.inf
        tokens.append(int(np.argmax(score)))
        floors.append(floor)
    return np.asarray(tokens, np.int32), np.asarray(floors, np.float32)


def kv_gather(k_pool: np.ndarray, v_pool: np.ndarray, blocks, *, layers: int, layer_elems: int,
              block_elems: int) -> np.ndarray:
    """The listed blocks of flat per-layer pools (layer l at l * layer_elems, block b's row at
    b * block_elems within it) as [n, 2, layers, block_elems]."""
    out = np.empty((len(blocks), 2, layers, block_elems), dtype=k_pool.dtype)
    for j, b in enumerate(blocks):
        for half, pool in enumerate((k_pool, v_pool)):
            for layer in range(layers):
                start = layer * layer_elems + int(b) * block_elems
                out[j, half, layer] = pool[start:start + block_elems]
    return out


def kv_scatter(k_pool: np.ndarray, v_pool: np.ndarray, blocks, staging: np.ndarray, *, layers: int,
               layer_elems: int, block_elems: int) -> None:
    """The reverse of kv_gather, in place."""
    for j, b in enumerate(blocks):
        for half, pool in enumerate((k_pool, v_pool)):
            for layer in range(layers):
                start = layer * layer_elems + int(b) * block_elems
                pool[start:start + block_elems] = staging[j, half, layer]
