/* y [M, N] = x [M, K] @ W^T with W [N, K] held as llama.cpp's GGML blocks, exactly as a GGUF file stores them
 * (runtime/formats/ggml.py describes the layouts), multiplied where the blocks lie (`specoffload_ggml_matmul`: no
 * repacking, no 16-bit copy), or W written into a 16-bit copy (`specoffload_ggml_dequantize`) for a GEMM over many
 * rows; and float16 <-> bfloat16 conversion (`specoffload_convert_16`).
 *
 * Every block is decoded to float32 with llama.cpp's arithmetic (ggml-quants.c dequantize_row_*; a multiply then a
 * subtract, never fused, so each weight is bit for bit the reference's), then multiplied by x in float32 with
 * fused multiply-adds. `round` first rounds each decoded weight to the compute dtype (1: bfloat16, 2: float16,
 * to nearest even, as torch converts; 0: kept in float32), so the product is x @ W^T for the weight a 16-bit copy
 * would hold: `specoffload_ggml_dequantize` writes that copy (for a GEMM over many rows), and the two paths multiply
 * the same weights. A row of y sums its products in the same order whatever M is and however the rows are tiled or
 * threaded: a row's result does not depend on the rows beside it.
 *
 *   q4_k  144 B / 256: w = (d * sc_j) * q - (dmin * m_j), j the sub-block of 32
 *   q6_k  210 B / 256: w = (d * sc_j) * (q - 32), j the sub-block of 16
 *   f16     2 B / 1:   w = the float16 value (a GGUF's F16 matrix: exact in float32)
 *
 * With AVX-512 (compiled with -march=native on a CPU that has it; `specoffload_ggml_vector` 1): tiles of up to 8
 * rows of x by 2 rows of W held in 16 accumulators of 16 lanes, each block decoded once per tile. With AVX2, FMA and
 * F16C and no AVX-512 (2): the same decoding in vectors of 8 lanes, tiles of up to 8 rows of x by 1 row of W (8
 * accumulators), each block decoded once per tile; with float32 weights (round 0) that path factors each
 * sub-block's sum instead of decoding every weight (`tile_factored`: the same products, summed in another order).
 * Otherwise (0) a portable loop the compiler vectorizes. f16 rows (`tile_f16`, both vector paths) convert 8
 * weights at a time with F16C, each rounded as `round` says, shared by a tile of up to 8 rows of x. With bfloat16
 * weights (round 1) on a CPU with AVX512-BF16, q4_k / q6_k tiles multiply pairs of bfloat16 weights and inputs
 * with `vdpbf16ps` (`tile_dot`), q4_k's weights picked from each sub-block's 16 values (`looked_up`), and f16 rows
 * 32 weights at a time (`tile_f16_dot`). A block's scales are unpacked in vectors on both vector paths
 * (`factors`). The output rows are split over `threads` POSIX threads (each writes its own columns of y), kept
 * between calls (`pooled`).
 */
#include <pthread.h>
#include <stdint.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(SPECOFFLOAD_GENERIC)
#include <immintrin.h>
#define VECTOR 1
#define TILE 8                         /* rows of x per tile */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(SPECOFFLOAD_GENERIC)
#include <immintrin.h>
#define VECTOR 2
#define TILE 8                         /* rows of x per tile: 8 accumulators of 8 lanes, half of the 16 registers */
#else
#define VECTOR 0
#define TILE 8
#endif
/* float32 weights on the AVX2 path: each sub-block's sum factored (`tile_factored`); SPECOFFLOAD_DECODED builds the
 * path that decodes every weight, its baseline */
#if VECTOR == 2 && !defined(SPECOFFLOAD_DECODED)
#define FACTORED 1
#else
#define FACTORED 0
#endif

/* bfloat16 weights (round 1) on the AVX-512 path of a CPU with AVX512-BF16: pairs of products summed by
 * `vdpbf16ps` (`tile_dot`); SPECOFFLOAD_NO_DOT builds the path that rounds each weight and multiply-adds it in
 * float32, its baseline */
#if VECTOR == 1 && defined(__AVX512BF16__) && !defined(SPECOFFLOAD_NO_DOT)
#define DOT 1
#else
#define DOT 0
#endif

enum { KIND_Q4_K = 0, KIND_Q6_K = 1, KIND_F16 = 2, KINDS = 3 };
#define QK 256                         /* inputs per k-quant block */
#define MAX_THREADS 64
static const int64_t BLOCK_BYTES[KINDS] = {144, 210, 2};
static const int64_t BLOCK_INPUTS[KINDS] = {QK, QK, 1};
/* f16 multiply-adds that pay for a thread: starting one cost ~80 us on a 2-core VM, where one thread does ~4M
 * multiply-adds of an f16 tile in ~150 us (a [1536, 336] expert at 8 rows; at 1 row 40 us alone, 110 us on two);
 * measured before the workers were kept between calls (`pooled`), whose wake-up costs less */
#define F16_WORK ((int64_t)1 << 22)

int specoffload_ggml_vector(void) { return VECTOR; }
int specoffload_ggml_dot(void) { return DOT; }

static float half(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
#if VECTOR && defined(__F16C__)
    return _cvtsh_ss((unsigned short)h); /* F16C: the same exact conversion in one instruction */
#else
    uint32_t s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    float f;
    if (e == 0) { /* zero or subnormal: m * 2^-24 */
        f = (float)m * (1.0f / 16777216.0f);
        return s ? -f : f;
    }
    bits = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112) << 23) | (m << 13));
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float bf16_bits_to_float(uint32_t bits) {
    float f;
    bits <<= 16;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16_bits(float w) { /* to nearest even (finite w) */
    uint32_t bits;
    memcpy(&bits, &w, 4);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* A block's per-sub-block factors: q4_k scale[8] = d * sc_j, low[8] = dmin * m_j; q6_k scale[16] = d * sc_j. */
static inline void factors(int kind, const uint8_t *b, float *scale, float *low) {
#if VECTOR
    if (kind == KIND_Q4_K) {
        /* the twelve scale bytes as three little-endian words w: sc_0..3 = the low 6 bits of w[0]'s bytes, m_0..3
         * of w[1]'s; sc_4..7 = w[2]'s low nibbles | (w[0]'s bytes' top 2 bits) << 4, m_4..7 = w[2]'s high nibbles
         * | (w[1]'s bytes' top 2 bits) << 4 (a byte per j: the scalar loop's values), then as float32 times d */
        uint32_t w[3];
        memcpy(w, b + 4, 12);
        const uint32_t six = 0x3F3F3F3Fu, nib = 0x0F0F0F0Fu, two = 0x03030303u;
        uint64_t sc = (uint64_t)(w[0] & six) | (uint64_t)((w[2] & nib) | (((w[0] >> 6) & two) << 4)) << 32;
        uint64_t m = (uint64_t)(w[1] & six) | (uint64_t)(((w[2] >> 4) & nib) | (((w[1] >> 6) & two) << 4)) << 32;
        _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(half(b)),
                                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc)))));
        _mm256_storeu_ps(low, _mm256_mul_ps(_mm256_set1_ps(half(b + 2)),
                                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)m)))));
    } else {
        __m256 d = _mm256_set1_ps(half(b + 208));
        __m128i s = _mm_loadu_si128((const __m128i *)(b + 192)); /* 16 signed scales */
        _mm256_storeu_ps(scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s))));
        _mm256_storeu_ps(scale + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8)))));
    }
