/* Attention over a paged KV cache, read in place (CPU, float32 arithmetic).
 *
 * The torch path gathers each sequence's blocks into a padded buffer and runs SDPA on it;
 * this reads the keys and values straight from their blocks, so nothing is copied, nothing is
 * padded and no mask is built. runtime/engine/kernels.py compiles it with the machine's C
 * compiler and calls it through ctypes (which releases the GIL for the call). OpenMP is the
 * one torch already loaded (libgomp.so.1 from torch/lib), so the kernel's threads are torch's.
 *
 * Two entry points: paged_attention_f32 for decodes (one row per sequence, any sequences) and
 * paged_prefill_attention_f32 for a prefill chunk (consecutive positions of one sequence,
 * causal, its own keys and values already stored; its tiles are multiplied as small matrices
 * by attend_tile where the vector code runs). Layouts (all contiguous):
 *   q, out        [rows, num_heads, head_dim]
 *   k/v_cache     [num_blocks, block_size, kv_heads, head_dim]
 *   block_tables  [rows, max_blocks] int32: row r's keys live in blocks block_tables[r][0..]
 *                 (prefill: one table for every row)
 *   context_lens  [rows] int32: row r attends to key positions [0, context_lens[r])
 *                 (prefill: row i to [0, start + i])
 * `window` > 0 keeps only the last `window` of those positions (sliding-window attention).
 * Query heads h * group .. h * group + group - 1 share kv head h (grouped-query attention).
 *
 * The caches hold float32, or bf16 when `kv_bf16` is set (half the bytes to stream per token;
 * a bf16 is the top half of a float32, so it widens exactly with a shift). Positions in a
 * cache are counted in elements, whichever their type.
 *
 * Numerics: scores and the weighted sum in float32, softmax with the row maximum subtracted,
 * as SDPA does; only the summation order differs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

/* Element `index` of a cache, as float32. Every caller is inlined into a copy of attend_rows
 * for each element type, so the branch is resolved at compile time. */
static inline float load1(const void *cache, int64_t index, int bf16) {
    if (bf16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)cache)[index] << 16;
        float value;
        memcpy(&value, &bits, sizeof value);
        return value;
    }
    return ((const float *)cache)[index];
}

static inline float dot(const float *query, const void *keys, int64_t start, int64_t n,
                        int bf16) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += query[i] * load1(keys, start + i, bf16);
    return sum;
}

/* The vector paths: one definition of the dot products and the weighted sum, over 512-bit
 * registers where the CPU has AVX-512 (half the instructions per element, and with a bf16
 * cache half the widening too) and 256-bit ones with AVX2 alone.
 * A head_dim that is not a multiple of the width takes the portable loops below. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define HAVE_VECTOR_DOTS 1
#if defined(__AVX512F__)
#define VLEN 16
typedef __m512 vec;
#define vec_zero _mm512_setzero_ps
#define vec_set1 _mm512_set1_ps
#define vec_loadu _mm512_loadu_ps
#define vec_storeu _mm512_storeu_ps
#define vec_fmadd _mm512_fmadd_ps
#define vec_mul _mm512_mul_ps
/* Elements [index, index + 16) of a cache, as float32. */
static inline vec load_vec(const void *cache, int64_t index, int bf16) {
    if (bf16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)cache + index);
}
/* The two halves of x added: 8 partial sums, for the 256-bit reduction tree. */
static inline __m256 fold256(vec x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}
#else
#define VLEN 8
typedef __m256 vec;
#define vec_zero _mm256_setzero_ps
#define vec_set1 _mm256_set1_ps
#define vec_loadu _mm256_loadu_ps
#define vec_storeu _mm256_storeu_ps
#define vec_fmadd _mm256_fmadd_ps
#define vec_mul _mm256_mul_ps
/* Elements [index, index + 8) of a cache, as float32. */
static inline vec load_vec(const void *cache, int64_t index, int bf16) {
    if (bf16) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)cache + index));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
    return _mm256_loadu_ps((const float *)cache + index);
}
static inline __m256 fold256(vec x) { return x; }
#endif

/* scores[j] = query . keys[start + j * stride ...], j < COUNT, head_dim a multiple of VLEN:
 * eight dot products reduced together (one horizontal add tree) instead of one at a time.
 * COUNT is a constant so that the accumulators stay in registers: 8 for whole groups, 1 for
 * a tail. */
