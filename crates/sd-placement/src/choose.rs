//! Auto-fit by predicted time: the seeds' ladder is the baseline and the floor; alternatives the runtime can execute are planned and predicted, and the fastest that fits wins.
//!
//! The alternatives are explicit placements written as the flags a user would type
//! (`--backend`, `--params-backend`), so each one is planned, validated and accounted by
//! [`crate::plan`] exactly as if typed, and the chosen plan's equivalent flags reproduce it:
//! for every computing device (each GPU and the CPU), diffusion on it alone or layer-split
//! with one other device (with one or two pipeline copies when the user set none); the text
//! encoder and the VAE on it or on the CPU; each module's params on its computing device or
//! in RAM. Segment budgets are not varied: a smaller budget for the same placement only
//! streams more. An alternative is chosen only when it fits, is
//! predicted completely ([`crate::cost::predict`]) and is predicted at least [`MARGIN`] faster
//! per generation than the ladder's plan; otherwise the ladder's plan stands. `--auto-fit
//! ladder` keeps the ladder's plan whatever the prediction.

use serde::{Deserialize, Serialize};

use crate::cost::{fmt_secs, predict, Figures, Prediction, Workload};
use crate::device::DeviceType;
use crate::error::PlanError;
use crate::model::Module;
use crate::plan::{plan, Plan, PlanRequest};
use crate::spec::{parse_auto_fit_mode, AutoFitMode, Flags};

/// An alternative must be predicted this much faster (a fraction) than the ladder to be chosen.
pub const MARGIN: f64 = 0.05;

/// Alternatives kept in [`Explain::alternatives`].
const TOP: usize = 5;

fn one() -> u32 {
    1
}

/// Pipeline copies an alternative with a layer split tries, when the user gave none: none
/// (one micro-batch at a time) and two (an image's two guidance passes overlap on the
/// split's devices).
const COPIES: [u32; 2] = [1, 2];

/// The flags that reproduce an alternative, for a person.
fn flags_of(a: &Alternative) -> String {
    let mut o = format!("--backend \"{}\"", a.backend);
    if !a.params_backend.is_empty() {
        o.push_str(&format!(" --params-backend \"{}\"", a.params_backend));
    }
    if a.pipeline_copies > 1 {
        o.push_str(&format!(" --pipeline-copies {}", a.pipeline_copies));
    }
    o
}

/// One alternative placement and its prediction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Alternative {
    /// Its `--backend`.
    pub backend: String,
    /// Its `--params-backend`.
    pub params_backend: String,
    /// Its `--pipeline-copies` (1 unless a module is layer-split).
    #[serde(default = "one")]
    pub pipeline_copies: u32,
    /// Predicted seconds per step.
    pub step_s: f64,
    /// Predicted seconds per generation.
    pub total_s: f64,
}

/// Why a plan was chosen, with the predictions behind it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Explain {
    /// The chosen plan's prediction.
    pub chosen: Prediction,
    /// The ladder's plan's prediction (auto-fit only).
    pub ladder: Option<Prediction>,
    /// The fastest alternatives that fit, fastest first (auto-fit by time only).
    pub alternatives: Vec<Alternative>,
    /// One line: what was chosen and why.
    pub reason: String,
    /// Where the figures come from.
    pub figures: String,
}

impl Explain {
    /// The explanation for a person.
    pub fn render(&self) -> String {
        let mut o =
            format!("prediction (figures: {}):\n", if self.figures.is_empty() { "given" } else { &self.figures });
        o.push_str(&self.chosen.render("  chosen plan"));
        if let Some(l) = &self.ladder {
            o.push_str(&l.render("  ladder plan"));
        }
        if !self.alternatives.is_empty() {
            o.push_str("  top alternatives:\n");
            for a in &self.alternatives {
                o.push_str(&format!(
                    "    {:>9} per step, {:>9} per generation: {}\n",
                    fmt_secs(a.step_s),
                    fmt_secs(a.total_s),
                    flags_of(a)
                ));
            }
        }
        o.push_str(&format!("  {}\n", self.reason));
        o
    }
}

