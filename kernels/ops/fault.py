"""Launcher of fault.cu: a real illegal-address write, to prove the sticky-error path end to end (worker
--fault cuda-illegal-address)."""

from __future__ import annotations

from ..cuda_runtime import I64, Device


def fault_illegal_address(dev: Device) -> None:
    """Launch a kernel that writes far outside any allocation and synchronize: raises
    StickyCudaError (700, CUDA_ERROR_ILLEGAL_ADDRESS) and poisons this process's context. No twin: the
    fault is the result."""
    buf = dev.scratch("fault", 256)
    dev.kernel("fault", "fault_illegal_address").launch((1,), (1,), buf, I64(1 << 40))
    dev.synchronize()
