//! `sd-cli serve` over real HTTP on loopback: the three APIs give the images sd-cli gives for
//! the same seed (bit for bit), per-request LoRAs leave the loaded model unchanged, the queue
//! limit answers 429, cancel stops queued and generating jobs, concurrent clients each get
//! their own seed's image, and bad input is a 4xx naming the field.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::{png_pixels, sd15_fixture, sd_cli};
use serde_json::{json, Value};

/// A running `sd-cli serve`, killed on drop.
struct Serve {
    child: Child,
    base: String,
    agent: ureq::Agent,
    key: Option<String>,
}

impl Serve {
    /// `sd-cli serve -m MODEL -t 2 --listen-port 0 ARGS`, ready once it printed its address.
    fn start(model: &Path, args: &[&str]) -> Serve {
        let mut child = sd_cli()
            .arg("serve")
            .arg("-m")
            .arg(model)
            .args(["-t", "2", "--listen-port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(if std::env::var_os("SERVE_LOG").is_some() { Stdio::inherit() } else { Stdio::null() })
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let base =
            line.trim().strip_prefix("sd-server listening on ").unwrap_or_else(|| panic!("no address: {line:?}"));
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(900)))
            .build()
            .into();
        let key = args.iter().position(|a| *a == "--api-key").map(|i| args[i + 1].to_string());
        Serve { child, base: base.to_string(), agent, key }
    }

    /// `(status, JSON body)` of `method path` with `body` (raw text, sent as JSON).
    fn call(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        let url = format!("{}{path}", self.base);
        let auth = self.key.as_ref().map(|k| format!("Bearer {k}"));
        let resp = match method {
            "GET" => {
                let mut r = self.agent.get(&url);
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.call()
            }
            _ => {
                let mut r = self.agent.post(&url).header("Content-Type", "application/json");
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.send(body.unwrap_or(""))
            }
        };
        let mut resp = resp.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status().as_u16();
        let text = resp.body_mut().with_config().limit(64 << 20).read_to_string().unwrap();
        let v = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{method} {path} -> {status}: not JSON ({e}): {text}"));
        (status, v)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.call("POST", path, Some(&body.to_string()))
    }

    /// Submits a native job: its id (202 asserted).
    fn submit(&self, body: &Value) -> String {
        let (status, v) = self.post("/sdcpp/v1/img_gen", body);
        assert_eq!(status, 202, "{v}");
        assert_eq!(v["poll_url"], format!("/sdcpp/v1/jobs/{}", v["id"].as_str().unwrap()));
        v["id"].as_str().unwrap().to_string()
    }

    fn job(&self, id: &str) -> Value {
        let (status, v) = self.call("GET", &format!("/sdcpp/v1/jobs/{id}"), None);
        assert_eq!(status, 200, "{v}");
        v
    }

