//! The Z-Image diffusion transformer (NextDiT, Lumina-Image-2.0's design) as a ggml graph.
//!
//! References: Alibaba's Z-Image (`ZImageTransformer2DModel` in diffusers, the module tree
//! ComfyUI's `z_image_*.safetensors` files name) and stable-diffusion.cpp's
//! `model/diffusion/z_image.hpp`, `model/common/rope.hpp` (`gen_z_image_pe`) and
//! `model/diffusion/dit.hpp` (the reference we must match, op by op).
//!
//! # Design
//!
//! * **Config from the tensors, as the reference infers it** ([`ZImageConfig::from_file`]):
//!   the main, noise-refiner and context-refiner depths from the largest indices, the width
//!   from `x_embedder.weight`, the caption width (the LLM's hidden size) from
//!   `cap_embedder.1.weight`, the head width from `layers.0.attention.q_norm.weight` (heads =
//!   width / head width; key/value heads from the qkv projection's rows), the output channels
//!   from `final_layer.linear.weight`. Fixed as in the reference: 2x2 patches, RoPE axes
//!   [32, 48, 48] with theta 256 (so heads are 128 wide), the SwiGLU width
//!   `multiple_of(256, int(8/3 * width))`, the adaLN input `min(width, 256)` wide, RMSNorm eps
//!   1e-5. [`validate_against_file`] then names every tensor whose shape disagrees.
//! * **Layout** ([`layout`]): the prelude (`x_embedder`, `t_embedder`, `cap_embedder`, the pad
//!   tokens), the context refiners (text only, unmodulated), the noise refiners (image only,
//!   modulated), the main layers over text then image tokens, the final layer.
//! * **Ops**: patchify 2x2 with the channels innermost (`patch_last = false` in the
//!   reference); `t_embedder(timestep_embedding(1000 - 1000 sigma, 256))` (the reference gives
//!   Z-Image `1000 - t`); the caption `cap_embedder.1(rms(context) * cap_embedder.0)`; text and
//!   image each padded to a multiple of 32 tokens with `cap_pad_token` / `x_pad_token`. A
//!   block: `x + tanh(gate) * rms2(attn(rms1(x) * (1 + scale)))`, then the same with the
//!   SwiGLU feed-forward (`w2(silu(w1 x) * w3 x)`, `w2` computed on `x / 128` and scaled back
//!   as the reference does); the modulation `adaLN_modulation.0(t_emb)` (no SiLU) in chunks
//!   scale_msa, gate_msa, scale_mlp, gate_mlp. Attention: fused qkv split per head, RMSNorm
//!   on q and k, FLUX's RoPE and attention (`super::flux::rope_attention`, k and v scaled by
//!   1/128 on the flash path). The final layer: LayerNorm (no affine, eps 1e-6) times
//!   `1 + adaLN_modulation.1(silu(t_emb))`, `linear`. The image tokens are unpatchified and
//!   negated (the reference's `-1` scale: Z-Image predicts the flow the other way round).
//! * **RoPE** ([`rope_pe`]): text ids `(i + 1, 0, 0)` over the padded text, image ids
//!   `(L_txt_padded + 1, row, col)`, pad image ids zero.
//! * **Cuts**: `zimage.prelude.{txt,img,t_emb}`, `zimage.context_refiner.N`,
//!   `zimage.noise_refiner.N`, `zimage.joint` (the concatenation), `zimage.layers.N`; the
//!   groups of [`group_of`] follow them.
//! * **Batch**: one sample per graph, as the reference (it asserts a batch of 1).

use sd_backends::{Context, GgmlType, Tensor};
use sd_sched::{TensorSpec, Weights};

use super::blocks::{self, AttnKernel};
use super::flux::{linspace, rope_attention, rope_axis};
use super::{DiffusionError, Result};
use crate::wtype::SpecSink;

const MODEL: &str = "Z-Image";
/// Internal prefix of every Z-Image parameter.
pub const PREFIX: &str = "model.diffusion_model";
/// Patch side.
const PATCH: i64 = 2;
/// Width of the sinusoidal timestep embedding and the most the adaLN input is.
const ADALN_EMBED_DIM: i64 = 256;
/// Text and image token counts are padded to multiples of this.
const SEQ_MULTI_OF: usize = 32;
/// RMSNorm epsilon of the blocks and the caption embedder.
const NORM_EPS: f32 = 1e-5;
/// The final LayerNorm's epsilon.
const FINAL_EPS: f32 = 1e-6;
/// RoPE channels per axis (index, row, column).
const AXES_DIM: [i64; 3] = [32, 48, 48];
/// RoPE base.
const THETA: f32 = 256.0;
/// The SwiGLU width is rounded up to a multiple of this.
const MULTIPLE_OF: i64 = 256;
/// The reference's overflow guards: `w2` reads `x / 128`; the flash path scales k and v by it.
const GUARD_SCALE: f32 = 1.0 / 128.0;
/// Graph size bound per block.
const NODES_PER_BLOCK: usize = 160;

