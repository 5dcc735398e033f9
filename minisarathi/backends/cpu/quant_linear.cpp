// out = x @ w.T in float32 for a weight kept in a compact quantized form (quant_linear.py makes the parts).
//
// Why: decode reads every weight once per step, so the bytes per weight set its speed. The activations are
// quantized to int8 per block of 32 columns (scale max|x| / 127, round to nearest even), as llama.cpp does
// for its int8 dot products, so each block of 32 weights costs one u8 x s8 dot product into int32
// (_mm256_maddubs_epi16 + _mm256_madd_epi16, or AVX512-VNNI's vpdpbusd) and one float multiply-add by the
// product of the weight's and the activation's scales. The error against the exact product is that of the
// activation rounding (at most half an activation step per weight) plus float32 rounding.
//
// Part kinds (one per compact layout family; a fused weight is several parts stacked on their rows):
//   INT8  int8 values [N, K], a float32 or fp16 scale per group of 16 or 32: w = scale * value
//         (Q8_0, GPTQ-8; fp16 where the file's scales are, as Q8_0's: 34 bytes per 32 weights, not 36)
//   INT6  6-bit codes as 4 + 2 bits, a scale per 16: w = scale * (code - 32)               (Q6_K)
//         low  uint8[N, K / 2]: per block of 32, byte i holds code i (low nibble) and code i + 16 (high)
//         high uint8[N, K / 4]: per block of 32, byte j holds the top 2 bits of codes j, j+8, j+16, j+24
//   UINT4 4-bit codes (low as INT6's), float32 scale and minimum per 32: w = scale * code - minimum
//   UINT5 as UINT4 plus high uint8[N, K / 8]: bit c % 8 of byte c / 8 is code c's fifth bit
//         (Q4_0, Q4_K, AWQ, GPTQ-4: UINT4; Q5_K: UINT5)
// For signed weights u8 x s8 takes |w| and x * sign(w), llama.cpp's way; no pair of products saturates
// int16 (|w| <= 128, |x| <= 127). The minimum's term is sum over blocks of minimum * (x scale * sum of x's
// int8 values), a float dot product after the main loop.
// Scales and minimums are float32 per group, or factored as the K-quants store them: an int8 per group
// times a float32 per 256 columns (their product, exact, is the group's float32 value).
//
// On AVX2 the 4-, 5- and 6-bit kinds take two blocks a step (64 weights: one 32-byte load of nibbles, the
// activations stored in the matching order) and apply the K-quants' int8 scales in int16 (madd), so a float
// multiply-add comes once per 64 weights instead of once per 32 (pair_tile).
//
// Determinism: each output is one float accumulator vector fed block (or pair) by block in k order, then reduced
// the same way, whatever tile it falls in; the activations are quantized alike on every path. So a row's
// result is bit-identical whatever batch it is in (for one ISA). Threads (OpenMP) split the outputs, so each
// output keeps its chain and the result is also the same whatever the thread count.
#include "cpu_isa.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {

enum Kind { INT8 = 0, INT6 = 1, UINT4 = 2, UINT5 = 3 };  // quant_linear.py's KINDS

constexpr int BLOCK = 32;  // activation columns per int8 scale

// One part: rows [N, K] of one kind (quant_linear.py's Part, a ctypes Structure of the same fields).
struct Part {
    int64_t kind;
    int64_t group;          // columns per scale: 16 or 32
    int64_t rows;
    const void* values;     // INT8: int8[N, K]; else low, uint8[N, K / 2]
    const uint8_t* high;    // INT6, UINT5: as above; else null
    const float* scale;     // float32[N, K / group], or [N, K / 256] where scale_sub is given
    const int8_t* scale_sub;  // int8[N, K / group] or null
    const float* minimum;   // UINT4, UINT5: float32[N, K / 32] or [N, K / 256]; else null
    const int8_t* minimum_sub;  // int8[N, K / 32] or null
    int64_t half_scale;     // INT8: 1 where scale holds fp16 bits (uint16[N, K / group]), else 0
};

