//! `cargo xtask parity sd3`: whole SD3 / SD3.5 generations, ours against the reference's.
//!
//! ```text
//! cargo xtask parity sd3 [-m FILE [--clip_l F] [--clip_g F] [--t5xxl F]] [--size N] [--steps N]
//!                        [--seed N] [--threads N] [--missing] [--sd-cli EXE]
//! ```
//!
//! Without `-m` it writes (once, in the fixture cache) an SD3.5 Medium layout (MMDiT-X: 24
//! joint blocks, the first 13 with `attn2`, width 192, so 24 heads of 8; the reference cannot
//! build fewer than 24 blocks), every MMDiT matrix N(0, 0.05) from seed 13, with the VAE and
//! full-size CLIP-L and CLIP-G inside (`sd_models::fixture::sd3`). T5-XXL is left out unless
//! `--t5xxl` names one: the reference builds all 24 of its 4096-wide layers.
//!
//! Cases, each one generation by both programs with the same files and flags, compared as PNGs
//! within the image bound (`Tolerance::PNG`):
//! - `txt2img`: a prompt with weights, `BREAK` and an escaped bracket, a negative prompt, cfg 5;
//! - `no negative`: another prompt, no negative prompt, the default cfg (7), 2 clip skip;
//! - `taesd` (fixtures only): `txt2img`'s flags with a 16-channel tiny autoencoder (TAESD3's
//!   layout, the TAEF1 fixture) in place of the VAE;
//! - `img2img`: from the reference's `txt2img` image at strength 0.6;
//! - `slg`: `txt2img`'s flags with skip-layer guidance at 2.5 over blocks 7, 8 and 9 (the
//!   default) on every step (`--skip-layer-end 1`), which must also change our image.
//!
//! With `--loras` (fixtures only) the `txt2img` case with a LoRA in each layout: the original
//! dotted names and diffusers' names match; the reference drops every adapter of a kohya file
//! (it cannot make SD3's flat names dotted), which the case checks instead.
//!
//! With `--missing` (fixtures only) the checkpoint without its encoders and the encoders as
//! `--clip_l` / `--clip_g` files of the same values, each missing in turn: `clip_l only` and
//! `clip_g only` (the absent one contributes zeros here). The pinned reference aborts on both
//! (its conditioner concatenates tensors of different ranks for the pooled vector): the case
//! then checks that ours generates and says so. A missing T5 is every default case: the
//! reference supports that one.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result};
use sd_models::family::sd3::mmdit::MmditConfig;
use sd_models::fixture::{self, sd3, FileFormat, WeightType};

use crate::parity::{png_diff, run_ok, Row, Tolerance};
use crate::reference;

/// `cargo xtask parity sd3` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// An SD3 checkpoint (default: the fixture).
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    model: Option<PathBuf>,
    /// A CLIP-L file for both programs.
    #[arg(long = "clip_l", value_name = "FILE")]
    clip_l: Option<PathBuf>,
    /// A CLIP-G file for both programs.
    #[arg(long = "clip_g", value_name = "FILE")]
    clip_g: Option<PathBuf>,
    /// A T5-XXL file for both programs (the reference needs all 24 layers).
    #[arg(long = "t5xxl", value_name = "FILE")]
    t5xxl: Option<PathBuf>,
    /// Image side in pixels (a multiple of 16).
    #[arg(long = "size", default_value_t = 64, value_parser = clap::value_parser!(u32).range(16..=1024))]
    size: u32,
    /// Sampling steps.
    #[arg(long = "steps", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=50))]
    steps: u32,
    /// Seed of the generations.
    #[arg(long = "seed", default_value_t = 42)]
    seed: u64,
    /// CPU threads of both programs.
    #[arg(long = "threads", short = 't', default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
    /// Also each CLIP missing in turn (fixtures only).
    #[arg(long = "missing", conflicts_with = "model")]
    missing: bool,
    /// Also the `txt2img` case with a LoRA of the fixture MMDiT in each layout (the original
    /// dotted names, diffusers' split q/k/v, kohya's flat names): ours from a prompt tag, the
    /// reference's from `--lora`.
    #[arg(long = "loras", conflicts_with = "model")]
    loras: bool,
    /// Our executable (default: `sd-cli` built in release).
    #[arg(long = "sd-cli", value_name = "EXE")]
    sd_cli: Option<PathBuf>,
}

