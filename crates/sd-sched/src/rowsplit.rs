//! Row split at graph level: large matmul weights cut by output rows across devices.
//!
//! Where no device plugin exports a split buffer type (the CPU, RPC servers, devices of
//! different registries), a module can still use every listed device inside each block:
//! [`Weights::place_rows`] replaces every weight the model calls row-splittable (a matmul
//! weight `W` of shape `[in, out]`) by chunks `W#rows{d}` of consecutive output rows, one per
//! device `d`, sized by the devices' shares (free memory or `--max-vram` budgets), each loaded
//! into a pinned replica on its device (charged to that device's ledger). The model's graph
//! builder asks [`Weights::matrix_parts`] and emits `concat(mul_mat(W_0, x), ..., mul_mat(W_n, x))`
//! on dim 0 instead of one `mul_mat` ([`mul_mat_parts`]; a bias is added after the concat).
//!
//! [`Runner::run`] then runs the module's whole graph through ggml's scheduler
//! ([`sd_backends::Scheduler`]) over the devices (plus a host CPU backend last, as ggml
//! requires): every chunk product is assigned to its chunk's device, every other node to the
//! main device, so the scheduler copies `x` to each device and the partial products back. The
//! scheduler's compute buffers are measured first (`reserve`) and charged to each device's
//! ledger before they are allocated. Each output element is the same dot product over the
//! same operands as without the split, so with identical kernels on every device the result
//! is bit-identical to the unsplit graph.
//!
//! Limits: parameters must live on their computing devices (the planner falls back to a layer
//! split otherwise); no segmenting or prefetch; no pipelined micro-batches.
//!
//! Correctness: ggml's reserve re-points the graph's operands at copies the next split frees;
//! `sd_backends::Scheduler::reserve` undoes that, without which the results were wrong. Over two
//! RPC servers, and over an RPC server with the CPU last, the SD 1.5 fixture's image equals the
//! all-CPU one bit for bit at cfg 7 over two steps (sd-cli's placement tests).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use sd_backends::{Backend, Context, DeviceKind, GgmlType, Scheduler, Tensor};

use crate::error::{Result, SchedError};
use crate::ledger::Ledgers;
use crate::runner::Runner;
use crate::weights::{ParamHome, SourceError, TensorSource, TensorSpec, Weights};

/// Separator between a split weight's name and its chunk's device.
const CHUNK: &str = "#rows";

/// Chunk boundaries are multiples of this many rows where the weight has enough rows.
const ROW_ALIGN: i64 = 64;

/// The rows `[start, end)` of each of `shares.len()` chunks of a weight with `rows` output
/// rows, in proportion to `shares` (cumulative rounding to multiples of [`ROW_ALIGN`], or of 1
/// when the weight is too small); a device whose share rounds to nothing gets an empty range.
pub(crate) fn row_bounds(rows: i64, shares: &[f64]) -> Vec<(i64, i64)> {
    let total: f64 = shares.iter().map(|s| s.max(0.0)).sum();
    let n = shares.len() as i64;
    let align = if rows >= ROW_ALIGN * n.max(1) { ROW_ALIGN } else { 1 };
    let mut out = Vec::with_capacity(shares.len());
    let mut acc = 0.0;
    let mut prev = 0i64;
    for (k, s) in shares.iter().enumerate() {
        acc += s.max(0.0);
        let end = if k + 1 == shares.len() || total <= 0.0 {
            if k + 1 == shares.len() {
                rows
            } else {
                0
            }
        } else {
            let exact = rows as f64 * acc / total;
            (((exact / align as f64).round() as i64) * align).clamp(prev, rows)
        };
        out.push((prev, end));
        prev = end;
    }
    out
}

/// One chunk of a split weight.
#[derive(Clone, Debug)]
struct Chunk {
    parent: String,
    parent_ty: GgmlType,
    parent_ne: Vec<i64>,
    /// Byte range of the chunk inside the parent's bytes.
    bytes: (usize, usize),
    device: usize,
}

/// The row chunks of a weight set (set by [`Weights::place_rows`]).
#[derive(Debug, Default)]
pub(crate) struct RowIndex {
    /// Chunk tensors by spec index.
    chunks: HashMap<usize, Chunk>,
    /// A split weight's chunk spec indices, in device order.
    by_parent: HashMap<String, Vec<usize>>,
}

/// What a row split put where: per device, the chunks and their rows and bytes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowSplitReport {
    /// Weights split.
    pub weights: usize,
    /// Per device (main first): chunks, rows summed over the chunks, bytes.
    pub per_device: Vec<(usize, i64, u64)>,
}

/// A source that serves chunks as byte ranges of their parents.
struct RowSource {
    inner: Arc<dyn TensorSource + Send + Sync>,
    chunks: HashMap<String, Chunk>,
}