constexpr int SUPER = 256;  // columns per float32 factor of factored scales

// Group g's scale (or minimum) of a row of `groups` groups of `group` columns.
inline float factor(const float* v, const int8_t* sub, int64_t row, int64_t groups, int64_t group,
                    int64_t g) {
    if (!sub) return v[row * groups + g];
    const int64_t per_super = SUPER / group;
    return v[row * (groups / per_super) + g / per_super] * (float)sub[row * groups + g];
}

// Activations quantized per block of 32: q int8[M, K], s float32[M, K / 32], sum float32[M, K / 32] (the
// scale times the sum of the block's q); and the same in pairs of blocks for the 4-, 5- and 6-bit tiles,
// in the order their nibbles unpack to: per pair of blocks b, b + 1 (b even), qp holds 64 bytes, b's codes
// 0-15, b + 1's 0-15, b's 16-31, b + 1's 16-31 (zeros for a row's odd last block's missing partner), and
// sp 8 floats, b's scale 4 times then b + 1's (0 for the missing one): qp int8[M, P * 64], sp float32[M,
// P * 8], P = ceil(K / 64). One buffer per thread, grown as needed, freed when the thread ends.
struct Activations {
    int8_t* q = nullptr;
    float* s = nullptr;
    float* sum = nullptr;
    int8_t* qp = nullptr;
    float* sp = nullptr;
    int64_t capacity = 0;  // in bytes, of q and of qp: m * P * 64 (at least m * K); s and sum take a 32nd
    ~Activations() { free(q), free(s), free(sum), free(qp), free(sp); }
    bool reserve(int64_t m, int64_t k) {
        const int64_t bytes = m * ((k / BLOCK + 1) / 2) * 64;
        if (bytes <= capacity) return true;
        free(q), free(s), free(sum), free(qp), free(sp);
        q = (int8_t*)aligned_alloc(64, bytes);
        s = (float*)malloc(bytes / BLOCK * sizeof(float));
        sum = (float*)malloc(bytes / BLOCK * sizeof(float));
        qp = (int8_t*)aligned_alloc(64, bytes);
        sp = (float*)aligned_alloc(64, bytes / 8 * sizeof(float));
        capacity = (q && s && sum && qp && sp) ? bytes : 0;
        return capacity != 0;
    }
    // Row t's pair-order copies from its q and s.
    void pair_row(int64_t t, int64_t k) {
        const int64_t nb = k / BLOCK, pairs = (nb + 1) / 2;
        for (int64_t b = 0; b < nb; ++b) {
            int8_t* to = qp + (t * pairs + b / 2) * 64 + b % 2 * 16;
            memcpy(to, q + t * k + b * BLOCK, 16);
            memcpy(to + 32, q + t * k + b * BLOCK + 16, 16);
            for (int e = 0; e < 4; ++e) sp[(t * pairs + b / 2) * 8 + b % 2 * 4 + e] = s[t * nb + b];
        }
        if (nb % 2) {
            int8_t* to = qp + (t * pairs + nb / 2) * 64 + 16;
            memset(to, 0, 16), memset(to + 32, 0, 16);
            for (int e = 0; e < 4; ++e) sp[(t * pairs + nb / 2) * 8 + 4 + e] = 0.0f;
        }
    }
};

// Group g's scale of a row of `groups` groups: factor() or an INT8 part's fp16 scale, widened exactly.
inline float scale_at(const Part& p, int64_t row, int64_t groups, int64_t group, int64_t g) {
    if (p.half_scale) return cpu_isa::half_to_float(((const uint16_t*)p.scale)[row * groups + g]);
    return factor(p.scale, p.scale_sub, row, groups, group, g);
}

void quantize_block_scalar(const float* x, int8_t* q, float* s, float* sum) {
    float amax = 0.0f;
    for (int e = 0; e < BLOCK; ++e) amax = fmaxf(amax, fabsf(x[e]));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int total = 0;
    for (int e = 0; e < BLOCK; ++e) {
        const int v = (int)nearbyintf(x[e] * id);
        q[e] = (int8_t)v;
        total += v;
    }
    *s = d;
    *sum = d * (float)total;
}

