//! The error type of this crate.

/// Errors of weights residency and graph execution.
#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    /// A model asked for a tensor its weight set does not have.
    #[error("tensor `{0}` is not in this module's weights")]
    MissingTensor(String),
    /// The source could not provide a tensor.
    #[error("loading tensor `{name}`")]
    Source { name: String, source: crate::weights::SourceError },
    /// Allocation failed on a device.
    #[error("{device}: cannot allocate {bytes} bytes for {what}")]
    Alloc { device: String, bytes: usize, what: String },
    /// An allocation would exceed the device's managed budget.
    #[error(
        "{device}: {what} needs {bytes} more bytes, but {managed} of the {budget}-byte budget are in use \
         (raise the device's budget or move parameters off it)"
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

/// What did not fit: the device, the bytes asked for, and the limit when one is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoRoom {
    /// Device name.
    pub device: String,
    /// Bytes needed.
    pub bytes: u64,
    /// The budget or available bytes that refused them, if known.
    pub cap: Option<u64>,
}

impl SchedError {
    /// Whether this is the device running out of room (an allocation failing, the managed
    /// budget refusing a charge, or the planner finding no room), with the figures: callers
    /// that can retry smaller (VAE tiling) treat all three alike.
    pub fn no_room(&self) -> Option<NoRoom> {
        match self {
            SchedError::Alloc { device, bytes, .. } => {
                Some(NoRoom { device: device.clone(), bytes: *bytes as u64, cap: None })
            }
            SchedError::OverBudget { device, bytes, budget, .. } => {
                Some(NoRoom { device: device.clone(), bytes: *bytes, cap: Some(*budget) })
            }
            SchedError::Plan(crate::plan::PlanError::DoesNotFit(s)) => {
                Some(NoRoom { device: s.device.clone(), bytes: s.needed, cap: Some(s.available) })
            }
            _ => None,
        }
    }
}

/// Result alias.
pub type Result<T, E = SchedError> = std::result::Result<T, E>;
