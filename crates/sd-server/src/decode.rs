//! Request bodies decoded into jobs: the native (`sdcpp`) schema, and the OpenAI and A1111
//! bodies mapped onto it; every error is a 4xx naming the field.
//!
//! The compatibility APIs build a native body from their own fields (type-checked under
//! their own names), merge the `<sd_cpp_extra_args>{json}</sd_cpp_extra_args>` block of the
//! prompt over it, and decode that as a native request, so the three APIs share one set of
//! rules.

use std::path::{Component, Path, PathBuf};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use sd_models::lora::LoraRequest;
use sd_models::pipeline::{GenerateParams, Image, PipelineError, Setting, ValidParams};
use sd_models::sampling::{SampleMethod, Scheduler};
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

use crate::Config;

/// Image sides accepted (the reference's `limits`).
pub(crate) const MIN_SIDE: i64 = 64;
pub(crate) const MAX_SIDE: i64 = 4096;
/// Images per request at most (the reference's `limits.max_batch_count`).
pub(crate) const MAX_BATCH: i64 = 8;
/// Sampling steps per request at most.
pub(crate) const MAX_STEPS: i64 = 1000;
/// Largest decoded init image, in pixels per side and bytes (a decompression bomb stops
/// here, before its pixels are allocated).
const MAX_DECODED_SIDE: u32 = 8192;
const MAX_DECODED_BYTES: u64 = 64 << 20;

/// An HTTP error with a JSON body `{"error", "message", "field"}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub error: &'static str,
    pub field: Option<String>,
    pub message: String,
}

impl ApiError {
    /// 400 for `field`.
    pub(crate) fn field(field: &str, message: impl std::fmt::Display) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            error: "invalid_request",
            field: Some(field.to_string()),
            message: format!("{field}: {message}"),
        }
    }

    /// An error of the whole request.
    pub(crate) fn new(status: StatusCode, error: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, error, field: None, message: message.into() }
    }

    /// 400 for a field the runtime cannot honour.
    fn unsupported(field: &str, what: &str) -> ApiError {
        ApiError::field(field, format!("{what} is not supported by this server yet"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": self.error, "message": self.message, "field": self.field});
        (self.status, axum::Json(body)).into_response()
    }
}

/// The image format of the response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    Png,
    Jpeg,
    Webp,
}

impl Format {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Format::Png => "png",
            Format::Jpeg => "jpeg",
            Format::Webp => "webp",
        }
    }
}

/// How images are encoded.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Output {
    pub format: Format,
    /// 0..=100 (JPEG quality).
    pub compression: u8,
}

/// One decoded, checked request.
#[derive(Debug)]
pub(crate) struct JobSpec {
    pub params: ValidParams,
    pub loras: Vec<LoraRequest>,
    pub output: Output,
}

/// The body as a JSON object.
pub(crate) fn parse_body(bytes: &[u8]) -> Result<Value, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", "empty body"));
    }
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", format!("invalid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", "the body must be a JSON object"));
    }
    Ok(v)
}

/// The value at dotted `path` in `obj` as a `T` (None when absent or null); a value of the
/// wrong type, or a non-object on the way, is an error naming the path.
pub(crate) fn field<T: DeserializeOwned>(obj: &Value, path: &str) -> Result<Option<T>, ApiError> {
    let mut v = obj;
    let mut walked = String::new();
    for key in path.split('.') {
        if !walked.is_empty() {
            walked.push('.');
        }
        match v {
            Value::Object(m) => match m.get(key) {
                Some(x) => v = x,
                None => return Ok(None),
            },
            Value::Null => return Ok(None),
            _ => return Err(ApiError::field(walked.trim_end_matches('.'), "must be an object")),
        }
        walked.push_str(key);
    }
    if v.is_null() {
        return Ok(None);
    }
    serde_json::from_value(v.clone()).map(Some).map_err(|e| ApiError::field(path, e))
}

