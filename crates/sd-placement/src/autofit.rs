//! Auto-fit: stable-diffusion.cpp's `docs/backend.md` "Automatic placement", as a sequential first-fit over components.
//!
//! One GPU computes everything: the discrete GPU with the largest budget (the first on a tie).
//! Components are taken in priority order (diffusion, te, vae, then the other modules) and each
//! one's weights go to the first location with room:
//!
//! 1. the main GPU, keeping room for computation (the largest compute reserve: phases run one
//!    after another), staging space for the largest tensor of each component that is offloaded or
//!    of lower priority (it may still be offloaded), and, when a higher-priority component is
//!    already offloaded, its full weights plus its compute reserve ("Before a lower-priority
//!    component can become permanently resident, the planner leaves room for the full weights
//!    and estimated compute space of higher-priority offloaded components");
//! 2. CPU RAM, keeping max(2 GiB, 10% of available RAM) free; skipped when RAM is unknown;
//! 3. another GPU with the largest remaining budget that holds the whole component (weights
//!    only: they are copied to the main GPU to run);
//! 4. disk.
//!
//! The plan's per-device accounting (`placement::account`) uses the same model, so a component
//! auto-fit makes resident never pushes the main GPU over its budget. With no discrete GPU everything computes on the CPU with params in RAM when they fit (same reserve),
//! otherwise on disk.

use crate::budget::Budget;
use crate::device::{Device, DeviceType};
use crate::model::{ComponentSummary, Module};
use crate::placement::{Layout, Params, Placement};
use crate::units::fmt_bytes;
use crate::GIB;

