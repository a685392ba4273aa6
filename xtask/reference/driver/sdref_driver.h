/*
 * sdref_driver: a small C ABI over stable-diffusion.cpp for the sdref tool.
 *
 * Only plain C types cross this boundary; the enums of sd.cpp are passed as
 * the strings its own CLI accepts (NULL = sd.cpp's default) and converted by
 * sd.cpp's str_to_* functions. Every function that can fail returns 0 on
 * success and non-zero on failure, writing a message into err[0..err_len).
 *
 * Tensors use ggml's axis order: ne[0] is the fastest-moving axis, so a
 * PyTorch tensor of shape [N, C, H, W] has ne = {W, H, C, N}; the data are
 * contiguous little-endian f32 in the same memory order as PyTorch's.
 */
#ifndef SDREF_DRIVER_H
#define SDREF_DRIVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sdref_ctx sdref_ctx;

typedef struct {
    const char* model_path;
    const char* diffusion_model_path;
    const char* vae_path;
    const char* clip_l_path;
    const char* clip_g_path;
    const char* t5xxl_path;
    const char* taesd_path;     /* tiny autoencoder decoding (and encoding) instead of the VAE */
    const char* wtype;          /* weight type name, e.g. "f16"; NULL: as in the file */
    const char* rng;            /* "cuda" | "std_default" | "cpu"; NULL: cuda */
    const char* sampler_rng;    /* NULL: same as rng */
    const char* backend;        /* runtime backend assignment; NULL: default */
    const char* params_backend; /* parameter backend assignment; NULL: default */
    int n_threads;              /* <= 0: number of physical cores */
    float max_vram;             /* GiB; 0 disables graph cutting */
    bool offload_to_cpu;        /* prepends "*=cpu" to params_backend, as the CLI does */
    bool clip_on_cpu;           /* prepends "te=cpu" to backend */
    bool vae_on_cpu;            /* prepends "vae=cpu" to backend */
    bool flash_attn;
    bool diffusion_flash_attn;
    bool diffusion_conv_direct;
    bool vae_conv_direct;
    bool enable_mmap;
    const char* lora_apply_mode; /* "auto" | "immediately" | "at_runtime"; NULL: immediately */
    const char* llm_path;        /* the LLM text encoder (--llm: Z-Image's Qwen3); NULL: none */
    const char* control_net_path; /* a ControlNet (--control-net); NULL: none */
    bool control_net_cpu;        /* prepends "controlnet=cpu" to backend */
} sdref_ctx_opts;

typedef struct {
    const char* prompt;
    const char* negative_prompt;
    int width;
    int height;
    int steps;
    int batch_count;
    int clip_skip;             /* <= 0: the model's default */
    float cfg_scale;
    float strength;            /* img2img only */
    int64_t seed;
    const char* sample_method; /* NULL: the model's default */
    const char* scheduler;     /* NULL: the model's default */
    const uint8_t* init_rgb;   /* NULL: txt2img; else width*height*3 bytes */
    bool vae_tiling;
    int lora_count;                 /* LoRA files applied (in the context's lora_apply_mode) */
    const char* const* lora_paths;  /* lora_count paths */
    const float* lora_multipliers;  /* lora_count multipliers */
    const uint8_t* mask_gray;       /* NULL: no mask (all 255, as the CLI passes); else width*height bytes */
    const uint8_t* control_rgb;     /* NULL: no control image; else control_width*control_height*3 bytes */
    int control_width;              /* of any size: the library resizes it to width x height */
    int control_height;
    float control_strength;
    const char* hires_upscaler;     /* NULL: no hires fix; else sd_hires_upscaler_name's name ("Latent", ...) */
    const char* hires_model_path;   /* the upscaler model of "Model"; NULL: none */
    float hires_scale;
    int hires_width;
    int hires_height;
    int hires_steps;
    float hires_denoising_strength;
    int hires_upscale_tile_size;
    int ref_count;                  /* reference images (-r), each RGB of its own size */
    const struct sdref_image_s* ref_images;
    bool auto_resize_ref_image;     /* the CLI's default (--disable-auto-resize-ref-image: false) */
    bool increase_ref_index;        /* --increase-ref-index */
    float slg_scale;                /* skip-layer guidance (--slg-scale; 0: off) */
    int skip_layer_count;           /* --skip-layers; 0: the CLI's default 7, 8, 9 */
    const int* skip_layers;
    float skip_layer_start;
    float skip_layer_end;
    float img_cfg_scale;            /* --img-cfg-scale; NaN: not set (the library's INFINITY) */
    float guidance;                 /* --guidance (FLUX distilled guidance; the CLI's default 3.5) */
} sdref_gen_opts;

typedef struct sdref_image_s {
    uint32_t width;
    uint32_t height;
    uint32_t channel;
    uint8_t* data;
} sdref_image;

typedef struct {
    float* data;
    int64_t ne[4];
    int n_dims;
} sdref_tensor;

typedef void (*sdref_log_cb)(int level, const char* text, void* data);
typedef void (*sdref_progress_cb)(int step, int steps, float seconds, void* data);

void sdref_set_callbacks(sdref_log_cb log_cb, sdref_progress_cb progress_cb, void* data);
const char* sdref_system_info(void);
const char* sdref_sdcpp_version(void);

sdref_ctx* sdref_ctx_new(const sdref_ctx_opts* opts, char* err, size_t err_len);
void sdref_ctx_free(sdref_ctx* ctx);

/* On success *out_images holds *out_count images; free them with sdref_images_free. */
int sdref_generate(sdref_ctx* ctx, const sdref_gen_opts* opts, sdref_image** out_images,
                   int* out_count, char* err, size_t err_len);
void sdref_images_free(sdref_image* images, int count);

