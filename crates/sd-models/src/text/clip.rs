//! CLIP text transformers as ggml graphs: OpenAI CLIP ViT-L/14 (SD 1.x, SDXL), OpenCLIP ViT-H/14
//! (SD 2.x) and OpenCLIP ViT-bigG/14 (SDXL's second encoder, with its projection).
//!
//! References: Radford et al., "Learning Transferable Visual Models From Natural Language
//! Supervision" (2021); Hugging Face `modeling_clip.py` (`CLIPTextModel`, whose tensor names we
//! use); stable-diffusion.cpp `model/te/clip.hpp`, `core/ggml_extend.hpp` and
//! `conditioning/conditioner.hpp` (the reference we must match to the number).
//!
//! # Design
//!
//! The graph mirrors the reference op by op wherever the order of floating-point operations
//! could differ, because the parity test compares our output with the reference's on the same
//! ggml kernels:
//!
//! * **Embeddings**: `get_rows` of the token table plus the position table (always stored
//!   f32). The token table keeps the file's type when ggml can gather rows of it (f16, q8_0,
//!   q5_0, q5_1, q4_0, q4_1), else it is widened to f32; `--type` never converts it (the
//!   reference never converts a tensor whose name contains `embedding`).
//! * **Pre-norm layers**: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`. LayerNorm is
//!   `ggml_norm(eps = 1e-5)` then `* weight + bias`. Linear is `mul_mat` then `+ bias`; its
//!   weight has the file's (or `--type`'s) type unless rows of `in_features` do not fit the
//!   type's blocks, in which case it is f32; biases and norm parameters are always f32.
//! * **Attention** is the reference's non-flash path (the text encoder never uses flash
//!   attention there): per-head `k·q` with f32 precision, `* 1/sqrt(d_head)`, causal mask,
//!   softmax, `v·softmax`. The reference adds a 0/-inf mask tensor; we apply
//!   `ggml_diag_mask_inf`, which writes the same -inf entries and leaves the others
//!   untouched (`x + 0.0 == x`), so the softmax input is bit-identical without an extra graph
//!   input.
//! * **MLP activation**: quick GELU (`x * sigmoid(1.702 x)`) for CLIP ViT-L; for OpenCLIP
//!   ViT-H the reference uses `ggml_gelu`, ggml's *tanh approximation* (upstream OpenCLIP uses
//!   the erf form; we follow the reference, not upstream).
//! * **Clip skip** (`--clip-skip N`, N >= 1): the first `n_layers - N + 1` layers run, so
//!   N = 1 is the last layer and N = 2 the penultimate. The reference's defaults are 1 for
//!   SD 1.x and 2 for SD 2.x; for SD 2.x the reference never fills the last layer's weights,
//!   so `--clip-skip 1` gives what 2 gives ([`ClipConfig::min_clip_skip`]). The final LayerNorm is applied after the last layer that ran
//!   whenever [`ClipConfig::with_final_ln`] is set, which the reference does for both SD 1.x
//!   and SD 2.x (only SDXL's encoders skip it).
//! * **Fused q/k/v**: OpenCLIP files store `in_proj` fused; the file reader splits it into
//!   `q_proj`/`k_proj`/`v_proj`, so one graph serves both families. The reference keeps it
//!   fused and splits the matmul's output instead; every output element is the same dot
//!   product of the same weight row and activation column either way.
//!
//! * **Pooled output** (ViT-bigG only, [`ClipEncoder::encode_pooled`]): every layer runs
//!   (clip skip ignored), then the final LayerNorm (even though SDXL builds bigG without
//!   it for the hidden states), then the hidden state at one token (the first EOS), times
//!   `text_projection` without bias. The reference declares `text_projection` f32 whatever
//!   the file stores, as ggml `[projection_dim, hidden_size]`, and multiplies it as a linear
//!   weight (`mul_mat(text_projection, x)`), so the stored tensor's rows are the outputs;
//!   it never transposes it, whether the file holds open_clip's `text_projection` (which
//!   open_clip itself applies as `x @ P`, the transpose) or HF's `text_projection.weight`.
//!   We do the same. Since 1280 = 1280 both readings of the shape agree; we declare it
//!   `[hidden_size, projection_dim]` (in, out) like any linear weight.
//!
//! Tensor names are the reference's internal ones under
//! `cond_stage_model.transformer.text_model` (`…embeddings.token_embedding.weight`,
//! `…encoder.layers.N.self_attn.q_proj.weight`, `…final_layer_norm.bias`, …), and
//! `cond_stage_model.1.transformer.text_model` for SDXL's bigG. Parameters that the
//! reference does not load (`position_ids`, `logit_scale`, the `text_projection` of ViT-L
//! and ViT-H) are not declared.
//!
//! Graph cuts are recorded as the reference marks them: `clip_text.prelude` after the
//! embeddings and `clip_text.layers.N` after each layer.

use sd_backends::{BackendError, Context, GgmlType, Tensor};
use sd_sched::{Runner, SchedError, TensorSpec, Weights};

use super::{ChunkConfig, TokenizeError, EOS_ID};
use crate::wtype::SpecSink;

/// Where the text model's tensors live in the internal naming.
const TEXT_MODEL_PREFIX: &str = "cond_stage_model.transformer.text_model";
/// Where SDXL's second text model (OpenCLIP ViT-bigG/14) lives.
const TEXT_MODEL2_PREFIX: &str = "cond_stage_model.1.transformer.text_model";

/// Errors of the text encoders.
#[derive(Debug, thiserror::Error)]
pub enum ClipError {
    /// A configuration that cannot describe a transformer.
    #[error("invalid text encoder configuration: {0}")]
    Config(String),
    /// `--clip-skip` beyond the number of layers.
    #[error(
        "clip skip {requested} is out of range for this text encoder of {layers} layers; \
         accepted: 1 to {layers} (1 = last layer, 2 = penultimate), or 0 / -1 for the model's default ({default})"
    )]
    ClipSkip { requested: i64, layers: usize, default: usize },
    /// A token id the embedding table has no row for.
    #[error("token id {id} at position {position} is outside the text encoder's vocabulary of {vocab} ids")]
    TokenId { id: u32, position: usize, vocab: usize },
    /// Token ids that are not whole sequences of the encoder's context length.
    #[error("{got} token ids do not form whole sequences of {n_positions} ids (the encoder's context length)")]
    IdsLength { got: usize, n_positions: usize },
    /// A graph input of the wrong type or shape (a bug in the caller).
    #[error("text encoder input `ids` must be i32 of shape [{n_positions}, N], got type {ty} shape {shape:?}")]
    Input { ty: String, shape: [i64; 4], n_positions: usize },
    /// A pooled output asked of an encoder without a projection, or at a token index
    /// outside the sequence.
    #[error("pooled output at token {index} of {n_positions}: {why}")]
    Pooled { index: usize, n_positions: usize, why: &'static str },
    /// A parameter missing from the weight set given to the model.
    #[error("text encoder weight `{0}` is missing from the weight set")]
    MissingWeight(String),
    /// A parameter whose shape disagrees with the architecture.
    #[error("text encoder weight `{name}` has shape {got:?}, the architecture needs {expected:?}")]
    WeightShape { name: String, expected: Vec<i64>, got: Vec<i64> },
    /// Weights declared but not given storage.
    #[error("the text encoder's weights have no storage yet: allocate and load them before encoding")]
    NotAllocated,
    /// Tokenizing the prompt failed.
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    /// Allocating or running the graph failed.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// Reading or writing tensor data failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Result alias of this module.
pub type Result<T, E = ClipError> = std::result::Result<T, E>;

/// The MLP's activation function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(1.702 x)` (`ggml_gelu_quick`), OpenAI CLIP.
    QuickGelu,
    /// GELU, tanh approximation (`ggml_gelu`), as the reference runs OpenCLIP.
    GeluTanh,
}

/// Hyper-parameters of a CLIP text transformer.
#[derive(Clone, Debug, PartialEq)]
pub struct ClipConfig {
    /// Name prefix of every parameter (no trailing dot).
    pub prefix: &'static str,
    /// Rows of the token embedding.
    pub vocab_size: usize,
    /// Context length: rows of the position embedding and ids per sequence.
    pub n_positions: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Transformer layers.
    pub n_layers: usize,
    /// MLP activation.
    pub activation: Activation,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f32,
    /// Whether the final LayerNorm follows the last layer that ran.
    pub with_final_ln: bool,
    /// Clip skip used when the user gives none (`--clip-skip` <= 0).
    pub default_clip_skip: usize,
    /// Smallest clip skip that selects a layer the reference really computes: 2 for
    /// OpenCLIP ViT-H, whose last layer (`encoder.layers.23`) stable-diffusion.cpp treats as
    /// optional and never fills (its output with `--clip-skip 1` is bit-identical to
    /// `--clip-skip 2`; found by `cargo xtask parity --fuzz`); 1 otherwise.
    pub min_clip_skip: usize,
    /// Id that pads a chunk after its EOS.
    pub pad_id: u32,
    /// Output width of `text_projection` (the pooled output's width); `None` for encoders
    /// whose projection the reference does not load (ViT-L, ViT-H).
    pub projection_dim: Option<usize>,
}

