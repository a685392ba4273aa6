// sd-rs: matrix products with f16 (or f32) weights on AVX-512 FMAs, packed and cache-blocked.
//
// Added to every CPU variant by patches/cpu-speed.toml ([[add]]); the kernel is compiled only
// where the variant's flags include AVX-512 F, BW and VL (skylakex, zen4, sapphirerapids) and
// runs where the AMX f16 kernel (sdrs-f16-amx.cpp) does not take the product. It replaces
// ggml's LLAMAFILE tiles (tinyBLAS) for these products: those read both operands from their
// rows and convert every f16 value to f32 at every use, with no blocking for the caches, and
// reach about half the FMA peak of a Zen 5 core. `SD_CPU_F16_GEMM=off` turns this kernel off.
//
// What it computes. GGML_OP_MUL_MAT, dst[n][m] = sum_k src1[n][k] * src0[m][k], with an f16
// src0 and an f32 or f16 src1 as ggml defines it: an f32 src1 is rounded to f16 first (the
// f16 vec_dot type), products are summed in f32. An f32 src0 (attention's q.k) is taken where
// ggml has no tiled kernel for it (k not a multiple of 16), with src1 read as f32. Every output
// is one f32 FMA chain over k in order (k blocks continue from the partial sums they left in
// dst), so its bits depend on neither the thread count nor the blocking nor a split of src0's
// rows over devices; they differ from tinyBLAS's, whose 16 lanes each sum a sixteenth of k.
//
// Layout. dst rows are n; along a row, m is contiguous, so m is the vector dimension: the
// micro-kernel keeps a 32 (m) x 12 (n) tile of dst in 24 zmm accumulators, and for each k
// loads 32 values of src0 (two vectors) and multiplies them by 12 broadcast values of src1.
// src0 is packed k-major in panels of 32 rows (a 16x16 transpose per 16 rows and 16 k, the
// f16 -> f32 conversion done once); src1 in panels of 12 rows, each row converted (and rounded
// to f16 where ggml rounds it) into a slot of 256 floats, so the kernel reaches the 12 rows at
// fixed offsets.
//
// Schedule. The threads split src1's panels or src0's rows (whichever makes them pack less;
// no barrier, no shared buffer: each packs what it reads). Over its share a thread runs one
// of two loop orders. With many src0 rows and src1 small enough to stay packed whole (every k;
// 16 MiB a thread at most, 32 MiB for all), as a VAE's convolutions (tens of thousands of
// pixels by 128 to 512 channels): src1 is packed once, and for each block of 128 src0 rows
// every k block of 256 is packed and multiplied, so that block of dst is finished while it is
// in the cache. Otherwise, per block of up to 32 src1 panels (384 rows) and k block: the src1
// block is packed, then each block of 128 src0 rows (128 KiB, in L2), and the micro-kernel
// runs over every (src1 panel, src0 panel) pair, a src1 panel (12 KiB) staying in L1 while the
// src0 panels stream past it. Packing buffers are leased from a pool kept across products
// (ggml starts new threads for every graph it computes).
//
// Measured on a Zen 5 guest (2 cores, 261 GFLOP/s of f32 FMAs a core), 2 threads, against
// ggml's kernels in the same process: a UNet linear layer 1.15-1.6x, a UNet convolution 1.0-1.1x,
// a VAE convolution 1.05-1.13x, attention's q.k (k = 40, where ggml has no tiled kernel) 4-70x;
// an SD 1.5 step at 256x256 0.92x the time, at 512x512 0.75x. Products of fewer than 128
// activation rows stay on ggml's kernels (packing would not pay).

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <atomic>

#ifndef SDRS_STANDALONE
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SDRS_HAVE_GEMM 1

#include <immintrin.h>

