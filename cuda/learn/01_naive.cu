// Step 1 of 4: paged decode attention, the plainest way that is still parallel.
//
// A decode is one query token per sequence; it attends to every key of its sequence. The keys live in a
// paged KV cache: key j of sequence s is row j % block_size of block block_tables[s][j / block_size]
// (docs/cuda.md, "Learning path", draws it). One thread block per (sequence, query head):
//   1. thread i scores keys i, i + blockDim.x, ... (q . k x scale) into shared memory;
//   2. thread 0 alone finds their max and the sum of exp(score - max), the softmax's denominator
//      (subtracting the max keeps exp from overflowing);
//   3. thread d adds up p_j v_j[d] over all keys for its output dimensions d = threadIdx.x, + blockDim.x, ...
// Everything is read straight from global memory, one thread waits on the others' whole context in
// step 2, and all scores sit in shared memory, which bounds the context. Step 2 removes all three.
#include "common.cuh"

template <typename T>
__global__ void naive_attention_kernel(
    const T* __restrict__ q,               // [num_seqs, num_q_heads, head_dim]: one query token per sequence
    const T* __restrict__ k_cache,         // [num_blocks, num_kv_heads, block_size, head_dim]
    const T* __restrict__ v_cache,         // same layout
    const int* __restrict__ block_tables,  // int32[num_seqs, max_blocks_per_seq]
    const int* __restrict__ context_lens,  // int32[num_seqs]: keys of each sequence
    T* __restrict__ out,                   // [num_seqs, num_q_heads, head_dim]
    int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* scores = reinterpret_cast<float*>(smem);   // float[context_len]: scores, then probabilities
    __shared__ float denominator;

    const int seq = blockIdx.x, head = blockIdx.y;
    const int kv_head = head / (num_q_heads / num_kv_heads);   // GQA: a group of query heads shares a KV head
    const int len = context_lens[seq];
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const T* q_head = q + ((long long)seq * num_q_heads + head) * head_dim;

    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const long long block = table[j / block_size];
        const long long row = (block * num_kv_heads + kv_head) * block_size + j % block_size;
        const T* k = k_cache + row * head_dim;
        float dot = 0.0f;
        for (int d = 0; d < head_dim; ++d) dot += to_float(q_head[d]) * to_float(k[d]);
        scores[j] = dot * scale;
    }
    __syncthreads();   // every score written

    if (threadIdx.x == 0) {
        float max_score = negative_infinity();
        for (int j = 0; j < len; ++j) max_score = fmaxf(max_score, scores[j]);
        float sum = 0.0f;
        for (int j = 0; j < len; ++j) {
            scores[j] = expf(scores[j] - max_score);
            sum += scores[j];
        }
        denominator = sum;
    }
    __syncthreads();   // probabilities and their sum written

    T* out_head = out + ((long long)seq * num_q_heads + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < len; ++j) {
            const long long block = table[j / block_size];
            const long long row = (block * num_kv_heads + kv_head) * block_size + j % block_size;
            acc += scores[j] * to_float(v_cache[row * head_dim + d]);
        }
        out_head[d] = from_float<T>(acc / denominator);
    }
}
