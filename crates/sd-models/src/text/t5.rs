//! The T5 v1.1 encoder (T5-XXL, FLUX's and SD3's large text encoder) as a ggml graph.
//!
//! References: Raffel et al., "Exploring the Limits of Transfer Learning with a Unified
//! Text-to-Text Transformer" (2020), and the v1.1 changes (gated-GELU feed-forward, no
//! parameter sharing between embedding and classifier); Hugging Face `modeling_t5.py`
//! (`T5EncoderModel`, whose tensor names the files use); stable-diffusion.cpp
//! `model/te/t5.hpp` (the reference we must match).
//!
//! # Design
//!
//! * **Embedding**: `get_rows` of `shared.weight` (`[d_model, vocab]`), no position
//!   embedding and no scaling. The table keeps the file's (or `--type`'s) type when ggml can
//!   gather rows of it, else it is f32, as the reference's `Embedding`.
//! * **Blocks** (pre-norm): `x + attn(rms(x))`, then `x + ffn(rms(x))`. RMSNorm is
//!   `x / sqrt(mean(x^2) + 1e-6) * weight`, the weight always f32; ggml's fused `rms_norm` is
//!   not wrapped by sd-backends, so it is built from `sqr`, `mean`, `add`, `sqrt`, `div`.
//! * **Attention**: no `1/sqrt(d)` scaling (T5 folds it into the weights; the reference
//!   multiplies k by `sqrt(d)` and its attention divides by it again, exact for d = 64).
//!   The scores get a relative position bias before the softmax, computed once from
//!   `encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight` (`[heads, 32]`)
//!   and the bidirectional buckets of [`relative_position_buckets`] (32 buckets, max distance
//!   128), and reused by every block: the later blocks have no bias table. No attention mask
//!   (FLUX's conditioner passes none, so the padding is attended to).
//! * **Feed-forward**: `wo(gelu(wi_0 x) * wi_1 x)` with ggml's tanh GELU; as the reference,
//!   the input of `wo` is scaled by 1/32 and its output by 32 (exact powers of two, against
//!   f16 overflow on some backends).
//! * **Final**: `encoder.final_layer_norm` (RMSNorm) after the last block.
//!
//! Tensor names are the reference's internal ones under `text_encoders.t5xxl.transformer`:
//! `shared.weight`, `encoder.block.N.layer.0.SelfAttention.{q,k,v,o}.weight`,
//! `encoder.block.N.layer.0.layer_norm.weight`, `encoder.block.N.layer.1.DenseReluDense.
//! {wi_0,wi_1,wo}.weight`, `encoder.block.N.layer.1.layer_norm.weight`,
//! `encoder.final_layer_norm.weight`. Linear layers have no bias; in a graph-level row split
//! ([`row_splittable`]) each block matmul is one product per row chunk, concatenated. Graph
//! cuts are recorded as the reference marks them: `t5.prelude` after the embedding and
//! `t5.block.N` after each block.

use sd_backends::{BackendError, Context, GgmlType, Tensor};
use sd_sched::{Runner, SchedError, TensorSpec, Weights};

use crate::wtype::SpecSink;

/// Where the encoder's tensors live in the internal naming (`--t5xxl` files are read under it).
pub const T5XXL_PREFIX: &str = "text_encoders.t5xxl.transformer";

