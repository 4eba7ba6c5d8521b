// Fused residual add + RMSNorm, one block of threads per row:
//   h = x (+ res);  if h_out: h_out = h;  y = h / sqrt(mean(h^2) + eps) * w
// Rows are addressed as (token t, head j) = (r / heads, r % heads) at t * ld + j * cols, so the same
// kernel normalises whole hidden rows (heads = 1) and per-head slices of q/k (qwen3, gemma3 q/k norm)
// in place. x, res, h_out share the x layout (ldx); y has its own (ldy). y may alias x or h_out.
#include "norm.cuh"
// A row lives in registers: thread t holds columns t + i * blockDim.x (i < E), so each
// element is read once and the reductions wait on no second pass through memory. The weights depend
// on no earlier kernel: they are loaded before the PDL wait (grid_dependency_sync).
// Two sizes (ops picks): E = 4 or 8 columns per thread, NORM_MAX_THREADS (kernels/constants.py)
// threads at most: up to 4096 and 8192 columns.

template <int E>
EMBER_DEV void rms_norm_row(const float* x, const float* res, float* h_out, const float* __restrict__ w, float* y,
                            int n_rows, int cols, int heads, i64 ldx, i64 ldy, float eps) {
    float wv[E], hv[E];
    load_weights(w, cols, wv);
    grid_dependency_sync();
    __shared__ float scratch[33];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const i64 ox = (i64)(r / heads) * ldx + (i64)(r % heads) * cols;
    const i64 oy = (i64)(r / heads) * ldy + (i64)(r % heads) * cols;
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        hv[i] = 0.0f;
        if (c < cols) {
            hv[i] = x[ox + c] + (res ? res[ox + c] : 0.0f);
            ss = fmaf(hv[i], hv[i], ss);
        }
    }
    const float inv = inv_rms(ss, cols, eps, scratch);
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < cols) {
            if (h_out) h_out[ox + c] = hv[i];
            y[oy + c] = (hv[i] * inv) * wv[i];
        }
    }
}

template <int E>
EMBER_DEV void rms_norm_add_row(const float* __restrict__ x, const float* __restrict__ w, float* out, int n_rows,
                                int cols, float eps) {
    float wv[E], ov[E];
    load_weights(w, cols, wv);
    grid_dependency_sync();
    __shared__ float scratch[33];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    float* orow = out + (i64)r * cols;
    post_norm_add(x + (i64)r * cols, orow, wv, cols, eps, scratch, ov);
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < cols) orow[c] = ov[i];
    }
}

// out += rms_norm(x) * w1, then h = rms_norm(out) * w2, one block per row: a Gemma post-norm folded
// into the residual add and the next sub-block's pre-norm, in one launch instead of two. The same
// per-element math as rms_norm_add_f32 followed by rms_norm_f32.
template <int E>
EMBER_DEV void rms_norm_add_norm_row(const float* __restrict__ x, const float* __restrict__ w1, float* out,
                                     const float* __restrict__ w2, float* __restrict__ h, int n_rows, int cols,
                                     float eps) {
    float w1v[E], w2v[E], ov[E], hv[E];
    load_weights(w1, cols, w1v);
    load_weights(w2, cols, w2v);
    grid_dependency_sync();
    __shared__ float scratch[33];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    float* orow = out + (i64)r * cols;
    post_norm_add_norm(x + (i64)r * cols, orow, w1v, w2v, cols, eps, scratch, ov, hv);
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < cols) {
            orow[c] = ov[i];
            h[(i64)r * cols + c] = hv[i];
        }
    }
}

#define NORM_KERNELS(E, MAXT)                                                                                \
    extern "C" __global__ void __launch_bounds__(MAXT) rms_norm_f32_e##E(                                  \
        const float* x, const float* res, float* h_out, const float* __restrict__ w, float* y, int n_rows,  \
        int cols, int heads, i64 ldx, i64 ldy, float eps) {                                                \
        rms_norm_row<E>(x, res, h_out, w, y, n_rows, cols, heads, ldx, ldy, eps);                          \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(MAXT) rms_norm_add_f32_e##E(                              \
        const float* __restrict__ x, const float* __restrict__ w, float* out, int n_rows, int cols, float eps) { \
        rms_norm_add_row<E>(x, w, out, n_rows, cols, eps);                                                 \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(MAXT) rms_norm_add_norm_f32_e##E(                         \
        const float* __restrict__ x, const float* __restrict__ w1, float* out, const float* __restrict__ w2,   \
        float* __restrict__ h, int n_rows, int cols, float eps) {                                          \
        rms_norm_add_norm_row<E>(x, w1, out, w2, h, n_rows, cols, eps);                                    \
    }
NORM_KERNELS(4, NORM_MAX_THREADS)
NORM_KERNELS(8, NORM_MAX_THREADS)

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

// y[r, :] += bias over n rows of cols (row stride ldy): the q/k/v biases (qwen2, gpt-oss; stacked as the q|k|v
// rows are, or one at a time) and gpt-oss's output bias.
extern "C" __global__ void add_bias_f32(float* y, i64 ldy, const float* __restrict__ bias, int n, int cols) {
    grid_dependency_sync();
    for (int c = threadIdx.x; c < cols; c += blockDim.x) y[(i64)blockIdx.x * ldy + c] += bias[c];
}
