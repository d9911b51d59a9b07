/* The one place where the native decode step names an instruction set.
 *
 * decode_step.c writes every kernel once, over the vector types below (GCC / Clang vector extensions, as wide as
 * the target's integer registers) and two primitives that each target lowers to its own instructions:
 *   dot4(acc, w, a)        acc + in each 32-bit lane the four products of w's bytes (unsigned) and a's bytes
 *                          (signed), with w taken as w - 128 + DOT_BIAS: exact while a's bytes lie in -127..127;
 *   dot4_small(acc, w, a)  the same for w's bytes in 0..127 taken as they are (4-bit codes): exact, and one or two
 *                          instructions everywhere (no sign juggling: each pair of products fits 16 bits);
 *   interleave4(r, quad)   four rows of bytes -> four vectors whose 32-bit lanes each hold one column of the four
 *                          rows (quad k, lane 4 L + m holds column 16 L + 4 k + m: x86's unpack instructions work
 *                          within 16-byte lanes, and every target here follows that order).
 * The compiler's -march picks one branch (runtime/backends/native/build.py builds one library per level):
 *   avx512-vnni   64-byte vectors, vpdpbusd (w as it is: DOT_BIAS 128, the caller takes 128 x sum(a) off)
 *   avx512bw      64-byte vectors, vpmaddubsw on |w - 128| and a with w's sign, vpmaddwd (DOT_BIAS 0)
 *   avx-vnni      32-byte vectors, vpdpbusd (AVX-VNNI, or AVX512-VNNI's 256-bit form)
 *   avx2          32-byte vectors, vpmaddubsw / vpsignb / vpmaddwd
 *   ssse3         16-byte vectors, the same at 128 bits (x86-64-v2)
 *   neon-dotprod  16-byte vectors, sdot on w - 128
 *   neon          16-byte vectors, smull and pairwise adds
 *   plain         16-byte vectors, a loop the compiler may vectorise
 * vpmaddubsw adds two products in 16 bits: |w - 128| <= 128 and |a| <= 127 keep each pair within 32512, so no sum
 * saturates. */
#ifndef K2_ISA_H
#define K2_ISA_H
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define K2_ISA "avx512-vnni"
#define VBYTES 64
#define DOT_BIAS 128
#elif defined(__AVX512BW__)
#define K2_ISA "avx512bw"
#define VBYTES 64
#define DOT_BIAS 0
#elif defined(__AVX2__) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define K2_ISA "avx-vnni"
#define VBYTES 32
#define DOT_BIAS 128
#elif defined(__AVX2__)
#define K2_ISA "avx2"
#define VBYTES 32
#define DOT_BIAS 0
#elif defined(__SSSE3__)
#define K2_ISA "ssse3"
#define VBYTES 16
#define DOT_BIAS 0
#elif defined(__ARM_NEON) && defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define K2_ISA "neon-dotprod"
#define VBYTES 16
#define DOT_BIAS 0
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define K2_ISA "neon"
#define VBYTES 16
#define DOT_BIAS 0
#else
#define K2_ISA "plain"
#define VBYTES 16
#define DOT_BIAS 0
#endif

#define LANES (VBYTES / 4)  /* 32-bit lanes of a vector */
typedef int32_t vi32 __attribute__((vector_size(VBYTES)));
typedef uint8_t vu8 __attribute__((vector_size(VBYTES)));
typedef int8_t vi8 __attribute__((vector_size(VBYTES)));
typedef float vf32 __attribute__((vector_size(VBYTES)));

static inline vu8 load_u8(const void *p) { vu8 v; memcpy(&v, p, VBYTES); return v; }
/* a vector the compiler must hold in a register: one load for the several dot4 that take it (folded into each of
   them as a memory operand, the load is repeated, and on AMD Zen 5 vpdpbusd from memory runs at half the rate) */
#if defined(__x86_64__) || defined(__i386__)
#define HELD(v) __asm__("" : "+v"(v))
#elif defined(__aarch64__)
#define HELD(v) __asm__("" : "+w"(v))
#else
#define HELD(v) ((void)0)
#endif
static inline vi8 load_i8(const void *p) { vi8 v; memcpy(&v, p, VBYTES); return v; }
static inline vi32 load_i32(const void *p) { vi32 v; memcpy(&v, p, VBYTES); return v; }
static inline vf32 load_f32(const void *p) { vf32 v; memcpy(&v, p, VBYTES); return v; }
static inline void store_i32(void *p, vi32 v) { memcpy(p, &v, VBYTES); }
static inline void store_f32(void *p, vf32 v) { memcpy(p, &v, VBYTES); }
static inline vi32 splat_i32(int32_t x) { return (vi32){0} + x; }
static inline vf32 splat_f32(float x) { vf32 v = {x}; return __builtin_shuffle(v, (vi32){0}); }  /* x itself (not 0 + x) */
static inline vi8 splat4(const void *four) { int32_t x; memcpy(&x, four, 4); return (vi8)splat_i32(x); }
/* a x b + c in each lane, in one rounding where the target fuses them (FMA: every x86-64-v3 level and up, and
   aarch64), else two; a kernel and its batched twin both take it, so they round alike */
