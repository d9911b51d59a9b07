/* One decode step (one sequence, one new token) of a cpu-target artifact, over its own int8 weights.
 *
 * The maths of the artifact's graphs at batch 1, in their order and their quantisation (runtime/native_decode.py
 * says which graph op each part follows): int8 block weights stored as bytes code + 128 with one float32 scale per
 * block of the input dim (MatMulNBits, QMoE), activations quantised per block to int8 (absmax / 127) before each
 * product, the int8 latent cache read in place (one scale per token), W_UK and W_UV int8 per output column.
 * Products use AVX-512 VNNI where the compiler targets it (vpdpbusd: weight bytes x signed activation bytes,
 * the + 128 taken off with the block's activation sum), else a plain loop.
 *
 * Every product's rows (and the attention's heads) are split over a pool of threads that spin between the phases of
 * a step, yield while they wait, sleep after a while idle, and keep each to its own core (k2_pool_start). Shapes: m hidden, h heads, d nope dim, r rope dim, v value dim, c latent, t positions, e experts.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define K2_VNNI 1
#endif

#define PAGE 64
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MAX_THREADS 256
#define MAX_TOP_K 64      /* the routing's limits (runtime/native_decode.py checks a model against them) */
#define MAX_GROUPS 64
#define MAX_EXPERTS 4096
#define MAX_HEADS_PER_THREAD 16
#define SPIN_SECONDS 2e-3 /* a worker idle this long sleeps until the next phase */

/* ---- the model, as runtime/native_decode.py lays it out ------------------------------------------------ */

typedef struct { const uint8_t *w; const float *s; int n, k, block; } K2Lin; /* w [n, k], s [n, k / block] */

typedef struct {
    int hidden, heads, nope, rope, v, latent, q_rank, vocab, top_k, n_group, topk_group, normalise, max_len;
    float eps, softmax_scale, rope_scale, scaling;
} K2Dims;

typedef struct {
    const float *in_norm, *q_norm, *kv_norm, *post_norm, *frequencies; /* [m], [q_rank], [c], [m], [r / 2] */
    K2Lin q_a, q_b, kv_a, o;
    const uint8_t *w_uk, *w_uv;   /* W_UK^T [h, c, d], W_UV^T [h, v, c] as bytes code + 128 */
    const float *uk_s, *uv_s;     /* [h, c], [h, v] */
    int moe, experts, width;      /* dense: width = intermediate; MoE: width = expert width */
    K2Lin gate, up, down;         /* the dense MLP, or the shared expert (n = 0: none) */
    const float *router, *bias;   /* [e, m], [e] */
    const uint8_t *fc1, *fc2;     /* [e, 2 width, m] gate and up rows interleaved, [e, m, width] */
    const float *fc1_s, *fc2_s;   /* [e, 2 width, m / block], [e, m, width / block] */
    int block;                    /* the experts' block */
} K2Layer;

typedef struct {
    K2Dims d;
    int layers;
    const K2Layer *layer;
    const uint16_t *embed;        /* [vocab, m] bfloat16 */
    const float *final_norm;      /* [m] */
    K2Lin head;
} K2Model;

typedef struct {                  /* one layer's pools: [pages, PAGE, c] codes, [pages, PAGE] scales, [.., r] f16 */
    uint8_t *latent; float *scale; uint16_t *rope;
} K2Pages;

/* ---- the pool ------------------------------------------------------------------------------------------- */

typedef void (*Task)(void *arg, int tid, int threads);

