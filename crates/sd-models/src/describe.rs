//! The planner's view of a model with the runtime's rules: the header-only description of
//! `sd_arch::describe` with the `--type` size rule, the compute estimates of the detected
//! family, and the tensors a runtime LoRA adds.
//!
//! `sd-cli plan` and the generation path both describe the model with this module before
//! anything is loaded; a tool without ggml calls `sd_arch::describe` itself.

use sd_backends::GgmlType;
use sd_placement::{Component as PComponent, ModelDescription, Module, Tensor};

use sd_arch::describe::module_of;
pub use sd_arch::describe::ExtraFile;

use crate::files::{self, FilesError, ModelFiles, TensorEntry};

/// Describes the opened model plus extra header-only files, each tensor of the model sized as
/// the loader stores it with the `--type` override `wtype`.
pub fn describe(
    model: &ModelFiles,
    extra: &[ExtraFile],
    wtype: Option<GgmlType>,
) -> Result<ModelDescription, FilesError> {
    sd_arch::describe(model, extra, &|e| loaded_bytes(e, wtype))
}

/// Bytes of the tensor `e` once loaded with the `--type` override `wtype`: the linear layers'
/// weights (two-dimensional) that [`crate::wtype::converts`] names take `wtype`'s size, as the
/// loader stores them; convolution kernels, norms, biases and kept tensors their file type's
/// loaded size (`sd_arch::describe::loaded_bytes`).
fn loaded_bytes(e: &TensorEntry, wtype: Option<GgmlType>) -> u64 {
    let ne0 = e.shape.last().copied().unwrap_or(1);
    match wtype {
        Some(w) if e.shape.len() == 2 && crate::wtype::converts(&e.name, ne0 as i64, w) => {
            sd_backends::row_size(w, e.shape.iter().product::<u64>() as i64) as u64
        }
        _ => sd_arch::describe::loaded_bytes(e),
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
