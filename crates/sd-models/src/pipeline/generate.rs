//! A generation as a sequence of named stages: text, start (schedule and init image), sampling
//! and decode. Each stage is timed by one [`StageClock`], which feeds the report, the log and the
//! progress events; each stage takes its module from the kept weights or loads it, and gives it
//! back to them (a server's warm pipeline) or frees it after its use.

use std::cell::Cell;
use std::ops::Range;
use std::time::Instant;

use sd_sched::{Runner, Weights};
use sd_vae::{FirstStage, TilingParams};

use super::control::ControlStage;
use super::{
    bad_setting, inpaint, kept, planar_to_rgb8, Image, KeptWeights, Pipeline, PipelineError, Progress, Request, Result,
    Setting, StepLatent, ACTIVATIONS,
};
use crate::diffusion::controlnet::ControlResiduals;
use crate::family::{DiffusionModel, TextRequest};
use crate::health;
use sd_placement::Module;

use crate::report::{module_name, ModuleReport, RunReport, RunnerReport, StepTime};
use crate::sampling::{
    img2img_sigmas, noised_latent, sample, sample_flow, txt2img_latent, Denoised, GuidedDenoiser, ModelInput,
    ModelOutput, NoiseRng, NoiseSchedule, Schedule, ScheduleContext, Step,
};
use crate::text::conditioning::{Conditioning, ReferenceLatent};

/// One stage's clock. Its laps (a module's load) and its own time go to the report; the whole
/// stage's time goes to the log and, as [`Progress::Stage`], to the observer.
struct StageClock {
    name: &'static str,
    started: Instant,
    lap: Instant,
}

impl StageClock {
    fn start(name: &'static str) -> Self {
        let now = Instant::now();
        StageClock { name, started: now, lap: now }
    }

    /// Records the time since the last lap (or the start) in the report as `label`.
    fn lap(&mut self, report: &mut RunReport, label: &str) {
        report.stage(label, self.lap.elapsed().as_secs_f64());
        self.lap = Instant::now();
    }

    /// Ends the stage: the time since the last lap goes to the report under the stage's name,
    /// the whole stage's time to the log and the observer.
    fn finish(self, out: &mut RunOutputs<'_, '_>) {
        out.report.stage(self.name, self.lap.elapsed().as_secs_f64());
        let seconds = self.started.elapsed().as_secs_f64();
        tracing::info!("{} took {seconds:.2} s", self.name);
        (out.progress)(Progress::Stage { name: self.name, seconds });
    }
}

/// What a generation's stages take from and write to: the weights a server keeps between runs
/// (none for a one-off run), the report and the observer.
pub(super) struct RunOutputs<'r, 'k> {
    pub kept: Option<&'k mut KeptWeights>,
    pub report: &'r mut RunReport,
    pub progress: &'r mut dyn FnMut(Progress),
}

/// The text stage's result: the prompt's conditioning and, with guidance, the negative prompt's;
/// with the image guidance the negative prompt's again without the reference images.
struct Texts {
    cond: Conditioning,
    uncond: Option<Conditioning>,
    img_uncond: Option<Conditioning>,
}

/// Where sampling starts: the schedule, the first pass's sigmas, and for img2img and inpainting
/// the init latent, an inpainting UNet's extra channels and the mask that keeps the init latent.
struct Start {
    schedule: Schedule,
    sigmas: Vec<f32>,
    init_latent: Option<Vec<f32>>,
    /// An inpainting UNet's extra channels (the same for every image and both passes).
    concat: Option<Vec<f32>>,
    /// Where the denoised estimate is repainted (elsewhere it keeps the init latent).
    denoise_mask: Option<Vec<f32>>,
    /// The reference images' latents (`-r`).
    refs: Vec<ReferenceLatent>,
}

/// The latents of the images a generation starts from ([`Pipeline::encode_images`]).
#[derive(Default)]
struct Encoded {
    /// The init image's (img2img, inpainting).
    init: Option<Vec<f32>>,
    /// An inpainting UNet's masked image's.
    masked: Option<Vec<f32>>,
    /// The reference images' (`-r`).
    refs: Vec<ReferenceLatent>,
}

/// Where a sampling pass's images start from.
enum PassStart {
    /// The init latent (img2img), else noise.
    Init,
    /// The hires fix's latent upscaler: the first pass's latents, upscaled.
    Latents(Vec<Vec<f32>>),
    /// The hires fix's image upscaler: each image is decoded, upscaled and encoded with its
    /// own generator, which its encoding draws from first.
    Images(Box<ImageUpscale>),
}

/// [`PassStart::Images`]' state.
struct ImageUpscale {
    /// The VAE (encoder and decoder) and its runner.
    vae: Box<dyn FirstStage>,
    runner: Runner,
    /// The first pass's latents.
    latents: Vec<Vec<f32>>,
    upscaler: crate::hires::HiresUpscaler,
}

/// A sampling pass's latent size and its sigmas.
type PassSize = ((usize, usize), Vec<f32>);

/// One sampling pass: the generated size, or the hires fix's target.
struct Pass<'a> {
    request: &'a Request,
    texts: &'a Texts,
    start: &'a Start,
    unet: &'a dyn DiffusionModel,
    /// The pass's latent size, and the first pass's (the hires fix upscales from it).
    dims: (usize, usize),
    first_dims: (usize, usize),
    /// Latent channels.
    channels: usize,
    sigmas: &'a [f32],
}

