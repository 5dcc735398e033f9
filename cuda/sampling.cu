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

// The cut-offs are order statistics of the weights, found by radix select: weights lie in [0, 1] and
// positive floats order like their bit patterns, so the threshold is fixed 8 bits at a time from the top,
// each digit by one histogram pass over the row (4 passes instead of a 31-step binary search).
// Counts and masses are summed as integers (mass in 2^-40 units): exact, so the result does not depend on
// the order in which threads add, and the same seed gives the same token on every run.
constexpr int RADIX_BINS = 256;
__device__ __forceinline__ unsigned long long fixed_mass(float w) {
    return (unsigned long long)(w * 1099511627776.0f);   // w * 2^40: exact scaling, truncated
}

struct RadixScratch {
    unsigned long long histogram[RADIX_BINS];
    unsigned long long above;   // count (or mass) of kept weights above the bins of the current digit
    unsigned int digit;
};

// Count (or fixed-point mass) over the block of the kept weights (w >= threshold, w > 0).
__device__ unsigned long long kept_total(const float* row, int vocab, float row_max, float temperature,
                                         float threshold, bool by_mass, RadixScratch& s) {
    unsigned long long total = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float w = weight_of(row[i], row_max, temperature);
        if (kept(w, threshold)) total += by_mass ? fixed_mass(w) : 1ull;
    }
    __syncthreads();
    if (threadIdx.x == 0) s.above = 0;
    __syncthreads();
    atomicAdd(&s.above, total);
    __syncthreads();
    return s.above;
}

// Largest threshold tau >= low with (count or mass of kept weights w >= tau) >= target; low when even
// all the kept weights fall short.
__device__ float radix_threshold(const float* row, int vocab, float row_max, float temperature, float low,
                                 unsigned long long target, bool by_mass, RadixScratch& s) {
    unsigned prefix = 0, prefix_mask = 0;   // the bits fixed so far
    unsigned long long above = 0;           // what the weights above the prefix's range hold
    for (int shift = 24; shift >= 0; shift -= 8) {
        __syncthreads();   // everyone has read the previous digit before the histogram is cleared
        for (int b = threadIdx.x; b < RADIX_BINS; b += blockDim.x) s.histogram[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float w = weight_of(row[i], row_max, temperature);
            const unsigned bits = __float_as_uint(w);
            if (kept(w, low) && (bits & prefix_mask) == prefix)
                atomicAdd(&s.histogram[(bits >> shift) & (RADIX_BINS - 1)], by_mass ? fixed_mass(w) : 1ull);
        }
        __syncthreads();
        if (threadIdx.x == 0) {   // from the top bin down: the first whose inclusion reaches the target
            int bin = RADIX_BINS - 1;
            for (; bin > 0 && above + s.histogram[bin] < target; --bin) above += s.histogram[bin];
            s.digit = bin;
            s.above = above;
        }
        __syncthreads();
        prefix |= s.digit << shift;
        prefix_mask |= (unsigned)(RADIX_BINS - 1) << shift;
        above = s.above;
    }
    return fmaxf(__uint_as_float(prefix), low);
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
    __shared__ RadixScratch radix;
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
        threshold = radix_threshold(row, vocab, row_max, t, threshold, (unsigned long long)top_k[r], false, radix);
    if (top_p[r] < 1.0f) {
        const double mass = (double)kept_total(row, vocab, row_max, t, threshold, true, radix);
        threshold = radix_threshold(row, vocab, row_max, t, threshold,
                                    fmax(1.0, ceil((double)top_p[r] * mass)), true, radix);
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
