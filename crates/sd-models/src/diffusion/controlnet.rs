//! The ControlNet of SD 1.x (`cldm.ControlNet`, Zhang et al., "Adding Conditional Control to
//! Text-to-Image Diffusion Models", arXiv:2302.05543) as a ggml graph.
//!
//! What stable-diffusion.cpp's `control.hpp` builds, op for op: the timestep embedding, a copy
//! of the UNet's input blocks and middle block (the same layout walk as the UNet,
//! [`super::unet::layout_under`], named under [`PREFIX`]), the hint encoder
//! (`input_hint_block`: eight 3x3 convolutions with SiLU between, three of stride 2, from the
//! control image's `[0, 1]` RGB to `model_channels` at latent resolution, added to the stem's
//! output), and a 1x1 convolution after each input block (`zero_convs.N.0`) and after the middle
//! block (`middle_block_out.0`). Its outputs are the residuals the UNet adds to its skip
//! connections and middle block, scaled by the strength
//! ([`super::unet::UNetModel::eval_controlled`]).
//!
//! Names are those of the common single-file ControlNets (`control_v11p_sd15_*.safetensors`:
//! `control_model.<module>`), which the reference strips to `<module>`.

use sd_backends::{Context, GgmlType, Tensor};
use sd_sched::{Runner, TensorSpec, Weights};

use super::blocks::{self, AttnKernel, SpecSink};
use super::unet::{block_specs, layout_under, run_layers, time_embedding, time_embedding_specs, Layer, UNetConfig};
use super::{DiffusionError, Result};

/// Prefix of every ControlNet tensor's name.
pub const PREFIX: &str = "control_model";
/// Tensors (and graph nodes) the metadata context of one ControlNet graph may hold (the
/// reference's bound is 1536 nodes; ours keeps the UNet's margin).
pub const GRAPH_SIZE: usize = 8192;
/// Channels of the control image (RGB).
const HINT_CHANNELS: i64 = 3;

const MODEL: &str = "ControlNet";

/// The hint encoder's convolutions: (index in `input_hint_block`, in, out, stride); the last
/// one's output width is `model_channels` (0 here).
const HINT_CONVS: [(usize, i64, i64, i32); 8] = [
    (0, HINT_CHANNELS, 16, 1),
    (2, 16, 16, 1),
    (4, 16, 32, 2),
    (6, 32, 32, 1),
    (8, 32, 96, 2),
    (10, 96, 96, 1),
    (12, 96, 256, 2),
    (14, 256, 0, 1),
];

/// A ControlNet's hyper-parameters: those of the UNet it controls, with the latent's channels
/// in (an inpainting UNet's extra channels are not the ControlNet's).
#[derive(Debug, Clone, PartialEq)]
pub struct ControlNetConfig {
    /// The copied UNet half.
    pub unet: UNetConfig,
}

impl ControlNetConfig {
    /// The ControlNet for `unet`.
    pub fn for_unet(unet: &UNetConfig) -> Self {
        let mut unet = unet.clone();
        unet.in_channels = unet.out_channels;
        Self { unet }
    }

    /// Residuals it gives: one per input block (the UNet's skip connections) and the middle
    /// block's.
    pub fn residuals(&self) -> usize {
        layout_under(&self.unet, PREFIX).input.len() + 1
    }

    /// Channels and downsampling factor of each residual, in output order.
    fn residual_shapes(&self) -> Vec<(i64, i64)> {
        let layout = layout_under(&self.unet, PREFIX);
        let mut ds = 1;
        let mut out = Vec::new();
        for block in &layout.input {
            let mut ch = 0;
            for (_, l) in &block.layers {
                match l {
                    Layer::Stem { out, .. } | Layer::Res { out, .. } => ch = *out,
                    Layer::Down { ch: c } => {
                        ch = *c;
                        ds *= 2;
                    }
                    _ => {}
                }
            }
            out.push((ch, ds));
        }
        let mid = out.last().map_or((self.unet.model_channels, 1), |&(c, _)| (c, ds));
        out.push(mid);
        out
    }
}

