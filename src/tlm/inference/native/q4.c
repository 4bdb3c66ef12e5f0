/* The 4-bit products, q4_0 and q4_k (llama.cpp's Q4_0 and Q4_K; inference/formats/q4.py
 * packs them, native/__init__.py compiles this file with the others): the activations
 * quantized as llama.cpp's Q8_0, then blocks_q4.h's kernel on each 16-row block, the blocks
 * shared out among OpenMP's threads (torch's own). The kernel is AVX2 with FMA and F16C, which
 * an AVX-512 build compiles and runs too; elsewhere q4_here() is 0 and q4.py's PyTorch
 * reference runs instead. */
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
 * max|x| / 127 kept in fp16, xq = round(x / dx) with 1 / dx in fp32, halves away from zero),
 * with each block's sum of xq (xsum) and dx [rows, in_pad / 32]. */
static void quantize_q8_0(const float *x, int64_t rows, int64_t in, int64_t in_pad, int8_t *xs,
                          int32_t *xsum, float *dx) {
    const int64_t n_in = in_pad / 32;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < n_in; b++) {
            const float *xb = x + r * in + b * 32;
            const int64_t n = in - b * 32 < 32 ? (in - b * 32 > 0 ? in - b * 32 : 0) : 32;
            float most = 0.0f;
            for (int64_t i = 0; i < n; i++) most = fabsf(xb[i]) > most ? fabsf(xb[i]) : most;
            const float scale = most / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
            dx[r * n_in + b] = _cvtsh_ss(_cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT));
            int8_t *sb = xs + r * in_pad + b * 32;
            int32_t sum = 0;
            for (int64_t i = 0; i < 32; i++) {
                sb[i] = (int8_t)(i < n ? (int32_t)roundf(xb[i] * inv) : 0);
                sum += sb[i];
            }
            xsum[r * n_in + b] = sum;
        }
}

/* q4_0 and q4_k share it: x quantized, then the 16-row blocks shared out among the threads. */
static int64_t q4_product(const uint8_t *blocks, const uint16_t *d, const uint8_t *scm,
                          int kquant, const float *bias, const float *x, int64_t rows, int64_t in,
                          int64_t in_pad, int64_t out, float *y) {
    const int64_t n_in = in_pad / 32;
    int8_t *xs = aligned_alloc(64, (size_t)(rows * in_pad));
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)(rows * n_in));
    float *dx = malloc(sizeof(float) * (size_t)(rows * n_in));
    if (!xs || !xsum || !dx) {
        free(xs), free(xsum), free(dx);
        return -2;
    }
    quantize_q8_0(x, rows, in, in_pad, xs, xsum, dx);
    const int64_t n_blocks = (out + 15) / 16;
    const int64_t per_d = kquant ? 32 * (in_pad / 256) : 16 * n_in; /* a 16-row block's d */
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n_blocks; j++)
        q4_block(blocks + j * 8 * in_pad, d + j * per_d, scm ? scm + j * 32 * n_in : NULL, kquant,
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
    return q4_product(blocks, scales, NULL, 0, bias, x, rows, in, in_pad, out, y);
#else
    (void)blocks, (void)scales, (void)bias, (void)x, (void)rows, (void)in, (void)in_pad;
    (void)out, (void)y;
    return -1;
#endif
}

/* q4_k (blocks_q4.h): blocks as q4_0's, in_pad a multiple of 256; scm [out_pad/16][in_pad/32]
 * [32] uint8 (the 16 rows' sc, then their m); d [out_pad/16][in_pad/256][32] fp16 (the 16
 * rows' d, then their dmin). Returns as q4_0_product. */
int64_t q4_k_product(const uint8_t *blocks, const uint16_t *d, const uint8_t *scm,
                     const float *bias, const float *x, int64_t rows, int64_t in, int64_t in_pad,
                     int64_t out, float *y) {
#if defined(Q4_KERNEL)
    return q4_product(blocks, d, scm, 1, bias, x, rows, in, in_pad, out, y);
#else
    (void)blocks, (void)d, (void)scm, (void)bias, (void)x, (void)rows, (void)in, (void)in_pad;
    (void)out, (void)y;
    return -1;
#endif
}