/// Hyper-parameters of a Z-Image transformer.
#[derive(Clone, Debug, PartialEq)]
pub struct ZImageConfig {
    /// Latent channels.
    pub in_channels: i64,
    /// Predicted channels.
    pub out_channels: i64,
    /// Width of the residual stream.
    pub hidden_size: i64,
    /// Width of the caption features (the LLM's hidden size: Qwen3-4B's 2560).
    pub cap_feat_dim: i64,
    /// Query heads.
    pub num_heads: i64,
    /// Key/value heads.
    pub num_kv_heads: i64,
    /// Width of one head.
    pub head_dim: i64,
    /// Main layers.
    pub num_layers: usize,
    /// Noise refiners and context refiners (each).
    pub num_refiner_layers: usize,
}

impl ZImageConfig {
    /// Z-Image (Turbo and base): 30 layers of width 3840, 30 heads of 128, 2 + 2 refiners,
    /// Qwen3-4B captions.
    pub fn turbo() -> Self {
        Self {
            in_channels: 16,
            out_channels: 16,
            hidden_size: 3840,
            cap_feat_dim: 2560,
            num_heads: 30,
            num_kv_heads: 30,
            head_dim: 128,
            num_layers: 30,
            num_refiner_layers: 2,
        }
    }

    /// A reduced configuration (heads of 128): `hidden` wide, `layers` main layers, `refiners`
    /// refiners of each kind, captions `cap_feat_dim` wide.
    pub fn reduced(hidden: i64, layers: usize, refiners: usize, cap_feat_dim: i64) -> Self {
        Self {
            hidden_size: hidden,
            num_heads: hidden / 128,
            num_kv_heads: hidden / 128,
            num_layers: layers,
            num_refiner_layers: refiners,
            cap_feat_dim,
            ..Self::turbo()
        }
    }

    /// Width of the adaLN input (the timestep embedding's output).
    fn adaln_dim(&self) -> i64 {
        self.hidden_size.min(ADALN_EMBED_DIM)
    }

    /// Width of the timestep embedder's hidden layer.
    fn t_hidden(&self) -> i64 {
        self.hidden_size.min(1024)
    }

    /// Width of the SwiGLU feed-forward: `int(8/3 * width)` (f32, as the reference) rounded up
    /// to a multiple of 256.
    pub fn ffn_dim(&self) -> i64 {
        let h = ((8.0f32 / 3.0) * self.hidden_size as f32) as i64;
        MULTIPLE_OF * ((h + MULTIPLE_OF - 1) / MULTIPLE_OF)
    }

    /// Rows of the fused qkv projection.
    fn qkv_dim(&self) -> i64 {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }

