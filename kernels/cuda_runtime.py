"""A small, checked layer over the CUDA driver API (cuda-python's ``cuda.bindings.driver``).

    dev = Device()                       # cuInit, primary context, made current in this thread
    a = dev.to_device(np.ones(4, np.float32))
    k = dev.kernel("norm", "rms_norm_f32_e4")   # module compiled by NVRTC (or read from the cache)
    k.launch((rows,), (256,), a, ...)    # arguments packed by their kind (see Kernel)
    dev.synchronize(); a.to_host()

Every driver call goes through ``check``: a failure raises ``CudaError`` with the CUresult code, its
name and the driver's message, and a sticky error (700 illegal address, 719 launch failed, ...; see
``errors.STICKY_CODES``) raises ``StickyCudaError`` and marks the device poisoned, so the worker can
report ``engine_poisoned`` and exit 75. Launches are asynchronous: a kernel's fault surfaces at the
next synchronizing call (``synchronize``, a copy to the host, an event wait).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import build
from .constants import KERNEL_CONSTANTS
from .device_caps import DeviceCaps, build_target, compat_from_env, warn_once
from .errors import CudaError, CudaUnavailable, StickyCudaError, cuda_error

_lock = threading.Lock()


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise CudaUnavailable(
            f"cuda-python is not installed ({e}); install the cuda extra: pip install 'ember[cuda]'") from e
    return driver


def error_name(code: int) -> tuple[str, str]:
    """(name, message) of a CUresult code, from the driver where it can say."""
    from .errors import STICKY_CODES

    name, msg = STICKY_CODES.get(code, f"CUDA_ERROR_{code}"), "unknown error"
    try:
        from cuda.bindings import driver as _d

        name = _d.CUresult(code).name
    except Exception:
        pass
    try:
        drv = _driver()
        err, n = drv.cuGetErrorName(drv.CUresult(code))
        if int(err) == 0 and n:
            name = n.decode() if isinstance(n, bytes) else str(n)
        err, m = drv.cuGetErrorString(drv.CUresult(code))
        if int(err) == 0 and m:
            msg = m.decode() if isinstance(m, bytes) else str(m)
    except Exception:  # an unknown code is not a reason to lose the original error
        pass
    return name, msg


_poisoned: StickyCudaError | None = None


def poisoned() -> StickyCudaError | None:
    """The sticky error that poisoned this process's context, if any."""
    return _poisoned


def check(result: Any, call: str = "") -> Any:
    """Unpack a cuda.bindings result ``(CUresult, *values)``: raise on error, else return the value(s)."""
    global _poisoned
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    code = int(err)
    if code != 0:
        name, msg = error_name(code)
        exc = cuda_error(code, name, msg, call)
        if isinstance(exc, StickyCudaError) and _poisoned is None:
            _poisoned = exc
        raise exc
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


# -- device -----------------------------------------------------------------------------------------

_NOT_AVAILABLE_CODES = {3, 34, 35, 100, 101, 804}  # not initialised, stub library, old driver, no device, ...


TRACE_WORDS = KERNEL_CONSTANTS["TRACE_WORDS"]  # common.cuh EMBER_TRACE: the count, then (start, release) pairs
TRACE_MARKS = KERNEL_CONSTANTS["TRACE_MARKS"]  # common.cuh TRACE_MARK: the SM clock at mark k in word TRACE_MARKS + k


def capped_memory(free: int, total: int, cap: int | None) -> tuple[int, int]:
    """(free, total) of a device of `cap` bytes holding all that this one holds (what is in use stays in use);
    a cap of None, or not below the device's size, changes nothing."""
    if cap is None or cap >= total:
        return free, total
    return max(0, free - (total - cap)), cap


