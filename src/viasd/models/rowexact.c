// Row-exact quantized matrix products for viasd's native weights (see models/rowexact.py).
//
// y[t, n] = sum over blocks b of  scale[n, b] * dx[t, b] * isum(t, n, b)  +  min[n, b] * sx[t, b]
//   isum(t, n, b) = sum_i q[n, b*blk + i] * xq[t, b*blk + i]   (exact int32: u8 weight x s8 activation)
//   xq, dx: activation row t quantized per block of blk (int8, scale amax / 127); sx = dx * sum(xq)
// (where min = c * scale with an integer c, as in Q4_0 / Q5_0 / Q8_0 / Q6_K: one term,
//  scale[n, b] * dx[t, b] * (isum + c * sum(xq)), the correction exact in int32)
//
// Every output element is computed by the same sequence of float operations whatever the number of
// activation rows, which rows share a call, or which thread computes it: integer sums are exact, and
// each (t, n) accumulates its blocks in order, one fmaf per term. So a row's result never depends on
// its block (what lossless speculative decoding needs), while several rows share each weight load
// (what makes verifying k drafts cost much less than k one-row passes).
//
// Weight layout (packed by rowexact.py), per tile of 16 output rows and per block of blk inputs:
//   8-bit: blk/4 vectors of 64 bytes; byte 4r + j of vector g = q[row r][4g + j]
//   4-bit: blk/8 vectors of 64 bytes; byte 4r + j of vector v = q[r][4v + j] | q[r][4(v + blk/8) + j] << 4
//   5-bit (Q5_0, blk 32): the 4-bit layout of the low four bits, then one vector of 64 bytes of fifth
//     bits: bit g of byte 4r + j = bit 4 of q[r][4g + j] (the file's size, where 8-bit values read 1.5x
//     its bytes)
//   6-bit (Q6_K, blk 16): the 4-bit layout of the low four bits, then one vector of 64 bytes of high bit
//     pairs: bits 2g, 2g + 1 of byte 4r + j = bits 4, 5 of q[r][4g + j] (the file's size, where 8-bit
//     values read 1.3x its bytes)
//   scale, min of a block: 16 lanes (row r at lane r), stored as the file allows it exactly:
//     mode 1: half per block; 2: int8 per block times a half per super-block (sup_blocks blocks, per
//     row: the K-quants' two-level scales, d and dmin as the file has them); min mode 3: min_mult * scale
//     (an integer min_mult)
// Rows are a multiple of 16, columns a multiple of blk (16 or 32).

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>

typedef struct {
    int64_t rows, cols;
    int32_t blk, bits;
    const uint8_t *q;
    const void *scale, *min;  // per block [tile][block][16], in scale_mode / min_mode's type
    const uint16_t *scale_sup, *min_sup;  // mode 2: per super-block [tile][super][16], half (the file's d, dmin)
    int32_t scale_mode, min_mode, sup_blocks;  // sup_blocks: 1, 8 (Q4_K) or 16 (Q6_K), a power of two
    float min_mult;  // min mode 3
} rx_weight;

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    uint32_t bits;
    if (e == 31) bits = sign | 0x7f800000u | (m << 13);
    else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) bits = sign;
    else {  // subnormal: value m * 2^-24, exact in float
        const float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// lane r of a block's scale (which = 0) or min (which = 1; not for min mode 3, folded into the sums)
static float block_value(const rx_weight *w, int which, int64_t tile, int64_t b, int r) {
    const int64_t nblk = w->cols / w->blk, i = (tile * nblk + b) * 16 + r;
    const int mode = which ? w->min_mode : w->scale_mode;
    const void *p = which ? w->min : w->scale;
    if (mode == 1) return half_to_float(((const uint16_t *)p)[i]);
    const int64_t nsup = nblk / w->sup_blocks;
    const uint16_t *sup = which ? w->min_sup : w->scale_sup;
    return half_to_float(sup[(tile * nsup + b / w->sup_blocks) * 16 + r]) * (float)((const int8_t *)p)[i];
}

// offsets into struct ggml_tensor, given by the caller (from the bound layout)
static size_t OFF_NE, OFF_NB, OFF_SRC, OFF_DATA;

void rx_set_layout(size_t ne, size_t nb, size_t src, size_t data) {
    OFF_NE = ne; OFF_NB = nb; OFF_SRC = src; OFF_DATA = data;
}

// ---------------------------------------------------------------- activations
// one row: x[cols] -> xq[cols] int8, dx[nb], sx[nb]
static void quantize_row(const float *x, int64_t cols, int blk, int8_t *xq, float *dx, float *sx, int32_t *qsum) {
    for (int64_t b = 0; b < cols / blk; b++) {
        const float *v = x + b * blk;
        float amax = 0.0f;
        for (int i = 0; i < blk; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < blk; i++) {
            const int q = (int)nearbyintf(v[i] * id);
            xq[b * blk + i] = (int8_t)q;
            sum += q;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
        qsum[b] = sum;
    }
}

// bytes of one tile's block in the packed layout (above): 8-bit values, or nibbles and a high-bit plane
__attribute__((always_inline)) static inline int64_t block_bytes(int blk, int bits) {
    return (int64_t)blk * (bits == 8 ? 16 : 8) + (bits == 5 || bits == 6 ? 64 : 0);
}

// ---------------------------------------------------------------- reference kernel (any CPU)
static int32_t wq(const rx_weight *w, int64_t tile, int64_t b, int r, int i) {
    // quantized weight of row 16*tile + r, input b*blk + i, from the packed layout
    const int64_t nblk = w->cols / w->blk;
    const uint8_t *p = w->q + (tile * nblk + b) * block_bytes(w->blk, w->bits);
    if (w->bits == 8) return p[(i / 4) * 64 + r * 4 + (i % 4)];
    const int half = w->blk / 2;
    const int hi = i >= half, k = i - hi * half;
    const uint8_t byte = p[(k / 4) * 64 + r * 4 + (k % 4)];
    const int32_t low = hi ? byte >> 4 : byte & 15;
    if (w->bits == 4) return low;
    const int H = w->bits - 4;  // high bits a value: group g's at bits H*g .. H*g + H - 1 of the plane's byte
    return low | ((p[w->blk * 8 + r * 4 + (i % 4)] >> (H * (i / 4))) & ((1 << H) - 1)) << 4;
}

static void tiles_ref(const rx_weight *w, int64_t t0, int64_t t1, int64_t T, const int8_t *xq, const float *dx,
                      const float *sx, const int32_t *qsum, float *y, int64_t ystride) {
    const int64_t nblk = w->cols / w->blk;
    for (int64_t tile = t0; tile < t1; tile++)
        for (int64_t t = 0; t < T; t++)
            for (int r = 0; r < 16; r++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nblk; b++) {
                    int32_t isum = 0;
                    for (int i = 0; i < w->blk; i++) isum += wq(w, tile, b, r, i) * xq[t * w->cols + b * w->blk + i];
                    const float sc = block_value(w, 0, tile, b, r);
                    if (w->min_mode == 3) {  // min = c * scale: one exact integer sum, one product
                        acc = fmaf((float)(isum + (int32_t)w->min_mult * qsum[t * nblk + b]), sc * dx[t * nblk + b], acc);
                    } else {
                        acc = fmaf((float)isum, sc * dx[t * nblk + b], acc);
                        acc = fmaf(block_value(w, 1, tile, b, r), sx[t * nblk + b], acc);
                    }
                }
                y[t * ystride + tile * 16 + r] = acc;
            }
}

// A kernel's shape for weight w as constants: CALL(BLK, BITS, SM, MM, SUP), with the scale mode, min
// mode and sup_blocks of the zoo's types as constants too (Q4_K, Q4_0, Q5_0, Q6_K, Q8_0: branch-free
// block scales, a pass' one-row products 0.97x the time on the AMX Xeon), else 0: read from w
#define RX_DISPATCH(w, CALL)                                                                 \
    do {                                                                                     \
        const int sm_ = (w)->scale_mode, mm_ = (w)->min_mode, sup_ = (w)->sup_blocks;        \
        if ((w)->bits == 4 && sm_ == 2 && mm_ == 2 && sup_ == 8) CALL(32, 4, 2, 2, 8);      \
        else if ((w)->bits == 4 && sm_ == 1 && mm_ == 3) CALL(32, 4, 1, 3, 1);              \
        else if ((w)->bits == 4) CALL(32, 4, 0, 0, 0);                                      \
        else if ((w)->bits == 5 && sm_ == 1 && mm_ == 3) CALL(32, 5, 1, 3, 1);              \
        else if ((w)->bits == 5) CALL(32, 5, 0, 0, 0);                                      \
        else if ((w)->bits == 6 && sm_ == 2 && mm_ == 3 && sup_ == 16) CALL(16, 6, 2, 3, 16); \
        else if ((w)->bits == 6) CALL(16, 6, 0, 0, 0);                                      \
        else if ((w)->blk == 32 && sm_ == 1 && mm_ == 3) CALL(32, 8, 1, 3, 1);              \
        else if ((w)->blk == 32) CALL(32, 8, 0, 0, 0);                                      \
        else CALL(16, 8, 0, 0, 0);                                                          \
    } while (0)

// a block shape's scale mode, min mode and super-block size: the constants SM, MM, SUP where given
// (RX_DISPATCH), else w's; with the block and super-block counts of a tile
typedef struct { int scale_mode, min_mode, sup_blocks, sup_shift; int64_t nblk, nsup; } rx_shape;
__attribute__((always_inline)) static inline rx_shape shape_of(const rx_weight *w, int BLK, int SM, int MM, int SUP) {
    rx_shape s = {SM ? SM : w->scale_mode, MM ? MM : w->min_mode, SUP ? SUP : w->sup_blocks, 0, w->cols / BLK, 0};
    s.sup_shift = __builtin_ctz((unsigned)s.sup_blocks);
    s.nsup = s.nblk / s.sup_blocks;
    return s;
}

#define RX_AVX2 __attribute__((target("avx2,fma,f16c")))

// A row's first maximum among the outputs a thread computes, kept per lane (lane r of tile n: output
// 16 n + r) as the VNNI and AVX2 kernels store each tile's 16 values: greedy decoding then never scans
// the logits (a cold 152k-float row took ~0.17 ms on the AMX Xeon; these add ~12 instructions a
// tile). In a lane the first of equal values stays (tiles ascend); best_result takes the lowest index
// among the lanes' equal maxima: the first maximum, as numpy's and torch's argmax.
typedef struct {
    __m256 v[2], i[2], nan;  // (indices as int32 bits)
    int any;
} rx_best;

RX_AVX2 static inline void best_update(rx_best *b, const float *y16, int64_t first) {
    for (int h = 0; h < 2; h++) {
        const __m256 v = _mm256_loadu_ps(y16 + 8 * h);
        const __m256 idx = _mm256_castsi256_ps(
            _mm256_add_epi32(_mm256_set1_epi32((int32_t)(first + 8 * h)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        b->nan = _mm256_or_ps(b->nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 gt = b->any ? _mm256_cmp_ps(v, b->v[h], _CMP_GT_OQ) : _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        b->v[h] = _mm256_blendv_ps(b->v[h], v, gt);
        b->i[h] = _mm256_blendv_ps(b->i[h], idx, gt);
    }
    b->any = 1;
}

// the row's first maximum: its value and index; index -1: no outputs, -2: one was NaN
RX_AVX2 static void best_result(const rx_best *b, float *value, int32_t *index) {
    float v[16];
    int32_t i[16];
    _mm256_storeu_ps(v, b->v[0]), _mm256_storeu_ps(v + 8, b->v[1]);
    _mm256_storeu_ps((float *)i, b->i[0]), _mm256_storeu_ps((float *)(i + 8), b->i[1]);
    *value = 0.0f, *index = -1;
    if (!b->any) return;
    if (_mm256_movemask_ps(b->nan)) { *index = -2; return; }
    int k = 0;
    for (int r = 1; r < 16; r++)
        if (v[r] > v[k] || (v[r] == v[k] && i[r] < i[k])) k = r;
    *value = v[k], *index = i[k];
}

// ---------------------------------------------------------------- AVX-512 VNNI kernel
#define RX_CHUNK 8  // activation rows per pass over a tile's weights
#define RX_AHEAD 8  // software prefetch distance, in blocks
#define RX_AHEAD_L2 16  // and into L2 this far on: the hardware streamers alone left it short (qwen2.5-coder-0.5b's
// one-row pass 0.91-0.93x the time with 16-48 blocks on the AMX Xeon, the AVX2 kernel 0.95x; one level
// alone, at 4-32 blocks, was no faster than 8 into L1). 16 against 32: a pass' products 0.95-0.96x the
// time there (0.5B, 1.5B; the AVX2 kernel forced there 0.95x); 12 or 24 blocks, or 4 or 6 KB, no better
// software prefetch of the weights for passes of up to this many rows (all by default: with 8 rows a
// block's weights are still read from memory while the previous ones are multiplied; benchmarks lower
// it to compare, see rx_set_prefetch_rows)
static int prefetch_rows = RX_CHUNK;

void rx_set_prefetch_rows(int rows) { prefetch_rows = rows; }

// ask for the weights of the block RX_AHEAD blocks on (into L1) and RX_AHEAD_L2 on (into L2); p: this block
__attribute__((always_inline)) static inline void prefetch_ahead(const uint8_t *p, int64_t qbytes) {
    for (int64_t off = 0; off < qbytes; off += 64) _mm_prefetch((const char *)p + RX_AHEAD * qbytes + off, _MM_HINT_T0);
    for (int64_t off = 0; off < qbytes; off += 64) _mm_prefetch((const char *)p + RX_AHEAD_L2 * qbytes + off, _MM_HINT_T1);
}

// A super-block's scale (which = 0) or min (1) of mode 2, as floats (zero in other modes): read and
// converted once every sup_blocks blocks (sup_shift = log2(sup_blocks), from the caller: two integer
// divisions a call cost a 4864x1024 Q4_K product a third more time on one thread, hot in cache)
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline __m512 sup_vector(const rx_weight *w, int which, int mode, int64_t nsup, int sup_shift, int64_t tile, int64_t b) {
    if (mode != 2) return _mm512_setzero_ps();
    const uint16_t *sup = (which ? w->min_sup : w->scale_sup) + (tile * nsup + (b >> sup_shift)) * 16;
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sup));
}

// a block's scale or min: mode 1 its half, mode 2 its int8 times the super-block's `sup`
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline __m512 block_vector(const rx_weight *w, int which, int mode, int64_t nblk, int64_t tile, int64_t b, __m512 sup) {
    const int64_t i = (tile * nblk + b) * 16;
    const void *p = which ? w->min : w->scale;
    if (mode == 1) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    const __m512 sub = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + i))));
    return _mm512_mul_ps(sup, sub);
}

