//! Applying a reviewed patch (`patches/*.toml`: exact find/replace hunks) to a copy of
//! one directory (with its subdirectories) of the pinned ggml source; every anchor must
//! occur exactly once.

use std::fs;
use std::path::{Path, PathBuf};

#[derive(serde::Deserialize)]
pub struct Patch {
    #[serde(rename = "file")]
    pub files: Vec<FileRule>,
    #[serde(rename = "hunk")]
    pub hunks: Vec<Hunk>,
    /// Files of ours added to the copy (and compiled with its sources).
    #[serde(rename = "add", default)]
    pub adds: Vec<Added>,
}

/// A source file of this project added to the patched copy: `name` is its path in the
/// copy, and its text lies in the directory named as the patch file without `.toml`
/// (`patches/cpu-speed/` for `patches/cpu-speed.toml`), under the same name.
#[derive(serde::Deserialize)]
pub(crate) struct Added {
    pub name: String,
    #[allow(dead_code)]
    pub why: String,
}

/// A file the patch touches, and strings that must be gone once it is applied.
#[derive(serde::Deserialize)]
pub(crate) struct FileRule {
    pub name: String,
    #[serde(default)]
    pub absent: Vec<String>,
}

#[derive(serde::Deserialize)]
pub(crate) struct Hunk {
    pub file: String,
    pub why: String,
    pub find: String,
    pub replace: String,
}

impl Patch {
    pub fn parse(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// The patched text of `name`, given its pinned text. `label` names the patch in errors.
    pub fn apply_to(&self, label: &str, name: &str, original: &str) -> Result<String, String> {
        let rule = self
            .files
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| format!("{label}: `{name}` is not listed as a [[file]]"))?;
        let mut text = original.to_string();
        for (i, h) in self.hunks.iter().enumerate().filter(|(_, h)| h.file == name) {
            let n = text.matches(h.find.as_str()).count();
            if n != 1 {
                return Err(format!(
                    "{label}: hunk {} ({name}: {}) expects its anchor exactly once in the pinned source, found it {n} times. \
                     The pinned ggml no longer matches this patch: re-read upstream's {name} and update the patch.",
                    i + 1,
                    h.why
                ));
            }
            text = text.replacen(h.find.as_str(), &h.replace, 1);
        }
        for s in &rule.absent {
            if text.contains(s.as_str()) {
                return Err(format!(
                    "{label}: `{s}` is still in the patched {name}: upstream added a site the patch must also cover"
                ));
            }
        }
        Ok(text)
    }

    fn check_hunk_files(&self, label: &str) -> Result<(), String> {
        for (i, h) in self.hunks.iter().enumerate() {
            if !self.files.iter().any(|f| f.name == h.file) {
                return Err(format!("{label}: hunk {} names `{}`, which is not listed as a [[file]]", i + 1, h.file));
            }
        }
        Ok(())
    }
}

/// The patched copy of a directory.
pub struct Applied {
    pub dir: PathBuf,
    /// The added files (paths relative to the copy), to compile with its sources.
    pub added: Vec<String>,
    /// The added files' texts, in order (part of the patch's identity).
    pub added_text: Vec<u8>,
}

/// Copies every file of `src_dir`, subdirectories included, into `out_dir`, applying
/// `patch_path` to the files it lists (by path relative to `src_dir`, `/`-separated) and
/// adding the patch's own files. Files are rewritten only when their text changes.
pub fn apply(patch_path: &Path, src_dir: &Path, out_dir: &Path) -> Result<Applied, String> {
    let label = patch_path.display().to_string();
    let text = fs::read_to_string(patch_path).map_err(|e| format!("{label}: {e}"))?;
    let patch = Patch::parse(&text).map_err(|e| format!("{label}: {e}"))?;
    patch.check_hunk_files(&label)?;
    let add_dir = patch_path.with_extension("");
    let mut added = Vec::new();
    let mut added_text = Vec::new();
    for a in &patch.adds {
        if src_dir.join(&a.name).exists() {
            return Err(format!("{label}: added file `{}` would replace a file of the pinned source", a.name));
        }
        let from = add_dir.join(&a.name);
        let bytes = fs::read(&from).map_err(|e| format!("{label}: added file {}: {e}", from.display()))?;
        let dest = out_dir.join(&a.name);
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        if fs::read(&dest).map(|old| old != bytes).unwrap_or(true) {
            fs::write(&dest, &bytes).map_err(|e| format!("{}: {e}", dest.display()))?;
        }
        added_text.extend_from_slice(a.name.as_bytes());
        added_text.push(0);
        added_text.extend_from_slice(&bytes);
        added.push(a.name.clone());
    }
    for f in &patch.files {
        if !src_dir.join(&f.name).is_file() {
            return Err(format!("{label}: the pinned source has no {}", src_dir.join(&f.name).display()));
        }
    }
    let mut stack = vec![String::new()];
    while let Some(rel) = stack.pop() {
        let dir = src_dir.join(&rel);
        let dest_dir = out_dir.join(&rel);
        fs::create_dir_all(&dest_dir).map_err(|e| format!("{}: {e}", dest_dir.display()))?;
        for entry in fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
            let path = entry.map_err(|e| e.to_string())?.path();
            let name = path.file_name().and_then(|n| n.to_str()).ok_or("non-UTF-8 file name")?;
            let name = if rel.is_empty() { name.to_string() } else { format!("{rel}/{name}") };
            if path.is_dir() {
                stack.push(name);
                continue;
            }
            if !path.is_file() {
                continue;
            }
            let dest = out_dir.join(&name);
            if patch.files.iter().any(|f| f.name == name) {
                let original = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                let out = patch.apply_to(&label, &name, &original)?;
                if fs::read_to_string(&dest).map(|old| old != out).unwrap_or(true) {
                    fs::write(&dest, out).map_err(|e| format!("{}: {e}", dest.display()))?;
                }
            } else {
                // unpatched files are copied as bytes (not every file of a tree is text)
                let bytes = fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                if fs::read(&dest).map(|old| old != bytes).unwrap_or(true) {
                    fs::write(&dest, bytes).map_err(|e| format!("{}: {e}", dest.display()))?;
                }
            }
        }
    }
    Ok(Applied { dir: out_dir.to_path_buf(), added, added_text })
}
