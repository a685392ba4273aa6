//! `cargo xtask bindings`: regenerate `crates/ggml-sys/src/bindings.rs`.
//!
//! The bindings are committed so that the default build needs no libclang. The
//! work is done by the `xtask/bindgen` project (its own cargo project, so bindgen
//! never enters the workspace's dependency graph); this command runs it. When the
//! workspace itself does not compile (stale bindings after moving the pin), run
//! `cargo run --release --manifest-path xtask/bindgen/Cargo.toml --target-dir target/bindgen`
//! directly.

use std::process::Command;

use anyhow::{bail, Result};

/// Entry point.
pub fn run() -> Result<()> {
    let root = crate::workspace_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = Command::new(&cargo)
        .args(["run", "--release", "--quiet", "--manifest-path"])
        .arg(root.join("xtask/bindgen/Cargo.toml"))
        .arg("--target-dir")
        .arg(root.join("target/bindgen"))
        .status()?;
    if !st.success() {
        bail!("generating the bindings failed (bindgen needs libclang: apt-get install libclang-dev)");
    }
    println!("review the diff of crates/ggml-sys/src/bindings.rs, then commit it");
    Ok(())
}
