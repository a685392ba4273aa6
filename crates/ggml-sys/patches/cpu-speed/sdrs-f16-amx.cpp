// sd-rs: matrix products with f16 weights on AMX-BF16 tiles, to f16 precision.
//
// Added to every CPU variant by patches/cpu-speed.toml ([[add]]); the kernel is compiled
// only where the variant's flags include AVX-512 BF16 and AMX (the sapphirerapids
// variant) and runs only when CPUID reports AMX-BF16 and Linux grants the tile state.
//
// What it computes. GGML_OP_MUL_MAT with an f16 src0 and an f32 or f16 src1: ggml's own
// path rounds src1 to f16 (the f16 vec_dot type) and accumulates products of f16 values
// in f32. Here each f16 value x is split exactly into two bfloat16 values, x = hi + lo:
// hi is x rounded to bf16's 8 significant bits, and lo = x - hi needs at most 3 more bits,
// so it is a bf16 too (f16 has 11 significant bits and a narrower exponent range than
// bf16). Then  w.a = hi(w).hi(a) + hi(w).lo(a) + lo(w).hi(a) + lo(w).lo(a), and every
// product of two bf16 values is exact in f32. The tile instruction (TDPBF16PS)
// accumulates such products in f32. The last term is at most 2^-18 of |w.a| and is
// dropped, so three tile products per step give ggml's f16 product up to f32 rounding
// and the order of the sum (crates/sd-backends/tests/mul_mat_amx.rs bounds the error
// against an f64 product of the f16-rounded operands). An f32 src0 (attention's q.k) is
// taken only where ggml has no tiled f32 kernel (k not a multiple of 16), and split into
// three bf16 parts (24 bits: an f32 to 2^-24) summed in six products: f32's precision.
//
// Layout. dst[n][m] = sum_k src1[n][k] * src0[m][k]. Tiles are 16 rows by 64 bytes
// throughout. One operand (the "P" side) is packed into row-major A tiles (16 rows by 32
// bf16 along k), the other (the "S" side) into VNNI B tiles (16 pairs of k by 16 columns
// by 2), which the tile product needs and which cost a transpose to pack. S is src0
// unless src0 has over twice src1's rows (a convolution's im2col as ggml lays it out);
// then S is src1, and each C tile is transposed as it is written to dst.
//
// Schedule. S is taken in chunks of up to SDRS_NCH rows. All threads pack a chunk (hi
// and lo, every k) into the work buffer, then wait at a barrier; then each thread takes
// its range of P row pairs (32 rows), in blocks of SDRS_MB pairs: for each k block of
// SDRS_KC values, it packs the block's P rows (its own scratch), and for every pair of
// 16-row tiles of the chunk runs the k steps with four C tiles held in tile registers
// (two of P by two of S), keeping partial sums in its scratch between k blocks and
// writing dst after the last. A second barrier guards the chunk buffer before the next.
// The tile configuration the thread had (ggml's AMX kernels configure once per thread)
// is saved at entry and restored at exit.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#ifndef SDRS_STANDALONE
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#endif

extern "C" {
size_t sdrs_f16_amx_wsize(int64_t m, int64_t n, int64_t k, int nth, int parts);
}

namespace {

constexpr int64_t SDRS_NCH = 512; // S rows packed at a time
constexpr int64_t SDRS_KC  = 512; // k values per block (16 tile steps)
constexpr int64_t SDRS_MB  = 8;   // src0 row pairs per block
constexpr size_t  TILE     = 1024;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1)/m*m; }

struct Layout {
    int64_t kp, ks, nch, ntile, kc_steps, parts;
    size_t s_part, per_thread, pbuf, cbuf;
};

// `parts`: bf16 values per operand value, 2 (f16 precision) or 3 (f32)
Layout layout(int64_t n, int64_t k, int64_t parts) {
    Layout l;
    l.parts    = parts;
    l.kp       = round_up(k, 32);
    l.ks       = l.kp/32;
    l.nch      = n < SDRS_NCH ? round_up(n, 32) : SDRS_NCH;
    l.ntile    = l.nch/16;
    l.kc_steps = SDRS_KC/32 < l.ks ? SDRS_KC/32 : l.ks;
    l.s_part   = (size_t) l.ntile*l.ks*TILE;            // one part of one chunk
    l.pbuf     = (size_t) 2*parts*l.kc_steps*TILE;      // 2 tiles of rows, every part
    l.cbuf     = (size_t) SDRS_MB*(l.nch/32)*4*TILE;    // 4 C tiles per (pair, pair)
    l.per_thread = l.pbuf + l.cbuf + TILE;
    return l;
}

} // namespace

