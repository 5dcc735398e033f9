// Embedding lookup: out[t] = table[ids[t]]. A grid-stride loop over (token, group of N columns), with
// 16-byte copies where the row allows (vec.cuh).
#include "common.cuh"
#include "vec.cuh"

template <int N, typename T>
__device__ void embedding_items(const T* table, const int* ids, T* out, int num_tokens, int vocab_size, int hidden) {
    const int per_row = hidden / N;
    const long long items = (long long)num_tokens * per_row;
    for (long long item = (long long)blockIdx.x * blockDim.x + threadIdx.x; item < items;
         item += (long long)gridDim.x * blockDim.x) {
        const long long t = item / per_row;
        const int i = (int)(item - t * per_row) * N;
        const int id = ids[t];
        Vec<T, N> row;
        if (id >= 0 && id < vocab_size) {
            row = load_vec<N>(table + (long long)id * hidden + i);
        } else {   // the host validates ids; this only keeps a bad id from reading outside the table
            for (int j = 0; j < N; ++j) row.v[j] = from_float<T>(0.0f);
        }
        store_vec<N>(out + t * hidden + i, row);
    }
}

template <typename T>
__global__ void embedding_kernel(const T* __restrict__ table, const int* __restrict__ ids, T* __restrict__ out,
                                 int num_tokens, int vocab_size, int hidden) {
    constexpr int N = vector_width<T>();
    if (hidden % N == 0 && aligned16(table) && aligned16(out))
        embedding_items<N>(table, ids, out, num_tokens, vocab_size, hidden);
    else
        embedding_items<1>(table, ids, out, num_tokens, vocab_size, hidden);
}
