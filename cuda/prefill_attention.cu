// Prefill-chunk attention on tensor cores (FlashAttention-2 style) over the paged KV cache.
//
// Serves query runs longer than one token (prefill chunks and whole prompts) of a mixed batch; decodes
// go to paged_attention.cu. Query token at position p of sequence s attends to keys 0..p of s, which
// live in the paged cache (key j: block block_tables[s][j / block_size], offset j % block_size); this
// step's keys are already stored, so the one rule "key position <= query position" covers both the
// history and causality within the chunk. Positions of a run are consecutive (the batch contract).
//
// Work decomposition: grid = (work items, KV heads), 128 threads. A work item is a run of up to
// PF_ROWS / G consecutive query tokens of one sequence; the CTA's PF_ROWS = 64 rows are (token, query
// head) pairs of the G = Hq / Hk query heads that share its KV head, so each K/V tile is read once for
// the whole GQA group (no copy of K/V per query head). Warp w owns rows 16w .. 16w+15.
//
// Per CTA: Q (64 x D) is copied to shared memory once and held in registers as mma A-fragments. K/V
// tiles of PF_KEYS = 64 keys stream through two shared-memory stages with cp.async (the next tile's
// copies are in flight while the current one is computed). Per tile and warp:
//   S = Q K^T      mma.m16n8k16, K fragments by ldmatrix (K rows are B^T: key-major, D contiguous)
//   online softmax in fp32 on S (running max m and sum l per row, exp2 with log2(e) folded into scale);
//   the causal mask is applied only on tiles that reach past the first query's position (diagonal tiles)
//   O += P V       P rounded to T straight from the S accumulators (their layout is the A layout), V
//                  fragments by ldmatrix.trans (V rows are key-major, the k dimension of this product)
// Shared-memory rows are padded by 16 bytes so the eight 16-byte rows one ldmatrix reads fall in
// different banks for every supported head_dim. Math is fp32 (mma accumulators) except P and the inputs.
#include "common.cuh"

constexpr int PF_WARPS = 4;
constexpr int PF_THREADS = PF_WARPS * 32;
constexpr int PF_ROWS = PF_WARPS * 16;   // (token, query head) rows per CTA
constexpr int PF_KEYS = 64;              // keys per K/V tile
constexpr int PF_PAD = 8;                // elements of padding per shared-memory row (16 bytes)

// Cache row of each key of a tile (block_tables lookup and the division by block_size, once per key, by
// PF_KEYS threads); -1 past key_end. Callers separate this from the copies that read it by a barrier.
__device__ __forceinline__ void tile_rows(const int* __restrict__ table, int* rows_s, int tile, int key_end,
                                          int kv_head, int num_kv_heads, int block_size) {
    if (threadIdx.x < PF_KEYS) {
        const int key = tile + threadIdx.x;
        rows_s[threadIdx.x] = key < key_end ? (table[key / block_size] * num_kv_heads + kv_head) * block_size + key % block_size
                                            : -1;
    }
}

