//! Saving the generated images: names from `-o` and `--output-begin-idx`, the format from
//! the extension, the parameters text unless `--disable-image-metadata`.

use std::path::Path;

use anyhow::Result;
use sd_models::image_io;
use sd_models::pipeline::Image;

/// Writes `images` as the reference names them ([`image_io::output_paths`]); image `i`
/// carries `parameters(i)` when that is `Some`. Returns the paths written.
pub fn save_images(
    images: &[Image],
    output: &Path,
    begin_idx: Option<i64>,
    parameters: impl Fn(usize) -> Option<String>,
) -> Result<Vec<std::path::PathBuf>> {
    let targets = image_io::output_paths(output, images.len(), begin_idx);
    let mut written = Vec::with_capacity(images.len());
    for (i, (img, (path, format))) in images.iter().zip(targets).enumerate() {
        image_io::write_image(&path, img, format, parameters(i).as_deref())?;
        tracing::info!("saved {} ({})", path.display(), format.name());
        written.push(path);
    }
    Ok(written)
}
