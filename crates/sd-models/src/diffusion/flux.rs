//! The FLUX.1 diffusion transformer (dev and schnell) as a ggml graph.
//!
//! References: Black Forest Labs' `flux` repository (`model.py`, `modules/layers.py`: the
//! module tree whose names the files use), and stable-diffusion.cpp's
//! `model/diffusion/flux.hpp`, `model/common/rope.hpp` and `model/diffusion/dit.hpp` (the
//! reference we must match, op by op).
//!
//! # Design
//!
//! * **Config from the file, as the reference infers it** ([`FluxConfig::from_file`]): the
//!   double and single block counts from the largest block index, `hidden_size` and
//!   `context_in_dim` from `txt_in.weight`, the head width from a `key_norm.scale` (heads =
//!   hidden / head width), guidance embedding from `guidance_in.in_layer.weight`. The rest
//!   (64 patchified input channels, `vec_in_dim` 768, `axes_dim` [16, 56, 56], theta 10000,
//!   MLP ratio 4, qkv bias) is fixed for FLUX.1 as in the reference; [`validate_against_file`]
//!   then names every tensor whose shape disagrees.
//! * **One layout walk** ([`layout`]): the prelude, `depth` double-stream blocks,
//!   `depth_single_blocks` single-stream blocks and the final layer; [`flux_specs`] and
//!   [`forward`] both walk it.
//! * **Storage types**: linear weights take the file's type or the `--type` override
//!   ([`crate::wtype::linear_weight_type`]; `img_in`, `txt_in`, `time_in`, `vector_in`,
//!   `guidance_in` and `final_layer` keep the file's type), biases and RMSNorm scales f32. The
//!   LayerNorms have no parameters (eps 1e-6, no affine).
//! * **Ops**: patchify 2x2 (`patchify`); `img_in`; `time_in(timestep_embedding(1000 t,
//!   256))` plus `guidance_in(timestep_embedding(1000 g, 256))` (dev) plus
//!   `vector_in(y)` as the modulation vector; `txt_in`; double blocks (modulation from
//!   `silu(vec)`, `x + x * scale + shift` after a LayerNorm, fused qkv split per head with
//!   RMSNorm on q and k, joint attention over txt then img with RoPE, projections and MLPs
//!   gated); the streams concatenated (txt first) for the single blocks (one linear for
//!   qkv and the MLP input, attention and GELU output concatenated into `linear2`); the img
//!   tokens through the final layer; unpatchify. GELU is ggml's tanh form.
//! * **RMSNorm** is composed from `sqr`, `mean`, `add`, `sqrt`, `div` as in `text/t5.rs`
//!   (sd-backends wraps no `rms_norm`); the reference's fused kernel rounds differently in
//!   the last bits only. The q/k views are made contiguous first (an exact copy).
//! * **RoPE** ([`rope_pe`]): computed on the host in f32 as the reference does: text ids
//!   are zero, image ids `(0, row, col)`; per axis the angles `pos / theta^(2i/d)` as
//!   rotation matrices `[[cos, -sin], [sin, cos]]`, the axes concatenated. Applied to q and k
//!   as the reference does (pairs of adjacent channels rotated).
//! * **Cuts**: `flux.prelude.{img,txt,vec}` (the two streams and the modulation vector,
//!   which every block reads: it and the pe cross every cut as bound tensors), then per double block two cuts, `flux.double_blocks.N.img`
//!   and `flux.double_blocks.N.txt` (the img stream's nodes first, then the rest of the txt
//!   stream: both read only block N's weights, so the planner merges them into one segment
//!   when they fit), then `flux.single_blocks.N`. The txt stream of a double block crosses
//!   the img cut as a bound tensor, like the UNet's skips.
//! * **Batch**: one sample per graph, as the reference (it asserts a batch of 1). Latent
//!   sizes must be even (the reference pads odd sizes; the pipeline's sizes are multiples
//!   of 16 pixels, so this is refused with an error rather than padded).

use sd_backends::{Context, GgmlType, Tensor};
use sd_sched::{TensorSpec, Weights};

use super::blocks::{self, AttnKernel};
use super::{DiffusionError, Result};
use crate::wtype::SpecSink;

pub mod chroma;
pub mod radiance;

const MODEL: &str = "FLUX";
/// Internal prefix of every FLUX parameter (BFL's bare names and ComfyUI's
/// `model.diffusion_model.` names both land here).
pub const PREFIX: &str = "model.diffusion_model";
/// Patch side of FLUX.1 (FLUX.2's latent comes in patches from its VAE: 1).
const PATCH: i64 = 2;
/// A FLUX.2 tensor (its shared modulation): the reference's test for the version.
const FLUX2_PROBE: &str = "double_stream_modulation_img.lin.weight";
/// Width of the sinusoidal timestep and guidance embeddings.
const TIME_DIM: i64 = 256;
/// The reference multiplies timesteps and guidance by 1000 before the embedding.
const TIME_FACTOR: f32 = 1000.0;
/// Max period of the sinusoidal embeddings.
const MAX_PERIOD: i32 = 10000;
/// LayerNorm and RMSNorm epsilon.
const EPS: f32 = 1e-6;
/// Graph size bound: about 170 nodes per double block, 90 per single block.
const NODES_PER_BLOCK: usize = 256;

/// Hyper-parameters of a FLUX.1 transformer.
#[derive(Clone, Debug, PartialEq)]
pub struct FluxConfig {
    /// Patchified input channels (16 latent channels x 2 x 2).
    pub in_channels: i64,
    /// Patchified output channels.
    pub out_channels: i64,
    /// Width of the pooled text vector (CLIP-L's pooled output).
    pub vec_in_dim: i64,
    /// Width of the text context (T5-XXL's hidden states).
    pub context_in_dim: i64,
    /// Width of the residual streams.
    pub hidden_size: i64,
    /// Attention heads.
    pub num_heads: i64,
    /// Double-stream blocks.
    pub depth: usize,
    /// Single-stream blocks.
    pub depth_single_blocks: usize,
    /// RoPE channels per axis (FLUX.1: index, row, column; FLUX.2 adds the text position);
    /// their sum is the head width.
    pub axes_dim: Vec<i64>,
    /// RoPE base.
    pub theta: f32,
    /// MLP width over hidden width.
    pub mlp_ratio: i64,
    /// Whether the qkv projections have biases.
    pub qkv_bias: bool,
    /// Latent pixels per token side (FLUX.1: 2; FLUX.2: 1, its VAE patches the latent).
    pub patch: i64,
    /// FLUX.2: no biases anywhere, one modulation shared by all double blocks (per stream)
    /// and one by all single blocks (`double_stream_modulation_{img,txt}`,
    /// `single_stream_modulation`), SiLU-gated MLPs (`silu(gate) * x`, the gate first), text
    /// positions on RoPE's fourth axis.
    pub flux2: bool,
    /// Whether the model embeds a distilled guidance scale (dev; schnell has none).
    pub guidance_embed: bool,
    /// Chroma: the distilled-guidance approximator in place of the embedders and the
    /// modulation projections ([`chroma`]); `None` for FLUX.1.
    pub chroma: Option<chroma::ChromaConfig>,
    /// Chroma1-Radiance: pixel space, a patch convolution in and a NeRF head out
    /// ([`radiance`]); `None` for the latent-space models.
    pub radiance: Option<radiance::RadianceConfig>,
}

impl FluxConfig {
    /// FLUX.1-dev: 19 double and 38 single blocks of width 3072, 24 heads, guidance embedding.
    pub fn dev() -> Self {
        Self {
            in_channels: 64,
            out_channels: 64,
            vec_in_dim: 768,
            context_in_dim: 4096,
            hidden_size: 3072,
            num_heads: 24,
            depth: 19,
            depth_single_blocks: 38,
            axes_dim: vec![16, 56, 56],
            theta: 10000.0,
            mlp_ratio: 4,
            qkv_bias: true,
            patch: PATCH,
            flux2: false,
            guidance_embed: true,
            chroma: None,
            radiance: None,
        }
    }

    /// FLUX.2 klein 4B: 5 double and 20 single blocks of width 3072, 24 heads, Qwen3-4B's
    /// three layers as the context (7680), 128 patched latent channels, no guidance embedding.
    pub fn flux2_klein_4b() -> Self {
        Self { depth: 5, depth_single_blocks: 20, context_in_dim: 7680, guidance_embed: false, ..Self::flux2_base() }
    }

    /// FLUX.2 dev: 8 double and 48 single blocks of width 6144, 48 heads, Mistral-Small-3.2's
    /// three layers as the context (15360), the guidance embedding.
    pub fn flux2_dev() -> Self {
        Self {
            hidden_size: 6144,
            num_heads: 48,
            depth: 8,
            depth_single_blocks: 48,
            context_in_dim: 15360,
            guidance_embed: true,
            ..Self::flux2_base()
        }
    }

