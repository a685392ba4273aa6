//! Measures the planner's presets (`sd_placement::presets`) from each family's real tensor layout: header-only files described as a load would.
//!
//! `cargo xtask presets` writes `crates/sd-placement/presets.json` from [`measure_all`]; the
//! test below fails when the committed file and a new measurement differ.

use std::path::Path;

use sd_backends::GgmlType;
use sd_placement::presets::Preset;

use crate::diffusion::flux::FluxConfig;
use crate::files::{ModelFiles, ModelSources};
use crate::fixture::{self, FileFormat, FixtureError, FixtureModel, FixtureRequest, WeightType};
use crate::text::t5::T5Config;

/// The families with presets: name, what the sizes stand for.
const FAMILIES: [(&str, &str); 6] = [
    ("sd15", "Stable Diffusion 1.5: one checkpoint (UNet, CLIP ViT-L/14, VAE), no EMA weights"),
    ("sdxl", "SDXL base 1.0: one checkpoint (UNet, CLIP ViT-L/14 and OpenCLIP ViT-bigG, VAE)"),
    ("flux-dev", "FLUX.1-dev: the transformer, clip_l, t5xxl (encoder only) and ae files"),
    ("zimage-turbo", "Z-Image Turbo: the transformer, Qwen3-4B (--llm) and FLUX.1's ae files"),
    ("sd35-large", "SD3.5 Large: the checkpoint (MMDiT and VAE), clip_l, clip_g and t5xxl (encoder only) files"),
    ("flux2-klein-4b", "FLUX.2 klein 4B: the transformer, Qwen3-4B (--llm) and FLUX.2's VAE files"),
];

/// The weight types with presets: name, and the `--type` a load converts to (`None`: as stored, f16).
const TYPES: [(&str, Option<GgmlType>); 3] =
    [("f16", None), ("q8_0", Some(GgmlType::GGML_TYPE_Q8_0)), ("q4_K", Some(GgmlType::GGML_TYPE_Q4_K))];

