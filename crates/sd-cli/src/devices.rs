//! `--list-devices`, `--version` and the device setup shared by every command.

use std::process::ExitCode;

use anyhow::{Context as _, Result};
use sd_backends::{DeviceInfo, PluginRegistry, PluginSearch};

use crate::DeviceArgs;

/// `--rpc-timeout`: seconds from 1 to 3600, or `never` (zero: no deadline).
pub fn parse_rpc_timeout(s: &str) -> std::result::Result<std::time::Duration, String> {
    parse_deadline(s, "the RPC deadline", 3600.0)
}

/// `--rpc-compute-limit`: seconds from 1 to 86400, or `never` (zero: no limit).
pub fn parse_rpc_compute_limit(s: &str) -> std::result::Result<std::time::Duration, String> {
    parse_deadline(s, "the RPC compute limit", 86400.0)
}

/// Seconds from [`sd_backends::rpc::MIN_DEADLINE`] to `max`, or `never` (zero). `0` is
/// refused rather than read as "never": below the floor, a small value would silently
/// mean the opposite of what it says.
fn parse_deadline(s: &str, what: &str, max: f64) -> std::result::Result<std::time::Duration, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("never") {
        return Ok(std::time::Duration::ZERO);
    }
    let min = sd_backends::rpc::MIN_DEADLINE.as_secs_f64();
    let secs: f64 = t.parse().map_err(|_| format!("`{s}` is not a number of seconds or `never`"))?;
    if !secs.is_finite() || !(min..=max).contains(&secs) {
        return Err(format!("`{s}`: {what} must be between {min} and {max} seconds, or `never` for none"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

/// Loads the plugins and connects the `--rpc` servers.
pub fn open(args: &DeviceArgs) -> Result<PluginRegistry> {
    sd_backends::rpc::set_timeout(args.rpc_timeout.unwrap_or(sd_backends::rpc::DEFAULT_TIMEOUT));
    sd_backends::rpc::set_compute_limit(args.rpc_compute_limit.unwrap_or(sd_backends::rpc::DEFAULT_COMPUTE_LIMIT));
    let mut reg = PluginRegistry::discover(&PluginSearch::standard(args.plugin_dir.clone()));
    if reg.plugins().is_empty() {
        anyhow::bail!(
            "no backend plugin could be loaded; searched: {}{}",
            reg.searched().iter().map(|(d, o)| format!("{} ({o})", d.display())).collect::<Vec<_>>().join(", "),
            if reg.skipped().is_empty() {
                String::new()
            } else {
                format!(
                    "; skipped: {}",
                    reg.skipped()
                        .iter()
                        .map(|s| format!("{}: {}", s.path.display(), s.reason))
                        .collect::<Vec<_>>()
                        .join("; ")
                )
            }
        );
    }
    if let Some(list) = &args.rpc {
        for endpoint in rpc_endpoints(list)? {
            let devs = reg.add_rpc_server(endpoint).with_context(|| format!("--rpc-servers {endpoint}"))?;
            tracing::info!(
                "added {} remote device(s) from {endpoint}: {}",
                devs.len(),
                devs.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")
            );
        }
    }
    Ok(reg)
}

/// The endpoints of `--rpc`: none empty, none twice (`--rpc ""` and `a,,b` are errors), no
/// server under two spellings (`127.0.0.1:P,localhost:P`: a server serves one client at a
/// time, so the second connection would wait on the first and be lost).
fn rpc_endpoints(list: &str) -> Result<Vec<&str>> {
    let endpoints: Vec<&str> = list.split(',').map(str::trim).collect();
    if endpoints.iter().any(|e| e.is_empty()) {
        anyhow::bail!(
            "--rpc-servers '{}': an endpoint is empty; write HOST:PORT[,HOST:PORT...]",
            crate::generate::clip_text(list)
        );
    }
    for (i, e) in endpoints.iter().enumerate() {
        if endpoints[..i].contains(e) {
            anyhow::bail!("--rpc-servers: endpoint '{}' is given twice", crate::generate::clip_text(e));
        }
    }
    let mut resolved: Vec<(&str, std::net::SocketAddr)> = Vec::new();
    for e in &endpoints {
        let addr = sd_backends::rpc::resolve(e).context("--rpc-servers")?;
        if let Some((first, _)) = resolved.iter().find(|(_, a)| *a == addr) {
            anyhow::bail!(
                "--rpc-servers: '{}' and '{}' are the same server ({addr}); give each server once",
                crate::generate::clip_text(first),
                crate::generate::clip_text(e)
            );
        }
        resolved.push((e, addr));
    }
    Ok(endpoints)
}

/// `err` with the plugins that were found but give no device (with why) when it is an unknown
/// device: a GPU plugin whose driver cannot start (e.g. Vulkan without a Vulkan driver)
/// leaves its devices out and the CPU runs on, so asking for its device must say which
/// plugin could not provide it.
pub fn name_unusable_plugins(err: anyhow::Error, reg: &PluginRegistry) -> anyhow::Error {
    use sd_backends::SkipReason;
    let unknown_device = err.chain().any(|e| {
        matches!(e.downcast_ref::<sd_placement::PlanError>(), Some(sd_placement::PlanError::UnknownDevice { .. }))
    });
    let unusable: Vec<String> = reg
        .skipped()
        .iter()
        // a CPU variant for another CPU or that lost to a better one, or a copy found twice,
        // is normal operation
        .filter(|s| {
            !matches!(
                s.reason,
                SkipReason::Superseded { .. } | SkipReason::Shadowed { .. } | SkipReason::UnusableOnThisCpu
            )
        })
        .map(|s| format!("{}: {}", s.path.display(), s.reason))
        .collect();
    if !unknown_device || unusable.is_empty() {
        return err;
    }
    err.context(format!("plugins found that give no device: {}", unusable.join("; ")))
}

fn mib(b: u64) -> String {
    format!("{} MiB", b / (1024 * 1024))
}

/// `--list-devices [--json]`.
pub fn list(args: &DeviceArgs, json: bool) -> Result<ExitCode> {
    let reg = open(args)?;
    let infos: Vec<DeviceInfo> = reg.device_infos();
    if json {
        crate::out!("{}", serde_json::to_string_pretty(&infos)?);
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<[String; 5]> = infos
        .iter()
        .map(|i| {
            [
                i.name.clone(),
                i.kind.as_str().to_string(),
                format!("{} / {}", mib(i.memory_free), mib(i.memory_total)),
                i.description.clone(),
                i.plugin.clone(),
            ]
        })
        .collect();
    let head = ["DEVICE", "TYPE", "FREE / TOTAL", "DESCRIPTION", "PLUGIN"];
    let mut w = head.map(str::len);
    for r in &rows {
        for (k, c) in r.iter().enumerate() {
            w[k] = w[k].max(c.len());
        }
    }
    let line = |r: &[String; 5]| {
        format!(
            "{:<w0$}  {:<w1$}  {:<w2$}  {:<w3$}  {}",
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            w0 = w[0],
            w1 = w[1],
            w2 = w[2],
            w3 = w[3]
        )
    };
    crate::out!("{}", line(&head.map(String::from)));
    for r in &rows {
        crate::out!("{}", line(r));
    }
    Ok(ExitCode::SUCCESS)
}

/// `--version`.
pub fn print_version(args: &DeviceArgs) -> Result<ExitCode> {
    let (ggml, package) = sd_backends::ggml_version();
    crate::out!("sd-cli {}", env!("CARGO_PKG_VERSION"));
    crate::out!("ggml {ggml} (from crates.io package {package}, backend API {})", ggml_sys::GGML_BACKEND_API_VERSION);
    crate::out!("plugin directories searched, in order:");
    for (dir, origin) in PluginSearch::standard(args.plugin_dir.clone()).directories() {
        crate::out!("  {} ({origin})", dir.display());
    }
    Ok(ExitCode::SUCCESS)
}