impl TensorSource for RowSource {
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> std::result::Result<Cow<'_, [u8]>, SourceError> {
        let Some(c) = self.chunks.get(name) else { return self.inner.load(name, ty, ne) };
        let all = self.inner.load(&c.parent, c.parent_ty, &c.parent_ne)?;
        let (a, b) = c.bytes;
        if b > all.len() {
            return Err(SourceError::new(format!(
                "`{}` gave {} bytes; its row chunk `{name}` needs bytes {a}..{b}",
                c.parent,
                all.len()
            )));
        }
        Ok(Cow::Owned(all[a..b].to_vec()))
    }

    fn release(&self, name: &str) {
        match self.chunks.get(name) {
            Some(c) => self.inner.release(&c.parent),
            None => self.inner.release(name),
        }
    }
}

impl Weights {
    /// Places the set for a graph-level row split over `devices` (main first; parameters on
    /// their computing devices only): every tensor `splittable` accepts (a matmul weight, 2-D,
    /// `[in, out]`) becomes one chunk of output rows per device, sized by `shares`
    /// ([`row_bounds`]), in a group of its own on that device (`group_of(parent)#rows{d}`;
    /// the main device's chunk stays in the parent's group); everything else stays on the main
    /// device. The [`Runner`] running the set needs the same devices
    /// ([`Runner::with_devices`]) and row mode ([`Runner::set_row_split`]).
    #[allow(clippy::too_many_arguments)]
    pub fn place_rows(
        &mut self,
        module: &str,
        home: ParamHome,
        devices: &[Arc<Backend>],
        shares: &[f64],
        splittable: &dyn Fn(&TensorSpec) -> bool,
        ledgers: &Ledgers,
        group_of: &dyn Fn(&str) -> String,
        src: Arc<dyn TensorSource + Send + Sync>,
    ) -> Result<RowSplitReport> {
        if !matches!(home, ParamHome::Compute) {
            return Err(SchedError::Invalid(format!(
                "{module}: a row split needs the parameters on their computing devices, not {}",
                home.describe()
            )));
        }
        if devices.len() < 2 || shares.len() != devices.len() || shares.iter().any(|s| !s.is_finite() || *s < 0.0) {
            return Err(SchedError::Invalid(format!(
                "{module}: a row split needs two or more devices with a finite share each ({} devices, shares {shares:?})",
                devices.len()
            )));
        }
        if self.is_allocated() && !self.specs().is_empty() {
            return Err(SchedError::Invalid(format!("{module}: the weights already have storage")));
        }
        let mut specs = Vec::with_capacity(self.specs().len());
        let mut chunks: Vec<(usize, Chunk)> = Vec::new();
        let mut report = RowSplitReport { weights: 0, per_device: vec![(0, 0, 0); devices.len()] };
        for spec in self.specs() {
            let two_d = spec.ne.len() >= 2 && spec.ne[2..].iter().all(|&d| d == 1);
            if !splittable(spec) || !two_d || spec.ne[1] < devices.len() as i64 {
                specs.push(spec.clone());
                continue;
            }
            let row_bytes = sd_backends::row_size(spec.ty, spec.ne[0]);
            report.weights += 1;
            for (d, (r0, r1)) in row_bounds(spec.ne[1], shares).into_iter().enumerate() {
                if r1 == r0 {
                    continue;
                }
                let mut ne = spec.ne.clone();
                ne[1] = r1 - r0;
                let chunk = Chunk {
                    parent: spec.name.clone(),
                    parent_ty: spec.ty,
                    parent_ne: spec.ne.clone(),
                    bytes: (r0 as usize * row_bytes, r1 as usize * row_bytes),
                    device: d,
                };
                let e = &mut report.per_device[d];
                e.0 += 1;
                e.1 += r1 - r0;
                e.2 += ((r1 - r0) as usize * row_bytes) as u64;
                chunks.push((specs.len(), chunk));
                specs.push(TensorSpec { name: format!("{}{CHUNK}{d}", spec.name), ty: spec.ty, ne });
            }
        }
        let mut fresh = Weights::new(specs)?;
        let mut index = RowIndex::default();
        for (i, c) in &chunks {
            index.by_parent.entry(c.parent.clone()).or_default().push(*i);
            index.chunks.insert(*i, c.clone());
        }
        let by_name: HashMap<String, Chunk> =
            chunks.iter().map(|(i, c)| (fresh.specs()[*i].name.clone(), c.clone())).collect();
        let chunk_of = |name: &str| by_name.get(name);
        let device_of = |name: &str| chunk_of(name).map_or(0, |c| c.device);
        let group = |name: &str| match chunk_of(name) {
            Some(c) if c.device > 0 => format!("{}{CHUNK}{}", group_of(&c.parent), c.device),
            Some(c) => group_of(&c.parent),
            None => group_of(name),
        };
        let src: Arc<dyn TensorSource + Send + Sync> = Arc::new(RowSource { inner: src, chunks: by_name.clone() });
        fresh.place_split(module, home, devices, &device_of, ledgers, &group, src)?;
        fresh.rows = Some(index);
        fresh.adapters = std::mem::take(&mut self.adapters);
        *self = fresh;
        for (d, (n, rows, bytes)) in report.per_device.iter().enumerate() {
            tracing::info!(
                "{module}: row split: {} holds {n} chunks of {} weights, {rows} rows, {:.1} MiB",
                devices[d].device().name(),
                report.weights,
                *bytes as f64 / (1024.0 * 1024.0)
            );
        }
        Ok(report)
    }