impl Pass<'_> {
    /// The latent values of one image.
    fn per_image(&self) -> usize {
        self.channels * self.dims.0 * self.dims.1
    }
}

impl Pipeline {
    /// The generation's stages in order; a module is taken from `out.kept` when kept there and
    /// put back after its stage ([`KeptWeights`]).
    pub(super) fn run_stages(&self, request: &Request, out: &mut RunOutputs<'_, '_>) -> Result<Vec<Image>> {
        let mut texts = self.encode_text(request, out)?;
        let mut start = self.prepare_start(request, out)?;
        // Reference images: both conditionings read their latents, as in the reference.
        let refs = std::mem::take(&mut start.refs);
        if !refs.is_empty() {
            let increase = request.params.increase_ref_index;
            if let Some(u) = texts.uncond.as_mut() {
                (u.references, u.increase_ref_index) = (refs.clone(), increase);
            }
            (texts.cond.references, texts.cond.increase_ref_index) = (refs, increase);
        }
        if request.img_cfg != 1.0 {
            // The image guidance's negative pass: the negative prompt without the references.
            texts.img_uncond = texts.uncond.clone().map(|u| Conditioning { references: Vec::new(), ..u });
        }
        let latents = self.sample_latents(request, &texts, &start, out)?;
        self.decode_latents(request, latents, out)
    }

    /// Text: the prompt (and with guidance the negative prompt) through the text encoder.
    fn encode_text(&self, request: &Request, out: &mut RunOutputs<'_, '_>) -> Result<Texts> {
        let p = &request.params;
        self.check_cancel()?;
        let mut clock = StageClock::start("text encode");
        let reused = out.kept.as_deref_mut().and_then(|k| k.te.take());
        let fresh = reused.is_none();
        let model = match reused {
            Some(m) => m,
            None => kept::load_or_free(&mut out.kept, || self.load_text())?,
        };
        let start = kept::begin(model.weights(), !fresh);
        clock.lap(out.report, "te load");
        let mut runner = self.runner(Module::Te, &self.opts.devices.te, self.opts.devices.te_split.as_ref());
        let text = |prompt, negative| TextRequest {
            prompt,
            clip_skip: p.clip_skip,
            width: p.width,
            height: p.height,
            negative,
        };
        let cond = model.encode(&mut runner, &text(&p.prompt, false))?;
        // The negative prompt for classifier-free guidance and for the image guidance.
        let guided = request.cfg_scale != request.img_cfg || request.img_cfg != 1.0;
        let uncond = if guided { Some(model.encode(&mut runner, &text(&p.negative_prompt, true))?) } else { None };
        health::check("text encoder (prompt)", &cond.data, ACTIVATIONS);
        // A conditioning may be zero by design (SDXL's empty negative prompt).
        if let Some(u) = uncond.as_ref().filter(|u| !u.zeroed) {
            health::check("text encoder (negative prompt)", &u.data, ACTIVATIONS);
        }
        tracing::debug!(
            "{} params {}; {}",
            module_name(Module::Te),
            model.weights().home_description(),
            runner.summary()
        );
        record_module(out.report, Module::Te, model.weights(), &runner);
        kept::record(out.report, Module::Te, model.weights(), start);
        drop(runner);
        if let Some(k) = out.kept.as_deref_mut() {
            k.te = Some(model);
        }
        clock.finish(out);
        Ok(Texts { cond, uncond, img_uncond: None })
    }

    /// Start: the schedule and its sigmas, for img2img and inpainting the init image's
    /// latent and the masks, and the reference images' latents. One encoder session encodes
    /// them all; its generator is seeded with the request's seed, and the references draw
    /// from it after the init image, as in the reference.
    fn prepare_start(&self, request: &Request, out: &mut RunOutputs<'_, '_>) -> Result<Start> {
        let p = &request.params;
        let scale = self.latent_scale();
        let (lw, lh) = (p.width / scale, p.height / scale);
        let channels = self.family.latent_channels();
        let schedule = self.schedule(request);
        let ctx = ScheduleContext { ays: self.family.sampling().ays, image_seq_len: lw * lh };
        // FLUX.2's shift follows the steps and the image's latent positions (each pass's).
        let full = request.scheduler.sigmas_for(p.steps, &schedule.for_image(p.steps, lw * lh), &ctx)?;
        let concat_channels = self.concat_channels()?;
        // Inpainting: the mask at pixel and latent resolution; an inpainting checkpoint also
        // takes the masked image's latent (`inpaint.rs`).
        let pixel_mask = p.mask.as_ref().map(inpaint::pixel_mask);
        let latent_mask = pixel_mask.as_ref().map(|m| inpaint::latent_mask(m, (p.width, p.height), scale));
        let encoded = if p.init_image.is_some() || !p.ref_images.is_empty() {
            self.encode_images(request, pixel_mask.as_deref(), concat_channels > 0, out)?
        } else {
            Encoded::default()
        };
        let Encoded { init: init_latent, masked: masked_latent, refs } = encoded;
        let sigmas = if init_latent.is_some() { img2img_sigmas(&full, p.strength)? } else { full };
        if sigmas.len() < 2 {
            return bad_setting(Setting::Strength, p.strength, "too low: no sampling step remains");
        }
        // Without an init image, an inpainting UNet takes a mask of ones and a zero masked
        // latent, as the reference.
        let concat = (concat_channels > 0).then(|| {
            let ones = vec![1.0; lw * lh];
            let zeros = vec![0.0; channels * lw * lh];
            inpaint::concat(latent_mask.as_deref().unwrap_or(&ones), masked_latent.as_deref().unwrap_or(&zeros))
        });
        // The denoised estimate keeps the init latent outside the mask (dilated for an
        // inpainting UNet). Without a mask the reference's mask is all ones: nothing to keep.
        let denoise_mask = latent_mask.map(|m| if concat.is_some() { inpaint::dilate3(&m, (lw, lh)) } else { m });
        if concat.is_some() && (p.init_image.is_none() || p.mask.is_none()) {
            // The reference's warning; it then runs as this does.
            tracing::warn!("an inpainting model needs both an init image (-i) and a mask (--mask)");
        }
        Ok(Start { schedule, sigmas, init_latent, concat, denoise_mask, refs })
    }

