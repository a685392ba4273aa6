//! The Qwen3 dense decoder as a text encoder (Z-Image's and FLUX.2 klein's LLM) as a ggml graph.
//!
//! References: the Qwen3 technical report (2025) and Hugging Face `modeling_qwen3.py`
//! (`Qwen3Model`, whose tensor names the files use); stable-diffusion.cpp `model/te/llm.hpp`
//! (`LLMArch::QWEN3`, the reference we must match).
//!
//! # Design
//!
//! * **Embedding**: `get_rows` of `model.embed_tokens.weight` (`[hidden, vocab]`), no scaling.
//!   The table keeps the file's (or `--type`'s) type when ggml can gather rows of it, else f32.
//! * **Layers** (pre-norm): `x + attn(rms(x))`, then `x + mlp(rms(x))`; RMSNorm is ggml's
//!   `rms_norm` times the f32 weight, eps 1e-6.
//! * **Attention**: grouped-query (32 query heads, 8 key/value heads of 128 for Qwen3-4B; query
//!   head `h` reads key/value head `h / 4`, through ggml's broadcasting matmul), no biases,
//!   an RMSNorm over each head's 128 values of q and k (`q_norm`, `k_norm`), then NeoX RoPE
//!   (base 1e6, positions 0..L), scores scaled by `1/sqrt(head_dim)` in f32 with a causal
//!   mask of `-f32::MAX/4` (the reference's value), softmax, `o_proj`.
//! * **MLP**: SwiGLU, `down(silu(gate x) * up x)`.
//! * **Output**: the reference's `out_layers`: the hidden states after each layer `L` listed,
//!   side by side per token (FLUX.2 klein takes 9, 18 and 27). For one layer `L`
//!   (1-based; Z-Image takes 35 of 36, the second to last), without the final norm; when `L`
//!   is not a layer of the model (0, or past its depth, as in a reduced-depth fixture), the
//!   final `model.norm`'s output. Layers after `L` are not computed.
//!
//! **Mistral** (`LlmArch::Mistral`: Mistral-Small-3.2-24B, FLUX.2 dev's encoder) is the same
//! decoder without `q_norm`/`k_norm`, with RoPE in the original layout (pairs `2i`, `2i + 1`;
//! base 1e9, the reference's `ggml_rope_ext(.., GGML_ROPE_TYPE_NORMAL, 8192, 1e9, ..)`) and
//! RMSNorm eps 1e-5: the reference's `LLMArch::MISTRAL_SMALL_3_2`.
//!
//! Tensor names are the reference's internal ones under `text_encoders.llm` (`--llm` files
//! are read under it): `model.embed_tokens.weight`, `model.layers.N.input_layernorm.weight`,
//! `model.layers.N.self_attn.{q,k,v,o}_proj.weight`, `model.layers.N.self_attn.{q,k}_norm.weight`,
//! `model.layers.N.post_attention_layernorm.weight`, `model.layers.N.mlp.{gate,up,down}_proj.weight`,
//! `model.norm.weight` (llama.cpp's GGUF names, `blk.N.attn_q.weight` and so on, are mapped
//! onto these by `sd_formats::names`). Graph cuts: `llm.prelude` after the embedding and
//! `llm.layers.N` after each layer, so `te` can be segmented and split by layer.

use sd_arch::encoders::qwen3_block_of;
use sd_backends::{BackendError, Context, GgmlType, Tensor};
use sd_sched::{Runner, SchedError, TensorSpec, Weights};

use crate::wtype::SpecSink;

/// Where the LLM's tensors live in the internal naming (no trailing dot).
pub const LLM_PREFIX: &str = "text_encoders.llm";

