//! A runner executes a module's graphs on one device: whole, or in segments with staging,
//! eviction and prefetch of the module's weight groups.
//!
//! Two ways in:
//! * [`Runner::alloc`] + [`Runner::compute`]: the graph runs whole; its weights must have
//!   storage ([`Weights::allocate`], or placed and pinned on the computing device).
//! * [`Runner::run`]: the module hands over its graph context, the cut tensors it marked at
//!   block boundaries (in execution order) and the output, and the runner takes three steps:
//!   1. *analyse* (the module graph): expand the graph cut by cut, so that base segment *k*
//!      is the nodes added by cut *k*; find, per segment, the weight groups it reads (as
//!      `GroupId`s) and the tensors crossing cuts;
//!   2. *plan*: measure every segment (and merged ranges on request) with ggml's
//!      measure-only allocator and ask the pure planner ([`crate::plan::plan`]) for a
//!      [`Schedule`] against the device's live state and its [`Ledger`];
//!   3. *replay*: translate the schedule into steps on this runner's groups (an action the
//!      runner cannot perform is refused before anything runs, never skipped), then perform
//!      them in order: evictions, compute-buffer charges, synchronous loads, prefetches on a
//!      worker thread that overlap the segment's compute, compute of a graph *view* of the
//!      segment's nodes. A prefetch allocated but not filled is evicted on any early return.
//!
//! What the runner offers the planner, and so what a schedule can ask of it: no per-segment
//! cut outputs (cut tensors and graph inputs live in one cut buffer on the device for the
//! whole run, allocated before the first segment and charged to the ledger; the planner
//! sees it as fixed managed memory, so it never plans `AllocCut`/`ReleaseCut`), and no
//! asynchronous transfer (prefetches are `Transfer::WorkerThread`). A segment's compute
//! buffer is ggml's graph allocator, reused across segments and runs (it grows to the
//! largest segment: "peak across N segments"); `Workspace` actions charge the ledger where
//! the plan puts them and the allocator allocates within that charge. An eviction of another
//! runner's replica goes through the device's [`Ledger`], which frees it unless that runner
//! is using it (then it stays, logged).
//!
//! Every device allocation is charged to the device's ledger before it is made, so the
//! managed bytes never exceed the budget. A charge that would exceed it first makes the
//! ledger evict idle replicas (this runner's or another's, least recently used first: the
//! cut buffer, for one, is charged before the first segment's planned evictions), and fails
//! with the device, the bytes and the budget only when that cannot make room. The replay
//! holds the groups the current segment reads and those being prefetched, so the ledger
//! never takes them, and stages again, before a segment computes, any group it reads that
//! was evicted since the plan was made: eviction changes where weights live, never results.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use sd_backends::{alloc, Backend, Buffer, BufferType, Context, Graph, GraphAllocator, Tensor};

use crate::error::{Result, SchedError};
use crate::ledger::Ledger;
use crate::plan::{
    self, Action, DeviceState, Mode, ModuleGraph, ParamGroup, PlannedSegment, Schedule, Segment, Transfer,
};
use crate::weights::{GroupId, Weights};

/// What a runner did, summed over its runs (serialised as is in a run report: byte counts
/// in bytes, times in seconds).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunStats {
    /// Graph runs.
    pub runs: usize,
    /// Runs executed in segments.
    pub segmented_runs: usize,
    /// Segments executed (a monolithic run counts one).
    pub segments: usize,
    /// Most segments in one run.
    pub max_segments: usize,
    /// Bytes loaded synchronously before a segment computed.
    pub loaded_bytes: u64,
    /// Bytes prefetched while a segment computed.
    pub prefetched_bytes: u64,
    /// Groups prefetched (prefetches issued).
    pub prefetched_groups: usize,
    /// Prefetched groups whose copy finished while a segment computed, so that the later
    /// segment reading them found them resident (prefetches used).
    pub prefetches_used: usize,
    /// Replicas evicted.
    pub evictions: usize,
    /// Wall time of graph computations.
    pub compute_secs: f64,
    /// Wall time blocked on synchronous loads.
    pub load_secs: f64,
    /// Wall time waiting for a prefetch after the segment's compute finished.
    pub prefetch_wait_secs: f64,
    /// Largest compute buffer.
    pub peak_workspace: u64,
    /// Bytes of activations copied between the devices of a layer split.
    #[serde(default)]
    pub cross_device_bytes: u64,
    /// Activation copies between the devices of a layer split.
    #[serde(default)]
    pub cross_device_copies: usize,
    /// Split runs whose micro-batches were overlapped across devices (`--pipeline-copies`).
    #[serde(default)]
    pub pipelined_runs: usize,
    /// Wall time of those runs.
    #[serde(default)]
    pub pipeline_wall_secs: f64,
    /// Compute time of every device during those runs, summed: divided by the wall time, the
    /// overlap achieved (1 = none; up to the number of devices).
    #[serde(default)]
    pub pipeline_busy_secs: f64,
}

