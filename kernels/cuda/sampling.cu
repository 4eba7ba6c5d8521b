// Sampling helpers on the device: argmax (greedy decoding) and a row softmax with temperature.
#include "argmax.cuh"

// out_idx[r] = first index of the largest value of row r (numpy.argmax's tie rule); one block per row.
extern "C" __global__ void argmax_f32(const float* __restrict__ x, i64 ld, int V, int* __restrict__ out_idx,
                                      float* __restrict__ out_val) {
    grid_dependency_sync();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* xr = x + (i64)blockIdx.x * ld;
    float best = -__int_as_float(0x7f800000);
    int bi = NO_INDEX;
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
        const float v = xr[c];
        if (v > best || bi == NO_INDEX) { best = v; bi = c; }  // strictly greater: first index wins
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
        bi = lane < nw ? si[lane] : NO_INDEX;
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
// chunks x rows, ARGMAX_THREADS threads, float4 loads; both from kernels/constants.py) to (value,
// index) pairs; argmax_final_f32 (one warp per row) reduces the pairs. Same result and tie rule as
// argmax_f32.

extern "C" __global__ void argmax_part_f32(const float* __restrict__ x, i64 ld, int V, float* __restrict__ pv,
                                           int* __restrict__ pi) {
    grid_dependency_sync();
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int si[ARGMAX_THREADS / 32];
    const int row = blockIdx.y, chunk = blockIdx.x, nchunks = gridDim.x;
    const float* xr = x + (i64)row * ld;
    const int c0 = chunk * ARGMAX_CHUNK, c1 = min(V, c0 + ARGMAX_CHUNK);
    float best = -__int_as_float(0x7f800000);
    int bi = NO_INDEX;
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
    warp_best(best, bi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (si[w] != NO_INDEX) better(best, bi, sv[w], si[w]);
        pv[(i64)row * nchunks + chunk] = best;
        pi[(i64)row * nchunks + chunk] = bi;
    }
}

extern "C" __global__ void argmax_final_f32(const float* __restrict__ pv, const int* __restrict__ pi, int nchunks,
                                            int* __restrict__ out_idx, float* __restrict__ out_val) {
    grid_dependency_sync();
    const int row = blockIdx.x, lane = threadIdx.x;
    float best = -__int_as_float(0x7f800000);
    int bi = NO_INDEX;
    for (int c = lane; c < nchunks; c += 32)
        if (pi[(i64)row * nchunks + c] != NO_INDEX) better(best, bi, pv[(i64)row * nchunks + c], pi[(i64)row * nchunks + c]);
    warp_best(best, bi);
    if (lane == 0) {
        out_idx[row] = bi == NO_INDEX ? 0 : bi;
        if (out_val) out_val[row] = best;
    }
}

// y = softmax(x * inv_temp) per row (reference.softmax at inv_temp 1); one block per row.
extern "C" __global__ void softmax_f32(const float* __restrict__ x, i64 ldx, float* __restrict__ y, i64 ldy,
                                       int V, float inv_temp) {
    grid_dependency_sync();
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

// Sampling on the device, one block of 1024 threads per row, the host sampler's chain
// (worker/engine/sampling.py): top-k, then top-p over what top-k kept, then min-p, then a draw from
// softmax(x / temperature) over what is left. Each filter is a threshold on the logit:
//   top-k  the k-th largest value (a 4-pass radix select over order-preserving keys, counting),
//   top-p  the value at which the kept mass, largest first, first reaches top_p (the same radix
//          select, summing exp(x - max) instead of counting: no sort of the vocabulary),
//   min-p  max + log(min_p) (p_i >= min_p * p_max).
// The draw is the Gumbel-max trick: argmax of x / T + Gumbel noise over the kept values, the noise
// from a counter-based hash of (seed, step, index), so a row's token does not depend on the batch.
// temperature <= 0 is greedy: one argmax pass, split over the grid's blocks of the row (gridDim.y
// parts; the block that finishes last merges their bests: one SM streaming a long row is slow; see
// kernels/README.md). A sampled row is one block's work (the other blocks of its row leave). Every pass reads the row
// with float4 loads, several in flight per thread.
// Twin: reference.sample_rows (same thresholds and the same noise). SAMPLE_THREADS (the block) comes
// from kernels/constants.py.

EMBER_DEV u32 order_key(float f) {  // larger float -> larger key; NaN sorts lowest
    if (f != f) return 0u;
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
EMBER_DEV float key_value(u32 k) {
    if (k == 0u) return -__int_as_float(0x7f800000);  // no floor
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

EMBER_DEV u64 mix64(u64 z) {  // splitmix64's finaliser
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
EMBER_DEV float gumbel(u64 seed, u32 step, int i) {
    const u64 h = mix64(seed * 0x9e3779b97f4a7c15ull + ((u64)step << 32) + (u64)(u32)i);
    const float u = ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
    return -logf(-logf(u));
}

// f(value, index) for every element of the row, this thread's share, with vector loads when aligned.
#define EACH_UNROLL 8
template <typename F>
EMBER_DEV void each(const float* __restrict__ xr, int V, F&& f) {
    const int t = threadIdx.x, nt = blockDim.x;
    if ((V & 3) == 0 && (((u64)xr) & 15) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const int n4 = V >> 2;
        // EACH_UNROLL float4 loads in flight per thread: a row streams through one SM, so its speed is
        // what one SM keeps in flight (4 were measurably slower on the H200: kernels/README.md)
        int i = t;
        for (; i + (EACH_UNROLL - 1) * nt < n4; i += EACH_UNROLL * nt) {
            float4 v[EACH_UNROLL];
#pragma unroll
            for (int u = 0; u < EACH_UNROLL; ++u) v[u] = x4[i + u * nt];
#pragma unroll
            for (int u = 0; u < EACH_UNROLL; ++u) {
                const int c = 4 * (i + u * nt);
                f(v[u].x, c); f(v[u].y, c + 1); f(v[u].z, c + 2); f(v[u].w, c + 3);
            }
        }
        for (; i < n4; i += nt) {
            const float4 v = x4[i];
            f(v.x, 4 * i); f(v.y, 4 * i + 1); f(v.z, 4 * i + 2); f(v.w, 4 * i + 3);
        }
    } else {
        for (int c = t; c < V; c += nt) f(xr[c], c);
    }
}

// The largest key K with (count or mass of elements with key >= K and key >= floor) >= target.
template <bool MASS>
EMBER_DEV u32 radix_select(const float* xr, int V, u32 floor_key, float m, float target, float* hist,
                           u32* shared_pick, float* shared_rem) {
    u32 prefix = 0, mask = 0;
    float rem = target;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0.0f;
        __syncthreads();
        each(xr, V, [&](float x, int) {
            const u32 k = order_key(x);
            if (k >= floor_key && (k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], MASS ? expf(x - m) : 1.0f);
        });
        __syncthreads();
        if (threadIdx.x == 0) {
            float acc = 0.0f;
            int b = 255;
            for (; b > 0; --b) {
                if (acc + hist[b] >= rem) break;
                acc += hist[b];
            }
            *shared_pick = (u32)b;
            *shared_rem = rem - acc;
        }
        __syncthreads();
        prefix |= *shared_pick << shift;
        mask |= 255u << shift;
        rem = *shared_rem;
        __syncthreads();
    }
    return prefix;
}

// (value desc, index asc) best over the block; thread 0 gets the result.
EMBER_DEV void block_best(float& bv, int& bi, float* sv, int* si) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (sv[w] > bv || (sv[w] == bv && si[w] < bi)) { bv = sv[w]; bi = si[w]; }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_f32(
    const float* __restrict__ x, i64 ld, int V, const float* __restrict__ temperature, const int* __restrict__ top_k,
    const float* __restrict__ top_p, const float* __restrict__ min_p, const u64* __restrict__ seed,
    const u32* __restrict__ step, int* __restrict__ out, float* __restrict__ out_floor, float* part_v, int* part_i,
    u32* done, const float* greedy_v, const int* greedy_i) {
    grid_dependency_sync();
    __shared__ float scratch[33];
    __shared__ float hist[256];
    __shared__ u32 pick;
    __shared__ float rem;
    __shared__ int best_i[32];
    __shared__ float best_v[32];
    __shared__ bool last;
    const int row = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
    const float* xr = x + (i64)row * ld;
    const float T = temperature[row];
    float bv = -__int_as_float(0x7f800000);
    int bi = NO_INDEX;
    if (!(T > 0.0f) && greedy_i) {  // greedy, and the row's argmax already found (sq8_b1's best)
        if (part == 0 && threadIdx.x == 0) {
            out[row] = greedy_i[row];
            if (out_floor) out_floor[row] = greedy_v[row];
        }
        return;
    }
    if (!(T > 0.0f)) {  // greedy: one argmax pass (first index of the maximum), the row's parts in parallel
        const int per = ((V + parts - 1) / parts + 3) & ~3;
        const int c0 = min(V, part * per), n = min(V, c0 + per) - c0;
        each(xr + c0, n, [&](float v, int c) {
            c += c0;
            if (v > bv || (v == bv && c < bi) || bi == NO_INDEX) { bv = v; bi = c; }
        });
        block_best(bv, bi, best_v, best_i);
        if (threadIdx.x == 0) {
            if (parts > 1) {  // publish this part's best; the block that finishes last merges them
                part_v[(i64)row * parts + part] = bv;
                part_i[(i64)row * parts + part] = bi;
                __threadfence();
                last = atomicAdd(&done[row], 1u) == (u32)parts - 1;
            } else {
                last = true;
                best_v[0] = bv;
                best_i[0] = bi;
            }
        }
        __syncthreads();
        if (!last || threadIdx.x >= 32) return;
        if (parts > 1) {
            __threadfence();
            bv = -__int_as_float(0x7f800000);
            bi = NO_INDEX;
            for (int p = threadIdx.x; p < parts; p += 32) {
                const float v = __ldcg(part_v + (i64)row * parts + p);
                const int i = __ldcg(part_i + (i64)row * parts + p);
                if (i != NO_INDEX && (v > bv || (v == bv && i < bi) || bi == NO_INDEX)) { bv = v; bi = i; }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (oi != NO_INDEX && (ov > bv || (ov == bv && oi < bi) || bi == NO_INDEX)) { bv = ov; bi = oi; }
            }
        } else {
            bv = best_v[0];
            bi = best_i[0];
        }
        if (threadIdx.x == 0) {
            out[row] = bi == NO_INDEX ? 0 : bi;
            if (out_floor) out_floor[row] = bv;
            if (parts > 1) done[row] = 0;  // ready for the next launch
        }
        return;
    }
    if (part != 0) return;  // a sampled row: one block runs the whole chain
    float m = -__int_as_float(0x7f800000);
    each(xr, V, [&](float v, int) { m = fmaxf(m, v); });
    m = block_max(m, scratch);
    u32 floor_key = 0;
    const int k = top_k[row];
    if (k > 0 && k < V) floor_key = radix_select<false>(xr, V, 0u, m, (float)k, hist, &pick, &rem);
    const float p = top_p[row];
    if (p < 1.0f) {
        float z = 0.0f;
        each(xr, V, [&](float v, int) { if (order_key(v) >= floor_key) z += expf(v - m); });
        z = block_sum(z, scratch);
        const u32 kp = radix_select<true>(xr, V, floor_key, m, p * z, hist, &pick, &rem);
        floor_key = max(floor_key, kp);
    }
    const float mp = min_p[row];
    if (mp > 0.0f) floor_key = max(floor_key, order_key(m + logf(mp)));
    // the draw: argmax of x / T + noise over the kept values (first index on ties)
    const float invT = 1.0f / T;
    const u64 sd = seed[row];
    const u32 st = step[row];
    each(xr, V, [&](float xv, int c) {
        if (order_key(xv) < floor_key) return;
        const float v = xv * invT + gumbel(sd, st, c);
        if (v > bv || (v == bv && c < bi)) { bv = v; bi = c; }
    });
    block_best(bv, bi, best_v, best_i);
    if (threadIdx.x == 0) {
        out[row] = bi == NO_INDEX ? 0 : bi;
        if (out_floor) out_floor[row] = key_value(floor_key);
    }
}
