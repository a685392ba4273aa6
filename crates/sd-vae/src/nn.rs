//! Building blocks shared by the autoencoders: convolution, group norm, ResNet and attention blocks.
//!
//! Each block knows its parameter names (`specs`) and builds its part of a ggml graph
//! (`forward`) op by op as stable-diffusion.cpp builds it, because the op sequence
//! decides the numerics:
//! * convolutions keep their kernels in **f16** whatever the file holds (sd.cpp's
//!   `Conv2d` always declares f16 weights and f32 biases), so ggml's im2col path rounds
//!   activations to f16 and multiplies f16 x f16 with f32 accumulation; the bias is a
//!   broadcast add of a `[1, 1, C, 1]` view;
//! * group norms are 32 groups, eps 1e-6, with f32 affine parameters applied as a
//!   broadcast multiply then add;
//! * attention is single-head over the `h*w` positions: `mul_mat(k, q)`, a separate
//!   scale by `1/sqrt(C)`, plain softmax, `mul_mat(v^T, kq)` — or, when enabled,
//!   ggml's flash attention with f16 k/v, as sd.cpp's `--fa` does.

use sd_backends::{Context, Device, GgmlType, ScaleMode, Tensor};
use sd_sched::{TensorSpec, Weights};

use crate::error::{Result, VaeError};

/// Graph-construction switches that change which ggml kernels run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphOptions {
    /// Use `ggml_conv_2d_direct` instead of im2col + matmul (sd.cpp's `--vae-conv-direct`).
    pub conv_direct: bool,
    /// Use flash attention in the mid-block attention (sd.cpp's `--fa`).
    pub flash_attn: bool,
}

impl GraphOptions {
    /// The switches to use on `device` when the caller has no preference: on the CPU,
    /// direct convolution, which ggml's CPU backend computes with the same f16 im2col
    /// rows and the same matmul kernel as the im2col path, in chunks — bit-identical on the
    /// small graph a test checks, within 1 level on a whole 256x256 SD decode (and no faster
    /// there: 7.0 against 6.7 s on two cores), with a compute buffer about 2.6x smaller (160
    /// vs 416 MiB). Elsewhere the reference's default (im2col), whose
    /// numerics other backends do not promise to share. Flash attention stays off, as in
    /// the reference without `--fa`.
    pub fn recommended(device: Device) -> Self {
        Self { conv_direct: device.kind() == sd_backends::DeviceKind::Cpu, flash_attn: false }
    }
}

/// What a forward pass needs: the graph context, the weights, the switches, and the
/// device (to ask whether it supports flash attention).
pub struct Fwd<'w, 'g> {
    /// The graph context.
    pub ctx: &'g Context,
    /// The module's weights.
    pub weights: &'w Weights,
    /// Switches.
    pub opts: GraphOptions,
    /// The device the graph runs on.
    pub device: Device,
    /// `vae` or `taesd`, for errors.
    pub module: &'static str,
}

impl Fwd<'_, '_> {
    pub(crate) fn get(&self, name: &str) -> Result<Tensor<'_>> {
        self.weights.get(name).map_err(|e| VaeError::Weights { module: self.module, source: e })
    }
}

fn spec(name: String, ty: GgmlType, ne: &[usize]) -> TensorSpec {
    TensorSpec { name, ty, ne: ne.iter().map(|&n| n as i64).collect() }
}

/// A 2-D convolution with a square kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct Conv2d {
    /// Parameter prefix (`….conv1`).
    pub name: String,
    /// Input channels.
    pub in_ch: usize,
    /// Output channels.
    pub out_ch: usize,
    /// Kernel edge.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Zero padding on each side.
    pub pad: usize,
    /// Whether there is a bias.
    pub bias: bool,
}

impl Conv2d {
    /// A convolution with bias.
    pub fn new(name: impl Into<String>, in_ch: usize, out_ch: usize, kernel: usize, stride: usize, pad: usize) -> Self {
        Self { name: name.into(), in_ch, out_ch, kernel, stride, pad, bias: true }
    }

    /// The same without bias.
    pub fn no_bias(mut self) -> Self {
        self.bias = false;
        self
    }

    /// Weight `[k, k, in, out]` in f16, bias `[out]` in f32.
    pub fn specs(&self, out: &mut Vec<TensorSpec>) {
        out.push(spec(
            format!("{}.weight", self.name),
            GgmlType::GGML_TYPE_F16,
            &[self.kernel, self.kernel, self.in_ch, self.out_ch],
        ));
        if self.bias {
            out.push(spec(format!("{}.bias", self.name), GgmlType::GGML_TYPE_F32, &[self.out_ch]));
        }
    }

