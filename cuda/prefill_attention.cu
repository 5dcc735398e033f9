// Prefill-chunk attention on tensor cores (FlashAttention-2 style) over the paged KV cache.
//
// Serves query runs longer than one token (prefill chunks and whole prompts) of a mixed batch; decodes
// go to decode_attention.cu. Query token at position p of sequence s attends to keys 0..p of s, which
// live in the paged cache (key j: block block_tables[s][j / block_size], offset j % block_size); this
// step's keys are already stored, so the one rule "key position <= query position" covers both the
// history and causality within the chunk. Positions of a run are consecutive (the batch contract). A sliding
// window (window > 0) also hides the keys at or before p - window: a CTA starts at the tile of its first
// query's first visible key (the blocks before may be freed), and masks within the tiles that reach before
// its last query's.
//
// Work decomposition: grid = (work items, KV heads, key splits), 128 threads. A work item is a run of up
// to PF_ROWS / G consecutive query tokens of one sequence; the CTA's PF_ROWS = 128 rows are (token, query
// head) pairs of the G = Hq / Hk query heads that share its KV head, so each K/V tile is read once for
// the whole GQA group (no copy of K/V per query head). Warp w owns rows 32w .. 32w+31 as two m16 blocks,
// so every K/V fragment a warp loads from shared memory feeds two mma (FlashAttention-2's 128-row tile).
// Split z (grid z > 1, for chunks too short to fill the GPU) covers keys [z split_keys, (z+1) split_keys)
// and writes unnormalized partials that paged_attention_reduce_kernel merges.
//
// Per CTA: Q (128 x D) is copied to shared memory once; its A-fragments are re-read there per k step
// (holding them in registers would take 64 of them at D = 128, past the 255 the accumulators leave).
// K/V tiles of PF_KEYS = 64 keys stream through pf_stages<D>() shared-memory stages with cp.async, the
// next STAGES - 1 tiles in flight while one is computed, one barrier per tile. Per softmax step (a tile,
// or half of one at D = 128: pf_softmax_keys) and warp:
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
constexpr int PF_WARP_BLOCKS = 2;                        // m16 row blocks per warp
constexpr int PF_ROWS = PF_WARPS * PF_WARP_BLOCKS * 16;  // (token, query head) rows per CTA
constexpr int PF_KEYS = 64;                              // keys per K/V tile
constexpr int PF_PAD = 8;                                // elements of padding per shared-memory row (16 bytes)
constexpr int PF_CTAS_PER_SM = 2;                        // resident CTAs per SM the registers are bounded for
// Three stages up to this head_dim: two CTAs of them still fit an H100/H200 SM's 228 KiB (D = 128 would
// need 2 x 136 KiB and drop to one CTA, 4 warps, per SM; it keeps two stages).
constexpr int PF_THREE_STAGE_MAX_HEAD_DIM = 96;

template <int D> __device__ __forceinline__ constexpr int pf_stages() { return D <= PF_THREE_STAGE_MAX_HEAD_DIM ? 3 : 2; }
// Keys per online-softmax step: a whole tile, but half of one at D = 128, where S of 64 keys (64 registers)
// beside O (128) and the fragments in flight leaves ptxas too few of the 255 and it spills.
template <int D> __device__ __forceinline__ constexpr int pf_softmax_keys() { return D <= 96 ? PF_KEYS : PF_KEYS / 2; }

// Cache row of key `key` in block `block`: 64-bit, since num_blocks * num_kv_heads * block_size passes 2^31
// on a large cache (a 32-bit row would wrap to another block's keys); -1 (zero-filled) for block -1.
__device__ __forceinline__ long long cache_row(int block, int key, int kv_head, int num_kv_heads, int block_size) {
    return block < 0 ? -1 : ((long long)block * num_kv_heads + kv_head) * block_size + key % block_size;
}

