/* The pool of threads a step's phases are split over, and the cores' leases.
   One part of the native step's source: decode_step.c includes the parts in order, one translation unit,
   so that the compiler inlines across them. */

#define SPIN_SECONDS 2e-3 /* a worker idle this long sleeps until the next phase */
#define STARVED_SECONDS 1e-3 /* a worker that ran less than half of this long (its CPU time) while the caller waited
                                this long for it, past its own share's time, had no core */
#define QUIET_SECONDS 0.01  /* and then nobody spins for this long, doubled for each starved wait that follows */
#define QUIET_DOUBLINGS 7   /* within the last quiet time or soon after (at most 1.28 s) */
#define LEASE_IDLE_SECONDS 0.05  /* a process that ran no step for this long gives its cores' leases back */

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
