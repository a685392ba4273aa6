//! The default build needs only a Rust toolchain and a C/C++ compiler (README):
//! no crate that runs CMake or bindgen (libclang) is anywhere in the workspace's
//! dependency graph, build dependencies included. `.ci/run` also builds with a
//! `cmake` on PATH that records any call.

use std::collections::BTreeSet;

/// Crates that would bring a system prerequisite back into the default build.
const FORBIDDEN: &[(&str, &str)] = &[
    ("cmake", "runs CMake"),
    ("bindgen", "needs libclang"),
    ("clang-sys", "needs libclang"),
    ("pkg-config", "looks for system libraries"),
];

fn resolved_packages() -> BTreeSet<String> {
    let meta = sd_tests::cargo_metadata();
    let ids: BTreeSet<&str> =
        meta["resolve"]["nodes"].as_array().unwrap().iter().map(|n| n["id"].as_str().unwrap()).collect();
    meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| ids.contains(p["id"].as_str().unwrap()))
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect()
}

fn offenders(packages: &BTreeSet<String>) -> Vec<String> {
    FORBIDDEN.iter().filter(|(name, _)| packages.contains(*name)).map(|(name, why)| format!("{name} ({why})")).collect()
}

#[test]
fn default_build_needs_no_cmake_and_no_libclang() {
    let packages = resolved_packages();
    // the graph is the real one: ggml-sys compiles ggml with `cc`
    assert!(packages.contains("ggml-sys") && packages.contains("cc"), "{packages:?}");
    let bad = offenders(&packages);
    assert!(bad.is_empty(), "the workspace's dependency graph contains {}", bad.join(", "));
}

#[test]
fn offenders_are_found() {
    let with = |extra: &str| -> BTreeSet<String> { ["cc", "ggml-sys", extra].iter().map(|s| s.to_string()).collect() };
    assert_eq!(offenders(&with("bindgen")), vec!["bindgen (needs libclang)".to_string()]);
    assert_eq!(offenders(&with("cmake")), vec!["cmake (runs CMake)".to_string()]);
    assert!(offenders(&with("serde")).is_empty());
}
