//! Opening model files: memory maps, format sniffing, diffusers folders, component files.
//!
//! Every file is memory-mapped and only its header is parsed, so opening a multi-GiB
//! checkpoint touches a few header pages and costs milliseconds; tensor bytes are paged in
//! only when [`ModelFiles::bytes`] slices are read.
//!
//! Sources combine as in sd.cpp: `-m` (a single-file checkpoint, a GGUF, or a diffusers
//! folder) first, then the component files `--diffusion-model`, `--vae`, `--clip_l`,
//! `--clip_g`, `--taesd`, `--t5xxl`. A component file **replaces** every tensor of its component that earlier
//! sources gave (so `-m model.safetensors --vae other.safetensors` uses the other VAE whole,
//! never a mix); sd.cpp gets the same effect by letting later names overwrite earlier ones.
//! Within one file, two stored names that normalize to one internal name are an error.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::arch::{self, Detected, Prediction};
use super::error::{FilesError, FormatError};
use super::gguf::{self, GgufValue};
use super::index::{prefix_component, Component, FileFormat, SourceFile, TensorEntry, TensorIndex};
use super::names::{normalize, FileRole, Normalized, QkvPart};
use super::safetensors::{self, expected_bytes};
use super::RawTensor;

/// The model files a user named (the reference's `-m`, `--diffusion-model`, `--vae`,
/// `--clip_l`, `--clip_g`, `--taesd`, `--t5xxl`, `--llm`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelSources {
    /// `-m`: a single-file checkpoint (safetensors or GGUF) or a diffusers folder.
    pub model: Option<PathBuf>,
    /// `--diffusion-model`: the UNet alone.
    pub diffusion_model: Option<PathBuf>,
    /// `--vae`: the VAE alone.
    pub vae: Option<PathBuf>,
    /// `--clip_l`: the CLIP-L text encoder alone.
    pub clip_l: Option<PathBuf>,
    /// `--clip_g`: the OpenCLIP ViT-bigG text encoder alone (SDXL's second).
    pub clip_g: Option<PathBuf>,
    /// `--taesd`: the tiny autoencoder.
    pub taesd: Option<PathBuf>,
    /// `--t5xxl`: the T5-XXL text encoder alone.
    pub t5xxl: Option<PathBuf>,
    /// `--llm`: an LLM text encoder alone (Qwen3 for Z-Image and FLUX.2 klein).
    pub llm: Option<PathBuf>,
}

impl ModelSources {
    /// Sources with only `-m`.
    pub fn model(path: impl Into<PathBuf>) -> Self {
        ModelSources { model: Some(path.into()), ..Self::default() }
    }
}

enum Mapping {
    Map(Mmap),
    /// A zero-length file (which cannot be mapped); it is rejected as truncated anyway.
    Empty,
}

impl Mapping {
    fn bytes(&self) -> &[u8] {
        match self {
            Mapping::Map(m) => m,
            Mapping::Empty => &[],
        }
    }
}

/// One opened file: its map, the open handle and what it looked like at open, so that a
/// truncation or rewrite during the run is seen before bytes are read (see [`super::guard`]).
struct Opened {
    map: Mapping,
    file: File,
    len: u64,
    modified: Option<std::time::SystemTime>,
    #[cfg(unix)]
    _guard: Option<super::guard::Registration>,
}

/// The opened model: a [`TensorIndex`] plus the memory maps its byte ranges point into.
pub struct ModelFiles {
    index: TensorIndex,
    maps: Vec<Opened>,
}

impl std::fmt::Debug for ModelFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFiles").field("files", &self.index.files()).field("tensors", &self.index.len()).finish()
    }
}

/// One parsed file, before its names are normalized.
struct Parsed {
    file: SourceFile,
    map: Opened,
    raw: Vec<RawTensor>,
}

