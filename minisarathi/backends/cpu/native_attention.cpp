// Decode attention on the CPU: each single-token query attends to its sequence's keys, read straight from the
// paged KV cache through its block table (no gather copy), for all decodes of a batch in one call.
//
// Why: NumPy's batched matmul makes one tiny BLAS call per (sequence, KV head) plus a gather, a mask, an exp
// and a sum pass over the scores; at small head_dim that overhead is most of a decode step's attention.
//
// Per decode: the key offsets of the context are computed once (shared by the KV heads, and by K and V, which
// have the same layout); its keys are scored 16 at a time for every KV head in turn (a block's K tiles are
// adjacent, so the cache is read in order), the G query heads of a KV head from the same loaded keys (one
// accumulator per key, vectorized over head_dim, then a 16-to-1 transposing sum tree gives the 16 scores as
// one vector), K prefetched ahead into L1 and V into L2; then per query head the softmax runs on those vectors
// with a polynomial exp, and the output is the weights times V, vectorized over head_dim, with a few
// independent accumulator chains so the sum over keys is not bound by the latency of one chain of fused
// multiply-adds.
//
// Two paths, chosen at run time: AVX-512 (16 lanes) and AVX2 + FMA (8 lanes, the same steps over half-width
// vectors; its sums over lanes take other trees, so its last bits differ from the AVX-512 path's).
//
// Determinism: every number a decode's output depends on is computed from that decode's own query, keys and
// context length, in an order fixed by the context length alone: a row's result is bit-identical whatever
// batch it is in (which other rows, how many, in what order). Built without -ffast-math, so the compiler
// keeps the written order of every sum.
// GCC 12 warns of its own intrinsics' deliberately undefined operands when they are inlined into a
// function with a target attribute; the warnings are false.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

namespace {

enum Isa { NONE = 0, AVX2 = 2, AVX512 = 3 };   // native_attention.py's ISAS

// Keys whose K rows are fetched into L1 this far ahead of their scores: a head's keys are bs-row tiles Hk
// tiles apart, a pattern the hardware prefetchers miss (long decodes stalled on those loads).
constexpr int64_t PREFETCH_KEYS = 64;

// Asks for the K rows of keys [t, t + KEYS) (clipped to n) into L1, and the V rows of [t - PREFETCH_KEYS, ...)
// into L2, where the weighted sum will read them after the softmax. One prefetch per 64-byte line.
template <int KEYS>
inline void prefetch(const float* k, const float* v, const int64_t* offsets, int64_t t, int64_t n, int64_t D,
                     int64_t Hk, int64_t head_stride) {
    for (int64_t j = t; j < t + KEYS && j < n; ++j)
        for (int64_t h = 0; h < Hk; ++h)
            for (int64_t d = 0; d < D; d += 16)
                _mm_prefetch((const char*)(k + offsets[j] + h * head_stride + d), _MM_HINT_T0);
    for (int64_t j = t < PREFETCH_KEYS ? n : t - PREFETCH_KEYS; j < t - PREFETCH_KEYS + KEYS && j < n; ++j)
        for (int64_t h = 0; h < Hk; ++h)
            for (int64_t d = 0; d < D; d += 16)
                _mm_prefetch((const char*)(v + offsets[j] + h * head_stride + d), _MM_HINT_T1);
}

// out[0 .. C * LANES) of weighted_sum<C, U> (the last vector's first `width` lanes only).
using WeightedSum = void (*)(const float*, const float*, const int64_t*, int64_t, int64_t, float, float*);
using Score = void (*)(const float*, int64_t, int64_t, int64_t, const float*, const float*, int64_t,
                       const int64_t*, int64_t, float*, int64_t);

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {

constexpr int LANES = 16;
constexpr int64_t SLICE = 8 * LANES;   // head_dim columns per pass of the weighted sum: 8 zmm accumulators

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
// q: float32[G][D], already scaled; k: the head's keys, key t at k + offsets[t].
void score(const float* q, int64_t Hk, int64_t G, int64_t D, const float* k, const float* v, int64_t head_stride,
           const int64_t* offsets, int64_t n, float* scores, int64_t scores_stride) {
    const int64_t full = D / LANES;
    const __mmask16 tail = first_lanes(D % LANES);
    for (int64_t t0 = -PREFETCH_KEYS; t0 < n + PREFETCH_KEYS; t0 += LANES) {
        prefetch<LANES>(k, v, offsets, t0 + PREFETCH_KEYS, n, D, Hk, head_stride);
        if (t0 < 0 || t0 >= n) continue;   // the first K rows' and the last V rows' prefetches
        const float* key[LANES];
        key_rows(k, offsets, t0, n, key);
        for (int64_t hg = 0; hg < Hk * G; ++hg) {   // every head of a key group: its K tiles are adjacent
            const float* qg = q + hg * D;
            const int64_t at = hg / G * head_stride;
            __m512 acc[LANES];
            for (int i = 0; i < LANES; ++i) acc[i] = _mm512_setzero_ps();
            for (int64_t c = 0; c < full; ++c) {
                const __m512 qv = _mm512_loadu_ps(qg + c * LANES);
                for (int i = 0; i < LANES; ++i)
                    acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(key[i] + at + c * LANES), acc[i]);
            }
            if (tail) {
                const __m512 qv = _mm512_maskz_loadu_ps(tail, qg + full * LANES);
                for (int i = 0; i < LANES; ++i)
                    acc[i] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, key[i] + at + full * LANES), acc[i]);
            }
            _mm512_storeu_ps(scores + hg * scores_stride + t0, sum_each(acc));
        }
    }
}