/// Errors of the T5 encoder.
#[derive(Debug, thiserror::Error)]
pub enum T5Error {
    /// A configuration that cannot describe an encoder.
    #[error("invalid T5 configuration: {0}")]
    Config(String),
    /// A token id the embedding table has no row for.
    #[error("token id {id} at position {position} is outside the T5 vocabulary of {vocab} ids")]
    TokenId { id: u32, position: usize, vocab: usize },
    /// Token ids that are not whole sequences of the requested length.
    #[error("{got} token ids do not form whole sequences of {len} ids")]
    IdsLength { got: usize, len: usize },
    /// A parameter missing from the weight set given to the model.
    #[error("T5 weight `{0}` is missing from the weight set")]
    MissingWeight(String),
    /// A parameter whose shape disagrees with the architecture.
    #[error("T5 weight `{name}` has shape {got:?}, the architecture needs {expected:?}")]
    WeightShape { name: String, expected: Vec<i64>, got: Vec<i64> },
    /// Weights declared but not given storage.
    #[error("the T5 weights have no storage yet: allocate and load them before encoding")]
    NotAllocated,
    /// Allocating or running the graph failed.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// Reading or writing tensor data failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Result alias of this module.
pub type Result<T, E = T5Error> = std::result::Result<T, E>;

/// Hyper-parameters of a T5 v1.1 encoder.
#[derive(Clone, Debug, PartialEq)]
pub struct T5Config {
    /// Name prefix of every parameter (no trailing dot).
    pub prefix: &'static str,
    /// Rows of `shared.weight`.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Width of one head; `n_heads * d_kv` is the attention's inner width.
    pub d_kv: usize,
    /// Width of the gated feed-forward.
    pub d_ff: usize,
    /// Encoder blocks.
    pub n_layers: usize,
    /// Relative position buckets (both directions together).
    pub num_buckets: usize,
    /// Distance from which all relative positions share the last bucket of a direction.
    pub max_distance: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
}

impl T5Config {
    /// T5-XXL v1.1 (google/t5-v1_1-xxl), the encoder FLUX.1 and SD3 use: 24 blocks of width
    /// 4096, 64 heads of 64, feed-forward 10240, 32128 embedding rows; 4,762,310,656
    /// parameters.
    pub fn xxl() -> Self {
        Self {
            prefix: T5XXL_PREFIX,
            vocab_size: 32128,
            d_model: 4096,
            n_heads: 64,
            d_kv: 64,
            d_ff: 10240,
            n_layers: 24,
            num_buckets: 32,
            max_distance: 128,
            eps: 1e-6,
        }
    }

    /// T5-XXL with as many blocks as `index` holds (`encoder.block.N` under the internal
    /// prefix), 24 when it holds none. The reference builds all 24; a cut-down encoder runs with
    /// the blocks it has.
    pub(crate) fn xxl_of(index: &crate::files::TensorIndex) -> Self {
        let xxl = Self::xxl();
        let blocks = index.with_prefix(T5XXL_PREFIX).filter_map(|e| sd_arch::encoders::t5_block_of(&e.name)).max();
        Self { n_layers: blocks.map_or(xxl.n_layers, |b| b as usize + 1), ..xxl }
    }

    /// The attention's inner width.
    pub fn inner_dim(&self) -> usize {
        self.n_heads * self.d_kv
    }

    /// Checks that the numbers describe an encoder the graph can be built for.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(T5Error::Config(m));
        if self.vocab_size == 0 || self.d_model == 0 || self.d_ff == 0 || self.d_kv == 0 || self.n_heads == 0 {
            return bad(format!("vocabulary and widths must be non-zero: {self:?}"));
        }
        if self.n_layers == 0 {
            return bad(format!("need at least one block: {self:?}"));
        }
        // Bidirectional buckets: half per direction, half of those exact.
        if self.num_buckets < 4 || !self.num_buckets.is_multiple_of(4) || self.max_distance <= self.num_buckets / 4 {
            return bad(format!(
                "relative buckets must be a multiple of 4 (at least 4) below a larger max distance: {self:?}"
            ));
        }
        if self.vocab_size > i32::MAX as usize || !self.eps.is_finite() || self.eps <= 0.0 {
            return bad(format!("vocabulary must fit i32 and eps must be positive: {self:?}"));
        }
        Ok(())
    }

    fn name(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.prefix)
    }

    fn block(&self, i: usize, suffix: &str) -> String {
        format!("{}.encoder.block.{i}.{suffix}", self.prefix)
    }

    /// Name of the relative position bias table (block 0 only).
    pub fn relative_bias_name(&self) -> String {
        self.block(0, "layer.0.SelfAttention.relative_attention_bias.weight")
    }
}

/// Whether the parameter `name` is read with `get_rows` rather than multiplied (so it stays out
/// of the CPU's repacked layouts).
pub fn is_gathered(name: &str) -> bool {
    name.ends_with(".shared.weight") || name.ends_with("relative_attention_bias.weight")
}