    /// `x` is `[W, H, in, N]`; returns `[W', H', out, N]`.
    pub fn forward<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'_>) -> Result<Tensor<'g>> {
        let w = f.get(&format!("{}.weight", self.name))?;
        let (s, p) = (self.stride as i32, self.pad as i32);
        let mut y = if f.opts.conv_direct {
            f.ctx.conv_2d_direct(w, x, s, s, p, p, 1, 1)
        } else {
            f.ctx.conv_2d(w, x, s, s, p, p, 1, 1)
        };
        if self.bias {
            let b = f.get(&format!("{}.bias", self.name))?;
            y = f.ctx.add(y, f.ctx.reshape(b, &[1, 1, self.out_ch as i64, 1]));
        }
        Ok(y)
    }
}

/// A linear layer over `ne[0]` (the diffusers form of the mid-attention projections).
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    /// Parameter prefix.
    pub name: String,
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
    /// Storage type of the weight (the file's, as sd.cpp keeps it).
    pub ty: GgmlType,
}

impl Linear {
    /// Weight `[in, out]` in `ty`, bias `[out]` in f32.
    pub fn specs(&self, out: &mut Vec<TensorSpec>) {
        out.push(spec(format!("{}.weight", self.name), self.ty, &[self.in_features, self.out_features]));
        out.push(spec(format!("{}.bias", self.name), GgmlType::GGML_TYPE_F32, &[self.out_features]));
    }

    /// `x` is `[in, L, N]`; returns `[out, L, N]`. The product is the model families' one
    /// linear layer ([`Weights::linear`]), so a LoRA applied at run time or a row split
    /// reaches the VAE's projections as it reaches theirs.
    pub fn forward<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'_>) -> Result<Tensor<'g>> {
        let weight = format!("{}.weight", self.name);
        let b = f.get(&format!("{}.bias", self.name))?;
        f.weights.linear(f.ctx, &weight, Some(b), x).map_err(|e| VaeError::Weights { module: f.module, source: e })
    }
}

/// Group normalisation with affine parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupNorm {
    /// Parameter prefix.
    pub name: String,
    /// Channels.
    pub channels: usize,
    /// Groups (32 in the SD VAE).
    pub groups: usize,
    /// Epsilon (1e-6 in the SD VAE).
    pub eps: f32,
}

impl GroupNorm {
    /// Weight and bias `[C]` in f32.
    pub fn specs(&self, out: &mut Vec<TensorSpec>) {
        out.push(spec(format!("{}.weight", self.name), GgmlType::GGML_TYPE_F32, &[self.channels]));
        out.push(spec(format!("{}.bias", self.name), GgmlType::GGML_TYPE_F32, &[self.channels]));
    }

    /// `x` is `[W, H, C, N]`.
    pub fn forward<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'_>) -> Result<Tensor<'g>> {
        let c = self.channels as i64;
        let w = f.ctx.reshape(f.get(&format!("{}.weight", self.name))?, &[1, 1, c, 1]);
        let b = f.ctx.reshape(f.get(&format!("{}.bias", self.name))?, &[1, 1, c, 1]);
        let y = f.ctx.group_norm(x, self.groups as i32, self.eps);
        Ok(f.ctx.add(f.ctx.mul(y, w), b))
    }
}

/// `ldm.modules.diffusionmodules.model.ResnetBlock` without time embedding:
/// norm1, SiLU, conv1, norm2, SiLU, conv2, plus the input (through a 1x1 `nin_shortcut`
/// when the channel count changes).
#[derive(Clone, Debug, PartialEq)]
pub struct ResnetBlock {
    /// Parameter prefix.
    pub name: String,
    /// First norm.
    pub norm1: GroupNorm,
    /// First 3x3 convolution.
    pub conv1: Conv2d,
    /// Second norm.
    pub norm2: GroupNorm,
    /// Second 3x3 convolution.
    pub conv2: Conv2d,
    /// 1x1 projection of the input when `in != out`.
    pub nin_shortcut: Option<Conv2d>,
}

impl ResnetBlock {
    /// A block at `name` from `in_ch` to `out_ch` channels.
    pub fn new(name: &str, in_ch: usize, out_ch: usize, groups: usize, eps: f32) -> Self {
        let gn = |n: &str, c| GroupNorm { name: format!("{name}.{n}"), channels: c, groups, eps };
        Self {
            name: name.to_string(),
            norm1: gn("norm1", in_ch),
            conv1: Conv2d::new(format!("{name}.conv1"), in_ch, out_ch, 3, 1, 1),
            norm2: gn("norm2", out_ch),
            conv2: Conv2d::new(format!("{name}.conv2"), out_ch, out_ch, 3, 1, 1),
            nin_shortcut: (in_ch != out_ch)
                .then(|| Conv2d::new(format!("{name}.nin_shortcut"), in_ch, out_ch, 1, 1, 0)),
        }
    }

    /// Output channels.
    pub fn out_ch(&self) -> usize {
        self.conv2.out_ch
    }