// score() for D <= 8: two keys per vector (one in each 256-bit half), so the sum tree starts at its second
// stage and the 8 vectors of 16 keys are loaded once for the G queries.
void score_pairs(const float* q, int64_t Hk, int64_t G, int64_t D, const float* k, const float* v,
                 int64_t head_stride, const int64_t* offsets, int64_t n, float* scores, int64_t scores_stride) {
    const __mmask16 low = first_lanes(D), high = (__mmask16)(low << 8);
    for (int64_t t0 = -PREFETCH_KEYS; t0 < n + PREFETCH_KEYS; t0 += LANES) {
        prefetch<LANES>(k, v, offsets, t0 + PREFETCH_KEYS, n, D, Hk, head_stride);
        if (t0 < 0 || t0 >= n) continue;   // the first K rows' and the last V rows' prefetches
        const float* key[LANES];
        key_rows(k, offsets, t0, n, key);
        for (int64_t h = 0; h < Hk; ++h) {   // every head of a key group: its K tiles are adjacent
            __m512 pair[8];   // a[2i] of sum_each in lanes 0-7, a[2i + 1] in lanes 8-15
            for (int i = 0; i < 8; ++i)   // lanes 8-15 read from key - 8: only lanes 8 .. 8 + D - 1 are read
                pair[i] = _mm512_mask_loadu_ps(_mm512_maskz_loadu_ps(low, key[2 * i] + h * head_stride), high,
                                               key[2 * i + 1] + h * head_stride - 8);
            for (int64_t g = 0; g < G; ++g) {
                const __m512 qv = _mm512_maskz_loadu_ps(low, q + (h * G + g) * D);
                const __m512 qq = _mm512_shuffle_f32x4(qv, qv, _MM_SHUFFLE(1, 0, 1, 0));   // q in both halves
                __m512 b[8];
                for (int i = 0; i < 8; ++i) b[i] = _mm512_mul_ps(pair[i], qq);
                _mm512_storeu_ps(scores + (h * G + g) * scores_stride + t0, sum_halves(b));
            }
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

// out[0 .. C * 16) (the last vector's first `width` lanes only) = sum over t < n of w[t] * v[offsets[t] + ...],
// divided by total. U chains of accumulators take keys t % U; they are added in order at the end.
template <int C, int U>
void weighted_sum(const float* w, const float* v, const int64_t* offsets, int64_t n, int64_t width, float total,
                  float* out) {
    const __mmask16 last = first_lanes(width);
    __m512 acc[U][C];
    #pragma GCC unroll 8
    for (int u = 0; u < U; ++u)
        #pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[u][c] = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + U <= n; t += U)
        #pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
            const __m512 wt = _mm512_set1_ps(w[t + u]);
            const float* vt = v + offsets[t + u];
            #pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
                const __m512 x = c == C - 1 ? _mm512_maskz_loadu_ps(last, vt + c * LANES) : _mm512_loadu_ps(vt + c * LANES);
                acc[u][c] = _mm512_fmadd_ps(wt, x, acc[u][c]);
            }
        }
    #pragma GCC unroll 8
    for (int u = 0; u < U; ++u)   // the last n % U keys (u a constant: the accumulators stay in registers)
        if (t + u < n) {
            const __m512 wt = _mm512_set1_ps(w[t + u]);
            const float* vt = v + offsets[t + u];
            #pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
                const __m512 x = c == C - 1 ? _mm512_maskz_loadu_ps(last, vt + c * LANES)
                                            : _mm512_loadu_ps(vt + c * LANES);
                acc[u][c] = _mm512_fmadd_ps(wt, x, acc[u][c]);
            }
        }
    const __m512 denominator = _mm512_set1_ps(total);
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
        __m512 r = acc[0][c];
        #pragma GCC unroll 8
        for (int u = 1; u < U; ++u) r = _mm512_add_ps(r, acc[u][c]);
        r = _mm512_div_ps(r, denominator);
        if (c == C - 1) _mm512_mask_storeu_ps(out + c * LANES, last, r);
        else _mm512_storeu_ps(out + c * LANES, r);
    }
}

