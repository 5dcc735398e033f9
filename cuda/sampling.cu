// Sampling on the GPU, so that only the sampled ids (and their logprobs) cross to the host.
//
// Rows are float32 logits [num_rows, vocab]; blockDim.x is a multiple of 32. Randomness comes from the
// host as one uniform number in [0, 1) per row: seeded, reproducible, and identical to what the CPU
// sampler would draw. The logprobs of the raw logits are reductions done by
// minisarathi/backends/gpu_sampling.py with array operations, not here.
#include "common.cuh"

// (value, index) argmax step; ties go to the lowest index, as numpy.argmax does. NaN never wins.
__device__ __forceinline__ void better(float& value, int& index, float other_value, int other_index) {
    if (other_value > value || (other_value == value && other_index < index)) {
        value = other_value;
        index = other_index;
    }
}

// Block-wide argmax of every thread's (value, index); `none` (an index above every real one) when all
// values are NaN. Every thread gets the result.
__device__ void block_best(float& value, int& index, int none, float* value_scratch, int* index_scratch) {
    for (int offset = 16; offset > 0; offset >>= 1)
        better(value, index, __shfl_xor_sync(FULL_WARP, value, offset), __shfl_xor_sync(FULL_WARP, index, offset));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    __syncthreads();
    if (lane == 0) { value_scratch[warp] = value; index_scratch[warp] = index; }
    __syncthreads();
    value = lane < (int)blockDim.x / 32 ? value_scratch[lane] : negative_infinity();
    index = lane < (int)blockDim.x / 32 ? index_scratch[lane] : none;
    for (int offset = 16; offset > 0; offset >>= 1)
        better(value, index, __shfl_xor_sync(FULL_WARP, value, offset), __shfl_xor_sync(FULL_WARP, index, offset));
}

extern "C" __global__ void argmax_kernel(const float* __restrict__ logits, int vocab, int* __restrict__ out_ids) {
    __shared__ float value_scratch[32];
    __shared__ int index_scratch[32];
    const float* row = logits + (long long)blockIdx.x * vocab;
    float value = negative_infinity();
    int index = vocab;   // "none yet": loses every tie against a real index
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) better(value, index, row[i], i);
    block_best(value, index, vocab, value_scratch, index_scratch);
    if (threadIdx.x == 0) out_ids[blockIdx.x] = index < vocab ? index : 0;   // an all-NaN row falls back to token 0
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


// ---- sample_kernel: temperature, min-p, top-k, top-p and the draw, each row split over several CTAs ----
//
// A row of a 128k vocabulary is 512 KB of logits: one CTA per row would leave half of an H200's SMs idle
// at batch 64 and make each CTA pass over its row a dozen times. Here each row is cut into `ctas_per_row`
// contiguous chunks of `chunk` tokens; a CTA copies its chunk into shared memory once (cp.async), and
// every later pass (the max, the weights, the radix digits, the draw) reads shared memory only. What
// the row's CTAs must agree on (its max, each digit's histogram, the masses before the draw) each CTA
// publishes in global memory, then they meet at a row barrier: an arrival counter per group of CTAs.
// Groups loop over rows (row = group, group + groups, ...). The grid (groups x ctas_per_row) is at most
// one CTA per SM, so every CTA of a group is resident and a barrier cannot wait for a CTA that has no
// SM (the host plans it: minisarathi/backends/gpu_sampling.py). With ctas_per_row 1 there is no
// barrier and no global traffic besides the row itself: the one-block-per-row path of small vocabularies.
//
// The rule is minisarathi/sampler.py's, as the one-block kernel had it: weights w = exp((x - max) / t) in
// float32, the largest being 1 (so min-p compares directly); then top-k and top-p (within the top-k mass)
// keep the weights at or above thresholds that are order statistics of the weights, found by radix
// select over their bits (weights lie in [0, 1], where float order is bit order; bits 29..0 vary, so three
// 10-bit digits). Counts and masses are integers (mass in 2^-40 units): exact, so the thresholds, and the
// token, do not depend on the order in which threads or CTAs add. The draw is an inverse CDF in token
// order with the row's uniform number from the host, summed in double as the NumPy sampler's CDF is.

