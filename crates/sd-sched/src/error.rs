//! The error type of this crate.

/// Errors of weights residency and graph execution.
#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    /// A model asked for a tensor its weight set does not have.
    #[error("tensor `{0}` is not in this module's weights")]
    MissingTensor(String),
    /// The source could not provide a tensor.
    #[error("loading tensor `{name}`: {source}")]
    Source { name: String, source: crate::weights::SourceError },
    /// Allocation failed on a device.
    #[error("{device}: cannot allocate {bytes} bytes for {what}")]
    Alloc { device: String, bytes: usize, what: String },
    /// A lower-level failure.
    #[error(transparent)]
    Backend(#[from] sd_backends::BackendError),
}

/// Result alias.
pub type Result<T, E = SchedError> = std::result::Result<T, E>;
