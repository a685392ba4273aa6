//! The bad-input corpus (issue 11): malformed models, placement strings, argument sets and faults, run through the real binary.
//!
//! One table-driven test: every case runs `sd-cli` as a child process with a deadline and
//! must exit (never die by a signal, never hang) with the expected status and a message
//! naming the offending thing; afterwards no file that existed before has changed. The text
//! tables live in `tests/data/bad/` (see its README); model files are generated here.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sd_models::files::safetensors::{header_bytes, to_bytes, HeaderEntry};
use sd_models::files::DType;
use sd_models::fixture::{tensor_table, Architecture};
use sd_models::text::clip::{clip_specs, ClipConfig};

/// Deadline of a case that must fail in validation (they take milliseconds; the margin is
/// for a loaded CI machine).
const FAIL_DEADLINE: Duration = Duration::from_secs(60);

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One invocation and what it must give.
struct Case {
    name: String,
    args: Vec<String>,
    /// Expected exit status.
    status: i32,
    /// Environment variables set for it.
    env: Vec<(String, String)>,
    /// Substrings stderr must contain.
    needles: Vec<String>,
}

struct Outcome {
    status: Option<i32>,
    signal: Option<i32>,
    stderr: String,
    timed_out: bool,
}

fn run(args: &[String], env: &[(String, String)], deadline: Duration) -> Outcome {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sd-cli"))
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .env_remove("SD_PIPELINE_COPIES")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sd-cli starts");
    let mut err = child.stderr.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let mut timed_out = false;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if start.elapsed() > deadline {
            timed_out = true;
            let _ = child.kill();
            break child.wait().expect("wait after kill");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Outcome { status: status.code(), signal: status.signal(), stderr: reader.join().unwrap_or_default(), timed_out }
}

/// Checks one outcome; returns a failure description.
fn judge(case: &Case, o: &Outcome) -> Option<String> {
    let tail: String = o.stderr.chars().rev().take(600).collect::<Vec<_>>().into_iter().rev().collect();
    if o.timed_out {
        return Some(format!("{}: no exit within the deadline (hang); stderr: {tail}", case.name));
    }
    if let Some(sig) = o.signal {
        return Some(format!("{}: killed by signal {sig}; stderr: {tail}", case.name));
    }
    if o.status != Some(case.status) {
        return Some(format!("{}: exit status {:?}, expected {}; stderr: {tail}", case.name, o.status, case.status));
    }
    for n in &case.needles {
        if !o.stderr.contains(n.as_str()) {
            return Some(format!("{}: stderr lacks {n:?}: {tail}", case.name));
        }
    }
    // Issue 39: a flag of the reference that sd-rs lacks is named as such, with no guess at
    // a similar flag (`--control-net` was pointed at `--control-net-cpu`).
    if o.stderr.contains("not implemented by sd-rs") && o.stderr.contains("similar") {
        return Some(format!("{}: a 'did you mean' beside 'not implemented': {tail}", case.name));
    }
    if let Some(repeat) = repeated_cause(&o.stderr) {
        return Some(format!("{}: the error repeats {repeat:?}: {tail}", case.name));
    }
    if let Some(c) = o.stderr.chars().find(|c| c.is_control() && *c != '\n' && *c != '\t') {
        return Some(format!("{}: a raw control character {c:?} in the messages: {tail:?}", case.name));
    }
    if o.stderr.contains("panicked") || o.stderr.contains("RUST_BACKTRACE") {
        return Some(format!("{}: a panic: {tail}", case.name));
    }
    if o.stderr.len() > 20_000 {
        return Some(format!("{}: {} bytes of stderr (an input echoed whole?)", case.name, o.stderr.len()));
    }
    None
}

/// A segment of an `error:` line's cause chain (`a: b: c`) that appears twice: each error
/// describes its own layer and leaves its cause to `source`, so no cause is printed twice
/// (a wrapper that also formats its source into its message gives `a: b: b`).
fn repeated_cause(stderr: &str) -> Option<String> {
    for line in stderr.lines() {
        let Some(chain) = line.strip_prefix("error: ") else { continue };
        let segments: Vec<&str> = chain.split(": ").map(str::trim).filter(|s| s.len() > 3).collect();
        for (i, a) in segments.iter().enumerate() {
            if segments[i + 1..].contains(a) {
                return Some((*a).to_string());
            }
        }
    }
    None
}

#[test]
fn a_repeated_cause_is_found() {
    assert_eq!(repeated_cause("error: loading: disk on fire: disk on fire\n"), Some("disk on fire".into()));
    assert_eq!(repeated_cause("error: a tensor: x.st: truncated: a tensor: x.st\n"), Some("a tensor".into()));
    assert_eq!(repeated_cause("error: VAE: reading 'a.st': file changed\n"), None);
    assert_eq!(repeated_cause("warn: x: x\nerror: a b c: d e f\n"), None);
}

// ---------------------------------------------------------------------------------------
// Model files
// ---------------------------------------------------------------------------------------

/// The SD 1.5 layout as safetensors specs (f16), optionally one tensor with another dtype.
fn sd15_specs() -> Vec<(String, Vec<u64>)> {
    tensor_table(&Architecture::sd15()).expect("sd15 layout").into_iter().map(|t| (t.name, t.shape)).collect()
}

/// A sparse safetensors file: the header of `tensors`, then zeros to the data's full length.
fn write_sparse(path: &Path, tensors: &[(String, Vec<u64>, DType)]) {
    let specs: Vec<HeaderEntry<'_>> =
        tensors.iter().map(|(n, s, d)| HeaderEntry { name: n, dtype: *d, shape: s }).collect();
    let header = header_bytes(&specs, &BTreeMap::new()).expect("header");
    let data: u64 = tensors
        .iter()
        .map(|(_, s, d)| d.tensor_bytes(s.last().copied().unwrap_or(1), s.iter().product()).expect("size"))
        .sum();
    std::fs::write(path, &header).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len(header.len() as u64 + data).unwrap();
}

fn sd15_with(path: &Path, change: Option<(&str, DType)>) {
    let t: Vec<(String, Vec<u64>, DType)> = sd15_specs()
        .into_iter()
        .map(|(n, s)| {
            let d = match change {
                Some((name, d)) if n == name => d,
                _ => DType::F16,
            };
            (n, s, d)
        })
        .collect();
    write_sparse(path, &t);
}

/// Writes an f16 NaN over the first element of tensor `name` (as stored) of `path`.
fn poke_f16_nan(path: &Path, name: &str) {
    use std::io::{Seek, SeekFrom, Write};
    let offset = {
        let files = sd_models::files::ModelFiles::open_model(path).unwrap();
        files.index().entries().iter().find(|e| e.original_name == name).expect("tensor").offset
    };
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(&0x7e00u16.to_le_bytes()).unwrap();
}

/// A safetensors file from a JSON header and `data_len` bytes of data.
fn st(json: &str, data_len: usize) -> Vec<u8> {
    let mut v = (json.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(json.as_bytes());
    v.extend(std::iter::repeat_n(0u8, data_len));
    v
}

/// A LoRA file of f32 tensors, each filled with one value.
fn lora_file(path: &Path, tensors: &[(String, Vec<u64>, f32)]) {
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, s, v)| std::iter::repeat_n(v.to_le_bytes(), s.iter().product::<u64>() as usize).flatten().collect())
        .collect();
    let entries: Vec<(HeaderEntry<'_>, &[u8])> = tensors
        .iter()
        .zip(&data)
        .map(|((n, s, _), d)| (HeaderEntry { name: n, dtype: DType::F32, shape: s }, d.as_slice()))
        .collect();
    std::fs::write(path, to_bytes(&entries, &BTreeMap::new()).expect("a LoRA file")).unwrap();
}

/// The LoRA files of issue 32's cases in `dir`: `rows` (a `lora_up` of 320 rows for the
/// 2560-row `ff.net.0.proj`), `alpha` (alpha 1e30), `ok` (a right one, alpha = rank), `notes`
/// (text), `pipe` (a FIFO), `zero` (a link to /dev/zero), `adir` (a directory).
fn lora_dir(dir: &Path) {
    std::fs::create_dir_all(dir.join("adir")).unwrap();
    let ff = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_ff_net_0_proj";
    let q = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q";
    let pair = |key: &str, up: u64, inner: u64, alpha: f32| {
        vec![
            (format!("{key}.lora_up.weight"), vec![up, 4], 0.01f32),
            (format!("{key}.lora_down.weight"), vec![4, inner], 0.01),
            (format!("{key}.alpha"), vec![], alpha),
        ]
    };
    lora_file(&dir.join("rows.safetensors"), &pair(ff, 320, 320, 4.0));
    lora_file(&dir.join("alpha.safetensors"), &pair(q, 320, 320, 1e30));
    lora_file(&dir.join("ok.safetensors"), &pair(q, 320, 320, 4.0));
    std::fs::write(dir.join("notes"), "root:x:0:0:root:/root:/bin/bash\n").unwrap();
    mkfifo(&dir.join("pipe.safetensors"));
    std::os::unix::fs::symlink("/dev/zero", dir.join("zero")).unwrap();
}

/// A hand-built GGUF file.
#[derive(Default)]
struct Gguf {
    version: u32,
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    /// Overrides of the counts as written.
    n_kv_written: Option<u64>,
    n_tensors_written: Option<u64>,
    data: Vec<u8>,
}

fn gstr(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl Gguf {
    fn new() -> Self {
        Gguf { version: 3, ..Default::default() }
    }
    fn kv_raw(mut self, key: &str, type_id: u32, value: &[u8]) -> Self {
        gstr(&mut self.kv, key);
        self.kv.extend_from_slice(&type_id.to_le_bytes());
        self.kv.extend_from_slice(value);
        self.n_kv += 1;
        self
    }
    fn tensor(mut self, name: &str, ne: &[i64], ty: u32, offset: u64) -> Self {
        gstr(&mut self.infos, name);
        self.infos.extend_from_slice(&(ne.len() as u32).to_le_bytes());
        for d in ne {
            self.infos.extend_from_slice(&d.to_le_bytes());
        }
        self.infos.extend_from_slice(&ty.to_le_bytes());
        self.infos.extend_from_slice(&offset.to_le_bytes());
        self.n_tensors += 1;
        self
    }
    fn data(mut self, n: usize) -> Self {
        self.data = vec![0; n];
        self
    }
    fn bytes(&self) -> Vec<u8> {
        let mut v = b"GGUF".to_vec();
        v.extend_from_slice(&self.version.to_le_bytes());
        v.extend_from_slice(&self.n_tensors_written.unwrap_or(self.n_tensors).to_le_bytes());
        v.extend_from_slice(&self.n_kv_written.unwrap_or(self.n_kv).to_le_bytes());
        v.extend_from_slice(&self.kv);
        v.extend_from_slice(&self.infos);
        while !v.len().is_multiple_of(32) {
            v.push(0);
        }
        v.extend_from_slice(&self.data);
        v
    }
}

const W: &str = "model.diffusion_model.out.2.bias";
const MATMUL: &str = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight";

/// The malformed model files: (file name, bytes, needles). Each is given as `plan -m`.
fn malformed() -> Vec<(String, Vec<u8>, Vec<&'static str>)> {
    let t = |dtype: &str, shape: &str, offs: &str| {
        format!(r#"{{"{W}":{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offs}}}}}"#)
    };
    let mut v: Vec<(String, Vec<u8>, Vec<&'static str>)> = vec![
        ("empty.safetensors".into(), vec![], vec!["truncated"]),
        ("four-bytes.safetensors".into(), vec![1, 2, 3, 4], vec!["truncated"]),
        ("header-past-end.safetensors".into(), 1000u64.to_le_bytes().to_vec(), vec!["header length 1000"]),
        ("header-huge.safetensors".into(), u64::MAX.to_le_bytes().to_vec(), vec!["impossible"]),
        ("not-utf8.safetensors".into(), [&2u64.to_le_bytes()[..], &[0xff, 0xfe]].concat(), vec!["not valid UTF-8"]),
        ("not-json.safetensors".into(), st("{not json", 0), vec!["not valid JSON"]),
        ("json-array.safetensors".into(), st("[1,2]", 0), vec!["not valid JSON"]),
        ("entry-not-object.safetensors".into(), st(&format!(r#"{{"{W}":5}}"#), 0), vec!["not an object"]),
        (
            "dtype-missing.safetensors".into(),
            st(&format!(r#"{{"{W}":{{"shape":[4],"data_offsets":[0,8]}}}}"#), 8),
            vec!["\"dtype\" is missing"],
        ),
        ("dtype-unknown.safetensors".into(), st(&t("Q9", "[4]", "[0,8]"), 8), vec!["unknown dtype 'Q9'"]),
        (
            "dtype-number.safetensors".into(),
            st(&t("F16", "[4]", "[0,8]").replace("\"F16\"", "7"), 8),
            vec!["not a string"],
        ),
        ("shape-negative.safetensors".into(), st(&t("F16", "[-4]", "[0,8]"), 8), vec!["shape[0]"]),
        (
            "shape-missing.safetensors".into(),
            st(&format!(r#"{{"{W}":{{"dtype":"F16","data_offsets":[0,8]}}}}"#), 8),
            vec!["\"shape\" is missing"],
        ),
        ("offsets-reversed.safetensors".into(), st(&t("F16", "[4]", "[8,0]"), 8), vec!["begin is after end"]),
        ("offsets-past-end.safetensors".into(), st(&t("F16", "[4]", "[0,8]"), 4), vec!["past its end"]),
        ("size-mismatch.safetensors".into(), st(&t("F16", "[5]", "[0,8]"), 8), vec!["needs 10 bytes"]),
        ("offsets-three.safetensors".into(), st(&t("F16", "[4]", "[0,8,9]"), 9), vec!["data_offsets"]),
        (
            "shape-overflow.safetensors".into(),
            st(&t("F16", "[4294967296,4294967296,16]", "[0,8]"), 8),
            vec!["overflows"],
        ),
        (
            "overlap.safetensors".into(),
            st(
                &format!(
                    r#"{{"{W}":{{"dtype":"F16","shape":[4],"data_offsets":[0,8]}},"model.diffusion_model.out.2.weight":{{"dtype":"F16","shape":[4],"data_offsets":[4,12]}}}}"#
                ),
                12,
            ),
            vec!["overlap"],
        ),
        (
            "duplicate.safetensors".into(),
            st(
                &format!(
                    r#"{{"{W}":{{"dtype":"F16","shape":[4],"data_offsets":[0,8]}},"{W}":{{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}}}"#
                ),
                8,
            ),
            vec!["twice"],
        ),
        ("metadata-array.safetensors".into(), st(r#"{"__metadata__":[1]}"#, 0), vec!["__metadata__"]),
        ("no-tensors.safetensors".into(), st("{}", 0), vec!["no tensor of a text encoder"]),
        (
            "only-unknown.safetensors".into(),
            st(r#"{"lora.down.weight":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}"#, 8),
            vec!["no tensor of a text encoder"],
        ),
        ("i8-weight.safetensors".into(), st(&t("I8", "[4]", "[0,4]"), 4), vec!["i8", "cannot compute"]),
        ("bool-weight.safetensors".into(), st(&t("BOOL", "[4]", "[0,4]"), 4), vec!["cannot compute"]),
        (
            "fused-qkv-not-thirds.safetensors".into(),
            st(
                r#"{"cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight":{"dtype":"F16","shape":[4,4],"data_offsets":[0,32]}}"#,
                32,
            ),
            vec!["q/k/v thirds"],
        ),
        ("junk.bin".into(), b"hello, this is not a model file".to_vec(), vec!["neither a safetensors nor a GGUF"]),
        // GGUF
        ("bad-magic.gguf".into(), b"GGUX\x03\0\0\0".to_vec(), vec!["magic"]),
        ("v1.gguf".into(), Gguf { version: 1, ..Gguf::new() }.bytes(), vec!["obsolete"]),
        ("big-endian.gguf".into(), Gguf { version: 3 << 24, ..Gguf::new() }.bytes(), vec!["big-endian"]),
        (
            "tensor-count-huge.gguf".into(),
            Gguf { n_tensors_written: Some(u64::MAX), ..Gguf::new() }.bytes(),
            vec!["tensor count"],
        ),
        ("kv-count-huge.gguf".into(), Gguf { n_kv_written: Some(1 << 40), ..Gguf::new() }.bytes(), vec!["key count"]),
        (
            "string-huge.gguf".into(),
            Gguf::new().kv_raw("general.name", 8, &u64::MAX.to_le_bytes()).bytes(),
            vec!["general.name"],
        ),
        (
            "value-type-unknown.gguf".into(),
            Gguf::new().kv_raw("general.x", 99, &[0; 8]).bytes(),
            vec!["unknown value type 99"],
        ),
        (
            "array-of-arrays.gguf".into(),
            Gguf::new().kv_raw("general.x", 9, &[9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]).bytes(),
            vec!["general.x"],
        ),
        (
            "key-twice.gguf".into(),
            Gguf::new().kv_raw("general.a", 4, &[1, 0, 0, 0]).kv_raw("general.a", 4, &[1, 0, 0, 0]).bytes(),
            vec!["appears twice"],
        ),
        ("key-empty.gguf".into(), Gguf::new().kv_raw("", 4, &[1, 0, 0, 0]).bytes(), vec!["is empty"]),
        (
            "alignment-3.gguf".into(),
            Gguf::new().kv_raw("general.alignment", 4, &[3, 0, 0, 0]).bytes(),
            vec!["power of two"],
        ),
        (
            "alignment-string.gguf".into(),
            Gguf::new().kv_raw("general.alignment", 8, &[1, 0, 0, 0, 0, 0, 0, 0, b'x']).bytes(),
            vec!["must be u32"],
        ),
        ("dims-5.gguf".into(), Gguf::new().tensor(W, &[1, 1, 1, 1, 1], 0, 0).data(32).bytes(), vec!["5 dimensions"]),
        ("dim-negative.gguf".into(), Gguf::new().tensor(W, &[-4], 0, 0).data(32).bytes(), vec!["negative"]),
        (
            "type-removed.gguf".into(),
            Gguf::new().tensor(W, &[4], 4, 0).data(32).bytes(),
            vec!["unknown ggml type id 4"],
        ),
        (
            "misaligned.gguf".into(),
            Gguf::new().tensor(W, &[4], 0, 8).data(64).bytes(),
            vec!["not a multiple of the alignment"],
        ),
        ("tensor-past-end.gguf".into(), Gguf::new().tensor(W, &[4096], 0, 0).data(32).bytes(), vec!["past its end"]),
        ("partial-block.gguf".into(), Gguf::new().tensor(W, &[30], 2, 0).data(64).bytes(), vec!["block size 32"]),
        (
            "infos-truncated.gguf".into(),
            {
                let mut b = Gguf::new().tensor(W, &[4], 0, 0).bytes();
                b.truncate(40);
                b
            },
            vec!["truncated"],
        ),
        (
            "tensor-twice.gguf".into(),
            Gguf::new().tensor(W, &[4], 0, 0).tensor(W, &[4], 0, 32).data(64).bytes(),
            vec!["twice"],
        ),
        (
            "i8-weight.gguf".into(),
            Gguf::new().tensor(MATMUL, &[320, 320], 24, 0).data(320 * 320).bytes(),
            vec!["dtype i8", "diffusion model cannot compute"],
        ),
        ("f64-weight.gguf".into(), Gguf::new().tensor(W, &[4], 28, 0).data(32).bytes(), vec!["dtype f64"]),
        // Issue 32 row 8: types ggml has no matrix product (nor dequantization) for.
        (
            "q8_1-weight.gguf".into(),
            Gguf::new().tensor(MATMUL, &[320, 320], 9, 0).data(320 * 10 * 36).bytes(),
            vec!["dtype q8_1", "to_q.weight", "diffusion model cannot compute"],
        ),
        (
            "q8_K-weight.gguf".into(),
            Gguf::new().tensor(MATMUL, &[256, 320], 15, 0).data(320 * 292).bytes(),
            vec!["dtype q8_K", "to_q.weight", "diffusion model cannot compute"],
        ),
        (
            "no-tensors.gguf".into(),
            Gguf::new().kv_raw("general.name", 8, &[1, 0, 0, 0, 0, 0, 0, 0, b'x']).bytes(),
            vec!["no tensor of a text encoder"],
        ),
    ];
    // Every file's own name must appear in its message.
    for (name, _, needles) in &mut v {
        let leaked: &'static str = Box::leak(name.clone().into_boxed_str());
        needles.push(leaked);
    }
    v
}

/// CLIP's first `fc1` (768 -> 3072) as stored: [3072, 768].
const FC1: &str = "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight";

/// Writes `bytes` at the offset of tensor `name` (as stored) of `path`, plus `at`.
fn poke(path: &Path, name: &str, at: u64, bytes: &[u8]) {
    use std::io::{Seek, SeekFrom, Write};
    let offset = {
        let files = sd_models::files::ModelFiles::open_model(path).unwrap();
        files.index().entries().iter().find(|e| e.original_name == name).expect("tensor").offset
    };
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(offset + at)).unwrap();
    f.write_all(bytes).unwrap();
}

/// The cases of issue 32's weight rows (see the call).
fn weight_cases(dir: &Path, cases: &mut Vec<Case>, plan: &dyn Fn(&str) -> Vec<String>) {
    let d = |n: &str| dir.join(n).display().to_string();
    let generate = |m: &str| -> Vec<String> {
        let (m, out) = (d(m), d("out.png"));
        ["-m", m.as_str(), "-W", "64", "-H", "64", "--steps", "1", "-t", "1", "-o", out.as_str()]
            .map(String::from)
            .to_vec()
    };
    let mut push = |name: &str, args: Vec<String>, status: i32, needles: &[&str]| {
        cases.push(Case {
            name: format!("{} {name}", args[0]),
            args,
            status,
            env: vec![],
            needles: needles.iter().map(|s| s.to_string()).chain([name.to_string()]).collect(),
        });
    };

    // Row 14: fc1 with its two dimensions swapped (the same element count).
    let name = "sd15-fc1-transposed.safetensors";
    let t: Vec<(String, Vec<u64>, DType)> = sd15_specs()
        .into_iter()
        .map(|(n, s)| {
            let s = if n == FC1 { vec![s[1], s[0]] } else { s };
            (n, s, DType::F16)
        })
        .collect();
    write_sparse(&dir.join(name), &t);
    let needles = ["fc1.weight", "has shape [768, 3072]", "expects shape [3072, 768]", "swapped"];
    push(name, plan(&d(name)), 2, &needles);
    push(name, generate(name), 2, &needles);

    // Row 16: a q8_0 weight whose second block's scale is a NaN (a GGUF checkpoint).
    let name = "sd15-q8_0-nan-scale.gguf";
    let t: Vec<(String, Vec<u64>, DType)> = sd15_specs()
        .into_iter()
        .map(|(n, s)| {
            let d = if n == FC1 { DType::Q8_0 } else { DType::F16 };
            (n, s, d)
        })
        .collect();
    let specs: Vec<HeaderEntry<'_>> = t.iter().map(|(n, s, d)| HeaderEntry { name: n, dtype: *d, shape: s }).collect();
    let header = sd_models::files::gguf::header_bytes(&specs, &[]).expect("GGUF header");
    let data: u64 = t
        .iter()
        .map(|(_, s, d)| d.tensor_bytes(*s.last().unwrap(), s.iter().product()).unwrap().div_ceil(32) * 32)
        .sum();
    std::fs::write(dir.join(name), &header).unwrap();
    std::fs::OpenOptions::new().write(true).open(dir.join(name)).unwrap().set_len(header.len() as u64 + data).unwrap();
    poke(&dir.join(name), FC1, 34, &0x7e00u16.to_le_bytes());
    push(name, generate(name), 1, &["fc1.weight", "NaN or infinite value (the scale `d` of block 1: elements 32..64)"]);

    // Row 16: every value of a weight at f16's largest, 65504 (the output overflows).
    let name = "sd15-fc1-65504.safetensors";
    sd15_with(&dir.join(name), None);
    poke(&dir.join(name), FC1, 0, &0x7bffu16.to_le_bytes().repeat(768 * 3072));
    push(name, generate(name), 1, &["fc1.weight", "65504"]);

    // Row 9: a sparse GGUF (4 KB on disk) declaring 2^27 empty strings (1 GiB of lengths).
    let name = "sparse-array.gguf";
    let mut g = b"GGUF".to_vec();
    g.extend_from_slice(&3u32.to_le_bytes());
    g.extend_from_slice(&0u64.to_le_bytes());
    g.extend_from_slice(&1u64.to_le_bytes());
    gstr(&mut g, "tokenizer.ggml.tokens");
    g.extend_from_slice(&9u32.to_le_bytes());
    g.extend_from_slice(&8u32.to_le_bytes());
    g.extend_from_slice(&(1u64 << 27).to_le_bytes());
    std::fs::write(dir.join(name), &g).unwrap();
    std::fs::OpenOptions::new().write(true).open(dir.join(name)).unwrap().set_len(g.len() as u64 + (8 << 27)).unwrap();
    let needles = ["'tokenizer.ggml.tokens'", "134217728 elements; at most"];
    push(name, plan(&d(name)), 2, &needles);
    push(name, generate(name), 2, &needles);

    // Row 18: a T5 encoder given as the diffusion model.
    let name = "t5-encoder.safetensors";
    let json = r#"{"shared.weight":{"dtype":"F16","shape":[4,4],"data_offsets":[0,32]},"encoder.block.0.layer.0.SelfAttention.q.weight":{"dtype":"F16","shape":[4,4],"data_offsets":[32,64]}}"#;
    std::fs::write(dir.join(name), st(json, 64)).unwrap();
    let mut args = generate("good.safetensors");
    args.extend(["--diffusion-model".into(), d(name)]);
    push(name, args, 2, &["is a T5 text encoder, not a diffusion model", "pass it with --t5xxl"]);
}

/// Everything a case directory holds before the cases run (path -> description).
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            let ft = m.file_type();
            let what = if ft.is_symlink() {
                format!("link -> {}", std::fs::read_link(e.path()).unwrap().display())
            } else if ft.is_dir() {
                stack.push(e.path());
                "dir".to_string()
            } else if ft.is_fifo() {
                "fifo".to_string()
            } else {
                let content =
                    if m.len() < (1 << 20) { format!("{:?}", std::fs::read(e.path()).unwrap()) } else { String::new() };
                format!(
                    "file {} bytes mode {:o} mtime {} ino {} {}",
                    m.len(),
                    m.permissions().mode(),
                    m.mtime_nsec(),
                    m.ino(),
                    content.len()
                ) + &content
            };
            out.insert(e.path(), what);
        }
    }
    out
}

fn mkfifo(p: &Path) {
    let st = Command::new("mkfifo").arg(p).status().expect("mkfifo runs");
    assert!(st.success());
}

fn png_64(path: &Path) {
    let f = std::fs::File::create(path).unwrap();
    let mut enc = png::Encoder::new(std::io::BufWriter::new(f), 64, 64);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header().unwrap().write_image_data(&vec![128u8; 64 * 64 * 3]).unwrap();
}

/// Splits a table line's argument column; `{DIR}` and `<empty>` substituted.
fn args_of(column: &str, dir: &Path) -> Vec<String> {
    column
        .split(' ')
        .filter(|a| !a.is_empty())
        .map(|a| if a == "<empty>" { String::new() } else { a.replace("{DIR}", &dir.display().to_string()) })
        .collect()
}

fn table(name: &str) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(workspace().join("tests/data/bad").join(name)).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| l.split('\t').map(str::to_string).collect())
        .collect()
}

#[test]
fn every_bad_input_gets_a_clear_error_without_signal_hang_or_lost_file() {
    let root = std::env::temp_dir().join(format!("sd-cli-corpus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let dir = root.join("case");
    std::fs::create_dir_all(&dir).unwrap();
    let d = |n: &str| dir.join(n).display().to_string();

    // Fixtures of the case directory.
    let good = dir.join("good.safetensors");
    sd15_with(&good, None);
    mkfifo(&dir.join("fifo"));
    std::fs::write(dir.join("ro.png"), b"read-only image").unwrap();
    std::fs::set_permissions(dir.join("ro.png"), std::fs::Permissions::from_mode(0o444)).unwrap();
    std::fs::create_dir(dir.join("batch_1.png")).unwrap();
    std::fs::create_dir(dir.join("adir")).unwrap();
    std::os::unix::fs::symlink("adir", dir.join("link-to-dir.png")).unwrap();
    std::os::unix::fs::symlink("fifo", dir.join("link-to-fifo.png")).unwrap();
    png_64(&dir.join("init.png"));
    lora_dir(&dir.join("loras"));
    // Issue 32, row 18: a 1 MiB prompt (refused by its length before anything is loaded).
    std::fs::write(dir.join("long-prompt.txt"), &"a cat, ".repeat(1 << 20).as_bytes()[..1 << 20]).unwrap();
    // An ESRGAN model as PyTorch saves it (a pickle): refused with "convert it to safetensors".
    std::fs::write(dir.join("esrgan.pth"), b"\x80\x02}q\x00.").unwrap();
    std::fs::write(dir.join("junk.safetensors"), st(r#"{"foo":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}"#, 8))
        .unwrap();
    std::fs::write(
        dir.join("profile.toml"),
        "ram_available_mib = 65536\n[[device]]\nname = \"CUDA0\"\ntype = \"gpu\"\nfree_mib = 24576\ntotal_mib = 24576\n",
    )
    .unwrap();
    let profile = d("profile.toml");
    // Issue 32: files an output must never replace (an input, a file that is not an image).
    std::fs::write(dir.join("notes.txt"), b"my notes").unwrap();
    std::fs::write(dir.join("README"), b"read me").unwrap();
    std::fs::write(dir.join("prompt.txt"), b"a cat").unwrap();
    std::fs::write(dir.join("lora.safetensors"), b"not read: refused before").unwrap();
    std::fs::hard_link(&good, dir.join("model-link.png")).unwrap();
    std::fs::hard_link(dir.join("lora.safetensors"), dir.join("vae-link.png")).unwrap();

    let mut cases: Vec<Case> = Vec::new();
    let plan = |m: &str| vec!["plan".to_string(), "-m".into(), m.to_string(), "--devices".into(), profile.clone()];

    // 1. Malformed model files (plan reads headers only; exit status 2 = bad input).
    let models = malformed();
    let n_models = models.len();
    for (name, bytes, needles) in models {
        std::fs::write(dir.join(&name), bytes).unwrap();
        cases.push(Case {
            name: format!("model {name}"),
            args: plan(&d(&name)),
            status: 2,
            env: vec![],
            needles: needles.into_iter().map(String::from).collect(),
        });
    }
    for (label, dtype, needle) in [
        ("i8", DType::I8, "dtype i8"),
        ("i16", DType::I16, "dtype i16"),
        ("i32", DType::I32, "dtype i32"),
        ("i64", DType::I64, "dtype i64"),
        ("f64", DType::F64, "dtype f64"),
    ] {
        let name = format!("sd15-{label}-matmul.safetensors");
        sd15_with(&dir.join(&name), Some((MATMUL, dtype)));
        for args in [plan(&d(&name)), vec!["-m".into(), d(&name), "-o".into(), d("out.png")]] {
            // bad input: exit status 2 from `plan` and a generation alike (issue 39)
            let status = 2;
            cases.push(Case {
                name: format!("{} {name}", args[0]),
                args,
                status,
                env: vec![],
                needles: vec![needle.into(), "to_q.weight".into(), name.clone()],
            });
        }
    }
    // A checkpoint without its VAE, and one whose VAE holds a NaN: found before sampling.
    let no_vae = dir.join("sd15-no-vae.safetensors");
    let t: Vec<(String, Vec<u64>, DType)> = sd15_specs()
        .into_iter()
        .filter(|(n, _)| !n.starts_with("first_stage_model."))
        .map(|(n, s)| (n, s, DType::F16))
        .collect();
    write_sparse(&no_vae, &t);
    let nan_vae = dir.join("sd15-nan-vae.safetensors");
    sd15_with(&nan_vae, None);
    poke_f16_nan(&nan_vae, "first_stage_model.decoder.conv_in.weight");
    for (path, needles) in [
        (&no_vae, vec!["VAE", "missing", "--vae", "sd15-no-vae.safetensors"]),
        (&nan_vae, vec!["VAE", "NaN", "conv_in.weight", "sd15-nan-vae.safetensors"]),
    ] {
        cases.push(Case {
            name: format!("generate {}", path.display()),
            args: vec![
                "-m".into(),
                path.display().to_string(),
                "-W".into(),
                "64".into(),
                "-H".into(),
                "64".into(),
                "-o".into(),
                d("out.png"),
            ],
            status: 2,
            env: vec![],
            needles: needles.into_iter().map(String::from).collect(),
        });
    }
    // SDXL layouts (Segmind Vega's, the smallest) that cannot run: refused in validation,
    // by `plan` and by a generation alike, naming what is wrong.
    let vega = || -> Vec<(String, Vec<u64>)> {
        let arch = Architecture::sdxl_with(sd_models::fixture::UnetLayout::vega());
        tensor_table(&arch).expect("vega layout").into_iter().map(|t| (t.name, t.shape)).collect()
    };
    let no_bigg: Vec<(String, Vec<u64>, DType)> = vega()
        .into_iter()
        .filter(|(n, _)| !n.starts_with("conditioner.embedders.1."))
        .map(|(n, s)| (n, s, DType::F16))
        .collect();
    let narrow_adm: Vec<(String, Vec<u64>, DType)> = vega()
        .into_iter()
        .map(|(n, s)| {
            let s = if n == "model.diffusion_model.label_emb.0.0.weight" { vec![s[0], 2048] } else { s };
            (n, s, DType::F16)
        })
        .collect();
    for (name, tensors, needles) in [
        (
            "vega-no-bigg.safetensors",
            no_bigg,
            vec!["text encoder", "517 of its 713 tensors are missing", "cond_stage_model.1."],
        ),
        ("vega-adm-2048.safetensors", narrow_adm, vec!["architecture", "label_emb.0.0.weight [1280, 2048]"]),
    ] {
        write_sparse(&dir.join(name), &tensors);
        let generate =
            vec!["-m".into(), d(name), "-W".into(), "64".into(), "-H".into(), "64".into(), "-o".into(), d("out.png")];
        // `plan` refuses what a generation refuses, with the same exit status (2, bad input),
        // an unknown architecture too (issue 39).
        let runs: Vec<(Vec<String>, i32)> = vec![(plan(&d(name)), 2), (generate, 2)];
        for (args, status) in runs {
            let mut needles: Vec<String> = needles.iter().map(|s| s.to_string()).collect();
            needles.push(name.into());
            cases.push(Case { name: format!("{} {name}", args[0]), args, status, env: vec![], needles });
        }
    }
    // SDXL's encoders as separate files (HF names, what `--clip_l` / `--clip_g` files hold):
    // bigG given as `--clip_g` completes the checkpoint; given as `--clip_l` it is named as
    // the wrong encoder for that flag.
    let bigg_hf: Vec<(String, Vec<u64>, DType)> = clip_specs(&ClipConfig::vit_bigg14(), &|_| None, None)
        .into_iter()
        .map(|s| {
            let body = s.name.strip_prefix("cond_stage_model.1.transformer.").expect("bigG's prefix").to_string();
            let name = if body.ends_with("text_projection") { "text_projection.weight".to_string() } else { body };
            (name, s.ne.iter().rev().map(|&d| d as u64).collect(), DType::F16)
        })
        .collect();
    write_sparse(&dir.join("bigg-hf.safetensors"), &bigg_hf);
    let with = |flag: &str| {
        let mut a = plan(&d("vega-no-bigg.safetensors"));
        a.extend([flag.to_string(), d("bigg-hf.safetensors")]);
        a
    };
    cases.push(Case {
        name: "plan vega --clip_g bigG".into(),
        args: with("--clip_g"),
        status: 0,
        env: vec![],
        needles: vec![],
    });
    cases.push(Case {
        name: "plan vega --clip_l bigG".into(),
        args: with("--clip_l"),
        status: 2,
        env: vec![],
        needles: [
            "bigg-hf.safetensors",
            "1280 wide",
            "text_model.embeddings.token_embedding.weight",
            "OpenCLIP ViT-bigG/14",
            "give it as --clip_g",
        ]
        .map(String::from)
        .to_vec(),
    });
    for (what, path, needle) in [
        ("FIFO model", d("fifo"), "FIFO"),
        ("device model", "/dev/zero".to_string(), "character device"),
        ("directory model", d("adir"), "unet"),
    ] {
        cases.push(Case { name: what.into(), args: plan(&path), status: 2, env: vec![], needles: vec![needle.into()] });
    }
    for (what, path, needle) in [
        ("profile /dev/zero", "/dev/zero".to_string(), "character device"),
        ("profile FIFO", d("fifo"), "FIFO"),
        ("profile directory", d("adir"), "directory"),
    ] {
        cases.push(Case {
            name: what.into(),
            args: vec!["plan".into(), "-m".into(), d("good.safetensors"), "--devices".into(), path],
            status: 2,
            env: vec![],
            needles: vec![needle.into(), "--devices".into()],
        });
    }

    // Issue 32: `plan` refuses what a generation refuses (the first stage is checked too),
    // never writes its report over an input, and names the flag of a bad number; bad values
    // of the CPU kernels' environment switches are refused at startup; control characters
    // in a path or a value are escaped in the message.
    let with = |extra: &[&str]| {
        let mut a = plan(&d("good.safetensors"));
        a.extend(extra.iter().map(|s| s.replace("{DIR}", &dir.display().to_string())));
        a
    };
    let envs = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
    #[allow(clippy::type_complexity)]
    let issue32: Vec<(&str, Vec<String>, i32, Vec<(String, String)>, Vec<&str>)> = vec![
        ("plan no VAE", plan(&d("sd15-no-vae.safetensors")), 2, vec![], vec!["VAE", "missing", "--vae"]),
        (
            "plan --taesd junk",
            with(&["--taesd", "{DIR}/junk.safetensors"]),
            2,
            vec![],
            vec!["TAESD", "junk.safetensors"],
        ),
        (
            "plan report on the profile",
            with(&["--report-json", "{DIR}/profile.toml"]),
            2,
            vec![],
            vec!["--report-json and --devices name the same file", "profile.toml"],
        ),
        (
            "plan report on the model",
            with(&["--report-json", "{DIR}/model-link.png"]),
            2,
            vec![],
            vec!["--report-json and -m name the same file", "good.safetensors", "model-link.png"],
        ),
        ("plan --ram-mib -1", with(&["--ram-mib", "-1"]), 2, vec![], vec!["for '--ram-mib", "negative"]),
        (
            "plan --ram-mib 2^44+1",
            with(&["--ram-mib", "17592186044417"]),
            2,
            vec![],
            vec!["for '--ram-mib", "17592186044417 MiB is more bytes"],
        ),
        (
            "SD_CPU_AMX_F16=OFF",
            with(&[]),
            2,
            envs("SD_CPU_AMX_F16", "OFF"),
            vec!["SD_CPU_AMX_F16=\"OFF\"", "on, off, 1, 0"],
        ),
        ("SD_CPU_F16_GEMM=no", with(&[]), 2, envs("SD_CPU_F16_GEMM", "no"), vec!["SD_CPU_F16_GEMM=\"no\"", "on, off"]),
        (
            "SD_CPU_EXTRA_BUFTS=maybe",
            vec!["-m".into(), d("good.safetensors"), "--steps".into(), "0".into()],
            2,
            envs("SD_CPU_EXTRA_BUFTS", "maybe"),
            vec!["SD_CPU_EXTRA_BUFTS=\"maybe\"", "true, false"],
        ),
        (
            "an escape sequence in -o",
            vec!["-m".into(), d("good.safetensors"), "-o".into(), d("\u{1b}[31mred/x.png")],
            2,
            vec![],
            vec!["\\u{1b}[31mred", "does not exist"],
        ),
        (
            "an escape sequence in --steps",
            vec!["-m".into(), d("good.safetensors"), "--steps".into(), "\u{1b}[2J\r".into()],
            2,
            vec![],
            // clap drops the escape sequence itself; the carriage return is escaped.
            vec!["invalid value '\\r' for '--steps"],
        ),
    ];
    for (what, args, status, env, needles) in issue32 {
        cases.push(Case {
            name: format!("issue 32: {what}"),
            args,
            status,
            env,
            needles: needles.into_iter().map(String::from).collect(),
        });
    }

    // 2. Placement strings.
    let placement = table("placement.tsv");
    let n_placement = placement.len();
    for row in &placement {
        let (flag, value, needle) = (&row[0], &row[1], &row[2]);
        let value = if value == "<empty>" { String::new() } else { value.clone() };
        let mut args = plan(&d("good.safetensors"));
        args.extend([flag.clone(), value.clone()]);
        cases.push(Case {
            name: format!("placement {flag} {value:?}"),
            args,
            status: 2,
            env: vec![],
            needles: vec![needle.clone()],
        });
    }
    // Issue 13: layer splits and pipeline copies that need several flags, a second device or
    // the environment (plan on a profile with a tiny second GPU).
    std::fs::write(
        dir.join("two-gpus.toml"),
        "ram_available_mib = 65536\n[[device]]\nname = \"CUDA0\"\ntype = \"gpu\"\nfree_mib = 24576\ntotal_mib = 24576\n\
         [[device]]\nname = \"CUDA1\"\ntype = \"gpu\"\nfree_mib = 16\ntotal_mib = 16\n",
    )
    .unwrap();
    let two_gpus = |extra: &[&str]| {
        let mut a =
            vec!["plan".to_string(), "-m".into(), d("good.safetensors"), "--devices".into(), d("two-gpus.toml")];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let env = |v: &str| vec![("SD_PIPELINE_COPIES".to_string(), v.to_string())];
    let mut copies = plan(&d("good.safetensors"));
    copies.extend(["--backend", "diffusion=cuda0&cpu", "--pipeline-copies", "64"].map(String::from));
    #[allow(clippy::type_complexity)]
    let split_cases: Vec<(&str, Vec<String>, Vec<(String, String)>, Vec<&str>)> = vec![
        (
            "a split device without a block",
            two_gpus(&["--backend", "diffusion=cuda0&cuda1"]),
            vec![],
            vec!["CUDA1 would receive no block of diffusion", "too little memory", "--max-vram"],
        ),
        (
            "more pipeline copies than memory allows",
            copies,
            vec![],
            vec!["--pipeline-copies 64: CUDA0 would need", "budget is", "copies fit"],
        ),
        (
            "SD_PIPELINE_COPIES=abc",
            two_gpus(&[]),
            env("abc"),
            vec!["SD_PIPELINE_COPIES: invalid value 'abc'", "positive integer"],
        ),
        ("SD_PIPELINE_COPIES=0", two_gpus(&[]), env("0"), vec!["SD_PIPELINE_COPIES: invalid value '0'"]),
        (
            "--pipeline-copies wins over SD_PIPELINE_COPIES",
            two_gpus(&["--pipeline-copies", "-1"]),
            env("2"),
            vec!["--pipeline-copies: invalid value '-1'"],
        ),
    ];
    for (what, args, env, needles) in split_cases {
        cases.push(Case {
            name: format!("split: {what}"),
            args,
            status: 2,
            env,
            needles: needles.into_iter().map(String::from).collect(),
        });
    }
    let long = "x".repeat(100_000);
    let mut args = plan(&d("good.safetensors"));
    args.extend(["--backend".into(), long]);
    cases.push(Case {
        name: "placement 100 KB".into(),
        args,
        status: 2,
        env: vec![],
        needles: vec!["(100000 bytes)".into()],
    });

    // Issue 32, weights: a transposed weight (row 14), a q8_0 block with a NaN scale and a
    // saturated f16 weight (row 16), a sparse GGUF declaring a GiB-long metadata array
    // through -m and plan (row 9; the <lora:> tag is in args.tsv), a T5 encoder given as
    // the diffusion model (row 18).
    weight_cases(&dir, &mut cases, &plan);

    // 3. Argument sets (generation: fail before any weight is read).
    let arg_rows = table("args.tsv");
    let n_args = arg_rows.len();
    for row in &arg_rows {
        let own = args_of(&row[2], &dir);
        let defaults = [
            ("-m", d("good.safetensors")),
            ("-W", "64".into()),
            ("-H", "64".into()),
            ("--steps", "1".into()),
            ("-t", "1".into()),
            ("-o", d("out.png")),
        ];
        let mut args: Vec<String> = Vec::new();
        for (flag, value) in defaults {
            if !own.iter().any(|a| a == flag) {
                args.extend([flag.to_string(), value]);
            }
        }
        args.extend(own);
        cases.push(Case {
            name: format!("args {}", row[2]),
            args,
            status: row[0].parse().unwrap(),
            env: vec![],
            needles: vec![row[1].replace("{DIR}", &dir.display().to_string())],
        });
    }
    // Issue 32, row 16: 5000 nested brackets (refused before anything is loaded, with the
    // byte where the nesting passes the bound).
    cases.push(Case {
        name: "args -p (x5000".into(),
        args: ["-m", &d("good.safetensors"), "-W", "64", "-H", "64", "--steps", "1", "-t", "1", "-o", &d("out.png")]
            .iter()
            .map(|s| s.to_string())
            .chain(["-p".to_string(), "(".repeat(5000) + "cat"])
            .collect(),
        status: 2,
        env: vec![],
        needles: vec!["-p/--prompt-file: prompt brackets nest deeper than 256 levels at byte 256".into()],
    });
    assert!(n_models + 5 >= 40, "at least 40 malformed model files, got {n_models} + 5");
    assert!(n_placement + 1 >= 40, "at least 40 placement strings, got {n_placement}");
    assert!(n_args >= 30, "at least 30 argument sets, got {n_args}");

    let before = snapshot(&dir);
    // Two workers: CI has two cores.
    let queue = std::sync::Mutex::new(cases.into_iter());
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let Some(case) = queue.lock().unwrap().next() else { break };
                let o = run(&case.args, &case.env, FAIL_DEADLINE);
                if std::env::var_os("SD_CORPUS_SHOW").is_some() {
                    // Every case's message, for reading them all at once.
                    eprintln!("{} => {}", case.name, o.stderr.lines().last().unwrap_or_default());
                }
                if let Some(f) = judge(&case, &o) {
                    failures.lock().unwrap().push(f);
                }
            });
        }
    });
    let after = snapshot(&dir);
    let mut failures = failures.into_inner().unwrap();
    for (p, was) in &before {
        match after.get(p) {
            None => failures.push(format!("{} was removed", p.display())),
            Some(now) if now != was => failures.push(format!("{} changed: was {was:.80}, now {now:.80}", p.display())),
            _ => {}
        }
    }
    for p in after.keys().filter(|p| !before.contains_key(*p)) {
        failures.push(format!("{} was created by a failing case", p.display()));
    }

    // 4. Faults during a run: the model truncated while in use, in its own directory.
    let fault = root.join("fault");
    std::fs::create_dir_all(&fault).unwrap();
    let model = fault.join("truncated.safetensors");
    sd15_with(&model, None);
    let mut child = Command::new(env!("CARGO_BIN_EXE_sd-cli"))
        .args(["-m", model.to_str().unwrap(), "-W", "64", "-H", "64", "--steps", "1", "-t", "1", "-o"])
        .arg(fault.join("out.png"))
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut stderr = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap_or_default();
        stderr.push_str(&line);
        stderr.push('\n');
        if line.contains("model: sd1") {
            std::fs::OpenOptions::new().write(true).open(&model).unwrap().set_len(4096).unwrap();
            break;
        }
    }
    let reader = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>().join("\n"));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    stderr.push_str(&reader.join().unwrap_or_default());
    eprintln!("truncated model case:\n{stderr}");
    match status {
        None => failures.push("truncated model: no exit within 120 s".into()),
        Some(s) if s.signal().is_some() => failures.push(format!("truncated model: signal {:?}: {stderr}", s.signal())),
        Some(s) if s.success() => failures.push(format!("truncated model: exit 0: {stderr}")),
        Some(_)
            if !stderr.contains("truncated.safetensors")
                || !(stderr.contains("changed while in use") || stderr.contains("truncated while in use")) =>
        {
            failures.push(format!("truncated model: the message does not name the file and the change: {stderr}"))
        }
        Some(_) => {}
    }
    if fault.join("out.png").exists() {
        failures.push("truncated model: an image was written".into());
    }

    // 5. A whole run on zero weights through a symbolic link: the link is followed (it stays a
    // link, its target gets the image) and every stage's numeric health is reported.
    let run_dir = root.join("run");
    std::fs::create_dir_all(&run_dir).unwrap();
    std::fs::write(run_dir.join("target.png"), b"old").unwrap();
    std::os::unix::fs::symlink("target.png", run_dir.join("link.png")).unwrap();
    let case = Case {
        name: "zero-weight run through a symlink".into(),
        args: [
            "-m",
            &d("good.safetensors"),
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "1",
            "--cfg-scale",
            "1",
            "-t",
            "2",
            "-o",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([run_dir.join("link.png").display().to_string()])
        .collect(),
        status: 0,
        env: vec![],
        needles: vec![
            "text encoder (prompt): every value is zero".into(),
            "diffusion model output at timestep".into(),
            "of image 1: every value is zero".into(),
            "VAE decoder (image 1)".into(),
        ],
    };
    let o = run(&case.args, &case.env, Duration::from_secs(300));
    failures.extend(judge(&case, &o));
    if !std::fs::symlink_metadata(run_dir.join("link.png")).unwrap().file_type().is_symlink() {
        failures.push("the -o symlink was replaced instead of followed".into());
    }
    if !std::fs::read(run_dir.join("target.png")).unwrap().starts_with(b"\x89PNG") {
        failures.push("the symlink's target did not get the image".into());
    }

    // 6. Issue 32, rows 11 and 13: a hard-linked output on a "full disk" (a file size limit
    // of 64 bytes: the image cannot be written): the run fails with a message naming the
    // output, and the old image and its other name are whole.
    let full = root.join("full");
    std::fs::create_dir_all(&full).unwrap();
    let old_bytes: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(full.join("old.png"), &old_bytes).unwrap();
    std::fs::hard_link(full.join("old.png"), full.join("link.png")).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sd-cli"));
    cmd.args(["-m", &d("good.safetensors"), "-W", "64", "-H", "64", "--steps", "1", "-t", "2", "-o"])
        .arg(full.join("link.png"))
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: only async-signal-safe setrlimit between fork and exec. sd-cli must ignore
    // SIGXFSZ itself (else the limit kills it).
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            let lim = libc::rlimit { rlim_cur: 64, rlim_max: 64 };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.signal().is_some() || out.status.code() != Some(1) {
        failures.push(format!("full disk: {:?}, expected exit 1: {stderr}", out.status));
    } else if !stderr.contains("link.png") || !stderr.contains("left as it was") {
        failures.push(format!("full disk: the message does not name the output and its state: {stderr}"));
    }
    for name in ["old.png", "link.png"] {
        if std::fs::read(full.join(name)).unwrap() != old_bytes {
            failures.push(format!("full disk: {name} changed"));
        }
    }
    if std::fs::read_dir(&full).unwrap().count() != 2 {
        failures.push("full disk: a temporary file was left".into());
    }

    // 7. Issue 32, row 18: `-o /dev/stdout` writes the PNG to the standard output (a pipe),
    // and a legal 250-byte name (the report's) is written, its temporary name cut to fit.
    let long_report = run_dir.join(format!("{}.json", "r".repeat(245)));
    let out = Command::new(env!("CARGO_BIN_EXE_sd-cli"))
        .args(["-m", &d("good.safetensors"), "-W", "64", "-H", "64", "--steps", "1", "-t", "2", "-o", "/dev/stdout"])
        .arg("--report-json")
        .arg(&long_report)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    if !out.status.success() || !out.stdout.starts_with(b"\x89PNG") {
        failures.push(format!(
            "-o /dev/stdout: {:?}, {} bytes on stdout: {}",
            out.status,
            out.stdout.len(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    if !std::fs::read(&long_report).is_ok_and(|b| b.starts_with(b"{")) {
        failures.push("a 250-byte report name was not written".into());
    }

    // 8. Issue 32, row 18: an empty SD_CACHE_DIR is unset: without -m the fixture goes to
    // $HOME/.cache/sd-rs, never into the working directory (stopped once it says where).
    let cache_case = root.join("cache");
    let (home, cwd) = (cache_case.join("home"), cache_case.join("cwd"));
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&cwd).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sd-cli"))
        .args(["-W", "64", "-H", "64", "--steps", "1", "-o"])
        .arg(cache_case.join("out.png"))
        .current_dir(&cwd)
        .env("NO_COLOR", "1")
        .env("SD_CACHE_DIR", "")
        .env("HOME", &home)
        .env_remove("XDG_CACHE_HOME")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut said = String::new();
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap_or_default();
        if line.contains("no model given") {
            said = line;
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    if !said.contains(&home.join(".cache/sd-rs").display().to_string()) {
        failures.push(format!("empty SD_CACHE_DIR: the fixture is not written under $HOME/.cache/sd-rs: {said:?}"));
    }
    if std::fs::read_dir(&cwd).unwrap().count() != 0 {
        failures.push("empty SD_CACHE_DIR: a file was written into the working directory".into());
    }

    let _ = std::fs::set_permissions(dir.join("ro.png"), std::fs::Permissions::from_mode(0o644));
    let _ = std::fs::remove_dir_all(&root);
    assert!(failures.is_empty(), "{} of the corpus cases failed:\n{}", failures.len(), failures.join("\n"));
}
