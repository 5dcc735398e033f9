// Decode attention: one query token per sequence over the paged KV cache (flash-decoding), shaped to be
// bound by memory bandwidth. Prefill chunks (query runs longer than one token) go elsewhere.
//
// Work: grid = (work items, KV heads x head chunks). A work item is split s of the S splits of one decode
// row; the host fixes S per row (backends/decode_plan.py: from the step's lengths eagerly, the same for every
// row of a CUDA graph's batch-size bucket) and the key range is derived here, on the device, from the row's
// context length: split s covers keys [s P, (s + 1) P) of the row's `len`, P = split_length(len, S). So a
// graph's fixed grid follows each step's real lengths, and the splits past a row's end exit at once. With a
// sliding window (window > 0) the row's keys are only its last `window` ones, `span` keys from `first`, which
// the splits cut instead (the blocks before them may be freed, block-table entries -1: never read).
// A row that uses one split writes its output directly; a row that uses several writes (unnormalized
// accumulator, max, sum) per split into its partial slots and decode_attention_reduce_kernel merges them.
//
// A split longer than DA_SEGMENT_KEYS runs as consecutive segments, each staging its own block-table
// entries, so shared memory does not grow with the context (a bucket's splits may be max_model_len / S long).
//
// A CTA serves up to GROUP_TILE query heads that share one KV head (GQA), so each K and V byte is
// loaded once for all of them. Inside the CTA:
//  - K/V stream through DA_STAGES shared-memory stages of `tile_keys<T>()` keys with cp.async: while
//    one tile is computed, the next DA_STAGES - 1 are in flight (16-byte copies that bypass L1).
//  - Thread mapping, the same for copying and computing: a group of LANES (a power of two >= the
//    16-byte chunks per key row, at most 32; a template parameter, so passes and shuffles unroll)
//    threads owns one key per pass, lane l owning chunks l and l + LANES of the row. A thread therefore reads back only the chunks it copied itself.
//  - The split's block-table entries are read once into shared memory; a copy finds its block with a
//    shift and a mask (block sizes are powers of two), no division.
//  - Q: the thread's chunks of its heads live in registers, pre-scaled. Scores: per-key partial dots,
//    summed over the key's lanes with shuffles that also transpose the heads across the lanes. Softmax per tile: warp w owns heads w, w + 4 (running
//    max and sum in registers). P.V: 16-byte V chunks times a probability per head, fp32 accumulators
//    per (head, chunk element); at the end, summed over the keys' lanes and the warps.
#include "common.cuh"

constexpr int DA_WARPS = 4;
constexpr int DA_THREADS = DA_WARPS * 32;
constexpr int DA_STAGES = 3;            // tiles in shared memory: one being computed, two loading
// Elements of a key row per lane: one 16-byte chunk of a 16-bit type or two of fp32. 32 lanes x 8 elements
// bound head_dim to 256 (checked on the host, decode_plan.supports).
constexpr int DA_LANE_ELEMENTS = 8;

// Keys per tile: one stage (K and V) is at most 32 KiB at head_dim 256.
constexpr int DA_TILE_KEYS_16BIT = 32;
constexpr int DA_TILE_KEYS_FLOAT = 16;
// Split lengths: whole tiles, at least DA_MIN_SPLIT_KEYS (below that the merge costs more than the parallelism
// gains). A CTA stages the block-table entries of DA_SEGMENT_KEYS keys (whole tiles) at a time.
constexpr int DA_SPLIT_ALIGN = 32;
constexpr int DA_MIN_SPLIT_KEYS = 64;
constexpr int DA_SEGMENT_KEYS = 2048;
template <typename T> __device__ __forceinline__ constexpr int tile_keys() {
    return sizeof(T) == 4 ? DA_TILE_KEYS_FLOAT : DA_TILE_KEYS_16BIT;
}

