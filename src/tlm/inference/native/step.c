/* The work of a decoding step between its weight products, for rows that feed one token
 * each (tlm/inference/native.py compiles this file and calls it; step.py runs the step).
 *
 * A step of a GPT-2-sized model reads 50-500 MB of weights in a few products per layer;
 * between them come a dozen small operations on vectors of width d (LayerNorm, the
 * residual add, attention of one query over the cached keys). Done one torch operation at
 * a time they cost more than the products they sit between. Here each stretch between two
 * products is one call. The arithmetic is the model's (model/attention.py, layers.py,
 * positions.py), in fp32, and tests hold the two equal.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* x += a (when a is given), then h = gamma * (x - mu) / sqrt(var + eps) + beta (eq. 9.22-9.25),
 * for each of `rows` rows of width d; beta may be NULL (no bias). Row r adds row r of a, or
 * with `index`, row index[r] of a (the position embeddings P[pos], Fig. 9.13). */
void add_norm(float *x, const float *a, const int64_t *index, float *h, const float *gamma,
              const float *beta, int64_t rows, int64_t d, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * d, *hr = h + r * d;
        if (a) {
            const float *ar = a + (index ? index[r] : r) * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) xr[i] += ar[i];
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < d; i++) sum += xr[i];
        const float mu = sum / (float)d;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < d; i++) squares += (xr[i] - mu) * (xr[i] - mu);
        const float inv = 1.0f / sqrtf(squares / (float)d + eps);
#pragma omp simd
        for (int64_t i = 0; i < d; i++) hr[i] = (xr[i] - mu) * inv * gamma[i] + (beta ? beta[i] : 0.0f);
    }
}

/* Scale v [n] to unit RMS: v / sqrt(mean(v^2) + eps) (qk_norm, as F.rms_norm). */
static void rms_norm(float *v, int64_t n, float eps) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; i++) squares += v[i] * v[i];
    const float inv = 1.0f / sqrtf(squares / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) v[i] *= inv;
}

/* Rotate the pairs (v_i, v_{i+n/2}) by the angles whose cos and sin are given [n/2]. */
static void rotate(float *v, int64_t n, const float *cos_, const float *sin_) {
    const int64_t half = n / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos_[i] - b * sin_[i];
        v[i + half] = a * sin_[i] + b * cos_[i];
    }
}

/* A rotary model's angles (positions.py): cos and sin tables [n, d_head/2], the scaling's
 * factor folded in, and past them (a model with an attention window reads on) the angles
 * computed as the tables were: cos(p * theta_i) * factor in double, rounded to float. */
typedef struct {
    const float *cos_, *sin_;
    int64_t n;
    const double *theta;
    double factor;
} Rope;

/* Rotate v [d_head] to position p (rope may be NULL: no rotation). */
static void rotate_to(float *v, int64_t d_head, const Rope *rope, int64_t p) {
    const int64_t half = d_head / 2;
    if (!rope) return;
    if (p < rope->n) {
        rotate(v, d_head, rope->cos_ + p * half, rope->sin_ + p * half);
        return;
    }
    float c[half], s[half];
    for (int64_t i = 0; i < half; i++) {
        const double angle = (double)p * rope->theta[i];
        c[i] = (float)(cos(angle) * rope->factor);
        s[i] = (float)(sin(angle) * rope->factor);
    }
    rotate(v, d_head, c, s);
}

/* One head of one row's key and value at position p, written at entry p mod capacity of
 * the head's cache Kh, Vh [capacity, d_head] (a ring where the model has an attention
 * window; p < capacity otherwise): the key scaled to unit RMS (qk_eps > 0) and rotated. */
static void store_head(const float *k, const float *v, float *Kh, float *Vh, int64_t p,
                       int64_t capacity, int64_t d_head, float qk_eps, const Rope *rope) {
    float *key = Kh + (p % capacity) * d_head;
    memcpy(key, k, d_head * sizeof(float));
    memcpy(Vh + (p % capacity) * d_head, v, d_head * sizeof(float));
    if (qk_eps > 0.0f) rms_norm(key, d_head, qk_eps);
    rotate_to(key, d_head, rope, p);
}

/* One head of one row's query at position p: out = softmax(q K_j^T / sqrt(d_head)) V_j
 * over positions j = lo..p (lo = 0, or p - W + 1 with an attention window W), each at
 * entry j mod capacity; the query scaled and rotated as its key was. */
