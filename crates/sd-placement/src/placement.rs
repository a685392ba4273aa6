//! Internal placement of each module (runtime layout + params location) and the per-device
//! accounting shared by auto-fit and explicit plans.
//!
//! Accounting model: a device's need is its resident params, plus space for computation, plus
//! space for weight staging. Modules run one after another (text encoding, sampling, decoding),
//! so compute space is the largest compute reserve of the modules running there (as the
//! reference's auto-fit keeps the maximum reserve per device). Staging is kept for each module
//! running there whose params live elsewhere (CPU, disk, another GPU): its largest tensor, summed
//! over those modules ("staging space for the largest weight tensor of each ... offloaded
//! component"). Row split counts the split tensors' full size on every participating device
//! (the conservative bound of stable-diffusion.cpp's `docs/backend.md`).

use crate::device::Device;
use crate::model::{ComponentSummary, Module};

/// Where a module's params live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Params {
    /// On one device (may differ from the runtime device: offloaded).
    Device(usize),
    /// Reloaded from the model file on demand.
    Disk,
    /// Not assigned: each device of the runtime layout keeps its own part.
    Follow,
}

/// A contiguous block range of a layer split (indices into `ComponentSummary::blocks`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Range {
    pub device: usize,
    pub start: usize,
    pub end: usize,
}

/// How a module executes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    Single(usize),
    /// Ranges in order; the first is the main device's (it also holds non-block tensors).
    Layer(Vec<Range>),
    /// Main device first (the split-buffer row split of a device plugin).
    Row(Vec<usize>),
    /// Graph-level row split: the devices (main first) and each one's share of the split
    /// weights' rows, in parts per million.
    Rows(Vec<usize>, Vec<u32>),
}

impl Layout {
    pub fn devices(&self) -> Vec<usize> {
        match self {
            Layout::Single(d) => vec![*d],
            Layout::Layer(r) => r.iter().map(|r| r.device).collect(),
            Layout::Row(d) | Layout::Rows(d, _) => d.clone(),
        }
    }

    pub fn main(&self) -> usize {
        self.devices()[0]
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    pub module: Module,
    pub layout: Layout,
    pub params: Params,
}

/// What one device holds and needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub params: u64,
    pub compute: u64,
    pub staging: u64,
}

impl Usage {
    pub fn total(self) -> u64 {
        self.params.saturating_add(self.compute).saturating_add(self.staging)
    }
}

fn range_bytes(s: &ComponentSummary, r: &Range) -> (u64, u64) {
    let blocks = &s.blocks[r.start..r.end];
    let bytes = blocks.iter().fold(0u64, |a, b| a.saturating_add(b.bytes));
    let largest = blocks.iter().map(|b| b.largest_tensor).max().unwrap_or(0);
    (bytes, largest)
}

/// The compute reserve of `p` on each of its runtime devices. A layer-split module with
/// `copies` pipeline copies keeps `copies` micro-batches in flight, each device holding a copy
/// of its cross-device inputs and a compute buffer per copy: the reserve is `copies` times the
/// module's (conservative: a micro-batch is smaller than the whole batch). Other layouts do not
/// pipeline and keep one reserve.
pub(crate) fn reserve(s: &ComponentSummary, p: &Placement, copies: u32) -> u64 {
    let r = s.compute_reserve;
    match p.layout {
        Layout::Layer(_) => r.saturating_mul(u64::from(copies.max(1))),
        _ => r,
    }
}

/// Per-device usage of a set of placements (`copies`: the pipeline copy count, see [`reserve`]).
pub(crate) fn account(
    summaries: &[ComponentSummary],
    placements: &[Placement],
    n_devices: usize,
    copies: u32,
) -> Vec<Usage> {
    let mut usage = vec![Usage::default(); n_devices];
    let add_params = |usage: &mut Vec<Usage>, d: usize, b: u64| {
        usage[d].params = usage[d].params.saturating_add(b);
    };
    // `phase(d, reserve, staging)`: a module computing on `d`.
    let phase = |usage: &mut Vec<Usage>, d: usize, r: u64, staging: u64| {
        usage[d].compute = usage[d].compute.max(r);
        usage[d].staging = usage[d].staging.saturating_add(staging);
    };
    for p in placements {
        let Some(s) = summaries.iter().find(|s| s.module == p.module) else {
            continue;
        };
        let r = reserve(s, p, copies);
        match &p.layout {
            Layout::Single(rt) => match p.params {
                Params::Device(d) if d != *rt => {
                    add_params(&mut usage, d, s.param_bytes);
                    phase(&mut usage, *rt, r, s.largest_tensor);
                }
                Params::Disk => phase(&mut usage, *rt, r, s.largest_tensor),
                _ => {
                    add_params(&mut usage, *rt, s.param_bytes);
                    phase(&mut usage, *rt, r, 0);
                }
            },
            Layout::Layer(ranges) => {
                for (i, range) in ranges.iter().enumerate() {
                    let (mut bytes, mut largest) = range_bytes(s, range);
                    if i == 0 {
                        bytes = bytes.saturating_add(s.non_block_bytes);
                        largest = largest.max(s.largest_non_block);
                    }
                    let dev = range.device;
                    match p.params {
                        Params::Follow => {
                            add_params(&mut usage, dev, bytes);
                            phase(&mut usage, dev, r, 0);
                        }
                        Params::Device(d) if d == dev => phase(&mut usage, dev, r, 0),
                        _ => phase(&mut usage, dev, r, largest),
                    }
                }
                if let Params::Device(d) = p.params {
                    add_params(&mut usage, d, s.param_bytes);
                }
            }
            Layout::Rows(devs, ppm) => {
                // Conservative: the main device keeps every tensor (the planner does not know
                // which block tensors are matmul weights); the others their share of the blocks.
                let block_bytes = s.param_bytes.saturating_sub(s.non_block_bytes);
                for (i, (&d, &share)) in devs.iter().zip(ppm).enumerate() {
                    let bytes = if i == 0 { s.param_bytes } else { rows_share(block_bytes, share) };
                    add_params(&mut usage, d, bytes);
                    phase(&mut usage, d, r, 0);
                }
            }
            Layout::Row(devs) => {
                let split_bytes = s.param_bytes.saturating_sub(s.non_block_bytes);
                for &d in devs {
                    add_params(&mut usage, d, split_bytes);
                    phase(&mut usage, d, r, 0);
                }
                let main = devs[0];
                match p.params {
                    Params::Device(d) if !devs.contains(&d) => {
                        add_params(&mut usage, d, s.param_bytes);
                        phase(&mut usage, main, r, s.largest_non_block);
                    }
                    Params::Disk => phase(&mut usage, main, r, s.largest_non_block),
                    _ => add_params(&mut usage, main, s.non_block_bytes),
                }
            }
        }
    }
    usage
}

/// Device names for output.
pub(crate) fn names(devices: &[Device], idx: &[usize]) -> Vec<String> {
    idx.iter().map(|&i| devices[i].name.trim().to_string()).collect()
}

/// `share` parts per million of `bytes`.
pub(crate) fn rows_share(bytes: u64, share: u32) -> u64 {
    (u128::from(bytes) * u128::from(share) / 1_000_000) as u64
}
