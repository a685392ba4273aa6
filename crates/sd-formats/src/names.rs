//! Tensor-name normalization: every file layout is mapped to ONE internal naming.
//!
//! The internal naming is the one stable-diffusion.cpp uses after its own conversion
//! (stable-diffusion.cpp's `name_conversion.cpp`), i.e. the original LDM single-file names with HF-CLIP text
//! encoders. For SD 1.x / 2.x:
//!
//! | component      | internal prefix                                   | body                       |
//! |----------------|---------------------------------------------------|----------------------------|
//! | UNet           | `model.diffusion_model.`                          | LDM (`input_blocks.N.M.…`) |
//! | VAE            | `first_stage_model.`                              | LDM (`encoder.down.N.…`)   |
//! | text encoder   | `cond_stage_model.transformer.text_model.`        | HF CLIP (`encoder.layers.N.self_attn.q_proj.…`) |
//! | 2nd text enc.  | `cond_stage_model.1.transformer.text_model.`      | HF CLIP                    |
//! | TAESD          | `tae.`                                            | as in the TAESD file       |
//!
//! Mappings applied (each only when the name has that shape; anything else is kept as is
//! so that it surfaces later as an extra tensor, never silently renamed):
//!
//! * **Diffusers UNet → LDM** (SD 1.x/2.x layout: 2 resnets per down block, 3 per up block,
//!   no attention in `up_blocks.0`): `conv_in` → `input_blocks.0.0`;
//!   `time_embedding.linear_{1,2}` → `time_embed.{0,2}`; `conv_norm_out` → `out.0`;
//!   `conv_out` → `out.2`; `down_blocks.i.resnets.j` → `input_blocks.(3i+j+1).0`;
//!   `down_blocks.i.attentions.j` → `input_blocks.(3i+j+1).1`;
//!   `down_blocks.i.downsamplers.0.conv` → `input_blocks.(3i+3).0.op`;
//!   `mid_block.resnets.j` → `middle_block.(2j)`; `mid_block.attentions.0` → `middle_block.1`;
//!   `up_blocks.i.resnets.j` → `output_blocks.(3i+j).0`; `up_blocks.i.attentions.j` →
//!   `output_blocks.(3i+j).1`; `up_blocks.i.upsamplers.0` → `output_blocks.(3i+2).(1 if i = 0
//!   else 2)`. Inside resnets: `norm1` → `in_layers.0`, `conv1` → `in_layers.2`, `norm2` →
//!   `out_layers.0`, `conv2` → `out_layers.3`, `time_emb_proj` → `emb_layers.1`,
//!   `conv_shortcut` → `skip_connection`. Inside attentions, names are shared by both layouts
//!   except `to_out.{weight,bias}` → `to_out.0.{weight,bias}`.
//! * **Diffusers VAE → LDM**: `{encoder,decoder}.conv_norm_out` → `….norm_out`;
//!   `encoder.down_blocks.i.resnets.j` → `encoder.down.i.block.j`;
//!   `encoder.down_blocks.i.downsamplers.0` → `encoder.down.i.downsample`;
//!   `decoder.up_blocks.i.resnets.j` → `decoder.up.(3-i).block.j` (diffusers counts up
//!   blocks in execution order, LDM in resolution order); `decoder.up_blocks.i.upsamplers.0`
//!   → `decoder.up.(3-i).upsample`; `*.mid_block.resnets.j` → `*.mid.block_(j+1)`;
//!   `*.mid_block.attentions.0` → `*.mid.attn_1` with `group_norm` → `norm`,
//!   `query`/`to_q` → `q`, `key`/`to_k` → `k`, `value`/`to_v` → `v`,
//!   `proj_attn`/`to_out.0` → `proj_out`; in resnets `conv_shortcut` → `nin_shortcut`;
//!   `encoder.quant_conv` → `quant_conv`, `decoder.post_quant_conv` → `post_quant_conv`.
//!   Shapes are not touched: diffusers stores the mid-attention projections as linear
//!   `[512, 512]` where LDM has 1×1 convolutions `[512, 512, 1, 1]`; the loader reshapes.
//! * **OpenCLIP (SD 2.x `cond_stage_model.model.*`) → HF CLIP**: `token_embedding` →
//!   `text_model.embeddings.token_embedding`; `positional_embedding` →
//!   `text_model.embeddings.position_embedding.weight`; `ln_final` →
//!   `text_model.final_layer_norm`; `text_projection` → `text_model.text_projection`;
//!   `transformer.resblocks.N.{ln_1, ln_2, attn.out_proj, mlp.c_fc, mlp.c_proj}` →
//!   `text_model.encoder.layers.N.{layer_norm1, layer_norm2, self_attn.out_proj, mlp.fc1,
//!   mlp.fc2}`; and the fused `attn.in_proj_{weight,bias}` (shape `[3d, d]` / `[3d]`) is
//!   **split** into `self_attn.{q,k,v}_proj.{weight,bias}` — its first, second and third
//!   row-thirds, which are contiguous byte ranges of the stored tensor in any dtype. The
//!   HF-style fused `self_attn.in_proj.{weight,bias}` that newer sd.cpp GGUF conversions
//!   write is split the same way, so an SD 2.x text encoder always appears per-layer q/k/v.
//! * `text_projection.weight` at the top of an HF CLIP → `text_model.text_projection`.
//! * **SDXL (SGM) checkpoints**: `conditioner.embedders.0.` → `cond_stage_model.` (CLIP-L,
//!   HF layout: `conditioner.embedders.0.transformer.text_model.…`);
//!   `conditioner.embedders.1.` → `cond_stage_model.1.`, whose open_clip body
//!   (`model.transformer.resblocks.N.…`, `model.token_embedding`, `model.ln_final`,
//!   `model.text_projection`, …) is mapped as above under `cond_stage_model.1.transformer.`,
//!   the fused `in_proj` split the same way; `conditioner.embedders.0.open_clip.` →
//!   `cond_stage_model.` (SGM SD 2.x). `text_projection` keeps its stored orientation, as in
//!   the reference (see `sd_models::text::clip`). Names the body maps do not cover
//!   (`logit_scale`, `position_ids`) keep the renamed prefix, body unchanged. Diffusers `text_encoder_2/` and `--clip_g`
//!   files are HF CLIP (`text_model.…`, `text_projection.weight`) under
//!   `cond_stage_model.1.transformer.` ([`FileRole::TextEncoder`] 1).
//! * **Families' own checkpoint prefixes**, registered by the family ([`CheckpointPrefix`]): a
//!   name under a registered prefix is read under the internal prefix it stands for (SD3's
//!   single files put their CLIPs under `text_encoders.clip_{l,g}.transformer.`).
//! * Component files get their component's prefix unless they already carry it (a `--vae`
//!   file's `encoder.…` becomes `first_stage_model.encoder.…`); files saved with the
//!   diffusers/ComfyUI short prefixes (`diffusion_model.`, `vae.`, `te.`, `text_encoder.`)
//!   have them replaced.

