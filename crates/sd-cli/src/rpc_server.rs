//! `sd-cli rpc-server`: serve a local device to other machines over ggml's RPC protocol.
//!
//! This process is the front (`sd_backends::rpc_front`): it listens on the public port,
//! checks every request and gives each client its own worker, a child process started
//! with the hidden `--worker-port` that runs ggml's server on a private loopback port.

use std::process::ExitCode;

use anyhow::{Context as _, Result};
use clap::Args;
use sd_backends::{Device, DeviceKind, PluginRegistry};

use crate::DeviceArgs;

/// Options of `rpc-server`.
#[derive(Args, Debug)]
pub struct RpcServerArgs {
    /// Address to bind. The protocol has no authentication: keep it on loopback
    /// unless the network is trusted.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: a free port, named in the log line that says where the
    /// server listens).
    #[arg(long, default_value_t = 50052, allow_negative_numbers = true, value_parser = crate::generate::whole::<u16>)]
    pub port: u16,
    /// Device to serve (default: the first GPU, else the CPU).
    #[arg(long, value_name = "NAME")]
    pub device: Option<String>,
    /// CPU threads for computations on a CPU device (0: one per CPU; at most 4 per CPU).
    #[arg(short = 't', long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::generate::whole::<usize>)]
    pub threads: usize,
    /// Directory for the server's tensor cache (optional).
    #[arg(long = "cache-dir", value_name = "DIR")]
    pub cache_dir: Option<std::path::PathBuf>,
    /// [sd-rs] Buffers all clients together may allocate, in MiB (default: the device's
    /// free memory when the server starts).
    #[arg(long = "max-buffer-mib", value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..=1 << 40))]
    pub max_buffer_mib: Option<u64>,
    /// [sd-rs] Clients served at once; each has its own worker process.
    #[arg(long = "max-clients", value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub max_clients: u64,
    /// [sd-rs] Seconds a client may stay silent between two requests before it is dropped.
    #[arg(long = "idle-timeout", value_name = "SECONDS", default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub idle_timeout: u64,
    /// Internal: run ggml's server for one client on this loopback port.
    #[arg(long = "worker-port", hide = true)]
    pub worker_port: Option<u16>,
}

/// The most CPU threads a server computes with: four per CPU this process may use.
fn max_threads() -> usize {
    4 * std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Runs the server until the process is stopped.
pub fn run(args: &RpcServerArgs, dev_args: &DeviceArgs) -> Result<ExitCode> {
    let cap = max_threads();
    if args.threads > cap {
        eprintln!(
            "error: --threads {}: at most {cap} (four per CPU this process may use; 0 means one per CPU)",
            args.threads
        );
        return Ok(ExitCode::from(2));
    }
    let threads = if args.threads == 0 { cap / 4 } else { args.threads };
    let reg = crate::devices::open(dev_args)?;
    let device = pick_device(&reg, args)?;
    if let Some(port) = args.worker_port {
        sd_backends::rpc::exit_with_supervisor();
        return worker(&reg, device, port, threads, args);
    }
    let endpoint = format!("{}:{}", args.host, args.port);
    let listener = std::net::TcpListener::bind(&endpoint)
        .with_context(|| format!("cannot listen on {endpoint} (the RPC server's --host and --port)"))?;
    if !sd_backends::rpc::is_loopback(&args.host) {
        tracing::warn!(
            "serving on {endpoint}: the RPC protocol has no authentication or encryption; anyone who can reach \
             this address can allocate up to the buffer limit, compute on the device and read its buffers"
        );
    }
    let (free, _) = device.memory();
    let max_buffer_bytes = args.max_buffer_mib.map_or(free, |m| m << 20);
    let mut cfg = sd_backends::rpc_front::FrontConfig::new(1, max_buffer_bytes);
    cfg.max_clients = args.max_clients as usize;
    cfg.idle_timeout = std::time::Duration::from_secs(args.idle_timeout);
    let exe = std::env::current_exe().context("locating sd-cli to start the server's workers")?;
    let spawn = move || -> std::io::Result<sd_backends::rpc_front::Worker> {
        let mut worker = std::process::Command::new(&exe);
        worker.args(std::env::args_os().skip(1));
        // ggml prints an abort's backtrace through a debugger child that inherits the
        // listening socket and outlives the worker
        if std::env::var_os("GGML_NO_BACKTRACE").is_none() {
            worker.env("GGML_NO_BACKTRACE", "1");
        }
        worker.stdout(std::process::Stdio::null());
        sd_backends::rpc_front::spawn_worker(&mut worker)
    };
    // the port bound (`--port 0` asks the system for a free one)
    let bound = listener.local_addr().map_or(endpoint, |a| a.to_string());
    tracing::info!(
        "RPC server listening on {bound}, serving {} ({} MiB for buffers, {} clients at once, {threads} threads)",
        device.name(),
        max_buffer_bytes >> 20,
        args.max_clients
    );
    sd_backends::rpc_front::serve(listener, cfg, Box::new(spawn)).context("serving RPC clients")?;
    Ok(ExitCode::SUCCESS)
}

fn pick_device(reg: &PluginRegistry, args: &RpcServerArgs) -> Result<Device> {
    let devices = reg.devices();
    Ok(match &args.device {
        Some(name) => reg.device(name)?,
        None => devices
            .iter()
            .find(|d| d.kind() == DeviceKind::Gpu)
            .or_else(|| devices.iter().find(|d| d.kind() == DeviceKind::Cpu))
            .copied()
            .context("no device to serve")?,
    })
}

/// A worker: ggml's server on `127.0.0.1:port`, on a thread whose stack fits the deepest
/// graph the front lets through (ggml builds graphs by recursion).
fn worker(reg: &PluginRegistry, device: Device, port: u16, threads: usize, args: &RpcServerArgs) -> Result<ExitCode> {
    let stack = sd_backends::rpc_guard::serving_stack_bytes(&sd_backends::rpc_guard::GraphLimits::default());
    let cache = args.cache_dir.as_deref();
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("rpc-worker".into())
            .stack_size(stack)
            .spawn_scoped(s, move || sd_backends::rpc::serve(reg, "127.0.0.1", port, &[device], threads, cache))
            .context("starting the RPC worker thread")?
            .join()
            .map_err(|_| anyhow::anyhow!("the RPC worker thread panicked"))?
            .context("running the RPC worker")
    })?;
    Ok(ExitCode::SUCCESS)
}
