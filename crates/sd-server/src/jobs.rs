//! The job queue: accepted jobs in FIFO order, their states and results, and the worker loop
//! that runs them one at a time on the thread that owns the pipeline.
//!
//! Invariants: a job is in `queue` exactly while it is `Queued`; at most one job is
//! `Generating` (`current`); the cancel flag shared with the pipeline is cleared under the
//! lock when a job starts, and set only for the job in `current`, so a cancel never reaches
//! the next job. Finished jobs are kept [`KEEP_SECONDS`] and then answer 410.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sd_models::pipeline::{KeptWeights, Pipeline, PipelineError, Progress};
use sd_models::report::RunReport;
use serde_json::{json, Value};

use crate::decode::JobSpec;
use crate::Config;

/// How long a finished job's result is kept (the reference's TTL).
pub(crate) const KEEP_SECONDS: u64 = 600;

/// A job's state, by the reference's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Queued,
    Generating,
    Completed,
    Failed,
    Cancelled,
}

impl Status {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::Generating => "generating",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
        }
    }
}

/// Where a running job is.
#[derive(Clone, Debug, Default)]
pub(crate) struct JobProgress {
    /// `text encode`, `sampling`, `decode`.
    pub stage: &'static str,
    /// Image (0-based) being sampled and images in the job.
    pub image: usize,
    pub images: usize,
    /// Sampling steps finished for `image`, of `steps`.
    pub step: usize,
    pub steps: usize,
}

/// What a job does.
pub(crate) enum Work {
    /// Generate images.
    Generate(Box<JobSpec>),
    /// Replace the loaded model by this checkpoint.
    Switch(PathBuf),
}

/// The latest preview of a generating job.
#[derive(Clone, Debug)]
pub(crate) struct Preview {
    /// Image (0-based) of the batch, and the sampling steps done for it.
    pub image: usize,
    pub step: usize,
    /// PNG, base64.
    pub b64: String,
}

