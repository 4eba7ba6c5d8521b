"""The kernels' shared constants, in one table: tile sizes, block dimensions, warp counts, head-dim
limits, quant block sizes, type ids and activation codes.

`build.py` hands every entry of `KERNEL_CONSTANTS` (and of `KERNEL_FLOATS`, the few float ones) to NVRTC
as ``-DNAME=VALUE`` (so each is part of every module's options, and of its cubin cache key); the ``.cu``
files never define these names, they use them and ``static_assert`` what their code assumes of them.
The launchers (``ops/``) and the twins (``reference.py``) read the same names from here.
``tests/test_kernels_constants.py`` checks both ways: every source compiles with this table, and no
source defines a name the table owns.

Not here: launch policy that only the launchers decide (splits, grids sized to the device, variant
choices), and a kernel's private details that no launcher needs to know.
"""

from __future__ import annotations

KERNEL_CONSTANTS: dict[str, int] = {
    # ggml type ids (gguf GGMLQuantizationType): quant.cuh's QT<T>, the matvec modules' QTYPE
    "GT_F32": 0,
    "GT_F16": 1,
    "GT_Q4_0": 2,
    "GT_Q5_0": 6,
    "GT_Q8_0": 8,
    "GT_Q4_K": 12,
    "GT_Q5_K": 13,
    "GT_Q6_K": 14,
    "GT_BF16": 30,
    "GT_Q6_KP": 1014,  # not a ggml type: Q6_K with its blocks padded to 16-byte alignment on the device
    "GT_Q4_1": 3,
    "GT_Q5_1": 7,
    "GT_Q2_K": 10,
    "GT_Q3_K": 11,
    "GT_IQ2_XXS": 16,
    "GT_IQ2_XS": 17,
    "GT_IQ3_XXS": 18,
    "GT_IQ4_NL": 20,
    "GT_IQ3_S": 21,
    "GT_IQ2_S": 22,
    "GT_IQ4_XS": 23,
    "GT_MXFP4": 39,
    # quantized block formats (ggml-common.h), elements and bytes a block: quant.cuh QT<T>::ELEMS, BYTES
    "BLOCK_ELEMS_Q4_0": 32,
    "BLOCK_BYTES_Q4_0": 18,
    "BLOCK_ELEMS_Q5_0": 32,
    "BLOCK_BYTES_Q5_0": 22,
    "BLOCK_ELEMS_Q8_0": 32,
    "BLOCK_BYTES_Q8_0": 34,
    "BLOCK_ELEMS_Q4_K": 256,
    "BLOCK_BYTES_Q4_K": 144,
    "BLOCK_ELEMS_Q5_K": 256,
    "BLOCK_BYTES_Q5_K": 176,
    "BLOCK_ELEMS_Q6_K": 256,
    "BLOCK_BYTES_Q6_K": 210,
    "BLOCK_ELEMS_Q6_KP": 256,
    "BLOCK_BYTES_Q6_KP": 224,  # 210 + 14 zero bytes (ops.repack_q6_k)
    "BLOCK_ELEMS_Q4_1": 32,
    "BLOCK_BYTES_Q4_1": 20,
    "BLOCK_ELEMS_Q5_1": 32,
    "BLOCK_BYTES_Q5_1": 24,
    "BLOCK_ELEMS_Q2_K": 256,
    "BLOCK_BYTES_Q2_K": 84,
    "BLOCK_ELEMS_Q3_K": 256,
    "BLOCK_BYTES_Q3_K": 110,
    "BLOCK_ELEMS_IQ2_XXS": 256,
    "BLOCK_BYTES_IQ2_XXS": 66,
    "BLOCK_ELEMS_IQ2_XS": 256,
    "BLOCK_BYTES_IQ2_XS": 74,
    "BLOCK_ELEMS_IQ2_S": 256,
    "BLOCK_BYTES_IQ2_S": 82,
    "BLOCK_ELEMS_IQ3_XXS": 256,
    "BLOCK_BYTES_IQ3_XXS": 98,
    "BLOCK_ELEMS_IQ3_S": 256,
    "BLOCK_BYTES_IQ3_S": 110,
    "BLOCK_ELEMS_IQ4_NL": 32,
    "BLOCK_BYTES_IQ4_NL": 18,
    "BLOCK_ELEMS_IQ4_XS": 256,
    "BLOCK_BYTES_IQ4_XS": 136,
    "BLOCK_ELEMS_MXFP4": 32,
    "BLOCK_BYTES_MXFP4": 17,
    # matvec.cu (the staged matvec)
    "MATVEC_WARPS": 4,  # warps a block
    "FAN_MAX": 6,  # matrices one fan-out matvec makes at once (matvec.cu qmv_b1_r*_v16_fan)
    "QMOC_RPB": 16,  # rows a block of the column-resident grouped matvec (matvec.cu qmoc_b1)
    "QMOC_MAX_WARPS": 8,  # its warps at most, 1024 columns each (a thread 32): rows of at most 8192 (wider: qmoe_b1)
    "XPRO_COLS": 1024,  # columns of x a qmvx / qmvgx block makes itself: 8 a thread
    # matvec_k.cu (kv2, kq8: column-resident)
    "KV2_MAX_WARPS": 8,  # warps a block at most, so rows of at most 8 * 2048 columns
    "KV2_WARP_SUPERBLOCKS": 8,  # 256-column super-blocks a warp covers, four lanes each
    "KV2_MAX_RPB": 64,  # rows a block at most
    # stream_q8_0.cu (sq8_b1)
    "SQ_WARPS": 8,  # warps a block
    "SQ_ROWS": 8,  # rows a warp stages at a time (four lanes a row)
    "SQ_VECS": 12,  # 16-byte loads a lane holds: rows of at most 32 * 16 * SQ_VECS / SQ_ROWS bytes
    # attention.cu (attn, attn_decode, qk_rope_kv)
    "ATT_THREADS": 128,  # threads of an attn / attn_decode CTA
    "ATT_SPLIT_MAX": 512,  # keys an attn / attn_decode CTA takes at most
    "ATT_MAX_HEAD_DIM": 256,  # the largest head_dim any attention kernel is built for
    # attn_warp.cuh
    "ATTW_WARPS": 16,  # warps of an attn_warp CTA
    "ATTW_SPLIT_MAX": 256,  # keys an attn_warp CTA takes at most
    "ATTW_CLUSTER_MAX": 8,  # attn_warp splits merged inside one cluster, at most (a portable cluster size)
    # flash.cu (prefill attention on the tensor cores)
    "FLASH_WARPS": 4,  # warps a row group (head_dim 256: two row groups)
    "FLASH_ROWS": 64,  # query rows a tile, 16 a warp
    "FLASH_TILE_KEYS": 64,  # keys a K/V tile up to head_dim 128
    "FLASH_TILE_KEYS_D256": 32,  # keys a K/V tile at head_dim 256 (registers and shared memory)
    "FLASH_PAD": 8,  # halves of padding a shared-memory row (ldmatrix's rows in different banks)
    # hyper.cu (DeepSeek V4's hyper-connections and compressed rows)
    "HC_MAX": 8,  # residual streams a hyper-connection at most (DeepSeek V4: 4)
    "HC_THREADS": 256,  # threads of an hc_pre block (a token) and of an hc_merge, compress_rows, attend_rows block
    "HCL_TOKENS": 16,  # tokens an hc_logits block takes (a thread two of its rows of one token)
    "HCL_ROWS": 32,  # mix-logit rows an hc_logits block takes (DeepSeek V4 has 24)
    "HCM_THREADS": 128,  # threads of an hc_mix_dots block: a column of every stream each (32 blocks at 4096)
    "ATTS_MAX_KEYS": 4096,  # keys a query row of attend_rows at most (a window, 512 picked CSA rows or a 512k
    # context's HCA rows)
    "ATTS_MAX_D": 512,  # a head's dimensions in attend_rows at most (a multiple of 128: a lane holds
    # ATTS_MAX_D / 32; DeepSeek V4: 512)
    "IDX_MAX_Q": 8192,  # floats of an indexer query (heads x dim; DeepSeek V4: 64 x 128) in shared memory
    "IDX_MAX_DIM": 128,  # an indexer head's dimensions at most (a lane holds IDX_MAX_DIM / 32)
    # moe.cu (routing around the grouped expert matvecs)
    "MOE_MAX_EXPERTS": 256,  # experts a router at most (eight a lane of moe_route's warp)
    "MOE_MAX_K": 16,  # experts a token goes through at most
    # qgemm.cu (grouped matmul on the tensor cores from the GGUF blocks: experts at many tokens)
    "QG_ROWS": 128,  # weight rows a CTA computes (gated: 64 gate rows and their 64 up rows)
    "QG_THREADS": 256,  # 8 warps
    # rope.cu
    "ROPE_MAX_HALF": 256,  # rotation pairs a head at most: head_dim up to 512
    # act.cuh (gated_act): the gated MLP's activation codes, which every kernel with a gated epilogue takes
    # (act.cu, matvec.cu qmvg/qmoeg, matvec_k.cu kq8, qgemm.cu qgemmg); ACTIVATIONS names them
    "ACT_NONE": 0,  # no activation: the int8 matvec's plain product
    "ACT_SILU": 1,
    "ACT_GELU_TANH": 2,
    "ACT_SWIGLU_OAI": 3,  # gpt-oss's clamped SwiGLU (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT below)
    # norm.cu
    "NORM_MAX_THREADS": 1024,  # threads a row at most (each holds NORM_COLS_PER_THREAD columns)
    # sampling.cu
    "ARGMAX_CHUNK": 8192,  # entries of a row one argmax_part_f32 block reduces
    "ARGMAX_THREADS": 256,  # threads of an argmax_part_f32 block
    "SAMPLE_THREADS": 1024,  # threads of a sample_f32 block
    # gemm.cu (the prefill matmul)
    "GEMM_TILE_M": 128,  # rows of C a CTA computes
    "GEMM_TILE_N": 128,  # columns of C a CTA computes
    "GEMM_TILE_K": 32,  # the K slice a pipeline stage holds; K must be a multiple of it
    "GEMM_THREADS": 256,  # 8 warps, 2 x 4, each 64 x 32 of the tile
    # common.cuh EMBER_TRACE (the profiling build): cuda_runtime's trace buffer
    "TRACE_WORDS": 32768,  # words of the buffer: the count, then (start, release) pairs
    "TRACE_MARKS": 32704,  # TRACE_MARK(k), k < 64, stores its clock at word TRACE_MARKS + k
}