    /// The configuration the reference infers from a file's tensors: `tensors` lists
    /// (internal name, ggml shape innermost first). Errors name the tensor that is missing
    /// or malformed.
    pub fn from_file(tensors: &[(String, Vec<u64>)]) -> Result<Self> {
        fn bad<T>(reason: String) -> Result<T> {
            Err(DiffusionError::Config { model: MODEL, reason })
        }
        let mut cfg = Self { num_layers: 0, num_refiner_layers: 0, ..Self::turbo() };
        let prefix = format!("{PREFIX}.");
        let find = |rel: &str| tensors.iter().find(|(n, _)| n.strip_prefix(&prefix) == Some(rel)).map(|(_, ne)| ne);
        let matrix = |rel: &str| -> Result<(i64, i64)> {
            let full = format!("{PREFIX}.{rel}");
            match find(rel).map(|ne| ne.as_slice()) {
                Some([a, b, rest @ ..]) if *a > 0 && *b > 0 && rest.iter().all(|&d| d == 1) => {
                    Ok((*a as i64, *b as i64))
                }
                Some(ne) => bad(format!("tensor '{full}' has ggml shape {ne:?}, expected a matrix")),
                None => bad(format!("tensor '{full}' is missing: it gives the model's widths")),
            }
        };
        let (x_in, hidden) = matrix("x_embedder.weight")?;
        if x_in % (PATCH * PATCH) != 0 {
            return bad(format!("tensor '{PREFIX}.x_embedder.weight' takes {x_in} inputs, not whole 2x2 patches"));
        }
        cfg.in_channels = x_in / (PATCH * PATCH);
        cfg.hidden_size = hidden;
        let (cap, cap_hidden) = matrix("cap_embedder.1.weight")?;
        if cap_hidden != hidden {
            return bad(format!(
                "tensor '{PREFIX}.cap_embedder.1.weight' maps to width {cap_hidden}, x_embedder to {hidden}"
            ));
        }
        cfg.cap_feat_dim = cap;
        let (_, out) = matrix("final_layer.linear.weight")?;
        if out % (PATCH * PATCH) != 0 {
            return bad(format!(
                "tensor '{PREFIX}.final_layer.linear.weight' has {out} outputs, not whole 2x2 patches"
            ));
        }
        cfg.out_channels = out / (PATCH * PATCH);
        let mut refiners = (0usize, 0usize);
        for (name, _) in tensors {
            let Some(rel) = name.strip_prefix(&prefix) else { continue };
            for (marker, count) in [
                ("layers.", &mut cfg.num_layers),
                ("noise_refiner.", &mut refiners.0),
                ("context_refiner.", &mut refiners.1),
            ] {
                if let Some(rest) = rel.strip_prefix(marker) {
                    match rest.split('.').next().unwrap_or("").parse::<usize>() {
                        Ok(i) if i < 4096 => *count = (*count).max(i + 1),
                        _ => return bad(format!("tensor '{name}' has no valid block index after '{marker}'")),
                    }
                }
            }
        }
        cfg.num_refiner_layers = refiners.0.max(refiners.1);
        let block0 = if cfg.num_layers > 0 { "layers.0" } else { "noise_refiner.0" };
        if let Some(ne) = find(&format!("{block0}.attention.q_norm.weight")) {
            let hd = ne.first().copied().unwrap_or(0) as i64;
            if hd <= 0 || hidden % hd != 0 {
                return bad(format!(
                    "tensor '{PREFIX}.{block0}.attention.q_norm.weight' has {hd} values, which do not divide the width {hidden} into heads"
                ));
            }
            cfg.head_dim = hd;
            cfg.num_heads = hidden / hd;
            cfg.num_kv_heads = cfg.num_heads;
            if let Ok((_, qkv)) = matrix(&format!("{block0}.attention.qkv.weight")) {
                cfg.num_kv_heads = ((qkv / hd - cfg.num_heads) / 2).max(1);
            }
        } else {
            cfg.num_heads = hidden / cfg.head_dim;
            cfg.num_kv_heads = cfg.num_heads;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks that the numbers describe a network the graph can be built for.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(DiffusionError::Config { model: MODEL, reason });
        let widths = [self.in_channels, self.out_channels, self.hidden_size, self.cap_feat_dim, self.num_heads];
        if widths.iter().any(|&w| w <= 0) || self.num_kv_heads <= 0 || self.head_dim <= 0 {
            return bad(format!("widths must be positive: {self:?}"));
        }
        if self.num_heads * self.head_dim != self.hidden_size {
            return bad(format!(
                "{} heads of {} do not make the width {}",
                self.num_heads, self.head_dim, self.hidden_size
            ));
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return bad(format!("{} query heads do not share {} key/value heads", self.num_heads, self.num_kv_heads));
        }
        if AXES_DIM.iter().sum::<i64>() != self.head_dim {
            return bad(format!(
                "heads are {} wide; Z-Image's RoPE axes {AXES_DIM:?} need heads of 128 (width / heads)",
                self.head_dim
            ));
        }
        if self.num_layers == 0 {
            return bad("the file has no `layers.N` blocks".into());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------------------

/// One unit of the layout walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// `x_embedder`, `t_embedder`, `cap_embedder`, the pad tokens.
    Prelude,
    /// `context_refiner.N` (text tokens, no modulation).
    ContextRefiner(usize),
    /// `noise_refiner.N` (image tokens).
    NoiseRefiner(usize),
    /// `layers.N` (text then image tokens).
    Layer(usize),
    /// `final_layer`.
    Final,
}

/// The blocks in execution order.
pub fn layout(cfg: &ZImageConfig) -> Vec<Block> {
    let mut v = vec![Block::Prelude];
    v.extend((0..cfg.num_refiner_layers).map(Block::ContextRefiner));
    v.extend((0..cfg.num_refiner_layers).map(Block::NoiseRefiner));
    v.extend((0..cfg.num_layers).map(Block::Layer));
    v.push(Block::Final);
    v
}

fn name(rel: &str) -> String {
    format!("{PREFIX}.{rel}")
}

fn block_specs(s: &mut SpecSink<'_>, cfg: &ZImageConfig, p: &str, modulated: bool) {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    s.linear(&format!("{p}.attention.qkv"), h, cfg.qkv_dim(), false);
    s.linear(&format!("{p}.attention.out"), cfg.num_heads * hd, h, false);
    for n in ["q_norm", "k_norm"] {
        s.push(format!("{p}.attention.{n}.weight"), GgmlType::GGML_TYPE_F32, &[hd]);
    }
    let ff = cfg.ffn_dim();
    s.linear(&format!("{p}.feed_forward.w1"), h, ff, false);
    s.linear(&format!("{p}.feed_forward.w2"), ff, h, false);
    s.linear(&format!("{p}.feed_forward.w3"), h, ff, false);
    for n in ["attention_norm1", "ffn_norm1", "attention_norm2", "ffn_norm2"] {
        s.push(format!("{p}.{n}.weight"), GgmlType::GGML_TYPE_F32, &[h]);
    }
    if modulated {
        s.linear(&format!("{p}.adaLN_modulation.0"), cfg.adaln_dim(), 4 * h, true);
    }
}

/// The parameters of `cfg` with the types the reference stores them in: `dtype_of(name)`
/// is the file's type of the internal name (`None` when the file lacks it), `wtype` the
/// `--type` override.
pub fn zimage_specs(
    cfg: &ZImageConfig,
    dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
    wtype: Option<GgmlType>,
) -> Vec<TensorSpec> {
    let mut s = SpecSink::new(dtype_of, wtype);
    let h = cfg.hidden_size;
    for block in layout(cfg) {
        match block {
            Block::Prelude => {
                s.push(name("cap_pad_token"), GgmlType::GGML_TYPE_F32, &[h]);
                s.push(name("x_pad_token"), GgmlType::GGML_TYPE_F32, &[h]);
                s.linear(&name("x_embedder"), PATCH * PATCH * cfg.in_channels, h, true);
                s.linear(&name("t_embedder.mlp.0"), ADALN_EMBED_DIM, cfg.t_hidden(), true);
                s.linear(&name("t_embedder.mlp.2"), cfg.t_hidden(), cfg.adaln_dim(), true);
                s.push(name("cap_embedder.0.weight"), GgmlType::GGML_TYPE_F32, &[cfg.cap_feat_dim]);
                s.linear(&name("cap_embedder.1"), cfg.cap_feat_dim, h, true);
            }
            Block::ContextRefiner(i) => block_specs(&mut s, cfg, &name(&format!("context_refiner.{i}")), false),
            Block::NoiseRefiner(i) => block_specs(&mut s, cfg, &name(&format!("noise_refiner.{i}")), true),
            Block::Layer(i) => block_specs(&mut s, cfg, &name(&format!("layers.{i}")), true),
            Block::Final => {
                s.linear(&name("final_layer.linear"), h, PATCH * PATCH * cfg.out_channels, true);
                s.linear(&name("final_layer.adaLN_modulation.1"), cfg.adaln_dim(), h, true);
            }
        }
    }
    s.specs
}

/// The parameter group (block) of an internal Z-Image name, for staging: `prelude`,
/// `context_refiner.N`, `noise_refiner.N`, `layers.N` or `final_layer`, in graph order.
pub fn group_of(name: &str) -> String {
    let rel = name.strip_prefix(PREFIX).and_then(|r| r.strip_prefix('.')).unwrap_or(name);
    let mut parts = rel.split('.');
    match (parts.next(), parts.next()) {
        (Some(b @ ("context_refiner" | "noise_refiner" | "layers")), Some(i)) => format!("{b}.{i}"),
        (Some("final_layer"), _) => "final_layer".into(),
        _ => "prelude".into(),
    }
}

/// Whether a Z-Image parameter is cut by output rows in a row split: the matmul weights of
/// the blocks (qkv, out, w1, w2, w3, the modulation).
pub fn row_splittable(spec: &TensorSpec) -> bool {
    const LEAVES: [&str; 6] = [
        ".attention.qkv.weight",
        ".attention.out.weight",
        ".feed_forward.w1.weight",
        ".feed_forward.w2.weight",
        ".feed_forward.w3.weight",
        ".adaLN_modulation.0.weight",
    ];
    let matrix = spec.ne.len() >= 2 && spec.ne[2..].iter().all(|&d| d == 1);
    matrix && group_of(&spec.name) != "prelude" && LEAVES.iter().any(|l| spec.name.ends_with(l))
}

/// Checks a file's Z-Image tensors against `specs`: every missing tensor and shape mismatch
/// in one error, naming each; on success the unused names under the prefix.
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

/// Pad tokens that bring `n` to a multiple of 32 (the reference's `bound_mod`).
fn pad_len(n: usize) -> usize {
    (SEQ_MULTI_OF - n % SEQ_MULTI_OF) % SEQ_MULTI_OF
}

/// Image tokens of a `w` x `h` latent (before padding).
pub fn image_tokens(w: usize, h: usize) -> usize {
    w.div_ceil(PATCH as usize) * h.div_ceil(PATCH as usize)
}

/// The positional embedding of `txt_tokens` text tokens and a `w` x `h` latent, both padded:
/// ggml `[2, 2, 64, tokens]`, as the reference's `gen_z_image_pe` computes it.
pub fn rope_pe(txt_tokens: usize, (w, h): (usize, usize)) -> Vec<f32> {
    let p = PATCH as usize;
    let lt = txt_tokens + pad_len(txt_tokens);
    let (h_len, w_len) = ((h + p / 2) / p, (w + p / 2) / p);
    let li = h_len * w_len;
    let n = lt + li + pad_len(li);
    let rows = linspace(0.0, h_len as f32 - 1.0, h_len);
    let cols = linspace(0.0, w_len as f32 - 1.0, w_len);
    let mut ids = vec![[0f32; 3]; n];
    for (i, id) in ids.iter_mut().take(lt).enumerate() {
        id[0] = i as f32 + 1.0;
    }
    let index = (lt + 1) as f32;
    for i in 0..h_len {
        for j in 0..w_len {
            ids[lt + i * w_len + j] = [index, rows[i], cols[j]];
        }
    }
    let axes: Vec<Vec<Vec<f32>>> = (0..3)
        .map(|a| {
            let pos: Vec<f32> = ids.iter().map(|id| id[a]).collect();
            rope_axis(&pos, AXES_DIM[a] as usize, THETA)
        })
        .collect();
    let mut out = Vec::with_capacity(n * 128 * 2);
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

fn weight<'w>(w: &'w Weights, name: &str) -> Result<Tensor<'w>> {
    Ok(w.get(name)?)
}

/// The reference's `RMSNorm`: ggml's `rms_norm` times the weight `{p}.weight`.
fn rms<'g>(g: &'g Context, w: &Weights, p: &str, x: Tensor<'g>) -> Result<Tensor<'g>> {
    Ok(g.mul(g.rms_norm(x, NORM_EPS), weight(w, &format!("{p}.weight"))?))
}

/// `x + x * scale` (scale `[hidden, 1]`, broadcast over tokens).
fn modulate<'g>(g: &'g Context, x: Tensor<'g>, scale: Tensor<'g>) -> Tensor<'g> {
    g.add(x, g.mul(x, scale))
}

