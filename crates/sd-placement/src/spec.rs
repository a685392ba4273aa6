//! The placement language: `--backend`, `--params-backend`, `--split-mode`, `--split-by`,
//! `--pipeline-copies`, `--max-vram`, `--auto-fit` and the compatibility flags, parsed into plain values.
//!
//! Parsing is in two steps so that it can be fuzzed and reused without devices: the functions
//! here check syntax, module names (the alias table of stable-diffusion.cpp's `docs/backend.md`) and the structural rules (`&`
//! lists only for diffusion and te, none in `--params-backend`, `disk` only for params); device
//! tokens stay strings until [`crate::plan`] resolves them against the device list.
//!
//! Syntax (backend.md "Syntax"): comma-separated entries; an entry without `=` (or with key
//! `all`, `default` or `*`) sets the default for every module without a more specific entry;
//! `module=value` sets one module. Later entries override earlier ones for the same key, which is
//! what lets explicit entries override the compatibility flags that are prepended.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::device::{is_default_token, is_disk_token};
use crate::error::{Flag, PlanError};
use crate::model::Module;

/// The raw flag values, exactly as given on a command line (`None` = flag absent).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Flags {
    /// `--backend`.
    pub backend: Option<String>,
    /// `--params-backend`.
    pub params_backend: Option<String>,
    /// `--split-mode`.
    pub split_mode: Option<String>,
    /// `--split-by` ([sd-rs]): `memory` (default) or `speed`, how a layer split sizes its ranges.
    pub split_by: Option<String>,
    /// `--pipeline-copies` ([sd-rs]): copies of each cross-device input a layer-split module keeps.
    pub pipeline_copies: Option<String>,
    /// The environment variable [`PIPELINE_COPIES_ENV`] as the caller read it (no environment
    /// access here); `--pipeline-copies` wins over it.
    pub pipeline_copies_env: Option<String>,
    /// `--max-vram`.
    pub max_vram: Option<String>,
    /// `--auto-fit` (`on` or `off`).
    pub auto_fit: Option<String>,
    /// `--clip-on-cpu`: prepends `te=cpu` to `--backend`.
    pub clip_on_cpu: bool,
    /// `--vae-on-cpu`: prepends `vae=cpu` to `--backend`.
    pub vae_on_cpu: bool,
    /// `--control-net-cpu`: prepends `controlnet=cpu` to `--backend`.
    pub control_net_cpu: bool,
    /// `--offload-to-cpu`: prepends `*=cpu` to `--params-backend`.
    pub offload_to_cpu: bool,
    /// `--no-memory-check`: load without the pre-load memory check or its warning.
    pub no_memory_check: bool,
}

impl Flags {
    /// `--backend` with the compatibility flags prepended ("The example argument layer prepends
    /// te=cpu, vae=cpu, and controlnet=cpu to --backend").
    pub fn effective_backend(&self) -> String {
        let mut parts: Vec<&str> = Vec::new();
        if self.clip_on_cpu {
            parts.push("te=cpu");
        }
        if self.vae_on_cpu {
            parts.push("vae=cpu");
        }
        if self.control_net_cpu {
            parts.push("controlnet=cpu");
        }
        join_prepended(parts, self.backend.as_deref())
    }

    /// `--params-backend` with `*=cpu` prepended for `--offload-to-cpu`.
    pub fn effective_params_backend(&self) -> String {
        let parts = if self.offload_to_cpu { vec!["*=cpu"] } else { Vec::new() };
        join_prepended(parts, self.params_backend.as_deref())
    }
}

impl Flags {
    /// `--backend` parsed: the compatibility flags' entries, overridden by the user's own
    /// string, in which each module may appear once ([`parse_backend`]).
    pub fn backend_assignment(&self) -> Result<Assignment<RuntimeValue>, PlanError> {
        let prefix = Flags { backend: None, ..self.clone() }.effective_backend();
        let mut a = parse_backend(&prefix)?;
        a.overlay(parse_backend(self.backend.as_deref().unwrap_or(""))?);
        Ok(a)
    }

