//! UNet building blocks as ggml graph functions: linear, conv, norms, attention, ResBlock, SpatialTransformer.
//!
//! Each block comes as a pair: a `*_specs` function that declares its parameters (name,
//! storage type, ggml shape) and a forward function that reads them from a
//! [`Weights`] set under the same name prefix. Names follow the LDM module tree
//! (`in_layers.0`, `transformer_blocks.0.attn1.to_q`, ...), as stable-diffusion.cpp
//! names them internally.
//!
//! Numerics follow stable-diffusion.cpp (`ggml_extend.hpp`, `common/block.hpp`):
//!
//! * Storage types: convolution kernels are always f16, biases and norm parameters
//!   always f32, linear weights take the file's type or the `--type` override
//!   ([`crate::wtype::linear_weight_type`]). The storage type decides the precision of ggml's product:
//!   with an f16 (or quantized) weight the CPU backend rounds the activation to the
//!   weight's dot type first; convolutions run as im2col in f16.
//! * GroupNorm: 32 groups, eps 1e-6 (the reference hard-codes it for every GroupNorm);
//!   LayerNorm eps 1e-5; GELU is ggml's tanh approximation; upsampling is nearest.
//! * Attention: `softmax(k·q / sqrt(d))` with f32 products, or
//!   `ggml_flash_attn_ext` with k and v cast to f16 (`--diffusion-fa`).

use sd_backends::{Context, Device, GgmlType, ScaleMode, Tensor};
use sd_sched::Weights;

use super::Result;
pub use crate::wtype::SpecSink;

const F16: GgmlType = GgmlType::GGML_TYPE_F16;

/// Groups of every GroupNorm in the UNet.
pub const GROUPS: i32 = 32;
/// GroupNorm epsilon (the reference uses 1e-6 for every GroupNorm it builds).
const GROUP_NORM_EPS: f32 = 1e-6;
/// LayerNorm epsilon of the transformer blocks.
const LAYER_NORM_EPS: f32 = 1e-5;

// ---------------------------------------------------------------------------------------
// Storage types
// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// Primitive layers
// ---------------------------------------------------------------------------------------

fn param<'w>(w: &'w Weights, p: &str, leaf: &str) -> Result<Tensor<'w>> {
    Ok(w.get(&format!("{p}.{leaf}"))?)
}

/// `x W^T + b` over ne[0]: x [inp, ...] -> [out, ...].
///
/// A weight cut by output rows for a row split ([`Weights::matrix_parts`]) is one product per
/// chunk, concatenated on dim 0 (each chunk's product runs on the chunk's device). A weight
/// with low-rank adapters (a LoRA applied at run time, [`Weights::adapters`]) gets
/// `scale * up(down(x))` per adapter added after the bias.
pub fn linear<'g>(g: &'g Context, w: &Weights, p: &str, x: Tensor<'g>, bias: bool) -> Result<Tensor<'g>> {
    let b = if bias { Some(param(w, p, "bias")?) } else { None };
    Ok(w.linear(g, &format!("{p}.weight"), b, x)?)
}

/// 2-D convolution with bias via im2col (`ggml_conv_2d`): x [W, H, IC, N] -> [OW, OH, OC, N].
///
/// A kernel with low-rank adapters ([`Weights::adapters`]) gets, per adapter and after the
/// bias, `scale * conv1x1(up, conv(down, x))`: `down` a `[kw, kh, IC, rank]` kernel with this
/// convolution's stride and padding, `up` a `[1, 1, rank, OC]` kernel, both f16 (the reference
/// casts a LoRA's convolution kernels to f16).
pub fn conv2d<'g>(g: &'g Context, w: &Weights, p: &str, x: Tensor<'g>, stride: i32, pad: i32) -> Result<Tensor<'g>> {
    let name = format!("{p}.weight");
    let k = w.get(&name)?;
    let b = param(w, p, "bias")?;
    let y = g.conv_2d(k, x, stride, stride, pad, pad, 1, 1);
    let y = g.add(y, g.reshape(b, &[1, 1, b.shape()[0], 1]));
    Ok(w.adapters(&name)?.iter().fold(y, |y, t| {
        let lx = g.conv_2d(t.down, x, stride, stride, pad, pad, 1, 1);
        g.add(y, g.scale(g.conv_2d(t.up, lx, 1, 1, 0, 0, 1, 1), t.scale))
    }))
}

