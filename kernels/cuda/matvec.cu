// y[b, r] = sum_k W[r, k] * x[b, k] (+ res[b, r]) with W straight from GGUF blocks (one ggml type per
// module, QTYPE set by the build) and x, y float32: the decode hot path (matrix-vector and small
// batches, b < 8 per launch).
//
// One warp owns R rows. The row is walked in chunks of CB blocks: the warp copies the R rows' chunk
// into its slice of shared memory with VEC-byte loads (coalesced; the next chunk's loads are issued
// before the current one is decoded, so bytes stay in flight), then each lane decodes 8-element
// units from shared memory and multiplies them with x, whose values are read once per unit and used
// for all R rows. Per unit: sum q*x in float, then * scale (- min * sum x); the final sum over
// lanes is a butterfly. Memory-bound by design: every weight byte is read exactly once.
#include "act.cuh"
#include "moe.cuh"
#include "norm.cuh"
#include "quant.cuh"

#ifndef QTYPE
#error "QTYPE must be defined"
#endif

// MATVEC_WARPS (warps a block) and XPRO_COLS (columns of an x a block makes itself, XK) come from
// kernels/constants.py
static_assert(XPRO_COLS == 8 * MATVEC_WARPS * 32, "a block makes its x 8 columns a thread (norm.cuh, E = 8)");
#define XSTAGE_COLS 2048  // batch 1 without XK: x staged in shared memory up to this many columns

// Batch-1 matvecs whose every block makes its input x itself, into shared memory, saving the launch
// of the kernel that would have made it (rows of at most XPRO_COLS columns):
//   XK_POST_NORM: x = rms_norm(res + rms_norm(o) * w1) * w2 from o and the residual res (Gemma's
//     post-norm, residual add and next pre-norm: rms_norm_add_norm's math); block 0 stores the new
//     residual to res_out (another buffer: the other blocks still read res).
#define XK_NONE 0
#define XK_POST_NORM 1
struct XPro {
    const float* o;
    const float* res;
    float* res_out;
    const float* w1;
    const float* w2;
    float eps;
};

template <int VEC> struct VecT;
template <> struct VecT<16> { typedef uint4 T; };
template <> struct VecT<8> { typedef uint2 T; };
template <> struct VecT<4> { typedef u32 T; };
template <> struct VecT<2> { typedef u16 T; };

// The widest load (16, 8, 4 or 2 bytes) at which every chunk of the SPLIT kernels (CB / MATVEC_WARPS
// blocks) starts aligned: a quarter of a chunk of 66-110-byte blocks is not 16 bytes' multiple
template <int T>
struct SplitVec {
    static constexpr int BYTES = QT<T>::CB / MATVEC_WARPS * QT<T>::BYTES;
    static constexpr int VEC = BYTES % 16 == 0 ? 16 : BYTES % 8 == 0 ? 8 : BYTES % 4 == 0 ? 4 : 2;
};