#if defined(__FMA__) || defined(__aarch64__)
#define FUSED_MULTIPLY_ADD 1
#else
#define FUSED_MULTIPLY_ADD 0
#endif
static inline vf32 fma_f32(vf32 a, vf32 b, vf32 c) {
#if VBYTES == 64
    return (vf32)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif VBYTES == 32 && defined(__FMA__)
    return (vf32)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__ARM_NEON) && defined(__aarch64__)
    return (vf32)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#elif defined(__FMA__)
    return (vf32)_mm_fmadd_ps((__m128)a, (__m128)b, (__m128)c);
#else
    return a * b + c;
#endif
}
/* each lane's smaller and larger of a and b: one instruction where the target has one */
static inline vi32 min_i32(vi32 a, vi32 b) {
#if VBYTES == 64
    return (vi32)_mm512_min_epi32((__m512i)a, (__m512i)b);
#elif VBYTES == 32 && defined(__AVX2__)
    return (vi32)_mm256_min_epi32((__m256i)a, (__m256i)b);
#elif defined(__SSE4_1__)
    return (vi32)_mm_min_epi32((__m128i)a, (__m128i)b);
#elif defined(__ARM_NEON) && defined(__aarch64__)
    return (vi32)vminq_s32((int32x4_t)a, (int32x4_t)b);
#else
    vi32 less = a < b;
    return (a & less) | (b & ~less);
#endif
}
static inline vi32 max_i32(vi32 a, vi32 b) {
#if VBYTES == 64
    return (vi32)_mm512_max_epi32((__m512i)a, (__m512i)b);
#elif VBYTES == 32 && defined(__AVX2__)
    return (vi32)_mm256_max_epi32((__m256i)a, (__m256i)b);
#elif defined(__SSE4_1__)
    return (vi32)_mm_max_epi32((__m128i)a, (__m128i)b);
#elif defined(__ARM_NEON) && defined(__aarch64__)
    return (vi32)vmaxq_s32((int32x4_t)a, (int32x4_t)b);
#else
    vi32 more = a > b;
    return (a & more) | (b & ~more);
#endif
}
static inline int32_t sum_lanes(vi32 v) {  /* integers: any order gives the same sum */
#if VBYTES == 64
    return _mm512_reduce_add_epi32((__m512i)v);
#elif VBYTES == 32 && defined(__AVX2__)
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128((__m256i)v), _mm256_extracti128_si256((__m256i)v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
#else
    int32_t s = 0;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
#endif
}

/* n float16 values -> floats: eight at a time where the CPU converts them (F16C), the rest one by one */
static inline void halves_to_floats(const uint16_t *half, int n, float *out) {
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(half + i))));
#endif
    for (; i < n; i++) { _Float16 h; memcpy(&h, half + i, 2); out[i] = (float)h; }
}

/* a spinning thread's hint to the core that it waits */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline vi32 dot4(vi32 acc, vu8 w, vi8 a) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return (vi32)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)a);
#elif defined(__AVX512BW__)
    __m512i s = _mm512_xor_si512((__m512i)w, _mm512_set1_epi8((char)0x80));
    __m512i signed_a = _mm512_mask_sub_epi8((__m512i)a, _mm512_movepi8_mask(s), _mm512_setzero_si512(), (__m512i)a);
    __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(s), signed_a);
    return acc + (vi32)_mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
#elif defined(__AVX2__) && defined(__AVXVNNI__)
    return (vi32)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, (__m256i)a);
#elif defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (vi32)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)w, (__m256i)a);
#elif defined(__AVX2__)
    __m256i s = _mm256_xor_si256((__m256i)w, _mm256_set1_epi8((char)0x80));
    __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(s, s), _mm256_sign_epi8((__m256i)a, s));
    return acc + (vi32)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#elif defined(__SSSE3__)
    __m128i s = _mm_xor_si128((__m128i)w, _mm_set1_epi8((char)0x80));
    __m128i pairs = _mm_maddubs_epi16(_mm_sign_epi8(s, s), _mm_sign_epi8((__m128i)a, s));
    return acc + (vi32)_mm_madd_epi16(pairs, _mm_set1_epi16(1));
#elif defined(__ARM_NEON) && defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
    int8x16_t s = veorq_s8(vreinterpretq_s8_u8((uint8x16_t)w), vdupq_n_s8(-128));
    return (vi32)vdotq_s32((int32x4_t)acc, s, (int8x16_t)a);
#elif defined(__ARM_NEON) && defined(__aarch64__)
    int8x16_t s = veorq_s8(vreinterpretq_s8_u8((uint8x16_t)w), vdupq_n_s8(-128));
    int16x8_t lo = vmull_s8(vget_low_s8(s), vget_low_s8((int8x16_t)a)), hi = vmull_high_s8(s, (int8x16_t)a);
    return acc + (vi32)vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi));