impl ClipConfig {
    /// OpenAI CLIP ViT-L/14 text tower, as SD 1.x uses it: 12 layers of width 768, 12 heads,
    /// quick GELU, final LayerNorm, last layer by default, chunks padded with EOS.
    pub fn vit_l14() -> Self {
        Self {
            prefix: TEXT_MODEL_PREFIX,
            vocab_size: 49408,
            n_positions: 77,
            hidden_size: 768,
            intermediate_size: 3072,
            n_heads: 12,
            n_layers: 12,
            activation: Activation::QuickGelu,
            layer_norm_eps: 1e-5,
            with_final_ln: true,
            default_clip_skip: 1,
            min_clip_skip: 1,
            pad_id: EOS_ID,
            projection_dim: None,
        }
    }

    /// OpenCLIP ViT-H/14 text tower, as SD 2.x uses it: 24 layers of width 1024, 16 heads,
    /// GELU (tanh approximation), penultimate layer by default followed by the final
    /// LayerNorm, chunks padded with id 0.
    pub fn vit_h14() -> Self {
        Self {
            hidden_size: 1024,
            intermediate_size: 4096,
            n_heads: 16,
            n_layers: 24,
            activation: Activation::GeluTanh,
            default_clip_skip: 2,
            min_clip_skip: 2,
            pad_id: 0,
            ..Self::vit_l14()
        }
    }

    /// OpenAI CLIP ViT-L/14 as SDXL's first encoder: as [`ClipConfig::vit_l14`] but without
    /// the final LayerNorm and with the penultimate layer by default (the reference's SDXL
    /// conditioner builds it with `with_final_ln = false`; clip skip <= 0 is 2 for SDXL).
    pub fn vit_l14_sdxl() -> Self {
        Self { with_final_ln: false, default_clip_skip: 2, ..Self::vit_l14() }
    }

    /// OpenCLIP ViT-bigG/14 text tower, SDXL's second encoder: 32 layers of width 1280, 20
    /// heads, MLP 5120, GELU (tanh approximation: the reference picks `ggml_gelu` for widths
    /// 1024 and 1280), no final LayerNorm on the hidden states, penultimate layer by default,
    /// and `text_projection` 1280 -> 1280 for the pooled output. Its parameters live under
    /// `cond_stage_model.1.transformer.text_model`. Chunks are padded with EOS when tokenized
    /// (the SDXL tokenizer's pad id); the conditioner sets the ids after the first EOS to 0
    /// before bigG sees them, so [`ClipConfig::pad_id`] is 0.
    pub fn vit_bigg14() -> Self {
        Self {
            prefix: TEXT_MODEL2_PREFIX,
            hidden_size: 1280,
            intermediate_size: 5120,
            n_heads: 20,
            n_layers: 32,
            activation: Activation::GeluTanh,
            with_final_ln: false,
            default_clip_skip: 2,
            min_clip_skip: 1,
            pad_id: 0,
            projection_dim: Some(1280),
            ..Self::vit_l14()
        }
    }

    /// How the tokenizer lays ids out for this encoder.
    pub fn chunk_config(&self) -> ChunkConfig {
        ChunkConfig { chunk_len: self.n_positions, pad_id: self.pad_id }
    }

    /// Checks that the numbers describe a transformer the graph can be built for.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ClipError::Config(m));
        if self.vocab_size == 0 || self.n_positions == 0 || self.hidden_size == 0 || self.intermediate_size == 0 {
            return bad(format!("vocabulary, positions and widths must be non-zero: {self:?}"));
        }
        if self.n_layers == 0 || self.n_heads == 0 || !self.hidden_size.is_multiple_of(self.n_heads) {
            return bad(format!("need at least one layer and a width divisible by the head count: {self:?}"));
        }
        if self.default_clip_skip == 0 || self.default_clip_skip > self.n_layers {
            return bad(format!("default clip skip {} is not in 1..={}", self.default_clip_skip, self.n_layers));
        }
        if self.projection_dim == Some(0) {
            return bad(format!("a text projection needs a non-zero width: {self:?}"));
        }
        if self.vocab_size > i32::MAX as usize || self.n_positions > i32::MAX as usize {
            return bad(format!("vocabulary and positions must fit i32: {self:?}"));
        }
        Ok(())
    }

    /// The clip skip for a `--clip-skip` value: <= 0 means the model's default; otherwise
    /// 1 (last layer) up to the number of layers, raised to [`ClipConfig::min_clip_skip`].
    ///
    /// The reference accepts larger values with odd results (`n_layers + 1` runs no layer at
    /// all, anything larger runs every layer); we refuse them instead.
    pub fn resolve_clip_skip(&self, flag: i64) -> Result<usize> {
        if flag <= 0 {
            return Ok(self.default_clip_skip);
        }
        match usize::try_from(flag) {
            Ok(n) if n <= self.n_layers => Ok(n.max(self.min_clip_skip)),
            _ => Err(ClipError::ClipSkip { requested: flag, layers: self.n_layers, default: self.default_clip_skip }),
        }
    }

    fn name(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.prefix)
    }
}

// ---------------------------------------------------------------------------------------
// Storage types
// ---------------------------------------------------------------------------------------

/// Whether the parameter `name` is an embedding table, read with `get_rows` rather than as
/// the matrix of a product (so it stays out of the CPU's repacked/AMX layouts:
/// `Weights::keep_in_device_buffer`).
pub fn is_gathered(name: &str) -> bool {
    name.ends_with("embeddings.token_embedding.weight") || name.ends_with("embeddings.position_embedding.weight")
}

/// Types ggml's `get_rows` reads that the reference keeps for embedding tables.
pub(crate) fn gathers_rows(ty: GgmlType) -> bool {
    [
        GgmlType::GGML_TYPE_F16,
        GgmlType::GGML_TYPE_Q8_0,
        GgmlType::GGML_TYPE_Q5_1,
        GgmlType::GGML_TYPE_Q5_0,
        GgmlType::GGML_TYPE_Q4_1,
        GgmlType::GGML_TYPE_Q4_0,
    ]
    .contains(&ty)
}

/// The parameters of a CLIP text transformer with the types the reference stores them in.
///
/// `dtype_of(name)` is the type the file stores the tensor `name` (internal name) in, `None`
/// when the file lacks it; `wtype` is the `--type` override, `None` to keep file types.
pub fn clip_specs(
    cfg: &ClipConfig,
    dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
    wtype: Option<GgmlType>,
) -> Vec<TensorSpec> {
    let mut b = SpecSink::new(dtype_of, wtype);
    let (h, m) = (cfg.hidden_size as i64, cfg.intermediate_size as i64);

    let tok = cfg.name("embeddings.token_embedding.weight");
    let mut tok_ty = crate::wtype::loaded_type(&tok, h, dtype_of(&tok), wtype);
    if !gathers_rows(tok_ty) {
        tok_ty = GgmlType::GGML_TYPE_F32;
    }
    b.push(tok, tok_ty, &[h, cfg.vocab_size as i64]);
    b.push(cfg.name("embeddings.position_embedding.weight"), GgmlType::GGML_TYPE_F32, &[h, cfg.n_positions as i64]);

    for i in 0..cfg.n_layers {
        let l = cfg.name(&format!("encoder.layers.{i}"));
        for proj in ["q_proj", "k_proj", "v_proj", "out_proj"] {
            b.linear(&format!("{l}.self_attn.{proj}"), h, h, true);
        }
        b.norm(&format!("{l}.layer_norm1"), h);
        b.linear(&format!("{l}.mlp.fc1"), h, m, true);
        b.linear(&format!("{l}.mlp.fc2"), m, h, true);
        b.norm(&format!("{l}.layer_norm2"), h);
    }
    b.norm(&cfg.name("final_layer_norm"), h);
    if let Some(p) = cfg.projection_dim {
        // Always f32 (clip.hpp CLIPTextModel::init_params), whatever the file stores.
        b.push(cfg.name("text_projection"), GgmlType::GGML_TYPE_F32, &[h, p as i64]);
    }
    b.specs
}

// ---------------------------------------------------------------------------------------
// Blocks
// ---------------------------------------------------------------------------------------

fn get<'w>(w: &'w Weights, name: &str) -> Result<Tensor<'w>> {
    w.get(name).map_err(|_| ClipError::MissingWeight(name.to_string()))
}

