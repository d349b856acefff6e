/* The element-wise work between a decoder layer's matmuls, fused (CPU, float32; the KV cache
 * may be bf16).
 *
 * In torch each of these is 5-15 small ops (an RMSNorm alone is to, pow, mean, add, rsqrt,
 * mul, to, mul), and with a step's few rows every op costs more in dispatch than in
 * arithmetic. Each function here is one pass over its rows. The numerics follow the torch
 * code they replace (model.py): float32 throughout, the RMSNorm's mean of squares, the
 * rotary embedding's x * cos + rotate_half(x) * sin; only summation order and FMA rounding
 * differ.
 */
#include <stdint.h>
#include <string.h>

#include "vector_math.h"

/* hidden[r] += delta[r] (when delta is not NULL), then
 * out[r] = weight * hidden[r] / sqrt(mean(hidden[r]^2) + eps). */
void add_rms_norm_f32(float *hidden, const float *delta, const float *weight, float eps,
                      float *out, int64_t rows, int64_t width, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        float *h = hidden + r * width;
        float *o = out + r * width;
        if (delta != NULL) {
            const float *d = delta + r * width;
#pragma omp simd
            for (int64_t i = 0; i < width; i++) h[i] += d[i];
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < width; i++) squares += h[i] * h[i];
        const float inverse = 1.0f / sqrtf(squares / (float)width + eps);
#pragma omp simd
        for (int64_t i = 0; i < width; i++) o[i] = weight[i] * (h[i] * inverse);
    }
}

static inline void rotate(const float *x, const float *cos, const float *sin, int64_t half,
                          float *out) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        out[i] = x[i] * cos[i] - x[i + half] * sin[i];
        out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
}

/* float32 to bf16, rounding to nearest even as torch's .to(torch.bfloat16) does; a NaN stays
 * a NaN (torch's own NaN bits differ between its scalar and vector paths). */
static inline uint16_t bf16_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* `count` floats into slot `slot` of a cache of float32, or of bf16 when bf16 is set. */
static inline void store_slot(void *cache, int64_t slot, const float *values, int64_t count,
                              int bf16) {
    if (!bf16) {
        memcpy((float *)cache + slot * count, values, sizeof(float) * count);
        return;
    }
    uint16_t *out = (uint16_t *)cache + slot * count;
#pragma omp simd
    for (int64_t i = 0; i < count; i++) out[i] = bf16_of(values[i]);
}

/* One row of qkv is [num_heads * head_dim | kv_heads * head_dim | kv_heads * head_dim].
 * Writes the rotated queries to q_out and rotated keys to k_out ([rows, heads, head_dim]
 * each), and stores each row's rotated key and its value in cache slot slots[r] of
 * k_cache / v_cache ([slots, kv_heads, head_dim]; float32, or bf16 when kv_bf16 is 1).
 * cos/sin are [rows, head_dim], the tables' rows for each row's position. Returns -2 (and
 * writes nothing) when a slot is outside [0, num_slots). */
int rope_store_kv_f32(const float *qkv, const float *cos, const float *sin,
                      const int64_t *slots, int64_t num_slots, int64_t rows, int64_t num_heads,
                      int64_t kv_heads, int64_t head_dim, float *q_out, float *k_out,
                      void *k_cache, void *v_cache, int kv_bf16, int num_threads) {
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return -2;
    const int64_t q_width = num_heads * head_dim, kv_width = kv_heads * head_dim;
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = qkv + r * (q_width + 2 * kv_width);
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        for (int64_t h = 0; h < num_heads; h++)
            rotate(row + h * head_dim, c, s, half, q_out + r * q_width + h * head_dim);
        float *k_row = k_out + r * kv_width;
        for (int64_t h = 0; h < kv_heads; h++)
            rotate(row + q_width + h * head_dim, c, s, half, k_row + h * head_dim);
        store_slot(k_cache, slots[r], k_row, kv_width, kv_bf16);
        store_slot(v_cache, slots[r], row + q_width + kv_width, kv_width, kv_bf16);
    }
    return 0;
}

/* out[r] = silu(gate_up[r][:width]) * gate_up[r][width:], silu(x) = x / (1 + exp(-x)). */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t width,
                  int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        float *o = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}
