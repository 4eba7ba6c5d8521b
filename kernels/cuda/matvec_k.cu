// y = x @ W.T for Q4_K / Q5_K weights at batch 1-2: the column-resident decode kernel ("kv2").
//
// matvec.cu stages rows through shared memory and re-reads x and the block scales for every 8
// weights: it is bound by load/store instructions, not bytes (the H200 measurements:
// kernels/README.md). Here each lane owns one fixed 64-column slice of the row -- sub-blocks (2c, 2c+1) of one
// 256-element super-block, whose 64 weights sit in 32 contiguous qs bytes -- and keeps that slice of
// x (and its two sub-block sums) in registers for every row it visits. Per row a lane issues three
// 16-byte loads (block header: d, dmin, 12 scale bytes; the 32 qs bytes; Q5_K adds the 32 qh bytes),
// turns each S-bit q into the float f = 1 + q / 2^S with one PRMT (q goes into the top mantissa bits
// of 1.0), does 64 FMAs, and recovers sum q*x = 2^S * (sum f*x - sum x) with the slice's sum of x
// computed once (measured error about 3x that of a plain float dot product, far under 1e-5). A warp covers 8
// super-blocks (2048 columns), a block ceil(cols / 2048) warps and `rows_per_block` rows, RU rows at
// a time with all of their loads issued before any use. Partial sums of RU rows leave a warp through
// one transposing butterfly (log2(RU) exchanges plus 5 - log2(RU) shuffles), then shared memory.
#include "act.cuh"
#include "quant.cuh"

#ifndef QTYPE
#error "QTYPE must be defined"
#endif
#if QTYPE != GT_Q4_K && QTYPE != GT_Q5_K && QTYPE != GT_Q6_KP
#error "matvec_k.cu handles Q4_K, Q5_K and (kq8 only) the repacked Q6_K"
#endif

// KV2_MAX_WARPS (warps a block: the widest rows; wider ones use matvec.cu), KV2_WARP_SUPERBLOCKS and
// KV2_MAX_RPB (rows a block) come from kernels/constants.py
static_assert(KV2_WARP_SUPERBLOCKS == 32 / 4, "a warp covers a super-block per four lanes (sb, c below)");
static_assert(BLOCK_ELEMS_Q4_K == 256 && BLOCK_ELEMS_Q5_K == 256 && BLOCK_ELEMS_Q6_KP == 256,
              "a lane's slice is a quarter of a 256-column super-block");

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

// A warp's partial sums of RU rows x B inputs: one transposing butterfly, then the lanes that hold a
// total each (those whose bits below the transposed ones are zero) put it in shared memory.
template <int B, int RU>
EMBER_DEV void slice_reduce(float (&part)[RU * B], float (*red)[KV2_MAX_RPB * B], int warp, int lane, int r0) {
    transpose_reduce<RU * B>(part, lane);
    constexpr int N = RU * B, LOW = 32 / N;
    if ((lane & (LOW - 1)) == 0) {
        const int idx = transposed_index<N>(lane);
        red[warp][(r0 + idx / B) * B + idx % B] = part[0];
    }
}

// The block's rows: the warps' column slices summed (+ res) into y.
template <int B>
EMBER_DEV void slice_store(float (*red)[KV2_MAX_RPB * B], int nw, int rows_per_block, int row_base, int rows,
                           int nb, const float* res, float* y) {
    __syncthreads();
    for (int t = threadIdx.x; t < rows_per_block * B; t += blockDim.x) {
        const int r = t / B, b = t % B, row = row_base + r;
        if (row >= rows || b >= nb) continue;
        float sum = 0.0f;
        for (int w = 0; w < nw; ++w) sum += red[w][t];
        const i64 at = (i64)b * rows + row;
        y[at] = sum + (res ? res[at] : 0.0f);
    }
}

