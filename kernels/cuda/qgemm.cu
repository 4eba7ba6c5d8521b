// Grouped matmul on the tensor cores straight from the GGUF blocks (one module per type, QTYPE set by
// the build): the mixture of experts' projections for prefill and batched decode, where many tokens
// share an expert and the staged matvec would decode every weight once per eight of them.
//
// For every tile of moe_group (expert e, first pair p0, pairs nb <= TN) and every QG_ROWS rows of the
// expert's matrix, a CTA computes Y[p0 + p, row] = x[p] . W_e[row] for its nb pairs: the weights are
// decoded from their blocks (quant.cuh units of 8) to f16 in shared memory one 32-deep K slice at a
// time, the activations converted from float32 beside them, and the product taken with mma.sync
// m16n8k16 (float32 accumulation). Each weight is decoded once per tile, not once per pair: the
// arithmetic moves to the tensor cores and the decoding is shared by up to TN pairs.
//
// x rows come in grouped order; with `order` they are read in place from the tokens' rows
// (x[order[p] / k]), which spares the gather. The gated variant takes the stacked [gate; up] matrix of
// an expert (rows = 2 ffn): a CTA's 128 rows are 64 gate rows and the 64 up rows beside them, so the
// epilogue writes act(gate) * up, [pairs, ffn] (act: an ACT_* code, act.cuh gated_act). bias (or null):
// each expert's `rows` biases one after another, added to its rows' products before the activation.
//
// The 16-bit type is the model's (the backend's half kind): f16, or bf16 where activations may
// exceed f16's range.
#include "act.cuh"
#include "mma.cuh"
#include "quant.cuh"

#ifndef QTYPE
#error "QTYPE must be defined"
#endif

static_assert(QG_ROWS == 128 && QG_THREADS == 256, "8 warps over 128 weight rows");
#define QG_K 32  // the K slice a stage holds: one sub-block of the K-quants, four units of 8
#define QG_LD (QG_K + 8)  // halves a shared-memory row: 8 of padding, so ldmatrix rows hit distinct banks

template <int TN>
struct QgShape {
    static constexpr int WM = TN >= 32 ? 32 : 16;  // weight rows a warp
    static constexpr int WARPS_M = QG_ROWS / WM;
    static constexpr int WARPS_N = 8 / WARPS_M;
    static constexpr int WN = TN / WARPS_N;  // pairs a warp
    static constexpr int MI = WM / 16, NJ = WN / 8;
    static_assert(WARPS_M * WARPS_N == 8 && NJ % 2 == 0, "8 warps; B fragments two n8 tiles at a time");
};

template <int TN>
struct QgSmem {
    union {
        struct {
            u16 w[2][QG_ROWS][QG_LD];
            u16 x[2][TN][QG_LD];
        } in;
        float out[QG_ROWS][TN + 1];  // the epilogue's tile, +1: column reads without bank conflicts
    };
};

// the 512 units of 8 of a 128 x 32 weight slice, two a thread, decoded to f16
template <bool BF>
EMBER_DEV u32 pack2(float lo, float hi) {
    return BF ? (u32)f2bf(lo) | ((u32)f2bf(hi) << 16) : pack_f16x2(lo, hi);
}

// Weight slices (128 rows x 32 columns, 4096 values) are decoded by the 256 threads in registers and
// stored after the slice before has gone through the tensor cores, so the loads' latency hides behind
// it. QgW<T> says how: ROWS rows a thread (slot i: row row(i)) and 16 values a row (two uint4 of 16-bit
// pairs) stored at column col(). The generic way takes two units of 8 (quant.cuh) of two rows; Q4_K and
// Q6_K take one row's 16 values with a few 16-byte loads (their sub-block's quants, scales, d), which
// eases the load/store unit, the kernel's limit at batched-decode sizes.
EMBER_DEV int qg_row(int r, int rows) {
    return r < rows ? r : -1;
}

template <bool GATED>
EMBER_DEV int qg_matrix_row(int r, int rows) {  // CTA row r -> the expert matrix's row, or -1
    if (GATED) {  // the expert's gate rows [0, rows/2), then its up rows
        const int half = rows / 2, j = blockIdx.x * (QG_ROWS / 2) + (r & (QG_ROWS / 2 - 1));
        return j < half ? j + (r >= QG_ROWS / 2 ? half : 0) : -1;
    }
    return qg_row(blockIdx.x * QG_ROWS + r, rows);
}