namespace {

constexpr int64_t MR  = 32;  // src0 rows per panel (two vectors)
constexpr int64_t NR  = 12;  // src1 rows per panel
constexpr int64_t KC  = 256; // k values per block, at most
constexpr int64_t MB  = 128; // src0 rows per packed block
constexpr int64_t NBP = 32;  // src1 panels per packed block

// How a row's values are read: f16; f32 rounded to f16 (ggml's f16 vec_dot type); f32.
enum Read { READ_F16 = 0, READ_F32_AS_F16 = 1, READ_F32 = 2 };

struct Mat {
    const char * data;
    size_t       ld;   // bytes between rows
    int64_t      rows;
    int          how;  // enum Read
};

// 16 values of a row from k0; `n` < 16 reads that many and zero-fills the rest
inline __m512 load16(const char * row, int how, int64_t k0, int64_t n) {
    const __mmask16 m = n >= 16 ? (__mmask16) 0xffff : (__mmask16) ((1u << n) - 1);
    if (how == READ_F16) {
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *) row + k0));
    }
    const __m512 f = _mm512_maskz_loadu_ps(m, (const float *) row + k0);
    if (how == READ_F32) {
        return f;
    }
    return _mm512_cvtph_ps(_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Transposes 16 vectors of 16 floats in place: afterwards v[i] holds element i of every input.
inline void transpose16(__m512 v[16]) {
    __m512 a[16];
    for (int i = 0; i < 8; i++) {
        a[2*i]     = _mm512_unpacklo_ps(v[2*i], v[2*i + 1]);
        a[2*i + 1] = _mm512_unpackhi_ps(v[2*i], v[2*i + 1]);
    }
    // b[4i + j]: in each 128-bit lane q, element 4q + j of inputs 4i .. 4i + 3
    __m512 b[16];
    for (int i = 0; i < 4; i++) {
        const __m512d x0 = _mm512_castps_pd(a[4*i]), x1 = _mm512_castps_pd(a[4*i + 1]);
        const __m512d x2 = _mm512_castps_pd(a[4*i + 2]), x3 = _mm512_castps_pd(a[4*i + 3]);
        b[4*i]     = _mm512_castpd_ps(_mm512_unpacklo_pd(x0, x2));
        b[4*i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x0, x2));
        b[4*i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(x1, x3));
        b[4*i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(x1, x3));
    }
    // element 4q + j of every input: lane i from b[4i + j]'s lane q
    for (int j = 0; j < 4; j++) {
        const __m512 lo01 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0x88);      // b0.l0 b0.l2 b1.l0 b1.l2
        const __m512 hi01 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0xdd);      // b0.l1 b0.l3 b1.l1 b1.l3
        const __m512 lo23 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0x88);
        const __m512 hi23 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0xdd);
        v[j]      = _mm512_shuffle_f32x4(lo01, lo23, 0x88);
        v[8 + j]  = _mm512_shuffle_f32x4(lo01, lo23, 0xdd);
        v[4 + j]  = _mm512_shuffle_f32x4(hi01, hi23, 0x88);
        v[12 + j] = _mm512_shuffle_f32x4(hi01, hi23, 0xdd);
    }
}

// src0 rows [m0, m0 + mlen), k [k0, k0 + kc) into panels of MR rows, k-major: value (row r of
// panel p, k0 + kk) at out[(p*kc + kk)*MR + r]; rows past the matrix are zeros.
void pack_a(const Mat & a, int64_t m0, int64_t mlen, int64_t k0, int64_t kc, float * out) {
    const int64_t panels = (mlen + MR - 1)/MR;
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t half = 0; half < 2; half++) {
            const int64_t r0 = m0 + p*MR + half*16;
            for (int64_t kk = 0; kk < kc; kk += 16) {
                const int64_t n = kc - kk < 16 ? kc - kk : 16;
                __m512 v[16];
                for (int r = 0; r < 16; r++) {
                    const int64_t m = r0 + r;
                    v[r] = m < m0 + mlen && m < a.rows ? load16(a.data + m*a.ld, a.how, k0 + kk, n) : _mm512_setzero_ps();
                }
                transpose16(v);
                float * dst = out + (p*kc + kk)*MR + half*16;
                for (int64_t i = 0; i < n; i++) {
                    _mm512_store_ps(dst + i*MR, v[i]);
                }
            }
        }
    }
}