// a tile's block of weights at p as 8-bit values, G = BLK / 4 vectors (group g: 4 inputs of each of the
// 16 rows): 8-bit values as they are, nibbles and a high-bit plane unpacked
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void block_weights(const uint8_t *p, const int BLK, const int BITS, __m512i *wv) {
    const int G = BLK / 4, H = BITS - 4;  // (5-, 6-bit: high bits a value in the plane after the nibbles)
    const __m512i low = _mm512_set1_epi8(15), high = _mm512_set1_epi8((char)(((1 << H) - 1) << 4));
    if (BITS == 8) {
        for (int g = 0; g < G; g++) wv[g] = _mm512_loadu_si512((const void *)(p + 64 * g));
        return;
    }
    for (int v = 0; v < G / 2; v++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(p + 64 * v));
        wv[v] = _mm512_and_si512(raw, low);
        wv[v + G / 2] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    if (BITS == 5 || BITS == 6) {  // bits H*g.. of the plane's bytes become bits 4.. of group g's values
        const __m512i hv = _mm512_loadu_si512((const void *)(p + BLK * 8));
        for (int g = 0; g < G; g++) {  // (0xF8: wv | (shifted & high), as high_bits does for AVX2)
            const int up = 4 - H * g;
            wv[g] = _mm512_ternarylogic_epi32(wv[g], up >= 0 ? _mm512_slli_epi16(hv, up) : _mm512_srli_epi16(hv, -up), high, 0xF8);
        }
    }
}

// One tile x NT activation rows (compile-time NT: the accumulators stay in registers). (Two tiles at
// once for up to three rows, independent accumulation chains, was slower on the 2-core AMD EPYC with
// AVX-512 of session 15: qwen2.5-coder-1.5b passes of 1 / 2 / 3 rows 23-24 / 25-26 / 26-27 ms against
// 24-29 / 30-33 / 35-38, alternated runs of benchmarks/native_probe.py's kind; results unchanged.)
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void tile_vnni_nt(const rx_weight *w, int64_t tile, const int NT, const int BLK, const int BITS,
                                const int SM, const int MM, const int SUP, const int8_t *xq, const float *dx,
                                const float *sx, const int32_t *qsum, float *y, int64_t ystride) {
    const rx_shape sh = shape_of(w, BLK, SM, MM, SUP);  // (SM, MM, SUP: constants, or 0: read from w)
    const int scale_mode = sh.scale_mode, min_mode = sh.min_mode, sup_blocks = sh.sup_blocks, sup_shift = sh.sup_shift;
    const int64_t nblk = sh.nblk, nsup = sh.nsup;
    const int G = BLK / 4;  // groups of 4 inputs a block
    const int64_t qbytes = block_bytes(BLK, BITS);
    __m512 acc[RX_CHUNK], sup_sc = _mm512_setzero_ps(), sup_mn = _mm512_setzero_ps();
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        const uint8_t *p = w->q + (tile * nblk + b) * qbytes;
        if (NT <= prefetch_rows) prefetch_ahead(p, qbytes);
        __m512i wv[8];
        block_weights(p, BLK, BITS, wv);
        if (!(b & (sup_blocks - 1)))  // a super-block begins
            sup_sc = sup_vector(w, 0, scale_mode, nsup, sup_shift, tile, b), sup_mn = sup_vector(w, 1, min_mode, nsup, sup_shift, tile, b);
        const __m512 sc = block_vector(w, 0, scale_mode, nblk, tile, b, sup_sc);
        const int mult = min_mode == 3;
        const __m512 mn = mult ? _mm512_setzero_ps() : block_vector(w, 1, min_mode, nblk, tile, b, sup_mn);  // (mult: unused)
        for (int t = 0; t < NT; t++) {
            const int32_t *xa = (const int32_t *)(xq + t * w->cols + b * BLK);
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            // vpdpbusd with the activation's 4 bytes broadcast from memory ({1to16}): GCC does not fold
            // _mm512_set1_epi32 into it (a separate vpbroadcastd each; a pass' products 0.98x the time folded)
            for (int g = 0; g < G; g += 2) {
                __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s0) : "v"(wv[g]), "m"(xa[g]));
                __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s1) : "v"(wv[g + 1]), "m"(xa[g + 1]));
            }
            __m512i isum = _mm512_add_epi32(s0, s1);
            if (mult) isum = _mm512_add_epi32(isum, _mm512_set1_epi32((int32_t)w->min_mult * qsum[t * nblk + b]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc, _mm512_set1_ps(dx[t * nblk + b])), acc[t]);
            if (!mult) acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[t * nblk + b]), acc[t]);
        }
    }
    for (int t = 0; t < NT; t++) _mm512_storeu_ps(y + t * ystride + tile * 16, acc[t]);
}

