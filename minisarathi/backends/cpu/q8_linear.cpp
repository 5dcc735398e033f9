// out = x @ w.T in float32 for a Q8_0 weight kept as int8 values and a float32 scale per group of 32.
//
// Why: decode reads every weight once per step, and int8 values are a quarter of float32's bytes. Each
// weight is widened in registers and multiplied by its group's scale (exact: an fp16 scale times an int8 has
// at most 19 significant bits), then fused into the dot product, so the result is float32 arithmetic on the
// exact dequantized weights. Widening and scaling take 2 of every 3 vector operations at one row, so the
// kernel is bound by them, not by memory (docs/quantization.md has the figures).
//
// A register tile of NT input rows x NN weight rows keeps one accumulator vector per output; the NN weight
// rows (NN x K bytes) stay in L1 while every input row passes over them, so a batch reads the weights once.
// Determinism: every output is one accumulator fed in k order from 0 and reduced the same way, whatever
// the tile it falls in, so a row's result is bit-identical whatever batch it is in (for one ISA).
// Built without -ffast-math so the compiler keeps that order. One thread, like packed_gemm.cpp.
// GCC 12 warns of its own intrinsics' deliberately undefined operands when they are inlined into a
// function with a target attribute; the warnings are false.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <stdint.h>

namespace {

constexpr int GROUP = 32;  // weights per scale (Q8_0's block)

template <int NT, int NN, typename Tile>
void run_tiles(const float* x, int64_t m, int64_t k, const int8_t* w, const float* scale, int64_t n,
               float* out, Tile tile) {
    for (int64_t j = 0; j < n; j += NN) {
        const int nn = n - j < NN ? (int)(n - j) : NN;
        for (int64_t i = 0; i < m; i += NT) {
            const int nt = m - i < NT ? (int)(m - i) : NT;
            tile(x + i * k, nt, k, w + j * k, scale + j * (k / GROUP), nn, out + i * n + j, n);
        }
    }
}

// The scalar path: the same per-output chain, one lane.
void scalar_tile(const float* x, int nt, int64_t k, const int8_t* w, const float* scale, int nn, float* out,
                 int64_t ldo) {
    for (int t = 0; t < nt; ++t)
        for (int c = 0; c < nn; ++c) {
            float acc = 0.0f;
            for (int64_t g = 0; g < k / GROUP; ++g) {
                const float s = scale[c * (k / GROUP) + g];
                for (int e = 0; e < GROUP; ++e) {
                    const int64_t p = g * GROUP + e;
                    acc += x[t * k + p] * (s * (float)w[c * k + p]);
                }
            }
            out[t * ldo + c] = acc;
        }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// 4 rows x 2 weights: 8 accumulators, 2 weight vectors and an input of the 16 ymm registers.
template <int NT, int NN>
void avx2_tile_fixed(const float* x, int64_t k, const int8_t* w, const float* scale, float* out, int64_t ldo) {
    __m256 acc[NT][NN];
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < NN; ++c) acc[t][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < k / GROUP; ++g) {
        __m256 s[NN];
        for (int c = 0; c < NN; ++c) s[c] = _mm256_set1_ps(scale[c * (k / GROUP) + g]);
        for (int v = 0; v < GROUP / 8; ++v) {
            const int64_t p = g * GROUP + v * 8;
            __m256 wv[NN];
            for (int c = 0; c < NN; ++c) {
                const __m128i b = _mm_loadl_epi64((const __m128i*)(w + c * k + p));
                wv[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s[c]);
            }
            for (int t = 0; t < NT; ++t) {
                const __m256 xv = _mm256_loadu_ps(x + t * k + p);
                for (int c = 0; c < NN; ++c) acc[t][c] = _mm256_fmadd_ps(xv, wv[c], acc[t][c]);
            }
        }
    }
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < NN; ++c) out[t * ldo + c] = hsum8(acc[t][c]);
}

template <int NT>
void avx2_rows(const float* x, int64_t k, const int8_t* w, const float* scale, int nn, float* out, int64_t ldo) {
    if (nn == 2)
        avx2_tile_fixed<NT, 2>(x, k, w, scale, out, ldo);
    else
        avx2_tile_fixed<NT, 1>(x, k, w, scale, out, ldo);
}

void avx2_tile(const float* x, int nt, int64_t k, const int8_t* w, const float* scale, int nn, float* out,
               int64_t ldo) {
    switch (nt) {
        case 4: return avx2_rows<4>(x, k, w, scale, nn, out, ldo);
        case 3: return avx2_rows<3>(x, k, w, scale, nn, out, ldo);
        case 2: return avx2_rows<2>(x, k, w, scale, nn, out, ldo);
        default: return avx2_rows<1>(x, k, w, scale, nn, out, ldo);
    }
}

