//! LoRA adapters: files, key mapping to our tensor names, and the merge into the weights.
//!
//! A LoRA file (safetensors or GGUF, opened through [`crate::files`]) holds, per adapted
//! weight, a `down` matrix (`[rank, in]`, or `[rank, in, kh, kw]` for a convolution), an `up`
//! matrix (`[out, rank]` or `[out, rank, 1, 1]`) and optionally an `alpha` scalar. Layouts read:
//! kohya/A1111 (`lora_unet_<flat name>.lora_down.weight`, `.lora_up.weight`, `.alpha`, the
//! flat name being the module path with `_` for `.`) and diffusers/PEFT
//! (`unet.<dotted name>.lora_A.weight`, `.lora_B.weight`), and under either naming LyCORIS's
//! LoHa (`.hada_w1_a`, `.hada_w1_b`, `.hada_w2_a`, `.hada_w2_b`) and LoKr (`.lokr_w1` or
//! `.lokr_w1_a`/`_b`, `.lokr_w2` or `.lokr_w2_a`/`_b`) factors ([`forms`]). Where each prefix points is the
//! family's table ([`crate::family::Family::lora_prefixes`]); the body is then named by the
//! same normalisation as model files ([`crate::files::names::normalize`]), so diffusers and LDM
//! bodies both reach our internal names.
//!
//! The rule is the reference's (stable-diffusion.cpp's `src/model/adapter/lora.hpp`): the
//! delta of one adapter is `scale * (up @ down)` reshaped to the weight, with
//! `scale = multiplier * alpha / rank`, `rank` the down matrix's first dimension, and
//! `scale = multiplier` when the file has no alpha; each adapter is added in f32 and the sum
//! stored back in the weight's type before the next adapter (the reference adds in place in
//! the weight's type for f16/f32 weights, and dequantizes, adds and requantizes the others).
//!
//! `immediately` ([`ApplyMode::Immediately`]) merges through [`MergedSource`], a
//! [`TensorSource`] over the model's own source: every time the weight placement reads a
//! tensor (once for parameters on the computing device or in RAM, at every staging for
//! parameters on disk) the adapters are added to the bytes read, so no unmerged copy is kept
//! next to the merged one and a disk-resident module keeps no merged copy at all.
//!
//! `at_runtime` ([`ApplyMode::AtRuntime`], [`runtime`]) changes no weight byte: each adapter's
//! `down` and `up` become tensors of the module they adapt (placed, staged and charged to the
//! ledgers with it) and the graph's linear and convolution helpers add
//! `scale * up(down(x))` after their bias, one adapter after the other, as the reference's
//! runtime path does. It costs two small products per adapted layer and evaluation instead of
//! one merge per load. `auto` picks per module ([`runtime::resolve`]): at run time when
//! adapted weights are quantized, when the parameters live off the computing device, or when
//! the module is row-split; merged otherwise. A row-split module in `immediately` works too:
//! the merge happens as the whole weight is read, before it is cut into row chunks.

mod forms;
pub mod runtime;
pub mod tags;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sd_backends::{convert, GgmlType};
use sd_sched::{MappedBytes, SourceError, TensorSource, TensorSpec};

use crate::files::names::{normalize, FileRole, Normalized};
use crate::files::{FilesError, ModelFiles};
use crate::loader::FileSource;

/// One adapter asked for: its file and multiplier.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraRequest {
    /// The LoRA file.
    pub path: PathBuf,
    /// The multiplier (`<lora:name:multiplier>`).
    pub multiplier: f32,
}

/// `--lora-apply-mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ApplyMode {
    /// Chosen per module by where its weights live ([`runtime::resolve`]).
    #[default]
    Auto,
    /// Merged into the weights as they are loaded or staged.
    Immediately,
    /// Low-rank products added in the graph ([`runtime`]).
    AtRuntime,
}

impl ApplyMode {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            ApplyMode::Auto => "auto",
            ApplyMode::Immediately => "immediately",
            ApplyMode::AtRuntime => "at_runtime",
        }
    }
}

impl std::str::FromStr for ApplyMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ApplyMode::Auto),
            "immediately" => Ok(ApplyMode::Immediately),
            "at_runtime" => Ok(ApplyMode::AtRuntime),
            _ => Err(format!("'{s}' is not one of auto, immediately, at_runtime")),
        }
    }
}

/// Where a prefix of LoRA keys points: one row of a family's table.
#[derive(Clone, Copy, Debug)]
pub struct LoraPrefix {
    /// The key prefix (`lora_unet_`, `unet.`).
    pub prefix: &'static str,
    /// The component the body names, as a file of that role would.
    pub role: FileRole,
    /// How the body is written.
    pub body: LoraBody,
}

/// How the body of a LoRA key (the key less its prefix and its `.lora_down.weight`) is written.
#[derive(Clone, Copy, Debug)]
pub enum LoraBody {
    /// Dotted, named as a file of the row's role names the module.
    Dotted,
    /// kohya's flat form (`_` for `.`, except inside the module names that contain `_`), then as [`LoraBody::Dotted`].
    Flat,
    /// A family's own renaming (a DiT's diffusers names): the body in the role's names and
    /// the part of a fused weight it adapts. Part `None` is a whole weight (its adapter must
    /// have the weight's shape); `Some(0)` the first row block of a fused one (`to_q` of a
    /// fused `qkv`); `Some(k)` the rows after those of parts `0..k` (the reference's
    /// `.weight.1`, `.weight.2` names). `None` for the whole: a module it does not name.
    Mapped(MapBody),
}

/// How a [`LoraBody::Mapped`] body names its module: the internal name, and the part.
pub type MapBody = fn(&str) -> Option<(String, Option<usize>)>;

