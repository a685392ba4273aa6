//! Architecture detection through an in-binary registry (`inventory`).
//!
//! Each model family submits an [`ArchSpec`] from its own file; [`detect`] asks every
//! registered spec whether the tensors are its own. Exactly one must answer: none is an
//! error that lists what was found (notable tensors, shapes and name prefixes), more than
//! one is an error naming the candidates. No central `match` has to grow when a family
//! is added, and a binary links a family by `use`-ing the module that registers it.
//!
//! Prediction type (eps or v) comes, in order, from the user's override (`--prediction`),
//! from file metadata ([`prediction_from_metadata`]), or stays unknown. sd.cpp decides an
//! SD 2.x file without metadata by running the UNet once on a probe input; that needs the
//! model graph, so here it is reported as unknown and left to the caller.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::error::FilesError;
use super::index::TensorIndex;

/// One registered model architecture.
#[derive(Debug)]
pub struct ArchSpec {
    /// Short unique name (`"sd1"`).
    pub name: &'static str,
    /// What users call it (`"Stable Diffusion 1.x"`).
    pub description: &'static str,
    /// Returns the detection when the tensors are of this architecture.
    pub detect: fn(&TensorIndex) -> Option<Detected>,
    /// Tensors whose shapes the unknown-architecture error shows when the files hold them
    /// (the ones `detect` reads).
    pub notable: &'static [&'static str],
    /// The family's block numbering of the files' tensors, in execution order: its
    /// diffusion model's blocks and its dominant text encoder's layers. The one owner of
    /// block numbers, read by plans and layer splits through [`TensorIndex::block_of`].
    pub blocks: fn(&TensorIndex) -> BlockFn,
}

/// A block numbering built for one set of files: a tensor's internal name to its block.
pub type BlockFn = Arc<dyn Fn(&str) -> Option<u32> + Send + Sync>;

/// The registered architectures that detect `index`, sorted by name, with their detections
/// (run once, when the index is built: [`TensorIndex::matched`]).
pub(crate) fn matching(index: &TensorIndex) -> Vec<(&'static ArchSpec, Detected)> {
    registered().into_iter().filter_map(|s| (s.detect)(index).map(|d| (s, d))).collect()
}

inventory::collect!(ArchSpec);

pub use sd_sampling::Prediction;

/// Where the prediction type came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PredictionSource {
    /// The user's override.
    Override,
    /// A metadata key (or marker tensor) of the files.
    Metadata { key: String },
    /// The architecture has only one (SD 1.x is always eps).
    ArchDefault,
    /// Neither; the caller decides (sd.cpp probes the UNet for SD 2.x).
    Unknown,
}

/// The result of detection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detected {
    /// [`ArchSpec::name`] of the architecture.
    pub arch: &'static str,
    /// Width of the text-encoder output the UNet cross-attends to (768 SD 1.x, 1024 SD 2.x).
    pub context_dim: u64,
    pub prediction: Option<Prediction>,
    pub prediction_source: PredictionSource,
}

/// Every registered architecture, sorted by name.
pub fn registered() -> Vec<&'static ArchSpec> {
    let mut v: Vec<&'static ArchSpec> = inventory::iter::<ArchSpec>.into_iter().collect();
    v.sort_by_key(|a| a.name);
    v
}

/// Metadata keys read for the prediction type, in order. Values are parsed with
/// [`Prediction::from_metadata`]; `ss_v_parameterization` (kohya) is a boolean string.
const PREDICTION_KEYS: &[&str] =
    &["modelspec.prediction_type", "prediction_type", "diffusers.scheduler.prediction_type", "ss_v_parameterization"];

