/* Causal attention for training under bf16 autocast, on a CPU with AVX512_BF16
 * (tlm/inference/native.py compiles this file with step.c; attention.py calls it).
 *
 * The same equations as model/attention.py: S = QK^T / sqrt(d_head) (eq. 9.11), masked above
 * the diagonal (Fig. 9.9), P = softmax(S) row by row (eq. 9.12), O = PV (eq. 9.13), and their
 * backward: dV = P^T dO, dP = dO V^T, dS = P o (dP - D) with D_i = sum_c dO_ic O_ic, dQ =
 * dS K / sqrt(d_head), dK = dS^T Q / sqrt(d_head). Every product takes bf16 operands and adds
 * in fp32 (vdpbf16ps: 16 sums of two products each); the scores, the softmax, O and every
 * gradient stay fp32, and only P and dS are rounded to bf16 to enter their products, as q,
 * k, v already are (autocast's products make them). PyTorch's CPU kernel in this place
 * runs at ~56 GFLOP/s, a sixth of the bf16 peak (docs/benchmarks.md).
 *
 * One head at a time on each of OpenMP's threads (torch's own, as in step.c): its rows are
 * copied into the layouts the products read (T rounded up to Tp, a multiple of 32, with
 * zeros), and each product is a row of tiles of 8 rows by 32 columns whose 16 sums stay in
 * registers over the whole inner dimension. An operand B of a product is "paired": the two
 * values that one instruction multiplies, B[2p][j] and B[2p+1][j], side by side, 16 columns
 * j in 64 bytes; an operand A is read a pair at a time, A[i][2p], A[i][2p+1] broadcast to
 * every lane. The forward pass works on 8 query rows at a time (their scores are only as
 * wide as the causal window needs); the backward pass on 8 key rows at a time, computing
 * S^T and dP^T so that P^T = exp(S^T - L) needs no sum across a row (L, each query's
 * log-sum-exp, is kept from the forward pass), then dV and dK from those rows; dQ = dS K
 * comes last, from dS^T paired along the keys, whose pairs are also dS's rows read as A.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_rows.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define ATTENTION_BF16 1
#endif

/* 1 where this build has the kernel (AVX512_BF16, -march=native), else 0. */
int64_t attention_here(void) {
#if defined(ATTENTION_BF16)
    return 1;
#else
    return 0;
#endif
}

#if defined(ATTENTION_BF16)
enum { ROWS = 8, COLS = 32 }; /* a tile: 8 rows by two vectors of 16 columns */

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* C[m][0..32) = sum over pairs p in [p0, p1) of A's pair (m, p) . B[p][column][0..1], for
 * the tile's 8 rows m. A's pair (m, p) is at A + m*lda + p*pa: pa = 2 for a row-major A,
 * else the rows of a paired matrix read as A. B: paired, ldb columns a pair; C: rows of ldc. */
static inline void tile(const uint16_t *A, int64_t lda, int64_t pa, const uint16_t *B,
                        int64_t ldb, int64_t p0, int64_t p1, float *C, int64_t ldc) {
    __m512 acc[ROWS][2];
    for (int m = 0; m < ROWS; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t p = p0; p < p1; p++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B + 2 * p * ldb);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(B + 2 * p * ldb + 32);
        for (int m = 0; m < ROWS; m++) {
            int32_t pair;
            memcpy(&pair, A + m * lda + p * pa, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
        }
    }
    for (int m = 0; m < ROWS; m++) {
        _mm512_storeu_ps(C + m * ldc, acc[m][0]);
        _mm512_storeu_ps(C + m * ldc + 16, acc[m][1]);
    }
}

/* dst[0..n) = bf16(src[0..n)), n a multiple of 16. */
static inline void round_row(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t j = 0; j < n; j += 16)
        _mm256_storeu_si256((__m256i *)(dst + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + j)));
}

typedef uint32_t __attribute__((may_alias)) pair_t; /* two bf16 values read as one */

/* plain [Tp][d] = one head's rows t < T of x (rows `stride` apart), then zero rows to Tp. */
static void copy_rows(const uint16_t *x, int64_t stride, int64_t T, int64_t Tp, int64_t d,
                      uint16_t *plain) {
    for (int64_t t = 0; t < T; t++) memcpy(plain + t * d, x + t * stride, 2 * (size_t)d);
    memset(plain + T * d, 0, 2 * (size_t)((Tp - T) * d));
}

