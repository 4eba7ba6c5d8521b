// Paged attention over a KV cache of fixed-size blocks (KV stored as float or fp16).
//
// Cache layout (per layer): [slots, Hk, D] with slot = block * BS + offset; a sequence's position p
// lives in block_tables[seq][p / BS] at offset p % BS (worker/backends/base.py's rule).
//
// attn_<D>_g<G>_<kv>: one query row = one token of one sequence at position pos; it sees the keys at
// positions j <= pos with pos - j < window (window 0: all), reference.attention's rule. A CTA owns one
// (kv head, query row, split): the G = Hq / Hk query heads that share that kv head, over a run of at
// most `split` keys (split-K over long contexts). Scores go to shared memory (16 lanes per key, D/16
// elements each), a softmax per head, then the weighted sum of V (one warp per key, D/32 elements per
// lane). With one split the CTA writes the normalised output; otherwise it writes (sum p*v, max, sum p)
// and attn_combine merges the splits (twin: reference.attention_partials and attention_merge). With sinks
// (gpt-oss: a learned logit per query head in each softmax's denominator, never a value) the sink joins
// where the output is normalised: the single split's CTA, or the merge. Decode is one query row per
// sequence; prefill may use the same kernel with one row per prompt token (correct, not yet flash-style
// fast).
//
// attn_decode_<D>_g<G>_<kv>: the same for decode steps (one row per sequence) with qk_rope_kv's work
// for the row fused in front: each CTA norms and rotates its G query heads and its key head itself,
// the CTA whose split holds the new position stores the new K and V, and before waiting for the
// kernel before it (the q|k|v matvec) a CTA reads its keys' slots and fetches their K and V rows into
// L2 -- every key but the new one was written by an earlier step.
#include "attn_common.cuh"
#include "attn_warp.cuh"

// ATT_THREADS (threads a CTA), ATT_SPLIT_MAX (keys a CTA at most) and ATT_MAX_HEAD_DIM come from
// kernels/constants.py
static_assert(ATT_THREADS % 32 == 0 && ATT_THREADS >= ATT_MAX_HEAD_DIM / 2,
              "attn_decode's prologue: a thread per rotation pair of a head");