// Issues the cp.async copies of one K/V tile (rows from tile_rows) into k_s / v_s (pitch D + PF_PAD). Keys
// past key_end are zero-filled without reading memory: a NaN in a never-written cache slot must not reach
// P V through 0 * NaN.
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                             const int* rows_s, T* k_s, T* v_s) {
    constexpr int CHUNKS = D / 8;   // 16-byte chunks per key row
    constexpr int PITCH = D + PF_PAD;
    static_assert(PF_KEYS * CHUNKS % PF_THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll 2
    for (int m = 0; m < PF_KEYS * CHUNKS / PF_THREADS; ++m) {
        const int i = threadIdx.x + m * PF_THREADS;
        const int j = i / CHUNKS, c = i % CHUNKS;
        const int row = rows_s[j];
        const long long offset = row < 0 ? 0 : (long long)row * D + c * 8;
        cp_async_16_zfill(k_s + j * PITCH + c * 8, k_cache + offset, row >= 0);
        cp_async_16_zfill(v_s + j * PITCH + c * 8, v_cache + offset, row >= 0);
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(PF_THREADS, 2) prefill_attention_kernel(
    const T* __restrict__ q,               // [num_tokens, num_q_heads, D], rows q_stride elements apart
    const T* __restrict__ k_cache,         // [num_blocks, num_kv_heads, block_size, D]
    const T* __restrict__ v_cache,         // same layout
    const int* __restrict__ work,          // int32[num_items, 3]: sequence, first token, token count
    const int* __restrict__ positions,     // int32[num_tokens]
    const int* __restrict__ block_tables,  // int32[num_seqs, max_blocks_per_seq]
    T* __restrict__ out,                   // [num_tokens, num_q_heads, D]; rows of other items untouched
    int num_q_heads, int num_kv_heads, int block_size, int max_blocks_per_seq, long long q_stride,
    float scale_log2) {                    // softmax scale * log2(e)
    static_assert(D % 16 == 0, "head_dim must be a multiple of 16 (the mma k step)");
    constexpr int PITCH = D + PF_PAD;
    constexpr int KSTEPS = D / 16;         // k16 steps of Q K^T; also pairs of n8 tiles of P V
    constexpr int NTILES = PF_KEYS / 8;    // n8 tiles of S
    // Shared memory: stage 0 K, V, then stage 1 K, V (each PF_KEYS x PITCH), then int rows_s[PF_KEYS]. Q is
    // staged in stage 1's K before the loop: it moves to registers before tile 1 is copied there.
    extern __shared__ __align__(16) unsigned char smem[];
    T* const stages = reinterpret_cast<T*>(smem);
    T* const q_s = stages + 2 * PF_KEYS * PITCH;
    int* const rows_s = reinterpret_cast<int*>(stages + 4 * PF_KEYS * PITCH);   // cache rows of the next tile

    const int seq = work[3 * blockIdx.x], first_token = work[3 * blockIdx.x + 1], tokens = work[3 * blockIdx.x + 2];
    const int kv_head = blockIdx.y;
    const int group = num_q_heads / num_kv_heads;
    const int rows = tokens * group;   // row r: token first_token + r / group, head kv_head * group + r % group
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;   // this lane's fragment row (and row + 8) and column pair
    const int first_position = positions[first_token];
    const int key_end = positions[first_token + tokens - 1] + 1;
    const int num_tiles = (key_end + PF_KEYS - 1) / PF_KEYS;
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;

    for (int i = threadIdx.x; i < PF_ROWS * (D / 8); i += PF_THREADS) {
        const int r = i / (D / 8), c = i % (D / 8);
        const bool present = r < rows;
        const long long src = present ? (first_token + r / group) * q_stride + (long long)(kv_head * group + r % group) * D + c * 8 : 0;
        cp_async_16_zfill(q_s + r * PITCH + c * 8, q + src, present);
    }
    tile_rows(table, rows_s, 0, key_end, kv_head, num_kv_heads, block_size);
    __syncthreads();
    load_kv_tile<T, D>(k_cache, v_cache, rows_s, stages, stages + PF_KEYS * PITCH);
    cp_async_wait_all();
    __syncthreads();   // Q and tile 0 landed for every thread's copies

    unsigned q_frag[KSTEPS][4];   // A fragments of this warp's 16 rows
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
        ldmatrix_x4(q_frag[kk], q_s + (warp * 16 + lane % 16) * PITCH + kk * 16 + (lane / 16) * 8);
    __syncthreads();   // q_s (stage 1) free for tile 1

    int row_position[2];   // rows 16 warp + g and + g + 8; -1 for padding rows (masked on diagonal tiles)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + g + 8 * h;
        row_position[h] = r < rows ? positions[first_token + r / group] : -1;
    }
    float o[2 * KSTEPS][4];   // O accumulators: n8 tile j of head dims, rows g (0, 1) and g + 8 (2, 3)
#pragma unroll
    for (int j = 0; j < 2 * KSTEPS; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float row_max[2] = {negative_infinity(), negative_infinity()}, row_sum[2] = {0.0f, 0.0f};   // sum: this lane's part

    for (int it = 0; it < num_tiles; ++it) {
        const int tile = it * PF_KEYS;
        if (it + 1 < num_tiles) {   // uniform across the CTA
            tile_rows(table, rows_s, tile + PF_KEYS, key_end, kv_head, num_kv_heads, block_size);
            __syncthreads();
            T* next = stages + ((it + 1) % 2) * 2 * PF_KEYS * PITCH;
            load_kv_tile<T, D>(k_cache, v_cache, rows_s, next, next + PF_KEYS * PITCH);
        }
        cp_async_commit();
        cp_async_wait<1>();   // this tile's group (committed one iteration earlier) has landed
        __syncthreads();
        const T* k_s = stages + (it % 2) * 2 * PF_KEYS * PITCH;
        const T* v_s = k_s + PF_KEYS * PITCH;

        float s[NTILES][4];
#pragma unroll
        for (int j = 0; j < NTILES; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int n2 = 0; n2 < NTILES / 2; ++n2) {
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                // Matrices: keys n2*16 + 0..7 / + 8..15 (lanes 16-31) x dims kk*16 + 0..7 / + 8..15 (lanes 8-15, 24-31).
                unsigned k_frag[4];
                ldmatrix_x4(k_frag, k_s + (n2 * 16 + lane % 8 + 8 * (lane / 16)) * PITCH + kk * 16 + 8 * ((lane / 8) % 2));
                mma_m16n8k16<T>(s[2 * n2], q_frag[kk], k_frag);
                mma_m16n8k16<T>(s[2 * n2 + 1], q_frag[kk], k_frag + 2);
            }
        }

        if (tile + PF_KEYS - 1 > first_position) {   // a diagonal tile (the test is uniform across the CTA)
#pragma unroll
            for (int j = 0; j < NTILES; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (tile + j * 8 + 2 * t + e % 2 > row_position[e / 2]) s[j][e] = negative_infinity();
        }

#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float tile_max = row_max[h];
#pragma unroll
            for (int j = 0; j < NTILES; ++j) tile_max = fmaxf(tile_max, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_WARP, tile_max, 1));   // the 4 lanes of a row
            tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_WARP, tile_max, 2));
            // Maxima are kept unscaled (scale > 0 keeps the order); exp2(s * scale_log2 - base) is one FFMA
            // and one EX2 per score. A row with no visible key yet (only padding rows) keeps max -inf; use
            // base 0 so exp2 gives 0, not NaN.
            const float base = tile_max == negative_infinity() ? 0.0f : tile_max * scale_log2;
            const float correction = exp2f(row_max[h] * scale_log2 - base);
            row_max[h] = tile_max;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < NTILES; ++j) {
                s[j][2 * h] = exp2f(fmaf(s[j][2 * h], scale_log2, -base));
                s[j][2 * h + 1] = exp2f(fmaf(s[j][2 * h + 1], scale_log2, -base));
                sum += s[j][2 * h] + s[j][2 * h + 1];
            }
            row_sum[h] = row_sum[h] * correction + sum;
#pragma unroll
            for (int j = 0; j < 2 * KSTEPS; ++j) {
                o[j][2 * h] *= correction;
                o[j][2 * h + 1] *= correction;
            }
        }

