//! A device simulator that replays schedules on its own ledger and checks every action.
//!
//! It shares no accounting code with the planner: group sizes, pins, cut-buffer lifetimes
//! and workspaces are recomputed from the module description, so a planner bug shows up as
//! a [`Violation`]. Several modules can run on one simulated device in turn (a text
//! encoder, then sampling steps, then a VAE); each keeps its own reusable workspace.

use std::collections::{HashMap, HashSet};

use super::error::PlanError;
use super::model::{DeviceState, ModuleGraph, Options, Replica};
use super::planner::plan;
use super::schedule::{Action, Mode, Schedule};
use super::workspace::MergedWorkspace;

/// What one replayed run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunReport {
    /// Segments computed, in order.
    pub computed: Vec<String>,
    /// Whether it ran monolithic (`None` for an empty report).
    pub mode: Option<Mode>,
    /// Groups loaded synchronously, in order.
    pub loaded: Vec<String>,
    /// Groups prefetched, in order.
    pub prefetched: Vec<String>,
    /// Groups evicted, in order.
    pub evicted: Vec<String>,
    /// Bytes loaded synchronously.
    pub loaded_bytes: u64,
    /// Bytes prefetched.
    pub prefetched_bytes: u64,
    /// Bytes evicted.
    pub evicted_bytes: u64,
    /// Highest managed bytes on the device during the run.
    pub high_water: u64,
}

impl RunReport {
    /// Bytes copied to the device (loads and prefetches).
    pub fn transferred(&self) -> u64 {
        self.loaded_bytes.saturating_add(self.prefetched_bytes)
    }
}

/// An action a schedule must not take, or a state it must not reach. Each variant's fields are
/// the values its message names.
#[allow(missing_docs)]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// Managed bytes above the explicit budget.
    #[error("{device}: {action} brings managed bytes to {managed}, above the budget of {budget}")]
    OverBudget { device: String, action: String, managed: u64, budget: u64 },
    /// An allocation eating into the scratch reserve.
    #[error(
        "{device}: {action} allocates {bytes} bytes with {free} free, eating into the {reserve}-byte scratch reserve"
    )]
    IntoReserve { device: String, action: String, bytes: u64, free: u64, reserve: u64 },
    /// Eviction of a replica that is not there.
    #[error("segment `{segment}` evicts `{group}`, which has no replica on the device")]
    EvictAbsent { segment: String, group: String },
    /// Eviction of a pinned replica (device-pinned, the current segment's, or prefetched).
    #[error("segment `{segment}` evicts `{group}`, which is pinned")]
    EvictPinned { segment: String, group: String },
    /// A load of a group that already has a replica.
    #[error("segment `{segment}` loads `{group}`, which is already resident")]
    AlreadyResident { segment: String, group: String },
    /// A group the module does not have, or with the wrong size.
    #[error("segment `{segment}` moves `{group}` as {bytes} bytes; the module has it as {expected:?}")]
    WrongGroup { segment: String, group: String, bytes: u64, expected: Option<u64> },
    /// A prefetch for a segment that does not need the group or is not later.
    #[error("segment `{segment}` prefetches `{group}` for segment {for_segment}, which does not need it later")]
    StrayPrefetch { segment: String, group: String, for_segment: usize },
    /// A segment computing without one of its groups.
    #[error("segment `{segment}` computes without `{group}` resident")]
    NotResident { segment: String, group: String },
    /// A segment computing with a smaller workspace than it needs.
    #[error("segment `{segment}` computes with a {have}-byte workspace; it needs {need}")]
    WorkspaceTooSmall { segment: String, have: u64, need: u64 },
    /// A segment computing without its cut buffers allocated.
    #[error("segment `{segment}` computes with {have} bytes of cut buffers; it needs {need}")]
    CutsMissing { segment: String, have: u64, need: u64 },
    /// More cut buffers released than allocated, or some left at the end.
    #[error("cut buffers unbalanced: {0}")]
    Cuts(String),
    /// The schedule does not compute each base segment exactly once, in order.
    #[error("schedule coverage: {0}")]
    Coverage(String),
}

/// A simulation failed: planning or a replayed action.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// The planner refused.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The schedule broke a rule.
    #[error(transparent)]
    Violation(#[from] Violation),
}

/// One simulated device shared by several runners.
#[derive(Clone, Debug)]
pub struct Simulator {
    template: DeviceState,
    free: Option<u64>,
    /// Managed bytes no runner here can reclaim (the initial `fixed` and `workspace`).
    fixed: u64,
    replicas: Vec<Replica>,
    workspaces: Vec<(String, u64)>,
    cuts: u64,
    managed: u64,
    high_water: u64,
}

impl Simulator {
    /// A device in state `device`; its `workspace` is counted as fixed until
    /// [`Simulator::with_workspace_owner`] names the runner it belongs to.
    pub fn new(device: DeviceState) -> Self {
        let fixed = device.fixed.saturating_add(device.workspace);
        let managed = device.managed();
        Self {
            free: device.free,
            fixed,
            replicas: device.replicas.clone(),
            workspaces: Vec::new(),
            cuts: 0,
            managed,
            high_water: managed,
            template: device,
        }
    }

