//! The UNet of SD 1.x / 2.x and SDXL (`ldm.modules.diffusionmodules.openaimodel.UNetModel`) as a
//! ggml graph.
//!
//! References: Rombach et al., "High-Resolution Image Synthesis with Latent Diffusion
//! Models" (arXiv:2112.10752), and stable-diffusion.cpp's `unet.hpp`, whose graph this one
//! reproduces op for op (see [`super::blocks`] for the per-block numerics).
//!
//! Shape: a timestep embedding (`time_embed`), `input_blocks` (a 3x3 stem, then per level
//! `num_res_blocks` ResBlocks, each followed by a SpatialTransformer at the attention
//! resolutions, and a stride-2 Downsample between levels), a `middle_block` (ResBlock,
//! SpatialTransformer, ResBlock), `output_blocks` mirroring the input blocks with the
//! input blocks' activations concatenated on the channel axis, and `out` (GroupNorm,
//! SiLU, 3x3 conv). The network outputs the model prediction (eps or v) as it is; the
//! sampler interprets it.
//!
//! SDXL adds a class-embedding path (`label_emb`: the ADM vector, pooled text embedding and
//! size embeddings, through two linears with a SiLU, added to the timestep embedding), a
//! transformer depth per level (1/2/10) and no transformer at the first level. Distilled
//! variants (SSD-1B, Vega) drop transformer blocks and the middle block's attention: their
//! depths are read from the file's tensor names ([`UNetConfig::adapted_to_file`]), not from a
//! list of known models.
//!
//! Batching: stable-diffusion.cpp evaluates the conditional and unconditional passes as
//! two separate batch-1 calls. Every op here treats samples independently, so a batch of
//! two gives the same numbers as two calls (a test checks this); [`UNetModel::eval`] takes
//! any batch and leaves the choice to the sampler.

use sd_backends::{BufferType, Context, GgmlType, Tensor};
use sd_sched::{Runner, TensorSource, TensorSpec, Weights};

use super::blocks::{self, AttnKernel, SpecSink, TransformerShape};
use super::{DiffusionError, Result, TensorProblem};

/// Prefix of every UNet tensor's internal name.
pub const PREFIX: &str = "model.diffusion_model";
/// Period of the sinusoidal timestep embedding.
const MAX_PERIOD: i32 = 10000;
/// Tensors (and graph nodes) the metadata context of one UNet graph may hold. SD 1.5 builds
/// about 2,550 tensors (2,530 nodes, views included); a test keeps the bound at 2x that.
pub const GRAPH_SIZE: usize = 16384;

const MODEL: &str = "UNet";

/// How the attention heads of a transformer are sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heads {
    /// A fixed number of heads at every level (SD 1.x: 8).
    Count(i64),
    /// A fixed head width, heads = channels / width (SD 2.x: `num_head_channels` 64).
    Width(i64),
}

/// `UNetModel` hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct UNetConfig {
    /// Latent channels in (4; 9 for inpainting models).
    pub in_channels: i64,
    /// Channels out.
    pub out_channels: i64,
    /// Channels of the first level.
    pub model_channels: i64,
    /// Width of the timestep embedding (4 x `model_channels` in SD 1.x / 2.x).
    pub time_embed_dim: i64,
    /// Per-level channel multipliers.
    pub channel_mult: Vec<i64>,
    /// ResBlocks per level on the way down (one more on the way up).
    pub num_res_blocks: usize,
    /// Downsampling factors (`ds` = 1, 2, 4, ...) of the levels that have transformers.
    pub attention_resolutions: Vec<i64>,
    /// Head sizing of the transformers.
    pub heads: Heads,
    /// Transformer blocks per SpatialTransformer, per level (the middle block takes the last).
    pub transformer_depth: Vec<usize>,
    /// Depths a file gives single SpatialTransformers (by layer name under [`PREFIX`], e.g.
    /// `input_blocks.7.1`) where they differ from their level's (SSD-1B).
    pub depth_overrides: std::collections::BTreeMap<String, usize>,
    /// Whether the middle block has its SpatialTransformer and second ResBlock (SSD-1B and
    /// Vega have only the first ResBlock).
    pub middle_transformer: bool,
    /// Width of the ADM vector of the class-embedding path (SDXL: 2816); `None` without one.
    pub adm_in_channels: Option<i64>,
    /// Width of the text context (768 for CLIP ViT-L, 1024 for OpenCLIP ViT-H).
    pub context_dim: i64,
    /// Linear `proj_in`/`proj_out` in the transformers instead of 1x1 convolutions.
    pub use_linear_projection: bool,
}

impl UNetConfig {
    /// SD 1.x (v1-inference.yaml): 320 channels, mult [1, 2, 4, 4], 8 heads, context 768.
    pub fn sd15() -> Self {
        UNetConfig {
            in_channels: 4,
            out_channels: 4,
            model_channels: 320,
            time_embed_dim: 1280,
            channel_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            attention_resolutions: vec![4, 2, 1],
            heads: Heads::Count(8),
            transformer_depth: vec![1; 4],
            depth_overrides: Default::default(),
            middle_transformer: true,
            adm_in_channels: None,
            context_dim: 768,
            use_linear_projection: false,
        }
    }

    /// SD 2.x (v2-inference[-v].yaml; SD-Turbo too): head width 64, context 1024, linear projections.
    pub fn sd21() -> Self {
        UNetConfig { heads: Heads::Width(64), context_dim: 1024, use_linear_projection: true, ..UNetConfig::sd15() }
    }