/// An integer field within `range`.
fn int_in(obj: &Value, path: &str, range: std::ops::RangeInclusive<i64>) -> Result<Option<i64>, ApiError> {
    match field::<i64>(obj, path)? {
        Some(v) if !range.contains(&v) => {
            Err(ApiError::field(path, format!("{v} is out of range {}..={}", range.start(), range.end())))
        }
        v => Ok(v),
    }
}

/// A finite number field.
fn number(obj: &Value, path: &str) -> Result<Option<f32>, ApiError> {
    match field::<f64>(obj, path)? {
        Some(v) if !v.is_finite() || v.abs() > f32::MAX as f64 => Err(ApiError::field(path, "not a finite number")),
        v => Ok(v.map(|v| v as f32)),
    }
}

/// Deep merge of `src` over `dst` (objects merge key by key; anything else replaces).
pub(crate) fn merge(dst: &mut Value, src: Value) {
    match (dst, src) {
        (Value::Object(d), Value::Object(s)) => {
            for (k, v) in s {
                merge(d.entry(k).or_insert(Value::Null), v);
            }
        }
        (d, s) => *d = s,
    }
}

/// `prompt` without its `<sd_cpp_extra_args>{json}</sd_cpp_extra_args>` block, and the
/// block's JSON object.
pub(crate) fn extra_args(prompt: &str) -> Result<(String, Option<Value>), ApiError> {
    const OPEN: &str = "<sd_cpp_extra_args>";
    const CLOSE: &str = "</sd_cpp_extra_args>";
    let Some(start) = prompt.find(OPEN) else { return Ok((prompt.to_string(), None)) };
    let Some(len) = prompt[start..].find(CLOSE) else {
        return Err(ApiError::field("prompt", "<sd_cpp_extra_args> is not closed"));
    };
    let inner = &prompt[start + OPEN.len()..start + len];
    let v: Value = serde_json::from_str(inner)
        .map_err(|e| ApiError::field("prompt", format!("<sd_cpp_extra_args> is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::field("prompt", "<sd_cpp_extra_args> must hold a JSON object"));
    }
    let rest = format!("{}{}", &prompt[..start], &prompt[start + len + CLOSE.len()..]);
    Ok((rest.trim().to_string(), Some(v)))
}

/// A sampler by our name, or by A1111's (`Euler a`, `DPM++ 2M`, `k_euler_a`), as the
/// reference's sdapi maps them.
pub(crate) fn sampler(path: &str, name: &str) -> Result<Option<SampleMethod>, ApiError> {
    if name.is_empty() || name.eq_ignore_ascii_case("default") {
        return Ok(None);
    }
    if let Ok(m) = name.parse::<SampleMethod>() {
        return Ok(Some(m));
    }
    let m = match name.to_ascii_lowercase().as_str() {
        "euler a" | "k_euler_a" => SampleMethod::EulerA,
        "euler" | "k_euler" => SampleMethod::Euler,
        "heun" | "k_heun" => SampleMethod::Heun,
        "dpm2" | "k_dpm_2" => SampleMethod::Dpm2,
        "lcm" => SampleMethod::Lcm,
        "ddim" => SampleMethod::DdimTrailing,
        "dpm++ 2m" | "k_dpmpp_2m" => SampleMethod::DpmPp2m,
        "dpm++ 2s a" | "k_dpmpp_2s_a" => SampleMethod::DpmPp2sA,
        "res multistep" | "k_res_multistep" => SampleMethod::ResMultistep,
        "res 2s" | "k_res_2s" => SampleMethod::Res2s,
        "euler_cfg_pp" | "k_euler_cfg_pp" => SampleMethod::EulerCfgPp,
        "euler_a_cfg_pp" | "k_euler_a_cfg_pp" => SampleMethod::EulerACfgPp,
        _ => {
            let known: Vec<&str> = SampleMethod::ALL.iter().map(|m| m.name()).collect();
            return Err(ApiError::field(
                path,
                format!("unknown sampler '{}' (known: {})", clip(name), known.join(", ")),
            ));
        }
    };
    Ok(Some(m))
}

fn scheduler(path: &str, name: &str) -> Result<Option<Scheduler>, ApiError> {
    if name.is_empty() || name.eq_ignore_ascii_case("default") || name.eq_ignore_ascii_case("automatic") {
        return Ok(None);
    }
    name.to_ascii_lowercase().parse::<Scheduler>().map(Some).map_err(|e| ApiError::field(path, e))
}

/// `s` cut to 60 characters for a message.
fn clip(s: &str) -> String {
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// A LoRA name confined to `dir`: relative, without `..`, naming a file there (as written,
/// then with `.gguf`, `.safetensors`, `.pt`, `.ckpt` appended).
pub(crate) fn lora_path(path: &str, name: &str, dir: &Path) -> Result<PathBuf, ApiError> {
    let p = Path::new(name);
    if name.is_empty() {
        return Err(ApiError::field(path, "empty LoRA name"));
    }
    if p.is_absolute() || p.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(ApiError::field(
            path,
            format!("'{}' must be a name relative to the LoRA directory, without '..'", clip(name)),
        ));
    }
    let base = dir.join(p);
    let candidates = std::iter::once(base.clone()).chain([".gguf", ".safetensors", ".pt", ".ckpt"].iter().map(|ext| {
        let mut s = base.clone().into_os_string();
        s.push(ext);
        PathBuf::from(s)
    }));
    let root = dir.canonicalize().ok();
    for c in candidates {
        if !c.is_file() {
            continue;
        }
        // A symbolic link inside the directory must not lead out of it.
        let inside = match (&root, c.canonicalize()) {
            (Some(root), Ok(real)) => real.starts_with(root),
            _ => false,
        };
        if !inside {
            return Err(ApiError::field(path, format!("'{}' leads outside the LoRA directory", clip(name))));
        }
        return Ok(c);
    }
    Err(ApiError::field(path, format!("no LoRA file '{}' in the LoRA directory", clip(name))))
}

/// An image field: raw base64 or a data URL, decoded with limits on its size.
pub(crate) fn image(path: &str, s: &str) -> Result<Image, ApiError> {
    let b64 = match s.strip_prefix("data:") {
        Some(rest) => match rest.split_once(',') {
            Some((meta, data)) if meta.ends_with(";base64") => data,
            _ => return Err(ApiError::field(path, "a data URL must be base64 (data:image/png;base64,...)")),
        },
        None => s,
    };
    let b64: String = b64.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(&b64)
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(&b64))
        .map_err(|e| ApiError::field(path, format!("not base64: {e}")))?;
    let mut reader = image::ImageReader::new(std::io::Cursor::new(&bytes))
        .with_guessed_format()
        .map_err(|e| ApiError::field(path, format!("unreadable image: {e}")))?;
    if reader.format().is_none() {
        return Err(ApiError::field(path, "not a PNG, JPEG, WebP or BMP image"));
    }
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(MAX_DECODED_SIDE);
    limits.max_image_height = Some(MAX_DECODED_SIDE);
    limits.max_alloc = Some(MAX_DECODED_BYTES);
    reader.limits(limits);
    let img = reader.decode().map_err(|e| ApiError::field(path, format!("cannot decode the image: {e}")))?;
    let rgb = img.to_rgb8();
    Ok(Image { width: rgb.width() as usize, height: rgb.height() as usize, rgb: rgb.into_raw() })
}

/// Fields the runtime cannot honour yet: refused when set to anything but their neutral value.
fn refuse_unsupported(body: &Value) -> Result<(), ApiError> {
    for f in ["mask_image", "control_image", "ip_adapter_image"] {
        if field::<Value>(body, f)?.is_some_and(|v| v != json!("")) {
            return Err(ApiError::unsupported(f, "this image input"));
        }
    }
    if field::<Vec<Value>>(body, "sample_params.custom_sigmas")?.is_some_and(|v| !v.is_empty()) {
        return Err(ApiError::unsupported("sample_params.custom_sigmas", "a non-empty list"));
    }
    if field::<i64>(body, "sample_params.shifted_timestep")?.is_some_and(|s| s != 0) {
        return Err(ApiError::unsupported("sample_params.shifted_timestep", "a shifted timestep"));
    }
    if field::<bool>(body, "hires.enabled")? == Some(true) {
        return Err(ApiError::unsupported("hires.enabled", "the highres fix"));
    }
    if let Some(mode) = field::<String>(body, "cache_mode")? {
        if !(mode.is_empty() || mode == "disabled") {
            return Err(ApiError::unsupported("cache_mode", "a cache mode"));
        }
    }
    Ok(())
}

/// The field name of a [`Setting`] in the native schema.
fn setting_field(s: Setting) -> &'static str {
    match s {
        Setting::Width => "width",
        Setting::Height => "height",
        Setting::Steps => "sample_params.sample_steps",
        Setting::BatchCount => "batch_count",
        Setting::CfgScale => "sample_params.guidance.txt_cfg",
        Setting::Guidance => "sample_params.guidance.distilled_guidance",
        Setting::Eta => "sample_params.eta",
        Setting::Strength => "strength",
        Setting::Mask => "mask_image",
        Setting::FlowShift => "sample_params.flow_shift",
        Setting::Prompt => "prompt",
        Setting::NegativePrompt => "negative_prompt",
        Setting::ControlStrength => "control_strength",
        Setting::HiresScale => "hires.scale",
        Setting::HiresSize => "hires.target_width",
        Setting::HiresDenoisingStrength => "hires.denoising_strength",
        Setting::Hires => "hires.enabled",
        Setting::RefImage => "ref_images",
        Setting::SlgScale => "sample_params.guidance.slg.scale",
        Setting::ImgCfgScale => "sample_params.guidance.img_cfg",
    }
}

