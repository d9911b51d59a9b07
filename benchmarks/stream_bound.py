"""What one decode step of a model could take on this host at N threads: the step's int8 weight products, one
after another, through a small native kernel of this script's own, every product split over the N threads.

    . .venv/bin/activate && python benchmarks/stream_bound.py [ART | --preset small] [--threads 1,2] [--context 640] [--json]

(from the repository root; the model's sizes come from ART's config, else from --preset, default `small`; no
weights are read). The decode step at batch 1, per layer in
order: q_a, q_b, kv_a, the absorbed W_UK and W_UV, the latent cache of --context tokens (kv_lora + rope bytes a
token), o_proj; then the dense MLP (gate, up, down) or the router, the shared experts and k routed experts drawn at
random from the layer's e (a new draw every step, so the experts come from memory as in decode); last the head.
Every weight is one byte; scales, norms and the embedding row are left out (under 2% of the bytes).

Each product y = W x streams W [n, k] once (byte weights, int8 activations, int32 sums), through the native
step's own dot4 (runtime/backends/native/isa.h, at the level `-march=native` gives: `vpdpbusd` with VNNI,
`vpmaddubsw` and `vpmaddwd` on AVX2, ...). Its rows are split into one contiguous run
per thread; the threads spin on a counter between products (no sleeping, no hand-off through a queue), as the
fastest CPU runtimes do. Nothing else runs: no attention softmax, no routing, no norms, no interpreter. So the
time is close to what the memory system gives this step's reads at N threads, and the ratio between thread counts
is how far a decode of this model can scale on this host, whoever's kernels run it.

The C source below is compiled once per run with the system's C compiler (`cc -O3 -march=native -pthread`, with
the native step's isa.h) into a temporary folder. Thread counts run in turn, in --rounds rounds, each a process of its own; the table gives
the median over rounds of each process's median step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from k2deploy.runtime.backends.native.build import SOURCE

NATIVE_SOURCES = SOURCE.parent  # isa.h: the kernel's products are the native step's dot4 at this host's level

# argv: threads steps warmup seed, then the products on stdin, one per line: "rows cols group", where group > 0
# marks the routed experts of a layer: each step draws `chosen` of the group's `count` matrices (line "E count
# chosen" opens a group). Prints "median_ms mean_gbps bytes_per_step" of the timed steps.
KERNEL_C = r"""
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include "isa.h"  /* the native step's vectors and its dot4, as its products take them */

typedef struct { int rows, cols, group; uint8_t *w; } Product;  /* w [rows, cols], LANES-row tiles of 4-byte columns */
typedef struct { int count, chosen, first; } Group;

static Product *products; static int n_products;
static Group *groups; static int n_groups;
static int *order; static int n_order;   /* one step's products, experts drawn */
static int8_t *x; static int32_t *y; static int threads;
static atomic_int go, arrived;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void rows_of(const Product *p, int r0, int r1) {  /* LANES rows a tile, two chains of dot4 */
    for (int r = r0; r < r1; r += LANES) {
        const uint8_t *tile = p->w + (size_t)r * p->cols;
        vi32 a = {0}, b = {0};
        int k = 0;
        for (; k + 1 < p->cols / 4; k += 2) {
            a = dot4(a, load_u8(tile + (size_t)k * VBYTES), splat4(x + 4 * k));
            b = dot4(b, load_u8(tile + (size_t)(k + 1) * VBYTES), splat4(x + 4 * k + 4));
        }
        for (; k < p->cols / 4; k++) a = dot4(a, load_u8(tile + (size_t)k * VBYTES), splat4(x + 4 * k));
        store_i32(y + r, a + b);
    }
}

static void share(int tid, const Product *p) {
    int tiles = p->rows / LANES;
    rows_of(p, tiles * tid / threads * LANES, tiles * (tid + 1) / threads * LANES);
}

static void barrier(int *generation) {  /* every thread spins until all have arrived */
    *generation += 1;
    if (atomic_fetch_add(&arrived, 1) + 1 == threads * *generation) return;
    while (atomic_load(&arrived) < threads * *generation) ;
}

static void *worker(void *arg) {
    int tid = (int)(intptr_t)arg, seen = 0, generation = 0;
    for (;;) {
        int step;
        while ((step = atomic_load(&go)) == seen) ;
        if (step < 0) return NULL;
        seen = step;
        for (int i = 0; i < n_order; i++) { share(tid, &products[order[i]]); barrier(&generation); }
    }
}

static unsigned long long rng_state;
static int draw(int n) { rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL; return (int)((rng_state >> 33) % n); }

