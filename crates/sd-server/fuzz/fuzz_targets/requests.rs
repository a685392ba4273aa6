//! Fuzz target: the server's request decoding (JSON bodies of the native, OpenAI and A1111
//! endpoints, the multipart body of `/v1/images/edits`) through its real router, in process
//! and without a model (`sd_server::fuzzing`). Every input must be answered, with a status
//! below 500 and a JSON error body naming what was wrong; a panic or an abort is a crash.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use sd_server::fuzzing::Harness;

/// The endpoints that decode a body, and a few that take none; the input's first byte picks.
const ROUTES: &[(&str, &str)] = &[
    ("POST", "/sdcpp/v1/img_gen"),
    ("POST", "/v1/images/generations"),
    ("POST", "/v1/images/edits"),
    ("POST", "/sdapi/v1/txt2img"),
    ("POST", "/sdapi/v1/img2img"),
    ("POST", "/sdapi/v1/options"),
    ("POST", "/sdcpp/v1/jobs/job_1/cancel"),
    ("GET", "/sdcpp/v1/jobs/job_1"),
    ("GET", "/sdcpp/v1/jobs/job_1/events"),
    ("POST", "/sdapi/v1/interrupt"),
    ("GET", "/sdapi/v1/progress"),
];

/// Names of the multipart fields of `/v1/images/edits` (and one it does not take).
const PARTS: &[&str] =
    &["image", "image[]", "mask", "prompt", "size", "n", "output_format", "output_compression", "model", "bogus"];

const BOUNDARY: &str = "sdfuzzBOUNDARY";

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("sd-server-fuzz-{}", std::process::id()));
        let loras = dir.join("loras");
        let models = dir.join("models");
        std::fs::create_dir_all(&loras).unwrap();
        std::fs::create_dir_all(&models).unwrap();
        std::fs::write(loras.join("style.safetensors"), b"not read when decoding").unwrap();
        std::fs::write(models.join("other.safetensors"), b"not read when decoding").unwrap();
        // 1 MiB: large enough for small images, small enough to hit the limit.
        Harness::new(loras, Some(models), 1 << 20).unwrap()
    })
}

/// A multipart body from `data`: raw after a leading `--`, else parts separated by 0 bytes,
/// each a name (its first byte picks one of [`PARTS`]) and its content.
fn multipart(data: &[u8]) -> Vec<u8> {
    if data.starts_with(b"--") {
        return data.to_vec();
    }
    let mut body = Vec::new();
    for part in data.split(|&b| b == 0) {
        let Some((&pick, content)) = part.split_first() else { continue };
        let name = PARTS[pick as usize % PARTS.len()];
        body.extend_from_slice(format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"").as_bytes());
        if name.starts_with("image") || name == "mask" {
            body.extend_from_slice(b"; filename=\"x.png\"\r\nContent-Type: image/png");
        }
        body.extend_from_slice(b"\r\n\r\n");
        body.extend_from_slice(content);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    body
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    let (method, path) = ROUTES[pick as usize % ROUTES.len()];
    let (content_type, body) = if path == "/v1/images/edits" {
        (format!("multipart/form-data; boundary={BOUNDARY}"), multipart(rest))
    } else {
        ("application/json".to_string(), rest.to_vec())
    };
    let (status, answer) = harness().answer(method, path, Some(&content_type), body);
    let text = String::from_utf8_lossy(&answer);
    if std::env::var_os("SD_FUZZ_SHOW").is_some() {
        eprintln!("{method} {path} -> {status}: {}", text.chars().take(200).collect::<String>());
    }
    assert!(status < 500, "{method} {path} -> {status}: {text}");
    // Events of a job that does not exist, like every error, are a JSON error.
    if status >= 400 {
        let v: serde_json::Value =
            serde_json::from_slice(&answer).unwrap_or_else(|e| panic!("{method} {path} -> {status}: not JSON ({e}): {text}"));
        assert!(v["error"].is_string() && v["message"].is_string(), "{method} {path} -> {status}: {text}");
    }
});
