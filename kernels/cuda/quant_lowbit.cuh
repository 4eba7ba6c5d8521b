// The block formats beyond quant.cuh's first ten (issue 39): Q4_1, Q5_1, the 2-3-bit K-quants (Q2_K,
// Q3_K), the i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS) and MXFP4, decoded 8
// elements at a time through the same QT<T>::unit interface (quant.cuh's header says how a unit is
// used), so every kernel that reads blocks through it -- the staged and grouped expert matvecs
// (matvec.cu), the tensor-core tiles (qgemm.cu), dequant.cu -- takes them unchanged.
//
// Each unit is w_i = s * q_i - o with q_i an integer held exactly in a float, s and o computed as
// ggml's dequantize_row_* (and gguf-py's dequantize_blocks, the numpy backend's decoder) compute them,
// operation for operation in float32: dequant.cu's separately rounded s * q - o then reproduces their
// values bit for bit. The i-quants' q_i are grid magnitudes with a sign (s * (-g) is exactly -(s * g));
// the grids and 16-entry tables come from quant_tables.cuh, which kernels/quant_tables.py generates
// from gguf-py's own tables.
//
// Alignment: blocks of 20, 24, 84 and 136 bytes are read with 32-bit loads (a row's blocks are then
// 4-byte aligned wherever the kernels read them); those of 66-110 bytes (2 mod 4) with 16-bit loads;
// MXFP4's 17-byte blocks (any alignment) with aligned 32-bit loads shifted into place. Included by
// quant.cuh, after its helpers.
#pragma once
#include "quant_tables.cuh"

// 8 bytes at p, 4-byte aligned
EMBER_DEV uint2 load8a4(const u8* p) {
    const u32* w = reinterpret_cast<const u32*>(p);
    return make_uint2(w[0], w[1]);
}
EMBER_DEV u32 ld32a2(const u8* p) { return (u32)ld16(p) | ((u32)ld16(p + 2) << 16); }
// 8 bytes at any p: the aligned words that hold them, funnel-shifted (three loads, or two when p is
// aligned, where eight byte loads were the unit's limit). Each word read holds at least one of the 8
// bytes, so no read leaves the aligned extent of the tensor (a row's last block may end its allocation).
EMBER_DEV uint2 ld64_any(const u8* p) {
    const int at = (int)(reinterpret_cast<unsigned long long>(p) & 3ull);
    const u32* w = reinterpret_cast<const u32*>(p - at);
    const u32 w0 = w[0], w1 = w[1], w2 = at ? w[2] : 0u, sh = 8u * (u32)at;
    return make_uint2(__funnelshift_r(w0, w1, sh), __funnelshift_r(w1, w2, sh));
}

// the bytes of a 16-entry table (four words w0..w3) at four indices, one in the low nibble of each byte
// of idx (high nibbles zero): two PRMTs pick from entries 0-7 and 8-15, a third chooses per byte
EMBER_DEV u32 table16(u32 idx, u32 w0, u32 w1, u32 w2, u32 w3) {
    const u32 t = idx | (idx >> 4);
    const u32 sel = (t & 0xFFu) | ((t >> 8) & 0xFF00u);  // the four indices as a selector's nibbles
    const u32 lo = __byte_perm(w0, w1, sel), hi = __byte_perm(w2, w3, sel);
    return __byte_perm(lo, hi, 0x3210u | ((sel & 0x8888u) >> 1));
}

// ggml's ksigns_iq2xs[i]: the 7 stored sign bits and an 8th that makes their count even
EMBER_DEV u32 ksign(u32 i) { return i | ((u32)(__popc(i) & 1) << 7); }

// q[k] negated where bit k of sg is set (a flip of the float's sign bit: exact)
EMBER_DEV void apply_signs(float q[8], u32 sg) {
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = __uint_as_float(__float_as_uint(q[k]) ^ (((sg >> k) & 1u) << 31));
}

// --- 32-element blocks with a minimum, 4-byte aligned -------------------------------------------------
// Q4_1: d, m, qs[16]; element j = low nibble of qs[j], j + 16 the high one; w = d * q + m (o = -m)
template <> struct QT<GT_Q4_1> {
    static constexpr int ELEMS = BLOCK_ELEMS_Q4_1, BYTES = BLOCK_BYTES_Q4_1, UNITS = 4, CB = 64;
    static constexpr bool HAS_MIN = true, IS_FLOAT = false, SMEM_A8 = false;
    static_assert(BYTES % 4 == 0, "32-bit loads");
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const uint2 w = load8a4(p + 4 + 8 * (u & 1));
        const int sh = 4 * (u >> 1);
        bytes_to_floats((w.x >> sh) & 0x0F0F0F0Fu, (w.y >> sh) & 0x0F0F0F0Fu, 8388608.0f, q);
        const u32 dm = *reinterpret_cast<const u32*>(p);
        s = h2f((u16)(dm & 0xFFFFu));
        o = -h2f((u16)(dm >> 16));
    }
};

