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
    /// An allocation would exceed the device's managed budget (`--max-vram`).
    #[error(
        "{device}: {what} needs {bytes} more bytes, but {managed} of the {budget}-byte budget are in use \
         (raise --max-vram for {device} or move parameters off it with --params-backend)"
    )]
    OverBudget { device: String, bytes: u64, what: String, managed: u64, budget: u64 },
    /// The segment planner refused the run.
    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),
    /// A call that cannot work in the current state.
    #[error("{0}")]
    Invalid(String),
    /// A lower-level failure.
    #[error(transparent)]
    Backend(#[from] sd_backends::BackendError),
}

/// Result alias.
pub type Result<T, E = SchedError> = std::result::Result<T, E>;
