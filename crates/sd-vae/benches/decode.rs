//! Decode timing of the SD 1.x/2.x VAE and TAESD with random weights, per convolution path.
//!
//! Run: `cargo bench -p sd-vae --bench decode [-- SIZE [THREADS]]` (SIZE in image pixels,
//! default 256). Prints seconds per decode and the compute buffer size for the im2col
//! path (the reference's default) and the direct-convolution path, and whether the two
//! images are bit-identical.

use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use sd_backends::{Backend, GgmlType, PluginRegistry, PluginSearch};
use sd_sched::{Runner, SourceError, TensorSource};
use sd_vae::{AutoencoderKl, FirstStage, GraphOptions, Taesd, TaesdConfig, TaesdParts, VaeConfig, VaeParts};

/// Cheap deterministic weights (an LCG per tensor), scaled like a trained network's.
struct Source;

impl TensorSource for Source {
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        let n: i64 = ne.iter().product();
        let fan_in: i64 = if ne.len() >= 2 { ne[..ne.len() - 1].iter().product() } else { 1 };
        let gain = (3.0 / fan_in as f32).sqrt();
        let mut s: u32 = name.bytes().fold(2166136261u32, |h, b| (h ^ b as u32).wrapping_mul(16777619));
        let mut out = Vec::with_capacity(n as usize * 4);
        for _ in 0..n {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            let u = (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0;
            let v = if name.contains("norm") && name.ends_with(".weight") {
                1.0 + 0.1 * u
            } else if name.ends_with(".bias") {
                0.05 * u
            } else {
                gain * u
            };
            if ty == GgmlType::GGML_TYPE_F16 {
                out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes());
            } else {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Ok(Cow::Owned(out))
    }
}

fn time<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed().as_secs_f64())
}

/// CPU seconds (user + system) of this process so far, from /proc (0 elsewhere). On a
/// busy machine this, not the wall time, says how much work a decode is.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let size: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(256);
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    // SD_VAE_PLUGIN_DIR: load the CPU plugin from another build of the same ggml
    // (to compare build options such as GGML_LLAMAFILE).
    let dir = std::env::var_os("SD_VAE_PLUGIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(ggml_sys::BUILD_PLUGIN_DIR));
    let reg = PluginRegistry::discover(&PluginSearch::only(vec![dir]));
    let dev = reg.device("cpu").expect("cpu device");
    println!("cpu plugin: {}", reg.plugin_of(&dev).map(|p| p.path.display().to_string()).unwrap_or_default());
    let backend = Backend::new(dev).expect("cpu backend");
    backend.set_threads(threads);
    let backend = Arc::new(backend);
    let buft = backend.device().buffer_type();
    let l = size / 8;
    let latent: Vec<f32> = (0..4 * l * l).map(|i| ((i as f32 * 0.37).sin()) * 1.5).collect();

    let (vae, t) = time(|| AutoencoderKl::load(VaeConfig::sd(), VaeParts::DecoderOnly, &Source, buft).expect("load"));
    println!("vae: {size}x{size}, {threads} threads, weights generated and loaded in {t:.1} s");
    let mut images = Vec::new();
    for (label, opts) in
        [("im2col", GraphOptions::default()), ("direct", GraphOptions { conv_direct: true, flash_attn: false })]
    {
        let vae = AutoencoderKl::from_weights(VaeConfig::sd(), clone_weights(&vae, buft))
            .expect("weights")
            .with_options(opts);
        let mut runner = Runner::new("vae", backend.clone());
        let need = match vae.decode_graph(&mut runner, &latent, [l, l], 4, Some(0)) {
            Err(sd_vae::VaeError::Alloc { bytes, .. }) => bytes,
            _ => 0,
        };
        let mut best = f64::MAX;
        let mut best_cpu = f64::MAX;
        let mut img = Vec::new();
        for _ in 0..2 {
            let c0 = cpu_seconds();
            let (r, t) = time(|| vae.decode(&mut runner, &latent, (l, l), 4).expect("decode"));
            best = best.min(t);
            best_cpu = best_cpu.min(cpu_seconds() - c0);
            img = r;
        }
        println!(
            "vae decode [{label}]: {best:.2} s wall, {best_cpu:.2} s cpu (best of 2), compute buffer {:.1} MiB",
            need as f64 / 1048576.0
        );
        images.push(img);
    }
    if let Some(path) = std::env::var_os("SD_VAE_BENCH_DUMP") {
        let bytes: Vec<u8> = images[0].iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(path, bytes).expect("dump");
    }
    let same = images[0] == images[1];
    let maxd = images[0].iter().zip(&images[1]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    println!("im2col vs direct: bit-identical {same}, max |diff| {maxd:e}");

    let tae = Taesd::load(TaesdConfig::sd(), TaesdParts::DecoderOnly, &Source, buft).expect("taesd");
    let mut runner = Runner::new("taesd", backend.clone());
    let c0 = cpu_seconds();
    let (_, t) = time(|| tae.decode(&mut runner, &latent, (l, l), 4).expect("taesd decode"));
    println!("taesd decode [im2col]: {t:.2} s wall, {:.2} s cpu", cpu_seconds() - c0);
}

/// A second weight set with the same values (the models own their weights).
fn clone_weights(vae: &AutoencoderKl, buft: sd_backends::BufferType) -> sd_sched::Weights {
    let mut w = sd_sched::Weights::new(vae.weights().specs().to_vec()).expect("specs");
    w.allocate(buft).expect("alloc");
    w.load_from(&Source).expect("load");
    w
}
