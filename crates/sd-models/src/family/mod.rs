//! Model families: what the pipeline needs from a model, registered once per family.
//!
//! A family turns detected files into a [`Family`]: its conditioner (prompt -> the
//! [`Conditioning`] its diffusion model reads), its diffusion model (latent, timestep and
//! conditioning -> prediction, with its graph cuts and its parameter groups), its first stage
//! (VAE and TAESD configurations) and its sampling defaults. The pipeline
//! (`crate::pipeline`), the placement wiring and the CLI only call this trait; none of them
//! names a family.
//!
//! A family lives in one folder under `family/` and registers itself with one
//! `inventory::submit!` of a [`FamilySpec`]; the [`crate::files::ArchSpec`] that detects its
//! files and numbers their blocks is registered by its file in `sd-arch` (`sd_arch::flux`
//! for `family/flux`), which needs no ggml. [`for_detected`] picks the spec whose `arch` is
//! the detected one. SD 1.x and 2.x are [`sd`].

pub mod chroma;
pub mod flux;
pub mod flux2;
pub mod sd;
pub mod sd3;
pub mod sdxl;
pub mod zimage;

use std::fmt::Debug;

use sd_backends::GgmlType;
use sd_sched::{Runner, TensorSpec, Weights};
use sd_vae::{TaesdConfig, VaeConfig};

use crate::files::{Detected, ModelFiles};
use crate::pipeline::{PipelineError, Result};
use crate::sampling::{AysLevels, SampleMethod, Schedule};
use crate::text::conditioning::Conditioning;

/// The storage type of each tensor in the files, by internal name (`crate::loader::dtype_of`).
pub type DtypeOf<'a> = &'a dyn Fn(&str) -> Option<GgmlType>;

/// One registered model family: the detected architecture it runs and how to build it.
#[derive(Debug)]
pub struct FamilySpec {
    /// The [`crate::files::ArchSpec::name`] it runs (`"sd1"`).
    pub arch: &'static str,
    /// Builds the family for detected files (configurations adapted to the tensors).
    pub build: fn(&Detected, &ModelFiles) -> Result<Box<dyn Family>>,
}

inventory::collect!(FamilySpec);

/// Whether `files` hold an inpainting model: an SD 1.x/2.x/SDXL UNet whose input convolution
/// takes 9 channels (the latent, the mask, the masked image's latent), as the reference tells
/// `SD 1.x Inpaint` (and 2.x, SDXL) apart.
pub fn is_inpainting(files: &ModelFiles) -> bool {
    let conv_in = files.index().get(sd_arch::sd::UNET_CONV_IN);
    conv_in.is_some_and(|e| e.shape.len() == 4 && e.shape[1] == 9)
}

/// The family that runs `detected`, built for `files`; an error when no family is
/// registered for the architecture.
pub fn for_detected(detected: &Detected, files: &ModelFiles) -> Result<Box<dyn Family>> {
    match inventory::iter::<FamilySpec>.into_iter().find(|f| f.arch == detected.arch) {
        Some(spec) => (spec.build)(detected, files),
        None => Err(PipelineError::Invalid(format!("architecture `{}` has no runtime yet", detected.arch))),
    }
}

