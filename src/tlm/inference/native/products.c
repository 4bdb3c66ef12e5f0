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
 * Each kernel is written twice, for the two vector widths of x86 CPUs, and the build picks
 * one by what the compiler targets (-march=native, or the build TLM_NATIVE_ARCH names):
 * AVX-512 (int8 with VNNI) as a 64-byte line's 16 lanes of one register, and AVX2 with FMA
 * and F16C as the line's two halves in two registers of 8 lanes (int8 by AVX-VNNI where the
 * CPU has it, else by vpmaddubsw: see int8_rows). Both compute the same sums. `products_here`
 * says which were compiled, `isa_here` for which instruction set, and blocked.py uses
 * fbgemm's kernels where none were.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The instruction set of this build's kernels: 512-bit (AVX-512F, int8 with VNNI) or 256-bit
 * (AVX2 with FMA and F16C; int8 with AVX-VNNI where the compiler targets it). */
#if defined(__AVX512F__)
#define WIDE 1
#if defined(__AVX512VNNI__)
#define INT8_KERNEL 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HALVES 1
#define INT8_KERNEL 1
#endif
#if defined(HALVES) && !defined(__AVXVNNI__)
#define BY_SIGNS 1 /* int8 by vpmaddubsw: x as |xq| and its signs */
#else
#define BY_SIGNS 0 /* int8 by VNNI: x as xq + 128 */
#endif

/* Which kernels this build has: bit 0 int8, bit 1 float16 and float32 blocks, bit 2 set
 * when they run on OpenMP's threads (built with -fopenmp, not -fopenmp-simd), bit 3 float32
 * panels (a prompt's rows; AVX2 builds only); q4.c's kernels say so themselves (q4_here). */
int64_t products_here(void) {
    int64_t here = 0;
#if defined(_OPENMP)
    here |= 4;
#endif
#if defined(INT8_KERNEL)
    here |= 1;
#endif
#if defined(WIDE) || defined(HALVES)
    here |= 2;
#endif
#if defined(HALVES)
    here |= 8;
#endif
    return here;
}

/* The instruction sets the kernels of this build use (native.py's ISA): 1 AVX-512F, 2
 * AVX-512 VNNI, 4 AVX512_BF16 (attention.c's), 8 AVX2 with FMA and F16C, 16 AVX-VNNI. */
int64_t isa_here(void) {
    int64_t isa = 0;
#if defined(WIDE)
    isa |= 1;
#if defined(__AVX512VNNI__)
    isa |= 2;
#endif
#if defined(__AVX512BF16__)
    isa |= 4;
#endif
#elif defined(HALVES)
    isa |= 8;
#if defined(__AVXVNNI__)
    isa |= 16;
#endif
#endif
    return isa;
}

/* One block j of 16 output rows, for every row of x: int8_block and float_block, written
 * once per vector width, with the same arguments and the same sums. */
#if defined(WIDE)
#include "blocks_avx512.h"
#elif defined(HALVES)
#include "blocks_avx2.h"
#endif

/* int8: W ~ scale[o] * q[o, i], q in [-127, 127] (one scale per output row). Each row of x
 * is quantized the same way, x ~ sx * xq with sx = max|x| / 127, and the block kernels sum
 * sum_i xq_i q_oi exactly in 32-bit integers; y[o] = sx scale[o] that + b[o]. VNNI's
 * unsigned-by-signed product reads xq + 128 (then sum_i (xq_i + 128) q_oi - 128 wsum[o] is
 * the sum, wsum[o] = sum_i q_oi); AVX2's vpmaddubsw reads |xq| and takes xq's signs apart
 * (BY_SIGNS, blocks_avx2.h says why).
 * blocks: [out_pad/16][in_pad/4][16][4] int8, in_pad a multiple of 16; scale, wsum and bias
 * [out_pad], out_pad a multiple of 16 (padding is zero); x [rows, in] fp32; y [rows, out]
 * fp32. Returns 0, -1 where this build has no int8 kernel, -2 without memory. */
int64_t int8_product(const int8_t *blocks, const float *scale, const int32_t *wsum,
                     const float *bias, const float *x, int64_t rows, int64_t in,
                     int64_t in_pad, int64_t out, float *y) {
#if defined(INT8_KERNEL)
    uint8_t *xu = aligned_alloc(64, (size_t)(2 * rows * in_pad));
    int8_t *xs = (int8_t *)(xu + rows * in_pad); /* xq itself, for its signs (BY_SIGNS) */
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
        int8_t *sr = xs + r * in_pad;
#pragma omp simd
        for (int64_t i = 0; i < in; i++) {
            const int32_t q = (int32_t)nearbyintf(xr[i] * inv);
            sr[i] = (int8_t)q;
            ur[i] = (uint8_t)(BY_SIGNS ? (q < 0 ? -q : q) : q + 128);
        }
        memset(ur + in, BY_SIGNS ? 0 : 128, (size_t)(in_pad - in)); /* xq = 0 at the padding */
        memset(sr + in, 0, (size_t)(in_pad - in));
    }
    const int64_t n_blocks = (out + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n_blocks; j++)
        int8_block(blocks + j * 16 * in_pad, xu, xs, sx, scale + j * 16, wsum + j * 16,
                   bias ? bias + j * 16 : NULL, rows, in_pad, out, out - j * 16, y + j * 16);
    free(xu), free(sx);
    return 0;
