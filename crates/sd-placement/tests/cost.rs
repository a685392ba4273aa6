//! The cost model on hand-computed cases (block FLOPs and bytes, a streamed segment, a two-stage pipeline, whole plans) and auto-fit by predicted time.

use sd_placement::*;

/// A module of `blocks` blocks, each one f16 weight `[side, side]` (`2·side²` bytes), plus one
/// non-block weight of the same shape: the description and the workload's shapes agree.
fn square(module: Module, blocks: u32, side: u64) -> (Component, Vec<WeightShape>) {
    let bytes = 2 * side * side;
    let mut tensors = vec![Tensor::new(format!("{module}.embed.weight"), bytes)];
    let mut shapes = vec![WeightShape {
        module,
        block: None,
        shape: vec![side, side],
        ty: WeightType::Float,
        bytes,
        attention_kv_tokens: None,
        rows: None,
    }];
    for b in 0..blocks {
        tensors.push(Tensor::in_block(format!("{module}.blocks.{b}.weight"), bytes, b));
        shapes.push(WeightShape { block: Some(b), ..shapes[0].clone() });
    }
    (Component { module, tensors }, shapes)
}

struct Case {
    devices: Vec<Device>,
    model: ModelDescription,
    work: Workload,
}

/// Diffusion (`d_blocks` × `side`), te (`t_blocks` × `side`), both at `tokens` rows; `steps`
/// diffusion runs, one te run.
fn case(devices: Vec<Device>, d_blocks: u32, t_blocks: u32, side: u64, tokens: u64, steps: u32) -> Case {
    let (d, mut ws) = square(Module::Diffusion, d_blocks, side);
    let mut components = vec![d];
    if t_blocks > 0 {
        let (t, ts) = square(Module::Te, t_blocks, side);
        components.push(t);
        ws.extend(ts);
    }
    let mut modules = vec![ModuleLoad { module: Module::Diffusion, tokens, batch: 2, runs: steps }];
    if t_blocks > 0 {
        modules.push(ModuleLoad { module: Module::Te, tokens, batch: 1, runs: 1 });
    }
    Case {
        devices,
        model: ModelDescription { components, ..Default::default() },
        work: Workload { steps, modules, weights: ws },
    }
}

fn request(c: &Case, flags: Flags) -> PlanRequest {
    PlanRequest {
        flags,
        devices: c.devices.clone(),
        ram_available_bytes: Some(64 * GIB),
        model: c.model.clone(),
        device_speeds: Default::default(),
    }
}