/// Self-attention over `x` `[hidden, L, 1]` with positions `pe`.
fn attention<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &ZImageConfig,
    p: &str,
    x: Tensor<'g>,
    pe: Tensor<'g>,
    kernel: AttnKernel,
) -> Result<Tensor<'g>> {
    let (hd, heads, kv) = (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads);
    let l = x.shape()[1];
    let qkv = blocks::linear(g, w, &format!("{p}.qkv"), x, false)?; // [(heads + 2 kv) hd, L, 1]
    let qkv = g.reshape(qkv, &[hd, heads + 2 * kv, l, 1]);
    let nb = qkv.nb();
    let part = |n: i64, at: i64| g.view(qkv, [hd, n, l, 1], [nb[1], nb[2], nb[3]], at as usize * nb[1]);
    let q = rms(g, w, &format!("{p}.q_norm"), g.cont(part(heads, 0)))?;
    let k = rms(g, w, &format!("{p}.k_norm"), g.cont(part(kv, heads)))?;
    let v = part(kv, heads + kv);
    let a = rope_attention(g, q, k, v, pe, kernel, GUARD_SCALE, None); // [hidden, L, 1]
    blocks::linear(g, w, &format!("{p}.out"), a, false)
}

/// `w2(silu(w1 x) * w3 x)`, `w2` on `x / 128` scaled back by 128 (as the reference).
fn feed_forward<'g>(g: &'g Context, w: &Weights, p: &str, x: Tensor<'g>) -> Result<Tensor<'g>> {
    let x1 = blocks::linear(g, w, &format!("{p}.w1"), x, false)?;
    let x3 = blocks::linear(g, w, &format!("{p}.w3"), x, false)?;
    let y = g.scale(g.mul(g.silu(x1), x3), GUARD_SCALE);
    Ok(g.scale(blocks::linear(g, w, &format!("{p}.w2"), y, false)?, 1.0 / GUARD_SCALE))
}

