// DeepSeek V4's own pieces (worker/backends/numpy/hyper.py is the readable twin of each):
//   hc_pre       a hyper-connection's input mix, one block a token: the mix logits (the streams times the
//                mix matrix, made by a matmul before it) scaled by the streams' inverse RMS, then the
//                layer's input (the streams weighed by `pre`), and `post` and the Sinkhorn-normalised
//                `comb` that hc_merge reads; the head's mix (pre alone) too
//   hc_mix_dots, hc_weigh  the same for a decode's few tokens, the mix logits' matvec within, over many blocks
//   hc_merge     the streams after a sublayer: stream d = post[d] * y + sum over s of comb[s, d] * stream s
//   compress_rows the compressed KV rows of whole blocks of `ratio` positions: each dimension a softmax
//                over its positions' scores weighing their values (CSA: a block also weighs the first
//                halves of the block before it)
//   attend_rows  attention with sinks over each query's own list of key rows (window and compressed)
//   indexer_scores, top_k_rows  the lightning indexer: each query's score of the compressed rows it
//                sees, and the k best appended to its list of key rows
//   store_rows   rows into the per-position pool at their slots (a compressor's score rows with the
//                position's bias added on the way)
//   clamped_swiglu  the experts' and the shared expert's activation, gate and up clamped at a limit
//   swap_rows    [a, b, w] -> [b, a, w]: the heads' outputs by group for the grouped output projection
//   mean_streams each token's streams averaged (a block drafter's features of the trunk)
//   round_half   floats rounded to float16 and back, in place (a block drafter's key rows, as llama.cpp's
//                drafter cache keeps them)
#include "attn_common.cuh"

EMBER_DEV float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// comb from a token's mix logits m, by one warp, lane i < hc * hc holding element (source i / hc,
// destination i % hc): a softmax over each source's destinations (+ eps), then the Sinkhorn's columns, then
// rows and columns in turn (hyper.hc_mix), each sum a butterfly of shuffles across the lanes of its row
// (lanes differing in their low bits) or its column (the high bits). hc a power of two, hc * hc <= 32.
// (A lane a row, then a lane a column, through shared memory: each step waited on its loads, its division
// and its stores one element after another, about 1,500 cycles a Sinkhorn round, 28,000 a decode mix.)
EMBER_DEV void hc_comb_lanes(const float* m, float inv, float scale, const float* base, int hc, float hc_eps,
                             int iters, float* __restrict__ comb_t) {
    const int lane = threadIdx.x & 31, n2 = hc * hc;
    const bool mine = lane < n2;  // the other lanes' rows and columns hold only other lanes past n2
    const int i = 2 * hc + lane;
    const float c0 = mine ? m[i] * inv * scale + base[i] : NEG_INF;
    float mx = c0;
    for (int o = 1; o < hc; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float e = mine ? expf(c0 - mx) : 0.0f;
    float sum = e;
    for (int o = 1; o < hc; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    float c = mine ? e / sum + hc_eps : 0.0f;
    for (int it = 0; it < max(iters, 1); ++it) {
        if (it > 0) {  // rows
            float r = c;
            for (int o = 1; o < hc; o <<= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
            c = c / (r + hc_eps);
        }
        float col = c;
        for (int o = hc; o < n2; o <<= 1) col += __shfl_xor_sync(0xffffffffu, col, o);
        c = c / (col + hc_eps);
    }
    if (mine) comb_t[lane] = c;
}

// From a token's mix logits m (not yet normalised) and the streams' inverse RMS inv: pre_s (shared) the
// streams' input weights; unless head, post and comb (row s: the source stream's weights to each
// destination), Sinkhorn-normalised by the block's first warp: hc_comb_lanes where hc allows, else a lane
// a row, then a lane a column, in the shared cm. Every thread of the block calls it; pre_s is ready after
// its first barrier.
EMBER_DEV void hc_coefficients(const float* m, float inv, const float* scale, const float* base, int hc,
                               float hc_eps, int iters, int head, int t, float* pre_s, float* cm,
                               float* __restrict__ post, float* __restrict__ comb) {
    const int tid = threadIdx.x;
    if (tid < hc) pre_s[tid] = sigmoidf_(m[tid] * inv * scale[0] + base[tid]) + hc_eps;
    __syncthreads();
    if (head || tid >= 32) return;
    if (tid < hc) post[(i64)t * hc + tid] = 2.0f * sigmoidf_(m[hc + tid] * inv * scale[1] + base[hc + tid]);
    if ((hc & (hc - 1)) == 0 && hc * hc <= 32) {
        hc_comb_lanes(m, inv, scale[2], base, hc, hc_eps, iters, comb + (i64)t * hc * hc);
        return;
    }
    if (tid < hc) {  // lane s: a softmax over source s's destinations, + eps
        const int s = tid;
        float mx = NEG_INF;
        for (int d = 0; d < hc; ++d) {
            const int i = 2 * hc + s * hc + d;
            cm[s * hc + d] = m[i] * inv * scale[2] + base[i];
            mx = fmaxf(mx, cm[s * hc + d]);
        }
        float sum = 0.0f;
        for (int d = 0; d < hc; ++d) sum += (cm[s * hc + d] = expf(cm[s * hc + d] - mx));
        for (int d = 0; d < hc; ++d) cm[s * hc + d] = cm[s * hc + d] / sum + hc_eps;
    }
    __syncwarp();
    for (int it = 0; it < max(iters, 1); ++it) {  // Sinkhorn: columns, then rows and columns
        if (it > 0) {
            if (tid < hc) {  // lane s: row s
                float sum = 0.0f;
                for (int d = 0; d < hc; ++d) sum += cm[tid * hc + d];
                for (int d = 0; d < hc; ++d) cm[tid * hc + d] /= sum + hc_eps;
            }
            __syncwarp();
        }
        if (tid < hc) {  // lane d: column d
            float sum = 0.0f;
            for (int s = 0; s < hc; ++s) sum += cm[s * hc + tid];
            for (int s = 0; s < hc; ++s) cm[s * hc + tid] /= sum + hc_eps;
        }
        __syncwarp();
    }
    for (int i = tid; i < hc * hc; i += 32) comb[(i64)t * hc * hc + i] = cm[i];
}

// x [n, hc, hidden] (token stride hc * hidden); raw [n, ldr]: the streams times the mix matrix, not yet
// normalised; scale [3] (head: [1]); base [(2 + hc) * hc] (head: [hc]). Writes y [n, hidden]; unless head,
// post [n, hc] and comb [n, hc * hc] (hc_coefficients). One block a token: the many-token form (a prefill,
// whose mix logits a tensor-core matmul makes); a decode's few tokens take hc_mix_dots and hc_weigh.
extern "C" __global__ void __launch_bounds__(HC_THREADS)
    hc_pre(const float* __restrict__ x, const float* __restrict__ raw, int ldr, const float* __restrict__ scale,
           const float* __restrict__ base, int n, int hc, int hidden, float eps, float hc_eps, int iters, int head,
           float* __restrict__ y, float* __restrict__ post, float* __restrict__ comb) {
    grid_dependency_sync();
    __shared__ float scratch[33];
    __shared__ float pre_s[HC_MAX];
    __shared__ float cm[HC_MAX * HC_MAX];  // [source][destination]
    const int t = blockIdx.x, tid = threadIdx.x;
    if (t >= n) return;
    const int width = hc * hidden;
    const float* xt = x + (i64)t * width;
    // one block reads a token's hc * hidden floats: four at a time and four loads in flight a thread (a
    // load at a time, the sum of squares alone waited on 64 of them at DeepSeek V4's sizes)
    const bool vec = (hidden & 3) == 0 && (((unsigned long long)x | (unsigned long long)y) & 15) == 0;
    float ss = 0.0f;
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xt);
#pragma unroll 4
        for (int c = tid; c < width / 4; c += blockDim.x) {
            const float4 v = x4[c];
            ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
        }
    } else {
        for (int c = tid; c < width; c += blockDim.x) ss = fmaf(xt[c], xt[c], ss);
    }
    const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)width + eps);
    hc_coefficients(raw + (i64)t * ldr, inv, scale, base, hc, hc_eps, iters, head, t, pre_s, cm, post, comb);
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xt);
        float4* y4 = reinterpret_cast<float4*>(y + (i64)t * hidden);
        const int h4 = hidden / 4;
