"""quant.cuh's block decoders, compiled for the CPU with the host's C++ compiler, against gguf-py.

The same header text NVRTC compiles (quant.cuh, quant_lowbit.cuh and the generated quant_tables.cuh)
is built with a stand-in for common.cuh that spells the few CUDA intrinsics it uses in plain C++
(__byte_perm, __popc, the float bit casts, fp16 -> fp32), then every unit of random blocks of every
device type is decoded as dequant.cu decodes it (w = s * q - o, each rounded) and compared with
gguf-py's `dequantize` bit for bit. No GPU is needed: this is where the decoders' bit layouts are held
to ggml's on CI; tests/test_kernels_quants_gpu.py checks the kernels themselves on a device. Skips
where no C++ compiler exists.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from gguf import quants as peer
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from ember.kernels import build, constants, ops, quant_tables
from ember.kernels.quants import BLOCK_DTYPES

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

# common.cuh's part that quant.cuh uses, for the host
SHIM = r"""
#pragma once
#include <cstdint>
#include <cstring>
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
#define EMBER_DEV inline
#define __device__
#define __constant__
struct uint2 { u32 x, y; };
inline uint2 make_uint2(u32 x, u32 y) { return uint2{x, y}; }
inline float __uint_as_float(u32 i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline u32 __float_as_uint(float f) { u32 i; std::memcpy(&i, &f, 4); return i; }
inline u32 __byte_perm(u32 x, u32 y, u32 s) {  // CUDA's: 3 bits of each of the low 4 selector nibbles
    const u64 t = ((u64)y << 32) | x;
    u32 r = 0;
    for (int n = 0; n < 4; ++n) r |= (u32)((t >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
    return r;
}
inline int __popc(u32 x) { return __builtin_popcount(x); }
inline u32 __funnelshift_r(u32 lo, u32 hi, u32 shift) { return (u32)((((u64)hi << 32) | lo) >> (shift & 31)); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float h2f(u16 h) {
    const u32 sign = (u32)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) {
        const float f = (float)m * 5.9604644775390625e-08f;  // subnormal: m * 2^-24, exact
        return sign ? -f : f;
    }
    return __uint_as_float(sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13)));
}
"""

MAIN = r"""
#include "quant.cuh"
#include <cstdio>
#include <cstdlib>
#include <vector>
template <int T, bool A8>
static void decode(const u8* blocks, long n, float* out) {
    typedef QT<T> Q;
    for (long b = 0; b < n; ++b)
        for (int u = 0; u < Q::UNITS; ++u) {
            float q[8], s, o;
            Q::template unit<A8>(blocks + b * Q::BYTES, u, q, s, o);
            for (int k = 0; k < 8; ++k)
                out[b * Q::ELEMS + u * 8 + k] = Q::IS_FLOAT ? q[k] : __fsub_rn(__fmul_rn(s, q[k]), o);
        }
}
template <int T>
static int run(bool a8, const char* in, const char* out) {
    FILE* f = std::fopen(in, "rb");
    std::vector<u8> raw;
    for (int c; (c = std::fgetc(f)) != EOF;) raw.push_back((u8)c);
    std::fclose(f);
    std::vector<u64> buf((raw.size() + 7) / 8 + 2);  // 8-byte aligned, as a row the A8 path reads
    std::memcpy(buf.data(), raw.data(), raw.size());
    const long n = (long)raw.size() / QT<T>::BYTES;
    std::vector<float> w(n * QT<T>::ELEMS);
    if (a8) decode<T, true>((const u8*)buf.data(), n, w.data());
    else decode<T, false>((const u8*)buf.data(), n, w.data());
    f = std::fopen(out, "wb");
    std::fwrite(w.data(), 4, w.size(), f);
    std::fclose(f);
    return 0;
}
int main(int argc, char** argv) {
    const int t = std::atoi(argv[1]);
    const bool a8 = std::atoi(argv[2]) != 0;
    switch (t) {
""" + "".join(f"    case GT_{name.upper()}: return run<GT_{name.upper()}>(a8, argv[3], argv[4]);\n"
              for name in constants.KERNEL_TYPES) + r"""
    }
    return 2;
}
"""

# the device type -> (the ggml type gguf-py decodes, how the device stores its bytes)
DEVICE_TYPES = {name: T(tid if name != "q6_kp" else T.Q6_K) for name, tid in constants.GGML_TYPE_IDS.items()}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler here")
    d = tmp_path_factory.mktemp("decoders")
    for name in ("quant.cuh", "quant_lowbit.cuh"):
        shutil.copy(build.SOURCE_DIR / name, d / name)
    (d / quant_tables.HEADER_NAME).write_bytes(quant_tables.header())
    (d / "common.cuh").write_text(SHIM)
    (d / "main.cpp").write_text(MAIN)
    exe = d / "decode"
    cmd = [CXX, "-std=c++17", "-O1", "-ffp-contract=off", "-Wno-unknown-pragmas", "-I", str(d),
           *constants.defines(), "-o", str(exe), str(d / "main.cpp")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]

    def run(name: str, raw: np.ndarray, a8: bool) -> np.ndarray:
        src, dst = d / f"{name}.in", d / f"{name}.out"
        src.write_bytes(np.ascontiguousarray(raw, np.uint8).tobytes())
        subprocess.run([str(exe), str(constants.GGML_TYPE_IDS[name]), str(int(a8)), str(src), str(dst)], check=True)
        return np.fromfile(dst, np.float32)

    return run


def random_blocks(t: T, n: int, rng: np.random.Generator) -> np.ndarray:
    """n random blocks of t: random bytes, fp16 scales finite over a wide range (subnormals and zero
    too), MXFP4's exponents across their range (its subnormal scales at 0 and 1 among them)."""
    block, size = GGML_QUANT_SIZES[t]
    if t in (T.F32, T.F16, T.BF16):
        vals = rng.normal(0, 1, n * block).astype(np.float32)
        if t == T.F32:
            return vals.view(np.uint8)
        return vals.astype(np.float16).view(np.uint8) if t == T.F16 else (vals.view(np.uint32) >> 16).astype(
            np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, n * size, dtype=np.uint8)
    blocks = raw.view(BLOCK_DTYPES[t])
    for field in blocks.dtype.names:
        if blocks.dtype[field] == np.dtype("<f2"):
            v = (2.0 ** rng.uniform(-26, 4, n) * rng.choice([-1.0, 1.0], n)).astype(np.float16)
            v[rng.random(n) < 0.02] = 0
            blocks[field] = v
    if t == T.MXFP4:
        blocks["e"] = rng.integers(0, 250, n, dtype=np.uint8)
        blocks["e"][:4] = [0, 1, 2, 127]
    return raw


@pytest.mark.parametrize("name", constants.KERNEL_TYPES)
def test_every_decoder_matches_gguf_py_bit_for_bit(decoder, name):
    t = DEVICE_TYPES[name]
    rng = np.random.default_rng(constants.GGML_TYPE_IDS[name])
    raw = random_blocks(t, 304, rng)  # whole units of 8 for the float types
    want = peer.dequantize(raw.reshape(1, -1), t).reshape(-1).astype(np.float32)
    stored = ops.repack_q6_k(raw) if name == "q6_kp" else raw
    for a8 in (False, True):
        got = decoder(name, stored, a8)
        assert got.shape == want.shape
        bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert not bad.size, f"{name} a8={a8}: {bad.size} differ, first at {bad[0]}: {got[bad[0]]} vs {want[bad[0]]}"


def test_the_sign_formula_is_gguf_pys_ksigns_table():
    table = np.frombuffer(peer.IQ2_XXS.ksigns, np.uint8)
    np.testing.assert_array_equal(quant_tables.ksigns(np.arange(128)), table)


def test_the_generated_tables_hold_gguf_pys_values():
    """Each grid word is its row of gguf-py's grid, a byte an element; the 16-entry tables are its kvalues."""
    for name, cls in (("iq2xxs", peer.IQ2_XXS), ("iq2xs", peer.IQ2_XS), ("iq2s", peer.IQ2_S),
                      ("iq3xxs", peer.IQ3_XXS), ("iq3s", peer.IQ3_S)):
        words = quant_tables.grids()[name]
        cls.init_grid()
        grid = np.asarray(cls.grid).reshape(cls.grid_shape)
        assert len(words) == grid.shape[0]
        np.testing.assert_array_equal(words.view(np.uint8).reshape(grid.shape), grid)
    text = quant_tables.header().decode()
    assert "u64 grid[1024]" in text and "u32 grid[512]" in text
    assert list(quant_tables.value_tables()["IQ4NL"]) == list(peer.IQ4_NL.kvalues)
    assert list(quant_tables.value_tables()["MXFP4"]) == list(peer.MXFP4.kvalues)
