//! Reference flags about what is generated and how it is saved: `-M/--mode`, prompt files,
//! `--disable-image-metadata`, `--output-begin-idx`, and the size rules of `-W/-H` with `-i`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _, Result};
use clap::Args;
use sd_models::image_io;
use sd_models::pipeline::Image;

/// The reference's run modes (`-M`), in its order.
const MODES: [&str; 5] = ["img_gen", "vid_gen", "convert", "upscale", "metadata"];

/// The default size when neither `-W/-H` nor an init image gives one.
const DEFAULT_SIDE: usize = 512;

/// Flags of stable-diffusion.cpp's CLI that choose the mode, read prompts from files and
/// name the outputs.
#[derive(Args, Debug, Clone, Default)]
pub struct RunArgs {
    /// Run mode: img_gen (the default), or upscale (the -i image with --upscale-model). The
    /// reference's other modes (vid_gen, convert, metadata) are not implemented here and are
    /// refused.
    #[arg(short = 'M', long = "mode", value_name = "MODE")]
    pub mode: Option<String>,
    /// Read the prompt from this file (its whole contents, as the reference reads it).
    #[arg(long = "prompt-file", value_name = "PATH", conflicts_with = "prompt")]
    pub prompt_file: Option<PathBuf>,
    /// Read the negative prompt from this file.
    #[arg(long = "negative-prompt-file", value_name = "PATH", conflicts_with = "negative_prompt")]
    pub negative_prompt_file: Option<PathBuf>,
    /// Do not embed the generation parameters in the image files.
    #[arg(long = "disable-image-metadata")]
    pub disable_image_metadata: bool,
    /// First index of the output names (`-o out_%03d.png`, or `out_<idx>.png` for a batch;
    /// default 0, negative: 0).
    #[arg(long = "output-begin-idx", value_name = "N", allow_hyphen_values = true)]
    pub output_begin_idx: Option<i64>,
}

impl RunArgs {
    /// Refuses modes other than `img_gen` with a message naming them (`sd-cli` runs
    /// `upscale` before it asks: `upscale.rs`).
    pub fn check_mode(&self) -> Result<()> {
        match self.mode.as_deref() {
            None | Some("img_gen") => Ok(()),
            Some(m) if MODES.contains(&m) => {
                bail!(
                    "-M {m}: only img_gen (and, without a subcommand, upscale) is implemented by sd-rs (the reference's modes: {})",
                    MODES.join(", ")
                )
            }
            Some(m) => bail!("-M {m}: invalid mode, must be one of [{}]", MODES.join(", ")),
        }
    }

    /// The prompt and negative prompt: the files' contents where given, else the flags'.
    pub fn prompts(&self, prompt: &str, negative: &str) -> Result<(String, String)> {
        // A prompt file is a regular file of at most 1 MiB (never a FIFO or a device).
        const MAX: u64 = 1 << 20;
        let read = |p: &Path, what: &str| -> Result<String> {
            use std::io::Read as _;
            let (file, meta) = sd_models::files::open::open_regular(p).with_context(|| format!("the {what} file"))?;
            if meta.len() > MAX {
                bail!(
                    "the {what} file '{}' is {} bytes; a prompt file may have at most {MAX}",
                    p.display(),
                    meta.len()
                );
            }
            let mut bytes = Vec::new();
            file.take(MAX)
                .read_to_end(&mut bytes)
                .with_context(|| format!("failed to read {what} file '{}'", p.display()))?;
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        };
        let prompt = match &self.prompt_file {
            Some(p) => read(p, "prompt")?,
            None => prompt.to_string(),
        };
        let negative = match &self.negative_prompt_file {
            Some(p) => read(p, "negative prompt")?,
            None => negative.to_string(),
        };
        Ok((prompt, negative))
    }
}

/// The requested size and the init image, resolved as the reference's CLI does: `-W`/`-H`
/// count as given only when both are positive; then an init image is fitted to them
/// ([`image_io::fit_image`]). Otherwise the init image's size is used, or 512x512 (each
/// positive side kept) without one. The pipeline then aligns the size to the model.
///
/// `-1` (the default) means "not given"; `0` and other negative values are refused, as they
/// can only be typos.
pub fn resolve_size(width: i64, height: i64, init_img: Option<&Path>) -> Result<(usize, usize, Option<Image>)> {
    for (flag, v) in [("-W", width), ("-H", height)] {
        if v == 0 || v < -1 {
            bail!(
                "{flag} {v}: the image side must be a positive number of pixels (or -1: from the init image, else 512)"
            );
        }
    }
    let given = width > 0 && height > 0;
    let side = |v: i64| if v > 0 { v as usize } else { DEFAULT_SIDE };
    let Some(path) = init_img else {
        return Ok((side(width), side(height), None));
    };
    let img = image_io::read_image(path).context("-i")?;
    if given {
        let (w, h) = (width as usize, height as usize);
        let fitted = image_io::fit_image(&img, w, h).with_context(|| format!("-i {}", path.display()))?;
        Ok((w, h, Some(fitted)))
    } else {
        tracing::info!("set width x height to {} x {} (the init image's size)", img.width, img.height);
        Ok((img.width, img.height, Some(img)))
    }
}

/// The `--control-image` as the reference's CLI reads it: RGB, fitted to `width x height` like
/// the init image.
pub fn read_control_image(path: &Path, width: usize, height: usize) -> Result<Image> {
    let img = image_io::read_image(path).context("--control-image")?;
    if (img.width, img.height) != (width, height) {
        tracing::info!("--control-image {}: {}x{} fitted to {width}x{height}", path.display(), img.width, img.height);
    }
    image_io::fit_image(&img, width, height).with_context(|| format!("--control-image {}", path.display()))
}