/// RAM auto-fit keeps free for other work: the larger of 2 GiB or 10% of available RAM.
pub fn ram_reserve(available: u64) -> u64 {
    (2 * GIB).max(available / 10)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loc {
    Main,
    Ram,
    Gpu(usize),
    Disk,
}

pub(crate) struct AutoFit {
    pub placements: Vec<Placement>,
    /// The computing device (main GPU, or the CPU).
    pub main: usize,
}

/// Summaries in auto-fit priority order.
fn by_priority(summaries: &[ComponentSummary]) -> Vec<&ComponentSummary> {
    Module::PRIORITY.iter().filter_map(|m| summaries.iter().find(|s| s.module == *m)).collect()
}

/// Room the computing device must keep beside its resident params while component `i` is
/// decided (`decided` holds the decisions for `0..i`): the largest compute reserve (or, with
/// `full_for_offloaded`, the full weights plus reserve of a higher-priority offloaded component,
/// if larger) plus staging space for the largest tensor of every component that is offloaded or
/// not yet decided (and so may still be offloaded).
fn room(comps: &[&ComponentSummary], decided: &[Loc], i: usize, full_for_offloaded: bool) -> u64 {
    let mut compute = 0u64;
    let mut staging = 0u64;
    for (k, c) in comps.iter().enumerate() {
        let r = c.compute_reserve;
        compute = compute.max(r);
        let offloaded_or_open = match decided.get(k) {
            Some(Loc::Main) => false,
            Some(_) => {
                if full_for_offloaded && k < i {
                    // Full weights: the staging slot below already holds the largest tensor.
                    let rest = c.param_bytes.saturating_sub(c.largest_tensor);
                    compute = compute.max(r.saturating_add(rest));
                }
                true
            }
            None => k != i,
        };
        if offloaded_or_open {
            staging = staging.saturating_add(c.largest_tensor);
        }
    }
    compute.saturating_add(staging)
}

pub(crate) fn auto_fit(
    summaries: &[ComponentSummary],
    devices: &[Device],
    budgets: &[Budget],
    ram: Option<u64>,
    cpu: usize,
    warnings: &mut Vec<String>,
) -> AutoFit {
    let comps = by_priority(summaries);
    let gpus: Vec<usize> = (0..devices.len()).filter(|&i| devices[i].kind == DeviceType::Gpu).collect();

    // Main GPU: largest known budget, first on a tie; with no known budget, the first GPU.
    let mut main: Option<usize> = None;
    for &g in &gpus {
        if let Some(b) = budgets[g].bytes {
            if main.is_none_or(|m| budgets[m].bytes.is_none_or(|mb| b > mb)) {
                main = Some(g);
            }
        }
    }
    let main = main.or_else(|| gpus.first().copied());

    let Some(main) = main else {
        return cpu_only(&comps, devices, ram, cpu, warnings);
    };

    let ram_cap = ram.map(|r| r.saturating_sub(ram_reserve(r)));
    let mut decided: Vec<Loc> = Vec::with_capacity(comps.len());
    let mut resident = 0u64;
    let mut ram_used = 0u64;
    let mut stored = vec![0u64; devices.len()];
    for (i, c) in comps.iter().enumerate() {
        let p = c.param_bytes;
        let on_main = match budgets[main].bytes {
            None => true,
            Some(b) => resident.saturating_add(p).saturating_add(room(&comps, &decided, i, true)) <= b,
        };
        let loc = if on_main {
            resident = resident.saturating_add(p);
            Loc::Main
        } else if ram_cap.is_some_and(|cap| ram_used.saturating_add(p) <= cap) {
            ram_used = ram_used.saturating_add(p);
            Loc::Ram
        } else {
            let mut best: Option<(usize, u64)> = None;
            for &g in &gpus {
                if g == main {
                    continue;
                }
                let Some(b) = budgets[g].bytes else { continue };
                let remaining = b.saturating_sub(stored[g]);
                if p <= remaining && best.is_none_or(|(_, r)| remaining > r) {
                    best = Some((g, remaining));
                }
            }
            match best {
                Some((g, _)) => {
                    stored[g] = stored[g].saturating_add(p);
                    Loc::Gpu(g)
                }
                None => Loc::Disk,
            }
        };
        decided.push(loc);
    }

    if budgets[main].bytes.is_none() {
        warnings.push(format!(
            "auto-fit: {} reports no memory figures; every component is planned resident on it unchecked",
            devices[main].name
        ));
    } else if let Some(b) = budgets[main].bytes {
        let min_need = resident.saturating_add(room(&comps, &decided, comps.len(), false));
        if min_need > b {
            warnings.push(format!(
                "auto-fit: main GPU {} has a budget of {} but computing needs at least {} (compute reserve and staging); \
                 auto-fit does not move computation to the CPU: lower the resolution, free VRAM or use --backend",
                devices[main].name,
                fmt_bytes(b),
                fmt_bytes(min_need)
            ));
        }
    }
    if devices.iter().any(|d| d.kind == DeviceType::Igpu) {
        warnings
            .push("auto-fit uses discrete GPUs only; an integrated GPU is used only when named in --backend".into());
    }

    let placements = comps
        .iter()
        .zip(&decided)
        .map(|(c, loc)| Placement {
            module: c.module,
            layout: Layout::Single(main),
            params: match loc {
                Loc::Main => Params::Device(main),
                Loc::Ram => Params::Device(cpu),
                Loc::Gpu(g) => Params::Device(*g),
                Loc::Disk => Params::Disk,
            },
        })
        .collect();
    AutoFit { placements, main }
}

/// No discrete GPU: compute on the CPU; params in RAM when they fit, else on disk.
fn cpu_only(
    comps: &[&ComponentSummary],
    devices: &[Device],
    ram: Option<u64>,
    cpu: usize,
    warnings: &mut Vec<String>,
) -> AutoFit {
    if devices.iter().any(|d| d.kind == DeviceType::Igpu) {
        warnings.push(
            "auto-fit: no discrete GPU; computing on the CPU (name an integrated GPU in --backend to use it)".into(),
        );
    }
    // `Main` here means resident in RAM next to the CPU runtime.
    let mut decided: Vec<Loc> = Vec::with_capacity(comps.len());
    match ram {
        None => {
            warnings
                .push("auto-fit: available RAM is unknown; params stay in RAM with the CPU runtime, unchecked".into());
            decided = vec![Loc::Main; comps.len()];
        }
        Some(r) => {
            let cap = r.saturating_sub(ram_reserve(r));
            let mut used = 0u64;
            for (i, c) in comps.iter().enumerate() {
                let cand = used.saturating_add(c.param_bytes);
                let fits = cand <= cap && cand.saturating_add(room(comps, &decided, i, false)) <= r;
                if fits {
                    used = cand;
                    decided.push(Loc::Main);
                } else {
                    decided.push(Loc::Disk);
                }
            }
        }
    }
    let placements = comps
        .iter()
        .zip(&decided)
        .map(|(c, loc)| Placement {
            module: c.module,
            layout: Layout::Single(cpu),
            params: if *loc == Loc::Disk { Params::Disk } else { Params::Device(cpu) },
        })
        .collect();
    AutoFit { placements, main: cpu }
}