/* plain [Tp][d] paired along d: [d/2][Tp][2], the pairs of a row being side by side already. */
static void pair_columns(const uint16_t *plain, int64_t Tp, int64_t d, uint16_t *paired) {
    const pair_t *from = (const pair_t *)plain;
    pair_t *to = (pair_t *)paired;
    for (int64_t t = 0; t < Tp; t++)
        for (int64_t c = 0; c < d / 2; c++) to[c * Tp + t] = from[t * (d / 2) + c];
}

/* rows [2 pairs][width] paired along the rows: paired[p][i] = (rows[2p][i], rows[2p+1][i]),
 * for i from 0, or with `diagonal` from the first of the pair's 32-column block (the
 * columns the backward pass wrote). width a multiple of 16. */
static void pair_rows(const uint16_t *rows, int64_t pairs, int64_t width, int diagonal,
                      uint16_t *paired) {
    for (int64_t p = 0; p < pairs; p++)
        for (int64_t i = diagonal ? 2 * p / COLS * COLS : 0; i < width; i += 16) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(rows + 2 * p * width + i));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(rows + (2 * p + 1) * width + i));
            const __m256i low = _mm256_unpacklo_epi16(a, b), high = _mm256_unpackhi_epi16(a, b);
            uint16_t *out = paired + (p * width + i) * 2;
            _mm256_storeu_si256((__m256i *)out, _mm256_permute2x128_si256(low, high, 0x20));
            _mm256_storeu_si256((__m256i *)(out + 16), _mm256_permute2x128_si256(low, high, 0x31));
        }
}

/* The forward pass of one head: o [T][d] (rows `so` apart) and lse [T] from q, k, v. */
static void forward_head(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t sq,
                         int64_t T, int64_t d, float scale, float *o, int64_t so, float *lse,
                         uint16_t *work, int64_t window) {
    const int64_t Tp = (T + COLS - 1) / COLS * COLS;
    uint16_t *Q = work, *K = Q + Tp * d, *V = K + Tp * d, *P = V + Tp * d; /* P [8][Tp] */
    uint16_t *plain = P + ROWS * Tp;
    float *S = (float *)(plain + Tp * d), *O = S + ROWS * Tp; /* O [8][d] */
    copy_rows(q, sq, T, Tp, d, Q);
    copy_rows(k, sq, T, Tp, d, plain);
    pair_columns(plain, Tp, d, K); /* K paired along d: S = Q K^T */
    copy_rows(v, sq, T, Tp, d, plain);
    pair_rows(plain, Tp / 2, d, 0, V); /* V paired along t: O = P V */
    for (int64_t i0 = 0; i0 < T; i0 += ROWS) {
        const int64_t width = (i0 + ROWS + COLS - 1) / COLS * COLS; /* keys the rows may see */
        const int64_t low = first_key(i0, window) / COLS * COLS; /* none left of it (a window) */
        for (int64_t j0 = low; j0 < width; j0 += COLS) /* S = Q K^T (eq. 9.11) */
            tile(Q + i0 * d, d, 2, K + 2 * j0, Tp, 0, d / 2, S + j0, Tp);
        for (int64_t m = 0; m < ROWS; m++) { /* P = softmax(S / sqrt(d)) over j <= i (eq. 9.12) */
            const int64_t i = i0 + m;
            const float logsum = softmax_row(S + m * Tp, i < T ? first_key(i, window) : 0,
                                               i < T ? i + 1 : 1, width, scale);
            round_row(P + m * Tp, S + m * Tp, width);
            if (i < T) lse[i] = logsum;
        }
        for (int64_t c0 = 0; c0 < d; c0 += COLS) /* O = P V (eq. 9.13) */
            tile(P, Tp, 2, V + 2 * c0, d, low / 2, width / 2, O + c0, d);
        for (int64_t m = 0; m < ROWS && i0 + m < T; m++)
            memcpy(o + (i0 + m) * so, O + m * d, sizeof(float) * (size_t)d);
    }
}

/* The backward pass of one head: dq, dk, dv [T][d] (rows `sg` apart) from q, k, v, the
 * forward pass's o and lse, and dout, the gradient of o (rows `so` apart, as o's). */
