#pragma once
#include "attn_common.cuh"
#include "cluster.cuh"
#include "mma.cuh"

// attn_warp_d<D>_g<G>_<kv>: attn_decode's work for short splits with no shared-memory phases in the
// softmax: a warp owns one query head (G >= ATTW_WARPS: G / ATTW_WARPS heads) and a strided share of
// the split's keys; lane l holds elements [l E, l E + E) of every vector (E = D / 32), so a score is a
// warp sum, the softmax runs online in registers and V is summed where it is loaded. The prologue is
// done per warp (its heads and the key head; the neox RoPE partner of a lane's element is in lane
// l ^ 16). With G < ATTW_WARPS, ATTW_WARPS / G warps share a head and merge through shared memory at
// the end. Before the wait for the q|k|v matvec (every key but the new one was written by an earlier
// step) the CTA copies its split's K and V rows into shared memory with cp.async (dynamic shared
// memory: 2 * split * D elements as stored), so after the wait no key is read from global memory; a
// split of up to ops.attention_split_warp's 128 KiB of rows (128 keys at D 256, f16) is the whole
// context of a short decode, which then needs no attn_combine. Keys are taken KC at a time.
// ATTW_SPLIT_MAX (keys a CTA at most), ATTW_WARPS and ATTW_CLUSTER_MAX (splits merged inside one
// cluster, at most) come from kernels/constants.py
static_assert(ATTW_CLUSTER_MAX <= 8, "a portable cluster size");

// E elements of a K or V row as stored (f16 or float), held raw in 32-bit words until used
template <int E, typename KV> struct KVRaw { u32 w[E * (int)sizeof(KV) / 4]; };

template <int E, typename KV>
EMBER_DEV void load_raw(const KV* p, KVRaw<E, KV>& r) {
    constexpr int NB = E * (int)sizeof(KV);
    if constexpr (NB % 16 == 0) {
#pragma unroll
        for (int i = 0; i < NB / 16; ++i) {
            const uint4 v = reinterpret_cast<const uint4*>(p)[i];
            r.w[4 * i] = v.x; r.w[4 * i + 1] = v.y; r.w[4 * i + 2] = v.z; r.w[4 * i + 3] = v.w;
        }
    } else if constexpr (NB == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        r.w[0] = v.x; r.w[1] = v.y;
    } else {
        r.w[0] = *reinterpret_cast<const u32*>(p);
    }
}

template <int E>
EMBER_DEV void raw_vals(const KVRaw<E, f16_t>& r, float* out) {
#pragma unroll
    for (int k = 0; k < E / 2; ++k) {
        out[2 * k] = h2f((u16)(r.w[k] & 0xffffu));
        out[2 * k + 1] = h2f((u16)(r.w[k] >> 16));
    }
}

template <int E>
EMBER_DEV void raw_vals(const KVRaw<E, float>& r, float* out) {
#pragma unroll
    for (int k = 0; k < E; ++k) out[k] = __uint_as_float(r.w[k]);
}