/// The parameters of a T5 encoder with the types the reference stores them in.
///
/// `dtype_of(name)` is the type the file stores the tensor `name` (internal name) in, `None`
/// when the file lacks it; `wtype` is the `--type` override, `None` to keep file types.
pub fn t5_specs(
    cfg: &T5Config,
    dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
    wtype: Option<GgmlType>,
) -> Vec<TensorSpec> {
    let mut b = SpecSink::new(dtype_of, wtype);
    let (d, inner, ff) = (cfg.d_model as i64, cfg.inner_dim() as i64, cfg.d_ff as i64);
    let gathered = |name: &str, ne0: i64| {
        let ty = crate::wtype::loaded_type(name, ne0, dtype_of(name), wtype);
        if super::clip::gathers_rows(ty) && sd_backends::convert::fits_blocks(ty, ne0) {
            ty
        } else {
            GgmlType::GGML_TYPE_F32
        }
    };
    let shared = cfg.name("shared.weight");
    b.push(shared.clone(), gathered(&shared, d), &[d, cfg.vocab_size as i64]);
    for i in 0..cfg.n_layers {
        for p in ["q", "k", "v"] {
            b.linear(&cfg.block(i, &format!("layer.0.SelfAttention.{p}")), d, inner, false);
        }
        b.linear(&cfg.block(i, "layer.0.SelfAttention.o"), inner, d, false);
        if i == 0 {
            let rel = cfg.relative_bias_name();
            let heads = cfg.n_heads as i64;
            b.push(rel.clone(), gathered(&rel, heads), &[heads, cfg.num_buckets as i64]);
        }
        b.push(cfg.block(i, "layer.0.layer_norm.weight"), GgmlType::GGML_TYPE_F32, &[d]);
        b.linear(&cfg.block(i, "layer.1.DenseReluDense.wi_0"), d, ff, false);
        b.linear(&cfg.block(i, "layer.1.DenseReluDense.wi_1"), d, ff, false);
        b.linear(&cfg.block(i, "layer.1.DenseReluDense.wo"), ff, d, false);
        b.push(cfg.block(i, "layer.1.layer_norm.weight"), GgmlType::GGML_TYPE_F32, &[d]);
    }
    b.push(cfg.name("encoder.final_layer_norm.weight"), GgmlType::GGML_TYPE_F32, &[d]);
    b.specs
}

/// The reference's bidirectional relative position buckets for a sequence of `len` tokens:
/// entry `i * len + j` is the bucket of key `j` seen from query `i` (`j - i`). Half the buckets
/// are for keys after the query; within a direction, distances below a quarter of the buckets
/// are exact and larger ones share logarithmic buckets up to `max_distance`, computed in f32
/// as the reference does.
pub fn relative_position_buckets(cfg: &T5Config, len: usize) -> Vec<i32> {
    let half = (cfg.num_buckets / 2) as i32;
    let max_exact = half / 2;
    let log_base = (cfg.max_distance as f32 / max_exact as f32).ln();
    let mut out = Vec::with_capacity(len * len);
    for i in 0..len as i64 {
        for j in 0..len as i64 {
            let rel = j - i;
            let mut bucket = if rel > 0 { half } else { 0 };
            let dist = rel.unsigned_abs() as i32;
            if dist < max_exact {
                bucket += dist;
            } else {
                let log_pos = (dist as f32 / max_exact as f32).ln();
                let large = max_exact + (log_pos / log_base * (half - max_exact) as f32) as i32;
                bucket += large.min(half - 1);
            }
            out.push(bucket);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// Blocks
// ---------------------------------------------------------------------------------------

fn get<'w>(w: &'w Weights, name: &str) -> Result<Tensor<'w>> {
    w.get(name).map_err(|_| T5Error::MissingWeight(name.to_string()))
}

/// `W x` for the linear layer `name` without bias ([`Weights::linear`]: one product per part
/// of a row-split matrix, plus the low-rank terms of a LoRA applied at run time).
fn linear<'g>(g: &'g Context, w: &Weights, name: &str, x: Tensor<'_>) -> Result<Tensor<'g>> {
    w.linear(g, name, None, x).map_err(|_| T5Error::MissingWeight(name.to_string()))
}

/// Whether a T5 parameter is cut by output rows in a graph-level row split: the matmul weights
/// of the encoder blocks (attention q/k/v/o, the gated feed-forward's wi_0, wi_1 and wo).
pub fn row_splittable(spec: &TensorSpec) -> bool {
    const LEAVES: [&str; 7] = [
        ".SelfAttention.q.weight",
        ".SelfAttention.k.weight",
        ".SelfAttention.v.weight",
        ".SelfAttention.o.weight",
        ".DenseReluDense.wi_0.weight",
        ".DenseReluDense.wi_1.weight",
        ".DenseReluDense.wo.weight",
    ];
    let matrix = spec.ne.len() >= 2 && spec.ne[2..].iter().all(|&d| d == 1);
    matrix && spec.name.contains(".encoder.block.") && LEAVES.iter().any(|l| spec.name.ends_with(l))
}

/// Graph inputs besides the ids: the bucket table and RMSNorm's epsilon.
#[derive(Clone, Copy)]
struct Inputs<'g> {
    buckets: Tensor<'g>,
    eps: Tensor<'g>,
}