// The block's gate rows [0, pair) and their up rows [pair, 2 pair): y = act(gate) * up.
template <int B>
EMBER_DEV void gated_store(float (*red)[KV2_MAX_RPB * B], int nw, int pair, int gate_base, int ffn, int nb, int act,
                           float* y) {
    __syncthreads();
    for (int t = threadIdx.x; t < pair * B; t += blockDim.x) {
        const int r = t / B, b = t % B, col = gate_base + r;
        if (col >= ffn || b >= nb) continue;
        float g = 0.0f, u = 0.0f;
        for (int w = 0; w < nw; ++w) {
            g += red[w][t];
            u += red[w][t + pair * B];
        }
        y[(i64)b * ffn + col] = dense_act(act, g, u);
    }
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
    const int sb = warp * KV2_WARP_SUPERBLOCKS + (lane >> 2), c = lane & 3;
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
        slice_reduce<B, RU>(part, red, warp, lane, r0);
    }
    slice_store<B>(red, nw, rows_per_block, row_base, rows, nb, res, y);
}

#define KV2(NAME, B, RU, PF)                                                                             \
    extern "C" __global__ void __launch_bounds__(KV2_MAX_WARPS * 32, 1) NAME(                              \
        const u8* __restrict__ W, i64 row_bytes, int rows, int cols, const float* __restrict__ x, int nb, \
        const float* res, float* y, int rows_per_block) {                                                 \
        grid_dependency_sync();                                                                           \
        kv2<B, RU, PF>(W, row_bytes, rows, cols, x, nb, res, y, rows_per_block);                          \
    }
#if QTYPE != GT_Q6_KP
KV2(kv2_b1_u4, 1, 4, false) KV2(kv2_b1_u8, 1, 8, false) KV2(kv2_b2_u2, 2, 2, false) KV2(kv2_b2_u4, 2, 4, false)
// software-pipelined: the next RU rows' loads are issued before this RU rows' arithmetic
KV2(kv2p_b1_u2, 1, 2, true) KV2(kv2p_b1_u4, 1, 4, true) KV2(kv2p_b2_u2, 2, 2, true)
#endif



// ---- kq8: the same column-resident layout with x quantized to int8 ---------------------------------
//
// kv2 spends about 4 instructions per weight (PRMT, FFMA and their operands) and is bound by issue,
// not bytes. Here each lane quantizes its 64-column slice of x once, per 32-column block as ggml's
// q8_1 does (d = max|x| / 127, q = roundf(x * (1 / d))), and then a row costs one dp4a per 4 weights
// plus the masks that build the 4 quants: sum q_w * q_x is exact in integers, and per group of 16
//   sum w * x' = d_x * (s * sum q_w q_x - o * sum q_x)
// is the dot of the dequantized weights with the dequantized x' (the twin: reference.quantize_q8).
// The slice is four groups of 16 columns: Q4_K/Q5_K the lane's 64 contiguous columns of sub-blocks
// 2c (groups 0, 1) and 2c+1 (groups 2, 3); Q6_K (repacked to 16-byte aligned 224-byte blocks,
// GT_Q6_KP) columns 128n + 32g + 16k + [0, 16) with n = c / 2, k = c % 2, each group half of an x
// block that the neighbouring lane holds the other half of. Either way the 16 bytes q0 hold groups 0
// (low nibbles) and 2 (high), q1 groups 1 and 3. Q6_K's offset of 32 is its "minimum": o = 32 s. The x
// slice takes 16 registers instead of kv2's 64. ACT != 0: x = act(g) * u, read from a fused gate|up
// buffer (u at uoff), so the activation needs no launch of its own.
EMBER_DEV int pack_i8x4(int a, int b, int c, int d) {
    return (a & 0xff) | ((b & 0xff) << 8) | ((c & 0xff) << 16) | ((u32)d << 24);
}

