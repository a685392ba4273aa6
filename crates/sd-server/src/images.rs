//! Generated images encoded for a response: PNG, JPEG (quality from `output_compression`) or
//! lossless WebP, as base64.

use base64::Engine as _;
use sd_models::pipeline::Image;

use crate::decode::{Format, Output};

/// `img` encoded as `output` asks, in base64.
pub(crate) fn encode_b64(img: &Image, output: Output) -> Result<String, image::ImageError> {
    let buf = image::RgbImage::from_raw(img.width as u32, img.height as u32, img.rgb.clone()).ok_or_else(|| {
        image::ImageError::Parameter(image::error::ParameterError::from_kind(
            image::error::ParameterErrorKind::DimensionMismatch,
        ))
    })?;
    let mut bytes = Vec::new();
    let mut cursor = std::io::Cursor::new(&mut bytes);
    match output.format {
        Format::Png => buf.write_to(&mut cursor, image::ImageFormat::Png)?,
        Format::Webp => buf.write_to(&mut cursor, image::ImageFormat::WebP)?,
        Format::Jpeg => {
            let quality = output.compression.clamp(1, 100);
            let enc = image::codecs::jpeg::JpegEncoder::new_with_quality(&mut cursor, quality);
            buf.write_with_encoder(enc)?
        }
    }
    Ok(base64::engine::general_purpose::STANDARD.encode(&bytes))
}
