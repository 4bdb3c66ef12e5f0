/* products.c's block kernels for AVX2 with FMA and F16C: a 64-byte line of a block (16
 * output rows) is two registers of 8 lanes, rows 0-7 and 8-15, one lane per output row.
 * Included by products.c where the compiler targets AVX2 without AVX-512; the sums are
 * blocks_avx512.h's, the int8 ones exactly (integers), the float ones to fp32 rounding.
 *
 * int8 without AVX-VNNI: vpmaddubsw multiplies unsigned by signed bytes and adds each pair
 * into 16 bits, which saturate past 32767. With x as xq + 128 (as VNNI reads it) a pair
 * reaches 2 * 255 * 127 = 64770 and would saturate; so x is read as |xq| and the weights
 * take xq's signs (vpsignb: q_oi * sign(xq_i), 0 where xq_i is 0), each pair is then at
 * most 2 * 127 * 127 = 32258, exact, and vpmaddwd adds the pairs into 32 bits. With
 * AVX-VNNI (-march=alderlake and later), vpdpbusd reads xq + 128 as the wide kernel does. */

#include "store_half.h"

/* y[0..n) = the first n of the 16 lanes (lo, hi). */
static inline void store(float *y, __m256 lo, __m256 hi, int64_t n) {
    store_half(y, lo, n);
    store_half(y + 8, hi, n - 8);
}

/* acc + the sums of four byte products per 32-bit lane: x (|xq|, or xq + 128 with AVX-VNNI)
 * by w, w taking the signs of s (xq) where vpmaddubsw does the products. */
static inline __attribute__((always_inline)) __m256i dot4(__m256i acc, __m256i x, __m256i s,
                                                          __m256i w) {
#if defined(__AVXVNNI__)
    (void)s;
    return _mm256_dpbusd_avx_epi32(acc, x, w);
#else
    const __m256i pairs = _mm256_maddubs_epi16(x, _mm256_sign_epi8(w, s));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* int8, the integer sums of one block for n rows (n = 1..4, as the wide int8_rows), rows
 * 0-7 in sums[2k], 8-15 in sums[2k + 1]: each line's two halves loaded once for the n rows;
 * one row keeps four sums apart. */
static inline __attribute__((always_inline)) void int8_rows(const int8_t *w, const uint8_t *xu,
                                                            const int8_t *xs, int64_t in_pad,
                                                            int n, __m256i *sums) {
    const int64_t groups = in_pad / 4; /* a multiple of 4 */
    if (n == 1) {
        const int32_t *x4 = (const int32_t *)xu, *s4 = (const int32_t *)xs;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t g = 0; g < groups; g += 2) {
            const __m256i *line = (const __m256i *)(w + g * 64);
            const __m256i x0 = _mm256_set1_epi32(x4[g]), s0 = _mm256_set1_epi32(s4[g]);
            const __m256i x1 = _mm256_set1_epi32(x4[g + 1]), s1 = _mm256_set1_epi32(s4[g + 1]);
            a0 = dot4(a0, x0, s0, _mm256_loadu_si256(line));
            a1 = dot4(a1, x0, s0, _mm256_loadu_si256(line + 1));
            a2 = dot4(a2, x1, s1, _mm256_loadu_si256(line + 2));
            a3 = dot4(a3, x1, s1, _mm256_loadu_si256(line + 3));
        }
        sums[0] = _mm256_add_epi32(a0, a2);
        sums[1] = _mm256_add_epi32(a1, a3);
        return;
    }
    __m256i a[8];
    for (int k = 0; k < 2 * n; k++) a[k] = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups; g++) {
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(w + g * 64));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(w + g * 64 + 32));
        for (int k = 0; k < n; k++) {
            const __m256i x = _mm256_set1_epi32(((const int32_t *)(xu + k * in_pad))[g]);
            const __m256i s = _mm256_set1_epi32(((const int32_t *)(xs + k * in_pad))[g]);
            a[2 * k] = dot4(a[2 * k], x, s, lo);
            a[2 * k + 1] = dot4(a[2 * k + 1], x, s, hi);
        }
    }
    for (int k = 0; k < 2 * n; k++) sums[k] = a[k];
}

/* y[r, 0..left) of one block w for every row r of x (xu and xs as dot4 reads them), rows
 * `out` floats apart; scale, wsum and bias (or NULL) are the block's 16. */
