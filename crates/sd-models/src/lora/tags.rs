//! `<lora:name:multiplier>` prompt tags and the file lookup of `--lora-model-dir`, as the
//! reference's CLI reads them (stable-diffusion.cpp's `examples/common/common.cpp`,
//! `extract_and_remove_lora`).
//!
//! Facts followed: a tag is `<lora:` + a name without `:` or `>` + `:` + anything up to `>`;
//! only the prompt is searched (the negative prompt is left as written); each tag is removed
//! from the prompt; the multiplier is read like C++'s `std::stof` (leading spaces, the longest
//! number prefix), and a tag whose multiplier is no number is removed and ignored; the name is
//! a path relative to the directory (or absolute), tried as written and then with `.gguf`,
//! `.safetensors`, `.pt`, `.ckpt` appended, in that order; the same file named twice has its
//! multipliers summed; the adapters are applied in the order of their paths. Where the
//! reference only warns and drops a tag naming no file, we refuse the request, naming the file
//! and the directory searched.

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
        let Some(multiplier) = stof(mult) else {
            tracing::warn!("LoRA tag <lora:{name}:{mult}>: '{mult}' is not a number; tag ignored");
            continue;
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

/// The file a tag names: `name` under `dir` (or absolute), as written, else with each of
/// [`EXTENSIONS`] appended.
fn resolve(name: &str, dir: &Path) -> Result<PathBuf, LoraError> {
    let base = if Path::new(name).is_absolute() { PathBuf::from(name) } else { dir.join(name) };
    if base.is_file() {
        return Ok(base);
    }
    for ext in EXTENSIONS {
        let mut p = base.clone().into_os_string();
        p.push(ext);
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(LoraError::NotFound { name: name.to_owned(), dir: dir.to_path_buf(), tried: EXTENSIONS.join(", ") })
}

/// `std::stof`: leading white space, then the longest prefix that is a decimal number
/// (`[+-]digits[.digits][e[+-]digits]`); `None` when there is none or it is out of range.
fn stof(s: &str) -> Option<f32> {
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
        return None;
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
    text.parse::<f32>().ok().filter(|v| v.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(files: &[&str]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sd-lora-tags-{}-{}", std::process::id(), files.join("-")));
        std::fs::create_dir_all(&dir).unwrap();
        for f in files {
            std::fs::write(dir.join(f), b"x").unwrap();
        }
        dir
    }

    #[test]
    fn tags_are_removed_looked_up_and_summed() {
        let dir = dir_with(&["style.safetensors", "b.gguf", "b.safetensors"]);
        let (p, loras) =
            extract("a cat <lora:style:0.8>, <lora:b:-1> sitting<lora:style:0.2> <lora:x:abc>", &dir).unwrap();
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
        let dir = dir_with(&[]);
        for s in ["<lora:>", "<lora::1>", "<lora:x>", "<lora:a:", "x < y <lora", "<lora:n:>"] {
            assert_eq!(extract(s, &dir).unwrap(), (s.to_string(), vec![]), "{s}");
        }
    }

    #[test]
    fn a_missing_file_names_it_and_the_directory() {
        let dir = dir_with(&[]);
        let e = extract("<lora:nothing_here:1>", &dir).unwrap_err().to_string();
        assert!(
            e.contains("nothing_here") && e.contains(&dir.display().to_string()) && e.contains(".safetensors"),
            "{e}"
        );
    }

    #[test]
    fn multipliers_read_like_stof() {
        for (s, want) in [("1", Some(1.0)), (" 0.5x", Some(0.5)), ("-1e1", Some(-10.0)), ("1e", Some(1.0))] {
            assert_eq!(stof(s), want, "{s}");
        }
        for s in ["x", ".", "-", "1e99"] {
            assert_eq!(stof(s), None, "{s}");
        }
    }
}