static struct {
    int threads;
    int cpus[MAX_THREADS];  /* thread t's CPU; -1: not pinned */
    pthread_t ids[MAX_THREADS];
    atomic_int generation, done, sleeping, stop;
    Task task; void *arg;
    pthread_mutex_t lock; pthread_cond_t wake;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void pin(int cpu) {  /* the calling thread onto one CPU */
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
}

static void *worker(void *arg) {
    int tid = (int)(intptr_t)arg, seen = atomic_load(&pool.generation);
    if (pool.cpus[tid] >= 0) pin(pool.cpus[tid]);
    char name[16];
    snprintf(name, sizeof name, "k2-decode-%d", tid);
    pthread_setname_np(pthread_self(), name);  /* as top -H and /proc/PID/task/TID/comm show it */
    for (;;) {
        double idle_since = now();
        int spins = 0;
        while (atomic_load(&pool.generation) == seen) {
            if (++spins % 1024 == 0) sched_yield();  /* a thread that shares this core gets it */
            if (spins % 1024 == 0 && now() - idle_since > SPIN_SECONDS) {
                pthread_mutex_lock(&pool.lock);
                atomic_fetch_add(&pool.sleeping, 1);
                while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
                atomic_fetch_sub(&pool.sleeping, 1);
                pthread_mutex_unlock(&pool.lock);
            }
#ifdef K2_VNNI
            _mm_pause();
#endif
        }
        seen = atomic_load(&pool.generation);
        if (atomic_load(&pool.stop)) return NULL;
        pool.task(pool.arg, tid, pool.threads);
        atomic_fetch_add(&pool.done, 1);
    }
}

/* Starts `threads` - 1 workers (the caller is thread 0) -> the pool's size; a started pool keeps its size. cpus:
   thread t's CPU (distinct physical cores), or NULL: none pinned. Each worker keeps to its CPU; the thread that
   calls a step holds cpus[0] for the step's length (hold_cpu). A worker woken after a long idle gap otherwise
   tends to be placed on the caller's core, and the two then take turns there for the whole step. */
int k2_pool_start(int threads, const int *cpus) {
    if (pool.threads) return pool.threads;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int t = 0; t < threads; t++) pool.cpus[t] = cpus ? cpus[t] : -1;
    for (int t = 1; t < threads; t++)
        if (pthread_create(&pool.ids[t], NULL, worker, (void *)(intptr_t)t) != 0) { threads = t; break; }
    pool.threads = threads;
    return threads;
}

typedef struct { cpu_set_t before; int held; } Held;

static Held hold_cpu(void) {  /* the calling thread onto cpus[0] until release_cpu */
    Held h = {.held = 0};
    if (pool.threads > 1 && pool.cpus[0] >= 0 && sched_getaffinity(0, sizeof h.before, &h.before) == 0) {
        pin(pool.cpus[0]);
        h.held = 1;
    }
    return h;
}

static void release_cpu(Held *h) {
    if (h->held) sched_setaffinity(0, sizeof h->before, &h->before);
}

static void run(Task task, void *arg) {
    if (pool.threads <= 1) { task(arg, 0, 1); return; }
    pool.task = task; pool.arg = arg;
    atomic_store(&pool.done, 0);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add(&pool.generation, 1);
    if (atomic_load(&pool.sleeping)) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    task(arg, 0, pool.threads);
    for (int spins = 1; atomic_load(&pool.done) < pool.threads - 1; spins++) {
        if (spins % 1024 == 0) sched_yield();  /* a worker waiting for this core gets it */
#ifdef K2_VNNI
        _mm_pause();
#endif
    }
}

static void share(int count, int tid, int threads, int *start, int *stop) {
    *start = (int)((long)count * tid / threads); *stop = (int)((long)count * (tid + 1) / threads);
}

/* ---- activations and products --------------------------------------------------------------------------- */

typedef struct { int8_t *q; float *s; int32_t *sum; int k, block; } Quant; /* x [k] as int8 blocks */

static float largest_magnitude(const float *x, int n) {
    int i = 0;
    float absmax = 0;
#ifdef K2_VNNI
    __m512 m = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    absmax = _mm512_reduce_max_ps(m);
#endif
    for (; i < n; i++) absmax = MAX(absmax, fabsf(x[i]));
    return absmax;
}

/* x [k] -> int8 codes round(x / scale), scale = absmax / 127 per block, and each block's code sum */
static void quantize(const float *x, Quant *a) {
    for (int j = 0; j < a->k / a->block; j++) {
        const float *xb = x + j * a->block;
        int8_t *qb = a->q + j * a->block;
        float scale = largest_magnitude(xb, a->block) / 127.0f, inverse = scale > 0 ? 1.0f / scale : 0;
        int32_t sum = 0;
        int i = 0;
#ifdef K2_VNNI
        __m512i sums = _mm512_setzero_si512();
        for (; i + 16 <= a->block; i += 16) {  /* rounds to nearest even, as nearbyintf does */
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), _mm512_set1_ps(inverse)));
            q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
            _mm_storeu_si128((__m128i *)(qb + i), _mm512_cvtepi32_epi8(q));
            sums = _mm512_add_epi32(sums, q);
        }
        sum = _mm512_reduce_add_epi32(sums);
#endif
        for (; i < a->block; i++) {
            int q = (int)nearbyintf(xb[i] * inverse);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            qb[i] = (int8_t)q; sum += q;
        }
        a->s[j] = scale; a->sum[j] = sum;
    }
}