// Code c of block b of a row, and its weight's integer factor (code - 32 for INT6), for the scalar path.
inline int code_at(const Part& p, int64_t row, int64_t k, int64_t c) {
    if (p.kind == INT8) return ((const int8_t*)p.values)[row * k + c];
    const uint8_t* low = (const uint8_t*)p.values + row * (k / 2);
    const int64_t b = c / BLOCK, e = c % BLOCK;
    int code = (low[b * 16 + e % 16] >> (e / 16 * 4)) & 0x0F;
    if (p.kind == INT6) {
        const uint8_t* high = p.high + row * (k / 4);
        return (code | ((high[b * 8 + e % 8] >> (e / 8 * 2)) & 3) << 4) - 32;
    }
    if (p.kind == UINT5) code |= ((p.high[row * (k / 8) + c / 8] >> (c % 8)) & 1) << 4;
    return code;
}

void scalar_part(const Activations& a, int64_t m, int64_t k, const Part& p, float* out, int64_t ldo) {
    const int64_t nb = k / BLOCK, ng = k / p.group;
#pragma omp for schedule(static) nowait
    for (int64_t c = 0; c < p.rows; ++c)
        for (int64_t t = 0; t < m; ++t) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; ++b)
                for (int64_t h = 0; h < BLOCK / p.group; ++h) {
                    const int64_t first = b * BLOCK + h * p.group;
                    int32_t dot = 0;
                    for (int64_t e = first; e < first + p.group; ++e)
                        dot += code_at(p, c, k, e) * a.q[t * k + e];
                    const float ws = scale_at(p, c, ng, p.group, first / p.group);
                    acc += (float)dot * (ws * a.s[t * nb + b]);
                }
            if (p.minimum)
                for (int64_t b = 0; b < nb; ++b)
                    acc -= factor(p.minimum, p.minimum_sub, c, nb, BLOCK, b) * a.sum[t * nb + b];
            out[t * ldo + c] = acc;
        }
}

// ---------------------------------------------------------------------------------------------------- AVX2

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

void quantize_block(const float* x, int8_t* q, float* s, float* sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float top = _mm_cvtss_f32(m4);
    const __m256 id = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i)
        i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT |
                                                                                 _MM_FROUND_NO_EXC));
    // packs interleave 128-bit lanes: put the 8 groups of 4 back in order
    const __m256i p01 = _mm256_packs_epi32(i32[0], i32[1]), p23 = _mm256_packs_epi32(i32[2], i32[3]);
    __m256i bytes = _mm256_packs_epi16(p01, p23);
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)q, bytes);
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    const float d = top / 127.0f;
    *s = d;
    *sum = d * (float)_mm_cvtsi128_si32(t4);
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Block b's 32 int8 values of an INT8 row.
inline __m256i int8_block(const Part& p, int64_t row, int64_t k, int64_t b) {
    return _mm256_loadu_si256((const __m256i*)((const int8_t*)p.values + row * k + b * 32));
}