// GATED: W is the stacked [gate; up] matrix (rows = 2 ffn) and y = act(x W_gate^T) * (x W_up^T), [nb, ffn]:
// a block takes rows_per_block / 2 gate rows and the up rows that pair with them, so the MLP's
// activation is applied once per column here instead of in every block of the down projection.
// MOE: W holds experts' matrices expert_bytes apart and blockIdx.y is tile y of `tiles` (moe.cuh's
// (expert, first pair, pairs); matvec.cu qmvs_route_b1 writes them for one token): the block multiplies
// that expert's rows with x's one row into y's row `first pair`. The expert is known only once the
// kernel before is done, so the first rows' loads wait for it.
template <int B, int RU, bool PF, bool GATED, bool MOE = false>
EMBER_DEV void kq8(const u8* __restrict__ W, i64 row_bytes, int rows, int cols, const float* __restrict__ x,
                   i64 ldx, i64 uoff, int act, int nb, const float* res, float* y, int rows_per_block,
                   const int* __restrict__ tiles = nullptr, i64 expert_bytes = 0) {
    static_assert(!MOE || (B == 1 && GATED), "experts: one token's gate|up rows");
    typedef QT<QTYPE> Q;
    constexpr bool Q5 = QTYPE == GT_Q5_K, Q6 = QTYPE == GT_Q6_KP;
    constexpr int QS_OFF = Q5 ? 48 : 16;
    __shared__ float red[KV2_MAX_WARPS][KV2_MAX_RPB * B];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int nsb = cols / 256;
    const int sb = warp * KV2_WARP_SUPERBLOCKS + (lane >> 2), c = lane & 3;
    const bool active = sb < nsb;
    const int row_base = blockIdx.x * rows_per_block;
    const int half = rows / 2, pair = rows_per_block / 2, gate_base = blockIdx.x * pair;
    // the matrix row of the block's r-th row, or -1 past the end
    auto row_of = [&](int r) -> int {
        if (!GATED) return row_base + r < rows ? row_base + r : -1;
        const int g = gate_base + (r < pair ? r : r - pair);
        return g < half ? (r < pair ? g : half + g) : -1;
    };
    // first column of group g of this lane's slice: col0 + g * GSTEP
    const int col0 = Q6 ? 128 * (c >> 1) + 16 * (c & 1) : 64 * c;
    constexpr int GSTEP = Q6 ? 32 : 16;

    uint4 hdr[RU], q0[RU], q1[RU], h0[RU], h1[RU];
    auto load = [&](int r0) {
#pragma unroll
        for (int i = 0; i < RU; ++i) {
            const int row = r0 < rows_per_block ? row_of(r0 + i) : -1;
            if (active && row >= 0) {
                const u8* p = W + (i64)row * row_bytes + (i64)sb * Q::BYTES;
                if (Q6) {  // ql[128] qh[64] scales[16] d pad[14]
                    const int n = c >> 1, k = c & 1;
                    hdr[i] = __ldg(reinterpret_cast<const uint4*>(p + 192));
                    q0[i] = __ldg(reinterpret_cast<const uint4*>(p + 64 * n + 16 * k));
                    q1[i] = __ldg(reinterpret_cast<const uint4*>(p + 64 * n + 32 + 16 * k));
                    h0[i] = __ldg(reinterpret_cast<const uint4*>(p + 128 + 32 * n + 16 * k));
                    h1[i].x = __ldg(reinterpret_cast<const u16*>(p + 208));
                } else {
                    hdr[i] = __ldg(reinterpret_cast<const uint4*>(p));
                    q0[i] = __ldg(reinterpret_cast<const uint4*>(p + QS_OFF + 32 * c));
                    q1[i] = __ldg(reinterpret_cast<const uint4*>(p + QS_OFF + 32 * c + 16));
                    if (Q5) {
                        h0[i] = __ldg(reinterpret_cast<const uint4*>(p + 16));
                        h1[i] = __ldg(reinterpret_cast<const uint4*>(p + 32));
                    }
                }
            } else {  // scales 0: adds 0
                hdr[i] = q0[i] = q1[i] = h0[i] = h1[i] = make_uint4(0, 0, 0, 0);
            }
        }
    };
    if constexpr (MOE) {
        grid_dependency_sync();
        const int* tile = tiles + 3 * blockIdx.y;
        if (tile[2] == 0) return;  // the whole block
        W += tile[0] * expert_bytes;
        y += (i64)tile[1] * (rows / 2);
        load(0);
    } else {
        // the first rows' weights depend on no earlier kernel: their loads are issued before waiting
        // for it (programmatic dependent launch), and x is read after
        load(0);
        grid_dependency_sync();
    }

    // this lane's slice of x as int8: group g in xq[b][4g .. 4g + 4)
    int xq[B][16], xsum[B][4];
    float dx[B][4];
#pragma unroll
    for (int b = 0; b < B; ++b) {
#pragma unroll
        for (int gp = 0; gp < 4; gp += 2) {  // two groups at a time: 32 floats in flight
            float v[2][16], amax[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                amax[h] = 0.0f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
                    const i64 at = (i64)b * ldx + sb * 256 + col0 + (gp + h) * GSTEP + 4 * i;
                    if (active && b < nb) {
                        f = *reinterpret_cast<const float4*>(x + at);
                        if (act != ACT_NONE && !GATED) {
                            const float4 u = *reinterpret_cast<const float4*>(x + at + uoff);
                            f.x = dense_act(act, f.x, u.x);
                            f.y = dense_act(act, f.y, u.y);
                            f.z = dense_act(act, f.z, u.z);
                            f.w = dense_act(act, f.w, u.w);
                        }
                    }
                    v[h][4 * i] = f.x; v[h][4 * i + 1] = f.y; v[h][4 * i + 2] = f.z; v[h][4 * i + 3] = f.w;
                    amax[h] = fmaxf(amax[h], fmaxf(fmaxf(fabsf(f.x), fabsf(f.y)), fmaxf(fabsf(f.z), fabsf(f.w))));
                }
            }
            // the max over each 32-column block: the neighbouring lane's half (Q6_K), or the pair's
            if (Q6) {
                amax[0] = fmaxf(amax[0], __shfl_xor_sync(0xffffffffu, amax[0], 1));
                amax[1] = fmaxf(amax[1], __shfl_xor_sync(0xffffffffu, amax[1], 1));
            } else {
                amax[0] = amax[1] = fmaxf(amax[0], amax[1]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float d = amax[h] / 127.0f;
                const float id = d > 0.0f ? 1.0f / d : 0.0f;
                int sum = 0;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int a0 = (int)roundf(v[h][4 * i] * id), a1 = (int)roundf(v[h][4 * i + 1] * id);
                    const int a2 = (int)roundf(v[h][4 * i + 2] * id), a3 = (int)roundf(v[h][4 * i + 3] * id);
                    xq[b][4 * (gp + h) + i] = pack_i8x4(a0, a1, a2, a3);
                    sum += (a0 + a1) + (a2 + a3);
                }
                dx[b][gp + h] = d;
                xsum[b][gp + h] = sum;
            }
        }
    }
    const int j0 = 2 * c, j1 = 2 * c + 1;

    for (int r0 = 0; r0 < rows_per_block; r0 += RU) {
        if (!PF && r0 > 0) load(r0);
        uint4 chdr[RU], cq0[RU], cq1[RU], ch0[RU], ch1[RU];
#pragma unroll
        for (int i = 0; i < RU; ++i) { chdr[i] = hdr[i]; cq0[i] = q0[i]; cq1[i] = q1[i]; ch0[i] = h0[i]; ch1[i] = h1[i]; }
        if (PF) load(r0 + RU);
        float part[RU * B];
#pragma unroll
        for (int i = 0; i < RU; ++i) {
            float s[4], o[4];  // per group: w = s * q - o
            if (Q6) {
                const float d = h2f((u16)(ch1[i].x & 0xffffu));
                const int n = c >> 1, k = c & 1;
#pragma unroll
                for (int g = 0; g < 4; ++g) {
                    s[g] = d * (float)(int)(i8)hdr_byte(chdr[i], 8 * n + 2 * g + k);
                    o[g] = 32.0f * s[g];
                }
            } else {
                u32 sc0, m0, sc1, m1;
                hdr_scale_min(chdr[i], j0, sc0, m0);
                hdr_scale_min(chdr[i], j1, sc1, m1);
                const float d = h2f((u16)(chdr[i].x & 0xffffu)), dmin = h2f((u16)(chdr[i].x >> 16));
                s[0] = s[1] = d * (float)sc0;
                o[0] = o[1] = dmin * (float)m0;
                s[2] = s[3] = d * (float)sc1;
                o[2] = o[3] = dmin * (float)m1;
            }
            const u32 qa[4] = {cq0[i].x, cq0[i].y, cq0[i].z, cq0[i].w};
            const u32 qb[4] = {cq1[i].x, cq1[i].y, cq1[i].z, cq1[i].w};
            const u32 ha[4] = {ch0[i].x, ch0[i].y, ch0[i].z, ch0[i].w};
            const u32 hb[4] = {ch1[i].x, ch1[i].y, ch1[i].z, ch1[i].w};
            int dot[B][4];
#pragma unroll
            for (int b = 0; b < B; ++b) dot[b][0] = dot[b][1] = dot[b][2] = dot[b][3] = 0;
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                u32 g[4] = {qa[w] & 0x0F0F0F0Fu, qb[w] & 0x0F0F0F0Fu, (qa[w] >> 4) & 0x0F0F0F0Fu,
                            (qb[w] >> 4) & 0x0F0F0F0Fu};
                if (Q5) {
                    g[0] |= ((ha[w] >> j0) & 0x01010101u) << 4;
                    g[1] |= ((hb[w] >> j0) & 0x01010101u) << 4;
                    g[2] |= ((ha[w] >> j1) & 0x01010101u) << 4;
                    g[3] |= ((hb[w] >> j1) & 0x01010101u) << 4;
                }
                if (Q6) {
                    g[0] |= (ha[w] << 4) & 0x30303030u;
                    g[1] |= (ha[w] << 2) & 0x30303030u;
                    g[2] |= ha[w] & 0x30303030u;
                    g[3] |= (ha[w] >> 2) & 0x30303030u;
                }
#pragma unroll
                for (int b = 0; b < B; ++b)
#pragma unroll
                    for (int gi = 0; gi < 4; ++gi) dot[b][gi] = __dp4a((int)g[gi], xq[b][4 * gi + w], dot[b][gi]);
            }
#pragma unroll
            for (int b = 0; b < B; ++b) {
                float acc = 0.0f;
#pragma unroll
                for (int gi = 0; gi < 4; ++gi) acc += dx[b][gi] * (s[gi] * (float)dot[b][gi] - o[gi] * (float)xsum[b][gi]);
                part[i * B + b] = acc;
            }
        }
        slice_reduce<B, RU>(part, red, warp, lane, r0);
    }
    if (GATED)
        gated_store<B>(red, nw, pair, gate_base, half, nb, act, y);
    else
        slice_store<B>(red, nw, rows_per_block, row_base, rows, nb, res, y);
}