    /// `--params-backend` parsed likewise (`--offload-to-cpu`'s `*=cpu`, then the user's).
    pub fn params_assignment(&self) -> Result<Assignment<ParamsValue>, PlanError> {
        let prefix = Flags { params_backend: None, ..self.clone() }.effective_params_backend();
        let mut a = parse_params_backend(&prefix)?;
        a.overlay(parse_params_backend(self.params_backend.as_deref().unwrap_or(""))?);
        Ok(a)
    }
}

fn join_prepended<'a>(mut parts: Vec<&'a str>, user: Option<&'a str>) -> String {
    if let Some(u) = user {
        if !u.trim().is_empty() {
            parts.push(u);
        }
    }
    parts.join(",")
}

/// One assignment with the entry it came from (for error messages).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry<T> {
    /// The parsed value.
    pub value: T,
    /// The entry as written, e.g. `te=cuda0`.
    pub entry: String,
}

/// A parsed assignment: a default and per-module overrides.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment<T> {
    /// Set by a bare value or `all=`/`default=`/`*=` (the last one wins).
    pub default: Option<Entry<T>>,
    /// Per-module values (the last one per module wins).
    pub modules: BTreeMap<Module, Entry<T>>,
}

impl<T> Default for Assignment<T> {
    fn default() -> Self {
        Assignment { default: None, modules: BTreeMap::new() }
    }
}

impl<T> Assignment<T> {
    /// The value for `module`: its own entry, else the default.
    pub fn get(&self, module: Module) -> Option<&Entry<T>> {
        self.modules.get(&module).or(self.default.as_ref())
    }

    /// Entries of `later` replace those of `self` for the same key.
    fn overlay(&mut self, later: Assignment<T>) {
        if later.default.is_some() {
            self.default = later.default;
        }
        self.modules.extend(later.modules);
    }

    /// Whether nothing was assigned.
    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.modules.is_empty()
    }
}

/// A `--backend` value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RuntimeValue {
    /// One device token (may be `auto`, `default`, `gpu`, a name or a prefix).
    Device(String),
    /// `a&b...`: layer or row split (diffusion and te only), at least two tokens.
    List(Vec<String>),
}

/// A `--params-backend` value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ParamsValue {
    /// One device token.
    Device(String),
    /// Reload from the model file on demand.
    Disk,
}

/// How a multi-device module distributes its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitMode {
    /// Contiguous block ranges per device (the default).
    Layer,
    /// Block matmul weights sliced by rows across the devices.
    Row,
}

/// How a layer split sizes its block ranges (`--split-by`). One value for the whole plan, not
/// per module: the speeds it uses are per device, and a plan splits at most diffusion and te.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitBy {
    /// In proportion to each device's memory basis (backend.md's rule, the default).
    #[default]
    Memory,
    /// So that every device's range takes the same time, within each device's memory basis.
    Speed,
}

impl SplitBy {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            SplitBy::Memory => "memory",
            SplitBy::Speed => "speed",
        }
    }
}

/// The environment variable that sets `--pipeline-copies` when the flag is absent.
pub const PIPELINE_COPIES_ENV: &str = "SD_PIPELINE_COPIES";

/// Parses `--split-by`: absent = `memory`; `memory` or `speed` (case-insensitive).
pub fn parse_split_by(value: Option<&str>) -> Result<SplitBy, PlanError> {
    match value.map(|v| v.trim().to_lowercase()).as_deref() {
        None | Some("memory") => Ok(SplitBy::Memory),
        Some("speed") => Ok(SplitBy::Speed),
        Some(_) => Err(PlanError::InvalidSplitBy { token: clip(value.unwrap_or_default()) }),
    }
}

