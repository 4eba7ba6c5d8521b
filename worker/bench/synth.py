"""Shape-faithful synthetic GGUF models for benchmarks and tests.

`make_model(arch, shape, out)` writes a GGUF file that llama.cpp (and ember) load like the real
thing: the architecture's metadata keys, tensor names, shapes and quantization types, and a working
tokenizer, with random (but valid and sanely scaled) weights. Nothing is downloaded; the same seed
gives a byte-identical file.

Shapes (`SHAPES`, what users type after --shape):
  tiny             a small test model of the chosen arch (tiny-llama, tiny-qwen2, tiny-qwen3,
                   tiny-gemma3, tiny-qwen3moe, tiny-gpt-oss, tiny-deepseek4); a few layers, hidden 128,
                   GQA, vocab 512-1000
  tiny-lowbit      (qwen3moe) a tiny MoE model whose matrices use every 2-5-bit type ember reads
  gemma3-270m      Gemma 3 270M, tensor for tensor the embedded Q4_K_M file
  gemma3-4b        Gemma 3 4B (text), Q4_K_M mix
  llama-8b         Llama 3 8B, Q4_K_M mix, Llama 3 BPE vocabulary
  qwen3-30b-a3b    Qwen3-Coder-30B-A3B (qwen3moe: 128 experts, 8 per token), Q4_K_M mix
  qwen3-30b-a3b-q2 the same in a 2-3-bit dynamic mix: IQ2_XXS/IQ3_XXS gate/up, Q2_K/Q3_K down experts
  gpt-oss-20b      gpt-oss-20b (32 experts, 4 per token): MXFP4 experts, Q8_0 elsewhere
  deepseek-v4-flash-L8
                   DeepSeek-V4-Flash's first 8 of 43 layers (every attention kind, both routings) and its
                   MTP layer: IQ2_XXS gate/up experts, Q2_K down, Q8_0 elsewhere, as users run it

Weights use llama.cpp's Q4_K_M type choice (llama-quant.cpp): Q4_K everywhere, Q6_K for the output
(or the tied embedding) and for attn_v / ffn_down on the "use_more_bits" layers, with llama.cpp's
fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0) for rows that are not a multiple of 256; norms and biases F32.

Tensor data is generated and written a chunk of rows at a time straight into the file, so a
multi-GB model needs only a few MB of memory. `plan(arch, shape)` returns the tensor table without
writing anything.

This module writes the file and holds the `make-model` command; the shape table and tensor plan
are synth_shapes, the tokenizers synth_vocab, the random weights synth_tensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, RopeScalingType
from gguf.constants import LlamaFileType

from .synth_shapes import (
    ARCHS,
    SHAPES,
    PlannedTensor,
    ShapeSpec,
    SynthError,
    plan,
    plan_dspark,
    plan_spec,
    q4_k_m_type,
    resolve_shape,
)
from .synth_tensors import tensor_chunks
from .synth_vocab import Vocab, build_vocab

__all__ = [
    "ARCHS",
    "SHAPES",
    "PlannedTensor",
    "ShapeSpec",
    "SynthError",
    "Vocab",
    "add_make_model_parser",
    "build_vocab",
    "make_model",
    "plan",
    "q4_k_m_type",
    "resolve_shape",
    "run_make_model",
    "write_model",
    "WHOLE",
    "TRUNK",
    "MTP",
]


# -- writing --------------------------------------------------------------------------------------


# what write_model writes of a deepseek4 shape, as llama.cpp's converter splits DeepSeek V4
# (conversion/deepseek.py, DeepseekV4Model): WHOLE, trunk and next-token (MTP) layer in one file (what
# llama.cpp's loader reads with load_mtp); TRUNK, the file without the layer (the converter's default and
# --no-mtp: no nextn_predict_layers, block_count the trunk's); MTP, the layer alone (its --mtp,
# "mtp-NAME.gguf": the layer's block, nextn_predict_layers and block_count over trunk and layer, and the
# model-level tensors its graph reads from its own model: token_embd, output_norm, output and a
# hyper-connection head, which the converter takes from the checkpoint's mtp.0.hc_head_*; here they are
# the trunk's bytes, so the pair computes as the whole file does)
WHOLE, TRUNK, MTP = "whole", "trunk", "mtp"
# DSPARK: the shape's DSpark block drafter (its own file, architecture `dflash`: plan_dspark), as
# llama.cpp's converter writes it with --dspark; llama-server drafts with it (-md PATH --spec-type draft-dspark)
DSPARK = "dspark"
_MTP_GLOBALS = ("token_embd.weight", "output_norm.weight", "output.weight", "output_hc_fn.weight",
                "output_hc_base.weight", "output_hc_scale.weight")


def _part_tensors(spec: ShapeSpec, part: str) -> list[PlannedTensor]:
    if part == DSPARK:
        return plan_dspark(spec)
    tensors = plan_spec(spec)
    if part == WHOLE:
        return tensors
    if spec.dsv4 is None or not spec.dsv4.nextn_layers:
        raise SynthError(f"{spec.name} has no next-token (MTP) layer to split off")
    layer = tuple(f"blk.{il}." for il in range(spec.n_layer, spec.n_layer + spec.dsv4.nextn_layers))
    if part == TRUNK:
        return [t for t in tensors if not t.name.startswith(layer)]
    if part == MTP:
        return [t for t in tensors if t.name.startswith(layer) or t.name in _MTP_GLOBALS]
    raise SynthError(f"unknown part {part!r} (whole, trunk, mtp or dspark)")


def _add_metadata(w: GGUFWriter, s: ShapeSpec, v: Vocab, seed: int, part: str = WHOLE) -> None:
    if part == DSPARK:
        _add_dspark_metadata(w, s, v, seed)
        return
    a = s.arch
    nextn = s.dsv4.nextn_layers if s.dsv4 and part != TRUNK else 0
    w.add_type("model")
    w.add_name(f"ember synthetic {s.name}")
    w.add_description(f"random weights in the shape of {s.description or s.name}; "
                      f"generated by ember bench make-model (seed {seed}); not a trained model")
    if s.size_label:
        w.add_size_label(s.size_label)
    w.add_string("ember.synthetic.shape", s.name)
    w.add_uint32("ember.synthetic.seed", seed)
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer + nextn)  # the next-token (MTP) layers count too
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_rope_freq_base(s.rope_base)
    if a in ("qwen3", "gemma3", "qwen3moe", "gpt-oss", "deepseek4") or s.head_dim * s.n_head != s.n_embd:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if a == "llama":
        w.add_vocab_size(s.n_vocab)
        w.add_rope_dimension_count(s.head_dim)
    if s.n_expert:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)
    if s.rope_yarn:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.rope_yarn[0])
        w.add_rope_scaling_orig_ctx_len(s.rope_yarn[1])
    if s.rope_scaling_linear:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s.rope_scaling_linear)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    if s.rope_base_swa is not None:
        w.add_rope_freq_base_swa(s.rope_base_swa)
    if s.dsv4 is not None:
        _add_dsv4_metadata(w, s, nextn)
    _add_tokenizer_metadata(w, v)
    w.add_quantization_version(2)
    file_type = {"q8_0": LlamaFileType.MOSTLY_Q8_0, "ds4-flash": LlamaFileType.MOSTLY_IQ2_XXS,
                 "q2-dynamic": LlamaFileType.MOSTLY_Q2_K}
    w.add_file_type(int(file_type.get(s.mix, LlamaFileType.MOSTLY_Q4_K_M)))


def _add_dspark_metadata(w: GGUFWriter, s: ShapeSpec, v: Vocab, seed: int) -> None:
    """The drafter's keys as llama.cpp's dflash loader reads them (src/models/dflash.cpp): the DeepSeek V4
    block's settings under `dflash.`, every stage window-only, the target layers and block size, and the
    trunk's tokenizer with the filler token a block's slots after the first are fed (mask_token_id)."""
    d = s.dsv4
    assert d is not None and d.dspark is not None
    ds, a, n = d.dspark, "dflash", d.dspark.stages
    w.add_type("model")
    w.add_name(f"ember synthetic {s.name} DSpark drafter")
    w.add_description(f"random weights in the shape of a DSpark drafter for {s.name}; generated by ember bench "
                      f"make-model (seed {seed}); not a trained model")
    w.add_string("ember.synthetic.shape", s.name)
    w.add_uint32("ember.synthetic.seed", seed)
    w.add_uint32(f"{a}.context_length", s.n_ctx)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    w.add_uint32(f"{a}.block_count", n)
    w.add_uint32(f"{a}.feed_forward_length", 0)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", 1)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps)
    w.add_uint32(f"{a}.rope.dimension_count", d.n_rot)
    w.add_float32(f"{a}.rope.freq_base", s.rope_base)
    w.add_uint32(f"{a}.attention.sliding_window", s.sliding_window)
    w.add_uint32(f"{a}.expert_count", s.n_expert)
    w.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
    w.add_uint32(f"{a}.expert_shared_count", d.n_shared)
    w.add_float32(f"{a}.expert_weights_scale", d.expert_weights_scale)
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_uint32(f"{a}.expert_gating_func", 4)  # sqrt-softplus, the only scoring the drafter takes
    w.add_array(f"{a}.swiglu_clamp_exp", [d.swiglu_limit] * n)
    w.add_array(f"{a}.swiglu_clamp_shexp", [d.swiglu_limit] * n)
    w.add_uint32(f"{a}.attention.q_lora_rank", d.q_lora_rank)
    w.add_uint32(f"{a}.attention.output_group_count", d.o_groups)
    w.add_uint32(f"{a}.attention.output_lora_rank", d.o_lora_rank)
    w.add_array(f"{a}.attention.compress_ratios", [0] * n)
    w.add_uint32(f"{a}.hyper_connection.count", d.hc_mult)
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", d.hc_sinkhorn_iters)
    w.add_float32(f"{a}.hyper_connection.epsilon", d.hc_eps)
    w.add_array(f"{a}.target_layers", list(ds.target_layers))
    w.add_uint32(f"{a}.block_size", ds.block_size)
    _add_tokenizer_metadata(w, v)
    w.add_uint32("tokenizer.ggml.mask_token_id", dspark_mask_token(s, v))
    w.add_quantization_version(2)
    w.add_file_type(int(LlamaFileType.MOSTLY_Q8_0))


def dspark_mask_token(s: ShapeSpec, v: Vocab) -> int:
    """The filler token a DSpark block's slots after the first are fed: the vocabulary's last token (the
    real drafter's is a reserved one, 128799 of V4's vocabulary)."""
    return len(v.tokens) - 1


def _add_tokenizer_metadata(w: GGUFWriter, v: Vocab) -> None:
    w.add_tokenizer_model(v.model)
    if v.pre:
        w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    w.add_token_types(v.types)
    if v.merges is not None:
        w.add_token_merges(v.merges)
    ids = v.special
    w.add_bos_token_id(ids["bos"])
    w.add_eos_token_id(ids["eos"])
    if "unk" in ids:
        w.add_unk_token_id(ids["unk"])
    if "pad" in ids:
        w.add_pad_token_id(ids["pad"])
    w.add_add_bos_token(v.add_bos)
    w.add_add_eos_token(v.add_eos)
    if v.add_space_prefix is not None:
        w.add_add_space_prefix(v.add_space_prefix)
    if v.chat_template:
        w.add_chat_template(v.chat_template)


def _add_dsv4_metadata(w: GGUFWriter, s: ShapeSpec, nextn: int) -> None:
    """deepseek4's keys beyond a transformer's, as llama.cpp's converter writes them (nextn: the file's
    next-token layers; the compress ratios cover them whether the file holds them or not, as the
    checkpoint's config lists them)."""
    d, a = s.dsv4, s.arch
    assert d is not None
    w.add_rope_dimension_count(d.n_rot)
    w.add_uint32(f"{a}.attention.q_lora_rank", d.q_lora_rank)
    w.add_uint32(f"{a}.expert_shared_count", d.n_shared)
    w.add_float32(f"{a}.expert_weights_scale", d.expert_weights_scale)
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_uint32(f"{a}.expert_gating_func", 4)  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
    n_all = s.n_layer + nextn  # per-layer arrays cover the next-token (MTP) layers after the trunk
    w.add_array(f"{a}.swiglu_clamp_exp", [d.swiglu_limit] * n_all)
    w.add_array(f"{a}.swiglu_clamp_shexp", [d.swiglu_limit] * n_all)
    w.add_uint32(f"{a}.attention.indexer.head_count", d.indexer_heads)
    w.add_uint32(f"{a}.attention.indexer.key_length", d.indexer_dim)
    w.add_uint32(f"{a}.attention.indexer.top_k", d.indexer_top_k)
    w.add_uint32(f"{a}.attention.output_group_count", d.o_groups)
    w.add_uint32(f"{a}.attention.output_lora_rank", d.o_lora_rank)
    w.add_array(f"{a}.attention.compress_ratios", [*d.compress_ratios, *[0] * d.nextn_layers])  # MTP: window only
    w.add_float32(f"{a}.attention.compress_rope_freq_base", d.compress_rope_base)
    w.add_uint32(f"{a}.hyper_connection.count", d.hc_mult)
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", d.hc_sinkhorn_iters)
    w.add_float32(f"{a}.hyper_connection.epsilon", d.hc_eps)
    w.add_uint32(f"{a}.hash_layer_count", d.hash_layers)
    w.add_uint32(f"{a}.embedding_length_out", s.n_embd * d.hc_mult)
    if nextn:
        w.add_uint32(f"{a}.nextn_predict_layers", nextn)