impl ModelFiles {
    /// Opens every file of `sources`, parses their headers and builds the index.
    pub fn open(sources: &ModelSources) -> Result<Self, FilesError> {
        let mut parsed: Vec<Parsed> = Vec::new();
        if let Some(m) = &sources.model {
            if m.is_dir() {
                parsed.extend(open_diffusers(m)?);
            } else {
                parsed.push(open_file(m, FileRole::Checkpoint)?);
            }
        }
        let components = [
            (&sources.diffusion_model, FileRole::DiffusionModel),
            (&sources.vae, FileRole::Vae),
            (&sources.clip_l, FileRole::TextEncoder(0)),
            (&sources.clip_g, FileRole::TextEncoder(1)),
            (&sources.taesd, FileRole::Taesd),
            (&sources.t5xxl, FileRole::T5xxl),
            (&sources.llm, FileRole::Llm),
        ];
        for (path, role) in components {
            if let Some(p) = path {
                let opened = open_file(p, role)?;
                // Before anything is sized or loaded: a file of another component in this
                // slot would otherwise fail late, as missing tensors or a memory check.
                if let Some(found) = super::names::misplaced_role(role, opened.raw.iter().map(|t| t.name.as_str())) {
                    return Err(FilesError::WrongComponent { path: p.clone(), found, given: role });
                }
                parsed.push(opened);
            }
        }
        if parsed.is_empty() {
            return Err(FilesError::NoModel);
        }

        let mut files = Vec::with_capacity(parsed.len());
        let mut maps = Vec::with_capacity(parsed.len());
        let mut entries: Vec<TensorEntry> = Vec::new();
        for (i, p) in parsed.into_iter().enumerate() {
            let new = file_entries(i, &p.file, p.raw)?;
            if let Some(replaced) = replaced_component(p.file.role) {
                let before = entries.len();
                entries.retain(|e| prefix_component(&e.name) != replaced);
                if entries.len() != before {
                    tracing::info!(
                        file = %p.file.path.display(),
                        replaced = before - entries.len(),
                        ?replaced,
                        "component file replaces the tensors of this component given earlier"
                    );
                }
            }
            entries.extend(new);
            files.push(p.file);
            maps.push(p.map);
        }
        let index = TensorIndex::new(files, entries)?;
        index.check_weight_dtypes()?;
        tracing::debug!(tensors = index.len(), files = index.files().len(), "model files indexed");
        Ok(ModelFiles { index, maps })
    }

    /// Opens a single checkpoint, GGUF or diffusers folder (`-m` alone).
    pub fn open_model(path: impl Into<PathBuf>) -> Result<Self, FilesError> {
        Self::open(&ModelSources::model(path))
    }

    /// The index of every tensor.
    pub fn index(&self) -> &TensorIndex {
        &self.index
    }

    /// The stored bytes of `entry`, borrowed from the memory map (paged in on first read).
    ///
    /// # Panics
    /// If `entry` does not come from this `ModelFiles` (its file index or byte range does not
    /// fit): that is a bug of the caller, since every range was checked at open.
    pub fn bytes(&self, entry: &TensorEntry) -> &[u8] {
        let map = self.maps.get(entry.file).expect("TensorEntry from another ModelFiles").map.bytes();
        let (start, end) = (entry.offset as usize, (entry.offset + entry.len) as usize);
        map.get(start..end).expect("TensorEntry byte range was validated at open")
    }

