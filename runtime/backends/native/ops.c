/* The step's ops one by one, exported for the tests.
   One part of the native step's source: decode_step.c includes the parts in order, one translation unit,
   so that the compiler inlines across them. */

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

/* n new cache entries kv [n, c + r] (the latent and the rope key as kv_a gives them: rewritten in place, normalised
   and roped) into their pages: entry i at position pos[i] of the sequence whose page ids `table` lists (entry_row,
   each_row's split); -1 on a bad argument */
int k2_op_store_entries(const K2Dims *d, const K2Layer *l, float *kv, int n, const int *pos, const int64_t *table,
                        const K2Pages *pages) {
    if (n < 1 || l->kv_a.n != d->latent + d->rope) return -1;
    for (int i = 0; i < n; i++)
        if (pos[i] < 0 || pos[i] >= d->max_len) return -1;
    int threads = pool.threads ? pool.threads : 1;
    char *scratch = malloc((size_t)n * d->rope * 4 + (size_t)threads * ((size_t)d->latent * 4 + 64) + 256);
    if (!scratch) return -1;
    Bump b = {(char *)(((uintptr_t)scratch + 63) / 64 * 64)};
    Entries entries = {d, l, kv, pos, table, 0, pages, take(&b, (size_t)n * d->rope * 4)};  /* table_len 0: one table */
    each_row(entry_row, &entries, n, (size_t)d->latent * 4, &b);
    free(scratch);
    return 0;
}