/// Why LoRA adapters cannot be used, naming the file and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// A tag names no file.
    #[error("LoRA '{name}' not found in '{}' (tried the name as written and with {tried} appended)", dir.display())]
    NotFound {
        /// The name in the tag.
        name: String,
        /// The directory searched.
        dir: PathBuf,
        /// The extensions tried.
        tried: String,
    },
    /// A tag names something that is not a regular file (a FIFO, a device, a directory).
    #[error("LoRA '{name}': '{}' is {kind}, not a regular file", path.display())]
    NotRegular {
        /// The name in the tag.
        name: String,
        /// What it resolved to.
        path: PathBuf,
        /// What that is ("a FIFO (named pipe)").
        kind: &'static str,
    },
    /// A tag that cannot be used: a name outside `--lora-model-dir`, a multiplier out of range.
    #[error("LoRA tag '{name}': {problem}")]
    Tag {
        /// The name in the tag (control characters escaped).
        name: String,
        /// What is wrong.
        problem: String,
    },
    /// The file cannot be opened or parsed (the cause names the file).
    #[error("LoRA file")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<FilesError>,
    },
    /// A tensor of the file cannot be read (the cause names the tensor and file).
    #[error("LoRA tensor")]
    Tensor {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: SourceError,
    },
    /// Nothing of the file adapts this model.
    #[error("LoRA file '{}': none of its {keys} adapters names a tensor of the {family} model (first: {first})", path.display())]
    NothingMatches {
        /// The file.
        path: PathBuf,
        /// The model family.
        family: &'static str,
        /// How many adapter keys it has.
        keys: usize,
        /// The first of them.
        first: String,
    },
    /// Up, down and the weight do not fit together.
    #[error("LoRA file '{}', tensor '{tensor}': {problem}", path.display())]
    Shape {
        /// The file.
        path: PathBuf,
        /// The adapter's key in the file.
        tensor: String,
        /// What does not fit.
        problem: String,
    },
    /// The scale an adapter makes (multiplier x alpha / rank) is out of range.
    #[error("LoRA file '{}', tensor '{tensor}': {problem}", path.display())]
    Value {
        /// The file.
        path: PathBuf,
        /// The adapter's key (or tensor) in the file.
        tensor: String,
        /// What is wrong, with the value.
        problem: String,
    },
    /// The request cannot be served.
    #[error("LoRA: {0}")]
    Unsupported(String),
}

/// The largest magnitude of an adapter's scale (multiplier x alpha / rank) accepted: the
/// largest finite f16. Checkpoints store their weights in f16, so beyond it any delta element
/// of magnitude 1 overflows the merged weight to infinity; trained adapters use scales near 1
/// (alpha at most the rank, multipliers within a few units), so a larger one is a corrupt file
/// or a typing error (`<lora:x:1e38>`), refused with the file and key.
const MAX_SCALE: f32 = 65504.0;

/// One adapter of one weight, ready to merge.
#[derive(Debug)]
struct Delta {
    /// The delta as the file stores it (`[out, inner]`).
    form: forms::Form,
    /// Rows of the delta (the rows of the weight it adapts, from `offset`).
    out: usize,
    inner: usize,
    /// The first row of the weight this adapter adds to (0 but for the later parts of a fused
    /// weight, [`LoraBody::Mapped`]).
    offset: usize,
    /// Rows of the weight.
    rows: usize,
    /// `multiplier * alpha / rank` (or `multiplier`; the kind's rule, [`read_delta`]).
    scale: f32,
    /// Whether the file stores a LoRA's both matrices as f16 (at run time they are then
    /// multiplied as f16, as the reference multiplies the file's tensors; else as f32).
    f16: bool,
    /// Whether the adapted weight is a convolution kernel (its adapters are f16 kernels).
    conv: bool,
}

impl Delta {
    /// The rank of the adapter at run time ([`forms::Form::up`], [`forms::Form::down`]).
    fn rank(&self) -> usize {
        self.form.rank()
    }
}

/// The adapters of a request, by our internal tensor name, in application order.
#[derive(Debug, Default)]
pub struct LoraSet {
    deltas: HashMap<String, Vec<Delta>>,
    /// Bytes of the adapter files (for budgets and `plan`).
    file_bytes: u64,
    files: usize,
}

/// One tensor of an adapter key: a LoRA's `down`/`up` (and the Tucker core of a LyCORIS LoCon
/// convolution), a whole `diff`, a LyCORIS LoHa's or LoKr's factors (and cores), the key's
/// `alpha` or `scale`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Slot {
    Down,
    Up,
    Alpha,
    Scale,
    HadaW1A,
    HadaW1B,
    HadaW2A,
    HadaW2B,
    LokrW1,
    LokrW1A,
    LokrW1B,
    LokrW2,
    LokrW2A,
    LokrW2B,
    /// `lora_mid`: the Tucker core of a LoCon convolution (`[r, r, kh, kw]`).
    LoraMid,
    /// `hada_t1`, `hada_t2`: the Tucker cores of a LoHa convolution's two products.
    HadaT1,
    HadaT2,
    /// `lokr_t2`: a Tucker core of a LoKr factor (not applied, as the reference).
    LokrT2,
    /// `diff`: the whole delta (LyCORIS's full-rank files).
    Diff,
}

/// The tensors of one adapter key found in a file, by slot.
#[derive(Default)]
struct Parts(BTreeMap<Slot, String>);

impl Parts {
    fn get(&self, slot: Slot) -> Option<&str> {
        self.0.get(&slot).map(|s| s.as_str())
    }
}

/// The kind of an adapter key, by the tensors it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Lora,
    Diff,
    Loha,
    Lokr,
}