// GATED (R = 2): W is the stacked [gate; up] matrix (rows = 2 ffn); a warp takes gate row g and up
// row ffn + g and writes y[b, g] = act(gate) * up, [nb, ffn] (act: an ACT_* code, act.cuh gated_act), so
// the MLP's activation is computed once per column instead of in every block of the down projection.
// SPLIT (batch 1, R rows a block): the block's warps share its rows, each taking every MATVEC_WARPS-th
// chunk of Q::CB / MATVEC_WARPS blocks of all R, and add their sums through shared memory: a wide row's
// decode (a chain of units per lane, latency-bound at one row a warp) is then a quarter as long, its
// R rows side by side.
// WAITED: the caller has passed grid_dependency_sync already (the weights it reads depend on an earlier
// kernel), so the early weight load and the wait are skipped
// bias: a float per row of W added to its product (a mixture of experts' biases: gpt-oss), or null
template <int B, int R, int VEC, bool GATED = false, int XK = XK_NONE, bool SPLIT = false, bool WAITED = false>
EMBER_DEV void qmv(const u8* __restrict__ W, i64 row_bytes, int rows, int cols,
                   const float* __restrict__ x, int nb, const float* res, float* y, int act = ACT_NONE,
                   const XPro& xp = XPro{}, const float* __restrict__ bias = nullptr) {
    static_assert(!GATED || R == 2, "a gated warp owns one gate row and its up row");
    constexpr bool XP = XK != XK_NONE;
    static_assert(!XP || B == 1, "a block makes one row of x");
    static_assert(!SPLIT || (B == 1 && !GATED && XK == XK_NONE), "split rows: batch 1");
    static_assert(!SPLIT || QT<QTYPE>::CB % MATVEC_WARPS == 0, "a chunk splits into MATVEC_WARPS");
    typedef QT<QTYPE> Q;
    typedef typename VecT<VEC>::T V;
    constexpr int WS = SPLIT ? MATVEC_WARPS : 1;  // warps a row
    constexpr int CB = Q::CB / WS;            // blocks a chunk
    constexpr int CHUNK = CB * Q::BYTES;
    static_assert(CHUNK % VEC == 0, "every chunk starts VEC-aligned (a QT's CB)");
    constexpr int NVR = (CHUNK + 32 * VEC - 1) / (32 * VEC);
    __shared__ __align__(16) u8 smem[MATVEC_WARPS][R][NVR * 32 * VEC];
    // XP: this block's x; XSTAGE (batch 1): x copied in once (a row of at most XSTAGE_COLS), so the
    // decode loop below does not wait on a global load of x every unit
    constexpr bool XSTAGE = !XP && B == 1;
    __shared__ __align__(16) float xnorm[XP ? XPRO_COLS : XSTAGE ? XSTAGE_COLS : 4];
    __shared__ float scratch[XP ? 33 : SPLIT ? MATVEC_WARPS * R : 1];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int half = rows / 2;
    const int part = SPLIT ? warp : 0;  // SPLIT: this warp's chunks are part, part + WS, ...
    const int row0 = SPLIT ? blockIdx.x * R : (blockIdx.x * MATVEC_WARPS + warp) * (GATED ? 1 : R);  // GATED: gate row
    const bool idle = row0 >= (GATED ? half : rows);
    float w1v[XP ? 8 : 1], w2v[XP ? 8 : 1];
    if constexpr (XK == XK_POST_NORM) {
        load_weights(xp.w1, cols, w1v);
        load_weights(xp.w2, cols, w2v);
    } else if (!XP && !XSTAGE && idle) {  // the whole warp leaves; only __syncwarp is used below (else: later)
        if (!WAITED) grid_dependency_sync();
        return;
    }
    const int nblk = cols / Q::ELEMS;
    const int nchunks = (nblk + CB - 1) / CB;

    const u8* rowp[R];
#pragma unroll
    for (int r = 0; r < R; ++r) rowp[r] = W + (i64)(GATED ? row0 + r * half : min(row0 + r, rows - 1)) * row_bytes;

    V buf[R][NVR];
    auto load = [&](int ch) {
        const int bytes = min(CB, nblk - ch * CB) * Q::BYTES;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const V* src = reinterpret_cast<const V*>(rowp[r] + (i64)ch * CHUNK);
#pragma unroll
            for (int v = 0; v < NVR; ++v) {
                const int i = v * 32 + lane;
                if (i * VEC < bytes) buf[r][v] = __ldg(src + i);
            }
        }
    };

    float acc[B][R];
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[b][r] = 0.0f;

    // the first chunk's weights depend on no earlier kernel: loaded while it finishes (programmatic
    // dependent launch; a small matrix's whole row is one chunk), x read after the wait
    if (!idle && part < nchunks) load(part);
    if (!WAITED) grid_dependency_sync();
    if (XSTAGE) TRACE_MARK(8);
    bool x_staged = XP;
    if constexpr (XSTAGE) {  // every warp takes part, idle or not
        if (cols <= XSTAGE_COLS) {  // block-uniform
            if ((cols & 3) == 0 && (reinterpret_cast<u64>(x) & 15) == 0) {  // every load issued, then stored
                constexpr int XV = XSTAGE_COLS / (4 * MATVEC_WARPS * 32);
                float4 xv4[XV];
#pragma unroll
                for (int k = 0; k < XV; ++k) {
                    const int c = 4 * (threadIdx.x + k * MATVEC_WARPS * 32);
                    if (c < cols) xv4[k] = __ldg(reinterpret_cast<const float4*>(x + c));
                }
#pragma unroll
                for (int k = 0; k < XV; ++k) {
                    const int c = 4 * (threadIdx.x + k * MATVEC_WARPS * 32);
                    if (c < cols) *reinterpret_cast<float4*>(xnorm + c) = xv4[k];
                }
            } else {
                for (int c = threadIdx.x; c < cols; c += blockDim.x) xnorm[c] = x[c];
            }
            __syncthreads();
            x_staged = true;
        }
        TRACE_MARK(9);
        if (idle) return;
    }
    if constexpr (XK == XK_POST_NORM) {  // every warp takes part in the block's reductions, idle or not
        float ov[8], hv[8];
        post_norm_add_norm(xp.o, xp.res, w1v, w2v, cols, xp.eps, scratch, ov, hv);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < cols) {
                xnorm[c] = hv[i];
                if (blockIdx.x == 0 && xp.res_out) xp.res_out[c] = ov[i];
            }
        }
        __syncthreads();
        if (idle) return;
    }
    for (int ch = part; ch < nchunks; ch += WS) {
        const int nbc = min(CB, nblk - ch * CB);
        const int bytes = nbc * Q::BYTES;
        __syncwarp();
#pragma unroll
        for (int r = 0; r < R; ++r) {
            V* dst = reinterpret_cast<V*>(&smem[warp][r][0]);
#pragma unroll
            for (int v = 0; v < NVR; ++v) {
                const int i = v * 32 + lane;
                if (i * VEC < bytes) dst[i] = buf[r][v];
            }
        }
        __syncwarp();
        if (ch + WS < nchunks) load(ch + WS);

        const float* xc = x + (i64)ch * CB * Q::ELEMS;
        const int nunits = nbc * Q::UNITS;
        for (int u = lane; u < nunits; u += 32) {
            const int blk = u / Q::UNITS, uu = u % Q::UNITS;
            const int e = blk * Q::ELEMS + uu * 8;
            float xv[B][8], xs[B];
#pragma unroll
            for (int b = 0; b < B; ++b) {
                if (x_staged) {
                    const float4 lo = *reinterpret_cast<const float4*>(xnorm + ch * CB * Q::ELEMS + e);
                    const float4 hi = *reinterpret_cast<const float4*>(xnorm + ch * CB * Q::ELEMS + e + 4);
                    xv[b][0] = lo.x; xv[b][1] = lo.y; xv[b][2] = lo.z; xv[b][3] = lo.w;
                    xv[b][4] = hi.x; xv[b][5] = hi.y; xv[b][6] = hi.z; xv[b][7] = hi.w;
                } else if (b < nb) {
                    const float4 lo = __ldg(reinterpret_cast<const float4*>(xc + (i64)b * cols + e));
                    const float4 hi = __ldg(reinterpret_cast<const float4*>(xc + (i64)b * cols + e + 4));
                    xv[b][0] = lo.x; xv[b][1] = lo.y; xv[b][2] = lo.z; xv[b][3] = lo.w;
                    xv[b][4] = hi.x; xv[b][5] = hi.y; xv[b][6] = hi.z; xv[b][7] = hi.w;
                } else {
#pragma unroll
                    for (int i = 0; i < 8; ++i) xv[b][i] = 0.0f;
                }
                xs[b] = 0.0f;
                if (Q::HAS_MIN) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) xs[b] += xv[b][i];
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float q[8], s, o;
                Q::template unit<Q::SMEM_A8>(&smem[warp][r][blk * Q::BYTES], uu, q, s, o);
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    float d = 0.0f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) d = fmaf(q[i], xv[b][i], d);
                    if (Q::IS_FLOAT) acc[b][r] += d;
                    else if (Q::HAS_MIN) acc[b][r] += s * d - o * xs[b];
                    else acc[b][r] = fmaf(s, d, acc[b][r]);
                }
            }
        }
    }

