//! Output files: where an output path really leads, checked before any work, written without destroying what is there.
//!
//! Rules (issue 11, row 1; issue 32, rows 10 to 13):
//! * a symbolic link is followed: the file it points to is replaced and the link stays;
//! * an existing file is never rewritten in place: the bytes go to a temporary file next to
//!   the *real* target, which is flushed to disk and then renamed over it, so a failure (a
//!   full disk) leaves the old file whole. A file with several hard links is replaced under
//!   this name only: its other names keep the old bytes;
//! * a directory, FIFO, device node or socket is refused and left untouched, as is a
//!   read-only file, a path whose directory does not exist or is not writable, and a name
//!   longer than a file system allows (255 bytes);
//! * `/dev/stdout` (`/dev/fd/1`, `/proc/self/fd/1`) writes to the standard output when it is
//!   not a terminal; the standard error is refused (messages go there);
//! * no output may be a file the run reads, or another output of the run ([`RunFiles`]):
//!   files are compared by device and inode after following links;
//! * every error names the path the user gave, never the temporary file.
//!
//! [`OutputTarget::resolve`] runs these checks without writing, so a caller can check every
//! output of a batch before the first expensive stage; [`OutputTarget::write`] checks again
//! (the file system may have changed during the run) and writes.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The longest file name (one path component) Linux file systems take, in bytes.
const NAME_MAX: usize = 255;

/// An output path that cannot be written, and why.
#[derive(Debug, thiserror::Error)]
#[error("cannot write the output '{}': {problem}", path.display())]
pub struct OutputError {
    /// The path as the user gave it.
    pub path: PathBuf,
    /// What is wrong.
    pub problem: String,
    /// Refused only because it would replace an existing file that may not be an image (its
    /// name has no image extension): the caller may ask again with the user's consent
    /// ([`ImageOutput::plan`]'s `overwrite`).
    pub needs_consent: bool,
}

impl OutputError {
    fn new(path: &Path, problem: String) -> Self {
        OutputError { path: path.to_owned(), problem, needs_consent: false }
    }
}

/// How the bytes reach the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Temporary file, then rename over the target (or create it).
    Replace,
    /// The standard output (not a terminal).
    Stdout,
}

/// A checked output path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputTarget {
    requested: PathBuf,
    real: PathBuf,
    mode: Mode,
}

/// Most symbolic links followed in a chain (Linux's own limit is 40).
const MAX_LINKS: usize = 40;

/// The names of the standard output and error a user may give as an output path.
const STDOUT_NAMES: [&str; 3] = ["/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"];
const STDERR_NAMES: [&str; 3] = ["/dev/stderr", "/dev/fd/2", "/proc/self/fd/2"];

