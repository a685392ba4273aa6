//! Placement language, auto-fit planner, layer/row split and pre-load memory check: pure logic.
//!
//! # What it is for
//!
//! "Will this model fit on my card, and how?" answered before anything is downloaded or loaded.
//! The crate implements the placement rules of stable-diffusion.cpp's `backend.md` (the
//! `--backend` / `--params-backend` / `--split-mode` / `--max-vram` / `--auto-fit` language,
//! the compatibility flags, automatic placement, layer and row split), the `--max-vram` budget
//! semantics of stable-diffusion.cpp's `docs/performance.md`, and the pre-load memory check of `memory-check.md` (the guide "Image generation memory, logs and limits").
//! Beyond the reference: the CPU in a layer split, `--split-by memory|speed` (ranges sized by
//! measured device speeds, given in [`PlanRequest::device_speeds`], with predicted times) and
//! `--pipeline-copies` / `SD_PIPELINE_COPIES` (the copy count a layer split's executor keeps,
//! and its memory).
//!
//! # What it refuses to do
//!
//! No I/O (a device profile is parsed from a `&str`, model descriptions are plain data), no
//! `unsafe`, no FFI, no ggml. It never panics on bad input: flags that do not parse are a
//! [`PlanError`] naming the offending token and what is accepted.
//!
//! # How another tool uses it
//!
//! Describe the devices (name, type, free/total memory, row-split capability, registry), the
//! available RAM and the model (per module: tensor names, byte sizes, block indices; the source
//! file sizes), pass the flags as the user typed them, and call [`plan`]:
//!
//! ```
//! use sd_placement::{plan, Component, Device, Flags, Module, ModelDescription, PlanRequest,
//!                    SourceFile, Tensor, GIB, MIB};
//!
//! // A 12 GiB diffusion model in 24 blocks, a 5 GiB text encoder, a small VAE.
//! let diffusion = Component {
//!     module: Module::Diffusion,
//!     tensors: (0..24).map(|b| Tensor::in_block(format!("blocks.{b}.w"), GIB / 2, b)).collect(),
//! };
//! let te = Component {
//!     module: Module::Te,
//!     tensors: (0..20).map(|i| Tensor::new(format!("t5.{i}.w"), GIB / 4)).collect(),
//! };
//! let vae = Component { module: Module::Vae, tensors: vec![Tensor::new("vae.w", 160 * MIB)] };
//! let request = PlanRequest {
//!     flags: Flags::default(), // no --backend: auto-fit is on
//!     devices: vec![Device::gpu("CUDA0", 8 * GIB, 8 * GIB), Device::cpu()],
//!     ram_available_bytes: Some(32 * GIB),
//!     model: ModelDescription {
//!         components: vec![diffusion, te, vae],
//!         files: vec![SourceFile { role: "<checkpoint file>".into(), bytes: 17 * GIB }],
//!         compute_bytes: Default::default(), // no estimates: the fixed reserves of backend.md
//!     },
//!     device_speeds: Default::default(), // no measured speeds (see --split-by speed)
//! };
//! let p = plan(&request).expect("valid input");
//! assert!(p.auto_fit && p.fits);
//! // The diffusion weights do not fit the 7.5 GiB budget with 2 GiB compute room: they stay in
//! // RAM and the GPU computes; the text encoder cannot take the room diffusion needs to cache
//! // its weights, so it is offloaded too.
//! assert_eq!(p.modules[0].runtime, ["CUDA0"]);
//! assert_eq!(p.modules[0].params, "CPU");
//! println!("{}", p.render()); // or p.to_json()
//!
//! // Explicit assignments disable auto-fit; errors name the token.
//! let mut bad = request.clone();
//! bad.flags.backend = Some("vae=cuda7".into());
//! let err = plan(&bad).unwrap_err().to_string();
//! assert!(err.contains("cuda7") && err.contains("CUDA0"));
//! ```
//!
//! A device profile (hypothetical devices) comes from TOML text with
//! [`DeviceProfile::from_toml_str`]. A loader that must refuse a model the memory check refuses
//! calls [`Plan::ensure_loadable`]. The parser entry points ([`parse_backend`],
//! [`parse_params_backend`], [`parse_split_mode`], [`parse_split_by`], [`parse_pipeline_copies`],
//! [`parse_max_vram`], [`parse_auto_fit`],
//! [`resolve_device`], [`Module::parse`]) are public for tools that only validate flags.
//!
//! # Predicted time
//!
//! [`predict`] gives a plan's seconds per step, per module run, bytes moved per step and peak
//! per device from device and link [`Figures`] and a [`Workload`] (weight shapes, token counts,
//! runs); [`plan_by_time`] is auto-fit choosing the fastest plan that fits, the ladder's plan
//! as the floor (`--auto-fit ladder` keeps it), with an [`Explain`] of the choice.
//!
//! The rules, each with its test, are in [`rules`].
//!
//! # Main types
//!
//! [`PlanRequest`] (input), [`Plan`] (output: per-module [`ModulePlan`], per-device
//! [`DeviceUsage`], [`MemoryCheck`], warnings, equivalent flags), [`PlanError`].

#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// The placement rules this crate implements, each with the test that checks it
/// (`RULES.md` of this crate, rendered here).
#[doc = include_str!("../RULES.md")]
pub mod rules {}

// The README's example runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}

mod autofit;
mod budget;
mod choose;
mod cost;
mod device;
mod error;
mod explicit;
mod memcheck;
mod model;
mod placement;
mod plan;
pub mod presets;
pub mod segments;
mod spec;
mod split;
mod units;

pub use autofit::ram_reserve;
pub use budget::BudgetRule;
pub use choose::{plan_by_time, Alternative, Explain, MARGIN};
pub use cost::{
    block_costs, nominal as nominal_figures, pipelined_s, predict, streamed_s, BlockCost, DeviceFigures, Figures,
    ModuleLoad, ModuleTime, OpClass, Prediction, WeightShape, WeightType, Workload,
};
pub use device::{default_device, resolve_device, Device, DeviceProfile, DeviceType, ProfileDevice};
pub use error::{Flag, PlanError};
pub use memcheck::{estimate as memory_estimate, gpu_figure, MemoryCheck, Verdict};
pub use model::{Component, ModelDescription, Module, SourceFile, Tensor};
pub use plan::{
    plan, DeviceUsage, ModulePlan, ParamsHome, Plan, PlanRequest, PredictedTime, SplitKind, SplitRange,
    PLAN_SCHEMA_VERSION,
};
pub use spec::{
    parse_auto_fit, parse_auto_fit_mode, parse_backend, parse_max_vram, parse_params_backend, parse_pipeline_copies,
    parse_split_by, parse_split_mode, Assignment, AutoFitMode, Entry, Flags, MaxVram, ParamsValue, RuntimeValue,
    SplitBy, SplitMode, PIPELINE_COPIES_ENV,
};
pub use split::{partition as layer_partition, partition_by_speed as layer_partition_by_speed};
pub use units::{fmt_bytes, GIB, MIB};