/* The conditioning sd.cpp feeds the diffusion model for `prompt`
 * (c_crossattn), and the pooled vector (c_vector) where the model has one
 * (out_vector->data is NULL otherwise). */
int sdref_encode_text(sdref_ctx* ctx, const char* prompt, int clip_skip, int width, int height,
                      sdref_tensor* out_crossattn, sdref_tensor* out_vector, char* err,
                      size_t err_len);

/* One evaluation of the diffusion model on the raw model input x (already
 * scaled by c_in), the model timestep t (e.g. 999.0 for SD1), and context. y
 * may be NULL for a UNet without ADM; FLUX needs y (the pooled vector [1, 768]), takes
 * the sampler's t (sigma, scaled by 1000 inside) and `guidance` (ignored by UNets and by
 * FLUX-schnell). The output is the raw model output (eps, v or FLUX's flow). */
int sdref_diffusion(sdref_ctx* ctx, const sdref_tensor* x, float timestep,
                    const sdref_tensor* context, const sdref_tensor* y, float guidance,
                    sdref_tensor* out, char* err, size_t err_len);

/* VAE decode of `latent` to the decoder's raw output, in [-1, 1] nominally,
 * before sd.cpp maps it with clamp((v + 1) / 2, 0, 1) and converts to uint8.
 * latent_is_diffusion_space: the latent is what the sampler produces, and is
 * first mapped to the VAE's space exactly as sd.cpp's decode does (for SD1/2:
 * divided by 0.18215). */
int sdref_vae_decode(sdref_ctx* ctx, const sdref_tensor* latent, bool latent_is_diffusion_space,
                     sdref_tensor* out, char* err, size_t err_len);

void sdref_tensor_free(sdref_tensor* t);

/* T5 token ids for `prompt`, by sd.cpp's own T5UniGramTokenizer (the T5-XXL vocabulary, not
 * umT5). raw: T5UniGramTokenizer::encode of the whole prompt, nothing else (weights all 1).
 * Otherwise what FluxCLIPEmbedder::tokenize gives the T5 encoder: parse_prompt_attention,
 * encode of each fragment with its weight, then Tokenizer::pad_tokens(min_length = max_length =
 * chunk_len, overflow expansion): chunks of chunk_len ids, each ending in EOS, padded with 0
 * (FLUX's conditioner uses chunk_len 256). No model is needed. On success *out_ids and
 * *out_weights hold *out_len values; free them with sdref_t5_tokens_free. */
int sdref_t5_tokenize(const char* prompt, bool raw, size_t chunk_len, int32_t** out_ids,
                      float** out_weights, size_t* out_len, char* err, size_t err_len);
void sdref_t5_tokens_free(int32_t* ids, float* weights);

/* The raw T5-XXL encoder output of sd.cpp's T5Runner for `n_ids` token ids (one sequence, no
 * attention mask, as FLUX's conditioner runs each chunk), with the weights of the `--t5xxl`
 * file `t5xxl_path` read as sd.cpp reads that flag (prefix text_encoders.t5xxl.transformer.,
 * its name conversion, all 24 blocks required). out: ne = {4096, n_ids}. */
int sdref_t5_encode(const char* t5xxl_path, const int32_t* ids, size_t n_ids, int n_threads,
                    sdref_tensor* out, char* err, size_t err_len);


/* Qwen2 BPE token ids for `prompt`, by sd.cpp's own Qwen2Tokenizer. zimage false: the
 * tokenizer's encode of the whole prompt, nothing else (weights all 1). zimage true: what
 * LLMEmbedder::tokenize gives the LLM for Z-Image without reference images: the fragments
 * "<|im_start|>user\n" (weight 1), parse_prompt_attention of the prompt, and
 * "<|im_end|>\n<|im_start|>assistant\n" (weight 1), each encoded on its own, then
 * pad_tokens(0, 100000000) (no BOS/EOS, no padding). No model is needed. Free the arrays with
 * sdref_t5_tokens_free. */
int sdref_qwen2_tokenize(const char* prompt, bool zimage, int32_t** out_ids, float** out_weights,
                         size_t* out_len, char* err, size_t err_len);

/* Mistral BPE token ids for `prompt`, by sd.cpp's own MistralTokenizer. flux2 false: the
 * tokenizer's encode of the whole prompt (weights all 1). flux2 true: what LLMEmbedder gives
 * the LLM for FLUX.2 dev: its system prompt and "[INST]" (weight 1), parse_prompt_attention of
 * the prompt, "[/INST]" (weight 1), each encoded on its own, then pad_tokens(0, 100000000)
 * (BOS first, no padding). Free the arrays with sdref_t5_tokens_free. */
int sdref_mistral_tokenize(const char* prompt, bool flux2, int32_t** out_ids, float** out_weights,
                           size_t* out_len, char* err, size_t err_len);

/* The hidden states sd.cpp's LLMRunner (arch: 0 QWEN3, as Z-Image and FLUX.2 klein use it; 1
 * MISTRAL_SMALL_3_2, FLUX.2 dev's; 2 QWEN2_5_VL, Qwen-Image's) gives
 * for `n_ids` token ids with out_layers = {out_layer} (Z-Image: 35; a layer past the file's
 * depth gives the final norm's output), the causal mask LLMEmbedder builds, and the weights of
 * the `--llm` file `llm_path` read as sd.cpp reads that flag (prefix text_encoders.llm., its
 * name conversion). No token weights applied. out: ne = {hidden, n_ids}. */
int sdref_llm_encode(const char* llm_path, int arch, const int32_t* ids, size_t n_ids, int out_layer,
                     int n_threads, sdref_tensor* out, char* err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* SDREF_DRIVER_H */