class Device:
    """One GPU's primary context. Create it once per process; call ``make_current`` in every other
    thread that launches work (the engine loop's thread)."""

    def __init__(self, ordinal: int = 0, *, cache: str | None = None):
        drv = _driver()
        try:
            err = drv.cuInit(0)
        except Exception as e:  # no libcuda at all (cuda.pathfinder raises its own error type)
            raise CudaUnavailable(f"no CUDA driver library ({type(e).__name__}: {e})") from e
        err = err[0] if isinstance(err, tuple) else err
        if int(err) != 0:
            name, msg = error_name(int(err))
            if int(err) in _NOT_AVAILABLE_CODES:
                raise CudaUnavailable(f"CUDA is not usable: {name} ({int(err)}): {msg}")
            check(err, "cuInit")
        count = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if count <= ordinal:
            raise CudaUnavailable(f"no CUDA device {ordinal} (the driver sees {count})")
        self.ordinal = ordinal
        self.cache = cache
        # bytes this process counts as the device's (--gpu-mem): memory_info reports a device of this size
        # with every allocation on the real one (the CUDA context's included) in use; None: the device's own
        self.memory_cap: int | None = None
        self.handle = check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = check(drv.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self.make_current()
        raw = check(drv.cuDeviceGetName(256, self.handle), "cuDeviceGetName")
        self.name = (raw.split(b"\0")[0].decode() if isinstance(raw, bytes) else str(raw)).strip()
        A = drv.CUdevice_attribute
        native = DeviceCaps.from_attributes(lambda n: self.attribute(getattr(A, f"CU_DEVICE_ATTRIBUTE_{n}")))
        self.arch = native.arch  # the GPU's own
        try:
            # what the launchers choose their paths from (a compat mode's, where EMBER_CUDA_COMPAT says)
            self.caps = native.for_compat(compat_from_env())
            self.target, warning = build_target(self.caps, build.supported_archs())  # what the kernels build for
        except ValueError as e:
            raise CudaUnavailable(str(e)) from None
        warn_once(warning)
        self.cc = self.caps.cc
        self.sm_count = self.caps.sm_count
        self.l2_bytes = self.caps.l2_bytes
        self.total_memory = int(check(drv.cuDeviceTotalMem(self.handle), "cuDeviceTotalMem"))
        self._modules: dict[str, Module] = {}
        # `ember bench trace` (worker/bench/trace.py): with EMBER_TRACE=1 the kernels time-stamp their
        # launches into this buffer, and launch_names lists what was launched, in order
        self.trace = None
        self.launch_names: list[str] = []
        self.launch_shapes: list[str] = []
        self._scratch: dict[str, DeviceArray] = {}
        self._released = False
        if build.tracing():
            self.trace = DeviceArray(self, (TRACE_WORDS,), np.uint64)
            self.trace.zero()

    def attribute(self, attr) -> int:
        return int(check(_driver().cuDeviceGetAttribute(attr, self.handle), "cuDeviceGetAttribute"))

    def make_current(self) -> None:
        check(_driver().cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def synchronize(self) -> None:
        check(_driver().cuCtxSynchronize(), "cuCtxSynchronize")

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory, as a device of memory_cap bytes would report them where a
        cap below the device's size is set."""
        free, total = check(_driver().cuMemGetInfo(), "cuMemGetInfo")
        return capped_memory(int(free), int(total), self.memory_cap)

    # modules and kernels
    def module(self, name: str) -> Module:
        with _lock:
            mod = self._modules.get(name)
            if mod is None:
                cubin = build.load_cubin(name, self.target, cache=self.cache)
                mod = Module(self, name, cubin)
                self._modules[name] = mod
            return mod

    def kernel(self, module: str, function: str) -> Kernel:
        return self.module(module).function(function)

    # memory
    def empty(self, shape: int | Sequence[int], dtype: Any = np.float32) -> DeviceArray:
        return DeviceArray(self, shape, dtype)

    def to_device(self, arr: np.ndarray) -> DeviceArray:
        arr = np.ascontiguousarray(arr)
        out = DeviceArray(self, arr.shape, arr.dtype)
        out.upload(arr)
        return out

    def pinned(self, nbytes: int) -> HostBuffer:
        """Page-locked host memory of nbytes (what asynchronous copies to and from the device need)."""
        return HostBuffer(nbytes)

    def event(self) -> Event:
        """A point in a stream's work the host can wait for."""
        return Event()

    def scratch(self, key: str, nbytes: int, zero: bool = False) -> DeviceArray:
        """A reusable device buffer of at least nbytes (grown on demand), e.g. split-K partials; zero:
        zeroed when (re)allocated (for users that leave it zeroed, like the sampler's counters)."""
        buf = self._scratch.get(key)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                buf.free()
            buf = DeviceArray(self, (max(nbytes, 256),), np.uint8)
            if zero:
                buf.zero()
            self._scratch[key] = buf
        return buf

    def close(self) -> None:
        """Free the scratch buffers, unload modules, release the primary context."""
        if self._released:
            return
        self._released = True
        if _poisoned is not None:
            return  # nothing can be freed in a poisoned context; the process must exit
        for b in self._scratch.values():
            b.free()
        for m in self._modules.values():
            m.unload()
        self._modules.clear()
        check(_driver().cuDevicePrimaryCtxRelease(self.handle), "cuDevicePrimaryCtxRelease")

    def __repr__(self) -> str:
        compat = f", compat {self.caps.compat}" if self.caps.compat else ""
        return f"Device({self.ordinal}: {self.name}, {self.arch}{compat}, {self.sm_count} SMs)"


# -- modules and launches ---------------------------------------------------------------------------


class Module:
    def __init__(self, device: Device, name: str, cubin: bytes):
        self.device, self.name = device, name
        image = np.frombuffer(cubin, dtype=np.uint8)
        self._image = image  # keep alive during the call
        self.handle = check(_driver().cuModuleLoadData(image.ctypes.data), f"cuModuleLoadData({name})")
        self._functions: dict[str, Kernel] = {}
        if device.trace is not None:  # a profiling build: point the module's kernels at the trace buffer
            err, ptr, _ = _driver().cuModuleGetGlobal(self.handle, b"ember_trace_buf")
            if int(err) == 0:  # (a module whose kernels never wait has none)
                value = np.array([device.trace.ptr], np.uint64)
                check(_driver().cuMemcpyHtoD(ptr, value.ctypes.data, 8), "cuMemcpyHtoD")

    def function(self, name: str) -> Kernel:
        k = self._functions.get(name)
        if k is None:
            h = check(_driver().cuModuleGetFunction(self.handle, name.encode()),
                      f"cuModuleGetFunction({self.name}.{name})")
            k = Kernel(self, name, h)
            self._functions[name] = k
        return k

    def unload(self) -> None:
        if self.handle is not None:
            check(_driver().cuModuleUnload(self.handle), "cuModuleUnload")
            self.handle = None


def _stream_handle(stream: Any) -> Any:
    """A Stream, a raw CUstream handle, or 0/None for the default stream."""
    if stream is None:
        return 0
    return getattr(stream, "handle", stream)


@dataclass(frozen=True)
class I32:
    value: int


@dataclass(frozen=True)
class I64:
    value: int


@dataclass(frozen=True)
class F32:
    value: float


def _ctype(arg: Any):
    """Kernel argument -> ctypes value: device arrays and None -> 64-bit pointer, I32/I64/F32 as
    named, plain int -> 32-bit int, plain float -> float32."""
    if arg is None:
        return ctypes.c_uint64(0)
    if isinstance(arg, DeviceArray):
        return ctypes.c_uint64(arg.ptr)
    if isinstance(arg, I32):
        return ctypes.c_int32(arg.value)
    if isinstance(arg, I64):
        return ctypes.c_int64(arg.value)
    if isinstance(arg, F32):
        return ctypes.c_float(arg.value)
    if isinstance(arg, Pointer):
        return ctypes.c_uint64(arg.value)
    if isinstance(arg, (bool, int, np.integer)):
        return ctypes.c_int32(int(arg))
    if isinstance(arg, (float, np.floating)):
        return ctypes.c_float(float(arg))
    raise TypeError(f"unsupported kernel argument {arg!r}")


@dataclass(frozen=True)
class Pointer:
    value: int


class Kernel:
    def __init__(self, module: Module, name: str, handle):
        self.module, self.name, self.handle = module, name, handle
        self._smem_limit: int | None = None  # dynamic shared memory allowed now (None: not read yet)
        self._static_smem = 0

    def _allow_smem(self, nbytes: int) -> None:
        """Opt in to more dynamic shared memory than the 48 KiB a block gets by default, static included
        (once per size increase)."""
        if nbytes <= 0:
            return
        if self._smem_limit is None:
            self._static_smem = self.attribute(_driver().CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            self._smem_limit = max(0, (48 << 10) - self._static_smem)
        if nbytes > self._smem_limit:
            # the device's (or its compat mode's) opt-in limit: a launcher that asks for more chose a path
            # this architecture does not have
            optin = self.module.device.caps.smem_optin
            if nbytes + self._static_smem > optin:
                raise ValueError(f"{self.module.name}.{self.name}: {nbytes} + {self._static_smem} bytes of shared "
                                 f"memory, more than the {optin} a block of this device may have")
            drv = _driver()
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(drv.cuFuncSetAttribute(self.handle, attr, int(nbytes)), f"cuFuncSetAttribute({self.name})")
            self._smem_limit = nbytes

    def attribute(self, attr) -> int:
        return int(check(_driver().cuFuncGetAttribute(attr, self.handle), "cuFuncGetAttribute"))

    def launch(self, grid: Iterable[int], block: Iterable[int], *args: Any, smem: int = 0, stream: Any = 0,
               cluster: tuple[int, int, int] | None = None) -> None:
        """cluster: the CTAs per thread block cluster in x, y, z (sm_90; grid a multiple of it)."""
        g = tuple(int(v) for v in grid) + (1, 1)
        b = tuple(int(v) for v in block) + (1, 1)
        if min(g[:3]) <= 0:
            return  # empty launch
        if self.module.device.trace is not None:
            self.module.device.launch_names.append(self.name)
            # the launch's grid and its first integer arguments (a matvec's rows and columns, say): which
            # matrix a launch of a kernel run many times a step was
            ints = [int(a) for a in args if isinstance(a, int) and not isinstance(a, bool)][:4]
            self.module.device.launch_shapes.append(f"grid {'x'.join(map(str, g[:3]))} {ints}")
        values = [_ctype(a) for a in args]
        ptrs = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        drv = _driver()
        self._allow_smem(int(smem))
        if _pdl.active or cluster:
            cfg = drv.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = g[:3]
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = b[:3]
            cfg.sharedMemBytes = int(smem)
            h = _stream_handle(stream)
            cfg.hStream = drv.CUstream(h) if isinstance(h, int) else h
            cfg.attrs = (([_pdl_attribute()] if _pdl.active else [])
                         + ([_cluster_attribute(*cluster)] if cluster else []))
            cfg.numAttrs = len(cfg.attrs)
            check(drv.cuLaunchKernelEx(cfg, self.handle, ctypes.addressof(ptrs), 0),
                  f"cuLaunchKernelEx({self.module.name}.{self.name})")
            return
        check(
            drv.cuLaunchKernel(
                self.handle, g[0], g[1], g[2], b[0], b[1], b[2], int(smem), _stream_handle(stream),
                ctypes.addressof(ptrs), 0
            ),
            f"cuLaunchKernel({self.module.name}.{self.name})",
        )


class _PdlState(threading.local):
    active = False


_pdl = _PdlState()


@functools.lru_cache(maxsize=1)
def _pdl_attribute():
    drv = _driver()
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    return attr


@functools.cache
def _cluster_attribute(x: int, y: int, z: int):
    drv = _driver()
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = int(x), int(y), int(z)
    return attr


@contextlib.contextmanager
def pdl_launches(enabled: bool = True):
    """Launch kernels in this block (this thread) with programmatic dependent launch: each may start
    while the one before it in the stream still runs, and waits in grid_dependency_sync()
    (common.cuh) for its data. Every kernel of ember's modules makes that call first; captured into a
    graph, the edges become programmatic ones, so a decode step's launch gaps overlap."""
    before = _pdl.active
    _pdl.active = enabled
    try:
        yield
    finally:
        _pdl.active = before


# -- memory -------------------------------------------------------------------------------------------


class DeviceArray:
    """A device allocation (or a view into one) with a numpy shape and dtype."""

    def __init__(self, device: Device, shape: int | Sequence[int], dtype: Any = np.float32, *,
                 _base: DeviceArray | None = None, _ptr: int | None = None):
        self.device = device
        # np.isscalar's TypeIs names complex, not int: mypy narrows neither branch of an int | Sequence[int]
        self.shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)  # type: ignore[arg-type, union-attr]
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self._base = _base
        if _ptr is not None:
            self.ptr, self._owned = int(_ptr), False
        else:
            p = check(_driver().cuMemAlloc(max(self.nbytes, 1)), f"cuMemAlloc({self.nbytes})")
            self.ptr, self._owned = int(p), True

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def view(self, offset_elements: int, shape: int | Sequence[int], dtype: Any = None) -> DeviceArray:
        """A non-owning view starting offset_elements (of this array's dtype) in."""
        dt = np.dtype(dtype) if dtype is not None else self.dtype
        v = DeviceArray(self.device, shape, dt, _base=self, _ptr=self.ptr + offset_elements * self.dtype.itemsize)
        if v.ptr + v.nbytes > self.ptr + self.nbytes:
            raise ValueError("view exceeds the array")
        return v

    def view_bytes(self, offset_bytes: int, count: int, dtype: Any) -> DeviceArray:
        """A non-owning view of `count` elements of `dtype` starting offset_bytes in."""
        dt = np.dtype(dtype)
        if offset_bytes % dt.itemsize:
            raise ValueError(f"offset {offset_bytes} is not aligned for {dt.name}")
        v = DeviceArray(self.device, count, dt, _base=self, _ptr=self.ptr + offset_bytes)
        if v.ptr + v.nbytes > self.ptr + self.nbytes:
            raise ValueError("view exceeds the array")
        return v

    def upload_from(self, host: HostBuffer, nbytes: int, stream: Any, host_offset: int = 0) -> None:
        """Asynchronous copy of nbytes from pinned host memory, ordered on `stream`."""
        if nbytes > self.nbytes or host_offset + nbytes > host.nbytes:
            raise ValueError("copy exceeds a buffer")
        if nbytes:
            check(_driver().cuMemcpyHtoDAsync(self.ptr, host.ptr + host_offset, nbytes, _stream_handle(stream)),
                  "cuMemcpyHtoDAsync")

    def copy_from(self, src: DeviceArray, nbytes: int, stream: Any) -> None:
        """Asynchronous device-to-device copy of nbytes from `src`, ordered on `stream`."""
        if nbytes > self.nbytes or nbytes > src.nbytes:
            raise ValueError("copy exceeds a buffer")
        if nbytes:
            check(_driver().cuMemcpyDtoDAsync(self.ptr, src.ptr, nbytes, _stream_handle(stream)), "cuMemcpyDtoDAsync")

    def download_into(self, host: HostBuffer, nbytes: int, stream: Any, host_offset: int = 0) -> None:
        """Asynchronous copy of nbytes into pinned host memory; done once `stream` is synchronized."""
        if nbytes > self.nbytes or host_offset + nbytes > host.nbytes:
            raise ValueError("copy exceeds a buffer")
        if nbytes:
            check(_driver().cuMemcpyDtoHAsync(host.ptr + host_offset, self.ptr, nbytes, _stream_handle(stream)),
                  "cuMemcpyDtoHAsync")

    def upload(self, arr: np.ndarray) -> None:
        """Copy from host memory, landed when this returns. A cuMemcpyHtoD from pageable memory returns once
        the data is staged, before its DMA lands, and the backend's non-blocking streams do not wait for the
        legacy stream it runs on: a kernel queued next on them could read the old bytes (it did, under
        another process's load: the host attention fallback's output), so the legacy stream is waited for."""
        arr = np.ascontiguousarray(arr)
        if arr.nbytes != self.nbytes:
            raise ValueError(f"upload of {arr.nbytes} bytes into a {self.nbytes}-byte array")
        if self.nbytes:
            check(_driver().cuMemcpyHtoD(self.ptr, arr.ctypes.data, self.nbytes), "cuMemcpyHtoD")
            check(_driver().cuStreamSynchronize(_stream_handle(None)), "cuStreamSynchronize")

    def to_host(self) -> np.ndarray:
        out = np.empty(self.shape, dtype=self.dtype)
        if self.nbytes:
            check(_driver().cuMemcpyDtoH(out.ctypes.data, self.ptr, self.nbytes), "cuMemcpyDtoH")
        return out

    def fill_bytes(self, value: int) -> None:
        """Set every byte (0xFF poisons floats as NaN and ints as -1), finished when this returns (the
        memset runs on the legacy stream, which the backend's non-blocking streams do not wait for)."""
        if self.nbytes:
            check(_driver().cuMemsetD8(self.ptr, value & 0xFF, self.nbytes), "cuMemsetD8")
            self.device.synchronize()

    def poison(self) -> None:
        self.fill_bytes(0xFF)

    def zero(self) -> None:
        self.fill_bytes(0)

    def free(self) -> None:
        if self._owned and self.ptr and _poisoned is None:
            check(_driver().cuMemFree(self.ptr), "cuMemFree")
        self.ptr, self._owned = 0, False

    def __del__(self):
        if getattr(self, "_owned", False) and self.ptr and _poisoned is None:
            with contextlib.suppress(Exception):
                _driver().cuMemFree(self.ptr)

    def __repr__(self) -> str:
        return f"DeviceArray({self.shape}, {self.dtype}, 0x{self.ptr:x})"


def copy_2d(*, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, to_host: bool) -> None:
    """A strided copy of `height` rows of `width` bytes between device and (pageable) host memory in
    one driver call: one KV block of every layer, which sit a layer's pool apart."""
    drv = _driver()
    p = drv.CUDA_MEMCPY2D()
    dev_t, host_t = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE, drv.CUmemorytype.CU_MEMORYTYPE_HOST
    if to_host:
        p.srcMemoryType, p.srcDevice, p.dstMemoryType, p.dstHost = dev_t, src, host_t, dst
    else:
        p.srcMemoryType, p.srcHost, p.dstMemoryType, p.dstDevice = host_t, src, dev_t, dst
    p.srcPitch, p.dstPitch, p.WidthInBytes, p.Height = src_pitch, dst_pitch, width, height
    check(drv.cuMemcpy2D(p), "cuMemcpy2D")


class HostBuffer:
    """Page-locked host memory (what asynchronous copies need) with a uint8 numpy view, `array`."""

    def __init__(self, nbytes: int):
        import ctypes

        self.nbytes = max(int(nbytes), 8)
        self.ptr = int(check(_driver().cuMemHostAlloc(self.nbytes, 0), f"cuMemHostAlloc({self.nbytes})"))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.ptr))

    def free(self) -> None:
        if self.ptr and _poisoned is None:
            check(_driver().cuMemFreeHost(self.ptr), "cuMemFreeHost")
        self.ptr, self.array = 0, np.zeros(0, np.uint8)  # a freed buffer has nothing to view

    def __del__(self):
        if getattr(self, "ptr", 0) and _poisoned is None:
            with contextlib.suppress(Exception):
                _driver().cuMemFreeHost(self.ptr)