/// Errors of the Qwen3 encoder.
#[derive(Debug, thiserror::Error)]
pub enum Qwen3Error {
    /// A configuration that cannot describe an encoder.
    #[error("invalid Qwen3 configuration: {0}")]
    Config(String),
    /// A token id the embedding table has no row for.
    #[error("token id {id} at position {position} is outside the LLM's embedding table of {vocab} rows")]
    TokenId { id: u32, position: usize, vocab: usize },
    /// No token ids at all.
    #[error("the LLM needs at least one token id")]
    NoTokens,
    /// A parameter missing from the weight set given to the model.
    #[error("LLM weight `{0}` is missing from the weight set")]
    MissingWeight(String),
    /// A parameter whose shape disagrees with the architecture.
    #[error("LLM weight `{name}` has shape {got:?}, the architecture needs {expected:?}")]
    WeightShape { name: String, expected: Vec<i64>, got: Vec<i64> },
    /// Weights declared but not given storage.
    #[error("the LLM weights have no storage yet: allocate and load them before encoding")]
    NotAllocated,
    /// Allocating or running the graph failed.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// Reading or writing tensor data failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Result alias of this module.
pub type Result<T, E = Qwen3Error> = std::result::Result<T, E>;

/// Which dense decoder: what the layers hold besides the shared Llama-style core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlmArch {
    /// Qwen3: RMSNorm of each head's q and k, NeoX RoPE.
    Qwen3,
    /// Mistral (Small 3.2): no q/k norms, RoPE in the original layout.
    Mistral,
    /// Qwen2.5-VL's text model (Qwen-Image's encoder): biases on q, k and v, no q/k norms,
    /// NeoX RoPE (its multimodal RoPE gives a text token one position on every section, which
    /// is NeoX RoPE at that position).
    Qwen25Vl,
}

impl LlmArch {
    /// Whether the attention holds `q_norm` and `k_norm`.
    pub fn qk_norm(self) -> bool {
        self == Self::Qwen3
    }

    /// Whether the q, k and v projections have biases.
    pub fn qkv_bias(self) -> bool {
        self == Self::Qwen25Vl
    }

    /// The name the reference gives the architecture (its `llm_arch_to_str`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen3 => "Qwen3",
            Self::Mistral => "Mistral-Small-3.2",
            Self::Qwen25Vl => "Qwen2.5-VL",
        }
    }
}

/// Hyper-parameters of a dense decoder (Qwen3 or Mistral) used as a text encoder.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3Config {
    /// Which decoder.
    pub arch: LlmArch,
    /// Name prefix of every parameter (no trailing dot).
    pub prefix: &'static str,
    /// Rows of `model.embed_tokens.weight`.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (a divisor of `n_heads`).
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Width of the SwiGLU feed-forward.
    pub intermediate: usize,
    /// Decoder layers.
    pub n_layers: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// The context length RoPE was trained for (ggml's `n_ctx_orig`; unused without YaRN).
    pub rope_ctx: usize,
}

impl Qwen3Config {
    /// Qwen3-4B, Z-Image's and FLUX.2 klein 4B's encoder: 36 layers of width 2560, 32 query
    /// and 8 key/value heads of 128, SwiGLU 9728, 151936 embedding rows, RoPE base 1e6.
    pub fn qwen3_4b() -> Self {
        Self {
            arch: LlmArch::Qwen3,
            prefix: LLM_PREFIX,
            vocab_size: 151_936,
            hidden: 2560,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            intermediate: 9728,
            n_layers: 36,
            eps: 1e-6,
            rope_base: 1_000_000.0,
            rope_ctx: 40960,
        }
    }

    /// Mistral-Small-3.2-24B, FLUX.2 dev's encoder: 40 layers of width 5120, 32 query and 8
    /// key/value heads of 128, SwiGLU 32768, 131072 embedding rows, RoPE base 1e9 (original
    /// layout), eps 1e-5.
    pub fn mistral_small_3_2() -> Self {
        Self {
            arch: LlmArch::Mistral,
            prefix: LLM_PREFIX,
            vocab_size: 131_072,
            hidden: 5120,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            intermediate: 32_768,
            n_layers: 40,
            eps: 1e-5,
            rope_base: 1e9,
            rope_ctx: 8192,
        }
    }

    /// Qwen2.5-VL-7B's text model, Qwen-Image's encoder: 28 layers of width 3584, 28 query and
    /// 4 key/value heads of 128 with q/k/v biases, SwiGLU 18944, 152064 embedding rows, RoPE
    /// base 1e6, eps 1e-6 (the reference's `LLMConfig` defaults for `QWEN2_5_VL`).
    pub fn qwen25_vl_7b() -> Self {
        Self {
            arch: LlmArch::Qwen25Vl,
            prefix: LLM_PREFIX,
            vocab_size: 152_064,
            hidden: 3584,
            n_heads: 28,
            n_kv_heads: 4,
            head_dim: 128,
            intermediate: 18_944,
            n_layers: 28,
            eps: 1e-6,
            rope_base: 1_000_000.0,
            rope_ctx: 128_000,
        }
    }