#else
    if (kind == KIND_Q4_K) {
        float d = half(b), dmin = half(b + 2);
        const uint8_t *s = b + 4;
        for (int j = 0; j < 8; j++) {
            int sc, m;
            if (j < 4) {
                sc = s[j] & 63;
                m = s[j + 4] & 63;
            } else {
                sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
                m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
            }
            scale[j] = d * (float)sc;
            low[j] = dmin * (float)m;
        }
    } else {
        float d = half(b + 208);
        const int8_t *s = (const int8_t *)(b + 192);
        for (int j = 0; j < 16; j++) scale[j] = d * (float)s[j];
    }
#endif
}

#if VECTOR /* both vector paths: the decoding's byte work is 256-bit AVX2 in each */
#if defined(__clang__)
#define UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define UNROLL _Pragma("GCC unroll 16")
#else
#define UNROLL
#endif

/* `call`, an expression naming MT, with MT the tile's rows mt (1 .. TILE) as a compile-time constant: each tile
 * size compiles to its own unrolled code. */
#define BY_MT(call)                                                                                           \
    switch (mt) {                                                                                             \
    case 1: { enum { MT = 1 }; call; } break;                                                                 \
    case 2: { enum { MT = 2 }; call; } break;                                                                 \
    case 3: { enum { MT = 3 }; call; } break;                                                                 \
    case 4: { enum { MT = 4 }; call; } break;                                                                 \
    case 5: { enum { MT = 5 }; call; } break;                                                                 \
    case 6: { enum { MT = 6 }; call; } break;                                                                 \
    case 7: { enum { MT = 7 }; call; } break;                                                                 \
    default: { enum { MT = 8 }; call; } break;                                                                \
    }

/* 8 float32 lanes (AVX2, which both vector paths have) rounded to bfloat16 (round == 1, to nearest even: torch's
 * conversion for finite values) or float16 (2). */
static inline __attribute__((always_inline)) __m256 rounded8(__m256 w, int round) {
    if (round == 1) {
        __m256i bits = _mm256_castps_si256(w);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        bits = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
        return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32((int)0xFFFF0000u)));
    }
    if (round == 2) return _mm256_cvtph_ps(_mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return w;
}

/* The 8 lanes' sum, in the same order for every vector. */
static inline __attribute__((always_inline)) float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 8 bfloat16 bit patterns (the high halves of rounded float32 values) as 16-bit words, in order. */
static inline __attribute__((always_inline)) __m128i high_halves(__m256 rounded_w) {
    __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(rounded_w), 16); /* each < 2^16: packus keeps it */
    return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

/* 8 float16 weights from w (the last `n` < 8 of a row: zero-padded) as float32, rounded (`round`). */
static inline __attribute__((always_inline)) __m256 halves(const uint16_t *w, int n, int round) {
    if (n < 8) {
        uint16_t pad[8] = {0};
        memcpy(pad, w, (size_t)n * 2);
        return rounded8(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)pad)), round);
    }
    return rounded8(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w)), round);
}

/* y rows m < MT, columns of the R float16 W rows from w (K inputs each, consecutive): 8 weights of each converted at
 * a time and shared by the tile's rows, one accumulator of 8 lanes per (W row, x row) pair, so a row of x alone
 * still runs R independent chains; the last K % 8 inputs zero-padded in both w and x. A pair's sum is the same
 * whatever MT and R are. */
static inline __attribute__((always_inline)) void tile_f16(int round, int MT, int R, const uint16_t *w,
                                                           const float *x, int64_t K, float *y, int64_t N) {
    __m256 acc[8][TILE];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) acc[r][m] = _mm256_setzero_ps();
    int64_t k8 = K & ~(int64_t)7;
    for (int64_t i = 0; i < k8; i += 8) {
        __m256 wv[8];
        UNROLL for (int r = 0; r < R; r++) wv[r] = halves(w + r * K + i, 8, round);
        UNROLL for (int m = 0; m < MT; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * K + i);
            UNROLL for (int r = 0; r < R; r++) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
        }
    }
    if (k8 < K) {
        int n = (int)(K - k8);
        __m256 wv[8];
        for (int r = 0; r < R; r++) wv[r] = halves(w + r * K + k8, n, round);
        for (int m = 0; m < MT; m++) {
            float pad[8] = {0};
            memcpy(pad, x + m * K + k8, (size_t)n * 4);
            __m256 xv = _mm256_loadu_ps(pad);
            for (int r = 0; r < R; r++) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) y[m * N + r] = sum8(acc[r][m]);
}

/* W rows per f16 tile of MT rows of x: up to 8 accumulators */
#define F16_R(MT) ((MT) == 1 ? 8 : (MT) == 2 ? 4 : (MT) <= 4 ? 2 : 1)
#define F16_TILES(round, RR) BY_MT(tile_f16(round, MT, RR, (const uint16_t *)w, x, K, y, N))

#if DOT
/* The lanes of a run of 32 values that hold one, `left` being the values from the run's start to the row's end. */
static inline __mmask32 first_lanes(int64_t left) {
    return left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
}

/* `tile_f16` for round 1 with AVX512-BF16, from x as bfloat16 (xh [M, K]): 32 weights of each W row converted to
 * float32 (exact) and rounded to bfloat16 by `vcvtne2ps2bf16` (the converted copy's weights), then multiplied by
 * pairs with `vdpbf16ps` (`tile_dot`'s arithmetic); the last K % 32 inputs zero-filled in both by masked loads. A
 * pair's sum is the same whatever MT and R are. */
static inline __attribute__((always_inline)) void tile_f16_dot(int MT, int R, const uint16_t *w, const uint16_t *xh,
                                                               int64_t K, float *y, int64_t N) {
    __m512 acc[8][TILE];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i += 32) {
        __mmask32 keep = first_lanes(K - i);
        __mmask16 lo = (__mmask16)keep, hi = (__mmask16)(keep >> 16);
        __m512bh pairs[8];
        UNROLL for (int r = 0; r < R; r++) {
            const uint16_t *wr = w + r * K + i;
            __m512 a = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lo, wr));
            __m512 b = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(hi, wr + 16));
            pairs[r] = _mm512_cvtne2ps_pbh(b, a);
        }
        UNROLL for (int m = 0; m < MT; m++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(keep, xh + m * K + i);
            UNROLL for (int r = 0; r < R; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], pairs[r], xv);
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) y[m * N + r] = _mm512_reduce_add_ps(acc[r][m]);
}
#define F16_DOT_TILES(RR) BY_MT(tile_f16_dot(MT, RR, (const uint16_t *)w, xh, K, y, N))
#endif

