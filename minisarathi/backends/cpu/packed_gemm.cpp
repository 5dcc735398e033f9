// out = x @ w.T in float32 with the weight w packed once, at load, into the layout this kernel streams.
//
// Why: OpenBLAS copies ("packs") the weight into its panel layout inside every sgemm call; at the decode
// batch's row counts that copy is most of the call. So the weight is packed once at load, as vLLM-CPU's
// oneDNN brgemm does, and the panels are streamed from memory with prefetch ahead.
//
// Layout (minisarathi/backends/cpu/packed_gemm.py packs it): w[N, K] becomes ceil(N / NR) panels of NR
// consecutive output features, each float32[K][NR], the last one padded with zeros. NR is the path's (an
// AVX-512 and an AVX2 + FMA path, chosen at run time): a register tile of up to MR rows x NR outputs keeps
// its accumulators in registers (24 of the 32 zmm, 12 of the 16 ymm); each k step loads one panel row and
// broadcasts one input per row (the inputs are first copied to [k][MR] order, so the broadcasts read one
// stream instead of MR rows a large power of two apart that evict each other from L1). Loop order and cache
// blocking as BLIS's (K blocks, groups of panels in L2, a row tile's inputs in L1).
//
// Determinism: every output element is one chain of fused multiply-adds over k = 0 .. K-1, in that order,
// from 0, whatever the number of rows, the row's place in its tile, the tile's shape, or the K blocking (a
// later K block resumes the chain from the value stored in `out`). So a row's result is bit-identical
// whatever batch it is in, and the two paths give the same bits. Built without -ffast-math: the compiler must
// not reorder the chain.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

