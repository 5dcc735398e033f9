// Shared helpers for the kernels in this folder. Every kernel file includes this header first.
//
// One source serves three compilers: NVRTC (CuPy at run time), nvcc (register reports) and g++
// through the CPU emulator (minisarathi/backends/emulator). Hence: __device__ on every helper,
// templates instantiated by name, no INFINITY macro, no implicit warp-synchronous code.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Element types: kernels load T, compute in float, store T. One overload per type keeps call
// sites the same for float, __half and __nv_bfloat16.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }

constexpr unsigned FULL_WARP = 0xffffffffu;

// Butterfly reductions: after log2(32) exchanges every lane holds the result.
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_WARP, v, offset);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_WARP, v, offset));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). `scratch` holds 32 floats
// of shared memory. The leading barrier lets callers reuse scratch for consecutive reductions.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : negative_infinity();
    return warp_max(v);
}