// Blocks b and b + 1 (b even; only b where `two` is false: the row's odd last block, its partner zeros) of
// a 4-, 5- or 6-bit row as unsigned codes in the activations' pair order: lo = [b's codes 0-15 | b + 1's
// 0-15], hi = [b's 16-31 | b + 1's 16-31] (one 32-byte load of the nibbles, no shuffle).
template <int KIND>
inline void pair_codes(const Part& p, int64_t row, int64_t k, int64_t b, bool two, __m256i& lo, __m256i& hi) {
    const uint8_t* low = (const uint8_t*)p.values + row * (k / 2) + b * 16;
    const __m256i packed = two ? _mm256_loadu_si256((const __m256i*)low)
                               : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)low));
    const __m256i nib = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(packed, nib);
    hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nib);
    if (KIND == INT6) {  // byte j of a block's 8: the top 2 bits of codes j, j + 8, j + 16, j + 24
        const uint8_t* high = p.high + row * (k / 4) + b * 8;
        const __m128i bits = two ? _mm_loadu_si128((const __m128i*)high) : _mm_loadl_epi64((const __m128i*)high);
        const __m256i both = _mm256_permute4x64_epi64(_mm256_castsi128_si256(bits), 0x50);  // b, b, b+1, b+1
        const __m256i three = _mm256_set1_epi8(3);
        const __m256i top_lo = _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 2, 0, 2)), three);
        const __m256i top_hi = _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(4, 6, 4, 6)), three);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(top_lo, 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(top_hi, 4));
    }
    if (KIND == UINT5) {  // bit c % 8 of byte c / 8 of a block's 4: code c's fifth bit
        uint64_t bits = 0;
        memcpy(&bits, p.high + row * (k / 8) + b * 4, two ? 8 : 4);
        const __m256i all = _mm256_set1_epi64x((int64_t)bits);
        const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
        const __m256i ten = _mm256_set1_epi8(0x10);
        // byte c of lo: byte c / 8 of b's (lane 0) or b + 1's (lane 1) 4; of hi: 2 + c / 8
        const __m256i spread_lo = _mm256_shuffle_epi8(
            all, _mm256_setr_epi64x(0, 0x0101010101010101, 0x0404040404040404, 0x0505050505050505));
        const __m256i spread_hi = _mm256_shuffle_epi8(
            all, _mm256_setr_epi64x(0x0202020202020202, 0x0303030303030303, 0x0606060606060606,
                                    0x0707070707070707));
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread_lo, bit), bit), ten));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread_hi, bit), bit), ten));
    }
}

// int16 x 16: int16 e0 of `four` 8 times, then e1 8 times (a pair's two lanes).
inline __m256i lanes_of(__m256i four, int e0, int e1) {
    const __m256i index = _mm256_set_m128i(_mm_set1_epi16((short)((2 * e1 + 1) << 8 | 2 * e1)),
                                           _mm_set1_epi16((short)((2 * e0 + 1) << 8 | 2 * e0)));
    return _mm256_shuffle_epi8(four, index);
}

// float x 8: f0 4 times, then f1 4 times.
inline __m256 lanes_of(float f0, float f1) {
    return _mm256_set_m128(_mm_set1_ps(f1), _mm_set1_ps(f0));
}

// sum over blocks of row's minimum * activation row t's block sum: 8 blocks a step (one factor's 256
// columns where factored), then the rest.
inline float minimum_dot(const Part& p, int64_t row, int64_t nb, const float* sum) {
    __m256 v = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        __m256 mn;
        if (p.minimum_sub)
            mn = _mm256_mul_ps(_mm256_set1_ps(p.minimum[row * (nb / 8) + b / 8]),
                               _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                   _mm_loadl_epi64((const __m128i*)(p.minimum_sub + row * nb + b)))));
        else
            mn = _mm256_loadu_ps(p.minimum + row * nb + b);
        v = _mm256_fmadd_ps(mn, _mm256_loadu_ps(sum + b), v);
    }
    float rest = hsum(v);
    for (; b < nb; ++b) rest += factor(p.minimum, p.minimum_sub, row, nb, BLOCK, b) * sum[b];
    return rest;
}

// An INT8 part's scale of block b of a row in every lane (GROUP 16: the first's in lanes 0-3, the second's in
// 4-7), float32 or fp16 (broadcast as fp16, then widened by F16C: exact).
template <int GROUP>
inline __m256 int8_scales(const Part& p, int64_t row, int64_t k, int64_t b) {
    const int64_t g = row * (k / GROUP) + b * (BLOCK / GROUP);
    if (p.half_scale) {
        const uint16_t* sc = (const uint16_t*)p.scale + g;
        if (GROUP == 32) return _mm256_cvtph_ps(_mm_set1_epi16((short)sc[0]));
        return _mm256_cvtph_ps(_mm_set_epi16((short)sc[1], (short)sc[1], (short)sc[1], (short)sc[1],
                                             (short)sc[0], (short)sc[0], (short)sc[0], (short)sc[0]));
    }
    const float* sc = p.scale + g;
    return GROUP == 32 ? _mm256_set1_ps(sc[0]) : lanes_of(sc[0], sc[1]);
}

