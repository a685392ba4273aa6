//! TAESD, the tiny autoencoder (`--taesd`): a small convolutional stand-in for AutoencoderKL.
//!
//! Reference: madebyollin/taesd (`taesd.py`) and diffusers' `AutoencoderTiny`; the graph
//! mirrors stable-diffusion.cpp's `tae.hpp` (SD 1.x/2.x form: 4 latent channels, 64
//! feature channels, no mid-block group norm; [`TaesdConfig::midblock_gn`] and
//! [`TaesdConfig::patched`] give the form of 32-channel, 2x2-patched latents). Parameters are
//! `tae.{decoder,encoder}.layers.N.*` (the file's names behind the `tae.` prefix the
//! loader adds). Convolution kernels are f16 and biases f32, as for the big VAE.
//!
//! Layer layout (index = `layers.N`):
//! * decoder: `0` conv z->64, `1` ReLU, `2..4` blocks, `5` upsample, `6` conv (no bias),
//!   `7..9` blocks, `10` upsample, `11` conv, `12..14` blocks, `15` upsample, `16` conv,
//!   `17` block, `18` conv 64->3; the input is first squashed as `3 * tanh(z / 3)`;
//! * encoder: `0` conv 3->64, `1` block, `2` stride-2 conv (no bias), `3..5` blocks,
//!   `6` stride-2 conv, `7..9` blocks, `10` stride-2 conv, `11..13` blocks, `14` conv 64->z.
//!
//! TAESD works on diffusion-space latents directly (no scale factor) and on images in
//! `[0, 1]` ([`ImageRange::ZeroToOne`]).

use sd_backends::{BufferType, ScaleMode, Tensor};
use sd_sched::{Runner, TensorSource, TensorSpec, Weights};

use crate::error::{Result, VaeError};
use crate::nn::{patchify, unpatchify, Conv2d, Fwd, GraphOptions, GroupNorm};
use crate::run::{decode_graph, encode_graph, run_graph, FirstStage, GraphModel, ImageRange};

const MODULE: &str = "taesd";
const PREFIX: &str = "tae";

/// TAESD's hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct TaesdConfig {
    /// Latent channels (4 for SD 1.x/2.x).
    pub z_channels: usize,
    /// Feature channels.
    pub channels: usize,
    /// Blocks per stage.
    pub num_blocks: usize,
    /// Image channels.
    pub image_channels: usize,
    /// A group-norm branch (`pool.0` 1x1 conv to 4x the channels, `pool.1` group norm of 4
    /// groups, ReLU, `pool.3` 1x1 conv back, added to the input) in the blocks next to the
    /// latent: the decoder's first stage, the encoder's last.
    pub midblock_gn: bool,
    /// The latent comes in 2x2 patches (4 `z_channels` at half the resolution, channel
    /// `4 c + 2 dy + dx`): unpatchified before decoding, patchified after encoding.
    pub patched: bool,
}

impl TaesdConfig {
    /// The SD 1.x/2.x TAESD.
    pub fn sd() -> Self {
        Self { z_channels: 4, channels: 64, num_blocks: 3, image_channels: 3, midblock_gn: false, patched: false }
    }

    /// TAEF1, FLUX.1's tiny autoencoder: TAESD's graph on 16 latent channels (the reference
    /// builds its TAE with 16 channels for every DiT model), decoding FLUX's latents as they
    /// are (no scale or shift, as for TAESD).
    pub fn flux() -> Self {
        Self { z_channels: 16, ..Self::sd() }
    }

    /// Channels of a diffusion latent: `z_channels`, times 4 when patched.
    pub fn latent_channels(&self) -> usize {
        self.z_channels * if self.patched { 4 } else { 1 }
    }

    /// Image pixels per diffusion latent position: 8, or 16 when patched.
    pub fn latent_scale(&self) -> usize {
        if self.patched {
            16
        } else {
            8
        }
    }
}

/// Which halves of TAESD to declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaesdParts {
    /// The decoder only.
    DecoderOnly,
    /// Decoder and encoder.
    Full,
}

/// `conv.0`, ReLU, `conv.2`, ReLU, `conv.4`, plus the input, ReLU.
#[derive(Clone, Debug, PartialEq)]
pub struct TaeBlock {
    /// Parameter prefix.
    pub name: String,
    /// The three 3x3 convolutions.
    pub convs: [Conv2d; 3],
    /// 1x1 projection of the input when the channel count changes (never in SD's TAESD).
    pub skip: Option<Conv2d>,
    /// The group-norm branch ([`TaesdConfig::midblock_gn`]): `pool.0`, `pool.1`, `pool.3`.
    pub pool: Option<(Conv2d, GroupNorm, Conv2d)>,
}

