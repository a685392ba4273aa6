//! The tensor index: every tensor of a model under its internal name, as plain data.
//!
//! A [`TensorIndex`] knows names, types, shapes, byte ranges and source files, but holds no
//! file contents, so architecture detection, planning and tests can work on one built from
//! plain data ([`TensorIndex::new`]). [`super::ModelFiles`] pairs it with the memory maps.

use std::collections::HashMap;
use std::path::PathBuf;

use super::error::FilesError;
use super::gguf::GgufValue;
use super::names::{FileRole, QkvPart, TAESD_PREFIX, TE2_PREFIX, TE_PREFIX, UNET_PREFIX, VAE_PREFIX};
use super::DType;

/// The container format of one file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileFormat {
    Safetensors,
    /// GGUF of this version (2 or 3) and data alignment.
    Gguf {
        version: u32,
        alignment: u64,
    },
}

/// One file a model was read from.
#[derive(Clone, Debug, PartialEq)]
pub struct SourceFile {
    pub path: PathBuf,
    pub format: FileFormat,
    pub role: FileRole,
    /// File size in bytes.
    pub len: u64,
    /// Safetensors `__metadata__` (as strings) or GGUF key/values, in file order. A diffusers
    /// folder's `scheduler/scheduler_config.json` `prediction_type` is added to its UNet file
    /// as `diffusers.scheduler.prediction_type`.
    pub metadata: Vec<(String, GgufValue)>,
}

/// One tensor of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// Internal name (see [`super::names`]).
    pub name: String,
    /// Name as stored in the file.
    pub original_name: String,
    pub dtype: DType,
    /// Row-major shape, outermost dimension first (safetensors / PyTorch order).
    pub shape: Vec<u64>,
    /// Index of the source file in [`TensorIndex::files`].
    pub file: usize,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Byte length of the data.
    pub len: u64,
    /// Set when this entry is one third of a fused q/k/v projection stored as one tensor.
    pub part: Option<QkvPart>,
}

impl TensorEntry {
    /// ggml's `ne[]`: the shape innermost first (the reverse of [`TensorEntry::shape`]).
    pub fn ne(&self) -> Vec<u64> {
        self.shape.iter().rev().copied().collect()
    }

    /// Number of elements (1 for a scalar).
    pub fn n_elements(&self) -> u64 {
        // Checked at parse time: the product fits.
        self.shape.iter().product()
    }
}

/// Which model component a tensor belongs to, by its internal-name prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// `model.diffusion_model.*`
    Diffusion,
    /// `cond_stage_model.transformer.*` (0), `cond_stage_model.1.*` (1) or
    /// `text_encoders.t5xxl.transformer.*` (2).
    TextEncoder(u8),
    /// `first_stage_model.*`
    Vae,
    /// `tae.*`
    Taesd,
    /// Stored but never used by inference: noise-schedule buffers (`alphas_cumprod`, …), EMA
    /// copies (`model_ema.*`), `position_ids`, `logit_scale`, markers such as `v_pred`
    /// (the list of sd.cpp's `unused_tensors`).
    Unused,
    /// Anything else: an extra tensor the architecture does not know.
    Other,
}