/* y's columns of the r float16 W rows from w0, F16_R(mt) at a time and the rest one by one (round 1 compiled
 * apart: the others are exact; with x as bfloat16, xh, `tile_f16_dot`). */
static void rows_f16(int round, int r, int mt, const uint8_t *w0, int64_t row_bytes, const float *x, int64_t K,
                     const uint16_t *xh, float *y, int64_t N) {
#if !DOT
    (void)xh;
#endif
    for (int i = 0; i < r;) {
        const uint8_t *w = w0 + i * row_bytes;
        int rr = r - i >= F16_R(mt) ? F16_R(mt) : 1; /* W rows in this tile */
#if DOT
        if (xh != NULL) {
            if (rr > 1) { F16_DOT_TILES(F16_R(MT)) } else { F16_DOT_TILES(1) }
        } else
#endif
        if (rr > 1) {
            if (round == 1) { F16_TILES(1, F16_R(MT)) } else { F16_TILES(0, F16_R(MT)) }
        } else {
            if (round == 1) { F16_TILES(1, 1) } else { F16_TILES(0, 1) }
        }
        i += rr;
        y += rr;
    }
}

/* A float16 row of K weights into out as `round` says (float32, bfloat16 or float16 bits). */
static void dequantize_f16_row(int round, const uint16_t *w, int64_t K, void *out) {
    if (round == 2) {
        memcpy(out, w, (size_t)K * 2);
        return;
    }
    for (int64_t i = 0; i < K; i += 8) {
        int n = K - i < 8 ? (int)(K - i) : 8;
        __m256 v = halves(w + i, n, round);
        if (round == 0) {
            float f[8];
            _mm256_storeu_ps(f, v);
            memcpy((float *)out + i, f, (size_t)n * 4);
        } else {
            uint16_t h[8];
            _mm_storeu_si128((__m128i *)h, high_halves(v));
            memcpy((uint16_t *)out + i, h, (size_t)n * 2);
        }
    }
}

/* The bytes of inputs 64c .. 64c + 31 (lo) and 64c + 32 .. 64c + 63 (hi) of a block, one code per byte. */
static inline __attribute__((always_inline)) void codes(int kind, const uint8_t *b, int c, __m256i *lo,
                                                        __m256i *hi) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    if (kind == KIND_Q4_K) { /* 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1 */
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
        *lo = _mm256_and_si256(q, nibble);
        *hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);
    } else { /* half h = c / 2: ql[64], qh[32]; even c: low nibbles + qh bits 0-3, odd c: high nibbles + bits 4-7 */
        const uint8_t *ql = b + 64 * (c >> 1), *qh = b + 128 + 32 * (c >> 1);
        __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        __m256i h = _mm256_loadu_si256((const __m256i *)qh);
        if (c & 1) {
            *lo = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nibble),
                                  _mm256_and_si256(h, _mm256_set1_epi8(0x30)));
            *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nibble),
                                  _mm256_srli_epi16(_mm256_and_si256(h, _mm256_set1_epi8((char)0xC0)), 2));
        } else {
            *lo = _mm256_or_si256(_mm256_and_si256(l0, nibble),
                                  _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x03)), 4));
            *hi = _mm256_or_si256(_mm256_and_si256(l1, nibble),
                                  _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x0C)), 2));
        }
    }
}
#endif

#if VECTOR == 1
/* w rounded to bfloat16 (round == 1, to nearest even: torch's conversion for finite values) or float16 (2). */
static inline __attribute__((always_inline)) __m512 rounded(__m512 w, int round) {
    if (round == 1) {
        __m512i bits = _mm512_castps_si512(w);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
        return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xFFFF0000u)));
    }
    if (round == 2) return _mm512_cvtph_ps(_mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return w;
}

/* Inputs 64c .. 64c + 63 of a block as four vectors of 16 weights. */
static inline __attribute__((always_inline)) void decode(int kind, int round, const uint8_t *b, const float *scale,
                                                         const float *low, int c, __m512 *w) {
    __m256i lo, hi;
    codes(kind, b, c, &lo, &hi);
    __m512i q[4] = {_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo)), _mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1)),
                    _mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi)), _mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1))};
    for (int v = 0; v < 4; v++) {
        if (kind == KIND_Q4_K) {
            int j = 2 * c + (v >> 1);
            w[v] = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(scale[j]), _mm512_cvtepi32_ps(q[v])),
                                 _mm512_set1_ps(low[j]));
        } else {
            __m512 value = _mm512_cvtepi32_ps(_mm512_sub_epi32(q[v], _mm512_set1_epi32(32)));
            w[v] = _mm512_mul_ps(_mm512_set1_ps(scale[4 * c + v]), value);
        }
        w[v] = rounded(w[v], round);
    }
}

/* y rows m < MT, columns of the R (1 or 2) W rows starting at w0 (the second at w0 + row_bytes). */
static inline __attribute__((always_inline)) void tile(int kind, int round, int MT, int R, const uint8_t *w0,
                                                       int64_t row_bytes, int64_t nb, const float *x, int64_t K,
                                                       float *y, int64_t N) {
    __m512 acc[2][TILE];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk++) {
        float scale[2][16], low[2][8];
        for (int r = 0; r < R; r++) factors(kind, w0 + r * row_bytes + blk * BLOCK_BYTES[kind], scale[r], low[r]);
        for (int c = 0; c < 4; c++) {
            __m512 w[2][4];
            for (int r = 0; r < R; r++)
                decode(kind, round, w0 + r * row_bytes + blk * BLOCK_BYTES[kind], scale[r], low[r], c, w[r]);
            UNROLL for (int v = 0; v < 4; v++) {
                const float *xp = x + blk * QK + 64 * c + 16 * v;
                UNROLL for (int m = 0; m < MT; m++) {
                    __m512 xv = _mm512_loadu_ps(xp + m * K);
                    UNROLL for (int r = 0; r < R; r++) acc[r][m] = _mm512_fmadd_ps(w[r][v], xv, acc[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) y[m * N + r] = _mm512_reduce_add_ps(acc[r][m]);
}

#if DOT
/* A q4_k block's inputs 64c .. 64c + 63 as bfloat16 weights, by table: a sub-block j has 16 weights, one per
 * code q, bf16(scale_j * q - low_j) (the float32 multiply then subtract of `decode`, rounded to nearest even as
 * `vcvtne2ps2bf16` rounds: the same values), so the two sub-blocks' 32 values are computed in one vector and each
 * code picks its own with `vpermw` (codes of sub-block 2c index words 0-15, those of 2c + 1 words 16-31). */
static inline __attribute__((always_inline)) void looked_up(const uint8_t *b, const float *scale, const float *low,
                                                            int c, __m512bh *pairs) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 t0 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(scale[2 * c]), q), _mm512_set1_ps(low[2 * c]));
    __m512 t1 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(scale[2 * c + 1]), q), _mm512_set1_ps(low[2 * c + 1]));
    __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t1, t0); /* words 0-15: sub-block 2c, 16-31: 2c + 1 */
    __m256i lo, hi;
    codes(KIND_Q4_K, b, c, &lo, &hi);
    pairs[0] = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(lo), table);
    pairs[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(_mm512_cvtepu8_epi16(hi), _mm512_set1_epi16(16)),
                                                  table);
}