// the block shapes as constants: loops unrolled, weights in registers
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void rx_case(const rx_weight *w, int64_t tile, const int NT, const int8_t *xq, const float *dx,
                           const float *sx, const int32_t *qsum, float *y, int64_t ystride) {
#define RX_T(BLK, BITS, SM, MM, SUP) tile_vnni_nt(w, tile, NT, BLK, BITS, SM, MM, SUP, xq, dx, sx, qsum, y, ystride)
    RX_DISPATCH(w, RX_T);
#undef RX_T
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void tiles_vnni(const rx_weight *w, int64_t t0, int64_t t1, int64_t T, const int8_t *xq, const float *dx,
                       const float *sx, const int32_t *qsum, float *y, int64_t ystride) {
    const int64_t nblk = w->cols / w->blk;
#define RX_CASE(NT) rx_case(w, tile, NT, xq + c * w->cols, dx + c * nblk, sx + c * nblk, qsum + c * nblk, y + c * ystride, ystride)
    for (int64_t c = 0; c < T; c += RX_CHUNK) {
        const int nt = (int)(T - c < RX_CHUNK ? T - c : RX_CHUNK);
        for (int64_t tile = t0; tile < t1; tile++) {
            switch (nt) {
                case 1: RX_CASE(1); break;
                case 2: RX_CASE(2); break;
                case 3: RX_CASE(3); break;
                case 4: RX_CASE(4); break;
                case 5: RX_CASE(5); break;
                case 6: RX_CASE(6); break;
                case 7: RX_CASE(7); break;
                default: RX_CASE(8); break;
            }
        }
    }
#undef RX_CASE
}

// the same quantization as quantize_row, 16 values at a time (cvtps_epi32 rounds half to even, as
// nearbyintf does in the default rounding mode)
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void quantize_row_vnni(const float *x, int64_t cols, int blk, int8_t *xq, float *dx, float *sx, int32_t *qsum) {
    for (int64_t b = 0; b < cols / blk; b++) {
        const float *v = x + b * blk;
        __m512 m = _mm512_abs_ps(_mm512_loadu_ps(v));
        if (blk == 32) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(v + 16)));
        const float amax = _mm512_reduce_max_ps(m);
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int h = 0; h < blk; h += 16) {
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + h), _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(xq + b * blk + h), _mm512_cvtsepi32_epi8(q));
            sum += _mm512_reduce_add_epi32(q);
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
        qsum[b] = sum;
    }
}

// ---------------------------------------------------------------- AVX2 kernel (FMA, F16C)
// The same sums as the reference: u8 x s8 pairs through vpmaddubsw (no saturation: q <= 63, or, for
// 8-bit types whose q reaches 255 (Q8_0), q - 128 with the sign moved onto the activation, as ggml
// does, and 128 * sum(xq) added back), then vpmaddwd into int32; the float part per lane as above.
#define RX_AVX2_ROWS 3  // activation rows per pass over a tile's weights (2 and 4 were slower at 3-8 rows)

// quantize_row's results with vector ops (the scalar loop called libm's fmaxf and nearbyintf for every
// value: 6% of smollm2's decoding CPU samples under perf on the AVX2 EPYC). The same numbers: max is exact
// (a NaN value is skipped, as fmaxf skips it), v * id is the same product, vcvtps2dq rounds in the
// current mode as nearbyintf does, and |q| <= 127 fits int8.
RX_AVX2 static void quantize_row_avx2(const float *x, int64_t cols, int blk, int8_t *xq, float *dx, float *sx, int32_t *qsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < cols / blk; b++) {
        const float *v = x + b * blk;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < blk; i += 8)  // (max_ps gives its second operand when the first is NaN)
            m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)), m);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        __m256i s = _mm256_setzero_si256();
        for (int i = 0; i < blk; i += 8) {
            const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(id)));
            s = _mm256_add_epi32(s, q);
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, q);
            for (int j = 0; j < 8; j++) xq[b * blk + i + j] = (int8_t)lanes[j];
        }
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        const int sum = _mm_cvtsi128_si32(t);
        dx[b] = d;
        sx[b] = d * (float)sum;
        qsum[b] = sum;
    }
}

// sup_vector's half h (rows 8h .. 8h + 7) for AVX2
RX_AVX2 __attribute__((always_inline))
static inline __m256 sup_vector8(const rx_weight *w, int which, int mode, int64_t nsup, int sup_shift, int64_t tile,
                                 int64_t b, int h) {
    if (mode != 2) return _mm256_setzero_ps();
    const uint16_t *sup = (which ? w->min_sup : w->scale_sup) + (tile * nsup + (b >> sup_shift)) * 16 + 8 * h;
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sup));
}

// block_vector's half h
RX_AVX2 __attribute__((always_inline))
static inline __m256 block_vector8(const rx_weight *w, int which, int mode, int64_t nblk, int64_t tile, int64_t b, int h,
                                   __m256 sup) {
    const int64_t i = (tile * nblk + b) * 16 + 8 * h;
    const void *p = which ? w->min : w->scale;
    if (mode == 1) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    const __m256 sub = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + i))));
    return _mm256_mul_ps(sup, sub);
}

// group g's H high bits (bits H*g.. of each byte of the plane) moved to bits 4.. (shifts within 16-bit
// lanes move no bit into the other byte's bits 4 .. 3 + H)
RX_AVX2 static inline __m256i high_bits(__m256i hv, int g, int H) {
    const __m256i high = _mm256_set1_epi8((char)(((1 << H) - 1) << 4));
    const int up = 4 - H * g;
    return _mm256_and_si256(up >= 0 ? _mm256_slli_epi16(hv, up) : _mm256_srli_epi16(hv, -up), high);
}