/// Graph execution on one backend, or on several for a layer-split module (main first).
#[derive(Debug)]
pub struct Runner {
    pub(crate) name: String,
    /// The computing devices; `devs[0]` is the main one (the only one without a split).
    pub(crate) devs: Vec<Dev>,
    pub(crate) opts: plan::Options,
    pub(crate) stats: RunStats,
    /// The stages of the last split run.
    pub(crate) stages: Vec<crate::report::StageReport>,
    /// `--pipeline-copies`: micro-batches a split run may overlap across its devices.
    pub(crate) copies: usize,
    /// Whether the pipelining line was logged.
    pub(crate) logged_pipeline: bool,
    /// The profile, when profiling is on ([`Runner::set_profiling`]).
    pub(crate) profile: Option<crate::profile::Profile>,
    /// The current run's segment names and node ranges, and the graph node the graph being
    /// computed starts at (a segment's view starts inside the module graph): for profiles.
    pub(crate) naming: (Vec<(String, Range<usize>)>, usize),
    /// Row mode ([`Runner::set_row_split`]): the host CPU backend the scheduler ends with
    /// (`Some(None)`: the last device is the CPU); `None` outside row mode.
    pub(crate) row: Option<Option<Arc<Backend>>>,
    /// The scheduler of row mode, built on the first run.
    pub(crate) sched: Option<sd_backends::Scheduler>,
}

/// A runner's state on one computing device.
#[derive(Debug)]
pub(crate) struct Dev {
    pub(crate) backend: Arc<Backend>,
    pub(crate) buft: BufferType,
    pub(crate) alloc: GraphAllocator,
    pub(crate) ledger: Ledger,
    /// Bytes of the compute buffer charged to the ledger.
    pub(crate) charged: u64,
    pub(crate) last_logged: usize,
    /// The cut buffers of the last run (one; one per micro-batch of a pipelined split run),
    /// kept while its output may still be read.
    pub(crate) cut_buffers: Vec<(Buffer, u64)>,
}

impl Dev {
    fn new(backend: Arc<Backend>, ledger: Ledger) -> Self {
        let buft = backend.device().buffer_type();
        let alloc = GraphAllocator::new(buft);
        Dev { backend, buft, alloc, ledger, charged: 0, last_logged: 0, cut_buffers: Vec::new() }
    }

    /// Charges and allocates the compute buffer of `module` for `graph` (measured: `need`
    /// bytes; one of `segments` segments or stages).
    pub(crate) fn alloc_measured(
        &mut self,
        module: &str,
        graph: &Graph<'_>,
        need: u64,
        segments: usize,
        stats: &mut RunStats,
    ) -> Result<()> {
        // Logged when it changes for whole graphs, when the peak grows for segments.
        if (segments == 1 && need as usize != self.last_logged) || (segments > 1 && need as usize > self.last_logged) {
            tracing::debug!(
                "{module} compute buffer size: {:.2} MB on {} (peak across {segments} segment{})",
                need as f64 / (1024.0 * 1024.0),
                self.backend.device().name(),
                if segments == 1 { "" } else { "s" }
            );
            self.last_logged = need as usize;
        }
        // The allocator grows its buffer to the largest graph it has seen.
        let target = need.max(self.alloc.buffer_size() as u64);
        if target > self.charged {
            self.ledger.charge(target - self.charged, &format!("the {module} compute buffer"))?;
            self.charged = target;
        }
        // SAFETY: the graph's tensors are used only until this runner allocates the next
        // graph or is dropped (the contract of `run` and `alloc`).
        unsafe { self.alloc.alloc_graph(graph) }.map_err(|_| SchedError::Alloc {
            device: self.backend.device().name(),
            bytes: need as usize,
            what: format!("the {module} compute buffer"),
        })?;
        let actual = self.alloc.buffer_size() as u64;
        if actual > self.charged {
            self.ledger.charge(actual - self.charged, &format!("the {module} compute buffer"))?;
            self.charged = actual;
        }
        stats.peak_workspace = stats.peak_workspace.max(actual);
        Ok(())
    }

    fn release_workspace(&mut self) {
        self.alloc = GraphAllocator::new(self.buft);
        self.ledger.credit(self.charged);
        self.charged = 0;
    }

    pub(crate) fn release_cut_buffer(&mut self) {
        for (buf, bytes) in self.cut_buffers.drain(..) {
            drop(buf);
            self.ledger.credit(bytes);
        }
    }

    /// Charges and allocates a cut buffer of `bytes` (kept until the next run); its index in
    /// `cut_buffers`.
    pub(crate) fn alloc_cut_buffer(&mut self, module: &str, bytes: u64) -> Result<usize> {
        self.ledger.charge(bytes, &format!("the {module} cut buffers"))?;
        let buf = match self.buft.alloc(bytes.max(1) as usize) {
            Ok(b) => b,
            Err(_) => {
                self.ledger.credit(bytes);
                return Err(SchedError::Alloc {
                    device: self.backend.device().name(),
                    bytes: bytes as usize,
                    what: format!("the {module} cut buffers"),
                });
            }
        };
        self.cut_buffers.push((buf, bytes));
        Ok(self.cut_buffers.len() - 1)
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        self.release_cut_buffer();
        self.ledger.credit(self.charged);
    }
}

impl Runner {
    /// A runner named `name` (for logs) on `backend`, with an account of its own and no budget.
    pub fn new(name: impl Into<String>, backend: Arc<Backend>) -> Self {
        let ledger = Ledger::new(backend.device().name(), None);
        Self::with_ledger(name, backend, ledger, plan::Options::default())
    }

    /// A runner charging the device's shared `ledger`, with the segmented-execution flags.
    pub fn with_ledger(name: impl Into<String>, backend: Arc<Backend>, ledger: Ledger, opts: plan::Options) -> Self {
        Self::with_devices(name, vec![(backend, ledger)], opts)
    }

