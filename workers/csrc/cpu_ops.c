/* The elementwise work of a decoder layer on the CPU, fused: each kernel reads its input once and
 * writes its output once, where torch's eager ops would make a pass (and a fresh tensor) per
 * operation. The formulas are the ones of workers/model.py's torch path, operation for operation;
 * only the order of the float32 sums in the norm differs (16 partial sums, then a tree).
 *
 * Every kernel runs its rows in parallel with OpenMP (torch's runtime: torch.set_num_threads
 * governs it) when there are enough of them to pay for waking the threads.
 */
#include "simd.h"

#define PARALLEL_MIN 8192        /* elements below which a kernel stays on the calling thread */
#define MAX_HEAD_DIM 512

/* RMSNorm in torch's order: out[t] = (x[t] * rsqrt(mean(x[t]^2) + eps)) * w. With `residual`
 * (may be NULL), x[t] is first added into it (residual[t] += x[t], the residual stream) and the norm
 * is of that sum. x, residual, out [T, N] contiguous; w [N]. */
void pdlab_rms_norm_f32(const float *x, float *residual, const float *w, float *out, int64_t T, int64_t N,
                        float eps) {
    const int64_t nv = N / L * L;
#pragma omp parallel for schedule(static) if (T * N >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * N;
        float *rt = residual ? residual + t * N : NULL, *ot = out + t * N;
        vf acc = splat(0.0f);
        float tail = 0.0f;
        if (rt) {
            for (int64_t i = 0; i < nv; i += L) {
                const vf v = load(rt + i) + load(xt + i);
                store(rt + i, v);
                acc += v * v;
            }
            for (int64_t i = nv; i < N; i++) { rt[i] += xt[i]; tail += rt[i] * rt[i]; }
        } else {
            for (int64_t i = 0; i < nv; i += L) { const vf v = load(xt + i); acc += v * v; }
            for (int64_t i = nv; i < N; i++) tail += xt[i] * xt[i];
        }
        const float r = 1.0f / sqrtf((hsum(acc) + tail) / (float)N + eps);
        const float *src = rt ? rt : xt;
        for (int64_t i = 0; i < nv; i += L) store(ot + i, (load(src + i) * r) * load(w + i));
        for (int64_t i = nv; i < N; i++) ot[i] = (src[i] * r) * w[i];
    }
}

static inline vf silu(vf x) { return x / (1.0f + vexp(-x)); }

/* out[t] = silu(gate[t]) * up[t], where gate_up[t] = [gate[t] | up[t]] (the fused projection's
 * output): gate_up [T, 2F], out [T, F], contiguous. */
