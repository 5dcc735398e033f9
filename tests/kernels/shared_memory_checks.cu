// A kernel with exactly 16 KiB of static shared memory and dynamic shared memory on top, for the emulator's
// launch limits (tests/system/test_emulator_limits.py): static + dynamic above 48 KiB needs the opt-in.
extern "C" __global__ void static_and_dynamic_shared(float* out) {
    __shared__ float scratch[4096];
    extern __shared__ __align__(16) unsigned char smem[];
    scratch[threadIdx.x] = (float)threadIdx.x;
    smem[threadIdx.x] = 1;
    __syncthreads();
    out[threadIdx.x] = scratch[blockDim.x - 1 - threadIdx.x] + smem[blockDim.x - 1 - threadIdx.x];
}