// Whether src1 (n rows) takes the shared chunks, src0 (m rows) being much longer.
static bool src1_shared(int64_t m, int64_t n) { return m > 2*n; }

// m, n: rows of src0 and src1; parts: 2 or 3 (an f32 src0)
extern "C" size_t sdrs_f16_amx_wsize(int64_t m, int64_t n, int64_t k, int nth, int parts) {
    const Layout l = layout(src1_shared(m, n) ? n : m, k, parts);
    return (size_t) parts*l.s_part + (size_t) nth*l.per_thread + 64;
}

#if defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define SDRS_HAVE_KERNEL 1

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>

namespace {

// Tile instructions as asm with a memory clobber (GCC 12's intrinsics have none; see
// patches/cpu-speed.toml), tile numbers fixed: C in 0-3, src0 tiles in 4-5, src1 in 6-7.
#define SDRS_TLOAD(t, p)  __asm__ __volatile__("tileloadd (%0,%1,1), %%tmm" #t :: "r"(p), "r"((int64_t) 64) : "memory")
#define SDRS_TSTORE(t, p) __asm__ __volatile__("tilestored %%tmm" #t ", (%0,%1,1)" :: "r"(p), "r"((int64_t) 64) : "memory")
#define SDRS_TSTORE_LD(t, p, ld) __asm__ __volatile__("tilestored %%tmm" #t ", (%0,%1,1)" :: "r"(p), "r"((int64_t) (ld)) : "memory")
#define SDRS_TZERO(t)     __asm__ __volatile__("tilezero %%tmm" #t ::: "memory")
#define SDRS_TDP(c, a, b) __asm__ __volatile__("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")

struct alignas(64) TileConfig {
    uint8_t  palette;
    uint8_t  start_row;
    uint8_t  reserved[14];
    uint16_t colsb[16];
    uint8_t  rows[16];
};

bool amx_bf16_usable() {
    static const bool ok = [] {
        const char * env = getenv("SD_CPU_AMX_F16");
        if (env && (strcmp(env, "off") == 0 || strcmp(env, "0") == 0)) {
            return false;
        }
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
            return false;
        }
        const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
        if (!tile || !bf16) {
            return false;
        }
        // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: the tile state is off until asked for
        return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }();
    return ok;
}

