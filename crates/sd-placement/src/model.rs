//! Modules (with the alias table of stable-diffusion.cpp's `docs/backend.md`) and the plain-data model description the planner reads.
//!
//! A model is described by what a file header tells without reading tensor data: per component
//! (module) the tensors' names, byte sizes and, where it has them, the index of the transformer
//! block each tensor belongs to; plus the sizes of the source files (for the memory check).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{GIB, MIB};

/// A placement module of backend.md's "Modules" table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Module {
    /// UNet, DiT, MMDiT, Flux... (`diffusion`, `model`, `unet`, `dit`).
    #[serde(rename = "diffusion")]
    Diffusion,
    /// Text encoders and conditioners (`te`, `clip`, `text`, `t5xxl`, ...).
    #[serde(rename = "te")]
    Te,
    /// CLIP vision encoder.
    #[serde(rename = "clip_vision")]
    ClipVision,
    /// VAE and TAE.
    #[serde(rename = "vae")]
    Vae,
    /// ControlNet.
    #[serde(rename = "controlnet")]
    ControlNet,
    /// PhotoMaker ID encoder and PhotoMaker LoRA.
    #[serde(rename = "photomaker")]
    PhotoMaker,
    /// ESRGAN upscaler.
    #[serde(rename = "upscaler")]
    Upscaler,
    /// ADetailer YOLOv8 detector.
    #[serde(rename = "detector")]
    Detector,
}

impl Module {
    /// Every module, in the order of backend.md's table (also the order of a plan's `modules`).
    pub const ALL: [Module; 8] = [
        Module::Diffusion,
        Module::Te,
        Module::ClipVision,
        Module::Vae,
        Module::ControlNet,
        Module::PhotoMaker,
        Module::Upscaler,
        Module::Detector,
    ];

    /// Auto-fit priority: "Components are considered in diffusion, te, vae order"; the remaining
    /// modules (which backend.md does not rank) follow in table order.
    pub const PRIORITY: [Module; 8] = [
        Module::Diffusion,
        Module::Te,
        Module::Vae,
        Module::ClipVision,
        Module::ControlNet,
        Module::PhotoMaker,
        Module::Upscaler,
        Module::Detector,
    ];

    /// The preferred (canonical) name, as printed in plans and equivalent flags.
    pub fn name(self) -> &'static str {
        match self {
            Module::Diffusion => "diffusion",
            Module::Te => "te",
            Module::ClipVision => "clip_vision",
            Module::Vae => "vae",
            Module::ControlNet => "controlnet",
            Module::PhotoMaker => "photomaker",
            Module::Upscaler => "upscaler",
            Module::Detector => "detector",
        }
    }

    /// The accepted names of backend.md's table, normalized (lower case, no `-` or `_`).
    pub fn aliases(self) -> &'static [&'static str] {
        match self {
            Module::Diffusion => &["diffusion", "model", "unet", "dit"],
            Module::Te => {
                &["te", "clip", "text", "textencoder", "textencoders", "conditioner", "cond", "llm", "t5", "t5xxl"]
            }
            Module::ClipVision => &["clipvision", "vision"],
            Module::Vae => &["vae", "firststage", "autoencoder", "tae"],
            Module::ControlNet => &["controlnet", "control"],
            Module::PhotoMaker => &["photomaker", "photomakerid", "pmid", "photo"],
            Module::Upscaler => &["upscaler", "esrgan", "hires"],
            Module::Detector => &["detector", "adetailer", "yolo"],
        }
    }

    /// Parses a module name: case-insensitive, surrounding blanks trimmed, `-` and `_` ignored.
    pub fn parse(name: &str) -> Option<Module> {
        let normalized: String =
            name.trim().chars().filter(|c| *c != '-' && *c != '_').flat_map(char::to_lowercase).collect();
        Module::ALL.into_iter().find(|m| m.aliases().contains(&normalized.as_str()))
    }

    /// Whether `&` device lists (layer or row split) are accepted: "Layer split is supported for
    /// the diffusion and te modules ... other modules accept only a single device."
    pub fn accepts_device_list(self) -> bool {
        matches!(self, Module::Diffusion | Module::Te)
    }

    /// The fixed compute reserve of backend.md's auto-fit, used for a module whose estimate the
    /// description does not give ([`ModelDescription::compute_bytes`]): "2 GiB for diffusion
    /// and text encoders, 1 GiB for VAE". backend.md gives no figure for the other modules; we
    /// use the VAE's 1 GiB for them.
    pub fn compute_reserve(self) -> u64 {
        match self {
            Module::Diffusion | Module::Te => 2 * GIB,
            _ => GIB,
        }
    }

    /// Every accepted name, for error messages.
    pub fn accepted_names() -> String {
        let mut out = String::new();
        for m in Module::ALL {
            if !out.is_empty() {
                out.push_str("; ");
            }
            out.push_str(m.name());
            out.push_str(" (");
            out.push_str(&m.aliases().join(", "));
            out.push(')');
        }
        out.push_str("; also all=, default=, *= for every module (case-insensitive, '-' and '_' ignored)");
        out
    }
}