// by vectors per pass (1-8); fewer vectors, more chains: about 4-8 independent accumulators each time
constexpr WeightedSum weighted_sum_of[9] = {nullptr, &weighted_sum<1, 4>, &weighted_sum<2, 2>, &weighted_sum<3, 2>,
                                            &weighted_sum<4, 1>, &weighted_sum<5, 1>, &weighted_sum<6, 1>,
                                            &weighted_sum<7, 1>, &weighted_sum<8, 1>};

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
constexpr int64_t SLICE = 8 * LANES;   // head_dim columns per pass of the weighted sum: 8 ymm accumulators

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
void score(const float* q, int64_t Hk, int64_t G, int64_t D, const float* k, const float* v, int64_t head_stride,
           const int64_t* offsets, int64_t n, float* scores, int64_t scores_stride) {
    const int64_t full = D / LANES;
    const __m256i tail = first_lanes(D % LANES);
    for (int64_t t0 = -PREFETCH_KEYS; t0 < n + PREFETCH_KEYS; t0 += LANES) {
        prefetch<LANES>(k, v, offsets, t0 + PREFETCH_KEYS, n, D, Hk, head_stride);
        if (t0 < 0 || t0 >= n) continue;   // the first K rows' and the last V rows' prefetches
        const float* key[LANES];   // past n the context's first key again, its score unused
        for (int j = 0; j < LANES; ++j) key[j] = k + offsets[t0 + j < n ? t0 + j : 0];
        for (int64_t hg = 0; hg < Hk * G; ++hg) {   // every head of a key group: its K tiles are adjacent
            const float* qg = q + hg * D;
            const int64_t at = hg / G * head_stride;
            __m256 acc[LANES];
            for (int i = 0; i < LANES; ++i) acc[i] = _mm256_setzero_ps();
            for (int64_t c = 0; c < full; ++c) {
                const __m256 qv = _mm256_loadu_ps(qg + c * LANES);
                for (int i = 0; i < LANES; ++i)
                    acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[i] + at + c * LANES), acc[i]);
            }
            if (D % LANES) {
                const __m256 qv = _mm256_maskload_ps(qg + full * LANES, tail);
                for (int i = 0; i < LANES; ++i)
                    acc[i] =
                        _mm256_fmadd_ps(qv, _mm256_maskload_ps(key[i] + at + full * LANES, tail), acc[i]);
            }
            _mm256_storeu_ps(scores + hg * scores_stride + t0, sum_each(acc));
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
template <int C, int U>
void weighted_sum(const float* w, const float* v, const int64_t* offsets, int64_t n, int64_t width,
                  float total, float* out) {
    const __m256i last = first_lanes(width);
    __m256 acc[U][C];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[u][c] = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + U <= n; t += U)
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
            const __m256 wt = _mm256_broadcast_ss(w + t + u);
            const float* vt = v + offsets[t + u];
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
                const __m256 x = c == C - 1 ? _mm256_maskload_ps(vt + c * LANES, last)
                                            : _mm256_loadu_ps(vt + c * LANES);
                acc[u][c] = _mm256_fmadd_ps(wt, x, acc[u][c]);
            }
        }
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u)   // the last n % U keys
        if (t + u < n) {
            const __m256 wt = _mm256_broadcast_ss(w + t + u);
            const float* vt = v + offsets[t + u];
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
                const __m256 x = c == C - 1 ? _mm256_maskload_ps(vt + c * LANES, last)
                                            : _mm256_loadu_ps(vt + c * LANES);
                acc[u][c] = _mm256_fmadd_ps(wt, x, acc[u][c]);
            }
        }
    const __m256 denominator = _mm256_set1_ps(total);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
        __m256 r = acc[0][c];
#pragma GCC unroll 8
        for (int u = 1; u < U; ++u) r = _mm256_add_ps(r, acc[u][c]);
        r = _mm256_div_ps(r, denominator);
        if (c == C - 1) _mm256_maskstore_ps(out + c * LANES, last, r);
        else _mm256_storeu_ps(out + c * LANES, r);
    }
}

// by vectors per pass (1-8), as avx512::weighted_sum_of
constexpr WeightedSum weighted_sum_of[9] = {nullptr,
                                            &weighted_sum<1, 4>,
                                            &weighted_sum<2, 2>,
                                            &weighted_sum<3, 2>,
                                            &weighted_sum<4, 1>,
                                            &weighted_sum<5, 1>,
                                            &weighted_sum<6, 1>,
                                            &weighted_sum<7, 1>,
                                            &weighted_sum<8, 1>};

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