// Issues the cp.async copies of one K/V tile (cache rows from rows_s) into k_s / v_s (pitch D + PF_PAD).
// Keys past the run's last key are zero-filled without reading memory: a NaN in a never-written cache slot
// must not reach P V through 0 * NaN.
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                             const long long* rows_s, T* k_s, T* v_s) {
    constexpr int CHUNKS = D / 8;   // 16-byte chunks per key row
    constexpr int PITCH = D + PF_PAD;
    static_assert(PF_KEYS * CHUNKS % PF_THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll 2
    for (int m = 0; m < PF_KEYS * CHUNKS / PF_THREADS; ++m) {
        const int i = threadIdx.x + m * PF_THREADS;
        const int j = i / CHUNKS, c = i % CHUNKS;
        const long long row = rows_s[j];
        const long long offset = row < 0 ? 0 : row * D + c * 8;
        cp_async_16_zfill(k_s + j * PITCH + c * 8, k_cache + offset, row >= 0);
        cp_async_16_zfill(v_s + j * PITCH + c * 8, v_cache + offset, row >= 0);
    }
}

// One step of the online softmax for a warp's 32 rows (q_w: their Q in shared memory) over KEYS keys from
// key position `key0` (k_s, v_s: their rows in a stage): S = Q K^T, mask, rescale, O += P V.
template <typename T, int D, int KEYS>
__device__ __forceinline__ void attend(const T* q_w, const T* k_s, const T* v_s, int key0, int first_position, int group,
                                       int window, float scale_log2, float (&o)[PF_WARP_BLOCKS][D / 8][4],
                                       float (&row_max)[PF_WARP_BLOCKS][2], float (&row_sum)[PF_WARP_BLOCKS][2]) {
    constexpr int PITCH = D + PF_PAD;
    constexpr int KSTEPS = D / 16;   // k16 steps of Q K^T; also pairs of n8 tiles of P V
    constexpr int NTILES = KEYS / 8; // n8 tiles of S
    constexpr int B = PF_WARP_BLOCKS;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;   // this lane's fragment row (and row + 8) and column pair

    float s[B][NTILES][4];
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
        for (int j = 0; j < NTILES; ++j) s[b][j][0] = s[b][j][1] = s[b][j][2] = s[b][j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        unsigned q_frag[B][4];
#pragma unroll
        for (int b = 0; b < B; ++b) ldmatrix_x4(q_frag[b], q_w + (b * 16 + lane % 16) * PITCH + kk * 16 + (lane / 16) * 8);
#pragma unroll
        for (int n2 = 0; n2 < NTILES / 2; ++n2) {
            // Matrices: keys n2*16 + 0..7 / + 8..15 (lanes 16-31) x dims kk*16 + 0..7 / + 8..15 (lanes 8-15, 24-31).
            unsigned k_frag[4];
            ldmatrix_x4(k_frag, k_s + (n2 * 16 + lane % 8 + 8 * (lane / 16)) * PITCH + kk * 16 + 8 * ((lane / 8) % 2));
#pragma unroll
            for (int b = 0; b < B; ++b) {
                mma_m16n8k16<T>(s[b][2 * n2], q_frag[b], k_frag);
                mma_m16n8k16<T>(s[b][2 * n2 + 1], q_frag[b], k_frag + 2);
            }
        }
    }

    // Keys past the CTA's first query position, or (a window) at or before its last row's position - window:
    // uniform across the CTA.
    if (key0 + KEYS - 1 > first_position || (window > 0 && key0 <= first_position + (PF_ROWS - 1) / group - window)) {
        // Row r's position is first_position + r / group (a run's positions are consecutive), worked out here
        // rather than held in registers through the loop; padding rows see keys harmlessly (zero Q).
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int last_visible = first_position - key0 + (warp * 32 + b * 16 + g + 8 * h) / group;
#pragma unroll
                for (int j = 0; j < NTILES; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (j * 8 + 2 * t + e > last_visible || (window > 0 && j * 8 + 2 * t + e <= last_visible - window))
                            s[b][j][2 * h + e] = negative_infinity();
            }
    }

    float correction[B][2];
    bool max_moved = false;
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float tile_max = row_max[b][h];
#pragma unroll
            for (int j = 0; j < NTILES; ++j) tile_max = fmaxf(tile_max, fmaxf(s[b][j][2 * h], s[b][j][2 * h + 1]));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_WARP, tile_max, 1));   // the 4 lanes of a row
            tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_WARP, tile_max, 2));
            // Maxima are kept unscaled (scale > 0 keeps the order); exp2(s * scale_log2 - base) is one FFMA
            // and one EX2 per score. A row with no visible key yet (padding rows; rows before a split's
            // keys) keeps max -inf; use base 0 so exp2 gives 0, not NaN.
            const float base = tile_max == negative_infinity() ? 0.0f : tile_max * scale_log2;
            correction[b][h] = exp2f(row_max[b][h] * scale_log2 - base);
            max_moved |= tile_max != row_max[b][h];
            row_max[b][h] = tile_max;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < NTILES; ++j) {
                s[b][j][2 * h] = exp2f(fmaf(s[b][j][2 * h], scale_log2, -base));
                s[b][j][2 * h + 1] = exp2f(fmaf(s[b][j][2 * h + 1], scale_log2, -base));
                sum += s[b][j][2 * h] + s[b][j][2 * h + 1];
            }
            row_sum[b][h] = row_sum[b][h] * correction[b][h] + sum;
        }
    // O is rescaled only when a row's max moved (correction 1 otherwise): deep into a long history that is
    // rare, and the D / 2 FMUL per row block are as many issue slots as the step's P V mma.
    if (__any_sync(FULL_WARP, max_moved)) {
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
            for (int j = 0; j < 2 * KSTEPS; ++j) {
                o[b][j][0] *= correction[b][0];
                o[b][j][1] *= correction[b][0];
                o[b][j][2] *= correction[b][1];
                o[b][j][3] *= correction[b][1];
            }
    }