static void backward_head(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t sq,
                          int64_t T, int64_t d, float scale, const float *o, const float *dout,
                          int64_t so, const float *lse, float *dq, float *dk, float *dv,
                          int64_t sg, uint16_t *work, int64_t window) {
    const int64_t Tp = (T + COLS - 1) / COLS * COLS, T8 = (T + ROWS - 1) / ROWS * ROWS;
    uint16_t *Kr = work, *Vr = Kr + Tp * d, *Qd = Vr + Tp * d, *Qt = Qd + Tp * d;
    uint16_t *Gd = Qt + Tp * d, *Gt = Gd + Tp * d, *Kj = Gt + Tp * d; /* G = dO */
    uint16_t *PT = Kj + Tp * d, *dST = PT + Tp * Tp, *dSp = dST + Tp * Tp, *plain = dSp + Tp * Tp;
    float *ST = (float *)(plain + Tp * d), *dPT = ST + ROWS * Tp, *L = dPT + ROWS * Tp;
    float *D = L + Tp, *rows = D + Tp; /* rows [8][d]: gradients on their way out */
    copy_rows(k, sq, T, Tp, d, Kr);
    pair_rows(Kr, Tp / 2, d, 0, Kj);
    copy_rows(v, sq, T, Tp, d, Vr);
    copy_rows(q, sq, T, Tp, d, plain);
    pair_columns(plain, Tp, d, Qd);
    pair_rows(plain, Tp / 2, d, 0, Qt);
    for (int64_t t = 0; t < Tp; t++) { /* dO in bf16; D_t = dO_t . O_t */
        float total = 0.0f;
        if (t < T) {
            round_row(plain + t * d, dout + t * so, d);
#pragma omp simd reduction(+ : total)
            for (int64_t c = 0; c < d; c++) total += from_bf16(plain[t * d + c]) * o[t * so + c];
        } else
            memset(plain + t * d, 0, 2 * (size_t)d);
        D[t] = total;
        L[t] = t < T ? lse[t] : 0.0f;
    }
    pair_columns(plain, Tp, d, Gd);
    pair_rows(plain, Tp / 2, d, 0, Gt);
    for (int64_t j0 = 0; j0 < T; j0 += ROWS) { /* 8 keys j at a time, every query i >= j */
        const int64_t first = j0 / COLS * COLS, last = last_query(j0, ROWS, window, COLS, Tp);
        for (int64_t i0 = first; i0 < last; i0 += COLS) {
            tile(Kr + j0 * d, d, 2, Qd + 2 * i0, Tp, 0, d / 2, ST + i0, Tp); /* S^T = K Q^T */
            tile(Vr + j0 * d, d, 2, Gd + 2 * i0, Tp, 0, d / 2, dPT + i0, Tp); /* dP^T = V dO^T */
        }
        for (int64_t m = 0; m < ROWS; m++) {
            const int64_t j = j0 + m;
            float *p = ST + m * Tp, *ds = dPT + m * Tp;
            gradient_row(p, ds, L, D, j, first, last, T, window, scale); /* P^T, dS^T */
            round_row(PT + j * Tp + first, p + first, last - first);
            round_row(dST + j * Tp + first, ds + first, last - first);
            memset(PT + j * Tp + last, 0, 2 * (size_t)(Tp - last)); /* past the window */
            memset(dST + j * Tp + last, 0, 2 * (size_t)(Tp - last));
        }
        for (int64_t pass = 0; pass < 2; pass++) { /* dV = P^T dO, then dK = dS^T Q */
            const uint16_t *A = (pass ? dST : PT) + j0 * Tp, *Bp = pass ? Qt : Gt;
            float *grad = pass ? dk : dv;
            for (int64_t c0 = 0; c0 < d; c0 += COLS)
                tile(A, Tp, 2, Bp + 2 * c0, d, first / 2, last / 2, rows + c0, d);
            for (int64_t m = 0; m < ROWS && j0 + m < T; m++)
                memcpy(grad + (j0 + m) * sg, rows + m * d, sizeof(float) * (size_t)d);
        }
    }
    pair_rows(dST, T8 / 2, Tp, 1, dSp); /* dS paired along j: its rows i are A's rows */
    for (int64_t i0 = 0; i0 < T; i0 += ROWS) { /* dQ = dS K, over the keys j < i0 + 8 */
        const int64_t low = first_key(i0, window) / 2; /* the first pair of keys it sees */
        for (int64_t c0 = 0; c0 < d; c0 += COLS)
            tile(dSp + 2 * i0, 2, 2 * Tp, Kj + 2 * c0, d, low, (i0 + ROWS) / 2, rows + c0, d);
        for (int64_t m = 0; m < ROWS && i0 + m < T; m++)
            memcpy(dq + (i0 + m) * sg, rows + m * d, sizeof(float) * (size_t)d);
    }
}
#endif

