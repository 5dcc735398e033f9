// Kernels for the emulator's cp.async model (tests/system/test_emulator_cp_async.py): one correct
// double-buffered copy and the two classic mistakes, which must read poisoned data on the CPU.
#include "common.cuh"

enum Mistake { NONE = 0, NO_WAIT = 1, WRONG_GROUP = 2 };

// out[i] = 2 * in[i] for i < n, through two shared-memory stages. Block b streams tiles b, b + gridDim.x, ...
// of blockDim.x chunks of BYTES each, prefetching tile k + 1 while it consumes tile k. Each thread
// consumes the chunk *another* thread copied (mirrored index), so the copy must have landed for the whole
// block: the copying thread's wait, then __syncthreads(). Chunks past n are zero-filled (16-byte cg) or
// not copied (ca), and their outputs are written (cg: must be 0) or skipped (ca).
template <int BYTES, bool VIA_L1, int MISTAKE>
__global__ void double_buffered_copy(const float* __restrict__ in, float* __restrict__ out, int n) {
    constexpr int FLOATS = BYTES / 4;   // per chunk
    extern __shared__ __align__(16) unsigned char smem[];
    float* stage[2] = {reinterpret_cast<float*>(smem), reinterpret_cast<float*>(smem) + blockDim.x * FLOATS};
    const int tile_floats = blockDim.x * FLOATS;
    const int tiles = (n + tile_floats - 1) / tile_floats;

    auto issue = [&](int tile, float* dst) {
        const int first = tile * tile_floats + threadIdx.x * FLOATS;
        float* d = dst + threadIdx.x * FLOATS;
        if (VIA_L1) {
            if (first < n) cp_async_ca<BYTES>(d, in + first);
        } else {
            cp_async_16_zfill(d, in + (first < n ? first : 0), first < n);
        }
    };

    int k = 0;
    if (blockIdx.x < tiles) issue(blockIdx.x, stage[0]);
    cp_async_commit();
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++k) {
        if (tile + (int)gridDim.x < tiles) issue(tile + gridDim.x, stage[(k + 1) % 2]);
        cp_async_commit();              // always one group per iteration (possibly empty)
        if (MISTAKE == NONE) cp_async_wait<1>();          // all but the prefetch just issued: tile k landed
        if (MISTAKE == WRONG_GROUP) cp_async_wait<2>();   // off by one: leaves tile k in flight
        __syncthreads();
        const int mirrored = blockDim.x - 1 - threadIdx.x;
        const float* src = stage[k % 2] + mirrored * FLOATS;
        for (int f = 0; f < FLOATS; ++f) {
            const int i = tile * tile_floats + mirrored * FLOATS + f;
            if (i < n || (!VIA_L1 && i < tiles * tile_floats)) out[i] = 2.0f * src[f];
        }
        __syncthreads();                // every thread done with stage k % 2 before it is refilled
    }
    cp_async_wait_all();
}

template __global__ void double_buffered_copy<16, false, NONE>(const float*, float*, int);
template __global__ void double_buffered_copy<16, true, NONE>(const float*, float*, int);
template __global__ void double_buffered_copy<8, true, NONE>(const float*, float*, int);
template __global__ void double_buffered_copy<4, true, NONE>(const float*, float*, int);
template __global__ void double_buffered_copy<16, false, NO_WAIT>(const float*, float*, int);
template __global__ void double_buffered_copy<16, false, WRONG_GROUP>(const float*, float*, int);

// Issues a copy and returns without waiting: the emulator stops the launch with a clear error.
extern "C" __global__ void exit_without_wait(const float* __restrict__ in) {
    extern __shared__ __align__(16) unsigned char smem[];
    cp_async_16(smem + 16 * threadIdx.x, in + 4 * threadIdx.x);
    cp_async_commit();
}

// A cp.async whose destination is global memory: an error on the GPU, and here.
extern "C" __global__ void copy_to_global(const float* __restrict__ in, float* __restrict__ out) {
    cp_async_16(out, in);
    cp_async_wait_all();
}