/// What a file holds, which decides the prefix its names get.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileRole {
    /// A single-file checkpoint with every component under its LDM prefix.
    Checkpoint,
    /// The UNet alone (`--diffusion-model`, diffusers `unet/`).
    DiffusionModel,
    /// The VAE alone (`--vae`, diffusers `vae/`).
    Vae,
    /// A text encoder alone: index 0 (`--clip_l`, diffusers `text_encoder/`) or 1
    /// (diffusers `text_encoder_2/`).
    TextEncoder(u8),
    /// The tiny autoencoder (`--taesd`).
    Taesd,
    /// The T5-XXL text encoder alone (`--t5xxl`): Hugging Face `T5EncoderModel` names
    /// (`encoder.block.N...`, `shared.weight`) or llama.cpp's GGUF names (`enc.blk.N.attn_q`,
    /// `token_embd`), read under `text_encoders.t5xxl.transformer.`.
    T5xxl,
    /// An LLM text encoder alone (`--llm`; Qwen3 for Z-Image and FLUX.2 klein): Hugging Face
    /// names (`model.layers.N.self_attn.q_proj.weight`, `model.embed_tokens.weight`) or
    /// llama.cpp's GGUF names (`blk.N.attn_q.weight`, `token_embd.weight`), read under
    /// `text_encoders.llm.`.
    Llm,
}

impl FileRole {
    /// What a file of this role holds, for messages ("a T5 text encoder").
    pub fn describe(self) -> &'static str {
        match self {
            FileRole::Checkpoint => "a whole checkpoint",
            FileRole::DiffusionModel => "a diffusion model",
            FileRole::Vae => "a VAE",
            FileRole::TextEncoder(_) => "a CLIP text encoder",
            FileRole::Taesd => "a TAESD",
            FileRole::T5xxl => "a T5 text encoder",
            FileRole::Llm => "an LLM text encoder",
        }
    }

    /// Whether two roles hold the same kind of component (both CLIP encoders are one kind).
    fn same_kind(self, other: FileRole) -> bool {
        match (self, other) {
            (FileRole::TextEncoder(_), FileRole::TextEncoder(_)) => true,
            (a, b) => a == b,
        }
    }
}

/// The component a tensor stored as `original` belongs to, judged from the name alone in
/// any of the layouts read here (LDM, diffusers, Hugging Face, open_clip, llama.cpp's T5);
/// `None` when the name says nothing (a bare `weight`, an unknown name). Checked in order:
/// T5 and CLIP names first (a CLIP encoder has `encoder.layers.`, as TAESD does).
fn component_of_name(original: &str) -> Option<FileRole> {
    let has = |parts: &[&str]| parts.iter().any(|p| original.contains(p));
    if has(&["SelfAttention.", "EncDecAttention.", "relative_attention_bias", "DenseReluDense."])
        || original.starts_with("enc.blk.")
        || original == "shared.weight"
        || original.ends_with(".shared.weight")
    {
        return Some(FileRole::T5xxl);
    }
    if has(&["text_model.", "transformer.resblocks.", "token_embedding", "positional_embedding", "text_projection"]) {
        return Some(FileRole::TextEncoder(0));
    }
    let autoencoder = has(&["encoder.", "decoder."]);
    if has(&["input_blocks.", "output_blocks.", "middle_block.", "double_blocks.", "single_blocks.", "joint_blocks."])
        || has(&["time_embed.", "time_embedding.", "label_emb."])
        || (!autoencoder && has(&["down_blocks.", "up_blocks.", "mid_block."]))
    {
        return Some(FileRole::DiffusionModel);
    }
    if has(&["quant_conv.", "encoder.down.", "decoder.up.", "encoder.mid.", "decoder.mid."])
        || (autoencoder && has(&["down_blocks.", "up_blocks.", "mid_block.", "conv_in.", "conv_out."]))
    {
        return Some(FileRole::Vae);
    }
    if has(&["encoder.layers.", "decoder.layers."]) {
        return Some(FileRole::Taesd);
    }
    None
}

/// For a component file (`role` not a checkpoint) whose tensors are `names`: the role its
/// tensors show when none of them is of `role` and most of those that say anything are of
/// one other role (a T5 encoder given as the diffusion model). `None` when the file holds
/// any tensor of its role, or when its names say nothing: those are judged later, by the
/// tensors the model looks for.
pub fn misplaced_role<'a>(role: FileRole, names: impl IntoIterator<Item = &'a str>) -> Option<FileRole> {
    if role == FileRole::Checkpoint {
        return None;
    }
    let mut counts: Vec<(FileRole, usize)> = Vec::new();
    for name in names {
        // A whole checkpoint given as a component keeps its own component's tensors.
        let Some(found) = component_of_name(name) else { continue };
        if found.same_kind(role) {
            return None;
        }
        match counts.iter_mut().find(|(r, _)| r.same_kind(found)) {
            Some((_, n)) => *n += 1,
            None => counts.push((found, 1)),
        }
    }
    counts.into_iter().max_by_key(|&(_, n)| n).map(|(r, _)| r)
}