namespace {

enum Isa { NONE = 0, AVX2 = 2, AVX512 = 3 };   // packed_gemm.py's ISAS

constexpr int64_t KC = 512;   // k per block: an input tile (KC x MR x 4 B) stays in L1

// out[ROWS, :cols] (row stride ldo) = (first ? 0 : out) + a @ panel over kc steps;
// a: float32[kc][MR] inputs; panel: float32[kc][NR]; next: the same block of the next panel, prefetched to L2
// while this one computes (nullptr: none), so the weight stream from memory never waits on a miss.
// panel_stride: floats from a panel to the next (the AVX2 tiles of few rows read several).
using Tile = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t, int, bool, const float*);

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {

constexpr int NR = 32;   // two zmm registers
constexpr int MR = 12;   // 24 accumulators + 2 weight vectors of the 32 zmm
constexpr int64_t GROUP_BYTES = 384 << 10;   // panels' K blocks computed together: they stay in L2

template <int ROWS>
void tile(const float* a, const float* panel, int64_t /* one panel */, int64_t kc, float* out, int64_t ldo,
          int cols, bool first, const float* next) {
    __m512 acc[ROWS][2];
    const __mmask16 lo = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    for (int r = 0; r < ROWS; ++r) {
        acc[r][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(lo, out + r * ldo);
        acc[r][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(hi, out + r * ldo + 16);
    }
    for (int64_t k = 0; k < kc; ++k) {
        if (next) {
            _mm_prefetch((const char*)(next + k * NR), _MM_HINT_T1);
            _mm_prefetch((const char*)(next + k * NR + 16), _MM_HINT_T1);
        }
        const __m512 w0 = _mm512_loadu_ps(panel + k * NR);
        const __m512 w1 = _mm512_loadu_ps(panel + k * NR + 16);
        for (int r = 0; r < ROWS; ++r) {
            const __m512 xr = _mm512_set1_ps(a[k * MR + r]);
            acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < ROWS; ++r) {
        _mm512_mask_storeu_ps(out + r * ldo, lo, acc[r][0]);
        _mm512_mask_storeu_ps(out + r * ldo + 16, hi, acc[r][1]);
    }
}

constexpr Tile tiles[MR + 1] = {nullptr,  &tile<1>, &tile<2>, &tile<3>, &tile<4>,  &tile<5>,  &tile<6>,
                                &tile<7>, &tile<8>, &tile<9>, &tile<10>, &tile<11>, &tile<12>};

}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {

constexpr int NR = 16;   // two ymm registers
constexpr int MR = 6;    // 12 accumulators + 2 weight vectors + a broadcast of the 16 ymm
constexpr int64_t GROUP_BYTES = 256 << 10;   // the L2s of AVX2 machines are smaller

// The first `count` of 8 lanes (the last panel has fewer than NR outputs); made where it is used: masks held
// through the k loop would take registers the accumulators need.
inline __m256i lanes(int count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// As avx512::tile, over P panels side by side (panel_stride floats apart; all of NR outputs where P > 1):
// a tile of few rows has only 2 * ROWS chains of multiply-adds, too few to hide their latency, so it takes
// more panels. The unroll pragmas keep the accumulators in registers (GCC leaves the arrays in memory else).
template <int ROWS, int P>
void tile(const float* a, const float* panel, int64_t panel_stride, int64_t kc, float* out, int64_t ldo,
          int cols, bool first, const float* next) {
    __m256 acc[ROWS][P][2];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < P; ++j)
#pragma GCC unroll 2
            for (int v = 0; v < 2; ++v)
                acc[r][j][v] = first ? _mm256_setzero_ps()
                               : _mm256_maskload_ps(out + r * ldo + j * NR + 8 * v, lanes(cols - 8 * v));
    for (int64_t k = 0; k < kc; ++k) {
        if (next)
#pragma GCC unroll 4
            for (int j = 0; j < P; ++j)
                _mm_prefetch((const char*)(next + j * panel_stride + k * NR), _MM_HINT_T1);
#pragma GCC unroll 4
        for (int j = 0; j < P; ++j) {
            const __m256 w0 = _mm256_loadu_ps(panel + j * panel_stride + k * NR);
            const __m256 w1 = _mm256_loadu_ps(panel + j * panel_stride + k * NR + 8);
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; ++r) {
                const __m256 xr = _mm256_broadcast_ss(a + k * MR + r);
                acc[r][j][0] = _mm256_fmadd_ps(xr, w0, acc[r][j][0]);
                acc[r][j][1] = _mm256_fmadd_ps(xr, w1, acc[r][j][1]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < P; ++j)
#pragma GCC unroll 2
            for (int v = 0; v < 2; ++v)
                if (cols == NR) _mm256_storeu_ps(out + r * ldo + j * NR + 8 * v, acc[r][j][v]);
                else
                    _mm256_maskstore_ps(out + r * ldo + j * NR + 8 * v, lanes(cols - 8 * v), acc[r][j][v]);
}

constexpr Tile tiles[MR + 1] = {nullptr, &tile<1, 1>, &tile<2, 1>, &tile<3, 1>, &tile<4, 1>, &tile<5, 1>,
                                &tile<6, 1>};
// By rows: how many full panels a tile of that many rows takes at once (8 or more chains), and its tile.
constexpr int WIDE[MR + 1] = {0, 4, 2, 1, 1, 1, 1};
constexpr Tile wide[MR + 1] = {nullptr, &tile<1, 4>, &tile<2, 2>, nullptr, nullptr, nullptr, nullptr};

}  // namespace avx2
#pragma GCC pop_options

// The inputs of one K block in tile order, float32[ceil(M / MR)][kc][MR]; one buffer per thread, grown as
// needed and freed when the thread ends.
struct InputTiles {
    float* data = nullptr;
    int64_t capacity = 0;
    ~InputTiles() { free(data); }
};

float* input_tiles(int64_t floats) {
    thread_local InputTiles tiles;
    if (floats > tiles.capacity) {
        free(tiles.data);
        tiles.data = (float*)aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        tiles.capacity = tiles.data ? floats : 0;
    }
    return tiles.data;
}

// The loops around a path's register tiles: tiles[rows] (1 .. MR rows, one panel); wide[rows], where not
// null, over WIDE[rows] full panels at once.
template <int NR, int MR, int64_t GROUP_BYTES>
int gemm(const Tile* tiles, const int* WIDE, const Tile* wide, const float* x, int64_t m, int64_t k,
         int64_t ldx, const float* packed, int64_t n, float* out, int64_t ldo) {
    if (m == 0 || n == 0) return 0;   // nothing to compute; input_tiles(0) would be a thread's null buffer
    const int64_t panels = (n + NR - 1) / NR, full = n / NR;
    const int64_t row_tiles = (m + MR - 1) / MR;
    float* a = input_tiles(row_tiles * MR * (k < KC ? k : KC));
    if (!a) return -1;
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t kc = k - k0 < KC ? k - k0 : KC;
        for (int64_t r = 0; r < m; ++r)
            for (int64_t i = 0; i < kc; ++i)
                a[(r / MR) * kc * MR + i * MR + r % MR] = x[r * ldx + k0 + i];
        // Groups of panels that stay in L2 (GROUP_BYTES); per group, every row tile (its inputs stay in L1)
        // runs every panel. A panel is read from memory once, by the first row tile, which also prefetches
        // the next panel into L2 while it computes; the other row tiles read the group from L2.
        const int64_t group = GROUP_BYTES / (kc * NR * 4) > 1 ? GROUP_BYTES / (kc * NR * 4) : 1;
        for (int64_t p0 = 0; p0 < panels; p0 += group) {
            const int64_t p1 = p0 + group < panels ? p0 + group : panels;
            for (int64_t t = 0; t < row_tiles; ++t) {
                const int rows = m - t * MR < MR ? (int)(m - t * MR) : MR;
                for (int64_t p = p0; p < p1;) {
                    const bool many = wide && wide[rows] && p + WIDE[rows] <= (p1 < full ? p1 : full);
                    const int step = many ? WIDE[rows] : 1;
                    const float* panel = packed + (p * k + k0) * NR;
                    const int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;
                    const float* next = t == 0 && p + step < panels ? panel + step * k * NR : nullptr;
                    float* o = out + t * MR * ldo + p * NR;
                    const Tile run = (many ? wide : tiles)[rows];
                    run(a + t * kc * MR, panel, k * NR, kc, o, ldo, cols, k0 == 0, next);
                    p += step;
                }
            }
        }
    }
    return 0;
}

bool supported(int isa) {
    __builtin_cpu_init();
    if (isa == AVX512) return __builtin_cpu_supports("avx512f");
    if (isa == AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return false;
}

}  // namespace

extern "C" {

// The widest path this CPU runs: AVX512, AVX2, or NONE.
__attribute__((visibility("default"))) int packed_gemm_best_isa() {
    return supported(AVX512) ? AVX512 : supported(AVX2) ? AVX2 : NONE;
}

// NR of a path: the panel width its packed weights must have.
__attribute__((visibility("default"))) int packed_gemm_panel_width(int isa) {
    return isa == AVX512 ? avx512::NR : isa == AVX2 ? avx2::NR : 0;
}

// out[M, N] (row stride ldo) = x[M, K] (row stride ldx) @ w[N, K].T on path isa; packed: w as
// float32[ceil(N / NR)][K][NR] with that path's NR; threads (>= 1) split the panels, each thread packing its
// own input tiles, so every output's chain (and result) is the same whatever the count. Returns 0; -1 when
// the input tiles could not be allocated; -2 when this CPU cannot run the path or threads < 1.
__attribute__((visibility("default"))) int packed_gemm(int isa, const float* x, int64_t m, int64_t k,
                                                      int64_t ldx, const float* packed, int64_t n, float* out,
                                                      int64_t ldo, int threads) {
    if (!supported(isa) || threads < 1) return -2;
    const int64_t nr = isa == AVX512 ? avx512::NR : avx2::NR, panels = (n + nr - 1) / nr;
    int status = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(min : status)
    for (int t = 0; t < threads; ++t) {
        const int64_t p0 = panels * t / threads, p1 = panels * (t + 1) / threads;
        const int64_t cols = (p1 * nr < n ? p1 * nr : n) - p0 * nr;
        if (cols <= 0) continue;
        const float* w = packed + p0 * k * nr;
        float* o = out + p0 * nr;
        status = isa == AVX512 ? gemm<avx512::NR, avx512::MR, avx512::GROUP_BYTES>(
                                     avx512::tiles, nullptr, nullptr, x, m, k, ldx, w, cols, o, ldo)
                               : gemm<avx2::NR, avx2::MR, avx2::GROUP_BYTES>(avx2::tiles, avx2::WIDE,
                                                                            avx2::wide, x, m, k, ldx, w,
                                                                            cols, o, ldo);
    }
    return status;
}

}  // extern "C"