template <int D, int G, typename KV, bool FUSED>
EMBER_DEV void attn(const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,
                    const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ row_seq,
                    const int* __restrict__ row_pos, int Hq, int Hk, int BS, int window, float scale,
                    const float* __restrict__ sinks, int split, float* __restrict__ out, float* __restrict__ part_acc,
                    float* __restrict__ part_ml, i64 ldq, const DecodePrologue& pro, KV* kc_new, KV* vc_new) {
    __shared__ float sc[G][ATT_SPLIT_MAX];
    __shared__ float red[G][D];
    __shared__ float stat[G][2];
    // FUSED: the roped q heads, the new key and value (as the cache holds them), slots, angles
    constexpr int FD = FUSED ? D : 1, FS = FUSED ? ATT_SPLIT_MAX : 1;
    __shared__ float qs[G][FD], knew[FD], vnew[FD], cs[FD / 2 + 1], sn[FD / 2 + 1];
    __shared__ float ssq[ATT_THREADS / 32][G + 1];
    __shared__ int slot_s[FS];
    const int kh = blockIdx.x, row = blockIdx.y, z = blockIdx.z, S = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int pos = row_pos[row];  // the step's inputs: read before waiting for the previous kernel
    const int* bt = block_tables + (i64)row_seq[row] * max_blocks;
    const int L = pos + 1;
    const int lo = window > 0 ? max(0, L - window) : 0;
    const int t0 = lo + z * split;
    const int nt = min(L, t0 + split) - t0;  // keys of this split; may be <= 0
    const i64 slot_stride = (i64)Hk * D;
    if constexpr (FUSED) {
        // a decode row's only new key is its own, at pos: the older keys' slots are known and their K
        // and V rows (written by earlier steps) are fetched into L2 while the kernel before finishes
        rope_table(cs, sn, pos, pro.inv_freq, D / 2, pro.mscale);
        for (int t = tid; t < nt; t += ATT_THREADS) {
            const int p = t0 + t;
            const int s = bt[p / BS] * BS + p % BS;
            slot_s[t] = s;
            if (p != pos) {
                l2_prefetch(kc + (i64)s * slot_stride + (i64)kh * D, D * (int)sizeof(KV));
                l2_prefetch(vc + (i64)s * slot_stride + (i64)kh * D, D * (int)sizeof(KV));
            }
        }
    }
    grid_dependency_sync();
    if constexpr (FUSED) {
        // qk_rope_kv's work for this kv head: thread i < D/2 takes rotation pair i (neox: elements i
        // and i + D/2; normal: 2i and 2i + 1) of the G query heads and the key head
        constexpr int HALF = D / 2;
        const bool owner = pos >= t0 && pos < t0 + nt;  // this split holds the new key: it stores it
        const i64 slot_new = pro.slots[row];
        const int ia = pro.neox ? tid : 2 * tid, ib = pro.neox ? tid + HALF : 2 * tid + 1;
        float a[G + 1], b[G + 1];
#pragma unroll
        for (int h = 0; h <= G; ++h) {
            float ss = 0.0f;
            a[h] = b[h] = 0.0f;
            if (tid < HALF) {
                const float* src = h < G ? q + (i64)row * ldq + (i64)(kh * G + h) * D
                                         : pro.k + (i64)row * pro.ldk + (i64)kh * D;
                a[h] = src[ia];
                b[h] = src[ib];
                ss = fmaf(a[h], a[h], ss);
                ss = fmaf(b[h], b[h], ss);
            }
            ss = warp_sum(ss);
            if (lane == 0) ssq[warp][h] = ss;
        }
        for (int e = tid; e < D; e += ATT_THREADS) {  // v: into its slot as it is
            const KV val = from_f32<KV>(pro.v[(i64)row * pro.ldv + (i64)kh * D + e]);
            vnew[e] = to_f32(val);
            if (owner) vc_new[(slot_new * Hk + kh) * D + e] = val;
        }
        __syncthreads();
        if (tid < HALF) {
#pragma unroll
            for (int h = 0; h <= G; ++h) {
                const float* w = h < G ? pro.qw : pro.kw;
                float inv = 1.0f;
                if (w) {
                    float tot = 0.0f;
#pragma unroll
                    for (int i = 0; i < ATT_THREADS / 32; ++i) tot += ssq[i][h];
                    inv = 1.0f / sqrtf(tot / (float)D + pro.eps);
                }
                const float x1 = w ? (a[h] * inv) * w[ia] : a[h];
                const float x2 = w ? (b[h] * inv) * w[ib] : b[h];
                const float c = cs[tid], sv = sn[tid];
                const float r1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sv));
                const float r2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sv));
                if (h < G) {
                    qs[h][ia] = r1;
                    qs[h][ib] = r2;
                } else {
                    const KV k1 = from_f32<KV>(r1), k2 = from_f32<KV>(r2);
                    knew[ia] = to_f32(k1);
                    knew[ib] = to_f32(k2);
                    if (owner) {
                        kc_new[(slot_new * Hk + kh) * D + ia] = k1;
                        kc_new[(slot_new * Hk + kh) * D + ib] = k2;
                    }
                }
            }
        }
        __syncthreads();
    }

    // phase 1: scores, 16 lanes per key
    constexpr int E1 = D / 16;
    const int hl = tid & 15, sub = (tid >> 4) & 1;
    float qr[G][E1];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* qp = q + (i64)row * ldq + (i64)(kh * G + g) * D + hl * E1;  // ldq: q rows may sit in a fused qkv row
