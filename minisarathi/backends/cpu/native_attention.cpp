// Decode attention on the CPU: each single-token query attends to its sequence's keys, read straight from the
// paged KV cache through its block table (no gather copy), for all decodes of a batch in one call.
//
// Why: NumPy's path keeps a contiguous copy of the decodes' K/V (as large as the cache's first few MiB per
// layer, for every layer) or gathers it each step, and makes one small BLAS call per (sequence, KV head).
//
// The work is split into items, one per (decode, KV head), run by the engine's threads (OpenMP). An item
// reads its head's K once and its V once, whatever the group G of query heads sharing them:
// - scores: keys 8 or 16 at a time (a vector's lanes), the G query heads from the same keys, loaded once into
//   L1 (one accumulator per key, vectorized over head_dim, then a transposing sum tree gives the scores of
//   those keys as one vector); K rows prefetched into L1 PREFETCH_BYTES ahead;
// - softmax per query head on those vectors, with a polynomial exp;
// - the weighted sum of V, SEGMENT keys at a time (their V rows stay in L1 across the passes, and the next
//   segment's are prefetched into L2): each pass keeps up to 4 query heads x a slice of head_dim in
//   registers, so a V row loaded once feeds every query head of the group; a few independent chains per
//   output where the pass is small, so the sum over keys is not bound by one chain's latency.
//
// Two paths, chosen at run time: AVX-512 (16 lanes) and AVX2 + FMA (8 lanes, the same steps over half-width
// vectors; its sums over lanes take other trees, so its last bits differ from the AVX-512 path's).
//
// Determinism: every number a decode's output depends on is computed from that decode's own query, keys and
// context length, in an order fixed by the context length alone: a row's result is bit-identical whatever
// batch it is in (which other rows, how many, in what order) and whatever the thread count. Built without
// -ffast-math, so the compiler keeps the written order of every sum.
// GCC 12 warns of its own intrinsics' deliberately undefined operands when they are inlined into a
// function with a target attribute; the warnings are false.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

namespace {

enum Isa { NONE = 0, AVX2 = 2, AVX512 = 3 };   // native_attention.py's ISAS

// K rows are asked into L1 this many bytes of keys ahead of their scores: a head's keys are bs-row tiles Hk
// tiles apart, a pattern the hardware prefetchers miss (long decodes stalled on those loads).
constexpr int64_t PREFETCH_BYTES = 8192;
// Keys per segment of the weighted sum (a multiple of 8, every U below): at head_dim 128, 16 KiB of V in L1.
constexpr int64_t SEGMENT = 32;

// Asks for the rows of keys [t0, t1) (clipped to n), key t at x + offsets[t], into L1 (T0) or L2 (T1).
template <int HINT>
inline void prefetch_rows(const float* x, const int64_t* offsets, int64_t t0, int64_t t1, int64_t n, int64_t D) {
    for (int64_t j = t0; j < t1 && j < n; ++j)
        for (int64_t d = 0; d < D; d += 16) _mm_prefetch((const char*)(x + offsets[j] + d), (_mm_hint)HINT);
}

// Chains of accumulators per output in a weighted-sum pass of GB query heads x C vectors: about 8
// independent accumulators in all (a power of two, so a segment's keys split evenly).
constexpr int chains(int GB, int C) { return GB * C == 1 ? 8 : GB * C == 2 ? 4 : GB * C <= 4 ? 2 : 1; }

// One pass of the weighted sum over keys [t0, t1) (t0 a multiple of SEGMENT), GB query heads x C vectors:
// w: the GB heads' weights, rows w_stride apart; v: V rows (key t at v + offsets[t]); chain u of head g holds
// at sums + (u * G + g) * Dp its keys t % U == u (between segments: t0 > 0 reads them, t1 < n writes them);
// after the last segment out[g * D ..] = the chains added in order / totals[g]. The last vector: its first
// `width` lanes only.
using Pass = void (*)(const float* w, int64_t w_stride, const float* v, const int64_t* offsets, int64_t t0,
                      int64_t t1, int64_t n, int64_t width, const float* totals, float* sums, int64_t G,
                      int64_t Dp, float* out, int64_t D);
using Score = void (*)(const float*, int64_t, int64_t, const float*, const int64_t*, int64_t, float*, int64_t);

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {

constexpr int LANES = 16;

// e^x for x <= 0 (scores minus their max), 16 lanes: Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-7
// polynomial for e^r, then 2^n by vscalefps, which goes through the subnormals to 0 for very negative x);
// within 2 ulp of e^x (tests/unit/test_native_attention.py checks it against float64). NaN stays NaN.
inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);   // e^-104 is 0 in float32; keeps n within vscalefps' range
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);   // ln2 in two parts: n * hi is exact
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

