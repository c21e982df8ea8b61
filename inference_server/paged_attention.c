/* Decode attention read in place from a paged KV cache (fp32 or bf16 keys and values, CPU): what PagedDecoderRunner calls
 * instead of gathering each row's blocks into a workspace and running SDPA there. Each row has one
 * query token; the query heads that share a KV head are done together, block by block, with an
 * online softmax (flash-decoding's recurrence), so each key and value is read once, from its block.
 *
 * Built by inference_server/paged_kernel.py with the machine's C compiler (no torch headers) and
 * called through ctypes, which lets go of the GIL for the call.
 *
 * This file is read twice by the compiler (it includes itself): once for fp32 keys and values
 * (riptide_paged_decode_f32) and once for bf16 ones (riptide_paged_decode_bf16, each loaded 16 at a
 * time and widened to fp32, so the arithmetic is fp32 in both).
 *
 * q:      [rows, heads, head_dim] fp32 (row stride q_row floats), heads = kv_heads * group
 * kp, vp: [blocks, kv_heads, block_size, head_dim], one layer's keys and values (fp32 or bf16)
 * table:  [rows, table_row] block ids, row r's first ceil(lens[r] / block_size) used
 * lens:   [rows] key positions row r attends to (its own position + 1)
 * out:    [rows, heads, head_dim] fp32 (row stride out_row floats)
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_neg.h"

#define MAX_GROUP 64
#define MAX_HEAD_DIM 512
#define MAX_BLOCK 256
#define MAX_THREADS 64

#ifndef KV_T
typedef struct {
    const float *q;
    const void *kp, *vp;
    const int64_t *table, *lens;
    float *out;
    int64_t q_row, table_row, out_row, w0, w1;
    int kv_heads, group, head_dim, block_size;
    float scale;
} job_t;

#if defined(__AVX512F__)
#include <immintrin.h>
/* out[j] = the sum of v[j]'s 16 lanes, j < 16: a transposing tree of shuffles and adds (45
 * instructions for 16 sums, where one sum alone takes ~8). */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4];
    for (int k = 0; k < 8; k++)    /* each 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++)    /* each lane: its sums of v[4k .. 4k+3] */
        b[k] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* lanes t0 .. n - 1 of a 16-lane run at t0 (all 16 when n - t0 >= 16) */
static inline __mmask16 lanes16(int t0, int n) {
    return n - t0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t0)) - 1u);
}

/* e^(s[t] - mx) in place for t < n, returning their sum (a last run of fewer than 16 masked: what
 * lies past n is never read) */
static inline float exp_sum16(float *s, int n, float mx) {
    const __m512 m = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16) {
        const __mmask16 k = lanes16(t, n);
        const __m512 p = _mm512_maskz_mov_ps(k, exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m)));
        _mm512_mask_storeu_ps(s + t, k, p);
        sum = _mm512_add_ps(sum, p);
    }
    return _mm512_reduce_add_ps(sum);
}

static inline float max16(const float *s, int n, float mx) {
    __m512 m = _mm512_set1_ps(mx);
    for (int t = 0; t < n; t += 16) m = _mm512_mask_max_ps(m, lanes16(t, n), m, _mm512_maskz_loadu_ps(lanes16(t, n), s + t));
    return _mm512_reduce_max_ps(m);
}

/* a block's keys 16 at a time; a last run of fewer than 16 too where the block has room for 16 (its
 * scores past n are of whatever those rows hold, and never used); then softmax and values vectorised */
#define DOTS16(D) ((D) % 16 == 0)
#define VEC16(D, n, BS) ((D) % 64 == 0 && ((n) % 16 == 0 || (BS) % 16 == 0))
#else
#define VEC16(D, n, BS) 0
#define DOTS16(D) 0
static inline float exp_sum16(float *s, int n, float mx) { (void)s, (void)n, (void)mx; return 0.f; }
static inline float max16(const float *s, int n, float mx) { (void)s, (void)n; return mx; }
#endif

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t i; float f; } u;
    u.i = (uint32_t)x << 16;
    return u.f;
}

