//! Named model presets: the module and block sizes of the families sd-rs runs, so that a tool can plan without the model's files.
//!
//! Each preset was measured from the family's real tensor layout (every name and shape of the
//! released files), described as sd-rs loads it with the given weight type (`f16`: as
//! distributed; `q8_0`, `q4_K`: the two-dimensional weights converted on load, as
//! `sd-cli --type` does; norms, biases and convolution kernels keep their file type). The
//! figures live in `presets.json` beside this crate's manifest; sd-models' test
//! `presets_match_the_real_layouts` measures them again and fails when they drift.
//!
//! A preset keeps per module what the planner reads: each block's bytes and its largest
//! tensor, and the same for the tensors outside blocks. Plans from a preset equal plans from
//! the files it was measured on, except that it carries no compute estimate (that depends on
//! the image size: fill [`ModelDescription::compute_bytes`] for small budgets).
//!
//! ```
//! use sd_placement::presets;
//! let flux = presets::find("flux-dev", "q8_0").expect("a preset of sd-placement");
//! let model = flux.description();
//! assert_eq!(model.components.len(), 3); // diffusion, te, vae
//! ```

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::model::{Component, ModelDescription, Module, Tensor};

/// One family's sizes at one weight type.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Preset {
    /// The family (`sd15`, `sdxl`, `flux-dev`).
    pub name: String,
    /// The weight type the sizes are for (`f16`, `q8_0`, `q4_K`).
    pub weight_type: String,
    /// What the sizes stand for: the files of a release.
    pub about: String,
    /// Per module, in [`Module::ALL`] order.
    pub modules: Vec<ModuleSizes>,
}

/// One module's sizes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleSizes {
    /// The module.
    pub module: Module,
    /// Its blocks in ascending order (what layer split and segments divide).
    pub blocks: Vec<BlockSizes>,
    /// Bytes of the tensors outside every block.
    pub other_bytes: u64,
    /// The largest tensor outside every block.
    pub other_largest: u64,
}

/// One block's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSizes {
    /// The block index, in execution order.
    pub index: u32,
    /// Bytes of its tensors.
    pub bytes: u64,
    /// Its largest tensor.
    pub largest: u64,
}

impl Preset {
    /// The sizes of `model` under a name: what a measurement stores.
    pub fn from_description(name: &str, weight_type: &str, about: &str, model: &ModelDescription) -> Preset {
        let modules = model
            .summaries()
            .into_iter()
            .map(|s| ModuleSizes {
                module: s.module,
                blocks: s
                    .blocks
                    .iter()
                    .map(|b| BlockSizes { index: b.index, bytes: b.bytes, largest: b.largest_tensor })
                    .collect(),
                other_bytes: s.non_block_bytes,
                other_largest: s.largest_non_block,
            })
            .collect();
        Preset { name: name.into(), weight_type: weight_type.into(), about: about.into(), modules }
    }

    /// A model description with these sizes: per block (and outside blocks) tensors of its
    /// largest tensor's size and one of the remainder, so the planner's figures are the measured ones. No
    /// files are listed (the tensors' sum stands in) and no compute estimate is set.
    pub fn description(&self) -> ModelDescription {
        let components = self
            .modules
            .iter()
            .map(|m| {
                let name = m.module.name();
                let mut tensors = Vec::with_capacity(2 * m.blocks.len() + 2);
                // The rest in pieces no larger than the largest, so it stays the largest.
                let mut split = |what: String, bytes: u64, largest: u64, block: Option<u32>| {
                    let mut left = bytes;
                    let mut i = 0;
                    while left > 0 {
                        let piece = left.min(largest.max(1));
                        tensors.push(Tensor { name: format!("{what}.{i}"), bytes: piece, block });
                        left -= piece;
                        i += 1;
                    }
                };
                if m.other_bytes > 0 {
                    split(format!("{name}.other"), m.other_bytes, m.other_largest, None);
                }
                for b in &m.blocks {
                    split(format!("{name}.block{}", b.index), b.bytes, b.largest, Some(b.index));
                }
                Component { module: m.module, tensors }
            })
            .collect();
        ModelDescription { components, files: Vec::new(), compute_bytes: Default::default() }
    }

    /// Bytes of every module's weights.
    pub fn total_bytes(&self) -> u64 {
        self.modules.iter().map(|m| m.other_bytes + m.blocks.iter().map(|b| b.bytes).sum::<u64>()).sum()
    }
}

/// The presets' file, as committed.
pub const PRESETS_JSON: &str = include_str!("../presets.json");

/// Every preset.
pub fn all() -> &'static [Preset] {
    static PRESETS: OnceLock<Vec<Preset>> = OnceLock::new();
    PRESETS.get_or_init(|| {
        serde_json::from_str(PRESETS_JSON)
            .expect("presets.json is written by `cargo xtask presets` and parsed by a test")
    })
}

/// The preset of `name` at `weight_type` (case-insensitive), if there is one; [`names`] lists them.
pub fn find(name: &str, weight_type: &str) -> Option<&'static Preset> {
    all().iter().find(|p| p.name.eq_ignore_ascii_case(name) && p.weight_type.eq_ignore_ascii_case(weight_type))
}

/// `name (types), ...` of every preset, for messages.
pub fn names() -> String {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for p in all() {
        match out.iter_mut().find(|(n, _)| *n == p.name) {
            Some((_, types)) => types.push(p.weight_type.clone()),
            None => out.push((p.name.clone(), vec![p.weight_type.clone()])),
        }
    }
    out.iter().map(|(n, t)| format!("{n} ({})", t.join(", "))).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_presets_description_summarises_to_its_own_sizes() {
        assert!(!all().is_empty());
        for p in all() {
            let again = Preset::from_description(&p.name, &p.weight_type, &p.about, &p.description());
            assert_eq!(&again, p, "{} {}", p.name, p.weight_type);
            assert!(p.modules.iter().all(|m| !m.blocks.is_empty() || m.other_bytes > 0), "{}: an empty module", p.name);
        }
    }

    #[test]
    fn quantized_presets_are_smaller_and_names_are_found_in_any_case() {
        for name in ["sd15", "sdxl", "flux-dev"] {
            let f16 = find(name, "f16").unwrap_or_else(|| panic!("{name} f16 in {}", names()));
            let q8 = find(&name.to_uppercase(), "Q8_0").unwrap();
            let q4 = find(name, "q4_k").unwrap();
            assert!(q4.total_bytes() < q8.total_bytes() && q8.total_bytes() < f16.total_bytes(), "{name}");
            assert_eq!(
                f16.modules.iter().map(|m| m.module).collect::<Vec<_>>(),
                [Module::Diffusion, Module::Te, Module::Vae]
            );
        }
        // FLUX's weights are nearly all linear: q8_0's 34 bytes per 32 values against f16's 64.
        // (SD's convolution kernels keep their file type, so its files shrink less.)
        let (f16, q8) = (find("flux-dev", "f16").unwrap(), find("flux-dev", "q8_0").unwrap());
        assert!(q8.total_bytes() * 100 < f16.total_bytes() * 55, "{} vs {}", q8.total_bytes(), f16.total_bytes());
        assert!(find("sd15", "q5_1").is_none());
        assert!(names().starts_with("sd15 (f16, q8_0, q4_K)"), "{}", names());
    }
}
