//! Safe wrappers over our C++ driver's C ABI (driver/sdref_driver.h).
//!
//! Only this module holds `unsafe`. The driver owns sd.cpp; Rust sees an opaque
//! context, plain option structs whose strings live in `CString`s kept alive
//! for the duration of each call, and results it copies out before freeing.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr;

#[repr(C)]
struct RawCtx {
    _private: [u8; 0],
}

#[repr(C)]
struct RawCtxOpts {
    model_path: *const c_char,
    diffusion_model_path: *const c_char,
    vae_path: *const c_char,
    clip_l_path: *const c_char,
    clip_g_path: *const c_char,
    t5xxl_path: *const c_char,
    taesd_path: *const c_char,
    wtype: *const c_char,
    rng: *const c_char,
    sampler_rng: *const c_char,
    backend: *const c_char,
    params_backend: *const c_char,
    n_threads: c_int,
    max_vram: f32,
    offload_to_cpu: bool,
    clip_on_cpu: bool,
    vae_on_cpu: bool,
    flash_attn: bool,
    diffusion_flash_attn: bool,
    diffusion_conv_direct: bool,
    vae_conv_direct: bool,
    enable_mmap: bool,
    lora_apply_mode: *const c_char,
    llm_path: *const c_char,
    control_net_path: *const c_char,
    control_net_cpu: bool,
}

#[repr(C)]
struct RawGenOpts {
    prompt: *const c_char,
    negative_prompt: *const c_char,
    width: c_int,
    height: c_int,
    steps: c_int,
    batch_count: c_int,
    clip_skip: c_int,
    cfg_scale: f32,
    strength: f32,
    seed: i64,
    sample_method: *const c_char,
    scheduler: *const c_char,
    init_rgb: *const u8,
    vae_tiling: bool,
    lora_count: c_int,
    lora_paths: *const *const c_char,
    lora_multipliers: *const f32,
    mask_gray: *const u8,
    control_rgb: *const u8,
    control_width: c_int,
    control_height: c_int,
    control_strength: f32,
    hires_upscaler: *const c_char,
    hires_model_path: *const c_char,
    hires_scale: f32,
    hires_width: c_int,
    hires_height: c_int,
    hires_steps: c_int,
    hires_denoising_strength: f32,
    hires_upscale_tile_size: c_int,
    ref_count: c_int,
    ref_images: *const RawImage,
    auto_resize_ref_image: bool,
    increase_ref_index: bool,
    slg_scale: f32,
    skip_layer_count: c_int,
    skip_layers: *const c_int,
    skip_layer_start: f32,
    skip_layer_end: f32,
    img_cfg_scale: f32,
    guidance: f32,
}

#[repr(C)]
struct RawImage {
    width: u32,
    height: u32,
    channel: u32,
    data: *mut u8,
}

#[repr(C)]
struct RawTensor {
    data: *mut f32,
    ne: [i64; 4],
    n_dims: c_int,
}

#[repr(C)]
struct RawUpscaler {
    _private: [u8; 0],
}

type LogCb = extern "C" fn(level: c_int, text: *const c_char, data: *mut c_void);
type ProgressCb = extern "C" fn(step: c_int, steps: c_int, seconds: f32, data: *mut c_void);

// sd.cpp's own C API (include/stable-diffusion.h), in libstable-diffusion.a.
extern "C" {
    fn new_upscaler_ctx(
        esrgan_path: *const c_char,
        direct: bool,
        n_threads: c_int,
        tile_size: c_int,
        backend: *const c_char,
        params_backend: *const c_char,
    ) -> *mut RawUpscaler;
    fn free_upscaler_ctx(ctx: *mut RawUpscaler);
    fn upscale(ctx: *mut RawUpscaler, input_image: RawImage, upscale_factor: u32) -> RawImage;
    fn get_upscale_factor(ctx: *mut RawUpscaler) -> c_int;
    fn free(p: *mut c_void);
    fn preprocess_canny(image: RawImage, high: f32, low: f32, weak: f32, strong: f32, inverse: bool) -> bool;
}