/// `x W^T + b` (the reference's `Linear` for inputs of at most 1024 sequences). A weight cut
/// by output rows for a row split ([`row_splittable`]) is one product per chunk, concatenated.
/// Low-rank adapters of the weight (a LoRA applied at run time, `Weights::adapters`) add
/// `scale * up(down(x))` each after the bias.
struct Linear<'w> {
    w: &'w Weights,
    weight: String,
    bias: Tensor<'w>,
}

impl<'w> Linear<'w> {
    fn load(w: &'w Weights, name: &str) -> Result<Self> {
        let weight = format!("{name}.weight");
        // the matrix and its adapters are looked up here, so a missing one fails at load
        w.matrix_parts(&weight)
            .and_then(|_| w.adapters(&weight))
            .map_err(|_| ClipError::MissingWeight(weight.clone()))?;
        Ok(Self { w, weight, bias: get(w, &format!("{name}.bias"))? })
    }

    fn forward<'g>(&self, g: &'g Context, x: Tensor<'_>) -> Tensor<'g> {
        self.w.linear(g, &self.weight, Some(self.bias), x).expect("looked up at load")
    }
}

/// Whether a CLIP parameter is cut by output rows in a row split: the matmul weights of the
/// encoder layers (attention q/k/v/out projections, the MLP's fc1 and fc2), in either of
/// SDXL's encoders.
pub fn row_splittable(spec: &TensorSpec) -> bool {
    const LEAVES: [&str; 6] = [
        ".self_attn.q_proj.weight",
        ".self_attn.k_proj.weight",
        ".self_attn.v_proj.weight",
        ".self_attn.out_proj.weight",
        ".mlp.fc1.weight",
        ".mlp.fc2.weight",
    ];
    let matrix = spec.ne.len() >= 2 && spec.ne[2..].iter().all(|&d| d == 1);
    matrix && spec.name.contains(".encoder.layers.") && LEAVES.iter().any(|l| spec.name.ends_with(l))
}

/// LayerNorm over ne[0] with affine parameters.
struct LayerNorm<'w> {
    weight: Tensor<'w>,
    bias: Tensor<'w>,
    eps: f32,
}

impl<'w> LayerNorm<'w> {
    fn load(w: &'w Weights, name: &str, eps: f32) -> Result<Self> {
        Ok(Self { weight: get(w, &format!("{name}.weight"))?, bias: get(w, &format!("{name}.bias"))?, eps })
    }

    fn forward<'g>(&self, g: &'g Context, x: Tensor<'_>) -> Tensor<'g> {
        g.add(g.mul(g.norm(x, self.eps), self.weight), self.bias)
    }
}

/// Token plus position embeddings.
struct Embeddings<'w> {
    token: Tensor<'w>,
    position: Tensor<'w>,
}

impl<'w> Embeddings<'w> {
    fn load(w: &'w Weights, cfg: &ClipConfig) -> Result<Self> {
        Ok(Self {
            token: get(w, &cfg.name("embeddings.token_embedding.weight"))?,
            position: get(w, &cfg.name("embeddings.position_embedding.weight"))?,
        })
    }

    /// ids [L, N] i32 -> [hidden, L, N].
    fn forward<'g>(&self, g: &'g Context, ids: Tensor<'_>) -> Tensor<'g> {
        // One flat gather ([hidden, L * N]); the reference gathers with ids shaped
        // [L, 1, N], which this ggml accepts only for N = 1. A gather copies rows, so the
        // values are the same either way.
        let [l, n, ..] = ids.shape();
        let tok = g.get_rows(self.token, g.reshape(ids, &[l * n]));
        let hidden = tok.shape()[0];
        g.add(g.reshape(tok, &[hidden, l, n]), self.position)
    }
}

/// Causal multi-head self-attention with separate q/k/v projections.
struct SelfAttention<'w> {
    q: Linear<'w>,
    k: Linear<'w>,
    v: Linear<'w>,
    out: Linear<'w>,
    n_heads: i64,
}

impl<'w> SelfAttention<'w> {
    fn load(w: &'w Weights, name: &str, n_heads: usize) -> Result<Self> {
        Ok(Self {
            q: Linear::load(w, &format!("{name}.q_proj"))?,
            k: Linear::load(w, &format!("{name}.k_proj"))?,
            v: Linear::load(w, &format!("{name}.v_proj"))?,
            out: Linear::load(w, &format!("{name}.out_proj"))?,
            n_heads: n_heads as i64,
        })
    }

    /// x [C, L, N] -> [C, L, N].
    fn forward<'g>(&self, g: &'g Context, x: Tensor<'_>) -> Tensor<'g> {
        let q = self.q.forward(g, x);
        let k = self.k.forward(g, x);
        let v = self.v.forward(g, x);
        let out = attention(g, q, k, v, self.n_heads);
        self.out.forward(g, out)
    }
}

/// The reference's default (non-flash) attention with a causal mask.
/// q, k, v: [C, L, N] with C = heads * d_head; result [C, L, N].
fn attention<'g>(g: &'g Context, q: Tensor<'_>, k: Tensor<'_>, v: Tensor<'_>, n_heads: i64) -> Tensor<'g> {
    let [c, l, n, _] = q.shape();
    let d = c / n_heads;
    let scale = 1.0f32 / (d as f32).sqrt();

    // [d, heads, L, N] -> [d, L, heads, N] -> [d, L, heads * N]
    let split_heads = |t: Tensor<'_>| -> Tensor<'g> {
        let t = g.reshape(t, &[d, n_heads, l, n]);
        let t = g.cont(g.permute(t, [0, 2, 1, 3]));
        g.reshape(t, &[d, l, n_heads * n])
    };
    let q = split_heads(q);
    let k = split_heads(k);
    // v: [d, heads, L, N] -> [L, d, heads, N] -> [L, d, heads * N]
    let v = g.reshape(v, &[d, n_heads, l, n]);
    let v = g.cont(g.permute(v, [1, 2, 0, 3]));
    let v = g.reshape(v, &[l, d, n_heads * n]);

    let kq = g.mul_mat_prec_f32(k, q); // [L_k, L_q, heads * N]
    let kq = g.scale(kq, scale);
    let kq = g.diag_mask_inf(kq, 0);
    let kq = g.soft_max(kq);

    let kqv = g.mul_mat(v, kq); // [d, L_q, heads * N]
    let kqv = g.reshape(kqv, &[d, l, n_heads, n]);
    let kqv = g.cont(g.permute(kqv, [0, 2, 1, 3])); // [d, heads, L, N]
    g.reshape(kqv, &[c, l, n])
}

/// fc1, activation, fc2.
struct Mlp<'w> {
    fc1: Linear<'w>,
    fc2: Linear<'w>,
    activation: Activation,
}

impl<'w> Mlp<'w> {
    fn load(w: &'w Weights, name: &str, activation: Activation) -> Result<Self> {
        Ok(Self {
            fc1: Linear::load(w, &format!("{name}.fc1"))?,
            fc2: Linear::load(w, &format!("{name}.fc2"))?,
            activation,
        })
    }

    fn forward<'g>(&self, g: &'g Context, x: Tensor<'_>) -> Tensor<'g> {
        let h = self.fc1.forward(g, x);
        let h = match self.activation {
            Activation::QuickGelu => g.gelu_quick(h),
            Activation::GeluTanh => g.gelu(h),
        };
        self.fc2.forward(g, h)
    }
}

/// One pre-norm transformer layer.
struct EncoderLayer<'w> {
    layer_norm1: LayerNorm<'w>,
    self_attn: SelfAttention<'w>,
    layer_norm2: LayerNorm<'w>,
    mlp: Mlp<'w>,
}

impl<'w> EncoderLayer<'w> {
    fn load(w: &'w Weights, cfg: &ClipConfig, i: usize) -> Result<Self> {
        let l = cfg.name(&format!("encoder.layers.{i}"));
        Ok(Self {
            layer_norm1: LayerNorm::load(w, &format!("{l}.layer_norm1"), cfg.layer_norm_eps)?,
            self_attn: SelfAttention::load(w, &format!("{l}.self_attn"), cfg.n_heads)?,
            layer_norm2: LayerNorm::load(w, &format!("{l}.layer_norm2"), cfg.layer_norm_eps)?,
            mlp: Mlp::load(w, &format!("{l}.mlp"), cfg.activation)?,
        })
    }

    fn forward<'g>(&self, g: &'g Context, x: Tensor<'_>) -> Tensor<'g> {
        let x = g.add(x, self.self_attn.forward(g, self.layer_norm1.forward(g, x)));
        g.add(x, self.mlp.forward(g, self.layer_norm2.forward(g, x)))
    }
}

// ---------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------

