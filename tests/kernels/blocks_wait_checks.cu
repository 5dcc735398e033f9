// Kernels that check the emulator's blocks that wait for each other (cuda/common.cuh: blocks_arrive,
// blocks_wait), used by tests/system/test_gpu_sampling.py.
#include "common.cuh"

// Every block publishes its index, meets the others at one grid-wide barrier, then sums what all
// published: right only if no block read before every block had written.
extern "C" __global__ void sum_after_grid_barrier(unsigned long long* counter, int* published, int* sums) {
    if (threadIdx.x == 0) published[blockIdx.x] = blockIdx.x + 1;
    __syncthreads();
    if (threadIdx.x == 0) {
        blocks_arrive(counter);
        blocks_wait(counter, gridDim.x);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int sum = 0;
        for (int b = 0; b < (int)gridDim.x; ++b) sum += __ldcg(published + b);
        sums[blockIdx.x] = sum;
    }
}
