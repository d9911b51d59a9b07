/* Activations quantised to int8 blocks, and the products of weights held in tiles with them.
   One part of the native step's source: decode_step.c includes the parts in order, one translation unit,
   so that the compiler inlines across them. */

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
    int32_t corr = CODE_ZERO * a->sum[0];
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

static void one_product(const K2Lin *l, int batch, const Quant *in, float *out) {  /* out [batch, n] */
    const Quant *ins[1] = {in};
    float *outs[1] = {out};
    Products p = {1, l, &batch, ins, outs};
    run(products_task, &p);
}