#pragma unroll
        for (int e = 0; e < E1; ++e) qr[g][e] = (FUSED ? qs[g][hl * E1 + e] : qp[e]) * scale;
    }
    // KU keys per half-warp per iteration, their loads issued together: the loop is bound by memory
    // latency (block table, then K), not bandwidth, so several keys must be in flight at once
    constexpr int KU = (G >= 8 || (D == 256 && G >= 4)) ? 2 : 4;
    constexpr int KSTEP = ATT_THREADS / 16;  // keys one pass of the CTA covers
    for (int tb = 2 * warp; tb < nt; tb += KU * KSTEP) {  // warp-uniform loop
        float kv[KU][E1];
        int slot_u[KU];
#pragma unroll
        for (int u = 0; u < KU; ++u) {
            const int t = tb + u * KSTEP + sub;
            const int p = t0 + min(t, nt - 1);
            slot_u[u] = FUSED ? slot_s[min(t, nt - 1)] : bt[p / BS] * BS + p % BS;
        }
#pragma unroll
        for (int u = 0; u < KU; ++u) {
            const int t = tb + u * KSTEP + sub;
            if (FUSED && t0 + t == pos) {  // the new key: this kernel wrote it, so it is not read back
#pragma unroll
                for (int e = 0; e < E1; ++e) kv[u][e] = knew[hl * E1 + e];
            } else if (t < nt) {
                load_vals<E1>(kc + (i64)slot_u[u] * slot_stride + (i64)kh * D + hl * E1, kv[u]);
            } else {
#pragma unroll
                for (int e = 0; e < E1; ++e) kv[u][e] = 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < KU; ++u) {
            const int t = tb + u * KSTEP + sub;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < E1; ++e) d = fmaf(qr[g][e], kv[u][e], d);
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                if (t < nt && hl == 0) sc[g][t] = d;
            }
        }
    }
    __syncthreads();

    // softmax per head over this split (unnormalised; the sum is kept)
    for (int g = warp; g < G; g += ATT_THREADS / 32) {
        float m = -__int_as_float(0x7f800000);
        for (int t = lane; t < nt; t += 32) m = fmaxf(m, sc[g][t]);
        m = warp_max(m);
        float l = 0.0f;
        for (int t = lane; t < nt; t += 32) {
            const float e = expf(sc[g][t] - m);
            sc[g][t] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) { stat[g][0] = m; stat[g][1] = l; }
    }
    __syncthreads();

    // phase 2: sum_t p_t * v_t, one warp per key
    constexpr int E2 = D / 32;
    float acc[G][E2];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < E2; ++e) acc[g][e] = 0.0f;
    constexpr int VU = 4;  // keys per warp per iteration, loads in flight together
    constexpr int VSTEP = ATT_THREADS / 32;
    for (int tb = warp; tb < nt; tb += VU * VSTEP) {
        float vv[VU][E2];
        int slot_u[VU];
#pragma unroll
        for (int u = 0; u < VU; ++u) {
            const int p = t0 + min(tb + u * VSTEP, nt - 1);
            slot_u[u] = FUSED ? slot_s[min(tb + u * VSTEP, nt - 1)] : bt[p / BS] * BS + p % BS;
        }
#pragma unroll
        for (int u = 0; u < VU; ++u) {
            if (FUSED && t0 + tb + u * VSTEP == pos) {
#pragma unroll
                for (int e = 0; e < E2; ++e) vv[u][e] = vnew[lane * E2 + e];
            } else if (tb + u * VSTEP < nt) {
                load_vals<E2>(vc + (i64)slot_u[u] * slot_stride + (i64)kh * D + lane * E2, vv[u]);
            } else {
#pragma unroll
                for (int e = 0; e < E2; ++e) vv[u][e] = 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < VU; ++u) {
            const int t = min(tb + u * VSTEP, nt - 1);
            const bool ok = tb + u * VSTEP < nt;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float pg = ok ? sc[g][t] : 0.0f;
#pragma unroll
                for (int e = 0; e < E2; ++e) acc[g][e] = fmaf(pg, vv[u][e], acc[g][e]);
            }
        }
    }
    // the warps' sums, added in warp order (shared-memory float atomics cost more than these barriers,
    // and the order makes the result reproducible)
