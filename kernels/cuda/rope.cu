// Rotary position embedding, in place, on q [n, hq, D] and k [n, hk, D] (row strides ldq, ldk in
// elements, so q and k may be slices of one fused qkv buffer). Angles pos * inv_freq[i] are formed in
// double, as the twin does (reference.rope_tables), then rounded cos/sin to float: once per token into
// shared memory, then all heads' pairs are rotated in parallel.
// neox rotates the pairs (i, i + D/2); the "normal" (llama) flavour the pairs (2i, 2i + 1). mscale: YaRN's
// scale of every cos and sin (1 without YaRN). hstride: elements from a head to the next (D, unless only
// part of each head turns: DeepSeek V4 rotates the last D of every head, q and k then views at that
// offset); inverse rotates back (sin negated: the attention output's de-rotation).
// ROPE_MAX_HALF (rotation pairs a head at most) comes from kernels/constants.py
#include "common.cuh"

extern "C" __global__ void rope_f32(float* q, i64 ldq, int hq, float* k, i64 ldk, int hk,
                                    const int* __restrict__ pos, const float* __restrict__ inv_freq,
                                    int n, int D, int neox, float mscale, i64 hstride, int inverse) {
    grid_dependency_sync();
    __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    const int t = blockIdx.x;
    if (t >= n) return;
    const int half = D / 2;
    rope_table(cs, sn, pos[t], inv_freq, half, mscale);
    __syncthreads();
    const int total = (hq + hk) * half;
    for (int idx = blockIdx.y * blockDim.x + threadIdx.x; idx < total; idx += gridDim.y * blockDim.x) {
        const int h = idx / half, i = idx % half;
        const float c = cs[i], s = inverse ? -sn[i] : sn[i];
        const int i1 = neox ? i : 2 * i, i2 = neox ? i + half : 2 * i + 1;
        float* v = h < hq ? q + (i64)t * ldq + (i64)h * hstride : k + (i64)t * ldk + (i64)(h - hq) * hstride;
        const float x1 = v[i1], x2 = v[i2];
        v[i1] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
        v[i2] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
    }
}
