/* q4.c's kernel of blocks of 32 inputs, q4_0, q4_k and q8_0 (AVX2 with FMA and F16C; an
 * AVX-512 build runs the same code). q4_k (llama.cpp's Q4_K) keeps the same lines of nibbles; a sub-block of 32 inputs
 * has a 6-bit scale sc and min m of each row (`scm`: the 16 rows' sc, then their m), and a
 * super-block of 256 an fp16 d and dmin of each row (`d`: the 16 d, then the 16 dmin), the
 * weight being d sc q - dmin m. Its sums stay integers through a super-block (sc S and m
 * sum(xq), 32 bits: at most 8 * 63 * 60960), scaled once a super-block by d dx and dmin dx,
 * as llama.cpp's Q4_K dot does: fewer operations than scaling each block in fp32.
 *
 * Weights as llama.cpp's Q4_0: blocks of 32 inputs of one output row, each a 4-bit q in
 * [0, 15] standing for (q - 8) * d, one fp16 d a block. Here 16 output rows go together, as
 * the int8 blocks: block j, input block b, group g of four inputs (4g..4g+3) is one 32-byte
 * line whose byte 4r + t holds row r's q of input 4g + t in its low nibble and row r + 8's in
 * its high nibble (r = 0..7). Masking the line gives rows 0-7, shifting it rows 8-15, each
 * as 8 lanes of 4 bytes: the layout `dot4` of the int8 kernels reads. The 16 rows' d of
 * input block b follow as 16 fp16 values (`scales`).
 *
 * The activations are quantized in q4.c: for q4_0 as llama.cpp's Q8_0, per row and block of
 * 32, xq = round(x 127 / max|x|) in [-127, 127] with dx = max|x| / 127 (rounded to fp16,
 * as Q8_0 keeps it); for q4_k as its Q8_K, one fp32 dx for a super-block of 256 (written for each of
 * its eight blocks). A block's sum over its 32 inputs, sum_i (q_i - 8) xq_i, is exact in
 * 32-bit integers, and y[o] = sum_b d[o, b] dx[b] sum_b + bias[o] in fp32, block by block.
 *
 * q8_0 (llama.cpp's Q8_0: a signed q in [-127, 127] a weight, one fp16 d a block of 32, with
 * Q8_0 activations) keeps q4_0's scales; its group g of block b is 64 bytes, rows 0-7 (byte
 * 4r + t: row r's q of input 4g + t) then rows 8-15. vpmaddubsw takes |xq| times q with xq's
 * signs for one row of x (one abs a group), |q| times xq with q's signs for several (one abs
 * a line, shared): a pair at most 2 * 127 * 127 = 32258, no saturation, widened to 32 bits
 * each group. */

enum { Q4_0 = 0, Q4_K = 1, Q8_0 = 2 }; /* the kinds of block */

/* 8 fp16 values as 8 fp32 lanes, and 8 bytes as 8 int32 lanes. */
static inline __m256 half8(const uint16_t *h) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}
static inline __m256i bytes8(const uint8_t *b) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
}

/* The integer sums of one 16-row block for n rows of x (n = 1..4), input block by input
 * block, scaled by d dx and added into f[2k] (rows 0-7) and f[2k + 1] (rows 8-15) of row k.
 * vpmaddubsw multiplies q (unsigned, 0..15) by xq (signed) and adds pairs into 16 bits: a
 * pair is at most 2 * 15 * 127 = 3810, so the 8 groups of a block add up in 16 bits (at most
 * 30480) before vpmaddwd widens them once a block; the 8 of (q - 8) is taken away as
 * 8 sum(xq), which products.c counted when it quantized the block (`xsum`). */
