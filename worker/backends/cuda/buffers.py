"""Device buffers that grow to the largest a caller has needed, by name: a step's inputs whose sizes follow
its contexts (key lists, candidate rows), uploaded together in one copy, and a drafter's small per-draft
inputs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ember.kernels.cuda_runtime import Device, DeviceArray, HostBuffer

ARENA_ALIGN = 256  # each input's place in the arena starts as a cuMemAlloc'd buffer would (vector loads)


class GrowingBuffers:
    """A buffer is replaced when a larger one is asked for, so an address is stable only while the sizes
    asked stay within what it has: `moves` counts the replacements, which a captured graph's owner watches.
    before_move: called before a buffer is replaced (and freed): the owner waits there for the work still
    reading it (a step run ahead)."""

    def __init__(self, dev: Device, before_move: Callable[[], None] | None = None):
        self.dev = dev
        self._before_move = before_move
        self._have: dict[str, DeviceArray] = {}
        self.moves = 0  # buffers replaced by larger ones so far (what a captured graph must not have read)
        self._places: dict[str, tuple[int, int]] = {}  # upload()'s: name -> (byte offset, room) in the arena
        self._end = 0
        self._stage = np.zeros(0, np.uint8)

    def get(self, name: str, elems: int, dtype=np.float32) -> DeviceArray:
        a = self._have.get(name)
        if a is None or a.size < elems:
            if a is not None:
                self.moves += 1
                if self._before_move is not None:
                    self._before_move()
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

    def upload(self, host: dict[str, np.ndarray], stage: Callable[[int], HostBuffer] | None = None,
               stream=None) -> dict[str, DeviceArray]:
        """Each array on the device, all of them in one copy into one arena (a step's dozens of small inputs:
        one copy, not one each). A name keeps its place while its arrays fit the room it was given (its size
        to the next power of two); a larger one lays the arena out anew, a move. stage(nbytes): pinned host
        memory of at least nbytes to copy from, asynchronously on `stream` (behind the work queued there,
        which may still read the arena); without it, a synchronous copy."""
        arrays = {k: np.ascontiguousarray(v) for k, v in host.items()}
        if any(k in self._places and self._places[k][1] < a.nbytes for k, a in arrays.items()):
            rooms = {k: room for k, (_, room) in self._places.items()}
            for k, a in arrays.items():
                rooms[k] = max(rooms.get(k, 0), _room(a.nbytes))
            self._places, self._end = {}, 0
            for k, room in rooms.items():
                self._places[k], self._end = (self._end, room), self._end + room
            self.moves += 1
        for k, a in arrays.items():
            if k not in self._places:
                self._places[k], self._end = (self._end, _room(a.nbytes)), self._end + _room(a.nbytes)
        arena = self.get("arena", self._end, np.uint8)
        pinned = stage(self._end) if stage is not None else None
        if pinned is not None:
            buf = pinned.array
        else:
            if self._stage.size < self._end:
                self._stage = np.zeros(self._end, np.uint8)
            buf = self._stage
        for k, a in arrays.items():
            at = self._places[k][0]
            buf[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
        if pinned is not None:
            arena.view(0, self._end).upload_from(pinned, self._end, stream)
        else:
            arena.view(0, self._end).upload(buf[: self._end])
        return {k: arena.view(self._places[k][0], a.size, a.dtype) for k, a in arrays.items()}


def _room(nbytes: int) -> int:
    return max(ARENA_ALIGN, 1 << (max(nbytes, 1) - 1).bit_length())