    /// Checks that the numbers describe an encoder the graph can be built for.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Qwen3Error::Config(m));
        if [
            self.vocab_size,
            self.hidden,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.intermediate,
            self.n_layers,
        ]
        .contains(&0)
        {
            return bad(format!("vocabulary, widths, heads and layers must be non-zero: {self:?}"));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} key/value heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("RoPE needs an even head width, not {}", self.head_dim));
        }
        let positive = |v: f32, above: f32| v.is_finite() && v > above;
        if self.vocab_size > i32::MAX as usize || !positive(self.eps, 0.0) || !positive(self.rope_base, 1.0) {
            return bad(format!("vocabulary must fit i32, eps be positive and the RoPE base above 1: {self:?}"));
        }
        Ok(())
    }

    /// The configuration of the Qwen3 model in `index`, as the reference infers it: depth from
    /// the layer names (`model.layers.N`), width and vocabulary from the embedding, SwiGLU width
    /// from layer 0's gate; heads stay Qwen3-4B's. Errors name the missing or malformed tensor.
    pub fn from_index(index: &crate::files::TensorIndex) -> Result<Self> {
        Self::from_index_as(index, Self::qwen3_4b())
    }

    /// [`Qwen3Config::from_index`] for the decoder `base` describes (its arch, heads, eps and
    /// RoPE kept; depth, widths and vocabulary read from the file).
    pub fn from_index_as(index: &crate::files::TensorIndex, base: Self) -> Result<Self> {
        let shape = |suffix: &str| -> Result<Vec<u64>> {
            let full = format!("{LLM_PREFIX}.model.{suffix}");
            match index.get(&full) {
                Some(e) if e.shape.len() == 2 => Ok(e.shape.clone()),
                Some(e) => Err(Qwen3Error::Config(format!(
                    "tensor '{}' has shape {:?}, expected a matrix",
                    e.original_name, e.shape
                ))),
                None => Err(Qwen3Error::MissingWeight(full)),
            }
        };
        let embed = shape("embed_tokens.weight")?;
        let gate = shape("layers.0.mlp.gate_proj.weight")?;
        let layers = index.entries().iter().filter_map(|e| qwen3_block_of(&e.name)).max().map_or(0, |n| n as usize + 1);
        let cfg = Self {
            vocab_size: embed[0] as usize,
            hidden: embed[1] as usize,
            intermediate: gate[0] as usize,
            n_layers: layers,
            ..base
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn name(&self, suffix: &str) -> String {
        format!("{}.model.{suffix}", self.prefix)
    }

    fn layer(&self, i: usize, suffix: &str) -> String {
        format!("{}.model.layers.{i}.{suffix}", self.prefix)
    }
}

/// Whether the parameter `name` is read with `get_rows` rather than multiplied.
pub fn is_gathered(name: &str) -> bool {
    name.ends_with(".embed_tokens.weight")
}

/// The parameters of a Qwen3 encoder with the types the reference stores them in.
///
/// `dtype_of(name)` is the type the file stores the tensor `name` (internal name) in, `None`
/// when the file lacks it; `wtype` is the `--type` override, `None` to keep file types.
pub fn qwen3_specs(
    cfg: &Qwen3Config,
    dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
    wtype: Option<GgmlType>,
) -> Vec<TensorSpec> {
    let mut b = SpecSink::new(dtype_of, wtype);
    let (d, ff) = (cfg.hidden as i64, cfg.intermediate as i64);
    let (q, kv, hd) =
        ((cfg.n_heads * cfg.head_dim) as i64, (cfg.n_kv_heads * cfg.head_dim) as i64, cfg.head_dim as i64);
    let embed = cfg.name("embed_tokens.weight");
    let ty = crate::wtype::loaded_type(&embed, d, dtype_of(&embed), wtype);
    let ty = if super::clip::gathers_rows(ty) && sd_backends::convert::fits_blocks(ty, d) {
        ty
    } else {
        GgmlType::GGML_TYPE_F32
    };
    b.push(embed, ty, &[d, cfg.vocab_size as i64]);
    for i in 0..cfg.n_layers {
        b.push(cfg.layer(i, "input_layernorm.weight"), GgmlType::GGML_TYPE_F32, &[d]);
        let bias = cfg.arch.qkv_bias();
        b.linear(&cfg.layer(i, "self_attn.q_proj"), d, q, bias);
        b.linear(&cfg.layer(i, "self_attn.k_proj"), d, kv, bias);
        b.linear(&cfg.layer(i, "self_attn.v_proj"), d, kv, bias);
        b.linear(&cfg.layer(i, "self_attn.o_proj"), q, d, false);
        if cfg.arch.qk_norm() {
            b.push(cfg.layer(i, "self_attn.q_norm.weight"), GgmlType::GGML_TYPE_F32, &[hd]);
            b.push(cfg.layer(i, "self_attn.k_norm.weight"), GgmlType::GGML_TYPE_F32, &[hd]);
        }
        b.push(cfg.layer(i, "post_attention_layernorm.weight"), GgmlType::GGML_TYPE_F32, &[d]);
        b.linear(&cfg.layer(i, "mlp.gate_proj"), d, ff, false);
        b.linear(&cfg.layer(i, "mlp.up_proj"), d, ff, false);
        b.linear(&cfg.layer(i, "mlp.down_proj"), ff, d, false);
    }
    b.push(cfg.name("norm.weight"), GgmlType::GGML_TYPE_F32, &[d]);
    b.specs
}

/// Whether a Qwen3 parameter is cut by output rows in a graph-level row split: the matmul
/// weights of the layers (q/k/v/o projections, gate, up and down).
pub fn row_splittable(spec: &TensorSpec) -> bool {
    const LEAVES: [&str; 7] = [
        ".self_attn.q_proj.weight",
        ".self_attn.k_proj.weight",
        ".self_attn.v_proj.weight",
        ".self_attn.o_proj.weight",
        ".mlp.gate_proj.weight",
        ".mlp.up_proj.weight",
        ".mlp.down_proj.weight",
    ];
    let matrix = spec.ne.len() >= 2 && spec.ne[2..].iter().all(|&d| d == 1);
    matrix && spec.name.contains(".model.layers.") && LEAVES.iter().any(|l| spec.name.ends_with(l))
}

/// The causal mask `[L, L]` (key fastest): 0 where the key is at or before the query,
/// `-f32::MAX / 4` after it, as the reference's LLM conditioner builds it.
pub fn causal_mask(len: usize) -> Vec<f32> {
    let masked = -f32::MAX / 4.0;
    (0..len).flat_map(|q| (0..len).map(move |k| if k > q { masked } else { 0.0 })).collect()
}

/// The causal mask of a padded sequence (`real[k]` 0 for a padding token): `-f32::MAX / 4`
/// for a padding key plus `-f32::MAX / 4` for a key after the query, summed in f32 as the
/// reference's `LLMEmbedder::encode_prompt` builds it.
pub fn padded_causal_mask(real: &[f32]) -> Vec<f32> {
    let masked = -f32::MAX / 4.0;
    let len = real.len();
    (0..len)
        .flat_map(|q| {
            (0..len).map(move |k| {
                let mut v = 0.0f32;
                if real[k] == 0.0 {
                    v += masked;
                }
                if k > q {
                    v += masked;
                }
                v
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Layers
// ---------------------------------------------------------------------------------------

fn get<'w>(w: &'w Weights, name: &str) -> Result<Tensor<'w>> {
    w.get(name).map_err(|_| Qwen3Error::MissingWeight(name.to_string()))
}

/// `W x` for the linear layer `name` (no bias), row-split and LoRA aware ([`Weights::linear`]).
fn linear<'g>(g: &'g Context, w: &Weights, name: &str, x: Tensor<'_>) -> Result<Tensor<'g>> {
    w.linear(g, name, None, x).map_err(|_| Qwen3Error::MissingWeight(name.to_string()))
}

/// Graph inputs besides the ids.
#[derive(Clone, Copy)]
struct Inputs<'g> {
    /// i32 `[L]`: 0..L.
    pos: Tensor<'g>,
    /// f32 `[L, L]`: [`causal_mask`].
    mask: Tensor<'g>,
}

fn rms_norm<'g>(g: &'g Context, cfg: &Qwen3Config, x: Tensor<'_>, weight: Tensor<'_>) -> Tensor<'g> {
    g.mul(g.rms_norm(x, cfg.eps), weight)
}

/// Grouped-query self-attention of `x` `[hidden, L]` (one sequence).
fn attention<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &Qwen3Config,
    i: usize,
    x: Tensor<'_>,
    inputs: Inputs<'_>,
) -> Result<Tensor<'g>> {
    let l = x.shape()[1];
    let (h, kvh, d) = (cfg.n_heads as i64, cfg.n_kv_heads as i64, cfg.head_dim as i64);
    let lin = |p: &str, x| linear(g, w, &cfg.layer(i, &format!("self_attn.{p}_proj.weight")), x);
    // q, k and v with their biases where the architecture has them.
    let qkv = |p: &str| -> Result<Tensor<'g>> {
        let y = lin(p, x)?;
        if !cfg.arch.qkv_bias() {
            return Ok(y);
        }
        Ok(g.add(y, get(w, &cfg.layer(i, &format!("self_attn.{p}_proj.bias")))?))
    };
    let q = g.reshape(qkv("q")?, &[d, h, l, 1]);
    let k = g.reshape(qkv("k")?, &[d, kvh, l, 1]);
    let v = g.reshape(qkv("v")?, &[d, kvh, l, 1]);
    let (q, k) = if cfg.arch.qk_norm() {
        (
            rms_norm(g, cfg, q, get(w, &cfg.layer(i, "self_attn.q_norm.weight"))?),
            rms_norm(g, cfg, k, get(w, &cfg.layer(i, "self_attn.k_norm.weight"))?),
        )
    } else {
        (q, k)
    };
    let rope = |t: Tensor<'g>| match cfg.arch {
        LlmArch::Qwen3 | LlmArch::Qwen25Vl => g.rope_neox(t, inputs.pos, d as i32, cfg.rope_ctx as i32, cfg.rope_base),
        LlmArch::Mistral => g.rope_normal(t, inputs.pos, d as i32, cfg.rope_ctx as i32, cfg.rope_base),
    };
    let (q, k) = (rope(q), rope(k));
    // [d, heads, L] -> [d, L, heads]
    let q = g.cont(g.permute(q, [0, 2, 1, 3]));
    let k = g.cont(g.permute(k, [0, 2, 1, 3]));
    let v = g.cont(g.permute(v, [1, 2, 0, 3])); // [L, d, kv heads]
    let kq = g.mul_mat_prec_f32(k, q); // [L_k, L_q, heads]: query head h reads kv head h / (h/kvh)
    let kq = g.soft_max_ext(kq, Some(inputs.mask), 1.0 / (d as f32).sqrt(), 0.0);
    let kqv = g.mul_mat(v, kq); // [d, L_q, heads]
    let kqv = g.cont(g.permute(kqv, [0, 2, 1, 3])); // [d, heads, L]
    lin("o", g.reshape(kqv, &[d * h, l]))
}