constexpr int SAMPLE_THREADS = 1024;      // most threads per CTA; __launch_bounds__ keeps one CTA per SM possible
constexpr int SAMPLE_MAX_CHUNK = 36864;   // tokens per CTA in shared memory: 144 KiB + 17 KiB static, under an A100's 163 KiB
constexpr int SAMPLE_PARAMS = 5;          // rows of the parameter array: temperature, top_k, top_p, min_p, uniform
constexpr int RADIX_BITS = 10;
constexpr int RADIX_BINS = 1024;          // 2^RADIX_BITS: 32 bins for each lane of one warp
static_assert(RADIX_BINS == 1 << RADIX_BITS && RADIX_BINS == 32 * 32, "a warp scans the histogram, 32 bins a lane");

// The unnormalized probability of a logit, exactly as minisarathi/sampler.py computes it in float32:
// exp((x - max) / t) lies in [0, 1] and is 1 for the most likely token.
__device__ __forceinline__ float weight_of(float x, float row_max, float temperature) {
    return expf((x - row_max) / temperature);
}

// Whether a token survives the filters: weights at or above the threshold, never a zero weight.
__device__ __forceinline__ bool kept(float w, float threshold) { return w >= threshold && w > 0.0f; }

__device__ __forceinline__ unsigned long long fixed_mass(float w) {
    return (unsigned long long)(w * 1099511627776.0f);   // w * 2^40: exact scaling, truncated
}

// Lanes of warp 0 for which `predicate` holds (every lane gets the count).
__device__ __forceinline__ int warp_count(bool predicate) {
    int count = predicate;
    for (int offset = 16; offset > 0; offset >>= 1) count += __shfl_xor_sync(FULL_WARP, count, offset);
    return count;
}

struct SampleScratch {
    // A digit's counts or masses are added as two 32-bit words (low, and high with the low word's carries):
    // shared-memory atomics are native at 32 bits, a compare-and-swap loop at 64.
    unsigned low[RADIX_BINS], high[RADIX_BINS];
    unsigned long long histogram[RADIX_BINS];   // the digit's row histogram; then the draw's per-thread masses
    float best_value[32];
    int best_index[32];
    unsigned long long above, target;           // radix select: what lies above the digit's bins; the goal
    unsigned digit;
    union {
        unsigned long long bin_sums[32];        // radix select: the digit's histogram, 32 bins a sum
        double lane_mass[32];                   // then the draw: masses of 32 runs each
    };
    double base;                                // the draw: mass of the row before this CTA's chunk
    int owner;                                  // the draw: the CTA whose chunk holds the token (-1: none kept)
};

// A CTA's chunk and scratch fit the opt-in shared memory of every target (A100: 163 KiB; H100/H200: 227 KiB).
static_assert(SAMPLE_MAX_CHUNK % 4 == 0 && SAMPLE_MAX_CHUNK * 4 + sizeof(SampleScratch) <= 163 * 1024,
              "a chunk of float32 logits and the scratch fit in 163 KiB of shared memory");

// The CTAs that share a row, and how many row barriers they have passed.
struct RowGroup {
    unsigned long long* arrivals;   // this group's barrier counter (zero at launch)
    unsigned long long* exchange;   // [2][ctas][RADIX_BINS]: what each CTA publishes, double-buffered
    int ctas, cta, barriers;
};

// This CTA's slot for what it publishes before the next barrier. Two slots suffice: what is published
// for barrier b goes to slot b % 2 and is read before barrier b + 1; the slot's next write, for barrier
// b + 2, comes after barrier b + 1, which no CTA passes before every CTA has finished reading.
__device__ __forceinline__ unsigned long long* outbox(const RowGroup& g) {
    return g.exchange + ((long long)(g.barriers & 1) * g.ctas + g.cta) * RADIX_BINS;
}
// What CTA `cta` published before the last barrier (read through L2: another SM wrote it).
__device__ __forceinline__ const unsigned long long* inbox(const RowGroup& g, int cta) {
    return g.exchange + ((long long)((g.barriers - 1) & 1) * g.ctas + cta) * RADIX_BINS;
}

// Every CTA of the row has published; afterwards each may read every inbox.
__device__ __forceinline__ void row_barrier(RowGroup& g) {
    __syncthreads();
    if (threadIdx.x == 0) {
        blocks_arrive(g.arrivals);
        blocks_wait(g.arrivals, (unsigned long long)(g.barriers + 1) * g.ctas);
    }
    ++g.barriers;
    __syncthreads();
}