#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) {
        // S tiles 2kk and 2kk+1 hold exactly the A fragment of keys kk*16 .. kk*16+15.
        unsigned p_frag[B][4];
#pragma unroll
        for (int b = 0; b < B; ++b) {
            p_frag[b][0] = pack2<T>(s[b][2 * kk][0], s[b][2 * kk][1]);
            p_frag[b][1] = pack2<T>(s[b][2 * kk][2], s[b][2 * kk][3]);
            p_frag[b][2] = pack2<T>(s[b][2 * kk + 1][0], s[b][2 * kk + 1][1]);
            p_frag[b][3] = pack2<T>(s[b][2 * kk + 1][2], s[b][2 * kk + 1][3]);
        }
#pragma unroll
        for (int d2 = 0; d2 < KSTEPS; ++d2) {
            // Matrices: keys kk*16 + 0..7 / + 8..15 (lanes 8-15, 24-31) x dims d2*16 + 0..7 / + 8..15 (lanes 16-31).
            unsigned v_frag[4];
            ldmatrix_x4_trans(v_frag, v_s + (kk * 16 + lane % 8 + 8 * ((lane / 8) % 2)) * PITCH + d2 * 16 + 8 * (lane / 16));
#pragma unroll
            for (int b = 0; b < B; ++b) {
                mma_m16n8k16<T>(o[b][2 * d2], p_frag[b], v_frag);
                mma_m16n8k16<T>(o[b][2 * d2 + 1], p_frag[b], v_frag + 2);
            }
        }
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(PF_THREADS, PF_CTAS_PER_SM) prefill_attention_kernel(
    const T* __restrict__ q,               // [num_tokens, num_q_heads, D], rows q_stride elements apart
    const T* __restrict__ k_cache,         // [num_blocks, num_kv_heads, block_size, D]
    const T* __restrict__ v_cache,         // same layout
    const int* __restrict__ work,          // int32[num_items, 3]: sequence, first token, token count
    const int* __restrict__ positions,     // int32[num_tokens]
    const int* __restrict__ block_tables,  // int32[num_seqs, max_blocks_per_seq]
    T* __restrict__ out,                   // [num_tokens, num_q_heads, D] (one split); rows of other items untouched
    float* __restrict__ partial_out,       // [splits, num_tokens, num_q_heads, D] (several splits)
    float* __restrict__ partial_max,       // [splits, num_tokens, num_q_heads]: max score x scale (natural log units)
    float* __restrict__ partial_sum,       // [splits, num_tokens, num_q_heads]
    int num_tokens, int num_q_heads, int num_kv_heads, int block_size, int max_blocks_per_seq, long long q_stride,
    float scale_log2,                      // softmax scale * log2(e)
    int split_keys,                        // keys per split, a multiple of PF_KEYS
    int window) {                          // sliding window (0: none)
    static_assert(D % 16 == 0, "head_dim must be a multiple of 16 (the mma k step)");
    constexpr int STAGES = pf_stages<D>();
    constexpr int PITCH = D + PF_PAD;
    constexpr int SUB_KEYS = pf_softmax_keys<D>();
    constexpr int B = PF_WARP_BLOCKS;
    // Shared memory: Q (PF_ROWS x PITCH), then STAGES x (K, V: PF_KEYS x PITCH each), then the cache rows of
    // the tiles in flight, long long rows_s[STAGES][PF_KEYS] (tile it's rows in slot it % STAGES).
    extern __shared__ __align__(16) unsigned char smem[];
    T* const q_s = reinterpret_cast<T*>(smem);
    T* const stages = q_s + PF_ROWS * PITCH;
    long long* const rows_s = reinterpret_cast<long long*>(stages + STAGES * 2 * PF_KEYS * PITCH);

    const int seq = work[3 * blockIdx.x], first_token = work[3 * blockIdx.x + 1], tokens = work[3 * blockIdx.x + 2];
    const int kv_head = blockIdx.y;
    const int group = num_q_heads / num_kv_heads;
    const int rows = tokens * group;   // row r: token first_token + r / group, head kv_head * group + r % group
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;   // this lane's fragment row (and row + 8) and column pair
    const int first_position = positions[first_token];
    const int key_end = positions[first_token + tokens - 1] + 1;
    const int split_tile = blockIdx.z * (split_keys / PF_KEYS);
    const int first_tile = max(split_tile, window_begin(first_position, window) / PF_KEYS);
    const int num_tiles = min((key_end + PF_KEYS - 1) / PF_KEYS, split_tile + split_keys / PF_KEYS) - first_tile;
    // CTA-uniform: this split lies past the run's last key, or before every row's window (the reduce skips it)
    if (num_tiles <= 0) return;
    const int table_start = seq * max_blocks_per_seq;   // an index (the table has < 2^31 entries): a pointer costs 2 registers

    // Block-table entry of key j of tile `it` (threads j < PF_KEYS); -1 past the run's last key. Entries are
    // loaded a tile before their rows are written, so the load's latency hides under a tile's compute.
    const auto table_entry = [&](int it) {
        const int key = (first_tile + it) * PF_KEYS + threadIdx.x;
        return key < key_end ? block_tables[table_start + key / block_size] : -1;
    };
    const auto row_of = [&](int entry, int it) {
        return cache_row(entry, (first_tile + it) * PF_KEYS + threadIdx.x, kv_head, num_kv_heads, block_size);
    };
    const auto stage = [&](int it) { return stages + (it % STAGES) * 2 * PF_KEYS * PITCH; };

    int next_entry = -1;   // table entry of tile it + STAGES, loaded during iteration it - 1
    if (threadIdx.x < PF_KEYS) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) rows_s[s * PF_KEYS + threadIdx.x] = row_of(table_entry(s), s);
        next_entry = table_entry(STAGES);
    }
    for (int i = threadIdx.x; i < PF_ROWS * (D / 8); i += PF_THREADS) {
        const int r = i / (D / 8), c = i % (D / 8);
        const bool present = r < rows;
        const long long src = present ? (first_token + r / group) * q_stride + (long long)(kv_head * group + r % group) * D + c * 8 : 0;
        cp_async_16_zfill(q_s + r * PITCH + c * 8, q + src, present);
    }
    __syncthreads();   // rows_s written
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {   // Q joins tile 0's group; groups past the last tile are empty
        if (s < num_tiles) load_kv_tile<T, D>(k_cache, v_cache, rows_s + s * PF_KEYS, stage(s), stage(s) + PF_KEYS * PITCH);
        cp_async_commit();
    }

    float o[B][D / 8][4];   // O accumulators: block b, n8 tile j of head dims, rows g (0, 1) and g + 8 (2, 3)
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
        for (int j = 0; j < D / 8; ++j) o[b][j][0] = o[b][j][1] = o[b][j][2] = o[b][j][3] = 0.0f;
    float row_max[B][2], row_sum[B][2];   // sum: this lane's part of its row
