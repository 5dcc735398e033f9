// 16-byte vector loads and stores for the elementwise kernels (one LDG.128 / STG.128 per access).
//
// A kernel body is written once as a template over N elements per access and instantiated twice:
// N = vector_width<T>() when the row length is a multiple of N and every pointer is 16-byte aligned
// (checked on the device, a uniform branch per block), N = 1 otherwise (odd hidden sizes, unaligned views).
#pragma once
#include "common.cuh"

template <typename T, int N>
struct __align__(sizeof(T) * N) Vec {
    T v[N];
};

template <typename T>
__device__ __forceinline__ constexpr int vector_width() { return 16 / (int)sizeof(T); }

__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15ull) == 0; }

template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) { return *reinterpret_cast<const Vec<T, N>*>(p); }

template <int N, typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& x) { *reinterpret_cast<Vec<T, N>*>(p) = x; }
