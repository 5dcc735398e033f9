// RMSNorm, and the fused residual-add + RMSNorm that every decoder layer runs twice.
//
// One block per token row; threads stride over the hidden dimension so loads are coalesced.
// The statistics are accumulated in float whatever T is.
#include "common.cuh"

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w
template <typename T>
__global__ void rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ out,
                                int hidden, float eps) {
    __shared__ float scratch[32];
    const long long row = (long long)blockIdx.x * hidden;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = to_float(x[row + i]);
        sum_sq += v * v;
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[row + i] = from_float<T>(to_float(x[row + i]) * inv_rms * to_float(weight[i]));
}

// residual[t] += x[t]; out[t] = rms_norm(residual[t]).
// The norm reads the residual after rounding to T, so it normalizes exactly what the next layer adds to.
template <typename T>
__global__ void add_rms_norm_kernel(const T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight,
                                    T* __restrict__ out, int hidden, float eps) {
    __shared__ float scratch[32];
    const long long row = (long long)blockIdx.x * hidden;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const T sum = from_float<T>(to_float(x[row + i]) + to_float(residual[row + i]));
        residual[row + i] = sum;
        const float v = to_float(sum);
        sum_sq += v * v;
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
    // Each thread re-reads only the elements it wrote itself, so no barrier is needed before this loop.
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[row + i] = from_float<T>(to_float(residual[row + i]) * inv_rms * to_float(weight[i]));
}