#define KQ8_(NAME, B, RU, PF, GATED)                                                                       \
    extern "C" __global__ void __launch_bounds__(KV2_MAX_WARPS * 32) NAME(                                 \
        const u8* __restrict__ W, i64 row_bytes, int rows, int cols, const float* __restrict__ x, i64 ldx, \
        i64 uoff, int act, int nb, const float* res, float* y, int rows_per_block) {                       \
        kq8<B, RU, PF, GATED>(W, row_bytes, rows, cols, x, ldx, uoff, act, nb, res, y, rows_per_block);     \
    }
#define KQ8(NAME, B, RU, PF) KQ8_(NAME, B, RU, PF, false)
KQ8(kq8_b1_u4, 1, 4, false) KQ8(kq8_b1_u8, 1, 8, false) KQ8(kq8_b2_u4, 2, 4, false)
KQ8(kq8p_b1_u2, 1, 2, true) KQ8(kq8p_b1_u4, 1, 4, true) KQ8(kq8p_b2_u2, 2, 2, true) KQ8(kq8p_b2_u4, 2, 4, true)
KQ8(kq8_b4_u2, 4, 2, false) KQ8(kq8p_b4_u2, 4, 2, true)
// the gate|up projection with the activation in its epilogue (x plain: act applies to the outputs)
KQ8_(kq8g_b1_u4, 1, 4, false, true) KQ8_(kq8g_b2_u4, 2, 4, false, true) KQ8_(kq8g_b4_u2, 4, 2, false, true)
// a mixture of experts' gate|up rows for one token, on qmvs_route_b1's tiles (ops.moe_mlp's int8 batch-1 path)
extern "C" __global__ void __launch_bounds__(KV2_MAX_WARPS * 32)
    kq8ge_b1_u4(const u8* __restrict__ W, i64 row_bytes, i64 expert_bytes, int rows, int cols,
                const int* __restrict__ tiles, const float* __restrict__ x, int act, float* y, int rows_per_block) {
    kq8<1, 4, false, true, true>(W, row_bytes, rows, cols, x, cols, 0, act, 1, nullptr, y, rows_per_block, tiles,
                                 expert_bytes);
}