// x = part 0 + part 1 (+ part 2), each bf16 (rounded to nearest) and each the rounding of
// what the parts before it leave, for 16 values; every remainder is exact in f32. Two parts
// hold an f16 value exactly, three an f32 value to 2^-24 of it.
inline void split16(__m512 x, int parts, __m256i out[3]) {
    for (int i = 0; i < parts; i++) {
        const __m256i h = (__m256i) _mm512_cvtneps_pbh(x);
        out[i] = h;
        x = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
}

// How a row's values are read: f16; f32 rounded to f16 first (as ggml rounds src1 to the
// f16 vec_dot type of an f16 src0); f32 as is.
enum Read { READ_F16 = 0, READ_F32_AS_F16 = 1, READ_F32 = 2 };

// 16 values from a row; `n` < 16 reads that many and zero-fills
inline __m512 load16(const void * row, int how, int64_t k0, int64_t n) {
    const __mmask16 m = n >= 16 ? (__mmask16) 0xffff : (__mmask16) ((1u << n) - 1);
    if (how == READ_F16) {
        const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *) row + k0);
        return _mm512_cvtph_ps(h);
    }
    const __m512 f = _mm512_maskz_loadu_ps(m, (const float *) row + k0);
    if (how == READ_F32) {
        return f;
    }
    return _mm512_cvtph_ps(_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// 32 values from k0 as 16 dwords of bf16 pairs, one vector per part
inline void pairs32(const void * row, int how, int64_t k0, int64_t k, int parts, __m512i out[3]) {
    const int64_t left = k - k0;
    __m256i a[3], b[3];
    split16(load16(row, how, k0, left < 0 ? 0 : left), parts, a);
    split16(load16(row, how, k0 + 16, left - 16 < 0 ? 0 : left - 16), parts, b);
    for (int i = 0; i < parts; i++) {
        out[i] = _mm512_inserti64x4(_mm512_castsi256_si512(a[i]), b[i], 1);
    }
}

// transposes 16 rows of 16 dwords in place
inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2*i]     = _mm512_unpacklo_epi32(r[2*i], r[2*i + 1]);
        t[2*i + 1] = _mm512_unpackhi_epi32(r[2*i], r[2*i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4*i]     = _mm512_unpacklo_epi64(t[4*i],     t[4*i + 2]);
        r[4*i + 1] = _mm512_unpackhi_epi64(t[4*i],     t[4*i + 2]);
        r[4*i + 2] = _mm512_unpacklo_epi64(t[4*i + 1], t[4*i + 3]);
        r[4*i + 3] = _mm512_unpackhi_epi64(t[4*i + 1], t[4*i + 3]);
    }
    // r[4i + j] now holds, for rows 4i..4i+3, column j + 4q of each 128-bit lane q
    for (int j = 0; j < 4; j++) {
        const __m512i a = r[j], b = r[4 + j], c = r[8 + j], d = r[12 + j];
        // lanes: (a0 b0 a2 b2), (a1 b1 a3 b3), then combine with c, d
        const __m512i ab_lo = _mm512_shuffle_i32x4(a, b, 0x88); // a0 a2 b0 b2
        const __m512i ab_hi = _mm512_shuffle_i32x4(a, b, 0xdd); // a1 a3 b1 b3
        const __m512i cd_lo = _mm512_shuffle_i32x4(c, d, 0x88);
        const __m512i cd_hi = _mm512_shuffle_i32x4(c, d, 0xdd);
        t[j]      = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88); // a0 b0 c0 d0
        t[8 + j]  = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xdd); // a2 b2 c2 d2
        t[4 + j]  = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88); // a1 b1 c1 d1
        t[12 + j] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xdd); // a3 b3 c3 d3
    }
    for (int i = 0; i < 16; i++) {
        r[i] = t[i];
    }
}

struct Mat {
    const char * data;
    size_t       ld; // bytes between rows
    int64_t      rows;
    int          how; // enum Read
};

// S rows [n0, n0 + nch) into VNNI tiles, part by part: tile (nt, ks) of part i at
// i*s_part + (nt*ks_n + ks)*TILE. Threads split the 16-row tiles.
void pack_s(const Mat & s, int64_t n0, int64_t k, const Layout & l, char * base, int ith, int nth) {
    const int64_t nt0 = l.ntile*ith/nth, nt1 = l.ntile*(ith + 1)/nth;
    const int parts = (int) l.parts;
    for (int64_t nt = nt0; nt < nt1; nt++) {
        for (int64_t ks = 0; ks < l.ks; ks++) {
            __m512i v[3][16];
            for (int r = 0; r < 16; r++) {
                const int64_t n = n0 + nt*16 + r;
                __m512i row[3];
                if (n < s.rows) {
                    pairs32(s.data + n*s.ld, s.how, ks*32, k, parts, row);
                } else {
                    row[0] = row[1] = row[2] = _mm512_setzero_si512();
                }
                for (int i = 0; i < parts; i++) {
                    v[i][r] = row[i];
                }
            }
            for (int i = 0; i < parts; i++) {
                transpose16(v[i]);
                char * t = base + i*l.s_part + (nt*l.ks + ks)*TILE;
                for (int r = 0; r < 16; r++) {
                    _mm512_store_si512((__m512i *) (t + 64*r), v[i][r]);
                }
            }
        }
    }
}

