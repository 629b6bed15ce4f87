/* cblas_sgemm for MLX's CPU matmuls, with a one-row product sent to sgemv.
 *
 * MLX multiplies every float32 matrix through cblas_sgemm. OpenBLAS's sgemm packs the
 * weight matrix even when the product has a single row, so a decode step's products
 * cost about twice what its sgemv costs (models/platform/_blas.py, "one-row products").
 * Loaded globally before OpenBLAS's renamed copy, this definition is the one MLX binds;
 * every other product goes to OpenBLAS's cblas_sgemm unchanged. _blas.py hands the two
 * OpenBLAS functions over through specslot_rows_set before MLX is imported.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static long rows_sent;

void specslot_rows_set(sgemm_fn gemm, sgemv_fn gemv) {
    real_sgemm = gemm;
    real_sgemv = gemv;
}

long specslot_rows_sent(void) { return __atomic_load_n(&rows_sent, __ATOMIC_RELAXED); }

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
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
        __atomic_add_fetch(&rows_sent, 1, __ATOMIC_RELAXED);
        return;
    }
    if (!real_sgemm) { /* _blas.py hands the functions over at load; a clear stop, not a crash */
        fputs("specslot: sgemm_rows: OpenBLAS's cblas_sgemm was never handed over\n", stderr);
        abort();
    }
    real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