static inline __attribute__((always_inline)) void q4_rows(const uint8_t *w, const uint16_t *d,
                                                          const uint8_t *scm, int kind,
                                                          const int8_t *xs, const int32_t *xsum,
                                                          const float *dx, int64_t in_pad,
                                                          int64_t n_in, int n, __m256 *f) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i scaled[8], shifted[8]; /* q4_k: a super-block's sum of sc S and of m sum(xq) */
    for (int k = 0; k < 2 * n; k++) {
        f[k] = _mm256_setzero_ps();
        scaled[k] = shifted[k] = _mm256_setzero_si256();
    }
    for (int64_t b = 0; b < n_in; b++) {
        __m256i p[8];
        for (int k = 0; k < 2 * n; k++) p[k] = _mm256_setzero_si256();
        if (kind == Q8_0 && n == 1) { /* one row: |x| times w with x's signs (one abs a group) */
            for (int g = 0; g < 8; g++) {
                const __m256i lo = _mm256_loadu_si256((const __m256i *)(w + (b * 8 + g) * 64));
                const __m256i hi = _mm256_loadu_si256((const __m256i *)(w + (b * 8 + g) * 64 + 32));
                const __m256i x = _mm256_set1_epi32(((const int32_t *)xs)[b * 8 + g]);
                const __m256i a = _mm256_abs_epi8(x);
                const __m256i m_lo = _mm256_maddubs_epi16(a, _mm256_sign_epi8(lo, x));
                const __m256i m_hi = _mm256_maddubs_epi16(a, _mm256_sign_epi8(hi, x));
                p[0] = _mm256_add_epi32(p[0], _mm256_madd_epi16(m_lo, ones));
                p[1] = _mm256_add_epi32(p[1], _mm256_madd_epi16(m_hi, ones));
            }
        } else if (kind == Q8_0) { /* rows share |w|: times x with w's signs */
            for (int g = 0; g < 8; g++) {
                const __m256i lo = _mm256_loadu_si256((const __m256i *)(w + (b * 8 + g) * 64));
                const __m256i hi = _mm256_loadu_si256((const __m256i *)(w + (b * 8 + g) * 64 + 32));
                const __m256i a_lo = _mm256_abs_epi8(lo), a_hi = _mm256_abs_epi8(hi);
                for (int k = 0; k < n; k++) {
                    const __m256i x = _mm256_set1_epi32(((const int32_t *)xs)[k * in_pad / 4 + b * 8 + g]);
                    const __m256i m_lo = _mm256_maddubs_epi16(a_lo, _mm256_sign_epi8(x, lo));
                    const __m256i m_hi = _mm256_maddubs_epi16(a_hi, _mm256_sign_epi8(x, hi));
                    p[2 * k] = _mm256_add_epi32(p[2 * k], _mm256_madd_epi16(m_lo, ones));
                    p[2 * k + 1] = _mm256_add_epi32(p[2 * k + 1], _mm256_madd_epi16(m_hi, ones));
                }
            }
        }
        if (kind == Q8_0) { /* each pair widened each group: the block's sums, scaled */
            const __m256 d_lo = half8(d + b * 16), d_hi = half8(d + b * 16 + 8);
            for (int k = 0; k < n; k++) {
                const __m256 sx = _mm256_set1_ps(dx[k * n_in + b]);
                f[2 * k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[2 * k]), _mm256_mul_ps(d_lo, sx), f[2 * k]);
                f[2 * k + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[2 * k + 1]), _mm256_mul_ps(d_hi, sx),
                                               f[2 * k + 1]);
            }
            continue;
        }
        for (int g = 0; g < 8; g++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + (b * 8 + g) * 32));
            const __m256i lo = _mm256_and_si256(v, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int k = 0; k < n; k++) {
                const __m256i x = _mm256_set1_epi32(((const int32_t *)xs)[k * in_pad / 4 + b * 8 + g]);
                p[2 * k] = _mm256_add_epi16(p[2 * k], _mm256_maddubs_epi16(lo, x));
                p[2 * k + 1] = _mm256_add_epi16(p[2 * k + 1], _mm256_maddubs_epi16(hi, x));
            }
        }
        if (kind == Q4_K) { /* w = d sc q - dmin m: integers through the super-block, then */
            const uint8_t *sm = scm + b * 32; /* f += d dx sum(sc S) - dmin dx sum(m sum(xq)) */
            const __m256i sc_lo = bytes8(sm), sc_hi = bytes8(sm + 8);
            const __m256i m_lo = bytes8(sm + 16), m_hi = bytes8(sm + 24);
            for (int k = 0; k < n; k++) {
                const __m256i sums = _mm256_set1_epi32(xsum[k * n_in + b]);
                const __m256i s_lo = _mm256_madd_epi16(p[2 * k], ones);
                const __m256i s_hi = _mm256_madd_epi16(p[2 * k + 1], ones);
                scaled[2 * k] = _mm256_add_epi32(scaled[2 * k], _mm256_mullo_epi32(s_lo, sc_lo));
                scaled[2 * k + 1] = _mm256_add_epi32(scaled[2 * k + 1], _mm256_mullo_epi32(s_hi, sc_hi));
                shifted[2 * k] = _mm256_add_epi32(shifted[2 * k], _mm256_mullo_epi32(sums, m_lo));
                shifted[2 * k + 1] = _mm256_add_epi32(shifted[2 * k + 1], _mm256_mullo_epi32(sums, m_hi));
            }
            if (b % 8 != 7) continue;
            const uint16_t *dk = d + (b / 8) * 32; /* the super-block's last block of 32 */
            const __m256 d_lo = half8(dk), d_hi = half8(dk + 8);
            const __m256 dm_lo = half8(dk + 16), dm_hi = half8(dk + 24);
            for (int k = 0; k < n; k++) {
                const __m256 sx = _mm256_set1_ps(dx[k * n_in + b]); /* Q8_K: one a super-block */
                f[2 * k] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(shifted[2 * k]), _mm256_mul_ps(dm_lo, sx),
                                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(scaled[2 * k]),
                                                            _mm256_mul_ps(d_lo, sx), f[2 * k]));
                f[2 * k + 1] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(shifted[2 * k + 1]), _mm256_mul_ps(dm_hi, sx),
                                                _mm256_fmadd_ps(_mm256_cvtepi32_ps(scaled[2 * k + 1]),
                                                                _mm256_mul_ps(d_hi, sx), f[2 * k + 1]));
                scaled[2 * k] = scaled[2 * k + 1] = shifted[2 * k] = shifted[2 * k + 1] = _mm256_setzero_si256();
            }
            continue;
        }
        const __m256 d_lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b * 16)));
        const __m256 d_hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b * 16 + 8)));
        for (int k = 0; k < n; k++) {
            const __m256i eight = _mm256_set1_epi32(8 * xsum[k * n_in + b]);
            const __m256i s_lo = _mm256_sub_epi32(_mm256_madd_epi16(p[2 * k], ones), eight);
            const __m256i s_hi = _mm256_sub_epi32(_mm256_madd_epi16(p[2 * k + 1], ones), eight);
            const __m256 sx = _mm256_set1_ps(dx[k * n_in + b]);
            f[2 * k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_lo), _mm256_mul_ps(d_lo, sx), f[2 * k]);
            f[2 * k + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_hi), _mm256_mul_ps(d_hi, sx),
                                           f[2 * k + 1]);
        }
    }
}

