/* One decode step (one new token for each of a batch of sequences) of a cpu-target artifact, over its own int8
 * weights.
 *
 * The maths of the artifact's graphs for each sequence, in their order and their quantisation
 * (runtime/backends/native/decoder.py says which graph op each part follows): int8 block weights stored as bytes
 * code + 128 with one float32 scale per block of the input dim (MatMulNBits, QMoE), activations quantised per block to int8 (absmax / 127) before each
 * product, the int8 latent cache read in place (one scale per token), W_UK and W_UV int8 per output column.
 * Every product is written once over runtime/backends/native/isa.h's vectors and its dot4 (four byte products a 32-bit lane),
 * which each instruction set lowers to its own int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI, AVX2, SSSE3,
 * NEON, a plain loop): the products are exact integer sums on every one of them.
 *
 * Every product's rows, and the attention's heads or positions (phase by phase), are split over a pool of threads
 * that spin between the phases of a step while each has a core to itself, yield while they wait, sleep after a while
 * idle, and keep each to its own core (k2_pool_start). Processes of this project on one host share its cores by
 * leases (a lock file a core, held while a process decodes): a step runs on the cores its process holds, so two
 * processes side by side settle on disjoint cores. With more threads than the process's CPUs, or once a phase
 * found a worker without a core (another process took it), nobody spins: waits sleep until woken, and a step's
 * time degrades with its share of the cores, not with the scheduler's time slice. A weight row is read once for the
 * whole batch (each routed expert once for the sequences that chose it) and multiplied by each sequence's input; a
 * sequence's result does not depend on the batch or on the number of threads. Shapes: m hidden, h heads, d nope dim, r rope dim, v value dim, c latent, t positions,
 * e experts.
 *
 * The source's parts, included below in this order: model.h (the model's structs and limits), pool.c (threads and
 * leases), products.c (activation quantisation and the weights' products), vectors.c (norms, rope, silu, float dots),
 * attention.c, moe.c (routing, experts, the MLP); this file's step; ops.c (each op exported alone, for the tests).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stddef.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include "isa.h"

#include "model.h"
#include "pool.c"
#include "products.c"
#include "vectors.c"
#include "attention.c"
#include "moe.c"

/* ---- the step ----------------------------------------------------------------------------------------------- */

/* each sequence's new entry: latent normalised, quantised per token; rope key roped (turns: rope_turns), float16;
   into its page */
static void store_entry(const K2Dims *d, const K2Layer *l, float *kv, int pos, const int64_t *table,
                        const K2Pages *pages, const float *turns, float *latent) {
    rms_norm(kv, l->kv_norm, d->latent, d->eps, latent);
    rope(kv + d->latent, d->rope, turns);
    size_t row = (size_t)table[pos / PAGE] * PAGE + pos % PAGE;
    float absmax = 0;
    for (int c = 0; c < d->latent; c++) absmax = MAX(absmax, fabsf(latent[c]));
    float scale = MAX(absmax / 127.0f, 1e-12f);
    for (int c = 0; c < d->latent; c++) {
        float q = nearbyintf(latent[c] / scale);
        q = q > 127 ? 127 : q < -127 ? -127 : q;
        pages->latent[row * d->latent + c] = (uint8_t)(q + CODE_ZERO);
    }
    pages->scale[row] = scale;
    for (int i = 0; i < d->rope; i++) pages->rope[row * d->rope + i] = to_half(kv[d->latent + i]);
}


typedef struct {            /* each sequence's new entry and its rope turns [batch, r] */
    const K2Dims *d; const K2Layer *l; float *kv; const int *pos; const int64_t *tables; int table_len;
    const K2Pages *pages; float *turns;
} Entries;

static void entry_row(void *arg, int s, char *own) {
    const Entries *e = arg;
    const K2Dims *d = e->d;
    float *turns = e->turns + (size_t)s * d->rope;
    rope_turns(e->l->frequencies, d->rope, e->pos[s], d->rope_scale, turns);
    store_entry(d, e->l, e->kv + (size_t)s * e->l->kv_a.n, e->pos[s], e->tables + (size_t)s * e->table_len, e->pages,
                turns, (float *)own);
}

typedef struct { const K2Dims *d; float *q; const float *turns; } Queries;  /* q [batch, h, d + r] */

static void query_rope_row(void *arg, int s, char *own) {
    (void)own;
    const Queries *e = arg;
    const K2Dims *d = e->d;
    int qk = d->nope + d->rope;
    for (int h = 0; h < d->heads; h++)
        rope(e->q + ((size_t)s * d->heads + h) * qk + d->nope, d->rope, e->turns + (size_t)s * d->rope);
}

