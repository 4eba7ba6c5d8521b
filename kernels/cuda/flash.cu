// Flash attention for prefill on the tensor cores, over the paged float16 KV cache.
//
// attention.cu's kernel gives every query row its own pass over the keys: fine for decode (one row per
// sequence), but a 4096-token prefill then reads each key thousands of times, and on an 8B model it
// took most of the prefill. Here a CTA takes a tile of up to 64 consecutive query rows of one sequence
// (the host lists the tiles: `tiles` holds (first row, row count) pairs) for one query head, and walks
// the keys those rows can see in tiles of KT, double-buffered in shared memory with cp.async:
// S = Q K^T and O += P V on mma.sync m16n8k16 (f16 in, f32 accumulate), with the online softmax in
// registers (exp2, the scale folded into Q), so each key is read once per (tile, head).
//
// Four warps, 16 query rows each (head_dim 256: eight, two per 16 rows). Fragment layouts follow the PTX ISA's m16n8k16: a thread (g =
// lane / 4, t = lane % 4) holds the scores of rows g and g + 8 at key columns 2t and 2t + 1 of each
// 8-key group, which is also the layout of P as the A operand of the second product, so P never
// leaves registers. Masking is the reference rule (reference.attention): key j is seen by the row at
// position p when j <= p and (window == 0 or p - j < window). sinks (or null): a logit per query head
// that joins each row's denominator at the end (gpt-oss; twin: reference.flash_rows). Shared-memory rows are padded by 8
// halves so ldmatrix's 8 row addresses fall in different banks.
#include "mma.cuh"

// FLASH_WARPS (warps a row group), FLASH_ROWS (query rows a tile), FLASH_TILE_KEYS(_D256) (keys a K/V
// tile) and FLASH_PAD (halves of padding a shared-memory row) come from kernels/constants.py
static_assert(FLASH_WARPS == 4 && FLASH_ROWS == 16 * FLASH_WARPS,
              "a row group of 4 warps (d0 = threadIdx.x >> 7), 16 query rows a warp");
static_assert(FLASH_TILE_KEYS % 16 == 0 && FLASH_TILE_KEYS_D256 % 16 == 0, "keys in 16-key mma steps");
static_assert(FLASH_PAD % 8 == 0, "16-byte aligned shared-memory rows (cp.async, ldmatrix)");

template <int D> struct FaShape {
    static constexpr int KT = D <= 128 ? FLASH_TILE_KEYS : FLASH_TILE_KEYS_D256;  // keys per tile
    static constexpr int LD = D + FLASH_PAD;  // halves per shared-memory row
    // D 256: two warps per 16 rows, each accumulating half of the output dimensions (128 floats of
    // O per thread would spill); both compute the rows' full scores
    static constexpr int DSPLIT = D == 256 ? 2 : 1;
    static constexpr int DO = D / DSPLIT;  // output dimensions per warp
};

template <int D>
EMBER_DEV void flash_prefill(const float* __restrict__ q, i64 ldq, const f16_t* __restrict__ kc,
                             const f16_t* __restrict__ vc, const int* __restrict__ tables, int max_blocks,
                             const int* __restrict__ row_seq, const int* __restrict__ row_pos,
                             const int* __restrict__ tiles, int Hq, int Hk, int BS, int window, float scale_log2,
                             const float* __restrict__ sinks, float* __restrict__ out, i64 ldo) {
    constexpr int KT = FaShape<D>::KT, LD = FaShape<D>::LD, DO = FaShape<D>::DO;
    extern __shared__ __align__(16) u16 smem[];
    u16* sq = smem;                  // [FLASH_ROWS][LD]
    u16* sk = sq + FLASH_ROWS * LD;  // [2][KT][LD]
    u16* sv = sk + 2 * KT * LD;      // [2][KT][LD]

    const int h = blockIdx.y, hk = h / (Hq / Hk);
    const int row0 = tiles[2 * blockIdx.x], nr = tiles[2 * blockIdx.x + 1];
    const int warp = (threadIdx.x >> 5) & (FLASH_WARPS - 1), lane = threadIdx.x & 31;  // warp: row group
    const int d0 = (threadIdx.x >> 7) * DO;  // this warp's output dimensions [d0, d0 + DO)
    const int p0 = row_pos[row0], plast = row_pos[row0 + nr - 1];
    const int* table = tables + (i64)row_seq[row0] * max_blocks;
    const u16* kbase = reinterpret_cast<const u16*>(kc);
    const u16* vbase = reinterpret_cast<const u16*>(vc);

    // Q rows of the tile, times scale * log2(e), as f16
    for (int i = threadIdx.x; i < FLASH_ROWS * D / 4; i += blockDim.x) {
        const int r = i / (D / 4), c = (i % (D / 4)) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < nr) v = *reinterpret_cast<const float4*>(q + (i64)(row0 + r) * ldq + (i64)h * D + c);
        u32* dst = reinterpret_cast<u32*>(sq + r * LD + c);
        dst[0] = pack_f16x2(v.x * scale_log2, v.y * scale_log2);
        dst[1] = pack_f16x2(v.z * scale_log2, v.w * scale_log2);
    }

    const int kstart = window > 0 ? max(0, p0 - window + 1) : 0, kend = plast + 1;
    const int t0 = kstart / KT, t1 = (kend + KT - 1) / KT;
    auto load_kv = [&](int t, int buf) {
        for (int i = threadIdx.x; i < KT * D / 8; i += blockDim.x) {
            const int kr = i / (D / 8), c = (i % (D / 8)) * 8;
            const int j = t * KT + kr, bi = j / BS;
            const bool ok = j < kend && bi < max_blocks;
            const i64 off = ((ok ? (i64)table[bi] * BS + j % BS : 0) * Hk + hk) * D + c;
            cp_async16(smem_addr(sk + (buf * KT + kr) * LD + c), kbase + off, ok);
            cp_async16(smem_addr(sv + (buf * KT + kr) * LD + c), vbase + off, ok);
        }
        cp_async_commit();
    };

    const int g = lane >> 2, tq = lane & 3;
    const int pos[2] = {p0 + warp * 16 + g, p0 + warp * 16 + g + 8};  // positions of this thread's rows
    float o[DO / 8][4];
