//! Why a graph cannot be planned.

use sd_placement::fmt_bytes;

/// A plan that cannot be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Even after reclaiming every unpinned replica, a segment (or the whole graph, when it
    /// must run monolithic) does not fit the device.
    #[error(
        "{device}: {what} of {module} needs {needed} bytes ({needed_h}: {weights_h} weights, {workspace_h} \
         workspace, {cuts_h} cut buffers) but only {available} bytes ({available_h}) are available after \
         reclaiming unpinned replicas (managed budget {budget_h}, live free {free_h} less the {reserve_h} \
         scratch reserve); {hint}",
        needed_h = fmt_bytes(*needed),
        weights_h = fmt_bytes(*weights),
        workspace_h = fmt_bytes(*workspace),
        cuts_h = fmt_bytes(*cuts),
        available_h = fmt_bytes(*available),
        budget_h = budget.map_or_else(|| "none".to_string(), fmt_bytes),
        free_h = free.map_or_else(|| "unknown".to_string(), fmt_bytes),
        reserve_h = fmt_bytes(*reserve),
    )]
    DoesNotFit {
        /// Device name.
        device: String,
        /// Module (runner) name.
        module: String,
        /// `segment `name`` or `the whole graph`.
        what: String,
        /// Bytes it needs (for a segment: its weights, workspace and live cut buffers; for the
        /// whole graph: missing weights and the workspace beyond the reusable buffer).
        needed: u64,
        /// Weights part of `needed`.
        weights: u64,
        /// Workspace part of `needed`.
        workspace: u64,
        /// Cut-buffer part of `needed`.
        cuts: u64,
        /// Bytes available to it.
        available: u64,
        /// The explicit managed budget, if any.
        budget: Option<u64>,
        /// Live free memory, if known.
        free: Option<u64>,
        /// The scratch reserve.
        reserve: u64,
        /// What the user can change.
        hint: &'static str,
    },
    /// The description of the module or the device contradicts itself.
    #[error("segment plan for {module}: {reason}")]
    InvalidInput {
        /// Module name.
        module: String,
        /// What is wrong and what is accepted.
        reason: String,
    },
}