/// A transformer block (`context_refiner.N`, `noise_refiner.N` or `layers.N`) over `x`
/// `[hidden, L, 1]`; `t_emb` `[adaln, 1]` for the modulated ones.
#[allow(clippy::too_many_arguments)]
pub fn block<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &ZImageConfig,
    p: &str,
    x: Tensor<'g>,
    pe: Tensor<'g>,
    t_emb: Option<Tensor<'g>>,
    kernel: AttnKernel,
) -> Result<Tensor<'g>> {
    let h = cfg.hidden_size;
    let mods = match t_emb {
        Some(t) => {
            let m = blocks::linear(g, w, &format!("{p}.adaLN_modulation.0"), t, true)?; // [4h, 1]
            let nb = m.nb();
            let chunk = |j: usize| g.cont(g.view(m, [h, 1, 1, 1], [nb[1], nb[2], nb[3]], j * h as usize * nb[0]));
            Some([chunk(0), chunk(1), chunk(2), chunk(3)])
        }
        None => None,
    };
    let residual = x;
    let mut y = rms(g, w, &format!("{p}.attention_norm1"), x)?;
    if let Some(m) = &mods {
        y = modulate(g, y, m[0]);
    }
    y = attention(g, w, cfg, &format!("{p}.attention"), y, pe, kernel)?;
    y = rms(g, w, &format!("{p}.attention_norm2"), y)?;
    if let Some(m) = &mods {
        y = g.mul(y, g.tanh(m[1]));
    }
    let x = g.add(y, residual);
    let residual = x;
    let mut y = rms(g, w, &format!("{p}.ffn_norm1"), x)?;
    if let Some(m) = &mods {
        y = modulate(g, y, m[2]);
    }
    y = feed_forward(g, w, &format!("{p}.feed_forward"), y)?;
    y = rms(g, w, &format!("{p}.ffn_norm2"), y)?;
    if let Some(m) = &mods {
        y = g.mul(y, g.tanh(m[3]));
    }
    Ok(g.add(y, residual))
}

