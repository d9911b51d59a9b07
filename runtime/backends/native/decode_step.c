/* One decode step (one new token for each of a batch of sequences) of a cpu-target artifact, over its own int8
 * weights.
 *
 * The maths of the artifact's graphs for each sequence, in their order and their quantisation (runtime/backends/native_decode.py
 * says which graph op each part follows): int8 block weights stored as bytes code + 128 with one float32 scale per
 * block of the input dim (MatMulNBits, QMoE), activations quantised per block to int8 (absmax / 127) before each
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
#include <sys/file.h>
#include <time.h>
#include "isa.h"

#define PAGE 64
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX_THREADS 256
#define MAX_TOP_K 64      /* the routing's limits (runtime/backends/native_decode.py checks a model against them) */
#define MAX_GROUPS 64
#define MAX_EXPERTS 4096
#define HEAD_GROUP (VBYTES == 64 ? 16 : 8)  /* heads that share one pass of latent_dots() over a cached row */
#define SPIN_SECONDS 2e-3 /* a worker idle this long sleeps until the next phase */
#define STARVED_SECONDS 1e-3 /* the caller waiting this much longer than its own share took: a worker had no core */
#define QUIET_SECONDS 0.01  /* and then nobody spins for this long, doubled for each starved wait that follows */
#define QUIET_DOUBLINGS 7   /* within the last quiet time or soon after (at most 1.28 s) */
#define LEASE_IDLE_SECONDS 0.05  /* a process that ran no step for this long gives its cores' leases back */

/* ---- the model, as the artifact holds it (core/native_tiles.py) and runtime/backends/native_decode.py maps it ---- */

#define TILE 64  /* weight rows laid out together: one int8 dot instruction per 16 of them, no horizontal sum */
/* n rows of k inputs in tiles of TILE rows (the last padded with zero rows), s [tiles(n), k / block, TILE] the block
   scales. bits 8: w [tiles(n), k / 4, TILE, 4] bytes code + 128, each tile's four consecutive inputs of its rows side
   by side; bits 4: w [tiles(n), k / 8, TILE, 4], each tile's four consecutive bytes of its rows side by side, a byte
   two 4-bit codes (value + 8), the lower input in the low nibble: inputs 8 i, 8 i + 2, 8 i + 4, 8 i + 6 in the low
   nibbles of a row's four bytes, 8 i + 1, ..., 8 i + 7 in the high ones (their activations go in that order: by_nibbles) */
typedef struct { const uint8_t *w; const float *s; int n, k, block, bits; } K2Lin;
static size_t tiles(int n) { return (size_t)(n + TILE - 1) / TILE; }

typedef struct {
    int hidden, heads, nope, rope, v, latent, q_rank, vocab, top_k, n_group, topk_group, normalise, max_len;
    float eps, softmax_scale, rope_scale, scaling;
} K2Dims;

typedef struct {
    const float *in_norm, *q_norm, *kv_norm, *post_norm, *frequencies; /* [m], [q_rank], [c], [m], [r / 2] */
    K2Lin q_a, q_b, kv_a, o;
    const uint8_t *w_uk, *w_uv;   /* W_UK [h, d / 4, c, 4], W_UV [h, c / 4, v, 4] (core/native_tiles.py four_rows), bytes code + 128 */
    const float *uk_s, *uv_s;     /* [h, c], [h, v] */
    int moe, experts, width;      /* dense: width = intermediate; MoE: width = expert width */
    K2Lin gate, up, down;         /* the dense MLP, or the shared expert (n = 0: none) */
    const float *router, *bias;   /* [e, m], [e] */
    const uint8_t *fc1, *fc2;     /* per expert a K2Lin's tiles: 2 width rows (gate and up interleaved) of m, m of width */
    const float *fc1_s, *fc2_s;   /* and their scales */
    int block, bits;              /* the experts' block (or 4-bit group), and 8 or 4 bits a weight (K2Lin) */
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
    int active;             /* the threads of the current step (begin_step): one a leased core, or 1 while quiet */
    int cpus[MAX_THREADS];  /* thread t's CPU as the pool started; -1: not pinned */
    int leases[MAX_THREADS];  /* the lock file of cpus[t]'s core, or -1: the core is not shared by leases */
    int held[MAX_THREADS];    /* whether this process holds leases[t] (under lock) */
    int place[MAX_THREADS];   /* thread t's CPU in the current step (the held cores in order); -1: not pinned */
    int pinned[MAX_THREADS];  /* the CPU thread t is pinned to now, its own */
    atomic_int in_step;
    _Atomic double step_ended;
    pthread_t ids[MAX_THREADS];
    atomic_int generation, done, sleeping, stop, caller_sleeps;
    int streak;             /* starved waits in a row (each within a quiet time of the last), the caller's own */
    _Atomic double quiet_until;  /* before this time waits do not spin: a worker lately went without a core */
    Task task; void *arg;
    pthread_mutex_t lock; pthread_cond_t wake, finished;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .finished = PTHREAD_COND_INITIALIZER};

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void pin(int cpu) {  /* the calling thread onto one CPU */
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
}

static int may_spin(double at) { return at >= atomic_load(&pool.quiet_until); }

/* ---- the cores' leases (under pool.lock) ---- */

static int take_lease(int t) {
    if (!pool.held[t] && pool.leases[t] >= 0 && flock(pool.leases[t], LOCK_EX | LOCK_NB) == 0) pool.held[t] = 1;
    return pool.held[t];
}

static void give_back_leases(int keep) {  /* every lease but thread keep's (-1: all) */
    for (int t = 0; t < pool.threads; t++)
        if (pool.held[t] && t != keep) { flock(pool.leases[t], LOCK_UN); pool.held[t] = 0; }
}

/* worker 1's sleep, under pool.lock, while the process holds leases -> 1 after a timed wait (the caller looks
   again), 0 where it holds none (the caller waits until woken). Where no step runs and none ran for
   LEASE_IDLE_SECONDS, the leases go back: another process may decode on those cores. */
static int idle_wait(void) {
    int any = 0;
    for (int t = 0; t < pool.threads; t++) any |= pool.held[t];
    if (!any) return 0;
    double at = now(), until = atomic_load(&pool.step_ended) + LEASE_IDLE_SECONDS;
    if (at >= until && !atomic_load(&pool.in_step)) {
        give_back_leases(-1);
        return 0;
    }
    double wait = at < until ? until - at : LEASE_IDLE_SECONDS;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);  /* the condition's clock */
    long nanos = deadline.tv_nsec + (long)(wait * 1e9);
    deadline.tv_sec += nanos / 1000000000L;
    deadline.tv_nsec = nanos % 1000000000L;
    pthread_cond_timedwait(&pool.wake, &pool.lock, &deadline);
    return 1;
}

