//! The `--canny` preprocessor: a control image turned into its Canny edges, as the reference's `preprocess_canny` computes them.
//!
//! Steps (stable-diffusion.cpp `src/runtime/preprocessing.hpp`): grey
//! (`0.2989 R + 0.5870 G + 0.1140 B` of the `[0, 1]` values), a 5x5 Gaussian of sigma 1.4 (its
//! continuous density, not renormalised) and the 3x3 Sobel kernels, each a correlation with
//! zero padding; the gradient's magnitude divided by its maximum; non-maximum suppression;
//! thresholds and hysteresis; the result in every channel (inverted on request). The
//! reference's quirks are kept, since its edges are what a ControlNet user gets there:
//! * the direction tests of the suppression compare as `0 >= angle && angle < 22.5` and
//!   `157.5 >= angle && angle <= 180`, so every angle up to 157.5 degrees compares the
//!   pixel with its vertical neighbours, and steeper ones keep only the maximum (1.0);
//! * the high threshold is a fraction of the maximum, the low one a fraction of the high one;
//!   values under it are left as they are (not zeroed);
//! * a 3-pixel frame (`x < 3`, `x > W - 3`, same for y) is zeroed before hysteresis, which
//!   looks at six of the eight neighbours (not `(x + 1, y + 1)` nor `(x - 1, y + 1)`), in
//!   place, row by row.

use crate::pipeline::Image;

/// The reference CLI's thresholds and levels for `--canny` (high, low, weak, strong).
pub const CLI_PARAMS: CannyParams = CannyParams { high: 0.08, low: 0.08, weak: 0.8, strong: 1.0, inverse: false };

/// Thresholds and output levels of [`canny`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CannyParams {
    /// High threshold, a fraction of the largest suppressed gradient.
    pub high: f32,
    /// Low threshold, a fraction of the high one.
    pub low: f32,
    /// Level of a weak edge before hysteresis.
    pub weak: f32,
    /// Level of a strong edge.
    pub strong: f32,
    /// White background, black edges.
    pub inverse: bool,
}

/// One channel, `w x h`, row-major.
struct Plane {
    w: usize,
    h: usize,
    v: Vec<f32>,
}

impl Plane {
    fn at(&self, x: usize, y: usize) -> f32 {
        self.v[y * self.w + x]
    }

    /// Correlation with `k` (`kw x kw`, row-major), zero padding `pad`, the reference's loop order.
    fn correlate(&self, k: &[f32], kw: usize, pad: usize) -> Plane {
        let mut out = vec![0f32; self.v.len()];
        for y in 0..self.h {
            for x in 0..self.w {
                let mut sum = 0f32;
                for ky in 0..kw {
                    let Some(iy) = (y + ky).checked_sub(pad).filter(|&iy| iy < self.h) else { continue };
                    for kx in 0..kw {
                        let Some(ix) = (x + kx).checked_sub(pad).filter(|&ix| ix < self.w) else { continue };
                        sum += self.at(ix, iy) * k[ky * kw + kx];
                    }
                }
                out[y * self.w + x] = sum;
            }
        }
        Plane { w: self.w, h: self.h, v: out }
    }
}

/// The reference's 5x5 Gaussian (sigma 1.4): the density `exp(-(x^2 + y^2) / (2 sigma^2)) /
/// (2 pi sigma^2)` at integer offsets, in f32.
fn gaussian5() -> Vec<f32> {
    let sigma = 1.4f32;
    let normal = 1.0 / (2.0 * std::f32::consts::PI * sigma.powi(2));
    let mut k = vec![0f32; 25];
    for y in 0..5 {
        let gx = y as f32 - 2.0;
        for x in 0..5 {
            let gy = x as f32 - 2.0;
            k[y * 5 + x] = (-((gx * gx + gy * gy) / (2.0 * sigma.powi(2)))).exp() * normal;
        }
    }
    k
}

