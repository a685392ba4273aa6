// Per-op probe for `cargo xtask parity ops` (xtask/src/parity_ops.rs).
//
// The ggml operations our SD models use, each on the same seeded inputs, written
// as raw little-endian f32 files `<dir>/<op>.f32`. xtask compiles this one file
// twice: against the reference's ggml (stable-diffusion.cpp's copy, static
// libraries, GGML_MAX_NAME=128) and against ours (the pinned ggml, our CPU
// plugin), and compares the outputs op by op. Only the public ggml API is used,
// the subset both versions share. For the f16 matrix products the probe also
// writes `truth_<op>.f32`: the product in double precision from the same
// operands, to say which side is the more accurate when they differ.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <stdint.h>
#include "ggml.h"
#include "ggml-cpu.h"

static uint64_t st;
static double u01(void) {
    st += 0x9e3779b97f4a7c15ull; uint64_t z = st;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull; z = (z ^ (z >> 27)) * 0x94d049bb133111ebull; z ^= z >> 31;
    return ((z >> 11) + 0.5) / 9007199254740992.0;
}
static float nrm(void) { return (float)(sqrt(-2 * log(u01())) * cos(6.283185307179586 * u01())); }

static struct ggml_tensor *rnd(struct ggml_context *c, enum ggml_type t, int64_t a, int64_t b, int64_t cc, int64_t d, float sd, uint64_t seed) {
    struct ggml_tensor *x = ggml_new_tensor_4d(c, t, a, b, cc, d);
    st = seed;
    int64_t n = ggml_nelements(x);
    for (int64_t i = 0; i < n; i++) {
        float v = nrm() * sd;
        if (t == GGML_TYPE_F16) ((ggml_fp16_t *)x->data)[i] = ggml_fp32_to_fp16(v);
        else ((float *)x->data)[i] = v;
    }
    return x;
}

static float value(const struct ggml_tensor *t, int64_t i) {
    return t->type == GGML_TYPE_F16 ? ggml_fp16_to_fp32(((const ggml_fp16_t *)t->data)[i]) : ((const float *)t->data)[i];
}

// ggml_mul_mat(a, b) of two contiguous 2-D tensors in double precision: out[n][m] = sum_k a[m][k] b[n][k].
static void truth_mul_mat(const char *name, const struct ggml_tensor *a, const struct ggml_tensor *b, const char *dir) {
    char path[512]; snprintf(path, sizeof path, "%s/truth_%s.f32", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(1); }
    const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1];
    for (int64_t n = 0; n < N; n++) {
        for (int64_t m = 0; m < M; m++) {
            double s = 0;
            for (int64_t k = 0; k < K; k++) s += (double)value(a, m * K + k) * value(b, n * K + k);
            float v = (float)s;
            fwrite(&v, 4, 1, f);
        }
    }
    fclose(f);
}

static void run(struct ggml_context *c, const char *name, struct ggml_tensor *y, const char *dir) {
    struct ggml_cgraph *g = ggml_new_graph(c);
    ggml_build_forward_expand(g, y);
    ggml_graph_compute_with_ctx(c, g, 2);
    char path[512]; snprintf(path, sizeof path, "%s/%s.f32", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(1); }
    int64_t n = ggml_nelements(y);
    for (int64_t i = 0; i < n; i++) { float v = value(y, i); fwrite(&v, 4, 1, f); }
    fclose(f);
    printf("%s %lld\n", name, (long long)n);
}