/// Seed of the fixture's weights.
const FIXTURE_SEED: u64 = 13;
/// Standard deviation of the fixture's MMDiT matrices.
const FIXTURE_STD: f64 = 0.05;

/// The fixture's MMDiT: SD3.5 Medium's layout at width 192.
fn fixture_config() -> MmditConfig {
    let base = MmditConfig::sd35_medium();
    let side = base.pos_embed_max_size;
    sd3::reduced(base, 192, 24, side)
}

/// The cached fixture checkpoint (`clips`: with the CLIPs inside), written once.
fn checkpoint(clips: bool) -> Result<PathBuf> {
    std::fs::create_dir_all(fixture::cache_dir())?;
    let cfg = fixture_config();
    let path = sd3::cached_sd3_path(&cfg, FIXTURE_SEED, WeightType::F16, clips)
        .with_extension(format!("std{FIXTURE_STD}.safetensors"));
    if !path.is_file() {
        let (std, f16, st) = (Some(FIXTURE_STD), WeightType::F16, FileFormat::Safetensors);
        sd3::write_sd3(&path, &cfg, FIXTURE_SEED, std, f16, st, clips)?;
    }
    Ok(path)
}

/// The cached `clip_l` / `clip_g` file of the fixture.
fn clip_file(which: &str) -> Result<PathBuf> {
    let path = fixture::cache_dir().join(format!("sd3-{which}-fixture-seed{FIXTURE_SEED}-f16.safetensors"));
    if !path.is_file() {
        sd3::write_sd3_clip(&path, which, FIXTURE_SEED, WeightType::F16)?;
    }
    Ok(path)
}