inline __mmask16 first_lanes(int64_t count) {
    return count >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
}

// sum_each from its second stage on: b[i] holds a[2i] in lanes 0-7 and a[2i + 1] in lanes 8-15, each already
// folded to 8 lanes (score_pairs' products of D <= 8 start here).
inline __m512 sum_halves(const __m512 b[8]) {
    __m512 c[4], d[2];
    for (int i = 0; i < 4; ++i)   // 128-bit quarters: a[4i + k] into quarter k
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i)   // lane pairs within each quarter
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane j of the result: the sum of the 16 lanes of a[PERM[j]], where the tree below leaves the sum of a[i]
// in lane 4 * (i % 4) + i / 4; so the caller puts key j's products in a[4 * (j % 4) + j / 4] and gets the 16
// keys' scores in order.
inline __m512 sum_each(const __m512 a[16]) {
    __m512 b[8];
    for (int i = 0; i < 8; ++i)   // 256-bit halves: a[2i] into lanes 0-7, a[2i + 1] into lanes 8-15
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return sum_halves(b);
}

// The K rows of keys [t0, t0 + 16) in sum_each's order (key j at 4 * (j % 4) + j / 4); past n the context's
// first key again, its score unused.
inline void key_rows(const float* k, const int64_t* offsets, int64_t t0, int64_t n, const float* key[LANES]) {
    for (int j = 0; j < LANES; ++j)
        key[4 * (j % 4) + j / 4] = k + offsets[t0 + j < n ? t0 + j : 0];
}

// scores[g][t] = q[g] . k[t] for t < n (and garbage up to n rounded up to 16, never read as a weight);
// q: float32[G][D], already scaled; k: one head's keys, key t at k + offsets[t].
void score(const float* q, int64_t G, int64_t D, const float* k, const int64_t* offsets, int64_t n,
           float* scores, int64_t scores_stride) {
    const int64_t full = D / LANES, ahead = (PREFETCH_BYTES / (D * 4) + LANES - 1) / LANES * LANES;
    const __mmask16 tail = first_lanes(D % LANES);
    prefetch_rows<_MM_HINT_T0>(k, offsets, 0, ahead, n, D);
    for (int64_t t0 = 0; t0 < n; t0 += LANES) {
        prefetch_rows<_MM_HINT_T0>(k, offsets, t0 + ahead, t0 + ahead + LANES, n, D);
        const float* key[LANES];
        key_rows(k, offsets, t0, n, key);
        for (int64_t g = 0; g < G; ++g) {   // the group's query heads from the same keys, in L1
            const float* qg = q + g * D;
            __m512 acc[LANES];
            for (int i = 0; i < LANES; ++i) acc[i] = _mm512_setzero_ps();
            for (int64_t c = 0; c < full; ++c) {
                const __m512 qv = _mm512_loadu_ps(qg + c * LANES);
                for (int i = 0; i < LANES; ++i)
                    acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(key[i] + c * LANES), acc[i]);
            }
            if (tail) {
                const __m512 qv = _mm512_maskz_loadu_ps(tail, qg + full * LANES);
                for (int i = 0; i < LANES; ++i)
                    acc[i] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, key[i] + full * LANES), acc[i]);
            }
            _mm512_storeu_ps(scores + g * scores_stride + t0, sum_each(acc));
        }
    }
}