/// `down(silu(gate x) * up x)`.
fn mlp<'g>(g: &'g Context, w: &Weights, cfg: &Qwen3Config, i: usize, x: Tensor<'_>) -> Result<Tensor<'g>> {
    let lin = |p: &str, x| linear(g, w, &cfg.layer(i, &format!("mlp.{p}_proj.weight")), x);
    let h = g.mul(g.silu(lin("gate", x)?), lin("up", x)?);
    lin("down", h)
}

/// Builds the graph: `ids` (i32 `[L]`) to the hidden states of `out_layers` (see the module
/// doc): `[hidden * k, L]` for the `k` of them the model has. `cuts` receives `llm.prelude`
/// and `llm.layers.N`.
fn forward<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &Qwen3Config,
    ids: Tensor<'_>,
    inputs: Inputs<'_>,
    out_layers: &[usize],
    cuts: &mut Vec<(String, Tensor<'g>)>,
) -> Result<Tensor<'g>> {
    let taken: Vec<usize> = out_layers.iter().copied().filter(|l| (1..=cfg.n_layers).contains(l)).collect();
    let with_norm = taken.is_empty() || out_layers.contains(&(cfg.n_layers + 1));
    let layers = if with_norm { cfg.n_layers } else { taken.iter().copied().max().unwrap_or(cfg.n_layers) };
    let _span = tracing::trace_span!("qwen3.forward", layers, tokens = ids.shape()[0]).entered();
    let mut x = g.get_rows(get(w, &cfg.name("embed_tokens.weight"))?, ids);
    cuts.push(("llm.prelude".to_string(), x));
    let mut outs = Vec::new();
    for i in 0..layers {
        let a = rms_norm(g, cfg, x, get(w, &cfg.layer(i, "input_layernorm.weight"))?);
        x = g.add(x, attention(g, w, cfg, i, a, inputs)?);
        let f = rms_norm(g, cfg, x, get(w, &cfg.layer(i, "post_attention_layernorm.weight"))?);
        x = g.add(x, mlp(g, w, cfg, i, f)?);
        cuts.push((format!("llm.layers.{i}"), x));
        if taken.contains(&(i + 1)) {
            outs.push(x);
        }
    }
    if with_norm {
        outs.push(rms_norm(g, cfg, x, get(w, &cfg.name("norm.weight"))?));
    }
    let mut out = outs[0];
    for o in &outs[1..] {
        out = g.concat(out, *o, 0);
    }
    Ok(out)
}