/// GroupNorm(32, eps 1e-6) with affine parameters over x [W, H, C, N].
pub fn group_norm32<'g>(g: &'g Context, w: &Weights, p: &str, x: Tensor<'g>) -> Result<Tensor<'g>> {
    let c = x.shape()[2];
    let gamma = g.reshape(param(w, p, "weight")?, &[1, 1, c, 1]);
    let beta = g.reshape(param(w, p, "bias")?, &[1, 1, c, 1]);
    let y = g.group_norm(x, GROUPS, GROUP_NORM_EPS);
    Ok(g.add(g.mul(y, gamma), beta))
}

/// LayerNorm(eps 1e-5) over ne[0] with affine parameters.
pub fn layer_norm<'g>(g: &'g Context, w: &Weights, p: &str, x: Tensor<'g>) -> Result<Tensor<'g>> {
    let y = g.norm(x, LAYER_NORM_EPS);
    Ok(g.add(g.mul(y, param(w, p, "weight")?), param(w, p, "bias")?))
}

// ---------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------

/// Which attention kernel to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKernel {
    /// `mul_mat` + `soft_max` + `mul_mat`, products in f32.
    Plain,
    /// `ggml_flash_attn_ext` with f16 k/v, unconditionally (the CPU supports every shape).
    Flash,
    /// Flash attention where `device` supports the op for the shape at hand, else
    /// [`AttnKernel::Plain`] (the reference's per-call fallback).
    FlashWhereSupported(Device),
}

impl AttnKernel {
    /// [`AttnKernel::Flash`] when `flash`, else [`AttnKernel::Plain`].
    pub fn from_flag(flash: bool) -> Self {
        if flash {
            AttnKernel::Flash
        } else {
            AttnKernel::Plain
        }
    }
}

/// Multi-head attention: q [C, Lq, N], k / v [C, Lk, N] with C = n_head * d_head -> [C, Lq, N].
pub fn attention<'g>(
    g: &'g Context,
    q: Tensor<'g>,
    k: Tensor<'g>,
    v: Tensor<'g>,
    n_head: i64,
    kernel: AttnKernel,
) -> Tensor<'g> {
    let [c, lq, n, _] = q.shape();
    let lk = k.shape()[1];
    let d = c / n_head;
    let scale = 1.0 / (d as f32).sqrt();
    // [C, L, N] -> [d, L, H, N] (a view).
    let heads = |t: Tensor<'g>, l: i64| g.permute(g.reshape(t, &[d, n_head, l, n]), [0, 2, 1, 3]);
    let qh = g.cont_if_needed(heads(q, lq));

    let flash = match kernel {
        AttnKernel::Plain => None,
        AttnKernel::Flash | AttnKernel::FlashWhereSupported(_) => {
            // The reference copies k and v contiguous, then casts them to f16; casting the
            // permuted views directly writes the same f16 values in one pass. The 4-D form
            // (heads in ne[2], batch in ne[3]) gives [d, H, Lq, N]: per (head, sample) the
            // same computation as the reference's 3-D form, which only supports N = 1.
            let k16 = g.cast(heads(k, lk), F16);
            let v16 = g.cast(heads(v, lk), F16);
            let out = g.flash_attn_ext(qh, k16, v16, None, scale);
            match kernel {
                AttnKernel::FlashWhereSupported(dev) if !dev.supports_op(out) => None,
                _ => Some(out),
            }
        }
    };
    if let Some(out) = flash {
        return g.reshape(out, &[c, lq, n]);
    }

    let qh = g.reshape(qh, &[d, lq, n_head * n]);
    let kh = g.reshape(g.cont_if_needed(heads(k, lk)), &[d, lk, n_head * n]);
    // v as [Lk, d, H*N], so the second product contracts over Lk.
    let vt = g.cont_if_needed(g.permute(g.reshape(v, &[d, n_head, lk, n]), [1, 2, 0, 3]));
    let vt = g.reshape(vt, &[lk, d, n_head * n]);
    let kq = g.mul_mat_prec_f32(kh, qh); // [Lk, Lq, H*N]
                                         // The reference scales in its own node, then takes a plain softmax; ggml's softmax
                                         // applies its scale with the same single multiply, so fusing it is exact.
    let kq = g.soft_max_ext(kq, None, scale, 0.0);
    let kqv = g.mul_mat(vt, kq); // [d, Lq, H*N]
    let kqv = g.permute(g.reshape(kqv, &[d, lq, n_head, n]), [0, 2, 1, 3]); // [d, H, Lq, N]
    g.reshape(g.cont_if_needed(kqv), &[c, lq, n])
}