impl TaeBlock {
    fn new(name: String, n_in: usize, n_out: usize, midblock_gn: bool) -> Self {
        let c = |i: usize, a, b| Conv2d::new(format!("{name}.conv.{i}"), a, b, 3, 1, 1);
        let n_gn = 4 * n_in;
        let pool = midblock_gn.then(|| {
            (
                Conv2d::new(format!("{name}.pool.0"), n_in, n_gn, 1, 1, 0).no_bias(),
                GroupNorm { name: format!("{name}.pool.1"), channels: n_gn, groups: 4, eps: 1e-6 },
                Conv2d::new(format!("{name}.pool.3"), n_gn, n_in, 1, 1, 0).no_bias(),
            )
        });
        Self {
            convs: [c(0, n_in, n_out), c(2, n_out, n_out), c(4, n_out, n_out)],
            skip: (n_in != n_out).then(|| Conv2d::new(format!("{name}.skip"), n_in, n_out, 1, 1, 0).no_bias()),
            pool,
            name,
        }
    }

    fn specs(&self, out: &mut Vec<TensorSpec>) {
        if let Some((p0, gn, p3)) = &self.pool {
            p0.specs(out);
            gn.specs(out);
            p3.specs(out);
        }
        for c in &self.convs {
            c.specs(out);
        }
        if let Some(s) = &self.skip {
            s.specs(out);
        }
    }

    /// `x` is `[W, H, in, N]`; returns `[W, H, out, N]`.
    pub fn forward<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'g>) -> Result<Tensor<'g>> {
        let x = match &self.pool {
            Some((p0, gn, p3)) => {
                let p = f.ctx.relu(gn.forward(f, p0.forward(f, x)?)?);
                f.ctx.add(x, p3.forward(f, p)?)
            }
            None => x,
        };
        let h = self.convs[0].forward(f, x)?;
        let h = f.ctx.relu(h);
        let h = self.convs[1].forward(f, h)?;
        let h = f.ctx.relu(h);
        let h = self.convs[2].forward(f, h)?;
        let skip = match &self.skip {
            Some(s) => s.forward(f, x)?,
            None => x,
        };
        Ok(f.ctx.relu(f.ctx.add(h, skip)))
    }
}

/// One entry of a layer list.
#[derive(Clone, Debug, PartialEq)]
pub enum Layer {
    /// A convolution.
    Conv(Conv2d),
    /// A residual block.
    Block(Box<TaeBlock>),
    /// ReLU (no parameters).
    Relu,
    /// Nearest x2 upsampling (no parameters).
    Upsample,
}

fn layers_specs(layers: &[Layer], out: &mut Vec<TensorSpec>) {
    for l in layers {
        match l {
            Layer::Conv(c) => c.specs(out),
            Layer::Block(b) => b.specs(out),
            Layer::Relu | Layer::Upsample => {}
        }
    }
}

fn layer_forward<'g>(l: &Layer, f: &Fwd<'_, 'g>, h: Tensor<'g>) -> Result<Tensor<'g>> {
    Ok(match l {
        Layer::Conv(c) => c.forward(f, h)?,
        Layer::Block(b) => b.forward(f, h)?,
        Layer::Relu => f.ctx.relu(h),
        Layer::Upsample => f.ctx.upscale(h, 2, ScaleMode::Nearest),
    })
}

/// The decoder's layers.
fn decoder_layers(cfg: &TaesdConfig) -> Vec<Layer> {
    let p = |i: usize| format!("{PREFIX}.decoder.layers.{i}");
    let ch = cfg.channels;
    let mut layers = vec![Layer::Conv(Conv2d::new(p(0), cfg.z_channels, ch, 3, 1, 1)), Layer::Relu];
    for stage in 0..3 {
        for _ in 0..cfg.num_blocks {
            let gn = cfg.midblock_gn && stage == 0;
            layers.push(Layer::Block(Box::new(TaeBlock::new(p(layers.len()), ch, ch, gn))));
        }
        layers.push(Layer::Upsample);
        layers.push(Layer::Conv(Conv2d::new(p(layers.len()), ch, ch, 3, 1, 1).no_bias()));
    }
    layers.push(Layer::Block(Box::new(TaeBlock::new(p(layers.len()), ch, ch, false))));
    layers.push(Layer::Conv(Conv2d::new(p(layers.len()), ch, cfg.image_channels, 3, 1, 1)));
    layers
}

