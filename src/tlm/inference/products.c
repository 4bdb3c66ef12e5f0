/* Weight products for decoding, y = x W^T + b, with W kept in blocks of 16 output rows
 * (tlm/inference/blocked.py packs them; native.py compiles this file with step.c).
 *
 * A decoding step multiplies a few rows x by every weight matrix, so its time is the time
 * to read the weights. Here the weights are laid out in the order the product reads them:
 * block j holds output rows 16j..16j+15, input by input, the 16 rows' values for one input
 * (int8: for four inputs) side by side in one 64-byte line. One vector instruction then
 * multiplies a broadcast input by the 16 rows' weights and adds into 16 outputs at once:
 * the weights stream from memory front to back, with no sum across a vector at the end of
 * each row, and the blocks are shared out among OpenMP's threads (torch's own, as in
 * step.c). Each block is read from memory once for all rows of x.
 *
 * The kernels need AVX-512 (int8: with VNNI); `products_here` says which were compiled for
 * this host (-march=native), and blocked.py uses fbgemm's kernels where they were not.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Which kernels this build has: bit 0 int8 (AVX-512 VNNI), bit 1 float16 and float32 blocks
 * (AVX-512F), and bit 2 set when they run on OpenMP's threads (built with -fopenmp, not
 * -fopenmp-simd). */
int64_t products_here(void) {
    int64_t here = 0;
#if defined(_OPENMP)
    here |= 4;
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    here |= 1;
#endif
#if defined(__AVX512F__)
    here |= 2;
#endif
    return here;
}

#if defined(__AVX512F__)
/* y[0..n) = v's first n lanes (the last block of an output whose width is not a multiple
 * of 16 writes only its own columns). */
static inline void store(float *y, __m512 v, int64_t n) {
    if (n >= 16)
        _mm512_storeu_ps(y, v);
    else
        _mm512_mask_storeu_ps(y, (__mmask16)((1u << n) - 1), v);
}
#endif

/* int8, the integer sums of one block for n rows (n = 1..4; a constant where it is
 * inlined): sums[k] = sum_i (xq_ki + 128) q_oi for the block's 16 rows o. Each 64-byte
 * line of weights (4 inputs of 16 rows) is loaded once for the n rows; one row keeps four
 * sums apart, so that four products are under way at once. */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
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
#endif

/* int8: W ~ scale[o] * q[o, i], q in [-127, 127] (one scale per output row). Each row of x
 * is quantized the same way, x ~ sx * xq with sx = max|x| / 127, and fed to VNNI's
 * unsigned-by-signed product as xq + 128; sum_i (xq_i + 128) q_oi - 128 wsum[o] is then
 * sum_i xq_i q_oi exactly (wsum[o] = sum_i q_oi), and y[o] = sx scale[o] that + b[o].
 * blocks: [out_pad/16][in_pad/4][16][4] int8, in_pad a multiple of 16; scale, wsum and bias
 * [out_pad], out_pad a multiple of 16 (padding is zero); x [rows, in] fp32; y [rows, out]
 * fp32. Returns 0, -1 where this build has no int8 kernel, -2 without memory. */
int64_t int8_product(const int8_t *blocks, const float *scale, const int32_t *wsum,
                     const float *bias, const float *x, int64_t rows, int64_t in,
                     int64_t in_pad, int64_t out, float *y) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    uint8_t *xu = aligned_alloc(64, (size_t)(rows * in_pad));
    float *sx = malloc(sizeof(float) * (size_t)rows);
    if (!xu || !sx) {
        free(xu), free(sx);
        return -2;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * in;
        float most = 0.0f;
#pragma omp simd reduction(max : most)
        for (int64_t i = 0; i < in; i++) most = fabsf(xr[i]) > most ? fabsf(xr[i]) : most;
        const float inv = most > 0.0f ? 127.0f / most : 0.0f;
        sx[r] = most / 127.0f;
        uint8_t *ur = xu + r * in_pad;
#pragma omp simd
        for (int64_t i = 0; i < in; i++) ur[i] = (uint8_t)((int32_t)nearbyintf(xr[i] * inv) + 128);
        memset(ur + in, 128, (size_t)(in_pad - in)); /* xq = 0 against the zero padding */
    }
    const int64_t n_blocks = (out + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n_blocks; j++) {
        const int8_t *w = blocks + j * 16 * in_pad;
        const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(wsum + j * 16), 7);
        const __m512 row_scale = _mm512_loadu_ps(scale + j * 16);
        const __m512 b = bias ? _mm512_loadu_ps(bias + j * 16) : _mm512_setzero_ps();
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
                const __m512 v = _mm512_fmadd_ps(
                    _mm512_mul_ps(_mm512_set1_ps(sx[r + k]), row_scale),
                    _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[k], offset)), b);
                store(y + (r + k) * out + j * 16, v, out - j * 16);
            }
        }
    }
    free(xu), free(sx);
    return 0;
#else
    return -1;
#endif
}

/* float16 and float32 blocks, the sums of one block for n rows (n = 1..4, as int8_rows):
 * sums[k] = sum_i x_ki w_oi for the block's 16 rows o, each input's 16 weights loaded (and
 * fp16 widened) once for the n rows; one row keeps four sums apart, more rows two each. */
#if defined(__AVX512F__)
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

