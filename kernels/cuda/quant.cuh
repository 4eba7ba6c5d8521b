// GGUF (ggml) block formats, decoded 8 elements ("a unit") at a time.
//
// Every unit is 8 elements that are contiguous in the row and share one scale, so a dot product
// can be written sum_i w_i x_i = s * sum_i q_i x_i - o * sum_i x_i, where w_i = s * q_i - o is
// exactly the twin's dequantized value (kernels/quants.py): q_i is a small integer (offset already
// applied, e.g. q - 8 for Q4_0) held exactly in a float, s the block/sub-block scale and o the
// sub-block minimum (K-quants with mins only; 0 elsewhere).
//
// Integers become floats without the slow I2F instruction: a byte b is placed in the low mantissa
// bits of 2^23 (one PRMT), and 2^23 (+ offset) subtracted (one FADD): exact for 0 <= b < 2^23.
//
// Layouts follow ggml-common.h byte for byte; the block sizes (BLOCK_ELEMS_*, BLOCK_BYTES_*) and the
// ggml type ids (GT_*) come from kernels/constants.py. Each type also says CB, the blocks a chunk of
// matvec.cu's staging holds: about 1-2 KB, a multiple of 16 bytes. Blocks of the 32-element types and Q6_K are
// only 2-byte aligned, so their fields are read with 16-bit loads unless the caller knows better
// (ALIGNED).
#pragma once
#include "common.cuh"

// the type ids are compared in #if (matvec_k.cu), where a missing macro would silently be 0
#if !defined(GT_F32) || !defined(GT_F16) || !defined(GT_BF16) || !defined(GT_Q4_0) || !defined(GT_Q5_0) || \
    !defined(GT_Q8_0) || !defined(GT_Q4_K) || !defined(GT_Q5_K) || !defined(GT_Q6_K) || !defined(GT_Q6_KP)
#error "the GT_* type ids come from kernels/constants.py (kernels/build.py passes them as -D options)"
#endif

// byte b of `word` (0..3) as float(b) + 2^23: subtract BIAS to get the integer back.
// The 0x4B000000 operand comes from a register so that PRMT can take its selector as an immediate
// (with both operands constant, ptxas materialises the selector with an extra MOV per use).
__constant__ u32 ember_magic_2p23 = 0x4B000000u;  // bits of 2^23; read from constant memory, so
EMBER_DEV u32 magic_reg() { return ember_magic_2p23; }  // ptxas cannot fold it into the PRMT
EMBER_DEV float magic_byte(u32 word, int k) {
    return __int_as_float((int)__byte_perm(word, magic_reg(), 0x7440u | (u32)k));
}

// 8 bytes at p. A2: p is only 2-byte aligned (four 16-bit loads); else 8-byte aligned.
template <bool A8>
EMBER_DEV uint2 load8(const u8* p) {
    if (A8) return *reinterpret_cast<const uint2*>(p);
    const u16* h = reinterpret_cast<const u16*>(p);
    return make_uint2((u32)h[0] | ((u32)h[1] << 16), (u32)h[2] | ((u32)h[3] << 16));
}

EMBER_DEV u16 ld16(const u8* p) { return *reinterpret_cast<const u16*>(p); }

// two words of 4 bytes each (values < 2^23 per byte) -> 8 floats minus bias
EMBER_DEV void bytes_to_floats(u32 a, u32 b, float bias, float q[8]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        q[k] = magic_byte(a, k) - bias;
        q[4 + k] = magic_byte(b, k) - bias;
    }
}

// bits 0..3 of x (x < 16) -> bit 0 of bytes 0..3
EMBER_DEV u32 spread4(u32 x) { return (x * 0x00204081u) & 0x01010101u; }

template <int T> struct QT;

// --- float types: a "block" is one unit of 8 elements --------------------------------------------
template <> struct QT<GT_F32> {
    static constexpr int ELEMS = 8, BYTES = 32, UNITS = 1, CB = 64;
    static constexpr bool HAS_MIN = false, IS_FLOAT = true, SMEM_A8 = true;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int, float q[8], float& s, float& o) {
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            uint2 w = load8<A8>(p + 8 * h);
            q[2 * h] = __uint_as_float(w.x);
            q[2 * h + 1] = __uint_as_float(w.y);
        }
        s = 1.0f; o = 0.0f;
    }
};

