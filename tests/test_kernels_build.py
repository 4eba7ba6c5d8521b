"""`ember kernels build` and the cubin cache, on a machine without a GPU (CI).

NVRTC only needs its library (the cuda extra: cuda-bindings + nvidia-cuda-nvrtc), so every kernel
module is compiled for sm_90 here; where NVRTC cannot be loaded the tests skip and say why.
Also the CUDA error classes, which need no driver at all.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from ember.kernels import build
from ember.kernels.errors import STICKY_CODES, CompileError, CudaError, CudaUnavailable, StickyCudaError, cuda_error


def _nvrtc_or_skip() -> tuple[int, int]:
    try:
        return build.nvrtc_version()
    except CudaUnavailable as e:
        pytest.skip(f"NVRTC is not available here ({e}); CI installs it with pip install -e '.[cuda]'")


@pytest.fixture(scope="module")
def built(kernel_cache):
    """Every module compiled once for sm_90 through the CLI entry point (exit code 0), into the session's
    shared kernel cache (tests/test_kernels_constants.py builds into the same one, and .ci/run's background
    build fills it first: a run compiles once; the cache-served rebuild below is timed against whichever
    compiled)."""
    _nvrtc_or_skip()
    from ember.kernels.cli import main

    cache = kernel_cache
    t = time.perf_counter()
    rc = main(["build", "--arch", "sm_90", "--cache-dir", str(cache)])
    return cache, rc, time.perf_counter() - t


def test_build_every_module_for_sm90_without_a_gpu(built):
    cache, rc, _ = built
    assert rc == 0
    for name in build.MODULES:
        cubins = list(cache.glob(f"{name}.sm_90.*.cubin"))
        assert len(cubins) == 1, name
        data = cubins[0].read_bytes()
        assert data[:4] == b"\x7fELF", f"{name}: not a cubin (ELF) file"
        meta = cubins[0].with_suffix(".json")
        assert meta.exists()
    # the cache folder is private, like the rest of ember's cache
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700


def test_no_kernel_spills_registers(built):
    cache, rc, _ = built
    assert rc == 0
    bad = {}
    for name in build.MODULES:
        r = build.build_module(name, "sm_90", cache=cache)
        assert r.cached
        assert r.resources, f"{name}: no ptxas resource report"
        for fn, res in r.resources.items():
            # a few bytes of stack are fine (double sin/cos in rope); spills in hot kernels are not
            if res.get("spill_stores", 0) > 64:
                bad[f"{name}.{fn}"] = res
    assert not bad, bad


def test_second_build_is_served_from_the_cache(built):
    cache, rc, first = built
    assert rc == 0
    t = time.perf_counter()
    results = build.build_all("sm_90", cache=cache)
    assert all(r.cached for r in results)
    assert time.perf_counter() - t < max(2.0, first / 5)


def test_cache_key_covers_arch_options_and_compiler(tmp_path, monkeypatch):
    _nvrtc_or_skip()
    k90 = build.cache_key("norm", "sm_90")
    assert build.cache_key("norm", "sm_90") == k90
    assert build.cache_key("norm", "sm_80") != k90
    monkeypatch.setitem(build.MODULES, "norm", build.ModuleSpec("norm.cu", ("-DEMBER_TEST=1",)))
    assert build.cache_key("norm", "sm_90") != k90
    monkeypatch.undo()
    monkeypatch.setattr(build, "_VERSION", (99, 0))
    assert build.cache_key("norm", "sm_90") != k90


def test_sweep_defines_join_the_options_and_the_key(monkeypatch):
    """EMBER_KERNEL_DEFINES (measuring a variant beside the default): its -D options reach NVRTC and the
    cache key; anything else is refused before a compile."""
    _nvrtc_or_skip()
    monkeypatch.delenv("EMBER_KERNEL_DEFINES", raising=False)
    plain = build.cache_key("norm", "sm_90")
    monkeypatch.setenv("EMBER_KERNEL_DEFINES", "-DEMBER_X=2 -DEMBER_Y")
    assert build.module_options("norm", "sm_90")[-2:] == ["-DEMBER_X=2", "-DEMBER_Y"]
    assert build.cache_key("norm", "sm_90") != plain
    monkeypatch.setenv("EMBER_KERNEL_DEFINES", "-DX=1 --use_fast_math")
    with pytest.raises(ValueError, match="--use_fast_math"):
        build.module_options("norm", "sm_90")


def test_changed_header_compiles_anew(tmp_path, monkeypatch):
    _nvrtc_or_skip()
    src = tmp_path / "src"
    src.mkdir()
    for p in build.SOURCE_DIR.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(build, "SOURCE_DIR", src)
    cache = tmp_path / "cache"
    first = build.build_module("act", "sm_90", cache=cache)
    assert not first.cached and first.path.exists()
    assert build.build_module("act", "sm_90", cache=cache).cached
    (src / "common.cuh").write_text((src / "common.cuh").read_text() + "\n// changed\n")
    again = build.build_module("act", "sm_90", cache=cache)
    assert not again.cached and again.path != first.path


def test_an_empty_compiler_log_leaves_the_interpreter_intact():
    """A PTX build (the compat modes) runs no ptxas, so NVRTC's log is one NUL byte. Read into `b" " * 1`,
    CPython's cached one-byte object, it turned every b" " of the process into b"\\0": in the compat modes
    print()'s separators came out as NUL, and the sticky-error test read none of its child's words. In a
    child process, so that a regression cannot corrupt this one."""
    _nvrtc_or_skip()
    code = textwrap.dedent("""
        from ember.kernels import build
        src = b'extern "C" __global__ void k(int *p) { *p = 1; }'
        for arch in ("compute_80", "sm_90"):
            out, log = build.compile_source("probe", src, arch, [f"--gpu-architecture={arch}"])
            assert len(out) > 100, arch
        print("POISONED", 700, " ".encode() == bytes([32]), b" " == bytes([32]))
        """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "POISONED 700 True True", repr(p.stdout)


def test_compile_error_carries_the_log(tmp_path):
    _nvrtc_or_skip()
    with pytest.raises(CompileError) as ei:
        build.compile_source("broken", b'extern "C" __global__ void k() { undefined_thing(); }', "sm_90",
                             build.module_options("norm", "sm_90"))
    assert "undefined_thing" in ei.value.log


def test_cache_dir_follows_ember_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "c"))
    d = build.cache_dir()
    assert d == tmp_path / "c" / "kernels"
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_arch_names():
    assert build.check_arch("sm_90") == "sm_90"
    assert build.check_arch("90") == "sm_90"
    assert build.check_arch("SM_90a") == "sm_90a"
    for bad in ("compute_90", "hopper", "sm_9", ""):
        with pytest.raises(ValueError):
            build.check_arch(bad)


def test_cli_rejects_unknown_arch_with_config_exit_code(tmp_path):
    _nvrtc_or_skip()
    from ember.kernels.cli import main

    assert main(["build", "--arch", "sm_12", "--cache-dir", str(tmp_path)]) == 78
    assert main(["build", "--arch", "bogus", "--cache-dir", str(tmp_path)]) == 78


def test_worker_cli_has_the_kernels_verb():
    from ember.worker.cli import build_parser

    args = build_parser().parse_args(["kernels", "build", "--arch", "sm_90", "--jobs", "1"])
    assert args.func.__name__ == "cmd_kernels_build" and args.arch == "sm_90" and args.jobs == 1


# -- error classes ----------------------------------------------------------------------------------


def test_sticky_codes_raise_sticky_errors():
    e = cuda_error(700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered", "cuCtxSynchronize")
    assert isinstance(e, StickyCudaError) and e.sticky
    assert (e.code, e.name) == (700, "CUDA_ERROR_ILLEGAL_ADDRESS")
    assert "700" in str(e) and "illegal memory access" in str(e)
    for code in (702, 710, 714, 715, 716, 717, 718, 719):
        assert isinstance(cuda_error(code, "X", "y"), StickyCudaError), code
    oom = cuda_error(2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")
    assert type(oom) is CudaError and not oom.sticky
    assert 700 in STICKY_CODES and 2 not in STICKY_CODES


def test_check_maps_results_and_remembers_poison(monkeypatch):
    pytest.importorskip("cuda.bindings", reason="cuda-python is not installed")
    from ember.kernels import cuda_runtime as cr

    monkeypatch.setattr(cr, "_poisoned", None)
    assert cr.check((0, 5)) == 5
    assert cr.check((0, 1, 2)) == (1, 2)
    assert cr.check(0) is None
    with pytest.raises(CudaError) as ei:
        cr.check((1,), "cuFoo")
    assert type(ei.value) is CudaError and ei.value.call == "cuFoo"
    assert cr.poisoned() is None
    with pytest.raises(StickyCudaError) as ei:
        cr.check((700,), "cuCtxSynchronize")
    assert ei.value.code == 700 and ei.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert cr.poisoned() is ei.value


def test_no_device_is_reported_not_raised():
    pytest.importorskip("cuda.bindings", reason="cuda-python is not installed")
    from ember.kernels.cuda_runtime import try_device

    dev, why = try_device()
    if dev is not None:
        pytest.skip(f"a CUDA device is present ({dev})")
    assert why


def test_compile_error_survives_a_worker_process():
    """build_all compiles in spawned processes: the error must unpickle whole (module, log, options),
    or the pool breaks and the NVRTC log is lost."""
    import pickle

    from ember.kernels.errors import CompileError

    e = pickle.loads(pickle.dumps(CompileError("flash", "flash.cu(1): error: x", ["-arch=sm_90"])))
    assert (e.module, e.log, e.options) == ("flash", "flash.cu(1): error: x", ["-arch=sm_90"])
    assert "flash.cu(1): error" in str(e)


def test_q6_k_is_repacked_to_aligned_blocks():
    """The device keeps Q6_K blocks padded to 224 bytes (16-byte aligned fields); the padding is all
    that changes."""
    import numpy as np

    from ember.kernels import ops

    raw = np.random.default_rng(3).integers(0, 256, 210 * 6, dtype=np.uint8)
    packed = ops.repack_q6_k(raw).reshape(6, 224)
    assert np.array_equal(packed[:, :210].reshape(-1), raw) and not packed[:, 210:].any()
    assert ops.row_nbytes("q6_kp", 512) == 2 * 224 and ops.row_nbytes("q6_k", 512) == 2 * 210


def test_flash_tiles_and_attention_splits():
    """Host-side choices of the attention launchers: each chunk's rows in tiles of at most 64 (one
    sequence per tile), and decode splits that shrink to 16 keys only while the GPU would be empty."""
    from types import SimpleNamespace

    from ember.kernels import ops

    tiles = ops.flash_tiles([(0, 130), (130, 131), (131, 195)])
    assert tiles.tolist() == [[0, 64], [64, 64], [128, 2], [130, 1], [131, 64]]
    assert ops.flash_tiles([]).shape == (0, 2)
    h200 = SimpleNamespace(sm_count=132)
    assert ops.attention_split(h200, rows=1, kv_heads=8, max_keys=64) == 16  # 4 splits x 8 heads
    assert ops.attention_split(h200, rows=1, kv_heads=8, max_keys=4096) == 64
    assert ops.attention_split(h200, rows=64, kv_heads=8, max_keys=4096) == 512  # the grid is full already


def test_norm_kernels_cover_every_width_ops_picks(built):
    """ops.norm_shape picks the register-held variant (4 or 8 columns per thread) and its threads;
    both variants of every norm kernel are in the module, and wider rows are refused up front."""
    from ember.kernels import ops

    assert ops.norm_shape(640) == (4, 160)
    assert ops.norm_shape(4096) == (4, 1024)
    assert ops.norm_shape(4097) == (8, 544)
    assert ops.norm_shape(8192) == (8, 1024)
    for cols in (1, 37, 640, 2560, 4096, 5000, 8192):
        per, threads = ops.norm_shape(cols)
        assert per * threads >= cols and threads <= 1024 and threads % 32 == 0
    with pytest.raises(ValueError, match="8192"):
        ops.norm_shape(8193)
    cache, rc, _ = built
    names = set(build.build_module("norm", "sm_90", cache=cache).resources)
    for kernel in ("rms_norm_f32", "rms_norm_add_f32", "rms_norm_add_norm_f32"):
        assert {f"{kernel}_e4", f"{kernel}_e8"} <= names


def test_upload_pads_rows_to_16_bytes_and_keeps_the_bytes():
    """QuantMatrix.upload on a stand-in device: rows whose length is not a multiple of 16 bytes (the
    640-column Q5_0/Q8_0 rows of Gemma 3 270M) are padded with zeros and the matrix records the
    stride; Q6_K is repacked first, and its 224-byte blocks need no padding at any width."""
    import numpy as np

    from ember.kernels import ops

    class Stored:
        def __init__(self, arr):
            self.arr, self.ptr = arr, 0

    class StandIn:
        def to_device(self, arr):
            return Stored(arr)

    rng = np.random.default_rng(3)
    for tname, cols, stride in (("q8_0", 640, 688), ("q5_0", 640, 448), ("q4_0", 640, 368), ("q6_k", 2560, 2240),
                                ("q6_k", 4096, 3584), ("q4_k", 768, 432), ("f16", 640, 1280)):
        rows, natural = 5, ops.row_nbytes(tname, cols)
        raw = rng.integers(0, 256, rows * natural, dtype=np.uint8)
        m = ops.QuantMatrix.upload(StandIn(), raw, tname, rows, cols)
        assert m.row_bytes == stride and m.row_bytes % 16 == 0, tname
        stored = m.data.arr.reshape(rows, stride)
        if tname == "q6_k":
            np.testing.assert_array_equal(stored.reshape(-1), ops.repack_q6_k(raw))
        else:
            np.testing.assert_array_equal(stored[:, :natural], raw.reshape(rows, natural))
            assert not stored[:, natural:].any()
        packed = ops.QuantMatrix.upload(StandIn(), raw, tname, rows, cols, align_rows=False)
        assert packed.stride == 0


def test_decode_attention_spreads_short_contexts_over_one_cluster():
    """attn_warp's split policy (no GPU needed): a few (row, kv head) pairs spread their keys over up to
    8 CTAs of at least 32 keys, which merge in their cluster (no partials to keep); many pairs take
    fewer splits; past 8 splits attn_combine merges them."""
    from ember.kernels import ops

    def parts(keys, pairs=1, d=256):
        split = ops.attention_split_warp(d, 2, keys, pairs)
        return split, -(-keys // split)

    assert parts(16) == (16, 1) and parts(32) == (32, 1)
    assert parts(40) == (32, 2) and ops.attention_clustered(True, 2)
    assert parts(128) == (32, 4) and parts(256) == (32, 8) and parts(1024) == (128, 8)
    assert parts(256, pairs=64) == (128, 2)  # 64 streams: two CTAs each, not eight
    assert parts(1500)[1] == 12 and not ops.attention_clustered(True, 12)
    assert not ops.attention_clustered(False, 4)  # attn_decode merges through attn_combine
    assert ops.attention_split_warp(256, 4, 4096) == 64  # float32 KV: half the keys fit in shared memory