// score() for D <= 8: two keys per vector (one in each 256-bit half), so the sum tree starts at its second
// stage and the 8 vectors of 16 keys are loaded once for the G queries.
void score_pairs(const float* q, int64_t G, int64_t D, const float* k, const int64_t* offsets, int64_t n,
                 float* scores, int64_t scores_stride) {
    const __mmask16 low = first_lanes(D), high = (__mmask16)(low << 8);
    const int64_t ahead = (PREFETCH_BYTES / (D * 4) + LANES - 1) / LANES * LANES;
    prefetch_rows<_MM_HINT_T0>(k, offsets, 0, ahead, n, D);
    for (int64_t t0 = 0; t0 < n; t0 += LANES) {
        prefetch_rows<_MM_HINT_T0>(k, offsets, t0 + ahead, t0 + ahead + LANES, n, D);
        const float* key[LANES];
        key_rows(k, offsets, t0, n, key);
        __m512 pair[8];   // a[2i] of sum_each in lanes 0-7, a[2i + 1] in lanes 8-15
        for (int i = 0; i < 8; ++i)   // lanes 8-15 read from key - 8: only lanes 8 .. 8 + D - 1 are read
            pair[i] = _mm512_mask_loadu_ps(_mm512_maskz_loadu_ps(low, key[2 * i]), high, key[2 * i + 1] - 8);
        for (int64_t g = 0; g < G; ++g) {
            const __m512 qv = _mm512_maskz_loadu_ps(low, q + g * D);
            const __m512 qq = _mm512_shuffle_f32x4(qv, qv, _MM_SHUFFLE(1, 0, 1, 0));   // q in both halves
            __m512 b[8];
            for (int i = 0; i < 8; ++i) b[i] = _mm512_mul_ps(pair[i], qq);
            _mm512_storeu_ps(scores + g * scores_stride + t0, sum_halves(b));
        }
    }
}

// In place over s[0 .. n): s[t] = e^(s[t] - max s); returns the sum of them. Lanes past n (up to n rounded
// up to 16) become 0.
float exp_and_sum(float* s, int64_t n) {
    __m512 top = _mm512_set1_ps(-__builtin_inff());
    for (int64_t t = 0; t < n; t += LANES)
        top = _mm512_mask_max_ps(top, first_lanes(n - t), _mm512_loadu_ps(s + t), top);
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += LANES) {
        const __m512 e = _mm512_maskz_mov_ps(first_lanes(n - t), exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), max)));
        _mm512_storeu_ps(s + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

// A Pass (above) of GB heads x C vectors; TAIL: the last vector is partial (masked).
template <int GB, int C, bool TAIL>
void weighted_sum(const float* w, int64_t w_stride, const float* v, const int64_t* offsets, int64_t t0,
                  int64_t t1, int64_t n, int64_t width, const float* totals, float* sums, int64_t G, int64_t Dp,
                  float* out, int64_t D) {
    constexpr int U = chains(GB, C);
    const __mmask16 last = first_lanes(TAIL ? width : LANES);
    __m512 acc[U][GB][C];
    #pragma GCC unroll 8
    for (int u = 0; u < U; ++u)
        #pragma GCC unroll 4
        for (int g = 0; g < GB; ++g)
            #pragma GCC unroll 8
            for (int c = 0; c < C; ++c)
                acc[u][g][c] = t0 ? _mm512_loadu_ps(sums + (u * G + g) * Dp + c * LANES) : _mm512_setzero_ps();
    for (int64_t t = t0; t < t1; t += U)
        #pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
            if (t + u >= t1) break;   // the context's last n % U keys
            const float* vt = v + offsets[t + u];
            __m512 x[C];
            #pragma GCC unroll 8
            for (int c = 0; c < C; ++c)
                x[c] = TAIL && c == C - 1 ? _mm512_maskz_loadu_ps(last, vt + c * LANES) : _mm512_loadu_ps(vt + c * LANES);
            #pragma GCC unroll 4
            for (int g = 0; g < GB; ++g) {
                const __m512 wt = _mm512_set1_ps(w[g * w_stride + t + u]);
                #pragma GCC unroll 8
                for (int c = 0; c < C; ++c) acc[u][g][c] = _mm512_fmadd_ps(wt, x[c], acc[u][g][c]);
            }
        }
    #pragma GCC unroll 4
    for (int g = 0; g < GB; ++g)
        #pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            if (t1 < n) {
                #pragma GCC unroll 8
                for (int u = 0; u < U; ++u) _mm512_storeu_ps(sums + (u * G + g) * Dp + c * LANES, acc[u][g][c]);
                continue;
            }
            __m512 r = acc[0][g][c];
            #pragma GCC unroll 8
            for (int u = 1; u < U; ++u) r = _mm512_add_ps(r, acc[u][g][c]);
            r = _mm512_div_ps(r, _mm512_set1_ps(totals[g]));
            if (TAIL && c == C - 1) _mm512_mask_storeu_ps(out + g * D + c * LANES, last, r);
            else _mm512_storeu_ps(out + g * D + c * LANES, r);
        }
}

