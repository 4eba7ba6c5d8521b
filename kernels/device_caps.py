"""What a GPU can do, read once from the driver, and what the launchers choose from it: never the
GPU's name. Pure logic (no driver calls here; cuda_runtime.Device reads the attributes), so every choice
is testable on a machine without a GPU.

    caps = DeviceCaps.from_attributes(read)  # read(name) -> int, a CU_DEVICE_ATTRIBUTE_<name>
    caps = caps.for_compat("sm_86")          # EMBER_CUDA_COMPAT: exactly the paths an RTX 3090 gets
    target, warning = build_target(caps, nvrtc_archs)

Paths that depend on the architecture: thread block clusters and their distributed-shared-memory
merges (sm_90+; else split-K attention merges with attn_combine), programmatic dependent launch
(sm_90+; else plain launches), and how much shared memory a block may opt in to (227 KiB on Hopper,
163 KiB on A100, 99 KiB on the RTX cards and L40S), which sizes attention's staging and decides
whether flash attention's tiles fit. The tensor-core code is mma.sync with cp.async: sm_80 and up.

Compat mode (EMBER_CUDA_COMPAT=sm_80|sm_86|sm_89) makes the host choose exactly the paths that
architecture would get and limits shared memory to its value; the kernels are then compiled as PTX for
that virtual architecture (compute_80, ...) and the driver JIT-compiles them for the real GPU, so the
fallbacks are proven on the hardware at hand.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable

COMPAT_ENV = "EMBER_CUDA_COMPAT"
# shared memory a block may opt in to, by architecture (the CUDA programming guide's table)
COMPAT_SMEM_OPTIN = {"sm_80": 163 << 10, "sm_86": 99 << 10, "sm_89": 99 << 10}
MIN_CC = (8, 0)  # mma.sync m16n8k16, cp.async, ldmatrix: Ampere and up
# The architectures ember's kernels have been run on (native cubins), from which build_target picks the
# nearest one for a device it has never run on. Compat-mode runs prove the sm_8x host paths through
# PTX on Hopper, not those cards' own cubins.
RUN_ARCHS = ("sm_90",)

_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class DeviceCaps:
    cc: tuple[int, int]
    sm_count: int
    l2_bytes: int
    smem_optin: int  # bytes of shared memory one block may opt in to (static and dynamic together)
    clusters: bool  # thread block clusters and distributed shared memory (sm_90+)
    integrated: bool  # the GPU shares the host's memory (DGX Spark's GB10, Jetson): one budget for both
    managed: bool  # managed (unified) memory
    compat: str | None = None  # EMBER_CUDA_COMPAT: the architecture whose paths these are

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch (griddepcontrol): sm_90+."""
        return self.cc >= (9, 0)

    @classmethod
    def from_attributes(cls, read: Callable[[str], int]) -> DeviceCaps:
        """read(name): the CU_DEVICE_ATTRIBUTE_<name> of the device."""
        cc = (read("COMPUTE_CAPABILITY_MAJOR"), read("COMPUTE_CAPABILITY_MINOR"))
        return cls(cc=cc, sm_count=read("MULTIPROCESSOR_COUNT"), l2_bytes=read("L2_CACHE_SIZE"),
                   smem_optin=read("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
                   clusters=cc >= (9, 0) and bool(read("CLUSTER_LAUNCH")), integrated=bool(read("INTEGRATED")),
                   managed=bool(read("MANAGED_MEMORY")))

    def for_compat(self, arch: str | None) -> DeviceCaps:
        """The capabilities of `arch` (a COMPAT_SMEM_OPTIN key) on this device: its compute capability,
        no clusters or PDL below sm_90, and no more shared memory than it has. None: unchanged."""
        if not arch:
            return self
        if arch not in COMPAT_SMEM_OPTIN:
            raise ValueError(f"{COMPAT_ENV}={arch}: the compat modes are {', '.join(COMPAT_SMEM_OPTIN)}")
        cc = (int(arch[3]), int(arch[4:]))
        if cc > self.cc:
            raise ValueError(f"{COMPAT_ENV}={arch}: this GPU is {self.arch}; a compat mode emulates an older one")
        return dataclasses.replace(self, cc=cc, smem_optin=min(self.smem_optin, COMPAT_SMEM_OPTIN[arch]),
                                   clusters=False, compat=arch)


def compat_from_env(environ=None) -> str | None:
    value = (environ if environ is not None else os.environ).get(COMPAT_ENV, "").strip().lower()
    return value or None


def build_target(caps: DeviceCaps, nvrtc_archs: list[str]) -> tuple[str, str | None]:
    """What to compile the kernels for on this device, and a warning to print once (None: none).

    Compat mode: PTX for its virtual architecture (compute_86, ...), JIT-compiled by the driver. An
    architecture the kernels have run on (RUN_ARCHS): its own cubin. Another one: the nearest
    architecture they have run on, as a cubin where the device runs that architecture's code (the
    same major version, an older minor), else as PTX the driver compiles for it; and with no such
    architecture below it, the device's own cubin, NVRTC permitting."""
    if caps.cc < MIN_CC:
        raise ValueError(f"the GPU is {caps.arch}; ember's kernels need sm_80 (Ampere) or newer")
    if caps.compat:
        return f"compute_{caps.compat[3:]}", None
    arch = caps.arch
    if arch in RUN_ARCHS:
        return arch, None
    known = sorted((a for a in RUN_ARCHS if _cc(a) <= caps.cc), key=_cc)
    if known:
        near = known[-1]
        if _cc(near)[0] == caps.cc[0]:
            return near, (f"ember's kernels have not been run on {arch} yet; using its {near} build "
                          "(binary compatible)")
        return f"compute_{near[3:]}", (f"ember's kernels have not been run on {arch} yet; using the {near} "
                                       "kernels as PTX, compiled for this GPU by the driver")
    if arch in nvrtc_archs:
        return arch, f"ember's kernels have not been run on {arch} yet; built for it, untested"
    raise ValueError(f"NVRTC cannot target {arch} (it knows {', '.join(nvrtc_archs)}) and ember has no "
                     "build that runs there")


def _cc(arch: str) -> tuple[int, int]:
    digits = arch.split("_")[1].rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def warn_once(message: str | None, stream=None) -> None:
    if message and message not in _warned:
        _warned.add(message)
        print(f"ember: warning: {message}", file=stream or sys.stderr)
