//! Device speeds for `--split-by speed`: measured once per device and model, cached in a TOML file.
//!
//! A layer split sized by speed needs, per device, how many bytes of block weights it evaluates
//! per second ([`sd_placement::PlanRequest::device_speeds`]). [`device_speeds`] measures it
//! with a probe shaped like the module's blocks: one matrix product of an f16 weight of
//! [`PROBE_SIDE`]² (a transformer block's projection in SD 1.x) by `tokens` activations (the
//! latent positions of the run), timed on the device (the best of [`PROBE_RUNS`] after one
//! warm-up), giving the weight's bytes over the time. The figure is a proxy: a real block
//! mixes convolutions, attention and normalisations whose cost per weight byte differs by
//! level, so the ratios between devices are what the split relies on; the plan's predicted
//! times are estimates.
//!
//! Figures are cached in [`cache_path`] (a TOML list under the user's cache directory), keyed
//! by device name, device description (its endpoint, for an RPC device), model and token
//! count, so a second run with the same devices measures nothing. A cache file that cannot be
//! read or parsed is reported once and replaced.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use sd_backends::{Backend, Context, GgmlType};
use sd_sched::{Runner, SchedError, SourceError, TensorSource, TensorSpec, Weights};

/// The probe weight's side (rows and columns).
const PROBE_SIDE: i64 = 1280;
/// Timed runs of the probe (after one warm-up).
const PROBE_RUNS: usize = 3;

/// Why a speed could not be measured.
#[derive(Debug, thiserror::Error)]
#[error("measuring the speed of {device}")]
pub struct SpeedError {
    /// The device.
    pub device: String,
    /// What failed.
    #[source]
    pub source: SchedError,
}

/// One cached figure.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Entry {
    device: String,
    description: String,
    model: String,
    tokens: u64,
    bytes_per_second: f64,
}

/// The cache file: a list of figures.
#[derive(Debug, Default, Serialize, Deserialize)]
struct CacheFile {
    #[serde(default)]
    speed: Vec<Entry>,
}

/// Where the figures are cached: a TOML file of device speeds in the fixture cache directory
/// ([`crate::fixture::cache_dir`]: `SD_CACHE_DIR`, else `$XDG_CACHE_HOME/sd-rs`, else
/// `~/.cache/sd-rs`).
pub fn cache_path() -> PathBuf {
    crate::fixture::cache_dir().join("device-speeds.toml")
}

/// Every device's speed in bytes of block weights per second, by device name, for `model`
/// (a key naming the model, e.g. its architecture and parameter bytes) at `tokens` latent
/// positions: from the cache at `path` where it has the figure, measured (and added to it)
/// otherwise.
pub fn device_speeds(
    devices: &[Arc<Backend>],
    model: &str,
    tokens: u64,
    path: &Path,
) -> Result<BTreeMap<String, f64>, SpeedError> {
    let mut cache = read_cache(path);
    let mut out = BTreeMap::new();
    let mut changed = false;
    for b in devices {
        let dev = b.device();
        let (name, description) = (dev.name(), dev.description());
        let known = cache
            .speed
            .iter()
            .find(|e| e.device == name && e.description == description && e.model == model && e.tokens == tokens);
        let speed = match known {
            Some(e) if e.bytes_per_second.is_finite() && e.bytes_per_second > 0.0 => e.bytes_per_second,
            _ => {
                let s = measure(b, tokens).map_err(|source| SpeedError { device: name.clone(), source })?;
                tracing::info!(
                    "{name}: {:.1} MiB of block weights per second (measured; cached in {})",
                    s / 1048576.0,
                    path.display()
                );
                cache.speed.retain(|e| {
                    !(e.device == name && e.description == description && e.model == model && e.tokens == tokens)
                });
                cache.speed.push(Entry {
                    device: name.clone(),
                    description,
                    model: model.to_string(),
                    tokens,
                    bytes_per_second: s,
                });
                changed = true;
                s
            }
        };
        out.insert(name, speed);
    }
    if changed {
        write_cache(path, &cache);
    }
    Ok(out)
}

/// The key of a model's figures: its diffusion module's tensor count and bytes (the shape of
/// the blocks a split runs), as the planner's description gives them.
pub fn model_key(model: &sd_placement::ModelDescription) -> String {
    let diffusion = model.components.iter().filter(|c| c.module == sd_placement::Module::Diffusion);
    let (n, bytes) = diffusion.flat_map(|c| c.tensors.iter()).fold((0usize, 0u64), |(n, b), t| (n + 1, b + t.bytes));
    format!("diffusion: {n} tensors, {bytes} bytes")
}

/// Latent positions of a `width` x `height` image (the probe's activations): an SD latent
/// is an eighth of the image on each side.
pub fn latent_tokens(width: usize, height: usize) -> u64 {
    ((width / 8).max(1) * (height / 8).max(1)) as u64
}

