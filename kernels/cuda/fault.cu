// Fault injection (worker --fault cuda-illegal-address): a kernel that really writes to an address no
// allocation maps (ops.fault_illegal_address passes the null page), so the driver reports
// CUDA_ERROR_ILLEGAL_ADDRESS (700) and the context is poisoned. Used to prove the sticky-error path end
// to end.
#include "common.cuh"

extern "C" __global__ void fault_illegal_address(float* p, i64 offset) {
    grid_dependency_sync();
    volatile float* bad = p + offset;
    *bad = 1.0f;
}