#define DEFINE_DOTS(COUNT)                                                                    \
    static inline void dots_##COUNT(const float *query, const void *keys, int64_t start,    \
                                    int64_t stride, int64_t head_dim, float scale,           \
                                    float *scores, int bf16) {                               \
        vec acc[8];                                                                          \
        for (int j = 0; j < 8; j++) acc[j] = vec_zero();                                     \
        for (int64_t i = 0; i < head_dim; i += VLEN) {                                       \
            const vec q = vec_loadu(query + i);                                              \
            for (int j = 0; j < COUNT; j++)                                                  \
                acc[j] = vec_fmadd(q, load_vec(keys, start + j * stride + i, bf16), acc[j]); \
        }                                                                                    \
        const __m256 s01 = _mm256_hadd_ps(fold256(acc[0]), fold256(acc[1]));                 \
        const __m256 s23 = _mm256_hadd_ps(fold256(acc[2]), fold256(acc[3]));                 \
        const __m256 s45 = _mm256_hadd_ps(fold256(acc[4]), fold256(acc[5]));                 \
        const __m256 s67 = _mm256_hadd_ps(fold256(acc[6]), fold256(acc[7]));                 \
        const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);     \
        const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),        \
                                          _mm256_permute2f128_ps(s0123, s4567, 0x31));       \
        const __m256 scaled = _mm256_mul_ps(sums, _mm256_set1_ps(scale));                    \
        if (COUNT == 8) {                                                                    \
            _mm256_storeu_ps(scores, scaled);                                                \
        } else {                                                                             \
            float all[8];                                                                    \
            _mm256_storeu_ps(all, scaled);                                                   \
            for (int j = 0; j < COUNT; j++) scores[j] = all[j];                              \
        }                                                                                    \
    }
DEFINE_DOTS(8)
DEFINE_DOTS(1)

/* Scores of `count` keys from element `start` on, `stride` apart: eight at a time, then one
 * at a time. */
static inline void block_dots(const float *query, const void *keys, int64_t start,
                              int64_t stride, int64_t count, int64_t head_dim, float scale,
                              float *scores, int bf16) {
    int64_t t = 0;
    for (; t + 8 <= count; t += 8)
        dots_8(query, keys, start + t * stride, stride, head_dim, scale, scores + t, bf16);
    for (; t < count; t++)
        dots_1(query, keys, start + t * stride, stride, head_dim, scale, scores + t, bf16);
}

/* out[0 .. VLEN * VECTORS) += sum over t < count of weights[t] * values[start + t * stride ...]:
 * the sums stay in registers across a block's tokens, so `out` is loaded and stored once a
 * block instead of once a token (which made the weighted sum load/store bound). */
#define DEFINE_WEIGHTED_SUM(NAME, VECTORS)                                                    \
    static inline void NAME(float *out, const float *weights, const void *values,           \
                            int64_t start, int64_t stride, int64_t count, int bf16) {        \
        vec acc[VECTORS];                                                                    \
        for (int j = 0; j < VECTORS; j++) acc[j] = vec_loadu(out + VLEN * j);                \
        for (int64_t t = 0; t < count; t++) {                                                \
            const vec weight = vec_set1(weights[t]);                                         \
            const int64_t row = start + t * stride;                                          \
            for (int j = 0; j < VECTORS; j++)                                                \
                acc[j] = vec_fmadd(weight, load_vec(values, row + VLEN * j, bf16), acc[j]);  \
        }                                                                                    \
        for (int j = 0; j < VECTORS; j++) vec_storeu(out + VLEN * j, acc[j]);                \
    }
DEFINE_WEIGHTED_SUM(weighted_sum_64, 64 / VLEN)
DEFINE_WEIGHTED_SUM(weighted_sum_1, 1)

/* The same over a head of head_dim floats (a multiple of VLEN): 64 at a time, then VLEN at a
 * time. */
static inline void weighted_sum(float *out, const float *weights, const void *values,
                                int64_t start, int64_t stride, int64_t count, int64_t head_dim,
                                int bf16) {
    int64_t i = 0;
    for (; i + 64 <= head_dim; i += 64)
        weighted_sum_64(out + i, weights, values, start + i, stride, count, bf16);
    for (; i < head_dim; i += VLEN)
        weighted_sum_1(out + i, weights, values, start + i, stride, count, bf16);
}
#endif

/* y += a * values[start ...] over n elements. */
static inline void axpy(float *y, float a, const void *values, int64_t start, int64_t n,
                        int bf16) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * load1(values, start + i, bf16);
}

/* Blocks read ahead of the one being computed: a block's arithmetic is short next to the
 * latency of fetching the next one from memory. */
#define PREFETCH_BLOCKS 2

/* Asks for part `part` of `parts` of a block's cache lines. A block's prefetches are spread
 * over the work on the block before it, a slice before each head's dot products or weighted
 * sum, rather than issued at once: 256-512 prefetches in a row filled the core's queue of
 * outstanding misses, and the arithmetic then waited for it. */