#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[b][r] = warp_sum(acc[b][r]);
    if constexpr (SPLIT) {  // the rows' parts, summed in warp order; the block is idle or not as a whole
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < R; ++r) scratch[warp * R + r] = acc[0][r];
        __syncthreads();
        if (warp != 0) return;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            acc[0][r] = 0.0f;
#pragma unroll
            for (int w = 0; w < MATVEC_WARPS; ++w) acc[0][r] += scratch[w * R + r];
        }
    }
    if (XSTAGE) TRACE_MARK(10);
    if (bias) {  // each row's bias (GATED: the gate row's and its up row's), added to every batch row's sum
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = GATED ? row0 + r * half : row0 + r;
            const float bv = row < rows ? bias[row] : 0.0f;
#pragma unroll
            for (int b = 0; b < B; ++b) acc[b][r] += bv;
        }
    }
    if (GATED && lane == 0) {
#pragma unroll
        for (int b = 0; b < B; ++b)
            if (b < nb) y[(i64)b * half + row0] = gated_act(act, acc[b][0], acc[b][R - 1]);
    } else if (lane == 0) {
#pragma unroll
        for (int b = 0; b < B; ++b) {
            if (b >= nb) break;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = row0 + r;
                if (row < rows) {
                    const i64 at = (i64)b * rows + row;
                    y[at] = acc[b][r] + (res ? res[at] : 0.0f);
                }
            }
        }
    }
}

#define QMV(B, R, VEC)                                                                              \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32)                                 \
        qmv_b##B##_r##R##_v##VEC(const u8* __restrict__ W, i64 row_bytes, int rows, int cols,       \
                                 const float* __restrict__ x, int nb, const float* res, float* y) { \
        qmv<B, R, VEC>(W, row_bytes, rows, cols, x, nb, res, y);                                    \
    }

QMV(1, 1, 16) QMV(1, 2, 16) QMV(1, 4, 16)
QMV(2, 1, 16) QMV(2, 2, 16) QMV(2, 4, 16)
QMV(4, 1, 16) QMV(4, 2, 16) QMV(4, 4, 16)
QMV(8, 1, 16) QMV(8, 2, 16) QMV(8, 4, 16)
QMV(1, 1, 2) QMV(2, 1, 2) QMV(4, 1, 2) QMV(8, 1, 2)

// A grouped projection at batch 1 in one launch: group g = blockIdx.y multiplies its own x row by its
// own rows of W (y[g] = x[g] W_g^T, W_g the g-th w_group bytes of W), as DeepSeek V4's output projection
// takes each group of heads through its own matrix: one launch of G * rows rows, not G launches of a few
// hundred blocks each, whose fixed cost was most of their time.
#define QMV_GROUPS(R)                                                                                      \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32)                                        \
        qmv_b1_r##R##_v16_groups(const u8* __restrict__ W, i64 row_bytes, int rows, int cols, i64 w_group,  \
                                 const float* __restrict__ x, i64 x_group, float* y, i64 y_group) {        \
        const int g = blockIdx.y;                                                                          \
        qmv<1, R, 16>(W + g * w_group, row_bytes, rows, cols, x + g * x_group, 1, nullptr, y + g * y_group);  \
    }
QMV_GROUPS(1) QMV_GROUPS(2) QMV_GROUPS(4)