#pragma unroll
    for (int w = 0; w < ATT_THREADS / 32; ++w) {
        if (warp == w) {
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int e = 0; e < E2; ++e) red[g][lane * E2 + e] = (w ? red[g][lane * E2 + e] : 0.0f) + acc[g][e];
        }
        __syncthreads();
    }

    for (int i = tid; i < G * D; i += ATT_THREADS) {
        const int g = i / D, d = i % D;
        const i64 h = (i64)row * Hq + kh * G + g;
        if (S == 1) {  // with a sink, it joins the denominator here (split: in attn_combine)
            out[h * D + d] = sinks ? red[g][d] * sink_inv(sinks, kh * G + g, stat[g][0], stat[g][1])
                                   : red[g][d] / stat[g][1];
        } else {
            part_acc[(h * S + z) * D + d] = red[g][d];
            if (d == 0) {
                part_ml[(h * S + z) * 2] = nt > 0 ? stat[g][0] : -__int_as_float(0x7f800000);
                part_ml[(h * S + z) * 2 + 1] = nt > 0 ? stat[g][1] : 0.0f;
            }
        }
    }
}

// At most 64 registers a thread (two CTAs of 512 threads an SM fit): at 96 (what ptxas took
// unbounded) a CTA needed three quarters of an SM's registers, so under programmatic dependent
// launch it found no SM beside the q|k|v matvec's CTAs and started only as that kernel ended (seen
// with `ember bench trace` on the H200: kernels/README.md).
#define ATTN_WARP(D, G, KVN, KVT)                                                                      \
    extern "C" __global__ void __launch_bounds__(ATTW_WARPS * 32, 2) attn_warp_d##D##_g##G##_##KVN(DECODE_PARAMS(KVT)) { \
        DECODE_PROLOGUE;                                                                               \
        attn_warp<D, G, KVT>(q, ldq, pro, kc, vc, block_tables, max_blocks, row_seq, row_pos, Hq, Hk,  \
                             BS, window, scale, sinks, split, out, part_acc, part_ml);                 \
    }
#define ATTN_WARP_G(D, KVN, KVT) \
    ATTN_WARP(D, 1, KVN, KVT) ATTN_WARP(D, 2, KVN, KVT) ATTN_WARP(D, 4, KVN, KVT) ATTN_WARP(D, 8, KVN, KVT)
ATTN_WARP_G(64, f16, f16_t) ATTN_WARP_G(128, f16, f16_t) ATTN_WARP_G(256, f16, f16_t)
ATTN_WARP_G(64, f32, float) ATTN_WARP_G(128, f32, float) ATTN_WARP_G(256, f32, float)

// Merge S splits: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s; with sinks, the head's sink logit sk
// joins: M takes it, and the denominator e^(sk - M). grid (Hq, rows), block D. Twin: reference.attention_merge.
extern "C" __global__ void attn_combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                        int S, int Hq, int D, const float* __restrict__ sinks,
                                        float* __restrict__ out) {
    grid_dependency_sync();
    // unrolled and branch-free, so the loads of many splits are in flight at once (a dependent chain
    // of S global loads is what made this kernel slow)
    const i64 h = (i64)blockIdx.y * Hq + blockIdx.x;
    const float* ml = part_ml + h * S * 2;
    float M = -__int_as_float(0x7f800000);
#pragma unroll 8
    for (int s = 0; s < S; ++s) M = fmaxf(M, ml[2 * s]);
    const float sk = sinks ? sinks[blockIdx.x] : 0.0f;
    if (sinks) M = fmaxf(M, sk);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.0f, den = sinks ? expf(sk - M) : 0.0f;
#pragma unroll 8
        for (int s = 0; s < S; ++s) {
            const float l = ml[2 * s + 1];
            const float f = l > 0.0f ? expf(ml[2 * s] - M) : 0.0f;  // an empty split weighs nothing
            num = fmaf(f, part_acc[(h * S + s) * D + d], num);
            den = fmaf(f, l, den);
        }
        out[h * D + d] = num / den;
    }
}

