/* The decoder's elementwise steps, each one pass over its rows (CPU, fp32 or bf16): what the CPU
 * runner calls instead of torch's chain of ops (LlamaRMSNorm alone is six passes, SiLU-and-multiply
 * three, rotary embedding seven), which on a CPU took about a third of a step on SmolLM2.
 *
 * Built and loaded with paged_attention.c by inference_server/paged_kernel.py; called through
 * ctypes, which lets go of the GIL. Every function takes contiguous row-major data and a thread
 * count: rows are dealt to that many threads. The arithmetic is fp32; a bf16 result is rounded once
 * (to nearest even), where torch's chain rounds after each op.
 *
 * This file is read twice by the compiler (it includes itself): T = float, then T = uint16_t (bf16).
 */
#ifndef T
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "exp_neg.h"

#define MAX_THREADS 64

static inline float bf16_in(uint16_t x) {
    union { uint32_t i; float f; } u;
    u.i = (uint32_t)x << 16;
    return u.f;
}

static inline uint16_t bf16_out(float f) {
    union { uint32_t i; float f; } u;
    u.f = f;
    if ((u.i & 0x7fffffff) > 0x7f800000) return (uint16_t)((u.i >> 16) | 0x40);    /* NaN stays NaN */
    return (uint16_t)((u.i + 0x7fff + ((u.i >> 16) & 1)) >> 16);
}

static inline float f32_in(float x) { return x; }
static inline float f32_out(float x) { return x; }

/* rows [r0, r1) of a job, on some thread */
typedef struct {
    void (*fn)(const void *args, int64_t r0, int64_t r1);
    const void *args;
    int64_t r0, r1;
} part_t;

static void *run_part(void *arg) {
    const part_t *p = (const part_t *)arg;
    p->fn(p->args, p->r0, p->r1);
    return NULL;
}

static void parallel_rows(void (*fn)(const void *, int64_t, int64_t), const void *args, int64_t rows, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > rows) threads = (int)rows;
    if (threads <= 1) {
        fn(args, 0, rows);
        return;
    }
    part_t parts[MAX_THREADS];
    for (int t = 0; t < threads; t++) parts[t] = (part_t){fn, args, rows * t / threads, rows * (t + 1) / threads};