template <int D, int G, typename KV>
EMBER_DEV void attn_warp(const float* __restrict__ q, i64 ldq, const DecodePrologue& pro, KV* kc, KV* vc,
                         const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ row_seq,
                         const int* __restrict__ row_pos, int Hq, int Hk, int BS, int window, float scale,
                         const float* __restrict__ sinks, int split, float* __restrict__ out, float* __restrict__ part_acc,
                         float* __restrict__ part_ml) {
    constexpr int E = D / 32, NW = ATTW_WARPS;
    constexpr int WPH = G >= NW ? 1 : NW / G;  // warps per head
    constexpr int HPW = G >= NW ? G / NW : 1;  // heads per warp
    constexpr int KC = 32 / E;                 // keys per chunk: 32 elements of K and of V per lane
    typedef KVRaw<E, KV> Raw;
    __shared__ float cs[D / 2], sn[D / 2];
    __shared__ int slot_s[ATTW_SPLIT_MAX];
    __shared__ float mrg[NW][2 + D];  // the warps' (max, sum p, sum p*v) to merge
    const int kh = blockIdx.x, row = blockIdx.y, z = blockIdx.z, S = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int pos = row_pos[row];
    const int* bt = block_tables + (i64)row_seq[row] * max_blocks;
    const int L = pos + 1;
    const int lo = window > 0 ? max(0, L - window) : 0;
    const int t0 = lo + z * split;
    const int nt = min(L, t0 + split) - t0;
    const i64 slot_stride = (i64)Hk * D;
    const int h0 = WPH > 1 ? warp % G : warp;  // this warp's first head (of HPW, NW apart)
    const int kset = WPH > 1 ? warp / G : 0;   // and its share of the keys: t = kset (mod WPH)
    // before the wait: angles, slots, the older keys' K and V rows into shared memory, the norm weights
    extern __shared__ __align__(16) u8 kv_rows[];  // [split][D] K, then [split][D] V
    KV* Ks = reinterpret_cast<KV*>(kv_rows);
    KV* Vs = Ks + (i64)split * D;
    rope_table(cs, sn, pos, pro.inv_freq, D / 2, pro.mscale);
    for (int t = tid; t < nt; t += NW * 32) {
        const int p = t0 + t;
        slot_s[t] = bt[p / BS] * BS + p % BS;
    }
    float qwr[E], kwr[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        qwr[e] = pro.qw ? pro.qw[lane * E + e] : 1.0f;
        kwr[e] = pro.kw ? pro.kw[lane * E + e] : 1.0f;
    }
    __syncthreads();
    constexpr int PIECES = D * (int)sizeof(KV) / 16;  // 16-byte pieces of a row
    for (int i = tid; i < nt * PIECES; i += NW * 32) {
        const int t = i / PIECES, c = i % PIECES;
        if (t0 + t == pos) continue;  // the new key: not written yet; warp 0 puts it here after the wait
        const i64 at = (i64)slot_s[t] * slot_stride + (i64)kh * D;
        cp_async16(smem_addr(reinterpret_cast<const u8*>(Ks + (i64)t * D) + 16 * c),
                   reinterpret_cast<const u8*>(kc + at) + 16 * c, true);
        cp_async16(smem_addr(reinterpret_cast<const u8*>(Vs + (i64)t * D) + 16 * c),
                   reinterpret_cast<const u8*>(vc + at) + 16 * c, true);
    }
    cp_async_commit();
    Raw kr[KC], vr[KC];
    auto load_chunk = [&](int c0) {
#pragma unroll
        for (int u = 0; u < KC; ++u) {
            const int t = c0 + u * WPH;
            if (t < nt) {
                load_raw<E>(Ks + (i64)t * D + lane * E, kr[u]);
                load_raw<E>(Vs + (i64)t * D + lane * E, vr[u]);
            } else {  // none: zeros, never NaN
#pragma unroll
                for (int i = 0; i < (int)(sizeof(Raw) / 4); ++i) kr[u].w[i] = vr[u].w[i] = 0u;
            }
        }
    };
    grid_dependency_sync();
    TRACE_MARK(0);

    // RMSNorm (optional) and RoPE of one head vector held E elements per lane
    auto norm_rope = [&](float (&x)[E], const float (&w)[E], bool normed) {
        if (normed) {
            float ss = 0.0f;
#pragma unroll
            for (int e = 0; e < E; ++e) ss = fmaf(x[e], x[e], ss);
            const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)D + pro.eps);
#pragma unroll
            for (int e = 0; e < E; ++e) x[e] = (x[e] * inv) * w[e];
        }
        if (pro.neox) {  // pairs (i, i + D/2): lanes l and l ^ 16
            const bool lo_half = lane < 16;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const float other = __shfl_xor_sync(0xffffffffu, x[e], 16);
                const int i = (lane & 15) * E + e;
                const float x1 = lo_half ? x[e] : other, x2 = lo_half ? other : x[e];
                const float c = cs[i], sv = sn[i];
                x[e] = lo_half ? __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sv))
                               : __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sv));
            }
        } else {  // pairs (2i, 2i + 1): within the lane
#pragma unroll
            for (int e = 0; e < E; e += 2) {
                const int i = (lane * E + e) / 2;
                const float x1 = x[e], x2 = x[e + 1], c = cs[i], sv = sn[i];
                x[e] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sv));
                x[e + 1] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sv));
            }
        }
    };
    float qh[HPW][E];
