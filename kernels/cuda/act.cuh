// The gated MLP's activations, shared by act.cu and every kernel with a gated epilogue (the matvecs that
// apply them while loading x or writing y, qgemm.cu's gated tiles). The codes (ACT_*) and gpt-oss's
// SwiGLU constants (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT) come from kernels/constants.py; the twin is
// reference.gated.
#pragma once
#include "common.cuh"

static_assert(ACT_NONE == 0, "act 0: the int8 matvec's plain product");
static_assert(ACT_SILU != ACT_NONE && ACT_GELU_TANH != ACT_NONE && ACT_SWIGLU_OAI != ACT_NONE &&
                  ACT_SILU != ACT_GELU_TANH && ACT_SILU != ACT_SWIGLU_OAI && ACT_GELU_TANH != ACT_SWIGLU_OAI,
              "one code an activation");

EMBER_DEV float silu(float x) { return x / (1.0f + expf(-x)); }
EMBER_DEV float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
// act(gate) * up by the activation's code; gpt-oss's clamped SwiGLU (ACT_SWIGLU_OAI) is silu's form with the
// gate clamped above and up both ways at the limit, alpha inside the sigmoid and up + 1:
// g / (1 + e^(-alpha g)) * (u + 1), in the twin's order of operations (reference.swiglu_oai). Written as one
// path with silu's (alpha 1 is exact: -1 * g is -g), so the epilogues that take any code carry one expf.
EMBER_DEV float gated_act(int act, float g, float u) {
    if (act == ACT_GELU_TANH) return gelu_tanh(g) * u;
    float alpha = 1.0f;
    if (act == ACT_SWIGLU_OAI) {
        g = fminf(g, SWIGLU_OAI_LIMIT);
        u = fminf(fmaxf(u, -SWIGLU_OAI_LIMIT), SWIGLU_OAI_LIMIT) + 1.0f;
        alpha = SWIGLU_OAI_ALPHA;
    }
    return g / (1.0f + expf(-alpha * g)) * u;
}
// act(g) * u for a dense MLP's two activations, as the int8 matvec applies them (matvec_k.cu: to every element
// of x in its load path, or to its gated outputs): a third branch there costs time (kernels/docs/code-choices.md),
// and gpt-oss's clamped SwiGLU only ever reaches its experts' kernels (ops.matvec_q8 refuses it).
EMBER_DEV float dense_act(int act, float g, float u) { return (act == ACT_GELU_TANH ? gelu_tanh(g) : silu(g)) * u; }