static void attend_head(const float *q, const float *Kh, const float *Vh, int64_t p,
                        int64_t lo, int64_t capacity, int64_t d_head, float qk_eps,
                        const Rope *rope, float *scores, float *out) {
    float query[d_head];
    memcpy(query, q, d_head * sizeof(float));
    if (qk_eps > 0.0f) rms_norm(query, d_head, qk_eps);
    rotate_to(query, d_head, rope, p);
    const float scale = 1.0f / sqrtf((float)d_head);
    const int64_t n = p - lo + 1;
    float most = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float *kj = Kh + ((lo + j) % capacity) * d_head;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d_head; i++) dot += query[i] * kj[i];
        scores[j] = dot * scale;
        most = scores[j] > most ? scores[j] : most;
    }
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; j++) {
        scores[j] = expf(scores[j] - most);
        total += scores[j];
    }
    memset(out, 0, d_head * sizeof(float));
    for (int64_t j = 0; j < n; j++) {
        const float weight = scores[j] / total;
        const float *vj = Vh + ((lo + j) % capacity) * d_head;
#pragma omp simd
        for (int64_t i = 0; i < d_head; i++) out[i] += weight * vj[i];
    }
}

/* One layer's attention for `rows` rows, each feeding one token (eq. 9.11-9.13, 9.19's
 * concatenation). Row r writes its key and value at position pos[r] of its slot slots[r]
 * in the cache, K and V [slots, H, capacity, d_head] of this layer, and its query attends
 * to positions 0..pos[r] of its slot: z[r] = concat_h softmax(q_h K_h^T / sqrt(d_head)) V_h.
 * With an attention window W > 0 it attends to pos[r] - W + 1..pos[r] only, and the cache
 * is a ring (position p at entry p mod capacity: model/window.py). Every row's key and
 * value are written before any query attends, so rows may be consecutive positions of
 * one slot (k tokens of one sequence checked in one step: each sees those before it, as
 * in the forward pass's causal mask; a ring holds W + k - 1 of them). q, k, v: rows of
 * width H*d_head, `stride` floats apart. With qk_eps > 0, q and k are first scaled to unit
 * RMS per head; with a rope, then rotated. The rows' heads are shared out among OpenMP's
 * threads: a head's keys and values were last read a whole step ago and come from
 * memory, which two cores read faster than one. */
void attend_one(const float *q, const float *k, const float *v, int64_t stride, float *K,
                float *V, const int64_t *slots, const int64_t *pos, int64_t rows, int64_t H,
                int64_t d_head, int64_t capacity, int64_t window, float qk_eps,
                const Rope *rope, float *z) {
#pragma omp parallel if (rows * H > 1)
    {
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < rows * H; unit++) {
            const int64_t r = unit / H, h = unit % H, at = r * stride + h * d_head;
            const int64_t head = (slots[r] * H + h) * capacity * d_head;
            store_head(k + at, v + at, K + head, V + head, pos[r], capacity, d_head, qk_eps, rope);
        }  /* the for's barrier: every key and value is in before a query reads them */
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < rows * H; unit++) {
            const int64_t r = unit / H, h = unit % H, at = r * stride + h * d_head;
            const int64_t head = (slots[r] * H + h) * capacity * d_head;
            const int64_t lo = window > 0 && pos[r] >= window ? pos[r] - window + 1 : 0;
            float scores[pos[r] - lo + 1];
            attend_head(q + at, K + head, V + head, pos[r], lo, capacity, d_head, qk_eps, rope,
                        scores, z + (r * H + h) * d_head);
        }
    }
}

/* The FFN's activation, in place on u [n] (eq. 9.21; model/functional.py's ACTIVATIONS):
 * 0 relu, 1 gelu (exact, x * Phi(x)), 2 gelu with the tanh approximation, 3 relu squared. */
void activate(float *u, int64_t n, int64_t kind) {
    if (kind == 0) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) u[i] = u[i] > 0.0f ? u[i] : 0.0f;
    } else if (kind == 1) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) u[i] = 0.5f * u[i] * (1.0f + erff(u[i] * 0.70710678118654752f));
    } else if (kind == 2) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float x = u[i];
            u[i] = 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) u[i] = u[i] > 0.0f ? u[i] * u[i] : 0.0f;
    }
}