// P rows [m0, m0 + 32), k steps [ks0, ks0 + nks) into row-major tiles:
// tile (half, part, step) at ((half*parts + part)*kc_steps + step)*TILE
void pack_p(const Mat & p, int64_t m0, int64_t ks0, int64_t nks, int64_t k, const Layout & l, char * buf) {
    const int parts = (int) l.parts;
    for (int half = 0; half < 2; half++) {
        for (int r = 0; r < 16; r++) {
            const int64_t m = m0 + half*16 + r;
            for (int64_t s = 0; s < nks; s++) {
                __m512i v[3];
                if (m < p.rows) {
                    pairs32(p.data + m*p.ld, p.how, (ks0 + s)*32, k, parts, v);
                } else {
                    v[0] = v[1] = v[2] = _mm512_setzero_si512();
                }
                for (int i = 0; i < parts; i++) {
                    _mm512_store_si512((__m512i *) (buf + ((half*parts + i)*l.kc_steps + s)*TILE + 64*r), v[i]);
                }
            }
        }
    }
}

// C tile (16 rows of 16 f32, 64-byte rows, at c) into dst rows r0.., columns c0.., within
// bounds
void store_partial(const float * c, float * dst, size_t ldd, int64_t r0, int64_t c0, int64_t r_end, int64_t c_end) {
    const int64_t cv = c_end - c0 < 16 ? c_end - c0 : 16;
    const __mmask16 mask = (__mmask16) ((1u << cv) - 1);
    for (int i = 0; i < 16 && r0 + i < r_end; i++) {
        float * row = (float *) ((char *) dst + (r0 + i)*ldd) + c0;
        _mm512_mask_storeu_ps(row, mask, _mm512_loadu_ps(c + 16*i));
    }
}

// C tile (16 rows of 16 f32 at c) transposed into dst: c[i][j] to dst row r0 + j,
// column c0 + i, within bounds
void store_transposed(const float * c, float * dst, size_t ldd, int64_t c0, int64_t r0, int64_t c_end, int64_t r_end) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) {
        r[i] = _mm512_load_si512((const __m512i *) (c + 16*i));
    }
    transpose16(r);
    const int64_t cv = c_end - c0 < 16 ? c_end - c0 : 16;
    const __mmask16 mask = (__mmask16) ((1u << cv) - 1);
    for (int j = 0; j < 16 && r0 + j < r_end; j++) {
        float * row = (float *) ((char *) dst + (r0 + j)*ldd) + c0;
        _mm512_mask_storeu_ps(row, mask, _mm512_castsi512_ps(r[j]));
    }
}

using Barrier = void (*)(void *);

// The partial products summed, in order, as (part of src0, part of src1): with two parts
// the dropped 1.1 is below 2^-18 of a term; with three, the dropped ones below 2^-24.
constexpr int PASSES2[3][2] = {{0, 0}, {0, 1}, {1, 0}};
constexpr int PASSES3[6][2] = {{0, 0}, {0, 1}, {1, 0}, {1, 1}, {0, 2}, {2, 0}};

