/* The row equations of causal attention that attention.c (bf16) and attention32.c (fp32)
 * share, in fp32 (tlm/inference/native.py keys the compiled library on this file too). */
#include <math.h>
#include <stdint.h>

/* One query's scores row[0..width), of which keys lo..seen-1 are those it may see (lo > 0:
 * an attention window): P = softmax(row * scale) over those (eq. 9.12), zeros elsewhere in
 * [0, width). Returns the log-sum-exp of the scaled scores, L, which the backward pass
 * takes P again from. */
static inline float softmax_row(float *row, int64_t lo, int64_t seen, int64_t width,
                                float scale) {
    float most = row[lo], total = 0.0f;
#pragma omp simd reduction(max : most)
    for (int64_t j = lo; j < seen; j++) most = row[j] > most ? row[j] : most;
#pragma omp simd reduction(+ : total)
    for (int64_t j = lo; j < seen; j++) {
        row[j] = expf((row[j] - most) * scale);
        total += row[j];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t j = 0; j < width; j++) row[j] = j >= lo && j < seen ? row[j] * inv : 0.0f;
    return most * scale + logf(total);
}

/* The first key query i sees: 0, or with an attention window W > 0, i - W + 1. */
static inline int64_t first_key(int64_t i, int64_t window) {
    return window > 0 && i >= window ? i - window + 1 : 0;
}

/* Past the queries that keys j0..j0+rows-1 reach, rounded up to `cols` and at most Tp: with
 * an attention window W > 0, query i sees key j only while i < j + W. */
static inline int64_t last_query(int64_t j0, int64_t rows, int64_t window, int64_t cols,
                                 int64_t Tp) {
    if (window <= 0) return Tp;
    const int64_t end = (j0 + rows - 1 + window + cols - 1) / cols * cols;
    return end < Tp ? end : Tp;
}

/* One key j's rows of S^T (p) and dP^T (ds) over the queries i in [first, Tp), in place:
 * P^T = exp(S^T * scale - L_i) where query i sees key j (j <= i < T, and i - j < W with an
 * attention window W > 0), else 0, and dS^T = P^T o (dP^T - D_i) * scale (dS = P o (dP -
 * D), D_i = dO_i . O_i; the scale of dQ and dK taken in). */
static inline void gradient_row(float *p, float *ds, const float *L, const float *D, int64_t j,
                                int64_t first, int64_t Tp, int64_t T, int64_t window,
                                float scale) {
#pragma omp simd
    for (int64_t i = first; i < Tp; i++) {
        const int seen = i >= j && i < T && j < T && (window <= 0 || i - j < window);
        const float e = seen ? expf(p[i] * scale - L[i]) : 0.0f;
        p[i] = e;
        ds[i] = e * (ds[i] - D[i]) * scale;
    }
}
