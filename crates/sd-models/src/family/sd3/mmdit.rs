//! The MMDiT of Stable Diffusion 3 and 3.5 (SD3 Medium, SD3.5 Large and Large Turbo, and SD3.5
//! Medium's MMDiT-X) as a ggml graph.
//!
//! References: Stability AI's `sd3_impls` / `mmditx.py` (the module tree the files name) and
//! stable-diffusion.cpp's `model/diffusion/mmdit.hpp` and `model/diffusion/dit.hpp` (the
//! reference we must match, op by op).
//!
//! # Design
//!
//! * **Config from the tensors, as the reference infers it** ([`MmditConfig::from_file`]): the
//!   depth from the largest `joint_blocks.N`, the width, patch and input channels from
//!   `x_embedder.proj.weight`, the pooled width from `y_embedder.mlp.0.weight`, the context
//!   widths from `context_embedder.weight`, the output channels from `final_layer.linear`, the
//!   position table's side from `pos_embed` (a square), the q/k norm from `attn.ln_q` (RMSNorm
//!   without a bias, LayerNorm with one) and the MMDiT-X blocks (SD3.5 Medium: a second
//!   self-attention `attn2` in the image stream) from the largest block that has one. As in the
//!   reference the model has as many heads as blocks (`num_heads = depth`), so a reduced-depth
//!   file has fewer, wider heads.
//! * **Storage types**: the embedders' linear weights (`t_embedder`, `y_embedder`,
//!   `context_embedder`) and `final_layer.linear` are f32 whatever the file holds (the
//!   reference builds them with `force_f32`), the patch convolution f16, `pos_embed`, biases
//!   and norm weights f32; the rest take the file's type or the `--type` override.
//! * **Ops**: the latent through a 2x2 stride-2 convolution, plus the centre crop of
//!   `pos_embed`; `c = t_embedder(timestep_embedding(t, 256)) + y_embedder(y)` (t is the
//!   sampler's `1000 sigma`); the context through `context_embedder`. A joint block: each
//!   stream's adaLN chunks from `adaLN_modulation.1(silu(c))` (6, or 2 for the last block's
//!   context stream, which only feeds the attention, or 9 for an MMDiT-X image stream);
//!   `x + x * scale + shift` after a LayerNorm (no affine, eps 1e-6); fused qkv split into
//!   q, k, v with the q/k norm per head; one attention over the context tokens then the image
//!   tokens; each stream's projection and MLP (GELU, tanh form) gated. MMDiT-X adds a second
//!   attention over the image tokens alone, modulated and gated by the last three chunks. The
//!   final layer modulates the image tokens with two chunks and projects them to patches,
//!   unpatchified with the channels innermost (`patch_last = false`).
//! * **Cuts**: `mmdit.prelude.{x,c,context}`, then per joint block `mmdit.joint_blocks.N.x`
//!   and `.context` (the last block has no context output); [`group_of`] follows them.
//! * **Batch**: one sample per graph, as FLUX and Z-Image here.

use sd_backends::{Context, GgmlType, Tensor};
use sd_sched::{TensorSpec, Weights};

use crate::diffusion::blocks::{self, AttnKernel};
use crate::diffusion::{DiffusionError, Result};
use crate::wtype::SpecSink;

const MODEL: &str = "MMDiT";
/// Internal prefix of every MMDiT parameter.
pub const PREFIX: &str = "model.diffusion_model";
/// Width of the sinusoidal timestep embedding.
const TIME_DIM: i64 = 256;
/// Max period of the sinusoidal embedding.
const MAX_PERIOD: i32 = 10000;
/// LayerNorm and q/k norm epsilon.
const EPS: f32 = 1e-6;
/// Graph size bound per joint block (about 150 nodes for an MMDiT-X block).
const NODES_PER_BLOCK: usize = 256;
/// The MLP is this many times wider than the streams.
const MLP_RATIO: f32 = 4.0;

/// The q/k normalisation of the attention layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    /// None (SD3 Medium).
    None,
    /// RMSNorm with a weight (SD3.5).
    Rms,
    /// LayerNorm with weight and bias.
    Ln,
}