/// One case: a name and the flags both programs get besides the files.
struct Case {
    name: &'static str,
    flags: Vec<String>,
    /// `(flag, file)` pairs for both programs.
    files: Vec<(&'static str, PathBuf)>,
}

/// Runs `case` on both programs; the row (and the reference's PNG).
fn generate(sdref: &Path, ours: &Path, dir: &Path, case: &Case) -> Result<(Row, PathBuf)> {
    let file_args = |c: &mut Command| {
        for (flag, path) in &case.files {
            c.arg(flag).arg(path);
        }
    };
    let slug = case.name.replace(' ', "-");
    let ref_png = dir.join(format!("{slug}.ref.png"));
    let mut c = Command::new(sdref);
    c.arg("txt2img");
    file_args(&mut c);
    c.args(&case.flags).arg("-o").arg(&ref_png);
    let ref_s = run_ok(c, &format!("sdref {}", case.name))?;
    let ours_png = dir.join(format!("{slug}.ours.png"));
    let mut c = Command::new(ours);
    file_args(&mut c);
    c.args(&case.flags).arg("-o").arg(&ours_png).env("NO_COLOR", "1");
    let ours_s = run_ok(c, &format!("sd-cli {}", case.name))?;
    let (diff, shape) = png_diff(&ours_png, &ref_png)?;
    let row = Row { family: "sd3", what: case.name.to_owned(), shape, diff, tol: Tolerance::PNG };
    row.print_timed(ref_s, ours_s);
    Ok((row, ref_png))
}

/// Entry point of `cargo xtask parity sd3`.
pub fn run(args: Args) -> Result<()> {
    let model = match &args.model {
        Some(m) => m.clone(),
        None => checkpoint(true)?,
    };
    let sdref = reference::build()?;
    let ours = match &args.sd_cli {
        Some(p) => p.clone(),
        None => crate::parity::build_sd_cli()?,
    };
    let dir = crate::workspace_root().join("target/parity/sd3");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let side = args.size.to_string();
    let common = |prompt: &str, negative: Option<&str>, cfg: Option<&str>| -> Vec<String> {
        let mut v: Vec<String> = ["-p", prompt, "-W", &side, "-H", &side, "--steps", &args.steps.to_string()]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        if let Some(n) = negative {
            v.extend(["-n".into(), n.into()]);
        }
        if let Some(c) = cfg {
            v.extend(["--cfg-scale".into(), c.into()]);
        }
        v.extend(["-s".into(), args.seed.to_string(), "-t".into(), args.threads.to_string()]);
        v
    };
    let mut files = vec![("-m", model)];
    for (flag, f) in [("--clip_l", &args.clip_l), ("--clip_g", &args.clip_g), ("--t5xxl", &args.t5xxl)] {
        if let Some(f) = f {
            files.push((flag, f.clone()));
        }
    }
    let prompt = "a (red:1.3) fox, [snow] BREAK night sky, \\(stars\\)";
    let txt2img = Case {
        name: "txt2img",
        flags: common(prompt, Some("blurry, (low quality:1.2)"), Some("5")),
        files: files.clone(),
    };
    let mut rows = Vec::new();
    let (row, first) = generate(&sdref, &ours, &dir, &txt2img)?;
    rows.push(row);
    let mut plain = common("a lighthouse on a cliff at dusk", None, None);
    plain.extend(["--clip-skip".into(), "2".into()]);
    rows.push(generate(&sdref, &ours, &dir, &Case { name: "no negative", flags: plain, files: files.clone() })?.0);
    if args.model.is_none() {
        // TAESD3 in place of the VAE: a 16-channel tiny autoencoder fixture (TAEF1's layout).
        let taesd = sd_models::fixture::taesd::cached_taesd_path(16, 42, WeightType::F16);
        if !taesd.is_file() {
            sd_models::fixture::taesd::write_taesd(&taesd, 16, 42, WeightType::F16, FileFormat::Safetensors)?;
        }
        let mut with_taesd = files.clone();
        with_taesd.push(("--taesd", taesd));
        let flags = common(prompt, Some("blurry"), Some("5"));
        rows.push(generate(&sdref, &ours, &dir, &Case { name: "taesd", flags, files: with_taesd })?.0);
    }
    let mut i2i = common(prompt, Some("blurry"), Some("5"));
    i2i.extend(["-i".into(), first.display().to_string(), "--strength".into(), "0.6".into()]);
    rows.push(generate(&sdref, &ours, &dir, &Case { name: "img2img", flags: i2i, files: files.clone() })?.0);
    // Skip-layer guidance: the default blocks (7, 8, 9) left out of a third pass on every step.
    let mut slg = common(prompt, Some("blurry, (low quality:1.2)"), Some("5"));
    slg.extend(["--slg-scale", "2.5", "--skip-layer-end", "1"].map(String::from));
    let (row, slg_png) = generate(&sdref, &ours, &dir, &Case { name: "slg", flags: slg, files: files.clone() })?;
    rows.push(row);
    let (effect, _) = crate::parity::png_diff(&slg_png.with_file_name("slg.ours.png"), &dir.join("txt2img.ours.png"))?;
    println!("(slg: our image differs from txt2img's by {:.2} mean, {} max)", effect.mean_abs, effect.max_abs);
    anyhow::ensure!(effect.max_abs > 0.0, "skip-layer guidance left our image as it was");
    if args.missing {
        let bare = checkpoint(false)?;
        for (name, flag, which) in [("clip_l only", "--clip_l", "clip_l"), ("clip_g only", "--clip_g", "clip_g")] {
            let files = vec![("-m", bare.clone()), (flag, clip_file(which)?)];
            let flags = common(prompt, Some("blurry"), Some("5"));
            let case = Case { name, flags, files };
            match generate(&sdref, &ours, &dir, &case) {
                Ok((row, _)) => rows.push(row),
                Err(e) if format!("{e:#}").contains("Tensor concat requires same rank") => {
                    // The reference concatenates the present CLIP's pooled output (rank 1) with
                    // the absent one's zeros (rank 2) and aborts; nothing to compare with. Ours
                    // must still generate.
                    let png = dir.join(format!("{}.ours.png", name.replace(' ', "-")));
                    let mut c = Command::new(&ours);
                    for (flag, path) in &case.files {
                        c.arg(flag).arg(path);
                    }
                    c.args(&case.flags).arg("-o").arg(&png).env("NO_COLOR", "1");
                    run_ok(c, &format!("sd-cli {name}"))?;
                    println!(
                        "{name:<30} the reference aborts (its SD3 conditioner concatenates a rank-1 pooled \
                         output with rank-2 zeros); ours generated {}",
                        png.display()
                    );
                }
                Err(e) => return Err(e),
            }
        }
    }
    if args.loras {
        use sd_models::fixture::lora::{write_sd3_lora, LoraFixture, LoraLayout};
        for (layout, name) in
            [(LoraLayout::Peft, "peft"), (LoraLayout::Diffusers, "diffusers"), (LoraLayout::Kohya, "kohya")]
        {
            let file = format!("sd3-lora-{name}");
            let path = dir.join(format!("{file}.safetensors"));
            let req = LoraFixture { layout, rank: 8, seed: 5, scale: 0.2, text_encoder: false };
            write_sd3_lora(&path, &fixture_config(), &req)?;
            // Ours reads the tag from the prompt, the reference the flag: both get the same prompt
            // text otherwise (the tag is cut out before tokenizing).
            let mut ours_flags = txt2img.flags.clone();
            let p = ours_flags.iter().position(|f| f == "-p").expect("the case has a prompt") + 1;
            ours_flags[p] = format!("{}<lora:{file}:1>", ours_flags[p]);
            ours_flags.extend(["--lora-model-dir".into(), dir.display().to_string()]);
            let slug = format!("lora-{name}");
            let ref_png = dir.join(format!("{slug}.ref.png"));
            let mut c = Command::new(&sdref);
            c.arg("txt2img");
            for (flag, f) in &files {
                c.arg(flag).arg(f);
            }
            c.args(&txt2img.flags).arg("--lora").arg(format!("{}:1", path.display())).arg("-o").arg(&ref_png);
            let ref_s = run_ok(c, &format!("sdref lora {name}"))?;
            let ours_png = dir.join(format!("{slug}.ours.png"));
            let mut c = Command::new(&ours);
            for (flag, f) in &files {
                c.arg(flag).arg(f);
            }
            c.args(&ours_flags).arg("-o").arg(&ours_png).env("NO_COLOR", "1");
            let ours_s = run_ok(c, &format!("sd-cli lora {name}"))?;
            let (diff, shape) = png_diff(&ours_png, &ref_png)?;
            let (effect, _) = png_diff(&ours_png, &first.with_file_name("txt2img.ours.png"))?;
            let what = format!("lora {name} (changes {:.2}/{})", effect.mean_abs, effect.max_abs);
            let row = Row { family: "sd3", what, shape, diff, tol: Tolerance::PNG };
            if layout == LoraLayout::Kohya {
                // The reference cannot make kohya's flat SD3 names dotted (its list of module
                // names with `_` lacks `joint_blocks`, `x_block`, `context_block`, ...) and drops
                // every adapter: its image is its image without the LoRA. sd-rs applies them
                // (`crates/sd-cli/tests/flux.rs`: kohya at 1 is the dotted file at 0.5).
                let (dropped, _) = png_diff(&ref_png, &first)?;
                anyhow::ensure!(
                    dropped.max_abs == 0.0,
                    "the reference applied part of the kohya SD3 LoRA; compare it with ours"
                );
                println!(
                    "{:<30} the reference drops every adapter (its image is its no-LoRA one); sd-rs applies them",
                    row.what
                );
                continue;
            }
            row.print_timed(ref_s, ours_s);
            rows.push(row);
        }
    }
    let failed: Vec<&str> = rows.iter().filter(|r| !r.pass()).map(|r| r.what.as_str()).collect();
    anyhow::ensure!(
        failed.is_empty(),
        "SD3: our image differs from the reference's beyond {} in: {}",
        Tolerance::PNG.describe(),
        failed.join(", ")
    );
    Ok(())
}
