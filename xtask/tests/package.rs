//! `sd-placement` as another tool gets it: `cargo package` makes the crate file, and a crate outside the workspace that depends on the unpacked package (as a vendored copy) builds and plans.
//!
//! Offline: the dependencies come from cargo's local cache (the workspace's own build has
//! fetched them). Both cargo runs use a target directory of their own under the temporary
//! directory, never the workspace's.

use std::path::Path;
use std::process::Command;

mod common;

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// [`common::run`], its standard output as text.
fn run(cmd: &mut Command) -> String {
    String::from_utf8_lossy(&common::run(cmd).stdout).into_owned()
}

#[test]
fn the_packaged_planner_builds_and_plans_outside_the_workspace() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let tmp = std::env::temp_dir().join(format!("sd-placement-package-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let target = tmp.join("target");
    run(cargo()
        .args(["package", "-p", "sd-placement", "--no-verify", "--offline", "--allow-dirty", "--target-dir"])
        .arg(&target)
        .current_dir(root));
    let crate_file = target.join("package/sd-placement-0.1.0.crate");
    let vendor = tmp.join("vendor");
    std::fs::create_dir_all(&vendor).unwrap();
    run(Command::new("tar").arg("-xzf").arg(&crate_file).arg("-C").arg(&vendor));
    let vendored = vendor.join("sd-placement-0.1.0");
    for f in ["README.md", "RULES.md", "examples/plan.rs", "public-api.txt"] {
        assert!(vendored.join(f).is_file(), "{f} is not in the package");
    }
    // a tool of its own, outside the workspace (its own [workspace] table)
    let tool = tmp.join("tool");
    std::fs::create_dir_all(tool.join("src")).unwrap();
    std::fs::write(
        tool.join("Cargo.toml"),
        format!(
            "[package]\nname = \"tool\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n[workspace]\n\n\
             [dependencies]\nsd-placement = {{ path = {:?} }}\n",
            vendored.display().to_string()
        ),
    )
    .unwrap();
    std::fs::write(
        tool.join("src/main.rs"),
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
    )
    .unwrap();
    let out = run(cargo().args(["run", "-q", "--offline", "--target-dir"]).arg(&target).current_dir(&tool));
    assert_eq!(out.trim(), format!("{} true diffusion=CUDA0", sd_placement_schema()), "{out}");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The schema version the workspace's planner writes (the vendored copy is the same code).
fn sd_placement_schema() -> u32 {
    let lib = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("crates/sd-placement/src/plan.rs"),
    )
    .unwrap();
    let line = lib.lines().find(|l| l.starts_with("pub const PLAN_SCHEMA_VERSION")).unwrap();
    line.split('=').nth(1).unwrap().trim().trim_end_matches(';').parse().unwrap()
}
