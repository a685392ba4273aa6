//! `ggml-build.toml` as types, and the part of the build that depends on the target: which
//! branch of ggml's CPU backend (x86 or ARM) its architecture takes, which variants are
//! compiled, and each variant's compiler flags and definitions.
//!
//! Pure (serde and std only): `build.rs` uses it for the target it builds, and
//! `tests/cpu_arch.rs` checks it for targets this machine cannot compile (aarch64 on an x86
//! host). The branch follows the target (`CARGO_CFG_TARGET_ARCH`, `CARGO_CFG_TARGET_OS`),
//! never the host the build script runs on.

use std::collections::BTreeMap;

#[derive(serde::Deserialize)]
pub struct Spec {
    pub defines: Vec<String>,
    #[serde(default)]
    pub linux_defines: Vec<String>,
    pub base: BaseSpec,
    pub backend: BackendSpec,
    pub rpc: RpcSpec,
    pub cpu: CpuSpec,
}

#[derive(serde::Deserialize)]
pub(crate) struct BaseSpec {
    pub sources: Vec<String>,
    pub public_defines: Vec<String>,
    pub private_defines: Vec<String>,
    pub includes: Vec<String>,
}

#[derive(serde::Deserialize)]
pub(crate) struct BackendSpec {
    pub defines: Vec<String>,
    pub includes: Vec<String>,
}

#[derive(serde::Deserialize)]
pub(crate) struct RpcSpec {
    pub target: String,
    pub sources: Vec<String>,
}

/// `[cpu]`: what every variant of every architecture compiles, and one `[cpu.arch.<name>]`
/// per architecture ggml-build.toml describes.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CpuSpec {
    pub sources: Vec<String>,
    pub defines: Vec<String>,
    pub includes: Vec<String>,
    pub feats_includes: Vec<String>,
    /// GGML_LLAMAFILE: left out with `SD_GGML_CPU_LLAMAFILE=off`.
    pub llamafile: Optional,
    pub arch: BTreeMap<String, ArchSpec>,
}

/// Sources and definitions that an option adds.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Optional {
    pub sources: Vec<String>,
    pub defines: Vec<String>,
}

/// One branch of `ggml_add_cpu_backend_variant_impl()`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ArchSpec {
    /// The `CARGO_CFG_TARGET_ARCH` values that take this branch.
    pub target_arch: Vec<String>,
    /// The `CARGO_CFG_TARGET_OS` values it is described for; empty: any.
    #[serde(default)]
    pub target_os: Vec<String>,
    pub sources: Vec<String>,
    pub feats_source: String,
    /// Flags every variant gets when the C++ compiler accepts them (CMake's
    /// `check_cxx_compiler_flag`); the build probes each.
    #[serde(default)]
    pub flags_if_accepted: Vec<String>,
    /// Features that each add their own flags and definition.
    #[serde(default)]
    pub features: BTreeMap<String, FeatureSpec>,
    /// Features that together make one `-march=` flag.
    #[serde(default)]
    pub march: Option<MarchSpec>,
    /// Every variant with its features.
    pub variants: BTreeMap<String, Vec<String>>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FeatureSpec {
    pub flags: Vec<String>,
    /// The definition upstream adds with the flags (none for the parity-only features).
    #[serde(default)]
    pub define: Option<String>,
}

/// A variant's `-march=<arch><tags>`: `arch` is `base`, raised by each feature the variant
/// has (in this order, the last one's wins), and the tags are the features' in this order.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MarchSpec {
    pub base: String,
    pub features: Vec<MarchFeature>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MarchFeature {
    pub name: String,
    /// The architecture the feature raises `-march` to (none: it does not raise it).
    #[serde(default)]
    pub arch: Option<String>,
    /// Appended to `-march` (`+dotprod`).
    pub tag: String,
    #[serde(default)]
    pub define: Option<String>,
}

/// One variant's flags (after the common ones) and definitions, in the order they are passed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Variant {
    pub flags: Vec<String>,
    pub defines: Vec<String>,
}

/// The CPU backend of one target: what each variant compiles, and every variant it offers.
#[derive(Debug)]
pub struct CpuTarget {
    /// The branch (`x86`, `arm`).
    pub arch: String,
    /// Every variant's sources, in order: the common ones, the branch's, LLAMAFILE's.
    pub sources: Vec<String>,
    pub defines: Vec<String>,
    pub includes: Vec<String>,
    pub feats_source: String,
    pub feats_includes: Vec<String>,
    /// Flags before each variant's own, where the compiler accepts them (the build keeps
    /// only the accepted ones).
    pub flags_if_accepted: Vec<String>,
    pub variants: BTreeMap<String, Variant>,
}