/// The encoder's layers.
fn encoder_layers(cfg: &TaesdConfig) -> Vec<Layer> {
    let p = |i: usize| format!("{PREFIX}.encoder.layers.{i}");
    let ch = cfg.channels;
    let mut layers = vec![Layer::Conv(Conv2d::new(p(0), cfg.image_channels, ch, 3, 1, 1))];
    layers.push(Layer::Block(Box::new(TaeBlock::new(p(1), ch, ch, false))));
    for stage in 0..3 {
        layers.push(Layer::Conv(Conv2d::new(p(layers.len()), ch, ch, 3, 2, 1).no_bias()));
        for _ in 0..cfg.num_blocks {
            let gn = cfg.midblock_gn && stage == 2;
            layers.push(Layer::Block(Box::new(TaeBlock::new(p(layers.len()), ch, ch, gn))));
        }
    }
    layers.push(Layer::Conv(Conv2d::new(p(layers.len()), ch, cfg.z_channels, 3, 1, 1)));
    layers
}

/// TAESD's parameters, in a stable order.
pub fn taesd_specs(cfg: &TaesdConfig, parts: TaesdParts) -> Vec<TensorSpec> {
    let mut out = Vec::new();
    layers_specs(&decoder_layers(cfg), &mut out);
    if parts == TaesdParts::Full {
        layers_specs(&encoder_layers(cfg), &mut out);
    }
    out
}

/// TAESD with its weights.
pub struct Taesd {
    cfg: TaesdConfig,
    decoder: Vec<Layer>,
    encoder: Option<Vec<Layer>>,
    weights: Weights,
    opts: GraphOptions,
}

impl std::fmt::Debug for Taesd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Taesd").field("cfg", &self.cfg).field("encoder", &self.encoder.is_some()).finish()
    }
}

impl Taesd {
    /// Declares the parameters of `parts`, allocates them on `buft` and fills them from `source`.
    pub fn load(cfg: TaesdConfig, parts: TaesdParts, source: &dyn TensorSource, buft: BufferType) -> Result<Self> {
        let w = |e| VaeError::Weights { module: MODULE, source: e };
        let mut weights = Weights::new(taesd_specs(&cfg, parts)).map_err(w)?;
        weights.allocate(buft).map_err(w)?;
        weights.load_from(source).map_err(w)?;
        Self::from_weights(cfg, weights)
    }

    /// Wraps weights declared with [`taesd_specs`] and filled.
    pub fn from_weights(cfg: TaesdConfig, weights: Weights) -> Result<Self> {
        let has_encoder = weights.contains(&format!("{PREFIX}.encoder.layers.0.weight"));
        let parts = if has_encoder { TaesdParts::Full } else { TaesdParts::DecoderOnly };
        for s in taesd_specs(&cfg, parts) {
            if !weights.contains(&s.name) {
                return Err(VaeError::Weights { module: MODULE, source: sd_sched::SchedError::MissingTensor(s.name) });
            }
        }
        Ok(Self {
            decoder: decoder_layers(&cfg),
            encoder: has_encoder.then(|| encoder_layers(&cfg)),
            cfg,
            weights,
            opts: GraphOptions::default(),
        })
    }

