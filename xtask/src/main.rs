//! Project automation (`cargo xtask <command>`): plugins, fixtures, the reference, parity, benchmarks.

mod bench;
mod bench_placement;
mod bench_server;
mod bench_sizes;
mod bench_split;
mod bench_truth;
mod bench_variants;
mod bindings;
mod fixture;
mod fuzz;
mod ggml;
mod install;
mod parity;
mod parity_chroma;
mod parity_esrgan;
mod parity_flux;
mod parity_flux2;
mod parity_flux_vae;
mod parity_ops;
mod parity_qwen3;
mod parity_samplers;
mod parity_sd3;
mod parity_t5;
mod parity_zimage;
mod plugins;
mod profile;
mod reference;
// The build script of xtask/reference reads the fields these tests do not.
#[cfg(test)]
#[allow(dead_code)]
#[path = "../reference/build/spec.rs"]
mod sdref_spec;

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::{Parser, Subcommand};

/// `cargo xtask <command>`: one parser for every command (clap), each command's flags
/// declared beside the code that runs it.
#[derive(Parser, Debug)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "Project automation: plugins, fixtures, the reference, parity, benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once per process
enum Command {
    /// Build backend plugins from the pinned ggml and install them.
    Plugins(plugins::Args),
    /// Install sd-cli, the core library and the default plugins under --prefix DIR
    /// (DIR/bin/sd-cli runs wherever DIR is moved).
    Install(install::InstallArgs),
    /// Make the release archive in target/dist: sd-rs-<version>-<arch>-<os> as a gzipped
    /// tar (the install layout: binary, core library, default plugins, licenses).
    Dist(install::DistArgs),
    /// Regenerate crates/ggml-sys/src/bindings.rs from the pinned headers (needs libclang; the
    /// default build never does).
    Bindings,
    /// Write a checkpoint with the real layout and random weights.
    Fixture(fixture::Args),
    /// Measure sd-placement's presets (module and block sizes of SD 1.5, SDXL, FLUX.1-dev and Z-Image Turbo
    /// at f16, q8_0 and q4_K) from the real layouts and rewrite crates/sd-placement/presets.json.
    Presets,
    /// Build the stable-diffusion.cpp reference harness (sdref) and print its path.
    Reference {
        /// Build it without AVX512-FP16, into target/reference-f32acc: f32 accumulation of
        /// f16 dot products, our kernels' order (`parity ops` shows why).
        #[arg(long = "f32-accumulation", conflicts_with = "llamafile")]
        f32_accumulation: bool,
        /// Build it as `cmake -DGGML_LLAMAFILE=ON` does, into target/reference-llamafile:
        /// ggml's llamafile GEMM kernels (the ones our CPU plugins use), the fastest build
        /// of the reference a user can make here.
        #[arg(long = "llamafile")]
        llamafile: bool,
    },
    /// Compare text encoder, UNet, VAE and 256x256 generations with the reference; `parity
    /// --fuzz N --model PATH`: random cases on any checkpoint; `parity samplers`: every
    /// sampling method and scheduler; `parity ops`: each ggml op against the reference's;
    /// `parity t5 --t5xxl FILE`: the T5-XXL encoder; `parity flux-dit --vae FILE`: the FLUX
    /// transformer; `parity flux-vae --diffusion-model FILE`: the FLUX.1 VAE; `parity esrgan`:
    /// the ESRGAN upscaler; `parity zimage`: a whole Z-Image generation.
    Parity(parity::Args),
    /// Time sd-cli against the reference, alternating runs, with ratios.
    Bench(bench::Args),
    /// Every CPU variant this CPU can run, forced one at a time, beside the reference.
    BenchVariants(bench_variants::Args),
    /// Parameter homes over a loopback RPC device: client RSS (device/RAM/disk), segmented
    /// UNet with and without prefetch, --offload-to-cpu beside the reference.
    BenchPlacement(bench_placement::Args),
    /// Where a generation's compute time goes: time, FLOPs and bytes by ggml op and by block.
    Profile(profile::Args),
}

/// Parses `line` (split at whitespace) as the flags of one command, for the parsers' tests.
#[cfg(test)]
pub(crate) fn parse_test<T: clap::Args>(line: &str) -> Result<T> {
    #[derive(Parser)]
    struct One<A: clap::Args> {
        #[command(flatten)]
        args: A,
    }
    let argv = std::iter::once("xtask").chain(line.split_whitespace());
    One::<T>::try_parse_from(argv).map(|o| o.args).map_err(|e| anyhow::anyhow!("{e}"))
}

/// `cargo xtask presets`: measures every preset (sparse layout files in a temporary
/// directory) and rewrites the file sd-placement embeds.
fn write_presets() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("sd-presets-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let measured = sd_models::presets::measure_all(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    let presets = measured?;
    let path = workspace_root().join("crates/sd-placement/presets.json");
    std::fs::write(&path, serde_json::to_string_pretty(&presets)? + "\n")?;
    for p in &presets {
        println!("{} {}: {:.1} MiB", p.name, p.weight_type, p.total_bytes() as f64 / 1048576.0);
    }
    println!("wrote {}", path.display());
    Ok(())
}

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn main() -> Result<()> {
    let Some(command) = Cli::parse().command else {
        use clap::CommandFactory as _;
        Cli::command().print_help()?;
        return Ok(());
    };
    match command {
        Command::Plugins(a) => plugins::run(a),
        Command::Install(a) => install::install(&a),
        Command::Dist(a) => install::dist(&a),
        Command::Bindings => bindings::run(),
        Command::Fixture(a) => fixture::run(a),
        Command::Presets => write_presets(),
        Command::Parity(a) => parity::run(a),
        Command::Bench(a) => bench::run(a),
        Command::BenchPlacement(a) => bench_placement::run(a),
        Command::BenchVariants(a) => bench_variants::run(a),
        Command::Profile(a) => profile::run(a),
        Command::Reference { f32_accumulation, llamafile } => {
            let kernels = match (f32_accumulation, llamafile) {
                (true, _) => reference::Kernels::F32Accumulation,
                (_, true) => reference::Kernels::Llamafile,
                _ => reference::Kernels::Native,
            };
            let exe = reference::build_kernels(kernels)?;
            println!("{}", exe.display());
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_and_its_spelling_parses() {
        for line in [
            "plugins --backend cpu,rpc --cpu-variants all --out /tmp/p",
            "plugins --parity",
            "bindings",
            "fixture sd15 --seed 1",
            "reference",
            "reference --f32-accumulation",
            "parity sd15 --threads 4",
            "parity ops --ref-lib /r --plugin /p.so",
            "parity --compare-runs /a /b",
            "parity samplers --steps 3",
            "parity zimage --steps 1 --sd-cli target/debug/sd-cli",
            "parity sd3 --missing --size 64 --sd-cli target/debug/sd-cli",
            "fixture sd35-medium --depth 24 --hidden 192 --with-clips -o m.safetensors",
            "fixture zimage --layers 2 --refiner-layers 1 --hidden 256 --cap-dim 256 --std 0.02 -o z.safetensors",
            "parity --fuzz 2 --model m.safetensors",
            "bench --size both --runs 1",
            "bench-variants --variants all",
            "bench-placement --runs 1 --size 256",
        ] {
            let argv = std::iter::once("xtask").chain(line.split_whitespace());
            if let Err(e) = Cli::try_parse_from(argv) {
                panic!("{line}: {e}");
            }
        }
        assert!(Cli::try_parse_from(["xtask", "bench-everything"]).is_err());
    }
}