#pragma unroll
    for (int j = 0; j < HPW; ++j)
        load_vals<E>(q + (i64)row * ldq + (i64)(kh * G + h0 + j * NW) * D + lane * E, qh[j]);
    // the new key and value: warp 0 of the split that holds position pos norms and rotates the key
    // and stores both to their cache slot and, as the cache holds them, into the split's shared rows,
    // so the loop below reads every key alike (the other warps neither wait for it nor repeat it)
    if (warp == 0 && pos >= t0 && pos < t0 + nt) {
        float kn[E], vn[E];
        load_vals<E>(pro.k + (i64)row * pro.ldk + (i64)kh * D + lane * E, kn);
        load_vals<E>(pro.v + (i64)row * pro.ldv + (i64)kh * D + lane * E, vn);
        norm_rope(kn, kwr, pro.kw != nullptr);
        const i64 at_new = ((i64)pro.slots[row] * Hk + kh) * D + lane * E;
        KV* ks_new = Ks + (i64)(pos - t0) * D + lane * E;
        KV* vs_new = Vs + (i64)(pos - t0) * D + lane * E;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const KV kq = from_f32<KV>(kn[e]), vq = from_f32<KV>(vn[e]);
            kc[at_new + e] = kq;
            vc[at_new + e] = vq;
            ks_new[e] = kq;
            vs_new[e] = vq;
        }
    }
#pragma unroll
    for (int j = 0; j < HPW; ++j) {
        norm_rope(qh[j], qwr, pro.qw != nullptr);
#pragma unroll
        for (int e = 0; e < E; ++e) qh[j][e] *= scale;
    }
    TRACE_MARK(1);
    cp_async_wait<0>();  // this thread's copies have landed, and after the barrier everyone's
    __syncthreads();
    TRACE_MARK(2);

    float m[HPW], l[HPW], acc[HPW][E];
