//! Devices as plain data, device profiles parsed from TOML text, and device-name resolution.
//!
//! Resolution follows stable-diffusion.cpp's `docs/backend.md` "Backend names": case-insensitive exact name, else a unique
//! prefix; `auto`/`default`/empty select the default device (GPU, then integrated GPU, then CPU);
//! `gpu` selects the first GPU, else the first integrated GPU. As a last resort before "unknown
//! device", a token equal to a backend registry name (`metal` also matching `MTL`) selects that
//! registry's first device, so `metal` works on devices named `MTL0` as it does upstream.

use serde::{Deserialize, Serialize};

use crate::error::{Flag, PlanError};
use crate::MIB;

/// The kind of a device, as ggml reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceType {
    /// The host CPU; its memory is system RAM.
    Cpu,
    /// A discrete GPU with its own memory.
    Gpu,
    /// An integrated GPU using host memory.
    Igpu,
    /// An accelerator without its own memory (BLAS, ...).
    Accel,
}

impl DeviceType {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            DeviceType::Cpu => "cpu",
            DeviceType::Gpu => "gpu",
            DeviceType::Igpu => "igpu",
            DeviceType::Accel => "accel",
        }
    }
}

/// One device the planner may use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    /// Device name as ggml lists it (`CPU`, `CUDA0`, `Vulkan1`, ...).
    pub name: String,
    /// Its kind.
    #[serde(rename = "type")]
    pub kind: DeviceType,
    /// Name of the backend registry it belongs to (`CUDA`, `Vulkan`...). Empty: derived from the
    /// name by dropping trailing digits.
    #[serde(default)]
    pub registry: String,
    /// Free memory in bytes, when reported.
    #[serde(default)]
    pub free_bytes: Option<u64>,
    /// Total memory in bytes, when reported.
    #[serde(default)]
    pub total_bytes: Option<u64>,
    /// Whether the backend exports a row-split buffer type for this device.
    #[serde(default)]
    pub row_split: bool,
}

impl Device {
    /// A device with the given kind and no memory figures.
    pub fn new(name: impl Into<String>, kind: DeviceType) -> Self {
        Device {
            name: name.into(),
            kind,
            registry: String::new(),
            free_bytes: None,
            total_bytes: None,
            row_split: false,
        }
    }

    /// The CPU device, named `CPU` as ggml names it.
    pub fn cpu() -> Self {
        Device::new("CPU", DeviceType::Cpu)
    }

    /// A discrete GPU with `free` of `total` bytes.
    pub fn gpu(name: impl Into<String>, free: u64, total: u64) -> Self {
        Device::new(name, DeviceType::Gpu).with_memory(Some(free), Some(total))
    }

    /// Sets the memory figures.
    pub fn with_memory(mut self, free: Option<u64>, total: Option<u64>) -> Self {
        self.free_bytes = free;
        self.total_bytes = total;
        self
    }

    /// Sets the registry name.
    pub fn with_registry(mut self, registry: impl Into<String>) -> Self {
        self.registry = registry.into();
        self
    }

    /// Sets the row-split capability.
    pub fn with_row_split(mut self, row_split: bool) -> Self {
        self.row_split = row_split;
        self
    }

    /// The registry name: `registry`, or the name without trailing digits.
    pub fn registry_name(&self) -> String {
        if !self.registry.trim().is_empty() {
            return self.registry.trim().to_string();
        }
        self.name.trim_end_matches(|c: char| c.is_ascii_digit()).to_string()
    }

    /// The memory figure the planner starts from: free memory, or total when free is not
    /// reported (a runtime without a budget reports its total as free).
    pub(crate) fn free_figure(&self) -> Option<u64> {
        self.free_bytes.or(self.total_bytes)
    }
}