static void *worker(void *arg) {
    int tid = (int)(intptr_t)arg, seen = 0;  /* the generation at the pool's start: read here instead, a phase
                                                started before this thread first ran would be missed */
    if (pool.cpus[tid] >= 0) pin(pool.cpus[tid]);
    pool.pinned[tid] = pool.cpus[tid];
    char name[16];
    snprintf(name, sizeof name, "k2-decode-%d", tid);
    pthread_setname_np(pthread_self(), name);  /* as top -H and /proc/PID/task/TID/comm show it */
    for (;;) {
        double idle_since = now();
        for (int spins = 1; atomic_load(&pool.generation) == seen; spins++) {
            if (spins % 1024 == 0) sched_yield();  /* a thread that shares this core gets it */
            if (spins % 256 == 0) {
                double at = now();
                if (tid >= pool.active || !may_spin(at) || at - idle_since > SPIN_SECONDS) {
                    pthread_mutex_lock(&pool.lock);
                    atomic_fetch_add(&pool.sleeping, 1);
                    while (atomic_load(&pool.generation) == seen)
                        if (tid != 1 || !idle_wait()) pthread_cond_wait(&pool.wake, &pool.lock);  /* worker 1 keeps the leases' time */
                    atomic_fetch_sub(&pool.sleeping, 1);
                    pthread_mutex_unlock(&pool.lock);
                }
            }
            cpu_relax();
        }
        seen = atomic_load(&pool.generation);
        if (atomic_load(&pool.stop)) return NULL;
        if (tid >= pool.active) continue;  /* not in this step (set before the generation moved) */
        if (pool.place[tid] != pool.pinned[tid] && pool.place[tid] >= 0) {  /* the step's cores changed */
            pin(pool.place[tid]);
            pool.pinned[tid] = pool.place[tid];
        }
        pool.task(pool.arg, tid, pool.active);
        if (atomic_fetch_add(&pool.done, 1) == pool.active - 2 && atomic_load(&pool.caller_sleeps)) {
            pthread_mutex_lock(&pool.lock);  /* the caller sleeps (or is about to, under the lock): wake it */
            pthread_cond_signal(&pool.finished);
            pthread_mutex_unlock(&pool.lock);
        }
    }
}

/* Starts `threads` - 1 workers (the caller is thread 0), at most as many threads as the process has CPUs -> the
   pool's size; a started pool keeps its size. cpus: thread t's CPU (distinct physical cores), or NULL: none pinned.
   leases: the open lock file of cpus[t]'s core, shared with the host's other processes of this project, or NULL:
   every core the process's own. A step runs on the cores whose leases the process holds (taken at each step's start
   where free, given back after LEASE_IDLE_SECONDS without a step or, all but one, when a worker went without a
   core), each thread on its own; the thread that calls a step holds its core for the step's length (hold_cpu). A
   worker woken after a long idle gap otherwise tends to be placed on the caller's core, and the two then take turns
   there for the whole step. */
int k2_pool_start(int threads, const int *cpus, const int *leases) {
    if (pool.threads) return pool.threads;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    cpu_set_t allowed;  /* more threads than the process's CPUs would only take turns on them */
    if (sched_getaffinity(0, sizeof allowed, &allowed) == 0 && CPU_COUNT(&allowed) < threads) threads = CPU_COUNT(&allowed);
    for (int t = 0; t < threads; t++) {
        pool.cpus[t] = pool.place[t] = cpus ? cpus[t] : -1;
        pool.leases[t] = leases && threads > 1 && pool.cpus[t] >= 0 ? leases[t] : -1;
    }
    for (int t = 1; t < threads; t++)
        if (pthread_create(&pool.ids[t], NULL, worker, (void *)(intptr_t)t) != 0) { threads = t; break; }
    pool.threads = threads;
    return threads;
}

/* the threads a step runs on: one a core the process holds (taking the free leases first), or the caller alone
   while a worker lately went without a core (a busy host: no step waits on a thread that has no core) or where
   other processes hold every core; the results do not depend on the number of threads */
static void begin_step(void) {
    atomic_store(&pool.in_step, 1);
    if (pool.threads <= 1) { pool.active = 1; return; }
    int quiet = now() < atomic_load(&pool.quiet_until), count = 0;
    pthread_mutex_lock(&pool.lock);
    for (int t = 0; t < pool.threads; t++)  /* while quiet, one core: the first the process holds or can take */
        if (pool.leases[t] < 0 || ((!quiet || count == 0) && take_lease(t))) pool.place[count++] = pool.cpus[t];
    pthread_mutex_unlock(&pool.lock);
    pool.active = quiet ? 1 : MAX(count, 1);
}

typedef struct { cpu_set_t before; int held; } Held;

static Held hold_cpu(void) {  /* the calling thread onto the step's first core until release_cpu, in a step of
                                 several threads (a step of the caller alone goes wherever the system finds a core) */
    Held h = {.held = 0};
    if (pool.active > 1 && pool.place[0] >= 0 && sched_getaffinity(0, sizeof h.before, &h.before) == 0) {
        pin(pool.place[0]);
        h.held = 1;
    }
    return h;
}

static void release_cpu(Held *h) {  /* and the step's end */
    if (h->held) sched_setaffinity(0, sizeof h->before, &h->before);
    atomic_store(&pool.step_ended, now());
    atomic_store(&pool.in_step, 0);
}

/* the leases of this process and the threads of its last step: bit t of *held for leases[t] -> active threads */
int k2_pool_leases(int *held) {
    int mask = 0;
    pthread_mutex_lock(&pool.lock);
    for (int t = 0; t < pool.threads && t < 31; t++) mask |= pool.held[t] << t;
    pthread_mutex_unlock(&pool.lock);
    *held = mask;
    return pool.active;
}

/* a worker went without a core: nobody spins for QUIET_SECONDS, twice that if it happened in the last quiet time
   (or as long after it), and so on up to QUIET_DOUBLINGS times: one late wake-up (an interrupt, the host taking the
   core a moment) costs 10 ms of sleeping waits, a host with more threads than cores keeps them sleeping */
static void starved(double at) {
    pthread_mutex_lock(&pool.lock);  /* the cores but one go back: a process beside this one may hold them */
    int keep = 0;
    while (keep < pool.threads && !pool.held[keep]) keep++;
    give_back_leases(keep);
    pthread_mutex_unlock(&pool.lock);
    double until = atomic_load(&pool.quiet_until), quiet = QUIET_SECONDS * (1 << MIN(pool.streak, QUIET_DOUBLINGS));
    pool.streak = at < until + quiet ? pool.streak + 1 : 0;
    atomic_store(&pool.quiet_until, at + QUIET_SECONDS * (1 << MIN(pool.streak, QUIET_DOUBLINGS)));
}

/* the caller's wait for the workers: spins while spinning is allowed, else (or once a worker has gone without a
   core for a while: starved) sleeps until the last one wakes it */
static void wait_for_workers(double own_seconds) {
    double since = now();
    for (int spins = 1; atomic_load(&pool.done) < pool.active - 1; spins++) {
        if (spins % 1024 == 0) sched_yield();  /* a worker waiting for this core gets it */
        if (spins % 256 == 0) {
            double at = now();
            if (at - since > own_seconds + STARVED_SECONDS) starved(at);
            if (!may_spin(at)) {
                pthread_mutex_lock(&pool.lock);
                atomic_store(&pool.caller_sleeps, 1);  /* before done is read again: the last worker then wakes it */
                while (atomic_load(&pool.done) < pool.active - 1) pthread_cond_wait(&pool.finished, &pool.lock);
                atomic_store(&pool.caller_sleeps, 0);
                pthread_mutex_unlock(&pool.lock);
                double woken = now();
                if (woken - since > own_seconds + STARVED_SECONDS) starved(woken);  /* still no core for them */
                return;
            }
        }
        cpu_relax();
    }
}

static void run(Task task, void *arg) {
    if (pool.active <= 1) { task(arg, 0, 1); return; }
    pool.task = task; pool.arg = arg;
    atomic_store(&pool.done, 0);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add(&pool.generation, 1);
    if (atomic_load(&pool.sleeping)) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    double started = now();
    task(arg, 0, pool.active);
    wait_for_workers(now() - started);
}

static void share(int count, int tid, int threads, int *start, int *stop) {
    *start = (int)((long)count * tid / threads); *stop = (int)((long)count * (tid + 1) / threads);
}