    /// The FLUX.2 settings the reference fixes (`sd_version_is_flux2`); depths and widths
    /// come from the file.
    fn flux2_base() -> Self {
        Self {
            in_channels: 128,
            out_channels: 128,
            vec_in_dim: 0,
            mlp_ratio: 3,
            theta: 2000.0,
            axes_dim: vec![32, 32, 32, 32],
            qkv_bias: false,
            patch: 1,
            flux2: true,
            ..Self::dev()
        }
    }

    /// `self` in pixel space (Chroma1-Radiance): RGB read and predicted in `r.patch` patches.
    pub fn with_radiance(self, r: radiance::RadianceConfig) -> Self {
        let pixels = 3 * r.patch * r.patch;
        Self { radiance: Some(r), patch: r.patch, in_channels: pixels, out_channels: pixels, ..self }
    }

    /// Whether the linear layers have biases (all but FLUX.2's).
    pub fn bias(&self) -> bool {
        !self.flux2
    }

    /// FLUX.1-schnell: dev without the guidance embedding.
    pub fn schnell() -> Self {
        Self { guidance_embed: false, ..Self::dev() }
    }

    /// Width of one head.
    pub fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_heads.max(1)
    }

    /// Width of the MLPs.
    pub(crate) fn mlp_hidden(&self) -> i64 {
        self.hidden_size * self.mlp_ratio
    }

    /// Width of the MLPs' first projection: twice [`FluxConfig::mlp_hidden`] when gated.
    fn mlp_in(&self) -> i64 {
        self.mlp_hidden() * if self.flux2 { 2 } else { 1 }
    }

    /// The configuration the reference infers from a file's tensors: `tensors` lists
    /// (internal name, ggml shape innermost first). Errors name the tensor that is missing
    /// or malformed.
    pub fn from_file(tensors: &[(String, Vec<u64>)]) -> Result<Self> {
        let bad = |reason: String| Err(DiffusionError::Config { model: MODEL, reason });
        let flux2 = tensors.iter().any(|(n, _)| n.strip_prefix(&format!("{PREFIX}.")) == Some(FLUX2_PROBE));
        let base = if flux2 { Self::flux2_base() } else { Self::dev() };
        let mut cfg = Self { depth: 0, depth_single_blocks: 0, guidance_embed: false, ..base };
        let mut head_dim = None;
        let mut txt_in = None;
        let prefix = format!("{PREFIX}.");
        for (name, ne) in tensors {
            let Some(rel) = name.strip_prefix(&prefix) else { continue };
            if rel == "guidance_in.in_layer.weight" {
                cfg.guidance_embed = true;
            }
            for (marker, count) in
                [("double_blocks.", &mut cfg.depth), ("single_blocks.", &mut cfg.depth_single_blocks)]
            {
                if let Some(rest) = rel.strip_prefix(marker) {
                    let index = rest.split('.').next().unwrap_or("");
                    match index.parse::<usize>() {
                        Ok(i) if i < 4096 => *count = (*count).max(i + 1),
                        _ => return bad(format!("tensor '{name}' has no valid block index after '{marker}'")),
                    }
                }
            }
            if rel == "txt_in.weight" {
                txt_in = Some(ne.clone());
            }
            if rel == "single_blocks.0.norm.key_norm.scale" || rel == "double_blocks.0.txt_attn.norm.key_norm.scale" {
                head_dim = Some(ne.first().copied().unwrap_or(0));
            }
        }
        cfg.chroma = chroma::from_file(tensors)?;
        if let Some(r) = radiance::from_file(tensors)? {
            cfg = cfg.with_radiance(r);
        }
        if cfg.chroma.is_some() {
            // Chroma has no vector_in: the conditioner's vector is the text mask.
            cfg.vec_in_dim = 0;
        }
        let txt_name = format!("{PREFIX}.txt_in.weight");
        match txt_in.as_deref() {
            Some([inp, hidden, rest @ ..]) if rest.iter().all(|&d| d == 1) && *inp > 0 && *hidden > 0 => {
                cfg.context_in_dim = *inp as i64;
                cfg.hidden_size = *hidden as i64;
            }
            Some(ne) => return bad(format!("tensor '{txt_name}' has shape {ne:?}, expected [context_in_dim, hidden]")),
            None => return bad(format!("tensor '{txt_name}' is missing: it gives the model's width")),
        }
        if let Some(hd) = head_dim {
            if hd == 0 || cfg.hidden_size % hd as i64 != 0 {
                return bad(format!(
                    "the key_norm scale has {hd} values, which do not divide the width {} into heads",
                    cfg.hidden_size
                ));
            }
            cfg.num_heads = cfg.hidden_size / hd as i64;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks that the numbers describe a network the graph can be built for.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(DiffusionError::Config { model: MODEL, reason });
        let widths = [self.in_channels, self.out_channels, self.context_in_dim, self.hidden_size, self.num_heads];
        if widths.iter().any(|&w| w <= 0) || self.mlp_ratio <= 0 || self.vec_in_dim < 0 {
            return bad(format!("widths must be positive: {self:?}"));
        }
        if self.hidden_size % self.num_heads != 0 {
            return bad(format!("width {} is not a multiple of {} heads", self.hidden_size, self.num_heads));
        }
        let axes: i64 = self.axes_dim.iter().sum();
        if self.axes_dim.iter().any(|&a| a <= 0 || a % 2 != 0) || axes != self.head_dim() {
            return bad(format!(
                "RoPE axes {:?} must be even and sum to the head width {} (width {} / {} heads)",
                self.axes_dim,
                self.head_dim(),
                self.hidden_size,
                self.num_heads
            ));
        }
        let p = self.patch;
        let patches = if self.radiance.is_some() { [16, 32].contains(&p) } else { (1..=2).contains(&p) };
        if !patches || self.in_channels % (p * p) != 0 || self.out_channels % (p * p) != 0 {
            return bad(format!("channels {} / {} are not whole {p}x{p} patches", self.in_channels, self.out_channels));
        }
        if self.radiance.is_some() && (self.chroma.is_none() || self.latent_channels() != 3) {
            return bad("a pixel-space (Radiance) model is a Chroma model on RGB".into());
        }
        if self.flux2 && (self.chroma.is_some() || self.vec_in_dim != 0) {
            return bad("a FLUX.2 model has neither an approximator nor vector_in".into());
        }
        if self.depth + self.depth_single_blocks == 0 {
            return bad("the file has neither double_blocks nor single_blocks".into());
        }
        if !(self.theta.is_finite() && self.theta > 1.0) {
            return bad(format!("RoPE theta {} must be above 1", self.theta));
        }
        if let Some(c) = &self.chroma {
            if self.guidance_embed || self.vec_in_dim != 0 {
                return bad("a Chroma model has neither guidance_in nor vector_in".into());
            }
            if c.inner <= 0 || c.layers == 0 {
                return bad(format!("the approximator needs a positive width and layers: {c:?}"));
            }
            chroma::validate(self.depth, self.depth_single_blocks)?;
        }
        Ok(())
    }

    /// Latent channels before patchifying.
    pub fn latent_channels(&self) -> i64 {
        self.in_channels / (self.patch * self.patch)
    }
}

// ---------------------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------------------

/// One unit of the layout walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// `img_in`, `time_in`, `guidance_in`, `vector_in`, `txt_in`.
    Prelude,
    /// `double_blocks.N`.
    Double(usize),
    /// `single_blocks.N`.
    Single(usize),
    /// `final_layer`.
    Final,
}

/// The blocks in execution order.
pub fn layout(cfg: &FluxConfig) -> Vec<Block> {
    let mut v = vec![Block::Prelude];
    v.extend((0..cfg.depth).map(Block::Double));
    v.extend((0..cfg.depth_single_blocks).map(Block::Single));
    v.push(Block::Final);
    v
}

fn name(rel: &str) -> String {
    format!("{PREFIX}.{rel}")
}

fn mlp_embedder_specs(s: &mut SpecSink<'_>, p: &str, inp: i64, hidden: i64, bias: bool) {
    s.linear(&format!("{p}.in_layer"), inp, hidden, bias);
    s.linear(&format!("{p}.out_layer"), hidden, hidden, bias);
}

fn qk_norm_specs(s: &mut SpecSink<'_>, p: &str, head_dim: i64) {
    for n in ["query_norm", "key_norm"] {
        s.push(format!("{p}.norm.{n}.scale"), GgmlType::GGML_TYPE_F32, &[head_dim]);
    }
}