/// `img`'s Canny edges with `p`, grey in all three channels.
pub fn canny(img: &Image, p: CannyParams) -> Image {
    const KX: [f32; 9] = [-1.0, 0.0, 1.0, -2.0, 0.0, 2.0, -1.0, 0.0, 1.0];
    const KY: [f32; 9] = [1.0, 2.0, 1.0, 0.0, 0.0, 0.0, -1.0, -2.0, -1.0];
    let (w, h) = (img.width, img.height);
    let gray: Vec<f32> = img
        .rgb
        .chunks_exact(3)
        .map(|c| {
            let f = |v: u8| v as f32 / 255.0;
            0.2989 * f(c[0]) + 0.5870 * f(c[1]) + 0.1140 * f(c[2])
        })
        .collect();
    let gray = Plane { w, h, v: gray }.correlate(&gaussian5(), 5, 2);
    let ix = gray.correlate(&KX, 3, 1);
    let iy = gray.correlate(&KY, 3, 1);
    let mut g: Vec<f32> = ix.v.iter().zip(&iy.v).map(|(x, y)| (x * x + y * y).sqrt()).collect();
    let max = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max != 0.0 && max.is_finite() {
        let s = 1.0 / max;
        g.iter_mut().for_each(|v| *v *= s);
    }
    let g = Plane { w, h, v: g };

    // Non-maximum suppression (the reference's comparisons, see the module doc).
    let mut e = vec![0f32; w * h];
    for y in 1..h.saturating_sub(1) {
        for x in 1..w.saturating_sub(1) {
            let mut angle = iy.at(x, y).atan2(ix.at(x, y)) * 180.0 / std::f32::consts::PI;
            if angle < 0.0 {
                angle += 180.0;
            }
            // The reference writes five direction tests (`0 >= angle && angle < 22.5 || 157.5 >=
            // angle && angle <= 180`, `22.5 >= angle && angle < 67.5`, ...); with its operands they
            // reduce to this: up to 157.5 degrees the vertical neighbours, above it none (1.0,
            // which only the maximum passes). A NaN angle passes no test, as there.
            let (q, r) = if angle <= 157.5 { (g.at(x, y + 1), g.at(x, y - 1)) } else { (1.0, 1.0) };
            let cur = g.at(x, y);
            e[y * w + x] = if cur >= q && cur >= r { cur } else { 0.0 };
        }
    }

    // Thresholds, the frame, hysteresis.
    let max = e.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let ht = max * p.high;
    let lt = ht * p.low;
    for v in &mut e {
        if *v >= ht {
            *v = p.strong;
        } else if *v <= ht && *v >= lt {
            *v = p.weak;
        }
    }
    for y in 0..h {
        for x in 0..w {
            let inside = x >= 3 && x + 3 <= w && y >= 3 && y + 3 <= h;
            if !inside {
                e[y * w + x] = 0.0;
            }
        }
    }
    for y in 1..h.saturating_sub(1) {
        for x in 1..w.saturating_sub(1) {
            if e[y * w + x] == p.weak {
                let s = |x: usize, y: usize| e[y * w + x] == p.strong;
                let strong =
                    s(x + 1, y - 1) || s(x + 1, y) || s(x, y - 1) || s(x, y + 1) || s(x - 1, y - 1) || s(x - 1, y);
                e[y * w + x] = if strong { p.strong } else { 0.0 };
            }
        }
    }
    let to_u8 = |v: f32| {
        let v = if p.inverse { 1.0 - v } else { v };
        if v <= 0.0 {
            0
        } else if v >= 1.0 {
            255
        } else {
            (v * 255.0 + 0.5) as u8
        }
    };
    Image { width: w, height: h, rgb: e.iter().flat_map(|&v| [to_u8(v); 3]).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(w: usize, h: usize, f: impl Fn(usize, usize) -> u8) -> Image {
        let rgb = (0..h).flat_map(|y| (0..w).map(move |x| (x, y))).flat_map(|(x, y)| [f(x, y); 3]).collect();
        Image { width: w, height: h, rgb }
    }

    fn gray_at(img: &Image, x: usize, y: usize) -> u8 {
        img.rgb[(y * img.width + x) * 3]
    }

    /// A black image has no gradient: every suppressed value is 0, the maximum 0, so both
    /// thresholds are 0 and every pixel is "strong" (the reference's quirk); the 3-pixel frame
    /// (x < 3 or x > W - 3) is zeroed. For 8x8: 255 exactly on x, y in 3..=5; inverted, the
    /// opposite.
    #[test]
    fn a_black_image_gives_the_references_white_square_inside_the_frame() {
        let out = canny(&image(8, 8, |_, _| 0), CLI_PARAMS);
        for y in 0..8 {
            for x in 0..8 {
                let inside = (3..=5).contains(&x) && (3..=5).contains(&y);
                assert_eq!(gray_at(&out, x, y), if inside { 255 } else { 0 }, "({x}, {y})");
            }
        }
        let inv = canny(&image(8, 8, |_, _| 0), CannyParams { inverse: true, ..CLI_PARAMS });
        assert_eq!((gray_at(&inv, 4, 4), gray_at(&inv, 0, 0)), (0, 255));
    }

    /// The Gaussian's centre is `1 / (2 pi 1.4^2)` = 1 / 12.31504 = 0.0812015 and a corner that
    /// times `exp(-8 / 3.92)` = 0.129922: 0.0105499; the kernel is symmetric.
    #[test]
    fn the_gaussian_is_the_density_at_integer_offsets() {
        let k = gaussian5();
        assert!((k[12] - 0.081_201_5).abs() < 1e-6, "{}", k[12]);
        assert!((k[0] - 0.010_549_9).abs() < 1e-6, "{}", k[0]);
        assert_eq!(k[1], k[5]);
        assert_eq!(k[0], k[24]);
    }

    /// A horizontal step (black above row 8, white from it) in a 16x16 image: the gradient is
    /// vertical (angle 90 degrees, compared with the vertical neighbours), largest on rows 7 and 8
    /// (equal: the blur is symmetric about 7.5), so at x = 8 (away from the frame) the edge is
    /// strong (255) there, while rows 4 and 12, flat over the blur and Sobel windows, are 0.
    #[test]
    fn a_step_gives_a_strong_edge_on_the_step_rows_only() {
        let out = canny(&image(16, 16, |_, y| if y >= 8 { 255 } else { 0 }), CLI_PARAMS);
        let col: Vec<u8> = (0..16).map(|y| gray_at(&out, 8, y)).collect();
        assert!(col[7] == 255 || col[8] == 255, "{col:?}");
        assert_eq!((col[4], col[12], col[0], col[15]), (0, 0, 0, 0), "{col:?}");
    }

    /// The reference's own edges of a 64x64 drawing (a soft-edged disc and a square on a
    /// gradient: `sdref canny`, sd.cpp's `preprocess_canny` with the CLI's thresholds), pixel
    /// for pixel.
    #[test]
    fn edges_of_a_drawing_are_the_references_exactly() {
        let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data");
        let input = crate::image_io::read_image(&data.join("canny-in-64x64.png")).unwrap();
        let want = crate::image_io::read_image(&data.join("ref-canny-64x64.png")).unwrap();
        let got = canny(&input, CLI_PARAMS);
        let differ: Vec<(usize, u8, u8)> = got
            .rgb
            .iter()
            .zip(&want.rgb)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, (a, b))| (i / 3, *a, *b))
            .collect();
        assert!(
            differ.is_empty(),
            "{} values differ (pixel, ours, reference): {:?}",
            differ.len(),
            &differ[..differ.len().min(10)]
        );
        assert!(want.rgb.iter().filter(|&&v| v == 255).count() > 3 * 50, "the drawing has edges");
    }
}
