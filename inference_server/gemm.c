/* fp32 matmul for the CPU fast path's projections: y = x @ W^T (+ bias), W packed once as [N/64][K][64]
 * (64-column panels, each a contiguous [K, 64] slab), on torch's OpenMP team.
 *
 * Built by inference_server/paged_kernel.py with the other kernels. Why not oneDNN's fp32 matmul: at
 * the rows a decode step has (1-256) it reads the weights and feeds the FMAs worse (SmolLM2-135M's
 * 120 projections on two cores, 64 rows: 69 ms against 53 here; 16 rows 34 against 26; 1 row 25
 * against 18, where this reads the weights at the machine's bandwidth); from ~1000 rows they are even.
 *
 * The micro-kernel: 6 rows x 64 columns of y in 24 AVX-512 registers, over k one broadcast of x and
 * one [64] row of the panel at a time. Each panel is read from memory once a block of rows (the
 * next panel comes into L2 during all of this one's row groups), then from L2 for the block's other rows.
 * Sums run in fp32 over blocks of K_BLOCK k's, then across the blocks (the same terms as any fp32
 * matmul, in another order; the two levels keep its rounding near oneDNN's).
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#define K_BLOCK 96

/* y[R rows, 64 columns] = x[R, K] @ w (a [K, 64] panel) + bias: k in blocks of K_BLOCK, each block's
 * sums made from zero in registers and then added to y (a two-level sum: rounding grows with
 * K_BLOCK + K / K_BLOCK terms, not K) */
static inline __attribute__((always_inline)) void mk(const int R, const float *x, int64_t ldx, const float *w,
                                                      int64_t K, float *y, int64_t ldy, const float *bias,
                                                      const char *next, int64_t next_lines) {
    /* next_lines cache lines from `next` into L2, spread evenly over this call's K steps (a running
       remainder, no division a step) */
    int64_t owed = 0;
    for (int64_t k0 = 0; k0 < K; k0 += K_BLOCK) {
        const int64_t k1 = K - k0 < K_BLOCK ? K : k0 + K_BLOCK;
        __m512 a[6][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) a[r][j] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k++) {
            const float *wk = w + k * 64;
            for (int c = 0; c < 64; c += 16) _mm_prefetch((const char *)(wk + 64 * 16 + c), _MM_HINT_T0);
            for (owed += next_lines; owed >= K; owed -= K, next += 64) _mm_prefetch(next, _MM_HINT_T1);
            const __m512 b0 = _mm512_loadu_ps(wk), b1 = _mm512_loadu_ps(wk + 16);
            const __m512 b2 = _mm512_loadu_ps(wk + 32), b3 = _mm512_loadu_ps(wk + 48);
            for (int r = 0; r < R; r++) {
                const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
                a[r][0] = _mm512_fmadd_ps(xr, b0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(xr, b1, a[r][1]);
                a[r][2] = _mm512_fmadd_ps(xr, b2, a[r][2]);
                a[r][3] = _mm512_fmadd_ps(xr, b3, a[r][3]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) {
                float *yj = y + r * ldy + 16 * j;
                const __m512 base = k0 ? _mm512_loadu_ps(yj) : bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
                _mm512_storeu_ps(yj, _mm512_add_ps(base, a[r][j]));
            }
    }
}

/* rows [0, M) of x through one panel (K rows of 64), while the next panel (or NULL) comes into L2: its
 * lines dealt evenly to the row groups, so that memory streams it during all of this panel's arithmetic
 * (fetched in the first group alone, the next panel's read and this one's sums took turns) */
static void panel_rows(const float *x, int64_t ldx, const float *w, int64_t K, float *y, int64_t ldy,
                       const float *bias, int64_t M, const float *next) {
    const int64_t groups = (M + 5) / 6, lines = next ? K * 4 : 0;        /* 64 floats a k: 4 lines */
    int64_t m = 0, g = 0;
    const char *nx = (const char *)next;
#define SHARE(g) (lines * ((g) + 1) / groups - lines * (g) / groups)
    for (; m + 6 <= M; m += 6, g++) {
        mk(6, x + m * ldx, ldx, w, K, y + m * ldy, ldy, bias, nx, SHARE(g));
        nx += 64 * SHARE(g);
    }
    x += m * ldx, y += m * ldy;
    const int64_t last = g < groups ? SHARE(g) : 0;
#undef SHARE
    switch (M - m) {
    case 5: mk(5, x, ldx, w, K, y, ldy, bias, nx, last); break;
    case 4: mk(4, x, ldx, w, K, y, ldy, bias, nx, last); break;
    case 3: mk(3, x, ldx, w, K, y, ldy, bias, nx, last); break;
    case 2: mk(2, x, ldx, w, K, y, ldy, bias, nx, last); break;
    case 1: mk(1, x, ldx, w, K, y, ldy, bias, nx, last); break;
    default: break;
    }
}
#endif

#define ROW_BLOCK 256

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T (+ bias [N]), W packed as [N/64][K][64].
 * Returns 0, or -1 where it was not built for it (no AVX-512, N not a multiple of 64): the caller falls back. */
int riptide_sgemm_f32(const float *x, int64_t ldx, const float *wp, const float *bias, float *y, int64_t ldy,
                      int64_t M, int64_t N, int64_t K, int threads) {
#if defined(__AVX512F__)
    if (N % 64 || M < 0 || K <= 0) return -1;
    const int64_t panels = N / 64;
    if (threads < 1) threads = 1;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        const int64_t mm = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
        /* few panels: each also cut in two by rows, so that the threads' shares come out even */
        const int64_t halves = (threads > 1 && panels < 8 * threads && mm >= 12) ? 2 : 1, items = panels * halves;
        const int64_t cut = (mm / 2 + 5) / 6 * 6;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
        for (int64_t it = 0; it < items; it++) {
            const int64_t p = it / halves, h = it % halves;
            const int64_t r0 = halves == 1 || h == 0 ? 0 : cut, r1 = halves == 1 || h == 1 ? mm : cut;
            const float *next = p + 1 < panels && (halves == 1 || h == 1) ? wp + (p + 1) * K * 64 : 0;
            panel_rows(x + (m0 + r0) * ldx, ldx, wp + p * K * 64, K, y + (m0 + r0) * ldy + p * 64, ldy,
                       bias ? bias + p * 64 : 0, r1 - r0, next);
        }
    }
    return 0;
#else
    (void)x, (void)ldx, (void)wp, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)threads;
    return -1;
#endif
}