    /// The memory map of source file `file` (an index into [`TensorIndex::files`]), so the
    /// loader can release pages it has copied; `None` for an empty (unmapped) file.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub fn mmap(&self, file: usize) -> Option<&Mmap> {
        match &self.maps.get(file)?.map {
            Mapping::Map(m) => Some(m),
            Mapping::Empty => None,
        }
    }

    /// Fails when source file `file` no longer has the size and modification time it had at
    /// open (truncated, grown or rewritten in place by another process): its mapped bytes can
    /// no longer be trusted, and reading past a new end would fault.
    pub fn check_unchanged(&self, file: usize) -> Result<(), FilesError> {
        let Some(o) = self.maps.get(file) else { return Ok(()) };
        let path = &self.index.files()[file].path;
        let meta = o.file.metadata().map_err(|e| io_err(path, e))?;
        if meta.len() != o.len {
            return Err(FilesError::Changed {
                path: path.clone(),
                what: format!("it was {} bytes when opened and is {} now", o.len, meta.len()),
            });
        }
        if meta.modified().ok() != o.modified {
            return Err(FilesError::Changed {
                path: path.clone(),
                what: "it was rewritten after it was opened".into(),
            });
        }
        Ok(())
    }

    /// The entry and bytes of the tensor with this internal name.
    pub fn tensor(&self, name: &str) -> Option<(&TensorEntry, &[u8])> {
        self.index.get(name).map(|e| (e, self.bytes(e)))
    }

    /// Detects the architecture with the registered [`arch::ArchSpec`]s; `prediction`
    /// overrides what the files say (`--prediction`).
    pub fn detect(&self, prediction: Option<Prediction>) -> Result<Detected, FilesError> {
        arch::detect(&self.index, prediction)
    }
}

fn replaced_component(role: FileRole) -> Option<Component> {
    match role {
        FileRole::DiffusionModel => Some(Component::Diffusion),
        FileRole::Vae => Some(Component::Vae),
        FileRole::TextEncoder(i) => Some(Component::TextEncoder(i)),
        FileRole::Taesd => Some(Component::Taesd),
        FileRole::T5xxl => Some(Component::TextEncoder(2)),
        FileRole::Llm => Some(Component::TextEncoder(3)),
        FileRole::Checkpoint => None,
    }
}

fn io_err(path: &Path, error: std::io::Error) -> FilesError {
    FilesError::Io { path: path.to_owned(), error }
}