// Q5_1: d, m, qh (u32), qs[16]; as Q4_1 plus bit e of qh as bit 4 of element e; 8-byte aligned blocks
template <> struct QT<GT_Q5_1> {
    static constexpr int ELEMS = BLOCK_ELEMS_Q5_1, BYTES = BLOCK_BYTES_Q5_1, UNITS = 4, CB = 64;
    static constexpr bool HAS_MIN = true, IS_FLOAT = false, SMEM_A8 = true;
    static_assert(BYTES % 8 == 0, "qs 8-byte aligned where the row is");
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const uint2 w = A8 ? load8<true>(p + 8 + 8 * (u & 1)) : load8a4(p + 8 + 8 * (u & 1));
        const u32 hb = (*reinterpret_cast<const u32*>(p + 4) >> (8 * u)) & 0xFFu;
        const int sh = 4 * (u >> 1);
        const u32 a = ((w.x >> sh) & 0x0F0F0F0Fu) | (spread4(hb & 0xFu) << 4);
        const u32 b = ((w.y >> sh) & 0x0F0F0F0Fu) | (spread4(hb >> 4) << 4);
        bytes_to_floats(a, b, 8388608.0f, q);
        const u32 dm = *reinterpret_cast<const u32*>(p);
        s = h2f((u16)(dm & 0xFFFFu));
        o = -h2f((u16)(dm >> 16));
    }
};

// --- 2-3-bit K-quants ------------------------------------------------------------------------------------
// Q2_K: scales[16], qs[64], d, dmin. Element e = 128 h + 32 j + l takes bits 2j, 2j+1 of qs[32 h + l];
// sub-block e / 16 has scale byte sc: w = (d * (sc & 15)) * q - (dmin * (sc >> 4))
template <> struct QT<GT_Q2_K> {
    static constexpr int ELEMS = BLOCK_ELEMS_Q2_K, BYTES = BLOCK_BYTES_Q2_K, UNITS = 32, CB = 16;
    static constexpr bool HAS_MIN = true, IS_FLOAT = false, SMEM_A8 = false;
    static_assert(BYTES % 4 == 0, "32-bit loads");
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const int h = u >> 4, j = (u >> 2) & 3;
        const uint2 w = load8a4(p + 16 + 32 * h + 8 * (u & 3));
        bytes_to_floats((w.x >> (2 * j)) & 0x03030303u, (w.y >> (2 * j)) & 0x03030303u, 8388608.0f, q);
        const u32 sc = p[u >> 1], dd = *reinterpret_cast<const u32*>(p + 80);
        s = h2f((u16)(dd & 0xFFFFu)) * (float)(sc & 0xFu);
        o = h2f((u16)(dd >> 16)) * (float)(sc >> 4);
    }
};

// Q3_K: hmask[32], qs[64], scales[12], d. Element e = 128 h + 32 j + l: low 2 bits from bits 2j of
// qs[32 h + l], and 4 subtracted unless bit (4 h + j) of hmask[l] is set; sub-block e / 16 has the
// 6-bit scale (low 4 bits: nibble e / 128 of scales[e / 16 % 8], high 2: bits 2 (e / 64) of
// scales[8 + e / 16 % 4]) less 32; w = (d * scale) * q
template <> struct QT<GT_Q3_K> {
    static constexpr int ELEMS = BLOCK_ELEMS_Q3_K, BYTES = BLOCK_BYTES_Q3_K, UNITS = 32, CB = 8;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = false;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const int h = u >> 4, j = (u >> 2) & 3, bit = u >> 2, l0 = 8 * (u & 3);
        const uint2 ql = load8<false>(p + 32 + 32 * h + l0), hm = load8<false>(p + l0);
        const u32 a = ((ql.x >> (2 * j)) & 0x03030303u) | (((hm.x >> bit) & 0x01010101u) << 2);
        const u32 b = ((ql.y >> (2 * j)) & 0x03030303u) | (((hm.y >> bit) & 0x01010101u) << 2);
        bytes_to_floats(a, b, 8388612.0f, q);  // (q + 4 hbit) - 4
        const int i = u >> 1;
        const u32 lo = ((u32)p[96 + (i & 7)] >> (4 * (i >> 3))) & 0xFu;
        const u32 hi = ((u32)p[104 + (i & 3)] >> (2 * (i >> 2))) & 3u;
        s = h2f(ld16(p + 108)) * (float)((int)(lo | (hi << 4)) - 32);
        o = 0.0f;
    }
};

