//! `sd-cli`: image generation, device listing, placement plans and an RPC device server.
//!
//! Flag names follow stable-diffusion.cpp's `sd-cli` so existing commands keep
//! working. Subcommands: `plan` (print a placement plan without loading
//! weights), `rpc-server` (serve a local device to other machines) and `serve`
//! (load the model once and serve it over HTTP, the `sd-server` crate); without
//! a subcommand, `--list-devices` lists devices and otherwise an image is
//! generated. Flags and commands that are ours, not the reference's, say so in
//! `--help` (`[sd-rs]`).

/// Prints a line to stdout, ignoring a closed pipe (`sd-cli ... | head`).
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

mod devices;
mod errors;
mod generate;
mod inputs;
mod logging;
mod output;
mod plan;
mod progress;
mod rpc_server;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// Options shared by every command that touches devices.
#[derive(Args, Debug, Clone, Default)]
pub struct DeviceArgs {
    /// [sd-rs] Directory to search for backend plugins first (repeatable).
    #[arg(long = "plugin-dir", value_name = "DIR", global = true)]
    pub plugin_dir: Vec<PathBuf>,
    /// RPC servers to offload to: comma-separated `host:port` (e.g. localhost:50052), such as
    /// `sd-cli rpc-server` instances. `--rpc` is our older name for it.
    #[arg(long = "rpc-servers", visible_alias = "rpc", value_name = "HOST:PORT[,...]", global = true)]
    pub rpc: Option<String>,
    /// Deadline of each RPC send or receive, in seconds (default 8): a server that moves
    /// no byte for this long is declared lost and the run stops with exit status 3.
    /// `sd-cli rpc-server` sends keepalives while it computes; raise it for other servers
    /// that compute one graph for longer. 0 waits forever.
    #[arg(long = "rpc-timeout", value_name = "SECONDS", value_parser = devices::parse_rpc_timeout, global = true)]
    pub rpc_timeout: Option<std::time::Duration>,
}

/// Exit status when a remote (RPC) device was lost during the run (1 is any other
/// failure, 2 bad input).
const EXIT_DEVICE_LOST: u8 = 3;

#[derive(Parser, Debug)]
#[command(
    name = "sd-cli",
    about = "Diffusion models on ggml, placed across devices",
    long_about = "Diffusion models on ggml, placed across devices.\n\nFlags follow stable-diffusion.cpp's sd-cli; \
                  those marked [sd-rs] and the commands are this program's own.",
    disable_version_flag = true
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Print the version, the ggml version and the plugin directories searched.
    #[arg(long = "version", global = true)]
    version: bool,
    /// Debug logging (`-v`), trace logging (`-vv`).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(flatten)]
    devices: DeviceArgs,
    /// List the available devices and exit.
    #[arg(long = "list-devices")]
    list_devices: bool,
    /// [sd-rs] With --list-devices: print JSON.
    #[arg(long = "json")]
    json: bool,
    #[command(flatten)]
    generate: generate::GenerateArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// [sd-rs] Print a placement plan from the model files' headers (no weights are read).
    Plan(plan::PlanArgs),
    /// [sd-rs] Serve a local device to other machines over ggml's RPC protocol.
    RpcServer(rpc_server::RpcServerArgs),
    /// [sd-rs] Load the model once and serve stable-diffusion.cpp's server APIs over HTTP
    /// (native async jobs, OpenAI, A1111) on 127.0.0.1:1234.
    Serve(Box<serve::ServeArgs>),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    logging::init(cli.verbose);
    let result = if cli.version {
        devices::print_version(&cli.devices)
    } else {
        match cli.command {
            Some(Command::RpcServer(args)) => rpc_server::run(&args, &cli.devices),
            Some(Command::Serve(args)) => serve::run(&args, &cli.devices),
            // Any error of `plan` is bad input (files, flags, profile): exit status 2.
            Some(Command::Plan(args)) => plan::run(&args, &cli.devices).or_else(|e| {
                print_error(&e);
                Ok(ExitCode::from(2))
            }),
            None if cli.list_devices => devices::list(&cli.devices, cli.json),
            None => generate::run(&cli.generate, &cli.devices),
        }
    };
    let printed = match &result {
        Ok(_) => String::new(),
        Err(e) => print_error(e),
    };
    // A lost server decides the exit status, whatever error it caused on its way out.
    if let Some(loss) = sd_backends::rpc::lost() {
        if !printed.contains(&loss.endpoint) {
            eprintln!("error: lost RPC server {}: {}", loss.endpoint, loss.reason);
        }
        if loss.reason.contains("deadline") {
            eprintln!(
                "hint: --rpc-timeout SECONDS raises the deadline (now {} s) for a server that is only slow",
                sd_backends::rpc::timeout().as_secs_f64()
            );
        }
        return ExitCode::from(EXIT_DEVICE_LOST);
    }
    match result {
        Ok(code) => code,
        Err(_) => ExitCode::FAILURE,
    }
}

/// Prints `e` and the hints that name flags for it; returns the printed message.
fn print_error(e: &anyhow::Error) -> String {
    let msg = report(e);
    eprintln!("error: {msg}");
    for hint in errors::hints(e) {
        eprintln!("hint: {hint}");
    }
    msg
}

/// The error and its causes, joined with `: ` (each error describes its own layer only, so
/// nothing repeats).
fn report(e: &anyhow::Error) -> String {
    e.chain().map(|cause| cause.to_string()).collect::<Vec<_>>().join(": ")
}

#[cfg(test)]
mod tests {
    use super::report;

    #[test]
    fn the_chain_is_printed_outermost_first() {
        let inner = std::io::Error::other("disk on fire");
        let e = anyhow::Error::new(inner).context("reading model.safetensors").context("loading");
        assert_eq!(report(&e), "loading: reading model.safetensors: disk on fire");
    }
}
