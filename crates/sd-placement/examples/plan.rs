//! Plans FLUX.1-dev (the q8_0 preset) on the devices of a TOML profile (a file given as the first argument, or the built-in one) and prints the plan.
//!
//! `cargo run -p sd-placement --example plan [PROFILE.toml] [--json]`

use sd_placement::{plan, presets, DeviceProfile, Flags, PlanRequest};

/// Two 12 GiB GPUs and 32 GiB of RAM, in the profile format of `sd-cli plan --devices`.
const PROFILE: &str = r#"
ram_available_mib = 32768
[[device]]
name = "CUDA0"
type = "gpu"
free_mib = 12288
[[device]]
name = "CUDA1"
type = "gpu"
free_mib = 12288
[[device]]
name = "CPU"
type = "cpu"
"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let text = match args.iter().find(|a| !a.starts_with("--")) {
        Some(path) => std::fs::read_to_string(path)?,
        None => PROFILE.to_string(),
    };
    let profile = DeviceProfile::from_toml_str(&text)?;
    let request = PlanRequest {
        // as typed on a command line: the diffusion model split over both GPUs, the T5's
        // weights in RAM, streamed to CUDA1 as it encodes
        flags: Flags {
            backend: Some("diffusion=CUDA0&CUDA1,te=CUDA1,vae=CUDA0".into()),
            params_backend: Some("te=cpu".into()),
            ..Flags::default()
        },
        devices: profile.devices(),
        ram_available_bytes: profile.ram_available_bytes(),
        // FLUX.1-dev's measured sizes, its weights converted to q8_0 on load
        model: presets::find("flux-dev", "q8_0").ok_or("no flux-dev q8_0 preset")?.description(),
        device_speeds: profile.device_speeds(),
    };
    let p = plan(&request)?;
    println!("{}", if json { p.to_json() } else { p.render() });
    std::process::exit(if p.fits { 0 } else { 1 });
}
