/* Causal attention for fp32 training on a CPU, on any instruction set the compiler knows
 * (tlm/inference/native.py compiles this file with attention.c; attention.py calls it).
 *
 * The equations of attention.c, all in fp32: S = QK^T / sqrt(d_head) (eq. 9.11), masked
 * above the diagonal (Fig. 9.9), P = softmax(S) row by row (eq. 9.12), O = PV (eq. 9.13);
 * backward dV = P^T dO, dP = dO V^T, dS = P o (dP - D) with D_i = sum_c dO_ic O_ic, dQ =
 * dS K / sqrt(d_head), dK = dS^T Q / sqrt(d_head). PyTorch's CPU kernel in this place runs
 * at 40-64 GFLOP/s on nanoGPT's shapes (docs/benchmarks.md).
 *
 * Written with the compiler's vector types, so that -march=native makes them AVX-512's 16
 * lanes, AVX2's 8 or NEON's 4, and every product a row of tiles of ROWS rows by two vectors
 * of columns whose sums stay in registers over the whole inner dimension, B's row of two
 * vectors loaded once for all ROWS rows of A, each of A's values broadcast to every lane.
 * One head at a time on each of OpenMP's threads (torch's own, as in attention.c): K^T, Q^T
 * and dO^T transposed, T rounded up to Tp, a multiple of COLS, with zeros; q, k, v and dO
 * read in place where T == Tp, else copied with zero rows to Tp. Then the passes of
 * attention.c, with its row equations (attention_rows.h): the forward pass ROWS query rows
 * at a time, only as wide as their causal window; the backward pass ROWS key rows at a
 * time, computing S^T and dP^T so that P^T = exp(S^T - L) needs no sum across a row (L,
 * each query's log-sum-exp, kept from the forward pass), then dV and dK from those rows;
 * dQ = dS K last, reading dS^T by columns.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_rows.h"

#if defined(__AVX512F__)
enum { LANES = 16, ROWS = 8, NV = 2 }; /* 16 sums of 16 lanes in 32 registers */
#elif defined(__AVX__)
enum { LANES = 8, ROWS = 4, NV = 2 }; /* 8 sums of 8 lanes in 16 registers */
#else
enum { LANES = 4, ROWS = 4, NV = 2 };
#endif
enum { COLS = NV * LANES }; /* a tile: ROWS rows by NV vectors */

typedef float vec __attribute__((vector_size(4 * LANES)));

