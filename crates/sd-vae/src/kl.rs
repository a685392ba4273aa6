//! AutoencoderKL (`ldm.models.autoencoder.AutoencoderKL`), the SD 1.x/2.x and FLUX.1 first stage.
//!
//! Reference: Rombach et al., "High-Resolution Image Synthesis with Latent Diffusion
//! Models" (2022); the graph mirrors stable-diffusion.cpp's `auto_encoder_kl.hpp`.
//! Parameters are `first_stage_model.{encoder,decoder,quant_conv,post_quant_conv}.*`
//! with LDM names. FLUX.1's autoencoder (BFL's `ae.safetensors`, [`VaeConfig::flux`]) is
//! the same network with 16 latent channels and no `quant_conv` / `post_quant_conv`
//! ([`VaeConfig::use_quant`] false). The decoder maps a `[z, h, w]` latent to a `[3, 8h, 8w]` image in
//! `[-1, 1]` (not clamped); the encoder maps such an image to the moments (mean and
//! log-variance) of a diagonal Gaussian over latents ([`LatentDistribution`]).
//!
//! The latent scale factor (0.18215 for SD 1.x/2.x; 0.3611 with shift 0.1159 for FLUX.1) is **not** applied inside the graphs:
//! the caller applies it with [`VaeConfig::diffusion_to_vae`] before decoding and
//! [`VaeConfig::vae_to_diffusion`] after sampling from the encoder's distribution,
//! exactly where stable-diffusion.cpp applies it (`decode_first_stage`,
//! `encode_first_stage`).

use sd_backends::{BufferType, GgmlType, Tensor};
use sd_sched::{Runner, TensorSource, TensorSpec, Weights};

use crate::error::{Result, VaeError};
use crate::nn::{
    patchify, unpatchify, AttnBlock, Conv2d, Downsample, Fwd, GraphOptions, GroupNorm, ResnetBlock, Upsample,
};
use crate::run::{decode_graph, encode_graph, run_graph, FirstStage, GraphModel, ImageRange};

const MODULE: &str = "vae";
const PREFIX: &str = "first_stage_model";

/// The autoencoder's hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct VaeConfig {
    /// Base channel count.
    pub ch: usize,
    /// Channel multiplier per resolution level.
    pub ch_mult: Vec<usize>,
    /// ResNet blocks per level (the decoder has one more).
    pub num_res_blocks: usize,
    /// Image channels.
    pub in_channels: usize,
    /// Output image channels.
    pub out_ch: usize,
    /// Latent channels.
    pub z_channels: usize,
    /// Channels of `quant_conv`/`post_quant_conv`.
    pub embed_dim: usize,
    /// Whether the encoder outputs mean and log-variance (2 x `z_channels`).
    pub double_z: bool,
    /// Group-norm groups.
    pub norm_groups: usize,
    /// Group-norm epsilon.
    pub norm_eps: f32,
    /// `None`: the mid-block attention projections are 1x1 convolutions (LDM files).
    /// `Some(ty)`: they are linear layers with weights stored as `ty` (diffusers files
    /// whose `[C, C]` weights were kept 2-D, as sd.cpp keeps them).
    pub attn_linear: Option<GgmlType>,
    /// Whether the file has `quant_conv` / `post_quant_conv` (1x1 convolutions between
    /// the encoder/decoder and the latent; SD has them, FLUX.1's `ae.safetensors` does not).
    pub use_quant: bool,
    /// Latent scale factor (`latent_vae = latent_diffusion / scale + shift`).
    pub scale_factor: f32,
    /// Latent shift factor.
    pub shift_factor: f32,
    /// The diffusion latent is the VAE latent's 2x2 patches (4 z channels at half the
    /// resolution, channel `4 c + 2 dy + dx`), and the encoder's mean is the latent (no
    /// sampling), as the reference runs FLUX.2's autoencoder.
    pub patched: bool,
    /// Per-channel statistics of the diffusion latent (`None`: the scale and shift alone).
    pub latent_stats: Option<LatentStats>,
}

