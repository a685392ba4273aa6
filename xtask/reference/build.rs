//! Builds stable-diffusion.cpp and our C++ driver with CMake, and links them.
//!
//! The sd.cpp source is the copy inside the crates.io package
//! `diffusion-rs-sys` (pinned in Cargo.toml, never compiled as a crate). It is
//! found through `SDREF_SDCPP_DIR` when set (xtask sets it), else through
//! `cargo metadata`. CMake runs with sd.cpp's default CPU settings (Release,
//! GGML_NATIVE=ON, OpenMP) and no compiler flags of cargo's; see
//! driver/CMakeLists.txt.
//!
//! The CMake tree lives in `<target-dir>/sdref-cmake` (or `SDREF_CMAKE_DIR`),
//! not in OUT_DIR: every variant of this build script (release, debug, test,
//! clippy) gets its own OUT_DIR, and each would otherwise recompile sd.cpp,
//! which takes many minutes on two cores. Cargo's lock on the target dir keeps
//! two builds from using the tree at once.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const SYS_PACKAGE: &str = "diffusion-rs-sys";

fn main() {
    println!("cargo:rerun-if-env-changed=SDREF_SDCPP_DIR");
    println!("cargo:rerun-if-env-changed=SDREF_CMAKE_DIR");
    println!("cargo:rerun-if-changed=driver");
    println!("cargo:rerun-if-changed=build.rs");

    let sdcpp = match locate_sdcpp() {
        Ok(dir) => dir,
        Err(msg) => {
            eprintln!("sdref build: {msg}");
            std::process::exit(1);
        }
    };

    let dst = cmake::Config::new("driver")
        .out_dir(cmake_dir())
        .profile("Release")
        .no_default_flags(true)
        .define("SDCPP_DIR", &sdcpp)
        .build();
    let lib_dir = dst.join("lib");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    // Dependents before their dependencies: the linker resolves static
    // archives left to right.
    for lib in ["sdref_driver", "stable-diffusion", "ggml", "ggml-cpu", "ggml-base"] {
        println!("cargo:rustc-link-lib=static={lib}");
    }
    for lib in ["gomp", "stdc++", "m", "pthread", "dl"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    println!("cargo:rustc-env=SDREF_SDCPP_DIR={}", sdcpp.display());
}

fn cmake_dir() -> PathBuf {
    if let Some(dir) = env::var_os("SDREF_CMAKE_DIR") {
        return PathBuf::from(dir);
    }
    // OUT_DIR is <target-dir>[/<triple>]/<profile>/build/<pkg>-<hash>/out.
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR for build scripts"));
    match out.ancestors().nth(4) {
        Some(target_dir) => target_dir.join("sdref-cmake"),
        None => out,
    }
}

fn locate_sdcpp() -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("SDREF_SDCPP_DIR") {
        return check_sdcpp(PathBuf::from(dir));
    }
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let manifest = Path::new(&env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?).join("Cargo.toml");
    let output = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(&manifest)
        .output()
        .map_err(|e| format!("cannot run `cargo metadata`: {e}; set SDREF_SDCPP_DIR to sd.cpp's source"))?;
    if !output.status.success() {
        return Err(format!(
            "`cargo metadata` failed: {}; set SDREF_SDCPP_DIR to sd.cpp's source",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| format!("`cargo metadata` output is not JSON: {e}"))?;
    let packages = meta["packages"].as_array().ok_or("`cargo metadata` output has no packages")?;
    let manifest_path = packages
        .iter()
        .find(|p| p["name"] == SYS_PACKAGE)
        .and_then(|p| p["manifest_path"].as_str())
        .ok_or_else(|| format!("package {SYS_PACKAGE} is not in `cargo metadata`; is Cargo.toml intact?"))?;
    let root = Path::new(manifest_path).parent().ok_or("manifest_path has no parent")?;
    check_sdcpp(root.join("stable-diffusion.cpp"))
}

fn check_sdcpp(dir: PathBuf) -> Result<PathBuf, String> {
    if dir.join("src/stable-diffusion.cpp").is_file() && dir.join("ggml/CMakeLists.txt").is_file() {
        Ok(dir)
    } else {
        Err(format!("{} is not a stable-diffusion.cpp source tree (no src/stable-diffusion.cpp or ggml/)", dir.display()))
    }
}
