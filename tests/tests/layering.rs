//! The layering of the workspace is checked, not only written down (ARCHITECTURE.md).
//!
//! Each crate has a layer; a crate may depend only on crates of lower layers.
//! Pure-logic crates depend on no FFI crate, directly or transitively. Only
//! sd-backends may use libloading (it alone calls dlopen).

use std::collections::{BTreeMap, BTreeSet};

/// Layer of each workspace crate; tools (xtask, the test crate) sit above all.
const LAYERS: &[(&str, u32)] = &[
    ("ggml-sys", 0),
    ("sd-placement", 0),
    ("sd-sampling", 0),
    ("sd-formats", 1),
    ("sd-backends", 1),
    ("sd-sched", 2),
    ("sd-arch", 2),
    ("sd-vae", 3),
    ("sd-models", 4),
    ("sd-server", 5),
    ("sd-cli", 6),
    ("xtask", 9),
    ("sd-tests", 9),
];
/// Pure logic: no FFI crate reached and no `unsafe` code (sd-arch reads headers through
/// sd-formats, whose maps are the one `unsafe` it reaches).
const PURE: &[&str] = &["sd-placement", "sd-sampling", "sd-arch"];
/// Crates that reach no FFI crate (pure ones, the file-format reader, which maps files
/// with `unsafe` but calls no ggml, and the architectures: other tools read and describe
/// model headers with them).
const NO_FFI: &[&str] = &["sd-placement", "sd-sampling", "sd-formats", "sd-arch"];
const FFI: &[&str] = &["ggml-sys", "sd-backends", "libloading", "bindgen"];
const DLOPEN_ALLOWED: &[&str] = &["sd-backends"];

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Normal (non-dev, non-build) dependencies of every package in the resolve graph.
fn dependency_graph() -> (Graph, BTreeSet<String>) {
    let meta = sd_tests::cargo_metadata();
    let names: BTreeMap<String, String> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap().to_string(), p["name"].as_str().unwrap().to_string()))
        .collect();
    let members: BTreeSet<String> =
        meta["workspace_members"].as_array().unwrap().iter().map(|id| names[id.as_str().unwrap()].clone()).collect();
    let mut graph = Graph::new();
    for node in meta["resolve"]["nodes"].as_array().unwrap() {
        let name = names[node["id"].as_str().unwrap()].clone();
        let deps = graph.entry(name).or_default();
        for d in node["deps"].as_array().unwrap() {
            let normal = d["dep_kinds"].as_array().unwrap().iter().any(|k| k["kind"].is_null());
            if normal {
                deps.insert(names[d["pkg"].as_str().unwrap()].clone());
            }
        }
    }
    (graph, members)
}

fn reachable(graph: &Graph, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut stack = vec![from.to_string()];
    while let Some(n) = stack.pop() {
        for d in graph.get(&n).into_iter().flatten() {
            if seen.insert(d.clone()) {
                stack.push(d.clone());
            }
        }
    }
    seen
}

/// Every violation of the rules in `graph`.
fn violations(graph: &Graph, members: &BTreeSet<String>) -> Vec<String> {
    let layer: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let mut out = Vec::new();
    for m in members {
        let Some(&lm) = layer.get(m.as_str()) else {
            out.push(format!("{m} has no layer in tests/tests/layering.rs and ARCHITECTURE.md"));
            continue;
        };
        for d in graph.get(m).into_iter().flatten() {
            if let Some(&ld) = layer.get(d.as_str()) {
                if ld >= lm && lm < 9 {
                    out.push(format!("{m} (layer {lm}) depends on {d} (layer {ld}): dependencies must point down"));
                }
            }
            if d == "libloading" && !DLOPEN_ALLOWED.contains(&m.as_str()) {
                out.push(format!("{m} depends on libloading: only sd-backends loads libraries"));
            }
        }
        if NO_FFI.contains(&m.as_str()) {
            for d in reachable(graph, m) {
                if FFI.contains(&d.as_str()) {
                    out.push(format!("FFI-free crate {m} reaches FFI crate {d}"));
                }
            }
        }
    }
    out
}

#[test]
fn workspace_respects_its_layers() {
    let (graph, members) = dependency_graph();
    assert!(members.contains("sd-placement") && members.contains("sd-cli"));
    let v = violations(&graph, &members);
    assert!(v.is_empty(), "layering violations:\n{}", v.join("\n"));
}

#[test]
fn the_checker_catches_upward_and_ffi_dependencies() {
    let mut g = Graph::new();
    g.insert("sd-backends".into(), ["sd-models".to_string()].into());
    g.insert("sd-placement".into(), ["helper".to_string()].into());
    g.insert("helper".into(), ["ggml-sys".to_string()].into());
    g.insert("sd-vae".into(), ["libloading".to_string()].into());
    let members: BTreeSet<String> = ["sd-backends", "sd-placement", "sd-vae", "sd-models"].map(String::from).into();
    let v = violations(&g, &members);
    assert!(v.iter().any(|s| s.contains("sd-backends (layer 1) depends on sd-models")), "{v:?}");
    assert!(v.iter().any(|s| s.contains("FFI-free crate sd-placement reaches FFI crate ggml-sys")), "{v:?}");
    assert!(v.iter().any(|s| s.contains("sd-vae depends on libloading")), "{v:?}");
}

#[test]
fn pure_crates_forbid_unsafe() {
    for krate in PURE {
        let lib = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates").join(krate).join("src/lib.rs");
        let text = std::fs::read_to_string(&lib).unwrap();
        assert!(text.contains("#![forbid(unsafe_code)]"), "{} must forbid unsafe code", lib.display());
    }
}

/// `cargo run -p CRATE` (the README's commands) needs one binary to run: a package with
/// several names the one it runs (`default-run`), as sd-cli does beside its sd-server alias.
#[test]
fn cargo_run_picks_a_binary_in_every_package() {
    let meta = sd_tests::cargo_metadata();
    let members: BTreeSet<&str> =
        meta["workspace_members"].as_array().unwrap().iter().filter_map(|m| m.as_str()).collect();
    let mut without = Vec::new();
    for p in meta["packages"].as_array().unwrap().iter().filter(|p| members.contains(p["id"].as_str().unwrap())) {
        let bins = p["targets"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["kind"].as_array().unwrap().iter().any(|k| k == "bin"))
            .count();
        if bins > 1 && p["default_run"].is_null() {
            without.push(p["name"].as_str().unwrap().to_owned());
        }
    }
    assert!(without.is_empty(), "packages with several binaries and no `default-run`: {without:?}");
}
