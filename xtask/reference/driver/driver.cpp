// sdref_driver: our C ABI over stable-diffusion.cpp (see sdref_driver.h).
//
// Why this file includes sd.cpp's src/stable-diffusion.cpp: the C API only
// offers whole generations, while parity checks need single components (text
// encoder, one diffusion-model call, VAE decode) evaluated by the very objects
// sd.cpp loaded, with its own settings. Those objects are public members of
// StableDiffusionGGML, a class defined in that .cpp file (no header declares
// it). Compiling the unmodified file inside this translation unit, and leaving
// it out of the static library (sdref-build.toml), gives us the class
// definition without copying or patching any sd.cpp source. Generation itself
// goes through the public C API only (new_sd_ctx, generate_image).

#include "src/stable-diffusion.cpp"

#include "sdref_driver.h"

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

struct sdref_ctx {
    sd_ctx_t* sd_ctx = nullptr;
};

namespace {

sdref_log_cb g_log_cb           = nullptr;
sdref_progress_cb g_progress_cb = nullptr;
void* g_cb_data                 = nullptr;

void log_trampoline(enum sd_log_level_t level, const char* text, void*) {
    if (g_log_cb != nullptr) {
        g_log_cb(static_cast<int>(level), text, g_cb_data);
    }
}

void progress_trampoline(int step, int steps, float seconds, void*) {
    if (g_progress_cb != nullptr) {
        g_progress_cb(step, steps, seconds, g_cb_data);
    }
}

void set_err(char* err, size_t err_len, const char* fmt, ...) {
    if (err == nullptr || err_len == 0) {
        return;
    }
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, err_len, fmt, args);
    va_end(args);
}

const char* opt_str(const char* s) {
    return s != nullptr ? s : "";
}

// Prepends `assignment` to a comma-separated backend spec, the way sd.cpp's
// CLI turns --offload-to-cpu / --clip-on-cpu / --vae-on-cpu into specs.
std::string prepend_assignment(const std::string& spec, const char* assignment) {
    return spec.empty() ? std::string(assignment) : std::string(assignment) + "," + spec;
}

bool parse_rng(const char* name, rng_type_t* out, const char* what, char* err, size_t err_len) {
    if (name == nullptr) {
        return true;
    }
    rng_type_t rng = str_to_rng_type(name);
    if (rng == RNG_TYPE_COUNT) {
        set_err(err, err_len, "unknown %s '%s' (accepted: std_default, cuda, cpu)", what, name);
        return false;
    }
    *out = rng;
    return true;
}

sd::Tensor<float> tensor_from_c(const sdref_tensor* t) {
    std::vector<int64_t> shape(t->ne, t->ne + t->n_dims);
    int64_t numel = 1;
    for (int64_t d : shape) {
        numel *= d;
    }
    std::vector<float> data(t->data, t->data + numel);
    return sd::Tensor<float>(std::move(shape), std::move(data));
}

bool tensor_to_c(const sd::Tensor<float>& src, sdref_tensor* dst, char* err, size_t err_len) {
    *dst = sdref_tensor{};
    if (src.dim() < 1 || src.dim() > 4) {
        set_err(err, err_len, "result tensor has %lld dims, expected 1..4", static_cast<long long>(src.dim()));
        return false;
    }
    size_t bytes = static_cast<size_t>(src.numel()) * sizeof(float);
    dst->data    = static_cast<float*>(malloc(bytes));
    if (dst->data == nullptr) {
        set_err(err, err_len, "out of memory copying a %zu-byte result", bytes);
        return false;
    }
    memcpy(dst->data, src.data(), bytes);
    dst->n_dims = static_cast<int>(src.dim());
    for (int i = 0; i < 4; i++) {
        dst->ne[i] = i < dst->n_dims ? src.shape()[i] : 1;
    }
    return true;
}

bool check_input(const sdref_tensor* t, const char* what, char* err, size_t err_len) {
    if (t == nullptr || t->data == nullptr || t->n_dims < 1 || t->n_dims > 4) {
        set_err(err, err_len, "%s: missing data or n_dims outside 1..4", what);
        return false;
    }
    for (int i = 0; i < t->n_dims; i++) {
        if (t->ne[i] <= 0) {
            set_err(err, err_len, "%s: axis %d has length %lld", what, i, static_cast<long long>(t->ne[i]));
            return false;
        }
    }
    return true;
}