#else
    for (int i = 0; i < LANES; i++) {
        int32_t s = 0;
        for (int j = 0; j < 4; j++) s += ((int32_t)w[4 * i + j] - 128 + DOT_BIAS) * a[4 * i + j];
        acc[i] += s;
    }
    return acc;
#endif
}

static inline vi32 dot4_small(vi32 acc, vu8 w, vi8 a) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return (vi32)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)a);
#elif defined(__AVX512BW__)
    return acc + (vi32)_mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)w, (__m512i)a), _mm512_set1_epi16(1));
#elif defined(__AVX2__) && defined(__AVXVNNI__)
    return (vi32)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, (__m256i)a);
#elif defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (vi32)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)w, (__m256i)a);
#elif defined(__AVX2__)
    return acc + (vi32)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)w, (__m256i)a), _mm256_set1_epi16(1));
#elif defined(__SSSE3__)
    return acc + (vi32)_mm_madd_epi16(_mm_maddubs_epi16((__m128i)w, (__m128i)a), _mm_set1_epi16(1));
#elif defined(__ARM_NEON) && defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
    return (vi32)vdotq_s32((int32x4_t)acc, vreinterpretq_s8_u8((uint8x16_t)w), (int8x16_t)a);
#elif defined(__ARM_NEON) && defined(__aarch64__)
    int8x16_t s = vreinterpretq_s8_u8((uint8x16_t)w);
    int16x8_t lo = vmull_s8(vget_low_s8(s), vget_low_s8((int8x16_t)a)), hi = vmull_high_s8(s, (int8x16_t)a);
    return acc + (vi32)vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi));
#else
    for (int i = 0; i < LANES; i++) {
        int32_t s = 0;
        for (int j = 0; j < 4; j++) s += (int32_t)w[4 * i + j] * a[4 * i + j];
        acc[i] += s;
    }
    return acc;
#endif
}

static inline void interleave4(const vi8 r[4], vi8 quad[4]) {
#if VBYTES == 64 && defined(__AVX512BW__)
#define UNPACK(half, bits, x, y) _mm512_unpack##half##_epi##bits((__m512i)(x), (__m512i)(y))
#elif VBYTES == 32 && defined(__AVX2__)
#define UNPACK(half, bits, x, y) _mm256_unpack##half##_epi##bits((__m256i)(x), (__m256i)(y))
#elif defined(__SSE2__)
#define UNPACK(half, bits, x, y) _mm_unpack##half##_epi##bits((__m128i)(x), (__m128i)(y))
#endif
#ifdef UNPACK
    vi8 lo01 = (vi8)UNPACK(lo, 8, r[0], r[1]), hi01 = (vi8)UNPACK(hi, 8, r[0], r[1]);
    vi8 lo23 = (vi8)UNPACK(lo, 8, r[2], r[3]), hi23 = (vi8)UNPACK(hi, 8, r[2], r[3]);
    quad[0] = (vi8)UNPACK(lo, 16, lo01, lo23); quad[1] = (vi8)UNPACK(hi, 16, lo01, lo23);
    quad[2] = (vi8)UNPACK(lo, 16, hi01, hi23); quad[3] = (vi8)UNPACK(hi, 16, hi01, hi23);
#undef UNPACK
#elif defined(__ARM_NEON) && defined(__aarch64__)
    int8x16x2_t z01 = vzipq_s8((int8x16_t)r[0], (int8x16_t)r[1]), z23 = vzipq_s8((int8x16_t)r[2], (int8x16_t)r[3]);
    int16x8x2_t lo = vzipq_s16(vreinterpretq_s16_s8(z01.val[0]), vreinterpretq_s16_s8(z23.val[0]));
    int16x8x2_t hi = vzipq_s16(vreinterpretq_s16_s8(z01.val[1]), vreinterpretq_s16_s8(z23.val[1]));
    quad[0] = (vi8)lo.val[0]; quad[1] = (vi8)lo.val[1]; quad[2] = (vi8)hi.val[0]; quad[3] = (vi8)hi.val[1];
#else
    for (int k = 0; k < 4; k++) {
        vi8 q = {0};
        for (int lane = 0; lane < LANES; lane++)
            for (int j = 0; j < 4; j++) q[4 * lane + j] = r[j][16 * (lane / 4) + 4 * k + lane % 4];
        quad[k] = q;
    }
#endif
}

/* where interleave4 leaves column c (of a run of columns a multiple of VBYTES long) once the four quads are stored
   one after another: within each VBYTES columns, column 16 L + 4 k + m at k LANES + 4 L + m */
static inline int interleaved_slot(int c) {
    int run = c - c % VBYTES, at = c % VBYTES;
    return run + (at % 16 / 4) * LANES + at / 16 * 4 + at % 4;
}

#endif
