//! Planner inputs: a module's segment list, the device's memory, the flags.

use std::collections::{HashMap, HashSet};

use super::error::PlanError;
use super::{PLANNING_HEADROOM, SCRATCH_RESERVE};

/// A group of parameters that is loaded, pinned and evicted as a unit (usually one block's
/// weights), with its size on the computing device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamGroup {
    /// Name, unique on the device (qualified with the module, e.g. `diffusion/input_blocks.1`).
    pub name: String,
    /// Bytes of its replica on the computing device.
    pub bytes: u64,
}

impl ParamGroup {
    /// A group named `name` of `bytes` bytes.
    pub fn new(name: impl Into<String>, bytes: u64) -> Self {
        Self { name: name.into(), bytes }
    }
}

/// An output of a segment that a later segment reads (a cut tensor, e.g. a UNet skip
/// connection). Between segments it lives in a cut buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CutOutput {
    /// Bytes of the tensor.
    pub bytes: u64,
    /// Index of the last segment (in the module's list) that reads it; after its producer.
    pub last_reader: usize,
}

/// One segment of a module's fixed segment list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Name, for logs and errors (e.g. `input_blocks.4`).
    pub name: String,
    /// Parameter groups it needs resident while it computes.
    pub groups: Vec<ParamGroup>,
    /// Compute workspace of this segment's graph alone, as ggml's measure-only allocator
    /// reports it (intermediates, inputs and its own outputs).
    pub workspace: u64,
    /// Outputs read by later segments.
    pub cut_outputs: Vec<CutOutput>,
}

impl Segment {
    /// A segment with parameter groups and workspace, no cut outputs.
    pub fn new(name: impl Into<String>, groups: Vec<ParamGroup>, workspace: u64) -> Self {
        Self { name: name.into(), groups, workspace, cut_outputs: Vec::new() }
    }

    /// Adds an output read last by segment `last_reader`.
    pub fn with_cut_output(mut self, bytes: u64, last_reader: usize) -> Self {
        self.cut_outputs.push(CutOutput { bytes, last_reader });
        self
    }
}

/// A module's graph as the planner sees it: its segment list in execution order. A graph
/// without cut markers is one segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleGraph {
    /// Module name (the runner's name), for logs and errors.
    pub name: String,
    /// Segments in execution order.
    pub segments: Vec<Segment>,
}

/// A weight replica present on the device before the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replica {
    /// Group name.
    pub group: String,
    /// Bytes.
    pub bytes: u64,
    /// A pinned replica is never evicted: parameters whose parameter backend is this device,
    /// or another runner's weights while it computes.
    pub pinned: bool,
}

/// The device as one graph run of one runner finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceState {
    /// Device name, for errors and logs.
    pub name: String,
    /// Explicit managed budget in bytes (a positive `--max-vram`, or the startup snapshot a
    /// negative one resolves to); `None` without one.
    pub budget: Option<u64>,
    /// Live free memory the device reports; `None` when it reports none.
    pub free: Option<u64>,
    /// Managed bytes this runner cannot reclaim: compute workspaces, cut and cache buffers of
    /// other runners sharing the device, and this runner's caches. Replicas and this runner's
    /// compute buffer are listed separately.
    pub fixed: u64,
    /// Capacity of this runner's reusable compute buffer, already allocated (0 if none).
    pub workspace: u64,
    /// Weight replicas on the device, of every runner. Unpinned replicas of groups this graph
    /// does not use are reclaimed in this order.
    pub replicas: Vec<Replica>,
    /// Free memory never allocated ([`SCRATCH_RESERVE`] unless changed).
    pub scratch_reserve: u64,
    /// Extra headroom the monolithic choice requires ([`PLANNING_HEADROOM`] unless changed).
    pub planning_headroom: u64,
    /// Whether the device can copy host data while it computes (otherwise prefetch runs on a
    /// worker thread).
    pub async_transfer: bool,
}

impl DeviceState {
    /// An empty device named `name` with the given budget and free memory, default reserves,
    /// asynchronous transfer.
    pub fn new(name: impl Into<String>, budget: Option<u64>, free: Option<u64>) -> Self {
        Self {
            name: name.into(),
            budget,
            free,
            fixed: 0,
            workspace: 0,
            replicas: Vec::new(),
            scratch_reserve: SCRATCH_RESERVE,
            planning_headroom: PLANNING_HEADROOM,
            async_transfer: true,
        }
    }

    /// Managed bytes on the device now: fixed bytes, replicas, this runner's workspace.
    pub fn managed(&self) -> u64 {
        self.replicas.iter().fold(self.fixed.saturating_add(self.workspace), |acc, r| acc.saturating_add(r.bytes))
    }
}