#define ATTN(D, G, KVN, KVT)                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_d##D##_g##G##_##KVN(               \
        const float* __restrict__ q, const KVT* __restrict__ kc, const KVT* __restrict__ vc,          \
        const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ row_seq,        \
        const int* __restrict__ row_pos, int Hq, int Hk, int BS, int window, float scale,             \
        const float* __restrict__ sinks, int split, float* __restrict__ out, float* __restrict__ part_acc, \
        float* __restrict__ part_ml, i64 ldq) {                                                       \
        attn<D, G, KVT, false>(q, kc, vc, block_tables, max_blocks, row_seq, row_pos, Hq, Hk, BS,     \
                               window, scale, sinks, split, out, part_acc, part_ml, ldq, DecodePrologue{}, \
                               nullptr, nullptr);                                                     \
    }
// attn_decode: one decode row per sequence, with qk_rope_kv's work for it fused in front (the new k
// and v stored by the split that holds position pos, and used from shared memory, not read back)
#define ATTN_DECODE(D, G, KVN, KVT)                                                                      \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_decode_d##D##_g##G##_##KVN(DECODE_PARAMS(KVT)) { \
        DECODE_PROLOGUE;                                                                                 \
        attn<D, G, KVT, true>(q, kc, vc, block_tables, max_blocks, row_seq, row_pos, Hq, Hk, BS, window, \
                              scale, sinks, split, out, part_acc, part_ml, ldq, pro, kc, vc);            \
    }
#define ATTN_G(D, KVN, KVT)                                                                      \
    ATTN(D, 1, KVN, KVT) ATTN(D, 2, KVN, KVT) ATTN(D, 4, KVN, KVT) ATTN(D, 8, KVN, KVT)          \
    ATTN_DECODE(D, 1, KVN, KVT) ATTN_DECODE(D, 2, KVN, KVT) ATTN_DECODE(D, 4, KVN, KVT)          \
    ATTN_DECODE(D, 8, KVN, KVT)
ATTN_G(64, f16, f16_t) ATTN_G(128, f16, f16_t) ATTN_G(256, f16, f16_t)
ATTN_G(64, f32, float) ATTN_G(128, f32, float) ATTN_G(256, f32, float)

// Write the new tokens' K and V (float rows with strides ldk/ldv, [n, Hk, D]) into their cache slots.
template <typename KV>
EMBER_DEV void kv_write(const float* __restrict__ k, i64 ldk, const float* __restrict__ v, i64 ldv,
                        KV* __restrict__ kc, KV* __restrict__ vc, const int* __restrict__ slots, int n,
                        int Hk, int D) {
    const int t = blockIdx.x;
    if (t >= n) return;
    const i64 slot = slots[t];
    for (int i = threadIdx.x; i < Hk * D; i += blockDim.x) {
        kc[slot * Hk * D + i] = from_f32<KV>(k[(i64)t * ldk + i]);
        vc[slot * Hk * D + i] = from_f32<KV>(v[(i64)t * ldv + i]);
    }
}
extern "C" __global__ void kv_write_f16(const float* k, i64 ldk, const float* v, i64 ldv, f16_t* kc,
                                        f16_t* vc, const int* slots, int n, int Hk, int D) {
    grid_dependency_sync();
    kv_write<f16_t>(k, ldk, v, ldv, kc, vc, slots, n, Hk, D);
}
extern "C" __global__ void kv_write_f32(const float* k, i64 ldk, const float* v, i64 ldv, float* kc,
                                        float* vc, const int* slots, int n, int Hk, int D) {
    grid_dependency_sync();
    kv_write<float>(k, ldk, v, ldv, kc, vc, slots, n, Hk, D);
}

