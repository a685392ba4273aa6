//! The HTTP routes of the three API families, the API key check and JSON errors for every
//! rejection (bad JSON, too large a body, unknown route).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::multipart::{Multipart, MultipartError, MultipartRejection};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use sd_models::sampling::{SampleMethod, Scheduler};
use serde_json::{json, Value};

use crate::decode::{self, ApiError, JobSpec};
use crate::jobs::{self, CancelError, QueueFull, Shared, Status, Work};

type AppState = Arc<Shared>;

/// Every route, behind the API key check and the body limit.
pub(crate) fn router(state: AppState) -> Router {
    let limit = state.config.max_body;
    Router::new()
        .route("/", get(index))
        .route("/sdcpp/v1/capabilities", get(capabilities))
        .route("/sdcpp/v1/img_gen", post(img_gen))
        .route("/sdcpp/v1/jobs/{id}", get(job))
        .route("/sdcpp/v1/jobs/{id}/cancel", post(cancel))
        .route("/sdcpp/v1/jobs/{id}/events", get(job_events))
        .route("/v1/images/generations", post(openai_generations))
        .route("/v1/images/edits", post(openai_edits))
        .route("/v1/models", get(models))
        .route("/sdapi/v1/txt2img", post(txt2img))
        .route("/sdapi/v1/img2img", post(img2img))
        .route("/sdapi/v1/samplers", get(samplers))
        .route("/sdapi/v1/schedulers", get(schedulers))
        .route("/sdapi/v1/loras", get(loras))
        .route("/sdapi/v1/sd-models", get(sd_models_list))
        .route("/sdapi/v1/options", get(options).post(set_options))
        .route("/sdapi/v1/upscalers", get(upscalers))
        .route("/sdapi/v1/latent-upscale-modes", get(latent_upscale_modes))
        .route("/sdapi/v1/progress", get(progress))
        .route("/sdapi/v1/interrupt", post(interrupt))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

/// `Authorization: Bearer KEY` when `--api-key` is set, and a declared `Content-Length` over
/// the limit answered 413 before the body is read (a body without one is limited as it is
/// read).
async fn auth(State(state): State<AppState>, req: Request, next: Next) -> Response {
    // The page holds no data; its API calls carry the key.
    let page = req.method() == axum::http::Method::GET && req.uri().path() == "/";
    if let Some(key) = state.config.api_key.as_ref().filter(|_| !page) {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "a valid 'Authorization: Bearer KEY' header is required",
            )
            .into_response();
        }
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > state.config.max_body as u64) {
        let message = format!("the body is larger than the limit of {} bytes", state.config.max_body);
        return ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message).into_response();
    }
    next.run(req).await
}

async fn index() -> axum::response::Html<&'static str> {
    axum::response::Html(crate::page::INDEX_HTML)
}

/// `GET /sdcpp/v1/jobs/{id}/events`: server-sent events, one per change of the job (event
/// name: its status; data: the job JSON of `GET /sdcpp/v1/jobs/{id}`, with progress and
/// preview), the last one when it is finished.
async fn job_events(State(state): State<AppState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    use axum::response::sse::{Event, KeepAlive, Sse};
    {
        let st = state.lock();
        if !st.jobs.contains_key(&id) {
            return Err(job_missing(st.expired.contains(&id)));
        }
    }
    let rx = state.subscribe();
    let stream = futures_util::stream::unfold(Some((state, id, rx, String::new())), |s| async move {
        let (state, id, mut rx, last) = s?;
        loop {
            let (v, status) = {
                let st = state.lock();
                match st.jobs.get(&id) {
                    Some(job) => (jobs::job_json(&st, job), job.status),
                    // Expired while followed (a client that kept the stream open 600 s).
                    None => return None,
                }
            };
            // A change is a change of anything but the clock (elapsed and ETA move always).
            let mut key = v.clone();
            if let Some(p) = key.get_mut("progress").and_then(Value::as_object_mut) {
                p.remove("elapsed");
                p.remove("eta");
            }
            let key = key.to_string();
            let finished = !matches!(status, Status::Queued | Status::Generating);
            if key != last {
                let event = Event::default().event(status.name()).data(v.to_string());
                let next = (!finished).then_some((state, id, rx, key));
                return Some((Ok::<_, std::convert::Infallible>(event), next));
            }
            rx.changed().await.ok()?;
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()).into_response())
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
}

/// The body's bytes, a rejection (413 for too large a body) as a JSON error.
fn body(b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    b.map_err(|r| {
        let status = r.status();
        let error = if status == StatusCode::PAYLOAD_TOO_LARGE { "payload_too_large" } else { "invalid_request" };
        ApiError::new(status, error, r.body_text())
    })
}

fn queue_full() -> ApiError {
    ApiError::new(StatusCode::TOO_MANY_REQUESTS, "queue_full", "job queue is full")
}

/// The loaded model's file stem.
fn model_stem(state: &Shared) -> String {
    let path = state.model_path().unwrap_or_default();
    path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Checkpoint files at the top level of `--models-dir`, sorted.
fn model_files(state: &Shared) -> Vec<std::path::PathBuf> {
    let Some(dir) = &state.config.models_dir else { return Vec::new() };
    let mut out: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .filter(|p| {
            let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
            ["safetensors", "gguf", "ckpt", "pt", "sft"].contains(&ext)
        })
        .collect();
    out.sort();
    out
}

/// LoRA files of the directory (top level): `{name, path}`.
fn lora_list(state: &Shared) -> Vec<Value> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&state.config.lora_dir) {
        for e in entries.flatten() {
            let p = e.path();
            let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
            if p.is_file() && ["safetensors", "gguf", "pt", "ckpt"].contains(&ext) {
                let name = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                let file = e.file_name().to_string_lossy().into_owned();
                out.push(json!({"name": name, "path": file}));
            }
        }
    }
    out.sort_by(|a, b| a["path"].as_str().cmp(&b["path"].as_str()));
    out
}

