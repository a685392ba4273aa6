//! A run's machine-readable report (`sd-cli --report-json`): placement, residency, runner work, device memory, stage times.
//!
//! [`RunReport`] is what tests and benchmarks read instead of log lines. Its figures come
//! from where they already live: the placement [`Plan`], the scheduler's reports
//! ([`ModuleReport`], [`RunnerReport`], [`DeviceReport`], read from each runner's
//! `RunStats`, the device ledgers and the weight sets), and the pipeline's own stage
//! timing. It serialises to JSON with serde; byte counts are in bytes, times in seconds.
//!
//! The [`SCHEMA`] version changes whenever a field is renamed, removed or changes meaning
//! (adding a field keeps it); readers check it first.

use sd_placement::Module;
use sd_placement::Plan;
pub use sd_sched::{DeviceReport, HomeReport, ModuleReport, Residency, RunnerReport};
use serde::{Deserialize, Serialize};

use crate::pipeline::Request;

/// The version of the report's layout (see the module docs for when it changes).
pub const SCHEMA: u32 = 1;

/// What a command did, as data.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunReport {
    /// The layout version, [`SCHEMA`].
    pub schema: u32,
    /// `generate` or `plan`.
    pub command: String,
    /// Versions of this program and of ggml.
    pub versions: Versions,
    /// The command line as given (program name left out).
    pub args: Vec<String>,
    /// The generation settings as resolved (model defaults applied); `None` for `plan`.
    pub settings: Option<Settings>,
    /// The placement plan the run followed.
    pub plan: Option<Plan>,
    /// Each module as it ran, in the order it ran (the VAE twice for img2img: its encode
    /// and its decode).
    pub modules: Vec<ModuleReport>,
    /// Each runner's work, in the same order as `modules`.
    pub runners: Vec<RunnerReport>,
    /// Each device's managed memory: high-water mark and budget, taken after the run.
    pub devices: Vec<DeviceReport>,
    /// Wall time of each stage, in the order they ran.
    pub stages: Vec<StageTime>,
    /// Wall time of each sampling step.
    pub steps: Vec<StepTime>,
    /// The cost model's prediction for the plan the run followed (`sd_placement::predict`),
    /// to set beside the measured `steps`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<sd_placement::Prediction>,
    /// Each module's weights as the run used them, in the order they ran: loaded anew or
    /// reused from an earlier run (a server's kept weights), and the bytes staged anew.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub staging: Vec<Staging>,
}

/// The name a run report, the log and a runner give `module`: `te`, `unet` (any diffusion
/// model), `vae`, `controlnet`, and the placement's name for the others. The report's layout
/// ([`SCHEMA`] 1) keeps these; the code names a module by [`Module`] only.
pub fn module_name(module: Module) -> &'static str {
    match module {
        Module::Diffusion => "unet",
        Module::Te => "te",
        Module::Vae => "vae",
        Module::ControlNet => "controlnet",
        other => other.name(),
    }
}

/// One module's weights in one run: what was staged anew and what was reused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Staging {
    /// `te`, `unet` or `vae`.
    pub module: String,
    /// Whether the weights were kept from an earlier run (`Pipeline::generate_keeping`)
    /// rather than loaded for this one.
    pub reused: bool,
    /// Bytes the run put into the module's home copy (RAM or another device: read from the
    /// model files when loaded anew) and uploaded to its computing device (a pinned load,
    /// staging and prefetches): 0 for weights kept pinned on their device, only what the
    /// placement streams by design for parameters kept elsewhere.
    pub staged_bytes: u64,
}

/// A report that cannot be read back.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Not JSON, or not a run report's layout.
    #[error("not a run report")]
    Json(#[source] serde_json::Error),
    /// Written with another layout version.
    #[error("run report schema {found:?}, expected {expected}")]
    Schema {
        /// The `schema` field, if any.
        found: Option<u64>,
        /// [`SCHEMA`].
        expected: u32,
    },
}

/// Versions of the programs that made the report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Versions {
    /// sd-rs (the workspace version).
    pub sd_rs: String,
    /// The ggml release compiled in.
    pub ggml: String,
    /// The crates.io package the ggml source came from.
    pub ggml_package: String,
}

/// Generation settings, as the pipeline ran them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// Image width in pixels (aligned to the model's multiple).
    pub width: usize,
    /// Image height in pixels.
    pub height: usize,
    /// Sampling steps.
    pub steps: usize,
    /// Guidance scale.
    pub cfg_scale: f32,
    /// Sampling method (the reference's name).
    pub sampling_method: String,
    /// Scheduler (the reference's name).
    pub scheduler: String,
    /// Seed of the first image.
    pub seed: u64,
    /// Images generated.
    pub batch_count: usize,
    /// Noise generator.
    pub rng: String,
    /// `--clip-skip` as given (<= 0: the model's default).
    pub clip_skip: i64,
    /// img2img strength; `None` for txt2img.
    pub strength: Option<f32>,
}

