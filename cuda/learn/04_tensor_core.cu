// Step 4 of 4: tensor cores, FlashAttention-2 style, for many query rows per KV head.
//
// What changes from step 3, and why. A decode has one query row per head, so steps 1-3 do 2 FLOPs per
// K/V element they read: memory bound, and scalar FMAs keep up. A prefill chunk (many query tokens of
// one sequence) and a GQA group (G query heads sharing a KV head) give many rows per K/V element:
// compute bound, and the tensor cores' matrix products are the fast way to do it.
//  - Rows: a CTA takes 64 (query token, query head) rows of one sequence and KV head, four warps of 16
//    (the m16 of mma.m16n8k16). Row r is token r / G, head kv_head * G + r % G, so each K/V tile in
//    shared memory serves the whole group. A row at position p sees keys 0..p (causal).
//  - Per tile of 16 keys and per warp: S = Q K^T (16 x 16, two n8 halves of D / 16 k steps each), the
//    causal mask, the online softmax of step 2 per row, then O += P V with P rounded to T.
//  - Fragments by hand, in the PTX ISA's layout (docs/cuda.md draws it): lane l = 4g + t holds rows g
//    and g + 8 and columns 2t, 2t + 1 (+ 8). Q's A fragments stay in registers for the whole loop; the
//    accumulators of S's two n8 halves are, element for element, the A fragment of P for P V.
//    The production kernel (cuda/prefill_attention.cu) loads the same fragments with ldmatrix.
// Math in fp32 (mma accumulates in fp32) except Q, K, V and P, which are T (__half or __nv_bfloat16).
#include "common.cuh"

constexpr int TC_WARPS = 4;
constexpr int TC_ROWS = TC_WARPS * 16;   // (token, head) rows per CTA
constexpr int TC_KEYS = 16;              // keys per tile: S of a warp is 16 x 16, one k16 step of P V
constexpr int TC_PAD = 8;                // elements of padding per shared row (16 bytes)
// Resident CTAs per SM that ptxas budgets registers for (at most 168 a thread): without a count, ptxas
// holds head_dim 64 to 72 registers and spills.
constexpr int TC_MIN_CTAS_PER_SM = 3;

// Two consecutive elements of a row as one fragment register (the lower index in the low half).
template <typename T>
__device__ __forceinline__ unsigned pair(const T* p) { return *reinterpret_cast<const unsigned*>(p); }