async fn capabilities(State(state): State<AppState>) -> Json<Value> {
    let d = &state.config.defaults;
    let defaults = json!({
        "prompt": d.prompt,
        "negative_prompt": d.negative_prompt,
        "clip_skip": d.clip_skip,
        "width": d.width,
        "height": d.height,
        "strength": d.strength,
        "seed": d.seed,
        "batch_count": d.batch_count,
        "sample_params": {
            "scheduler": d.scheduler.map(|s| s.name()).unwrap_or("default"),
            "sample_method": d.method.map(|m| m.name()).unwrap_or("default"),
            "sample_steps": d.steps,
            "eta": d.eta,
            "shifted_timestep": 0,
            "flow_shift": d.flow_shift,
            "guidance": {
                "txt_cfg": d.cfg_scale,
                "img_cfg": null,
                "distilled_guidance": d.guidance,
                "slg": {"layers": [7, 8, 9], "layer_start": 0.01, "layer_end": 0.2, "scale": 0.0},
            },
        },
        "lora": [],
        "output_format": "png",
        "output_compression": 100,
    });
    let features = json!({
        "init_image": true, "mask_image": false, "control_image": false, "ip_adapter_image": false,
        "ref_images": true, "lora": true, "vae_tiling": true, "hires": false, "cache": false,
        "cancel_queued": true, "cancel_generating": true,
    });
    let formats = json!(["png", "jpeg", "webp"]);
    let path = &state.model_path().unwrap_or_default();
    Json(json!({
        "model": {
            "name": path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
            "stem": model_stem(&state),
            "path": path.to_string_lossy(),
        },
        "current_mode": "img_gen",
        "supported_modes": ["img_gen"],
        "defaults": defaults,
        "defaults_by_mode": {"img_gen": defaults},
        "output_formats": formats,
        "output_formats_by_mode": {"img_gen": formats},
        "features": features,
        "features_by_mode": {"img_gen": features},
        "samplers": SampleMethod::ALL.iter().map(|m| m.name()).collect::<Vec<_>>(),
        "schedulers": Scheduler::ALL.iter().map(|s| s.name()).collect::<Vec<_>>(),
        "loras": lora_list(&state),
        "upscalers": [{"name": "None"}],
        "limits": {
            "min_width": decode::MIN_SIDE,
            "max_width": decode::MAX_SIDE,
            "min_height": decode::MIN_SIDE,
            "max_height": decode::MAX_SIDE,
            "max_batch_count": decode::MAX_BATCH,
            "max_queue_size": state.config.max_queue,
        },
    }))
}

/// `POST /sdcpp/v1/img_gen`: 202 with the job's id and poll URL.
async fn img_gen(State(state): State<AppState>, b: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let bytes = body(b)?;
    let v = decode::parse_body(&bytes)?;
    if v.as_object().is_some_and(|o| o.contains_key("sd_cpp_extra_args")) {
        return Err(ApiError::field("sd_cpp_extra_args", "not used by the native API: put its fields in the body"));
    }
    let spec = decode::native(&v, &state.config)?;
    let (id, created, _) = state.submit(Work::Generate(Box::new(spec)), false).map_err(|QueueFull| queue_full())?;
    let out = json!({
        "id": id,
        "kind": "img_gen",
        "status": "queued",
        "created": created,
        "poll_url": format!("/sdcpp/v1/jobs/{id}"),
    });
    Ok((StatusCode::ACCEPTED, Json(out)).into_response())
}

