/* The products of blocks of 32 inputs: q4_0, q4_k and q8_0 (llama.cpp's Q4_0, Q4_K and Q8_0;
 * inference/formats/q4.py and q8.py pack them, native/__init__.py compiles this file with the
 * others): the activations quantized as llama.cpp's Q8_0 (q4_0, q8_0) or Q8_K (q4_k), then
 * blocks_q4.h's kernel on each 16-row block, the blocks shared out among OpenMP's threads
 * (torch's own). The kernel is AVX2 with FMA and F16C, which an AVX-512 build compiles and
 * runs too; elsewhere q4_here() is 0 and the PyTorch references run instead. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q4_KERNEL 1
#include <immintrin.h>
#include "blocks_q4.h"
#endif

/* 1 where this build has the kernel (and runs it on OpenMP's threads), else 0. */
int64_t q4_here(void) {
#if defined(Q4_KERNEL) && defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

#if defined(Q4_KERNEL)
/* Each row of x [rows, in] as llama.cpp's Q8_0 into xs [rows, in_pad] (blocks of 32: dx =
 * max|x| / 127 kept in fp16, xq = round(x 127 / max|x|) to the nearest even, as its x86
 * quantize_row_q8_0 rounds activations), with each block's sum of xq (xsum) and dx [rows,
 * in_pad / 32]. */
static void quantize_q8_0(const float *x, int64_t rows, int64_t in, int64_t in_pad, int8_t *xs,
                          int32_t *xsum, float *dx) {
    const int64_t n_in = in_pad / 32;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < n_in; b++) {
            const float *xb = x + r * in + b * 32;
            const int64_t n = in - b * 32 < 32 ? (in - b * 32 > 0 ? in - b * 32 : 0) : 32;
            float most = 0.0f;
            for (int64_t i = 0; i < n; i++) most = fabsf(xb[i]) > most ? fabsf(xb[i]) : most;
            const float scale = most / 127.0f, inv = most != 0.0f ? 127.0f / most : 0.0f;
            dx[r * n_in + b] = _cvtsh_ss(_cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT));
            int8_t *sb = xs + r * in_pad + b * 32;
            int32_t sum = 0;
            for (int64_t i = 0; i < 32; i++) {
                sb[i] = (int8_t)(i < n ? lrintf(xb[i] * inv) : 0);
                sum += sb[i];
            }
            xsum[r * n_in + b] = sum;
        }
}

/* Each row of x [rows, in] (in a multiple of 256) as llama.cpp's Q8_K (quantize_row_q8_K_ref):
 * per super-block of 256, max the value of largest magnitude (the first), iscale = -127 / max,
 * xq = min(127, round(iscale x)) to the nearest even, dx = 1 / iscale kept in fp32; dx is
 * written once for each of its eight blocks of 32, with each block's sum of xq (xsum). */
static void quantize_q8_k(const float *x, int64_t rows, int64_t in, int8_t *xs, int32_t *xsum,
                          float *dx) {
    const int64_t n_in = in / 32;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t s = 0; s < in / 256; s++) {
            const float *xb = x + r * in + s * 256;
            float most = 0.0f, amax = 0.0f;
            for (int64_t i = 0; i < 256; i++)
                if (fabsf(xb[i]) > amax) amax = fabsf(xb[i]), most = xb[i];
            const float iscale = amax != 0.0f ? -127.0f / most : 0.0f;
            int8_t *sb = xs + r * in + s * 256;
            for (int64_t b = 0; b < 8; b++) {
                int32_t sum = 0;
                for (int64_t i = 32 * b; i < 32 * b + 32; i++) {
                    const long v = lrintf(iscale * xb[i]);
                    sb[i] = (int8_t)(v > 127 ? 127 : v);
                    sum += sb[i];
                }
                xsum[r * n_in + s * 8 + b] = sum;
                dx[r * n_in + s * 8 + b] = amax != 0.0f ? 1.0f / iscale : 0.0f;
            }
        }
}

/* The three share it: x quantized (Q8_0 for q4_0 and q8_0, Q8_K for q4_k, as llama.cpp pairs
 * them), then the 16-row blocks shared out among the threads. */