/// Hyper-parameters of an MMDiT.
#[derive(Clone, Debug, PartialEq)]
pub struct MmditConfig {
    /// Patch side.
    pub patch: i64,
    /// Latent channels in.
    pub in_channels: i64,
    /// Latent channels out.
    pub out_channels: i64,
    /// Width of both streams.
    pub hidden_size: i64,
    /// Joint blocks (also the number of heads).
    pub depth: usize,
    /// Width of the pooled text vector (`y`).
    pub adm_in_channels: i64,
    /// Width of the text context (CLIP-L + CLIP-G padded, then T5: 4096).
    pub context_size: i64,
    /// Side of the square position table.
    pub pos_embed_max_size: i64,
    /// The q/k norm.
    pub qk_norm: QkNorm,
    /// Blocks whose image stream has MMDiT-X's second self-attention (`attn2`): blocks
    /// `0..self_attn_blocks`.
    pub self_attn_blocks: usize,
}

impl MmditConfig {
    /// SD3.5 Large: 38 blocks of width 2432, RMSNorm on q and k.
    pub fn sd35_large() -> Self {
        Self {
            patch: 2,
            in_channels: 16,
            out_channels: 16,
            hidden_size: 2432,
            depth: 38,
            adm_in_channels: 2048,
            context_size: 4096,
            pos_embed_max_size: 192,
            qk_norm: QkNorm::Rms,
            self_attn_blocks: 0,
        }
    }

    /// SD3.5 Medium (MMDiT-X): 24 blocks of width 1536, the first 13 with `attn2`, a position
    /// table of side 384.
    pub fn sd35_medium() -> Self {
        Self { hidden_size: 1536, depth: 24, pos_embed_max_size: 384, self_attn_blocks: 13, ..Self::sd35_large() }
    }

    /// Attention heads: as many as blocks (the reference's `num_heads = depth`).
    pub fn num_heads(&self) -> i64 {
        self.depth as i64
    }

    /// Width of one head.
    pub fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_heads().max(1)
    }

    /// Width of the MLPs (`int(hidden * 4.0)`).
    pub fn mlp_hidden(&self) -> i64 {
        (self.hidden_size as f32 * MLP_RATIO) as i64
    }

    /// Entries of the position table.
    fn num_patches(&self) -> i64 {
        self.pos_embed_max_size * self.pos_embed_max_size
    }

    /// Whether block `i`'s context stream ends with the attention (the last block).
    fn context_pre_only(&self, i: usize) -> bool {
        i + 1 == self.depth
    }

    /// The configuration the reference infers from a file's tensors: `tensors` lists
    /// (internal name, ggml shape innermost first). Errors name the tensor that is missing or
    /// malformed.
    pub fn from_file(tensors: &[(String, Vec<u64>)]) -> Result<Self> {
        let bad = |reason: String| Err(DiffusionError::Config { model: MODEL, reason });
        let mut cfg = Self { depth: 0, self_attn_blocks: 0, qk_norm: QkNorm::None, ..Self::sd35_large() };
        let (mut x_embedder, mut pos_embed) = (false, false);
        let prefix = format!("{PREFIX}.");
        for (name, ne) in tensors {
            let Some(rel) = name.strip_prefix(&prefix) else { continue };
            let dims = |n: usize| ne.len() >= n && ne[n..].iter().all(|&d| d == 1);
            match rel {
                "x_embedder.proj.weight" if ne.len() == 4 => {
                    x_embedder = true;
                    cfg.patch = ne[0] as i64;
                    cfg.in_channels = ne[2] as i64;
                    cfg.hidden_size = ne[3] as i64;
                }
                "y_embedder.mlp.0.weight" if dims(2) => cfg.adm_in_channels = ne[0] as i64,
                "context_embedder.weight" if dims(2) => cfg.context_size = ne[0] as i64,
                "pos_embed" if ne.len() >= 2 => {
                    pos_embed = true;
                    let n = ne[1] as i64;
                    let side = (n as f64).sqrt().round() as i64;
                    if side * side != n {
                        return bad(format!("tensor '{name}' has {n} positions, which is not a square"));
                    }
                    cfg.pos_embed_max_size = side;
                }
                "final_layer.linear.weight" if dims(2) => {
                    let area = cfg.patch * cfg.patch;
                    cfg.out_channels = ne[1] as i64 / area.max(1);
                }
                _ => {}
            }
            if let Some(rest) = rel.strip_prefix("joint_blocks.") {
                let (index, tail) = rest.split_once('.').unwrap_or((rest, ""));
                let i = match index.parse::<usize>() {
                    Ok(i) if i < 4096 => i,
                    _ => return bad(format!("tensor '{name}' has no valid block index after 'joint_blocks.'")),
                };
                cfg.depth = cfg.depth.max(i + 1);
                if tail.contains("attn.ln_q.") || tail.contains("attn.ln_k.") {
                    cfg.qk_norm = if tail.ends_with(".bias") { QkNorm::Ln } else { cfg.qk_norm.max_rms() };
                }
                if tail.contains("attn2.") {
                    cfg.self_attn_blocks = cfg.self_attn_blocks.max(i + 1);
                }
            }
        }
        if !x_embedder {
            return bad(format!("tensor '{PREFIX}.x_embedder.proj.weight' is missing: it gives the model's width"));
        }
        if !pos_embed {
            return bad(format!("tensor '{PREFIX}.pos_embed' is missing"));
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks that the numbers describe a network the graph can be built for.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(DiffusionError::Config { model: MODEL, reason });
        let widths = [self.patch, self.in_channels, self.out_channels, self.hidden_size, self.pos_embed_max_size];
        if widths.iter().any(|&w| w <= 0) || self.adm_in_channels <= 0 || self.context_size <= 0 {
            return bad(format!("widths must be positive: {self:?}"));
        }
        if self.depth == 0 {
            return bad("the file has no joint_blocks".into());
        }
        if self.hidden_size % self.num_heads() != 0 {
            return bad(format!(
                "width {} is not a multiple of the {} heads (as many as joint blocks)",
                self.hidden_size,
                self.num_heads()
            ));
        }
        if self.self_attn_blocks > self.depth {
            return bad(format!("{} MMDiT-X blocks in a model of {}", self.self_attn_blocks, self.depth));
        }
        Ok(())
    }
}

