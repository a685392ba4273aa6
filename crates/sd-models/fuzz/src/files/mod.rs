//! The parser source files of `sd-models/src/files`, compiled as they are (see `../lib.rs`).

#[path = "../../../src/files/dtype.rs"]
pub mod dtype;
#[path = "../../../src/files/error.rs"]
pub mod error;
#[path = "../../../src/files/gguf.rs"]
pub mod gguf;
#[path = "../../../src/files/raw.rs"]
mod raw;
#[path = "../../../src/files/safetensors.rs"]
pub mod safetensors;

pub use raw::RawTensor;