// One product (one batch): c[i][j] = sum_k p[i][k] s[j][k], written to dst[i][j] (row i at
// dst + i*ldd), or to dst[j][i] when `transposed`. ggml's dst[n][m] = sum_k src1[n][k]
// src0[m][k] is p = src1, s = src0, or p = src0, s = src1 transposed: s is the side packed
// in shared chunks (VNNI, the costlier packing), best the one with fewer rows.
void gemm(const Mat & p, const Mat & s, int64_t k, int parts, float * dst, size_t ldd, bool transposed, char * wdata,
          int ith, int nth, Barrier barrier, void * bctx) {
    const Layout l  = layout(s.rows, k, parts);
    char * s_base   = (char *) (((uintptr_t) wdata + 63) & ~(uintptr_t) 63);
    char * mine     = s_base + parts*l.s_part + (size_t) ith*l.per_thread;
    char * pbuf     = mine;
    char * cbuf     = mine + l.pbuf;
    float * ctmp    = (float *) (cbuf + l.cbuf);

    const int64_t pairs = (p.rows + 31)/32;
    const int64_t mp0 = pairs*ith/nth, mp1 = pairs*(ith + 1)/nth;

    for (int64_t n0 = 0; n0 < s.rows; n0 += l.nch) {
        const int64_t nch    = s.rows - n0 < l.nch ? s.rows - n0 : l.nch;
        const int64_t npairs = (nch + 31)/32;
        pack_s(s, n0, k, l, s_base, ith, nth);
        barrier(bctx);
        for (int64_t mb = mp0; mb < mp1; mb += SDRS_MB) {
            const int64_t mb1 = mb + SDRS_MB < mp1 ? mb + SDRS_MB : mp1;
            for (int64_t ks0 = 0; ks0 < l.ks; ks0 += l.kc_steps) {
                const int64_t nks   = l.ks - ks0 < l.kc_steps ? l.ks - ks0 : l.kc_steps;
                const bool    first = ks0 == 0, last = ks0 + nks >= l.ks;
                for (int64_t mp = mb; mp < mb1; mp++) {
                    pack_p(p, mp*32, ks0, nks, k, l, pbuf);
                    const char * pt[3][2];
                    for (int i = 0; i < parts; i++) {
                        pt[i][0] = pbuf + ((0*parts + i)*l.kc_steps)*TILE;
                        pt[i][1] = pbuf + ((1*parts + i)*l.kc_steps)*TILE;
                    }
                    for (int64_t np = 0; np < npairs; np++) {
                        char * cs = cbuf + ((mp - mb)*(l.nch/32) + np)*4*TILE;
                        if (first) {
                            SDRS_TZERO(0); SDRS_TZERO(1); SDRS_TZERO(2); SDRS_TZERO(3);
                        } else {
                            SDRS_TLOAD(0, cs); SDRS_TLOAD(1, cs + TILE); SDRS_TLOAD(2, cs + 2*TILE); SDRS_TLOAD(3, cs + 3*TILE);
                        }
                        const char * st[3][2];
                        for (int i = 0; i < parts; i++) {
                            st[i][0] = s_base + i*l.s_part + ((2*np)*l.ks + ks0)*TILE;
                            st[i][1] = s_base + i*l.s_part + ((2*np + 1)*l.ks + ks0)*TILE;
                        }
                        // The partial products are summed in one order of src0's and src1's
                        // parts (PASSES), whichever side P is: each output's arithmetic is
                        // then the same for any split of src0's rows (a row split over
                        // devices) and any thread count, so placements give the same bits.
                        // A tile pair is loaded only when the pass needs another part.
                        const int (*passes)[2] = parts == 2 ? PASSES2 : PASSES3;
                        const int n_passes = parts == 2 ? 3 : 6;
                        for (int64_t t = 0; t < nks; t++) {
                            const size_t o = (size_t) t*TILE;
                            int cur_p = -1, cur_s = -1;
                            for (int q = 0; q < n_passes; q++) {
                                const int pp = transposed ? passes[q][0] : passes[q][1];
                                const int sp = transposed ? passes[q][1] : passes[q][0];
                                if (pp != cur_p) { SDRS_TLOAD(4, pt[pp][0] + o); SDRS_TLOAD(5, pt[pp][1] + o); cur_p = pp; }
                                if (sp != cur_s) { SDRS_TLOAD(6, st[sp][0] + o); SDRS_TLOAD(7, st[sp][1] + o); cur_s = sp; }
                                SDRS_TDP(0, 4, 6); SDRS_TDP(1, 4, 7); SDRS_TDP(2, 5, 6); SDRS_TDP(3, 5, 7);
                            }
                        }
                        if (!last) {
                            SDRS_TSTORE(0, cs); SDRS_TSTORE(1, cs + TILE); SDRS_TSTORE(2, cs + 2*TILE); SDRS_TSTORE(3, cs + 3*TILE);
                            continue;
                        }
                        // tile (i, j): rows p_a + 16i of the output, columns s_a + 16j
                        const int64_t p_a = mp*32, s_a = n0 + np*32;
                        const int64_t p_end = p.rows, s_end = n0 + nch;
                        if (transposed) {
                            SDRS_TSTORE(0, ctmp); store_transposed(ctmp, dst, ldd, p_a, s_a, p_end, s_end);
                            if (s_a + 16 < s_end) { SDRS_TSTORE(1, ctmp); store_transposed(ctmp, dst, ldd, p_a, s_a + 16, p_end, s_end); }
                            if (p_a + 16 < p_end) {
                                SDRS_TSTORE(2, ctmp); store_transposed(ctmp, dst, ldd, p_a + 16, s_a, p_end, s_end);
                                if (s_a + 16 < s_end) { SDRS_TSTORE(3, ctmp); store_transposed(ctmp, dst, ldd, p_a + 16, s_a + 16, p_end, s_end); }
                            }
                            continue;
                        }
                        const bool full = p_a + 32 <= p_end && s_a + 32 <= s_end;
                        if (full) {
                            char * d = (char *) dst + p_a*ldd + s_a*sizeof(float);
                            SDRS_TSTORE_LD(0, d, ldd);
                            SDRS_TSTORE_LD(1, d + 16*sizeof(float), ldd);
                            SDRS_TSTORE_LD(2, d + 16*ldd, ldd);
                            SDRS_TSTORE_LD(3, d + 16*ldd + 16*sizeof(float), ldd);
                            continue;
                        }
                        SDRS_TSTORE(0, ctmp); store_partial(ctmp, dst, ldd, p_a, s_a, p_end, s_end);
                        if (s_a + 16 < s_end) { SDRS_TSTORE(1, ctmp); store_partial(ctmp, dst, ldd, p_a, s_a + 16, p_end, s_end); }
                        if (p_a + 16 < p_end) {
                            SDRS_TSTORE(2, ctmp); store_partial(ctmp, dst, ldd, p_a + 16, s_a, p_end, s_end);
                            if (s_a + 16 < s_end) { SDRS_TSTORE(3, ctmp); store_partial(ctmp, dst, ldd, p_a + 16, s_a + 16, p_end, s_end); }
                        }
                    }
                }
            }
        }
        barrier(bctx);
    }
}