    /// Sets the graph switches.
    pub fn with_options(mut self, opts: GraphOptions) -> Self {
        self.opts = opts;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &TaesdConfig {
        &self.cfg
    }

    /// Builds the decode graph on `z` (`[w, h, 4, 1]`). Returns `[8w, 8h, 3, 1]` in about `[0, 1]`.
    pub fn build_decode<'g>(&self, f: &Fwd<'_, 'g>, z: Tensor<'g>) -> Result<Tensor<'g>> {
        let ctx = f.ctx;
        let z = if self.cfg.patched { unpatchify(ctx, z) } else { z };
        let mut h = ctx.scale(ctx.tanh(ctx.scale(z, 1.0 / 3.0)), 3.0);
        for l in &self.decoder {
            h = layer_forward(l, f, h)?;
        }
        Ok(h)
    }

    /// Builds the encode graph on `x` (`[W, H, 3, 1]` in `[0, 1]`). Returns `[W/8, H/8, 4, 1]`.
    pub fn build_encode<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'g>) -> Result<Tensor<'g>> {
        let layers = self
            .encoder
            .as_ref()
            .ok_or_else(|| VaeError::input(MODULE, "the encoder was not loaded (TaesdParts::DecoderOnly)"))?;
        let mut h = x;
        for l in layers {
            h = layer_forward(l, f, h)?;
        }
        Ok(if self.cfg.patched { patchify(f.ctx, h) } else { h })
    }

    /// Decodes a diffusion-space latent (planar `[4, h, w]`) to a planar `[3, 8h, 8w]`
    /// image in about `[0, 1]` (not clamped). One graph, no tiling.
    pub fn decode(
        &self,
        runner: &mut Runner,
        latent: &[f32],
        dims: (usize, usize),
        channels: usize,
    ) -> Result<Vec<f32>> {
        self.decode_graph(runner, latent, [dims.0, dims.1], channels, None).map(|(v, _)| v)
    }

    /// Encodes a planar `[3, H, W]` image in `[0, 1]` to a diffusion-space latent `[4, H/8, W/8]`.
    pub fn encode(&self, runner: &mut Runner, image: &[f32], dims: (usize, usize)) -> Result<Vec<f32>> {
        self.encode_graph(runner, image, [dims.0, dims.1], self.cfg.image_channels, None).map(|(v, _)| v)
    }

    /// Runs one layer (`decoder.layers.7`, `encoder.layers.2`; names without the `tae.`
    /// prefix) on a planar `[c, h, w]` input; returns the output and its `[w, h, c]`.
    pub fn run_block(
        &self,
        runner: &mut Runner,
        name: &str,
        input: &[f32],
        dims: [usize; 3],
    ) -> Result<(Vec<f32>, [usize; 3])> {
        let (side, index) = name
            .strip_prefix("decoder.layers.")
            .map(|i| (&self.decoder, i))
            .or_else(|| name.strip_prefix("encoder.layers.").and_then(|i| self.encoder.as_ref().map(|e| (e, i))))
            .ok_or_else(|| VaeError::input(MODULE, format!("no layer named `{name}`")))?;
        let layer = index
            .parse::<usize>()
            .ok()
            .and_then(|i| side.get(i))
            .ok_or_else(|| VaeError::input(MODULE, format!("no layer named `{name}`")))?;
        run_graph(runner, MODULE, &self.weights, self.opts, input, dims, None, |f, x| layer_forward(layer, f, x))
    }
}

impl FirstStage for Taesd {
    fn params(&self) -> Option<&Weights> {
        Some(GraphModel::weights(self))
    }

    fn module(&self) -> &'static str {
        MODULE
    }

    fn scale_factor(&self) -> usize {
        self.cfg.latent_scale()
    }

    fn latent_channels(&self) -> usize {
        self.cfg.latent_channels()
    }

    fn image_channels(&self) -> usize {
        self.cfg.image_channels
    }

    fn image_range(&self) -> ImageRange {
        ImageRange::ZeroToOne
    }

    fn diffusion_to_vae(&self, _latents: &mut [f32]) {}

    fn vae_to_diffusion(&self, _latents: &mut [f32]) {}

    fn decode_graph(
        &self,
        runner: &mut Runner,
        latent: &[f32],
        dims: [usize; 2],
        channels: usize,
        max_compute_bytes: Option<usize>,
    ) -> Result<(Vec<f32>, usize)> {
        decode_graph(self, runner, latent, dims, channels, max_compute_bytes)
    }

    fn encode_graph(
        &self,
        runner: &mut Runner,
        image: &[f32],
        dims: [usize; 2],
        channels: usize,
        max_compute_bytes: Option<usize>,
    ) -> Result<(Vec<f32>, usize)> {
        encode_graph(self, runner, image, dims, channels, max_compute_bytes)
    }
}

impl GraphModel for Taesd {
    fn weights(&self) -> &Weights {
        &self.weights
    }

    fn graph_options(&self) -> GraphOptions {
        self.opts
    }

    fn build_decode_graph<'g>(&self, f: &Fwd<'_, 'g>, z: Tensor<'g>) -> Result<Tensor<'g>> {
        self.build_decode(f, z)
    }

    fn build_encode_graph<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'g>) -> Result<Tensor<'g>> {
        self.build_encode(f, x)
    }
}