#pragma unroll
    for (int j = 0; j < HPW; ++j) {
        m[j] = -__int_as_float(0x7f800000);
        l[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[j][e] = 0.0f;
    }
    for (int c0 = kset; c0 < nt; c0 += KC * WPH) {  // warp-uniform
        load_chunk(c0);
#pragma unroll
        for (int j = 0; j < HPW; ++j) {
            float sc[KC], cmax = -__int_as_float(0x7f800000);
#pragma unroll
            for (int u = 0; u < KC; ++u) {
                float kk[E];
                raw_vals<E>(kr[u], kk);
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < E; ++e) d = fmaf(qh[j][e], kk[e], d);
                sc[u] = warp_sum(d);
                if (c0 + u * WPH >= nt) sc[u] = -__int_as_float(0x7f800000);
                cmax = fmaxf(cmax, sc[u]);
            }
            const float mn = fmaxf(m[j], cmax);  // finite: key c0 is in the split
            const float r = expf(m[j] - mn);     // 0 while m was -inf
            l[j] *= r;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[j][e] *= r;
#pragma unroll
            for (int u = 0; u < KC; ++u) {
                const float pu = expf(sc[u] - mn);
                float vv[E];
                raw_vals<E>(vr[u], vv);
                l[j] += pu;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[j][e] = fmaf(pu, vv[e], acc[j][e]);
            }
            m[j] = mn;
        }
    }
    TRACE_MARK(3);
    auto share = [&]() {  // this warp's (max, sum p, sum p*v) of its first head into mrg[warp]
#pragma unroll
        for (int e = 0; e < E; ++e) mrg[warp][2 + lane * E + e] = acc[0][e];
        if (lane == 0) { mrg[warp][0] = l[0] > 0.0f ? m[0] : -__int_as_float(0x7f800000); mrg[warp][1] = l[0]; }
    };
    if constexpr (WPH > 1) {  // merge the warps that share a head into the first of them
        share();
        __syncthreads();
    }
    TRACE_MARK(4);
    // the splits of this (kv head, row) launched as one cluster (ops.attention): merged right here
    const bool clustered = HPW == 1 && S > 1 && cluster_ctas() == (u32)S;
    if (kset != 0 && !clustered) return;
    if (WPH > 1 && kset == 0) {
        float M = l[0] > 0.0f ? m[0] : -__int_as_float(0x7f800000);
#pragma unroll
        for (int k = 1; k < WPH; ++k) M = fmaxf(M, mrg[warp + k * G][0]);
        const float f0 = l[0] > 0.0f ? expf(m[0] - M) : 0.0f;
        l[0] *= f0;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[0][e] *= f0;
#pragma unroll
        for (int k = 1; k < WPH; ++k) {
            const float lk = mrg[warp + k * G][1];
            const float f = lk > 0.0f ? expf(mrg[warp + k * G][0] - M) : 0.0f;
            l[0] = fmaf(f, lk, l[0]);
#pragma unroll
            for (int e = 0; e < E; ++e) acc[0][e] = fmaf(f, mrg[warp + k * G][2 + lane * E + e], acc[0][e]);
        }
        m[0] = M;
    }
    if (clustered) {  // (sum p*v, max, sum p) of head h0 in mrg[h0], then rank z merges its slice of G*D
        if (kset == 0) share();  // the head's merged part: rows h0 < G, which no other warp reads now
        cluster_sync();
        TRACE_MARK(5);
        const int per = (G * D + S - 1) / S;
        for (int i = z * per + tid; i < min(G * D, (z + 1) * per); i += NW * 32) {
            const int hh = i / D, d = i % D;
            // every rank's (max, sum p, sum p*v) loaded at once: one round trip, not one per use
            float ms[ATTW_CLUSTER_MAX], ls[ATTW_CLUSTER_MAX], ns[ATTW_CLUSTER_MAX], M = -__int_as_float(0x7f800000);
#pragma unroll
            for (int s = 0; s < ATTW_CLUSTER_MAX; ++s) {
                if (s >= S) break;
                ms[s] = cluster_load(&mrg[hh][0], s);
                ls[s] = cluster_load(&mrg[hh][1], s);
                ns[s] = cluster_load(&mrg[hh][2 + d], s);  // written by every rank (0 where it saw no key)
            }
#pragma unroll
            for (int s = 0; s < ATTW_CLUSTER_MAX; ++s) {
                if (s >= S) break;
                if (ls[s] > 0.0f) M = fmaxf(M, ms[s]);
            }
            // a sink (gpt-oss) joins the denominator: the max takes it, and den starts at e^(sk - M)
            const float sk = sinks ? sinks[kh * G + hh] : 0.0f;
            if (sinks) M = fmaxf(M, sk);
            float num = 0.0f, den = sinks ? expf(sk - M) : 0.0f;
#pragma unroll
            for (int s = 0; s < ATTW_CLUSTER_MAX; ++s) {
                if (s >= S) break;
                if (ls[s] > 0.0f) {
                    const float f = expf(ms[s] - M);
                    den = fmaf(f, ls[s], den);
                    num = fmaf(f, ns[s], num);
                }
            }
            out[((i64)row * Hq + kh * G + hh) * D + d] = num / den;
        }
        TRACE_MARK(6);
        cluster_sync();  // no CTA leaves while another still reads its shared memory
        TRACE_MARK(7);
        return;
    }
#pragma unroll
    for (int j = 0; j < HPW; ++j) {
        const i64 h = (i64)row * Hq + kh * G + h0 + j * NW;
        if (S == 1) {  // with a sink, it joins the denominator here (split: in the merges)
            const float inv = sink_inv(sinks, kh * G + h0 + j * NW, m[j], l[j]);
#pragma unroll
            for (int e = 0; e < E; ++e) out[h * D + lane * E + e] = acc[j][e] * inv;
        } else {
#pragma unroll
            for (int e = 0; e < E; ++e) part_acc[(h * S + z) * D + lane * E + e] = acc[j][e];
            if (lane == 0) {
                part_ml[(h * S + z) * 2] = l[j] > 0.0f ? m[j] : -__int_as_float(0x7f800000);
                part_ml[(h * S + z) * 2 + 1] = l[j];
            }
        }
    }
}