/// The prediction type the files declare: a metadata key of [`PREDICTION_KEYS`], or a
/// `v_pred` marker tensor (the convention sd.cpp reads for SDXL v-pred files).
pub fn prediction_from_metadata(index: &TensorIndex) -> Option<(Prediction, String)> {
    for &key in PREDICTION_KEYS {
        let Some((file, value)) = index.metadata(key) else { continue };
        let Some(s) = value.as_str() else {
            tracing::warn!(key, file = %file.path.display(), "prediction metadata is not a string; ignored");
            continue;
        };
        let parsed = if key == "ss_v_parameterization" {
            match s.to_ascii_lowercase().as_str() {
                "true" => Some(Prediction::V),
                "false" => None,
                _ => None,
            }
        } else {
            Prediction::from_metadata(s)
        };
        match parsed {
            Some(p) => return Some((p, key.to_owned())),
            None if key == "ss_v_parameterization" => {}
            None => {
                tracing::warn!(key, value = s, file = %file.path.display(), "unknown prediction type in metadata; ignored")
            }
        }
    }
    index.contains("v_pred").then(|| (Prediction::V, "v_pred".to_owned()))
}

/// Detects the architecture of `index` with the registered specs; `prediction` overrides
/// what the files say.
pub fn detect(index: &TensorIndex, prediction: Option<Prediction>) -> Result<Detected, FilesError> {
    let found = index.matched();
    match found.len() {
        0 => Err(FilesError::UnknownArchitecture {
            files: index.files().iter().map(|f| format!("'{}'", f.path.display())).collect::<Vec<_>>().join(", "),
            known: registered()
                .iter()
                .map(|s| format!("{} ({})", s.name, s.description))
                .collect::<Vec<_>>()
                .join(", "),
            found: summarize(index),
        }),
        1 => {
            let (spec, mut d) = found[0].clone();
            if let Some(p) = prediction {
                d.prediction = Some(p);
                d.prediction_source = PredictionSource::Override;
            }
            tracing::info!(arch = spec.name, prediction = ?d.prediction, source = ?d.prediction_source, "model architecture detected");
            Ok(d)
        }
        _ => Err(FilesError::AmbiguousArchitecture { candidates: found.iter().map(|(s, _)| s.name).collect() }),
    }
}

/// A short description of what the index holds, for the unknown-architecture error.
pub fn summarize(index: &TensorIndex) -> String {
    if index.is_empty() {
        return "no tensors at all".to_owned();
    }
    let mut prefixes: BTreeMap<String, usize> = BTreeMap::new();
    for e in index.entries() {
        let mut parts = e.name.split('.');
        let head = match (parts.next(), parts.next()) {
            (Some(a), Some(b)) if !b.is_empty() => format!("{a}.{b}"),
            (Some(a), _) => a.to_owned(),
            _ => String::new(),
        };
        *prefixes.entry(head).or_default() += 1;
    }
    let mut top: Vec<(String, usize)> = prefixes.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut out = format!("{} tensors; prefixes: ", index.len());
    out += &top.iter().take(8).map(|(p, n)| format!("{p}.* ({n})")).collect::<Vec<_>>().join(", ");
    if top.len() > 8 {
        out += &format!(", and {} more", top.len() - 8);
    }
    let mut notable: Vec<&str> = Vec::new();
    for spec in registered() {
        for n in spec.notable {
            if !notable.contains(n) {
                notable.push(n);
            }
        }
    }
    let shapes: Vec<String> =
        notable.iter().filter_map(|n| index.get(n).map(|e| format!("{} {:?}", e.name, e.shape))).collect();
    if shapes.is_empty() {
        out += "; none of the SD tensors this build knows (";
        let mut firsts: Vec<&str> = registered().iter().filter_map(|s| s.notable.first().copied()).collect();
        firsts.dedup();
        out += &firsts.join(", ");
        out += ")";
    } else {
        out += "; notable: ";
        out += &shapes.join(", ");
    }
    let examples: Vec<&str> = index.entries().iter().take(3).map(|e| e.original_name.as_str()).collect();
    out += &format!("; first stored names: {}", examples.join(", "));
    out
}