// passes[GB][C][TAIL] (C up to 8 / GB)
#define PASS(GB, C) {&weighted_sum<GB, C, false>, &weighted_sum<GB, C, true>}
constexpr Pass passes[5][9][2] = {
    {},
    {{}, PASS(1, 1), PASS(1, 2), PASS(1, 3), PASS(1, 4), PASS(1, 5), PASS(1, 6), PASS(1, 7), PASS(1, 8)},
    {{}, PASS(2, 1), PASS(2, 2), PASS(2, 3), PASS(2, 4)},
    {{}, PASS(3, 1), PASS(3, 2)},
    {{}, PASS(4, 1), PASS(4, 2)}};
#undef PASS

void exp_of(const float* x, int64_t n, float* out) {
    for (int64_t i = 0; i < n; i += LANES) {
        const __mmask16 lanes = first_lanes(n - i);
        _mm512_mask_storeu_ps(out + i, lanes, exp_nonpositive(_mm512_maskz_loadu_ps(lanes, x + i)));
    }
}

}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {

constexpr int LANES = 8;

inline __m256i first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(count < LANES ? count : LANES)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// avx512::exp_nonpositive's steps over 8 lanes; 2^n as two factors 2^h 2^(n - h), h = floor(n / 2), each a
// normal float32, so p * 2^h is exact and the second product rounds once, as vscalefps does: the same bits.
inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i h = _mm256_srai_epi32(ni, 1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
    const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, first), second);
}

// Lane j of the result: the sum of the 8 lanes of a[j].
inline __m256 sum_each(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);   // a[0..3], a[4..7] per half
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float max_lanes(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// avx512::score over 8 keys at a time (any D; no pairs: a head of 8 fills a vector).
void score(const float* q, int64_t G, int64_t D, const float* k, const int64_t* offsets, int64_t n,
           float* scores, int64_t scores_stride) {
    const int64_t full = D / LANES, ahead = (PREFETCH_BYTES / (D * 4) + LANES - 1) / LANES * LANES;
    const __m256i tail = first_lanes(D % LANES);
    prefetch_rows<_MM_HINT_T0>(k, offsets, 0, ahead, n, D);
    for (int64_t t0 = 0; t0 < n; t0 += LANES) {
        prefetch_rows<_MM_HINT_T0>(k, offsets, t0 + ahead, t0 + ahead + LANES, n, D);
        const float* key[LANES];   // past n the context's first key again, its score unused
        for (int j = 0; j < LANES; ++j) key[j] = k + offsets[t0 + j < n ? t0 + j : 0];
        for (int64_t g = 0; g < G; ++g) {
            const float* qg = q + g * D;
            __m256 acc[LANES];
            for (int i = 0; i < LANES; ++i) acc[i] = _mm256_setzero_ps();
            for (int64_t c = 0; c < full; ++c) {
                const __m256 qv = _mm256_loadu_ps(qg + c * LANES);
                for (int i = 0; i < LANES; ++i)
                    acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[i] + c * LANES), acc[i]);
            }
            if (D % LANES) {
                const __m256 qv = _mm256_maskload_ps(qg + full * LANES, tail);
                for (int i = 0; i < LANES; ++i)
                    acc[i] = _mm256_fmadd_ps(qv, _mm256_maskload_ps(key[i] + full * LANES, tail), acc[i]);
            }
            _mm256_storeu_ps(scores + g * scores_stride + t0, sum_each(acc));
        }
    }
}