/// Every tensor of each `(module, specs)` exists in `files` with the expected number of
/// elements (the `arch` model's); an error names the misshapen tensor with its stored name and
/// file, or else the module, the first missing tensors and the files searched.
pub fn check_specs(arch: &str, files: &ModelFiles, modules: &[(&'static str, Vec<TensorSpec>)]) -> Result<()> {
    let index = files.index();
    let searched = || index.files().iter().map(|f| format!("'{}'", f.path.display())).collect::<Vec<_>>().join(", ");
    for (module, specs) in modules {
        // A tensor of another shape first: it says which variant the file is (a TAEF1 given
        // for TAEF2, a VAE of another latent width), where the tensors it lacks would not.
        for s in specs {
            let Some(e) = index.get(&s.name) else { continue };
            if !same_layout(&e.ne(), &s.ne) {
                let expected: Vec<i64> = s.ne.iter().rev().copied().collect();
                let swapped = if e.n_elements() as i64 == s.ne.iter().product::<i64>() {
                    " (the same number of elements in another layout: dimensions swapped or transposed)"
                } else {
                    ""
                };
                return Err(PipelineError::Invalid(format!(
                    "{module}: tensor '{}' in '{}' has shape {:?}; the {arch} model expects shape {:?} \
                     (ggml ne {:?}){swapped}",
                    e.original_name,
                    index.files()[e.file].path.display(),
                    e.shape,
                    expected,
                    s.ne
                )));
            }
        }
        let missing: Vec<&str> = specs.iter().filter(|s| !index.contains(&s.name)).map(|s| s.name.as_str()).collect();
        if !missing.is_empty() {
            return Err(PipelineError::MissingTensors {
                module,
                missing: missing.len(),
                total: specs.len(),
                files: searched(),
                first: missing[..missing.len().min(3)].join(", "),
            });
        }
    }
    Ok(())
}

/// Whether a stored tensor of ggml dimensions `stored` holds the elements of a parameter of
/// dimensions `want` in the same order: equal once dimensions of 1 are dropped. A dimension
/// of 1 moves no element, so this accepts every legitimate variant of one layout (a 1x1
/// convolution kernel `[1, 1, in, out]` stored as a linear weight `[in, out]` or the other
/// way round, as SD 2's and SDXL's `proj_in`/`proj_out` and the VAE's attention projections
/// are in some files; a bias stored as `[1, c, 1, 1]`), and refuses two dimensions swapped
/// (CLIP's `fc1` transposed has the same element count, but every row is wrong).
fn same_layout(stored: &[u64], want: &[i64]) -> bool {
    let stored = stored.iter().map(|&d| d as i64).filter(|&d| d != 1);
    stored.eq(want.iter().copied().filter(|&d| d != 1))
}

/// The family of `files`, detected without logging (a caller has detected and logged it
/// already), or `None` when it is unknown.
pub fn of_files_quietly(files: &ModelFiles) -> Option<Box<dyn Family>> {
    let silent = tracing::subscriber::NoSubscriber::default();
    let detected = tracing::subscriber::with_default(silent, || files.detect(None)).ok()?;
    for_detected(&detected, files).ok()
}

/// For `sd-cli plan` (headers only): the files' architecture is detected (an unknown one is
/// refused with the same error a generation gives), and when a registered family runs it,
/// every tensor its text encoder and diffusion model need is there with its shape. An
/// architecture detected but without a runtime passes: a plan describes it from its headers.
///
/// The same modules as a generation checks before it loads ([`generation_specs`]), the
/// first stage's decoder included: `plan` and a generation refuse the same files.
pub fn check_runnable(files: &ModelFiles) -> Result<()> {
    let detected = files.detect(None)?;
    if !inventory::iter::<FamilySpec>.into_iter().any(|f| f.arch == detected.arch) {
        return Ok(());
    }
    let family = for_detected(&detected, files)?;
    check_specs(family.arch(), files, &generation_specs(family.as_ref(), files, None, false)?)
}

/// The tensors of the modules a generation loads: the text encoder, the diffusion model and
/// the first stage (the TAESD when the files hold one, else the VAE; its encoder too when
/// `need_encoder`, for img2img). One list for [`check_runnable`] and the pipeline's check.
pub(crate) fn generation_specs(
    family: &dyn Family,
    files: &ModelFiles,
    wtype: Option<GgmlType>,
    need_encoder: bool,
) -> Result<[(&'static str, Vec<TensorSpec>); 3]> {
    let dtype = crate::loader::dtype_of(files);
    let taesd = files.index().files().iter().any(|f| f.role == crate::files::FileRole::Taesd);
    let first = match family.vae() {
        // Pixel space: no autoencoder.
        None => ("first stage", Vec::new()),
        Some(_) if taesd => {
            let parts = if need_encoder { sd_vae::TaesdParts::Full } else { sd_vae::TaesdParts::DecoderOnly };
            ("TAESD", sd_vae::taesd_specs(&taesd_config(family)?, parts))
        }
        Some(cfg) => {
            let parts = if need_encoder { sd_vae::VaeParts::Full } else { sd_vae::VaeParts::DecoderOnly };
            ("VAE", sd_vae::vae_specs(&cfg, parts))
        }
    };
    Ok([
        ("text encoder", family.text_specs(&dtype, wtype)),
        ("diffusion model", family.diffusion_specs(&dtype, wtype)),
        first,
    ])
}

/// The family's TAESD, or an error when it takes none.
pub(crate) fn taesd_config(family: &dyn Family) -> Result<TaesdConfig> {
    family.taesd().ok_or_else(|| PipelineError::NoTaesd { family: family.arch() })
}

/// The staging group of a text-encoder or VAE tensor: its name up to the first block index
/// (`...encoder.layers.3`, `...decoder.up.1`), or without its last part.
pub(crate) fn block_group(name: &str) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    let is_block = |p: &&str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    match parts.iter().position(is_block) {
        Some(i) => parts[..=i].join("."),
        None => parts[..parts.len().saturating_sub(1).max(1)].join("."),
    }
}

/// What the conditioner reads from a request, besides the prompt.
#[derive(Clone, Copy, Debug)]
pub struct TextRequest<'a> {
    /// The prompt (or the negative prompt), with its weighting syntax.
    pub prompt: &'a str,
    /// `--clip-skip` (<= 0: the family's default).
    pub clip_skip: i64,
    /// Image width in pixels (families with size conditioning read it).
    pub width: usize,
    /// Image height in pixels.
    pub height: usize,
    /// Whether this is the negative prompt (SDXL zeroes an empty one).
    pub negative: bool,
}

/// What a diffusion model is loaded with besides its parameters.
#[derive(Clone, Copy, Debug)]
pub struct DiffusionSettings {
    /// `--diffusion-fa`: flash attention where the device supports it.
    pub flash_attn: bool,
    /// `--guidance`: the distilled guidance scale of models that take one (FLUX.1 dev).
    pub guidance: f32,
}

/// How a family samples when the user does not say.
#[derive(Clone, Debug)]
pub struct SamplingDefaults {
    /// Its Align Your Steps noise levels (`--scheduler ays`).
    pub ays: AysLevels,
    /// `--sampling-method` when none is given.
    pub method: SampleMethod,
    /// The noise schedule of the diffusion model.
    pub schedule: Schedule,
    /// `--cfg-scale` when none is given: 7 (the reference's default) for models trained
    /// with classifier-free guidance, 1 for guidance-distilled ones (FLUX.1).
    pub cfg_scale: f32,
}

/// A model family built for a set of files.
pub trait Family: Send + Sync + Debug {
    /// The architecture it runs (`sd1`).
    fn arch(&self) -> &'static str;

    /// The conditioner's parameters (internal names, shapes, storage types).
    fn text_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec>;
    /// Checks the request's text settings (e.g. `--clip-skip` against the encoder's depth).
    fn check_text(&self, clip_skip: i64) -> Result<()>;
    /// The conditioner over its placed parameters.
    fn load_text(&self, weights: Weights) -> Result<Box<dyn TextEncoder>>;
    /// The parameter group (one per layer) a text-encoder tensor is staged in.
    fn text_group(&self, name: &str) -> String {
        block_group(name)
    }
    /// Whether a text-encoder parameter is cut by output rows in a graph-level row split
    /// (`sd_sched`'s `rowsplit`: a matmul weight of a layer).
    fn text_row_splittable(&self, spec: &TensorSpec) -> bool;

    /// The diffusion model's parameters.
    fn diffusion_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec>;
    /// The parameter group (one per block) a diffusion-model tensor is staged in.
    fn diffusion_group(&self, name: &str) -> String;
    /// Whether a diffusion-model parameter is cut by output rows in a graph-level row split.
    fn diffusion_row_splittable(&self, spec: &TensorSpec) -> bool;
    /// The diffusion model over its placed parameters.
    fn load_diffusion(&self, weights: Weights, settings: &DiffusionSettings) -> Result<Box<dyn DiffusionModel>>;
    /// Channels of a latent.
    fn latent_channels(&self) -> usize;
    /// Channels the diffusion model takes beside the latent's: an inpainting UNet's mask and
    /// masked-image latent (`latent_channels() + 1`); 0 for other models.
    fn concat_channels(&self) -> usize {
        0
    }
    /// Whether the diffusion model reads reference images (`-r`): their latents, encoded by
    /// the family's VAE, as tokens beside the image's ([`Conditioning::references`]). False
    /// unless the family says so; the pipeline refuses reference images then.
    ///
    /// [`Conditioning::references`]: crate::text::conditioning::Conditioning::references
    fn reads_reference_images(&self) -> bool {
        false
    }
    /// Whether the diffusion model can leave blocks out for skip-layer guidance
    /// ([`DiffusionModel::eval_skipping_layers`]; `--slg-scale`). False unless the family says
    /// so; the pipeline refuses skip-layer guidance then.
    fn skips_layers(&self) -> bool {
        false
    }
    /// Image sides are multiples of this (VAE scale x the diffusion model's down factor).
    fn spatial_multiple(&self) -> usize;
    /// A lower bound of the diffusion model's largest working tensor in bytes, for `tokens`
    /// latent positions and `batch` samples (the first level's attention scores unless
    /// flash attention).
    fn attention_bytes(&self, tokens: f64, batch: f64, flash_attn: bool) -> f64;

    /// Text tokens of one prompt chunk as the diffusion model reads them (the cost model's
    /// text rows): CLIP's 77 unless the family says otherwise (a T5 chunk).
    fn text_tokens(&self) -> u64 {
        77
    }

    /// The VAE's configuration; `None`: the model diffuses in pixel space and has no
    /// autoencoder (its first stage is [`sd_vae::PixelSpace`]).
    fn vae(&self) -> Option<VaeConfig>;
    /// What loading found that a user should know (a missing optional encoder).
    fn notices(&self) -> Vec<crate::pipeline::Notice> {
        Vec::new()
    }

    /// The TAESD configuration; `None`: the family takes no TAESD yet.
    fn taesd(&self) -> Option<TaesdConfig>;

    /// Sampling defaults.
    fn sampling(&self) -> SamplingDefaults;

    /// `--model-args`: the family's options, `(key, value)` as the reference names them. The
    /// default takes none: any key is an error naming it.
    fn set_model_args(&mut self, args: &[(String, String)]) -> Result<()> {
        match args.first() {
            Some((key, _)) => Err(PipelineError::Invalid(format!(
                "model argument '{key}': the {} model takes no model arguments",
                self.arch()
            ))),
            None => Ok(()),
        }
    }

    /// Where LoRA keys point (`crate::lora`): one row per key prefix. Empty: the family takes
    /// no LoRA yet.
    fn lora_prefixes(&self) -> &'static [crate::lora::LoraPrefix] {
        &[]
    }

    /// The ControlNet that fits the diffusion model (`crate::controlnet`); `None`: the family
    /// takes no ControlNet yet.
    fn control_net(&self) -> Option<crate::diffusion::controlnet::ControlNetConfig> {
        None
    }
}