/// Plans `req` and predicts it; with auto-fit by time (the default `--auto-fit on` when
/// figures are given), picks the fastest alternative that fits when it beats the ladder by
/// [`MARGIN`]. The returned plan's [`Plan::choice`] carries the one-line reason.
pub fn plan_by_time(req: &PlanRequest, work: &Workload, figures: &Figures) -> Result<(Plan, Explain), PlanError> {
    for (name, d) in &figures.devices {
        d.check().map_err(|reason| PlanError::InvalidFigures { device: name.clone(), reason })?;
    }
    let mode = parse_auto_fit_mode(req.flags.auto_fit.as_deref())?;
    let mut ladder = plan(req)?;
    let ladder_pred = predict(&ladder, work, figures);
    let source = figures.source.clone();
    if !ladder.auto_fit || mode != AutoFitMode::Time {
        let reason = if !ladder.auto_fit {
            "explicit placement (auto-fit off): predicted only".to_string()
        } else {
            "--auto-fit ladder: the seeds' ladder, predicted only".to_string()
        };
        ladder.choice = Some(reason.clone());
        return Ok((
            ladder,
            Explain { chosen: ladder_pred, ladder: None, alternatives: Vec::new(), reason, figures: source },
        ));
    }
    let mut alts: Vec<(Alternative, Plan, Prediction)> = Vec::new();
    // A layer split's pipeline copies are varied only when the user set none.
    let copies_given = req.flags.pipeline_copies.is_some()
        || req.flags.pipeline_copies_env.as_deref().is_some_and(|v| !v.trim().is_empty());
    let mut tries: Vec<(String, String, Option<u32>)> = Vec::new();
    for (backend, params) in candidates(&ladder) {
        if backend.contains('&') && !copies_given {
            tries.extend(COPIES.iter().map(|&c| (backend.clone(), params.clone(), Some(c))));
        } else {
            tries.push((backend, params, None));
        }
    }
    for (backend, params, copies) in tries {
        let flags = Flags {
            backend: Some(backend.clone()),
            params_backend: (!params.is_empty()).then(|| params.clone()),
            pipeline_copies: copies.map(|c| c.to_string()).or_else(|| req.flags.pipeline_copies.clone()),
            auto_fit: None,
            clip_on_cpu: false,
            vae_on_cpu: false,
            control_net_cpu: false,
            offload_to_cpu: false,
            ..req.flags.clone()
        };
        let cand_req = PlanRequest { flags, ..req.clone() };
        let Ok(p) = plan(&cand_req) else { continue };
        if !p.fits {
            continue;
        }
        let pred = predict(&p, work, figures);
        if !pred.complete() || !pred.total_s.is_finite() {
            continue;
        }
        let same = |a: &Alternative| {
            a.backend == p.backend && a.params_backend == p.params_backend && a.pipeline_copies == p.pipeline_copies
        };
        if alts.iter().any(|(a, _, _)| same(a)) {
            continue;
        }
        let a = Alternative {
            backend: p.backend.clone(),
            params_backend: p.params_backend.clone(),
            pipeline_copies: p.pipeline_copies,
            step_s: pred.step_s,
            total_s: pred.total_s,
        };
        alts.push((a, p, pred));
    }
    alts.sort_by(|a, b| a.0.total_s.total_cmp(&b.0.total_s));
    let alternatives: Vec<Alternative> = alts.iter().take(TOP).map(|(a, _, _)| a.clone()).collect();
    let best = alts.into_iter().next();
    let ladder_ok = ladder.fits && ladder_pred.complete();
    let pick = match best {
        Some((a, p, pred)) if !ladder_ok || a.total_s < ladder_pred.total_s * (1.0 - MARGIN) => Some((a, p, pred)),
        _ => None,
    };
    let Some((a, mut chosen, pred)) = pick else {
        let reason = if ladder_ok {
            format!(
                "auto-fit by time: the ladder's plan kept ({} per generation predicted; no alternative is {:.0}% faster)",
                fmt_secs(ladder_pred.total_s),
                MARGIN * 100.0
            )
        } else if ladder_pred.complete() {
            "auto-fit by time: the ladder's plan kept (nothing fits)".to_string()
        } else {
            format!("auto-fit by time: the ladder's plan kept (not predicted: {})", ladder_pred.unpredicted.join("; "))
        };
        ladder.choice = Some(reason.clone());
        return Ok((
            ladder,
            Explain { chosen: ladder_pred.clone(), ladder: Some(ladder_pred), alternatives, reason, figures: source },
        ));
    };
    let reason = if ladder_ok {
        format!(
            "auto-fit by time: {} predicted {} per generation ({} per step) against the ladder's {} ({} per step)",
            flags_of(&a),
            fmt_secs(a.total_s),
            fmt_secs(a.step_s),
            fmt_secs(ladder_pred.total_s),
            fmt_secs(ladder_pred.step_s)
        )
    } else {
        format!(
            "auto-fit by time: the ladder's plan does not fit; {} fits, predicted {} per generation",
            flags_of(&a),
            fmt_secs(a.total_s)
        )
    };
    chosen.auto_fit = true;
    chosen.ram_reserve_bytes = ladder.ram_reserve_bytes;
    chosen.choice = Some(reason.clone());
    Ok((chosen, Explain { chosen: pred, ladder: Some(ladder_pred), alternatives, reason, figures: source }))
}