// --- i-quants: grid magnitudes with signs ----------------------------------------------------------------
// IQ2_XXS: d, qs[32] (u16). Sub-block ib of 32 elements: 8 bytes, the first four grid indices (one
// per 8 elements), the last a word whose bits 7 l.. index unit l's signs and whose top 4 the scale;
// w = (d * (0.5 + scale) * 0.25) * (+-grid)
template <> struct QT<GT_IQ2_XXS> {
    static constexpr int ELEMS = BLOCK_ELEMS_IQ2_XXS, BYTES = BLOCK_BYTES_IQ2_XXS, UNITS = 32, CB = 16;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = false;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const u8* g = p + 2 + 8 * (u >> 2);
        const u32 aux = ld32a2(g + 4);
        const u64 grid = ember_iq2xxs_grid(g[u & 3]);
        bytes_to_floats((u32)grid, (u32)(grid >> 32), 8388608.0f, q);
        apply_signs(q, ksign((aux >> (7 * (u & 3))) & 127u));
        s = h2f(ld16(p)) * (0.5f + (float)(aux >> 28)) * 0.25f;
        o = 0.0f;
    }
};

// IQ2_XS: d, qs[32] (u16: a 9-bit grid index and a 7-bit sign index per unit), scales[8] (a nibble per
// 16 elements); w = (d * (0.5 + scale) * 0.25) * (+-grid)
template <> struct QT<GT_IQ2_XS> {
    static constexpr int ELEMS = BLOCK_ELEMS_IQ2_XS, BYTES = BLOCK_BYTES_IQ2_XS, UNITS = 32, CB = 16;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = false;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const u32 v = ld16(p + 2 + 2 * u);
        const u64 grid = ember_iq2xs_grid(v & 511u);
        bytes_to_floats((u32)grid, (u32)(grid >> 32), 8388608.0f, q);
        apply_signs(q, ksign(v >> 9));
        const u32 sc = ((u32)p[66 + (u >> 2)] >> (4 * ((u >> 1) & 1))) & 0xFu;
        s = h2f(ld16(p)) * (0.5f + (float)sc) * 0.25f;
        o = 0.0f;
    }
};

// IQ2_S: d, qs[32] (grid index low bits), signs[32] (a byte per unit), qh[8] (index bits 8-9, two per
// unit), scales[8]; w = (d * (0.5 + scale) * 0.25) * (+-grid)
template <> struct QT<GT_IQ2_S> {
    static constexpr int ELEMS = BLOCK_ELEMS_IQ2_S, BYTES = BLOCK_BYTES_IQ2_S, UNITS = 32, CB = 16;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = false;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const int ib = u >> 2, l = u & 3;
        const u32 idx = (u32)p[2 + u] | (((u32)p[66 + ib] << (8 - 2 * l)) & 0x300u);
        const u64 grid = ember_iq2s_grid(idx);
        bytes_to_floats((u32)grid, (u32)(grid >> 32), 8388608.0f, q);
        apply_signs(q, p[34 + u]);
        const u32 sc = ((u32)p[74 + ib] >> (4 * (l >> 1))) & 0xFu;
        s = h2f(ld16(p)) * (0.5f + (float)sc) * 0.25f;
        o = 0.0f;
    }
};

// IQ3_XXS: d, qs[64] (a grid index per 4 elements), then a word per 32 elements (sign indices 7 l..,
// scale in its top 4 bits); w = (d * (0.5 + scale) * 0.5) * (+-grid)
template <> struct QT<GT_IQ3_XXS> {
    static constexpr int ELEMS = BLOCK_ELEMS_IQ3_XXS, BYTES = BLOCK_BYTES_IQ3_XXS, UNITS = 32, CB = 8;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = false;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const u8* qs = p + 2 + 2 * u;
        const u32 aux = ld32a2(p + 66 + 4 * (u >> 2));
        bytes_to_floats(ember_iq3xxs_grid(qs[0]), ember_iq3xxs_grid(qs[1]), 8388608.0f, q);
        apply_signs(q, ksign((aux >> (7 * (u & 3))) & 127u));
        s = h2f(ld16(p)) * (0.5f + (float)(aux >> 28)) * 0.5f;
        o = 0.0f;
    }
};

