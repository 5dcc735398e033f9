// Step 3 of 4: flash-decoding (the context split over several warps, then merged), K/V staged by cp.async.
//
// What changes from step 2, and why:
//  - Split-KV. A batch of few sequences has few (sequence, head) warps: too few to keep every SM busy
//    while each walks a long context alone. Grid z now cuts the context into splits of partition_keys
//    keys; each warp runs step 2's online softmax over its split only and writes its unnormalized
//    output with its max m_z and sum l_z. merge_splits_kernel combines them exactly:
//        M = max_z m_z,   out = sum_z e^(m_z - M) acc_z / sum_z e^(m_z - M) l_z.
//    With one split (grid z = 1) the warp writes the output itself.
//  - cp.async. The copy of tile t + 1 is issued before tile t is computed, into the other of two
//    shared-memory stages, so the loads fly while the lanes do arithmetic (double buffering). cp.async
//    copies bytes without registers, so the stages hold T, not float, in 16-byte chunks.
//  - Rows are padded by 16 bytes and lane j reads its key row 16 bytes at a time: the 8 lanes of each
//    quarter-warp then start 4 banks apart and cover all 32 banks.
// head_dim x sizeof(T) must be a multiple of 16 bytes; the host checks it.
#include "vec.cuh"

constexpr int FD_TILE_KEYS = 32;      // one key per lane
constexpr int FD_STAGES = 2;          // tiles in shared memory: one computed, one loading
constexpr int FD_MAX_HEAD_DIM = 128;  // dimensions per lane: at most 4 accumulators