/// Builds the text transformer's graph: `ids` (i32 `[n_positions, N]`) to the hidden states
/// `[hidden_size, n_positions, N]` after the layer `clip_skip` selects (1 = last), followed by
/// the final LayerNorm when the config has one.
///
/// `cuts` receives `clip_text.prelude` and `clip_text.layers.N` for every layer that runs.
pub fn forward<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &ClipConfig,
    ids: Tensor<'_>,
    clip_skip: usize,
    cuts: &mut Vec<(String, Tensor<'g>)>,
) -> Result<Tensor<'g>> {
    let x = layers(g, w, cfg, ids, clip_skip, cuts)?;
    if cfg.with_final_ln {
        return Ok(LayerNorm::load(w, &cfg.name("final_layer_norm"), cfg.layer_norm_eps)?.forward(g, x));
    }
    Ok(x)
}

/// Builds the pooled output's graph for one sequence: every layer, the final LayerNorm,
/// the hidden state at `token_index`, times `text_projection` (no bias) when the encoder has
/// one: `[projection_dim]`, else `[hidden_size]`.
fn pooled_forward<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &ClipConfig,
    ids: Tensor<'_>,
    token_index: usize,
    cuts: &mut Vec<(String, Tensor<'g>)>,
) -> Result<Tensor<'g>> {
    let n_positions = cfg.n_positions;
    if token_index >= n_positions {
        return Err(ClipError::Pooled { index: token_index, n_positions, why: "the index is outside the sequence" });
    }
    if ids.shape()[1] != 1 {
        return Err(ClipError::Input { ty: sd_backends::type_name(ids.dtype()), shape: ids.shape(), n_positions });
    }
    let x = layers(g, w, cfg, ids, 1, cuts)?;
    let x = LayerNorm::load(w, &cfg.name("final_layer_norm"), cfg.layer_norm_eps)?.forward(g, x);
    let [h, ..] = x.shape();
    let nb = x.nb();
    let row = g.view(x, [h, 1, 1, 1], [nb[1], nb[2], nb[3]], nb[1] * token_index);
    match cfg.projection_dim {
        Some(_) => {
            let name = cfg.name("text_projection");
            w.linear(g, &name, None, row).map_err(|_| ClipError::MissingWeight(name))
        }
        // No projection (CLIP-L, whose pooled state FLUX reads): the state itself.
        None => Ok(g.cont(row)),
    }
}

/// Embeddings and the first `n_layers - clip_skip + 1` layers.
fn layers<'g>(
    g: &'g Context,
    w: &Weights,
    cfg: &ClipConfig,
    ids: Tensor<'_>,
    clip_skip: usize,
    cuts: &mut Vec<(String, Tensor<'g>)>,
) -> Result<Tensor<'g>> {
    cfg.validate()?;
    let shape = ids.shape();
    if ids.dtype() != GgmlType::GGML_TYPE_I32 || shape[0] != cfg.n_positions as i64 || shape[2] != 1 || shape[3] != 1 {
        return Err(ClipError::Input { ty: sd_backends::type_name(ids.dtype()), shape, n_positions: cfg.n_positions });
    }
    if clip_skip == 0 || clip_skip > cfg.n_layers {
        return Err(ClipError::ClipSkip {
            requested: clip_skip as i64,
            layers: cfg.n_layers,
            default: cfg.default_clip_skip,
        });
    }
    let n_run = cfg.n_layers - clip_skip + 1;
    let _span = tracing::trace_span!("clip_text.forward", layers = n_run, sequences = shape[1]).entered();

    let mut x = Embeddings::load(w, cfg)?.forward(g, ids);
    cuts.push(("clip_text.prelude".to_string(), x));
    for i in 0..n_run {
        x = EncoderLayer::load(w, cfg, i)?.forward(g, x);
        cuts.push((format!("clip_text.layers.{i}"), x));
    }
    Ok(x)
}

/// Checks that `weights` holds every parameter of `cfg` with its shape and has storage.
fn check_weights(cfg: &ClipConfig, weights: &Weights) -> Result<()> {
    cfg.validate()?;
    if !weights.is_allocated() {
        return Err(ClipError::NotAllocated);
    }
    match super::first_mismatch(weights, clip_specs(cfg, &|_| None, None)) {
        None => Ok(()),
        Some(super::SpecMismatch::Missing(name)) => Err(ClipError::MissingWeight(name)),
        Some(super::SpecMismatch::Shape { name, expected, got }) => Err(ClipError::WeightShape { name, expected, got }),
    }
}

/// A CLIP text transformer with its weights, ready to encode token ids.
#[derive(Debug)]
pub struct ClipTextModel {
    cfg: ClipConfig,
    weights: Weights,
}

impl ClipTextModel {
    /// Pairs a config with its weights (declared from [`clip_specs`], allocated and loaded).
    /// Every parameter must be present with the architecture's shape.
    pub fn new(cfg: ClipConfig, weights: Weights) -> Result<Self> {
        check_weights(&cfg, &weights)?;
        Ok(Self { cfg, weights })
    }

    /// The configuration.
    pub fn config(&self) -> &ClipConfig {
        &self.cfg
    }

    /// The weights.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The encoder over this model's config and weights.
    pub fn encoder(&self) -> ClipEncoder<'_> {
        ClipEncoder { cfg: &self.cfg, weights: &self.weights }
    }

    /// See [`ClipEncoder::encode_ids`].
    pub fn encode_ids(&self, runner: &mut Runner, ids: &[u32], clip_skip: usize) -> Result<Vec<f32>> {
        self.encoder().encode_ids(runner, ids, clip_skip)
    }

    /// See [`ClipEncoder::encode_each`].
    pub fn encode_each(&self, runner: &mut Runner, sequences: &[&[u32]], clip_skip: usize) -> Result<Vec<Vec<f32>>> {
        self.encoder().encode_each(runner, sequences, clip_skip)
    }

    /// See [`ClipEncoder::encode_pooled`].
    pub fn encode_pooled(&self, runner: &mut Runner, ids: &[u32], token_index: usize) -> Result<Vec<f32>> {
        self.encoder().encode_pooled(runner, ids, token_index)
    }
}

/// A text transformer over borrowed weights: several encoders can share one weight set
/// (SDXL's two encoders are one `te` module). Build it with [`ClipEncoder::new`], which checks
/// the weights, or [`ClipTextModel::encoder`].
#[derive(Clone, Copy, Debug)]
pub struct ClipEncoder<'a> {
    cfg: &'a ClipConfig,
    weights: &'a Weights,
}

/// What one graph of the encoder returns.
#[derive(Clone, Copy)]
enum Output {
    /// Hidden states at a clip skip.
    Hidden(usize),
    /// The pooled, projected state at a token index.
    Pooled(usize),
}

impl<'a> ClipEncoder<'a> {
    /// An encoder for `cfg` over `weights`, which must hold every parameter of `cfg` (and
    /// may hold others).
    pub fn new(cfg: &'a ClipConfig, weights: &'a Weights) -> Result<Self> {
        check_weights(cfg, weights)?;
        Ok(Self { cfg, weights })
    }

