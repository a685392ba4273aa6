//! The error type of this crate: bad flags, bad inputs, and failures of the graph runs.

use sd_sched::SchedError;

/// Errors of VAE loading, tiling and graph execution.
#[derive(Debug, thiserror::Error)]
pub enum VaeError {
    /// A tiling option that cannot be used (a front end names its own flag for it).
    #[error("{}: {message}", option.name())]
    Tiling {
        /// The option.
        option: crate::tiling::TilingOption,
        /// What is wrong and what is accepted.
        message: String,
    },
    /// A tiling option given while tiling is off.
    #[error("{} is given but tiling is off", option.name())]
    TilingOff {
        /// The option.
        option: crate::tiling::TilingOption,
    },
    /// An input buffer whose size or channel count does not fit the model.
    #[error("{module}: {message}")]
    Input {
        /// `vae` or `taesd`.
        module: &'static str,
        /// What was expected and what was given.
        message: String,
    },
    /// An upscaler file that lacks a tensor the network reads, or holds one of another shape.
    #[error("upscaler: tensor `{tensor}`: {message}")]
    UpscalerLayout {
        /// The tensor (in the RRDBNet naming).
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// The compute buffer of a graph could not be allocated, or it is larger than the cap.
    /// This is the failure the decode path retries with smaller tiles.
    #[error("{device}: cannot allocate {bytes} bytes for the {module} compute buffer{}",
            .cap.map(|c| format!(" (cap {c} bytes)")).unwrap_or_default())]
    Alloc {
        /// The device of the runner.
        device: String,
        /// `vae` or `taesd`.
        module: &'static str,
        /// Bytes the graph needs.
        bytes: usize,
        /// The memory cap that was exceeded, when a cap caused the failure.
        cap: Option<usize>,
    },
    /// A graph failed while running (never retried).
    #[error("{module} compute failed")]
    Compute {
        /// `vae` or `taesd`.
        module: &'static str,
        /// The runner's error.
        #[source]
        source: SchedError,
    },
    /// Weights could not be declared, allocated or loaded.
    #[error("{module} weights")]
    Weights {
        /// `vae` or `taesd`.
        module: &'static str,
        /// The weights error (names the tensor).
        #[source]
        source: SchedError,
    },
    /// A ggml object could not be created (context, tensor data).
    #[error("{module}: ggml")]
    Backend {
        /// `vae` or `taesd`.
        module: &'static str,
        /// The wrapper's error.
        #[source]
        source: sd_backends::BackendError,
    },
}

impl VaeError {
    /// Whether this is an allocation failure (the only kind the decode path retries).
    pub fn is_alloc(&self) -> bool {
        matches!(self, VaeError::Alloc { .. })
    }

    pub(crate) fn tiling(option: crate::tiling::TilingOption, message: impl Into<String>) -> Self {
        VaeError::Tiling { option, message: message.into() }
    }

    pub(crate) fn upscaler(tensor: &str, message: impl Into<String>) -> Self {
        VaeError::UpscalerLayout { tensor: tensor.to_string(), message: message.into() }
    }

    pub(crate) fn input(module: &'static str, message: impl Into<String>) -> Self {
        VaeError::Input { module, message: message.into() }
    }
}

/// Result alias.
pub type Result<T, E = VaeError> = std::result::Result<T, E>;