#pragma unroll 2
        for (int c = tid; c < h4; c += blockDim.x) {
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int s = 0; s < hc; ++s) {
                const float4 v = x4[(i64)s * h4 + c];
                const float p = pre_s[s];
                acc = make_float4(fmaf(p, v.x, acc.x), fmaf(p, v.y, acc.y), fmaf(p, v.z, acc.z), fmaf(p, v.w, acc.w));
            }
            y4[c] = acc;
        }
    } else {
        for (int c = tid; c < hidden; c += blockDim.x) {
            float acc = 0.0f;
            for (int s = 0; s < hc; ++s) acc = fmaf(pre_s[s], xt[(i64)s * hidden + c], acc);
            y[(i64)t * hidden + c] = acc;
        }
    }
}

// Many tokens' mix logits (a prefill's, for hc_pre): out [n, ldo] = x [n, K] (row stride ldx) times fn
// [m, K] (row stride ldf) transposed, float32 throughout. A block takes HCL_TOKENS tokens and HCL_ROWS of
// the m rows (grid.y covers the rest): K in chunks of HCL_K staged through shared memory, the next chunk's
// loads in flight while this one's products are summed; a thread sums two rows of one token, over k in
// order. (The staged matvec took 8 tokens a launch over 24 rows, 6 blocks: 226 us a launch, 256 launches a
// 2,048-token mix, 85% of that prefill.)
#define HCL_K 128
static_assert(HC_THREADS == HCL_TOKENS * HCL_ROWS / 2, "a thread two rows of one token");
extern "C" __global__ void __launch_bounds__(HC_THREADS)
    hc_logits(const float* __restrict__ x, i64 ldx, const float* __restrict__ fn, i64 ldf, int n, int m, int K,
              float* __restrict__ out, int ldo) {
    constexpr int XL = HCL_TOKENS * HCL_K / HC_THREADS, FL = HCL_ROWS * HCL_K / HC_THREADS;  // loads a thread
    __shared__ float xs[HCL_TOKENS][HCL_K];
    __shared__ float fs[HCL_ROWS][HCL_K + 1];  // + 1: a warp's 16 rows fall in different banks
    const int tid = threadIdx.x, t0 = blockIdx.x * HCL_TOKENS, r0 = blockIdx.y * HCL_ROWS;
    const int tt = tid / (HCL_ROWS / 2), rr = tid % (HCL_ROWS / 2);
    float xv[XL], fv[FL];
    auto load = [&](int k0) {
#pragma unroll
        for (int i = 0; i < XL; ++i) {
            const int e = tid + i * HC_THREADS, a = e / HCL_K, k = k0 + e % HCL_K;
            xv[i] = t0 + a < n && k < K ? x[(i64)(t0 + a) * ldx + k] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < FL; ++i) {
            const int e = tid + i * HC_THREADS, a = e / HCL_K, k = k0 + e % HCL_K;
            fv[i] = r0 + a < m && k < K ? fn[(i64)(r0 + a) * ldf + k] : 0.0f;
        }
    };
    load(0);  // the first chunk of the weights may go before the wait: x's may not
    grid_dependency_sync();
#pragma unroll
    for (int i = 0; i < XL; ++i) {
        const int e = tid + i * HC_THREADS, a = e / HCL_K, k = e % HCL_K;
        xv[i] = t0 + a < n && k < K ? x[(i64)(t0 + a) * ldx + k] : 0.0f;
    }
    float acc0 = 0.0f, acc1 = 0.0f;
    for (int k0 = 0; k0 < K; k0 += HCL_K) {
        __syncthreads();  // the last chunk's readers are done
#pragma unroll
        for (int i = 0; i < XL; ++i) {
            const int e = tid + i * HC_THREADS;
            xs[e / HCL_K][e % HCL_K] = xv[i];
        }
#pragma unroll
        for (int i = 0; i < FL; ++i) {
            const int e = tid + i * HC_THREADS;
            fs[e / HCL_K][e % HCL_K] = fv[i];
        }
        __syncthreads();
        if (k0 + HCL_K < K) load(k0 + HCL_K);
#pragma unroll 16
        for (int k = 0; k < HCL_K; ++k) {
            const float xk = xs[tt][k];
            acc0 = fmaf(xk, fs[rr][k], acc0);
            acc1 = fmaf(xk, fs[rr + HCL_ROWS / 2][k], acc1);
        }
    }
    const int t = t0 + tt;
    if (t < n && r0 + rr < m) out[(i64)t * ldo + r0 + rr] = acc0;
    if (t < n && r0 + rr + HCL_ROWS / 2 < m) out[(i64)t * ldo + r0 + rr + HCL_ROWS / 2] = acc1;
}