    /// The family's schedule with the request's flow shift, where the model has a flow schedule.
    fn schedule(&self, request: &Request) -> Schedule {
        match (self.family.sampling().schedule, request.params.flow_shift) {
            (Schedule::Flow(flow), Some(shift)) => Schedule::Flow(flow.with_shift(shift)),
            (schedule, Some(shift)) => {
                // The reference sets a shift on flow denoisers only.
                tracing::info!("flow shift {shift} ignored: the {} model has no flow schedule", self.family.arch());
                schedule
            }
            (schedule, None) => schedule,
        }
    }

    /// The channels the diffusion model takes beside the latent: none, or inpainting's mask and
    /// masked image.
    fn concat_channels(&self) -> Result<usize> {
        let channels = self.family.latent_channels();
        match self.family.concat_channels() {
            c if c == 0 || c == channels + 1 => Ok(c),
            c => Err(PipelineError::Invalid(format!(
                "the {} model's UNet takes {c} channels beside the latent's {channels}: \
                 only inpainting's {} (mask and masked image) are supported",
                self.family.arch(),
                channels + 1
            ))),
        }
    }

    /// The images a generation starts from, in one encoder session: the init image's latent,
    /// for an inpainting UNet (`masked`) the masked image's, and the reference images'
    /// latents, drawn in that order from one generator seeded with the request's seed, as the
    /// reference.
    fn encode_images(
        &self,
        request: &Request,
        pixel_mask: Option<&[f32]>,
        masked: bool,
        out: &mut RunOutputs<'_, '_>,
    ) -> Result<Encoded> {
        let p = &request.params;
        let image = p.init_image.as_ref().map(crate::image_io::to_planar);
        let mut rng = p.rng.seeded(p.seed);
        let rng = rng.as_mut();
        self.with_encoder(out, |vae, runner, progress| {
            let mut on_tile = |done: usize, tiles: usize| {
                progress(Progress::Tile { stage: "image encode", image: 0, images: 1, done, tiles })
            };
            let mut encode = |px: &[f32], rng: &mut dyn NoiseRng| {
                let px = to_vae_range(vae, px);
                encode_latent(vae, runner, &px, (p.width, p.height), &p.tiling, rng, &mut on_tile)
            };
            let mut encoded = Encoded::default();
            if let Some(image) = &image {
                encoded.init = Some(encode(image, &mut *rng)?);
                // The reference encodes the masked image next, drawing from the same generator.
                if masked {
                    let ones = vec![1.0; p.width * p.height];
                    let m = pixel_mask.unwrap_or(&ones);
                    encoded.masked = Some(encode(&inpaint::masked_image(image, m), &mut *rng)?);
                }
            }
            encoded.refs = encode_refs(vae, runner, progress, request, &mut *rng)?;
            Ok(encoded)
        })
    }

    /// Runs `f` with the full VAE (encoder and decoder), its runner and the progress observer:
    /// the VAE a server kept, else one loaded (and kept after, where the server keeps it).
    fn with_encoder<T>(
        &self,
        out: &mut RunOutputs<'_, '_>,
        f: impl FnOnce(&dyn FirstStage, &mut Runner, &mut dyn FnMut(Progress)) -> Result<T>,
    ) -> Result<T> {
        let mut clock = StageClock::start("image encode");
        // A kept decoder without its encoder is freed for the full VAE.
        let reused = out.kept.as_deref_mut().and_then(|k| k.vae.take()).filter(|(encoder, _)| *encoder);
        let was_kept = reused.is_some();
        let vae = match reused {
            Some((_, vae)) => vae,
            None => kept::load_or_free(&mut out.kept, || self.load_first_stage(true))?,
        };
        let start = vae.params().and_then(|w| kept::begin(w, was_kept));
        clock.lap(out.report, "vae load (encode)");
        let mut runner = self.runner(Module::Vae, &self.opts.devices.vae, None);
        let result = f(vae.as_ref(), &mut runner, &mut *out.progress)?;
        if let Some(w) = vae.params() {
            record_module(out.report, Module::Vae, w, &runner);
            kept::record(out.report, Module::Vae, w, start);
        }
        if let Some(k) = out.kept.as_deref_mut() {
            k.vae = Some((true, vae));
        }
        clock.finish(out);
        Ok(result)
    }

