/*
 * The CPU backward of normgnorm's LayerNorm and RMSNorm (normgnorm/cpu_ext.py builds and calls
 * it): dx, each example's dγ_b and dβ_b, their sums dγ, dβ and the squared norms, in one pass
 * over x and dy, where the PyTorch path reads them three times. Plain C and OpenMP, no torch
 * headers: it compiles in a fraction of a second. float32, contiguous rows.
 *
 * For a row with x̂ = (x - mean) * rstd and g = dy ⊙ γ (Ba et al. 2016, "Layer Normalization"),
 *     dx = rstd * (g - mean_d(g) - x̂ * mean_d(g ⊙ x̂))
 * and RMSNorm's (mean NULL: x̂ = x * rstd, Zhang & Sennrich 2019) has no mean_d(g) term. Per
 * example (Gray et al. 2024), dγ_b = Σ_t dy_bt ⊙ x̂_bt and dβ_b = Σ_t dy_bt.
 */
#include <stdint.h>
#include <string.h>

/*
 * x, dy, dx: [B * T, D]; mean (NULL: RMSNorm), rstd: [B * T]; weight: [D].
 * Written: dx, dw_b [B, D], dw [D], and with db_b (NULL: no bias) db_b [B, D] and db [D].
 * Added to: *weight_sq += Σ_b ||dγ_b||², *bias_sq += Σ_b ||dβ_b||² (with db_b), *count += B.
 * The per-example gradients and their norms alone (the separated layers, whose dx, dγ, dβ are
 * torch's): dx, dw, db, weight and count NULL.
 * threads: the team size, taken as given (num_threads, not the OpenMP default, which is torch's
 * whole pool); cpu_ext.py passes min(torch's threads, B): each thread owns whole examples, so
 * threads past the B-th would idle.
 */
void normgnorm_cpu_backward(const float *x, const float *dy, const float *mean, const float *rstd,
                            const float *weight, int64_t B, int64_t T, int64_t D, float *dx,
                            float *dw_b, float *db_b, float *dw, float *db, float *weight_sq,
                            float *bias_sq, float *count, int threads) {
    /* examples are independent: each thread owns whole examples, so dγ_b, dβ_b need no atomics */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < B; b++) {
        float *dwr = dw_b + b * D, *dbr = db_b ? db_b + b * D : NULL;
        memset(dwr, 0, D * sizeof(float));
        if (dbr)
            memset(dbr, 0, D * sizeof(float));
        for (int64_t row = b * T; row < (b + 1) * T; row++) {
            const float *xr = x + row * D, *dyr = dy + row * D;
            const float m = mean ? mean[row] : 0.0f, r = rstd[row];
            if (dbr) {
                #pragma omp simd
                for (int64_t d = 0; d < D; d++)
                    dbr[d] += dyr[d];
            }
            if (!dx) {
                #pragma omp simd
                for (int64_t d = 0; d < D; d++)
                    dwr[d] += dyr[d] * ((xr[d] - m) * r);
                continue;
            }
            float sum_g = 0.0f, sum_gx = 0.0f;
            #pragma omp simd reduction(+:sum_g, sum_gx)
            for (int64_t d = 0; d < D; d++) {
                const float xhat = (xr[d] - m) * r, g = dyr[d] * weight[d];
                sum_g += g;
                sum_gx += g * xhat;
                dwr[d] += dyr[d] * xhat;
            }
            const float mean_g = mean ? sum_g / (float)D : 0.0f, mean_gx = sum_gx / (float)D;
            float *dxr = dx + row * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) {  /* the row is still in L1: x̂ and g again cost less than storing them */
                const float xhat = (xr[d] - m) * r;
                dxr[d] = r * (dyr[d] * weight[d] - mean_g - xhat * mean_gx);
            }
        }
    }
    /* the sums over examples and the squared norms, by feature (the squares accumulate in double) */
    double sq_w = 0.0, sq_b = 0.0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(+:sq_w, sq_b)
    for (int64_t d = 0; d < D; d++) {
        float sum_w = 0.0f, sum_b = 0.0f;
        for (int64_t b = 0; b < B; b++) {
            const float gw = dw_b[b * D + d];
            sum_w += gw;
            sq_w += (double)gw * gw;
            if (db_b) {
                const float gb = db_b[b * D + d];
                sum_b += gb;
                sq_b += (double)gb * gb;
            }
        }
        if (dw)
            dw[d] = sum_w;
        if (db)
            db[d] = sum_b;
    }
    if (weight_sq)  /* (a buffer not given is not added to, never a null write) */
        *weight_sq += (float)sq_w;
    if (db_b && bias_sq)
        *bias_sq += (float)sq_b;
    if (count)
        *count += (float)B;
}