impl QkNorm {
    /// RMS unless a bias already said LayerNorm.
    fn max_rms(self) -> Self {
        match self {
            QkNorm::Ln => QkNorm::Ln,
            _ => QkNorm::Rms,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------------------

/// One unit of the layout walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// `x_embedder`, `pos_embed`, `t_embedder`, `y_embedder`, `context_embedder`.
    Prelude,
    /// `joint_blocks.N`.
    Joint(usize),
    /// `final_layer`.
    Final,
}

/// The blocks in execution order.
pub fn layout(cfg: &MmditConfig) -> Vec<Block> {
    let mut v = vec![Block::Prelude];
    v.extend((0..cfg.depth).map(Block::Joint));
    v.push(Block::Final);
    v
}

fn name(rel: &str) -> String {
    format!("{PREFIX}.{rel}")
}

/// One stream of a joint block: its prefix, whether it ends with the attention, whether it has
/// MMDiT-X's `attn2`.
fn streams(cfg: &MmditConfig, i: usize) -> [(String, bool, bool); 2] {
    [
        (name(&format!("joint_blocks.{i}.context_block")), cfg.context_pre_only(i), false),
        (name(&format!("joint_blocks.{i}.x_block")), false, i < cfg.self_attn_blocks),
    ]
}

/// Chunks of a stream's modulation: 2 for an attention-only stream, 9 with `attn2`, else 6.
fn n_mods(pre_only: bool, self_attn: bool) -> i64 {
    match (pre_only, self_attn) {
        (true, _) => 2,
        (_, true) => 9,
        _ => 6,
    }
}

fn attention_specs(s: &mut SpecSink<'_>, cfg: &MmditConfig, p: &str, with_proj: bool) {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim());
    s.linear(&format!("{p}.qkv"), h, 3 * h, true);
    if with_proj {
        s.linear(&format!("{p}.proj"), h, h, true);
    }
    for n in ["ln_q", "ln_k"] {
        match cfg.qk_norm {
            QkNorm::None => {}
            QkNorm::Rms => s.push(format!("{p}.{n}.weight"), GgmlType::GGML_TYPE_F32, &[hd]),
            QkNorm::Ln => s.norm(&format!("{p}.{n}"), hd),
        }
    }
}

/// A linear layer the reference keeps in f32 whatever the file holds (`force_f32`).
fn f32_linear(s: &mut SpecSink<'_>, p: &str, inp: i64, out: i64) {
    s.push(format!("{p}.weight"), GgmlType::GGML_TYPE_F32, &[inp, out]);
    s.push(format!("{p}.bias"), GgmlType::GGML_TYPE_F32, &[out]);
}

/// The parameters of `cfg` with the types the reference stores them in: `dtype_of(name)` is
/// the file's type of the internal name (`None` when the file lacks it), `wtype` the `--type`
/// override.
pub fn mmdit_specs(
    cfg: &MmditConfig,
    dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
    wtype: Option<GgmlType>,
) -> Vec<TensorSpec> {
    let mut s = SpecSink::new(dtype_of, wtype);
    let h = cfg.hidden_size;
    for block in layout(cfg) {
        match block {
            Block::Prelude => {
                s.push(
                    name("x_embedder.proj.weight"),
                    GgmlType::GGML_TYPE_F16,
                    &[cfg.patch, cfg.patch, cfg.in_channels, h],
                );
                s.push(name("x_embedder.proj.bias"), GgmlType::GGML_TYPE_F32, &[h]);
                s.push(name("pos_embed"), GgmlType::GGML_TYPE_F32, &[h, cfg.num_patches(), 1]);
                f32_linear(&mut s, &name("t_embedder.mlp.0"), TIME_DIM, h);
                f32_linear(&mut s, &name("t_embedder.mlp.2"), h, h);
                f32_linear(&mut s, &name("y_embedder.mlp.0"), cfg.adm_in_channels, h);
                f32_linear(&mut s, &name("y_embedder.mlp.2"), h, h);
                f32_linear(&mut s, &name("context_embedder"), cfg.context_size, h);
            }
            Block::Joint(i) => {
                for (p, pre_only, self_attn) in streams(cfg, i) {
                    attention_specs(&mut s, cfg, &format!("{p}.attn"), !pre_only);
                    if self_attn {
                        attention_specs(&mut s, cfg, &format!("{p}.attn2"), true);
                    }
                    if !pre_only {
                        s.linear(&format!("{p}.mlp.fc1"), h, cfg.mlp_hidden(), true);
                        s.linear(&format!("{p}.mlp.fc2"), cfg.mlp_hidden(), h, true);
                    }
                    s.linear(&format!("{p}.adaLN_modulation.1"), h, n_mods(pre_only, self_attn) * h, true);
                }
            }
            Block::Final => {
                f32_linear(&mut s, &name("final_layer.linear"), h, cfg.patch * cfg.patch * cfg.out_channels);
                s.linear(&name("final_layer.adaLN_modulation.1"), h, 2 * h, true);
            }
        }
    }
    s.specs
}

/// The parameter group (block) of an internal MMDiT name, for staging: `prelude`,
/// `joint_blocks.N` or `final_layer`, the order the graph uses them.
pub fn group_of(name: &str) -> String {
    let rel = name.strip_prefix(PREFIX).and_then(|r| r.strip_prefix('.')).unwrap_or(name);
    let mut parts = rel.split('.');
    match (parts.next(), parts.next()) {
        (Some("joint_blocks"), Some(i)) => format!("joint_blocks.{i}"),
        (Some("final_layer"), _) => "final_layer".into(),
        _ => "prelude".into(),
    }
}

/// Whether an MMDiT parameter is cut by output rows in a row split: the matmul weights of the
/// joint blocks (qkv, projections, MLPs, modulations).
pub fn row_splittable(spec: &TensorSpec) -> bool {
    const LEAVES: [&str; 5] =
        [".qkv.weight", ".proj.weight", ".mlp.fc1.weight", ".mlp.fc2.weight", ".adaLN_modulation.1.weight"];
    let matrix = spec.ne.len() >= 2 && spec.ne[2..].iter().all(|&d| d == 1);
    matrix && group_of(&spec.name).starts_with("joint_blocks.") && LEAVES.iter().any(|l| spec.name.ends_with(l))
}

/// Checks a file's MMDiT tensors against `specs`: every missing tensor and shape mismatch in
/// one error, naming each; on success the unused names under the prefix.
pub fn validate_against_file(specs: &[TensorSpec], file: &[(String, Vec<u64>)]) -> Result<Vec<String>> {
    match crate::diffusion::validate_against_file(specs, file) {
        Err(DiffusionError::WeightsMismatch { problems, .. }) => {
            Err(DiffusionError::WeightsMismatch { model: MODEL, problems })
        }
        other => other,
    }
}

// ---------------------------------------------------------------------------------------
// Blocks
// ---------------------------------------------------------------------------------------

/// `x + x * scale + shift` (scale and shift `[hidden, 1]`, broadcast over tokens).
fn modulate<'g>(g: &'g Context, x: Tensor<'g>, shift: Tensor<'g>, scale: Tensor<'g>) -> Tensor<'g> {
    let x = g.add(x, g.mul(x, scale));
    g.add(x, shift)
}

/// `k` chunks `[hidden, 1]` of `lin(silu(c))` (the reference's `ggml_ext_chunk`, each copied).
fn modulation<'g>(g: &'g Context, w: &Weights, p: &str, c: Tensor<'g>, k: i64) -> Result<Vec<Tensor<'g>>> {
    let h = c.shape()[0];
    let m = blocks::linear(g, w, p, g.silu(c), true)?; // [k * hidden, 1]
    let nb = m.nb();
    Ok((0..k).map(|j| g.cont(g.view(m, [h, 1, 1, 1], [nb[1], nb[2], nb[3]], (j * h) as usize * nb[0]))).collect())
}

/// q, k, v `[hidden, L, 1]` of a self-attention layer `p` on `x` `[hidden, L, 1]`: the fused
/// projection split as the reference's `split_qkv` does, q and k normed per head.
fn pre_attention<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &MmditConfig,
    p: &str,
    x: Tensor<'g>,
) -> Result<[Tensor<'g>; 3]> {
    let (h, hd, heads) = (cfg.hidden_size, cfg.head_dim(), cfg.num_heads());
    let qkv = blocks::linear(g, w, &format!("{p}.qkv"), x, true)?; // [3h, L, 1]
    let l = qkv.shape()[1];
    // [h, 3, L, 1] -> [h, L, 1, 3], copied: q, k and v one after another.
    let qkv = g.cont(g.permute(g.reshape(qkv, &[h, 3, l, 1]), [0, 3, 1, 2]));
    let nb = qkv.nb();
    let part = |j: usize| g.view(qkv, [h, l, 1, 1], [nb[1], nb[2], nb[3]], j * nb[3]);
    let normed = |t: Tensor<'g>, n: &str| -> Result<Tensor<'g>> {
        let t4 = g.reshape(t, &[hd, heads, l, 1]);
        let y = match cfg.qk_norm {
            QkNorm::None => return Ok(t),
            QkNorm::Rms => g.mul(g.rms_norm(t4, EPS), w.get(&format!("{p}.{n}.weight"))?),
            QkNorm::Ln => {
                let y = g.mul(g.norm(t4, EPS), w.get(&format!("{p}.{n}.weight"))?);
                g.add(y, w.get(&format!("{p}.{n}.bias"))?)
            }
        };
        Ok(g.reshape(y, &[h, l, 1]))
    };
    Ok([normed(part(0), "ln_q")?, normed(part(1), "ln_k")?, part(2)])
}

/// `fc2(gelu(fc1(x)))`.
fn mlp<'g>(g: &'g Context, w: &Weights, p: &str, x: Tensor<'g>) -> Result<Tensor<'g>> {
    let y = g.gelu(blocks::linear(g, w, &format!("{p}.fc1"), x, true)?);
    blocks::linear(g, w, &format!("{p}.fc2"), y, true)
}

/// One stream before the joint attention: its modulation chunks, the q/k/v of `attn` and, for
/// an MMDiT-X image stream, of `attn2`.
struct Pre<'g> {
    mods: Vec<Tensor<'g>>,
    qkv: [Tensor<'g>; 3],
    qkv2: Option<[Tensor<'g>; 3]>,
}

fn stream_pre<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &MmditConfig,
    (p, pre_only, self_attn): (&str, bool, bool),
    x: Tensor<'g>,
    c: Tensor<'g>,
) -> Result<Pre<'g>> {
    let mods = modulation(g, w, &format!("{p}.adaLN_modulation.1"), c, n_mods(pre_only, self_attn))?;
    let x_norm = g.norm(x, EPS);
    let qkv = pre_attention(g, w, cfg, &format!("{p}.attn"), modulate(g, x_norm, mods[0], mods[1]))?;
    let qkv2 = if self_attn {
        Some(pre_attention(g, w, cfg, &format!("{p}.attn2"), modulate(g, x_norm, mods[6], mods[7]))?)
    } else {
        None
    };
    Ok(Pre { mods, qkv, qkv2 })
}