/// The parameters of `cfg` with the types the reference stores them in: `dtype_of(name)`
/// is the file's type of the internal name (`None` when the file lacks it), `wtype` the
/// `--type` override.
pub fn flux_specs(
    cfg: &FluxConfig,
    dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
    wtype: Option<GgmlType>,
) -> Vec<TensorSpec> {
    let mut s = SpecSink::new(dtype_of, wtype);
    let (h, hd, mlp) = (cfg.hidden_size, cfg.head_dim(), cfg.mlp_hidden());
    let bias = cfg.bias();
    for block in layout(cfg) {
        match block {
            Block::Prelude => {
                match &cfg.radiance {
                    Some(r) => radiance::input_specs(&mut s, r, h),
                    None => s.linear(&name("img_in"), cfg.in_channels, h, bias),
                }
                if let Some(c) = &cfg.chroma {
                    chroma::specs(&mut s, c, h);
                    s.linear(&name("txt_in"), cfg.context_in_dim, h, true);
                    continue;
                }
                mlp_embedder_specs(&mut s, &name("time_in"), TIME_DIM, h, bias);
                if cfg.vec_in_dim > 0 {
                    mlp_embedder_specs(&mut s, &name("vector_in"), cfg.vec_in_dim, h, bias);
                }
                if cfg.guidance_embed {
                    mlp_embedder_specs(&mut s, &name("guidance_in"), TIME_DIM, h, bias);
                }
                if cfg.flux2 {
                    s.linear(&name("double_stream_modulation_img.lin"), h, 6 * h, false);
                    s.linear(&name("double_stream_modulation_txt.lin"), h, 6 * h, false);
                    s.linear(&name("single_stream_modulation.lin"), h, 3 * h, false);
                }
                s.linear(&name("txt_in"), cfg.context_in_dim, h, bias);
            }
            Block::Double(i) => {
                for stream in ["img", "txt"] {
                    let p = name(&format!("double_blocks.{i}.{stream}"));
                    if cfg.chroma.is_none() && !cfg.flux2 {
                        s.linear(&format!("{p}_mod.lin"), h, 6 * h, true);
                    }
                    s.linear(&format!("{p}_attn.qkv"), h, 3 * h, cfg.qkv_bias);
                    qk_norm_specs(&mut s, &format!("{p}_attn"), hd);
                    s.linear(&format!("{p}_attn.proj"), h, h, bias);
                    s.linear(&format!("{p}_mlp.0"), h, cfg.mlp_in(), bias);
                    s.linear(&format!("{p}_mlp.2"), mlp, h, bias);
                }
            }
            Block::Single(i) => {
                let p = name(&format!("single_blocks.{i}"));
                s.linear(&format!("{p}.linear1"), h, 3 * h + cfg.mlp_in(), bias);
                s.linear(&format!("{p}.linear2"), h + mlp, h, bias);
                qk_norm_specs(&mut s, &p, hd);
                if cfg.chroma.is_none() && !cfg.flux2 {
                    s.linear(&format!("{p}.modulation.lin"), h, 3 * h, true);
                }
            }
            Block::Final if cfg.radiance.is_some() => radiance::head_specs(&mut s, h),
            Block::Final => {
                s.linear(&name("final_layer.linear"), h, cfg.out_channels, bias);
                if cfg.chroma.is_none() {
                    s.linear(&name("final_layer.adaLN_modulation.1"), h, 2 * h, bias);
                }
            }
        }
    }
    s.specs
}

/// The parameter group (block) of an internal FLUX name, for staging: `prelude` (the input
/// embeddings), `double_blocks.N`, `single_blocks.N` or `final_layer`, the order the graph
/// uses them, matching the cuts of [`forward`].
pub fn group_of(name: &str) -> String {
    let rel = name.strip_prefix(PREFIX).and_then(|r| r.strip_prefix('.')).unwrap_or(name);
    let mut parts = rel.split('.');
    match (parts.next(), parts.next()) {
        (Some(b @ ("double_blocks" | "single_blocks")), Some(i)) => format!("{b}.{i}"),
        (Some("final_layer"), _) => "final_layer".into(),
        // Chroma1-Radiance's head runs where the final layer would.
        (Some(head), _) if head.starts_with("nerf_") => "final_layer".into(),
        _ => "prelude".into(),
    }
}

/// Checks a file's FLUX tensors against `specs` (as [`super::validate_against_file`] does
/// for the UNet): every missing tensor and shape mismatch in one error, naming each; on
/// success the unused names under the prefix, for a warning.
pub fn validate_against_file(specs: &[TensorSpec], file: &[(String, Vec<u64>)]) -> Result<Vec<String>> {
    match super::validate_against_file(specs, file) {
        Err(DiffusionError::WeightsMismatch { problems, .. }) => {
            Err(DiffusionError::WeightsMismatch { model: MODEL, problems })
        }
        other => other,
    }
}

// ---------------------------------------------------------------------------------------
// Positional embedding
// ---------------------------------------------------------------------------------------

/// `n` values from `start` to `end` as the reference spaces them in f32.
pub(super) fn linspace(start: f32, end: f32, n: usize) -> Vec<f32> {
    if n == 1 {
        return vec![start];
    }
    let step = (end - start) / (n - 1) as f32;
    (0..n).map(|i| start + i as f32 * step).collect()
}

/// The rotation matrices of one axis for positions `pos`: per position `dim / 2` blocks of
/// `[cos, -sin, sin, cos]`.
pub(super) fn rope_axis(pos: &[f32], dim: usize, theta: f32) -> Vec<Vec<f32>> {
    let half = dim / 2;
    let scale = linspace(0.0, (dim as f32 - 2.0) / dim as f32, half);
    let omega: Vec<f32> = scale.iter().map(|&s| 1.0 / theta.powf(s)).collect();
    pos.iter()
        .map(|&p| {
            omega
                .iter()
                .flat_map(|&w| {
                    let a = p * w;
                    [a.cos(), -a.sin(), a.sin(), a.cos()]
                })
                .collect()
        })
        .collect()
}

/// The step between reference images on the first RoPE axis (the reference's
/// `ref_index_scale` of FLUX.2, whose index grows by one per reference).
const REF_INDEX_SCALE: f32 = 10.0;

/// Number of image tokens of a `w` x `h` latent read in `patch` x `patch` patches.
pub fn image_tokens(w: usize, h: usize, patch: usize) -> usize {
    w.div_ceil(patch) * h.div_ceil(patch)
}

/// The positional embedding of `txt_tokens` text tokens followed by the image tokens of a
/// `w` x `h` latent: ggml `[2, 2, head_dim / 2, tokens]`, as the reference computes it
/// (text ids zero, image ids `(0, row, col)`; FLUX.2's text ids carry their position on the
/// fourth axis, its image ids a zero there).
pub fn rope_pe(cfg: &FluxConfig, txt_tokens: usize, dims: (usize, usize)) -> Vec<f32> {
    rope_pe_with_refs(cfg, txt_tokens, dims, &[], false)
}

/// [`rope_pe`] with the tokens of reference latents of `refs` (`(width, height)` each) after
/// the image's, as the reference numbers them. FLUX.2: the k-th reference (from 0) has ids
/// `(10 (k + 1), row, col, 0)`, each a picture of its own beside the generated one. FLUX.1
/// (Kontext): every reference has index 1, laid out beside the ones before it: below them
/// when that keeps the whole taller than wide, else to their right (the offsets in latent
/// positions, added to the rows and columns of patches, as the reference adds them); with
/// `increase_ref_index` the k-th has index `k + 1` and no offset instead.
pub fn rope_pe_with_refs(
    cfg: &FluxConfig,
    txt_tokens: usize,
    (w, h): (usize, usize),
    refs: &[(usize, usize)],
    increase_ref_index: bool,
) -> Vec<f32> {
    let p = cfg.patch as usize;
    let n_axes = cfg.axes_dim.len();
    let mut ids = vec![vec![0f32; n_axes]; txt_tokens];
    if cfg.flux2 {
        for (i, id) in ids.iter_mut().enumerate() {
            id[3] = i as f32;
        }
    }
    // `index` on the first axis: 0 for the image, then the references'; rows and columns from
    // the offsets.
    let mut grid = |index: f32, (w, h): (usize, usize), (h_off, w_off): (usize, usize)| {
        let (h_len, w_len) = ((h + p / 2) / p, (w + p / 2) / p);
        let (h0, w0) = (h_off as f32, w_off as f32);
        let rows = linspace(h0, h0 + h_len as f32 - 1.0, h_len);
        let cols = linspace(w0, w0 + w_len as f32 - 1.0, w_len);
        for row in &rows {
            for col in &cols {
                let mut id = vec![0f32; n_axes];
                (id[0], id[1], id[2]) = (index, *row, *col);
                ids.push(id);
            }
        }
    };
    grid(0.0, (w, h), (0, 0));
    let (mut cur_h, mut cur_w) = (0, 0);
    for (k, &(rw, rh)) in refs.iter().enumerate() {
        if cfg.flux2 || increase_ref_index {
            let scale = if cfg.flux2 { REF_INDEX_SCALE } else { 1.0 };
            grid(((k + 1) as f32 * scale).trunc(), (rw, rh), (0, 0));
            continue;
        }
        let (h_off, w_off) = if rh + cur_h > rw + cur_w { (0, cur_w) } else { (cur_h, 0) };
        grid(1.0, (rw, rh), (h_off, w_off));
        (cur_h, cur_w) = (cur_h.max(rh + h_off), cur_w.max(rw + w_off));
    }
    let n = ids.len();
    let axes: Vec<Vec<Vec<f32>>> = (0..n_axes)
        .map(|a| {
            let pos: Vec<f32> = ids.iter().map(|id| id[a]).collect();
            rope_axis(&pos, cfg.axes_dim[a] as usize, cfg.theta)
        })
        .collect();
    let mut out = Vec::with_capacity(n * cfg.head_dim() as usize * 2);
    for t in 0..n {
        for axis in &axes {
            out.extend_from_slice(&axis[t]);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// Blocks
// ---------------------------------------------------------------------------------------

/// The graph inputs every block reads besides the streams.
#[derive(Clone, Debug)]
pub struct Shared<'g> {
    /// The modulation vector `[hidden, 1]`.
    pub vec: Tensor<'g>,
    /// The positional embedding `[2, 2, head_dim / 2, tokens]` (txt tokens first).
    pub pe: Tensor<'g>,
    /// RMSNorm's epsilon `[1]`.
    pub eps: Tensor<'g>,
    /// The attention kernel.
    pub kernel: AttnKernel,
    /// Chroma's DiT mask `[txt + img tokens]` (0 or -inf), added to the scores over the keys.
    pub mask: Option<Tensor<'g>>,
    /// FLUX.2's shared modulations: the double blocks' img and txt triples (6 each), the
    /// single blocks' (3), computed once in the prelude.
    pub(crate) shared_mods: Option<SharedMods<'g>>,
}

/// FLUX.2's modulations, shared by every block of a kind.
#[derive(Clone, Debug)]
pub(crate) struct SharedMods<'g> {
    img: Vec<Tensor<'g>>,
    txt: Vec<Tensor<'g>>,
    single: Vec<Tensor<'g>>,
}

fn weight<'w>(w: &'w Weights, name: &str) -> Result<Tensor<'w>> {
    Ok(w.get(name)?)
}