// One tile x NT activation rows (NT <= RX_AVX2_ROWS). Each step unpacks two groups for both halves of
// the tile (rows 0-7 and 8-15) and uses them at once for every row, so that each row's activation
// broadcast serves both halves; the 16-bit sums of both halves, the four weight vectors and the two
// broadcasts fit AVX2's 16 registers for two rows (three spill the float accumulators, which are
// touched once a block). Integer sums are exact in any order, and the float operations per row are
// the reference's, in its order.
RX_AVX2 __attribute__((always_inline))
static inline void tiles_avx2_nt(const rx_weight *w, int64_t tile, const int NT, const int BLK, const int BITS, const int WIDE,
                                 const int SM, const int MM, const int SUP, const int8_t *xq, const float *dx,
                                 const float *sx, const int32_t *qsum, float *y, int64_t ystride) {
    const rx_shape sh = shape_of(w, BLK, SM, MM, SUP);  // (as tile_vnni_nt's)
    const int scale_mode = sh.scale_mode, min_mode = sh.min_mode, sup_blocks = sh.sup_blocks, sup_shift = sh.sup_shift;
    const int64_t nblk = sh.nblk, nsup = sh.nsup;
    const int mult = min_mode == 3;
    const int G = BLK / 4;
    const int64_t qbytes = block_bytes(BLK, BITS);
    // maddubs results (16-bit pair sums) added in 16 bits before widening, as many as cannot overflow:
    // |pair| <= 2 * max(q) * 128 (15 for 4-bit values, 31 for 5-bit, 63 for 6-bit and 8-bit but Q8_0's 128)
    const int PAIRS = BITS == 4 ? 8 : BITS == 5 ? 4 : WIDE ? 1 : 2;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[2][RX_AVX2_ROWS], sup_sc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()},
           sup_mn[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // (mode 2: a super-block's, per half)
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < NT; t++) acc[h][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        const uint8_t *p = w->q + (tile * nblk + b) * qbytes;
        if (NT <= prefetch_rows) prefetch_ahead(p, qbytes);
        __m256i isum[2][RX_AVX2_ROWS], s16[2][RX_AVX2_ROWS];
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < NT; t++) isum[h][t] = s16[h][t] = _mm256_setzero_si256();
        int pending = 0;  // groups summed in s16 since it was last widened
        for (int s = 0; s < G / 2; s++) {  // two groups a step: ga and gb, both halves
            int ga, gb;
            __m256i wa[2], wb[2];
            for (int h = 0; h < 2; h++) {
                if (BITS == 8) {
                    ga = 2 * s, gb = 2 * s + 1;
                    wa[h] = _mm256_loadu_si256((const __m256i *)(p + 64 * ga + 32 * h));
                    wb[h] = _mm256_loadu_si256((const __m256i *)(p + 64 * gb + 32 * h));
                } else {  // one vector's low and high nibbles: groups s and s + G/2
                    ga = s, gb = s + G / 2;
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 64 * s + 32 * h));
                    wa[h] = _mm256_and_si256(raw, low);
                    wb[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    if (BITS == 5 || BITS == 6) {
                        const __m256i hv = _mm256_loadu_si256((const __m256i *)(p + BLK * 8 + 32 * h));
                        wa[h] = _mm256_or_si256(wa[h], high_bits(hv, ga, BITS - 4));
                        wb[h] = _mm256_or_si256(wb[h], high_bits(hv, gb, BITS - 4));
                    }
                }
            }
            if (WIDE) {  // |q - 128| (shared by the rows) times the activation with q - 128's sign
                for (int h = 0; h < 2; h++) {
                    const __m256i sa = _mm256_xor_si256(wa[h], flip), sb = _mm256_xor_si256(wb[h], flip);
                    const __m256i ua = _mm256_sign_epi8(sa, sa), ub = _mm256_sign_epi8(sb, sb);
                    for (int t = 0; t < NT; t++) {
                        const int32_t *xa = (const int32_t *)(xq + t * w->cols + b * BLK);
                        const __m256i pa = _mm256_maddubs_epi16(ua, _mm256_sign_epi8(_mm256_set1_epi32(xa[ga]), sa));
                        const __m256i pb = _mm256_maddubs_epi16(ub, _mm256_sign_epi8(_mm256_set1_epi32(xa[gb]), sb));
                        isum[h][t] = _mm256_add_epi32(isum[h][t], _mm256_add_epi32(_mm256_madd_epi16(pa, ones), _mm256_madd_epi16(pb, ones)));
                    }
                }
            } else {
                for (int t = 0; t < NT; t++) {
                    const int32_t *xa = (const int32_t *)(xq + t * w->cols + b * BLK);
                    const __m256i xa_ = _mm256_set1_epi32(xa[ga]), xb_ = _mm256_set1_epi32(xa[gb]);
                    for (int h = 0; h < 2; h++) {
                        s16[h][t] = _mm256_add_epi16(s16[h][t], _mm256_maddubs_epi16(wa[h], xa_));
                        s16[h][t] = _mm256_add_epi16(s16[h][t], _mm256_maddubs_epi16(wb[h], xb_));
                    }
                }
                pending += 2;
                if (pending == PAIRS || s == G / 2 - 1) {
                    for (int h = 0; h < 2; h++)
                        for (int t = 0; t < NT; t++) {
                            isum[h][t] = _mm256_add_epi32(isum[h][t], _mm256_madd_epi16(s16[h][t], ones));
                            s16[h][t] = _mm256_setzero_si256();
                        }
                    pending = 0;
                }
            }
        }
        if (!(b & (sup_blocks - 1)))
            for (int h = 0; h < 2; h++)
                sup_sc[h] = sup_vector8(w, 0, scale_mode, nsup, sup_shift, tile, b, h),
                sup_mn[h] = sup_vector8(w, 1, min_mode, nsup, sup_shift, tile, b, h);
        for (int h = 0; h < 2; h++) {  // rows 0-7, then 8-15: each 64-byte vector's halves
            const __m256 sc = block_vector8(w, 0, scale_mode, nblk, tile, b, h, sup_sc[h]);
            const __m256 mn = mult ? _mm256_setzero_ps() : block_vector8(w, 1, min_mode, nblk, tile, b, h, sup_mn[h]);  // (mult: unused)
            for (int t = 0; t < NT; t++) {
                int32_t extra = mult ? (int32_t)w->min_mult * qsum[t * nblk + b] : 0;
                if (WIDE) extra += 128 * qsum[t * nblk + b];
                __m256i is = isum[h][t];
                if (extra) is = _mm256_add_epi32(is, _mm256_set1_epi32(extra));
                acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(sc, _mm256_set1_ps(dx[t * nblk + b])), acc[h][t]);
                if (!mult) acc[h][t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sx[t * nblk + b]), acc[h][t]);
            }
        }
    }
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < NT; t++) _mm256_storeu_ps(y + t * ystride + tile * 16 + 8 * h, acc[h][t]);
}

RX_AVX2 __attribute__((always_inline))
static inline void rx_case8(const rx_weight *w, int64_t tile, const int NT, const int8_t *xq, const float *dx,
                            const float *sx, const int32_t *qsum, float *y, int64_t ystride, int wide) {
    // (wide: Q8_0's 8-bit values, a constant of the 32-value 8-bit shapes only)
#define RX_T8(BLK, BITS, SM, MM, SUP) \
    (BITS == 8 && BLK == 32 && wide ? tiles_avx2_nt(w, tile, NT, BLK, BITS, 1, SM, MM, SUP, xq, dx, sx, qsum, y, ystride) \
                                    : tiles_avx2_nt(w, tile, NT, BLK, BITS, 0, SM, MM, SUP, xq, dx, sx, qsum, y, ystride))
    RX_DISPATCH(w, RX_T8);
#undef RX_T8
}

RX_AVX2 static void tiles_avx2(const rx_weight *w, int64_t t0, int64_t t1, int64_t T, const int8_t *xq, const float *dx,
                               const float *sx, const int32_t *qsum, float *y, int64_t ystride) {
    const int64_t nblk = w->cols / w->blk;
    // 8-bit values above 63 would overflow vpmaddubsw's 16-bit pair sums: Q8_0 (min = -128 scale)
    const int wide = w->bits == 8 && w->min_mode == 3 && w->min_mult == -128.0f;
    // each tile for every chunk of rows in turn: a second chunk reads the tile from cache, not memory
    for (int64_t tile = t0; tile < t1; tile++) {
        for (int64_t c = 0; c < T; c += RX_AVX2_ROWS) {
            const int nt = (int)(T - c < RX_AVX2_ROWS ? T - c : RX_AVX2_ROWS);
#define RX_CASE8(NT) rx_case8(w, tile, NT, xq + c * w->cols, dx + c * nblk, sx + c * nblk, qsum + c * nblk, y + c * ystride, ystride, wide)
            switch (nt) {
                case 1: RX_CASE8(1); break;
#if RX_AVX2_ROWS > 2
                case 2: RX_CASE8(2); break;
#endif
#if RX_AVX2_ROWS > 3
                case 3: RX_CASE8(3); break;
#endif
                default: RX_CASE8(RX_AVX2_ROWS); break;
            }
#undef RX_CASE8
        }
    }
}


int rx_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

int rx_has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

// ---------------------------------------------------------------- entry points
typedef struct {
    int8_t *xq;
    float *dx, *sx;
    size_t cap;
} scratch;

static __thread scratch tls;

static int reserve(int64_t T, int64_t cols, int blk) {
    const size_t need = (size_t)(T * cols) + 3 * sizeof(float) * (size_t)(T * (cols / blk)) + 64;
    if (need <= tls.cap) return 1;
    free(tls.xq);
    tls.xq = (int8_t *)malloc(need);
    if (!tls.xq) { tls.cap = 0; return 0; }
    tls.cap = need;
    return 1;
}

// y = W x for T rows: x [T][x_stride floats], y [T][y_stride floats]; tiles split among nth callers.
// `impl`: 0 the reference kernel, 1 AVX-512 VNNI, 2 AVX2. Returns 0, or -1 when out of memory.
static int matmul(const rx_weight *w, const float *x, int64_t x_stride, int64_t T, float *y, int64_t y_stride,
                  int ith, int nth, int impl, rx_best *best) {
    const int64_t nblk = w->cols / w->blk;
    if (!reserve(T, w->cols, w->blk)) return -1;
    int8_t *xq = tls.xq;
    float *dx = (float *)(((uintptr_t)(xq + T * w->cols) + 63) & ~(uintptr_t)63);
    float *sx = dx + T * nblk;
    int32_t *qsum = (int32_t *)(sx + T * nblk);
    for (int64_t t = 0; t < T; t++)
        (impl == 1 ? quantize_row_vnni : impl == 2 ? quantize_row_avx2 : quantize_row)(
            x + t * x_stride, w->cols, w->blk, xq + t * w->cols, dx + t * nblk, sx + t * nblk, qsum + t * nblk);
    const int64_t ntiles = w->rows / 16;
    const int64_t t0 = ntiles * ith / nth, t1 = ntiles * (ith + 1) / nth;
    if (best && impl != 0) {  // an LM head: tile by tile, each tile's outputs read back while in L1
        for (int64_t tile = t0; tile < t1; tile++) {
            if (impl == 1)
                tiles_vnni(w, tile, tile + 1, T, xq, dx, sx, qsum, y, y_stride);
            else
                tiles_avx2(w, tile, tile + 1, T, xq, dx, sx, qsum, y, y_stride);
            for (int64_t t = 0; t < T; t++) best_update(best + t, y + t * y_stride + tile * 16, tile * 16);
        }
    } else if (impl == 1)
        tiles_vnni(w, t0, t1, T, xq, dx, sx, qsum, y, y_stride);
    else if (impl == 2)
        tiles_avx2(w, t0, t1, T, xq, dx, sx, qsum, y, y_stride);
    else
        tiles_ref(w, t0, t1, T, xq, dx, sx, qsum, y, y_stride);  // (finds no maxima: best left unset)
    return 0;
}

int rx_matmul(const rx_weight *w, const float *x, int64_t x_stride, int64_t T, float *y, int64_t y_stride,
              int ith, int nth, int impl) {
    return matmul(w, x, x_stride, T, y, y_stride, ith, nth, impl, NULL);
}

// ggml custom op (ggml_custom_4d): dst [rows, T] = W src[0], src[0] [cols, T] (rows contiguous).
// userdata: a struct rx_op.
typedef struct {
    rx_weight w;
    int32_t impl;
} rx_op;

// a product op's activations and output: x [T][x_stride], y [T][y_stride] floats (from the ggml tensors)
typedef struct {
    const float *x;
    float *y;
    int64_t T, x_stride, y_stride;
} rx_io;