/* The likeliest of n logits (the first of equal maxima, as torch's and numpy's argmax) and
 * its log-probability under their softmax, -log sum_i exp(logits_i - logits[best]) (eq.
 * 10.46, and the log-softmax at one token), in *logprob. The sum is made the same way
 * whatever the vector width (blocks of 256, then fp64): one sum in fp32 lanes added 50,000
 * terms of ~1e-7 to lanes that held a 1, and its error depended on the width (1.9e-5 apart
 * from torch's with an AVX2 host's code, within 1e-5 with AVX-512's). Returns -1 when a logit is not
 * finite: this file is compiled with -ffast-math, which assumes finite numbers, so the
 * caller decides those (the test is on the bits: an exponent of all ones). */
int64_t greedy_pick(const float *logits, int64_t n, float *logprob) {
    const uint32_t *bits = (const uint32_t *)logits;
    uint32_t odd = 0;
#pragma omp simd reduction(| : odd)
    for (int64_t i = 0; i < n; i++) odd |= (bits[i] & 0x7f800000u) == 0x7f800000u;
    if (odd) return -1;
    float most = logits[0];
#pragma omp simd reduction(max : most)
    for (int64_t i = 0; i < n; i++) most = logits[i] > most ? logits[i] : most;
    int64_t best = 0; /* the first block of 256 that holds the maximum, then its place in it */
    for (int64_t lo = 0; lo < n; lo += 256) {
        const int64_t hi = lo + 256 < n ? lo + 256 : n;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = lo; i < hi; i++) hit |= logits[i] == most;
        if (hit) {
            for (best = lo; logits[best] != most; best++) {
            }
            break;
        }
    }
    double total = 0.0; /* blocks of 256 summed in fp32 from zero, added up in fp64: */
    for (int64_t lo = 0; lo < n; lo += 256) { /* tiny terms never meet a sum near 1 in fp32 */
        const int64_t hi = lo + 256 < n ? lo + 256 : n;
        float part = 0.0f;
#pragma omp simd reduction(+ : part)
        for (int64_t i = lo; i < hi; i++) part += expf(logits[i] - most);
        total += part;
    }
    *logprob = -(float)log(total);
    return best;
}

/* Where a step's token embeddings E[w] come from (inference/formats/prepare.py keeps them three
 * ways): rows in memory (`table`), fp32, fp16, bf16, or int8 with one scale per row or per
 * block of 32 (kernels.PackedRows: int8, q8_0); or rows left in the model's file (`table` NULL: read from `fd`,
 * the rows starting at byte `start`, as tensor_files.FileRows reads them). Each row is
 * widened to fp32 and multiplied by `times`, the embedding's scale. */
typedef struct {
    int64_t kind; /* 0 fp32, 1 fp16, 2 bf16, 3 int8, 4 q8_0 (int8, a scale a block of 32) */
    const void *table;
    const float *scale;
    int64_t fd, start, n;
    float times;
} Rows;