// A few tokens' mix, first half: the mix logits (x [n, hc * hidden] times fn [m, hc * hidden] float32,
// row stride ldf, transposed) and the streams' sum of squares, without the matvec's launch and over many
// blocks (one a token, hc_pre waited on its 64 KB of streams; the matvec's m = 24 rows were 24 blocks). Grid
// (ceil(hidden / HCM_THREADS), n): a thread a column of every stream, so a block's loads of fn and x are
// coalesced; each block's m + 1 sums go to part [n, gridDim.x, m + 1], and the last block of a token (count
// [n], put back to 0) adds them up and makes pre [n, hc], post and comb as hc_pre does. hc_weigh then
// weighs the streams by pre.
extern "C" __global__ void __launch_bounds__(HCM_THREADS)
    hc_mix_dots(const float* __restrict__ x, const float* __restrict__ fn, i64 ldf, const float* __restrict__ scale,
                const float* __restrict__ base, int n, int hc, int hidden, float eps, float hc_eps, int iters,
                int head, float* part, u32* count, float* __restrict__ pre, float* __restrict__ post,
                float* __restrict__ comb) {
    constexpr int MIX_MAX = (2 + HC_MAX) * HC_MAX + 1;
    static_assert(MIX_MAX <= HCM_THREADS, "a thread a mix logit's base");
    const int m = head ? hc : (2 + hc) * hc, tid = threadIdx.x;
    // what depends on no earlier kernel, while it finishes: this block's columns of the mix weights into L2,
    // and the biases and scales the last block reads (kept in registers, later in shared memory)
    const int c0 = blockIdx.x * HCM_THREADS, bytes = 4 * min(HCM_THREADS, hidden - c0);
    for (int i = tid; blockIdx.y == 0 && i < m * hc; i += blockDim.x) {
        const float* p = fn + (i / hc) * ldf + (i64)(i % hc) * hidden + c0;
        if ((reinterpret_cast<u64>(p) & 15) == 0 && bytes % 16 == 0) l2_prefetch(p, bytes);
    }
    const float my_base = tid < m ? base[tid] : 0.0f, my_scale = tid < (head ? 1 : 3) ? scale[tid] : 0.0f;
    grid_dependency_sync();
    __shared__ float red[HCM_THREADS / 32][MIX_MAX];
    __shared__ float msum[MIX_MAX], base_s[MIX_MAX], scale_s[3];
    __shared__ float pre_s[HC_MAX];
    __shared__ float cm[HC_MAX * HC_MAX];
    __shared__ bool last;
    const int t = blockIdx.y, lane = tid & 31, warp = tid >> 5;
    if (t >= n) return;
    const int c = blockIdx.x * HCM_THREADS + tid, blocks = gridDim.x;
    const float* xt = x + (i64)t * hc * hidden;
    float xv[HC_MAX];
#pragma unroll
    for (int s = 0; s < HC_MAX; ++s) xv[s] = s < hc && c < hidden ? xt[(i64)s * hidden + c] : 0.0f;
    for (int r0 = 0; r0 <= m; r0 += 8) {  // rows r0 .. r0 + 7 of the m + 1 sums (the last: the squares')
        float acc[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int r = r0 + u;
            acc[u] = 0.0f;
            if (c < hidden && r < m) {
#pragma unroll
                for (int s = 0; s < HC_MAX; ++s)
                    if (s < hc) acc[u] = fmaf(fn[r * ldf + (i64)s * hidden + c], xv[s], acc[u]);
            } else if (r == m) {
#pragma unroll
                for (int s = 0; s < HC_MAX; ++s) acc[u] = fmaf(xv[s], xv[s], acc[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const float v = warp_sum(acc[u]);
            if (lane == 0 && r0 + u <= m) red[warp][r0 + u] = v;
        }
    }
    __syncthreads();
    float* mine = part + ((i64)t * blocks + blockIdx.x) * (m + 1);
    for (int r = tid; r <= m; r += HCM_THREADS) {
        float v = 0.0f;
        for (int w = 0; w < HCM_THREADS / 32; ++w) v += red[w][r];
        mine[r] = v;
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(count + t, 1u) == (u32)blocks - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* all = part + (i64)t * blocks * (m + 1);
    for (int r = tid; r <= m; r += HCM_THREADS) {  // in block order, 8 loads in flight at a time
        float v = 0.0f;
        for (int b0 = 0; b0 < blocks; b0 += 8) {
            float p[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) p[u] = b0 + u < blocks ? __ldcg(all + (i64)(b0 + u) * (m + 1) + r) : 0.0f;
#pragma unroll
            for (int u = 0; u < 8; ++u) v += p[u];
        }
        msum[r] = v;
    }
    if (tid < m) base_s[tid] = my_base;
    if (tid < 3) scale_s[tid] = my_scale;
    __syncthreads();
    const float inv = 1.0f / sqrtf(msum[m] / (float)(hc * hidden) + eps);
    hc_coefficients(msum, inv, scale_s, base_s, hc, hc_eps, iters, head, t, pre_s, cm, post, comb);
    if (tid < hc) pre[(i64)t * hc + tid] = pre_s[tid];
    if (tid == 0) count[t] = 0u;  // ready for the next launch (a graph's replay)
}

// The second half: y [n, hidden] = the streams x [n, hc, hidden] weighed by pre [n, hc]. Grid
// (ceil(hidden / HC_THREADS), n), a thread a column.
extern "C" __global__ void __launch_bounds__(HC_THREADS)
    hc_weigh(const float* __restrict__ x, const float* __restrict__ pre, int n, int hc, int hidden,
             float* __restrict__ y) {
    grid_dependency_sync();
    const int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n || c >= hidden) return;
    const float* xt = x + (i64)t * hc * hidden + c;
    float acc = 0.0f;
    for (int s = 0; s < hc; ++s) acc = fmaf(pre[(i64)t * hc + s], xt[(i64)s * hidden], acc);
    y[(i64)t * hidden + c] = acc;
}

// x [n, hc, hidden] in place; y [n, hidden]; grid (ceil(hidden / blockDim.x), n): a thread a column
extern "C" __global__ void __launch_bounds__(HC_THREADS)
    hc_merge(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ post,
             const float* __restrict__ comb, int n, int hc, int hidden) {
    grid_dependency_sync();
    const int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n || c >= hidden) return;
    float* xt = x + (i64)t * hc * hidden + c;
    const float* ct = comb + (i64)t * hc * hc;
    float xs[HC_MAX];
    for (int s = 0; s < hc; ++s) xs[s] = xt[(i64)s * hidden];
    const float yc = y[(i64)t * hidden + c];
    for (int d = 0; d < hc; ++d) {
        float acc = post[(i64)t * hc + d] * yc;
        for (int s = 0; s < hc; ++s) acc = fmaf(xs[s], ct[s * hc + d], acc);
        xt[(i64)d * hidden] = acc;
    }
}

// nb compressed rows, each of a block of `ratio` positions: position p's value and score rows at
// kv + rows[p] * ld and score + rows[p] * ld (rows: pool rows, a block's positions consecutive in it).
// Output row b's block starts at rows[starts[2 b]]; overlap (CSA): the value and score rows are 2 d wide,
// this block contributing their second halves and the block before it (starting at rows[starts[2 b + 1]],
// -1: none) their first. So one launch serves the blocks of several sequences, each its own rows.
// out[b * ldo + j], j < d; grid (ceil(d / blockDim.x), nb).
extern "C" __global__ void __launch_bounds__(HC_THREADS)
    compress_rows(const float* __restrict__ kv, const float* __restrict__ score, i64 ld, const int* __restrict__ rows,
                  const int* __restrict__ starts, int ratio, int d, int overlap, float* __restrict__ out, i64 ldo) {
    grid_dependency_sync();
    const int b = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    // the parts: (the block before, first halves) when overlapping and it exists; (this block, second halves)
    const int parts = overlap ? 2 : 1;
    float mx = NEG_INF;
    for (int part = 0; part < parts; ++part) {
        const int at = starts[2 * b + (overlap && part == 0)], col = overlap && part == 1 ? d + j : j;
        if (at < 0) continue;
        for (int i = 0; i < ratio; ++i) mx = fmaxf(mx, score[(i64)rows[at + i] * ld + col]);
    }
    float sum = 0.0f, acc = 0.0f;
    for (int part = 0; part < parts; ++part) {
        const int at = starts[2 * b + (overlap && part == 0)], col = overlap && part == 1 ? d + j : j;
        if (at < 0) continue;
        for (int i = 0; i < ratio; ++i) {
            const i64 r = (i64)rows[at + i] * ld + col;
            const float w = expf(score[r] - mx);
            sum += w;
            acc = fmaf(w, kv[r], acc);
        }
    }
    out[(i64)b * ldo + j] = acc / sum;
}

// Attention of query rows over chosen key rows, the single KV head being key and value at once, a learned
// sink logit per head joining each softmax's denominator (hyper.attend). Query t's keys are the pool rows
// idx[t * ldi + j] for j < cnt[t] (-1: none, skipped): its window's rows and the compressed rows it sees
// (or the indexer picked), gathered by the caller. q [n, heads, d <= ATTS_MAX_D, d % 4 == 0]; out
// likewise; keys [rows, ld] of KT (ld % 4 == 0). A block a (token, head, split). A lane holds the
// query's columns 4 * lane + 128 * k (k < ATTS_C4) in registers, so a warp reads a key row in ATTS_C4
// 16-byte (f32) or 8-byte (f16) loads a lane; a warp takes ATTS_UNROLL keys at a time, every load of
// them issued before the first is used, and keeps an online softmax (its max, its sum, the weighted sum
// of its rows) over the keys it takes, so each key row is read once. The warps' states then merge in
// shared memory. (One key's columns a lane at a stride of 32, with a break at d, made a warp's loads of a
// key one after another: about 60 L2 latencies a block, 22 us a launch whatever its keys.)
// A decode step has a block a head alone (64 blocks at batch 1), each walking all its keys: so there the
// keys are split over `splits` blocks, each leaving its (max, sum, weighted rows) in `part`, and the last
// of them to finish (a count a (token, head), which it puts back to 0) merges them with the sink, as a
// flash-decoding pass does.
#define ATTS_C4 (ATTS_MAX_D / 128)
static_assert(ATTS_MAX_D % 128 == 0, "a lane holds 4 columns in each 128");
#define ATTS_UNROLL 4
#define ATTS_WARPS (HC_THREADS / 32)
template <typename KT>
EMBER_DEV void attend_rows(const float* __restrict__ q, const KT* __restrict__ keys, i64 ld,
                           const int* __restrict__ idx, int ldi, const int* __restrict__ cnt,
                           const float* __restrict__ sinks, int n, int heads, int d, float scale,
                           float* __restrict__ out, int splits, float* part_buf, u32* count) {
    grid_dependency_sync();
    __shared__ float part[ATTS_WARPS][ATTS_MAX_D];
    __shared__ float warp_mx[ATTS_WARPS], warp_l[ATTS_WARPS];
    __shared__ bool last;
    const int t = blockIdx.y, h = blockIdx.x, split = blockIdx.z;
    if (t >= n) return;
    const int all = min(cnt[t], ATTS_MAX_KEYS), per = (all + splits - 1) / splits;
    const int j_lo = min(all, split * per), m = min(all, j_lo + per) - j_lo;  // this block's keys
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* qt = q + ((i64)t * heads + h) * d;
    const int* it = idx + (i64)t * ldi + j_lo;
    float qr[ATTS_C4][4], acc[ATTS_C4][4];
#pragma unroll
    for (int k = 0; k < ATTS_C4; ++k) {
        const int c = 4 * lane + 128 * k;
        if (c < d) load_vals<4>(qt + c, qr[k]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (c >= d) qr[k][e] = 0.0f;
            acc[k][e] = 0.0f;
        }
    }
    float mx = NEG_INF, l = 0.0f;  // this warp's online softmax
    for (int j0 = warp * ATTS_UNROLL; j0 < m; j0 += ATTS_WARPS * ATTS_UNROLL) {
        int r[ATTS_UNROLL];
        float v[ATTS_UNROLL][ATTS_C4][4];
#pragma unroll
        for (int u = 0; u < ATTS_UNROLL; ++u) r[u] = j0 + u < m ? it[j0 + u] : -1;
#pragma unroll
        for (int u = 0; u < ATTS_UNROLL; ++u)
#pragma unroll
            for (int k = 0; k < ATTS_C4; ++k) {
                const int c = 4 * lane + 128 * k;
                if (r[u] >= 0 && c < d) load_vals<4>(keys + (i64)r[u] * ld + c, v[u][k]);
                else v[u][k][0] = v[u][k][1] = v[u][k][2] = v[u][k][3] = 0.0f;
            }
        float s[ATTS_UNROLL], top = mx;
#pragma unroll
        for (int u = 0; u < ATTS_UNROLL; ++u) {
            float dot = 0.0f;
#pragma unroll
            for (int k = 0; k < ATTS_C4; ++k)
#pragma unroll
                for (int e = 0; e < 4; ++e) dot = fmaf(qr[k][e], v[u][k][e], dot);
            s[u] = r[u] >= 0 ? warp_sum(dot) * scale : NEG_INF;
            top = fmaxf(top, s[u]);
        }
        if (top == NEG_INF) continue;  // no key here yet (the same on every lane)
        const float keep = expf(mx - top);  // 0 while mx is -inf
        l *= keep;
#pragma unroll
        for (int k = 0; k < ATTS_C4; ++k)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[k][e] *= keep;
#pragma unroll
        for (int u = 0; u < ATTS_UNROLL; ++u) {
            const float p = expf(s[u] - top);  // 0 for an empty slot
            l += p;
#pragma unroll
            for (int k = 0; k < ATTS_C4; ++k)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[k][e] = fmaf(p, v[u][k][e], acc[k][e]);
        }
        mx = top;
    }
#pragma unroll
    for (int k = 0; k < ATTS_C4; ++k) {
        const int c = 4 * lane + 128 * k;
        if (c < d)
#pragma unroll
            for (int e = 0; e < 4; ++e) part[warp][c + e] = acc[k][e];
    }
    if (lane == 0) warp_mx[warp] = mx, warp_l[warp] = l;
    __syncthreads();
    // the block's max (with the sink where there is no merge after), each warp's weight under it
    float top = splits == 1 ? sinks[h] : NEG_INF, denom = 0.0f, wgt[ATTS_WARPS];
#pragma unroll
    for (int w = 0; w < ATTS_WARPS; ++w)
        if (warp_l[w] > 0.0f) top = fmaxf(top, warp_mx[w]);
#pragma unroll
    for (int w = 0; w < ATTS_WARPS; ++w) {
        wgt[w] = warp_l[w] > 0.0f ? expf(warp_mx[w] - top) : 0.0f;  // a warp of no keys: weight 0, never NaN
        denom += warp_l[w] * wgt[w];
    }
    float* ot = out + ((i64)t * heads + h) * d;
    if (splits == 1) {
        const float inv = 1.0f / (denom + expf(sinks[h] - top));
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float total = 0.0f;
#pragma unroll
            for (int w = 0; w < ATTS_WARPS; ++w) total = fmaf(part[w][c], wgt[w], total);
            ot[c] = total * inv;
        }
        return;
    }
    // this split's share: its max, its sum, its weighted rows; then the last split merges them all
    float* mine = part_buf + (((i64)t * heads + h) * splits + split) * (d + 2);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTS_WARPS; ++w) total = fmaf(part[w][c], wgt[w], total);
        mine[2 + c] = total;
    }
    if (threadIdx.x == 0) mine[0] = top, mine[1] = denom;
    __threadfence();
    __syncthreads();
    u32* counter = count + (i64)t * heads + h;
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == (u32)splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* shares = part_buf + ((i64)t * heads + h) * splits * (d + 2);
    top = sinks[h];
    for (int s = 0; s < splits; ++s) top = fmaxf(top, __ldcg(shares + s * (d + 2)));
    denom = expf(sinks[h] - top);
    for (int s = 0; s < splits; ++s) {  // a split of no keys: sum 0, max -inf (weight 0, never NaN)
        const float ls = __ldcg(shares + s * (d + 2) + 1);
        if (ls > 0.0f) denom += ls * expf(__ldcg(shares + s * (d + 2)) - top);
    }
    const float inv = 1.0f / denom;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float total = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float ls = __ldcg(shares + s * (d + 2) + 1);
            if (ls > 0.0f) total += __ldcg(shares + s * (d + 2) + 2 + c) * expf(__ldcg(shares + s * (d + 2)) - top);
        }
        ot[c] = total * inv;
    }
    if (threadIdx.x == 0) *counter = 0u;  // ready for the next launch (a graph's replay)
}

