// RoPE and the KV-cache write in one launch: rotates each token's query heads in place and writes its
// rotated key heads and its value heads into the paged cache (one read of K and V, no write back).
//
// Rotation: half-split ("rotate_half") layout; for i < D/2 the pair (x[i], x[i + D/2]) is rotated by the
// angle position * inv_freq[i], read from a float32 table cos_sin[position] = [cos(angles) | sin(angles)]
// that the host builds once from float64 angles (minisarathi/model/rope.py), so far positions stay exact
// to float32 and every scaled RoPE variant (they only change inv_freq) is served alike.
// Cache layout per layer: [num_blocks, num_kv_heads, block_size, head_dim]; token t goes to slot
// slot_mapping[t] = block * block_size + offset; a negative slot means padding: nothing is stored.
// q, k and v may be row-strided views of the fused QKV output; heads inside a row are contiguous.
// One block per token; a thread takes N consecutive elements (16 bytes where the shapes allow, vec.cuh).
#include "common.cuh"
#include "vec.cuh"

template <int N, typename T>
__device__ void rope_store_kv_token(T* q, const T* k, const T* v, T* k_cache, T* v_cache, const float* cos_sin,
                                    int slot, int num_q_heads, int num_kv_heads, int head_dim, int block_size) {
    const int half = head_dim / 2, per_head = half / N;
    const int rotations = (num_q_heads + (slot >= 0 ? num_kv_heads : 0)) * per_head;
    const int items = rotations + (slot >= 0 ? num_kv_heads * head_dim / N : 0);
    // Element (head h, d) of this token's slot lives at slot_base + h * head_stride + d.
    const long long head_stride = (long long)block_size * head_dim;
    const long long slot_base =
        slot >= 0 ? ((long long)(slot / block_size) * num_kv_heads * block_size + slot % block_size) * head_dim : 0;
    for (int item = threadIdx.x; item < items; item += blockDim.x) {
        if (item < rotations) {
            const int head = item / per_head, i = (item % per_head) * N;
            const bool is_q = head < num_q_heads;
            const T* src = is_q ? q + (long long)head * head_dim : k + (long long)(head - num_q_heads) * head_dim;
            T* dst = is_q ? q + (long long)head * head_dim : k_cache + slot_base + (head - num_q_heads) * head_stride;
            const Vec<T, N> x1 = load_vec<N>(src + i), x2 = load_vec<N>(src + half + i);
            Vec<T, N> y1, y2;
            for (int j = 0; j < N; ++j) {
                const float c = cos_sin[i + j], s = cos_sin[half + i + j];
                const float a = to_float(x1.v[j]), b = to_float(x2.v[j]);
                y1.v[j] = from_float<T>(a * c - b * s);
                y2.v[j] = from_float<T>(b * c + a * s);
            }
            store_vec<N>(dst + i, y1);
            store_vec<N>(dst + half + i, y2);
        } else {
            const int e = (item - rotations) * N, head = e / head_dim, d = e % head_dim;
            store_vec<N>(v_cache + slot_base + head * head_stride + d, load_vec<N>(v + e));
        }
    }
}

template <typename T>
__global__ void rope_store_kv_kernel(T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                     T* __restrict__ k_cache, T* __restrict__ v_cache,
                                     const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                                     const float* __restrict__ cos_sin, int num_q_heads, int num_kv_heads,
                                     int head_dim, int block_size, long long q_stride, long long k_stride,
                                     long long v_stride) {
    constexpr int N = vector_width<T>();
    const long long t = blockIdx.x;
    T* q_row = q + t * q_stride;
    const T* k_row = k + t * k_stride;
    const T* v_row = v + t * v_stride;
    const float* angles = cos_sin + (long long)positions[t] * head_dim;
    const int slot = slot_mapping[t];
    if ((head_dim / 2) % N == 0 && aligned16(q_row) && aligned16(k_row) && aligned16(v_row) && aligned16(k_cache) &&
        aligned16(v_cache))
        rope_store_kv_token<N>(q_row, k_row, v_row, k_cache, v_cache, angles, slot, num_q_heads, num_kv_heads,
                               head_dim, block_size);
    else
        rope_store_kv_token<1>(q_row, k_row, v_row, k_cache, v_cache, angles, slot, num_q_heads, num_kv_heads,
                               head_dim, block_size);
}