static float from_half(uint16_t h) { /* IEEE binary16 to binary32, exactly */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, nan */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        uint32_t e = 113u;
        while (!(mantissa & 0x400u)) mantissa <<= 1, e--;
        bits = sign | (e << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* x[r] = times * E[ids[r]] for `rows` rows of width d. Returns 0, -3 where an id is not a
 * row of E, -4 where the file holds fewer bytes than a row (changed since it was opened). */
int64_t look_up(const Rows *E, const int64_t *ids, int64_t rows, int64_t d, float *x) {
    const size_t width = E->kind == 0 ? 4 : E->kind >= 3 ? 1 : 2;
    const size_t bytes = width * (size_t)d;
    for (int64_t r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= E->n) return -3;
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * d;
        unsigned char buffer[E->table ? 1 : bytes];
        const void *row = E->table ? (const char *)E->table + ids[r] * bytes : (const void *)buffer;
        if (!E->table) {
            for (size_t done = 0; done < bytes;) {
                const ssize_t got = pread((int)E->fd, buffer + done, bytes - done,
                                          (off_t)(E->start + ids[r] * (int64_t)bytes + (int64_t)done));
                if (got <= 0) return -4;
                done += (size_t)got;
            }
        }
        if (E->kind == 0) {
            memcpy(xr, row, bytes);
        } else if (E->kind == 1) {
            for (int64_t i = 0; i < d; i++) xr[i] = from_half(((const uint16_t *)row)[i]);
        } else if (E->kind == 2) {
            for (int64_t i = 0; i < d; i++) {
                const uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
                memcpy(xr + i, &bits, sizeof(float));
            }
        } else if (E->kind == 3) {
            const float s = E->scale[ids[r]];
            for (int64_t i = 0; i < d; i++) xr[i] = (float)((const int8_t *)row)[i] * s;
        } else {
            const float *s = E->scale + ids[r] * ((d + 31) / 32);
            for (int64_t i = 0; i < d; i++) xr[i] = (float)((const int8_t *)row)[i] * s[i / 32];
        }
        if (E->times != 1.0f)
            for (int64_t i = 0; i < d; i++) xr[i] *= E->times;
    }
    return 0;
}

/* The whole step in one call, for a model whose every product has a kernel in products.c
 * (program.py builds these descriptions once per model; step.py calls it); with `picks`,
 * each row's greedy choice and its log-probability too (greedy_pick, -1 where it has none). */
int64_t int8_product(const int8_t *blocks, const float *scale, const int32_t *wsum,
                     const float *bias, const float *x, int64_t rows, int64_t in,
                     int64_t in_pad, int64_t out, float *y);
int64_t float16_product(const uint16_t *blocks, const float *bias, const float *x,
                        int64_t rows, int64_t in, int64_t out, float *y);
int64_t float32_product(const float *blocks, const float *bias, const float *x, int64_t rows,
                        int64_t in, int64_t out, float *y);
int64_t float32_rows(const float *W, int64_t ld, const float *bias, const float *x,
                     int64_t rows, int64_t in, int64_t out, float *y, int64_t ldy);
int64_t float32_dots(const float *E, int64_t ld, const float *bias, const float *x,
                     int64_t rows, int64_t in, int64_t out, float *y, int64_t ldy);
int64_t q4_0_product(const uint8_t *blocks, const uint16_t *scales, const float *bias,
                     const float *x, int64_t rows, int64_t in, int64_t in_pad, int64_t out,
                     float *y);
int64_t q4_k_product(const uint8_t *blocks, const uint16_t *d, const uint8_t *scm,
                     const float *bias, const float *x, int64_t rows, int64_t in, int64_t in_pad,
                     int64_t out, float *y);
int64_t q8_0_product(const int8_t *blocks, const uint16_t *scales, const float *bias,
                     const float *x, int64_t rows, int64_t in, int64_t in_pad, int64_t out,
                     float *y);

/* One product, y = x W^T + b, written at `offset` of each output row: kind 0 int8 blocks,
 * 1 float16 blocks, 2 fp32 W [in, out] (rows ld apart), 3 fp32 W^T [out, in] (rows ld
 * apart), 4 float32 blocks, 5 q4_0 blocks (`scale`: their fp16 scales), 6 q4_k blocks
 * (`scale`: their fp16 d and dmin, `wsum`: their 6-bit sc and m), 7 q8_0 blocks (`scale`:
 * their fp16 scales). Only kinds 2 and 3 write at an offset, into rows wider than their own
 * output (Q, K and V as three products; program.py checks). */
typedef struct {
    int64_t kind;
    const void *w;
    const float *scale;
    const int32_t *wsum;
    const float *bias;
    int64_t in, in_pad, out, ld, offset;
} Product;

typedef struct {
    const float *gamma, *beta;
    float eps;
} Norm;

/* One block: its products (Q, K and V as one to three), the norm inside it (ln2) and the
 * norm after it (the next block's ln1, or ln_f), and its rope and qk-norm (see attend_one). */
typedef struct {
    Product qkv[3];
    int64_t n_qkv;
    Product out, up, down;
    Norm inside, after;
    const Rope *rope;
    float qk_eps;
} Block;

/* y's rows are `ldy` floats apart (the product's own width but for Q, K and V). */
static int64_t product(const Product *p, const float *x, int64_t rows, float *y, int64_t ldy) {
    switch (p->kind) {
    case 0: return int8_product(p->w, p->scale, p->wsum, p->bias, x, rows, p->in, p->in_pad, p->out, y);
    case 1: return float16_product(p->w, p->bias, x, rows, p->in, p->out, y);
    case 2: return float32_rows(p->w, p->ld, p->bias, x, rows, p->in, p->out, y + p->offset, ldy);
    case 3: return float32_dots(p->w, p->ld, p->bias, x, rows, p->in, p->out, y + p->offset, ldy);
    case 5: return q4_0_product(p->w, (const uint16_t *)p->scale, p->bias, x, rows, p->in, p->in_pad, p->out, y);
    case 6:
        return q4_k_product(p->w, (const uint16_t *)p->scale, (const uint8_t *)p->wsum, p->bias, x, rows, p->in,
                            p->in_pad, p->out, y);
    case 7: return q8_0_product(p->w, (const uint16_t *)p->scale, p->bias, x, rows, p->in, p->in_pad, p->out, y);
    default: return float32_product(p->w, p->bias, x, rows, p->in, p->out, y);
    }
}

/* Logits [rows, V] of a step in which each row feeds one token (step.py's loop, in C):
 * x [rows, d] holds E[w], or with E, is given the rows of the tokens `ids` (look_up), and
 * becomes the residual stream; P (or NULL) the position
 * embeddings added by pos; K, V the cache, `layer_floats` apart per layer (a ring with an
 * attention window > 0, as attend_one's); `activation`
 * as `activate`'s kind. Returns 0, look_up's error, or the first product's error. */
int64_t decode_step(const Block *blocks, int64_t n_blocks, const Product *head,
                    const Norm *first, const float *P, float *x, int64_t rows, int64_t d,
                    int64_t d_ff, float *K, float *V, int64_t layer_floats,
                    const int64_t *slots, const int64_t *pos, int64_t H, int64_t d_head,
                    int64_t capacity, int64_t window, int64_t activation, float *logits,
                    int64_t *picks,
                    float *pick_logprobs, const Rows *E, const int64_t *ids) {
    const int64_t width = H * d_head;
    if (E) {
        const int64_t looked = look_up(E, ids, rows, d, x);
        if (looked) return looked;
    }
    float *h = malloc(sizeof(float) * (size_t)(rows * (2 * d + 4 * width + d_ff)));
    if (!h) return -2;
    float *o = h + rows * d, *qkv = o + rows * d, *z = qkv + rows * 3 * width;
    float *u = z + rows * width;
    int64_t failed = 0;
    add_norm(x, P, P ? pos : NULL, h, first->gamma, first->beta, rows, d, first->eps);
    for (int64_t l = 0; l < n_blocks && !failed; l++) {
        const Block *b = blocks + l;
        for (int64_t i = 0; i < b->n_qkv; i++) failed |= product(&b->qkv[i], h, rows, qkv, 3 * width);
        attend_one(qkv, qkv + width, qkv + 2 * width, 3 * width, K + l * layer_floats,
                   V + l * layer_floats, slots, pos, rows, H, d_head, capacity, window,
                   b->qk_eps, b->rope, z);
        failed |= product(&b->out, z, rows, o, d);
        add_norm(x, o, NULL, h, b->inside.gamma, b->inside.beta, rows, d, b->inside.eps);
        failed |= product(&b->up, h, rows, u, d_ff);
        activate(u, rows * d_ff, activation);
        failed |= product(&b->down, u, rows, o, d);
        add_norm(x, o, NULL, h, b->after.gamma, b->after.beta, rows, d, b->after.eps);
    }
    if (!failed) failed = product(head, h, rows, logits, head->out);
    free(h);
    if (!failed && picks) { /* greedy's choice, from logits still in the cache */
#pragma omp parallel for if (rows > 1)
        for (int64_t r = 0; r < rows; r++)
            picks[r] = greedy_pick(logits + r * head->out, head->out, pick_logprobs + r);
    }
    return failed;
}

/* decode_step's products alone, in its order, on inputs of zeros, and nothing between them:
 * the time the weights take to stream (bench/generate.py's "products" column). */
int64_t decode_products(const Block *blocks, int64_t n_blocks, const Product *head,
                        int64_t rows, int64_t d, int64_t d_ff, int64_t width, float *logits) {
    const int64_t wide = 3 * width > d_ff ? 3 * width : d_ff;
    float *zeros = calloc((size_t)(rows * (d > wide ? d : wide)), sizeof(float));
    float *y = malloc(sizeof(float) * (size_t)(rows * wide));
    int64_t failed = !zeros || !y ? -2 : 0;
    for (int64_t l = 0; l < n_blocks && !failed; l++) {
        const Block *b = blocks + l;
        for (int64_t i = 0; i < b->n_qkv; i++) failed |= product(&b->qkv[i], zeros, rows, y, 3 * width);
        failed |= product(&b->out, zeros, rows, y, d);
        failed |= product(&b->up, zeros, rows, y, d_ff);
        failed |= product(&b->down, zeros, rows, y, d);
    }
    if (!failed) failed = product(head, zeros, rows, logits, head->out);
    free(zeros), free(y);
    return failed;
}
