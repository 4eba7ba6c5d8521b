// Embedding lookup / dequantization: out[i, :] = dequantize(W[ids[i], :]) as float32, bit-identical
// to kernels/quants.py (w = s * q - o computed with separate, correctly rounded multiply and subtract,
// as numpy does; no FMA contraction). ids == nullptr decodes rows 0..n-1 (a whole tensor).
// One block of threads per output row; each thread decodes 8-element units straight from global
// memory (blocks of most types are only 2-byte aligned; A8 is used where 8-byte loads are safe).
// The _h16 / _hbf variants write f16 / bf16 instead (whole matrices, for the prefill GEMM's B).
#include "quant.cuh"

EMBER_DEV void store8(float* dst, const float* w) {
    float4* d = reinterpret_cast<float4*>(dst);
    d[0] = make_float4(w[0], w[1], w[2], w[3]);
    d[1] = make_float4(w[4], w[5], w[6], w[7]);
}
template <bool BF>
EMBER_DEV void store8(u16* dst, const float* w) {
    u32 p[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const u16 lo = BF ? f2bf(w[2 * k]) : f2h(w[2 * k]), hi = BF ? f2bf(w[2 * k + 1]) : f2h(w[2 * k + 1]);
        p[k] = (u32)lo | ((u32)hi << 16);
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(p[0], p[1], p[2], p[3]);
}

template <int T, bool A8, int OUT /* 0 float, 1 f16, 2 bf16 */, typename O>
EMBER_DEV void dequant_rows(const u8* __restrict__ W, i64 row_bytes, int n_rows, int cols,
                            const int* __restrict__ ids, int n, O* __restrict__ out, float scale) {
    typedef QT<T> Q;
    const int i = blockIdx.x;
    if (i >= n) return;
    int row = ids ? ids[i] : i;
    if (row < 0 || row >= n_rows) {  // out of range: NaN row (the host checks ids; this is a guard)
        if constexpr (OUT == 0)
            for (int c = threadIdx.x; c < cols; c += blockDim.x) out[(i64)i * cols + c] = __int_as_float(0x7fc00000);
        return;
    }
    const u8* rp = W + (i64)row * row_bytes;
    const int nunits = cols / 8;
    for (int g = threadIdx.x; g < nunits; g += blockDim.x) {
        const int blk = g / Q::UNITS, u = g % Q::UNITS;
        float q[8], s, o;
        Q::template unit<A8>(rp + (i64)blk * Q::BYTES, u, q, s, o);
        float w[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            w[k] = Q::IS_FLOAT ? q[k] : __fsub_rn(__fmul_rn(s, q[k]), o);
            w[k] = scale == 1.0f ? w[k] : __fmul_rn(w[k], scale);
        }
        if constexpr (OUT == 0)
            store8(out + (i64)i * cols + (i64)g * 8, w);
        else
            store8<OUT == 2>(out + (i64)i * cols + (i64)g * 8, w);
    }
}

// A decode/prefill step's first kernel: the token embedding with, optionally, run-ahead's feed in front
// (source[i] >= 0: row i's token is drawn[source[i]], from the previous step's draws, and is stored to
// ids[i]: run-ahead decoding, the step launched before the host has read the draws) and the first layer's RMSNorm behind (h = rms_norm(out) * norm_w, the
// math of rms_norm_f32: 1 / sqrt(mean(x^2) + eps), then (x * inv) * w). Two launches fewer a step.
template <int T, bool A8>
EMBER_DEV void embed(const u8* __restrict__ W, i64 row_bytes, int n_rows, int cols, const int* drawn,
                     const int* __restrict__ source, int* ids, int n, float* __restrict__ out, float scale,
                     const float* __restrict__ norm_w, float eps, float* __restrict__ h) {
    __shared__ float scratch[33];
    const int i = blockIdx.x;
    if (i >= n) return;
    if (source && source[i] >= 0) {  // block-uniform
        if (threadIdx.x == 0) ids[i] = drawn[source[i]];
        __syncthreads();
    }
    dequant_rows<T, A8, 0>(W, row_bytes, n_rows, cols, ids, n, out, scale);
    if (!norm_w) return;
    float ss = 0.0f;  // each thread reads back only what it stored itself
    for (int c = threadIdx.x * 8; c < cols; c += blockDim.x * 8)
#pragma unroll
        for (int k = 0; k < 8; ++k) ss = fmaf(out[(i64)i * cols + c + k], out[(i64)i * cols + c + k], ss);
    const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)cols + eps);
    for (int c = threadIdx.x * 8; c < cols; c += blockDim.x * 8)
