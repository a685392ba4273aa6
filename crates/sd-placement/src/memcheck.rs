//! The pre-load memory check of `memory-check.md` (the guide "Image generation memory, logs and limits").
//!
//! estimate = sum of the model files' sizes x 1.25 + 512 MiB. A discrete GPU's figure is its
//! free memory, its total when it reports no free figure, and none when it reports 0 free
//! against a positive total (over its budget). Integrated GPUs are never used: beside a discrete
//! GPU they add nothing, and a model computing on an integrated GPU (or the CPU) is compared
//! with available RAM alone.
//!
//! Verdicts for a model computing on a discrete GPU: `refuse` when the estimate exceeds every
//! discrete GPU's figure plus available RAM (never when RAM is unknown: "Windows does not read
//! system memory, so nothing is refused there"); else `warn` when it exceeds the computing GPU's
//! figure (part of the model stays in system memory, slower); else `ok`. `skipped` when the
//! computing device reports no memory, when RAM is unknown on the CPU path, or with
//! `--no-memory-check`. A plan that keeps every weight on two or more discrete GPUs (none in
//! RAM, none on disk) is compared with those GPUs' figures together: `ok` when they hold the
//! estimate, else `warn` that their memory is short (nothing of the model is in system memory).

use serde::{Deserialize, Serialize};

use crate::device::{Device, DeviceType};
use crate::model::HALF_GIB;
use crate::units::fmt_bytes;

/// The memory check's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The estimate fits the computing device.
    Ok,
    /// Loads, but part of the model stays in system memory: slower.
    Warn,
    /// Must not load: the estimate exceeds every discrete GPU plus available RAM.
    Refuse,
    /// Not checked (no figures, or disabled).
    Skipped,
}

/// The memory check's result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryCheck {
    /// file sizes x 1.25 + 512 MiB.
    pub estimate_bytes: u64,
    /// The verdict.
    pub verdict: Verdict,
    /// The device the model loads on (computes on).
    pub device: Option<String>,
    /// That device's figure (GPU memory, or RAM for CPU / integrated GPU).
    pub device_bytes: Option<u64>,
    /// The figure a refusal compares with (discrete GPUs + RAM, or RAM).
    pub limit_bytes: Option<u64>,
    /// How the figures are made up.
    pub figures: String,
    /// One line for a person.
    pub message: String,
}

/// The estimate for `file_bytes` of model files.
pub fn estimate(file_bytes: u64) -> u64 {
    let scaled = (file_bytes as u128) * 5 / 4 + HALF_GIB as u128;
    u64::try_from(scaled).unwrap_or(u64::MAX)
}

/// A discrete GPU's figure; `None` when it reports no memory.
pub fn gpu_figure(d: &Device) -> Option<u64> {
    match (d.free_bytes, d.total_bytes) {
        (Some(0), Some(t)) if t > 0 => Some(0),
        (Some(f), _) if f > 0 => Some(f),
        (None, Some(t)) if t > 0 => Some(t),
        _ => None,
    }
}

/// A `warn` of [`check`] for a plan whose weights all live on the discrete GPUs `gpus` (name,
/// figure): `ok` when their figures together hold the estimate, else a `warn` saying that
/// their memory, not system memory, is what is short.
pub(crate) fn spread_over_gpus(mc: &mut MemoryCheck, gpus: &[(String, u64)]) {
    if mc.verdict != Verdict::Warn {
        return;
    }
    let sum = gpus.iter().fold(0u64, |a, (_, f)| a.saturating_add(*f));
    let names = gpus.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(" + ");
    if mc.estimate_bytes <= sum {
        mc.verdict = Verdict::Ok;
        mc.message = format!(
            "ok: estimated {} fits {names} ({}), over which the plan places every weight",
            fmt_bytes(mc.estimate_bytes),
            fmt_bytes(sum)
        );
    } else {
        mc.message = format!(
            "warn: estimated {} exceeds {names} ({}), which hold every weight: compute buffers may not fit beside them",
            fmt_bytes(mc.estimate_bytes),
            fmt_bytes(sum)
        );
    }
}

pub(crate) fn check(
    devices: &[Device],
    ram: Option<u64>,
    computing: usize,
    file_bytes: u64,
    disabled: bool,
) -> MemoryCheck {
    let est = estimate(file_bytes);
    let dev = &devices[computing];
    let mut mc = MemoryCheck {
        estimate_bytes: est,
        verdict: Verdict::Skipped,
        device: Some(dev.name.trim().to_string()),
        device_bytes: None,
        limit_bytes: None,
        figures: String::new(),
        message: String::new(),
    };
    if disabled {
        mc.message = "memory check disabled (--no-memory-check)".into();
        return mc;
    }
    if dev.kind == DeviceType::Gpu {
        let Some(fig) = gpu_figure(dev) else {
            mc.message = format!("not checked: {} reports no memory figures", dev.name);
            return mc;
        };
        mc.device_bytes = Some(fig);
        let mut parts = Vec::new();
        let mut sum = 0u64;
        for g in devices.iter().filter(|d| d.kind == DeviceType::Gpu) {
            if let Some(f) = gpu_figure(g) {
                sum = sum.saturating_add(f);
                parts.push(format!("{} {}", g.name.trim(), fmt_bytes(f)));
            }
        }
        if let Some(r) = ram {
            let limit = sum.saturating_add(r);
            parts.push(format!("RAM {}", fmt_bytes(r)));
            mc.limit_bytes = Some(limit);
            mc.figures = parts.join(" + ");
            if est > limit {
                mc.verdict = Verdict::Refuse;
                mc.message = format!(
                    "refuse: estimated {} exceeds every discrete GPU plus available RAM ({} = {})",
                    fmt_bytes(est),
                    mc.figures,
                    fmt_bytes(limit)
                );
                return mc;
            }
        } else {
            mc.figures = parts.join(" + ");
        }
        if est > fig {
            mc.verdict = Verdict::Warn;
            mc.message = format!(
                "warn: estimated {} exceeds {}'s {}: part of the model stays in system memory and generation will be slower",
                fmt_bytes(est),
                dev.name,
                fmt_bytes(fig)
            );
        } else {
            mc.verdict = Verdict::Ok;
            mc.message = format!("ok: estimated {} fits {}'s {}", fmt_bytes(est), dev.name, fmt_bytes(fig));
        }
        return mc;
    }
    // CPU, integrated GPU or accelerator: host memory, compared with available RAM alone.
    let Some(r) = ram else {
        mc.message = format!("not checked: available RAM is unknown ({} uses host memory)", dev.name);
        return mc;
    };
    mc.device_bytes = Some(r);
    mc.limit_bytes = Some(r);
    mc.figures = format!("RAM {}", fmt_bytes(r));
    if est > r {
        mc.verdict = Verdict::Refuse;
        mc.message = format!(
            "refuse: estimated {} exceeds available RAM {} ({} uses host memory)",
            fmt_bytes(est),
            fmt_bytes(r),
            dev.name
        );
    } else {
        mc.verdict = Verdict::Ok;
        mc.message = format!("ok: estimated {} fits available RAM {}", fmt_bytes(est), fmt_bytes(r));
    }
    mc
}