/// A device profile: hypothetical devices and RAM, written in TOML.
///
/// ```toml
/// ram_available_mib = 32768
/// [[device]]
/// name = "CUDA0"
/// type = "gpu"        # cpu | gpu | igpu | accel
/// free_mib = 8192
/// total_mib = 8192
/// row_split = true    # optional, default false
/// registry = "CUDA"   # optional, default: the name without trailing digits
/// speed_mib_s = 2000  # optional: MiB of block weights evaluated per second (--split-by speed)
/// [device.cost]       # optional: the cost model's figures (DeviceFigures), e.g.
/// matmul_f16 = 2e13   # FLOP/s
/// link_bytes_per_s = 1.2e10
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceProfile {
    /// Available system RAM in MiB; absent = unknown.
    #[serde(default)]
    pub ram_available_mib: Option<u64>,
    /// The devices, in listing order.
    #[serde(default, rename = "device")]
    pub devices: Vec<ProfileDevice>,
}

/// One `[[device]]` of a profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileDevice {
    /// Device name.
    pub name: String,
    /// Its kind.
    #[serde(rename = "type")]
    pub kind: DeviceType,
    /// Free memory in MiB.
    #[serde(default)]
    pub free_mib: Option<u64>,
    /// Total memory in MiB.
    #[serde(default)]
    pub total_mib: Option<u64>,
    /// Row-split capability.
    #[serde(default)]
    pub row_split: bool,
    /// Registry name.
    #[serde(default)]
    pub registry: Option<String>,
    /// Measured speed in MiB of block weights evaluated per second (see
    /// [`crate::PlanRequest::device_speeds`]); a positive number.
    #[serde(default)]
    pub speed_mib_s: Option<f64>,
    /// The cost model's figures ([`crate::DeviceFigures`], a `[device.cost]` table), for
    /// predicting plans on devices this machine does not have.
    #[serde(default)]
    pub cost: Option<crate::DeviceFigures>,
}

impl DeviceProfile {
    /// Parses a profile from TOML text (no file access: the caller reads the file).
    pub fn from_toml_str(text: &str) -> Result<DeviceProfile, PlanError> {
        let profile: DeviceProfile = toml::from_str(text)
            .map_err(|e| PlanError::InvalidProfile { reason: e.to_string().trim_end().to_string() })?;
        validate_names(profile.devices.iter().map(|d| d.name.as_str()))
            .map_err(|reason| PlanError::InvalidProfile { reason })?;
        if let Some(d) = profile.devices.iter().find(|d| d.speed_mib_s.is_some_and(|v| !v.is_finite() || v <= 0.0)) {
            return Err(PlanError::InvalidProfile {
                reason: format!(
                    "device '{}': speed_mib_s = {} is not a positive number of MiB per second",
                    d.name.trim(),
                    d.speed_mib_s.unwrap_or_default()
                ),
            });
        }
        for d in &profile.devices {
            if let Some(Err(reason)) = d.cost.as_ref().map(crate::DeviceFigures::check) {
                return Err(PlanError::InvalidProfile {
                    reason: format!("device '{}': [device.cost]: {reason}", d.name.trim()),
                });
            }
        }
        Ok(profile)
    }

    /// The speeds the profile gives, in bytes of block weights per second, by device name
    /// (for [`crate::PlanRequest::device_speeds`]).
    pub fn device_speeds(&self) -> std::collections::BTreeMap<String, f64> {
        self.devices.iter().filter_map(|d| d.speed_mib_s.map(|v| (d.name.trim().to_string(), v * MIB as f64))).collect()
    }

    /// Available RAM in bytes.
    pub fn ram_available_bytes(&self) -> Option<u64> {
        self.ram_available_mib.map(|m| m.saturating_mul(MIB))
    }

    /// The devices; a `CPU` device is appended when the profile lists none of type `cpu`.
    pub fn devices(&self) -> Vec<Device> {
        let mut out: Vec<Device> = self
            .devices
            .iter()
            .map(|d| Device {
                name: d.name.trim().to_string(),
                kind: d.kind,
                registry: d.registry.clone().unwrap_or_default(),
                free_bytes: d.free_mib.map(|m| m.saturating_mul(MIB)),
                total_bytes: d.total_mib.map(|m| m.saturating_mul(MIB)),
                row_split: d.row_split,
            })
            .collect();
        if !out.iter().any(|d| d.kind == DeviceType::Cpu) {
            let mut cpu = Device::cpu();
            cpu.free_bytes = self.ram_available_bytes();
            out.push(cpu);
        }
        out
    }
}

