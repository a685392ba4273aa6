//! Library errors in this program's words: the flag a typed error is about, and hints naming flags.
//!
//! The libraries name settings, devices and budgets, never a flag of this program; this is the
//! one place that knows which flag sets what.

use sd_models::files::FileRole;
use sd_models::output::{FileUse, InputRole, OutputError, OutputRole, SameFile};
use sd_models::pipeline::{Notice, PipelineError, Setting};
use sd_models::text::clip::ClipError;
use sd_vae::{TilingOption, VaeError};

/// The marker of an error found while checking a run's input, before its first expensive
/// stage: bad input, exit status 2 (as every error of `plan` is). Added as an outer context
/// whose text is empty (the report leaves it out); the errors under it keep their types.
#[derive(Debug)]
pub struct BadInput;

impl std::fmt::Display for BadInput {
    fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        Ok(())
    }
}

/// `e` marked as bad input ([`BadInput`]).
pub fn bad_input(e: anyhow::Error) -> anyhow::Error {
    e.context(BadInput)
}

/// Whether `e` was found checking the input ([`bad_input`]).
pub fn is_bad_input(e: &anyhow::Error) -> bool {
    e.downcast_ref::<BadInput>().is_some()
}

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
        Setting::Mask => "--mask",
        Setting::FlowShift => "--flow-shift",
        Setting::Prompt => "-p/--prompt-file",
        Setting::NegativePrompt => "-n/--negative-prompt-file",
        Setting::ControlStrength => "--control-strength",
        Setting::HiresScale => "--hires-scale",
        Setting::HiresSize => "--hires-width/--hires-height",
        Setting::HiresDenoisingStrength => "--hires-denoising-strength",
        Setting::Hires => "--hires",
        Setting::RefImage => "-r",
        Setting::SlgScale => "--slg-scale",
        Setting::ImgCfgScale => "--img-cfg-scale",
    }
}

/// The flag that names a file of `role`.
fn role_flag(role: FileRole) -> &'static str {
    match role {
        FileRole::Checkpoint => "-m/--model",
        FileRole::DiffusionModel => "--diffusion-model",
        FileRole::Vae => "--vae",
        FileRole::TextEncoder(1) => "--clip_g",
        FileRole::TextEncoder(_) => "--clip_l (or --clip_g)",
        FileRole::Taesd => "--taesd",
        FileRole::T5xxl => "--t5xxl",
        FileRole::Llm => "--llm",
    }
}

/// The one flag that names a file of `role` (a first text encoder is CLIP-L's).
fn one_role_flag(role: FileRole) -> &'static str {
    match role {
        FileRole::TextEncoder(0) => "--clip_l",
        r => role_flag(r),
    }
}

/// A notice of the loaded model ([`sd_models::pipeline::Notice`]) with the flag that changes it.
pub fn notice(n: &Notice) -> String {
    match n {
        Notice::PredictionAssumed => format!("{n} (--prediction v for 768-v models)"),
        Notice::MissingOptional { role, .. } => format!("{n} (give it with {})", one_role_flag(*role)),
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

/// The flag that names an input file of role `r`.
fn input_flag(r: InputRole) -> &'static str {
    match r {
        InputRole::Model => "-m",
        InputRole::DiffusionModel => "--diffusion-model",
        InputRole::Vae => "--vae",
        InputRole::ClipL => "--clip_l",
        InputRole::ClipG => "--clip_g",
        InputRole::T5xxl => "--t5xxl",
        InputRole::Taesd => "--taesd",
        InputRole::Llm => "--llm",
        InputRole::PromptFile => "--prompt-file",
        InputRole::NegativePromptFile => "--negative-prompt-file",
        InputRole::InitImage => "-i",
        InputRole::Mask => "--mask",
        InputRole::Lora => "a <lora:> tag of -p",
        InputRole::DeviceProfile => "--devices",
        InputRole::UpscaleModel => "--upscale-model",
        InputRole::ControlNet => "--control-net",
        InputRole::ControlImage => "--control-image",
        InputRole::RefImage => "-r",
    }
}

/// The flag that names an output of role `r`.
fn output_flag(r: OutputRole) -> &'static str {
    match r {
        OutputRole::Image => "-o",
        OutputRole::Report => "--report-json",
    }
}

/// An output that is an input or another output, saying which flags name the two.
pub fn same_file(e: SameFile) -> anyhow::Error {
    let other = match e.other {
        FileUse::Input(r) => input_flag(r),
        FileUse::Output(r) => output_flag(r),
    };
    let out = output_flag(e.output);
    anyhow::Error::new(e).context(format!("{out} and {other} name the same file"))
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
        if let Some(OutputError { needs_consent: true, .. }) = cause.downcast_ref() {
            out.push("--overwrite replaces it with the image (a PNG); or name the output .png, .jpg or .webp".into());
        }
        match cause.downcast_ref::<PipelineError>() {
            Some(PipelineError::MisplacedFile { found, .. }) => {
                out.push(format!("give it as {}", one_role_flag(*found)))
            }
            Some(PipelineError::MissingComponent { role, .. }) => {
                out.push(format!("give it with {}", role_flag(*role)))
            }
            Some(PipelineError::NoTaesd { .. }) => out.push("drop --taesd to decode with the VAE".into()),
            _ => {}
        }
        if let Some(sd_models::files::FilesError::NoModel) = cause.downcast_ref() {
            out.push("pass -m/--model, or --diffusion-model with its components".into());
        }
        if let Some(sd_models::files::FilesError::WrongComponent { found, .. }) = cause.downcast_ref() {
            out.push(format!("pass it with {}", role_flag(*found)));
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