/// `x / sqrt(mean(x^2) + eps) * scale` over ne[0].
fn rms_norm<'g>(g: &'g Context, x: Tensor<'g>, scale: Tensor<'_>, eps: Tensor<'_>) -> Tensor<'g> {
    let ms = g.mean(g.sqr(x));
    g.mul(g.div(x, g.sqrt(g.add(ms, eps))), scale)
}

/// `[[shift, scale, gate]; k]` from `lin(silu(vec))`: `k` triples, each a `[hidden, 1]` view.
fn modulation<'g>(g: &'g Context, w: &Weights, p: &str, vec: Tensor<'g>, k: i64) -> Result<Vec<Tensor<'g>>> {
    modulation_with(g, w, p, vec, k, true)
}

/// [`modulation`] with or without the projection's bias (FLUX.2 has none).
fn modulation_with<'g>(
    g: &'g Context,
    w: &Weights,
    p: &str,
    vec: Tensor<'g>,
    k: i64,
    bias: bool,
) -> Result<Vec<Tensor<'g>>> {
    let h = vec.shape()[0];
    let m = blocks::linear(g, w, p, g.silu(vec), bias)?; // [k * hidden, 1]
                                                         // The reference's reshape to [hidden, k, 1] and permute to [hidden, 1, k] (a copy).
    let m = g.cont(g.permute(g.reshape(m, &[h, k, 1]), [0, 2, 1, 3]));
    let nb = m.nb();
    Ok((0..k).map(|j| g.view(m, [h, 1, 1, 1], [nb[1], nb[1], nb[1]], j as usize * nb[1])).collect())
}

/// `x + x * scale + shift` (scale and shift `[hidden, 1]`, broadcast over tokens).
fn modulate<'g>(g: &'g Context, x: Tensor<'g>, shift: Tensor<'g>, scale: Tensor<'g>) -> Tensor<'g> {
    let x = g.add(x, g.mul(x, scale));
    g.add(x, shift)
}

/// LayerNorm without parameters.
fn layer_norm<'g>(g: &'g Context, x: Tensor<'g>) -> Tensor<'g> {
    g.norm(x, EPS)
}

/// q, k, v of `qkv` `[width, L, 1]` at byte offsets 0, `hidden`, `2 hidden` (in f32
/// elements), each `[head_dim, heads, L, 1]`; q and k RMS-normed with `{p}.norm.*`.
fn split_qkv<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &FluxConfig,
    p: &str,
    qkv: Tensor<'g>,
    eps: Tensor<'g>,
) -> Result<[Tensor<'g>; 3]> {
    let (hd, heads, h) = (cfg.head_dim(), cfg.num_heads, cfg.hidden_size);
    let l = qkv.shape()[1];
    let nb = qkv.nb();
    let part =
        |j: i64| g.view(qkv, [hd, heads, l, 1], [nb[0] * hd as usize, nb[1], nb[2]], j as usize * nb[0] * h as usize);
    let q = rms_norm(g, g.cont(part(0)), weight(w, &format!("{p}.norm.query_norm.scale"))?, eps);
    let k = rms_norm(g, g.cont(part(1)), weight(w, &format!("{p}.norm.key_norm.scale"))?, eps);
    Ok([q, k, part(2)])
}

/// The reference's RoPE: x `[head_dim, heads, L, 1]` -> `[head_dim, L, heads]`, adjacent
/// channel pairs rotated by `pe`.
fn apply_rope<'g>(g: &'g Context, x: Tensor<'g>, pe: Tensor<'g>) -> Tensor<'g> {
    let [d, heads, l, n] = x.shape();
    let x = g.cont(g.permute(x, [0, 2, 1, 3])); // [d, L, heads, N]
    let x = g.reshape(x, &[2, d / 2, l, heads * n]);
    let x = g.cont(g.permute(x, [3, 0, 1, 2])); // [d/2, L, heads*N, 2]
    let nb = x.nb();
    let half = |j: usize| {
        let v = g.view(x, [d / 2, l, heads * n, 1], [nb[1], nb[2], nb[2] * (heads * n) as usize], j * nb[3]);
        g.repeat(g.reshape(v, &[1, d / 2, l, heads * n]), g.new_f32(&[2, d / 2, l, heads * n]))
    };
    let (x0, x1) = (half(0), half(1));
    let pe = g.cont(g.permute(pe, [3, 0, 1, 2])); // [2, d/2, L, 2]
    let pnb = pe.nb();
    let [p0, p1, p2, _] = pe.shape();
    let pe_half = |j: usize| g.view(pe, [p0, p1, p2, 1], [pnb[1], pnb[2], pnb[3]], j * pnb[3]);
    let out = g.add(g.mul(x0, pe_half(0)), g.mul(x1, pe_half(1)));
    g.reshape(out, &[d, l, heads * n])
}

/// Attention with RoPE: q, k, v `[head_dim, heads, L, 1]` -> `[hidden, L, 1]`.
fn attention<'g>(g: &'g Context, q: Tensor<'g>, k: Tensor<'g>, v: Tensor<'g>, s: &Shared<'g>) -> Tensor<'g> {
    rope_attention(g, q, k, v, s.pe, s.kernel, 1.0, s.mask)
}

/// The reference's `Rope::attention`: q `[head_dim, heads, L, 1]`, k and v `[head_dim,
/// kv_heads, L, 1]` (query head `h` reads key/value head `h / (heads / kv_heads)`, by ggml's
/// broadcasting matmul) -> `[head_dim * heads, L, 1]`. `kv_scale` is the reference's overflow
/// guard of the flash path (k and v scaled before the f16 cast, the output scaled back); the
/// plain path ignores it, as the reference's does. `mask` `[L]` (Chroma's DiT mask) is added
/// to the scaled scores over the keys, as the reference's plain path does; a masked
/// attention always takes the plain path here.
#[allow(clippy::too_many_arguments)]
pub(super) fn rope_attention<'g>(
    g: &'g Context,
    q: Tensor<'g>,
    k: Tensor<'g>,
    v: Tensor<'g>,
    pe: Tensor<'g>,
    kernel: AttnKernel,
    kv_scale: f32,
    mask: Option<Tensor<'g>>,
) -> Tensor<'g> {
    let [d, heads, l, _] = q.shape();
    let kv_heads = v.shape()[1];
    let q = apply_rope(g, q, pe); // [d, L, heads]
    let k = apply_rope(g, k, pe);
    let scale = 1.0 / (d as f32).sqrt();
    let flash = match kernel {
        _ if mask.is_some() => None,
        AttnKernel::Plain => None,
        AttnKernel::Flash | AttnKernel::FlashWhereSupported(_) => {
            let scaled = |t: Tensor<'g>| if kv_scale != 1.0 { g.scale(t, kv_scale) } else { t };
            let k16 = g.cast(scaled(k), GgmlType::GGML_TYPE_F16);
            let v = scaled(g.reshape(g.cont(g.permute(v, [0, 2, 1, 3])), &[d, l, kv_heads]));
            let v16 = g.cast(v, GgmlType::GGML_TYPE_F16);
            let out = g.flash_attn_ext(q, k16, v16, None, scale / kv_scale); // [d, heads, L, 1]
            match kernel {
                AttnKernel::FlashWhereSupported(dev) if !dev.supports_op(out) => None,
                _ if kv_scale != 1.0 => Some(g.scale(out, 1.0 / kv_scale)),
                _ => Some(out),
            }
        }
    };
    if let Some(out) = flash {
        return g.reshape(out, &[d * heads, l, 1]);
    }
    let vt = g.reshape(g.cont(g.permute(v, [1, 2, 0, 3])), &[l, d, kv_heads]); // [L, d, kv_heads]
    let kq = g.mul_mat_prec_f32(k, q); // [Lk, Lq, heads]
                                       // The reference scales in its own node, then takes a plain softmax: the same single
                                       // multiply as the fused scale.
    let kq = match mask {
        // The reference's order: scale, add the mask, softmax.
        Some(m) => g.soft_max_ext(g.add(g.scale(kq, scale), m), None, 1.0, 0.0),
        None => g.soft_max_ext(kq, None, scale, 0.0),
    };
    let kqv = g.mul_mat(vt, kq); // [d, Lq, heads]
    let kqv = g.cont(g.permute(g.reshape(kqv, &[d, l, heads, 1]), [0, 2, 1, 3])); // [d, heads, L, 1]
    g.reshape(kqv, &[d * heads, l, 1])
}

