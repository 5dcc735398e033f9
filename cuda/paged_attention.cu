// Paged attention over a mixed batch (see "The batch contract" in docs/architecture.md).
//
// A batch holds any mix of prefill chunks (many query tokens per sequence) and decodes (one). Query
// token at position p of sequence s attends to keys 0..p of s, which live in the paged cache: key j
// is at block block_tables[s][j / block_size], offset j % block_size. The new keys of this step are
// already stored (store_kv runs first), so "causal within the chunk" and "full over the history" are
// the same rule: key position <= query position. A sliding window (window > 0) also hides the keys at or
// before p - window; the blocks of those may be freed (block-table entries -1), so they are never read.
//
// Work decomposition: grid = (work items, KV heads, partitions).
//  - A work item is a run of up to `tile_tokens` consecutive query tokens of one sequence; the host
//    builds the list, so prefills and decodes are just items of different lengths.
//  - GQA without copying K/V: a CTA serves every query head that shares its KV head, so each key
//    and value is read from memory once for all G = Hq / Hk heads. Rows = tokens x G <= MAX_ROWS.
//  - Long contexts are split into partitions of `partition_size` keys (flash-decoding): each CTA
//    keeps an online softmax (running max m, running sum l, unnormalized accumulator) over its
//    partition and writes (acc, m, l); paged_attention_reduce_kernel merges the partitions. With one
//    partition the CTA normalizes and writes the output directly.
// Inside a CTA: keys are processed in tiles of `key_tile` keys (<= 32, a multiple of 4) staged in
// shared memory. Each warp owns up to ROWS_PER_WARP rows; lane j scores key j of the tile, then lanes
// switch to owning head dimensions (d = lane, lane + 32, ...) to accumulate p * V. Math is float
// whatever T is.
#include "common.cuh"

constexpr int PA_WARPS = 4;
constexpr int PA_THREADS = PA_WARPS * 32;
constexpr int PA_ROWS_PER_WARP = 4;
constexpr int PA_MAX_ROWS = PA_WARPS * PA_ROWS_PER_WARP;    // 16 (query token, head) rows per CTA
constexpr int PA_MAX_HEAD_DIM = 256;
constexpr int PA_DIMS_PER_LANE = PA_MAX_HEAD_DIM / 32;
// CTAs per SM that ptxas must fit (<= 72 registers). With PA_THREADS alone ptxas may trim registers to reach
// the next CTA count on its own, and did: 64 (sm_80) / 72 (sm_90) with the row positions spilled under NVRTC.
constexpr int PA_MIN_CTAS_PER_SM = 7;

// Shared memory, in this order (cuda_ops._attention_tiling adds up its size; the host reads the constants
// above from this file, so they are written only here):
//   q_s  float[MAX_ROWS][head_dim]      queries of this CTA, pre-multiplied by the softmax scale
//   p_s  float[MAX_ROWS][key_tile]      probabilities of the current tile, per row
//   k_s  T[key_tile][head_dim + pad]    keys of the tile; the pad shifts rows across smem banks so
//                                       32 lanes reading 32 different keys do not conflict
//   v_s  T[key_tile][head_dim]          values of the tile
template <typename T>
__device__ __forceinline__ int key_pitch(int head_dim) { return head_dim + (int)(4 / sizeof(T)); }

