/* Attention over a paged KV cache, read in place (CPU, float32 arithmetic).
 *
 * The torch path gathers each sequence's blocks into a padded buffer and runs SDPA on it;
 * this reads the keys and values straight from their blocks, so nothing is copied, nothing is
 * padded and no mask is built. runtime/engine/kernels.py compiles it with the machine's C
 * compiler and calls it through ctypes (which releases the GIL for the call). OpenMP is the
 * one torch already loaded (libgomp.so.1 from torch/lib), so the kernel's threads are torch's.
 *
 * Layouts (all contiguous):
 *   q, out        [rows, num_heads, head_dim]
 *   k/v_cache     [num_blocks, block_size, kv_heads, head_dim]
 *   block_tables  [rows, max_blocks] int32: row r's keys live in blocks block_tables[r][0..]
 *   context_lens  [rows] int32: row r attends to key positions [0, context_lens[r])
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

/* Element `index` of a cache, as float32. Every caller is inlined into a copy of attend_row
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_DOTS 1
/* Elements [index, index + 8) of a cache, as float32. */
static inline __m256 load8(const void *cache, int64_t index, int bf16) {
    if (bf16) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)cache + index));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
    return _mm256_loadu_ps((const float *)cache + index);
}

/* scores[j] = query . keys[start + j * stride ...], j < COUNT, head_dim a multiple of 8: eight
 * dot products reduced together (one horizontal add tree) instead of one at a time. COUNT is
 * a constant so that the accumulators stay in registers: 8 for whole groups, 1 for a tail. */
#define DEFINE_DOTS(COUNT)                                                                    \
    static inline void dots_##COUNT(const float *query, const void *keys, int64_t start,    \
                                    int64_t stride, int64_t head_dim, float scale,           \
                                    float *scores, int bf16) {                               \
        __m256 acc[8];                                                                       \
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();                            \
        for (int64_t i = 0; i < head_dim; i += 8) {                                          \
            const __m256 q = _mm256_loadu_ps(query + i);                                     \
            for (int j = 0; j < COUNT; j++)                                                  \
                acc[j] = _mm256_fmadd_ps(q, load8(keys, start + j * stride + i, bf16),       \
                                         acc[j]);                                            \
        }                                                                                    \
        const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]);                                   \
        const __m256 s23 = _mm256_hadd_ps(acc[2], acc[3]);                                   \
        const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]);                                   \
        const __m256 s67 = _mm256_hadd_ps(acc[6], acc[7]);                                   \
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
#endif

/* y += a * values[start ...] over n elements. */
static inline void axpy(float *y, float a, const void *values, int64_t start, int64_t n,
                        int bf16) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * load1(values, start + i, bf16);
}

#ifdef HAVE_AVX2_DOTS
/* out[0 .. 8 * VECTORS) += sum over t < count of weights[t] * values[start + t * stride ...]:
 * the sums stay in registers across a block's tokens, so `out` is loaded and stored once a
 * block instead of once a token (which made the weighted sum load/store bound). */
#define DEFINE_WEIGHTED_SUM(VECTORS)                                                          \
    static inline void weighted_sum_##VECTORS(float *out, const float *weights,             \
                                              const void *values, int64_t start,             \
                                              int64_t stride, int64_t count, int bf16) {     \
        __m256 acc[VECTORS];                                                                 \
        for (int j = 0; j < VECTORS; j++) acc[j] = _mm256_loadu_ps(out + 8 * j);             \
        for (int64_t t = 0; t < count; t++) {                                                \
            const __m256 weight = _mm256_set1_ps(weights[t]);                                \
            const int64_t row = start + t * stride;                                          \
            for (int j = 0; j < VECTORS; j++)                                                \
                acc[j] = _mm256_fmadd_ps(weight, load8(values, row + 8 * j, bf16), acc[j]);  \
        }                                                                                    \
        for (int j = 0; j < VECTORS; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);             \
    }
DEFINE_WEIGHTED_SUM(8)
DEFINE_WEIGHTED_SUM(1)

/* The same over a head of head_dim floats (a multiple of 8): 64 at a time, then 8 at a time. */
static inline void weighted_sum(float *out, const float *weights, const void *values,
                                int64_t start, int64_t stride, int64_t count, int64_t head_dim,
                                int bf16) {
    int64_t i = 0;
    for (; i + 64 <= head_dim; i += 64)
        weighted_sum_8(out + i, weights, values, start + i, stride, count, bf16);
    for (; i < head_dim; i += 8)
        weighted_sum_1(out + i, weights, values, start + i, stride, count, bf16);
}
#endif

/* Blocks read ahead of the one being computed: a block's arithmetic is short next to the
 * latency of fetching the next one from memory. */
#define PREFETCH_BLOCKS 2

static inline void prefetch_block(const void *k_cache, const void *v_cache, int32_t block,
                                  int64_t block_bytes) {
    const char *keys = (const char *)k_cache + (int64_t)block * block_bytes;
    const char *values = (const char *)v_cache + (int64_t)block * block_bytes;
    for (int64_t offset = 0; offset < block_bytes; offset += 64) {
        __builtin_prefetch(keys + offset);
        __builtin_prefetch(values + offset);
    }
}

