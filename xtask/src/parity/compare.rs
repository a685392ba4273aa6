//! Comparisons: how far two outputs are apart, the tolerances they must meet, the report rows.

use anyhow::{bail, Result};

use super::*;

/// How far two outputs are apart, and the scale of the reference.
#[derive(Clone, Debug, PartialEq)]
pub struct Diff {
    /// Number of values compared.
    pub n: usize,
    /// max |ours - ref|.
    pub max_abs: f64,
    /// mean |ours - ref|.
    pub mean_abs: f64,
    /// sqrt(mean (ours - ref)^2).
    pub rms: f64,
    /// max |ref|.
    pub ref_max_abs: f64,
    /// Standard deviation of the reference values.
    pub ref_std: f64,
    /// sqrt(mean ref^2).
    pub ref_rms: f64,
    /// Values that are NaN or infinite, in either output.
    pub non_finite: usize,
}

impl Diff {
    /// Compares `ours` with `reference` element by element (same length required).
    pub fn of(ours: &[f64], reference: &[f64]) -> Result<Diff> {
        if ours.len() != reference.len() || ours.is_empty() {
            bail!("cannot compare {} values with {}", ours.len(), reference.len());
        }
        let n = ours.len();
        let (mut max_abs, mut sum_abs, mut sum_sq) = (0.0f64, 0.0f64, 0.0f64);
        let (mut ref_max_abs, mut ref_sum, mut ref_sq) = (0.0f64, 0.0f64, 0.0f64);
        let mut non_finite = 0;
        for (&a, &b) in ours.iter().zip(reference) {
            if !a.is_finite() || !b.is_finite() {
                non_finite += 1;
                continue;
            }
            let d = (a - b).abs();
            max_abs = max_abs.max(d);
            sum_abs += d;
            sum_sq += d * d;
            ref_max_abs = ref_max_abs.max(b.abs());
            ref_sum += b;
            ref_sq += b * b;
        }
        let nf = n as f64;
        let mean = ref_sum / nf;
        Ok(Diff {
            n,
            max_abs,
            mean_abs: sum_abs / nf,
            rms: (sum_sq / nf).sqrt(),
            ref_max_abs,
            ref_std: (ref_sq / nf - mean * mean).max(0.0).sqrt(),
            ref_rms: (ref_sq / nf).sqrt(),
            non_finite,
        })
    }

    /// rms(ours - ref) / rms(ref).
    pub fn rel_rms(&self) -> f64 {
        if self.ref_rms > 0.0 {
            self.rms / self.ref_rms
        } else {
            f64::INFINITY
        }
    }

    /// max|ours - ref| / max|ref|.
    pub fn rel_max(&self) -> f64 {
        if self.ref_max_abs > 0.0 {
            self.max_abs / self.ref_max_abs
        } else {
            f64::INFINITY
        }
    }
}

/// What a comparison must satisfy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Tolerance {
    /// Tensors: relative errors (see the module doc).
    Relative { rel_rms: f64, rel_max: f64 },
    /// 8-bit images: absolute, in levels.
    Levels { mean: f64, max: f64 },
}

impl Tolerance {
    /// The bound for a path with `n` f16 rounding points: `4 u sqrt(n)` / `8 u sqrt(n)`.
    pub fn rounding_points(n: u32) -> Tolerance {
        let r = F16_U * f64::from(n).sqrt();
        Tolerance::Relative { rel_rms: 4.0 * r, rel_max: 8.0 * r }
    }

    /// The PNG bound: mean <= 1/255, max <= 8/255.
    pub const PNG: Tolerance = Tolerance::Levels { mean: 1.0, max: 8.0 };

    /// Whether `d` is within this tolerance (never with non-finite values).
    pub fn accepts(&self, d: &Diff) -> bool {
        if d.non_finite > 0 {
            return false;
        }
        match *self {
            Tolerance::Relative { rel_rms, rel_max } => d.rel_rms() <= rel_rms && d.rel_max() <= rel_max,
            Tolerance::Levels { mean, max } => d.mean_abs <= mean && d.max_abs <= max,
        }
    }

    pub(crate) fn describe(&self) -> String {
        match *self {
            Tolerance::Relative { rel_rms, rel_max } => {
                format!("rel_rms<={rel_rms:.1e} rel_max<={rel_max:.1e}")
            }
            Tolerance::Levels { mean, max } => format!("mean<={mean} max<={max} levels"),
        }
    }
}

/// One f32 output against the reference's under a tolerance, as the one-tensor checks
/// (`parity-flux`, `parity-flux-vae`, `parity-t5`) print it.
pub(crate) struct Verdict {
    /// Whether the output is within the tolerance.
    pub(crate) pass: bool,
    /// The figures: relative errors, the largest difference, the reference's scale, the bound.
    pub(crate) figures: String,
}

