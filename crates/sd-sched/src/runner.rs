//! A runner executes a module's graphs on one device: whole, or in segments with staging,
//! eviction and prefetch of the module's weight groups.
//!
//! Two ways in:
//! * [`Runner::alloc`] + [`Runner::compute`]: the graph runs whole; its weights must have
//!   storage (allocated, or staged with [`Weights::make_resident`]).
//! * [`Runner::run`]: the module hands over its graph context, the cut tensors it marked at
//!   block boundaries (in execution order) and the output. The runner expands the graph cut
//!   by cut, so that base segment *k* is the nodes added by cut *k*; finds, per segment, the
//!   weight groups it reads and the tensors it reads from earlier segments; measures every
//!   segment (and merged ranges on request) with ggml's measure-only allocator; asks the pure
//!   planner ([`crate::plan::plan`]) for a [`Schedule`] against the device's live state and
//!   its [`Ledger`]; and replays the schedule: evictions, synchronous loads, prefetches on a
//!   worker thread that overlap the segment's compute, compute of a graph *view* of the
//!   segment's nodes.
//!
//! Cut tensors (and graph inputs) live in one cut buffer on the device for the whole run,
//! allocated before the first segment and charged to the ledger; the planner sees it as
//! fixed managed memory. A segment's compute buffer is ggml's graph allocator, reused across
//! segments and runs (it grows to the largest segment: "peak across N segments").
//!
//! Every device allocation is charged to the device's ledger before it is made, so the
//! managed bytes never exceed the budget; a charge that would exceed it fails with the
//! device, the bytes and the budget.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use sd_backends::{alloc, Backend, Buffer, BufferType, Context, Graph, GraphAllocator, Tensor};

use crate::error::{Result, SchedError};
use crate::ledger::Ledger;
use crate::plan::{self, Action, DeviceState, Mode, ModuleGraph, ParamGroup, Replica, Segment};
use crate::weights::Weights;

/// What a runner did, summed over its runs.
#[derive(Clone, Debug, Default, PartialEq)]
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
    /// Groups prefetched.
    pub prefetched_groups: usize,
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
}

/// Graph execution on one backend.
#[derive(Debug)]
pub struct Runner {
    name: String,
    backend: Arc<Backend>,
    buft: BufferType,
    alloc: GraphAllocator,
    ledger: Ledger,
    /// Bytes of the compute buffer charged to the ledger.
    charged: u64,
    opts: plan::Options,
    last_logged: usize,
    stats: RunStats,
    /// The cut buffer of the last run, kept while its output may still be read.
    cut_buffer: Option<(Buffer, u64)>,
}

impl Runner {
    /// A runner named `name` (for logs) on `backend`, with an account of its own and no budget.
    pub fn new(name: impl Into<String>, backend: Arc<Backend>) -> Self {
        let ledger = Ledger::new(backend.device().name(), None);
        Self::with_ledger(name, backend, ledger, plan::Options::default())
    }

    /// A runner charging the device's shared `ledger`, with the segmented-execution flags.
    pub fn with_ledger(name: impl Into<String>, backend: Arc<Backend>, ledger: Ledger, opts: plan::Options) -> Self {
        let buft = backend.device().buffer_type();
        let alloc = GraphAllocator::new(buft);
        Self {
            name: name.into(),
            backend,
            buft,
            alloc,
            ledger,
            charged: 0,
            opts,
            last_logged: 0,
            stats: RunStats::default(),
            cut_buffer: None,
        }
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }

    /// What the runner did so far.
    pub fn stats(&self) -> &RunStats {
        &self.stats
    }

    /// The ledger it charges.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Bytes of the current compute buffer.
    pub fn compute_buffer_size(&self) -> usize {
        self.alloc.buffer_size()
    }

    /// Measures and allocates the compute buffer for `graph`.
    pub fn alloc(&mut self, graph: &Graph<'_>) -> Result<()> {
        self.stats.runs += 1;
        self.stats.segments += 1;
        self.stats.max_segments = self.stats.max_segments.max(1);
        let need = self.alloc.measure(graph);
        self.alloc_measured(graph, need as u64, 1)
    }

