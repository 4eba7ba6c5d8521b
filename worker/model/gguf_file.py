"""A memory-mapped GGUF reader.

`gguf.GGUFReader` builds numpy views for every metadata item and spends seconds on a 262k-token
vocabulary; a worker that restarts after a crash cannot afford that. This reader parses the header
with `struct` straight from an mmap, keeps tensor data as zero-copy views into the mapping, and turns
every malformed input into one `ModelFileError` line that names the file and the problem.

A model split into shards (llama.cpp's gguf-split, or a converter's --split-max-size: NAME-00001-of-0000N.gguf,
the first holding the metadata, every shard its own tensors and split.* keys) opens from its first shard; the
others are found beside it by that naming, as llama.cpp finds them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"

# GGUF metadata value types (gguf spec).
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = range(10)
_UINT64, _INT64, _FLOAT64 = 10, 11, 12
_SCALAR_FORMATS = {
    _UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I", _INT32: "<i",
    _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q", _FLOAT64: "<d",
}
_NUMPY_DTYPES = {
    _UINT8: np.uint8, _INT8: np.int8, _UINT16: np.uint16, _INT16: np.int16, _UINT32: np.uint32,
    _INT32: np.int32, _FLOAT32: np.float32, _BOOL: np.bool_, _UINT64: np.uint64,
    _INT64: np.int64, _FLOAT64: np.float64,
}


class ModelFileError(Exception):
    """A model file that cannot be used; str() is one line naming the file and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous (row) dimension
    ggml_type: GGMLQuantizationType
    offset: int  # absolute offset of the data in its file
    nbytes: int
    shard: int = 0  # which file of a split model holds it (0: the first, or the only one)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def rows(self) -> int:
        return self.n_elements // self.shape[0]