/// The `--mask` image as the reference's CLI reads it: grey (stb_image's luma), fitted to
/// `width x height` like the init image (centre crop to the aspect ratio, box resize).
pub fn read_mask(path: &Path, width: usize, height: usize) -> Result<Image> {
    let img = image_io::read_image(path).context("--mask")?;
    let gray = image_io::to_gray(&img);
    if (gray.width, gray.height) != (width, height) {
        tracing::info!("--mask {}: {}x{} fitted to {width}x{height}", path.display(), gray.width, gray.height);
    }
    image_io::fit_image(&gray, width, height).with_context(|| format!("--mask {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_other_than_img_gen_are_refused_by_name() {
        let args = |m: Option<&str>| RunArgs { mode: m.map(Into::into), ..RunArgs::default() };
        assert!(args(None).check_mode().is_ok());
        assert!(args(Some("img_gen")).check_mode().is_ok());
        let e = args(Some("vid_gen")).check_mode().unwrap_err().to_string();
        assert!(e.contains("-M vid_gen") && e.contains("only img_gen"), "{e}");
        let e = args(Some("paint")).check_mode().unwrap_err().to_string();
        assert!(e.contains("invalid mode") && e.contains("metadata"), "{e}");
    }

    #[test]
    fn sizes_follow_the_reference_without_an_init_image() {
        let (w, h, _) = resolve_size(-1, -1, None).unwrap();
        assert_eq!((w, h), (512, 512));
        let (w, h, img) = resolve_size(64, -1, None).unwrap();
        assert_eq!((w, h), (64, 512));
        assert!(img.is_none());
        // 0 and negative sides other than -1 are typos, refused by name
        for (w, h) in [(0, 96), (64, -64)] {
            let e = resolve_size(w, h, None).unwrap_err().to_string();
            assert!(e.contains("positive number of pixels"), "{e}");
        }
    }

    #[test]
    fn an_init_image_is_fitted_to_both_sides_or_gives_the_size() {
        let dir = std::env::temp_dir().join(format!("sd-cli-init-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("init.png");
        let img = Image { width: 100, height: 60, rgb: vec![77; 100 * 60 * 3] };
        image_io::save_image(&p, &img, image_io::OutputFormat::Png, None).unwrap();
        let (w, h, fitted) = resolve_size(64, 64, Some(&p)).unwrap();
        let fitted = fitted.unwrap();
        assert_eq!((w, h, fitted.width, fitted.height), (64, 64, 64, 64));
        assert!(fitted.rgb.iter().all(|&v| v == 77));
        // Only one side given: both come from the image, as in the reference.
        for (w, h) in [(64, -1), (-1, -1), (-1, 64)] {
            let (rw, rh, got) = resolve_size(w, h, Some(&p)).unwrap();
            assert_eq!((rw, rh), (100, 60), "-W {w} -H {h}");
            assert_eq!(got.unwrap(), img);
        }
        let e = format!("{:#}", resolve_size(64, 64, Some(&dir.join("missing.webp"))).unwrap_err());
        assert!(e.contains("-i") && e.contains("missing.webp"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A mask of another size is centre-cropped and resized like the init image (the
    /// reference's CLI loads both with the same function), after turning grey as stb_image does.
    #[test]
    fn a_mask_is_read_grey_and_fitted_like_the_init_image() {
        let dir = std::env::temp_dir().join(format!("sd-cli-mask-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("mask.png");
        // 128x96, red (luma 76) on the left half, white on the right half.
        let rgb = (0..96).flat_map(|_| (0..128).flat_map(|x| if x < 64 { [255, 0, 0] } else { [255; 3] })).collect();
        image_io::save_image(&p, &Image { width: 128, height: 96, rgb }, image_io::OutputFormat::Png, None).unwrap();
        let m = read_mask(&p, 64, 64).unwrap();
        assert_eq!((m.width, m.height), (64, 64));
        assert!(m.rgb.chunks_exact(3).all(|px| px[0] == px[1] && px[1] == px[2]), "grey in every channel");
        // The 96x96 centre crop starts at x = 16: the white half begins at 48 of 96, 32 of 64.
        let row: Vec<u8> = (0..64).map(|x| m.rgb[(10 * 64 + x) * 3]).collect();
        assert!(row[..32].iter().all(|&v| v == 76) && row[32..].iter().all(|&v| v == 255), "{row:?}");
        let e = format!("{:#}", read_mask(&dir.join("none.png"), 64, 64).unwrap_err());
        assert!(e.contains("--mask") && e.contains("none.png"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn prompt_files_are_read_whole() {
        let dir = std::env::temp_dir().join(format!("sd-cli-prompts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("p.txt");
        std::fs::write(&p, "a cat,\nsitting\n").unwrap();
        let args = RunArgs { prompt_file: Some(p), ..RunArgs::default() };
        assert_eq!(args.prompts("", "bad").unwrap(), ("a cat,\nsitting\n".to_string(), "bad".to_string()));
        let missing = RunArgs { negative_prompt_file: Some(dir.join("none.txt")), ..RunArgs::default() };
        let e = format!("{:#}", missing.prompts("x", "").unwrap_err());
        assert!(e.contains("negative prompt file") && e.contains("none.txt"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
