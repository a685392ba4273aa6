//! The planner: monolithic/segmented choice, merging, and the action list of every segment.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use super::error::{PlanError, Shortfall};
use super::model::{cuts_in, cuts_out, DeviceState, Facts, ModuleGraph, Options, Replica};
use super::schedule::{Action, Decision, Mode, PlannedSegment, Reason, Schedule, Transfer};
use super::workspace::MergedWorkspace;

/// Plans one graph run of `module` on `device`.
///
/// `workspace` gives the workspace of merged segment ranges (and of the whole graph, the
/// range over every segment); a single segment's workspace is its [`Segment::workspace`].
/// See the [module documentation](super) for the rules.
///
/// [`Segment::workspace`]: super::Segment::workspace
pub fn plan(
    module: &ModuleGraph,
    device: &DeviceState,
    opts: &Options,
    workspace: &mut dyn MergedWorkspace,
) -> Result<Schedule, PlanError> {
    let facts = Facts::new(module, device)?;
    let workspace = &mut Memo { inner: workspace, seen: HashMap::new() };
    let n = module.segments.len();
    let full_ws = if n == 1 { module.segments[0].workspace } else { workspace.merged(&module.segments, 0..n) };

    // Capacity: what this runner could hold at once after reclaiming every unpinned replica
    // and its own idle workspace.
    let (mut evictable, mut pinned) = (0u64, 0u64);
    for r in &device.replicas {
        if r.pinned {
            pinned = pinned.saturating_add(r.bytes);
        } else {
            evictable = evictable.saturating_add(r.bytes);
        }
    }
    let cap_free = device
        .free
        .map(|f| f.saturating_add(device.workspace).saturating_add(evictable).saturating_sub(device.scratch_reserve));
    let cap_budget = device.budget.map(|b| b.saturating_sub(device.fixed.saturating_add(pinned)));
    let capacity = min_opt(cap_free, cap_budget);

    // The monolithic/segmented choice, in performance.md's terms.
    let graph_groups: HashSet<&str> = facts.all_groups.iter().map(String::as_str).collect();
    let resident: HashSet<&str> = device.replicas.iter().map(|r| r.group.as_str()).collect();
    let missing_weights = facts
        .all_groups
        .iter()
        .filter(|g| !resident.contains(g.as_str()))
        .map(|g| facts.bytes[g])
        .fold(0, u64::saturating_add);
    let new_workspace = full_ws.saturating_sub(device.workspace);
    let reclaimable = device
        .replicas
        .iter()
        .filter(|r| !r.pinned && !graph_groups.contains(r.group.as_str()))
        .map(|r| r.bytes)
        .fold(0, u64::saturating_add);
    let avail_free = device.free.map(|f| f.saturating_add(reclaimable).saturating_sub(device.scratch_reserve));
    let avail_budget = device.budget.map(|b| b.saturating_add(reclaimable).saturating_sub(device.managed()));
    let available = min_opt(avail_free, avail_budget);
    let need = missing_weights.saturating_add(new_workspace);
    let reason = match available {
        None => Reason::Unbounded,
        Some(a) if need.saturating_add(device.planning_headroom) <= a => Reason::Fits,
        Some(_) if n == 1 => Reason::NoCuts,
        Some(_) if opts.disable_segmented_compute => Reason::Disabled,
        Some(_) => Reason::ExceedsHeadroom,
    };
    let decision =
        Decision { reason, missing_weights, new_workspace, available, planning_headroom: device.planning_headroom };

    let ctx = Ctx::new(module, device, opts, &facts);
    let mut dev = DeviceModel::new(device);
    let segments = if reason == Reason::ExceedsHeadroom {
        let capacity = capacity.unwrap_or(u64::MAX);
        let ranges = ctx.merge(workspace, capacity)?;
        let segs = ctx.planned(workspace, &ranges);
        let mut planned = Vec::with_capacity(segs.len());
        let mut inflight = HashSet::new();
        for i in 0..segs.len() {
            let out = ctx.step(&segs, &mut dev, &mut inflight, i, true, capacity)?;
            planned.push(PlannedSegment {
                name: segs[i].name.clone(),
                base: segs[i].base.clone(),
                groups: segs[i].groups.clone(),
                workspace: segs[i].workspace,
                actions: out.actions,
                prefetch_skipped: out.prefetch_skipped,
                stays_resident: false,
            });
        }
        planned
    } else {
        if let Some(a) = available {
            if need > a {
                let hint = match reason {
                    Reason::Disabled => {
                        "segmented execution is disabled, so the whole graph runs at once; enable it to run in segments"
                    }
                    _ => {
                        "this graph has no cut markers, so it cannot run in segments; raise the device's budget, free \
                         device memory, or run the module on another device"
                    }
                };
                return Err(PlanError::DoesNotFit(Box::new(Shortfall {
                    device: device.name.clone(),
                    module: module.name.clone(),
                    what: "the whole graph".into(),
                    needed: need,
                    weights: missing_weights,
                    workspace: new_workspace,
                    cuts: 0,
                    available: a,
                    budget: device.budget,
                    free: device.free,
                    reserve: device.scratch_reserve,
                    hint,
                })));
            }
        }
        vec![ctx.monolithic(&mut dev, full_ws)]
    };

    let mut segments = segments;
    for s in &mut segments {
        s.stays_resident = s.groups.iter().all(|g| dev.is_resident(g));
    }
    let schedule = Schedule {
        module: module.name.clone(),
        device: device.name.clone(),
        mode: if reason == Reason::ExceedsHeadroom { Mode::Segmented } else { Mode::Monolithic },
        decision,
        capacity,
        base_segments: n,
        segments,
    };
    Ok(schedule)
}