    /// Parameters.
    pub fn specs(&self, out: &mut Vec<TensorSpec>) {
        self.norm1.specs(out);
        self.conv1.specs(out);
        self.norm2.specs(out);
        self.conv2.specs(out);
        if let Some(s) = &self.nin_shortcut {
            s.specs(out);
        }
    }

    /// `x` is `[W, H, in, N]`; returns `[W, H, out, N]`.
    pub fn forward<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'g>) -> Result<Tensor<'g>> {
        let h = self.norm1.forward(f, x)?;
        let h = f.ctx.silu(h);
        let h = self.conv1.forward(f, h)?;
        let h = self.norm2.forward(f, h)?;
        let h = f.ctx.silu(h);
        let h = self.conv2.forward(f, h)?;
        let skip = match &self.nin_shortcut {
            Some(s) => s.forward(f, x)?,
            None => x,
        };
        Ok(f.ctx.add(h, skip))
    }
}

/// A projection of the attention block: a 1x1 convolution (LDM checkpoints) or a linear
/// layer (diffusers VAEs keep `[C, C]` weights; sd.cpp then uses the linear form).
#[derive(Clone, Debug, PartialEq)]
pub enum Proj {
    /// 1x1 convolution, f16 kernel.
    Conv(Conv2d),
    /// Linear layer.
    Linear(Linear),
}

impl Proj {
    fn new(name: String, ch: usize, linear: Option<GgmlType>) -> Self {
        match linear {
            None => Proj::Conv(Conv2d::new(name, ch, ch, 1, 1, 0)),
            Some(ty) => Proj::Linear(Linear { name, in_features: ch, out_features: ch, ty }),
        }
    }

    fn specs(&self, out: &mut Vec<TensorSpec>) {
        match self {
            Proj::Conv(c) => c.specs(out),
            Proj::Linear(l) => l.specs(out),
        }
    }
}

/// `ldm.modules.diffusionmodules.model.AttnBlock`: single-head self-attention over the
/// spatial positions, with a residual.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnBlock {
    /// Parameter prefix.
    pub name: String,
    /// Channels.
    pub channels: usize,
    /// Input norm.
    pub norm: GroupNorm,
    /// Query projection.
    pub q: Proj,
    /// Key projection.
    pub k: Proj,
    /// Value projection.
    pub v: Proj,
    /// Output projection.
    pub proj_out: Proj,
}

impl AttnBlock {
    /// A block at `name`; `linear` selects the linear projections and their weight type.
    pub fn new(name: &str, ch: usize, groups: usize, eps: f32, linear: Option<GgmlType>) -> Self {
        let p = |n: &str| Proj::new(format!("{name}.{n}"), ch, linear);
        Self {
            name: name.to_string(),
            channels: ch,
            norm: GroupNorm { name: format!("{name}.norm"), channels: ch, groups, eps },
            q: p("q"),
            k: p("k"),
            v: p("v"),
            proj_out: p("proj_out"),
        }
    }

    /// Parameters.
    pub fn specs(&self, out: &mut Vec<TensorSpec>) {
        self.norm.specs(out);
        for p in [&self.q, &self.k, &self.v, &self.proj_out] {
            p.specs(out);
        }
    }

    /// `x` is `[W, H, C, N]`; returns the same shape.
    pub fn forward<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'g>) -> Result<Tensor<'g>> {
        let ctx = f.ctx;
        let [w, h, c, n] = x.shape();
        let hn = self.norm.forward(f, x)?;
        // [W, H, C, N] -> [C, W*H, N]: channels innermost, one row per position.
        let to_rows = |t: Tensor<'g>| ctx.reshape(ctx.cont(ctx.permute(t, [1, 2, 0, 3])), &[c, h * w, n]);
        let out = match (&self.q, &self.k, &self.v, &self.proj_out) {
            (Proj::Conv(qc), Proj::Conv(kc), Proj::Conv(vc), Proj::Conv(oc)) => {
                let q = to_rows(qc.forward(f, hn)?);
                let k = to_rows(kc.forward(f, hn)?);
                let v = to_rows(vc.forward(f, hn)?);
                let a = attention(f, q, k, v)?;
                let a = ctx.reshape(ctx.cont(ctx.permute(a, [1, 0, 2, 3])), &[w, h, c, n]);
                oc.forward(f, a)?
            }
            (Proj::Linear(ql), Proj::Linear(kl), Proj::Linear(vl), Proj::Linear(ol)) => {
                let rows = to_rows(hn);
                let q = ql.forward(f, rows)?;
                let k = kl.forward(f, rows)?;
                let v = vl.forward(f, rows)?;
                let a = attention(f, q, k, v)?;
                let a = ol.forward(f, a)?;
                ctx.reshape(ctx.cont(ctx.permute(a, [1, 0, 2, 3])), &[w, h, c, n])
            }
            _ => unreachable!("AttnBlock::new makes all projections of one kind"),
        };
        Ok(ctx.add(out, x))
    }
}