// Several matrices that read one x, stacked in W, at batch 1 in one launch, each into its own y: matrix s
// is W's rows [e_{s-1}, e_s) (e_{-1} = 0; a matrix not given ends at rows) and goes to y_s. Each matrix's
// rows are a multiple of a block's (MATVEC_WARPS * R), so a block's rows belong to one matrix, whose y it
// writes at the matrix's own row numbers. (DeepSeek V4: the one KV head's row, the low-rank query, the
// compressor's and the indexer's rows, all of the attention's input: six launches that mostly waited.)
#define FAN_ARGS(s) float *y##s, int e##s
#define QMV_FAN(R)                                                                                          \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32)                                         \
        qmv_b1_r##R##_v16_fan(const u8* __restrict__ W, i64 row_bytes, int rows, int cols,                  \
                              const float* __restrict__ x, FAN_ARGS(0), FAN_ARGS(1), FAN_ARGS(2),          \
                              FAN_ARGS(3), FAN_ARGS(4), FAN_ARGS(5)) {                                     \
        static_assert(FAN_MAX == 6, "the fan-out's arguments");                                             \
        const int row0 = blockIdx.x * MATVEC_WARPS * R;                                                    \
        float* y = y0;                                                                                     \
        int start = 0, end = e0;                                                                           \
        if (row0 >= e0) y = y1, start = e0, end = e1;                                                      \
        if (row0 >= e1) y = y2, start = e1, end = e2;                                                      \
        if (row0 >= e2) y = y3, start = e2, end = e3;                                                      \
        if (row0 >= e3) y = y4, start = e3, end = e4;                                                      \
        if (row0 >= e4) y = y5, start = e4, end = e5;                                                      \
        qmv<1, R, 16>(W, row_bytes, min(end, rows), cols, x, 1, nullptr, y - start);                        \
    }
QMV_FAN(1) QMV_FAN(2) QMV_FAN(4)

// R wide rows a block, their chunks shared by the block's warps (16-byte rows; chunks loaded SplitVec wide)
#define QMVS(R)                                                                                          \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32)                                      \
        qmvs_b1_r##R(const u8* __restrict__ W, i64 row_bytes, int rows, int cols, const float* __restrict__ x, \
                     const float* res, float* y) {                                                       \
        qmv<1, R, SplitVec<QTYPE>::VEC, false, XK_NONE, true>(W, row_bytes, rows, cols, x, 1, res, y);   \
    }
QMVS(1) QMVS(2) QMVS(4)

// the gate|up projection with the activation in its epilogue (16-byte aligned rows only)
#define QMVG(B)                                                                                     \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32)                                 \
        qmvg_b##B(const u8* __restrict__ W, i64 row_bytes, int rows, int cols,                      \
                  const float* __restrict__ x, int nb, float* y, int act) {                         \
        qmv<B, 2, 16, true>(W, row_bytes, rows, cols, x, nb, nullptr, y, act);                      \
    }
QMVG(1) QMVG(2) QMVG(4) QMVG(8)

// batch 1 with the input normalised in the kernel (XPro): the 16-byte row path, and the gate|up one
#define QMVX(R)                                                                                         \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32) qmvx_b1_r##R(                       \
        const u8* __restrict__ W, i64 row_bytes, int rows, int cols, const float* o, const float* res,  \
        float* res_out, const float* w1, const float* w2, float eps, float* y) {                        \
        const XPro xp{o, res, res_out, w1, w2, eps};                            \
        qmv<1, R, 16, false, XK_POST_NORM>(W, row_bytes, rows, cols, nullptr, 1, nullptr, y, 0, xp);    \
    }
QMVX(1) QMVX(2) QMVX(4)
extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32) qmvgx_b1(
    const u8* __restrict__ W, i64 row_bytes, int rows, int cols, const float* o, const float* res, float* res_out,
    const float* w1, const float* w2, float eps, float* y, int act) {
    const XPro xp{o, res, res_out, w1, w2, eps};
    qmv<1, 2, 16, true, XK_POST_NORM>(W, row_bytes, rows, cols, nullptr, 1, nullptr, y, act, xp);
}

// A mixture of experts' matrices, grouped (moe.cu): W holds the experts' matrices one after another,
// expert_bytes apart, each `rows` x `cols`; tile blockIdx.y of `tiles` (moe_group) says the expert, the
// first row of x (and of y) in grouped order, and how many rows (0: no work). qmoe: y = x W_e^T;
// qmoeg: W_e is the stacked [gate; up] matrix and y = act(x W_gate^T) * (x W_up^T), [pairs, rows / 2].
// x_per_pair 0: every pair reads x's one row (a single token's pairs: no gather). bias (or null): each
// expert's `rows` biases one after another, added to its rows' products (before the activation).
template <int B, int R, bool GATED>
EMBER_DEV void qmoe(const u8* __restrict__ W, i64 row_bytes, i64 expert_bytes, int rows, int cols,
                    const int* __restrict__ tiles, const float* __restrict__ x, int x_per_pair, float* y, int act,
                    const float* __restrict__ bias) {
    grid_dependency_sync();  // the tiles come from the kernel before
    const int* tile = tiles + 3 * blockIdx.y;
    const int e = tile[0], r0 = tile[1], nb = tile[2];
    if (nb == 0) return;  // the whole block
    const int ycols = GATED ? rows / 2 : rows;
    qmv<B, R, 16, GATED, XK_NONE, false, true>(W + e * expert_bytes, row_bytes, rows, cols,
                                               x + (i64)r0 * cols * x_per_pair, nb, nullptr, y + (i64)r0 * ycols,
                                               act, XPro{}, bias ? bias + (i64)e * rows : nullptr);
}

