/* Paged attention on the CPU: every query of a step, decode and prefill alike, reads its keys and
 * values in place from the paged KV pool through its sequence's block table (no gathered copy).
 *
 * One call covers the whole step (varlen): sequence s owns queries [q_start[s], q_start[s+1]) and
 * keys at positions [0, ctx_len[s]); its last query sits at position ctx_len[s] - 1, and each query
 * attends causally to the keys up to its own position. Grouped-query attention: the G = H / KVH
 * query heads of one KV head are processed together, so each key and value row is read once per
 * query tile, not once per head.
 *
 * Work item = (sequence, KV head, tile of queries), run in parallel with OpenMP (the runtime torch
 * itself uses, so torch.set_num_threads governs it). A prompt chunk's tile visits its keys in chunks
 * with an online softmax, flash-attention style: a running max and sum per query row, the output
 * accumulated in float32 and divided once at the end; a single query row per head (a decode) takes
 * its whole context in passes instead. Head sizes 32, 64 and 128 have specialised copies whose
 * accumulators stay in registers; any other size runs a plain generic tile.
 *
 * Layouts (float32):
 *   q     [T, H, D], token stride q_stride (elements), head stride D   out [T, H, D], contiguous
 *   k, v  [num_blocks, BS, KVH, D], contiguous         block_tables [S, *], row stride table_stride
 */
#include "simd.h"
#include <omp.h>

#define ROWS 64          /* query rows (queries x heads of a group) per work item, at most */
#define PROWS 128        /* the same for the prefill tile of a head size it is specialised for */
#define MAX_D 256
#define KC (4 * L)       /* keys per chunk of the prefill tile */

typedef struct {
    const float *q, *k, *v;
    float *out;
    int64_t q_stride;
    int H, KVH, BS;
    float scale;
} Args;

/* A tile's rows: row i * G + g is query first_q + i of head kvh * G + g, scaled; its running max,
 * sum and output accumulator start empty. */
static void start_rows(const Args *a, int D, int first_q, int num_q, int kvh, float *qs, float *acc, float *m,
                       float *l) {
    const int G = a->H / a->KVH;
    for (int i = 0; i < num_q; i++)
        for (int g = 0; g < G; g++) {
            const float *src = a->q + (int64_t)(first_q + i) * a->q_stride + (int64_t)(kvh * G + g) * D;
            for (int d = 0; d < D; d++) qs[(i * G + g) * D + d] = src[d] * a->scale;
        }
    for (int r = 0; r < num_q * G; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(acc, 0, sizeof(float) * (size_t)num_q * G * D);
}

/* Any head size (the specialised ones take prefill_d*): queries [first_q, first_q + num_q) of one
 * sequence (the first at position q_pos0), all G heads of KV head kvh, against keys 16 at a time
 * (one block's worth at most), transposed into kt so scores come from broadcast multiply-adds, with
 * an online softmax. Plain loops: the compiler vectorises what it can. */
static void tile_any(const Args *a, int D, const int32_t *table, int first_q, int num_q, int q_pos0, int kvh,
                     float *scratch) {
    const int G = a->H / a->KVH, R = num_q * G, BS = a->BS;
    const int64_t tok = (int64_t)a->KVH * D, blk = (int64_t)BS * a->KVH * D;
    float *qs = scratch, *acc = qs + ROWS * MAX_D, *kt = acc + ROWS * MAX_D;
    float m[ROWS], l[ROWS], s[ROWS * L];
    start_rows(a, D, first_q, num_q, kvh, qs, acc, m, l);
    const int last_pos = q_pos0 + num_q - 1;
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int key0 = 0; key0 <= last_pos; ) {
        const int b = key0 / BS, off = key0 % BS;
        int nk = BS - off < L ? BS - off : L;
        if (nk > last_pos - key0 + 1) nk = last_pos - key0 + 1;
        const float *kb = a->k + (int64_t)table[b] * blk + off * tok + (int64_t)kvh * D;
        const float *vb = a->v + (int64_t)table[b] * blk + off * tok + (int64_t)kvh * D;
        for (int d = 0; d < D; d++) {
            for (int j = 0; j < nk; j++) kt[d * L + j] = kb[j * tok + d];
            for (int j = nk; j < L; j++) kt[d * L + j] = 0.0f;
        }
        for (int r = 0; r < R; r++) {
            vf c = {0};
            for (int d = 0; d < D; d++) c += qs[r * D + d] * load(kt + d * L);
            store(s + r * L, c);
        }
        for (int r = 0; r < R; r++) {                       /* causal mask, online softmax */
            const int valid = q_pos0 + r / G - key0 + 1;
            vf x = load(s + r * L);
            x = sel(lane < (valid < nk ? valid : nk), x, splat(-INFINITY));
            const float hx = hmax(x), mx = hx > m[r] ? hx : m[r];
            if (mx == -INFINITY) { store(s + r * L, splat(0.0f)); continue; }
            const vf p = vexp(x - mx);
            const float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
            l[r] = l[r] * alpha + hsum(p);
            m[r] = mx;
            store(s + r * L, p);
            if (alpha != 1.0f)
                for (int d = 0; d < D; d++) acc[r * D + d] *= alpha;
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < nk; j++) {
                const float p = s[r * L + j], *vj = vb + j * tok;
                for (int d = 0; d < D; d++) acc[r * D + d] += p * vj[d];
            }
        key0 += nk;
    }
    for (int i = 0; i < num_q; i++)
        for (int g = 0; g < G; g++) {
            const int r = i * G + g;
            const float inv = 1.0f / l[r];
            float *dst = a->out + ((int64_t)(first_q + i) * a->H + kvh * G + g) * D;
            for (int d = 0; d < D; d++) dst[d] = acc[r * D + d] * inv;
        }
}