    /// The configuration.
    pub fn config(&self) -> &'a ClipConfig {
        self.cfg
    }

    /// Encodes `ids` (N sequences of `n_positions` ids, one after another) in one graph and
    /// returns the hidden states, `hidden_size` values per token, tokens in order: the raw
    /// encoder output, before any prompt weighting. This is the component the parity harness
    /// compares with the reference's text-encoder output.
    pub fn encode_ids(&self, runner: &mut Runner, ids: &[u32], clip_skip: usize) -> Result<Vec<f32>> {
        let len = self.cfg.n_positions;
        if ids.is_empty() || !ids.len().is_multiple_of(len) {
            return Err(ClipError::IdsLength { got: ids.len(), n_positions: len });
        }
        let mut out = self.run(runner, ids.len() / len, &[ids], Output::Hidden(clip_skip))?;
        Ok(out.remove(0))
    }

    /// Encodes each sequence of `n_positions` ids in its own run of one shared single-sequence
    /// graph, as the reference encodes prompt chunks.
    pub fn encode_each(&self, runner: &mut Runner, sequences: &[&[u32]], clip_skip: usize) -> Result<Vec<Vec<f32>>> {
        let len = self.cfg.n_positions;
        if let Some(bad) = sequences.iter().find(|s| s.len() != len) {
            return Err(ClipError::IdsLength { got: bad.len(), n_positions: len });
        }
        if sequences.is_empty() {
            return Ok(Vec::new());
        }
        self.run(runner, 1, sequences, Output::Hidden(clip_skip))
    }

    /// The pooled output of one sequence of `n_positions` ids (`pooled_forward`):
    /// `projection_dim` values, or `hidden_size` for an encoder without a projection.
    pub fn encode_pooled(&self, runner: &mut Runner, ids: &[u32], token_index: usize) -> Result<Vec<f32>> {
        let len = self.cfg.n_positions;
        if ids.len() != len {
            return Err(ClipError::IdsLength { got: ids.len(), n_positions: len });
        }
        let mut out = self.run(runner, 1, &[ids], Output::Pooled(token_index))?;
        Ok(out.remove(0))
    }

    /// Builds one graph for `batch` sequences and runs it once per input.
    fn run(&self, runner: &mut Runner, batch: usize, inputs: &[&[u32]], what: Output) -> Result<Vec<Vec<f32>>> {
        let cfg = self.cfg;
        let converted: Vec<Vec<i32>> = inputs.iter().map(|ids| self.check_ids(ids)).collect::<Result<_>>()?;

        let graph_size = 64 * (cfg.n_layers + 2);
        let mut results = Vec::with_capacity(converted.len());
        for input in &converted {
            let g = Context::for_graph(2 * graph_size, graph_size).map_err(ClipError::Backend)?;
            let ids = g
                .new_tensor(GgmlType::GGML_TYPE_I32, &[cfg.n_positions as i64, batch as i64])
                .set_name("clip_ids")
                .set_input();
            let mut cuts = Vec::new();
            let out = match what {
                Output::Hidden(clip_skip) => forward(&g, self.weights, cfg, ids, clip_skip, &mut cuts)?,
                Output::Pooled(index) => pooled_forward(&g, self.weights, cfg, ids, index, &mut cuts)?,
            }
            .set_output();
            if cuts.last().is_some_and(|(_, t)| *t == out) {
                cuts.pop();
            }
            // Whole or in segments at the layer cuts, staging weights as their home requires.
            runner.run(self.weights, &g, graph_size, &cuts, out, &mut || {
                ids.set_i32(input)?;
                Ok(())
            })?;
            results.push(out.get_f32()?);
        }
        Ok(results)
    }

    fn check_ids(&self, ids: &[u32]) -> Result<Vec<i32>> {
        let vocab = self.cfg.vocab_size;
        ids.iter()
            .enumerate()
            .map(
                |(position, &id)| {
                    if (id as usize) < vocab {
                        Ok(id as i32)
                    } else {
                        Err(ClipError::TokenId { id, position, vocab })
                    }
                },
            )
            .collect()
    }
}

/// Shared by the text-encoder tests: a CPU backend, deterministic random weights, and a plain
/// f64 implementation of the transformer to check the graph against.
#[cfg(test)]
pub(crate) mod test_support {
    use std::borrow::Cow;
    use std::sync::{Arc, OnceLock};

    use sd_backends::{convert::pack_f32, Backend, GgmlType, PluginRegistry, PluginSearch};
    use sd_sched::{SourceError, TensorSource, TensorSpec, Weights};

    use super::{clip_specs, Activation, ClipConfig, ClipTextModel};

    /// A 2-thread CPU backend from the plugins ggml-sys built.
    pub fn backend() -> Arc<Backend> {
        static REGISTRY: OnceLock<PluginRegistry> = OnceLock::new();
        let reg = REGISTRY.get_or_init(|| {
            PluginRegistry::discover(&PluginSearch { use_install_dir: true, ..PluginSearch::default() })
        });
        let backend = Backend::new(reg.device("cpu").expect("the CPU plugin is built with ggml-sys")).unwrap();
        backend.set_threads(2);
        Arc::new(backend)
    }

    /// A small config with the real vocabulary and context length, so real prompts fit.
    pub fn tiny(activation: Activation, default_clip_skip: usize, pad_id: u32) -> ClipConfig {
        ClipConfig {
            hidden_size: 32,
            intermediate_size: 64,
            n_heads: 4,
            n_layers: 3,
            activation,
            default_clip_skip,
            pad_id,
            ..ClipConfig::vit_l14()
        }
    }