// The digit's row histogram: this CTA's counts (two words a bin), or with several CTAs every CTA's, summed
// (integers: any order). Each warp holds 32 consecutive bins, whose sum it leaves for cut_digit.
__device__ __forceinline__ void finish_histogram(SampleScratch& s, RowGroup& g) {
    if (g.ctas > 1) {
        unsigned long long* out = outbox(g);
        for (int b = threadIdx.x; b < RADIX_BINS; b += blockDim.x)
            out[b] = (unsigned long long)s.high[b] << 32 | s.low[b];
        row_barrier(g);
    }
    for (int b = threadIdx.x; b < RADIX_BINS; b += blockDim.x) {
        unsigned long long count = 0;
        if (g.ctas == 1) {
            count = (unsigned long long)s.high[b] << 32 | s.low[b];
        } else {
            // CTA c's bin b, RADIX_BINS further each: one base register, the unrolled loads at fixed offsets.
            const unsigned long long* in = inbox(g, 0) + b;
            for (int c = 0; c < g.ctas; ++c, in += RADIX_BINS) count += __ldcg(in);
        }
        s.histogram[b] = count;
        for (int offset = 16; offset > 0; offset >>= 1) count += __shfl_xor_sync(FULL_WARP, count, offset);
        if (b % 32 == 0) s.bin_sums[b / 32] = count;
    }
    __syncthreads();
}

// Sum of x over lanes lane..31 of warp 0 (every lane of it calls).
__device__ __forceinline__ unsigned long long suffix_sum(unsigned long long x) {
    for (int offset = 1; offset < 32; offset <<= 1) {
        const unsigned long long v = __shfl_down_sync(FULL_WARP, x, offset);
        if ((int)threadIdx.x + offset < 32) x += v;
    }
    return x;
}

// One digit of a radix select, by warp 0 over the merged histogram: from the top bin down, the first
// bin whose inclusion brings what lies above it to the target; bin 0 when none does. A by-mass select
// (fraction >= 0) first sets the target from the histogram's total: its first digit covers every kept
// weight, so the total is the kept mass.
__device__ __forceinline__ void cut_digit(SampleScratch& s, double fraction) {
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const unsigned long long mine = s.bin_sums[lane];   // bins 32 l .. 32 l + 31
        const unsigned long long suffix = suffix_sum(mine);
        const unsigned long long total = __shfl_sync(FULL_WARP, suffix, 0);
        const unsigned long long target =
            fraction >= 0.0 ? (unsigned long long)fmax(1.0, ceil(fraction * (double)total)) : s.target;
        const unsigned long long above = s.above;
        // The lanes whose bins and those above reach the target are a prefix 0..L of the warp; then the
        // same scan over lane L's 32 bins, one a lane, so that no lane loads (or holds) 32 bins.
        const int owner = max(warp_count(above + suffix >= target) - 1, 0);
        const unsigned long long start = above + __shfl_sync(FULL_WARP, suffix - mine, owner);
        const unsigned long long bin_mass = s.histogram[32 * owner + lane];
        const unsigned long long bin_suffix = suffix_sum(bin_mass);
        if (lane == max(warp_count(start + bin_suffix >= target) - 1, 0)) {
            s.digit = 32 * owner + lane;
            s.above = start + (bin_suffix - bin_mass);
            s.target = target;
        }
    }
    __syncthreads();
}

// Largest threshold tau >= low with (count, or mass, of the row's kept weights >= tau) >= target; low when
// even all the kept weights fall short. The target is `count`, or max(1, ceil(fraction * kept mass)).
__device__ __forceinline__ float radix_threshold(const float* w, int n, float low, unsigned long long count,
                                                 double fraction, RowGroup& g, SampleScratch& s) {
    const bool by_mass = fraction >= 0.0;
    unsigned prefix = 0, prefix_mask = 0;   // the bits fixed so far
    if (threadIdx.x == 0) { s.above = 0; s.target = count; }
    for (int shift = 2 * RADIX_BITS; shift >= 0; shift -= RADIX_BITS) {
        __syncthreads();   // everyone has read the previous digit before the histogram is cleared
        for (int b = threadIdx.x; b < RADIX_BINS; b += blockDim.x) s.low[b] = s.high[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const unsigned bits = __float_as_uint(w[i]);
            if (kept(w[i], low) && (bits & prefix_mask) == prefix) {
                const int bin = (bits >> shift) & (RADIX_BINS - 1);
                const unsigned long long add = by_mass ? fixed_mass(w[i]) : 1ull;
                const unsigned before = atomicAdd(&s.low[bin], (unsigned)add);
                const unsigned carry = before + (unsigned)add < before;
                if ((add >> 32) + carry) atomicAdd(&s.high[bin], (unsigned)(add >> 32) + carry);
            }
        }
        __syncthreads();
        finish_histogram(s, g);
        cut_digit(s, by_mass && shift == 2 * RADIX_BITS ? fraction : -1.0);
        prefix |= s.digit << shift;
        prefix_mask |= (unsigned)(RADIX_BINS - 1) << shift;
    }
    return fmaxf(__uint_as_float(prefix), low);
}

