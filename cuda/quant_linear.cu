// Linear layers over quantized weights: out[M, N] = x[M, K] @ W^T (+ bias), x in T (fp16 / bf16), W[N, K]
// stored compactly and dequantized in registers into mma.sync m16n8k16 B fragments (fp32 accumulate), in
// the manner of Marlin. Three weight formats (QuantFormat), each a code per weight and fp16 scales:
//   QL_INT8   int8 values, w = scale * q                  (Q8_0, GPTQ-8, Q6_K as int8 groups of 16)
//   QL_UINT4  4-bit codes, w = scale * q - minimum        (AWQ, GPTQ-4, Q4_0, Q4_K: groups of 32)
//   QL_FP8    E4M3 bytes, w = scale * e4m3                (FP8 rows: the row scale repeated per 32)
// Scales and minimums are fp16 [Kp / group, Np] (one row of N per group: a tile's are contiguous).
//
// Packed weights (made on the host by cuda_ops._pack_codes): W padded with zeros to [Np, Kp] (multiples
// of 64), cut into units of 16 output features x 64 k, stored [Kp / 64][Np / 16][unit]. A unit holds, for
// lane l = 4g + t of a warp, the B fragments of its two n8 tiles (j) and four k16 steps (kk): weights
// W[n0 + 8j + g][k0 + 16kk + {2t, 2t+1, 2t+8, 2t+9}] (the fragment's b0 and b1 pairs, PTX ISA layout):
//   8-bit: byte j * 512 + 16 l + 4 kk + e (1024 bytes): a lane's 16 bytes are one tile's four k steps
//   4-bit: nibble 4j + e of 32-bit word kk at byte 16 l + 4 kk (512 bytes): a lane's 16 bytes are all
// So a CTA's weights for one k tile are 4 consecutive units (2 or 4 KiB, copied coalesced by cp.async),
// and each lane reads its fragments from shared memory as 16-byte words, without bank conflicts.
//
// Tiling: 128 threads, QL_BN = 64 output features x BM rows per CTA, k tiles of QL_BK = 64 streamed
// through STAGES shared-memory stages by cp.async (x tile, weight units, scales), one barrier per tile.
//   BM = 16 (decodes, M <= 16): warp w owns features 16w..16w+15 (one unit) for all 16 rows; 4 stages.
//   BM = 64 (prefill): warps 2 x 2, each 32 rows x 32 features (two units); 3 stages.
// x fragments come from shared memory by ldmatrix; the grid is (Np / 64, row tiles, k splits): a grid
// too small to fill the GPU splits K, each split writing fp32 partials that quant_linear_reduce_kernel
// sums (the decode path: a bandwidth-bound stream of the weights needs many CTAs in flight).
#include "common.cuh"

constexpr int QL_THREADS = 128;
constexpr int QL_BN = 64;                 // output features per CTA
constexpr int QL_BK = 64;                 // k per tile (and per packed unit)
constexpr int QL_PAD = 8;                 // elements of padding per x row in shared memory (16 bytes)
constexpr int QL_DECODE_ROWS = 16;        // BM of the decode path
constexpr int QL_PREFILL_ROWS = 64;       // BM of the tiled path
constexpr int QL_DECODE_STAGES = 4;
constexpr int QL_PREFILL_STAGES = 3;
constexpr int QL_MIN_GROUP = 16;          // groups of 16, 32 or 64 weights (a k16 step lies in one group)
constexpr int QL_SCALE_ROWS = QL_BK / QL_MIN_GROUP;   // scale rows a stage holds at most
constexpr int QL_INT8 = 0;
constexpr int QL_UINT4 = 1;
constexpr int QL_FP8 = 2;

template <int Q> __device__ __forceinline__ constexpr int ql_unit_bytes() {
    return Q == QL_UINT4 ? 512 : 1024;
}
template <int BM> __device__ __forceinline__ constexpr int ql_stages() {
    return BM == QL_DECODE_ROWS ? QL_DECODE_STAGES : QL_PREFILL_STAGES;
}

