//! Placement at run time, end to end: the same fixture generation (fixed seed) under many
//! placements must give the same image. The remote device is a real RPC server (`sd-cli
//! rpc-server`) on loopback running the same CPU kernels, so every placement is required to
//! be bit-identical to the all-CPU run; `-v` output is checked for what the runtime says it
//! did (segments, prefetches, each device's high-water mark within its budget).

mod common;

use std::path::Path;

use common::{sd15_fixture as fixture, sd_cli, Server};

fn pixels(path: &Path) -> Vec<u8> {
    let dec = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut r = dec.read_info().unwrap();
    let mut buf = vec![0; r.output_buffer_size().unwrap()];
    let info = r.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    buf
}

/// Generates with `extra` flags; returns the pixels and the `-v` log.
fn generate(model: &Path, out: &Path, extra: &[&str]) -> (Vec<u8>, String) {
    let o = sd_cli()
        .arg("-m")
        .arg(model)
        .args(["-p", "a cat", "-W", "64", "-H", "64", "--steps", "2", "--sampling-method", "euler"])
        .args(["-s", "42", "--cfg-scale", "1", "-t", "2", "-v", "-o"])
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "sd-cli {extra:?} failed:\n{log}");
    (pixels(out), log)
}

/// `(high-water MiB, budget MiB)` of `device` from the `-v` report.
fn high_water(log: &str, device: &str) -> (f64, Option<f64>) {
    let line = log
        .lines()
        .find(|l| l.contains(&format!("{device}: managed high-water")))
        .unwrap_or_else(|| panic!("no high-water line for {device} in:\n{log}"));
    let num_after = |key: &str| -> Option<f64> {
        let rest = &line[line.find(key)? + key.len()..];
        rest.trim_start().split(' ').next()?.parse().ok()
    };
    (num_after("high-water").unwrap(), num_after("budget"))
}

/// The UNet runner's summary line.
fn unet_summary(log: &str) -> &str {
    log.lines().find(|l| l.contains("unet params ")).unwrap_or_else(|| panic!("no unet summary in:\n{log}"))
}

#[test]
fn every_placement_gives_the_all_cpu_image() {
    let model = fixture();
    let dir = std::env::temp_dir().join(format!("sd-cli-placement-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (base, log) = generate(&model, &dir.join("cpu.png"), &["--backend", "cpu"]);
    assert!(unet_summary(&log).contains("0 segmented"), "{}", unet_summary(&log));

    let server = Server::start();
    let rpc = ["--rpc", server.endpoint.as_str()];
    let budget = "RPC0=0.5"; // 512 MiB: less than a third of the 1.6 GiB UNet
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("params on the device", vec!["--backend", "RPC0"]),
        ("params in RAM", vec!["--backend", "RPC0", "--params-backend", "cpu"]),
        ("params on disk", vec!["--backend", "RPC0", "--params-backend", "disk"]),
        ("params on another device", vec!["--backend", "cpu", "--params-backend", "RPC0"]),
        ("segmented", vec!["--backend", "RPC0", "--params-backend", "cpu", "--max-vram", budget]),
        (
            "segmented, no prefetch",
            vec!["--backend", "RPC0", "--params-backend", "cpu", "--max-vram", budget, "--disable-prefetch"],
        ),
        // performance.md: "0 uses the device's current free memory without an explicit budget".
        ("--max-vram 0", vec!["--backend", "RPC0", "--params-backend", "cpu", "--max-vram", "RPC0=0"]),
        (
            "monolithic forced with room",
            vec!["--backend", "RPC0", "--params-backend", "cpu", "--max-vram", "RPC0=4", "--disable-segmented-compute"],
        ),
    ];
    for (i, (what, flags)) in cases.iter().enumerate() {
        let args: Vec<&str> = rpc.iter().copied().chain(flags.iter().copied()).collect();
        let (px, log) = generate(&model, &dir.join(format!("{i}.png")), &args);
        assert!(px == base, "{what}: the image differs from the all-CPU one");
        let unet = unet_summary(&log);
        let (hw, budget_mib) = high_water(&log, "RPC0");
        if let Some(b) = budget_mib {
            assert!(hw <= b, "{what}: RPC0 high-water {hw} MiB above its budget {b} MiB");
        }
        match *what {
            "segmented" => {
                assert!(unet.contains("2 segmented") && !unet.contains("up to 1 segments"), "{what}: {unet}");
                assert!(!unet.contains(" 0 groups"), "{what}: prefetch is on by default: {unet}");
            }
            "segmented, no prefetch" => {
                assert!(unet.contains("2 segmented"), "{what}: {unet}");
                assert!(unet.contains("prefetched 0.0 MiB in 0 groups"), "{what}: {unet}");
            }
            "params on the device" => {
                assert!(unet.contains("0 segmented") && log.contains("unet params on the computing device"), "{unet}");
                assert!(hw > 1600.0, "the UNet's weights are managed on RPC0: {hw} MiB");
            }
            _ => assert!(unet.contains("0 segmented"), "{what}: {unet}"),
        }
        if *what == "--max-vram 0" {
            assert_eq!(budget_mib, None, "{what}: RPC0 must have no managed budget");
        }
        if *what == "params on disk" {
            assert!(log.contains("unet params on disk"), "{what}: {log}");
        }
        if *what == "params on another device" {
            assert!(log.contains("unet params on RPC0") && unet.contains("unet on CPU"), "{what}: {unet}");
            assert!(hw > 1600.0, "the UNet's home copy is managed on RPC0: {hw} MiB");
        }
    }
}

#[test]
fn a_budget_too_small_for_one_block_fails_cleanly() {
    let model = fixture();
    let server = Server::start();
    let out = std::env::temp_dir().join(format!("sd-cli-placement-small-{}.png", std::process::id()));
    let o = sd_cli()
        .arg("-m")
        .arg(&model)
        .args(["-p", "a cat", "-W", "64", "-H", "64", "--steps", "1", "--cfg-scale", "1"])
        .args(["--rpc", &server.endpoint, "--backend", "RPC0", "--params-backend", "cpu", "--max-vram", "RPC0=0.01"])
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a 10 MiB budget cannot hold a UNet block");
    assert!(err.contains("RPC0"), "the error names the device: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out.exists(), "no output file left behind");
}