/// Device names must be non-empty, unique (case-insensitively) and free of the characters the
/// placement language uses (`,` `=` `&`), or they could not be named in a flag.
pub(crate) fn validate_names<'a>(names: impl Iterator<Item = &'a str>) -> Result<(), String> {
    let mut seen: Vec<String> = Vec::new();
    for name in names {
        let trimmed = name.trim();
        if trimmed.is_empty() {
            return Err("a device has an empty name".to_string());
        }
        if trimmed.contains([',', '=', '&']) {
            return Err(format!(
                "device name '{trimmed}' contains one of ',', '=' or '&', which the placement language reserves"
            ));
        }
        let lower = trimmed.to_lowercase();
        if seen.contains(&lower) {
            return Err(format!("device name '{trimmed}' is listed twice"));
        }
        seen.push(lower);
    }
    Ok(())
}

/// Whether `token` is one of the default-device spellings (`auto`, `default`, empty).
pub(crate) fn is_default_token(token: &str) -> bool {
    let t = token.trim();
    t.is_empty() || t.eq_ignore_ascii_case("auto") || t.eq_ignore_ascii_case("default")
}

/// Whether `token` is `disk`.
pub(crate) fn is_disk_token(token: &str) -> bool {
    token.trim().eq_ignore_ascii_case("disk")
}

/// The default device: first GPU, then first integrated GPU, then first CPU.
pub fn default_device(devices: &[Device]) -> Option<usize> {
    [DeviceType::Gpu, DeviceType::Igpu, DeviceType::Cpu]
        .into_iter()
        .find_map(|kind| devices.iter().position(|d| d.kind == kind))
}

/// Resolves a device token against `devices`; `flag` and `entry` (the whole assignment, e.g.
/// `te=cuda9`) only feed the error message.
pub fn resolve_device(devices: &[Device], token: &str, flag: Flag, entry: &str) -> Result<usize, PlanError> {
    let t = token.trim();
    let lower = t.to_lowercase();
    if is_default_token(t) {
        return default_device(devices).ok_or_else(|| PlanError::NoSuchDeviceType {
            flag,
            token: t.to_string(),
            wanted: "the default device (a GPU, an integrated GPU or the CPU)",
            available: list_names(devices),
        });
    }
    if lower == "gpu" {
        return [DeviceType::Gpu, DeviceType::Igpu]
            .into_iter()
            .find_map(|kind| devices.iter().position(|d| d.kind == kind))
            .ok_or_else(|| PlanError::NoSuchDeviceType {
                flag,
                token: t.to_string(),
                wanted: "a GPU or an integrated GPU",
                available: list_names(devices),
            });
    }
    if let Some(i) = devices.iter().position(|d| d.name.trim().to_lowercase() == lower) {
        return Ok(i);
    }
    let prefixed: Vec<usize> = devices
        .iter()
        .enumerate()
        .filter(|(_, d)| d.name.trim().to_lowercase().starts_with(&lower))
        .map(|(i, _)| i)
        .collect();
    match prefixed.len() {
        1 => return Ok(prefixed[0]),
        0 => {}
        _ => {
            return Err(PlanError::AmbiguousDevice {
                flag,
                token: t.to_string(),
                entry: entry.trim().to_string(),
                candidates: prefixed.iter().map(|&i| devices[i].name.trim()).collect::<Vec<_>>().join(", "),
            })
        }
    }
    let registry = if lower == "metal" { "mtl".to_string() } else { lower.clone() };
    if let Some(i) = devices.iter().position(|d| {
        let r = d.registry_name().to_lowercase();
        r == lower || r == registry
    }) {
        return Ok(i);
    }
    Err(PlanError::UnknownDevice {
        flag,
        token: t.to_string(),
        entry: entry.trim().to_string(),
        available: list_names(devices),
    })
}

fn list_names(devices: &[Device]) -> String {
    if devices.is_empty() {
        return "(none)".to_string();
    }
    devices.iter().map(|d| format!("{} ({})", d.name.trim(), d.kind.name())).collect::<Vec<_>>().join(", ")
}