#pragma unroll
    for (int i = 0; i < DO / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    load_kv(t0, 0);
    for (int t = t0; t < t1; ++t) {
        const int buf = (t - t0) & 1;
        if (t + 1 < t1) {
            load_kv(t + 1, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16* kt = sk + buf * KT * LD;
        const u16* vt = sv + buf * KT * LD;

        float s[KT / 8][4];
#pragma unroll
        for (int i = 0; i < KT / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 a[4];
            ldmatrix_x4(smem_addr(sq + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8), a[0], a[1], a[2],
                        a[3]);
#pragma unroll
            for (int nt = 0; nt < KT / 16; ++nt) {  // one ldmatrix.x4: B of two 8-key groups
                u32 b[4];
                const int key = nt * 16 + (lane & 7) + ((lane >> 4) << 3);
                ldmatrix_x4(smem_addr(kt + key * LD + kk * 16 + ((lane >> 3) & 1) * 8), b[0], b[1], b[2], b[3]);
                mma16816<false>(s[2 * nt], a, b);
                mma16816<false>(s[2 * nt + 1], a, b + 2);
            }
        }

        // mask, and the online softmax (rows: e < 2 -> pos[0], else pos[1])
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = t * KT + nt * 8 + 2 * tq + (e & 1), p = pos[e >> 1];
                const bool seen = j <= p && j < kend && (window <= 0 || p - j < window);
                s[nt][e] = seen ? s[nt][e] : NEG_INF;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
            }
        }
        float corr[2], base[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            base[i] = mx[i] == NEG_INF ? 0.0f : mx[i];  // a row that has seen nothing yet
            corr[i] = exp2f(m[i] - base[i]);
            m[i] = mx[i];
        }
#pragma unroll
        for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = exp2f(s[nt][e] - base[e >> 1]);
                rs[e >> 1] += s[nt][e];
            }
        }
        l[0] = l[0] * corr[0] + rs[0];
        l[1] = l[1] * corr[1] + rs[1];
#pragma unroll
        for (int i = 0; i < DO / 8; ++i) {
            o[i][0] *= corr[0]; o[i][1] *= corr[0];
            o[i][2] *= corr[1]; o[i][3] *= corr[1];
        }

        // O += P V: P from the score registers, V through transposing ldmatrix
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
            const u32 a[4] = {pack_f16x2(s[2 * kk][0], s[2 * kk][1]), pack_f16x2(s[2 * kk][2], s[2 * kk][3]),
                              pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dt = 0; dt < DO / 16; ++dt) {  // one ldmatrix.x4.trans: B of two 8-wide d groups
                u32 b[4];
                ldmatrix_x4_trans(smem_addr(vt + (kk * 16 + (lane & 15)) * LD + d0 + dt * 16 + (lane >> 4) * 8), b[0],
                                  b[1], b[2], b[3]);
                mma16816<false>(o[2 * dt], a, b);
                mma16816<false>(o[2 * dt + 1], a, b + 2);
            }
        }
        __syncthreads();  // this buffer is refilled two tiles on
    }

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    float inv[2] = {l[0] > 0.0f ? 1.0f / l[0] : 0.0f, l[1] > 0.0f ? 1.0f / l[1] : 0.0f};
    if (sinks) {  // the head's sink logit joins each row's denominator (gpt-oss), in the scores' log2 units
        const float sk = sinks[h] * 1.4426950408889634f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float M = fmaxf(m[i], sk), f = exp2f(m[i] - M);
            inv[i] = f / fmaf(l[i], f, exp2f(sk - M));
        }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + g + 8 * half;
        if (r >= nr) continue;
        float* dst = out + (i64)(row0 + r) * ldo + (i64)h * D + d0 + 2 * tq;
#pragma unroll
        for (int i = 0; i < DO / 8; ++i)
            *reinterpret_cast<float2*>(dst + 8 * i) = make_float2(o[i][2 * half] * inv[half], o[i][2 * half + 1] * inv[half]);
    }
}

#define FLASH(D)                                                                                              \
    extern "C" __global__ void __launch_bounds__(FLASH_WARPS * 32 * FaShape<D>::DSPLIT) flash_prefill_d##D(   \
        const float* q, i64 ldq, const f16_t* kc, const f16_t* vc, const int* tables, int max_blocks,         \
        const int* row_seq, const int* row_pos, const int* tiles, int Hq, int Hk, int BS, int window,         \
        float scale_log2, const float* sinks, float* out, i64 ldo) {                                          \
        grid_dependency_sync();                                                                               \
        flash_prefill<D>(q, ldq, kc, vc, tables, max_blocks, row_seq, row_pos, tiles, Hq, Hk, BS, window,     \
                         scale_log2, sinks, out, ldo);                                                        \
    }
FLASH(64) FLASH(128) FLASH(256)