#define QMOE(B)                                                                                           \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32)                                       \
        qmoe_b##B(const u8* __restrict__ W, i64 row_bytes, i64 expert_bytes, int rows, int cols,          \
                  const int* __restrict__ tiles, const float* __restrict__ x, int x_per_pair, float* y,   \
                  const float* bias) {                                                                    \
        qmoe<B, 1, false>(W, row_bytes, expert_bytes, rows, cols, tiles, x, x_per_pair, y, ACT_NONE, bias); \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32)                                       \
        qmoeg_b##B(const u8* __restrict__ W, i64 row_bytes, i64 expert_bytes, int rows, int cols,         \
                   const int* __restrict__ tiles, const float* __restrict__ x, int x_per_pair, float* y,  \
                   int act, const float* bias) {                                                          \
        qmoe<B, 2, true>(W, row_bytes, expert_bytes, rows, cols, tiles, x, x_per_pair, y, act, bias);     \
    }
QMOE(1) QMOE(8)

// The grouped matvec at batch 1, column-resident (qmoc_b1): for the low-bit experts, whose staged form
// (qmoe_b1, a warp a row) re-read 32 bytes of x for every 8 weights and ran at about a quarter of the
// memory's bandwidth. Here thread i of a block owns columns 32 i .. 32 i + 31 of every row (a group of
// four units, in one block of the type) and holds that slice of x in registers; a block walks QMOC_RPB rows
// of its tile's expert, each thread decoding its group of each row (Group32 below), and the rows' sums
// meet across the block's warps in shared memory. Same tiles, x, y and bias as qmoe (one pair a tile).
// QMOC_RPB (rows a block) and QMOC_MAX_WARPS (a block's warps at most, 1024 columns each) come from
// kernels/constants.py

// A thread's dot of its 32 weights (group g of the block at p) with x[32]; xs[k]: the sum of x[8k .. 8k + 7]
// (the types with a minimum). The default decodes four units through QT<T>::unit; the users' DeepSeek V4
// types read the group's bytes once (a unit's loads, repeated four times, were most of the time).
template <int T>
struct Group32 {
    static EMBER_DEV float dot(const u8* p, int g, const float x[32], const float xs[4]) {
        typedef QT<T> Q;
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float q[8], sc, o;
            Q::template unit<false>(p, 4 * g + k, q, sc, o);
            float d = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) d = fmaf(q[i], x[8 * k + i], d);
            if (Q::HAS_MIN) acc += sc * d - o * xs[k];
            else acc = fmaf(sc, d, acc);
        }
        return acc;
    }
};

// IQ2_XXS: group g is bytes 2 + 8 g: four grid indices, then a word of four 7-bit sign indices and the
// group's 4-bit scale (quant_lowbit.cuh's unit, its loads made once)
template <>
struct Group32<GT_IQ2_XXS> {
    static EMBER_DEV float dot(const u8* p, int g, const float x[32], const float[4]) {
        const u8* b = p + 2 + 8 * g;
        const u32 idx = ld32a2(b), aux = ld32a2(b + 4);
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float q[8];
            const u64 grid = ember_iq2xxs_grid((idx >> (8 * k)) & 0xFFu);
            bytes_to_floats((u32)grid, (u32)(grid >> 32), 8388608.0f, q);
            apply_signs(q, ksign((aux >> (7 * k)) & 127u));
#pragma unroll
            for (int i = 0; i < 8; ++i) acc = fmaf(q[i], x[8 * k + i], acc);
        }
        return h2f(ld16(p)) * (0.5f + (float)(aux >> 28)) * 0.25f * acc;
    }
};

// Q2_K: group g = 4 h + j is bits 2 j of qs[32 h .. 32 h + 31] (offset 16), its two 16-element halves
// scaled by scales[2 g], scales[2 g + 1] (a nibble each of scale and min) times d and dmin (offset 80)
template <>
struct Group32<GT_Q2_K> {
    static EMBER_DEV float dot(const u8* p, int g, const float x[32], const float xs[4]) {
        const int h = g >> 2, j = g & 3;
        const u32* qs = reinterpret_cast<const u32*>(p + 16 + 32 * h);
        u32 w[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = (qs[i] >> (2 * j)) & 0x03030303u;
        const u32 sc = ld16(p + 2 * g), dd = *reinterpret_cast<const u32*>(p + 80);
        const float d = h2f((u16)(dd & 0xFFFFu)), dmin = h2f((u16)(dd >> 16));
        float acc = 0.0f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float q[8], e = 0.0f;
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                bytes_to_floats(w[4 * half + 2 * k], w[4 * half + 2 * k + 1], 8388608.0f, q);
#pragma unroll
                for (int i = 0; i < 8; ++i) e = fmaf(q[i], x[16 * half + 8 * k + i], e);
            }
            const u32 b = (sc >> (8 * half)) & 0xFFu;
            acc += d * (float)(b & 0xFu) * e - dmin * (float)(b >> 4) * (xs[2 * half] + xs[2 * half + 1]);
        }
        return acc;
    }
};