impl OutputTarget {
    /// Checks `path` as an output and finds the file it really names.
    pub fn resolve(path: &Path) -> Result<Self, OutputError> {
        let fail = |problem: String| OutputError::new(path, problem);
        if path.as_os_str().is_empty() {
            return Err(fail("the path is empty".into()));
        }
        if STDOUT_NAMES.iter().any(|n| path == Path::new(n)) {
            if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                return Err(fail(
                    "the standard output is a terminal; image bytes are written to it only when it is \
                     redirected to a file or a pipe"
                        .into(),
                ));
            }
            return Ok(OutputTarget { requested: path.to_owned(), real: path.to_owned(), mode: Mode::Stdout });
        }
        if STDERR_NAMES.iter().any(|n| path == Path::new(n)) {
            return Err(fail("it is the standard error, where messages are written".into()));
        }
        // Follow symbolic links by hand, so that a dangling link resolves to the file it
        // would create.
        let mut real = path.to_path_buf();
        for hop in 0.. {
            match std::fs::symlink_metadata(&real) {
                Ok(m) if m.file_type().is_symlink() => {
                    if hop == MAX_LINKS {
                        return Err(fail(format!("more than {MAX_LINKS} symbolic links in a chain")));
                    }
                    let target = std::fs::read_link(&real).map_err(|e| fail(format!("reading the link: {e}")))?;
                    real = match real.parent() {
                        Some(dir) if target.is_relative() => dir.join(target),
                        _ => target,
                    };
                }
                _ => break,
            }
        }
        let via = if real != path { format!(" (the link leads to '{}')", real.display()) } else { String::new() };
        for name in [path.file_name(), real.file_name()].into_iter().flatten() {
            if name.len() > NAME_MAX {
                return Err(fail(format!(
                    "the file name is {} bytes long; file systems allow at most {NAME_MAX}{via}",
                    name.len()
                )));
            }
        }
        match std::fs::metadata(&real) {
            Ok(m) if m.is_dir() => return Err(fail(format!("it is a directory{via}"))),
            Ok(m) if !m.is_file() => {
                return Err(fail(format!(
                    "it is {}{via}; only regular files are written, and it is left untouched",
                    crate::files::open::kind_of(&m)
                )))
            }
            Ok(m) if m.permissions().readonly() => {
                return Err(fail(format!("the file is read-only{via}; it is left untouched")))
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(fail(format!("{e}{via}"))),
        }
        let dir = parent_dir(&real);
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(m) => {
                return Err(fail(format!(
                    "'{}' is {}, not a directory",
                    dir.display(),
                    crate::files::open::kind_of(&m)
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(fail(format!("the directory '{}' does not exist", dir.display())))
            }
            Err(e) => return Err(fail(format!("the directory '{}': {e}", dir.display()))),
        }
        if !writable_dir(dir) {
            return Err(fail(format!(
                "the directory '{}' is not writable (the image is written to a new file there, then \
                 renamed)",
                dir.display()
            )));
        }
        Ok(OutputTarget { requested: path.to_owned(), real, mode: Mode::Replace })
    }

    /// The path as given.
    pub fn path(&self) -> &Path {
        &self.requested
    }

    /// What the output is on disk now: the existing file's device and inode, or for a file
    /// still to be created, its directory (resolved) and name.
    fn identity(&self) -> Identity {
        let path = if self.mode == Mode::Stdout { &self.requested } else { &self.real };
        if let Some(id) = file_id(path) {
            return Identity::File(id);
        }
        let dir = std::fs::canonicalize(parent_dir(&self.real)).unwrap_or_else(|_| parent_dir(&self.real).to_owned());
        Identity::New(dir.join(self.real.file_name().unwrap_or_default()))
    }

    /// Writes `bytes` to the target (checked again first): to a temporary file next to it,
    /// flushed to disk, then renamed over it.
    pub fn write(&self, bytes: &[u8]) -> Result<(), OutputError> {
        let now = Self::resolve(&self.requested)?;
        let fail = |problem: String| OutputError::new(&self.requested, problem);
        if now.mode == Mode::Stdout {
            let mut out = std::io::stdout().lock();
            return out.write_all(bytes).and_then(|()| out.flush()).map_err(|e| fail(format!("standard output: {e}")));
        }
        let dir = parent_dir(&now.real);
        let (tmp, mut f) = create_temp(dir, now.real.file_name().unwrap_or_default())
            .map_err(|e| fail(format!("creating a temporary file in '{}': {e}", dir.display())))?;
        let result = (|| -> std::io::Result<()> {
            f.write_all(bytes)?;
            if let Ok(old) = std::fs::metadata(&now.real) {
                // Keep the permissions of the file being replaced.
                f.set_permissions(old.permissions())?;
            }
            // A full disk may report itself only when the data is flushed: before the rename,
            // so that the old file is still whole when it does.
            f.sync_all()?;
            drop(f);
            std::fs::rename(&tmp, &now.real)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result.map_err(|e| fail(format!("{e}; the file is left as it was")))
    }
}

/// Creates a new temporary file in `dir` for `name`: `.<name>.tmp-<pid>-<n>`, the name cut
/// so that the whole fits in [`NAME_MAX`] bytes.
fn create_temp(dir: &Path, name: &std::ffi::OsStr) -> std::io::Result<(PathBuf, std::fs::File)> {
    let name = name.to_string_lossy();
    for n in 0..100u32 {
        let suffix = format!(".tmp-{}-{n}", std::process::id());
        let mut keep = NAME_MAX.saturating_sub(1 + suffix.len()).min(name.len());
        while !name.is_char_boundary(keep) {
            keep -= 1;
        }
        let tmp = dir.join(format!(".{}{suffix}", &name[..keep]));
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other("100 temporary names are taken"))
}

fn parent_dir(p: &Path) -> &Path {
    p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// Whether this process may create files in `dir`.
#[cfg(unix)]
fn writable_dir(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return false };
    // SAFETY: a valid NUL-terminated path; access only reads it.
    unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

#[cfg(not(unix))]
fn writable_dir(_dir: &Path) -> bool {
    true
}

/// The device and inode of the file `path` leads to (links followed), if it exists.
#[cfg(unix)]
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn file_id(path: &Path) -> Option<(u64, u64)> {
    // Without inodes, the canonical path stands for the file.
    let c = std::fs::canonicalize(path).ok()?;
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    c.hash(&mut h);
    Some((0, h.finish()))
}

/// What an output is, to compare it with the others.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Identity {
    /// An existing file: device and inode.
    File((u64, u64)),
    /// A file to be created: its resolved path.
    New(PathBuf),
}

/// A file a run reads, by the part it plays: every kind of input file is listed here once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputRole {
    /// A checkpoint, or a file of a diffusers folder.
    Model,
    /// The diffusion model alone.
    DiffusionModel,
    /// The VAE alone.
    Vae,
    /// The CLIP-L text encoder alone.
    ClipL,
    /// The OpenCLIP ViT-bigG text encoder alone.
    ClipG,
    /// The T5-XXL text encoder alone.
    T5xxl,
    /// The tiny autoencoder.
    Taesd,
    /// An LLM text encoder (described only).
    Llm,
    /// The file the prompt is read from.
    PromptFile,
    /// The file the negative prompt is read from.
    NegativePromptFile,
    /// The init image of img2img.
    InitImage,
    /// The mask of inpainting.
    Mask,
    /// A LoRA file.
    Lora,
    /// A device profile.
    DeviceProfile,
    /// An ESRGAN upscaler.
    UpscaleModel,
    /// A ControlNet.
    ControlNet,
    /// The ControlNet's control image.
    ControlImage,
    /// A reference image (`-r`).
    RefImage,
}

impl InputRole {
    /// The role in words ("the VAE").
    fn describe(self) -> &'static str {
        match self {
            InputRole::Model => "the model",
            InputRole::DiffusionModel => "the diffusion model",
            InputRole::Vae => "the VAE",
            InputRole::ClipL => "the CLIP-L text encoder",
            InputRole::ClipG => "the ViT-bigG text encoder",
            InputRole::T5xxl => "the T5-XXL text encoder",
            InputRole::Taesd => "the TAESD",
            InputRole::Llm => "the LLM text encoder",
            InputRole::PromptFile => "the prompt file",
            InputRole::NegativePromptFile => "the negative prompt file",
            InputRole::InitImage => "the init image",
            InputRole::Mask => "the mask",
            InputRole::Lora => "the LoRA",
            InputRole::DeviceProfile => "the device profile",
            InputRole::UpscaleModel => "the upscale model",
            InputRole::ControlNet => "the ControlNet",
            InputRole::ControlImage => "the control image",
            InputRole::RefImage => "a reference image",
        }
    }
}

/// A file a run writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputRole {
    /// A generated image.
    Image,
    /// The JSON run report.
    Report,
}

impl OutputRole {
    /// The role in words ("the image").
    fn describe(self) -> &'static str {
        match self {
            OutputRole::Image => "the image",
            OutputRole::Report => "the run report",
        }
    }
}