// avx512::exp_and_sum over 8 lanes.
float exp_and_sum(float* s, int64_t n) {
    __m256 top = _mm256_set1_ps(-__builtin_inff());
    for (int64_t t = 0; t < n; t += LANES)
        top = _mm256_blendv_ps(top, _mm256_max_ps(_mm256_loadu_ps(s + t), top),
                               _mm256_castsi256_ps(first_lanes(n - t)));
    const __m256 max = _mm256_set1_ps(max_lanes(top));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t += LANES) {
        const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(first_lanes(n - t)),
                                       exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), max)));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    return sum_lanes(sum);
}

// avx512::weighted_sum over 8 lanes.
template <int GB, int C, bool TAIL>
void weighted_sum(const float* w, int64_t w_stride, const float* v, const int64_t* offsets, int64_t t0,
                  int64_t t1, int64_t n, int64_t width, const float* totals, float* sums, int64_t G, int64_t Dp,
                  float* out, int64_t D) {
    constexpr int U = chains(GB, C);
    const __m256i last = first_lanes(TAIL ? width : LANES);
    __m256 acc[U][GB][C];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 4
        for (int g = 0; g < GB; ++g)
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c)
                acc[u][g][c] = t0 ? _mm256_loadu_ps(sums + (u * G + g) * Dp + c * LANES) : _mm256_setzero_ps();
    for (int64_t t = t0; t < t1; t += U)
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
            if (t + u >= t1) break;   // the context's last n % U keys
            const float* vt = v + offsets[t + u];
            __m256 x[C];
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c)
                x[c] = TAIL && c == C - 1 ? _mm256_maskload_ps(vt + c * LANES, last) : _mm256_loadu_ps(vt + c * LANES);
#pragma GCC unroll 4
            for (int g = 0; g < GB; ++g) {
                const __m256 wt = _mm256_broadcast_ss(w + g * w_stride + t + u);
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c) acc[u][g][c] = _mm256_fmadd_ps(wt, x[c], acc[u][g][c]);
            }
        }
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            if (t1 < n) {
#pragma GCC unroll 8
                for (int u = 0; u < U; ++u) _mm256_storeu_ps(sums + (u * G + g) * Dp + c * LANES, acc[u][g][c]);
                continue;
            }
            __m256 r = acc[0][g][c];
#pragma GCC unroll 8
            for (int u = 1; u < U; ++u) r = _mm256_add_ps(r, acc[u][g][c]);
            r = _mm256_div_ps(r, _mm256_set1_ps(totals[g]));
            if (TAIL && c == C - 1) _mm256_maskstore_ps(out + g * D + c * LANES, last, r);
            else _mm256_storeu_ps(out + g * D + c * LANES, r);
        }
}

// passes[GB][C][TAIL], as avx512::passes
#define PASS(GB, C) {&weighted_sum<GB, C, false>, &weighted_sum<GB, C, true>}
constexpr Pass passes[5][9][2] = {
    {},
    {{}, PASS(1, 1), PASS(1, 2), PASS(1, 3), PASS(1, 4), PASS(1, 5), PASS(1, 6), PASS(1, 7), PASS(1, 8)},
    {{}, PASS(2, 1), PASS(2, 2), PASS(2, 3), PASS(2, 4)},
    {{}, PASS(3, 1), PASS(3, 2)},
    {{}, PASS(4, 1), PASS(4, 2)}};
#undef PASS

void exp_of(const float* x, int64_t n, float* out) {
    for (int64_t i = 0; i < n; i += LANES) {
        const __m256i lanes = first_lanes(n - i);
        _mm256_maskstore_ps(out + i, lanes, exp_nonpositive(_mm256_maskload_ps(x + i, lanes)));
    }
}

}  // namespace avx2
#pragma GCC pop_options

// One buffer per thread, grown as needed, freed when the thread ends.
struct Scratch {
    void* data = nullptr;
    int64_t capacity = 0;
    ~Scratch() { free(data); }
};

void* scratch(int64_t bytes) {
    thread_local Scratch buffer;
    if (bytes > buffer.capacity) {
        free(buffer.data);
        buffer.data = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        buffer.capacity = buffer.data ? bytes : 0;
    }
    return buffer.data;
}

bool supported(int isa) {
    __builtin_cpu_init();
    if (isa == AVX512) return __builtin_cpu_supports("avx512f");
    if (isa == AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return false;
}

}  // namespace