#define ATTEND_ROWS(NAME, KT)                                                                                 \
    extern "C" __global__ void __launch_bounds__(HC_THREADS)                                               \
        NAME(const float* __restrict__ q, const KT* __restrict__ keys, i64 ld, const int* __restrict__ idx, \
             int ldi, const int* __restrict__ cnt, const float* __restrict__ sinks, int n, int heads, int d,  \
             float scale, float* __restrict__ out, int splits, float* part, u32* count) {                   \
        attend_rows<KT>(q, keys, ld, idx, ldi, cnt, sinks, n, heads, d, scale, out, splits, part, count);   \
    }
ATTEND_ROWS(attend_rows_f32, float)
ATTEND_ROWS(attend_rows_f16, f16_t)

// The lightning indexer's score of query t for each compressed indexer row it sees (hyper._indexer_pick):
// sum over the indexer's heads h of w[t, h] * relu(q[t, h] . key). The rows are keys + crow[t, j] * ld for
// j < ccnt[t]; score [n, ldc]. q [n, heads, di] is read from shared memory (heads * di <= IDX_MAX_Q). A warp
// a row: each lane holds di / 32 of its dimensions. grid (ceil(ldc / warps), n).
template <typename KT>
EMBER_DEV void indexer_scores_rows(const float* __restrict__ q, const float* __restrict__ w,
                                   const KT* __restrict__ keys, i64 ld, const int* __restrict__ crow, int ldc,
                                   const int* __restrict__ ccnt, int n, int heads, int di,
                                   float* __restrict__ score) {
    grid_dependency_sync();
    __shared__ float qs[IDX_MAX_Q];
    const int t = blockIdx.y;
    if (t >= n) return;
    for (int i = threadIdx.x; i < heads * di; i += blockDim.x) qs[i] = q[(i64)t * heads * di + i];
    __syncthreads();
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int j = blockIdx.x * warps + (threadIdx.x >> 5);
    if (j >= ccnt[t] || j >= ldc) return;
    const KT* kr = keys + (i64)crow[(i64)t * ldc + j] * ld;
    float kv[IDX_MAX_DIM / 32];
#pragma unroll
    for (int i = 0; i < IDX_MAX_DIM / 32; ++i) kv[i] = lane + 32 * i < di ? to_f32(kr[lane + 32 * i]) : 0.0f;
    float s = 0.0f;
    for (int h = 0; h < heads; ++h) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < IDX_MAX_DIM / 32; ++i)
            if (lane + 32 * i < di) dot = fmaf(qs[h * di + lane + 32 * i], kv[i], dot);
        dot = warp_sum(dot);
        s = fmaf(w[(i64)t * heads + h], fmaxf(dot, 0.0f), s);
    }
    if (lane == 0) score[(i64)t * ldc + j] = s;
}

