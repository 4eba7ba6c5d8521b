"""Launcher of fault.cu: a real illegal-address write, to prove the sticky-error path end to end (worker
--fault cuda-illegal-address)."""

from __future__ import annotations

from ..cuda_runtime import I64, Device

# The write goes to the null page (address 16), which no allocation of the device or the host maps; a
# write at a fixed distance past an allocation (4 TiB, until 2026-12-04) could land in mapped memory
# where the GPU shares the process's address space with the host (HMM, unified memory).
FAULT_ARGS = (None, I64(4))  # float* p = nullptr, offset 4 floats


def fault_illegal_address(dev: Device) -> None:
    """Launch a kernel that writes to the null page and synchronize: raises StickyCudaError (700,
    CUDA_ERROR_ILLEGAL_ADDRESS) and poisons this process's context. No twin: the fault is the result."""
    dev.kernel("fault", "fault_illegal_address").launch((1,), (1,), *FAULT_ARGS)
    dev.synchronize()
