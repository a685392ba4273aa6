//! Benchmark: planning a 2,000-tensor model on 8 devices (target: median under 5 ms).
//! Run with `cargo bench -p sd-placement --bench plan`; prints the median of 200 runs for
//! auto-fit, for an explicit 7-way layer split, and for the same split sized by speed.

use std::hint::black_box;
use std::time::{Duration, Instant};

use sd_placement::*;

fn model() -> ModelDescription {
    // 1,200 diffusion tensors in 60 blocks, 600 text-encoder tensors in 24 blocks, 200 VAE.
    let mut components = Vec::new();
    for (module, n, nb, bytes) in
        [(Module::Diffusion, 1200u32, 60u32, 10 * MIB), (Module::Te, 600, 24, 15 * MIB), (Module::Vae, 200, 0, MIB)]
    {
        let tensors = (0..n)
            .map(|i| Tensor {
                name: format!("{module}.blocks.{}.t{i}.weight", i % nb.max(1)),
                bytes: bytes + (i as u64 % 7) * MIB,
                block: (nb > 0 && i % 10 != 0).then_some(i * nb / n),
            })
            .collect();
        components.push(Component { module, tensors });
    }
    ModelDescription {
        compute_bytes: Default::default(),
        components,
        files: vec![SourceFile { role: "<checkpoint file>".into(), bytes: 20 * GIB }],
    }
}

fn devices() -> Vec<Device> {
    let mut d = vec![Device::cpu()];
    for i in 0..7u64 {
        d.push(Device::gpu(format!("CUDA{i}"), (6 + i) * GIB, 24 * GIB).with_row_split(true));
    }
    d
}

fn median(mut f: impl FnMut()) -> Duration {
    for _ in 0..10 {
        f();
    }
    let mut times: Vec<Duration> = (0..200)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn main() {
    let auto = PlanRequest {
        flags: Flags::default(),
        devices: devices(),
        ram_available_bytes: Some(64 * GIB),
        model: model(),
        device_speeds: Default::default(),
    };
    let mut split = auto.clone();
    split.flags.backend = Some("diffusion=cuda0&cuda1&cuda2&cuda3&cuda4&cuda5&cuda6,te=cuda6&cuda5".into());
    let mut speed = split.clone();
    speed.flags.split_by = Some("speed".into());
    speed.device_speeds = (0..7).map(|i| (format!("CUDA{i}"), (1 + i) as f64 * 1e9)).collect();
    let tensors: usize = auto.model.components.iter().map(|c| c.tensors.len()).sum();
    for (name, req) in [("auto-fit", &auto), ("layer split", &split), ("speed split", &speed)] {
        let t = median(|| {
            black_box(plan(black_box(req)).unwrap());
        });
        println!(
            "plan {name}: {tensors} tensors, {} devices: median {:.3} ms (target < 5 ms)",
            req.devices.len(),
            t.as_secs_f64() * 1e3
        );
    }
}