static inline void prefetch_part(const void *cache, int32_t block, int64_t block_bytes,
                                 int64_t part, int64_t parts) {
    const char *base = (const char *)cache + (int64_t)block * block_bytes;
    const int64_t lines = block_bytes / 64;
    for (int64_t line = part * lines / parts; line < (part + 1) * lines / parts; line++)
        __builtin_prefetch(base + line * 64);
}

/* Rows of one sequence, attended together: row r (r < nrows) is query[r] ([num_heads,
 * head_dim]) over key positions [first[r], len[r]) of the same block table. A decode is one
 * row; a prefill chunk comes in tiles of PREFILL_TILE consecutive positions (here where the
 * head_dim fits no vector: attend_tile below takes the rest), so that each block of keys and
 * values is read from memory once for the tile instead of once per row (row-at-a-time prefill
 * re-read the whole context for every token and lost to SDPA from ~1,000 tokens of context).
 * A block at a time: keys and values of a block are [block_size,
 * kv_heads, head_dim], contiguous, so every read is sequential; blocks ahead are prefetched
 * while this one is computed, since their addresses (block-table lookups) are jumps the
 * hardware prefetcher cannot guess. Softmax is the online kind: a running maximum per row and
 * head, the sums rescaled when it grows. Always inlined, so each element type (`bf16` a
 * constant at the call) gets its own copy without branches. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *query, const void *k_cache, const void *v_cache, const int32_t *table,
    const int64_t *first, const int64_t *len, int64_t nrows, int64_t num_heads,
    int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out,
    float *scores /* [nrows * num_heads * block_size] */,
    float *maxima, float *sums /* [nrows * num_heads] each */, const int bf16) {
    const int64_t group = num_heads / kv_heads;
    const int64_t token_stride = kv_heads * head_dim;
    const int64_t block_elements = block_size * token_stride;
    const int64_t block_bytes = block_elements * (bf16 ? 2 : 4);
    const int64_t row_size = num_heads * head_dim;
    int64_t lowest = first[0], highest = len[0];
    for (int64_t r = 0; r < nrows; r++) {
        lowest = first[r] < lowest ? first[r] : lowest;
        highest = len[r] > highest ? len[r] : highest;
    }
    for (int64_t i = 0; i < nrows * row_size; i++) out[i] = 0.0f;
    for (int64_t i = 0; i < nrows * num_heads; i++) {
        maxima[i] = -INFINITY;
        sums[i] = 0.0f;
    }
    const int64_t first_block = lowest / block_size, last_block = (highest - 1) / block_size;
    for (int64_t b = first_block; b < first_block + PREFETCH_BLOCKS && b <= last_block; b++) {
        prefetch_part(k_cache, table[b], block_bytes, 0, 1);
        prefetch_part(v_cache, table[b], block_bytes, 0, 1);
    }
    for (int64_t b = first_block; b <= last_block; b++) {
        const int64_t block_start = (int64_t)table[b] * block_elements;  /* in K and in V */
        const int64_t block_first = b * block_size;
        /* The first row with keys in this block asks for the blocks ahead, spread over its
         * heads; the others find this block in cache. */
        int ahead = b + PREFETCH_BLOCKS <= last_block;
        const int32_t next = ahead ? table[b + PREFETCH_BLOCKS] : 0;
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t from = first[r] > block_first ? first[r] : block_first;
            const int64_t to = len[r] < block_first + block_size ? len[r] : block_first + block_size;
            if (to <= from) continue;
            const int64_t lo = from - block_first, count = to - from;
            const float *q_row = query + r * row_size;
            float *out_row = out + r * row_size;
            float *row_scores = scores + r * num_heads * block_size;
            float *row_maxima = maxima + r * num_heads, *row_sums = sums + r * num_heads;
            for (int64_t h = 0; h < num_heads; h++) {
                if (ahead) prefetch_part(k_cache, next, block_bytes, h, num_heads);
                const int64_t keys = block_start + lo * token_stride + (h / group) * head_dim;
                float *s = row_scores + h * block_size + lo;
#ifdef HAVE_VECTOR_DOTS
                if (head_dim % VLEN == 0) {
                    block_dots(q_row + h * head_dim, k_cache, keys, token_stride, count, head_dim,
                               scale, s, bf16);
                    continue;
                }
#endif
                for (int64_t t = 0; t < count; t++)
                    s[t] = dot(q_row + h * head_dim, k_cache, keys + t * token_stride, head_dim,
                               bf16) * scale;
            }
            for (int64_t h = 0; h < num_heads; h++) {
                float *s = row_scores + h * block_size + lo;
                float peak = row_maxima[h];
                for (int64_t t = 0; t < count; t++) peak = s[t] > peak ? s[t] : peak;
                if (peak > row_maxima[h]) {
                    const float shrink = expf(row_maxima[h] - peak);  /* 0 on the first block */
                    row_sums[h] *= shrink;
                    float *o = out_row + h * head_dim;
#pragma omp simd
                    for (int64_t i = 0; i < head_dim; i++) o[i] *= shrink;
                    row_maxima[h] = peak;
                }
                float total = 0.0f;
#pragma omp simd reduction(+ : total)
                for (int64_t t = 0; t < count; t++) {
                    s[t] = expf(s[t] - peak);
                    total += s[t];
                }
                row_sums[h] += total;
            }
            for (int64_t h = 0; h < num_heads; h++) {
                if (ahead) prefetch_part(v_cache, next, block_bytes, h, num_heads);
                const int64_t values = block_start + lo * token_stride + (h / group) * head_dim;
                const float *weights = row_scores + h * block_size + lo;
                float *o = out_row + h * head_dim;
#ifdef HAVE_VECTOR_DOTS
                if (head_dim % VLEN == 0) {
                    weighted_sum(o, weights, v_cache, values, token_stride, count, head_dim, bf16);
                    continue;
                }
#endif
                for (int64_t t = 0; t < count; t++)
                    axpy(o, weights[t], v_cache, values + t * token_stride, head_dim, bf16);
            }
            ahead = 0;
        }
    }
    for (int64_t i = 0; i < nrows * num_heads; i++) {
        const float inverse = 1.0f / sums[i];
        float *o = out + i * head_dim;
#pragma omp simd
        for (int64_t j = 0; j < head_dim; j++) o[j] *= inverse;
    }
}