/// One stream after the joint attention: `x + proj(attn) * gate_msa` (and MMDiT-X's
/// `+ proj2(attn2) * gate_msa2`), then `+ mlp(modulate(norm(x))) * gate_mlp`.
fn stream_post<'g>(
    g: &'g Context,
    w: &Weights,
    p: &str,
    x: Tensor<'g>,
    attn: Tensor<'g>,
    attn2: Option<Tensor<'g>>,
    m: &[Tensor<'g>],
) -> Result<Tensor<'g>> {
    let proj = blocks::linear(g, w, &format!("{p}.attn.proj"), attn, true)?;
    let mut x = g.add(x, g.mul(proj, m[2]));
    if let Some(a2) = attn2 {
        let proj2 = blocks::linear(g, w, &format!("{p}.attn2.proj"), a2, true)?;
        x = g.add(x, g.mul(proj2, m[8]));
    }
    let y = mlp(g, w, &format!("{p}.mlp"), modulate(g, g.norm(x, EPS), m[3], m[4]))?;
    Ok(g.add(x, g.mul(y, m[5])))
}

/// A joint block: `(context [hidden, L_ctx, 1], x [hidden, L_img, 1])` -> the same; the
/// context is `None` after the last block.
#[allow(clippy::too_many_arguments)]
fn joint_block<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &MmditConfig,
    i: usize,
    context: Tensor<'g>,
    x: Tensor<'g>,
    c: Tensor<'g>,
    kernel: AttnKernel,
) -> Result<(Option<Tensor<'g>>, Tensor<'g>)> {
    let [(cp, c_pre_only, _), (xp, _, x_self_attn)] = streams(cfg, i);
    let heads = cfg.num_heads();
    let ctx_pre = stream_pre(g, w, cfg, (&cp, c_pre_only, false), context, c)?;
    let x_pre = stream_pre(g, w, cfg, (&xp, false, x_self_attn), x, c)?;
    let joint = |j: usize| g.concat(ctx_pre.qkv[j], x_pre.qkv[j], 1);
    let attn = blocks::attention(g, joint(0), joint(1), joint(2), heads, kernel); // [h, Lc + Lx, 1]
    let (lc, lx) = (context.shape()[1], x.shape()[1]);
    let nb = attn.nb();
    let h = attn.shape()[0];
    let ctx_attn = g.view(attn, [h, lc, 1, 1], [nb[1], nb[2], nb[3]], 0);
    let x_attn = g.view(attn, [h, lx, 1, 1], [nb[1], nb[2], nb[3]], lc as usize * nb[1]);
    let context = if c_pre_only { None } else { Some(stream_post(g, w, &cp, context, ctx_attn, None, &ctx_pre.mods)?) };
    let attn2 = x_pre.qkv2.map(|[q, k, v]| blocks::attention(g, q, k, v, heads, kernel));
    let x = stream_post(g, w, &xp, x, x_attn, attn2, &x_pre.mods)?;
    Ok((context, x))
}