// INT8: one block a step, |w| x x * sign(w), a float scale per 16 or 32.
template <int GROUP, int NT, int NN>
inline void int8_tile(const Activations& a, int64_t i, int64_t k, const Part& p, int64_t j, __m256 acc[NT][NN]) {
    const int64_t nb = k / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b) {
        __m256i w[NN];
        __m256 ws[NN];
        for (int c = 0; c < NN; ++c) {
            w[c] = int8_block(p, j + c, k, b);
            ws[c] = int8_scales<GROUP>(p, j + c, k, b);
        }
        for (int t = 0; t < NT; ++t) {
            const __m256i xq = _mm256_load_si256((const __m256i*)(a.q + (i + t) * k + b * BLOCK));
            const __m256 xs = _mm256_set1_ps(a.s[(i + t) * nb + b]);
            for (int c = 0; c < NN; ++c) {
                const __m256i u = _mm256_sign_epi8(w[c], w[c]), v = _mm256_sign_epi8(xq, w[c]);
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), ones);
                acc[t][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws[c], xs), acc[t][c]);
            }
        }
    }
}

// UINT4, UINT5, INT6: two blocks a step, in the activations' pair order. The unsigned codes' u8 x s8
// products of a block's low and high 16 columns are added as int16 (no overflow: |sum| <= 4 * 63 * 127),
// times the integer scales where FACTORED (madd with int16 scales: one float scale product per pair, per
// 256 columns' factor) or summed (madd with ones) and scaled in float. INT6's code - 32 is the code's
// product minus 32 times the activations' (one maddubs per row, shared by the outputs).
template <int KIND, int GROUP, bool FACTORED, int NT, int NN>
inline void pair_tile(const Activations& a, int64_t i, int64_t k, const Part& p, int64_t j, __m256 acc[NT][NN]) {
    const int64_t nb = k / BLOCK, pairs = (nb + 1) / 2;
    const __m256i ones = _mm256_set1_epi16(1), thirty_two = _mm256_set1_epi8(32);
    constexpr int SCALES = GROUP == 32 ? 1 : 2;  // per pair: one scale vector, or lo's and hi's
    __m256i scales[NN][4][SCALES];  // FACTORED: a super-block's int16 scales, per pair
    __m256 factors[NN];             // FACTORED: its float32 factor
    for (int64_t b = 0; b < nb; b += 2) {
        const bool two = b + 1 < nb;
        if (FACTORED && b % 8 == 0)  // k % 256 == 0: whole super-blocks
            for (int c = 0; c < NN; ++c) {
                const int64_t row = j + c;
                factors[c] = _mm256_set1_ps(p.scale[row * (k / SUPER) + b / 8]);
                const int8_t* sub = p.scale_sub + row * (k / GROUP) + b * (BLOCK / GROUP);
                for (int q = 0; q < 4; ++q) {
                    int32_t four = 0;  // the pair's 2 (GROUP 32) or 4 int8 scales
                    memcpy(&four, sub + q * 2 * (BLOCK / GROUP), 2 * (BLOCK / GROUP));
                    const __m256i wide = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_cvtsi32_si128(four)));
                    if (GROUP == 32) scales[c][q][0] = lanes_of(wide, 0, 1);
                    else scales[c][q][0] = lanes_of(wide, 0, 2), scales[c][q][SCALES - 1] = lanes_of(wide, 1, 3);
                }
            }
        __m256i lo[NN], hi[NN];
        __m256 wlo[NN], whi[NN];  // not FACTORED: the float scales per lane
        for (int c = 0; c < NN; ++c) {
            pair_codes<KIND>(p, j + c, k, b, two, lo[c], hi[c]);
            if (!FACTORED) {
                const float* sc = p.scale + (j + c) * (k / GROUP) + b * (BLOCK / GROUP);
                if (GROUP == 32) wlo[c] = lanes_of(sc[0], two ? sc[1] : 0.0f);
                else wlo[c] = lanes_of(sc[0], two ? sc[2] : 0.0f), whi[c] = lanes_of(sc[1], two ? sc[3] : 0.0f);
            }
        }
        for (int t = 0; t < NT; ++t) {
            const int8_t* xq = a.qp + ((i + t) * pairs + b / 2) * 64;
            const __m256i xlo = _mm256_load_si256((const __m256i*)xq);
            const __m256i xhi = _mm256_load_si256((const __m256i*)(xq + 32));
            const __m256 xs = _mm256_load_ps(a.sp + ((i + t) * pairs + b / 2) * 8);
            __m256i off_lo = _mm256_setzero_si256(), off_hi = off_lo;
            if (KIND == INT6)
                off_lo = _mm256_maddubs_epi16(thirty_two, xlo), off_hi = _mm256_maddubs_epi16(thirty_two, xhi);
            for (int c = 0; c < NN; ++c) {
                __m256i plo = _mm256_maddubs_epi16(lo[c], xlo), phi = _mm256_maddubs_epi16(hi[c], xhi);
                if (KIND == INT6) plo = _mm256_sub_epi16(plo, off_lo), phi = _mm256_sub_epi16(phi, off_hi);
                if (FACTORED) {
                    const __m256i* sc = scales[c][b % 8 / 2];
                    const __m256i dot =
                        GROUP == 32 ? _mm256_madd_epi16(_mm256_add_epi16(plo, phi), sc[0])
                                    : _mm256_add_epi32(_mm256_madd_epi16(plo, sc[0]), _mm256_madd_epi16(phi, sc[SCALES - 1]));
                    acc[t][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(xs, factors[c]), acc[t][c]);
                } else if (GROUP == 32) {
                    const __m256i dot = _mm256_madd_epi16(_mm256_add_epi16(plo, phi), ones);
                    acc[t][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(xs, wlo[c]), acc[t][c]);
                } else {
                    const __m256i dlo = _mm256_madd_epi16(plo, ones), dhi = _mm256_madd_epi16(phi, ones);
                    acc[t][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dlo), _mm256_mul_ps(xs, wlo[c]), acc[t][c]);
                    acc[t][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dhi), _mm256_mul_ps(xs, whi[c]), acc[t][c]);
                }
            }
        }
    }
}