// Weight i (0..3: k offsets 2t, 2t+1, 2t+8, 2t+9) of n8 tile j from a lane's 32-bit word, as a float.
// Integer codes become floats by the exponent trick (2^23 + code has the code in its low mantissa bits),
// one logic op and one FADD; an E4M3 byte's bits shifted into an fp16 are its value / 256, exactly.
template <int Q>
__device__ __forceinline__ float ql_code(unsigned word, int j, int i) {
    if constexpr (Q == QL_UINT4) {
        return __uint_as_float(0x4B000000u | ((word >> (4 * (4 * j + i))) & 0xFu)) - 8388608.0f;
    } else if constexpr (Q == QL_INT8) {
        // offset by 128 to unsigned, then 2^23 + 128 taken off
        return __uint_as_float(0x4B000000u | (((word >> (8 * i)) & 0xFFu) ^ 0x80u)) - 8388736.0f;
    } else {
        static_assert(Q == QL_FP8, "the three weight formats");
        const unsigned byte = (word >> (8 * i)) & 0xFFu;
        const unsigned short bits = (unsigned short)(((byte & 0x7Fu) << 7) | ((byte & 0x80u) << 8));
        return __half2float(__ushort_as_half(bits)) * 256.0f;
    }
}

// The code of weight (n, k) in the packed layout (the embedding lookup: one weight at a time).
template <int Q>
__device__ __forceinline__ float ql_code_at(const unsigned char* packed, int n, int k, int Np) {
    const long long unit = (long long)(k / QL_BK) * (Np / 16) + n / 16;
    const int j = (n % 16) / 8, g = n % 8, kk = (k % QL_BK) / 16, r = k % 16;
    const int t = (r % 8) / 2, i = r % 2 + 2 * (r / 8);
    const unsigned char* u = packed + unit * ql_unit_bytes<Q>();
    if constexpr (Q == QL_UINT4) {
        const unsigned word = *reinterpret_cast<const unsigned*>(u + 16 * (4 * g + t) + 4 * kk);
        return ql_code<Q>(word, j, i);
    } else {
        return ql_code<Q>(u[j * 512 + 16 * (4 * g + t) + 4 * kk + i], 0, 0);
    }
}

