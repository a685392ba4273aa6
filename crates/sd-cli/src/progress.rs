//! Progress of a generation, drawn from the pipeline's [`Progress`] events: bars on a
//! terminal (indicatif), plain log lines when stderr is not one.
//!
//! On a terminal each image of a batch gets a bar of its sampling steps with the rate
//! (`it/s`, or `s/it` below one step a second) and the time left, measured from the step
//! durations the pipeline reports; a tiled VAE run gets a bar of its tiles. Log lines
//! printed meanwhile go above the bars ([`active`] lets the log writer suspend them).
//!
//! Off a terminal every event is one `info` line, a stable format scripts and tests may
//! parse:
//! * `image <i>/<n> step <s>/<steps> took <seconds> s`
//! * `<stage> image <i>/<n> tile <t>/<tiles>` (`stage` is `decode` or `image encode`)
//!
//! (stage durations are logged by the pipeline itself: `text encode took ...`).

use std::sync::Mutex;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use sd_models::pipeline::Progress;

/// The bars being drawn, for the log writer (`None` when no bar is shown).
static ACTIVE: Mutex<Option<MultiProgress>> = Mutex::new(None);

/// The bars being drawn now, if any.
pub fn active() -> Option<MultiProgress> {
    ACTIVE.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Turns pipeline events into bars or lines.
pub struct Reporter {
    bars: Option<Bars>,
}

struct Bars {
    multi: MultiProgress,
    /// The sampling bar of the image being sampled: (image, bar, seconds so far).
    sampling: Option<(usize, ProgressBar, f64)>,
    /// The tile bar of the VAE run in progress: (stage, image, bar).
    tiles: Option<(&'static str, usize, ProgressBar)>,
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()).progress_chars("=> ")
}

/// `2.50 it/s` or `1.25 s/it`, from steps done and the seconds they took.
fn rate(done: u64, seconds: f64) -> String {
    if done == 0 || seconds <= 0.0 {
        return "-- it/s".into();
    }
    let per_sec = done as f64 / seconds;
    if per_sec >= 1.0 {
        format!("{per_sec:.2} it/s")
    } else {
        format!("{:.2} s/it", 1.0 / per_sec)
    }
}

/// `ETA 1m05s` for `left` steps at the average step time so far.
pub fn eta(done: u64, left: u64, seconds: f64) -> String {
    let secs = if done == 0 { 0.0 } else { seconds / done as f64 * left as f64 };
    let secs = secs.round() as u64;
    if secs >= 60 {
        format!("ETA {}m{:02}s", secs / 60, secs % 60)
    } else {
        format!("ETA {secs}s")
    }
}

impl Reporter {
    /// Bars when `terminal`, else lines.
    pub fn new(terminal: bool) -> Self {
        if terminal {
            Self::with_target(ProgressDrawTarget::stderr())
        } else {
            Self { bars: None }
        }
    }

    /// Bars drawn to `target` (tests pass a hidden one).
    pub fn with_target(target: ProgressDrawTarget) -> Self {
        let multi = MultiProgress::with_draw_target(target);
        *ACTIVE.lock().unwrap_or_else(|e| e.into_inner()) = Some(multi.clone());
        Self { bars: Some(Bars { multi, sampling: None, tiles: None }) }
    }

    /// Shows one event.
    pub fn event(&mut self, p: &Progress) {
        match self.bars.as_mut() {
            Some(b) => b.event(p),
            None => log_line(p),
        }
    }

    /// Finishes the bars left open (an error cut the run short) and stops drawing.
    pub fn finish(&mut self) {
        if let Some(b) = self.bars.take() {
            if let Some((_, bar, _)) = b.sampling {
                bar.abandon();
            }
            if let Some((_, _, bar)) = b.tiles {
                bar.abandon();
            }
            *ACTIVE.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    /// The sampling bar of the current image: (prefix, position, length, message).
    #[cfg(test)]
    fn sampling_state(&self) -> Option<(String, u64, Option<u64>, String)> {
        let (_, bar, _) = self.bars.as_ref()?.sampling.as_ref()?;
        Some((bar.prefix(), bar.position(), bar.length(), bar.message()))
    }

    /// The tile bar: (prefix, position, length, finished).
    #[cfg(test)]
    fn tiles_state(&self) -> Option<(String, u64, Option<u64>, bool)> {
        let (_, _, bar) = self.bars.as_ref()?.tiles.as_ref()?;
        Some((bar.prefix(), bar.position(), bar.length(), bar.is_finished()))
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        self.finish();
    }
}

impl Bars {
    fn event(&mut self, p: &Progress) {
        match *p {
            Progress::Step { image, images, step, steps, seconds } => {
                let same = self.sampling.as_ref().is_some_and(|(i, bar, _)| *i == image && !bar.is_finished());
                if !same {
                    if let Some((_, old, _)) = self.sampling.take() {
                        old.finish();
                    }
                    let bar = self.multi.add(ProgressBar::new(steps as u64));
                    bar.set_style(style("{prefix} [{bar:30}] {pos}/{len} {msg}"));
                    bar.set_prefix(format!("image {}/{images}", image + 1));
                    self.sampling = Some((image, bar, 0.0));
                }
                let Some((_, bar, total)) = self.sampling.as_mut() else { return };
                *total += seconds;
                let done = (step + 1) as u64;
                bar.set_length(steps as u64);
                bar.set_position(done);
                bar.set_message(format!(
                    "{}, {}",
                    rate(done, *total),
                    eta(done, (steps as u64).saturating_sub(done), *total)
                ));
                if done >= steps as u64 {
                    bar.finish();
                }
            }
            Progress::Tile { stage, image, images, done, tiles } => {
                let same =
                    self.tiles.as_ref().is_some_and(|(s, i, bar)| *s == stage && *i == image && !bar.is_finished());
                if !same || self.tiles.as_ref().is_some_and(|(_, _, bar)| bar.length() != Some(tiles as u64)) {
                    if let Some((_, _, old)) = self.tiles.take() {
                        old.finish_and_clear();
                    }
                    let bar = self.multi.add(ProgressBar::new(tiles as u64));
                    bar.set_style(style("{prefix} [{bar:30}] {pos}/{len} tiles"));
                    bar.set_prefix(format!("{stage} image {}/{images}", image + 1));
                    self.tiles = Some((stage, image, bar));
                }
                let Some((_, _, bar)) = self.tiles.as_ref() else { return };
                bar.set_position(done as u64);
                if done >= tiles {
                    bar.finish();
                }
            }
            Progress::Stage { .. } => {}
        }
    }
}

/// The line of an event off a terminal (see the module doc for the format).
pub fn line(p: &Progress) -> Option<String> {
    match *p {
        Progress::Step { image, images, step, steps, seconds } => {
            Some(format!("image {}/{images} step {}/{steps} took {seconds:.2} s", image + 1, step + 1))
        }
        Progress::Tile { stage, image, images, done, tiles } => {
            Some(format!("{stage} image {}/{images} tile {done}/{tiles}", image + 1))
        }
        Progress::Stage { .. } => None,
    }
}

fn log_line(p: &Progress) {
    if let Some(l) = line(p) {
        tracing::info!("{l}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(image: usize, images: usize, step: usize, steps: usize) -> Progress {
        Progress::Step { image, images, step, steps, seconds: 0.5 }
    }

    #[test]
    fn lines_have_the_documented_format() {
        assert_eq!(line(&step(0, 2, 2, 20)).unwrap(), "image 1/2 step 3/20 took 0.50 s");
        let t = Progress::Tile { stage: "decode", image: 1, images: 2, done: 4, tiles: 9 };
        assert_eq!(line(&t).unwrap(), "decode image 2/2 tile 4/9");
        assert_eq!(line(&Progress::Stage { name: "decode", seconds: 1.0 }), None);
    }

    #[test]
    fn rate_and_eta_come_from_the_step_times() {
        assert_eq!(rate(4, 2.0), "2.00 it/s");
        assert_eq!(rate(2, 5.0), "2.50 s/it");
        assert_eq!(rate(0, 0.0), "-- it/s");
        assert_eq!(eta(4, 16, 2.0), "ETA 8s");
        assert_eq!(eta(1, 100, 1.3), "ETA 2m10s");
    }

    #[test]
    fn each_image_gets_its_bar_and_tiles_theirs() {
        let mut r = Reporter::with_target(ProgressDrawTarget::hidden());
        assert!(active().is_some());
        r.event(&step(0, 2, 0, 4));
        r.event(&step(0, 2, 1, 4));
        let (prefix, pos, len, msg) = r.sampling_state().unwrap();
        assert_eq!((prefix.as_str(), pos, len), ("image 1/2", 2, Some(4)));
        assert_eq!(msg, "2.00 it/s, ETA 1s");
        r.event(&step(1, 2, 0, 4));
        let (prefix, pos, ..) = r.sampling_state().unwrap();
        assert_eq!((prefix.as_str(), pos), ("image 2/2", 1));
        for done in 1..=3 {
            r.event(&Progress::Tile { stage: "decode", image: 0, images: 2, done, tiles: 6 });
        }
        assert_eq!(r.tiles_state().unwrap(), ("decode image 1/2".to_string(), 3, Some(6), false));
        // A retry with another grid starts a new bar.
        r.event(&Progress::Tile { stage: "decode", image: 0, images: 2, done: 1, tiles: 12 });
        assert_eq!(r.tiles_state().unwrap(), ("decode image 1/2".to_string(), 1, Some(12), false));
        r.event(&Progress::Tile { stage: "decode", image: 0, images: 2, done: 12, tiles: 12 });
        assert!(r.tiles_state().unwrap().3, "the last tile finishes the bar");
        r.finish();
        assert!(active().is_none());
    }
}