    /// SDXL base (sd_xl_base.yaml; SDXL-Turbo too): mult [1, 2, 4], attention at the last two
    /// levels with depths 2 and 10 (10 in the middle), head width 64, context 2048, linear
    /// projections, ADM input 2816.
    pub fn sdxl() -> Self {
        UNetConfig {
            channel_mult: vec![1, 2, 4],
            attention_resolutions: vec![4, 2],
            transformer_depth: vec![1, 2, 10],
            heads: Heads::Width(64),
            context_dim: 2048,
            use_linear_projection: true,
            adm_in_channels: Some(2816),
            ..UNetConfig::sd15()
        }
    }

    /// This config with the widths a file's tensors show, as the reference detects them:
    /// input and model channels from `input_blocks.0.0.weight`, the embedding width from
    /// `time_embed.0.weight`, output channels from `out.2.weight`, the context width from
    /// the first cross-attention `to_k`, and linear vs convolution projections from the
    /// rank of the first transformer's `proj_out.weight`. `ne_of` returns a tensor's ggml
    /// shape (innermost first) by internal name.
    pub fn adapted_to_file(mut self, ne_of: &dyn Fn(&str) -> Option<Vec<u64>>) -> Self {
        let get = |rel: &str| ne_of(&format!("{PREFIX}.{rel}"));
        if let Some(ne) = get("input_blocks.0.0.weight").filter(|ne| ne.len() == 4) {
            self.in_channels = ne[2] as i64;
            self.model_channels = ne[3] as i64;
            self.time_embed_dim = 4 * self.model_channels;
        }
        if let Some(ne) = get("time_embed.0.weight").filter(|ne| ne.len() == 2) {
            self.model_channels = ne[0] as i64;
            self.time_embed_dim = ne[1] as i64;
        }
        if let Some(ne) = get("out.2.weight").filter(|ne| ne.len() == 4) {
            self.out_channels = ne[3] as i64;
        }
        if let Some(ne) = get("label_emb.0.0.weight").filter(|ne| ne.len() == 2) {
            self.adm_in_channels = Some(ne[0] as i64);
            self.time_embed_dim = ne[1] as i64;
        }
        // Block depths as the file has them (distilled models drop transformer blocks).
        if get("middle_block.0.in_layers.0.weight").is_some() {
            self.middle_transformer = get("middle_block.1.norm.weight").is_some();
        }
        let depth_in_file = |rel: &str| {
            (0..).take_while(|k| get(&format!("{rel}.transformer_blocks.{k}.attn1.to_q.weight")).is_some()).count()
        };
        for block in layout(&self).blocks() {
            for (p, l) in &block.layers {
                let Layer::Transformer(t) = l else { continue };
                let rel = p.strip_prefix(&format!("{PREFIX}.")).unwrap_or(p).to_string();
                let d = depth_in_file(&rel);
                if d > 0 && d != t.depth {
                    self.depth_overrides.insert(rel, d);
                }
            }
        }
        let layout = layout(&self);
        let first_transformer = layout
            .blocks()
            .flat_map(|b| &b.layers)
            .find_map(|(p, l)| matches!(l, Layer::Transformer { .. }).then(|| p.clone()));
        if let Some(p) = first_transformer {
            let rel = p.strip_prefix(&format!("{PREFIX}.")).unwrap_or(&p).to_string();
            if let Some(ne) = get(&format!("{rel}.transformer_blocks.0.attn2.to_k.weight")).filter(|ne| ne.len() == 2) {
                self.context_dim = ne[0] as i64;
            }
            match get(&format!("{rel}.proj_out.weight")).map(|ne| ne.len()) {
                Some(4) => self.use_linear_projection = false,
                Some(2) => self.use_linear_projection = true,
                _ => {}
            }
        }
        self
    }

