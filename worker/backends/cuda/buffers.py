"""Device buffers that grow to the largest a caller has needed, by name: a step's inputs whose sizes follow
its contexts (key lists, candidate rows) and a drafter's small per-draft inputs."""

from __future__ import annotations

import numpy as np

from ember.kernels.cuda_runtime import Device, DeviceArray


class GrowingBuffers:
    """A buffer is replaced when a larger one is asked for, so an address is stable only while the sizes
    asked stay within what it has: `moves` counts the replacements, which a captured graph's owner watches."""

    def __init__(self, dev: Device):
        self.dev = dev
        self._have: dict[str, DeviceArray] = {}
        self.moves = 0  # buffers replaced by larger ones so far (what a captured graph must not have read)

    def get(self, name: str, elems: int, dtype=np.float32) -> DeviceArray:
        a = self._have.get(name)
        if a is None or a.size < elems:
            self.moves += a is not None
            a = self._have[name] = self.dev.empty((max(elems, 1),), dtype)
        return a

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._have.values())

    def put(self, name: str, host: np.ndarray) -> DeviceArray:
        """`host` uploaded into the named buffer (its first host.size elements)."""
        host = np.ascontiguousarray(host)
        a = self.get(name, host.size, host.dtype)
        a.view(0, host.size).upload(host)
        return a

    def ints(self, name: str, values) -> DeviceArray:
        """put() of `values` as int32 (a kernel's row ids, positions, counts)."""
        return self.put(name, np.asarray(values, np.int32))