static rx_io op_io(void *dst) {
    char *d = (char *)dst;
    char *src = *(char **)(d + OFF_SRC);
    rx_io io = {*(const float **)(src + OFF_DATA), *(float **)(d + OFF_DATA), ((const int64_t *)(src + OFF_NE))[1],
                (int64_t)(((const size_t *)(src + OFF_NB))[1] / 4), (int64_t)(((const size_t *)(d + OFF_NB))[1] / 4)};
    return io;
}

// thread ith's output rows [*r0, *r1) of a product (whole tiles, as rx_matmul splits them)
static void own_rows(const rx_weight *w, int ith, int nth, int64_t *r0, int64_t *r1) {
    const int64_t ntiles = w->rows / 16;
    *r0 = 16 * (ntiles * ith / nth);
    *r1 = 16 * (ntiles * (ith + 1) / nth);
}

// out of memory (for quantized or normalized activations): this thread's outputs become NaN, never stale
static void poison_rows(const rx_weight *w, const rx_io *io, int ith, int nth) {
    int64_t r0, r1;
    own_rows(w, ith, nth, &r0, &r1);
    for (int64_t t = 0; t < io->T; t++)
        for (int64_t r = r0; r < r1; r++) io->y[t * io->y_stride + r] = NAN;
}

void rx_ggml_op(void *dst, int ith, int nth, void *userdata) {
    const rx_op *op = (const rx_op *)userdata;
    const rx_io io = op_io(dst);
    if (matmul(&op->w, io.x, io.x_stride, io.T, io.y, io.y_stride, ith, nth, op->impl, NULL) != 0)
        poison_rows(&op->w, &io, ith, nth);
}

// The same product with the ops ggml would run around it fused in (two fewer barriers between the
// threads for each op fused): on the way in, its input's RMS norm times a weight, by ggml's float
// operations (rms_norm: the squares summed in double in order, x * (1 / sqrt(mean + eps)); then mul:
// one float product); on the way out, a residual added (ggml's add: one float sum). Each thread
// normalizes every row itself (a few hundred floats) and adds the residual to its own outputs.
// userdata: a struct rx_fused_op; src[1]: the residual [rows] per activation row when `add`.
// With `best_index` (an LM head's op), each thread also finds each activation row's first maximum
// among its outputs: best_value / best_index [RX_BEST_THREADS][best_rows] at [ith][t] (index -1: the
// thread had no outputs; -2: one was NaN), and best_threads = nth (models/rowexact.py combines them).
#define RX_BEST_THREADS 64
#define RX_BEST_ROWS 64  // (a decoding pass' rows at most: ROW_ATTENTION_MAX)
typedef struct {
    const rx_op *op;
    const float *norm;  // [cols], or NULL: no norm
    float eps;
    int32_t add;
    float *best_value;
    int32_t *best_index;
    int32_t best_rows, best_threads;
} rx_fused_op;

static __thread float *norm_buf;
static __thread size_t norm_cap;

void rx_ggml_fused_op(void *dst, int ith, int nth, void *userdata) {
    const rx_fused_op *f = (const rx_fused_op *)userdata;
    const rx_op *op = f->op;
    const rx_io io = op_io(dst);
    const int64_t cols = op->w.cols;
    const float *x = io.x;
    int64_t x_stride = io.x_stride;
    int status = 0;
    if (f->norm) {
        const size_t need = (size_t)(io.T * cols);
        if (norm_cap < need) {
            free(norm_buf);
            norm_buf = (float *)malloc(need * sizeof(float));
            norm_cap = norm_buf ? need : 0;
        }
        if (!norm_buf) status = -1;
        else {
            for (int64_t t = 0; t < io.T; t++) {
                const float *xr = io.x + t * io.x_stride;
                float *n = norm_buf + t * cols;
                double sum = 0.0;
                for (int64_t i = 0; i < cols; i++) sum += (double)(xr[i] * xr[i]);
                const float mean = sum / cols;
                const float scale = 1.0f / sqrtf(mean + f->eps);
                for (int64_t i = 0; i < cols; i++) n[i] = (xr[i] * scale) * f->norm[i];
            }
            x = norm_buf;
            x_stride = cols;
        }
    }
    rx_best best[RX_BEST_ROWS];
    // (not on the reference kernel: best_update and best_result are AVX2 code)
    const int tracked = f->best_index && !f->add && op->impl != 0 && io.T <= f->best_rows && io.T <= RX_BEST_ROWS &&
                        nth <= RX_BEST_THREADS;
    if (tracked) memset(best, 0, sizeof(rx_best) * (size_t)io.T);  // (any = 0: no outputs yet)
    if (status == 0) status = matmul(&op->w, x, x_stride, io.T, io.y, io.y_stride, ith, nth, op->impl, tracked ? best : NULL);
    if (tracked) {
        for (int64_t t = 0; t < io.T; t++) {
            best_result(best + t, f->best_value + ith * f->best_rows + t, f->best_index + ith * f->best_rows + t);
            if (status != 0) f->best_index[ith * f->best_rows + t] = -2;
        }
        if (ith == 0) ((rx_fused_op *)f)->best_threads = nth;
    }
    if (status != 0) {
        poison_rows(&op->w, &io, ith, nth);
        return;
    }
    if (f->add) {
        int64_t r0, r1;
        own_rows(&op->w, ith, nth, &r0, &r1);
        const char *res = *(char *const *)((char *)dst + OFF_SRC + sizeof(void *));
        const float *rd = *(const float *const *)(res + OFF_DATA);
        const int64_t rs = (int64_t)(((const size_t *)(res + OFF_NB))[1] / 4);
        for (int64_t t = 0; t < io.T; t++)
            for (int64_t r = r0; r < r1; r++) io.y[t * io.y_stride + r] = rd[t * rs + r] + io.y[t * io.y_stride + r];
    }
}

// ---------------------------------------------------------------- ggml's repacked Q4_K, several rows (AVX2)
// ggml's CPU_REPACK layout for Q4_K on AVX2 (block_q4_Kx8: 8 output rows' super-blocks interleaved)
// is multiplied one activation row at a time by ggml_gemv_q4_K_8x8_q8_K; its several-row GEMM sums in
// another order. This kernel computes several rows sharing each weight load and unpacking, with, for
// each row, exactly the instruction sequence of ggml's AVX2 gemv (arch/x86/repack.cpp, ggml 0.10.1):
// every output is bit for bit what the gemv gives for that row alone. Activations are quantized by
// ggml's own quantize_row_q8_K (a pointer the caller passes). ggml_kernels._rows_op checks the equality against
// ggml's gemv on this machine before it uses the kernel.

typedef struct {  // block_q8_K
    float d;
    int8_t qs[256];
    int16_t bsums[16];
} rx_q8k;

typedef struct {  // block_q4_Kx8
    uint16_t d[8], dmin[8];
    uint8_t scales[96];
    uint8_t qs[1024];
} rx_q4kx8;

typedef struct {
    const void *data;  // RX_ROWS_Q4K8: block_q4_Kx8 [rows / 8][cols / 256]; RX_ROWS_Q6K: block_q6_K [rows][cols / 256]
    int64_t rows, cols;
    void (*quantize)(const float *x, void *y, int64_t k);  // ggml's quantize_row_q8_K
    int32_t kind;
} rx_rows_op;

enum { RX_ROWS_Q4K8 = 0, RX_ROWS_Q6K = 1 };

#define RX_Q4K8_ROWS 16  // activation rows per pass over a weight's blocks (a prompt's rows: 32 cost
                         // 0.94x two passes of 16, 16 cost 0.84x two of 8, on 120 MB of Q4_K)
#define RX_CHUNK_GROUPS 16  // groups of 8 weight rows a thread takes at a time

RX_AVX2 static inline void q4k8_sub_scales(const uint8_t *src, uint32_t *utmp) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    memcpy(utmp, src, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
}

