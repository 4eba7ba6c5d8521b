"""`ember bench agree`: a model's logits on the GPU against the numpy reference's, position by position, on
a large file (issue 40 item 4: DeepSeek V4's L8 file, its first 512 positions). In two halves, since the
reference of such a file takes a CPU most of an hour and the GPU is on another machine:

    ember bench agree --model L8.gguf --positions 512 --out ref.npz      # numpy, on any machine
    ember bench agree --model L8.gguf --reference ref.npz --mode exact   # the GPU, the same file

One prompt of `positions` token ids (seeded), every position's logits. The reference keeps per position the
argmax, the top-2 gap and the logits at a fixed sample of vocab ids (the whole rows would be 265 MB at 512
positions of 129,280), the last position's whole row, and the file's fingerprint (the halves must read one
file). The comparison reports each position's correlation over the sample, the argmax where the reference's
top two are 0.5 or more apart (and everywhere), and the last row's correlation; it judges nothing (the
exit status says only whether it ran). Small files are compared whole by the test suite instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..backends.base import Backend

CLEAR_GAP = 0.5  # a position's argmax is compared where the reference's top two are this far apart
SAMPLE = 512  # vocab ids whose logits the reference keeps for every position


def add_agree_parser(bsub) -> None:
    a = bsub.add_parser("agree", help="a model's logits on the GPU against the numpy reference's, position by "
                                      "position (the reference written first, on any machine)")
    a.add_argument("--model", metavar="PATH", required=True, help="GGUF model file (a split model: its first shard)")
    a.add_argument("--positions", type=int, default=512, metavar="N",
                   help="the prompt's length, every position compared (default 512)")
    a.add_argument("--out", metavar="PATH", help="write the numpy reference here (.npz)")
    a.add_argument("--reference", metavar="PATH", help="compare with this reference (written by --out)")
    a.add_argument("--backend", choices=("cuda", "numpy"), default="cuda",
                   help="what the comparison runs on (default cuda; numpy checks the tool itself)")
    a.add_argument("--mode", choices=("exact", "fast"), default="exact",
                   help="cuda: exact (every matmul through the float32 matvec) or fast (prefill matmuls and "
                        "experts on the tensor cores, 16-bit inputs; what a worker prefills with)")
    a.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a.set_defaults(func=cmd_agree)


def cmd_agree(args: argparse.Namespace) -> int:
    from ember.kernels.errors import CudaUnavailable

    from ..model.gguf_file import ModelFileError

    if (args.out is None) == (args.reference is None):
        print("ember bench agree: give --out (write the reference) or --reference (compare with one)",
              file=sys.stderr)
        return 2
    if args.positions < 2:
        print("ember bench agree: --positions must be at least 2", file=sys.stderr)
        return 2
    try:
        if args.out is not None:
            reference(args.model, args.positions, Path(args.out))
            print(f"wrote {args.out}")
            return 0
        result = compare(args.model, Path(args.reference), backend=args.backend, mode=args.mode)
    except (ModelFileError, ReferenceError, CudaUnavailable, OSError) as e:
        print(f"ember bench agree: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']} on {result['backend']} ({result['mode']}), {result['positions']} positions:")
    print(f"  correlation over {result['sampled_ids']} vocab ids: min {result['corr_min']:.6f}, "
          f"1st percentile {result['corr_p01']:.6f}, median {result['corr_median']:.6f}")
    print(f"  positions under 0.999: {result['below_0999']}, under 0.99: {result['below_099']}")
    print(f"  argmax: {result['argmax_agree_clear']} of {result['clear_positions']} clear positions "
          f"(top-2 gap >= {CLEAR_GAP}), {result['argmax_agree_all']} of {result['positions']} in all")
    print(f"  the last position's whole row: correlation {result['last_row_corr']:.6f}")
    return 0


class ReferenceError(ValueError):
    """A reference that does not fit the model it is compared on."""


def prompt(vocab: int, positions: int) -> np.ndarray:
    """The prompt both halves run: seeded ids, clear of the lowest (often special) ones."""
    return np.random.default_rng(512).integers(min(1000, vocab // 8), min(120000, vocab), positions).astype(np.int32)


def sampled_ids(vocab: int) -> np.ndarray:
    """The vocab ids whose logits the reference keeps (sorted)."""
    ids = np.sort(np.random.default_rng(4096).choice(vocab, min(8 * SAMPLE, vocab), replace=False))
    return ids[::8]


def reference(model_path: str, positions: int, out: Path) -> None:
    """The numpy reference's logits of the prompt, summarised into `out` (see the module docstring)."""
    from ..backends.base import SeqChunk
    from ..backends.numpy.backend import NumpyBackend
    from ..model.loader import open_model
    from ..model.weights import load_weights

    model = open_model(model_path)
    cfg = model.config
    weights = load_weights(model.gguf, cfg)  # a DeepSeek V4 file's experts stay quantized where float32 won't fit
    blocks = -(-positions // 16)
    backend = NumpyBackend(cfg, weights, n_blocks=blocks + 1, block_size=16)
    (logits,) = backend.forward([SeqChunk(prompt(cfg.vocab_size, positions), 0, list(range(blocks)), "all")])
    top2 = np.sort(logits, axis=1)[:, -2:]
    ids = sampled_ids(cfg.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        np.savez_compressed(f, ids=ids, sub=logits[:, ids].astype(np.float32), argmax=logits.argmax(1),
                            gap=top2[:, 1] - top2[:, 0], last=logits[-1].astype(np.float32),
                            fingerprint=np.array(str(model.gguf.fingerprint)))


def compare(model_path: str, ref_path: Path, *, backend: str = "cuda", mode: str = "exact") -> dict:
    """The comparison's figures (see the module docstring)."""
    from ..backends.base import SeqChunk
    from ..model.loader import open_model

    model = open_model(model_path)
    cfg = model.config
    try:
        ref = np.load(ref_path)
        want_fp, ids, sub = str(ref["fingerprint"]), ref["ids"], ref["sub"]
        argmax, gap, last = ref["argmax"], ref["gap"], ref["last"]
    except (OSError, ValueError, KeyError) as e:
        raise ReferenceError(f"{ref_path} is not a reference `ember bench agree --out` wrote ({e})") from e
    if want_fp != str(model.gguf.fingerprint):
        raise ReferenceError(f"{ref_path} was made from another file (fingerprint {want_fp}, "
                             f"this one {model.gguf.fingerprint})")
    positions = len(argmax)
    blocks = -(-positions // 16)
    be: Backend
    if backend == "cuda":
        from ..backends.cuda import open_backend

        be = open_backend(cfg, model.gguf, n_blocks=blocks + 1, block_size=16, max_rows=positions,
                          tensor_cores=mode == "fast")
    else:
        from ..backends.numpy.backend import NumpyBackend
        from ..model.weights import load_weights

        be = NumpyBackend(cfg, load_weights(model.gguf, cfg), n_blocks=blocks + 1, block_size=16)
    (x,) = be.forward([SeqChunk(prompt(cfg.vocab_size, positions), 0, list(range(blocks)), "all")])
    corr = np.array([_corr(x[t, ids], sub[t]) for t in range(positions)])
    clear = gap >= CLEAR_GAP
    agree = x.argmax(1) == argmax
    return {"model": model.path.name, "backend": be.name, "mode": mode if backend == "cuda" else "reference",
            "positions": positions, "sampled_ids": len(ids), "corr_min": float(corr.min()),
            "corr_p01": float(np.quantile(corr, 0.01)), "corr_median": float(np.median(corr)),
            "below_0999": int((corr < 0.999).sum()), "below_099": int((corr < 0.99).sum()),
            "clear_positions": int(clear.sum()), "argmax_agree_clear": int((agree & clear).sum()),
            "argmax_agree_all": int(agree.sum()), "last_row_corr": _corr(x[-1], last),
            "worst_positions": [int(t) for t in np.argsort(corr)[:5]]}


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.std() == 0 or b.std() == 0:
        return 1.0 if np.allclose(a, b) else 0.0
    return float(np.corrcoef(a, b)[0, 1])
