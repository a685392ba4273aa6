//! Layer split: one module's graph run stage by stage on the devices that hold its blocks.
//!
//! A split module's weights are placed with [`Weights::place_split`]: every group (one block's
//! parameters) belongs to one computing device, the non-block groups to the main one. The
//! runner cuts the graph at the module's cuts as a single-device run does (base segment *k* is
//! what cut *k* added), gives each segment the device of the groups it reads (a segment that
//! reads none stays on the device before it), and merges consecutive segments of one device
//! into a *stage*. For the UNet the stages are: the main device (time embedding, the first
//! input blocks), the next device's range, ..., and the main device again for the output head.
//!
//! Activations crossing a stage boundary: every tensor computed in one segment and read in a
//! later one (block outputs, the time embedding, and the UNet's skip connections from input
//! blocks to output blocks, which may skip several stages), and every graph input, is a *bound*
//! tensor with a slot in the cut buffer of each device that produces or reads it. It has one
//! ggml struct, so it points at one slot at a time: before a stage on device *d* reads it, the
//! runner re-points it at *d*'s slot, copying the bytes from where it was computed unless *d*
//! already holds them (a bound tensor is written once per run, so a copy stays valid). Only
//! what a stage reads is copied, once per device; views of a moved tensor made in an earlier
//! stage are re-made by the allocator.
//!
//! Weights: groups not resident on their device (parameters in RAM, on another device or on
//! disk) are loaded before their stage; with a disk home they are freed right after it
//! (released per stage, never kept), otherwise they stay until an allocation on the device needs the room,
//! when its ledger evicts replicas the time slot's stages do not read (this module's other
//! groups, or another module's), least recently used first. Segment planning and
//! prefetch are off for a split module (stable-diffusion.cpp's `docs/backend.md`): each
//! device's stage runs whole, in a compute buffer of that device charged to its ledger.

use std::collections::HashSet;
use std::ops::Range;
use std::time::Instant;

use sd_backends::{Context, Graph, Tensor};

use crate::error::{Result, SchedError};
use crate::report::StageReport;
use crate::runner::{analyse, slot, Analysis, Dev, RunStats, Runner};
use crate::weights::{GroupId, Weights};

/// Consecutive base segments on one device.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Stage {
    /// Index of the device in the runner's (and the weights') device list.
    pub device: usize,
    /// Base segments.
    pub segments: Range<usize>,
}

/// The stages of a split run: each segment on the device of the groups it reads, merged.
pub(crate) fn stages(
    module: &str,
    names: &[String],
    seg_names: &[String],
    groups_of_seg: &[Vec<usize>],
) -> Result<Vec<Stage>> {
    let mut out: Vec<Stage> = Vec::new();
    let mut prev = 0usize;
    for (s, devices) in groups_of_seg.iter().enumerate() {
        let mut dev = None;
        for &d in devices {
            match dev {
                None => dev = Some(d),
                Some(x) if x != d => {
                    return Err(SchedError::Invalid(format!(
                        "{module}: segment `{}` reads weights on {} and on {}; a layer split needs a graph cut \
                         between their blocks",
                        seg_names[s], names[x], names[d]
                    )))
                }
                Some(_) => {}
            }
        }
        let d = dev.unwrap_or(prev);
        prev = d;
        match out.last_mut() {
            Some(st) if st.device == d => st.segments.end = s + 1,
            _ => out.push(Stage { device: d, segments: s..s + 1 }),
        }
    }
    Ok(out)
}

/// One graph of a split run: a micro-batch when a batch is pipelined ([`Runner::run_batches`]).
#[derive(Clone, Debug)]
pub struct BatchJob<'g> {
    /// The context the graph was built in.
    pub ctx: &'g Context,
    /// Room for this many nodes.
    pub graph_size: usize,
    /// Block outputs in execution order, with names ([`Runner::run`]'s cuts).
    pub cuts: Vec<(String, Tensor<'g>)>,
    /// The output; readable after the run until the runner runs again.
    pub out: Tensor<'g>,
}

/// Where each bound tensor is, during a split run.
struct Bound {
    /// The device whose slot it points at now.
    at: usize,
    /// The devices holding its current bytes.
    valid: Vec<bool>,
    /// Its slot offset in each device's cut buffer of its job (`None`: no slot there).
    slot: Vec<Option<usize>>,
}

/// One job's graph and its analysis, during a split run.
struct JobRun<'g> {
    graph: Graph<'g>,
    a: Analysis<'g>,
    stages: Vec<Stage>,
    reads: Vec<Vec<usize>>,
    bound: Vec<Bound>,
    /// The job's cut buffer on each device (an index into that device's `cut_buffers`).
    bufs: Vec<Option<usize>>,
}

