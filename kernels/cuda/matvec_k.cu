// y = x @ W.T for Q4_K / Q5_K weights at batch 1-2: the column-resident decode kernel ("kv2").
//
// matvec.cu stages rows through shared memory and re-reads x and the block scales for every 8
// weights; measured on an H200 it is bound by load/store instructions, not bytes (about 1.1 TB/s
// for Q4_K). Here each lane owns one fixed 64-column slice of the row -- sub-blocks (2c, 2c+1) of one
// 256-element super-block, whose 64 weights sit in 32 contiguous qs bytes -- and keeps that slice of
// x (and its two sub-block sums) in registers for every row it visits. Per row a lane issues three
// 16-byte loads (block header: d, dmin, 12 scale bytes; the 32 qs bytes; Q5_K adds the 32 qh bytes),
// turns each S-bit q into the float f = 1 + q / 2^S with one PRMT (q goes into the top mantissa bits
// of 1.0), does 64 FMAs, and recovers sum q*x = 2^S * (sum f*x - sum x) with the slice's sum of x
// computed once (measured error about 3x that of a plain float dot product, far under 1e-5). A warp covers 8
// super-blocks (2048 columns), a block ceil(cols / 2048) warps and `rows_per_block` rows, RU rows at
// a time with all of their loads issued before any use. Partial sums of RU rows leave a warp through
// one transposing butterfly (log2(RU) exchanges plus 5 - log2(RU) shuffles), then shared memory.
#include "quant.cuh"

#ifndef QTYPE
#error "QTYPE must be defined"
#endif
#if QTYPE != GT_Q4_K && QTYPE != GT_Q5_K
#error "matvec_k.cu handles Q4_K and Q5_K"
#endif

#define KV2_MAX_WARPS 8  // cols <= 16384; wider rows use matvec.cu
#define KV2_MAX_RPB 64

EMBER_DEV u32 hdr_byte(const uint4& h, int k) {
    const u32 w = (k & 8) ? ((k & 4) ? h.w : h.z) : ((k & 4) ? h.y : h.x);
    return (w >> ((k & 3) * 8)) & 0xFFu;
}

// ggml's get_scale_min_k4 on the header words (scale bytes start at byte 4)
EMBER_DEV void hdr_scale_min(const uint4& h, int j, u32& sc, u32& m) {
    if (j < 4) {
        sc = hdr_byte(h, 4 + j) & 63u;
        m = hdr_byte(h, 8 + j) & 63u;
    } else {
        sc = (hdr_byte(h, 8 + j) & 0xFu) | ((hdr_byte(h, j) >> 6) << 4);
        m = (hdr_byte(h, 8 + j) >> 4) | ((hdr_byte(h, 4 + j) >> 6) << 4);
    }
}

// Sum v[0..N) over the 32 lanes of a warp, transposed: afterwards v[0] in lane l holds the total of
// value index idx(l) = bits 4, 3, ... of l (most significant first), for every lane.
template <int N>
EMBER_DEV void transpose_reduce(float (&v)[N], int lane) {
    int n = N;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        if (n > 1) {
            const bool up = (lane & o) != 0;
            const int half = n / 2;
#pragma unroll
            for (int i = 0; i < N / 2; ++i) {
                if (i < half) {
                    const float keep = up ? v[i + half] : v[i];
                    const float send = up ? v[i] : v[i + half];
                    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
                }
            }
            n = half;
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
        }
    }
}

template <int N>
EMBER_DEV int transposed_index(int lane) {
    int idx = 0, bit = N / 2, o = 16;
#pragma unroll
    for (int s = 0; s < 5; ++s) {
        if (bit > 0) {
            if (lane & o) idx += bit;
            bit >>= 1;
        }
        o >>= 1;
    }
    return idx;
}

