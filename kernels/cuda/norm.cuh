// RMSNorm pieces shared by norm.cu and the matvecs that normalise their own input (matvec.cu XPRO).
// A row is held E columns per thread: thread t holds columns t + i * blockDim.x (i < E).
#pragma once
#include "common.cuh"

template <int E>
EMBER_DEV void load_weights(const float* __restrict__ w, int cols, float (&wv)[E]) {
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        wv[i] = c < cols ? __ldg(w + c) : 0.0f;
    }
}

EMBER_DEV float inv_rms(float ss, int cols, float eps, float* scratch) {
    return 1.0f / sqrtf(block_sum(ss, scratch) / (float)cols + eps);
}

// out = out + rms_norm(x) * w, one block per row: a post-norm (Gemma) folded into the residual add.
// post_norm_add: ov = out row + rms_norm(x row) * w (w already loaded), shared with rms_norm_add_norm.
template <int E>
EMBER_DEV void post_norm_add(const float* xr, const float* orow, const float (&wv)[E], int cols, float eps,
                             float* scratch, float (&ov)[E]) {
    float xv[E], ss = 0.0f;
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        xv[i] = c < cols ? xr[c] : 0.0f;
        ov[i] = c < cols ? orow[c] : 0.0f;
        ss = fmaf(xv[i], xv[i], ss);
    }
    const float inv = inv_rms(ss, cols, eps, scratch);
#pragma unroll
    for (int i = 0; i < E; ++i) ov[i] += (xv[i] * inv) * wv[i];  // columns past the row: 0 + 0
}


// The Gemma post-norm into the residual and the next sub-block's pre-norm: ov = res + rms_norm(o) * w1
// (the new residual), hv = rms_norm(ov) * w2. Every thread of the block must call it.
template <int E>
EMBER_DEV void post_norm_add_norm(const float* o, const float* res, const float (&w1v)[E], const float (&w2v)[E],
                                  int cols, float eps, float* scratch, float (&ov)[E], float (&hv)[E]) {
    post_norm_add(o, res, w1v, cols, eps, scratch, ov);
    float ss2 = 0.0f;
#pragma unroll
    for (int i = 0; i < E; ++i) ss2 = fmaf(ov[i], ov[i], ss2);
    const float inv2 = inv_rms(ss2, cols, eps, scratch);
#pragma unroll
    for (int i = 0; i < E; ++i) hv[i] = (ov[i] * inv2) * w2v[i];
}
