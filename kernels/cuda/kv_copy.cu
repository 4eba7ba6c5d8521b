// Whole KV blocks between the paged pools and a packed staging area, so that persisting or
// restoring many blocks costs one launch and one host copy instead of two strided copies a block.
//
// The pools hold, per layer, (n_blocks + 1) blocks of `words` 16-byte words each (block_size rows of
// kv_dim values: a block's rows are contiguous within a layer); layer l starts `layer_words` words
// into the pool. The staging layout is the KV store's payload layout, block after block:
//   staging[j] = [K | V][layer][words]     for the j-th listed block
// One CTA copies one (block, half, layer) row of `words` words; the launcher checks that a block's
// row is a whole number of 16-byte words (block_size * kv_dim * item bytes; always true for the
// 16-token blocks ember uses).
#include "common.cuh"

extern "C" __global__ void kv_gather(const uint4* __restrict__ k_pool, const uint4* __restrict__ v_pool,
                                     const int* __restrict__ blocks, int layers, i64 layer_words, int words,
                                     uint4* __restrict__ staging) {
    const int row = blockIdx.x;  // (j, half, layer)
    const int layer = row % layers, half = (row / layers) % 2, j = row / (2 * layers);
    const uint4* src = (half ? v_pool : k_pool) + layer * layer_words + (i64)blocks[j] * words;
    uint4* dst = staging + (i64)row * words;
    for (int w = threadIdx.x; w < words; w += blockDim.x) dst[w] = src[w];
}

extern "C" __global__ void kv_scatter(uint4* __restrict__ k_pool, uint4* __restrict__ v_pool,
                                      const int* __restrict__ blocks, int layers, i64 layer_words, int words,
                                      const uint4* __restrict__ staging) {
    const int row = blockIdx.x;
    const int layer = row % layers, half = (row / layers) % 2, j = row / (2 * layers);
    uint4* dst = (half ? v_pool : k_pool) + layer * layer_words + (i64)blocks[j] * words;
    const uint4* src = staging + (i64)row * words;
    for (int w = threadIdx.x; w < words; w += blockDim.x) dst[w] = src[w];
}
