// out = x @ w.T in float32 with the weight w packed once, at load, into the layout this kernel streams.
//
// Why: OpenBLAS copies ("packs") the weight into its panel layout inside every sgemm call; at the decode
// batch's row counts that copy is most of the call. So the weight is packed once at load, as vLLM-CPU's
// oneDNN brgemm does, and the panels are streamed from memory with prefetch ahead.
//
// Layout (minisarathi/backends/cpu/packed_gemm.py packs it): w[N, K] becomes ceil(N / NR) panels of NR
// consecutive output features, each float32[K][NR], the last one padded with zeros. A register tile of up
// to MR rows x NR outputs keeps 2 * MR accumulators in zmm registers; each k step loads one panel row (2
// vectors) and broadcasts one input per row (the inputs are first copied to [k][MR] order, so the broadcasts
// read one stream instead of MR rows a large power of two apart that evict each other from L1). Loop order
// and cache blocking as BLIS's (K blocks, groups of panels in L2, a row tile's inputs in L1).
//
// Determinism: every output element is one chain of fused multiply-adds over k = 0 .. K-1, in that order,
// from 0, whatever the number of rows, the row's place in its tile, or the K blocking (a later K block resumes
// the chain from the value stored in `out`). So a row's result is bit-identical whatever batch it is in.
// Built without -ffast-math: the compiler must not reorder the chain.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

namespace {

constexpr int NR = 32;        // output features per panel: two zmm registers
constexpr int MR = 12;        // rows per register tile: 24 accumulators + 2 weight vectors of the 32 zmm
constexpr int64_t KC = 512;   // k per block: an input tile (KC x MR x 4 B = 24 KiB) stays in L1
constexpr int64_t GROUP_BYTES = 384 << 10;   // panels' K blocks computed together: they stay in the 1 MiB L2

// out[ROWS, :cols] (row stride ldo) = (first ? 0 : out) + a @ panel over kc steps;
// a: float32[kc][MR] inputs; panel: float32[kc][NR]; next: the same block of the next panel, prefetched to L2
// while this one computes (nullptr: none), so the weight stream from memory never waits on a miss.
template <int ROWS>
void tile(const float* a, const float* panel, int64_t kc, float* out, int64_t ldo, int cols, bool first,
          const float* next) {
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

using Tile = void (*)(const float*, const float*, int64_t, float*, int64_t, int, bool, const float*);
constexpr Tile tile_of_rows[MR + 1] = {nullptr,  &tile<1>, &tile<2>, &tile<3>, &tile<4>,  &tile<5>,  &tile<6>,
                                       &tile<7>, &tile<8>, &tile<9>, &tile<10>, &tile<11>, &tile<12>};

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

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int packed_gemm_panel_width() { return NR; }

// out[M, N] (row stride ldo) = x[M, K] (row stride ldx) @ w[N, K].T; packed: w as float32[ceil(N / NR)][K][NR].
// Returns 0, or -1 when the input tiles could not be allocated.
__attribute__((visibility("default"))) int packed_gemm(const float* x, int64_t m, int64_t k, int64_t ldx,
                                                      const float* packed, int64_t n, float* out, int64_t ldo) {
    if (m == 0 || n == 0) return 0;   // nothing to compute; input_tiles(0) would be a thread's null buffer
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t row_tiles = (m + MR - 1) / MR;
    float* a = input_tiles(row_tiles * MR * (k < KC ? k : KC));
    if (!a) return -1;
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t kc = k - k0 < KC ? k - k0 : KC;
        for (int64_t r = 0; r < m; ++r)
            for (int64_t i = 0; i < kc; ++i) a[(r / MR) * kc * MR + i * MR + r % MR] = x[r * ldx + k0 + i];
        // Groups of panels that stay in L2 (GROUP_BYTES); per group, every row tile (its inputs stay in L1)
        // runs every panel. A panel is read from memory once, by the first row tile, which also prefetches the
        // next panel into L2 while it computes; the other row tiles read the group from L2.
        const int64_t group = GROUP_BYTES / (kc * NR * 4) > 1 ? GROUP_BYTES / (kc * NR * 4) : 1;
        for (int64_t p0 = 0; p0 < panels; p0 += group) {
            const int64_t p1 = p0 + group < panels ? p0 + group : panels;
            for (int64_t t = 0; t < row_tiles; ++t) {
                const int rows = m - t * MR < MR ? (int)(m - t * MR) : MR;
                for (int64_t p = p0; p < p1; ++p) {
                    const float* panel = packed + (p * k + k0) * NR;
                    const int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;
                    const float* next = t == 0 && p + 1 < panels ? panel + k * NR : nullptr;
                    tile_of_rows[rows](a + t * kc * MR, panel, kc, out + t * MR * ldo + p * NR, ldo, cols, k0 == 0,
                                       next);
                }
            }
        }
    }
    return 0;
}

}  // extern "C"