/* The forward pass for B*H heads of T positions: q, k, v bf16 with element (b, h, t, c) at
 * b*sb + h*sh + t*st + c (the same strides for all three); o fp32 with its own strides
 * (ob, oh, ot); lse fp32 [B][H][T]. d a multiple of 32. Returns 0, -1 where this build has
 * no kernel, -2 without memory. */
int64_t attention_forward(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t B,
                          int64_t H, int64_t T, int64_t d, int64_t sb, int64_t sh, int64_t st,
                          float *o, int64_t ob, int64_t oh, int64_t ot, float *lse, int64_t window) {
#if defined(ATTENTION_BF16)
    const int64_t Tp = (T + COLS - 1) / COLS * COLS;
    const size_t bytes = 2 * (size_t)(4 * Tp * d + ROWS * Tp) + 4 * (size_t)(ROWS * Tp + ROWS * d);
    int64_t failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        uint16_t *work = aligned_alloc(64, (bytes + 63) / 64 * 64);
        failed = work == NULL;
#pragma omp for schedule(dynamic)
        for (int64_t n = 0; n < B * H; n++) {
            const int64_t b = n / H, h = n % H, at = b * sb + h * sh;
            if (work)
                forward_head(q + at, k + at, v + at, st, T, d, 1.0f / sqrtf((float)d),
                             o + b * ob + h * oh, ot, lse + n * T, work, window);
        }
        free(work);
    }
    return failed ? -2 : 0;
#else
    (void)q, (void)k, (void)v, (void)B, (void)H, (void)T, (void)d, (void)sb, (void)sh, (void)st;
    (void)o, (void)ob, (void)oh, (void)ot, (void)lse, (void)window;
    return -1;
#endif
}

/* The backward pass for the heads of attention_forward: q, k, v and their strides as there;
 * o, dout (the gradient of o) and lse as attention_forward wrote them (dout with o's
 * strides); dq, dk, dv fp32 with strides (gb, gh, gt). Returns 0, -1 where this build has no
 * kernel, -2 without memory. */
int64_t attention_backward(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t B,
                           int64_t H, int64_t T, int64_t d, int64_t sb, int64_t sh, int64_t st,
                           const float *o, const float *dout, int64_t ob, int64_t oh, int64_t ot,
                           const float *lse, float *dq, float *dk, float *dv, int64_t gb,
                           int64_t gh, int64_t gt, int64_t window) {
#if defined(ATTENTION_BF16)
    const int64_t Tp = (T + COLS - 1) / COLS * COLS;
    const size_t bytes = 2 * (size_t)(8 * Tp * d + 3 * Tp * Tp) + 4 * (size_t)(2 * ROWS * Tp + 2 * Tp + ROWS * d);
    int64_t failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        uint16_t *work = aligned_alloc(64, (bytes + 63) / 64 * 64);
        failed = work == NULL;
#pragma omp for schedule(dynamic)
        for (int64_t n = 0; n < B * H; n++) {
            const int64_t b = n / H, h = n % H, at = b * sb + h * sh, out = b * ob + h * oh;
            const int64_t grad = b * gb + h * gh;
            if (work)
                backward_head(q + at, k + at, v + at, st, T, d, 1.0f / sqrtf((float)d), o + out,
                              dout + out, ot, lse + n * T, dq + grad, dk + grad, dv + grad, gt,
                              work, window);
        }
        free(work);
    }
    return failed ? -2 : 0;
#else
    (void)q, (void)k, (void)v, (void)B, (void)H, (void)T, (void)d, (void)sb, (void)sh, (void)st;
    (void)o, (void)dout, (void)ob, (void)oh, (void)ot, (void)lse, (void)dq, (void)dk, (void)dv;
    (void)gb, (void)gh, (void)gt, (void)window;
    return -1;
#endif
}
