/* cblas_sgemm for MLX's CPU matmuls, with few-row products on kernels of their own.
 *
 * MLX multiplies every float32 matrix through cblas_sgemm. OpenBLAS's sgemm packs the
 * weight matrix first, even for a product of one to a few rows, so a decode step, a draft
 * step and a verify of a few tokens read their weights about twice, at sgemm's pace.
 * Loaded globally before OpenBLAS's renamed copy, this definition is the one MLX binds
 * (models/platform/_blas.py, "few-row products"):
 *   - a row-major product of 1 to MAX_ROWS rows with A untransposed runs on the kernels
 *     below (AVX-512 or AVX2, the best the CPU's flags allow), each weight row
 *     read once for every row of A, split by weight rows over OpenBLAS's thread count;
 *   - without those kernels, a one-row product goes to OpenBLAS's sgemv;
 *   - everything else goes to OpenBLAS's cblas_sgemm unchanged.
 * Every output element is summed in the same order whatever the row count and the split,
 * so a row's product does not depend on what it is batched with.
 * _blas.py hands the OpenBLAS functions over through specslot_rows_set before MLX is imported.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_KERNELS 1
#else
#define HAVE_KERNELS 0
#endif

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
enum { ISA_NONE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum { MAX_ROWS = 8, MAX_THREADS = 16 };
#define SPLIT_MIN (64L * 1024)  /* weights (n * k) below which one thread does the product */
#define SPLIT_ALIGN 16          /* a split falls on whole vectors of every kernel */
#define SPIN_CHECKS 64 /* an idle helper looks this often (a few microseconds) before it sleeps */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
typedef int (*threads_fn)(void);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static threads_fn blas_threads;
static int isa;
static long sent_sgemv, sent_kernel;

/* c = alpha * s + beta * c, where beta == 0 never reads c (it may hold NaNs) */
static inline void put(float *c, float s, float alpha, float beta) {
    *c = beta == 0.0f ? alpha * s : alpha * s + beta * *c;
}

/* One range of output columns [n0, n1) for all m rows of A.
 * dot form (B is n x k, transposed): c[r][j] = sum_i a[r][i] b[j][i]
 * axpy form (B is k x n): c[r][j] = sum_i a[r][i] b[i][j] */
typedef void (*range_fn)(int k, const float *a, int lda, const float *b, int ldb, float *c, int ldc, int n0,
                         int n1, float alpha, float beta);

#if HAVE_KERNELS
#define DOT(NAME, M, TARGET, VT, W, ZERO, LOAD, FMA, SUM)                                                          \
    TARGET static void NAME(int k, const float *a, int lda, const float *b, int ldb, float *c, int ldc, int n0,  \
                            int n1, float alpha, float beta) {                                                   \
        for (int j = n0; j < n1; j++) {                                                                          \
            const float *w = b + (size_t)j * ldb;                                                                \
            VT acc[M];                                                                                           \
            _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) acc[r] = ZERO();                                 \
            int i = 0;                                                                                           \
            for (; i + W <= k; i += W) {                                                                         \
                VT wv = LOAD(w + i);                                                                             \
                _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) acc[r] =                                     \
                    FMA(wv, LOAD(a + (size_t)r * lda + i), acc[r]);                                              \
            }                                                                                                    \
            for (int r = 0; r < M; r++) {                                                                        \
                float s = SUM(acc[r]);                                                                           \
                for (int t = i; t < k; t++) s += a[(size_t)r * lda + t] * w[t];                                  \
                put(c + (size_t)r * ldc + j, s, alpha, beta);                                                    \
            }                                                                                                    \
        }                                                                                                        \
    }

#define AXPY(NAME, M, TARGET, VT, W, ZERO, LOAD, FMA, SET1, STORE)                                                \
    TARGET static void NAME(int k, const float *a, int lda, const float *b, int ldb, float *c, int ldc, int n0,  \
                            int n1, float alpha, float beta) {                                                   \
        int j = n0;                                                                                              \
        for (; j + W <= n1; j += W) {                                                                            \
            VT acc[M];                                                                                           \
            _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) acc[r] = ZERO();                                 \
            for (int i = 0; i < k; i++) {                                                                        \
                VT bv = LOAD(b + (size_t)i * ldb + j);                                                           \
                _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) acc[r] =                                     \
                    FMA(SET1(a[(size_t)r * lda + i]), bv, acc[r]);                                               \
            }                                                                                                    \
            for (int r = 0; r < M; r++) {                                                                        \
                float out[W];                                                                                    \
                STORE(out, acc[r]);                                                                              \
                for (int t = 0; t < W; t++) put(c + (size_t)r * ldc + j + t, out[t], alpha, beta);               \
            }                                                                                                    \
        }                                                                                                        \
        for (; j < n1; j++) {                                                                                    \
            for (int r = 0; r < M; r++) {                                                                        \
                float s = 0.0f;                                                                                  \
                for (int i = 0; i < k; i++) s += a[(size_t)r * lda + i] * b[(size_t)i * ldb + j];                \
                put(c + (size_t)r * ldc + j, s, alpha, beta);                                                    \
            }                                                                                                    \
        }                                                                                                        \
    }

