//! FLUX.2 klein end to end from the component files the reference takes (`--diffusion-model`,
//! `--llm`, `--vae`), on the fixtures `cargo xtask parity flux2` compares with the reference: a
//! reduced DiT (width 256, 2 double and 2 single blocks), a 30-layer Qwen3 of width 256 and
//! FLUX.2's full-size VAE. Asserted here: determinism, the prompt and the init image reaching
//! the image, TAEF2 (`--taesd`), `plan` from the headers, the DiT segmented on an RPC server under a budget and
//! the LLM layer-split over the server and the CPU giving the all-CPU image, and clear errors
//! for a missing or mismatched LLM or VAE.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;

use common::{png_pixels as pixels, sd_cli, write_init_png};
use sd_models::fixture::{self, flux, FileFormat, WeightType};
use sd_models::report::{Residency, RunReport};

/// (DiT, LLM, VAE), written once per process into the fixture cache.
fn files() -> &'static (PathBuf, PathBuf, PathBuf) {
    static FILES: OnceLock<(PathBuf, PathBuf, PathBuf)> = OnceLock::new();
    FILES.get_or_init(|| flux::cached_flux2_klein_set(7, 0.05).unwrap())
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sd-cli-flux2-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `sd-cli` with `pre` (a subcommand), the DiT `dit` (default: the fixture's), the LLM and
/// VAE (left out when `None`) and `extra`.
fn cli(pre: &[&str], dit: Option<&Path>, llm: Option<&Path>, vae: Option<&Path>, extra: &[&str]) -> Output {
    let mut c = sd_cli();
    c.env(sd_backends::backend::CPU_EXTRA_BUFTS_ENV, "off").args(pre);
    c.arg("--diffusion-model").arg(dit.unwrap_or(&files().0));
    if let Some(l) = llm {
        c.arg("--llm").arg(l);
    }
    if let Some(v) = vae {
        c.arg("--vae").arg(v);
    }
    c.args(extra).output().unwrap()
}

/// The tiny-autoencoder fixture of `z_channels` (32: TAEF2's layout).
fn tae(z_channels: usize) -> PathBuf {
    let path = fixture::taesd::cached_taesd_path(z_channels, 42, WeightType::F16);
    if !path.exists() {
        fixture::taesd::write_taesd(&path, z_channels, 42, WeightType::F16, FileFormat::Safetensors).unwrap();
    }
    path
}

fn all(extra: &[&str]) -> Output {
    let (_, llm, vae) = files();
    cli(&[], None, Some(llm), Some(vae), extra)
}

/// The DiT (12.6 MiB of weights) on the RPC server at `endpoint` under a 20 MiB budget, params
/// in RAM: it runs in segments at its block cuts (the text encoder and the VAE on the CPU).
fn segmented_on(endpoint: &str) -> [&str; 8] {
    [
        "--rpc",
        endpoint,
        "--max-vram",
        "RPC0=0.01953125",
        "--backend",
        "diffusion=RPC0,te=cpu,vae=cpu",
        "--params-backend",
        "diffusion=cpu",
    ]
}

#[test]
fn flux2_generates_reads_the_prompt_and_the_init_image_and_plans() {
    let d = dir("gen");
    let gen = |name: &str, more: &[&str]| {
        let out = d.join(format!("{name}.png"));
        let width = if more.contains(&"-W") { &[][..] } else { &["-W", "64"][..] };
        // 4 steps: at 2, an img2img of strength 0.5 starts from sigma 1 (the reference's cut),
        // where the init image is pure noise. Pixels, not PNG bytes: the PNG's parameters differ.
        let base = ["-H", "64", "--steps", "4", "-s", "7", "-o", out.to_str().unwrap()];
        let o = all(&[width, &base[..], more].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{name}:\n{err}");
        (pixels(&std::fs::read(&out).unwrap()), err)
    };
    let (cat, err) = gen("cat", &["-p", "a photo of a cat"]);
    assert!(err.contains("model: flux2-klein") && err.contains("flow matching"), "{err}");
    let px = &cat;
    assert_eq!(px.len(), 64 * 64 * 3);
    assert!(px.iter().any(|&v| v != px[0]), "a flat image");
    let (again, _) = gen("again", &["-p", "a photo of a cat"]);
    assert!(again == cat, "the same seed gives the same image");
    let (dog, _) = gen("dog", &["-p", "a photo of a dog"]);
    assert!(dog != cat, "the prompt reaches the image (through Qwen3)");
    // A non-square size (latents of 16 pixels) and an init image.
    let (wide, _) = gen("wide", &["-p", "a photo of a cat", "-W", "96"]);
    assert_eq!(wide.len(), 96 * 64 * 3);
    let init = d.join("init.png");
    write_init_png(&init, false);
    let i2i = ["-p", "a photo of a cat", "-i", init.to_str().unwrap(), "--strength", "0.5"];
    let (from_init, _) = gen("i2i", &i2i);
    assert!(from_init != cat, "the init image reaches the image");
    let flipped = d.join("flipped.png");
    write_init_png(&flipped, true);
    // The same strength as above: only the init image differs, so an ignored one would fail.
    let flip = ["-p", "a photo of a cat", "-i", flipped.to_str().unwrap(), "--strength", "0.5"];
    let (from_flipped, _) = gen("i2i-flipped", &flip);
    assert!(from_flipped != from_init, "another init image, another image");
    // TAEF2 decodes instead of the VAE: another image of the same size, the same each time.
    let taef2 = tae(32);
    let (tiny, err) = gen("taef2", &["-p", "a photo of a cat", "--taesd", taef2.to_str().unwrap()]);
    assert!(tiny != cat && tiny.len() == 64 * 64 * 3, "{err}");
    assert!(gen("taef2-again", &["-p", "a photo of a cat", "--taesd", taef2.to_str().unwrap()]).0 == tiny);
    // `plan` from the headers: every module sized, klein named.
    let (_, llm, vae) = files();
    let o = cli(&["plan"], None, Some(llm), Some(vae), &[]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && out.contains("flux2-klein"), "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn flux2_without_a_fitting_llm_or_vae_is_a_clear_error() {
    let d = dir("bad");
    let (_, llm, vae) = files();
    let out = d.join("x.png");
    let args = ["-p", "a cat", "-W", "64", "-H", "64", "-o", out.to_str().unwrap()];
    let check = |o: Output, needles: &[&str]| {
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.code() == Some(2), "{err}");
        for n in needles {
            assert!(err.contains(n), "'{n}' missing from:\n{err}");
        }
        assert!(!out.exists());
    };
    check(cli(&[], None, None, Some(vae), &args), &["FLUX.2 klein needs", "--llm"]);
    check(cli(&[], None, Some(llm), None, &args), &["FLUX.2 klein needs", "--vae"]);
    // An LLM too shallow for layers 9, 18 and 27 (Z-Image's 2-layer fixture).
    let shallow = d.join("qwen3-2l.safetensors");
    let cfg = sd_models::text::qwen3::Qwen3Config {
        n_layers: 2,
        hidden: 256,
        intermediate: 512,
        ..sd_models::text::qwen3::Qwen3Config::qwen3_4b()
    };
    fixture::qwen3::write_qwen3(&shallow, &cfg, 3, None, WeightType::F16, FileFormat::Safetensors).unwrap();
    check(cli(&[], None, Some(&shallow), Some(vae), &args), &["has 2 layers", "at least 27"]);
    // A DiT whose txt_in takes another LLM's width (three layers of 128).
    let narrow = d.join("dit-c384.safetensors");
    let c = flux::reduced_flux2(256, 1, 1, 3 * 128);
    flux::write_flux2(&narrow, &c, 3, Some(0.05), WeightType::F16, FileFormat::Safetensors).unwrap();
    check(cli(&[], Some(&narrow), Some(llm), Some(vae), &args), &["256 wide", "768", "takes 384", "txt_in"]);
    // An SD VAE (4 channels) for FLUX.2's 32.
    let sd_vae = d.join("sd-vae.safetensors");
    let req = fixture::FixtureRequest::family(fixture::FixtureModel::Sd15, 1, WeightType::F16, FileFormat::Safetensors);
    let mut req = req;
    req.arch = req.arch.only(&[fixture::Component::Vae]);
    fixture::write_fixture(&sd_vae, &req).unwrap();
    check(cli(&[], None, Some(llm), Some(&sd_vae), &args), &["VAE"]);
    // A TAEF1 (16 channels) where FLUX.2 takes TAEF2 (32, patched).
    let needles = ["decoder.layers.0.weight", "[64, 16, 3, 3]", "flux2-klein model expects shape [64, 32, 3, 3]"];
    check(all(&[&args[..], &["--taesd", tae(16).to_str().unwrap()]].concat()), &needles);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn flux2_edits_with_reference_images_in_order_and_segmented() {
    // Reference images (-r): each changes the image, in order; the same refs give the same
    // image; the DiT's extra tokens run segmented on an RPC server as on the CPU.
    let d = dir("refs");
    let (a, b) = (d.join("a.png"), d.join("b.png"));
    write_init_png(&a, false);
    write_init_png(&b, true);
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let gen = |name: &str, more: &[&str]| {
        let out = d.join(format!("{name}.png"));
        let base = ["-p", "the cat of image 1", "-W", "64", "-H", "48", "--steps", "2", "-s", "7"];
        let o = all(&[&base[..], &["-o", out.to_str().unwrap()], more].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{name}:\n{err}");
        pixels(&std::fs::read(&out).unwrap())
    };
    let plain = gen("plain", &[]);
    let one = gen("one", &["-r", a]);
    assert!(one != plain, "a reference image reaches the image");
    assert!(gen("one-again", &["--ref-image", a]) == one, "the same reference, the same image");
    let ab = gen("ab", &["-r", a, "-r", b]);
    let ba = gen("ba", &["-r", b, "-r", a]);
    assert!(ab != one && ba != ab, "a second reference counts, and their order does");
    // The image guidance: three passes with references, ignored without (as the reference).
    assert!(gen("ab-img-cfg", &["-r", a, "-r", b, "--img-cfg-scale", "2"]) != ab, "--img-cfg-scale ignored");
    assert!(gen("img-cfg-alone", &["--img-cfg-scale", "2"]) == plain, "image guidance without references");
    // Auto-resized, the 64x64 reference takes the 64x48 image's area (48x48); at its own size
    // (whole latents) it is encoded as it is.
    let own = gen("own", &["-r", a, "--disable-auto-resize-ref-image"]);
    assert!(own != one, "64x64 encoded as it is, not resized to 48x48");
    // img2img with a reference: the init image and the reference go through one encoder
    // load (one `vae load (encode)` stage in the run report), and both reach the image.
    let report = d.join("edit.json");
    let edit = gen("edit", &["-r", a, "-i", b, "--strength", "0.3", "--report-json", report.to_str().unwrap()]);
    assert!(edit != one, "the init image reaches the image");
    let report = sd_models::report::RunReport::from_json(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let loads = report.stages.iter().filter(|s| s.name == "vae load (encode)").count();
    assert_eq!(loads, 1, "{:?}", report.stages);
    let server = common::Server::start();
    let placed = segmented_on(&server.endpoint);
    let seg = gen("seg", &[&["-r", a, "-r", b][..], &placed[..]].concat());
    assert!(seg == ab, "the segmented run with references differs from the CPU one");
    // Bad references are errors naming them, before anything runs.
    let out = d.join("x.png");
    let check = |more: &[&str], needles: &[&str]| {
        let o = all(&[&["-p", "x", "-W", "64", "-H", "64", "-o", out.to_str().unwrap()][..], more].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.code() == Some(2), "{err}");
        for n in needles {
            assert!(err.contains(n), "'{n}' missing from:\n{err}");
        }
        assert!(!out.exists());
    };
    let missing = d.join("no-such.png");
    check(&["-r", missing.to_str().unwrap()], &["-r ", "no-such.png"]);
    let odd = d.join("odd.png");
    let img = sd_models::pipeline::Image { width: 100, height: 40, rgb: vec![90; 100 * 40 * 3] };
    sd_models::image_io::save_image(&odd, &img, sd_models::image_io::OutputFormat::Png, None).unwrap();
    let needles = ["-r 1 (100x40)", "multiples of 16"];
    check(&["-r", a, "-r", odd.to_str().unwrap(), "--disable-auto-resize-ref-image"], &["-r 2 (100x40)"]);
    check(&["-r", odd.to_str().unwrap(), "--disable-auto-resize-ref-image"], &needles);
    // Skip-layer guidance: a bad list of blocks is named.
    check(&["--slg-scale", "2.5", "--skip-layers", "[7,x]"], &["--skip-layers [7,x]", "'x' is not a block number"]);
    // A model that reads no references refuses them (the SD 1.5 fixture).
    let o = sd_cli()
        .arg("-m")
        .arg(common::sd15_fixture())
        .args(["-p", "x", "-W", "64", "-H", "64", "-r", a, "-o", out.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.code() == Some(2) && err.contains("reads no reference images"), "{err}");
    // Nor has its UNet blocks to skip for skip-layer guidance (the DiTs have).
    let o = sd_cli()
        .arg("-m")
        .arg(common::sd15_fixture())
        .args(["-p", "x", "-W", "64", "-H", "64", "--slg-scale", "2", "-o", out.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.code() == Some(2) && err.contains("--slg-scale: the sd1 model has no layers to skip"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn flux2_segmented_under_a_budget_and_split_give_the_cpu_image() {
    // The DiT (12.6 MiB of weights) computes on an RPC server under a 20 MiB budget (about
    // 5.6 MiB of it the cut buffers of 512 text tokens, a double block's segment 11 MiB with its
    // attention), params in RAM: it runs in segments at its block cuts. Then the LLM is
    // layer-split over the server and the CPU. Both give the all-CPU image.
    let d = dir("seg");
    let gen = |name: &str, more: &[&str]| {
        let (out, report) = (d.join(format!("{name}.png")), d.join(format!("{name}.json")));
        let base =
            ["-p", "a photo of a cat", "-W", "64", "-H", "64", "--steps", "2", "-s", "7", "-o", out.to_str().unwrap()];
        let o = all(&[&base[..], &["--report-json", report.to_str().unwrap()], more].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{name}:\n{err}");
        let report = RunReport::from_json(&std::fs::read_to_string(&report).unwrap()).unwrap();
        (pixels(&std::fs::read(&out).unwrap()), report, err)
    };
    let (cpu, _, _) = gen("cpu", &["--backend", "cpu"]);
    let server = common::Server::start();
    let placed = segmented_on(&server.endpoint);
    let (png, report, err) = gen("rpc", &placed);
    assert!(png == cpu, "the segmented image differs from the CPU one:\n{err}");
    let unet = report.module("unet").unwrap();
    let s = &report.runner("unet").unwrap().stats;
    assert_eq!((unet.devices.as_slice(), unet.residency), (&["RPC0".to_string()][..], Residency::Segmented));
    assert!(s.segmented_runs > 1 && s.max_segments > 1, "the steps in segments: {s:?}");
    let split = ["--rpc", server.endpoint.as_str(), "--backend", "te=RPC0&CPU,diffusion=cpu,vae=cpu"];
    let (png, report, err) = gen("split", &split);
    assert!(png == cpu, "the layer-split image differs from the CPU one:\n{err}");
    assert_eq!(report.module("te").unwrap().devices.len(), 2, "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn flux2_loras_apply_in_both_layouts_and_modes() {
    use sd_models::fixture::lora::{write_flux_lora, LoraFixture, LoraLayout};
    let d = dir("lora");
    let cfg = flux::reduced_flux2(256, 2, 2, 3 * 256);
    let lora = |layout| LoraFixture { layout, rank: 4, seed: 1, scale: 0.05, text_encoder: false };
    // One set of values in kohya's and BFL's dotted layouts (kohya's alpha = rank / 2 halves
    // the scale); diffusers' FLUX.2 names are refused by the writer (and unknown to the reference).
    write_flux_lora(&d.join("kohya.safetensors"), &cfg, &lora(LoraLayout::Kohya)).unwrap();
    write_flux_lora(&d.join("peft.safetensors"), &cfg, &lora(LoraLayout::Peft)).unwrap();
    assert!(write_flux_lora(&d.join("x.safetensors"), &cfg, &lora(LoraLayout::Diffusers)).is_err());
    let dir_arg = d.display().to_string();
    let gen = |name: &str, prompt: &str, more: &[&str]| -> Vec<u8> {
        let out = d.join(format!("{name}.png"));
        let base = ["-p", prompt, "-W", "64", "-H", "64", "--steps", "2", "-s", "7", "--lora-model-dir", &dir_arg];
        let o = all(&[&base[..], &["-o", out.to_str().unwrap()], more].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{name}:\n{err}");
        assert!(!err.contains("name no tensor"), "{name}: an adapter was not used:\n{err}");
        pixels(&std::fs::read(&out).unwrap())
    };
    let base = gen("base", "a photo of a cat", &[]);
    let kohya = gen("kohya", "a photo of a cat<lora:kohya:1>", &[]);
    assert!(kohya != base, "the kohya LoRA reaches the image");
    assert!(gen("zero", "a photo of a cat<lora:kohya:0>", &[]) == base, "multiplier 0 changed the image");
    assert!(gen("peft", "a photo of a cat<lora:peft:0.5>", &[]) == kohya, "kohya and dotted layouts differ");
    let rt = gen("kohya-rt", "a photo of a cat<lora:kohya:1>", &["--lora-apply-mode", "at_runtime"]);
    let (a, b) = (&rt[..], &kohya[..]);
    let diffs: Vec<u8> = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y)).collect();
    let mean = diffs.iter().map(|&v| f64::from(v)).sum::<f64>() / diffs.len() as f64;
    let max = diffs.iter().copied().max().unwrap_or(0);
    assert!(mean <= 1.0 && max <= 8, "at_runtime vs immediately: mean {mean:.3}, max {max}");
    let _ = std::fs::remove_dir_all(&d);
}

/// FLUX.2 dev on its reduced fixtures (a DiT of width 256 with 1 double and 48 single blocks and
/// the guidance embedding, a 30-layer Mistral of width 256, FLUX.2's VAE; `cargo xtask parity
/// flux2 --dev` compares them with the reference): it generates, reads the prompt (through
/// Mistral) and `--guidance`, gives the CPU's image with Mistral layer-split over an RPC server and
/// the CPU and with Mistral segmented on the server under a budget, `plan` names it, and an LLM
/// of the other FLUX.2 is refused by name in both directions, as is a Mistral too shallow for
/// layers 10, 20 and 30.
#[test]
fn flux2_dev_generates_with_mistral_and_refuses_the_other_llm() {
    let d = dir("dev");
    let (dit, llm, vae) = flux::cached_flux2_dev_set(7, 0.05).unwrap();
    let gen = |name: &str, more: &[&str]| {
        let out = d.join(format!("{name}.png"));
        let base = ["-W", "64", "-H", "64", "--steps", "2", "-s", "7", "-o", out.to_str().unwrap()];
        let o = cli(&[], Some(&dit), Some(&llm), Some(&vae), &[&base[..], more].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{name}:\n{err}");
        (pixels(&std::fs::read(&out).unwrap()), err)
    };
    let (cat, err) = gen("cat", &["-p", "a photo of a cat"]);
    assert!(err.contains("model: flux2") && !err.contains("flux2-klein"), "{err}");
    assert!(cat.iter().any(|&v| v != cat[0]), "a flat image");
    let (dog, _) = gen("dog", &["-p", "a photo of a dog"]);
    assert!(dog != cat, "the prompt reaches the image (through Mistral)");
    let (guided, _) = gen("guided", &["-p", "a photo of a cat", "--guidance", "6"]);
    assert!(guided != cat, "--guidance reaches the DiT's guidance embedding");
    // Placement of the Mistral encoder: layer-split over an RPC server and the CPU, then alone
    // on the server in segments under an 80 MiB budget (237 MiB of weights in RAM, the embedding
    // table 64 MiB of them): the CPU's image.
    let server = common::Server::start();
    let (cpu, _) = gen("cpu", &["-p", "a photo of a cat", "--backend", "cpu"]);
    assert!(cpu == cat);
    let split = ["--rpc", server.endpoint.as_str(), "--backend", "te=RPC0&CPU,diffusion=cpu,vae=cpu"];
    let (png, err) = gen("split", &[&["-p", "a photo of a cat"][..], &split].concat());
    assert!(png == cpu, "the layer-split image differs from the CPU one:\n{err}");
    let seg = [
        "--rpc",
        server.endpoint.as_str(),
        "--backend",
        "te=RPC0,diffusion=cpu,vae=cpu",
        "--params-backend",
        "te=cpu",
        "--max-vram",
        "RPC0=0.078125",
    ];
    let report = d.join("seg.json");
    let (png, err) =
        gen("seg", &[&["-p", "a photo of a cat", "--report-json", report.to_str().unwrap()][..], &seg].concat());
    assert!(png == cpu, "the segmented encoder's image differs from the CPU one:\n{err}");
    let report = RunReport::from_json(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let s = &report.runner("te").unwrap().stats;
    assert!(s.segmented_runs > 0 && s.max_segments > 1, "the encoder in segments: {s:?}");
    let o = cli(&["plan"], Some(&dit), Some(&llm), Some(&vae), &[]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && out.contains("flux2") && !out.contains("flux2-klein"), "{out}");
    let refused = |dit: &Path, llm: &Path, needles: &[&str]| {
        let out = d.join("x.png");
        let o = cli(&[], Some(dit), Some(llm), Some(&vae), &["-p", "a cat", "-o", out.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.code() == Some(2), "{err}");
        for n in needles {
            assert!(err.contains(n), "missing {n:?} in:\n{err}");
        }
        assert!(!out.exists());
    };
    let (klein_dit, qwen, _) = files();
    refused(&dit, qwen, &["q_norm", "Qwen3", "Mistral-Small-3.2"]);
    refused(klein_dit, &llm, &["q_norm", "FLUX.2 klein reads a Qwen3"]);
    let shallow = d.join("mistral-2l.safetensors");
    let cfg = sd_models::text::qwen3::Qwen3Config {
        n_layers: 2,
        hidden: 256,
        intermediate: 512,
        ..sd_models::text::qwen3::Qwen3Config::mistral_small_3_2()
    };
    fixture::qwen3::write_qwen3(&shallow, &cfg, 3, None, WeightType::F16, FileFormat::Safetensors).unwrap();
    refused(&dit, &shallow, &["has 2 layers", "at least 30"]);
    let _ = std::fs::remove_dir_all(&d);
}

/// A sparse safetensors file (the header, then a hole as long as the data) of `specs` (ggml
/// order) with `prefix` taken off each name, as bf16 (FLUX.2 dev's and Mistral's release type).
fn write_sparse_bf16(path: &Path, specs: &[sd_sched::TensorSpec], prefix: &str) -> u64 {
    use sd_models::files::safetensors::{header_bytes, HeaderEntry};
    use sd_models::files::DType;
    let tensors: Vec<(String, Vec<u64>)> = specs
        .iter()
        .map(|s| (s.name.strip_prefix(prefix).unwrap().to_owned(), s.ne.iter().rev().map(|&d| d as u64).collect()))
        .collect();
    let entries: Vec<HeaderEntry<'_>> =
        tensors.iter().map(|(n, s)| HeaderEntry { name: n, dtype: DType::BF16, shape: s }).collect();
    let header = header_bytes(&entries, &Default::default()).unwrap();
    let data: u64 = tensors.iter().map(|(_, s)| 2 * s.iter().product::<u64>()).sum();
    std::fs::write(path, &header).unwrap();
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(header.len() as u64 + data).unwrap();
    data
}

/// FLUX.2 dev at its real sizes (a 32B DiT and Mistral-Small-3.2-24B, bf16; sparse files of
/// their headers) on one 24 GiB GPU: `plan` (headers only) computes both on the GPU with neither
/// resident there (about 103 GiB of weights), streaming the DiT's blocks from system memory with
/// 128 GiB of RAM; with 64 GiB the DiT streams from disk and the encoder from RAM, and the
/// memory check refuses the load as its seed says (the estimate, 129 GiB, exceeds the GPU plus
/// RAM) unless `--no-memory-check`.
#[test]
fn flux2_dev_at_real_size_auto_fits_one_24_gib_gpu_and_ram() {
    use sd_models::diffusion::flux::{flux_specs, FluxConfig, PREFIX};
    use sd_models::text::qwen3::{qwen3_specs, Qwen3Config, LLM_PREFIX};
    use sd_placement::{ParamsHome, Plan, Verdict};
    let d = dir("dev-plan");
    let bf16 = |_: &str| Some(sd_backends::GgmlType::GGML_TYPE_BF16);
    let dit = d.join("flux2-dev.safetensors");
    let dit_bytes = write_sparse_bf16(&dit, &flux_specs(&FluxConfig::flux2_dev(), &bf16, None), &format!("{PREFIX}."));
    let llm = d.join("mistral-small-3.2.safetensors");
    let llm_bytes = write_sparse_bf16(
        &llm,
        &qwen3_specs(&Qwen3Config::mistral_small_3_2(), &bf16, None),
        &format!("{LLM_PREFIX}."),
    );
    // 32.2 and 22.9 billion parameters at two bytes.
    assert!(dit_bytes > 64_000_000_000 && llm_bytes > 45_000_000_000, "{dit_bytes} {llm_bytes}");
    let vae = fixture::flux_vae::cached_flux2_vae_path(42, WeightType::F16);
    if !vae.is_file() {
        fixture::flux_vae::write_flux2_vae(&vae, 42, WeightType::F16, FileFormat::Safetensors).unwrap();
    }
    let plan = |ram_gib: u64, more: &[&str]| -> (Plan, String) {
        let profile = d.join(format!("gpu24-ram{ram_gib}.toml"));
        std::fs::write(
            &profile,
            format!(
                "ram_available_mib = {}\n[[device]]\nname = \"GPU0\"\ntype = \"gpu\"\nfree_mib = 24576\n\
                 total_mib = 24576\n[[device]]\nname = \"CPU\"\ntype = \"cpu\"\n",
                ram_gib * 1024
            ),
        )
        .unwrap();
        let args = [&["--devices", profile.to_str().unwrap(), "--json"][..], more].concat();
        let o = cli(&["plan"], Some(&dit), Some(&llm), Some(&vae), &args);
        let plan: Plan =
            serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stderr)));
        let text = serde_json::to_string_pretty(&plan).unwrap();
        // `plan` exits 1 for a plan that does not fit.
        assert_eq!(o.status.code(), Some(if plan.fits { 0 } else { 1 }), "{text}");
        (plan, text)
    };
    let params = |p: &Plan, name: &str| {
        let m = p.modules.iter().find(|m| m.module.name() == name).unwrap();
        assert_eq!(m.runtime, vec!["GPU0".to_string()], "{name} computes on the GPU");
        m.params.clone()
    };
    let cpu = ParamsHome::Device("CPU".into());
    let (big, text) = plan(128, &[]);
    assert!(big.fits && big.auto_fit && big.main_device == "GPU0", "{text}");
    assert_eq!((params(&big, "diffusion"), params(&big, "te")), (cpu.clone(), cpu.clone()), "{text}");
    let gpu = big.devices.iter().find(|u| u.device == "GPU0").unwrap();
    assert!(gpu.fits && gpu.param_bytes == 0 && Some(gpu.used_bytes) <= gpu.budget_bytes, "{text}");
    assert_eq!(big.memory_check.verdict, Verdict::Warn, "{text}");
    let (small, text) = plan(64, &[]);
    assert_eq!((params(&small, "diffusion"), params(&small, "te")), (ParamsHome::Disk, cpu), "{text}");
    assert!(!small.fits && small.memory_check.verdict == Verdict::Refuse, "{text}");
    assert!(small.memory_check.message.contains("exceeds every discrete GPU plus available RAM"), "{text}");
    let (forced, text) = plan(64, &["--no-memory-check"]);
    assert!(forced.fits && forced.memory_check.verdict == Verdict::Skipped, "{text}");
    let _ = std::fs::remove_dir_all(&d);
}