fn map_file(path: &Path) -> Result<Opened, FilesError> {
    let (file, meta) = super::open::open_regular(path)?;
    let (len, modified) = (meta.len(), meta.modified().ok());
    if len == 0 {
        return Ok(Opened {
            map: Mapping::Empty,
            file,
            len,
            modified,
            #[cfg(unix)]
            _guard: None,
        });
    }
    // SAFETY: the map is read-only and lives as long as the slices borrowed from it. Another
    // process truncating or rewriting the file while it is mapped would change or fault those
    // bytes: the loader checks size and modification time before each read
    // (`check_unchanged`), and a fault during a read ends the run with a message naming the
    // file instead of a bare SIGBUS (`guard`).
    let map = unsafe { Mmap::map(&file) }.map_err(|e| io_err(path, e))?;
    #[cfg(unix)]
    let guard = Some(super::guard::register(map.as_ptr(), map.len(), path));
    Ok(Opened {
        map: Mapping::Map(map),
        file,
        len,
        modified,
        #[cfg(unix)]
        _guard: guard,
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sniffed {
    Safetensors,
    Gguf,
}

fn sniff(path: &Path, bytes: &[u8]) -> Option<Sniffed> {
    if bytes.starts_with(&gguf::MAGIC) {
        return Some(Sniffed::Gguf);
    }
    let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("gguf") => Some(Sniffed::Gguf),
        Some("safetensors") => Some(Sniffed::Safetensors),
        _ if bytes.get(8) == Some(&b'{') => Some(Sniffed::Safetensors),
        _ => None,
    }
}

/// How a file of no known format starts, in words (for a message that echoes none of its
/// bytes).
fn describe_start(bytes: &[u8]) -> &'static str {
    let head = &bytes[..bytes.len().min(512)];
    if head.is_empty() {
        "it is empty"
    } else if head.starts_with(b"PK\x03\x04") {
        "it is a ZIP archive, as PyTorch .ckpt/.pt files are: convert it to safetensors"
    } else if head.starts_with(&[0x80]) {
        "it is a Python pickle, as old PyTorch files are: convert it to safetensors"
    } else if !head.contains(&0) && std::str::from_utf8(head).map_or_else(|e| e.error_len().is_none(), |_| true) {
        // (A character cut by the 512-byte window is still text.)
        "it is text"
    } else {
        "its first bytes match no model format"
    }
}

/// Maps and parses one file.
fn open_file(path: &Path, role: FileRole) -> Result<Parsed, FilesError> {
    let map = map_file(path)?;
    let len = map.len;
    let bytes = map.map.bytes();
    let malformed = |problem: FormatError| FilesError::Malformed { path: path.to_owned(), problem };
    let (format, metadata, raw) = match sniff(path, bytes) {
        Some(Sniffed::Safetensors) => {
            let h = safetensors::parse(bytes).map_err(malformed)?;
            let meta = h.metadata.into_iter().map(|(k, v)| (k, GgufValue::String(v))).collect();
            (FileFormat::Safetensors, meta, h.tensors)
        }
        Some(Sniffed::Gguf) => {
            let h = gguf::parse(bytes).map_err(malformed)?;
            (FileFormat::Gguf { version: h.version, alignment: h.alignment }, h.metadata, h.tensors)
        }
        None => return Err(FilesError::UnknownFormat { path: path.to_owned(), what: describe_start(bytes) }),
    };
    tracing::debug!(path = %path.display(), ?format, ?role, tensors = raw.len(), "parsed model file header");
    Ok(Parsed { file: SourceFile { path: path.to_owned(), format, role, len, metadata }, map, raw })
}

/// The size and tensors of one safetensors or GGUF file, from its header alone: names as
/// stored (not normalized), no role checked. The planner describes extra files (`--control-net`)
/// with it; a GGUF is told by its magic, anything else is read as safetensors.
pub fn read_header(path: &Path) -> Result<(u64, Vec<RawTensor>), FilesError> {
    let opened = map_file(path)?;
    let malformed = |problem| FilesError::Malformed { path: path.to_owned(), problem };
    if opened.len == 0 {
        return Err(malformed(FormatError::Truncated { what: "the header".into(), start: 0, end: 8, file_len: 0 }));
    }
    let bytes = opened.map.bytes();
    let raw = if bytes.starts_with(&gguf::MAGIC) {
        gguf::parse(bytes).map_err(malformed)?.tensors
    } else {
        safetensors::parse(bytes).map_err(malformed)?.tensors
    };
    Ok((opened.len, raw))
}

/// The entries of one file: names normalized, fused q/k/v projections split.
fn file_entries(file: usize, sf: &SourceFile, raw: Vec<RawTensor>) -> Result<Vec<TensorEntry>, FilesError> {
    let mut out: Vec<TensorEntry> = Vec::with_capacity(raw.len());
    let own = replaced_component(sf.role);
    let mut foreign = 0usize;
    for t in raw {
        let normalized = normalize(&t.name, sf.role);
        let first = match &normalized {
            Normalized::One(n) => n,
            Normalized::Split(n) => &n[0],
        };
        let c = prefix_component(first);
        if own.is_some_and(|own| c != own && c != Component::Other) {
            foreign += 1;
            continue;
        }
        match normalized {
            Normalized::One(name) => out.push(TensorEntry {
                name,
                original_name: t.name,
                dtype: t.dtype,
                shape: t.shape,
                file,
                offset: t.offset,
                len: t.len,
                part: None,
            }),
            Normalized::Split(names) => {
                let bad = |problem| FilesError::BadFusedProjection {
                    path: sf.path.clone(),
                    tensor: t.name.clone(),
                    shape: t.shape.clone(),
                    dtype: t.dtype.name().to_owned(),
                    problem,
                };
                let Some(&rows) = t.shape.first() else {
                    return Err(bad("it is a scalar"));
                };
                if rows % 3 != 0 || rows == 0 {
                    return Err(bad("its first dimension is not a positive multiple of 3"));
                }
                let mut shape = t.shape.clone();
                shape[0] = rows / 3;
                let third = expected_bytes(&t.name, t.dtype, &shape)
                    .map_err(|problem| FilesError::Malformed { path: sf.path.clone(), problem })?;
                if third.checked_mul(3) != Some(t.len) {
                    return Err(bad("its bytes do not divide into three equal row blocks"));
                }
                for (k, (name, part)) in names.into_iter().zip([QkvPart::Q, QkvPart::K, QkvPart::V]).enumerate() {
                    out.push(TensorEntry {
                        name,
                        original_name: t.name.clone(),
                        dtype: t.dtype,
                        shape: shape.clone(),
                        file,
                        offset: t.offset + k as u64 * third,
                        len: third,
                        part: Some(part),
                    });
                }
            }
        }
    }
    if foreign > 0 {
        tracing::warn!(
            file = %sf.path.display(),
            skipped = foreign,
            "component file also holds tensors of other components; only its own are used"
        );
    }
    Ok(out)
}

/// The safetensors file of one diffusers component folder, if present (the fp16 variant as
/// a fallback).
fn diffusers_file(root: &Path, folder: &str, stem: &str) -> Option<PathBuf> {
    [format!("{stem}.safetensors"), format!("{stem}.fp16.safetensors")]
        .into_iter()
        .map(|f| root.join(folder).join(f))
        .find(|p| p.is_file())
}

/// Largest diffusers JSON file read (real ones are a few kB).
const MAX_JSON_BYTES: u64 = 16 << 20;

fn read_json(root: &Path, rel: &str) -> Result<Option<serde_json::Value>, FilesError> {
    let path = root.join(rel);
    if !path.exists() {
        return Ok(None);
    }
    let text = super::open::read_text(&path, MAX_JSON_BYTES)?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| FilesError::Diffusers {
        path: root.to_owned(),
        problem: format!("{rel} is not valid JSON: {e}"),
    })?;
    if !value.is_object() {
        return Err(FilesError::Diffusers { path: root.to_owned(), problem: format!("{rel} is not a JSON object") });
    }
    Ok(Some(value))
}

