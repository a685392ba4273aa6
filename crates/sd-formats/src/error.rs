//! Errors of the model-file layer: what is wrong inside a file, and which file it was.
//!
//! The header parsers work on byte slices and know nothing of paths, so they return a
//! [`FormatError`] that names the tensor or key at fault; [`FilesError`] adds the file.
//! Messages say what was found and what is accepted, so a user can act on them.

use std::path::PathBuf;

/// What is wrong inside one safetensors or GGUF file (the file is named by [`FilesError`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// The file ends before a structure it announces.
    #[error("file is truncated: {what} needs bytes {start}..{end} but the file has {file_len} bytes")]
    Truncated { what: String, start: u64, end: u64, file_len: u64 },

    /// The safetensors header length is larger than the file or than any real header.
    #[error(
        "safetensors header length {len} is impossible (file has {file_len} bytes; headers are at most {limit} bytes)"
    )]
    HeaderLength { len: u64, file_len: u64, limit: u64 },

    /// The header contains bytes that are not UTF-8.
    #[error("{what} is not valid UTF-8 (at byte {valid_up_to} of it)")]
    NotUtf8 { what: String, valid_up_to: usize },

    /// The safetensors header is not a JSON object.
    #[error("safetensors header is not valid JSON: {message}")]
    Json { message: String },

    /// A safetensors header entry lacks a field or has one of the wrong kind.
    #[error("tensor '{tensor}': {problem} (expected {{\"dtype\": STRING, \"shape\": [INT, ...], \"data_offsets\": [BEGIN, END]}})")]
    BadEntry { tensor: String, problem: String },

    /// `__metadata__` is not a JSON object.
    #[error("__metadata__ must be a JSON object of strings, found {found}")]
    BadMetadata { found: String },

    /// A tensor name appears twice in one file.
    #[error("tensor '{tensor}' appears twice in the header")]
    DuplicateTensor { tensor: String },

    /// A dtype string this reader does not know.
    #[error("tensor '{tensor}' has unknown dtype '{dtype}' (accepted: {accepted})")]
    UnknownDType { tensor: String, dtype: String, accepted: &'static str },

    /// A GGUF tensor type id that is not (or no longer) a ggml type.
    #[error("tensor '{tensor}' has unknown ggml type id {id} (known: 0-3, 6-30, 34, 35, 39-42)")]
    UnknownGgmlType { tensor: String, id: u32 },

    /// A tensor's shape has too many elements or bytes to be real.
    #[error("tensor '{tensor}' has shape {shape:?} whose size overflows")]
    ShapeOverflow { tensor: String, shape: Vec<u64> },

    /// A shape dimension is negative (GGUF stores dimensions as signed 64-bit).
    #[error("tensor '{tensor}' dimension {dim} is negative ({value})")]
    NegativeDim { tensor: String, dim: usize, value: i64 },

    /// More dimensions than ggml tensors have.
    #[error("tensor '{tensor}' has {n_dims} dimensions, at most {max} are accepted")]
    TooManyDims { tensor: String, n_dims: u64, max: u64 },

    /// A quantized row that is not a whole number of blocks.
    #[error("tensor '{tensor}' of type {dtype} has rows of {ne0} elements, not a multiple of the block size {block}")]
    PartialBlock { tensor: String, dtype: String, ne0: u64, block: u64 },

    /// The stored byte range disagrees with shape × dtype.
    #[error("tensor '{tensor}' ({dtype}, shape {shape:?}) needs {expected} bytes but its data_offsets span {actual}")]
    SizeMismatch { tensor: String, dtype: String, shape: Vec<u64>, expected: u64, actual: u64 },

    /// A begin offset after the end offset.
    #[error("tensor '{tensor}' has data_offsets [{begin}, {end}]: begin is after end")]
    ReversedOffsets { tensor: String, begin: u64, end: u64 },

    /// Tensor data past the end of the file.
    #[error("tensor '{tensor}' data at bytes {begin}..{end} of the data section lies past its end ({data_len} bytes)")]
    OutOfBounds { tensor: String, begin: u64, end: u64, data_len: u64 },

    /// Two tensors share bytes.
    #[error("tensors '{first}' and '{second}' overlap in the file (bytes {overlap_start}..{overlap_end} of the data section)")]
    Overlap { first: String, second: String, overlap_start: u64, overlap_end: u64 },

    /// A GGUF file that does not start with `GGUF`.
    #[error("not a GGUF file: magic is {found:?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },

    /// A GGUF version other than 2 or 3.
    #[error("GGUF version {version} is not supported (accepted: 2, 3){hint}")]
    UnsupportedVersion { version: u32, hint: &'static str },

    /// A count or length that cannot fit in the bytes the file has left.
    #[error("{what} is {count}, but the {remaining} bytes left in the file hold at most {max}")]
    CountTooLarge { what: String, count: u64, remaining: u64, max: u64 },

    /// A GGUF metadata array longer than the reader accepts.
    #[error("the array of metadata key '{key}' declares {len} elements; at most {max} are read")]
    ArrayTooLong { key: String, len: u64, max: u64 },

    /// GGUF metadata strings past what the reader keeps.
    #[error("the string of metadata key '{key}' brings the metadata's strings past {limit} bytes")]
    MetadataTooLarge { key: String, limit: u64 },

    /// A GGUF metadata array that was read without its elements, given to the writer.
    #[error("metadata key '{key}' is an array whose elements were not read; it cannot be written")]
    UnreadArray { key: String },

    /// A GGUF metadata value type outside the specification.
    #[error("metadata key '{key}' has unknown value type {type_id} (known: 0-12; arrays of arrays are not accepted)")]
    UnknownValueType { key: String, type_id: u32 },

    /// The same GGUF metadata key twice.
    #[error("metadata key '{key}' appears twice")]
    DuplicateKey { key: String },

    /// An empty GGUF metadata key.
    #[error("metadata key #{index} is empty")]
    EmptyKey { index: u64 },

    /// A well-known GGUF key with the wrong value type.
    #[error("metadata key '{key}' must be {expected}, found {found}")]
    WrongKeyType { key: String, expected: &'static str, found: &'static str },

    /// `general.alignment` that is zero or not a power of two.
    #[error("general.alignment is {value}, it must be a non-zero power of two")]
    BadAlignment { value: u64 },

    /// A GGUF tensor offset that is not a multiple of the alignment.
    #[error("tensor '{tensor}' offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned { tensor: String, offset: u64, alignment: u64 },
}

/// An error of the model-file layer, naming the file (and, inside it, the tensor).
#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    /// The file could not be opened, mapped or read.
    #[error("cannot read '{}': {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },

    /// The path names a FIFO, device, socket or directory where a file is expected.
    #[error("'{}' is {kind}, not a regular file", path.display())]
    NotRegular { path: PathBuf, kind: &'static str },

    /// A text file over the size this reader accepts.
    #[error("'{}' is {len} bytes; at most {limit} bytes are read from such a file", path.display())]
    TooLarge { path: PathBuf, len: u64, limit: u64 },

    /// A model file that changed size or modification time after it was opened.
    #[error("'{}' changed while in use ({what}); do not modify or truncate a model file during a run", path.display())]
    Changed { path: PathBuf, what: String },

    /// A tensor whose element type no model computation accepts (integers, f64, `U8`, `BOOL`,
    /// q8_1, q8_K).
    #[error("'{}': tensor '{tensor}' has dtype {dtype}, which the {component} cannot compute with (accepted: f32, f16, bf16 and ggml's quantized types but q8_1 and q8_K, which ggml has no matrix product or dequantization for)", path.display())]
    UnsupportedDType { path: PathBuf, tensor: String, dtype: &'static str, component: &'static str },

    /// A component file whose tensors are all of another component (a T5 encoder given as
    /// the diffusion model).
    #[error("'{}' is {}, not {}: none of its tensors belongs to {}", path.display(), found.describe(), given.describe(), given.describe())]
    WrongComponent { path: PathBuf, found: super::names::FileRole, given: super::names::FileRole },

    /// Files that hold no tensor of any module.
    #[error("{files}: no tensor of a text encoder, diffusion model, VAE or TAESD was found (the headers list {tensors} tensors)")]
    NoModelTensors { files: String, tensors: usize },

    /// The file's contents are malformed.
    #[error("'{}': {problem}", path.display())]
    Malformed { path: PathBuf, problem: FormatError },

    /// Neither safetensors nor GGUF.
    /// (`what` describes how it starts; its bytes are never echoed: the file may be anyone's.)
    #[error("'{}' is neither a safetensors nor a GGUF file ({what}); accepted: .safetensors, .gguf, or a diffusers folder with model_index.json", path.display())]
    UnknownFormat { path: PathBuf, what: &'static str },

    /// A diffusers folder without its UNet, or with a malformed JSON file.
    #[error("diffusers folder '{}': {problem}", path.display())]
    Diffusers { path: PathBuf, problem: String },

    /// Two files (or two names of one file) give the same internal tensor name.
    #[error("tensor '{name}' is given twice: as '{first_original}' in '{}' and as '{second_original}' in '{}'", first_path.display(), second_path.display())]
    DuplicateTensor {
        name: String,
        first_original: String,
        first_path: PathBuf,
        second_original: String,
        second_path: PathBuf,
    },

    /// A fused attention projection that cannot be split into q, k, v.
    #[error("'{}': tensor '{tensor}' (shape {shape:?}, {dtype}) cannot be split into q/k/v thirds: {problem}", path.display())]
    BadFusedProjection { path: PathBuf, tensor: String, shape: Vec<u64>, dtype: String, problem: &'static str },

    /// No model was given.
    #[error("no model file given: a checkpoint, or a diffusion model with its components, is needed")]
    NoModel,

    /// No registered architecture recognises the tensors.
    #[error("unknown model architecture in {files}; known: {known}. Found: {found}")]
    UnknownArchitecture { files: String, known: String, found: String },

    /// More than one registered architecture recognises the tensors.
    #[error("ambiguous model architecture: the tensors fit {candidates:?}; pass the files of one model")]
    AmbiguousArchitecture { candidates: Vec<&'static str> },
}