impl Kind {
    /// The kind of `p` in the reference's order of preference (a LoRA pair, then a whole diff,
    /// then LoHa, then LoKr); `None` when no kind has all its tensors.
    fn of(p: &Parts) -> Option<Kind> {
        let has = |s: Slot| p.0.contains_key(&s);
        if has(Slot::Up) && has(Slot::Down) {
            Some(Kind::Lora)
        } else if has(Slot::Diff) {
            Some(Kind::Diff)
        } else if [Slot::HadaW1A, Slot::HadaW1B, Slot::HadaW2A, Slot::HadaW2B].iter().all(|&s| has(s)) {
            Some(Kind::Loha)
        } else if (has(Slot::LokrW1) || (has(Slot::LokrW1A) && has(Slot::LokrW1B)))
            && (has(Slot::LokrW2) || (has(Slot::LokrW2A) && has(Slot::LokrW2B)))
        {
            Some(Kind::Lokr)
        } else {
            None
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Lora => "lora",
            Kind::Diff => "diff",
            Kind::Loha => "loha",
            Kind::Lokr => "lokr",
        }
    }
}

/// The adapter key and slot of a stored name; `None` for names of another kind (`diff_b`,
/// `dora_scale`, ...).
fn split_key(name: &str) -> Option<(&str, Slot)> {
    const SUFFIXES: [(&str, Slot); 26] = [
        (".lora_down.weight", Slot::Down),
        (".lora_up.weight", Slot::Up),
        (".lora.down.weight", Slot::Down),
        (".lora.up.weight", Slot::Up),
        (".lora_A.weight", Slot::Down),
        (".lora_B.weight", Slot::Up),
        (".lora_A.default.weight", Slot::Down),
        (".lora_B.default.weight", Slot::Up),
        (".alpha", Slot::Alpha),
        (".scale", Slot::Scale),
        (".hada_w1_a", Slot::HadaW1A),
        (".hada_w1_b", Slot::HadaW1B),
        (".hada_w2_a", Slot::HadaW2A),
        (".hada_w2_b", Slot::HadaW2B),
        (".lokr_w1", Slot::LokrW1),
        (".lokr_w1_a", Slot::LokrW1A),
        (".lokr_w1_b", Slot::LokrW1B),
        (".lokr_w2", Slot::LokrW2),
        (".lokr_w2_a", Slot::LokrW2A),
        (".lokr_w2_b", Slot::LokrW2B),
        (".lora_mid.weight", Slot::LoraMid),
        (".lora.mid.weight", Slot::LoraMid),
        (".hada_t1", Slot::HadaT1),
        (".hada_t2", Slot::HadaT2),
        (".lokr_t2", Slot::LokrT2),
        (".diff", Slot::Diff),
    ];
    SUFFIXES.iter().find_map(|(s, slot)| name.strip_suffix(s).map(|base| (base, *slot)))
}

/// Module names that keep their `_` when a kohya flat name is made dotted again (the names of
/// the UNet, CLIP, FLUX DiT and T5 modules, LDM and diffusers layouts, that contain `_`).
/// The reference's list (`convert_sep_to_dot`) lacks FLUX's `final_layer`, `img_in`,
/// `txt_in`, `time_in`, `vector_in`, `guidance_in`, `in_layer`, `out_layer` and
/// `adaLN_modulation`, and Z-Image's `feed_forward`, `noise_refiner`, `context_refiner`,
/// `t_embedder` and `cap_embedder`, so it drops kohya adapters of those modules; here they apply.
const KEEP_UNDERSCORE: [&str; 69] = [
    "final_layer_norm",
    "conv_norm_out",
    "time_emb_proj",
    "down_blocks",
    "up_blocks",
    "mid_block",
    "transformer_blocks",
    "to_q",
    "to_k",
    "to_v",
    "to_out",
    "proj_in",
    "proj_out",
    "conv_shortcut",
    "conv_in",
    "conv_out",
    "time_embedding",
    "linear_1",
    "linear_2",
    "input_blocks",
    "output_blocks",
    "middle_block",
    "in_layers",
    "out_layers",
    "emb_layers",
    "skip_connection",
    "time_embed",
    "label_emb",
    "add_embedding",
    "text_model",
    "self_attn",
    "q_proj",
    "k_proj",
    "v_proj",
    "out_proj",
    "layer_norm1",
    "layer_norm2",
    "token_embedding",
    "position_embedding",
    "text_projection",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "add_out_proj",
    "double_blocks",
    "single_blocks",
    "img_attn",
    "txt_attn",
    "img_mlp",
    "txt_mlp",
    "img_mod",
    "txt_mod",
    "img_in",
    "txt_in",
    "time_in",
    "vector_in",
    "guidance_in",
    "in_layer",
    "out_layer",
    "final_layer",
    "adaLN_modulation",
    "wi_0",
    "wi_1",
    "feed_forward",
    "noise_refiner",
    "context_refiner",
    "t_embedder",
    "cap_embedder",
    "x_embedder",
];

/// A kohya flat body (`down_blocks_0_attentions_0_proj_in`) made dotted
/// (`down_blocks.0.attentions.0.proj_in`).
pub(crate) fn dotted(flat: &str) -> String {
    dotted_keeping(flat, &[])
}

/// [`dotted`] that also keeps the `_` of a family's own module names `extra` (SD3's
/// `joint_blocks`, `x_block`, ...).
pub(crate) fn dotted_keeping(flat: &str, extra: &[&str]) -> String {
    let parts: Vec<&str> = flat.split('_').collect();
    let mut out: Vec<String> = Vec::with_capacity(parts.len());
    let mut i = 0;
    while i < parts.len() {
        let mut taken = 1;
        for n in [3, 2] {
            if i + n <= parts.len() {
                let joined = parts[i..i + n].join("_");
                if KEEP_UNDERSCORE.contains(&joined.as_str()) || extra.contains(&joined.as_str()) {
                    out.push(joined);
                    taken = n;
                    break;
                }
            }
        }
        if taken == 1 {
            out.push(parts[i].to_owned());
        }
        i += taken;
    }
    out.join(".")
}