    /// The row chunks of a split weight, in device order (`None`: not split).
    pub(crate) fn row_chunks(&self, name: &str) -> Option<Vec<Tensor<'_>>> {
        let idx = self.rows.as_ref()?.by_parent.get(name)?;
        Some(idx.iter().map(|&i| self.nth(i)).collect())
    }

    /// The tensors of the matrix `name`: its row chunks in device order when it is cut for a
    /// row split, else the whole tensor alone. [`mul_mat_parts`] multiplies them.
    pub fn matrix_parts(&self, name: &str) -> Result<Vec<Tensor<'_>>> {
        match self.row_chunks(name) {
            Some(chunks) => Ok(chunks),
            None => Ok(vec![self.get(name)?]),
        }
    }

    /// The shape `name` was declared with: a weight cut for a row split has its whole shape
    /// (its chunks have parts of it); `None` when the set holds no such tensor.
    pub fn declared_ne(&self, name: &str) -> Option<Vec<i64>> {
        if let Some(rows) = &self.rows {
            if let Some(first) = rows.by_parent.get(name).and_then(|idx| idx.first()) {
                return rows.chunks.get(first).map(|c| c.parent_ne.clone());
            }
        }
        self.specs().iter().find(|s| s.name == name).map(|s| s.ne.clone())
    }

    /// The weights cut for a row split (declared names, in the order of their first chunk);
    /// empty when the set is not row-split.
    pub(crate) fn row_split_names(&self) -> Vec<String> {
        let Some(rows) = &self.rows else { return Vec::new() };
        let mut first: Vec<(usize, &String)> =
            rows.by_parent.iter().filter_map(|(name, idx)| idx.first().map(|&i| (i, name))).collect();
        first.sort();
        first.into_iter().map(|(_, name)| name.clone()).collect()
    }

    /// Whether the set is placed for a row split.
    pub fn is_row_split(&self) -> bool {
        self.rows.is_some()
    }

    /// The device of `t` when it is a row chunk of this set.
    pub(crate) fn row_device(&self, t: Tensor<'_>) -> Option<usize> {
        let i = self.index_of(t)?;
        self.rows.as_ref()?.chunks.get(&i).map(|c| c.device)
    }
}

/// `W x` for a matrix given as [`Weights::matrix_parts`]: one `mul_mat` per part (each runs
/// on its part's device), concatenated on dim 0 in order; one part is a plain `mul_mat`.
///
/// # Panics
/// When `parts` is empty (`matrix_parts` never returns that).
pub fn mul_mat_parts<'g>(g: &'g Context, parts: &[Tensor<'_>], x: Tensor<'_>) -> Tensor<'g> {
    let mut products = parts.iter().map(|&w| g.mul_mat(w, x));
    let first = products.next().expect("a matrix has at least one part");
    products.fold(first, |a, b| g.concat(a, b, 0))
}

impl Runner {
    /// Puts the runner in row mode (its weights placed by [`Weights::place_rows`]): graphs run
    /// through ggml's scheduler over its devices, and `host` (a CPU backend) last, which ggml
    /// requires; `None` when the last device is already the CPU.
    pub fn set_row_split(&mut self, host: Option<Arc<Backend>>) {
        self.row = Some(host);
        self.sched = None;
    }

    /// Whether the runner is in row mode.
    pub fn is_row_split(&self) -> bool {
        self.row.is_some()
    }

