"""The kernels' constants table (kernels/constants.py) is the one home of every constant a launcher
shares with a kernel: build.py passes it to NVRTC, the .cu files define none of it, and the launchers
read it. Runs without a GPU; the compile needs NVRTC (the cuda extra) and skips, saying why, without it.
"""

from __future__ import annotations

import inspect
import re

import pytest

from ember.kernels import build, constants, cuda_runtime, ops
from ember.kernels.constants import KERNEL_CONSTANTS, KERNEL_FLOATS
from ember.kernels.errors import CompileError, CudaUnavailable

OWNED = [*KERNEL_CONSTANTS, *KERNEL_FLOATS]  # every name the tables pass to NVRTC

SOURCES = sorted([*build.SOURCE_DIR.glob("*.cu"), *build.SOURCE_DIR.glob("*.cuh")])


def _nvrtc_or_skip() -> tuple[int, int]:
    try:
        return build.nvrtc_version()
    except CudaUnavailable as e:
        pytest.skip(f"NVRTC is not available here ({e}); CI installs it with pip install -e '.[cuda]'")


def _code(path) -> str:
    """The source without its comments (a comment may mention a constant's value)."""
    text = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


@pytest.fixture(scope="module")
def compiled(kernel_cache):
    """Every module compiled for sm_90 through build.py (the table among its options), into the session's
    shared kernel cache (tests/test_kernels_build.py builds into the same one, so a run of both compiles once)."""
    _nvrtc_or_skip()
    return {r.module: r for r in build.build_all("sm_90", cache=kernel_cache)}


def test_every_kernel_source_compiles_with_the_table(compiled):
    assert set(compiled) == set(build.MODULES)
    defines = set(constants.defines())
    sources = {spec.source for spec in build.MODULES.values()}
    assert sources == {p.name for p in SOURCES if p.suffix == ".cu"}  # no source left out of MODULES
    for name, result in compiled.items():
        assert result.path.read_bytes()[:4] == b"\x7fELF", name
        assert defines <= set(build.module_options(name, "sm_90")), name


def test_no_kernel_source_defines_a_constant_the_table_owns():
    owned = "|".join(sorted(OWNED, key=len, reverse=True))
    definition = re.compile(rf"#\s*(?:define|undef)\s+({owned})\b|\b({owned})\s*=(?!=)|\benum\b[^;]*\b({owned})\b")
    found = {}
    for path in SOURCES:
        for m in definition.finditer(_code(path)):
            found.setdefault(path.name, []).append(next(g for g in m.groups() if g))
    assert not found, f"defined in the sources, but kernels/constants.py owns them: {found}"


def test_every_table_constant_is_used_by_a_kernel_source():
    code = "\n".join(_code(p) for p in SOURCES)
    unused = [name for name in OWNED if not re.search(rf"\b{name}\b", code)]
    assert not unused, f"in the table but in no kernel source (launcher-only policy belongs in ops/): {unused}"


def test_table_names_in_preprocessor_conditions_are_guarded():
    """A macro missing from `#if` reads as 0 without a word, so every table name a condition tests must
    also be checked with `defined(...)` next to an #error."""
    texts = {p.name: _code(p) for p in SOURCES}
    guarded = set()
    for text in texts.values():
        for block in re.findall(r"#\s*if[^\n]*(?:\\\n[^\n]*)*\n\s*#\s*error", text):
            guarded |= set(re.findall(r"defined\s*\(?\s*(\w+)", block))
            guarded |= set(re.findall(r"#\s*ifndef\s+(\w+)", block))
    unguarded = set()
    for text in texts.values():
        for line in re.findall(r"^\s*#\s*(?:if|elif|ifdef|ifndef)\b[^\n]*", text, flags=re.M):
            unguarded |= {name for name in KERNEL_CONSTANTS if re.search(rf"\b{name}\b", line)} - guarded
    assert not unguarded, f"tested in #if without a defined(...) guard: {sorted(unguarded)}"