impl Verdict {
    pub(crate) fn of(ours: &[f32], reference: &[f32], tol: Tolerance) -> Result<Verdict> {
        let d = Diff::of(&to_f64(ours), &to_f64(reference))?;
        let figures = format!(
            "rel_rms {:.2e} rel_max {:.2e} (max|d| {:.3e}, ref max {:.3e}; {})",
            d.rel_rms(),
            d.rel_max(),
            d.max_abs,
            d.ref_max_abs,
            tol.describe()
        );
        Ok(Verdict { pass: tol.accepts(&d), figures })
    }

    /// `PASS` or `FAIL`.
    pub(crate) fn word(&self) -> &'static str {
        if self.pass {
            "PASS"
        } else {
            "FAIL"
        }
    }
}

/// Rounding points per module (counted in the module doc).
pub(super) const CLIP_L_POINTS: u32 = 48;
pub(super) const CLIP_H_POINTS: u32 = 92;
/// OpenCLIP ViT-bigG/14 (SDXL): 4 per layer, all 32 (clip skip 1 at most).
pub(super) const BIGG_POINTS: u32 = 128;
/// bigG's pooled output: every layer and the text projection.
pub(super) const BIGG_POOLED_POINTS: u32 = 129;
pub(crate) const UNET_POINTS: u32 = 202;
pub(crate) const VAE_POINTS: u32 = 36;

/// One line of the report.
#[derive(Debug)]
pub(crate) struct Row {
    pub family: &'static str,
    pub what: String,
    pub shape: String,
    pub diff: Diff,
    pub tol: Tolerance,
}

impl Row {
    pub fn pass(&self) -> bool {
        self.tol.accepts(&self.diff)
    }

    /// An image row with both programs' wall times.
    pub fn print_timed(&self, ref_s: f64, ours_s: f64) {
        let d = &self.diff;
        println!(
            "{:<30} mean|d| {:<7.3} max|d| {:<4} (levels){}  sdref {:>5.1} s  sd-cli {:>5.1} s  {}",
            self.what,
            d.mean_abs,
            d.max_abs,
            if d.non_finite > 0 { format!(" NON-FINITE {}", d.non_finite) } else { String::new() },
            ref_s,
            ours_s,
            if self.pass() { "PASS" } else { "FAIL" }
        );
    }

    pub(super) fn print(&self) {
        let d = &self.diff;
        println!(
            "{:<5} {:<16} {:<14} max|d| {:<9.3e} mean|d| {:<9.3e} max|ref| {:<9.3e} std(ref) {:<9.3e} rel_rms {:<9.3e} rel_max {:<9.3e}{} [{}] {}",
            self.family,
            self.what,
            self.shape,
            d.max_abs,
            d.mean_abs,
            d.ref_max_abs,
            d.ref_std,
            d.rel_rms(),
            d.rel_max(),
            if d.non_finite > 0 { format!(" NON-FINITE {}", d.non_finite) } else { String::new() },
            self.tol.describe(),
            if self.pass() { "PASS" } else { "FAIL" }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diff_statistics_match_hand_computed_values() {
        // ref = [1, -3, 2, 0], ours = ref + [0.5, 0, -1, 0]
        let r = [1.0, -3.0, 2.0, 0.0];
        let o = [1.5, -3.0, 1.0, 0.0];
        let d = Diff::of(&o, &r).unwrap();
        assert_eq!(d.max_abs, 1.0);
        assert_eq!(d.mean_abs, 0.375);
        assert!((d.rms - (1.25f64 / 4.0).sqrt()).abs() < 1e-12);
        assert_eq!(d.ref_max_abs, 3.0);
        // mean 0, mean square 14/4
        assert!((d.ref_std - 3.5f64.sqrt()).abs() < 1e-12);
        assert!((d.rel_max() - 1.0 / 3.0).abs() < 1e-12);
        assert!(Diff::of(&[1.0], &[1.0, 2.0]).is_err());
    }

    #[test]
    fn tolerances_reject_what_they_should() {
        let png = Tolerance::PNG;
        let within =
            Diff::of(&[10.0, 18.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], &[10.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]).unwrap();
        assert!(png.accepts(&within), "max 8, mean 1 is the limit itself");
        let over = Diff::of(&[19.0, 0.0], &[10.0, 0.0]).unwrap();
        assert!(!png.accepts(&over));
        let nan = Diff::of(&[f64::NAN, 1.0], &[1.0, 1.0]).unwrap();
        assert!(!png.accepts(&nan) && !Tolerance::rounding_points(1).accepts(&nan));
        // 4 u sqrt(N): 48 points give 1.35e-2.
        let Tolerance::Relative { rel_rms, rel_max } = Tolerance::rounding_points(48) else { unreachable!() };
        assert!((rel_rms - 4.0 * 48f64.sqrt() / 2048.0).abs() < 1e-15 && (rel_max - 2.0 * rel_rms).abs() < 1e-15);
    }
}