# The float constants a kernel shares with its twin, passed as -DNAME=VALUEf (reference.py reads them here)
KERNEL_FLOATS: dict[str, float] = {
    "SWIGLU_OAI_ALPHA": 1.702,  # gpt-oss's SwiGLU: gate * sigmoid(alpha * gate) (fixed in llama.cpp too)
    "SWIGLU_OAI_LIMIT": 7.0,  # the gate clamped above, up both ways, at this limit
}

# The gated activations by the names the recipes (recipe.Act), the launchers and the twins use: the one
# table from a name to the kernels' ACT_* code
ACTIVATIONS: dict[str, int] = {"silu": KERNEL_CONSTANTS["ACT_SILU"], "gelu_tanh": KERNEL_CONSTANTS["ACT_GELU_TANH"],
                               "swiglu_oai": KERNEL_CONSTANTS["ACT_SWIGLU_OAI"]}

# The variants the .cu files instantiate by macro (kernel names carry them); a CPU test finds each in
# the compiled modules.
ATTN_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)  # attention.cu, flash.cu
ATTN_GROUPS: tuple[int, ...] = (1, 2, 4, 8)  # query heads a kv head: attn, attn_decode, attn_warp
NORM_COLS_PER_THREAD: tuple[int, ...] = (4, 8)  # norm.cu rms_norm*_e{4,8}

