/* The MLP: the router, the routed experts grouped as products' parts, the shared expert or the dense MLP.
   One part of the native step's source: decode_step.c includes the parts in order, one translation unit,
   so that the compiler inlines across them. */

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

/* ---- the experts and the MLP -------------------------------------------------------------------------------- */

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