/* Many query rows (a prompt chunk): the rows of tile (first_q.., all G heads of kvh) against keys
 * KC at a time, flash-attention style. A chunk's keys, gathered through the block table, are
 * transposed once into kt [D, KC], so scores come from broadcast multiply-adds, 4 rows x KC keys
 * in 16 accumulators; the online softmax then rescales each row once per KC keys; the values are
 * accumulated RB rows at a time, each value vector loaded once for RB rows. DIM is a multiple of L. */
#define DEFINE_PREFILL(NAME, DIM)                                                                     \
static void NAME(const Args *a, const int32_t *table, int first_q, int num_q, int q_pos0, int kvh,    \
                 float *scratch) {                                                                    \
    enum { D = DIM, V = DIM / L, NV = KC / L, RB = 16 / V > 0 ? 16 / V : 1 };                         \
    const int G = a->H / a->KVH, R = num_q * G, BS = a->BS;                                           \
    const int64_t tok = (int64_t)a->KVH * D, blk = (int64_t)BS * a->KVH * D;                          \
    float *qs = scratch, *acc = qs + PROWS * MAX_D, *kt = acc + PROWS * MAX_D;                        \
    float m[PROWS], l[PROWS], s[PROWS * KC];                                                          \
    const float *vp[KC];                                                                              \
    start_rows(a, D, first_q, num_q, kvh, qs, acc, m, l);                                             \
    const int last_pos = q_pos0 + num_q - 1;                                                          \
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};                           \
    for (int key0 = 0; key0 <= last_pos; key0 += KC) {                                                \
        const int nk = last_pos - key0 + 1 < KC ? last_pos - key0 + 1 : KC;                           \
        const float *kp[KC];                                                                          \
        for (int j = 0; j < nk; j++) {                     /* the chunk's keys and values */         \
            const int key = key0 + j;                                                                 \
            const int64_t at = (int64_t)table[key / BS] * blk + (key % BS) * tok + (int64_t)kvh * D;  \
            kp[j] = a->k + at;                                                                        \
            vp[j] = a->v + at;                                                                        \
        }                                                                                             \
        for (int j0 = 0; j0 < KC; j0 += L)                 /* kt = K^T, 16 x 16 blocks at a time */  \
            for (int d0 = 0; d0 < D; d0 += L) {                                                       \
                vf blk16[L];                                                                          \
                for (int j = 0; j < L; j++) blk16[j] = j0 + j < nk ? load(kp[j0 + j] + d0) : splat(0.0f); \
                transpose16(blk16);                                                                   \
                for (int d = 0; d < L; d++) store(kt + (d0 + d) * KC + j0, blk16[d]);                 \
            }                                                                                         \
        int r = 0;                                                                                    \
        for (; r + 4 <= R; r += 4) {                       /* scores, 4 rows x KC keys */            \
            vf c[4][NV];                                                                              \
            for (int i = 0; i < 4; i++) for (int v = 0; v < NV; v++) c[i][v] = splat(0.0f);           \
            for (int d = 0; d < D; d++) {                                                             \
                vf kd[NV];                                                                            \
                for (int v = 0; v < NV; v++) kd[v] = load(kt + d * KC + v * L);                       \
                for (int i = 0; i < 4; i++) {                                                         \
                    const float qv = qs[(r + i) * D + d];                                             \
                    for (int v = 0; v < NV; v++) c[i][v] += qv * kd[v];                               \
                }                                                                                     \
            }                                                                                         \
            for (int i = 0; i < 4; i++) for (int v = 0; v < NV; v++) store(s + (r + i) * KC + v * L, c[i][v]); \
        }                                                                                             \
        for (; r < R; r++) {                                                                          \
            vf c[NV];                                                                                 \
            for (int v = 0; v < NV; v++) c[v] = splat(0.0f);                                          \
            for (int d = 0; d < D; d++)                                                               \
                for (int v = 0; v < NV; v++) c[v] += qs[r * D + d] * load(kt + d * KC + v * L);       \
            for (int v = 0; v < NV; v++) store(s + r * KC + v * L, c[v]);                             \
        }                                                                                             \
        for (int r = 0; r < R; r++) {                      /* causal mask, online softmax */        \
            const int valid = q_pos0 + r / G - key0 + 1, vis = valid < nk ? valid : nk;               \
            float *row = s + r * KC;                                                                  \
            if (vis <= 0) { memset(row, 0, sizeof(float) * KC); continue; }                          \
            vf x[NV], mv = splat(-INFINITY);                                                          \
            for (int v = 0; v < NV; v++) {                                                            \
                x[v] = sel(lane + v * L < vis, load(row + v * L), splat(-INFINITY));                  \
                mv = vmax(mv, x[v]);                                                                  \
            }                                                                                         \
            const float hx = hmax(mv), mx = hx > m[r] ? hx : m[r];                                    \
            vf sum = splat(0.0f);                                                                     \
            for (int v = 0; v < NV; v++) {                                                            \
                const vf p = vexp(x[v] - mx);                                                         \
                store(row + v * L, p);                                                                \
                sum += p;                                                                             \
            }                                                                                         \
            const float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);                           \
            l[r] = l[r] * alpha + hsum(sum);                                                          \
            m[r] = mx;                                                                                \
            if (alpha != 1.0f)                                                                        \
                for (int c = 0; c < V; c++) store(acc + r * D + c * L, load(acc + r * D + c * L) * alpha); \
        }                                                                                             \
        for (r = 0; r + RB <= R; r += RB) {                /* acc += p V, RB rows at a time */       \
            vf o[RB][V];                                                                              \
            for (int i = 0; i < RB; i++) for (int c = 0; c < V; c++) o[i][c] = load(acc + (r + i) * D + c * L); \
            for (int j = 0; j < nk; j++) {                                                            \
                vf vv[V];                                                                             \
                for (int c = 0; c < V; c++) vv[c] = load(vp[j] + c * L);                              \
                for (int i = 0; i < RB; i++) {                                                        \
                    const float p = s[(r + i) * KC + j];                                              \
                    for (int c = 0; c < V; c++) o[i][c] += p * vv[c];                                 \
                }                                                                                     \
            }                                                                                         \
            for (int i = 0; i < RB; i++) for (int c = 0; c < V; c++) store(acc + (r + i) * D + c * L, o[i][c]); \
        }                                                                                             \
        for (; r < R; r++) {                                                                          \
            vf o[V];                                                                                  \
            for (int c = 0; c < V; c++) o[c] = load(acc + r * D + c * L);                             \
            for (int j = 0; j < nk; j++) {                                                            \
                const float p = s[r * KC + j];                                                        \
                for (int c = 0; c < V; c++) o[c] += p * load(vp[j] + c * L);                          \
            }                                                                                         \
            for (int c = 0; c < V; c++) store(acc + r * D + c * L, o[c]);                             \
        }                                                                                             \
    }                                                                                                 \
    for (int i = 0; i < num_q; i++)                                                                   \
        for (int g = 0; g < G; g++) {                                                                 \
            const int r = i * G + g;                                                                  \
            const float inv = 1.0f / l[r];                                                            \
            float *dst = a->out + ((int64_t)(first_q + i) * a->H + kvh * G + g) * D;                  \
            for (int c = 0; c < V; c++) store(dst + c * L, load(acc + r * D + c * L) * inv);          \
        }                                                                                             \
}

