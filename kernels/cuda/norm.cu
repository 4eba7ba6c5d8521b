// Fused residual add + RMSNorm, one block of threads per row:
//   h = x (+ res);  if h_out: h_out = h;  y = h / sqrt(mean(h^2) + eps) * w
// Rows are addressed as (token t, head j) = (r / heads, r % heads) at t * ld + j * cols, so the same
// kernel normalises whole hidden rows (heads = 1) and per-head slices of q/k (qwen3, gemma3 q/k norm)
// in place. x, res, h_out share the x layout (ldx); y has its own (ldy). y may alias x or h_out.
#include "common.cuh"

extern "C" __global__ void rms_norm_f32(const float* x, const float* res, float* h_out,
                                        const float* __restrict__ w, float* y, int n_rows, int cols,
                                        int heads, i64 ldx, i64 ldy, float eps) {
    grid_dependency_sync();
    __shared__ float scratch[33];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const i64 ox = (i64)(r / heads) * ldx + (i64)(r % heads) * cols;
    const i64 oy = (i64)(r / heads) * ldy + (i64)(r % heads) * cols;
    const float* xr = x + ox;
    const float* rr = res ? res + ox : nullptr;
    float* hr = h_out ? h_out + ox : nullptr;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float h = xr[c];
        if (rr) h += rr[c];
        if (hr) hr[c] = h;
        ss = fmaf(h, h, ss);
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
    // second pass: every element is re-read by the thread that wrote it in the first pass
    const float* src = hr ? hr : xr;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float h = src[c];
        if (rr && !hr) h += rr[c];
        y[oy + c] = (h * inv) * w[c];
    }
}

// out = out + rms_norm(x) * w, one block per row: a post-norm (Gemma) folded into the residual add.
// 1 / sqrt(mean(v^2) + eps) of one row, every thread of the block taking part
EMBER_DEV float row_inv_rms(const float* v, int cols, float eps, float* scratch /* 33 floats, shared */) {
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) ss = fmaf(v[c], v[c], ss);
    ss = block_sum(ss, scratch);
    return 1.0f / sqrtf(ss / (float)cols + eps);
}

extern "C" __global__ void rms_norm_add_f32(const float* __restrict__ x, const float* __restrict__ w, float* out,
                                            int n_rows, int cols, float eps) {
    grid_dependency_sync();
    __shared__ float scratch[33];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const float* xr = x + (i64)r * cols;
    const float inv = row_inv_rms(xr, cols, eps, scratch);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[(i64)r * cols + c] += (xr[c] * inv) * w[c];
}

// Elementwise h = a + b (the residual add when no norm follows).
extern "C" __global__ void add_f32(const float* a, const float* b, float* out, i64 n) {
    grid_dependency_sync();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = a[i] + b[i];
}

// out[i, :] = x[idx[i], :] (rows of cols floats, x with row stride ldx): the rows whose logits a step needs.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ x, i64 ldx, const int* __restrict__ idx,
                                           int n, int cols, float* __restrict__ out) {
    grid_dependency_sync();
    const int i = blockIdx.x;
    if (i >= n) return;
    const float* src = x + (i64)idx[i] * ldx;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[(i64)i * cols + c] = src[c];
}

// y[r, :] += bias over n rows of cols (row stride ldy): qwen2's q/k/v biases.
extern "C" __global__ void add_bias_f32(float* y, i64 ldy, const float* __restrict__ bias, int n, int cols) {
    grid_dependency_sync();
    for (int c = threadIdx.x; c < cols; c += blockDim.x) y[(i64)blockIdx.x * ldy + c] += bias[c];
}

// out += rms_norm(x) * w1, then h = rms_norm(out) * w2, one block per row: a Gemma post-norm folded
// into the residual add and the next sub-block's pre-norm, in one launch instead of two. The same
// per-element math as rms_norm_add_f32 followed by rms_norm_f32.
extern "C" __global__ void rms_norm_add_norm_f32(const float* __restrict__ x, const float* __restrict__ w1,
                                                 float* out, const float* __restrict__ w2, float* __restrict__ h,
                                                 int n_rows, int cols, float eps) {
    grid_dependency_sync();
    __shared__ float scratch[33];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const float* xr = x + (i64)r * cols;
    float* orow = out + (i64)r * cols;
    const float inv = row_inv_rms(xr, cols, eps, scratch);
    float ss2 = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float o = orow[c] + (xr[c] * inv) * w1[c];
        orow[c] = o;
        ss2 = fmaf(o, o, ss2);
    }
    ss2 = block_sum(ss2, scratch);
    const float inv2 = 1.0f / sqrtf(ss2 / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) h[(i64)r * cols + c] = (orow[c] * inv2) * w2[c];
}
