//! Output files: where an output path really leads, checked before any work, written without destroying what is there.
//!
//! Rules (issue 11, row 1):
//! * a symbolic link is followed: the file it points to is replaced and the link stays;
//! * an existing regular file is replaced atomically: the bytes go to a temporary file next
//!   to the *real* target, which is then renamed over it (a failure leaves the old file);
//! * a file with several hard links is rewritten in place, so every name sees the new image
//!   (a rename would silently detach this name from the others);
//! * a directory, FIFO, device node or socket is refused and left untouched, as is a
//!   read-only file, and a path whose directory does not exist;
//! * every error names the path the user gave, never the temporary file.
//!
//! [`OutputTarget::resolve`] runs these checks without writing, so a caller can check every
//! output of a batch before the first expensive stage; [`OutputTarget::write`] checks again
//! (the file system may have changed during the run) and writes.

use std::io::Write;
use std::path::{Path, PathBuf};

/// An output path that cannot be written, and why.
#[derive(Debug, thiserror::Error)]
#[error("cannot write the output '{}': {problem}", path.display())]
pub struct OutputError {
    /// The path as the user gave it.
    pub path: PathBuf,
    /// What is wrong.
    pub problem: String,
}

/// How the bytes reach the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Temporary file, then rename over the target (or create it).
    Replace,
    /// Rewrite the existing file in place (it has other hard links).
    InPlace,
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

impl OutputTarget {
    /// Checks `path` as an output and finds the file it really names.
    pub fn resolve(path: &Path) -> Result<Self, OutputError> {
        let fail = |problem: String| OutputError { path: path.to_owned(), problem };
        if path.as_os_str().is_empty() {
            return Err(fail("the path is empty".into()));
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
        let mode = match std::fs::metadata(&real) {
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
            Ok(m) if link_count(&m) > 1 => Mode::InPlace,
            Ok(_) => Mode::Replace,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Mode::Replace,
            Err(e) => return Err(fail(format!("{e}{via}"))),
        };
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
        Ok(OutputTarget { requested: path.to_owned(), real, mode })
    }

    /// The path as given.
    pub fn path(&self) -> &Path {
        &self.requested
    }

    /// Writes `bytes` to the target (checked again first), atomically unless the file has
    /// other hard links.
    pub fn write(&self, bytes: &[u8]) -> Result<(), OutputError> {
        let now = Self::resolve(&self.requested)?;
        let fail = |problem: String| OutputError { path: self.requested.clone(), problem };
        match now.mode {
            Mode::InPlace => {
                let mut f = std::fs::OpenOptions::new().write(true).open(&now.real).map_err(|e| fail(e.to_string()))?;
                f.write_all(bytes).and_then(|()| f.set_len(bytes.len() as u64)).map_err(|e| fail(e.to_string()))
            }
            Mode::Replace => {
                let dir = parent_dir(&now.real);
                let name = now.real.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
                let result = (|| -> std::io::Result<()> {
                    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
                    f.write_all(bytes)?;
                    if let Ok(old) = std::fs::metadata(&now.real) {
                        // Keep the permissions of the file being replaced.
                        f.set_permissions(old.permissions())?;
                    }
                    drop(f);
                    std::fs::rename(&tmp, &now.real)
                })();
                if result.is_err() {
                    let _ = std::fs::remove_file(&tmp);
                }
                result.map_err(|e| fail(e.to_string()))
            }
        }
    }
}

fn parent_dir(p: &Path) -> &Path {
    p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

#[cfg(unix)]
fn link_count(m: &std::fs::Metadata) -> u64 {
    std::os::unix::fs::MetadataExt::nlink(m)
}

#[cfg(not(unix))]
fn link_count(_m: &std::fs::Metadata) -> u64 {
    1
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
        // A hard link: both names see the new bytes.
        let other = d.path().join("other.png");
        std::fs::hard_link(&target, &other).unwrap();
        write(&other, b"shared").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"shared");
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
    }
}

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
    /// batch is `<stem>_<i>.<ext>`; an existing path without a known extension is taken as
    /// written), each checked as a target ([`OutputTarget::resolve`]) before any work is done.
    pub fn plan(output: &Path, count: usize, begin_idx: Option<i64>) -> Result<Vec<Self>, OutputError> {
        crate::image_io::output_paths(output, count, begin_idx)
            .into_iter()
            .map(|(path, format)| Ok(ImageOutput { target: OutputTarget::resolve(&path)?, format }))
            .collect()
    }

    /// Encodes `img` with `parameters` (None: no metadata) and writes it.
    pub fn write(&self, img: &crate::pipeline::Image, parameters: Option<&str>) -> crate::image_io::Result<()> {
        crate::image_io::write_image(&self.target, img, self.format, parameters)
    }
}