/* sum over blocks of (weight codes - 128) . activation codes, times both scales; w [k] one row, ws its scales */
static float row_dot(const uint8_t *w, const float *ws, const Quant *a) {
    float corr = 0;
    int blocks = a->k / a->block;
#ifdef K2_VNNI
    if (a->block % 64 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int j = 0; j < blocks; j++) {
            __m512i s = _mm512_setzero_si512();
            for (int i = j * a->block; i < (j + 1) * a->block; i += 64)
                s = _mm512_dpbusd_epi32(s, _mm512_loadu_si512(w + i), _mm512_loadu_si512(a->q + i));
            float scale = ws[j] * a->s[j];
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(scale), acc);
            corr += scale * (float)a->sum[j];
        }
        return _mm512_reduce_add_ps(acc) - 128.0f * corr;
    }
#endif
    float total = 0;
    for (int j = 0; j < blocks; j++) {
        int32_t s = 0;
        for (int i = j * a->block; i < (j + 1) * a->block; i++) s += (int32_t)w[i] * a->q[i];
        float scale = ws[j] * a->s[j];
        total += scale * (float)s;
        corr += scale * (float)a->sum[j];
    }
    return total - 128.0f * corr;
}

#define MAX_PARTS 80
typedef struct {            /* products that share one input, their rows taken as one run split over the threads */
    int parts;
    K2Lin lin[MAX_PARTS];
    const Quant *in[MAX_PARTS];
    float *out[MAX_PARTS];
} Products;

static void products_task(void *arg, int tid, int threads) {
    Products *p = arg;
    int total = 0;
    for (int i = 0; i < p->parts; i++) total += p->lin[i].n;
    int start, stop;
    share(total, tid, threads, &start, &stop);
    int base = 0;
    for (int i = 0; i < p->parts; i++) {
        const K2Lin *l = &p->lin[i];
        int lo = start > base ? start - base : 0, hi = stop - base < l->n ? stop - base : l->n;
        int blocks = l->k / l->block;
        for (int r = lo; r < hi; r++) p->out[i][r] = row_dot(l->w + (size_t)r * l->k, l->s + (size_t)r * blocks, p->in[i]);
        base += l->n;
    }
}

typedef struct {            /* y[r] = sum over parts of weight[i] * row r of part i (the MoE's down products) */
    int parts, rows;
    K2Lin lin[MAX_PARTS];
    const Quant *in[MAX_PARTS];
    float weight[MAX_PARTS];
    float *out;
} Mixed;

static void mixed_task(void *arg, int tid, int threads) {
    Mixed *p = arg;
    int start, stop;
    share(p->rows, tid, threads, &start, &stop);
    for (int r = start; r < stop; r++) p->out[r] = 0;
    for (int i = 0; i < p->parts; i++) {  /* part by part: each matrix's run of rows streams in order */
        const K2Lin *l = &p->lin[i];
        for (int r = start; r < stop; r++)
            p->out[r] += p->weight[i] * row_dot(l->w + (size_t)r * l->k, l->s + (size_t)r * (l->k / l->block), p->in[i]);
    }
}

/* ---- scratch -------------------------------------------------------------------------------------------- */

typedef struct { char *at; } Bump;
static void *take(Bump *b, size_t bytes) { void *p = b->at; b->at += (bytes + 63) / 64 * 64; return p; }
static Quant quant(Bump *b, int k, int block) {
    Quant a = {take(b, k), take(b, (k / block) * 4), take(b, (k / block) * 4), k, block};
    return a;
}

/* ---- pieces --------------------------------------------------------------------------------------------- */

static void rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    double squares = 0;
    for (int i = 0; i < n; i++) squares += (double)x[i] * x[i];
    float inverse = 1.0f / sqrtf((float)(squares / n) + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inverse * w[i];
}