/// Why a measurement failed.
#[derive(Debug, thiserror::Error)]
pub enum PresetError {
    /// Writing a layout file.
    #[error(transparent)]
    Layout(#[from] FixtureError),
    /// Opening or describing it.
    #[error(transparent)]
    Files(#[from] crate::files::FilesError),
    /// Not a family of [`FAMILIES`].
    #[error("no preset family '{0}'")]
    Unknown(String),
}

/// Writes the f16 layout files of family `name` (`sd15`, `sdxl`, `flux-dev`, `zimage-turbo`,
/// `sd35-large`, `flux2-klein-4b`) in `dir`: sparse
/// files of the released layout (headers only; their tensors read as zeros), as the flags
/// that load them. Each costs a header's bytes of disk.
pub fn write_layouts(name: &str, dir: &Path) -> Result<ModelSources, PresetError> {
    let f16 = WeightType::F16;
    let same = |n: &str| n.to_string();
    let write = |file: &str, table: &[fixture::arch::FixtureTensor], rename: &dyn Fn(&str) -> String| {
        let path = dir.join(file);
        fixture::write_layout(&path, table, f16, rename).map(|_| path)
    };
    let checkpoint =
        |family: FixtureModel| FixtureRequest::family(family, 0, f16, FileFormat::Safetensors).tensor_table();
    Ok(match name {
        "sd15" => ModelSources::model(write("sd15.safetensors", &checkpoint(FixtureModel::Sd15)?, &same)?),
        "sdxl" => ModelSources::model(write("sdxl.safetensors", &checkpoint(FixtureModel::Sdxl)?, &same)?),
        "flux-dev" => {
            const CLIP: &str = "cond_stage_model.transformer.";
            let clip: Vec<_> =
                checkpoint(FixtureModel::Sd15)?.into_iter().filter(|t| t.name.starts_with(CLIP)).collect();
            let bare = |n: &str| n.strip_prefix(CLIP).unwrap_or(n).to_string();
            ModelSources {
                diffusion_model: Some(write(
                    "flux1-dev.safetensors",
                    &fixture::flux::flux_tensor_table(&FluxConfig::dev(), None),
                    &same,
                )?),
                clip_l: Some(write("clip_l.safetensors", &clip, &bare)?),
                t5xxl: Some(write("t5xxl.safetensors", &fixture::t5::t5xxl_tensor_table(&T5Config::xxl()), &same)?),
                vae: Some(write("ae.safetensors", &fixture::flux_vae::flux_vae_tensor_table(), &same)?),
                ..ModelSources::default()
            }
        }
        "zimage-turbo" => {
            let llm = crate::text::qwen3::Qwen3Config::qwen3_4b();
            ModelSources {
                diffusion_model: Some(write(
                    "z_image_turbo.safetensors",
                    &fixture::zimage::zimage_tensor_table(&crate::diffusion::zimage::ZImageConfig::turbo(), None),
                    &same,
                )?),
                llm: Some(write("qwen_3_4b.safetensors", &fixture::qwen3::qwen3_tensor_table(&llm, None), &same)?),
                vae: Some(write("ae.safetensors", &fixture::flux_vae::flux_vae_tensor_table(), &same)?),
                ..ModelSources::default()
            }
        }
        "sd35-large" => {
            use crate::family::sd3::mmdit::MmditConfig;
            let (clip_l, bare_l) = fixture::sd3::clip_table("clip_l");
            let (clip_g, bare_g) = fixture::sd3::clip_table("clip_g");
            ModelSources {
                model: Some(write(
                    "sd3.5_large.safetensors",
                    &fixture::sd3::checkpoint_table(&MmditConfig::sd35_large(), None),
                    &same,
                )?),
                clip_l: Some(write("clip_l.safetensors", &clip_l, &bare_l)?),
                clip_g: Some(write("clip_g.safetensors", &clip_g, &bare_g)?),
                t5xxl: Some(write("t5xxl.safetensors", &fixture::t5::t5xxl_tensor_table(&T5Config::xxl()), &same)?),
                ..ModelSources::default()
            }
        }
        "flux2-klein-4b" => {
            let llm = crate::text::qwen3::Qwen3Config::qwen3_4b();
            ModelSources {
                diffusion_model: Some(write(
                    "flux-2-klein-4b.safetensors",
                    &fixture::flux::flux_tensor_table(&FluxConfig::flux2_klein_4b(), None),
                    &same,
                )?),
                llm: Some(write("qwen_3_4b.safetensors", &fixture::qwen3::qwen3_tensor_table(&llm, None), &same)?),
                vae: Some(write("flux2-vae.safetensors", &fixture::flux_vae::flux2_vae_tensor_table(), &same)?),
                ..ModelSources::default()
            }
        }
        other => return Err(PresetError::Unknown(other.to_string())),
    })
}

/// The file names [`write_layouts`] writes.
const LAYOUT_FILES: [&str; 12] = [
    "sd15.safetensors",
    "sdxl.safetensors",
    "flux1-dev.safetensors",
    "clip_l.safetensors",
    "t5xxl.safetensors",
    "ae.safetensors",
    "z_image_turbo.safetensors",
    "qwen_3_4b.safetensors",
    "sd3.5_large.safetensors",
    "clip_g.safetensors",
    "flux-2-klein-4b.safetensors",
    "flux2-vae.safetensors",
];

/// The description of family `name` loaded with `wtype`, from [`write_layouts`] files written
/// in `dir` (removed before returning).
pub fn measure(name: &str, wtype: Option<GgmlType>, dir: &Path) -> Result<sd_placement::ModelDescription, PresetError> {
    let described = write_layouts(name, dir).and_then(|sources| {
        let files = ModelFiles::open(&sources)?;
        Ok(crate::describe::describe(&files, &[], wtype)?)
    });
    for file in LAYOUT_FILES {
        let _ = std::fs::remove_file(dir.join(file));
    }
    described
}

/// Every preset of [`FAMILIES`] x [`TYPES`], measured with layout files in `dir`.
pub fn measure_all(dir: &Path) -> Result<Vec<Preset>, PresetError> {
    let mut out = Vec::new();
    for (name, about) in FAMILIES {
        for (type_name, wtype) in TYPES {
            let model = measure(name, wtype, dir)?;
            out.push(Preset::from_description(name, type_name, about, &model));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_the_real_layouts() {
        let dir = tempfile::tempdir().unwrap();
        let measured = measure_all(dir.path()).unwrap();
        let committed = sd_placement::presets::all();
        for (m, c) in measured.iter().zip(committed) {
            assert_eq!(
                m, c,
                "the preset {} {} differs from a new measurement: run `cargo xtask presets` to rewrite \
                 crates/sd-placement/presets.json (and check why the layout changed)",
                m.name, m.weight_type
            );
        }
        assert_eq!(measured.len(), committed.len(), "run `cargo xtask presets`");
        // The layout files were sparse and are gone.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // Block lists as the planner divides them: SD 1.5's UNet and CLIP, FLUX's 19 + 38 blocks
        // and T5's 24 layers.
        let blocks = |name: &str, module: sd_placement::Module| {
            let p = sd_placement::presets::find(name, "f16").unwrap();
            p.modules.iter().find(|m| m.module == module).map_or(0, |m| m.blocks.len())
        };
        assert_eq!(blocks("flux-dev", sd_placement::Module::Diffusion), 57);
        assert_eq!(blocks("flux-dev", sd_placement::Module::Te), 24);
        assert!(blocks("sd15", sd_placement::Module::Diffusion) > 10);
        // Z-Image Turbo: 2 + 2 refiners and 30 layers; Qwen3-4B's 36 layers.
        assert_eq!(blocks("zimage-turbo", sd_placement::Module::Diffusion), 34);
        assert_eq!(blocks("zimage-turbo", sd_placement::Module::Te), 36);
        // SD3.5 Large: 38 joint blocks; T5-XXL's 24 layers are te's blocks (CLIP-L and CLIP-G
        // are not cut).
        assert_eq!(blocks("sd35-large", sd_placement::Module::Diffusion), 38);
        assert_eq!(blocks("sd35-large", sd_placement::Module::Te), 24);
        // FLUX.2 klein 4B: 5 double and 20 single blocks; Qwen3-4B's 36 layers.
        assert_eq!(blocks("flux2-klein-4b", sd_placement::Module::Diffusion), 25);
        assert_eq!(blocks("flux2-klein-4b", sd_placement::Module::Te), 36);
    }

    /// A plan from a preset is the plan from the files it was measured on (file sizes aside:
    /// a preset lists none), under budgets that split, segment and stream.
    #[test]
    fn a_presets_plans_equal_the_plans_of_its_files() {
        use sd_placement::{plan, DeviceProfile, Flags, PlanRequest};
        let profile = DeviceProfile::from_toml_str(
            "ram_available_mib = 65536\n[[device]]\nname = \"CUDA0\"\ntype = \"gpu\"\nfree_mib = 6144\n\
             [[device]]\nname = \"CUDA1\"\ntype = \"gpu\"\nfree_mib = 3072\n[[device]]\nname = \"CPU\"\ntype = \"cpu\"\n",
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let flag_sets = [
            Flags { backend: Some("diffusion=CUDA0&CUDA1,te=CUDA1,vae=CUDA0".into()), ..Flags::default() },
            Flags { auto_fit: Some("on".into()), ..Flags::default() },
            Flags { max_vram: Some("CUDA0=1.5".into()), ..Flags::default() },
        ];
        let mut rendered = Vec::new();
        for (name, wtype) in [("flux-dev", "q8_0"), ("sdxl", "f16")] {
            let t = TYPES.iter().find(|t| t.0 == wtype).unwrap().1;
            let mut measured = measure(name, t, dir.path()).unwrap();
            measured.files.clear();
            let preset = sd_placement::presets::find(name, wtype).unwrap().description();
            for flags in &flag_sets {
                let request = |model| PlanRequest {
                    flags: flags.clone(),
                    devices: profile.devices(),
                    ram_available_bytes: profile.ram_available_bytes(),
                    model,
                    device_speeds: Default::default(),
                };
                let (a, b) = (plan(&request(measured.clone())), plan(&request(preset.clone())));
                let show = |p: Result<sd_placement::Plan, sd_placement::PlanError>| match p {
                    Ok(p) => p.render(),
                    Err(e) => format!("error: {e}"),
                };
                let (a, b) = (show(a), show(b));
                assert_eq!(a, b, "{name} {wtype} {flags:?}");
                rendered.push(a);
            }
        }
        // The plans compared are real ones: FLUX split over both GPUs, and streamed or
        // segmented under the 1.5 GiB budget.
        assert!(rendered[0].contains("layer split: CUDA0 blocks 0..="), "{}", rendered[0]);
        assert!(rendered.iter().all(|r| !r.starts_with("error")), "{rendered:?}");
    }
}