template <int B, int RU, bool PF>
EMBER_DEV void kv2(const u8* __restrict__ W, i64 row_bytes, int rows, int cols, const float* __restrict__ x,
                   int nb, const float* res, float* y, int rows_per_block) {
    typedef QT<QTYPE> Q;
    constexpr bool Q5 = QTYPE == GT_Q5_K;
    constexpr int QS_OFF = Q5 ? 48 : 16;
    constexpr float SCALE = Q5 ? 32.0f : 16.0f;  // 2^S for S-bit q
    __shared__ float red[KV2_MAX_WARPS][KV2_MAX_RPB * B];
    const u32 one = magic_reg() - 0x0C000000u;  // 0x3F000000 in a register (bytes 0, 0, 0, 0x3F)

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int nsb = cols / 256;
    const int sb = warp * 8 + (lane >> 2), c = lane & 3;
    const bool active = sb < nsb;
    const int row_base = blockIdx.x * rows_per_block;

    // this lane's 64 columns of x: sub-block 2c (xr[b][0..32)) and 2c+1 (xr[b][32..64))
    float xr[B][64], xs[B][2];
#pragma unroll
    for (int b = 0; b < B; ++b) {
        xs[b][0] = xs[b][1] = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (active && b < nb) v = __ldg(reinterpret_cast<const float4*>(x + (i64)b * cols + sb * 256 + 64 * c) + i);
            xr[b][4 * i] = v.x; xr[b][4 * i + 1] = v.y; xr[b][4 * i + 2] = v.z; xr[b][4 * i + 3] = v.w;
            xs[b][i >> 3] += (v.x + v.y) + (v.z + v.w);
        }
        // keep the sums in registers: without this the compiler recomputes them for every row
        asm volatile("" : "+f"(xs[b][0]), "+f"(xs[b][1]));
    }
    const int j0 = 2 * c, j1 = 2 * c + 1;

    uint4 hdr[RU], q0[RU], q1[RU], h0[RU], h1[RU];
    auto load = [&](int r0) {
#pragma unroll
        for (int i = 0; i < RU; ++i) {
            const int row = row_base + r0 + i;
            if (active && row < rows && r0 < rows_per_block) {
                const u8* p = W + (i64)row * row_bytes + (i64)sb * Q::BYTES;
                hdr[i] = __ldg(reinterpret_cast<const uint4*>(p));
                q0[i] = __ldg(reinterpret_cast<const uint4*>(p + QS_OFF + 32 * c));
                q1[i] = __ldg(reinterpret_cast<const uint4*>(p + QS_OFF + 32 * c + 16));
                if (Q5) {
                    h0[i] = __ldg(reinterpret_cast<const uint4*>(p + 16));
                    h1[i] = __ldg(reinterpret_cast<const uint4*>(p + 32));
                }
            } else {
                hdr[i] = q0[i] = q1[i] = h0[i] = h1[i] = make_uint4(0, 0, 0, 0);  // d = dmin = 0: adds 0
            }
        }
    };
    if (PF) load(0);
    for (int r0 = 0; r0 < rows_per_block; r0 += RU) {
        if (!PF) load(r0);
        // PF: this group's words move to registers of their own and the next group's loads are in
        // flight while this one is computed
        uint4 chdr[RU], cq0[RU], cq1[RU], ch0[RU], ch1[RU];
#pragma unroll
        for (int i = 0; i < RU; ++i) { chdr[i] = hdr[i]; cq0[i] = q0[i]; cq1[i] = q1[i]; ch0[i] = h0[i]; ch1[i] = h1[i]; }
        if (PF) load(r0 + RU);
        float part[RU * B];
#pragma unroll
        for (int i = 0; i < RU; ++i) {
            u32 sc0, m0, sc1, m1;
            hdr_scale_min(chdr[i], j0, sc0, m0);
            hdr_scale_min(chdr[i], j1, sc1, m1);
            const float d = h2f((u16)(chdr[i].x & 0xffffu)), dmin = h2f((u16)(chdr[i].x >> 16));
            const float s0 = d * (float)sc0, o0 = dmin * (float)m0, s1 = d * (float)sc1, o1 = dmin * (float)m1;
            const u32 qw[8] = {cq0[i].x, cq0[i].y, cq0[i].z, cq0[i].w, cq1[i].x, cq1[i].y, cq1[i].z, cq1[i].w};
            const u32 hw[8] = {ch0[i].x, ch0[i].y, ch0[i].z, ch0[i].w, ch1[i].x, ch1[i].y, ch1[i].z, ch1[i].w};
            float dot0[B], dot1[B];
#pragma unroll
            for (int b = 0; b < B; ++b) dot0[b] = dot1[b] = 0.0f;
#pragma unroll
            for (int w = 0; w < 8; ++w) {
                // per byte: 0x80 | q << (7 - S): with 0x3F above it, the float 1 + q / 2^S (exact)
                u32 lo, hi;
                if (Q5) {
                    lo = ((qw[w] << 2) & 0x3C3C3C3Cu) | (((hw[w] >> j0) & 0x01010101u) << 6) | 0x80808080u;
                    hi = ((qw[w] >> 2) & 0x3C3C3C3Cu) | (((hw[w] >> j1) & 0x01010101u) << 6) | 0x80808080u;
                } else {
                    lo = ((qw[w] << 3) & 0x78787878u) | 0x80808080u;
                    hi = ((qw[w] >> 1) & 0x78787878u) | 0x80808080u;
                }
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float fl = __int_as_float((int)__byte_perm(lo, one, 0x7044u | ((u32)k << 8)));
                    const float fh = __int_as_float((int)__byte_perm(hi, one, 0x7044u | ((u32)k << 8)));
#pragma unroll
                    for (int b = 0; b < B; ++b) {
                        dot0[b] = fmaf(fl, xr[b][4 * w + k], dot0[b]);
                        dot1[b] = fmaf(fh, xr[b][32 + 4 * w + k], dot1[b]);
                    }
                }
            }
            // sum q*x = 2^S * (sum f*x - sum x)
#pragma unroll
            for (int b = 0; b < B; ++b)
                part[i * B + b] = (s0 * (SCALE * (dot0[b] - xs[b][0])) - o0 * xs[b][0]) +
                                  (s1 * (SCALE * (dot1[b] - xs[b][1])) - o1 * xs[b][1]);
        }
        transpose_reduce<RU * B>(part, lane);
        constexpr int N = RU * B;
        // lanes whose bits below the transposed ones are zero hold one total each
        constexpr int LOW = 32 / N;
        if ((lane & (LOW - 1)) == 0) {
            const int idx = transposed_index<N>(lane);
            red[warp][(r0 + idx / B) * B + idx % B] = part[0];
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < rows_per_block * B; t += blockDim.x) {
        const int r = t / B, b = t % B, row = row_base + r;
        if (row >= rows || b >= nb) continue;
        float s = 0.0f;
        for (int w = 0; w < nw; ++w) s += red[w][t];
        const i64 at = (i64)b * rows + row;
        y[at] = s + (res ? res[at] : 0.0f);
    }
}

#define KV2(NAME, B, RU, PF)                                                                             \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                             \
        const u8* __restrict__ W, i64 row_bytes, int rows, int cols, const float* __restrict__ x, int nb, \
        const float* res, float* y, int rows_per_block) {                                                 \
        kv2<B, RU, PF>(W, row_bytes, rows, cols, x, nb, res, y, rows_per_block);                          \
    }
KV2(kv2_b1_u4, 1, 4, false) KV2(kv2_b1_u8, 1, 8, false) KV2(kv2_b2_u2, 2, 2, false) KV2(kv2_b2_u4, 2, 4, false)
// software-pipelined: the next RU rows' loads are issued before this RU rows' arithmetic
KV2(kv2p_b1_u2, 1, 2, true) KV2(kv2p_b1_u4, 1, 4, true) KV2(kv2p_b2_u2, 2, 2, true)

