// Warp-level tensor-core instructions for the minisarathi CUDA emulator (included by minisarathi_emu.h).
//
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 and
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans].shared.b16, modeled as what they are on the GPU: warp-
// collective operations. Every lane publishes the registers (or the row address) it holds in the per-warp
// fragment buffer, the 32 lanes meet at a barrier, each lane computes exactly the elements the PTX ISA
// assigns to it ("Matrix Fragments for mma.m16n8k16 with floating point type", "ldmatrix"), and the lanes
// meet again before anyone may overwrite the buffer. A kernel that puts an element in the wrong register or
// lane therefore gets the wrong product here exactly as on the GPU.
//
// Numerics: a product of two bf16 or two fp16 values is exact in fp32, and the sum is accumulated in fp32
// starting from the C element, in k order. Tensor cores add the 16 products in an unspecified order and
// internal width, so results agree with a GPU to fp32 rounding, not bit for bit.
#pragma once

namespace emu {

enum class Mma16 { f16, bf16 };

// Registers each lane hands to a warp-collective matrix operation: 4 words of A and 2 of B for mma, or
// a 2-word row address for ldmatrix. thread_local = one buffer per running block (per OS thread).
inline thread_local uint32_t tls_fragments[32][kWarpSize][6];

inline float fragment_element(uint32_t reg, int high, Mma16 type) {
    const unsigned short bits = (unsigned short)(high ? reg >> 16 : reg & 0xffffu);
    return type == Mma16::bf16 ? emu_bf16_bits_to_float(bits) : emu_half_bits_to_float(bits);
}

// D = A * B + C with A 16x16 (row-major fragments), B 16x8 (column-major fragments), C and D 16x8 fp32.
// Lane l, group g = l / 4, t = l % 4 holds (two 16-bit elements per register, the lower column first):
//   A: a[0] = A[g][2t..2t+1]  a[1] = A[g+8][2t..2t+1]  a[2] = A[g][2t+8..2t+9]  a[3] = A[g+8][2t+8..2t+9]
//   B: b[0] = B[2t..2t+1][g]  b[1] = B[2t+8..2t+9][g]
//   C, D: c[0..1] = C[g][2t..2t+1]  c[2..3] = C[g+8][2t..2t+1]
inline void mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2], const float c[4], Mma16 type) {
    Block* blk = tls_block;
    const Fiber* f = blk->current;
    uint32_t (*warp)[6] = tls_fragments[f->warp];
    std::memcpy(warp[f->lane], a, 4 * sizeof(unsigned));
    std::memcpy(warp[f->lane] + 4, b, 2 * sizeof(unsigned));
    warp_barrier(0xffffffffu, "mma.sync.aligned.m16n8k16");
    const int g = f->lane / 4, t = f->lane % 4;
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
        float sum = c[i];
        for (int k = 0; k < 16; ++k) {
            // Who holds A[row][k] and B[k][col], by the fragment layout above.
            const uint32_t a_reg = warp[(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)];
            const uint32_t b_reg = warp[col * 4 + (k % 8) / 2][4 + k / 8];
            sum += fragment_element(a_reg, k % 2, type) * fragment_element(b_reg, k % 2, type);
        }
        out[i] = sum;
    }
    warp_barrier(0xffffffffu, "mma.sync.aligned.m16n8k16");
    std::memcpy(d, out, sizeof out);
}

// ldmatrix.m8n8.x{count}[.trans].shared.b16: matrix i (8 rows of eight 16-bit elements, 16 bytes each) has
// its row addresses in lanes 8i .. 8i+7 (the other lanes' addresses are ignored). Lane l receives in r[i]
// the pair M_i[l/4][2(l%4) .. 2(l%4)+1], or with .trans M_i[2(l%4)][l/4] (low) and M_i[2(l%4)+1][l/4] (high).
inline void ldmatrix(unsigned* r, int count, bool trans, const void* row) {
    Block* blk = tls_block;
    const Fiber* f = blk->current;
    const char* what = trans ? "ldmatrix.sync.aligned.m8n8.trans" : "ldmatrix.sync.aligned.m8n8";
    if (f->lane < 8 * count && reinterpret_cast<uintptr_t>(row) % 16 != 0)
        fiber_fail(std::string(what) + ": row address not 16-byte aligned");
    uint32_t (*warp)[6] = tls_fragments[f->warp];
    std::memcpy(warp[f->lane], &row, sizeof row);
    warp_barrier(0xffffffffu, what);
    const auto element = [&](int matrix, int r_, int c_) {
        const unsigned short* p;
        std::memcpy(&p, warp[8 * matrix + r_], sizeof p);
        return (uint32_t)p[c_];
    };
    const int g = f->lane / 4, t = f->lane % 4;
    unsigned out[4];
    for (int i = 0; i < count; ++i)
        out[i] = trans ? element(i, 2 * t, g) | element(i, 2 * t + 1, g) << 16
                       : element(i, g, 2 * t) | element(i, g, 2 * t + 1) << 16;
    warp_barrier(0xffffffffu, what);
    std::memcpy(r, out, count * sizeof(unsigned));
}

}  // namespace emu

// Bit views of the 16-bit types, as cuda_fp16.h / cuda_bf16.h name them.
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.bits; }
