/* Vector helpers shared by the CPU kernels: 16 float32 lanes (one AVX-512 register, or two AVX2
 * ones) through GCC's vector extensions, so the same source builds for any x86 or Arm CPU. */
#ifndef PDLAB_SIMD_H
#define PDLAB_SIMD_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define L 16             /* float32 lanes per vector (the attention kernel scores L keys together) */

typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));

static inline vf load(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline void store(float *p, vf x) { memcpy(p, &x, sizeof x); }
static inline vf splat(float x) { return (vf){0} + x; }
/* horizontal reductions as shuffle trees: four steps, not fifteen */
#define SWAP8 ((vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7})
#define SWAP4 ((vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11})
#define SWAP2 ((vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13})
#define SWAP1 ((vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14})
static inline vf vmax(vf a, vf b) { return (vf)(((vi)a & (a > b)) | ((vi)b & ~(a > b))); }
static inline float hsum(vf x) {
    x += __builtin_shuffle(x, SWAP8);
    x += __builtin_shuffle(x, SWAP4);
    x += __builtin_shuffle(x, SWAP2);
    x += __builtin_shuffle(x, SWAP1);
    return x[0];
}
/* Sixteen vectors to one whose lane j is the sum of c[j]'s lanes: four levels of pairwise
 * shuffle-adds (15 of them, 3 operations a vector) instead of one horizontal sum per vector. */
#define PAIR(a, b, lo, hi) (__builtin_shuffle((a), (b), lo) + __builtin_shuffle((a), (b), hi))
static inline vf sum16(const vf *c) {
    const vi lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf a[8], b[4], d[2];
    for (int i = 0; i < 8; i++) a[i] = PAIR(c[2 * i], c[2 * i + 1], lo1, hi1);   /* 8 partials each of 2 */
    for (int i = 0; i < 4; i++) b[i] = PAIR(a[2 * i], a[2 * i + 1], lo2, hi2);   /* 4 partials each of 4 */
    for (int i = 0; i < 2; i++) d[i] = PAIR(b[2 * i], b[2 * i + 1], lo3, hi3);   /* 2 partials each of 8 */
    return PAIR(d[0], d[1], lo4, hi4);                                            /* one each of 16 */
}
static inline float hmax(vf x) {
    x = vmax(x, __builtin_shuffle(x, SWAP8));
    x = vmax(x, __builtin_shuffle(x, SWAP4));
    x = vmax(x, __builtin_shuffle(x, SWAP2));
    x = vmax(x, __builtin_shuffle(x, SWAP1));
    return x[0];
}

/* exp for the softmax, lane-parallel: exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln(2)/2,
 * exp(r) by a degree-6 polynomial (relative error about 2e-7, below the float32 rounding of the
 * sums it feeds). Lanes below -87 (masked keys, or far below the running max) give exactly 0. */
static inline vf sel(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static inline vf vexp(vf x) {
    const vi dead = x < -87.0f;
    x = sel(x < -87.0f, splat(-87.0f), x);
    x = sel(x > 88.0f, splat(88.0f), x);
    const vf t = x * 1.44269504088896341f;
    const vi ni = __builtin_convertvector(sel(t >= 0.0f, t + 0.5f, t - 0.5f), vi);   /* round half away */
    const vf n = __builtin_convertvector(ni, vf);
    const vf r = (x - n * 0.693359375f) + n * 2.12194440e-4f;       /* ln 2 in two parts */
    vf p = splat(1.3981999507e-3f);
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return sel(dead, splat(0.0f), p * (vf)((ni + 127) << 23));
}


/* A 16 x 16 block in registers, transposed in place: four rounds that swap off-diagonal blocks of
 * 8, 4, 2 and 1 lanes between rows i and i + b (16 two-source shuffles a round). */
static inline void transpose16(vf *r) {
    for (int b = 8; b >= 1; b /= 2) {
        vi lo, hi;
        for (int l = 0; l < L; l++) {
            lo[l] = (l & b) ? L + l - b : l;
            hi[l] = (l & b) ? L + l : l + b;
        }
        for (int i = 0; i < L; i++)
            if (!(i & b)) {
                const vf x = r[i], y = r[i + b];
                r[i] = __builtin_shuffle(x, y, lo);
                r[i + b] = __builtin_shuffle(x, y, hi);
            }
    }
}
#endif