/* One of the two element types, chosen once per call. */
static inline void attend(const float *query, const void *k_cache, const void *v_cache,
                          const int32_t *table, const int64_t *first, const int64_t *len,
                          int64_t nrows, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                          int64_t block_size, float scale, float *out, float *scratch,
                          int kv_bf16) {
    float *maxima = scratch + nrows * num_heads * block_size, *sums = maxima + nrows * num_heads;
    if (kv_bf16)
        attend_rows(query, k_cache, v_cache, table, first, len, nrows, num_heads, kv_heads,
                    head_dim, block_size, scale, out, scratch, maxima, sums, 1);
    else
        attend_rows(query, k_cache, v_cache, table, first, len, nrows, num_heads, kv_heads,
                    head_dim, block_size, scale, out, scratch, maxima, sums, 0);
}

/* The first key position a row ending at `len` attends to. */
static inline int64_t window_start(int64_t len, int64_t window) {
    return (window > 0 && len > window) ? len - window : 0;
}

/* Returns 0; -1 when scratch memory could not be allocated; -2 when a context length is
 * longer than its block table or a block id it reads is outside [0, num_blocks) (nothing is
 * read then: the caller gets an error instead of a crash). q and out are float32; the caches
 * float32, or bf16 when kv_bf16 is 1. */
