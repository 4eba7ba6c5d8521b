"""llama.cpp's deepseek4 MTP graph on a token list: what tests/test_mtp.py holds ember's next-token layer to.

Run under a python with llama-cpp-python (0.3.36 or later: llama_cpp_ext's nextn calls, load_mtp and
LLAMA_CONTEXT_TYPE_MTP); like gen_logit_fixtures.py it does NOT import ember. The model is loaded with
its MTP layer; a normal context decodes the tokens and hands back the trunk's logits and its output
streams at every position (h_nextn, unmasked); an MTP context then decodes the same tokens, each
paired with the trunk's streams at the position before it (zeros before the first), as
common/speculative.cpp's MTP drafter feeds it, and hands back the layer's logits; then drafts CHAIN
tokens from the last position on as that drafter does. KV caches in float32.

    mtp_logits.py MODEL.gguf OUT.npz 1,5,9,... [--f32]   # --f32: run on an F32 copy of MODEL
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import llama_cpp as L
import numpy as np
from llama_cpp import llama_cpp_ext as X

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_logit_fixtures import write_f32_copy  # noqa: E402

CHAIN = 3  # the draft's length from the last position


def _context(model, kind: int):
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 1024
    cp.n_seq_max = 1
    cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
    cp.ctx_type = kind
    cp.n_threads = cp.n_threads_batch = 2
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit("llama.cpp could not create the context")
    return ctx


def _batch(tokens: list[int]):
    b = L.llama_batch_init(len(tokens), 0, 1)
    for i, t in enumerate(tokens):
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, 1
        b.seq_id[i][0] = 0
    b.n_tokens = len(tokens)
    return b


def run(path: Path, tokens: list[int]) -> dict[str, np.ndarray]:
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.load_mtp = True
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    n, n_vocab = len(tokens), L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    width = L.llama_model_n_embd_out(model)
    ctx = _context(model, L.LLAMA_CONTEXT_TYPE_DEFAULT)
    X.llama_set_embeddings_nextn(ctx, True, False)
    if L.llama_decode(ctx, _batch(tokens)) != 0:
        raise SystemExit("llama.cpp's trunk decode failed")
    trunk = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n, n_vocab)).copy()
    h = np.ctypeslib.as_array(X.llama_get_embeddings_nextn(ctx), shape=(n, width)).copy()
    mtp_ctx = _context(model, L.LLAMA_CONTEXT_TYPE_MTP)
    X.llama_set_embeddings_nextn(mtp_ctx, True, True)
    before = np.zeros((n, width), np.float32)
    before[1:] = h[:-1]
    b = _batch(tokens)
    rows = (ctypes.c_float * before.size).from_buffer(before)  # a batch entry may carry a token and a row
    b.embd = ctypes.cast(rows, ctypes.POINTER(ctypes.c_float))
    if L.llama_decode(mtp_ctx, b) != 0:
        raise SystemExit("llama.cpp's MTP decode failed")
    mtp = np.ctypeslib.as_array(L.llama_get_logits(mtp_ctx), shape=(n, n_vocab)).copy()
    # a draft from the last position on, as the drafter chains a single layer: each step's argmax at the
    # next position, paired with the layer's own h_nextn of the step before
    chain = []
    h_row = np.ctypeslib.as_array(X.llama_get_embeddings_nextn(mtp_ctx), shape=(n, width))[-1].copy()
    guess = int(np.argmax(mtp[-1]))
    for step in range(CHAIN - 1):
        b = L.llama_batch_init(1, 0, 1)
        b.token[0], b.pos[0], b.n_seq_id[0], b.logits[0] = guess, n + step, 1, 1
        b.seq_id[0][0] = 0
        b.n_tokens = 1
        row = np.ascontiguousarray(h_row, np.float32)
        b.embd = ctypes.cast((ctypes.c_float * width).from_buffer(row), ctypes.POINTER(ctypes.c_float))
        if L.llama_decode(mtp_ctx, b) != 0:
            raise SystemExit("llama.cpp's MTP draft step failed")
        chain.append(np.ctypeslib.as_array(L.llama_get_logits(mtp_ctx), shape=(1, n_vocab))[0].copy())
        h_row = np.ctypeslib.as_array(X.llama_get_embeddings_nextn(mtp_ctx), shape=(1, width))[0].copy()
        guess = int(np.argmax(chain[-1]))
    return {"tokens": np.asarray(tokens), "trunk": trunk, "h": h, "mtp": mtp,
            "n_layer_nextn": np.asarray(L.llama_model_n_layer_nextn(model)),
            "chain": np.asarray([mtp[-1], *chain])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("tokens")
    p.add_argument("--f32", action="store_true", help="run on an F32 copy of the model (the exact math)")
    a = p.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model
        if a.f32:
            path = Path(tmp) / "f32.gguf"
            write_f32_copy(a.model, path)
        np.savez(a.out, **run(path, tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