/// Which fused-projection third an entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QkvPart {
    Q,
    K,
    V,
}

impl QkvPart {
    /// 0, 1, 2 for q, k, v: the index of the row-third in the fused tensor.
    pub fn index(self) -> u64 {
        match self {
            QkvPart::Q => 0,
            QkvPart::K => 1,
            QkvPart::V => 2,
        }
    }
}

/// The internal name(s) of one stored tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Normalized {
    /// One internal name.
    One(String),
    /// A fused q/k/v projection, split into three internal names (q, k, v order).
    Split([String; 3]),
}

pub const UNET_PREFIX: &str = "model.diffusion_model.";
pub const VAE_PREFIX: &str = "first_stage_model.";
pub const TE_PREFIX: &str = "cond_stage_model.transformer.";
pub const TE2_PREFIX: &str = "cond_stage_model.1.transformer.";
pub const TAESD_PREFIX: &str = "tae.";
pub const T5XXL_PREFIX: &str = "text_encoders.t5xxl.transformer.";
/// llama.cpp's T5 names and the Hugging Face names they stand for, applied in this order,
/// each to its first occurrence (the reference's `t5_name_map` in `name_conversion.cpp`).
const T5_LLAMA_NAMES: [(&str, &str); 14] = [
    ("enc.", "encoder."),
    ("blk.", "block."),
    ("output_norm.", "final_layer_norm."),
    ("attn_q.", "layer.0.SelfAttention.q."),
    ("attn_k.", "layer.0.SelfAttention.k."),
    ("attn_v.", "layer.0.SelfAttention.v."),
    ("attn_o.", "layer.0.SelfAttention.o."),
    ("attn_norm.", "layer.0.layer_norm."),
    ("ffn_norm.", "layer.1.layer_norm."),
    ("ffn_up.", "layer.1.DenseReluDense.wi_1."),
    ("ffn_down.", "layer.1.DenseReluDense.wo."),
    ("ffn_gate.", "layer.1.DenseReluDense.wi_0."),
    ("attn_rel_b.", "layer.0.SelfAttention.relative_attention_bias."),
    ("token_embd.", "shared."),
];
pub const LLM_PREFIX: &str = "text_encoders.llm.";
/// llama.cpp's LLM names and the Hugging Face names they stand for, applied in this order,
/// each to its first occurrence (the text-model part of the reference's `llm_name_map` in
/// `name_conversion.cpp`).
const LLM_LLAMA_NAMES: [(&str, &str); 21] = [
    ("attn_sinks.weight", "self_attn.sinks"),
    ("token_embd.", "model.embed_tokens."),
    ("blk.", "model.layers."),
    ("attn_q.", "self_attn.q_proj."),
    ("attn_k.", "self_attn.k_proj."),
    ("attn_v.", "self_attn.v_proj."),
    ("attn_q_norm.", "self_attn.q_norm."),
    ("attn_k_norm.", "self_attn.k_norm."),
    ("attn_output.", "self_attn.o_proj."),
    ("attn_norm.", "input_layernorm."),
    ("attn_post_norm.", "post_attention_norm."),
    ("ffn_gate_inp.", "mlp.router."),
    ("ffn_gate_exps.", "mlp.experts.gate_proj."),
    ("ffn_up_exps.", "mlp.experts.up_proj."),
    ("ffn_down_exps.", "mlp.experts.down_proj."),
    ("ffn_down.", "mlp.down_proj."),
    ("ffn_gate.", "mlp.gate_proj."),
    ("ffn_up.", "mlp.up_proj."),
    ("ffn_post_norm.", "post_ffw_norm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("output_norm.", "model.norm."),
];
const OPEN_CLIP_PREFIX: &str = "cond_stage_model.model.";

/// A checkpoint prefix a family's files use for a component, and the internal prefix it
/// stands for: registered by the family's file in `sd-arch` with `inventory::submit!` (SD3's
/// `text_encoders.clip_l.transformer.` is `cond_stage_model.transformer.`). A name under `from`
/// is read as the same name under `to`, then mapped as any checkpoint name; the internal
/// prefixes and the layouts above are tried first.
#[derive(Debug)]
pub struct CheckpointPrefix {
    /// The prefix in the family's files.
    pub from: &'static str,
    /// The internal (or LDM) prefix it stands for.
    pub to: &'static str,
}

inventory::collect!(CheckpointPrefix);
/// SDXL's second encoder in open_clip layout, after the `conditioner.embedders.1.` rename.
const OPEN_CLIP2_PREFIX: &str = "cond_stage_model.1.model.";
/// The SGM (SDXL) checkpoint prefixes and the LDM ones they become, in the order the
/// reference tries them (`name_conversion.cpp`'s prefix map).
const SGM_PREFIXES: [(&str, &str); 3] = [
    ("conditioner.embedders.0.open_clip.", "cond_stage_model."),
    ("conditioner.embedders.0.", "cond_stage_model."),
    ("conditioner.embedders.1.", "cond_stage_model.1."),
];

/// The internal name of a tensor stored as `original` in a `--t5xxl` file.
pub fn t5xxl_name(original: &str) -> String {
    let mut body = strip_any(original, &[T5XXL_PREFIX, "text_encoders.t5xxl.", "te3."]).to_owned();
    for (from, to) in T5_LLAMA_NAMES {
        if let Some(pos) = body.find(from) {
            body.replace_range(pos..pos + from.len(), to);
        }
    }
    format!("{T5XXL_PREFIX}{body}")
}

/// The internal name of a tensor stored as `original` in an `--llm` file.
pub fn llm_name(original: &str) -> String {
    let mut body = strip_any(original, &[LLM_PREFIX]).to_owned();
    for (from, to) in LLM_LLAMA_NAMES {
        if let Some(pos) = body.find(from) {
            body.replace_range(pos..pos + from.len(), to);
        }
    }
    format!("{LLM_PREFIX}{body}")
}

/// The internal name(s) of the tensor stored as `original` in a file of `role`.
///
/// A component file whose names already carry a full checkpoint prefix (say a whole
/// checkpoint given as `--vae`) is read as a checkpoint; the caller keeps only the tensors
/// of the file's own component.
pub fn normalize(original: &str, role: FileRole) -> Normalized {
    if role != FileRole::Checkpoint
        && [UNET_PREFIX, VAE_PREFIX, "cond_stage_model.", "conditioner.embedders."]
            .iter()
            .any(|p| original.starts_with(p))
    {
        return checkpoint_name(original);
    }
    match role {
        FileRole::Checkpoint => checkpoint_name(original),
        FileRole::DiffusionModel => {
            let body = strip_any(original, &[UNET_PREFIX, "diffusion_model.", "unet."]);
            Normalized::One(format!("{UNET_PREFIX}{}", unet_body(body)))
        }
        FileRole::Vae => {
            let body = strip_any(original, &[VAE_PREFIX, "vae."]);
            Normalized::One(format!("{VAE_PREFIX}{}", vae_body(body)))
        }
        FileRole::TextEncoder(i) => {
            let prefix = if i == 0 { TE_PREFIX } else { TE2_PREFIX };
            if let Some(rest) = original.strip_prefix(OPEN_CLIP_PREFIX) {
                return open_clip(rest, prefix).unwrap_or_else(|| Normalized::One(original.to_owned()));
            }
            let body = strip_any(original, &[prefix, "te.", "text_encoder.", "transformer."]);
            hf_clip(body, prefix)
        }
        FileRole::Taesd => {
            let body = strip_any(original, &[TAESD_PREFIX]);
            Normalized::One(format!("{TAESD_PREFIX}{body}"))
        }
        FileRole::T5xxl => Normalized::One(t5xxl_name(original)),
        FileRole::Llm => Normalized::One(llm_name(original)),
    }
}

fn strip_any<'a>(name: &'a str, prefixes: &[&str]) -> &'a str {
    prefixes.iter().find_map(|p| name.strip_prefix(p)).unwrap_or(name)
}

