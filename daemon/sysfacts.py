"""ember's version, and host, Python, driver and GPU facts for crash bundles and status. NVML through
ctypes when the library is present (no extra dependency); every call runs under a time limit, since
a GPU in trouble can make NVML slow exactly when a bundle is being written."""

from __future__ import annotations

import ctypes
import os
import platform
import socket
import sys
import threading
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import psutil


def ember_version() -> str:
    try:
        return version("ember")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def host_facts() -> dict[str, Any]:
    vm = psutil.virtual_memory()
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "cpus": os.cpu_count(),
        "memory_bytes": vm.total,
        "memory_available_bytes": vm.available,
        "boot_time": psutil.boot_time(),
    }


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml() -> dict[str, Any]:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return {"present": False}
    out: dict[str, Any] = {"present": True}
    if lib.nvmlInit_v2() != 0:
        return {"present": True, "error": "nvmlInit failed"}
    try:
        buf = ctypes.create_string_buffer(96)
        if lib.nvmlSystemGetDriverVersion(buf, 96) == 0:
            out["driver_version"] = buf.value.decode()
        v = ctypes.c_int()
        if lib.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(v)) == 0:
            out["cuda_driver_version"] = f"{v.value // 1000}.{(v.value % 1000) // 10}"
        n = ctypes.c_uint()
        gpus = []
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) == 0:
            for i in range(n.value):
                h = ctypes.c_void_p()
                if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) != 0:
                    continue
                g: dict[str, Any] = {"index": i}
                if lib.nvmlDeviceGetName(h, buf, 96) == 0:
                    g["name"] = buf.value.decode()
                if lib.nvmlDeviceGetUUID(h, buf, 96) == 0:
                    g["uuid"] = buf.value.decode()
                mem = _Memory()
                if lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(mem)) == 0:
                    g.update(memory_total=mem.total, memory_used=mem.used)
                t = ctypes.c_uint()
                if lib.nvmlDeviceGetTemperature(h, 0, ctypes.byref(t)) == 0:
                    g["temperature_c"] = t.value
                u = (ctypes.c_uint * 2)()
                if lib.nvmlDeviceGetUtilizationRates(h, ctypes.byref(u)) == 0:
                    g["utilization_gpu"] = u[0]
                gpus.append(g)
        out["gpus"] = gpus
    finally:
        lib.nvmlShutdown()
    return out


def gpu_facts(timeout: float = 3.0) -> dict[str, Any]:
    result: dict[str, Any] = {"present": False, "error": f"NVML did not answer within {timeout:g}s"}

    def run() -> None:
        nonlocal result
        try:
            result = _nvml()
        except Exception as e:  # ctypes signature mismatches, odd drivers
            result = {"present": True, "error": f"{type(e).__name__}: {e}"}

    t = threading.Thread(target=run, name="nvml", daemon=True)
    t.start()
    t.join(timeout)
    return result


if __name__ == "__main__":
    import json

    print(json.dumps({"host": host_facts(), "gpu": gpu_facts()}, indent=2))