#else
    return -1;
#endif
}

/* float16 (widened to fp32 as it is read) or float32 blocks: y = x W^T + b in fp32 (inlined
 * into each caller, so that `fp32` is a constant in the loops). */
#if defined(WIDE) || defined(HALVES)
static inline __attribute__((always_inline)) void float_product(const void *blocks, int fp32,
                                                                const float *bias, const float *x,
                                                                int64_t rows, int64_t in,
                                                                int64_t out, float *y) {
    const int64_t n_blocks = (out + 15) / 16, block = 16 * in * (fp32 ? 4 : 2);
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n_blocks; j++)
        float_block((const char *)blocks + j * block, fp32, bias ? bias + j * 16 : NULL, x, rows,
                    in, out, out - j * 16, y + j * 16);
}
#endif

/* float16: W in fp16, widened to fp32 as it is read; the arithmetic is fp32.
 * blocks: [out_pad/16][in][16] fp16 (as uint16_t) and bias [out_pad], out_pad a multiple of
 * 16 (padding is zero); x [rows, in] fp32; y [rows, out] fp32. Returns 0, or -1 where this
 * build has no float16 kernel. */
int64_t float16_product(const uint16_t *blocks, const float *bias, const float *x,
                        int64_t rows, int64_t in, int64_t out, float *y) {
#if defined(WIDE) || defined(HALVES)
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
#if defined(WIDE) || defined(HALVES)
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

/* float32 for the rows of a prompt, on the model's own W [in, out] (rows `ld` floats apart),
 * nothing kept between calls: each thread copies a panel of 16 outputs input by input
 * (p [in][16]: 48 KB for in = 768, in the core's L2), then runs every row of x against it
 * six rows at a time (blocks_avx2.h's float_panel: each panel line loaded once for six rows,
 * where torch's product for a few dozen rows reached 70-110 GFLOP/s on the 2-core AVX2
 * host and this 120-145). y [rows, out]. Returns 0, -1 where this build has no such kernel
 * (an AVX-512 build: torch's product, whose kernels have the wider registers; not measured
 * against these), or -2 without memory. */
int64_t float32_panels(const float *W, int64_t ld, const float *bias, const float *x,
                       int64_t rows, int64_t in, int64_t out, float *y) {
#if defined(HALVES)
#if defined(_OPENMP)
    const int threads = omp_get_max_threads();
#else
    const int threads = 1;
#endif
    float *panels = aligned_alloc(64, sizeof(float) * 16 * (size_t)(threads * in));
    if (!panels) return -2;
    const int64_t n_panels = (out + 15) / 16;
#pragma omp parallel num_threads(threads)
    {
#if defined(_OPENMP)
        float *p = panels + 16 * in * omp_get_thread_num();
#else
        float *p = panels;
#endif
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n_panels; j++) {
            const int64_t left = out - j * 16 < 16 ? out - j * 16 : 16;
            float b[16] = {0};
            if (bias) memcpy(b, bias + j * 16, sizeof(float) * (size_t)left);
            for (int64_t i = 0; i < in; i++) {
                memcpy(p + i * 16, W + i * ld + j * 16, sizeof(float) * (size_t)left);
                if (left < 16) /* lanes never stored; zeros, not garbage that may be subnormal */
                    memset(p + i * 16 + left, 0, sizeof(float) * (size_t)(16 - left));
            }
            float_panel(p, b, x, rows, in, out, left, y + j * 16);
        }
    }
    free(panels);
    return 0;
#else
    (void)W, (void)ld, (void)bias, (void)x, (void)rows, (void)in, (void)out, (void)y;
    return -1;
#endif
}

/* float32 against a matrix kept as [out, in] with rows `ld` floats apart (a tied head: x E^T
 * with E [V, d], the embedding itself): y[r, o] = E[o] . x[r] + b[o], y's rows `ldy` floats
 * apart; the threads share out the rows of E, each read once for every row of x. */
int64_t float32_dots(const float *E, int64_t ld, const float *bias, const float *x,
                     int64_t rows, int64_t in, int64_t out, float *y, int64_t ldy) {
    const int64_t fours = out / 4;
#pragma omp parallel for schedule(static)
    for (int64_t f = 0; f < fours; f++) { /* four rows of E at once: four sums under way */
        const int64_t o = 4 * f;
        const float *e0 = E + o * ld, *e1 = e0 + ld, *e2 = e1 + ld, *e3 = e2 + ld;
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * in;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t i = 0; i < in; i++) {
                s0 += e0[i] * xr[i];
                s1 += e1[i] * xr[i];
                s2 += e2[i] * xr[i];
                s3 += e3[i] * xr[i];
            }
            float *yr = y + r * ldy + o;
            yr[0] = s0 + (bias ? bias[o] : 0.0f);
            yr[1] = s1 + (bias ? bias[o + 1] : 0.0f);
            yr[2] = s2 + (bias ? bias[o + 2] : 0.0f);
            yr[3] = s3 + (bias ? bias[o + 3] : 0.0f);
        }
    }
    for (int64_t o = 4 * fours; o < out; o++) { /* the last few */
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