int paged_attention_f32(const float *q, const void *k_cache, const void *v_cache,
                        int64_t num_blocks, const int32_t *block_tables,
                        const int32_t *context_lens, int64_t rows, int64_t max_blocks,
                        int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                        int64_t block_size, int64_t window, float scale, float *out,
                        int kv_bf16, int num_threads) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t len = context_lens[r];
        if (len > max_blocks * block_size) return -2;
        for (int64_t b = 0; b * block_size < len; b++) {
            const int32_t block = block_tables[r * max_blocks + b];
            if (block < 0 || block >= num_blocks) return -2;
        }
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * (size_t)(num_heads * (block_size + 2)));
        if (scratch == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t len = context_lens[r];
            float *result = out + r * num_heads * head_dim;
            if (scratch == NULL || len <= 0) {
                for (int64_t i = 0; i < num_heads * head_dim; i++) result[i] = 0.0f;
                continue;
            }
            const int64_t first = window_start(len, window);
            attend(q + r * num_heads * head_dim, k_cache, v_cache, block_tables + r * max_blocks,
                   &first, &len, 1, num_heads, kv_heads, head_dim, block_size, scale, result,
                   scratch, kv_bf16);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* Most rows of a prefill tile: 16 rows share each block's reads (more gain nothing). A short
 * chunk gets smaller tiles, so that every thread has one. */
#define PREFILL_TILE 16

/* ---- Prefill tiles as small matrix products ------------------------------------------------
 *
 * A tile's rows that share a kv head (its positions times the heads of the group) are attended
 * together, so that every key and value loaded feeds many rows' FMAs, and no horizontal sum is
 * taken. The queries are transposed once per tile and kv head into qt [head_dim][rows] (scale
 * folded in, rows padded to a multiple of VLEN), so a key's scores for VLEN rows are one vector:
 * scores^T [keys][rows] += qt[d] * key[d], register-blocked over 4 keys and 3 row vectors. The
 * online softmax then runs along the rows (a row's maximum over a block is an element-wise max
 * over its keys, not a reduction), and the weighted sum adds probs^T[key][row] * value[key] into
 * PV_ROWS output rows at once, each value vector loaded once for them, with the row's rescale
 * folded into loading its sums: several times faster than row-at-a-time dot products with
 * horizontal sums. */
#ifdef HAVE_VECTOR_DOTS
#if VLEN == 16
#define PV_ROWS 4 /* 4 rows x 4 vectors of sums: 16 of AVX-512's 32 registers */
#else
#define PV_ROWS 2 /* 2 x 4: half of AVX2's 16 */
#endif
#define PV_VECS 4
/* A vector loaded once for several FMAs stays in a register: left to itself, gcc folds the
 * load into every FMA, and the loads, not the FMAs, then set the pace. */
#define HOLD(x) __asm__("" : "+v"(x))

/* st[a * nqp + c * VLEN ...] = qt . keys[a], for KEYS keys and VECS vectors of rows. */
#define DEFINE_QK(KEYS, VECS)                                                                 \
    static inline void qk_##KEYS##_##VECS(const float *qt, int64_t nqp, const float *keys,   \
                                          int64_t key_stride, int64_t head_dim, float *st) { \
        vec acc[KEYS][VECS];                                                                 \
        for (int a = 0; a < KEYS; a++)                                                       \
            for (int c = 0; c < VECS; c++) acc[a][c] = vec_zero();                           \
        for (int64_t d = 0; d < head_dim; d++) {                                             \
            vec q[VECS];                                                                     \
            for (int c = 0; c < VECS; c++) {                                                 \
                q[c] = vec_loadu(qt + d * nqp + c * VLEN);                                   \
                HOLD(q[c]);                                                                  \
            }                                                                                \
            for (int a = 0; a < KEYS; a++) {                                                 \
                const vec k = vec_set1(keys[a * key_stride + d]);                            \
                for (int c = 0; c < VECS; c++) acc[a][c] = vec_fmadd(q[c], k, acc[a][c]);    \
            }                                                                                \
        }                                                                                    \
        for (int a = 0; a < KEYS; a++)                                                       \
            for (int c = 0; c < VECS; c++) vec_storeu(st + a * nqp + c * VLEN, acc[a][c]);   \
    }
DEFINE_QK(4, 3)
DEFINE_QK(4, 2)
DEFINE_QK(4, 1)
DEFINE_QK(1, 3)
DEFINE_QK(1, 2)
DEFINE_QK(1, 1)

/* Scores of KEYS keys from key k on, for every row vector: 3 vectors at a time, then the rest. */
#define QK_ALL_ROWS(KEYS)                                                                     \
    do {                                                                                     \
        const float *keys_k = keys + k * key_stride;                                         \
        float *st_k = st + k * nqp;                                                          \
        int64_t c = 0;                                                                       \
        for (; c + 3 <= vectors; c += 3)                                                     \
            qk_##KEYS##_3(qt + c * VLEN, nqp, keys_k, key_stride, head_dim, st_k + c * VLEN);\
        if (vectors - c == 2)                                                                \
            qk_##KEYS##_2(qt + c * VLEN, nqp, keys_k, key_stride, head_dim, st_k + c * VLEN);\
        else if (vectors - c == 1)                                                           \
            qk_##KEYS##_1(qt + c * VLEN, nqp, keys_k, key_stride, head_dim, st_k + c * VLEN);\
    } while (0)

/* Scores of keys [from, to) (key k at keys + k * key_stride) for every row vector. */
static inline void tile_scores(const float *qt, int64_t nqp, const float *keys, int64_t key_stride,
                               int64_t from, int64_t to, int64_t head_dim, float *st) {
    const int64_t vectors = nqp / VLEN;
    int64_t k = from;
    for (; k + 4 <= to; k += 4) QK_ALL_ROWS(4);
    for (; k < to; k++) QK_ALL_ROWS(1);
}

/* outs[j][...] = outs[j][...] * factors[j] + sum over k in [from, to) of pt[k * nqp + j] *
 * values[start + k * stride ...], for ROWS rows: PV_VECS vectors of a head at a time, then one. */
