"""Launchers: one Python function per kernel, taking DeviceArrays and choosing the variant.

One module per kernel family; each launcher names its numpy twin (``kernels/reference.py`` or
``kernels/quants.py``, mostly under the launcher's own name), and the gpu tests check every one against
its twin. (No module is named like a launcher: ``ops.matvec`` is the function.)

    module              CUDA sources                              twins
    matvecs.py          matvec.cu, matvec_k.cu, stream_q8_0.cu    reference.linear, reference.linear_q8
    dequant.py          dequant.cu                                quants.dequantize_rows, quants.dequantize
    norm.py             norm.cu, rope.cu, act.cu                  reference.rms_norm, rope, gated
    paged_attention.py  attention.cu, flash.cu                    reference.attention (+ rms_norm, rope),
                                                                  attention_partials, attention_merge, flash_rows
    sampling.py         sampling.cu                               numpy.argmax, reference.softmax, sample_rows
    matmul.py           gemm.cu                                   reference.linear on 16-bit values
    kv_copy.py          kv_copy.cu                                reference.kv_gather, reference.kv_scatter
    moe.py              moe.cu, matvec.cu qmoe/qmoeg/qmvn,        reference.route, reference.moe_mlp
                        qgemm.cu
    hyper.py            hyper.cu                                  worker/backends/numpy/hyper.py: hc_mix,
                                                                  hc_merge, compress, attend, indexer_scores,
                                                                  indexer_top_k, clamped_swiglu; numpy's
                                                                  mean(axis=1), astype(float16)
    fault.py            fault.cu                                  (none: the fault is the result)
    quant_matrix.py     QuantMatrix, the device's block formats   quants.py

The constants a launcher shares with its kernel (block sizes, tiles, warp counts, limits) come from
``kernels/constants.py``, the one table that build.py also passes to NVRTC. All activations are
float32; the KV cache is float16 or float32. Launches are asynchronous on the given stream; errors of
a launch's configuration raise at once, faults inside a kernel at the next synchronizing call (see
cuda_runtime). This package re-exports every public name, so callers use ``ops.<name>``.
"""

from __future__ import annotations

from ..constants import ACTIVATIONS, BLOCK_SIZES, GGML_TYPE_IDS, GGML_TYPE_NAMES
from .dequant import dequant_half, dequant_rows, embed
from .fault import fault_illegal_address
from .hyper import (
    ATTS_MAX_KEYS,
    HC_MAX,
    HC_MIX_MAX_ROWS,
    HcMixWork,
    attend_rows,
    clamped_swiglu,
    compress_rows,
    hc_logits,
    hc_merge,
    hc_mix,
    hc_mix_supported,
    hc_pre,
    indexer_scores,
    mean_streams,
    round_half,
    store_rows,
    swap_rows,
    top_k_rows,
)
from .kv_copy import kv_gather, kv_scatter
from .matmul import HALF_KINDS, gemm, gemm_splitk_bytes, gemm_splits, linear_tc, to_half
from .matvecs import (
    FAN_MAX,
    KQ8_ACTIVATIONS,
    KQ8_DEFAULT,
    KQ8_MAX_ROWS,
    KQ8_TYPES,
    KQ8_VARIANTS,
    KV2_MAX_COLS,
    KV2_PREFETCH,
    KV2_TYPES,
    MATVEC_WARPS,
    SQ_MAX_ROW_BYTES,
    SQ_ROWS,
    SQ_WARPS,
    XPRO_COLS,
    PostNorm,
    RowArgmax,
    kq8_supported,
    kv2_supported,
    matvec,
    matvec_fan,
    matvec_fan_supported,
    matvec_gated,
    matvec_gated_supported,
    matvec_groups,
    matvec_groups_supported,
    matvec_post_norm,
    matvec_q8,
    matvec_stream_q8_0,
    post_norm_supported,
    stream_q8_0_smem,
    stream_q8_0_supported,
)
from .moe import (
    MOE_MAX_EXPERTS,
    MOE_MAX_K,
    QGEMM_MIN_ROWS,
    ExpertMatrices,
    MoeScratch,
    MoeWeights,
    matvec_rows,
    moe_combine,
    moe_gather,
    moe_gemm,
    moe_group,
    moe_matvec,
    moe_matvec_q8,
    moe_mlp,
    moe_q8_supported,
    moe_route,
    moe_route_group,
    qgemm_supported,
    qmoc_supported,
)
from .norm import (
    NORM_MAX_COLS,
    add,
    add_bias,
    gated_act,
    gather_rows,
    norm_shape,
    rms_norm,
    rms_norm_add,
    rms_norm_add_norm,
    rope,
)
from .paged_attention import (
    ATT_SPLIT_MAX,
    ATT_SPLIT_MIN,
    ATTW_CLUSTER_MAX,
    ATTW_CLUSTER_MIN_SPLIT,
    ATTW_MAX_KEYS,
    ATTW_MAX_ROW_HEADS,
    ATTW_SPLIT_MAX,
    ATTW_SPREAD_CTAS,
    ATTW_STAGE_BYTES,
    ATTW_WARPS,
    FLASH_HEAD_DIMS,
    FLASH_ROWS,
    DecodePrologue,
    attention,
    attention_clustered,
    attention_parts,
    attention_split,
    attention_split_warp,
    attention_warp_cap,
    attention_warp_smem,
    attention_warp_stage_bytes,
    decode_kernel,
    flash_attention,
    flash_smem_bytes,
    flash_tiles,
    kv_write,
    qk_rope_kv,
)
from .quant_matrix import Q6K_PAD, QuantMatrix, repack_q6_k, row_nbytes
from .sampling import (
    ARGMAX_CHUNK,
    SAMPLE_MAX_PARTS,
    SAMPLE_PART,
    SampleParams,
    argmax,
    sample,
    sample_parts,
    softmax,
)