    /// Checks the hyper-parameters; the error names the offending field.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(DiffusionError::Config { model: MODEL, reason });
        if self.channel_mult.is_empty()
            || self.num_res_blocks == 0
            || self.transformer_depth.len() != self.channel_mult.len()
            || self.transformer_depth.contains(&0)
            || self.depth_overrides.values().any(|&d| d == 0)
        {
            return bad(format!(
                "channel_mult and num_res_blocks must be non-empty / non-zero, and transformer_depth \
                 must give every level a non-zero depth: {self:?}"
            ));
        }
        if self.adm_in_channels.is_some_and(|a| a <= 0) {
            return bad(format!("adm_in_channels must be positive: {self:?}"));
        }
        if self.in_channels <= 0 || self.out_channels <= 0 || self.context_dim <= 0 || self.time_embed_dim <= 0 {
            return bad(format!("in/out channels, context_dim and time_embed_dim must be positive: {self:?}"));
        }
        if self.model_channels <= 0 || self.model_channels % 2 != 0 {
            return bad(format!(
                "model_channels {} must be positive and even (timestep embedding)",
                self.model_channels
            ));
        }
        for &m in &self.channel_mult {
            let c = m * self.model_channels;
            if c <= 0 || c % blocks::GROUPS as i64 != 0 {
                return bad(format!(
                    "level width {c} (model_channels {} x mult {m}) is not a positive multiple of 32 (GroupNorm32)",
                    self.model_channels
                ));
            }
            let ok = match self.heads {
                Heads::Count(n) => n > 0 && c % n == 0,
                Heads::Width(d) => d > 0 && c % d == 0,
            };
            if !ok {
                return bad(format!("{:?} does not divide level width {c}", self.heads));
            }
        }
        Ok(())
    }

    /// Heads of a transformer with `ch` channels.
    pub fn n_head(&self, ch: i64) -> i64 {
        match self.heads {
            Heads::Count(n) => n,
            Heads::Width(d) => ch / d,
        }
    }

    /// Bytes of the f32 attention scores (`heads x tokens^2` per sample) at the first level
    /// with attention, for `tokens` latent positions and `batch` samples: the largest working
    /// tensor of a UNet evaluated without flash attention (SD 1.x/2.x: the first level; SDXL:
    /// the second, a quarter of the tokens).
    pub fn attention_scores_bytes(&self, tokens: f64, batch: f64) -> f64 {
        let ds = self.attention_resolutions.iter().copied().min().unwrap_or(1).max(1);
        let level = ds.ilog2() as usize;
        let ch = self.channel_mult.get(level).copied().unwrap_or(1) * self.model_channels;
        let t = tokens / (ds * ds) as f64;
        batch * self.n_head(ch) as f64 * t * t * 4.0
    }

    /// The latent width and height must be multiples of this (one halving per level but the last).
    pub(crate) fn size_multiple(&self) -> i64 {
        1 << (self.channel_mult.len().saturating_sub(1))
    }

    /// The SpatialTransformer `rel` (its name under [`PREFIX`]) of `ch` channels at `level`.
    fn transformer(&self, rel: &str, level: usize, ch: i64) -> TransformerShape {
        let level_depth = self.transformer_depth.get(level).or(self.transformer_depth.last()).copied().unwrap_or(1);
        TransformerShape {
            channels: ch,
            n_head: self.n_head(ch),
            depth: self.depth_overrides.get(rel).copied().unwrap_or(level_depth),
            context_dim: self.context_dim,
            linear_proj: self.use_linear_projection,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------------------

/// One module inside a UNet block.
#[derive(Debug, Clone, PartialEq)]
pub enum Layer {
    /// The 3x3 stem convolution (`input_blocks.0.0`).
    Stem { inp: i64, out: i64 },
    /// A `ResBlock`.
    Res { inp: i64, out: i64 },
    /// A `SpatialTransformer`.
    Transformer(TransformerShape),
    /// A stride-2 `Downsample`.
    Down { ch: i64 },
    /// A nearest x2 `Upsample`.
    Up { ch: i64 },
}

/// A numbered UNet block: its name (the graph-cut label) and its modules with their full prefixes.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// `input_blocks.N`, `middle_block` or `output_blocks.N`.
    pub name: String,
    /// (full name prefix, module), in execution order.
    pub layers: Vec<(String, Layer)>,
}

/// The blocks of a UNet in execution order.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// `input_blocks.*`; each one's output is kept for a skip connection.
    pub input: Vec<Block>,
    /// `middle_block`.
    pub middle: Block,
    /// `output_blocks.*`; each one first concatenates the last kept skip activation.
    pub output: Vec<Block>,
}

impl Layout {
    /// Every block, input to output.
    pub fn blocks(&self) -> impl Iterator<Item = &Block> {
        self.input.iter().chain(std::iter::once(&self.middle)).chain(self.output.iter())
    }
}

/// Walks the module tree of `cfg` (the constructor of `UNetModel`).
pub fn layout(cfg: &UNetConfig) -> Layout {
    layout_under(cfg, PREFIX)
}

/// [`layout`] with the modules named under `prefix` instead of [`PREFIX`] (a ControlNet's copy
/// of the input and middle blocks, `super::controlnet`).
pub(crate) fn layout_under(cfg: &UNetConfig, prefix: &str) -> Layout {
    let mc = cfg.model_channels;
    let levels = cfg.channel_mult.len();
    let name = |s: String| format!("{prefix}.{s}");
    let mut input = vec![Block {
        name: "input_blocks.0".into(),
        layers: vec![(name("input_blocks.0.0".into()), Layer::Stem { inp: cfg.in_channels, out: mc })],
    }];
    let mut skip_chans = vec![mc];
    let mut ch = mc;
    let mut ds = 1;
    let mut idx = 0;
    for (level, &mult) in cfg.channel_mult.iter().enumerate() {
        for _ in 0..cfg.num_res_blocks {
            idx += 1;
            let out = mult * mc;
            let mut layers = vec![(name(format!("input_blocks.{idx}.0")), Layer::Res { inp: ch, out })];
            ch = out;
            if cfg.attention_resolutions.contains(&ds) {
                let rel = format!("input_blocks.{idx}.1");
                layers.push((name(rel.clone()), Layer::Transformer(cfg.transformer(&rel, level, ch))));
            }
            input.push(Block { name: format!("input_blocks.{idx}"), layers });
            skip_chans.push(ch);
        }
        if level != levels - 1 {
            idx += 1;
            input.push(Block {
                name: format!("input_blocks.{idx}"),
                layers: vec![(name(format!("input_blocks.{idx}.0")), Layer::Down { ch })],
            });
            skip_chans.push(ch);
            ds *= 2;
        }
    }

    let mut middle_layers = vec![(name("middle_block.0".into()), Layer::Res { inp: ch, out: ch })];
    if cfg.middle_transformer {
        let t = cfg.transformer("middle_block.1", levels - 1, ch);
        middle_layers.push((name("middle_block.1".into()), Layer::Transformer(t)));
        middle_layers.push((name("middle_block.2".into()), Layer::Res { inp: ch, out: ch }));
    }
    let middle = Block { name: "middle_block".into(), layers: middle_layers };

    let mut output = Vec::new();
    let mut idx = 0;
    for (level, &mult) in cfg.channel_mult.iter().enumerate().rev() {
        for j in 0..=cfg.num_res_blocks {
            let skip = skip_chans.pop().expect("one skip connection per output block");
            let out = mult * mc;
            let mut layers = vec![(name(format!("output_blocks.{idx}.0")), Layer::Res { inp: ch + skip, out })];
            ch = out;
            let mut sub = 1;
            if cfg.attention_resolutions.contains(&ds) {
                let rel = format!("output_blocks.{idx}.1");
                layers.push((name(rel.clone()), Layer::Transformer(cfg.transformer(&rel, level, ch))));
                sub = 2;
            }
            if level > 0 && j == cfg.num_res_blocks {
                layers.push((name(format!("output_blocks.{idx}.{sub}")), Layer::Up { ch }));
                ds /= 2;
            }
            output.push(Block { name: format!("output_blocks.{idx}"), layers });
            idx += 1;
        }
    }
    Layout { input, middle, output }
}