    /// A runner for a module split over `devices` (main first, each with its device's shared
    /// ledger), whose weights were placed with [`Weights::place_split`] on the same devices in
    /// the same order. With one device it is [`with_ledger`](Self::with_ledger).
    pub fn with_devices(name: impl Into<String>, devices: Vec<(Arc<Backend>, Ledger)>, opts: plan::Options) -> Self {
        let devs = devices.into_iter().map(|(b, l)| Dev::new(b, l)).collect();
        Self {
            name: name.into(),
            devs,
            opts,
            stats: RunStats::default(),
            stages: Vec::new(),
            copies: 1,
            logged_pipeline: false,
            profile: None,
            naming: (Vec::new(), 0),
            row: None,
            sched: None,
        }
    }

    /// The name it was given (for logs and reports).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The backend (the main one of a split).
    pub fn backend(&self) -> &Arc<Backend> {
        &self.devs[0].backend
    }

    /// Every computing device's backend, main first.
    pub fn backends(&self) -> Vec<Arc<Backend>> {
        self.devs.iter().map(|d| d.backend.clone()).collect()
    }

    /// The stages of its last layer-split run (device and segments, in execution order).
    pub fn last_stages(&self) -> &[crate::report::StageReport] {
        &self.stages
    }

    /// What the runner did so far.
    pub fn stats(&self) -> &RunStats {
        &self.stats
    }

    /// The ledger it charges (the main device's).
    pub fn ledger(&self) -> &Ledger {
        &self.devs[0].ledger
    }

    /// Measures and allocates the compute buffer for `graph`. Its tensors' data stays valid
    /// until this runner allocates another graph or is dropped.
    pub fn alloc(&mut self, graph: &Graph<'_>) -> Result<()> {
        self.stats.runs += 1;
        self.stats.segments += 1;
        self.stats.max_segments = self.stats.max_segments.max(1);
        let need = self.devs[0].alloc.measure(graph);
        self.alloc_measured(graph, need as u64, 1)
    }

    fn alloc_measured(&mut self, graph: &Graph<'_>, need: u64, segments: usize) -> Result<()> {
        self.devs[0].alloc_measured(&self.name, graph, need, segments, &mut self.stats)
    }

    fn release_workspace(&mut self) {
        self.devs[0].release_workspace();
    }