    fn alloc_measured(&mut self, graph: &Graph<'_>, need: u64, segments: usize) -> Result<()> {
        // Logged when it changes for whole graphs, when the peak grows for segments.
        if (segments == 1 && need as usize != self.last_logged) || (segments > 1 && need as usize > self.last_logged) {
            tracing::debug!(
                "{} compute buffer size: {:.2} MB on {} (peak across {segments} segment{})",
                self.name,
                need as f64 / (1024.0 * 1024.0),
                self.backend.device().name(),
                if segments == 1 { "" } else { "s" }
            );
            self.last_logged = need as usize;
        }
        // The allocator grows its buffer to the largest graph it has seen.
        let target = need.max(self.alloc.buffer_size() as u64);
        if target > self.charged {
            self.ledger.charge(target - self.charged, &format!("the {} compute buffer", self.name))?;
            self.charged = target;
        }
        self.alloc.alloc_graph(graph).map_err(|_| SchedError::Alloc {
            device: self.backend.device().name(),
            bytes: need as usize,
            what: format!("the {} compute buffer", self.name),
        })?;
        let actual = self.alloc.buffer_size() as u64;
        if actual > self.charged {
            self.ledger.charge(actual - self.charged, &format!("the {} compute buffer", self.name))?;
            self.charged = actual;
        }
        self.stats.peak_workspace = self.stats.peak_workspace.max(actual);
        Ok(())
    }

    fn release_workspace(&mut self) {
        self.alloc = GraphAllocator::new(self.buft);
        self.ledger.credit(self.charged);
        self.charged = 0;
    }

    fn release_cut_buffer(&mut self) {
        if let Some((buf, bytes)) = self.cut_buffer.take() {
            drop(buf);
            self.ledger.credit(bytes);
        }
    }

