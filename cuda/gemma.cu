// The elementwise ops Gemma 3 adds (backends/gemma_ops.py has them in NumPy), grid-stride loops in float:
//  - GeGLU: out[t, i] = gelu_tanh(x[t, i]) * x[t, I + i] for x = [gate | up], gelu_tanh(g) =
//    g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), transformers' gelu_pytorch_tanh;
//  - tanh soft-capping of the logits in place: x = tanh(x / cap) cap.
#include "common.cuh"

template <typename T>
__global__ void gelu_tanh_and_mul_kernel(const T* __restrict__ x, T* __restrict__ out, int num_tokens, int intermediate) {
    const long long items = (long long)num_tokens * intermediate;
    for (long long item = (long long)blockIdx.x * blockDim.x + threadIdx.x; item < items;
         item += (long long)gridDim.x * blockDim.x) {
        const long long t = item / intermediate;
        const long long i = item - t * intermediate;
        const float g = to_float(x[t * 2 * intermediate + i]), u = to_float(x[t * 2 * intermediate + intermediate + i]);
        // tanhf, not a fast approximation: the CPU backends use NumPy's tanh
        const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        out[item] = from_float<T>(0.5f * g * (1.0f + tanhf(inner)) * u);
    }
}

template <typename T>
__global__ void softcap_kernel(T* __restrict__ x, long long n, float cap) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = from_float<T>(tanhf(to_float(x[i]) / cap) * cap);
}