/// Single-head attention of `q` `[C, Lq, N]` over `k`, `v` `[C, Lk, N]`; returns `[C, Lq, N]`.
/// The op sequence of sd.cpp's `ggml_ext_attention_ext` with one head and no mask.
pub fn attention<'g>(f: &Fwd<'_, 'g>, q: Tensor<'g>, k: Tensor<'g>, v: Tensor<'g>) -> Result<Tensor<'g>> {
    let ctx = f.ctx;
    let [c, lq, n, _] = q.shape();
    let scale = 1.0f32 / (c as f32).sqrt();
    if f.opts.flash_attn && n == 1 {
        let kf = ctx.cast(k, GgmlType::GGML_TYPE_F16);
        let vf = ctx.cast(v, GgmlType::GGML_TYPE_F16);
        let out = ctx.flash_attn_ext(q, kf, vf, None, scale);
        if f.device.supports_op(out) {
            // [C, 1, Lq, 1] -> [C, Lq, 1]
            return Ok(ctx.reshape(out, &[c, lq, n]));
        }
    }
    let vt = ctx.cont(ctx.transpose(v)); // [Lk, C, N]
    let kq = ctx.mul_mat(k, q); // [Lk, Lq, N]
    let kq = ctx.scale(kq, scale);
    let kq = ctx.soft_max(kq);
    Ok(ctx.mul_mat(vt, kq)) // [C, Lq, N]
}

/// LDM's encoder downsampling: zero-pad one column and row at the end, 3x3 stride-2 convolution.
#[derive(Clone, Debug, PartialEq)]
pub struct Downsample {
    /// The convolution (`….downsample.conv`).
    pub conv: Conv2d,
}

impl Downsample {
    /// A downsample at `name` with `ch` channels.
    pub fn new(name: &str, ch: usize) -> Self {
        Self { conv: Conv2d::new(format!("{name}.conv"), ch, ch, 3, 2, 0) }
    }

    /// `x` is `[W, H, C, N]`; returns `[W/2, H/2, C, N]`.
    pub fn forward<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'_>) -> Result<Tensor<'g>> {
        let x = f.ctx.pad(x, [1, 1, 0, 0]);
        self.conv.forward(f, x)
    }
}

/// LDM's decoder upsampling: nearest x2, then a 3x3 convolution.
#[derive(Clone, Debug, PartialEq)]
pub struct Upsample {
    /// The convolution (`….upsample.conv`).
    pub conv: Conv2d,
}

impl Upsample {
    /// An upsample at `name` with `ch` channels.
    pub fn new(name: &str, ch: usize) -> Self {
        Self { conv: Conv2d::new(format!("{name}.conv"), ch, ch, 3, 1, 1) }
    }

    /// `x` is `[W, H, C, N]`; returns `[2W, 2H, C, N]`.
    pub fn forward<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'_>) -> Result<Tensor<'g>> {
        let x = f.ctx.upscale(x, 2, ScaleMode::Nearest);
        self.conv.forward(f, x)
    }
}

/// `[w, h, C * 4, N]` (channel `4 c + 2 dy + dx`) -> `[2w, 2h, C, N]`, as the reference's
/// decoders of 2x2-patched latents.
pub(crate) fn unpatchify<'g>(g: &'g Context, z: Tensor<'g>) -> Tensor<'g> {
    let p = 2;
    let [w, h, cp, n] = z.shape();
    let c = cp / (p * p);
    let z = g.reshape(z, &[w * h, p * p, c, n]);
    let z = g.cont(g.permute(z, [1, 0, 2, 3])); // [p*p, w*h, C, N]
    let z = g.reshape(z, &[p, p, w, h * c * n]);
    let z = g.cont(g.permute(z, [0, 2, 1, 3])); // [p, w, p, h*C*N]
    g.reshape(z, &[w * p, h * p, c, n])
}

/// `[W, H, C, N]` -> `[W/2, H/2, C * 4, N]`, the inverse of [`unpatchify`].
pub(crate) fn patchify<'g>(g: &'g Context, z: Tensor<'g>) -> Tensor<'g> {
    let p = 2;
    let [ww, hh, c, n] = z.shape();
    let (w, h) = (ww / p, hh / p);
    let z = g.reshape(g.cont(z), &[p, w, p, h * c * n]);
    let z = g.cont(g.permute(z, [0, 2, 1, 3])); // [p, p, w, h*C*N]
    let z = g.reshape(z, &[p * p, w * h, c, n]);
    let z = g.cont(g.permute(z, [1, 0, 2, 3])); // [w*h, p*p, C, N]
    g.reshape(z, &[w, h, p * p * c, n])
}