// A batch's decodes and the cache's shape, as native_attention.py's DecodeRows lays them out (int64 fields).
struct DecodeBatch {
    const int32_t* block_tables;   // int32 rows of table_stride entries
    int64_t table_stride;
    const int32_t* context_lens;   // int32[num_seqs]
    const int64_t* seqs;           // [num_decodes]: each decode's sequence
    const int64_t* rows;           // [num_decodes]: its row of q and out
    int64_t num_decodes, num_blocks, Hk, G, D, bs;
};

namespace {

// Below this many multiply-adds in a call (about 0.4 ms of one core) the decodes run on the calling thread:
// an OpenMP region waits for every thread of its team to be on a core, which on a shared machine cost a
// one-stream step at context 128 more than its attention (bench/cpu_decode_attention.py, load average 5).
constexpr int64_t MIN_PARALLEL_WORK = 1 << 20;

// decode_attention on one path: score (one head's scores of one decode), exp_and_sum, passes (the weighted
// sum's, by query heads, vectors and tail).
template <int LANES>
int decode(Score score, float (*exp_and_sum)(float*, int64_t), const Pass (*passes)[9][2],
           const DecodeBatch* batch, const float* q, int64_t q_stride, const float* k_cache,
           const float* v_cache, float scale, int64_t window, int threads, float* out) {
    const int32_t* block_tables = batch->block_tables;
    const int32_t* context_lens = batch->context_lens;
    const int64_t *seqs = batch->seqs, *rows = batch->rows;
    const int64_t table_stride = batch->table_stride, num_decodes = batch->num_decodes;
    const int64_t num_blocks = batch->num_blocks, Hk = batch->Hk, G = batch->G, D = batch->D, bs = batch->bs;
    const int64_t out_stride = Hk * G * D, head_stride = bs * D, block_stride = Hk * head_stride;
    const int64_t Dp = (D + LANES - 1) / LANES * LANES;   // a row of the chains' sums: whole vectors
    int64_t longest = 0, keys = 0;
    for (int64_t i = 0; i < num_decodes; ++i) {   // every table entry a decode reads is checked before any read
        const int64_t len = context_lens[seqs[i]];
        const int32_t* table = block_tables + seqs[i] * table_stride;
        if (len > table_stride * bs) return -2;
        const int64_t first = window > 0 && len > window ? len - window : 0;
        for (int64_t b = first / bs; b * bs < len; ++b)
            if (table[b] < 0 || table[b] >= num_blocks) return -2;
        longest = len - first > longest ? len - first : longest;
        keys += len - first;
    }
    const int64_t padded = (longest + LANES - 1) / LANES * LANES;   // a score row: whole vectors
    const int64_t bytes = padded * 8 + G * padded * 4 + G * D * 4 + 8 * G * Dp * 4 + G * 4;
    const int team = keys * Hk * G * D < MIN_PARALLEL_WORK ? 1 : threads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(team)
    for (int64_t item = 0; item < num_decodes * Hk; ++item) {
        const int64_t i = item / Hk, h = item % Hk;
        char* memory = (char*)scratch(bytes);
        if (!memory) {
            failed = 1;
            continue;
        }
        int64_t* offsets = (int64_t*)memory;             // [n]: key t's place in the caches, head h
        float* scores = (float*)(memory + padded * 8);   // [G][padded]
        float* scaled = scores + G * padded;             // [G][D]: the head's queries, scaled
        float* sums = scaled + G * D;                    // [8][G][Dp]: the weighted sum's chains
        float* totals = sums + 8 * G * Dp;               // [G]: the softmax's denominators
        const int64_t len = context_lens[seqs[i]];
        const int32_t* table = block_tables + seqs[i] * table_stride;
        // A sliding window: keys first .. len - 1 only (the blocks before them may be freed: never read).
        const int64_t first = window > 0 && len > window ? len - window : 0, n = len - first;
        float* oi = out + rows[i] * out_stride + h * G * D;
        if (n <= 0) {   // no keys (never from the engine): zeros rather than 0 / 0
            for (int64_t j = 0; j < G * D; ++j) oi[j] = 0.0f;
            continue;
        }
        for (int64_t b = first / bs; b * bs < len; ++b) {
            const int64_t base = table[b] * block_stride + h * head_stride;
            for (int64_t t = b * bs > first ? b * bs : first; t < len && t < (b + 1) * bs; ++t)
                offsets[t - first] = base + (t - b * bs) * D;
        }
        const float* qi = q + rows[i] * q_stride + h * G * D;
        for (int64_t j = 0; j < G * D; ++j) scaled[j] = qi[j] * scale;
        score(scaled, G, D, k_cache, offsets, n, scores, padded);
        for (int64_t g = 0; g < G; ++g) totals[g] = exp_and_sum(scores + g * padded, n);
        prefetch_rows<_MM_HINT_T1>(v_cache, offsets, 0, SEGMENT, n, D);
        for (int64_t t0 = 0; t0 < n; t0 += SEGMENT) {
            const int64_t t1 = t0 + SEGMENT < n ? t0 + SEGMENT : n;
            prefetch_rows<_MM_HINT_T1>(v_cache, offsets, t1, t1 + SEGMENT, n, D);
            for (int64_t g0 = 0; g0 < G; g0 += 4) {
                const int64_t GB = G - g0 < 4 ? G - g0 : 4, most = 8 / GB;
                for (int64_t d0 = 0; d0 < D; d0 += most * LANES) {
                    const int64_t C = (D - d0 + LANES - 1) / LANES < most ? (D - d0 + LANES - 1) / LANES : most;
                    const int64_t width = D - d0 - (C - 1) * LANES < LANES ? D - d0 - (C - 1) * LANES : LANES;
                    passes[GB][C][width < LANES](scores + g0 * padded, padded, v_cache + d0, offsets, t0, t1, n,
                                                 width, totals + g0, sums + g0 * Dp + d0, G, Dp,
                                                 oi + g0 * D + d0, D);
                }
            }
        }
    }
    return failed ? -1 : 0;
}

}  // namespace