// The draw: the first kept token (in token order) whose running mass passes u times the row's kept mass.
// Each thread sums a contiguous run of its CTA's chunk in double; the CTAs publish their masses; the CTA
// whose chunk holds the target finds the lane (warp 0: 32 runs each), the run, then the token. Sums are
// compared as the same additions at every level, so a target that passes a part passes one of its
// pieces; only when rounding leaves it a hair beyond a part's own sum does the part's last kept token win.
__device__ __forceinline__ void draw(const float* w, int n, int first, float threshold, double u, int* out_id,
                     RowGroup& g, SampleScratch& s) {
    double* run_mass = reinterpret_cast<double*>(s.histogram);   // free again: the digits are cut
    const int per_thread = (n + blockDim.x - 1) / blockDim.x;
    const int begin = min(n, (int)threadIdx.x * per_thread), end = min(n, begin + per_thread);
    double mass = 0.0;
    for (int i = begin; i < end; ++i)
        if (kept(w[i], threshold)) mass += w[i];
    __syncthreads();   // cut_digit's readers are done with the histogram
    run_mass[threadIdx.x] = mass;
    __syncthreads();

    // Warp 0: lane l owns the runs of threads 32 l .. 32 l + 31. The running sums over lanes are sequential
    // additions of non-negative terms, so they never decrease: the lanes passing a target are a suffix.
    const int lane = threadIdx.x;
    double lane_mass = 0.0, inclusive = 0.0, exclusive = 0.0, chunk_mass = 0.0;
    if (threadIdx.x < 32) {
        for (int j = 32 * lane; j < min(32 * lane + 32, (int)blockDim.x); ++j) lane_mass += run_mass[j];
        s.lane_mass[lane] = lane_mass;
        __syncwarp();
        for (int l = 0; l < lane; ++l) exclusive += s.lane_mass[l];
        inclusive = exclusive + lane_mass;
        for (int l = 0; l < 32; ++l) chunk_mass += s.lane_mass[l];   // the same additions as lane 31's inclusive
    }

    // The row: the CTAs' masses in CTA order; the owner is the first whose running end passes the target.
    if (g.ctas > 1) {
        if (threadIdx.x == 0) reinterpret_cast<double*>(outbox(g))[0] = chunk_mass;
        row_barrier(g);
    }
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int c = 0; c < g.ctas; ++c)
            total += g.ctas == 1 ? chunk_mass : __ldcg(reinterpret_cast<const double*>(inbox(g, c)));
        const double target = u * total;
        double before = 0.0;
        int owner = -1;
        for (int c = 0; c < g.ctas && !(owner >= 0 && before > target); ++c) {
            const double m = g.ctas == 1 ? chunk_mass : __ldcg(reinterpret_cast<const double*>(inbox(g, c)));
            if (m > 0.0) { owner = c; s.base = before; }   // the last CTA keeping anything, until one passes
            before += m;
        }
        s.owner = owner;
        s.target = __double_as_longlong(target);
    }
    __syncthreads();
    const int owner = s.owner;
    if (owner < 0 && g.cta == 0 && threadIdx.x == 0) *out_id = 0;   // nothing kept: an all -inf or NaN row
    if (owner != g.cta || threadIdx.x >= 32) return;
    const double target = __longlong_as_double((long long)s.target), base = s.base;

    // The first lane whose end passes the target (it keeps something, as base <= target); if rounding
    // left none, the last lane that keeps anything.
    const int passing = warp_count(base + inclusive > target);
    int chosen = passing > 0 ? 32 - passing : (lane_mass > 0.0 ? lane : -1);
    if (passing == 0)
        for (int offset = 16; offset > 0; offset >>= 1) chosen = max(chosen, __shfl_xor_sync(FULL_WARP, chosen, offset));
    if (lane != chosen) return;

    // One thread's walk: the lane's runs, then the tokens of one run.
    double running = base + exclusive, run_start = running;
    int thread = -1;
    for (int j = 32 * lane; j < min(32 * lane + 32, (int)blockDim.x); ++j) {
        if (run_mass[j] <= 0.0) continue;
        thread = j;
        run_start = running;
        if (running + run_mass[j] > target) break;
        running += run_mass[j];
    }
    running = run_start;
    int id = 0;
    for (int i = min(n, thread * per_thread); i < min(n, thread * per_thread + per_thread); ++i) {
        if (!kept(w[i], threshold)) continue;
        id = i;
        if (running + w[i] > target) break;
        running += w[i];
    }
    *out_id = first + id;
}