DEFINE_PREFILL(prefill_d32, 32)
DEFINE_PREFILL(prefill_d64, 64)
DEFINE_PREFILL(prefill_d128, 128)

/* One query row per head (a decode, or a prompt chunk's single token): the heads of KV heads
 * [h0, h1) over the whole context, in passes rather than online. First every score into `scores`
 * [heads, ctx]; then each head's max, its exponentials and their sum over the whole row at once;
 * then the values, weighted. The online softmax of a tile would rescale the accumulators and take
 * an exponential of the running max for every 16 keys, which at one row per head costs as much as
 * the dot products themselves. Both passes walk the context a chunk of keys at a time (up to L,
 * within one block) with every KV head of the range inside the chunk: a chunk's rows are
 * contiguous in the pool, so the pass reads memory in order, and the next chunk (scattered in the
 * pool, where no hardware prefetcher sees it coming) is prefetched while this one is used. */
static inline void prefetch_rows(const float *p, int64_t n_floats) {
    for (int64_t i = 0; i < n_floats; i += L) __builtin_prefetch(p + i);
}

/* The chunk of keys from key0 (up to L of them, within one block) in one of a layer's pools: its
 * length, and in *rows where its first key's row starts (each row holds every KV head; rows tok
 * floats apart). The next chunk's rows are prefetched. */