template <> struct QT<GT_F16> {
    static constexpr int ELEMS = 8, BYTES = 16, UNITS = 1, CB = 128;
    static constexpr bool HAS_MIN = false, IS_FLOAT = true, SMEM_A8 = true;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int, float q[8], float& s, float& o) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint2 w = load8<A8>(p + 8 * h);
            q[4 * h + 0] = h2f((u16)(w.x & 0xffffu));
            q[4 * h + 1] = h2f((u16)(w.x >> 16));
            q[4 * h + 2] = h2f((u16)(w.y & 0xffffu));
            q[4 * h + 3] = h2f((u16)(w.y >> 16));
        }
        s = 1.0f; o = 0.0f;
    }
};

template <> struct QT<GT_BF16> {
    static constexpr int ELEMS = 8, BYTES = 16, UNITS = 1, CB = 128;
    static constexpr bool HAS_MIN = false, IS_FLOAT = true, SMEM_A8 = true;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int, float q[8], float& s, float& o) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint2 w = load8<A8>(p + 8 * h);
            q[4 * h + 0] = __uint_as_float(w.x << 16);
            q[4 * h + 1] = __uint_as_float(w.x & 0xffff0000u);
            q[4 * h + 2] = __uint_as_float(w.y << 16);
            q[4 * h + 3] = __uint_as_float(w.y & 0xffff0000u);
        }
        s = 1.0f; o = 0.0f;
    }
};

// --- 32-element legacy blocks ---------------------------------------------------------------------
// Q4_0: d, qs[16]; element j = low nibble of qs[j], element j+16 = high nibble; w = d * (q - 8)
template <> struct QT<GT_Q4_0> {
    static constexpr int ELEMS = BLOCK_ELEMS_Q4_0, BYTES = BLOCK_BYTES_Q4_0, UNITS = 4, CB = 64;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = false;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        uint2 w = load8<false>(p + 2 + 8 * (u & 1));
        const int sh = 4 * (u >> 1);
        bytes_to_floats((w.x >> sh) & 0x0F0F0F0Fu, (w.y >> sh) & 0x0F0F0F0Fu, 8388616.0f, q);
        s = h2f(ld16(p)); o = 0.0f;
    }
};

// Q5_0: d, qh (u32), qs[16]; as Q4_0 plus bit e of qh as bit 4 of element e; w = d * (q - 16)
template <> struct QT<GT_Q5_0> {
    static constexpr int ELEMS = BLOCK_ELEMS_Q5_0, BYTES = BLOCK_BYTES_Q5_0, UNITS = 4, CB = 64;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = false;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        uint2 w = load8<false>(p + 6 + 8 * (u & 1));
        const u32 qh = (u32)ld16(p + 2) | ((u32)ld16(p + 4) << 16);
        const u32 hb = (qh >> (8 * u)) & 0xFFu;
        const int sh = 4 * (u >> 1);
        const u32 a = ((w.x >> sh) & 0x0F0F0F0Fu) | (spread4(hb & 0xFu) << 4);
        const u32 b = ((w.y >> sh) & 0x0F0F0F0Fu) | (spread4(hb >> 4) << 4);
        bytes_to_floats(a, b, 8388624.0f, q);
        s = h2f(ld16(p)); o = 0.0f;
    }
};

// Q8_0: d, qs[32] signed; w = d * q
template <> struct QT<GT_Q8_0> {
    static constexpr int ELEMS = BLOCK_ELEMS_Q8_0, BYTES = BLOCK_BYTES_Q8_0, UNITS = 4, CB = 32;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = false;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        uint2 w = load8<false>(p + 2 + 8 * u);
        bytes_to_floats(w.x ^ 0x80808080u, w.y ^ 0x80808080u, 8388736.0f, q);  // (q + 128) - 128
        s = h2f(ld16(p)); o = 0.0f;
    }
};

// --- 256-element K-quants ---------------------------------------------------------------------------
// ggml's get_scale_min_k4: 6-bit scale and min of sub-block j from the 12 packed bytes
EMBER_DEV void scale_min_k4(const u8* sc, int j, u32& d, u32& m) {
    if (j < 4) {
        d = sc[j] & 63u;
        m = sc[j + 4] & 63u;
    } else {
        d = (sc[j + 4] & 0xFu) | ((u32)(sc[j - 4] >> 6) << 4);
        m = ((u32)sc[j + 4] >> 4) | ((u32)(sc[j] >> 6) << 4);
    }
}