// One token per row of (already penalized) logits, in minisarathi/sampler.py's order: temperature 0 is
// greedy (argmax, ties to the lowest id); otherwise min-p, top-k, then top-p (within the top-k mass) on
// the weights, then the draw. params[SAMPLE_PARAMS][num_rows], in double (each value exact): temperature,
// top_k, top_p, min_p, uniform; top_k <= 0 or >= vocab, top_p >= 1 and min_p <= 0 disable their filters.
// workspace: groups arrival counters (zeroed by the host), then [groups][2][ctas_per_row][RADIX_BINS].
// Dynamic shared memory: chunk floats.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1)
sample_kernel(const float* __restrict__ logits, int num_rows, int vocab, const double* __restrict__ params,
              int ctas_per_row, int chunk, unsigned long long* __restrict__ workspace, int* __restrict__ out_ids) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* w = reinterpret_cast<float*>(smem);   // this CTA's chunk: logits, then weights
    __shared__ SampleScratch s;
    const int groups = gridDim.x / ctas_per_row;
    RowGroup g{workspace + blockIdx.x / ctas_per_row,
               workspace + groups + (long long)(blockIdx.x / ctas_per_row) * 2 * ctas_per_row * RADIX_BINS,
               ctas_per_row, (int)blockIdx.x % ctas_per_row, 0};
    const int first = g.cta * chunk, n = max(0, min(vocab - first, chunk));
    // 16-byte copies when every chunk starts 16-byte aligned (chunk is a multiple of 4 tokens).
    const bool vector = vocab % 4 == 0 && reinterpret_cast<unsigned long long>(logits) % 16 == 0;

    for (int row = blockIdx.x / ctas_per_row; row < num_rows; row += groups) {
        static_assert(SAMPLE_PARAMS == 5, "temperature, top_k, top_p, min_p, uniform");
        const float t = (float)params[row];
        const int top_k = (int)params[num_rows + row];
        const float top_p = (float)params[2 * num_rows + row], min_p = (float)params[3 * num_rows + row];
        const double u = params[4 * num_rows + row];

        __syncthreads();   // the previous row's draw has read the chunk
        const float* source = logits + (long long)row * vocab + first;
        if (vector)
            for (int i = 4 * threadIdx.x; i < n; i += 4 * blockDim.x) cp_async_16(w + i, source + i);
        else
            for (int i = threadIdx.x; i < n; i += blockDim.x) cp_async_ca<4>(w + i, source + i);
        cp_async_wait_all();
        __syncthreads();

        // The row's max and argmax (the greedy token): the CTAs' in CTA order, ties to the lowest id.
        float best = negative_infinity();
        int best_id = vocab;   // "none yet"
        for (int i = threadIdx.x; i < n; i += blockDim.x) better(best, best_id, w[i], first + i);
        block_best(best, best_id, vocab, s.best_value, s.best_index);
        if (g.ctas > 1) {
            if (threadIdx.x == 0) {
                unsigned long long* out = outbox(g);
                out[0] = __float_as_uint(best);
                out[1] = (unsigned)best_id;
            }
            row_barrier(g);
            best = negative_infinity();
            best_id = vocab;
            for (int c = 0; c < g.ctas; ++c)
                better(best, best_id, __uint_as_float((unsigned)__ldcg(inbox(g, c))), (int)__ldcg(inbox(g, c) + 1));
        }
        if (t <= 0.0f) {
            if (g.cta == 0 && threadIdx.x == 0) out_ids[row] = best_id < vocab ? best_id : 0;   // all NaN: token 0
            continue;
        }

        for (int i = threadIdx.x; i < n; i += blockDim.x) w[i] = weight_of(w[i], best, t);
        __syncthreads();
        // Each filter keeps the weights above a threshold that only rises.
        float threshold = fmaxf(min_p, 0.0f);   // the largest weight is 1, so min-p compares directly
        if (top_k > 0 && top_k < vocab)
            threshold = radix_threshold(w, n, threshold, (unsigned long long)top_k, -1.0, g, s);
        if (top_p < 1.0f)
            threshold = radix_threshold(w, n, threshold, 0, (double)top_p, g, s);
        draw(w, n, first, threshold, u, out_ids + row, g, s);
    }
}