/// Declares `CrossAttention(query_dim, context_dim)`: bias-free q/k/v, `to_out.0` with bias.
fn cross_attention_specs(s: &mut SpecSink<'_>, p: &str, query_dim: i64, context_dim: i64, inner: i64) {
    s.linear(&format!("{p}.to_q"), query_dim, inner, false);
    s.linear(&format!("{p}.to_k"), context_dim, inner, false);
    s.linear(&format!("{p}.to_v"), context_dim, inner, false);
    s.linear(&format!("{p}.to_out.0"), inner, query_dim, true);
}

/// `CrossAttention`: x [C, Lq, N] attends to context [Dc, Lk, N].
pub fn cross_attention<'g>(
    g: &'g Context,
    w: &Weights,
    p: &str,
    x: Tensor<'g>,
    context: Tensor<'g>,
    n_head: i64,
    kernel: AttnKernel,
) -> Result<Tensor<'g>> {
    let q = linear(g, w, &format!("{p}.to_q"), x, false)?;
    let k = linear(g, w, &format!("{p}.to_k"), context, false)?;
    let v = linear(g, w, &format!("{p}.to_v"), context, false)?;
    let a = attention(g, q, k, v, n_head, kernel);
    linear(g, w, &format!("{p}.to_out.0"), a, true)
}

/// Declares the GEGLU `FeedForward(dim, mult 4)`.
fn feed_forward_specs(s: &mut SpecSink<'_>, p: &str, dim: i64) {
    let inner = 4 * dim;
    s.linear(&format!("{p}.net.0.proj"), dim, 2 * inner, true);
    s.linear(&format!("{p}.net.2"), inner, dim, true);
}

/// `FeedForward` with GEGLU: `net.2(a * gelu(b))` where `[a | b] = net.0.proj(x)`.
pub fn feed_forward<'g>(g: &'g Context, w: &Weights, p: &str, x: Tensor<'g>) -> Result<Tensor<'g>> {
    let h = linear(g, w, &format!("{p}.net.0.proj"), x, true)?;
    // Reference: a = view of the first half, gate = cont(second half), gelu(gate), a * gate.
    // ggml's fused swapped GEGLU computes the same table GELU and the same product.
    let h = g.geglu_swapped(h);
    linear(g, w, &format!("{p}.net.2"), h, true)
}

/// Declares a `BasicTransformerBlock(dim, context_dim)`.
fn transformer_block_specs(s: &mut SpecSink<'_>, p: &str, dim: i64, context_dim: i64) {
    cross_attention_specs(s, &format!("{p}.attn1"), dim, dim, dim);
    cross_attention_specs(s, &format!("{p}.attn2"), dim, context_dim, dim);
    feed_forward_specs(s, &format!("{p}.ff"), dim);
    for n in ["norm1", "norm2", "norm3"] {
        s.norm(&format!("{p}.{n}"), dim);
    }
}

