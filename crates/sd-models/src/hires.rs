//! Hires fix (`--hires`): a second sampling pass at a larger size, started from the first
//! pass's latent upscaled, as the reference's `generate_image` runs it after its first pass.
//!
//! The latent upscalers resize the latent's planes with the reference's filters
//! (`core/tensor.hpp`'s `interpolate`: half-pixel centres, edge clamping, PyTorch's bicubic
//! `a = -0.75`; the antialiased modes widen the filter by the downscale factor and normalise).
//! The second pass's schedule: [`second_pass_schedule_steps`].

/// How the first pass's result is enlarged (`--hires-upscaler`): the reference's latent modes,
/// or its image upscalers, which decode the latent, resize the image and encode it again. An
/// ESRGAN model (the reference's `Model`, given to [`crate::pipeline::Pipeline::set_hires_model`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HiresUpscaler {
    /// `Latent`: bilinear.
    Latent,
    /// `Latent (nearest)`.
    LatentNearest,
    /// `Latent (nearest-exact)`.
    LatentNearestExact,
    /// `Latent (antialiased)`: bilinear, antialiased.
    LatentAntialiased,
    /// `Latent (bicubic)`.
    LatentBicubic,
    /// `Latent (bicubic antialiased)`.
    LatentBicubicAntialiased,
    /// `Lanczos`: the decoded image, Lanczos-3.
    Lanczos,
    /// `Nearest`: the decoded image, nearest.
    Nearest,
    /// `Model`: the decoded image through an ESRGAN model, then nearest to the target.
    Model,
}

impl HiresUpscaler {
    /// Every mode, in the reference's order.
    pub const ALL: [HiresUpscaler; 9] = [
        HiresUpscaler::Latent,
        HiresUpscaler::LatentNearest,
        HiresUpscaler::LatentNearestExact,
        HiresUpscaler::LatentAntialiased,
        HiresUpscaler::LatentBicubic,
        HiresUpscaler::LatentBicubicAntialiased,
        HiresUpscaler::Lanczos,
        HiresUpscaler::Nearest,
        HiresUpscaler::Model,
    ];

    /// The reference's name (`sd_hires_upscaler_name`).
    pub fn name(self) -> &'static str {
        match self {
            HiresUpscaler::Latent => "Latent",
            HiresUpscaler::LatentNearest => "Latent (nearest)",
            HiresUpscaler::LatentNearestExact => "Latent (nearest-exact)",
            HiresUpscaler::LatentAntialiased => "Latent (antialiased)",
            HiresUpscaler::LatentBicubic => "Latent (bicubic)",
            HiresUpscaler::LatentBicubicAntialiased => "Latent (bicubic antialiased)",
            HiresUpscaler::Lanczos => "Lanczos",
            HiresUpscaler::Nearest => "Nearest",
            HiresUpscaler::Model => "Model",
        }
    }

    /// The mode named `name` (the reference's names, exactly).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|u| u.name() == name)
    }

    /// Whether it resizes the latent (else the decoded image).
    pub fn is_latent(self) -> bool {
        !matches!(self, HiresUpscaler::Lanczos | HiresUpscaler::Nearest | HiresUpscaler::Model)
    }

    fn filter(self) -> (Filter, bool) {
        match self {
            HiresUpscaler::Latent => (Filter::Linear, false),
            HiresUpscaler::LatentNearest => (Filter::Nearest, false),
            HiresUpscaler::LatentNearestExact => (Filter::NearestExact, false),
            HiresUpscaler::LatentAntialiased => (Filter::Linear, true),
            HiresUpscaler::LatentBicubic => (Filter::Cubic, false),
            HiresUpscaler::LatentBicubicAntialiased => (Filter::Cubic, true),
            HiresUpscaler::Lanczos => (Filter::Lanczos, false),
            HiresUpscaler::Nearest | HiresUpscaler::Model => (Filter::Nearest, false),
        }
    }
}

/// The hires fix's settings (the reference's `sd_hires_params_t`; its defaults in
/// [`HiresParams::default`]).
#[derive(Clone, Debug, PartialEq)]
pub struct HiresParams {
    /// `--hires-upscaler`.
    pub upscaler: HiresUpscaler,
    /// `--hires-scale`: the target size's factor when neither side is given.
    pub scale: f32,
    /// `--hires-width` (0: from the height, else from the scale).
    pub width: usize,
    /// `--hires-height` (0: from the width, else from the scale).
    pub height: usize,
    /// `--hires-steps`: the second pass's steps (0: the first pass's).
    pub steps: usize,
    /// `--hires-denoising-strength` (0..1; the reference raises it to 0.0001 at least).
    pub denoising_strength: f32,
}

