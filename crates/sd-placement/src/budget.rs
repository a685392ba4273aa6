//! Per-device planning budgets from `--max-vram` (stable-diffusion.cpp's `docs/performance.md` and `docs/backend.md` semantics).
//!
//! A positive value is a managed budget in GiB (capped by free memory, since "live free memory
//! can lower the effective limit"); `0` is the device's current free memory; a negative value is
//! free memory minus that many GiB; with no value the planner uses free memory minus 512 MiB.
//! "Free memory" is the reported free figure, or the total when no free figure is reported. The
//! CPU's budget is the available system RAM; `--max-vram` does not apply to it.

use serde::{Deserialize, Serialize};

use crate::device::{resolve_device, Device, DeviceType};
use crate::error::{Flag, PlanError};
use crate::model::HALF_GIB;
use crate::spec::MaxVram;
use crate::units::fmt_bytes;
use crate::GIB;

/// Which rule produced a budget.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "rule", content = "gib")]
pub enum BudgetRule {
    /// Positive `--max-vram`: a managed budget of that many GiB.
    Managed(f64),
    /// `--max-vram 0`: current free memory.
    Free,
    /// Negative `--max-vram`: free memory minus that many GiB.
    FreeMinus(f64),
    /// No `--max-vram`: free memory minus 512 MiB.
    FreeMinusMargin,
    /// The CPU: available system RAM.
    Ram,
}

impl BudgetRule {
    /// Short human-readable description.
    pub fn describe(self) -> String {
        match self {
            BudgetRule::Managed(g) => format!("--max-vram {g}"),
            BudgetRule::Free => "free (--max-vram 0)".to_string(),
            BudgetRule::FreeMinus(g) => format!("free - {g} GiB"),
            BudgetRule::FreeMinusMargin => "free - 512 MiB".to_string(),
            BudgetRule::Ram => "available RAM".to_string(),
        }
    }
}

/// A device's resolved budget.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Budget {
    /// Bytes the plan may use; `None` when the device reports no memory and no positive
    /// `--max-vram` names it (usage there is not checked).
    pub bytes: Option<u64>,
    pub rule: BudgetRule,
    /// Whether `--max-vram` gave a value for this device (explicitly or as the default).
    pub explicit: bool,
}

pub(crate) fn gib_to_bytes(gib: f64) -> u64 {
    // `as` saturates: huge values become u64::MAX, NaN cannot occur (parse rejects it).
    (gib.abs() * GIB as f64) as u64
}

/// Resolves every device's budget. Errors on a `--max-vram` key naming no device.
pub(crate) fn resolve_budgets(
    devices: &[Device],
    ram: Option<u64>,
    max_vram: &MaxVram,
    warnings: &mut Vec<String>,
) -> Result<Vec<Budget>, PlanError> {
    let mut per_device: Vec<Option<f64>> = vec![None; devices.len()];
    for e in &max_vram.devices {
        let (key, gib) = &e.value;
        let i = resolve_device(devices, key, Flag::MaxVram, &e.entry)?;
        if devices[i].kind == DeviceType::Cpu {
            warnings.push(format!(
                "--max-vram entry '{}' names the CPU: --max-vram limits device memory; the CPU is planned with available RAM",
                e.entry
            ));
            continue;
        }
        per_device[i] = Some(*gib);
    }
    let mut out = Vec::with_capacity(devices.len());
    for (d, own) in devices.iter().zip(per_device) {
        if d.kind == DeviceType::Cpu {
            out.push(Budget { bytes: ram, rule: BudgetRule::Ram, explicit: false });
            continue;
        }
        let value = own.or(max_vram.default);
        let free = d.free_figure();
        let (bytes, rule) = match value {
            Some(v) if v > 0.0 => {
                let managed = gib_to_bytes(v);
                let bytes = match free {
                    Some(f) if f < managed => {
                        warnings.push(format!(
                            "--max-vram gives {} {} but it has {} free; planning with the free memory",
                            d.name,
                            fmt_bytes(managed),
                            fmt_bytes(f)
                        ));
                        f
                    }
                    _ => managed,
                };
                (Some(bytes), BudgetRule::Managed(v))
            }
            Some(v) if v < 0.0 => (free.map(|f| f.saturating_sub(gib_to_bytes(v))), BudgetRule::FreeMinus(-v)),
            Some(_) => (free, BudgetRule::Free),
            None => (free.map(|f| f.saturating_sub(HALF_GIB)), BudgetRule::FreeMinusMargin),
        };
        if bytes.is_none() {
            warnings.push(format!(
                "{} reports no memory figures: its usage is not checked (give --max-vram {}=GiB to plan with a budget)",
                d.name, d.name
            ));
        }
        out.push(Budget { bytes, rule, explicit: value.is_some() });
    }
    Ok(out)
}
