//! `<lora:name:multiplier>` prompt tags and the file lookup of `--lora-model-dir`, as the
//! reference's CLI reads them (stable-diffusion.cpp's `examples/common/common.cpp`,
//! `extract_and_remove_lora`).
//!
//! Facts followed: a tag is `<lora:` + a name without `:` or `>` + `:` + anything up to `>`;
//! only the prompt is searched (the negative prompt is left as written); each tag is removed
//! from the prompt; the multiplier is read like C++'s `std::stof` (leading spaces, the longest
//! number prefix), and a tag whose multiplier is no number is removed and ignored; the name is
//! a path relative to the directory, tried as written and then with `.gguf`,
//! `.safetensors`, `.pt`, `.ckpt` appended, in that order; the same file named twice has its
//! multipliers summed; the adapters are applied in the order of their paths. Where the
//! reference only warns and drops a tag naming no file, we refuse the request, naming the file
//! and the directory searched.
//!
//! Where we differ on purpose: a name is confined to `--lora-model-dir`. The reference takes
//! an absolute name as it is and joins `..` as written, so a prompt (which may come from
//! someone else: a shared prompt file, a server's request) opens any file of the machine
//! (`<lora:/etc/passwd:1>`); here an absolute name, a `..` component or a root/prefix is
//! refused with the tag's name. Links inside the directory are followed (model managers link
//! their files there). A name that exists but is not a regular file (a FIFO, a device, a
//! directory) is refused as such, not reported missing. A multiplier out of `f32`'s range
//! (`1e99`, where the reference's `stof` throws and the tag is dropped) is refused too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{LoraError, LoraRequest};

/// Extensions tried after the name as written, in the reference's order.
const EXTENSIONS: [&str; 4] = [".gguf", ".safetensors", ".pt", ".ckpt"];

/// `prompt` without its `<lora:...>` tags, and the adapters they name, looked up in `dir`
/// (sorted by path, multipliers of one path summed). A tag naming no file is an error naming
/// it and `dir`.
pub fn extract(prompt: &str, dir: &Path) -> Result<(String, Vec<LoraRequest>), LoraError> {
    let mut out = String::with_capacity(prompt.len());
    let mut found: BTreeMap<PathBuf, f32> = BTreeMap::new();
    let mut rest = prompt;
    while let Some(start) = rest.find("<lora:") {
        let Some((name, mult, len)) = tag_at(&rest[start..]) else {
            // Not a tag here: keep `<` and look further.
            out.push_str(&rest[..start + 1]);
            rest = &rest[start + 1..];
            continue;
        };
        out.push_str(&rest[..start]);
        rest = &rest[start + len..];
        let multiplier = match stof(mult) {
            Number::Value(m) => m,
            Number::OutOfRange => {
                return Err(LoraError::Tag {
                    name: shown(name),
                    problem: format!("the multiplier '{}' is out of range", shown(mult)),
                })
            }
            Number::None => {
                tracing::warn!(
                    "LoRA tag <lora:{}:{}>: '{}' is not a number; tag ignored",
                    shown(name),
                    shown(mult),
                    shown(mult)
                );
                continue;
            }
        };
        let path = resolve(name, dir)?;
        *found.entry(path).or_insert(0.0) += multiplier;
    }
    out.push_str(rest);
    Ok((out, found.into_iter().map(|(path, multiplier)| LoraRequest { path, multiplier }).collect()))
}

/// At the start of `s` (which begins with `<lora:`): the name, the multiplier text and the
/// tag's length in bytes, when a whole tag is there.
fn tag_at(s: &str) -> Option<(&str, &str, usize)> {
    let body = &s["<lora:".len()..];
    let name_end = body.find([':', '>'])?;
    if name_end == 0 || body.as_bytes()[name_end] != b':' {
        return None;
    }
    let after = &body[name_end + 1..];
    let mult_end = after.find('>')?;
    if mult_end == 0 {
        return None;
    }
    Some((&body[..name_end], &after[..mult_end], "<lora:".len() + name_end + 1 + mult_end + 1))
}

