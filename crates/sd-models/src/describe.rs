//! The planner's view of a model: tensor sizes per module and block, and file sizes, from headers only.
//!
//! `sd-cli plan` and the generation path both describe the model with this
//! module before anything is loaded. Besides the files the runtime can load
//! ([`ModelFiles`]), extra text-encoder files (`--clip_g`, `--t5xxl`, `--llm`)
//! can be described by header so that plans for later model families work
//! before their runtimes exist. Only headers are read.

use std::path::{Path, PathBuf};

use sd_backends::GgmlType;
use sd_placement::{Component as PComponent, ModelDescription, Module, SourceFile, Tensor};

use crate::files::{self, Component, FilesError, FormatError, ModelFiles};

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

fn module_of(c: Component) -> Option<Module> {
    match c {
        Component::Diffusion => Some(Module::Diffusion),
        Component::TextEncoder(_) => Some(Module::Te),
        Component::Vae | Component::Taesd => Some(Module::Vae),
        Component::Unused | Component::Other => None,
    }
}

/// Role names that never show a path (plans are printed and shared).
fn role_of(role: files::FileRole) -> String {
    format!("<{} file>", format!("{role:?}").to_lowercase())
}

/// Describes the opened model plus extra header-only files.
pub fn describe(
    model: &ModelFiles,
    extra: &[ExtraFile],
    wtype: Option<GgmlType>,
) -> Result<ModelDescription, FilesError> {
    let index = model.index();
    let mut comps: Vec<PComponent> = Vec::new();
    let mut push = |module: Module, t: Tensor| match comps.iter_mut().find(|c| c.module == module) {
        Some(c) => c.tensors.push(t),
        None => comps.push(PComponent { module, tensors: vec![t] }),
    };
    let mut ignored = 0usize;
    for e in index.entries() {
        match module_of(files::index::component_of(&e.name)) {
            Some(m) => {
                let bytes = loaded_bytes(&e.name, e.dtype, e.len, &e.shape, wtype);
                push(m, Tensor { name: e.name.clone(), bytes, block: index.block(e) })
            }
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

/// Bytes of the tensor `name` (`stored` bytes of `dtype` in the file, `shape` outermost first)
/// once loaded with the `--type` override `wtype`: the linear layers' weights (two-dimensional)
/// that [`crate::wtype::converts`] names take `wtype`'s size, as the loader stores them;
/// convolution kernels, norms, biases and kept tensors their file type's loaded size.
fn loaded_bytes(name: &str, dtype: sd_formats::DType, stored: u64, shape: &[u64], wtype: Option<GgmlType>) -> u64 {
    let ne0 = shape.last().copied().unwrap_or(1);
    match wtype {
        Some(w) if shape.len() == 2 && crate::wtype::converts(name, ne0 as i64, w) => {
            sd_backends::row_size(w, shape.iter().product::<u64>() as i64) as u64
        }
        _ => dtype.loaded_bytes(stored, shape),
    }
}

/// Estimated compute buffers of one graph per module for images of `width` x `height`, the
/// planner's reserves ([`ModelDescription::compute_bytes`]); empty when no family sd-rs runs
/// detects the files (the planner then keeps the fixed 2 GiB / 1 GiB of stable-diffusion.cpp's
/// auto-fit).
///
/// diffusion: the family's attention scores of one sample (none with flash attention) plus
/// its activations (latent positions x 2560 f32, about eight tensors of a 320-channel first
/// level) and 64 MiB; te: 64 MiB, 256 MiB with a T5-XXL (512 tokens of 4096 channels, 64
/// heads' scores); vae: the decoder's buffer, about fourteen 128-channel f32 images of the
/// output size, for at most a 256x256-pixel tile (a decode whose buffer does not fit its
/// device is retried in such tiles), and 64 MiB. Measured on SD 1.5 at 512x512: the UNet's
/// largest segment 542 MiB of workspace (estimate 616 MiB), the VAE 1.72 GiB untiled and
/// about 0.43 GiB per 256x256 tile (estimate 0.5 GiB). ggml's allocator measures the real
/// buffers at run time; these are what a small budget is planned with, instead of a fixed
/// reserve that refuses it outright.
pub fn compute_estimates(
    files: &ModelFiles,
    width: usize,
    height: usize,
    flash_attn: bool,
) -> std::collections::BTreeMap<Module, u64> {
    const MIB: f64 = 1048576.0;
    let mut out = std::collections::BTreeMap::new();
    let Some(family) = crate::family::of_files_quietly(files) else { return out };
    let tokens = (width / 8) as f64 * (height / 8) as f64;
    let diffusion = family.attention_bytes(tokens, 1.0, flash_attn) + tokens * 2560.0 * 4.0 + 64.0 * MIB;
    let t5 = family.arch().contains("flux") || files.index().files().iter().any(|f| f.role == files::FileRole::T5xxl);
    let te = if t5 { 256.0 * MIB } else { 64.0 * MIB };
    let vae = 14.0 * 128.0 * 4.0 * (width * height).min(256 * 256) as f64 + 64.0 * MIB;
    for (m, b) in [(Module::Diffusion, diffusion), (Module::Te, te), (Module::Vae, vae)] {
        out.insert(m, b.min(u64::MAX as f64) as u64);
    }
    out
}

/// Adds to `desc` the tensors a LoRA applied at run time puts in each module
/// ([`crate::lora::LoraSet::runtime_tensor_bytes`]), each in the block of the weight it
/// adapts; returns their bytes per module.
pub fn add_runtime_loras(
    desc: &mut ModelDescription,
    model: &ModelFiles,
    set: &crate::lora::LoraSet,
) -> Vec<(Module, u64)> {
    let index = model.index();
    let mut per: Vec<(Module, u64)> = Vec::new();
    for (weight, name, bytes) in set.runtime_tensor_bytes() {
        let Some(module) = module_of(files::index::component_of(&weight)) else { continue };
        let t = Tensor { name, bytes, block: index.block_of(&weight) };
        match desc.components.iter_mut().find(|c| c.module == module) {
            Some(c) => c.tensors.push(t),
            None => desc.components.push(PComponent { module, tensors: vec![t] }),
        }
        match per.iter_mut().find(|(m, _)| *m == module) {
            Some(e) => e.1 += bytes,
            None => per.push((module, bytes)),
        }
    }
    per
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
    let io = |e: std::io::Error| FilesError::Io { path: path.to_owned(), error: e };
    let (file, meta) = files::open::open_regular(path)?;
    let len = meta.len();
    if len == 0 {
        return Err(FilesError::Malformed {
            path: path.to_owned(),
            problem: FormatError::Truncated { what: "the header".into(), start: 0, end: 8, file_len: 0 },
        });
    }
    // SAFETY: the map is read-only and only its header pages are read here, once, right after
    // the open; a concurrent truncation could fault them, the window every mmap reader has.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    let malformed = |problem| FilesError::Malformed { path: path.to_owned(), problem };
    let raw = if map.starts_with(b"GGUF") {
        files::gguf::parse(&map).map_err(malformed)?.tensors
    } else {
        files::safetensors::parse(&map).map_err(malformed)?.tensors
    };
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