    /// Runs the graph of `out` whole through the scheduler (module docs).
    pub(crate) fn run_rows<'g>(
        &mut self,
        w: &Weights,
        g: &'g sd_backends::Context,
        graph_size: usize,
        out: Tensor<'g>,
        set_inputs: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let names: Vec<String> = self.devs.iter().map(|d| d.backend.device().name()).collect();
        if w.device_names() != names {
            return Err(SchedError::Invalid(format!(
                "{}: the weights are placed on [{}] but the runner computes on [{}]",
                self.name,
                w.device_names().join(", "),
                names.join(", ")
            )));
        }
        if self.sched.is_none() {
            let mut backends: Vec<Arc<Backend>> = self.devs.iter().map(|d| d.backend.clone()).collect();
            if backends.iter().take(backends.len() - 1).any(|b| b.device().kind() == DeviceKind::Cpu) {
                return Err(SchedError::Invalid(format!(
                    "{}: a row split takes the CPU only as its last device ([{}])",
                    self.name,
                    names.join(", ")
                )));
            }
            if backends.last().map(|b| b.device().kind()) != Some(DeviceKind::Cpu) {
                match self.row.clone().flatten() {
                    Some(h) => backends.push(h),
                    None => {
                        return Err(SchedError::Invalid(format!(
                            "{}: a row split over [{}] needs a host CPU backend for ggml's scheduler",
                            self.name,
                            names.join(", ")
                        )))
                    }
                }
            }
            self.sched = Some(Scheduler::new(backends, graph_size)?);
        }
        let graph = g.new_graph(graph_size);
        graph.expand(out);
        // Chunk products on their devices, every other node (and graph input) on the main one.
        let mut assign: Vec<(Tensor<'_>, usize)> = Vec::with_capacity(graph.n_nodes() * 2);
        let mut remote_bytes = 0u64;
        for i in 0..graph.n_nodes() {
            let node = graph.node(i);
            match node.src(0).and_then(|s| w.row_device(s)) {
                Some(d) => {
                    assign.push((node, d));
                    if d > 0 {
                        remote_bytes += (node.src(1).map_or(0, |x| x.nbytes()) + node.nbytes()) as u64;
                    }
                }
                None => assign.push((node, 0)),
            }
            for j in 0..sd_backends::context::MAX_SRC {
                if let Some(s) = node.src(j) {
                    if !s.is_allocated() && s.view_src().is_none() && s.src(0).is_none() {
                        assign.push((s, 0));
                    }
                }
            }
        }
        let sched = self.sched.as_mut().expect("built above");
        let sizes = sched.reserve(&graph, &assign)?;
        for (d, dev) in self.devs.iter_mut().enumerate() {
            let need = sizes[d];
            if need as usize != dev.last_logged {
                tracing::debug!(
                    "{} compute buffer size: {:.2} MB on {} (row split, {} graph pieces)",
                    self.name,
                    need as f64 / (1024.0 * 1024.0),
                    dev.backend.device().name(),
                    sched.n_splits()
                );
                dev.last_logged = need as usize;
            }
            if need > dev.charged {
                dev.ledger.charge(need - dev.charged, &format!("the {} compute buffer", self.name))?;
                dev.charged = need;
            }
            self.stats.peak_workspace = self.stats.peak_workspace.max(need);
        }
        // SAFETY: the graph's tensors are used only until this runner runs again or is dropped
        // (`run`'s contract); the scheduler lives in the runner until then.
        unsafe { sched.alloc_graph(&graph, &assign)? };
        let sizes = sched.buffer_sizes();
        for (d, dev) in self.devs.iter_mut().enumerate() {
            if sizes[d] > dev.charged {
                dev.ledger.charge(sizes[d] - dev.charged, &format!("the {} compute buffer", self.name))?;
                dev.charged = sizes[d];
            }
        }
        set_inputs()?;
        let t0 = Instant::now();
        sched.compute(&graph)?;
        self.stats.compute_secs += t0.elapsed().as_secs_f64();
        self.stats.runs += 1;
        self.stats.segments += 1;
        self.stats.max_segments = self.stats.max_segments.max(1);
        self.stats.cross_device_bytes += remote_bytes;
        self.stats.cross_device_copies += assign.iter().filter(|(_, d)| *d > 0).count() * 2;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_follow_the_shares_in_aligned_chunks_that_cover_the_weight() {
        assert_eq!(row_bounds(1280, &[1.0, 1.0]), vec![(0, 640), (640, 1280)]);
        // 1/3 of 1280 = 426.7 rows: rounded to 448 (a multiple of 64).
        assert_eq!(row_bounds(1280, &[1.0, 2.0]), vec![(0, 448), (448, 1280)]);
        // Too few rows for aligned chunks: exact rounding.
        assert_eq!(row_bounds(10, &[1.0, 1.0, 2.0]), vec![(0, 3), (3, 5), (5, 10)]);
        // A device with no share gets nothing.
        assert_eq!(row_bounds(640, &[1.0, 0.0]), vec![(0, 640), (640, 640)]);
        for shares in [[0.3, 0.7], [0.5, 0.5], [0.9, 0.1]] {
            let b = row_bounds(5120, &shares);
            assert_eq!(b.first().unwrap().0, 0);
            assert_eq!(b.last().unwrap().1, 5120);
            assert!(b.windows(2).all(|w| w[0].1 == w[1].0 && w[0].0 <= w[0].1));
        }
    }
}