// A product whose double-precision truth is also written.
static void run_mm(struct ggml_context *c, const char *name, struct ggml_tensor *a, struct ggml_tensor *b, const char *dir) {
    run(c, name, ggml_mul_mat(c, a, b), dir);
    truth_mul_mat(name, a, b, dir);
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : ".";
    struct ggml_init_params p = { (size_t)3 << 30, NULL, false };
    struct ggml_context *c = ggml_init(p);
    if (!c) { fprintf(stderr, "ggml_init failed (3 GiB context)\n"); return 1; }
    const enum ggml_type F16 = GGML_TYPE_F16, F32 = GGML_TYPE_F32;
    // CLIP-like linear: f16 weight x f32 activations
    run_mm(c, "mul_mat_f16_768x768_n77", rnd(c, F16, 768, 768, 1, 1, 0.02f, 1), rnd(c, F32, 768, 77, 1, 1, 1.0f, 2), dir);
    run_mm(c, "mul_mat_f16_3072x768_n77", rnd(c, F16, 3072, 768, 1, 1, 0.02f, 3), rnd(c, F32, 3072, 77, 1, 1, 1.0f, 4), dir);
    run_mm(c, "mul_mat_f16_320x320_n1024", rnd(c, F16, 320, 320, 1, 1, 0.05f, 5), rnd(c, F32, 320, 1024, 1, 1, 1.0f, 6), dir);
    // attention products, f32 x f32
    { struct ggml_tensor *kq = ggml_mul_mat(c, rnd(c, F32, 64, 77, 12, 1, 1.0f, 7), rnd(c, F32, 64, 77, 12, 1, 1.0f, 8));
      ggml_mul_mat_set_prec(kq, GGML_PREC_F32); run(c, "mul_mat_f32_kq_64_77x77x12", kq, dir); }
    // the cross-attention's second product: a sum over the 77 context tokens (not a
    // multiple of 8: the scalar tail of the dot product, where compile flags matter)
    run(c, "mul_mat_f32_kqv_77x40x8", ggml_mul_mat(c, rnd(c, F32, 77, 40, 8, 1, 1.0f, 39), rnd(c, F32, 77, 640, 8, 1, 0.1f, 40)), dir);
    run(c, "mul_mat_f32_kqv_1024x40x8", ggml_mul_mat(c, rnd(c, F32, 1024, 40, 8, 1, 1.0f, 9), rnd(c, F32, 1024, 1024, 8, 1, 0.03f, 10)), dir);
    // softmax: scale, then with a causal mask
    run(c, "soft_max_scale", ggml_soft_max_ext(c, rnd(c, F32, 77, 77, 12, 1, 3.0f, 11), NULL, 0.125f, 0.0f), dir);
    { struct ggml_tensor *m = ggml_new_tensor_2d(c, F32, 77, 77);
      for (int i = 0; i < 77; i++) for (int j = 0; j < 77; j++) ((float *)m->data)[i * 77 + j] = j > i ? -INFINITY : 0.0f;
      struct ggml_tensor *x = ggml_scale(c, rnd(c, F32, 77, 77, 12, 1, 3.0f, 12), 0.125f);
      run(c, "soft_max_causal", ggml_soft_max(c, ggml_add(c, x, m)), dir); }
    run(c, "norm_768", ggml_norm(c, rnd(c, F32, 768, 77, 1, 1, 2.0f, 13), 1e-5f), dir);
    run(c, "gelu_quick", ggml_gelu_quick(c, rnd(c, F32, 3072, 77, 1, 1, 2.0f, 14)), dir);
    run(c, "gelu", ggml_gelu(c, rnd(c, F32, 1280, 256, 1, 1, 2.0f, 15)), dir);
    run(c, "silu", ggml_silu(c, rnd(c, F32, 32, 32, 320, 1, 2.0f, 16)), dir);
    run(c, "group_norm32", ggml_group_norm(c, rnd(c, F32, 32, 32, 320, 1, 2.0f, 17), 32, 1e-6f), dir);
    run(c, "conv_2d_3x3_320", ggml_conv_2d(c, rnd(c, F16, 3, 3, 320, 320, 0.02f, 18), rnd(c, F32, 32, 32, 320, 1, 1.0f, 19), 1, 1, 1, 1, 1, 1), dir);
    run(c, "conv_2d_3x3_4to320", ggml_conv_2d(c, rnd(c, F16, 3, 3, 4, 320, 0.05f, 20), rnd(c, F32, 32, 32, 4, 1, 1.0f, 21), 1, 1, 1, 1, 1, 1), dir);
    run(c, "conv_2d_3x3_s2", ggml_conv_2d(c, rnd(c, F16, 3, 3, 320, 320, 0.02f, 22), rnd(c, F32, 32, 32, 320, 1, 1.0f, 23), 2, 2, 1, 1, 1, 1), dir);
    run(c, "upscale_nearest2", ggml_upscale(c, rnd(c, F32, 16, 16, 64, 1, 1.0f, 24), 2, GGML_SCALE_MODE_NEAREST), dir);
    { struct ggml_tensor *t = ggml_new_tensor_1d(c, F32, 2); ((float *)t->data)[0] = 999.0f; ((float *)t->data)[1] = 401.0f;
      run(c, "timestep_embedding_320", ggml_timestep_embedding(c, t, 320, 10000), dir); }
    run(c, "add_bcast", ggml_add(c, rnd(c, F32, 32, 32, 320, 1, 1.0f, 25), rnd(c, F32, 1, 1, 320, 1, 1.0f, 26)), dir);
    run(c, "cpy_f32_f16", ggml_cpy(c, rnd(c, F32, 4096, 64, 1, 1, 1.0f, 27), ggml_new_tensor_2d(c, F16, 4096, 64)), dir);
    // UNet-specific: our fused forms (`*_ourstyle`) beside the reference's written-out forms
    // (`*_refstyle`), so the comparison can pair ours-in-ours with the reference's-in-its.
    { struct ggml_tensor *h = rnd(c, F32, 2560, 256, 1, 1, 1.5f, 30);
      run(c, "geglu_ourstyle", ggml_geglu_swapped(c, h), dir);
      struct ggml_tensor *a = ggml_view_2d(c, h, 1280, 256, h->nb[1], 0);
      struct ggml_tensor *gt = ggml_cont(c, ggml_view_2d(c, h, 1280, 256, h->nb[1], 1280 * sizeof(float)));
      run(c, "geglu_refstyle", ggml_mul(c, a, ggml_gelu_inplace(c, gt)), dir); }
    { float sc = 1.0f / sqrtf(40.0f);
      struct ggml_tensor *k = rnd(c, F32, 40, 256, 8, 1, 1.0f, 31), *q = rnd(c, F32, 40, 256, 8, 1, 1.0f, 32);
      struct ggml_tensor *kq = ggml_mul_mat(c, k, q); ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
      run(c, "attn40_ourstyle", ggml_soft_max_ext(c, kq, NULL, sc, 0.0f), dir);
      struct ggml_tensor *kq2 = ggml_mul_mat(c, k, q); ggml_mul_mat_set_prec(kq2, GGML_PREC_F32);
      run(c, "attn40_refstyle", ggml_soft_max_inplace(c, ggml_scale_inplace(c, kq2, sc)), dir); }
    run(c, "conv_2d_3x3_1280", ggml_conv_2d(c, rnd(c, F16, 3, 3, 1280, 1280, 0.01f, 33), rnd(c, F32, 8, 8, 1280, 1, 1.0f, 34), 1, 1, 1, 1, 1, 1), dir);
    run(c, "concat_ch", ggml_concat(c, rnd(c, F32, 8, 8, 640, 1, 1.0f, 35), rnd(c, F32, 8, 8, 320, 1, 1.0f, 36), 2), dir);
    run_mm(c, "mul_mat_f16_768x320_ctx77", rnd(c, F16, 768, 320, 1, 1, 0.02f, 37), rnd(c, F32, 768, 77, 1, 1, 1.0f, 38), dir);
    return 0;
}
