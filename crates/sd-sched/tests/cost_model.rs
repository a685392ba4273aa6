//! sd-placement's cost model against this crate's segment planner: the bytes the model says a streamed module copies per warm run are what the `Simulator` transfers.
//!
//! The model replays the planner this crate executes (`sd_placement::segments`, re-exported
//! as `sd_sched::plan`); checked here on equal blocks under several budgets, against a
//! simulator fed by this test rather than by the model.

use sd_placement::{
    plan, predict, Component, Device, DeviceFigures, Figures, Flags, ModelDescription, Module, ModuleLoad, PlanRequest,
    Tensor, WeightShape, WeightType, Workload, GIB,
};
use sd_sched::plan::{DeviceState, Estimate, ModuleGraph, Options, ParamGroup, Segment, Simulator};

/// `n` blocks of one f16 weight `[5120, 10240]` (100 MiB) at 64 rows: the widest output is
/// 5120·64·4 bytes, the model's workspace 16 times that (20 MiB).
const OUT: u64 = 5120;
const IN: u64 = 10240;
const ROWS: u64 = 64;
const BLOCK: u64 = 2 * OUT * IN;
const WORKSPACE: u64 = 16 * OUT * ROWS * 4;

fn predicted_bytes(n: u32, budget_gib: f64) -> u64 {
    let tensors = (0..n).map(|b| Tensor::in_block(format!("blocks.{b}.w"), BLOCK, b)).collect();
    let weights = (0..n)
        .map(|b| WeightShape {
            module: Module::Diffusion,
            block: Some(b),
            shape: vec![OUT, IN],
            ty: WeightType::Float,
            bytes: BLOCK,
            attention_kv_tokens: None,
            rows: None,
        })
        .collect();
    let req = PlanRequest {
        flags: Flags {
            backend: Some("GPU0".into()),
            params_backend: Some("CPU".into()),
            max_vram: Some(format!("{budget_gib}")),
            ..Flags::default()
        },
        devices: vec![Device::gpu("GPU0", 24 * GIB, 24 * GIB)],
        ram_available_bytes: Some(64 * GIB),
        model: ModelDescription {
            components: vec![Component { module: Module::Diffusion, tensors }],
            ..Default::default()
        },
        device_speeds: Default::default(),
    };
    let p = plan(&req).unwrap();
    let work = Workload {
        steps: 3,
        modules: vec![ModuleLoad { module: Module::Diffusion, tokens: ROWS, batch: 1, runs: 3 }],
        weights,
    };
    let f = DeviceFigures { matmul_f16: 1e12, link_bytes_per_s: 1e9, ..Default::default() };
    let figures = Figures {
        devices: [("GPU0".to_string(), f.clone()), ("CPU".to_string(), f)].into_iter().collect(),
        ..Figures::default()
    };
    predict(&p, &work, &figures).bytes_per_step
}

fn simulated_bytes(n: u32, budget_gib: f64) -> u64 {
    let segments = (0..n)
        .map(|b| Segment::new(format!("block.{b}"), vec![ParamGroup::new(format!("d/{b}"), BLOCK)], WORKSPACE))
        .collect();
    let graph = ModuleGraph { name: "diffusion".into(), segments };
    let budget = (budget_gib * GIB as f64) as u64;
    let mut sim = Simulator::new(DeviceState::new("GPU0", Some(budget), None));
    let mut last = 0;
    for _ in 0..3 {
        last = sim.run(&graph, &Options::default(), &mut Estimate).unwrap().1.transferred();
    }
    last
}

#[test]
fn streamed_bytes_per_warm_run_against_the_simulator() {
    // The model replays the executor's planner, so it streams exactly what the simulator
    // transfers, under budgets where everything fits (nothing streams) and where most streams.
    let mut streamed_some = false;
    for n in [12u32, 20, 30] {
        for budget in [0.6f64, 0.8, 1.0, 1.5, 2.0, 2.5, 3.0] {
            let (model, sim) = (predicted_bytes(n, budget), simulated_bytes(n, budget));
            assert_eq!(
                model,
                sim,
                "{n} blocks of 100 MiB under {budget} GiB: the model streams {} blocks, the simulator {}",
                model / BLOCK,
                sim / BLOCK
            );
            streamed_some |= sim > 0;
        }
    }
    assert!(streamed_some);
}