// src1 rows [n0, n0 + 12*panels), k [k0, k0 + kc) into panels of NR rows, each row KC values
// apart (a constant, so the micro-kernel addresses the 12 rows with fixed offsets): value (row
// j of panel q, k0 + kk) at out[(q*NR + j)*KC + kk]; rows past the matrix are zeros.
void pack_b(const Mat & b, int64_t n0, int64_t panels, int64_t k0, int64_t kc, float * out) {
    for (int64_t q = 0; q < panels; q++) {
        for (int64_t j = 0; j < NR; j++) {
            const int64_t row = n0 + q*NR + j;
            float * dst = out + (q*NR + j)*KC;
            if (row >= b.rows) {
                memset(dst, 0, (size_t) kc*sizeof(float));
                continue;
            }
            const char * src = b.data + row*b.ld;
            for (int64_t kk = 0; kk < kc; kk += 16) {
                const int64_t n = kc - kk < 16 ? kc - kk : 16;
                const __mmask16 m = n >= 16 ? (__mmask16) 0xffff : (__mmask16) ((1u << n) - 1);
                _mm512_mask_storeu_ps(dst + kk, m, load16(src, b.how, k0 + kk, n));
            }
        }
    }
}

// dst tile of MV*16 rows of m (masks m0, m1) by `nv` (<= NR) rows of n at `c` (rows `ldc`
// floats apart): c (+)= the packed panels' product over `kc` k values; `acc` continues from
// the values in c, otherwise they are overwritten.
template <int MV>
inline void micro(int64_t kc, const float * __restrict a, const float * __restrict b, float * c, int64_t ldc, int64_t nv,
                  __mmask16 m0, __mmask16 m1, bool acc) {
    __m512 c0[NR], c1[NR];
#pragma GCC unroll 12
    for (int j = 0; j < NR; j++) {
        c0[j] = _mm512_setzero_ps();
        c1[j] = _mm512_setzero_ps();
        if (acc && j < nv) {
            c0[j] = _mm512_maskz_loadu_ps(m0, c + j*ldc);
            if (MV == 2) {
                c1[j] = _mm512_maskz_loadu_ps(m1, c + j*ldc + 16);
            }
        }
    }
    for (int64_t k = 0; k < kc; k++) {
        const __m512 a0 = _mm512_load_ps(a + k*MR);
        const __m512 a1 = MV == 2 ? _mm512_load_ps(a + k*MR + 16) : _mm512_setzero_ps();
        const float * bk = b + k;
#pragma GCC unroll 12
        for (int j = 0; j < NR; j++) {
            const __m512 bj = _mm512_set1_ps(bk[j*KC]);
            c0[j] = _mm512_fmadd_ps(a0, bj, c0[j]);
            if (MV == 2) {
                c1[j] = _mm512_fmadd_ps(a1, bj, c1[j]);
            }
        }
    }
#pragma GCC unroll 12
    for (int j = 0; j < NR; j++) {
        if (j < nv) {
            _mm512_mask_storeu_ps(c + j*ldc, m0, c0[j]);
            if (MV == 2) {
                _mm512_mask_storeu_ps(c + j*ldc + 16, m1, c1[j]);
            }
        }
    }
}

// Packing buffers, kept across products: ggml's CPU backend starts new threads for every
// graph it computes, so buffers of a thread's own would be allocated (and their pages faulted
// in) again for every graph. A product's thread leases a slot for the call and returns it.
struct Slot {
    std::atomic<bool> busy{false};
    float * buf[3] = {nullptr, nullptr, nullptr};
    size_t  cap[3] = {0, 0, 0};
};
constexpr int SLOTS = 64;
Slot g_slots[SLOTS];

struct Lease {
    Slot * slot = nullptr;
    Lease() {
        for (Slot & s : g_slots) {
            bool idle = false;
            if (s.busy.compare_exchange_strong(idle, true, std::memory_order_acquire)) {
                slot = &s;
                return;
            }
        }
    }
    ~Lease() {
        if (slot) {
            slot->busy.store(false, std::memory_order_release);
        }
    }
    Lease(const Lease &) = delete;
    Lease & operator=(const Lease &) = delete;
    // A buffer of at least `n` floats, 64-byte aligned; null if none can be had.
    float * buffer(int which, size_t n) {
        if (!slot) {
            return nullptr;
        }
        if (slot->cap[which] < n) {
            free(slot->buf[which]);
            const size_t bytes = (n*sizeof(float) + 63)/64*64;
            slot->buf[which] = (float *) aligned_alloc(64, bytes);
            slot->cap[which] = slot->buf[which] ? n : 0;
        }
        return slot->buf[which];
    }
};