typedef struct { const K2Dims *d; const K2Layer *l; float *x; const float *o; float *xn; } Residual;

static void residual_row(void *arg, int s, char *own) {  /* x += o, xn = its post-attention norm */
    (void)own;
    const Residual *r = arg;
    int m = r->d->hidden;
    float *x = r->x + (size_t)s * m;
    for (int i = 0; i < m; i++) x[i] += r->o[(size_t)s * m + i];
    rms_norm(x, r->l->post_norm, m, r->d->eps, r->xn + (size_t)s * m);
}

/* one layer for `batch` sequences: x [batch, m] in and out; sequence s at position pos[s], its page ids
   tables [s * table_len ..]; each sequence's new entry into its page */
static void layer_step(const K2Dims *d, const K2Layer *l, int batch, float *x, const int *pos, const K2Pages *pages,
                       const int64_t *tables, int table_len, Bump b, char *attention_scratch) {
    int m = d->hidden, heads = d->heads, qk = d->nope + d->rope;
    Quant *xq = quantize_rows(x, batch, m, l->in_norm, d->eps, l->q_a.block, &b);
    float *q_a = take(&b, (size_t)batch * l->q_a.n * 4), *kv = take(&b, (size_t)batch * l->kv_a.n * 4);
    K2Lin first_lin[2] = {l->q_a, l->kv_a};
    int first_count[2] = {batch, batch};
    const Quant *first_in[2] = {xq, xq};
    float *first_out[2] = {q_a, kv};
    Products first = {2, first_lin, first_count, first_in, first_out};
    run(products_task, &first);
    float *turns = take(&b, (size_t)batch * d->rope * 4);
    Entries entries = {d, l, kv, pos, tables, table_len, pages, turns};
    each_row(entry_row, &entries, batch, (size_t)d->latent * 4, &b);
    float *q = take(&b, (size_t)batch * heads * qk * 4);
    one_product(&l->q_b, batch, quantize_rows(q_a, batch, l->q_a.n, l->q_norm, d->eps, l->q_b.block, &b), q);
    Queries queries = {d, q, turns};
    each_row(query_rope_row, &queries, batch, 0, &b);
    float *attended = take(&b, (size_t)batch * heads * d->v * 4);
    for (int s = 0, n; s < batch; s += n) {  /* runs of sequences over the same pages (a prompt's tokens) */
        const int64_t *table = tables + (size_t)s * table_len;
        for (n = 1; s + n < batch && !memcmp(table, table + (size_t)n * table_len, (size_t)table_len * 8); n++) {}
        int threads = pool.threads ? pool.threads : 1;
        if (n * heads >= ROW_TILE * threads && d->latent % VBYTES == 0) {  /* enough rows for a tile a thread */
            block_attention(d, l, pages, table, n, pos + s, q + (size_t)s * heads * qk,
                            attended + (size_t)s * heads * d->v, attention_scratch);
            continue;
        }
        for (int i = s; i < s + n; i++)
            attention(d, l, pages, tables + (size_t)i * table_len, pos[i] + 1, q + (size_t)i * heads * qk,
                      attended + (size_t)i * heads * d->v, attention_scratch);
    }
    float *o = take(&b, (size_t)batch * m * 4);
    one_product(&l->o, batch, quantize_rows(attended, batch, heads * d->v, NULL, 0, l->o.block, &b), o);
    float *xn = take(&b, (size_t)batch * m * 4), *y = take(&b, (size_t)batch * m * 4);
    Residual residual = {d, l, x, o, xn};
    each_row(residual_row, &residual, batch, 0, &b);
    mlp(d, l, batch, xn, y, b);
    for (size_t i = 0; i < (size_t)batch * m; i++) x[i] += y[i];
}