fn job_missing(expired: bool) -> ApiError {
    if expired {
        ApiError::new(StatusCode::GONE, "job_expired", "job expired")
    } else {
        ApiError::new(StatusCode::NOT_FOUND, "job_not_found", "job not found")
    }
}

async fn job(State(state): State<AppState>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let st = state.lock();
    match st.jobs.get(&id) {
        Some(job) => Ok(Json(jobs::job_json(&st, job))),
        None => Err(job_missing(st.expired.contains(&id))),
    }
}

/// `POST /sdcpp/v1/jobs/{id}/cancel`: the job as it is now (a generating job reports
/// `generating` until it stops at its next step).
async fn cancel(State(state): State<AppState>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    match state.cancel(&id) {
        Ok(_) => {}
        Err(CancelError::NotFound) => return Err(job_missing(false)),
        Err(CancelError::Expired) => return Err(job_missing(true)),
        Err(CancelError::Finished(s)) => {
            return Err(ApiError::new(StatusCode::CONFLICT, "job_finished", format!("the job is already {}", s.name())))
        }
    }
    let st = state.lock();
    let job = st.jobs.get(&id).ok_or_else(|| job_missing(st.expired.contains(&id)))?;
    Ok(Json(jobs::job_json(&st, job)))
}

/// Cancels a synchronous request's job when its handler is dropped (the client went away).
struct CancelOnDrop {
    state: AppState,
    id: String,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            tracing::info!("{}: the client disconnected; cancelling", self.id);
            let _ = self.state.cancel(&self.id);
        }
    }
}

/// Runs `spec` as a job and waits for it: the base64 images and their format.
async fn run_sync(state: &AppState, spec: JobSpec) -> Result<(Vec<String>, &'static str), ApiError> {
    run_work(state, Work::Generate(Box::new(spec))).await
}

/// Runs `work` as a job and waits for it.
async fn run_work(state: &AppState, work: Work) -> Result<(Vec<String>, &'static str), ApiError> {
    let (id, _, rx) = state.submit(work, true).map_err(|QueueFull| queue_full())?;
    let mut guard = CancelOnDrop { state: state.clone(), id: id.clone(), armed: true };
    if let Some(rx) = rx {
        let _ = rx.await;
    }
    guard.armed = false;
    let st = state.lock();
    let Some(job) = st.jobs.get(&id) else {
        return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "the job vanished"));
    };
    let message = job.error.as_ref().map(|(_, m)| m.clone()).unwrap_or_default();
    match job.status {
        Status::Completed => Ok((job.images.clone(), job.output_format)),
        Status::Cancelled => Err(ApiError::new(StatusCode::CONFLICT, "cancelled", message)),
        Status::Failed if job.bad_request => Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message)),
        _ => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "generation_failed", message)),
    }
}

async fn openai_generations(
    State(state): State<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let bytes = body(b)?;
    let v = decode::parse_body(&bytes)?;
    let native = decode::openai(&v)?;
    let spec = decode::native(&native, &state.config)?;
    let (images, format) = run_sync(&state, spec).await?;
    let data: Vec<Value> = images.into_iter().map(|b64| json!({"b64_json": b64})).collect();
    Ok(Json(json!({"created": jobs::unix_now(), "output_format": format, "data": data})))
}

/// A multipart error as a JSON error (413 for too large a body).
fn multipart_error(e: MultipartError) -> ApiError {
    let status = e.status();
    let error = if status == StatusCode::PAYLOAD_TOO_LARGE { "payload_too_large" } else { "invalid_request" };
    ApiError::new(status, error, format!("multipart body: {}", e.body_text()))
}