/// A native (`/sdcpp/v1/img_gen`) body as a job, the server's defaults filling what it leaves
/// out.
pub(crate) fn native(body: &Value, config: &Config) -> Result<JobSpec, ApiError> {
    refuse_unsupported(body)?;
    let d = &config.defaults;
    let mut p = GenerateParams { init_image: None, ..d.clone() };
    if let Some(s) = field::<String>(body, "prompt")? {
        p.prompt = s;
    }
    if let Some(s) = field::<String>(body, "negative_prompt")? {
        p.negative_prompt = s;
    }
    if let Some(v) = field::<i64>(body, "clip_skip")? {
        p.clip_skip = v;
    }
    if let Some(v) = int_in(body, "width", MIN_SIDE..=MAX_SIDE)? {
        p.width = v as usize;
    }
    if let Some(v) = int_in(body, "height", MIN_SIDE..=MAX_SIDE)? {
        p.height = v as usize;
    }
    if let Some(v) = number(body, "strength")? {
        if !(0.0..=1.0).contains(&v) {
            return Err(ApiError::field("strength", format!("{v} is out of range 0..=1")));
        }
        p.strength = v;
    }
    if let Some(v) = field::<i64>(body, "seed")? {
        p.seed = if v < 0 { random_seed() } else { v as u64 };
    }
    if let Some(v) = int_in(body, "batch_count", 1..=MAX_BATCH)? {
        p.batch_count = v as usize;
    }
    if let Some(v) = int_in(body, "sample_params.sample_steps", 1..=MAX_STEPS)? {
        p.steps = v as usize;
    }
    if let Some(s) = field::<String>(body, "sample_params.sample_method")? {
        p.method = sampler("sample_params.sample_method", &s)?;
    }
    if let Some(s) = field::<String>(body, "sample_params.scheduler")? {
        p.scheduler = scheduler("sample_params.scheduler", &s)?;
    }
    if let Some(v) = number(body, "sample_params.eta")? {
        p.eta = Some(v);
    }
    if let Some(v) = number(body, "sample_params.flow_shift")? {
        // The reference's 0 (and its `inf` default) mean the model's own shift.
        p.flow_shift = (v != 0.0).then_some(v);
    }
    if let Some(v) = number(body, "sample_params.guidance.txt_cfg")? {
        p.cfg_scale = Some(v);
    }
    if let Some(v) = number(body, "sample_params.guidance.distilled_guidance")? {
        p.guidance = v;
    }
    if let Some(v) = number(body, "sample_params.guidance.img_cfg")? {
        p.img_cfg_scale = Some(v);
    }
    // Skip-layer guidance, with the reference's defaults for what is left out.
    let slg_scale = number(body, "sample_params.guidance.slg.scale")?.unwrap_or(0.0);
    let layers = field::<Vec<usize>>(body, "sample_params.guidance.slg.layers")?.unwrap_or_else(|| vec![7, 8, 9]);
    let start = number(body, "sample_params.guidance.slg.layer_start")?.unwrap_or(0.01);
    let end = number(body, "sample_params.guidance.slg.layer_end")?.unwrap_or(0.2);
    p.slg =
        (slg_scale != 0.0).then_some(sd_models::sampling::SkipLayerGuidance { scale: slg_scale, layers, start, end });
    if let Some(s) = field::<String>(body, "init_image")? {
        if !s.is_empty() {
            p.init_image = Some(image("init_image", &s)?);
        }
    }
    // Reference images (FLUX.2's edits), each a base64 image like the init image.
    if let Some(list) = field::<Vec<String>>(body, "ref_images")? {
        p.ref_images =
            list.iter().enumerate().map(|(k, s)| image(&format!("ref_images[{k}]"), s)).collect::<Result<_, _>>()?;
    }
    if let Some(b) = field::<bool>(body, "auto_resize_ref_image")? {
        p.auto_resize_ref_images = b;
    }
    if let Some(b) = field::<bool>(body, "increase_ref_index")? {
        p.increase_ref_index = b;
    }
    p.tiling = tiling(body, &p)?;
    let loras = loras(body, config)?;
    let output = output(body)?;
    let params = p.validate().map_err(|e| match e {
        PipelineError::Setting { setting, value, problem } => {
            ApiError::field(setting_field(setting), format!("{value}: {problem}"))
        }
        e => ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", e.to_string()),
    })?;
    Ok(JobSpec { params, loras, output })
}

