//! Chroma1-Radiance's pixel-space ends: Chroma's transformer between a patch convolution on
//! the image and a NeRF-style head that turns each patch's hidden state into the weights of a
//! small per-pixel MLP.
//!
//! As the reference computes it (stable-diffusion.cpp `model/diffusion/flux.hpp`,
//! `Flux::forward_chroma_radiance`, `NerfEmbedder`, `NerfGLUBlock`, `NerfFinalLayerConv` and
//! `FluxRunner::fetch_dct_pos`):
//!
//! * **In**: `img_in_patch`, a `patch x patch` convolution with stride `patch` (16, or 32 for
//!   files marked `__32x32__`), from the 3-channel image in `[-1, 1]` to one token of the
//!   model's width per patch, in row-major patch order (FLUX's token order).
//! * **Between**: Chroma's approximator, double and single blocks, on those tokens; no final
//!   layer.
//! * **Out**, per patch: the patch's `patch^2` pixels (3 channels each) followed by the fixed
//!   DCT features of their positions (`max_freqs^2` = 64 values: `cos(pi fx x) cos(pi fy y) /
//!   (1 + fx fy)` over `x, y` in `[0, 1]` across the patch) go through `nerf_image_embedder`
//!   (67 -> 64). Then four `nerf_blocks`: each `param_generator` maps the patch's hidden state
//!   to three matrices (a gate and a value `64 -> 256`, an output `256 -> 64`), each row
//!   L2-normalised (eps 1e-12); the pixels take `x + out(silu(gate(n)) * value(n))` with `n`
//!   the block's RMSNorm of `x`. The pixels are put back in image order, RMS-normalised over
//!   their 64 channels (`nerf_final_layer_conv.norm`) and a 3x3 convolution gives the
//!   3-channel prediction.
//! * **x0 files** (a tensor named `__x0__`): the head predicts the clean image; the model's
//!   output becomes `(x - x0) / t`, the flow's velocity.
//!
//! The NeRF head's sizes are fixed (64 wide, MLP ratio 4, 4 blocks, 8 frequencies), as the
//! reference fixes them. Files whose patch convolution is half the patch (the reference's
//! "fake x2 patch", which interpolates the image first) are refused.

use sd_backends::{Context, GgmlType, Tensor};
use sd_sched::Weights;

use super::super::blocks;
use super::super::{DiffusionError, Result};
use super::{name, patchify, unpatchify, MODEL, PREFIX};
use crate::wtype::SpecSink;

/// The tensor whose presence marks Chroma1-Radiance (the reference's test).
pub const PROBE: &str = "nerf_final_layer_conv.conv.weight";
/// Width of the per-pixel features.
const NERF_HIDDEN: i64 = 64;
/// MLP width over [`NERF_HIDDEN`].
const NERF_MLP_RATIO: i64 = 4;
/// NeRF blocks.
pub const NERF_DEPTH: usize = 4;
/// DCT frequencies per axis.
pub const NERF_MAX_FREQS: i64 = 8;
/// Patch side of the released files.
const PATCH: i64 = 16;
/// Epsilon of the NeRF RMSNorms.
const RMS_EPS: f32 = 1e-6;
/// Epsilon of the generated matrices' L2 normalisation.
const L2_EPS: f32 = 1e-12;

/// The pixel-space options a file carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RadianceConfig {
    /// Patch side (16, or 32 for `__32x32__` files).
    pub patch: i64,
    /// Whether the head predicts the clean image (`__x0__` files).
    pub x0: bool,
}

impl RadianceConfig {
    /// The released Chroma1-Radiance: 16x16 patches, velocity prediction.
    pub fn released() -> Self {
        Self { patch: PATCH, x0: false }
    }
}

/// The pixel-space options of a file, or `None` when it has no NeRF head: `tensors` lists
/// (internal name, ggml shape). Errors name the tensor that does not fit.
pub(super) fn from_file(tensors: &[(String, Vec<u64>)]) -> Result<Option<RadianceConfig>> {
    let full = |rel: &str| format!("{PREFIX}.{rel}");
    let probe = full(PROBE);
    if !tensors.iter().any(|(n, _)| *n == probe) {
        return Ok(None);
    }
    let mut cfg = RadianceConfig::released();
    for (n, _) in tensors {
        if !n.starts_with(PREFIX) {
            continue;
        }
        cfg.x0 |= n.contains("__x0__");
        if n.contains("__32x32__") {
            cfg.patch = 32;
        }
    }
    let conv = full("img_in_patch.weight");
    match tensors.iter().find(|(n, _)| *n == conv).map(|(_, ne)| ne.as_slice()) {
        Some([kw, kh, 3, _]) if *kw as i64 == cfg.patch && *kh as i64 == cfg.patch => Ok(Some(cfg)),
        Some(ne) => Err(DiffusionError::Config {
            model: MODEL,
            reason: format!(
                "tensor '{conv}' has ggml shape {ne:?}, expected [{p}, {p}, 3, width] (a {p}x{p} patch \
                 convolution on RGB; half-size \"fake x2\" patches are not supported)",
                p = cfg.patch
            ),
        }),
        None => Err(DiffusionError::Config {
            model: MODEL,
            reason: format!("tensor '{conv}' is missing: a Chroma1-Radiance file has a patch convolution"),
        }),
    }
}

