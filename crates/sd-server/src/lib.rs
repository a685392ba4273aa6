//! sd-server: one loaded model served over HTTP with stable-diffusion.cpp's three server APIs.
//!
//! The model is loaded once by the caller (`sd-cli serve` builds the [`Pipeline`] with every
//! context flag of a generation) and handed to [`serve`], which binds the listener, starts the
//! HTTP side (axum on a small tokio runtime) and then runs jobs on the calling thread, one at
//! a time, in the order they were accepted. The pipeline never leaves that thread: requests
//! reach it only as decoded, validated jobs through the queue ([`jobs`]).
//!
//! The API families follow stable-diffusion.cpp's `examples/server/api.md` (upstream 97d2990):
//! - native async jobs: `GET /sdcpp/v1/capabilities`, `POST /sdcpp/v1/img_gen` (202 with
//!   `{id, poll_url}`, 429 when the queue is full), `GET /sdcpp/v1/jobs/{id}`,
//!   `POST /sdcpp/v1/jobs/{id}/cancel`;
//! - OpenAI: `POST /v1/images/generations`, `POST /v1/images/edits`, `GET /v1/models`;
//! - A1111: `POST /sdapi/v1/txt2img`, `POST /sdapi/v1/img2img`, the `GET /sdapi/v1/...`
//!   lists, and (beyond the reference) `GET /sdapi/v1/progress`, `POST /sdapi/v1/interrupt`,
//!   `POST /sdapi/v1/options` (model switching among `--models-dir`);
//! - beyond the reference: `GET /sdcpp/v1/jobs/{id}/events` (server-sent events), previews
//!   in the job JSON ([`preview`]), and the web page at `/` ([`page`]).
//!
//! LoRAs come from the `lora` field, and in sdapi prompts from A1111's `<lora:name:weight>`
//! tags too (the reference parses tags in no API; A1111 clients write them); the native and
//! OpenAI prompts keep tags as text, as the reference does. What it refuses: LoRA and model
//! names that leave their directories, and every field the runtime cannot honour (partial
//! masks, reference images, hires fix, custom sigmas): a 400 naming the field, never a silent
//! default. Bad input never reaches the pipeline: every body is decoded and checked on the
//! HTTP side ([`decode`]).

mod decode;
#[doc(hidden)]
pub mod fuzzing;
mod images;
mod jobs;
mod page;
mod preview;
mod routes;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use sd_models::lora::ApplyMode;
use sd_models::pipeline::{GenerateParams, Pipeline};

/// The server's own flags (names as the reference's `sd-server`).
#[derive(clap::Args, Debug, Clone)]
pub struct ServerArgs {
    /// Address to listen on (a warning is logged for anything but loopback).
    #[arg(short = 'l', long = "listen-ip", default_value = "127.0.0.1")]
    pub listen_ip: IpAddr,
    /// Port to listen on (0: any free port, printed at startup).
    #[arg(long = "listen-port", default_value_t = 1234)]
    pub listen_port: u16,
    /// [sd-rs] Require `Authorization: Bearer KEY` on every endpoint.
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_key: Option<String>,
    /// [sd-rs] Jobs accepted and not yet finished (queued or generating) before new ones are
    /// answered 429.
    #[arg(long = "max-queue", value_name = "N", default_value_t = 64)]
    pub max_queue: usize,
    /// [sd-rs] Largest request body in MiB (larger ones are answered 413).
    #[arg(long = "max-body-mib", value_name = "MIB", default_value_t = 32)]
    pub max_body_mib: usize,
    /// [sd-rs] A generating job's preview (its latent projected to RGB, PNG) is renewed
    /// every N sampling steps and at the last; 0: no previews.
    #[arg(long = "preview-interval", value_name = "N", default_value_t = 1)]
    pub preview_interval: usize,
    /// Directory of the checkpoints `POST /sdapi/v1/options {"sd_model_checkpoint": NAME}`
    /// may switch to (its top level; the old model is freed before the new one loads).
    #[arg(long = "models-dir", value_name = "DIR")]
    pub models_dir: Option<PathBuf>,
}

/// Everything the server needs besides the pipeline.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The bearer key every request must carry, if any.
    pub api_key: Option<String>,
    /// Jobs pending (queued or generating) at most.
    pub max_queue: usize,
    /// Largest request body in bytes.
    pub max_body: usize,
    /// Sampling steps between previews (0: none).
    pub preview_interval: usize,
    /// The checkpoints a request may switch to.
    pub models_dir: Option<PathBuf>,
    /// The directory every request's LoRA names are confined to.
    pub lora_dir: PathBuf,
    /// How LoRAs are applied (`--lora-apply-mode`).
    pub lora_apply_mode: ApplyMode,
    /// The model file, for `/v1/models`, `/sdapi/v1/sd-models` and capabilities.
    pub model_path: PathBuf,
    /// Values of fields a request leaves out (the generation flags given at startup).
    pub defaults: GenerateParams,
}

impl Config {
    /// A configuration from the flags, with the rest given by the caller.
    pub fn new(
        args: &ServerArgs,
        lora_dir: PathBuf,
        lora_apply_mode: ApplyMode,
        model_path: PathBuf,
        defaults: GenerateParams,
    ) -> Config {
        Config {
            listen: SocketAddr::new(args.listen_ip, args.listen_port),
            api_key: args.api_key.clone(),
            max_queue: args.max_queue.max(1),
            max_body: args.max_body_mib.saturating_mul(1 << 20),
            preview_interval: args.preview_interval,
            models_dir: args.models_dir.clone(),
            lora_dir,
            lora_apply_mode,
            model_path,
            defaults,
        }
    }
}

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The listener could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The async runtime could not start.
    #[error("cannot start the HTTP runtime")]
    Runtime(#[source] std::io::Error),
}

/// Loads the checkpoint at a path with the server's context flags (model switching): the
/// pipeline, or the error's message.
pub type Loader = Box<dyn FnMut(&std::path::Path) -> Result<Pipeline, String>>;

/// Serves `pipeline` until the process ends: binds `config.listen`, calls `ready` with the
/// bound address, then runs the queued jobs on this thread (`load` loads the checkpoints a
/// model switch asks for).
pub fn serve(
    pipeline: Pipeline,
    config: Config,
    load: Loader,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), ServerError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("sd-server-http")
        .build()
        .map_err(ServerError::Runtime)?;
    let addr = config.listen;
    let std_listener = std::net::TcpListener::bind(addr).map_err(|source| ServerError::Bind { addr, source })?;
    std_listener.set_nonblocking(true).map_err(|source| ServerError::Bind { addr, source })?;
    let bound = std_listener.local_addr().map_err(|source| ServerError::Bind { addr, source })?;
    if !bound.ip().is_loopback() {
        tracing::warn!(
            "listening on {bound}, which is not a loopback address: anyone who can reach it can generate{}",
            if config.api_key.is_some() { " with the API key" } else { " (no --api-key is set)" }
        );
    }
    let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let state = Arc::new(jobs::Shared::new(config, cancel));
    let pipeline = jobs::hooked(&state, pipeline);
    let app = routes::router(state.clone());
    let listener = {
        let _guard = runtime.enter();
        tokio::net::TcpListener::from_std(std_listener).map_err(|source| ServerError::Bind { addr, source })?
    };
    runtime.spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("the HTTP server stopped: {e}");
        }
    });
    tracing::info!("listening on http://{bound}");
    ready(bound);
    jobs::work(&state, pipeline, load);
    Ok(())
}