static void int8_block(const int8_t *w, const uint8_t *xu, const int8_t *xs, const float *sx,
                       const float *scale, const int32_t *wsum, const float *bias, int64_t rows,
                       int64_t in_pad, int64_t out, int64_t left, float *y) {
#if defined(__AVXVNNI__) /* the sums of (xq + 128) q: take 128 wsum away */
    const __m256i off_lo = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)wsum), 7);
    const __m256i off_hi = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(wsum + 8)), 7);
#else
    (void)wsum;
    const __m256i off_lo = _mm256_setzero_si256(), off_hi = off_lo;
#endif
    const __m256 scale_lo = _mm256_loadu_ps(scale), scale_hi = _mm256_loadu_ps(scale + 8);
    const __m256 b_lo = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b_hi = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; r += 4) {
        const int n = rows - r < 4 ? (int)(rows - r) : 4;
        __m256i sums[8];
        const uint8_t *xr = xu + r * in_pad;
        const int8_t *sr = xs + r * in_pad;
        switch (n) { /* each a copy of int8_rows for its n */
        case 1: int8_rows(w, xr, sr, in_pad, 1, sums); break;
        case 2: int8_rows(w, xr, sr, in_pad, 2, sums); break;
        case 3: int8_rows(w, xr, sr, in_pad, 3, sums); break;
        default: int8_rows(w, xr, sr, in_pad, 4, sums);
        }
        for (int k = 0; k < n; k++) {
            const __m256 s = _mm256_set1_ps(sx[r + k]);
            const __m256 lo = _mm256_fmadd_ps(_mm256_mul_ps(s, scale_lo),
                                              _mm256_cvtepi32_ps(_mm256_sub_epi32(sums[2 * k], off_lo)), b_lo);
            const __m256 hi = _mm256_fmadd_ps(_mm256_mul_ps(s, scale_hi),
                                              _mm256_cvtepi32_ps(_mm256_sub_epi32(sums[2 * k + 1], off_hi)), b_hi);
            store(y + (r + k) * out, lo, hi, left);
        }
    }
}

/* Input i's 8 weights of half h (rows 8h..8h+7) of a float block, fp16 widened (F16C). */
static inline __attribute__((always_inline)) __m256 weights(const void *w, int64_t i, int h,
                                                            int fp32) {
    if (fp32) return _mm256_loadu_ps((const float *)w + i * 16 + h * 8);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i * 16 + h * 8)));
}

/* float16 and float32 blocks, the sums of one block for n rows (n = 1..4), halves as
 * int8_rows: one row keeps four sums of each half apart (eight under way, as two FMA
 * units of 4-5 cycles want), two rows two each, more rows one each. */
static inline __attribute__((always_inline)) void float_rows(const void *w, const float *x,
                                                             int64_t in, int n, int fp32,
                                                             __m256 *sums) {
    if (n == 1) {
        const int64_t whole = in - in % 4;
        __m256 a[8];
        for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
        for (int64_t i = 0; i < whole; i += 4)
            for (int u = 0; u < 4; u++) {
                const __m256 xi = _mm256_set1_ps(x[i + u]);
                a[2 * u] = _mm256_fmadd_ps(xi, weights(w, i + u, 0, fp32), a[2 * u]);
                a[2 * u + 1] = _mm256_fmadd_ps(xi, weights(w, i + u, 1, fp32), a[2 * u + 1]);
            }
        for (int64_t i = whole; i < in; i++) {
            const __m256 xi = _mm256_set1_ps(x[i]);
            a[0] = _mm256_fmadd_ps(xi, weights(w, i, 0, fp32), a[0]);
            a[1] = _mm256_fmadd_ps(xi, weights(w, i, 1, fp32), a[1]);
        }
        sums[0] = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[4], a[6]));
        sums[1] = _mm256_add_ps(_mm256_add_ps(a[1], a[3]), _mm256_add_ps(a[5], a[7]));
        return;
    }
    const int apart = n == 2 ? 2 : 1; /* sums kept apart per half and row */
    __m256 a[8];
    for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
    const int64_t whole = in - in % apart;
    for (int64_t i = 0; i < whole; i += apart)
        for (int u = 0; u < apart; u++) {
            const __m256 lo = weights(w, i + u, 0, fp32), hi = weights(w, i + u, 1, fp32);
            for (int k = 0; k < n; k++) {
                const __m256 xi = _mm256_set1_ps(x[k * in + i + u]);
                a[(2 * k) * apart + 2 * u] = _mm256_fmadd_ps(xi, lo, a[(2 * k) * apart + 2 * u]);
                a[(2 * k) * apart + 2 * u + 1] = _mm256_fmadd_ps(xi, hi, a[(2 * k) * apart + 2 * u + 1]);
            }
        }
    for (int64_t i = whole; i < in; i++) {
        const __m256 lo = weights(w, i, 0, fp32), hi = weights(w, i, 1, fp32);
        for (int k = 0; k < n; k++) {
            const __m256 xi = _mm256_set1_ps(x[k * in + i]);
            a[2 * k * apart] = _mm256_fmadd_ps(xi, lo, a[2 * k * apart]);
            a[2 * k * apart + 1] = _mm256_fmadd_ps(xi, hi, a[2 * k * apart + 1]);
        }
    }
    for (int k = 0; k < n; k++) {
        __m256 lo = a[2 * k * apart], hi = a[2 * k * apart + 1];
        if (apart == 2) {
            lo = _mm256_add_ps(lo, a[2 * k * apart + 2]);
            hi = _mm256_add_ps(hi, a[2 * k * apart + 3]);
        }
        sums[2 * k] = lo;
        sums[2 * k + 1] = hi;
    }
}