/// The patch convolution (the prelude's part).
pub(super) fn input_specs(s: &mut SpecSink<'_>, r: &RadianceConfig, hidden: i64) {
    s.conv2d(&name("img_in_patch"), 3, hidden, r.patch);
}

/// The NeRF head (in place of the final layer).
pub(super) fn head_specs(s: &mut SpecSink<'_>, hidden: i64) {
    s.linear(&name("nerf_image_embedder.embedder.0"), 3 + NERF_MAX_FREQS * NERF_MAX_FREQS, NERF_HIDDEN, true);
    for i in 0..NERF_DEPTH {
        let p = name(&format!("nerf_blocks.{i}"));
        s.linear(&format!("{p}.param_generator"), hidden, 3 * NERF_HIDDEN * NERF_HIDDEN * NERF_MLP_RATIO, true);
        s.push(format!("{p}.norm.scale"), GgmlType::GGML_TYPE_F32, &[NERF_HIDDEN]);
    }
    s.push(name("nerf_final_layer_conv.norm.scale"), GgmlType::GGML_TYPE_F32, &[NERF_HIDDEN]);
    s.conv2d(&name("nerf_final_layer_conv.conv"), NERF_HIDDEN, 3, 3);
}

/// The DCT features of a patch's positions, `[max_freqs^2, patch^2]` row-major by position
/// (the reference's `fetch_dct_pos`, in f32 as it computes them).
pub fn dct_features(patch: usize) -> Vec<f32> {
    let freqs = NERF_MAX_FREQS as usize;
    let pos: Vec<f32> = (0..patch).map(|i| i as f32 / (patch - 1) as f32).collect();
    let mut out = Vec::with_capacity(patch * patch * freqs * freqs);
    for i in 0..patch {
        for j in 0..patch {
            let (px, py) = (pos[j], pos[i]);
            for fx in 0..freqs {
                let cx = (px * fx as f32 * std::f32::consts::PI).cos();
                for fy in 0..freqs {
                    let cy = (py * fy as f32 * std::f32::consts::PI).cos();
                    out.push(cx * cy * (1.0 / (1.0 + fx as f32 * fy as f32)));
                }
            }
        }
    }
    out
}

/// The image `[W, H, 3, 1]` to its patch tokens `[hidden, W/p * H/p, 1]`.
pub(super) fn embed<'g>(g: &'g Context, w: &Weights, r: &RadianceConfig, x: Tensor<'g>) -> Result<Tensor<'g>> {
    let p = r.patch as i32;
    let y = blocks::conv2d(g, w, &name("img_in_patch"), x, p, 0)?; // [W/p, H/p, hidden, 1]
    let [pw, ph, hidden, _] = y.shape();
    Ok(g.cont(g.permute(g.reshape(y, &[pw * ph, hidden, 1, 1]), [1, 0, 2, 3])))
}

