/* Causal attention of a newcomer's own tokens (a prefill computed this step, no cached prefix), fp32, CPU:
 * what DecoderRunner._prefill_attention calls instead of torch's SDPA for head_dim 64 and up to 4 query
 * heads a KV head (SmolLM2, Llama 3 and Qwen 2.5's small models). torch's CPU flash attention ran at
 * ~55 GFLOP/s a core on SmolLM2-135M's shapes (9 heads over 3 KV heads, 16-512 tokens).
 *
 * Per KV head the keys are first transposed ([64][n], padded to 16), so that 16 scores of a query come
 * from 64 broadcast FMAs against rows of 16 keys; a tile of 4 positions x `group` query heads (up to 16
 * queries) shares each row. Online softmax over blocks of 16 keys (flash attention's recurrence), the
 * exponential a polynomial (relative error ~2e-7, as paged_attention.c's), the output accumulated in
 * fp32 a tile at a time. Work items (KV head, tile) go to torch's OpenMP team.
 *
 * q [n, heads, 64] rows q_row floats apart (head h at h * 64); k, v [n, kv_heads, 64] rows k_row, v_row
 * apart; out [n, heads, 64] rows out_row apart. kt: scratch of kv_heads * 64 * round_up(n, 16) floats.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp_neg.h"

#define TILE 4
#define MAXQ 16

#if defined(__AVX512F__)
#include <immintrin.h>

/* one tile: positions i0 .. i0 + ti - 1, the `group` query heads of KV head h */
static inline __attribute__((always_inline)) void tile_(const float *q, int64_t q_row, const float *kt, int64_t npad,
                                                        const float *v, int64_t v_row, float *out, int64_t out_row,
                                                        int64_t i0, int ti, int h, const int group, float scale) {
    /* query r: position i0 + r / group, head h * group + r % group; a full tile's count is a constant,
       so its scores stay in registers */
    const int nq = ti == TILE ? TILE * group : ti * group;
    const float *qr[MAXQ];
    float m[MAXQ], l[MAXQ], o[MAXQ][64] __attribute__((aligned(64))), p[MAXQ][16] __attribute__((aligned(64)));
    for (int r = 0; r < nq; r++) {
        qr[r] = q + (i0 + r / group) * q_row + (int64_t)(h * group + r % group) * 64;
        m[r] = -INFINITY, l[r] = 0.f;
        memset(o[r], 0, sizeof o[r]);
    }
    const int64_t end = i0 + ti;               /* keys [0, end): causal */
    for (int64_t j0 = 0; j0 < end; j0 += 16) {
        __m512 s[MAXQ];
        for (int r = 0; r < nq; r++) s[r] = _mm512_setzero_ps();
        for (int d = 0; d < 64; d++) {
            const __m512 kd = _mm512_loadu_ps(kt + d * npad + j0);
            for (int r = 0; r < nq; r++) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), kd, s[r]);
        }
        const int nb = end - j0 < 16 ? (int)(end - j0) : 16;
        float corr[MAXQ];
        for (int r = 0; r < nq; r++) {
            const int64_t pos = i0 + r / group;        /* keys j <= pos */
            const int64_t lim = pos - j0 + 1;          /* keys of this block it sees */
            const __mmask16 seen = lim >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << lim) - 1u);
            const __m512 sr = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, _mm512_mul_ps(s[r], _mm512_set1_ps(scale)));
            const float mx = fmaxf(m[r], _mm512_reduce_max_ps(sr));
            const __m512 pr = _mm512_maskz_mov_ps(seen, exp_neg16(_mm512_sub_ps(sr, _mm512_set1_ps(mx))));
            _mm512_store_ps(p[r], pr);
            corr[r] = m[r] == -INFINITY ? 0.f : expf(m[r] - mx);
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(pr);
            m[r] = mx;
        }
        for (int r0 = 0; r0 < nq; r0 += 2) {        /* two queries at a time share each value row's loads */
            const int two = r0 + 1 < nq;
            const __m512 c0 = _mm512_set1_ps(corr[r0]), c1 = _mm512_set1_ps(two ? corr[r0 + 1] : 0.f);
            __m512 a0 = _mm512_mul_ps(_mm512_load_ps(o[r0]), c0), a1 = _mm512_mul_ps(_mm512_load_ps(o[r0] + 16), c0);
            __m512 a2 = _mm512_mul_ps(_mm512_load_ps(o[r0] + 32), c0), a3 = _mm512_mul_ps(_mm512_load_ps(o[r0] + 48), c0);
            __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
            if (two) {
                b0 = _mm512_mul_ps(_mm512_load_ps(o[r0 + 1]), c1), b1 = _mm512_mul_ps(_mm512_load_ps(o[r0 + 1] + 16), c1);
                b2 = _mm512_mul_ps(_mm512_load_ps(o[r0 + 1] + 32), c1), b3 = _mm512_mul_ps(_mm512_load_ps(o[r0 + 1] + 48), c1);
            }
            const int lim0 = (int)(i0 + r0 / group - j0 + 1), lim1 = two ? (int)(i0 + (r0 + 1) / group - j0 + 1) : 0;
            const int n0 = lim0 < nb ? lim0 : nb, n1 = lim1 < nb ? lim1 : nb, nn = n0 > n1 ? n0 : n1;
            for (int t = 0; t < nn; t++) {
                const float *vt = v + (j0 + t) * v_row + (int64_t)h * 64;
                const __m512 v0 = _mm512_loadu_ps(vt), v1 = _mm512_loadu_ps(vt + 16);
                const __m512 v2 = _mm512_loadu_ps(vt + 32), v3 = _mm512_loadu_ps(vt + 48);
                const __m512 p0 = _mm512_set1_ps(p[r0][t]), p1 = _mm512_set1_ps(two ? p[r0 + 1][t] : 0.f);
                a0 = _mm512_fmadd_ps(p0, v0, a0), a1 = _mm512_fmadd_ps(p0, v1, a1);
                a2 = _mm512_fmadd_ps(p0, v2, a2), a3 = _mm512_fmadd_ps(p0, v3, a3);
                b0 = _mm512_fmadd_ps(p1, v0, b0), b1 = _mm512_fmadd_ps(p1, v1, b1);
                b2 = _mm512_fmadd_ps(p1, v2, b2), b3 = _mm512_fmadd_ps(p1, v3, b3);
            }
            _mm512_store_ps(o[r0], a0), _mm512_store_ps(o[r0] + 16, a1), _mm512_store_ps(o[r0] + 32, a2), _mm512_store_ps(o[r0] + 48, a3);
            if (two)
                _mm512_store_ps(o[r0 + 1], b0), _mm512_store_ps(o[r0 + 1] + 16, b1),
                _mm512_store_ps(o[r0 + 1] + 32, b2), _mm512_store_ps(o[r0 + 1] + 48, b3);
        }
    }
    for (int r = 0; r < nq; r++) {
        float *dst = out + (i0 + r / group) * out_row + (int64_t)(h * group + r % group) * 64;
        const __m512 inv = _mm512_set1_ps(1.f / l[r]);
        for (int c = 0; c < 64; c += 16) _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_load_ps(o[r] + c), inv));
    }
}

