"""Run-time compilation of ember's CUDA C++ kernels with NVRTC, and the on-disk cubin cache.

Every kernel module is one source file under ``kernels/cuda/`` (plus the shared ``*.cuh`` headers,
handed to NVRTC in memory) and a few ``-D`` options; ``MODULES`` lists them. Every module also gets the
kernel constants of ``constants.KERNEL_CONSTANTS`` as ``-DNAME=VALUE`` options (the sources define
none of them). A module is compiled for one real architecture (``sm_90`` on Hopper) straight to a
cubin, so the driver never JIT-compiles PTX, and stored as ``<cache>/<module>.<arch>.<key>.cubin``
where ``key`` hashes the source, every header, the architecture, the NVRTC version and the options
(the constants' defines among them): any change compiles anew, and stale files are simply never read
again. The cache lives in ``<cache dir>/kernels`` (ember.ops.contract.cache_dir: ``$EMBER_CACHE_DIR``,
else ``$XDG_CACHE_HOME/ember``, else ``~/.cache/ember``), mode 0700; files are written
atomically (temp file + rename), so concurrent builders never see half a cubin.

A virtual target (``compute_86``) is compiled to PTX instead, stored as ``.ptx``, which the driver
JIT-compiles for the GPU at hand: the compat modes' kernels (device_caps.py), and the build for a GPU
ember's kernels have not run on.

NVRTC needs no GPU: ``ember kernels build --arch sm_90`` works on any machine with cuda-python and
NVRTC's library (the ``cuda`` extra: cuda-bindings + nvidia-cuda-nvrtc).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ember.ops import contract

from . import constants
from .constants import GGML_TYPE_IDS, QGEMM_TYPES
from .errors import CompileError, CudaUnavailable

SOURCE_DIR = Path(__file__).resolve().parent / "cuda"
CACHE_FORMAT = 1  # bump when the cache layout or the meaning of a key changes

BASE_OPTIONS: tuple[str, ...] = ("-std=c++17", "-lineinfo", "--ptxas-options=-v")


@dataclass(frozen=True)
class ModuleSpec:
    source: str  # file name under SOURCE_DIR
    options: tuple[str, ...] = ()
    doc: str = ""


def _modules() -> dict[str, ModuleSpec]:
    mods = {
        f"matvec_{name}": ModuleSpec("matvec.cu", (f"-DQTYPE={tid}",), f"quantized matrix-vector product, {name}")
        for name, tid in GGML_TYPE_IDS.items()
    }
    for name in ("q4_k", "q5_k", "q6_kp"):
        mods[f"matvec_k_{name}"] = ModuleSpec(
            "matvec_k.cu", (f"-DQTYPE={GGML_TYPE_IDS[name]}",), f"column-resident matrix-vector product, {name}"
        )
    for name in QGEMM_TYPES:
        mods[f"qgemm_{name}"] = ModuleSpec(
            "qgemm.cu", (f"-DQTYPE={GGML_TYPE_IDS[name]}",), f"grouped tensor-core matmul from the blocks, {name}"
        )
    mods.update(
        stream_q8_0=ModuleSpec("stream_q8_0.cu", (), "streaming Q8_0 matrix-vector product, int8 x (dp4a)"),
        dequant=ModuleSpec("dequant.cu", (), "dequantize rows / embedding lookup, every type"),
        norm=ModuleSpec("norm.cu", (), "fused residual add + RMSNorm"),
        rope=ModuleSpec("rope.cu", (), "rotary embedding, neox and normal"),
        act=ModuleSpec("act.cu", (), "gated MLP activation, silu and gelu_tanh"),
        attention=ModuleSpec("attention.cu", (), "paged attention (split-K), KV cache writes"),
        flash=ModuleSpec("flash.cu", (), "flash attention for prefill on the tensor cores (f16 KV)"),
        sampling=ModuleSpec("sampling.cu", (), "argmax, softmax, top-k/top-p/min-p/temperature sampling"),
        gemm=ModuleSpec("gemm.cu", (), "tensor-core matmul for prefill (f16/bf16 in, f32 out)"),
        probe=ModuleSpec("probe.cu", (), "launch-latency probes for the micro-benchmark"),
        fault=ModuleSpec("fault.cu", (), "fault injection: an illegal-address write"),
        kv_copy=ModuleSpec("kv_copy.cu", (), "whole KV blocks between the pools and a packed staging area"),
        moe=ModuleSpec("moe.cu", (), "mixture of experts: routing, grouping by expert, gather, weighted sum"),
    )
    return mods


MODULES: dict[str, ModuleSpec] = _modules()

_ARCH_RE = re.compile(r"^(sm|compute)_(\d{2,3})([af]?)$")


def check_target(target: str) -> str:
    """A build target: a real architecture (check_arch: a cubin) or a virtual one, 'compute_86' (PTX,
    which the driver JIT-compiles for the GPU at hand: device_caps.build_target's choice in compat mode)."""
    t = target.strip().lower()
    m = _ARCH_RE.match(t)
    if m and m.group(1) == "compute" and not m.group(3):
        return t
    return check_arch(target)


def is_ptx(target: str) -> bool:
    return target.startswith("compute_")


def check_arch(arch: str) -> str:
    """'sm_90', 'sm_90a', '90' -> the NVRTC spelling 'sm_90' / 'sm_90a'; ValueError otherwise."""
    a = arch.strip().lower()
    if a.isdigit():
        a = f"sm_{a}"
    m = _ARCH_RE.match(a)
    if not m or m.group(1) != "sm":
        raise ValueError(f"bad architecture {arch!r}: expected a real GPU architecture such as sm_90")
    return a


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    base = Path(override) if override else contract.cache_dir() / "kernels"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base


# -- NVRTC ----------------------------------------------------------------------------------------


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise CudaUnavailable(
            f"cuda-python is not installed ({e}); install the cuda extra: pip install 'ember[cuda]'") from e
    return nvrtc


def _nvrtc_check(res, what: str):
    nvrtc = _nvrtc()
    err = res[0] if isinstance(res, tuple) else res
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise RuntimeError(f"{what}: {msg.decode(errors='replace') if isinstance(msg, bytes) else msg}")
    return res[1:] if isinstance(res, tuple) else ()


_VERSION: tuple[int, int] | None = None


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library in use; CudaUnavailable when it cannot be loaded."""
    global _VERSION
    if _VERSION is None:
        nvrtc = _nvrtc()
        try:
            major, minor = _nvrtc_check(nvrtc.nvrtcVersion(), "nvrtcVersion")
        except CudaUnavailable:
            raise
        except Exception as e:  # the library itself is missing (cuda.pathfinder raises its own type)
            raise CudaUnavailable(
                f"NVRTC's library could not be loaded ({type(e).__name__}: {e}); "
                "install the cuda extra: pip install 'ember[cuda]' (it brings nvidia-cuda-nvrtc)"
            ) from e
        _VERSION = (int(major), int(minor))
    return _VERSION


def supported_archs() -> list[str]:
    nvrtc_version()
    (archs,) = _nvrtc_check(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    return [f"sm_{a}" for a in archs]


def _headers() -> list[tuple[str, bytes]]:
    return [(p.name, p.read_bytes()) for p in sorted(SOURCE_DIR.glob("*.cuh"))]


def tracing() -> bool:
    """EMBER_TRACE=1: build (and load) the profiling variant of every kernel (common.cuh EMBER_TRACE)."""
    return os.environ.get("EMBER_TRACE") == "1"


def sweep_defines() -> list[str]:
    """EMBER_KERNEL_DEFINES="-DNAME=V ...": extra macros for every module, for measuring a kernel variant
    beside the default on one machine (part of the cache key, like every option; never set in service).
    A name of the constants table is refused: the launchers would still use the table's value."""
    opts = os.environ.get("EMBER_KERNEL_DEFINES", "").split()
    bad = [o for o in opts if not re.fullmatch(r"-D[A-Za-z_][A-Za-z0-9_]*(=[A-Za-z0-9_.+-]*)?", o)]
    if bad:
        raise ValueError(f"EMBER_KERNEL_DEFINES takes -DNAME or -DNAME=VALUE options, not {' '.join(bad)}")
    owned = [o for o in opts if o[2:].split("=")[0] in constants.KERNEL_CONSTANTS]
    if owned:
        raise ValueError(f"EMBER_KERNEL_DEFINES cannot set {' '.join(owned)}: kernels/constants.py owns it "
                         "(change it there, where the launchers read it too)")
    return opts


def module_options(name: str, arch: str) -> list[str]:
    spec = MODULES[name]
    base = BASE_OPTIONS if not is_ptx(arch) else tuple(o for o in BASE_OPTIONS if not o.startswith("--ptxas"))
    return [f"--gpu-architecture={check_target(arch)}", *base, *constants.defines(), *spec.options,
            *(("-DEMBER_TRACE",) if tracing() else ()), *sweep_defines()]


def cache_key(name: str, arch: str) -> str:
    """Hash of everything that decides the cubin: sources, headers, arch, NVRTC version, options."""
    spec = MODULES[name]
    h = hashlib.sha256()
    h.update(f"ember-kernels:{CACHE_FORMAT}\0{name}\0".encode())
    h.update((SOURCE_DIR / spec.source).read_bytes())
    for hname, data in _headers():
        h.update(b"\0" + hname.encode() + b"\0" + data)
    major, minor = nvrtc_version()
    h.update(f"\0{check_target(arch)}\0nvrtc {major}.{minor}\0".encode())
    h.update("\0".join(module_options(name, arch)).encode())
    return h.hexdigest()


@dataclass
class BuildResult:
    module: str
    arch: str
    path: Path
    cached: bool  # found in the cache (not compiled now)
    seconds: float
    cubin_bytes: int
    log: str = ""
    resources: dict[str, dict[str, int]] = field(default_factory=dict)


def compile_source(name: str, source: bytes, arch: str, options: list[str]) -> tuple[bytes, str]:
    """NVRTC: source -> (cubin, or PTX for a compute_XX target; log). Raises CompileError with the log."""
    nvrtc = _nvrtc()
    nvrtc_version()
    headers = _headers()
    (prog,) = _nvrtc_check(
        nvrtc.nvrtcCreateProgram(
            source, f"{name}.cu".encode(), len(headers), [d for _, d in headers], [n.encode() for n, _ in headers]
        ),
        "nvrtcCreateProgram",
    )
    try:
        opts = [o.encode() for o in options]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err = res[0] if isinstance(res, tuple) else res
        (size,) = _nvrtc_check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        _nvrtc_check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.rstrip(b"\0").decode(errors="replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(name, log, options)
        if is_ptx(arch):  # PTX text, NUL-terminated as cuModuleLoadData wants it
            (size,) = _nvrtc_check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            ptx = b" " * size
            _nvrtc_check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
            return ptx, log
        (size,) = _nvrtc_check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _nvrtc_check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_RES_FN = re.compile(r"Compiling entry function '([^']+)'")
_RES_REGS = re.compile(r"Used (\d+) registers")
_RES_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RES_SMEM = re.compile(r"(\d+) bytes smem")


def parse_resources(log: str) -> dict[str, dict[str, int]]:
    """ptxas -v output -> {kernel: {registers, stack, spill_stores, spill_loads, smem}}."""
    out: dict[str, dict[str, int]] = {}
    cur: dict[str, int] | None = None
    for line in log.splitlines():
        m = _RES_FN.search(line)
        if m:
            cur = out.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = _RES_SPILL.search(line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _RES_REGS.search(line)
        if m:
            cur["registers"] = int(m.group(1))
            s = _RES_SMEM.search(line)
            cur["smem"] = int(s.group(1)) if s else 0
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def build_module(name: str, arch: str, *, cache: str | os.PathLike[str] | None = None,
                 force: bool = False) -> BuildResult:
    """Compile one module for `arch` unless a cubin with the same key is cached; return where it is."""
    if name not in MODULES:
        raise KeyError(f"unknown kernel module {name!r} (known: {', '.join(MODULES)})")
    arch = check_target(arch)
    d = cache_dir(cache)
    key = cache_key(name, arch)
    path = d / f"{name}.{arch}.{key[:20]}.{'ptx' if is_ptx(arch) else 'cubin'}"
    meta_path = path.with_suffix(".json")
    t = time.perf_counter()
    if path.exists() and not force:
        log, resources = "", {}
        try:
            meta = json.loads(meta_path.read_text())
            log, resources = meta.get("log", ""), meta.get("resources", {})
        except (OSError, ValueError):
            pass
        return BuildResult(name, arch, path, True, time.perf_counter() - t, path.stat().st_size, log, resources)
    spec = MODULES[name]
    options = module_options(name, arch)
    cubin, log = compile_source(name, (SOURCE_DIR / spec.source).read_bytes(), arch, options)
    seconds = time.perf_counter() - t
    resources = parse_resources(log)
    major, minor = nvrtc_version()
    meta = {
        "module": name, "arch": arch, "key": key, "nvrtc": f"{major}.{minor}", "options": options,
        "source": spec.source, "seconds": round(seconds, 3), "log": log, "resources": resources,
    }
    _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    _atomic_write(path, cubin)
    return BuildResult(name, arch, path, False, seconds, len(cubin), log, resources)


def _build_one(args: tuple[str, str, str | None, bool]) -> BuildResult:
    name, arch, cache, force = args
    return build_module(name, arch, cache=cache, force=force)


def build_all(
    arch: str,
    *,
    cache: str | os.PathLike[str] | None = None,
    force: bool = False,
    modules: list[str] | None = None,
    jobs: int | None = None,
) -> list[BuildResult]:
    """Build every module (or `modules`) for `arch`. NVRTC holds the GIL, so `jobs` > 1 compiles in
    worker processes (spawned: safe even when the caller holds a CUDA context)."""
    arch = check_target(arch)
    nvrtc_version()  # fail early and clearly when NVRTC is missing
    names = list(modules or MODULES)
    for n in names:
        if n not in MODULES:
            raise KeyError(f"unknown kernel module {n!r} (known: {', '.join(MODULES)})")
    cache_s = str(cache_dir(cache))
    todo = [(n, arch, cache_s, force) for n in names]
    jobs = jobs if jobs is not None else min(len(todo), os.cpu_count() or 1)
    if jobs <= 1 or len(todo) <= 1:
        return [_build_one(a) for a in todo]
    import concurrent.futures as cf
    import multiprocessing as mp

    # modules whose cubin is cached need no worker process
    results: dict[str, BuildResult] = {}
    pending = []
    for a in todo:
        r = None if force else _cached(a[0], arch, cache_s)
        if r is not None:
            results[a[0]] = r
        else:
            pending.append(a)
    if pending:
        # longest first: matvec modules and attention dominate
        with cf.ProcessPoolExecutor(max_workers=min(jobs, len(pending)), mp_context=mp.get_context("spawn")) as ex:
            for r in ex.map(_build_one, pending):
                results[r.module] = r
    return [results[n] for n in names]


def _cached(name: str, arch: str, cache: str) -> BuildResult | None:
    key = cache_key(name, arch)
    path = Path(cache) / f"{name}.{arch}.{key[:20]}.{'ptx' if is_ptx(arch) else 'cubin'}"
    if not path.exists():
        return None
    return build_module(name, arch, cache=cache)


def load_cubin(name: str, arch: str, *, cache: str | os.PathLike[str] | None = None) -> bytes:
    """The cubin of module `name` for `arch`, compiled now if it is not cached."""
    return build_module(name, arch, cache=cache).path.read_bytes()