/// The final layer on the image tokens `[hidden, L, 1]` -> `[p * p * out, L, 1]`.
fn final_layer<'g>(g: &'g Context, w: &Weights, x: Tensor<'g>, c: Tensor<'g>) -> Result<Tensor<'g>> {
    let m = modulation(g, w, &name("final_layer.adaLN_modulation.1"), c, 2)?;
    let x = modulate(g, g.norm(x, EPS), m[0], m[1]);
    blocks::linear(g, w, &name("final_layer.linear"), x, true)
}

/// The centre crop of the position table for an `h` x `w` grid of patches: `[hidden, h * w, 1]`
/// (row-major patches), as the reference's `cropped_pos_embed` copies it.
fn cropped_pos_embed<'g>(g: &'g Context, w: &Weights, cfg: &MmditConfig, h: i64, wd: i64) -> Result<Tensor<'g>> {
    let table = w.get(&name("pos_embed"))?;
    let (hid, side) = (cfg.hidden_size, cfg.pos_embed_max_size);
    let (top, left) = ((side - h) / 2, (side - wd) / 2);
    let row = hid as usize * 4;
    let crop = g.view(table, [hid, wd, h, 1], [row, row * side as usize, row * (side * side) as usize], {
        (top * side + left) as usize * row
    });
    Ok(g.reshape(g.cont(crop), &[hid, h * wd, 1]))
}