    /// The initial `workspace` of the device state is runner `module`'s reusable compute buffer.
    pub fn with_workspace_owner(mut self, module: &str) -> Self {
        let ws = self.template.workspace;
        self.fixed = self.fixed.saturating_sub(ws);
        self.workspaces.retain(|(m, _)| m != module);
        self.workspaces.push((module.to_string(), ws));
        self
    }

    /// The device as runner `module` sees it now.
    pub fn state_for(&self, module: &str) -> DeviceState {
        let mut s = self.template.clone();
        s.free = self.free;
        s.replicas = self.replicas.clone();
        s.workspace = self.workspace_of(module);
        s.fixed = self
            .workspaces
            .iter()
            .filter(|(m, _)| m != module)
            .fold(self.fixed.saturating_add(self.cuts), |acc, (_, b)| acc.saturating_add(*b));
        s
    }

    /// Highest managed bytes so far.
    pub fn high_water(&self) -> u64 {
        self.high_water
    }

    /// Managed bytes now.
    pub fn managed(&self) -> u64 {
        self.managed
    }

    /// Replicas on the device now, in eviction-preference order.
    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    /// Another process takes `bytes` of device memory (not managed): live free memory drops.
    pub fn take_free(&mut self, bytes: u64) {
        self.free = self.free.map(|f| f.saturating_sub(bytes));
    }

    /// Plans a run of `module` on the current state and replays it.
    pub fn run(
        &mut self,
        module: &ModuleGraph,
        opts: &Options,
        ws: &mut dyn MergedWorkspace,
    ) -> Result<(Schedule, RunReport), SimError> {
        let schedule = plan(module, &self.state_for(&module.name), opts, ws)?;
        let report = self.replay(module, &schedule, ws)?;
        Ok((schedule, report))
    }

    fn workspace_of(&self, module: &str) -> u64 {
        self.workspaces.iter().find(|(m, _)| m == module).map_or(0, |(_, b)| *b)
    }

    fn release(&mut self, bytes: u64) {
        self.managed = self.managed.saturating_sub(bytes);
        self.free = self.free.map(|f| f.saturating_add(bytes));
    }

    /// Allocates `bytes`; a zero-byte allocation allocates nothing and always succeeds.
    fn alloc(&mut self, bytes: u64, action: impl Fn() -> String) -> Result<(), Violation> {
        if bytes == 0 {
            return Ok(());
        }
        if let Some(free) = self.free {
            if free < bytes.saturating_add(self.template.scratch_reserve) {
                return Err(Violation::IntoReserve {
                    device: self.template.name.clone(),
                    action: action(),
                    bytes,
                    free,
                    reserve: self.template.scratch_reserve,
                });
            }
            self.free = Some(free - bytes);
        }
        self.managed = self.managed.saturating_add(bytes);
        if let Some(budget) = self.template.budget {
            if self.managed > budget {
                return Err(Violation::OverBudget {
                    device: self.template.name.clone(),
                    action: action(),
                    managed: self.managed,
                    budget,
                });
            }
        }
        self.high_water = self.high_water.max(self.managed);
        Ok(())
    }

