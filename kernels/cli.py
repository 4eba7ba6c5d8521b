"""`ember kernels ...`: build the CUDA kernels ahead of time (no GPU needed) and show what is cached.

    ember kernels build [--arch sm_90] [--cache-dir DIR] [--force] [--jobs N] [--module NAME ...] [-v]
    ember kernels list

Hooked into the worker's parser with ``add_kernels_parser(subparsers)``; handlers return the
contract's exit codes (ember.ops.contract.ExitCode): OK built, FAILURE a module failed to compile,
CONFIG when NVRTC / cuda-python is missing or the architecture is not one NVRTC knows.
"""

from __future__ import annotations

import argparse
import sys
import time

from ember.ops.contract import ExitCode, cache_dir

EX_OK, EX_FAIL, EX_CONFIG = ExitCode.OK, ExitCode.FAILURE, ExitCode.CONFIG


def add_kernels_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("kernels", help="build the CUDA kernels with NVRTC (no GPU needed) and list them")
    sub = p.add_subparsers(dest="kernels_verb", required=True)

    b = sub.add_parser("build", help="compile every kernel module for an architecture into the cubin cache")
    b.add_argument("--arch", default=None, metavar="SM",
                   help="target architecture, e.g. sm_90, or compute_86 for PTX (what EMBER_CUDA_COMPAT=sm_86 "
                        "loads); default: what the local GPU loads (device_caps.build_target), else sm_90")
    b.add_argument("--cache-dir", default=None, metavar="DIR",
                   help=f"cubin cache (default {cache_dir() / 'kernels'})")
    b.add_argument("--force", action="store_true", help="compile even when a cached cubin matches")
    b.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                   help="parallel NVRTC processes (default: cores)")
    b.add_argument("--module", action="append", default=None, metavar="NAME", help="only this module (repeatable)")
    b.add_argument("-v", "--verbose", action="store_true", help="print registers / spills of every kernel")
    b.set_defaults(func=cmd_kernels_build)

    ls = sub.add_parser("list", help="list the kernel modules and their sources")
    ls.set_defaults(func=cmd_kernels_list)
    return p


def _default_arch() -> str:
    try:
        from .cuda_runtime import try_device

        dev, _ = try_device()
        if dev is not None:
            return dev.target
    except Exception:
        pass
    return "sm_90"


def cmd_kernels_build(args: argparse.Namespace) -> int:
    from . import build
    from .errors import CompileError, CudaUnavailable

    try:
        arch = build.check_target(args.arch) if args.arch else _default_arch()
        major, minor = build.nvrtc_version()
        supported = build.supported_archs()
    except ValueError as e:
        print(f"ember: {e}", file=sys.stderr)
        return EX_CONFIG
    except CudaUnavailable as e:
        print(f"ember: cannot build kernels: {e}", file=sys.stderr)
        return EX_CONFIG
    base = "sm_" + arch.split("_")[1].rstrip("af")  # compute_86 (PTX for a compat mode) needs sm_86 too
    if base not in supported:
        print(f"ember: NVRTC {major}.{minor} cannot target {arch} (it supports {', '.join(supported)})",
              file=sys.stderr)
        return EX_CONFIG
    cache = build.cache_dir(args.cache_dir)
    print(f"building {len(args.module or build.MODULES)} kernel modules for {arch} with NVRTC {major}.{minor} "
          f"into {cache}")
    t = time.perf_counter()
    try:
        results = build.build_all(arch, cache=cache, force=args.force, modules=args.module, jobs=args.jobs)
    except KeyError as e:
        print(f"ember: {e.args[0]}", file=sys.stderr)
        return EX_CONFIG
    except CompileError as e:
        print(f"ember: {e}", file=sys.stderr)
        return EX_FAIL
    for r in results:
        n_fn = len(r.resources)
        spills = sum(v.get("spill_stores", 0) + v.get("spill_loads", 0) for v in r.resources.values())
        state = "cached" if r.cached else f"compiled in {r.seconds:.1f}s"
        extra = f", {n_fn} kernels" if n_fn else ""
        extra += f", {spills} bytes spilled" if spills else ""
        print(f"  {r.module:<14} {r.cubin_bytes / 1024:8.1f} KiB  {state}{extra}")
        if args.verbose:
            for fn, res in sorted(r.resources.items()):
                print(f"      {fn:<28} regs {res.get('registers', '?'):>3}  smem {res.get('smem', 0):>6}  "
                      f"stack {res.get('stack', 0):>4}  spill {res.get('spill_stores', 0)}/{res.get('spill_loads', 0)}")
    print(f"{len(results)} modules ready in {time.perf_counter() - t:.1f}s")
    return EX_OK


def cmd_kernels_list(args: argparse.Namespace) -> int:
    from . import build

    for name, spec in build.MODULES.items():
        opts = " ".join(spec.options)
        print(f"{name:<14} {spec.source:<14} {opts:<12} {spec.doc}")
    return EX_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ember")
    sub = parser.add_subparsers(dest="verb", required=True)
    add_kernels_parser(sub)
    args = parser.parse_args(["kernels", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":  # python -m ember.kernels.cli build --arch sm_90
    sys.exit(main())
