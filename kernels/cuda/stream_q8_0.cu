// y = x @ W.T (+ res) for one row x and a tall Q8_0 matrix W of short rows: the output projection of
// models whose tied embedding is Q8_0 (Gemma 3 270M: 262144 x 640, 178 MB a token).
//
// The staged matvec (matvec.cu) streams such a matrix well below the memory's bandwidth (the H200
// measurements: kernels/README.md), bound by instructions, not bytes: per 8 weights it turns bytes into floats out of 2-byte aligned shared
// memory and reads x again. Here every block quantizes x to int8 once (per 32 columns, as ggml's q8_1
// and the kq8 kernels do: d = max|x| / 127, q = roundf(x / d); twin: reference.linear_q8), so a
// weight block costs 8 dp4a. The grid is persistent: each warp walks groups of SQ_ROWS consecutive
// rows (contiguous, 16-byte aligned), staging a group through its slice of shared memory with
// 16-byte loads that bypass L1 and leave L2 first (the matrix is read once a step; the layers'
// weights may stay), the next group's loads issued before the current group is used. A pair of
// Q8_0 blocks is 68 bytes, 4-byte aligned in shared memory: read as 17 words, the even block's quants
// are the words funnel-shifted by 16 bits, the odd block's are aligned. Lanes 4r..4r+3 take row r's
// block pairs and a 4-lane sum ends the row.
//
// With `best` given, the grid also finds the row's greedy token (the first index of the largest y, as
// sample_f32's greedy pass): each block publishes its best (value, index), and the block that finishes
// last merges them into best_v[0], best_i[0], so the sampler needs no pass over the logits.
#include "argmax.cuh"

// SQ_WARPS (warps a block), SQ_ROWS (rows a warp stages at a time) and SQ_VECS (16-byte loads a lane
// holds, so rows of at most 32 * 16 * SQ_VECS / SQ_ROWS bytes) come from kernels/constants.py
static_assert(SQ_ROWS == 32 / 4, "four lanes a row: lane / 4 is the row, lane % 4 its block pairs");
static_assert(BLOCK_ELEMS_Q8_0 == 32 && BLOCK_BYTES_Q8_0 == 34, "a pair of Q8_0 blocks is 68 bytes, 17 words");

// a 16-byte load that skips L1 and is the first out of L2 (policy: evict_first_policy())
EMBER_DEV u64 evict_first_policy() {
    u64 pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}

EMBER_DEV uint4 ld_stream(const uint4* p, u64 pol) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
    return v;
}