// decode_attention on one path: score (its scores of one decode), exp_and_sum, weighted_sum_of (by vectors
// of LANES per pass of SLICE columns).
template <int LANES, int64_t SLICE>
int decode(Score score, float (*exp_and_sum)(float*, int64_t), const WeightedSum* weighted_sum_of,
           const DecodeBatch* batch, const float* q, int64_t q_stride, const float* k_cache,
           const float* v_cache, float scale, int64_t window, float* out) {
    const int32_t* block_tables = batch->block_tables;
    const int32_t* context_lens = batch->context_lens;
    const int64_t *seqs = batch->seqs, *rows = batch->rows;
    const int64_t table_stride = batch->table_stride, num_decodes = batch->num_decodes;
    const int64_t num_blocks = batch->num_blocks, Hk = batch->Hk, G = batch->G, D = batch->D, bs = batch->bs;
    const int64_t out_stride = Hk * G * D;
    int64_t longest = 0;
    for (int64_t i = 0; i < num_decodes; ++i)
        if (context_lens[seqs[i]] > longest) longest = context_lens[seqs[i]];
    const int64_t padded = (longest + LANES - 1) / LANES * LANES;   // a score row: whole vectors
    char* memory = (char*)scratch(padded * 8 + Hk * G * padded * 4 + Hk * G * D * 4);
    if (!memory) return -1;
    int64_t* offsets = (int64_t*)memory;                        // [longest]: key t's place in head 0
    float* scores = (float*)(memory + padded * 8);              // [Hk * G][padded]
    float* scaled = scores + Hk * G * padded;                   // [Hk * G][D]: the decode's queries, scaled
    const int64_t head_stride = bs * D;
    const int64_t block_stride = Hk * head_stride;
    for (int64_t i = 0; i < num_decodes; ++i) {
        const int64_t len = context_lens[seqs[i]];
        const int32_t* table = block_tables + seqs[i] * table_stride;
        if (len > table_stride * bs) return -2;
        // A sliding window: keys first .. len - 1 only (the blocks before them may be freed: never read).
        const int64_t first = window > 0 && len > window ? len - window : 0, n = len - first;
        for (int64_t b = first / bs; b * bs < len; ++b) {
            if (table[b] < 0 || table[b] >= num_blocks) return -2;
            const int64_t base = table[b] * block_stride;
            for (int64_t t = b * bs > first ? b * bs : first; t < len && t < (b + 1) * bs; ++t)
                offsets[t - first] = base + (t - b * bs) * D;
        }
        const float* qi = q + rows[i] * q_stride;
        float* oi = out + rows[i] * out_stride;
        if (n <= 0) {   // no keys (never from the engine): zeros rather than 0 / 0
            for (int64_t j = 0; j < Hk * G * D; ++j) oi[j] = 0.0f;
            continue;
        }
        for (int64_t j = 0; j < Hk * G * D; ++j) scaled[j] = qi[j] * scale;
        score(scaled, Hk, G, D, k_cache, v_cache, head_stride, offsets, n, scores, padded);
        for (int64_t hg = 0; hg < Hk * G; ++hg) {
            float* w = scores + hg * padded;
            const float total = exp_and_sum(w, n);
            for (int64_t d0 = 0; d0 < D; d0 += SLICE) {
                const int64_t width = D - d0 < SLICE ? D - d0 : SLICE;
                const int vectors = (int)((width + LANES - 1) / LANES);
                weighted_sum_of[vectors](w, v_cache + hg / G * head_stride + d0, offsets, n,
                                         width - (vectors - 1) * LANES, total, oi + hg * D + d0);
            }
        }
    }
    return 0;
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
// Returns 0; -1 when the scratch memory could not be allocated; -2 when a block-table entry within a context
// is not a block of the cache, or a context is longer than its block-table row holds (nothing is read); -3
// when this CPU cannot run the path.
__attribute__((visibility("default"))) int decode_attention(int isa, const DecodeBatch* batch, const float* q,
                                                           int64_t q_stride, const float* k_cache,
                                                           const float* v_cache, float scale, int64_t window,
                                                           float* out) {
    if (!supported(isa)) return -3;
    if (isa == AVX512)
        return decode<avx512::LANES, avx512::SLICE>(batch->D <= 8 ? avx512::score_pairs : avx512::score,
                                                    avx512::exp_and_sum, avx512::weighted_sum_of, batch, q,
                                                    q_stride, k_cache, v_cache, scale, window, out);
    return decode<avx2::LANES, avx2::SLICE>(avx2::score, avx2::exp_and_sum, avx2::weighted_sum_of, batch, q,
                                            q_stride, k_cache, v_cache, scale, window, out);
}

}  // extern "C"
