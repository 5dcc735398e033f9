// SwiGLU activation: out[t, i] = silu(x[t, i]) * x[t, I + i], with x = [gate | up] from one fused matmul.
#include "common.cuh"

template <typename T>
__global__ void silu_and_mul_kernel(const T* __restrict__ x, T* __restrict__ out, int intermediate) {
    const T* gate = x + (long long)blockIdx.x * 2 * intermediate;
    const T* up = gate + intermediate;
    T* row = out + (long long)blockIdx.x * intermediate;
    for (int i = threadIdx.x; i < intermediate; i += blockDim.x) {
        const float g = to_float(gate[i]);
        // expf, not __expf: the fast version loses accuracy for large |g| where silu(g) ~ g.
        row[i] = from_float<T>(g / (1.0f + expf(-g)) * to_float(up[i]));
    }
}
