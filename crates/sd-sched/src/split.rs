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
//! (released per stage, never kept), otherwise they stay until the device's budget needs the
//! room, when the runner evicts its other staged groups on that device. Segment planning and
//! prefetch are off for a split module (stable-diffusion.cpp's `docs/backend.md`): each
//! device's stage runs whole, in a compute buffer of that device charged to its ledger.

use std::collections::HashSet;
use std::ops::Range;
use std::time::Instant;

use sd_backends::{Graph, Tensor};

use crate::error::{Result, SchedError};
use crate::report::StageReport;
use crate::runner::{analyse, slot, Analysis, Runner};
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

/// Where each bound tensor is, during a split run.
struct Bound {
    /// The device whose slot it points at now.
    at: usize,
    /// The devices holding its current bytes.
    valid: Vec<bool>,
    /// Its slot offset in each device's cut buffer (`None`: no slot there).
    slot: Vec<Option<usize>>,
}

impl Runner {
    /// [`Runner::run`] for a module split over this runner's devices (module docs).
    pub(crate) fn run_split<'g>(
        &mut self,
        w: &Weights,
        graph: &Graph<'g>,
        segments: Vec<(String, Range<usize>)>,
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
        self.stats.runs += 1;
        self.stats.segmented_runs += 1;
        let a = analyse(w, graph, segments, self.devs[0].buft);
        let seg_names: Vec<String> = a.segments.iter().map(|(n, _)| n.clone()).collect();
        let devs_of_seg: Vec<Vec<usize>> =
            a.groups_of_seg.iter().map(|gs| gs.iter().map(|g| w.device_of_group(*g)).collect()).collect();
        let stages = stages(&self.name, &names, &seg_names, &devs_of_seg)?;
        let reads = stage_reads(graph, &a, &stages);
        self.stages = stages
            .iter()
            .map(|st| StageReport {
                device: names[st.device].clone(),
                segments: seg_names[st.segments.clone()].to_vec(),
            })
            .collect();
        let mut bound = self.bind(&a, &stages, &reads)?;
        set_inputs()?;
        let n_stages = stages.len();
        for (k, st) in stages.iter().enumerate() {
            let d = st.device;
            self.move_inputs(&a, &reads[k], d, &mut bound)?;
            let nodes = a.nodes_of(st.segments.clone());
            let moved_views = earlier_views(graph, &a, nodes.clone());
            let own: HashSet<GroupId> = st.segments.clone().flat_map(|s| a.groups_of_seg[s].iter().copied()).collect();
            let mut loaded = Vec::new();
            for &gi in own.iter() {
                if !w.is_resident(gi) {
                    self.stage_group(w, gi, d, &own)?;
                    loaded.push(gi);
                }
            }
            for (s, t) in a.stale_views.iter().chain(moved_views.iter()) {
                if st.segments.contains(s) {
                    // SAFETY: a view made in an earlier segment of storage that may have moved
                    // (a restaged weight, a bound tensor now on this device); the allocator
                    // re-makes it from its source.
                    unsafe { t.detach_storage() };
                }
            }
            let view = graph.view(nodes);
            let vg = view.graph();
            let dev = &mut self.devs[d];
            let need = dev.alloc.measure(&vg) as u64;
            dev.alloc_measured(&self.name, &vg, need, n_stages, &mut self.stats)?;
            let t0 = Instant::now();
            dev.backend.compute(&vg)?;
            self.stats.compute_secs += t0.elapsed().as_secs_f64();
            self.stats.segments += 1;
            for (i, t) in a.bound.iter().enumerate() {
                if a.produced_in(*t).is_some_and(|p| st.segments.contains(&p)) {
                    bound[i].valid[d] = true;
                    // SAFETY: computed by this stage; later stages only read it.
                    unsafe { t.sever_operands() };
                }
            }
            if w.is_disk_home() {
                for gi in loaded {
                    w.evict_group(gi);
                    self.stats.evictions += 1;
                }
            }
        }
        self.stats.max_segments = self.stats.max_segments.max(n_stages);
        Ok(())
    }

    /// Allocates each device's cut buffer (a slot for every bound tensor a stage on it produces
    /// or reads; graph inputs on the device of their first reader) and points every bound
    /// tensor at the slot on the device that writes it first.
    fn bind(&mut self, a: &Analysis<'_>, stages: &[Stage], reads: &[Vec<usize>]) -> Result<Vec<Bound>> {
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
        for (k, r) in reads.iter().enumerate() {
            for &i in r {
                needs[i][stages[k].device] = true;
            }
        }
        let mut bound: Vec<Bound> = (0..a.bound.len())
            .map(|i| Bound { at: first_at[i], valid: vec![false; n_dev], slot: vec![None; n_dev] })
            .collect();
        for (d, dev) in self.devs.iter_mut().enumerate() {
            let mut off = 0usize;
            for (i, t) in a.bound.iter().enumerate() {
                if needs[i][d] {
                    bound[i].slot[d] = Some(off);
                    off += slot(dev.buft, *t);
                }
            }
            if off > 0 {
                dev.alloc_cut_buffer(&self.name, off as u64)?;
            }
        }
        for (i, t) in a.bound.iter().enumerate() {
            let d = bound[i].at;
            if let (Some(off), Some((buf, _))) = (bound[i].slot[d], self.devs[d].cut_buffer.as_ref()) {
                if !t.is_allocated() {
                    // SAFETY: the cut buffer stays in `devs[d]` until the next run or the
                    // runner's drop, past every use this run makes of the tensor (`run`'s
                    // contract); slots are disjoint and inside it.
                    unsafe { t.place_in(buf, off)? };
                }
            }
            // Inputs are written by `set_inputs` where they point now; outputs where computed.
            bound[i].valid[d] = a.produced_in(*t).is_none();
        }
        Ok(bound)
    }

    /// Points the bound tensors stage `d` reads at device `d`'s slots, copying the bytes of
    /// those it does not hold yet.
    fn move_inputs(&mut self, a: &Analysis<'_>, reads: &[usize], d: usize, bound: &mut [Bound]) -> Result<()> {
        for &i in reads {
            let b = &mut bound[i];
            if b.at == d {
                continue;
            }
            let t = a.bound[i];
            let Some(off) = b.slot[d] else {
                return Err(SchedError::Invalid(format!("{}: no slot for `{}` on device {d}", self.name, t.name())));
            };
            let Some((buf, _)) = self.devs[d].cut_buffer.as_ref() else {
                return Err(SchedError::Invalid(format!("{}: no cut buffer on device {d}", self.name)));
            };
            let bytes = if b.valid[d] { None } else { Some(t.read_range(0, t.nbytes())?) };
            // SAFETY: the tensor's bytes were read above (or are already in the new slot);
            // no graph holds the old storage any more (stages run one after another), and
            // the new slot lives in the cut buffer for the rest of the run (`bind`).
            unsafe {
                t.detach_storage();
                t.place_in(buf, off)?;
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

    /// Loads group `gi` onto device `d` for a stage that reads `keep`; when the device's budget
    /// refuses it, evicts this runner's other staged groups there and tries once more.
    fn stage_group(&mut self, w: &Weights, gi: GroupId, d: usize, keep: &HashSet<GroupId>) -> Result<()> {
        let t0 = Instant::now();
        if let Err(e) = w.alloc_group(gi) {
            if !matches!(e, SchedError::OverBudget { .. }) {
                return Err(e);
            }
            for other in w.staged_on(d).into_iter().filter(|g| !keep.contains(g)) {
                w.evict_group(other);
                self.stats.evictions += 1;
            }
            w.alloc_group(gi)?;
        }
        if let Err(e) = w.fill_group(gi) {
            w.evict_group(gi);
            return Err(e);
        }
        self.stats.load_secs += t0.elapsed().as_secs_f64();
        self.stats.loaded_bytes += w.group_bytes(gi);
        Ok(())
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
                if src != root && bound.contains(&(root.as_raw() as usize)) && !is_node_in(graph, src, nodes.clone()) {
                    out.push((s, src));
                }
            }
        }
    }
    out
}

fn is_node_in(graph: &Graph<'_>, t: Tensor<'_>, nodes: Range<usize>) -> bool {
    nodes.into_iter().any(|i| graph.node(i) == t)
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