/// `POST /v1/images/edits` (multipart): `prompt`, one image as `image` or `image[]`, an
/// optional `mask`, `n`, `size`, `output_format`, `output_compression`. The image is the
/// init image of an image-to-image run (its size unless `size` is given); a mask must ask to
/// repaint everything (white everywhere), as this server does not inpaint yet.
async fn openai_edits(
    State(state): State<AppState>,
    form: Result<Multipart, MultipartRejection>,
) -> Result<Json<Value>, ApiError> {
    let mut form = form.map_err(|r| ApiError::new(r.status(), "invalid_request", r.body_text()))?;
    let mut body = serde_json::Map::new();
    let mut images: Vec<(String, Bytes)> = Vec::new();
    let mut mask: Option<Bytes> = None;
    while let Some(field) = form.next_field().await.map_err(multipart_error)? {
        let name = field.name().unwrap_or("").to_string();
        match name.as_str() {
            "image" | "image[]" => images.push((name, field.bytes().await.map_err(multipart_error)?)),
            "mask" => mask = Some(field.bytes().await.map_err(multipart_error)?),
            "prompt" | "size" | "output_format" | "response_format" | "model" | "user" | "quality" => {
                let text = field.text().await.map_err(multipart_error)?;
                body.insert(name, json!(text));
            }
            "n" | "output_compression" => {
                let text = field.text().await.map_err(multipart_error)?;
                let n: i64 = text.trim().parse().map_err(|_| ApiError::field(&name, "not an integer"))?;
                body.insert(name, json!(n));
            }
            _ => {
                let shown: String = name.chars().take(40).flat_map(char::escape_debug).collect();
                return Err(ApiError::field(&shown, "not a field of /v1/images/edits"));
            }
        }
    }
    let (image_field, image) = match images.len() {
        0 => return Err(ApiError::field("image", "missing: the image to edit")),
        1 => images.pop().expect("one image"),
        n => return Err(ApiError::field("image[]", format!("{n} images: this server edits one image per request"))),
    };
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let init = decode::image(&image_field, &b64(&image))?;
    if let Some(mask) = mask {
        let m = decode::image("mask", &b64(&mask))?;
        if (m.width, m.height) != (init.width, init.height) {
            return Err(ApiError::field(
                "mask",
                format!("{}x{} is not the image's size {}x{}", m.width, m.height, init.width, init.height),
            ));
        }
        if m.rgb.iter().any(|&v| v != 255) {
            return Err(ApiError::field(
                "mask",
                "a partial mask (inpainting) is not supported by this server yet; a mask white everywhere is",
            ));
        }
    }
    let v = Value::Object(body);
    let mut native = decode::openai(&v)?;
    if native.get("width").is_none() {
        native["width"] = json!(init.width);
        native["height"] = json!(init.height);
    }
    native["init_image"] = json!(b64(&image));
    let spec = decode::native(&native, &state.config)?;
    let (images, format) = run_sync(&state, spec).await?;
    let data: Vec<Value> = images.into_iter().map(|b64| json!({"b64_json": b64})).collect();
    Ok(Json(json!({"created": jobs::unix_now(), "output_format": format, "data": data})))
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": "sd-cpp-local", "object": "model", "owned_by": "local"}]}))
}

async fn sdapi_generate(
    state: AppState,
    b: Result<Bytes, BytesRejection>,
    img2img: bool,
) -> Result<Json<Value>, ApiError> {
    let bytes = body(b)?;
    let v = decode::parse_body(&bytes)?;
    let mut native = decode::sdapi(&v, img2img, &state.config.lora_dir)?;
    // A1111 images are PNG.
    native["output_format"] = json!("png");
    let spec = decode::native(&native, &state.config)?;
    let (images, _) = run_sync(&state, spec).await?;
    Ok(Json(json!({"images": images, "parameters": v, "info": ""})))
}

async fn txt2img(State(state): State<AppState>, b: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    sdapi_generate(state, b, false).await
}

async fn img2img(State(state): State<AppState>, b: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    sdapi_generate(state, b, true).await
}

async fn samplers() -> Json<Value> {
    let list: Vec<Value> = std::iter::once("default")
        .chain(SampleMethod::ALL.iter().map(|m| m.name()))
        .map(|n| json!({"name": n, "aliases": [n], "options": {}}))
        .collect();
    Json(Value::Array(list))
}

async fn schedulers() -> Json<Value> {
    let list: Vec<Value> = Scheduler::ALL.iter().map(|s| json!({"name": s.name(), "label": s.name()})).collect();
    Json(Value::Array(list))
}

async fn loras(State(state): State<AppState>) -> Json<Value> {
    Json(Value::Array(lora_list(&state)))
}

/// The loaded model, or the checkpoints of `--models-dir` when it is given.
async fn sd_models_list(State(state): State<AppState>) -> Json<Value> {
    let mut files = model_files(&state);
    if files.is_empty() {
        files.extend(state.model_path());
    }
    let list: Vec<Value> = files
        .iter()
        .map(|p| {
            let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            let file = p.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            json!({
                "title": stem, "model_name": stem, "filename": file,
                "hash": "00000000", "sha256": "0000000000000000000000000000000000000000000000000000000000000000",
                "config": null,
            })
        })
        .collect();
    Json(Value::Array(list))
}