fn checkpoint_name(name: &str) -> Normalized {
    if let Some(rest) = name.strip_prefix(UNET_PREFIX).or_else(|| name.strip_prefix("diffusion_model.")) {
        return Normalized::One(format!("{UNET_PREFIX}{}", unet_body(rest)));
    }
    if let Some(rest) = name.strip_prefix(VAE_PREFIX) {
        return Normalized::One(format!("{VAE_PREFIX}{}", vae_body(rest)));
    }
    if let Some(rest) = name.strip_prefix(OPEN_CLIP_PREFIX) {
        return open_clip(rest, TE_PREFIX).unwrap_or_else(|| Normalized::One(name.to_owned()));
    }
    if let Some(rest) = name.strip_prefix(OPEN_CLIP2_PREFIX) {
        return open_clip(rest, TE2_PREFIX).unwrap_or_else(|| Normalized::One(name.to_owned()));
    }
    if let Some((from, to)) = SGM_PREFIXES.iter().find(|(from, _)| name.starts_with(from)) {
        return checkpoint_name(&format!("{to}{}", &name[from.len()..]));
    }
    if let Some(rest) = name.strip_prefix(TE2_PREFIX) {
        return hf_clip(rest, TE2_PREFIX);
    }
    if let Some(rest) = name.strip_prefix(TE_PREFIX) {
        return hf_clip(rest, TE_PREFIX);
    }
    if let Some(p) = inventory::iter::<CheckpointPrefix>.into_iter().find(|p| name.starts_with(p.from)) {
        return checkpoint_name(&format!("{}{}", p.to, &name[p.from.len()..]));
    }
    Normalized::One(name.to_owned())
}

/// `a.b.c` with `rest` segments appended, skipping an empty tail.
fn join(head: &str, rest: &[&str]) -> String {
    if rest.is_empty() {
        head.to_owned()
    } else {
        format!("{head}.{}", rest.join("."))
    }
}

fn small(s: &str) -> Option<u32> {
    // Block indices are small; refuse absurd numbers rather than overflow arithmetic.
    s.parse::<u32>().ok().filter(|&n| n < 1000)
}

/// A UNet name body in LDM form: converted when it is a diffusers name, else unchanged.
fn unet_body(body: &str) -> String {
    diffusers_unet(body).unwrap_or_else(|| body.to_owned())
}

fn diffusers_unet(body: &str) -> Option<String> {
    let seg: Vec<&str> = body.split('.').collect();
    let out = match seg.as_slice() {
        ["conv_in", rest @ ..] => join("input_blocks.0.0", rest),
        ["time_embedding", "linear_1", rest @ ..] => join("time_embed.0", rest),
        ["time_embedding", "linear_2", rest @ ..] => join("time_embed.2", rest),
        ["conv_norm_out", rest @ ..] => join("out.0", rest),
        ["conv_out", rest @ ..] => join("out.2", rest),
        ["down_blocks", i, "resnets", j, rest @ ..] => {
            format!("input_blocks.{}.0.{}", 3 * small(i)? + small(j)? + 1, resnet_unet(rest)?)
        }
        ["down_blocks", i, "attentions", j, rest @ ..] => {
            format!("input_blocks.{}.1.{}", 3 * small(i)? + small(j)? + 1, attention(rest))
        }
        ["down_blocks", i, "downsamplers", "0", "conv", rest @ ..] => {
            join(&format!("input_blocks.{}.0.op", 3 * (small(i)? + 1)), rest)
        }
        ["mid_block", "resnets", j, rest @ ..] => format!("middle_block.{}.{}", 2 * small(j)?, resnet_unet(rest)?),
        ["mid_block", "attentions", "0", rest @ ..] => format!("middle_block.1.{}", attention(rest)),
        ["up_blocks", i, "resnets", j, rest @ ..] => {
            format!("output_blocks.{}.0.{}", 3 * small(i)? + small(j)?, resnet_unet(rest)?)
        }
        ["up_blocks", i, "attentions", j, rest @ ..] => {
            format!("output_blocks.{}.1.{}", 3 * small(i)? + small(j)?, attention(rest))
        }
        ["up_blocks", i, "upsamplers", "0", rest @ ..] => {
            let i = small(i)?;
            join(&format!("output_blocks.{}.{}", 3 * i + 2, if i == 0 { 1 } else { 2 }), rest)
        }
        _ => return None,
    };
    Some(out)
}