class _Cursor:
    """Bounds-checked sequential reads from a buffer."""

    def __init__(self, path: str, buf: memoryview):
        self.path, self.buf, self.pos = path, buf, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelFileError(self.path, f"truncated or corrupt header (while reading {what})")

    def scalar(self, vtype: int, what: str) -> Any:
        fmt = _SCALAR_FORMATS[vtype]
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar(_UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(_UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def string_array(self, count: int, what: str) -> list[str]:
        """A tight loop for the one hot spot: vocabularies of 100k+ strings."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, what)
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                self.pos = pos
                self.need(n, what)
            append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.u32(what)
            count = self.u64(what)
            if etype == _STRING:
                return self.string_array(count, what)
            if etype in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[etype]).newbyteorder("<")
                self.need(count * dtype.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += count * dtype.itemsize
                return arr
            if etype == _ARRAY:
                return [self.value(_ARRAY, what) for _ in range(count)]
            raise ModelFileError(self.path, f"corrupt metadata: unknown array element type {etype} in {what}")
        if vtype in _SCALAR_FORMATS:
            return self.scalar(vtype, what)
        raise ModelFileError(self.path, f"corrupt metadata: unknown value type {vtype} in {what}")


class _Mapped:
    """One file, memory-mapped, its header parsed: metadata, and its tensor table (offsets in this file)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(self.path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                if self.size < 24:
                    raise ModelFileError(self.path, f"too small to be a GGUF file ({self.size} bytes)")
                self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise ModelFileError(self.path, "no such file") from None
        except IsADirectoryError:
            raise ModelFileError(self.path, "is a directory, not a GGUF file") from None
        except PermissionError:
            raise ModelFileError(self.path, "permission denied") from None
        self.buf = memoryview(self.mmap)
        self.metadata: dict[str, Any] = {}
        self.tensors: list[TensorInfo] = []
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> None:
        path = str(self.path)
        if bytes(self.buf[:4]) != GGUF_MAGIC:
            raise ModelFileError(path, f"not a GGUF file (magic {bytes(self.buf[:4])!r}, expected b'GGUF')")
        cur = _Cursor(path, self.buf)
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in (2, 3):
            raise ModelFileError(path, f"unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise ModelFileError(path, "corrupt header (implausible tensor or metadata count)")
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.u32(f"type of {key}")
            self.metadata[key] = cur.value(vtype, key)
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.u32(f"dims of {name}")
            if n_dims > 4:
                raise ModelFileError(path, f"corrupt tensor info for {name} ({n_dims} dimensions)")
            shape = tuple(cur.u64(f"shape of {name}") for _ in range(n_dims))
            raw_type = cur.u32(f"type of {name}")
            offset = cur.u64(f"offset of {name}")
            try:
                ggml_type = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ModelFileError(path, f"tensor {name} has unknown ggml type {raw_type}") from None
            infos.append((name, shape, ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ModelFileError(path, f"corrupt header (alignment {alignment})")
        self.data_offset = (cur.pos + alignment - 1) // alignment * alignment
        self.header_size = cur.pos
        for name, shape, ggml_type, offset in infos:
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            n_el = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if shape and shape[0] % block:
                raise ModelFileError(path, f"tensor {name}: row of {shape[0]} is not a multiple of the "
                                           f"{ggml_type.name} block")
            nbytes = n_el // block * type_size
            start = self.data_offset + offset
            if start + nbytes > self.size:
                raise ModelFileError(
                    path, f"truncated: tensor {name} needs bytes up to {start + nbytes}, file has {self.size}"
                )
            self.tensors.append(TensorInfo(name, shape, ggml_type, start, nbytes))

    def digest(self, h: Any) -> None:
        """Feed h this file's cheap identity: size, header bytes and 16 samples of tensor data (no full read)."""
        h.update(self.size.to_bytes(8, "little"))
        h.update(self.buf[: self.header_size])
        span = max(self.size - self.data_offset, 1)
        for i in range(16):
            off = self.data_offset + span * i // 16
            h.update(self.buf[off : off + 65536])

    def close(self) -> None:
        self.buf.release()
        with contextlib.suppress(BufferError):  # numpy views still alive; the mapping goes with them
            self.mmap.close()


def _split_key(f: _Mapped, key: str, default: int) -> int:
    """A split.* count or number from f's metadata: an integer, else one line naming the file."""
    value = f.metadata.get(key, default)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ModelFileError(f.path, f"corrupt metadata: {key} is {value!r}, not an integer")
    return int(value)


def model_stem(path: Path) -> str:
    """The model's name from its file: the file's stem, without a split model's -00001-of-0000N."""
    named = SHARD_NAME.match(path.name)
    return named["prefix"] if named else path.stem


class GGUFFile:
    """One GGUF model: metadata, tensor table and memory-mapped tensor data; from one file, or from the first
    shard of a split model and the shards beside it."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        first = _Mapped(self.path)
        self._files = [first]
        self.version, self.metadata = first.version, first.metadata
        self.size, self.header_size, self.data_offset = first.size, first.header_size, first.data_offset
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in first.tensors}
        try:
            count = _split_key(first, SPLIT_COUNT, 1)
            if count > 1:
                self._open_shards(count)
        except BaseException:
            self.close()
            raise
        self._fingerprint: str | None = None

    def _open_shards(self, count: int) -> None:
        """The shards after the first, found by llama.cpp's naming, their tensors added to the table."""
        no = _split_key(self._files[0], SPLIT_NO, 0)
        named = SHARD_NAME.match(self.path.name)
        if no != 0:
            first = f", {named['prefix']}-00001-of-{count:05d}.gguf" if named else ""
            raise ModelFileError(self.path, f"is shard {no + 1} of {count} of a split model: give its first "
                                            f"shard{first}")
        if named is None or int(named["no"]) != 1 or int(named["count"]) != count:
            raise ModelFileError(self.path, f"is the first of {count} shards, but its name does not end in "
                                            f"-00001-of-{count:05d}.gguf, so the others cannot be found")
        for i in range(1, count):
            path = self.path.with_name(f"{named['prefix']}-{i + 1:05d}-of-{count:05d}.gguf")
            if not path.exists():
                raise ModelFileError(self.path, f"shard {i + 1} of {count} is missing: no {path.name} beside it")
            shard = _Mapped(path)
            self._files.append(shard)
            if _split_key(shard, SPLIT_NO, -1) != i or _split_key(shard, SPLIT_COUNT, 0) != count:
                raise ModelFileError(path, f"is not shard {i + 1} of {count} of {self.path.name} (its split.no "
                                           f"and split.count say otherwise)")
            for t in shard.tensors:
                if t.name in self.tensors:
                    raise ModelFileError(path, f"tensor {t.name} is in two shards")
                self.tensors[t.name] = dataclasses.replace(t, shard=i)
        expected = _split_key(self._files[0], SPLIT_TENSORS, len(self.tensors))
        if expected != len(self.tensors):
            raise ModelFileError(self.path, f"the {count} shards hold {len(self.tensors)} tensors; the first says "
                                            f"{expected}")
        self.size = sum(f.size for f in self._files)

    # -- access -------------------------------------------------------------------------------

    def get(self, key: str | None, default: Any = None) -> Any:
        """The metadata value of key, or default (also for key None: a family without that setting)."""
        return default if key is None else self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(self.path, "metadata has no general.architecture")
        return arch

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a zero-copy uint8 view into the mapping."""
        info = self.tensors[name]
        return np.frombuffer(self._files[info.shard].mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    @property
    def fingerprint(self) -> str:
        """Cheap identity: each file's size, header bytes and 16 samples of its tensor data (no full read)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for f in self._files:
                f.digest(h)
            self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

    def close(self) -> None:
        for f in self._files:
            f.close()