/// Parses the pipeline copy count: `--pipeline-copies` when given, else the environment
/// variable's value (an empty variable counts as unset), else 1. A positive decimal integer.
pub fn parse_pipeline_copies(flag: Option<&str>, env: Option<&str>) -> Result<u32, PlanError> {
    let (origin, value) = match (flag, env.filter(|v| !v.trim().is_empty())) {
        (Some(f), _) => ("--pipeline-copies", f),
        (None, Some(e)) => (PIPELINE_COPIES_ENV, e),
        (None, None) => return Ok(1),
    };
    let t = value.trim();
    match t.parse::<u32>() {
        Ok(n) if n > 0 && t.chars().all(|c| c.is_ascii_digit()) => Ok(n),
        _ => Err(PlanError::InvalidPipelineCopies { origin, token: clip(value) }),
    }
}

/// Key of one entry: the default or a module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
    Default,
    Module(Module),
}

struct RawEntry {
    key: Key,
    value: String,
    entry: String,
}

fn is_default_key(key: &str) -> bool {
    let k = key.trim().to_lowercase();
    k == "all" || k == "default" || k == "*"
}

/// `s` cut to 60 characters for a message (a 100 KB flag value is not echoed whole).
pub(crate) fn clip(s: &str) -> String {
    const MAX: usize = 60;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}... ({} bytes)", &s[..i], s.len()),
        None => s.to_string(),
    }
}

/// Fails on an empty part of a non-empty comma list (`a,,b`, `a,`, `,a`).
fn check_no_empty_part(flag: Flag, spec: &str) -> Result<(), PlanError> {
    if spec.trim().is_empty() || spec.split(',').all(|p| !p.trim().is_empty()) {
        return Ok(());
    }
    Err(PlanError::InvalidAssignment {
        flag,
        entry: clip(spec),
        reason: "it has an empty entry (two commas in a row, or a comma at either end)".into(),
    })
}

