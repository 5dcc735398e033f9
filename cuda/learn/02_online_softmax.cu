// Step 2 of 4: one pass over the keys in tiles, an online softmax, warp reductions.
//
// What changes from step 1, and why:
//  - One warp per (sequence, query head), keys in tiles of 32: lane j scores key j of the tile, and the
//    tile's max and sum come from warp_max / warp_sum (register shuffles, common.cuh), so no lane waits
//    for another to loop over the context.
//  - Online softmax: the warp keeps a running max m, a running sum l and an unnormalized output; when a
//    tile raises the max, what was summed so far is rescaled by exp(m_old - m_new). The scores of the
//    whole context are never stored, so the context is no longer bounded by shared memory, and each key
//    and value is read once.
//  - Each tile's K and V rows are first copied into shared memory, lanes reading consecutive elements of
//    a row (coalesced), and converted to float once. Lane j then reads its key row from there: straight
//    from global memory that would be 32 rows far apart per load. K rows are one float longer than
//    head_dim, so the 32 lanes reading element d of 32 rows hit 32 different banks.
//  - For p V the lanes switch roles: lane l owns dimensions l, l + 32, ... and adds p_j v_j over the
//    tile, p_j broadcast from lane j by a shuffle.
#include "common.cuh"

constexpr int OS_TILE_KEYS = 32;      // one key per lane
constexpr int OS_MAX_HEAD_DIM = 128;  // dimensions per lane: at most 4 accumulators

template <typename T>
__global__ void __launch_bounds__(32) online_softmax_attention_kernel(
    const T* __restrict__ q,               // [num_seqs, num_q_heads, head_dim]: one query token per sequence
    const T* __restrict__ k_cache,         // [num_blocks, num_kv_heads, block_size, head_dim]
    const T* __restrict__ v_cache,         // same layout
    const int* __restrict__ block_tables,  // int32[num_seqs, max_blocks_per_seq]
    const int* __restrict__ context_lens,  // int32[num_seqs]
    T* __restrict__ out,                   // [num_seqs, num_q_heads, head_dim]
    int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, float scale) {
    constexpr int DIMS_PER_LANE = OS_MAX_HEAD_DIM / 32;
    extern __shared__ __align__(16) unsigned char smem[];
    const int k_pitch = head_dim + 1;
    float* k_s = reinterpret_cast<float*>(smem);    // float[TILE_KEYS][head_dim + 1]
    float* v_s = k_s + OS_TILE_KEYS * k_pitch;      // float[TILE_KEYS][head_dim]
    float* q_s = v_s + OS_TILE_KEYS * head_dim;     // float[head_dim], pre-multiplied by the scale

    const int seq = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
    const int kv_head = head / (num_q_heads / num_kv_heads);
    const int len = context_lens[seq];
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const long long q_row = ((long long)seq * num_q_heads + head) * head_dim;
    for (int d = lane; d < head_dim; d += 32) q_s[d] = to_float(q[q_row + d]) * scale;

    float run_max = negative_infinity(), run_sum = 0.0f, acc[DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] = 0.0f;

    for (int tile = 0; tile < len; tile += OS_TILE_KEYS) {
        const int n = min(OS_TILE_KEYS, len - tile);
        __syncwarp();   // every lane done with the previous tile
        for (int j = 0; j < n; ++j) {
            const int key = tile + j;
            const long long block = table[key / block_size];
            const long long row = (block * num_kv_heads + kv_head) * block_size + key % block_size;
            for (int d = lane; d < head_dim; d += 32) {
                k_s[j * k_pitch + d] = to_float(k_cache[row * head_dim + d]);
                v_s[j * head_dim + d] = to_float(v_cache[row * head_dim + d]);
            }
        }
        __syncwarp();   // the tile (and, the first time, q_s) visible to every lane

        float score = negative_infinity();   // lanes past the tile's end: probability exp(-inf) = 0
        if (lane < n) {
            score = 0.0f;
            for (int d = 0; d < head_dim; ++d) score += q_s[d] * k_s[lane * k_pitch + d];
        }
        const float new_max = fmaxf(run_max, warp_max(score));   // finite: the tile's first key is valid
        const float p = expf(score - new_max);
        const float correction = expf(run_max - new_max);        // 0 at the first tile (run_max = -inf)
        run_sum = run_sum * correction + warp_sum(p);
        run_max = new_max;
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] *= correction;
        for (int j = 0; j < n; ++j) {
            const float p_j = __shfl_sync(FULL_WARP, p, j);
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i)
                if (lane + 32 * i < head_dim) acc[i] += p_j * v_s[j * head_dim + lane + 32 * i];
        }
    }

#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i)
        if (lane + 32 * i < head_dim) out[q_row + lane + 32 * i] = from_float<T>(acc[i] / run_sum);
}