def make_model(
    arch: str,
    shape: str,
    out: Path | str,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    mtp_out: Path | str | None = None,
    ctx: int | None = None,
    dspark_out: Path | str | None = None,
) -> Path:
    """Write a synthetic GGUF model of `arch`/`shape` to `out`; returns the path.

    The file appears atomically (written to `out`.part, then renamed). `progress(done, total)` is
    called with bytes of tensor data written so far. mtp_out: write the next-token (MTP) layer there
    and the trunk alone to `out`, the pair llama.cpp's converter writes with --mtp and --no-mtp. ctx:
    the context length the file declares, instead of the shape's (random weights have no trained
    length: a benchmark of long conversations on a shape whose model has a short one). Raises
    SynthError for an unknown arch or shape, a bad ctx or an unusable output path, OSError for
    failures while writing.
    """
    spec = resolve_shape(arch, shape)
    if ctx is not None:
        if not 16 <= ctx <= 1 << 24:
            raise SynthError(f"ctx must be in 16..{1 << 24}, got {ctx}")
        spec = dataclasses.replace(spec, n_ctx=ctx)
    if dspark_out is not None:  # the drafter first: a shape without one is refused before anything is written
        _part_tensors(spec, DSPARK)
        write_model(spec, dspark_out, seed, progress, part=DSPARK)
    if mtp_out is None:
        return write_model(spec, out, seed, progress)
    _part_tensors(spec, MTP)  # a shape without the layer is refused before anything is written
    write_model(spec, mtp_out, seed, progress, part=MTP)
    return write_model(spec, out, seed, progress, part=TRUNK)