/// Our internal name of the weight an adapter key adapts, through `table`, and the row block
/// of a fused weight it covers ([`LoraBody::Mapped`]; `None` for a whole weight).
fn target_of(key: &str, table: &[LoraPrefix]) -> Option<(String, Option<usize>)> {
    let key = key.strip_prefix("lora.").unwrap_or(key);
    let row = table.iter().filter(|r| key.starts_with(r.prefix)).max_by_key(|r| r.prefix.len())?;
    let body = &key[row.prefix.len()..];
    let (body, part) = match row.body {
        LoraBody::Dotted => (body.to_owned(), None),
        LoraBody::Flat => (dotted(body), None),
        LoraBody::Mapped(map) => map(body)?,
    };
    match normalize(&format!("{body}.weight"), row.role) {
        Normalized::One(name) => Some((name, part)),
        Normalized::Split(_) => None,
    }
}

/// The first element of a tensor as f32 (an alpha).
fn scalar(files: &ModelFiles, name: &str, path: &Path) -> Result<f32, LoraError> {
    let (e, _) = files.tensor(name).expect("listed by the index");
    let ne: Vec<i64> = e.ne().iter().map(|&v| v as i64).collect();
    let bytes = FileSource::new(files)
        .load_tensor(name, GgmlType::GGML_TYPE_F32, &ne)
        .map_err(|source| LoraError::Tensor { path: path.to_path_buf(), source })?;
    match bytes.get(..4) {
        Some(b) => Ok(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        None => Err(LoraError::Shape {
            path: path.to_path_buf(),
            tensor: name.to_owned(),
            problem: "alpha is empty".into(),
        }),
    }
}

/// A tensor as f32 with its file shape (outermost first).
fn matrix(files: &ModelFiles, name: &str, path: &Path) -> Result<(Vec<u64>, Vec<f32>), LoraError> {
    let (e, _) = files.tensor(name).expect("listed by the index");
    let shape = e.shape.clone();
    let ne: Vec<i64> = e.ne().iter().map(|&v| v as i64).collect();
    let bytes = FileSource::new(files)
        .load_tensor(name, GgmlType::GGML_TYPE_F32, &ne)
        .map_err(|source| LoraError::Tensor { path: path.to_path_buf(), source })?;
    let v = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok((shape, v))
}

/// An adapter key of a file matched to the weight it adapts ([`match_targets`]).
struct Matched<'k> {
    /// The key.
    base: &'k str,
    /// Its tensors.
    parts: &'k Parts,
    kind: Kind,
    /// Whether it adapts a row block of a fused weight (else the whole weight, as part 0).
    fused: bool,
}

/// The adapters of each weight, by part (a fused weight's row blocks, in order).
type ByTarget<'k> = BTreeMap<String, BTreeMap<usize, Matched<'k>>>;

/// The tensors of `files` grouped by adapter key and slot, and the names of the tensors of
/// kinds not applied (`diff_b`, `dora_scale`, ...).
fn adapter_keys(files: &ModelFiles) -> (BTreeMap<String, Parts>, Vec<String>) {
    let mut keys: BTreeMap<String, Parts> = BTreeMap::new();
    let mut other: Vec<String> = Vec::new();
    for e in files.index().entries() {
        match split_key(&e.original_name) {
            Some((base, slot)) => {
                keys.entry(base.to_owned()).or_default().0.insert(slot, e.name.clone());
            }
            None => other.push(e.original_name.clone()),
        }
    }
    (keys, other)
}

/// Matches each adapter key to the weight of `by_name` it names through `table`; the keys
/// that cannot be used (no complete kind, a Tucker-decomposed LoKr, no such weight, a second
/// adapter of one weight) go to `unmatched` with the reason.
fn match_targets<'k>(
    keys: &'k BTreeMap<String, Parts>,
    table: &[LoraPrefix],
    by_name: &HashMap<&str, &TensorSpec>,
    unmatched: &mut Vec<String>,
) -> ByTarget<'k> {
    let mut by_target = ByTarget::new();
    for (base, parts) in keys {
        let Some(kind) = Kind::of(parts) else {
            unmatched.push(format!("{base} (no up/down pair, diff, LoHa or LoKr factors)"));
            continue;
        };
        // As the reference: a LoKr factor's Tucker core is not read (it would drop the
        // core and apply the rest; here the key is reported instead).
        if kind == Kind::Lokr && parts.0.contains_key(&Slot::LokrT2) {
            unmatched.push(format!("{base} (a Tucker-decomposed lokr: not applied)"));
            continue;
        }
        let Some((target, part)) = target_of(base, table).filter(|(t, _)| by_name.contains_key(t.as_str())) else {
            unmatched.push(base.clone());
            continue;
        };
        // Two keys of one file for the same weight (say kohya's and diffusers' names of
        // one module): the first in name order is kept, as the reference keeps one tensor per name.
        let slot = by_target.entry(target.clone()).or_default();
        let (fused, part) = (part.is_some(), part.unwrap_or(0));
        if slot.contains_key(&part) {
            unmatched.push(format!("{base} (a second adapter of '{target}' in this file)"));
            continue;
        }
        slot.insert(part, Matched { base, parts, kind, fused });
    }
    by_target
}

/// Warns about what the file at `path` has that is not applied: tensors of other kinds
/// (`other`) and adapter keys that name no weight of the `family` model (`unmatched`, of `total`).
fn warn_left_out(path: &Path, family: &str, total: usize, other: &[String], unmatched: &[String]) {
    if !other.is_empty() {
        let first = other.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        tracing::warn!(
            "LoRA '{}': {} tensors of kinds not applied (diff_b, dora_scale; first: {first})",
            path.display(),
            other.len()
        );
    }
    if !unmatched.is_empty() {
        let first = unmatched.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        tracing::warn!(
            "LoRA '{}': {} of its {total} adapters name no tensor of the {family} model (first: {first})",
            path.display(),
            unmatched.len()
        );
    }
}