/// What the other file of a [`SameFile`] is to the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileUse {
    /// A file the run reads.
    Input(InputRole),
    /// Another output.
    Output(OutputRole),
}

impl FileUse {
    fn describe(self) -> &'static str {
        match self {
            FileUse::Input(r) => r.describe(),
            FileUse::Output(r) => r.describe(),
        }
    }
}

/// An output that is a file the run reads, or another output: writing it would destroy that.
#[derive(Debug, thiserror::Error)]
#[error(
    "{} '{}' is the same file as {} '{}': writing it would destroy {}; nothing was written",
    output.describe(), output_path.display(), other.describe(), other_path.display(), other.describe()
)]
pub struct SameFile {
    /// What the output is.
    pub output: OutputRole,
    /// The output path as given.
    pub output_path: PathBuf,
    /// What the other file is.
    pub other: FileUse,
    /// The other path as given (for a diffusers folder, the file in it).
    pub other_path: PathBuf,
}

/// The files one run reads and writes, each with its role, checked together
/// ([`RunFiles::check`]) before any work: no output may be an input or another output.
#[derive(Debug, Default)]
pub struct RunFiles {
    inputs: Vec<(InputRole, PathBuf)>,
    outputs: Vec<(OutputRole, OutputTarget)>,
}

/// Most files listed from one input folder (a diffusers folder holds about 20).
const MAX_FOLDER_FILES: usize = 10_000;