/* round 1 with AVX512-BF16: y rows m < MT, columns of the R (1 or 2) W rows from w0, from x as bfloat16 (xh [M, K],
 * x rounded to nearest even, `to_bf16`). Each block is decoded to float32 as `decode` does, rounded to bfloat16 to
 * nearest even by `vcvtne2ps2bf16` (the weight `dequantize_row` writes with round 1; q4_k's by table, `looked_up`,
 * the same values), and 32 weights at a time
 * multiplied by a row of x with `vdpbf16ps`: lane i adds w[2i] x[2i] + w[2i + 1] x[2i + 1], each product of two
 * bfloat16 values exact in float32, to its float32 accumulator. The same products as `tile` with round 1 on x in
 * bfloat16, summed in another fixed order; a row's sum does not depend on the tile. Per 32 weights and row of x:
 * one instruction where `tile` runs two multiply-adds, and no rounding of each weight in integer operations. */
static inline __attribute__((always_inline)) void tile_dot(int kind, int MT, int R, const uint8_t *w0,
                                                           int64_t row_bytes, int64_t nb, const uint16_t *xh,
                                                           int64_t K, float *y, int64_t N) {
    __m512 acc[2][TILE];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk++) {
        float scale[2][16], low[2][8];
        for (int r = 0; r < R; r++) factors(kind, w0 + r * row_bytes + blk * BLOCK_BYTES[kind], scale[r], low[r]);
        for (int c = 0; c < 4; c++) {
            __m512bh pairs[2][2]; /* [W row][inputs 64c + 32h .. + 31] */
            for (int r = 0; r < R; r++) {
                const uint8_t *b = w0 + r * row_bytes + blk * BLOCK_BYTES[kind];
                if (kind == KIND_Q4_K) {
                    looked_up(b, scale[r], low[r], c, pairs[r]);
                    continue;
                }
                __m512 w[4];
                decode(kind, 0, b, scale[r], low[r], c, w);
                pairs[r][0] = _mm512_cvtne2ps_pbh(w[1], w[0]); /* (the second operand fills the low half) */
                pairs[r][1] = _mm512_cvtne2ps_pbh(w[3], w[2]);
            }
            UNROLL for (int h = 0; h < 2; h++) {
                const uint16_t *xp = xh + blk * QK + 64 * c + 32 * h;
                UNROLL for (int m = 0; m < MT; m++) {
                    __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xp + m * K));
                    UNROLL for (int r = 0; r < R; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], pairs[r][h], xv);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) y[m * N + r] = _mm512_reduce_add_ps(acc[r][m]);
}

#define DOT_TILES(kind, R) BY_MT(tile_dot(kind, MT, R, w0, row_bytes, nb, xh, K, y, N))

/* x [n] as bfloat16 bits, each rounded to nearest even (the last n % 32 by masked loads and stores). */
static void to_bf16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i += 32) {
        __mmask32 keep = first_lanes(n - i);
        __m512 a = _mm512_maskz_loadu_ps((__mmask16)keep, x + i);
        __m512 b = _mm512_maskz_loadu_ps((__mmask16)(keep >> 16), x + i + 16);
        _mm512_mask_storeu_epi16((void *)(out + i), keep, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}
#endif

#define TILES(kind, round, R) BY_MT(tile(kind, round, MT, R, w0, row_bytes, nb, x, K, y, N))

#define ROUNDS(kind, R)                                                                                       \
    if (round == 1) { TILES(kind, 1, R) } else if (round == 2) { TILES(kind, 2, R) } else { TILES(kind, 0, R) }

static void rows(int kind, int round, int r, int mt, const uint8_t *w0, int64_t row_bytes, int64_t nb,
                 const float *x, int64_t K, const float *xs, const uint16_t *xh, float *y, int64_t N) {
    (void)xs; /* (only the AVX2 path factors its sums) */
#if DOT
    if (xh != NULL) {
        if (kind == KIND_Q4_K) {
            if (r == 2) { DOT_TILES(KIND_Q4_K, 2) } else { DOT_TILES(KIND_Q4_K, 1) }
        } else {
            if (r == 2) { DOT_TILES(KIND_Q6_K, 2) } else { DOT_TILES(KIND_Q6_K, 1) }
        }
        return;
    }
#else
    (void)xh;
#endif
    if (kind == KIND_Q4_K) {
        if (r == 2) { ROUNDS(KIND_Q4_K, 2) } else { ROUNDS(KIND_Q4_K, 1) }
    } else {
        if (r == 2) { ROUNDS(KIND_Q6_K, 2) } else { ROUNDS(KIND_Q6_K, 1) }
    }
}

/* Row n's weights, rounded (`round`), into out (float32, bfloat16 or float16 bits: `round` 0, 1, 2). */
static void dequantize_row(int kind, int round, const uint8_t *row, int64_t nb, void *out) {
    for (int64_t blk = 0; blk < nb; blk++) {
        float scale[16], low[8];
        const uint8_t *b = row + blk * BLOCK_BYTES[kind];
        factors(kind, b, scale, low);
        for (int c = 0; c < 4; c++) {
            __m512 w[4];
            if (kind == KIND_Q4_K) decode(KIND_Q4_K, 0, b, scale, low, c, w);
            else decode(KIND_Q6_K, 0, b, scale, low, c, w);
            for (int v = 0; v < 4; v++) {
                int64_t at = blk * QK + 64 * c + 16 * v;
                if (round == 0) _mm512_storeu_ps((float *)out + at, w[v]);
                else if (round == 2)
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at),
                                        _mm512_cvtps_ph(w[v], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                else
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at),
                                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded(w[v], 1)), 16)));
            }
        }
    }
}
#elif VECTOR == 2

