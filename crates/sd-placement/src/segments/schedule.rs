//! Planner output: the mode, the figures behind it, and the actions of every (merged) segment.

use std::fmt;
use std::ops::Range;

use crate::fmt_bytes;

/// How the graph runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The whole graph at once.
    Monolithic,
    /// Its segment list in order.
    Segmented,
}

/// Why the planner chose the mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Missing weights plus incremental workspace plus the planning headroom fit.
    Fits,
    /// They do not, and the graph has cut markers: segmented.
    ExceedsHeadroom,
    /// The graph has no cut markers (one segment).
    NoCuts,
    /// `--disable-segmented-compute`.
    Disabled,
    /// The device has neither a budget nor a free-memory figure.
    Unbounded,
}

/// The figures of the monolithic/segmented choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Why.
    pub reason: Reason,
    /// Missing weights of the whole graph.
    pub missing_weights: u64,
    /// Workspace of the whole graph beyond the reusable compute buffer.
    pub new_workspace: u64,
    /// Available device headroom (the tighter of budget and free memory, counting unpinned
    /// replicas the graph does not use as available); `None` when unbounded.
    pub available: Option<u64>,
    /// The planning headroom required on top.
    pub planning_headroom: u64,
}

impl Decision {
    /// Missing weights plus incremental workspace.
    pub fn need(&self) -> u64 {
        self.missing_weights.saturating_add(self.new_workspace)
    }
}

/// How a prefetch is carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transfer {
    /// An asynchronous copy on the device's transfer queue.
    Async,
    /// A copy on a worker thread (the device has no asynchronous transfer).
    WorkerThread,
}

/// One step of a segment, in the order the executor performs them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Free the unpinned replica of `group`.
    Evict {
        /// Group name.
        group: String,
        /// Bytes released.
        bytes: u64,
    },
    /// Reallocate the runner's compute buffer to exactly `bytes` (free, then allocate): to
    /// grow it, or with `bytes == 0` to release an oversized idle one under pressure before
    /// evicting replicas (it is then allocated at the segment's size after the evictions).
    Workspace {
        /// New capacity.
        bytes: u64,
    },
    /// Copy `group` to the device now and wait for it.
    Load {
        /// Group name.
        group: String,
        /// Bytes allocated and copied.
        bytes: u64,
    },
    /// Allocate the cut buffers this segment writes for later segments.
    AllocCut {
        /// Bytes.
        bytes: u64,
    },
    /// Allocate `group`'s replica and start copying it, to overlap with this segment's
    /// compute; the segment `for_segment` waits for it before it computes. The replica stays
    /// pinned until then.
    Prefetch {
        /// Group name.
        group: String,
        /// Bytes allocated and copied.
        bytes: u64,
        /// Index (in [`Schedule::segments`]) of the segment that needs it.
        for_segment: usize,
        /// How the copy runs.
        via: Transfer,
    },
    /// Compute this segment (its groups are resident and pinned).
    Compute,
    /// Free cut buffers whose last reader this segment was.
    ReleaseCut {
        /// Bytes.
        bytes: u64,
    },
}

/// One (possibly merged) segment of a schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedSegment {
    /// `first..last` base segment names, or the single name.
    pub name: String,
    /// Indices of the base segments it covers.
    pub base: Range<usize>,
    /// Groups it needs resident (pinned while it computes).
    pub groups: Vec<String>,
    /// Its compute workspace.
    pub workspace: u64,
    /// What to do, in order.
    pub actions: Vec<Action>,
    /// A prefetch for the next parameter-bearing segment was considered and did not fit.
    pub prefetch_skipped: bool,
    /// Its groups are still resident when the run ends, so the next run (sampling step)
    /// does not load them again.
    pub stays_resident: bool,
}

impl PlannedSegment {
    /// Groups evicted, in order (for its loads first, then for its prefetch).
    pub fn evictions(&self) -> impl Iterator<Item = &str> {
        self.actions.iter().filter_map(|a| match a {
            Action::Evict { group, .. } => Some(group.as_str()),
            _ => None,
        })
    }

    /// Groups loaded synchronously before it computes, in order.
    pub fn loads(&self) -> impl Iterator<Item = &str> {
        self.actions.iter().filter_map(|a| match a {
            Action::Load { group, .. } => Some(group.as_str()),
            _ => None,
        })
    }

    /// Groups prefetched while it computes, in order.
    pub fn prefetches(&self) -> impl Iterator<Item = &str> {
        self.actions.iter().filter_map(|a| match a {
            Action::Prefetch { group, .. } => Some(group.as_str()),
            _ => None,
        })
    }

    /// Bytes loaded synchronously plus bytes prefetched.
    pub fn transfer_bytes(&self) -> u64 {
        self.actions
            .iter()
            .map(|a| match a {
                Action::Load { bytes, .. } | Action::Prefetch { bytes, .. } => *bytes,
                _ => 0,
            })
            .fold(0, u64::saturating_add)
    }
}

/// The plan of one graph run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Module (runner) name.
    pub module: String,
    /// Device name.
    pub device: String,
    /// Monolithic or segmented.
    pub mode: Mode,
    /// The figures of that choice.
    pub decision: Decision,
    /// What this runner could hold at once after reclaiming (`None`: unbounded).
    pub capacity: Option<u64>,
    /// Number of base segments (cut markers + 1).
    pub base_segments: usize,
    /// The segments to run, in order; one for a monolithic run.
    pub segments: Vec<PlannedSegment>,
}

impl Schedule {
    /// Largest workspace of its segments ("peak across N segments").
    pub fn peak_workspace(&self) -> u64 {
        self.segments.iter().map(|s| s.workspace).max().unwrap_or(0)
    }

    /// Bytes this run copies to the device.
    pub fn transfer_bytes(&self) -> u64 {
        self.segments.iter().map(PlannedSegment::transfer_bytes).fold(0, u64::saturating_add)
    }

    /// Groups prefetched during the run, in order.
    pub fn prefetches(&self) -> impl Iterator<Item = &str> {
        self.segments.iter().flat_map(PlannedSegment::prefetches)
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match self.mode {
            Mode::Monolithic => "monolithic".to_string(),
            Mode::Segmented => format!("{} segments (from {})", self.segments.len(), self.base_segments),
        };
        let avail = self.decision.available.map_or_else(|| "unbounded".to_string(), fmt_bytes);
        write!(
            f,
            "{} on {}: {mode} ({:?}; need {} of {avail} + {} planning headroom), peak workspace {}, transfers {}",
            self.module,
            self.device,
            self.decision.reason,
            fmt_bytes(self.decision.need()),
            fmt_bytes(self.decision.planning_headroom),
            fmt_bytes(self.peak_workspace()),
            fmt_bytes(self.transfer_bytes()),
        )?;
        let prefetched = self.prefetches().count();
        if prefetched > 0 {
            write!(f, ", {prefetched} groups prefetched")?;
        }
        Ok(())
    }
}