/// A loaded conditioner.
pub trait TextEncoder {
    /// Its parameters (for reports).
    fn weights(&self) -> &Weights;
    /// The conditioning of one prompt.
    fn encode(&self, runner: &mut Runner, request: &TextRequest<'_>) -> Result<Conditioning>;
}

/// A loaded diffusion model.
pub trait DiffusionModel {
    /// Its parameters (for reports).
    fn weights(&self) -> &Weights;
    /// One evaluation of a batch: `x` holds one latent per conditioning (row-major
    /// [N, C, H, W]), `timesteps` one per sample; returns the predictions, same layout.
    /// Conditionings of one batch must be [`Conditioning::batches_with`] each other.
    fn eval(
        &self,
        runner: &mut Runner,
        x: &[f32],
        dims: (usize, usize),
        timesteps: &[f32],
        cond: &[&Conditioning],
    ) -> Result<Vec<f32>>;

    /// [`DiffusionModel::eval`] with the blocks `skip` left out (skip-layer guidance). The
    /// default has no blocks to skip: an error naming the model ([`Family::skips_layers`] says
    /// which families have them).
    fn eval_skipping_layers(
        &self,
        _runner: &mut Runner,
        _x: &[f32],
        _dims: (usize, usize),
        _timesteps: &[f32],
        _cond: &[&Conditioning],
        _skip: &[usize],
    ) -> Result<Vec<f32>> {
        Err(PipelineError::Invalid("skip-layer guidance is not implemented for this diffusion model".into()))
    }