#ifdef _OPENMP
    /* torch's OpenMP team (see paged_attention.c) */
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) run_part(&parts[t]);
#else
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], NULL, run_part, &parts[t]) == 0;
    run_part(&parts[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
        else run_part(&parts[t]);
    }
#endif
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* x * sigmoid(x) * u, 16 lanes */
static inline __m512 silu_mul16(__m512 x, __m512 u) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 e = exp_neg16(_mm512_mask_blend_ps(neg, _mm512_sub_ps(_mm512_setzero_ps(), x), x));  /* e^-|x| */
    const __m512 num = _mm512_mask_blend_ps(neg, one, e);
    const __m512 s = _mm512_div_ps(num, _mm512_add_ps(one, e));
    return _mm512_mul_ps(_mm512_mul_ps(x, s), u);
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline void store16_f32(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void store16_bf16(uint16_t *p, __m512 v) {    /* round to nearest even, as bf16_out (NaN aside) */
    __m512i i = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
    i = _mm512_add_epi32(i, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(i, 16)));
}
#define HAVE16 1
#else
#define HAVE16 0
#endif

/* ---- sampling: the next token and its logprob from fp32 logits, a row at a time -------------------
 * Row r: s = logits / temps[r] (as is where temps[r] is 0 or 1); its max, then the sum of e^(s - max)
 * (log_softmax's total), then, for a sampled row, the first token whose running sum of e^(s - max)
 * passes u[r] * total (inverse CDF, as cumsum + searchsorted(right=True)), recomputing the
 * exponentials only up to that token; a greedy row (temps[r] 0, or u NULL) takes the first argmax.
 * logprob = s[token] - max - log(total). No [rows, vocab] temporaries. */
typedef struct {
    const float *logits, *temps, *u;
    int64_t vocab;
    int64_t *tokens;
    float *logprobs, *shift, *log_total;
} sample_args;

static inline float scaled_at(const float *x, int64_t i, float t) { return t > 0.f && t != 1.f ? x[i] / t : x[i]; }

static void sample_rows(const void *a_, int64_t r0, int64_t r1) {
    const sample_args *a = (const sample_args *)a_;
    const int64_t V = a->vocab;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = a->logits + r * V, t = a->temps[r];
        const int divide = t > 0.f && t != 1.f;
        int64_t i = 0;
        float mx = -INFINITY, total = 0.f;
#if HAVE16
        const __m512 tv = _mm512_set1_ps(divide ? t : 1.f);
        __m512 m16 = _mm512_set1_ps(-INFINITY);
        for (; i + 16 <= V; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            m16 = _mm512_max_ps(m16, divide ? _mm512_div_ps(v, tv) : v);
        }
        mx = _mm512_reduce_max_ps(m16);
#endif
        for (int64_t k = i; k < V; k++) mx = fmaxf(mx, scaled_at(x, k, t));
        i = 0;
#if HAVE16
        const __m512 mv = _mm512_set1_ps(mx);
        __m512 sum16 = _mm512_setzero_ps();
        for (; i + 16 <= V; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            sum16 = _mm512_add_ps(sum16, exp_neg16(_mm512_sub_ps(divide ? _mm512_div_ps(v, tv) : v, mv)));
        }
        total = _mm512_reduce_add_ps(sum16);
#endif
        for (int64_t k = i; k < V; k++) total += exp_neg(scaled_at(x, k, t) - mx);
        int64_t token = -1;
        if (a->u == NULL || t == 0.f) {
            for (int64_t k = 0; k < V && token < 0; k++)
                if (scaled_at(x, k, t) == mx) token = k;
        } else {
            const float target = a->u[r] * total;
            float acc = 0.f;
            for (int64_t k = 0; k < V && token < 0; k++) {
#if HAVE16
                if (k % 16 == 0 && k + 16 <= V) {    /* a whole 16 that the running sum does not pass: skip it */
                    const __m512 v = _mm512_loadu_ps(x + k);
                    const __m512 e = exp_neg16(_mm512_sub_ps(divide ? _mm512_div_ps(v, tv) : v, mv));
                    const float h = _mm512_reduce_add_ps(e);
                    if (acc + h <= target) {
                        acc += h;
                        k += 15;
                        continue;
                    }
                }
#endif
                const float e = exp_neg(scaled_at(x, k, t) - mx);
                acc += e;
                if (acc > target) token = k;
            }
            if (token < 0) token = V - 1;        /* the running sum fell short of u * total by rounding
                                                    (torch's path clamps the same way); exp_neg is never 0 */
        }
        a->tokens[r] = token;
        a->shift[r] = mx;
        a->log_total[r] = logf(total);
        a->logprobs[r] = scaled_at(x, token, t) - mx - a->log_total[r];
    }
}

int riptide_sample(const float *logits, int64_t rows, int64_t vocab, const float *temps, const float *u,
                   int64_t *tokens, float *logprobs, float *shift, float *log_total, int threads) {
    const sample_args a = {logits, temps, u, vocab, tokens, logprobs, shift, log_total};
    parallel_rows(sample_rows, &a, rows, threads);
    return 0;
}

typedef struct {
    void *x;
    const void *d, *w;
    void *out;
    int64_t dim;
    float eps;
} norm_args;

typedef struct {
    const void *gu;
    void *out;
    int64_t inter;
} silu_args;

typedef struct {
    void *x;
    const void *cos, *sin;
    int64_t row, heads, head_dim;
} rope_args;

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(x) CAT(x, SUF)

#define T float
#define SUF f32
#define IN(v) f32_in(v)
#define OUT(v) f32_out(v)
#define LOAD16 load16_f32
#define STORE16 store16_f32
#include "fused_ops.c"
#undef T
#undef SUF
#undef IN
#undef OUT
#undef LOAD16
#undef STORE16

#define T uint16_t
#define SUF bf16
#define IN(v) bf16_in(v)
#define OUT(v) bf16_out(v)
#define LOAD16 load16_bf16
#define STORE16 store16_bf16
#include "fused_ops.c"

#else   /* T: the functions for elements of type T */