/// `{p}.2(gelu({p}.0(x)))`, FLUX.2's `{p}.2(silu_act({p}.0(x)))` without biases.
fn mlp<'g>(g: &'g Context, w: &Weights, cfg: &FluxConfig, p: &str, x: Tensor<'g>) -> Result<Tensor<'g>> {
    let y = blocks::linear(g, w, &format!("{p}.0"), x, cfg.bias())?;
    let y = if cfg.flux2 { silu_act(g, y) } else { g.gelu(y) };
    blocks::linear(g, w, &format!("{p}.2"), y, cfg.bias())
}

/// The reference's `ggml_ext_silu_act`: `x` `[2n, ...]` halved along ne[0], the first half
/// the gate: `second * silu(first)`.
fn silu_act<'g>(g: &'g Context, x: Tensor<'g>) -> Tensor<'g> {
    let [n2, a, b, c] = x.shape();
    let nb = x.nb();
    let half = n2 / 2;
    let gate = g.cont(g.view(x, [half, a, b, c], [nb[1], nb[2], nb[3]], 0));
    let value = g.view(x, [half, a, b, c], [nb[1], nb[2], nb[3]], half as usize * nb[0]);
    g.mul(value, g.silu(gate))
}

/// A double-stream block: `(img [hidden, L_img, 1], txt [hidden, L_txt, 1])` -> the same.
/// Its joint attention runs over the txt tokens, then the img tokens.
pub fn double_block<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &FluxConfig,
    i: usize,
    img: Tensor<'g>,
    txt: Tensor<'g>,
    s: &Shared<'g>,
) -> Result<(Tensor<'g>, Tensor<'g>)> {
    let p = name(&format!("double_blocks.{i}"));
    let (img_mod, txt_mod) = if let Some(m) = &s.shared_mods {
        (m.img.clone(), m.txt.clone())
    } else if cfg.chroma.is_some() {
        chroma::double_mods(g, s.vec, i)
    } else {
        (
            modulation(g, w, &format!("{p}.img_mod.lin"), s.vec, 6)?,
            modulation(g, w, &format!("{p}.txt_mod.lin"), s.vec, 6)?,
        )
    };
    let qkv_of = |stream: &str, x: Tensor<'g>, m: &[Tensor<'g>]| -> Result<[Tensor<'g>; 3]> {
        let x = modulate(g, layer_norm(g, x), m[0], m[1]);
        let qkv = blocks::linear(g, w, &format!("{p}.{stream}_attn.qkv"), x, cfg.qkv_bias)?;
        split_qkv(g, w, cfg, &format!("{p}.{stream}_attn"), qkv, s.eps)
    };
    let [iq, ik, iv] = qkv_of("img", img, &img_mod)?;
    let [tq, tk, tv] = qkv_of("txt", txt, &txt_mod)?;
    let q = g.concat(tq, iq, 2);
    let k = g.concat(tk, ik, 2);
    let v = g.concat(tv, iv, 2);
    let attn = attention(g, q, k, v, s); // [hidden, L_txt + L_img, 1]
    let (lt, li) = (txt.shape()[1], img.shape()[1]);
    let nb = attn.nb();
    let txt_attn = g.view(attn, [attn.shape()[0], lt, 1, 1], [nb[1], nb[2], nb[3]], 0);
    let img_attn = g.view(attn, [attn.shape()[0], li, 1, 1], [nb[1], nb[2], nb[3]], lt as usize * nb[1]);

    let stream = |name: &str, x: Tensor<'g>, a: Tensor<'g>, m: &[Tensor<'g>]| -> Result<Tensor<'g>> {
        let proj = blocks::linear(g, w, &format!("{p}.{name}_attn.proj"), a, cfg.bias())?;
        let x = g.add(x, g.mul(proj, m[2]));
        let y = mlp(g, w, cfg, &format!("{p}.{name}_mlp"), modulate(g, layer_norm(g, x), m[3], m[4]))?;
        Ok(g.add(x, g.mul(y, m[5])))
    };
    let img = stream("img", img, img_attn, &img_mod)?;
    let txt = stream("txt", txt, txt_attn, &txt_mod)?;
    Ok((img, txt))
}

/// A single-stream block over the joint stream `[hidden, L_txt + L_img, 1]`.
pub fn single_block<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &FluxConfig,
    i: usize,
    x: Tensor<'g>,
    s: &Shared<'g>,
) -> Result<Tensor<'g>> {
    let p = name(&format!("single_blocks.{i}"));
    let (h, mlp_w) = (cfg.hidden_size, cfg.mlp_hidden());
    let m = if let Some(m) = &s.shared_mods {
        m.single.clone()
    } else if cfg.chroma.is_some() {
        chroma::single_mods(g, s.vec, i)
    } else {
        modulation(g, w, &format!("{p}.modulation.lin"), s.vec, 3)?
    };
    let x_mod = modulate(g, layer_norm(g, x), m[0], m[1]);
    let qkv_mlp = blocks::linear(g, w, &format!("{p}.linear1"), x_mod, cfg.bias())?; // [3h + mlp, L, 1]
    let [q, k, v] = split_qkv(g, w, cfg, &p, qkv_mlp, s.eps)?;
    let attn = attention(g, q, k, v, s);
    let l = qkv_mlp.shape()[1];
    let nb = qkv_mlp.nb();
    let hidden = if cfg.flux2 {
        // The gate and the value side by side, as `linear1` writes them.
        silu_act(g, g.view(qkv_mlp, [cfg.mlp_in(), l, 1, 1], [nb[1], nb[2], nb[3]], 3 * h as usize * nb[0]))
    } else {
        g.gelu(g.cont(g.view(qkv_mlp, [mlp_w, l, 1, 1], [nb[1], nb[2], nb[3]], 3 * h as usize * nb[0])))
    };
    let out = blocks::linear(g, w, &format!("{p}.linear2"), g.concat(attn, hidden, 0), cfg.bias())?;
    Ok(g.add(x, g.mul(out, m[2])))
}

/// The final layer on the img tokens `[hidden, L_img, 1]` -> `[out_channels, L_img, 1]`.
fn final_layer<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &FluxConfig,
    img: Tensor<'g>,
    vec: Tensor<'g>,
) -> Result<Tensor<'g>> {
    if cfg.chroma.is_some() {
        let (shift, scale) = chroma::final_mods(g, vec);
        let x = modulate(g, layer_norm(g, img), shift, scale);
        return blocks::linear(g, w, &name("final_layer.linear"), x, true);
    }
    let h = vec.shape()[0];
    let m = blocks::linear(g, w, &name("final_layer.adaLN_modulation.1"), g.silu(vec), cfg.bias())?; // [2h, 1]
    let nb = m.nb();
    let chunk = |j: usize| g.cont(g.view(m, [h, 1, 1, 1], [nb[1], nb[2], nb[3]], j * h as usize * nb[0]));
    let (shift, scale) = (chunk(0), chunk(1));
    let x = modulate(g, layer_norm(g, img), shift, scale);
    blocks::linear(g, w, &name("final_layer.linear"), x, cfg.bias())
}

/// `[W, H, C, 1]` -> `[C * 4, W/2 * H/2, 1]`: each 2x2 patch's channels, channel-major
/// (FLUX.2, patch 1: `[C, W * H, 1]`).
fn patchify<'g>(g: &'g Context, x: Tensor<'g>, p: i64) -> Tensor<'g> {
    let [wd, ht, c, n] = x.shape();
    if p == 1 {
        return g.reshape(g.cont(g.permute(g.reshape(x, &[wd * ht, c, n, 1]), [1, 0, 2, 3])), &[c, wd * ht, n]);
    }
    let (pw, ph) = (p, p);
    let (w, h) = (wd / pw, ht / ph);
    let x = g.reshape(x, &[pw, w, ph, h * c * n]);
    let x = g.cont(g.permute(x, [0, 2, 1, 3])); // [pw, ph, w, h*C*N]
    let x = g.reshape(x, &[pw * ph, w * h, c, n]);
    let x = g.cont(g.permute(x, [0, 2, 1, 3])); // [pw*ph, C, w*h, N]
    g.reshape(x, &[pw * ph * c, w * h, n])
}

