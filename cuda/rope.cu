// Rotary position embedding, in place on Q and K, half-split ("rotate_half") layout:
// for i < D/2, the pair (v[i], v[i + D/2]) is rotated by the angle position * inv_freq[i].
//
// Every scaled RoPE variant (linear, llama3, ...) only changes inv_freq, which the loader folds in,
// so this one kernel serves them all. One block per token; each thread rotates (head, i) pairs of
// Q heads then K heads. q and k may be views into the fused QKV matmul output: rows are `q_stride`
// and `k_stride` elements apart, heads inside a row are contiguous.
#include "common.cuh"

template <typename T>
__global__ void rope_kernel(T* __restrict__ q, T* __restrict__ k, const int* __restrict__ positions,
                            const float* __restrict__ inv_freq, int num_q_heads, int num_kv_heads, int head_dim,
                            long long q_stride, long long k_stride) {
    const int t = blockIdx.x;
    const int half = head_dim / 2;
    const float position = (float)positions[t];
    const int pairs = (num_q_heads + num_kv_heads) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int head = p / half, i = p % half;
        T* v = head < num_q_heads ? q + t * q_stride + (long long)head * head_dim
                                  : k + t * k_stride + (long long)(head - num_q_heads) * head_dim;
        // Precise sincosf: angles reach position * 1 radian, far outside __sinf's accurate range.
        float s, c;
        sincosf(position * inv_freq[i], &s, &c);
        const float x1 = to_float(v[i]), x2 = to_float(v[i + half]);
        v[i] = from_float<T>(x1 * c - x2 * s);
        v[i + half] = from_float<T>(x2 * c + x1 * s);
    }
}