    /// Runs an allocated graph.
    pub fn compute(&mut self, graph: &Graph<'_>) -> Result<()> {
        let _span = tracing::trace_span!("compute", module = %self.name).entered();
        let t0 = Instant::now();
        self.exec(0, graph)?;
        self.stats.compute_secs += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Profiles every graph this runner computes from now on (`false`: stops and drops the
    /// profile): node by node, by op and by block ([`crate::profile`]). Prefetches are then
    /// copied before the segment computes rather than during it, and a split's devices take
    /// their turns one at a time.
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(crate::profile::Profile::default);
    }

    /// The profile so far, when profiling is on.
    pub fn profile(&self) -> Option<&crate::profile::Profile> {
        self.profile.as_ref()
    }

    /// Computes `graph` on device `dev`: whole, or node by node into the profile.
    pub(crate) fn exec(&mut self, dev: usize, graph: &Graph<'_>) -> Result<()> {
        let Some(p) = self.profile.as_mut() else { return Ok(self.devs[dev].backend.compute(graph)?) };
        let (names, base) = &self.naming;
        let block_of = |i: usize| {
            names.iter().find(|(_, r)| r.contains(&(base + i))).map_or_else(|| "graph".to_string(), |(n, _)| n.clone())
        };
        p.compute(&self.devs[dev].backend, graph, &block_of)
    }

    /// Runs the graph of `out` built in `g` (room for `graph_size` nodes), whose weights are
    /// `w`, cut at `cuts` (block outputs in execution order, with names for logs), whole or
    /// in segments as the planner decides. `set_inputs` is called once the inputs have
    /// storage and before anything computes. `out` can be read afterwards, until this
    /// runner runs or allocates another graph, or is dropped.
    ///
    /// Three steps (module docs): `analyse` the module graph (segments, their weight groups,
    /// the tensors crossing cuts), `plan` it (measure, describe the device, ask the pure
    /// planner), `replay` exactly the schedule it returned.
    pub fn run<'g>(
        &mut self,
        w: &Weights,
        g: &'g Context,
        graph_size: usize,
        cuts: &[(String, Tensor<'g>)],
        out: Tensor<'g>,
        set_inputs: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        for d in &mut self.devs {
            d.release_cut_buffer();
        }
        if self.row.is_some() || w.is_row_split() {
            return self.run_rows(w, g, graph_size, out, set_inputs);
        }
        if self.devs.len() > 1 || w.device_names().len() > 1 {
            let job = crate::split::BatchJob { ctx: g, graph_size, cuts: cuts.to_vec(), out };
            return self.run_batches(w, std::slice::from_ref(&job), set_inputs);
        }
        let graph = g.new_graph(graph_size);
        let segments = expand(&graph, cuts, out);
        if self.profile.is_some() {
            self.naming = (segments.clone(), 0);
        }
        if w.is_pinned() {
            // Everything is on the device and stays there: one graph, as allocated.
            self.alloc(&graph)?;
            set_inputs()?;
            return self.compute(&graph);
        }
        self.stats.runs += 1;
        let a = analyse(w, &graph, segments, self.devs[0].buft);
        let schedule = self.plan(w, &graph, &a)?;
        let steps = resolve(&self.name, w, &schedule)?;
        self.replay(w, &graph, &a, &schedule, &steps, set_inputs)
    }

    /// Measures every segment (and merged ranges on request) with the weights and cut
    /// tensors that will live elsewhere marked as such, describes the device, and asks the
    /// pure planner for a schedule.
    fn plan(&self, w: &Weights, graph: &Graph<'_>, a: &Analysis<'_>) -> Result<Schedule> {
        let groups = w.groups();
        // Measure with every missing weight and every cut tensor marked as stored elsewhere.
        let mut marked: Vec<Tensor<'_>> = Vec::new();
        for (gi, ts) in &a.tensors_of_group {
            if !w.is_resident(*gi) {
                marked.extend(ts.iter().copied());
            }
        }
        marked.extend(a.bound.iter().copied().filter(|t| !t.is_allocated()));
        for t in &marked {
            // SAFETY: unmarked below before anything allocates or computes.
            unsafe { t.mark_stored_elsewhere() };
        }
        let buft = self.devs[0].buft;
        let measure_range = |r: Range<usize>| -> u64 {
            let view = graph.view(a.nodes_of(r));
            alloc::measure(buft, &view.graph()) as u64
        };
        let segments: Vec<Segment> = a
            .segments
            .iter()
            .enumerate()
            .map(|(s, (name, _))| {
                let gs = a.groups_of_seg[s]
                    .iter()
                    .map(|gi| ParamGroup::new(groups[gi.0].0.clone(), groups[gi.0].1))
                    .collect();
                Segment::new(name.clone(), gs, measure_range(s..s + 1))
            })
            .collect();
        let module = ModuleGraph { name: self.name.clone(), segments };
        let state = self.device_state(a.cut_bytes);
        let mut merged = |_: &[Segment], r: Range<usize>| measure_range(r);
        let schedule = plan::plan(&module, &state, &self.opts, &mut merged);
        for t in &marked {
            // SAFETY: removes the marker set above; the tensors had no storage before.
            unsafe { t.detach_storage() };
        }
        let schedule = schedule?;
        tracing::debug!("{schedule}");
        Ok(schedule)
    }

    /// Performs the schedule's steps in order. A prefetch allocated but not yet filled is
    /// undone (evicted) on any early return, so no group stays marked resident and unfilled.
    fn replay(
        &mut self,
        w: &Weights,
        graph: &Graph<'_>,
        a: &Analysis<'_>,
        schedule: &Schedule,
        steps: &[Vec<Step>],
        set_inputs: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let n_segments = schedule.segments.len();
        // A segment holds the groups it reads, and those prefetched for later, in the ledger
        // (never evicted for another allocation) from its first step; the others may be
        // evicted under pressure, and are staged again before a segment reading them
        // computes. Every hold is released when the run ends.
        let _holds = Holds(w);
        let mut prefetched: Vec<GroupId> = Vec::new();
        let mut inflight = InFlight { w, groups: Vec::new() };
        for (k, (seg, steps)) in schedule.segments.iter().zip(steps).enumerate() {
            let mut seen = HashSet::new();
            let reads: Vec<GroupId> = seg
                .base
                .clone()
                .filter_map(|b| a.groups_of_seg.get(b))
                .flatten()
                .copied()
                .filter(|g| seen.insert(*g))
                .collect();
            prefetched.retain(|g| !reads.contains(g));
            w.set_in_use(&[reads.as_slice(), &prefetched, &inflight.groups].concat());
            if k == 0 && schedule.mode == Mode::Segmented {
                self.stats.segmented_runs += 1;
                self.alloc_cut_buffer(a)?;
                set_inputs()?;
            }
            for step in steps {
                match *step {
                    Step::Evict(gi) => {
                        // Already gone when the ledger evicted it for an earlier allocation.
                        if w.evict_group(gi) {
                            self.stats.evictions += 1;
                        }
                    }
                    Step::EvictForeign(ref group) => {
                        if !self.devs[0].ledger.evict(group) {
                            tracing::debug!("{}: {group} is another runner's and in use; left resident", self.name);
                        }
                    }
                    Step::ReleaseWorkspace => self.release_workspace(),
                    Step::Workspace(bytes) => self.reserve_workspace(bytes)?,
                    Step::Load(gi, bytes) => self.load(w, gi, bytes)?,
                    Step::Prefetch(gi, bytes) => {
                        w.alloc_group(gi)?;
                        inflight.groups.push(gi);
                        prefetched.push(gi);
                        self.stats.prefetched_bytes += bytes;
                        self.stats.prefetched_groups += 1;
                        tracing::trace!("{}: prefetching group {} during {}", self.name, gi.0, seg.name);
                    }
                    Step::Compute => {
                        // Groups the plan counted on that an allocation evicted meanwhile.
                        for &gi in &reads {
                            if !w.is_resident(gi) {
                                tracing::debug!("{}: staging group {} again for {}", self.name, gi.0, seg.name);
                                self.load(w, gi, w.group_bytes(gi))?;
                            }
                        }
                        if schedule.mode == Mode::Monolithic {
                            self.naming.1 = 0;
                            let need = self.devs[0].alloc.measure(graph) as u64;
                            self.alloc_measured(graph, need, 1)?;
                            set_inputs()?;
                            self.compute_with_prefetch(graph, &mut inflight)?;
                        } else {
                            self.compute_segment(graph, a, seg, n_segments, &mut inflight)?;
                        }
                        self.stats.segments += 1;
                    }
                }
            }
        }
        self.stats.max_segments = self.stats.max_segments.max(n_segments);
        Ok(())
    }

    /// Allocates group `gi` (`bytes`) and fills it now.
    pub(crate) fn load(&mut self, w: &Weights, gi: GroupId, bytes: u64) -> Result<()> {
        let t0 = Instant::now();
        w.alloc_group(gi)?;
        if let Err(e) = w.fill_group(gi) {
            w.evict_group(gi);
            return Err(e);
        }
        self.stats.load_secs += t0.elapsed().as_secs_f64();
        self.stats.loaded_bytes += bytes;
        Ok(())
    }

    /// The cut buffer: cut tensors and inputs, for the whole run (the planner counts it as
    /// fixed memory, [`DeviceState::fixed`]).
    fn alloc_cut_buffer(&mut self, a: &Analysis<'_>) -> Result<()> {
        let dev = &mut self.devs[0];
        let buft = dev.buft;
        let at = dev.alloc_cut_buffer(&self.name, a.cut_bytes)?;
        let buf = &dev.cut_buffers[at].0;
        let mut off = 0usize;
        for t in &a.bound {
            if !t.is_allocated() {
                // SAFETY: the buffer stays in `cut_buffers` until the next run or the
                // runner's drop, past every use this run makes of the tensors (the caller
                // reads the output before either, `run`'s contract); slots are disjoint
                // (`slot` bytes each, in order) and sum to its size.
                unsafe { t.place_in(buf, off)? };
            }
            off += slot(buft, *t);
        }
        Ok(())
    }

    /// Computes one segment of a segmented run: a graph view of its nodes, in the compute
    /// buffer the planner measured for it.
    fn compute_segment(
        &mut self,
        graph: &Graph<'_>,
        a: &Analysis<'_>,
        seg: &PlannedSegment,
        n_segments: usize,
        inflight: &mut InFlight<'_>,
    ) -> Result<()> {
        for t in a.stale_views.iter().filter(|(s, _)| seg.base.contains(s)).map(|(_, t)| t) {
            // SAFETY: a view of a weight made in an earlier segment: its storage may have
            // moved; the allocator re-makes it.
            unsafe { t.detach_storage() };
        }
        let nodes = a.nodes_of(seg.base.clone());
        self.naming.1 = nodes.start;
        let view = graph.view(nodes);
        let vg = view.graph();
        // Measured by the planner, with the same tensors outside the view.
        self.alloc_measured(&vg, seg.workspace, n_segments)?;
        self.compute_with_prefetch(&vg, inflight)?;
        for t in a.bound.iter().filter(|t| a.produced_in(**t).is_some_and(|p| p < seg.base.end)) {
            // SAFETY: computed by this or an earlier segment; later segments only read it.
            unsafe { t.sever_operands() };
        }
        Ok(())
    }

    /// Charges the compute buffer up to `bytes` where the plan puts it (before the segment's
    /// loads); ggml's allocator allocates the buffer when the segment's graph is allocated,
    /// within that charge (more is charged then if it needs more).
    fn reserve_workspace(&mut self, bytes: u64) -> Result<()> {
        let dev = &mut self.devs[0];
        if bytes > dev.charged {
            dev.ledger.charge(bytes - dev.charged, &format!("the {} compute buffer", self.name))?;
            dev.charged = bytes;
        }
        Ok(())
    }

    /// Computes `graph` while the worker thread fills the in-flight prefetches; they are
    /// filled (and no longer in flight) only when both succeed.
    fn compute_with_prefetch(&mut self, graph: &Graph<'_>, inflight: &mut InFlight<'_>) -> Result<()> {
        if self.profile.is_some() && !inflight.groups.is_empty() {
            // Profiling: the copies first, then the graph node by node (no overlap to measure).
            let t0 = Instant::now();
            for &gi in &inflight.groups {
                inflight.w.fill_group(gi)?;
            }
            self.stats.prefetch_wait_secs += t0.elapsed().as_secs_f64();
            self.stats.prefetches_used += inflight.groups.len();
            inflight.groups.clear();
        }
        if inflight.groups.is_empty() {
            return self.compute(graph);
        }
        // SAFETY: the in-flight groups are prefetched for a later segment, never for the one
        // computing now (`resolve` rejects a schedule that prefetches a segment's own group),
        // so the graph computed below holds none of their tensors; nothing else touches the
        // weight set until the scope below has joined the worker, which ends the job.
        let job = unsafe { inflight.w.fill_on_worker(&inflight.groups) };
        let t0 = Instant::now();
        let backend = self.devs[0].backend.clone();
        let (computed, fetched, compute_secs) = std::thread::scope(|s| {
            let worker = s.spawn(move || job.map_or(Ok(()), |j| j.run()));
            let c0 = Instant::now();
            let computed = backend.compute(graph).map_err(SchedError::from);
            let compute_secs = c0.elapsed().as_secs_f64();
            let fetched =
                worker.join().unwrap_or_else(|_| Err(SchedError::Invalid("the prefetch thread panicked".into())));
            (computed, fetched, compute_secs)
        });
        self.stats.compute_secs += compute_secs;
        self.stats.prefetch_wait_secs += (t0.elapsed().as_secs_f64() - compute_secs).max(0.0);
        computed?;
        fetched?;
        // Filled: resident for good. On an error above, the guard evicts them (a replica
        // whose copy did not finish must not count as resident).
        self.stats.prefetches_used += inflight.groups.len();
        inflight.groups.clear();
        Ok(())
    }

    fn device_state(&self, cut_bytes: u64) -> DeviceState {
        let main = &self.devs[0];
        let dev = main.backend.device();
        let (free, total) = dev.memory();
        let mut state = DeviceState::new(dev.name(), main.ledger.budget(), (total > 0).then_some(free));
        let replicas = main.ledger.replicas();
        let replica_bytes: u64 = replicas.iter().map(|r| r.bytes).sum();
        state.fixed = main.ledger.managed().saturating_sub(replica_bytes).saturating_sub(main.charged) + cut_bytes;
        state.workspace = main.charged;
        state.replicas = replicas;
        // Prefetches are copied on a worker thread while the segment computes; the executor
        // has no asynchronous-transfer path, so it never offers one.
        state.async_transfer = false;
        state
    }

    /// One line for `-v`: what ran, where, and what moved.
    pub fn summary(&self) -> String {
        let s = &self.stats;
        format!(
            "{} on {}: {} runs ({} segmented, up to {} segments), loaded {:.1} MiB, prefetched {:.1} MiB in {} \
             groups, {} evictions, compute {:.2} s, blocking loads {:.2} s, prefetch waits {:.2} s, peak compute \
             buffer {:.1} MiB",
            self.name,
            self.devs.iter().map(|d| d.backend.device().name()).collect::<Vec<_>>().join("&"),
            s.runs,
            s.segmented_runs,
            s.max_segments,
            s.loaded_bytes as f64 / 1048576.0,
            s.prefetched_bytes as f64 / 1048576.0,
            s.prefetched_groups,
            s.evictions,
            s.compute_secs,
            s.load_secs,
            s.prefetch_wait_secs,
            s.peak_workspace as f64 / 1048576.0
        ) + &self.split_summary()
    }

    /// What a split moved between its devices and, pipelined, the overlap it achieved.
    fn split_summary(&self) -> String {
        let s = &self.stats;
        let mut out = String::new();
        if self.devs.len() > 1 {
            out += &format!(
                ", {:.1} MiB of activations in {} copies between devices",
                s.cross_device_bytes as f64 / 1048576.0,
                s.cross_device_copies
            );
        }
        if s.pipelined_runs > 0 && s.pipeline_wall_secs > 0.0 {
            out += &format!(
                ", {} pipelined evaluations: devices busy {:.2} s in {:.2} s (overlap {:.2})",
                s.pipelined_runs,
                s.pipeline_busy_secs,
                s.pipeline_wall_secs,
                s.pipeline_busy_secs / s.pipeline_wall_secs
            );
        }
        out
    }
}

/// Bytes a tensor takes in the cut buffer.
pub(crate) fn slot(buft: BufferType, t: Tensor<'_>) -> usize {
    let a = buft.alignment().max(1);
    buft.alloc_size(t).div_ceil(a) * a
}

/// Expands the graph cut by cut, so that base segment *k* is the nodes cut *k* added (cuts
/// that add no node are skipped), then the output; returns the segments' names and node
/// ranges in execution order.
pub(crate) fn expand<'g>(
    graph: &Graph<'g>,
    cuts: &[(String, Tensor<'g>)],
    out: Tensor<'g>,
) -> Vec<(String, Range<usize>)> {
    let mut segments = Vec::new();
    let mut start = 0;
    for (name, t) in cuts {
        graph.expand(*t);
        let end = graph.n_nodes();
        if end > start {
            segments.push((name.clone(), start..end));
            start = end;
        }
    }
    graph.expand(out);
    let n = graph.n_nodes();
    if n > start {
        segments.push(("output".into(), start..n));
    }
    segments
}

/// The module graph as the runner sees it: its base segments, what each reads, and the
/// tensors crossing cuts.
pub(crate) struct Analysis<'g> {
    /// Name and node range of each base segment, in execution order.
    pub(crate) segments: Vec<(String, Range<usize>)>,
    /// Groups each segment reads, in order of first use.
    pub(crate) groups_of_seg: Vec<Vec<GroupId>>,
    /// Tensors that need storage outside the segments' compute buffers: outputs of a segment
    /// read by a later one, and graph inputs (leaves without storage that are not weights).
    pub(crate) bound: Vec<Tensor<'g>>,
    /// Bytes of the cut buffer holding `bound`.
    pub(crate) cut_bytes: u64,
    /// Views of weights made in an earlier segment and read by segment `.0`.
    pub(crate) stale_views: Vec<(usize, Tensor<'g>)>,
    /// The weight tensors of each group the graph reads.
    pub(crate) tensors_of_group: HashMap<GroupId, Vec<Tensor<'g>>>,
    /// The base segment that computes each bound tensor (absent for inputs).
    pub(crate) producer: HashMap<usize, usize>,
}

impl Analysis<'_> {
    pub(crate) fn produced_in(&self, t: Tensor<'_>) -> Option<usize> {
        self.producer.get(&(t.as_raw() as usize)).copied()
    }

    /// The graph nodes of base segments `r`.
    pub(crate) fn nodes_of(&self, r: Range<usize>) -> Range<usize> {
        self.segments[r.start].1.start..self.segments[r.end - 1].1.end
    }
}

pub(crate) fn analyse<'g>(
    w: &Weights,
    graph: &Graph<'g>,
    segments: Vec<(String, Range<usize>)>,
    buft: BufferType,
) -> Analysis<'g> {
    let n = graph.n_nodes();
    let mut node_index: HashMap<usize, usize> = HashMap::with_capacity(n);
    for i in 0..n {
        node_index.insert(graph.node(i).as_raw() as usize, i);
    }
    let mut groups_of_seg = vec![Vec::new(); segments.len()];
    let mut bound = Vec::new();
    let mut bound_set = HashSet::new();
    let mut stale_views = Vec::new();
    let mut tensors_of_group: HashMap<GroupId, Vec<Tensor<'g>>> = HashMap::new();
    let mut seen_weight = HashSet::new();
    let mut seg_of_node = vec![0usize; n];
    for (s, (_, range)) in segments.iter().enumerate() {
        for i in range.clone() {
            seg_of_node[i] = s;
        }
    }
    for (s, (_, range)) in segments.iter().enumerate() {
        let mut seen_group = HashSet::new();
        for i in range.clone() {
            let node = graph.node(i);
            let operands = (0..sd_backends::context::MAX_SRC).filter_map(|j| node.src(j));
            for t in std::iter::once(node).chain(operands) {
                let root = t.storage_root();
                if let Some(ti) = w.index_of(root) {
                    if let Some(gi) = w.group_of_tensor(ti) {
                        if seen_group.insert(gi) {
                            groups_of_seg[s].push(gi);
                        }
                        if seen_weight.insert(root.as_raw() as usize) {
                            tensors_of_group.entry(gi).or_default().push(root);
                        }
                    }
                    if t != root && node_index.get(&(t.as_raw() as usize)).is_some_and(|&j| j < range.start) {
                        stale_views.push((s, t));
                    }
                    continue;
                }
                let crosses = match node_index.get(&(root.as_raw() as usize)) {
                    Some(&j) => j < range.start,
                    None => !root.is_allocated(),
                };
                if crosses && bound_set.insert(root.as_raw() as usize) {
                    bound.push(root);
                }
            }
        }
    }
    let producer = bound
        .iter()
        .filter_map(|t| node_index.get(&(t.as_raw() as usize)).map(|&i| (t.as_raw() as usize, seg_of_node[i])))
        .collect();
    let cut_bytes = bound.iter().map(|t| slot(buft, *t) as u64).sum();
    Analysis { segments, groups_of_seg, bound, cut_bytes, stale_views, tensors_of_group, producer }
}