impl Default for HiresParams {
    fn default() -> Self {
        HiresParams {
            upscaler: HiresUpscaler::Latent,
            scale: 2.0,
            width: 0,
            height: 0,
            steps: 0,
            denoising_strength: 0.7,
        }
    }
}

/// The largest `--hires-scale` accepted (the memory check bounds the size itself).
pub const MAX_HIRES_SCALE: f32 = 8.0;

impl HiresParams {
    /// The target size before alignment, as the reference's `resolve_hires`: both sides if
    /// given, one side for both, else the generated size times the scale, rounded.
    pub fn target_size(&self, width: usize, height: usize) -> (usize, usize) {
        match (self.width, self.height) {
            (w, h) if w > 0 && h > 0 => (w, h),
            (w, _) if w > 0 => (w, w),
            (_, h) if h > 0 => (h, h),
            _ => ((width as f32 * self.scale).round() as usize, (height as f32 * self.scale).round() as usize),
        }
    }

    /// The strength the reference samples with (clamped to 0.0001..=1).
    pub(crate) fn strength(&self) -> f32 {
        self.denoising_strength.clamp(0.0001, 1.0)
    }
}

/// The second pass's scheduler step count, as the reference's `make_hires_sigma_schedule`:
/// the steps (the first pass's when 0) divided by the strength, truncated, so trimming the
/// schedule to the strength leaves about `steps` steps. The schedule of this many steps is
/// trimmed by `sd_sampling::schedule::img2img_sigmas` with the same strength.
pub(crate) fn second_pass_schedule_steps(hires: &HiresParams, first_steps: usize) -> usize {
    let steps = if hires.steps > 0 { hires.steps } else { first_steps }.max(1);
    ((steps as f32 / hires.strength()) as usize).max(1)
}

/// The filters of the reference's `interpolate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Filter {
    /// `in = out * in_size / out_size` (integer).
    Nearest,
    /// The nearest half-pixel centre.
    NearestExact,
    /// Triangle, support 1.
    Linear,
    /// Keys' cubic, `a = -0.75`, support 2.
    Cubic,
    /// Lanczos, radius 3, weights normalised.
    Lanczos,
}

/// One output index's inputs and weights along an axis.
fn contributors(input: usize, output: usize, filter: Filter, antialias: bool) -> Vec<Vec<(usize, f64)>> {
    let scale = input as f64 / output as f64;
    let last = input as i64 - 1;
    (0..output)
        .map(|out| match filter {
            Filter::Nearest => vec![((out * input / output).min(input - 1), 1.0)],
            Filter::NearestExact => {
                let centre = (out as f64 + 0.5) * scale - 0.5;
                vec![(((centre + 0.5).floor() as i64).clamp(0, last) as usize, 1.0)]
            }
            Filter::Linear | Filter::Cubic | Filter::Lanczos => {
                let fscale = if antialias { scale.max(1.0) } else { 1.0 };
                let centre = (out as f64 + 0.5) * scale - 0.5;
                let support = match filter {
                    Filter::Linear => 1.0,
                    Filter::Cubic => 2.0,
                    _ => 3.0,
                } * fscale;
                let (start, end) = ((centre - support).ceil() as i64, (centre + support).floor() as i64);
                let mut taps = Vec::new();
                let mut sum = 0.0;
                for i in start..=end {
                    let x = ((centre - i as f64) / fscale).abs();
                    let w = if filter == Filter::Linear {
                        if x < 1.0 {
                            1.0 - x
                        } else {
                            0.0
                        }
                    } else if filter == Filter::Cubic {
                        cubic(x)
                    } else {
                        lanczos(x)
                    };
                    if w == 0.0 {
                        continue;
                    }
                    taps.push((i.clamp(0, last) as usize, w));
                    sum += w;
                }
                if (antialias || filter == Filter::Lanczos) && sum.abs() > 1e-12 {
                    for t in &mut taps {
                        t.1 /= sum;
                    }
                }
                if taps.is_empty() {
                    taps.push((((centre + 0.5).floor() as i64).clamp(0, last) as usize, 1.0));
                }
                taps
            }
        })
        .collect()
}

fn sinc(x: f64) -> f64 {
    if x.abs() < 1e-12 {
        1.0
    } else {
        let px = std::f64::consts::PI * x;
        px.sin() / px
    }
}

fn lanczos(x: f64) -> f64 {
    if x >= 3.0 {
        0.0
    } else {
        sinc(x) * sinc(x / 3.0)
    }
}