    /// Replays `schedule` of `module`, checking every action; the device keeps the result.
    pub fn replay(
        &mut self,
        module: &ModuleGraph,
        schedule: &Schedule,
        ws: &mut dyn MergedWorkspace,
    ) -> Result<RunReport, Violation> {
        let segs = &module.segments;
        let n = segs.len();
        let mut sizes: HashMap<&str, u64> = HashMap::new();
        for s in segs {
            for g in &s.groups {
                sizes.insert(g.name.as_str(), g.bytes);
            }
        }
        // Coverage: consecutive ranges over 0..n.
        let mut next = 0;
        for p in &schedule.segments {
            if p.base.start != next || p.base.end <= p.base.start {
                return Err(Violation::Coverage(format!(
                    "segment `{}` covers {:?}, expected to start at {next}",
                    p.name, p.base
                )));
            }
            next = p.base.end;
        }
        if next != n {
            return Err(Violation::Coverage(format!("the schedule ends at {next}, the module has {n} segments")));
        }
        let needs = |p: usize| -> HashSet<&str> {
            segs[schedule.segments[p].base.clone()]
                .iter()
                .flat_map(|s| s.groups.iter().map(|g| g.name.as_str()))
                .collect()
        };

        let mut report = RunReport { mode: Some(schedule.mode), high_water: self.managed, ..RunReport::default() };
        let mut inflight: HashMap<String, usize> = HashMap::new();
        let mut own_ws = self.workspace_of(&module.name);
        let start_hw = self.high_water;
        self.high_water = self.managed;
        let result = (|| -> Result<(), Violation> {
            for (p, planned) in schedule.segments.iter().enumerate() {
                let name = planned.name.clone();
                let needed = needs(p);
                let mut computed = 0;
                for action in &planned.actions {
                    match action {
                        Action::Evict { group, bytes } => {
                            let Some(pos) = self.replicas.iter().position(|r| &r.group == group) else {
                                return Err(Violation::EvictAbsent { segment: name, group: group.clone() });
                            };
                            let r = &self.replicas[pos];
                            if r.pinned || needed.contains(group.as_str()) || inflight.contains_key(group) {
                                return Err(Violation::EvictPinned { segment: name, group: group.clone() });
                            }
                            if r.bytes != *bytes {
                                return Err(Violation::WrongGroup {
                                    segment: name,
                                    group: group.clone(),
                                    bytes: *bytes,
                                    expected: Some(r.bytes),
                                });
                            }
                            self.replicas.remove(pos);
                            self.release(*bytes);
                            report.evicted.push(group.clone());
                            report.evicted_bytes += bytes;
                        }
                        Action::Workspace { bytes } => {
                            self.release(own_ws);
                            own_ws = 0;
                            self.alloc(*bytes, || format!("the workspace of `{name}` ({bytes} bytes)"))?;
                            own_ws = *bytes;
                        }
                        Action::Load { group, bytes } | Action::Prefetch { group, bytes, .. } => {
                            if sizes.get(group.as_str()) != Some(bytes) {
                                return Err(Violation::WrongGroup {
                                    segment: name,
                                    group: group.clone(),
                                    bytes: *bytes,
                                    expected: sizes.get(group.as_str()).copied(),
                                });
                            }
                            if self.replicas.iter().any(|r| &r.group == group) {
                                return Err(Violation::AlreadyResident { segment: name, group: group.clone() });
                            }
                            if let Action::Prefetch { for_segment, .. } = action {
                                if *for_segment <= p
                                    || *for_segment >= schedule.segments.len()
                                    || !needs(*for_segment).contains(group.as_str())
                                {
                                    return Err(Violation::StrayPrefetch {
                                        segment: name,
                                        group: group.clone(),
                                        for_segment: *for_segment,
                                    });
                                }
                                inflight.insert(group.clone(), *for_segment);
                                report.prefetched.push(group.clone());
                                report.prefetched_bytes += bytes;
                            } else {
                                report.loaded.push(group.clone());
                                report.loaded_bytes += bytes;
                            }
                            self.alloc(*bytes, || format!("`{name}` copying `{group}` ({bytes} bytes)"))?;
                            self.replicas.push(Replica { group: group.clone(), bytes: *bytes, pinned: false });
                        }
                        Action::AllocCut { bytes } => {
                            self.alloc(*bytes, || format!("the cut buffers of `{name}` ({bytes} bytes)"))?;
                            self.cuts += bytes;
                        }
                        Action::ReleaseCut { bytes } => {
                            if *bytes > self.cuts {
                                return Err(Violation::Cuts(format!("`{name}` releases {bytes} of {}", self.cuts)));
                            }
                            self.cuts -= bytes;
                            self.release(*bytes);
                        }
                        Action::Compute => {
                            computed += 1;
                            for g in &needed {
                                if !self.replicas.iter().any(|r| r.group == *g) {
                                    return Err(Violation::NotResident { segment: name, group: g.to_string() });
                                }
                            }
                            let range = planned.base.clone();
                            let need_ws = if range.len() == 1 {
                                segs[range.start].workspace
                            } else {
                                ws.merged(segs, range.clone())
                            };
                            if own_ws < need_ws {
                                return Err(Violation::WorkspaceTooSmall {
                                    segment: name,
                                    have: own_ws,
                                    need: need_ws,
                                });
                            }
                            // Cut buffers live now: written before this segment and read by it or
                            // later, plus those it writes for after it.
                            let need_cuts: u64 = segs
                                .iter()
                                .enumerate()
                                .flat_map(|(i, s)| s.cut_outputs.iter().map(move |c| (i, c)))
                                .filter(|(i, c)| {
                                    (*i < range.start && c.last_reader >= range.start)
                                        || (range.contains(i) && c.last_reader >= range.end)
                                })
                                .map(|(_, c)| c.bytes)
                                .sum();
                            if self.cuts < need_cuts {
                                return Err(Violation::CutsMissing { segment: name, have: self.cuts, need: need_cuts });
                            }
                            report.computed.push(name.clone());
                        }
                    }
                }
                if computed != 1 {
                    return Err(Violation::Coverage(format!("segment `{name}` computes {computed} times")));
                }
                inflight.retain(|_, t| *t != p);
            }
            if self.cuts != 0 {
                return Err(Violation::Cuts(format!("{} bytes still held after the run", self.cuts)));
            }
            Ok(())
        })();
        // Record the workspace even when a check failed, so the ledger stays consistent.
        self.workspaces.retain(|(m, _)| m != &module.name);
        self.workspaces.push((module.name.clone(), own_ws));
        report.high_water = self.high_water;
        self.high_water = self.high_water.max(start_hw);
        result.map(|()| report)
    }
}