/* interleaved pairs (x[2i], x[2i+1]) rotated by pos * frequency i, cos and sin scaled (export/rope.py) */
static void rope(float *x, int r, const float *frequencies, int pos, float scale) {
    for (int i = 0; i < r / 2; i++) {
        float angle = (float)pos * frequencies[i], c = cosf(angle) * scale, s = sinf(angle) * scale;
        float even = x[2 * i], odd = x[2 * i + 1];
        x[2 * i] = even * c - odd * s; x[2 * i + 1] = odd * c + even * s;
    }
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* a . b over n floats, in 16 lanes (a plain sum would chain every add on the one before) */
static float dot_f32(const float *a, const float *b, int n) {
    int i = 0;
    float total = 0;
#ifdef K2_VNNI
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    total = _mm512_reduce_add_ps(acc);
#else
    float lanes[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lanes[j] += a[i + j] * b[i + j];
    for (int j = 0; j < 8; j++) total += lanes[j];
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

static uint16_t to_half(float f) { _Float16 h = (_Float16)f; uint16_t bits; memcpy(&bits, &h, 2); return bits; }
static float from_bf16(uint16_t bits) { uint32_t u = (uint32_t)bits << 16; float f; memcpy(&f, &u, 4); return f; }

/* ---- attention over the int8 latent cache, a range of heads per thread ------------------------------------ */

typedef struct {
    const K2Dims *d; const K2Layer *l; const K2Pages *pages; const int64_t *table;
    int keys;                 /* positions 0 .. keys - 1, the new one included (already in its page) */
    const float *q;           /* [h, d + r]: q_nope, q_pe (roped) per head */
    float *out;               /* [h, v] */
    char *scratch; size_t per_thread;
} Attention;

/* sums [n, c] int32 (n <= MAX_HEADS_PER_THREAD) = the probability bytes p [n, keys] times the latent codes - 128 of each position, exact (as
   MatMulInteger sums them). A page of the cache at a time: its 64 rows stay in cache while each run of 16 latent
   columns goes through every head. With VNNI, four positions' bytes are interleaved so that one vpdpbusd adds four
   products to each of 16 columns. */
static void values(const Attention *a, int n, int keys, const uint8_t *p, int32_t *sums) {
    const K2Dims *d = a->d;
    int c_dim = d->latent;
    memset(sums, 0, (size_t)n * c_dim * 4);
    for (int t0 = 0; t0 < keys; t0 += PAGE) {
        int rows = keys - t0 < PAGE ? keys - t0 : PAGE;
        const uint8_t *page = a->pages->latent + (size_t)a->table[t0 / PAGE] * PAGE * c_dim;
#ifdef K2_VNNI
        if (c_dim % 16 == 0) {
            uint32_t words[MAX_HEADS_PER_THREAD][PAGE / 4];  /* each head's probability bytes, four positions a word */
            for (int j = 0; j < n; j++)
                for (int g = 0; g < PAGE / 4; g++) {
                    uint32_t w = 0;
                    for (int k = 0; k < 4; k++) {
                        int t = 4 * g + k;
                        w |= (uint32_t)(t < rows ? p[(size_t)j * keys + t0 + t] : 0) << (8 * k);
                    }
                    words[j][g] = w;
                }
            const __m128i flip = _mm_set1_epi8((char)0x80);
            for (int c = 0; c < c_dim; c += 16) {
                __m512i acc[MAX_HEADS_PER_THREAD];
                for (int j = 0; j < n; j++) acc[j] = _mm512_setzero_si512();
                for (int g = 0; g < (rows + 3) / 4; g++) {
                    __m128i r[4];
                    for (int k = 0; k < 4; k++) {  /* a missing position repeats the first: its probability is 0 */
                        int t = 4 * g + k < rows ? 4 * g + k : 4 * g;
                        r[k] = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(page + (size_t)t * c_dim + c)), flip);
                    }
                    __m128i lo01 = _mm_unpacklo_epi8(r[0], r[1]), hi01 = _mm_unpackhi_epi8(r[0], r[1]);
                    __m128i lo23 = _mm_unpacklo_epi8(r[2], r[3]), hi23 = _mm_unpackhi_epi8(r[2], r[3]);
                    __m512i quad = _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_set_m128i(_mm_unpackhi_epi16(lo01, lo23), _mm_unpacklo_epi16(lo01, lo23))),
                        _mm256_set_m128i(_mm_unpackhi_epi16(hi01, hi23), _mm_unpacklo_epi16(hi01, hi23)), 1);
                    for (int j = 0; j < n; j++)
                        acc[j] = _mm512_dpbusd_epi32(acc[j], _mm512_set1_epi32((int)words[j][g]), quad);
                }
                for (int j = 0; j < n; j++) {
                    int32_t *out = sums + (size_t)j * c_dim + c;
                    _mm512_storeu_si512(out, _mm512_add_epi32(_mm512_loadu_si512(out), acc[j]));
                }
            }
            continue;
        }
#endif
        for (int t = 0; t < rows; t++) {
            const uint8_t *codes = page + (size_t)t * c_dim;
            for (int j = 0; j < n; j++) {
                int32_t weight = p[(size_t)j * keys + t0 + t], *out = sums + (size_t)j * c_dim;
                if (weight)
                    for (int c = 0; c < c_dim; c++) out[c] += weight * ((int32_t)codes[c] - 128);
            }
        }
    }
}

