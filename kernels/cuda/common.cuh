// Shared helpers for ember's kernels. NVRTC compiles these without the CUDA toolkit's headers, so
// the few fp16/bf16 conversions needed are written out here (inline PTX) instead of cuda_fp16.h.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define EMBER_DEV __device__ __forceinline__
#define NEG_INF __int_as_float(0xff800000u)  // -infinity as a constant expression (no <math> in NVRTC)

// Programmatic dependent launch (sm_90+). A kernel launched with the PDL attribute (Kernel.launch
// inside cuda_runtime.pdl_launches(): the backend's captured decode steps) may start while the
// kernel before it in the stream is still running, to hide launch latency. It must neither read
// that kernel's output nor write anything before grid_dependency_sync(), which waits until the
// previous grid has completed and its memory is visible, then lets the next kernel launch early.
// Every kernel calls it before touching what earlier kernels of the step write. Before it, a kernel
// may read only what no kernel writes: the weights (the matvecs issue their first rows' loads, the
// norms load their weight vectors) and the step's inputs copied from the host (positions, block
// tables: qk_rope_kv computes its angles, attention finds its row) and, in a decode step, the KV
// cache rows of earlier positions (written by earlier steps: attn_decode fetches them into L2).
// Launched without the attribute, both instructions return at once.
//
// Built with EMBER_TRACE (the EMBER_TRACE=1 environment of kernels/build.py: a profiling build, never the
// default), block 0 of every kernel appends (its start, the moment its wait returned) in %globaltimer
// nanoseconds to the buffer ember_trace_buf points at (word 0 counts the words written; the host sets
// the pointer in every module it loads): in a PDL chain the wait of kernel k + 1 returns when kernel k
// is done, so the differences time each kernel where it runs (`ember bench trace`). The buffer holds
// TRACE_WORDS words (kernels/constants.py, as cuda_runtime allocates it).
//
// TRACE_MARK(k) (k < 64), in the same build: block 0's thread 0 stores its SM's clock64 at word
// TRACE_MARKS + k where a phase of its kernel ends; the step's last launch to pass a
// mark keeps it. Marks 0-7: decode attention (attn_warp.cuh); 8-10: the staged batch-1 matvec
// (matvec.cu). `ember bench trace` prints the cycles between them (worker/bench/trace.py PHASES).
static_assert(TRACE_MARKS + 64 <= TRACE_WORDS, "the 64 marks sit at the end of the trace buffer");
#ifdef EMBER_TRACE
__device__ unsigned long long* ember_trace_buf;
EMBER_DEV unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define TRACE_MARK(k)                                                                                    \
    do {                                                                                                  \
        if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && ember_trace_buf) { \
            ember_trace_buf[TRACE_MARKS + (k)] = (unsigned long long)clock64();                         \
        }                                                                                                 \
    } while (0)
#else
#define TRACE_MARK(k) \
    do {              \
    } while (0)
#endif
EMBER_DEV void grid_dependency_sync() {
#ifdef EMBER_TRACE
    const unsigned long long t0 = global_ns();
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#ifdef EMBER_TRACE
    if (threadIdx.x == 0 && threadIdx.y == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && ember_trace_buf) {
        const unsigned long long t1 = global_ns();
        const unsigned long long i = atomicAdd(ember_trace_buf, 2ull);
        if (i < TRACE_MARKS - 2) {
            ember_trace_buf[1 + i] = t0;
            ember_trace_buf[2 + i] = t1;
        }
    }
#endif
}

// Start fetching [p, p + bytes) into L2 and go on (p 16-byte aligned, bytes a multiple of 16).
EMBER_DEV void l2_prefetch(const void* p, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
    for (int o = 0; o < bytes; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)p + o));
#endif
}

EMBER_DEV float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

EMBER_DEV u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

EMBER_DEV float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

EMBER_DEV u16 f2bf(float f) {  // round to nearest even, NaN kept quiet
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// Storage types of activations / KV: float, half (stored as u16 bits) and bf16 (u16 bits).
struct f16_t { u16 v; };
struct bf16_t { u16 v; };
EMBER_DEV float to_f32(float x) { return x; }
EMBER_DEV float to_f32(f16_t x) { return h2f(x.v); }
EMBER_DEV float to_f32(bf16_t x) { return bf2f(x.v); }
template <typename T> EMBER_DEV T from_f32(float x);
template <> EMBER_DEV float from_f32<float>(float x) { return x; }
template <> EMBER_DEV f16_t from_f32<f16_t>(float x) { f16_t r; r.v = f2h(x); return r; }
template <> EMBER_DEV bf16_t from_f32<bf16_t>(float x) { bf16_t r; r.v = f2bf(x); return r; }

EMBER_DEV float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

EMBER_DEV float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
EMBER_DEV float block_sum(float v, float* scratch /* >= 33 floats of shared memory */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    return t;
}

EMBER_DEV float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : -__int_as_float(0x7f800000);
    return warp_max(t);
}

// cos/sin of pos * inv_freq[i] for i < half, times mscale (YaRN's magnitude scale; 1 otherwise), into
// shared memory, the angle and the product in double (as the twin, reference.rope_tables); the caller
// syncs before reading.
EMBER_DEV void rope_table(float* cs, float* sn, int pos, const float* __restrict__ inv_freq, int half, float mscale) {
    const double p = (double)pos, ms = (double)mscale;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const double a = p * (double)inv_freq[i];
        cs[i] = (float)(cos(a) * ms);
        sn[i] = (float)(sin(a) * ms);
    }
}