template <bool BF>
EMBER_DEV uint4 pack8(const float w[8]) {
    return make_uint4(pack2<BF>(w[0], w[1]), pack2<BF>(w[2], w[3]), pack2<BF>(w[4], w[5]), pack2<BF>(w[6], w[7]));
}

template <int T>
struct QgW {  // any type: units (threadIdx % 4) of rows threadIdx / 4 and threadIdx / 4 + 64, 8 values each
    static constexpr int ROWS = 2;
    static EMBER_DEV int row(int i) { return (threadIdx.x >> 2) + i * (QG_THREADS / 4); }
    template <bool BF>
    static EMBER_DEV void fetch(const u8* const rp[ROWS], int k0, uint4 v[2]) {
        typedef QT<T> Q;
        const int ug = k0 / 8 + (threadIdx.x & 3);
        const i64 off = (i64)(ug / Q::UNITS) * Q::BYTES;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            v[i] = make_uint4(0u, 0u, 0u, 0u);
            if (rp[i]) {
                float q[8], s, o;
                Q::template unit<Q::SMEM_A8>(rp[i] + off, ug % Q::UNITS, q, s, o);
                float w[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) w[e] = Q::IS_FLOAT ? q[e] : fmaf(s, q[e], -o);
                v[i] = pack8<BF>(w);
            }
        }
    }
    static EMBER_DEV void store(u16 (*dst)[QG_LD], const uint4 v[2]) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) *reinterpret_cast<uint4*>(&dst[row(i)][(threadIdx.x & 3) * 8]) = v[i];
    }
};

// one row's 16 values a thread: row threadIdx / 2, columns 16 (threadIdx % 2) of the slice
struct QgHalfRow {
    static constexpr int ROWS = 1;
    static EMBER_DEV int row(int) { return threadIdx.x >> 1; }
    static EMBER_DEV void store(u16 (*dst)[QG_LD], const uint4 v[2]) {
        uint4* d = reinterpret_cast<uint4*>(&dst[threadIdx.x >> 1][(threadIdx.x & 1) * 16]);
        d[0] = v[0];
        d[1] = v[1];
    }
};

EMBER_DEV u32 byte_of(uint4 v, int i) {  // byte i (0..15) of a 16-byte load
    const u32 w = i < 8 ? (i < 4 ? v.x : v.y) : (i < 12 ? v.z : v.w);
    return (w >> (8 * (i & 3))) & 0xFFu;
}

// Q4_K (144-byte blocks, 16-byte aligned rows): sub-block j = k0 % 256 / 32 of the block; d, dmin and
// the 12 scale bytes are its first 16 bytes; the 16 quants are bytes 16 + 32 (j / 2) + 16 h, low
// nibbles for even j
template <>
struct QgW<GT_Q4_K> : QgHalfRow {
    template <bool BF>
    static EMBER_DEV void fetch(const u8* const rp[1], int k0, uint4 v[2]) {
        v[0] = v[1] = make_uint4(0u, 0u, 0u, 0u);
        if (!rp[0]) return;
        const u8* p = rp[0] + (i64)(k0 / BLOCK_ELEMS_Q4_K) * BLOCK_BYTES_Q4_K;
        const int j = (k0 % BLOCK_ELEMS_Q4_K) / 32, h = threadIdx.x & 1;
        const uint4 hd = *reinterpret_cast<const uint4*>(p);
        const uint4 qs = *reinterpret_cast<const uint4*>(p + 16 + 32 * (j >> 1) + 16 * h);
        u32 sc, m;  // ggml's get_scale_min_k4 over bytes 4..15 of the block
        if (j < 4) {
            sc = byte_of(hd, 4 + j) & 63u;
            m = byte_of(hd, 8 + j) & 63u;
        } else {
            sc = (byte_of(hd, 8 + j) & 0xFu) | ((byte_of(hd, j) >> 6) << 4);
            m = (byte_of(hd, 8 + j) >> 4) | ((byte_of(hd, 4 + j) >> 6) << 4);
        }
        const float s = h2f((u16)(hd.x & 0xFFFFu)) * (float)sc, o = h2f((u16)(hd.x >> 16)) * (float)m;
        const int sh = 4 * (j & 1);
        const u32 words[4] = {qs.x, qs.y, qs.z, qs.w};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float q[8], w[8];
            bytes_to_floats((words[2 * half] >> sh) & 0x0F0F0F0Fu, (words[2 * half + 1] >> sh) & 0x0F0F0F0Fu,
                            8388608.0f, q);
#pragma unroll
            for (int e = 0; e < 8; ++e) w[e] = fmaf(s, q[e], -o);
            v[half] = pack8<BF>(w);
        }
    }
};