/// Per-channel statistics a latent is normalised with: `(x - mean) * scale / std` into the
/// diffusion space, the inverse out of it; one value per diffusion latent channel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatentStats {
    /// Mean per channel.
    pub mean: &'static [f32],
    /// Standard deviation per channel.
    pub std: &'static [f32],
}

impl LatentStats {
    /// Applies `f(value, mean, std)` to every value of a planar latent, each with its
    /// channel's statistics (one plane per channel, in order).
    fn per_channel(&self, latents: &mut [f32], f: impl Fn(f32, f32, f32) -> f32) {
        let plane = (latents.len() / self.std.len().max(1)).max(1);
        for (i, v) in latents.iter_mut().enumerate() {
            let c = (i / plane).min(self.std.len() - 1);
            *v = f(*v, self.mean[c], self.std[c]);
        }
    }
}

impl VaeConfig {
    /// The SD 1.x / 2.x VAE: ch 128, mult [1, 2, 4, 4], 2 ResNet blocks, z 4,
    /// 32 groups with eps 1e-6, mid-block attention, quant convs, scale 0.18215.
    pub fn sd() -> Self {
        Self {
            ch: 128,
            ch_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            in_channels: 3,
            out_ch: 3,
            z_channels: 4,
            embed_dim: 4,
            double_z: true,
            norm_groups: 32,
            norm_eps: 1e-6,
            attn_linear: None,
            use_quant: true,
            scale_factor: 0.18215,
            shift_factor: 0.0,
            patched: false,
            latent_stats: None,
        }
    }

    /// The FLUX.1 VAE (`ae.safetensors`, dev and schnell): the SD network with z 16, no
    /// quant convs, latent scale 0.3611 and shift 0.1159 (the reference's values for FLUX).
    pub fn flux() -> Self {
        Self {
            z_channels: 16,
            embed_dim: 16,
            use_quant: false,
            scale_factor: 0.3611,
            shift_factor: 0.1159,
            ..Self::sd()
        }
    }

    /// Pixels per latent pixel: 2^(levels - 1), twice that for a patched latent.
    fn downscale(&self) -> usize {
        (1 << self.ch_mult.len().saturating_sub(1)) * self.patch()
    }

    /// Image pixels per diffusion latent position (8, or 16 for FLUX.2's patched latent).
    pub fn latent_scale(&self) -> usize {
        self.downscale()
    }

    /// The side of the latent's patches: 2 for FLUX.2's, else 1.
    fn patch(&self) -> usize {
        if self.patched {
            2
        } else {
            1
        }
    }

    /// Channels of a diffusion latent: `z_channels`, times 4 when patched.
    pub fn latent_channels(&self) -> usize {
        self.z_channels * self.patch() * self.patch()
    }

    /// Channels of the encoder's output (the moments).
    fn moment_channels(&self) -> usize {
        self.z_channels * if self.double_z { 2 } else { 1 }
    }

    /// Diffusion latents to VAE latents, in place: `x / scale + shift` (in this order,
    /// in f32, as stable-diffusion.cpp computes it). Call before decoding.
    pub fn diffusion_to_vae(&self, latents: &mut [f32]) {
        if let Some(st) = &self.latent_stats {
            // `(x * std) / scale + mean` per channel, as the reference.
            st.per_channel(latents, |v, mean, std| (v * std) / self.scale_factor + mean);
            return;
        }
        for v in latents {
            *v = *v / self.scale_factor + self.shift_factor;
        }
    }

    /// VAE latents to diffusion latents, in place: `(x - shift) * scale`. Call after
    /// [`LatentDistribution::sample`].
    pub fn vae_to_diffusion(&self, latents: &mut [f32]) {
        if let Some(st) = &self.latent_stats {
            // `((x - mean) * scale) / std` per channel, as the reference.
            st.per_channel(latents, |v, mean, std| ((v - mean) * self.scale_factor) / std);
            return;
        }
        for v in latents {
            *v = (*v - self.shift_factor) * self.scale_factor;
        }
    }