impl RunFiles {
    /// An input file (nothing when `None`). A folder stands for the files in it and in its
    /// subfolders (a diffusers model).
    pub fn input(mut self, role: InputRole, path: Option<impl AsRef<Path>>) -> Self {
        if let Some(p) = path {
            self.inputs.push((role, p.as_ref().to_owned()));
        }
        self
    }

    /// Each of `paths`, in `role`.
    pub fn inputs(self, role: InputRole, paths: &[impl AsRef<Path>]) -> Self {
        paths.iter().fold(self, |files, p| files.input(role, Some(p)))
    }

    /// The model files of `sources`, each with its role.
    pub fn model_sources(self, sources: &crate::files::ModelSources) -> Self {
        // Destructured, so that a new kind of model file cannot be left out.
        let crate::files::ModelSources { model, diffusion_model, vae, clip_l, clip_g, taesd, t5xxl, llm } = sources;
        self.input(InputRole::Model, model.as_deref())
            .input(InputRole::DiffusionModel, diffusion_model.as_deref())
            .input(InputRole::Vae, vae.as_deref())
            .input(InputRole::ClipL, clip_l.as_deref())
            .input(InputRole::ClipG, clip_g.as_deref())
            .input(InputRole::Taesd, taesd.as_deref())
            .input(InputRole::T5xxl, t5xxl.as_deref())
            .input(InputRole::Llm, llm.as_deref())
    }

    /// The LoRA files of a request.
    pub fn loras(self, loras: &[crate::lora::LoraRequest]) -> Self {
        loras.iter().fold(self, |s, l| s.input(InputRole::Lora, Some(&l.path)))
    }

    /// An output.
    pub fn output(mut self, role: OutputRole, target: &OutputTarget) -> Self {
        self.outputs.push((role, target.clone()));
        self
    }

    /// Fails when an output is an input (same device and inode, links followed) or another
    /// output (the same existing file, or the same new path).
    pub fn check(&self) -> Result<(), SameFile> {
        let mut inputs: Vec<(InputRole, PathBuf, (u64, u64))> = Vec::new();
        for (role, path) in &self.inputs {
            if path.is_dir() {
                for file in folder_files(path) {
                    if let Some(id) = file_id(&file) {
                        inputs.push((*role, file, id));
                    }
                }
            } else if let Some(id) = file_id(path) {
                inputs.push((*role, path.clone(), id));
            }
        }
        let outputs: Vec<(OutputRole, &OutputTarget, Identity)> =
            self.outputs.iter().map(|(r, t)| (*r, t, t.identity())).collect();
        for (i, (role, target, id)) in outputs.iter().enumerate() {
            let clash = |other: FileUse, other_path: &Path| SameFile {
                output: *role,
                output_path: target.path().to_owned(),
                other,
                other_path: other_path.to_owned(),
            };
            if let Identity::File(id) = id {
                if let Some((r, p, _)) = inputs.iter().find(|(_, _, input)| input == id) {
                    return Err(clash(FileUse::Input(*r), p));
                }
            }
            if let Some((r, t, _)) = outputs[..i].iter().find(|(_, _, other)| other == id) {
                return Err(clash(FileUse::Output(*r), t.path()));
            }
        }
        Ok(())
    }
}