// Reads value k of a row as the kernel does.
inline float value(const Mat & x, int64_t row, int64_t k) {
    const char * r = x.data + row*x.ld;
    if (x.how == READ_F16) {
        return _cvtsh_ss(((const uint16_t *) r)[k]);
    }
    const float f = ((const float *) r)[k];
    return x.how == READ_F32 ? f : _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The same outputs as gemm_panels, bit for bit (one FMA chain over k in order per output),
// without packing buffers: for when those cannot be allocated.
void gemm_plain(const Mat & a, const Mat & b, int64_t k, float * dst, int64_t ldd, int64_t q0, int64_t q1,
                int64_t m_lo, int64_t m_hi) {
    const int64_t n1 = q1*NR < b.rows ? q1*NR : b.rows;
    for (int64_t n = q0*NR; n < n1; n++) {
        for (int64_t m = m_lo; m < m_hi; m++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++) {
                acc = __builtin_fmaf(value(a, m, i), value(b, n, i), acc);
            }
            dst[n*ldd + m] = acc;
        }
    }
}

// The k block length: k split into equal blocks of at most KC (multiples of 16 but the last).
int64_t k_block(int64_t k) {
    const int64_t blocks = (k + KC - 1)/KC;
    const int64_t kc = (k + blocks - 1)/blocks;
    return (kc + 15)/16*16;
}

// The micro-kernel over every pair of a packed src0 block (`mlen` rows from m0) and `nq`
// packed src1 panels (from panel qs; `rows` src1 rows in all), one k block of `kc` values.
void run_block(const float * pa, const float * pb, int64_t qs, int64_t nq, int64_t rows, int64_t kc, int64_t mlen,
               float * dst, int64_t ldd, int64_t m0, bool acc) {
    for (int64_t q = 0; q < nq; q++) {
        const int64_t n0 = (qs + q)*NR;
        const int64_t nv = rows - n0 < NR ? rows - n0 : NR;
        const float * bq = pb + q*NR*KC;
        for (int64_t p = 0; p*MR < mlen; p++) {
            const int64_t left = mlen - p*MR;
            float * c = dst + n0*ldd + m0 + p*MR;
            const float * ap = pa + p*kc*MR;
            const __mmask16 mk0 = left >= 16 ? (__mmask16) 0xffff : (__mmask16) ((1u << left) - 1);
            if (left > 16) {
                const __mmask16 mk1 = left >= 32 ? (__mmask16) 0xffff : (__mmask16) ((1u << (left - 16)) - 1);
                micro<2>(kc, ap, bq, c, ldd, nv, mk0, mk1, acc);
            } else {
                micro<1>(kc, ap, bq, c, ldd, nv, mk0, 0, acc);
            }
        }
    }
}