#define DEFINE_PV(ROWS)                                                                       \
    static inline void pv_##ROWS(float *const *outs, const float *factors, const float *pt,  \
                                 int64_t nqp, const void *values, int64_t start,             \
                                 int64_t stride, int64_t from, int64_t to, int64_t head_dim, \
                                 int bf16) {                                                 \
        int64_t i = 0;                                                                       \
        for (; i + PV_VECS * VLEN <= head_dim; i += PV_VECS * VLEN) {                        \
            vec acc[ROWS][PV_VECS];                                                          \
            for (int j = 0; j < ROWS; j++) {                                                 \
                const vec f = vec_set1(factors[j]);                                          \
                for (int c = 0; c < PV_VECS; c++)                                            \
                    acc[j][c] = vec_mul(vec_loadu(outs[j] + i + c * VLEN), f);               \
            }                                                                                \
            for (int64_t k = from; k < to; k++) {                                            \
                const int64_t row = start + k * stride + i;                                  \
                vec v[PV_VECS];                                                              \
                for (int c = 0; c < PV_VECS; c++) {                                          \
                    v[c] = load_vec(values, row + c * VLEN, bf16);                           \
                    HOLD(v[c]);                                                              \
                }                                                                            \
                for (int j = 0; j < ROWS; j++) {                                             \
                    const vec w = vec_set1(pt[k * nqp + j]);                                 \
                    for (int c = 0; c < PV_VECS; c++) acc[j][c] = vec_fmadd(w, v[c], acc[j][c]); \
                }                                                                            \
            }                                                                                \
            for (int j = 0; j < ROWS; j++)                                                   \
                for (int c = 0; c < PV_VECS; c++) vec_storeu(outs[j] + i + c * VLEN, acc[j][c]); \
        }                                                                                    \
        for (; i < head_dim; i += VLEN) {                                                    \
            vec acc[ROWS];                                                                   \
            for (int j = 0; j < ROWS; j++)                                                   \
                acc[j] = vec_mul(vec_loadu(outs[j] + i), vec_set1(factors[j]));              \
            for (int64_t k = from; k < to; k++) {                                            \
                const vec v = load_vec(values, start + k * stride + i, bf16);                \
                for (int j = 0; j < ROWS; j++)                                               \
                    acc[j] = vec_fmadd(vec_set1(pt[k * nqp + j]), v, acc[j]);                \
            }                                                                                \
            for (int j = 0; j < ROWS; j++) vec_storeu(outs[j] + i, acc[j]);                  \
        }                                                                                    \
    }
DEFINE_PV(4)
DEFINE_PV(2)
DEFINE_PV(1)
#define PV_CALL_(ROWS) pv_##ROWS
#define PV_CALL(ROWS) PV_CALL_(ROWS)

/* Asks for the cache lines of one kv head's slice of a block (block_size tokens of head_dim
 * elements, token_stride apart), for the loop over that head's blocks. */
static inline void prefetch_head_slice(const void *cache, int64_t first_element, int64_t tokens,
                                       int64_t token_stride, int64_t head_bytes, int64_t elem) {
    const char *base = (const char *)cache + first_element * elem;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t byte = 0; byte < head_bytes; byte += 64)
            __builtin_prefetch(base + t * token_stride * elem + byte);
}

/* Scratch floats (and int32s, counted as floats) attend_tile needs for a tile of `nrows`. */
static inline int64_t tile_scratch_floats(int64_t nrows, int64_t group, int64_t head_dim,
                                          int64_t block_size) {
    const int64_t nqp = (nrows * group + VLEN - 1) / VLEN * VLEN;
    /* row pointers (2 floats' room each) first, where malloc's alignment holds for them */
    return nqp * (2 + head_dim + block_size + 7) + block_size * head_dim;
}

/* The rows of a prefill tile as above: row r (r < nrows) is query[r] ([num_heads, head_dim])
 * over key positions [first[r], len[r]) of `table`; same numerics as attend_rows. */