/* floats of scratch a step of up to `batch` sequences needs */
long k2_scratch_floats(const K2Model *m, int threads, int batch) {
    const K2Dims *d = &m->d;
    size_t widest = d->hidden, experts = 0;
    for (int i = 0; i < m->layers; i++) {
        const K2Layer *l = &m->layer[i];
        size_t rows = l->moe ? (size_t)2 * l->width * (d->top_k + 1) : (size_t)2 * l->width;
        if (rows > widest) widest = rows;
        if (l->moe && (size_t)l->experts > experts) experts = l->experts;
    }
    size_t per_sequence = (size_t)32 * (d->hidden + d->q_rank + d->latent + d->rope) * 4 +
                          (size_t)8 * d->heads * (d->nope + d->rope + d->v) + widest * 16 +
                          (size_t)(d->top_k + 8) * (64 * 8 + 2 * sizeof(Quant) + 8 * sizeof(void *) + 2 * sizeof(K2Lin)) +
                          experts * 4;
    size_t row = MAX(MAX(d->hidden, d->q_rank), MAX(d->latent, d->heads * d->v)) + 64;  /* each_row's own scratch */
    for (int i = 0; i < m->layers; i++)  /* the activations' (the widest of an expert and the dense or shared MLP) */
        row = MAX(row, (size_t)3 * (MAX(m->layer[i].width, m->layer[i].gate.n) + 64));
    size_t rows = (size_t)EACH_ROW_CALLS * threads * row * 4 + (size_t)batch * (d->top_k + 2) * (sizeof(Activations) + 4);
    size_t bytes = 64 * 1024 + (size_t)batch * per_sequence + experts * 4 + step_attention_bytes(d, threads) +
                   rows + (size_t)4 * 4096;
    return (long)(bytes / 4 + 1);
}

static Bump step_scratch(const K2Model *m, float *scratch) {
    int threads = pool.threads ? pool.threads : 1;
    Bump b = {(char *)scratch + step_attention_bytes(&m->d, threads)};
    b.at = (char *)(((uintptr_t)b.at + 63) / 64 * 64);
    return b;
}

/* layers first .. first + count - 1 of `batch` sequences, one token each: sequence s at position pos[s] (it holds
   pos[s] entries), its page ids tables [s * table_len ..] (pos[s] / PAGE < table_len); each layer's new entries
   into their pages (pages[i]: the pools of layer first + i); hidden [batch, m] in and out. scratch:
   k2_scratch_floats floats for at least `batch`. Returns 0, or -1 on a bad argument. */
int k2_decode_layers(const K2Model *m, int first, int count, int batch, const int *pos, const int64_t *tables,
                     int table_len, const K2Pages *pages, float *hidden, float *scratch) {
    const K2Dims *d = &m->d;
    if (first < 0 || count < 0 || first + count > m->layers || batch < 1) return -1;
    for (int s = 0; s < batch; s++)
        if (pos[s] < 0 || pos[s] >= d->max_len || pos[s] / PAGE >= table_len) return -1;
    if (d->top_k > MAX_TOP_K || d->n_group > MAX_GROUPS || d->topk_group > MAX_GROUPS) return -1;
    for (int i = 0; i < count; i++) {
        const K2Layer *l = &m->layer[first + i];
        if (l->moe && (l->experts > MAX_EXPERTS || (l->bits != 8 && l->bits != 4))) return -1;
    }
    Bump b = step_scratch(m, scratch);
    begin_step();
    Held held = hold_cpu();
    for (int i = 0; i < count; i++)
        layer_step(d, &m->layer[first + i], batch, hidden, pos, &pages[i], tables, table_len, b, (char *)scratch);
    release_cpu(&held);
    return 0;
}

/* each sequence's token embedded, then every layer (k2_decode_layers) */
int k2_decode_step(const K2Model *m, int batch, const int *tokens, const int *pos, const int64_t *tables,
                   int table_len, const K2Pages *pages, float *hidden, float *scratch) {
    const K2Dims *d = &m->d;
    for (int s = 0; s < batch; s++) {
        if (tokens[s] < 0 || tokens[s] >= d->vocab) return -1;
        for (int i = 0; i < d->hidden; i++)
            hidden[(size_t)s * d->hidden + i] = from_bf16(m->embed[(size_t)tokens[s] * d->hidden + i]);
    }
    return k2_decode_layers(m, 0, m->layers, batch, pos, tables, table_len, pages, hidden, scratch);
}

/* the library's side of its contract with runtime/backends/native/decoder.py, read there at load (build.CONTRACT
   names them in this order): its constants and the sizes of the structs it takes; a Python side whose layout or
   limits differ refuses to run it */
long k2_contract(int what) {
    const long values[] = {PAGE, TILE, MAX_TOP_K, MAX_GROUPS, MAX_EXPERTS, MAX_THREADS, CODE_ZERO, sizeof(K2Lin),
                           sizeof(K2Dims), sizeof(K2Layer), sizeof(K2Model), sizeof(K2Pages)};
    return what >= 0 && what < (int)(sizeof values / sizeof values[0]) ? values[what] : -1;
}

