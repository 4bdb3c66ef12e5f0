/* The one store of 8 fp32 lanes, or of their first n, that the AVX2 kernels share
 * (blocks_avx2.h, and blocks_q4.h in both builds). */
#ifndef TLM_STORE_HALF
#define TLM_STORE_HALF

/* y[0..n) = the first n of v's 8 lanes (n may be 0 or less: nothing). */
static inline void store_half(float *y, __m256 v, int64_t n) {
    if (n >= 8) {
        _mm256_storeu_ps(y, v);
    } else if (n > 0) {
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lanes), v);
    }
}

#endif