template <typename T>
__global__ void __launch_bounds__(32) flash_decoding_kernel(
    const T* __restrict__ q,               // [num_seqs, num_q_heads, head_dim]: one query token per sequence
    const T* __restrict__ k_cache,         // [num_blocks, num_kv_heads, block_size, head_dim]
    const T* __restrict__ v_cache,         // same layout
    const int* __restrict__ block_tables,  // int32[num_seqs, max_blocks_per_seq]
    const int* __restrict__ context_lens,  // int32[num_seqs]
    T* __restrict__ out,                   // [num_seqs, num_q_heads, head_dim]            (one split)
    float* __restrict__ partial_out,       // [num_seqs, num_q_heads, splits, head_dim]    (several)
    float* __restrict__ partial_max,       // [num_seqs, num_q_heads, splits]
    float* __restrict__ partial_sum,       // [num_seqs, num_q_heads, splits]
    int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, float scale,
    int partition_keys) {                  // keys per split, a multiple of FD_TILE_KEYS
    constexpr int VEC = 16 / sizeof(T);   // elements per 16-byte chunk
    constexpr int DIMS_PER_LANE = FD_MAX_HEAD_DIM / 32;
    extern __shared__ __align__(16) unsigned char smem[];
    const int pitch = head_dim + VEC;     // elements per staged row: 16 bytes of padding
    T* stages = reinterpret_cast<T*>(smem);   // T[STAGES][2][TILE_KEYS][pitch]: K, V of each stage
    float* q_s = reinterpret_cast<float*>(stages + FD_STAGES * 2 * FD_TILE_KEYS * pitch);   // float[head_dim]

    const int seq = blockIdx.x, head = blockIdx.y, split = blockIdx.z, lane = threadIdx.x;
    const int kv_head = head / (num_q_heads / num_kv_heads);
    const int len = context_lens[seq];
    const int key_begin = split * partition_keys, key_end = min(len, key_begin + partition_keys);
    if (key_begin >= key_end) return;   // a split past this sequence's end (the merge skips it)
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const long long q_row = ((long long)seq * num_q_heads + head) * head_dim;
    for (int d = lane; d < head_dim; d += 32) q_s[d] = to_float(q[q_row + d]) * scale;

    // Issues the copies of the tile starting at key `tile` into stage `stage`: K rows, then V rows.
    const int chunks = head_dim / VEC;
    auto issue_tile = [&](int tile, int stage) {
        T* k_dst = stages + stage * 2 * FD_TILE_KEYS * pitch;
        T* v_dst = k_dst + FD_TILE_KEYS * pitch;
        const int n = min(FD_TILE_KEYS, key_end - tile);
        for (int i = lane; i < n * chunks; i += 32) {
            const int j = i / chunks, c = i % chunks, key = tile + j;
            const long long block = table[key / block_size];
            const long long row = (block * num_kv_heads + kv_head) * block_size + key % block_size;
            cp_async_16(k_dst + j * pitch + c * VEC, k_cache + row * head_dim + c * VEC);
            cp_async_16(v_dst + j * pitch + c * VEC, v_cache + row * head_dim + c * VEC);
        }
        cp_async_commit();
    };

    float run_max = negative_infinity(), run_sum = 0.0f, acc[DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] = 0.0f;

    issue_tile(key_begin, 0);
    for (int tile = key_begin, t = 0; tile < key_end; tile += FD_TILE_KEYS, ++t) {
        const int n = min(FD_TILE_KEYS, key_end - tile);
        if (tile + FD_TILE_KEYS < key_end) issue_tile(tile + FD_TILE_KEYS, (t + 1) % FD_STAGES);
        else cp_async_commit();   // an empty group, so that the wait below always means "tile t"
        cp_async_wait<1>();       // all but the newest group landed: this lane's copies of tile t
        __syncwarp();             // ... and every lane's (and q_s)
        const T* k_tile = stages + (t % FD_STAGES) * 2 * FD_TILE_KEYS * pitch;
        const T* v_tile = k_tile + FD_TILE_KEYS * pitch;

        float score = negative_infinity();
        if (lane < n) {
            score = 0.0f;
            for (int c = 0; c < chunks; ++c) {
                const Vec<T, VEC> k = load_vec<VEC>(k_tile + lane * pitch + c * VEC);
#pragma unroll
                for (int e = 0; e < VEC; ++e) score += q_s[c * VEC + e] * to_float(k.v[e]);
            }
        }
        const float new_max = fmaxf(run_max, warp_max(score));
        const float p = expf(score - new_max);
        const float correction = expf(run_max - new_max);
        run_sum = run_sum * correction + warp_sum(p);
        run_max = new_max;
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] *= correction;
        for (int j = 0; j < n; ++j) {
            const float p_j = __shfl_sync(FULL_WARP, p, j);
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i)
                if (lane + 32 * i < head_dim) acc[i] += p_j * to_float(v_tile[j * pitch + lane + 32 * i]);
        }
        __syncwarp();   // every lane done with this stage before the next iteration's copies refill it
    }
    cp_async_wait<0>();   // only the trailing empty group is left

    if (gridDim.z == 1) {
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i)
            if (lane + 32 * i < head_dim) out[q_row + lane + 32 * i] = from_float<T>(acc[i] / run_sum);
        return;
    }
    const long long slot = ((long long)seq * num_q_heads + head) * gridDim.z + split;
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i)
        if (lane + 32 * i < head_dim) partial_out[slot * head_dim + lane + 32 * i] = acc[i];
    if (lane == 0) {
        partial_max[slot] = run_max;
        partial_sum[slot] = run_sum;
    }
}

// One block per (sequence, query head): merges the splits that hold keys, the first
// ceil(len / partition_keys) of them.
template <typename T>
__global__ void merge_splits_kernel(
    const float* __restrict__ partial_out,   // [num_seqs, num_q_heads, splits, head_dim]
    const float* __restrict__ partial_max,   // [num_seqs, num_q_heads, splits]
    const float* __restrict__ partial_sum,   // [num_seqs, num_q_heads, splits]
    const int* __restrict__ context_lens,    // int32[num_seqs]
    T* __restrict__ out,                     // [num_seqs, num_q_heads, head_dim]
    int num_q_heads, int head_dim, int splits, int partition_keys) {
    const int seq = blockIdx.x, head = blockIdx.y;
    const long long first = ((long long)seq * num_q_heads + head) * splits;
    const int used = (context_lens[seq] + partition_keys - 1) / partition_keys;
    float global_max = negative_infinity();
    for (int z = 0; z < used; ++z) global_max = fmaxf(global_max, partial_max[first + z]);
    float denominator = 0.0f;
    for (int z = 0; z < used; ++z)
        denominator += expf(partial_max[first + z] - global_max) * partial_sum[first + z];
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float numerator = 0.0f;
        for (int z = 0; z < used; ++z)
            numerator += expf(partial_max[first + z] - global_max) * partial_out[(first + z) * head_dim + d];
        out[((long long)seq * num_q_heads + head) * head_dim + d] = from_float<T>(numerator / denominator);
    }
}