/// `x / sqrt(mean(x^2) + eps) * weight` over ne[0].
fn rms_norm<'g>(g: &'g Context, x: Tensor<'_>, weight: Tensor<'_>, eps: Tensor<'_>) -> Tensor<'g> {
    let ms = g.mean(g.sqr(x));
    let denom = g.sqrt(g.add(ms, eps));
    g.mul(g.div(x, denom), weight)
}

/// The relative position bias `[L_k, L_q, heads]` from block 0's table.
fn position_bias<'g>(g: &'g Context, table: Tensor<'_>, buckets: Tensor<'_>) -> Tensor<'g> {
    let [l, ..] = buckets.shape();
    let heads = table.shape()[0];
    let rows = g.get_rows(table, g.reshape(buckets, &[l * l])); // [heads, L_k * L_q]
    let rows = g.reshape(rows, &[heads, l, l]);
    g.cont(g.permute(rows, [2, 0, 1, 3]))
}

/// Self-attention of `x` `[d_model, L, N]` with the additive `bias`, no scaling.
fn attention<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &T5Config,
    i: usize,
    x: Tensor<'_>,
    bias: Tensor<'_>,
) -> Result<Tensor<'g>> {
    let lin = |p: &str, x| linear(g, w, &cfg.block(i, &format!("layer.0.SelfAttention.{p}.weight")), x);
    let (q, k, v) = (lin("q", x)?, lin("k", x)?, lin("v", x)?);
    let [c, l, n, _] = q.shape();
    let (h, d) = (cfg.n_heads as i64, cfg.d_kv as i64);
    debug_assert_eq!(c, h * d);
    // [d, heads, L, N] -> [d, L, heads * N]
    let split_heads = |t: Tensor<'_>| -> Tensor<'g> {
        let t = g.reshape(t, &[d, h, l, n]);
        let t = g.cont(g.permute(t, [0, 2, 1, 3]));
        g.reshape(t, &[d, l, h * n])
    };
    let (q, k) = (split_heads(q), split_heads(k));
    let v = g.reshape(v, &[d, h, l, n]);
    let v = g.cont(g.permute(v, [1, 2, 0, 3])); // [L, d, heads, N]
    let v = g.reshape(v, &[l, d, h * n]);
    let kq = g.mul_mat_prec_f32(k, q); // [L_k, L_q, heads * N]
    let kq = g.soft_max_ext(kq, Some(bias), 1.0, 0.0);
    let kqv = g.mul_mat(v, kq); // [d, L_q, heads * N]
    let kqv = g.reshape(kqv, &[d, l, h, n]);
    let kqv = g.cont(g.permute(kqv, [0, 2, 1, 3])); // [d, heads, L, N]
    let out = g.reshape(kqv, &[c, l, n]);
    lin("o", out)
}

/// `wo(gelu(wi_0 x) * wi_1 x)`, with the reference's 1/32 scaling around `wo`.
fn feed_forward<'g>(g: &'g Context, w: &Weights, cfg: &T5Config, i: usize, x: Tensor<'_>) -> Result<Tensor<'g>> {
    const WO_SCALE: f32 = 1.0 / 32.0;
    let lin = |p: &str, x| linear(g, w, &cfg.block(i, &format!("layer.1.DenseReluDense.{p}.weight")), x);
    let gate = g.gelu(lin("wi_0", x)?);
    let h = g.mul(gate, lin("wi_1", x)?);
    let h = g.scale(h, WO_SCALE);
    Ok(g.scale(lin("wo", h)?, 1.0 / WO_SCALE))
}

