//! The crate's one error type: every message names the offending token and what is accepted.

use crate::spec::clip;
use crate::units::fmt_bytes;

/// The flag an error comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flag {
    /// `--backend` (after the compatibility flags are prepended).
    Backend,
    /// `--params-backend` (after `--offload-to-cpu` is prepended).
    ParamsBackend,
    /// `--split-mode`.
    SplitMode,
    /// `--max-vram`.
    MaxVram,
    /// `--auto-fit`.
    AutoFit,
}

impl std::fmt::Display for Flag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Flag::Backend => "--backend",
            Flag::ParamsBackend => "--params-backend",
            Flag::SplitMode => "--split-mode",
            Flag::MaxVram => "--max-vram",
            Flag::AutoFit => "--auto-fit",
        })
    }
}

/// Why a plan could not be made (bad input), or why a model must not be loaded (memory check).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// A module key that is not in the alias table of stable-diffusion.cpp's `docs/backend.md`.
    #[error("{flag}: unknown module '{}' in '{}'; accepted modules: {accepted}", clip(token), clip(entry))]
    UnknownModule {
        /// Flag.
        flag: Flag,
        /// The module key as written.
        token: String,
        /// The whole assignment.
        entry: String,
        /// Accepted names.
        accepted: String,
    },
    /// A device name matching no device.
    #[error(
        "{flag}: unknown device '{}'{}; available devices: {available}; \
         special values: auto, default, gpu (and disk for --params-backend)",
        clip(token), if token == entry { String::new() } else { format!(" in '{}'", clip(entry)) }
    )]
    UnknownDevice {
        /// Flag.
        flag: Flag,
        /// The device token.
        token: String,
        /// The whole assignment.
        entry: String,
        /// The device list.
        available: String,
    },
    /// A prefix of several device names.
    #[error(
        "{flag}: device name '{token}' in '{entry}' is ambiguous: it is a prefix of {candidates}; \
         write one of them in full"
    )]
    AmbiguousDevice {
        /// Flag.
        flag: Flag,
        /// The device token.
        token: String,
        /// The whole assignment.
        entry: String,
        /// Matching device names.
        candidates: String,
    },
    /// `auto`/`gpu` with no device of that kind.
    #[error("{flag}: '{token}' selects {wanted}, but there is none; available devices: {available}")]
    NoSuchDeviceType {
        /// Flag.
        flag: Flag,
        /// The token.
        token: String,
        /// What the token selects.
        wanted: &'static str,
        /// The device list.
        available: String,
    },
    /// `disk` given as a runtime backend.
    #[error(
        "--backend: 'disk' in '{entry}' is not a runtime backend: disk is a parameter residency \
         mode, accepted only by --params-backend (e.g. --params-backend diffusion=disk)"
    )]
    DiskAsRuntime {
        /// The whole assignment.
        entry: String,
    },
    /// A `&` device list where none is allowed.
    #[error("{flag}: device list '{token}' in '{entry}' is not allowed: {reason}")]
    DeviceListNotAllowed {
        /// Flag.
        flag: Flag,
        /// The list as written.
        token: String,
        /// The whole assignment.
        entry: String,
        /// What is allowed instead.
        reason: String,
    },
    /// A malformed `&` list (empty, or holding a default token).
    #[error("{flag}: invalid device list '{token}' in '{entry}': {reason}")]
    InvalidDeviceList {
        /// Flag.
        flag: Flag,
        /// The list as written.
        token: String,
        /// The whole assignment.
        entry: String,
        /// What is wrong.
        reason: String,
    },
    /// `key=` or `=value`.
    #[error("{flag}: invalid assignment '{entry}': {reason}")]
    InvalidAssignment {
        /// Flag.
        flag: Flag,
        /// The whole assignment.
        entry: String,
        /// What is wrong and what is accepted.
        reason: String,
    },
    /// A `--max-vram` value that is not a finite decimal number.
    #[error(
        "{flag}: malformed number '{token}' in '{entry}'; expected GiB as a decimal number such \
         as 6, 0.5, 0 (free memory) or -1 (free memory minus 1 GiB)"
    )]
    MalformedNumber {
        /// Flag.
        flag: Flag,
        /// The number as written.
        token: String,
        /// The whole assignment.
        entry: String,
    },
    /// `--auto-fit` other than on/off.
    #[error("--auto-fit: invalid value '{token}'; accepted: on, off, ladder")]
    InvalidAutoFit {
        /// The value.
        token: String,
    },
    /// A device's cost figures are not usable numbers.
    #[error("cost figures of device '{device}': {reason}")]
    InvalidFigures {
        /// The device.
        device: String,
        /// What is wrong.
        reason: String,
    },
    /// A split mode other than layer/row.
    #[error("--split-mode: invalid mode '{token}' in '{entry}'; accepted: layer, row")]
    InvalidSplitMode {
        /// The mode as written.
        token: String,
        /// The whole assignment.
        entry: String,
    },
    /// A `--split-by` value other than memory/speed.
    #[error("--split-by: invalid value '{token}'; accepted: memory (the default: ranges sized by free memory), speed (ranges sized so that the devices finish together)")]
    InvalidSplitBy {
        /// The value as written.
        token: String,
    },
    /// A pipeline copy count that is not a positive integer.
    #[error("{origin}: invalid value '{token}'; expected a positive integer (1, the default, keeps no extra copies; 2 overlaps two micro-batches)")]
    InvalidPipelineCopies {
        /// `--pipeline-copies` or the environment variable `SD_PIPELINE_COPIES`.
        origin: &'static str,
        /// The value as written.
        token: String,
    },
    /// A pipeline copy count whose compute reserve breaks a budget that one copy fits.
    #[error(
        "{setting}: {device} would need {} ({} of it compute reserve for {copies} copies) but its budget is {}; at most {max_copies} copies fit",
        fmt_bytes(*.needed_bytes), fmt_bytes(*.compute_bytes), fmt_bytes(*.budget_bytes)
    )]
    TooManyPipelineCopies {
        /// Where the count comes from, as written: `--pipeline-copies 8` or `SD_PIPELINE_COPIES=8`.
        setting: String,
        /// The copy count asked for.
        copies: u32,
        /// The first device over its budget.
        device: String,
        /// What it would need.
        needed_bytes: u64,
        /// The compute part of it.
        compute_bytes: u64,
        /// Its budget.
        budget_bytes: u64,
        /// The largest count that fits every budget.
        max_copies: u32,
    },
    /// A device listed twice in one module's `&` list (after name resolution: `cpu&CPU`).
    #[error(
        "--backend: '{}' lists {device} twice for {module}; list each device once (e.g. {module}=A&B)",
        clip(entry)
    )]
    DuplicateSplitDevice {
        /// The module.
        module: String,
        /// The device, as listed by the device list.
        device: String,
        /// The whole assignment.
        entry: String,
    },
    /// A layer split in which a listed device would hold no block.
    #[error("--backend: '{}': {device} would receive no block of {module} ({reason}); {hint}", clip(entry))]
    EmptySplitRange {
        /// The module.
        module: String,
        /// The device left without a block.
        device: String,
        /// The whole assignment.
        entry: String,
        /// Why: too few blocks, or too little memory.
        reason: String,
        /// What to do instead.
        hint: String,
    },
    /// A device speed given to [`crate::plan`] that is not a positive finite number.
    #[error(
        "device speeds: {device} has speed {value}; expected a positive finite number of block-weight bytes per second"
    )]
    InvalidSpeed {
        /// The device name as given.
        device: String,
        /// The value.
        value: f64,
    },
    /// A device profile that does not parse or validate.
    #[error("device profile: {reason}")]
    InvalidProfile {
        /// What is wrong.
        reason: String,
    },
    /// A device list given to [`crate::plan`] that does not validate.
    #[error("device list: {reason}")]
    InvalidDevices {
        /// What is wrong.
        reason: String,
    },
    /// The pre-load memory check refuses the model.
    #[error(
        "model refused by the memory check: estimated {} (file sizes x 1.25 + 512 MiB) exceeds \
         {} ({}) on {device}; pass --no-memory-check to load anyway",
        fmt_bytes(*.estimate_bytes), fmt_bytes(*.limit_bytes), .figures
    )]
    MemoryRefused {
        /// The estimate.
        estimate_bytes: u64,
        /// The figure it was compared with.
        limit_bytes: u64,
        /// How that figure is made up.
        figures: String,
        /// The device the model loads on.
        device: String,
    },
}