/* One row: attention of its num_heads query heads over key positions [first, len), a block at
 * a time. Keys and values of a block are [block_size, kv_heads, head_dim], contiguous, so every
 * read is sequential; blocks ahead are prefetched while this one is computed, since their
 * addresses (block-table lookups) are jumps the hardware prefetcher cannot guess. Softmax is
 * the online kind: a running maximum per head, the sums rescaled when it grows. Always inlined,
 * so each element type (`bf16` a constant at the call) gets its own copy without branches. */
static inline __attribute__((always_inline)) void attend_row(
    const float *query, const void *k_cache, const void *v_cache, const int32_t *table,
    int64_t first, int64_t len, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
    int64_t block_size, float scale, float *out, float *scores /* [num_heads * block_size] */,
    float *maxima, float *sums /* [num_heads] each */, const int bf16) {
    const int64_t group = num_heads / kv_heads;
    const int64_t token_stride = kv_heads * head_dim;
    const int64_t block_elements = block_size * token_stride;
    const int64_t block_bytes = block_elements * (bf16 ? 2 : 4);
    for (int64_t i = 0; i < num_heads * head_dim; i++) out[i] = 0.0f;
    for (int64_t h = 0; h < num_heads; h++) {
        maxima[h] = -INFINITY;
        sums[h] = 0.0f;
    }
    const int64_t first_block = first / block_size, last_block = (len - 1) / block_size;
    for (int64_t b = first_block; b < first_block + PREFETCH_BLOCKS && b <= last_block; b++)
        prefetch_block(k_cache, v_cache, table[b], block_bytes);
    for (int64_t b = first_block; b <= last_block; b++) {
        const int64_t block_start = (int64_t)table[b] * block_elements;  /* in K and in V */
        if (b + PREFETCH_BLOCKS <= last_block)
            prefetch_block(k_cache, v_cache, table[b + PREFETCH_BLOCKS], block_bytes);
        const int64_t lo = b == first_block ? first % block_size : 0;
        const int64_t hi = b == last_block ? (len - 1) % block_size + 1 : block_size;
#ifdef HAVE_AVX2_DOTS
        if (head_dim % 8 == 0) {
            for (int64_t h = 0; h < num_heads; h++)
                block_dots(query + h * head_dim, k_cache,
                           block_start + lo * token_stride + (h / group) * head_dim, token_stride,
                           hi - lo, head_dim, scale, scores + h * block_size + lo, bf16);
        } else
#endif
        for (int64_t t = lo; t < hi; t++) {
            const int64_t key = block_start + t * token_stride;
            for (int64_t h = 0; h < num_heads; h++)
                scores[h * block_size + t] =
                    dot(query + h * head_dim, k_cache, key + (h / group) * head_dim, head_dim,
                        bf16) * scale;
        }
        for (int64_t h = 0; h < num_heads; h++) {
            float *s = scores + h * block_size;
            float peak = maxima[h];
            for (int64_t t = lo; t < hi; t++) peak = s[t] > peak ? s[t] : peak;
            if (peak > maxima[h]) {
                const float shrink = expf(maxima[h] - peak);  /* 0 on the first block */
                sums[h] *= shrink;
                float *o = out + h * head_dim;
#pragma omp simd
                for (int64_t i = 0; i < head_dim; i++) o[i] *= shrink;
                maxima[h] = peak;
            }
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t t = lo; t < hi; t++) {
                s[t] = expf(s[t] - peak);
                total += s[t];
            }
            sums[h] += total;
        }
#ifdef HAVE_AVX2_DOTS
        if (head_dim % 8 == 0) {
            for (int64_t h = 0; h < num_heads; h++)
                weighted_sum(out + h * head_dim, scores + h * block_size + lo, v_cache,
                             block_start + lo * token_stride + (h / group) * head_dim,
                             token_stride, hi - lo, head_dim, bf16);
        } else
#endif
        for (int64_t t = lo; t < hi; t++) {
            const int64_t value = block_start + t * token_stride;
            for (int64_t h = 0; h < num_heads; h++)
                axpy(out + h * head_dim, scores[h * block_size + t], v_cache,
                     value + (h / group) * head_dim, head_dim, bf16);
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        const float inverse = 1.0f / sums[h];
        float *o = out + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < head_dim; i++) o[i] *= inverse;
    }
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
            const int64_t first = (window > 0 && len > window) ? len - window : 0;
            const float *query = q + r * num_heads * head_dim;
            const int32_t *table = block_tables + r * max_blocks;
            float *maxima = scratch + num_heads * block_size, *sums = maxima + num_heads;
            if (kv_bf16)
                attend_row(query, k_cache, v_cache, table, first, len, num_heads, kv_heads,
                           head_dim, block_size, scale, result, scratch, maxima, sums, 1);
            else
                attend_row(query, k_cache, v_cache, table, first, len, num_heads, kv_heads,
                           head_dim, block_size, scale, result, scratch, maxima, sums, 0);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
