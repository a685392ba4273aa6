//! Model files as a weight source: bytes from the memory map, converted to the type a model asks for.
//!
//! Checks done here, each an error naming the tensor and its file: missing
//! tensor, element count that disagrees with the architecture, NaN or infinite
//! values in float weights, an impossible type conversion.

use std::borrow::Cow;

use sd_backends::convert;
use sd_backends::GgmlType;
use sd_sched::{SourceError, TensorSource};

use crate::files::{DType, ModelFiles, TensorEntry};

/// A [`TensorSource`] reading from opened model files.
pub struct FileSource<'a> {
    files: &'a ModelFiles,
}

impl std::fmt::Debug for FileSource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FileSource({:?})", self.files)
    }
}

impl<'a> FileSource<'a> {
    /// A source over `files`.
    pub fn new(files: &'a ModelFiles) -> Self {
        Self { files }
    }

    fn path_of(&self, e: &TensorEntry) -> String {
        self.files.index().files().get(e.file).map(|f| f.path.display().to_string()).unwrap_or_default()
    }
}

/// The ggml type of a file dtype.
pub fn ggml_type(d: DType) -> Option<GgmlType> {
    d.ggml_type_id().map(GgmlType)
}

/// The file's storage type of every tensor, for models choosing their own storage types.
pub fn dtype_of(files: &ModelFiles) -> impl Fn(&str) -> Option<GgmlType> + '_ {
    move |name| files.index().get(name).and_then(|e| ggml_type(e.dtype))
}

/// Index of the first non-finite value in float data, if any.
fn first_non_finite(ty: GgmlType, data: &[u8]) -> Option<usize> {
    match ty {
        GgmlType::GGML_TYPE_F32 => {
            data.chunks_exact(4).position(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite())
        }
        // f16: exponent bits all ones means inf or NaN.
        GgmlType::GGML_TYPE_F16 => {
            data.chunks_exact(2).position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00)
        }
        GgmlType::GGML_TYPE_BF16 => {
            data.chunks_exact(2).position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80)
        }
        _ => None,
    }
}

impl TensorSource for FileSource<'_> {
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        let e = self
            .files
            .index()
            .get(name)
            .ok_or_else(|| SourceError(format!("tensor `{name}` is missing from the model files")))?;
        let want: i64 = ne.iter().product();
        if e.n_elements() as i64 != want {
            return Err(SourceError(format!(
                "tensor `{}` in {} has shape {:?} ({} elements); the architecture expects {} elements (ggml ne {:?})",
                e.original_name,
                self.path_of(e),
                e.shape,
                e.n_elements(),
                want,
                ne
            )));
        }
        let from = ggml_type(e.dtype).ok_or_else(|| {
            SourceError(format!(
                "tensor `{}` in {}: dtype {} cannot be loaded",
                e.original_name,
                self.path_of(e),
                e.dtype.name()
            ))
        })?;
        let bytes = self.files.bytes(e);
        if let Some(i) = first_non_finite(from, bytes) {
            return Err(SourceError(format!(
                "tensor `{}` in {} holds a NaN or infinite value (element {i})",
                e.original_name,
                self.path_of(e)
            )));
        }
        if from == ty {
            return Ok(Cow::Borrowed(bytes));
        }
        convert::convert(from, ty, bytes, ne)
            .map(Cow::Owned)
            .map_err(|err| SourceError(format!("tensor `{}` in {}: {err}", e.original_name, self.path_of(e))))
    }
}
