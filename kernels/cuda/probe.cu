// Launch-latency probes for the micro-benchmark (bench.py --sections launch): what a dependent
// kernel costs inside a PDL-captured graph against an in-kernel grid barrier and a cluster barrier,
// each passing a 640-float vector on (the size of a small model's hidden state). Not used by the
// backend.
#include "cluster.cuh"

extern "C" __global__ void probe_empty(int) { grid_dependency_sync(); }

// one link of a chain: every warp sums x (read through L2) and writes one element of y
extern "C" __global__ void probe_chain(const float* __restrict__ x, float* y, int n) {
    grid_dependency_sync();
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += __ldcg(x + i);
    s = warp_sum(s);
    const int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if ((threadIdx.x & 31) == 0 && w < n) y[w] = s * 1e-3f + 1.0f;
}

// the same links inside one persistent grid (every block resident: grid <= SMs), separated by a
// barrier on a global counter (zeroed before the launch)
extern "C" __global__ void probe_grid_barrier(unsigned* count, float* x, int iters, int n) {
    for (int it = 0; it < iters; ++it) {
        const float* xi = x + (it & 1) * n;
        float* xo = x + ((it + 1) & 1) * n;
        float s = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) s += __ldcg(xi + i);
        s = warp_sum(s);
        const int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
        if ((threadIdx.x & 31) == 0 && w < n) __stcg(xo + w, s * 1e-3f + 1.0f);
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned target = (unsigned)(it + 1) * gridDim.x;
            unsigned v;
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
            } while (v < target);
        }
        __syncthreads();
    }
}

// cluster barriers, each followed by a read of another CTA's shared memory
extern "C" __global__ void probe_cluster_barrier(float* out, int iters) {
    __shared__ float v[32];
    if (threadIdx.x < 32) v[threadIdx.x] = (float)threadIdx.x;
    float s = 0.0f;
    const u32 n = cluster_ctas();
    for (int it = 0; it < iters; ++it) {
        cluster_sync();
        if (threadIdx.x < 32) s += cluster_load(&v[threadIdx.x], (threadIdx.x + it) % n);
    }
    cluster_sync();
    if (threadIdx.x < 32) out[blockIdx.x * 32 + threadIdx.x] = s;
}
