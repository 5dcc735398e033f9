// Structured outputs (minisarathi/structured.py): the tokens a grammar forbids set to -inf, in place, before
// the sampling kernels read the logits. The host computes one bitmask per constrained row (llguidance's
// layout: bit j of 32-bit word w allows token 32 w + j) while the forward runs; only those rows are touched.
//
// One CUDA block per constrained row, its threads striding over the vocabulary; a thread's word is shared
// with its warp's 31 neighbours, so a warp reads one word and writes (or skips) 32 consecutive floats.
#include "common.cuh"

extern "C" __global__ void apply_token_bitmask_kernel(float* __restrict__ logits, int vocab,
                                                      const long long* __restrict__ rows,
                                                      const unsigned* __restrict__ mask, int words) {
    float* row = logits + rows[blockIdx.x] * vocab;
    const unsigned* bits = mask + (long long)blockIdx.x * words;
    for (int t = threadIdx.x; t < vocab; t += blockDim.x)
        if (!((bits[t >> 5] >> (t & 31)) & 1u)) row[t] = negative_infinity();
}
