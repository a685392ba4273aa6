//! PNG output with the generation parameters, and PNG input for img2img.
//!
//! The output carries a `parameters` tEXt chunk in the format A1111 writes and
//! image browsers read (prompt, `Negative prompt:` line, then `Key: value`
//! pairs). Files are written through [`OutputTarget`] (a temporary name next to the real
//! target, then a rename), so a failure never leaves a partial image behind and a link or
//! device node is never replaced.

use std::path::Path;

use anyhow::{bail, Context as _, Result};
use sd_models::files::open::open_regular;
use sd_models::output::OutputTarget;

/// An 8-bit RGB image.
#[derive(Clone, Debug, PartialEq)]
pub struct Rgb8 {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

/// Writes `img` as PNG with a `parameters` text chunk to `target` (atomically, see
/// [`OutputTarget`]); errors name the output path.
pub fn write_png(target: &OutputTarget, img: &Rgb8, parameters: &str) -> Result<()> {
    let mut bytes = Vec::new();
    let mut enc = png::Encoder::new(&mut bytes, img.width, img.height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.add_text_chunk("parameters".into(), parameters.into())?;
    let mut w = enc.write_header()?;
    w.write_image_data(&img.data)?;
    w.finish().with_context(|| format!("encoding {}", target.path().display()))?;
    target.write(&bytes)?;
    Ok(())
}

/// Reads a PNG as 8-bit RGB (grey and alpha are converted).
pub fn read_png(path: &Path) -> Result<Rgb8> {
    let (file, _) = open_regular(path).context("the init image (-i)")?;
    let mut dec = png::Decoder::new(std::io::BufReader::new(file));
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = dec.read_info().with_context(|| format!("{} is not a readable PNG", path.display()))?;
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).with_context(|| format!("decoding {}", path.display()))?;
    let px = (info.width * info.height) as usize;
    let data: Vec<u8> = match info.color_type {
        png::ColorType::Rgb => buf[..px * 3].to_vec(),
        png::ColorType::Rgba => buf[..px * 4].chunks_exact(4).flat_map(|c| [c[0], c[1], c[2]]).collect(),
        png::ColorType::Grayscale => buf[..px].iter().flat_map(|&g| [g, g, g]).collect(),
        png::ColorType::GrayscaleAlpha => buf[..px * 2].chunks_exact(2).flat_map(|c| [c[0], c[0], c[0]]).collect(),
        other => bail!("{}: unsupported PNG color type {other:?}", path.display()),
    };
    Ok(Rgb8 { width: info.width, height: info.height, data })
}
