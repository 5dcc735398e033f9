// out = x @ w.T in float32 for a weight kept in 16 bits (bfloat16 bits or IEEE fp16), widened in registers.
//
// Why: decode reads every weight once per step, so halving the bytes of each weight halves the step's
// memory traffic. bf16 widens by a 16-bit shift, fp16 by F16C's vcvtph2ps; both are exact, so the result is
// float32 arithmetic on the checkpoint's own values.
//
// Layout: panels of 16 outputs, uint16[P][K][16] (half_linear.py packs them): lane j of panel p is output
// 16p + j, zeros past N. A register tile of MR input rows x NP panels broadcasts one input x[r][k] against
// the 16 widened weights of each panel, so a panel's widening is shared by the tile's rows.
//
// Determinism: every output is one float32 accumulator, started at 0 and fed fma(x[k], w[k], acc) for
// k = 0, 1, ..., K-1, whatever its tile, its panel group, its K block (the accumulator goes through `out`
// between blocks: an exact float32 store and load) or the ISA path. So a row's result is bit-identical
// whatever batch it is in, and the scalar, AVX2 and AVX-512 paths agree bit for bit; the blocking below
// changes only the order of memory accesses. Built without -ffast-math and with -ffp-contract=off so the
// compiler keeps that chain. Threads (OpenMP) split the panel groups, so the result is also the same
// whatever the thread count.
#include "cpu_isa.h"  // its warnings' pragmas, half_to_float

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