// ---------------------------------------------------------------------------------------
// Parameters
// ---------------------------------------------------------------------------------------

/// Every UNet parameter: internal name, storage type and ggml shape.
///
/// `dtype_of` gives the file's type of a tensor by internal name (None when absent);
/// `wtype` is the `--type` override. Storage follows the reference: convolution kernels
/// f16, biases and norms f32, linear weights the file's type or the override (except
/// `time_embed.*`, which `--type` leaves alone); see [`crate::wtype::linear_weight_type`].
pub fn unet_specs(
    cfg: &UNetConfig,
    dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
    wtype: Option<GgmlType>,
) -> Vec<TensorSpec> {
    let mut s = SpecSink::new(dtype_of, wtype);
    time_embedding_specs(&mut s, PREFIX, cfg);
    for block in layout(cfg).blocks() {
        block_specs(&mut s, block, cfg.time_embed_dim);
    }
    let mc = cfg.model_channels;
    s.norm(&format!("{PREFIX}.out.0"), mc);
    s.conv2d(&format!("{PREFIX}.out.2"), mc, cfg.out_channels, 3);
    s.specs
}

/// The specs of [`time_embedding`]'s weights under `prefix`.
pub(crate) fn time_embedding_specs(s: &mut SpecSink<'_>, prefix: &str, cfg: &UNetConfig) {
    let (mc, temb) = (cfg.model_channels, cfg.time_embed_dim);
    s.linear(&format!("{prefix}.time_embed.0"), mc, temb, true);
    s.linear(&format!("{prefix}.time_embed.2"), temb, temb, true);
    if let Some(adm) = cfg.adm_in_channels {
        s.linear(&format!("{prefix}.label_emb.0.0"), adm, temb, true);
        s.linear(&format!("{prefix}.label_emb.0.2"), temb, temb, true);
    }
}

/// The specs of one layout block's layers ([`run_layers`]), with timestep embeddings `temb` wide.
pub(crate) fn block_specs(s: &mut SpecSink<'_>, block: &Block, temb: i64) {
    for (p, layer) in &block.layers {
        match layer {
            Layer::Stem { inp, out } => s.conv2d(p, *inp, *out, 3),
            Layer::Res { inp, out } => blocks::res_block_specs(s, p, *inp, *out, temb),
            Layer::Transformer(t) => blocks::spatial_transformer_specs(s, p, t),
            Layer::Down { ch } => blocks::downsample_specs(s, p, *ch),
            Layer::Up { ch } => blocks::upsample_specs(s, p, *ch),
        }
    }
}

/// Checks a file's UNet tensors against `specs`.
///
/// `file` lists the file's tensors as (internal name, ggml shape innermost first, as
/// `TensorEntry::ne` gives it); trailing dimensions of 1 are ignored on both sides. Every
/// missing tensor and shape mismatch is reported in one error; on success the names under
/// the UNet prefix that the architecture does not use are returned, for a warning.
pub fn validate_against_file(specs: &[TensorSpec], file: &[(String, Vec<u64>)]) -> Result<Vec<String>> {
    fn trim(ne: &[i64]) -> Vec<i64> {
        let mut v = ne.to_vec();
        while v.len() > 1 && v.last() == Some(&1) {
            v.pop();
        }
        v
    }
    let found: std::collections::HashMap<&str, Vec<i64>> =
        file.iter().map(|(n, ne)| (n.as_str(), ne.iter().map(|&d| d as i64).collect())).collect();
    let mut problems = Vec::new();
    for s in specs {
        match found.get(s.name.as_str()) {
            None => problems.push(TensorProblem::Missing { name: s.name.clone(), expected: s.ne.clone() }),
            Some(ne) if trim(ne) != trim(&s.ne) => {
                problems.push(TensorProblem::Shape { name: s.name.clone(), expected: s.ne.clone(), found: ne.clone() })
            }
            Some(_) => {}
        }
    }
    if !problems.is_empty() {
        return Err(DiffusionError::WeightsMismatch { model: MODEL, problems });
    }
    let known: std::collections::HashSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    let prefix = format!("{PREFIX}.");
    Ok(file
        .iter()
        .filter(|(n, _)| n.starts_with(&prefix) && !known.contains(n.as_str()))
        .map(|(n, _)| n.clone())
        .collect())
}

// ---------------------------------------------------------------------------------------
// Graph
// ---------------------------------------------------------------------------------------

/// The UNet graph: x [W, H, in_channels, N], timesteps [N], context [context_dim, L, N or 1]
/// -> [W, H, out_channels, N]. `flash_attn` selects `ggml_flash_attn_ext` for attention.
/// Pushes `(block name, activation)` after the time embedding, each block and `out`.
#[allow(clippy::too_many_arguments)]
pub fn forward<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &UNetConfig,
    x: Tensor<'g>,
    timesteps: Tensor<'g>,
    context: Tensor<'g>,
    flash_attn: bool,
    cuts: &mut Vec<(String, Tensor<'g>)>,
) -> Result<Tensor<'g>> {
    forward_with(g, w, cfg, x, timesteps, context, None, AttnKernel::from_flag(flash_attn), None, cuts)
}