__all__ = [
    # types and tables
    "ACTIVATIONS", "BLOCK_SIZES", "GGML_TYPE_IDS", "GGML_TYPE_NAMES", "HALF_KINDS", "Q6K_PAD",
    "DecodePrologue", "PostNorm", "QuantMatrix", "RowArgmax", "SampleParams",
    # matvec
    "KQ8_ACTIVATIONS", "KQ8_DEFAULT", "KQ8_MAX_ROWS", "KQ8_TYPES", "KQ8_VARIANTS", "KV2_MAX_COLS", "KV2_PREFETCH",
    "KV2_TYPES", "FAN_MAX",
    "MATVEC_WARPS", "SQ_MAX_ROW_BYTES", "SQ_ROWS", "SQ_WARPS", "XPRO_COLS",
    "kq8_supported", "kv2_supported", "matvec", "matvec_fan", "matvec_fan_supported", "matvec_gated",
    "matvec_gated_supported", "matvec_groups",
    "matvec_groups_supported", "matvec_post_norm",
    "matvec_q8", "matvec_stream_q8_0", "post_norm_supported", "repack_q6_k", "row_nbytes", "stream_q8_0_smem",
    "stream_q8_0_supported",
    # dequant
    "dequant_half", "dequant_rows", "embed",
    # hyper (DeepSeek V4)
    "ATTS_MAX_KEYS", "HC_MAX", "HC_MIX_MAX_ROWS", "HcMixWork", "attend_rows", "clamped_swiglu", "compress_rows",
    "hc_logits", "hc_merge", "hc_mix", "hc_mix_supported", "hc_pre", "indexer_scores",
    "mean_streams", "round_half", "store_rows", "swap_rows", "top_k_rows",
    # norm, rope, act
    "NORM_MAX_COLS", "add", "add_bias", "gated_act", "gather_rows", "norm_shape", "rms_norm", "rms_norm_add",
    "rms_norm_add_norm", "rope",
    # attention
    "ATT_SPLIT_MAX", "ATT_SPLIT_MIN", "ATTW_CLUSTER_MAX", "ATTW_CLUSTER_MIN_SPLIT", "ATTW_MAX_KEYS",
    "ATTW_MAX_ROW_HEADS", "ATTW_SPLIT_MAX", "ATTW_SPREAD_CTAS", "ATTW_STAGE_BYTES", "ATTW_WARPS", "FLASH_HEAD_DIMS",
    "FLASH_ROWS", "attention", "attention_clustered", "attention_parts", "attention_split", "attention_split_warp",
    "attention_warp_cap", "attention_warp_smem", "attention_warp_stage_bytes", "decode_kernel", "flash_attention",
    "flash_smem_bytes", "flash_tiles", "kv_write", "qk_rope_kv",
    # sampling
    "ARGMAX_CHUNK", "SAMPLE_MAX_PARTS", "SAMPLE_PART", "argmax", "sample", "sample_parts", "softmax",
    # gemm
    "gemm", "gemm_splitk_bytes", "gemm_splits", "linear_tc", "to_half",
    # mixture of experts
    "MOE_MAX_EXPERTS", "MOE_MAX_K", "QGEMM_MIN_ROWS", "ExpertMatrices", "MoeScratch", "MoeWeights",
    "matvec_rows", "moe_combine", "moe_gather", "moe_gemm", "moe_group", "moe_matvec", "moe_matvec_q8", "moe_mlp",
    "moe_q8_supported", "moe_route", "moe_route_group", "qgemm_supported", "qmoc_supported",
    # kv copy, fault injection
    "fault_illegal_address", "kv_gather", "kv_scatter",
]