/// `[W, H, C, 1]` through the patch convolution -> `[hidden, W/p * H/p, 1]`.
fn patch_embed<'g>(g: &'g Context, w: &Weights, cfg: &MmditConfig, x: Tensor<'g>) -> Result<Tensor<'g>> {
    let y = blocks::conv2d(g, w, &name("x_embedder.proj"), x, cfg.patch as i32, 0)?; // [W/p, H/p, hidden, 1]
    let [pw, ph, c, n] = y.shape();
    let y = g.reshape(y, &[pw * ph, c, n]);
    Ok(g.cont(g.permute(y, [1, 0, 2, 3])))
}

/// `[p * p * C, h * w, 1]` (channels innermost) -> the latent `[W, H, C, 1]`, ending in a copy.
fn unpatchify<'g>(g: &'g Context, x: Tensor<'g>, p: i64, wd: i64, ht: i64) -> Tensor<'g> {
    let [cpp, _, n, _] = x.shape();
    let (w, h, c) = (wd / p, ht / p, cpp / (p * p));
    let x = g.reshape(x, &[c, p * p, w * h, n]);
    let x = g.cont(g.permute(x, [2, 0, 1, 3])); // [p*p, w*h, C, N]
    let x = g.reshape(x, &[p, p, w, h * c * n]);
    let x = g.cont(g.permute(x, [0, 2, 1, 3])); // [p, w, p, h*C*N]
    g.cont(g.reshape(x, &[wd, ht, c, n]))
}

