// Embedding lookup: out[t] = table[ids[t]]. One block per token, threads stride over the row.
#include "common.cuh"

template <typename T>
__global__ void embedding_kernel(const T* __restrict__ table, const int* __restrict__ ids, T* __restrict__ out,
                                 int vocab_size, int hidden) {
    const int id = ids[blockIdx.x];
    T* row = out + (long long)blockIdx.x * hidden;
    // The host validates ids; this guard only keeps a bad id from reading outside the table.
    const bool valid = id >= 0 && id < vocab_size;
    const T* src = table + (long long)(valid ? id : 0) * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) row[i] = valid ? src[i] : from_float<T>(0.0f);
}