/* sums [n] = one cached row's codes (bytes code + 128) times each head's quantised latent query, in integers; the
   row is loaded once for every head */
static void latent_dots(const uint8_t *codes, int c, const Quant *lat, int n, int32_t *sums) {
    for (int j0 = 0; j0 < n; j0 += MAX_HEADS_PER_THREAD) {
        int count = n - j0 < MAX_HEADS_PER_THREAD ? n - j0 : MAX_HEADS_PER_THREAD;
#ifdef K2_VNNI
        if (c % 64 == 0) {
            __m512i acc[MAX_HEADS_PER_THREAD];
            for (int j = 0; j < count; j++) acc[j] = _mm512_setzero_si512();
            for (int i = 0; i < c; i += 64) {
                __m512i row = _mm512_loadu_si512(codes + i);
                for (int j = 0; j < count; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], row, _mm512_loadu_si512(lat[j0 + j].q + i));
            }
            for (int j = 0; j < count; j++) sums[j0 + j] = _mm512_reduce_add_epi32(acc[j]);
            continue;
        }
#endif
        for (int j = 0; j < count; j++) {
            int32_t s = 0;
            for (int i = 0; i < c; i++) s += (int32_t)codes[i] * lat[j0 + j].q[i];
            sums[j0 + j] = s;
        }
    }
}

/* Each thread takes a run of heads and walks the cache once for all of them: a token's latent codes and rope key
   are read once per thread, not once per head. */
static void attention_task(void *arg, int tid, int threads) {
    Attention *a = arg;
    const K2Dims *d = a->d;
    int h0, h1;
    share(d->heads, tid, threads, &h0, &h1);
    int n = h1 - h0, keys = a->keys, qk = d->nope + d->rope;
    if (n <= 0) return;
    Bump b = {a->scratch + a->per_thread * tid};
    Quant nope = quant(&b, d->nope, d->nope), back = quant(&b, d->latent, d->latent);
    Quant *lat = take(&b, n * sizeof(Quant));
    for (int j = 0; j < n; j++) lat[j] = quant(&b, d->latent, d->latent);
    float *q_lat = take(&b, d->latent * 4), *scores = take(&b, (size_t)n * keys * 4);
    float *acc = take(&b, (size_t)n * d->latent * 4), *k_pe = take(&b, d->rope * 4);
    float *p_scale = take(&b, n * 4);
    int32_t *sums = take(&b, n * 4);
    uint8_t *p = take(&b, (size_t)n * keys);
    for (int j = 0; j < n; j++) {  /* q_nope through W_UK, per output column c; quantised per row */
        int h = h0 + j;
        quantize(a->q + (size_t)h * qk, &nope);
        for (int c = 0; c < d->latent; c++)
            q_lat[c] = row_dot(a->l->w_uk + ((size_t)h * d->latent + c) * d->nope, a->l->uk_s + (size_t)h * d->latent + c, &nope);
        quantize(q_lat, &lat[j]);
    }
    for (int t = 0; t < keys; t++) {
        size_t at = (size_t)a->table[t / PAGE] * PAGE + t % PAGE;
        const uint8_t *codes = a->pages->latent + at * d->latent;
        const _Float16 *rope_key = (const _Float16 *)(a->pages->rope + at * d->rope);
        float token_scale = a->pages->scale[at];
        for (int i = 0; i < d->rope; i++) k_pe[i] = (float)rope_key[i];
        latent_dots(codes, d->latent, lat, n, sums);
        for (int j = 0; j < n; j++) {  /* the integer product as MatMulInteger gives it, then the two scales */
            float latent_score = (float)(sums[j] - 128 * lat[j].sum[0]) * lat[j].s[0] * token_scale;
            float rope_score = dot_f32(a->q + (size_t)(h0 + j) * qk + d->nope, k_pe, d->rope);
            scores[(size_t)j * keys + t] = (latent_score + rope_score) * d->softmax_scale;
        }
    }
    for (int j = 0; j < n; j++) {  /* softmax; times each token's scale; quantised per row to bytes (absmax / 255) */
        float *s = scores + (size_t)j * keys, largest = -INFINITY, total = 0, p_max = 0;
        for (int t = 0; t < keys; t++) largest = MAX(largest, s[t]);
        for (int t = 0; t < keys; t++) { s[t] = expf(s[t] - largest); total += s[t]; }
        for (int t = 0; t < keys; t++) {
            s[t] = s[t] / total * a->pages->scale[(size_t)a->table[t / PAGE] * PAGE + t % PAGE];
            p_max = MAX(p_max, s[t]);
        }
        p_scale[j] = MAX(p_max / 255.0f, 1e-30f);
        float inverse = 1.0f / p_scale[j];
        for (int t = 0; t < keys; t++) p[(size_t)j * keys + t] = (uint8_t)nearbyintf(s[t] * inverse);
    }
    for (int j = 0; j < n; j += MAX_HEADS_PER_THREAD)
        values(a, n - j < MAX_HEADS_PER_THREAD ? n - j : MAX_HEADS_PER_THREAD, keys, p + (size_t)j * keys,
               (int32_t *)acc + (size_t)j * d->latent);
    for (int j = 0; j < n; j++) {  /* through W_UV, per output column v */
        int h = h0 + j;
        float *out = acc + (size_t)j * d->latent;
        const int32_t *sums = (const int32_t *)out;
        for (int c = 0; c < d->latent; c++) out[c] = (float)sums[c] * p_scale[j];
        quantize(out, &back);
        for (int i = 0; i < d->v; i++)
            a->out[(size_t)h * d->v + i] = row_dot(a->l->w_uv + ((size_t)h * d->v + i) * d->latent,
                                                   a->l->uv_s + (size_t)h * d->v + i, &back);
    }
}

