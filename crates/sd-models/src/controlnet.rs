//! A ControlNet file (the `controlnet` module): opened and checked against the model it
//! controls from its header, before any weight is read; its weights loaded per generation.
//!
//! The network is [`crate::diffusion::controlnet`]. Files name their tensors
//! `control_model.<module>` (the common `control_v11p_sd15_*.safetensors`) or `<module>` alone
//! (the reference strips the prefix, so both load there); here both are read under
//! [`PREFIX`]. The file's widths (model channels, context width, skip connections, a class
//! embedding) must be the controlled UNet's: a ControlNet for another family is refused with
//! what the file has and what the model needs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use sd_backends::GgmlType;
use sd_sched::{MappedBytes, SourceError, TensorSource, TensorSpec};

use crate::diffusion::controlnet::{controlnet_specs, ControlNetConfig, PREFIX};
use crate::diffusion::TensorProblem;
use crate::files::{FilesError, ModelFiles};
use crate::loader::{ggml_type, FileSource};

/// Errors of a ControlNet file.
#[derive(Debug, thiserror::Error)]
pub enum ControlNetError {
    /// The file cannot be opened or read as a model file.
    #[error("ControlNet '{}'", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<FilesError>,
    },
    /// The file has no ControlNet hint encoder.
    #[error("'{}' is not a ControlNet: it has no tensor '{PREFIX}.input_hint_block.0.weight' (nor 'input_hint_block.0.weight')", path.display())]
    NotControlNet {
        /// The file.
        path: PathBuf,
    },
    /// The model's family takes no ControlNet.
    #[error("the {arch} model takes no ControlNet ('{}')", path.display())]
    Unsupported {
        /// The model's architecture.
        arch: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// The ControlNet is for a UNet of other widths (another family).
    #[error("ControlNet '{}' is for another model: it has {found}; the {arch} model needs {expected}", path.display())]
    OtherFamily {
        /// The file.
        path: PathBuf,
        /// The model's architecture.
        arch: &'static str,
        /// What the file's tensors show.
        found: String,
        /// What the model's UNet needs.
        expected: String,
    },
    /// Tensors missing or of the wrong shape.
    #[error("ControlNet '{}': {} tensor(s) disagree with the network: {}", path.display(), problems.len(),
        problems.iter().take(5).map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Tensors {
        /// The file.
        path: PathBuf,
        /// Each disagreement.
        problems: Vec<TensorProblem>,
    },
}

/// The widths of a ControlNet that decide which UNet it fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Widths {
    model_channels: i64,
    context_dim: i64,
    skips: usize,
    class_embedding: bool,
}

impl Widths {
    fn of_config(cfg: &ControlNetConfig) -> Self {
        Widths {
            model_channels: cfg.unet.model_channels,
            context_dim: cfg.unet.context_dim,
            skips: cfg.residuals() - 1,
            class_embedding: cfg.unet.adm_in_channels.is_some(),
        }
    }

    fn describe(&self) -> String {
        let kind = match (self.context_dim, self.class_embedding) {
            (2048, true) => " (an SDXL ControlNet's)",
            (768, false) => " (an SD 1.x ControlNet's)",
            (1024, false) => " (an SD 2.x ControlNet's)",
            _ => "",
        };
        format!(
            "{} model channels, context width {}, {} skip connections, {}{kind}",
            self.model_channels,
            self.context_dim,
            self.skips,
            if self.class_embedding { "a class embedding" } else { "no class embedding" }
        )
    }
}

/// A checked ControlNet file: its configuration and its tensors under [`PREFIX`], nothing
/// loaded.
pub struct ControlNetFile {
    path: PathBuf,
    files: ModelFiles,
    config: ControlNetConfig,
    /// Name under [`PREFIX`] -> the index's name.
    names: HashMap<String, String>,
}

impl std::fmt::Debug for ControlNetFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlNetFile").field("path", &self.path).finish()
    }
}

impl ControlNetFile {
    /// Opens `path` and checks it against `config` (the controlled UNet's ControlNet, `None`
    /// when the model `arch` takes none): the hint encoder exists, the widths are the UNet's and
    /// every tensor the network reads has its shape.
    pub fn open(path: &Path, arch: &'static str, config: Option<ControlNetConfig>) -> Result<Self, ControlNetError> {
        let p = || path.to_path_buf();
        let config = config.ok_or_else(|| ControlNetError::Unsupported { arch, path: p() })?;
        let files =
            ModelFiles::open_model(path).map_err(|e| ControlNetError::Open { path: p(), source: Box::new(e) })?;
        let prefix = format!("{PREFIX}.");
        let names: HashMap<String, String> = files
            .index()
            .entries()
            .iter()
            .map(|e| {
                let bare = e.original_name.strip_prefix(&prefix).unwrap_or(&e.original_name);
                (format!("{prefix}{bare}"), e.name.clone())
            })
            .collect();
        let ne_of =
            |name: &str| -> Option<Vec<u64>> { names.get(name).and_then(|n| files.index().get(n)).map(|e| e.ne()) };
        if ne_of(&format!("{prefix}input_hint_block.0.weight")).is_none() {
            return Err(ControlNetError::NotControlNet { path: p() });
        }
        // The widths the file shows.
        let skips = (0..).take_while(|i| ne_of(&format!("{prefix}zero_convs.{i}.0.weight")).is_some()).count();
        let model_channels =
            ne_of(&format!("{prefix}input_blocks.0.0.weight")).filter(|ne| ne.len() == 4).map_or(0, |ne| ne[3] as i64);
        let mut attn: Vec<&String> =
            names.keys().filter(|n| n.ends_with(".transformer_blocks.0.attn2.to_k.weight")).collect();
        attn.sort();
        let context_dim = attn.first().and_then(|n| ne_of(n)).map_or(0, |ne| ne[0] as i64);
        let found = Widths {
            model_channels,
            context_dim,
            skips,
            class_embedding: ne_of(&format!("{prefix}label_emb.0.0.weight")).is_some(),
        };
        let expected = Widths::of_config(&config);
        if found != expected {
            return Err(ControlNetError::OtherFamily {
                path: p(),
                arch,
                found: found.describe(),
                expected: expected.describe(),
            });
        }
        let file = Self { path: p(), files, config, names };
        let problems = file.problems();
        if !problems.is_empty() {
            return Err(ControlNetError::Tensors { path: p(), problems });
        }
        Ok(file)
    }