// IQ3_S: d, qs[64] (grid index low bits per 4 elements), qh[8] (bit 8 of each index), signs[32] (a
// byte per unit), scales[4] (a nibble per 32 elements); w = (d * (1 + 2 scale)) * (+-grid)
template <> struct QT<GT_IQ3_S> {
    static constexpr int ELEMS = BLOCK_ELEMS_IQ3_S, BYTES = BLOCK_BYTES_IQ3_S, UNITS = 32, CB = 8;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = false;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const int ib = u >> 2, l = u & 3;
        const u32 qh = p[66 + ib];
        const u32 i1 = (u32)p[2 + 2 * u] | ((qh << (8 - 2 * l)) & 256u);
        const u32 i2 = (u32)p[3 + 2 * u] | ((qh << (7 - 2 * l)) & 256u);
        bytes_to_floats(ember_iq3s_grid(i1), ember_iq3s_grid(i2), 8388608.0f, q);
        apply_signs(q, p[74 + u]);
        const u32 sc = ((u32)p[106 + (ib >> 1)] >> (4 * (ib & 1))) & 0xFu;
        s = h2f(ld16(p)) * (float)(1 + 2 * (int)sc);
        o = 0.0f;
    }
};

// --- 4-bit codes through a 16-entry table -----------------------------------------------------------------
// the table's values (+ EMBER_TABLE_BIAS, as bytes) of the 8 codes in nibble `sh` of w's bytes, as floats
template <u32 W0, u32 W1, u32 W2, u32 W3>
EMBER_DEV void table_floats(uint2 w, int sh, float q[8]) {
    bytes_to_floats(table16((w.x >> sh) & 0x0F0F0F0Fu, W0, W1, W2, W3),
                    table16((w.y >> sh) & 0x0F0F0F0Fu, W0, W1, W2, W3), 8388608.0f + EMBER_TABLE_BIAS, q);
}

// IQ4_NL: d, qs[16] as Q4_0; w = d * kvalues_iq4nl[q]
template <> struct QT<GT_IQ4_NL> {
    static constexpr int ELEMS = BLOCK_ELEMS_IQ4_NL, BYTES = BLOCK_BYTES_IQ4_NL, UNITS = 4, CB = 64;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = false;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        table_floats<EMBER_IQ4NL_W0, EMBER_IQ4NL_W1, EMBER_IQ4NL_W2, EMBER_IQ4NL_W3>(
            load8<false>(p + 2 + 8 * (u & 1)), 4 * (u >> 1), q);
        s = h2f(ld16(p));
        o = 0.0f;
    }
};

// IQ4_XS: d, scales_h (u16: 2 high bits per 32 elements), scales_l[4] (a nibble per 32), qs[128]; sub-
// block ib as an IQ4_NL block's quants at qs[16 ib]; w = (d * (scale - 32)) * kvalues_iq4nl[q]
template <> struct QT<GT_IQ4_XS> {
    static constexpr int ELEMS = BLOCK_ELEMS_IQ4_XS, BYTES = BLOCK_BYTES_IQ4_XS, UNITS = 32, CB = 8;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = true;
    static_assert(BYTES % 8 == 0, "qs 8-byte aligned where the row is");
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const int ib = u >> 2;
        const u8* qs = p + 8 + 16 * ib + 8 * (u & 1);
        table_floats<EMBER_IQ4NL_W0, EMBER_IQ4NL_W1, EMBER_IQ4NL_W2, EMBER_IQ4NL_W3>(
            A8 ? load8<true>(qs) : load8a4(qs), 4 * ((u >> 1) & 1), q);
        const u32 lo = ((u32)p[4 + (ib >> 1)] >> (4 * (ib & 1))) & 0xFu, hi = ((u32)ld16(p + 2) >> (2 * ib)) & 3u;
        const u32 ls = lo | (hi << 4);
        s = h2f(ld16(p)) * (float)((int)ls - 32);
        o = 0.0f;
    }
};

// MXFP4: e (an E8M0 scale), qs[16] as Q4_0; w = 2^(e - 128) * kvalues_mxfp4[q] (doubled e2m1 values;
// ggml's GGML_E8M0_TO_FP32_HALF, subnormal below e = 2)
template <> struct QT<GT_MXFP4> {
    static constexpr int ELEMS = BLOCK_ELEMS_MXFP4, BYTES = BLOCK_BYTES_MXFP4, UNITS = 4, CB = 64;
    static constexpr bool HAS_MIN = false, IS_FLOAT = false, SMEM_A8 = false;
    template <bool A8>
    static EMBER_DEV void unit(const u8* p, int u, float q[8], float& s, float& o) {
        const u8* qs = p + 1 + 8 * (u & 1);
        table_floats<EMBER_MXFP4_W0, EMBER_MXFP4_W1, EMBER_MXFP4_W2, EMBER_MXFP4_W3>(
            ld64_any(qs), 4 * (u >> 1), q);
        const u32 e = p[0];
        s = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
        o = 0.0f;
    }
};