template <int KIND, int GROUP, bool FACTORED, int NT, int NN>
void tile(const Activations& a, int64_t i, int64_t k, const Part& p, int64_t j, float* out, int64_t ldo) {
    __m256 acc[NT][NN];
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < NN; ++c) acc[t][c] = _mm256_setzero_ps();
    if constexpr (KIND == INT8) int8_tile<GROUP, NT, NN>(a, i, k, p, j, acc);
    else pair_tile<KIND, GROUP, FACTORED, NT, NN>(a, i, k, p, j, acc);
    const int64_t nb = k / BLOCK;
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < NN; ++c) {
            float r = hsum(acc[t][c]);
            if (KIND == UINT4 || KIND == UINT5) r -= minimum_dot(p, j + c, nb, a.sum + (i + t) * nb);
            out[(i + t) * ldo + j + c] = r;
        }
}

}  // namespace avx2
#pragma GCC pop_options

// ------------------------------------------------------------------------------------- AVX-512BW (+ VNNI)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace avx512 {
#define QUANT_LINEAR_VNNI 0
#include "quant_linear_avx512.h"
#undef QUANT_LINEAR_VNNI
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace avx512_vnni {
#define QUANT_LINEAR_VNNI 1
#include "quant_linear_avx512.h"
#undef QUANT_LINEAR_VNNI
}  // namespace avx512_vnni
#pragma GCC pop_options

// ------------------------------------------------------------------------------------------------ dispatch

using TileFn = void (*)(const Activations&, int64_t, int64_t, const Part&, int64_t, float*, int64_t);

