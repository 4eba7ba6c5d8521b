// What the decode attention kernels share (attention.cu, attn_warp.cuh): loading a head vector as
// floats, the fused decode prologue and the decode kernels' parameter list.
#pragma once
#include "common.cuh"

template <int E>
EMBER_DEV void load_vals(const f16_t* p, float* out) {
    if constexpr (E % 8 == 0) {
#pragma unroll
        for (int i = 0; i < E / 8; ++i) {
            const uint4 v = reinterpret_cast<const uint4*>(p)[i];
            const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                out[8 * i + 2 * k] = h2f((u16)(w[k] & 0xffffu));
                out[8 * i + 2 * k + 1] = h2f((u16)(w[k] >> 16));
            }
        }
    } else if constexpr (E % 4 == 0) {
#pragma unroll
        for (int i = 0; i < E / 4; ++i) {
            const uint2 v = reinterpret_cast<const uint2*>(p)[i];
            out[4 * i + 0] = h2f((u16)(v.x & 0xffffu));
            out[4 * i + 1] = h2f((u16)(v.x >> 16));
            out[4 * i + 2] = h2f((u16)(v.y & 0xffffu));
            out[4 * i + 3] = h2f((u16)(v.y >> 16));
        }
    } else {
#pragma unroll
        for (int i = 0; i < E; ++i) out[i] = h2f(p[i].v);
    }
}

template <int E>
EMBER_DEV void load_vals(const float* p, float* out) {
    if constexpr (E % 4 == 0) {
#pragma unroll
        for (int i = 0; i < E / 4; ++i) {
            const float4 v = reinterpret_cast<const float4*>(p)[i];
            out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < E; ++i) out[i] = p[i];
    }
}

// The decode prologue that attn_decode fuses in front of attn (FUSED): the step's raw k and v rows
// (q is attn's q), the per-head RMSNorm weights (null: none), RoPE, and the new token's cache slot.
struct DecodePrologue {
    const float* k;
    i64 ldk;
    const float* v;
    i64 ldv;
    const float* qw;
    const float* kw;
    float eps;
    const float* inv_freq;
    float mscale;  // YaRN's cos/sin scale (1 without)
    int neox;
    const int* slots;
};

// The parameters of the decode kernels with the prologue fused (attn_warp, attn_decode), and their prologue.
// sinks (or null): a logit per query head that joins its softmax's denominator (gpt-oss; attention_sink).
#define DECODE_PARAMS(KVT)                                                                          \
    const float *__restrict__ q, i64 ldq, const float *k, i64 ldk, const float *v, i64 ldv,         \
        const float *qw, const float *kw, float eps, const float *inv_freq, float mscale, int neox, \
        const int *slots, KVT *kc, KVT *vc, const int *__restrict__ block_tables, int max_blocks,   \
        const int *__restrict__ row_seq, const int *__restrict__ row_pos, int Hq, int Hk, int BS,   \
        int window, float scale, const float *__restrict__ sinks, int split, float *__restrict__ out, \
        float *__restrict__ part_acc, float *__restrict__ part_ml
#define DECODE_PROLOGUE const DecodePrologue pro{k, ldk, v, ldv, qw, kw, eps, inv_freq, mscale, neox, slots}

// A softmax's sums relative to its max m (sum p * v and l = sum p) finished with a sink logit sk joining the
// denominator (null sinks: none): the factor the sums' quotient num / l takes, f / (l f + e^(sk - M)) with
// M = max(m, sk) and f = e^(m - M) (reference.attention's top = max(scores, sink)); 1 / l without a sink.
EMBER_DEV float sink_inv(const float* sinks, int head, float m, float l) {
    if (!sinks) return 1.0f / l;
    const float sk = sinks[head], M = fmaxf(m, sk), f = expf(m - M);
    return f / fmaf(l, f, expf(sk - M));
}
