//! `sd-cli rpc-server`: serve a local device to other machines over ggml's RPC protocol.

use std::process::ExitCode;

use anyhow::{Context as _, Result};
use clap::Args;
use sd_backends::DeviceKind;

use crate::DeviceArgs;

/// Options of `rpc-server`.
#[derive(Args, Debug)]
pub struct RpcServerArgs {
    /// Address to bind. The protocol has no authentication: keep it on loopback
    /// unless the network is trusted.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 50052, allow_negative_numbers = true, value_parser = crate::generate::whole::<u16>)]
    pub port: u16,
    /// Device to serve (default: the first GPU, else the CPU).
    #[arg(long, value_name = "NAME")]
    pub device: Option<String>,
    /// CPU threads for computations on a CPU device.
    #[arg(short = 't', long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::generate::whole::<usize>)]
    pub threads: usize,
    /// Directory for the server's tensor cache (optional).
    #[arg(long = "cache-dir", value_name = "DIR")]
    pub cache_dir: Option<std::path::PathBuf>,
    /// Internal: serve in this process. Without it, this process supervises such a
    /// worker and starts it again if a client's message kills it.
    #[arg(long = "worker", hide = true)]
    pub worker: bool,
}

/// Runs the server until the process is stopped.
pub fn run(args: &RpcServerArgs, dev_args: &DeviceArgs) -> Result<ExitCode> {
    if !args.worker {
        let exe = std::env::current_exe().context("locating sd-cli to start the server worker")?;
        let status = sd_backends::rpc::supervise(|| {
            let mut worker = std::process::Command::new(&exe);
            worker.args(std::env::args_os().skip(1)).arg("--worker");
            // ggml prints an abort's backtrace through a debugger child that inherits the
            // listening socket and outlives the worker: the restart could not bind
            if std::env::var_os("GGML_NO_BACKTRACE").is_none() {
                worker.env("GGML_NO_BACKTRACE", "1");
            }
            worker.spawn()
        })
        .context("running the RPC server worker")?;
        return Ok(match status.code() {
            Some(0) => ExitCode::SUCCESS,
            Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
            None => ExitCode::FAILURE,
        });
    }
    sd_backends::rpc::exit_with_supervisor();
    let reg = crate::devices::open(dev_args)?;
    let devices = reg.devices();
    let device = match &args.device {
        Some(name) => reg.device(name)?,
        None => devices
            .iter()
            .find(|d| d.kind() == DeviceKind::Gpu)
            .or_else(|| devices.iter().find(|d| d.kind() == DeviceKind::Cpu))
            .copied()
            .context("no device to serve")?,
    };
    let threads = if args.threads == 0 {
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    } else {
        args.threads
    };
    sd_backends::rpc::serve(&reg, &args.host, args.port, &[device], threads, args.cache_dir.as_deref())?;
    Ok(ExitCode::SUCCESS)
}