/// One step of the replay: a schedule action with its group resolved to this runner's id.
#[derive(Debug, PartialEq)]
enum Step {
    /// Free this runner's replica of the group.
    Evict(GroupId),
    /// The planner would evict another runner's replica: left resident (a runner frees only
    /// its own replicas; the other runner's next plan sees the device as it is).
    EvictForeign(String),
    /// Release an oversized idle compute buffer (`Action::Workspace { bytes: 0 }`).
    ReleaseWorkspace,
    /// Charge the compute buffer up to this size (`Action::Workspace`).
    Workspace(u64),
    /// Allocate and fill the group now.
    Load(GroupId, u64),
    /// Allocate the group now and fill it on the worker thread while this segment computes;
    /// it is filled before any later segment starts, so before the one that needs it.
    Prefetch(GroupId, u64),
    /// Compute the segment.
    Compute,
}

/// Translates a schedule into steps on `w`'s groups before anything runs: every action is
/// either performed or refused here, never skipped.
fn resolve(runner: &str, w: &Weights, schedule: &Schedule) -> Result<Vec<Vec<Step>>> {
    let ids = w.group_ids();
    let own = |group: &str| {
        ids.get(group).copied().ok_or_else(|| {
            SchedError::Invalid(format!(
                "{runner}: the schedule loads group `{group}`, which is not one of its weights"
            ))
        })
    };
    let refuse = |what: &str| {
        Err(SchedError::Invalid(format!(
            "{runner}: the schedule asks for {what}, which this runner never offers the planner"
        )))
    };
    let mut out = Vec::with_capacity(schedule.segments.len());
    for seg in &schedule.segments {
        let mut steps = Vec::with_capacity(seg.actions.len());
        for action in &seg.actions {
            steps.push(match action {
                Action::Evict { group, .. } => match ids.get(group.as_str()) {
                    Some(&gi) => Step::Evict(gi),
                    None => Step::EvictForeign(group.clone()),
                },
                Action::Workspace { bytes: 0 } => Step::ReleaseWorkspace,
                Action::Workspace { bytes } => Step::Workspace(*bytes),
                Action::Load { group, bytes } => Step::Load(own(group)?, *bytes),
                Action::Prefetch { group, bytes, for_segment, via } => {
                    if *via != Transfer::WorkerThread {
                        return refuse(
                            "an asynchronous transfer (it declares none: prefetches run on a worker thread)",
                        );
                    }
                    if seg.groups.contains(group) || schedule.segments.get(*for_segment).is_none() {
                        return Err(SchedError::Invalid(format!(
                            "{runner}: segment `{}` prefetches `{group}` for segment {for_segment}; a prefetch is \
                             for a later segment",
                            seg.name
                        )));
                    }
                    Step::Prefetch(own(group)?, *bytes)
                }
                Action::AllocCut { .. } | Action::ReleaseCut { .. } => {
                    return refuse(
                        "per-segment cut buffers (it declares no cut outputs: its cut tensors live in one buffer \
                         for the run, counted as fixed memory)",
                    )
                }
                Action::Compute => Step::Compute,
            });
        }
        out.push(steps);
    }
    Ok(out)
}