# -- timing -------------------------------------------------------------------------------------------


class Timer:
    """Device-event timing of the work launched between start() and stop() (milliseconds)."""

    def __init__(self):
        drv = _driver()
        self._a = check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")
        self._b = check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")

    def start(self, stream: Any = 0) -> None:
        check(_driver().cuEventRecord(self._a, _stream_handle(stream)), "cuEventRecord")

    def stop(self, stream: Any = 0) -> float:
        drv = _driver()
        check(drv.cuEventRecord(self._b, _stream_handle(stream)), "cuEventRecord")
        check(drv.cuEventSynchronize(self._b), "cuEventSynchronize")
        return float(check(drv.cuEventElapsedTime(self._a, self._b), "cuEventElapsedTime"))


class Event:
    """A point in a stream's work to wait for (no timing: the cheapest kind to record)."""

    def __init__(self):
        drv = _driver()
        self.handle = check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def record(self, stream: Any = 0) -> None:
        check(_driver().cuEventRecord(self.handle, _stream_handle(stream)), "cuEventRecord")

    def synchronize(self) -> None:
        check(_driver().cuEventSynchronize(self.handle), "cuEventSynchronize")


class Stream:
    """A non-blocking stream (graph capture needs one; the legacy default stream cannot be captured)."""

    def __init__(self):
        drv = _driver()
        self.handle = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")

    def synchronize(self) -> None:
        check(_driver().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def wait(self, event: Event) -> None:
        """Work queued on this stream from now on starts after `event` (recorded on another stream)."""
        check(_driver().cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")

    def destroy(self) -> None:
        if self.handle is not None and _poisoned is None:
            check(_driver().cuStreamDestroy(self.handle), "cuStreamDestroy")
        self.handle = None


class Graph:
    """Record the launches made on `stream` inside ``with Graph.capture(stream) as g:``, then replay
    them all with one ``g.launch()`` (CUDA graphs: one host call for a whole decode step)."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.graph = None
        self.exec = None

    @classmethod
    def capture(cls, stream: Stream) -> Graph:
        return cls(stream)

    def __enter__(self) -> Graph:
        drv = _driver()
        check(drv.cuStreamBeginCapture(self.stream.handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              "cuStreamBeginCapture")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        drv = _driver()
        graph = check(drv.cuStreamEndCapture(self.stream.handle), "cuStreamEndCapture")
        if exc_type is not None:
            return
        self.graph = graph
        self.exec = check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def launch(self) -> None:
        check(_driver().cuGraphLaunch(self.exec, self.stream.handle), "cuGraphLaunch")

    def destroy(self) -> None:
        if _poisoned is None:
            drv = _driver()
            if self.exec is not None:
                check(drv.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
            if self.graph is not None:
                check(drv.cuGraphDestroy(self.graph), "cuGraphDestroy")
        self.exec = self.graph = None


def try_device(ordinal: int = 0) -> tuple[Device | None, str]:
    """(Device, '') where CUDA works, else (None, why): for skipping tests and for `ember kernels`."""
    try:
        return Device(ordinal), ""
    except CudaUnavailable as e:
        return None, str(e)
    except CudaError as e:
        return None, str(e)


__all__ = [
    "CudaError", "CudaUnavailable", "Device", "DeviceArray", "F32", "HostBuffer", "copy_2d", "I32", "I64", "Kernel",
    "Module", "Event", "Graph", "Pointer", "Stream", "StickyCudaError", "Timer", "check", "error_name", "pdl_launches",
    "poisoned", "try_device",
]
