/* products.c's block kernels for AVX-512 (int8 with VNNI): a 64-byte line of a block is one
 * register of 16 lanes, one lane per output row. Included by products.c where the compiler
 * targets AVX-512F; blocks_avx2.h computes the same sums with two registers of 8 lanes. */

/* y[0..n) = v's first n lanes (the last block of an output whose width is not a multiple
 * of 16 writes only its own columns). */
static inline void store(float *y, __m512 v, int64_t n) {
    if (n >= 16)
        _mm512_storeu_ps(y, v);
    else
        _mm512_mask_storeu_ps(y, (__mmask16)((1u << n) - 1), v);
}

#if defined(INT8_KERNEL)
/* int8, the integer sums of one block for n rows (n = 1..4; a constant where it is
 * inlined): sums[k] = sum_i (xq_ki + 128) q_oi for the block's 16 rows o. Each 64-byte
 * line of weights (4 inputs of 16 rows) is loaded once for the n rows; one row keeps four
 * sums apart, so that four products are under way at once. */
static inline __attribute__((always_inline)) void int8_rows(const int8_t *w, const uint8_t *xu,
                                                            int64_t in_pad, int n, __m512i *sums) {
    const int64_t groups = in_pad / 4;
    if (n == 1) {
        const int32_t *x4 = (const int32_t *)xu;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t g = 0; g < groups; g += 4) {
            const int8_t *line = w + g * 64;
            a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(x4[g]), _mm512_loadu_si512(line));
            a1 = _mm512_dpbusd_epi32(a1, _mm512_set1_epi32(x4[g + 1]), _mm512_loadu_si512(line + 64));
            a2 = _mm512_dpbusd_epi32(a2, _mm512_set1_epi32(x4[g + 2]), _mm512_loadu_si512(line + 128));
            a3 = _mm512_dpbusd_epi32(a3, _mm512_set1_epi32(x4[g + 3]), _mm512_loadu_si512(line + 192));
        }
        sums[0] = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
        return;
    }
    __m512i a[4];
    for (int k = 0; k < n; k++) a[k] = _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; g++) {
        const __m512i line = _mm512_loadu_si512(w + g * 64);
        for (int k = 0; k < n; k++)
            a[k] = _mm512_dpbusd_epi32(a[k], _mm512_set1_epi32(((const int32_t *)(xu + k * in_pad))[g]), line);
    }
    for (int k = 0; k < n; k++) sums[k] = a[k];
}

/* y[r, 0..left) of one block w for every row r of x (xu: xq + 128; xs unused here), rows
 * `out` floats apart; scale, wsum and bias (or NULL) are the block's 16. */
static void int8_block(const int8_t *w, const uint8_t *xu, const int8_t *xs, const float *sx,
                       const float *scale, const int32_t *wsum, const float *bias, int64_t rows,
                       int64_t in_pad, int64_t out, int64_t left, float *y) {
    (void)xs;
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(wsum), 7);
    const __m512 row_scale = _mm512_loadu_ps(scale);
    const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r += 4) {
        const int n = rows - r < 4 ? (int)(rows - r) : 4;
        __m512i sums[4];
        const uint8_t *xr = xu + r * in_pad;
        switch (n) { /* each a copy of int8_rows for its n */
        case 1: int8_rows(w, xr, in_pad, 1, sums); break;
        case 2: int8_rows(w, xr, in_pad, 2, sums); break;
        case 3: int8_rows(w, xr, in_pad, 3, sums); break;
        default: int8_rows(w, xr, in_pad, 4, sums);
        }
        for (int k = 0; k < n; k++) {
            const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(sx[r + k]), row_scale),
                                             _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[k], offset)), b);
            store(y + (r + k) * out, v, left);
        }
    }
}
#endif

/* float16 and float32 blocks, the sums of one block for n rows (n = 1..4, as int8_rows):
 * sums[k] = sum_i x_ki w_oi for the block's 16 rows o, each input's 16 weights loaded (and
 * fp16 widened) once for the n rows; one row keeps four sums apart, more rows two each. */
static inline __attribute__((always_inline)) __m512 weights(const void *w, int64_t i, int fp32) {
    if (fp32) return _mm512_loadu_ps((const float *)w + i * 16);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i * 16)));
}

static inline __attribute__((always_inline)) void float_rows(const void *w, const float *x,
                                                             int64_t in, int n, int fp32,
                                                             __m512 *sums) {
    if (n == 1) {
        const int64_t whole = in - in % 4;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < whole; i += 4) {
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(x[i]), weights(w, i, fp32), a0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(x[i + 1]), weights(w, i + 1, fp32), a1);
            a2 = _mm512_fmadd_ps(_mm512_set1_ps(x[i + 2]), weights(w, i + 2, fp32), a2);
            a3 = _mm512_fmadd_ps(_mm512_set1_ps(x[i + 3]), weights(w, i + 3, fp32), a3);
        }
        for (int64_t i = whole; i < in; i++) a0 = _mm512_fmadd_ps(_mm512_set1_ps(x[i]), weights(w, i, fp32), a0);
        sums[0] = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
        return;
    }
    __m512 even[4], odd[4];
    for (int k = 0; k < n; k++) even[k] = odd[k] = _mm512_setzero_ps();
    const int64_t pairs = in - in % 2;
    for (int64_t i = 0; i < pairs; i += 2) {
        const __m512 w0 = weights(w, i, fp32), w1 = weights(w, i + 1, fp32);
        for (int k = 0; k < n; k++) {
            even[k] = _mm512_fmadd_ps(_mm512_set1_ps(x[k * in + i]), w0, even[k]);
            odd[k] = _mm512_fmadd_ps(_mm512_set1_ps(x[k * in + i + 1]), w1, odd[k]);
        }
    }
    if (pairs < in) {
        const __m512 w0 = weights(w, pairs, fp32);
        for (int k = 0; k < n; k++) even[k] = _mm512_fmadd_ps(_mm512_set1_ps(x[k * in + pairs]), w0, even[k]);
    }
    for (int k = 0; k < n; k++) sums[k] = _mm512_add_ps(even[k], odd[k]);
}

/* y[r, 0..left) of one block w for every row r of x [rows, in], rows `out` floats apart;
 * bias (or NULL) the block's 16. */
static inline __attribute__((always_inline)) void float_block(const void *w, int fp32,
                                                              const float *bias, const float *x,
                                                              int64_t rows, int64_t in, int64_t out,
                                                              int64_t left, float *y) {
    const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r += 4) {
        const int n = rows - r < 4 ? (int)(rows - r) : 4;
        __m512 sums[4];
        const float *xr = x + r * in;
        switch (n) { /* each a copy of float_rows for its n */
        case 1: float_rows(w, xr, in, 1, fp32, sums); break;
        case 2: float_rows(w, xr, in, 2, fp32, sums); break;
        case 3: float_rows(w, xr, in, 3, fp32, sums); break;
        default: float_rows(w, xr, in, 4, fp32, sums);
        }
        for (int k = 0; k < n; k++) store(y + (r + k) * out, _mm512_add_ps(sums[k], b), left);
    }
}
