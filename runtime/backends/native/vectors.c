/* The float steps between the products: rms norm, rope, silu, float dots, halves; rows normalised and quantised.
   One part of the native step's source: decode_step.c includes the parts in order, one translation unit,
   so that the compiler inlines across them. */

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