    /// Sampling: every pass (the generated size, then the hires fix's target) of every image.
    fn sample_latents(
        &self,
        request: &Request,
        texts: &Texts,
        start: &Start,
        out: &mut RunOutputs<'_, '_>,
    ) -> Result<Vec<Vec<f32>>> {
        let p = &request.params;
        let mut clock = StageClock::start("sampling");
        let key = p.guidance.to_bits();
        let reused = out.kept.as_deref_mut().and_then(|k| k.unet.take()).filter(|(g, _)| *g == key);
        let was_kept = reused.is_some();
        let unet = match reused {
            Some((_, unet)) => unet,
            None => kept::load_or_free(&mut out.kept, || self.load_diffusion(p.guidance))?,
        };
        let staged_from = kept::begin(unet.weights(), was_kept);
        clock.lap(out.report, "unet load");
        let mut control = self.control_stage(request, &mut clock, out)?;
        let mut runner =
            self.runner(Module::Diffusion, &self.opts.devices.diffusion, self.opts.devices.diffusion_split.as_ref());
        let scale = self.latent_scale();
        let first_dims = (p.width / scale, p.height / scale);
        let mut latents: Vec<Vec<f32>> = Vec::with_capacity(p.batch_count);
        // Where each pass's images start from: the init latent (or noise), then the first
        // pass's latents upscaled.
        let mut from = PassStart::Init;
        for (index, (dims, sigmas)) in self.passes(request, start)?.into_iter().enumerate() {
            if index == 1 {
                from = self.second_pass_start(request, std::mem::take(&mut latents), (first_dims, dims))?;
            }
            let channels = self.family.latent_channels();
            let pass = Pass { request, texts, start, unet: unet.as_ref(), dims, first_dims, channels, sigmas: &sigmas };
            for images in image_groups(&runner, p.batch_count) {
                let x = self.sample_group(&pass, images, &mut from, &mut runner, control.as_mut(), out)?;
                latents.extend(x.chunks_exact(pass.per_image()).map(<[f32]>::to_vec));
            }
        }
        let moved = unet.weights().stats();
        tracing::debug!(
            "unet params {}; {}; copied {:.1} MiB to {} in {:.2} s",
            unet.weights().home_description(),
            runner.summary(),
            moved.copied_bytes as f64 / 1048576.0,
            runner.backends().iter().map(|b| b.device().name()).collect::<Vec<_>>().join("&"),
            moved.copy_nanos as f64 * 1e-9
        );
        record_module(out.report, Module::Diffusion, unet.weights(), &runner);
        kept::record(out.report, Module::Diffusion, unet.weights(), staged_from);
        if let Some(c) = &control {
            tracing::debug!("controlnet params {}; {}", c.model.weights.home_description(), c.runner.summary());
            record_module(out.report, Module::ControlNet, &c.model.weights, &c.runner);
        }
        drop(control);
        clock.finish(out);
        drop(runner);
        if let Some(k) = out.kept.as_deref_mut() {
            k.unet = Some((key, unet));
        }
        Ok(latents)
    }

    /// The ControlNet, loaded for sampling (and released after it) when the request has a
    /// control image and the pipeline a ControlNet.
    fn control_stage(
        &self,
        request: &Request,
        clock: &mut StageClock,
        out: &mut RunOutputs<'_, '_>,
    ) -> Result<Option<ControlStage>> {
        let p = &request.params;
        match (&p.control_image, self.control_net.is_some()) {
            (Some(image), true) => {
                let Some(model) = kept::load_or_free(&mut out.kept, || self.load_control_net())? else {
                    return Ok(None);
                };
                clock.lap(out.report, "controlnet load");
                let runner = self.runner(Module::ControlNet, &self.opts.devices.controlnet, None);
                let hint = crate::image_io::to_planar(image);
                Ok(Some(ControlStage { model, runner, hint, strength: p.control_strength }))
            }
            (Some(_), false) => {
                tracing::warn!("a control image without a ControlNet is not used");
                Ok(None)
            }
            (None, _) => Ok(None),
        }
    }

    /// The sampling passes, each a latent size and its sigmas: the generated size, then the
    /// hires fix's target from the first pass's latents upscaled (the reference's second
    /// sampling, each image's generator seeded again as for the first).
    fn passes(&self, request: &Request, start: &Start) -> Result<Vec<PassSize>> {
        let p = &request.params;
        let scale = self.latent_scale();
        let mut passes = vec![((p.width / scale, p.height / scale), start.sigmas.clone())];
        if let Some(h) = &p.hires {
            let (hw, hh) = (h.width / scale, h.height / scale);
            let steps = crate::hires::second_pass_schedule_steps(h, p.steps);
            let ctx = ScheduleContext { ays: self.family.sampling().ays, image_seq_len: hw * hh };
            let schedule = start.schedule.for_image(steps, hw * hh);
            let full = request.scheduler.sigmas_for(steps, &schedule, &ctx)?;
            let tail = img2img_sigmas(&full, h.strength())?;
            tracing::info!(
                "hires fix: {}x{}, scheduler steps {steps}, denoising strength {:.2}, {} sigmas",
                h.width,
                h.height,
                h.strength(),
                tail.len()
            );
            passes.push(((hw, hh), tail));
        }
        Ok(passes)
    }