/* ---- activations and products --------------------------------------------------------------------------- */

typedef struct { int8_t *q; float *s; int32_t *sum; int k, block; } Quant; /* x [k] as int8 blocks */

typedef int8_t vq8 __attribute__((vector_size(LANES)));  /* LANES int8 codes: a vf32's lanes narrowed */

static inline vi32 pick(vi32 mask, vi32 yes, vi32 no) { return (yes & mask) | (no & ~mask); }

/* the largest |x[i]| (for finite x; the order of the comparisons is fixed, so any x gives one answer) */
static float largest_magnitude(const float *x, int n) {
    float absmax = 0;
    int i = 0;
    if (n >= LANES) {
        vi32 most = {0};
        for (; i + LANES <= n; i += LANES) {
            vi32 magnitude = (vi32)load_f32(x + i) & 0x7fffffff;
            most = pick((vf32)magnitude > (vf32)most, magnitude, most);
        }
        for (int j = 0; j < LANES; j++) absmax = MAX(absmax, ((vf32)most)[j]);
    }
    for (; i < n; i++) absmax = MAX(absmax, fabsf(x[i]));
    return absmax;
}

#define ROUNDER 12582912.0f  /* 1.5 x 2^23: v + ROUNDER - ROUNDER is v rounded to the nearest integer, ties to even, for
                                |v| < 2^22, as nearbyintf rounds (a product over absmax / 127 is at most 127 and a bit) */

/* codes [n] = round(x [n] x inverse), clipped to [lowest, highest], as bytes (int8 codes: -127 .. 127; probability
   bytes: 0 .. 255); -> their sum */
static int32_t round_codes(const float *x, int n, float inverse, int lowest, int highest, uint8_t *codes) {
    int32_t sum = 0;
    int i = 0;
    const vf32 by = (vf32){0} + inverse, rounder = (vf32){0} + ROUNDER;
    vi32 total = {0};
    for (; i + LANES <= n; i += LANES) {
        vi32 q = __builtin_convertvector((load_f32(x + i) * by + rounder) - rounder, vi32);
        q = pick(q > highest, splat_i32(highest), q);
        q = pick(q < lowest, splat_i32(lowest), q);
        total += q;
        vq8 bytes = __builtin_convertvector(q, vq8);  /* each lane's low byte */
        memcpy(codes + i, &bytes, LANES);
    }
    for (int j = 0; j < LANES; j++) sum += total[j];
    for (; i < n; i++) {
        int q = (int)nearbyintf(x[i] * inverse);
        q = q > highest ? highest : q < lowest ? lowest : q;
        codes[i] = (uint8_t)q; sum += q;
    }
    return sum;
}

/* x [k] -> int8 codes round(x / scale) (to nearest, ties to even), scale = absmax / 127 per block, and each block's
   code sum */
static void quantize(const float *x, Quant *a) {
    for (int j = 0; j < a->k / a->block; j++) {
        float scale = largest_magnitude(x + j * a->block, a->block) / 127.0f, inverse = scale > 0 ? 1.0f / scale : 0;
        a->sum[j] = round_codes(x + j * a->block, a->block, inverse, -127, 127, (uint8_t *)a->q + j * a->block);
        a->s[j] = scale;
    }
}

#define TILE_VECTORS (TILE * 4 / VBYTES)  /* vectors that hold one group of four inputs of a tile's rows */

/* y [TILE]: one tile's rows times one input, w [k / 4, TILE, 4] and ws [k / block, TILE] (K2Lin): per block, the
   integer sum of (weight codes - 128) x activation codes, exact, then times both scales, summed in block order;
   each vector lane is one row, so no sum crosses lanes */
static void tile_dot(const uint8_t *w, const float *ws, const Quant *a, float *y) {
    int blocks = a->k / a->block, quads = a->block / 4;
    vf32 acc[TILE_VECTORS];
    for (int v = 0; v < TILE_VECTORS; v++) acc[v] = (vf32){0};
    for (int j = 0; j < blocks; j++) {
        vi32 sum[TILE_VECTORS];
        for (int v = 0; v < TILE_VECTORS; v++) sum[v] = (vi32){0};
        for (int g = j * quads; g < (j + 1) * quads; g++) {
            vi8 x = splat4(a->q + 4 * g);
            const uint8_t *rows = w + (size_t)g * TILE * 4;
            for (int v = 0; v < TILE_VECTORS; v++) sum[v] = dot4(sum[v], load_u8(rows + VBYTES * v), x);
        }
        int32_t bias = DOT_BIAS * a->sum[j];
        float scale = a->s[j];
        for (int v = 0; v < TILE_VECTORS; v++)
            acc[v] += __builtin_convertvector(sum[v] - bias, vf32) * (load_f32(ws + (size_t)j * TILE + LANES * v) * scale);
    }
    for (int v = 0; v < TILE_VECTORS; v++) store_f32(y + LANES * v, acc[v]);
}

#define INPUT_BLOCK (VBYTES == 64 ? 4 : 2)  /* inputs tile_dot_inputs() takes at once */

/* tile_dot for INPUT_BLOCK inputs at once, y[i] [TILE] input i's: each weight vector is loaded once for all of
   them (a batch's or a prompt's tokens), and each input's sums and float steps are exactly tile_dot's */
static void tile_dot_inputs(const uint8_t *w, const float *ws, const Quant *a, float *const *y) {
    int blocks = a[0].k / a[0].block, quads = a[0].block / 4;
    for (int i = 0; i < INPUT_BLOCK; i++) memset(y[i], 0, TILE * sizeof(float));
    for (int j = 0; j < blocks; j++) {
        vi32 sum[TILE_VECTORS][INPUT_BLOCK];
        for (int v = 0; v < TILE_VECTORS; v++)
            for (int i = 0; i < INPUT_BLOCK; i++) sum[v][i] = (vi32){0};
        for (int g = j * quads; g < (j + 1) * quads; g++) {
            vi8 x[INPUT_BLOCK];
            for (int i = 0; i < INPUT_BLOCK; i++) x[i] = splat4(a[i].q + 4 * g);
            const uint8_t *rows = w + (size_t)g * TILE * 4;
            for (int v = 0; v < TILE_VECTORS; v++) {
                vu8 weights = load_u8(rows + VBYTES * v);
                for (int i = 0; i < INPUT_BLOCK; i++) sum[v][i] = dot4(sum[v][i], weights, x[i]);
            }
        }
        for (int i = 0; i < INPUT_BLOCK; i++) {
            int32_t bias = DOT_BIAS * a[i].sum[j];
            float scale = a[i].s[j];
            for (int v = 0; v < TILE_VECTORS; v++) {
                vf32 acc = load_f32(y[i] + LANES * v);
                acc += __builtin_convertvector(sum[v][i] - bias, vf32) * (load_f32(ws + (size_t)j * TILE + LANES * v) * scale);
                store_f32(y[i] + LANES * v, acc);
            }
        }
    }
}

/* a 4-bit product's activations in the order of the codes' nibbles (K2Lin bits 4): each eight inputs' even ones, then
   their odd ones; a block's sum does not change */
static void by_nibbles(Quant *a) {
    for (int i = 0; i < a->k; i += 8) {
        int8_t run[8];
        for (int j = 0; j < 4; j++) { run[j] = a->q[i + 2 * j]; run[4 + j] = a->q[i + 2 * j + 1]; }
        memcpy(a->q + i, run, 8);
    }
}

/* tile_dot over 4-bit codes (K2Lin bits 4), activations by_nibbles: per group, the integer sum of codes x activation
   codes, less 8 x the group's activation sum (the zero point), exact, then times both scales, summed in group order */