// Copies keys tile .. tile + n - 1 of one KV head from the paged cache into k_s / v_s. Each key's row
// is head_dim contiguous elements, so when a row is a whole number of 16-byte chunks the copy moves one
// chunk per thread and iteration (8 bf16 values): fewer instructions, and the block/offset arithmetic is
// paid once per chunk instead of once per element. v_s rows are 16-byte aligned (the host picks key_tile
// as a multiple of 4); padded k_s rows only 4-byte aligned, so keys are stored as four 32-bit words.
template <typename T>
__device__ __forceinline__ void stage_kv_tile(const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                              const int* __restrict__ table, T* k_s, T* v_s, int tile, int n,
                                              int kv_head, int num_kv_heads, int head_dim, int block_size,
                                              int k_pitch) {
    constexpr int VEC = 16 / sizeof(T);   // elements per 16-byte chunk
    if (head_dim % VEC == 0) {
        const int chunks = head_dim / VEC;
        for (int i = threadIdx.x; i < n * chunks; i += blockDim.x) {
            const int j = i / chunks, c = i % chunks;
            const int key = tile + j;
            const long long block = table[key / block_size];
            const long long row = ((block * num_kv_heads + kv_head) * block_size + key % block_size) * head_dim;
            const uint4 k = reinterpret_cast<const uint4*>(k_cache + row)[c];
            reinterpret_cast<uint4*>(v_s + j * head_dim)[c] = reinterpret_cast<const uint4*>(v_cache + row)[c];
            unsigned* k_dst = reinterpret_cast<unsigned*>(k_s + j * k_pitch + c * VEC);
            k_dst[0] = k.x; k_dst[1] = k.y; k_dst[2] = k.z; k_dst[3] = k.w;
        }
    } else {
        for (int i = threadIdx.x; i < n * head_dim; i += blockDim.x) {
            const int j = i / head_dim, d = i % head_dim;
            const int key = tile + j;
            const long long block = table[key / block_size];
            const long long src = ((block * num_kv_heads + kv_head) * block_size + key % block_size) * head_dim + d;
            k_s[j * k_pitch + d] = k_cache[src];
            v_s[j * head_dim + d] = v_cache[src];
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(PA_THREADS, PA_MIN_CTAS_PER_SM) paged_attention_kernel(
    const T* __restrict__ q,               // [num_tokens, num_q_heads, head_dim], rows q_stride apart
    const T* __restrict__ k_cache,         // [num_blocks, num_kv_heads, block_size, head_dim]
    const T* __restrict__ v_cache,         // same layout
    const int* __restrict__ work,          // int32[num_items, 3]: sequence, first token, token count
    const int* __restrict__ positions,     // int32[num_tokens]
    const int* __restrict__ block_tables,  // int32[num_seqs, max_blocks_per_seq]
    T* __restrict__ out,                   // [num_tokens, num_q_heads, head_dim]      (one partition)
    float* __restrict__ partial_out,       // [partitions, num_tokens, num_q_heads, head_dim] (several)
    float* __restrict__ partial_max,       // [partitions, num_tokens, num_q_heads]
    float* __restrict__ partial_sum,       // [partitions, num_tokens, num_q_heads]
    int num_tokens, int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks_per_seq,
    long long q_stride, float scale, int partition_size, int key_tile,
    int span) {   // keys a row sees back from its own: its sliding window, or 2^31 - 1 (all of them)
    extern __shared__ __align__(16) unsigned char smem[];
    float* q_s = reinterpret_cast<float*>(smem);
    float* p_s = q_s + PA_MAX_ROWS * head_dim;
    T* k_s = reinterpret_cast<T*>(p_s + PA_MAX_ROWS * key_tile);
    const int k_pitch = key_pitch<T>(head_dim);
    T* v_s = k_s + key_tile * k_pitch;

    const int seq = work[3 * blockIdx.x], first_token = work[3 * blockIdx.x + 1], tokens = work[3 * blockIdx.x + 2];
    const int kv_head = blockIdx.y, partition = blockIdx.z;
    const int group = num_q_heads / num_kv_heads;
    const int rows = tokens * group;     // row r: token first_token + r / group, head kv_head * group + r % group
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    for (int i = threadIdx.x; i < rows * head_dim; i += blockDim.x) {
        const int r = i / head_dim, d = i % head_dim;
        const long long token = first_token + r / group;
        const int head = kv_head * group + r % group;
        q_s[i] = to_float(q[token * q_stride + (long long)head * head_dim + d]) * scale;
    }

    // Keys this CTA reads: its partition, cut at the last query's position (causality) and, with a window,
    // begun at the first query's first visible key.
    const int last_position = positions[first_token + tokens - 1];
    const int key_begin = max(partition * partition_size, positions[first_token] - span + 1);
    const int key_end = min((partition + 1) * partition_size, last_position + 1);

    float row_max[PA_ROWS_PER_WARP], row_sum[PA_ROWS_PER_WARP], acc[PA_ROWS_PER_WARP][PA_DIMS_PER_LANE];
#pragma unroll
    for (int w = 0; w < PA_ROWS_PER_WARP; ++w) {
        row_max[w] = negative_infinity();
        row_sum[w] = 0.0f;
#pragma unroll
        for (int i = 0; i < PA_DIMS_PER_LANE; ++i) acc[w][i] = 0.0f;
    }
    // Lane w holds the position of the warp's row w (-1: no row), shuffled out per row and tile: one register
    // instead of four held through the tile loop.
    const int lane_row = warp + lane * PA_WARPS;
    const int row_positions = lane < PA_ROWS_PER_WARP && lane_row < rows ? positions[first_token + lane_row / group] : -1;
    const int lane_dims = head_dim - lane;   // this lane's dimensions d = lane + 32 i are those with 32 i < lane_dims
    // Key j is visible to a row at position p when 0 <= p - j < span (causal, and within a window): one
    // unsigned compare against the parameter (a row with no position, -1, sees none). A register more held
    // through the tile loop made ptxas spill at sm_90.
    __syncthreads();   // q_s complete

    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    for (int tile = key_begin; tile < key_end; tile += key_tile) {
        const int n = min(key_tile, key_end - tile);
        stage_kv_tile(k_cache, v_cache, table, k_s, v_s, tile, n, kv_head, num_kv_heads, head_dim, block_size, k_pitch);
        __syncthreads();   // tile staged

#pragma unroll
        for (int w = 0; w < PA_ROWS_PER_WARP; ++w) {
            const int r = warp + w * PA_WARPS;
            if (r >= rows) continue;   // uniform across the warp, so the shuffles below see all lanes
            const int row_position = __shfl_sync(FULL_WARP, row_positions, w);
            float score = negative_infinity();
            if (lane < n && (unsigned)(row_position - tile - lane) < (unsigned)span) {
                const float* qr = q_s + r * head_dim;
                const T* kr = k_s + lane * k_pitch;
                float dot = 0.0f;
                // Not unrolled: inside the unrolled row and dimension loops, unrolling these inner loops
                // multiplied the code eightfold, spilled registers and took NVRTC 20 s per architecture.
#pragma unroll 1
                for (int d = 0; d < head_dim; ++d) dot += qr[d] * to_float(kr[d]);
                score = dot;
            }
            const float new_max = fmaxf(row_max[w], warp_max(score));
            if (new_max == negative_infinity()) continue;   // no visible key yet for this row
            // Online softmax: rescale what was accumulated under the old max.
            const float correction = expf(row_max[w] - new_max);
            const float p = score == negative_infinity() ? 0.0f : expf(score - new_max);
            row_sum[w] = row_sum[w] * correction + warp_sum(p);
            row_max[w] = new_max;
            if (lane < key_tile) p_s[r * key_tile + lane] = p;
            __syncwarp();   // p_s row visible to all lanes
#pragma unroll
            for (int i = 0; i < PA_DIMS_PER_LANE; ++i) acc[w][i] *= correction;
            // Keys outer, dimensions inner: p_j is loaded once for all of the lane's dimensions, and key j's values
            // sit at fixed offsets 32 i from one pointer. Each acc still adds p_j v_j in key order.
            const float* pr = p_s + r * key_tile;
            const T* vr = v_s + lane;
#pragma unroll 1
            for (int j = 0; j < n; ++j, vr += head_dim) {
                const float pj = pr[j];
#pragma unroll
                for (int i = 0; i < PA_DIMS_PER_LANE; ++i)
                    if (32 * i < lane_dims) acc[w][i] += pj * to_float(vr[32 * i]);
            }
            __syncwarp();   // all lanes done reading p_s before the next row or tile writes it
        }
        __syncthreads();   // every warp done with k_s/v_s before the next tile overwrites them
    }

#pragma unroll
    for (int w = 0; w < PA_ROWS_PER_WARP; ++w) {
        const int r = warp + w * PA_WARPS;
        if (r >= rows) continue;
        const long long token = first_token + r / group;
        const int head = kv_head * group + r % group;
        const long long row = token * num_q_heads + head;
        if (gridDim.z == 1) {
            const float inv_sum = 1.0f / row_sum[w];   // a row's own key is always visible: row_sum > 0
#pragma unroll
            for (int i = 0; i < PA_DIMS_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                if (d < head_dim) out[row * head_dim + d] = from_float<T>(acc[w][i] * inv_sum);
            }
        } else {
            const long long prow = (long long)partition * num_tokens * num_q_heads + row;
#pragma unroll
            for (int i = 0; i < PA_DIMS_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                if (d < head_dim) partial_out[prow * head_dim + d] = acc[w][i];
            }
            if (lane == 0) {
                partial_max[prow] = row_max[w];
                partial_sum[prow] = row_sum[w];
            }
        }
    }
}

// Merges the partitions of each (token, head) listed in `tokens`: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p.
// A token at position p has keys in partitions window_begin(p) / partition_size .. p / partition_size, all of
// them written (those before its window may not be).
template <typename T>
__global__ void paged_attention_reduce_kernel(const float* __restrict__ partial_out,
                                              const float* __restrict__ partial_max,
                                              const float* __restrict__ partial_sum,
                                              const int* __restrict__ positions,
                                              const int* __restrict__ tokens,   // int32[grid x]: tokens to merge
                                              T* __restrict__ out, int num_tokens, int num_q_heads, int head_dim,
                                              int partition_size, int window) {
    const int token = tokens[blockIdx.x];
    const long long row = (long long)token * num_q_heads + blockIdx.y;
    const long long partition_step = (long long)num_tokens * num_q_heads;
    const int first = window_begin(positions[token], window) / partition_size;
    const int partitions = positions[token] / partition_size + 1;
    float global_max = negative_infinity();
    for (int p = first; p < partitions; ++p) global_max = fmaxf(global_max, partial_max[p * partition_step + row]);
    float denominator = 0.0f;
    for (int p = first; p < partitions; ++p)
        denominator += expf(partial_max[p * partition_step + row] - global_max) * partial_sum[p * partition_step + row];
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float numerator = 0.0f;
        for (int p = first; p < partitions; ++p)
            numerator += expf(partial_max[p * partition_step + row] - global_max) *
                         partial_out[(p * partition_step + row) * head_dim + d];
        out[row * head_dim + d] = from_float<T>(numerator / denominator);
    }
}