/// Checks that `weights` holds every parameter of `cfg` with its shape and has storage.
fn check_weights(cfg: &Qwen3Config, weights: &Weights) -> Result<()> {
    cfg.validate()?;
    if !weights.is_allocated() {
        return Err(Qwen3Error::NotAllocated);
    }
    match super::first_mismatch(weights, qwen3_specs(cfg, &|_| None, None)) {
        None => Ok(()),
        Some(super::SpecMismatch::Missing(name)) => Err(Qwen3Error::MissingWeight(name)),
        Some(super::SpecMismatch::Shape { name, expected, got }) => {
            Err(Qwen3Error::WeightShape { name, expected, got })
        }
    }
}

/// A Qwen3 encoder over borrowed weights. Build it with [`Qwen3Encoder::new`], which checks them.
#[derive(Clone, Copy, Debug)]
pub struct Qwen3Encoder<'a> {
    cfg: &'a Qwen3Config,
    weights: &'a Weights,
}

impl<'a> Qwen3Encoder<'a> {
    /// An encoder for `cfg` over `weights`, which must hold every parameter of `cfg` (and may
    /// hold others).
    pub fn new(cfg: &'a Qwen3Config, weights: &'a Weights) -> Result<Self> {
        check_weights(cfg, weights)?;
        Ok(Self { cfg, weights })
    }