static void tile_dot_int4(const uint8_t *w, const float *ws, const Quant *a, float *y) {
    int groups = a->k / a->block, pairs = a->block / 8;
    vf32 acc[TILE_VECTORS];
    for (int v = 0; v < TILE_VECTORS; v++) acc[v] = (vf32){0};
    for (int j = 0; j < groups; j++) {
        vi32 sum[TILE_VECTORS];
        for (int v = 0; v < TILE_VECTORS; v++) sum[v] = (vi32){0};
        for (int g = j * pairs; g < (j + 1) * pairs; g++) {
            vi8 low = splat4(a->q + 8 * g), high = splat4(a->q + 8 * g + 4);
            const uint8_t *rows = w + (size_t)g * TILE * 4;
            for (int v = 0; v < TILE_VECTORS; v++) {
                vu8 codes = load_u8(rows + VBYTES * v);
                sum[v] = dot4_small(dot4_small(sum[v], codes & 0x0F, low), codes >> 4, high);
            }
        }
        int32_t zero = 8 * a->sum[j];
        float scale = a->s[j];
        for (int v = 0; v < TILE_VECTORS; v++)
            acc[v] += __builtin_convertvector(sum[v] - zero, vf32) * (load_f32(ws + (size_t)j * TILE + LANES * v) * scale);
    }
    for (int v = 0; v < TILE_VECTORS; v++) store_f32(y + LANES * v, acc[v]);
}

#define COLUMN_VECTORS 8  /* vectors of columns columns_product() takes in one pass */

/* columns j0 .. j0 + count LANES - 1 of columns_product(); count a constant where it is called, so that the
   accumulators stay in registers */
static inline __attribute__((always_inline)) void columns_pass(const uint8_t *w, const float *ws, int n,
                                                                const Quant *a, float *y, int j0, const int count) {
    vi32 acc[COLUMN_VECTORS];
    for (int v = 0; v < count; v++) acc[v] = (vi32){0};
    for (int g = 0; g < a->k / 4; g++) {
        vi8 x = splat4(a->q + 4 * g);
        const uint8_t *rows = w + ((size_t)g * n + j0) * 4;
        for (int v = 0; v < count; v++) acc[v] = dot4(acc[v], load_u8(rows + VBYTES * v), x);
    }
    int32_t bias = DOT_BIAS * a->sum[0];
    for (int v = 0; v < count; v++)
        store_f32(y + j0 + LANES * v, __builtin_convertvector(acc[v] - bias, vf32) *
                                      (load_f32(ws + j0 + LANES * v) * a->s[0]));
}

/* y [n] = x times w, a [k, n] matrix with one block of k per output column, stored four rows interleaved: [k / 4, n,
   4], bytes code + 128, column scales ws [n] (the absorbed W_UK and W_UV): y[j] = (sum_i (w[i, j] - 128) q[i]) *
   ws[j] * scale. One dot4 adds four rows' products to a vector of columns, and no sum crosses lanes. */
static void columns_product(const uint8_t *w, const float *ws, int n, const Quant *a, float *y) {
    int k = a->k;
    if (n % LANES == 0 && k % 4 == 0) {
        int j0 = 0;
        for (; j0 + COLUMN_VECTORS * LANES <= n; j0 += COLUMN_VECTORS * LANES) columns_pass(w, ws, n, a, y, j0, COLUMN_VECTORS);
        for (; j0 < n; j0 += LANES) columns_pass(w, ws, n, a, y, j0, 1);
        return;
    }
    int32_t corr = 128 * a->sum[0];
    for (int j = 0; j < n; j++) {
        int32_t sum = 0;
        for (int i = 0; i < k; i++) sum += (int32_t)w[((size_t)(i / 4) * n + j) * 4 + i % 4] * a->q[i];
        y[j] = (float)(sum - corr) * (ws[j] * a->s[0]);
    }
}

typedef struct {            /* products whose rows are taken as one run split over the threads: each row of part i
                               times each of the part's count[i] inputs (a row is read once for all of them) */
    int parts;
    const K2Lin *lin;         /* [parts] */
    const int *count;         /* [parts] */
    const Quant *const *in;   /* [parts] -> [count[i]] */
    float *const *out;        /* [parts] -> [count[i], lin[i].n] */
} Products;

static void products_task(void *arg, int tid, int threads) {
    const Products *p = arg;
    int total = 0;
    for (int i = 0; i < p->parts; i++) total += (int)tiles(p->lin[i].n);
    int start, stop;
    share(total, tid, threads, &start, &stop);
    float y[TILE];
    int base = 0;
    for (int i = 0; i < p->parts; i++) {  /* part by part: each matrix's run of tiles streams in order */
        const K2Lin *l = &p->lin[i];
        int count = (int)tiles(l->n), lo = start > base ? start - base : 0, hi = stop - base < count ? stop - base : count;
        for (int t = lo; t < hi; t++) {
            const uint8_t *w = l->w + (size_t)t * TILE * l->k / (8 / l->bits);
            const float *ws = l->s + (size_t)t * TILE * (l->k / l->block);
            int rows = MIN(TILE, l->n - t * TILE);
            int j = 0;
            if (l->bits == 8 && rows == TILE)  /* inputs INPUT_BLOCK at a time, each weight loaded once for them */
                for (; j + INPUT_BLOCK <= p->count[i]; j += INPUT_BLOCK) {
                    float *outs[INPUT_BLOCK];
                    for (int b = 0; b < INPUT_BLOCK; b++) outs[b] = p->out[i] + (size_t)(j + b) * l->n + (size_t)t * TILE;
                    tile_dot_inputs(w, ws, &p->in[i][j], outs);
                }
            for (; j < p->count[i]; j++) {
                float *out = p->out[i] + (size_t)j * l->n + (size_t)t * TILE, *into = rows == TILE ? out : y;
                if (l->bits == 4) tile_dot_int4(w, ws, &p->in[i][j], into);
                else tile_dot(w, ws, &p->in[i][j], into);
                if (into != out) memcpy(out, y, rows * sizeof(float));
            }
        }
        base += count;
    }
}

typedef struct {            /* y [batch, rows]: y[s, r] = sum over t of weight[s, t] * term[s, t][r], t in order */
    int batch, rows, terms;
    const float *const *term; /* [batch, terms] -> [rows] */
    const float *weight;      /* [batch, terms] */
    float *y;
} Combine;

