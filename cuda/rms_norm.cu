// RMSNorm, and the fused residual-add + RMSNorm that every decoder layer runs twice.
//
// One block per token row; each thread takes N consecutive elements per access (16 bytes when the row
// allows, see vec.cuh), strided over the hidden dimension so loads stay coalesced. The statistics are
// accumulated in float whatever T is.
#include "common.cuh"
#include "vec.cuh"

template <int N, typename T>
__device__ void rms_norm_row(const T* x, const T* weight, T* out, int hidden, float eps, float* scratch) {
    float sum_sq = 0.0f;
    for (int i = threadIdx.x * N; i < hidden; i += blockDim.x * N) {
        const Vec<T, N> a = load_vec<N>(x + i);
        for (int j = 0; j < N; ++j) sum_sq += to_float(a.v[j]) * to_float(a.v[j]);
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
    for (int i = threadIdx.x * N; i < hidden; i += blockDim.x * N) {
        const Vec<T, N> a = load_vec<N>(x + i), w = load_vec<N>(weight + i);
        Vec<T, N> o;
        for (int j = 0; j < N; ++j) o.v[j] = from_float<T>(to_float(a.v[j]) * inv_rms * to_float(w.v[j]));
        store_vec<N>(out + i, o);
    }
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, over rows r = t * heads + h of x[T, heads, hidden] whose
// tokens lie token_stride elements apart (a row-strided q or k view of the QKV output; heads 1 otherwise).
template <typename T>
__global__ void rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ out,
                                int hidden, float eps, int heads, long long token_stride) {
    __shared__ float scratch[32];
    constexpr int N = vector_width<T>();
    const T* in = x + (blockIdx.x / heads) * token_stride + (long long)(blockIdx.x % heads) * hidden;
    T* row_out = out + (long long)blockIdx.x * hidden;
    if (hidden % N == 0 && aligned16(in) && aligned16(weight) && aligned16(row_out))
        rms_norm_row<N>(in, weight, row_out, hidden, eps, scratch);
    else
        rms_norm_row<1>(in, weight, row_out, hidden, eps, scratch);
}

template <int N, typename T>
__device__ void add_rms_norm_row(const T* x, T* residual, const T* weight, T* out, int hidden, float eps,
                                 float* scratch) {
    float sum_sq = 0.0f;
    for (int i = threadIdx.x * N; i < hidden; i += blockDim.x * N) {
        const Vec<T, N> a = load_vec<N>(x + i);
        Vec<T, N> r = load_vec<N>(residual + i);
        for (int j = 0; j < N; ++j) {
            r.v[j] = from_float<T>(to_float(a.v[j]) + to_float(r.v[j]));
            sum_sq += to_float(r.v[j]) * to_float(r.v[j]);
        }
        store_vec<N>(residual + i, r);
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
    // Each thread re-reads only the elements it wrote itself, so no barrier is needed before this loop.
    for (int i = threadIdx.x * N; i < hidden; i += blockDim.x * N) {
        const Vec<T, N> r = load_vec<N>(residual + i), w = load_vec<N>(weight + i);
        Vec<T, N> o;
        for (int j = 0; j < N; ++j) o.v[j] = from_float<T>(to_float(r.v[j]) * inv_rms * to_float(w.v[j]));
        store_vec<N>(out + i, o);
    }
}

// residual[t] += x[t]; out[t] = rms_norm(residual[t]).
// The norm reads the residual after rounding to T, so it normalizes exactly what the next layer adds to.
template <typename T>
__global__ void add_rms_norm_kernel(const T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight,
                                    T* __restrict__ out, int hidden, float eps) {
    __shared__ float scratch[32];
    constexpr int N = vector_width<T>();
    const long long row = (long long)blockIdx.x * hidden;
    if (hidden % N == 0 && aligned16(x) && aligned16(residual) && aligned16(weight) && aligned16(out))
        add_rms_norm_row<N>(x + row, residual + row, weight, out + row, hidden, eps, scratch);
    else
        add_rms_norm_row<1>(x + row, residual + row, weight, out + row, hidden, eps, scratch);
}