template <typename T, int Q, int BM>
__global__ void __launch_bounds__(QL_THREADS) quant_linear_kernel(
    const T* __restrict__ x,                // [M, K]
    const unsigned char* __restrict__ packed,   // [Kp / 64][Np / 16] units (see the top of this file)
    const __half* __restrict__ scale,       // [Kp / group, Np]
    const __half* __restrict__ minimum,     // [Kp / group, Np] (QL_UINT4; unread otherwise)
    const T* __restrict__ bias,             // [N] (has_bias; unread otherwise)
    T* __restrict__ out,                    // [M, out_stride]: this weight's columns from col0 (one split)
    float* __restrict__ partial,            // [splits, M, N] fp32 (several splits)
    int M, int N, int K, int Np,
    int group_shift,                        // log2 of the group (16, 32 or 64): no division in the loop
    int split_tiles, int out_stride, int col0, int has_bias) {
    constexpr int STAGES = ql_stages<BM>();
    constexpr int PITCH = QL_BK + QL_PAD;
    constexpr int UNIT = ql_unit_bytes<Q>();
    constexpr int WARPS_M = BM == QL_DECODE_ROWS ? 1 : 2;
    constexpr int WARPS_N = 4 / WARPS_M;
    constexpr int MB = BM / 16 / WARPS_M;            // m16 blocks per warp
    constexpr int NU = QL_BN / 16 / WARPS_N;         // units (n16) per warp
    constexpr int X_BYTES = BM * PITCH * (int)sizeof(T);
    constexpr int W_BYTES = 4 * UNIT;
    constexpr int S_BYTES = QL_SCALE_ROWS * QL_BN * 2;
    constexpr int STAGE_BYTES = X_BYTES + W_BYTES + 2 * S_BYTES;
    static_assert(BM == QL_DECODE_ROWS || BM == QL_PREFILL_ROWS, "the two row tiles");
    static_assert(X_BYTES % 16 == 0 && STAGE_BYTES % 16 == 0, "16-byte aligned stage parts");
    extern __shared__ __align__(16) unsigned char smem[];

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int n0 = blockIdx.x * QL_BN, m0 = blockIdx.y * BM;
    const int first_tile = blockIdx.z * split_tiles;
    const int num_tiles = min(split_tiles, (K + QL_BK - 1) / QL_BK - first_tile);
    const int scale_rows = QL_BK >> group_shift;
    const int units_per_k = Np / 16;

    const auto load_tile = [&](int it) {
        unsigned char* s = smem + (it % STAGES) * STAGE_BYTES;
        const int kt = first_tile + it, k0 = kt * QL_BK;
        T* x_s = reinterpret_cast<T*>(s);
#pragma unroll
        // 16-byte chunks of the x tile; rows past M and k past K are zero-filled
        for (int r = 0; r < BM * 8 / QL_THREADS; ++r) {
            const int i = threadIdx.x + r * QL_THREADS, row = i / 8, c = i % 8;
            const bool ok = m0 + row < M && k0 + 8 * c < K;
            const T* src = ok ? x + (long long)(m0 + row) * K + k0 + 8 * c : x;
            cp_async_16_zfill(x_s + row * PITCH + 8 * c, src, ok);
        }
        const unsigned char* w = packed + ((long long)kt * units_per_k + n0 / 16) * UNIT;
#pragma unroll
        for (int r = 0; r < W_BYTES / 16 / QL_THREADS; ++r) {
            const int i = threadIdx.x + r * QL_THREADS;
            cp_async_16(s + X_BYTES + 16 * i, w + 16 * i);
        }
        if (threadIdx.x < scale_rows * 8) {   // each scale row of the tile: 64 fp16 = 8 chunks
            const int row = threadIdx.x / 8, c = threadIdx.x % 8;
            const long long offset = (long long)(kt * scale_rows + row) * Np + n0 + 8 * c;
            cp_async_16(s + X_BYTES + W_BYTES + row * QL_BN * 2 + 16 * c, scale + offset);
            if constexpr (Q == QL_UINT4)
                cp_async_16(s + X_BYTES + W_BYTES + S_BYTES + row * QL_BN * 2 + 16 * c, minimum + offset);
        }
    };

    float acc[MB][2 * NU][4];
#pragma unroll
    for (int b = 0; b < MB; ++b)
#pragma unroll
        for (int j = 0; j < 2 * NU; ++j) acc[b][j][0] = acc[b][j][1] = acc[b][j][2] = acc[b][j][3] = 0.0f;

#pragma unroll
    for (int it = 0; it < STAGES - 1; ++it) {
        if (it < num_tiles) load_tile(it);
        cp_async_commit();
    }
    for (int it = 0; it < num_tiles; ++it) {
        cp_async_wait<STAGES - 2>();   // this thread's copies of tile it have landed
        __syncthreads();               // everyone's have, and every warp is done with tile it - 1's stage
        if (it + STAGES - 1 < num_tiles) load_tile(it + STAGES - 1);
        cp_async_commit();

        const unsigned char* s = smem + (it % STAGES) * STAGE_BYTES;
        const T* x_s = reinterpret_cast<const T*>(s);
        const __half* scale_s = reinterpret_cast<const __half*>(s + X_BYTES + W_BYTES);
        const __half* min_s = reinterpret_cast<const __half*>(s + X_BYTES + W_BYTES + S_BYTES);
        // This lane's fragment words of its units: [unit][j] (8-bit) or [unit] (4-bit), four k steps each.
        uint4 words[NU][Q == QL_UINT4 ? 1 : 2];
#pragma unroll
        for (int u = 0; u < NU; ++u)
#pragma unroll
            for (int h = 0; h < (Q == QL_UINT4 ? 1 : 2); ++h)
                words[u][h] =
                    *reinterpret_cast<const uint4*>(s + X_BYTES + (wn * NU + u) * UNIT + h * 512 + 16 * lane);
#pragma unroll
        for (int kk = 0; kk < QL_BK / 16; ++kk) {
            unsigned a[MB][4];
#pragma unroll
            for (int b = 0; b < MB; ++b)
                ldmatrix_x4(a[b], x_s + ((wm * MB + b) * 16 + lane % 16) * PITCH + kk * 16 + (lane / 16) * 8);
            const int srow = (kk * 16) >> group_shift;
#pragma unroll
            for (int u = 0; u < NU; ++u)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const uint4& v = words[u][Q == QL_UINT4 ? 0 : j];
                    const unsigned word = kk == 0 ? v.x : kk == 1 ? v.y : kk == 2 ? v.z : v.w;
                    const int col = (wn * NU + u) * 16 + 8 * j + g;
                    const float sc = __half2float(scale_s[srow * QL_BN + col]);
                    const float mn = Q == QL_UINT4 ? __half2float(min_s[srow * QL_BN + col]) : 0.0f;
                    float w[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float q = ql_code<Q>(word, j, i);
                        w[i] = Q == QL_UINT4 ? fmaf(q, sc, -mn) : q * sc;
                    }
                    const unsigned bfrag[2] = {pack2<T>(w[0], w[1]), pack2<T>(w[2], w[3])};
#pragma unroll
                    for (int b = 0; b < MB; ++b) mma_m16n8k16<T>(acc[b][2 * u + j], a[b], bfrag);
                }
        }
    }
    cp_async_wait<0>();   // the trailing (empty) groups

    const bool split = gridDim.z > 1;
