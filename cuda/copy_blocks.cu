// Copy-on-write of KV blocks for parallel sampling (n > 1): the choices of a request share its prompt's
// blocks, and a choice about to write into a shared, partly filled block first gets a copy of it.
//
// One CUDA block per (source, destination) pair, its threads striding over the block's elements
// (num_kv_heads * block_size * head_dim of them, contiguous in the [num_blocks, Hk, block_size, D] cache).
// The host launches it once per layer for the keys and once for the values; it runs only in the steps
// where a fork's first decodes happen.
#include "common.cuh"

template <typename T>
__global__ void copy_blocks_kernel(T* __restrict__ cache, const int* __restrict__ pairs, int block_elems) {
    const long long source = pairs[2 * blockIdx.x], destination = pairs[2 * blockIdx.x + 1];
    const T* from = cache + source * block_elems;
    T* to = cache + destination * block_elems;
    for (int i = threadIdx.x; i < block_elems; i += blockDim.x)
        to[i] = from[i];
}
