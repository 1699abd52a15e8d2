/*
 * Every transformer layer of a decode step in one call: the sequence of kernel launches
 * that LlamaModel.forward makes per layer on the fused CPU path (common/model/llama.py,
 * _Layer.forward_fused), run from C instead of Python. A batch-1 step of a 30-layer model
 * is some 330 launches; from Python each pays argument checks and ctypes marshalling
 * (tens of microseconds on a small machine), from here a function-pointer call.
 *
 * The kernels are the ones the Python path calls, taken by address from their own
 * libraries (quant_gemm.c, packed_gemm.c, fused_ops.c, paged_attention.c), so the
 * arithmetic is the same launch for launch and the results are bit-identical. The one
 * step written here is the KV write (each new token's rotated K and its V copied into
 * its cache slot), a byte copy, as kernels/reference.py's write_kv stores them.
 *
 * Per layer, with x the residual stream [T, C] and delta the previous layer's output:
 *   h = add_rms_norm(x += delta, input_norm); qkv = h @ Wqkv; q, k = rope(qkv);
 *   cache[slot] = k, v; attn = decode_attention(q); o = attn @ Wo;
 *   h = add_rms_norm(x += o, post_norm); act = silu_mul(h @ Wgate_up); delta = act @ Wdown
 * and after the last layer x += delta. Only decode rows (each row one query position
 * with its own block table and context length) come here; a step with prefill chunks
 * stays in Python. Float32 caches only.
 *
 * Returns 0, or -(100 * layer + 10 + step) when a kernel rejects its arguments (step 0..9
 * in the order above), or -1 on a bad size or a slot outside the cache.
 */
#include <stdint.h>
#include <string.h>

typedef int (*quant_linear_fn)(int fmt, const float *x, long ldx, const uint8_t *packed,
                               const float *bias, float *y, long ldy, long M, long N, long K,
                               int num_threads);
typedef int (*packed_linear_fn)(const float *x, long ldx, const float *packed, const float *bias,
                                float *y, long ldy, long M, long N, long K, int num_threads);
typedef int (*add_rms_norm_fn)(float *x, long ldx, const float *delta, long ldd, const float *weight,
                               float eps, float *out, long ldo, long T, long C);
typedef int (*silu_mul_fn)(const float *gu, long ldg, float *out, long ldo, long T, long I);
typedef int (*rope_qk_fn)(const float *qkv, long ldq, const int64_t *positions, const float *cos,
                          const float *sin, long max_pos, float *q, float *k, long T, long H,
                          long KVH, long D);
typedef int (*decode_attention_fn)(const float *q, const void *k_cache, const void *v_cache,
                                   int64_t k_block_stride, int64_t v_block_stride,
                                   int64_t token_stride, int64_t head_stride, int64_t num_blocks,
                                   const int32_t *block_tables, int64_t bt_stride, int max_blocks,
                                   const int32_t *context_lens, int B, int H, int KVH, int D,
                                   int block_size, float scale, float *out, int num_threads);

/* One projection as held: quantised (fmt >= 0, a quant_gemm.c format code) or packed
 * float32 (fmt = -1). */
typedef struct {
    int64_t fmt;
    const void *w;
    const float *bias; /* NULL: none */
    int64_t n, k;
} Proj;

typedef struct {
    const float *input_norm, *post_norm;
    Proj qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* this layer's [NB, BS, KVH, D] K and V, block stride below */
} Layer;

typedef struct {
    quant_linear_fn quant_linear;
    packed_linear_fn packed_linear;
    add_rms_norm_fn add_rms_norm;
    silu_mul_fn silu_mul;
    rope_qk_fn rope_qk;
    decode_attention_fn attention;
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *cos, *sin;
    int64_t max_pos;
    int64_t num_blocks, block_size, block_stride; /* elements between blocks of one layer's K */
    const Layer *layers;
} Model;

typedef struct {
    int64_t T;
    float *x;                  /* [T, C] residual stream, updated in place */
    const int64_t *positions;  /* [T] */
    const int64_t *slots;      /* [T] cache slot of each row's token */
    const int32_t *block_tables;
    int64_t bt_stride, max_blocks;
    const int32_t *context_lens; /* [T] */
    float *scratch;            /* decode_layers_scratch(model, T) floats */
    int64_t threads;
} Step;

