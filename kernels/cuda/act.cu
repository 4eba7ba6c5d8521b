// Gated MLP activation: out = act(g) * u (act.cuh gated_act: the ACT_* code, silu, gelu_tanh or gpt-oss's
// clamped SwiGLU) over [n, F] with row strides, so g and u can be the two halves of one fused gate|up buffer.
#include "act.cuh"

extern "C" __global__ void gated_act_f32(const float* g, i64 ldg, const float* u, i64 ldu, float* out,
                                         i64 ldo, int n, int F, int act) {
    grid_dependency_sync();
    const i64 total = (i64)n * F;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / F, c = i % F;
        out[r * ldo + c] = gated_act(act, g[r * ldg + c], u[r * ldu + c]);
    }
}