// dst[n][m] of one batch matrix for n in src1's panels [q0, q1) and m in src0's rows [m_lo,
// m_hi). Returns false when a buffer cannot be allocated (nothing written then).
bool gemm_panels(const Mat & a, const Mat & b, int64_t k, float * dst, int64_t ldd, int64_t q0, int64_t q1,
                 int64_t m_lo, int64_t m_hi, int nth, Lease & lease) {
    // bytes of src1 a thread may keep packed whole: 16 MiB, 32 MiB for all threads together
    const size_t bfull = (nth <= 2 ? 16u << 20 : (32u << 20)/(size_t) nth);
    const int64_t kcb = k_block(k);
    float * pa = lease.buffer(0, (size_t) MB*kcb);
    float * pb = lease.buffer(1, (size_t) NBP*NR*KC);
    if (!pa || !pb) {
        return false;
    }
    // src1 small enough to stay packed whole (every panel, every k): src0 blocks outermost, so
    // each block of dst is finished (every k block) while it is in the cache.
    const int64_t nq_all = q1 - q0;
    const size_t whole = (size_t) ((k + kcb - 1)/kcb)*nq_all*NR*KC; // floats: every k block's panels
    if (m_hi - m_lo > 4*nq_all*NR && whole*sizeof(float) <= bfull) {
        float * pf = lease.buffer(2, whole);
        if (!pf) {
            return false;
        }
        for (int64_t k0 = 0; k0 < k; k0 += kcb) {
            pack_b(b, q0*NR, nq_all, k0, k - k0 < kcb ? k - k0 : kcb, pf + (k0/kcb)*nq_all*NR*KC);
        }
        for (int64_t m0 = m_lo; m0 < m_hi; m0 += MB) {
            const int64_t mlen = m_hi - m0 < MB ? m_hi - m0 : MB;
            for (int64_t k0 = 0; k0 < k; k0 += kcb) {
                const int64_t kc = k - k0 < kcb ? k - k0 : kcb;
                pack_a(a, m0, mlen, k0, kc, pa);
                run_block(pa, pf + (k0/kcb)*nq_all*NR*KC, q0, nq_all, b.rows, kc, mlen, dst, ldd, m0, k0 > 0);
            }
        }
        return true;
    }
    for (int64_t qs = q0; qs < q1; qs += NBP) {
        const int64_t nq = q1 - qs < NBP ? q1 - qs : NBP;
        for (int64_t k0 = 0; k0 < k; k0 += kcb) {
            const int64_t kc = k - k0 < kcb ? k - k0 : kcb;
            pack_b(b, qs*NR, nq, k0, kc, pb);
            for (int64_t m0 = m_lo; m0 < m_hi; m0 += MB) {
                const int64_t mlen = m_hi - m0 < MB ? m_hi - m0 : MB;
                pack_a(a, m0, mlen, k0, kc, pa);
                run_block(pa, pb, qs, nq, b.rows, kc, mlen, dst, ldd, m0, k0 > 0);
            }
        }
    }
    return true;
}

bool gemm_enabled() {
    static const bool on = [] {
        const char * env = getenv("SD_CPU_F16_GEMM");
        return !(env && (strcmp(env, "off") == 0 || strcmp(env, "0") == 0));
    }();
    return on;
}

} // namespace
#endif

#ifdef SDRS_STANDALONE
// Test entry: one product on one thread. src0 `a` (m rows, f16 if a_f16), src1 `b` (n rows,
// f16 if b_f16, else f32 rounded to f16 for an f16 src0), dst n rows of m, `ldd` floats apart.
extern "C" int sdrs_gemm_avx512_standalone(const void * a, size_t lda, int64_t m, int a_f16, const void * b, size_t ldb,
                                          int64_t n, int b_f16, int64_t k, float * dst, int64_t ldd) {
#ifdef SDRS_HAVE_GEMM
    const Mat ma{(const char *) a, lda, m, a_f16 ? READ_F16 : READ_F32};
    const Mat mb{(const char *) b, ldb, n, b_f16 ? READ_F16 : (a_f16 ? READ_F32_AS_F16 : READ_F32)};
    Lease lease;
    return gemm_panels(ma, mb, k, dst, ldd, 0, (n + NR - 1)/NR, 0, m, 1, lease) ? 1 : 0;
#else
    return 0;
#endif
}
#else