    /// Where the hires fix's pass starts: the first pass's `latents` upscaled in latent space,
    /// or (an image upscaler) decoded, upscaled and encoded again image by image as sampling
    /// reaches them; `dims` are the two passes' latent sizes.
    fn second_pass_start(
        &self,
        request: &Request,
        latents: Vec<Vec<f32>>,
        (from, to): ((usize, usize), (usize, usize)),
    ) -> Result<PassStart> {
        let Some(h) = &request.params.hires else { return Ok(PassStart::Init) };
        if h.upscaler.is_latent() {
            let up = |l: &Vec<f32>| crate::hires::upscale_latent(l, from, to, h.upscaler);
            return Ok(PassStart::Latents(latents.iter().map(up).collect()));
        }
        let vae = self.load_first_stage(true)?;
        let runner = self.runner(Module::Vae, &self.opts.devices.vae, None);
        Ok(PassStart::Images(Box::new(ImageUpscale { vae, runner, latents, upscaler: h.upscaler })))
    }

    /// Samples one group of the batch's `images` through `pass`: the latents of the group's
    /// images, concatenated.
    fn sample_group(
        &self,
        pass: &Pass<'_>,
        images: Range<usize>,
        from: &mut PassStart,
        runner: &mut Runner,
        mut control: Option<&mut ControlStage>,
        out: &mut RunOutputs<'_, '_>,
    ) -> Result<Vec<f32>> {
        let (request, start) = (pass.request, pass.start);
        let p = &request.params;
        let mut rngs: Vec<Box<dyn NoiseRng>> =
            images.clone().map(|b| p.rng.seeded(p.seed.wrapping_add(b as u64))).collect();
        let x = self.initial_latents(pass, images.start, from, &mut rngs)?;
        let mut rng = ImagesRng(rngs);
        let warned = Cell::new(false);
        let model = |inp: ModelInput<'_>| -> Result<ModelOutput> {
            let out = eval_pass(pass, runner, control.as_deref_mut(), &inp, images.len())?;
            // One warning per image: a broken model is broken at every step.
            if !warned.get() {
                let which = match images.len() {
                    1 => format!("image {}", images.start + 1),
                    n => format!("images {} to {}", images.start + 1, images.start + n),
                };
                let stage = format!("diffusion model output at timestep {:.0} of {which}", inp.timestep);
                warned.set(health::check(&stage, &out.cond, ACTIVATIONS));
            }
            Ok(out)
        };
        let mut denoiser = GuidedDenoiser::new(&start.schedule, self.prediction, request.cfg_scale, model)
            .with_skip_layer_guidance(p.slg.clone())
            .with_image_guidance(request.img_cfg);
        let with_uncond = request.method.needs_uncond_denoised();
        let mut step_start = Instant::now();
        let mut denoise = |x: &[f32], sigma: f32, step: Step| -> Result<Denoised> {
            self.check_cancel()?;
            let mut d = denoiser.denoise_full::<PipelineError>(x, sigma, step, with_uncond)?;
            if let (Some(m), Some(init)) = (&start.denoise_mask, &start.init_latent) {
                inpaint::blend(&mut d.pred, init, m);
            }
            if step.last_eval {
                self.step_done(pass, images.clone(), step, &d.pred, step_start.elapsed().as_secs_f64(), out);
                step_start = Instant::now();
            }
            Ok(d)
        };
        let eta = p.eta.unwrap_or_else(|| request.method.default_eta());
        if start.schedule.is_flow() {
            Ok(sample_flow(request.method, &mut denoise, x, pass.sigmas, &mut rng, eta)?)
        } else {
            Ok(sample(request.method, &mut denoise, x, pass.sigmas, &mut rng, eta)?)
        }
    }

    /// The noised latents a group of images (the first is `first`) starts sampling from, each
    /// drawing its noise from its own generator in `rngs`.
    fn initial_latents(
        &self,
        pass: &Pass<'_>,
        first: usize,
        from: &mut PassStart,
        rngs: &mut [Box<dyn NoiseRng>],
    ) -> Result<Vec<f32>> {
        let p = &pass.request.params;
        let per_image = pass.per_image();
        let sigma0 = pass.sigmas[0];
        let mut x = Vec::with_capacity(per_image * rngs.len());
        for (k, rng) in rngs.iter_mut().enumerate() {
            let from_image;
            let init = match from {
                PassStart::Init => pass.start.init_latent.as_deref(),
                PassStart::Latents(u) => Some(&u[first + k][..]),
                PassStart::Images(state) => {
                    from_image = hires_image_upscale(
                        self.hires_model.as_ref(),
                        state.vae.as_ref(),
                        &mut state.runner,
                        &state.latents[first + k],
                        (pass.first_dims, pass.dims),
                        state.upscaler,
                        &p.tiling,
                        rng.as_mut(),
                    )?;
                    Some(&from_image[..])
                }
            };
            let noise = rng.randn(per_image);
            x.extend(match init {
                None => txt2img_latent(&noise, sigma0),
                Some(init) => match &pass.start.schedule {
                    Schedule::Flow(flow) => flow.noised_latent(init, &noise, sigma0)?,
                    Schedule::Discrete(_) => noised_latent(init, &noise, sigma0)?,
                },
            });
        }
        Ok(x)
    }

    /// After a sampling step's last model evaluation: its time in the report and to the
    /// observer for each image of the group (in lockstep one step serves every image), and each
    /// image's denoised latent to the latent hook.
    fn step_done(
        &self,
        pass: &Pass<'_>,
        images: Range<usize>,
        step: Step,
        pred: &[f32],
        seconds: f64,
        out: &mut RunOutputs<'_, '_>,
    ) {
        let batch = pass.request.params.batch_count;
        for b in images.clone() {
            out.report.steps.push(StepTime { image: b, step: step.index, seconds });
            // The front end shows it (sd-cli: a bar, or an info line).
            (out.progress)(Progress::Step { image: b, images: batch, step: step.index, steps: step.count, seconds });
        }
        let Some(hook) = &self.latent_hook else { return };
        let (channels, per_image) = (pass.channels, pass.per_image());
        for (k, b) in images.enumerate() {
            let Some(latent) = pred.get(k * per_image..(k + 1) * per_image) else { break };
            let (width, height) = pass.dims;
            hook(&StepLatent { image: b, step: step.index, steps: step.count, channels, width, height, latent });
        }
    }

    /// Decode: every latent through the VAE, at the hires target's size after a hires pass.
    fn decode_latents(
        &self,
        request: &Request,
        latents: Vec<Vec<f32>>,
        out: &mut RunOutputs<'_, '_>,
    ) -> Result<Vec<Image>> {
        let p = &request.params;
        let size = p.hires.as_ref().map_or((p.width, p.height), |h| (h.width, h.height));
        self.check_cancel()?;
        let mut clock = StageClock::start("decode");
        let reused = out.kept.as_deref_mut().and_then(|k| k.vae.take());
        let was_kept = reused.is_some();
        let (encoder, vae) = match reused {
            Some(v) => v,
            None => (false, kept::load_or_free(&mut out.kept, || self.load_first_stage(false))?),
        };
        let start = vae.params().and_then(|w| kept::begin(w, was_kept));
        clock.lap(out.report, "vae load");
        let mut runner = self.runner(Module::Vae, &self.opts.devices.vae, None);
        let count = latents.len();
        let mut images = Vec::with_capacity(count);
        for (image, latent) in latents.into_iter().enumerate() {
            let mut on_tile = |done: usize, tiles: usize| {
                (out.progress)(Progress::Tile { stage: "decode", image, images: count, done, tiles })
            };
            images.push(self.decode_one(vae.as_ref(), &mut runner, latent, size, request, &mut on_tile, image)?);
        }
        tracing::debug!("vae; {}", runner.summary());
        if let Some(w) = vae.params() {
            record_module(out.report, Module::Vae, w, &runner);
            kept::record(out.report, Module::Vae, w, start);
        }
        drop(runner);
        if let Some(k) = out.kept.as_deref_mut() {
            k.vae = Some((encoder, vae));
        }
        clock.finish(out);
        Ok(images)
    }

    /// One latent decoded to an image of `(width, height)` pixels (image `index` of the batch).
    #[allow(clippy::too_many_arguments)]
    fn decode_one(
        &self,
        vae: &dyn FirstStage,
        runner: &mut Runner,
        mut latent: Vec<f32>,
        (width, height): (usize, usize),
        request: &Request,
        on_tile: &mut dyn FnMut(usize, usize),
        index: usize,
    ) -> Result<Image> {
        let p = &request.params;
        vae.diffusion_to_vae(&mut latent);
        let scale = self.latent_scale();
        let dims = (width / scale, height / scale);
        let channels = self.family.latent_channels();
        let img = sd_vae::decode_tiled_observed(
            vae,
            runner,
            &latent,
            dims,
            channels,
            &p.tiling,
            p.vae_max_compute_bytes,
            on_tile,
        )?;
        let (lo, hi) = match vae.image_range() {
            sd_vae::ImageRange::MinusOneToOne => (-1.0, 1.0),
            sd_vae::ImageRange::ZeroToOne => (0.0, 1.0),
        };
        health::check(&format!("VAE decoder (image {})", index + 1), &img, health::Expect::Image { lo, hi });
        Ok(planar_to_rgb8(&img, width, height, vae.image_range()))
    }
}