#include "store_half.h"

/* y[r, 0..left) of one 16-row block for every row r of x, rows `out` floats apart; bias (or
 * NULL) the block's 16. */
static void q4_block(const uint8_t *w, const uint16_t *d, const uint8_t *scm, int kind,
                     const int8_t *xs, const int32_t *xsum, const float *dx, const float *bias,
                     int64_t rows, int64_t in_pad, int64_t out, int64_t left, float *y) {
    const int64_t n_in = in_pad / 32;
    const __m256 b_lo = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b_hi = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; r += 4) {
        const int n = rows - r < 4 ? (int)(rows - r) : 4;
        const int8_t *xr = xs + r * in_pad;
        const int32_t *sr = xsum + r * n_in;
        const float *dr = dx + r * n_in;
        __m256 f[8];
        switch (n + 4 * kind) { /* each a copy of q4_rows for its n and kind */
        case 1: q4_rows(w, d, scm, Q4_0, xr, sr, dr, in_pad, n_in, 1, f); break;
        case 2: q4_rows(w, d, scm, Q4_0, xr, sr, dr, in_pad, n_in, 2, f); break;
        case 3: q4_rows(w, d, scm, Q4_0, xr, sr, dr, in_pad, n_in, 3, f); break;
        case 4: q4_rows(w, d, scm, Q4_0, xr, sr, dr, in_pad, n_in, 4, f); break;
        case 5: q4_rows(w, d, scm, Q4_K, xr, sr, dr, in_pad, n_in, 1, f); break;
        case 6: q4_rows(w, d, scm, Q4_K, xr, sr, dr, in_pad, n_in, 2, f); break;
        case 7: q4_rows(w, d, scm, Q4_K, xr, sr, dr, in_pad, n_in, 3, f); break;
        case 8: q4_rows(w, d, scm, Q4_K, xr, sr, dr, in_pad, n_in, 4, f); break;
        case 9: q4_rows(w, d, scm, Q8_0, xr, sr, dr, in_pad, n_in, 1, f); break;
        case 10: q4_rows(w, d, scm, Q8_0, xr, sr, dr, in_pad, n_in, 2, f); break;
        case 11: q4_rows(w, d, scm, Q8_0, xr, sr, dr, in_pad, n_in, 3, f); break;
        default: q4_rows(w, d, scm, Q8_0, xr, sr, dr, in_pad, n_in, 4, f);
        }
        for (int k = 0; k < n; k++) {
            store_half(y + (r + k) * out, _mm256_add_ps(f[2 * k], b_lo), left);
            store_half(y + (r + k) * out + 8, _mm256_add_ps(f[2 * k + 1], b_hi), left - 8);
        }
    }
}