// Q6_K as stored on the device (224-byte blocks): value e of the block takes the nibble (e % 128) / 64
// of ql[64 (e / 128) + e % 64] and the 2 bits 2 ((e % 128) / 32) of qh[32 (e / 128) + e % 32]; a
// sub-block of 16 values has one int8 scale (byte 192 + e / 16), d at byte 208
template <>
struct QgW<GT_Q6_KP> : QgHalfRow {
    template <bool BF>
    static EMBER_DEV void fetch(const u8* const rp[1], int k0, uint4 v[2]) {
        v[0] = v[1] = make_uint4(0u, 0u, 0u, 0u);
        if (!rp[0]) return;
        const u8* p = rp[0] + (i64)(k0 / BLOCK_ELEMS_Q6_KP) * BLOCK_BYTES_Q6_KP;
        const int e0 = k0 % BLOCK_ELEMS_Q6_KP + 16 * (threadIdx.x & 1);  // this thread's first value
        const int hb = e0 >> 7, r = e0 & 127;
        const uint4 ql = *reinterpret_cast<const uint4*>(p + 64 * hb + (r & 63));
        const uint4 qh = *reinterpret_cast<const uint4*>(p + 128 + 32 * hb + (r & 31));
        const float s = h2f(*reinterpret_cast<const u16*>(p + 208)) * (float)(int)(i8)p[192 + (e0 >> 4)];
        const int shl = 4 * (r >> 6), shh = 2 * (r >> 5);
        const u32 lw[4] = {ql.x, ql.y, ql.z, ql.w}, hw[4] = {qh.x, qh.y, qh.z, qh.w};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const u32 a = ((lw[2 * half] >> shl) & 0x0F0F0F0Fu) | (((hw[2 * half] >> shh) & 0x03030303u) << 4);
            const u32 b = ((lw[2 * half + 1] >> shl) & 0x0F0F0F0Fu) | (((hw[2 * half + 1] >> shh) & 0x03030303u) << 4);
            float q[8], w[8];
            bytes_to_floats(a, b, 8388640.0f, q);
#pragma unroll
            for (int e = 0; e < 8; ++e) w[e] = s * q[e];
            v[half] = pack8<BF>(w);
        }
    }
};

// MXFP4 (17-byte blocks: e, then qs[16] as Q4_0: qs[j]'s low nibble is value j, its high nibble value
// j + 16): a 32-deep slice is one block a row, and thread h of a row takes the nibbles h of all 16 qs
// bytes. The block is read with five aligned 32-bit loads and realigned with funnel shifts, where the
// generic way read it a byte at a time (9 byte loads for every 8 values: the load/store unit was the
// tiles' limit). Rows are padded to 16 bytes (ops.QuantMatrix.upload), so the words around a block stay
// within its row. The values are the unit's (QT<GT_MXFP4>), operation for operation.
template <>
struct QgW<GT_MXFP4> : QgHalfRow {
    template <bool BF>
    static EMBER_DEV void fetch(const u8* const rp[1], int k0, uint4 v[2]) {
        v[0] = v[1] = make_uint4(0u, 0u, 0u, 0u);
        if (!rp[0]) return;
        const u8* p = rp[0] + (i64)(k0 / BLOCK_ELEMS_MXFP4) * BLOCK_BYTES_MXFP4;
        const int at = (int)(reinterpret_cast<unsigned long long>(p) & 3ull);
        const u32* w = reinterpret_cast<const u32*>(p - at);
        const u32 w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3], w4 = w[4];  // bytes at .. at + 16 of them
        const u32 e = (w0 >> (8 * at)) & 0xFFu;
        const bool next = at == 3;  // qs starts in the second word
        const u32 sh = 8u * ((u32)(at + 1) & 3u);
        const u32 qs[4] = {__funnelshift_r(next ? w1 : w0, next ? w2 : w1, sh),
                           __funnelshift_r(next ? w2 : w1, next ? w3 : w2, sh),
                           __funnelshift_r(next ? w3 : w2, next ? w4 : w3, sh),
                           __funnelshift_r(next ? w4 : w3, next ? 0u : w4, sh)};
        const float s = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23), o = 0.0f;
        const int nib = 4 * (threadIdx.x & 1);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float q[8], x[8];
            table_floats<EMBER_MXFP4_W0, EMBER_MXFP4_W1, EMBER_MXFP4_W2, EMBER_MXFP4_W3>(
                make_uint2(qs[2 * half], qs[2 * half + 1]), nib, q);
