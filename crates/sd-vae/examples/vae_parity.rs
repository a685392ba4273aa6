//! Decodes a latent with the VAE of a single-file checkpoint, for comparison with the reference.
//!
//! `cargo run -p sd-vae --example vae_parity -- MODEL.safetensors SIDE THREADS OUT_DIR [taesd.safetensors]`
//! writes `OUT_DIR/z.f32` (+ `.json` sidecar, the sdref raw format: a standard-normal-ish
//! diffusion-space latent `[1, 4, SIDE, SIDE]`) and `OUT_DIR/vae.ours.f32` (our decoder
//! output in [-1, 1], `[1, 3, 8 SIDE, 8 SIDE]`). Run
//! `sdref vae-decode -m MODEL --latent OUT_DIR/z.f32 -o OUT_DIR/vae.ref.f32 -t THREADS`
//! and compare the two files. With a TAESD file it also writes `OUT_DIR/taesd.ours.f32`.
//! `SD_VAE_CONV=im2col|direct` forces a convolution path; `SD_VAE_PLUGIN_DIR` loads the
//! CPU plugin from another directory (another build of the same ggml).

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use sd_backends::{Backend, GgmlType, PluginRegistry, PluginSearch};
use sd_sched::{Runner, SourceError, TensorSource};
use sd_vae::{AutoencoderKl, FirstStage, GraphOptions, Taesd, TaesdConfig, TaesdParts, VaeConfig, VaeParts};

/// Tensors of one safetensors file, converted to what the model declares.
struct File {
    bytes: Vec<u8>,
    prefix: &'static str,
}

impl TensorSource for File {
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        let st = SafeTensors::deserialize(&self.bytes).map_err(SourceError::new)?;
        let key = name.strip_prefix(self.prefix).unwrap_or(name);
        let t = st.tensor(key).map_err(|e| SourceError::new(format!("{key}: {e}")))?;
        let n: i64 = ne.iter().product();
        let d = t.data();
        let vals: Vec<f32> = match t.dtype() {
            Dtype::F32 => d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::F16 => d.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::BF16 => d.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => return Err(SourceError::new(format!("{key}: dtype {other:?}"))),
        };
        if vals.len() as i64 != n {
            return Err(SourceError::new(format!("{key}: {} values, expected {n}", vals.len())));
        }
        Ok(Cow::Owned(match ty {
            GgmlType::GGML_TYPE_F16 => vals.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
            _ => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }))
    }
}

fn write_raw(path: &Path, shape: &[usize], data: &[f32]) {
    std::fs::write(path, data.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).expect("write");
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let side = format!(
        "{{\"format\": \"sdref-f32\", \"dtype\": \"f32\", \"byte_order\": \"little\", \"shape\": [{}]}}\n",
        dims.join(", ")
    );
    let mut p = path.as_os_str().to_owned();
    p.push(".json");
    std::fs::write(PathBuf::from(p), side).expect("write sidecar");
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 4 {
        eprintln!("usage: vae_parity MODEL.safetensors SIDE THREADS OUT_DIR [taesd.safetensors]");
        std::process::exit(2);
    }
    let side: usize = a[1].parse().expect("SIDE");
    let threads: usize = a[2].parse().expect("THREADS");
    let out = PathBuf::from(&a[3]);
    std::fs::create_dir_all(&out).expect("out dir");

    // SD_VAE_PLUGIN_DIR: take the CPU plugin from another build of the same ggml.
    let dir = std::env::var_os("SD_VAE_PLUGIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(ggml_sys::BUILD_PLUGIN_DIR));
    let reg = PluginRegistry::discover(&PluginSearch::only(vec![dir]));
    let dev = reg.device("cpu").expect("cpu");
    eprintln!("cpu plugin: {}", reg.plugin_of(&dev).map(|p| p.path.display().to_string()).unwrap_or_default());
    let backend = Backend::new(dev).expect("backend");
    backend.set_threads(threads);
    let backend = Arc::new(backend);

    // A deterministic latent with unit-ish variance.
    let mut s: u64 = 0x5eed_0002;
    let z: Vec<f32> = (0..4 * side * side)
        .map(|_| {
            let mut u = 0.0;
            for _ in 0..4 {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                u += (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            }
            u * 1.7
        })
        .collect();
    write_raw(&out.join("z.f32"), &[1, 4, side, side], &z);

    let file = File { bytes: std::fs::read(&a[0]).expect("model"), prefix: "" };
    let cfg = VaeConfig::sd();
    let vae = AutoencoderKl::load(cfg.clone(), VaeParts::DecoderOnly, &file, backend.device().buffer_type())
        .expect("load")
        .with_options(match std::env::var("SD_VAE_CONV").as_deref() {
            Ok("im2col") => GraphOptions::default(),
            Ok("direct") => GraphOptions { conv_direct: true, flash_attn: false },
            _ => GraphOptions::recommended(dev),
        });
    let mut runner = Runner::new("vae", backend.clone());
    let mut zv = z.clone();
    vae.diffusion_to_vae(&mut zv);
    let t = std::time::Instant::now();
    let img = vae.decode(&mut runner, &zv, (side, side), 4).expect("decode");
    eprintln!("our vae decode: {:.2} s", t.elapsed().as_secs_f64());
    write_raw(&out.join("vae.ours.f32"), &[1, 3, side * 8, side * 8], &img);

    if let Some(taesd) = a.get(4) {
        let file = File { bytes: std::fs::read(taesd).expect("taesd"), prefix: "tae." };
        let tae = Taesd::load(TaesdConfig::sd(), TaesdParts::DecoderOnly, &file, backend.device().buffer_type())
            .expect("taesd");
        let img = tae.decode(&mut runner, &z, (side, side), 4).expect("taesd decode");
        write_raw(&out.join("taesd.ours.f32"), &[1, 3, side * 8, side * 8], &img);
    }
}
