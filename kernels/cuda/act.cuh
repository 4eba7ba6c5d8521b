// The gated MLP's activations, shared by act.cu and the matvecs that apply them while loading x.
#pragma once
#include "common.cuh"

EMBER_DEV float silu(float x) { return x / (1.0f + expf(-x)); }
EMBER_DEV float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