/// The inputs of one MMDiT evaluation, as graph tensors.
#[derive(Clone, Copy, Debug)]
struct MmditInputs<'g> {
    /// The latent `[W, H, C, 1]`.
    pub x: Tensor<'g>,
    /// The timestep `[1]` (the sampler's `1000 sigma`).
    pub timestep: Tensor<'g>,
    /// The text context `[context_size, L, 1]`.
    pub context: Tensor<'g>,
    /// The pooled text vector `[adm_in_channels, 1]`.
    pub y: Tensor<'g>,
}

/// The MMDiT graph: the latent `[W, H, C, 1]` to the prediction of the same shape, the joint
/// blocks of `skip` left out (skip-layer guidance: their streams pass unchanged, as in the
/// reference). Pushes the cuts described in the module documentation.
fn forward<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &MmditConfig,
    inputs: &MmditInputs<'g>,
    kernel: AttnKernel,
    cuts: &mut Vec<(String, Tensor<'g>)>,
    skip: &[usize],
) -> Result<Tensor<'g>> {
    let (wd, ht, _) = crate::diffusion::check_dit_inputs(
        MODEL,
        inputs.x.shape(),
        inputs.context.shape(),
        cfg.patch,
        cfg.in_channels,
        cfg.context_size,
    )?;
    let (gh, gw) = (ht / cfg.patch, wd / cfg.patch);
    if gh > cfg.pos_embed_max_size || gw > cfg.pos_embed_max_size {
        return Err(DiffusionError::Input {
            model: MODEL,
            reason: format!(
                "a latent of {wd}x{ht} is {gw}x{gh} patches; the model's position table covers {0}x{0}",
                cfg.pos_embed_max_size
            ),
        });
    }
    let _span = tracing::trace_span!("mmdit.forward", depth = cfg.depth).entered();
    let mut x = inputs.x;
    let mut context = Some(inputs.context);
    let mut c = inputs.timestep;
    let mut out = None;
    for block in layout(cfg) {
        match block {
            Block::Prelude => {
                x = g.add(patch_embed(g, w, cfg, inputs.x)?, cropped_pos_embed(g, w, cfg, gh, gw)?);
                let t = g.timestep_embedding(inputs.timestep, TIME_DIM as i32, MAX_PERIOD);
                let t = blocks::linear(g, w, &name("t_embedder.mlp.0"), t, true)?;
                c = blocks::linear(g, w, &name("t_embedder.mlp.2"), g.silu(t), true)?;
                let y = blocks::linear(g, w, &name("y_embedder.mlp.0"), inputs.y, true)?;
                let y = blocks::linear(g, w, &name("y_embedder.mlp.2"), g.silu(y), true)?;
                c = g.add(c, y);
                let ctx = blocks::linear(g, w, &name("context_embedder"), inputs.context, true)?;
                context = Some(ctx);
                cuts.push(("mmdit.prelude.x".into(), x));
                cuts.push(("mmdit.prelude.c".into(), c));
                cuts.push(("mmdit.prelude.context".into(), ctx));
            }
            Block::Joint(i) if skip.contains(&i) => {}
            Block::Joint(i) => {
                let Some(ctx) = context else {
                    return Err(DiffusionError::Config {
                        model: MODEL,
                        reason: format!("joint block {i} follows the last one"),
                    });
                };
                let (next, nx) = joint_block(g, w, cfg, i, ctx, x, c, kernel)?;
                x = nx;
                context = next;
                if let Some(ctx) = context {
                    cuts.push((format!("mmdit.joint_blocks.{i}.context"), ctx));
                }
                cuts.push((format!("mmdit.joint_blocks.{i}.x"), x));
            }
            Block::Final => {
                let y = final_layer(g, w, x, c)?;
                out = Some(unpatchify(g, y, cfg.patch, wd, ht));
            }
        }
    }
    Ok(out.expect("the layout ends with the final layer"))
}

/// Nodes the graph of `cfg` may create.
pub fn graph_size(cfg: &MmditConfig) -> usize {
    NODES_PER_BLOCK * (cfg.depth + 4)
}

