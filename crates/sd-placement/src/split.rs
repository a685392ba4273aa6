//! Layer split: contiguous block ranges sized in proportion to each device's memory, or by speed.
//!
//! stable-diffusion.cpp's `docs/backend.md`: "The module's transformer blocks are then distributed across the listed devices
//! in contiguous ranges sized proportionally to each device's free memory (minus a compute-buffer
//! headroom of about 2 GiB per device)". A device's basis is its `--max-vram` budget when one is
//! given for it ("--max-vram can still provide the per-device limits used by layer split"), else
//! its free memory; the CPU's basis is the available RAM (its planning budget: `--max-vram` does
//! not apply to it). As in the reference, the headroom never takes more than 7/8 of the basis
//! (weight = max(basis - 2 GiB, basis / 8)), so a small device still gets a share. Range sizes are
//! measured in block bytes; each boundary is the block boundary closest to its proportional target.
//!
//! `--split-by speed` (ours: no peer sizes a split by speed) uses a time model: device `d`
//! evaluates weights at `speed(d)` bytes of block weights per second, the main device also
//! evaluating the non-block tensors. Each range must fit its device's planning budget (free
//! memory less 512 MiB, or `--max-vram`; the available RAM for the CPU) less the module's compute
//! reserve times the pipeline copy count ([`speed_cap`]): the budget the plan's own accounting
//! checks, rather than the memory split's proportional weight, so that a speed-sized split of a
//! device holding nothing else always fits it. A layer
//! split runs its ranges one after another, so one evaluation takes the SUM of the range times
//! whatever the sizing; only with pipelining (`--pipeline-copies` > 1, micro-batches overlapping
//! across the devices) is the time per micro-batch bounded by the slowest range, and that is
//! what [`partition_by_speed`] minimises (equal finish times), breaking ties by the smallest sum.

use crate::budget::Budget;
use crate::device::{Device, DeviceType};
use crate::GIB;

/// Split weight of device `i` in bytes: its memory basis less the headroom (at most 7/8 of it);
/// `None` when the basis is unknown.
pub(crate) fn basis_weight(devices: &[Device], budgets: &[Budget], i: usize) -> Option<u64> {
    let basis = if devices[i].kind == DeviceType::Cpu {
        budgets[i].bytes.or(devices[i].free_figure())
    } else if budgets[i].explicit {
        budgets[i].bytes
    } else {
        devices[i].free_figure()
    };
    basis.map(|b| b.saturating_sub(2 * GIB).max(b / 8))
}

/// The most bytes of a speed-sized range on device `i`: its planning budget less `reserve`
/// (the module's compute reserve times the pipeline copies); `None` when the budget is unknown.
pub(crate) fn speed_cap(budgets: &[Budget], i: usize, reserve: u64) -> Option<u64> {
    budgets[i].bytes.map(|b| b.saturating_sub(reserve))
}

/// Split weight of each device.
pub(crate) fn weights(devices: &[Device], budgets: &[Budget], listed: &[usize]) -> Vec<f64> {
    let raw: Vec<Option<f64>> = listed.iter().map(|&i| basis_weight(devices, budgets, i).map(|w| w as f64)).collect();
    let known: Vec<f64> = raw.iter().flatten().copied().filter(|w| *w > 0.0).collect();
    let fill = if known.is_empty() { 1.0 } else { known.iter().sum::<f64>() / known.len() as f64 };
    let w: Vec<f64> = raw.iter().map(|w| w.unwrap_or(fill)).collect();
    if w.iter().all(|x| *x <= 0.0) {
        vec![1.0; w.len()]
    } else {
        w
    }
}