fn resnet_unet(rest: &[&str]) -> Option<String> {
    let (first, tail) = rest.split_first()?;
    let ldm = match *first {
        "norm1" => "in_layers.0",
        "conv1" => "in_layers.2",
        "norm2" => "out_layers.0",
        "conv2" => "out_layers.3",
        "time_emb_proj" => "emb_layers.1",
        "conv_shortcut" => "skip_connection",
        _ => return None,
    };
    Some(join(ldm, tail))
}

fn attention(rest: &[&str]) -> String {
    let s = rest.join(".");
    for p in ["weight", "bias"] {
        if let Some(head) = s.strip_suffix(&format!("to_out.{p}")) {
            return format!("{head}to_out.0.{p}");
        }
    }
    s
}

/// A VAE name body in LDM form: converted when it is a diffusers name, else unchanged.
fn vae_body(body: &str) -> String {
    diffusers_vae(body).unwrap_or_else(|| body.to_owned())
}

fn diffusers_vae(body: &str) -> Option<String> {
    let seg: Vec<&str> = body.split('.').collect();
    let out = match seg.as_slice() {
        ["encoder", "quant_conv", rest @ ..] => join("quant_conv", rest),
        ["decoder", "post_quant_conv", rest @ ..] => join("post_quant_conv", rest),
        [side @ ("encoder" | "decoder"), "conv_norm_out", rest @ ..] => join(&format!("{side}.norm_out"), rest),
        ["encoder", "down_blocks", i, "resnets", j, rest @ ..] => {
            format!("encoder.down.{}.block.{}.{}", small(i)?, small(j)?, resnet_vae(rest)?)
        }
        ["encoder", "down_blocks", i, "downsamplers", "0", rest @ ..] => {
            join(&format!("encoder.down.{}.downsample", small(i)?), rest)
        }
        ["decoder", "up_blocks", i, "resnets", j, rest @ ..] => {
            format!("decoder.up.{}.block.{}.{}", 3u32.checked_sub(small(i)?)?, small(j)?, resnet_vae(rest)?)
        }
        ["decoder", "up_blocks", i, "upsamplers", "0", rest @ ..] => {
            join(&format!("decoder.up.{}.upsample", 3u32.checked_sub(small(i)?)?), rest)
        }
        [side @ ("encoder" | "decoder"), "mid_block", "resnets", j, rest @ ..] => {
            format!("{side}.mid.block_{}.{}", small(j)? + 1, resnet_vae(rest)?)
        }
        [side @ ("encoder" | "decoder"), "mid_block", "attentions", "0", rest @ ..] => {
            format!("{side}.mid.attn_1.{}", vae_attention(rest)?)
        }
        _ => return None,
    };
    Some(out)
}

fn resnet_vae(rest: &[&str]) -> Option<String> {
    let (first, tail) = rest.split_first()?;
    let ldm = if *first == "conv_shortcut" { "nin_shortcut" } else { first };
    Some(join(ldm, tail))
}

fn vae_attention(rest: &[&str]) -> Option<String> {
    let (ldm, tail) = match rest {
        ["to_out", "0", tail @ ..] => ("proj_out", tail),
        [first, tail @ ..] => (
            match *first {
                "group_norm" => "norm",
                "query" | "to_q" => "q",
                "key" | "to_k" => "k",
                "value" | "to_v" => "v",
                "proj_attn" => "proj_out",
                other => other,
            },
            tail,
        ),
        [] => return None,
    };
    Some(join(ldm, tail))
}

fn split_names(prefix: &str, layer: &str, suffix: &str) -> Normalized {
    let n = |p: &str| format!("{prefix}text_model.encoder.layers.{layer}.self_attn.{p}_proj.{suffix}");
    Normalized::Split([n("q"), n("k"), n("v")])
}

/// OpenCLIP text-encoder body (after `cond_stage_model.model.`) to HF CLIP names under
/// `prefix`; `None` for names OpenCLIP has that we do not map (kept as is).
fn open_clip(rest: &str, prefix: &str) -> Option<Normalized> {
    let seg: Vec<&str> = rest.split('.').collect();
    let hf = match seg.as_slice() {
        ["token_embedding", tail @ ..] => join("text_model.embeddings.token_embedding", tail),
        ["positional_embedding"] => "text_model.embeddings.position_embedding.weight".to_owned(),
        ["ln_final", tail @ ..] => join("text_model.final_layer_norm", tail),
        ["text_projection"] => "text_model.text_projection".to_owned(),
        ["transformer", "resblocks", n, tail @ ..] => {
            small(n)?;
            let layer = |body: &str, t: &[&str]| join(&format!("text_model.encoder.layers.{n}.{body}"), t);
            match tail {
                ["attn", "in_proj_weight"] => return Some(split_names(prefix, n, "weight")),
                ["attn", "in_proj_bias"] => return Some(split_names(prefix, n, "bias")),
                ["attn", "out_proj", t @ ..] => layer("self_attn.out_proj", t),
                ["ln_1", t @ ..] => layer("layer_norm1", t),
                ["ln_2", t @ ..] => layer("layer_norm2", t),
                ["mlp", "c_fc", t @ ..] => layer("mlp.fc1", t),
                ["mlp", "c_proj", t @ ..] => layer("mlp.fc2", t),
                _ => return None,
            }
        }
        _ => return None,
    };
    Some(Normalized::One(format!("{prefix}{hf}")))
}