/// The inverse of `patchify` for a `wd` x `ht` latent. It ends in a copy, not a reshape view:
/// the graph's output gets a slot of its own in a split run, which a view cannot take.
fn unpatchify<'g>(g: &'g Context, x: Tensor<'g>, wd: i64, ht: i64, p: i64) -> Tensor<'g> {
    let [cpp, _, n, _] = x.shape();
    if p == 1 {
        // [C, W*H, N] -> [W, H, C, N].
        return g.cont(g.reshape(g.cont(g.permute(x, [1, 0, 2, 3])), &[wd, ht, cpp, n]));
    }
    let (pw, ph) = (p, p);
    let (w, h, c) = (wd / pw, ht / ph, cpp / (pw * ph));
    let x = g.reshape(x, &[pw * ph, c, w * h, n]);
    let x = g.cont(g.permute(x, [0, 2, 1, 3])); // [pw*ph, w*h, C, N]
    let x = g.reshape(x, &[pw, ph, w, h * c * n]);
    let x = g.cont(g.permute(x, [0, 2, 1, 3])); // [pw, w, ph, h*C*N]
    g.cont(g.reshape(x, &[wd, ht, c, n]))
}

/// The inputs of one FLUX evaluation, as graph tensors.
#[derive(Clone, Debug)]
pub struct FluxInputs<'g> {
    /// The latent `[W, H, 16, 1]`.
    pub x: Tensor<'g>,
    /// The timestep `[1]` (the sampler's t in [0, 1]; scaled by 1000 inside).
    pub timestep: Tensor<'g>,
    /// The text context `[context_in_dim, L_txt, 1]`.
    pub context: Tensor<'g>,
    /// The pooled text vector `[vec_in_dim, 1]`.
    pub y: Tensor<'g>,
    /// The guidance scale `[1]` (dev only; scaled by 1000 inside).
    pub guidance: Option<Tensor<'g>>,
    /// [`rope_pe`]'s values `[2, 2, head_dim / 2, L_txt + L_img]`.
    pub pe: Tensor<'g>,
    /// RMSNorm's epsilon `[1]`.
    pub eps: Tensor<'g>,
    /// Chroma: the approximator's row indices `[344]` (0..344).
    pub mod_index: Option<Tensor<'g>>,
    /// Chroma's DiT mask `[L_txt + L_img]`: the text mask, then zeros for the image tokens.
    pub mask: Option<Tensor<'g>>,
    /// Reference latents `[W_k, H_k, C, 1]` (FLUX.1 Kontext's, FLUX.2's): their tokens follow
    /// the image's (and `pe` covers them, [`rope_pe_with_refs`]); the output is the image's
    /// tokens only.
    pub refs: Vec<Tensor<'g>>,
    /// Chroma1-Radiance: the DCT features of a patch's pixels `[64, patch^2]`
    /// ([`radiance::dct_features`]).
    pub dct: Option<Tensor<'g>>,
}

fn check_inputs(cfg: &FluxConfig, i: &FluxInputs<'_>) -> Result<()> {
    let (wd, ht, lt) = super::check_dit_inputs(
        MODEL,
        i.x.shape(),
        i.context.shape(),
        cfg.patch,
        cfg.latent_channels(),
        cfg.context_in_dim,
    )?;
    let bad = |reason: String| Err(DiffusionError::Input { model: MODEL, reason });
    if cfg.vec_in_dim > 0 && i.y.shape()[..2] != [cfg.vec_in_dim, 1] {
        return bad(format!("pooled vector shape {:?}, the model takes [{}, 1]", i.y.shape(), cfg.vec_in_dim));
    }
    let guided = cfg.guidance_embed || cfg.chroma.is_some();
    if guided != i.guidance.is_some() {
        return bad(format!(
            "the model {} a guidance input",
            if guided { "embeds guidance (dev, Chroma) and needs" } else { "has no guidance embedding, yet got" }
        ));
    }
    if cfg.radiance.is_some() != i.dct.is_some() {
        return bad("the DCT features go with a pixel-space (Radiance) model, and only with one".into());
    }
    if cfg.chroma.is_some() != i.mod_index.is_some() {
        return bad("the approximator's row indices go with a Chroma model, and only with one".into());
    }
    let mut tokens = lt + (wd / cfg.patch) * (ht / cfg.patch);
    if !i.refs.is_empty() && cfg.chroma.is_some() {
        return bad("Chroma reads no reference latents".into());
    }
    for r in &i.refs {
        let [rw, rh, rc, rn] = r.shape();
        if rc != cfg.latent_channels() || rn != 1 || rw % cfg.patch != 0 || rh % cfg.patch != 0 {
            return bad(format!(
                "reference latent shape {:?}, the model takes [W, H, {}, 1] in whole patches of {}",
                r.shape(),
                cfg.latent_channels(),
                cfg.patch
            ));
        }
        tokens += (rw / cfg.patch) * (rh / cfg.patch);
    }
    if let Some(m) = i.mask {
        if cfg.chroma.is_none() || m.shape()[0] != tokens || m.shape()[1..].iter().any(|&d| d != 1) {
            return bad(format!("a DiT mask of shape {:?} (Chroma only, one value per token: {tokens})", m.shape()));
        }
    }
    if i.pe.shape() != [2, 2, cfg.head_dim() / 2, tokens] {
        return bad(format!("pe shape {:?} does not fit {tokens} tokens", i.pe.shape()));
    }
    Ok(())
}

/// `time_in(t)`-style embedder of a scalar: `out_layer(silu(in_layer(emb(1000 v, 256))))`.
fn scalar_embedding<'g>(g: &'g Context, w: &Weights, p: &str, v: Tensor<'g>, bias: bool) -> Result<Tensor<'g>> {
    let e = g.timestep_embedding(g.scale(v, TIME_FACTOR), TIME_DIM as i32, MAX_PERIOD);
    let e = g.silu(blocks::linear(g, w, &format!("{p}.in_layer"), e, bias)?);
    blocks::linear(g, w, &format!("{p}.out_layer"), e, bias)
}

/// The FLUX graph: the latent `[W, H, 16, 1]` to the prediction of the same shape. Pushes
/// the cuts described in the module documentation.
pub fn forward<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &FluxConfig,
    inputs: &FluxInputs<'g>,
    kernel: AttnKernel,
    cuts: &mut Vec<(String, Tensor<'g>)>,
) -> Result<Tensor<'g>> {
    forward_skipping(g, w, cfg, inputs, kernel, cuts, &[])
}

