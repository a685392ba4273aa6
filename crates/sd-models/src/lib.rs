//! Model files, text encoders, diffusion models and samplers.
//!
//! The crate is split by concern, one module per folder:
//! - [`files`]: memory-mapped safetensors / GGUF / diffusers folders, tensor-name
//!   normalization, architecture detection.
//! - [`fixture`]: checkpoints with the real tensor layout and small random weights.
//! - [`text`]: the CLIP BPE tokenizer and prompt weighting.
//! - [`sampling`]: noise generators (Philox, mt19937), schedulers and samplers.
//! - [`output`]: output paths checked before any work and written without destroying
//!   what is there; [`health`]: numeric health of stage outputs.
//! - [`lora`]: LoRA files, their keys mapped to our names, the merge into the weights.
//! - [`image_io`]: image files in and out (PNG, JPEG, WebP, BMP), init-image fitting,
//!   generation parameters in the files, output names.

pub mod controlnet;
pub mod describe;
pub mod diffusion;
pub mod family;
pub mod fixture;
pub mod health;
pub mod hires;
pub mod image_io;
pub mod loader;
pub mod lora;
pub mod output;
pub mod pipeline;
pub mod placement;
pub mod presets;
pub mod report;
pub mod speed;
pub mod text;
pub mod upscale;
pub mod wtype;

/// Samplers, schedules and noise: the `sd-sampling` crate, under its old path.
pub use sd_sampling as sampling;

/// Model files, the tensor index and the architecture registry: the `sd-formats` crate,
/// under its old path.
pub use sd_formats as files;

#[cfg(test)]
mod files_tests;