impl LoraSet {
    /// Reads `requests` (in order) for a model of `family` whose weights are `targets`, with
    /// the family's key `table`. Keys that name no weight are reported as a warning (count and
    /// first names); a file of which no key names a weight, and adapters whose shapes do not
    /// fit, are errors.
    pub fn load(
        requests: &[LoraRequest],
        family: &'static str,
        table: &[LoraPrefix],
        targets: &[TensorSpec],
    ) -> Result<LoraSet, LoraError> {
        let by_name: HashMap<&str, &TensorSpec> = targets.iter().map(|s| (s.name.as_str(), s)).collect();
        let mut set = LoraSet::default();
        for req in requests {
            set.add_file(req, family, table, &by_name)?;
        }
        Ok(set)
    }

    /// Reads the file of `req` into the set: every adapter key that names one of the weights
    /// `by_name` through `table`, read as a [`Delta`]. A file of which no key applies is an
    /// error; keys and tensors left out are reported as warnings.
    fn add_file(
        &mut self,
        req: &LoraRequest,
        family: &'static str,
        table: &[LoraPrefix],
        by_name: &HashMap<&str, &TensorSpec>,
    ) -> Result<(), LoraError> {
        let path = &req.path;
        let file_err = |source| LoraError::File { path: path.clone(), source: Box::new(source) };
        let files = ModelFiles::open_model(path).map_err(file_err)?;
        self.file_bytes += files.index().files().iter().map(|f| f.len).sum::<u64>();
        self.files += 1;
        let (keys, other) = adapter_keys(&files);
        let mut unmatched: Vec<String> = Vec::new();
        let total = keys.len();
        let by_target = match_targets(&keys, table, by_name, &mut unmatched);
        let applied = self.read_targets(&files, req, by_target, by_name, &mut unmatched)?;
        if applied == 0 {
            let first = keys.keys().chain(other.iter()).take(3).cloned().collect::<Vec<_>>().join(", ");
            return Err(LoraError::NothingMatches { path: path.clone(), family, keys: total, first });
        }
        warn_left_out(path, family, total, &other, &unmatched);
        tracing::info!("LoRA '{}' x{}: {applied} of {total} adapters applied", path.display(), req.multiplier);
        Ok(())
    }

    /// Reads the adapters `by_target` matched in `files` (the file of `req`) and adds them to
    /// the set; returns how many were read. As the reference, the parts of a fused weight stack
    /// from part 0 on and stop at the first one missing: what follows a gap adapts nothing and
    /// goes to `unmatched`.
    fn read_targets(
        &mut self,
        files: &ModelFiles,
        req: &LoraRequest,
        by_target: ByTarget<'_>,
        by_name: &HashMap<&str, &TensorSpec>,
        unmatched: &mut Vec<String>,
    ) -> Result<usize, LoraError> {
        let mut applied = 0usize;
        for (target, parts) in by_target {
            let spec = by_name[target.as_str()];
            let mut offset = 0usize;
            for (k, (part, m)) in parts.into_iter().enumerate() {
                if part != k {
                    unmatched.push(format!("{} (part {part} of '{target}' without part {k})", m.base));
                    continue;
                }
                let at = m.fused.then_some(offset);
                let r = KeyReader { files, path: &req.path, base: m.base, key: m.parts };
                let delta = read_delta(&r, m.kind, req.multiplier, spec, at)?;
                offset += delta.out;
                self.deltas.entry(target.clone()).or_default().push(delta);
                applied += 1;
            }
        }
        Ok(applied)
    }

    /// Bytes of the adapter files read.
    pub fn file_bytes(&self) -> u64 {
        self.file_bytes
    }

    /// Number of weights adapted.
    pub fn targets(&self) -> usize {
        self.deltas.len()
    }

    /// Whether an adapter names the weight `name`.
    pub(crate) fn adapts(&self, name: &str) -> bool {
        self.deltas.contains_key(name)
    }

    /// `bytes` (the tensor `name` as `ty`, shape `ne`) with every adapter of `name` added, in
    /// order, each sum stored in `ty` before the next; `None` when no adapter names it.
    pub fn merge(&self, name: &str, ty: GgmlType, ne: &[i64], bytes: &[u8]) -> Option<Result<Vec<u8>, String>> {
        let deltas = self.deltas.get(name)?;
        Some(merge_all(deltas, ty, ne, bytes))
    }
}

fn merge_all(deltas: &[Delta], ty: GgmlType, ne: &[i64], bytes: &[u8]) -> Result<Vec<u8>, String> {
    let n: i64 = ne.iter().product();
    let row = ne.first().copied().unwrap_or(1).max(1);
    let mut packed = bytes.to_vec();
    for d in deltas {
        let mut w = convert::to_f32(ty, &packed, n).map_err(|e| e.to_string())?;
        d.form.add_rows(&mut w, d.out, d.inner, d.offset, d.scale);
        // Never an infinite weight made silently (the scale is bounded, the sum may still
        // overflow: a large weight plus a large delta, or beyond f16's range).
        let limit = if ty == GgmlType::GGML_TYPE_F16 { 65504.0 } else { f32::MAX };
        if let Some(i) = w.iter().position(|x| x.is_nan() || x.abs() > limit) {
            return Err(format!(
                "the merged weight's element {i} is {} (beyond what {} holds): the adapter's scale {} is too \
                 large for it",
                w[i],
                sd_backends::type_name(ty),
                d.scale
            ));
        }
        packed = convert::pack_f32(ty, &w, row).map_err(|e| e.to_string())?;
    }
    Ok(packed)
}

/// `[cols, rows]` of a row-major `[rows, cols]` matrix.
fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; m.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = m[r * cols + c];
        }
    }
    t
}