/// The files of a diffusers folder: `unet/` (required), `vae/`, `text_encoder/`,
/// `text_encoder_2/` (optional, each with a warning when missing as sd.cpp does).
fn open_diffusers(root: &Path) -> Result<Vec<Parsed>, FilesError> {
    match read_json(root, "model_index.json")? {
        Some(index) => tracing::debug!(
            class = index.get("_class_name").and_then(|c| c.as_str()).unwrap_or("?"),
            "diffusers model_index.json"
        ),
        None => tracing::warn!(path = %root.display(), "diffusers folder has no model_index.json"),
    }
    let Some(unet) = diffusers_file(root, "unet", "diffusion_pytorch_model") else {
        return Err(FilesError::Diffusers {
            path: root.to_owned(),
            problem: "missing unet/diffusion_pytorch_model.safetensors (only safetensors weights are read)".into(),
        });
    };
    let mut out = vec![open_file(&unet, FileRole::DiffusionModel)?];
    if let Some(sched) = read_json(root, "scheduler/scheduler_config.json")? {
        if let Some(p) = sched.get("prediction_type").and_then(|p| p.as_str()) {
            out[0].file.metadata.push(("diffusers.scheduler.prediction_type".into(), GgufValue::String(p.to_owned())));
        }
    }
    let parts = [
        ("vae", "diffusion_pytorch_model", FileRole::Vae),
        ("text_encoder", "model", FileRole::TextEncoder(0)),
        ("text_encoder_2", "model", FileRole::TextEncoder(1)),
    ];
    for (folder, stem, role) in parts {
        match diffusers_file(root, folder, stem) {
            Some(p) => out.push(open_file(&p, role)?),
            None if folder == "text_encoder_2" => {}
            None => {
                tracing::warn!(path = %root.display(), folder, "diffusers folder has no {folder}/{stem}.safetensors")
            }
        }
    }
    Ok(out)
}
