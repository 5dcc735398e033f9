// quant_linear.cpp's AVX-512 tiles, included twice: with QUANT_LINEAR_VNNI 0 (AVX-512BW's
// maddubs + madd) and 1 (VNNI's vpdpbusd), each under its own target, so the BW path has no VNNI instruction.
// Pairs of blocks fill a zmm; a row's odd last block is loaded masked, its second half zeros.

// Blocks b and b + 1 (only b where `two` is false: the row's last block) of a row, as 64 bytes.
template <int KIND>
inline __m512i blocks(const Part& p, int64_t row, int64_t k, int64_t b, bool two) {
    if (KIND == INT8)
        return _mm512_maskz_loadu_epi8(two ? ~0ULL : 0xFFFFFFFFULL,
                                       (const int8_t*)p.values + row * k + b * BLOCK);
    const __m256i packed = _mm256_maskz_loadu_epi8(two ? 0xFFFFFFFFu : 0xFFFFu,
                                                   (const uint8_t*)p.values + row * (k / 2) + b * 16);
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m512i halves = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, nib)),
                                              _mm256_and_si256(_mm256_srli_epi16(packed, 4), nib), 1);
    // [low 0-15 | low 16-31 | high 0-15 | high 16-31] -> block b's low, high, then block b + 1's
    __m512i codes = _mm512_shuffle_i64x2(halves, halves, _MM_SHUFFLE(3, 1, 2, 0));
    if (KIND == INT6) {
        const __m128i bits = _mm_maskz_loadu_epi8(two ? 0xFFFF : 0xFF, p.high + row * (k / 4) + b * 8);
        __m512i top = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1),
                                               _mm512_castsi128_si512(bits));
        top = _mm512_srlv_epi64(top, _mm512_setr_epi64(0, 2, 4, 6, 0, 2, 4, 6));
        top = _mm512_slli_epi16(_mm512_and_si512(top, _mm512_set1_epi8(3)), 4);
        return _mm512_sub_epi8(_mm512_or_si512(codes, top), _mm512_set1_epi8(32));
    }
    if (KIND == UINT5) {
        uint64_t bits = 0;
        memcpy(&bits, p.high + row * (k / 8) + b * 4, two ? 8 : 4);
        codes = _mm512_or_si512(codes, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(0x10)));
    }
    return codes;
}

// Per int32 lane (8 per block): lanes 0-7 block b, 8-15 block b + 1 (zero where `two` is false).
template <int GROUP>
inline __m512 weight_scales(const Part& p, int64_t row, int64_t k, int64_t b, bool two) {
    const int per_block = BLOCK / GROUP;
    float four[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int g = 0; g < (two ? 2 : 1) * per_block; ++g)
        four[g] = p.half_scale ? _cvtsh_ss(((const uint16_t*)p.scale)[row * (k / GROUP) + b * per_block + g])
                               : factor(p.scale, p.scale_sub, row, k / GROUP, GROUP, b * per_block + g);
    const __m128 s = _mm_loadu_ps(four);
    const __m512i index = GROUP == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                      : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(s));
}

inline __m512 activation_scales(const float* s, bool two) {
    const __m128 v = _mm_maskz_loadu_ps(two ? 3 : 1, s);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                 _mm512_castps128_ps512(v));
}

inline __m512i dot(__m512i u, __m512i v) {
#if QUANT_LINEAR_VNNI
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, v);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, v), _mm512_set1_epi16(1));
#endif
}

template <int KIND, int GROUP, int NT, int NN>
void tile(const Activations& a, int64_t i, int64_t k, const Part& p, int64_t j, float* out, int64_t ldo) {
    constexpr bool SIGNED = KIND == INT8 || KIND == INT6;
    const int64_t nb = k / BLOCK;
    __m512 acc[NT][NN];
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < NN; ++c) acc[t][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
        const bool two = b + 1 < nb;
        __m512i u[NN];
        __mmask64 negative[NN];
        __m512 ws[NN];
        for (int c = 0; c < NN; ++c) {
            const __m512i w = blocks<KIND>(p, j + c, k, b, two);
            negative[c] = SIGNED ? _mm512_movepi8_mask(w) : 0;
            u[c] = SIGNED ? _mm512_abs_epi8(w) : w;
            ws[c] = weight_scales<GROUP>(p, j + c, k, b, two);
        }
        for (int t = 0; t < NT; ++t) {
            const int8_t* row = a.q + (i + t) * k + b * BLOCK;
            const __m512i xq = _mm512_maskz_loadu_epi8(two ? ~0ULL : 0xFFFFFFFFULL, row);
            const __m512 xs = activation_scales(a.s + (i + t) * nb + b, two);
            for (int c = 0; c < NN; ++c) {
                const __m512i zero = _mm512_setzero_si512();
                const __m512i v = SIGNED ? _mm512_mask_sub_epi8(xq, negative[c], zero, xq) : xq;
                const __m512i d = dot(u[c], v);
                acc[t][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws[c], xs), acc[t][c]);
            }
        }
    }
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < NN; ++c) {
            float r = _mm512_reduce_add_ps(acc[t][c]);
            if (!SIGNED) r -= avx2::minimum_dot(p, j + c, nb, a.sum + (i + t) * nb);
            out[(i + t) * ldo + j + c] = r;
        }
}