/// A Tucker-decomposed convolution delta's `down` with its core folded in: the core `mid`
/// (file shape `[ra, rb, kh, kw]`, `ra` meeting `up`'s rank and `rb` `down`'s rows) times
/// `down` (`[rb, in]`, a 1x1 kernel), as `[ra, in * kh * kw]` (a kernel's row width, input
/// channel first): `d[a, i kh kw + t] = sum_b mid[a, b, t] down[b, i]`, summed over `b` in
/// order. So `up @ d` is the delta LyCORIS rebuilds (`up[o, a] mid[a, b, t] down[b, i]`), the
/// composition down, core, up that the reference's at_runtime graph runs too (its merge pairs
/// the core's axes otherwise: docs/models.md). `None` when the shapes do not fit.
fn tucker_down(
    mid_shape: &[u64],
    mid: &[f32],
    (ra, rb): (usize, usize),
    down: &[f32],
    input: usize,
) -> Option<(Vec<f32>, usize)> {
    let [a, b, kh, kw] = <[u64; 4]>::try_from(mid_shape).ok()?;
    if a as usize != ra || b as usize != rb || down.len() != rb * input {
        return None;
    }
    let kk = (kh * kw) as usize;
    let inner = input * kk;
    let mut d = vec![0f32; ra * inner];
    for a in 0..ra {
        let row = &mut d[a * inner..(a + 1) * inner];
        for b in 0..rb {
            let core = &mid[(a * rb + b) * kk..(a * rb + b + 1) * kk];
            for (i, &w) in down[b * input..(b + 1) * input].iter().enumerate() {
                for (x, c) in row[i * kk..(i + 1) * kk].iter_mut().zip(core) {
                    *x += c * w;
                }
            }
        }
    }
    Some((d, inner))
}

/// `(rows, numel / rows)` of a file shape: a matrix's rows and their width (a kernel's
/// `in x kh x kw`).
fn rows_cols(shape: &[u64], n: usize) -> Option<(usize, usize)> {
    match shape.first() {
        Some(&r) if r > 0 && n.is_multiple_of(r as usize) => Some((r as usize, n / r as usize)),
        _ => None,
    }
}

/// Reads the adapter key `r` (of kind `kind`, [`Kind::of`]) for `target`, with `multiplier`:
/// the whole weight (`at` `None`: the delta must have the weight's shape), or the row block
/// of a fused weight from row `at` (the weight's row width, within its rows).
///
/// Every factor's shape is checked against the others and the delta's against the weight's
/// (never added to some of its rows: the reference pads a delta with too few rows with zeros
/// and warns; a file of the wrong model is refused here), and the scale
/// `|multiplier x alpha / rank|` must be at most [`MAX_SCALE`] (non-finite values are refused
/// as the file's tensors are read).
///
/// Scale, as the reference: a LoRA's `scale` tensor, else `alpha / rank` (rank: `down`'s first
/// dimension), else 1; a LoHa's `alpha / rank` (rank: `hada_w1_b`'s first dimension), else 1;
/// a LoKr's `alpha / rank` with rank the first dimension of `lokr_w2_b`, else of `lokr_w1_b`,
/// and a scale of 1 when neither factor is decomposed (or the rank is 1) or there is no alpha.
/// Each is then times the multiplier.
fn read_delta(
    r: &KeyReader<'_>,
    kind: Kind,
    multiplier: f32,
    target: &TensorSpec,
    at: Option<usize>,
) -> Result<Delta, LoraError> {
    use forms::{Factor, FactorValues, Form};
    let alpha = r.scalar(Slot::Alpha)?;
    let d = match kind {
        Kind::Lora => lora_delta(r, alpha)?,
        Kind::Diff => {
            // The whole delta, as the weight's own shape; scaled by the multiplier alone.
            let (_, v, out, inner) = r.read(Slot::Diff)?;
            let form = Form::Full(Factor { rows: out, cols: inner, values: FactorValues::Whole(v) });
            KeyDelta { form, out, inner, scale: 1.0, f16: false }
        }
        Kind::Loha => loha_delta(r, alpha)?,
        Kind::Lokr => lokr_delta(r, alpha)?,
    };
    check_fits(r, kind, &d, target, at)?;
    let scale = total_scale(r, alpha, d.scale, multiplier)?;
    let rows = target.ne.last().copied().unwrap_or(1).max(1);
    let conv = target.ne.len() == 4;
    let (form, out, inner, f16) = (d.form, d.out, d.inner, d.f16);
    Ok(Delta { form, out, inner, offset: at.unwrap_or(0), rows: rows as usize, scale, f16, conv })
}

/// One adapter key of an open LoRA file, whose tensors [`read_delta`] reads.
struct KeyReader<'a> {
    files: &'a ModelFiles,
    /// The file (named in errors).
    path: &'a Path,
    /// The key (named in errors).
    base: &'a str,
    /// The key's tensors.
    key: &'a Parts,
}

impl KeyReader<'_> {
    /// A shape error naming the file and the key.
    fn shape_err(&self, problem: String) -> LoraError {
        LoraError::Shape { path: self.path.to_path_buf(), tensor: self.base.to_owned(), problem }
    }

    /// Whether the key has a tensor in `slot`.
    fn has(&self, slot: Slot) -> bool {
        self.key.get(slot).is_some()
    }

    /// The stored name of the key's tensor in `slot`, which [`Kind::of`] found there.
    fn name(&self, slot: Slot) -> &str {
        self.key.get(slot).expect("Kind::of checked the slot")
    }

    /// The file shape of the stored tensor `name` (empty when the file has none).
    fn shape_of(&self, name: &str) -> Vec<u64> {
        self.files.tensor(name).map(|(e, _)| e.shape.clone()).unwrap_or_default()
    }

    /// The key's matrix in `slot`: its file shape, values, rows and row width.
    fn read(&self, slot: Slot) -> Result<(Vec<u64>, Vec<f32>, usize, usize), LoraError> {
        let (shape, v) = matrix(self.files, self.name(slot), self.path)?;
        let (r, c) = rows_cols(&shape, v.len())
            .ok_or_else(|| self.shape_err(format!("{} has shape {shape:?}", self.name(slot))))?;
        Ok((shape, v, r, c))
    }

    /// The key's scalar in `slot` (an alpha or a scale); `None` when it has none.
    fn scalar(&self, slot: Slot) -> Result<Option<f32>, LoraError> {
        self.key.get(slot).map(|name| scalar(self.files, name, self.path)).transpose()
    }

    /// Whether the key's tensor in `slot` is stored as f16.
    fn is_f16(&self, slot: Slot) -> bool {
        self.files.tensor(self.name(slot)).is_some_and(|(e, _)| e.dtype == crate::files::DType::F16)
    }
}

