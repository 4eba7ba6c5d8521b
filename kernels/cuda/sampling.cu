// Sampling helpers on the device: argmax (greedy decoding) and a row softmax with temperature.
#include "common.cuh"

// out_idx[r] = first index of the largest value of row r (numpy.argmax's tie rule); one block per row.
extern "C" __global__ void argmax_f32(const float* __restrict__ x, i64 ld, int V, int* __restrict__ out_idx,
                                      float* __restrict__ out_val) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* xr = x + (i64)blockIdx.x * ld;
    float best = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
        const float v = xr[c];
        if (v > best || bi == 0x7fffffff) { best = v; bi = c; }  // strictly greater: first index wins
    }
    // (value desc, index asc) reduction
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        best = lane < nw ? sv[lane] : -__int_as_float(0x7f800000);
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) {
            out_idx[blockIdx.x] = bi;
            if (out_val) out_val[blockIdx.x] = best;
        }
    }
}

// Two-phase argmax for long rows: argmax_part_f32 reduces chunks of ARGMAX_CHUNK elements (grid:
// chunks x rows, 256 threads, float4 loads) to (value, index) pairs; argmax_final_f32 (one warp per
// row) reduces the pairs. Same result and tie rule as argmax_f32.
#define ARGMAX_CHUNK 8192

EMBER_DEV void better(float& best, int& bi, float v, int i) {
    if (v > best || (v == best && i < bi) || bi == 0x7fffffff) { best = v; bi = i; }
}

extern "C" __global__ void argmax_part_f32(const float* __restrict__ x, i64 ld, int V, float* __restrict__ pv,
                                           int* __restrict__ pi) {
    __shared__ float sv[8];
    __shared__ int si[8];
    const int row = blockIdx.y, chunk = blockIdx.x, nchunks = gridDim.x;
    const float* xr = x + (i64)row * ld;
    const int c0 = chunk * ARGMAX_CHUNK, c1 = min(V, c0 + ARGMAX_CHUNK);
    float best = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;
    const bool vec = (ld % 4 == 0) && ((((u64)x) & 15) == 0);
    if (vec) {
        for (int c = c0 + 4 * threadIdx.x; c < c1; c += 4 * blockDim.x) {
            if (c + 3 < c1) {
                const float4 v = *reinterpret_cast<const float4*>(xr + c);
                better(best, bi, v.x, c); better(best, bi, v.y, c + 1);
                better(best, bi, v.z, c + 2); better(best, bi, v.w, c + 3);
            } else {
                for (int e = c; e < c1; ++e) better(best, bi, xr[e], e);
            }
        }
    } else {
        for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) better(best, bi, xr[c], c);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi != 0x7fffffff) better(best, bi, ov, oi);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (si[w] != 0x7fffffff) better(best, bi, sv[w], si[w]);
        pv[(i64)row * nchunks + chunk] = best;
        pi[(i64)row * nchunks + chunk] = bi;
    }
}

extern "C" __global__ void argmax_final_f32(const float* __restrict__ pv, const int* __restrict__ pi, int nchunks,
                                            int* __restrict__ out_idx, float* __restrict__ out_val) {
    const int row = blockIdx.x, lane = threadIdx.x;
    float best = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;
    for (int c = lane; c < nchunks; c += 32)
        if (pi[(i64)row * nchunks + c] != 0x7fffffff) better(best, bi, pv[(i64)row * nchunks + c], pi[(i64)row * nchunks + c]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi != 0x7fffffff) better(best, bi, ov, oi);
    }
    if (lane == 0) {
        out_idx[row] = bi == 0x7fffffff ? 0 : bi;
        if (out_val) out_val[row] = best;
    }
}

// y = softmax(x * inv_temp) per row (reference.softmax at inv_temp 1); one block per row.
extern "C" __global__ void softmax_f32(const float* __restrict__ x, i64 ldx, float* __restrict__ y, i64 ldy,
                                       int V, float inv_temp) {
    __shared__ float scratch[33];
    const float* xr = x + (i64)blockIdx.x * ldx;
    float* yr = y + (i64)blockIdx.x * ldy;
    float m = -__int_as_float(0x7f800000);
    for (int c = threadIdx.x; c < V; c += blockDim.x) m = fmaxf(m, xr[c] * inv_temp);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
        const float e = expf(xr[c] * inv_temp - m);
        yr[c] = e;
        s += e;
    }
    s = block_sum(s, scratch);
    const float inv = 1.0f / s;
    for (int c = threadIdx.x; c < V; c += blockDim.x) yr[c] = yr[c] * inv;
}