/// `BasicTransformerBlock`: self-attention, cross-attention, feed-forward, each pre-normed
/// and residual. x [C, L, N], context [Dc, Lc, N].
pub fn transformer_block<'g>(
    g: &'g Context,
    w: &Weights,
    p: &str,
    x: Tensor<'g>,
    context: Tensor<'g>,
    n_head: i64,
    kernel: AttnKernel,
) -> Result<Tensor<'g>> {
    let h = layer_norm(g, w, &format!("{p}.norm1"), x)?;
    let x = g.add(cross_attention(g, w, &format!("{p}.attn1"), h, h, n_head, kernel)?, x);
    let h = layer_norm(g, w, &format!("{p}.norm2"), x)?;
    let x = g.add(cross_attention(g, w, &format!("{p}.attn2"), h, context, n_head, kernel)?, x);
    let h = layer_norm(g, w, &format!("{p}.norm3"), x)?;
    Ok(g.add(feed_forward(g, w, &format!("{p}.ff"), h)?, x))
}

// ---------------------------------------------------------------------------------------
// UNet blocks
// ---------------------------------------------------------------------------------------

/// Shape of a `SpatialTransformer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransformerShape {
    /// Channels in and out (= heads x head width).
    pub channels: i64,
    /// Attention heads.
    pub n_head: i64,
    /// Stacked `BasicTransformerBlock`s.
    pub depth: usize,
    /// Width of the cross-attention context.
    pub context_dim: i64,
    /// Linear `proj_in`/`proj_out` (SD 2.x) instead of 1x1 convolutions (SD 1.x).
    pub linear_proj: bool,
}

/// Declares a `SpatialTransformer`.
pub fn spatial_transformer_specs(s: &mut SpecSink<'_>, p: &str, t: &TransformerShape) {
    let c = t.channels;
    s.norm(&format!("{p}.norm"), c);
    if t.linear_proj {
        s.linear(&format!("{p}.proj_in"), c, c, true);
    } else {
        s.conv2d(&format!("{p}.proj_in"), c, c, 1);
    }
    for d in 0..t.depth {
        transformer_block_specs(s, &format!("{p}.transformer_blocks.{d}"), c, t.context_dim);
    }
    if t.linear_proj {
        s.linear(&format!("{p}.proj_out"), c, c, true);
    } else {
        s.conv2d(&format!("{p}.proj_out"), c, c, 1);
    }
}

/// `SpatialTransformer`: x [W, H, C, N] as W*H tokens through the transformer blocks, plus x.
pub fn spatial_transformer<'g>(
    g: &'g Context,
    w: &Weights,
    p: &str,
    x: Tensor<'g>,
    context: Tensor<'g>,
    t: &TransformerShape,
    kernel: AttnKernel,
) -> Result<Tensor<'g>> {
    spatial_transformer_cut(g, w, p, x, context, t, kernel, None)
}

/// [`spatial_transformer`] that pushes a graph cut `(name, tokens)` after each of its
/// transformer blocks but the last, named `<name>.transformer_blocks.K` after `cut_name`,
/// so that a deep stack (SDXL's depth 10) can run in segments of one block each.
#[allow(clippy::too_many_arguments)]
pub(crate) fn spatial_transformer_cut<'g>(
    g: &'g Context,
    w: &Weights,
    p: &str,
    x: Tensor<'g>,
    context: Tensor<'g>,
    t: &TransformerShape,
    kernel: AttnKernel,
    mut cuts: Option<(&str, &mut Vec<(String, Tensor<'g>)>)>,
) -> Result<Tensor<'g>> {
    let [wd, ht, c, n] = x.shape();
    // [W, H, C, N] -> [C, W*H, N]: token index = x + W * y.
    let to_tokens = |h: Tensor<'g>| g.reshape(g.cont(g.permute(h, [1, 2, 0, 3])), &[c, wd * ht, n]);
    let from_tokens = |h: Tensor<'g>| g.reshape(g.cont(g.permute(h, [1, 0, 2, 3])), &[wd, ht, c, n]);

    let mut h = group_norm32(g, w, &format!("{p}.norm"), x)?;
    h = if t.linear_proj {
        linear(g, w, &format!("{p}.proj_in"), to_tokens(h), true)?
    } else {
        to_tokens(conv2d(g, w, &format!("{p}.proj_in"), h, 1, 0)?)
    };
    for d in 0..t.depth {
        h = transformer_block(g, w, &format!("{p}.transformer_blocks.{d}"), h, context, t.n_head, kernel)?;
        if let Some((name, cuts)) = cuts.as_mut() {
            if d + 1 < t.depth {
                cuts.push((format!("{name}.transformer_blocks.{d}"), h));
            }
        }
    }
    h = if t.linear_proj {
        from_tokens(linear(g, w, &format!("{p}.proj_out"), h, true)?)
    } else {
        conv2d(g, w, &format!("{p}.proj_out"), from_tokens(h), 1, 0)?
    };
    Ok(g.add(h, x))
}