/// Releases every hold of a weight set in the ledgers when dropped (the end of a run, or any
/// early return).
pub(crate) struct Holds<'w>(pub(crate) &'w Weights);

impl Drop for Holds<'_> {
    fn drop(&mut self) {
        self.0.set_in_use(&[]);
    }
}

/// Prefetched groups allocated but not yet filled; evicted when dropped (any early return of
/// the replay), so that none stays marked resident with unfilled storage.
struct InFlight<'w> {
    w: &'w Weights,
    groups: Vec<GroupId>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        for gi in self.groups.drain(..) {
            self.w.evict_group(gi);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use sd_backends::GgmlType;

    use super::*;
    use crate::ledger::Ledgers;
    use crate::plan::{DeviceState, ModuleGraph, Options, ParamGroup, Segment, MIB};
    use crate::weights::{ParamHome, SourceError, TensorSource, TensorSpec};

    const N: i64 = 64;

    struct Ones;

    impl TensorSource for Ones {
        fn load(&self, _: &str, _: GgmlType, ne: &[i64]) -> std::result::Result<Cow<'_, [u8]>, SourceError> {
            let n: i64 = ne.iter().product();
            Ok(Cow::Owned((0..n).flat_map(|_| 1f32.to_le_bytes()).collect()))
        }
    }

    fn cpu() -> Arc<Backend> {
        crate::test_cpu()
    }

    /// Two groups (`m/b0`, `m/b1`) of one f32 N×N tensor each, homed in RAM.
    fn placed(ledgers: &Ledgers) -> Weights {
        let specs = (0..2)
            .map(|i| TensorSpec { name: format!("b{i}.w"), ty: GgmlType::GGML_TYPE_F32, ne: vec![N, N] })
            .collect();
        let mut w = Weights::new(specs).unwrap();
        let group_of = |name: &str| name[..2].to_string();
        w.place("m", ParamHome::Host, cpu(), ledgers, &group_of, Arc::new(Ones)).unwrap();
        w
    }

    /// A schedule of two one-group segments on a device whose budget forces segments.
    fn schedule(w: &Weights, cut_output: bool, async_transfer: bool) -> Schedule {
        let groups = w.groups();
        let mut segments: Vec<Segment> = groups
            .iter()
            .map(|(name, bytes)| Segment::new(name.clone(), vec![ParamGroup::new(name, *bytes)], 0))
            .collect();
        if cut_output {
            segments[0] = segments[0].clone().with_cut_output(1024, 1);
        }
        let module = ModuleGraph { name: "m".into(), segments };
        let mut device = DeviceState::new(cpu().device().name(), Some(groups[0].1 * 2 + 2048), None);
        device.async_transfer = async_transfer;
        let s = plan::plan(&module, &device, &Options::default(), &mut plan::Estimate).unwrap();
        assert_eq!(s.mode, Mode::Segmented);
        s
    }

    #[test]
    fn a_schedule_asking_for_what_the_runner_does_not_offer_is_refused_before_anything_runs() {
        let ledgers = Ledgers::default();
        let w = placed(&ledgers);
        let ok = resolve("m", &w, &schedule(&w, false, false)).unwrap();
        let ids = w.group_ids();
        assert_eq!(ok[0][0], Step::Load(ids["m/b0"], w.groups()[0].1));
        assert!(ok[0].contains(&Step::Prefetch(ids["m/b1"], w.groups()[1].1)), "{ok:?}");
        let cut = resolve("m", &w, &schedule(&w, true, false)).unwrap_err().to_string();
        assert!(cut.contains("per-segment cut buffers"), "{cut}");
        let via = resolve("m", &w, &schedule(&w, false, true)).unwrap_err().to_string();
        assert!(via.contains("asynchronous transfer"), "{via}");
        assert_eq!(ledgers.get(&cpu().device().name()).managed(), 0, "nothing was allocated");
    }

    #[test]
    fn a_prefetch_allocated_before_a_failing_charge_is_undone() {
        let dev = cpu().device().name();
        let ledgers = Ledgers::with_budgets(HashMap::from([(dev.clone(), 64 * MIB)]));
        let w = placed(&ledgers);
        let g = Context::for_graph(8, 8).unwrap();
        let x = g.new_f32(&[N, 1]).set_input();
        let out = g.mul_mat(w.get("b0.w").unwrap(), x);
        let graph = g.new_graph(8);
        let a = analyse(&w, &graph, expand(&graph, &[], out), cpu().device().buffer_type());
        let mut runner = Runner::with_ledger("m", cpu(), ledgers.get(&dev), Options::default());
        let b1 = w.group_ids()["m/b1"];
        // A plan whose first segment prefetches b1, then charges a workspace the budget refuses.
        let mut s = schedule(&w, false, false);
        s.mode = Mode::Monolithic;
        let steps = vec![vec![Step::Prefetch(b1, w.groups()[1].1), Step::Workspace(128 * MIB), Step::Compute]];
        let err = runner.replay(&w, &graph, &a, &s, &steps, &mut || Ok(())).unwrap_err();
        assert!(matches!(err, SchedError::OverBudget { .. }), "{err}");
        assert!(!w.is_resident(b1), "the unfilled prefetch was evicted");
        assert_eq!(ledgers.get(&dev).managed(), 0, "and its replica released");
    }
}
