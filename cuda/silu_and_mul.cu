// SwiGLU activation: out[t, i] = silu(x[t, i]) * x[t, I + i], with x = [gate | up] from one fused matmul.
//
// A grid-stride loop over (token, group of N columns): any number of tokens fills the GPU, one token
// (decode at batch 1) as well as a 2048-token prefill chunk. 16-byte accesses where the row allows (vec.cuh).
#include "common.cuh"
#include "vec.cuh"

template <int N, typename T>
__device__ void silu_and_mul_items(const T* x, T* out, int num_tokens, int intermediate) {
    const int per_row = intermediate / N;
    const long long items = (long long)num_tokens * per_row;
    for (long long item = (long long)blockIdx.x * blockDim.x + threadIdx.x; item < items;
         item += (long long)gridDim.x * blockDim.x) {
        const long long t = item / per_row;
        const int i = (int)(item - t * per_row) * N;
        const T* gate = x + t * 2 * intermediate + i;
        const Vec<T, N> g = load_vec<N>(gate), u = load_vec<N>(gate + intermediate);
        Vec<T, N> o;
        for (int j = 0; j < N; ++j) {
            const float gj = to_float(g.v[j]);
            // expf, not __expf: the fast version loses accuracy for large |g| where silu(g) ~ g.
            o.v[j] = from_float<T>(gj / (1.0f + expf(-gj)) * to_float(u.v[j]));
        }
        store_vec<N>(out + t * intermediate + i, o);
    }
}

template <typename T>
__global__ void silu_and_mul_kernel(const T* __restrict__ x, T* __restrict__ out, int num_tokens, int intermediate) {
    constexpr int N = vector_width<T>();
    if (intermediate % N == 0 && aligned16(x) && aligned16(out))
        silu_and_mul_items<N>(x, out, num_tokens, intermediate);
    else
        silu_and_mul_items<1>(x, out, num_tokens, intermediate);
}