/// The groups of the batch's images sampled together: each image alone, as the reference, or,
/// for a split module that overlaps micro-batches across its devices (`pipeline_copies` > 1),
/// the whole batch in lockstep: one model evaluation per step covers every image, so the
/// micro-batches have images to overlap even without guidance. Each image still draws its noise
/// from its own generator, in its own order ([`ImagesRng`]), so the sampling math is the same.
fn image_groups(runner: &Runner, batch: usize) -> Vec<Range<usize>> {
    if runner.micro_batches(batch) > 1 {
        tracing::debug!("{batch} images sampled in lockstep for the pipelined split");
        std::iter::once(0..batch).collect()
    } else {
        (0..batch).map(|b| b..b + 1).collect()
    }
}

/// One guided evaluation of a pass's diffusion model on `inp` for `images` images, with an
/// inpainting UNet's extra channels appended to each image's latent.
fn eval_pass(
    pass: &Pass<'_>,
    runner: &mut Runner,
    control: Option<&mut ControlStage>,
    inp: &ModelInput<'_>,
    images: usize,
) -> Result<ModelOutput> {
    let with_concat: Vec<f32>;
    let x = match &pass.start.concat {
        None => inp.x,
        Some(c) => {
            with_concat = inp.x.chunks_exact(pass.per_image()).flat_map(|xi| xi.iter().chain(c).copied()).collect();
            &with_concat
        }
    };
    let texts = pass.texts;
    let mut out = eval_guided(
        pass.unet,
        runner,
        x,
        pass.dims,
        images,
        inp.timestep,
        &texts.cond,
        texts.uncond.as_ref().filter(|_| inp.uncond),
        control.map(|c| (c, inp.x)),
    )?;
    // The image guidance: the negative prompt without the reference images.
    if let (true, Some(iu)) = (inp.img_uncond, texts.img_uncond.as_ref()) {
        let (times, conds) = (vec![inp.timestep; images], vec![iu; images]);
        out.img_uncond = Some(pass.unet.eval(runner, x, pass.dims, &times, &conds)?);
    }
    // Skip-layer guidance: the prompt's prediction again, some blocks left out.
    if let Some(layers) = inp.skip_layers {
        let (times, conds) = (vec![inp.timestep; images], vec![&texts.cond; images]);
        out.skipped = Some(pass.unet.eval_skipping_layers(runner, x, pass.dims, &times, &conds, layers)?);
    }
    Ok(out)
}