/// Splits `spec` into entries; checks keys. An empty spec has no entries; an empty entry in
/// a non-empty one, or one key given two different values, is an error (later entries override only the
/// entries the compatibility flags prepend, see [`Flags::backend_assignment`]).
fn parse_entries(flag: Flag, spec: &str) -> Result<Vec<RawEntry>, PlanError> {
    check_no_empty_part(flag, spec)?;
    let mut out: Vec<RawEntry> = Vec::new();
    for part in spec.split(',') {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        let Some((key, value)) = part.split_once('=') else {
            out.push(RawEntry { key: Key::Default, value: part.to_string(), entry: part.to_string() });
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        if key.is_empty() {
            return Err(PlanError::InvalidAssignment {
                flag,
                entry: part.to_string(),
                reason: "missing module name before '='; write MODULE=VALUE or all=VALUE".into(),
            });
        }
        if value.is_empty() {
            return Err(PlanError::InvalidAssignment {
                flag,
                entry: part.to_string(),
                reason: format!("missing value after '='; write {key}=VALUE (or {key}=auto for the default device)"),
            });
        }
        let key = if is_default_key(key) {
            Key::Default
        } else {
            match Module::parse(key) {
                Some(m) => Key::Module(m),
                None => {
                    return Err(PlanError::UnknownModule {
                        flag,
                        token: key.to_string(),
                        entry: part.to_string(),
                        accepted: Module::accepted_names(),
                    })
                }
            }
        };
        out.push(RawEntry { key, value: value.to_string(), entry: part.to_string() });
    }
    for (i, later) in out.iter().enumerate() {
        // The same value twice (`clip=cpu,t5xxl=cpu`: two aliases of te) is redundant, not a conflict.
        let conflict = |e: &&RawEntry| e.key == later.key && !e.value.eq_ignore_ascii_case(&later.value);
        if let Some(first) = out[..i].iter().find(conflict) {
            let what = match later.key {
                Key::Default => "the default (a bare device, all=, default= or *=)".to_string(),
                Key::Module(m) => format!("module {m}"),
            };
            return Err(PlanError::InvalidAssignment {
                flag,
                entry: clip(&later.entry),
                reason: format!("{what} is already assigned by '{}'; give each module once", clip(&first.entry)),
            });
        }
    }
    Ok(out)
}

fn insert<T>(a: &mut Assignment<T>, key: Key, value: T, entry: String) {
    let e = Entry { value, entry };
    match key {
        Key::Default => a.default = Some(e),
        Key::Module(m) => {
            a.modules.insert(m, e);
        }
    }
}

/// Parses `--backend` (after compatibility flags): single names, per-module entries, `&` lists.
pub fn parse_backend(spec: &str) -> Result<Assignment<RuntimeValue>, PlanError> {
    let flag = Flag::Backend;
    let mut a = Assignment::default();
    for raw in parse_entries(flag, spec)? {
        let value = if raw.value.contains('&') {
            let module_ok = matches!(raw.key, Key::Module(m) if m.accepts_device_list());
            if !module_ok {
                let reason = match raw.key {
                    Key::Module(m) => format!(
                        "module {m} accepts only a single device; only diffusion and te accept '&' lists (layer/row split)"
                    ),
                    Key::Default => "a default applies to every module, and only diffusion and te accept '&' lists; write diffusion=A&B or te=A&B".to_string(),
                };
                return Err(PlanError::DeviceListNotAllowed {
                    flag,
                    token: raw.value.clone(),
                    entry: raw.entry.clone(),
                    reason,
                });
            }
            let names: Vec<String> = raw.value.split('&').map(str::trim).map(str::to_string).collect();
            let list_error = |reason: String| PlanError::InvalidDeviceList {
                flag,
                token: clip(&raw.value),
                entry: clip(&raw.entry),
                reason,
            };
            if names.iter().any(String::is_empty) {
                return Err(list_error(
                    "it has an empty device name (a '&' at either end or two in a row); write e.g. cuda0&cuda1".into(),
                ));
            }
            for n in &names {
                if is_disk_token(n) {
                    return Err(PlanError::DiskAsRuntime { entry: raw.entry.clone() });
                }
                if is_default_token(n) {
                    return Err(PlanError::InvalidDeviceList {
                        flag,
                        token: raw.value.clone(),
                        entry: raw.entry.clone(),
                        reason: format!("'{n}' (the default device) cannot be part of a device list; name the devices"),
                    });
                }
            }
            if names.len() == 1 {
                RuntimeValue::Device(names.into_iter().next().unwrap_or_default())
            } else {
                RuntimeValue::List(names)
            }
        } else {
            if is_disk_token(&raw.value) {
                return Err(PlanError::DiskAsRuntime { entry: raw.entry.clone() });
            }
            RuntimeValue::Device(raw.value.clone())
        };
        insert(&mut a, raw.key, value, raw.entry);
    }
    Ok(a)
}

/// Parses `--params-backend` (after `--offload-to-cpu`): device names or `disk`, no lists.
pub fn parse_params_backend(spec: &str) -> Result<Assignment<ParamsValue>, PlanError> {
    let flag = Flag::ParamsBackend;
    let mut a = Assignment::default();
    for raw in parse_entries(flag, spec)? {
        if raw.value.contains('&') {
            return Err(PlanError::DeviceListNotAllowed {
                flag,
                token: raw.value.clone(),
                entry: raw.entry.clone(),
                reason: "--params-backend accepts no device lists; with a layer split each block range's params follow its device when params are not assigned".into(),
            });
        }
        let value = if is_disk_token(&raw.value) { ParamsValue::Disk } else { ParamsValue::Device(raw.value.clone()) };
        insert(&mut a, raw.key, value, raw.entry);
    }
    Ok(a)
}

/// Parses `--split-mode`: `layer` or `row`, single or per module.
pub fn parse_split_mode(spec: &str) -> Result<Assignment<SplitMode>, PlanError> {
    let mut a = Assignment::default();
    for raw in parse_entries(Flag::SplitMode, spec)? {
        let mode = match raw.value.trim().to_lowercase().as_str() {
            "layer" => SplitMode::Layer,
            "row" => SplitMode::Row,
            _ => return Err(PlanError::InvalidSplitMode { token: raw.value.clone(), entry: raw.entry.clone() }),
        };
        insert(&mut a, raw.key, mode, raw.entry);
    }
    Ok(a)
}

/// A parsed `--max-vram`: GiB values, device keys not yet resolved.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MaxVram {
    /// A bare number or `all=`/`default=`/`*=`.
    pub default: Option<f64>,
    /// `device=GiB` entries in order, keys as written.
    pub devices: Vec<Entry<(String, f64)>>,
}