static inline vec load(const float *p) {
    vec x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store(float *p, vec x) { memcpy(p, &x, sizeof x); }

/* C[m][0..COLS) = sum over k in [k0, k1) of A[m*am + k*ak] B[k*ldb + 0..COLS), for the
 * tile's ROWS rows m: A row-major (am = lda, ak = 1) or read by columns (am = 1). */
static inline void tile(const float *A, int64_t am, int64_t ak, const float *B, int64_t ldb,
                        int64_t k0, int64_t k1, float *C, int64_t ldc) {
    vec acc[ROWS][NV];
    for (int m = 0; m < ROWS; m++)
        for (int n = 0; n < NV; n++) acc[m][n] = (vec){0};
    for (int64_t k = k0; k < k1; k++) {
        vec b[NV];
        for (int n = 0; n < NV; n++) b[n] = load(B + k * ldb + n * LANES);
        for (int m = 0; m < ROWS; m++) {
            const vec a = (vec){0} + A[m * am + k * ak];
            for (int n = 0; n < NV; n++) acc[m][n] += a * b[n];
        }
    }
    for (int m = 0; m < ROWS; m++)
        for (int n = 0; n < NV; n++) store(C + m * ldc + n * LANES, acc[m][n]);
}

/* One head's rows t < T of x (rows `stride` apart) as Tp rows: x itself where T == Tp (*ld
 * = stride), else copied into plain [Tp][d] with zero rows after T (*ld = d). */
static const float *rows_of(const float *x, int64_t stride, int64_t T, int64_t Tp, int64_t d,
                            float *plain, int64_t *ld) {
    *ld = T == Tp ? stride : d;
    if (T == Tp) return x;
    for (int64_t t = 0; t < T; t++) memcpy(plain + t * d, x + t * stride, 4 * (size_t)d);
    memset(plain + T * d, 0, 4 * (size_t)((Tp - T) * d));
    return plain;
}

/* columns [d][Tp]: the transpose of one head's rows t < T of x (rows `stride` apart), zeros
 * after T; 8 rows at a time, so that each column's 8 values are written side by side. */
static void transpose(const float *x, int64_t stride, int64_t T, int64_t Tp, int64_t d,
                      float *columns) {
    for (int64_t t0 = 0; t0 < Tp; t0 += 8)
        for (int64_t c = 0; c < d; c++)
            for (int64_t t = t0; t < t0 + 8; t++)
                columns[c * Tp + t] = t < T ? x[t * stride + c] : 0.0f;
}

/* The forward pass of one head: o [T][d] (rows `so` apart) and lse [T] from q, k, v. */
static void forward_head(const float *q, const float *k, const float *v, int64_t sq, int64_t T,
                         int64_t d, float scale, float *o, int64_t so, float *lse, float *work,
                         int64_t window) {
    const int64_t Tp = (T + COLS - 1) / COLS * COLS;
    float *Kt = work, *S = Kt + Tp * d, *O = S + ROWS * Tp; /* K^T: S = Q K^T */
    int64_t lq, lv;
    const float *Q = rows_of(q, sq, T, Tp, d, O + ROWS * d, &lq);
    const float *V = rows_of(v, sq, T, Tp, d, O + ROWS * d + Tp * d, &lv);
    transpose(k, sq, T, Tp, d, Kt);
    for (int64_t i0 = 0; i0 < T; i0 += ROWS) {
        const int64_t width = (i0 + ROWS + COLS - 1) / COLS * COLS; /* keys the rows may see */
        const int64_t low = first_key(i0, window) / COLS * COLS; /* none left of it (a window) */
        for (int64_t j0 = low; j0 < width; j0 += COLS) /* S = Q K^T (eq. 9.11) */
            tile(Q + i0 * lq, lq, 1, Kt + j0, Tp, 0, d, S + j0, Tp);
        for (int64_t m = 0; m < ROWS; m++) { /* P = softmax(S / sqrt(d)) over j <= i (eq. 9.12) */
            const int64_t i = i0 + m;
            const float logsum = softmax_row(S + m * Tp, i < T ? first_key(i, window) : 0,
                                               i < T ? i + 1 : 1, width, scale);
            if (i < T) lse[i] = logsum;
        }
        for (int64_t c0 = 0; c0 < d; c0 += COLS) /* O = P V (eq. 9.13) */
            tile(S, Tp, 1, V + c0, lv, low, width, O + c0, d);
        for (int64_t m = 0; m < ROWS && i0 + m < T; m++)
            memcpy(o + (i0 + m) * so, O + m * d, sizeof(float) * (size_t)d);
    }
}

/* The backward pass of one head: dq, dk, dv [T][d] (rows `sg` apart) from q, k, v, the
 * forward pass's o and lse, and dout, the gradient of o (rows `so` apart, as o's). */
static void backward_head(const float *q, const float *k, const float *v, int64_t sq, int64_t T,
                          int64_t d, float scale, const float *o, const float *dout, int64_t so,
                          const float *lse, float *dq, float *dk, float *dv, int64_t sg,
                          float *work, int64_t window) {
    const int64_t Tp = (T + COLS - 1) / COLS * COLS;
    float *Qt = work, *Gt = Qt + Tp * d, *dST = Gt + Tp * d, *ST = dST + Tp * Tp; /* G = dO */
    float *dPT = ST + ROWS * Tp, *L = dPT + ROWS * Tp, *D = L + Tp, *rows = D + Tp;
    float *plain = rows + ROWS * d; /* [4][Tp][d], where T < Tp */
    int64_t lk, lv, lq, lg;
    const float *K = rows_of(k, sq, T, Tp, d, plain, &lk);
    const float *V = rows_of(v, sq, T, Tp, d, plain + Tp * d, &lv);
    const float *Q = rows_of(q, sq, T, Tp, d, plain + 2 * Tp * d, &lq);
    const float *G = rows_of(dout, so, T, Tp, d, plain + 3 * Tp * d, &lg);
    transpose(q, sq, T, Tp, d, Qt);
    transpose(dout, so, T, Tp, d, Gt);
    for (int64_t t = 0; t < Tp; t++) { /* D_t = dO_t . O_t */
        float total = 0.0f;
        if (t < T) {
#pragma omp simd reduction(+ : total)
            for (int64_t c = 0; c < d; c++) total += G[t * lg + c] * o[t * so + c];
        }
        D[t] = total;
        L[t] = t < T ? lse[t] : 0.0f;
    }
    for (int64_t j0 = 0; j0 < T; j0 += ROWS) { /* ROWS keys j at a time, every query i >= j */
        const int64_t first = j0 / COLS * COLS, last = last_query(j0, ROWS, window, COLS, Tp);
        for (int64_t i0 = first; i0 < last; i0 += COLS) {
            tile(K + j0 * lk, lk, 1, Qt + i0, Tp, 0, d, ST + i0, Tp); /* S^T = K Q^T */
            tile(V + j0 * lv, lv, 1, Gt + i0, Tp, 0, d, dPT + i0, Tp); /* dP^T = V dO^T */
        }
        for (int64_t m = 0; m < ROWS; m++) {
            const int64_t j = j0 + m;
            float *p = ST + m * Tp, *ds = dPT + m * Tp;
            gradient_row(p, ds, L, D, j, first, last, T, window, scale); /* P^T, dS^T */
            memset(dST + j * Tp, 0, sizeof(float) * (size_t)first);
            memcpy(dST + j * Tp + first, ds + first, sizeof(float) * (size_t)(last - first));
            memset(dST + j * Tp + last, 0, sizeof(float) * (size_t)(Tp - last)); /* past W */
        }
        for (int64_t pass = 0; pass < 2; pass++) { /* dV = P^T dO, then dK = dS^T Q */
            const float *A = pass ? dPT : ST, *Bm = pass ? Q : G;
            const int64_t ldb = pass ? lq : lg;
            float *grad = pass ? dk : dv;
            for (int64_t c0 = 0; c0 < d; c0 += COLS)
                tile(A, Tp, 1, Bm + c0, ldb, first, last, rows + c0, d);
            for (int64_t m = 0; m < ROWS && j0 + m < T; m++)
                memcpy(grad + (j0 + m) * sg, rows + m * d, sizeof(float) * (size_t)d);
        }
    }
    for (int64_t i0 = 0; i0 < T; i0 += ROWS) { /* dQ = dS K, over the keys j < i0 + ROWS */
        const int64_t keys = i0 + ROWS < T ? i0 + ROWS : T;
        for (int64_t c0 = 0; c0 < d; c0 += COLS)
            tile(dST + i0, 1, Tp, K + c0, lk, first_key(i0, window), keys, rows + c0, d);
        for (int64_t m = 0; m < ROWS && i0 + m < T; m++)
            memcpy(dq + (i0 + m) * sg, rows + m * d, sizeof(float) * (size_t)d);
    }
}

/* The forward pass for B*H heads of T positions: q, k, v fp32 with element (b, h, t, c) at
 * b*sb + h*sh + t*st + c (the same strides for all three); o with its own strides (ob, oh,
 * ot); lse [B][H][T]. d a multiple of COLS (32 does for every build). Returns 0, -2 without
 * memory. */
int64_t attention32_forward(const float *q, const float *k, const float *v, int64_t B, int64_t H,
                            int64_t T, int64_t d, int64_t sb, int64_t sh, int64_t st, float *o,
                            int64_t ob, int64_t oh, int64_t ot, float *lse, int64_t window) {
    const int64_t Tp = (T + COLS - 1) / COLS * COLS;
    const size_t floats = (size_t)(3 * Tp * d + ROWS * Tp + ROWS * d);
    int64_t failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *work = aligned_alloc(64, (4 * floats + 63) / 64 * 64);
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
}

/* The backward pass for the heads of attention32_forward: q, k, v and their strides as
 * there; o, dout (the gradient of o) and lse as attention32_forward wrote them (dout with
 * o's strides); dq, dk, dv with strides (gb, gh, gt). Returns 0, -2 without memory. */
int64_t attention32_backward(const float *q, const float *k, const float *v, int64_t B,
                             int64_t H, int64_t T, int64_t d, int64_t sb, int64_t sh, int64_t st,
                             const float *o, const float *dout, int64_t ob, int64_t oh,
                             int64_t ot, const float *lse, float *dq, float *dk, float *dv,
                             int64_t gb, int64_t gh, int64_t gt, int64_t window) {
    const int64_t Tp = (T + COLS - 1) / COLS * COLS;
    const size_t floats = (size_t)(6 * Tp * d + Tp * Tp + 2 * ROWS * Tp + 2 * Tp + ROWS * d);
    int64_t failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *work = aligned_alloc(64, (4 * floats + 63) / 64 * 64);
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
}