static inline __attribute__((always_inline)) void float_product(const void *blocks, int fp32,
                                                                const float *bias, const float *x,
                                                                int64_t rows, int64_t in,
                                                                int64_t out, float *y) {
    const int64_t n_blocks = (out + 15) / 16, block = 16 * in * (fp32 ? 4 : 2);
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n_blocks; j++) {
        const void *w = (const char *)blocks + j * block;
        const __m512 b = bias ? _mm512_loadu_ps(bias + j * 16) : _mm512_setzero_ps();
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
            for (int k = 0; k < n; k++) store(y + (r + k) * out + j * 16, _mm512_add_ps(sums[k], b), out - j * 16);
        }
    }
}
#endif

/* float16: W in fp16, widened to fp32 as it is read; the arithmetic is fp32.
 * blocks: [out_pad/16][in][16] fp16 (as uint16_t) and bias [out_pad], out_pad a multiple of
 * 16 (padding is zero); x [rows, in] fp32; y [rows, out] fp32. Returns 0, or -1 where this
 * build has no float16 kernel. */
int64_t float16_product(const uint16_t *blocks, const float *bias, const float *x,
                        int64_t rows, int64_t in, int64_t out, float *y) {
#if defined(__AVX512F__)
    float_product(blocks, 0, bias, x, rows, in, out, y);
    return 0;
#else
    return -1;
#endif
}

/* float32 blocks: a copy of fp32 weights laid out as float16's, for steps of more rows than
 * `float32_rows` serves well (its partial sums of every row outgrow the core's cache).
 * Returns 0, or -1 where this build has no such kernel. */
int64_t float32_product(const float *blocks, const float *bias, const float *x, int64_t rows,
                        int64_t in, int64_t out, float *y) {
#if defined(__AVX512F__)
    float_product(blocks, 1, bias, x, rows, in, out, y);
    return 0;
#else
    return -1;
#endif
}

/* float32 on the model's own layout, the parameters themselves (nothing copied): y = x W + b
 * for x [rows, in], W [in, out] with rows `ld` floats apart, y's rows `ldy` floats apart.
 * The threads share out the inputs: each streams its rows of W front to back, eight at a
 * time, into partial sums of its own (held in the core's cache; each line of W serves
 * every row of x), and the partial sums are added at the end. Plain C: the compiler
 * vectorizes the loops for the host. Returns 0, or -2 without memory. */
int64_t float32_rows(const float *W, int64_t ld, const float *bias, const float *x,
                     int64_t rows, int64_t in, int64_t out, float *y, int64_t ldy) {
#if defined(_OPENMP)
    const int threads = omp_get_max_threads();
#else
    const int threads = 1;
#endif
    const int64_t width = (out + 15) / 16 * 16; /* each partial y on its own cache lines */
    float *partial = aligned_alloc(64, sizeof(float) * (size_t)(threads * rows * width));
    if (!partial) return -2;
#pragma omp parallel num_threads(threads)
    {
#if defined(_OPENMP)
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int t = 0, n = 1;
#endif
        const int64_t lo = in * t / n, hi = in * (t + 1) / n;
        float *mine = partial + t * rows * width;
        memset(mine, 0, sizeof(float) * (size_t)(rows * width));
        int64_t i = lo;
        for (; i + 8 <= hi; i += 8) { /* eight rows of W a pass: 18% faster than four */
            const float *w0 = W + i * ld, *w1 = w0 + ld, *w2 = w1 + ld, *w3 = w2 + ld;
            const float *w4 = w3 + ld, *w5 = w4 + ld, *w6 = w5 + ld, *w7 = w6 + ld;
            for (int64_t r = 0; r < rows; r++) {
                const float *xr = x + r * in + i;
                const float x0 = xr[0], x1 = xr[1], x2 = xr[2], x3 = xr[3];
                const float x4 = xr[4], x5 = xr[5], x6 = xr[6], x7 = xr[7];
                float *acc = mine + r * width;
#pragma omp simd
                for (int64_t o = 0; o < out; o++)
                    acc[o] += (x0 * w0[o] + x1 * w1[o] + x2 * w2[o] + x3 * w3[o]) +
                              (x4 * w4[o] + x5 * w5[o] + x6 * w6[o] + x7 * w7[o]);
            }
        }
        for (; i < hi; i++) {
            const float *w0 = W + i * ld;
            for (int64_t r = 0; r < rows; r++) {
                const float x0 = x[r * in + i];
                float *acc = mine + r * width;
#pragma omp simd
                for (int64_t o = 0; o < out; o++) acc[o] += x0 * w0[o];
            }
        }
#pragma omp barrier
#pragma omp for schedule(static) collapse(2)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = 0; o < out; o++) {
                float sum = bias ? bias[o] : 0.0f;
                for (int k = 0; k < n; k++) sum += partial[(k * rows + r) * width + o];
                y[r * ldy + o] = sum;
            }
    }
    free(partial);
    return 0;
}

/* float32 against a matrix kept as [out, in] with rows `ld` floats apart (a tied head: x E^T
 * with E [V, d], the embedding itself): y[r, o] = E[o] . x[r] + b[o], y's rows `ldy` floats
 * apart; the threads share out the rows of E, each read once for every row of x. */
int64_t float32_dots(const float *E, int64_t ld, const float *bias, const float *x,
                     int64_t rows, int64_t in, int64_t out, float *y, int64_t ldy) {
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const float *e = E + o * ld;
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * in;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < in; i++) sum += e[i] * xr[i];
            y[r * ldy + o] = sum + (bias ? bias[o] : 0.0f);
        }
    }
    return 0;
}