/// One stage's wall time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageTime {
    /// `te load`, `text encode`, `vae load (encode)`, `image encode`, `unet load`,
    /// `sampling`, `vae load`, `decode`, `write` (a module's load is its own stage: the
    /// encode and decode stages leave it out).
    pub name: String,
    /// Seconds.
    pub seconds: f64,
}

/// One sampling step's wall time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// Image of the batch, from 0.
    pub image: usize,
    /// Step, from 0.
    pub step: usize,
    /// Seconds.
    pub seconds: f64,
}

impl RunReport {
    /// An empty report of `command`, run with `args`.
    pub fn new(command: &str, args: Vec<String>) -> Self {
        let (ggml, package) = sd_backends::ggml_version();
        Self {
            schema: SCHEMA,
            command: command.to_string(),
            versions: Versions {
                sd_rs: env!("CARGO_PKG_VERSION").to_string(),
                ggml: ggml.to_string(),
                ggml_package: package.to_string(),
            },
            args,
            settings: None,
            plan: None,
            modules: Vec::new(),
            runners: Vec::new(),
            devices: Vec::new(),
            stages: Vec::new(),
            steps: Vec::new(),
            predicted: None,
            staging: Vec::new(),
        }
    }

    /// Records a stage's wall time.
    pub fn stage(&mut self, name: &str, seconds: f64) {
        self.stages.push(StageTime { name: name.to_string(), seconds });
    }

    /// A report read back from JSON; refuses one of another [`SCHEMA`].
    pub fn from_json(text: &str) -> Result<Self, ReportError> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(ReportError::Json)?;
        let found = v.get("schema").and_then(serde_json::Value::as_u64);
        if found != Some(u64::from(SCHEMA)) {
            return Err(ReportError::Schema { found, expected: SCHEMA });
        }
        serde_json::from_value(v).map_err(ReportError::Json)
    }

    /// The last report of the module named `module` (`te`, `unet`, `vae`).
    pub fn module(&self, module: &str) -> Option<&ModuleReport> {
        self.modules.iter().rev().find(|m| m.module == module)
    }

    /// The last report of the runner named `name`.
    pub fn runner(&self, name: &str) -> Option<&RunnerReport> {
        self.runners.iter().rev().find(|r| r.name == name)
    }

    /// Bytes staged anew by the whole run ([`Staging::staged_bytes`] summed).
    pub fn staged_bytes(&self) -> u64 {
        self.staging.iter().map(|s| s.staged_bytes).sum()
    }

    /// The managed memory of `device`.
    pub fn device(&self, device: &str) -> Option<&DeviceReport> {
        self.devices.iter().find(|d| d.device == device)
    }

    /// The report as pretty-printed JSON.
    pub fn to_json(&self) -> String {
        // Serialising plain structs of numbers and strings cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }
}

impl Settings {
    /// The settings of a completed request.
    pub fn of(r: &Request) -> Self {
        let p = r.params();
        Self {
            width: p.width,
            height: p.height,
            steps: p.steps,
            cfg_scale: r.cfg_scale(),
            sampling_method: r.method().name().to_string(),
            scheduler: r.scheduler().name().to_string(),
            seed: p.seed,
            batch_count: p.batch_count,
            rng: p.rng.name().to_string(),
            clip_skip: p.clip_skip,
            strength: p.init_image.as_ref().map(|_| p.strength),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_reads_back_and_another_schema_is_refused() {
        let mut r = RunReport::new("generate", vec!["-p".into(), "a cat".into()]);
        r.stage("decode", 1.5);
        r.devices.push(DeviceReport {
            device: "RPC0".into(),
            budget_bytes: Some(512 << 20),
            high_water_bytes: 500 << 20,
            managed_bytes: 0,
            pressure_evictions: 2,
            pressure_evicted_bytes: 3 << 20,
        });
        let text = r.to_json();
        let back = RunReport::from_json(&text).unwrap();
        assert_eq!((back.schema, back.stages.clone(), back.args.clone()), (SCHEMA, r.stages.clone(), r.args.clone()));
        assert_eq!(back.device("RPC0"), r.devices.first());
        assert_eq!(back.device("CPU"), None);
        assert_eq!(back.versions.sd_rs, env!("CARGO_PKG_VERSION"));
        let other = text.replacen(&format!("\"schema\": {SCHEMA}"), "\"schema\": 999", 1);
        let e = RunReport::from_json(&other).unwrap_err().to_string();
        assert!(e.contains("999") && e.contains(&SCHEMA.to_string()), "{e}");
        assert!(matches!(RunReport::from_json("{}"), Err(ReportError::Schema { found: None, .. })));
        assert!(matches!(RunReport::from_json("not json"), Err(ReportError::Json(_))));
    }
}
