//! Layer split: contiguous block ranges sized in proportion to each device's memory.
//!
//! stable-diffusion.cpp's `docs/backend.md`: "The module's transformer blocks are then distributed across the listed devices
//! in contiguous ranges sized proportionally to each device's free memory (minus a compute-buffer
//! headroom of about 2 GiB per device)". A device's basis is its `--max-vram` budget when one is
//! given for it ("--max-vram can still provide the per-device limits used by layer split"), else
//! its free memory. As in the reference, the headroom never takes more than 7/8 of the basis
//! (weight = max(basis - 2 GiB, basis / 8)), so a small device still gets a share. Range sizes are
//! measured in block bytes; each boundary is the block boundary closest to its proportional target.

use crate::budget::Budget;
use crate::device::Device;
use crate::GIB;

/// Split weight of each device.
pub(crate) fn weights(devices: &[Device], budgets: &[Budget], listed: &[usize]) -> Vec<f64> {
    let raw: Vec<Option<f64>> = listed
        .iter()
        .map(|&i| {
            let basis = if budgets[i].explicit { budgets[i].bytes } else { devices[i].free_figure() };
            basis.map(|b| b.saturating_sub(2 * GIB).max(b / 8) as f64)
        })
        .collect();
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