/// `s` for a message: control characters escaped (a tag is text of the user's, echoed in an
/// error), cut to 80 characters.
fn shown(s: &str) -> String {
    let mut out: String = s.chars().take(80).flat_map(char::escape_debug).collect();
    if s.chars().nth(80).is_some() {
        out.push_str(&format!("... ({} bytes)", s.len()));
    }
    out
}

/// The file a tag names: `name` under `dir`, as written, else with each of [`EXTENSIONS`]
/// appended. `name` must stay inside `dir` (relative, no `..`); the first candidate that
/// exists must be a regular file (links followed).
fn resolve(name: &str, dir: &Path) -> Result<PathBuf, LoraError> {
    use std::path::Component;
    let escapes = Path::new(name).components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir));
    if escapes {
        return Err(LoraError::Tag {
            name: shown(name),
            problem: format!(
                "a LoRA is named by a path inside --lora-model-dir '{}' (no absolute path, no '..')",
                dir.display()
            ),
        });
    }
    let base = dir.join(name);
    let with = |ext: &str| {
        let mut p = base.clone().into_os_string();
        p.push(ext);
        PathBuf::from(p)
    };
    for p in std::iter::once(base.clone()).chain(EXTENSIONS.iter().map(|e| with(e))) {
        // `metadata` follows links; a dangling link is as missing.
        let Ok(meta) = std::fs::metadata(&p) else { continue };
        if meta.is_file() {
            return Ok(p);
        }
        return Err(LoraError::NotRegular { name: shown(name), path: p, kind: crate::files::open::kind_of(&meta) });
    }
    Err(LoraError::NotFound { name: shown(name), dir: dir.to_path_buf(), tried: EXTENSIONS.join(", ") })
}

/// What [`stof`] reads.
#[derive(Debug, PartialEq)]
enum Number {
    Value(f32),
    /// A number, beyond `f32`'s range (`std::stof` throws `out_of_range`).
    OutOfRange,
    /// No number (`std::stof` throws `invalid_argument`).
    None,
}