/// Pixels in `[0, 1]` in the range the VAE takes.
fn to_vae_range(vae: &dyn FirstStage, x: &[f32]) -> Vec<f32> {
    match vae.image_range() {
        sd_vae::ImageRange::MinusOneToOne => x.iter().map(|v| v * 2.0 - 1.0).collect(),
        sd_vae::ImageRange::ZeroToOne => x.to_vec(),
    }
}

/// Adds `module`'s residency and its runner's work to `report`.
fn record_module(report: &mut RunReport, module: Module, w: &Weights, runner: &Runner) {
    report.modules.push(ModuleReport::of(module_name(module), w, runner));
    report.runners.push(RunnerReport::of(runner, w));
}
/// One guided model evaluation of `images` latents (concatenated in `x`, sampled in lockstep):
/// every image's cond pass and then every image's uncond pass as one batch when their shapes
/// agree (the same numbers as separate runs to a few f16 ulps, fewer graph launches), else the
/// cond passes and the uncond passes as two batches.
#[allow(clippy::too_many_arguments)]
fn eval_guided(
    model: &dyn DiffusionModel,
    runner: &mut Runner,
    x: &[f32],
    dims: (usize, usize),
    images: usize,
    timestep: f32,
    cond: &Conditioning,
    uncond: Option<&Conditioning>,
    mut control: Option<(&mut ControlStage, &[f32])>,
) -> Result<ModelOutput> {
    let times = vec![timestep; images];
    let conds = vec![cond; images];
    // The ControlNet's residuals for a batch of `n` copies of the latents under `cs`.
    let mut residuals = |n: usize, cs: &[&Conditioning]| -> Result<Option<ControlResiduals>> {
        let Some((stage, latent)) = control.as_mut() else { return Ok(None) };
        let lx: Vec<f32> = std::iter::repeat_n(*latent, n).flatten().copied().collect();
        Ok(Some(stage.residuals(&lx, dims, &vec![timestep; cs.len()], cs)?))
    };
    match uncond {
        None => {
            let r = residuals(1, &conds)?;
            let c = model.eval_controlled(runner, x, dims, &times, &conds, r.as_ref())?;
            Ok(ModelOutput { cond: c, uncond: None, skipped: None, img_uncond: None })
        }
        Some(u) if u.batches_with(cond) => {
            let mut xx = Vec::with_capacity(2 * x.len());
            xx.extend_from_slice(x);
            xx.extend_from_slice(x);
            let both: Vec<&Conditioning> = conds.iter().copied().chain(std::iter::repeat_n(u, images)).collect();
            let r = residuals(2, &both)?;
            let times2 = [&times[..], &times[..]].concat();
            let mut out = model.eval_controlled(runner, &xx, dims, &times2, &both, r.as_ref())?;
            // Each half is one output per image (an inpainting UNet's input has more channels).
            let un = out.split_off(out.len() / 2);
            Ok(ModelOutput { cond: out, uncond: Some(un), skipped: None, img_uncond: None })
        }
        Some(u) => {
            let r = residuals(1, &conds)?;
            let c = model.eval_controlled(runner, x, dims, &times, &conds, r.as_ref())?;
            let uncs = vec![u; images];
            let r = residuals(1, &uncs)?;
            let un = model.eval_controlled(runner, x, dims, &times, &uncs, r.as_ref())?;
            Ok(ModelOutput { cond: c, uncond: Some(un), skipped: None, img_uncond: None })
        }
    }
}

/// The sampler's noise for images sampled in lockstep: a draw for all of them (their latents
/// concatenated) takes an equal share from each image's own generator, in image order, so each
/// image gets the values it would get sampled alone.
struct ImagesRng(Vec<Box<dyn NoiseRng>>);

