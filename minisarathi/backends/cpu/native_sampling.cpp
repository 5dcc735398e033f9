// The sampler's inverse CDF (minisarathi/sampler.py, Sampler._inverse_cdf) in one call for all rows, bit for
// bit the same tokens as the NumPy version: the same float64 operations in the same order. NumPy spends a few
// dozen array calls on it, and its per-block sums loop over the rows' blocks one short reduction at a time.
//
// Exactness rests on three orders, which the tests check against the NumPy version on every block size:
// - a block's sum is NumPy's pairwise sum of the float32 probabilities converted to float64 (numpy/_core/src/
//   umath/loops_utils.h.src: below 8 values one running sum from 0; up to 128, eight running sums, then a fixed
//   tree, then the rest in order; above, two halves split at a multiple of 8), which is what
//   `blocks.sum(axis=2, dtype=np.float64)` computes;
// - np.cumsum is one running sum in order;
// - comparisons count, as `(cdf <= target).sum()` does.
// No -ffast-math and no FMA contraction (-ffp-contract=off): each operation rounds as NumPy's does.
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t PAIRWISE_BLOCK = 128;   // NumPy's PW_BLOCKSIZE

double pairwise_sum(const float* a, int64_t n) {
    if (n < 8) {
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += static_cast<double>(a[i]);
        return sum;
    }
    if (n <= PAIRWISE_BLOCK) {
        double r[8];
        for (int j = 0; j < 8; j++) r[j] = static_cast<double>(a[j]);
        int64_t i = 8;
        for (; i < n - n % 8; i += 8)
            for (int j = 0; j < 8; j++) r[j] += static_cast<double>(a[i + j]);
        double sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) sum += static_cast<double>(a[i]);
        return sum;
    }
    int64_t half = n / 2;
    half -= half % 8;
    return pairwise_sum(a, half) + pairwise_sum(a + half, n - half);
}

}  // namespace

// probs: float32[rows, vocab], C order, nonnegative, each row with some mass; u: float64[rows] in [0, 1);
// block: tokens per block (divides vocab). Writes int64[rows].
extern "C" __attribute__((visibility("default")))
void inverse_cdf(const float* probs, int64_t rows, int64_t vocab, int64_t block, const double* u, int64_t* out) {
    const int64_t blocks = vocab / block;
    std::vector<double> block_cdf(blocks);   // one row's running sums of its blocks
    for (int64_t r = 0; r < rows; r++) {
        const float* row = probs + r * vocab;
        double running = 0.0;   // (0 + x is x: starting from 0 changes no comparison below)
        for (int64_t b = 0; b < blocks; b++) block_cdf[b] = running += pairwise_sum(row + b * block, block);
        const double target = u[r] * block_cdf[blocks - 1];
        int64_t chosen = 0;   // the first block whose running sum passes the target
        for (int64_t b = 0; b < blocks; b++) chosen += block_cdf[b] <= target;
        if (chosen >= blocks) chosen = blocks - 1;   // only where the input breaks the contract (NaN, no mass)
        const double before = chosen > 0 ? block_cdf[chosen - 1] : 0.0;
        const float* inside = row + chosen * block;
        double cumulative = 0.0;
        int64_t token = 0;
        for (int64_t j = 0; j < block; j++) {
            cumulative += static_cast<double>(inside[j]);
            token += before + cumulative <= target;
        }
        // the block's own running sum can round below its pairwise sum: then its last kept token
        int64_t last = block - 1;
        while (last > 0 && !(inside[last] > 0)) last--;
        out[r] = chosen * block + (token < last ? token : last);
    }
}

// Structured outputs (minisarathi/structured.py): the tokens a grammar forbids set to -inf in place. logits:
// float32[N, vocab]; rows: int64[count], the rows masked; mask: uint32[count, words], bit j of word w allowing
// token 32 w + j (llguidance's layout; little-endian, so byte k holds tokens 8 k .. 8 k + 7). A byte at a
// time: all set (most of a permissive mask) is skipped, none set (most of a strict one) is a fill, others add
// a table's 0 or -inf per token (branchless: branching bit by bit on a mixed mask cost 6x).
namespace {

struct ByteMasks {
    float add[256][8];   // per byte pattern, what its 8 tokens get added: 0 where the bit is set, else -inf
    ByteMasks() {
        for (int b = 0; b < 256; b++)
            for (int j = 0; j < 8; j++) add[b][j] = (b >> j) & 1 ? 0.0f : -__builtin_inff();
    }
};

const ByteMasks byte_masks;

}  // namespace

extern "C" __attribute__((visibility("default")))
void apply_token_bitmask(float* logits, int64_t vocab, const int64_t* rows, int64_t count, const uint32_t* mask,
                         int64_t words) {
    const float minus_infinity = -__builtin_inff();
    const uint8_t* bytes_of_rows = reinterpret_cast<const uint8_t*>(mask);
    for (int64_t r = 0; r < count; r++) {
        float* row = logits + rows[r] * vocab;
        const uint8_t* bytes = bytes_of_rows + r * words * 4;
        for (int64_t b = 0; b < (vocab + 7) / 8; b++) {
            const uint8_t byte = bytes[b];
            if (byte == 0xff) continue;
            float* tokens = row + 8 * b;
            const int n = 8 * b + 8 <= vocab ? 8 : static_cast<int>(vocab - 8 * b);
            if (byte == 0) {
                for (int j = 0; j < n; j++) tokens[j] = minus_infinity;
            } else {
                const float* add = byte_masks.add[byte];
                for (int j = 0; j < n; j++) tokens[j] += add[j];   // x + 0 is x; x + -inf is -inf
            }
        }
    }
}
