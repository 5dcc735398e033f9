// Tiny kernels that exercise the tensor-core wrappers of cuda/common.cuh (tests/system/test_emulator_mma.py).
// One warp each. Matrices are row-major in global memory; the kernels place elements into fragments by
// the PTX ISA's layout themselves, so the test checks the emulator's ownership rules, not its own.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ unsigned pair(const T* p) {
    return (unsigned)(*reinterpret_cast<const unsigned short*>(p)) | (unsigned)(*reinterpret_cast<const unsigned short*>(p + 1)) << 16;
}

template <typename T>
__device__ __forceinline__ unsigned column_pair(const T* b, int k, int n) {   // B[k][n], B[k+1][n]
    return (unsigned)(*reinterpret_cast<const unsigned short*>(b + k * 8 + n)) |
           (unsigned)(*reinterpret_cast<const unsigned short*>(b + (k + 1) * 8 + n)) << 16;
}

__device__ __forceinline__ void store_d(const float d[4], float* out) {
    const int g = threadIdx.x / 4, t = threadIdx.x % 4;
    out[g * 8 + 2 * t] = d[0];
    out[g * 8 + 2 * t + 1] = d[1];
    out[(g + 8) * 8 + 2 * t] = d[2];
    out[(g + 8) * 8 + 2 * t + 1] = d[3];
}

// D[16x8] = A[16x16] B[16x8] + C, fragments loaded element by element from global memory.
// `misindex` != 0 swaps a[1] and a[2]: the classic mistake of taking the A registers in row-major order
// (row g: k 0-7, then k 8-15) instead of the ISA's (row g, row g+8, then the upper k half).
template <typename T>
__global__ void mma_from_global(const T* a, const T* b, const float* c, float* out, int misindex) {
    const int g = threadIdx.x / 4, t = threadIdx.x % 4;
    unsigned fa[4] = {pair(a + g * 16 + 2 * t), pair(a + (g + 8) * 16 + 2 * t), pair(a + g * 16 + 2 * t + 8),
                      pair(a + (g + 8) * 16 + 2 * t + 8)};
    if (misindex) {
        const unsigned swap = fa[1];
        fa[1] = fa[2];
        fa[2] = swap;
    }
    const unsigned fb[2] = {column_pair(b, 2 * t, g), column_pair(b, 2 * t + 8, g)};
    float d[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
    mma_m16n8k16<T>(d, fa, fb);
    store_d(d, out);
}

// out[lane][i] = register i of ldmatrix x{count}[.trans] over a 32x8 matrix staged in shared memory with
// a padded pitch; lane l hands the address of row rows[l] (a permutation), so the test also checks that
// each matrix takes its rows from the right lanes.
__global__ void ldmatrix_registers(const unsigned short* m, const int* rows, unsigned* out, int count, int trans) {
    constexpr int PITCH = 24;   // elements: 48-byte rows, 16-byte aligned
    __shared__ __align__(16) unsigned short tile[32 * PITCH];
    for (int i = threadIdx.x; i < 32 * 8; i += 32) tile[(i / 8) * PITCH + i % 8] = m[i];
    __syncwarp();
    const void* row = tile + rows[threadIdx.x] * PITCH;
    unsigned r[4] = {0, 0, 0, 0};
    if (count == 1) trans ? ldmatrix_x1_trans(r, row) : ldmatrix_x1(r, row);
    if (count == 2) trans ? ldmatrix_x2_trans(r, row) : ldmatrix_x2(r, row);
    if (count == 4) trans ? ldmatrix_x4_trans(r, row) : ldmatrix_x4(r, row);
    for (int i = 0; i < 4; ++i) out[threadIdx.x * 4 + i] = r[i];
}

// D[16x16] = A[16x16] B[16x16] the way attention kernels feed tensor cores: A through ldmatrix_x4 from a
// row-major tile, B (k-major, as V is) through ldmatrix_x4_trans, two n8 halves, and B^T (n-major, as K
// is) through ldmatrix_x2 for the second product out2 = A B computed from bt = B^T.
template <typename T>
__global__ void ldmatrix_mma(const T* a, const T* b, const T* bt, float* out, float* out2) {
    __shared__ __align__(16) T a_s[16 * 16], b_s[16 * 16], bt_s[16 * 16];
    for (int i = threadIdx.x; i < 256; i += 32) {
        a_s[i] = a[i];
        b_s[i] = b[i];
        bt_s[i] = bt[i];
    }
    __syncwarp();
    const int lane = threadIdx.x;
    unsigned fa[4], fb[4];
    ldmatrix_x4(fa, a_s + (lane % 16) * 16 + (lane / 16) * 8);
    ldmatrix_x4_trans(fb, b_s + (lane % 16) * 16 + (lane / 16) * 8);
    const int g = lane / 4, t = lane % 4;
    for (int half = 0; half < 2; ++half) {
        float d[4] = {0, 0, 0, 0};
        mma_m16n8k16<T>(d, fa, fb + 2 * half);
        out[g * 16 + 8 * half + 2 * t] = d[0];
        out[g * 16 + 8 * half + 2 * t + 1] = d[1];
        out[(g + 8) * 16 + 8 * half + 2 * t] = d[2];
        out[(g + 8) * 16 + 8 * half + 2 * t + 1] = d[3];
    }
    for (int half = 0; half < 2; ++half) {
        unsigned fbt[2];   // rows n of B^T: lanes 0-7 give k 0-7, lanes 8-15 give k 8-15
        ldmatrix_x2(fbt, bt_s + (8 * half + lane % 8) * 16 + ((lane / 8) % 2) * 8);
        float d[4] = {0, 0, 0, 0};
        mma_m16n8k16<T>(d, fa, fbt);
        out2[g * 16 + 8 * half + 2 * t] = d[0];
        out2[g * 16 + 8 * half + 2 * t + 1] = d[1];
        out2[(g + 8) * 16 + 8 * half + 2 * t] = d[2];
        out2[(g + 8) * 16 + 8 * half + 2 * t + 1] = d[3];
    }
}

// Packs floats into fragment registers through pack2<T> (round to nearest even), read back raw.
template <typename T>
__global__ void pack_pairs(const float* x, unsigned* out) {
    out[threadIdx.x] = pack2<T>(x[2 * threadIdx.x], x[2 * threadIdx.x + 1]);
}

template __global__ void mma_from_global<__half>(const __half*, const __half*, const float*, float*, int);
template __global__ void mma_from_global<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, const float*, float*, int);
template __global__ void ldmatrix_mma<__half>(const __half*, const __half*, const __half*, float*, float*);
template __global__ void ldmatrix_mma<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, float*, float*);
template __global__ void pack_pairs<__half>(const float*, unsigned*);
template __global__ void pack_pairs<__nv_bfloat16>(const float*, unsigned*);
