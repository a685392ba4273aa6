//! The planner and the header reader as another tool gets them: `cargo package` makes the crate files, and a crate outside the workspace that depends on the unpacked packages (as vendored copies) builds, describes a model file and plans it.
//!
//! Offline: the dependencies come from cargo's local cache (the workspace's own build has
//! fetched them). Every cargo run uses a target directory of its own under a temporary
//! directory, never the workspace's.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// [`common::run`], its standard output as text.
fn run(cmd: &mut Command) -> String {
    String::from_utf8_lossy(&common::run(cmd).stdout).into_owned()
}

/// Packages the workspace's `crates` (version 0.1.0) in one `cargo package` run, as
/// publishing them together would, and unpacks each `.crate` under `tmp/vendor`: the
/// vendored copies, in the order of `crates`.
fn package_and_unpack(crates: &[&str], tmp: &Path) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let target = tmp.join("target");
    let mut cmd = cargo();
    cmd.arg("package");
    for c in crates {
        cmd.args(["-p", c]);
    }
    run(cmd.args(["--no-verify", "--offline", "--allow-dirty", "--target-dir"]).arg(&target).current_dir(root));
    let vendor = tmp.join("vendor");
    std::fs::create_dir_all(&vendor).unwrap();
    crates
        .iter()
        .map(|c| {
            let crate_file = target.join(format!("package/{c}-0.1.0.crate"));
            run(Command::new("tar").arg("-xzf").arg(&crate_file).arg("-C").arg(&vendor));
            vendor.join(format!("{c}-0.1.0"))
        })
        .collect()
}

/// Writes a tool of its own under `tmp/tool` (its own `[workspace]` table, outside the
/// workspace): `Cargo.toml` with `manifest_tail` after its `[package]` table, `src/main.rs`.
/// Runs it offline and returns its standard output.
fn run_tool(tmp: &Path, manifest_tail: &str, main_rs: &str) -> String {
    let tool = tmp.join("tool");
    std::fs::create_dir_all(tool.join("src")).unwrap();
    std::fs::write(
        tool.join("Cargo.toml"),
        format!(
            "[package]\nname = \"tool\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n[workspace]\n\n{manifest_tail}"
        ),
    )
    .unwrap();
    std::fs::write(tool.join("src/main.rs"), main_rs).unwrap();
    let target = tmp.join("target");
    run(cargo().args(["run", "-q", "--offline", "--target-dir"]).arg(&target).current_dir(&tool))
}

/// A path as a TOML string.
fn toml_path(p: &Path) -> String {
    format!("{:?}", p.display().to_string())
}

