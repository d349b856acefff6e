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
 * causal, its own keys and values already stored). Layouts (all contiguous):
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
 * registers where the CPU has AVX-512 (half the instructions per element; with a bf16 cache,
 * half the widening too: ~20 % off the kernel on Zen 5) and 256-bit ones with AVX2 alone.
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
 * outstanding misses, and the arithmetic then waited for it (on Zen 5, spreading them took
 * 30 % off the kernel for small's heads in float32 and half in bf16; bench/README.md,
 * seventeenth round). */
static inline void prefetch_part(const void *cache, int32_t block, int64_t block_bytes,
                                 int64_t part, int64_t parts) {
    const char *base = (const char *)cache + (int64_t)block * block_bytes;
    const int64_t lines = block_bytes / 64;
    for (int64_t line = part * lines / parts; line < (part + 1) * lines / parts; line++)
        __builtin_prefetch(base + line * 64);
}

/* Rows of one sequence, attended together: row r (r < nrows) is query[r] ([num_heads,
 * head_dim]) over key positions [first[r], len[r]) of the same block table. A decode is one
 * row; a prefill chunk comes in tiles of PREFILL_TILE consecutive positions, so that each
 * block of keys and values is read from memory once for the tile instead of once per row
 * (row-at-a-time prefill re-read the whole context for every token and lost to SDPA from
 * ~1,000 tokens of context). A block at a time: keys and values of a block are [block_size,
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

/* Most rows of a prefill tile: 16 rows share each block's reads (32 gained nothing on small's
 * heads; bench/README.md, seventeenth round). A short chunk gets smaller tiles, so that every
 * thread has one. */
#define PREFILL_TILE 16

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
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * (size_t)(tile * num_heads * (block_size + 2)));
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
            attend(q + row0 * num_heads * head_dim, k_cache, v_cache, table, first, len, nrows,
                   num_heads, kv_heads, head_dim, block_size, scale,
                   out + row0 * num_heads * head_dim, scratch, kv_bf16);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