#pragma unroll
        for (int kk = 0; kk < PF_KEYS / 16; ++kk) {
            // S tiles 2kk and 2kk+1 hold exactly the A fragment of keys kk*16 .. kk*16+15.
            const unsigned p_frag[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                        pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                        pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int d2 = 0; d2 < KSTEPS; ++d2) {
                // Matrices: keys kk*16 + 0..7 / + 8..15 (lanes 8-15, 24-31) x dims d2*16 + 0..7 / + 8..15 (lanes 16-31).
                unsigned v_frag[4];
                ldmatrix_x4_trans(v_frag, v_s + (kk * 16 + lane % 8 + 8 * ((lane / 8) % 2)) * PITCH + d2 * 16 + 8 * (lane / 16));
                mma_m16n8k16<T>(o[2 * d2], p_frag, v_frag);
                mma_m16n8k16<T>(o[2 * d2 + 1], p_frag, v_frag + 2);
            }
        }
        __syncthreads();   // every warp done with this stage (and rows_s) before iteration it + 1 refills them
    }
    cp_async_wait<0>();   // the last (empty) group

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = row_sum[h];
        sum += __shfl_xor_sync(FULL_WARP, sum, 1);
        sum += __shfl_xor_sync(FULL_WARP, sum, 2);
        const int r = warp * 16 + g + 8 * h;
        if (r >= rows) continue;
        const float inv_sum = 1.0f / sum;   // key 0 is visible to every row, so sum > 0
        const long long token = first_token + r / group;
        T* dst = out + (token * num_q_heads + kv_head * group + r % group) * D + 2 * t;
#pragma unroll
        for (int j = 0; j < 2 * KSTEPS; ++j)
            *reinterpret_cast<unsigned*>(dst + 8 * j) = pack2<T>(o[j][2 * h] * inv_sum, o[j][2 * h + 1] * inv_sum);
    }
}