static int linear(const Model *m, const Proj *p, const float *x, long ldx, float *y, long T, int threads) {
    if (p->fmt >= 0)
        return m->quant_linear((int)p->fmt, x, ldx, (const uint8_t *)p->w, p->bias, y, p->n, T, p->n,
                               p->k, threads);
    return m->packed_linear(x, ldx, (const float *)p->w, p->bias, y, p->n, T, p->n, p->k, threads);
}

static int64_t qkv_width(const Model *m) { return (m->heads + 2 * m->kv_heads) * m->head_dim; }

/* Floats of scratch a step of T rows needs. */
long decode_layers_scratch(const Model *m, long T) {
    const int64_t C = m->hidden, q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    return T * (C + qkv_width(m) + q + kv + q + C + 2 * m->intermediate + m->intermediate + C);
}

static void write_kv(const Model *m, const Layer *l, const float *k, const float *qkv, int64_t ldq,
                     const int64_t *slots, int64_t T) {
    const int64_t row = m->kv_heads * m->head_dim, v_at = (m->heads + m->kv_heads) * m->head_dim;
    for (int64_t t = 0; t < T; t++) {
        const int64_t b = slots[t] / m->block_size, off = slots[t] % m->block_size;
        const int64_t at = b * m->block_stride + off * row;
        memcpy(l->k_cache + at, k + t * row, sizeof(float) * row);
        memcpy(l->v_cache + at, qkv + t * ldq + v_at, sizeof(float) * row);
    }
}

#define CHECK(call, step)                                      \
    do {                                                       \
        if ((call) != 0) return -(100 * (int)i + 10 + (step)); \
    } while (0)

int decode_layers(const Model *m, const Step *s) {
    const int64_t T = s->T, C = m->hidden, H = m->heads, KVH = m->kv_heads, D = m->head_dim;
    const int64_t I = m->intermediate, ldq = qkv_width(m), cache_slots = m->num_blocks * m->block_size;
    const int threads = s->threads < 1 ? 1 : (int)s->threads;
    if (T < 1 || m->num_layers < 1) return -1;
    for (int64_t t = 0; t < T; t++)
        if (s->slots[t] < 0 || s->slots[t] >= cache_slots) return -1;
    float *h = s->scratch, *qkv = h + T * C, *q = qkv + T * ldq, *k = q + T * H * D;
    float *attn = k + T * KVH * D, *o = attn + T * H * D, *gu = o + T * C, *act = gu + T * 2 * I;
    float *delta = act + T * I;
    const float *prev = NULL; /* the previous layer's output, added into x by this one */
    for (int64_t i = 0; i < m->num_layers; i++) {
        const Layer *l = m->layers + i;
        CHECK(m->add_rms_norm(s->x, C, prev, C, l->input_norm, m->eps, h, C, T, C), 0);
        CHECK(linear(m, &l->qkv, h, C, qkv, T, threads), 1);
        CHECK(m->rope_qk(qkv, ldq, s->positions, m->cos, m->sin, m->max_pos, q, k, T, H, KVH, D), 2);
        write_kv(m, l, k, qkv, ldq, s->slots, T);
        CHECK(m->attention(q, l->k_cache, l->v_cache, m->block_stride, m->block_stride, KVH * D, D,
                           m->num_blocks, s->block_tables, s->bt_stride, (int)s->max_blocks,
                           s->context_lens, (int)T, (int)H, (int)KVH, (int)D, (int)m->block_size,
                           m->scale, attn, threads), 4);
        CHECK(linear(m, &l->o, attn, H * D, o, T, threads), 5);
        CHECK(m->add_rms_norm(s->x, C, o, C, l->post_norm, m->eps, h, C, T, C), 6);
        CHECK(linear(m, &l->gate_up, h, C, gu, T, threads), 7);
        CHECK(m->silu_mul(gu, 2 * I, act, I, T, I), 8);
        CHECK(linear(m, &l->down, act, I, delta, T, threads), 9);
        prev = delta;
    }
    for (int64_t j = 0; j < T * C; j++) s->x[j] += delta[j];
    return 0;
}