/// Every ControlNet parameter: name, storage type and ggml shape (storage as the UNet's:
/// [`super::unet_specs`]).
pub fn controlnet_specs(
    cfg: &ControlNetConfig,
    dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
    wtype: Option<GgmlType>,
) -> Vec<TensorSpec> {
    let u = &cfg.unet;
    let mut s = SpecSink::new(dtype_of, wtype);
    let mc = u.model_channels;
    time_embedding_specs(&mut s, PREFIX, u);
    for (i, inp, out, _) in HINT_CONVS {
        s.conv2d(&format!("{PREFIX}.input_hint_block.{i}"), inp, if out == 0 { mc } else { out }, 3);
    }
    let layout = layout_under(u, PREFIX);
    for block in layout.input.iter().chain(std::iter::once(&layout.middle)) {
        block_specs(&mut s, block, u.time_embed_dim);
    }
    for (i, (ch, _)) in cfg.residual_shapes().iter().enumerate() {
        let name = if i + 1 == cfg.residuals() {
            format!("{PREFIX}.middle_block_out.0")
        } else {
            format!("{PREFIX}.zero_convs.{i}.0")
        };
        s.conv2d(&name, *ch, *ch, 1);
    }
    s.specs
}

/// The ControlNet graph: x [W, H, C, N] (the sampler's scaled latent), hint [8W, 8H, 3, N]
/// (the control image in `[0, 1]`), timesteps [N], context [context_dim, L, N or 1] ->
/// the residuals, each [W_i, H_i, C_i, N] (input blocks' then the middle block's).
#[allow(clippy::too_many_arguments)]
pub fn forward<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &ControlNetConfig,
    x: Tensor<'g>,
    hint: Tensor<'g>,
    timesteps: Tensor<'g>,
    context: Tensor<'g>,
    y: Option<Tensor<'g>>,
    kernel: AttnKernel,
) -> Result<Vec<Tensor<'g>>> {
    let u = &cfg.unet;
    let [xw, xh, xc, n] = x.shape();
    let [hw, hh, hc, hn] = hint.shape();
    if xc != u.in_channels || hc != HINT_CHANNELS || hn != n || hw != 8 * xw || hh != 8 * xh {
        return Err(DiffusionError::Input {
            model: MODEL,
            reason: format!(
                "latent {:?} and hint {:?} do not fit (the hint is the image: 8x the latent's sides, {HINT_CHANNELS} channels)",
                x.shape(),
                hint.shape()
            ),
        });
    }
    let [cd, lc, cn, _] = context.shape();
    if cd != u.context_dim {
        return Err(DiffusionError::Input {
            model: MODEL,
            reason: format!("context width {cd} but the cross-attention takes {}", u.context_dim),
        });
    }
    let context = if cn != n { g.repeat(context, g.new_f32(&[cd, lc, n])) } else { context };

    let emb = time_embedding(g, w, PREFIX, u.model_channels, timesteps, y)?;

    let mut guided = hint;
    for (k, (i, _, _, stride)) in HINT_CONVS.iter().enumerate() {
        guided = blocks::conv2d(g, w, &format!("{PREFIX}.input_hint_block.{i}"), guided, *stride, 1)?;
        if k + 1 < HINT_CONVS.len() {
            guided = g.silu(guided);
        }
    }

    let layout = layout_under(u, PREFIX);
    let run_block =
        |block: &super::unet::Block, h: Tensor<'g>| run_layers(g, w, block, h, (emb, context), kernel, None);
    let mut outs = Vec::with_capacity(layout.input.len() + 1);
    let mut h = x;
    for (i, block) in layout.input.iter().enumerate() {
        h = run_block(block, h)?;
        if i == 0 {
            h = g.add(h, guided);
        }
        outs.push(blocks::conv2d(g, w, &format!("{PREFIX}.zero_convs.{i}.0"), h, 1, 0)?);
    }
    h = run_block(&layout.middle, h)?;
    outs.push(blocks::conv2d(g, w, &format!("{PREFIX}.middle_block_out.0"), h, 1, 0)?);
    Ok(outs)
}

/// A ControlNet's residuals for one UNet evaluation of a batch.
#[derive(Debug, Clone)]
pub struct ControlResiduals {
    /// Values of each residual, `[N, C, H, W]` row-major (ggml `[W, H, C, N]`).
    pub values: Vec<Vec<f32>>,
    /// ggml shapes of the residuals.
    pub shapes: Vec<[i64; 4]>,
    /// The strength they are added with.
    pub strength: f32,
}

impl ControlResiduals {
    /// Each residual holds `batch` samples.
    pub(crate) fn check(&self, batch: usize) -> Result<()> {
        let ok = self.values.len() == self.shapes.len()
            && self
                .values
                .iter()
                .zip(&self.shapes)
                .all(|(v, ne)| ne[3] == batch as i64 && v.len() as i64 == ne.iter().product::<i64>());
        if ok {
            Ok(())
        } else {
            Err(DiffusionError::Input {
                model: MODEL,
                reason: format!("control residuals {:?} do not fit a batch of {batch}", self.shapes),
            })
        }
    }
}