/// [`forward`] with the blocks of `skip` left out (skip-layer guidance), numbered as the
/// reference numbers them: the double blocks from 0, then the single blocks after them.
fn forward_skipping<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &FluxConfig,
    inputs: &FluxInputs<'g>,
    kernel: AttnKernel,
    cuts: &mut Vec<(String, Tensor<'g>)>,
    skip: &[usize],
) -> Result<Tensor<'g>> {
    check_inputs(cfg, inputs)?;
    let [wd, ht, _, _] = inputs.x.shape();
    let _span = tracing::trace_span!("flux.forward", double = cfg.depth, single = cfg.depth_single_blocks).entered();
    let mut img = inputs.x;
    let mut txt = inputs.context;
    let mut vec = inputs.timestep;
    let mut shared = None;
    let mut joint = None;
    let lt = inputs.context.shape()[1];
    let mut out = None;
    for block in layout(cfg) {
        match block {
            Block::Prelude if cfg.chroma.is_some() => {
                let c = cfg.chroma.as_ref().expect("matched");
                img = match &cfg.radiance {
                    Some(r) => radiance::embed(g, w, r, inputs.x)?,
                    None => blocks::linear(g, w, &name("img_in"), patchify(g, inputs.x, cfg.patch), true)?,
                };
                let (Some(gd), Some(index)) = (inputs.guidance, inputs.mod_index) else {
                    return Err(DiffusionError::Input {
                        model: MODEL,
                        reason: "Chroma needs guidance and row indices".into(),
                    });
                };
                vec = chroma::modulation_vectors(g, w, c, inputs.timestep, gd, index, inputs.eps)?;
                txt = blocks::linear(g, w, &name("txt_in"), inputs.context, true)?;
                cuts.push(("flux.prelude.img".into(), img));
                cuts.push(("flux.prelude.txt".into(), txt));
                cuts.push(("flux.prelude.vec".into(), vec));
                shared =
                    Some(Shared { vec, pe: inputs.pe, eps: inputs.eps, kernel, mask: inputs.mask, shared_mods: None });
            }
            Block::Prelude => {
                let bias = cfg.bias();
                // The reference latents' tokens follow the image's (edits).
                let tokens = inputs
                    .refs
                    .iter()
                    .fold(patchify(g, inputs.x, cfg.patch), |all, &r| g.concat(all, patchify(g, r, cfg.patch), 1));
                img = blocks::linear(g, w, &name("img_in"), tokens, bias)?;
                vec = scalar_embedding(g, w, &name("time_in"), inputs.timestep, bias)?;
                if let Some(gd) = inputs.guidance {
                    vec = g.add(vec, scalar_embedding(g, w, &name("guidance_in"), gd, bias)?);
                }
                if cfg.vec_in_dim > 0 {
                    let y = blocks::linear(g, w, &name("vector_in.in_layer"), inputs.y, true)?;
                    let y = blocks::linear(g, w, &name("vector_in.out_layer"), g.silu(y), true)?;
                    vec = g.add(vec, y);
                }
                // FLUX.2: the shared modulations, before `txt_in` as the reference orders them.
                let shared_mods = if cfg.flux2 {
                    let m = |p: &str, k| modulation_with(g, w, &name(p), vec, k, false);
                    Some(SharedMods {
                        img: m("double_stream_modulation_img.lin", 6)?,
                        txt: m("double_stream_modulation_txt.lin", 6)?,
                        single: m("single_stream_modulation.lin", 3)?,
                    })
                } else {
                    None
                };
                txt = blocks::linear(g, w, &name("txt_in"), inputs.context, bias)?;
                cuts.push(("flux.prelude.img".into(), img));
                cuts.push(("flux.prelude.txt".into(), txt));
                cuts.push(("flux.prelude.vec".into(), vec));
                shared = Some(Shared { vec, pe: inputs.pe, eps: inputs.eps, kernel, mask: None, shared_mods });
            }
            Block::Double(i) if skip.contains(&i) => {}
            Block::Single(i) if skip.contains(&(i + cfg.depth)) => {}
            Block::Double(i) => {
                let s = shared.as_ref().expect("the prelude comes first");
                (img, txt) = double_block(g, w, cfg, i, img, txt, s)?;
                cuts.push((format!("flux.double_blocks.{i}.img"), img));
                cuts.push((format!("flux.double_blocks.{i}.txt"), txt));
            }
            Block::Single(i) => {
                let s = shared.as_ref().expect("the prelude comes first");
                let x = joint.unwrap_or_else(|| g.concat(txt, img, 1));
                let x = single_block(g, w, cfg, i, x, s)?;
                cuts.push((format!("flux.single_blocks.{i}"), x));
                joint = Some(x);
            }
            Block::Final => {
                // The generated image's tokens: after the text's, before any reference's.
                let li = (wd / cfg.patch) * (ht / cfg.patch);
                let img_tokens = match joint {
                    Some(x) => {
                        let nb = x.nb();
                        g.view(x, [cfg.hidden_size, li, 1, 1], [nb[1], nb[2], nb[3]], lt as usize * nb[1])
                    }
                    None if img.shape()[1] != li => {
                        let nb = img.nb();
                        g.view(img, [cfg.hidden_size, li, 1, 1], [nb[1], nb[2], nb[3]], 0)
                    }
                    None => img,
                };
                if let (Some(r), Some(dct)) = (&cfg.radiance, inputs.dct) {
                    out = Some(radiance::decode(g, w, r, img_tokens, inputs.x, dct, inputs.timestep)?);
                    continue;
                }
                let y = final_layer(g, w, cfg, img_tokens, vec)?;
                out = Some(unpatchify(g, y, wd, ht, cfg.patch));
            }
        }
    }
    Ok(out.expect("the layout ends with the final layer"))
}

/// Nodes the graph of `cfg` may create.
pub fn graph_size(cfg: &FluxConfig) -> usize {
    NODES_PER_BLOCK * (cfg.depth + cfg.depth_single_blocks + 4)
}

// ---------------------------------------------------------------------------------------
// Model
// ---------------------------------------------------------------------------------------

/// A FLUX transformer with its weights: one evaluation per call.
#[derive(Debug)]
pub struct FluxModel {
    /// Hyper-parameters.
    pub cfg: FluxConfig,
    /// Parameters (internal names).
    pub weights: Weights,
    /// Use flash attention where the device supports it (`--diffusion-fa`).
    pub flash_attn: bool,
    /// The distilled guidance scale of every evaluation (`--guidance`, default 3.5 as in the
    /// reference); a schnell model has no guidance input and ignores it.
    pub guidance: f32,
}

/// The reference's default `--guidance`.
pub(crate) const DEFAULT_GUIDANCE: f32 = 3.5;

impl FluxModel {
    /// Declares the parameters of `cfg` (no storage yet); see [`flux_specs`] for the types.
    pub fn new(cfg: FluxConfig, dtype_of: &dyn Fn(&str) -> Option<GgmlType>, wtype: Option<GgmlType>) -> Result<Self> {
        cfg.validate()?;
        let weights = Weights::new(flux_specs(&cfg, dtype_of, wtype))?;
        Ok(Self { cfg, weights, flash_attn: false, guidance: DEFAULT_GUIDANCE })
    }

    /// One evaluation of one sample. `x` is the latent `[16, H, W]` (row-major, ggml
    /// `[W, H, 16]`), `timestep` the sampler's t (sigma; the model scales it by 1000),
    /// `context` `[n_ctx_tokens, context_in_dim]`, `y` the pooled vector (`vec_in_dim`
    /// values), `guidance` the distilled guidance scale (dev; `None` for schnell). Returns
    /// the prediction, shaped as `x`.
    #[allow(clippy::too_many_arguments)]
    pub fn eval(
        &self,
        runner: &mut sd_sched::Runner,
        x: &[f32],
        (w, h): (usize, usize),
        timestep: f32,
        context: &[f32],
        n_ctx_tokens: usize,
        y: &[f32],
        guidance: Option<f32>,
    ) -> Result<Vec<f32>> {
        let sample = Sample { x, timestep, context, n_ctx_tokens, y, refs: &[], increase_ref_index: false, skip: &[] };
        Ok(self.eval_samples(runner, (w, h), &[sample], guidance)?.remove(0))
    }

