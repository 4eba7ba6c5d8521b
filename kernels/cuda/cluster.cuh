// Thread block clusters (sm_90): the CTAs of one cluster run at once on one GPC and can read each
// other's shared memory (distributed shared memory), so split work merges without another launch or
// a round trip through global memory. Launched without a cluster, a CTA is a cluster of one.
#pragma once
#include "mma.cuh"

EMBER_DEV u32 cluster_ctas() {
    u32 n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}

// Every thread of every CTA of the cluster: writes to shared memory before it are visible to all the
// cluster's CTAs after it. Also keeps a CTA's shared memory alive until the others are done with it.
EMBER_DEV void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}

// The float at p (this CTA's shared memory) in the CTA of cluster rank `rank`. Volatile (kept in order
// with the barriers), with no memory clobber, so several loads can be in flight at once.
EMBER_DEV float cluster_load(const float* p, u32 rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    u32 remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote));
    return v;
#else
    return *p;
#endif
}