/// Splits blocks (their byte sizes, in order) into `weights.len()` contiguous ranges
/// `(start, end)` (end exclusive) covering all blocks, sized in proportion to `weights`.
pub fn partition(blocks: &[u64], weights: &[f64]) -> Vec<(usize, usize)> {
    let n = weights.len();
    let nb = blocks.len();
    let mut cum = Vec::with_capacity(nb + 1);
    cum.push(0u128);
    for b in blocks {
        let last = *cum.last().unwrap_or(&0);
        cum.push(last + *b as u128);
    }
    let total = *cum.last().unwrap_or(&0) as f64;
    let wsum: f64 = weights.iter().sum();
    let mut out = Vec::with_capacity(n);
    let mut start = 0usize;
    let mut acc = 0.0f64;
    for (i, w) in weights.iter().enumerate() {
        let end = if i + 1 == n {
            nb
        } else {
            acc += w;
            let target = total * (acc / wsum);
            let mut best = start;
            let mut best_d = f64::INFINITY;
            for (j, c) in cum.iter().enumerate().skip(start) {
                let d = (*c as f64 - target).abs();
                if d < best_d {
                    best_d = d;
                    best = j;
                }
            }
            best
        };
        out.push((start, end));
        start = end;
    }
    out
}

/// Splits blocks (their byte sizes, in order) into `speeds.len()` contiguous, non-empty ranges
/// `(start, end)` (end exclusive) covering all blocks, so that the slowest range takes as little
/// time as possible (the devices finish together), among those the sum of the times is least.
/// Range `k` takes `(bytes of its blocks + (lead_bytes if k == 0)) / speeds[k]` seconds and must
/// hold at most `caps[k]` bytes (`None`: no limit), the main range's `lead_bytes` included.
/// `None` when there are fewer blocks than devices, a speed is not positive and finite, or no
/// partition fits the caps. Ties go to the earliest boundaries (deterministic).
pub fn partition_by_speed(
    blocks: &[u64],
    lead_bytes: u64,
    speeds: &[f64],
    caps: &[Option<u64>],
) -> Option<Vec<(usize, usize)>> {
    let (k_n, n) = (speeds.len(), blocks.len());
    if k_n == 0 || n < k_n || caps.len() != k_n || speeds.iter().any(|s| !s.is_finite() || *s <= 0.0) {
        return None;
    }
    let mut cum = vec![0u128; n + 1];
    for (j, b) in blocks.iter().enumerate() {
        cum[j + 1] = cum[j] + *b as u128;
    }
    // Time of range k over blocks i..j, or None when it breaks device k's cap.
    let time = |k: usize, i: usize, j: usize| -> Option<f64> {
        let bytes = cum[j] - cum[i] + if k == 0 { lead_bytes as u128 } else { 0 };
        match caps[k] {
            Some(c) if bytes > c as u128 => None,
            _ => Some(bytes as f64 / speeds[k]),
        }
    };
    // Dynamic programme over (range k, end j); `combine` folds the prefix value with range k's
    // time. First pass: the least maximum; second: the least sum with every range under it.
    let solve = |combine: &dyn Fn(f64, f64) -> Option<f64>| -> Option<(f64, Vec<(usize, usize)>)> {
        let mut best = vec![vec![None::<(f64, usize)>; n + 1]; k_n];
        // Range k ends at j in (k + 1)..=n - (k_n - 1 - k): every range keeps at least one block.
        for (j, cell) in best[0].iter_mut().enumerate().take(n - (k_n - 1) + 1).skip(1) {
            *cell = time(0, 0, j).and_then(|t| combine(f64::NEG_INFINITY, t)).map(|v| (v, 0));
        }
        for k in 1..k_n {
            for j in (k + 1)..=n - (k_n - 1 - k) {
                let mut cell: Option<(f64, usize)> = None;
                for (i, prefix) in best[k - 1].iter().enumerate().take(j).skip(k) {
                    let Some((prev, _)) = *prefix else { continue };
                    let Some(v) = time(k, i, j).and_then(|t| combine(prev, t)) else { continue };
                    if cell.is_none_or(|(c, _)| v < c) {
                        cell = Some((v, i));
                    }
                }
                best[k][j] = cell;
            }
        }
        let (value, _) = best[k_n - 1][n]?;
        let mut out = vec![(0, 0); k_n];
        let mut end = n;
        for k in (0..k_n).rev() {
            let (_, start) = best[k][end]?;
            out[k] = (start, end);
            end = start;
        }
        Some((value, out))
    };
    let (slowest, _) = solve(&|prev, t| Some(prev.max(t)))?;
    let limit = slowest * (1.0 + 1e-9);
    let first = |prev: f64| if prev == f64::NEG_INFINITY { 0.0 } else { prev };
    solve(&|prev, t| (t <= limit).then_some(first(prev) + t)).map(|(_, r)| r)
}