fn min_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

/// The planner's model of the device during the run (the executor's account is
/// [`crate::Ledger`]).
#[derive(Clone, Debug)]
struct DeviceModel {
    budget: Option<u64>,
    reserve: u64,
    free: Option<u64>,
    managed: u64,
    /// Replicas in eviction-preference order for foreign groups.
    resident: Vec<Replica>,
    workspace: u64,
}

impl DeviceModel {
    fn new(device: &DeviceState) -> Self {
        Self {
            budget: device.budget,
            reserve: device.scratch_reserve,
            free: device.free,
            managed: device.managed(),
            resident: device.replicas.clone(),
            workspace: device.workspace,
        }
    }

    fn room(&self) -> u64 {
        let by_free = self.free.map_or(u64::MAX, |f| f.saturating_sub(self.reserve));
        let by_budget = self.budget.map_or(u64::MAX, |b| b.saturating_sub(self.managed));
        by_free.min(by_budget)
    }

    fn alloc(&mut self, bytes: u64) {
        self.managed = self.managed.saturating_add(bytes);
        self.free = self.free.map(|f| f.saturating_sub(bytes));
    }

    fn release(&mut self, bytes: u64) {
        self.managed = self.managed.saturating_sub(bytes);
        self.free = self.free.map(|f| f.saturating_add(bytes));
    }

    fn is_resident(&self, group: &str) -> bool {
        self.resident.iter().any(|r| r.group == group)
    }

    fn evict(&mut self, group: &str) -> u64 {
        let pos = self.resident.iter().position(|r| r.group == group).expect("evicting a resident replica");
        let bytes = self.resident.remove(pos).bytes;
        self.release(bytes);
        bytes
    }

    fn load(&mut self, group: &str, bytes: u64) {
        self.alloc(bytes);
        self.resident.push(Replica { group: group.to_string(), bytes, pinned: false });
    }

    fn set_workspace(&mut self, bytes: u64) {
        self.release(self.workspace);
        self.alloc(bytes);
        self.workspace = bytes;
    }
}

/// A segment of the schedule being built.
#[derive(Clone, Debug)]
struct Seg {
    name: String,
    base: Range<usize>,
    groups: Vec<String>,
    workspace: u64,
    /// Cut buffers it writes for later segments.
    cuts_out: u64,
    /// Cut buffers of earlier segments it reads last.
    cuts_release: u64,
}

