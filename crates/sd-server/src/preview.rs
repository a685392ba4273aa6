//! Live previews: a sampling step's denoised latent projected to RGB (a fixed linear map per
//! latent channel, no VAE run), enlarged by pixel repetition and encoded as PNG.
//!
//! The map of SD 1.x/2.x latents (4 channels) is the usual "cheap approximation": each RGB
//! value is a weighted sum of the four channels, about -1..1. Latents of other widths
//! (16-channel SD3/Flux latents) show their first three channels, each stretched to its own
//! range: enough to see the composition form, which is what a preview is for.

use std::sync::Arc;

use base64::Engine as _;
use sd_models::pipeline::{LatentHook, StepLatent};

use crate::jobs::Shared;

/// RGB weights of each channel of a 4-channel KL-f8 latent (the SD 1.x autoencoder's
/// latent space, which SD 2.x and SDXL share closely enough for a preview).
const KL_F8_RGB: [[f32; 3]; 4] =
    [[0.3512, 0.2297, 0.3227], [0.3250, 0.4974, 0.2350], [-0.2829, 0.1762, 0.2721], [-0.2120, -0.2616, -0.7177]];

/// Longest side of a preview, in pixels.
const MAX_SIDE: usize = 512;

/// The latent as RGB bytes at latent resolution, or None when its shape is inconsistent.
pub(crate) fn project(l: &StepLatent<'_>) -> Option<Vec<u8>> {
    let n = l.width * l.height;
    if n == 0 || l.channels == 0 || l.latent.len() != l.channels * n {
        return None;
    }
    let plane = |c: usize| &l.latent[c * n..(c + 1) * n];
    let mut rgb = vec![0u8; n * 3];
    let byte = |v: f32| ((v.clamp(-1.0, 1.0) + 1.0) * 127.5).round() as u8;
    if l.channels == 4 {
        for (i, px) in rgb.chunks_exact_mut(3).enumerate() {
            for (k, out) in px.iter_mut().enumerate() {
                let v: f32 = (0..4).map(|c| plane(c)[i] * KL_F8_RGB[c][k]).sum();
                *out = byte(if v.is_finite() { v } else { 0.0 });
            }
        }
    } else {
        for k in 0..3 {
            let p = plane(k.min(l.channels - 1));
            let (lo, hi) = p
                .iter()
                .filter(|v| v.is_finite())
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            let span = if hi > lo { hi - lo } else { 1.0 };
            for (i, &v) in p.iter().enumerate() {
                let t = if v.is_finite() { (v - lo) / span } else { 0.0 };
                rgb[i * 3 + k] = (t.clamp(0.0, 1.0) * 255.0).round() as u8;
            }
        }
    }
    Some(rgb)
}

/// The preview of `l` as base64 PNG: the projection enlarged by an integer factor (up to
/// the VAE's 8, the longest side at most [`MAX_SIDE`]).
pub(crate) fn png_b64(l: &StepLatent<'_>) -> Option<String> {
    let rgb = project(l)?;
    let f = (MAX_SIDE / l.width.max(l.height)).clamp(1, 8);
    let (w, h) = (l.width * f, l.height * f);
    let mut big = vec![0u8; w * h * 3];
    for y in 0..h {
        for x in 0..w {
            let src = ((y / f) * l.width + x / f) * 3;
            big[(y * w + x) * 3..][..3].copy_from_slice(&rgb[src..src + 3]);
        }
    }
    let img = image::RgbImage::from_raw(w as u32, h as u32, big)?;
    let mut bytes = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut bytes), image::ImageFormat::Png).ok()?;
    Some(base64::engine::general_purpose::STANDARD.encode(&bytes))
}

/// The pipeline's hook: every `--preview-interval` steps (and at the last), the generating
/// job's preview is replaced.
pub(crate) fn hook(shared: Arc<Shared>) -> LatentHook {
    Arc::new(move |l: &StepLatent<'_>| {
        let every = shared.config.preview_interval;
        if every == 0 {
            return;
        }
        let done = l.step + 1;
        if !done.is_multiple_of(every) && done != l.steps {
            return;
        }
        if let Some(b64) = png_b64(l) {
            shared.set_preview(l.image, done, b64);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn latent(channels: usize, values: &[f32]) -> StepLatent<'_> {
        StepLatent { image: 0, step: 0, steps: 1, channels, width: values.len() / channels, height: 1, latent: values }
    }

    #[test]
    fn sd1_latents_map_through_the_channel_weights() {
        // One pixel of each channel alone: its weights scaled to bytes.
        for c in 0..4 {
            let mut v = [0.0f32; 4];
            v[c] = 1.0;
            let rgb = project(&latent(4, &v)).unwrap();
            for k in 0..3 {
                assert_eq!(rgb[k], ((KL_F8_RGB[c][k] + 1.0) * 127.5).round() as u8, "channel {c}, colour {k}");
            }
        }
        // A zero latent is mid grey; a non-finite value does not poison the pixel.
        assert_eq!(project(&latent(4, &[0.0; 4])).unwrap(), vec![128, 128, 128]);
        assert_eq!(project(&latent(4, &[f32::NAN, 0.0, 0.0, 0.0])).unwrap(), vec![128, 128, 128]);
    }

    #[test]
    fn other_latents_stretch_their_first_channels_and_bad_shapes_give_none() {
        // 16 channels, 2 pixels: channel k holds (k, k+1) -> each stretched to 0 and 255.
        let v: Vec<f32> = (0..16).flat_map(|k| [k as f32, k as f32 + 1.0]).collect();
        assert_eq!(project(&latent(16, &v)).unwrap(), vec![0, 0, 0, 255, 255, 255]);
        let short = StepLatent { image: 0, step: 0, steps: 1, channels: 4, width: 2, height: 2, latent: &[0.0; 15] };
        assert!(project(&short).is_none());
    }

    #[test]
    fn the_png_is_the_projection_enlarged() {
        let v = [0.0f32; 4 * 8 * 8];
        let l = StepLatent { image: 0, step: 0, steps: 1, channels: 4, width: 8, height: 8, latent: &v };
        let bytes = base64::engine::general_purpose::STANDARD.decode(png_b64(&l).unwrap()).unwrap();
        let img = image::load_from_memory(&bytes).unwrap().to_rgb8();
        assert_eq!((img.width(), img.height()), (64, 64));
        assert!(img.pixels().all(|p| p.0 == [128, 128, 128]));
    }
}