/* Codes 8v .. 8v + 7 of a 32-byte half of `codes` (v < 4) as 32-bit integers. */
static inline __attribute__((always_inline)) __m256i code_ints(__m256i half, int v) {
    __m128i lane = (v & 2) ? _mm256_extracti128_si256(half, 1) : _mm256_castsi256_si128(half);
    return _mm256_cvtepu8_epi32((v & 1) ? _mm_srli_si128(lane, 8) : lane);
}

/* Inputs 64c + 8v .. 64c + 8v + 7 of a block (v < 8) as 8 weights, from its `codes`. */
static inline __attribute__((always_inline)) __m256 weights(int kind, int round, __m256i lo, __m256i hi,
                                                            const float *scale, const float *low, int c, int v) {
    __m256i q = code_ints(v < 4 ? lo : hi, v & 3);
    __m256 w;
    if (kind == KIND_Q4_K) {
        int j = 2 * c + (v >> 2);
        w = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(scale[j]), _mm256_cvtepi32_ps(q)), _mm256_set1_ps(low[j]));
    } else {
        w = _mm256_mul_ps(_mm256_set1_ps(scale[4 * c + (v >> 1)]),
                          _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(32))));
    }
    return rounded8(w, round);
}

/* Codes 8v .. 8v + 7 of a 32-byte half of `codes` (v < 4) as float32 (exact), less 32 for q6_k. */
static inline __attribute__((always_inline)) __m256 code_floats(int kind, __m256i half, int v) {
    __m256i q = code_ints(half, v);
    return _mm256_cvtepi32_ps(kind == KIND_Q4_K ? q : _mm256_sub_epi32(q, _mm256_set1_epi32(32)));
}

/* With round 0 (float32 weights) the tile sums the same products factored as llama.cpp's dot products are, a
 * sub-block j at a time:
 *
 *   q4_k  y = sum_j (d sc_j) (q_j . x_j) - (dmin m_j) sum(x_j)        q6_k  y = sum_j (d sc_j) ((q_j - 32) . x_j)
 *
 * the codes converted to float32 exactly, each sub-block's dot product in float32 multiply-adds, then one
 * multiply-add by its factor; sum(x_j) per row and sub-block of 32 comes in xs (`sub_sums`). No multiply, subtract
 * per weight: a row of x costs 4 multiply-adds for 32 weights and a sub-block's decoding is shared by the tile's
 * rows. The float32 result differs from the decoded weights' products only by summation order; a row's sum does
 * not depend on the tile. */
static inline __attribute__((always_inline)) void tile_factored(int kind, int MT, const uint8_t *w, int64_t nb,
                                                                const float *x, int64_t K, const float *xs,
                                                                float *y, int64_t N) {
    __m256 acc[TILE];
    for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk++) {
        const uint8_t *b = w + blk * BLOCK_BYTES[kind];
        const float *xb = x + blk * QK;
        float scale[16], low[8];
        factors(kind, b, scale, low);
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            codes(kind, b, c, &lo, &hi);
            UNROLL for (int h = 0; h < 2; h++) { /* inputs 64c + 32h .. + 31: q4_k's sub-block 2c + h, q6_k's two */
                __m256 q[4];
                UNROLL for (int v = 0; v < 4; v++) q[v] = code_floats(kind, h ? hi : lo, v);
                const float *xh = xb + 64 * c + 32 * h;
                if (kind == KIND_Q4_K) {
                    __m256 s = _mm256_set1_ps(scale[2 * c + h]);
                    UNROLL for (int m = 0; m < MT; m++) {
                        const float *xm = xh + m * K;
                        __m256 d = _mm256_mul_ps(q[0], _mm256_loadu_ps(xm));
                        d = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xm + 8), d);
                        d = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xm + 16), d);
                        d = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xm + 24), d);
                        acc[m] = _mm256_fmadd_ps(s, d, acc[m]);
                    }
                } else {
                    __m256 s0 = _mm256_set1_ps(scale[4 * c + 2 * h]), s1 = _mm256_set1_ps(scale[4 * c + 2 * h + 1]);
                    UNROLL for (int m = 0; m < MT; m++) {
                        const float *xm = xh + m * K;
                        __m256 d0 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xm + 8), _mm256_mul_ps(q[0],
                                                                                                _mm256_loadu_ps(xm)));
                        __m256 d1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xm + 24),
                                                    _mm256_mul_ps(q[2], _mm256_loadu_ps(xm + 16)));
                        acc[m] = _mm256_fmadd_ps(s1, d1, _mm256_fmadd_ps(s0, d0, acc[m]));
                    }
                }
            }
        }
        if (kind == KIND_Q4_K) {
            __m256 l = _mm256_loadu_ps(low);
            UNROLL for (int m = 0; m < MT; m++)
                acc[m] = _mm256_fnmadd_ps(l, _mm256_loadu_ps(xs + m * (K / 32) + blk * 8), acc[m]);
        }
    }
    for (int m = 0; m < MT; m++) y[m * N] = sum8(acc[m]);
}

/* xs [M, K / 32]: each row's sums over its inputs 32g .. 32g + 31, in the same order for every row. */
static void sub_sums(const float *x, int64_t M, int64_t K, float *xs) {
    for (int64_t i = 0; i < M * (K / 32); i++) {
        const float *p = x + i * 32;
        xs[i] = sum8(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                        _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24))));
    }
}

/* y rows m < MT, column of the W row at w (8 accumulators of 8 lanes and the operands fit AVX2's 16 registers, so
 * a tile holds one W row: each block is decoded once per tile). Up to 2 rows of x the weights go from the decoding
 * to the multiply-adds in registers; from 3 rows a block is decoded into wb (in L1) first, and the multiply-adds
 * read it there: the compiler keeps the accumulators in registers. */
static inline __attribute__((always_inline)) void tile(int kind, int round, int MT, const uint8_t *w, int64_t nb,
                                                       const float *x, int64_t K, float *y, int64_t N) {
    __m256 acc[TILE];
    for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps();
    float wb[QK] __attribute__((aligned(32)));
    for (int64_t blk = 0; blk < nb; blk++) {
        const uint8_t *b = w + blk * BLOCK_BYTES[kind];
        const float *xb = x + blk * QK;
        float scale[16], low[8];
        factors(kind, b, scale, low);
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            codes(kind, b, c, &lo, &hi);
            UNROLL for (int v = 0; v < 8; v++) {
                __m256 wv = weights(kind, round, lo, hi, scale, low, c, v);
                if (MT <= 2)
                    UNROLL for (int m = 0; m < MT; m++)
                        acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xb + m * K + 64 * c + 8 * v), acc[m]);
                else _mm256_store_ps(wb + 64 * c + 8 * v, wv);
            }
        }
        if (MT > 2)
            for (int i = 0; i < QK; i += 8) {
                __m256 wv = _mm256_load_ps(wb + i);
                UNROLL for (int m = 0; m < MT; m++)
                    acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xb + m * K + i), acc[m]);
            }
    }
    for (int m = 0; m < MT; m++) y[m * N] = sum8(acc[m]);
}