    /// Checks that a file of `layout` is a VAE of this configuration: an error naming both
    /// (say an SD VAE given as `--vae` to a FLUX model) otherwise.
    pub fn check_layout(&self, layout: &VaeLayout) -> Result<()> {
        let want = VaeLayout { latent_channels: self.z_channels as u64, quant_convs: self.use_quant };
        if *layout == want {
            return Ok(());
        }
        Err(VaeError::input(
            MODULE,
            format!("the VAE file has {}, but this model needs {}", layout.describe(), want.describe()),
        ))
    }

    fn check(&self) -> Result<()> {
        if self.ch_mult.is_empty() || self.ch == 0 || self.z_channels == 0 || self.norm_groups == 0 {
            return Err(VaeError::input(MODULE, format!("unusable configuration {self:?}")));
        }
        if let Some(st) = &self.latent_stats {
            let c = self.latent_channels();
            if st.mean.len() != c || st.std.len() != c || st.std.iter().any(|&v| !(v.is_finite() && v > 0.0)) {
                return Err(VaeError::input(
                    MODULE,
                    format!(
                        "latent statistics of {} means and {} deviations (positive) for {c} channels",
                        st.mean.len(),
                        st.std.len()
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// What a VAE file's tensor shapes say about it (a standalone `--vae`): the latent channel
/// count and whether it has quant convs. FLUX.1's `ae.safetensors` and SD3's VAE share one
/// layout (16 channels, no quant convs) and differ only in the scale and shift, which the
/// reference takes from the diffusion model; so the file's layout is checked against the
/// family's [`VaeConfig`] ([`VaeConfig::check_layout`]) rather than read as a configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VaeLayout {
    /// Input channels of `decoder.conv_in` (4 for SD 1.x/2.x/SDXL, 16 for FLUX.1/SD3).
    pub latent_channels: u64,
    /// Whether `post_quant_conv.weight` is present.
    pub quant_convs: bool,
}

impl VaeLayout {
    /// The layout of the tensors that `ne_of` describes (internal names,
    /// `first_stage_model.*`, ggml `ne` order: a convolution is `[kw, kh, in, out]`).
    pub fn of_tensors(ne_of: impl Fn(&str) -> Option<Vec<u64>>) -> Result<Self> {
        let conv_in = format!("{PREFIX}.decoder.conv_in.weight");
        let ne = ne_of(&conv_in).ok_or_else(|| {
            VaeError::input(MODULE, format!("no `{conv_in}`: the file holds no AutoencoderKL decoder"))
        })?;
        if ne.len() != 4 || ne[0] != 3 || ne[1] != 3 || ne[2] == 0 {
            return Err(VaeError::input(
                MODULE,
                format!("`{conv_in}` has shape {ne:?} (ggml order), expected a 3x3 convolution [3, 3, z, C]"),
            ));
        }
        let quant_convs = ne_of(&format!("{PREFIX}.post_quant_conv.weight")).is_some();
        Ok(Self { latent_channels: ne[2], quant_convs })
    }

    /// What models use this layout, for messages.
    pub fn describe(&self) -> String {
        let kind = match (self.latent_channels, self.quant_convs) {
            (4, true) => " (an SD 1.x/2.x/SDXL VAE)",
            (16, false) => " (a FLUX.1 or SD3 VAE)",
            _ => "",
        };
        let quant = if self.quant_convs { "with" } else { "without" };
        format!("{} latent channels {quant} quant convs{kind}", self.latent_channels)
    }
}

/// Which halves of the autoencoder to declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VaeParts {
    /// Decoder and `post_quant_conv` if any (text-to-image).
    DecoderOnly,
    /// Both halves (image-to-image).
    Full,
}

/// The parameters of the autoencoder, in a stable order.
pub fn vae_specs(cfg: &VaeConfig, parts: VaeParts) -> Vec<TensorSpec> {
    let mut out = Vec::new();
    let dec = Decoder::new(cfg);
    dec.specs(&mut out);
    if let Some(c) = post_quant_conv(cfg) {
        c.specs(&mut out);
    }
    if parts == VaeParts::Full {
        Encoder::new(cfg).specs(&mut out);
        if let Some(c) = quant_conv(cfg) {
            c.specs(&mut out);
        }
    }
    out
}

fn post_quant_conv(cfg: &VaeConfig) -> Option<Conv2d> {
    cfg.use_quant.then(|| Conv2d::new(format!("{PREFIX}.post_quant_conv"), cfg.z_channels, cfg.embed_dim, 1, 1, 0))
}

fn quant_conv(cfg: &VaeConfig) -> Option<Conv2d> {
    let f = if cfg.double_z { 2 } else { 1 };
    cfg.use_quant.then(|| Conv2d::new(format!("{PREFIX}.quant_conv"), cfg.embed_dim * f, cfg.z_channels * f, 1, 1, 0))
}

/// One resolution level of the encoder.
#[derive(Clone, Debug, PartialEq)]
pub struct DownLevel {
    /// ResNet blocks.
    pub blocks: Vec<ResnetBlock>,
    /// Downsampling (all levels but the last).
    pub downsample: Option<Downsample>,
}

/// One resolution level of the decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct UpLevel {
    /// ResNet blocks.
    pub blocks: Vec<ResnetBlock>,
    /// Upsampling (all levels but level 0).
    pub upsample: Option<Upsample>,
}

/// The middle of both halves: ResNet, attention, ResNet.
#[derive(Clone, Debug, PartialEq)]
pub struct Mid {
    /// `mid.block_1`.
    pub block_1: ResnetBlock,
    /// `mid.attn_1`.
    pub attn_1: AttnBlock,
    /// `mid.block_2`.
    pub block_2: ResnetBlock,
}

impl Mid {
    fn new(prefix: &str, ch: usize, cfg: &VaeConfig) -> Self {
        let (g, e) = (cfg.norm_groups, cfg.norm_eps);
        Self {
            block_1: ResnetBlock::new(&format!("{prefix}.mid.block_1"), ch, ch, g, e),
            attn_1: AttnBlock::new(&format!("{prefix}.mid.attn_1"), ch, g, e, cfg.attn_linear),
            block_2: ResnetBlock::new(&format!("{prefix}.mid.block_2"), ch, ch, g, e),
        }
    }

    fn specs(&self, out: &mut Vec<TensorSpec>) {
        self.block_1.specs(out);
        self.attn_1.specs(out);
        self.block_2.specs(out);
    }

    fn forward<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'g>) -> Result<Tensor<'g>> {
        let h = self.block_1.forward(f, x)?;
        let h = self.attn_1.forward(f, h)?;
        self.block_2.forward(f, h)
    }
}

/// `ldm.modules.diffusionmodules.model.Encoder`.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoder {
    /// Input convolution.
    pub conv_in: Conv2d,
    /// Levels, full resolution first.
    pub down: Vec<DownLevel>,
    /// Middle.
    pub mid: Mid,
    /// Output norm.
    pub norm_out: GroupNorm,
    /// Output convolution (to the moments).
    pub conv_out: Conv2d,
}

impl Encoder {
    /// The encoder of `cfg`.
    pub fn new(cfg: &VaeConfig) -> Self {
        let p = format!("{PREFIX}.encoder");
        let (g, e) = (cfg.norm_groups, cfg.norm_eps);
        let levels = cfg.ch_mult.len();
        let mut down = Vec::with_capacity(levels);
        for i in 0..levels {
            let mut block_in = if i == 0 { cfg.ch } else { cfg.ch * cfg.ch_mult[i - 1] };
            let block_out = cfg.ch * cfg.ch_mult[i];
            let mut blocks = Vec::with_capacity(cfg.num_res_blocks);
            for j in 0..cfg.num_res_blocks {
                blocks.push(ResnetBlock::new(&format!("{p}.down.{i}.block.{j}"), block_in, block_out, g, e));
                block_in = block_out;
            }
            let downsample = (i + 1 != levels).then(|| Downsample::new(&format!("{p}.down.{i}.downsample"), block_in));
            down.push(DownLevel { blocks, downsample });
        }
        let block_in = cfg.ch * cfg.ch_mult[levels - 1];
        Self {
            conv_in: Conv2d::new(format!("{p}.conv_in"), cfg.in_channels, cfg.ch, 3, 1, 1),
            down,
            mid: Mid::new(&p, block_in, cfg),
            norm_out: GroupNorm { name: format!("{p}.norm_out"), channels: block_in, groups: g, eps: e },
            conv_out: Conv2d::new(format!("{p}.conv_out"), block_in, cfg.moment_channels(), 3, 1, 1),
        }
    }

    /// Parameters.
    pub fn specs(&self, out: &mut Vec<TensorSpec>) {
        self.conv_in.specs(out);
        for l in &self.down {
            for b in &l.blocks {
                b.specs(out);
            }
            if let Some(d) = &l.downsample {
                d.conv.specs(out);
            }
        }
        self.mid.specs(out);
        self.norm_out.specs(out);
        self.conv_out.specs(out);
    }

    /// `x` is `[W, H, 3, N]`; returns `[W/8, H/8, 2z, N]`.
    pub fn forward<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'g>) -> Result<Tensor<'g>> {
        let mut h = self.conv_in.forward(f, x)?;
        for level in &self.down {
            for b in &level.blocks {
                h = b.forward(f, h)?;
            }
            if let Some(d) = &level.downsample {
                h = d.forward(f, h)?;
            }
        }
        h = self.mid.forward(f, h)?;
        let h = self.norm_out.forward(f, h)?;
        let h = f.ctx.silu(h);
        self.conv_out.forward(f, h)
    }
}

/// `ldm.modules.diffusionmodules.model.Decoder`.
#[derive(Clone, Debug, PartialEq)]
pub struct Decoder {
    /// Input convolution.
    pub conv_in: Conv2d,
    /// Middle.
    pub mid: Mid,
    /// Levels indexed as in the checkpoint (`up.0` is full resolution); run from the last.
    pub up: Vec<UpLevel>,
    /// Output norm.
    pub norm_out: GroupNorm,
    /// Output convolution (to RGB).
    pub conv_out: Conv2d,
}

impl Decoder {
    /// The decoder of `cfg`.
    pub fn new(cfg: &VaeConfig) -> Self {
        let p = format!("{PREFIX}.decoder");
        let (g, e) = (cfg.norm_groups, cfg.norm_eps);
        let levels = cfg.ch_mult.len();
        let mut block_in = cfg.ch * cfg.ch_mult[levels - 1];
        let conv_in = Conv2d::new(format!("{p}.conv_in"), cfg.z_channels, block_in, 3, 1, 1);
        let mid = Mid::new(&p, block_in, cfg);
        let mut up: Vec<Option<UpLevel>> = vec![None; levels];
        for i in (0..levels).rev() {
            let block_out = cfg.ch * cfg.ch_mult[i];
            let mut blocks = Vec::with_capacity(cfg.num_res_blocks + 1);
            for j in 0..=cfg.num_res_blocks {
                blocks.push(ResnetBlock::new(&format!("{p}.up.{i}.block.{j}"), block_in, block_out, g, e));
                block_in = block_out;
            }
            let upsample = (i != 0).then(|| Upsample::new(&format!("{p}.up.{i}.upsample"), block_in));
            up[i] = Some(UpLevel { blocks, upsample });
        }
        Self {
            conv_in,
            mid,
            up: up.into_iter().map(|l| l.expect("every level is built")).collect(),
            norm_out: GroupNorm { name: format!("{p}.norm_out"), channels: block_in, groups: g, eps: e },
            conv_out: Conv2d::new(format!("{p}.conv_out"), block_in, cfg.out_ch, 3, 1, 1),
        }
    }

    /// Parameters.
    pub fn specs(&self, out: &mut Vec<TensorSpec>) {
        self.conv_in.specs(out);
        self.mid.specs(out);
        for l in self.up.iter().rev() {
            for b in &l.blocks {
                b.specs(out);
            }
            if let Some(u) = &l.upsample {
                u.conv.specs(out);
            }
        }
        self.norm_out.specs(out);
        self.conv_out.specs(out);
    }

    /// `z` is `[w, h, z, N]`; returns `[8w, 8h, 3, N]`.
    pub fn forward<'g>(&self, f: &Fwd<'_, 'g>, z: Tensor<'g>) -> Result<Tensor<'g>> {
        let mut h = self.conv_in.forward(f, z)?;
        h = self.mid.forward(f, h)?;
        for level in self.up.iter().rev() {
            for b in &level.blocks {
                h = b.forward(f, h)?;
            }
            if let Some(u) = &level.upsample {
                h = u.forward(f, h)?;
            }
        }
        let h = self.norm_out.forward(f, h)?;
        let h = f.ctx.silu(h);
        self.conv_out.forward(f, h)
    }
}

/// The diagonal Gaussian the encoder describes (`DiagonalGaussianDistribution`).
#[derive(Clone, Debug, PartialEq)]
pub struct LatentDistribution {
    /// Mean, planar `[z, h, w]`.
    pub mean: Vec<f32>,
    /// Log-variance, same layout.
    pub logvar: Vec<f32>,
    /// Latent `[w, h]`.
    pub dims: (usize, usize),
    /// Latent channels.
    pub channels: usize,
}

impl LatentDistribution {
    /// Splits encoder moments (planar `[2z, h, w]`) into mean (first half of the
    /// channels) and log-variance (second half).
    pub fn from_moments(moments: &[f32], dims: (usize, usize), channels2: usize) -> Result<Self> {
        let plane = dims.0 * dims.1;
        if !channels2.is_multiple_of(2) || moments.len() != plane * channels2 {
            return Err(VaeError::input(
                MODULE,
                format!(
                    "moments have {} values, expected an even channel count times {}x{}",
                    moments.len(),
                    dims.1,
                    dims.0
                ),
            ));
        }
        let half = plane * channels2 / 2;
        Ok(Self { mean: moments[..half].to_vec(), logvar: moments[half..].to_vec(), dims, channels: channels2 / 2 })
    }