// The int8 form (qmoc8_b1): a thread's 32 columns of x quantized to int8 once, as one block of
// reference.quantize_q8 (d = max|x| / 127, q = roundf(x / d): kq8's and ggml's q8_1), then every row's 32
// weights a dp4a per 4, the sum exact in integers. For the users' DeepSeek V4 expert types only: IQ2_XXS's
// grid bytes (8, 25 or 43) signed by a byte mask of their sign bits, Q2_K's 2-bit quants as bytes with
// its minimums through the sums of x's quants per 16. Twin: reference.linear_q8 over the expert.
EMBER_DEV u32 sign_bytes4(u32 s) {  // bits 0-3 of s -> bytes 0-3 of 0xFF or 0 (the four bits spread 7 apart)
    return ((s & 0xFu) * 0x00204081u & 0x01010101u) * 0xFFu;
}

template <int T>
struct Group32Q8 {
    static constexpr bool OK = false;
    static EMBER_DEV float dot(const u8*, int, const int[8], float, const int[2]) { return 0.0f; }
};

template <>
struct Group32Q8<GT_IQ2_XXS> {
    static constexpr bool OK = true;
    static EMBER_DEV float dot(const u8* p, int g, const int xq[8], float dx, const int[2]) {
        const u8* b = p + 2 + 8 * g;
        const u32 idx = ld32a2(b), aux = ld32a2(b + 4);
        int acc = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u64 grid = ember_iq2xxs_grid((idx >> (8 * k)) & 0xFFu);
            const u32 s = ksign((aux >> (7 * k)) & 127u);
            const u32 m0 = sign_bytes4(s), m1 = sign_bytes4(s >> 4);
            acc = __dp4a((int)__vsub4((u32)grid ^ m0, m0), xq[2 * k], acc);  // (g ^ m) - m: -g where m = 0xFF
            acc = __dp4a((int)__vsub4((u32)(grid >> 32) ^ m1, m1), xq[2 * k + 1], acc);
        }
        return h2f(ld16(p)) * (0.5f + (float)(aux >> 28)) * 0.25f * dx * (float)acc;
    }
};

template <>
struct Group32Q8<GT_Q2_K> {
    static constexpr bool OK = true;
    static EMBER_DEV float dot(const u8* p, int g, const int xq[8], float dx, const int xs[2]) {
        const int h = g >> 2, j = g & 3;
        const u32* qs = reinterpret_cast<const u32*>(p + 16 + 32 * h);
        const u32 sc = ld16(p + 2 * g), dd = *reinterpret_cast<const u32*>(p + 80);
        const float d = h2f((u16)(dd & 0xFFFFu)), dmin = h2f((u16)(dd >> 16));
        float acc = 0.0f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int e = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) e = __dp4a((int)((qs[4 * half + i] >> (2 * j)) & 0x03030303u), xq[4 * half + i], e);
            const u32 b = (sc >> (8 * half)) & 0xFFu;
            acc += d * (float)(b & 0xFu) * (float)e - dmin * (float)(b >> 4) * (float)xs[half];
        }
        return dx * acc;
    }
};

// A thread's 32 columns of x as the dot products take them: float, with the sums of each 8 (Group32), or
// quantized to int8 as one block of reference.quantize_q8 with the sums of each 16 quants (Group32Q8)
template <int T>
struct XFloat32 {
    typedef QT<T> Q;
    static constexpr bool OK = QT<T>::ELEMS % 32 == 0 && !QT<T>::IS_FLOAT;  // a thread's 32 columns in one block
    float xv[32], xs[4];
    EMBER_DEV void load(const float* xr, bool mine) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float4 v = mine ? __ldg(reinterpret_cast<const float4*>(xr) + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            xv[4 * k] = v.x, xv[4 * k + 1] = v.y, xv[4 * k + 2] = v.z, xv[4 * k + 3] = v.w;
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            xs[k] = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) xs[k] += xv[8 * k + i];
        }
    }
    EMBER_DEV float dot(const u8* p, int g) const { return Group32<T>::dot(p, g, xv, xs); }
};

template <int T>
struct XInt8 {
    typedef QT<T> Q;
    static constexpr bool OK = Group32Q8<T>::OK;
    int xq[8], xs[2];
    float dx;
    EMBER_DEV void load(const float* xr, bool mine) {
        float xv[32], amax = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float4 v = mine ? __ldg(reinterpret_cast<const float4*>(xr) + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            xv[4 * k] = v.x, xv[4 * k + 1] = v.y, xv[4 * k + 2] = v.z, xv[4 * k + 3] = v.w;
            amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        }
        dx = amax / 127.0f;
        const float id = dx > 0.0f ? 1.0f / dx : 0.0f;
        xs[0] = xs[1] = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int a0 = (int)roundf(xv[4 * k] * id), a1 = (int)roundf(xv[4 * k + 1] * id);
            const int a2 = (int)roundf(xv[4 * k + 2] * id), a3 = (int)roundf(xv[4 * k + 3] * id);
            xq[k] = (a0 & 0xff) | ((a1 & 0xff) << 8) | ((a2 & 0xff) << 16) | ((u32)a3 << 24);
            xs[k >> 2] += (a0 + a1) + (a2 + a3);
        }
    }
    EMBER_DEV float dot(const u8* p, int g) const { return Group32Q8<T>::dot(p, g, xq, dx, xs); }
};