/// A ControlNet with its weights.
#[derive(Debug)]
pub struct ControlNetModel {
    /// Hyper-parameters.
    pub cfg: ControlNetConfig,
    /// Parameters.
    pub weights: Weights,
    /// Flash attention where the device supports it.
    pub flash_attn: bool,
}

impl ControlNetModel {
    /// One evaluation of a batch of `batch` latents `x` ([N, C, H, W]) with their hints
    /// ([N, 3, 8H, 8W], `[0, 1]`), timesteps, contexts ([N or 1, tokens, context_dim]) and ADM
    /// vectors (empty without a class embedding); the residuals scaled later by `strength`.
    #[allow(clippy::too_many_arguments)]
    pub fn eval(
        &self,
        runner: &mut Runner,
        x: &[f32],
        (w, h): (usize, usize),
        hint: &[f32],
        timesteps: &[f32],
        context: &[f32],
        n_ctx_tokens: usize,
        batch: usize,
        y: &[f32],
        strength: f32,
    ) -> Result<ControlResiduals> {
        let _span = tracing::trace_span!("controlnet", w, h, batch).entered();
        let u = &self.cfg.unet;
        let (cin, cd) = (u.in_channels as usize, u.context_dim as usize);
        let ctx_batch = context.len() / (n_ctx_tokens * cd).max(1);
        let adm = u.adm_in_channels.unwrap_or(0) as usize;
        if batch == 0
            || x.len() != w * h * cin * batch
            || hint.len() != 64 * w * h * HINT_CHANNELS as usize * batch
            || timesteps.len() != batch
            || n_ctx_tokens == 0
            || !context.len().is_multiple_of(n_ctx_tokens * cd)
            || (ctx_batch != batch && ctx_batch != 1)
            || y.len() != adm * batch
        {
            return Err(DiffusionError::Input {
                model: MODEL,
                reason: format!(
                    "{} latent, {} hint, {} timestep, {} context and {} ADM values for a batch of {batch} \
                     {w}x{h} latents of {cin} channels with {n_ctx_tokens} tokens of {cd}",
                    x.len(),
                    hint.len(),
                    timesteps.len(),
                    context.len(),
                    y.len()
                ),
            });
        }
        let kernel = if self.flash_attn {
            AttnKernel::FlashWhereSupported(runner.backend().device())
        } else {
            AttnKernel::Plain
        };
        let g = Context::for_graph(GRAPH_SIZE, GRAPH_SIZE)?;
        let (wi, hi, b) = (w as i64, h as i64, batch as i64);
        let tx = g.new_f32(&[wi, hi, u.in_channels, b]).set_name("x").set_input();
        let th = g.new_f32(&[8 * wi, 8 * hi, HINT_CHANNELS, b]).set_name("hint").set_input();
        let tt = g.new_f32(&[b]).set_name("timesteps").set_input();
        let tc = g.new_f32(&[u.context_dim, n_ctx_tokens as i64, ctx_batch as i64]).set_name("context").set_input();
        let ty = u.adm_in_channels.map(|adm| g.new_f32(&[adm, b]).set_name("y").set_input());
        let outs = forward(&g, &self.weights, &self.cfg, tx, th, tt, tc, ty, kernel)?;
        let shapes: Vec<[i64; 4]> = outs.iter().map(|t| t.shape()).collect();
        // One output for the runner: every residual flattened, end to end.
        let flat = outs
            .iter()
            .map(|t| g.reshape(*t, &[t.shape().iter().product()]))
            .reduce(|a, t| g.concat(a, t, 0))
            .ok_or_else(|| DiffusionError::Config { model: MODEL, reason: "no residuals".into() })?
            .set_output();
        runner.run(&self.weights, &g, GRAPH_SIZE, &[], flat, &mut || {
            tx.set_f32(x)?;
            th.set_f32(hint)?;
            tt.set_f32(timesteps)?;
            tc.set_f32(context)?;
            if let Some(ty) = ty {
                ty.set_f32(y)?;
            }
            Ok(())
        })?;
        let all = flat.get_f32()?;
        let mut values = Vec::with_capacity(shapes.len());
        let mut at = 0;
        for ne in &shapes {
            let n = ne.iter().product::<i64>() as usize;
            values.push(all[at..at + n].to_vec());
            at += n;
        }
        Ok(ControlResiduals { values, shapes, strength })
    }
}