/// Parses `--max-vram` (`6`, `-1`, `0`, `cuda0=6,vulkan0=2`, `all=4,cuda1=-1`).
pub fn parse_max_vram(spec: &str) -> Result<MaxVram, PlanError> {
    let flag = Flag::MaxVram;
    check_no_empty_part(flag, spec)?;
    let mut out = MaxVram::default();
    let mut default_entry: Option<String> = None;
    for part in spec.split(',') {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        let twice = |first: &str| PlanError::InvalidAssignment {
            flag,
            entry: clip(part),
            reason: format!("the same budget is already given by '{}'; give each device once", clip(first)),
        };
        // A key given twice with different values is a conflict (the same value is redundant).
        let (key, value) = match part.split_once('=') {
            Some((k, v)) => (Some(k.trim()), v.trim()),
            None => (None, part),
        };
        let same = |entry: &str| entry.split_once('=').map_or(entry, |(_, v)| v.trim()) == value;
        if key.is_none_or(is_default_key) {
            if let Some(first) = default_entry.as_deref().filter(|f| !same(f)) {
                return Err(twice(first));
            }
            default_entry = Some(part.to_string());
        } else if let Some(first) =
            out.devices.iter().find(|e| key.is_some_and(|k| e.value.0.eq_ignore_ascii_case(k)) && !same(&e.entry))
        {
            return Err(twice(&first.entry));
        }
        match part.split_once('=') {
            None => out.default = Some(parse_gib(part, part)?),
            Some((key, value)) => {
                let (key, value) = (key.trim(), value.trim());
                if key.is_empty() || value.is_empty() {
                    return Err(PlanError::InvalidAssignment {
                        flag,
                        entry: part.to_string(),
                        reason: "write DEVICE=GiB (e.g. cuda0=6), all=GiB or a bare GiB value".into(),
                    });
                }
                let gib = parse_gib(value, part)?;
                if is_default_key(key) {
                    out.default = Some(gib);
                } else {
                    out.devices.push(Entry { value: (key.to_string(), gib), entry: part.to_string() });
                }
            }
        }
    }
    Ok(out)
}

fn parse_gib(token: &str, entry: &str) -> Result<f64, PlanError> {
    let t = token.trim();
    let ok_chars = !t.is_empty() && t.chars().all(|c| c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E'));
    match t.parse::<f64>() {
        Ok(v) if ok_chars && v.is_finite() => Ok(v),
        _ => Err(PlanError::MalformedNumber { flag: Flag::MaxVram, token: t.to_string(), entry: entry.to_string() }),
    }
}

/// Parses `--auto-fit`: absent = on; `on`, `off` or `ladder` (case-insensitive). `ladder` is
/// auto-fit as the seeds define it (on, never by predicted time).
pub fn parse_auto_fit(value: Option<&str>) -> Result<bool, PlanError> {
    Ok(parse_auto_fit_mode(value)? != AutoFitMode::Off)
}

/// What `--auto-fit` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AutoFitMode {
    /// `off`: explicit placement only.
    Off,
    /// `ladder`: the seeds' first-fit ladder, never replaced by a faster prediction.
    Ladder,
    /// `on` (the default): the ladder, replaced by an alternative predicted faster when device
    /// figures are known ([`crate::plan_by_time`]).
    Time,
}

/// Parses `--auto-fit` into its mode: absent or `on` = [`AutoFitMode::Time`].
pub fn parse_auto_fit_mode(value: Option<&str>) -> Result<AutoFitMode, PlanError> {
    match value.map(|v| v.trim().to_lowercase()) {
        None => Ok(AutoFitMode::Time),
        Some(v) if v == "on" => Ok(AutoFitMode::Time),
        Some(v) if v == "off" => Ok(AutoFitMode::Off),
        Some(v) if v == "ladder" => Ok(AutoFitMode::Ladder),
        Some(_) => Err(PlanError::InvalidAutoFit { token: value.unwrap_or_default().to_string() }),
    }
}