#define INDEXER_SCORES(NAME, KT)                                                                              \
    extern "C" __global__ void __launch_bounds__(HC_THREADS)                                               \
        NAME(const float* __restrict__ q, const float* __restrict__ w, const KT* __restrict__ keys, i64 ld,    \
             const int* __restrict__ crow, int ldc, const int* __restrict__ ccnt, int n, int heads, int di,     \
             float* __restrict__ score) {                                                                   \
        indexer_scores_rows<KT>(q, w, keys, ld, crow, ldc, ccnt, n, heads, di, score);                      \
    }
INDEXER_SCORES(indexer_scores_f32, float)
INDEXER_SCORES(indexer_scores_f16, f16_t)

// A float's order as an unsigned key: larger float, larger key
EMBER_DEV u32 order_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The k best of query t's scores score[t, j < ccnt[t]] appended to its attention list: their rows
// crow[t, j] go to idx[t, cnt[t] ..] and cnt[t] grows by min(k, ccnt[t]). Those above the k-th value in
// any order; of those equal to it, the first by j. The k-th value by a radix select over the scores'
// order keys (four passes of 8 bits). A block a query; grid (n).
extern "C" __global__ void __launch_bounds__(HC_THREADS)
    top_k_rows(const float* __restrict__ score, const int* __restrict__ crow, int ldc, const int* __restrict__ ccnt,
               int k, int* __restrict__ idx, int ldi, int* __restrict__ cnt, int n) {
    grid_dependency_sync();
    __shared__ u32 hist[256];
    __shared__ u32 prefix_s, want_s, above_s, ties_s;
    __shared__ u32 warp_ties[HC_THREADS / 32];
    const int t = blockIdx.x;
    if (t >= n) return;
    const int m = min(ccnt[t], ldc), base = cnt[t];
    const float* st = score + (i64)t * ldc;
    const int* rt = crow + (i64)t * ldc;
    int* out = idx + (i64)t * ldi + base;
    const int take = min(k, m);
    __syncthreads();  // every thread has read cnt[t] before thread 0 moves it
    if (take == m) {  // all of them
        for (int j = threadIdx.x; j < m; j += blockDim.x) out[j] = rt[j];
        if (threadIdx.x == 0) cnt[t] = base + m;
        return;
    }
    u32 prefix = 0, mask = 0, want = (u32)k;  // want: how many of those matching prefix are still to take
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int j = threadIdx.x; j < m; j += blockDim.x) {
            const u32 key = order_key(st[j]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 above = 0;
            int b = 255;
            for (; b > 0 && above + hist[b] < want; --b) above += hist[b];
            prefix_s = prefix | ((u32)b << shift);
            want_s = want - above;
        }
        __syncthreads();
        prefix = prefix_s;
        want = want_s;
        mask |= 255u << shift;
        __syncthreads();
    }
    // prefix: the k-th largest key; k - want keys lie above it, and `want` of those equal to it are taken
    if (threadIdx.x == 0) above_s = ties_s = 0;
    __syncthreads();
    const u32 kth = prefix, above_n = (u32)k - want;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int j0 = 0; j0 < m; j0 += blockDim.x) {
        const int j = j0 + threadIdx.x;
        const u32 key = j < m ? order_key(st[j]) : 0u;
        if (j < m && key > kth) out[atomicAdd(&above_s, 1u)] = rt[j];
        const bool tie = j < m && key == kth;
        const u32 ballot = __ballot_sync(0xffffffffu, tie);
        if (lane == 0) warp_ties[warp] = __popc(ballot);
        __syncthreads();
        u32 before = ties_s;
        for (int w2 = 0; w2 < warp; ++w2) before += warp_ties[w2];
        before += __popc(ballot & ((1u << lane) - 1u));
        if (tie && before < want) out[above_n + before] = rt[j];
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 all = 0;
            for (int w2 = 0; w2 < (int)(blockDim.x >> 5); ++w2) all += warp_ties[w2];
            ties_s += all;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) cnt[t] = base + k;
}