impl CpuSpec {
    /// The branch for target architecture `arch` on `os` (`CARGO_CFG_TARGET_ARCH` and
    /// `_OS`), with every variant's flags; `llamafile`: GGML_LLAMAFILE on. An architecture
    /// no branch describes is an error that names it.
    pub fn for_target(&self, arch: &str, os: &str, llamafile: bool) -> Result<CpuTarget, String> {
        let takes = |a: &ArchSpec| a.target_arch.iter().any(|t| t == arch);
        let Some((name, spec)) = self.arch.iter().find(|(_, a)| takes(a)) else {
            return Err(format!(
                "ggml-build.toml describes no CPU backend for the target architecture `{arch}` (it describes {}); \
                 ggml's CMake has branches for other architectures that this build does not reproduce",
                self.described()
            ));
        };
        if !spec.target_os.is_empty() && !spec.target_os.iter().any(|o| o == os) {
            return Err(format!(
                "ggml-build.toml describes the CPU backend for the target architecture `{arch}` on {} only, \
                 not on `{os}` (ggml's CMake lists other variants there); it describes {}",
                spec.target_os.join(", "),
                self.described()
            ));
        }
        let variants = spec
            .variants
            .iter()
            .map(|(v, feats)| Ok((v.clone(), spec.variant(name, v, feats)?)))
            .collect::<Result<_, String>>()?;
        let (opt_sources, opt_defines) =
            if llamafile { (&self.llamafile.sources[..], &self.llamafile.defines[..]) } else { (&[][..], &[][..]) };
        Ok(CpuTarget {
            arch: name.clone(),
            sources: self.sources.iter().chain(&spec.sources).chain(opt_sources).cloned().collect(),
            defines: opt_defines.iter().chain(&self.defines).cloned().collect(),
            includes: self.includes.clone(),
            feats_source: spec.feats_source.clone(),
            feats_includes: self.feats_includes.clone(),
            flags_if_accepted: spec.flags_if_accepted.clone(),
            variants,
        })
    }

    /// `x86_64 (x86), aarch64 on linux (arm)`.
    fn described(&self) -> String {
        let one = |(name, a): (&String, &ArchSpec)| {
            let on = if a.target_os.is_empty() { String::new() } else { format!(" on {}", a.target_os.join(", ")) };
            format!("{}{on} ({name})", a.target_arch.join(", "))
        };
        self.arch.iter().map(one).collect::<Vec<_>>().join(", ")
    }
}

impl ArchSpec {
    /// Variant `v` of branch `arch` with features `feats`: the flags of its `features` in their
    /// table's order, then its `-march` when the branch has one; their definitions likewise.
    fn variant(&self, arch: &str, v: &str, feats: &[String]) -> Result<Variant, String> {
        let known = |f: &String| {
            self.features.contains_key(f) || self.march.iter().any(|m| m.features.iter().any(|mf| &mf.name == f))
        };
        if let Some(f) = feats.iter().find(|f| !known(f)) {
            return Err(format!(
                "CPU variant `{v}` names unknown feature `{f}` ([cpu.arch.{arch}] of ggml-build.toml)"
            ));
        }
        let mut out = Variant { flags: Vec::new(), defines: Vec::new() };
        // Upstream adds flags in a fixed order of features, not the variant's order.
        for (name, f) in &self.features {
            if feats.contains(name) {
                out.flags.extend(f.flags.iter().cloned());
                out.defines.extend(f.define.clone());
            }
        }
        if let Some(m) = &self.march {
            let mut march = m.base.clone();
            let mut tags = String::new();
            for f in m.features.iter().filter(|f| feats.contains(&f.name)) {
                if let Some(a) = &f.arch {
                    march = a.clone();
                }
                tags.push_str(&f.tag);
                out.defines.extend(f.define.clone());
            }
            out.flags.push(format!("-march={march}{tags}"));
        }
        Ok(out)
    }
}

impl CpuTarget {
    /// The variants to compile: `requested` (`SD_GGML_CPU_VARIANTS`: `all`, every variant of
    /// the target's branch but the parity-only `native*` ones, or a comma-separated list),
    /// else `defaults` (plugins/cpu/plugin.toml's list for the target's architecture).
    pub fn choose_variants(&self, requested: Option<&str>, defaults: &[String]) -> Result<Vec<String>, String> {
        let chosen: Vec<String> = match requested {
            Some(v) if v.trim() == "all" => {
                self.variants.keys().filter(|k| !k.starts_with("native")).cloned().collect()
            }
            Some(v) => v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect(),
            None => defaults.to_vec(),
        };
        if chosen.is_empty() {
            return Err(match requested {
                Some(_) => "no CPU variant to build (SD_GGML_CPU_VARIANTS is empty)".into(),
                None => format!("plugins/cpu/plugin.toml lists no default CPU variant for the {} branch", self.arch),
            });
        }
        if let Some(v) = chosen.iter().find(|v| !self.variants.contains_key(*v)) {
            return Err(format!(
                "unknown CPU variant `{v}`; ggml-build.toml's {} branch (this target's) offers: {}",
                self.arch,
                self.variants.keys().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
        Ok(chosen)
    }
}