/* out = x / rms(x) * w, by row; with d: x += d first (x written back), the residual add fused in */
static void NAME(norm_rows)(const void *a_, int64_t r0, int64_t r1) {
    const norm_args *a = (const norm_args *)a_;
    const int64_t D = a->dim;
    const T *w = (const T *)a->w;
    float row[8192];
    for (int64_t r = r0; r < r1; r++) {
        T *x = (T *)a->x + r * D, *o = (T *)a->out + r * D;
        const T *d = a->d ? (const T *)a->d + r * D : NULL;
        float ss = 0.f;
        if (d) {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < D; i++) {
                const T s = OUT(IN(x[i]) + IN(d[i]));     /* the residual stream keeps T's precision */
                x[i] = s;
                row[i] = IN(s);
                ss += row[i] * row[i];
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < D; i++) {
                row[i] = IN(x[i]);
                ss += row[i] * row[i];
            }
        }
        const float inv = 1.f / sqrtf(ss / (float)D + a->eps);
#pragma omp simd
        for (int64_t i = 0; i < D; i++) o[i] = OUT(IN(w[i]) * (row[i] * inv));
    }
}

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i]: the gate and up projections side by side */
static void NAME(silu_rows)(const void *a_, int64_t r0, int64_t r1) {
    const silu_args *a = (const silu_args *)a_;
    const int64_t I = a->inter;
    for (int64_t r = r0; r < r1; r++) {
        const T *g = (const T *)a->gu + r * 2 * I, *u = g + I;
        T *o = (T *)a->out + r * I;
        int64_t i0 = 0;
#if HAVE16
        for (; i0 + 16 <= I; i0 += 16) STORE16(o + i0, silu_mul16(LOAD16(g + i0), LOAD16(u + i0)));
#endif
        for (int64_t i = i0; i < I; i++) {
            const float x = IN(g[i]), e = exp_neg(x < 0.f ? x : -x);     /* e^-|x| */
            const float s = x < 0.f ? e / (1.f + e) : 1.f / (1.f + e);  /* sigmoid(x) */
            o[i] = OUT(x * s * IN(u[i]));
        }
    }
}

/* in place: each head h < heads of each row, x = x * cos + rotate_half(x) * sin (cos, sin: [rows, head_dim] T) */
static void NAME(rope_rows)(const void *a_, int64_t r0, int64_t r1) {
    const rope_args *a = (const rope_args *)a_;
    const int64_t Dh = a->head_dim, half = Dh / 2;
    for (int64_t r = r0; r < r1; r++) {
        const T *c = (const T *)a->cos + r * Dh, *s = (const T *)a->sin + r * Dh;
        for (int64_t h = 0; h < a->heads; h++) {
            T *x = (T *)a->x + r * a->row + h * Dh;
            float lo[512], hi[512];
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                lo[i] = IN(x[i]);
                hi[i] = IN(x[i + half]);
            }
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                x[i] = OUT(lo[i] * IN(c[i]) - hi[i] * IN(s[i]));
                x[i + half] = OUT(hi[i] * IN(c[i + half]) + lo[i] * IN(s[i + half]));
            }
        }
    }
}

/* x: [rows, dim]; d: the same or NULL; w: [dim]; out: [rows, dim]. Returns -1 for a dim it does not take. */
int NAME(riptide_rms_norm)(void *x, const void *d, const void *w, void *out, int64_t rows, int64_t dim, float eps,
                          int threads) {
    if (dim > 8192) return -1;
    const norm_args a = {x, d, w, out, dim, eps};
    parallel_rows(NAME(norm_rows), &a, rows, threads);
    return 0;
}

int NAME(riptide_silu_mul)(const void *gu, void *out, int64_t rows, int64_t inter, int threads) {
    const silu_args a = {gu, out, inter};
    parallel_rows(NAME(silu_rows), &a, rows, threads);
    return 0;
}

/* x: rows of `row` elements whose first heads * head_dim are rotated (q and k side by side, v after) */
int NAME(riptide_rope)(void *x, const void *cos, const void *sin, int64_t rows, int64_t row, int64_t heads,
                      int64_t head_dim, int threads) {
    if (head_dim > 1024 || head_dim % 2) return -1;
    const rope_args a = {x, cos, sin, row, heads, head_dim};
    parallel_rows(NAME(rope_rows), &a, rows, threads);
    return 0;
}

#endif  /* T */