static inline __attribute__((always_inline)) void attend_tile(
    const float *query, const void *k_cache, const void *v_cache, const int32_t *table,
    const int64_t *first, const int64_t *len, int64_t nrows, int64_t num_heads,
    int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out,
    float *scratch, const int bf16) {
    const int64_t group = num_heads / kv_heads;
    const int64_t token_stride = kv_heads * head_dim;
    const int64_t block_elements = block_size * token_stride;
    const int64_t row_size = num_heads * head_dim;
    const int64_t elem = bf16 ? 2 : 4, head_bytes = head_dim * elem;
    const int64_t nq = nrows * group, nqp = (nq + VLEN - 1) / VLEN * VLEN;
    float **outs = (float **)scratch;            /* [nq]: each row's output */
    float *qt = scratch + 2 * nqp;               /* [head_dim][nqp] */
    float *st = qt + head_dim * nqp;             /* [block_size][nqp]: scores, then probs */
    float *maxima = st + block_size * nqp, *sums = maxima + nqp, *factors = sums + nqp;
    float *shift = factors + nqp, *block_max = shift + nqp;
    int32_t *lo = (int32_t *)(block_max + nqp), *hi = lo + nqp;  /* each row's key positions */
    float *widened = (float *)(hi + nqp);        /* [block_size][head_dim]: bf16 keys as float */
    int64_t lowest = first[0], highest = len[0], latest_first = first[0], earliest_len = len[0];
    for (int64_t r = 0; r < nrows; r++) {
        lowest = first[r] < lowest ? first[r] : lowest;
        highest = len[r] > highest ? len[r] : highest;
        latest_first = first[r] > latest_first ? first[r] : latest_first;
        earliest_len = len[r] < earliest_len ? len[r] : earliest_len;
    }
    for (int64_t r = 0; r < nqp; r++) {  /* padding rows copy the last row's key range */
        const int64_t t = r < nq ? r / group : nrows - 1;
        lo[r] = (int32_t)first[t];
        hi[r] = (int32_t)len[t];
    }
    const int64_t first_block = lowest / block_size, last_block = (highest - 1) / block_size;
    for (int64_t g = 0; g < kv_heads; g++) {
        for (int64_t r = 0; r < nqp; r++) {
            if (r >= nq) {
                for (int64_t d = 0; d < head_dim; d++) qt[d * nqp + r] = 0.0f;
                continue;
            }
            const int64_t offset = (r / group) * row_size + (g * group + r % group) * head_dim;
            const float *q_row = query + offset;
            for (int64_t d = 0; d < head_dim; d++) qt[d * nqp + r] = q_row[d] * scale;
            outs[r] = out + offset;
            for (int64_t i = 0; i < head_dim; i++) outs[r][i] = 0.0f;
        }
        for (int64_t r = 0; r < nqp; r++) {
            maxima[r] = -INFINITY;
            sums[r] = 0.0f;
        }
        for (int64_t b = first_block; b < first_block + PREFETCH_BLOCKS && b <= last_block; b++) {
            const int64_t slice = (int64_t)table[b] * block_elements + g * head_dim;
            prefetch_head_slice(k_cache, slice, block_size, token_stride, head_bytes, elem);
            prefetch_head_slice(v_cache, slice, block_size, token_stride, head_bytes, elem);
        }
        for (int64_t b = first_block; b <= last_block; b++) {
            const int64_t block_first = b * block_size;
            const int64_t slice = (int64_t)table[b] * block_elements + g * head_dim;
            const int64_t from = (lowest > block_first ? lowest : block_first) - block_first;
            const int64_t to = (highest < block_first + block_size ? highest
                                                                   : block_first + block_size) -
                               block_first;
            const int ahead = b + PREFETCH_BLOCKS <= last_block;
            const int64_t next = ahead ? (int64_t)table[b + PREFETCH_BLOCKS] * block_elements +
                                             g * head_dim
                                       : 0;
            if (ahead) prefetch_head_slice(k_cache, next, block_size, token_stride, head_bytes, elem);
            const float *keys;
            int64_t key_stride;
            if (bf16) {
                for (int64_t k = from; k < to; k++)
                    for (int64_t i = 0; i < head_dim; i += VLEN)
                        vec_storeu(widened + k * head_dim + i,
                                   load_vec(k_cache, slice + k * token_stride + i, 1));
                keys = widened;
                key_stride = head_dim;
            } else {
                keys = (const float *)k_cache + slice;
                key_stride = token_stride;
            }
            tile_scores(qt, nqp, keys, key_stride, from, to, head_dim, st);
            /* The block's maximum per row, along rows; keys outside a row's range get -inf
             * first, where the block is not inside every row's range (the diagonal, a
             * window's edge). */
            for (int64_t r = 0; r < nqp; r++) block_max[r] = -INFINITY;
            const int inside = block_first + from >= latest_first && block_first + to <= earliest_len;
            for (int64_t k = from; k < to; k++) {
                const int32_t position = (int32_t)(block_first + k);
                float *s = st + k * nqp;
                if (inside) {
#pragma omp simd
                    for (int64_t r = 0; r < nqp; r++)
                        block_max[r] = s[r] > block_max[r] ? s[r] : block_max[r];
                    continue;
                }
#pragma omp simd
                for (int64_t r = 0; r < nqp; r++) {
                    const float x = (position >= lo[r] && position < hi[r]) ? s[r] : -INFINITY;
                    s[r] = x;
                    block_max[r] = x > block_max[r] ? x : block_max[r];
                }
            }
            /* A row with no key yet keeps -inf as its maximum; exponents are taken against 0
             * then, so its sums stay 0 instead of becoming NaN. */
#pragma omp simd
            for (int64_t r = 0; r < nqp; r++) {
                const float peak = block_max[r] > maxima[r] ? block_max[r] : maxima[r];
                shift[r] = peak == -INFINITY ? 0.0f : peak;
                factors[r] = maxima[r] - shift[r];
                maxima[r] = peak;
            }
#pragma omp simd
            for (int64_t r = 0; r < nqp; r++) factors[r] = expf(factors[r]);
#pragma omp simd
            for (int64_t r = 0; r < nqp; r++) sums[r] *= factors[r];
            for (int64_t k = from; k < to; k++) {
                float *s = st + k * nqp;
#pragma omp simd
                for (int64_t r = 0; r < nqp; r++) {
                    s[r] = expf(s[r] - shift[r]);
                    sums[r] += s[r];
                }
            }
            if (ahead) prefetch_head_slice(v_cache, next, block_size, token_stride, head_bytes, elem);
            int64_t r = 0;
            for (; r + PV_ROWS <= nq; r += PV_ROWS)
                PV_CALL(PV_ROWS)(outs + r, factors + r, st + r, nqp, v_cache, slice, token_stride,
                                 from, to, head_dim, bf16);
            for (; r < nq; r++)
                pv_1(outs + r, factors + r, st + r, nqp, v_cache, slice, token_stride, from, to,
                     head_dim, bf16);
        }
        for (int64_t r = 0; r < nq; r++) {
            const float inverse = 1.0f / sums[r];
#pragma omp simd
            for (int64_t i = 0; i < head_dim; i++) outs[r][i] *= inverse;
        }
    }
}
#endif