#pragma unroll
            for (int i = 0; i < 8; ++i) x[i] = fmaf(s, q[i], -o);
            v[half] = pack8<BF>(x);
        }
    }
};

// A thread's piece of each TN x 32 activation slice (TN * 4 <= QG_THREADS pieces of 8): row r = piece / 4
// of the tile; nullptr: a row past nb (zeros), or no piece
template <int TN>
EMBER_DEV const float* qg_x_row(const float* x, const int* __restrict__ order, int k, int p0, int nb, int cols) {
    static_assert(TN * 4 <= QG_THREADS, "one activation piece a thread at most");
    const int r = threadIdx.x >> 2;
    if (r >= TN || r >= nb) return nullptr;
    const int src = order ? order[p0 + r] / k : p0 + r;
    return x + (i64)src * cols + (threadIdx.x & 3) * 8;
}

template <bool BF>
EMBER_DEV uint4 qg_fetch_x(const float* xr, int k0) {
    if (!xr) return make_uint4(0u, 0u, 0u, 0u);
    const float4* p = reinterpret_cast<const float4*>(xr + k0);
    const float4 a = p[0], b = p[1];
    return make_uint4(pack2<BF>(a.x, a.y), pack2<BF>(a.z, a.w), pack2<BF>(b.x, b.y), pack2<BF>(b.z, b.w));
}

template <int TN>
EMBER_DEV void qg_store_x(u16 (*dst)[QG_LD], uint4 v) {
    if (threadIdx.x < TN * 4) *reinterpret_cast<uint4*>(&dst[threadIdx.x >> 2][(threadIdx.x & 3) * 8]) = v;
}

