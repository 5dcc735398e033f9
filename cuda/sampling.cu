// Sampling on the GPU, so that only the sampled ids (and their logprobs) cross to the host.
//
// Every kernel runs one block per row of float32 logits [num_rows, vocab]; blockDim.x is a multiple
// of 32. Randomness comes from the host as one uniform number in [0, 1) per row: seeded, reproducible,
// and identical to what the CPU sampler would draw. The logprobs of the raw logits are reductions done
// by minisarathi/backends/gpu_sampling.py with array operations, not here.
#include "common.cuh"

// Block-wide (value, index) argmax; ties go to the lowest index, as numpy.argmax does. NaN never wins.
__device__ __forceinline__ void better(float& value, int& index, float other_value, int other_index) {
    if (other_value > value || (other_value == value && other_index < index)) {
        value = other_value;
        index = other_index;
    }
}
__device__ int block_argmax(const float* row, int vocab, float* value_scratch, int* index_scratch) {
    float value = negative_infinity();
    int index = vocab;   // "none yet": loses every tie against a real index
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) better(value, index, row[i], i);
    for (int offset = 16; offset > 0; offset >>= 1)
        better(value, index, __shfl_xor_sync(FULL_WARP, value, offset), __shfl_xor_sync(FULL_WARP, index, offset));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    __syncthreads();
    if (lane == 0) { value_scratch[warp] = value; index_scratch[warp] = index; }
    __syncthreads();
    value = lane < (int)blockDim.x / 32 ? value_scratch[lane] : negative_infinity();
    index = lane < (int)blockDim.x / 32 ? index_scratch[lane] : vocab;
    for (int offset = 16; offset > 0; offset >>= 1)
        better(value, index, __shfl_xor_sync(FULL_WARP, value, offset), __shfl_xor_sync(FULL_WARP, index, offset));
    return index < vocab ? index : 0;   // an all-NaN row falls back to token 0
}

extern "C" __global__ void argmax_kernel(const float* __restrict__ logits, int vocab, int* __restrict__ out_ids) {
    __shared__ float value_scratch[32];
    __shared__ int index_scratch[32];
    const int id = block_argmax(logits + (long long)blockIdx.x * vocab, vocab, value_scratch, index_scratch);
    if (threadIdx.x == 0) out_ids[blockIdx.x] = id;
}

// Repetition, frequency and presence penalties, in place. Row r lists its distinct tokens (prompt and
// output) in tokens[row_offsets[r] .. row_offsets[r+1]) with their counts in the output so far:
// every listed token gets the repetition penalty (divide positive logits, multiply negative ones),
// frequency and presence penalties apply to output counts only (OpenAI semantics). The subtraction is
// done in double and rounded once, as NumPy's promotion does in minisarathi/sampler.py: same bits.
extern "C" __global__ void apply_penalties_kernel(float* __restrict__ logits, int vocab,
                                                  const int* __restrict__ row_offsets, const int* __restrict__ tokens,
                                                  const int* __restrict__ output_counts,
                                                  const float* __restrict__ repetition,
                                                  const float* __restrict__ frequency,
                                                  const float* __restrict__ presence) {
    const int r = blockIdx.x;
    float* row = logits + (long long)r * vocab;
    for (int e = row_offsets[r] + threadIdx.x; e < row_offsets[r + 1]; e += blockDim.x) {
        const int token = tokens[e], count = output_counts[e];
        float x = row[token];
        x = x > 0.0f ? x / repetition[r] : x * repetition[r];
        row[token] = (float)((double)x - (double)frequency[r] * count - (count > 0 ? (double)presence[r] : 0.0));
    }
}

// The unnormalized probability of a logit, exactly as minisarathi/sampler.py computes it in float32:
// exp((x - max) / t) lies in [0, 1] and is 1 for the most likely token.
__device__ __forceinline__ float weight_of(float x, float row_max, float temperature) {
    return expf((x - row_max) / temperature);
}

// Whether a token survives the filters: weights at or above the threshold, never a zero weight.
__device__ __forceinline__ bool kept(float w, float threshold) { return w >= threshold && w > 0.0f; }