#define FIELD(s, f) {#s "." #f, offsetof(s, f)}
static const struct { const char *name; size_t at; } FIELDS[] = {
    FIELD(K2Lin, w), FIELD(K2Lin, s), FIELD(K2Lin, n), FIELD(K2Lin, k), FIELD(K2Lin, block), FIELD(K2Lin, bits),
    FIELD(K2Dims, hidden), FIELD(K2Dims, heads), FIELD(K2Dims, nope), FIELD(K2Dims, rope), FIELD(K2Dims, v),
    FIELD(K2Dims, latent), FIELD(K2Dims, q_rank), FIELD(K2Dims, vocab), FIELD(K2Dims, top_k), FIELD(K2Dims, n_group),
    FIELD(K2Dims, topk_group), FIELD(K2Dims, normalise), FIELD(K2Dims, max_len), FIELD(K2Dims, eps),
    FIELD(K2Dims, softmax_scale), FIELD(K2Dims, rope_scale), FIELD(K2Dims, scaling),
    FIELD(K2Layer, in_norm), FIELD(K2Layer, q_norm), FIELD(K2Layer, kv_norm), FIELD(K2Layer, post_norm),
    FIELD(K2Layer, frequencies), FIELD(K2Layer, q_a), FIELD(K2Layer, q_b), FIELD(K2Layer, kv_a), FIELD(K2Layer, o),
    FIELD(K2Layer, w_uk), FIELD(K2Layer, w_uv), FIELD(K2Layer, uk_s), FIELD(K2Layer, uv_s), FIELD(K2Layer, moe),
    FIELD(K2Layer, experts), FIELD(K2Layer, width), FIELD(K2Layer, gate), FIELD(K2Layer, up), FIELD(K2Layer, down),
    FIELD(K2Layer, router), FIELD(K2Layer, bias), FIELD(K2Layer, fc1), FIELD(K2Layer, fc2), FIELD(K2Layer, fc1_s),
    FIELD(K2Layer, fc2_s), FIELD(K2Layer, block), FIELD(K2Layer, bits),
    FIELD(K2Model, d), FIELD(K2Model, layers), FIELD(K2Model, layer), FIELD(K2Model, embed), FIELD(K2Model, final_norm),
    FIELD(K2Model, head),
    FIELD(K2Pages, latent), FIELD(K2Pages, scale), FIELD(K2Pages, rope),
};

/* field i of the structs the library takes: its name ("K2Layer.w_uk") into *name -> its offset in bytes, -1 past
   the last: the ctypes mirrors are checked against these by name, so that two fields of one type swapped on either
   side do not pass */
long k2_field(int i, const char **name) {
    if (i < 0 || i >= (int)(sizeof FIELDS / sizeof FIELDS[0])) return -1;
    *name = FIELDS[i].name;
    return (long)FIELDS[i].at;
}

/* the int8 multiply-add peak of one thread at this level: `rounds` passes of PEAK_CHAINS independent dot4 chains
   (VBYTES multiply-adds each) over values held in registers -> a checksum (so that nothing is left out); the
   caller times it (benchmarks/prefill_peak.py) */
#define PEAK_CHAINS 16
long k2_dot4_peak(long rounds) {
    vi32 acc[PEAK_CHAINS];
    vu8 w = (vu8){0} + (uint8_t)(rounds | 1);
    vi8 x = (vi8){0} + (int8_t)3;
    for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = splat_i32(c);
    for (long i = 0; i < rounds; i++) {
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = dot4(acc[c], w, x);
        __asm__ volatile("" : "+x"(w), "+x"(x));  /* the operands stay unknown to the compiler: every dot4 runs */
    }
    long total = 0;
    for (int c = 0; c < PEAK_CHAINS; c++) total += sum_lanes(acc[c]);
    return total;
}

/* multiply-adds one k2_dot4_peak round takes */
long k2_dot4_peak_width(void) { return (long)PEAK_CHAINS * VBYTES; }

/* the instruction set the products were built for (runtime/backends/native/isa.h) */
const char *k2_isa(void) { return K2_ISA; }

/* hidden [batch, m] -> logits [batch, vocab]: the final norm and the head, its rows read once for the batch */
void k2_logits(const K2Model *m, int batch, const float *hidden, float *logits, float *scratch) {
    const K2Dims *d = &m->d;
    Bump b = step_scratch(m, scratch);
    begin_step();
    Held held = hold_cpu();
    one_product(&m->head, batch, quantize_rows(hidden, batch, d->hidden, m->final_norm, d->eps, m->head.block, &b),
                logits);
    release_cpu(&held);
}

#include "ops.c"