/// HF CLIP body under `prefix`, splitting a fused `self_attn.in_proj`.
fn hf_clip(body: &str, prefix: &str) -> Normalized {
    let seg: Vec<&str> = body.split('.').collect();
    match seg.as_slice() {
        ["text_model", "encoder", "layers", n, "self_attn", "in_proj", suffix @ ("weight" | "bias")]
            if small(n).is_some() =>
        {
            split_names(prefix, n, suffix)
        }
        ["text_projection", "weight"] => Normalized::One(format!("{prefix}text_model.text_projection")),
        _ => Normalized::One(format!("{prefix}{body}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(original: &str, role: FileRole) -> String {
        match normalize(original, role) {
            Normalized::One(s) => s,
            Normalized::Split(s) => panic!("{original} was split into {s:?}"),
        }
    }

    /// (diffusers UNet name, LDM name). Pairs from the HF diffusers conversion script
    /// `convert_diffusers_to_original_stable_diffusion.py` (the table sd.cpp also follows).
    #[test]
    fn diffusers_unet_names_map_to_ldm() {
        let cases = [
            ("conv_in.weight", "input_blocks.0.0.weight"),
            ("time_embedding.linear_1.bias", "time_embed.0.bias"),
            ("time_embedding.linear_2.weight", "time_embed.2.weight"),
            ("conv_norm_out.weight", "out.0.weight"),
            ("conv_out.bias", "out.2.bias"),
            ("down_blocks.0.resnets.0.norm1.weight", "input_blocks.1.0.in_layers.0.weight"),
            ("down_blocks.0.resnets.1.conv1.weight", "input_blocks.2.0.in_layers.2.weight"),
            ("down_blocks.1.resnets.0.conv_shortcut.weight", "input_blocks.4.0.skip_connection.weight"),
            ("down_blocks.3.resnets.1.time_emb_proj.bias", "input_blocks.11.0.emb_layers.1.bias"),
            ("down_blocks.2.resnets.0.norm2.bias", "input_blocks.7.0.out_layers.0.bias"),
            ("down_blocks.2.resnets.0.conv2.weight", "input_blocks.7.0.out_layers.3.weight"),
            (
                "down_blocks.0.attentions.1.transformer_blocks.0.attn1.to_q.weight",
                "input_blocks.2.1.transformer_blocks.0.attn1.to_q.weight",
            ),
            ("down_blocks.0.attentions.0.proj_in.weight", "input_blocks.1.1.proj_in.weight"),
            ("down_blocks.0.downsamplers.0.conv.weight", "input_blocks.3.0.op.weight"),
            ("down_blocks.2.downsamplers.0.conv.bias", "input_blocks.9.0.op.bias"),
            ("mid_block.resnets.0.norm1.weight", "middle_block.0.in_layers.0.weight"),
            ("mid_block.resnets.1.conv2.weight", "middle_block.2.out_layers.3.weight"),
            ("mid_block.attentions.0.norm.weight", "middle_block.1.norm.weight"),
            ("up_blocks.0.resnets.2.conv1.weight", "output_blocks.2.0.in_layers.2.weight"),
            ("up_blocks.0.upsamplers.0.conv.weight", "output_blocks.2.1.conv.weight"),
            ("up_blocks.1.upsamplers.0.conv.weight", "output_blocks.5.2.conv.weight"),
            ("up_blocks.3.resnets.2.conv_shortcut.bias", "output_blocks.11.0.skip_connection.bias"),
            (
                "up_blocks.3.attentions.2.transformer_blocks.0.attn2.to_out.0.weight",
                "output_blocks.11.1.transformer_blocks.0.attn2.to_out.0.weight",
            ),
            (
                "up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.bias",
                "output_blocks.3.1.transformer_blocks.0.attn1.to_out.0.bias",
            ),
        ];
        for (diffusers, ldm) in cases {
            assert_eq!(one(diffusers, FileRole::DiffusionModel), format!("model.diffusion_model.{ldm}"), "{diffusers}");
        }
    }

    /// (diffusers VAE name, LDM name), from the same conversion script's VAE table.
    #[test]
    fn diffusers_vae_names_map_to_ldm() {
        let cases = [
            ("encoder.conv_in.weight", "encoder.conv_in.weight"),
            ("encoder.conv_norm_out.bias", "encoder.norm_out.bias"),
            ("decoder.conv_norm_out.weight", "decoder.norm_out.weight"),
            ("encoder.down_blocks.1.resnets.0.conv_shortcut.weight", "encoder.down.1.block.0.nin_shortcut.weight"),
            ("encoder.down_blocks.0.resnets.1.norm1.bias", "encoder.down.0.block.1.norm1.bias"),
            ("encoder.down_blocks.2.downsamplers.0.conv.weight", "encoder.down.2.downsample.conv.weight"),
            ("decoder.up_blocks.0.resnets.2.conv2.weight", "decoder.up.3.block.2.conv2.weight"),
            ("decoder.up_blocks.3.resnets.0.conv_shortcut.bias", "decoder.up.0.block.0.nin_shortcut.bias"),
            ("decoder.up_blocks.1.upsamplers.0.conv.weight", "decoder.up.2.upsample.conv.weight"),
            ("encoder.mid_block.resnets.0.conv1.weight", "encoder.mid.block_1.conv1.weight"),
            ("decoder.mid_block.resnets.1.norm2.weight", "decoder.mid.block_2.norm2.weight"),
            ("encoder.mid_block.attentions.0.group_norm.weight", "encoder.mid.attn_1.norm.weight"),
            ("decoder.mid_block.attentions.0.to_q.weight", "decoder.mid.attn_1.q.weight"),
            ("decoder.mid_block.attentions.0.key.bias", "decoder.mid.attn_1.k.bias"),
            ("decoder.mid_block.attentions.0.value.weight", "decoder.mid.attn_1.v.weight"),
            ("decoder.mid_block.attentions.0.to_out.0.weight", "decoder.mid.attn_1.proj_out.weight"),
            ("encoder.mid_block.attentions.0.proj_attn.bias", "encoder.mid.attn_1.proj_out.bias"),
            ("quant_conv.weight", "quant_conv.weight"),
            ("post_quant_conv.bias", "post_quant_conv.bias"),
            ("encoder.quant_conv.weight", "quant_conv.weight"),
        ];
        for (diffusers, ldm) in cases {
            assert_eq!(one(diffusers, FileRole::Vae), format!("first_stage_model.{ldm}"), "{diffusers}");
        }
    }

    #[test]
    fn ldm_checkpoint_names_are_kept() {
        for n in [
            "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight",
            "model.diffusion_model.time_embed.0.weight",
            "first_stage_model.decoder.up.3.block.0.conv1.weight",
            "first_stage_model.encoder.mid.attn_1.q.weight",
            "cond_stage_model.transformer.text_model.encoder.layers.11.self_attn.q_proj.weight",
            "cond_stage_model.transformer.text_model.embeddings.position_ids",
            "alphas_cumprod",
            "model_ema.decay",
        ] {
            assert_eq!(one(n, FileRole::Checkpoint), n);
        }
        // A ComfyUI-style bare UNet prefix gets the full one.
        assert_eq!(one("diffusion_model.out.2.weight", FileRole::Checkpoint), "model.diffusion_model.out.2.weight");
    }

    /// OpenCLIP → HF CLIP, as in sd.cpp's `convert_open_clip_to_hf_clip_name` table.
    #[test]
    fn sd2_open_clip_names_become_hf_clip() {
        let p = "cond_stage_model.model.";
        let t = "cond_stage_model.transformer.text_model.";
        let cases = [
            ("token_embedding.weight", "embeddings.token_embedding.weight"),
            ("positional_embedding", "embeddings.position_embedding.weight"),
            ("ln_final.bias", "final_layer_norm.bias"),
            ("text_projection", "text_projection"),
            ("transformer.resblocks.3.ln_1.weight", "encoder.layers.3.layer_norm1.weight"),
            ("transformer.resblocks.3.ln_2.bias", "encoder.layers.3.layer_norm2.bias"),
            ("transformer.resblocks.22.attn.out_proj.weight", "encoder.layers.22.self_attn.out_proj.weight"),
            ("transformer.resblocks.0.mlp.c_fc.bias", "encoder.layers.0.mlp.fc1.bias"),
            ("transformer.resblocks.0.mlp.c_proj.weight", "encoder.layers.0.mlp.fc2.weight"),
        ];
        for (oc, hf) in cases {
            assert_eq!(one(&format!("{p}{oc}"), FileRole::Checkpoint), format!("{t}{hf}"), "{oc}");
        }
        assert_eq!(
            normalize("cond_stage_model.model.transformer.resblocks.5.attn.in_proj_weight", FileRole::Checkpoint),
            Normalized::Split([
                format!("{t}encoder.layers.5.self_attn.q_proj.weight"),
                format!("{t}encoder.layers.5.self_attn.k_proj.weight"),
                format!("{t}encoder.layers.5.self_attn.v_proj.weight"),
            ])
        );
        assert_eq!(
            normalize(
                "cond_stage_model.transformer.text_model.encoder.layers.2.self_attn.in_proj.bias",
                FileRole::Checkpoint
            ),
            Normalized::Split([
                format!("{t}encoder.layers.2.self_attn.q_proj.bias"),
                format!("{t}encoder.layers.2.self_attn.k_proj.bias"),
                format!("{t}encoder.layers.2.self_attn.v_proj.bias"),
            ])
        );
        // Unmapped OpenCLIP names stay visible under their original name.
        assert_eq!(
            one("cond_stage_model.model.logit_scale", FileRole::Checkpoint),
            "cond_stage_model.model.logit_scale"
        );
    }

    /// SDXL single-file (SGM) names, as the reference's `name_conversion.cpp` (its prefix map
    /// and open_clip table) converts them.
    #[test]
    fn sdxl_sgm_names_become_the_internal_ones() {
        let l = "cond_stage_model.transformer.text_model.";
        let g = "cond_stage_model.1.transformer.text_model.";
        let cases = [
            (
                "conditioner.embedders.0.transformer.text_model.encoder.layers.11.mlp.fc2.bias",
                format!("{l}encoder.layers.11.mlp.fc2.bias"),
            ),
            (
                "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight",
                format!("{l}embeddings.token_embedding.weight"),
            ),
            (
                "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight",
                format!("{l}final_layer_norm.weight"),
            ),
            ("conditioner.embedders.1.model.token_embedding.weight", format!("{g}embeddings.token_embedding.weight")),
            ("conditioner.embedders.1.model.positional_embedding", format!("{g}embeddings.position_embedding.weight")),
            ("conditioner.embedders.1.model.ln_final.bias", format!("{g}final_layer_norm.bias")),
            ("conditioner.embedders.1.model.text_projection", format!("{g}text_projection")),
            (
                "conditioner.embedders.1.model.transformer.resblocks.31.ln_1.weight",
                format!("{g}encoder.layers.31.layer_norm1.weight"),
            ),
            (
                "conditioner.embedders.1.model.transformer.resblocks.0.attn.out_proj.bias",
                format!("{g}encoder.layers.0.self_attn.out_proj.bias"),
            ),
            (
                "conditioner.embedders.1.model.transformer.resblocks.7.mlp.c_fc.weight",
                format!("{g}encoder.layers.7.mlp.fc1.weight"),
            ),
            (
                "conditioner.embedders.1.model.transformer.resblocks.7.mlp.c_proj.bias",
                format!("{g}encoder.layers.7.mlp.fc2.bias"),
            ),
            ("conditioner.embedders.0.open_clip.model.ln_final.weight", format!("{l}final_layer_norm.weight")),
            // What the reference ignores keeps a visible name.
            ("conditioner.embedders.1.model.logit_scale", "cond_stage_model.1.model.logit_scale".to_owned()),
            (
                "conditioner.embedders.0.transformer.text_model.embeddings.position_ids",
                format!("{l}embeddings.position_ids"),
            ),
        ];
        for (sgm, internal) in cases {
            assert_eq!(one(sgm, FileRole::Checkpoint), internal, "{sgm}");
        }
        for (suffix, part) in [("in_proj_weight", "weight"), ("in_proj_bias", "bias")] {
            assert_eq!(
                normalize(
                    &format!("conditioner.embedders.1.model.transformer.resblocks.30.attn.{suffix}"),
                    FileRole::Checkpoint
                ),
                Normalized::Split([
                    format!("{g}encoder.layers.30.self_attn.q_proj.{part}"),
                    format!("{g}encoder.layers.30.self_attn.k_proj.{part}"),
                    format!("{g}encoder.layers.30.self_attn.v_proj.{part}"),
                ])
            );
        }
        // Separate files: `--clip_g` / diffusers `text_encoder_2/` (HF CLIPTextModelWithProjection),
        // and a whole SDXL checkpoint given as a component.
        assert_eq!(one("text_projection.weight", FileRole::TextEncoder(1)), format!("{g}text_projection"));
        assert_eq!(
            one("text_model.encoder.layers.31.self_attn.v_proj.weight", FileRole::TextEncoder(1)),
            format!("{g}encoder.layers.31.self_attn.v_proj.weight")
        );
        assert_eq!(
            one("conditioner.embedders.1.model.ln_final.weight", FileRole::TextEncoder(1)),
            format!("{g}final_layer_norm.weight")
        );
        assert_eq!(
            one("text_model.embeddings.position_embedding.weight", FileRole::TextEncoder(0)),
            format!("{l}embeddings.position_embedding.weight")
        );
    }

    #[test]
    fn component_files_get_their_prefix() {
        assert_eq!(
            one("encoder.down.0.block.0.conv1.weight", FileRole::Vae),
            "first_stage_model.encoder.down.0.block.0.conv1.weight"
        );
        assert_eq!(
            one("first_stage_model.decoder.conv_in.bias", FileRole::Vae),
            "first_stage_model.decoder.conv_in.bias"
        );
        assert_eq!(one("vae.decoder.conv_out.bias", FileRole::Vae), "first_stage_model.decoder.conv_out.bias");
        assert_eq!(
            one("input_blocks.0.0.weight", FileRole::DiffusionModel),
            "model.diffusion_model.input_blocks.0.0.weight"
        );
        assert_eq!(
            one("text_model.encoder.layers.0.mlp.fc1.weight", FileRole::TextEncoder(0)),
            "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight"
        );
        assert_eq!(
            one("text_model.final_layer_norm.weight", FileRole::TextEncoder(1)),
            "cond_stage_model.1.transformer.text_model.final_layer_norm.weight"
        );
        assert_eq!(
            one("text_projection.weight", FileRole::TextEncoder(0)),
            "cond_stage_model.transformer.text_model.text_projection"
        );
        assert_eq!(one("decoder.layers.3.conv.0.weight", FileRole::Taesd), "tae.decoder.layers.3.conv.0.weight");
        assert_eq!(one("tae.decoder.layers.3.conv.0.weight", FileRole::Taesd), "tae.decoder.layers.3.conv.0.weight");
    }

    #[test]
    fn a_component_file_of_another_component_is_named_by_its_tensors() {
        use FileRole::*;
        let t5 = ["shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight", "encoder.final_layer_norm.weight"];
        let t5_gguf = ["token_embd.weight", "enc.blk.0.attn_q.weight"];
        let clip = ["text_model.embeddings.token_embedding.weight", "text_model.encoder.layers.0.mlp.fc1.weight"];
        let unet = ["input_blocks.0.0.weight", "time_embed.0.weight"];
        let unet_diffusers =
            ["conv_in.weight", "down_blocks.0.resnets.0.conv1.weight", "time_embedding.linear_1.weight"];
        let flux = ["double_blocks.0.img_attn.qkv.weight", "img_in.weight"];
        let vae = ["decoder.up.0.block.0.conv1.weight", "post_quant_conv.weight"];
        let vae_diffusers = ["encoder.down_blocks.0.resnets.0.conv1.weight", "decoder.conv_in.weight"];
        let taesd = ["decoder.layers.3.conv.0.weight", "encoder.layers.0.weight"];
        let checkpoint =
            ["model.diffusion_model.input_blocks.0.0.weight", "first_stage_model.decoder.up.0.block.0.conv1.weight"];
        let cases: [(&[&str], FileRole, Option<FileRole>); 16] = [
            (&t5, DiffusionModel, Some(T5xxl)),
            (&t5_gguf, DiffusionModel, Some(T5xxl)),
            (&t5, TextEncoder(0), Some(T5xxl)),
            (&t5, T5xxl, None),
            (&clip, DiffusionModel, Some(TextEncoder(0))),
            (&clip, TextEncoder(1), None),
            (&unet, Vae, Some(DiffusionModel)),
            (&unet_diffusers, DiffusionModel, None),
            (&flux, DiffusionModel, None),
            (&flux, T5xxl, Some(DiffusionModel)),
            (&vae, DiffusionModel, Some(Vae)),
            (&vae_diffusers, Vae, None),
            (&taesd, Vae, Some(Taesd)),
            (&taesd, Taesd, None),
            // A whole checkpoint given as a component keeps its component's tensors.
            (&checkpoint, Vae, None),
            // Names that say nothing are judged later.
            (&["foo", "weight"], DiffusionModel, None),
        ];
        for (names, role, want) in cases {
            assert_eq!(misplaced_role(role, names.iter().copied()), want, "{names:?} as {role:?}");
        }
        assert_eq!(misplaced_role(Checkpoint, t5.iter().copied()), None);
    }

    #[test]
    fn absurd_block_numbers_are_not_converted() {
        // Kept unconverted (and so reported later as unknown), never an arithmetic overflow.
        assert_eq!(
            one("down_blocks.99999999999.resnets.0.norm1.weight", FileRole::DiffusionModel),
            "model.diffusion_model.down_blocks.99999999999.resnets.0.norm1.weight"
        );
        assert_eq!(
            one("decoder.up_blocks.7.resnets.0.conv1.weight", FileRole::Vae),
            "first_stage_model.decoder.up_blocks.7.resnets.0.conv1.weight"
        );
    }
}
