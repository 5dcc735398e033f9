// Writes this step's keys and values into the paged KV cache.
//
// Cache layout per layer: [num_blocks, num_kv_heads, block_size, head_dim], so one head's block is a
// contiguous run of block_size * head_dim elements. Token t goes to slot slot_mapping[t] =
// block * block_size + offset. A negative slot means "padding, do not store". One block per token.
#include "common.cuh"

template <typename T>
__global__ void store_kv_kernel(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_cache,
                                T* __restrict__ v_cache, const int* __restrict__ slot_mapping, int num_kv_heads,
                                int head_dim, int block_size, long long k_stride, long long v_stride) {
    const int t = blockIdx.x;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const long long block = slot / block_size, offset = slot % block_size;
    const int row = num_kv_heads * head_dim;
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
        const int head = i / head_dim, d = i % head_dim;
        const long long dst = ((block * num_kv_heads + head) * block_size + offset) * head_dim + d;
        k_cache[dst] = k[t * k_stride + i];
        v_cache[dst] = v[t * v_stride + i];
    }
}