namespace {

constexpr int LANES = 16;    // outputs per panel
constexpr int64_t KC = 256;  // k per block where several row tiles share a panel: panel and inputs in L1
constexpr int64_t GROUP_BYTES = 256 << 10;  // a group of panels' K block stays in L2 for every row tile

enum Format { BF16 = 0, F16 = 1 };

// One call's operands: x[m][k], the panels, out[m][n].
struct Operands {
    const float* x;
    int64_t k;
    const uint16_t* w;
    int64_t n;
    float* out;
};

// The loop nest the vector paths share: K blocks, groups of panels, row tiles of at most max_rows, panels.
// tile(a, i, rows, p, p_end, k0, kc) runs rows [i, i + rows) against panels [p, p_end) over k0 .. k0 + kc.
template <typename Tile>
void run_blocks(const Operands& a, int64_t m, int max_rows, Tile tile) {
    const int64_t panels = (a.n + LANES - 1) / LANES;
    // One row tile: each panel is read once, so K is one block (longer streams for the prefetchers).
    const int64_t kc_max = m <= max_rows ? a.k : KC;
    const int64_t block_bytes = kc_max * LANES * 2;
    const int64_t group = block_bytes >= GROUP_BYTES ? 1 : GROUP_BYTES / block_bytes;
    for (int64_t k0 = 0; k0 < a.k; k0 += kc_max) {
        const int64_t kc = a.k - k0 < kc_max ? a.k - k0 : kc_max;
        // The barrier at its end keeps each output's K blocks in order (they meet in `out`).
#pragma omp for schedule(static)
        for (int64_t g = 0; g < panels; g += group) {
            const int64_t g_end = g + group < panels ? g + group : panels;
            for (int64_t i = 0; i < m; i += max_rows)
                tile(a, i, m - i < max_rows ? (int)(m - i) : max_rows, g, g_end, k0, kc);
        }
    }
}

inline float widen_scalar(uint16_t v, int format) {
    if (format == F16) return cpu_isa::half_to_float(v);
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// The scalar path: the same per-output chain, one output at a time.
void scalar_linear(const Operands& a, int64_t m, int format) {
#pragma omp for schedule(static)
    for (int64_t c = 0; c < a.n; ++c)
        for (int64_t i = 0; i < m; ++i) {
            const uint16_t* w = a.w + (c / LANES) * a.k * LANES + c % LANES;
            const float* x = a.x + i * a.k;
            float acc = 0.0f;
            for (int64_t q = 0; q < a.k; ++q) acc = fmaf(x[q], widen_scalar(w[q * LANES], format), acc);
            a.out[i * a.n + c] = acc;
        }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

template <int F>
inline __m256 widen8(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128((const __m128i*)p);
    if (F == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

inline __m256i lanes_below(int64_t n_left) {  // the lanes j < n_left
    const int left = n_left > 8 ? 8 : (int)n_left;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// MR rows x NP panels from row i, panel p: 2 * MR * NP accumulators (at most 12), 2 weight vectors per
// panel and a broadcast input. The lane masks are made where they are used (no register holds them across
// the loop), and the k loop is a do-while: with a zero-trip path GCC 12 stores every accumulator to the
// stack at every step.
template <int F, int MR, int NP>
void avx2_tile(const Operands& a, int64_t i, int64_t p, int64_t k0, int64_t kc, bool first) {
    constexpr int V = 2 * NP;  // vectors per row
    const int64_t k = a.k, n_left = a.n - p * LANES;
    const float* x = a.x + i * k + k0;
    const uint16_t* w = a.w + p * k * LANES + k0 * LANES;
    float* out = a.out + i * a.n + p * LANES;
    __m256 acc[MR][V];
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < V; ++v)
            acc[r][v] = first ? _mm256_setzero_ps()
                              : _mm256_maskload_ps(out + r * a.n + v * 8, lanes_below(n_left - v * 8));
    int64_t q = 0;
    do {
        __m256 wv[V];
        for (int v = 0; v < V; ++v) wv[v] = widen8<F>(w + (v / 2) * k * LANES + q * LANES + (v % 2) * 8);
        for (int r = 0; r < MR; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * k + q);
            for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
        }
    } while (++q < kc);
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < V; ++v)
            _mm256_maskstore_ps(out + r * a.n + v * 8, lanes_below(n_left - v * 8), acc[r][v]);
}

// Panels [p, p_end) for MR rows: NP at a time, then one at a time.
template <int F, int MR, int NP>
void avx2_panels(const Operands& a, int64_t i, int64_t p, int64_t p_end, int64_t k0, int64_t kc) {
    for (; p + NP <= p_end; p += NP) avx2_tile<F, MR, NP>(a, i, p, k0, kc, k0 == 0);
    for (; p < p_end; ++p) avx2_tile<F, MR, 1>(a, i, p, k0, kc, k0 == 0);
}

template <int F>
void avx2_linear(const Operands& a, int64_t m) {
    run_blocks(a, m, 6, [](const Operands& a, int64_t i, int rows, int64_t p, int64_t p_end, int64_t k0,
                           int64_t kc) {
        switch (rows) {
            case 6: return avx2_panels<F, 6, 1>(a, i, p, p_end, k0, kc);
            case 5: return avx2_panels<F, 5, 1>(a, i, p, p_end, k0, kc);
            case 4: return avx2_panels<F, 4, 1>(a, i, p, p_end, k0, kc);
            case 3: return avx2_panels<F, 3, 2>(a, i, p, p_end, k0, kc);
            case 2: return avx2_panels<F, 2, 3>(a, i, p, p_end, k0, kc);
            default: return avx2_panels<F, 1, 4>(a, i, p, p_end, k0, kc);
        }
    });
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")

template <int F>
inline __m512 widen16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)p);
    if (F == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

// MR rows x NP panels: MR * NP accumulators (at most 24 of the 32 zmm registers), one vector per panel.
template <int F, int MR, int NP>
void avx512_tile(const Operands& a, int64_t i, int64_t p, int64_t k0, int64_t kc, bool first) {
    const float* x = a.x + i * a.k + k0;
    const uint16_t* w = a.w + p * a.k * LANES + k0 * LANES;
    float* out = a.out + i * a.n + p * LANES;
    __m512 acc[MR][NP];
    __mmask16 mask[NP];
    for (int c = 0; c < NP; ++c) {
        const int64_t left = a.n - (p + c) * LANES;
        mask[c] = left >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NP; ++c)
            acc[r][c] = first ? _mm512_setzero_ps()
                              : _mm512_maskz_loadu_ps(mask[c], out + r * a.n + c * LANES);
    int64_t q = 0;
    do {  // a do-while, as in avx2_tile
        __m512 wv[NP];
        for (int c = 0; c < NP; ++c) wv[c] = widen16<F>(w + c * a.k * LANES + q * LANES);
        for (int r = 0; r < MR; ++r) {
            const __m512 xv = _mm512_set1_ps(x[r * a.k + q]);
            for (int c = 0; c < NP; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    } while (++q < kc);
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NP; ++c) _mm512_mask_storeu_ps(out + r * a.n + c * LANES, mask[c], acc[r][c]);
}

template <int F, int MR, int NP>
void avx512_panels(const Operands& a, int64_t i, int64_t p, int64_t p_end, int64_t k0, int64_t kc) {
    for (; p + NP <= p_end; p += NP) avx512_tile<F, MR, NP>(a, i, p, k0, kc, k0 == 0);
    for (; p < p_end; ++p) avx512_tile<F, MR, 1>(a, i, p, k0, kc, k0 == 0);
}

template <int F>
void avx512_linear(const Operands& a, int64_t m) {
    run_blocks(a, m, 12, [](const Operands& a, int64_t i, int rows, int64_t p, int64_t p_end, int64_t k0,
                            int64_t kc) {
        switch (rows) {
            case 12: return avx512_panels<F, 12, 2>(a, i, p, p_end, k0, kc);
            case 11: return avx512_panels<F, 11, 2>(a, i, p, p_end, k0, kc);
            case 10: return avx512_panels<F, 10, 2>(a, i, p, p_end, k0, kc);
            case 9: return avx512_panels<F, 9, 2>(a, i, p, p_end, k0, kc);
            case 8: return avx512_panels<F, 8, 3>(a, i, p, p_end, k0, kc);
            case 7: return avx512_panels<F, 7, 3>(a, i, p, p_end, k0, kc);
            case 6: return avx512_panels<F, 6, 4>(a, i, p, p_end, k0, kc);
            case 5: return avx512_panels<F, 5, 4>(a, i, p, p_end, k0, kc);
            case 4: return avx512_panels<F, 4, 6>(a, i, p, p_end, k0, kc);
            case 3: return avx512_panels<F, 3, 8>(a, i, p, p_end, k0, kc);
            case 2: return avx512_panels<F, 2, 8>(a, i, p, p_end, k0, kc);
            default: return avx512_panels<F, 1, 8>(a, i, p, p_end, k0, kc);
        }
    });
}

#pragma GCC pop_options

enum Isa { AUTO = 0, SCALAR = 1, AVX2 = 2, AVX512 = 3 };

bool supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
        case SCALAR: return true;
        case AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
        case AVX512: return __builtin_cpu_supports("avx512f");
        default: return false;
    }
}

}  // namespace

extern "C" {

// The widest ISA this CPU runs: 3 AVX-512, 2 AVX2 + FMA + F16C, 1 scalar.
__attribute__((visibility("default"))) int half_linear_best_isa() {
    return supported(AVX512) ? AVX512 : supported(AVX2) ? AVX2 : SCALAR;
}

// out[m, n] = x[m, k] @ w.T for w packed as uint16[ceil(n / 16)][k][16] in `format` (0 bf16, 1 fp16); x and
// out C-contiguous. isa: AUTO or one to force (tests); returns the ISA run, or -1 where the CPU lacks it or
// the format is unknown or threads < 1. threads: how many to run.
__attribute__((visibility("default"))) int half_linear(const float* x, int64_t m, int64_t k,
                                                       const uint16_t* w, int64_t n, float* out, int format,
                                                       int isa, int threads) {
    if (isa == AUTO) isa = half_linear_best_isa();
    if (!supported(isa) || (format != BF16 && format != F16) || threads < 1) return -1;
    const Operands a{x, k, w, n, out};
    if (k == 0) {
        for (int64_t i = 0; i < m * n; ++i) out[i] = 0.0f;
        return isa;
    }
#pragma omp parallel num_threads(threads)
    if (isa == AVX512)
        format == BF16 ? avx512_linear<BF16>(a, m) : avx512_linear<F16>(a, m);
    else if (isa == AVX2)
        format == BF16 ? avx2_linear<BF16>(a, m) : avx2_linear<F16>(a, m);
    else
        scalar_linear(a, m, format);
    return isa;
}

}  // extern "C"