// Whether this kernel computes `dst`, a matrix product (a graph node, or the product ggml's
// direct convolution calls on a tensor of its own); the same answer on every thread.
static bool sdrs_gemm_avx512_applies(const struct ggml_tensor * dst) {
#ifdef SDRS_HAVE_GEMM
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    if (!src0 || !src1 || (dst->op != GGML_OP_MUL_MAT && dst->op != GGML_OP_NONE)) {
        return false;
    }
    const bool types = (src0->type == GGML_TYPE_F16 && (src1->type == GGML_TYPE_F32 || src1->type == GGML_TYPE_F16)) ||
                       (src0->type == GGML_TYPE_F32 && src1->type == GGML_TYPE_F32);
    if (!types || dst->type != GGML_TYPE_F32) {
        return false;
    }
    if (src0->nb[0] != ggml_type_size(src0->type) || src1->nb[0] != ggml_type_size(src1->type) ||
        dst->nb[0] != sizeof(float)) {
        return false;
    }
    // Products of a few activation rows (a time embedding's) stay on ggml's kernels: a
    // 12-row panel would be mostly padding. So do f16 products of fewer than 128 (a text
    // encoder's 77 tokens): packing src0 costs about 16 FMA lanes per value, which src1's rows
    // must repay (tinyBLAS packs nothing). No bound on src0's rows: a row split over devices
    // cuts those, and each share must take the same kernel as the whole.
    if (src1->ne[1] < (src0->type == GGML_TYPE_F16 ? 128 : 8) || src0->ne[0] < 1) {
        return false;
    }
    // An f32 src0 only where ggml has no tiled kernel for it (LLAMAFILE takes k in multiples
    // of 16; otherwise one dot product per output).
    if (src0->type == GGML_TYPE_F32 && src0->ne[0] % 16 == 0) {
        return false;
    }
    return gemm_enabled();
#else
    (void) dst;
    return false;
#endif
}

// Computes `dst` if sdrs_gemm_avx512_applies(dst); every thread of the op calls it.
extern "C" bool sdrs_gemm_avx512_mul_mat(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
#ifdef SDRS_HAVE_GEMM
    if (params->use_ref || !sdrs_gemm_avx512_applies(dst)) {
        return false;
    }
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    const int64_t k = src0->ne[0];
    const int64_t r2 = src1->ne[2]/src0->ne[2], r3 = src1->ne[3]/src0->ne[3];
    const int a_how = src0->type == GGML_TYPE_F16 ? READ_F16 : READ_F32;
    const int b_how = src1->type == GGML_TYPE_F16 ? READ_F16 : (a_how == READ_F16 ? READ_F32_AS_F16 : READ_F32);
    const int64_t m = src0->ne[1], n = src1->ne[1], mats = src1->ne[2]*src1->ne[3];
    const int64_t qn = (n + NR - 1)/NR, pm = (m + MR - 1)/MR;
    // The threads split src1's panels or src0's, whichever packs less: each thread packs the
    // src0 rows it multiplies once per block of src1 panels, and the src1 rows it multiplies.
    const int64_t nth = params->nth;
    const auto blocks = [](int64_t panels) { return (panels + NBP - 1)/NBP; };
    const int64_t by_n = m*blocks((qn + nth - 1)/nth) + qn*NR/nth;
    const int64_t by_m = (pm*MR/nth)*blocks(qn) + qn*NR;
    const bool split_m = by_m < by_n;
    const int64_t per = split_m ? pm : qn;
    const int64_t total = per*mats;
    const int64_t t0 = total*params->ith/nth, t1 = total*(params->ith + 1)/nth;
    Lease lease;
    for (int64_t t = t0; t < t1;) {
        const int64_t mat = t/per, lo = t % per;
        const int64_t hi = t1 - mat*per < per ? t1 - mat*per : per;
        const int64_t i12 = mat % src1->ne[2], i13 = mat/src1->ne[2];
        const Mat a{(const char *) src0->data + (i12/r2)*src0->nb[2] + (i13/r3)*src0->nb[3], src0->nb[1], m, a_how};
        const Mat b{(const char *) src1->data + i12*src1->nb[2] + i13*src1->nb[3], src1->nb[1], n, b_how};
        float * d = (float *) ((char *) dst->data + i12*dst->nb[2] + i13*dst->nb[3]);
        const int64_t ldd = (int64_t) (dst->nb[1]/sizeof(float));
        const int64_t q0 = split_m ? 0 : lo, q1 = split_m ? qn : hi;
        const int64_t m_lo = split_m ? lo*MR : 0, m_hi = split_m ? (hi*MR < m ? hi*MR : m) : m;
        if (!gemm_panels(a, b, k, d, ldd, q0, q1, m_lo, m_hi, (int) nth, lease)) {
            // No packing buffers (every slot leased, or no memory): the same outputs, slowly.
            gemm_plain(a, b, k, d, ldd, q0, q1, m_lo, m_hi);
        }
        t = mat*per + hi;
    }
    return true;
#else
    (void) params;
    (void) dst;
    return false;
#endif
}
#endif