/// [`forward`] for a model with a class embedding (SDXL): `y` is the ADM vector [adm, N].
#[allow(clippy::too_many_arguments)]
pub fn forward_adm<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &UNetConfig,
    x: Tensor<'g>,
    timesteps: Tensor<'g>,
    context: Tensor<'g>,
    y: Tensor<'g>,
    flash_attn: bool,
    cuts: &mut Vec<(String, Tensor<'g>)>,
) -> Result<Tensor<'g>> {
    forward_with(g, w, cfg, x, timesteps, context, Some(y), AttnKernel::from_flag(flash_attn), None, cuts)
}

/// The timestep embedding of a UNet (or its ControlNet copy) whose weights are under `prefix`,
/// plus SDXL's class embedding of the ADM vector `y` when given: [temb, N].
pub(crate) fn time_embedding<'g>(
    g: &'g Context,
    w: &Weights,
    prefix: &str,
    model_channels: i64,
    timesteps: Tensor<'g>,
    y: Option<Tensor<'g>>,
) -> Result<Tensor<'g>> {
    let t_emb = g.timestep_embedding(timesteps, model_channels as i32, MAX_PERIOD); // [mc, N]
    let mut emb = blocks::linear(g, w, &format!("{prefix}.time_embed.0"), t_emb, true)?;
    emb = g.silu(emb);
    emb = blocks::linear(g, w, &format!("{prefix}.time_embed.2"), emb, true)?;
    if let Some(y) = y {
        let mut label = blocks::linear(g, w, &format!("{prefix}.label_emb.0.0"), y, true)?;
        label = g.silu(label);
        label = blocks::linear(g, w, &format!("{prefix}.label_emb.0.2"), label, true)?;
        emb = g.add(emb, label);
    }
    Ok(emb)
}

/// The layers of one layout block on `h`, with the timestep embedding and the context
/// (`(emb, context)`). With `cuts` (the weights' prefix and the cut list), each spatial
/// transformer pushes a graph cut after each of its transformer blocks but the last, named
/// after the layer without the prefix.
pub(crate) fn run_layers<'g>(
    g: &'g Context,
    w: &Weights,
    block: &Block,
    mut h: Tensor<'g>,
    (emb, context): (Tensor<'g>, Tensor<'g>),
    kernel: AttnKernel,
    mut cuts: Option<(&str, &mut Vec<(String, Tensor<'g>)>)>,
) -> Result<Tensor<'g>> {
    for (p, layer) in &block.layers {
        h = match layer {
            Layer::Stem { .. } => blocks::conv2d(g, w, p, h, 1, 1)?,
            Layer::Res { .. } => blocks::res_block(g, w, p, h, emb)?,
            Layer::Transformer(t) => {
                let cut = cuts.as_mut().map(|(prefix, list)| {
                    let rel = p.strip_prefix(*prefix).and_then(|r| r.strip_prefix('.')).unwrap_or(p);
                    (rel, &mut **list)
                });
                blocks::spatial_transformer_cut(g, w, p, h, context, t, kernel, cut)?
            }
            Layer::Down { .. } => blocks::downsample(g, w, p, h)?,
            Layer::Up { .. } => blocks::upsample(g, w, p, h)?,
        };
    }
    Ok(h)
}

/// A ControlNet's residuals in a UNet graph: one per skip connection (input block order) and
/// the middle block's last, each scaled by `strength` and added as the reference adds them.
#[derive(Clone, Copy)]
pub(crate) struct GraphControls<'a, 'g> {
    /// Residuals, `[W, H, C, N]` each: the skips' then the middle block's.
    pub tensors: &'a [Tensor<'g>],
    /// `--control-strength`.
    pub strength: f32,
}