#pragma unroll
    for (int b = 0; b < MB; ++b)
#pragma unroll
        for (int j = 0; j < 2 * NU; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + (wm * MB + b) * 16 + g + 8 * h;
                const int n = n0 + wn * NU * 16 + 8 * j + 2 * t;   // even, and N is even: n < N covers n + 1
                if (row >= M || n >= N) continue;
                float v0 = acc[b][j][2 * h], v1 = acc[b][j][2 * h + 1];
                if (split) {
                    float* dst = partial + ((long long)blockIdx.z * M + row) * N + n;
                    *reinterpret_cast<float2*>(dst) = float2{v0, v1};
                } else {
                    if (has_bias) {
                        v0 += to_float(bias[n]);
                        v1 += to_float(bias[n + 1]);
                    }
                    T* dst = out + (long long)row * out_stride + col0 + n;
                    *reinterpret_cast<unsigned*>(dst) = pack2<T>(v0, v1);
                }
            }
}

// out[m, col0 + n] = sum of the splits' partials (+ bias), rounded once to T. Grid-stride over M x N.
template <typename T>
__global__ void quant_linear_reduce_kernel(const float* __restrict__ partial,   // [splits, M, N]
                                           const T* __restrict__ bias, T* __restrict__ out, int M, int N,
                                           int splits, int out_stride, int col0, int has_bias) {
    const long long total = (long long)M * N, stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += stride) {
        float sum = has_bias ? to_float(bias[i % N]) : 0.0f;
        for (int z = 0; z < splits; ++z) sum += partial[z * total + i];
        out[(i / N) * out_stride + col0 + i % N] = from_float<T>(sum);
    }
}

// out[token, k] = W[ids[token], k], dequantized and rounded to T: an embedding table kept quantized.
template <typename T, int Q>
__global__ void quant_embedding_kernel(const unsigned char* __restrict__ packed,
                                       const __half* __restrict__ scale, const __half* __restrict__ minimum,
                                       const int* __restrict__ ids, T* __restrict__ out, int num_tokens, int H,
                                       int Np, int group_shift) {
    const long long total = (long long)num_tokens * H, stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += stride) {
        const int n = ids[i / H], k = (int)(i % H);
        const long long s = (long long)(k >> group_shift) * Np + n;
        const float q = ql_code_at<Q>(packed, n, k, Np);
        const float w = Q == QL_UINT4 ? fmaf(q, __half2float(scale[s]), -__half2float(minimum[s]))
                                      : q * __half2float(scale[s]);
        out[i] = from_float<T>(w);
    }
}
