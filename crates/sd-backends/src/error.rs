//! The error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong below the model layer.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// No device has this name (or unique prefix).
    #[error("unknown device `{name}`; available devices: {available}")]
    UnknownDevice { name: String, available: String },
    /// A backend could not be created for a device.
    #[error("could not initialise a backend for device `{0}`")]
    BackendInit(String),
    /// A plugin needed for an operation is not loaded.
    #[error("the {0} plugin is not loaded (searched: {1})")]
    PluginMissing(String, String),
    /// The plugin lacks a function we need.
    #[error("plugin `{plugin}` does not export `{symbol}`")]
    MissingProc { plugin: String, symbol: String },
    /// An RPC endpoint string is malformed.
    #[error("bad RPC endpoint `{0}`: expected HOST:PORT with an IPv4 address or host name")]
    BadEndpoint(String),
    /// An RPC server could not be reached or did not speak the protocol.
    #[error("RPC server {endpoint} is unusable: {reason}")]
    RpcUnreachable { endpoint: String, reason: String },
    /// An RPC server stopped answering or went away during the run.
    #[error(
        "lost RPC server {endpoint} ({devices}): {reason}; what it held for this run (weights, \
         activations) is gone, so the run stopped"
    )]
    RpcLost { endpoint: String, devices: String, reason: String },
    /// A buffer allocation failed on a device.
    #[error("allocating {bytes} bytes on {device} failed")]
    Alloc { device: String, bytes: usize },
    /// A tensor could not be placed in a buffer.
    #[error("cannot place tensor `{name}`: {reason}")]
    Placement { name: String, reason: String },
    /// A graph computation failed.
    #[error("graph computation on {device} failed with status {status}")]
    Compute { device: String, status: i32 },
    /// A tensor's data is in a buffer type that takes writes only (a device's extra buffer
    /// type holds weights in a layout of its own).
    #[error("tensor `{name}` is stored in the write-only buffer type {buffer_type} and cannot be read back")]
    WriteOnly { name: String, buffer_type: String },
    /// A tensor's data is used in place from read-only memory (a model file's memory map).
    #[error("tensor `{name}` is used in place from a read-only mapping of its model file and cannot be written")]
    ReadOnly { name: String },
    /// A graph reads a weight held in an extra buffer type with an operation that buffer
    /// type does not compute.
    #[error(
        "graph node `{node}` ({op}) reads `{weight}`, which is stored in {buffer_type}, a layout \
         only that buffer type's matrix product understands"
    )]
    ExtraBufferUse { node: String, op: String, weight: String, buffer_type: String },
    /// A ggml context could not be created.
    #[error("could not create a ggml context of {0} bytes")]
    Context(usize),
    /// Tensor data of the wrong size.
    #[error("tensor `{name}` holds {expected} bytes, got {got}")]
    DataSize { name: String, expected: usize, got: usize },
    /// A tensor of another type than the operation needs.
    #[error("tensor `{name}` has type {actual}, not {expected}")]
    TypeMismatch { name: String, expected: String, actual: String },
    /// An I/O error with the path involved.
    #[error("{path}")]
    Io { path: PathBuf, source: std::io::Error },
    /// An environment variable of the CPU kernels holds a value they do not take.
    #[error("the environment variable {variable}={value:?} is not one of {accepted}")]
    BadEnv { variable: &'static str, value: String, accepted: &'static str },
}

/// Result alias.
pub type Result<T, E = BackendError> = std::result::Result<T, E>;
