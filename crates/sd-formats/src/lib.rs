//! Model files: memory-mapped safetensors / GGUF / diffusers folders, one internal naming,
//! architecture detection.
//!
//! # Design
//!
//! * **Headers only, through memory maps.** Opening a model maps each file read-only and
//!   parses only its header; tensor bytes are borrowed from the map ([`ModelFiles::bytes`])
//!   and paged in when read, so a multi-GiB checkpoint is indexed in milliseconds and never
//!   copied by this layer. Weight-type conversion (`--type`) belongs to the loader above.
//! * **Our own parsers, strict and bounded.** [`safetensors::parse`] and [`gguf::parse`]
//!   take the file as a byte slice, so they are pure functions that tests, proptest and the
//!   fuzz targets call directly. Every length, count and offset is checked against the file
//!   size before use: a lying header is an error naming the file and tensor, never a panic,
//!   an out-of-bounds slice or a huge allocation.
//! * **One internal naming** ([`names`]): whatever the layout (original LDM single file,
//!   SD 2.x OpenCLIP, diffusers folders, sd.cpp GGUF, separate component files), tensors
//!   are indexed under the names stable-diffusion.cpp uses after its conversion, with
//!   fused OpenCLIP q/k/v projections split into per-layer HF-style `q_proj/k_proj/v_proj`
//!   views of the same bytes. The original name stays on every entry.
//! * **Plain data for the layers above.** [`TensorIndex`] holds no file handles; the planner
//!   reads each tensor's [`Component`] and execution-order block from it, and architecture
//!   detection ([`arch`]) runs on it through an `inventory` registry that later model
//!   families join from their own files.
//!
//! This layer does no ggml calls and knows no model math; it refuses nothing that is
//! well-formed (unknown-but-valid tensors are indexed, then reported by whoever expects a
//! given set), with one exception: a weight of a model component whose dtype no computation
//! accepts (integers, f64) is refused at open, because ggml would crash on it
//! ([`TensorIndex::check_weight_dtypes`]). Paths are opened through [`open`] (regular files
//! only, never blocking).

pub mod arch;
pub mod dtype;
pub mod error;
pub mod f8;
pub mod gguf;
#[cfg(unix)]
pub mod guard;
pub mod index;
pub mod names;
pub mod open;
mod raw;
pub mod safetensors;
pub mod store;

pub use arch::{ArchSpec, Detected, Prediction, PredictionSource};
pub use dtype::DType;
pub use error::{FilesError, FormatError};
pub use index::{Component, FileFormat, SourceFile, TensorEntry, TensorIndex};
pub use names::{FileRole, QkvPart};
pub use raw::RawTensor;
pub use safetensors::HeaderEntry;
pub use store::{ModelFiles, ModelSources};

// The README's example is compiled (not run: it needs model files) as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}