/// [`forward`] with an explicit attention kernel choice.
#[allow(clippy::too_many_arguments)]
fn forward_with<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &UNetConfig,
    x: Tensor<'g>,
    timesteps: Tensor<'g>,
    context: Tensor<'g>,
    y: Option<Tensor<'g>>,
    kernel: AttnKernel,
    controls: Option<GraphControls<'_, 'g>>,
    cuts: &mut Vec<(String, Tensor<'g>)>,
) -> Result<Tensor<'g>> {
    check_shapes(cfg, x.shape(), timesteps.shape(), context.shape())?;
    match (cfg.adm_in_channels, y.map(|y| y.shape())) {
        (None, None) => {}
        (Some(adm), Some([a, b, 1, 1])) if a == adm && b == x.shape()[3] => {}
        (adm, shape) => {
            return Err(DiffusionError::Input {
                model: MODEL,
                reason: format!(
                    "the ADM vector {shape:?} does not fit the model's class embedding (width {adm:?}, one per sample)"
                ),
            })
        }
    }
    let [_, _, _, n] = x.shape();
    let [cd, lc, cn, _] = context.shape();
    // A context shared by the whole batch is repeated per sample, as the reference does.
    let context = if cn != n { g.repeat(context, g.new_f32(&[cd, lc, n])) } else { context };

    let emb = time_embedding(g, w, PREFIX, cfg.model_channels, timesteps, y)?; // [temb, N]
    cuts.push(("time_embed".into(), emb));

    let layout = layout(cfg);
    let run_block = |block: &Block, h: Tensor<'g>, cuts: &mut Vec<(String, Tensor<'g>)>| {
        run_layers(g, w, block, h, (emb, context), kernel, Some((PREFIX, cuts)))
    };

    let mut skips = Vec::with_capacity(layout.input.len());
    let mut h = x;
    for block in &layout.input {
        h = run_block(block, h, cuts)?;
        cuts.push((block.name.clone(), h));
        skips.push(h);
    }
    h = run_block(&layout.middle, h, cuts)?;
    if let Some(c) = controls {
        if c.tensors.len() != skips.len() + 1 {
            return Err(DiffusionError::Input {
                model: MODEL,
                reason: format!(
                    "{} control residuals for {} skip connections and the middle block",
                    c.tensors.len(),
                    skips.len()
                ),
            });
        }
        // The reference scales each residual in place, then adds it (unet.hpp).
        let middle = g.scale(c.tensors[skips.len()], c.strength);
        h = g.add(h, middle);
    }
    cuts.push((layout.middle.name.clone(), h));
    for block in &layout.output {
        let mut skip = skips.pop().expect("the layout has one skip per output block");
        if let Some(c) = controls {
            skip = g.add(skip, g.scale(c.tensors[skips.len()], c.strength));
        }
        h = g.concat(h, skip, 2);
        h = run_block(block, h, cuts)?;
        cuts.push((block.name.clone(), h));
    }

    h = blocks::group_norm32(g, w, &format!("{PREFIX}.out.0"), h)?;
    h = g.silu(h);
    h = blocks::conv2d(g, w, &format!("{PREFIX}.out.2"), h, 1, 1)?;
    cuts.push(("out".into(), h));
    Ok(h)
}

