//! Library errors in this program's words: the flag a typed error is about, and hints naming flags.
//!
//! The libraries name settings, devices and budgets, never a flag of this program; this is the
//! one place that knows which flag sets what.

use sd_models::pipeline::{PipelineError, Setting};
use sd_models::text::clip::ClipError;
use sd_vae::{TilingOption, VaeError};

/// The flag that sets `s`.
fn flag(s: Setting) -> &'static str {
    match s {
        Setting::Width => "-W",
        Setting::Height => "-H",
        Setting::Steps => "--steps",
        Setting::BatchCount => "-b",
        Setting::CfgScale => "--cfg-scale",
        Setting::Guidance => "--guidance",
        Setting::Eta => "--eta",
        Setting::Strength => "--strength",
        Setting::FlowShift => "--flow-shift",
        Setting::Prompt => "-p/--prompt-file",
        Setting::NegativePrompt => "-n/--negative-prompt-file",
    }
}

/// The flag that sets `o`.
fn tiling_flag(o: TilingOption) -> &'static str {
    match o {
        TilingOption::TileSize => "--vae-tile-size",
        TilingOption::Overlap => "--vae-tile-overlap",
        TilingOption::RelativeSize => "--vae-relative-tile-size",
    }
}

/// A tiling error, saying which flag it is about.
pub fn tiling_with_flag(e: VaeError) -> anyhow::Error {
    match e {
        VaeError::Tiling { option, message } => anyhow::anyhow!("{}: {message}", tiling_flag(option)),
        VaeError::TilingOff { option } => anyhow::anyhow!("{}: requires --vae-tiling", tiling_flag(option)),
        e => e.into(),
    }
}

/// `e`, saying which flag it is about where it is about one.
pub fn with_flag(e: PipelineError) -> anyhow::Error {
    match e {
        PipelineError::Vae(e @ (VaeError::Tiling { .. } | VaeError::TilingOff { .. })) => tiling_with_flag(e),
        PipelineError::Setting { setting, value, problem } if value.is_empty() => {
            anyhow::anyhow!("{}: {problem}", flag(setting))
        }
        PipelineError::Setting { setting, value, problem } => anyhow::anyhow!("{} {value}: {problem}", flag(setting)),
        PipelineError::WorkingMemory { width, height, .. } => {
            anyhow::Error::new(e).context(format!("-W {width} -H {height}"))
        }
        PipelineError::Text(ClipError::ClipSkip { .. }) => anyhow::Error::new(e).context("--clip-skip"),
        e => e.into(),
    }
}

/// Lines that tell what flag would help with `e`, if any.
pub fn hints(e: &anyhow::Error) -> Vec<String> {
    let mut out = Vec::new();
    for cause in e.chain() {
        if let Some(p) = cause.downcast_ref::<PipelineError>() {
            match p {
                PipelineError::WorkingMemory { flash_attn: false, .. } => {
                    out.push("--diffusion-fa (flash attention) or --vae-tiling lower the working memory".into())
                }
                PipelineError::MissingTensors { module: "VAE", .. } => {
                    out.push("give a VAE with --vae (or a TAESD with --taesd)".into())
                }
                PipelineError::MissingTensors { module: "TAESD", .. } => {
                    out.push("is the --taesd file a TAESD?".into())
                }
                _ => {}
            }
        }
        if let Some(sd_models::files::FilesError::NoModel) = cause.downcast_ref() {
            out.push("pass -m/--model, or --diffusion-model with its components".into());
        }
        if let Some(s) = cause.downcast_ref::<sd_sched::SchedError>() {
            if matches!(s, sd_sched::SchedError::OverBudget { .. } | sd_sched::SchedError::Plan(_)) {
                out.push(
                    "--max-vram sets a device's budget; --params-backend moves parameters off it (cpu, disk)".into(),
                );
            }
        }
    }
    out
}