void pdlab_silu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t F) {
    const int64_t nv = F / L * L;
#pragma omp parallel for schedule(static) if (T * F >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * F, *u = g + F;
        float *o = out + t * F;
        for (int64_t i = 0; i < nv; i += L) store(o + i, silu(load(g + i)) * load(u + i));
        for (int64_t i = nv; i < F; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotary embedding of the queries and keys of a step, in place, and the keys and values written to
 * their slots of one layer's pools. qkv [T, (H + 2 KVH) * D] contiguous: each row H query heads, KVH
 * key heads, KVH value heads. cos, signed_sin [T, D] (workers/model.py's tables at the tokens'
 * positions): x <- x * cos + roll(x, D/2) * signed_sin. k_cache, v_cache: the layer's pools, slot
 * s at element s * KVH * D. Returns -1 if D is odd or above MAX_HEAD_DIM. */
int pdlab_rope_store_kv_f32(float *qkv, int64_t T, int H, int KVH, int D, const float *cos,
                            const float *signed_sin, const int64_t *slots, float *k_cache, float *v_cache) {
    if (D % 2 || D > MAX_HEAD_DIM) return -1;
    const int half = D / 2, width = (H + 2 * KVH) * D;
#pragma omp parallel for schedule(static) if (T * width >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * width, tmp[MAX_HEAD_DIM];
        const float *c = cos + t * D, *s = signed_sin + t * D;
        for (int h = 0; h < H + KVH; h++) {
            float *x = row + h * D;
            memcpy(tmp, x, sizeof(float) * D);
            for (int i = 0; i < half; i++) x[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
            for (int i = half; i < D; i++) x[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
        }
        const int64_t at = slots[t] * KVH * D;
        memcpy(k_cache + at, row + H * D, sizeof(float) * KVH * D);
        memcpy(v_cache + at, row + (H + KVH) * D, sizeof(float) * KVH * D);
    }
    return 0;
}

/* A linear layer for the few rows of a decode step: out[M, N] = x[M, K] @ W^T, W [N, K], from W packed
 * (workers/cpu_kernels.py pack_linear's layout) into panels of NR output columns, each panel [K][NR] contiguous. A
 * panel streams through once per MR rows of x: each k loads NR weights (NR / L vectors) and
 * multiplies them into MR x NR accumulators held in registers with x[m, k] broadcast, so the
 * weights, the bulk of the bytes at these row counts, are read in order at the memory's pace. The
 * sums over k run in order k = 0..K-1 per output, in float32. Panels run in parallel (OpenMP).
 * Measured here against oneDNN's packed linear at the 29m shape's layers: 0.67x its time at 16
 * rows, 0.87x at 64, 0.97x at 255. */
#define NR 64            /* output columns per panel: 4 vectors */
#define MR 6             /* rows of x per pass over a panel: 24 accumulators in registers */
#define PF 16            /* panel rows prefetched ahead */

/* Rows [0, mr) of x (contiguous, K columns) times one panel, into out's first nc columns (row stride ldo).
 * The panel's rows are prefetched PF ahead: the hardware prefetcher alone left the stream waiting
 * on memory while the multiply-adds ran (measured: 1.3x slower at 16 rows). */
static inline __attribute__((always_inline)) void linear_tile(int mr, const float *x, int64_t K,
                                                             const float *panel, float *out, int64_t ldo,
                                                             int nc) {
    vf acc[MR][NR / L];
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < NR / L; c++) acc[i][c] = splat(0.0f);
    for (int64_t k = 0; k < K; k++) {
        vf w[NR / L];
        for (int c = 0; c < NR / L; c++) __builtin_prefetch(panel + (k + PF) * NR + c * L);
        for (int c = 0; c < NR / L; c++) w[c] = load(panel + k * NR + c * L);
        for (int i = 0; i < mr; i++) {
            const float xv = x[i * K + k];
            for (int c = 0; c < NR / L; c++) acc[i][c] += xv * w[c];
        }
    }
    for (int i = 0; i < mr; i++) {
        if (nc == NR) {
            for (int c = 0; c < NR / L; c++) store(out + i * ldo + c * L, acc[i][c]);
        } else {                               /* the last panel: only its real columns */
            float tmp[NR];
            for (int c = 0; c < NR / L; c++) store(tmp + c * L, acc[i][c]);
            memcpy(out + i * ldo, tmp, sizeof(float) * nc);
        }
    }
}

int64_t pdlab_linear_panel_width(void) { return NR; }

void pdlab_linear_small_f32(const float *x, int64_t M, int64_t K, const float *packed, int64_t N, float *out) {
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) if (panels > 1 && M * N * K >= 1 << 18)
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = packed + p * K * NR;
        const int nc = N - p * NR < NR ? (int)(N - p * NR) : NR;
        for (int64_t m = 0; m < M; m += MR) {
            const float *xm = x + m * K;
            float *om = out + m * N + p * NR;
            switch (M - m < MR ? (int)(M - m) : MR) {     /* MR == 6 */
                case 1: linear_tile(1, xm, K, panel, om, N, nc); break;
                case 2: linear_tile(2, xm, K, panel, om, N, nc); break;
                case 3: linear_tile(3, xm, K, panel, om, N, nc); break;
                case 4: linear_tile(4, xm, K, panel, om, N, nc); break;
                case 5: linear_tile(5, xm, K, panel, om, N, nc); break;
                default: linear_tile(MR, xm, K, panel, om, N, nc);
            }
        }
    }
}