// Keys per split when a row of `len` keys is cut into `splits`; the row uses ceil(len / it) of them (the
// host mirrors this: decode_plan.split_length). Both kernels derive a row's splits from it.
__device__ __forceinline__ int split_length(int len, int splits) {
    const int even = (len + splits - 1) / splits;
    return max(DA_MIN_SPLIT_KEYS, (even + DA_SPLIT_ALIGN - 1) / DA_SPLIT_ALIGN * DA_SPLIT_ALIGN);
}

// 16 bytes of T as floats (8 for 16-bit types, 4 for float), from four 32-bit words: the chunk stays one
// 128-bit shared-memory load (element-wise reads of a reinterpreted T array became eight 16-bit loads).
__device__ __forceinline__ void unpack_word(unsigned w, float* out, float) { out[0] = __uint_as_float(w); }
__device__ __forceinline__ void unpack_word(unsigned w, float* out, __nv_bfloat16) {
    out[0] = __uint_as_float(w << 16);
    out[1] = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack_word(unsigned w, float* out, __half) {
    out[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    out[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}
// Sums each of the G partial dot products over the LANES (>= G) lanes of a key and hands each total to
// store(head, total) once. The sums are transposed on the way (each exchange sends half of the values a
// lane still holds): G - 1 + log2(LANES / G) shuffles instead of G log2(LANES).
template <int LANES, int G, typename Store>
__device__ __forceinline__ void reduce_over_key_lanes(float (&dot)[G], int lane_chunk, Store store) {
    static_assert(LANES >= G, "one head per group of lanes");
#pragma unroll
    for (int n = G / 2, offset = LANES / 2; n >= 1; n /= 2, offset /= 2) {
        const bool upper = lane_chunk & offset;
#pragma unroll
        for (int i = 0; i < n; ++i) {
            const float send = upper ? dot[i] : dot[i + n];
            const float keep = upper ? dot[i + n] : dot[i];
            dot[i] = keep + __shfl_xor_sync(FULL_WARP, send, offset);
        }
    }
    // Lane l now holds a partial of head l / (LANES / G); the lanes of one head finish the sum.
    constexpr int LANES_PER_HEAD = LANES / G;
#pragma unroll
    for (int offset = LANES_PER_HEAD / 2; offset > 0; offset /= 2) dot[0] += __shfl_xor_sync(FULL_WARP, dot[0], offset);
    if (lane_chunk % LANES_PER_HEAD == 0) store(lane_chunk / LANES_PER_HEAD, dot[0]);
}

template <typename T>
__device__ __forceinline__ void unpack16(const uint4& raw, float* out) {
    constexpr int PER_WORD = 4 / sizeof(T);
    unpack_word(raw.x, out, T());
    unpack_word(raw.y, out + PER_WORD, T());
    unpack_word(raw.z, out + 2 * PER_WORD, T());
    unpack_word(raw.w, out + 3 * PER_WORD, T());
}

// GROUP_TILE (4 or 8): query heads per CTA, a compile-time bound so that Q and the accumulators stay in
// registers (8 heads cost about 180 registers, 4 about 100); a larger GQA group takes several CTAs.
// LANES (8, 16 or 32): threads per key row, from head_dim and T (decode_plan.key_lanes).
// Launch bounds: 4 resident CTAs per SM for 4 heads (at most 128 registers); 2 for 8 heads (ptxas would
// otherwise aim at 3 and spill).
template <typename T, int GROUP_TILE, int LANES>
__global__ void __launch_bounds__(DA_THREADS, GROUP_TILE == 4 ? 4 : 2) decode_attention_kernel(
    const T* __restrict__ q,               // [num_tokens, num_q_heads, head_dim], rows q_stride apart
    const T* __restrict__ k_cache,         // [num_blocks, num_kv_heads, block_size, head_dim]
    const T* __restrict__ v_cache,         // same layout
    const int* __restrict__ items,         // int32[W, 5]: token, sequence, split, splits, partial slot (-1: none)
    const int* __restrict__ block_tables,  // int32[num_seqs, max_blocks_per_seq]
    const int* __restrict__ context_lens,  // int32[num_seqs]: keys of each sequence (gives its key ranges)
    T* __restrict__ out,                   // [num_tokens, num_q_heads, head_dim]
    float* __restrict__ partial_out,       // [slots, num_q_heads, head_dim]
    float* __restrict__ partial_max,       // [slots, num_q_heads]
    float* __restrict__ partial_sum,       // [slots, num_q_heads]
    int num_q_heads, int num_kv_heads, int head_dim, int log2_block_size, int max_blocks_per_seq,
    long long q_stride, float scale, int table_capacity, int window) {
    constexpr int VEC = 16 / (int)sizeof(T);            // elements per 16-byte chunk
    constexpr int CHUNKS_PER_LANE = DA_LANE_ELEMENTS / VEC;
    constexpr int TK = tile_keys<T>();
    extern __shared__ __align__(16) unsigned char smem[];
    T* stages = reinterpret_cast<T*>(smem);                                     // [STAGES][2][TK][head_dim]
    float* scores = reinterpret_cast<float*>(stages + DA_STAGES * 2 * TK * head_dim);   // [GROUP_TILE][TK]
    float* correction = scores + GROUP_TILE * TK;                             // [GROUP_TILE]
    float* row_sum_s = correction + GROUP_TILE;                               // [GROUP_TILE]
    int* table_s = reinterpret_cast<int*>(row_sum_s + GROUP_TILE);           // [table_capacity]

    const int* item = items + 5 * blockIdx.x;
    const int token = item[0], seq = item[1], split = item[2], len = context_lens[seq];
    const int first = window_begin(len - 1, window), span = len - first;
    const int split_keys = split_length(span, item[3]);
    const int key_begin = first + split * split_keys, key_end = min(len, key_begin + split_keys);
    const bool direct = span <= split_keys;   // the row's only used split: normalize and write the output
    const int slot = item[4];
    const int group = num_q_heads / num_kv_heads;
    const int head_chunks = (group + GROUP_TILE - 1) / GROUP_TILE;
    const int kv_head = blockIdx.y / head_chunks;
    const int first_head = kv_head * group + (blockIdx.y % head_chunks) * GROUP_TILE;
    const int heads = min(GROUP_TILE, kv_head * group + group - first_head);
    if (key_begin >= key_end) return;   // a split past the row's end (whole CTA alike, before any barrier)
    const int block_size = 1 << log2_block_size;

    const int chunks = head_dim / VEC;                  // 16-byte chunks per key row
    constexpr int lanes = LANES;                        // chunks <= LANES * CHUNKS_PER_LANE (host-checked)
    constexpr int keys_per_pass = DA_THREADS / lanes;
    constexpr int passes = (TK + keys_per_pass - 1) / keys_per_pass;
    const int key_slot = threadIdx.x / lanes, lane_chunk = threadIdx.x % lanes;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    // Stages the block-table entries of the segment seg_begin .. seg_end - 1.
    int seg_begin = key_begin, seg_end = min(key_end, key_begin + DA_SEGMENT_KEYS);
    auto stage_table = [&]() {
        const int first_block = seg_begin >> log2_block_size;
        const int table_len = ((seg_end - 1) >> log2_block_size) - first_block + 1;
        const int* table = block_tables + (long long)seq * max_blocks_per_seq + first_block;
        for (int i = threadIdx.x; i < table_len && i < table_capacity; i += DA_THREADS) table_s[i] = table[i];
    };
    stage_table();   // the first segment's entries load while Q does

    // Query chunks of this thread, pre-multiplied by the softmax scale; zeros where it owns no chunk.
    float q_reg[GROUP_TILE][DA_LANE_ELEMENTS];
#pragma unroll
    for (int h = 0; h < GROUP_TILE; ++h) {
#pragma unroll
        for (int cc = 0; cc < CHUNKS_PER_LANE; ++cc) {
            const int c = lane_chunk + cc * lanes;
            float v[VEC];
            if (h < heads && c < chunks) {
                const uint4 raw = *reinterpret_cast<const uint4*>(q + token * q_stride + (long long)(first_head + h) * head_dim + c * VEC);
                unpack16<T>(raw, v);
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) v[e] = 0.0f;
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) q_reg[h][cc * VEC + e] = v[e] * scale;
        }
    }

    // Copies tile `t` of the segment starting at seg_begin (keys seg_begin + t * TK ..) into its stage; keys past
    // seg_end become zeros. A key's cache row is a 32-bit index (the host checks blocks x Hk x block_size <
    // 2^31), one multiply to bytes.
    const T* k_lane = k_cache + lane_chunk * VEC;
    const T* v_lane = v_cache + lane_chunk * VEC;
    auto issue_tile = [&](int t) {
        T* k_dst = stages + (t % DA_STAGES) * 2 * TK * head_dim + lane_chunk * VEC;
        T* v_dst = k_dst + TK * head_dim;
        const int first_rel = (seg_begin & (block_size - 1)) + t * TK, valid_keys = seg_end - seg_begin - t * TK;
#pragma unroll
        for (int p = 0; p < passes; ++p) {
            const int j = p * keys_per_pass + key_slot;
            if (j >= TK) break;
            const bool valid = j < valid_keys;
            const int rel = first_rel + j;   // key's index counted from the segment's first block
            const int block = valid ? table_s[rel >> log2_block_size] : 0;
            const long long row = (long long)((((block * num_kv_heads) + kv_head) << log2_block_size) +
                                              (rel & (block_size - 1))) * head_dim;
#pragma unroll
            for (int cc = 0; cc < CHUNKS_PER_LANE; ++cc) {
                if (lane_chunk + cc * lanes >= chunks) break;
                const int e = j * head_dim + cc * lanes * VEC;
                cp_async_16_zfill(k_dst + e, k_lane + row + cc * lanes * VEC, valid);
                cp_async_16_zfill(v_dst + e, v_lane + row + cc * lanes * VEC, valid);
            }
        }
    };

    float acc[GROUP_TILE][DA_LANE_ELEMENTS];
#pragma unroll
    for (int h = 0; h < GROUP_TILE; ++h)
#pragma unroll
        for (int e = 0; e < DA_LANE_ELEMENTS; ++e) acc[h][e] = 0.0f;
    constexpr int HEADS_PER_WARP = (GROUP_TILE + DA_WARPS - 1) / DA_WARPS;   // softmax: warp w owns heads w, w + 4
    float run_max[HEADS_PER_WARP], run_sum[HEADS_PER_WARP];
#pragma unroll
    for (int w = 0; w < HEADS_PER_WARP; ++w) run_max[w] = negative_infinity(), run_sum[w] = 0.0f;

    while (true) {
        __syncthreads();   // table_s complete

        const int tiles = (seg_end - seg_begin + TK - 1) / TK;
#pragma unroll
        for (int t = 0; t < DA_STAGES - 1; ++t) {
            if (t < tiles) issue_tile(t);
            cp_async_commit();
        }
        for (int t = 0; t < tiles; ++t) {
            cp_async_wait<DA_STAGES - 2>();   // this thread's copies of tile t have landed
            __syncthreads();                  // ... everyone's; and everyone is done with tile t - 1's stage
            if (t + DA_STAGES - 1 < tiles) issue_tile(t + DA_STAGES - 1);
            cp_async_commit();

            const T* k_tile = stages + (t % DA_STAGES) * 2 * TK * head_dim;
            const T* v_tile = k_tile + TK * head_dim;
            const int n = min(TK, seg_end - seg_begin - t * TK);

            // Scores of this thread's keys (every lane runs the shuffles, so no early exit). Unrolled for 4 heads;
            // with 8, unrolling the passes too runs out of registers.
#pragma unroll(GROUP_TILE == 4 ? passes : 1)
            for (int p = 0; p < passes; ++p) {
                const int j = p * keys_per_pass + key_slot;
                float dot[GROUP_TILE];
#pragma unroll
                for (int h = 0; h < GROUP_TILE; ++h) dot[h] = 0.0f;
#pragma unroll
                for (int cc = 0; cc < CHUNKS_PER_LANE; ++cc) {
                    const int c = lane_chunk + cc * lanes;
                    if (j < TK && c < chunks) {
                        float k[VEC];
                        unpack16<T>(*reinterpret_cast<const uint4*>(k_tile + j * head_dim + c * VEC), k);
#pragma unroll
                        for (int h = 0; h < GROUP_TILE; ++h)
#pragma unroll
                            for (int e = 0; e < VEC; ++e) dot[h] += q_reg[h][cc * VEC + e] * k[e];
                    }
                }
                reduce_over_key_lanes<LANES>(dot, lane_chunk, [&](int h, float total) {
                    if (h < heads && j < TK) scores[h * TK + j] = j < n ? total : negative_infinity();
                });
            }
            __syncthreads();   // scores complete

            // Online softmax over the tile, one warp per head: probabilities replace the scores.
#pragma unroll
            for (int w = 0; w < HEADS_PER_WARP; ++w) {
                const int h = warp + w * DA_WARPS;
                if (h >= heads) break;
                const float s = lane < TK ? scores[h * TK + lane] : negative_infinity();
                const float new_max = fmaxf(run_max[w], warp_max(s));   // finite: the tile's first key is valid
                const float p = expf(s - new_max);
                const float corr = expf(run_max[w] - new_max);
                run_sum[w] = run_sum[w] * corr + warp_sum(p);
                run_max[w] = new_max;
                if (lane < TK) scores[h * TK + lane] = p;
                if (lane == 0) correction[h] = corr;
            }
            __syncthreads();   // probabilities and corrections complete

            // acc = acc * correction + P.V over this thread's keys and chunks.
#pragma unroll
            for (int h = 0; h < GROUP_TILE; ++h) {
                if (h >= heads) break;
                const float corr = correction[h];
#pragma unroll
                for (int e = 0; e < DA_LANE_ELEMENTS; ++e) acc[h][e] *= corr;
            }
#pragma unroll
            for (int p = 0; p < passes; ++p) {
                const int j = p * keys_per_pass + key_slot;
                if (j >= n) break;
#pragma unroll
                for (int cc = 0; cc < CHUNKS_PER_LANE; ++cc) {
                    const int c = lane_chunk + cc * lanes;
                    if (c >= chunks) break;
                    float v[VEC];
                    unpack16<T>(*reinterpret_cast<const uint4*>(v_tile + j * head_dim + c * VEC), v);
#pragma unroll
                    for (int h = 0; h < GROUP_TILE; ++h) {
                        if (h >= heads) break;
                        const float prob = scores[h * TK + j];
#pragma unroll
                        for (int e = 0; e < VEC; ++e) acc[h][cc * VEC + e] += prob * v[e];
                    }
                }
            }
        }
        if (seg_end == key_end) break;
        seg_begin = seg_end, seg_end = min(key_end, seg_begin + DA_SEGMENT_KEYS);
        __syncthreads();   // every thread done with the last segment's stages and table entries
        stage_table();
    }
    cp_async_wait<0>();   // only empty groups remain; keeps every thread's group count at zero on exit

    // Sum the accumulators over the keys' lanes of each warp, then over the warps through shared memory.
#pragma unroll
    for (int h = 0; h < GROUP_TILE; ++h) {
        if (h >= heads) break;
#pragma unroll
        for (int e = 0; e < DA_LANE_ELEMENTS; ++e)
            for (int offset = 16; offset > 0; offset >>= 1)    // over the warp's keys
                if (offset >= lanes) acc[h][e] += __shfl_xor_sync(FULL_WARP, acc[h][e], offset);
    }
    __syncthreads();   // every warp done with the stages: reuse them for the per-warp sums
    float* warp_acc = reinterpret_cast<float*>(smem);   // [WARPS][heads][head_dim]
    if (lane < lanes) {
#pragma unroll
        for (int h = 0; h < GROUP_TILE; ++h) {
            if (h >= heads) break;
#pragma unroll
            for (int cc = 0; cc < CHUNKS_PER_LANE; ++cc) {
                const int c = lane_chunk + cc * lanes;
                if (c >= chunks) break;
#pragma unroll
                for (int e = 0; e < VEC; ++e) warp_acc[(warp * heads + h) * head_dim + c * VEC + e] = acc[h][cc * VEC + e];
            }
        }
    }
#pragma unroll
    for (int w = 0; w < HEADS_PER_WARP; ++w) {
        const int h = warp + w * DA_WARPS;
        if (h < heads && lane == 0) {
            row_sum_s[h] = run_sum[w];
            if (!direct) {
                partial_max[(long long)slot * num_q_heads + first_head + h] = run_max[w];
                partial_sum[(long long)slot * num_q_heads + first_head + h] = run_sum[w];
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < heads * head_dim; i += DA_THREADS) {
        const int h = i / head_dim, d = i % head_dim;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < DA_WARPS; ++w) total += warp_acc[(w * heads + h) * head_dim + d];
        const long long head = first_head + h;
        if (direct)
            out[(long long)token * num_q_heads * head_dim + head * head_dim + d] = from_float<T>(total / row_sum_s[h]);
        else
            partial_out[((long long)slot * num_q_heads + head) * head_dim + d] = total;
    }
}

// Merges the splits of one decode row and query head: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s,
// over the splits that hold keys (the first ceil(span / split_length) of the row's, span its keys in the
// window; a row that uses one split had it write the output).
template <typename T>
__global__ void decode_attention_reduce_kernel(const float* __restrict__ partial_out,   // [slots, Hq, D]
                                               const float* __restrict__ partial_max,   // [slots, Hq]
                                               const float* __restrict__ partial_sum,   // [slots, Hq]
                                               const int* __restrict__ rows,   // int32[R, 4]: token, seq, first slot, splits
                                               const int* __restrict__ context_lens,   // int32[num_seqs]
                                               T* __restrict__ out,            // [num_tokens, Hq, D]
                                               int num_q_heads, int head_dim, int window) {
    const int* row = rows + 4 * blockIdx.x;
    const int token = row[0], len = context_lens[row[1]], first = row[2];
    const int span = len - window_begin(len - 1, window);
    const int split_keys = split_length(span, row[3]);
    const int used = (span + split_keys - 1) / split_keys;   // splits that hold keys
    if (used == 1) return;   // its one split wrote the output
    const int head = blockIdx.y;
    float global_max = negative_infinity();
    for (int s = 0; s < used; ++s) global_max = fmaxf(global_max, partial_max[(long long)(first + s) * num_q_heads + head]);
    float denominator = 0.0f;
    for (int s = 0; s < used; ++s) {
        const long long i = (long long)(first + s) * num_q_heads + head;
        denominator += expf(partial_max[i] - global_max) * partial_sum[i];
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float numerator = 0.0f;
        for (int s = 0; s < used; ++s) {
            const long long i = (long long)(first + s) * num_q_heads + head;
            numerator += expf(partial_max[i] - global_max) * partial_out[i * head_dim + d];
        }
        out[((long long)token * num_q_heads + head) * head_dim + d] = from_float<T>(numerator / denominator);
    }
}