def test_a_source_compiled_without_the_table_fails_naming_what_is_missing():
    _nvrtc_or_skip()
    table = set(constants.defines())
    options = [o for o in build.module_options("kv_copy", "sm_90") if o not in table]
    with pytest.raises(CompileError) as ei:
        build.compile_source("kv_copy", (build.SOURCE_DIR / "kv_copy.cu").read_bytes(), "sm_90", options)
    assert "TRACE_MARKS" in ei.value.log
    gt_q4_k = f"-DGT_Q4_K={KERNEL_CONSTANTS['GT_Q4_K']}"
    options = [o for o in build.module_options("matvec_k_q4_k", "sm_90") if o != gt_q4_k]
    with pytest.raises(CompileError) as ei:
        build.compile_source("matvec_k_q4_k", (build.SOURCE_DIR / "matvec_k.cu").read_bytes(), "sm_90", options)
    assert "kernels/constants.py" in ei.value.log


def test_the_variants_the_launchers_name_are_compiled(compiled):
    """The kernel names the launchers form from the table's variant lists exist in the modules (read
    from the cubins' symbol tables: ptxas's resource report differs between NVRTC versions)."""
    names = {m: set(re.findall(rb"[A-Za-z_][A-Za-z0-9_]*", r.path.read_bytes())) for m, r in compiled.items()}
    names = {m: {n.decode() for n in found} for m, found in names.items()}
    for d in constants.ATTN_HEAD_DIMS:
        assert f"flash_prefill_d{d}" in names["flash"]
        for g in constants.ATTN_GROUPS:
            for kv in ("f16", "f32"):
                for kernel in ("attn", "attn_decode", "attn_warp"):
                    assert f"{kernel}_d{d}_g{g}_{kv}" in names["attention"]
    for e in constants.NORM_COLS_PER_THREAD:
        assert f"rms_norm_f32_e{e}" in names["norm"]
    for t in ops.KQ8_TYPES:
        for b, u, pf in ops.KQ8_VARIANTS:
            assert f"kq8{'p' if pf else ''}_b{b}_u{u}" in names[f"matvec_k_{t}"]


def test_the_table_holds_together_and_matches_ggml():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    constants.check_table()
    for name, tid in constants.GGML_TYPE_IDS.items():
        if name == "q6_kp":  # ours: Q6_K padded to 16-byte blocks
            assert tid not in {t.value for t in GGMLQuantizationType}
            continue
        t = GGMLQuantizationType(tid)
        assert t.name.lower() == name
        if name not in ("f32", "f16", "bf16"):
            assert ops.BLOCK_SIZES[name] == GGML_QUANT_SIZES[t], name
    assert build.GGML_TYPE_IDS is constants.GGML_TYPE_IDS


def test_the_launchers_read_the_table():
    c = KERNEL_CONSTANTS
    launcher_values = {
        "MATVEC_WARPS": ops.MATVEC_WARPS, "XPRO_COLS": ops.XPRO_COLS, "SQ_WARPS": ops.SQ_WARPS,
        "SQ_ROWS": ops.SQ_ROWS, "ATT_SPLIT_MAX": ops.ATT_SPLIT_MAX, "ATTW_SPLIT_MAX": ops.ATTW_SPLIT_MAX,
        "ATTW_WARPS": ops.ATTW_WARPS, "ATTW_CLUSTER_MAX": ops.ATTW_CLUSTER_MAX, "FLASH_ROWS": ops.FLASH_ROWS,
        "ARGMAX_CHUNK": ops.ARGMAX_CHUNK, "TRACE_WORDS": cuda_runtime.TRACE_WORDS,
        "TRACE_MARKS": cuda_runtime.TRACE_MARKS,
    }
    assert launcher_values == {name: c[name] for name in launcher_values}
    assert ops.KV2_MAX_COLS == c["KV2_MAX_WARPS"] * c["KV2_WARP_SUPERBLOCKS"] * c["BLOCK_ELEMS_Q4_K"] == 16384
    assert ops.SQ_MAX_ROW_BYTES == 768
    assert ops.FLASH_HEAD_DIMS == constants.ATTN_HEAD_DIMS
    assert ops.NORM_MAX_COLS == max(constants.NORM_COLS_PER_THREAD) * c["NORM_MAX_THREADS"] == 8192
    assert c["BLOCK_BYTES_Q6_KP"] - c["BLOCK_BYTES_Q6_K"] == ops.Q6K_PAD
    assert ops.flash_smem_bytes(128) == (64 + 4 * 64) * (128 + 8) * 2
    assert ops.flash_smem_bytes(256) == (64 + 4 * 32) * (256 + 8) * 2