struct StepOut {
    actions: Vec<Action>,
    prefetch_skipped: bool,
}

/// What stays fixed while one schedule is built.
struct Ctx<'a> {
    module: &'a ModuleGraph,
    device: &'a DeviceState,
    facts: &'a Facts,
    prefetch: Option<Transfer>,
    /// The graph's groups from the last segment backward: the eviction order.
    backward: Vec<String>,
}

impl<'a> Ctx<'a> {
    fn new(module: &'a ModuleGraph, device: &'a DeviceState, opts: &Options, facts: &'a Facts) -> Self {
        let mut seen = HashSet::new();
        let mut backward = Vec::new();
        for groups in facts.seg_groups.iter().rev() {
            for g in groups.iter().rev() {
                if seen.insert(g.as_str()) {
                    backward.push(g.clone());
                }
            }
        }
        let prefetch = (!opts.disable_prefetch).then_some(if device.async_transfer {
            Transfer::Async
        } else {
            Transfer::WorkerThread
        });
        Self { module, device, facts, prefetch, backward }
    }

    fn range_name(&self, range: &Range<usize>) -> String {
        let segs = &self.module.segments;
        if range.len() == 1 {
            segs[range.start].name.clone()
        } else {
            format!("{}..{}", segs[range.start].name, segs[range.end - 1].name)
        }
    }

    fn workspace_of(&self, ws: &mut dyn MergedWorkspace, range: Range<usize>) -> u64 {
        if range.len() == 1 {
            self.module.segments[range.start].workspace
        } else {
            ws.merged(&self.module.segments, range)
        }
    }

    /// (unpinned weights, workspace, cut buffers live while it runs) of base segments `range` merged.
    fn footprint(&self, ws: &mut dyn MergedWorkspace, range: Range<usize>) -> (u64, u64, u64) {
        let weights = self.facts.unpinned_bytes(&self.facts.groups_of(range.clone()));
        let workspace = self.workspace_of(ws, range.clone());
        let cuts = cuts_in(&self.module.segments, range.start).saturating_add(cuts_out(&self.module.segments, range));
        (weights, workspace, cuts)
    }

    fn does_not_fit(&self, range: Range<usize>, fp: (u64, u64, u64), capacity: u64) -> PlanError {
        let (weights, workspace, cuts) = fp;
        PlanError::DoesNotFit(Box::new(Shortfall {
            device: self.device.name.clone(),
            module: self.module.name.clone(),
            what: format!("segment `{}`", self.range_name(&range)),
            needed: weights.saturating_add(workspace).saturating_add(cuts),
            weights,
            workspace,
            cuts,
            available: capacity,
            budget: self.device.budget,
            free: self.device.free,
            reserve: self.device.scratch_reserve,
            hint: "every segment must fit on its own: raise the device's budget or free device memory, lower the \
                   resolution or batch size, or run the module on another device",
        }))
    }

    /// Checks that every base segment fits the capacity, then merges adjacent ones greedily
    /// while the merged segment fits the capacity less the planning headroom (and, with
    /// prefetch, next to a prefetch of its own weight).
    fn merge(&self, ws: &mut dyn MergedWorkspace, capacity: u64) -> Result<Vec<Range<usize>>, PlanError> {
        let n = self.module.segments.len();
        for i in 0..n {
            let fp = self.footprint(ws, i..i + 1);
            if fp.0.saturating_add(fp.1).saturating_add(fp.2) > capacity {
                return Err(self.does_not_fit(i..i + 1, fp, capacity));
            }
        }
        let limit = capacity.saturating_sub(self.device.planning_headroom);
        let mut ranges = Vec::new();
        let mut start = 0;
        while start < n {
            let mut end = start + 1;
            while end < n {
                let (w, s, c) = self.footprint(ws, start..end + 1);
                let neighbour = if self.prefetch.is_some() { w } else { 0 };
                if w.saturating_add(s).saturating_add(c).saturating_add(neighbour) <= limit {
                    end += 1;
                } else {
                    break;
                }
            }
            ranges.push(start..end);
            start = end;
        }
        Ok(ranges)
    }