/// `[W, H, C, 1]` -> `[4 C, W/2 * H/2, 1]`: each 2x2 patch, channels innermost.
fn patchify<'g>(g: &'g Context, x: Tensor<'g>) -> Tensor<'g> {
    let [wd, ht, c, n] = x.shape();
    let (w, h) = (wd / PATCH, ht / PATCH);
    let x = g.reshape(x, &[PATCH, w, PATCH, h * c * n]);
    let x = g.cont(g.permute(x, [0, 2, 1, 3])); // [pw, ph, w, h*C*N]
    let x = g.reshape(x, &[PATCH * PATCH, w * h, c, n]);
    let x = g.cont(g.permute(x, [1, 2, 0, 3])); // [C, pw*ph, w*h, N]
    g.reshape(x, &[PATCH * PATCH * c, w * h, n])
}

/// The inverse of `patchify` for a `wd` x `ht` latent, ending in a copy (the output's own slot).
fn unpatchify<'g>(g: &'g Context, x: Tensor<'g>, wd: i64, ht: i64) -> Tensor<'g> {
    let [cpp, _, n, _] = x.shape();
    let (w, h, c) = (wd / PATCH, ht / PATCH, cpp / (PATCH * PATCH));
    let x = g.reshape(x, &[c, PATCH * PATCH, w * h, n]);
    let x = g.cont(g.permute(x, [2, 0, 1, 3])); // [pw*ph, w*h, C, N]
    let x = g.reshape(x, &[PATCH, PATCH, w, h * c * n]);
    let x = g.cont(g.permute(x, [0, 2, 1, 3])); // [pw, w, ph, h*C*N]
    g.cont(g.reshape(x, &[wd, ht, c, n]))
}

/// `x` `[hidden, L, 1]` followed by `pad` copies of the pad token `[hidden]`.
fn pad_tokens<'g>(g: &'g Context, w: &Weights, token: &str, x: Tensor<'g>, pad: usize) -> Result<Tensor<'g>> {
    if pad == 0 {
        return Ok(x);
    }
    let t = weight(w, &name(token))?;
    let h = x.shape()[0];
    let rep = g.repeat(g.reshape(t, &[h, 1, 1, 1]), g.new_f32(&[h, pad as i64, 1, 1]));
    Ok(g.concat(x, rep, 1))
}

/// The inputs of one Z-Image evaluation, as graph tensors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ZImageInputs<'g> {
    /// The latent `[W, H, C, 1]`.
    pub x: Tensor<'g>,
    /// The model's timestep `[1]`: `1000 - 1000 sigma`.
    pub timestep: Tensor<'g>,
    /// The caption features `[cap_feat_dim, L_txt, 1]`.
    pub context: Tensor<'g>,
    /// [`rope_pe`]'s values `[2, 2, 64, padded tokens]`.
    pub pe: Tensor<'g>,
}

fn check_inputs(cfg: &ZImageConfig, i: &ZImageInputs<'_>) -> Result<()> {
    let (wd, ht, lt) =
        super::check_dit_inputs(MODEL, i.x.shape(), i.context.shape(), PATCH, cfg.in_channels, cfg.cap_feat_dim)?;
    let li = image_tokens(wd as usize, ht as usize);
    let tokens = lt as usize + pad_len(lt as usize) + li + pad_len(li);
    if i.pe.shape() != [2, 2, cfg.head_dim / 2, tokens as i64] {
        let reason = format!("pe shape {:?} does not fit {tokens} tokens", i.pe.shape());
        return Err(DiffusionError::Input { model: MODEL, reason });
    }
    Ok(())
}