// NT rows of activations a[t] (each nb blocks) against one group of 8 interleaved weight rows, read
// once in memory order: acc[2 t] (the gemv's acc_row) and acc[2 t + 1] (acc_min_rows) of each row
// t. The integer sums are exact (4-bit weights times int8 activations cannot overflow them), so
// their order is free; the float operations are the gemv's, in its order.
RX_AVX2 __attribute__((always_inline))
static inline void q4k8_group(const rx_q4kx8 *b_ptr, int64_t nb, const rx_q8k *const *a, const int NT, __m256 *acc) {
    const __m128i deltamask = _mm_set_epi8(15, 14, 7, 6, 13, 12, 5, 4, 11, 10, 3, 2, 9, 8, 1, 0);
    const __m128i scalemask = _mm_set_epi8(7, 7, 3, 3, 6, 6, 2, 2, 5, 5, 1, 1, 4, 4, 0, 0);
    const __m256i m4b = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < 2 * NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const rx_q4kx8 *blk = b_ptr + b;
        __m256i iacc_b[RX_Q4K8_ROWS], iacc_min_b[RX_Q4K8_ROWS], q8s[RX_Q4K8_ROWS];
        for (int t = 0; t < NT; t++) {
            iacc_b[t] = iacc_min_b[t] = _mm256_setzero_si256();
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)a[t][b].bsums);
            q8s[t] = _mm256_castsi128_si256(_mm_hadd_epi16(_mm256_castsi256_si128(q8sums), _mm256_extracti128_si256(q8sums, 1)));
            q8s[t] = _mm256_permute2f128_si256(q8s[t], q8s[t], 0);
        }
        for (int sb = 0; sb < 4; sb++) {
            uint32_t utmp_0[4], utmp_1[4];
            q4k8_sub_scales(blk->scales + 24 * sb, utmp_0);
            q4k8_sub_scales(blk->scales + 12 + 24 * sb, utmp_1);
            const __m128i mins_and_scales_0 = _mm_set_epi32(utmp_0[3], utmp_0[2], utmp_0[1], utmp_0[0]);
            const __m128i mins_and_scales_1 = _mm_set_epi32(utmp_1[3], utmp_1[2], utmp_1[1], utmp_1[0]);
            const __m256i mins_01 = _mm256_cvtepu8_epi16(
                _mm_unpacklo_epi8(_mm_shuffle_epi32(mins_and_scales_0, 78), _mm_shuffle_epi32(mins_and_scales_1, 78)));
            for (int t = 0; t < NT; t++) {
                iacc_min_b[t] = _mm256_add_epi32(iacc_min_b[t], _mm256_madd_epi16(_mm256_shuffle_epi32(q8s[t], 0), mins_01));
                q8s[t] = _mm256_bsrli_epi128(q8s[t], 4);
            }
            const uint8_t *qs = blk->qs + sb * 256;
            for (int half = 0; half < 2; half++) {
                const __m256i scales = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(half ? mins_and_scales_1 : mins_and_scales_0, scalemask));
                __m256i r[8];
                for (int j = 0; j < 4; j++) {
                    __m256i v0123 = _mm256_loadu_si256((const __m256i *)(qs + 64 * j));
                    __m256i v4567 = _mm256_loadu_si256((const __m256i *)(qs + 64 * j + 32));
                    if (half) {
                        v0123 = _mm256_srli_epi16(v0123, 4);
                        v4567 = _mm256_srli_epi16(v4567, 4);
                    }
                    v0123 = _mm256_and_si256(v0123, m4b);
                    v4567 = _mm256_and_si256(v4567, m4b);
                    r[2 * j] = _mm256_blend_epi32(v0123, _mm256_shuffle_epi32(v4567, 177), 170);
                    r[2 * j + 1] = _mm256_blend_epi32(_mm256_shuffle_epi32(v0123, 177), v4567, 170);
                }
#pragma GCC unroll 1
                for (int t = 0; t < NT; t++) {  // (not unrolled: the 8 weight vectors stay in registers)
                    // the gemv's _mm256_shuffle_epi32(lhs, k) of 16 activations repeated in both lanes:
                    // their 4-byte group k broadcast, loaded as such
                    const int32_t *aq = (const int32_t *)(a[t][b].qs + sb * 64 + 32 * half);
                    // (16-bit sums: exact, in any order, as no partial sum can overflow)
                    __m256i m[8];
                    for (int i = 0; i < 8; i++) m[i] = _mm256_maddubs_epi16(r[i], _mm256_set1_epi32(aq[i]));
                    const __m256i s16 = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(m[0], m[1]), _mm256_add_epi16(m[2], m[3])),
                                                         _mm256_add_epi16(_mm256_add_epi16(m[4], m[5]), _mm256_add_epi16(m[6], m[7])));
                    iacc_b[t] = _mm256_add_epi32(iacc_b[t], _mm256_madd_epi16(s16, scales));
                }
            }
        }
        const __m256 col_scale_f32 = _mm256_cvtph_ps(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)blk->d), deltamask));
        const __m256 col_dmin_f32 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->dmin));
        for (int t = 0; t < NT; t++) {
            const __m256 row_scale_f32 = _mm256_set1_ps(a[t][b].d);
            acc[2 * t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc_b[t]), _mm256_mul_ps(col_scale_f32, row_scale_f32), acc[2 * t]);
            acc[2 * t + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc_min_b[t]), _mm256_mul_ps(col_dmin_f32, row_scale_f32), acc[2 * t + 1]);
        }
    }
}

// y [T][y_stride] = W x for the activations quantized (a: nb blocks a row); groups of 8 weight rows
// split among nth callers, each read once for every RX_Q4K8_ROWS rows.
RX_AVX2 static void q4k8_matmul(const rx_rows_op *op, const rx_q8k *q8, int64_t T, float *y, int64_t y_stride, int ith, int nth) {
    const int64_t nb = op->cols / 256, groups = op->rows / 8;
    const __m256i finalpermutemask = _mm256_set_epi32(7, 5, 3, 1, 6, 4, 2, 0);
    for (int64_t c = 0; c < T; c += RX_Q4K8_ROWS) {
        const int nt = (int)(T - c < RX_Q4K8_ROWS ? T - c : RX_Q4K8_ROWS);
        const rx_q8k *a[RX_Q4K8_ROWS];
        for (int t = 0; t < nt; t++) a[t] = q8 + (c + t) * nb;
        // chunks of RX_CHUNK_GROUPS groups, dealt round the threads: they read neighbouring memory
        for (int64_t g = 0; g < groups; g++) {
            if ((g / RX_CHUNK_GROUPS) % nth != ith) {
                g += RX_CHUNK_GROUPS - 1 - g % RX_CHUNK_GROUPS;
                continue;
            }
            __m256 acc[2 * RX_Q4K8_ROWS];
            const rx_q4kx8 *w = (const rx_q4kx8 *)op->data + g * nb;
            switch (nt) {  // (row counts as constants: the loops over rows unrolled)
                case 1: q4k8_group(w, nb, a, 1, acc); break;
                case 2: q4k8_group(w, nb, a, 2, acc); break;
                case 4: q4k8_group(w, nb, a, 4, acc); break;
                case 8: q4k8_group(w, nb, a, 8, acc); break;
                case 16: q4k8_group(w, nb, a, 16, acc); break;
                default: q4k8_group(w, nb, a, nt, acc); break;
            }
            for (int t = 0; t < nt; t++)
                _mm256_storeu_ps(y + (c + t) * y_stride + 8 * g,
                                 _mm256_sub_ps(_mm256_permutevar8x32_ps(acc[2 * t], finalpermutemask), acc[2 * t + 1]));
        }
    }
}

// ---------------------------------------------------------------- ggml's plain Q6_K, several rows (AVX2)
// The same for Q6_K weights in the file's layout, which ggml multiplies one activation row at a time
// by ggml_vec_dot_q6_K_q8_K (arch/x86/quants.c, ggml 0.10.1): for each row, its AVX2 instruction
// sequence (the integer sums exact, so in any order; the float ones in its order, then its
// horizontal sum), each weight row unpacked once for up to 16 activation rows.

typedef struct {  // block_q6_K
    uint8_t ql[128], qh[64];
    int8_t scales[16];
    uint16_t d;
} rx_q6k;

static const uint8_t q6k_scale_shuffle[128] = {
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7,
    8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11,
    12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15};

RX_AVX2 static inline float q6k_hsum_float_8(const __m256 x) {  // ggml's hsum_float_8
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

// one weight row (nb blocks) against NT activation rows: out[t]
RX_AVX2 __attribute__((always_inline))
static inline void q6k_row(const rx_q6k *x, int64_t nb, const rx_q8k *const *a, const int NT, float *out) {
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    __m256 acc[RX_Q4K8_ROWS];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const float xd = _cvtsh_ss(x[i].d);
        const __m128i scales = _mm_loadu_si128((const __m128i *)x[i].scales);
        const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
        __m256i sumi[RX_Q4K8_ROWS];
        for (int t = 0; t < NT; t++) sumi[t] = _mm256_setzero_si256();
        for (int j = 0; j < 2; j++) {
            const __m256i q4bits1 = _mm256_loadu_si256((const __m256i *)(x[i].ql + 64 * j));
            const __m256i q4bits2 = _mm256_loadu_si256((const __m256i *)(x[i].ql + 64 * j + 32));
            const __m256i q4bitsH = _mm256_loadu_si256((const __m256i *)(x[i].qh + 32 * j));
            const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
            const __m256i q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
            const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
            const __m256i q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);
            const __m256i q4[4] = {_mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0),
                                   _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1),
                                   _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2),
                                   _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3)};
            __m256i sc[4];
            for (int k = 0; k < 4; k++)
                sc[k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, _mm_loadu_si128((const __m128i *)q6k_scale_shuffle + 4 * j + k)));
#pragma GCC unroll 1
            for (int t = 0; t < NT; t++) {
                const int8_t *q8 = a[t][i].qs + 128 * j;
                __m256i p[4];
                for (int k = 0; k < 4; k++)
                    p[k] = _mm256_madd_epi16(sc[k], _mm256_maddubs_epi16(q4[k], _mm256_loadu_si256((const __m256i *)(q8 + 32 * k))));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])));
            }
        }
        for (int t = 0; t < NT; t++) {
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)a[t][i].bsums);
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
            const float d = a[t][i].d * xd;
            acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&d), _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi[t], q8sclsub)), acc[t]);
        }
    }
    for (int t = 0; t < NT; t++) out[t] = q6k_hsum_float_8(acc[t]);
}