/// sd.cpp's `preprocess_canny` on an RGB8 image of `width x height`, in place, with the
/// thresholds and levels given.
#[allow(clippy::too_many_arguments)]
pub fn canny(
    rgb: &mut [u8],
    width: u32,
    height: u32,
    (high, low, weak, strong): (f32, f32, f32, f32),
    inverse: bool,
) -> Result<(), String> {
    if rgb.len() != width as usize * height as usize * 3 {
        return Err(format!("{} bytes for a {width}x{height} RGB image", rgb.len()));
    }
    let img = RawImage { width, height, channel: 3, data: rgb.as_mut_ptr() };
    // SAFETY: `img` points at `rgb`, `width * height * 3` writable bytes (checked above), alive for
    // the call; sd.cpp writes the edges back in place and keeps no pointer.
    if unsafe { preprocess_canny(img, high, low, weak, strong, inverse) } {
        Ok(())
    } else {
        Err("preprocess_canny failed".into())
    }
}

extern "C" {
    fn sdref_set_callbacks(log_cb: Option<LogCb>, progress_cb: Option<ProgressCb>, data: *mut c_void);
    fn sdref_system_info() -> *const c_char;
    fn sdref_sdcpp_version() -> *const c_char;
    fn sdref_ctx_new(opts: *const RawCtxOpts, err: *mut c_char, err_len: usize) -> *mut RawCtx;
    fn sdref_ctx_free(ctx: *mut RawCtx);
    fn sdref_generate(
        ctx: *mut RawCtx,
        opts: *const RawGenOpts,
        out_images: *mut *mut RawImage,
        out_count: *mut c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn sdref_images_free(images: *mut RawImage, count: c_int);
    fn sdref_encode_text(
        ctx: *mut RawCtx,
        prompt: *const c_char,
        clip_skip: c_int,
        width: c_int,
        height: c_int,
        out_crossattn: *mut RawTensor,
        out_vector: *mut RawTensor,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn sdref_diffusion(
        ctx: *mut RawCtx,
        x: *const RawTensor,
        timestep: f32,
        context: *const RawTensor,
        y: *const RawTensor,
        guidance: f32,
        out: *mut RawTensor,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn sdref_vae_decode(
        ctx: *mut RawCtx,
        latent: *const RawTensor,
        latent_is_diffusion_space: bool,
        out: *mut RawTensor,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn sdref_tensor_free(t: *mut RawTensor);
    fn sdref_t5_tokenize(
        prompt: *const c_char,
        raw: bool,
        chunk_len: usize,
        out_ids: *mut *mut i32,
        out_weights: *mut *mut f32,
        out_len: *mut usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn sdref_t5_tokens_free(ids: *mut i32, weights: *mut f32);
    fn sdref_qwen2_tokenize(
        prompt: *const c_char,
        zimage: bool,
        out_ids: *mut *mut i32,
        out_weights: *mut *mut f32,
        out_len: *mut usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn sdref_mistral_tokenize(
        prompt: *const c_char,
        flux2: bool,
        out_ids: *mut *mut i32,
        out_weights: *mut *mut f32,
        out_len: *mut usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn sdref_llm_encode(
        llm_path: *const c_char,
        arch: c_int,
        ids: *const i32,
        n_ids: usize,
        out_layer: c_int,
        n_threads: c_int,
        out: *mut RawTensor,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn sdref_t5_encode(
        t5xxl_path: *const c_char,
        ids: *const i32,
        n_ids: usize,
        n_threads: c_int,
        out: *mut RawTensor,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// sd.cpp's T5 token ids and weights for `prompt` (see `sdref_t5_tokenize` in
/// driver/sdref_driver.h): `raw` is the tokenizer's `encode` alone, otherwise FLUX's
/// conditioner's chunks of `chunk_len`.
pub fn t5_tokenize(prompt: &str, raw: bool, chunk_len: usize) -> Result<(Vec<i32>, Vec<f32>), String> {
    let prompt = CString::new(prompt).map_err(|_| "the prompt holds a NUL byte".to_owned())?;
    let mut ids: *mut i32 = std::ptr::null_mut();
    let mut weights: *mut f32 = std::ptr::null_mut();
    let mut len = 0usize;
    let mut err = ErrBuf::new();
    // SAFETY: valid NUL-terminated prompt and out-pointers; no context is involved.
    let rc = unsafe {
        sdref_t5_tokenize(prompt.as_ptr(), raw, chunk_len, &mut ids, &mut weights, &mut len, err.ptr(), err.0.len())
    };
    if rc != 0 {
        return Err(err.message());
    }
    // SAFETY: on success the driver returned two malloc'd arrays of `len` values each.
    let out =
        unsafe { (std::slice::from_raw_parts(ids, len).to_vec(), std::slice::from_raw_parts(weights, len).to_vec()) };
    // SAFETY: the arrays came from sdref_t5_tokenize and are freed once.
    unsafe { sdref_t5_tokens_free(ids, weights) };
    Ok(out)
}

/// sd.cpp's raw T5-XXL output for one sequence of `ids`, weights from the `--t5xxl` file
/// `path` (see `sdref_t5_encode` in driver/sdref_driver.h).
pub fn t5_encode(path: &str, ids: &[i32], threads: i32) -> Result<Tensor, String> {
    let path = CString::new(path).map_err(|_| "the path holds a NUL byte".to_owned())?;
    let mut out = empty_raw();
    let mut err = ErrBuf::new();
    // SAFETY: valid path string, `ids.len()` ids, valid out-pointers.
    let rc =
        unsafe { sdref_t5_encode(path.as_ptr(), ids.as_ptr(), ids.len(), threads, &mut out, err.ptr(), err.0.len()) };
    if rc != 0 {
        return Err(err.message());
    }
    take_raw(out).ok_or_else(|| "T5 returned no tensor".to_owned())
}

/// The signature of the driver's LLM tokenizers (`sdref_qwen2_tokenize`, `sdref_mistral_tokenize`).
type LlmTokenizeFn =
    unsafe extern "C" fn(*const c_char, bool, *mut *mut i32, *mut *mut f32, *mut usize, *mut c_char, usize) -> c_int;

/// Runs one of the driver's LLM tokenizers on `prompt` (`templated`: its family's template).
fn llm_tokenize(f: LlmTokenizeFn, prompt: &str, templated: bool) -> Result<(Vec<i32>, Vec<f32>), String> {
    let prompt = CString::new(prompt).map_err(|_| "the prompt holds a NUL byte".to_owned())?;
    let mut ids: *mut i32 = std::ptr::null_mut();
    let mut weights: *mut f32 = std::ptr::null_mut();
    let mut len = 0usize;
    let mut err = ErrBuf::new();
    // SAFETY: valid NUL-terminated prompt and out-pointers; no context is involved.
    let rc = unsafe { f(prompt.as_ptr(), templated, &mut ids, &mut weights, &mut len, err.ptr(), err.0.len()) };
    if rc != 0 {
        return Err(err.message());
    }
    // SAFETY: on success the driver returned two malloc'd arrays of `len` values each.
    let out =
        unsafe { (std::slice::from_raw_parts(ids, len).to_vec(), std::slice::from_raw_parts(weights, len).to_vec()) };
    // SAFETY: the arrays came from the driver (malloc'd, as sdref_t5_tokens_free expects) and are
    // freed once.
    unsafe { sdref_t5_tokens_free(ids, weights) };
    Ok(out)
}

/// sd.cpp's Qwen2 token ids and weights for `prompt` (see `sdref_qwen2_tokenize` in
/// driver/sdref_driver.h): the tokenizer's `encode` alone, or Z-Image's template around it.
pub fn qwen2_tokenize(prompt: &str, zimage: bool) -> Result<(Vec<i32>, Vec<f32>), String> {
    llm_tokenize(sdref_qwen2_tokenize, prompt, zimage)
}

/// sd.cpp's Mistral token ids and weights for `prompt` (see `sdref_mistral_tokenize` in
/// driver/sdref_driver.h): the tokenizer's `encode` alone, or FLUX.2 dev's template around it (BOS first).
pub fn mistral_tokenize(prompt: &str, flux2: bool) -> Result<(Vec<i32>, Vec<f32>), String> {
    llm_tokenize(sdref_mistral_tokenize, prompt, flux2)
}

/// sd.cpp's Qwen3 hidden states for `ids` with `out_layers = {out_layer}`, weights from the
/// `--llm` file `path`; `arch` 0 Qwen3, 1 Mistral-Small-3.2, 2 Qwen2.5-VL (see `sdref_llm_encode`
/// in driver/sdref_driver.h).
pub fn llm_encode(path: &str, arch: i32, ids: &[i32], out_layer: i32, threads: i32) -> Result<Tensor, String> {
    let path = CString::new(path).map_err(|_| "the path holds a NUL byte".to_owned())?;
    let mut out = empty_raw();
    let mut err = ErrBuf::new();
    // SAFETY: valid path string, `ids.len()` ids, valid out-pointers.
    let rc = unsafe {
        sdref_llm_encode(
            path.as_ptr(),
            arch,
            ids.as_ptr(),
            ids.len(),
            out_layer,
            threads,
            &mut out,
            err.ptr(),
            err.0.len(),
        )
    };
    if rc != 0 {
        return Err(err.message());
    }
    take_raw(out).ok_or_else(|| "the LLM returned no tensor".to_owned())
}

/// sd.cpp's ESRGAN upscaler (`new_upscaler_ctx`, `upscale`, as its CLI's `--upscale-model`
/// path calls them): `repeats` passes over an RGB image, tiles of `tile` pixels; returns the
/// model's factor and the image.
pub fn upscale_image(
    path: &str,
    threads: i32,
    tile: i32,
    backend: Option<&str>,
    input: Image,
    repeats: u32,
) -> Result<(i32, Image), String> {
    let mut strings = Strings::default();
    let path = strings.opt(Some(path))?;
    let backend = strings.opt(backend)?;
    if input.channels != 3 || input.data.len() != (input.width * input.height * 3) as usize {
        return Err("the input is not an RGB image".into());
    }
    // SAFETY: valid NUL-terminated strings kept alive by `strings`; a null backend is the default.
    let ctx = unsafe { new_upscaler_ctx(path, false, threads, tile, backend, ptr::null()) };
    if ctx.is_null() {
        return Err("new_upscaler_ctx failed (see the log)".into());
    }
    // SAFETY: a live context.
    let factor = unsafe { get_upscale_factor(ctx) };
    let mut img = input;
    let mut result = Ok(());
    for _ in 0..repeats {
        let raw = RawImage { width: img.width, height: img.height, channel: 3, data: img.data.as_mut_ptr() };
        // SAFETY: a live context; `raw` points at `img.data`, which outlives the call and which
        // sd.cpp only reads.
        let out = unsafe { upscale(ctx, raw, factor as u32) };
        if out.data.is_null() {
            result = Err("upscale failed (see the log)".to_owned());
            break;
        }
        let n = (out.width * out.height * out.channel) as usize;
        // SAFETY: sd.cpp malloc'ed `n` bytes at `out.data`; copied, then freed once.
        let data = unsafe { std::slice::from_raw_parts(out.data, n) }.to_vec();
        // SAFETY: as above.
        unsafe { free(out.data as *mut c_void) };
        img = Image { width: out.width, height: out.height, channels: out.channel, data };
    }
    // SAFETY: the context from new_upscaler_ctx, freed once.
    unsafe { free_upscaler_ctx(ctx) };
    result.map(|()| (factor, img))
}

/// Log level numbers of sd.cpp's `sd_log_level_t`.
pub const LOG_DEBUG: i32 = 0;

/// Receives sd.cpp's log lines and progress reports.
pub trait Observer: Send + Sync {
    fn log(&self, level: i32, text: &str);
    fn progress(&self, step: i32, steps: i32, seconds: f32);
}

extern "C" fn log_trampoline(level: c_int, text: *const c_char, data: *mut c_void) {
    if text.is_null() || data.is_null() {
        return;
    }
    // SAFETY: `data` is the `&'static dyn Observer` boxed in `set_observer`,
    // never freed; `text` is a NUL-terminated string sd.cpp owns for the call.
    let (observer, text) = unsafe { (&*(data as *const &'static dyn Observer), CStr::from_ptr(text)) };
    observer.log(level, &text.to_string_lossy());
}

extern "C" fn progress_trampoline(step: c_int, steps: c_int, seconds: f32, data: *mut c_void) {
    if data.is_null() {
        return;
    }
    // SAFETY: as in `log_trampoline`.
    let observer = unsafe { &*(data as *const &'static dyn Observer) };
    observer.progress(step, steps, seconds);
}

/// Routes sd.cpp's log and progress callbacks to `observer` for the rest of the process.
pub fn set_observer(observer: &'static dyn Observer) {
    let data = Box::into_raw(Box::new(observer)) as *mut c_void;
    // SAFETY: the trampolines match the C typedefs; `data` is leaked, so it
    // outlives every callback.
    unsafe { sdref_set_callbacks(Some(log_trampoline), Some(progress_trampoline), data) };
}

fn static_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the driver returns pointers to static NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

pub fn system_info() -> String {
    // SAFETY: no arguments; returns a static string.
    static_str(unsafe { sdref_system_info() })
}

pub fn sdcpp_version() -> String {
    // SAFETY: no arguments; returns a static string.
    static_str(unsafe { sdref_sdcpp_version() })
}

/// Keeps the `CString`s behind the raw pointers of one call alive.
#[derive(Default)]
struct Strings(Vec<CString>);

impl Strings {
    fn opt(&mut self, s: Option<&str>) -> Result<*const c_char, String> {
        match s {
            None => Ok(ptr::null()),
            Some(s) => {
                let c = CString::new(s).map_err(|_| format!("argument {s:?} contains a NUL byte"))?;
                let p = c.as_ptr();
                self.0.push(c);
                Ok(p)
            }
        }
    }
}

struct ErrBuf([u8; 1024]);

impl ErrBuf {
    fn new() -> Self {
        ErrBuf([0; 1024])
    }
    fn ptr(&mut self) -> *mut c_char {
        self.0.as_mut_ptr().cast()
    }
    fn message(&self) -> String {
        let end = self.0.iter().position(|&b| b == 0).unwrap_or(self.0.len());
        String::from_utf8_lossy(&self.0[..end]).into_owned()
    }
}

#[derive(Debug, Default, Clone)]
pub struct CtxOptions {
    pub model: Option<String>,
    pub diffusion_model: Option<String>,
    pub vae: Option<String>,
    pub clip_l: Option<String>,
    pub clip_g: Option<String>,
    pub t5xxl: Option<String>,
    pub taesd: Option<String>,
    pub wtype: Option<String>,
    pub rng: Option<String>,
    pub sampler_rng: Option<String>,
    pub backend: Option<String>,
    pub params_backend: Option<String>,
    pub threads: i32,
    pub max_vram: f32,
    pub offload_to_cpu: bool,
    pub clip_on_cpu: bool,
    pub vae_on_cpu: bool,
    pub flash_attn: bool,
    pub diffusion_fa: bool,
    pub diffusion_conv_direct: bool,
    pub vae_conv_direct: bool,
    pub mmap: bool,
    pub lora_apply_mode: Option<String>,
    /// The LLM text encoder (`--llm`).
    pub llm: Option<String>,
    /// A ControlNet (`--control-net`).
    pub control_net: Option<String>,
    /// `--control-net-cpu`.
    pub control_net_cpu: bool,
}

#[derive(Debug, Clone)]
pub struct GenOptions {
    pub prompt: String,
    pub negative_prompt: String,
    pub width: i32,
    pub height: i32,
    pub steps: i32,
    pub batch_count: i32,
    pub clip_skip: i32,
    pub cfg_scale: f32,
    pub strength: f32,
    pub seed: i64,
    pub sample_method: Option<String>,
    pub scheduler: Option<String>,
    /// RGB8, `width * height * 3` bytes; `None` for txt2img.
    pub init_rgb: Option<Vec<u8>>,
    pub vae_tiling: bool,
    /// LoRA files and multipliers, applied immediately (merged into the weights).
    pub loras: Vec<(String, f32)>,
    /// The inpainting mask, gray8, `width * height` bytes (255: repaint); `None`: no mask.
    pub mask_gray: Option<Vec<u8>>,
    /// The control image: RGB8 of its own size (width, height, bytes); the library resizes it.
    pub control: Option<(u32, u32, Vec<u8>)>,
    /// `--control-strength`.
    pub control_strength: f32,
    /// The hires fix (`--hires`); `None`: one pass.
    pub hires: Option<HiresOptions>,
    /// Reference images (`-r`): RGB8 of their own sizes (width, height, bytes).
    pub refs: Vec<(u32, u32, Vec<u8>)>,
    /// The CLI's default: resize each reference image to the image's area.
    pub auto_resize_ref_image: bool,
    /// `--increase-ref-index`.
    pub increase_ref_index: bool,
    /// Skip-layer guidance: scale (0: off), layers (empty: 7, 8, 9), start, end.
    pub slg: (f32, Vec<i32>, f32, f32),
    /// `--img-cfg-scale` (None: not set).
    pub img_cfg: Option<f32>,
    /// `--guidance`, FLUX's distilled guidance.
    pub guidance: f32,
}

/// The library's `sd_hires_params_t` (the CLI's `--hires-*` flags).
#[derive(Debug, Clone)]
pub struct HiresOptions {
    /// `--hires-upscaler`: the library's name (`Latent`, `Lanczos`, `Model`, ...).
    pub upscaler: String,
    /// The model of `Model`.
    pub model_path: Option<String>,
    pub scale: f32,
    pub width: i32,
    pub height: i32,
    pub steps: i32,
    pub denoising_strength: f32,
    pub upscale_tile_size: i32,
}

pub struct Image {
    pub width: u32,
    pub height: u32,
    pub channels: u32,
    pub data: Vec<u8>,
}

/// A tensor in ggml axis order: `ne[0]` moves fastest. `shape_torch` gives
/// the outermost-first order used in files and by PyTorch.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub ne: Vec<i64>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn from_torch_shape(shape: &[i64], data: Vec<f32>) -> Tensor {
        Tensor { ne: shape.iter().rev().copied().collect(), data }
    }
    pub fn shape_torch(&self) -> Vec<i64> {
        self.ne.iter().rev().copied().collect()
    }
    fn raw(&self) -> RawTensor {
        let mut ne = [1i64; 4];
        ne[..self.ne.len()].copy_from_slice(&self.ne);
        RawTensor { data: self.data.as_ptr() as *mut f32, ne, n_dims: self.ne.len() as c_int }
    }
}

fn empty_raw() -> RawTensor {
    RawTensor { data: ptr::null_mut(), ne: [0; 4], n_dims: 0 }
}

/// Copies a driver-allocated tensor out and frees it; `None` when empty.
fn take_raw(mut t: RawTensor) -> Option<Tensor> {
    if t.data.is_null() {
        return None;
    }
    let dims = t.n_dims.clamp(0, 4) as usize;
    let ne: Vec<i64> = t.ne[..dims].to_vec();
    let numel: i64 = ne.iter().product();
    // SAFETY: the driver malloc'ed `numel` floats at `t.data`.
    let data = unsafe { std::slice::from_raw_parts(t.data, numel as usize) }.to_vec();
    // SAFETY: `t` came from the driver and is freed exactly once.
    unsafe { sdref_tensor_free(&mut t) };
    Some(Tensor { ne, data })
}

fn check_tensor(t: &Tensor, what: &str) -> Result<(), String> {
    if t.ne.is_empty() || t.ne.len() > 4 {
        return Err(format!("{what}: {} dims, expected 1..4", t.ne.len()));
    }
    let numel: i64 = t.ne.iter().product();
    if numel as usize != t.data.len() {
        return Err(format!("{what}: shape {:?} needs {numel} values, have {}", t.shape_torch(), t.data.len()));
    }
    Ok(())
}

/// A loaded sd.cpp context (`new_sd_ctx`).
pub struct Context {
    raw: *mut RawCtx,
}

impl Context {
    pub fn new(o: &CtxOptions) -> Result<Context, String> {
        let mut s = Strings::default();
        let raw_opts = RawCtxOpts {
            model_path: s.opt(o.model.as_deref())?,
            diffusion_model_path: s.opt(o.diffusion_model.as_deref())?,
            vae_path: s.opt(o.vae.as_deref())?,
            clip_l_path: s.opt(o.clip_l.as_deref())?,
            clip_g_path: s.opt(o.clip_g.as_deref())?,
            t5xxl_path: s.opt(o.t5xxl.as_deref())?,
            taesd_path: s.opt(o.taesd.as_deref())?,
            wtype: s.opt(o.wtype.as_deref())?,
            rng: s.opt(o.rng.as_deref())?,
            sampler_rng: s.opt(o.sampler_rng.as_deref())?,
            backend: s.opt(o.backend.as_deref())?,
            params_backend: s.opt(o.params_backend.as_deref())?,
            n_threads: o.threads,
            max_vram: o.max_vram,
            offload_to_cpu: o.offload_to_cpu,
            clip_on_cpu: o.clip_on_cpu,
            vae_on_cpu: o.vae_on_cpu,
            flash_attn: o.flash_attn,
            diffusion_flash_attn: o.diffusion_fa,
            diffusion_conv_direct: o.diffusion_conv_direct,
            vae_conv_direct: o.vae_conv_direct,
            enable_mmap: o.mmap,
            lora_apply_mode: s.opt(o.lora_apply_mode.as_deref())?,
            llm_path: s.opt(o.llm.as_deref())?,
            control_net_path: s.opt(o.control_net.as_deref())?,
            control_net_cpu: o.control_net_cpu,
        };
        let mut err = ErrBuf::new();
        // SAFETY: every pointer in `raw_opts` is null or points into `s`,
        // alive until the end of this function; `err` is 1024 writable bytes.
        let raw = unsafe { sdref_ctx_new(&raw_opts, err.ptr(), err.0.len()) };
        if raw.is_null() {
            return Err(err.message());
        }
        Ok(Context { raw })
    }

    pub fn generate(&mut self, o: &GenOptions) -> Result<Vec<Image>, String> {
        if let Some(rgb) = &o.init_rgb {
            let want = o.width as usize * o.height as usize * 3;
            if rgb.len() != want {
                return Err(format!("init image has {} bytes, {}x{} RGB needs {want}", rgb.len(), o.width, o.height));
            }
        }
        if let Some((w, h, rgb)) = &o.control {
            if rgb.len() != *w as usize * *h as usize * 3 || *w == 0 || *h == 0 {
                return Err(format!(
                    "control image has {} bytes, {w}x{h} RGB needs {}",
                    rgb.len(),
                    *w as usize * *h as usize * 3
                ));
            }
        }
        if let Some(gray) = &o.mask_gray {
            let want = o.width as usize * o.height as usize;
            if gray.len() != want {
                return Err(format!("mask has {} bytes, {}x{} gray needs {want}", gray.len(), o.width, o.height));
            }
        }
        for (k, (w, h, rgb)) in o.refs.iter().enumerate() {
            if rgb.len() != *w as usize * *h as usize * 3 || *w == 0 || *h == 0 {
                return Err(format!("reference image {} has {} bytes for {w}x{h} RGB", k + 1, rgb.len()));
            }
        }
        let refs: Vec<RawImage> = o
            .refs
            .iter()
            .map(|(w, h, rgb)| RawImage { width: *w, height: *h, channel: 3, data: rgb.as_ptr() as *mut u8 })
            .collect();
        let mut s = Strings::default();
        let mut lora_paths: Vec<*const c_char> = Vec::with_capacity(o.loras.len());
        for (path, _) in &o.loras {
            lora_paths.push(s.opt(Some(path))?);
        }
        let lora_mults: Vec<f32> = o.loras.iter().map(|(_, m)| *m).collect();
        let raw_opts = RawGenOpts {
            prompt: s.opt(Some(&o.prompt))?,
            negative_prompt: s.opt(Some(&o.negative_prompt))?,
            width: o.width,
            height: o.height,
            steps: o.steps,
            batch_count: o.batch_count,
            clip_skip: o.clip_skip,
            cfg_scale: o.cfg_scale,
            strength: o.strength,
            seed: o.seed,
            sample_method: s.opt(o.sample_method.as_deref())?,
            scheduler: s.opt(o.scheduler.as_deref())?,
            init_rgb: o.init_rgb.as_ref().map_or(ptr::null(), |v| v.as_ptr()),
            vae_tiling: o.vae_tiling,
            lora_count: lora_paths.len() as c_int,
            lora_paths: if lora_paths.is_empty() { ptr::null() } else { lora_paths.as_ptr() },
            lora_multipliers: if lora_mults.is_empty() { ptr::null() } else { lora_mults.as_ptr() },
            mask_gray: o.mask_gray.as_ref().map_or(ptr::null(), |v| v.as_ptr()),
            control_rgb: o.control.as_ref().map_or(ptr::null(), |(_, _, v)| v.as_ptr()),
            control_width: o.control.as_ref().map_or(0, |c| c.0 as c_int),
            control_height: o.control.as_ref().map_or(0, |c| c.1 as c_int),
            control_strength: o.control_strength,
            hires_upscaler: s.opt(o.hires.as_ref().map(|h| h.upscaler.as_str()))?,
            hires_model_path: s.opt(o.hires.as_ref().and_then(|h| h.model_path.as_deref()))?,
            hires_scale: o.hires.as_ref().map_or(2.0, |h| h.scale),
            hires_width: o.hires.as_ref().map_or(0, |h| h.width),
            hires_height: o.hires.as_ref().map_or(0, |h| h.height),
            hires_steps: o.hires.as_ref().map_or(0, |h| h.steps),
            hires_denoising_strength: o.hires.as_ref().map_or(0.7, |h| h.denoising_strength),
            hires_upscale_tile_size: o.hires.as_ref().map_or(128, |h| h.upscale_tile_size),
            ref_count: refs.len() as c_int,
            ref_images: if refs.is_empty() { ptr::null() } else { refs.as_ptr() },
            auto_resize_ref_image: o.auto_resize_ref_image,
            increase_ref_index: o.increase_ref_index,
            slg_scale: o.slg.0,
            skip_layer_count: o.slg.1.len() as c_int,
            skip_layers: if o.slg.1.is_empty() { ptr::null() } else { o.slg.1.as_ptr() },
            skip_layer_start: o.slg.2,
            skip_layer_end: o.slg.3,
            img_cfg_scale: o.img_cfg.unwrap_or(f32::NAN),
            guidance: o.guidance,
        };
        let mut images: *mut RawImage = ptr::null_mut();
        let mut count: c_int = 0;
        let mut err = ErrBuf::new();
        // SAFETY: `self.raw` is a live context; the option pointers live in
        // `s` and `o` for the call; the out-pointers are valid locals.
        let rc = unsafe { sdref_generate(self.raw, &raw_opts, &mut images, &mut count, err.ptr(), err.0.len()) };
        if rc != 0 {
            return Err(err.message());
        }
        let mut out = Vec::with_capacity(count.max(0) as usize);
        for i in 0..count.max(0) as usize {
            // SAFETY: the driver returned `count` images at `images`.
            let img = unsafe { &*images.add(i) };
            if img.data.is_null() {
                continue;
            }
            let len = img.width as usize * img.height as usize * img.channel as usize;
            // SAFETY: sd.cpp allocates width*height*channel bytes per image.
            let data = unsafe { std::slice::from_raw_parts(img.data, len) }.to_vec();
            out.push(Image { width: img.width, height: img.height, channels: img.channel, data });
        }
        // SAFETY: freed once, with the count the driver returned.
        unsafe { sdref_images_free(images, count) };
        Ok(out)
    }

    /// Returns (c_crossattn, c_vector if the model has one).
    pub fn encode_text(
        &mut self,
        prompt: &str,
        clip_skip: i32,
        width: i32,
        height: i32,
    ) -> Result<(Tensor, Option<Tensor>), String> {
        let mut s = Strings::default();
        let prompt = s.opt(Some(prompt))?;
        let mut cross = empty_raw();
        let mut vector = empty_raw();
        let mut err = ErrBuf::new();
        // SAFETY: live context, valid prompt string, valid out-pointers.
        let rc = unsafe {
            sdref_encode_text(
                self.raw,
                prompt,
                clip_skip,
                width,
                height,
                &mut cross,
                &mut vector,
                err.ptr(),
                err.0.len(),
            )
        };
        if rc != 0 {
            return Err(err.message());
        }
        let cross = take_raw(cross).ok_or("text encoder returned no tensor")?;
        Ok((cross, take_raw(vector)))
    }

    /// One diffusion-model evaluation; `guidance` is read by FLUX-dev only.
    pub fn diffusion(
        &mut self,
        x: &Tensor,
        timestep: f32,
        context: &Tensor,
        y: Option<&Tensor>,
        guidance: f32,
    ) -> Result<Tensor, String> {
        check_tensor(x, "latent")?;
        check_tensor(context, "context")?;
        if let Some(y) = y {
            check_tensor(y, "y")?;
        }
        let (rx, rc_, ry) = (x.raw(), context.raw(), y.map(Tensor::raw));
        let mut out = empty_raw();
        let mut err = ErrBuf::new();
        // SAFETY: the input RawTensors point into tensors borrowed for the
        // call (the driver only reads them); `out` and `err` are valid.
        let rc = unsafe {
            sdref_diffusion(
                self.raw,
                &rx,
                timestep,
                &rc_,
                ry.as_ref().map_or(ptr::null(), |r| r as *const RawTensor),
                guidance,
                &mut out,
                err.ptr(),
                err.0.len(),
            )
        };
        if rc != 0 {
            return Err(err.message());
        }
        take_raw(out).ok_or_else(|| "diffusion model returned no tensor".to_owned())
    }

    pub fn vae_decode(&mut self, latent: &Tensor, diffusion_space: bool) -> Result<Tensor, String> {
        check_tensor(latent, "latent")?;
        let rl = latent.raw();
        let mut out = empty_raw();
        let mut err = ErrBuf::new();
        // SAFETY: as in `diffusion`.
        let rc = unsafe { sdref_vae_decode(self.raw, &rl, diffusion_space, &mut out, err.ptr(), err.0.len()) };
        if rc != 0 {
            return Err(err.message());
        }
        take_raw(out).ok_or_else(|| "VAE returned no tensor".to_owned())
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: `raw` came from sdref_ctx_new and is freed once.
        unsafe { sdref_ctx_free(self.raw) };
    }
}