    /// Deterministic values uniform in [-1, 1), seeded by `basis` and the tensor's name: the
    /// random weights of the graph tests (each family scales them by its own rule).
    pub fn seeded_uniform(basis: u64, name: &str, n: usize) -> Vec<f32> {
        let mut s = basis;
        for b in name.bytes() {
            s = (s ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        s |= 1;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            out.push((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0);
        }
        out
    }

    /// A tensor source serving `values(name, ne)` in whatever type the weight set asks for.
    pub struct ValuesSource(pub fn(&str, &[i64]) -> Vec<f32>);

    impl TensorSource for ValuesSource {
        fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
            pack_f32(ty, &(self.0)(name, ne), ne[0]).map(Cow::Owned).map_err(SourceError::new)
        }
    }

    /// The weight set of `specs` in [`backend`]'s CPU memory, filled from `values`.
    pub fn random_weights(specs: Vec<TensorSpec>, values: fn(&str, &[i64]) -> Vec<f32>) -> Weights {
        let mut w = Weights::new(specs).unwrap();
        w.allocate(backend().device().buffer_type()).unwrap();
        w.load_from(&ValuesSource(values)).unwrap();
        w
    }

    /// Values of a parameter: linear weights with variance 1/fan_in (half that scale on the
    /// layers closing a residual branch), norm gains 1 +- 0.1, small biases and embeddings.
    pub fn values(name: &str, ne: &[i64]) -> Vec<f32> {
        let n = ne.iter().product::<i64>() as usize;
        let (scale, offset) = if name.ends_with("norm1.weight")
            || name.ends_with("norm2.weight")
            || name.ends_with("final_layer_norm.weight")
        {
            (0.1, 1.0)
        } else if name.ends_with(".bias") {
            (0.05, 0.0)
        } else if name.contains("token_embedding") {
            (0.5, 0.0)
        } else if name.contains("position_embedding") {
            (0.1, 0.0)
        } else {
            let gain = if name.contains("out_proj") || name.contains("fc2") { 0.5 } else { 1.0 };
            (gain * (3.0 / ne[0] as f32).sqrt(), 0.0)
        };
        let mut v = seeded_uniform(0xcbf2_9ce4_8422_2325, name, n);
        for x in &mut v {
            *x = *x * scale + offset;
        }
        v
    }

    /// Serves [`values`] in whatever type the weight set asks for.
    pub const RANDOM: ValuesSource = ValuesSource(values);

    /// A model whose file stores every tensor as `file_type`, with random weights.
    pub fn model(cfg: &ClipConfig, file_type: GgmlType, backend: &Backend) -> ClipTextModel {
        let mut w = Weights::new(clip_specs(cfg, &|_| Some(file_type), None)).unwrap();
        w.allocate(backend.device().buffer_type()).unwrap();
        w.load_from(&RANDOM).unwrap();
        ClipTextModel::new(cfg.clone(), w).unwrap()
    }

    // --- the f64 reference -------------------------------------------------------------

    type Rows = Vec<Vec<f64>>;

    fn f16_round(x: f64) -> f64 {
        half::f16::from_f64(x).to_f64()
    }

    /// ggml's CPU activations read a table indexed by the input rounded to f16 and return
    /// the f16-rounded function value; GELU passes |x| >= 10 through the exact limits.
    pub(crate) fn activation(kind: Activation, x: f64) -> f64 {
        match kind {
            Activation::QuickGelu => {
                let x = f16_round(x);
                f16_round(x / (1.0 + (-1.702 * x).exp()))
            }
            Activation::GeluTanh if x <= -10.0 => 0.0,
            Activation::GeluTanh if x >= 10.0 => x,
            Activation::GeluTanh => {
                let x = f16_round(x);
                let inner = (2.0 / std::f64::consts::PI).sqrt() * x * (1.0 + 0.044715 * x * x);
                f16_round(0.5 * x * (1.0 + inner.tanh()))
            }
        }
    }

    fn layer_norm(x: &Rows, w: &[f64], b: &[f64], eps: f64) -> Rows {
        x.iter()
            .map(|row| {
                let n = row.len() as f64;
                let mean = row.iter().sum::<f64>() / n;
                let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
                let inv = 1.0 / (var + eps).sqrt();
                row.iter().enumerate().map(|(c, v)| (v - mean) * inv * w[c] + b[c]).collect()
            })
            .collect()
    }

    /// `w` stored as PyTorch [out][in].
    fn linear(x: &Rows, w: &[f64], b: &[f64]) -> Rows {
        let out = b.len();
        x.iter()
            .map(|row| {
                let inp = row.len();
                (0..out).map(|o| (0..inp).map(|i| w[o * inp + i] * row[i]).sum::<f64>() + b[o]).collect()
            })
            .collect()
    }

    fn causal_attention(q: &Rows, k: &Rows, v: &Rows, heads: usize) -> Rows {
        let (l, c) = (q.len(), q[0].len());
        let d = c / heads;
        let scale = 1.0 / (d as f64).sqrt();
        let mut out = vec![vec![0.0; c]; l];
        for h in 0..heads {
            let r = h * d..(h + 1) * d;
            for tq in 0..l {
                let scores: Vec<f64> = (0..=tq)
                    .map(|tk| q[tq][r.clone()].iter().zip(&k[tk][r.clone()]).map(|(a, b)| a * b).sum::<f64>() * scale)
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for (tk, p) in e.iter().enumerate() {
                    for j in r.clone() {
                        out[tq][j] += p / z * v[tk][j];
                    }
                }
            }
        }
        out
    }

    fn add(a: &Rows, b: &Rows) -> Rows {
        a.iter().zip(b).map(|(x, y)| x.iter().zip(y).map(|(p, q)| p + q).collect()).collect()
    }

    /// The text transformer in f64 on the weights [`values`] gives: hidden states of each
    /// sequence of `ids`, token-major like the graph's output.
    pub(crate) fn reference_encode(cfg: &ClipConfig, ids: &[u32], clip_skip: usize) -> Vec<f64> {
        ids.chunks(cfg.n_positions)
            .flat_map(|seq| reference_rows(cfg, seq, cfg.n_layers - clip_skip + 1, cfg.with_final_ln))
            .flatten()
            .collect()
    }

    /// The pooled output in f64: all layers, final LayerNorm, the row at `index`, times
    /// `text_projection` (stored [in = hidden][out = projection] in ggml order, i.e. torch
    /// `[projection][hidden]`).
    pub(crate) fn reference_pooled(cfg: &ClipConfig, ids: &[u32], index: usize) -> Vec<f64> {
        let rows = reference_rows(cfg, ids, cfg.n_layers, true);
        let (h, p) = (cfg.hidden_size, cfg.projection_dim.unwrap());
        let name = format!("{}.text_projection", cfg.prefix);
        let w: Vec<f64> = values(&name, &[h as i64, p as i64]).into_iter().map(f64::from).collect();
        (0..p).map(|o| (0..h).map(|i| w[o * h + i] * rows[index][i]).sum()).collect()
    }

    /// One sequence through `n_run` layers, then the final LayerNorm when `final_ln`.
    fn reference_rows(cfg: &ClipConfig, seq: &[u32], n_run: usize, final_ln: bool) -> Rows {
        let specs = clip_specs(cfg, &|_| None, None);
        let p = |suffix: &str| -> Vec<f64> {
            let name = format!("{}.{suffix}", cfg.prefix);
            let spec = specs.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no {name}"));
            values(&name, &spec.ne).into_iter().map(f64::from).collect()
        };
        let eps = cfg.layer_norm_eps as f64;
        let h = cfg.hidden_size;
        let (tok, pos) = (p("embeddings.token_embedding.weight"), p("embeddings.position_embedding.weight"));
        let mut x: Rows = seq
            .iter()
            .enumerate()
            .map(|(t, &id)| (0..h).map(|c| tok[id as usize * h + c] + pos[t * h + c]).collect())
            .collect();
        for i in 0..n_run {
            let l = |s: &str| p(&format!("encoder.layers.{i}.{s}"));
            let a = layer_norm(&x, &l("layer_norm1.weight"), &l("layer_norm1.bias"), eps);
            let proj = |name: &str, t: &Rows| {
                linear(t, &l(&format!("self_attn.{name}.weight")), &l(&format!("self_attn.{name}.bias")))
            };
            let attn = causal_attention(&proj("q_proj", &a), &proj("k_proj", &a), &proj("v_proj", &a), cfg.n_heads);
            x = add(&x, &proj("out_proj", &attn));
            let m = layer_norm(&x, &l("layer_norm2.weight"), &l("layer_norm2.bias"), eps);
            let mut m = linear(&m, &l("mlp.fc1.weight"), &l("mlp.fc1.bias"));
            m.iter_mut().flatten().for_each(|v| *v = activation(cfg.activation, *v));
            x = add(&x, &linear(&m, &l("mlp.fc2.weight"), &l("mlp.fc2.bias")));
        }
        if final_ln {
            x = layer_norm(&x, &p("final_layer_norm.weight"), &p("final_layer_norm.bias"), eps);
        }
        x
    }

    /// (max, mean) absolute difference.
    pub fn diff(got: &[f32], want: &[f64]) -> (f64, f64) {
        assert_eq!(got.len(), want.len());
        let d: Vec<f64> = got.iter().zip(want).map(|(g, w)| (*g as f64 - w).abs()).collect();
        (d.iter().cloned().fold(0.0, f64::max), d.iter().sum::<f64>() / d.len() as f64)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use sd_backends::GgmlType;
    use sd_sched::{Runner, Weights};

    use super::test_support::*;
    use super::*;
    use crate::files::names::{normalize, FileRole, Normalized};
    use crate::fixture::{tensor_table, Architecture, Component, Prediction};

    const F32: GgmlType = GgmlType::GGML_TYPE_F32;
    const F16: GgmlType = GgmlType::GGML_TYPE_F16;

    fn count(specs: &[TensorSpec]) -> i64 {
        specs.iter().map(|s| s.ne.iter().product::<i64>()).sum()
    }

    #[test]
    fn clip_l_text_model_has_the_published_parameter_count() {
        // OpenAI CLIP ViT-L/14 text tower (HF CLIPTextModel, `openai/clip-vit-large-patch14`):
        // 123,060,480 parameters.
        assert_eq!(count(&clip_specs(&ClipConfig::vit_l14(), &|_| None, None)), 123_060_480);
    }

    #[test]
    fn open_clip_h_text_model_has_what_the_reference_loads() {
        // The reference's modules for OPEN_CLIP_VIT_H_14 (no text_projection, which it creates
        // only for bigG): token + position embeddings, 24 layers of q/k/v/out (1024x1024 + bias),
        // two LayerNorms, fc1 1024->4096, fc2 4096->1024, and the final LayerNorm.
        let (d, m) = (1024i64, 4096i64);
        let layer = 4 * (d * d + d) + 2 * 2 * d + (d * m + m) + (m * d + d);
        let want = (49408 + 77) * d + 24 * layer + 2 * d;
        assert_eq!(want, 352_984_064);
        // open_clip's ViT-H-14 text tower with its projection (1024x1024) is 354,032,640.
        assert_eq!(want + d * d, 354_032_640);
        assert_eq!(count(&clip_specs(&ClipConfig::vit_h14(), &|_| None, None)), want);
    }

    #[test]
    fn open_clip_bigg_text_model_has_the_published_parameter_count() {
        // HF CLIPTextModelWithProjection for `laion/CLIP-ViT-bigG-14-laion2B-39B-b160k` (SDXL's
        // `text_encoder_2`): 694,659,840 parameters, the projection (1280x1280, no bias)
        // included. All of it is what the reference loads for OPEN_CLIP_VIT_BIGG_14.
        let cfg = ClipConfig::vit_bigg14();
        let specs = clip_specs(&cfg, &|_| None, None);
        assert_eq!(count(&specs), 694_659_840);
        let proj = specs.iter().find(|s| s.name.ends_with(".text_projection")).unwrap();
        assert_eq!(proj.name, "cond_stage_model.1.transformer.text_model.text_projection");
        assert_eq!((proj.ty, proj.ne.clone()), (F32, vec![1280, 1280]));
        // Stored f32 even when the file has f16 and --type asks for q8_0.
        let specs = clip_specs(&cfg, &|_| Some(F16), Some(GgmlType::GGML_TYPE_Q8_0));
        assert_eq!(specs.iter().find(|s| s.name == proj.name).unwrap().ty, F32);
        // SDXL's ViT-L is SD 1.x's without the final norm, penultimate by default.
        let l = ClipConfig::vit_l14_sdxl();
        assert_eq!(count(&clip_specs(&l, &|_| None, None)), 123_060_480);
        assert!(!l.with_final_ln && l.resolve_clip_skip(0).unwrap() == 2 && l.resolve_clip_skip(1).unwrap() == 1);
        assert_eq!(cfg.resolve_clip_skip(-1).unwrap(), 2);
        assert_eq!(cfg.resolve_clip_skip(1).unwrap(), 1, "bigG's last layer is loaded (the pooled output needs it)");
    }

    /// A tiny encoder with a projection, as bigG is.
    fn tiny_projected() -> ClipConfig {
        ClipConfig {
            prefix: TEXT_MODEL2_PREFIX,
            with_final_ln: false,
            projection_dim: Some(32),
            ..tiny(Activation::GeluTanh, 2, 0)
        }
    }

    #[test]
    fn pooled_output_matches_an_f64_transformer() {
        let backend = backend();
        let mut runner = Runner::new("clip", backend.clone());
        let cfg = tiny_projected();
        let model = model(&cfg, F32, &backend);
        let ids: Vec<u32> = (0..77u32).map(|i| (i * 7919 + 13) % 49408).collect();
        for index in [0, 5, 76] {
            let got = model.encode_pooled(&mut runner, &ids, index).unwrap();
            assert_eq!(got.len(), 32);
            let want = reference_pooled(&cfg, &ids, index);
            let (max, mean) = diff(&got, &want);
            assert!(max < 2e-3 && mean < 2e-4, "index {index}: max {max:e}, mean {mean:e}");
        }
        // The pooled state runs every layer and the final norm, unlike the hidden states of
        // this config (penultimate, no norm): it is not a projection of those.
        let last = reference_rows_for_test(&cfg, &ids);
        let hidden = model.encode_ids(&mut runner, &ids, 2).unwrap();
        assert!(diff(&hidden[5 * 32..6 * 32], &last[5 * 32..6 * 32]).0 > 1e-2);
        // Causal: the pooled state at a token ignores every later token.
        let mut later = ids.clone();
        later[40] = 7;
        assert_eq!(
            model.encode_pooled(&mut runner, &ids, 5).unwrap(),
            model.encode_pooled(&mut runner, &later, 5).unwrap()
        );
    }

    /// Hidden states after every layer and the final norm (what pooling reads).
    fn reference_rows_for_test(cfg: &ClipConfig, ids: &[u32]) -> Vec<f64> {
        let full = ClipConfig { with_final_ln: true, ..cfg.clone() };
        reference_encode(&full, ids, 1)
    }

    #[test]
    fn pooled_output_errors_are_clear() {
        let backend = backend();
        let mut runner = Runner::new("clip", backend.clone());
        let cfg = tiny_projected();
        let model = model(&cfg, F32, &backend);
        let ids = vec![EOS_ID; 77];
        let e = model.encode_pooled(&mut runner, &ids, 77).unwrap_err();
        assert!(matches!(e, ClipError::Pooled { index: 77, n_positions: 77, .. }), "{e}");
        assert!(matches!(model.encode_pooled(&mut runner, &ids[..76], 3), Err(ClipError::IdsLength { got: 76, .. })));
        // Without a projection the pooled output is the normed state itself (FLUX's CLIP-L).
        let plain_cfg = tiny(Activation::QuickGelu, 1, EOS_ID);
        let plain = super::test_support::model(&plain_cfg, F32, &backend);
        let mut prompt = vec![EOS_ID; 77];
        prompt[0] = crate::text::BOS_ID;
        prompt[1..5].copy_from_slice(&[320, 1125, 539, 320]);
        let got = plain.encode_pooled(&mut runner, &prompt, 5).unwrap();
        let want = reference_rows_for_test(&plain_cfg, &prompt);
        assert_eq!(got.len(), 32);
        let (max, mean) = diff(&got, &want[5 * 32..6 * 32]);
        assert!(max < 2e-3 && mean < 2e-4, "max {max:e}, mean {mean:e}");
        // A weight set without the projection is refused when the encoder is built.
        let mut specs = clip_specs(&cfg, &|_| None, None);
        specs.retain(|s| !s.name.ends_with("text_projection"));
        let mut w = Weights::new(specs).unwrap();
        w.allocate(backend.device().buffer_type()).unwrap();
        match ClipEncoder::new(&cfg, &w) {
            Err(ClipError::MissingWeight(n)) => assert!(n.ends_with(".text_projection"), "{n}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(ClipConfig { projection_dim: Some(0), ..cfg }.validate(), Err(ClipError::Config(_))));
    }

    /// Internal name -> ggml shape of the fixture's text encoder `which`, through the file
    /// reader's name normalisation, keeping what the reference loads (the projection only
    /// for bigG).
    fn fixture_layout(arch: Architecture, which: u8) -> BTreeMap<String, Vec<i64>> {
        let keep_projection = which == 1;
        let mut out = BTreeMap::new();
        for t in tensor_table(&arch.only(&[Component::TextEncoder(which)])).unwrap() {
            let mut ne: Vec<i64> = t.shape.iter().rev().map(|&n| n as i64).collect();
            match normalize(&t.name, FileRole::Checkpoint) {
                Normalized::One(name) => {
                    if (keep_projection || !name.ends_with("text_projection")) && !name.ends_with("logit_scale") {
                        out.insert(name, ne);
                    }
                }
                Normalized::Split(names) => {
                    *ne.last_mut().unwrap() /= 3;
                    for name in names {
                        out.insert(name, ne.clone());
                    }
                }
            }
        }
        out
    }

    #[test]
    fn specs_match_the_checkpoint_layout_of_both_families() {
        for (cfg, arch, which) in [
            (ClipConfig::vit_l14(), Architecture::sd15(), 0),
            (ClipConfig::vit_h14(), Architecture::sd2(Prediction::V), 0),
            (ClipConfig::vit_l14_sdxl(), Architecture::sdxl(), 0),
            (ClipConfig::vit_bigg14(), Architecture::sdxl(), 1),
        ] {
            let ours: BTreeMap<String, Vec<i64>> =
                clip_specs(&cfg, &|_| None, None).into_iter().map(|s| (s.name, s.ne)).collect();
            assert_eq!(ours, fixture_layout(arch, which), "{cfg:?}");
        }
    }

    #[test]
    fn storage_types_follow_the_reference_rules() {
        use GgmlType as T;
        let p = TEXT_MODEL_PREFIX;
        let tok = format!("{p}.embeddings.token_embedding.weight");
        let pos = format!("{p}.embeddings.position_embedding.weight");
        let q = format!("{p}.encoder.layers.0.self_attn.q_proj.weight");
        let qb = format!("{p}.encoder.layers.0.self_attn.q_proj.bias");
        let ln = format!("{p}.encoder.layers.0.layer_norm1.weight");
        let fc2 = format!("{p}.encoder.layers.0.mlp.fc2.weight");
        // (file type, --type, config, expected [token, position, q weight, q bias, ln, fc2])
        // Rules: clip.hpp CLIPEmbeddings / ggml_extend.hpp Linear, LayerNorm, support_get_rows;
        // model_loader.cpp tensor_should_be_converted.
        type Case = (T, Option<T>, ClipConfig, [T; 6], &'static str);
        let cases: Vec<Case> = vec![
            (
                T::GGML_TYPE_F16,
                None,
                ClipConfig::vit_l14(),
                [T::GGML_TYPE_F16, F32, T::GGML_TYPE_F16, F32, F32, T::GGML_TYPE_F16],
                "f16 file",
            ),
            (F32, None, ClipConfig::vit_l14(), [F32; 6], "f32 file"),
            (
                T::GGML_TYPE_F16,
                Some(T::GGML_TYPE_Q8_0),
                ClipConfig::vit_h14(),
                [T::GGML_TYPE_F16, F32, T::GGML_TYPE_Q8_0, F32, F32, T::GGML_TYPE_Q8_0],
                "--type converts linear weights, never embeddings or biases",
            ),
            (
                T::GGML_TYPE_BF16,
                None,
                ClipConfig::vit_l14(),
                [F32, F32, T::GGML_TYPE_BF16, F32, F32, T::GGML_TYPE_BF16],
                "bf16 token table cannot be gathered: widened to f32",
            ),
            (
                T::GGML_TYPE_Q4_K,
                None,
                ClipConfig::vit_l14(),
                [F32, F32, T::GGML_TYPE_Q4_K, F32, F32, T::GGML_TYPE_Q4_K],
                "q4_K: 768 and 3072 are multiples of 256; token table widened",
            ),
            (
                T::GGML_TYPE_Q4_K,
                None,
                tiny(Activation::QuickGelu, 1, EOS_ID),
                [F32; 6],
                "q4_K rows of 32/64 do not fit 256-blocks: f32",
            ),
            (
                T::GGML_TYPE_F16,
                Some(T::GGML_TYPE_Q4_K),
                tiny(Activation::QuickGelu, 1, EOS_ID),
                [T::GGML_TYPE_F16, F32, T::GGML_TYPE_F16, F32, F32, T::GGML_TYPE_F16],
                "--type skips tensors whose rows do not fit its blocks",
            ),
            (
                T::GGML_TYPE_Q8_0,
                None,
                ClipConfig::vit_l14(),
                [T::GGML_TYPE_Q8_0, F32, T::GGML_TYPE_Q8_0, F32, F32, T::GGML_TYPE_Q8_0],
                "q8_0 token table is gathered as is",
            ),
        ];
        for (file, wtype, cfg, want, why) in cases {
            let specs = clip_specs(&cfg, &|_| Some(file), wtype);
            let ty = |n: &str| specs.iter().find(|s| s.name == n).unwrap().ty;
            let got = [ty(&tok), ty(&pos), ty(&q), ty(&qb), ty(&ln), ty(&fc2)];
            assert_eq!(got, want, "{why}");
        }
        // A tensor the file lacks is declared f32 (the reference's default type).
        let specs = clip_specs(&ClipConfig::vit_l14(), &|n| (n != q).then_some(T::GGML_TYPE_F16), None);
        assert_eq!(specs.iter().find(|s| s.name == q).unwrap().ty, F32);
    }

    #[test]
    fn graph_matches_an_f64_transformer() {
        let backend = backend();
        let mut runner = Runner::new("clip", backend.clone());
        let ids: Vec<u32> = (0..2 * 77u32).map(|i| (i * 7919 + 13) % 49408).collect();
        for (activation, with_final_ln, clip_skip) in [
            (Activation::QuickGelu, true, 1),
            (Activation::GeluTanh, true, 2),
            (Activation::QuickGelu, false, 2),
            (Activation::GeluTanh, true, 3),
        ] {
            let cfg = ClipConfig { with_final_ln, ..tiny(activation, 1, EOS_ID) };
            let model = model(&cfg, F32, &backend);
            let got = model.encode_ids(&mut runner, &ids, clip_skip).unwrap();
            let want = reference_encode(&cfg, &ids, clip_skip);
            let (max, mean) = diff(&got, &want);
            // f32 accumulation against f64; the activation tables are emulated, so only inputs
            // within an f32 rounding of an f16 rounding boundary can differ by one f16 step.
            assert!(
                max < 2e-3 && mean < 2e-5,
                "{activation:?} final_ln={with_final_ln} skip={clip_skip}: max {max:e}, mean {mean:e}"
            );
        }
    }

    #[test]
    fn clip_skip_and_final_norm_select_the_right_hidden_state() {
        // Without the final norm, clip skip N returns the residual stream after layer
        // n_layers - N: encoding with N on a model equals encoding with 1 on the same model cut
        // to that many layers.
        let backend = backend();
        let mut runner = Runner::new("clip", backend.clone());
        let cfg = ClipConfig { with_final_ln: false, ..tiny(Activation::QuickGelu, 1, EOS_ID) };
        let ids: Vec<u32> = (0..77u32).map(|i| i * 31 + 5).collect();
        let full = model(&cfg, F32, &backend);
        let cut_cfg = ClipConfig { n_layers: 2, ..cfg.clone() };
        let cut = model(&cut_cfg, F32, &backend);
        let a = full.encode_ids(&mut runner, &ids, 2).unwrap();
        let b = cut.encode_ids(&mut runner, &ids, 1).unwrap();
        assert_eq!(a, b);
        let last = full.encode_ids(&mut runner, &ids, 1).unwrap();
        assert!(
            diff(&last, &a.iter().map(|&v| v as f64).collect::<Vec<_>>()).0 > 1e-3,
            "the last layer changes the output"
        );
    }

    #[test]
    fn batched_and_per_sequence_runs_agree() {
        let backend = backend();
        let mut runner = Runner::new("clip", backend.clone());
        let cfg = tiny(Activation::GeluTanh, 2, 0);
        let model = model(&cfg, F16, &backend);
        let ids: Vec<u32> = (0..2 * 77u32).map(|i| (i * 104_729) % 49408).collect();
        let batched = model.encode_ids(&mut runner, &ids, 2).unwrap();
        let each = model.encode_each(&mut runner, &[&ids[..77], &ids[77..]], 2).unwrap();
        assert_eq!(each.len(), 2);
        let joined: Vec<f64> = each.concat().into_iter().map(f64::from).collect();
        assert!(diff(&batched, &joined).0 < 1e-5);
        // A causal encoder: changing the last token leaves every earlier position untouched.
        let mut changed = ids[..77].to_vec();
        changed[76] = 1234;
        let again = model.encode_ids(&mut runner, &changed, 2).unwrap();
        let h = cfg.hidden_size;
        assert_eq!(again[..76 * h], each[0][..76 * h]);
        assert_ne!(again[76 * h..], each[0][76 * h..]);
    }

    #[test]
    fn bad_input_is_an_error_not_a_crash() {
        let backend = backend();
        let mut runner = Runner::new("clip", backend.clone());
        let cfg = tiny(Activation::QuickGelu, 1, EOS_ID);
        let model = model(&cfg, F32, &backend);
        let mut ids = vec![EOS_ID; 77];
        ids[3] = 49408;
        match model.encode_ids(&mut runner, &ids, 1) {
            Err(ClipError::TokenId { id: 49408, position: 3, vocab: 49408 }) => {}
            other => panic!("{other:?}"),
        }
        assert!(matches!(model.encode_ids(&mut runner, &[1; 76], 1), Err(ClipError::IdsLength { got: 76, .. })));
        assert!(matches!(model.encode_ids(&mut runner, &[], 1), Err(ClipError::IdsLength { got: 0, .. })));
        assert!(matches!(
            model.encode_ids(&mut runner, &[1; 77], 4),
            Err(ClipError::ClipSkip { requested: 4, layers: 3, .. })
        ));
        assert!(matches!(model.encode_ids(&mut runner, &[1; 77], 0), Err(ClipError::ClipSkip { .. })));

        assert_eq!(cfg.resolve_clip_skip(-1).unwrap(), 1);
        assert_eq!(cfg.resolve_clip_skip(0).unwrap(), 1);
        assert_eq!(ClipConfig::vit_h14().resolve_clip_skip(-1).unwrap(), 2);
        assert_eq!(ClipConfig::vit_h14().resolve_clip_skip(24).unwrap(), 24);
        // The reference never computes ViT-H's last layer: --clip-skip 1 is 2 there.
        assert_eq!(ClipConfig::vit_h14().resolve_clip_skip(1).unwrap(), 2);
        assert_eq!(ClipConfig::vit_l14().resolve_clip_skip(1).unwrap(), 1);
        let e = ClipConfig::vit_h14().resolve_clip_skip(25).unwrap_err();
        assert!(e.to_string().contains("clip skip 25") && e.to_string().contains("1 to 24"), "{e}");

        // Weight sets that do not fit the architecture.
        let mut specs = clip_specs(&cfg, &|_| None, None);
        let gone = specs.remove(5).name;
        let mut w = Weights::new(specs).unwrap();
        w.allocate(backend.device().buffer_type()).unwrap();
        match ClipTextModel::new(cfg.clone(), w) {
            Err(ClipError::MissingWeight(n)) => assert_eq!(n, gone),
            other => panic!("{other:?}"),
        }
        let mut specs = clip_specs(&cfg, &|_| None, None);
        specs[0].ne = vec![32, 1000];
        let mut w = Weights::new(specs).unwrap();
        w.allocate(backend.device().buffer_type()).unwrap();
        assert!(matches!(ClipTextModel::new(cfg.clone(), w), Err(ClipError::WeightShape { .. })));
        let w = Weights::new(clip_specs(&cfg, &|_| None, None)).unwrap();
        assert!(matches!(ClipTextModel::new(cfg.clone(), w), Err(ClipError::NotAllocated)));
        let odd = ClipConfig { n_heads: 5, ..cfg.clone() };
        assert!(matches!(odd.validate(), Err(ClipError::Config(_))));
    }

    #[test]
    fn real_sizes_run_with_f16_weights() {
        // SD 1.5's CLIP ViT-L/14 and SD 2.1's OpenCLIP ViT-H/14 at full size, random f16 weights.
        let backend = backend();
        let mut runner = Runner::new("clip", backend.clone());
        let ids: Vec<u32> =
            [BOS_ID_FOR_TEST, 320, 2368, 539, 49407].iter().copied().chain(std::iter::repeat_n(49407, 72)).collect();
        for cfg in [ClipConfig::vit_l14(), ClipConfig::vit_h14()] {
            let model = model(&cfg, F16, &backend);
            let mut cuts = Vec::new();
            let g = Context::for_graph(8192, 4096).unwrap();
            let t = g.new_tensor(GgmlType::GGML_TYPE_I32, &[77, 1]).set_input();
            let out = forward(&g, model.weights(), &cfg, t, cfg.default_clip_skip, &mut cuts).unwrap();
            assert_eq!(out.shape(), [cfg.hidden_size as i64, 77, 1, 1]);
            assert_eq!(cuts.len(), 1 + cfg.n_layers - cfg.default_clip_skip + 1);
            assert_eq!(cuts.last().unwrap().0, format!("clip_text.layers.{}", cfg.n_layers - cfg.default_clip_skip));
            drop(g);

            let got = model.encode_ids(&mut runner, &ids, cfg.default_clip_skip).unwrap();
            assert_eq!(got.len(), cfg.hidden_size * 77);
            assert!(got.iter().all(|v| v.is_finite()), "{cfg:?}");
            // After the final LayerNorm every token has spread (gain ~1): not collapsed, not blown up.
            for token in got.chunks(cfg.hidden_size) {
                let mean = token.iter().map(|&v| v as f64).sum::<f64>() / token.len() as f64;
                let var = token.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / token.len() as f64;
                assert!((0.5..2.0).contains(&var), "per-token variance {var}");
            }
        }
    }

    const BOS_ID_FOR_TEST: u32 = crate::text::BOS_ID;
}