impl Component {
    /// The components a checkpoint file holds, by their short names on command lines
    /// (`cargo xtask fixture --only`).
    const NAMED: [(Component, &'static str); 3] =
        [(Component::Diffusion, "unet"), (Component::TextEncoder(0), "text"), (Component::Vae, "vae")];

    /// The component a short name (`unet`, `text`, `vae`) names.
    pub fn from_short_name(s: &str) -> Option<Component> {
        Self::NAMED.into_iter().find(|(_, n)| *n == s).map(|(c, _)| c)
    }
}

/// Prefixes of the internal names of tensors that inference never reads (sd.cpp matches
/// its list the same way, by prefix).
const UNUSED: &[&str] = &[
    "betas",
    "alphas_cumprod",
    "sqrt_alphas_cumprod",
    "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod",
    "sqrt_recip_alphas_cumprod",
    "sqrt_recipm1_alphas_cumprod",
    "posterior_variance",
    "posterior_log_variance_clipped",
    "posterior_mean_coef1",
    "posterior_mean_coef2",
    "model_ema.",
    "embedding_manager.",
    "denoiser.sigmas",
    "ztsnr",
    "v_pred",
    "edm_vpred.",
    "cond_stage_model.model.logit_scale",
    "cond_stage_model.1.model.logit_scale",
    "model.diffusion_model.time_embedding.cond_proj.weight",
];

/// Whether inference never reads the tensor with this internal name.
fn is_unused(name: &str) -> bool {
    name.ends_with(".position_ids") || UNUSED.iter().any(|u| name.starts_with(u))
}

/// The component of the tensor with this internal name.
pub fn component_of(name: &str) -> Component {
    if is_unused(name) {
        Component::Unused
    } else {
        prefix_component(name)
    }
}

/// The component whose prefix the internal name carries, [`Component::Unused`] never
/// (a `position_ids` buffer under the text-encoder prefix is [`Component::TextEncoder`]).
pub fn prefix_component(name: &str) -> Component {
    if name.starts_with(UNET_PREFIX) {
        Component::Diffusion
    } else if name.starts_with(TE2_PREFIX) || name.starts_with("cond_stage_model.1.") {
        Component::TextEncoder(1)
    } else if name.starts_with(TE_PREFIX) || name.starts_with("cond_stage_model.") {
        Component::TextEncoder(0)
    } else if name.starts_with(VAE_PREFIX) {
        Component::Vae
    } else if name.starts_with(TAESD_PREFIX) {
        Component::Taesd
    } else if name.starts_with(super::names::T5XXL_PREFIX) {
        Component::TextEncoder(2)
    } else {
        Component::Other
    }
}

/// Every tensor of a model, by internal name, with the files they come from.
#[derive(Clone, Debug, Default)]
pub struct TensorIndex {
    files: Vec<SourceFile>,
    entries: Vec<TensorEntry>,
    by_name: HashMap<String, usize>,
    /// Number of UNet input blocks (highest `input_blocks.N` + 1), for block numbering.
    unet_input_blocks: u32,
    /// Whether a second text encoder is present (SDXL's bigG): then it is the dominant one,
    /// whose layers are the text encoder's blocks.
    has_te2: bool,
    /// Whether T5-XXL is present (FLUX): then it is the dominant text encoder.
    has_t5: bool,
    /// Number of FLUX double-stream blocks (highest `double_blocks.N` + 1): the single-stream
    /// blocks are numbered after them.
    flux_double_blocks: u32,
}

/// Where FLUX's double-stream blocks are numbered.
const FLUX_DOUBLE: &str = "model.diffusion_model.double_blocks.";
/// Where FLUX's single-stream blocks are numbered.
const FLUX_SINGLE: &str = "model.diffusion_model.single_blocks.";
/// Where T5-XXL's blocks are numbered.
const T5_BLOCKS: &str = "text_encoders.t5xxl.transformer.encoder.block.";

/// `N` of `{prefix}N.…`.
fn numbered(name: &str, prefix: &str) -> Option<u32> {
    name.strip_prefix(prefix)?.split('.').next()?.parse().ok()
}

impl TensorIndex {
    /// An index over `entries` read from `files`. Internal names must be unique; each
    /// entry's `file` must index `files` (else an error naming the tensor).
    pub fn new(files: Vec<SourceFile>, entries: Vec<TensorEntry>) -> Result<Self, FilesError> {
        let mut by_name = HashMap::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            if e.file >= files.len() {
                return Err(FilesError::Malformed {
                    path: PathBuf::from("(tensor index)"),
                    problem: super::FormatError::BadEntry {
                        tensor: e.name.clone(),
                        problem: format!("file index {} but only {} files", e.file, files.len()),
                    },
                });
            }
            if let Some(&j) = by_name.get(&e.name) {
                let first: &TensorEntry = &entries[j];
                return Err(FilesError::DuplicateTensor {
                    name: e.name.clone(),
                    first_original: first.original_name.clone(),
                    first_path: files[first.file].path.clone(),
                    second_original: e.original_name.clone(),
                    second_path: files[e.file].path.clone(),
                });
            }
            by_name.insert(e.name.clone(), i);
        }
        let unet_input_blocks = entries
            .iter()
            .filter_map(|e| unet_block(&e.name).and_then(|(kind, n)| (kind == UnetPart::Input).then_some(n)))
            .max()
            .map_or(0, |n| n + 1);
        let has_te2 = entries.iter().any(|e| e.name.starts_with(TE2_PREFIX));
        let has_t5 = entries.iter().any(|e| e.name.starts_with(T5_BLOCKS));
        let flux_double_blocks =
            entries.iter().filter_map(|e| numbered(&e.name, FLUX_DOUBLE)).max().map_or(0, |n| n + 1);
        Ok(TensorIndex { files, entries, by_name, unet_input_blocks, has_te2, has_t5, flux_double_blocks })
    }

    /// The files, indexed by [`TensorEntry::file`].
    pub fn files(&self) -> &[SourceFile] {
        &self.files
    }

    /// All entries, in file order (files in the order given, tensors in header order).
    pub fn entries(&self) -> &[TensorEntry] {
        &self.entries
    }

    /// The entry with this internal name.
    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.by_name.get(name).map(|&i| &self.entries[i])
    }

