//! Model architectures without ggml: each family's detection from tensor names, its block
//! numbering, and the model description the planner reads from file headers.
//!
//! A tool that plans a model (which modules it has, how large each tensor is once loaded, which
//! block each tensor belongs to) needs to know the families, but not their networks. That
//! knowledge lives here, one file per family, with no FFI and no `unsafe`:
//!
//! * [`sd`] (SD 1.x and 2.x, and the UNet's block numbering SDXL shares), [`sdxl`], [`sd3`],
//!   [`flux`] (and the DiT's block numbering Chroma and FLUX.2 share), [`chroma`], [`flux2`] and
//!   [`zimage`] each register
//!   their `sd_formats::ArchSpec`s with `inventory::submit!`: the detection from tensor names
//!   and shapes, the tensors an unknown-architecture error shows, and the block numbering of
//!   the files' tensors in execution order;
//! * [`encoders`] numbers the text encoders' layers (CLIP, T5-XXL, the Qwen3 LLM);
//! * [`describe`] turns opened files (and extra files read by header) into the planner's
//!   `sd_placement::ModelDescription`, with a rule for each tensor's loaded size that the
//!   caller gives (sd-models passes the `--type` rule, which needs ggml's row sizes).
//!
//! The registrations take effect in every binary that links this crate: `sd-models` uses it,
//! so every program built on `sd-models` detects these architectures. A tool that links only
//! `sd-formats` and this crate detects them too, without ggml. The networks that run each
//! family stay in `sd-models` (`crates/sd-models/src/family/`).

#![forbid(unsafe_code)]

pub mod chroma;
pub mod describe;
pub mod encoders;
pub mod flux;
pub mod flux2;
pub mod sd;
pub mod sd3;
pub mod sdxl;
pub mod zimage;

pub use describe::{describe, ExtraFile};

/// Test helpers shared by the families' detection tests.
#[cfg(test)]
pub(crate) mod test_support {
    use sd_formats::index::{FileFormat, SourceFile, TensorEntry};
    use sd_formats::{DType, FileRole, TensorIndex};

    /// An index of one file of `role` holding `names` with their ggml shapes (PyTorch order).
    pub(crate) fn index_of(role: FileRole, names: &[(&str, Vec<u64>)]) -> TensorIndex {
        let file = SourceFile {
            path: "m.safetensors".into(),
            format: FileFormat::Safetensors,
            role,
            len: 0,
            metadata: vec![],
        };
        let entry = |(name, shape): &(&str, Vec<u64>)| TensorEntry {
            name: name.to_string(),
            original_name: name.to_string(),
            dtype: DType::F32,
            shape: shape.clone(),
            file: 0,
            offset: 0,
            len: 4,
            part: None,
        };
        TensorIndex::new(vec![file], names.iter().map(entry).collect()).unwrap()
    }
}

// The README's example is compiled (not run: it needs model files) as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}