    /// Runs an allocated graph.
    pub fn compute(&mut self, graph: &Graph<'_>) -> Result<()> {
        let _span = tracing::trace_span!("compute", module = %self.name).entered();
        let t0 = Instant::now();
        self.backend.compute(graph)?;
        self.stats.compute_secs += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Runs the graph of `out` built in `g` (room for `graph_size` nodes), whose weights are
    /// `w`, cut at `cuts` (block outputs in execution order, with names for logs), whole or
    /// in segments as the planner decides. `set_inputs` is called once the inputs have
    /// storage and before anything computes. `out` can be read afterwards.
    pub fn run<'g>(
        &mut self,
        w: &Weights,
        g: &'g Context,
        graph_size: usize,
        cuts: &[(String, Tensor<'g>)],
        out: Tensor<'g>,
        set_inputs: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        self.release_cut_buffer();
        let graph = g.new_graph(graph_size);
        let mut ranges: Vec<(String, std::ops::Range<usize>)> = Vec::new();
        let mut start = 0;
        for (name, t) in cuts {
            graph.expand(*t);
            let end = graph.n_nodes();
            if end > start {
                ranges.push((name.clone(), start..end));
                start = end;
            }
        }
        graph.expand(out);
        let n = graph.n_nodes();
        if n > start {
            ranges.push(("output".into(), start..n));
        }
        if w.is_pinned() {
            // Everything is on the device and stays there: one graph, as allocated.
            self.alloc(&graph)?;
            set_inputs()?;
            return self.compute(&graph);
        }
        self.stats.runs += 1;

        let a = analyse(w, &graph, &ranges);
        let groups = w.groups();
        let cut_bytes: u64 = a.bound.iter().map(|t| self.slot(*t) as u64).sum();

        // Measure with every missing weight and every cut tensor marked as stored elsewhere.
        let mut marked: Vec<Tensor<'_>> = Vec::new();
        for (gi, _) in groups.iter().enumerate() {
            if !w.is_resident(gi) {
                marked.extend(a.tensors_of_group.get(&gi).into_iter().flatten().copied());
            }
        }
        marked.extend(a.bound.iter().copied().filter(|t| !t.is_allocated()));
        for t in &marked {
            // SAFETY: unmarked below before anything allocates or computes.
            unsafe { t.mark_stored_elsewhere() };
        }
        let buft = self.buft;
        let seg_ranges: Vec<std::ops::Range<usize>> = ranges.iter().map(|(_, r)| r.clone()).collect();
        let measure_range = |r: std::ops::Range<usize>| -> u64 {
            let first = seg_ranges[r.start].start;
            let last = seg_ranges[r.end - 1].end;
            let view = graph.view(first..last);
            alloc::measure(buft, &view.graph()) as u64
        };
        let segments: Vec<Segment> = ranges
            .iter()
            .enumerate()
            .map(|(s, (name, _))| {
                let gs =
                    a.groups_of_seg[s].iter().map(|&gi| ParamGroup::new(groups[gi].0.clone(), groups[gi].1)).collect();
                Segment::new(name.clone(), gs, measure_range(s..s + 1))
            })
            .collect();
        let module = ModuleGraph { name: self.name.clone(), segments };
        let state = self.device_state(cut_bytes);
        let mut merged = |_: &[Segment], r: std::ops::Range<usize>| measure_range(r);
        let schedule = plan::plan(&module, &state, &self.opts, &mut merged);
        for t in &marked {
            // SAFETY: removes the marker set above; the tensors had no storage before.
            unsafe { t.detach_storage() };
        }
        let schedule = schedule?;

        let n_segments = schedule.segments.len();
        if schedule.mode == Mode::Segmented {
            self.stats.segmented_runs += 1;
            // The cut buffer: cut tensors and inputs, for the whole run.
            self.ledger.charge(cut_bytes, &format!("the {} cut buffers", self.name))?;
            let buf = match self.buft.alloc(cut_bytes.max(1) as usize) {
                Ok(b) => b,
                Err(_) => {
                    self.ledger.credit(cut_bytes);
                    return Err(SchedError::Alloc {
                        device: self.backend.device().name(),
                        bytes: cut_bytes as usize,
                        what: format!("the {} cut buffers", self.name),
                    });
                }
            };
            self.cut_buffer = Some((buf, cut_bytes));
            let buf = &self.cut_buffer.as_ref().expect("just set").0;
            let mut off = 0usize;
            for t in &a.bound {
                if !t.is_allocated() {
                    t.place_in(buf, off)?;
                }
                off += self.slot(*t);
            }
            set_inputs()?;
        }

        let mut pending: Vec<usize> = Vec::new();
        for seg in &schedule.segments {
            for action in &seg.actions {
                match action {
                    Action::Evict { group, .. } => {
                        if let Some(gi) = w.group_index(group) {
                            w.evict_group(gi);
                            self.stats.evictions += 1;
                        } else {
                            tracing::debug!("{}: {group} belongs to another runner; left resident", self.name);
                        }
                    }
                    Action::Workspace { bytes } => {
                        if *bytes == 0 {
                            self.release_workspace();
                        }
                    }
                    Action::Load { group, bytes } => {
                        let gi = w.group_index(group).ok_or_else(|| SchedError::MissingTensor(group.clone()))?;
                        let t0 = Instant::now();
                        w.alloc_group(gi)?;
                        if let Err(e) = w.fill_group(gi) {
                            w.evict_group(gi);
                            return Err(e);
                        }
                        self.stats.load_secs += t0.elapsed().as_secs_f64();
                        self.stats.loaded_bytes += bytes;
                    }
                    Action::Prefetch { group, bytes, .. } => {
                        let gi = w.group_index(group).ok_or_else(|| SchedError::MissingTensor(group.clone()))?;
                        w.alloc_group(gi)?;
                        pending.push(gi);
                        self.stats.prefetched_bytes += bytes;
                        self.stats.prefetched_groups += 1;
                        tracing::trace!("{}: prefetching {group} during {}", self.name, seg.name);
                    }
                    Action::AllocCut { .. } | Action::ReleaseCut { .. } => {}
                    Action::Compute => {
                        if schedule.mode == Mode::Monolithic {
                            let need = self.alloc.measure(&graph) as u64;
                            self.alloc_measured(&graph, need, 1)?;
                            set_inputs()?;
                            self.compute_with_prefetch(w, &graph, &mut pending)?;
                        } else {
                            let first = seg_ranges[seg.base.start].start;
                            let last = seg_ranges[seg.base.end - 1].end;
                            for t in a.stale_views.iter().filter(|(s, _)| seg.base.contains(s)).map(|(_, t)| t) {
                                // SAFETY: a view of a weight made in an earlier segment: its
                                // storage may have moved; the allocator re-makes it.
                                unsafe { t.detach_storage() };
                            }
                            let view = graph.view(first..last);
                            let vg = view.graph();
                            // Measured by the planner, with the same tensors outside the view.
                            self.alloc_measured(&vg, seg.workspace, n_segments)?;
                            self.compute_with_prefetch(w, &vg, &mut pending)?;
                            for t in a.bound.iter().filter(|t| a.produced_in(**t).is_some_and(|p| p < seg.base.end)) {
                                // SAFETY: computed by this or an earlier segment; later
                                // segments only read it.
                                unsafe { t.sever_operands() };
                            }
                        }
                        self.stats.segments += 1;
                    }
                }
            }
        }
        self.stats.max_segments = self.stats.max_segments.max(n_segments);
        Ok(())
    }

    fn compute_with_prefetch(&mut self, w: &Weights, graph: &Graph<'_>, pending: &mut Vec<usize>) -> Result<()> {
        if pending.is_empty() {
            return self.compute(graph);
        }
        let groups = std::mem::take(pending);
        let t0 = Instant::now();
        let backend = self.backend.clone();
        let (computed, fetched, compute_secs) = std::thread::scope(|s| {
            let worker = s.spawn(|| groups.iter().try_for_each(|&gi| w.fill_group(gi)));
            let c0 = Instant::now();
            let computed = backend.compute(graph).map_err(SchedError::from);
            let compute_secs = c0.elapsed().as_secs_f64();
            let fetched =
                worker.join().unwrap_or_else(|_| Err(SchedError::Invalid("the prefetch thread panicked".into())));
            (computed, fetched, compute_secs)
        });
        self.stats.compute_secs += compute_secs;
        self.stats.prefetch_wait_secs += (t0.elapsed().as_secs_f64() - compute_secs).max(0.0);
        if computed.is_err() || fetched.is_err() {
            // A replica whose copy did not finish must not count as resident.
            for &gi in &groups {
                w.evict_group(gi);
            }
        }
        computed?;
        fetched
    }

    /// Bytes a tensor takes in the cut buffer.
    fn slot(&self, t: Tensor<'_>) -> usize {
        let a = self.buft.alignment().max(1);
        self.buft.alloc_size(t).div_ceil(a) * a
    }

    fn device_state(&self, cut_bytes: u64) -> DeviceState {
        let dev = self.backend.device();
        let (free, total) = dev.memory();
        let mut state = DeviceState::new(dev.name(), self.ledger.budget(), (total > 0).then_some(free));
        let replicas = self.ledger.replicas();
        let replica_bytes: u64 = replicas.iter().map(|r| r.bytes).sum();
        state.fixed = self.ledger.managed().saturating_sub(replica_bytes).saturating_sub(self.charged) + cut_bytes;
        state.workspace = self.charged;
        state.replicas =
            replicas.into_iter().map(|r| Replica { group: r.group, bytes: r.bytes, pinned: r.pinned }).collect();
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
            self.backend.device().name(),
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
        )
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        self.release_cut_buffer();
        self.ledger.credit(self.charged);
    }
}

/// What the graph reads, per base segment.
struct Analysis<'g> {
    /// Group indices each segment reads, in order of first use.
    groups_of_seg: Vec<Vec<usize>>,
    /// Tensors that need storage outside the segments' compute buffers: outputs of a segment
    /// read by a later one, and graph inputs (leaves without storage that are not weights).
    bound: Vec<Tensor<'g>>,
    /// Views of weights made in an earlier segment and read by segment `.0`.
    stale_views: Vec<(usize, Tensor<'g>)>,
    /// The weight tensors of each group the graph reads.
    tensors_of_group: HashMap<usize, Vec<Tensor<'g>>>,
    /// The base segment that computes each bound tensor (absent for inputs).
    producer: HashMap<usize, usize>,
}

impl Analysis<'_> {
    fn produced_in(&self, t: Tensor<'_>) -> Option<usize> {
        self.producer.get(&(t.as_raw() as usize)).copied()
    }
}

fn analyse<'g>(w: &Weights, graph: &Graph<'g>, ranges: &[(String, std::ops::Range<usize>)]) -> Analysis<'g> {
    let n = graph.n_nodes();
    let mut node_index: HashMap<usize, usize> = HashMap::with_capacity(n);
    for i in 0..n {
        node_index.insert(graph.node(i).as_raw() as usize, i);
    }
    let mut groups_of_seg = vec![Vec::new(); ranges.len()];
    let mut bound = Vec::new();
    let mut bound_set = HashSet::new();
    let mut stale_views = Vec::new();
    let mut tensors_of_group: HashMap<usize, Vec<Tensor<'g>>> = HashMap::new();
    let mut seen_weight = HashSet::new();
    let mut seg_of_node = vec![0usize; n];
    for (s, (_, range)) in ranges.iter().enumerate() {
        for i in range.clone() {
            seg_of_node[i] = s;
        }
    }
    for (s, (_, range)) in ranges.iter().enumerate() {
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
    Analysis { groups_of_seg, bound, stale_views, tensors_of_group, producer }
}