/// Declares an LDM `ResBlock(inp -> out)` conditioned on an embedding of width `emb`.
pub fn res_block_specs(s: &mut SpecSink<'_>, p: &str, inp: i64, out: i64, emb: i64) {
    s.norm(&format!("{p}.in_layers.0"), inp);
    s.conv2d(&format!("{p}.in_layers.2"), inp, out, 3);
    s.linear(&format!("{p}.emb_layers.1"), emb, out, true);
    s.norm(&format!("{p}.out_layers.0"), out);
    s.conv2d(&format!("{p}.out_layers.3"), out, out, 3);
    if inp != out {
        s.conv2d(&format!("{p}.skip_connection"), inp, out, 1);
    }
}

/// LDM `ResBlock`: x [W, H, IC, N], emb [E, N] -> [W, H, OC, N]. A 1x1 `skip_connection`
/// maps x to OC channels when the weights have one (IC != OC).
pub fn res_block<'g>(g: &'g Context, w: &Weights, p: &str, x: Tensor<'g>, emb: Tensor<'g>) -> Result<Tensor<'g>> {
    let mut h = group_norm32(g, w, &format!("{p}.in_layers.0"), x)?;
    h = g.silu(h);
    h = conv2d(g, w, &format!("{p}.in_layers.2"), h, 1, 1)?;
    let e = linear(g, w, &format!("{p}.emb_layers.1"), g.silu(emb), true)?; // [OC, N]
    let [oc, n, _, _] = e.shape();
    h = g.add(h, g.reshape(e, &[1, 1, oc, n]));
    h = group_norm32(g, w, &format!("{p}.out_layers.0"), h)?;
    h = g.silu(h);
    h = conv2d(g, w, &format!("{p}.out_layers.3"), h, 1, 1)?;
    let skip_name = format!("{p}.skip_connection");
    let skip = if w.contains(&format!("{skip_name}.weight")) { conv2d(g, w, &skip_name, x, 1, 0)? } else { x };
    Ok(g.add(h, skip))
}

/// Declares a `Downsample` (3x3 convolution, stride 2, named `op`).
pub fn downsample_specs(s: &mut SpecSink<'_>, p: &str, ch: i64) {
    s.conv2d(&format!("{p}.op"), ch, ch, 3);
}

/// `Downsample`: 3x3 convolution with stride 2 and padding 1.
pub fn downsample<'g>(g: &'g Context, w: &Weights, p: &str, x: Tensor<'g>) -> Result<Tensor<'g>> {
    conv2d(g, w, &format!("{p}.op"), x, 2, 1)
}

/// Declares an `Upsample` (nearest x2, then a 3x3 convolution named `conv`).
pub fn upsample_specs(s: &mut SpecSink<'_>, p: &str, ch: i64) {
    s.conv2d(&format!("{p}.conv"), ch, ch, 3);
}

/// `Upsample`: nearest-neighbour x2, then a 3x3 convolution.
pub fn upsample<'g>(g: &'g Context, w: &Weights, p: &str, x: Tensor<'g>) -> Result<Tensor<'g>> {
    let up = g.upscale(x, 2, ScaleMode::Nearest);
    conv2d(g, w, &format!("{p}.conv"), up, 1, 1)
}