/* This step's keys and values into their blocks, one copy a (token, KV head): token i's rows of
 * k and v (head h at h * head_bytes from k + src[i] * k_row) go to pool rows base[i] + h * block_size
 * of kf and vf (head_bytes apart): what two index_select and two index_copy_ a layer did. */
int riptide_kv_write(const char *k, int64_t k_row, const char *v, int64_t v_row, const int64_t *src, const int64_t *base,
                     int64_t n, int kv_heads, int64_t head_bytes, int64_t block_size, char *kf, char *vf) {
    for (int64_t i = 0; i < n; i++)
        for (int h = 0; h < kv_heads; h++) {
            const int64_t to = (base[i] + h * block_size) * head_bytes, from = h * head_bytes;
            memcpy(kf + to, k + src[i] * k_row + from, head_bytes);
            memcpy(vf + to, v + src[i] * v_row + from, head_bytes);
        }
    return 0;
}

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(x) CAT(x, SUF)

#define KV_T float
#define SUF f32
#define SCALAR(x) (x)
#define LOAD16(p) _mm512_loadu_ps(p)
#include "paged_attention.c"
#undef KV_T
#undef SUF
#undef SCALAR
#undef LOAD16

#define KV_T uint16_t
#define SUF bf16
#define SCALAR(x) bf16_to_f32(x)
#define LOAD16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#include "paged_attention.c"

#else   /* KV_T: the kernel for keys and values of type KV_T */
#if defined(__AVX512F__)
/* s[j] = scale * q . k[j] for 16 consecutive keys (D a multiple of 16) */
static inline void NAME(dots16)(const float *q, const KV_T *k, int D, float scale, float *s) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) {
        const KV_T *kj = k + j * D;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), LOAD16(kj));
        for (int i = 16; i < D; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), LOAD16(kj + i), a);
        acc[j] = a;
    }
    _mm512_storeu_ps(s, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}

/* acc[:D] = acc * corr + sum_t p[t] v[t] (D a multiple of 64): 64 columns at a time in registers */
static inline void NAME(pv64)(float *acc, const float *p, const KV_T *v, int n, int D, float corr) {
    const __m512 c = _mm512_set1_ps(corr);
    for (int i = 0; i < D; i += 64) {
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + i), c), a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + i + 16), c);
        __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(acc + i + 32), c), a3 = _mm512_mul_ps(_mm512_loadu_ps(acc + i + 48), c);
        for (int t = 0; t < n; t++) {
            const __m512 pt = _mm512_set1_ps(p[t]);
            const KV_T *vt = v + t * D + i;
            a0 = _mm512_fmadd_ps(pt, LOAD16(vt), a0);
            a1 = _mm512_fmadd_ps(pt, LOAD16(vt + 16), a1);
            a2 = _mm512_fmadd_ps(pt, LOAD16(vt + 32), a2);
            a3 = _mm512_fmadd_ps(pt, LOAD16(vt + 48), a3);
        }
        _mm512_storeu_ps(acc + i, a0);
        _mm512_storeu_ps(acc + i + 16, a1);
        _mm512_storeu_ps(acc + i + 32, a2);
        _mm512_storeu_ps(acc + i + 48, a3);
    }
}

/* The same for the G <= 4 query heads of a KV head at once (D = 64): each value row is loaded (and
 * widened) once for all of them, and the G * 4 accumulators are independent chains (one head's 4
 * wait on each other's FMA latency). p: head g's weights at p + g * p_stride. */