/// Builds the encoder's graph: `ids` (i32 `[L, N]`) to the hidden states `[d_model, L, N]`
/// after the final norm. `cuts` receives `t5.prelude` and `t5.block.N`.
fn forward<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &T5Config,
    ids: Tensor<'_>,
    inputs: Inputs<'_>,
    cuts: &mut Vec<(String, Tensor<'g>)>,
) -> Result<Tensor<'g>> {
    let [l, n, ..] = ids.shape();
    let _span = tracing::trace_span!("t5.forward", blocks = cfg.n_layers, tokens = l, sequences = n).entered();
    let d = cfg.d_model as i64;
    let emb = g.get_rows(get(w, &cfg.name("shared.weight"))?, g.reshape(ids, &[l * n]));
    let mut x = g.reshape(emb, &[d, l, n]);
    cuts.push(("t5.prelude".to_string(), x));
    let bias = position_bias(g, get(w, &cfg.relative_bias_name())?, inputs.buckets);
    for i in 0..cfg.n_layers {
        let norm = |s: &str| get(w, &cfg.block(i, s));
        let a = rms_norm(g, x, norm("layer.0.layer_norm.weight")?, inputs.eps);
        x = g.add(x, attention(g, w, cfg, i, a, bias)?);
        let f = rms_norm(g, x, norm("layer.1.layer_norm.weight")?, inputs.eps);
        x = g.add(x, feed_forward(g, w, cfg, i, f)?);
        cuts.push((format!("t5.block.{i}"), x));
    }
    Ok(rms_norm(g, x, get(w, &cfg.name("encoder.final_layer_norm.weight"))?, inputs.eps))
}

/// Checks that `weights` holds every parameter of `cfg` with its shape and has storage.
fn check_weights(cfg: &T5Config, weights: &Weights) -> Result<()> {
    cfg.validate()?;
    if !weights.is_allocated() {
        return Err(T5Error::NotAllocated);
    }
    match super::first_mismatch(weights, t5_specs(cfg, &|_| None, None)) {
        None => Ok(()),
        Some(super::SpecMismatch::Missing(name)) => Err(T5Error::MissingWeight(name)),
        Some(super::SpecMismatch::Shape { name, expected, got }) => Err(T5Error::WeightShape { name, expected, got }),
    }
}

/// A T5 encoder over borrowed weights. Build it with [`T5Encoder::new`], which checks them.
#[derive(Clone, Copy, Debug)]
pub struct T5Encoder<'a> {
    cfg: &'a T5Config,
    weights: &'a Weights,
}

impl<'a> T5Encoder<'a> {
    /// An encoder for `cfg` over `weights`, which must hold every parameter of `cfg` (and may
    /// hold others).
    pub fn new(cfg: &'a T5Config, weights: &'a Weights) -> Result<Self> {
        check_weights(cfg, weights)?;
        Ok(Self { cfg, weights })
    }

    /// The configuration.
    pub fn config(&self) -> &'a T5Config {
        self.cfg
    }

    /// Encodes `ids`, N sequences of `len` ids one after another, in one graph, and returns
    /// the hidden states: `d_model` values per token, tokens in order (the raw encoder output,
    /// before any prompt weighting). FLUX encodes chunks of 256 ids, one per run.
    pub fn encode_ids(&self, runner: &mut Runner, ids: &[u32], len: usize) -> Result<Vec<f32>> {
        let cfg = self.cfg;
        if len == 0 || ids.is_empty() || !ids.len().is_multiple_of(len) {
            return Err(T5Error::IdsLength { got: ids.len(), len });
        }
        let input: Vec<i32> = ids
            .iter()
            .enumerate()
            .map(|(position, &id)| {
                if (id as usize) < cfg.vocab_size {
                    Ok(id as i32)
                } else {
                    Err(T5Error::TokenId { id, position, vocab: cfg.vocab_size })
                }
            })
            .collect::<Result<_>>()?;
        let batch = ids.len() / len;
        let buckets = relative_position_buckets(cfg, len);

        let graph_size = 96 * (cfg.n_layers + 2);
        let g = Context::for_graph(2 * graph_size, graph_size).map_err(T5Error::Backend)?;
        let ids_t = g.new_tensor(GgmlType::GGML_TYPE_I32, &[len as i64, batch as i64]).set_name("t5_ids").set_input();
        let inputs = Inputs {
            buckets: g
                .new_tensor(GgmlType::GGML_TYPE_I32, &[len as i64, len as i64])
                .set_name("t5_buckets")
                .set_input(),
            eps: g.new_f32(&[1]).set_name("t5_eps").set_input(),
        };
        let mut cuts = Vec::new();
        let out = forward(&g, self.weights, cfg, ids_t, inputs, &mut cuts)?.set_output();
        runner.run(self.weights, &g, graph_size, &cuts, out, &mut || {
            ids_t.set_i32(&input)?;
            inputs.buckets.set_i32(&buckets)?;
            inputs.eps.set_f32(&[cfg.eps])?;
            Ok(())
        })?;
        Ok(out.get_f32()?)
    }
}

#[cfg(test)]
mod tests;