static void draw_order(void) {
    n_order = 0;
    for (int i = 0; i < n_products; i++) {
        if (products[i].group < 0) { order[n_order++] = i; continue; }
        Group *g = &groups[products[i].group];
        if (i != g->first) continue;
        int picked[1024], n = 0;
        while (n < g->chosen) {
            int e = draw(g->count), seen = 0;
            for (int j = 0; j < n; j++) seen |= picked[j] == e;
            if (!seen) picked[n++] = e;
        }
        for (int j = 0; j < n; j++)  /* an expert is 3 consecutive products: gate, up, down */
            for (int m = 0; m < 3; m++) order[n_order++] = g->first + 3 * picked[j] + m;
    }
}

static int compare(const void *a, const void *b) { double d = *(const double *)a - *(const double *)b; return (d > 0) - (d < 0); }

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: kernel threads steps warmup seed < products\n"); return 2; }
    threads = atoi(argv[1]); int steps = atoi(argv[2]), warmup = atoi(argv[3]); rng_state = strtoull(argv[4], 0, 10);
    int cap = 1 << 16, max_cols = 0, max_rows = 0; char kind[8];
    products = calloc(cap, sizeof *products); groups = calloc(cap, sizeof *groups); order = calloc(cap, sizeof *order);
    while (scanf("%7s", kind) == 1) {
        if (kind[0] == 'E') {
            Group *g = &groups[n_groups]; if (scanf("%d %d", &g->count, &g->chosen) != 2) return 2;
            g->first = n_products; n_groups++;
            int rows[3], cols[3];
            for (int m = 0; m < 3; m++) if (scanf("%d %d", &rows[m], &cols[m]) != 2) return 2;
            for (int e = 0; e < g->count; e++)
                for (int m = 0; m < 3; m++) products[n_products++] = (Product){rows[m], cols[m], n_groups - 1, NULL};
        } else {
            Product p = {0, 0, -1, NULL}; if (scanf("%d %d", &p.rows, &p.cols) != 2) return 2;
            products[n_products++] = p;
        }
    }
    size_t held = 0;
    for (int i = 0; i < n_products; i++) held += ((size_t)products[i].rows * products[i].cols + 63) / 64 * 64;
    /* one region advised to use huge pages, as the runtime's native decode step holds its weights */
    uint8_t *region = mmap(NULL, held + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region == MAP_FAILED) { fprintf(stderr, "cannot map %zu bytes\n", held); return 2; }
    region = (uint8_t *)(((uintptr_t)region + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
    madvise(region, held, MADV_HUGEPAGE);
    for (int i = 0; i < n_products; i++) {
        Product *p = &products[i];
        size_t size = (size_t)p->rows * p->cols;
        p->w = region; region += (size + 63) / 64 * 64;
        for (size_t j = 0; j < size; j++) p->w[j] = (uint8_t)(j * 31 + i);
        if (p->cols > max_cols) max_cols = p->cols;
        if (p->rows > max_rows) max_rows = p->rows;
    }
    x = aligned_alloc(64, (max_cols + 63) / 64 * 64); memset(x, 3, max_cols);
    y = aligned_alloc(64, ((size_t)max_rows * 4 + 63) / 64 * 64);
    pthread_t pool[256];
    for (int t = 1; t < threads; t++) pthread_create(&pool[t], NULL, worker, (void *)(intptr_t)t);
    double *times = calloc(steps, sizeof *times), streamed = 0;
    int generation = 0;
    for (int s = 0; s < warmup + steps; s++) {
        draw_order();
        double started = now();
        atomic_store(&go, s + 1);
        for (int i = 0; i < n_order; i++) { share(0, &products[order[i]]); barrier(&generation); }
        double took = now() - started;
        if (s >= warmup) {
            times[s - warmup] = took;
            for (int i = 0; i < n_order; i++) streamed += (double)products[order[i]].rows * products[order[i]].cols;
        }
    }
    atomic_store(&go, -1);
    for (int t = 1; t < threads; t++) pthread_join(pool[t], NULL);
    double total = 0; for (int s = 0; s < steps; s++) total += times[s];
    qsort(times, steps, sizeof *times, compare);
    printf("%.4f %.2f %.0f\n", times[steps / 2] * 1e3, streamed / total / 1e9, streamed / steps);
    return 0;
}
"""


def step_products(config, context: int) -> list[str]:
    """The decode step's products in order, as the kernel's input lines: "P rows cols" or, for a layer's routed
    experts, "E count chosen" and the gate, up and down shapes. Rows are rounded up to 16, columns to 8."""
    def product(rows: int, cols: int) -> str:
        return f"P {-(-rows // 16) * 16} {-(-cols // 8) * 8}"

    h, heads = config.hidden_size, config.num_attention_heads
    lines = []
    for layer in range(config.num_hidden_layers):
        lines += [product(config.q_lora_rank, h),
                  product(heads * (config.qk_nope_head_dim + config.qk_rope_head_dim), config.q_lora_rank),
                  product(config.kv_lora_rank + config.qk_rope_head_dim, h),
                  product(heads * config.kv_lora_rank, config.qk_nope_head_dim),  # W_UK: queries into the latent
                  product(context, config.kv_lora_rank + config.qk_rope_head_dim),  # the latent cache
                  product(heads * config.v_head_dim, config.kv_lora_rank),  # W_UV
                  product(h, heads * config.v_head_dim)]  # o_proj
        if layer < config.first_k_dense_replace:
            f = config.intermediate_size
            lines += [product(f, h), product(f, h), product(h, f)]
            continue
        f = config.moe_intermediate_size
        lines.append(product(config.n_routed_experts, h))  # the router
        for _ in range(config.n_shared_experts):
            lines += [product(f, h), product(f, h), product(h, f)]
        gate, down = product(f, h)[2:], product(h, f)[2:]
        lines.append(f"E {config.n_routed_experts} {config.num_experts_per_tok} {gate} {gate} {down}")
    lines.append(product(config.vocab_size, h))  # the head
    return lines


def compile_kernel(folder: Path) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise SystemExit("stream_bound.py: no C compiler (cc, gcc or clang) on PATH; install one (e.g. `apt install gcc`)")
    source, binary = folder / "kernel.c", folder / "kernel"
    source.write_text(KERNEL_C)
    built = subprocess.run([compiler, "-O3", "-march=native", "-pthread", f"-I{NATIVE_SOURCES}", str(source), "-o",
                            str(binary)], capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"stream_bound.py: the kernel did not compile with {compiler}:\n{built.stderr.strip()[:2000]}")
    return binary


def run_kernel(binary: Path, products: list[str], threads: int, steps: int, warmup: int, seed: int) -> dict:
    out = subprocess.run([str(binary), str(threads), str(steps), str(warmup), str(seed)], input="\n".join(products),
                         capture_output=True, text=True, check=True)
    ms, gbps, streamed = (float(v) for v in out.stdout.split())
    return {"step_ms": ms, "gbps": gbps, "bytes": streamed}


def measure(config, threads: list[int], context: int, rounds: int, steps: int, warmup: int = 5) -> dict:
    """{threads: {"step_ms", "gbps"}}: medians over rounds, the thread counts in turn in each round."""
    products = step_products(config, context)
    with tempfile.TemporaryDirectory(prefix="k2deploy-stream-bound-") as folder:
        binary = compile_kernel(Path(folder))
        runs = {t: [] for t in threads}
        for round_ in range(rounds):
            for t in threads:
                runs[t].append(run_kernel(binary, products, t, steps, warmup, seed=round_ + 1))
    return {t: {key: statistics.median(r[key] for r in rs) for key in ("step_ms", "gbps")} for t, rs in runs.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", nargs="?", type=Path, help="an artifact, whose config gives the sizes")
    parser.add_argument("--preset", default="small", help="without ART, the sizes of this preset (default small)")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--context", type=int, default=640, help="cached tokens the step reads (default 640)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over the thread counts (default 5)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per process (default 100)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--threads {args.threads}: give thread counts separated by commas, e.g. 1,2")
    if not threads or min(threads) < 1 or args.rounds < 1 or args.steps < 1 or args.context < 1:
        parser.error("--threads, --rounds, --steps and --context take positive numbers")
    from k2deploy.core.checkpoint.presets import preset_config
    from k2deploy.core.errors import K2Error
    from k2deploy.core.manifest import load_manifest
    try:
        config = (load_manifest(args.artifact, verify_hashes=False).config if args.artifact
                  else preset_config(args.preset))
    except K2Error as exc:
        parser.error(str(exc))
    results = measure(config, threads, args.context, args.rounds, args.steps)
    if args.json:
        print(json.dumps({"context": args.context, "rounds": args.rounds, "steps": args.steps,
                          "threads": {str(t): r for t, r in results.items()}}, indent=2))
        return 0
    base = results[threads[0]]["step_ms"]
    print(f"one decode step's int8 products through a native kernel (context {args.context}, median of {args.rounds} "
          f"rounds of {args.steps} steps)")
    print(f"{'threads':>7} {'step ms':>8} {'GB/s':>6} {'speed-up':>9}")
    for t, r in results.items():
        print(f"{t:>7} {r['step_ms']:>8.3f} {r['gbps']:>6.1f} {base / r['step_ms']:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