template <typename T, int D>
__global__ void __launch_bounds__(TC_WARPS * 32, TC_MIN_CTAS_PER_SM) tensor_core_attention_kernel(
    const T* __restrict__ q,               // [num_tokens, num_q_heads, D]: the batch's query tokens
    const T* __restrict__ k_cache,         // [num_blocks, num_kv_heads, block_size, D]
    const T* __restrict__ v_cache,         // same layout
    const int* __restrict__ query_start,   // int32[num_seqs + 1]: tokens of sequence s, query_start[s] ..
    const int* __restrict__ context_lens,  // int32[num_seqs]: keys of sequence s, its query tokens the last
    const int* __restrict__ block_tables,  // int32[num_seqs, max_blocks_per_seq]
    T* __restrict__ out,                   // [num_tokens, num_q_heads, D]
    int num_q_heads, int num_kv_heads, int block_size, int max_blocks_per_seq, float scale) {
    static_assert(D % 16 == 0, "head_dim must be a multiple of 16 (the mma k step)");
    __shared__ __align__(16) T k_s[TC_KEYS][D + TC_PAD];
    __shared__ __align__(16) T v_s[TC_KEYS][D + TC_PAD];

    const int seq = blockIdx.y, kv_head = blockIdx.z;
    const int group = num_q_heads / num_kv_heads;
    const int first_token = query_start[seq], rows = (query_start[seq + 1] - first_token) * group;
    const int row0 = blockIdx.x * TC_ROWS;
    if (row0 >= rows) return;   // the grid is sized for the longest query run
    const int first_position = context_lens[seq] - rows / group;
    const int key_end = first_position + (min(row0 + TC_ROWS, rows) - 1) / group + 1;   // the last row's keys
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;

    // This lane's rows g and g + 8 of its warp's 16: their position and query. Rows past the end repeat
    // the last row (computed, never written), so every row sees key 0 and its max is finite.
    int position[2];
    unsigned q_frag[D / 16][4];   // A fragments of Q, one per k16 step
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = min(row0 + warp * 16 + g + 8 * h, rows - 1);
        position[h] = first_position + r / group;
        const long long token = first_token + r / group;
        const T* q_row = q + (token * num_q_heads + kv_head * group + r % group) * D;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            q_frag[kk][h] = pair(q_row + kk * 16 + 2 * t);           // a[0]: row g,  a[1]: row g + 8
            q_frag[kk][h + 2] = pair(q_row + kk * 16 + 2 * t + 8);   // a[2], a[3]: columns + 8
        }
    }

    float o[D / 8][4];   // O: n8 tile j of dims 8j .. 8j + 7; [0..1] row g, [2..3] row g + 8
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float row_max[2] = {negative_infinity(), negative_infinity()}, row_sum[2] = {0.0f, 0.0f};

    for (int tile = 0; tile < key_end; tile += TC_KEYS) {
        __syncthreads();   // every warp done with the previous tile
        for (int i = threadIdx.x; i < TC_KEYS * (D / 8); i += blockDim.x) {
            const int j = i / (D / 8), c = i % (D / 8), key = tile + j;
            const bool valid = key < key_end;   // keys past it are zeros: 0 x (garbage) could be NaN in P V
            const long long block = valid ? table[key / block_size] : 0;
            const long long row = (block * num_kv_heads + kv_head) * block_size + key % block_size;
            cp_async_16_zfill(&k_s[j][c * 8], k_cache + row * D + c * 8, valid);
            cp_async_16_zfill(&v_s[j][c * 8], v_cache + row * D + c * 8, valid);
        }
        cp_async_wait_all();
        __syncthreads();   // the tile visible to every warp

        // S = Q K^T. B is K^T (k = dimension, n = key): b[0] holds K[key g][dims 2t, 2t + 1], b[1] dims + 8.
        float s[2][4] = {};   // n8 halves: keys tile + 0..7 and tile + 8..15
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const T* k_row = &k_s[8 * n + g][kk * 16 + 2 * t];
                const unsigned b[2] = {pair(k_row), pair(k_row + 8)};
                mma_m16n8k16<T>(s[n], q_frag[kk], b);
            }

        // Scale, causal mask, online softmax: element [n][2h + e] is row g + 8h, key tile + 8n + 2t + e.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float tile_max = negative_infinity();
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[n][2 * h + e];
                    x = tile + 8 * n + 2 * t + e <= position[h] ? x * scale : negative_infinity();
                    tile_max = fmaxf(tile_max, x);
                }
            // The row's other 16 - 4 scores are in the lanes 4g .. 4g + 3.
            tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_WARP, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_WARP, tile_max, 2));
            const float new_max = fmaxf(row_max[h], tile_max);   // finite from the first tile on (key 0)
            const float correction = expf(row_max[h] - new_max);
            row_max[h] = new_max;
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    s[n][2 * h + e] = expf(s[n][2 * h + e] - new_max);
                    sum += s[n][2 * h + e];
                }
            row_sum[h] = row_sum[h] * correction + sum;   // this lane's share of the row; summed at the end
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                o[j][2 * h] *= correction;
                o[j][2 * h + 1] *= correction;
            }
        }

        // O += P V. P's A fragment is S's accumulators rounded to T; B is V (k = key, n = dimension):
        // b[0] holds V[keys 2t, 2t + 1][dim g], b[1] keys + 8, two rows apart, so they are packed here.
        const unsigned p[4] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3]),
                               pack2<T>(s[1][0], s[1][1]), pack2<T>(s[1][2], s[1][3])};
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const int d = 8 * j + g;
            const unsigned b[2] = {pack2<T>(to_float(v_s[2 * t][d]), to_float(v_s[2 * t + 1][d])),
                                   pack2<T>(to_float(v_s[2 * t + 8][d]), to_float(v_s[2 * t + 9][d]))};
            mma_m16n8k16<T>(o[j], p, b);
        }
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = row_sum[h];
        sum += __shfl_xor_sync(FULL_WARP, sum, 1);
        sum += __shfl_xor_sync(FULL_WARP, sum, 2);
        const int r = row0 + warp * 16 + g + 8 * h;
        if (r >= rows) continue;
        const long long token = first_token + r / group;
        T* out_row = out + (token * num_q_heads + kv_head * group + r % group) * D;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            out_row[8 * j + 2 * t] = from_float<T>(o[j][2 * h] / sum);
            out_row[8 * j + 2 * t + 1] = from_float<T>(o[j][2 * h + 1] / sum);
        }
    }
}