    /// A sample `mean + exp(0.5 * clamp(logvar, -30, 20)) * noise` with the caller's
    /// standard-normal `noise` (one value per latent element, drawn from the generation's
    /// RNG as stable-diffusion.cpp draws it with `randn_like(mean)`).
    pub fn sample(&self, noise: &[f32]) -> Result<Vec<f32>> {
        if noise.len() != self.mean.len() {
            return Err(VaeError::input(
                MODULE,
                format!("noise has {} values, the latent {}", noise.len(), self.mean.len()),
            ));
        }
        Ok(self
            .mean
            .iter()
            .zip(&self.logvar)
            .zip(noise)
            .map(|((&m, &lv), &n)| {
                let std = (0.5f32 * lv.clamp(-30.0, 20.0)).exp();
                m + std * n
            })
            .collect())
    }

    /// The mean (what pix2pix-style models use instead of a sample).
    pub fn mode(&self) -> &[f32] {
        &self.mean
    }
}

/// The SD 1.x/2.x (or FLUX.1) autoencoder with its weights.
pub struct AutoencoderKl {
    cfg: VaeConfig,
    decoder: Decoder,
    post_quant_conv: Option<Conv2d>,
    encoder: Option<(Encoder, Option<Conv2d>)>,
    weights: Weights,
    opts: GraphOptions,
}

impl std::fmt::Debug for AutoencoderKl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AutoencoderKl")
            .field("cfg", &self.cfg)
            .field("encoder", &self.encoder.is_some())
            .field("opts", &self.opts)
            .finish()
    }
}