/// `vae_tiling_params`.
fn tiling(body: &Value, p: &GenerateParams) -> Result<sd_vae::TilingParams, ApiError> {
    const F: &str = "vae_tiling_params";
    if field::<Value>(body, F)?.is_none() {
        return Ok(p.tiling.clone());
    }
    let enabled = field::<bool>(body, "vae_tiling_params.enabled")?.unwrap_or(false);
    let x = int_in(body, "vae_tiling_params.tile_size_x", 0..=MAX_SIDE)?.unwrap_or(0);
    let y = int_in(body, "vae_tiling_params.tile_size_y", 0..=MAX_SIDE)?.unwrap_or(0);
    let overlap = number(body, "vae_tiling_params.target_overlap")?;
    let rx = number(body, "vae_tiling_params.rel_size_x")?.unwrap_or(0.0);
    let ry = number(body, "vae_tiling_params.rel_size_y")?.unwrap_or(0.0);
    let size = (x > 0 && y > 0).then(|| format!("{x}x{y}"));
    let rel = (rx > 0.0 && ry > 0.0).then(|| format!("{rx}x{ry}"));
    let overlap = overlap.map(|o| o.to_string());
    sd_vae::TilingParams::from_cli(enabled, size.as_deref(), overlap.as_deref(), rel.as_deref())
        .map_err(|e| ApiError::field(F, e))
}

