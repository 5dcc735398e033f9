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
// The first key a query at `position` sees: key 0, or with a sliding window (window > 0) the first of the
// last `window` keys up to its own.
__device__ __forceinline__ int window_begin(int position, int window) {
    return window > 0 ? max(0, position - window + 1) : 0;
}

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

// Sum or max over the whole block (blockDim.x a multiple of 32, at most 1024): each warp reduces its
// lanes, lane 0 of each warp leaves the result in `scratch` (32 floats of shared memory), and every warp
// then reduces those. The leading barrier lets callers reuse scratch for consecutive reductions.
template <bool IS_MAX>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
    v = IS_MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : (IS_MAX ? negative_infinity() : 0.0f);
    return IS_MAX ? warp_max(v) : warp_sum(v);
}
__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce<false>(v, scratch); }
__device__ __forceinline__ float block_max(float v, float* scratch) { return block_reduce<true>(v, scratch); }

// Asynchronous global -> shared copies (cp.async, sm_80+): the copy engine moves the bytes while the
// thread goes on issuing loads or computing, so several tiles can be in flight per thread. A copy is
// only guaranteed to have landed once the issuing thread's cp_async_wait<N>() has released its group
// (and other threads see it after a __syncthreads()). Inline PTX for nvcc and NVRTC; the CPU emulator
// models the same groups (its copies land exactly at the wait, and the destination reads as NaN before).
//   cp_async_16(smem, gmem)             16 bytes, L2 only (.cg: streamed data that this CTA reads once)
//   cp_async_16_zfill(smem, gmem, ok)   the same, or 16 zero bytes without reading gmem when !ok
//   cp_async_ca<4|8|16>(smem, gmem)     through L1 (.ca: data other CTAs of the SM may reuse)
//   cp_async_commit()                   closes the group of copies issued since the last commit
//   cp_async_wait<N>()                  returns when at most the newest N committed groups are pending
//   cp_async_wait_all()                 commit, then wait for everything
#ifdef __CUDACC__
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_16_zfill(void* smem, const void* gmem, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(smem)), "l"(gmem),
                 "r"(ok ? 16 : 0));
}
template <int BYTES>
__device__ __forceinline__ void cp_async_ca(void* smem, const void* gmem) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async.ca copies 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(shared_address(smem)), "l"(gmem), "n"(BYTES));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
#else
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
    emu::cp_async(smem, gmem, 16, 16, "cp_async_16");
}
__device__ __forceinline__ void cp_async_16_zfill(void* smem, const void* gmem, bool ok) {
    emu::cp_async(smem, gmem, 16, ok ? 16 : 0, "cp_async_16_zfill");
}
template <int BYTES>
__device__ __forceinline__ void cp_async_ca(void* smem, const void* gmem) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async.ca copies 4, 8 or 16 bytes");
    emu::cp_async(smem, gmem, BYTES, BYTES, "cp_async_ca");
}
__device__ __forceinline__ void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { emu::cp_async_wait(N); }
__device__ __forceinline__ void cp_async_wait_all() {
    emu::cp_async_commit();
    emu::cp_async_wait(0);
}
#endif

// ---- CTAs that wait for each other -------------------------------------------------------------------
// A barrier among a group of CTAs through a global counter: each CTA's thread 0 arrives once per barrier
// (after a fence, so the CTA's global writes, ordered before it by __syncthreads, are visible first), then
// waits until the whole group has. Sound only when every CTA of the group is resident at once: the host
// launches at most one CTA per SM. The CPU emulator starts a blocked launch's remaining blocks on more
// threads, as a GPU with enough SMs runs them (minisarathi_emu.h: blocks_wait).
#ifdef __CUDACC__
__device__ __forceinline__ void blocks_arrive(unsigned long long* counter) {
    __threadfence();
    atomicAdd(counter, 1ull);
}
__device__ __forceinline__ void blocks_wait(const unsigned long long* counter, unsigned long long target) {
    while (*reinterpret_cast<const volatile unsigned long long*>(counter) < target) __nanosleep(64);
    __threadfence();
}
#else
__device__ __forceinline__ void blocks_arrive(unsigned long long* counter) { emu::blocks_arrive(counter); }
__device__ __forceinline__ void blocks_wait(const unsigned long long* counter, unsigned long long target) {
    emu::blocks_wait(counter, target);
}
#endif

// ---- tensor cores (sm_80 and later) ------------------------------------------------------------------
// Warp-collective: all 32 lanes of the warp call these together. Fragment layouts are the PTX ISA's
// ("Matrix Fragments for mma.m16n8k16", "ldmatrix"); each unsigned register holds two 16-bit elements,
// the lower-indexed one in the low half. Under nvcc and NVRTC (__CUDACC__) they are inline PTX; under
// the CPU emulator, minisarathi_emu_mma.h implements them with the same per-lane ownership.

// c[4] += A[16x16] * B[16x8] in fp32 (mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32).
template <typename T> __device__ __forceinline__ void mma_m16n8k16(float c[4], const unsigned a[4], const unsigned b[2]);

// r[i] = fragment of the 8x8 matrix whose rows lanes 8i..8i+7 address (16-byte aligned shared memory);
// _trans delivers the transpose. smem_row is this lane's row address (ignored beyond lane 8 * count).
#ifdef __CUDACC__
template <> __device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma_m16n8k16<__half>(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void ldmatrix_x1(unsigned r[1], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(shared_address(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned r[2], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(shared_address(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x1_trans(unsigned r[1], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(shared_address(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned r[2], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(shared_address(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(smem_row)));
}
#else
template <> __device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float c[4], const unsigned a[4], const unsigned b[2]) {
    emu::mma_m16n8k16(c, a, b, c, emu::Mma16::bf16);
}
template <> __device__ __forceinline__ void mma_m16n8k16<__half>(float c[4], const unsigned a[4], const unsigned b[2]) {
    emu::mma_m16n8k16(c, a, b, c, emu::Mma16::f16);
}
__device__ __forceinline__ void ldmatrix_x1(unsigned r[1], const void* smem_row) { emu::ldmatrix(r, 1, false, smem_row); }
__device__ __forceinline__ void ldmatrix_x2(unsigned r[2], const void* smem_row) { emu::ldmatrix(r, 2, false, smem_row); }
__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* smem_row) { emu::ldmatrix(r, 4, false, smem_row); }
__device__ __forceinline__ void ldmatrix_x1_trans(unsigned r[1], const void* smem_row) { emu::ldmatrix(r, 1, true, smem_row); }
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned r[2], const void* smem_row) { emu::ldmatrix(r, 2, true, smem_row); }
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* smem_row) { emu::ldmatrix(r, 4, true, smem_row); }
#endif

// Two floats rounded to T and packed into one fragment register (lo in the low half).
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) | (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16;
}
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    return (unsigned)__half_as_ushort(__float2half_rn(lo)) | (unsigned)__half_as_ushort(__float2half_rn(hi)) << 16;
}