/// A key's delta as the file gives it, before it is checked against the weight it adapts.
struct KeyDelta {
    form: forms::Form,
    /// Rows and row width of the delta.
    out: usize,
    inner: usize,
    /// The file's scale (the kind's rule, [`read_delta`]), before the multiplier.
    scale: f32,
    /// Whether a LoRA's both matrices are f16 in the file ([`Delta::f16`]).
    f16: bool,
}

/// A LoRA pair's delta, `up @ down`, with a LoCon convolution's Tucker core folded into `down`;
/// its scale is the key's `scale` tensor, else `alpha / rank`, else 1.
fn lora_delta(r: &KeyReader<'_>, alpha: Option<f32>) -> Result<KeyDelta, LoraError> {
    let (up_shape, up, out, rank_up) = r.read(Slot::Up)?;
    let (down_shape, down, rank, inner) = r.read(Slot::Down)?;
    // The reference's rank (for alpha / rank) is down's first dimension, core or not.
    let scale = match (r.scalar(Slot::Scale)?, alpha) {
        (Some(s), _) => s,
        (None, Some(a)) => a / rank as f32,
        (None, None) => 1.0,
    };
    if r.has(Slot::LoraMid) {
        // LoCon with a Tucker core: up 1x1, the core carries the kernel, down 1x1.
        let (mid_shape, mid, _, _) = r.read(Slot::LoraMid)?;
        let (down, inner) = tucker_down(&mid_shape, &mid, (rank_up, rank), &down, inner).ok_or_else(|| {
            r.shape_err(format!(
                "Tucker core {mid_shape:?} does not fit lora_up {up_shape:?} x lora_down {down_shape:?}"
            ))
        })?;
        return Ok(KeyDelta { form: forms::Form::LowRank { up, down, rank: rank_up }, out, inner, scale, f16: false });
    }
    if rank_up != rank {
        return Err(r.shape_err(format!(
            "rank mismatch: up {up_shape:?} has rank {rank_up}, down {down_shape:?} has rank {rank}"
        )));
    }
    let f16 = r.is_f16(Slot::Up) && r.is_f16(Slot::Down);
    Ok(KeyDelta { form: forms::Form::LowRank { up, down, rank }, out, inner, scale, f16 })
}

/// One of a LoHa's two products: `up` `[out, rank]` and `down` `[rank, inner]`.
struct Product {
    up: Vec<f32>,
    out: usize,
    rank: usize,
    down: Vec<f32>,
    inner: usize,
    /// `b`'s first dimension: the reference's rank for `alpha / rank`.
    rank_b: usize,
}

/// A LoHa product from its factors `a` [out, rank] (a Tucker product's stored [rank, out], as
/// LyCORIS writes it; the reference transposes it too) and `b` [rank_b, inner], with the Tucker
/// `core` folded into `b` when the key has one. `None` when the shapes do not fit.
fn loha_product(r: &KeyReader<'_>, a: Slot, b: Slot, core: Slot) -> Result<Option<Product>, LoraError> {
    let (_, up, d0, d1) = r.read(a)?;
    let (_, down, rank_b, inner) = r.read(b)?;
    if !r.has(core) {
        return Ok((d1 == rank_b).then_some(Product { up, out: d0, rank: d1, down, inner, rank_b }));
    }
    let (cs, cv, _, _) = r.read(core)?;
    Ok(tucker_down(&cs, &cv, (d0, rank_b), &down, inner).map(|(down, inner)| Product {
        up: transpose(&up, d0, d1),
        out: d1,
        rank: d0,
        down,
        inner,
        rank_b,
    }))
}

/// A LoHa's delta, the elementwise product of its two products; its scale is
/// `alpha / rank` (rank: `hada_w1_b`'s first dimension), else 1.
fn loha_delta(r: &KeyReader<'_>, alpha: Option<f32>) -> Result<KeyDelta, LoraError> {
    let p1 = loha_product(r, Slot::HadaW1A, Slot::HadaW1B, Slot::HadaT1)?;
    let p2 = loha_product(r, Slot::HadaW2A, Slot::HadaW2B, Slot::HadaT2)?;
    let Some((p1, p2)) = p1.zip(p2).filter(|(p1, p2)| p1.out == p2.out && p1.inner == p2.inner) else {
        let shape = |slot: Slot| r.shape_of(r.name(slot));
        return Err(r.shape_err(format!(
            "LoHa factors do not fit: hada_w1_a {:?} x hada_w1_b {:?}, hada_w2_a {:?} x hada_w2_b {:?}",
            shape(Slot::HadaW1A),
            shape(Slot::HadaW1B),
            shape(Slot::HadaW2A),
            shape(Slot::HadaW2B)
        )));
    };
    let scale = alpha.map_or(1.0, |a| a / p1.rank_b as f32);
    let (out, inner) = (p1.out, p1.inner);
    let form = forms::Form::Hadamard { a1: p1.up, b1: p1.down, r1: p1.rank, a2: p2.up, b2: p2.down, r2: p2.rank };
    Ok(KeyDelta { form, out, inner, scale, f16: false })
}

