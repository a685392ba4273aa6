//! Weights kept staged between generations: a server's loaded model reuses each module's
//! placed weights (pinned device buffers, RAM or other-device home copies, staged replicas)
//! from one request to the next instead of loading them again.
//!
//! A [`KeptWeights`] belongs to one [`Pipeline`] (its files and placement): handed to another
//! pipeline (a model switch) it frees what it holds before anything loads. Weights are kept
//! only while no LoRA is applied (merged adapters change them; a request with LoRAs frees the
//! kept weights and loads its own, as a plain generation does). Kept weights stay within the
//! device budgets: replicas staged from a home copy are evicted by the ledgers under pressure
//! as in any run, and when a load or a run finds no room beside pinned kept weights, the kept
//! weights are freed and the load, or the run, is tried once more without them.

use std::sync::Arc;

use sd_sched::{HomeReport, Weights};
use sd_vae::FirstStage;

use super::{Image, Pipeline, PipelineError, Progress, Request, Result};
use crate::family::{DiffusionModel, TextEncoder};
use crate::files::ModelFiles;
use sd_placement::Module;

use crate::report::{module_name, DeviceReport, RunReport, Settings, Staging};

/// The loaded modules of a pipeline kept between its generations (see the module docs).
#[derive(Default)]
pub struct KeptWeights {
    /// The files of the pipeline they belong to (also keeps them open).
    files: Option<Arc<ModelFiles>>,
    pub(super) te: Option<Box<dyn TextEncoder>>,
    /// With the guidance it was loaded for.
    pub(super) unet: Option<(u32, Box<dyn DiffusionModel>)>,
    /// With whether it has its encoder.
    pub(super) vae: Option<(bool, Box<dyn FirstStage>)>,
}

impl std::fmt::Debug for KeptWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeptWeights(te {}, unet {}, vae {})", self.te.is_some(), self.unet.is_some(), self.vae.is_some())
    }
}

impl KeptWeights {
    /// Nothing kept yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Frees every kept module.
    pub fn clear(&mut self) {
        self.free_modules();
        self.files = None;
    }

    /// Frees the modules kept now (those taken out for the running stage stay with it).
    pub(super) fn free_modules(&mut self) {
        if self.te.is_some() || self.unet.is_some() || self.vae.is_some() {
            tracing::debug!("freeing the kept weights");
        }
        self.te = None;
        self.unet = None;
        self.vae = None;
    }

    /// Whether no module is kept.
    pub fn is_empty(&self) -> bool {
        self.te.is_none() && self.unet.is_none() && self.vae.is_none()
    }
}

/// Whether `e` is a device running out of room (a budget refusing a charge, an allocation
/// failing, the segment planner finding no room).
fn no_room(e: &PipelineError) -> bool {
    if let PipelineError::Sched(s) = e {
        return s.no_room().is_some();
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<sd_sched::SchedError>().is_some_and(|s| s.no_room().is_some()) {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Loads a module with `load`; when it finds no room and other modules are kept, frees them
/// and loads once more.
pub(super) fn load_or_free<T>(kept: &mut Option<&mut KeptWeights>, load: impl Fn() -> Result<T>) -> Result<T> {
    match load() {
        Err(e) if no_room(&e) && kept.as_deref().is_some_and(|k| !k.is_empty()) => {
            tracing::info!("no room beside the kept weights ({e}): freeing them");
            if let Some(k) = kept.as_deref_mut() {
                k.free_modules();
            }
            load()
        }
        r => r,
    }
}

/// A module's copy counter when its use in this run begins: `Some` for weights reused from
/// an earlier run, `None` for weights loaded anew.
pub(super) fn begin(w: &Weights, reused: bool) -> Option<u64> {
    reused.then(|| w.stats().copied_bytes)
}

/// Records in `report` what `module`'s use in this run staged anew (`start` from [`begin`]).
pub(super) fn record(report: &mut RunReport, module: Module, w: &Weights, start: Option<u64>) {
    let copied = w.stats().copied_bytes;
    let staged_bytes = match start {
        Some(before) => copied.saturating_sub(before),
        // A home copy in RAM or on another device was read from the files at the load.
        None => match w.home_report() {
            HomeReport::Host | HomeReport::Device { .. } => copied + w.nbytes() as u64,
            HomeReport::Compute | HomeReport::Disk => copied,
        },
    };
    report.staging.push(Staging { module: module_name(module).to_string(), reused: start.is_some(), staged_bytes });
}

impl Pipeline {
    /// [`Pipeline::generate_reported`] keeping the loaded weights in `kept` for the next
    /// generation of this pipeline, and reusing those an earlier one kept (see the module
    /// docs): the report's `staging` says per module what was reused and what staged anew.
    pub fn generate_keeping(
        &self,
        request: &Request,
        progress: &mut dyn FnMut(Progress),
        report: &mut RunReport,
        kept: &mut KeptWeights,
    ) -> Result<Vec<Image>> {
        report.settings = Some(Settings::of(request));
        if !kept.files.as_ref().is_some_and(|f| Arc::ptr_eq(f, &self.files)) {
            // Another pipeline's weights (a model switch): freed before anything loads.
            kept.clear();
            kept.files = Some(self.files.clone());
        }
        let images = if self.loras.is_some() {
            // Adapted weights are this request's own: the plain ones make room for them.
            kept.free_modules();
            self.generate_into(request, progress, report, None)
        } else {
            let had = !kept.is_empty();
            match self.generate_into(request, progress, report, Some(kept)) {
                Err(e) if had && no_room(&e) => {
                    tracing::info!("no room beside the kept weights ({e}): freeing them and running again");
                    kept.free_modules();
                    report.modules.clear();
                    report.runners.clear();
                    report.stages.clear();
                    report.steps.clear();
                    report.staging.clear();
                    self.generate_into(request, progress, report, None)
                }
                r => r,
            }
        };
        report.devices = DeviceReport::all(&self.opts.placement.ledgers);
        images
    }
}