void avx2_linear(const float* x, int64_t m, int64_t k, const int8_t* w, const float* scale, int64_t n,
                 float* out) {
    run_tiles<4, 2>(x, m, k, w, scale, n, out, avx2_tile);
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")

// 4 rows x 4 weights: 16 accumulators, 4 weight vectors and an input of the 32 zmm registers (8 rows x 3
// weights measured slower at 1 and 16 rows).
template <int NT, int NN>
void avx512_tile_fixed(const float* x, int64_t k, const int8_t* w, const float* scale, float* out,
                       int64_t ldo) {
    __m512 acc[NT][NN];
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < NN; ++c) acc[t][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / GROUP; ++g) {
        __m512 s[NN];
        for (int c = 0; c < NN; ++c) s[c] = _mm512_set1_ps(scale[c * (k / GROUP) + g]);
        for (int v = 0; v < GROUP / 16; ++v) {
            const int64_t p = g * GROUP + v * 16;
            __m512 wv[NN];
            for (int c = 0; c < NN; ++c) {
                const __m128i b = _mm_loadu_si128((const __m128i*)(w + c * k + p));
                wv[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s[c]);
            }
            for (int t = 0; t < NT; ++t) {
                const __m512 xv = _mm512_loadu_ps(x + t * k + p);
                for (int c = 0; c < NN; ++c) acc[t][c] = _mm512_fmadd_ps(xv, wv[c], acc[t][c]);
            }
        }
    }
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < NN; ++c) out[t * ldo + c] = _mm512_reduce_add_ps(acc[t][c]);
}

template <int NT>
void avx512_rows(const float* x, int64_t k, const int8_t* w, const float* scale, int nn, float* out,
                 int64_t ldo) {
    switch (nn) {
        case 4: return avx512_tile_fixed<NT, 4>(x, k, w, scale, out, ldo);
        case 3: return avx512_tile_fixed<NT, 3>(x, k, w, scale, out, ldo);
        case 2: return avx512_tile_fixed<NT, 2>(x, k, w, scale, out, ldo);
        default: return avx512_tile_fixed<NT, 1>(x, k, w, scale, out, ldo);
    }
}

void avx512_tile(const float* x, int nt, int64_t k, const int8_t* w, const float* scale, int nn, float* out,
                 int64_t ldo) {
    switch (nt) {
        case 4: return avx512_rows<4>(x, k, w, scale, nn, out, ldo);
        case 3: return avx512_rows<3>(x, k, w, scale, nn, out, ldo);
        case 2: return avx512_rows<2>(x, k, w, scale, nn, out, ldo);
        default: return avx512_rows<1>(x, k, w, scale, nn, out, ldo);
    }
}

void avx512_linear(const float* x, int64_t m, int64_t k, const int8_t* w, const float* scale, int64_t n,
                   float* out) {
    run_tiles<4, 4>(x, m, k, w, scale, n, out, avx512_tile);
}

#pragma GCC pop_options

enum Isa { AUTO = 0, SCALAR = 1, AVX2 = 2, AVX512 = 3 };

bool supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
        case SCALAR: return true;
        case AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        case AVX512: return __builtin_cpu_supports("avx512f");
        default: return false;
    }
}

}  // namespace

extern "C" {

// The widest ISA this CPU runs: 3 AVX-512, 2 AVX2 + FMA, 1 scalar.
__attribute__((visibility("default"))) int q8_linear_best_isa() {
    return supported(AVX512) ? AVX512 : supported(AVX2) ? AVX2 : SCALAR;
}

// out[m, n] = x[m, k] @ (scale * w)[n, k].T; x, w, scale, out C-contiguous, k a multiple of 32.
// isa: AUTO or one to force (tests); returns the ISA run, or -1 where the CPU lacks it.
__attribute__((visibility("default"))) int q8_linear(const float* x, int64_t m, int64_t k, const int8_t* w,
                                                     const float* scale, int64_t n, float* out, int isa) {
    if (isa == AUTO) isa = q8_linear_best_isa();
    if (!supported(isa) || k % GROUP) return -1;
    if (isa == AVX512)
        avx512_linear(x, m, k, w, scale, n, out);
    else if (isa == AVX2)
        avx2_linear(x, m, k, w, scale, n, out);
    else
        run_tiles<1, 1>(x, m, k, w, scale, n, out, scalar_tile);
    return isa;
}

}  // extern "C"