/// The regular files under `dir`, two folder levels deep (where a diffusers model keeps them).
fn folder_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), 0)];
    while let Some((d, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            if out.len() >= MAX_FOLDER_FILES {
                return out;
            }
            let p = e.path();
            match std::fs::metadata(&p) {
                Ok(m) if m.is_dir() && depth < 2 => stack.push((p, depth + 1)),
                Ok(m) if m.is_file() => out.push(p),
                _ => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(p: &Path, bytes: &[u8]) -> Result<(), String> {
        OutputTarget::resolve(p).and_then(|t| t.write(bytes)).map_err(|e| e.to_string())
    }

    #[test]
    fn regular_files_are_created_and_replaced() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.png");
        write(&p, b"one").unwrap();
        write(&p, b"two!").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two!");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1, "no temporary file left behind");
    }

    #[cfg(unix)]
    #[test]
    fn links_are_followed_and_kept() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("real.png");
        std::fs::write(&target, b"old").unwrap();
        let link = d.path().join("link.png");
        std::os::unix::fs::symlink("real.png", &link).unwrap();
        write(&link, b"new").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        // A dangling link creates its target.
        let dangling = d.path().join("dangling.png");
        std::os::unix::fs::symlink("made.png", &dangling).unwrap();
        write(&dangling, b"x").unwrap();
        assert_eq!(std::fs::read(d.path().join("made.png")).unwrap(), b"x");
    }

    #[cfg(unix)]
    #[test]
    fn a_hard_link_is_replaced_by_a_new_file_and_the_other_name_keeps_the_old_bytes() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let model = d.path().join("model.safetensors");
        std::fs::write(&model, b"the model's bytes").unwrap();
        let other = d.path().join("other.png");
        std::fs::hard_link(&model, &other).unwrap();
        write(&other, b"an image").unwrap();
        assert_eq!(std::fs::read(&model).unwrap(), b"the model's bytes");
        assert_eq!(std::fs::read(&other).unwrap(), b"an image");
        assert_eq!(std::fs::metadata(&model).unwrap().nlink(), 1);
        assert_ne!(std::fs::metadata(&model).unwrap().ino(), std::fs::metadata(&other).unwrap().ino());
    }

    /// Runs `write` in a child process whose file size limit (RLIMIT_FSIZE) is `limit` bytes:
    /// a full disk as the writer sees it (EFBIG instead of ENOSPC). The child is this test
    /// binary, running only `child_writes_under_a_size_limit`.
    #[cfg(target_os = "linux")]
    fn write_in_limited_child(path: &Path, bytes: usize, limit: u64) -> (bool, String) {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "output::tests::child_writes_under_a_size_limit", "--nocapture", "--test-threads=1"])
            .env("SD_OUTPUT_CHILD", format!("{}\n{bytes}\n{limit}", path.display()))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        (text.contains("CHILD WROTE"), text)
    }

    /// The child of [`write_in_limited_child`]; does nothing when run as a test of its own.
    #[cfg(target_os = "linux")]
    #[test]
    fn child_writes_under_a_size_limit() {
        let Ok(spec) = std::env::var("SD_OUTPUT_CHILD") else { return };
        let mut parts = spec.split('\n');
        let path = PathBuf::from(parts.next().unwrap());
        let bytes: usize = parts.next().unwrap().parse().unwrap();
        let limit: u64 = parts.next().unwrap().parse().unwrap();
        // SAFETY: plain libc calls on values we own; SIGXFSZ ignored so that the write
        // returns EFBIG instead of killing the child.
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let lim = libc::rlimit { rlim_cur: limit, rlim_max: limit };
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
        }
        match write(&path, &vec![7u8; bytes]) {
            Ok(()) => println!("CHILD WROTE"),
            Err(e) => println!("CHILD FAILED: {e}"),
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_full_disk_leaves_the_old_file_and_its_hard_links_intact() {
        let d = tempfile::tempdir().unwrap();
        let old = d.path().join("old.png");
        std::fs::write(&old, vec![1u8; 1000]).unwrap();
        let link = d.path().join("link.png");
        std::fs::hard_link(&old, &link).unwrap();
        for target in [&old, &link] {
            let (wrote, text) = write_in_limited_child(target, 10_000, 4096);
            assert!(!wrote && text.contains("CHILD FAILED"), "{text}");
            assert!(text.contains("left as it was") && !text.contains(".tmp-"), "{text}");
            assert_eq!(std::fs::read(&old).unwrap(), vec![1u8; 1000]);
            assert_eq!(std::fs::read(&link).unwrap(), vec![1u8; 1000]);
        }
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 2, "no temporary file left behind");
        // Under the limit the same child writes.
        let (wrote, text) = write_in_limited_child(&link, 100, 4096);
        assert!(wrote, "{text}");
        assert_eq!(std::fs::read(&old).unwrap(), vec![1u8; 1000]);
        assert_eq!(std::fs::read(&link).unwrap(), vec![7u8; 100]);
    }

    #[test]
    fn a_long_legal_name_is_written_and_a_too_long_one_refused_before_writing() {
        let d = tempfile::tempdir().unwrap();
        let long = d.path().join(format!("{}.png", "a".repeat(246)));
        assert_eq!(long.file_name().unwrap().len(), 250);
        write(&long, b"x").unwrap();
        assert_eq!(std::fs::read(&long).unwrap(), b"x");
        // Written twice: the temporary name of a replacement fits too.
        write(&long, b"y").unwrap();
        assert_eq!(std::fs::read(&long).unwrap(), b"y");
        let multibyte = d.path().join(format!("{}.png", "é".repeat(125)));
        assert_eq!(multibyte.file_name().unwrap().len(), 254);
        write(&multibyte, b"z").unwrap();
        let too_long = d.path().join(format!("{}.png", "a".repeat(252)));
        let err = OutputTarget::resolve(&too_long).unwrap_err().to_string();
        assert!(err.contains("256 bytes long") && err.contains("at most 255"), "{err}");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 2);
    }

    #[cfg(unix)]
    #[test]
    fn non_regular_read_only_and_missing_directories_are_refused_untouched() {
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("pipe.png");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = write(&fifo, b"x").unwrap_err();
        assert!(err.contains("FIFO") && err.contains("pipe.png"), "{err}");
        assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());

        let err = write(Path::new("/dev/null"), b"x").unwrap_err();
        assert!(err.contains("'/dev/null'") && err.contains("character device"), "{err}");
        let err = write(Path::new("/dev/stderr"), b"x").unwrap_err();
        assert!(err.contains("standard error"), "{err}");

        let ro = d.path().join("ro.png");
        std::fs::write(&ro, b"keep").unwrap();
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o444)).unwrap();
        let err = write(&ro, b"x").unwrap_err();
        assert!(err.contains("read-only") && err.contains("ro.png"), "{err}");
        assert_eq!(std::fs::read(&ro).unwrap(), b"keep");

        let err = write(d.path(), b"x").unwrap_err();
        assert!(err.contains("directory"), "{err}");
        let err = write(&d.path().join("missing/x.png"), b"x").unwrap_err();
        assert!(err.contains("does not exist") && err.contains("missing"), "{err}");
        assert!(!err.contains(".tmp-"), "{err}");

        // A directory this process may not write to is refused before any work (root may
        // write anywhere: nothing to check then).
        let locked = d.path().join("locked");
        std::fs::create_dir(&locked).unwrap();
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o555)).unwrap();
        if !writable_dir(&locked) {
            let err = OutputTarget::resolve(&locked.join("x.png")).unwrap_err().to_string();
            assert!(err.contains("not writable") && err.contains("locked"), "{err}");
        }
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn no_output_may_be_an_input_or_another_output() {
        let d = tempfile::tempdir().unwrap();
        let p = |n: &str| d.path().join(n);
        std::fs::write(p("model.safetensors"), b"model").unwrap();
        std::fs::write(p("prompt.txt"), b"a cat").unwrap();
        std::fs::create_dir_all(p("diffusers/unet")).unwrap();
        std::fs::write(p("diffusers/unet/diffusion_pytorch_model.safetensors"), b"unet").unwrap();
        std::fs::hard_link(p("model.safetensors"), p("hard.png")).unwrap();
        std::os::unix::fs::symlink("prompt.txt", p("soft.png")).unwrap();
        let target = |n: &str| OutputTarget::resolve(&p(n)).unwrap();
        let sources = crate::files::ModelSources::model(p("model.safetensors"));
        let files = || {
            RunFiles::default()
                .model_sources(&sources)
                .input(InputRole::PromptFile, Some(&p("prompt.txt")))
                .input(InputRole::Model, Some(&p("diffusers")))
                .input(InputRole::InitImage, Some(&p("missing.png")))
        };
        let err = |f: RunFiles| f.check().unwrap_err();

        let e = err(files().output(OutputRole::Image, &target("model.safetensors")));
        assert_eq!((e.output, e.other), (OutputRole::Image, FileUse::Input(InputRole::Model)));
        let msg = e.to_string();
        assert!(msg.contains("model.safetensors' is the same file as the model") && msg.contains("destroy"), "{msg}");
        // A hard link of the model, a symbolic link to the prompt file, a file of a folder.
        let e = err(files().output(OutputRole::Image, &target("hard.png")));
        assert_eq!(e.other, FileUse::Input(InputRole::Model));
        assert_eq!(e.other_path, p("model.safetensors"));
        let e = err(files().output(OutputRole::Report, &target("soft.png")));
        assert_eq!((e.output, e.other), (OutputRole::Report, FileUse::Input(InputRole::PromptFile)));
        let e = err(files().output(OutputRole::Image, &target("diffusers/unet/diffusion_pytorch_model.safetensors")));
        assert!(e.other_path.ends_with("unet/diffusion_pytorch_model.safetensors"), "{e}");
        // The report on the image: new (the same path spelled two ways) or existing.
        let e =
            err(files().output(OutputRole::Image, &target("out.png")).output(OutputRole::Report, &target("./out.png")));
        assert_eq!(e.other, FileUse::Output(OutputRole::Image));
        std::fs::write(p("old.png"), b"old").unwrap();
        std::os::unix::fs::symlink("old.png", p("old-link.json")).unwrap();
        let e = err(files()
            .output(OutputRole::Image, &target("old.png"))
            .output(OutputRole::Report, &target("old-link.json")));
        assert_eq!((e.output, e.other), (OutputRole::Report, FileUse::Output(OutputRole::Image)));
        // Distinct files pass; a missing input is no file of anyone's.
        files()
            .output(OutputRole::Image, &target("out.png"))
            .output(OutputRole::Report, &target("out.json"))
            .output(OutputRole::Image, &target("missing.png"))
            .check()
            .unwrap();
    }

    #[test]
    fn image_names_that_are_not_images_are_refused_unless_asked() {
        let d = tempfile::tempdir().unwrap();
        let notes = d.path().join("notes.txt");
        std::fs::write(&notes, b"my notes").unwrap();
        let readme = d.path().join("README");
        std::fs::write(&readme, b"read me").unwrap();
        for p in [&notes, &readme] {
            let e = ImageOutput::plan(p, 1, None, false).unwrap_err();
            assert!(e.needs_consent && e.to_string().contains("left untouched"), "{e}");
        }
        assert_eq!(std::fs::read(&notes).unwrap(), b"my notes");
        // With consent the file itself is the target, as a PNG.
        let out = ImageOutput::plan(&notes, 1, None, true).unwrap();
        assert_eq!((out[0].target.path(), out[0].format), (notes.as_path(), crate::image_io::OutputFormat::Png));
        // A new name without an image extension gets `.png`, as in the reference; a batch
        // of an existing name is numbered beside it.
        let new = ImageOutput::plan(&d.path().join("new.txt"), 1, None, false).unwrap();
        assert_eq!(new[0].target.path(), d.path().join("new.txt.png"));
        let batch = ImageOutput::plan(&notes, 2, None, false).unwrap();
        assert_eq!(batch[1].target.path(), d.path().join("notes.txt_1.png"));
        // An image format that is not written is refused, not renamed.
        for name in ["x.gif", "y.BMP", "z_%d.tiff"] {
            let e = ImageOutput::plan(&d.path().join(name), 1, None, true).unwrap_err().to_string();
            assert!(e.contains("is not a format written here") && e.contains(".webp"), "{e}");
        }
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 2);
    }
}