/// A `[h, L, 1]` token range `[from, from + len)` of `x` `[h, *, 1]`.
fn tokens<'g>(g: &'g Context, x: Tensor<'g>, from: usize, len: usize) -> Tensor<'g> {
    let nb = x.nb();
    g.view(x, [x.shape()[0], len as i64, 1, 1], [nb[1], nb[2], nb[3]], from * nb[1])
}

/// The Z-Image graph: the latent `[W, H, C, 1]` to the prediction of the same shape. Pushes
/// the cuts described in the module documentation.
pub(crate) fn forward<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &ZImageConfig,
    inputs: &ZImageInputs<'g>,
    kernel: AttnKernel,
    cuts: &mut Vec<(String, Tensor<'g>)>,
) -> Result<Tensor<'g>> {
    check_inputs(cfg, inputs)?;
    let [wd, ht, _, _] = inputs.x.shape();
    let _span = tracing::trace_span!("zimage.forward", layers = cfg.num_layers).entered();
    let n_txt = inputs.context.shape()[1] as usize;
    let n_img = image_tokens(wd as usize, ht as usize);
    let (lt, li) = (n_txt + pad_len(n_txt), n_img + pad_len(n_img));
    let pnb = inputs.pe.nb();
    let pe_range = |from: usize, len: usize| {
        g.view(inputs.pe, [2, 2, cfg.head_dim / 2, len as i64], [pnb[1], pnb[2], pnb[3]], from * pnb[3])
    };
    let (txt_pe, img_pe) = (pe_range(0, lt), pe_range(lt, li));
    let (mut txt, mut img, mut t_emb, mut joint) = (inputs.context, inputs.x, inputs.timestep, inputs.x);
    let mut out = None;
    for b in layout(cfg) {
        match b {
            Block::Prelude => {
                let e = g.timestep_embedding(inputs.timestep, ADALN_EMBED_DIM as i32, 10000);
                let e = g.silu(blocks::linear(g, w, &name("t_embedder.mlp.0"), e, true)?);
                t_emb = blocks::linear(g, w, &name("t_embedder.mlp.2"), e, true)?;
                let c = rms(g, w, &name("cap_embedder.0"), inputs.context)?;
                txt = blocks::linear(g, w, &name("cap_embedder.1"), c, true)?;
                img = blocks::linear(g, w, &name("x_embedder"), patchify(g, inputs.x), true)?;
                cuts.push(("zimage.prelude.txt".into(), txt));
                cuts.push(("zimage.prelude.img".into(), img));
                cuts.push(("zimage.prelude.t_emb".into(), t_emb));
                txt = pad_tokens(g, w, "cap_pad_token", txt, lt - n_txt)?;
                img = pad_tokens(g, w, "x_pad_token", img, li - n_img)?;
            }
            Block::ContextRefiner(i) => {
                txt = block(g, w, cfg, &name(&format!("context_refiner.{i}")), txt, txt_pe, None, kernel)?;
                cuts.push((format!("zimage.context_refiner.{i}"), txt));
            }
            Block::NoiseRefiner(i) => {
                img = block(g, w, cfg, &name(&format!("noise_refiner.{i}")), img, img_pe, Some(t_emb), kernel)?;
                cuts.push((format!("zimage.noise_refiner.{i}"), img));
            }
            Block::Layer(i) => {
                if i == 0 {
                    joint = g.concat(txt, img, 1);
                    cuts.push(("zimage.joint".into(), joint));
                }
                joint = block(g, w, cfg, &name(&format!("layers.{i}")), joint, inputs.pe, Some(t_emb), kernel)?;
                cuts.push((format!("zimage.layers.{i}"), joint));
            }
            Block::Final => {
                let scale = blocks::linear(g, w, &name("final_layer.adaLN_modulation.1"), g.silu(t_emb), true)?; // [h, 1]
                let x = modulate(g, g.norm(joint, FINAL_EPS), scale);
                let y = blocks::linear(g, w, &name("final_layer.linear"), x, true)?; // [4C, L, 1]
                let y = g.cont(tokens(g, y, lt, n_img));
                out = Some(g.scale(unpatchify(g, y, wd, ht), -1.0));
            }
        }
    }
    Ok(out.expect("the layout ends with the final layer"))
}

/// Nodes the graph of `cfg` may create.
pub fn graph_size(cfg: &ZImageConfig) -> usize {
    NODES_PER_BLOCK * (cfg.num_layers + 2 * cfg.num_refiner_layers + 4)
}

// ---------------------------------------------------------------------------------------
// Model
// ---------------------------------------------------------------------------------------