#define TILES(kind, round) BY_MT(tile(kind, round, MT, w, nb, x, K, y, N))

#define FACTORED_TILES(kind) BY_MT(tile_factored(kind, MT, w, nb, x, K, xs, y, N))

#define ROUNDS(kind)                                                                                          \
    if (round == 1) { TILES(kind, 1) } else if (round == 2) { TILES(kind, 2) }                                \
    else if (FACTORED && (xs != NULL || kind == KIND_Q6_K)) { FACTORED_TILES(kind) } else { TILES(kind, 0) }

/* y's columns of the r W rows from w0 (the tile of mt rows of x at x; xs: their `sub_sums`, or NULL), one W row at
 * a time. */
static void rows(int kind, int round, int r, int mt, const uint8_t *w0, int64_t row_bytes, int64_t nb,
                 const float *x, int64_t K, const float *xs, const uint16_t *xh, float *y, int64_t N) {
    (void)xh; /* (only the AVX-512 path with AVX512-BF16 takes x as bfloat16) */
    for (int i = 0; i < r; i++) {
        const uint8_t *w = w0 + i * row_bytes;
        if (kind == KIND_Q4_K) { ROUNDS(KIND_Q4_K) } else { ROUNDS(KIND_Q6_K) }
        y++;
    }
}

/* Row n's weights, rounded (`round`), into out (float32, bfloat16 or float16 bits: `round` 0, 1, 2). */
static void dequantize_row(int kind, int round, const uint8_t *row, int64_t nb, void *out) {
    for (int64_t blk = 0; blk < nb; blk++) {
        float scale[16], low[8];
        const uint8_t *b = row + blk * BLOCK_BYTES[kind];
        factors(kind, b, scale, low);
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            if (kind == KIND_Q4_K) codes(KIND_Q4_K, b, c, &lo, &hi);
            else codes(KIND_Q6_K, b, c, &lo, &hi);
            for (int v = 0; v < 8; v++) {
                int64_t at = blk * QK + 64 * c + 8 * v;
                __m256 w = kind == KIND_Q4_K ? weights(KIND_Q4_K, 0, lo, hi, scale, low, c, v)
                                             : weights(KIND_Q6_K, 0, lo, hi, scale, low, c, v);
                if (round == 0) _mm256_storeu_ps((float *)out + at, w);
                else if (round == 2)
                    _mm_storeu_si128((__m128i *)((uint16_t *)out + at),
                                     _mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                else _mm_storeu_si128((__m128i *)((uint16_t *)out + at), high_halves(rounded8(w, 1)));
            }
        }
    }
}
#else
/* The portable path: one W row at a time, the block decoded into 256 floats, then TILE rows of x in 16 lanes. */
#ifdef __FLT16_MANT_DIG__
#define HAVE_HALF 1
static float rounded(float w, int round) {
    if (round == 1) return bf16_bits_to_float(float_to_bf16_bits(w));
    if (round == 2) return (float)(_Float16)w;
    return w;
}
#else
#define HAVE_HALF 0
static float rounded(float w, int round) { return round == 1 ? bf16_bits_to_float(float_to_bf16_bits(w)) : w; }
#endif

