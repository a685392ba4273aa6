//! The server's HTTP side without a model, for the request-decoding fuzz target
//! (`crates/sd-server/fuzz`): the real router (API key check, body limit, JSON and multipart
//! decoding, every endpoint's validation) answering requests in process, with a queue that
//! takes no job, so that a request decoded and accepted is answered 429 instead of waiting
//! for a model. What a request may never get from it is a 5xx, a body that is not JSON
//! (but the page at `/`), or a panic.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, Request};
use sd_models::lora::ApplyMode;
use sd_models::pipeline::GenerateParams;
use tower::ServiceExt as _;

use crate::{jobs, routes, Config};

/// The router on a single-threaded runtime.
pub struct Harness {
    runtime: tokio::runtime::Runtime,
    app: axum::Router,
}

impl Harness {
    /// A router whose LoRA names are confined to `lora_dir` and model names to `models_dir`,
    /// with a body limit of `max_body` bytes and an empty queue of no room.
    pub fn new(lora_dir: PathBuf, models_dir: Option<PathBuf>, max_body: usize) -> std::io::Result<Harness> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        // sd-cli's defaults, at the smallest size.
        let defaults = GenerateParams {
            prompt: String::new(),
            negative_prompt: String::new(),
            width: 64,
            height: 64,
            steps: 1,
            cfg_scale: None,
            guidance: 3.5,
            method: None,
            scheduler: None,
            seed: 42,
            batch_count: 1,
            rng: sd_models::sampling::RngKind::Cuda,
            clip_skip: -1,
            eta: None,
            init_image: None,
            strength: 0.75,
            mask: None,
            tiling: sd_vae::TilingParams::default(),
            vae_max_compute_bytes: None,
            flow_shift: None,
            control_image: None,
            control_strength: 0.9,
            hires: None,
            ref_images: Vec::new(),
            auto_resize_ref_images: true,
            increase_ref_index: false,
            slg: None,
            img_cfg_scale: None,
        };
        let config = Config {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            api_key: None,
            // Every job is refused: decoding is what runs.
            max_queue: 0,
            max_body,
            preview_interval: 0,
            models_dir,
            lora_dir,
            lora_apply_mode: ApplyMode::Auto,
            model_path: PathBuf::from("model.safetensors"),
            defaults,
        };
        let state = Arc::new(jobs::Shared::new(config, Arc::new(AtomicBool::new(false))));
        Ok(Harness { runtime, app: routes::router(state) })
    }

    /// The status and body the server answers `method path` with `body` (of `content_type`).
    pub fn answer(&self, method: &str, path: &str, content_type: Option<&str>, body: Vec<u8>) -> (u16, Vec<u8>) {
        let mut req = Request::builder().method(method).uri(path).header(header::CONTENT_LENGTH, body.len());
        if let Some(ct) = content_type {
            req = req.header(header::CONTENT_TYPE, ct);
        }
        let req = match req.body(Body::from(body)) {
            Ok(r) => r,
            // A method or path http refuses never reaches a server either.
            Err(_) => return (400, b"{}".to_vec()),
        };
        self.runtime.block_on(async {
            let resp = match self.app.clone().oneshot(req).await {
                Ok(r) => r,
                Err(e) => match e {},
            };
            let status = resp.status().as_u16();
            let bytes =
                axum::body::to_bytes(resp.into_body(), usize::MAX).await.map(|b| b.to_vec()).unwrap_or_default();
            (status, bytes)
        })
    }
}