def write_model(spec: ShapeSpec, out: Path | str, seed: int = 0,
                progress: Callable[[int, int], None] | None = None, part: str = WHOLE) -> Path:
    """make_model for a ShapeSpec of one's own (a variant of a known shape, as a test needs); part: WHOLE,
    TRUNK or MTP (a deepseek4 shape's file without its next-token layer, or that layer's own file).
    Every tensor's bytes are the same in each part (drawn by name and seed)."""
    if not 0 <= seed < 2**32:
        raise SynthError(f"seed must be in 0..{2**32 - 1}, got {seed}")
    tensors = _part_tensors(spec, part)
    out = Path(out)
    if out.is_dir():
        raise SynthError(f"{out} is a directory; give a file name such as {out / (spec.name + '.gguf')}")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise SynthError(f"cannot write {out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise SynthError(f"cannot write {out}: directory {parent} is not writable")
    total = sum(t.nbytes for t in tensors)
    free = shutil.disk_usage(parent).free
    if free < total + (64 << 20):
        raise SynthError(f"cannot write {out}: needs about {total / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free")

    vocab = build_vocab(spec)
    tmp = out.with_name(out.name + ".part")
    writer = GGUFWriter(tmp, "dflash" if part == DSPARK else spec.arch)
    try:
        _add_metadata(writer, spec, vocab, seed, part)
        for t in tensors:
            writer.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(np.float32), t.nbytes,
                                   raw_dtype=t.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())  # data section starts aligned
        done = 0
        if progress:
            progress(0, total)
        for t in tensors:
            written = 0
            for chunk in tensor_chunks(t, seed, spec.n_expert):
                fout.write(memoryview(chunk))
                written += chunk.nbytes
                done += chunk.nbytes
                if progress:
                    progress(done, total)
            assert written == t.nbytes, (t.name, written, t.nbytes)
            writer.write_padding(fout, written)
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