fn check_shapes(cfg: &UNetConfig, x: [i64; 4], t: [i64; 4], c: [i64; 4]) -> Result<()> {
    let bad = |reason: String| Err(DiffusionError::Input { model: MODEL, reason });
    let m = cfg.size_multiple();
    if x[0] <= 0 || x[1] <= 0 || x[0] % m != 0 || x[1] % m != 0 {
        return bad(format!(
            "latent size {}x{} is not a positive multiple of {m} (image size a multiple of {})",
            x[0],
            x[1],
            8 * m
        ));
    }
    if x[2] != cfg.in_channels {
        return bad(format!("latent has {} channels, the model takes {}", x[2], cfg.in_channels));
    }
    if t[0] != x[3] || t[1..].iter().any(|&d| d != 1) {
        return bad(format!("{} timesteps for a batch of {}", t[0], x[3]));
    }
    if c[0] != cfg.context_dim {
        return bad(format!("context width {} but the model's cross-attention takes {}", c[0], cfg.context_dim));
    }
    if c[1] <= 0 || (c[2] != x[3] && c[2] != 1) || c[3] != 1 {
        return bad(format!(
            "context shape {:?} does not fit a batch of {} (ggml order [width, tokens, batch or 1])",
            &c[..3],
            x[3]
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Model
// ---------------------------------------------------------------------------------------

/// The parameter group (block) of an internal UNet tensor name, for staging: `time_embed`,
/// `input_blocks.N`, `middle_block`, `output_blocks.N` or `out` (the order the graph uses
/// them), matching the cut markers of [`forward`].
///
/// A transformer block after the first of a SpatialTransformer (`...transformer_blocks.K`,
/// K >= 1: only deep stacks such as SDXL's have them) is a group of its own, read by the
/// segment its cut closes, so that a deep stack stages one transformer block at a time.
pub fn group_of(name: &str) -> String {
    let rest = name.strip_prefix(PREFIX).and_then(|r| r.strip_prefix('.')).unwrap_or(name);
    if let Some(i) = rest.find(".transformer_blocks.") {
        let after = &rest[i + ".transformer_blocks.".len()..];
        let k = after.split('.').next().unwrap_or("");
        if k.parse::<usize>().is_ok_and(|k| k >= 1) {
            return rest[..i + ".transformer_blocks.".len() + k.len()].to_string();
        }
    }
    let mut parts = rest.split('.');
    match (parts.next(), parts.next()) {
        (Some(b @ ("input_blocks" | "output_blocks")), Some(i)) => format!("{b}.{i}"),
        (Some(b), _) => b.to_string(),
        (None, _) => rest.to_string(),
    }
}

/// Whether a UNet parameter is cut by output rows in a row split: the matmul weights of the
/// transformer blocks (attention q/k/v/out, the feed-forward projections) and linear
/// `proj_in`/`proj_out` (SD 2.x; SD 1.x's are 1x1 convolutions and stay whole).
pub fn row_splittable(spec: &TensorSpec) -> bool {
    const LEAVES: [&str; 8] = [
        ".to_q.weight",
        ".to_k.weight",
        ".to_v.weight",
        ".to_out.0.weight",
        ".ff.net.0.proj.weight",
        ".ff.net.2.weight",
        ".proj_in.weight",
        ".proj_out.weight",
    ];
    let matrix = spec.ne.len() >= 2 && spec.ne[2..].iter().all(|&d| d == 1);
    let name = &spec.name;
    matrix
        && name.starts_with(PREFIX)
        && (name.contains("input_blocks.") || name.contains("middle_block.") || name.contains("output_blocks."))
        && LEAVES.iter().any(|l| name.ends_with(l))
}

/// A UNet with its weights: what the sampler calls once per step.
#[derive(Debug)]
pub struct UNetModel {
    /// Hyper-parameters.
    pub cfg: UNetConfig,
    /// Parameters (internal names).
    pub weights: Weights,
    /// Use flash attention where the device supports it (`--diffusion-fa`).
    pub flash_attn: bool,
}

impl UNetModel {
    /// Declares the parameters of `cfg` (no storage yet); see [`unet_specs`] for the types.
    pub fn new(cfg: UNetConfig, dtype_of: &dyn Fn(&str) -> Option<GgmlType>, wtype: Option<GgmlType>) -> Result<Self> {
        cfg.validate()?;
        let weights = Weights::new(unet_specs(&cfg, dtype_of, wtype))?;
        Ok(Self { cfg, weights, flash_attn: false })
    }

    /// Declares, allocates on `buft` and fills the parameters from `src`.
    pub fn load(
        cfg: UNetConfig,
        dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
        wtype: Option<GgmlType>,
        buft: BufferType,
        src: &dyn TensorSource,
    ) -> Result<Self> {
        let mut m = Self::new(cfg, dtype_of, wtype)?;
        m.weights.allocate(buft)?;
        m.weights.load_from(src)?;
        tracing::debug!(tensors = m.weights.specs().len(), bytes = m.weights.nbytes(), "UNet weights loaded");
        Ok(m)
    }

    /// One evaluation. `x` is the latent [N, C, H, W] (row-major, i.e. ggml [W, H, C, N]),
    /// `timesteps` one per sample, `context` [N or 1, n_ctx_tokens, context_dim]; returns
    /// the prediction [N, out_channels, H, W].
    #[allow(clippy::too_many_arguments)]
    pub fn eval(
        &self,
        runner: &mut Runner,
        x: &[f32],
        (w, h): (usize, usize),
        timesteps: &[f32],
        context: &[f32],
        n_ctx_tokens: usize,
        batch: usize,
    ) -> Result<Vec<f32>> {
        self.eval_adm(runner, x, (w, h), timesteps, context, n_ctx_tokens, batch, &[])
    }

    /// [`eval`](Self::eval) with the ADM vectors (`adm_in_channels` values per sample) of a
    /// model with a class embedding (SDXL); empty for one without.
    #[allow(clippy::too_many_arguments)]
    pub fn eval_adm(
        &self,
        runner: &mut Runner,
        x: &[f32],
        (w, h): (usize, usize),
        timesteps: &[f32],
        context: &[f32],
        n_ctx_tokens: usize,
        batch: usize,
        y: &[f32],
    ) -> Result<Vec<f32>> {
        self.eval_controlled(runner, x, (w, h), timesteps, context, n_ctx_tokens, batch, y, None)
    }

    /// [`eval_adm`](Self::eval_adm) with a ControlNet's residuals added to the skip
    /// connections and the middle block (`None`: none), as the reference adds them.
    #[allow(clippy::too_many_arguments)]
    pub fn eval_controlled(
        &self,
        runner: &mut Runner,
        x: &[f32],
        (w, h): (usize, usize),
        timesteps: &[f32],
        context: &[f32],
        n_ctx_tokens: usize,
        batch: usize,
        y: &[f32],
        controls: Option<&super::controlnet::ControlResiduals>,
    ) -> Result<Vec<f32>> {
        let _span = tracing::trace_span!("unet", w, h, batch, n_ctx_tokens).entered();
        let bad = |reason: String| Err(DiffusionError::Input { model: MODEL, reason });
        let cin = self.cfg.in_channels as usize;
        let cd = self.cfg.context_dim as usize;
        if batch == 0 || w == 0 || h == 0 || n_ctx_tokens == 0 {
            return bad(format!("empty input: {w}x{h} latent, batch {batch}, {n_ctx_tokens} context tokens"));
        }
        if x.len() != w * h * cin * batch {
            return bad(format!(
                "latent has {} values, {batch} x {cin} x {h} x {w} needs {}",
                x.len(),
                w * h * cin * batch
            ));
        }
        if timesteps.len() != batch {
            return bad(format!("{} timesteps for a batch of {batch}", timesteps.len()));
        }
        let ctx_batch = context.len() / (n_ctx_tokens * cd).max(1);
        if !context.len().is_multiple_of(n_ctx_tokens * cd) || (ctx_batch != batch && ctx_batch != 1) {
            return bad(format!(
                "context has {} values, expected {batch} (or 1) x {n_ctx_tokens} x {cd}",
                context.len()
            ));
        }
        let adm = self.cfg.adm_in_channels.unwrap_or(0) as usize;
        if y.len() != adm * batch {
            return bad(format!("ADM vector has {} values, the model takes {adm} per sample x {batch}", y.len()));
        }

        let kernel = if self.flash_attn {
            AttnKernel::FlashWhereSupported(runner.backend().device())
        } else {
            AttnKernel::Plain
        };
        if let Some(c) = controls {
            c.check(batch)?;
        }
        let m = runner.micro_batches(batch);
        // Residuals are per evaluation: a pipelined split runs the whole batch as one graph.
        if m > 1 && controls.is_none() {
            let inputs = EvalInputs { x, dims: (w, h), timesteps, context, n_ctx_tokens, batch, y };
            return self.eval_pipelined(runner, m, &inputs, kernel);
        }
        let g = Context::for_graph(GRAPH_SIZE, GRAPH_SIZE)?;
        let (ins, out, cuts) = self.graph(&g, (w, h), batch, ctx_batch, n_ctx_tokens, kernel, controls)?;
        runner.run(&self.weights, &g, GRAPH_SIZE, &cuts, out, &mut || {
            ins.set(x, timesteps, context, y)?;
            for (t, v) in ins.controls.iter().zip(controls.map(|c| &c.values[..]).unwrap_or_default()) {
                t.set_f32(v)?;
            }
            Ok(())
        })?;
        Ok(out.get_f32()?)
    }

    /// The graph of one evaluation of `batch` samples in `g`: its inputs, output and cuts
    /// (block outputs; the last cut, the output itself, left out).
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn graph<'g>(
        &'g self,
        g: &'g Context,
        (w, h): (usize, usize),
        batch: usize,
        ctx_batch: usize,
        n_ctx_tokens: usize,
        kernel: AttnKernel,
        controls: Option<&super::controlnet::ControlResiduals>,
    ) -> Result<(Inputs<'g>, Tensor<'g>, Vec<(String, Tensor<'g>)>)> {
        let cin = self.cfg.in_channels;
        let cd = self.cfg.context_dim;
        let tx = g.new_f32(&[w as i64, h as i64, cin, batch as i64]).set_name("x").set_input();
        let tt = g.new_f32(&[batch as i64]).set_name("timesteps").set_input();
        let tc = g.new_f32(&[cd, n_ctx_tokens as i64, ctx_batch as i64]).set_name("context").set_input();
        let ty = self.cfg.adm_in_channels.map(|adm| g.new_f32(&[adm, batch as i64]).set_name("y").set_input());
        let control_tensors: Vec<Tensor<'g>> = controls
            .map(|c| {
                c.shapes
                    .iter()
                    .enumerate()
                    .map(|(i, ne)| g.new_f32(ne).set_name(&format!("control{i}")).set_input())
                    .collect()
            })
            .unwrap_or_default();
        let graph_controls = controls.map(|c| GraphControls { tensors: &control_tensors, strength: c.strength });
        let mut cuts = Vec::new();
        let out =
            forward_with(g, &self.weights, &self.cfg, tx, tt, tc, ty, kernel, graph_controls, &mut cuts)?.set_output();
        // The last cut is the output itself.
        cuts.pop();
        Ok((Inputs { x: tx, t: tt, context: tc, y: ty, controls: control_tensors }, out, cuts))
    }

    /// [`eval`](Self::eval) as `m` micro-batches of consecutive samples, which a split runner
    /// overlaps across its devices (`--pipeline-copies`).
    fn eval_pipelined(
        &self,
        runner: &mut Runner,
        m: usize,
        e: &EvalInputs<'_>,
        kernel: AttnKernel,
    ) -> Result<Vec<f32>> {
        let EvalInputs { x, dims: (w, h), timesteps, context, n_ctx_tokens, batch, y } = *e;
        let per_y = y.len() / batch;
        let per_x = x.len() / batch;
        let per_ctx = n_ctx_tokens * self.cfg.context_dim as usize;
        let shared_ctx = context.len() == per_ctx;
        // Consecutive samples, as even as the batch allows.
        let bounds: Vec<(usize, usize)> = (0..m).map(|j| (j * batch / m, (j + 1) * batch / m)).collect();
        let ctxs: Vec<Context> =
            (0..m).map(|_| Context::for_graph(GRAPH_SIZE, GRAPH_SIZE)).collect::<Result<_, _>>()?;
        let mut parts = Vec::with_capacity(m);
        for (g, &(a, b)) in ctxs.iter().zip(&bounds) {
            let ctx_batch = if shared_ctx { 1 } else { b - a };
            parts.push(self.graph(g, (w, h), b - a, ctx_batch, n_ctx_tokens, kernel, None)?);
        }
        let jobs: Vec<sd_sched::BatchJob<'_>> = ctxs
            .iter()
            .zip(&parts)
            .map(|(g, (_, out, cuts))| sd_sched::BatchJob {
                ctx: g,
                graph_size: GRAPH_SIZE,
                cuts: cuts.clone(),
                out: *out,
            })
            .collect();
        runner.run_batches(&self.weights, &jobs, &mut || {
            for ((ins, _, _), &(a, b)) in parts.iter().zip(&bounds) {
                let ctx = if shared_ctx { context } else { &context[a * per_ctx..b * per_ctx] };
                ins.set(&x[a * per_x..b * per_x], &timesteps[a..b], ctx, &y[a * per_y..b * per_y])?;
            }
            Ok(())
        })?;
        let mut out = Vec::with_capacity(x.len() / self.cfg.in_channels as usize * self.cfg.out_channels as usize);
        for (_, o, _) in &parts {
            out.extend(o.get_f32()?);
        }
        Ok(out)
    }
}

/// The checked inputs of one evaluation ([`UNetModel::eval`]'s arguments).
#[derive(Clone, Copy)]
struct EvalInputs<'a> {
    x: &'a [f32],
    dims: (usize, usize),
    timesteps: &'a [f32],
    context: &'a [f32],
    n_ctx_tokens: usize,
    batch: usize,
    y: &'a [f32],
}

/// The input tensors of one UNet graph.
struct Inputs<'g> {
    x: Tensor<'g>,
    t: Tensor<'g>,
    context: Tensor<'g>,
    /// The ADM vectors of a model with a class embedding.
    y: Option<Tensor<'g>>,
    /// A ControlNet's residuals (none without one).
    controls: Vec<Tensor<'g>>,
}

impl Inputs<'_> {
    fn set(&self, x: &[f32], t: &[f32], context: &[f32], y: &[f32]) -> std::result::Result<(), sd_sched::SchedError> {
        self.x.set_f32(x)?;
        self.t.set_f32(t)?;
        self.context.set_f32(context)?;
        if let Some(ty) = self.y {
            ty.set_f32(y)?;
        }
        Ok(())
    }
}