/* A prefill chunk of one sequence, its keys and values already written to their blocks: row i
 * is position start + i and attends to positions [0, start + i] (the last `window` of them
 * when window > 0) of `table` (table_len blocks). Same returns as paged_attention_f32. */
int paged_prefill_attention_f32(const float *q, const void *k_cache, const void *v_cache,
                                int64_t num_blocks, const int32_t *table, int64_t table_len,
                                int64_t start, int64_t rows, int64_t num_heads,
                                int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                int64_t window, float scale, float *out, int kv_bf16,
                                int num_threads) {
    if (rows <= 0) return 0;
    if (start < 0 || start + rows > table_len * block_size) return -2;
    for (int64_t b = 0; b * block_size < start + rows; b++)
        if (table[b] < 0 || table[b] >= num_blocks) return -2;
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    const int64_t per_thread = (rows + threads - 1) / threads;
    const int64_t tile = per_thread < PREFILL_TILE ? per_thread : PREFILL_TILE;
    const int64_t tiles = (rows + tile - 1) / tile;
    int blocked = 0;
    int64_t scratch_floats = tile * num_heads * (block_size + 2);
#ifdef HAVE_VECTOR_DOTS
    if (head_dim % VLEN == 0) {
        blocked = 1;
        scratch_floats = tile_scratch_floats(tile, num_heads / kv_heads, head_dim, block_size);
    }
#endif
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * (size_t)scratch_floats);
        if (scratch == NULL) failed = 1;
        /* Later tiles attend to more positions: handed out first, so the last one a thread
         * picks up is short. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = tiles - 1; t >= 0; t--) {
            const int64_t row0 = t * tile;
            const int64_t nrows = rows - row0 < tile ? rows - row0 : tile;
            if (scratch == NULL) continue;
            int64_t first[PREFILL_TILE] = {0}, len[PREFILL_TILE] = {0};
            for (int64_t r = 0; r < nrows; r++) {
                len[r] = start + row0 + r + 1;
                first[r] = window_start(len[r], window);
            }
            const float *rows_q = q + row0 * num_heads * head_dim;
            float *rows_out = out + row0 * num_heads * head_dim;
#ifdef HAVE_VECTOR_DOTS
            if (blocked) {
                if (kv_bf16)
                    attend_tile(rows_q, k_cache, v_cache, table, first, len, nrows, num_heads,
                                kv_heads, head_dim, block_size, scale, rows_out, scratch, 1);
                else
                    attend_tile(rows_q, k_cache, v_cache, table, first, len, nrows, num_heads,
                                kv_heads, head_dim, block_size, scale, rows_out, scratch, 0);
                continue;
            }
#endif
            attend(rows_q, k_cache, v_cache, table, first, len, nrows, num_heads, kv_heads,
                   head_dim, block_size, scale, rows_out, scratch, kv_bf16);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