/// The timestep Z-Image reads for the sampler's `t` (`sigma * 1000` on its flow schedule):
/// `1000 - t`, in f32 as the reference computes it.
pub fn model_timestep(t: f32) -> f32 {
    1000.0 - t
}

/// A Z-Image transformer with its weights: one evaluation per sample.
#[derive(Debug)]
pub struct ZImageModel {
    /// Hyper-parameters.
    pub cfg: ZImageConfig,
    /// Parameters (internal names).
    pub weights: Weights,
    /// Use flash attention where the device supports it (`--diffusion-fa`).
    pub flash_attn: bool,
}

impl ZImageModel {
    /// Declares the parameters of `cfg` (no storage yet).
    pub fn new(
        cfg: ZImageConfig,
        dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
        wtype: Option<GgmlType>,
    ) -> Result<Self> {
        cfg.validate()?;
        let weights = Weights::new(zimage_specs(&cfg, dtype_of, wtype))?;
        Ok(Self { cfg, weights, flash_attn: false })
    }

    /// One evaluation of one sample: `x` the latent `[C, H, W]` (row-major), `t` the sampler's
    /// timestep (`sigma * 1000`), `context` `[n_ctx_tokens, cap_feat_dim]`. Returns the
    /// prediction, shaped as `x`.
    pub fn eval_one(
        &self,
        runner: &mut sd_sched::Runner,
        x: &[f32],
        (w, h): (usize, usize),
        t: f32,
        context: &[f32],
        n_ctx_tokens: usize,
    ) -> Result<Vec<f32>> {
        let bad = |reason: String| Err(DiffusionError::Input { model: MODEL, reason });
        let cfg = &self.cfg;
        let (c, cd) = (cfg.in_channels as usize, cfg.cap_feat_dim as usize);
        if x.len() != c * w * h || w == 0 || h == 0 {
            return bad(format!("latent has {} values, {c} x {h} x {w} needs {}", x.len(), c * w * h));
        }
        if n_ctx_tokens == 0 || context.len() != n_ctx_tokens * cd {
            return bad(format!(
                "context has {} values, {n_ctx_tokens} tokens x {cd} needs {}",
                context.len(),
                n_ctx_tokens * cd
            ));
        }
        let kernel = if self.flash_attn {
            AttnKernel::FlashWhereSupported(runner.backend().device())
        } else {
            AttnKernel::Plain
        };
        let _span = tracing::trace_span!("zimage", w, h, tokens = n_ctx_tokens).entered();
        let size = graph_size(cfg);
        let g = Context::for_graph(size, size)?;
        let li = image_tokens(w, h);
        let tokens = n_ctx_tokens + pad_len(n_ctx_tokens) + li + pad_len(li);
        let ins = ZImageInputs {
            x: g.new_f32(&[w as i64, h as i64, c as i64, 1]).set_name("x").set_input(),
            timestep: g.new_f32(&[1]).set_name("timestep").set_input(),
            context: g.new_f32(&[cd as i64, n_ctx_tokens as i64, 1]).set_name("context").set_input(),
            pe: g.new_f32(&[2, 2, cfg.head_dim / 2, tokens as i64]).set_name("pe").set_input(),
        };
        let mut cuts = Vec::new();
        let out = forward(&g, &self.weights, cfg, &ins, kernel, &mut cuts)?.set_output();
        let pe = rope_pe(n_ctx_tokens, (w, h));
        let mut set_inputs = || -> std::result::Result<(), sd_sched::SchedError> {
            ins.x.set_f32(x)?;
            ins.timestep.set_f32(&[model_timestep(t)])?;
            ins.context.set_f32(context)?;
            ins.pe.set_f32(&pe)?;
            Ok(())
        };
        runner.run(&self.weights, &g, size, &cuts, out, &mut set_inputs)?;
        Ok(out.get_f32()?)
    }
}

/// Z-Image as the pipeline evaluates it: each sample in a graph of its own (as the
/// reference), the LLM's hidden states as the conditioning's tokens (no pooled vector).
impl crate::family::DiffusionModel for ZImageModel {
    fn weights(&self) -> &Weights {
        &self.weights
    }

    fn eval(
        &self,
        runner: &mut sd_sched::Runner,
        x: &[f32],
        (w, h): (usize, usize),
        timesteps: &[f32],
        cond: &[&crate::text::conditioning::Conditioning],
    ) -> crate::pipeline::Result<Vec<f32>> {
        let per = self.cfg.in_channels as usize * w * h;
        let input = (per, self.cfg.cap_feat_dim as usize, "cap_embedder (the LLM's hidden size)");
        super::eval_each(MODEL, input, x, timesteps, cond, |xi, t, c| {
            self.eval_one(runner, xi, (w, h), t, &c.data, c.n_tokens)
        })
    }
}

#[cfg(test)]
mod tests;