static void combine_task(void *arg, int tid, int threads) {
    const Combine *c = arg;
    int start, stop;
    share(c->rows, tid, threads, &start, &stop);
    for (int s = 0; s < c->batch; s++)
        for (int r = start; r < stop; r++) {
            float y = 0;
            for (int t = 0; t < c->terms; t++) y += c->weight[s * c->terms + t] * c->term[s * c->terms + t][r];
            c->y[(size_t)s * c->rows + r] = y;
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

/* a . b over n floats, a vector of lanes at a time (a plain sum would chain every add on the one before) */
static float dot_f32(const float *a, const float *b, int n) {
    int i = 0;
    vf32 acc = {0};
    for (; i + LANES <= n; i += LANES) acc += load_f32(a + i) * load_f32(b + i);
    float total = 0;
    for (int j = 0; j < LANES; j++) total += acc[j];
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

static uint16_t to_half(float f) { _Float16 h = (_Float16)f; uint16_t bits; memcpy(&bits, &h, 2); return bits; }
static float from_bf16(uint16_t bits) { uint32_t u = (uint32_t)bits << 16; float f; memcpy(&f, &u, 4); return f; }

/* ---- attention over the int8 latent cache ----------------------------------------------------------------
   Six phases, each split over the pool: the absorbed queries and, at the end, W_UV take a run of heads each; the
   scores, their exponentials, the probabilities and the probability bytes times the cache take a run of positions
   each, so that the cache is read once whatever the number of threads. Every sum whose order a split could change
   is taken per CHUNK positions and then chunk by chunk, and the value sums are integers: the number of threads
   changes nothing in the result. */

#define CHUNK 16  /* positions: the unit the position phases are split in (a divisor of PAGE) */

typedef struct {
    const K2Dims *d; const K2Layer *l; const K2Pages *pages; const int64_t *table;
    int keys;                 /* positions 0 .. keys - 1, the new one included (already in its page) */
    const float *q;           /* [h, d + r]: q_nope, q_pe (roped) per head */
    float *q_pe;              /* [r, h] q_pe, the heads side by side (rope_scores) */
    float *out;               /* [h, v] */
    Quant *lat;               /* [h] each head's latent query (q_nope through W_UK), quantised */
    float *scores;            /* [h, keys]: scores, then exp(score - largest), then probabilities */
    uint8_t *p;               /* [h, keys] probability bytes */
    float *largest, *peak;    /* [threads, h] each thread's largest score, largest probability */
    float *chunk_sums;        /* [h, keys / CHUNK] the exponentials' sum per chunk */
    int32_t *partial;         /* [threads, h, c] each thread's value sums over its positions */
    char *own; size_t own_bytes;  /* thread t's own scratch: own + t * own_bytes */
} Attention;

static void position_share(int keys, int tid, int threads, int *start, int *stop) {
    int chunks = (keys + CHUNK - 1) / CHUNK;
    share(chunks, tid, threads, start, stop);
    *start *= CHUNK; *stop = *stop * CHUNK < keys ? *stop * CHUNK : keys;
}

static size_t cache_row(const Attention *a, int t) { return (size_t)a->table[t / PAGE] * PAGE + t % PAGE; }

#define VALUE_HEADS (VBYTES == 64 ? 4 : 2)  /* heads that share one pass of values() over a page: 16 (or 8) sums */

/* where the value sums keep latent column c: in interleave4's order where values() takes the columns a vector at a
   time (c_dim a multiple of VBYTES), else at c */
static int value_slot(int c_dim, int c) { return c_dim % VBYTES == 0 ? interleaved_slot(c) : c; }

/* sums [n, c] int32 (n <= VALUE_HEADS, columns at value_slot) += the probability bytes p (row j at p + j * stride) of
   positions t0 .. t1 - 1 times the latent codes - 128 of each position, exact (as MatMulInteger sums them). Four
   positions' rows of a vector of codes are interleaved (interleave4) so that one dot4 adds four positions'
   products to a vector of columns; a page's rows stay in cache across its column runs. dot4 takes the probability
   bytes as p - 128 + DOT_BIAS: where DOT_BIAS is not 128, (128 - DOT_BIAS) x each column's code sum is added back
   (one more dot4 a group, shared by the heads). */
static void values(const Attention *a, int n, int t0, int t1, const uint8_t *p, size_t stride, int32_t *sums) {
    int c_dim = a->d->latent;
    for (int t = t0, rows; t < t1; t += rows) {
        rows = MIN(t1, (t / PAGE + 1) * PAGE) - t;  /* the rest of t's page */
        const uint8_t *page = a->pages->latent + cache_row(a, t) * c_dim;
        if (c_dim % VBYTES == 0) {
            int groups = (rows + 3) / 4;
            uint32_t words[VALUE_HEADS][PAGE / 4] = {{0}};  /* each head's probability bytes, four positions a word;
                                                               heads past n stay 0 (the loops below take all) */
            for (int j = 0; j < n; j++)
                for (int g = 0; g < groups; g++) {
                    const uint8_t *four = p + (size_t)j * stride + t + 4 * g;
                    uint32_t w = 0;
                    if (4 * g + 4 <= rows) memcpy(&w, four, 4);
                    else for (int k = 0; 4 * g + k < rows; k++) w |= (uint32_t)four[k] << (8 * k);
                    words[j][g] = w;
                }
            const vu8 ones = (vu8){0} + (uint8_t)(129 - DOT_BIAS);  /* dot4 takes them as 1 */
            for (int c = 0; c < c_dim; c += VBYTES) {
                vi32 acc[VALUE_HEADS][4], codes[4];
                for (int k = 0; k < 4; k++) {
                    codes[k] = (vi32){0};
                    for (int j = 0; j < VALUE_HEADS; j++) acc[j][k] = (vi32){0};
                }
                for (int g = 0; g < groups; g++) {
                    vi8 r[4], quad[4];
                    for (int k = 0; k < 4; k++)  /* a missing position: code 0 (its probability is 0 too) */
                        r[k] = 4 * g + k < rows ? (vi8)(load_u8(page + (size_t)(4 * g + k) * c_dim + c) ^ 0x80) : (vi8){0};
                    interleave4(r, quad);
                    for (int j = 0; j < VALUE_HEADS; j++) {
                        vu8 w = (vu8)splat_i32((int32_t)words[j][g]);
                        for (int k = 0; k < 4; k++) acc[j][k] = dot4(acc[j][k], w, quad[k]);
                    }
                    if (DOT_BIAS != 128)
                        for (int k = 0; k < 4; k++) codes[k] = dot4(codes[k], ones, quad[k]);
                }
                for (int j = 0; j < n; j++)
                    for (int k = 0; k < 4; k++) {
                        int32_t *out = sums + (size_t)j * c_dim + c + LANES * k;
                        store_i32(out, load_i32(out) + acc[j][k] + (128 - DOT_BIAS) * codes[k]);
                    }
            }
            continue;
        }
        for (int row = 0; row < rows; row++) {
            const uint8_t *codes = page + (size_t)row * c_dim;
            for (int j = 0; j < n; j++) {
                int32_t weight = p[(size_t)j * stride + t + row], *out = sums + (size_t)j * c_dim;
                if (weight)
                    for (int c = 0; c < c_dim; c++) out[c] += weight * ((int32_t)codes[c] - 128);
            }
        }
    }
}

/* sums [n] = one cached row's codes - 128 (stored as bytes code + 128) times each head's quantised latent query, in
   integers; the row is loaded once for a group of heads */
static void latent_dots(const uint8_t *codes, int c, const Quant *lat, int n, int32_t *sums) {
    for (int j0 = 0; j0 < n; j0 += HEAD_GROUP) {
        int count = n - j0 < HEAD_GROUP ? n - j0 : HEAD_GROUP;
        if (c % VBYTES == 0) {
            vi32 acc[HEAD_GROUP];
            for (int j = 0; j < count; j++) acc[j] = (vi32){0};
            for (int i = 0; i < c; i += VBYTES) {
                vu8 row = load_u8(codes + i);
                for (int j = 0; j < count; j++) acc[j] = dot4(acc[j], row, load_i8(lat[j0 + j].q + i));
            }
            for (int j = 0; j < count; j++) sums[j0 + j] = sum_lanes(acc[j]) - DOT_BIAS * lat[j0 + j].sum[0];
            continue;
        }
        for (int j = 0; j < count; j++) {
            int32_t s = 0;
            for (int i = 0; i < c; i++) s += ((int32_t)codes[i] - 128) * lat[j0 + j].q[i];
            sums[j0 + j] = s;
        }
    }
}

typedef float v8f __attribute__((vector_size(32)));  /* eight heads' rope scores at once, on every instruction set */

/* out [h] = each head's roped query . one position's rope key, q_pe [r, h] (heads side by side): the sum over i in
   four interleaved runs (i mod 4), then (run 0 + run 1) + (run 2 + run 3): one order on every instruction set, for
   any number of heads, whatever the threads */
static void rope_scores(const float *q_pe, const float *k, int r, int h, float *out) {
    int j = 0;
    for (; j + 8 <= h; j += 8) {
        v8f run0 = {0}, run1 = {0}, run2 = {0}, run3 = {0}, q[4];
        int i = 0;
        for (; i + 4 <= r; i += 4) {
            memcpy(q, q_pe + (size_t)i * h + j, sizeof q[0]);
            memcpy(q + 1, q_pe + (size_t)(i + 1) * h + j, sizeof q[0]);
            memcpy(q + 2, q_pe + (size_t)(i + 2) * h + j, sizeof q[0]);
            memcpy(q + 3, q_pe + (size_t)(i + 3) * h + j, sizeof q[0]);
            run0 += q[0] * ((v8f){0} + k[i]);
            run1 += q[1] * ((v8f){0} + k[i + 1]);
            run2 += q[2] * ((v8f){0} + k[i + 2]);
            run3 += q[3] * ((v8f){0} + k[i + 3]);
        }
        for (v8f *run[3] = {&run0, &run1, &run2}; i < r; i++) {  /* i mod 4 is 0, 1, 2 in turn */
            memcpy(q, q_pe + (size_t)i * h + j, sizeof q[0]);
            *run[i % 4] += q[0] * ((v8f){0} + k[i]);
        }
        v8f total = (run0 + run1) + (run2 + run3);
        memcpy(out + j, &total, sizeof total);
    }
    for (; j < h; j++) {
        float run[4] = {0, 0, 0, 0};
        for (int i = 0; i < r; i++) run[i % 4] += q_pe[(size_t)i * h + j] * k[i];
        out[j] = (run[0] + run[1]) + (run[2] + run[3]);
    }
}

/* phase 1, heads: q_nope through W_UK per output column c, quantised per row */
static void absorb_task(void *arg, int tid, int threads) {
    Attention *a = arg;
    const K2Dims *d = a->d;
    int h0, h1, qk = d->nope + d->rope;
    share(d->heads, tid, threads, &h0, &h1);
    Bump b = {a->own + a->own_bytes * tid};
    Quant nope = quant(&b, d->nope, d->nope);
    float *q_lat = take(&b, d->latent * 4);
    for (int h = h0; h < h1; h++) {
        quantize(a->q + (size_t)h * qk, &nope);
        columns_product(a->l->w_uk + (size_t)h * d->nope * d->latent, a->l->uk_s + (size_t)h * d->latent, d->latent,
                        &nope, q_lat);
        quantize(q_lat, &a->lat[h]);
    }
}

/* phase 2, positions: every head's score of each position (the integer latent product as MatMulInteger gives it,
   times the two scales, plus the rope product), and the largest per head */
static void scores_task(void *arg, int tid, int threads) {
    Attention *a = arg;
    const K2Dims *d = a->d;
    int t0, t1, heads = d->heads, keys = a->keys;
    position_share(keys, tid, threads, &t0, &t1);
    Bump b = {a->own + a->own_bytes * tid};
    float *k_pe = take(&b, d->rope * 4), *rope = take(&b, heads * 4), *largest = a->largest + (size_t)tid * heads;
    int32_t *sums = take(&b, heads * 4);
    for (int j = 0; j < heads; j++) largest[j] = -INFINITY;
    for (int t = t0; t < t1; t++) {
        size_t at = cache_row(a, t);
        halves_to_floats(a->pages->rope + at * d->rope, d->rope, k_pe);  /* the cached float16 rope key */
        latent_dots(a->pages->latent + at * d->latent, d->latent, a->lat, heads, sums);
        rope_scores(a->q_pe, k_pe, d->rope, heads, rope);
        float token_scale = a->pages->scale[at];
        for (int j = 0; j < heads; j++) {
            float latent_score = (float)sums[j] * a->lat[j].s[0] * token_scale;
            float s = (latent_score + rope[j]) * d->softmax_scale;
            a->scores[(size_t)j * keys + t] = s;
            largest[j] = MAX(largest[j], s);
        }
    }
}

static float largest_of(const float *per_thread, int threads, int heads, int j) {
    float m = -INFINITY;
    for (int i = 0; i < threads; i++) m = MAX(m, per_thread[(size_t)i * heads + j]);
    return m;
}

/* phase 3, positions: exp(score - the head's largest), summed per chunk */
static void exp_task(void *arg, int tid, int threads) {
    Attention *a = arg;
    int t0, t1, heads = a->d->heads, keys = a->keys, chunks = (keys + CHUNK - 1) / CHUNK;
    position_share(keys, tid, threads, &t0, &t1);
    for (int j = 0; j < heads; j++) {
        float largest = largest_of(a->largest, threads, heads, j), *s = a->scores + (size_t)j * keys;
        for (int c0 = t0; c0 < t1; c0 += CHUNK) {
            float total = 0;
            for (int t = c0; t < MIN(c0 + CHUNK, t1); t++) { s[t] = expf(s[t] - largest); total += s[t]; }
            a->chunk_sums[(size_t)j * chunks + c0 / CHUNK] = total;
        }
    }
}

/* phase 4, positions: the probabilities (softmax times each position's scale), and the largest per head */
static void probabilities_task(void *arg, int tid, int threads) {
    Attention *a = arg;
    int t0, t1, heads = a->d->heads, keys = a->keys, chunks = (keys + CHUNK - 1) / CHUNK;
    position_share(keys, tid, threads, &t0, &t1);
    for (int j = 0; j < heads; j++) {
        float total = 0, peak = 0, *s = a->scores + (size_t)j * keys;
        for (int c = 0; c < chunks; c++) total += a->chunk_sums[(size_t)j * chunks + c];
        for (int t = t0; t < t1; t++) {
            s[t] = s[t] / total * a->pages->scale[cache_row(a, t)];
            peak = MAX(peak, s[t]);
        }
        a->peak[(size_t)tid * heads + j] = peak;
    }
}

static float probability_scale(const Attention *a, int threads, int j) {  /* largest / 255, as the graph quantises */
    return MAX(largest_of(a->peak, threads, a->d->heads, j) / 255.0f, 1e-30f);
}

/* phase 5, positions: the probability bytes, and this thread's value sums over its positions */
static void values_task(void *arg, int tid, int threads) {
    Attention *a = arg;
    const K2Dims *d = a->d;
    int t0, t1, heads = d->heads, keys = a->keys;
    position_share(keys, tid, threads, &t0, &t1);
    int32_t *sums = a->partial + (size_t)tid * heads * d->latent;
    memset(sums, 0, (size_t)heads * d->latent * 4);
    for (int j = 0; j < heads; j++) {
        float inverse = 1.0f / probability_scale(a, threads, j), *s = a->scores + (size_t)j * keys;
        uint8_t *p = a->p + (size_t)j * keys;
        round_codes(s + t0, t1 - t0, inverse, 0, 255, p + t0);
    }
    for (int j = 0; j < heads; j += VALUE_HEADS)
        values(a, MIN(heads - j, VALUE_HEADS), t0, t1, a->p + (size_t)j * keys, keys,
               sums + (size_t)j * d->latent);
}

/* phase 6, heads: the threads' value sums added, scaled, quantised, through W_UV per output column v */
static void output_task(void *arg, int tid, int threads) {
    Attention *a = arg;
    const K2Dims *d = a->d;
    int h0, h1, c_dim = d->latent;
    share(d->heads, tid, threads, &h0, &h1);
    Bump b = {a->own + a->own_bytes * tid};
    Quant back = quant(&b, c_dim, c_dim);
    float *x = take(&b, c_dim * 4);
    for (int h = h0; h < h1; h++) {
        float scale = probability_scale(a, threads, h);
        for (int c = 0; c < c_dim; c++) {
            int32_t sum = 0, slot = value_slot(c_dim, c);
            for (int i = 0; i < threads; i++) sum += a->partial[((size_t)i * d->heads + h) * c_dim + slot];
            x[c] = (float)sum * scale;
        }
        quantize(x, &back);
        columns_product(a->l->w_uv + (size_t)h * c_dim * d->v, a->l->uv_s + (size_t)h * d->v, d->v, &back,
                        a->out + (size_t)h * d->v);
    }
}

/* one thread's own attention scratch, in bytes */
static size_t attention_own_bytes(const K2Dims *d) {
    size_t quant_bytes = (size_t)MAX(d->nope, d->latent) + 3 * 64;
    return (quant_bytes + (size_t)4 * (d->latent + d->rope + 2 * d->heads) + 5 * 64 + 63) / 64 * 64;
}

/* the attention's scratch for `threads` threads, in bytes */
static size_t attention_bytes(const K2Dims *d, int threads) {
    size_t h = d->heads, t = d->max_len, chunks = (t + CHUNK - 1) / CHUNK;
    size_t shared = h * sizeof(Quant) + h * (d->latent + 3 * 64) + (size_t)d->rope * h * 4 + 64 + h * t * 5 +
                    (size_t)threads * h * 8 +
                    h * chunks * 4 + (size_t)threads * h * d->latent * 4 + 8 * 64;
    return shared + (size_t)threads * attention_own_bytes(d);
}

static void attention(const K2Dims *d, const K2Layer *l, const K2Pages *pages, const int64_t *table, int keys,
                      const float *q, float *out, char *scratch) {
    int threads = pool.threads ? pool.threads : 1, h = d->heads;
    Bump b = {scratch};
    Attention a = {.d = d, .l = l, .pages = pages, .table = table, .keys = keys, .q = q, .out = out};
    a.lat = take(&b, h * sizeof(Quant));
    for (int j = 0; j < h; j++) a.lat[j] = quant(&b, d->latent, d->latent);
    a.q_pe = take(&b, (size_t)d->rope * h * 4);
    for (int j = 0; j < h; j++)
        for (int i = 0; i < d->rope; i++) a.q_pe[(size_t)i * h + j] = q[(size_t)j * (d->nope + d->rope) + d->nope + i];
    a.scores = take(&b, (size_t)h * keys * 4);
    a.p = take(&b, (size_t)h * keys);
    a.largest = take(&b, (size_t)threads * h * 4);
    a.peak = take(&b, (size_t)threads * h * 4);
    a.chunk_sums = take(&b, (size_t)h * ((keys + CHUNK - 1) / CHUNK) * 4);
    a.partial = take(&b, (size_t)threads * h * d->latent * 4);
    a.own = b.at; a.own_bytes = attention_own_bytes(d);
    run(absorb_task, &a);
    run(scores_task, &a);
    run(exp_task, &a);
    run(probabilities_task, &a);
    run(values_task, &a);
    run(output_task, &a);
}

/* ---- routing ---------------------------------------------------------------------------------------------- */

typedef struct { const float *router, *x; float *scores; int experts, hidden, batch; } Router; /* x [batch, m] */

static void router_task(void *arg, int tid, int threads) {  /* scores [batch, e] */
    Router *r = arg;
    int start, stop;
    share(r->experts, tid, threads, &start, &stop);
    for (int e = start; e < stop; e++)
        for (int b = 0; b < r->batch; b++) {
            float s = dot_f32(r->x + (size_t)b * r->hidden, r->router + (size_t)e * r->hidden, r->hidden);
            r->scores[(size_t)b * r->experts + e] = 1.0f / (1.0f + expf(-s));
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
    size_t bytes = 64 * 1024 + (size_t)batch * per_sequence + experts * 4 + attention_bytes(d, threads) +
                   (size_t)4 * 4096;
    return (long)(bytes / 4 + 1);
}

/* the routed experts as products' parts: each expert that any sequence of the batch chose, once, its inputs in
   the order the choices come (sequence by sequence, best first) */
typedef struct {
    int parts;
    K2Lin *up, *down;         /* [parts] the expert's gate-and-up rows (interleaved), its down rows */
    int *count;               /* [parts] its inputs */
    int *part, *slot;         /* [batch, k] each choice's part and its input's place there */
} Experts;

static Experts group_experts(const K2Dims *d, const K2Layer *l, int batch, const int *chosen, Bump *b) {
    int k = d->top_k, m = d->hidden;
    size_t rows = (size_t)2 * l->width, up = tiles(2 * l->width) * TILE, down = tiles(m) * TILE;
    Experts x = {0};
    int *part_of = take(b, (size_t)l->experts * 4);
    for (int e = 0; e < l->experts; e++) part_of[e] = -1;
    x.up = take(b, (size_t)batch * k * sizeof(K2Lin));
    x.down = take(b, (size_t)batch * k * sizeof(K2Lin));
    x.count = take(b, (size_t)batch * k * 4);
    x.part = take(b, (size_t)batch * k * 4);
    x.slot = take(b, (size_t)batch * k * 4);
    for (int i = 0; i < batch * k; i++) {
        size_t e = (size_t)chosen[i];
        if (part_of[e] < 0) {
            part_of[e] = x.parts;
            size_t per_byte = 8 / l->bits;  /* weights a byte */
            x.up[x.parts] = (K2Lin){l->fc1 + e * up * m / per_byte, l->fc1_s + e * up * (m / l->block), (int)rows, m,
                                    l->block, l->bits};
            x.down[x.parts] = (K2Lin){l->fc2 + e * down * l->width / per_byte, l->fc2_s + e * down * (l->width / l->block),
                                      m, l->width, l->block, l->bits};
            x.count[x.parts++] = 0;
        }
        x.part[i] = part_of[e];
        x.slot[i] = x.count[part_of[e]]++;
    }
    return x;
}

/* silu(gate) * up of `count` rows of gate and up -> their int8 inputs of the down product (of `bits` a code) */
static Quant *activations(const float *gate, const float *up, size_t stride, int step, int count, int width,
                          int block, int bits, Bump *b) {
    Quant *h = take(b, count * sizeof(Quant));
    float *act = take(b, width * 4);
    for (int j = 0; j < count; j++) {
        const float *g = gate + (size_t)j * stride, *u = up + (size_t)j * stride;
        for (int i = 0; i < width; i++) act[i] = silu(g[(size_t)step * i]) * u[(size_t)step * i];
        h[j] = quant(b, width, block);
        quantize(act, &h[j]);
        if (bits == 4) by_nibbles(&h[j]);
    }
    return h;
}

/* xn [batch, m] -> y [batch, m]: the dense MLP, or the routed experts and the shared one. Each matrix is read once
   for the whole batch, and each sequence's result is the one it gets alone (the same products, summed in the same
   order). */
static void mlp(const K2Dims *d, const K2Layer *l, int batch, const float *xn, float *y, Bump b) {
    int m = d->hidden, k = l->moe ? d->top_k : 0, dense = l->gate.n > 0, terms = k + dense;
    Experts x = {0};
    Quant *xe = NULL;
    int *chosen = take(&b, (size_t)batch * (k + 1) * 4);
    float *weight = take(&b, (size_t)batch * terms * 4);
    if (l->moe) {
        float *scores = take(&b, (size_t)batch * l->experts * 4);
        Router r = {l->router, xn, scores, l->experts, m, batch};
        run(router_task, &r);
        xe = take(&b, batch * sizeof(Quant));
        for (int s = 0; s < batch; s++) {
            route(d, scores + (size_t)s * l->experts, l->bias, l->experts, chosen + s * k, weight + s * terms);
            xe[s] = quant(&b, m, l->block);
            quantize(xn + (size_t)s * m, &xe[s]);
            if (l->bits == 4) by_nibbles(&xe[s]);
        }
        x = group_experts(d, l, batch, chosen, &b);
    }
    /* gate and up: each expert's rows times its inputs, then (dense, or shared expert) every sequence's */
    int parts = x.parts + 2 * dense;
    K2Lin *lin = take(&b, parts * sizeof(K2Lin));
    int *count = take(&b, parts * 4);
    const Quant **in = take(&b, parts * sizeof(Quant *));
    float **out = take(&b, parts * sizeof(float *));
    for (int u = 0; u < x.parts; u++) {
        Quant *inputs = take(&b, x.count[u] * sizeof(Quant));
        for (int i = 0; i < batch * k; i++)
            if (x.part[i] == u) inputs[x.slot[i]] = xe[i / k];
        lin[u] = x.up[u]; count[u] = x.count[u]; in[u] = inputs;
        out[u] = take(&b, (size_t)x.count[u] * x.up[u].n * 4);
    }
    if (dense) {
        Quant *xd = take(&b, batch * sizeof(Quant));
        for (int s = 0; s < batch; s++) {
            xd[s] = quant(&b, m, l->gate.block);
            quantize(xn + (size_t)s * m, &xd[s]);
        }
        for (int i = 0; i < 2; i++) {
            lin[x.parts + i] = i ? l->up : l->gate; count[x.parts + i] = batch; in[x.parts + i] = xd;
            out[x.parts + i] = take(&b, (size_t)batch * l->gate.n * 4);
        }
    }
    Products up = {parts, lin, count, in, out};
    run(products_task, &up);
    /* down: each expert's rows times its activations, then the dense (shared) one's; summed per sequence */
    int down_parts = x.parts + dense;
    K2Lin *down_lin = take(&b, down_parts * sizeof(K2Lin));
    int *down_count = take(&b, down_parts * 4);
    const Quant **down_in = take(&b, down_parts * sizeof(Quant *));
    float **down_out = take(&b, down_parts * sizeof(float *));
    const float **term = take(&b, (size_t)batch * terms * sizeof(float *));
    for (int u = 0; u < x.parts; u++) {  /* the gate and up rows interleaved */
        down_lin[u] = x.down[u]; down_count[u] = x.count[u];
        down_in[u] = activations(out[u], out[u] + 1, x.up[u].n, 2, x.count[u], l->width, l->block, l->bits, &b);
        down_out[u] = take(&b, (size_t)x.count[u] * m * 4);
    }
    for (int i = 0; i < batch * k; i++)
        term[(i / k) * terms + i % k] = down_out[x.part[i]] + (size_t)x.slot[i] * m;
    if (dense) {
        down_lin[x.parts] = l->down; down_count[x.parts] = batch;
        down_in[x.parts] = activations(out[x.parts], out[x.parts + 1], l->gate.n, 1, batch, l->gate.n, l->down.block, 8, &b);
        down_out[x.parts] = take(&b, (size_t)batch * m * 4);
        for (int s = 0; s < batch; s++) {
            term[s * terms + k] = down_out[x.parts] + (size_t)s * m;
            weight[s * terms + k] = 1.0f;
        }
    }
    Products down = {down_parts, down_lin, down_count, down_in, down_out};
    run(products_task, &down);
    Combine sum = {batch, m, terms, term, weight, y};
    run(combine_task, &sum);
}

/* each sequence's new entry: latent normalised, quantised per token; rope key roped, float16; into its page */
static void store_entry(const K2Dims *d, const K2Layer *l, float *kv, int pos, const int64_t *table,
                        const K2Pages *pages, float *latent) {
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
}

/* x [batch, k] rows, each normalised by w (NULL: as it is) and quantised in blocks -> [batch] int8 inputs */
static Quant *quantize_rows(const float *x, int batch, int k, const float *w, float eps, int block, Bump *b) {
    Quant *q = take(b, batch * sizeof(Quant));
    float *normed = w ? take(b, k * 4) : NULL;
    for (int s = 0; s < batch; s++) {
        const float *row = x + (size_t)s * k;
        if (w) { rms_norm(row, w, k, eps, normed); row = normed; }
        q[s] = quant(b, k, block);
        quantize(row, &q[s]);
    }
    return q;
}

static void one_product(const K2Lin *l, int batch, const Quant *in, float *out) {  /* out [batch, n] */
    const Quant *ins[1] = {in};
    float *outs[1] = {out};
    Products p = {1, l, &batch, ins, outs};
    run(products_task, &p);
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
    float *latent = take(&b, d->latent * 4);
    for (int s = 0; s < batch; s++)
        store_entry(d, l, kv + (size_t)s * l->kv_a.n, pos[s], tables + (size_t)s * table_len, pages, latent);
    float *q = take(&b, (size_t)batch * heads * qk * 4);
    one_product(&l->q_b, batch, quantize_rows(q_a, batch, l->q_a.n, l->q_norm, d->eps, l->q_b.block, &b), q);
    float *attended = take(&b, (size_t)batch * heads * d->v * 4);
    for (int s = 0; s < batch; s++) {
        float *q_s = q + (size_t)s * heads * qk;
        for (int h = 0; h < heads; h++) rope(q_s + (size_t)h * qk + d->nope, d->rope, l->frequencies, pos[s], d->rope_scale);
        attention(d, l, pages, tables + (size_t)s * table_len, pos[s] + 1, q_s, attended + (size_t)s * heads * d->v,
                  attention_scratch);
    }
    float *o = take(&b, (size_t)batch * m * 4);
    one_product(&l->o, batch, quantize_rows(attended, batch, heads * d->v, NULL, 0, l->o.block, &b), o);
    float *xn = take(&b, (size_t)batch * m * 4), *y = take(&b, (size_t)batch * m * 4);
    for (int s = 0; s < batch; s++) {
        for (int i = 0; i < m; i++) x[(size_t)s * m + i] += o[(size_t)s * m + i];
        rms_norm(x + (size_t)s * m, l->post_norm, m, d->eps, xn + (size_t)s * m);
    }
    mlp(d, l, batch, xn, y, b);
    for (size_t i = 0; i < (size_t)batch * m; i++) x[i] += y[i];
}

static Bump step_scratch(const K2Model *m, float *scratch) {
    int threads = pool.threads ? pool.threads : 1;
    Bump b = {(char *)scratch + attention_bytes(&m->d, threads)};
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

/* the library's side of its contract with runtime/backends/native_decode.py, read there at load (native_build.CONTRACT
   names them in this order): its constants and the sizes of the structs it takes; a Python side whose layout or
   limits differ refuses to run it */
long k2_contract(int what) {
    const long values[] = {PAGE, TILE, MAX_TOP_K, MAX_GROUPS, MAX_EXPERTS, MAX_THREADS, sizeof(K2Lin), sizeof(K2Dims),
                           sizeof(K2Layer), sizeof(K2Model), sizeof(K2Pages)};
    return what >= 0 && what < (int)(sizeof values / sizeof values[0]) ? values[what] : -1;
}

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
