// Tiny kernels that the emulator must catch misbehaving (tests/system/test_kernels.py).
#include "common.cuh"

// Missing barrier: thread 0 writes, the others read without __syncthreads. Correct only when
// thread 0 happens to run first (forward order); reverse order exposes it.
extern "C" __global__ void racy_broadcast(const float* in, float* out) {
    __shared__ float value;
    if (threadIdx.x == 0) value = in[0];
    out[threadIdx.x] = value;
}

// The same with the barrier: right under every order.
extern "C" __global__ void synced_broadcast(const float* in, float* out) {
    __shared__ float value;
    if (threadIdx.x == 0) value = in[0];
    __syncthreads();
    out[threadIdx.x] = value;
}

// Reads shared memory nobody wrote: the emulator poisons it with NaN at every block start.
extern "C" __global__ void read_uninitialized(float* out) {
    __shared__ float never_written[65];
    extern __shared__ __align__(16) unsigned char smem[];
    // One store keeps g++ from proving the array is all zeros and folding the reads away.
    if (threadIdx.x == 0) never_written[64] = 1.0f;
    out[2 * threadIdx.x] = never_written[threadIdx.x];
    out[2 * threadIdx.x + 1] = reinterpret_cast<float*>(smem)[threadIdx.x];
}

// Half the block returns early while the other half waits at __syncthreads: a deadlock on a GPU.
extern "C" __global__ void early_exit_barrier(float* out) {
    if (threadIdx.x < 16) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}

// Warp sum through shuffles, and a float parameter that must arrive as a 32-bit float.
extern "C" __global__ void scaled_warp_sum(const float* in, float* out, float scale) {
    const float total = warp_sum(in[blockIdx.x * 32 + threadIdx.x]);
    if (threadIdx.x == 0) out[blockIdx.x] = total * scale;
}

// float -> __half / __nv_bfloat16 -> float, to check the shim's round-to-nearest-even conversions.
extern "C" __global__ void round_trip_16bit(const float* in, float* as_half, float* as_bf16, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    as_half[i] = __half2float(__float2half_rn(in[i]));
    as_bf16[i] = __bfloat162float(__float2bfloat16_rn(in[i]));
}

// Float32 denormals under CuPy's -ftz=true: a product that underflows to a denormal is flushed to zero
// (FTZ), and a denormal operand reads as zero (DAZ). Stores and loads themselves keep the bits.
extern "C" __global__ void flush_to_zero(const float* in, float* out) {
    out[0] = in[0] * in[1];     // 1e-30 * 1e-10: a denormal result
    out[1] = in[2] * in[3];     // a denormal operand times 1 (read at run time: no folding)
    out[2] = in[2] + in[2];     // denormal + denormal
    out[3] = in[2];             // a plain copy: no arithmetic, the bits survive
}