async fn options(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"samples_format": "png", "sd_model_checkpoint": model_stem(&state)}))
}

/// `POST /sdapi/v1/options`: `sd_model_checkpoint` switches to a checkpoint of
/// `--models-dir` (by file name, stem, or A1111's `title [hash]`), queued behind the jobs
/// before it; `samples_format` may only be `png`.
async fn set_options(State(state): State<AppState>, b: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    let bytes = body(b)?;
    let v = decode::parse_body(&bytes)?;
    for key in v.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()).unwrap_or_default() {
        if key != "sd_model_checkpoint" && key != "samples_format" {
            let shown: String = key.chars().take(40).flat_map(char::escape_debug).collect();
            return Err(ApiError::field(&shown, "not an option this server sets"));
        }
    }
    if let Some(f) = decode::field::<String>(&v, "samples_format")? {
        if f != "png" {
            return Err(ApiError::field("samples_format", "only png"));
        }
    }
    let Some(name) = decode::field::<String>(&v, "sd_model_checkpoint")? else { return Ok(Json(json!({}))) };
    // A1111 clients send the title, `name [hash]`.
    let name = match name.rfind(" [") {
        Some(i) if name.ends_with(']') => name[..i].to_string(),
        _ => name,
    };
    const F: &str = "sd_model_checkpoint";
    if name.contains(['/', '\\']) || name == ".." || name.is_empty() {
        return Err(ApiError::field(F, "a checkpoint is named by its file name in --models-dir (no path)"));
    }
    if state.config.models_dir.is_none() {
        if name == model_stem(&state) {
            return Ok(Json(json!({})));
        }
        return Err(ApiError::field(F, "the server was started without --models-dir: it serves one model"));
    }
    let files = model_files(&state);
    let matches = |p: &&std::path::PathBuf| {
        p.file_name().is_some_and(|n| n.to_string_lossy() == name)
            || p.file_stem().is_some_and(|n| n.to_string_lossy() == name)
    };
    let Some(path) = files.iter().find(matches).cloned() else {
        let known: Vec<String> =
            files.iter().filter_map(|p| p.file_stem()).map(|s| s.to_string_lossy().into_owned()).collect();
        let shown: String = name.chars().take(60).flat_map(char::escape_debug).collect();
        return Err(ApiError::field(
            F,
            format!("no checkpoint '{shown}' in --models-dir (known: {})", known.join(", ")),
        ));
    };
    run_work(&state, Work::Switch(path)).await?;
    Ok(Json(json!({})))
}

async fn upscalers() -> Json<Value> {
    Json(json!([{"name": "None", "model_name": null, "model_path": null, "model_url": null, "scale": 4}]))
}

async fn latent_upscale_modes() -> Json<Value> {
    Json(json!([]))
}

/// A1111's `GET /sdapi/v1/progress`: the generating job's share done, ETA and state.
async fn progress(State(state): State<AppState>) -> Json<Value> {
    let st = state.lock();
    let queued = st.queue.len();
    let current = st.current.as_ref().and_then(|id| st.jobs.get(id));
    let (fraction, eta, p) = match current {
        Some(job) => {
            let p = jobs::progress_json(job);
            (jobs::fraction(&job.progress), p["eta"].as_f64().unwrap_or(0.0), p)
        }
        None => (0.0, 0.0, Value::Null),
    };
    Json(json!({
        "progress": fraction,
        "eta_relative": eta,
        "state": {
            "skipped": false,
            "interrupted": false,
            "job": current.map(|j| j.id.clone()).unwrap_or_default(),
            "job_count": queued + usize::from(current.is_some()),
            "job_timestamp": current.map(|j| j.created.to_string()).unwrap_or_default(),
            "job_no": 0,
            "sampling_step": p["step"],
            "sampling_steps": p["steps"],
        },
        "current_image": current.and_then(|j| j.preview.as_ref()).map(|p| p.b64.clone()),
        "textinfo": current.map(|j| j.progress.stage),
    }))
}

/// A1111's `POST /sdapi/v1/interrupt`: the generating job stops at its next step.
async fn interrupt(State(state): State<AppState>) -> Json<Value> {
    let id = state.interrupt();
    Json(json!({"interrupted": id}))
}