/* y[r, 0..left) of one block w for every row r of x [rows, in], rows `out` floats apart;
 * bias (or NULL) the block's 16. */
static inline __attribute__((always_inline)) void float_block(const void *w, int fp32,
                                                              const float *bias, const float *x,
                                                              int64_t rows, int64_t in, int64_t out,
                                                              int64_t left, float *y) {
    const __m256 b_lo = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b_hi = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; r += 4) {
        const int n = rows - r < 4 ? (int)(rows - r) : 4;
        __m256 sums[8];
        const float *xr = x + r * in;
        switch (n) { /* each a copy of float_rows for its n */
        case 1: float_rows(w, xr, in, 1, fp32, sums); break;
        case 2: float_rows(w, xr, in, 2, fp32, sums); break;
        case 3: float_rows(w, xr, in, 3, fp32, sums); break;
        default: float_rows(w, xr, in, 4, fp32, sums);
        }
        for (int k = 0; k < n; k++)
            store(y + (r + k) * out, _mm256_add_ps(sums[2 * k], b_lo), _mm256_add_ps(sums[2 * k + 1], b_hi), left);
    }
}

/* The sums of n rows of x (n = 1..6) against a panel p [in][16] (16 outputs, input by
 * input): twelve sums under way in twelve registers, the panel's two halves loaded once an
 * input for all n rows (products.c's float32_panels; the 6 x 16 tile of BLIS-like kernels). */
static inline __attribute__((always_inline)) void panel_rows(const float *p, const float *x,
                                                             int64_t in, int n, __m256 *sums) {
    __m256 a[12];
    for (int k = 0; k < 2 * n; k++) a[k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < in; i++) {
        const __m256 lo = _mm256_load_ps(p + i * 16), hi = _mm256_load_ps(p + i * 16 + 8);
        for (int k = 0; k < n; k++) {
            const __m256 xi = _mm256_broadcast_ss(x + k * in + i);
            a[2 * k] = _mm256_fmadd_ps(xi, lo, a[2 * k]);
            a[2 * k + 1] = _mm256_fmadd_ps(xi, hi, a[2 * k + 1]);
        }
    }
    for (int k = 0; k < 2 * n; k++) sums[k] = a[k];
}

/* y[r, 0..left) of one panel p for every row r of x [rows, in], y's rows `out` floats apart;
 * bias the panel's 16 (zero past `left`). */
static void float_panel(const float *p, const float *bias, const float *x, int64_t rows,
                        int64_t in, int64_t out, int64_t left, float *y) {
    const __m256 b_lo = _mm256_loadu_ps(bias), b_hi = _mm256_loadu_ps(bias + 8);
    for (int64_t r = 0; r < rows; r += 6) {
        const int n = rows - r < 6 ? (int)(rows - r) : 6;
        const float *xr = x + r * in;
        __m256 sums[12];
        switch (n) { /* each a copy of panel_rows for its n */
        case 1: panel_rows(p, xr, in, 1, sums); break;
        case 2: panel_rows(p, xr, in, 2, sums); break;
        case 3: panel_rows(p, xr, in, 3, sums); break;
        case 4: panel_rows(p, xr, in, 4, sums); break;
        case 5: panel_rows(p, xr, in, 5, sums); break;
        default: panel_rows(p, xr, in, 6, sums);
        }
        for (int k = 0; k < n; k++)
            store(y + (r + k) * out, _mm256_add_ps(sums[2 * k], b_lo),
                  _mm256_add_ps(sums[2 * k + 1], b_hi), left);
    }
}