// Loads this kernel's tile configuration; returns the one the thread had.
void tiles_enter(TileConfig & saved) {
    __asm__ __volatile__("sttilecfg %0" : "=m"(saved) :: "memory");
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i]  = 16;
        c.colsb[i] = 64;
    }
    __asm__ __volatile__("ldtilecfg %0" :: "m"(c) : "memory");
}

void tiles_leave(const TileConfig & saved) {
    if (saved.palette != 0) {
        __asm__ __volatile__("ldtilecfg %0" :: "m"(saved) : "memory");
    } else {
        __asm__ __volatile__("tilerelease" ::: "memory");
    }
}

} // namespace

#pragma GCC pop_options
#endif

#ifdef SDRS_STANDALONE
// test entry: one product on one thread
extern "C" int sdrs_f16_amx_standalone(const void * p, size_t ldp, int64_t m, int p_f16, const void * s, size_t lds,
                                        int64_t n, int s_f16, int64_t k, float * dst, size_t ldd, void * wdata) {
#ifdef SDRS_HAVE_KERNEL
    if (!amx_bf16_usable()) return 0;
    TileConfig saved;
    tiles_enter(saved);
    // p: the weights (rows m), s: the activations (rows n), as src0 and src1
    Mat w{(const char *) p, ldp, m, p_f16 ? READ_F16 : READ_F32}, a{(const char *) s, lds, n, s_f16 ? READ_F16 : (p_f16 ? READ_F32_AS_F16 : READ_F32)};
    const int parts = p_f16 ? 2 : 3;
    if (src1_shared(m, n)) {
        gemm(w, a, k, parts, dst, ldd, true, (char *) wdata, 0, 1, [](void *) {}, nullptr);
    } else {
        gemm(a, w, k, parts, dst, ldd, false, (char *) wdata, 0, 1, [](void *) {}, nullptr);
    }
    tiles_leave(saved);
    return 1;
#else
    return 0;
#endif
}
#else

// bf16 parts per value: 2 hold an f16 exactly, 3 an f32 to 2^-24
static int parts_of(const struct ggml_tensor * dst) { return dst->src[0]->type == GGML_TYPE_F32 ? 3 : 2; }