/// Flags that change the plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// `--disable-segmented-compute`: run the graph whole even when it does not fit the headroom.
    pub disable_segmented_compute: bool,
    /// `--disable-prefetch`: load every segment's weights synchronously.
    pub disable_prefetch: bool,
}

/// Validated facts about a module graph and a device, used by the planner and the simulator.
#[derive(Debug)]
pub(crate) struct Facts {
    /// Bytes of every group the graph uses.
    pub bytes: HashMap<String, u64>,
    /// Unique groups of each segment, in order of first appearance.
    pub seg_groups: Vec<Vec<String>>,
    /// Every group of the graph, in order of first appearance.
    pub all_groups: Vec<String>,
    /// Groups with a pinned replica on the device (always resident, never counted as missing).
    pub device_pinned: HashSet<String>,
}

impl Facts {
    /// Checks the module against itself and the device: a group has one size everywhere, a
    /// replica is listed once, a cut output is read after it is written and within the list.
    pub fn new(module: &ModuleGraph, device: &DeviceState) -> Result<Self, PlanError> {
        let invalid = |reason: String| PlanError::InvalidInput { module: module.name.clone(), reason };
        if module.segments.is_empty() {
            return Err(invalid("the segment list is empty (a graph without cuts is one segment)".into()));
        }
        let n = module.segments.len();
        let mut bytes: HashMap<String, u64> = HashMap::new();
        let mut seg_groups = Vec::with_capacity(n);
        let mut all_groups = Vec::new();
        for (i, seg) in module.segments.iter().enumerate() {
            let mut seen = HashSet::new();
            let mut groups = Vec::new();
            for g in &seg.groups {
                match bytes.get(&g.name) {
                    Some(&b) if b != g.bytes => {
                        return Err(invalid(format!(
                            "group `{}` is {} bytes in segment `{}` but {} bytes earlier; a group has one size",
                            g.name, g.bytes, seg.name, b
                        )))
                    }
                    Some(_) => {}
                    None => {
                        bytes.insert(g.name.clone(), g.bytes);
                        all_groups.push(g.name.clone());
                    }
                }
                if seen.insert(g.name.as_str()) {
                    groups.push(g.name.clone());
                }
            }
            for c in &seg.cut_outputs {
                if c.last_reader <= i || c.last_reader >= n {
                    return Err(invalid(format!(
                        "segment `{}` (index {i}) has a cut output read last by segment {}; accepted: an index \
                         after {i} and below {n}",
                        seg.name, c.last_reader
                    )));
                }
            }
            seg_groups.push(groups);
        }
        let mut listed = HashSet::new();
        let mut device_pinned = HashSet::new();
        for r in &device.replicas {
            if !listed.insert(r.group.as_str()) {
                return Err(invalid(format!("device {} lists a replica of `{}` twice", device.name, r.group)));
            }
            if let Some(&b) = bytes.get(&r.group) {
                if b != r.bytes {
                    return Err(invalid(format!(
                        "the replica of `{}` on {} is {} bytes but the graph needs {} bytes",
                        r.group, device.name, r.bytes, b
                    )));
                }
                if r.pinned {
                    device_pinned.insert(r.group.clone());
                }
            }
        }
        Ok(Self { bytes, seg_groups, all_groups, device_pinned })
    }

    /// Unique groups of the base segments in `range`, in order of first appearance.
    pub fn groups_of(&self, range: std::ops::Range<usize>) -> Vec<String> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for i in range {
            for g in &self.seg_groups[i] {
                if seen.insert(g.as_str()) {
                    out.push(g.clone());
                }
            }
        }
        out
    }

    /// Bytes of `groups` that are not pinned on the device (what occupies the runner's capacity).
    pub fn unpinned_bytes(&self, groups: &[String]) -> u64 {
        groups.iter().filter(|g| !self.device_pinned.contains(*g)).map(|g| self.bytes[g]).fold(0, u64::saturating_add)
    }
}

/// Bytes of cut outputs produced in `range` and read after it (the merged segment's cut buffers).
pub(crate) fn cuts_out(segments: &[Segment], range: std::ops::Range<usize>) -> u64 {
    let end = range.end;
    segments[range]
        .iter()
        .flat_map(|s| &s.cut_outputs)
        .filter(|c| c.last_reader >= end)
        .map(|c| c.bytes)
        .fold(0, u64::saturating_add)
}

/// Bytes of cut outputs produced before `start` and read at or after it (live while it runs).
pub(crate) fn cuts_in(segments: &[Segment], start: usize) -> u64 {
    segments[..start]
        .iter()
        .flat_map(|s| &s.cut_outputs)
        .filter(|c| c.last_reader >= start)
        .map(|c| c.bytes)
        .fold(0, u64::saturating_add)
}