#pragma unroll
    for (int b = 0; b < B; ++b) {
        row_max[b][0] = row_max[b][1] = negative_infinity();
        row_sum[b][0] = row_sum[b][1] = 0.0f;
    }

    for (int it = 0; it < num_tiles; ++it) {
        const int tile = (first_tile + it) * PF_KEYS;
        cp_async_wait<STAGES - 2>();   // this thread's copies of tile it have landed
        __syncthreads();               // everyone's have, and every warp is done with tile it - 1 (its stage and rows)
        if (it + STAGES - 1 < num_tiles) {   // uniform across the CTA: refill tile it - 1's stage
            T* next = stage(it + STAGES - 1);
            load_kv_tile<T, D>(k_cache, v_cache, rows_s + ((it + STAGES - 1) % STAGES) * PF_KEYS, next, next + PF_KEYS * PITCH);
        }
        cp_async_commit();
        if (threadIdx.x < PF_KEYS) {   // tile it's rows slot now takes tile it + STAGES's (read after the next barrier)
            rows_s[(it % STAGES) * PF_KEYS + threadIdx.x] = row_of(next_entry, it + STAGES);
            next_entry = table_entry(it + STAGES + 1);
        }
        const T* k_s = stage(it);
#pragma unroll 1   // unrolled, ptxas interleaves the halves' loads at D = 128 and spills
        for (int sub = 0; sub < PF_KEYS; sub += SUB_KEYS)
            attend<T, D, SUB_KEYS>(q_s + warp * 32 * PITCH, k_s + sub * PITCH, k_s + (PF_KEYS + sub) * PITCH, tile + sub,
                                   first_position, group, window, scale_log2, o, row_max, row_sum);
    }
    cp_async_wait<0>();   // the trailing (empty) groups

    const bool split = gridDim.z > 1;
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = row_sum[b][h];
            sum += __shfl_xor_sync(FULL_WARP, sum, 1);
            sum += __shfl_xor_sync(FULL_WARP, sum, 2);
            const int r = warp * 32 + b * 16 + g + 8 * h;
            if (r >= rows) continue;
            const long long row = (long long)(first_token + r / group) * num_q_heads + kv_head * group + r % group;
            if (split) {   // unnormalized; a row with no key in this split is never merged (its position is before them)
                const long long prow = (long long)blockIdx.z * num_tokens * num_q_heads + row;
                float* dst = partial_out + prow * D + 2 * t;
#pragma unroll
                for (int j = 0; j < D / 8; ++j)
                    *reinterpret_cast<float2*>(dst + 8 * j) = float2{o[b][j][2 * h], o[b][j][2 * h + 1]};
                if (t == 0) {
                    partial_max[prow] = row_max[b][h] * scale_log2 * 0.6931471805599453f;   // exp2 units to exp's
                    partial_sum[prow] = sum;
                }
            } else {
                const float inv_sum = 1.0f / sum;   // a row's own key is visible to it, so sum > 0
                T* dst = out + row * D + 2 * t;
#pragma unroll
                for (int j = 0; j < D / 8; ++j)
                    *reinterpret_cast<unsigned*>(dst + 8 * j) = pack2<T>(o[b][j][2 * h] * inv_sum, o[b][j][2 * h + 1] * inv_sum);
            }
        }
}
