//! Saving the generated images, each with its parameters text unless `--disable-image-metadata`.

use anyhow::Result;
use sd_models::output::ImageOutput;
use sd_models::pipeline::Image;

/// Writes image `i` to `outputs[i]` (checked and named by [`ImageOutput::plan`]), carrying
/// `parameters(i)` when that is `Some`.
pub fn save_images(
    images: &[Image],
    outputs: &[ImageOutput],
    parameters: impl Fn(usize) -> Option<String>,
) -> Result<()> {
    for (i, (img, out)) in images.iter().zip(outputs).enumerate() {
        out.write(img, parameters(i).as_deref())?;
        tracing::info!("saved {} ({})", out.target.path().display(), out.format.name());
    }
    Ok(())
}