impl std::fmt::Display for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One weight tensor as a file header describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tensor {
    /// Tensor name as found in the file.
    pub name: String,
    /// Size in bytes in its storage type.
    pub bytes: u64,
    /// Index of the transformer block the tensor belongs to, in execution order across the whole
    /// component (e.g. Flux: double blocks 0..=18, then single blocks 19..=56). `None` for
    /// non-block tensors (embeddings, norms, small sub-models). For `te`, set it only on the
    /// dominant encoder (t5xxl or the LLM): layer split applies to that one.
    #[serde(default)]
    pub block: Option<u32>,
}

impl Tensor {
    /// A non-block tensor.
    pub fn new(name: impl Into<String>, bytes: u64) -> Self {
        Tensor { name: name.into(), bytes, block: None }
    }

    /// A tensor of transformer block `block`.
    pub fn in_block(name: impl Into<String>, bytes: u64, block: u32) -> Self {
        Tensor { name: name.into(), bytes, block: Some(block) }
    }
}

/// The tensors of one module. Several components with the same module are merged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Component {
    /// Which module runs these weights.
    pub module: Module,
    /// Its tensors.
    pub tensors: Vec<Tensor>,
}

/// A source file of the model (checkpoint, separate VAE, text encoder...).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFile {
    /// A role rather than a path (e.g. `<checkpoint file>`, `<t5xxl file>`): plans are printed and
    /// may be shared.
    pub role: String,
    /// File size in bytes.
    pub bytes: u64,
}

/// Everything the planner needs to know about a model, as plain data.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelDescription {
    /// Components; a module without a component (or without tensors) is absent.
    pub components: Vec<Component>,
    /// Source files; their sizes feed the memory check. When empty, the sum of tensor sizes
    /// stands in for them.
    #[serde(default)]
    pub files: Vec<SourceFile>,
    /// Estimated compute buffer per module for the run's image size (working tensors of one
    /// graph, from the model's family: `sd_models::describe::compute_estimates` fills it for
    /// the families sd-rs runs). A module absent here is reserved [`Module::compute_reserve`]'s
    /// fixed figure, which is far too much for small images and small budgets.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub compute_bytes: BTreeMap<Module, u64>,
}

/// Per-module figures derived from the tensors (merged components).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ComponentSummary {
    pub module: Module,
    pub param_bytes: u64,
    pub largest_tensor: u64,
    /// The compute reserve of one graph: the description's estimate, else the fixed one.
    pub compute_reserve: u64,
    /// Distinct blocks in ascending order with their bytes and largest tensor.
    pub blocks: Vec<BlockSummary>,
    pub non_block_bytes: u64,
    pub largest_non_block: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockSummary {
    pub index: u32,
    pub bytes: u64,
    pub largest_tensor: u64,
}

impl ModelDescription {
    /// Present modules (with at least one tensor) summarized, in [`Module::ALL`] order.
    pub(crate) fn summaries(&self) -> Vec<ComponentSummary> {
        let mut out = Vec::new();
        for module in Module::ALL {
            let mut tensors =
                self.components.iter().filter(|c| c.module == module).flat_map(|c| c.tensors.iter()).peekable();
            if tensors.peek().is_none() {
                continue;
            }
            let mut s = ComponentSummary {
                module,
                param_bytes: 0,
                largest_tensor: 0,
                compute_reserve: self.compute_bytes.get(&module).copied().unwrap_or(module.compute_reserve()),
                blocks: Vec::new(),
                non_block_bytes: 0,
                largest_non_block: 0,
            };
            let mut blocks: std::collections::BTreeMap<u32, BlockSummary> = Default::default();
            for t in tensors {
                s.param_bytes = s.param_bytes.saturating_add(t.bytes);
                s.largest_tensor = s.largest_tensor.max(t.bytes);
                match t.block {
                    Some(b) => {
                        let e = blocks.entry(b).or_insert(BlockSummary { index: b, bytes: 0, largest_tensor: 0 });
                        e.bytes = e.bytes.saturating_add(t.bytes);
                        e.largest_tensor = e.largest_tensor.max(t.bytes);
                    }
                    None => {
                        s.non_block_bytes = s.non_block_bytes.saturating_add(t.bytes);
                        s.largest_non_block = s.largest_non_block.max(t.bytes);
                    }
                }
            }
            s.blocks = blocks.into_values().collect();
            out.push(s);
        }
        out
    }

    /// Sum of source file sizes, or of tensor sizes when no file is listed.
    pub(crate) fn file_bytes(&self) -> (u64, bool) {
        if self.files.is_empty() {
            let sum =
                self.components.iter().flat_map(|c| c.tensors.iter()).fold(0u64, |a, t| a.saturating_add(t.bytes));
            (sum, false)
        } else {
            (self.files.iter().fold(0u64, |a, f| a.saturating_add(f.bytes)), true)
        }
    }
}

/// 512 MiB, the planning margin and the memory-check constant.
pub(crate) const HALF_GIB: u64 = 512 * MIB;