    fn planned(&self, ws: &mut dyn MergedWorkspace, ranges: &[Range<usize>]) -> Vec<Seg> {
        let segs = &self.module.segments;
        let owner = |base: usize| ranges.iter().position(|r| r.contains(&base)).expect("ranges cover the list");
        let mut release = vec![0u64; ranges.len()];
        for r in ranges {
            for s in &segs[r.clone()] {
                for c in s.cut_outputs.iter().filter(|c| c.last_reader >= r.end) {
                    let q = owner(c.last_reader);
                    release[q] = release[q].saturating_add(c.bytes);
                }
            }
        }
        ranges
            .iter()
            .zip(release)
            .map(|(r, cuts_release)| Seg {
                name: self.range_name(r),
                base: r.clone(),
                groups: self.facts.groups_of(r.clone()),
                workspace: self.workspace_of(ws, r.clone()),
                cuts_out: cuts_out(segs, r.clone()),
                cuts_release,
            })
            .collect()
    }

    /// Unpinned replicas that may be evicted, in eviction order: replicas the graph does not
    /// use (device order), then the graph's from the last segment backward; `pins` excluded.
    fn candidates(&self, dev: &DeviceModel, pins: &HashSet<String>) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = dev
            .resident
            .iter()
            .filter(|r| !r.pinned && !self.facts.bytes.contains_key(&r.group))
            .map(|r| (r.group.clone(), r.bytes))
            .collect();
        for g in &self.backward {
            if pins.contains(g) || self.facts.device_pinned.contains(g) {
                continue;
            }
            if let Some(r) = dev.resident.iter().find(|r| r.group == *g).filter(|r| !r.pinned) {
                out.push((g.clone(), r.bytes));
            }
        }
        out
    }

    fn missing(&self, dev: &DeviceModel, groups: &[String]) -> Vec<(String, u64)> {
        groups.iter().filter(|g| !dev.is_resident(g)).map(|g| (g.clone(), self.facts.bytes[g])).collect()
    }

    /// Plans segment `i` on `dev`, updating it; prefetches for a later segment when
    /// `allow_prefetch` and it fits.
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        segs: &[Seg],
        dev: &mut DeviceModel,
        inflight: &mut HashSet<String>,
        i: usize,
        allow_prefetch: bool,
        capacity: u64,
    ) -> Result<StepOut, PlanError> {
        let seg = &segs[i];
        let mut actions = Vec::new();
        let mut pins: HashSet<String> = seg.groups.iter().cloned().collect();
        pins.extend(inflight.iter().cloned());
        let missing = self.missing(dev, &seg.groups);
        let missing_bytes = missing.iter().map(|(_, b)| *b).fold(0, u64::saturating_add);
        let need = |dev: &DeviceModel| {
            missing_bytes.saturating_add(seg.workspace.saturating_sub(dev.workspace)).saturating_add(seg.cuts_out)
        };

        // Reclaim: an oversized idle workspace first (released now, allocated at its size
        // below, after the evictions), then unpinned replicas in order.
        if need(dev) > dev.room() && dev.workspace > seg.workspace {
            actions.push(Action::Workspace { bytes: 0 });
            dev.set_workspace(0);
        }
        for (g, _) in self.candidates(dev, &pins) {
            if need(dev) <= dev.room() {
                break;
            }
            let bytes = dev.evict(&g);
            actions.push(Action::Evict { group: g, bytes });
        }
        if need(dev) > dev.room() {
            let w = self.facts.unpinned_bytes(&seg.groups);
            let c = cuts_in(&self.module.segments, seg.base.start).saturating_add(seg.cuts_out);
            return Err(self.does_not_fit(seg.base.clone(), (w, seg.workspace, c), capacity));
        }
        if seg.workspace > dev.workspace {
            actions.push(Action::Workspace { bytes: seg.workspace });
            dev.set_workspace(seg.workspace);
        }
        for (g, bytes) in missing {
            dev.load(&g, bytes);
            actions.push(Action::Load { group: g, bytes });
        }
        if seg.cuts_out > 0 {
            dev.alloc(seg.cuts_out);
            actions.push(Action::AllocCut { bytes: seg.cuts_out });
        }

        let mut prefetch_skipped = false;
        if let (true, Some(via)) = (allow_prefetch, self.prefetch) {
            if let Some(j) = (i + 1..segs.len()).find(|&j| !segs[j].groups.is_empty()) {
                let wanted = self.missing(dev, &segs[j].groups);
                if !wanted.is_empty() {
                    match self.try_prefetch(segs, dev, inflight, &pins, i, j, &wanted, via, capacity) {
                        Some((trial, trial_inflight, pf_actions)) => {
                            *dev = trial;
                            *inflight = trial_inflight;
                            actions.extend(pf_actions);
                        }
                        None => prefetch_skipped = true,
                    }
                }
            }
        }

        actions.push(Action::Compute);
        if seg.cuts_release > 0 {
            dev.release(seg.cuts_release);
            actions.push(Action::ReleaseCut { bytes: seg.cuts_release });
        }
        inflight.retain(|g| !seg.groups.contains(g));
        Ok(StepOut { actions, prefetch_skipped })
    }

    /// The state after prefetching `wanted` (segment `j`'s missing groups) during segment
    /// `i`, with its actions; `None` when it does not fit next to segment `i` or would leave
    /// a segment up to `j` without room.
    #[allow(clippy::too_many_arguments)]
    fn try_prefetch(
        &self,
        segs: &[Seg],
        dev: &DeviceModel,
        inflight: &HashSet<String>,
        pins: &HashSet<String>,
        i: usize,
        j: usize,
        wanted: &[(String, u64)],
        via: Transfer,
        capacity: u64,
    ) -> Option<(DeviceModel, HashSet<String>, Vec<Action>)> {
        let bytes_wanted = wanted.iter().map(|(_, b)| *b).fold(0, u64::saturating_add);
        let mut pins = pins.clone();
        pins.extend(segs[j].groups.iter().cloned());
        let candidates = self.candidates(dev, &pins);
        let evictable = candidates.iter().map(|(_, b)| *b).fold(0, u64::saturating_add);
        if dev.room().saturating_add(evictable) < bytes_wanted {
            return None;
        }
        let mut trial = dev.clone();
        let mut actions = Vec::new();
        for (g, _) in candidates {
            if bytes_wanted <= trial.room() {
                break;
            }
            let bytes = trial.evict(&g);
            actions.push(Action::Evict { group: g, bytes });
        }
        // The estimate above adds evictable bytes to the room, which overstates it when the
        // device starts above its budget (the room saturates at 0): check what is left.
        if trial.room() < bytes_wanted {
            return None;
        }
        let mut trial_inflight = inflight.clone();
        for (g, bytes) in wanted {
            trial.load(g, *bytes);
            trial_inflight.insert(g.clone());
            actions.push(Action::Prefetch { group: g.clone(), bytes: *bytes, for_segment: j, via });
        }
        // Every segment up to the target must still fit with the prefetched groups pinned.
        let mut check = trial.clone();
        let mut check_inflight = trial_inflight.clone();
        check.release(segs[i].cuts_release);
        check_inflight.retain(|g| !segs[i].groups.contains(g));
        for k in i + 1..=j {
            self.step(segs, &mut check, &mut check_inflight, k, false, capacity).ok()?;
        }
        Some((trial, trial_inflight, actions))
    }

    /// The single segment of a monolithic run: reclaim replicas the graph does not use (only
    /// as many as needed), grow the workspace, load the missing groups, compute.
    fn monolithic(&self, dev: &mut DeviceModel, full_ws: u64) -> PlannedSegment {
        let n = self.module.segments.len();
        let groups = self.facts.all_groups.clone();
        let missing = self.missing(dev, &groups);
        let missing_bytes = missing.iter().map(|(_, b)| *b).fold(0, u64::saturating_add);
        let need = missing_bytes.saturating_add(full_ws.saturating_sub(dev.workspace));
        let pins: HashSet<String> = groups.iter().cloned().collect();
        let mut actions = Vec::new();
        for (g, _) in self.candidates(dev, &pins) {
            if need <= dev.room() {
                break;
            }
            let bytes = dev.evict(&g);
            actions.push(Action::Evict { group: g, bytes });
        }
        if full_ws > dev.workspace {
            actions.push(Action::Workspace { bytes: full_ws });
            dev.set_workspace(full_ws);
        }
        for (g, bytes) in missing {
            dev.load(&g, bytes);
            actions.push(Action::Load { group: g, bytes });
        }
        actions.push(Action::Compute);
        PlannedSegment {
            name: self.range_name(&(0..n)),
            base: 0..n,
            groups,
            workspace: full_ws,
            actions,
            prefetch_skipped: false,
            stays_resident: true,
        }
    }
}

