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
    /// `text_encoders.t5xxl.transformer.*` (2) or `text_encoders.llm.*` (3).
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
    } else if name.starts_with(super::names::LLM_PREFIX) {
        Component::TextEncoder(3)
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
    /// The detected family's block numbering (`None` when the files are of no single
    /// registered architecture: then no tensor has a block).
    blocks: Option<Numbering>,
    /// The registered architectures that detect these tensors, found once when the index is
    /// built (the index never changes after): read by the block numbering and by
    /// [`super::arch::detect`].
    matched: Vec<(&'static super::arch::ArchSpec, super::arch::Detected)>,
}

/// A family's block numbering ([`super::arch::ArchSpec::blocks`]), shared by clones of the index.
#[derive(Clone)]
struct Numbering(super::arch::BlockFn);

impl std::fmt::Debug for Numbering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Numbering")
    }
}

/// `N` of `{prefix}N.…` (below 10,000, so that block arithmetic cannot overflow).
pub fn numbered(name: &str, prefix: &str) -> Option<u32> {
    name.strip_prefix(prefix)?.split('.').next()?.parse().ok().filter(|&n| n < 10_000)
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
        let mut index = TensorIndex { files, entries, by_name, blocks: None, matched: Vec::new() };
        index.matched = super::arch::matching(&index);
        index.blocks = match index.matched.as_slice() {
            [(spec, _)] => Some(Numbering((spec.blocks)(&index))),
            _ => None,
        };
        Ok(index)
    }

    /// The registered architectures that detect these tensors, with their detections.
    pub(crate) fn matched(&self) -> &[(&'static super::arch::ArchSpec, super::arch::Detected)] {
        &self.matched
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

    /// The execution-order block of `entry` within its module, where it has one, as the
    /// detected family numbers them ([`super::arch::ArchSpec::blocks`]): the diffusion
    /// model's blocks, and the layers of the dominant text encoder. Embeddings, final norms,
    /// first-stage tensors, and every tensor of files of no single registered architecture
    /// have none.
    pub fn block(&self, entry: &TensorEntry) -> Option<u32> {
        self.block_of(&entry.name)
    }

    /// [`TensorIndex::block`] by internal name (a layer split's device of a tensor).
    pub fn block_of(&self, name: &str) -> Option<u32> {
        self.blocks.as_ref().and_then(|b| (b.0)(name))
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
