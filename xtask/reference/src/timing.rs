//! Per-stage timings of an sd.cpp generation, read from its log and progress callbacks.
//!
//! The C API reports no stage timings, but sd.cpp logs one line per stage
//! ("get_learned_condition completed, taking 0.65s", "sampling completed,
//! taking 32.1s", "decode_first_stage completed, taking 14.5s"), with 10 ms
//! resolution, and calls the progress callback once per sampling step with the
//! seconds that step took (microsecond clock). The progress callback also
//! serves weight loading (which sd.cpp does lazily, inside the first step of a
//! stage) and tiled VAE passes, so a step is only counted between the
//! "generating image" and "sampling completed" log lines, and outside a
//! weight load (the DEBUG line "loading N/M tensors from FILE" up to the INFO
//! line "loading tensors completed, taking Xs").

use std::io::Write;
use std::sync::Mutex;

use crate::ffi::{Observer, LOG_DEBUG};

#[derive(Debug, Default, Clone)]
pub(crate) struct StageTimes {
    pub text_encode_s: Option<f64>,
    pub sampling_s: Vec<f64>,
    pub decode_s: Option<f64>,
    pub generate_s: Option<f64>,
    pub step_s: Vec<f64>,
    /// Sum of sd.cpp's "loading tensors completed, taking Xs" lines.
    pub tensor_load_s: f64,
    in_sampling: bool,
    in_loading: bool,
}

/// Echoes sd.cpp's log to stderr and records its stage timings.
pub struct Recorder {
    verbose: bool,
    times: Mutex<StageTimes>,
}

impl Recorder {
    pub fn new(verbose: bool) -> Recorder {
        Recorder { verbose, times: Mutex::new(StageTimes::default()) }
    }

    pub fn take(&self) -> StageTimes {
        let mut t = self.times.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *t)
    }
}

/// The number of seconds in "..., taking 1.23s".
fn taking_seconds(line: &str) -> Option<f64> {
    let rest = &line[line.find("taking ")? + "taking ".len()..];
    let num: String = rest.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    let value: f64 = num.parse().ok()?;
    let unit = rest[num.len()..].trim_start();
    if unit.starts_with("ms") {
        Some(value / 1000.0)
    } else if unit.starts_with('s') {
        Some(value)
    } else {
        None
    }
}

/// The number of seconds in "generate_image completed in 1.23s".
fn completed_in_seconds(line: &str) -> Option<f64> {
    let rest = &line[line.find("completed in ")? + "completed in ".len()..];
    rest.trim().trim_end_matches('s').parse().ok()
}

impl StageTimes {
    fn observe_line(&mut self, line: &str) {
        if line.contains("generating image:") {
            self.in_sampling = true;
        } else if line.contains("loading tensors completed") {
            self.in_loading = false;
            self.tensor_load_s += taking_seconds(line).unwrap_or(0.0);
        } else if line.contains("loading ") && line.contains(" tensors from ") {
            self.in_loading = true;
        } else if line.contains("get_learned_condition completed") {
            self.text_encode_s = taking_seconds(line).or(self.text_encode_s);
        } else if line.contains("sampling completed") && !line.contains("hires") {
            self.in_sampling = false;
            if let Some(s) = taking_seconds(line) {
                self.sampling_s.push(s);
            }
        } else if line.contains("decode_first_stage completed") {
            self.decode_s = taking_seconds(line).or(self.decode_s);
        } else if line.contains("generate_image completed in") {
            self.generate_s = completed_in_seconds(line);
        }
    }
}

impl Observer for Recorder {
    fn log(&self, level: i32, text: &str) {
        {
            let mut t = self.times.lock().unwrap_or_else(|e| e.into_inner());
            t.observe_line(text);
        }
        if level > LOG_DEBUG || self.verbose {
            let tag = ["DEBUG", "INFO", "WARN", "ERROR"].get(level as usize).copied().unwrap_or("LOG");
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "[sd.cpp {tag}] {}", text);
            if !text.ends_with('\n') {
                let _ = writeln!(err);
            }
        }
    }

    fn progress(&self, step: i32, _steps: i32, seconds: f32) {
        let mut t = self.times.lock().unwrap_or_else(|e| e.into_inner());
        if t.in_sampling && !t.in_loading && step > 0 {
            t.step_s.push(f64::from(seconds));
        }
    }
}

/// Peak resident set size of this process, in KiB (getrusage's ru_maxrss).
pub fn peak_rss_kib() -> Option<u64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the pointer we own.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: getrusage succeeded, so the struct is initialised.
    let usage = unsafe { usage.assume_init() };
    u64::try_from(usage.ru_maxrss).ok()
}

pub fn ms(seconds: f64) -> String {
    format!("{:.0}", seconds * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_stage_lines_sd_cpp_prints() {
        let mut t = StageTimes::default();
        for line in [
            "generate_image 256x256",
            "get_learned_condition completed, taking 0.65s",
            "generating image: 1/1 - seed 42",
            "sampling completed, taking 32.04s",
            "decoding 1 latents",
            "latent 1 decoded, taking 14.50s",
            "decode_first_stage completed, taking 14.51s",
            "generate_image completed in 47.30s",
        ] {
            t.observe_line(line);
        }
        assert_eq!(t.text_encode_s, Some(0.65));
        assert_eq!(t.sampling_s, vec![32.04]);
        assert_eq!(t.decode_s, Some(14.51));
        assert_eq!(t.generate_s, Some(47.30));
        assert!(!t.in_sampling);
    }

    #[test]
    fn only_sampling_progress_counts_as_steps() {
        let r = Recorder::new(false);
        r.progress(3, 10, 0.5); // model loading
        r.log(1, "generating image: 1/1 - seed 42");
        r.log(0, "model_loader.cpp:987  - loading 686/1130 tensors from m.safetensors");
        r.progress(1, 686, 0.1); // lazy weight load inside step 1
        r.log(1, "model_loader.cpp:1211 - loading tensors completed, taking 3.01s (read: 2.99s)");
        r.progress(0, 4, 0.0);
        r.progress(1, 4, 8.0);
        r.progress(2, 4, 8.1);
        r.log(1, "sampling completed, taking 16.1s");
        r.progress(1, 4, 0.2); // VAE tiles
        let t = r.take();
        assert_eq!(t.step_s, vec![8.0, f64::from(8.1f32)]);
        assert_eq!(t.tensor_load_s, 3.01);
    }

    #[test]
    fn millisecond_durations_are_understood() {
        assert_eq!(taking_seconds("encode_first_stage completed, taking 1500 ms"), Some(1.5));
        assert_eq!(taking_seconds("no duration here"), None);
    }
}