def test_the_table_is_part_of_every_module_and_its_cache_key(monkeypatch):
    _nvrtc_or_skip()
    monkeypatch.delenv("EMBER_KERNEL_DEFINES", raising=False)
    for name in build.MODULES:
        options = build.module_options(name, "sm_90")
        assert options[4:4 + len(OWNED)] == list(constants.defines()), name
    before = build.cache_key("attention", "sm_90")
    monkeypatch.setitem(KERNEL_CONSTANTS, "ATTW_WARPS", 8)
    assert "-DATTW_WARPS=8" in build.module_options("attention", "sm_90")
    assert build.cache_key("attention", "sm_90") != before


def test_a_sweep_cannot_override_a_table_constant(monkeypatch):
    """EMBER_KERNEL_DEFINES would change the kernel but not its launcher: refused for the table's names."""
    monkeypatch.setenv("EMBER_KERNEL_DEFINES", "-DEMBER_SWEEP=1 -DATTW_WARPS=8")
    with pytest.raises(ValueError, match="ATTW_WARPS"):
        build.module_options("attention", "sm_90")
    monkeypatch.setenv("EMBER_KERNEL_DEFINES", "-DEMBER_SWEEP=1")
    assert build.module_options("attention", "sm_90")[-1] == "-DEMBER_SWEEP=1"


def test_every_launcher_names_its_twin():
    """ops/ keeps one launcher per kernel next to its numpy twin's name: each launcher's docstring says
    which twin the gpu tests hold it to."""
    launchers = [getattr(ops, n) for n in ops.__all__ if inspect.isfunction(getattr(ops, n))]
    launchers = [f for f in launchers if next(iter(inspect.signature(f).parameters), "") == "dev"
                 and inspect.signature(f).return_annotation == "None"]  # not the policies (splits, sizes)
    assert {"matvec", "attention", "flash_attention", "sample", "gemm", "kv_gather", "fault_illegal_address"} <= {
        f.__name__ for f in launchers}
    missing = [f.__name__ for f in launchers if "twin" not in (f.__doc__ or "").lower()]
    assert not missing, f"launchers whose docstring names no twin: {missing}"


def test_the_activation_codes_are_one_table():
    """The gated activations the recipes name (recipe.Act) are constants.ACTIVATIONS' names, each an ACT_*
    code of the kernels' table; the launchers take exactly those names, and the twin's SwiGLU constants
    are the ones the kernels get."""
    from ember.kernels import reference
    from ember.kernels.ops.args import act_code
    from ember.worker.model.arch.recipe import Act

    assert set(constants.ACTIVATIONS) == {a.value for a in Act}
    assert {KERNEL_CONSTANTS[f"ACT_{name.upper()}"] for name in constants.ACTIVATIONS} == set(
        constants.ACTIVATIONS.values())
    assert KERNEL_CONSTANTS["ACT_NONE"] not in constants.ACTIVATIONS.values()
    assert [act_code(a) for a in constants.ACTIVATIONS] == list(constants.ACTIVATIONS.values())
    assert act_code(None, none=True) == KERNEL_CONSTANTS["ACT_NONE"]
    with pytest.raises(ValueError, match="swiglu_oai"):
        act_code("relu")
    twin = (reference.SWIGLU_OAI_ALPHA, reference.SWIGLU_OAI_LIMIT)
    assert twin == (KERNEL_FLOATS["SWIGLU_OAI_ALPHA"], KERNEL_FLOATS["SWIGLU_OAI_LIMIT"])
    assert "-DSWIGLU_OAI_ALPHA=1.702f" in constants.defines()
    # no kernel source picks an activation by a number of its own
    code = "\n".join(_code(p) for p in SOURCES)
    assert not re.search(r"\bact\s*[=!]=\s*\d", code)