/// One accepted job.
pub(crate) struct Job {
    pub id: String,
    pub status: Status,
    pub created: u64,
    pub started: Option<u64>,
    pub completed: Option<u64>,
    /// Taken by the worker when the job starts.
    pub spec: Option<Work>,
    pub output_format: &'static str,
    /// Base64 images once completed.
    pub images: Vec<String>,
    /// The run report of a completed generation (what was staged anew and what reused).
    pub report: Option<RunReport>,
    /// `(code, message)` of a failed or cancelled job.
    pub error: Option<(&'static str, String)>,
    /// A failure caused by the request (answered 400 by the synchronous APIs).
    pub bad_request: bool,
    pub progress: JobProgress,
    /// The latest preview while generating.
    pub preview: Option<Preview>,
    pub started_at: Option<Instant>,
    finished_at: Option<Instant>,
    /// Synchronous handlers waiting for the job to finish.
    waiters: Vec<tokio::sync::oneshot::Sender<()>>,
}

/// The queue and every job, behind one lock.
#[derive(Default)]
pub(crate) struct State {
    pub jobs: HashMap<String, Job>,
    pub queue: VecDeque<String>,
    pub current: Option<String>,
    /// Ids of finished jobs dropped after [`KEEP_SECONDS`] (answered 410).
    pub expired: HashSet<String>,
    counter: u64,
}

/// What the HTTP side and the worker share.
pub(crate) struct Shared {
    pub config: Config,
    state: Mutex<State>,
    wake: Condvar,
    cancel: Arc<AtomicBool>,
    /// Bumped on every change of any job (server-sent events wait on it).
    changes: tokio::sync::watch::Sender<u64>,
    /// The checkpoint loaded now (None while none is: a switch whose model and the old one
    /// both failed to load).
    model: Mutex<Option<PathBuf>>,
}

/// Why a job was not accepted.
pub(crate) struct QueueFull;

/// Why a job cannot be cancelled.
pub(crate) enum CancelError {
    NotFound,
    Expired,
    Finished(Status),
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl Shared {
    pub(crate) fn new(config: Config, cancel: Arc<AtomicBool>) -> Shared {
        Shared {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            cancel,
            changes: tokio::sync::watch::Sender::new(0),
            model: Mutex::new(Some(config.model_path.clone())),
            config,
        }
    }

    /// The checkpoint loaded now.
    pub(crate) fn model_path(&self) -> Option<PathBuf> {
        self.model.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Tells the event streams that a job changed.
    pub(crate) fn changed(&self) {
        self.changes.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// A receiver told of every change from now on.
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Replaces the generating job's preview.
    pub(crate) fn set_preview(&self, image: usize, step: usize, b64: String) {
        {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let Some(id) = st.current.clone() else { return };
            if let Some(job) = st.jobs.get_mut(&id) {
                job.preview = Some(Preview { image, step, b64 });
            }
        }
        self.changed();
    }

    /// The state, locked; finished jobs past their time are dropped first.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held is our bug; the state is still consistent enough
        // to answer requests, so the poison is ignored rather than spread to every request.
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let keep = Duration::from_secs(KEEP_SECONDS);
        let old: Vec<String> = st
            .jobs
            .values()
            .filter(|j| j.finished_at.is_some_and(|t| t.elapsed() > keep) && j.waiters.is_empty())
            .map(|j| j.id.clone())
            .collect();
        for id in old {
            st.jobs.remove(&id);
            st.expired.insert(id);
        }
        st
    }

    /// Accepts `spec` at the end of the queue: the job's id, or [`QueueFull`] when
    /// `max_queue` jobs are pending. With `wait`, also a receiver told when it finishes.
    pub(crate) fn submit(
        &self,
        spec: Work,
        wait: bool,
    ) -> Result<(String, u64, Option<tokio::sync::oneshot::Receiver<()>>), QueueFull> {
        let mut st = self.lock();
        let pending = st.queue.len() + usize::from(st.current.is_some());
        if pending >= self.config.max_queue {
            return Err(QueueFull);
        }
        st.counter += 1;
        let created = unix_now();
        let id = format!("job_{created:x}_{:08x}", st.counter);
        let (tx, rx) = if wait {
            let (tx, rx) = tokio::sync::oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let job = Job {
            id: id.clone(),
            status: Status::Queued,
            created,
            started: None,
            completed: None,
            output_format: match &spec {
                Work::Generate(g) => g.output.format.name(),
                Work::Switch(_) => "png",
            },
            spec: Some(spec),
            images: Vec::new(),
            report: None,
            error: None,
            bad_request: false,
            progress: JobProgress::default(),
            preview: None,
            started_at: None,
            finished_at: None,
            waiters: tx.into_iter().collect(),
        };
        st.jobs.insert(id.clone(), job);
        st.queue.push_back(id.clone());
        drop(st);
        self.wake.notify_one();
        self.changed();
        Ok((id, created, rx))
    }

    /// Cancels job `id`: a queued job leaves the queue at once, a generating one stops at
    /// the next sampling step.
    pub(crate) fn cancel(&self, id: &str) -> Result<Status, CancelError> {
        let mut st = self.lock();
        let Some(job) = st.jobs.get(id) else {
            return Err(if st.expired.contains(id) { CancelError::Expired } else { CancelError::NotFound });
        };
        match job.status {
            Status::Queued => {
                st.queue.retain(|q| q != id);
                finish(&mut st, id, Status::Cancelled, Some(("cancelled", "job cancelled by client".into())));
                drop(st);
                self.changed();
                Ok(Status::Cancelled)
            }
            Status::Generating => {
                self.cancel.store(true, Ordering::Relaxed);
                Ok(Status::Generating)
            }
            s => Err(CancelError::Finished(s)),
        }
    }

    /// Cancels the generating job, if any (A1111's interrupt); its id.
    pub(crate) fn interrupt(&self) -> Option<String> {
        let st = self.lock();
        let id = st.current.clone()?;
        self.cancel.store(true, Ordering::Relaxed);
        Some(id)
    }
}

/// Marks job `id` finished and wakes whoever waits on it.
fn finish(st: &mut State, id: &str, status: Status, error: Option<(&'static str, String)>) {
    if let Some(job) = st.jobs.get_mut(id) {
        job.status = status;
        job.completed = Some(unix_now());
        job.finished_at = Some(Instant::now());
        job.error = error;
        job.spec = None;
        job.preview = None;
        for w in job.waiters.drain(..) {
            let _ = w.send(());
        }
    }
}

/// The job JSON of the reference (`make_async_job_json`), with our `progress` added.
pub(crate) fn job_json(st: &State, job: &Job) -> Value {
    let position = match job.status {
        Status::Queued => st.queue.iter().position(|q| *q == job.id).map_or(0, |p| p + 1),
        _ => 0,
    };
    let result = (job.status == Status::Completed).then(|| {
        let images: Vec<Value> =
            job.images.iter().enumerate().map(|(i, b64)| json!({"index": i, "b64_json": b64})).collect();
        json!({"output_format": job.output_format, "images": images})
    });
    let error = job.error.as_ref().map(|(code, message)| json!({"code": code, "message": message}));
    let mut v = json!({
        "id": job.id,
        "kind": "img_gen",
        "status": job.status.name(),
        "created": job.created,
        "started": job.started,
        "completed": job.completed,
        "queue_position": position,
        "result": result,
        "error": error,
    });
    if let Some(report) = &job.report {
        // Serialising plain structs of numbers and strings cannot fail.
        v["report"] = serde_json::to_value(report).unwrap_or(Value::Null);
    }
    if job.status == Status::Generating {
        v["progress"] = progress_json(job);
        if let Some(p) = &job.preview {
            v["preview"] = json!({"image": p.image, "step": p.step, "format": "png", "b64_json": p.b64});
        }
    }
    v
}

/// `{stage, image, images, step, steps, fraction, elapsed, eta}` of a generating job
/// (elapsed and ETA in seconds; the ETA from the sampling rate so far).
pub(crate) fn progress_json(job: &Job) -> Value {
    let p = &job.progress;
    let elapsed = job.started_at.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let fraction = fraction(p);
    let eta = (fraction > 0.0).then(|| elapsed / fraction - elapsed);
    json!({
        "stage": p.stage,
        "image": p.image,
        "images": p.images,
        "step": p.step,
        "steps": p.steps,
        "fraction": fraction,
        "elapsed": elapsed,
        "eta": eta,
    })
}

/// The share of the job's sampling steps done.
pub(crate) fn fraction(p: &JobProgress) -> f64 {
    let total = p.images * p.steps;
    if total == 0 {
        return 0.0;
    }
    (p.image * p.steps + p.step) as f64 / total as f64
}

/// `pipeline` with the server's cancel flag and preview hook.
pub(crate) fn hooked(shared: &Arc<Shared>, pipeline: Pipeline) -> Pipeline {
    pipeline.with_cancel(shared.cancel.clone()).with_latent_hook(crate::preview::hook(shared.clone()))
}

/// Replaces the loaded model by `path`: the old one and its kept weights are dropped first
/// (their memory returns before the new one's is taken); when the new one fails to load,
/// the old one is loaded again.
fn switch(
    shared: &Arc<Shared>,
    pipeline: &mut Option<Pipeline>,
    kept: &mut KeptWeights,
    load: &mut crate::Loader,
    path: &Path,
) -> Result<Outcome, Failure> {
    let old = shared.model_path();
    if old.as_deref() == Some(path) && pipeline.is_some() {
        return Ok((Vec::new(), None));
    }
    kept.clear();
    *pipeline = None;
    *shared.model.lock().unwrap_or_else(|p| p.into_inner()) = None;
    tracing::info!("loading <checkpoint file> '{}'", path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default());
    let error = match load(path) {
        Ok(p) => {
            *pipeline = Some(hooked(shared, p));
            *shared.model.lock().unwrap_or_else(|p| p.into_inner()) = Some(path.to_path_buf());
            return Ok((Vec::new(), None));
        }
        Err(e) => e,
    };
    let message = roles(error.replace(&*path.to_string_lossy(), "<checkpoint file>"), &shared.config, &[]);
    tracing::warn!("the model switch failed: {message}");
    if let Some(old) = old {
        match load(&old) {
            Ok(p) => {
                *pipeline = Some(hooked(shared, p));
                *shared.model.lock().unwrap_or_else(|p| p.into_inner()) = Some(old);
            }
            Err(e) => {
                tracing::error!("the previous model could not be loaded again: {}", roles(e, &shared.config, &[]))
            }
        }
    }
    Err(Failure::Failed { message: format!("loading the model: {message}"), bad_request: false })
}

/// Runs queued jobs on this thread, forever.
pub(crate) fn work(shared: &Arc<Shared>, pipeline: Pipeline, mut load: crate::Loader) {
    let mut pipeline = Some(pipeline);
    // The loaded model's weights, kept staged from one generation to the next.
    let mut kept = KeptWeights::new();
    loop {
        let (id, spec) = {
            let mut st = shared.lock();
            let id = loop {
                if let Some(id) = st.queue.pop_front() {
                    break id;
                }
                st = shared.wake.wait(st).unwrap_or_else(|p| p.into_inner());
            };
            // Cleared under the lock: a cancel for this job can only come after.
            shared.cancel.store(false, Ordering::Relaxed);
            st.current = Some(id.clone());
            let job = st.jobs.get_mut(&id).expect("a queued job is in the map");
            job.status = Status::Generating;
            job.started = Some(unix_now());
            job.started_at = Some(Instant::now());
            let spec = job.spec.take().expect("a queued job has its request");
            job.progress = match &spec {
                Work::Generate(spec) => JobProgress {
                    stage: "text encode",
                    image: 0,
                    images: spec.params.params().batch_count,
                    step: 0,
                    steps: spec.params.params().steps,
                },
                Work::Switch(_) => JobProgress { stage: "load model", ..JobProgress::default() },
            };
            (id, spec)
        };
        shared.changed();
        let outcome = match spec {
            Work::Generate(spec) => {
                let spec = *spec;
                let p = spec.params.params();
                tracing::info!(
                    "{id}: generating {}x{}, {} steps, {} images",
                    p.width,
                    p.height,
                    p.steps,
                    p.batch_count
                );
                // Prompts are the user's text: only at debug level (logs may leave the machine).
                tracing::debug!("{id}: prompt {:?}, negative prompt {:?}", p.prompt, p.negative_prompt);
                match pipeline.as_mut() {
                    Some(pipeline) => run(shared, pipeline, &mut kept, &id, spec),
                    None => Err(Failure::Failed {
                        message: "no model is loaded (the last model switch failed): switch to a model first".into(),
                        bad_request: false,
                    }),
                }
            }
            Work::Switch(path) => switch(shared, &mut pipeline, &mut kept, &mut load, &path),
        };
        release_freed_memory();
        let mut st = shared.lock();
        st.current = None;
        match outcome {
            Ok((images, report)) => {
                if let Some(job) = st.jobs.get_mut(&id) {
                    job.images = images;
                    job.report = report;
                }
                finish(&mut st, &id, Status::Completed, None);
                tracing::info!("{id}: completed");
            }
            Err(Failure::Cancelled) => {
                finish(&mut st, &id, Status::Cancelled, Some(("cancelled", "job cancelled by client".into())));
                tracing::info!("{id}: cancelled");
            }
            Err(Failure::Failed { message, bad_request }) => {
                tracing::warn!("{id}: failed: {message}");
                if let Some(job) = st.jobs.get_mut(&id) {
                    job.bad_request = bad_request;
                }
                finish(&mut st, &id, Status::Failed, Some(("generation_failed", message)));
            }
        }
        drop(st);
        shared.changed();
    }
}

/// Hands the memory a finished job freed back to the system. glibc keeps freed blocks in
/// its heaps (one per thread that allocated, and ggml's compute threads are new each graph), so
/// without this a server's idle resident set creeps up in steps of a compute buffer over many
/// jobs although nothing stays allocated. Only the pages of free blocks go: the kept weights
/// and live allocations are untouched.
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of glibc's own heaps; it takes no pointer.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A finished job's images (base64) and, for a generation, its run report.
type Outcome = (Vec<String>, Option<RunReport>);

enum Failure {
    Cancelled,
    Failed { message: String, bad_request: bool },
}

/// `message` with the model file and the request's LoRA files named by their roles
/// (`<checkpoint file>`, `<lora file>`, `<lora-model-dir>`): the message is logged and
/// answered, and both may leave the machine.
pub(crate) fn roles(message: String, config: &Config, loras: &[sd_models::lora::LoraRequest]) -> String {
    let mut m = message;
    for l in loras {
        m = m.replace(&*l.path.to_string_lossy(), "<lora file>");
    }
    let model = config.model_path.to_string_lossy();
    if !model.is_empty() {
        m = m.replace(&*model, "<checkpoint file>");
    }
    // Only directories given in full: a relative one (`.`) would match text anywhere.
    let dirs = [(Some(&config.lora_dir), "<lora-model-dir>"), (config.models_dir.as_ref(), "<models-dir>")];
    for (dir, role) in dirs {
        if let Some(dir) = dir.filter(|d| d.is_absolute() && d.parent().is_some()) {
            m = m.replace(&*dir.to_string_lossy(), role);
        }
    }
    m
}

/// The error and its causes, joined with `: `.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// One job on the pipeline: its LoRAs set for this run only, the request checked against the
/// model, the images generated (reusing the weights `kept` from the last job) and encoded.
fn run(
    shared: &Shared,
    pipeline: &mut Pipeline,
    kept: &mut KeptWeights,
    id: &str,
    spec: JobSpec,
) -> Result<Outcome, Failure> {
    let failed = |e: &PipelineError, bad_request: bool| match e {
        PipelineError::Cancelled => Failure::Cancelled,
        e => Failure::Failed { message: roles(chain(e), &shared.config, &spec.loras), bad_request },
    };
    pipeline.set_loras(&spec.loras, shared.config.lora_apply_mode).map_err(|e| failed(&e, true))?;
    let request = pipeline.check_request(spec.params).map_err(|e| failed(&e, true))?;
    let mut on_progress = |p: Progress| {
        let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
        let Some(job) = st.jobs.get_mut(id) else { return };
        let jp = &mut job.progress;
        match p {
            Progress::Step { image, images, step, steps, .. } => {
                *jp = JobProgress { stage: "sampling", image, images, step: step + 1, steps };
                if step + 1 == steps && image + 1 == images {
                    jp.stage = "decode";
                }
            }
            Progress::Stage { name: "text encode", .. } | Progress::Stage { name: "image encode", .. } => {
                jp.stage = "sampling"
            }
            Progress::Stage { name: "decode", .. } => jp.stage = "encode image",
            Progress::Stage { .. } => {}
            Progress::Tile { .. } => jp.stage = "decode",
        }
        drop(st);
        shared.changed();
    };
    let mut report = RunReport::new("serve", Vec::new());
    let images = pipeline.generate_keeping(&request, &mut on_progress, &mut report, kept);
    // The loaded pipeline keeps no adapter between requests.
    let _ = pipeline.set_loras(&[], shared.config.lora_apply_mode);
    let images = images.map_err(|e| failed(&e, false))?;
    let reused: Vec<&str> = report.staging.iter().filter(|s| s.reused).map(|s| s.module.as_str()).collect();
    tracing::info!(
        "{id}: staged {:.1} MiB of weights anew; reused the kept weights of {}",
        report.staged_bytes() as f64 / 1048576.0,
        if reused.is_empty() { "no module".to_string() } else { reused.join(", ") }
    );
    let images = images
        .iter()
        .map(|img| crate::images::encode_b64(img, spec.output))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Failure::Failed { message: format!("encoding the image: {e}"), bad_request: false })?;
    Ok((images, Some(report)))
}