/// The cached figures at `path` by device name for `model` at `tokens` (none measured).
pub fn cached_speeds(model: &str, tokens: u64, path: &Path) -> BTreeMap<String, f64> {
    read_cache(path)
        .speed
        .into_iter()
        .filter(|e| {
            e.model == model && e.tokens == tokens && e.bytes_per_second.is_finite() && e.bytes_per_second > 0.0
        })
        .map(|e| (e.device, e.bytes_per_second))
        .collect()
}

fn read_cache(path: &Path) -> CacheFile {
    match crate::files::open::read_text(path, 1 << 20) {
        Ok(text) => toml::from_str(&text).unwrap_or_else(|e| {
            tracing::warn!("{}: not a speed cache ({e}); measuring again", path.display());
            CacheFile::default()
        }),
        Err(_) => CacheFile::default(),
    }
}

fn write_cache(path: &Path, cache: &CacheFile) {
    let text = match toml::to_string(cache) {
        Ok(t) => t,
        Err(e) => return tracing::warn!("the speed cache could not be written: {e}"),
    };
    let tmp = path.with_extension(format!("toml.{}", std::process::id()));
    let written = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|_| std::fs::write(&tmp, text))
        .and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        std::fs::remove_file(&tmp).ok();
        tracing::warn!("{}: the speed cache could not be written: {e}", path.display());
    }
}

/// A source of small constant values for the probe's tensors.
struct Constant;

impl TensorSource for Constant {
    fn load(&self, _: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        let n = ne.iter().product::<i64>().max(0) as usize;
        let values: Vec<u8> = std::iter::repeat_n(0.01f32.to_le_bytes(), n).flatten().collect();
        sd_backends::convert::convert(GgmlType::GGML_TYPE_F32, ty, &values, ne)
            .map(Cow::Owned)
            .map_err(SourceError::new)
    }
}

/// Bytes of probe weight per second on `backend` at `tokens` activations.
fn measure(backend: &Arc<Backend>, tokens: u64) -> Result<f64, SchedError> {
    let tokens = tokens.clamp(1, 1 << 16) as i64;
    let specs = vec![
        TensorSpec { name: "w".into(), ty: GgmlType::GGML_TYPE_F16, ne: vec![PROBE_SIDE, PROBE_SIDE] },
        TensorSpec { name: "x".into(), ty: GgmlType::GGML_TYPE_F32, ne: vec![PROBE_SIDE, tokens] },
    ];
    let mut w = Weights::new(specs)?;
    w.allocate(backend.device().buffer_type())?;
    w.load_from(&Constant)?;
    let g = Context::for_graph(8, 8)?;
    let y = g.mul_mat(w.get("w")?, w.get("x")?);
    let graph = g.new_graph(8);
    graph.expand(y);
    let mut runner = Runner::new("speed probe", backend.clone());
    runner.alloc(&graph)?;
    runner.compute(&graph)?;
    let mut best = f64::INFINITY;
    for _ in 0..PROBE_RUNS {
        let t0 = Instant::now();
        runner.compute(&graph)?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    let bytes = (PROBE_SIDE * PROBE_SIDE * 2) as f64;
    Ok(bytes / best.max(1e-9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_measured_once_then_read_from_the_cache() {
        let search = sd_backends::PluginSearch::only(vec![PathBuf::from(ggml_sys::BUILD_PLUGIN_DIR)]);
        let reg: &'static sd_backends::PluginRegistry =
            Box::leak(Box::new(sd_backends::PluginRegistry::discover(&search)));
        let cpu = Arc::new(Backend::new(reg.device("cpu").unwrap()).unwrap());
        let dir = std::env::temp_dir().join(format!("sd-speed-cache-{}", std::process::id()));
        let path = dir.join("device-speeds.toml");
        let first = device_speeds(std::slice::from_ref(&cpu), "sd1 test", 64, &path).unwrap();
        let s = first["CPU"];
        assert!(s.is_finite() && s > 0.0, "{first:?}");
        // A planted figure in the file is what a second call returns: nothing is measured again.
        let text = std::fs::read_to_string(&path).unwrap().replace(&format!("{s}"), "12345.0");
        std::fs::write(&path, text).unwrap();
        let second = device_speeds(std::slice::from_ref(&cpu), "sd1 test", 64, &path).unwrap();
        assert_eq!(second["CPU"], 12345.0);
        assert_eq!(cached_speeds("sd1 test", 64, &path)["CPU"], 12345.0);
        assert!(cached_speeds("another model", 64, &path).is_empty(), "keyed by model");
        // A damaged file is replaced by a fresh measurement.
        std::fs::write(&path, "speed = [not toml").unwrap();
        let third = device_speeds(std::slice::from_ref(&cpu), "sd1 test", 64, &path).unwrap();
        assert!(third["CPU"] != 12345.0 && third["CPU"] > 0.0);
        std::fs::remove_dir_all(&dir).ok();
    }
}
