//! `sd-cli serve`: load the model once and serve it over HTTP (the `sd-server` library).

use std::process::ExitCode;

use anyhow::{Context as _, Result};
use clap::Args;

use crate::generate::{load, GenerateArgs, Loaded};
use crate::DeviceArgs;

/// `serve`'s flags: the server's own, and every generation flag (the model and its
/// placement, and the defaults of fields a request leaves out).
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub server: sd_server::ServerArgs,
    #[command(flatten)]
    pub generate: GenerateArgs,
}

/// Loads the model, then serves until the process is stopped.
pub fn run(a: &ServeArgs, dev: &DeviceArgs) -> Result<ExitCode> {
    let g = &a.generate;
    let (defaults, loras) = g.params()?;
    if !loras.is_empty() {
        anyhow::bail!("-p: LoRA tags in the default prompt are not applied by the server; requests name LoRAs in their `lora` field");
    }
    if let Some(m) = &g.upscale.upscale_model {
        anyhow::bail!(
            "--upscale-model {}: the server does not upscale its images (use sd-cli -M upscale on them)",
            m.display()
        );
    }
    let defaults = defaults.params().clone();
    if let Some(dir) = &a.server.models_dir {
        if !dir.is_dir() {
            anyhow::bail!("--models-dir '{}' is not a directory", dir.display());
        }
    }
    let size = (defaults.width, defaults.height);
    let Loaded { pipeline, model, .. } = load(g, dev, g.model.or_fixture(crate::generate::ensure_fixture)?, size, &[])?;
    let model_path = model.model.clone().or(model.diffusion_model.clone()).unwrap_or_default();
    // A model switch loads another checkpoint with the same context flags.
    let (g2, dev2) = (g.clone(), dev.clone());
    let loader: sd_server::Loader = Box::new(move |path: &std::path::Path| {
        let mut m = model.clone();
        m.model = Some(path.to_path_buf());
        m.diffusion_model = None;
        load(&g2, &dev2, m, size, &[]).map(|l| l.pipeline).map_err(|e| format!("{e:#}"))
    });
    let config =
        sd_server::Config::new(&a.server, g.lora.lora_model_dir.clone(), g.lora.lora_apply_mode, model_path, defaults);
    sd_server::serve(pipeline, config, loader, |addr| crate::out!("sd-server listening on http://{addr}"))
        .context("sd-cli serve")?;
    Ok(ExitCode::SUCCESS)
}