impl NoiseRng for ImagesRng {
    fn randn(&mut self, n: usize) -> Vec<f32> {
        match self.0.as_mut_slice() {
            many if !many.is_empty() && n.is_multiple_of(many.len()) => {
                let share = n / many.len();
                many.iter_mut().flat_map(|r| r.randn(share)).collect()
            }
            // A draw that is not one share per image (no sampler makes one): nothing, which the
            // sampler reports as noise of the wrong length rather than using another image's.
            _ => Vec::new(),
        }
    }
}

/// Encodes an image (in the model's range) to a diffusion-space latent.
fn encode_latent(
    vae: &dyn FirstStage,
    runner: &mut Runner,
    px: &[f32],
    (w, h): (usize, usize),
    tiling: &TilingParams,
    rng: &mut dyn NoiseRng,
    on_tile: &mut dyn FnMut(usize, usize),
) -> Result<Vec<f32>> {
    let (out, c) = sd_vae::encode_tiled_observed(vae, runner, px, (w, h), 3, tiling, None, on_tile)?;
    let s = vae.scale_factor();
    let (lw, lh) = (w / s, h / s);
    let latent_c = vae.latent_channels();
    let mut latent = if c == 2 * latent_c {
        let dist = sd_vae::LatentDistribution::from_moments(&out, (lw, lh), c)?;
        let noise = rng.randn(latent_c * lw * lh);
        dist.sample(&noise)?
    } else {
        out
    };
    vae.vae_to_diffusion(&mut latent);
    Ok(latent)
}

/// The reference images' latents (`-r`), each at its size as `check_request` fitted it,
/// drawn from `rng` (FLUX.1's VAE samples; FLUX.2's takes the mean and draws nothing).
fn encode_refs(
    vae: &dyn FirstStage,
    runner: &mut Runner,
    progress: &mut dyn FnMut(Progress),
    request: &Request,
    rng: &mut dyn NoiseRng,
) -> Result<Vec<ReferenceLatent>> {
    let p = &request.params;
    let images = p.ref_images.len();
    let mut refs = Vec::with_capacity(images);
    for (image, ref_image) in p.ref_images.iter().enumerate() {
        let (w, h) = (ref_image.width, ref_image.height);
        let mut on_tile = |done: usize, tiles: usize| {
            progress(Progress::Tile { stage: "reference image encode", image, images, done, tiles })
        };
        let px = to_vae_range(vae, &crate::image_io::to_planar(ref_image));
        let data = encode_latent(vae, runner, &px, (w, h), &p.tiling, &mut *rng, &mut on_tile)?;
        let s = vae.scale_factor();
        refs.push(ReferenceLatent { data, width: w / s, height: h / s });
    }
    Ok(refs)
}

/// The hires fix's image upscalers: the first pass's `latent` decoded, resized in pixels as
/// [`crate::hires::upscale_image`] and encoded again (the encoder sampling from `rng`), as
/// the reference's `upscale_hires_latent`; sizes are the latent's, `(from, to)`.
#[allow(clippy::too_many_arguments)]
fn hires_image_upscale(
    model: Option<&std::sync::Mutex<crate::upscale::Upscaler>>,
    vae: &dyn FirstStage,
    runner: &mut Runner,
    latent: &[f32],
    (from, to): ((usize, usize), (usize, usize)),
    upscaler: crate::hires::HiresUpscaler,
    tiling: &TilingParams,
    rng: &mut dyn NoiseRng,
) -> Result<Vec<f32>> {
    let mut latent = latent.to_vec();
    vae.diffusion_to_vae(&mut latent);
    let channels = latent.len() / (from.0 * from.1);
    let img = sd_vae::decode_tiled_observed(vae, runner, &latent, from, channels, tiling, None, &mut |_, _| {})?;
    let range = vae.image_range();
    // The decoder's output in [0, 1] (the reference clamps a [-1, 1] decoder's output there).
    let unit: Vec<f32> = match range {
        sd_vae::ImageRange::MinusOneToOne => img.iter().map(|v| ((v + 1.0) * 0.5).clamp(0.0, 1.0)).collect(),
        sd_vae::ImageRange::ZeroToOne => img,
    };
    let scale = vae.scale_factor();
    let (pw, ph) = (from.0 * scale, from.1 * scale);
    let (tw, th) = (to.0 * scale, to.1 * scale);
    let up = match (upscaler, model) {
        (crate::hires::HiresUpscaler::Model, Some(m)) => {
            let mut m = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let (out, size) = m.upscale_planar(&unit, (pw, ph)).map_err(|e| PipelineError::Invalid(e.to_string()))?;
            // Not clamped, as the reference; nearest to the target when the model's factor misses it.
            crate::hires::resize_planes(&out, size, (tw, th), crate::hires::Filter::Nearest, false)
        }
        _ => crate::hires::upscale_image(&unit, (pw, ph), (tw, th), upscaler),
    };
    let px: Vec<f32> = match range {
        sd_vae::ImageRange::MinusOneToOne => up.iter().map(|v| v * 2.0 - 1.0).collect(),
        sd_vae::ImageRange::ZeroToOne => up,
    };
    encode_latent(vae, runner, &px, (tw, th), tiling, rng, &mut |_, _| {})
}
