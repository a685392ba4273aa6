//! Inpainting's masks and latents, as the reference builds them (`stable-diffusion.cpp`'s
//! `prepare_image_generation_latents` and the denoiser's blend).
//!
//! The mask image is read as 0 or 1 per pixel (its value / 255, rounded); the latent mask takes
//! the maximum over each `scale x scale` block (a latent position is repainted when any of its
//! pixels is). At every denoising step the denoised estimate keeps the init image's latent where
//! the mask is 0: `denoised * m + init * (1 - m)`. A normal checkpoint blends with the latent
//! mask; an inpainting checkpoint (a UNet taking the mask and the masked image's latent beside
//! the noisy latent) blends with the latent mask dilated by a 3x3 maximum, and its input gets
//! `[latent mask, masked image latent]` appended to the latent's channels.

use crate::pipeline::Image;

/// The mask at pixel resolution, one 0/1 value per pixel (row-major): the first channel / 255,
/// rounded half away from zero (the reference's `round` of its `[0, 1]` tensor).
pub(crate) fn pixel_mask(mask: &Image) -> Vec<f32> {
    mask.rgb.chunks_exact(3).map(|px| (px[0] as f32 / 255.0).round()).collect()
}

/// The mask at latent resolution `(w / scale) x (h / scale)`: the maximum of each
/// `scale x scale` block of `pixels` (`w x h`, both multiples of `scale`), the reference's
/// `NearestMax` interpolation when downsampling by a whole factor.
pub(crate) fn latent_mask(pixels: &[f32], (w, h): (usize, usize), scale: usize) -> Vec<f32> {
    let (lw, lh) = (w / scale, h / scale);
    let mut out = vec![f32::MIN; lw * lh];
    for y in 0..lh * scale {
        for x in 0..lw * scale {
            let o = &mut out[(y / scale) * lw + x / scale];
            *o = o.max(pixels[y * w + x]);
        }
    }
    out
}

/// A 3x3 maximum filter (stride 1, padding 1: the window clipped at the edges), the
/// reference's `max_pool_2d(mask, {3, 3}, {1, 1}, {1, 1})` for inpainting checkpoints.
pub(crate) fn dilate3(mask: &[f32], (w, h): (usize, usize)) -> Vec<f32> {
    let mut out = vec![f32::MIN; w * h];
    for y in 0..h {
        for x in 0..w {
            let o = &mut out[y * w + x];
            for sy in y.saturating_sub(1)..(y + 2).min(h) {
                for sx in x.saturating_sub(1)..(x + 2).min(w) {
                    *o = o.max(mask[sy * w + sx]);
                }
            }
        }
    }
    out
}

/// The init image with the masked part replaced by mid grey, planar `[3, H, W]` in `[0, 1]`:
/// `(1 - m) * (image - 0.5) + 0.5`, what an inpainting checkpoint's masked-image latent
/// encodes.
pub(crate) fn masked_image(planar: &[f32], pixels: &[f32]) -> Vec<f32> {
    let plane = pixels.len();
    planar.iter().enumerate().map(|(i, &v)| (1.0 - pixels[i % plane]) * (v - 0.5) + 0.5).collect()
}

/// Keeps the init latent where the mask is 0, in every image of `pred` (images of
/// `init.len()` values, `mask.len()` positions per channel): `pred * m + init * (1 - m)`.
pub(crate) fn blend(pred: &mut [f32], init: &[f32], mask: &[f32]) {
    let plane = mask.len();
    for image in pred.chunks_exact_mut(init.len()) {
        for (i, (p, &b)) in image.iter_mut().zip(init).enumerate() {
            let m = mask[i % plane];
            *p = *p * m + b * (1.0 - m);
        }
    }
}

/// An inpainting UNet's extra input channels for one image: the latent mask, then the masked
/// image's latent.
pub(crate) fn concat(latent_mask: &[f32], masked_latent: &[f32]) -> Vec<f32> {
    latent_mask.iter().chain(masked_latent).copied().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gray(w: usize, h: usize, v: impl Fn(usize, usize) -> u8) -> Image {
        let mut rgb = Vec::with_capacity(w * h * 3);
        for y in 0..h {
            for x in 0..w {
                rgb.extend_from_slice(&[v(x, y); 3]);
            }
        }
        Image { width: w, height: h, rgb }
    }

    #[test]
    fn a_latent_is_repainted_when_any_of_its_pixels_is() {
        // 16x8 pixels, scale 8: two latent positions; one pixel at 128 (rounds to 1) in the
        // second block, 127 (rounds to 0) everywhere in the first.
        let m = gray(16, 8, |x, y| if (x, y) == (13, 5) { 128 } else { 127 });
        let px = pixel_mask(&m);
        assert_eq!(px.iter().filter(|&&v| v == 1.0).count(), 1);
        assert_eq!(latent_mask(&px, (16, 8), 8), vec![0.0, 1.0]);
    }

    #[test]
    fn dilation_spreads_one_position_to_its_neighbours_only() {
        let mut m = vec![0.0; 16];
        m[5] = 1.0; // (1, 1) of 4x4
        let d = dilate3(&m, (4, 4));
        let ones: Vec<usize> = (0..16).filter(|&i| d[i] == 1.0).collect();
        assert_eq!(ones, vec![0, 1, 2, 4, 5, 6, 8, 9, 10]);
        // A corner: the window is clipped, nothing wraps around.
        let mut c = vec![0.0; 16];
        c[15] = 1.0;
        assert_eq!((0..16).filter(|&i| dilate3(&c, (4, 4))[i] == 1.0).collect::<Vec<_>>(), vec![10, 11, 14, 15]);
    }

    #[test]
    fn blending_keeps_the_init_where_the_mask_is_zero_in_every_image_and_channel() {
        let mask = [1.0, 0.0];
        let init = [10.0, 20.0, 30.0, 40.0]; // 2 channels x 2 positions
        let mut pred = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]; // 2 images
        blend(&mut pred, &init, &mask);
        assert_eq!(pred, vec![1.0, 20.0, 3.0, 40.0, 5.0, 20.0, 7.0, 40.0]);
    }

    #[test]
    fn the_masked_image_is_grey_where_repainted() {
        let planar = [0.0, 1.0, 0.25, 0.75, 0.5, 0.125]; // 3 channels x 2 pixels
        let out = masked_image(&planar, &[1.0, 0.0]);
        assert_eq!(out, vec![0.5, 1.0, 0.5, 0.75, 0.5, 0.125]);
    }
}