/// `std::stof`: leading white space, then the longest prefix that is a decimal number
/// (`[+-]digits[.digits][e[+-]digits]`).
fn stof(s: &str) -> Number {
    let t = s.trim_start();
    let b = t.as_bytes();
    let mut i = 0;
    if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
        i += 1;
    }
    let digits = |i: &mut usize| {
        let s = *i;
        while *i < b.len() && b[*i].is_ascii_digit() {
            *i += 1;
        }
        *i - s
    };
    let mut n = digits(&mut i);
    if i < b.len() && b[i] == b'.' {
        i += 1;
        n += digits(&mut i);
    }
    if n == 0 {
        return Number::None;
    }
    let mantissa_end = i;
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        let mut j = i + 1;
        if j < b.len() && (b[j] == b'+' || b[j] == b'-') {
            j += 1;
        }
        if digits(&mut j) > 0 {
            i = j;
        }
    }
    let text = if i > mantissa_end { &t[..i] } else { &t[..mantissa_end] };
    match text.parse::<f32>() {
        Ok(v) if v.is_finite() => Number::Value(v),
        _ => Number::OutOfRange,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// A directory holding `files`, removed with the value.
    fn dir_with(files: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::Builder::new().prefix("sd-lora-tags-").tempdir().unwrap();
        for f in files {
            std::fs::write(dir.path().join(f), b"x").unwrap();
        }
        dir
    }

    #[test]
    fn tags_are_removed_looked_up_and_summed() {
        let tmp = dir_with(&["style.safetensors", "b.gguf", "b.safetensors"]);
        let dir = tmp.path();
        let (p, loras) =
            extract("a cat <lora:style:0.8>, <lora:b:-1> sitting<lora:style:0.2> <lora:x:abc>", dir).unwrap();
        assert_eq!(p, "a cat ,  sitting ");
        // b: .gguf comes before .safetensors; sorted by path; style summed to 1.0.
        assert_eq!(loras.len(), 2);
        assert_eq!(loras[0].path, dir.join("b.gguf"));
        assert_eq!(loras[0].multiplier, -1.0);
        assert_eq!(loras[1].path, dir.join("style.safetensors"));
        assert!((loras[1].multiplier - 1.0).abs() < 1e-6);
    }

    #[test]
    fn not_tags_are_kept() {
        let tmp = dir_with(&[]);
        let dir = tmp.path();
        for s in ["<lora:>", "<lora::1>", "<lora:x>", "<lora:a:", "x < y <lora", "<lora:n:>"] {
            assert_eq!(extract(s, dir).unwrap(), (s.to_string(), vec![]), "{s}");
        }
    }

    #[test]
    fn a_missing_file_names_it_and_the_directory() {
        let tmp = dir_with(&[]);
        let dir = tmp.path();
        let e = extract("<lora:nothing_here:1>", dir).unwrap_err().to_string();
        assert!(
            e.contains("nothing_here") && e.contains(&dir.display().to_string()) && e.contains(".safetensors"),
            "{e}"
        );
    }

    /// Issue 32, row 18: names stay inside the directory; what is not a regular file is
    /// named as what it is; nothing of the tag is echoed raw.
    #[test]
    fn names_are_confined_to_the_directory_and_must_be_regular_files() {
        let tmp = dir_with(&["inside.safetensors"]);
        let dir = tmp.path();
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/deeper.gguf"), b"x").unwrap();
        let (_, loras) = extract("<lora:sub/deeper:1><lora:./inside:1>", dir).unwrap();
        assert_eq!(loras.len(), 2);
        for name in ["/etc/passwd", "../inside", "sub/../../x", "sub/../inside"] {
            let e = extract(&format!("<lora:{name}:1>"), dir).unwrap_err();
            assert!(matches!(e, LoraError::Tag { .. }), "{name}: {e}");
            let e = e.to_string();
            assert!(e.contains(name) && e.contains("--lora-model-dir") && e.contains("'..'"), "{e}");
        }
        // A FIFO, a device (through a link) and a directory, under the name or with an extension.
        let st = Command::new("mkfifo").arg(dir.join("pipe.safetensors")).status().unwrap();
        assert!(st.success());
        let _ = std::fs::remove_file(dir.join("zero"));
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero")).unwrap();
        std::fs::create_dir_all(dir.join("folder.gguf")).unwrap();
        for (name, kind) in [("pipe", "a FIFO"), ("zero", "a character device"), ("folder", "a directory")] {
            let e = extract(&format!("<lora:{name}:1>"), dir).unwrap_err();
            assert!(matches!(e, LoraError::NotRegular { .. }), "{name}: {e}");
            let e = e.to_string();
            assert!(e.contains(kind) && e.contains("not a regular file") && !e.contains("not found"), "{e}");
        }
        // Control characters of a tag are escaped in the message.
        let e = extract("<lora:a\x1b[2Jb:1>", dir).unwrap_err().to_string();
        assert!(e.contains("\\u{1b}") && !e.contains('\x1b'), "{e}");
        // A multiplier beyond f32 is refused (the reference drops the tag); 1e38 is a number
        // (its scale is judged with the file's alpha when the file is read).
        let e = extract("<lora:inside:1e99>", dir).unwrap_err().to_string();
        assert!(e.contains("inside") && e.contains("'1e99' is out of range"), "{e}");
        assert_eq!(extract("<lora:inside:1e38>", dir).unwrap().1[0].multiplier, 1e38);
    }

    #[test]
    fn multipliers_read_like_stof() {
        for (s, want) in [("1", 1.0), (" 0.5x", 0.5), ("-1e1", -10.0), ("1e", 1.0), ("1e38", 1e38)] {
            assert_eq!(stof(s), Number::Value(want), "{s}");
        }
        for s in ["x", ".", "-"] {
            assert_eq!(stof(s), Number::None, "{s}");
        }
        for s in ["1e99", "-1e39"] {
            assert_eq!(stof(s), Number::OutOfRange, "{s}");
        }
    }
}
