"""Argument checks and pointer arithmetic shared by the launchers (no kernels here)."""

from __future__ import annotations

import numpy as np

from ..constants import ACTIVATIONS, KERNEL_CONSTANTS
from ..cuda_runtime import DeviceArray, Pointer


def ptr_at(a: DeviceArray | None, offset_bytes: int = 0) -> Pointer:
    """A kernel argument pointing offset_bytes into `a` (None: a null pointer)."""
    return Pointer(0 if a is None else a.ptr + offset_bytes)


def need(a: DeviceArray, dtype, min_elems: int, what: str) -> None:
    """`a` holds at least min_elems elements of dtype; TypeError or ValueError naming `what` otherwise."""
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{what} must be {np.dtype(dtype).name}, not {a.dtype.name}")
    if a.size < min_elems:
        raise ValueError(f"{what} holds {a.size} elements; {min_elems} needed")


def act_code(act: str | None, *, none: bool = False) -> int:
    """A gated activation's kernel code (constants.ACTIVATIONS; None: ACT_NONE where `none` allows it);
    ValueError naming the ones there are otherwise."""
    if act is None and none:
        return KERNEL_CONSTANTS["ACT_NONE"]
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r} (have: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[act]