extern "C" {

// The widest path this CPU runs: AVX512, AVX2, or NONE.
__attribute__((visibility("default"))) int native_attention_best_isa() {
    return supported(AVX512) ? AVX512 : supported(AVX2) ? AVX2 : NONE;
}

// out[i] = e^x[i] for x[i] <= 0 by path isa's exp: how tests/unit/test_native_attention.py measures its
// accuracy. Returns 0, or -2 when this CPU cannot run the path.
__attribute__((visibility("default"))) int exp_nonpositive_of(int isa, const float* x, int64_t n,
                                                             float* out) {
    if (!supported(isa)) return -2;
    (isa == AVX512 ? avx512::exp_of : avx2::exp_of)(x, n, out);
    return 0;
}

// For each decode i, on path isa: sequence b.seqs[i], whose query is row b.rows[i] of q and whose output goes
// to that row of out, attends to its context_lens[seq] keys, key t in block block_tables[seq][t / bs] at
// offset t % bs; with window > 0 only its last `window` keys (0: all of them).
//   q: float32 rows of [Hq = Hk * G][D] (row stride q_stride floats), unscaled; scores use q * scale (float32)
//   k_cache, v_cache: float32[num_blocks][Hk][bs][D]
//   out: float32[..][Hq][D], C order
// threads: at most this many OpenMP threads (each a share of the (decode, KV head) items; the result is the
// same for any count). Returns 0; -1 when the scratch memory could not be allocated; -2 when a block-table entry within a context
// is not a block of the cache, or a context is longer than its block-table row holds (nothing is read); -3
// when this CPU cannot run the path.
__attribute__((visibility("default"))) int decode_attention(int isa, const DecodeBatch* batch, const float* q,
                                                           int64_t q_stride, const float* k_cache,
                                                           const float* v_cache, float scale, int64_t window,
                                                           int threads, float* out) {
    if (!supported(isa)) return -3;
    if (isa == AVX512)
        return decode<avx512::LANES>(batch->D <= 8 ? avx512::score_pairs : avx512::score, avx512::exp_and_sum,
                                     avx512::passes, batch, q, q_stride, k_cache, v_cache, scale, window,
                                     threads, out);
    return decode<avx2::LANES>(avx2::score, avx2::exp_and_sum, avx2::passes, batch, q, q_stride, k_cache,
                               v_cache, scale, window, threads, out);
}

}  // extern "C"