    /// Polls job `id` until it is finished.
    fn wait(&self, id: &str) -> Value {
        let t = Instant::now();
        loop {
            let v = self.job(id);
            if ["completed", "failed", "cancelled"].contains(&v["status"].as_str().unwrap()) {
                return v;
            }
            // Generous: a loaded CI machine runs a queue of 24 tiny jobs in minutes.
            assert!(t.elapsed() < Duration::from_secs(900), "job {id} did not finish: {v}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sd-cli-serve-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// RGB pixels of a base64 PNG.
fn b64_pixels(b64: &str) -> Vec<u8> {
    png_pixels(&base64::engine::general_purpose::STANDARD.decode(b64).unwrap())
}

/// The pixels of the completed job `v`'s only image.
fn job_pixels(v: &Value) -> Vec<u8> {
    assert_eq!(v["status"], "completed", "{v}");
    let images = v["result"]["images"].as_array().unwrap();
    assert_eq!(images.len(), 1);
    b64_pixels(images[0]["b64_json"].as_str().unwrap())
}

/// sd-cli's image for `prompt` at 64x64, `steps` euler steps, cfg 7, `seed` (2 threads).
fn cli_image(model: &Path, dir: &Path, name: &str, prompt: &str, steps: u32, seed: u64, lora_dir: &Path) -> Vec<u8> {
    let out = dir.join(name);
    let o = sd_cli()
        .arg("-m")
        .arg(model)
        .args(["-p", prompt, "-W", "64", "-H", "64", "--steps", &steps.to_string(), "--sampling-method", "euler"])
        .args(["-s", &seed.to_string(), "--cfg-scale", "7", "-t", "2", "--lora-model-dir"])
        .arg(lora_dir)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "sd-cli: {}", String::from_utf8_lossy(&o.stderr));
    common::pixels(&out)
}

/// The native body of the images above.
fn native(prompt: &str, steps: u32, seed: u64) -> Value {
    json!({
        "prompt": prompt, "width": 64, "height": 64, "seed": seed,
        "sample_params": {"sample_steps": steps, "sample_method": "euler", "guidance": {"txt_cfg": 7.0}},
    })
}

/// Writes a kohya LoRA `kohya.safetensors` into `dir` and returns sd-cli's "a cat" (2 steps,
/// seed 42) without and with `<lora:kohya:1>`.
fn plain_and_kohya_images(model: &Path, dir: &Path) -> (Vec<u8>, Vec<u8>) {
    let kohya = sd_models::fixture::lora::LoraFixture {
        layout: sd_models::fixture::lora::LoraLayout::Kohya,
        rank: 4,
        seed: 1,
        scale: 0.1,
        text_encoder: true,
    };
    sd_models::fixture::lora::write_lora(&dir.join("kohya.safetensors"), &kohya).unwrap();
    let plain = cli_image(model, dir, "plain.png", "a cat", 2, 42, dir);
    let lora = cli_image(model, dir, "lora.png", "a cat<lora:kohya:1>", 2, 42, dir);
    (plain, lora)
}

#[test]
fn every_api_gives_sd_clis_image_and_loras_apply_per_request() {
    let model = sd15_fixture();
    let dir = out_dir("apis");
    let (plain, lora) = plain_and_kohya_images(&model, &dir);
    assert_ne!(plain, lora, "the LoRA changes the image");

    let server = Serve::start(&model, &["--lora-model-dir", dir.to_str().unwrap()]);
    // Native async jobs: the plain image, the LoRA's, and the plain one again (the LoRA of
    // the second request did not stay in the loaded model).
    let id = server.submit(&native("a cat", 2, 42));
    assert_eq!(job_pixels(&server.wait(&id)), plain, "native job vs sd-cli");
    let mut with_lora = native("a cat", 2, 42);
    with_lora["lora"] = json!([{"path": "kohya", "multiplier": 1.0}]);
    let id = server.submit(&with_lora);
    assert_eq!(job_pixels(&server.wait(&id)), lora, "native job with a LoRA vs sd-cli's <lora:kohya:1>");
    let id = server.submit(&native("a cat", 2, 42));
    assert_eq!(job_pixels(&server.wait(&id)), plain, "after a LoRA request the model is unchanged");
    // A finished job can no longer be cancelled.
    let (status, v) = server.post(&format!("/sdcpp/v1/jobs/{id}/cancel"), &json!({}));
    assert_eq!(status, 409, "{v}");

    // OpenAI, with the native fields in the prompt's extra-args block.
    let extra =
        r#"{"seed": 42, "sample_params": {"sample_steps": 2, "sample_method": "euler", "guidance": {"txt_cfg": 7}}}"#;
    let body =
        json!({"prompt": format!("a cat <sd_cpp_extra_args>{extra}</sd_cpp_extra_args>"), "size": "64x64", "n": 1});
    let (status, v) = server.post("/v1/images/generations", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["output_format"], "png");
    assert_eq!(b64_pixels(v["data"][0]["b64_json"].as_str().unwrap()), plain, "OpenAI vs sd-cli");

    // A1111 txt2img by its own field names.
    let body = json!({"prompt": "a cat", "width": 64, "height": 64, "steps": 2, "sampler_name": "Euler", "cfg_scale": 7, "seed": 42});
    let (status, v) = server.post("/sdapi/v1/txt2img", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["parameters"]["sampler_name"], "Euler");
    assert_eq!(b64_pixels(v["images"][0].as_str().unwrap()), plain, "sdapi txt2img vs sd-cli");

    // The lists.
    let (_, v) = server.call("GET", "/sdapi/v1/loras", None);
    assert_eq!(v, json!([{"name": "kohya", "path": "kohya.safetensors"}]));
    let (_, v) = server.call("GET", "/v1/models", None);
    assert_eq!(v["data"][0]["id"], "sd-cpp-local");
    let (_, v) = server.call("GET", "/sdcpp/v1/capabilities", None);
    assert_eq!(v["limits"]["max_queue_size"], 64);
    assert!(v["samplers"].as_array().unwrap().contains(&json!("euler")));
    assert_eq!(v["model"]["path"], model.to_str().unwrap());
    let (_, v) = server.call("GET", "/sdapi/v1/samplers", None);
    assert!(v.as_array().unwrap().iter().any(|s| s["name"] == "euler_a"));
    let (_, v) = server.call("GET", "/sdapi/v1/options", None);
    assert_eq!(v["sd_model_checkpoint"], model.file_stem().unwrap().to_str().unwrap());
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn queue_limit_cancel_progress_and_concurrent_clients() {
    let model = sd15_fixture();
    let dir = out_dir("queue");
    let server = Serve::start(&model, &["--max-queue", "3"]);
    // A long job, two behind it: the queue is full.
    let long = server.submit(&native("a dog", 40, 1));
    let t = Instant::now();
    while server.job(&long)["status"] == "queued" {
        assert!(t.elapsed() < Duration::from_secs(60), "the job did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = server.submit(&native("a cat", 1, 7));
    let third = server.submit(&native("a cat", 1, 8));
    let (status, v) = server.post("/sdcpp/v1/img_gen", &native("a cat", 1, 9));
    assert_eq!(status, 429, "{v}");
    assert_eq!(server.job(&third)["queue_position"], 2);
    // A queued job is cancelled at once and leaves the queue.
    let (status, v) = server.post(&format!("/sdcpp/v1/jobs/{third}/cancel"), &json!({}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "cancelled");
    assert_eq!(server.job(&third)["error"]["code"], "cancelled");
    // The generating job reports its steps, then stops at the next one when cancelled.
    let t = Instant::now();
    let progress = loop {
        let v = server.job(&long);
        if v["status"] == "generating" && v["progress"]["step"].as_u64().unwrap_or(0) >= 1 {
            break v["progress"].clone();
        }
        assert!(t.elapsed() < Duration::from_secs(120), "no progress: {v}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(progress["steps"], 40);
    assert!(progress["elapsed"].as_f64().unwrap() > 0.0);
    let (_, a1111) = server.call("GET", "/sdapi/v1/progress", None);
    assert!(a1111["progress"].as_f64().unwrap() > 0.0, "{a1111}");
    assert_eq!(a1111["state"]["job"], long.as_str());
    let (status, _) = server.post(&format!("/sdcpp/v1/jobs/{long}/cancel"), &json!({}));
    assert_eq!(status, 200);
    let v = server.wait(&long);
    assert_eq!(v["status"], "cancelled", "{v}");
    assert!(v["started"].is_u64());
    // The job behind it runs.
    let second_pixels = job_pixels(&server.wait(&second));
    drop(server);

    // 8 clients x 3 jobs each, seeds 7 and 8: every job gets its seed's image (FIFO, no job
    // lost).
    let server = std::sync::Arc::new(Serve::start(&model, &[]));
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let server = server.clone();
            std::thread::spawn(move || {
                (0..3u64)
                    .map(|j| {
                        let seed = 7 + (c + j) % 2;
                        let id = server.submit(&native("a cat", 1, seed));
                        (seed, id)
                    })
                    .collect::<Vec<_>>()
                    .into_iter()
                    .map(|(seed, id)| (seed, job_pixels(&server.wait(&id))))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let results: Vec<(u64, Vec<u8>)> = clients.into_iter().flat_map(|c| c.join().unwrap()).collect();
    assert_eq!(results.len(), 24);
    let seed7 = cli_image(&model, &dir, "seed7.png", "a cat", 1, 7, &dir);
    assert_eq!(second_pixels, seed7, "the job queued behind a cancelled one vs sd-cli");
    let seed8 = results.iter().find(|(s, _)| *s == 8).unwrap().1.clone();
    assert_ne!(seed7, seed8);
    for (seed, px) in &results {
        assert_eq!(px, if *seed == 7 { &seed7 } else { &seed8 }, "seed {seed}");
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A PNG of `w` x `h` black pixels (small on disk, large decoded).
fn black_png(w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, w, h);
    enc.set_color(png::ColorType::Rgb);
    let mut writer = enc.write_header().unwrap();
    writer.write_image_data(&vec![0u8; (w * h * 3) as usize]).unwrap();
    writer.finish().unwrap();
    out
}

#[test]
fn bad_input_is_a_4xx_naming_the_field() {
    let model = sd15_fixture();
    let dir = out_dir("bad");
    std::fs::write(dir.join("outside.safetensors"), b"x").unwrap();
    let loras = dir.join("loras");
    std::fs::create_dir_all(&loras).unwrap();
    let server = Serve::start(
        &model,
        &["--lora-model-dir", loras.to_str().unwrap(), "--max-body-mib", "1", "--api-key", "sesame"],
    );
    let bomb = base64::engine::general_purpose::STANDARD.encode(black_png(6000, 6000));
    let cases: &[(&str, &str, String, u16, Option<&str>)] = &[
        ("/sdcpp/v1/img_gen", "malformed JSON", r#"{"prompt": "a"#.into(), 400, None),
        ("/sdcpp/v1/img_gen", "empty body", "".into(), 400, None),
        ("/sdcpp/v1/img_gen", "not an object", "[1, 2]".into(), 400, None),
        ("/sdcpp/v1/img_gen", "wrong type", r#"{"width": "wide"}"#.into(), 400, Some("width")),
        ("/sdcpp/v1/img_gen", "fraction for an integer", r#"{"height": 64.5}"#.into(), 400, Some("height")),
        ("/sdcpp/v1/img_gen", "too small", r#"{"width": 8}"#.into(), 400, Some("width")),
        ("/sdcpp/v1/img_gen", "too large", r#"{"height": 100000}"#.into(), 400, Some("height")),
        (
            "/sdcpp/v1/img_gen",
            "zero steps",
            r#"{"sample_params": {"sample_steps": 0}}"#.into(),
            400,
            Some("sample_params.sample_steps"),
        ),
        (
            "/sdcpp/v1/img_gen",
            "negative steps",
            r#"{"sample_params": {"sample_steps": -3}}"#.into(),
            400,
            Some("sample_params.sample_steps"),
        ),
        ("/sdcpp/v1/img_gen", "not an object", r#"{"sample_params": 5}"#.into(), 400, Some("sample_params")),
        (
            "/sdcpp/v1/img_gen",
            "unknown sampler",
            r#"{"sample_params": {"sample_method": "warp_drive"}}"#.into(),
            400,
            Some("sample_params.sample_method"),
        ),
        (
            "/sdcpp/v1/img_gen",
            "unknown scheduler",
            r#"{"sample_params": {"scheduler": "sometimes"}}"#.into(),
            400,
            Some("sample_params.scheduler"),
        ),
        ("/sdcpp/v1/img_gen", "batch too large", r#"{"batch_count": 1000}"#.into(), 400, Some("batch_count")),
        ("/sdcpp/v1/img_gen", "strength", r#"{"strength": 2}"#.into(), 400, Some("strength")),
        ("/sdcpp/v1/img_gen", "output format", r#"{"output_format": "gif"}"#.into(), 400, Some("output_format")),
        ("/sdcpp/v1/img_gen", "base64 garbage", r#"{"init_image": "@@not base64@@"}"#.into(), 400, Some("init_image")),
        (
            "/sdcpp/v1/img_gen",
            "not an image",
            json!({"init_image": base64::engine::general_purpose::STANDARD.encode(b"hello")}).to_string(),
            400,
            Some("init_image"),
        ),
        ("/sdcpp/v1/img_gen", "decompression bomb", json!({"init_image": bomb}).to_string(), 400, Some("init_image")),
        ("/sdcpp/v1/img_gen", "unsupported mask", r#"{"mask_image": "abc"}"#.into(), 400, Some("mask_image")),
        (
            "/sdcpp/v1/img_gen",
            "a reference image that is none",
            json!({"ref_images": [base64::engine::general_purpose::STANDARD.encode(black_png(8, 8)), "abc"]})
                .to_string(),
            400,
            Some("ref_images[1]"),
        ),
        (
            "/sdcpp/v1/img_gen",
            "skip layers that are no numbers",
            r#"{"sample_params": {"guidance": {"slg": {"scale": 2.5, "layers": ["a"]}}}}"#.into(),
            400,
            Some("sample_params.guidance.slg.layers"),
        ),
        (
            "/sdcpp/v1/img_gen",
            "an infinite skip-layer scale",
            r#"{"sample_params": {"guidance": {"slg": {"scale": 1e39}}}}"#.into(),
            400,
            Some("sample_params.guidance.slg.scale"),
        ),
        (
            "/sdcpp/v1/img_gen",
            "lora traversal",
            r#"{"lora": [{"path": "../outside", "multiplier": 1}]}"#.into(),
            400,
            Some("lora[0].path"),
        ),
        (
            "/sdcpp/v1/img_gen",
            "absolute lora",
            json!({"lora": [{"path": dir.join("outside.safetensors")}]}).to_string(),
            400,
            Some("lora[0].path"),
        ),
        ("/sdcpp/v1/img_gen", "missing lora", r#"{"lora": [{"path": "nothing"}]}"#.into(), 400, Some("lora[0].path")),
        (
            "/sdcpp/v1/img_gen",
            "lora multiplier",
            r#"{"lora": [{"path": "x", "multiplier": "big"}]}"#.into(),
            400,
            Some("lora[0].multiplier"),
        ),
        ("/v1/images/generations", "no prompt", r#"{"size": "64x64"}"#.into(), 400, Some("prompt")),
        ("/v1/images/generations", "bad size", r#"{"prompt": "a", "size": "big"}"#.into(), 400, Some("size")),
        (
            "/v1/images/generations",
            "bad extra args",
            r#"{"prompt": "a <sd_cpp_extra_args>{nope</sd_cpp_extra_args>"}"#.into(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/images/generations",
            "extra args field",
            r#"{"prompt": "a <sd_cpp_extra_args>{\"width\": 1}</sd_cpp_extra_args>"}"#.into(),
            400,
            Some("width"),
        ),
        (
            "/sdapi/v1/txt2img",
            "A1111 sampler",
            r#"{"prompt": "a", "sampler_name": "Warp"}"#.into(),
            400,
            Some("sampler_name"),
        ),
        ("/sdapi/v1/txt2img", "A1111 steps type", r#"{"prompt": "a", "steps": "many"}"#.into(), 400, Some("steps")),
        ("/sdapi/v1/img2img", "no init image", r#"{"prompt": "a"}"#.into(), 400, Some("init_images")),
        (
            "/sdapi/v1/img2img",
            "init image garbage",
            r#"{"prompt": "a", "init_images": ["data:image/png;base64,!!"]}"#.into(),
            400,
            Some("init_images[0]"),
        ),
    ];
    for (path, what, body, status, field) in cases {
        let (got, v) = server.call("POST", path, Some(body.as_str()));
        assert_eq!(got, *status, "{what}: {v}");
        assert_eq!(v["field"].as_str(), *field, "{what}: {v}");
        assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {v}");
    }
    // Nothing was queued by any of them.
    let (_, v) = server.call("GET", "/sdapi/v1/progress", None);
    assert_eq!(v["state"]["job_count"], 0, "{v}");
    let (status, _) = server.call("GET", "/sdcpp/v1/jobs/job_nothing", None);
    assert_eq!(status, 404);
    let (status, _) = server.call("POST", "/sdcpp/v1/jobs/job_nothing/cancel", Some("{}"));
    assert_eq!(status, 404);
    let (status, _) = server.call("GET", "/no/such/endpoint", None);
    assert_eq!(status, 404);

    // Without the key: 401.
    let resp = server.agent.get(format!("{}/v1/models", server.base)).call().unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let resp =
        server.agent.get(format!("{}/v1/models", server.base)).header("Authorization", "Bearer wrong").call().unwrap();
    assert_eq!(resp.status().as_u16(), 401);

    // A body over --max-body-mib: 413 before it is read (only its headers and a start sent).
    let addr = server.base.strip_prefix("http://").unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = format!(
        "POST /sdcpp/v1/img_gen HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer sesame\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{\"prompt\": \"",
        4 << 20
    );
    s.write_all(head.as_bytes()).unwrap();
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&buf[..n]);
        if reply.windows(4).any(|w| w == b"\r\n\r\n") && String::from_utf8_lossy(&reply).contains("}") {
            break;
        }
    }
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    assert!(reply.contains("payload_too_large"), "{reply}");
    // The server lives on.
    let (status, _) = server.call("GET", "/v1/models", None);
    assert_eq!(status, 200);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A part of a multipart body: name, file name (for a file), bytes.
type Part<'a> = (&'a str, Option<&'a str>, &'a [u8]);

/// A multipart/form-data body of `parts`: its content type and bytes.
fn multipart(parts: &[Part<'_>]) -> (String, Vec<u8>) {
    let boundary = "sd-rs-test-boundary-7MA4YWxkTrZu0gW";
    let mut body = Vec::new();
    for (name, file, bytes) in parts {
        body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        match file {
            Some(f) => body.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"; filename=\"{f}\"\r\nContent-Type: image/png\r\n\r\n")
                    .as_bytes(),
            ),
            None => body.extend_from_slice(format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes()),
        }
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// A PNG of `w` x `h` pixels all of `rgb`.
fn flat_png(w: u32, h: u32, rgb: [u8; 3]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, w, h);
    enc.set_color(png::ColorType::Rgb);
    let mut writer = enc.write_header().unwrap();
    writer.write_image_data(&rgb.repeat((w * h) as usize)).unwrap();
    writer.finish().unwrap();
    out
}

/// The server events of job `id` until the stream ends: `(event, job JSON)` each.
fn events(server: &Serve, id: &str) -> Vec<(String, Value)> {
    let mut resp = server.agent.get(format!("{}/sdcpp/v1/jobs/{id}/events", server.base)).call().unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let ct = resp.headers().get("content-type").unwrap().to_str().unwrap().to_string();
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    let reader = BufReader::new(resp.body_mut().with_config().limit(u64::MAX).reader());
    let (mut out, mut event, mut data) = (Vec::new(), String::new(), String::new());
    for line in reader.lines() {
        let line = line.unwrap();
        if let Some(e) = line.strip_prefix("event:") {
            event = e.trim().to_string();
        } else if let Some(d) = line.strip_prefix("data:") {
            data.push_str(d.trim_start());
        } else if line.is_empty() && !data.is_empty() {
            out.push((std::mem::take(&mut event), serde_json::from_str(&std::mem::take(&mut data)).unwrap()));
        }
    }
    out
}

#[test]
fn sd_server_alias_lora_tags_edits_events_previews_and_json_logs() {
    let model = sd15_fixture();
    let dir = out_dir("alias");
    let (plain, lora) = plain_and_kohya_images(&model, &dir);
    // sd-cli's img2img of the plain image (strength 0.75), for the edits endpoint.
    common::write_init_png(&dir.join("init.png"), false);
    let init_png = std::fs::read(dir.join("init.png")).unwrap();
    let o = sd_cli()
        .arg("-m")
        .arg(&model)
        .args(["-p", "a cat", "-W", "64", "-H", "64", "--steps", "2", "--sampling-method", "euler"])
        .args(["-s", "42", "--cfg-scale", "7", "-t", "2", "--strength", "0.75", "-i"])
        .arg(dir.join("init.png"))
        .arg("-o")
        .arg(dir.join("edit.png"))
        .output()
        .unwrap();
    assert!(o.status.success(), "sd-cli img2img: {}", String::from_utf8_lossy(&o.stderr));
    let edited = common::pixels(&dir.join("edit.png"));

    // `sd-server`, the reference's name, with the reference's flags; logs as JSON lines.
    let log = dir.join("server.log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sd-server"))
        .arg("-m")
        .arg(&model)
        .args(["-t", "2", "-l", "127.0.0.1", "--listen-port", "0", "--log-format", "json", "--lora-model-dir"])
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let base = line.trim().strip_prefix("sd-server listening on ").unwrap_or_else(|| panic!("{line:?}")).to_string();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .into();
    let server = Serve { child, base, agent, key: None };

    // A1111 prompts take <lora:name:weight> tags, confined to --lora-model-dir.
    let a1111 = |prompt: &str| json!({"prompt": prompt, "width": 64, "height": 64, "steps": 2, "sampler_name": "Euler", "cfg_scale": 7, "seed": 42});
    let (status, v) = server.post("/sdapi/v1/txt2img", &a1111("a cat<lora:kohya:1>"));
    assert_eq!(status, 200, "{v}");
    assert_eq!(b64_pixels(v["images"][0].as_str().unwrap()), lora, "sdapi <lora:kohya:1> vs sd-cli's");
    for bad in ["a cat<lora:../outside:1>", "a cat<lora:/etc/passwd:1>", "a cat<lora:nothing:1>"] {
        let (status, v) = server.post("/sdapi/v1/txt2img", &a1111(bad));
        assert_eq!(status, 400, "{bad}: {v}");
        assert_eq!(v["field"], "prompt", "{bad}: {v}");
        assert!(!v["message"].as_str().unwrap().contains(dir.to_str().unwrap()), "the directory is named by role: {v}");
    }

    // OpenAI edits: the image is img2img's init image (sd-cli's image bit for bit); a mask
    // white everywhere is a whole-image edit, any other is refused by name.
    let extra = r#"<sd_cpp_extra_args>{"seed": 42, "strength": 0.75, "sample_params": {"sample_steps": 2, "sample_method": "euler", "guidance": {"txt_cfg": 7}}}</sd_cpp_extra_args>"#;
    let prompt = format!("a cat {extra}");
    let white = flat_png(64, 64, [255, 255, 255]);
    let grey = flat_png(64, 64, [128, 128, 128]);
    let edit = |parts: &[Part<'_>]| {
        let (ct, body) = multipart(parts);
        let mut resp = server
            .agent
            .post(format!("{}/v1/images/edits", server.base))
            .header("Content-Type", &ct)
            .send(&body[..])
            .unwrap();
        let status = resp.status().as_u16();
        let v: Value =
            serde_json::from_str(&resp.body_mut().with_config().limit(64 << 20).read_to_string().unwrap()).unwrap();
        (status, v)
    };
    let (status, v) = edit(&[("prompt", None, prompt.as_bytes()), ("image", Some("init.png"), &init_png)]);
    assert_eq!(status, 200, "{v}");
    assert_eq!(b64_pixels(v["data"][0]["b64_json"].as_str().unwrap()), edited, "edits vs sd-cli -i");
    let (status, v) = edit(&[
        ("prompt", None, prompt.as_bytes()),
        ("image[]", Some("init.png"), &init_png),
        ("mask", Some("mask.png"), &white),
    ]);
    assert_eq!(status, 200, "{v}");
    assert_eq!(b64_pixels(v["data"][0]["b64_json"].as_str().unwrap()), edited, "a white mask edits everything");
    let bad: [(&[Part<'_>], &str); 5] = [
        (&[("prompt", None, b"a cat"), ("image", Some("i.png"), &init_png), ("mask", Some("m.png"), &grey)], "mask"),
        (&[("prompt", None, b"a cat")], "image"),
        (&[("image", Some("i.png"), &init_png)], "prompt"),
        (&[("prompt", None, b"a cat"), ("image", Some("i.png"), b"not a png")], "image"),
        (&[("prompt", None, b"a cat"), ("image", Some("i.png"), &init_png), ("n", None, b"many")], "n"),
    ];
    for (parts, field) in bad {
        let (status, v) = edit(parts);
        assert_eq!(status, 400, "{field}: {v}");
        assert_eq!(v["field"], field, "{v}");
    }

    // A job's server-sent events: queued or generating with each step and a preview (the
    // latent projected to a PNG of the image's size), then completed with sd-cli's image.
    let id = server.submit(&native("a cat", 2, 42));
    let evs = events(&server, &id);
    let (last_event, last) = evs.last().unwrap();
    assert_eq!(last_event, "completed");
    assert_eq!(job_pixels(last), plain, "the events' result vs sd-cli");
    // One event per change: a few per step, not a stream of the same state.
    assert!(evs.len() <= 20, "{} events for a 2-step job", evs.len());
    let steps: Vec<u64> =
        evs.iter().filter(|(e, _)| e == "generating").filter_map(|(_, v)| v["progress"]["step"].as_u64()).collect();
    assert!(steps.contains(&1) && steps.contains(&2), "every step is an event: {steps:?}");
    assert!(steps.windows(2).all(|w| w[0] <= w[1]), "{steps:?}");
    let preview = evs.iter().find_map(|(_, v)| v["preview"]["b64_json"].as_str()).expect("a preview event");
    let bytes = base64::engine::general_purpose::STANDARD.decode(preview).unwrap();
    let img = image::load_from_memory(&bytes).unwrap();
    assert_eq!((img.width(), img.height()), (64, 64));
    // A finished job's stream is its last state; an unknown one is 404.
    let again = events(&server, &id);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].0, "completed");
    let (status, _) = server.call("GET", "/sdcpp/v1/jobs/job_nothing/events", None);
    assert_eq!(status, 404);
    drop(server);

    // The logs: one JSON object per line, the jobs there, the prompts not (info level).
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect();
    assert!(lines.iter().any(|l| l["fields"]["message"].as_str().is_some_and(|m| m.contains("generating"))), "{text}");
    assert!(lines.iter().all(|l| l["level"].is_string()), "{text}");
    assert!(!text.contains("a cat"), "a prompt was logged above debug: {text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A headless Chromium driven over WebDriver by its chromedriver (Debian's `chromium` and
/// `chromium-driver`), closed on drop.
struct Browser {
    driver: Child,
    url: String,
    session: String,
    agent: ureq::Agent,
}

/// The W3C WebDriver key of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

impl Browser {
    /// A browser session, or None (said on stderr) where chromedriver or Chromium is not
    /// installed and `SD_TEST_BROWSER=1` (set by `.ci/run`) does not require them.
    fn start(test: &str) -> Option<Browser> {
        let required = std::env::var("SD_TEST_BROWSER").is_ok_and(|v| v == "1");
        let found = |names: &[&str]| {
            names.iter().find_map(|n| {
                std::env::var_os("PATH")
                    .and_then(|p| std::env::split_paths(&p).map(|d| d.join(n)).find(|c| c.is_file()))
            })
        };
        let (Some(driver), Some(chromium)) =
            (found(&["chromedriver"]), found(&["chromium", "chromium-browser", "google-chrome"]))
        else {
            let what = "chromedriver and Chromium (Debian: apt-get install chromium chromium-driver)";
            assert!(!required, "SD_TEST_BROWSER=1 but {what} are not both on PATH");
            eprintln!("{test}: NOT RUN: no {what}; SD_TEST_BROWSER=1 makes this a failure");
            return None;
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let driver = std::process::Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .build()
            .into();
        let url = format!("http://127.0.0.1:{port}");
        let t = Instant::now();
        while agent.get(format!("{url}/status")).call().is_err() {
            assert!(t.elapsed() < Duration::from_secs(30), "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut b = Browser { driver, url, session: String::new(), agent };
        // No waiting for page loads in each command: the page's event stream stays open.
        let caps = json!({"capabilities": {"alwaysMatch": {"pageLoadStrategy": "none", "goog:chromeOptions": {
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        }}}});
        let v = b.call("POST", "/session", Some(caps));
        b.session = v["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {v}")).to_string();
        Some(b)
    }

    /// The `value` of a WebDriver command (an error is a failure).
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}{path}", self.url);
        let mut resp = match method {
            "GET" => self.agent.get(&url).call(),
            "DELETE" => self.agent.delete(&url).call(),
            _ => self.agent.post(&url).send_json(body.unwrap_or(json!({}))),
        }
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status().as_u16();
        let v: Value =
            serde_json::from_str(&resp.body_mut().with_config().limit(64 << 20).read_to_string().unwrap()).unwrap();
        assert_eq!(status, 200, "{method} {path}: {v}");
        v["value"].clone()
    }

    fn session(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.call(method, &format!("/session/{}{path}", self.session), body)
    }

    /// The element of CSS selector `css`.
    fn element(&self, css: &str) -> String {
        let v = self.session("POST", "/element", Some(json!({"using": "css selector", "value": css})));
        v[ELEMENT].as_str().unwrap_or_else(|| panic!("no element {css}: {v}")).to_string()
    }

    /// Types `text` into the field `css` (cleared first).
    fn type_into(&self, css: &str, text: &str) {
        let e = self.element(css);
        self.session("POST", &format!("/element/{e}/clear"), Some(json!({})));
        self.session("POST", &format!("/element/{e}/value"), Some(json!({"text": text})));
    }

    /// The value of `script` run in the page.
    fn eval(&self, script: &str) -> Value {
        self.session("POST", "/execute/sync", Some(json!({"script": script, "args": []})))
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = self.agent.delete(format!("{}/session/{}", self.url, self.session)).call();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

#[test]
fn the_page_generates_in_a_real_browser_with_progress_and_preview() {
    let Some(browser) = Browser::start("the_page_generates_in_a_real_browser_with_progress_and_preview") else {
        return;
    };
    let model = sd15_fixture();
    let dir = out_dir("page");
    let steps = 8;
    let expected = cli_image(&model, &dir, "page.png", "a cat", steps, 42, &dir);
    let server = Serve::start(&model, &["--lora-model-dir", dir.to_str().unwrap()]);
    browser.session("POST", "/url", Some(json!({"url": format!("{}/", server.base)})));
    // The samplers come from the server.
    let t = Instant::now();
    while browser.eval("return document.querySelectorAll('#sampler option').length") == json!(1) {
        assert!(t.elapsed() < Duration::from_secs(30), "the page did not load the samplers");
        std::thread::sleep(Duration::from_millis(50));
    }
    browser.type_into("#prompt", "a cat");
    for (css, v) in
        [("#width", "64"), ("#height", "64"), ("#steps", &steps.to_string()), ("#seed", "42"), ("#cfg", "7")]
    {
        browser.type_into(css, v);
    }
    browser.eval("const s = document.getElementById('sampler'); s.value = 'euler'; return s.value");
    let button = browser.element("#generate");
    browser.session("POST", &format!("/element/{button}/click"), Some(json!({})));
    // The progress bar moves, a preview shows, then the image appears.
    let (mut bars, mut preview, mut status_lines) = (Vec::new(), false, Vec::new());
    let t = Instant::now();
    let src = loop {
        let v = browser.eval(
            "return [document.getElementById('bar').value, document.getElementById('status').textContent, \
             document.getElementById('preview').src, document.getElementById('error').textContent, \
             Array.from(document.querySelectorAll('#results img')).map(i => i.src)]",
        );
        assert_eq!(v[3], "", "the page shows an error: {v}");
        let bar = v[0].as_f64().unwrap();
        if bars.last() != Some(&bar) {
            bars.push(bar);
        }
        status_lines.push(v[1].as_str().unwrap().to_string());
        preview |= v[2].as_str().is_some_and(|s| s.starts_with("data:image/png;base64,"));
        if let Some(src) = v[4].as_array().and_then(|a| a.first()) {
            break src.as_str().unwrap().to_string();
        }
        assert!(t.elapsed() < Duration::from_secs(600), "no image: {v}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let moving: Vec<f64> = bars.iter().copied().filter(|b| *b > 0.0 && *b < 1.0).collect();
    assert!(moving.len() >= 2, "the bar did not move: {bars:?}");
    assert!(bars.windows(2).all(|w| w[0] <= w[1]), "the bar went back: {bars:?}");
    assert!(status_lines.iter().any(|s| s.contains(&format!("/{steps}"))), "no step i/n shown: {status_lines:?}");
    assert!(preview, "no preview was shown");
    let b64 = src.strip_prefix("data:image/png;base64,").unwrap();
    assert_eq!(b64_pixels(b64), expected, "the page's image vs sd-cli's");
    drop(browser);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn models_switch_among_the_models_dir_and_a_failed_switch_keeps_the_old_model() {
    use sd_models::fixture::{ensure_cached, FixtureModel, WeightType};
    let dir = out_dir("models");
    let models = dir.join("models");
    std::fs::create_dir_all(&models).unwrap();
    std::os::unix::fs::symlink(sd15_fixture(), models.join("sd15.safetensors")).unwrap();
    std::os::unix::fs::symlink(
        ensure_cached(FixtureModel::Sd21, 42, WeightType::F16).unwrap().0,
        models.join("sd21.safetensors"),
    )
    .unwrap();
    std::fs::write(dir.join("secret.safetensors"), b"outside").unwrap();
    let sd15 = cli_image(&models.join("sd15.safetensors"), &dir, "sd15.png", "a cat", 1, 42, &dir);
    let sd21 = cli_image(&models.join("sd21.safetensors"), &dir, "sd21.png", "a cat", 1, 42, &dir);
    assert_ne!(sd15, sd21);
    let server = Serve::start(&models.join("sd15.safetensors"), &["--models-dir", models.to_str().unwrap()]);
    let (_, v) = server.call("GET", "/sdapi/v1/sd-models", None);
    let titles: Vec<&str> = v.as_array().unwrap().iter().map(|m| m["title"].as_str().unwrap()).collect();
    assert_eq!(titles, ["sd15", "sd21"]);
    let image = || job_pixels(&server.wait(&server.submit(&native("a cat", 1, 42))));

    let (status, v) = server.post("/sdapi/v1/options", &json!({"sd_model_checkpoint": "sd21"}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(server.call("GET", "/sdapi/v1/options", None).1["sd_model_checkpoint"], "sd21");
    assert_eq!(image(), sd21, "after switching to sd21");
    // A1111's title form, `name [hash]`.
    let (status, v) = server.post("/sdapi/v1/options", &json!({"sd_model_checkpoint": "sd15.safetensors [00000000]"}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(image(), sd15, "after switching back to sd15");

    // Names outside the directory, unknown names and options the server does not set: 400.
    for (body, field) in [
        (json!({"sd_model_checkpoint": "../secret"}), "sd_model_checkpoint"),
        (json!({"sd_model_checkpoint": dir.join("secret.safetensors")}), "sd_model_checkpoint"),
        (json!({"sd_model_checkpoint": "nothing"}), "sd_model_checkpoint"),
        (json!({"sd_model_checkpoint": 5}), "sd_model_checkpoint"),
        (json!({"CLIP_stop_at_last_layers": 2}), "CLIP_stop_at_last_layers"),
    ] {
        let (status, v) = server.post("/sdapi/v1/options", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["field"], field, "{body}: {v}");
    }
    // A checkpoint that does not load: the switch fails, the old model serves on.
    std::fs::write(models.join("broken.safetensors"), b"not a checkpoint").unwrap();
    let (status, v) = server.post("/sdapi/v1/options", &json!({"sd_model_checkpoint": "broken"}));
    assert_eq!(status, 500, "{v}");
    assert!(!v["message"].as_str().unwrap().contains(models.to_str().unwrap()), "paths named by role: {v}");
    assert_eq!(server.call("GET", "/sdapi/v1/options", None).1["sd_model_checkpoint"], "sd15");
    assert_eq!(image(), sd15, "after a failed switch");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The resident set of process `pid`, and its high-water mark, in KiB.
fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let get = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap()
    };
    (get("VmRSS:"), get("VmHWM:"))
}

#[test]
fn a_client_that_disconnects_and_twenty_jobs_leave_the_server_as_it_was() {
    let model = sd15_fixture();
    let server = Serve::start(&model, &[]);
    // A synchronous client that goes away mid-generation: its job ends (cancelled), the
    // server serves on.
    let addr = server.base.strip_prefix("http://").unwrap().to_string();
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    let body = json!({"prompt": "a dog", "width": 64, "height": 64, "steps": 200, "seed": 3}).to_string();
    write!(
        s,
        "POST /sdapi/v1/txt2img HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let t = Instant::now();
    let job = loop {
        let (_, v) = server.call("GET", "/sdapi/v1/progress", None);
        if v["state"]["sampling_step"].as_u64().unwrap_or(0) >= 1 {
            break v["state"]["job"].as_str().unwrap().to_string();
        }
        assert!(t.elapsed() < Duration::from_secs(120), "the job did not start: {v}");
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(s);
    let v = server.wait(&job);
    assert_eq!(v["status"], "cancelled", "{v}");
    assert!(v["progress"].is_null());

    // 20 tiny jobs one after the other (`SD_SERVE_LEAK_JOBS` sets another count): the
    // resident set stays within the first job's high-water mark and a margin.
    let jobs: usize = std::env::var("SD_SERVE_LEAK_JOBS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let pid = server.child.id();
    let tiny = json!({"prompt": "a cat", "width": 64, "height": 64, "seed": 1,
        "sample_params": {"sample_steps": 1, "sample_method": "euler", "guidance": {"txt_cfg": 1.0}}});
    let first = job_pixels(&server.wait(&server.submit(&tiny)));
    let (idle_first, hwm_first) = rss_kib(pid);
    let mut idle = Vec::with_capacity(jobs);
    for i in 1..jobs.max(2) {
        let v = server.wait(&server.submit(&tiny));
        assert_eq!(job_pixels(&v), first, "job {i}");
        idle.push(rss_kib(pid).0);
    }
    let (idle_last, hwm_last) = rss_kib(pid);
    // The server hands a job's freed memory back (glibc's heaps kept it: the idle RSS rose
    // in steps of 8 MiB); what stays is the finished jobs' records, about 24 KiB each.
    const MARGIN_KIB: u64 = 32 << 10;
    eprintln!(
        "RSS over {jobs} jobs: high-water {hwm_first} KiB after the first, {hwm_last} KiB after the last; \
         between jobs {idle_first} KiB after the first, {idle_last} KiB after the last; after each job {idle:?}"
    );
    assert!(hwm_last <= hwm_first + MARGIN_KIB, "the high-water mark grew from {hwm_first} KiB to {hwm_last} KiB");
    assert!(idle_last <= idle_first + MARGIN_KIB, "the idle RSS grew from {idle_first} KiB to {idle_last} KiB");
    drop(server);
}

/// `(module, reused, staged bytes)` of each module in a completed job's run report.
fn staging(v: &Value) -> Vec<(String, bool, u64)> {
    assert_eq!(v["status"], "completed", "{v}");
    let report: sd_models::report::RunReport = serde_json::from_value(v["report"].clone()).unwrap();
    report.staging.iter().map(|s| (s.module.clone(), s.reused, s.staged_bytes)).collect()
}

#[test]
fn the_loaded_weights_stay_staged_between_requests_and_a_switch_frees_them() {
    let dir = out_dir("kept");
    let models = dir.join("models");
    std::fs::create_dir_all(&models).unwrap();
    // Two names of one checkpoint: switching between them loads it anew.
    std::os::unix::fs::symlink(sd15_fixture(), models.join("a.safetensors")).unwrap();
    std::os::unix::fs::symlink(sd15_fixture(), models.join("b.safetensors")).unwrap();
    let server = Serve::start(&models.join("a.safetensors"), &["--models-dir", models.to_str().unwrap()]);
    let pid = server.child.id();
    let body = native("a cat", 1, 42);

    // The first request loads every module; the second reuses them all and stages nothing.
    let first = server.wait(&server.submit(&body));
    let loaded = staging(&first);
    let modules: Vec<&str> = loaded.iter().map(|(m, _, _)| m.as_str()).collect();
    assert_eq!(modules, ["te", "unet", "vae"], "{loaded:?}");
    assert!(loaded.iter().all(|(_, reused, bytes)| !reused && *bytes > 0), "the first request loads: {loaded:?}");
    let second = server.wait(&server.submit(&body));
    let kept = staging(&second);
    assert_eq!(kept.len(), 3, "{kept:?}");
    assert!(kept.iter().all(|(_, reused, bytes)| *reused && *bytes == 0), "the second request reuses: {kept:?}");
    assert_eq!(job_pixels(&second), job_pixels(&first), "the kept weights give the first request's image");

    // A different request (another seed and guidance, img2img) reuses them too.
    let other = json!({"prompt": "a dog", "width": 64, "height": 64, "seed": 7,
        "sample_params": {"sample_steps": 1, "sample_method": "euler", "guidance": {"txt_cfg": 1.0}}});
    let v = server.wait(&server.submit(&other));
    assert!(staging(&v).iter().all(|(_, reused, bytes)| *reused && *bytes == 0), "{:?}", staging(&v));

    // A switch frees the kept weights before the new model loads: the resident set does not
    // hold two models (the checkpoint is 2 GiB), and the new model's first request loads
    // every module anew, as many bytes as the first model's did.
    let (before, _) = rss_kib(pid);
    let (status, v) = server.post("/sdapi/v1/options", &json!({"sd_model_checkpoint": "b"}));
    assert_eq!(status, 200, "{v}");
    let switched = server.wait(&server.submit(&body));
    assert_eq!(staging(&switched), loaded, "the switched-to model loads anew");
    assert_eq!(job_pixels(&switched), job_pixels(&first));
    let (after, _) = rss_kib(pid);
    eprintln!("RSS with model a kept: {before} KiB; after the switch to b and a request: {after} KiB");
    const MARGIN_KIB: u64 = 512 << 10;
    assert!(after <= before + MARGIN_KIB, "the resident set grew from {before} KiB to {after} KiB over the switch");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
