//! The tensor description both header parsers produce, before name normalization.
//!
//! Kept in its own file, with no dependency beyond [`DType`], so that the fuzz project can
//! compile the parsers alone (see `fuzz/src/lib.rs`).

use super::dtype::DType;

/// One tensor as a header describes it, before name normalization.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawTensor {
    /// Name as stored.
    pub name: String,
    pub dtype: DType,
    /// Row-major shape, outermost first (for GGUF: `ne` reversed).
    pub shape: Vec<u64>,
    /// Absolute byte offset in the file.
    pub offset: u64,
    /// Byte length (exactly shape × dtype).
    pub len: u64,
}