#[test]
fn the_packaged_planner_builds_and_plans_outside_the_workspace() {
    let tmp = std::env::temp_dir().join(format!("sd-placement-package-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let vendored = package_and_unpack(&["sd-placement"], &tmp).remove(0);
    for f in ["README.md", "RULES.md", "examples/plan.rs", "public-api.txt"] {
        assert!(vendored.join(f).is_file(), "{f} is not in the package");
    }
    let out = run_tool(
        &tmp,
        &format!("[dependencies]\nsd-placement = {{ path = {} }}\n", toml_path(&vendored)),
        r#"//! Plans a model on a profile with the vendored planner.
use sd_placement::*;
fn main() {
    let profile = DeviceProfile::from_toml_str(
        "ram_available_mib = 16384\n[[device]]\nname = \"CUDA0\"\ntype = \"gpu\"\nfree_mib = 8192\n",
    )
    .unwrap();
    let unet = (0..25).map(|b| Tensor::in_block(format!("unet.{b}.w"), 66 * MIB, b)).collect();
    let model = ModelDescription {
        components: vec![Component { module: Module::Diffusion, tensors: unet }],
        files: vec![SourceFile { role: "<checkpoint file>".into(), bytes: 25 * 66 * MIB }],
        compute_bytes: Default::default(),
    };
    let request = PlanRequest {
        flags: Flags::default(),
        devices: profile.devices(),
        ram_available_bytes: profile.ram_available_bytes(),
        model,
        device_speeds: Default::default(),
    };
    let p = plan(&request).unwrap();
    println!("{} {} {}", p.schema_version, p.fits, p.backend);
}
"#,
    );
    assert_eq!(out.trim(), format!("{} true diffusion=CUDA0", sd_placement_schema()), "{out}");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The header reader (`sd-arch`, with `sd-formats` and `sd-sampling`) packaged with the
/// planner: a tool that depends on the four vendored copies (the vendored sd-arch's
/// registry dependencies on sd-formats and sd-placement patched to the vendored ones) writes
/// an SD 1.x checkpoint's header by hand, detects and describes it, and plans a layer split.
#[test]
fn the_packaged_header_reader_describes_and_plans_outside_the_workspace() {
    let tmp = std::env::temp_dir().join(format!("sd-arch-package-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let crates = ["sd-sampling", "sd-formats", "sd-placement", "sd-arch"];
    let vendored = package_and_unpack(&crates, &tmp);
    for (c, dir) in crates.iter().zip(&vendored) {
        assert!(dir.join("README.md").is_file(), "{c}: README.md is not in the package");
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        assert!(!manifest.contains("path = \"../"), "{c}: the packaged manifest keeps a path:\n{manifest}");
        assert!(!manifest.contains("ggml-sys"), "{c}: the packaged manifest names ggml-sys:\n{manifest}");
    }
    let paths: Vec<String> =
        crates.iter().zip(&vendored).map(|(c, dir)| format!("{c} = {{ path = {} }}\n", toml_path(dir))).collect();
    // the tool names sd-formats, sd-placement and sd-arch; the vendored manifests' registry
    // dependencies (sd-arch's on sd-formats and sd-placement, sd-formats' on sd-sampling)
    // are patched to the vendored copies
    let manifest = format!("[dependencies]\n{}\n[patch.crates-io]\n{}", paths[1..].concat(), paths[..3].concat());
    let out = run_tool(&tmp, &manifest, HEADER_TOOL);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert_eq!(lines[0], "arch sd1 context 768", "{out}");
    assert_eq!(lines[1], "modules Diffusion Te Vae blocks 0..=24", "{out}");
    // two ranges of blocks, CUDA0 from block 0, CUDA1 to block 24, the second after the first
    let plan: Vec<&str> = lines[2].split(' ').collect();
    assert_eq!((plan.len(), plan[0], plan[1]), (4, "fits", "true"), "{out}");
    let (r0, r1) = (plan[2].split_once(':').unwrap(), plan[3].split_once(':').unwrap());
    let bounds = |r: &str| -> (u32, u32) {
        let (a, b) = r.split_once('-').unwrap();
        (a.parse().unwrap(), b.parse().unwrap())
    };
    let ((a0, b0), (a1, b1)) = (bounds(r0.1), bounds(r1.1));
    assert_eq!((r0.0, a0, r1.0, b1), ("CUDA0", 0, "CUDA1", 24), "{out}");
    assert_eq!(a1, b0 + 1, "{out}");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The tool of the header-reader test: an SD 1.x checkpoint's safetensors file written by
/// hand (8-byte little-endian header length, JSON header, zeroed f16 data), read by header
/// with `sd_formats`, described with `sd_arch` and planned with `sd_placement`.
const HEADER_TOOL: &str = r##"//! Describes and plans a hand-written SD 1.x checkpoint with the vendored crates.
use sd_arch::describe::loaded_bytes;
use sd_formats::ModelFiles;
use sd_placement::{plan, Device, Flags, Module, PlanRequest, GIB};

/// An SD 1.x checkpoint's tensors (real names, small shapes where detection reads none).
const TENSORS: [(&str, &[u64]); 9] = [
    ("model.diffusion_model.input_blocks.0.0.weight", &[320, 4, 3, 3]),
    ("model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight", &[320, 768]),
    ("model.diffusion_model.input_blocks.11.0.out_layers.3.weight", &[64, 64]),
    ("model.diffusion_model.middle_block.1.norm.weight", &[1280]),
    ("model.diffusion_model.output_blocks.0.0.out_layers.3.weight", &[64, 64]),
    ("model.diffusion_model.output_blocks.11.1.transformer_blocks.0.attn2.to_k.weight", &[320, 768]),
    ("cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight", &[64, 64]),
    ("cond_stage_model.transformer.text_model.encoder.layers.11.mlp.fc1.weight", &[64, 64]),
    ("first_stage_model.decoder.conv_in.weight", &[512, 4, 3, 3]),
];

fn main() {
    // the tensors above and one in each of the UNet's other blocks: every block from 0 to 24 has one
    let mut tensors: Vec<(String, &[u64])> = TENSORS.iter().map(|&(n, s)| (n.to_string(), s)).collect();
    for n in (2..11).chain(13..23) {
        let (kind, i) = if n < 12 { ("input", n) } else { ("output", n - 12) };
        tensors.push((format!("model.diffusion_model.{kind}_blocks.{i}.0.in_layers.2.weight"), &[64, 64]));
    }
    let mut json = Vec::new();
    let mut offset = 0u64;
    for (name, shape) in &tensors {
        let bytes = 2 * shape.iter().product::<u64>();
        let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
        json.push(format!(
            r#""{name}":{{"dtype":"F16","shape":[{}],"data_offsets":[{offset},{}]}}"#,
            dims.join(","),
            offset + bytes
        ));
        offset += bytes;
    }
    let header = format!("{{{}}}", json.join(","));
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.resize(file.len() + offset as usize, 0);
    let path = std::path::Path::new("sd15.safetensors"); // in the tool's folder
    std::fs::write(path, file).unwrap();

    let files = ModelFiles::open_model(path).unwrap();
    let detected = files.detect(None).unwrap();
    println!("arch {} context {}", detected.arch, detected.context_dim);
    let model = sd_arch::describe(&files, &[], &loaded_bytes).unwrap();
    let mut modules: Vec<Module> = model.components.iter().map(|c| c.module).collect();
    modules.sort();
    let diffusion = model.components.iter().find(|c| c.module == Module::Diffusion).unwrap();
    let blocks = || diffusion.tensors.iter().filter_map(|t| t.block);
    let (first, last) = (blocks().min().unwrap(), blocks().max().unwrap());
    let names: Vec<String> = modules.iter().map(|m| format!("{m:?}")).collect();
    println!("modules {} blocks {first}..={last}", names.join(" "));
    let request = PlanRequest {
        flags: Flags { backend: Some("diffusion=cuda0&cuda1".into()), ..Flags::default() },
        devices: vec![Device::gpu("CUDA0", 8 * GIB, 8 * GIB), Device::gpu("CUDA1", 8 * GIB, 8 * GIB), Device::cpu()],
        ram_available_bytes: Some(32 * GIB),
        model,
        device_speeds: Default::default(),
    };
    let p = plan(&request).unwrap();
    let m = p.modules.iter().find(|m| m.module == Module::Diffusion).unwrap();
    let split: Vec<String> = m.split.iter().map(|r| format!("{}:{}-{}", r.device, r.first_block, r.last_block)).collect();
    println!("fits {} {}", p.fits, split.join(" "));
}
"##;

/// The schema version the workspace's planner writes (the vendored copy is the same code).
fn sd_placement_schema() -> u32 {
    let lib = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("crates/sd-placement/src/plan.rs"),
    )
    .unwrap();
    let line = lib.lines().find(|l| l.starts_with("pub const PLAN_SCHEMA_VERSION")).unwrap();
    line.split('=').nth(1).unwrap().trim().trim_end_matches(';').parse().unwrap()
}