static int64_t q4_product(const uint8_t *blocks, const uint16_t *d, const uint8_t *scm,
                          int kind, const float *bias, const float *x, int64_t rows, int64_t in,
                          int64_t in_pad, int64_t out, float *y) {
    const int64_t n_in = in_pad / 32;
    int8_t *xs = aligned_alloc(64, (size_t)(rows * in_pad));
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)(rows * n_in));
    float *dx = malloc(sizeof(float) * (size_t)(rows * n_in));
    if (!xs || !xsum || !dx) {
        free(xs), free(xsum), free(dx);
        return -2;
    }
    if (kind == Q4_K)
        quantize_q8_k(x, rows, in, xs, xsum, dx);
    else
        quantize_q8_0(x, rows, in, in_pad, xs, xsum, dx);
    const int64_t n_blocks = (out + 15) / 16;
    const int64_t per_d = kind == Q4_K ? 32 * (in_pad / 256) : 16 * n_in; /* a 16-row block's d */
    const int64_t per_w = kind == Q8_0 ? 16 * in_pad : 8 * in_pad;          /* and bytes */
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n_blocks; j++)
        q4_block(blocks + j * per_w, d + j * per_d, scm ? scm + j * 32 * n_in : NULL, kind,
                 xs, xsum, dx, bias ? bias + j * 16 : NULL, rows, in_pad, out, out - j * 16,
                 y + j * 16);
    free(xs), free(xsum), free(dx);
    return 0;
}
#endif

/* q4_0 (blocks_q4.h): blocks [out_pad/16][in_pad/32][8][32] uint8 and scales
 * [out_pad/16][in_pad/32][16] fp16 (as uint16_t), in_pad a multiple of 32 (padding: q = 8,
 * the weight 0); bias [out_pad] or NULL; x [rows, in] fp32; y [rows, out] fp32. Each row of x
 * is quantized first as llama.cpp's Q8_0 (blocks of 32: dx = max|x| / 127 kept in fp16, xq =
 * round(x / dx) with 1 / dx in fp32, halves away from zero). Returns 0, -1 where this build
 * has no q4_0 kernel, -2 without memory. */
int64_t q4_0_product(const uint8_t *blocks, const uint16_t *scales, const float *bias,
                     const float *x, int64_t rows, int64_t in, int64_t in_pad, int64_t out,
                     float *y) {
#if defined(Q4_KERNEL)
    return q4_product(blocks, scales, NULL, Q4_0, bias, x, rows, in, in_pad, out, y);
#else
    (void)blocks, (void)scales, (void)bias, (void)x, (void)rows, (void)in, (void)in_pad;
    (void)out, (void)y;
    return -1;
#endif
}

/* q4_k (blocks_q4.h): blocks as q4_0's, in_pad = in a multiple of 256; scm [out_pad/16]
 * [in_pad/32][32] uint8 (the 16 rows' sc, then their m); d [out_pad/16][in_pad/256][32] fp16
 * (the 16 rows' d, then their dmin). Each row of x is quantized first as llama.cpp's Q8_K
 * (quantize_q8_k). Returns as q4_0_product. */
int64_t q4_k_product(const uint8_t *blocks, const uint16_t *d, const uint8_t *scm,
                     const float *bias, const float *x, int64_t rows, int64_t in, int64_t in_pad,
                     int64_t out, float *y) {
#if defined(Q4_KERNEL)
    return q4_product(blocks, d, scm, Q4_K, bias, x, rows, in, in_pad, out, y);
#else
    (void)blocks, (void)d, (void)scm, (void)bias, (void)x, (void)rows, (void)in, (void)in_pad;
    (void)out, (void)y;
    return -1;
#endif
}


/* q8_0 (blocks_q4.h): blocks [out_pad/16][in_pad/32][8][64] int8 and scales as q4_0's (padding:
 * q = 0); the rest as q4_0_product, x quantized as Q8_0. */
int64_t q8_0_product(const int8_t *blocks, const uint16_t *scales, const float *bias,
                     const float *x, int64_t rows, int64_t in, int64_t in_pad, int64_t out,
                     float *y) {
#if defined(Q4_KERNEL)
    return q4_product((const uint8_t *)blocks, scales, NULL, Q8_0, bias, x, rows, in, in_pad, out, y);
#else
    (void)blocks, (void)scales, (void)bias, (void)x, (void)rows, (void)in, (void)in_pad;
    (void)out, (void)y;
    return -1;
#endif
}