/// Memoises merged-workspace answers within one planning call (the executor measures graphs).
struct Memo<'a> {
    inner: &'a mut dyn MergedWorkspace,
    seen: HashMap<(usize, usize), u64>,
}

impl MergedWorkspace for Memo<'_> {
    fn merged(&mut self, segments: &[super::Segment], range: Range<usize>) -> u64 {
        let key = (range.start, range.end);
        if let Some(&b) = self.seen.get(&key) {
            return b;
        }
        let b = self.inner.merged(segments, range);
        self.seen.insert(key, b);
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segments::{ParamGroup, Segment};

    fn module(groups: &[&[&str]]) -> ModuleGraph {
        let segments = groups
            .iter()
            .enumerate()
            .map(|(i, gs)| {
                let gs = gs.iter().map(|g| ParamGroup::new(*g, 1)).collect();
                Segment::new(format!("s{i}"), gs, 0)
            })
            .collect();
        ModuleGraph { name: "m".into(), segments }
    }

    #[test]
    fn a_shared_group_ranks_at_its_last_use() {
        // "from the last segment backward": a group used by segments 1 and 3 is evicted with
        // segment 3's, before segment 2's.
        let m = module(&[&["a"], &["b", "shared"], &["c"], &["shared", "d"]]);
        let d = DeviceState::new("D", Some(10), None);
        let facts = Facts::new(&m, &d).unwrap();
        let ctx = Ctx::new(&m, &d, &Options::default(), &facts);
        assert_eq!(ctx.backward, ["d", "shared", "c", "b", "a"]);
    }

    #[test]
    fn candidates_put_foreign_replicas_first_and_skip_pins() {
        let m = module(&[&["a"], &["b"], &["c"]]);
        let mut d = DeviceState::new("D", Some(100), None);
        for (g, pinned) in [("a", false), ("x", false), ("c", true), ("b", false), ("y", true), ("z", false)] {
            d.replicas.push(crate::segments::Replica { group: g.into(), bytes: 1, pinned });
        }
        let facts = Facts::new(&m, &d).unwrap();
        let ctx = Ctx::new(&m, &d, &Options::default(), &facts);
        let dev = DeviceModel::new(&d);
        let pins: HashSet<String> = ["b".to_string()].into();
        let order: Vec<String> = ctx.candidates(&dev, &pins).into_iter().map(|(g, _)| g).collect();
        // Foreign x and z in device order; y is pinned; then c (pinned on the device: skipped),
        // b (pinned by the segment: skipped), a.
        assert_eq!(order, ["x", "z", "a"]);
    }

    #[test]
    fn room_is_the_tighter_limit() {
        let mut d = DeviceState::new("D", Some(1000), Some(2000));
        d.scratch_reserve = 100;
        d.fixed = 300;
        let mut l = DeviceModel::new(&d);
        // Budget: 1000 - 300 = 700; free: 2000 - 100 = 1900.
        assert_eq!(l.room(), 700);
        l.free = Some(500);
        assert_eq!(l.room(), 400);
        l.alloc(450);
        assert_eq!((l.room(), l.managed), (0, 750));
        l.release(450);
        assert_eq!(l.room(), 400);
        assert_eq!(DeviceModel::new(&DeviceState::new("CPU", None, None)).room(), u64::MAX);
    }
}
