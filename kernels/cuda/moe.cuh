// A router's choice for one token (moe.cu's routing kernels, and the batch-1 router matvec of matvec.cu
// qmvs_route_b1, which routes in its last block): the k experts, best first, and their weights.
#pragma once
#include "common.cuh"

static_assert(MOE_MAX_EXPERTS % 32 == 0 && MOE_MAX_EXPERTS <= 1024, "experts a router: whole warps");

#define GATING_SOFTMAX 0  // softmax over every expert, then the k largest (qwen3moe)
#define GATING_SOFTMAX_TOPK 1  // the k largest logits, then a softmax over those k (gpt-oss)
// sqrt(softplus(logit)) per expert; the k largest of it plus `bias` (a selection bias here: the weights
// stay unbiased), or the token's k experts from a table (hash routing); deepseek4
#define GATING_SQRT_SOFTPLUS 2

EMBER_DEV float sqrt_softplus(float x) { return sqrtf(x > 20.0f ? x : log1pf(expf(x))); }

// v[e / 32] of lane e % 32, to every lane of the warp (every lane must call it, with the same e)
template <int PER>
EMBER_DEV float lane_value(const float (&v)[PER], int e) {
    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const float c = __shfl_sync(0xffffffffu, v[i], e & 31);
        if (i == (e >> 5)) out = c;
    }
    return out;
}

// token t's k experts by one warp; ties go to the lower expert (numpy's stable argsort of the negated
// values). CG: the logits were written by other blocks of this kernel, so they are read through L2 (__ldcg)
// rather than a cache that may not have seen those writes.
template <bool CG = false>
EMBER_DEV void route_token(const float* __restrict__ logits, const float* __restrict__ bias, int t, int E, int k,
                           int gating, int norm, float sum_min, int* __restrict__ ids, float* __restrict__ wts,
                           float scale = 1.0f, const int* __restrict__ table = nullptr,
                           const int* __restrict__ tokens = nullptr) {
    constexpr int PER = MOE_MAX_EXPERTS / 32;
    const int lane = threadIdx.x & 31;
    const bool ssp = gating == GATING_SQRT_SOFTPLUS;
    float v[PER], raw[PER];  // what the choice ranks; what the weights are made of (sqrt-softplus: apart)
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        const float* at = logits + (i64)t * E + e;
        const float l = e < E ? (CG ? __ldcg(at) : *at) : 0.0f;
        const float b = e < E && bias ? bias[e] : 0.0f;
        raw[i] = ssp ? sqrt_softplus(l) : 0.0f;
        v[i] = e < E ? (ssp ? raw[i] : l) + b : NEG_INF;
    }
    if (gating == GATING_SOFTMAX) {
        float mx = NEG_INF;
#pragma unroll
        for (int i = 0; i < PER; ++i) mx = fmaxf(mx, v[i]);
        mx = warp_max(mx);
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            v[i] = lane + 32 * i < E ? expf(v[i] - mx) : 0.0f;
            s += v[i];
        }
        s = warp_sum(s);
#pragma unroll
        for (int i = 0; i < PER; ++i) v[i] = lane + 32 * i < E ? v[i] / s : NEG_INF;
    }
    float best[MOE_MAX_K];
    int who[MOE_MAX_K];
    for (int j = 0; j < k; ++j) {
        int bi;
        float bv;
        if (table) {  // hash routing: the token's row of the table
            bi = table[(i64)tokens[t] * k + j];
            bv = 0.0f;
        } else {
            bv = NEG_INF;
            bi = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                const int e = lane + 32 * i;
                if (e < E && (v[i] > bv || (v[i] == bv && e < bi))) { bv = v[i]; bi = e; }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
            }
#pragma unroll
            for (int i = 0; i < PER; ++i)
                if (lane + 32 * i == bi) v[i] = NEG_INF;  // taken; E is below 2^31, so bi is a real expert
        }
        best[j] = ssp ? lane_value(raw, bi) : bv;
        who[j] = bi;
    }
    if (lane != 0) return;
    float s = 0.0f;
    if (gating == GATING_SOFTMAX_TOPK) {
        const float mx = best[0];  // the largest
        for (int j = 0; j < k; ++j) {
            best[j] = expf(best[j] - mx);
            s += best[j];
        }
        for (int j = 0; j < k; ++j) best[j] /= s;
    }
    s = 0.0f;
    for (int j = 0; j < k; ++j) s += best[j];
    const float inv = norm ? 1.0f / fmaxf(s, sum_min) : 1.0f;
    for (int j = 0; j < k; ++j) {
        ids[(i64)t * k + j] = who[j];
        wts[(i64)t * k + j] = best[j] * inv * scale;
    }
}