/// A value moved to a device's compute thread. Sound where it is built: every thread gets
/// one device's state and graphs no other thread touches (see `compute_items`).
struct OnThread<T>(T);

// SAFETY: only built in `compute_items`, whose comment states the exclusivity argument.
unsafe impl<T> Send for OnThread<T> {}

impl Runner {
    /// Sets how many micro-batches a split run may overlap across its devices
    /// (`--pipeline-copies`; at least 1). Each one keeps its own copy of the activations that
    /// cross devices (its own cut buffers); the devices' compute buffers are shared.
    pub fn set_pipeline_copies(&mut self, copies: usize) {
        self.copies = copies.max(1);
    }

    /// How many micro-batches a batch of `batch` samples should be split into for this
    /// runner: the pipeline copies, at most `batch`, for a split runner; 1 otherwise.
    pub fn micro_batches(&self, batch: usize) -> usize {
        if self.devs.len() > 1 && self.row.is_none() {
            self.copies.min(batch).max(1)
        } else {
            1
        }
    }

    /// Runs the graphs of `jobs` (micro-batches of one evaluation, built alike) over this
    /// runner's split devices: with several jobs, device *k* computes stage *k* of job *i*
    /// while device *k+1* computes stage *k+1* of job *i-1* (module docs). `set_inputs` is
    /// called once every job's inputs have storage. Every job's output can be read afterwards,
    /// until this runner runs again or is dropped.
    pub fn run_batches<'g>(
        &mut self,
        w: &Weights,
        jobs: &[BatchJob<'g>],
        set_inputs: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        for d in &mut self.devs {
            d.release_cut_buffer();
        }
        let names: Vec<String> = self.devs.iter().map(|d| d.backend.device().name()).collect();
        if w.device_names() != names {
            return Err(SchedError::Invalid(format!(
                "{}: the weights are placed on [{}] but the runner computes on [{}]",
                self.name,
                w.device_names().join(", "),
                names.join(", ")
            )));
        }
        if jobs.is_empty() {
            return Ok(());
        }
        let mut runs = Vec::with_capacity(jobs.len());
        for job in jobs {
            let graph = job.ctx.new_graph(job.graph_size);
            let segments = crate::runner::expand(&graph, &job.cuts, job.out);
            let mut a = analyse(w, &graph, segments, self.devs[0].buft);
            keep_output(&mut a, job.out);
            let seg_names: Vec<String> = a.segments.iter().map(|(n, _)| n.clone()).collect();
            let devs_of_seg: Vec<Vec<usize>> =
                a.groups_of_seg.iter().map(|gs| gs.iter().map(|g| w.device_of_group(*g)).collect()).collect();
            let stages = stages(&self.name, &names, &seg_names, &devs_of_seg)?;
            let reads = stage_reads(&graph, &a, &stages);
            runs.push(JobRun { graph, a, stages, reads, bound: Vec::new(), bufs: Vec::new() });
        }
        let pattern: Vec<usize> = runs[0].stages.iter().map(|s| s.device).collect();
        if runs.iter().any(|r| r.stages.iter().map(|s| s.device).collect::<Vec<_>>() != pattern) {
            return Err(SchedError::Invalid(format!("{}: the micro-batches' graphs are not alike", self.name)));
        }
        self.stages = runs[0]
            .stages
            .iter()
            .map(|st| StageReport {
                device: names[st.device].clone(),
                segments: runs[0].a.segments[st.segments.clone()].iter().map(|(n, _)| n.clone()).collect(),
            })
            .collect();
        for r in &mut runs {
            self.bind(r)?;
        }
        set_inputs()?;
        let n_stages = pattern.len();
        let m = runs.len();
        if m > 1 && !self.logged_pipeline {
            tracing::debug!("{}: pipeline parallelism enabled (n_copies={m})", self.name);
            self.logged_pipeline = true;
        }
        self.stats.runs += m;
        self.stats.segmented_runs += m;
        let t_run = Instant::now();
        let mut busy = 0.0f64;
        let mut loaded: Vec<Vec<GroupId>> = vec![Vec::new(); n_stages];
        let _holds = crate::runner::Holds(w);
        for t in 0..n_stages + m - 1 {
            // Stage k of job t - k, for every k that has one.
            let items: Vec<(usize, usize)> =
                (0..n_stages).filter_map(|k| t.checked_sub(k).filter(|&i| i < m).map(|i| (k, i))).collect();
            // The slot's stages hold their groups in the ledgers: an allocation on a device
            // evicts only its other replicas (module docs).
            let slot_groups: Vec<GroupId> = items
                .iter()
                .flat_map(|&(k, i)| runs[i].stages[k].segments.clone().map(move |s| (i, s)))
                .flat_map(|(i, s)| runs[i].a.groups_of_seg[s].iter().copied())
                .collect::<HashSet<GroupId>>()
                .into_iter()
                .collect();
            w.set_in_use(&slot_groups);
            for &(k, i) in &items {
                let d = pattern[k];
                self.move_inputs(&mut runs[i], k, d)?;
                let r = &runs[i];
                let segs = r.stages[k].segments.clone();
                let own: HashSet<GroupId> = segs.clone().flat_map(|s| r.a.groups_of_seg[s].iter().copied()).collect();
                for &gi in &own {
                    if !w.is_resident(gi) {
                        self.load(w, gi, w.group_bytes(gi))?;
                        loaded[k].push(gi);
                    }
                }
                let moved = earlier_views(&r.graph, &r.a, r.a.nodes_of(segs.clone()));
                for (s, t) in r.a.stale_views.iter().chain(moved.iter()) {
                    if segs.contains(s) {
                        // SAFETY: a view made in an earlier segment of storage that may have
                        // moved (a restaged weight, a bound tensor now on this device); the
                        // allocator re-makes it from its source.
                        unsafe { t.detach_storage() };
                    }
                }
            }
            busy += self.compute_items(&runs, &items, n_stages)?;
            for &(k, i) in &items {
                let r = &mut runs[i];
                let d = pattern[k];
                for (bi, t) in r.a.bound.iter().enumerate() {
                    if r.a.produced_in(*t).is_some_and(|p| r.stages[k].segments.contains(&p)) {
                        r.bound[bi].valid[d] = true;
                        // SAFETY: computed by this stage; later stages only read it.
                        unsafe { t.sever_operands() };
                    }
                }
                if i + 1 == m && w.is_disk_home() {
                    // Released once the stage's last micro-batch has run.
                    for gi in loaded[k].drain(..) {
                        if w.evict_group(gi) {
                            self.stats.evictions += 1;
                        }
                    }
                }
            }
        }
        self.stats.segments += n_stages * m;
        self.stats.max_segments = self.stats.max_segments.max(n_stages);
        if m > 1 {
            self.stats.pipelined_runs += 1;
            self.stats.pipeline_wall_secs += t_run.elapsed().as_secs_f64();
            self.stats.pipeline_busy_secs += busy;
        }
        Ok(())
    }