/// Image formats a user may name in an output's extension that are not written here: such a
/// name is refused rather than written as `<name>.png`.
const UNWRITTEN_IMAGE_EXTENSIONS: [&str; 20] = [
    "gif", "bmp", "tif", "tiff", "avif", "jxl", "heic", "heif", "ico", "tga", "ppm", "pgm", "pbm", "pnm", "qoi", "exr",
    "hdr", "dds", "svg", "jp2",
];

/// One image's output: a checked target and the format its name chose.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageOutput {
    /// Where the image goes.
    pub target: OutputTarget,
    /// How it is encoded.
    pub format: crate::image_io::OutputFormat,
}

impl ImageOutput {
    /// The outputs of a batch of `count` images for `output` and `begin_idx`: named as the
    /// reference names them (the extension picks the format, `%d` numbers the images, a
    /// batch is `<stem>_<i>.<ext>`, a name without an image extension gets `.png`), each
    /// checked as a target ([`OutputTarget::resolve`]) before any work is done.
    ///
    /// Refused: an image format that is not written (`x.gif`: not silently `x.gif.png`), and
    /// an existing regular file whose name has no image extension (a .txt file, `README`)
    /// unless `overwrite` (then it is replaced by a PNG). Something else that exists under
    /// such a name (a directory, a device) is taken as written, for the target checks to
    /// refuse it.
    pub fn plan(
        output: &Path,
        count: usize,
        begin_idx: Option<i64>,
        overwrite: bool,
    ) -> Result<Vec<Self>, OutputError> {
        use crate::image_io::OutputFormat;
        let fail = |problem: String| OutputError::new(output, problem);
        let ext = output.extension().map(|e| e.to_string_lossy().to_ascii_lowercase());
        if let Some(e) = ext.as_deref().filter(|e| UNWRITTEN_IMAGE_EXTENSIONS.contains(e)) {
            return Err(fail(format!(
                ".{e} is not a format written here (PNG: .png, JPEG: .jpg/.jpeg/.jpe, WebP: .webp); \
                 name the output with one of those"
            )));
        }
        let single = count == 1 && crate::image_io::format_index(&output.to_string_lossy(), 0).is_none();
        if single && OutputFormat::from_path(output).is_none() && std::fs::metadata(output).is_ok_and(|m| m.is_file()) {
            if !overwrite {
                return Err(OutputError {
                    path: output.to_owned(),
                    problem: "the file exists and its name has no image extension (.png, .jpg, .jpeg, .jpe, \
                              .webp), so it may not be an image: it is left untouched"
                        .into(),
                    needs_consent: true,
                });
            }
            tracing::info!("replacing '{}' with a PNG image, as asked", output.display());
            return Ok(vec![ImageOutput { target: OutputTarget::resolve(output)?, format: OutputFormat::Png }]);
        }
        let paths = crate::image_io::output_paths(output, count, begin_idx);
        if OutputFormat::from_path(output).is_none() {
            if let Some((first, _)) = paths.first().filter(|(p, _)| p != output) {
                let (shown, first) = (output.display(), first.display());
                // The reference's naming; an extension that is not an image's may be a surprise.
                match ext {
                    None => tracing::info!("'{shown}' has no extension: writing '{first}' (PNG)"),
                    Some(e) => tracing::warn!(
                        "'{shown}': .{e} is not an image extension; writing '{first}' (PNG), as stable-diffusion.cpp \
                         names it"
                    ),
                }
            }
        }
        paths
            .into_iter()
            .map(|(path, format)| Ok(ImageOutput { target: OutputTarget::resolve(&path)?, format }))
            .collect()
    }

    /// Encodes `img` with `parameters` (None: no metadata) and writes it.
    pub fn write(&self, img: &crate::pipeline::Image, parameters: Option<&str>) -> crate::image_io::Result<()> {
        crate::image_io::write_image(&self.target, img, self.format, parameters)
    }
}