impl AutoencoderKl {
    /// Declares the parameters of `parts`, allocates them on `buft` and fills them from `source`.
    pub fn load(cfg: VaeConfig, parts: VaeParts, source: &dyn TensorSource, buft: BufferType) -> Result<Self> {
        cfg.check()?;
        let w = |e| VaeError::Weights { module: MODULE, source: e };
        let mut weights = Weights::new(vae_specs(&cfg, parts)).map_err(w)?;
        weights.allocate(buft).map_err(w)?;
        weights.load_from(source).map_err(w)?;
        Self::from_weights(cfg, weights)
    }

    /// Wraps weights declared with [`vae_specs`] and already filled (the encoder is
    /// available when the set holds its tensors).
    pub fn from_weights(cfg: VaeConfig, weights: Weights) -> Result<Self> {
        cfg.check()?;
        let has_encoder = weights.contains(&format!("{PREFIX}.encoder.conv_in.weight"));
        let parts = if has_encoder { VaeParts::Full } else { VaeParts::DecoderOnly };
        for s in vae_specs(&cfg, parts) {
            if !weights.contains(&s.name) {
                return Err(VaeError::Weights { module: MODULE, source: sd_sched::SchedError::MissingTensor(s.name) });
            }
        }
        Ok(Self {
            decoder: Decoder::new(&cfg),
            post_quant_conv: post_quant_conv(&cfg),
            encoder: has_encoder.then(|| (Encoder::new(&cfg), quant_conv(&cfg))),
            cfg,
            weights,
            opts: GraphOptions::default(),
        })
    }