/// `lora[]`: `{path, multiplier, is_high_noise}`, each confined to the LoRA directory.
fn loras(body: &Value, config: &Config) -> Result<Vec<LoraRequest>, ApiError> {
    let Some(list) = field::<Vec<Value>>(body, "lora")? else { return Ok(Vec::new()) };
    let mut out: Vec<LoraRequest> = Vec::new();
    for (i, entry) in list.iter().enumerate() {
        let at = |f: &str| format!("lora[{i}].{f}");
        if !entry.is_object() {
            return Err(ApiError::field(&format!("lora[{i}]"), "must be an object {path, multiplier}"));
        }
        let name: String = field(entry, "path")
            .map_err(|e| rename(e, &at("path")))?
            .ok_or_else(|| ApiError::field(&at("path"), "missing"))?;
        let multiplier = number(entry, "multiplier").map_err(|e| rename(e, &at("multiplier")))?.unwrap_or(1.0);
        if field::<bool>(entry, "is_high_noise").map_err(|e| rename(e, &at("is_high_noise")))? == Some(true) {
            return Err(ApiError::unsupported(&at("is_high_noise"), "a high-noise LoRA"));
        }
        let path = lora_path(&at("path"), &name, &config.lora_dir)?;
        // The same file twice: multipliers add up, as the reference's tags do.
        match out.iter_mut().find(|l| l.path == path) {
            Some(l) => l.multiplier += multiplier,
            None => out.push(LoraRequest { path, multiplier }),
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// An error of a nested object, named by its full path.
fn rename(mut e: ApiError, full: &str) -> ApiError {
    if let Some(f) = &e.field {
        e.message = e.message.replacen(f.as_str(), full, 1);
    }
    e.field = Some(full.to_string());
    e
}

/// `output_format` (png, jpeg, webp; default png) and `output_compression` (clamped 0..100).
fn output(body: &Value) -> Result<Output, ApiError> {
    let format = match field::<String>(body, "output_format")?.as_deref() {
        None | Some("png") => Format::Png,
        Some("jpeg") | Some("jpg") => Format::Jpeg,
        Some("webp") => Format::Webp,
        Some(other) => {
            return Err(ApiError::field("output_format", format!("'{}' is not png, jpeg or webp", clip(other))))
        }
    };
    let compression = field::<i64>(body, "output_compression")?.unwrap_or(100).clamp(0, 100) as u8;
    Ok(Output { format, compression })
}

fn random_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64 & 0x7fff_ffff)
        .unwrap_or(0)
}

/// Puts `value` at `key` of the native body `out` when present.
fn put(out: &mut Map<String, Value>, key: &str, value: Option<Value>) {
    if let Some(v) = value {
        out.insert(key.to_string(), v);
    }
}

/// The prompt of a compatibility body (required) without its extra-args block, and the block.
fn compat_prompt(body: &Value, required: bool) -> Result<(String, Option<Value>), ApiError> {
    match field::<String>(body, "prompt")? {
        Some(p) => extra_args(&p),
        None if required => Err(ApiError::field("prompt", "missing")),
        None => Ok((String::new(), None)),
    }
}

/// `POST /v1/images/generations` as a native body.
pub(crate) fn openai(body: &Value) -> Result<Value, ApiError> {
    let (prompt, extra) = compat_prompt(body, true)?;
    let mut out = Map::new();
    out.insert("prompt".into(), json!(prompt));
    put(&mut out, "batch_count", int_in(body, "n", 1..=MAX_BATCH)?.map(|n| json!(n)));
    if let Some(size) = field::<String>(body, "size")? {
        let parsed = size
            .split_once(['x', 'X'])
            .and_then(|(w, h)| Some((w.trim().parse::<i64>().ok()?, h.trim().parse::<i64>().ok()?)));
        let Some((w, h)) = parsed else {
            return Err(ApiError::field("size", format!("'{}' is not WIDTHxHEIGHT", clip(&size))));
        };
        for v in [w, h] {
            if !(MIN_SIDE..=MAX_SIDE).contains(&v) {
                return Err(ApiError::field("size", format!("{v} is out of range {MIN_SIDE}..={MAX_SIDE}")));
            }
        }
        out.insert("width".into(), json!(w));
        out.insert("height".into(), json!(h));
    }
    put(&mut out, "output_format", field::<String>(body, "output_format")?.map(Value::from));
    put(&mut out, "output_compression", field::<i64>(body, "output_compression")?.map(Value::from));
    if let Some(f) = field::<String>(body, "response_format")? {
        if f != "b64_json" {
            return Err(ApiError::field("response_format", format!("'{}': only b64_json is served", clip(&f))));
        }
    }
    let mut v = Value::Object(out);
    if let Some(extra) = extra {
        merge(&mut v, extra);
    }
    Ok(v)
}

/// `POST /sdapi/v1/txt2img` and `img2img` as a native body. A1111's `<lora:name:weight>` tags
/// in the prompt are taken out and added to `lora` (names confined to `lora_dir`, as the
/// field's are).
pub(crate) fn sdapi(body: &Value, img2img: bool, lora_dir: &Path) -> Result<Value, ApiError> {
    let (prompt, extra) = compat_prompt(body, false)?;
    let (prompt, tagged) = sd_models::lora::tags::extract(&prompt, lora_dir).map_err(|e| {
        // The directory is the server's, named by its role.
        let dir = lora_dir.to_string_lossy();
        let message = e.to_string();
        let message = if lora_dir.is_absolute() { message.replace(&*dir, "<lora-model-dir>") } else { message };
        ApiError::field("prompt", message)
    })?;
    let mut out = Map::new();
    out.insert("prompt".into(), json!(prompt));
    put(&mut out, "negative_prompt", field::<String>(body, "negative_prompt")?.map(Value::from));
    put(&mut out, "width", int_in(body, "width", MIN_SIDE..=MAX_SIDE)?.map(Value::from));
    put(&mut out, "height", int_in(body, "height", MIN_SIDE..=MAX_SIDE)?.map(Value::from));
    put(&mut out, "seed", field::<i64>(body, "seed")?.map(Value::from));
    put(&mut out, "batch_count", int_in(body, "batch_size", 1..=MAX_BATCH)?.map(Value::from));
    put(&mut out, "clip_skip", field::<i64>(body, "clip_skip")?.map(Value::from));
    let mut sample = Map::new();
    put(&mut sample, "sample_steps", int_in(body, "steps", 1..=MAX_STEPS)?.map(Value::from));
    if let Some(name) = field::<String>(body, "sampler_name")? {
        if let Some(m) = sampler("sampler_name", &name)? {
            sample.insert("sample_method".into(), json!(m.name()));
        }
    }
    if let Some(name) = field::<String>(body, "scheduler")? {
        if let Some(s) = scheduler("scheduler", &name)? {
            sample.insert("scheduler".into(), json!(s.name()));
        }
    }
    if let Some(cfg) = number(body, "cfg_scale")? {
        sample.insert("guidance".into(), json!({"txt_cfg": cfg}));
    }
    out.insert("sample_params".into(), Value::Object(sample));
    if let Some(l) = field::<Value>(body, "lora")? {
        out.insert("lora".into(), l);
    }
    if field::<Vec<Value>>(body, "extra_images")?.is_some_and(|v| !v.is_empty()) {
        return Err(ApiError::unsupported("extra_images", "a non-empty list"));
    }
    if field::<bool>(body, "enable_hr")? == Some(true) {
        return Err(ApiError::unsupported("enable_hr", "the highres fix"));
    }
    let strength = number(body, "denoising_strength")?;
    if img2img {
        let images = field::<Vec<String>>(body, "init_images")?.unwrap_or_default();
        let Some(first) = images.first() else {
            return Err(ApiError::field("init_images", "img2img needs one init image"));
        };
        // Decoded here, under the field's own name.
        image("init_images[0]", first)?;
        out.insert("init_image".into(), json!(first));
        if field::<String>(body, "mask")?.is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::unsupported("mask", "inpainting"));
        }
        put(&mut out, "strength", strength.map(|s| json!(s.clamp(0.0, 1.0))));
    }
    let mut v = Value::Object(out);
    if let Some(extra) = extra {
        merge(&mut v, extra);
    }
    if !tagged.is_empty() {
        let mut list = match v.get("lora") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(l)) => l.clone(),
            Some(_) => return Err(ApiError::field("lora", "must be a list of {path, multiplier}")),
        };
        for l in tagged {
            // The tag's file, named relative to the directory (checked again with the list's).
            let rel = l.path.strip_prefix(lora_dir).unwrap_or(&l.path);
            list.push(json!({"path": rel.to_string_lossy(), "multiplier": l.multiplier}));
        }
        v["lora"] = Value::Array(list);
    }
    Ok(v)
}