// dst[idx[t] * ldd + c] = src[t * lds + c] (+ ape[(pos[t] % ratio) * w + c] where ape is given), c < w:
// a step's per-position rows into the pool at their slots (hyper.HyperStack._attention's `rows[slots, ...] =`),
// a compressor's score rows with their position-in-block bias. grid (ceil(w / blockDim.x), min(n, 65535)):
// a block takes rows y, y + gridDim.y, ... (the MTP layer's copies are n * hc rows, past the grid's 65535).
extern "C" __global__ void __launch_bounds__(HC_THREADS)
    store_rows(const float* __restrict__ src, i64 lds, const int* __restrict__ idx, float* __restrict__ dst, i64 ldd,
               int n, int w, const float* __restrict__ ape, const int* __restrict__ pos, int ratio) {
    grid_dependency_sync();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= w) return;
    for (int t = blockIdx.y; t < n; t += gridDim.y) {
        float v = src[(i64)t * lds + c];
        if (ape != nullptr) v += ape[(i64)(pos[t] % ratio) * w + c];
        dst[(i64)idx[t] * ldd + c] = v;
    }
}

// out = silu(min(g, limit)) * clamp(u, -limit, limit) over [n, F] (limit <= 1e-6: no clamp), row strides
// ldg, ldu, ldo: DeepSeek V4's experts and shared expert (hyper.clamped_swiglu).
extern "C" __global__ void __launch_bounds__(HC_THREADS)
    clamped_swiglu(const float* __restrict__ g, i64 ldg, const float* __restrict__ u, i64 ldu, float* __restrict__ out,
                   i64 ldo, int n, int F, float limit) {
    grid_dependency_sync();
    const i64 total = (i64)n * F;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / F, c = i % F;
        float gv = g[r * ldg + c], uv = u[r * ldu + c];
        if (limit > 1e-6f) {
            gv = fminf(gv, limit);
            uv = fminf(fmaxf(uv, -limit), limit);
        }
        out[r * ldo + c] = gv / (1.0f + expf(-gv)) * uv;
    }
}