// VAE::_compute is protected; naming it through a derived class yields a
// pointer to the base member, which may then be called on any VAE. This is
// the decoder's raw output, before VAE::decode's clamp((v + 1) / 2, 0, 1).
struct VaeRawDecode : VAE {
    static sd::Tensor<float> run(VAE* vae, int n_threads, const sd::Tensor<float>& z) {
        auto fn = &VaeRawDecode::_compute;
        return (vae->*fn)(n_threads, z, true);
    }
};

struct RunnerDone {
    GGMLRunner* runner = nullptr;
    ~RunnerDone() {
        if (runner != nullptr) {
            runner->runner_done();
        }
    }
};

}  // namespace

extern "C" {

void sdref_set_callbacks(sdref_log_cb log_cb, sdref_progress_cb progress_cb, void* data) {
    g_log_cb      = log_cb;
    g_progress_cb = progress_cb;
    g_cb_data     = data;
    sd_set_log_callback(log_trampoline, nullptr);
    sd_set_progress_callback(progress_trampoline, nullptr);
}

const char* sdref_system_info(void) {
    return sd_get_system_info();
}

const char* sdref_sdcpp_version(void) {
    return sd_version();
}

sdref_ctx* sdref_ctx_new(const sdref_ctx_opts* o, char* err, size_t err_len) {
    if (o == nullptr) {
        set_err(err, err_len, "no options");
        return nullptr;
    }
    sd_ctx_params_t p;
    sd_ctx_params_init(&p);
    p.lora_apply_mode = LORA_APPLY_IMMEDIATELY;
    if (o->lora_apply_mode != nullptr) {
        p.lora_apply_mode = str_to_lora_apply_mode(o->lora_apply_mode);
        if (p.lora_apply_mode == LORA_APPLY_MODE_COUNT) {
            set_err(err, err_len, "unknown LoRA apply mode '%s' (auto, immediately, at_runtime)", o->lora_apply_mode);
            return nullptr;
        }
    }

    if (o->wtype != nullptr) {
        p.wtype = str_to_sd_type(o->wtype);
        if (p.wtype == SD_TYPE_COUNT) {
            set_err(err, err_len, "unknown weight type '%s' (examples: f32, f16, q8_0, q4_0, q4_K)", o->wtype);
            return nullptr;
        }
    }
    if (!parse_rng(o->rng, &p.rng_type, "rng", err, err_len) ||
        !parse_rng(o->sampler_rng, &p.sampler_rng_type, "sampler rng", err, err_len)) {
        return nullptr;
    }

    std::string backend        = opt_str(o->backend);
    std::string params_backend = opt_str(o->params_backend);
    if (o->offload_to_cpu) {
        params_backend = prepend_assignment(params_backend, "*=cpu");
    }
    if (o->clip_on_cpu) {
        backend = prepend_assignment(backend, "te=cpu");
    }
    if (o->vae_on_cpu) {
        backend = prepend_assignment(backend, "vae=cpu");
    }
    if (o->control_net_cpu) {
        backend = prepend_assignment(backend, "controlnet=cpu");
    }

    // sd.cpp's CLI passes "" (never NULL) for unset paths; do the same.
    p.model_path           = opt_str(o->model_path);
    p.diffusion_model_path = opt_str(o->diffusion_model_path);
    p.vae_path             = opt_str(o->vae_path);
    p.clip_l_path          = opt_str(o->clip_l_path);
    p.clip_g_path          = opt_str(o->clip_g_path);
    p.t5xxl_path           = opt_str(o->t5xxl_path);
    p.clip_vision_path                = "";
    p.llm_path                        = opt_str(o->llm_path);
    p.llm_vision_path                 = "";
    p.high_noise_diffusion_model_path = "";
    p.uncond_diffusion_model_path     = "";
    p.embeddings_connectors_path      = "";
    p.audio_vae_path                  = "";
    p.taesd_path                      = opt_str(o->taesd_path);
    p.control_net_path                = opt_str(o->control_net_path);
    p.photo_maker_path                = "";
    p.tensor_type_rules               = "";
    p.n_threads                       = o->n_threads > 0 ? o->n_threads : sd_get_num_physical_cores();
    p.enable_mmap                     = o->enable_mmap;
    p.flash_attn                      = o->flash_attn;
    p.diffusion_flash_attn            = o->diffusion_flash_attn;
    p.diffusion_conv_direct           = o->diffusion_conv_direct;
    p.vae_conv_direct                 = o->vae_conv_direct;
    p.max_vram                        = o->max_vram;
    p.backend                         = backend.c_str();
    p.params_backend                  = params_backend.c_str();

    sd_ctx_t* sd_ctx = new_sd_ctx(&p);
    if (sd_ctx == nullptr) {
        set_err(err, err_len, "new_sd_ctx failed (sd.cpp's ERROR log lines above say why)");
        return nullptr;
    }
    auto* ctx   = new sdref_ctx;
    ctx->sd_ctx = sd_ctx;
    return ctx;
}

void sdref_ctx_free(sdref_ctx* ctx) {
    if (ctx == nullptr) {
        return;
    }
    free_sd_ctx(ctx->sd_ctx);
    delete ctx;
}

int sdref_generate(sdref_ctx* ctx, const sdref_gen_opts* o, sdref_image** out_images,
                   int* out_count, char* err, size_t err_len) {
    *out_images = nullptr;
    *out_count  = 0;
    sd_img_gen_params_t g;
    sd_img_gen_params_init(&g);

    if (o->sample_method != nullptr) {
        g.sample_params.sample_method = str_to_sample_method(o->sample_method);
        if (g.sample_params.sample_method == SAMPLE_METHOD_COUNT) {
            set_err(err, err_len, "unknown sampling method '%s'", o->sample_method);
            return 1;
        }
    }
    if (o->scheduler != nullptr) {
        g.sample_params.scheduler = str_to_scheduler(o->scheduler);
        if (g.sample_params.scheduler == SCHEDULER_COUNT) {
            set_err(err, err_len, "unknown scheduler '%s'", o->scheduler);
            return 1;
        }
    }
    // The CLI always hands its default skip layers over; with the default
    // slg scale of 0 they have no effect, but keep the parameters identical.
    static int skip_layers[]           = {7, 8, 9};
    g.sample_params.guidance.slg.layers      = skip_layers;
    g.sample_params.guidance.slg.layer_count = 3;
    if (o->skip_layer_count > 0) {
        g.sample_params.guidance.slg.layers      = const_cast<int*>(o->skip_layers);
        g.sample_params.guidance.slg.layer_count = (size_t)o->skip_layer_count;
    }
    g.sample_params.guidance.slg.scale       = o->slg_scale;
    g.sample_params.guidance.slg.layer_start = o->skip_layer_start;
    g.sample_params.guidance.slg.layer_end   = o->skip_layer_end;
    if (!std::isnan(o->img_cfg_scale)) {
        g.sample_params.guidance.img_cfg = o->img_cfg_scale;
    }
    g.sample_params.guidance.txt_cfg         = o->cfg_scale;
    g.sample_params.guidance.distilled_guidance = o->guidance;
    g.sample_params.sample_steps             = o->steps;

    g.prompt                     = opt_str(o->prompt);
    g.negative_prompt            = opt_str(o->negative_prompt);
    g.clip_skip                  = o->clip_skip;
    g.width                      = o->width;
    g.height                     = o->height;
    g.strength                   = o->strength;
    g.seed                       = o->seed;
    g.batch_count                = o->batch_count;
    std::vector<sd_lora_t> loras;
    for (int i = 0; i < o->lora_count; i++) {
        sd_lora_t l;
        l.is_high_noise = false;
        l.multiplier    = o->lora_multipliers[i];
        l.path          = o->lora_paths[i];
        loras.push_back(l);
    }
    g.loras      = loras.empty() ? nullptr : loras.data();
    g.lora_count = (uint32_t)loras.size();
    g.vae_tiling_params.enabled  = o->vae_tiling;
    if (o->init_rgb != nullptr) {
        g.init_image = sd_image_t{static_cast<uint32_t>(o->width), static_cast<uint32_t>(o->height), 3,
                                  const_cast<uint8_t*>(o->init_rgb)};
    }
    if (o->mask_gray != nullptr) {
        g.mask_image = sd_image_t{static_cast<uint32_t>(o->width), static_cast<uint32_t>(o->height), 1,
                                  const_cast<uint8_t*>(o->mask_gray)};
    }
    if (o->control_rgb != nullptr) {
        g.control_image = sd_image_t{static_cast<uint32_t>(o->control_width), static_cast<uint32_t>(o->control_height), 3,
                                     const_cast<uint8_t*>(o->control_rgb)};
        g.control_strength = o->control_strength;
    }
    std::vector<sd_image_t> refs;
    for (int i = 0; i < o->ref_count; i++) {
        const sdref_image& r = o->ref_images[i];
        refs.push_back(sd_image_t{r.width, r.height, r.channel, r.data});
    }
    g.ref_images            = refs.empty() ? nullptr : refs.data();
    g.ref_images_count      = (int)refs.size();
    g.auto_resize_ref_image = o->auto_resize_ref_image;
    g.increase_ref_index    = o->increase_ref_index;
    if (o->hires_upscaler != nullptr) {
        g.hires.enabled  = true;
        g.hires.upscaler = str_to_sd_hires_upscaler(o->hires_upscaler);
        if (g.hires.upscaler == SD_HIRES_UPSCALER_COUNT) {
            set_err(err, err_len, "unknown hires upscaler '%s'", o->hires_upscaler);
            return 1;
        }
        g.hires.model_path         = o->hires_model_path;
        g.hires.scale              = o->hires_scale;
        g.hires.target_width       = o->hires_width;
        g.hires.target_height      = o->hires_height;
        g.hires.steps              = o->hires_steps;
        g.hires.denoising_strength = o->hires_denoising_strength;
        g.hires.upscale_tile_size  = o->hires_upscale_tile_size;
    }

    sd_image_t* images = generate_image(ctx->sd_ctx, &g);
    if (images == nullptr) {
        set_err(err, err_len, "generate_image failed (sd.cpp's ERROR log lines above say why)");
        return 1;
    }
    static_assert(sizeof(sd_image_t) == sizeof(sdref_image), "sd_image_t and sdref_image differ");
    *out_images = reinterpret_cast<sdref_image*>(images);
    *out_count  = o->batch_count;
    return 0;
}

void sdref_images_free(sdref_image* images, int count) {
    free_sd_images(reinterpret_cast<sd_image_t*>(images), count);
}

int sdref_encode_text(sdref_ctx* ctx, const char* prompt, int clip_skip, int width, int height,
                      sdref_tensor* out_crossattn, sdref_tensor* out_vector, char* err,
                      size_t err_len) {
    *out_crossattn = sdref_tensor{};
    *out_vector    = sdref_tensor{};
    StableDiffusionGGML* sd = ctx->sd_ctx->sd;
    if (sd->cond_stage_model == nullptr) {
        set_err(err, err_len, "the loaded model has no text encoder");
        return 1;
    }
    // As prepare_image_generation_embeds does for the positive prompt.
    ConditionerRunnerDoneOnExit done{sd->cond_stage_model.get()};
    std::vector<sd::Tensor<float>> no_ref_images;
    ConditionerParams params;
    params.text            = opt_str(prompt);
    params.clip_skip       = clip_skip;
    params.width           = width;
    params.height          = height;
    params.zero_out_masked = false;
    params.ref_images      = &no_ref_images;
    SDCondition cond       = sd->cond_stage_model->get_learned_condition(sd->n_threads, params);
    if (cond.c_crossattn.empty()) {
        set_err(err, err_len, "get_learned_condition returned no c_crossattn");
        return 1;
    }
    if (!tensor_to_c(cond.c_crossattn, out_crossattn, err, err_len)) {
        return 1;
    }
    if (!cond.c_vector.empty() && !tensor_to_c(cond.c_vector, out_vector, err, err_len)) {
        sdref_tensor_free(out_crossattn);
        return 1;
    }
    return 0;
}

int sdref_diffusion(sdref_ctx* ctx, const sdref_tensor* x, float timestep,
                    const sdref_tensor* context, const sdref_tensor* y, float guidance,
                    sdref_tensor* out, char* err, size_t err_len) {
    *out                    = sdref_tensor{};
    StableDiffusionGGML* sd = ctx->sd_ctx->sd;
    bool flux               = sd_version_is_flux(sd->version);
    if (!sd_version_is_unet(sd->version) && !flux) {
        set_err(err, err_len,
                "diffusion dumps support UNet models (SD1.x/SD2.x/SDXL) and FLUX only; this model is version %d",
                static_cast<int>(sd->version));
        return 1;
    }
    if (flux && y == nullptr) {
        set_err(err, err_len, "a FLUX evaluation needs y, the pooled text vector [1, 768]");
        return 1;
    }
    if (!check_input(x, "latent", err, err_len) || !check_input(context, "context", err, err_len) ||
        (y != nullptr && !check_input(y, "y", err, err_len))) {
        return 1;
    }
    sd::Tensor<float> x_t = tensor_from_c(x);
    sd::Tensor<float> c   = tensor_from_c(context);
    sd::Tensor<float> y_t = y != nullptr ? tensor_from_c(y) : sd::Tensor<float>();
    int64_t batch         = x->n_dims == 4 ? x->ne[3] : 1;
    sd::Tensor<float> timesteps({batch}, std::vector<float>(static_cast<size_t>(batch), timestep));

    // As the sampler's run_condition does for UNet models, without controls; for FLUX with
    // the guidance tensor (one value per sample) and no skipped layers. FLUX takes the
    // sampler's t (sigma) and scales it by 1000 itself.
    RunnerDone done{sd->diffusion_model.get()};
    std::vector<sd::Tensor<float>> no_controls;
    sd::Tensor<float> guidance_t({batch}, std::vector<float>(static_cast<size_t>(batch), guidance));
    DiffusionParams params;
    params.x         = &x_t;
    params.timesteps = &timesteps;
    params.context   = &c;
    params.y         = y_t.empty() ? nullptr : &y_t;
    if (flux) {
        params.extra = FluxDiffusionExtra{&guidance_t, nullptr};
    } else {
        params.extra = UNetDiffusionExtra{-1, &no_controls, 0.f};
    }
    sd::Tensor<float> result = sd->diffusion_model->compute(sd->n_threads, params);
    sd->diffusion_model->free_compute_buffer();
    if (result.empty()) {
        set_err(err, err_len, "diffusion model compute failed (see sd.cpp's log)");
        return 1;
    }
    return tensor_to_c(result, out, err, err_len) ? 0 : 1;
}

int sdref_vae_decode(sdref_ctx* ctx, const sdref_tensor* latent, bool latent_is_diffusion_space,
                     sdref_tensor* out, char* err, size_t err_len) {
    *out                    = sdref_tensor{};
    StableDiffusionGGML* sd = ctx->sd_ctx->sd;
    if (sd->first_stage_model == nullptr) {
        set_err(err, err_len, "the loaded model has no VAE");
        return 1;
    }
    if (!check_input(latent, "latent", err, err_len)) {
        return 1;
    }
    sd::Tensor<float> z = tensor_from_c(latent);
    if (latent_is_diffusion_space) {
        z = sd->first_stage_model->diffusion_to_vae_latents(z);
    }
    RunnerDone done{sd->first_stage_model.get()};
    sd::Tensor<float> result = VaeRawDecode::run(sd->first_stage_model.get(), sd->n_threads, z);
    sd->first_stage_model->free_compute_buffer();
    if (result.empty()) {
        set_err(err, err_len, "vae decode compute failed (see sd.cpp's log)");
        return 1;
    }
    return tensor_to_c(result, out, err, err_len) ? 0 : 1;
}

void sdref_tensor_free(sdref_tensor* t) {
    if (t != nullptr) {
        free(t->data);
        t->data = nullptr;
    }
}

int sdref_t5_tokenize(const char* prompt, bool raw, size_t chunk_len, int32_t** out_ids,
                      float** out_weights, size_t* out_len, char* err, size_t err_len) {
    *out_ids     = nullptr;
    *out_weights = nullptr;
    *out_len     = 0;
    if (prompt == nullptr) {
        set_err(err, err_len, "prompt is NULL");
        return 1;
    }
    if (!raw && chunk_len < 2) {
        set_err(err, err_len, "chunk_len %zu is too short (EOS and one token need 2)", chunk_len);
        return 1;
    }
    // One tokenizer per process: its constructor parses the embedded tokenizer.json.
    static T5UniGramTokenizer tokenizer(false);
    std::vector<int> ids;
    std::vector<float> weights;
    if (raw) {
        ids = tokenizer.encode(prompt);
        weights.assign(ids.size(), 1.0f);
    } else {
        // FluxCLIPEmbedder::tokenize's T5 half, step for step.
        for (const auto& item : parse_prompt_attention(prompt)) {
            std::vector<int> curr = tokenizer.encode(item.first);
            ids.insert(ids.end(), curr.begin(), curr.end());
            weights.insert(weights.end(), curr.size(), item.second);
        }
        tokenizer.pad_tokens(ids, &weights, nullptr, chunk_len, chunk_len, true);
    }
    size_t n  = ids.size();
    auto* pid = static_cast<int32_t*>(malloc(sizeof(int32_t) * (n == 0 ? 1 : n)));
    auto* pw  = static_cast<float*>(malloc(sizeof(float) * (n == 0 ? 1 : n)));
    if (pid == nullptr || pw == nullptr) {
        free(pid);
        free(pw);
        set_err(err, err_len, "out of memory for %zu tokens", n);
        return 1;
    }
    for (size_t i = 0; i < n; i++) {
        pid[i] = ids[i];
        pw[i]  = weights[i];
    }
    *out_ids     = pid;
    *out_weights = pw;
    *out_len     = n;
    return 0;
}

void sdref_t5_tokens_free(int32_t* ids, float* weights) {
    free(ids);
    free(weights);
}

int sdref_t5_encode(const char* t5xxl_path, const int32_t* ids, size_t n_ids, int n_threads,
                    sdref_tensor* out, char* err, size_t err_len) {
    *out = sdref_tensor{};
    if (t5xxl_path == nullptr || ids == nullptr || n_ids == 0) {
        set_err(err, err_len, "t5 encode needs a file and at least one token id");
        return 1;
    }
    // One loaded T5 per process, kept until exit and never destroyed: ModelManager's
    // destructor touches the parameter tensors of the runners it serves, which the runner's
    // own destructor has freed by then (a crash seen here), and reloading 5-10 GB per chunk
    // would be slow anyway.
    struct LoadedT5 {
        std::string path;
        ggml_backend_t backend = nullptr;
        std::shared_ptr<ModelManager> manager;
        T5Runner* runner = nullptr;
    };
    static LoadedT5* loaded = nullptr;
    const std::string prefix = "text_encoders.t5xxl.transformer";
    if (loaded != nullptr && loaded->path != t5xxl_path) {
        set_err(err, err_len, "this process already loaded T5 from '%s'", loaded->path.c_str());
        return 1;
    }
    if (loaded == nullptr) {
        ggml_backend_t backend = sd_backend_cpu_init();
        if (backend == nullptr) {
            set_err(err, err_len, "cannot start sd.cpp's CPU backend");
            return 1;
        }
        // The way sd.cpp loads --t5xxl (new_sd_ctx: init_from_file with this prefix, then
        // the name conversion) and registers a runner's parameters for lazy loading.
        auto manager        = std::make_shared<ModelManager>();
        ModelLoader& loader = manager->loader();
        if (!loader.init_from_file_and_convert_name(t5xxl_path, prefix + ".")) {
            set_err(err, err_len, "sd.cpp cannot read '%s' as a T5 file", t5xxl_path);
            return 1;
        }
        auto* runner = new T5Runner(backend, loader.get_tensor_storage_map(), prefix, false, manager);
        if (!manager->register_runner_params("t5", *runner, prefix, ModelManager::ResidencyMode::ParamBackend,
                                             backend, backend) ||
            !manager->validate_registered_tensors()) {
            set_err(err, err_len, "sd.cpp's T5 runner cannot take the tensors of '%s' (see its log)", t5xxl_path);
            return 1;
        }
        loaded = new LoadedT5{t5xxl_path, backend, manager, runner};
    }
    std::vector<int32_t> v(ids, ids + n_ids);
    sd::Tensor<int32_t> input({static_cast<int64_t>(n_ids)}, v);
    // Parameters stay loaded between chunks (free_compute_params = false).
    sd::Tensor<float> hidden = loaded->runner->compute(n_threads, input, sd::Tensor<float>(), false, true, false);
    if (hidden.empty()) {
        set_err(err, err_len, "sd.cpp's T5 compute failed (see its log)");
        return 1;
    }
    return tensor_to_c(hidden, out, err, err_len) ? 0 : 1;
}


// The ids and weights an LLM conditioner feeds its model: `encode` of the whole prompt (no
// template: weights all 1), or LLMEmbedder's tokenize: the template's prefix (weight 1), the
// prompt's parse_prompt_attention fragments and the suffix (weight 1), each encoded on its own,
// then pad_tokens(0, 100000000) (BOS where the tokenizer adds one, no padding). The arrays are
// malloc'd for sdref_t5_tokens_free.
static int llm_tokenize(BPETokenizer& tokenizer, const char* prompt, const char* prefix, const char* suffix,
                        int32_t** out_ids, float** out_weights, size_t* out_len, char* err, size_t err_len) {
    *out_ids     = nullptr;
    *out_weights = nullptr;
    *out_len     = 0;
    if (prompt == nullptr) {
        set_err(err, err_len, "prompt is NULL");
        return 1;
    }
    std::vector<int> ids;
    std::vector<float> weights;
    if (prefix == nullptr) {
        ids = tokenizer.encode(prompt);
        weights.assign(ids.size(), 1.0f);
    } else {
        std::vector<std::pair<std::string, float>> parts;
        parts.emplace_back(prefix, 1.f);
        for (const auto& item : parse_prompt_attention(prompt)) {
            parts.push_back(item);
        }
        parts.emplace_back(suffix, 1.f);
        for (const auto& item : parts) {
            std::vector<int> curr = tokenizer.encode(item.first, nullptr);
            ids.insert(ids.end(), curr.begin(), curr.end());
            weights.insert(weights.end(), curr.size(), item.second);
        }
        std::vector<float> mask;
        tokenizer.pad_tokens(ids, &weights, &mask, 0, 100000000);
    }
    size_t n  = ids.size();
    auto* pid = static_cast<int32_t*>(malloc(sizeof(int32_t) * (n == 0 ? 1 : n)));
    auto* pw  = static_cast<float*>(malloc(sizeof(float) * (n == 0 ? 1 : n)));
    if (pid == nullptr || pw == nullptr) {
        free(pid);
        free(pw);
        set_err(err, err_len, "out of memory for %zu tokens", n);
        return 1;
    }
    for (size_t i = 0; i < n; i++) {
        pid[i] = ids[i];
        pw[i]  = weights[i];
    }
    *out_ids     = pid;
    *out_weights = pw;
    *out_len     = n;
    return 0;
}

int sdref_qwen2_tokenize(const char* prompt, bool zimage, int32_t** out_ids, float** out_weights,
                         size_t* out_len, char* err, size_t err_len) {
    // One tokenizer per process: its constructor parses the embedded merges. Z-Image without
    // reference images (LLMEmbedder::get_learned_condition).
    static Qwen2Tokenizer tokenizer;
    return llm_tokenize(tokenizer, prompt, zimage ? "<|im_start|>user\n" : nullptr,
                        "<|im_end|>\n<|im_start|>assistant\n", out_ids, out_weights, out_len, err, err_len);
}

int sdref_mistral_tokenize(const char* prompt, bool flux2, int32_t** out_ids, float** out_weights,
                           size_t* out_len, char* err, size_t err_len) {
    // One tokenizer per process: its constructor parses the embedded vocabulary and merges.
    // FLUX.2 dev (LLMEmbedder::get_learned_condition for VERSION_FLUX2).
    static MistralTokenizer tokenizer;
    const char* prefix =
        "[SYSTEM_PROMPT]You are an AI that reasons about image descriptions. You give structured responses "
        "focusing on object relationships, object\nattribution and actions without speculation.[/SYSTEM_PROMPT][INST]";
    return llm_tokenize(tokenizer, prompt, flux2 ? prefix : nullptr, "[/INST]", out_ids, out_weights, out_len, err,
                        err_len);
}

int sdref_llm_encode(const char* llm_path, int arch, const int32_t* ids, size_t n_ids, int out_layer,
                     int n_threads, sdref_tensor* out, char* err, size_t err_len) {
    *out = sdref_tensor{};
    if (llm_path == nullptr || ids == nullptr || n_ids == 0) {
        set_err(err, err_len, "llm encode needs a file and at least one token id");
        return 1;
    }
    // One loaded LLM per process, never destroyed (see sdref_t5_encode).
    struct LoadedLLM {
        std::string path;
        ggml_backend_t backend = nullptr;
        std::shared_ptr<ModelManager> manager;
        LLM::LLMRunner* runner = nullptr;
    };
    static LoadedLLM* loaded = nullptr;
    const std::string prefix = "text_encoders.llm";
    if (loaded != nullptr && loaded->path != llm_path) {
        set_err(err, err_len, "this process already loaded an LLM from '%s'", loaded->path.c_str());
        return 1;
    }
    if (loaded == nullptr) {
        ggml_backend_t backend = sd_backend_cpu_init();
        if (backend == nullptr) {
            set_err(err, err_len, "cannot start sd.cpp's CPU backend");
            return 1;
        }
        auto manager        = std::make_shared<ModelManager>();
        ModelLoader& loader = manager->loader();
        if (!loader.init_from_file_and_convert_name(llm_path, prefix + ".")) {
            set_err(err, err_len, "sd.cpp cannot read '%s' as an LLM file", llm_path);
            return 1;
        }
        const LLM::LLMArch which = arch == 1   ? LLM::LLMArch::MISTRAL_SMALL_3_2
                                   : arch == 2 ? LLM::LLMArch::QWEN2_5_VL
                                               : LLM::LLMArch::QWEN3;
        auto* runner = new LLM::LLMRunner(which, backend, loader.get_tensor_storage_map(), prefix, false, manager);
        if (!manager->register_runner_params("llm", *runner, prefix, ModelManager::ResidencyMode::ParamBackend,
                                             backend, backend) ||
            !manager->validate_registered_tensors()) {
            set_err(err, err_len, "sd.cpp's LLM runner cannot take the tensors of '%s' (see its log)", llm_path);
            return 1;
        }
        loaded = new LoadedLLM{llm_path, backend, manager, runner};
    }
    std::vector<int32_t> v(ids, ids + n_ids);
    sd::Tensor<int32_t> input({static_cast<int64_t>(n_ids)}, v);
    // LLMEmbedder::encode_prompt's mask: all tokens real (no padding), causal.
    const size_t n                     = n_ids;
    const float masked_attention_value = -std::numeric_limits<float>::max() / 4.0f;
    sd::Tensor<float> mask({static_cast<int64_t>(n), static_cast<int64_t>(n)});
    for (size_t i1 = 0; i1 < n; ++i1) {
        for (size_t i0 = 0; i0 < n; ++i0) {
            mask[static_cast<int64_t>(i0 + n * i1)] = i0 > i1 ? masked_attention_value : 0.0f;
        }
    }
    std::set<int> out_layers = {out_layer};
    sd::Tensor<float> hidden = loaded->runner->compute(n_threads, input, mask, {}, out_layers, false, false, true, false);
    if (hidden.empty()) {
        set_err(err, err_len, "sd.cpp's LLM compute failed (see its log)");
        return 1;
    }
    return tensor_to_c(hidden, out, err, err_len) ? 0 : 1;
}

}  // extern "C"
