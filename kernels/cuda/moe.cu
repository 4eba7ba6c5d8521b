// A mixture-of-experts MLP around the grouped expert matvecs (matvec.cu qmoe, qmoeg), every step on
// the device so a decode step stays one captured graph:
//   moe_route    the router's logits [n, E] -> each token's k experts, best first, and their weights
//                (moe_route_group: both steps in one block, for the few tokens of a decode step)
//   moe_group    the n k (token, slot) pairs counted by expert, placed expert by expert ("grouped
//                order"), and cut into tiles of at most T pairs of one expert: (expert, first pair,
//                pairs), tiles past the last holding 0 pairs
//   moe_gather   the grouped-order input rows: xs[q] = x[token of the pair at q]
//   moe_combine  y[t] = res[t] + sum over slots s of w[t, s] * ys[pos[t, s]], slots in order
// Within an expert the pairs' order depends on atomics, but no value does: the matvec computes each
// row of a tile on its own, in the same order of operations whatever its place in the tile.
#include "moe.cuh"

// one warp a token
// (scale: the weights' factor after normalising; table, tokens: hash routing, table[tokens[t]] the token's
// k experts; null otherwise)
extern "C" __global__ void moe_route(const float* __restrict__ logits, const float* __restrict__ bias, int n, int E,
                                     int k, int gating, int norm, float sum_min, int* __restrict__ ids,
                                     float* __restrict__ wts, float scale, const int* __restrict__ table,
                                     const int* __restrict__ tokens) {
    grid_dependency_sync();
    const int t = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    if (t < n) route_token(logits, bias, t, E, k, gating, norm, sum_min, ids, wts, scale, table, tokens);
}

// one block; tiles[3 i .. 3 i + 3) = (expert, first pair in grouped order, pairs) for i < max_tiles. The
// experts' starts and first tiles are exclusive scans of their counts, made by the first warp (a lane a run
// of experts), so no thread walks all E experts alone (the serial walk was most of a decode step's routing).
EMBER_DEV void group_pairs(const int* __restrict__ ids, int pairs, int E, int T, int max_tiles, int* __restrict__ pos,
                           int* __restrict__ order, int* __restrict__ tiles) {
    __shared__ int count[MOE_MAX_EXPERTS], start[MOE_MAX_EXPERTS], first[MOE_MAX_EXPERTS];
    __shared__ int made;
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x, per = (E + 31) / 32, e0 = lane * per;
        int c = 0, t = 0;  // this lane's experts' pairs and tiles
        for (int e = e0; e < min(E, e0 + per); ++e) c += count[e], t += (count[e] + T - 1) / T;
        int cx = c, tx = t;  // inclusive scans over the lanes
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, cx, o), b = __shfl_up_sync(0xffffffffu, tx, o);
            if (lane >= o) cx += a, tx += b;
        }
        if (lane == 31) made = min(tx, max_tiles);
        cx -= c, tx -= t;
        for (int e = e0; e < min(E, e0 + per); ++e) {
            start[e] = cx, first[e] = tx;
            cx += count[e], tx += (count[e] + T - 1) / T;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int nt = first[e];
        for (int j = 0; j < count[e] && nt < max_tiles; j += T, ++nt) {
            tiles[3 * nt] = e;
            tiles[3 * nt + 1] = start[e] + j;
            tiles[3 * nt + 2] = min(T, count[e] - j);
        }
    }
    for (int nt = made + threadIdx.x; nt < max_tiles; nt += blockDim.x)
        tiles[3 * nt] = tiles[3 * nt + 1] = tiles[3 * nt + 2] = 0;
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;  // from here: this expert's pairs placed so far
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int e = ids[p], q = start[e] + atomicAdd(&count[e], 1);
        pos[p] = q;
        order[q] = p;
    }
}

extern "C" __global__ void moe_group(const int* __restrict__ ids, int pairs, int E, int T, int max_tiles,
                                     int* __restrict__ pos, int* __restrict__ order, int* __restrict__ tiles) {
    grid_dependency_sync();
    group_pairs(ids, pairs, E, T, max_tiles, pos, order, tiles);
}

// moe_route then moe_group in one block of 1024 threads, for the few tokens of a decode step (a warp
// each): one launch fewer a layer
extern "C" __global__ void moe_route_group(const float* __restrict__ logits, const float* __restrict__ bias, int n,
                                           int E, int k, int gating, int norm, float sum_min, int* __restrict__ ids,
                                           float* __restrict__ wts, int T, int max_tiles, int* __restrict__ pos,
                                           int* __restrict__ order, int* __restrict__ tiles, float scale,
                                           const int* __restrict__ table, const int* __restrict__ tokens) {
    grid_dependency_sync();
    for (int t = threadIdx.x >> 5; t < n; t += blockDim.x >> 5)
        route_token(logits, bias, t, E, k, gating, norm, sum_min, ids, wts, scale, table, tokens);
    __syncthreads();  // the block's global writes of ids are visible to it after the barrier
    group_pairs(ids, n * k, E, T, max_tiles, pos, order, tiles);
}

// block q: row q of xs from row order[q] / k of x
extern "C" __global__ void moe_gather(const float* __restrict__ x, const int* __restrict__ order, int k, int cols,
                                      float* __restrict__ xs) {
    grid_dependency_sync();
    const int q = blockIdx.x;
    const float* src = x + (i64)(order[q] / k) * cols;
    float* dst = xs + (i64)q * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
}

// block (t, column chunk): y[t, c] = res[t, c] + sum_s w[t, s] ys[pos[t, s], c] (y may be res)
extern "C" __global__ void moe_combine(const float* __restrict__ ys, const int* __restrict__ pos,
                                       const float* __restrict__ wts, int k, int cols, const float* res, float* y) {
    grid_dependency_sync();
    const int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float acc = 0.0f;
    for (int s = 0; s < k; ++s) acc = fmaf(wts[(i64)t * k + s], ys[(i64)pos[(i64)t * k + s] * cols + c], acc);
    y[(i64)t * cols + c] = acc + (res ? res[(i64)t * cols + c] : 0.0f);
}