    /// [`DiffusionModel::eval`] with a ControlNet's residuals for the batch (`None`: none). The
    /// default takes none: residuals are an error naming the model.
    fn eval_controlled(
        &self,
        runner: &mut Runner,
        x: &[f32],
        dims: (usize, usize),
        timesteps: &[f32],
        cond: &[&Conditioning],
        controls: Option<&crate::diffusion::controlnet::ControlResiduals>,
    ) -> Result<Vec<f32>> {
        match controls {
            None => self.eval(runner, x, dims, timesteps, cond),
            Some(_) => Err(PipelineError::Invalid("this diffusion model takes no ControlNet residuals".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::block_group;
    use crate::files::arch::{registered, BlockFn};
    use crate::files::index::{FileFormat, SourceFile, TensorEntry};
    use crate::files::{DType, FileRole, TensorIndex};

    /// An index of these names (shapes that detect no architecture).
    fn index_of(names: &[String]) -> TensorIndex {
        let file = SourceFile {
            path: "m.safetensors".into(),
            format: FileFormat::Safetensors,
            role: FileRole::Checkpoint,
            len: 0,
            metadata: vec![],
        };
        let entry = |name: &String| TensorEntry {
            name: name.clone(),
            original_name: name.clone(),
            dtype: DType::F32,
            shape: vec![1],
            file: 0,
            offset: 0,
            len: 4,
            part: None,
        };
        TensorIndex::new(vec![file], names.iter().map(entry).collect()).unwrap()
    }

    /// The block numbering the architecture `arch` registers, built for `index`.
    fn numbering(arch: &str, index: &TensorIndex) -> BlockFn {
        (registered().into_iter().find(|s| s.name == arch).unwrap().blocks)(index)
    }

    #[test]
    fn blocks_follow_execution_order() {
        let mut names: Vec<String> =
            (0..12).map(|i| format!("model.diffusion_model.input_blocks.{i}.0.weight")).collect();
        names.push("model.diffusion_model.middle_block.1.norm.weight".into());
        names.push("model.diffusion_model.output_blocks.0.0.in_layers.0.weight".into());
        names.push("model.diffusion_model.output_blocks.11.1.proj_out.weight".into());
        names.push("model.diffusion_model.time_embed.0.weight".into());
        names.push("cond_stage_model.transformer.text_model.encoder.layers.7.mlp.fc1.weight".into());
        names.push("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight".into());
        names.push("first_stage_model.decoder.up.0.block.0.conv1.weight".into());
        let idx = index_of(&names);
        let blocks = numbering("sd1", &idx);
        let b = |n: &str| blocks(n);
        assert_eq!(b("model.diffusion_model.input_blocks.0.0.weight"), Some(0));
        assert_eq!(b("model.diffusion_model.input_blocks.11.0.weight"), Some(11));
        assert_eq!(b("model.diffusion_model.middle_block.1.norm.weight"), Some(12), "after the 12 input blocks");
        assert_eq!(b("model.diffusion_model.output_blocks.0.0.in_layers.0.weight"), Some(13));
        assert_eq!(b("model.diffusion_model.output_blocks.11.1.proj_out.weight"), Some(24));
        assert_eq!(b("model.diffusion_model.time_embed.0.weight"), None);
        assert_eq!(b("cond_stage_model.transformer.text_model.encoder.layers.7.mlp.fc1.weight"), Some(7));
        assert_eq!(b("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"), None);
        assert_eq!(b("first_stage_model.decoder.up.0.block.0.conv1.weight"), None);
        // Two text encoders (SDXL): the dominant second one's layers are the blocks.
        let big_g = format!("{}text_model.encoder.layers.30.mlp.fc1.weight", crate::files::names::TE2_PREFIX);
        names.push(big_g.clone());
        let blocks = numbering("sdxl", &index_of(&names));
        assert_eq!(blocks(&big_g), Some(30));
        assert_eq!(blocks("cond_stage_model.transformer.text_model.encoder.layers.7.mlp.fc1.weight"), None);
        assert_eq!(blocks("model.diffusion_model.output_blocks.0.0.in_layers.0.weight"), Some(13));
    }

    #[test]
    fn flux_blocks_and_t5_layers_are_numbered() {
        let names = [
            "model.diffusion_model.double_blocks.0.img_attn.qkv.weight",
            "model.diffusion_model.double_blocks.18.txt_mlp.0.weight",
            "model.diffusion_model.single_blocks.0.linear1.weight",
            "model.diffusion_model.single_blocks.37.linear2.weight",
            "model.diffusion_model.img_in.weight",
            "cond_stage_model.transformer.text_model.encoder.layers.7.mlp.fc1.weight",
            "text_encoders.t5xxl.transformer.encoder.block.23.layer.1.DenseReluDense.wo.weight",
            "text_encoders.t5xxl.transformer.shared.weight",
        ];
        let blocks = numbering("flux", &index_of(&names.map(String::from)));
        let b: Vec<Option<u32>> = names.iter().map(|n| blocks(n)).collect();
        // 19 double blocks, then the single ones; T5 is the dominant encoder, CLIP-L is not cut.
        assert_eq!(b, [Some(0), Some(18), Some(19), Some(56), None, None, Some(23), None]);
    }

    #[test]
    fn staging_groups_end_at_the_block_index() {
        let l = "cond_stage_model.transformer.text_model.encoder.layers.3.mlp.fc1.weight";
        assert_eq!(block_group(l), "cond_stage_model.transformer.text_model.encoder.layers.3");
        assert_eq!(
            block_group("first_stage_model.decoder.up.1.block.0.conv1.weight"),
            "first_stage_model.decoder.up.1"
        );
        assert_eq!(
            block_group("cond_stage_model.transformer.text_model.final_layer_norm.weight"),
            "cond_stage_model.transformer.text_model.final_layer_norm"
        );
        assert_eq!(block_group("weight"), "weight");
    }
}
