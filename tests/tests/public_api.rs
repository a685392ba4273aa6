//! The public API of each crate packaged for other tools (`PACKAGED`), committed: its
//! `public-api.txt` lists every `pub` declaration of its `src/` (the declaration's first line),
//! so that a change to what other tools depend on (an item or field added, renamed or removed, a
//! signature changed) shows in review as a change of that file. Regenerate with
//! `UPDATE_PUBLIC_API=1 cargo test -p sd-tests --test public_api` and judge the diff by semver: a
//! removal or a change is breaking, an addition is a minor version (a field added to a struct
//! without `..Default::default()` users is breaking too).

use std::path::Path;

/// Every line of `src/` (and its folders) that declares a `pub` item, field or variant-bearing type, as
/// `file: declaration`, in file and line order.
fn public_lines(src: &Path) -> String {
    fn rs_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                rs_files(&p, out);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    rs_files(src, &mut files);
    files.sort();
    let mut out = String::new();
    for f in &files {
        // `segments/mod.rs` for a module's files
        let name = f.strip_prefix(src).unwrap().to_string_lossy().replace('\\', "/");
        let text = std::fs::read_to_string(f).unwrap();
        let mut in_tests = false;
        for line in text.lines() {
            let t = line.trim();
            if t == "#[cfg(test)]" {
                in_tests = true;
            }
            if in_tests {
                continue;
            }
            if t.starts_with("pub ") {
                let decl = t.trim_end_matches('{').trim_end();
                out.push_str(&format!("{name}: {decl}\n"));
            }
        }
    }
    out
}

/// The crates other tools depend on (`xtask/tests/package.rs` packages them).
const PACKAGED: [&str; 4] = ["sd-placement", "sd-arch", "sd-formats", "sd-sampling"];

#[test]
fn the_public_api_is_the_committed_one() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("crates");
    let mut changed = Vec::new();
    for name in PACKAGED {
        let root = crates.join(name);
        let now = public_lines(&root.join("src"));
        let file = root.join("public-api.txt");
        if std::env::var_os("UPDATE_PUBLIC_API").is_some() {
            std::fs::write(&file, &now).unwrap();
        }
        let committed = std::fs::read_to_string(&file).unwrap_or_default();
        if committed != now {
            let gone: Vec<&str> = committed.lines().filter(|l| !now.lines().any(|n| n == *l)).collect();
            let new: Vec<&str> = now.lines().filter(|l| !committed.lines().any(|c| c == *l)).collect();
            changed.push(format!(
                "{name}: removed or changed:\n  {}\nadded:\n  {}",
                gone.join("\n  "),
                new.join("\n  ")
            ));
        }
    }
    assert!(
        changed.is_empty(),
        "the public API changed; rerun with UPDATE_PUBLIC_API=1 and judge the diff by semver\n{}",
        changed.join("\n")
    );
}
