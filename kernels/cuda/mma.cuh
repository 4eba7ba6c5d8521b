// Tensor-core building blocks (sm_80+ instructions, used on Hopper as well): shared-memory
// addresses, cp.async, ldmatrix and mma.sync m16n8k16 with float32 accumulation. Shared by the
// prefill matmul (gemm.cu) and flash attention (flash.cu).
#pragma once
#include "common.cuh"

EMBER_DEV u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

EMBER_DEV void cp_async16(u32 dst, const void* src, bool valid) {
    const int bytes = valid ? 16 : 0;  // 0: zero-fill the destination
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}

EMBER_DEV void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// the same with each 8x8 matrix transposed (B fragments from a [k][n] row-major tile)
EMBER_DEV void ldmatrix_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

EMBER_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
EMBER_DEV void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// two floats -> one register of two f16 (lo in the low half)
EMBER_DEV u32 pack_f16x2(float lo, float hi) {
    return (u32)f2h(lo) | ((u32)f2h(hi) << 16);
}

template <bool BF>
EMBER_DEV void mma16816(float* c, const u32* a, const u32* b) {
    if constexpr (BF) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