// dst [b, a, w] = src [a, b, w] transposed in its first two dimensions. grid (ceil(w / blockDim.x),
// min(a * b, 65535)): a block takes rows y, y + gridDim.y, ... (a prefill's n * groups rows pass 65535).
extern "C" __global__ void __launch_bounds__(HC_THREADS)
    swap_rows(const float* __restrict__ src, float* __restrict__ dst, int a, int b, int w) {
    grid_dependency_sync();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= w) return;
    for (int r = blockIdx.y; r < a * b; r += gridDim.y) {
        const int i = r / b, j = r % b;
        dst[((i64)j * a + i) * w + c] = src[(i64)r * w + c];
    }
}

// out[t, c] = mean over s of x[t, s, c], x [n, hc, hidden] (token stride hc * hidden), out at row stride ldo.
// grid (ceil(hidden / blockDim.x), n).
extern "C" __global__ void __launch_bounds__(HC_THREADS)
    mean_streams(const float* __restrict__ x, int n, int hc, int hidden, float* __restrict__ out, i64 ldo) {
    grid_dependency_sync();
    const int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n || c >= hidden) return;
    const float* row = x + (i64)t * hc * hidden + c;
    float sum = 0.0f;
    for (int s = 0; s < hc; s++) sum += row[(i64)s * hidden];
    out[(i64)t * ldo + c] = sum / (float)hc;
}

// x[i] = the float16 nearest x[i] (round to nearest even), as a float, for i < n.
extern "C" __global__ void round_half(float* x, i64 n) {
    grid_dependency_sync();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        x[i] = h2f(f2h(x[i]));
}