    /// The configuration.
    pub fn config(&self) -> &'a Qwen3Config {
        self.cfg
    }

    /// Encodes one sequence of `ids` (causal, no padding) and returns the hidden states of
    /// `out_layer` (see the module doc): `hidden` values per token, tokens in order, before
    /// any prompt weighting.
    pub fn encode_ids(&self, runner: &mut Runner, ids: &[u32], out_layer: usize) -> Result<Vec<f32>> {
        self.encode(runner, ids, None, &[out_layer])
    }

    /// Encodes one sequence of `ids` and returns the hidden states after each layer of
    /// `out_layers` (1-based), concatenated per token (`hidden * k` values per token for the
    /// `k` layers the model has; the final norm's output for `n_layers + 1`, or when it has
    /// none of them, as the reference). `real`, when given, marks each id as text (1) or
    /// padding (0): no query attends to a padding key, as the reference's padded LLM
    /// conditioners mask it (its value added to the causal mask's).
    pub fn encode(
        &self,
        runner: &mut Runner,
        ids: &[u32],
        real: Option<&[f32]>,
        out_layers: &[usize],
    ) -> Result<Vec<f32>> {
        let cfg = self.cfg;
        if ids.is_empty() {
            return Err(Qwen3Error::NoTokens);
        }
        if real.is_some_and(|r| r.len() != ids.len()) {
            return Err(Qwen3Error::Config(format!(
                "the padding mask has {} values for {} ids",
                real.map_or(0, <[f32]>::len),
                ids.len()
            )));
        }
        let input: Vec<i32> = ids
            .iter()
            .enumerate()
            .map(|(position, &id)| {
                if (id as usize) < cfg.vocab_size {
                    Ok(id as i32)
                } else {
                    Err(Qwen3Error::TokenId { id, position, vocab: cfg.vocab_size })
                }
            })
            .collect::<Result<_>>()?;
        let len = ids.len();
        let graph_size = 64 * (cfg.n_layers + 2);
        let g = Context::for_graph(2 * graph_size, graph_size).map_err(Qwen3Error::Backend)?;
        let ids_t = g.new_tensor(GgmlType::GGML_TYPE_I32, &[len as i64]).set_name("llm_ids").set_input();
        let inputs = Inputs {
            pos: g.new_tensor(GgmlType::GGML_TYPE_I32, &[len as i64]).set_name("llm_pos").set_input(),
            mask: g.new_f32(&[len as i64, len as i64]).set_name("llm_mask").set_input(),
        };
        let mut cuts = Vec::new();
        let out = forward(&g, self.weights, cfg, ids_t, inputs, out_layers, &mut cuts)?.set_output();
        let pos: Vec<i32> = (0..len as i32).collect();
        let mask = match real {
            None => causal_mask(len),
            Some(real) => padded_causal_mask(real),
        };
        runner.run(self.weights, &g, graph_size, &cuts, out, &mut || {
            ids_t.set_i32(&input)?;
            inputs.pos.set_i32(&pos)?;
            inputs.mask.set_f32(&mask)?;
            Ok(())
        })?;
        Ok(out.get_f32()?)
    }
}

#[cfg(test)]
mod tests;