static inline int chunk_at(const float *pool, const int32_t *table, int key0, int ctx, int BS, int64_t tok,
                           const float **rows) {
    const int64_t blk = (int64_t)BS * tok;
    const int off = key0 % BS;
    int nk = BS - off < L ? BS - off : L;
    if (nk > ctx - key0) nk = ctx - key0;
    *rows = pool + (int64_t)table[key0 / BS] * blk + off * tok;
    if (key0 + nk < ctx) {
        const int next = key0 + nk, noff = next % BS;
        prefetch_rows(pool + (int64_t)table[next / BS] * blk + noff * tok, (int64_t)(BS - noff < L ? BS - noff : L) * tok);
    }
    return nk;
}

#define DEFINE_DECODE(NAME, DIM)                                                                      \
static void NAME(const Args *a, int D_, const int32_t *table, int qi, int ctx, int h0, int h1,        \
                 float *scratch) {                                                                    \
    const int D = DIM ? DIM : D_;                                                                     \
    const int G = a->H / a->KVH, BS = a->BS, R = (h1 - h0) * G;                                       \
    const int64_t tok = (int64_t)a->KVH * D;                                                          \
    const int stride = (ctx + L - 1) / L * L;              /* a row of scores, padded to vectors */  \
    float *qs = scratch, *acc = qs + R * D, *scores = acc + R * D;                                    \
    for (int r = 0; r < R; r++) {                          /* row r: head h0 * G + r */              \
        const float *src = a->q + (int64_t)qi * a->q_stride + (int64_t)(h0 * G + r) * D;              \
        for (int d = 0; d < D; d++) { qs[r * D + d] = src[d] * a->scale; acc[r * D + d] = 0.0f; }     \
    }                                                                                                 \
    _Pragma("GCC unroll 1")                                                                           \
    for (int key0 = 0; key0 < ctx; ) {                     /* scores */                              \
        const float *kb;                                                                              \
        const int nk = chunk_at(a->k, table, key0, ctx, BS, tok, &kb);                                \
        for (int r = 0; r < R; r++) {                                                                 \
            const float *kh = kb + (int64_t)(h0 + r / G) * D;                                         \
            vf c[L];                                                                                  \
            if (DIM) {                                                                                \
                enum { V = (DIM ? DIM : L) / L };                                                     \
                vf qv[V];                                                                             \
                for (int cc = 0; cc < V; cc++) qv[cc] = load(qs + r * D + cc * L);                    \
                for (int j = 0; j < nk; j++) {                                                        \
                    vf c0 = qv[0] * load(kh + j * tok);                                               \
                    for (int cc = 1; cc < V; cc++) c0 += qv[cc] * load(kh + j * tok + cc * L);        \
                    c[j] = c0;                                                                        \
                }                                                                                     \
                for (int j = nk; j < L; j++) c[j] = splat(0.0f);                                      \
                const vf sc = sum16(c);                                                               \
                memcpy(scores + r * stride + key0, &sc, sizeof(float) * nk);                          \
            } else {                                                                                  \
                for (int j = 0; j < nk; j++) {                                                        \
                    float d0 = 0.0f;                                                                  \
                    for (int d = 0; d < D; d++) d0 += qs[r * D + d] * kh[j * tok + d];                \
                    scores[r * stride + key0 + j] = d0;                                               \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        key0 += nk;                                                                                   \
    }                                                                                                 \
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};                           \
    for (int r = 0; r < R; r++) {                          /* softmax of each head's row */          \
        float *row = scores + r * stride;                                                             \
        for (int j = ctx; j < stride; j++) row[j] = -INFINITY;                                        \
        vf mv = load(row);                                                                            \
        for (int j = L; j < stride; j += L) mv = vmax(mv, load(row + j));                             \
        const vf mx = splat(hmax(mv));                                                                \
        vf sum = splat(0.0f);                                                                         \
        for (int j = 0; j < stride; j += L) {                                                         \
            const vf p = vexp(load(row + j) - mx);                                                    \
            store(row + j, sel(lane + j < ctx, p, splat(0.0f)));                                      \
            sum += p;                                                                                 \
        }                                                                                             \
        qs[r] = 1.0f / hsum(sum);                          /* (the queries are done with) */         \
    }                                                                                                 \
    _Pragma("GCC unroll 1")                                                                           \
    for (int key0 = 0; key0 < ctx; ) {                     /* the weighted values */                 \
        const float *vb;                                                                              \
        const int nk = chunk_at(a->v, table, key0, ctx, BS, tok, &vb);                                \
        for (int r = 0; r < R; r++) {                                                                 \
            const float *vh = vb + (int64_t)(h0 + r / G) * D, *p = scores + r * stride + key0;        \
            float *o = acc + r * D;                                                                   \
            if (DIM) {                                                                                \
                enum { V = (DIM ? DIM : L) / L };                                                     \
                vf o0[V], o1[V];                           /* even and odd keys: two chains */       \
                for (int c = 0; c < V; c++) { o0[c] = load(o + c * L); o1[c] = splat(0.0f); }         \
                int j = 0;                                                                            \
                for (; j + 2 <= nk; j += 2)                                                           \
                    for (int c = 0; c < V; c++) {                                                     \
                        o0[c] += p[j] * load(vh + j * tok + c * L);                                   \
                        o1[c] += p[j + 1] * load(vh + (j + 1) * tok + c * L);                         \
                    }                                                                                 \
                for (; j < nk; j++)                                                                   \
                    for (int c = 0; c < V; c++) o0[c] += p[j] * load(vh + j * tok + c * L);           \
                for (int c = 0; c < V; c++) store(o + c * L, o0[c] + o1[c]);                          \
            } else {                                                                                  \
                for (int j = 0; j < nk; j++)                                                          \
                    for (int d = 0; d < D; d++) o[d] += p[j] * vh[j * tok + d];                       \
            }                                                                                         \
        }                                                                                             \
        key0 += nk;                                                                                   \
    }                                                                                                 \
    for (int r = 0; r < R; r++) {                                                                     \
        float *dst = a->out + ((int64_t)qi * a->H + h0 * G + r) * D;                                  \
        for (int d = 0; d < D; d++) dst[d] = acc[r * D + d] * qs[r];                                  \
    }                                                                                                 \
}

DEFINE_DECODE(decode_d32, 32)
DEFINE_DECODE(decode_d64, 64)
DEFINE_DECODE(decode_d128, 128)
DEFINE_DECODE(decode_any, 0)

/* Returns 0; -1 when the shapes are beyond this kernel (H not a multiple of KVH, more than ROWS
 * heads per KV head, D above MAX_D); -2 when scratch memory cannot be had. */
int pdlab_paged_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v, float *out,
                              const int32_t *block_tables, int table_stride, const int32_t *q_start,
                              const int32_t *ctx_len, int num_seqs, int H, int KVH, int D, int BS, float scale) {
    if (KVH <= 0 || H % KVH || H / KVH > ROWS || D <= 0 || D > MAX_D || BS <= 0) return -1;
    const Args a = {q, k, v, out, q_stride, H, KVH, BS, scale};
    const int G = H / KVH, special = D == 32 || D == 64 || D == 128;
    const int tile_q = (special ? PROWS : ROWS) / G;
    int num_decode = 0, max_single = 0;        /* one-row sequences, and the longest context one reads */
    for (int s = 0; s < num_seqs; s++)
        if (q_start[s + 1] - q_start[s] == 1) {
            num_decode++;
            if (ctx_len[s] > max_single) max_single = ctx_len[s];
        }
    /* A one-row sequence is one work item over all its KV heads (its chunks read in order), unless
     * there are too few of them to keep the threads busy: then one item per KV head. */
    const int split = num_decode < 2 * omp_get_max_threads();
    const size_t cap = ((size_t)q_start[num_seqs] / tile_q + num_seqs + 1) * KVH;
    int *item_seq = malloc(sizeof(int) * 3 * cap);
    if (!item_seq) return -2;
    int *item_first = item_seq + cap, *item_kvh = item_first + cap, num_items = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int n = q_start[s + 1] - q_start[s];
        for (int first = 0; first < n; first += tile_q)
            for (int kvh = 0; kvh < KVH; kvh++) {
                if (n == 1 && !split && kvh) break;
                item_seq[num_items] = s;
                item_first[num_items] = first;
                item_kvh[num_items++] = n == 1 && !split ? -1 : kvh;     /* -1: every KV head */
            }
    }
    const size_t tile_floats = 2 * PROWS * MAX_D + MAX_D * KC;
    const size_t score_floats = (size_t)H * (2 * D + (max_single + L - 1) / L * L);
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * (tile_floats > score_floats ? tile_floats : score_floats));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int w = 0; w < num_items; w++) {
            if (!scratch) continue;
            const int s = item_seq[w], kvh = item_kvh[w];
            const int num_q_seq = q_start[s + 1] - q_start[s], first = item_first[w];
            const int n = num_q_seq - first < tile_q ? num_q_seq - first : tile_q;
            const int32_t *table = block_tables + (int64_t)s * table_stride;
            const int qi = q_start[s] + first, q_pos0 = ctx_len[s] - num_q_seq + first;
            if (num_q_seq == 1) {
                const int h0 = kvh < 0 ? 0 : kvh, h1 = kvh < 0 ? KVH : kvh + 1;
                switch (D) {
                    case 32: decode_d32(&a, D, table, qi, ctx_len[s], h0, h1, scratch); break;
                    case 64: decode_d64(&a, D, table, qi, ctx_len[s], h0, h1, scratch); break;
                    case 128: decode_d128(&a, D, table, qi, ctx_len[s], h0, h1, scratch); break;
                    default: decode_any(&a, D, table, qi, ctx_len[s], h0, h1, scratch);
                }
                continue;
            }
            if (special)
                (D == 32 ? prefill_d32 : D == 64 ? prefill_d64 : prefill_d128)(&a, table, qi, n, q_pos0, kvh, scratch);
            else
                tile_any(&a, D, table, qi, n, q_pos0, kvh, scratch);
        }
        free(scratch);
    }
    free(item_seq);
    return failed ? -2 : 0;
}