/// The alternatives as `(--backend, --params-backend)` strings.
fn candidates(ladder: &Plan) -> Vec<(String, String)> {
    let cpu = ladder.devices.iter().find(|d| d.kind == DeviceType::Cpu).map(|d| d.device.clone());
    let Some(cpu) = cpu else { return Vec::new() };
    let mut mains: Vec<String> = ladder
        .devices
        .iter()
        .filter(|d| matches!(d.kind, DeviceType::Gpu | DeviceType::Igpu))
        .map(|d| d.device.clone())
        .collect();
    mains.push(cpu.clone());
    let present: Vec<Module> = ladder.modules.iter().map(|m| m.module).collect();
    let mut out = Vec::new();
    for main in &mains {
        let mut diffusion: Vec<String> = vec![main.clone()];
        if present.contains(&Module::Diffusion) {
            for other in mains.iter().filter(|o| *o != main) {
                diffusion.push(format!("{main}&{other}"));
            }
        }
        let side: Vec<String> = if main == &cpu { vec![cpu.clone()] } else { vec![main.clone(), cpu.clone()] };
        for d in &diffusion {
            for te in &side {
                for vae in &side {
                    // Each module: (runtime, may its params go to RAM?)
                    let mut rows: Vec<(Module, String)> = Vec::new();
                    for m in &present {
                        let rt = match m {
                            Module::Diffusion => d.clone(),
                            Module::Te => te.clone(),
                            Module::Vae => vae.clone(),
                            _ => main.clone(),
                        };
                        rows.push((*m, rt));
                    }
                    let backend: String =
                        rows.iter().map(|(m, rt)| format!("{}={rt}", m.name())).collect::<Vec<_>>().join(",");
                    // Params in RAM for any subset of the single-device modules not on the CPU.
                    let offloadable: Vec<Module> = rows
                        .iter()
                        .filter(|(m, rt)| {
                            rt != &cpu && !rt.contains('&') && matches!(m, Module::Diffusion | Module::Te | Module::Vae)
                        })
                        .map(|(m, _)| *m)
                        .collect();
                    for mask in 0u32..(1 << offloadable.len()) {
                        let params: Vec<String> = offloadable
                            .iter()
                            .enumerate()
                            .filter(|(i, _)| mask & (1 << i) != 0)
                            .map(|(_, m)| format!("{}={cpu}", m.name()))
                            .collect();
                        out.push((backend.clone(), params.join(",")));
                    }
                }
            }
        }
    }
    out
}