// Whether this kernel computes `dst` (a GGML_OP_MUL_MAT); the same answer on every thread.
extern "C" bool sdrs_f16_amx_applies(const struct ggml_tensor * dst) {
#ifdef SDRS_HAVE_KERNEL
    // Graph nodes only: the graph plan reserved this kernel's work buffer for them. ggml's
    // direct convolution calls MUL_MAT on a tensor of its own (op NONE) whose operand lies
    // in the work buffer; that product stays on ggml's kernels.
    if (dst->op != GGML_OP_MUL_MAT) {
        return false;
    }
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    const bool types = (src0->type == GGML_TYPE_F16 || src0->type == GGML_TYPE_F32) &&
                       (src1->type == GGML_TYPE_F32 || src1->type == GGML_TYPE_F16);
    if (!types) {
        return false;
    }
    if (dst->type != GGML_TYPE_F32 || src0->nb[0] != ggml_type_size(src0->type) ||
        src1->nb[0] != ggml_type_size(src1->type) || dst->nb[0] != sizeof(float)) {
        return false;
    }
    // products of few activation rows or a short k stay on ggml's kernels (a 32x32 tile
    // block would be mostly padding). No bound on src0's rows: a row split over devices
    // cuts those, and each share must take the same kernel as the whole.
    if (src1->ne[1] < 16 || src0->ne[0] < 16) {
        return false;
    }
    // An f32 src0 only where ggml has no tiled f32 kernel (LLAMAFILE's AVX-512 tiles take k
    // in multiples of 16; others fall back to one dot product per output, 17 GFLOP/s for
    // attention's q.k with a head of 40 on two cores): there, three parts per value keep
    // f32's precision at a third of the speed of f16's two.
    if (src0->type == GGML_TYPE_F32 && src0->ne[0] % 16 == 0) {
        return false;
    }
    return amx_bf16_usable();
#else
    (void) dst;
    return false;
#endif
}

extern "C" size_t sdrs_f16_amx_node_wsize(const struct ggml_tensor * dst, int n_tasks) {
    if (!sdrs_f16_amx_applies(dst)) {
        return 0;
    }
    return sdrs_f16_amx_wsize(dst->src[0]->ne[1], dst->src[1]->ne[1], dst->src[0]->ne[0], n_tasks, parts_of(dst));
}

// Computes `dst` if sdrs_f16_amx_applies(dst); every thread of the op calls it.
extern "C" bool sdrs_f16_amx_mul_mat(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
#ifdef SDRS_HAVE_KERNEL
    if (params->use_ref || !sdrs_f16_amx_applies(dst)) {
        return false;
    }
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    const int64_t k = src0->ne[0];
    const int parts = parts_of(dst);
    if (params->wsize < sdrs_f16_amx_wsize(src0->ne[1], src1->ne[1], k, params->nth, parts)) {
        return false; // planned without this kernel (cannot happen when the plan saw it)
    }
    const int64_t r2 = src1->ne[2]/src0->ne[2], r3 = src1->ne[3]/src0->ne[3];
    // ggml rounds an f32 src1 to f16 for an f16 src0 (its vec_dot type), and reads it as
    // f32 for an f32 src0
    const int p_how = src0->type == GGML_TYPE_F16 ? READ_F16 : READ_F32;
    const int s_how = src1->type == GGML_TYPE_F16 ? READ_F16 : (p_how == READ_F16 ? READ_F32_AS_F16 : READ_F32);
    TileConfig saved;
    tiles_enter(saved);
    for (int64_t i13 = 0; i13 < src1->ne[3]; i13++) {
        for (int64_t i12 = 0; i12 < src1->ne[2]; i12++) {
            const Mat p{(const char *) src0->data + (i12/r2)*src0->nb[2] + (i13/r3)*src0->nb[3], src0->nb[1], src0->ne[1],
                        p_how};
            const Mat s{(const char *) src1->data + i12*src1->nb[2] + i13*src1->nb[3], src1->nb[1], src1->ne[1], s_how};
            float * d = (float *) ((char *) dst->data + i12*dst->nb[2] + i13*dst->nb[3]);
            const bool t = src1_shared(p.rows, s.rows);
            gemm(t ? p : s, t ? s : p, k, parts, d, dst->nb[1], t, (char *) params->wdata, params->ith, params->nth,
                 [](void * tp) { ggml_barrier((struct ggml_threadpool *) tp); }, params->threadpool);
        }
    }
    tiles_leave(saved);
    return true;
#else
    (void) params;
    (void) dst;
    return false;
#endif
}
#endif