fn figs(list: &[(&str, f64, f64, f64)]) -> Figures {
    Figures {
        devices: list
            .iter()
            .map(|&(n, flops, link, latency)| {
                (
                    n.to_string(),
                    DeviceFigures {
                        matmul_f16: flops,
                        link_bytes_per_s: link,
                        link_latency_s: latency,
                        ..Default::default()
                    },
                )
            })
            .collect(),
        disk_bytes_per_s: 0.0,
        source: "test".into(),
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

#[test]
fn block_flops_and_bytes_from_shapes() {
    let w = |block, shape: Vec<u64>, ty, bytes, kv| WeightShape {
        module: Module::Diffusion,
        block,
        shape,
        ty,
        bytes,
        attention_kv_tokens: kv,
        rows: None,
    };
    let weights = vec![
        w(Some(0), vec![4, 3], WeightType::Float, 24, None), // 2·4·3·10 = 240 matmul f16
        w(Some(0), vec![2, 3, 3, 3], WeightType::Float, 108, None), // 2·54·10 = 1080 conv
        w(Some(0), vec![8, 8], WeightType::Q8, 68, Some(0)), // 2·64·10 = 1280 q8; 4·10·10·8 attention
        w(Some(0), vec![8], WeightType::Float, 16, None),    // a norm: bytes only
        w(Some(1), vec![5, 2], WeightType::Q4, 6, Some(7)),  // 2·10·10 = 200 q4; 4·10·7·5 cross attention
        w(None, vec![6, 2], WeightType::Float, 24, None),    // non-block: 2·12·10 = 240
        WeightShape { module: Module::Te, ..w(Some(0), vec![9, 9], WeightType::Float, 162, None) }, // not counted
        WeightShape { rows: Some(0), ..w(Some(1), vec![9, 9], WeightType::Float, 162, Some(0)) }, // not computed
        WeightShape { rows: Some(5), ..w(None, vec![2, 3], WeightType::Float, 12, None) }, // 2·6·5 = 60 at 5 rows
    ];
    let c = block_costs(&weights, Module::Diffusion, 10);
    assert_eq!(c.len(), 3);
    assert_eq!(c[0].index, None);
    assert_eq!(c[0].weight_bytes, 24 + 12);
    assert_eq!(c[0].flops, [240.0 + 60.0, 0.0, 0.0, 0.0, 0.0]);
    assert_eq!(c[1].index, Some(0));
    assert_eq!(c[1].weight_bytes, 24 + 108 + 68 + 16);
    assert_eq!(c[1].flops, [240.0, 1280.0, 0.0, 1080.0, 3200.0]);
    assert_eq!(c[1].out_bytes, 8 * 10 * 4, "the widest output, f32, at 10 rows");
    assert_eq!(c[2].flops, [0.0, 0.0, 200.0, 0.0, 1400.0]);
    assert_eq!(c[2].weight_bytes, 6 + 162, "a weight not computed is still moved");
    // A roofline: FLOPs by class at each class's rate, or the weight read, whichever is longer.
    let d = DeviceFigures { matmul_f16: 100.0, matmul_q8: 1280.0, conv: 1080.0, attention: 0.0, ..Default::default() };
    assert!(close(c[1].compute_s(&d), 2.4 + 1.0 + 1.0 + 32.0), "attention falls back to the f16 rate");
    let slow_memory = DeviceFigures { memory_bytes_per_s: 1.0, ..d.clone() };
    assert!(close(c[1].compute_s(&slow_memory), 216.0));
}

#[test]
fn streamed_segments_overlap_transfer_and_compute() {
    // Transfer-bound: the first transfer, then every segment waits for its successor's copy.
    assert!(close(streamed_s(&[(2.0, 1.0), (2.0, 1.0), (2.0, 1.0)]), 2.0 + 2.0 + 2.0 + 1.0));
    // Compute-bound: only the first transfer shows.
    assert!(close(streamed_s(&[(1.0, 3.0), (1.0, 3.0)]), 1.0 + 3.0 + 3.0));
    // A resident leading segment hides the first streamed one's copy.
    assert!(close(streamed_s(&[(0.0, 3.0), (2.0, 1.0)]), 3.0 + 1.0));
    assert_eq!(streamed_s(&[]), 0.0);
}

#[test]
fn a_two_stage_pipeline() {
    // Stages of 2 s and 1 s: in sequence 3 s; two micro-batches of half the work each:
    // 1 + 0.5 to pass the first through, then one more slowest stage (1 s).
    assert!(close(pipelined_s(&[2.0, 1.0], 1), 3.0));
    assert!(close(pipelined_s(&[2.0, 1.0], 2), 2.5));
    assert!(close(pipelined_s(&[1.0, 1.0], 4), 0.5 + 0.75));
}

#[test]
fn a_resident_plan_is_its_compute() {
    // CPU only: 4 blocks + embed of 2·1024·1024·64 FLOPs each at 1 GFLOP/s.
    let c = case(vec![], 4, 0, 1024, 64, 3);
    let p = plan(&request(&c, Flags::default())).unwrap();
    let pred = predict(&p, &c.work, &figs(&[("CPU", 1e9, 0.0, 0.0)]));
    let block = 2.0 * 1024.0 * 1024.0 * 64.0 / 1e9;
    assert!(pred.complete(), "{:?}", pred.unpredicted);
    assert!(close(pred.step_s, 5.0 * block), "{}", pred.step_s);
    assert!(close(pred.total_s, 3.0 * 5.0 * block));
    assert_eq!(pred.bytes_per_step, 0);
    assert_eq!(pred.peak.iter().find(|(d, _)| d == "CPU").unwrap().1, p.devices.last().unwrap().used_bytes);
}

#[test]
fn params_in_ram_stream_what_the_budget_cannot_keep() {
    // 40 blocks + embed of about 64 MiB each (2.6 GiB), params in RAM, computed on a GPU with a
    // 2.5 GiB budget. Once warm, what stays is what the executor's segment planner keeps: the
    // same 41 segments (workspace 16 times the widest f32 output: 16·side·16 rows·4 bytes)
    // replayed on the device's budget and free memory, until the third run.
    let side = 4096 * 1448 / 1024; // about 64 MiB per f16 weight
    let c = case(vec![Device::gpu("GPU0", 3 * GIB, 8 * GIB)], 40, 0, side, 16, 2);
    let flags = Flags { backend: Some("GPU0".into()), params_backend: Some("CPU".into()), ..Flags::default() };
    let p = plan(&request(&c, flags)).unwrap();
    let gpu = p.devices.iter().find(|d| d.device == "GPU0").unwrap();
    let per = 2 * side * side;
    let workspace = 16 * side * 16 * 4;
    let graph = segments::ModuleGraph {
        name: "unet".into(),
        segments: (0..41)
            .map(|i| {
                segments::Segment::new(
                    format!("s{i}"),
                    vec![segments::ParamGroup::new(format!("g{i}"), per)],
                    workspace,
                )
            })
            .collect(),
    };
    let mut sim = segments::Simulator::new(segments::DeviceState::new("GPU0", gpu.budget_bytes, gpu.free_bytes));
    let runs: Vec<_> =
        (0..3).map(|_| sim.run(&graph, &segments::Options::default(), &mut segments::Estimate).unwrap().1).collect();
    let streamed = runs[2].transferred();
    assert_eq!(runs[0].transferred(), 41 * per, "the first run copies everything");
    assert!(streamed > 0 && streamed < 41 * per, "{streamed}");
    // (not only trailing ones: the planner merges segments and evicts from the end of each)
    let f = figs(&[("GPU0", 1e24, 1e9, 0.0), ("CPU", 1e9, 0.0, 0.0)]);
    let pred = predict(&p, &c.work, &f);
    assert!(pred.complete(), "{:?}", pred.unpredicted);
    assert_eq!(pred.bytes_per_step, streamed);
    // Compute is negligible: each streamed segment waits for its own copy.
    let t = per as f64 / 1e9;
    assert!(close(pred.step_s, (streamed / per) as f64 * t), "{}", pred.step_s);
    let d = &pred.modules[0];
    assert!(close(d.first_run_s, 41.0 * t), "the first run copies everything");
    // Free memory that holds every block and the workspace: nothing streams once warm.
    let c = case(vec![Device::gpu("GPU0", 8 * GIB, 8 * GIB)], 40, 0, side, 16, 2);
    let flags = Flags { backend: Some("GPU0".into()), params_backend: Some("CPU".into()), ..Flags::default() };
    let p = plan(&request(&c, flags)).unwrap();
    assert_eq!(predict(&p, &c.work, &f).bytes_per_step, 0);
}

#[test]
fn layer_split_with_pipeline_copies() {
    // 4 blocks on two GPUs split by memory 2 + 2 (embed with the first); GPU1 twice as slow.
    let c =
        case(vec![Device::gpu("GPU0", 16 * GIB, 16 * GIB), Device::gpu("GPU1", 16 * GIB, 16 * GIB)], 4, 0, 1024, 64, 1);
    let flags =
        Flags { backend: Some("diffusion=GPU0&GPU1".into()), pipeline_copies: Some("2".into()), ..Flags::default() };
    let p = plan(&request(&c, flags)).map_err(|e| e.to_string()).unwrap();
    let d = &p.modules[0];
    assert_eq!(d.split.len(), 2);
    let n0 = u64::from(d.split[0].last_block - d.split[0].first_block + 1) + 1; // + embed
    let n1 = u64::from(d.split[1].last_block - d.split[1].first_block + 1);
    let flops = 2.0 * 1024.0 * 1024.0 * 64.0;
    let boundary = (1024 * 64 * 4) as f64; // the block's f32 output
    let f = figs(&[("GPU0", 1e12, 1e9, 1e-3), ("GPU1", 0.5e12, 1e9, 1e-3), ("CPU", 1e9, 0.0, 0.0)]);
    let s0 = 1e-3 + n0 as f64 * flops / 1e12 + 2.0 * (boundary / 1e9 + 1e-3);
    let s1 = 1e-3 + n1 as f64 * flops / 0.5e12;
    let pred = predict(&p, &c.work, &f);
    assert!(pred.complete(), "{:?}", pred.unpredicted);
    assert!(close(pred.step_s, (s0 + s1) / 2.0 + s0.max(s1) / 2.0), "{} vs {}", pred.step_s, s0 + s1);
    assert_eq!(pred.bytes_per_step, 2 * 1024 * 64 * 4);

    // The same two devices computing on one machine's cores (two RPC servers on one host)
    // take turns: the stages run in sequence whatever the copies, and the plan says why.
    let mut shared = f.clone();
    for d in ["GPU0", "GPU1"] {
        shared.devices.get_mut(d).unwrap().host = "10.0.0.7".into();
    }
    let seq = predict(&p, &c.work, &shared);
    assert!(close(seq.step_s, s0 + s1), "{} vs {}", seq.step_s, s0 + s1);
    assert!(seq.modules[0].how.contains("share the cores of 10.0.0.7"), "{}", seq.modules[0].how);
    // Hosts that differ (or a device with compute of its own) still overlap.
    shared.devices.get_mut("GPU1").unwrap().host = "10.0.0.8".into();
    assert!(close(predict(&p, &c.work, &shared).step_s, pred.step_s));
    shared.devices.get_mut("GPU1").unwrap().host.clear();
    assert!(close(predict(&p, &c.work, &shared).step_s, pred.step_s));
}

#[test]
fn a_row_split_or_missing_figures_are_not_predicted() {
    let c = case(vec![Device::gpu("GPU0", 16 * GIB, 16 * GIB)], 4, 2, 256, 16, 1);
    let p = plan(&request(&c, Flags::default())).unwrap();
    let pred = predict(&p, &c.work, &figs(&[("CPU", 1e9, 0.0, 0.0)]));
    assert!(!pred.complete());
    assert!(pred.unpredicted.iter().any(|u| u.contains("GPU0")), "{:?}", pred.unpredicted);
}

/// The text encoder case of the issue: a remote GPU behind a slow link whose budget cannot
/// hold the text encoder next to diffusion; the ladder keeps te's params in RAM and streams
/// them over the network every run, the CPU computes it faster locally.
fn remote_te() -> (Case, Figures) {
    let side = 2048; // 8 MiB weights
    let c = case(vec![Device::gpu("RPC0", 2 * GIB + 812 * MIB, 4 * GIB).with_registry("RPC")], 20, 24, side, 64, 4);
    let f = figs(&[("RPC0", 5e12, 50e6, 2e-3), ("CPU", 200e9, 0.0, 0.0)]);
    (c, f)
}

#[test]
fn auto_fit_by_time_moves_a_streamed_text_encoder_to_the_cpu() {
    let (c, f) = remote_te();
    let req = request(&c, Flags::default());
    let ladder = plan(&req).unwrap();
    assert_eq!(ladder.modules[1].runtime, ["RPC0"], "the ladder computes te on the GPU");
    let (chosen, explain) = plan_by_time(&req, &c.work, &f).unwrap();
    assert!(chosen.auto_fit && chosen.fits);
    let te = chosen.modules.iter().find(|m| m.module == Module::Te).unwrap();
    assert_eq!(te.runtime, ["CPU"], "{}", explain.render());
    let l = explain.ladder.as_ref().unwrap();
    assert!(explain.chosen.total_s < l.total_s * (1.0 - MARGIN));
    assert!(
        chosen.choice.as_deref().unwrap().contains("against the ladder's"),
        "{}\n{}",
        explain.render(),
        ladder.render()
    );
    assert!(!explain.alternatives.is_empty());
    assert!(explain.alternatives.windows(2).all(|w| w[0].total_s <= w[1].total_s));
    // The chosen plan's equivalent flags reproduce it.
    let again = plan(&PlanRequest {
        flags: Flags {
            backend: Some(chosen.backend.clone()),
            params_backend: Some(chosen.params_backend.clone()),
            ..Flags::default()
        },
        ..req.clone()
    })
    .unwrap();
    assert_eq!(again.modules, chosen.modules);
}

#[test]
fn auto_fit_ladder_keeps_the_seeds_plan_exactly() {
    let (c, f) = remote_te();
    let req = request(&c, Flags { auto_fit: Some("ladder".into()), ..Flags::default() });
    let (mut chosen, explain) = plan_by_time(&req, &c.work, &f).unwrap();
    assert!(chosen.choice.take().unwrap().contains("--auto-fit ladder"));
    let seeds = plan(&request(&c, Flags::default())).unwrap();
    assert_eq!(chosen, seeds);
    assert!(explain.alternatives.is_empty());
    assert_eq!(parse_auto_fit_mode(Some(" Ladder ")).unwrap(), AutoFitMode::Ladder);
    assert!(parse_auto_fit(Some("ladder")).unwrap());
    let e = parse_auto_fit_mode(Some("fastest")).unwrap_err().to_string();
    assert!(e.contains("fastest") && e.contains("ladder"), "{e}");
}

#[test]
fn auto_fit_by_time_picks_the_faster_of_two_uneven_gpus() {
    // The ladder computes on the GPU with the larger budget; the smaller one is 10x faster and
    // holds the model too.
    let devices = vec![Device::gpu("GPU0", 20 * GIB, 24 * GIB), Device::gpu("GPU1", 10 * GIB, 12 * GIB)];
    let c = case(devices, 12, 4, 1024, 256, 8);
    let f = figs(&[("GPU0", 1e12, 10e9, 1e-5), ("GPU1", 10e12, 10e9, 1e-5), ("CPU", 1e11, 0.0, 0.0)]);
    let req = request(&c, Flags::default());
    assert_eq!(plan(&req).unwrap().main_device, "GPU0");
    let (chosen, explain) = plan_by_time(&req, &c.work, &f).unwrap();
    assert_eq!(chosen.modules[0].runtime, ["GPU1"], "{}", explain.render());
}

#[test]
fn never_slower_than_the_ladder_and_deterministic() {
    // A spread of situations: the chosen plan's prediction never exceeds the ladder's.
    for (budget, link, cpu) in [(3, 1e9, 1e9), (6, 50e6, 1e11), (16, 10e9, 1e12), (2, 10e9, 1e8)] {
        let c = case(vec![Device::gpu("GPU0", budget * GIB, 24 * GIB)], 10, 6, 2048, 64, 10);
        let f = figs(&[("GPU0", 1e13, link, 1e-4), ("CPU", cpu, 0.0, 0.0)]);
        let req = request(&c, Flags::default());
        let (a, ea) = plan_by_time(&req, &c.work, &f).unwrap();
        let (b, _) = plan_by_time(&req, &c.work, &f).unwrap();
        assert_eq!(a, b, "deterministic");
        if let Some(l) = &ea.ladder {
            if l.complete() && plan(&req).unwrap().fits {
                assert!(ea.chosen.total_s <= l.total_s, "budget {budget}: {}", ea.render());
            }
        }
    }
}

#[test]
fn bad_figures_are_refused_naming_the_device() {
    let (c, mut f) = remote_te();
    f.devices.get_mut("RPC0").unwrap().link_bytes_per_s = f64::NAN;
    let e = plan_by_time(&request(&c, Flags::default()), &c.work, &f).unwrap_err().to_string();
    assert!(e.contains("RPC0") && e.contains("link_bytes_per_s"), "{e}");
}
