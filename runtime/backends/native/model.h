/* The model as the artifact holds it, and the step's limits.
   One part of the native step's source: decode_step.c includes the parts in order, one translation unit,
   so that the compiler inlines across them. */

#define PAGE 64
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX_THREADS 256
#define MAX_TOP_K 64      /* the routing's limits (runtime/backends/native/decoder.py checks a model against them) */
#define MAX_GROUPS 64
#define MAX_EXPERTS 4096
#define CODE_ZERO 128  /* an int8 code q (weights, the latent cache) is stored as the byte q + CODE_ZERO */

/* the artifact's layout (core/native_tiles.py), as runtime/backends/native/decoder.py maps it */
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