// y [T][y_stride] = W x for the activations quantized; weight rows split among nth callers.
RX_AVX2 static void q6k_matmul(const rx_rows_op *op, const rx_q8k *q8, int64_t T, float *y, int64_t y_stride, int ith, int nth) {
    const int64_t nb = op->cols / 256;
    const rx_q6k *data = (const rx_q6k *)op->data;
    for (int64_t c = 0; c < T; c += RX_Q4K8_ROWS) {
        const int nt = (int)(T - c < RX_Q4K8_ROWS ? T - c : RX_Q4K8_ROWS);
        const rx_q8k *a[RX_Q4K8_ROWS];
        for (int t = 0; t < nt; t++) a[t] = q8 + (c + t) * nb;
        for (int64_t r = 0; r < op->rows; r++) {
            if ((r / (8 * RX_CHUNK_GROUPS)) % nth != ith) {
                r += 8 * RX_CHUNK_GROUPS - 1 - r % (8 * RX_CHUNK_GROUPS);
                continue;
            }
            float out[RX_Q4K8_ROWS];
            switch (nt) {
                case 1: q6k_row(data + r * nb, nb, a, 1, out); break;
                case 2: q6k_row(data + r * nb, nb, a, 2, out); break;
                case 4: q6k_row(data + r * nb, nb, a, 4, out); break;
                case 8: q6k_row(data + r * nb, nb, a, 8, out); break;
                case 16: q6k_row(data + r * nb, nb, a, 16, out); break;
                default: q6k_row(data + r * nb, nb, a, nt, out); break;
            }
            for (int t = 0; t < nt; t++) y[(c + t) * y_stride + r] = out[t];
        }
    }
}

// ---------------------------------------------------------------- entry points (ggml's one-row results)
static __thread rx_q8k *q8k_buf;
static __thread size_t q8k_cap;

// y [T][y_stride] = W x for x [T][x_stride] floats, every row as ggml's one-row kernel gives it; the
// outputs split among nth callers. Returns 0, or -1 when out of memory.
RX_AVX2 int rx_rows_matmul(const rx_rows_op *op, const float *x, int64_t x_stride, int64_t T, float *y, int64_t y_stride,
                           int ith, int nth) {
    const int64_t nb = op->cols / 256;
    if (q8k_cap < (size_t)(T * nb)) {
        free(q8k_buf);
        q8k_buf = (rx_q8k *)malloc((size_t)(T * nb) * sizeof(rx_q8k));
        q8k_cap = q8k_buf ? (size_t)(T * nb) : 0;
        if (!q8k_buf) return -1;
    }
    for (int64_t t = 0; t < T; t++) op->quantize(x + t * x_stride, q8k_buf + t * nb, op->cols);
    if (op->kind == RX_ROWS_Q6K)
        q6k_matmul(op, q8k_buf, T, y, y_stride, ith, nth);
    else
        q4k8_matmul(op, q8k_buf, T, y, y_stride, ith, nth);
    return 0;
}

// ggml custom op (ggml_custom_4d): dst [rows, T] = W src[0], src[0] [cols, T]; userdata: rx_rows_op
void rx_rows_ggml_op(void *dst, int ith, int nth, void *userdata) {
    const rx_rows_op *op = (const rx_rows_op *)userdata;
    const rx_io io = op_io(dst);
    if (rx_rows_matmul(op, io.x, io.x_stride, io.T, io.y, io.y_stride, ith, nth) != 0) {
        // out of memory for the quantized activations: this thread's outputs become NaN, never stale
        for (int64_t t = 0; t < io.T; t++)
            for (int64_t r = 0; r < op->rows; r++)
                if ((r / (8 * RX_CHUNK_GROUPS)) % nth == ith) io.y[t * io.y_stride + r] = NAN;
    }
}

// ---------------------------------------------------------------- row-exact attention (AVX-512 F, BW, VL; AVX2)
// out[t, h] = sum_p softmax_p(s) v[p],  s[p] = scale * q[t, h] . k[p] (+ softcap) + mask[t, p], over
// the keys row t's mask leaves visible (mask > -inf). The same float operations for (t, h) whatever
// the other rows of the call or the thread: keys go in chunks of 16 (AVX2: 8) at fixed positions, a
// chunk with no visible key adds exactly nothing (nor does any key past the last visible chunk), each
// dot product reduces its lanes in a fixed tree, the exponentials are computed lane by lane, and the
// values are summed key by key in order (AVX-512: even and odd keys in two chains added at the end).
// The two forms differ in their last bits (each is row-exact on its own CPU).
// What it replaces, ggml's reference flash attention, does the same per row but one key at a time
// with scalar exponentials: 5-8x slower here.

typedef struct {
    float scale, softcap;  // as ggml's flash attention takes them inside: with softcap > 0, the score is
                           // softcap * tanh(scale * dot), scale already divided by softcap
} rx_attn_params;

#define RX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// exp(x) lane by lane, x <= 0 or -inf (-> 0): 2^n exp(r), r = x - n ln2 (Cody-Waite), |r| <= ln2 / 2,
// exp(r) by its degree-7 Taylor polynomial (truncation < 2e-8 relative), 2^n applied by vscalefps
RX_AVX512 static inline __m512 exp_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm512_maskz_scalef_ps(finite, p, _mm512_max_ps(n, _mm512_set1_ps(-200.0f)));
}

// the 16 sums of lanes of a[0..15]: lane j of the result = sum of a[j]'s lanes (a fixed tree)
RX_AVX512 static inline __m512 hsum16(__m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  // [a_lo + a_hi, b_lo + b_hi]: 8 partials of two vectors
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  // 4 partials of four vectors, one per 128-bit lane
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  // lane j: [v_j p0+p2, v_j p1+p3, v_j+4 .., v_j+4 ..] (v indexed per c pair)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    // e's 128-bit lane L holds the vectors L, L + 4, L + 8, L + 12: back to vector order
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, e);
}

static __thread float *attn_buf;
static __thread size_t attn_cap;

int rx_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

// one (row, head): q [D] -> out [D], keys / values p at k + p * ks, v + p * vs (floats), mask [n_keys] f16
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline void attend_d(const float *q, const char *k, size_t ks, const char *v, size_t vs, const uint16_t *mask,
                            int64_t n_keys, const int D, float scale, float softcap, float *s, float *out) {
    const int64_t n_chunks = (n_keys + 15) / 16;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    const __m512 neg = _mm512_set1_ps(-INFINITY);
    int64_t used = 0;  // chunks up to the last one with a visible key (the rest add nothing)
    for (int64_t c = 0; c < n_chunks; c++) {
        const int64_t p0 = c * 16;
        const int n = n_keys - p0 < 16 ? (int)(n_keys - p0) : 16;
        const __mmask16 in = (__mmask16)((1u << n) - 1);
        const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, mask + p0));
        const __mmask16 vis = _mm512_mask_cmp_ps_mask(in, mv, neg, _CMP_NEQ_OQ);
        if (!vis) {  // nothing visible: the chunk adds nothing
            _mm512_storeu_ps(s + p0, neg);
            continue;
        }
        used = c + 1;
        __m512 acc[16];
        for (int j = 0; j < 16; j++) {
            const float *kp = (const float *)(k + (p0 + (j < n ? j : 0)) * ks);
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kp));
            for (int i = 16; i < D; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(kp + i), a);
            acc[j] = a;
        }
        __m512 sc = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale));
        if (softcap != 0.0f) {
            float tmp[16];
            _mm512_storeu_ps(tmp, sc);
            for (int j = 0; j < 16; j++) tmp[j] = softcap * tanhf(tmp[j]);
            sc = _mm512_loadu_ps(tmp);
        }
        sc = _mm512_mask_blend_ps(vis, neg, _mm512_add_ps(sc, mv));
        _mm512_storeu_ps(s + p0, sc);
        mx = _mm512_max_ps(mx, sc);
    }
    const float m = _mm512_reduce_max_ps(mx);
    for (int i = 0; i < D; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
    if (m == -INFINITY) return;  // no visible key (ggml's reference gives zeros too)
    __m512 sum = _mm512_setzero_ps();
    const __m512 mm = _mm512_set1_ps(m);
    for (int64_t c = 0; c < used; c++) {
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + c * 16), mm));
        _mm512_storeu_ps(s + c * 16, e);
        sum = _mm512_add_ps(sum, e);
    }
    // values key by key in order, even and odd keys in two chains (summed at the end: a fixed order)
    __m512 o0[16], o1[16];  // D <= 256
    for (int i = 0; i < D / 16; i++) o0[i] = o1[i] = _mm512_setzero_ps();
    const int64_t last = used * 16 < n_keys ? used * 16 : n_keys;
    for (int64_t p = 0; p < last; p += 2) {
        if (s[p] != 0.0f) {  // (zero: masked or underflowed, adds exactly nothing)
            const __m512 e = _mm512_set1_ps(s[p]);
            const float *vp = (const float *)(v + p * vs);
            for (int i = 0; i < D / 16; i++) o0[i] = _mm512_fmadd_ps(e, _mm512_loadu_ps(vp + 16 * i), o0[i]);
        }
        if (p + 1 < last && s[p + 1] != 0.0f) {
            const __m512 e = _mm512_set1_ps(s[p + 1]);
            const float *vp = (const float *)(v + (p + 1) * vs);
            for (int i = 0; i < D / 16; i++) o1[i] = _mm512_fmadd_ps(e, _mm512_loadu_ps(vp + 16 * i), o1[i]);
        }
    }
    const float total = _mm512_reduce_add_ps(sum);
    const __m512 inv = _mm512_set1_ps(total == 0.0f ? 0.0f : 1.0f / total);
    for (int i = 0; i < D / 16; i++) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(_mm512_add_ps(o0[i], o1[i]), inv));
}

// head sizes as constants (the value sums stay in registers), any other multiple of 16 as a variable
RX_AVX512 static void attend_one_avx512(const float *q, const char *k, size_t ks, const char *v, size_t vs, const uint16_t *mask,
                                 int64_t n_keys, int D, float scale, float softcap, float *s, float *out) {
    switch (D) {
        case 64: attend_d(q, k, ks, v, vs, mask, n_keys, 64, scale, softcap, s, out); break;
        case 128: attend_d(q, k, ks, v, vs, mask, n_keys, 128, scale, softcap, s, out); break;
        default: attend_d(q, k, ks, v, vs, mask, n_keys, D, scale, softcap, s, out); break;
    }
}