// A part over tiles of up to NT rows x NN outputs; `pick(nt, nn)` gives the tile function of that shape.
template <int NT, typename Pick>
void run_part(const Activations& a, int64_t m, int64_t k, const Part& p, float* out, int64_t ldo, int NN,
              Pick pick) {
#pragma omp for schedule(static) nowait
    for (int64_t j = 0; j < p.rows; j += NN) {
        const int nn = p.rows - j < NN ? (int)(p.rows - j) : NN;
        for (int64_t i = 0; i < m; i += NT) {
            const int nt = m - i < NT ? (int)(m - i) : NT;
            pick(nt, nn)(a, i, k, p, j, out, ldo);
        }
    }
}

// Tables of tile functions by (nt - 1, nn - 1), filled by index sequences over the shapes.
template <int NT, int NN, template <int, int> class Fn>
struct Table {
    TileFn fns[NT][NN];
    template <int T, int C>
    void fill() {
        fns[T][C] = Fn<T + 1, C + 1>::fn;
        if constexpr (C + 1 < NN) fill<T, C + 1>();
        else if constexpr (T + 1 < NT) fill<T + 1, 0>();
    }
    Table() { fill<0, 0>(); }
};

template <int KIND, int GROUP, bool FACTORED>
struct Avx2Fn {
    template <int T, int C>
    struct of {
        static constexpr TileFn fn = avx2::tile<KIND, GROUP, FACTORED, T, C>;
    };
};

template <bool VNNI, int KIND, int GROUP>
struct Avx512Fn {
    template <int T, int C>
    struct of {
        static constexpr TileFn fn =
            VNNI ? avx512_vnni::tile<KIND, GROUP, T, C> : avx512::tile<KIND, GROUP, T, C>;
    };
};

// Tiles of 4 rows x 2 outputs (AVX2: 8 accumulators of the 16 ymm) or 4 x 4 (AVX-512: 16 of the 32 zmm);
// below 4 rows, 4 outputs on AVX2 too, so a decode step streams 4 weight rows at once.
constexpr int AVX2_NT = 4, AVX2_NN = 2, AVX2_FEW_NN = 4, AVX512_NT = 4, AVX512_NN = 4;

template <int KIND, int GROUP, bool FACTORED>
void run_avx2(const Activations& a, int64_t m, int64_t k, const Part& p, float* out, int64_t ldo) {
    static const Table<AVX2_NT, AVX2_FEW_NN, Avx2Fn<KIND, GROUP, FACTORED>::template of> table;
    run_part<AVX2_NT>(a, m, k, p, out, ldo, m < AVX2_NT ? AVX2_FEW_NN : AVX2_NN,
                      [](int nt, int nn) { return table.fns[nt - 1][nn - 1]; });
}

template <bool VNNI, int KIND, int GROUP>
void run_avx512(const Activations& a, int64_t m, int64_t k, const Part& p, float* out, int64_t ldo) {
    static const Table<AVX512_NT, AVX512_NN, Avx512Fn<VNNI, KIND, GROUP>::template of> table;
    run_part<AVX512_NT>(a, m, k, p, out, ldo, AVX512_NN,
                        [](int nt, int nn) { return table.fns[nt - 1][nn - 1]; });
}

template <int KIND, int GROUP, bool FACTORED = false>
void run_kind(int isa, const Activations& a, int64_t m, int64_t k, const Part& p, float* out, int64_t ldo) {
    if (isa == cpu_isa::AVX512_VNNI)
        run_avx512<true, KIND, GROUP>(a, m, k, p, out, ldo);
    else if (isa == cpu_isa::AVX512)
        run_avx512<false, KIND, GROUP>(a, m, k, p, out, ldo);
    else
        run_avx2<KIND, GROUP, FACTORED>(a, m, k, p, out, ldo);
}

