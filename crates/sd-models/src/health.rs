//! Numeric health of a stage's output: all zero, saturated or non-finite values, reported as a warning naming the stage.
//!
//! A model with overflowing weights (finite f16 values of 65504), a prompt whose weights
//! overflow (`(((...)))` nested thousands deep) or a broken VAE still "works": every stage
//! runs and the result is a black or uniform PNG. The pipeline passes each stage's output
//! (the text encoder's hidden states, the UNet's output at every step, the VAE's image)
//! through [`check`]; a problem is a `tracing` warning naming the stage, with the value
//! statistics at debug level (`-v`). Generation goes on: an all-zero image can be legitimate.

/// Summary statistics of one output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    /// Number of values.
    pub len: usize,
    /// NaN or infinite values.
    pub non_finite: usize,
    /// Values exactly zero.
    pub zeros: usize,
    /// Smallest and largest finite value (0 when there is none).
    pub min: f32,
    pub max: f32,
    /// Mean of the finite values.
    pub mean: f64,
}

impl Stats {
    /// The statistics of `data`.
    pub fn of(data: &[f32]) -> Self {
        let (mut non_finite, mut zeros, mut sum, mut n) = (0usize, 0usize, 0f64, 0usize);
        let (mut min, mut max) = (f32::INFINITY, f32::NEG_INFINITY);
        for &v in data {
            if !v.is_finite() {
                non_finite += 1;
                continue;
            }
            zeros += usize::from(v == 0.0);
            min = min.min(v);
            max = max.max(v);
            sum += f64::from(v);
            n += 1;
        }
        if n == 0 {
            (min, max) = (0.0, 0.0);
        }
        Stats { len: data.len(), non_finite, zeros, min, max, mean: if n > 0 { sum / n as f64 } else { 0.0 } }
    }
}

/// What a stage's output should look like.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Expect {
    /// Activations: finite, not all zero, magnitudes below `limit` (values at f16's maximum,
    /// 65504, mean an overflow somewhere upstream).
    Activations { limit: f32 },
    /// An image in `[lo, hi]`: saturated when nearly every value lies at or beyond a bound.
    Image { lo: f32, hi: f32 },
}

/// Activations whose magnitude reaches this are treated as an f16 overflow.
pub const F16_OVERFLOW: f32 = 60000.0;

/// The problem with `data` as `expect` describes it, if any (a sentence).
pub fn problem(data: &[f32], expect: Expect) -> Option<String> {
    let s = Stats::of(data);
    if s.len == 0 {
        return None;
    }
    if s.non_finite > 0 {
        return Some(format!("{} of {} values are NaN or infinite", s.non_finite, s.len));
    }
    match expect {
        Expect::Activations { limit } => {
            if s.zeros == s.len {
                return Some("every value is zero".into());
            }
            let peak = s.min.abs().max(s.max.abs());
            if peak >= limit {
                return Some(format!(
                    "values reach {peak:e} (saturated: an f16 overflow in the weights or prompt weights?)"
                ));
            }
        }
        Expect::Image { lo, hi } => {
            let at_bounds = data.iter().filter(|&&v| v <= lo || v >= hi).count();
            // 99.9 %: a real image has a few clipped pixels, a broken one is all clipped.
            if at_bounds * 1000 >= s.len * 999 {
                return Some(format!(
                    "{at_bounds} of {} values are clipped to {lo} or {hi} (the image is saturated, e.g. all black)",
                    s.len
                ));
            }
            if s.min == s.max {
                return Some(format!("every value is {} (a uniform image)", s.min));
            }
        }
    }
    None
}

/// Checks `data`, the output of `stage`; warns when it is unhealthy (statistics at debug).
/// Returns whether a warning was given, so a caller can warn once per run of a stage.
pub fn check(stage: &str, data: &[f32], expect: Expect) -> bool {
    let s = Stats::of(data);
    tracing::debug!(
        "{stage}: {} values, min {:e}, max {:e}, mean {:e}, {} zero, {} non-finite",
        s.len,
        s.min,
        s.max,
        s.mean,
        s.zeros,
        s.non_finite
    );
    match problem(data, expect) {
        Some(p) => {
            tracing::warn!("{stage}: {p}; the image will likely be blank or noise");
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_found_and_healthy_outputs_pass() {
        let act = Expect::Activations { limit: F16_OVERFLOW };
        let img = Expect::Image { lo: -1.0, hi: 1.0 };
        assert_eq!(problem(&[0.1, -0.5, 2.0], act), None);
        assert!(problem(&[0.1, f32::NAN], act).unwrap().contains("1 of 2 values are NaN"));
        assert!(problem(&[0.1, f32::INFINITY], img).unwrap().contains("NaN or infinite"));
        assert!(problem(&[0.0; 8], act).unwrap().contains("every value is zero"));
        assert!(problem(&[1.0, -65504.0], act).unwrap().contains("saturated"));
        assert!(problem(&[-1.0; 100], img).unwrap().contains("clipped"));
        assert!(problem(&[-3.0, -1.5, 5.0, -1.0], img).unwrap().contains("4 of 4"));
        assert!(problem(&[0.25; 10], img).unwrap().contains("uniform"));
        assert_eq!(problem(&[-1.0, 0.3, 0.9, 1.0], img), None);
        let s = Stats::of(&[1.0, f32::NAN, 0.0, -3.0]);
        assert_eq!((s.non_finite, s.zeros, s.min, s.max), (1, 1, -3.0, 1.0));
    }
}