# The rest of what the numpy backend reads (issue 39: the 2-5-bit K- and i-quants and MXFP4 of
# mixture-of-experts models), which the kernels decode through quant.cuh's block decoders only (no
# column-resident or int8 matvec of their own yet).
LOW_BIT_TYPES: tuple[str, ...] = ("q4_1", "q5_1", "q2_k", "q3_k", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s",
                                  "iq4_nl", "iq4_xs", "mxfp4")
# The device types the kernels read, by the names used in module and kernel names (matvec_<name>).
KERNEL_TYPES: tuple[str, ...] = ("f32", "f16", "q4_0", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k", "bf16", "q6_kp",
                                 *LOW_BIT_TYPES)
GGML_TYPE_IDS: dict[str, int] = {name: KERNEL_CONSTANTS[f"GT_{name.upper()}"] for name in KERNEL_TYPES}
GGML_TYPE_NAMES: dict[int, str] = {v: k for k, v in GGML_TYPE_IDS.items()}

# The block types qgemm.cu decodes on load (a module each): every quantized type the device keeps.
QGEMM_TYPES: tuple[str, ...] = ("q4_0", "q5_0", "q8_0", "q4_k", "q5_k", "q6_kp", *LOW_BIT_TYPES)

# (elements, bytes) a block of each type, the float types first (a float type's block is one element)
BLOCK_SIZES: dict[str, tuple[int, int]] = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2)} | {
    name: (KERNEL_CONSTANTS[f"BLOCK_ELEMS_{name.upper()}"], KERNEL_CONSTANTS[f"BLOCK_BYTES_{name.upper()}"])
    for name in KERNEL_TYPES
    if f"BLOCK_ELEMS_{name.upper()}" in KERNEL_CONSTANTS
}