#define T512 __attribute__((target("avx512f")))
#define T256 __attribute__((target("avx2,fma")))

T256 static inline float sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define KERNELS(M)                                                                                               \
    DOT(dot512_##M, M, T512, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,                    \
        _mm512_reduce_add_ps)                                                                                    \
    DOT(dot256_##M, M, T256, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, sum256)             \
    AXPY(axpy512_##M, M, T512, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_set1_ps, \
         _mm512_storeu_ps)                                                                                       \
    AXPY(axpy256_##M, M, T256, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, _mm256_set1_ps,  \
         _mm256_storeu_ps)
KERNELS(1)
KERNELS(2)
KERNELS(3)
KERNELS(4)
KERNELS(5)
KERNELS(6)
KERNELS(7)
KERNELS(8)

/* [isa][dot 0 / axpy 1][m] */
static const range_fn ranges[3][2][MAX_ROWS + 1] = {
    [ISA_AVX2] = {{0, dot256_1, dot256_2, dot256_3, dot256_4, dot256_5, dot256_6, dot256_7, dot256_8},
                  {0, axpy256_1, axpy256_2, axpy256_3, axpy256_4, axpy256_5, axpy256_6, axpy256_7, axpy256_8}},
    [ISA_AVX512] = {{0, dot512_1, dot512_2, dot512_3, dot512_4, dot512_5, dot512_6, dot512_7, dot512_8},
                    {0, axpy512_1, axpy512_2, axpy512_3, axpy512_4, axpy512_5, axpy512_6, axpy512_7, axpy512_8}},
};
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

/* The helpers: started on first use, up to MAX_THREADS - 1; each looks for the next product
 * SPIN_CHECKS times, then sleeps until woken (spinning longer takes a core from the rest of
 * a small machine, as OpenBLAS's idle threads did: docs/configuration.md, "CPU BLAS"). One
 * caller uses them at a time; a second concurrent caller computes its product alone. */
static struct {
    range_fn fn;
    int k, lda, ldb, ldc, n, parts;
    const float *a, *b;
    float *c;
    float alpha, beta;
} job;
static atomic_uint job_gen;
static atomic_int job_pending, sleepers, pool_busy;
static int helpers;
static unsigned spawn_gen; /* the generation a new helper has already seen */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;

static void run_part(int part) {
    int per = (job.n + job.parts - 1) / job.parts;
    per = (per + SPLIT_ALIGN - 1) / SPLIT_ALIGN * SPLIT_ALIGN;
    int n0 = part * per, n1 = n0 + per < job.n ? n0 + per : job.n;
    if (n0 < n1) job.fn(job.k, job.a, job.lda, job.b, job.ldb, job.c, job.ldc, n0, n1, job.alpha, job.beta);
}

static void *helper(void *arg) {
    int id = (int)(long)arg;
    unsigned seen = spawn_gen; /* not job_gen: the product it was started for may be posted already */
    for (;;) {
        unsigned gen = seen;
        for (int i = 0; i < SPIN_CHECKS && (gen = atomic_load(&job_gen)) == seen; i++) RELAX();
        if (gen == seen) {
            pthread_mutex_lock(&pool_lock);
            atomic_fetch_add(&sleepers, 1);
            while ((gen = atomic_load(&job_gen)) == seen) pthread_cond_wait(&pool_wake, &pool_lock);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&pool_lock);
        }
        seen = gen;
        if (id < job.parts) run_part(id);
        atomic_fetch_sub(&job_pending, 1);
    }
    return NULL;
}

static void pool_reset_in_child(void) { /* a forked child has none of its parent's helpers */
    helpers = 0;
    atomic_store(&pool_busy, 0);
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_wake, NULL);
}