// The column-resident body of both (the comment above qmoc_b1's Group32): X holds a thread's slice of x
template <class X>
EMBER_DEV void qmoc(const u8* __restrict__ W, i64 row_bytes, i64 expert_bytes, int rows, int cols,
                    const int* __restrict__ tiles, const float* __restrict__ x, int x_per_pair, float* __restrict__ y,
                    const float* __restrict__ bias) {
    typedef typename X::Q Q;
    __shared__ float red[QMOC_MAX_WARPS][QMOC_RPB];
    const int* tile = tiles + 3 * blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int c0 = 32 * threadIdx.x, row0 = blockIdx.x * QMOC_RPB;
    const bool mine = c0 < cols;
    const int blk = c0 / Q::ELEMS, g = (c0 % Q::ELEMS) / 32;
    grid_dependency_sync();  // the tiles and x come from the kernels before
    const int e = tile[0], r0 = tile[1], nb = tile[2];
    if (nb == 0) return;  // the whole block
    X xin;
    xin.load(x + (i64)r0 * cols * x_per_pair + c0, mine);
    const u8* base = W + e * expert_bytes + (i64)blk * Q::BYTES;
    float acc[QMOC_RPB];
#pragma unroll
    for (int r = 0; r < QMOC_RPB; ++r) {
        const int row = row0 + r;
        acc[r] = mine && row < rows ? xin.dot(base + (i64)row * row_bytes, g) : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < QMOC_RPB; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == 0) red[warp][r] = v;
    }
    __syncthreads();
    if (threadIdx.x < QMOC_RPB) {
        const int row = row0 + threadIdx.x;
        if (row < rows) {
            float v = 0.0f;
            for (int w = 0; w < warps; ++w) v += red[w][threadIdx.x];
            if (bias) v += bias[(i64)e * rows + row];
            y[(i64)r0 * rows + row] = v;
        }
    }
}

extern "C" __global__ void __launch_bounds__(QMOC_MAX_WARPS * 32)
    qmoc_b1(const u8* __restrict__ W, i64 row_bytes, i64 expert_bytes, int rows, int cols,
            const int* __restrict__ tiles, const float* __restrict__ x, int x_per_pair, float* __restrict__ y,
            const float* __restrict__ bias) {
    if constexpr (!XFloat32<QTYPE>::OK) {
        __trap();  // (ops.moe_matvec never launches it for these types)
    } else {
        qmoc<XFloat32<QTYPE>>(W, row_bytes, expert_bytes, rows, cols, tiles, x, x_per_pair, y, bias);
    }
}

// qmoc_b1 with x quantized to int8 (Group32Q8 above): same grid, tiles, x, y and bias
extern "C" __global__ void __launch_bounds__(QMOC_MAX_WARPS * 32)
    qmoc8_b1(const u8* __restrict__ W, i64 row_bytes, i64 expert_bytes, int rows, int cols,
             const int* __restrict__ tiles, const float* __restrict__ x, int x_per_pair, float* __restrict__ y,
             const float* __restrict__ bias) {
    if constexpr (!XInt8<QTYPE>::OK) {
        __trap();  // (ops.moe_matvec launches it for IQ2_XXS and Q2_K only)
    } else {
        qmoc<XInt8<QTYPE>>(W, row_bytes, expert_bytes, rows, cols, tiles, x, x_per_pair, y, bias);
    }
}

// Batches of any size in one launch: blockIdx.y takes rows 8 y .. 8 y + 7 of x (16-byte rows)
extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32)
    qmvn_b8(const u8* __restrict__ W, i64 row_bytes, int rows, int cols, const float* __restrict__ x, int n,
            float* y) {
    const int b0 = 8 * blockIdx.y;
    qmv<8, 1, 16>(W, row_bytes, rows, cols, x + (i64)b0 * cols, min(8, n - b0), nullptr, y + (i64)b0 * rows);
}

// One token through a mixture of experts in three launches (ops.moe_mlp at batch 1): qmvs_route_b1 (the
// router's logits, then its routing by the block that finishes last), qmoeg_b1 (each chosen expert's gate|up
// rows and the activation, on the tiles the routing wrote) and qmoed_b1 (the down rows of every chosen
// expert and their weighted sum into the residual), where the grouped path takes six (moe.cu).