/* ---- routing ---------------------------------------------------------------------------------------------- */

typedef struct { const float *router, *x; float *scores; int experts, hidden; } Router;

static void router_task(void *arg, int tid, int threads) {
    Router *r = arg;
    int start, stop;
    share(r->experts, tid, threads, &start, &stop);
    for (int e = start; e < stop; e++) {
        float s = dot_f32(r->x, r->router + (size_t)e * r->hidden, r->hidden);
        r->scores[e] = 1.0f / (1.0f + expf(-s));
    }
}

/* the k best of values (ties to the lower index) -> ids in order, best first */
static void top_k(const float *values, int n, int k, int *ids) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            int taken = 0;
            for (int m = 0; m < j; m++) taken |= ids[m] == i;
            if (!taken && (best < 0 || values[i] > values[best])) best = i;
        }
        ids[j] = best;
    }
}

static void route(const K2Dims *d, const float *scores, const float *bias, int experts, int *ids, float *weights) {
    float choice[MAX_EXPERTS];
    for (int e = 0; e < experts; e++) choice[e] = scores[e] + bias[e];
    if (d->n_group > 1) {
        int per = experts / d->n_group, kept[MAX_GROUPS];
        float group_score[MAX_GROUPS];
        for (int g = 0; g < d->n_group; g++) {
            int two[2];
            top_k(choice + g * per, per, 2, two);
            group_score[g] = choice[g * per + two[0]] + choice[g * per + two[1]];
        }
        top_k(group_score, d->n_group, d->topk_group, kept);
        for (int g = 0; g < d->n_group; g++) {
            int keep = 0;
            for (int j = 0; j < d->topk_group; j++) keep |= kept[j] == g;
            if (!keep) for (int e = g * per; e < (g + 1) * per; e++) choice[e] = -INFINITY;
        }
    }
    top_k(choice, experts, d->top_k, ids);
    float total = 0;
    for (int j = 0; j < d->top_k; j++) { weights[j] = scores[ids[j]]; total += weights[j]; }
    for (int j = 0; j < d->top_k; j++) weights[j] = (d->normalise ? weights[j] / (total + 1e-20f) : weights[j]) * d->scaling;
}

/* ---- the step ----------------------------------------------------------------------------------------------- */

/* one thread's attention scratch: its share of the heads (share() gives at most this many) */
static size_t attention_bytes(const K2Dims *d, int threads) {
    size_t h = (d->heads + threads - 1) / threads, quants = (h + 2) * (d->latent + 3 * 64) + d->nope + 3 * 64 + h * sizeof(Quant);
    return quants + (size_t)4 * (d->latent * (h + 2) + d->rope + 2 * h) + (size_t)5 * h * d->max_len + 64 * 18;
}

/* floats of scratch a step needs */
long k2_scratch_floats(const K2Model *m, int threads) {
    const K2Dims *d = &m->d;
    size_t widest = d->hidden;
    for (int i = 0; i < m->layers; i++) {
        const K2Layer *l = &m->layer[i];
        size_t rows = l->moe ? (size_t)2 * l->width * (d->top_k + 1) : (size_t)2 * l->width;
        if (rows > widest) widest = rows;
    }
    size_t bytes = 64 * 1024 + (size_t)32 * (d->hidden + d->q_rank + d->latent + d->rope) * 4 +
                   (size_t)8 * d->heads * (d->nope + d->rope + d->v) + widest * 16 +
                   (size_t)threads * attention_bytes(d, threads) + (size_t)4 * 4096;
    return (long)(bytes / 4 + 1);
}