static void decode_block(int kind, int round, const uint8_t *b, float *w) {
    float scale[16], low[8];
    factors(kind, b, scale, low);
    if (kind == KIND_Q4_K) {
        for (int c = 0; c < 4; c++) {
            const uint8_t *q = b + 16 + 32 * c;
            for (int i = 0; i < 32; i++) w[64 * c + i] = scale[2 * c] * (float)(q[i] & 0xF) - low[2 * c];
            for (int i = 0; i < 32; i++) w[64 * c + 32 + i] = scale[2 * c + 1] * (float)(q[i] >> 4) - low[2 * c + 1];
        }
    } else {
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            float *o = w + 128 * h;
            const float *s = scale + 8 * h;
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                o[l] = s[is] * (float)((int)((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                o[l + 32] = s[is + 2] * (float)((int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                o[l + 64] = s[is + 4] * (float)((int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                o[l + 96] = s[is + 6] * (float)((int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
    }
    if (round)
        for (int i = 0; i < QK; i++) w[i] = rounded(w[i], round);
}

static void rows(int kind, int round, int r, int mt, const uint8_t *w0, int64_t row_bytes, int64_t nb,
                 const float *x, int64_t K, const float *xs, const uint16_t *xh, float *y, int64_t N) {
    (void)xs; /* (only the AVX2 path factors its sums) */
    (void)xh; /* (only the AVX-512 path with AVX512-BF16 takes x as bfloat16) */
    for (int i = 0; i < r; i++) {
        float acc[TILE][16], w[QK];
        memset(acc, 0, sizeof(acc));
        for (int64_t blk = 0; blk < nb; blk++) {
            decode_block(kind, round, w0 + i * row_bytes + blk * BLOCK_BYTES[kind], w);
            for (int m = 0; m < mt; m++) {
                const float *xp = x + m * K + blk * QK;
                for (int v = 0; v < QK; v += 16)
                    for (int l = 0; l < 16; l++) acc[m][l] += w[v + l] * xp[v + l];
            }
        }
        for (int m = 0; m < mt; m++) {
            float s = 0.0f;
            for (int l = 0; l < 16; l++) s += acc[m][l];
            y[m * N + i] = s;
        }
    }
}

/* The float16 W rows from w0, one at a time, 16 lanes a row of x (as `rows`). */
static void rows_f16(int round, int r, int mt, const uint8_t *w0, int64_t row_bytes, const float *x, int64_t K,
                     const uint16_t *xh, float *y, int64_t N) {
    (void)xh;
    for (int i = 0; i < r; i++) {
        const uint8_t *w = w0 + i * row_bytes;
        for (int m = 0; m < mt; m++) {
            float acc[16] = {0}, s = 0.0f;
            for (int64_t k = 0; k < K; k++) acc[k & 15] += rounded(half(w + 2 * k), round) * x[m * K + k];
            for (int l = 0; l < 16; l++) s += acc[l];
            y[m * N + i] = s;
        }
    }
}

static void dequantize_f16_row(int round, const uint16_t *w, int64_t K, void *out) {
    if (round == 2) {
        memcpy(out, w, (size_t)K * 2);
        return;
    }
    for (int64_t k = 0; k < K; k++) {
        float f = half((const uint8_t *)(w + k));
        if (round == 0) ((float *)out)[k] = f;
        else ((uint16_t *)out)[k] = float_to_bf16_bits(f);
    }
}

static void dequantize_row(int kind, int round, const uint8_t *row, int64_t nb, void *out) {
    float w[QK];
    for (int64_t blk = 0; blk < nb; blk++) {
        decode_block(kind, 0, row + blk * BLOCK_BYTES[kind], w);
        for (int i = 0; i < QK; i++) {
            int64_t at = blk * QK + i;
            if (round == 0) ((float *)out)[at] = w[i];
            else if (round == 1) ((uint16_t *)out)[at] = float_to_bf16_bits(w[i]);
#if HAVE_HALF
            else {
                _Float16 h = (_Float16)w[i];
                memcpy((uint16_t *)out + at, &h, 2);
            }
#endif
        }
    }
}
#endif

#if VECTOR
#define HAVE_HALF 1
#endif

/* float16 <-> bfloat16 (`to_bf16` 1: float16 -> bfloat16, 0: the reverse), each value rounded once to nearest even,
 * as torch's conversion rounds (through float32, which holds both exactly); a NaN stays a (quiet) NaN. */
static void convert(const uint16_t *src, uint16_t *dst, int64_t n, int to_bf16) {
    int64_t i = 0;
#if VECTOR == 1
    uint16_t in[16], out[16];
    for (; i < n; i += 16) {
        int64_t left = n - i < 16 ? n - i : 16;
        const uint16_t *s = src + i;
        if (left < 16) { /* the tail through a whole vector */
            memset(in, 0, sizeof(in));
            memcpy(in, s, (size_t)left * 2);
            s = in;
        }
        __m256i h = _mm256_loadu_si256((const __m256i *)s), r;
        if (to_bf16) {
            __m512 f = _mm512_cvtph_ps(h);
            __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(rounded(f, 1)), 16);
            bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
            r = _mm512_cvtepi32_epi16(bits);
        } else {
            __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            r = _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        if (left < 16) {
            _mm256_storeu_si256((__m256i *)out, r);
            memcpy(dst + i, out, (size_t)left * 2);
        } else {
            _mm256_storeu_si256((__m256i *)(dst + i), r);
        }
    }
#elif VECTOR == 2
    uint16_t in[8], out[8];
    for (; i < n; i += 8) {
        int64_t left = n - i < 8 ? n - i : 8;
        const uint16_t *s = src + i;
        if (left < 8) { /* the tail through a whole vector */
            memset(in, 0, sizeof(in));
            memcpy(in, s, (size_t)left * 2);
            s = in;
        }
        __m128i h = _mm_loadu_si128((const __m128i *)s), r;
        if (to_bf16) {
            __m256 f = _mm256_cvtph_ps(h);
            __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
            __m256 quiet = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)); /* (bfloat16 0x7FC0) */
            r = high_halves(_mm256_blendv_ps(rounded8(f, 1), quiet, nan));
        } else {
            __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            r = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        if (left < 8) {
            _mm_storeu_si128((__m128i *)out, r);
            memcpy(dst + i, out, (size_t)left * 2);
        } else {
            _mm_storeu_si128((__m128i *)(dst + i), r);
        }
    }
#else
    for (; i < n; i++) {
        uint8_t b[2] = {(uint8_t)(src[i] & 0xFF), (uint8_t)(src[i] >> 8)};
        if (to_bf16) {
            float f = half(b);
            dst[i] = f != f ? 0x7FC0 : float_to_bf16_bits(f);
        }
#if HAVE_HALF
        else {
            _Float16 h = (_Float16)bf16_bits_to_float(src[i]);
            memcpy(dst + i, &h, 2);
        }
#endif
    }
#endif
}

#if !DOT /* (a build with the pair products takes x as bfloat16: `to_bf16`) */
/* x [n] rounded to bfloat16 to nearest even (finite values, as torch rounds them), held as float32. */
static void bf16_rounded(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = bf16_bits_to_float(float_to_bf16_bits(x[i]));
}
#endif

struct job {
    int kind, round; /* kind -1: convert (round: 1 to bfloat16, 0 to float16) values n0 .. n1 of w into y */
    const uint8_t *w;
    const float *x; /* NULL: dequantize rows n0 .. n1 into y (bytes per weight by round) */
    const float *xs; /* x's `sub_sums` [M, K / 32] (AVX2, q4_k, round 0), or NULL */
    const uint16_t *xh; /* x as bfloat16 [M, K] (AVX512-BF16, round 1: `tile_dot`, `tile_f16_dot`), or NULL */
    void *y;
    int64_t M, N, K, n0, n1;
};

static void *work(void *arg) {
    const struct job *j = arg;
    if (j->kind < 0) {
        convert((const uint16_t *)j->w + j->n0, (uint16_t *)j->y + j->n0, j->n1 - j->n0, j->round);
        return NULL;
    }
    int64_t nb = j->K / BLOCK_INPUTS[j->kind], row_bytes = nb * BLOCK_BYTES[j->kind];
    if (j->x == NULL) {
        int64_t size = j->round ? 2 : 4;
        for (int64_t n = j->n0; n < j->n1; n++) {
            char *out = (char *)j->y + n * j->K * size;
            if (j->kind == KIND_F16) dequantize_f16_row(j->round, (const uint16_t *)(j->w + n * row_bytes), j->K, out);
            else dequantize_row(j->kind, j->round, j->w + n * row_bytes, nb, out);
        }
        return NULL;
    }
    for (int64_t m = 0; m < j->M; m += TILE) { /* a tile of x stays in cache while the thread's W rows pass */
        int mt = j->M - m < TILE ? (int)(j->M - m) : TILE;
        if (j->kind == KIND_F16) {
            rows_f16(j->round, (int)(j->n1 - j->n0), mt, j->w + j->n0 * row_bytes, row_bytes, j->x + m * j->K, j->K,
                     j->xh ? j->xh + m * j->K : NULL,
                     (float *)j->y + m * j->N + j->n0, j->N);
            continue;
        }
        for (int64_t n = j->n0; n < j->n1; n += 2) {
            int r = j->n1 - n >= 2 ? 2 : 1;
            rows(j->kind, j->round, r, mt, j->w + n * row_bytes, row_bytes, nb, j->x + m * j->K, j->K,
                 j->xs ? j->xs + m * (j->K / 32) : NULL, j->xh ? j->xh + m * j->K : NULL,
                 (float *)j->y + m * j->N + n, j->N);
        }
    }
    return NULL;
}

/* Worker threads kept between calls: started on first use (up to MAX_THREADS - 1, as calls ask), then waiting on a
 * condition variable for the next call's jobs, so a call costs a wake-up, not a thread start and join (~50-80 us
 * each on a 2-core VM, against a few ms for a decode pass's product). One call uses them at a time: a call made
 * while another holds them (the loader's conversion beside the compute thread's products) starts threads of its
 * own, as every call did before; a forked child, which has none of its parent's workers, starts its own. */
static struct {
    pthread_mutex_t hold;       /* held by the call using the workers */
    pthread_mutex_t lock;       /* guards the fields below */
    pthread_cond_t go, done;
    int started;                /* workers 1 .. started running */
    long pid;                   /* the process that started them */
    unsigned long calls;        /* calls handed out so far: a worker takes each one once */
    int wanted, left;           /* this call's workers (jobs[1 .. wanted]) and those not yet finished */
    struct job *jobs;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
          0, 0, 0, 0, 0, NULL};

/* pool.calls when worker i started: the calls before it are not its own */
static unsigned long born[MAX_THREADS];

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    unsigned long seen = born[id];
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.calls == seen) pthread_cond_wait(&pool.go, &pool.lock);
        seen = pool.calls;
        if (id > pool.wanted) continue;
        struct job *j = &pool.jobs[id];
        pthread_mutex_unlock(&pool.lock);
        work(j);
        pthread_mutex_lock(&pool.lock);
        if (--pool.left == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* jobs[1 .. threads - 1] on the pool's workers and jobs[0] on the caller; 0, or -1 where the pool is busy or
 * cannot start enough workers (nothing run then). */
static int pooled(struct job *jobs, int threads) {
    if (pthread_mutex_trylock(&pool.hold) != 0) return -1;
    long pid = (long)getpid();
    if (pool.pid != pid) { /* (first use, or a forked child: its parent's workers are not here) */
        pthread_mutex_init(&pool.lock, NULL);
        pthread_cond_init(&pool.go, NULL);
        pthread_cond_init(&pool.done, NULL);
        pool.started = 0;
        pool.calls = 0;
        pool.pid = pid;
    }
    while (pool.started < threads - 1) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        born[pool.started + 1] = pool.calls; /* (pool.calls changes only under pool.hold, which this call holds) */
        int failed = pthread_create(&id, &attr, worker, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (failed) {
            pthread_mutex_unlock(&pool.hold);
            return -1;
        }
        pool.started++;
    }
    pthread_mutex_lock(&pool.lock);
    pool.jobs = jobs;
    pool.wanted = pool.left = threads - 1;
    pool.calls++;
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.lock);
    work(&jobs[0]);
    pthread_mutex_lock(&pool.lock);
    while (pool.left > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.hold);
    return 0;
}

/* The jobs over pairs of W rows (or of values to convert) on `threads` threads (the caller's one of them): the
 * pool's workers, or threads started for this call where the pool is busy. */
static int run(struct job base, int threads) {
    int64_t pairs = (base.N + 1) / 2;
    if (base.kind < 0 && threads > 1 && base.N < (int64_t)1 << 16) threads = 1; /* (a thread costs ~20 us) */
    if (base.kind == KIND_F16 && base.x != NULL) { /* a thread per F16_WORK multiply-adds at most */
        int64_t most = base.M * base.N * base.K / F16_WORK;
        if (threads > most) threads = most > 1 ? (int)most : 1;
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > pairs) threads = pairs > 0 ? (int)pairs : 1;
    struct job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0}, rc = 0;
    for (int t = 0; t < threads; t++) {
        int64_t n0 = 2 * (pairs * t / threads), n1 = 2 * (pairs * (t + 1) / threads);
        jobs[t] = base;
        jobs[t].n0 = n0;
        jobs[t].n1 = n1 < base.N ? n1 : base.N;
    }
    if (threads == 1 || pooled(jobs, threads) == 0) {
        if (threads == 1) work(&jobs[0]);
        return 0;
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, work, &jobs[t]) == 0;
    work(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else { work(&jobs[t]); rc = -2; }
    }
    return rc;
}

static int bad(int kind, int round, int64_t N, int64_t K, int64_t M) {
    return kind < 0 || kind >= KINDS || round < 0 || round > 2 || (round == 2 && !HAVE_HALF) ||
           K % BLOCK_INPUTS[kind] || N < 0 || M < 0;
}

/* y [M, N] = x [M, K] @ W^T, W [N, K] as blocks of `kind` (row n at w + n * K / block inputs * block bytes), each
 * weight rounded as `round` says, float32, all contiguous; with round 1 x is rounded to bfloat16 as well (the
 * operands of a bfloat16 GEMM: exact for an engine whose activations are bfloat16). Returns 0; -1 for a kind or
 * rounding it does not know or K not whole blocks; -2 if a thread failed to start (its rows are then computed on
 * the calling thread); -3 if x's bfloat16 copy could not be allocated (nothing computed). */
int specoffload_ggml_matmul(int kind, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                            int threads, int round) {
    if (bad(kind, round, N, K, M) || x == NULL) return -1;
    float *xs = NULL, *xr = NULL;
    uint16_t *xh = NULL;
    if (round == 1 && M > 0) { /* x as bfloat16 too: a bfloat16 copy for the pair products, else rounded floats */
#if DOT
        if ((xh = malloc((size_t)(M * K) * sizeof(uint16_t))) == NULL) return -3;
        to_bf16(x, M * K, xh);
#else
        if ((xr = malloc((size_t)(M * K) * sizeof(float))) == NULL) return -3;
        bf16_rounded(x, M * K, xr);
        x = xr;
#endif
    }
#if FACTORED
    if (kind == KIND_Q4_K && round == 0 && M > 0 && (xs = malloc((size_t)(M * (K / 32)) * sizeof(float))) != NULL)
        sub_sums(x, M, K, xs); /* (without it, the tile decodes each weight) */
#endif
    struct job base = {kind, round, w, x, xs, xh, y, M, N, K, 0, 0};
    int rc = run(base, threads);
    free(xs);
    free(xr);
    free(xh);
    return rc;
}

/* W [N, K] into out: float32 (round 0), bfloat16 (1) or float16 (2), contiguous; the weights `specoffload_ggml_matmul`
 * multiplies with the same `round`. Returns as it does. */
int specoffload_ggml_dequantize(int kind, const uint8_t *w, int64_t N, int64_t K, void *out, int threads, int round) {
    if (bad(kind, round, N, K, 0)) return -1;
    return run((struct job){kind, round, w, NULL, NULL, NULL, out, 0, N, K, 0, 0}, threads);
}

/* n values between float16 and bfloat16 (`to_bf16` 1: float16 src -> bfloat16 dst; 0: the reverse), as torch's
 * dst.copy_(src) converts them but for NaN payloads. Returns as specoffload_ggml_matmul does. */
int specoffload_convert_16(const uint16_t *src, uint16_t *dst, int64_t n, int to_bf16, int threads) {
    if (n < 0 || to_bf16 < 0 || to_bf16 > 1 || (!to_bf16 && !HAVE_HALF)) return -1;
    return run((struct job){-1, to_bf16, (const uint8_t *)src, NULL, NULL, NULL, dst, 0, n, 0, 0, 0}, threads);
}