// The attention prologue of one decode/prefill step, one block per token: for each q and k head,
// the per-head RMSNorm (qwen3, gemma3: when qw/kw are given) and RoPE, q written back in place and
// k into its cache slot, and v copied into its slot; the work of rms_norm_f32 (twice), rope_f32 and
// kv_write_* in one launch. One warp per head: lane l holds the rotation pairs i = l + 32 j (neox:
// elements i and i + D/2; normal: 2i and 2i + 1), so the norm is a warp sum and the rotation needs
// no exchange. Angles in double, like rope_f32 and the twin.
#define PRO_MAX_PAIRS (ATT_MAX_HEAD_DIM / 64)  // rotation pairs a lane holds: D / 64
template <typename KV>
EMBER_DEV void qk_rope_kv(float* __restrict__ q, i64 ldq, const float* __restrict__ k, i64 ldk,
                          const float* __restrict__ v, i64 ldv, int hq, int hk, int D,
                          const float* __restrict__ qw, const float* __restrict__ kw, float eps,
                          const int* __restrict__ pos, const float* __restrict__ inv_freq, float mscale, int neox,
                          KV* __restrict__ kc, KV* __restrict__ vc, const int* __restrict__ slots, int n) {
    __shared__ float cs[ATT_MAX_HEAD_DIM / 2], sn[ATT_MAX_HEAD_DIM / 2];
    const int t = blockIdx.x;
    const int half = D / 2, per = half / 32;
    // positions and frequencies come from the step's input copy, not from the kernel before this one:
    // the angles are computed while that kernel finishes (programmatic dependent launch)
    if (t < n) rope_table(cs, sn, pos[t], inv_freq, half, mscale);
    grid_dependency_sync();
    if (t >= n) return;
    __syncthreads();
    const i64 slot = slots[t];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int h = warp; h < hq + 2 * hk; h += nw) {
        if (h >= hq + hk) {  // v: a copy into its slot
            const float* src = v + (i64)t * ldv + (i64)(h - hq - hk) * D;
            KV* dst = vc + (slot * hk + (h - hq - hk)) * D;
            for (int e = lane; e < D; e += 32) dst[e] = from_f32<KV>(src[e]);
            continue;
        }
        const bool is_q = h < hq;
        const float* src = is_q ? q + (i64)t * ldq + (i64)h * D : k + (i64)t * ldk + (i64)(h - hq) * D;
        const float* w = is_q ? qw : kw;
        float a[PRO_MAX_PAIRS], b[PRO_MAX_PAIRS];
        int ia[PRO_MAX_PAIRS], ib[PRO_MAX_PAIRS];
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < PRO_MAX_PAIRS; ++j) {
            if (j < per) {
                const int i = lane + 32 * j;
                ia[j] = neox ? i : 2 * i;
                ib[j] = neox ? i + half : 2 * i + 1;
                a[j] = src[ia[j]];
                b[j] = src[ib[j]];
                ss = fmaf(a[j], a[j], ss);
                ss = fmaf(b[j], b[j], ss);
            }
        }
        float inv = 1.0f;
        if (w) inv = 1.0f / sqrtf(warp_sum(ss) / (float)D + eps);
#pragma unroll
        for (int j = 0; j < PRO_MAX_PAIRS; ++j) {
            if (j < per) {
                const int i = lane + 32 * j;
                const float x1 = w ? (a[j] * inv) * w[ia[j]] : a[j];
                const float x2 = w ? (b[j] * inv) * w[ib[j]] : b[j];
                const float c = cs[i], s = sn[i];
                const float r1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
                const float r2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
                if (is_q) {
                    float* dst = q + (i64)t * ldq + (i64)h * D;
                    dst[ia[j]] = r1;
                    dst[ib[j]] = r2;
                } else {
                    KV* dst = kc + (slot * hk + (h - hq)) * D;
                    dst[ia[j]] = from_f32<KV>(r1);
                    dst[ib[j]] = from_f32<KV>(r2);
                }
            }
        }
    }
}
#define QK_ROPE_KV(KVN, KVT)                                                                                 \
    extern "C" __global__ void qk_rope_kv_##KVN(                                                             \
        float* q, i64 ldq, const float* k, i64 ldk, const float* v, i64 ldv, int hq, int hk, int D,          \
        const float* qw, const float* kw, float eps, const int* pos, const float* inv_freq, float mscale,    \
        int neox, KVT* kc, KVT* vc, const int* slots, int n) {                                               \
        qk_rope_kv<KVT>(q, ldq, k, ldk, v, ldv, hq, hk, D, qw, kw, eps, pos, inv_freq, mscale, neox, kc, vc, slots, \
                        n);                                                                                  \
    }
QK_ROPE_KV(f16, f16_t) QK_ROPE_KV(f32, float)