static void mlp(const K2Dims *d, const K2Layer *l, const float *xn, float *y, Bump b) {
    Quant x = quant(&b, d->hidden, l->gate.n ? l->gate.block : l->block);
    quantize(xn, &x);
    int chosen[MAX_TOP_K]; float weights[MAX_TOP_K];
    int experts = 0;
    Products up = {0};
    float *gate_up[MAX_PARTS];
    if (l->moe) {
        float *scores = take(&b, l->experts * 4);
        Router r = {l->router, xn, scores, l->experts, d->hidden};
        run(router_task, &r);
        route(d, scores, l->bias, l->experts, chosen, weights);
        experts = d->top_k;
        Quant xe = quant(&b, d->hidden, l->block);
        quantize(xn, &xe);
        for (int j = 0; j < experts; j++) {
            size_t e = (size_t)chosen[j], rows = (size_t)2 * l->width;
            up.lin[up.parts] = (K2Lin){l->fc1 + e * rows * d->hidden, l->fc1_s + e * rows * (d->hidden / l->block),
                                       (int)rows, d->hidden, l->block};
            up.in[up.parts] = take(&b, sizeof(Quant)); *(Quant *)up.in[up.parts] = xe;
            gate_up[up.parts] = up.out[up.parts] = take(&b, rows * 4);
            up.parts++;
        }
    }
    int shared = up.parts;
    if (l->gate.n) {  /* the dense MLP, or the shared expert: gate and up */
        up.lin[up.parts] = l->gate; up.in[up.parts] = &x; up.out[up.parts++] = take(&b, l->gate.n * 4);
        up.lin[up.parts] = l->up; up.in[up.parts] = &x; up.out[up.parts++] = take(&b, l->up.n * 4);
    }
    run(products_task, &up);
    Mixed down = {0};
    down.rows = d->hidden; down.out = y;
    for (int j = 0; j < experts; j++) {  /* silu(gate) * up, quantised for the down product */
        float *h = take(&b, l->width * 4);
        for (int i = 0; i < l->width; i++) h[i] = silu(gate_up[j][2 * i]) * gate_up[j][2 * i + 1];
        Quant *q = take(&b, sizeof(Quant)); *q = quant(&b, l->width, l->block);
        quantize(h, q);
        size_t e = (size_t)chosen[j];
        down.lin[down.parts] = (K2Lin){l->fc2 + e * d->hidden * l->width,
                                       l->fc2_s + e * d->hidden * (l->width / l->block), d->hidden, l->width, l->block};
        down.in[down.parts] = q; down.weight[down.parts++] = weights[j];
    }
    if (l->gate.n) {
        int width = l->gate.n;
        float *h = take(&b, width * 4);
        for (int i = 0; i < width; i++) h[i] = silu(up.out[shared][i]) * up.out[shared + 1][i];
        Quant *q = take(&b, sizeof(Quant)); *q = quant(&b, width, l->down.block);
        quantize(h, q);
        down.lin[down.parts] = l->down; down.in[down.parts] = q; down.weight[down.parts++] = 1.0f;
    }
    run(mixed_task, &down);
}

