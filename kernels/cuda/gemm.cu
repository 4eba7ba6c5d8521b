// Dense matmul for prefill on the tensor cores: C[M, N] = A[M, K] @ B[N, K]^T (+ R), 16-bit inputs
// with float32 accumulation and output.
//
// Prefill multiplies many token rows by each weight matrix, so the weights are worth decoding once
// per call (dequant.cu's 16-bit variants write B) and the activations are converted to 16 bits
// (to_half below); the matmul itself is then bound by arithmetic, not by bytes.
//
// gemm_<h>: a CTA computes a 128 x 128 tile of C with 8 warps (2 x 4, each 64 x 32) from a
// double-buffered 32-deep slice of A and B in shared memory, loaded with cp.async (rows beyond M or N
// are zero-filled) and fed to mma.sync m16n8k16 through ldmatrix. Rows are padded to 40 halves so the
// 8 row addresses of each ldmatrix fall in different banks. K must be a multiple of 32 (every model
// dimension is). h = f16 or bf16: bf16 keeps the float32 exponent range, for models (Gemma) whose
// activations can exceed what f16 holds.
#include "mma.cuh"

// GEMM_TILE_M x GEMM_TILE_N (the CTA's tile of C), GEMM_TILE_K (the K slice a stage holds) and
// GEMM_THREADS come from kernels/constants.py; the warp layout and load_tile are written for these:
static_assert(GEMM_TILE_M == 2 * 64 && GEMM_TILE_N == 4 * 32 && GEMM_THREADS == 8 * 32,
              "8 warps, 2 x 4, each 64 x 32 of the tile");
static_assert(GEMM_TILE_K == 32 && GEMM_TILE_M * GEMM_TILE_K / 8 == 2 * GEMM_THREADS &&
                  GEMM_TILE_N * GEMM_TILE_K / 8 == 2 * GEMM_THREADS,
              "load_tile: four 16-byte pieces a row, two a thread");
#define GM_LD (GEMM_TILE_K + 8)  // halves per shared-memory row: 8 of padding

// Load one 128 x 32 slice of a row-major [rows, K] matrix into shared memory: 512 16-byte pieces,
// two per thread.
EMBER_DEV void load_tile(u16 (*dst)[GM_LD], const u16* __restrict__ src, int row0, int rows, int K, int k0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int piece = threadIdx.x + i * GEMM_THREADS;
        const int r = piece >> 2, c = (piece & 3) * 8;
        const int gr = row0 + r;
        const bool ok = gr < rows;
        cp_async16(smem_addr(&dst[r][c]), src + (ok ? (i64)gr * K + k0 + c : 0), ok);
    }
}

template <bool BF>
EMBER_DEV void gemm(const u16* __restrict__ A, const u16* __restrict__ B, const float* R, float* C, int M, int N,
                    int K, i64 ldc) {
    // split-K (gridDim.z > 1): this CTA multiplies one run of K and writes its partial tile to
    // C + z * M * ldc (a workspace; R is applied by gemm_splitk_reduce), so a small M still fills the GPU
    const int nk_all = K / GEMM_TILE_K, per = (nk_all + gridDim.z - 1) / gridDim.z;
    const int kt0 = blockIdx.z * per, nk = max(0, min(nk_all, kt0 + per) - kt0);
    if (gridDim.z > 1) {
        C += (i64)blockIdx.z * M * ldc;
        R = nullptr;
    }
    A += (i64)kt0 * GEMM_TILE_K;
    B += (i64)kt0 * GEMM_TILE_K;
    __shared__ __align__(16) u16 sa[2][GEMM_TILE_M][GM_LD];
    __shared__ __align__(16) u16 sb[2][GEMM_TILE_N][GM_LD];
    const int m0 = blockIdx.y * GEMM_TILE_M, n0 = blockIdx.x * GEMM_TILE_N;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    if (nk > 0) {
        load_tile(sa[0], A, m0, M, K, 0);
        load_tile(sb[0], B, n0, N, K, 0);
    }
    asm volatile("cp.async.commit_group;");
    for (int kt = 0; kt < nk; ++kt) {
        const int cur = kt & 1;
        if (kt + 1 < nk) {
            load_tile(sa[cur ^ 1], A, m0, M, K, (kt + 1) * GEMM_TILE_K);
            load_tile(sb[cur ^ 1], B, n0, N, K, (kt + 1) * GEMM_TILE_K);
        }
        asm volatile("cp.async.commit_group;");
        asm volatile("cp.async.wait_group 1;");
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < GEMM_TILE_K; ks += 16) {
            u32 af[4][4], bfr[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = wm + i * 16 + (lane & 15), c = ks + (lane >> 4) * 8;
                ldmatrix_x4(smem_addr(&sa[cur][r][c]), af[i][0], af[i][1], af[i][2], af[i][3]);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {  // two n8 tiles per ldmatrix.x4
                const int r = wn + j * 16 + (lane & 7) + ((lane >> 4) << 3), c = ks + ((lane >> 3) & 1) * 8;
                ldmatrix_x4(smem_addr(&sb[cur][r][c]), bfr[2 * j][0], bfr[2 * j][1], bfr[2 * j + 1][0],
                            bfr[2 * j + 1][1]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma16816<BF>(acc[i][j], af[i], bfr[j]);
        }
        __syncthreads();  // the next iteration's loads overwrite the buffer just read
    }

    // epilogue: c0,c1 at (row lane/4, cols 2*(lane%4) + 0/1); c2,c3 eight rows below
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int r = m0 + wm + i * 16 + (lane >> 2) + hh * 8;
                const int c = n0 + wn + j * 8 + (lane & 3) * 2;
                if (r >= M) continue;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (c + e >= N) continue;
                    float v = acc[i][j][hh * 2 + e];
                    if (R) v += R[(i64)r * ldc + c + e];
                    C[(i64)r * ldc + c + e] = v;
                }
            }
}

// C = sum over the splits of the workspace (+ R): the second half of a split-K matmul.
extern "C" __global__ void gemm_splitk_reduce(const float* __restrict__ ws, int splits, i64 mn, const float* R,
                                              float* C) {
    grid_dependency_sync();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < mn; i += (i64)gridDim.x * blockDim.x) {
        float v = R ? R[i] : 0.0f;
        for (int z = 0; z < splits; ++z) v += ws[(i64)z * mn + i];
        C[i] = v;
    }
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS) gemm_f16(const u16* A, const u16* B, const float* R,
                                                                    float* C, int M, int N, int K, i64 ldc) {
    grid_dependency_sync();
    gemm<false>(A, B, R, C, M, N, K, ldc);
}
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) gemm_bf16(const u16* A, const u16* B, const float* R,
                                                                     float* C, int M, int N, int K, i64 ldc) {
    grid_dependency_sync();
    gemm<true>(A, B, R, C, M, N, K, ldc);
}

// x (float32, n elements) to 16 bits: f16 (round to nearest) or bf16 (nearest even).
extern "C" __global__ void to_f16(const float* __restrict__ x, u16* __restrict__ out, i64 n) {
    grid_dependency_sync();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = f2h(x[i]);
}
extern "C" __global__ void to_bf16(const float* __restrict__ x, u16* __restrict__ out, i64 n) {
    grid_dependency_sync();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = f2bf(x[i]);
}