    /// Evaluates `samples` (each in a graph of its own, as the reference) and returns their
    /// predictions in order. A split runner that overlaps micro-batches (`--pipeline-copies`)
    /// gets them as such, as many at a time as it keeps copies: one sample per micro-batch.
    fn eval_samples(
        &self,
        runner: &mut sd_sched::Runner,
        (w, h): (usize, usize),
        samples: &[Sample<'_>],
        guidance: Option<f32>,
    ) -> Result<Vec<Vec<f32>>> {
        let _span = tracing::trace_span!("flux", w, h, samples = samples.len()).entered();
        for s in samples {
            self.check_sample(s, (w, h))?;
        }
        let kernel = if self.flash_attn {
            AttnKernel::FlashWhereSupported(runner.backend().device())
        } else {
            AttnKernel::Plain
        };
        let size = graph_size(&self.cfg);
        let m = runner.micro_batches(samples.len());
        let mut outs = Vec::with_capacity(samples.len());
        for chunk in samples.chunks(m.max(1)) {
            let ctxs: Vec<Context> = chunk.iter().map(|_| Context::for_graph(size, size)).collect::<Result<_, _>>()?;
            let mut graphs = Vec::with_capacity(chunk.len());
            for (g, s) in ctxs.iter().zip(chunk) {
                graphs.push(self.graph(g, (w, h), s, guidance.is_some(), kernel)?);
            }
            let mut set_inputs = || -> std::result::Result<(), sd_sched::SchedError> {
                for ((ins, _, _), s) in graphs.iter().zip(chunk) {
                    self.set_inputs(ins, s, (w, h), guidance)?;
                }
                Ok(())
            };
            if let [(_, out, cuts)] = &graphs[..] {
                runner.run(&self.weights, &ctxs[0], size, cuts, *out, &mut set_inputs)?;
            } else {
                let jobs: Vec<sd_sched::BatchJob<'_>> = ctxs
                    .iter()
                    .zip(&graphs)
                    .map(|(g, (_, out, cuts))| sd_sched::BatchJob {
                        ctx: g,
                        graph_size: size,
                        cuts: cuts.clone(),
                        out: *out,
                    })
                    .collect();
                runner.run_batches(&self.weights, &jobs, &mut set_inputs)?;
            }
            for (_, out, _) in &graphs {
                outs.push(out.get_f32()?);
            }
        }
        Ok(outs)
    }

    /// Checks one sample's inputs against the model.
    fn check_sample(&self, s: &Sample<'_>, (w, h): (usize, usize)) -> Result<()> {
        let bad = |reason: String| Err(DiffusionError::Input { model: MODEL, reason });
        let cfg = &self.cfg;
        let (c, cd) = (cfg.latent_channels() as usize, cfg.context_in_dim as usize);
        if s.x.len() != c * w * h || w == 0 || h == 0 {
            return bad(format!("latent has {} values, {c} x {h} x {w} needs {}", s.x.len(), c * w * h));
        }
        if s.n_ctx_tokens == 0 || s.context.len() != s.n_ctx_tokens * cd {
            return bad(format!(
                "context has {} values, {} tokens x {cd} needs {}",
                s.context.len(),
                s.n_ctx_tokens,
                s.n_ctx_tokens * cd
            ));
        }
        if cfg.chroma.is_some() {
            if !s.y.is_empty() && s.y.len() != s.n_ctx_tokens {
                return bad(format!("the text mask has {} values for {} tokens", s.y.len(), s.n_ctx_tokens));
            }
        } else if s.y.len() != cfg.vec_in_dim as usize {
            return bad(format!("pooled vector has {} values, the model takes {}", s.y.len(), cfg.vec_in_dim));
        }
        if !s.refs.is_empty() && cfg.chroma.is_some() {
            return bad(format!("{} reference latents given; Chroma reads no reference images", s.refs.len()));
        }
        for (k, r) in s.refs.iter().enumerate() {
            if r.width == 0 || r.height == 0 || r.data.len() != c * r.width * r.height {
                return bad(format!(
                    "reference latent {} has {} values, {c} x {} x {} needs {}",
                    k + 1,
                    r.data.len(),
                    r.height,
                    r.width,
                    c * r.width * r.height
                ));
            }
        }
        Ok(())
    }

    /// Whether a sample's graph takes Chroma's DiT mask: a Chroma model with the mask on
    /// (`chroma_use_dit_mask`) and a conditioning that carries one.
    fn masked(&self, s: &Sample<'_>) -> bool {
        self.cfg.chroma.as_ref().is_some_and(|c| c.dit_mask) && !s.y.is_empty()
    }

    /// The graph of one sample in `g`: its inputs, output and cuts.
    #[allow(clippy::type_complexity)]
    fn graph<'g>(
        &'g self,
        g: &'g Context,
        (w, h): (usize, usize),
        s: &Sample<'_>,
        guided: bool,
        kernel: AttnKernel,
    ) -> Result<(FluxInputs<'g>, Tensor<'g>, Vec<(String, Tensor<'g>)>)> {
        let cfg = &self.cfg;
        let (c, cd) = (cfg.latent_channels(), cfg.context_in_dim);
        let (n_ctx_tokens, masked) = (s.n_ctx_tokens, self.masked(s));
        let refs: Vec<(usize, usize)> = s.refs.iter().map(|r| (r.width, r.height)).collect();
        let p = self.cfg.patch as usize;
        let ref_tokens: usize = refs.iter().map(|&(rw, rh)| image_tokens(rw, rh, p)).sum();
        let tokens = (n_ctx_tokens + image_tokens(w, h, p) + ref_tokens) as i64;
        let ins = FluxInputs {
            x: g.new_f32(&[w as i64, h as i64, c, 1]).set_name("x").set_input(),
            timestep: g.new_f32(&[1]).set_name("timestep").set_input(),
            context: g.new_f32(&[cd, n_ctx_tokens as i64, 1]).set_name("context").set_input(),
            y: g.new_f32(&[cfg.vec_in_dim.max(1), 1]).set_name("y").set_input(),
            guidance: guided.then(|| g.new_f32(&[1]).set_name("guidance").set_input()),
            pe: g.new_f32(&[2, 2, cfg.head_dim() / 2, tokens]).set_name("pe").set_input(),
            eps: g.new_f32(&[1]).set_name("rms_eps").set_input(),
            mod_index: cfg
                .chroma
                .is_some()
                .then(|| g.new_f32(&[chroma::MOD_INDEX_LEN as i64]).set_name("mod_index").set_input()),
            mask: masked.then(|| g.new_f32(&[tokens]).set_name("dit_mask").set_input()),
            refs: refs
                .iter()
                .enumerate()
                .map(|(k, &(rw, rh))| g.new_f32(&[rw as i64, rh as i64, c, 1]).set_name(&format!("ref{k}")).set_input())
                .collect(),
            dct: cfg.radiance.as_ref().map(|r| {
                let dims = [radiance::NERF_MAX_FREQS * radiance::NERF_MAX_FREQS, r.patch * r.patch];
                g.new_f32(&dims).set_name("dct").set_input()
            }),
        };
        let mut cuts = Vec::new();
        let out = forward_skipping(g, &self.weights, cfg, &ins, kernel, &mut cuts, s.skip)?.set_output();
        Ok((ins, out, cuts))
    }

    /// Writes one sample's values into its graph's inputs.
    fn set_inputs(
        &self,
        ins: &FluxInputs<'_>,
        s: &Sample<'_>,
        (w, h): (usize, usize),
        guidance: Option<f32>,
    ) -> std::result::Result<(), sd_sched::SchedError> {
        ins.x.set_f32(s.x)?;
        ins.timestep.set_f32(&[s.timestep])?;
        ins.context.set_f32(s.context)?;
        if self.cfg.vec_in_dim > 0 {
            ins.y.set_f32(s.y)?;
        }
        if let (Some(t), Some(v)) = (ins.guidance, guidance) {
            t.set_f32(&[v])?;
        }
        let refs: Vec<(usize, usize)> = s.refs.iter().map(|r| (r.width, r.height)).collect();
        ins.pe.set_f32(&rope_pe_with_refs(&self.cfg, s.n_ctx_tokens, (w, h), &refs, s.increase_ref_index))?;
        for (t, r) in ins.refs.iter().zip(s.refs) {
            t.set_f32(&r.data)?;
        }
        ins.eps.set_f32(&[EPS])?;
        if let (Some(t), Some(r)) = (ins.dct, &self.cfg.radiance) {
            t.set_f32(&radiance::dct_features(r.patch as usize))?;
        }
        if let Some(t) = ins.mod_index {
            t.set_f32(&chroma::mod_index_values())?;
        }
        if let Some(t) = ins.mask {
            // The text mask, then zeros for the image tokens (the reference's ggml_pad).
            let mut m = s.y.to_vec();
            m.resize(s.n_ctx_tokens + image_tokens(w, h, self.cfg.patch as usize), 0.0);
            t.set_f32(&m)?;
        }
        Ok(())
    }
}

/// One sample's inputs to [`FluxModel`]: see [`FluxModel::eval`].
#[derive(Clone, Copy)]
struct Sample<'a> {
    x: &'a [f32],
    timestep: f32,
    context: &'a [f32],
    n_ctx_tokens: usize,
    y: &'a [f32],
    /// Reference latents (FLUX.1 Kontext, FLUX.2).
    refs: &'a [crate::text::conditioning::ReferenceLatent],
    /// Each reference on its own RoPE index (see [`rope_pe_with_refs`]).
    increase_ref_index: bool,
    /// The blocks left out (skip-layer guidance; see [`forward_skipping`]).
    skip: &'a [usize],
}

/// FLUX as the pipeline evaluates it: each sample of a batch in a graph of its own (as the
/// reference), the T5 states as the conditioning's tokens, the pooled CLIP-L vector as its
/// `vector`, and the guidance from the model ([`FluxModel::guidance`]): it is one value per
/// run, the same for every sample and step, so it travels with the model rather than in each
/// conditioning. The timesteps are the sampler's t (sigma), which the model scales by 1000.
impl crate::family::DiffusionModel for FluxModel {
    fn weights(&self) -> &Weights {
        &self.weights
    }

    fn eval(
        &self,
        runner: &mut sd_sched::Runner,
        x: &[f32],
        dims: (usize, usize),
        timesteps: &[f32],
        cond: &[&crate::text::conditioning::Conditioning],
    ) -> crate::pipeline::Result<Vec<f32>> {
        self.eval_skipping_layers(runner, x, dims, timesteps, cond, &[])
    }

    fn eval_skipping_layers(
        &self,
        runner: &mut sd_sched::Runner,
        x: &[f32],
        (w, h): (usize, usize),
        timesteps: &[f32],
        cond: &[&crate::text::conditioning::Conditioning],
        skip: &[usize],
    ) -> crate::pipeline::Result<Vec<f32>> {
        let per = self.cfg.latent_channels() as usize * w * h;
        super::check_batch(MODEL, per, x.len(), timesteps.len(), cond.len())?;
        let bad = |reason: String| Err(DiffusionError::Input { model: MODEL, reason }.into());
        // The reference fills Chroma's guidance with 0 whatever `--guidance` says.
        let guidance =
            if self.cfg.chroma.is_some() { Some(0.0) } else { self.cfg.guidance_embed.then_some(self.guidance) };
        let mut samples = Vec::with_capacity(cond.len());
        for (i, c) in cond.iter().enumerate() {
            if c.hidden_size != self.cfg.context_in_dim as usize {
                return bad(format!(
                    "the conditioning is {} wide, the model's txt_in takes {} (T5-XXL's states)",
                    c.hidden_size, self.cfg.context_in_dim
                ));
            }
            let x = &x[i * per..(i + 1) * per];
            samples.push(Sample {
                x,
                timestep: timesteps[i],
                context: &c.data,
                n_ctx_tokens: c.n_tokens,
                y: &c.vector,
                refs: &c.references,
                increase_ref_index: c.increase_ref_index,
                skip,
            });
        }
        Ok(self.eval_samples(runner, (w, h), &samples, guidance)?.concat())
    }
}

#[cfg(test)]
mod tests;