    /// Whether a tensor with this internal name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries whose internal name starts with `prefix`.
    pub fn with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a TensorEntry> + 'a {
        self.entries.iter().filter(move |e| e.name.starts_with(prefix))
    }

    /// The first metadata value under `key`, searching files in order, with its file.
    pub fn metadata(&self, key: &str) -> Option<(&SourceFile, &GgufValue)> {
        self.files.iter().find_map(|f| f.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| (f, v)))
    }

    /// The component of `entry`.
    pub fn component(&self, entry: &TensorEntry) -> Component {
        component_of(&entry.name)
    }

    /// The execution-order block of `entry` within its component, where it has one:
    /// UNet `input_blocks.N` → N, `middle_block` → (number of input blocks),
    /// `output_blocks.N` → (number of input blocks) + 1 + N; FLUX `double_blocks.N` → N,
    /// `single_blocks.N` → (number of double blocks) + N; the dominant text encoder's layers
    /// (T5 `encoder.block.N`, else CLIP `encoder.layers.N`) → N. Embeddings, final norms, the
    /// UNet's `time_embed`/`out`, and every VAE/TAESD tensor have none.
    pub fn block(&self, entry: &TensorEntry) -> Option<u32> {
        self.block_of(&entry.name)
    }

    /// [`TensorIndex::block`] by internal name (a layer split's device of a tensor).
    pub fn block_of(&self, name: &str) -> Option<u32> {
        if let Some((part, n)) = unet_block(name) {
            return Some(match part {
                UnetPart::Input => n,
                UnetPart::Middle => self.unet_input_blocks,
                UnetPart::Output => self.unet_input_blocks + 1 + n,
            });
        }
        // FLUX's DiT: the double-stream blocks, then the single-stream ones.
        if let Some(n) = numbered(name, FLUX_DOUBLE) {
            return Some(n);
        }
        if let Some(n) = numbered(name, FLUX_SINGLE) {
            return Some(self.flux_double_blocks + n);
        }
        // A layer split of the text encoder cuts the dominant encoder ("for te it applies to
        // the dominant text encoder"): T5-XXL where it is present (FLUX), else the second CLIP
        // where there are two (SDXL's bigG); the other encoder's layers stay with the
        // non-block tensors on the main device.
        if self.has_t5 {
            return numbered(name, T5_BLOCKS);
        }
        let rest = if self.has_te2 { name.strip_prefix(TE2_PREFIX) } else { name.strip_prefix(TE_PREFIX) }?;
        let rest = rest.strip_prefix("text_model.encoder.layers.")?;
        rest.split('.').next()?.parse().ok()
    }

    /// Fails on the first tensor of a model component (text encoder, UNet, VAE, TAESD) whose
    /// dtype no computation accepts ([`DType::is_compute_type`]), naming the file and tensor.
    /// Unused buffers (`position_ids` is often I64) and unknown tensors are not checked.
    pub fn check_weight_dtypes(&self) -> Result<(), FilesError> {
        for e in &self.entries {
            let component = match component_of(&e.name) {
                Component::Diffusion => "diffusion model",
                Component::TextEncoder(_) => "text encoder",
                Component::Vae => "VAE",
                Component::Taesd => "TAESD",
                Component::Unused | Component::Other => continue,
            };
            if !e.dtype.is_compute_type() {
                return Err(FilesError::UnsupportedDType {
                    path: self.files[e.file].path.clone(),
                    tensor: e.original_name.clone(),
                    dtype: e.dtype.name(),
                    component,
                });
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum UnetPart {
    Input,
    Middle,
    Output,
}

fn unet_block(name: &str) -> Option<(UnetPart, u32)> {
    let rest = name.strip_prefix(UNET_PREFIX)?;
    if rest.starts_with("middle_block.") {
        return Some((UnetPart::Middle, 0));
    }
    let (part, rest) = if let Some(r) = rest.strip_prefix("input_blocks.") {
        (UnetPart::Input, r)
    } else {
        (UnetPart::Output, rest.strip_prefix("output_blocks.")?)
    };
    let n: u32 = rest.split('.').next()?.parse().ok()?;
    // Refuse absurd indices so block arithmetic cannot overflow.
    (n < 10_000).then_some((part, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str) -> TensorEntry {
        TensorEntry {
            name: name.into(),
            original_name: name.into(),
            dtype: DType::F32,
            shape: vec![1],
            file: 0,
            offset: 0,
            len: 4,
            part: None,
        }
    }

    fn file() -> SourceFile {
        SourceFile {
            path: "m.safetensors".into(),
            format: FileFormat::Safetensors,
            role: FileRole::Checkpoint,
            len: 0,
            metadata: vec![],
        }
    }

    #[test]
    fn components_by_prefix() {
        let cases = [
            ("model.diffusion_model.input_blocks.0.0.weight", Component::Diffusion),
            ("cond_stage_model.transformer.text_model.final_layer_norm.weight", Component::TextEncoder(0)),
            ("cond_stage_model.1.transformer.text_model.final_layer_norm.weight", Component::TextEncoder(1)),
            ("first_stage_model.decoder.conv_in.weight", Component::Vae),
            ("tae.decoder.layers.0.weight", Component::Taesd),
            ("alphas_cumprod", Component::Unused),
            ("alphas_cumprod_prev", Component::Unused),
            ("model_ema.diffusion_modelinput_blocks00weight", Component::Unused),
            ("cond_stage_model.transformer.text_model.embeddings.position_ids", Component::Unused),
            ("cond_stage_model.model.logit_scale", Component::Unused),
            ("lora_unet_down.weight", Component::Other),
            ("v_pred", Component::Unused),
            ("model.diffusion_model.time_embedding.cond_proj.weight", Component::Unused),
        ];
        for (n, c) in cases {
            assert_eq!(component_of(n), c, "{n}");
        }
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
        let idx = TensorIndex::new(vec![file()], names.iter().map(|n| entry(n)).collect()).unwrap();
        let b = |n: &str| idx.block_of(n);
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
        let big_g = format!("{TE2_PREFIX}text_model.encoder.layers.30.mlp.fc1.weight");
        names.push(big_g.clone());
        let idx = TensorIndex::new(vec![file()], names.iter().map(|n| entry(n)).collect()).unwrap();
        assert_eq!(idx.block_of(&big_g), Some(30));
        assert_eq!(idx.block_of("cond_stage_model.transformer.text_model.encoder.layers.7.mlp.fc1.weight"), None);
        assert_eq!(idx.block_of("model.diffusion_model.output_blocks.0.0.in_layers.0.weight"), Some(13));
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
        let idx = TensorIndex::new(vec![file()], names.iter().map(|n| entry(n)).collect()).unwrap();
        let b: Vec<Option<u32>> = names.iter().map(|n| idx.block_of(n)).collect();
        // 19 double blocks, then the single ones; T5 is the dominant encoder, CLIP-L is not cut.
        assert_eq!(b, [Some(0), Some(18), Some(19), Some(56), None, None, Some(23), None]);
    }

    #[test]
    fn duplicate_internal_names_are_an_error_naming_both_originals() {
        let mut a = entry("model.diffusion_model.out.2.weight");
        a.original_name = "model.diffusion_model.out.2.weight".into();
        let mut b = entry("model.diffusion_model.out.2.weight");
        b.original_name = "diffusion_model.out.2.weight".into();
        let err = TensorIndex::new(vec![file()], vec![a, b]).unwrap_err().to_string();
        assert!(
            err.contains("model.diffusion_model.out.2.weight") && err.contains("'diffusion_model.out.2.weight'"),
            "{err}"
        );
    }
}