#pragma unroll
        for (int k = 0; k < 8; ++k) h[(i64)i * cols + c + k] = (out[(i64)i * cols + c + k] * inv) * norm_w[c + k];
}

#define EMBED(NAME, T, SUF, A8)                                                                             \
    extern "C" __global__ void embed_##NAME##_##SUF(const u8* __restrict__ W, i64 row_bytes, int n_rows,        \
                                                    int cols, const int* drawn, const int* source, int* ids,    \
                                                    int n, float* __restrict__ out, float scale,              \
                                                    const float* norm_w, float eps, float* h) {               \
        grid_dependency_sync();                                                                              \
        embed<T, A8>(W, row_bytes, n_rows, cols, drawn, source, ids, n, out, scale, norm_w, eps, h);        \
    }

#define DQ(NAME, T)                                                                                  \
    extern "C" __global__ void dequant_##NAME##_a2(const u8* __restrict__ W, i64 row_bytes, int n_rows, \
                                                   int cols, const int* __restrict__ ids, int n,      \
                                                   float* __restrict__ out, float scale) {            \
        grid_dependency_sync();                                                                       \
        dequant_rows<T, false, 0>(W, row_bytes, n_rows, cols, ids, n, out, scale);                  \
    }                                                                                                \
    extern "C" __global__ void dequant_##NAME##_a8(const u8* __restrict__ W, i64 row_bytes, int n_rows, \
                                                   int cols, const int* __restrict__ ids, int n,      \
                                                   float* __restrict__ out, float scale) {            \
        grid_dependency_sync();                                                                       \
        dequant_rows<T, true, 0>(W, row_bytes, n_rows, cols, ids, n, out, scale);                   \
    }                                                                                                \
    EMBED(NAME, T, a8, true)                                                                          \
    EMBED(NAME, T, a2, false)                                                                         \
    extern "C" __global__ void dequant_##NAME##_h16(const u8* __restrict__ W, i64 row_bytes, int n_rows, \
                                                    int cols, int n, u16* __restrict__ out) {         \
        grid_dependency_sync();                                                                       \
        dequant_rows<T, false, 1>(W, row_bytes, n_rows, cols, nullptr, n, out, 1.0f);               \
    }                                                                                                \
    extern "C" __global__ void dequant_##NAME##_hbf(const u8* __restrict__ W, i64 row_bytes, int n_rows, \
                                                    int cols, int n, u16* __restrict__ out) {         \
        grid_dependency_sync();                                                                       \
        dequant_rows<T, false, 2>(W, row_bytes, n_rows, cols, nullptr, n, out, 1.0f);               \
    }

DQ(f32, GT_F32)
DQ(f16, GT_F16)
DQ(bf16, GT_BF16)
DQ(q4_0, GT_Q4_0)
DQ(q5_0, GT_Q5_0)
DQ(q8_0, GT_Q8_0)
DQ(q4_k, GT_Q4_K)
DQ(q5_k, GT_Q5_K)
DQ(q6_k, GT_Q6_K)
DQ(q6_kp, GT_Q6_KP)
DQ(q4_1, GT_Q4_1)
DQ(q5_1, GT_Q5_1)
DQ(q2_k, GT_Q2_K)
DQ(q3_k, GT_Q3_K)
DQ(iq2_xxs, GT_IQ2_XXS)
DQ(iq2_xs, GT_IQ2_XS)
DQ(iq2_s, GT_IQ2_S)
DQ(iq3_xxs, GT_IQ3_XXS)
DQ(iq3_s, GT_IQ3_S)
DQ(iq4_nl, GT_IQ4_NL)
DQ(iq4_xs, GT_IQ4_XS)
DQ(mxfp4, GT_MXFP4)