/// The NeRF head: the patches' hidden states `[hidden, P, 1]` (P patches in token order) and
/// the input image `x` `[W, H, 3, 1]` to the prediction `[W, H, 3, 1]`. `dct` is
/// [`dct_features`] as a `[64, patch^2]` input; `timestep` the sampler's t `[1]` (x0 files).
pub(super) fn decode<'g>(
    g: &'g Context,
    w: &Weights,
    r: &RadianceConfig,
    hidden: Tensor<'g>,
    x: Tensor<'g>,
    dct: Tensor<'g>,
    timestep: Tensor<'g>,
) -> Result<Tensor<'g>> {
    let p = r.patch;
    let [wd, ht, c, _] = x.shape();
    let patches = (wd / p) * (ht / p);
    // Each patch's pixels, channels innermost: [C, p^2, P].
    let px = g.reshape(patchify(g, x, p), &[p * p, c, patches, 1]);
    let px = g.cont(g.permute(px, [1, 0, 2, 3]));
    let feats = g.repeat_4d(dct, [NERF_MAX_FREQS * NERF_MAX_FREQS, p * p, patches, 1]);
    let mut v = blocks::linear(g, w, &name("nerf_image_embedder.embedder.0"), g.concat(px, feats, 0), true)?;
    let s = g.reshape(hidden, &[hidden.shape()[0], patches, 1, 1]);
    let (nh, mh) = (NERF_HIDDEN, NERF_HIDDEN * NERF_MLP_RATIO);
    for i in 0..NERF_DEPTH {
        let pre = name(&format!("nerf_blocks.{i}"));
        let params = blocks::linear(g, w, &format!("{pre}.param_generator"), s, true)?; // [3 nh mh, P]
        let nb1 = params.nb()[1];
        let (span, offset) = (nb1 * patches as usize, (nh * mh) as usize * params.nb()[0]);
        // The k-th generated matrix of a layer from `inp` to `outp` channels, per patch: stored
        // transposed, returned as ggml `[inp, outp, P]` (one row of `inp` weights per output),
        // every row L2-normalised.
        let matrix = |k: usize, inp: i64, outp: i64| {
            let m = g.cont(g.view(params, [nh * mh, patches, 1, 1], [nb1, span, span], k * offset));
            g.l2_norm(g.cont(g.permute(g.reshape(m, &[outp, inp, patches, 1]), [1, 0, 2, 3])), L2_EPS)
        };
        // The gate and value map nh to mh channels, the output mh back to nh.
        let (gate, value, out) = (matrix(0, nh, mh), matrix(1, nh, mh), matrix(2, mh, nh));
        let n = g.mul(g.rms_norm(v, RMS_EPS), w.get(&format!("{pre}.norm.scale"))?);
        let h = g.mul(g.silu(g.mul_mat(gate, n)), g.mul_mat(value, n)); // [mh, p^2, P]
        v = g.add(g.mul_mat(out, h), v);
    }
    // [nh, p^2, P] -> [p^2 * nh, P] -> the image's layout [W, H, nh, 1].
    let v = g.cont(g.permute(v, [1, 0, 2, 3]));
    let v = unpatchify(g, g.reshape(v, &[p * p * nh, patches, 1, 1]), wd, ht, p);
    // RMSNorm over the channels, then the 3x3 convolution.
    let v = g.cont(g.permute(v, [1, 2, 0, 3])); // [nh, W, H, 1]
    let v = g.mul(g.rms_norm(v, RMS_EPS), w.get(&name("nerf_final_layer_conv.norm.scale"))?);
    let v = g.cont(g.permute(v, [2, 0, 1, 3])); // [W, H, nh, 1]
    let y = blocks::conv2d(g, w, &name("nerf_final_layer_conv.conv"), v, 1, 1)?;
    if r.x0 {
        return Ok(g.div(g.sub(x, y), timestep));
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(extra: &[(&str, Vec<u64>)]) -> Vec<(String, Vec<u64>)> {
        let mut v = vec![(format!("{PREFIX}.{PROBE}"), vec![3, 3, 64, 3])];
        v.extend(extra.iter().map(|(n, s)| (format!("{PREFIX}.{n}"), s.clone())));
        v
    }

    /// Patch and prediction come from the file's markers; a patch convolution that does not
    /// fit is refused by name.
    #[test]
    fn options_come_from_the_file() {
        assert_eq!(from_file(&[]).unwrap(), None);
        let conv16 = ("img_in_patch.weight", vec![16, 16, 3, 256]);
        assert_eq!(
            from_file(&names(std::slice::from_ref(&conv16))).unwrap(),
            Some(RadianceConfig { patch: 16, x0: false })
        );
        let x0 = ("__x0__", vec![1]);
        assert_eq!(from_file(&names(&[conv16.clone(), x0])).unwrap(), Some(RadianceConfig { patch: 16, x0: true }));
        let conv32 = ("img_in_patch.weight", vec![32, 32, 3, 256]);
        let marked = ("__32x32__", vec![1]);
        assert_eq!(from_file(&names(&[conv32, marked.clone()])).unwrap().map(|r| r.patch), Some(32));
        let e = from_file(&names(&[conv16, marked])).unwrap_err().to_string();
        assert!(e.contains("img_in_patch.weight") && e.contains("fake x2"), "{e}");
        let e = from_file(&names(&[])).unwrap_err().to_string();
        assert!(e.contains("img_in_patch.weight") && e.contains("missing"), "{e}");
    }

    /// The DCT table: position 0 has every cosine 1 (so the values are the coefficients), the
    /// far corner alternates in sign with the frequencies.
    #[test]
    fn dct_features_follow_the_reference_formula() {
        let d = dct_features(16);
        assert_eq!(d.len(), 256 * 64);
        assert_eq!(d[0], 1.0);
        assert!((d[3 * 8 + 2] - 1.0 / 7.0).abs() < 1e-7);
        let last = &d[255 * 64..];
        // x = y = 1: cos(pi fx) cos(pi fy) / (1 + fx fy).
        assert!((last[8 + 1] - 1.0 / 2.0).abs() < 1e-6);
        assert!((last[1] + 1.0).abs() < 1e-6);
    }
}