// Shared memory: x as int8 [cols], its scales [cols / 32], then each warp's stage [SQ_ROWS * row_bytes].
extern "C" __global__ void __launch_bounds__(SQ_WARPS * 32)
    sq8_b1(const u8* __restrict__ W, i64 row_bytes, int rows, int cols, const float* __restrict__ x,
           const float* res, float* __restrict__ y, float* part_v, int* part_i, u32* done, float* best_v,
           int* best_i) {
    extern __shared__ __align__(16) u8 smem[];
    __shared__ float wv[SQ_WARPS];
    __shared__ int wi[SQ_WARPS];
    __shared__ bool last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    i8* xq = reinterpret_cast<i8*>(smem);
    float* xd = reinterpret_cast<float*>(smem + cols);
    u8* stage = smem + ((cols + cols / 8 + 15) & ~15) + (i64)warp * SQ_ROWS * row_bytes;
    const int groups = (rows + SQ_ROWS - 1) / SQ_ROWS;
    const int gstep = gridDim.x * SQ_WARPS;
    const int nblk = cols / 32, npairs = nblk / 2;

    uint4 buf[SQ_VECS];
    const u64 pol = evict_first_policy();
    auto load = [&](int g) {
        const int r0 = g * SQ_ROWS;
        const int nvec = (int)((min(SQ_ROWS, rows - r0) * row_bytes) >> 4);
        const uint4* src = reinterpret_cast<const uint4*>(W + (i64)r0 * row_bytes);
#pragma unroll
        for (int v = 0; v < SQ_VECS; ++v) {
            const int i = v * 32 + lane;
            if (i < nvec) buf[v] = ld_stream(src + i, pol);
        }
    };
    int g = blockIdx.x * SQ_WARPS + warp;
    if (g < groups) load(g);  // the weights depend on no earlier kernel: loaded while it finishes
    grid_dependency_sync();

    for (int b = warp; b < nblk; b += SQ_WARPS) {  // x to int8, a warp per 32 columns
        const float v = x[b * 32 + lane];
        const float d = warp_max(fabsf(v)) / 127.0f;
        const float inv = d > 0.0f ? 1.0f / d : 0.0f;
        xq[b * 32 + lane] = (i8)(int)roundf(v * inv);
        if (lane == 0) xd[b] = d;
    }
    __syncthreads();

    const int r = lane >> 2, sub = lane & 3;
    float bv = 0.0f;
    int bi = NO_INDEX;
    for (; g < groups; g += gstep) {
        const int r0 = g * SQ_ROWS;
        const int nvec = (int)((min(SQ_ROWS, rows - r0) * row_bytes) >> 4);
        __syncwarp();
#pragma unroll
        for (int v = 0; v < SQ_VECS; ++v) {
            const int i = v * 32 + lane;
            if (i < nvec) reinterpret_cast<uint4*>(stage)[i] = buf[v];
        }
        __syncwarp();
        if (g + gstep < groups) load(g + gstep);

        float acc = 0.0f;
        if (r0 + r < rows) {
            const u8* rowp = stage + r * row_bytes;
            for (int p = sub; p < npairs; p += 4) {
                const u32* wp = reinterpret_cast<const u32*>(rowp + 68 * p);
                u32 w[17];
#pragma unroll
                for (int k = 0; k < 17; ++k) w[k] = wp[k];
                const int4* x4 = reinterpret_cast<const int4*>(xq + 64 * p);
                const int4 xa = x4[0], xb = x4[1], xc = x4[2], xe = x4[3];
                const int xs[16] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w,
                                    xc.x, xc.y, xc.z, xc.w, xe.x, xe.y, xe.z, xe.w};
                int sa = 0, sb = 0;
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    sa = __dp4a((int)__funnelshift_r(w[k], w[k + 1], 16), xs[k], sa);
                    sb = __dp4a((int)w[9 + k], xs[8 + k], sb);
                }
                const float da = h2f((u16)(w[0] & 0xffffu)), db = h2f((u16)(w[8] >> 16));
                acc = fmaf(da * xd[2 * p], (float)sa, acc);
                acc = fmaf(db * xd[2 * p + 1], (float)sb, acc);
            }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        if (sub == 0 && r0 + r < rows) {
            const float v = acc + (res ? res[r0 + r] : 0.0f);
            y[r0 + r] = v;
            if (beats(v, r0 + r, bv, bi)) { bv = v; bi = r0 + r; }
        }
    }
    if (!best_i) return;
    warp_best<true>(bv, bi);
    if (lane == 0) { wv[warp] = bv; wi[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < SQ_WARPS; ++w)
            if (beats(wv[w], wi[w], bv, bi)) { bv = wv[w]; bi = wi[w]; }
        part_v[blockIdx.x] = bv;
        part_i[blockIdx.x] = bi;
        __threadfence();
        last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last || warp != 0) return;
    __threadfence();
    bv = 0.0f;
    bi = NO_INDEX;
    for (int b = lane; b < (int)gridDim.x; b += 32) {
        const float v = __ldcg(part_v + b);
        const int i = __ldcg(part_i + b);
        if (beats(v, i, bv, bi)) { bv = v; bi = i; }
    }
    warp_best<true>(bv, bi);
    if (lane == 0) {
        best_v[0] = bv;
        best_i[0] = bi == NO_INDEX ? 0 : bi;
        *done = 0;  // ready for the next launch
    }
}