/// A LoKr factor, stored whole (`whole`) or as the product of `a` and `b` (`name` is the
/// factor's name in errors).
fn lokr_factor(r: &KeyReader<'_>, whole: Slot, a: Slot, b: Slot, name: &str) -> Result<forms::Factor, LoraError> {
    use forms::{Factor, FactorValues};
    if r.has(whole) {
        let (_, v, rows, cols) = r.read(whole)?;
        return Ok(Factor { rows, cols, values: FactorValues::Whole(v) });
    }
    let (sa, va, rows, rank) = r.read(a)?;
    let (sb, vb, rb, cols) = r.read(b)?;
    if rank != rb {
        return Err(r.shape_err(format!("LoKr {name}_a {sa:?} x {name}_b {sb:?}: ranks {rank} and {rb}")));
    }
    Ok(Factor { rows, cols, values: FactorValues::LowRank { a: va, b: vb, rank } })
}

/// A LoKr's delta, the Kronecker product of its two factors; its scale is `alpha / rank` with
/// rank the first dimension of `lokr_w2_b`, else of `lokr_w1_b`, and 1 when neither factor is
/// decomposed (or the rank is 1) or there is no alpha.
fn lokr_delta(r: &KeyReader<'_>, alpha: Option<f32>) -> Result<KeyDelta, LoraError> {
    use forms::FactorValues;
    let w1 = lokr_factor(r, Slot::LokrW1, Slot::LokrW1A, Slot::LokrW1B, "lokr_w1")?;
    let w2 = lokr_factor(r, Slot::LokrW2, Slot::LokrW2A, Slot::LokrW2B, "lokr_w2")?;
    // The reference's rank: w2's if it is a product, else w1's, else 1 (scale 1).
    let rank = match (&w2.values, &w1.values) {
        (FactorValues::LowRank { rank, .. }, _) | (_, FactorValues::LowRank { rank, .. }) => *rank,
        _ => 1,
    };
    let scale = match alpha {
        Some(a) if rank != 1 => a / rank as f32,
        _ => 1.0,
    };
    let (out, inner) = (w1.rows * w2.rows, w1.cols * w2.cols);
    Ok(KeyDelta { form: forms::Form::Kron { w1, w2 }, out, inner, scale, f16: false })
}

/// Checks that the delta `d` fits `target`: a whole weight (`at` `None`) takes a delta of its
/// own shape (rows and row width); a row block of a fused one from row `at` takes the weight's
/// row width, within its rows. The error names every factor's shape and the weight's.
fn check_fits(
    r: &KeyReader<'_>,
    kind: Kind,
    d: &KeyDelta,
    target: &TensorSpec,
    at: Option<usize>,
) -> Result<(), LoraError> {
    let (out, inner) = (d.out, d.inner);
    let want: i64 = target.ne.iter().product();
    let rows = target.ne.last().copied().unwrap_or(1).max(1);
    let conv = target.ne.len() == 4;
    let offset = at.unwrap_or(0);
    let fits = match at {
        None => out as i64 == rows && (out * inner) as i64 == want,
        Some(_) => !conv && inner as i64 * rows == want && (offset + out) as i64 <= rows,
    };
    if fits {
        return Ok(());
    }
    let torch: Vec<i64> = target.ne.iter().rev().copied().collect();
    let at = if offset > 0 { format!(" at row {offset}") } else { String::new() };
    let parts: Vec<String> = r
        .key
        .0
        .iter()
        .filter(|(s, _)| !matches!(s, Slot::Alpha | Slot::Scale))
        .map(|(_, name)| format!("{name} {:?}", r.shape_of(name)))
        .collect();
    Err(r.shape_err(format!(
        "the {} delta of {} is [{out}, {inner}]{at}; the weight '{}' has shape {torch:?}",
        kind.name(),
        parts.join(", "),
        target.name
    )))
}

/// The adapter's scale, the file's `scale` times `multiplier`, refused when it is NaN or
/// beyond [`MAX_SCALE`] in magnitude.
fn total_scale(r: &KeyReader<'_>, alpha: Option<f32>, scale: f32, multiplier: f32) -> Result<f32, LoraError> {
    // f32: a multiplier of 1e38 times an alpha of 2 is infinite, not refused as large.
    let total = f64::from(scale) * f64::from(multiplier);
    if total.is_nan() || total.abs() > f64::from(MAX_SCALE) {
        let alpha = alpha.map_or(String::new(), |a| format!(" (alpha {a:e})"));
        return Err(LoraError::Value {
            path: r.path.to_path_buf(),
            tensor: r.base.to_owned(),
            problem: format!(
                "the adapter's scale, multiplier x the file's scale{alpha}, is {multiplier:e} x {scale:e} = \
                 {total:.3e}: at most {MAX_SCALE} in magnitude is accepted"
            ),
        });
    }
    Ok(total as f32)
}

/// A [`TensorSource`] that adds a [`LoraSet`]'s adapters to what another source reads.
pub struct MergedSource {
    inner: Arc<dyn TensorSource + Send + Sync>,
    set: Arc<LoraSet>,
}

impl MergedSource {
    /// `inner` with `set` merged into every tensor it names.
    pub fn new(inner: Arc<dyn TensorSource + Send + Sync>, set: Arc<LoraSet>) -> Self {
        Self { inner, set }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("merging the LoRA adapters into '{tensor}': {problem}")]
struct MergeError {
    tensor: String,
    problem: String,
}

impl TensorSource for MergedSource {
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        let bytes = self.inner.load(name, ty, ne)?;
        match self.set.merge(name, ty, ne, &bytes) {
            None => Ok(bytes),
            Some(Ok(merged)) => Ok(Cow::Owned(merged)),
            Some(Err(problem)) => Err(SourceError::new(MergeError { tensor: name.to_owned(), problem })),
        }
    }

    fn release(&self, name: &str) {
        self.inner.release(name)
    }

    /// The inner source's mapped bytes of the tensors no adapter changes.
    fn mapped(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Option<MappedBytes>, SourceError> {
        if self.set.adapts(name) {
            return Ok(None);
        }
        self.inner.mapped(name, ty, ne)
    }
}

#[cfg(test)]
mod tests;