// Sum (or count) over the block of the kept weights.
__device__ float kept_mass(const float* row, int vocab, float row_max, float temperature, float threshold,
                           bool count_only, float* scratch) {
    float total = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float w = weight_of(row[i], row_max, temperature);
        if (kept(w, threshold)) total += count_only ? 1.0f : w;
    }
    return block_sum(total, scratch);
}

// Largest threshold tau in [low, 1] with kept_mass(tau) >= target. Weights lie in [0, 1] and positive
// floats order like their bit patterns, so a binary search over the bits takes at most 31 passes.
__device__ float search_threshold(const float* row, int vocab, float row_max, float temperature, float low,
                                  float target, bool count_only, float* scratch) {
    unsigned lo = __float_as_uint(low), hi = __float_as_uint(1.0f);
    while (lo < hi) {
        const unsigned mid = lo + (hi - lo + 1) / 2;
        if (kept_mass(row, vocab, row_max, temperature, __uint_as_float(mid), count_only, scratch) >= target)
            lo = mid;
        else
            hi = mid - 1;
    }
    return __uint_as_float(lo);
}

// One token per row of (already penalized) logits, in minisarathi/sampler.py's order: temperature 0 is
// greedy; otherwise min-p, top-k, then top-p (within the top-k mass) on the weights, and one draw by
// inverse CDF over the kept tokens in index order with the row's uniform number from the host.
// top_k <= 0 or >= vocab, top_p >= 1 and min_p <= 0 disable their filters.
extern "C" __global__ void sample_kernel(const float* __restrict__ logits, int vocab,
                                         const float* __restrict__ temperature, const int* __restrict__ top_k,
                                         const float* __restrict__ top_p, const float* __restrict__ min_p,
                                         const double* __restrict__ uniform, int* __restrict__ out_ids) {
    __shared__ float scratch[32];
    __shared__ int index_scratch[32];
    __shared__ float chunk_mass[1024];
    const int r = blockIdx.x;
    const float* row = logits + (long long)r * vocab;
    const float t = temperature[r];
    if (t <= 0.0f) {
        const int id = block_argmax(row, vocab, scratch, index_scratch);
        if (threadIdx.x == 0) out_ids[r] = id;
        return;
    }
    float local_max = negative_infinity();
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) local_max = fmaxf(local_max, row[i]);
    const float row_max = block_max(local_max, scratch);

    // Each filter keeps the weights above a threshold that only rises.
    float threshold = fmaxf(min_p[r], 0.0f);   // the largest weight is 1, so min-p compares directly
    if (top_k[r] > 0 && top_k[r] < vocab)
        threshold = search_threshold(row, vocab, row_max, t, threshold, (float)top_k[r], true, scratch);
    if (top_p[r] < 1.0f) {
        const float mass = kept_mass(row, vocab, row_max, t, threshold, false, scratch);
        threshold = search_threshold(row, vocab, row_max, t, threshold, top_p[r] * mass, false, scratch);
    }

    // Inverse CDF: each thread owns a contiguous chunk; thread 0 walks the chunk sums, then one chunk.
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int begin = min(vocab, (int)threadIdx.x * chunk), end = min(vocab, begin + chunk);
    float mass = 0.0f;
    for (int i = begin; i < end; ++i) {
        const float w = weight_of(row[i], row_max, t);
        if (kept(w, threshold)) mass += w;
    }
    chunk_mass[threadIdx.x] = mass;
    __syncthreads();
    if (threadIdx.x != 0) return;
    double total = 0.0;
    int last_nonempty = 0;
    for (int c = 0; c < (int)blockDim.x; ++c) {
        total += chunk_mass[c];
        if (chunk_mass[c] > 0.0f) last_nonempty = c;
    }
    // The first token whose running mass passes u * total (double: u keeps all its bits, as on the host).
    double target = uniform[r] * total;
    int c = 0;
    while (c < last_nonempty && target >= chunk_mass[c]) target -= chunk_mass[c++];
    int id = 0;
    for (int i = c * chunk; i < min(vocab, (c + 1) * chunk); ++i) {
        const float w = weight_of(row[i], row_max, t);
        if (!kept(w, threshold)) continue;
        id = i;   // rounding can leave target a hair above the chunk's mass: then the last kept token wins
        if (target < w) break;
        target -= w;
    }
    out_ids[r] = id;
}