fn cubic(x: f64) -> f64 {
    const A: f64 = -0.75;
    if x <= 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

/// Resizes each of the `input.len() / (w * h)` row-major planes of `input` from `from` to
/// `to` (width, height) with `filter`, as the reference's `interpolate` (sums in f64).
pub(crate) fn resize_planes(
    input: &[f32],
    from: (usize, usize),
    to: (usize, usize),
    filter: Filter,
    antialias: bool,
) -> Vec<f32> {
    let ((iw, ih), (ow, oh)) = (from, to);
    if from == to {
        return input.to_vec();
    }
    let xs = contributors(iw, ow, filter, antialias);
    let ys = contributors(ih, oh, filter, antialias);
    let mut out = Vec::with_capacity(input.len() / (iw * ih) * ow * oh);
    for plane in input.chunks_exact(iw * ih) {
        for y_taps in &ys {
            for x_taps in &xs {
                let mut v = 0.0f64;
                for &(yi, yw) in y_taps {
                    let row = &plane[yi * iw..(yi + 1) * iw];
                    for &(xi, xw) in x_taps {
                        v += row[xi] as f64 * xw * yw;
                    }
                }
                out.push(v as f32);
            }
        }
    }
    out
}

/// The first pass's latent (`channels` planes of `from`) upscaled to `to` with `upscaler`.
pub(crate) fn upscale_latent(
    latent: &[f32],
    from: (usize, usize),
    to: (usize, usize),
    upscaler: HiresUpscaler,
) -> Vec<f32> {
    let (filter, antialias) = upscaler.filter();
    tracing::info!("hires {} upscale {}x{} -> {}x{}", upscaler.name(), from.0, from.1, to.0, to.1);
    resize_planes(latent, from, to, filter, antialias)
}

/// The decoded image (3 planes of `from` pixels, in [0, 1]) upscaled to `to` with `upscaler`'s
/// image filter and clamped to [0, 1], as the reference's image upscalers.
pub(crate) fn upscale_image(
    image: &[f32],
    from: (usize, usize),
    to: (usize, usize),
    upscaler: HiresUpscaler,
) -> Vec<f32> {
    let (filter, antialias) = upscaler.filter();
    tracing::info!("hires {} image upscale {}x{} -> {}x{}", upscaler.name(), from.0, from.1, to.0, to.1);
    let mut out = resize_planes(image, from, to, filter, antialias);
    for v in &mut out {
        *v = v.clamp(0.0, 1.0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_others_are_refused() {
        for u in HiresUpscaler::ALL {
            assert_eq!(HiresUpscaler::from_name(u.name()), Some(u));
        }
        assert_eq!(HiresUpscaler::from_name("latent"), None);
        assert_eq!(HiresUpscaler::from_name("lanczos"), None);
        assert!(HiresUpscaler::LatentNearest.is_latent() && !HiresUpscaler::Lanczos.is_latent());
    }

    #[test]
    fn target_size_follows_the_reference() {
        let mut h = HiresParams { scale: 1.5, ..HiresParams::default() };
        assert_eq!(h.target_size(64, 40), (96, 60));
        h.width = 100;
        assert_eq!(h.target_size(64, 40), (100, 100));
        h.height = 30;
        assert_eq!(h.target_size(64, 40), (100, 30));
        h.width = 0;
        assert_eq!(h.target_size(64, 40), (30, 30));
    }

    #[test]
    fn second_pass_steps_divide_by_the_strength() {
        let h = HiresParams { denoising_strength: 0.7, ..HiresParams::default() };
        // (int)(4 / 0.7f) = 5; the hires steps win over the first pass's.
        assert_eq!(second_pass_schedule_steps(&h, 4), 5);
        assert_eq!(second_pass_schedule_steps(&HiresParams { steps: 10, ..h.clone() }, 4), 14);
        assert_eq!(second_pass_schedule_steps(&HiresParams { denoising_strength: 0.0, ..h }, 2), 20000);
    }

    #[test]
    fn bilinear_doubling_interpolates_half_pixel_centres() {
        // One row 0, 4 -> 0, 1, 3, 4 (edges clamped: the first output is 0.75*0 + 0.25*0).
        let out = resize_planes(&[0.0, 4.0], (2, 1), (4, 1), Filter::Linear, false);
        assert_eq!(out, vec![0.0, 1.0, 3.0, 4.0]);
        let near = resize_planes(&[0.0, 4.0], (2, 1), (4, 1), Filter::Nearest, false);
        assert_eq!(near, vec![0.0, 0.0, 4.0, 4.0]);
        // Two planes stay apart; a constant stays constant under every filter.
        for (f, aa) in [
            (Filter::Lanczos, false),
            (Filter::Cubic, false),
            (Filter::Cubic, true),
            (Filter::Linear, true),
            (Filter::NearestExact, false),
        ] {
            let out = resize_planes(&[2.0; 6 * 2], (3, 2), (7, 5), f, aa);
            assert_eq!(out.len(), 7 * 5 * 2);
            assert!(out.iter().all(|v| (v - 2.0).abs() < 1e-5), "{f:?} {aa}: {out:?}");
        }
    }
}
