//! Project automation (`cargo xtask <command>`): plugins, fixtures, the reference, parity, benchmarks.

mod bench;
mod bench_placement;
mod bench_variants;
mod bindings;
mod fixture;
mod fuzz;
mod parity;
mod parity_ops;
mod parity_samplers;
mod plugins;
mod reference;

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

const USAGE: &str = "usage: cargo xtask <command> [args]

commands:
  plugins [--backend cpu,rpc,cuda,vulkan,metal] [--cpu-variants default|all] [--out DIR]
                      build backend plugins from the pinned ggml and install them
  bindings            regenerate crates/ggml-sys/src/bindings.rs from the pinned headers
                      (needs libclang; the default build never does)
  fixture sd15|sd21|sd-turbo [--seed N] [--type f16|q8_0|...] [-o FILE] [--std S]
                      write a checkpoint with the real layout and random weights
  reference           build the stable-diffusion.cpp reference harness (sdref)
  parity [sd15|sd21|all] [--threads N] [--write-test-data [--test-data-dir DIR]]
                      compare text encoder, UNet, VAE and 256x256 generations with the reference
  parity --fuzz N --model PATH [--seed S] [--threads N] [--max-steps K]
                      N random cases (prompt syntax, sizes, samplers, cfg, clip skip, img2img) on
                      any checkpoint, each disagreement with the first stage where it appears
  parity --compare-runs DIR_A DIR_B
                      our outputs of two fuzz runs of the same cases (e.g. two CPU plugin builds,
                      SD_PLUGIN_PATH), stage by stage: our kernel-order floor
  parity ops [--ref-lib DIR] [--plugin FILE]
                      each ggml op our models use, ours against the reference's ggml, bit for bit
  parity samplers [--steps N] [--side PX] [--only NAME,...] [--write-test-data]
                      every sampling method and scheduler: sd-cli against the reference, per case
  bench [--size 256|512|both] [--runs N] [--threads N]
                      time sd-cli against the reference, alternating runs, with ratios
  bench-variants [--variants all|v1,v2] [--type f16,q8_0] [--runs N] [--threads N] [--size 256|512]
                      every CPU variant this CPU can run, forced one at a time, beside the reference
  bench-placement [--runs N] [--threads N] [--size 256|512]
                      parameter homes over a loopback RPC device: client RSS (device/RAM/disk),
                      segmented UNet with and without prefetch, --offload-to-cpu beside the reference";

/// A command line written as one string, split at whitespace (for the parsers' tests).
#[cfg(test)]
pub(crate) fn test_args(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        println!("{USAGE}");
        return Ok(());
    };
    match cmd.as_str() {
        "plugins" => plugins::run(rest),
        "bindings" => bindings::run(rest),
        "fixture" => fixture::run(rest),
        "parity" => parity::run(rest),
        "bench" => bench::run(rest),
        "bench-placement" => bench_placement::run(rest),
        "bench-variants" => bench_variants::run(rest),
        "reference" => {
            let exe = reference::build()?;
            println!("{}", exe.display());
            Ok(())
        }
        "help" | "--help" | "-h" => {
            println!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown command `{other}`\n{USAGE}"),
    }
}
