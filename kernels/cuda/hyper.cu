// DeepSeek V4's own pieces (worker/backends/numpy/hyper.py is the readable twin of each):
//   hc_pre       a hyper-connection's input mix, one block a token: the mix logits (the streams times the
//                mix matrix, made by a matmul before it) scaled by the streams' inverse RMS, then the
//                layer's input (the streams weighed by `pre`), and `post` and the Sinkhorn-normalised
//                `comb` that hc_merge reads; the head's mix (pre alone) too
//   hc_merge     the streams after a sublayer: stream d = post[d] * y + sum over s of comb[s, d] * stream s
//   compress_rows the compressed KV rows of whole blocks of `ratio` positions: each dimension a softmax
//                over its positions' scores weighing their values (CSA: a block also weighs the first
//                halves of the block before it)
#include "common.cuh"

#define NEG_INF_F __int_as_float(0xff800000u)

EMBER_DEV float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// x [n, hc, hidden] (token stride hc * hidden); raw [n, ldr]: the streams times the mix matrix, not yet
// normalised; scale [3] (head: [1]); base [(2 + hc) * hc] (head: [hc]). Writes y [n, hidden]; unless head,
// post [n, hc] and comb [n, hc * hc] (row s: the source stream's weights to each destination).
extern "C" __global__ void __launch_bounds__(HC_THREADS)
    hc_pre(const float* __restrict__ x, const float* __restrict__ raw, int ldr, const float* __restrict__ scale,
           const float* __restrict__ base, int n, int hc, int hidden, float eps, float hc_eps, int iters, int head,
           float* __restrict__ y, float* __restrict__ post, float* __restrict__ comb) {
    grid_dependency_sync();
    __shared__ float scratch[33];
    __shared__ float pre_s[HC_MAX];
    const int t = blockIdx.x;
    if (t >= n) return;
    const int width = hc * hidden;
    const float* xt = x + (i64)t * width;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < width; c += blockDim.x) ss = fmaf(xt[c], xt[c], ss);
    const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)width + eps);
    if (threadIdx.x == 0) {
        const float* m = raw + (i64)t * ldr;
        for (int s = 0; s < hc; ++s) pre_s[s] = sigmoidf_(m[s] * inv * scale[0] + base[s]) + hc_eps;
        if (!head) {
            for (int d = 0; d < hc; ++d)
                post[(i64)t * hc + d] = 2.0f * sigmoidf_(m[hc + d] * inv * scale[1] + base[hc + d]);
            float cm[HC_MAX][HC_MAX];  // [source][destination]
            for (int s = 0; s < hc; ++s) {  // a softmax over each source's destinations, + eps
                float mx = NEG_INF_F;
                for (int d = 0; d < hc; ++d) {
                    const int i = 2 * hc + s * hc + d;
                    cm[s][d] = m[i] * inv * scale[2] + base[i];
                    mx = fmaxf(mx, cm[s][d]);
                }
                float sum = 0.0f;
                for (int d = 0; d < hc; ++d) sum += (cm[s][d] = expf(cm[s][d] - mx));
                for (int d = 0; d < hc; ++d) cm[s][d] = cm[s][d] / sum + hc_eps;
            }
            for (int it = 0; it < max(iters, 1); ++it) {  // Sinkhorn: columns, then rows and columns
                if (it > 0) {
                    for (int s = 0; s < hc; ++s) {
                        float sum = 0.0f;
                        for (int d = 0; d < hc; ++d) sum += cm[s][d];
                        for (int d = 0; d < hc; ++d) cm[s][d] /= sum + hc_eps;
                    }
                }
                for (int d = 0; d < hc; ++d) {
                    float sum = 0.0f;
                    for (int s = 0; s < hc; ++s) sum += cm[s][d];
                    for (int s = 0; s < hc; ++s) cm[s][d] /= sum + hc_eps;
                }
            }
            for (int s = 0; s < hc; ++s)
                for (int d = 0; d < hc; ++d) comb[(i64)t * hc * hc + s * hc + d] = cm[s][d];
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < hc; ++s) acc = fmaf(pre_s[s], xt[(i64)s * hidden + c], acc);
        y[(i64)t * hidden + c] = acc;
    }
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

// Blocks b0 .. b0 + nb of `ratio` positions each: position p's value and score rows at kv + rows[p] * ld
// and score + rows[p] * ld (rows: the positions' pool rows, a block's positions consecutive in it). Width
// d of the output row; overlap (CSA): the value and score rows are 2 d wide, the block before contributing
// its first halves and this block its second. out[(b - b0) * ldo + j]; grid (ceil(d / blockDim.x), nb).
extern "C" __global__ void __launch_bounds__(HC_THREADS)
    compress_rows(const float* __restrict__ kv, const float* __restrict__ score, i64 ld, const int* __restrict__ rows,
                  int b0, int ratio, int d, int overlap, float* __restrict__ out, i64 ldo) {
    grid_dependency_sync();
    const int b = b0 + blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    // the parts: (the block before, first halves) when overlapping and b > 0; (this block, second halves)
    const int parts = overlap ? 2 : 1;
    float mx = NEG_INF_F;
    for (int part = 0; part < parts; ++part) {
        const int blk = overlap && part == 0 ? b - 1 : b, col = overlap && part == 1 ? d + j : j;
        if (blk < 0) continue;
        for (int i = 0; i < ratio; ++i) mx = fmaxf(mx, score[(i64)rows[blk * ratio + i] * ld + col]);
    }
    float sum = 0.0f, acc = 0.0f;
    for (int part = 0; part < parts; ++part) {
        const int blk = overlap && part == 0 ? b - 1 : b, col = overlap && part == 1 ? d + j : j;
        if (blk < 0) continue;
        for (int i = 0; i < ratio; ++i) {
            const i64 r = (i64)rows[blk * ratio + i] * ld + col;
            const float w = expf(score[r] - mx);
            sum += w;
            acc = fmaf(w, kv[r], acc);
        }
    }
    out[(i64)blockIdx.y * ldo + j] = acc / sum;
}
