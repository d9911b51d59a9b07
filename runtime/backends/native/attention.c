/* The absorbed attention over the int8 latent cache's pages: one query at a time, and a run of queries as tiles.
   One part of the native step's source: decode_step.c includes the parts in order, one translation unit,
   so that the compiler inlines across them. */

#define HEAD_GROUP (VBYTES == 64 ? 16 : 8)  /* heads that share one pass of latent_dots() over a cached row */

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
            const vu8 ones = (vu8){0} + (uint8_t)(CODE_ZERO + 1 - DOT_BIAS);  /* dot4 takes them as 1 */
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
                    if (DOT_BIAS != CODE_ZERO)
                        for (int k = 0; k < 4; k++) codes[k] = dot4(codes[k], ones, quad[k]);
                }
                for (int j = 0; j < n; j++)
                    for (int k = 0; k < 4; k++) {
                        int32_t *out = sums + (size_t)j * c_dim + c + LANES * k;
                        store_i32(out, load_i32(out) + acc[j][k] + (CODE_ZERO - DOT_BIAS) * codes[k]);
                    }
            }
            continue;
        }
        for (int row = 0; row < rows; row++) {
            const uint8_t *codes = page + (size_t)row * c_dim;
            for (int j = 0; j < n; j++) {
                int32_t weight = p[(size_t)j * stride + t + row], *out = sums + (size_t)j * c_dim;
                if (weight)
                    for (int c = 0; c < c_dim; c++) out[c] += weight * ((int32_t)codes[c] - CODE_ZERO);
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
            for (int i = 0; i < c; i++) s += ((int32_t)codes[i] - CODE_ZERO) * lat[j0 + j].q[i];
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
    float *probability_scale, *largest;  /* [ROW_TILE] each row's; its largest score */
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
    t.probability_scale = take(b, ROW_TILE * 4); t.largest = take(b, ROW_TILE * 4);
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
   latent product times the two scales, plus the rope product, times the softmax scale); largest [ROW_TILE] the
   largest of each row's */
static void block_scores(const Block *a, Tile *t, int keys) {
    const K2Dims *d = a->d;
    int c = d->latent;
    for (int rr = 0; rr < ROW_TILE; rr++) t->largest[rr] = -INFINITY;
    for (int t0 = 0; t0 < keys; t0 += SCORE_POSITIONS) {
        int count = MIN(SCORE_POSITIONS, keys - t0);
        const uint8_t *row[SCORE_POSITIONS];
        for (int p = 0; p < SCORE_POSITIONS; p++)
            row[p] = a->pages->latent + cache_row_of(a->table, t0 + MIN(p, count - 1)) * c;
        for (int p = t0 + SCORE_POSITIONS; p < MIN(t0 + 2 * SCORE_POSITIONS, keys); p++) {  /* the next group's rows */
            size_t next = cache_row_of(a->table, p);
            for (int at = 0; at < c; at += 64) __builtin_prefetch(a->pages->latent + next * c + at);
            for (int at = 0; at < d->rope * 2; at += 64) __builtin_prefetch((const char *)(a->pages->rope + next * d->rope) + at);
        }
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
                vf32 score = (latent_score + load_f32(t->rope + (size_t)p * ROW_TILE + LANES * v)) * d->softmax_scale;
                store_f32(s + LANES * v, score);
                vf32 largest = load_f32(t->largest + LANES * v);  /* MAX(largest, score) over the row's positions */
                vi32 take = (splat_i32(t0 + p) < load_i32(t->keys + LANES * v)) & ~(largest > score);
                store_f32(t->largest + LANES * v, (vf32)pick(take, (vi32)score, (vi32)largest));
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
        largest[v] = load_f32(t->largest + LANES * v); total[v] = (vf32){0}; peak[v] = (vf32){0};
        row_keys[v] = load_i32(t->keys + LANES * v);
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
    const vu8 ones = (vu8){0} + (uint8_t)(CODE_ZERO + 1 - DOT_BIAS);  /* dot4 takes them as 1 */
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
                    if (DOT_BIAS != CODE_ZERO) codes[k] = dot4(codes[k], ones, quad[k]);
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
                    t->x[c] = (float)(sums[slot] + (CODE_ZERO - DOT_BIAS) * t->code_sums[slot]) * scale;
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
