"""Errors of the CUDA layer. Nothing here imports cuda-python, so the worker can map them anywhere.

    CudaUnavailable    no driver, no device or no cuda-python/NVRTC: a configuration problem
    CudaError          a CUDA call failed; the context is still usable (bad argument, out of memory)
    StickyCudaError    a sticky error: the context is poisoned and every later call fails too; the
                       worker reports ``engine_poisoned`` with code, name and message and exits 75
    CompileError       NVRTC rejected a kernel source (the log is attached)
"""

from __future__ import annotations

from ember.ops.contract import STICKY_CUDA_ERRORS

# CUresult codes after which the CUDA context is unusable ("sticky": every later call in the process
# returns the same error; only a new process recovers): the contract's one list, which the daemon reads too.
STICKY_CODES: dict[int, str] = STICKY_CUDA_ERRORS


class CudaUnavailable(RuntimeError):
    """CUDA cannot be used here: no driver library, no device, or cuda-python / NVRTC not installed."""


class CudaError(RuntimeError):
    """A CUDA driver call failed with `code` (CUresult), `name` (e.g. CUDA_ERROR_OUT_OF_MEMORY) and the
    driver's `message`; `call` names the API function."""

    def __init__(self, code: int, name: str, message: str, call: str = ""):
        self.code, self.name, self.message, self.call = int(code), name, message, call
        where = f" in {call}" if call else ""
        super().__init__(f"{name} ({self.code}){where}: {message}")

    @property
    def sticky(self) -> bool:
        return self.code in STICKY_CODES


class StickyCudaError(CudaError):
    """The context is poisoned (e.g. 700 illegal address): nothing more can run in this process."""


def cuda_error(code: int, name: str, message: str, call: str = "") -> CudaError:
    """The right exception class for a failed call: StickyCudaError for sticky codes."""
    cls = StickyCudaError if int(code) in STICKY_CODES else CudaError
    return cls(code, name, message, call)


class CompileError(RuntimeError):
    """NVRTC could not compile a kernel module; `log` is the compiler's output."""

    def __init__(self, module: str, log: str, options: list[str] | None = None):
        self.module, self.log, self.options = module, log, list(options or [])
        super().__init__(f"NVRTC failed to compile kernel module {module!r}:\n{log.strip()}")

    def __reduce__(self):  # rebuilt whole when raised in a build worker process
        return (CompileError, (self.module, self.log, self.options))
