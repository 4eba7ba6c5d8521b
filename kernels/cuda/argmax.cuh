// The greedy draw's comparison, shared by sampling.cu's argmax kernels and stream_q8_0.cu's fused
// argmax: the first index of the largest value (numpy.argmax's tie rule), NO_INDEX meaning "none yet".
#pragma once
#include "common.cuh"

#define NO_INDEX 0x7fffffff

// (v, i) beats the best so far (best, bi): it is something, and larger, or as large and earlier; anything
// beats nothing. stream_q8_0.cu's row loop tests this form: with better() there, its dp4a loop compiled
// into slower code (measured: kernels/README.md)
EMBER_DEV bool beats(float v, int i, float best, int bi) {
    return i != NO_INDEX && (bi == NO_INDEX || v > best || (v == best && i < bi));
}

// (v, i) into the best so far (best, bi): larger, or as large and earlier; anything beats nothing
EMBER_DEV void better(float& best, int& bi, float v, int i) {
    if (v > best || (v == best && i < bi) || bi == NO_INDEX) { best = v; bi = i; }
}

// The best (value, index) over a warp, every lane's NO_INDEX ignored; every lane gets it. Either form
// gives the same answer; they compile differently around the caller's loops, and each caller keeps the
// one that measured faster for it (stream_q8_0.cu: BEATS).
template <bool BEATS = false>
EMBER_DEV void warp_best(float& best, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if constexpr (BEATS) {
            if (beats(ov, oi, best, bi)) { best = ov; bi = oi; }
        } else if (oi != NO_INDEX) {
            better(best, bi, ov, oi);
        }
    }
}