    /// Missing tensors and shape mismatches against the network's specs.
    fn problems(&self) -> Vec<TensorProblem> {
        fn trim(ne: &[i64]) -> Vec<i64> {
            let mut v = ne.to_vec();
            while v.len() > 1 && v.last() == Some(&1) {
                v.pop();
            }
            v
        }
        let mut problems = Vec::new();
        for s in self.specs(None) {
            match self.names.get(&s.name).and_then(|n| self.files.index().get(n)) {
                None => problems.push(TensorProblem::Missing { name: s.name.clone(), expected: s.ne.clone() }),
                Some(e) => {
                    let found: Vec<i64> = e.ne().iter().map(|&d| d as i64).collect();
                    if trim(&found) != trim(&s.ne) {
                        problems.push(TensorProblem::Shape { name: s.name.clone(), expected: s.ne.clone(), found });
                    }
                }
            }
        }
        problems
    }

    /// The network's configuration.
    pub fn config(&self) -> &ControlNetConfig {
        &self.config
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parameters as they load, with the `--type` override `wtype`.
    pub fn specs(&self, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        let dtype =
            |name: &str| self.names.get(name).and_then(|n| self.files.index().get(n)).and_then(|e| ggml_type(e.dtype));
        controlnet_specs(&self.config, &dtype, wtype)
    }

    /// The file's tensors under the network's names.
    pub fn source(self: &std::sync::Arc<Self>) -> std::sync::Arc<dyn TensorSource + Send + Sync> {
        std::sync::Arc::new(Renamed(self.clone()))
    }
}

/// A ControlNet file's tensors under [`PREFIX`].
struct Renamed(std::sync::Arc<ControlNetFile>);

impl Renamed {
    fn name<'n>(&'n self, name: &'n str) -> &'n str {
        self.0.names.get(name).map_or(name, String::as_str)
    }
}

impl TensorSource for Renamed {
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<std::borrow::Cow<'_, [u8]>, SourceError> {
        FileSource::new(&self.0.files).load_tensor(self.name(name), ty, ne)
    }

    fn release(&self, name: &str) {
        FileSource::new(&self.0.files).release(self.name(name))
    }

    fn mapped(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Option<MappedBytes>, SourceError> {
        FileSource::new(&self.0.files).mapped_tensor(self.name(name), ty, ne)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diffusion::UNetConfig;
    use crate::fixture::controlnet::ControlNetFixture;
    use crate::fixture::{write_table, write_table_renamed, FileFormat, WeightType};

    /// A narrow SD 1.x layout (32 model channels) for files written in milliseconds.
    fn narrow() -> UNetConfig {
        UNetConfig { model_channels: 32, time_embed_dim: 128, ..UNetConfig::sd15() }
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sd-models-controlnet-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// The file is checked from its header: `control_model.` names and bare ones open alike (the
    /// reference strips the prefix); a missing tensor is named with its shape; a model family
    /// without a ControlNet, and a ControlNet of other widths, are refused naming the file.
    #[test]
    fn files_are_checked_against_the_model_before_loading() {
        let d = dir("checks");
        let f = ControlNetFixture { unet: narrow(), std: None, seed: 3 };
        let cfg = || Some(ControlNetConfig::for_unet(&narrow()));
        let good = d.join("good.safetensors");
        f.write(&good, WeightType::F16, FileFormat::Safetensors).unwrap();
        let file = ControlNetFile::open(&good, "sd1", cfg()).unwrap();
        assert_eq!(file.config().residuals(), 13);
        assert_eq!(file.specs(None).len(), f.table().len());

        let bare = d.join("bare.safetensors");
        let strip = |n: &str| n.strip_prefix("control_model.").unwrap_or(n).to_string();
        write_table_renamed(&bare, f.table(), WeightType::F16, FileFormat::Safetensors, &[], 3, &strip).unwrap();
        assert!(ControlNetFile::open(&bare, "sd1", cfg()).is_ok());

        let missing = d.join("missing.safetensors");
        let table = f.table().into_iter().filter(|t| t.name != "control_model.input_hint_block.8.weight").collect();
        write_table(&missing, table, WeightType::F16, FileFormat::Safetensors, &[], 3).unwrap();
        match ControlNetFile::open(&missing, "sd1", cfg()) {
            Err(ControlNetError::Tensors { problems, .. }) => {
                assert_eq!(
                    problems,
                    [TensorProblem::Missing {
                        name: "control_model.input_hint_block.8.weight".into(),
                        expected: vec![3, 3, 32, 96]
                    }]
                );
            }
            other => panic!("{other:?}"),
        }

        let e = ControlNetFile::open(&good, "flux", None).unwrap_err().to_string();
        assert!(e.contains("flux") && e.contains("good.safetensors"), "{e}");
        let sd21 = Some(ControlNetConfig::for_unet(&UNetConfig { context_dim: 1024, ..narrow() }));
        let e = ControlNetFile::open(&good, "sd2", sd21).unwrap_err().to_string();
        assert!(
            e.contains("good.safetensors") && e.contains("context width 768") && e.contains("context width 1024"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