static void tile(const float *q, int64_t q_row, const float *kt, int64_t npad, const float *v, int64_t v_row,
                 float *out, int64_t out_row, int64_t i0, int ti, int h, int group, float scale) {
#define TILE_G(G) (ti == TILE ? tile_(q, q_row, kt, npad, v, v_row, out, out_row, i0, TILE, h, G, scale) \
                              : tile_(q, q_row, kt, npad, v, v_row, out, out_row, i0, ti, h, G, scale))
    switch (group) {
    case 1: TILE_G(1); break;
    case 2: TILE_G(2); break;
    case 3: TILE_G(3); break;
    default: TILE_G(4); break;
    }
#undef TILE_G
}
#endif

/* Returns 0, or -1 for sizes it was not built for (head_dim != 64, group > 4, no AVX-512): SDPA then. */
int riptide_prefill_attention_f32(const float *q, int64_t q_row, const float *k, int64_t k_row, const float *v,
                                  int64_t v_row, float *out, int64_t out_row, float *kt, int64_t n, int kv_heads,
                                  int group, int head_dim, float scale, int threads) {
#if defined(__AVX512F__)
    if (head_dim != 64 || group < 1 || group * TILE > MAXQ || n <= 0) return -1;
    const int64_t npad = (n + 15) / 16 * 16, tiles = (n + TILE - 1) / TILE;
    if (threads < 1) threads = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t hj = 0; hj < (int64_t)kv_heads * npad; hj++) {      /* kt[h][d][j] = k[j][h][d] */
            const int64_t h = hj / npad, j = hj % npad;
            float *col = kt + h * 64 * npad + j;
            if (j < n) {
                const float *kj = k + j * k_row + h * 64;
                for (int d = 0; d < 64; d++) col[d * npad] = kj[d];
            } else
                for (int d = 0; d < 64; d++) col[d * npad] = 0.f;
        }
        /* items: (KV head, tile), the longest (last) tiles first, dealt as they free up */
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t w = 0; w < (int64_t)kv_heads * tiles; w++) {
            const int64_t t = tiles - 1 - w / kv_heads;
            const int h = (int)(w % kv_heads);
            const int64_t i0 = t * TILE;
            tile(q, q_row, kt + h * 64 * npad, npad, v, v_row, out, out_row, i0, (int)(n - i0 < TILE ? n - i0 : TILE),
                 h, group, scale);
        }
    }
    return 0;
#else
    (void)q, (void)q_row, (void)k, (void)k_row, (void)v, (void)v_row, (void)out, (void)out_row, (void)kt, (void)n;
    (void)kv_heads, (void)group, (void)head_dim, (void)scale, (void)threads;
    return -1;
#endif
}