static void layer_step(const K2Dims *d, const K2Layer *l, float *x, int pos, const K2Pages *pages,
                       const int64_t *table, Bump b, char *attention_scratch) {
    int m = d->hidden, heads = d->heads, qk = d->nope + d->rope;
    float *xn = take(&b, m * 4);
    rms_norm(x, l->in_norm, m, d->eps, xn);
    Quant xq = quant(&b, m, l->q_a.block);
    quantize(xn, &xq);
    float *q_a = take(&b, l->q_a.n * 4), *kv = take(&b, l->kv_a.n * 4);
    Products first = {2, {l->q_a, l->kv_a}, {&xq, &xq}, {q_a, kv}};
    run(products_task, &first);
    /* the new entry: latent normalised, quantised per token; rope key roped, float16; into its page */
    float *latent = take(&b, d->latent * 4);
    rms_norm(kv, l->kv_norm, d->latent, d->eps, latent);
    rope(kv + d->latent, d->rope, l->frequencies, pos, d->rope_scale);
    size_t row = (size_t)table[pos / PAGE] * PAGE + pos % PAGE;
    float absmax = 0;
    for (int c = 0; c < d->latent; c++) absmax = MAX(absmax, fabsf(latent[c]));
    float scale = MAX(absmax / 127.0f, 1e-12f);
    for (int c = 0; c < d->latent; c++) {
        float q = nearbyintf(latent[c] / scale);
        q = q > 127 ? 127 : q < -127 ? -127 : q;
        pages->latent[row * d->latent + c] = (uint8_t)(q + 128);
    }
    pages->scale[row] = scale;
    for (int i = 0; i < d->rope; i++) pages->rope[row * d->rope + i] = to_half(kv[d->latent + i]);
    /* the query */
    float *q_an = take(&b, l->q_a.n * 4), *q = take(&b, (size_t)heads * qk * 4);
    rms_norm(q_a, l->q_norm, l->q_a.n, d->eps, q_an);
    Quant qq = quant(&b, l->q_b.k, l->q_b.block);
    quantize(q_an, &qq);
    Products second = {1, {l->q_b}, {&qq}, {q}};
    run(products_task, &second);
    for (int h = 0; h < heads; h++) rope(q + (size_t)h * qk + d->nope, d->rope, l->frequencies, pos, d->rope_scale);
    float *attended = take(&b, (size_t)heads * d->v * 4);
    Attention a = {d, l, pages, table, pos + 1, q, attended, attention_scratch,
                   attention_bytes(d, pool.threads ? pool.threads : 1)};
    run(attention_task, &a);
    Quant oq = quant(&b, l->o.k, l->o.block);
    quantize(attended, &oq);
    float *o = take(&b, m * 4);
    Products third = {1, {l->o}, {&oq}, {o}};
    run(products_task, &third);
    for (int i = 0; i < m; i++) x[i] += o[i];
    rms_norm(x, l->post_norm, m, d->eps, xn);
    float *y = take(&b, m * 4);
    mlp(d, l, xn, y, b);
    for (int i = 0; i < m; i++) x[i] += y[i];
}

static Bump step_scratch(const K2Model *m, float *scratch) {
    int threads = pool.threads ? pool.threads : 1;
    Bump b = {(char *)scratch + (size_t)threads * attention_bytes(&m->d, threads)};
    b.at = (char *)(((uintptr_t)b.at + 63) / 64 * 64);
    return b;
}

/* layers first .. first + count - 1 of one token at position pos (the sequence holds pos entries): each layer's new
   entry into its page (table [pos / PAGE + 1] page ids; pages[i] the pools of layer first + i), hidden [m] in and
   out. scratch: k2_scratch_floats floats. Returns 0, or -1 on a bad argument. */
int k2_decode_layers(const K2Model *m, int first, int count, int pos, const int64_t *table, const K2Pages *pages,
                     float *hidden, float *scratch) {
    const K2Dims *d = &m->d;
    if (first < 0 || count < 0 || first + count > m->layers || pos < 0 || pos >= d->max_len) return -1;
    if (d->top_k > MAX_TOP_K || d->n_group > MAX_GROUPS || d->topk_group > MAX_GROUPS) return -1;
    for (int i = 0; i < count; i++)
        if (m->layer[first + i].moe && m->layer[first + i].experts > MAX_EXPERTS) return -1;
    Bump b = step_scratch(m, scratch);
    Held held = hold_cpu();
    for (int i = 0; i < count; i++)
        layer_step(d, &m->layer[first + i], hidden, pos, &pages[i], table, b, (char *)scratch);
    release_cpu(&held);
    return 0;
}

/* the embedding of token, then every layer (k2_decode_layers) */
int k2_decode_step(const K2Model *m, int token, int pos, const int64_t *table, const K2Pages *pages,
                   float *hidden, float *scratch) {
    const K2Dims *d = &m->d;
    if (token < 0 || token >= d->vocab) return -1;
    for (int i = 0; i < d->hidden; i++) hidden[i] = from_bf16(m->embed[(size_t)token * d->hidden + i]);
    return k2_decode_layers(m, 0, m->layers, pos, table, pages, hidden, scratch);
}

/* hidden [m] -> logits [vocab]: the final norm and the head */
void k2_logits(const K2Model *m, const float *hidden, float *logits, float *scratch) {
    const K2Dims *d = &m->d;
    Bump b = step_scratch(m, scratch);
    float *xn = take(&b, d->hidden * 4);
    rms_norm(hidden, m->final_norm, d->hidden, d->eps, xn);
    Quant xq = quant(&b, d->hidden, m->head.block);
    quantize(xn, &xq);
    Products head = {1, {m->head}, {&xq}, {logits}};
    Held held = hold_cpu();
    run(products_task, &head);
    release_cpu(&held);
}