static int start_helpers(int wanted) {
    spawn_gen = atomic_load(&job_gen);
    while (helpers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, helper, (void *)(long)(helpers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        helpers++;
    }
    return helpers;
}

static void split(range_fn fn, int n, int k, const float *a, int lda, const float *b, int ldb, float *c, int ldc,
                  float alpha, float beta) {
    int threads = blas_threads ? blas_threads() : 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n / SPLIT_ALIGN) threads = n / SPLIT_ALIGN;
    int free = 0;
    if (threads <= 1 || (long)n * k < SPLIT_MIN || !atomic_compare_exchange_strong(&pool_busy, &free, 1)) {
        fn(k, a, lda, b, ldb, c, ldc, 0, n, alpha, beta);
        return;
    }
    int started = start_helpers(threads - 1); /* more may run from an earlier, larger count */
    if (started < threads - 1) threads = 1 + started;
    job.fn = fn, job.k = k, job.a = a, job.lda = lda, job.b = b, job.ldb = ldb, job.c = c, job.ldc = ldc;
    job.n = n, job.parts = threads, job.alpha = alpha, job.beta = beta;
    atomic_store(&job_pending, helpers);
    atomic_fetch_add(&job_gen, 1); /* seq_cst: a helper about to sleep sees it, or is seen below */
    if (atomic_load(&sleepers)) {
        pthread_mutex_lock(&pool_lock);
        pthread_cond_broadcast(&pool_wake);
        pthread_mutex_unlock(&pool_lock);
    }
    run_part(0);
    for (long spins = 0; atomic_load(&job_pending) > 0; spins++) {
        if (spins < 100000) RELAX();
        else sched_yield(); /* a helper lost its core */
    }
    atomic_store(&pool_busy, 0);
}

/* The best kernel this CPU runs, from its own answer (cpuid, with the OS's saved state
 * checked, as OpenBLAS asks it): /proc/cpuinfo can differ, under an emulator for one. */
static int cpu_isa(void) {
#if HAVE_KERNELS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
    return ISA_NONE;
}

/* Hands over OpenBLAS's functions; `most` caps the kernel (ISA_NONE: sgemv for one row only).
 * Returns the kernel in use. */
int specslot_rows_set(sgemm_fn gemm, sgemv_fn gemv, threads_fn threads, int most) {
    real_sgemm = gemm;
    real_sgemv = gemv;
    blas_threads = threads;
    int best = cpu_isa();
    isa = most < ISA_NONE ? ISA_NONE : most < best ? most : best;
    static int registered;
    if (!registered++) pthread_atfork(NULL, NULL, pool_reset_in_child);
    return isa;
}

long specslot_rows_sent(void) { return __atomic_load_n(&sent_sgemv, __ATOMIC_RELAXED); }

long specslot_rows_kernel(void) { return __atomic_load_n(&sent_kernel, __ATOMIC_RELAXED); }

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
#if HAVE_KERNELS
    if (isa != ISA_NONE && order == ROW_MAJOR && trans_a == NO_TRANS && m >= 1 && m <= MAX_ROWS && n > 0 &&
        k > 0) {
        split(ranges[isa][trans_b == TRANS ? 0 : 1][m], n, k, a, lda, b, ldb, c, ldc, alpha, beta);
        __atomic_add_fetch(&sent_kernel, 1, __ATOMIC_RELAXED);
        return;
    }
#endif
    if (order == ROW_MAJOR && m == 1 && n > 0 && k > 0 && real_sgemv) {
        /* the row of A: k values, one apart (A is 1 x k) or lda apart (A^T is k x 1) */
        int inc_x = trans_a == TRANS ? lda : 1;
        if (beta == 0.0f) {
            memset(c, 0, (size_t)n * sizeof(float)); /* sgemv would scale what is there */
        }
        if (trans_b == TRANS) { /* B is n x k: c = B a */
            real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_x, beta, c, 1);
        } else { /* B is k x n: c = B^T a */
            real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_x, beta, c, 1);
        }
        __atomic_add_fetch(&sent_sgemv, 1, __ATOMIC_RELAXED);
        return;
    }
    if (!real_sgemm) { /* _blas.py hands the functions over at load; a clear stop, not a crash */
        fputs("specslot: sgemm_rows: OpenBLAS's cblas_sgemm was never handed over\n", stderr);
        abort();
    }
    real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