static inline __attribute__((always_inline)) void NAME(pvg64_)(float *acc, const float *p, int p_stride, const KV_T *v,
                                                               int n, const float *corr, const int G) {
    __m512 a[4][4];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 4; i++) a[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * 64 + 16 * i), _mm512_set1_ps(corr[g]));
    for (int t = 0; t < n; t++) {
        const KV_T *vt = v + t * 64;
        const __m512 v0 = LOAD16(vt), v1 = LOAD16(vt + 16), v2 = LOAD16(vt + 32), v3 = LOAD16(vt + 48);
        for (int g = 0; g < G; g++) {
            const __m512 pt = _mm512_set1_ps(p[g * p_stride + t]);
            a[g][0] = _mm512_fmadd_ps(pt, v0, a[g][0]);
            a[g][1] = _mm512_fmadd_ps(pt, v1, a[g][1]);
            a[g][2] = _mm512_fmadd_ps(pt, v2, a[g][2]);
            a[g][3] = _mm512_fmadd_ps(pt, v3, a[g][3]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc + g * 64 + 16 * i, a[g][i]);
}

/* 1 if it did them: G in 1..4 and D = 64 */
static inline int NAME(pvg64)(float *acc, const float *p, int p_stride, const KV_T *v, int n, int D, const float *corr, int G) {
    if (D != 64) return 0;
    switch (G) {
    case 1: NAME(pvg64_)(acc, p, p_stride, v, n, corr, 1); return 1;
    case 2: NAME(pvg64_)(acc, p, p_stride, v, n, corr, 2); return 1;
    case 3: NAME(pvg64_)(acc, p, p_stride, v, n, corr, 3); return 1;
    case 4: NAME(pvg64_)(acc, p, p_stride, v, n, corr, 4); return 1;
    default: return 0;
    }
}

/* 16 keys widened to fp32 once (bf16), so the G query heads' dot products read them as fp32 */
static inline const float *NAME(keys16)(const KV_T *k, int D, float *buf) {
    if (sizeof(KV_T) == sizeof(float)) return (const float *)k;
    for (int i = 0; i < 16 * D; i += 16) _mm512_storeu_ps(buf + i, LOAD16(k + i));
    return buf;
}
#else
static inline int NAME(pvg64)(float *acc, const float *p, int p_stride, const KV_T *v, int n, int D, const float *corr, int G) {
    (void)acc, (void)p, (void)p_stride, (void)v, (void)n, (void)D, (void)corr, (void)G;
    return 0;
}
static inline const float *NAME(keys16)(const KV_T *k, int D, float *buf) { (void)D, (void)buf; return (const float *)k; }
static inline void NAME(dots16)(const float *q, const KV_T *k, int D, float scale, float *s) {
    (void)q, (void)k, (void)D, (void)scale, (void)s;
}
static inline void NAME(pv64)(float *acc, const float *p, const KV_T *v, int n, int D, float corr) {
    (void)acc, (void)p, (void)v, (void)n, (void)D, (void)corr;
}
#endif

/* One (row, KV head): its `group` query heads over the row's blocks. D is a constant in the
 * specialised copies (64, 128), so a head's accumulator stays in registers across a block. */
#undef ONE_HEAD
#define ONE_HEAD(FN, DIM)                                                                        \
    static void FN(const job_t *j, int64_t r, int h, float *s) {                                  \
        const int G = j->group, D = (DIM) ? (DIM) : j->head_dim, BS = j->block_size;                \
        const float *qh = j->q + r * j->q_row + (int64_t)h * G * D;                                 \
        const int64_t len = j->lens[r];                                                             \
        float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP * MAX_HEAD_DIM], kbuf[16 * MAX_HEAD_DIM];    \
        for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; }                                \
        memset(acc, 0, sizeof(float) * G * D);                                                     \
        for (int64_t b = 0; b * BS < len; b++) {                                                    \
            const int n = (int)(len - b * BS < BS ? len - b * BS : BS);                             \
            const int64_t page = j->table[r * j->table_row + b] * j->kv_heads + h;                  \
            const KV_T *kb = (const KV_T *)j->kp + page * BS * D, *vb = (const KV_T *)j->vp + page * BS * D;                   \
            const int64_t ahead = (b + 1) * BS < len ? j->table[r * j->table_row + b + 1] * j->kv_heads + h : page; \
            const char *kn = (const char *)((const KV_T *)j->kp + ahead * BS * D), *vn = (const char *)((const KV_T *)j->vp + ahead * BS * D); \
            int t0 = 0;                                                                             \
            if (DOTS16(D))                                                                          \
                for (; t0 < n && t0 + 16 <= BS; t0 += 16) {                                         \
                    /* the next block's same keys and values (this one's on the last), while these run */ \
                    for (int c = 0; c < 16 * D * (int)sizeof(KV_T); c += 64) {                                      \
                        __builtin_prefetch(kn + t0 * D * sizeof(KV_T) + c);                                    \
                        __builtin_prefetch(vn + t0 * D * sizeof(KV_T) + c);                                    \
                    }                                                                               \
                    if (sizeof(KV_T) == sizeof(float) || G == 1)                                    \
                        for (int g = 0; g < G; g++)                                                 \
                            NAME(dots16)(qh + g * D, kb + t0 * D, D, j->scale, s + g * BS + t0);          \
                    else {                                                                          \
                        const float *k32 = NAME(keys16)(kb + t0 * D, D, kbuf);                      \
                        for (int g = 0; g < G; g++)                                                 \
                            dots16_f32(qh + g * D, k32, D, j->scale, s + g * BS + t0);              \
                    }                                                                               \
                }                                                                                   \
            for (int t = t0; t < n; t++)                                                            \
                for (int g = 0; g < G; g++) {                                                       \
                    const float *qg = qh + g * D;                                   \
                    const KV_T *kt = kb + t * D;                                 \
                    float d = 0.f;                                                                  \
                    _Pragma("omp simd reduction(+ : d)")                                            \
                    for (int i = 0; i < D; i++) d += qg[i] * SCALAR(kt[i]);                                 \
                    s[g * BS + t] = d * j->scale;                                                   \
                }                                                                                   \
            if (VEC16(D, n, BS) && D == 64 && G <= 4) {                                                 \
                float corr[4];                                                                      \
                for (int g = 0; g < G; g++) {                                                       \
                    float *sg = s + g * BS;                                                         \
                    const float mx = max16(sg, n, m[g]), sum = exp_sum16(sg, n, mx);                \
                    corr[g] = m[g] == -INFINITY ? 0.f : exp_neg(m[g] - mx);                         \
                    l[g] = l[g] * corr[g] + sum;                                                    \
                    m[g] = mx;                                                                      \
                }                                                                                   \
                if (NAME(pvg64)(acc, s, BS, vb, n, D, corr, G)) continue;                           \
            }                                                                                       \
            for (int g = 0; g < G; g++) {                                                           \
                float *sg = s + g * BS, mx = m[g], sum = 0.f;                                       \
                if (VEC16(D, n, BS)) {                                                                  \
                    mx = max16(sg, n, mx);                                                          \
                    sum = exp_sum16(sg, n, mx);                                                     \
                    const float corr = m[g] == -INFINITY ? 0.f : exp_neg(m[g] - mx);                \
                    NAME(pv64)(acc + g * D, sg, vb, n, D, corr);                                          \
                    l[g] = l[g] * corr + sum;                                                       \
                    m[g] = mx;                                                                      \
                    continue;                                                                       \
                }                                                                                   \
                for (int t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;                           \
                _Pragma("omp simd reduction(+ : sum)")                                              \
                for (int t = 0; t < n; t++) { sg[t] = exp_neg(sg[t] - mx); sum += sg[t]; }          \
                const float corr = m[g] == -INFINITY ? 0.f : exp_neg(m[g] - mx);                    \
                float a[(DIM) ? (DIM) : MAX_HEAD_DIM], *ag = acc + g * D;                           \
                for (int i = 0; i < D; i++) a[i] = ag[i] * corr;                                    \
                for (int t = 0; t < n; t++) {                                                       \
                    const float p = sg[t];                                      \
                    const KV_T *vt = vb + t * D;                                        \
                    _Pragma("omp simd")                                                             \
                    for (int i = 0; i < D; i++) a[i] += p * SCALAR(vt[i]);                                  \
                }                                                                                   \
                for (int i = 0; i < D; i++) ag[i] = a[i];                                           \
                l[g] = l[g] * corr + sum;                                                           \
                m[g] = mx;                                                                          \
            }                                                                                       \
        }                                                                                           \
        float *oh = j->out + r * j->out_row + (int64_t)h * G * D;                                   \
        for (int g = 0; g < G; g++) {                                                               \
            const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;                                        \
            for (int i = 0; i < D; i++) oh[g * D + i] = acc[g * D + i] * inv;                       \
        }                                                                                           \
    }