// BIASED: the experts' biases (or null) and any activation code (gpt-oss: its clamped SwiGLU); else neither,
// and a dense MLP's two activations: the kernels the other families run keep the epilogue they had before
// gpt-oss (dense_act), which a bias branch and the third activation slowed by 2% (the 30B-A3B's 64-row step)
template <int TN, bool GATED, bool BF, bool BIASED>
EMBER_DEV void qgemm(const u8* __restrict__ W, i64 row_bytes, i64 expert_bytes, int rows, int cols,
                     const int* __restrict__ tiles, const float* __restrict__ x, const int* __restrict__ order, int k,
                     float* __restrict__ y, int act, const float* __restrict__ bias) {
    typedef QgShape<TN> S;
    __shared__ __align__(16) QgSmem<TN> sm;
    grid_dependency_sync();  // the tiles and x come from the kernels before
    const int* tile = tiles + 3 * blockIdx.y;
    const int e = tile[0], p0 = tile[1], nb = tile[2];
    if (nb == 0) return;  // the whole block
    W += (i64)e * expert_bytes;
    if (BIASED && bias) bias += (i64)e * rows;  // this expert's biases, one a row of its matrix
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = (warp / S::WARPS_N) * S::WM, wn = (warp % S::WARPS_N) * S::WN;
    float acc[S::MI][S::NJ][4];
#pragma unroll
    for (int i = 0; i < S::MI; ++i)
#pragma unroll
        for (int j = 0; j < S::NJ; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

    const int nk = cols / QG_K;
    typedef QgW<QTYPE> L;
    const u8* rp[L::ROWS];
#pragma unroll
    for (int i = 0; i < L::ROWS; ++i) {
        const int gr = qg_matrix_row<GATED>(L::row(i), rows);
        rp[i] = gr >= 0 ? W + (i64)gr * row_bytes : nullptr;
    }
    const float* xr = qg_x_row<TN>(x, order, k, p0, nb, cols);
    uint4 wv[2], xv;
    L::template fetch<BF>(rp, 0, wv);
    xv = qg_fetch_x<BF>(xr, 0);
    L::store(sm.in.w[0], wv);
    qg_store_x<TN>(sm.in.x[0], xv);
    __syncthreads();
    for (int kt = 0; kt < nk; ++kt) {
        const int cur = kt & 1;
        const bool next = kt + 1 < nk;
        if (next) {
            L::template fetch<BF>(rp, (kt + 1) * QG_K, wv);
            xv = qg_fetch_x<BF>(xr, (kt + 1) * QG_K);
        }
#pragma unroll
        for (int ks = 0; ks < QG_K; ks += 16) {
            u32 af[S::MI][4], bf[S::NJ][2];
#pragma unroll
            for (int i = 0; i < S::MI; ++i) {
                const int r = wm + i * 16 + (lane & 15), c = ks + (lane >> 4) * 8;
                ldmatrix_x4(smem_addr(&sm.in.w[cur][r][c]), af[i][0], af[i][1], af[i][2], af[i][3]);
            }
#pragma unroll
            for (int j = 0; j < S::NJ / 2; ++j) {
                const int r = wn + j * 16 + (lane & 7) + ((lane >> 4) << 3), c = ks + ((lane >> 3) & 1) * 8;
                ldmatrix_x4(smem_addr(&sm.in.x[cur][r][c]), bf[2 * j][0], bf[2 * j][1], bf[2 * j + 1][0],
                            bf[2 * j + 1][1]);
            }
#pragma unroll
            for (int i = 0; i < S::MI; ++i)
#pragma unroll
                for (int j = 0; j < S::NJ; ++j) mma16816<BF>(acc[i][j], af[i], bf[j]);
        }
        if (next) {  // the other buffer: everyone finished reading it before the last barrier
            L::store(sm.in.w[cur ^ 1], wv);
            qg_store_x<TN>(sm.in.x[cur ^ 1], xv);
        }
        __syncthreads();
    }

    // c0,c1 at (weight row lane/4, pairs 2 (lane%4) + 0/1); c2,c3 eight rows below
#pragma unroll
    for (int i = 0; i < S::MI; ++i)
#pragma unroll
        for (int j = 0; j < S::NJ; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v)
                sm.out[wm + i * 16 + (lane >> 2) + (v >> 1) * 8][wn + j * 8 + (lane & 3) * 2 + (v & 1)] = acc[i][j][v];
    __syncthreads();
    if (GATED) {
        const int half = rows / 2, c0 = blockIdx.x * (QG_ROWS / 2);
        for (int idx = threadIdx.x; idx < nb * (QG_ROWS / 2); idx += QG_THREADS) {
            const int p = idx / (QG_ROWS / 2), j = idx % (QG_ROWS / 2);
            if (c0 + j >= half) continue;
            float g = sm.out[j][p], u = sm.out[QG_ROWS / 2 + j][p];
            if (BIASED && bias) {
                g += bias[c0 + j];
                u += bias[half + c0 + j];
            }
            y[(i64)(p0 + p) * half + c0 + j] = BIASED ? gated_act(act, g, u) : dense_act(act, g, u);
        }
    } else {
        const int c0 = blockIdx.x * QG_ROWS;
        for (int idx = threadIdx.x; idx < nb * QG_ROWS; idx += QG_THREADS) {
            const int p = idx / QG_ROWS, j = idx % QG_ROWS;
            if (c0 + j >= rows) continue;
            float v = sm.out[j][p];
            if (BIASED && bias) v += bias[c0 + j];
            y[(i64)(p0 + p) * rows + c0 + j] = v;
        }
    }
}

// qgemm* without biases, qgemmb* with them (and any activation)
#define QGEMM_(NAME, GNAME, BF, TN, BIASED)                                                                   \
    extern "C" __global__ void __launch_bounds__(QG_THREADS)                                              \
        NAME(const u8* __restrict__ W, i64 row_bytes, i64 expert_bytes, int rows, int cols,               \
             const int* __restrict__ tiles, const float* __restrict__ x, const int* order, int k,         \
             float* __restrict__ y, const float* bias) {                                                  \
        qgemm<TN, false, BF, BIASED>(W, row_bytes, expert_bytes, rows, cols, tiles, x, order, k, y, ACT_NONE, bias); \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(QG_THREADS)                                              \
        GNAME(const u8* __restrict__ W, i64 row_bytes, i64 expert_bytes, int rows, int cols,              \
              const int* __restrict__ tiles, const float* __restrict__ x, const int* order, int k,        \
              float* __restrict__ y, int act, const float* bias) {                                        \
        qgemm<TN, true, BF, BIASED>(W, row_bytes, expert_bytes, rows, cols, tiles, x, order, k, y, act, bias); \
    }
#define QGEMM(H, BF, TN)                                                          \
    QGEMM_(qgemm_##H##_t##TN, qgemmg_##H##_t##TN, BF, TN, false)                  \
    QGEMM_(qgemmb_##H##_t##TN, qgemmgb_##H##_t##TN, BF, TN, true)
QGEMM(f16, false, 16)
QGEMM(f16, false, 64)
QGEMM(bf16, true, 16)
QGEMM(bf16, true, 64)
