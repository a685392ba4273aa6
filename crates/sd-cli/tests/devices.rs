//! The device commands of sd-cli, run as a user runs them: a real binary, real plugins, a real RPC server.

use std::process::Stdio;

mod common;
use common::sd_cli;
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn devices_json(extra: &[&str]) -> Vec<serde_json::Value> {
    let out = sd_cli().args(["--list-devices", "--json"]).args(extra).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap().as_array().unwrap().clone()
}

#[test]
fn list_devices_json_shows_the_cpu_with_real_memory() {
    let devices = devices_json(&[]);
    let cpu = devices.iter().find(|d| d["type"] == "cpu").expect("a cpu device");
    let total = cpu["memory_total"].as_u64().unwrap();
    // The machine's real memory, as /proc/meminfo reports it (ggml reads the same).
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kb: u64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(total, kb * 1024);
    for key in ["name", "description", "type", "memory_free", "memory_total", "plugin"] {
        assert!(!cpu[key].is_null(), "missing {key}");
    }
    assert!(cpu["plugin"].as_str().unwrap().contains("libggml-cpu-"));
}

#[test]
fn rpc_server_devices_join_the_list() {
    let server = common::Server::start();
    let endpoint = server.endpoint.clone();
    // `--rpc-servers` is the reference's name, `--rpc` ours: the same flag.
    for flag in ["--rpc-servers", "--rpc"] {
        let devices = devices_json(&[flag, &endpoint]);
        let rpc = devices.iter().find(|d| d["name"].as_str().unwrap().starts_with("RPC")).expect("an RPC device");
        assert_eq!(rpc["description"], endpoint.as_str(), "{flag}");
        assert!(rpc["memory_total"].as_u64().unwrap() > 0);
        assert!(rpc["plugin"].as_str().unwrap().contains(&endpoint));
        // The local CPU is still listed.
        assert!(devices.iter().any(|d| d["type"] == "cpu" && d["name"] == "CPU"));
    }
}

#[test]
fn unreachable_rpc_server_is_a_clear_error_within_seconds() {
    let port = free_port();
    let t = Instant::now();
    let out = sd_cli().args(["--list-devices", "--rpc", &format!("127.0.0.1:{port}")]).output().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("127.0.0.1:{port}")) && err.contains("cannot connect"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn malformed_rpc_endpoint_is_rejected() {
    let out = sd_cli().args(["--list-devices", "--rpc", "localhost"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad RPC endpoint `localhost`"), "{err}");
}

#[test]
fn rpc_server_on_a_busy_port_fails_cleanly() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let out = sd_cli().args(["rpc-server", "--port", &port.to_string()]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot listen"));
}

#[test]
fn rpc_server_warns_off_loopback() {
    use std::io::BufRead;
    let mut child = sd_cli()
        .args(["rpc-server", "--host", "0.0.0.0", "--port", "0"])
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // the warning comes before the line saying where it listens (or the process ends)
    let mut err = String::new();
    for line in std::io::BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        err.push_str(&line);
        err.push('\n');
        if line.contains("listening on") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(err.contains("no authentication") && err.contains("listening on 0.0.0.0:"), "{err}");
}

#[test]
fn version_names_ggml_and_the_plugin_directories() {
    let out = sd_cli().arg("--version").output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains(&format!("ggml {}", ggml_sys::GGML_VERSION)), "{s}");
    assert!(s.contains("build tree") && s.contains("executable directory"), "{s}");
    assert!(s.contains("installed beside the executable"), "{s}");
    let cwd = std::env::current_dir().unwrap();
    assert!(
        !s.lines().any(|l| l.trim().starts_with(&format!("{} (", cwd.display()))),
        "the working directory is never searched: {s}"
    );
}
