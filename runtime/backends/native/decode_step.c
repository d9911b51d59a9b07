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
#define MAX_TOP_K 64      /* the routing's limits (runtime/backends/native/decoder.py checks a model against them) */
#define MAX_GROUPS 64
#define MAX_EXPERTS 4096
#define HEAD_GROUP (VBYTES == 64 ? 16 : 8)  /* heads that share one pass of latent_dots() over a cached row */
#define SPIN_SECONDS 2e-3 /* a worker idle this long sleeps until the next phase */
#define STARVED_SECONDS 1e-3 /* a worker that ran less than half of this long (its CPU time) while the caller waited
                                this long for it, past its own share's time, had no core */
#define QUIET_SECONDS 0.01  /* and then nobody spins for this long, doubled for each starved wait that follows */
#define QUIET_DOUBLINGS 7   /* within the last quiet time or soon after (at most 1.28 s) */
#define LEASE_IDLE_SECONDS 0.05  /* a process that ran no step for this long gives its cores' leases back */

/* ---- the model, as the artifact holds it (core/native_tiles.py) and runtime/backends/native/decoder.py maps it ---- */

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
    atomic_int finished_generation[MAX_THREADS];  /* the generation whose task thread t finished last */
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

static struct timespec deadline_after(double seconds) {  /* on the pool's conditions' clock */
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    long nanos = deadline.tv_nsec + (long)(seconds * 1e9);
    deadline.tv_sec += nanos / 1000000000L;
    deadline.tv_nsec = nanos % 1000000000L;
    return deadline;
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
    struct timespec deadline = deadline_after(at < until ? until - at : LEASE_IDLE_SECONDS);
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
        atomic_store(&pool.finished_generation[tid], seen);
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

static double cpu_seconds(int t) {  /* worker t's CPU time so far */
    clockid_t clock;
    struct timespec at;
    if (pthread_getcpuclockid(pool.ids[t], &clock) != 0 || clock_gettime(clock, &at) != 0) return 0;
    return at.tv_sec + at.tv_nsec * 1e-9;
}

typedef struct { double at, cpu[MAX_THREADS]; } Progress;  /* the workers' CPU times at wall time `at` (0: none) */

/* whether a worker still in the current task got under half of the wall time since progress->at on a CPU (none
   taken yet: taken now, 0); a worker that is only slower than the caller (more work, slower memory) keeps running */
static int worker_starved(Progress *progress, double at) {
    int generation = atomic_load(&pool.generation), starving = 0;
    for (int t = 1; t < pool.active; t++) {
        if (atomic_load(&pool.finished_generation[t]) == generation) continue;
        double cpu = cpu_seconds(t);
        if (progress->at > 0 && cpu - progress->cpu[t] < 0.5 * (at - progress->at)) starving = 1;
        progress->cpu[t] = cpu;
    }
    progress->at = at;
    return starving;
}

/* the caller's wait for the workers: spins while spinning is allowed, else sleeps until the last one wakes it (a
   look every STARVED_SECONDS); once it has waited STARVED_SECONDS past its own share's time, it looks at the
   workers' CPU times every STARVED_SECONDS: a worker that went without a core (starved) turns spinning off */
static void wait_for_workers(double own_seconds) {
    double since = now(), looked = 0;
    Progress progress = {0};
    for (int spins = 1; atomic_load(&pool.done) < pool.active - 1; spins++) {
        if (spins % 1024 == 0) sched_yield();  /* a worker waiting for this core gets it */
        if (spins % 256 == 0) {
            double at = now();
            if (at - since > own_seconds + STARVED_SECONDS && at - looked >= STARVED_SECONDS) {
                if (worker_starved(&progress, at)) starved(at);
                looked = at;
            }
            if (!may_spin(at)) {
                pthread_mutex_lock(&pool.lock);
                atomic_store(&pool.caller_sleeps, 1);  /* before done is read again: the last worker then wakes it */
                while (atomic_load(&pool.done) < pool.active - 1) {
                    struct timespec deadline = deadline_after(STARVED_SECONDS);
                    pthread_cond_timedwait(&pool.finished, &pool.lock, &deadline);
                    double woken = now();
                    if (atomic_load(&pool.done) < pool.active - 1 && woken - since > own_seconds + STARVED_SECONDS &&
                        worker_starved(&progress, woken)) {  /* still no core for them */
                        pthread_mutex_unlock(&pool.lock);
                        starved(woken);
                        pthread_mutex_lock(&pool.lock);
                    }
                }
                atomic_store(&pool.caller_sleeps, 0);
                pthread_mutex_unlock(&pool.lock);
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

/* A phase whose pieces cost about the same (a product's tiles, rows) is cut in GRAINS grains a thread, which the
   threads take first come, first served (next_grain): a thread that is slower for a while (an interrupt, a page
   fault, the other thread on the core) leaves its grains to the others instead of the step waiting for it. A
   grain's result does not depend on the thread that takes it. */
#define GRAINS 4

static int next_grain(atomic_int *next) { return atomic_fetch_add_explicit(next, 1, memory_order_relaxed); }

/* ---- activations and products --------------------------------------------------------------------------- */

typedef struct { int8_t *q; float *s; int32_t *sum; int k, block; } Quant; /* x [k] as int8 blocks */

typedef int8_t vq8 __attribute__((vector_size(LANES)));  /* LANES int8 codes: a vf32's lanes narrowed */

static inline vi32 pick(vi32 mask, vi32 yes, vi32 no) { return (yes & mask) | (no & ~mask); }

/* the largest of each lane's value (non-negative floats as integers: their order is the floats') in every lane, by
   halving: a maximum in any order is the same */
static inline vi32 most_lanes(vi32 v) {
    vi32 turn;
    for (int i = 0; i < LANES; i++) turn[i] = (i + LANES / 2) % LANES;
    for (int half = LANES / 2; half >= 1; half /= 2) {
        v = max_i32(__builtin_shuffle(v, turn), v);
        for (int i = 0; i < LANES; i++) turn[i] = (i + half / 2) % LANES;
    }
    return v;
}

/* the largest |x[i]| (for finite x: a magnitude's bits order as its value, so the maxima are integer ones, four
   chains at once; a maximum is the same in any order) */
static float largest_magnitude(const float *x, int n) {
    float absmax = 0;
    int i = 0;
    if (n >= LANES) {
        vi32 most[4] = {{0}};
        for (; i + 4 * LANES <= n; i += 4 * LANES)
            for (int k = 0; k < 4; k++) {
                vi32 magnitude = (vi32)load_f32(x + i + k * LANES) & 0x7fffffff;
                most[k] = max_i32(magnitude, most[k]);
            }
        for (; i + LANES <= n; i += LANES) {
            vi32 magnitude = (vi32)load_f32(x + i) & 0x7fffffff;
            most[0] = max_i32(magnitude, most[0]);
        }
        for (int k = 1; k < 4; k++) most[0] = max_i32(most[k], most[0]);
        absmax = ((vf32)most_lanes(most[0]))[0];
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
        q = max_i32(min_i32(q, splat_i32(highest)), splat_i32(lowest));
        total += q;
        vq8 bytes = __builtin_convertvector(q, vq8);  /* each lane's low byte */
        memcpy(codes + i, &bytes, LANES);
    }
    sum = sum_lanes(total);
    for (; i < n; i++) {
        int q = (int)nearbyintf(x[i] * inverse);
        q = q > highest ? highest : q < lowest ? lowest : q;
        codes[i] = (uint8_t)q; sum += q;
    }
    return sum;
}

/* exp(x) of each lane, for x <= 0 (a softmax's scores less their largest): 2^n p(r), n = round(x / ln 2) and r = x - n ln 2
   in two steps (ln 2's leading bits exact), p the degree-7 Taylor polynomial (within 2 float ulps of exp on |r| <= ln 2 / 2);
   below -87 (where exp leaves the normal floats) 0. Each lane's steps are its own: any lane, any vector width and
   any order of the positions give one value. */
static inline vf32 exp_lanes(vf32 x) {
    const vf32 rounder = (vf32){0} + ROUNDER;
    vi32 under = x < -87.0f;
    x = (vf32)pick(under, (vi32)((vf32){0} - 87.0f), (vi32)x);
    vf32 n = (x * 1.44269504f + rounder) - rounder;
    vf32 r = (x - n * 0.693145752f) - n * 1.42860677e-06f;
    vf32 p = (vf32){0} + 1.0f / 5040;
    p = p * r + 1.0f / 720; p = p * r + 1.0f / 120; p = p * r + 1.0f / 24; p = p * r + 1.0f / 6;
    p = p * r + 0.5f; p = p * r + 1.0f; p = p * r + 1.0f;
    vi32 two_n = (__builtin_convertvector(n, vi32) + 127) << 23;  /* n >= -126: a normal float's exponent */
    return (vf32)((vi32)(p * (vf32)two_n) & ~under);
}

/* out [n] = exp_lanes(x [n] - less), a vector at a time (the last one padded) */
static void exp_run(const float *x, int n, float less, float *out) {
    for (int i = 0; i < n; i += LANES) {
        float in[LANES] = {0}, got[LANES];
        int count = MIN(LANES, n - i);
        memcpy(in, x + i, count * 4);
        store_f32(got, exp_lanes(load_f32(in) - less));
        memcpy(out + i, got, count * 4);
    }
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

/* y [TILE] += one block's integer sums (sum[v * stride], v < TILE_VECTORS) less `less`, times the block's scales ws
   [TILE] and the input's scale: the float steps of tile_dot's block */
static inline void add_block(float *y, const vi32 *sum, int stride, int32_t less, float scale, const float *ws) {
    for (int v = 0; v < TILE_VECTORS; v++) {
        vf32 acc = load_f32(y + LANES * v);
        acc += __builtin_convertvector(sum[v * stride] - less, vf32) * (load_f32(ws + LANES * v) * scale);
        store_f32(y + LANES * v, acc);
    }
}

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
            for (int i = 0; i < INPUT_BLOCK; i++) {
                x[i] = splat4(a[i].q + 4 * g);
                HELD(x[i]);
            }
            const uint8_t *rows = w + (size_t)g * TILE * 4;
            for (int v = 0; v < TILE_VECTORS; v++) {
                vu8 weights = load_u8(rows + VBYTES * v);
                HELD(weights);
                for (int i = 0; i < INPUT_BLOCK; i++) sum[v][i] = dot4(sum[v][i], weights, x[i]);
            }
        }
        for (int i = 0; i < INPUT_BLOCK; i++)
            add_block(y[i], &sum[0][i], INPUT_BLOCK, DOT_BIAS * a[i].sum[j], a[i].s[j], ws + (size_t)j * TILE);
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

/* tile_dot_int4 for INPUT_BLOCK inputs at once (as tile_dot_inputs for tile_dot): each code vector is loaded and
   split into its nibbles once for all of them, and each input's sums and float steps are exactly tile_dot_int4's */
static void tile_dot_int4_inputs(const uint8_t *w, const float *ws, const Quant *a, float *const *y) {
    int groups = a[0].k / a[0].block, pairs = a[0].block / 8;
    for (int i = 0; i < INPUT_BLOCK; i++) memset(y[i], 0, TILE * sizeof(float));
    for (int j = 0; j < groups; j++) {
        vi32 sum[TILE_VECTORS][INPUT_BLOCK];
        for (int v = 0; v < TILE_VECTORS; v++)
            for (int i = 0; i < INPUT_BLOCK; i++) sum[v][i] = (vi32){0};
        for (int g = j * pairs; g < (j + 1) * pairs; g++) {
            vi8 low[INPUT_BLOCK], high[INPUT_BLOCK];
            for (int i = 0; i < INPUT_BLOCK; i++) { low[i] = splat4(a[i].q + 8 * g); high[i] = splat4(a[i].q + 8 * g + 4); }
            const uint8_t *rows = w + (size_t)g * TILE * 4;
            for (int v = 0; v < TILE_VECTORS; v++) {
                vu8 codes = load_u8(rows + VBYTES * v), lo = codes & 0x0F, hi = codes >> 4;
                for (int i = 0; i < INPUT_BLOCK; i++) sum[v][i] = dot4_small(dot4_small(sum[v][i], lo, low[i]), hi, high[i]);
            }
        }
        for (int i = 0; i < INPUT_BLOCK; i++)  /* less the zero point 8 */
            add_block(y[i], &sum[0][i], INPUT_BLOCK, 8 * a[i].sum[j], a[i].s[j], ws + (size_t)j * TILE);
    }
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

#define COLUMN_INPUTS (VBYTES == 64 ? 4 : 2)  /* inputs columns_inputs() takes in one pass */
#define COLUMN_GROUP 4                        /* vectors of columns a pass of columns_inputs() takes */

/* columns j0 .. j0 + COLUMN_GROUP LANES - 1 of columns_inputs() for `inputs` inputs (a constant where it is called) */
static inline __attribute__((always_inline)) void columns_inputs_pass(const uint8_t *w, const float *ws, int n,
                                                                       const Quant *a, float *const *y, int j0,
                                                                       const int inputs) {
    vi32 acc[COLUMN_GROUP][COLUMN_INPUTS];
    for (int v = 0; v < COLUMN_GROUP; v++)
        for (int i = 0; i < inputs; i++) acc[v][i] = (vi32){0};
    for (int g = 0; g < a[0].k / 4; g++) {
        vi8 x[COLUMN_INPUTS];
        for (int i = 0; i < inputs; i++) {
            x[i] = splat4(a[i].q + 4 * g);
            HELD(x[i]);
        }
        const uint8_t *rows = w + ((size_t)g * n + j0) * 4;
        for (int v = 0; v < COLUMN_GROUP; v++) {
            vu8 weights = load_u8(rows + VBYTES * v);
            HELD(weights);
            for (int i = 0; i < inputs; i++) acc[v][i] = dot4(acc[v][i], weights, x[i]);
        }
    }
    for (int i = 0; i < inputs; i++)
        for (int v = 0; v < COLUMN_GROUP; v++)
            store_f32(y[i] + j0 + LANES * v, __builtin_convertvector(acc[v][i] - DOT_BIAS * a[i].sum[0], vf32) *
                                             (load_f32(ws + j0 + LANES * v) * a[i].s[0]));
}

/* columns_product() of `count` inputs a [count] through one matrix, y [count] -> [n]: each weight vector loaded once
   for COLUMN_INPUTS of them, each input's sums and float steps columns_product's */
static void columns_inputs(const uint8_t *w, const float *ws, int n, const Quant *a, int count, float *const *y) {
    if (n % (COLUMN_GROUP * LANES) || a[0].k % 4) {
        for (int i = 0; i < count; i++) columns_product(w, ws, n, &a[i], y[i]);
        return;
    }
    for (int i = 0; i < count; i += COLUMN_INPUTS)
        for (int j0 = 0; j0 < n; j0 += COLUMN_GROUP * LANES) {
            int left = count - i;
            if (left >= COLUMN_INPUTS) columns_inputs_pass(w, ws, n, a + i, y + i, j0, COLUMN_INPUTS);
            else if (left == 3) columns_inputs_pass(w, ws, n, a + i, y + i, j0, 3);
            else if (left == 2) columns_inputs_pass(w, ws, n, a + i, y + i, j0, 2);
            else columns_inputs_pass(w, ws, n, a + i, y + i, j0, 1);
        }
}

typedef struct {            /* products whose rows are taken as one run split over the threads: each row of part i
                               times each of the part's count[i] inputs (a row is read once for all of them) */
    int parts;
    const K2Lin *lin;         /* [parts] */
    const int *count;         /* [parts] */
    const Quant *const *in;   /* [parts] -> [count[i]] */
    float *const *out;        /* [parts] -> [count[i], lin[i].n] */
    atomic_int next;          /* the next grain to take (0 at the start) */
} Products;

#define TILE_READ_COST 2  /* a tile's cost in inputs' products, for reading its weights (products_task) */

/* the first of part's `count` tiles whose grain is `grain` or later: tile t's grain is the one whose share of the
   products' cost holds the middle of t's cost (TILE_READ_COST + its inputs), `before` the parts' cost ahead */
static int first_tile_of(int grain, int grains, long long total, long long before, int inputs, int count) {
    long long cost = TILE_READ_COST + inputs, need = (long long)grain * 2 * total - (2 * before + cost) * grains;
    if (need <= 0) return 0;
    long long t = (need + 2 * cost * grains - 1) / (2 * cost * grains);
    return t < count ? (int)t : count;
}

/* tiles lo .. hi - 1 of part i times each of its inputs */
static void product_tiles(const Products *p, int i, int lo, int hi) {
    const K2Lin *l = &p->lin[i];
    float y[TILE];
    for (int t = lo; t < hi; t++) {
        const uint8_t *w = l->w + (size_t)t * TILE * l->k / (8 / l->bits);
        const float *ws = l->s + (size_t)t * TILE * (l->k / l->block);
        int rows = MIN(TILE, l->n - t * TILE);
        int j = 0;
        if (rows == TILE)  /* inputs INPUT_BLOCK at a time, each weight loaded once for them */
            for (; j + INPUT_BLOCK <= p->count[i]; j += INPUT_BLOCK) {
                float *outs[INPUT_BLOCK];
                for (int b = 0; b < INPUT_BLOCK; b++) outs[b] = p->out[i] + (size_t)(j + b) * l->n + (size_t)t * TILE;
                if (l->bits == 4) tile_dot_int4_inputs(w, ws, &p->in[i][j], outs);
                else tile_dot_inputs(w, ws, &p->in[i][j], outs);
            }
        for (; j < p->count[i]; j++) {
            float *out = p->out[i] + (size_t)j * l->n + (size_t)t * TILE, *into = rows == TILE ? out : y;
            if (l->bits == 4) tile_dot_int4(w, ws, &p->in[i][j], into);
            else tile_dot(w, ws, &p->in[i][j], into);
            if (into != out) memcpy(out, y, rows * sizeof(float));
        }
    }
}

static void products_task(void *arg, int tid, int threads) {
    (void)tid;
    Products *p = arg;
    long long total = 0;  /* split by cost, not by tiles: an expert many inputs chose costs more */
    for (int i = 0; i < p->parts; i++) total += (long long)tiles(p->lin[i].n) * (TILE_READ_COST + p->count[i]);
    int grains = threads * GRAINS;
    for (int g; (g = next_grain(&p->next)) < grains;) {
        long long before = 0;
        for (int i = 0; i < p->parts; i++) {  /* part by part: each matrix's run of tiles streams in order */
            int count = (int)tiles(p->lin[i].n);
            int lo = first_tile_of(g, grains, total, before, p->count[i], count);
            int hi = first_tile_of(g + 1, grains, total, before, p->count[i], count);
            before += (long long)count * (TILE_READ_COST + p->count[i]);
            if (lo < hi) product_tiles(p, i, lo, hi);
        }
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
    share((c->rows + LANES - 1) / LANES, tid, threads, &start, &stop);  /* a vector of rows at a time */
    start *= LANES; stop = MIN(stop * LANES, c->rows);
    for (int s = 0; s < c->batch; s++) {
        const float *weight = c->weight + (size_t)s * c->terms, *const *term = c->term + (size_t)s * c->terms;
        float *y = c->y + (size_t)s * c->rows;
        int r = start;
        for (; r + LANES <= stop; r += LANES) {
            vf32 sum = {0};
            for (int t = 0; t < c->terms; t++) sum += splat_f32(weight[t]) * load_f32(term[t] + r);
            store_f32(y + r, sum);
        }
        for (; r < stop; r++) {
            float sum = 0;
            for (int t = 0; t < c->terms; t++) sum += weight[t] * term[t][r];
            y[r] = sum;
        }
    }
}

/* ---- scratch -------------------------------------------------------------------------------------------- */

typedef struct { char *at; } Bump;
static void *take(Bump *b, size_t bytes) { void *p = b->at; b->at += (bytes + 63) / 64 * 64; return p; }
static Quant quant(Bump *b, int k, int block) {
    Quant a = {take(b, k), take(b, (k / block) * 4), take(b, (k / block) * 4), k, block};
    return a;
}

/* fn(arg, row, own) for rows 0 .. rows - 1, split over the pool where there are enough of them (a prompt's tokens,
   a batch); own: the calling thread's own `own_bytes` of scratch. Each row's work is its own: the split changes no
   result. */
#define ROWS_TO_SHARE 8
#define EACH_ROW_CALLS 16  /* each_row calls a step makes at most between two resets of its scratch (a layer) */
typedef void (*RowWork)(void *arg, int row, char *own);
typedef struct { RowWork fn; void *arg; int rows; char *own; size_t own_bytes; atomic_int next; } EachRow;

static void each_row_task(void *arg, int tid, int threads) {
    EachRow *e = arg;
    int grains = threads * GRAINS;
    for (int g, start, stop; (g = next_grain(&e->next)) < grains;) {
        share(e->rows, g, grains, &start, &stop);
        for (int row = start; row < stop; row++) e->fn(e->arg, row, e->own + e->own_bytes * tid);
    }
}

static void each_row(RowWork fn, void *arg, int rows, size_t own_bytes, Bump *b) {
    int threads = pool.threads ? pool.threads : 1;
    EachRow e = {fn, arg, rows, take(b, (size_t)threads * ((own_bytes + 63) / 64 * 64)), (own_bytes + 63) / 64 * 64};
    if (rows < ROWS_TO_SHARE) each_row_task(&e, 0, 1);
    else run(each_row_task, &e);
}

/* ---- pieces --------------------------------------------------------------------------------------------- */

/* out [n] = x / sqrt(mean(x^2) + eps) * w: the squares summed in float a vector of lanes at a time (each lane's
   chain, then the lanes in double, in one order for any input) */
static void rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    int i = 0;
    vf32 lanes = {0};
    for (; i + LANES <= n; i += LANES) {
        vf32 v = load_f32(x + i);
        lanes += v * v;
    }
    double squares = 0;
    for (int j = 0; j < LANES; j++) squares += lanes[j];
    for (; i < n; i++) squares += (double)x[i] * x[i];
    float inverse = 1.0f / sqrtf((float)(squares / n) + eps);
    for (i = 0; i + LANES <= n; i += LANES)
        store_f32(out + i, load_f32(x + i) * inverse * load_f32(w + i));
    for (; i < n; i++) out[i] = x[i] * inverse * w[i];
}

/* turns [r]: the cos and sin of pos * frequency i, scaled (export/rope.py), for each pair i: one position's rope */
static void rope_turns(const float *frequencies, int r, int pos, float scale, float *turns) {
    for (int i = 0; i < r / 2; i++) {
        float angle = (float)pos * frequencies[i];
        turns[2 * i] = cosf(angle) * scale; turns[2 * i + 1] = sinf(angle) * scale;
    }
}

/* interleaved pairs (x[2i], x[2i+1]) rotated by rope_turns' pair i */
static void rope(float *x, int r, const float *turns) {
    for (int i = 0; i < r / 2; i++) {
        float c = turns[2 * i], s = turns[2 * i + 1], even = x[2 * i], odd = x[2 * i + 1];
        x[2 * i] = even * c - odd * s; x[2 * i + 1] = odd * c + even * s;
    }
}

/* silu(x) = x / (1 + exp(-x)) of each lane, through exp_lanes of -|x|: x / (1 + e) where x >= 0, x e / (e + 1) below */
static inline vf32 silu_lanes(vf32 x) {
    vf32 e = exp_lanes((vf32)((vi32)x | (vi32)splat_f32(-0.0f)));
    return (vf32)pick(x < 0, (vi32)(x * e), (vi32)x) / (1.0f + e);
}

#define DOT_ROWS 4  /* rows dots_f32 takes against one vector at once */

/* out[j] = a[j] . b over n floats for `rows` (1 .. DOT_ROWS) vectors a[j], each a vector of lanes at a time (a plain
   sum would chain every add on the one before), then its lanes in order: b's loads shared, each dot's own steps */
static void dots_f32(const float *const *a, int rows, const float *b, int n, float *out) {
    int i = 0;
    vf32 acc[DOT_ROWS] = {{0}};
    for (; i + LANES <= n; i += LANES) {
        vf32 w = load_f32(b + i);
        for (int j = 0; j < DOT_ROWS; j++)
            if (j < rows) acc[j] += load_f32(a[j] + i) * w;
    }
    for (int j = 0; j < rows; j++) {
        float total = 0;
        for (int l = 0; l < LANES; l++) total += acc[j][l];
        for (int t = i; t < n; t++) total += a[j][t] * b[t];
        out[j] = total;
    }
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

static size_t cache_row_of(const int64_t *table, int t) { return (size_t)table[t / PAGE] * PAGE + t % PAGE; }
static size_t cache_row(const Attention *a, int t) { return cache_row_of(a->table, t); }

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
                HELD(row);
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
static inline v8f fma8(v8f a, v8f b, v8f c) {  /* a x b + c, fused as fma_f32 is */
#if defined(__FMA__) && defined(__AVX__)
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif FUSED_MULTIPLY_ADD
    v8f out;
    for (int i = 0; i < 8; i++) out[i] = fmaf(a[i], b[i], c[i]);
    return out;
#else
    return a * b + c;
#endif
}
static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }  /* (not 0 + x: a sum, where -0 becomes +0
                                                                                 and a product of it changes no run) */

/* out [h] = each head's roped query . one position's rope key, q_pe [r, h] (heads side by side): the products added
   in the order of i, one by one from 0: one order on every instruction set, for any number of heads, whatever the
   threads (tile_rope_scores keeps it too) */
static void rope_scores(const float *q_pe, const float *k, int r, int h, float *out) {
    int j = 0;
    for (; j + 8 <= h; j += 8) {
        v8f sum = {0}, q;
        for (int i = 0; i < r; i++) {
            memcpy(&q, q_pe + (size_t)i * h + j, sizeof q);
            sum = fma8(q, splat8(k[i]), sum);
        }
        memcpy(out + j, &sum, sizeof sum);
    }
    for (; j < h; j++) {
        float sum = 0;
        for (int i = 0; i < r; i++) sum = FUSED_MULTIPLY_ADD ? fmaf(q_pe[(size_t)i * h + j], k[i], sum)
                                                               : q_pe[(size_t)i * h + j] * k[i] + sum;
        out[j] = sum;
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

/* phase 3, positions: exp(score - the head's largest) (exp_lanes), summed per chunk */
static void exp_task(void *arg, int tid, int threads) {
    Attention *a = arg;
    int t0, t1, heads = a->d->heads, keys = a->keys, chunks = (keys + CHUNK - 1) / CHUNK;
    position_share(keys, tid, threads, &t0, &t1);
    for (int j = 0; j < heads; j++) {
        float largest = largest_of(a->largest, threads, heads, j), *s = a->scores + (size_t)j * keys;
        for (int c0 = t0; c0 < t1; c0 += CHUNK) {
            float total = 0;
            exp_run(s + c0, MIN(c0 + CHUNK, t1) - c0, largest, s + c0);
            for (int t = c0; t < MIN(c0 + CHUNK, t1); t++) total += s[t];
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

/* ---- attention for a run of queries over one sequence's pages (a prompt's chunk, drafted tokens) ----------------
   The queries' heads are rows (query i, head j: row i h + j), ROW_TILE rows a tile, and each thread takes whole
   tiles: no phase waits on another thread. A tile's latent queries are interleaved, four codes of one row a lane,
   so that a cached row's four codes, broadcast, meet LANES rows in one dot4 (the scores are a product of the tile and the cache, read once a tile);
   the probability bytes of four positions are interleaved a word a row, and a page's codes four positions a lane
   (interleave4, as values() takes them), so that one dot4 adds four positions' products for a run of columns (the
   values are a product too). Every row takes exactly the float steps, in the same order, that attention() takes for
   its query alone, and the integer sums are exact: each query's result is the one it gets alone. */

#define ROW_TILE VBYTES            /* rows of a tile: one probability byte a row fills a vector */
#define ROW_VECTORS 4              /* vectors of a tile's rows (ROW_TILE / LANES) */
#define SCORE_POSITIONS (VBYTES == 64 ? 4 : 2)  /* cached positions a pass of block_scores() takes */
#define VALUE_ROWS (VBYTES == 64 ? 4 : 2)       /* rows a pass of block_values() takes */

typedef struct {
    const K2Dims *d; const K2Layer *l; const K2Pages *pages; const int64_t *table;
    int n;                    /* queries */
    const int *pos;           /* [n] query i at position pos[i]: it attends to positions 0 .. pos[i] */
    const float *q;           /* [n, h, d + r]: q_nope, q_pe (roped) per head */
    float *out;               /* [n, h, v] */
    int tiles;
    char *own; size_t own_bytes;  /* thread t's own scratch: own + t * own_bytes */
    atomic_int next;          /* tiles taken so far (next_grain) */
} Block;

typedef struct {              /* one tile's scratch */
    Quant nope[COLUMN_INPUTS], lat, back[COLUMN_INPUTS];  /* rows of one head, COLUMN_INPUTS at a time */
    float *q_lat[COLUMN_INPUTS], *x;                      /* [c] */
    int8_t *codes;            /* [c / 4, ROW_TILE, 4] the rows' latent query codes, four columns a lane */
    float *scale, *q_pe;      /* [ROW_TILE] each row's latent query scale; [r, ROW_TILE] the rows' roped queries */
    int32_t *sum;             /* [ROW_TILE] each row's latent query code sum */
    int *keys;                /* [ROW_TILE] positions each row attends to (0 for a row past the queries) */
    float *k_pe, *rope;       /* [SCORE_POSITIONS, r] positions' rope keys, [SCORE_POSITIONS, ROW_TILE] their scores */
    float *scores;            /* [keys, ROW_TILE]: scores, exponentials, probabilities */
    float *probability_scale; /* [ROW_TILE] */
    uint8_t *words;           /* [keys / 4, ROW_TILE, 4] probability bytes, four positions a row (interleave4) */
    int8_t *quads;            /* [PAGE / 4, 4, VBYTES] a page's codes - 128 for a run of VBYTES columns */
    int32_t *values;          /* [ROW_TILE, c] value sums, columns at value_slot */
    int32_t *code_sums;       /* [c] codes summed over the positions taken (at value_slot), where DOT_BIAS < 128 */
} Tile;

static Tile tile_scratch(const K2Dims *d, Bump *b) {
    Tile t;
    int c = d->latent;
    for (int i = 0; i < COLUMN_INPUTS; i++) {
        t.nope[i] = quant(b, d->nope, d->nope); t.back[i] = quant(b, c, c); t.q_lat[i] = take(b, c * 4);
    }
    t.lat = quant(b, c, c); t.x = take(b, c * 4);
    t.codes = take(b, (size_t)c * ROW_TILE);
    t.scale = take(b, ROW_TILE * 4); t.q_pe = take(b, (size_t)d->rope * ROW_TILE * 4);
    t.sum = take(b, ROW_TILE * 4); t.keys = take(b, ROW_TILE * 4);
    t.k_pe = take(b, (size_t)SCORE_POSITIONS * d->rope * 4); t.rope = take(b, (size_t)SCORE_POSITIONS * ROW_TILE * 4);
    t.scores = take(b, (size_t)d->max_len * ROW_TILE * 4);
    t.probability_scale = take(b, ROW_TILE * 4);
    t.words = take(b, ((size_t)d->max_len + 3) / 4 * ROW_TILE * 4);
    t.quads = take(b, (size_t)PAGE * VBYTES);
    t.values = take(b, (size_t)ROW_TILE * c * 4);
    t.code_sums = take(b, (size_t)c * 4);
    return t;
}

static size_t block_own_bytes(const K2Dims *d) {
    char *base = (char *)64;  /* take() only counts: the sizes from an aligned base */
    Bump b = {base};
    tile_scratch(d, &b);
    return (size_t)(b.at - base) + 64;
}

/* the tile's rows' latent queries (as absorb_task makes them), interleaved; their roped queries side by side ->
   the most positions a row attends to */
static int block_queries(const Block *a, int first, Tile *t) {
    const K2Dims *d = a->d;
    int h = d->heads, c = d->latent, qk = d->nope + d->rope, rows = a->n * h, most = 0;
    memset(t->codes, 0, (size_t)c * ROW_TILE);
    for (int rr = 0; rr < ROW_TILE; rr++) {
        int row = first + rr;
        if (row >= rows) {
            t->keys[rr] = 0; t->scale[rr] = 0; t->sum[rr] = 0;
            for (int k = 0; k < d->rope; k++) t->q_pe[(size_t)k * ROW_TILE + rr] = 0;
            continue;
        }
        const float *q = a->q + (size_t)row * qk;
        for (int k = 0; k < d->rope; k++) t->q_pe[(size_t)k * ROW_TILE + rr] = q[d->nope + k];
        t->keys[rr] = a->pos[row / h] + 1;
        most = MAX(most, t->keys[rr]);
    }
    for (int head_at = 0; head_at < MIN(h, ROW_TILE); head_at++) {  /* the rows head_at, head_at + h, ...: one head's */
        int j = (first + head_at) % h, same[ROW_TILE], count = 0;
        for (int rr = head_at; rr < ROW_TILE && first + rr < rows; rr += h) same[count++] = rr;
        for (int i0 = 0; i0 < count; i0 += COLUMN_INPUTS) {
            int n = MIN(COLUMN_INPUTS, count - i0);
            for (int i = 0; i < n; i++) quantize(a->q + (size_t)(first + same[i0 + i]) * qk, &t->nope[i]);
            columns_inputs(a->l->w_uk + (size_t)j * d->nope * c, a->l->uk_s + (size_t)j * c, c, t->nope, n, t->q_lat);
            for (int i = 0; i < n; i++) {
                int rr = same[i0 + i];
                quantize(t->q_lat[i], &t->lat);
                for (int g = 0; g < c / 4; g++) memcpy(t->codes + ((size_t)g * ROW_TILE + rr) * 4, t->lat.q + 4 * g, 4);
                t->scale[rr] = t->lat.s[0]; t->sum[rr] = t->lat.sum[0];
            }
        }
    }
    return most;
}

/* out [count, ROW_TILE] = rope_scores() of the tile's rows (q_pe [r, ROW_TILE]) and each of `count` positions' rope
   keys k [count, r] (count a constant where it is called), the same sums in the same order for each row: each
   vector of the rows' queries loaded once for the positions */
static inline __attribute__((always_inline)) void tile_rope_scores(const float *q_pe, const float *k, int r,
                                                                    const int count, float *out) {
    vf32 sum[SCORE_POSITIONS][ROW_VECTORS];
    for (int p = 0; p < count; p++)
        for (int v = 0; v < ROW_VECTORS; v++) sum[p][v] = (vf32){0};
    for (int i = 0; i < r; i++) {
        vf32 q[ROW_VECTORS];
        for (int v = 0; v < ROW_VECTORS; v++) {
            q[v] = load_f32(q_pe + (size_t)i * ROW_TILE + LANES * v);
            HELD(q[v]);
        }
        for (int p = 0; p < count; p++) {
            vf32 key = splat_f32(k[(size_t)p * r + i]);
            for (int v = 0; v < ROW_VECTORS; v++) sum[p][v] = fma_f32(q[v], key, sum[p][v]);
        }
    }
    for (int p = 0; p < count; p++)
        for (int v = 0; v < ROW_VECTORS; v++) store_f32(out + (size_t)p * ROW_TILE + LANES * v, sum[p][v]);
}

/* scores [keys, ROW_TILE]: each row's score of each position it attends to, as scores_task gives it (the integer
   latent product times the two scales, plus the rope product, times the softmax scale) */
static void block_scores(const Block *a, Tile *t, int keys) {
    const K2Dims *d = a->d;
    int c = d->latent;
    for (int t0 = 0; t0 < keys; t0 += SCORE_POSITIONS) {
        int count = MIN(SCORE_POSITIONS, keys - t0);
        const uint8_t *row[SCORE_POSITIONS];
        for (int p = 0; p < SCORE_POSITIONS; p++)
            row[p] = a->pages->latent + cache_row_of(a->table, t0 + MIN(p, count - 1)) * c;
        for (int p = t0 + SCORE_POSITIONS; p < MIN(t0 + 2 * SCORE_POSITIONS, keys); p++)  /* the next group's rows */
            for (int at = 0; at < c; at += 64) __builtin_prefetch(a->pages->latent + cache_row_of(a->table, p) * c + at);
        vi32 acc[SCORE_POSITIONS][ROW_VECTORS];
        for (int p = 0; p < SCORE_POSITIONS; p++)
            for (int v = 0; v < ROW_VECTORS; v++) acc[p][v] = (vi32){0};
        for (int g = 0; g < c / 4; g++) {
            vi8 q[ROW_VECTORS];
            for (int v = 0; v < ROW_VECTORS; v++) {
                q[v] = load_i8(t->codes + (size_t)g * ROW_TILE * 4 + VBYTES * v);
                HELD(q[v]);
            }
            for (int p = 0; p < SCORE_POSITIONS; p++) {
                vu8 w = (vu8)splat4(row[p] + 4 * g);
                for (int v = 0; v < ROW_VECTORS; v++) acc[p][v] = dot4(acc[p][v], w, q[v]);
            }
        }
        for (int p = 0; p < count; p++)  /* the cached float16 rope keys */
            halves_to_floats(a->pages->rope + cache_row_of(a->table, t0 + p) * d->rope, d->rope, t->k_pe + p * d->rope);
        if (count == SCORE_POSITIONS) tile_rope_scores(t->q_pe, t->k_pe, d->rope, SCORE_POSITIONS, t->rope);
        else for (int p = 0; p < count; p++) tile_rope_scores(t->q_pe, t->k_pe + p * d->rope, d->rope, 1, t->rope + p * ROW_TILE);
        for (int p = 0; p < count; p++) {
            float token_scale = a->pages->scale[cache_row_of(a->table, t0 + p)];
            float *s = t->scores + (size_t)(t0 + p) * ROW_TILE;
            for (int v = 0; v < ROW_VECTORS; v++) {
                vi32 sums = acc[p][v] - DOT_BIAS * load_i32(t->sum + LANES * v);
                vf32 latent_score = __builtin_convertvector(sums, vf32) * load_f32(t->scale + LANES * v) * token_scale;
                store_f32(s + LANES * v, (latent_score + load_f32(t->rope + (size_t)p * ROW_TILE + LANES * v)) *
                                         d->softmax_scale);
            }
        }
    }
}

/* the scores -> probabilities (softmax times each position's scale, as exp_task and probabilities_task give them)
   -> their bytes (as values_task rounds them), interleaved four positions a row; 0 past a row's positions */
static void block_probabilities(const Block *a, Tile *t, int keys) {
    vf32 largest[ROW_VECTORS], total[ROW_VECTORS], peak[ROW_VECTORS];
    vi32 row_keys[ROW_VECTORS];
    for (int v = 0; v < ROW_VECTORS; v++) {
        largest[v] = (vf32){0} - INFINITY; total[v] = (vf32){0}; peak[v] = (vf32){0};
        row_keys[v] = load_i32(t->keys + LANES * v);
    }
    for (int p = 0; p < keys; p++)
        for (int v = 0; v < ROW_VECTORS; v++) {
            vf32 s = load_f32(t->scores + (size_t)p * ROW_TILE + LANES * v);
            largest[v] = (vf32)pick((splat_i32(p) < row_keys[v]) & ~(largest[v] > s), (vi32)s, (vi32)largest[v]);
        }
    for (int c0 = 0; c0 < keys; c0 += CHUNK) {  /* exp(score - largest), summed a chunk at a time, the chunks in order */
        vf32 chunk[ROW_VECTORS];
        for (int v = 0; v < ROW_VECTORS; v++) chunk[v] = (vf32){0};
        for (int p = c0; p < MIN(c0 + CHUNK, keys); p++)
            for (int v = 0; v < ROW_VECTORS; v++) {
                float *s = t->scores + (size_t)p * ROW_TILE + LANES * v;
                vf32 e = (vf32)((vi32)exp_lanes(load_f32(s) - largest[v]) & (splat_i32(p) < row_keys[v]));
                store_f32(s, e);
                chunk[v] += e;
            }
        for (int v = 0; v < ROW_VECTORS; v++) total[v] += chunk[v];
    }
    for (int p = 0; p < keys; p++) {
        float token_scale = a->pages->scale[cache_row_of(a->table, p)];
        for (int v = 0; v < ROW_VECTORS; v++) {
            float *s = t->scores + (size_t)p * ROW_TILE + LANES * v;
            vf32 probability = load_f32(s) / total[v] * token_scale;
            probability = (vf32)((vi32)probability & (splat_i32(p) < row_keys[v]));
            store_f32(s, probability);
            peak[v] = (vf32)pick(peak[v] > probability, (vi32)peak[v], (vi32)probability);
        }
    }
    vf32 inverse[ROW_VECTORS];
    const vf32 rounder = (vf32){0} + ROUNDER;
    for (int v = 0; v < ROW_VECTORS; v++) {
        vf32 scale = peak[v] / 255.0f, least = (vf32){0} + 1e-30f;
        scale = (vf32)pick(scale > least, (vi32)scale, (vi32)least);
        store_f32(t->probability_scale + LANES * v, scale);
        inverse[v] = 1.0f / scale;
    }
    for (int p0 = 0; p0 < keys; p0 += 4) {
        vi8 r[4], quad[4];
        for (int k = 0; k < 4; k++) {
            vi32 bytes[ROW_VECTORS];
            for (int v = 0; v < ROW_VECTORS; v++) {
                vi32 q = {0};
                if (p0 + k < keys) {
                    q = __builtin_convertvector((load_f32(t->scores + (size_t)(p0 + k) * ROW_TILE + LANES * v) *
                                                 inverse[v] + rounder) - rounder, vi32);
                    q = pick(q > 255, splat_i32(255), q);
                    q = pick(q < 0, splat_i32(0), q);
                }
                bytes[v] = q;
            }
            for (int v = 0; v < ROW_VECTORS; v++) {
                vq8 narrow = __builtin_convertvector(bytes[v], vq8);
                memcpy((int8_t *)&r[k] + LANES * v, &narrow, LANES);
            }
        }
        interleave4(r, quad);
        for (int k = 0; k < 4; k++) memcpy(t->words + (size_t)p0 * ROW_TILE + VBYTES * k, &quad[k], VBYTES);
    }
}

/* values [ROW_TILE, c] = each row's probability bytes times the codes - 128 of the positions it attends to, exact;
   a page's codes interleaved once for the tile's rows, VALUE_ROWS rows a pass */
static void block_values(const Block *a, Tile *t, int keys) {
    int c_dim = a->d->latent;
    memset(t->values, 0, (size_t)ROW_TILE * c_dim * 4);
    memset(t->code_sums, 0, (size_t)c_dim * 4);
    const vu8 ones = (vu8){0} + (uint8_t)(129 - DOT_BIAS);  /* dot4 takes them as 1 */
    for (int t0 = 0; t0 < keys; t0 += PAGE) {
        int rows = MIN(keys, t0 + PAGE) - t0, groups = (rows + 3) / 4;
        const uint8_t *page = a->pages->latent + cache_row_of(a->table, t0) * c_dim;
        const uint8_t *next = t0 + PAGE < keys ? a->pages->latent + cache_row_of(a->table, t0 + PAGE) * c_dim : NULL;
        for (int c = 0; c < c_dim; c += VBYTES) {
            if (next)  /* the next page's run of these columns, while this one's are multiplied */
                for (int row = 0; row < MIN(PAGE, keys - t0 - PAGE); row++) __builtin_prefetch(next + (size_t)row * c_dim + c);
            vi32 codes[4] = {{0}};
            for (int g = 0; g < groups; g++) {
                vi8 r[4], quad[4];
                for (int k = 0; k < 4; k++)  /* a missing position: code 0 (its probability byte is 0 too) */
                    r[k] = 4 * g + k < rows ? (vi8)(load_u8(page + (size_t)(4 * g + k) * c_dim + c) ^ 0x80) : (vi8){0};
                interleave4(r, quad);
                for (int k = 0; k < 4; k++) {
                    memcpy(t->quads + ((size_t)g * 4 + k) * VBYTES, &quad[k], VBYTES);
                    if (DOT_BIAS != 128) codes[k] = dot4(codes[k], ones, quad[k]);
                }
            }
            for (int k = 0; k < 4; k++) store_i32(t->code_sums + c + LANES * k, load_i32(t->code_sums + c + LANES * k) + codes[k]);
            for (int r0 = 0; r0 < ROW_TILE; r0 += VALUE_ROWS) {
                vi32 acc[VALUE_ROWS][4];
                for (int j = 0; j < VALUE_ROWS; j++)
                    for (int k = 0; k < 4; k++) acc[j][k] = (vi32){0};
                const uint8_t *words = t->words + (size_t)t0 * ROW_TILE;
                for (int g = 0; g < groups; g++) {
                    vi8 quad[4];
                    for (int k = 0; k < 4; k++) {
                        quad[k] = load_i8(t->quads + ((size_t)g * 4 + k) * VBYTES);
                        HELD(quad[k]);
                    }
                    for (int j = 0; j < VALUE_ROWS; j++) {
                        vu8 w = (vu8)splat4(words + ((size_t)g * ROW_TILE + interleaved_slot(r0 + j)) * 4);
                        for (int k = 0; k < 4; k++) acc[j][k] = dot4(acc[j][k], w, quad[k]);
                    }
                }
                for (int j = 0; j < VALUE_ROWS; j++)
                    for (int k = 0; k < 4; k++) {
                        int32_t *out = t->values + (size_t)(r0 + j) * c_dim + c + LANES * k;
                        store_i32(out, load_i32(out) + acc[j][k]);
                    }
            }
        }
    }
}

/* each row's value sums (plus (128 - DOT_BIAS) x the codes' sums: dot4 took the bytes as p - 128 + DOT_BIAS) times
   its probability scale, quantised, through its head's W_UV (as output_task) */
static void block_output(const Block *a, Tile *t, int first) {
    const K2Dims *d = a->d;
    int h = d->heads, c_dim = d->latent, rows = a->n * h;
    for (int head_at = 0; head_at < MIN(h, ROW_TILE); head_at++) {  /* one head's rows together, as block_queries */
        int j = (first + head_at) % h, same[ROW_TILE], count = 0;
        for (int rr = head_at; rr < ROW_TILE && first + rr < rows; rr += h) same[count++] = rr;
        for (int i0 = 0; i0 < count; i0 += COLUMN_INPUTS) {
            int n = MIN(COLUMN_INPUTS, count - i0);
            float *out[COLUMN_INPUTS];
            for (int i = 0; i < n; i++) {
                int rr = same[i0 + i];
                const int32_t *sums = t->values + (size_t)rr * c_dim;
                float scale = t->probability_scale[rr];
                for (int c = 0; c < c_dim; c++) {
                    int slot = value_slot(c_dim, c);
                    t->x[c] = (float)(sums[slot] + (128 - DOT_BIAS) * t->code_sums[slot]) * scale;
                }
                quantize(t->x, &t->back[i]);
                out[i] = a->out + (size_t)(first + rr) * d->v;
            }
            columns_inputs(a->l->w_uv + (size_t)j * c_dim * d->v, a->l->uv_s + (size_t)j * d->v, d->v, t->back, n, out);
        }
    }
}

static void block_task(void *arg, int tid, int threads) {
    Block *a = arg;
    Bump b = {a->own + a->own_bytes * tid};
    Tile t = tile_scratch(a->d, &b);
    (void)threads;
    for (int taken; (taken = next_grain(&a->next)) < a->tiles;) {
        int tile = a->tiles - 1 - taken;  /* the last first: later tiles attend further, the cheap ones fill in */
        int keys = block_queries(a, tile * ROW_TILE, &t);
        block_scores(a, &t, keys);
        block_probabilities(a, &t, keys);
        block_values(a, &t, keys);
        block_output(a, &t, tile * ROW_TILE);
    }
}

/* attention() for n queries of one sequence (query i at pos[i], its entry already in its page), q [n, h, d + r]
   -> out [n, h, v]: each query's the one attention() gives it alone */
static void block_attention(const K2Dims *d, const K2Layer *l, const K2Pages *pages, const int64_t *table, int n,
                            const int *pos, const float *q, float *out, char *scratch) {
    Block a = {.d = d, .l = l, .pages = pages, .table = table, .n = n, .pos = pos, .q = q, .out = out,
               .tiles = (n * d->heads + ROW_TILE - 1) / ROW_TILE, .own = scratch, .own_bytes = block_own_bytes(d)};
    run(block_task, &a);
}

/* the attention's scratch for `threads` threads, in bytes: a query's alone, or a run's tiles */
static size_t step_attention_bytes(const K2Dims *d, int threads) {
    return MAX(attention_bytes(d, threads), (size_t)threads * block_own_bytes(d) + 64);
}

/* ---- routing ---------------------------------------------------------------------------------------------- */

typedef struct { const float *router, *x; float *scores; int experts, hidden, batch; } Router; /* x [batch, m] */

static void router_task(void *arg, int tid, int threads) {  /* scores [batch, e] */
    Router *r = arg;
    int start, stop;
    share(r->experts, tid, threads, &start, &stop);
    for (int e = start; e < stop; e++)
        for (int b = 0; b < r->batch; b += DOT_ROWS) {
            int rows = MIN(DOT_ROWS, r->batch - b);
            const float *x[DOT_ROWS];
            float s[DOT_ROWS];
            for (int j = 0; j < rows; j++) x[j] = r->x + (size_t)(b + j) * r->hidden;
            dots_f32(x, rows, r->router + (size_t)e * r->hidden, r->hidden, s);
            for (int j = 0; j < rows; j++) r->scores[(size_t)(b + j) * r->experts + e] = 1.0f / (1.0f + expf(-s[j]));
        }
}

/* the k best of values (ties to the lower index) -> ids in order, best first */
static void top_k(const float *values, int n, int k, int *ids) {
    unsigned char taken[n];
    memset(taken, 0, (size_t)n);
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++)
            if (!taken[i] && (best < 0 || values[i] > values[best])) best = i;
        ids[j] = best;
        taken[best] = 1;
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

typedef struct { const float *x, *w; int k; float eps; Quant *q; } Rows;

static void quantize_row(void *arg, int row, char *own) {
    const Rows *r = arg;
    const float *x = r->x + (size_t)row * r->k;
    if (r->w) { rms_norm(x, r->w, r->k, r->eps, (float *)own); x = (const float *)own; }
    quantize(x, &r->q[row]);
}

/* x [batch, k] rows, each normalised by w (NULL: as it is) and quantised in blocks -> [batch] int8 inputs */
static Quant *quantize_rows(const float *x, int batch, int k, const float *w, float eps, int block, Bump *b) {
    Quant *q = take(b, batch * sizeof(Quant));
    for (int s = 0; s < batch; s++) q[s] = quant(b, k, block);
    Rows rows = {x, w, k, eps, q};
    each_row(quantize_row, &rows, batch, (size_t)k * 4, b);
    return q;
}

typedef struct {            /* SwiGLU's activations of `count` inputs (gate and up rows of `width`, every `step`-th
                               value from gate and up, input j at j x stride) -> their inputs of the down product */
    const float *gate, *up; size_t stride; int step, count, width, bits;
    Quant *h;                 /* [count] */
} Activations;

typedef struct { int parts; const Activations *part; const int *first; } AllActivations;  /* first [parts + 1] */

static void activation_row(void *arg, int row, char *own) {
    const AllActivations *all = arg;
    int lo = 0, hi = all->parts - 1;
    while (lo < hi) {  /* the part that holds this row */
        int mid = (lo + hi + 1) / 2;
        if (all->first[mid] <= row) lo = mid; else hi = mid - 1;
    }
    const Activations *a = &all->part[lo];
    int j = row - all->first[lo];
    const float *g = a->gate + (size_t)j * a->stride, *u = a->up + (size_t)j * a->stride;
    int padded = (a->width + LANES - 1) / LANES * LANES;
    float *act = (float *)own, *gate = act + padded, *up = gate + padded;
    int i = 0;
    if (a->step == 2 && u == g + 1) {  /* gate and up interleaved: a vector of each from two of pairs */
        vi32 even, odd;
        for (int l = 0; l < LANES; l++) { even[l] = 2 * l; odd[l] = 2 * l + 1; }
        for (; i + LANES <= a->width; i += LANES) {
            vf32 first = load_f32(g + 2 * (size_t)i), second = load_f32(g + 2 * (size_t)i + LANES);
            store_f32(gate + i, __builtin_shuffle(first, second, even));
            store_f32(up + i, __builtin_shuffle(first, second, odd));
        }
    }
    for (; i < padded; i++) {  /* gathered (every step-th value), the last vector padded with zeros */
        gate[i] = i < a->width ? g[(size_t)a->step * i] : 0;
        up[i] = i < a->width ? u[(size_t)a->step * i] : 0;
    }
    for (int i = 0; i < padded; i += LANES) store_f32(act + i, silu_lanes(load_f32(gate + i)) * load_f32(up + i));
    quantize(act, &a->h[j]);
    if (a->bits == 4) by_nibbles(&a->h[j]);
}

/* each part's activations (silu(gate) * up, quantised in blocks of `block`), over the pool */
static void activations(Activations *part, int parts, int block, int widest, Bump *b) {
    int *first = take(b, (size_t)(parts + 1) * 4);
    first[0] = 0;
    for (int u = 0; u < parts; u++) {
        part[u].h = take(b, part[u].count * sizeof(Quant));
        for (int j = 0; j < part[u].count; j++) part[u].h[j] = quant(b, part[u].width, block);
        first[u + 1] = first[u] + part[u].count;
    }
    AllActivations all = {parts, part, first};
    each_row(activation_row, &all, first[parts], (size_t)3 * (widest + LANES) * 4, b);
}

typedef struct {
    const K2Dims *d; const K2Layer *l; const float *scores, *xn; int *chosen; float *weight; int terms; Quant *xe;
} Routing;

static void route_row(void *arg, int s, char *own) {  /* sequence s's experts and weights, and its input to them */
    (void)own;
    const Routing *r = arg;
    int k = r->d->top_k;
    route(r->d, r->scores + (size_t)s * r->l->experts, r->l->bias, r->l->experts, r->chosen + s * k,
          r->weight + s * r->terms);
    quantize(r->xn + (size_t)s * r->d->hidden, &r->xe[s]);
    if (r->l->bits == 4) by_nibbles(&r->xe[s]);
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
        for (int s = 0; s < batch; s++) xe[s] = quant(&b, m, l->block);
        Routing routing = {d, l, scores, xn, chosen, weight, terms, xe};
        each_row(route_row, &routing, batch, 0, &b);
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
        Quant *xd = quantize_rows(xn, batch, m, NULL, 0, l->gate.block, &b);
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
    Activations *act = take(&b, (size_t)(x.parts + 1) * sizeof(Activations));
    for (int u = 0; u < x.parts; u++)  /* the gate and up rows interleaved */
        act[u] = (Activations){out[u], out[u] + 1, x.up[u].n, 2, x.count[u], l->width, l->bits, NULL};
    if (x.parts) activations(act, x.parts, l->block, l->width, &b);
    if (dense) {
        Activations shared = {out[x.parts], out[x.parts + 1], l->gate.n, 1, batch, l->gate.n, 8, NULL};
        activations(&shared, 1, l->down.block, l->gate.n, &b);
        act[x.parts] = shared;
    }
    for (int u = 0; u < x.parts; u++) {
        down_lin[u] = x.down[u]; down_count[u] = x.count[u]; down_in[u] = act[u].h;
        down_out[u] = take(&b, (size_t)x.count[u] * m * 4);
    }
    for (int i = 0; i < batch * k; i++)
        term[(i / k) * terms + i % k] = down_out[x.part[i]] + (size_t)x.slot[i] * m;
    if (dense) {
        down_lin[x.parts] = l->down; down_count[x.parts] = batch; down_in[x.parts] = act[x.parts].h;
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
        pages->latent[row * d->latent + c] = (uint8_t)(q + 128);
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
    const long values[] = {PAGE, TILE, MAX_TOP_K, MAX_GROUPS, MAX_EXPERTS, MAX_THREADS, sizeof(K2Lin), sizeof(K2Dims),
                           sizeof(K2Layer), sizeof(K2Model), sizeof(K2Pages)};
    return what >= 0 && what < (int)(sizeof values / sizeof values[0]) ? values[what] : -1;
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

/* ---- the ops one by one: each the step's own code on plain arrays, for tests/test_native_ops.py to check against
   its eager reference (plugins/, export/rope.py) at every instruction-set level; none is on the step's path ---- */

/* out [rows, n] = each row of x [rows, n] normalised by w [n] (rms_norm) */
void k2_op_rms_norm(const float *x, const float *w, int rows, int n, float eps, float *out) {
    for (int r = 0; r < rows; r++) rms_norm(x + (size_t)r * n, w, n, eps, out + (size_t)r * n);
}

/* x [rows, r] roped in place, row i at position pos[i] (rope_turns, then rope) */
void k2_op_rope(float *x, int rows, int r, const float *frequencies, const int *pos, float scale) {
    float turns[r];
    for (int i = 0; i < rows; i++) {
        rope_turns(frequencies, r, pos[i], scale, turns);
        rope(x + (size_t)i * r, r, turns);
    }
}

/* x [n, m] through the router [e, m] and its correction bias [e] -> each token's top_k experts ids [n, top_k] and
   their weights [n, top_k] (router_task, then route); -1 where the settings pass the step's limits */
int k2_op_route(const float *x, int n, int m, const float *router, const float *bias, int experts, int top_k,
                int n_group, int topk_group, int normalise, float scaling, int *ids, float *weights) {
    if (experts > MAX_EXPERTS || top_k > MAX_TOP_K || n_group > MAX_GROUPS || n_group < 1) return -1;
    K2Dims d = {.hidden = m, .top_k = top_k, .n_group = n_group, .topk_group = topk_group, .normalise = normalise,
                .scaling = scaling};
    float *scores = malloc((size_t)n * experts * sizeof(float));
    if (!scores) return -1;
    Router r = {router, x, scores, experts, m, n};
    run(router_task, &r);
    for (int s = 0; s < n; s++) route(&d, scores + (size_t)s * experts, bias, experts, ids + s * top_k, weights + s * top_k);
    free(scores);
    return 0;
}

/* y [batch, n] = x [batch, k], each row quantised in blocks of `block` as the step quantises its inputs, times the
   weight held in tiles (w, ws: K2Lin, `bits` 8 or 4) */
int k2_op_linear(const uint8_t *w, const float *ws, int n, int k, int block, int bits, const float *x, int batch,
                 float *y) {
    size_t per = (size_t)k + 2 * (size_t)(k / block) * 4 + 3 * 64;
    char *scratch = malloc(batch * (sizeof(Quant) + per) + 128);  /* + the alignment and the array's rounding */
    if (!scratch) return -1;
    Bump b = {(char *)(((uintptr_t)scratch + 63) / 64 * 64)};
    Quant *in = (Quant *)take(&b, batch * sizeof(Quant));
    for (int s = 0; s < batch; s++) {
        in[s] = quant(&b, k, block);
        quantize(x + (size_t)s * k, &in[s]);
        if (bits == 4) by_nibbles(&in[s]);
    }
    K2Lin l = {w, ws, n, k, block, bits};
    one_product(&l, batch, in, y);
    free(scratch);
    return 0;
}

/* y [batch, m] = mlp() of xn [batch, m] through layer l: a dense layer's MLP, or the routed experts (routing
   included) and the shared one's; -1 where the settings pass the step's limits */
int k2_op_mlp(const K2Dims *d, const K2Layer *l, int batch, const float *xn, float *y) {
    if (batch < 1 || d->top_k > MAX_TOP_K || d->n_group > MAX_GROUPS || d->n_group < 1 ||
        (l->moe && (l->experts > MAX_EXPERTS || (l->bits != 8 && l->bits != 4))))
        return -1;
    K2Model model = {.d = *d, .layers = 1, .layer = l};
    char *scratch = malloc((size_t)k2_scratch_floats(&model, pool.threads ? pool.threads : 1, batch) * 4 + 64);
    if (!scratch) return -1;
    Bump b = {(char *)(((uintptr_t)scratch + 63) / 64 * 64)};
    mlp(d, l, batch, xn, y, b);
    free(scratch);
    return 0;
}

/* out [n, h, v] = the absorbed attention of n queries of one sequence, q [n, h, d + r] (q_nope, roped q_pe), query
   i at position pos[i] over positions 0 .. pos[i] of its pages (table): each alone (attention()), or, together != 0,
   all as one run of tiles (block_attention(), which needs the latent a multiple of VBYTES); -1 on a bad argument */
int k2_op_attention(const K2Dims *d, const K2Layer *l, const K2Pages *pages, const int64_t *table, int n,
                    const int *pos, const float *q, float *out, int together) {
    if (n < 1 || (together && d->latent % VBYTES)) return -1;
    for (int i = 0; i < n; i++)
        if (pos[i] < 0 || pos[i] >= d->max_len) return -1;
    char *scratch = malloc(step_attention_bytes(d, pool.threads ? pool.threads : 1) + 64);
    if (!scratch) return -1;
    char *aligned = (char *)(((uintptr_t)scratch + 63) / 64 * 64);
    int qk = d->nope + d->rope;
    if (together) block_attention(d, l, pages, table, n, pos, q, out, aligned);
    else
        for (int i = 0; i < n; i++)
            attention(d, l, pages, table, pos[i] + 1, q + (size_t)i * d->heads * qk, out + (size_t)i * d->heads * d->v,
                      aligned);
    free(scratch);
    return 0;
}