    /// Computes the work items `(stage, job)` of one time slot: each device's items in order
    /// on a thread of its own, the devices in parallel. Returns the devices' compute time,
    /// summed.
    fn compute_items(&mut self, runs: &[JobRun<'_>], items: &[(usize, usize)], n_stages: usize) -> Result<f64> {
        let name = self.name.clone();
        let mut per_dev: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.devs.len()];
        for &(k, i) in items {
            per_dev[runs[i].stages[k].device].push((k, i));
        }
        let work = |dev: &mut Dev, mine: &[(usize, usize)], stats: &mut RunStats| -> Result<f64> {
            let mut secs = 0.0;
            for &(k, i) in mine {
                let r = &runs[i];
                let view = r.graph.view(r.a.nodes_of(r.stages[k].segments.clone()));
                let vg = view.graph();
                let need = dev.alloc.measure(&vg) as u64;
                dev.alloc_measured(&name, &vg, need, n_stages, stats)?;
                let t0 = Instant::now();
                dev.backend.compute(&vg)?;
                secs += t0.elapsed().as_secs_f64();
            }
            Ok(secs)
        };
        let active = per_dev.iter().filter(|v| !v.is_empty()).count();
        let mut total = 0.0;
        if self.profile.is_some() {
            // Profiling: one device at a time, node by node.
            for (d, mine) in per_dev.iter().enumerate() {
                for &(k, i) in mine {
                    let r = &runs[i];
                    let nodes = r.a.nodes_of(r.stages[k].segments.clone());
                    self.naming = (r.a.segments.clone(), nodes.start);
                    let view = r.graph.view(nodes);
                    let vg = view.graph();
                    let need = self.devs[d].alloc.measure(&vg) as u64;
                    self.devs[d].alloc_measured(&name, &vg, need, n_stages, &mut self.stats)?;
                    let t0 = Instant::now();
                    self.exec(d, &vg)?;
                    total += t0.elapsed().as_secs_f64();
                }
            }
        } else if active <= 1 {
            for (d, mine) in per_dev.iter().enumerate().filter(|(_, v)| !v.is_empty()) {
                total += work(&mut self.devs[d], mine, &mut self.stats)?;
            }
        } else {
            // SAFETY (of every `OnThread` below): each thread gets one device's state (`&mut`
            // to a distinct element of `devs`), and the graphs of its items; the items of one
            // slot belong to distinct jobs (job = slot - stage), whose graphs, contexts and cut
            // buffers are disjoint, and a graph's views are made and allocated only by the
            // thread computing it. The weights the graphs read are neither staged nor evicted
            // while the threads run (that happens before and after this call), and each
            // backend serialises its own calls.
            let results: Vec<(Result<f64>, RunStats)> = std::thread::scope(|s| {
                let handles: Vec<_> = self
                    .devs
                    .iter_mut()
                    .zip(&per_dev)
                    .filter(|(_, mine)| !mine.is_empty())
                    .map(|(dev, mine)| {
                        let job = OnThread((dev, mine.as_slice(), &work));
                        s.spawn(move || {
                            let job = job;
                            let OnThread((dev, mine, work)) = job;
                            let mut stats = RunStats::default();
                            let r = work(dev, mine, &mut stats);
                            OnThread((r, stats))
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| match h.join() {
                        Ok(OnThread(v)) => v,
                        Err(_) => {
                            (Err(SchedError::Invalid("a device's compute thread panicked".into())), RunStats::default())
                        }
                    })
                    .collect()
            });
            for (r, st) in results {
                self.stats.peak_workspace = self.stats.peak_workspace.max(st.peak_workspace);
                total += r?;
            }
        }
        self.stats.compute_secs += total;
        Ok(total)
    }

    /// Allocates the job's cut buffer on each device (a slot for every bound tensor a stage
    /// on it produces or reads; graph inputs on the device of their first reader) and points
    /// every bound tensor at the slot on the device that writes it first.
    fn bind(&mut self, r: &mut JobRun<'_>) -> Result<()> {
        let (a, stages, reads) = (&r.a, &r.stages, &r.reads);
        let n_dev = self.devs.len();
        let stage_of_seg = |s: usize| stages.iter().position(|st| st.segments.contains(&s)).unwrap_or(0);
        let mut first_at = Vec::with_capacity(a.bound.len());
        let mut needs = vec![vec![false; n_dev]; a.bound.len()];
        for (i, t) in a.bound.iter().enumerate() {
            let first = match a.produced_in(*t) {
                Some(s) => stages[stage_of_seg(s)].device,
                None => reads.iter().position(|r| r.contains(&i)).map_or(0, |k| stages[k].device),
            };
            first_at.push(first);
            needs[i][first] = true;
        }
        for (k, rd) in reads.iter().enumerate() {
            for &i in rd {
                needs[i][stages[k].device] = true;
            }
        }
        let mut bound: Vec<Bound> = (0..a.bound.len())
            .map(|i| Bound { at: first_at[i], valid: vec![false; n_dev], slot: vec![None; n_dev] })
            .collect();
        let mut bufs = vec![None; n_dev];
        for (d, dev) in self.devs.iter_mut().enumerate() {
            let mut off = 0usize;
            for (i, t) in a.bound.iter().enumerate() {
                if needs[i][d] {
                    bound[i].slot[d] = Some(off);
                    off += slot(dev.buft, *t);
                }
            }
            if off > 0 {
                bufs[d] = Some(dev.alloc_cut_buffer(&self.name, off as u64)?);
            }
        }
        for (i, t) in a.bound.iter().enumerate() {
            let d = bound[i].at;
            if let (Some(off), Some(b)) = (bound[i].slot[d], bufs[d]) {
                if !t.is_allocated() {
                    // SAFETY: the cut buffer stays in `devs[d].cut_buffers` until the next
                    // run or the runner's drop, past every use this run makes of the tensor
                    // (`run`'s contract); slots are disjoint and inside it.
                    unsafe { t.place_in(&self.devs[d].cut_buffers[b].0, off)? };
                }
            }
            // Inputs are written by `set_inputs` where they point now; outputs where computed.
            bound[i].valid[d] = a.produced_in(*t).is_none();
        }
        r.bound = bound;
        r.bufs = bufs;
        Ok(())
    }

    /// Points the bound tensors stage `k` of job `r` reads at device `d`'s slots, copying the
    /// bytes of those it does not hold yet.
    fn move_inputs(&mut self, r: &mut JobRun<'_>, k: usize, d: usize) -> Result<()> {
        for &i in &r.reads[k] {
            let b = &mut r.bound[i];
            if b.at == d {
                continue;
            }
            let t = r.a.bound[i];
            let (Some(off), Some(at)) = (b.slot[d], r.bufs[d]) else {
                return Err(SchedError::Invalid(format!("{}: no slot for `{}` on device {d}", self.name, t.name())));
            };
            let bytes = if b.valid[d] { None } else { Some(t.read_range(0, t.nbytes())?) };
            // SAFETY: the tensor's bytes were read above (or are already in the new slot);
            // no graph holds the old storage any more (the stage reading it runs after this),
            // and the new slot lives in the cut buffer for the rest of the run (`bind`).
            unsafe {
                t.detach_storage();
                t.place_in(&self.devs[d].cut_buffers[at].0, off)?;
            }
            if let Some(bytes) = bytes {
                t.set_bytes(&bytes)?;
                self.stats.cross_device_bytes += bytes.len() as u64;
                self.stats.cross_device_copies += 1;
                b.valid[d] = true;
            }
            b.at = d;
        }
        Ok(())
    }
}

/// Makes the output a bound tensor of the last segment, so that it lives in a cut buffer
/// (outside the compute buffer the device reuses for its next stage or micro-batch).
fn keep_output<'g>(a: &mut Analysis<'g>, out: Tensor<'g>) {
    if a.produced_in(out).is_none() && !a.segments.is_empty() {
        a.producer.insert(out.as_raw() as usize, a.segments.len() - 1);
        a.bound.push(out);
    }
}

/// For each stage, the bound tensors (indices into `a.bound`) its nodes read.
fn stage_reads(graph: &Graph<'_>, a: &Analysis<'_>, stages: &[Stage]) -> Vec<Vec<usize>> {
    let index: std::collections::HashMap<usize, usize> =
        a.bound.iter().enumerate().map(|(i, t)| (t.as_raw() as usize, i)).collect();
    stages
        .iter()
        .map(|st| {
            let mut seen = HashSet::new();
            let mut out = Vec::new();
            for n in a.nodes_of(st.segments.clone()) {
                let node = graph.node(n);
                for j in 0..sd_backends::context::MAX_SRC {
                    if let Some(src) = node.src(j) {
                        if let Some(&i) = index.get(&(src.storage_root().as_raw() as usize)) {
                            if a.produced_in(a.bound[i]).is_none_or(|p| !st.segments.contains(&p)) && seen.insert(i) {
                                out.push(i);
                            }
                        }
                    }
                }
            }
            out
        })
        .collect()
}

/// Views read by the nodes `nodes` that were made outside them (in an earlier segment) of a
/// bound tensor, with the segment reading them (as `Analysis::stale_views` lists weights').
fn earlier_views<'g>(graph: &Graph<'g>, a: &Analysis<'g>, nodes: Range<usize>) -> Vec<(usize, Tensor<'g>)> {
    let bound: HashSet<usize> = a.bound.iter().map(|t| t.as_raw() as usize).collect();
    let inside: HashSet<usize> = nodes.clone().map(|i| graph.node(i).as_raw() as usize).collect();
    let mut out = Vec::new();
    for (s, (_, range)) in a.segments.iter().enumerate() {
        if range.start < nodes.start || range.end > nodes.end {
            continue;
        }
        for n in range.clone() {
            let node = graph.node(n);
            for j in 0..sd_backends::context::MAX_SRC {
                let Some(src) = node.src(j) else { continue };
                let root = src.storage_root();
                if src != root
                    && bound.contains(&(root.as_raw() as usize))
                    && !inside.contains(&(src.as_raw() as usize))
                {
                    out.push((s, src));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("dev{i}")).collect()
    }

    #[test]
    fn segments_merge_into_stages_by_the_device_of_their_weights() {
        let seg: Vec<String> = ["time", "b0", "b1", "b2", "mid", "head"].iter().map(|s| s.to_string()).collect();
        // b2 and mid on dev1; the head back on dev0; `mid` reads nothing and follows b2.
        let devs = vec![vec![0], vec![0], vec![0, 0], vec![1], vec![], vec![0]];
        let st = stages("unet", &names(2), &seg, &devs).unwrap();
        assert_eq!(
            st,
            vec![
                Stage { device: 0, segments: 0..3 },
                Stage { device: 1, segments: 3..5 },
                Stage { device: 0, segments: 5..6 }
            ]
        );
        let err = stages("unet", &names(2), &seg, &[vec![0], vec![0, 1]]).unwrap_err().to_string();
        assert!(err.contains("segment `b0` reads weights on dev0 and on dev1"), "{err}");
    }
}
