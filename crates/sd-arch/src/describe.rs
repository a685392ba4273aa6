//! The planner's view of a model: tensor sizes per module and block, and file sizes, from headers only.
//!
//! `sd-cli plan` and the generation path both describe the model with this module (through
//! `sd_models::describe`, which adds the `--type` size rule) before anything is loaded.
//! Besides the files the runtime can load ([`ModelFiles`]), extra files (`--control-net`) can
//! be described by header so that plans for modules and families without a runtime work.
//! Only headers are read; block indices come from the detected architecture's numbering
//! (`TensorIndex::block`).

use std::path::{Path, PathBuf};

use sd_formats::index::component_of;
use sd_formats::{Component, FileRole, FilesError, ModelFiles, TensorEntry};
use sd_placement::{Component as PComponent, ModelDescription, Module, SourceFile, Tensor};

/// An extra file described by header only.
#[derive(Clone, Debug)]
pub struct ExtraFile {
    /// The flag it came from, used as its role (`--t5xxl`).
    pub flag: String,
    /// Path.
    pub path: PathBuf,
    /// Whether it is the dominant text encoder (T5-XXL, an LLM): its layers get block indices.
    pub dominant: bool,
    /// The module its tensors belong to.
    pub module: Module,
}

/// The planner's module of a file component; `None` for unused buffers and unknown tensors.
pub fn module_of(c: Component) -> Option<Module> {
    match c {
        Component::Diffusion => Some(Module::Diffusion),
        Component::TextEncoder(_) => Some(Module::Te),
        Component::Vae | Component::Taesd => Some(Module::Vae),
        Component::Unused | Component::Other => None,
    }
}

/// Role names that never show a path (plans are printed and shared).
fn role_of(role: FileRole) -> String {
    format!("<{} file>", format!("{role:?}").to_lowercase())
}

/// The bytes of `entry` once loaded as stored (no `--type` conversion): its file type's
/// loaded size (8-bit floats are widened to f16, for one).
pub fn loaded_bytes(entry: &TensorEntry) -> u64 {
    entry.dtype.loaded_bytes(entry.len, &entry.shape)
}

/// Describes the opened model plus extra header-only files; `bytes` gives each tensor of the
/// model its size once loaded ([`loaded_bytes`] when nothing is converted).
pub fn describe(
    model: &ModelFiles,
    extra: &[ExtraFile],
    bytes: &dyn Fn(&TensorEntry) -> u64,
) -> Result<ModelDescription, FilesError> {
    let index = model.index();
    let mut comps: Vec<PComponent> = Vec::new();
    let mut push = |module: Module, t: Tensor| match comps.iter_mut().find(|c| c.module == module) {
        Some(c) => c.tensors.push(t),
        None => comps.push(PComponent { module, tensors: vec![t] }),
    };
    let mut ignored = 0usize;
    for e in index.entries() {
        match module_of(component_of(&e.name)) {
            Some(m) => push(m, Tensor { name: e.name.clone(), bytes: bytes(e), block: index.block(e) }),
            None => ignored += 1,
        }
    }
    if ignored > 0 {
        tracing::debug!(ignored, "tensors outside every module (unused buffers or unknown) are not planned");
    }
    let mut sources: Vec<SourceFile> =
        index.files().iter().map(|f| SourceFile { role: role_of(f.role), bytes: f.len }).collect();
    for x in extra {
        let (len, tensors) = header_tensors(&x.path)?;
        sources.push(SourceFile { role: format!("<{} file>", x.flag.trim_start_matches('-')), bytes: len });
        for (name, bytes) in tensors {
            let block = if x.dominant { layer_index(&name) } else { None };
            push(x.module, Tensor { name, bytes, block });
        }
    }
    if comps.is_empty() {
        let files: Vec<String> = index.files().iter().map(|f| format!("'{}'", f.path.display())).collect();
        return Err(FilesError::NoModelTensors { files: files.join(", "), tensors: index.len() });
    }
    Ok(ModelDescription { components: comps, files: sources, compute_bytes: Default::default() })
}

/// Block index of a text-encoder layer tensor by common naming schemes
/// (T5 `encoder.block.N.`, LLMs `layers.N.` / `blk.N.`).
fn layer_index(name: &str) -> Option<u32> {
    for key in ["encoder.block.", "layers.", "blk."] {
        if let Some(pos) = name.find(key) {
            return name[pos + key.len()..].split('.').next()?.parse().ok();
        }
    }
    None
}

/// (file size, [(tensor name, bytes once loaded)]) of a safetensors or GGUF file, header only.
fn header_tensors(path: &Path) -> Result<(u64, Vec<(String, u64)>), FilesError> {
    let (len, raw) = sd_formats::store::read_header(path)?;
    Ok((len, raw.into_iter().map(|t| (t.name, t.dtype.loaded_bytes(t.len, &t.shape))).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_indices() {
        assert_eq!(layer_index("encoder.block.12.layer.0.SelfAttention.q.weight"), Some(12));
        assert_eq!(layer_index("model.layers.3.mlp.up_proj.weight"), Some(3));
        assert_eq!(layer_index("blk.7.attn_q.weight"), Some(7));
        assert_eq!(layer_index("shared.weight"), None);
    }
}