// The router's logits as qmvs_b1_r1 makes them (a block a row, its warps sharing the row's chunks), then the
// block that finishes last routes the token (moe.cuh route_token) and writes the tiles qmoe* read: slot j is
// tile j = (expert, first pair j, 1 pair), slots in the router's order (best first). done: a counter the
// last block finds at gridDim.x - 1 and sets back to 0 for the next launch (zero when first launched).
extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32)
    qmvs_route_b1(const u8* __restrict__ W, i64 row_bytes, int rows, int cols, const float* __restrict__ x,
                  float* logits, const float* __restrict__ bias, int k, int gating, int norm, float sum_min,
                  int* ids, float* wts, int* tiles, u32* done) {
    qmv<1, 1, SplitVec<QTYPE>::VEC, false, XK_NONE, true>(W, row_bytes, rows, cols, x, 1, nullptr, logits);
    // warp 0 of every block is here as a whole (qmv's split path returns the block's other warps early)
    if ((threadIdx.x >> 5) != 0) return;
    const int lane = threadIdx.x & 31;
    u32 last = 0;
    if (lane == 0) {
        __threadfence();  // this block's logit is visible to every block before it is counted
        last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    if (!__shfl_sync(0xffffffffu, last, 0)) return;
    __threadfence();
    route_token<true>(logits, bias, 0, rows, k, gating, norm, sum_min, ids, wts);
    __syncwarp();  // lane 0's ids, for the lanes writing the tiles
    for (int j = lane; j < k; j += 32) {
        tiles[3 * j] = ids[j];
        tiles[3 * j + 1] = j;
        tiles[3 * j + 2] = 1;
    }
    if (lane == 0) *done = 0u;
}

// y[r] = res[r] + sum over slots j of wts[j] * (hs[j] . W_ids[j][r] + bias_ids[j][r]): the down projection of
// every chosen expert and the weighted sum over them (moe.cu moe_combine's, slots in order), a warp an output
// row. Each slot's dot product is qmoe_b1's, in the same order of operations (lanes over the row's units,
// chunk after chunk, then the butterfly), and the sum moe_combine's: given the same routing, the grouped
// path's result bit for bit. The chunks of every slot's row are one stream, loaded two ahead of the one
// decoded.
template <int VEC>
EMBER_DEV void qmoed(const u8* __restrict__ W, i64 row_bytes, i64 expert_bytes, int rows, int cols,
                     const int* __restrict__ ids, const float* __restrict__ wts, int k, const float* __restrict__ hs,
                     const float* res, float* y, const float* __restrict__ bias) {
    typedef QT<QTYPE> Q;
    typedef typename VecT<VEC>::T V;
    constexpr int CB = Q::CB, CHUNK = CB * Q::BYTES;
    constexpr int NVR = (CHUNK + 32 * VEC - 1) / (32 * VEC);
    __shared__ __align__(16) u8 smem[MATVEC_WARPS][NVR * 32 * VEC];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * MATVEC_WARPS + warp;
    grid_dependency_sync();  // the experts chosen, and their inputs, come from the kernels before
    if (row >= rows) return;  // the whole warp; only __syncwarp is used below
    const int nblk = cols / Q::ELEMS, nchunks = (nblk + CB - 1) / CB, total = k * nchunks;
    V buf[2][NVR];
    auto load = [&](int i, V* b) {  // chunk i of the stream: slot i / nchunks, chunk i % nchunks of its row
        const int j = i / nchunks, ch = i - j * nchunks;
        const V* src = reinterpret_cast<const V*>(W + ids[j] * expert_bytes + (i64)row * row_bytes + (i64)ch * CHUNK);
        const int bytes = min(CB, nblk - ch * CB) * Q::BYTES;
#pragma unroll
        for (int v = 0; v < NVR; ++v)
            if ((v * 32 + lane) * VEC < bytes) b[v] = __ldg(src + v * 32 + lane);
    };
    load(0, buf[0]);
    if (total > 1) load(1, buf[1]);
    float out = 0.0f, acc = 0.0f;
    for (int i = 0; i < total; ++i) {
        const int j = i / nchunks, ch = i - j * nchunks;
        const int nbc = min(CB, nblk - ch * CB), bytes = nbc * Q::BYTES;
        __syncwarp();
        V* dst = reinterpret_cast<V*>(&smem[warp][0]);
#pragma unroll
        for (int v = 0; v < NVR; ++v)
            if ((v * 32 + lane) * VEC < bytes) dst[v * 32 + lane] = buf[0][v];
        __syncwarp();
#pragma unroll
        for (int v = 0; v < NVR; ++v) buf[0][v] = buf[1][v];
        if (i + 2 < total) load(i + 2, buf[1]);
        const float* xc = hs + (i64)j * cols + (i64)ch * CB * Q::ELEMS;
        for (int u = lane; u < nbc * Q::UNITS; u += 32) {
            const int blk = u / Q::UNITS, uu = u % Q::UNITS;
            const int e = blk * Q::ELEMS + uu * 8;
            const float4 lo = __ldg(reinterpret_cast<const float4*>(xc + e));
            const float4 hi = __ldg(reinterpret_cast<const float4*>(xc + e + 4));
            const float xv[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            float xs = 0.0f;
            if (Q::HAS_MIN) {
#pragma unroll
                for (int t = 0; t < 8; ++t) xs += xv[t];
            }
            float q[8], sc, o;
            Q::template unit<Q::SMEM_A8>(&smem[warp][blk * Q::BYTES], uu, q, sc, o);
            float d = 0.0f;
#pragma unroll
            for (int t = 0; t < 8; ++t) d = fmaf(q[t], xv[t], d);
            if (Q::IS_FLOAT) acc += d;
            else if (Q::HAS_MIN) acc += sc * d - o * xs;
            else acc = fmaf(sc, d, acc);
        }
        if (ch == nchunks - 1) {  // slot j's row done: its sum (qmoe_b1's y, bias and all), weighted into out
            float dot = warp_sum(acc) + (bias ? bias[(i64)ids[j] * rows + row] : 0.0f);
            out = fmaf(wts[j], dot + 0.0f, out);
            acc = 0.0f;
        }
    }
    if (lane == 0) y[row] = out + (res ? res[row] : 0.0f);
}

extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32)
    qmoed_b1(const u8* __restrict__ W, i64 row_bytes, i64 expert_bytes, int rows, int cols,
             const int* __restrict__ ids, const float* __restrict__ wts, int k, const float* __restrict__ hs,
             const float* res, float* y, const float* __restrict__ bias) {
    qmoed<16>(W, row_bytes, expert_bytes, rows, cols, ids, wts, k, hs, res, y, bias);
}
