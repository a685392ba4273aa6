//! Our side, in process: the wiring of `sd_models::pipeline` for one component at a time.

use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use sd_backends::{Backend, BackendManager, PluginRegistry, PluginSearch};
use sd_models::diffusion::unet::{UNetConfig, UNetModel};
use sd_models::family::TextEncoder;
use sd_models::files::ModelFiles;
use sd_models::loader::{dtype_of, FileSource};
use sd_models::text::clip::{clip_specs, ClipConfig, ClipTextModel};
use sd_models::text::conditioning::encode_prompt;
use sd_models::text::{ChunkConfig, ClipTokenizer};
use sd_sched::{Runner, Weights};
use sd_vae::{AutoencoderKl, VaeConfig, VaeParts};

use super::*;

/// A CPU backend with `threads` threads; the registry stays alive with it.
pub(crate) struct Cpu {
    _registry: PluginRegistry,
    pub(crate) backend: Arc<Backend>,
}

impl Cpu {
    pub(crate) fn new(threads: u32) -> Result<Cpu> {
        let registry = PluginRegistry::discover(&PluginSearch::standard(Vec::new()));
        let device = registry
            .device("cpu")
            .context("no CPU device among the loaded ggml plugins (run `cargo xtask plugins`?)")?;
        let backend = BackendManager::new(Some(threads as usize)).get(device).context("creating the CPU backend")?;
        Ok(Cpu { _registry: registry, backend })
    }
}

/// The module configurations of the detected architecture.
pub(crate) fn configs(files: &ModelFiles) -> Result<(ClipConfig, UNetConfig, u32)> {
    let detected = files.detect(None)?;
    let Some((clip, unet)) = sd_models::family::sd::configs(detected.arch) else {
        bail!("architecture `{}` is not compared by this command", detected.arch)
    };
    // Probe points per text-encoder layout (ViT-L's 12 layers, ViT-H's 24).
    let points = if clip.n_layers > 12 { CLIP_H_POINTS } else { CLIP_L_POINTS };
    Ok((clip, unet, points))
}

/// A family's conditioner as the pipeline builds it (`sd_models::family`), with what the
/// harness needs to compare it: its tokenizer's chunking and the rounding points of its
/// token states and of its vector (0: the family has none).
pub(crate) struct FamilyText {
    pub encoder: Box<dyn TextEncoder>,
    pub chunks: ChunkConfig,
    pub points: u32,
    pub vector_points: u32,
}

/// The conditioner of `files`' family, its weights in the CPU's memory.
pub(crate) fn load_family_text(cpu: &Cpu, files: &ModelFiles) -> Result<FamilyText> {
    let detected = files.detect(None)?;
    let (chunks, points, vector_points) = match sd_models::family::sd::configs(detected.arch) {
        Some((clip, _)) => (clip.chunk_config(), if clip.n_layers > 12 { CLIP_H_POINTS } else { CLIP_L_POINTS }, 0),
        // SDXL: CLIP-L's tokens; bigG is the longer path of both outputs.
        None if detected.arch == "sdxl" => (ClipConfig::vit_l14_sdxl().chunk_config(), BIGG_POINTS, BIGG_POOLED_POINTS),
        None => bail!("architecture `{}` is not compared by this command", detected.arch),
    };
    let family = sd_models::family::for_detected(&detected, files)?;
    let dtype = dtype_of(files);
    let mut w = Weights::new(family.text_specs(&dtype, None))?;
    w.allocate(cpu.backend.device().buffer_type())?;
    w.load_from(&FileSource::new(files))?;
    Ok(FamilyText { encoder: family.load_text(w)?, chunks, points, vector_points })
}

/// Our text encoder of `files`, its weights in the CPU's memory.
pub(crate) fn load_clip(cpu: &Cpu, files: &ModelFiles, clip: &ClipConfig) -> Result<ClipTextModel> {
    let src = FileSource::new(files);
    let dtype = dtype_of(files);
    let mut w = Weights::new(clip_specs(clip, &dtype, None))?;
    w.allocate(cpu.backend.device().buffer_type())?;
    w.load_from(&src)?;
    Ok(ClipTextModel::new(clip.clone(), w)?)
}

/// Our conditioning of each prompt, `(data, n_tokens, hidden)`.
pub(super) fn our_text(
    cpu: &Cpu,
    files: &ModelFiles,
    clip: &ClipConfig,
    prompts: &[&str],
) -> Result<Vec<(Vec<f32>, usize, usize)>> {
    let model = load_clip(cpu, files, clip)?;
    let mut runner = Runner::new("te", cpu.backend.clone());
    let tokenizer = ClipTokenizer::new();
    prompts
        .iter()
        .map(|p| {
            let c = encode_prompt(&model, &mut runner, &tokenizer, p, -1)?;
            Ok((c.data, c.n_tokens, c.hidden_size))
        })
        .collect()
}

pub(super) fn our_unet(
    cpu: &Cpu,
    files: &ModelFiles,
    cfg: &UNetConfig,
    x: &[f32],
    context: &[f32],
    n_ctx: usize,
) -> Result<Vec<f32>> {
    let src = FileSource::new(files);
    let dtype = dtype_of(files);
    let unet = UNetModel::load(cfg.clone(), &dtype, None, cpu.backend.device().buffer_type(), &src)?;
    let mut runner = Runner::new("unet", cpu.backend.clone());
    Ok(unet.eval(&mut runner, x, (LATENT_SIDE, LATENT_SIDE), &[TIMESTEP], context, n_ctx, 1)?)
}

pub(super) fn our_vae(cpu: &Cpu, files: &ModelFiles, latent: &[f32]) -> Result<Vec<f32>> {
    let src = FileSource::new(files);
    let cfg = VaeConfig::sd();
    let vae = AutoencoderKl::load(cfg.clone(), VaeParts::DecoderOnly, &src, cpu.backend.device().buffer_type())?;
    let mut runner = Runner::new("vae", cpu.backend.clone());
    let mut z = latent.to_vec();
    cfg.diffusion_to_vae(&mut z);
    Ok(vae.decode(&mut runner, &z, (LATENT_SIDE, LATENT_SIDE), cfg.z_channels)?)
}