// Q4_K: d, dmin, scales[12], qs[128]. Sub-block j (32 elements): qs bytes [32c, 32c+32) with c = j/2,
// low nibbles for even j, high for odd; w = (d * sc) * q - (dmin * m)
template <> struct QT<GT_Q4_K> {
    static constexpr int ELEMS = BLOCK_ELEMS_Q4_K, BYTES = BLOCK_BYTES_Q4_K, UNITS = 32, CB = 8;
    static constexpr bool HAS_MIN = true, IS_FLOAT = false, SMEM_A8 = true;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const int j = u >> 2, t = u & 3;
        uint2 w = load8<A8>(p + 16 + 32 * (j >> 1) + 8 * t);
        const int sh = 4 * (j & 1);
        bytes_to_floats((w.x >> sh) & 0x0F0F0F0Fu, (w.y >> sh) & 0x0F0F0F0Fu, 8388608.0f, q);
        u32 sc, m;
        scale_min_k4(p + 4, j, sc, m);
        s = h2f(ld16(p)) * (float)sc;
        o = h2f(ld16(p + 2)) * (float)m;
    }
};

// Q5_K: d, dmin, scales[12], qh[32], qs[128]; as Q4_K plus bit j of qh[l] as bit 4 of element l of
// sub-block j
template <> struct QT<GT_Q5_K> {
    static constexpr int ELEMS = BLOCK_ELEMS_Q5_K, BYTES = BLOCK_BYTES_Q5_K, UNITS = 32, CB = 8;
    static constexpr bool HAS_MIN = true, IS_FLOAT = false, SMEM_A8 = true;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const int j = u >> 2, t = u & 3;
        uint2 w = load8<A8>(p + 48 + 32 * (j >> 1) + 8 * t);
        uint2 h = load8<A8>(p + 16 + 8 * t);
        const int sh = 4 * (j & 1);
        const u32 a = ((w.x >> sh) & 0x0F0F0F0Fu) | (((h.x >> j) & 0x01010101u) << 4);
        const u32 b = ((w.y >> sh) & 0x0F0F0F0Fu) | (((h.y >> j) & 0x01010101u) << 4);
        bytes_to_floats(a, b, 8388608.0f, q);
        u32 sc, m;
        scale_min_k4(p + 4, j, sc, m);
        s = h2f(ld16(p)) * (float)sc;
        o = h2f(ld16(p + 2)) * (float)m;
    }
};

// Q6_K: ql[128], qh[64], scales[16] (int8), d. Half h (128 elements): element e takes the nibble
// (e / 64) of ql[64h + e % 64] and bits 2*(e / 32).. of qh[32h + e % 32] as its top 2 bits;
// sub-blocks of 16 with a signed scale; w = (d * sc) * (q - 32)
template <> struct QT<GT_Q6_K> {
    static constexpr int ELEMS = BLOCK_ELEMS_Q6_K, BYTES = BLOCK_BYTES_Q6_K, UNITS = 32, CB = 8;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = false;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const int h = u >> 4, e0 = 8 * (u & 15);
        uint2 l = load8<false>(p + 64 * h + (e0 & 63));
        uint2 hi = load8<false>(p + 128 + 32 * h + (e0 & 31));
        const int shl = 4 * (e0 >> 6), shh = 2 * (e0 >> 5);
        const u32 a = ((l.x >> shl) & 0x0F0F0F0Fu) | (((hi.x >> shh) & 0x03030303u) << 4);
        const u32 b = ((l.y >> shl) & 0x0F0F0F0Fu) | (((hi.y >> shh) & 0x03030303u) << 4);
        bytes_to_floats(a, b, 8388640.0f, q);
        s = h2f(ld16(p + 208)) * (float)(int)(i8)p[192 + 8 * h + (e0 >> 4)];
        o = 0.0f;
    }
};

// Q6_K as the device stores it (ops.QuantMatrix.upload): each 210-byte block followed by 14 bytes of
// padding, so every block and each of its fields is 16-byte aligned and can be read in 16-byte loads.
template <> struct QT<GT_Q6_KP> : QT<GT_Q6_K> {
    static_assert(BLOCK_ELEMS_Q6_KP == BLOCK_ELEMS_Q6_K && BLOCK_BYTES_Q6_KP % 16 == 0, "a Q6_K block, padded");
    static constexpr int BYTES = BLOCK_BYTES_Q6_KP;
    static constexpr bool SMEM_A8 = true;
};

// Q4_1, Q5_1, Q2_K, Q3_K, the i-quants and MXFP4
#include "quant_lowbit.cuh"