ONE_HEAD(NAME(head_64), 64)
ONE_HEAD(NAME(head_128), 128)
ONE_HEAD(NAME(head_any), 0)

static void *NAME(run)(void *arg) {
    const job_t *j = (const job_t *)arg;
    float s[MAX_GROUP * MAX_BLOCK];
    void (*head)(const job_t *, int64_t, int, float *) =
        j->head_dim == 64 ? NAME(head_64) : j->head_dim == 128 ? NAME(head_128) : NAME(head_any);
    for (int64_t w = j->w0; w < j->w1; w++) head(j, w / j->kv_heads, (int)(w % j->kv_heads), s);
    return NULL;
}

/* Returns 0, or -1 for sizes it was not built for (the caller falls back). `threads` > 1 deals the
 * (row, KV head) items to that many threads in runs of about equal key positions. */
int NAME(riptide_paged_decode)(const float *q, int64_t q_row, const KV_T *kp, const KV_T *vp,
                             const int64_t *table, int64_t table_row, const int64_t *lens, float *out,
                             int64_t out_row, int64_t rows, int kv_heads, int group, int head_dim,
                             int block_size, float scale, int threads) {
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK || group * head_dim > MAX_GROUP * MAX_HEAD_DIM)
        return -1;
    job_t base = {q, kp, vp, table, lens, out, q_row, table_row, out_row, 0, rows * kv_heads,
                  kv_heads, group, head_dim, block_size, scale};
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || rows * kv_heads < 2) {
        NAME(run)(&base);
        return 0;
    }
    const int64_t items = rows * kv_heads;
    int64_t total = 0, c = 0;
    for (int64_t r = 0; r < rows; r++) total += (lens[r] + 16) * kv_heads;
    job_t jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0}, t = 0;
    jobs[0] = base;
    for (int64_t w = 0; w < items; w++) {          /* item w goes to the thread its middle falls in */
        const int64_t cost = lens[w / kv_heads] + 16;
        const int64_t tw = (c + cost / 2) * threads / total;
        while (t < tw && t < threads - 1) {
            jobs[t].w1 = w;
            jobs[++t] = base;
            jobs[t].w0 = w;
        }
        c += cost;
    }
    jobs[t].w1 = items;
    while (++t < threads) {
        jobs[t] = base;
        jobs[t].w0 = jobs[t].w1 = items;
    }
#ifdef _OPENMP
    /* torch's own OpenMP team (the library shares the libgomp torch loaded): no thread made a call, and
       no second pool spinning against torch's on the same cores */
    (void)tids; (void)started;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int j = 0; j < threads; j++)
        if (jobs[j].w1 > jobs[j].w0) NAME(run)(&jobs[j]);
#else
    for (int t = 1; t < threads; t++)
        started[t] = jobs[t].w1 > jobs[t].w0 && pthread_create(&tids[t], NULL, NAME(run), &jobs[t]) == 0;
    NAME(run)(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
        else NAME(run)(&jobs[t]);
    }
#endif
    return 0;
}
#endif  /* KV_T */
