//! Saving the generated images: names from `-o` and `--output-begin-idx`, the format from
//! the extension, the parameters text unless `--disable-image-metadata`.

use std::path::Path;

use anyhow::{Context as _, Result};
use sd_models::image_io::{self, OutputFormat};
use sd_models::output::OutputTarget;
use sd_models::pipeline::Image;
use sd_models::report::RunReport;

/// The files a batch of `n` images will be written to, named as the reference names them
/// ([`image_io::output_paths`]) and each checked as a target ([`OutputTarget::resolve`]:
/// no directory, device, FIFO or read-only file, an existing parent directory) before any
/// work is done.
pub fn plan_outputs(output: &Path, n: usize, begin_idx: Option<i64>) -> Result<Vec<(OutputTarget, OutputFormat)>> {
    image_io::output_paths(output, n, begin_idx)
        .into_iter()
        .map(|(path, format)| Ok((OutputTarget::resolve(&path).context("-o")?, format)))
        .collect()
}

/// Writes image `i` to `targets[i]`, carrying `parameters(i)` when that is `Some`.
pub fn save_images(
    images: &[Image],
    targets: &[(OutputTarget, OutputFormat)],
    parameters: impl Fn(usize) -> Option<String>,
) -> Result<()> {
    for (i, (img, (target, format))) in images.iter().zip(targets).enumerate() {
        image_io::write_image(target, img, *format, parameters(i).as_deref())?;
        tracing::info!("saved {} ({})", target.path().display(), format.name());
    }
    Ok(())
}

/// `--report-json PATH` checked as an output target, like the images (no directory,
/// device, FIFO or read-only file; an existing parent directory), before any work is done.
pub fn report_target(path: Option<&Path>) -> Result<Option<OutputTarget>> {
    path.map(|p| OutputTarget::resolve(p).context("--report-json")).transpose()
}

/// Writes `report` as JSON to `target` (nothing when `None`).
pub fn write_report(target: Option<&OutputTarget>, report: &RunReport) -> Result<()> {
    let Some(target) = target else { return Ok(()) };
    target.write(report.to_json().as_bytes()).context("--report-json")?;
    tracing::info!("wrote the run report to {}", target.path().display());
    Ok(())
}

/// The command line as given, program name left out, for a run report.
pub fn command_line() -> Vec<String> {
    std::env::args_os().skip(1).map(|a| a.to_string_lossy().into_owned()).collect()
}