# -- CLI ------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class _Progress:
    """One status line on stderr: rewritten in place on a terminal, every 10% otherwise."""

    def __init__(self, out: Path, stream=None):
        self.out, self.stream = out, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.last_t, self.last_pct = 0.0, -10

    def __call__(self, done: int, total: int) -> None:
        pct = 100 if total == 0 else int(done * 100 // total)
        now = time.monotonic()
        if self.tty:
            if done < total and now - self.last_t < 0.2:
                return
            end = "\n" if done >= total else ""
            self.stream.write(f"\rwriting {self.out}: {_size(done)} / {_size(total)} ({pct}%)" + end)
        else:
            if pct < self.last_pct + 10 and done < total:
                return
            self.last_pct = pct
            self.stream.write(f"writing {self.out}: {_size(done)} / {_size(total)} ({pct}%)\n")
        self.last_t = now
        self.stream.flush()


def _size(n: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.2f} {unit}"
    return f"{n} B"


def run_make_model(args: argparse.Namespace) -> int:
    """Handler of `make-model`: returns the exit code (0 done, 2 bad request or write failure)."""
    out = Path(args.out)
    try:
        mtp_out = Path(args.mtp_out) if args.mtp_out else None
        dspark_out = Path(args.dspark_out) if args.dspark_out else None
        path = make_model(args.arch, args.shape, out, seed=args.seed, progress=_Progress(out), mtp_out=mtp_out,
                          ctx=args.ctx, dspark_out=dspark_out)
    except SynthError as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"make-model: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("make-model: interrupted", file=sys.stderr)
        return 130
    for written in (path, *(p for p in (mtp_out, dspark_out) if p)):
        print(f"{written}  sha256 {_sha256(written)}")
    return 0


def add_make_model_parser(subparsers) -> argparse.ArgumentParser:
    """Register `make-model` on an argparse subparsers object; the handler is `args.func(args)`."""
    shapes = ", ".join(["tiny"] + [n for n in SHAPES if not n.startswith("tiny-")])
    p = subparsers.add_parser(
        "make-model",
        help="write a synthetic GGUF model of a given architecture and shape",
        description="Write a GGUF model with random weights in the exact layout of a real model "
        "(metadata, tensor names, shapes, Q4_K_M types, tokenizer), for benchmarks and tests.",
    )
    p.add_argument("--arch", required=True, help=f"architecture: {', '.join(ARCHS)}")
    p.add_argument("--shape", required=True, help=f"shape: {shapes}")
    p.add_argument("--out", required=True, help="output .gguf file (replaced if it exists)")
    p.add_argument("--mtp-out", metavar="PATH",
                   help="deepseek4: write the next-token (MTP) layer to PATH and the trunk alone to --out, as "
                        "llama.cpp's converter splits it (--mtp, --no-mtp); serve the pair with --spec mtp:PATH")
    p.add_argument("--dspark-out", metavar="PATH",
                   help="deepseek4: also write a DSpark block drafter for the model to PATH (architecture dflash, "
                        "as llama.cpp's converter writes it with --dspark; llama-server: -md PATH --spec-type "
                        "draft-dspark)")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same file (default 0)")
    p.add_argument("--ctx", type=int, metavar="TOKENS",
                   help="context length the file declares (default: the shape's; llama-8b's is 8192, so a 16k "
                        "conversation needs --ctx 32768)")
    p.set_defaults(func=run_make_model)
    return p