    /// Sets the graph switches (direct convolution, flash attention).
    pub fn with_options(mut self, opts: GraphOptions) -> Self {
        self.opts = opts;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &VaeConfig {
        &self.cfg
    }

    /// The weights.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Whether the encoder was loaded.
    pub fn has_encoder(&self) -> bool {
        self.encoder.is_some()
    }

    /// Builds the decode graph on `z` (`[w, h, z, 1]`, VAE latents): `post_quant_conv`
    /// (if the configuration has one) then the decoder. Returns `[8w, 8h, 3, 1]`.
    pub fn build_decode<'g>(&self, f: &Fwd<'_, 'g>, z: Tensor<'g>) -> Result<Tensor<'g>> {
        let z = if self.cfg.patched { unpatchify(f.ctx, z) } else { z };
        let z = match &self.post_quant_conv {
            Some(c) => c.forward(f, z)?,
            None => z,
        };
        self.decoder.forward(f, z)
    }

    /// Builds the encode graph on `x` (`[W, H, 3, 1]` in [-1, 1]): the encoder then
    /// `quant_conv` (if any). Returns the moments `[W/8, H/8, 2z, 1]`.
    pub fn build_encode<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'g>) -> Result<Tensor<'g>> {
        let (enc, quant) = self
            .encoder
            .as_ref()
            .ok_or_else(|| VaeError::input(MODULE, "the encoder was not loaded (VaeParts::DecoderOnly)"))?;
        let h = enc.forward(f, x)?;
        let moments = match quant {
            Some(q) => q.forward(f, h)?,
            None => h,
        };
        if !self.cfg.patched {
            return Ok(moments);
        }
        // FLUX.2: the mean (the first z channels) in 2x2 patches.
        let [w, h, _, n] = moments.shape();
        let nb = moments.nb();
        let mean = f.ctx.view(moments, [w, h, self.cfg.z_channels as i64, n], [nb[1], nb[2], nb[3]], 0);
        Ok(patchify(f.ctx, mean))
    }

    /// Decodes one VAE latent (planar `[channels, h, w]`, already divided by the scale
    /// factor) to an image, planar `[3, 8h, 8w]` in [-1, 1] before clamping. One graph,
    /// no tiling (see [`crate::decode_tiled`] for the main decode path).
    pub fn decode(
        &self,
        runner: &mut Runner,
        latent: &[f32],
        dims: (usize, usize),
        channels: usize,
    ) -> Result<Vec<f32>> {
        self.decode_graph(runner, latent, [dims.0, dims.1], channels, None).map(|(v, _)| v)
    }

    /// Encodes an image (planar `[3, H, W]` in [-1, 1], `H` and `W` multiples of 8) to the
    /// moments of the latent distribution. One graph, no tiling (see [`crate::encode_tiled`]).
    pub fn encode(&self, runner: &mut Runner, image: &[f32], dims: (usize, usize)) -> Result<LatentDistribution> {
        let (m, c) = self.encode_graph(runner, image, [dims.0, dims.1], self.cfg.in_channels, None)?;
        let s = self.cfg.downscale();
        LatentDistribution::from_moments(&m, (dims.0 / s, dims.1 / s), c)
    }

    /// Runs one named block (`decoder.mid.block_1`, `decoder.mid.attn_1`,
    /// `decoder.up.2.upsample`, `encoder.down.0.downsample`, `decoder.conv_in`,
    /// `decoder.norm_out`, `post_quant_conv`, ...; names without the
    /// `first_stage_model.` prefix) on a planar `[c, h, w]` input. Returns the output
    /// and its `[w, h, c]`. For comparisons against the reference, block by block.
    pub fn run_block(
        &self,
        runner: &mut Runner,
        name: &str,
        input: &[f32],
        dims: [usize; 3],
    ) -> Result<(Vec<f32>, [usize; 3])> {
        let full = format!("{PREFIX}.{name}");
        let block =
            self.find_block(&full).ok_or_else(|| VaeError::input(MODULE, format!("no block named `{name}`")))?;
        run_graph(runner, MODULE, &self.weights, self.opts, input, dims, None, |f, x| match block {
            Block::Conv(c) => c.forward(f, x),
            Block::Norm(n) => n.forward(f, x),
            Block::Resnet(r) => r.forward(f, x),
            Block::Attn(a) => a.forward(f, x),
            Block::Up(u) => u.forward(f, x),
            Block::Down(d) => d.forward(f, x),
        })
    }

    fn find_block(&self, full: &str) -> Option<Block<'_>> {
        let convs = [Some(&self.decoder.conv_in), Some(&self.decoder.conv_out), self.post_quant_conv.as_ref()];
        let mut found = convs.into_iter().flatten().find(|c| c.name == full).map(Block::Conv);
        let mids = std::iter::once(&self.decoder.mid).chain(self.encoder.as_ref().map(|(e, _)| &e.mid));
        let mut resnets: Vec<&ResnetBlock> = self.decoder.up.iter().flat_map(|l| &l.blocks).collect();
        let mut norms = vec![&self.decoder.norm_out];
        let ups: Vec<&Upsample> = self.decoder.up.iter().filter_map(|l| l.upsample.as_ref()).collect();
        let mut downs: Vec<&Downsample> = Vec::new();
        let mut attns = Vec::new();
        for m in mids {
            resnets.extend([&m.block_1, &m.block_2]);
            attns.push(&m.attn_1);
        }
        if let Some((e, q)) = &self.encoder {
            for c in [Some(&e.conv_in), Some(&e.conv_out), q.as_ref()].into_iter().flatten() {
                if c.name == full {
                    found = Some(Block::Conv(c));
                }
            }
            resnets.extend(e.down.iter().flat_map(|l| &l.blocks));
            downs.extend(e.down.iter().filter_map(|l| l.downsample.as_ref()));
            norms.push(&e.norm_out);
        }
        found
            .or_else(|| resnets.into_iter().find(|r| r.name == full).map(Block::Resnet))
            .or_else(|| attns.into_iter().find(|a| a.name == full).map(Block::Attn))
            .or_else(|| norms.into_iter().find(|n| n.name == full).map(Block::Norm))
            .or_else(|| ups.into_iter().find(|u| u.conv.name.strip_suffix(".conv") == Some(full)).map(Block::Up))
            .or_else(|| downs.into_iter().find(|d| d.conv.name.strip_suffix(".conv") == Some(full)).map(Block::Down))
    }
}

#[derive(Clone, Copy)]
enum Block<'a> {
    Conv(&'a Conv2d),
    Norm(&'a GroupNorm),
    Resnet(&'a ResnetBlock),
    Attn(&'a AttnBlock),
    Up(&'a Upsample),
    Down(&'a Downsample),
}

impl FirstStage for AutoencoderKl {
    fn params(&self) -> Option<&Weights> {
        Some(GraphModel::weights(self))
    }

    fn module(&self) -> &'static str {
        MODULE
    }

    fn scale_factor(&self) -> usize {
        self.cfg.downscale()
    }

    fn latent_channels(&self) -> usize {
        self.cfg.latent_channels()
    }

    fn image_channels(&self) -> usize {
        self.cfg.out_ch
    }

    fn image_range(&self) -> ImageRange {
        ImageRange::MinusOneToOne
    }

    fn diffusion_to_vae(&self, latents: &mut [f32]) {
        self.cfg.diffusion_to_vae(latents)
    }

    fn vae_to_diffusion(&self, latents: &mut [f32]) {
        self.cfg.vae_to_diffusion(latents)
    }

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

impl GraphModel for AutoencoderKl {
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
