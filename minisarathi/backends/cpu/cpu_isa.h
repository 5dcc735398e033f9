// The vector paths of the CPU kernels and which of them this CPU runs, chosen at run time: each path is
// compiled with its own target attribute, so one library serves every x86-64 CPU.
#pragma once
// GCC 12 warns of its own intrinsics' deliberately undefined operands when they are inlined into a
// function with a target attribute; the warnings are false.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace cpu_isa {

// A kernel's Python side names these codes (its ISAS); AUTO asks for best().
enum Isa { AUTO = 0, SCALAR = 1, AVX2 = 2, AVX512 = 3, AVX512_VNNI = 4 };

// AVX2 is AVX2 + FMA + F16C (fp16 scales); AVX512 is AVX-512 F + BW + VL (the byte and 256-bit forms); AVX512_VNNI adds VNNI.
inline bool supported(int isa) {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
    switch (isa) {
        case SCALAR: return true;
        case AVX2: return avx2;
        case AVX512: return avx512;
        case AVX512_VNNI: return avx512 && __builtin_cpu_supports("avx512vnni");
        default: return false;
    }
}

inline int best() {
    if (supported(AVX512_VNNI)) return AVX512_VNNI;
    if (supported(AVX512)) return AVX512;
    return supported(AVX2) ? AVX2 : SCALAR;
}

// 32-bit float from fp16 bits, exact: normal, subnormal, infinite; a NaN keeps its payload, made quiet. The
// scalar paths' widening (the vector ones use F16C's vcvtph2ps).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000 | (mantissa << 13) | (mantissa ? 0x400000 : 0);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        const float magnitude = (float)mantissa * 0x1p-24f;  // subnormal: mantissa * 2^-24, exact
        memcpy(&bits, &magnitude, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

}  // namespace cpu_isa
