"""The on-disk format of one KV block, and the checks that make a bad file harmless.

    magic "EMBERKV1" | header (fixed struct) | token ids (int32 x n_tokens) | payload
The header names the block (its chain hash), its parent, the model fingerprint and the KV
layout (salt), the payload's dtype and shape, and xxh3-64 checksums of the header fields and of
the payload. A file passes only if every one of those agrees with what the reader expects and
the chain hash recomputed from (parent, tokens) equals the file's name.

`read_into` reads a file's payload straight into memory the caller provides (the backend's restore
buffers: pinned memory on CUDA), checked as `decode` checks a file read whole.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = b"EMBERKV1"
FORMAT_VERSION = 1
# version, n_tokens, dtype code, 5 shape dims, payload bytes, block hash, parent hash, salt digest,
# payload checksum, header checksum
_HEADER = struct.Struct("<HHB5IQ16s16s16sQQ")
HEADER_SIZE = len(MAGIC) + _HEADER.size
_DTYPES: dict[int, np.dtype] = {1: np.dtype("<f4"), 2: np.dtype("<f2")}
_CODES = {v: k for k, v in _DTYPES.items()}


class BadBlockFile(Exception):
    """Why a file cannot be used (one line)."""


@dataclass(frozen=True)
class BlockHeader:
    block_hash: bytes
    parent_hash: bytes
    salt_digest: bytes
    n_tokens: int
    dtype: np.dtype
    shape: tuple[int, ...]
    payload_bytes: int
    payload_checksum: int

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + 4 * self.n_tokens + self.payload_bytes


def salt_digest(salt: bytes) -> bytes:
    return xxhash.xxh3_128_digest(salt)


def encode(block_hash: bytes, parent_hash: bytes, salt: bytes, tokens, payload: np.ndarray) -> bytes:
    return b"".join(encode_parts(block_hash, parent_hash, salt, tokens, payload))


def encode_parts(block_hash: bytes, parent_hash: bytes, salt: bytes, tokens, payload: np.ndarray
                 ) -> tuple[bytes, bytes, memoryview]:
    """The file as (magic + header, token ids, payload): the payload is not copied (os.writev
    writes the three as one file)."""
    payload = np.ascontiguousarray(payload)
    code = _CODES[payload.dtype.newbyteorder("<") if payload.dtype.byteorder == ">" else payload.dtype]
    shape = tuple(payload.shape) + (1,) * (5 - payload.ndim)
    raw = memoryview(payload).cast("B")  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ on 3.12+ only
    toks = np.asarray(tokens, dtype="<i4").tobytes()
    fields = (FORMAT_VERSION, len(tokens), code, *shape, raw.nbytes, block_hash, parent_hash, salt_digest(salt),
              xxhash.xxh3_64_intdigest(raw))
    head = _HEADER.pack(*fields, 0)
    check = xxhash.xxh3_64_intdigest(MAGIC + head[: -8] + toks)
    return MAGIC + _HEADER.pack(*fields, check), toks, raw


def read_header(data: bytes, *, salt: bytes) -> tuple[BlockHeader, list[int]]:
    """Parse and check the header and token ids (no payload read needed)."""
    if len(data) < HEADER_SIZE:
        raise BadBlockFile(f"truncated header ({len(data)} bytes)")
    if data[: len(MAGIC)] != MAGIC:
        raise BadBlockFile("not an ember KV block (bad magic)")
    (version, n_tokens, code, d0, d1, d2, d3, d4, payload_bytes, block_hash, parent_hash, sdigest,
     payload_sum, header_sum) = _HEADER.unpack_from(data, len(MAGIC))
    if version != FORMAT_VERSION:
        raise BadBlockFile(f"format version {version}, expected {FORMAT_VERSION}")
    end = HEADER_SIZE + 4 * n_tokens
    if len(data) < end:
        raise BadBlockFile("truncated token ids")
    toks = data[HEADER_SIZE:end]
    if xxhash.xxh3_64_intdigest(data[: HEADER_SIZE - 8] + toks) != header_sum:
        raise BadBlockFile("header checksum mismatch")
    if sdigest != salt_digest(salt):
        raise BadBlockFile("written for another model or KV layout")
    if code not in _DTYPES:
        raise BadBlockFile(f"unknown dtype code {code}")
    shape = tuple(d for d in (d0, d1, d2, d3, d4))
    header = BlockHeader(block_hash, parent_hash, sdigest, n_tokens, _DTYPES[code], shape, payload_bytes, payload_sum)
    return header, np.frombuffer(toks, dtype="<i4").tolist()


def _check_block(header: BlockHeader, tokens: list[int], *, salt: bytes, expect_hash: bytes,
                 shape: tuple[int, ...], dtype, chain_hash) -> None:
    """The header names the block asked for, its tokens hash to that name, and its payload is `shape`."""
    if header.block_hash != expect_hash:
        raise BadBlockFile("block hash does not match the file name")
    if chain_hash is not None and chain_hash(header.parent_hash, tokens, salt) != header.block_hash:
        raise BadBlockFile("token ids do not hash to the block's name")
    want = tuple(shape) + (1,) * (5 - len(shape))
    if header.shape != want or header.dtype != np.dtype(dtype):
        raise BadBlockFile(f"payload shape {header.shape} {header.dtype}, expected {want} {np.dtype(dtype)}")


def decode(data: bytes, *, salt: bytes, expect_hash: bytes, shape: tuple[int, ...], dtype=np.float32,
           chain_hash=None) -> np.ndarray:
    """The payload of a fully checked file, shaped `shape`."""
    header, tokens = read_header(data, salt=salt)
    _check_block(header, tokens, salt=salt, expect_hash=expect_hash, shape=shape, dtype=dtype, chain_hash=chain_hash)
    start = HEADER_SIZE + 4 * header.n_tokens
    raw = data[start : start + header.payload_bytes]
    if len(raw) != header.payload_bytes or len(data) != start + header.payload_bytes:
        raise BadBlockFile(f"payload is {len(data) - start} bytes, header says {header.payload_bytes}")
    if xxhash.xxh3_64_intdigest(raw) != header.payload_checksum:
        raise BadBlockFile("payload checksum mismatch")
    return np.frombuffer(raw, dtype=header.dtype).reshape(shape)


def _read_exact(f: io.RawIOBase, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = f.read(left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def read_into(f: io.RawIOBase, out: np.ndarray, *, salt: bytes, expect_hash: bytes, chain_hash=None) -> None:
    """Read the block file open as `f` (unbuffered) into `out`, checked as decode checks a file read
    whole: the payload goes from the file into `out` (C-contiguous, the block's shape and dtype) and
    through no other buffer. A file that fails a check raises BadBlockFile, and `out` then holds
    nothing to use."""
    head = _read_exact(f, HEADER_SIZE)
    if len(head) == HEADER_SIZE and head[: len(MAGIC)] == MAGIC:
        head += _read_exact(f, 4 * _HEADER.unpack_from(head, len(MAGIC))[1])  # the token ids
    header, tokens = read_header(head, salt=salt)
    _check_block(header, tokens, salt=salt, expect_hash=expect_hash, shape=out.shape, dtype=out.dtype,
                 chain_hash=chain_hash)
    raw = out.data.cast("B")
    if raw.nbytes != header.payload_bytes:
        raise BadBlockFile(f"payload is {header.payload_bytes} bytes, expected {raw.nbytes}")
    got = 0
    while got < raw.nbytes:
        n = f.readinto(raw[got:])
        if not n:
            raise BadBlockFile(f"payload is {got} bytes, header says {header.payload_bytes}")
        got += n
    if f.read(1):
        raise BadBlockFile(f"the file runs on past the header's {header.payload_bytes} payload bytes")
    if xxhash.xxh3_64_intdigest(raw) != header.payload_checksum:
        raise BadBlockFile("payload checksum mismatch")