def defines() -> tuple[str, ...]:
    """The tables as NVRTC options, in table order: ``-DNAME=VALUE`` each (the floats as float literals)."""
    return (*(f"-D{name}={value}" for name, value in KERNEL_CONSTANTS.items()),
            *(f"-D{name}={value!r}f" for name, value in KERNEL_FLOATS.items()))


def check_table() -> None:
    """What the table's own entries assume of each other; ValueError naming the first that fails."""
    c = KERNEL_CONSTANTS
    rules = {
        "XPRO_COLS == 8 * MATVEC_WARPS * 32": c["XPRO_COLS"] == 8 * c["MATVEC_WARPS"] * 32,
        "max(ATTN_HEAD_DIMS) == ATT_MAX_HEAD_DIM": max(ATTN_HEAD_DIMS) == c["ATT_MAX_HEAD_DIM"],
        "FLASH_ROWS == 16 * FLASH_WARPS": c["FLASH_ROWS"] == 16 * c["FLASH_WARPS"],
        "TRACE_MARKS + 64 <= TRACE_WORDS": c["TRACE_MARKS"] + 64 <= c["TRACE_WORDS"],
        "BLOCK_BYTES_Q6_KP % 16 == 0": c["BLOCK_BYTES_Q6_KP"] % 16 == 0,
        "BLOCK_BYTES_Q6_KP >= BLOCK_BYTES_Q6_K": c["BLOCK_BYTES_Q6_KP"] >= c["BLOCK_BYTES_Q6_K"],
        "ARGMAX_THREADS % 32 == 0": c["ARGMAX_THREADS"] % 32 == 0,
    }
    broken = [rule for rule, ok in rules.items() if not ok]
    if broken:
        raise ValueError(f"kernels/constants.py: {broken[0]} does not hold")


check_table()
