//! Saving the generated images, each with its parameters text unless `--disable-image-metadata`.

use std::path::Path;

use anyhow::{Context as _, Result};
use sd_models::output::{ImageOutput, OutputTarget};
use sd_models::pipeline::Image;
use sd_models::report::RunReport;

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