// ---- the AVX2 form (FMA, F16C): 8 keys a chunk, 8 lanes a vector
// exp(x) lane by lane, x <= 0 or -inf (-> 0): as exp_ps, 2^n built in the exponent bits (n < -126,
// where the result is below 2^-126 and adds nothing a softmax sum keeps, gives 0)
RX_AVX2 static inline __m256 exp_ps8(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256 ok = _mm256_cmp_ps(n, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);  // (false for -inf and NaN)
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(_mm256_max_ps(n, _mm256_set1_ps(-126.0f))),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(ok, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// the 8 sums of lanes of a[0..7]: lane j of the result = sum of a[j]'s lanes (a fixed tree)
RX_AVX2 static inline __m256 hsum8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [a0..a3 low halves | high halves]
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

RX_AVX2 static inline float hsum_ps8(__m256 v) {  // a fixed tree
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

RX_AVX2 static inline float hmax_ps8(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// values key by key in order into out[0..W) (W <= 64: the sums stay in 8 registers)
RX_AVX2 __attribute__((always_inline))
static inline void value_sums8(const char *v, size_t vs, const float *s, int64_t last, const int W, __m256 inv, float *out) {
    __m256 o[8];
    for (int i = 0; i < W / 8; i++) o[i] = _mm256_setzero_ps();
    for (int64_t p = 0; p < last; p++) {
        if (s[p] == 0.0f) continue;  // masked or underflowed: adds exactly nothing
        const __m256 e = _mm256_set1_ps(s[p]);
        const float *vp = (const float *)(v + p * vs);
        for (int i = 0; i < W / 8; i++) o[i] = _mm256_fmadd_ps(e, _mm256_loadu_ps(vp + 8 * i), o[i]);
    }
    for (int i = 0; i < W / 8; i++) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(o[i], inv));
}

RX_AVX2 __attribute__((always_inline))
static inline void attend_d8(const float *q, const char *k, size_t ks, const char *v, size_t vs, const uint16_t *mask,
                             int64_t n_keys, const int D, float scale, float softcap, float *s, float *out) {
    const int64_t n_chunks = (n_keys + 7) / 8;
    const __m256 neg = _mm256_set1_ps(-INFINITY);
    __m256 mx = neg;
    int64_t used = 0;  // chunks up to the last one with a visible key (the rest add nothing)
    for (int64_t c = 0; c < n_chunks; c++) {
        const int64_t p0 = c * 8;
        const int n = n_keys - p0 < 8 ? (int)(n_keys - p0) : 8;
        uint16_t mh[8];
        for (int j = 0; j < 8; j++) mh[j] = j < n ? mask[p0 + j] : 0xFC00;  // (f16 -inf past the keys)
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mh));
        const __m256 vis = _mm256_cmp_ps(mv, neg, _CMP_NEQ_OQ);
        if (!_mm256_movemask_ps(vis)) {  // nothing visible: the chunk adds nothing
            _mm256_storeu_ps(s + p0, neg);
            continue;
        }
        used = c + 1;
        __m256 acc[8];
        for (int j = 0; j < 8; j++) {
            const float *kp = (const float *)(k + (p0 + (j < n ? j : 0)) * ks);
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kp));
            for (int i = 8; i < D; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kp + i), a);
            acc[j] = a;
        }
        __m256 sc = _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale));
        if (softcap != 0.0f) {
            float tmp[8];
            _mm256_storeu_ps(tmp, sc);
            for (int j = 0; j < 8; j++) tmp[j] = softcap * tanhf(tmp[j]);
            sc = _mm256_loadu_ps(tmp);
        }
        sc = _mm256_blendv_ps(neg, _mm256_add_ps(sc, mv), vis);
        _mm256_storeu_ps(s + p0, sc);
        mx = _mm256_max_ps(mx, sc);
    }
    const float m = hmax_ps8(mx);
    if (m == -INFINITY) {  // no visible key (ggml's reference gives zeros too)
        for (int i = 0; i < D; i += 8) _mm256_storeu_ps(out + i, _mm256_setzero_ps());
        return;
    }
    __m256 sum = _mm256_setzero_ps();
    const __m256 mm = _mm256_set1_ps(m);
    for (int64_t c = 0; c < used; c++) {
        const __m256 e = exp_ps8(_mm256_sub_ps(_mm256_loadu_ps(s + c * 8), mm));
        _mm256_storeu_ps(s + c * 8, e);
        sum = _mm256_add_ps(sum, e);
    }
    const float total = hsum_ps8(sum);
    const __m256 inv = _mm256_set1_ps(total == 0.0f ? 0.0f : 1.0f / total);
    const int64_t last = used * 8 < n_keys ? used * 8 : n_keys;
    int i = 0;
    for (; i + 64 <= D; i += 64) value_sums8(v + 4 * i, vs, s, last, 64, inv, out + i);
    for (; i < D; i += 16) value_sums8(v + 4 * i, vs, s, last, 16, inv, out + i);
}

RX_AVX2 static void attend_one_avx2(const float *q, const char *k, size_t ks, const char *v, size_t vs, const uint16_t *mask,
                                    int64_t n_keys, int D, float scale, float softcap, float *s, float *out) {
    switch (D) {
        case 64: attend_d8(q, k, ks, v, vs, mask, n_keys, 64, scale, softcap, s, out); break;
        case 128: attend_d8(q, k, ks, v, vs, mask, n_keys, 128, scale, softcap, s, out); break;
        default: attend_d8(q, k, ks, v, vs, mask, n_keys, D, scale, softcap, s, out); break;
    }
}

typedef void (*attend_fn)(const float *, const char *, size_t, const char *, size_t, const uint16_t *, int64_t, int,
                          float, float, float *, float *);

// the form this CPU runs (AVX-512 where it has it), or NULL
static attend_fn attend_one(void) {
    static attend_fn chosen;
    static int done;
    if (!done) {
        __builtin_cpu_init();
        chosen = rx_has_avx512() ? attend_one_avx512 : rx_has_avx2() ? attend_one_avx2 : NULL;
        done = 1;
    }
    return chosen;
}

int rx_has_attention(void) { return attend_one() != NULL; }

// ggml custom op (ggml_custom_4d): dst [D, H, T] from src[0] q [D, T, H], src[1] k, src[2] v
// [D, n_keys, Hkv] float32, src[3] mask [n_keys, T] f16; userdata: rx_attn_params. The (row, head)
// pairs are split among the threads.
void rx_attn_op(void *dst, int ith, int nth, void *userdata) {
    const rx_attn_params *prm = (const rx_attn_params *)userdata;
    const attend_fn attend = attend_one();
    char *d = (char *)dst;
    char *const *src = (char *const *)(d + OFF_SRC);
#define NE(t) ((const int64_t *)((t) + OFF_NE))
#define NB(t) ((const size_t *)((t) + OFF_NB))
#define DATA(t) (*(char **)((t) + OFF_DATA))
    const char *q = src[0], *k = src[1], *v = src[2], *mk = src[3];
    const int D = (int)NE(q)[0];
    const int64_t T = NE(q)[1], H = NE(q)[2], Hkv = NE(k)[2], n_keys = NE(k)[1];
    if (attn_cap < (size_t)n_keys + 16) {
        free(attn_buf);
        attn_cap = (size_t)n_keys + 16;
        attn_buf = (float *)malloc(attn_cap * sizeof(float));
    }
    const int64_t n_tasks = T * H, a = n_tasks * ith / nth, b = n_tasks * (ith + 1) / nth;
    for (int64_t task = a; task < b; task++) {
        const int64_t t = task / H, h = task % H, kh = h / (H / Hkv);
        float *out = (float *)(DATA(d) + t * NB(d)[2] + h * NB(d)[1]);
        if (!attn_buf || !attend) {  // out of memory (or no form for this CPU): NaN, never stale
            for (int i = 0; i < D; i++) out[i] = NAN;
            continue;
        }
        attend((const float *)(DATA(q) + t * NB(q)[1] + h * NB(q)[2]), DATA(k) + kh * NB(k)[2], NB(k)[1],
                   DATA(v) + kh * NB(v)[2], NB(v)[1], (const uint16_t *)(DATA(mk) + t * NB(mk)[1]), n_keys, D,
                   prm->scale, prm->softcap, attn_buf, out);
    }
#undef NE
#undef NB
#undef DATA
}

// the same on plain arrays, on the calling thread (tests): q [T][H][D], k, v [Hkv][n_keys][D] float32,
// mask [T][n_keys] f16 bits, out [T][H][D]. Returns 0, or -1 when out of memory.
int rx_attention(const float *q, const float *k, const float *v, const uint16_t *mask, float *out, int64_t T,
                           int64_t H, int64_t Hkv, int64_t n_keys, int D, float scale, float softcap) {
    const attend_fn attend = attend_one();
    float *s = (float *)malloc(((size_t)n_keys + 16) * sizeof(float));
    if (!s || !attend) {
        free(s);
        return -1;
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t kh = h / (H / Hkv);
            attend(q + (t * H + h) * D, (const char *)(k + kh * n_keys * D), (size_t)D * 4,
                       (const char *)(v + kh * n_keys * D), (size_t)D * 4, mask + t * n_keys, n_keys, D, scale, softcap, s,
                       out + (t * H + h) * D);
        }
    free(s);
    return 0;
}