void run_vector(int isa, const Activations& a, int64_t m, int64_t k, const Part& p, float* out, int64_t ldo) {
    switch (p.kind * 100 + p.group) {
        case INT8 * 100 + 32: return run_kind<INT8, 32>(isa, a, m, k, p, out, ldo);
        case INT8 * 100 + 16: return run_kind<INT8, 16>(isa, a, m, k, p, out, ldo);
        case INT6 * 100 + 16:
            if (p.scale_sub) return run_kind<INT6, 16, true>(isa, a, m, k, p, out, ldo);
            return run_kind<INT6, 16>(isa, a, m, k, p, out, ldo);
        case UINT4 * 100 + 32:
            if (p.scale_sub) return run_kind<UINT4, 32, true>(isa, a, m, k, p, out, ldo);
            return run_kind<UINT4, 32>(isa, a, m, k, p, out, ldo);
        default:
            if (p.scale_sub) return run_kind<UINT5, 32, true>(isa, a, m, k, p, out, ldo);
            return run_kind<UINT5, 32>(isa, a, m, k, p, out, ldo);
    }
}

bool valid(const Part& p) {
    const bool grouped = (p.kind == INT8 && (p.group == 16 || p.group == 32)) ||
                         (p.kind == INT6 && p.group == 16) ||
                         ((p.kind == UINT4 || p.kind == UINT5) && p.group == 32);
    const bool arrays = p.values && p.scale && (p.kind == INT6 || p.kind == UINT5) == (p.high != nullptr) &&
                        (p.kind != INT8 || !p.scale_sub) && (p.kind == INT8 || !p.half_scale) &&
                        (p.kind >= UINT4) == (p.minimum != nullptr) && (!p.minimum_sub || p.minimum);
    return grouped && arrays && p.rows >= 0;
}

}  // namespace

extern "C" {

// The widest ISA this CPU runs (cpu_isa.h's codes).
__attribute__((visibility("default"))) int quant_linear_best_isa() { return cpu_isa::best(); }

// out[m, sum of rows] = x[m, k] @ w.T, w the `count` parts stacked on their rows; x, out C-contiguous, k a
// multiple of 32. isa: AUTO or one to force (tests); threads: how many to run (>= 1). Returns the ISA run; -1 where the CPU lacks it, -2 for
// a bad argument, -3 where no memory for the quantized activations.
__attribute__((visibility("default"))) int quant_linear(const float* x, int64_t m, int64_t k,
                                                        const Part* parts, int64_t count, float* out,
                                                        int isa, int threads) {
    if (isa == cpu_isa::AUTO) isa = cpu_isa::best();
    if (!cpu_isa::supported(isa)) return -1;
    if (k <= 0 || k % BLOCK || m < 0 || threads < 1) return -2;
    int64_t n = 0;
    for (int64_t i = 0; i < count; ++i) {
        if (!valid(parts[i]) || ((parts[i].scale_sub || parts[i].minimum_sub) && k % SUPER)) return -2;
        n += parts[i].rows;
    }
    if (m == 0) return isa;
    thread_local Activations mine;
    if (!mine.reserve(m, k)) return -3;
    Activations& a = mine;  // the caller's buffer: inside the region `mine` would name each thread's own
    const int64_t nb = k / BLOCK;
    // Each thread quantizes some rows, then (after the barrier) computes a share of every part's outputs.
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; ++t) {
            for (int64_t b = 0; b < nb; ++b) {
                const float* src = x + t * k + b * BLOCK;
                int8_t* q = a.q + t * k + b * BLOCK;
                if (isa == cpu_isa::SCALAR)
                    quantize_block_scalar(src, q, a.s + t * nb + b, a.sum + t * nb + b);
                else
                    avx2::quantize_block(src, q, a.s + t * nb + b, a.sum + t * nb + b);
            }
            if (isa == cpu_isa::AVX2) a.pair_row(t, k);  // the AVX2 4-, 5- and 6-bit tiles' order
        }
        int64_t column = 0;
        for (int64_t i = 0; i < count; ++i) {
            if (isa == cpu_isa::SCALAR)
                scalar_part(a, m, k, parts[i], out + column, n);
            else
                run_vector(isa, a, m, k, parts[i], out + column, n);
            column += parts[i].rows;
        }
    }
    return isa;
}

}  // extern "C"
