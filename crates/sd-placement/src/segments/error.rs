//! Why a graph cannot be planned.

use std::fmt;

use crate::fmt_bytes;

/// A plan that cannot be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Even after reclaiming every unpinned replica, a segment (or the whole graph, when it
    /// must run monolithic) does not fit the device.
    #[error("{0}")]
    DoesNotFit(Box<Shortfall>),
    /// The description of the module or the device contradicts itself.
    #[error("segment plan for {module}: {reason}")]
    InvalidInput {
        /// Module name.
        module: String,
        /// What is wrong and what is accepted.
        reason: String,
    },
}

/// What did not fit, where, and by how much.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// Device name.
    pub device: String,
    /// Module (runner) name.
    pub module: String,
    /// ``segment `name` `` or `the whole graph`.
    pub what: String,
    /// Bytes it needs (for a segment: its weights, workspace and live cut buffers; for the
    /// whole graph: missing weights and the workspace beyond the reusable buffer).
    pub needed: u64,
    /// Weights part of `needed`.
    pub weights: u64,
    /// Workspace part of `needed`.
    pub workspace: u64,
    /// Cut-buffer part of `needed`.
    pub cuts: u64,
    /// Bytes available to it.
    pub available: u64,
    /// The explicit managed budget, if any.
    pub budget: Option<u64>,
    /// Live free memory, if known.
    pub free: Option<u64>,
    /// The scratch reserve.
    pub reserve: u64,
    /// What the user can change.
    pub hint: &'static str,
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} of {} needs {} bytes ({}: {} weights, {} workspace, {} cut buffers) but only {} bytes ({}) \
             are available after reclaiming unpinned replicas (managed budget {}, live free {} less the {} \
             scratch reserve); {}",
            self.device,
            self.what,
            self.module,
            self.needed,
            fmt_bytes(self.needed),
            fmt_bytes(self.weights),
            fmt_bytes(self.workspace),
            fmt_bytes(self.cuts),
            self.available,
            fmt_bytes(self.available),
            self.budget.map_or_else(|| "none".to_string(), fmt_bytes),
            self.free.map_or_else(|| "unknown".to_string(), fmt_bytes),
            fmt_bytes(self.reserve),
            self.hint,
        )
    }
}