// ---------------------------------------------------------------------------------------
// Model
// ---------------------------------------------------------------------------------------

/// An MMDiT with its weights: one evaluation per sample.
#[derive(Debug)]
pub struct MmditModel {
    /// Hyper-parameters.
    pub cfg: MmditConfig,
    /// Parameters (internal names).
    pub weights: Weights,
    /// Use flash attention where the device supports it (`--diffusion-fa`).
    pub flash_attn: bool,
}

impl MmditModel {
    /// Declares the parameters of `cfg` (no storage yet).
    pub fn new(cfg: MmditConfig, dtype_of: &dyn Fn(&str) -> Option<GgmlType>, wtype: Option<GgmlType>) -> Result<Self> {
        cfg.validate()?;
        let weights = Weights::new(mmdit_specs(&cfg, dtype_of, wtype))?;
        Ok(Self { cfg, weights, flash_attn: false })
    }

    /// One evaluation of one sample: `x` the latent `[C, H, W]` (row-major), `t` the sampler's
    /// timestep (`1000 sigma`), `context` `[n_ctx_tokens, context_size]`, `y` the pooled
    /// vector. Returns the prediction, shaped as `x`.
    #[allow(clippy::too_many_arguments)]
    pub fn eval_one(
        &self,
        runner: &mut sd_sched::Runner,
        x: &[f32],
        dims: (usize, usize),
        t: f32,
        context: &[f32],
        n_ctx_tokens: usize,
        y: &[f32],
    ) -> Result<Vec<f32>> {
        self.eval_skipping(runner, x, dims, t, (context, n_ctx_tokens), y, &[])
    }

    /// [`MmditModel::eval_one`] with the joint blocks of `skip` left out.
    #[allow(clippy::too_many_arguments)]
    fn eval_skipping(
        &self,
        runner: &mut sd_sched::Runner,
        x: &[f32],
        (w, h): (usize, usize),
        t: f32,
        (context, n_ctx_tokens): (&[f32], usize),
        y: &[f32],
        skip: &[usize],
    ) -> Result<Vec<f32>> {
        let bad = |reason: String| Err(DiffusionError::Input { model: MODEL, reason });
        let cfg = &self.cfg;
        let (c, cd, adm) = (cfg.in_channels as usize, cfg.context_size as usize, cfg.adm_in_channels as usize);
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
        if y.len() != adm {
            return bad(format!("pooled vector has {} values, the model's y_embedder takes {adm}", y.len()));
        }
        let kernel = if self.flash_attn {
            AttnKernel::FlashWhereSupported(runner.backend().device())
        } else {
            AttnKernel::Plain
        };
        let _span = tracing::trace_span!("mmdit", w, h, tokens = n_ctx_tokens).entered();
        let size = graph_size(cfg);
        let g = Context::for_graph(size, size)?;
        let ins = MmditInputs {
            x: g.new_f32(&[w as i64, h as i64, c as i64, 1]).set_name("x").set_input(),
            timestep: g.new_f32(&[1]).set_name("timestep").set_input(),
            context: g.new_f32(&[cd as i64, n_ctx_tokens as i64, 1]).set_name("context").set_input(),
            y: g.new_f32(&[adm as i64, 1]).set_name("y").set_input(),
        };
        let mut cuts = Vec::new();
        let out = forward(&g, &self.weights, cfg, &ins, kernel, &mut cuts, skip)?.set_output();
        let mut set_inputs = || -> std::result::Result<(), sd_sched::SchedError> {
            ins.x.set_f32(x)?;
            ins.timestep.set_f32(&[t])?;
            ins.context.set_f32(context)?;
            ins.y.set_f32(y)?;
            Ok(())
        };
        runner.run(&self.weights, &g, size, &cuts, out, &mut set_inputs)?;
        Ok(out.get_f32()?)
    }
}

/// The MMDiT as the pipeline evaluates it: each sample in a graph of its own, the three
/// encoders' states as the conditioning's tokens, their pooled outputs as its vector.
impl crate::family::DiffusionModel for MmditModel {
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
        let per = self.cfg.in_channels as usize * w * h;
        let input = (per, self.cfg.context_size as usize, "context_embedder");
        crate::diffusion::eval_each(MODEL, input, x, timesteps, cond, |xi, t, c| {
            self.eval_skipping(runner, xi, (w, h), t, (&c.data, c.n_tokens), &c.vector, skip)
        })
    }
}

#[cfg(test)]
mod tests;
