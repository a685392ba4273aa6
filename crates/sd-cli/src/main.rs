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

mod cost;
mod devices;
mod errors;
mod generate;
mod inputs;
mod logging;
mod output;
mod plan;
mod progress;
mod reference_flags;
mod rpc_server;
mod serve;
mod upscale;

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
    /// Deadline of each RPC send or receive, in seconds from 1 to 3600 (default 8): a server
    /// that moves no byte for this long is declared lost and the run stops with exit status 3.
    /// `sd-cli rpc-server` sends keepalives while it computes; raise it for other servers
    /// that compute one graph for longer. `never` waits forever.
    #[arg(long = "rpc-timeout", value_name = "SECONDS|never", value_parser = devices::parse_rpc_timeout, global = true)]
    pub rpc_timeout: Option<std::time::Duration>,
    /// [sd-rs] How long an RPC server may keep computing (sending only keepalives) before it
    /// answers one call, in seconds from 1 to 86400 (default 900): past it the server is
    /// declared lost (exit status 3). `never` removes the limit.
    #[arg(
        long = "rpc-compute-limit",
        value_name = "SECONDS|never",
        value_parser = devices::parse_rpc_compute_limit,
        global = true
    )]
    pub rpc_compute_limit: Option<std::time::Duration>,
}

/// Exit status when a remote (RPC) device was lost during the run (1 is any other
/// failure, 2 bad input: any error of `plan`, and a generation's found before its first
/// expensive stage, so that both give 2 for the same bad input).
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
    /// [sd-rs] Log lines as text, or as JSON objects one per line (for front-ends that
    /// collect logs).
    #[arg(long = "log-format", value_enum, default_value_t = logging::LogFormat::Text, global = true)]
    log_format: logging::LogFormat,
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
#[allow(clippy::large_enum_variant)] // parsed once per process
enum Command {
    /// [sd-rs] Print a placement plan from the model files' headers (no weights are read); takes
    /// a generation's flags, so `sd-cli plan` followed by a generation's flags plans that run.
    Plan(plan::PlanArgs),
    /// [sd-rs] Measure each device's compute, memory and link figures (a few seconds) for the
    /// cost model that `plan --explain` and auto-fit by time use.
    Calibrate(cost::CalibrateArgs),
    /// [sd-rs] Serve a local device to other machines over ggml's RPC protocol.
    RpcServer(rpc_server::RpcServerArgs),
    /// [sd-rs] Load the model once and serve stable-diffusion.cpp's server APIs over HTTP
    /// (native async jobs, OpenAI, A1111) on 127.0.0.1:1234.
    Serve(Box<serve::ServeArgs>),
}

fn main() -> ExitCode {
    #[cfg(unix)]
    // SAFETY: changes one signal's disposition to "ignore", before any other thread runs.
    // A file size limit (`ulimit -f`) reached while writing an output is then an error
    // with a message (EFBIG), as a full disk is, instead of a death by SIGXFSZ.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if e.kind() == clap::error::ErrorKind::UnknownArgument => {
            // A flag of stable-diffusion.cpp's that we lack: said so, not "did you mean".
            let arg = match e.get(clap::error::ContextKind::InvalidArg) {
                // one this program takes elsewhere (`plan --steps`): clap's message is right
                Some(clap::error::ContextValue::String(a)) if !takes_flag(a) => reference_flags::not_implemented(a),
                _ => None,
            };
            match arg {
                Some(msg) => eprintln!("error: {}", printable(&msg)),
                None => eprint!("{}", printable(&e.render().to_string())),
            }
            return ExitCode::from(2);
        }
        Err(e) if e.use_stderr() => {
            // clap quotes the argument it refuses as given: escaped here like our messages.
            eprint!("{}", printable(&e.render().to_string()));
            return ExitCode::from(2);
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
    };
    logging::init(cli.verbose, cli.log_format);
    // Switches the CPU kernels read behind our back: a value they would ignore is bad input.
    if let Err(e) = sd_backends::backend::check_cpu_env() {
        print_error(&e.into());
        return ExitCode::from(2);
    }
    let result = if cli.version {
        devices::print_version(&cli.devices)
    } else {
        match cli.command {
            Some(Command::RpcServer(args)) => rpc_server::run(&args, &cli.devices),
            Some(Command::Serve(args)) => serve::run(&args, &cli.devices),
            Some(Command::Calibrate(args)) => cost::run(&args, &cli.devices),
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
        // an error on the way out may name the device without the loss (an allocation the
        // lost server answered with nothing): the loss and its cause are printed then too
        if !printed.contains(&format!("lost RPC server {}", loss.endpoint)) {
            eprintln!("error: lost RPC server {}: {}", printable(&loss.endpoint), printable(&loss.reason));
        }
        if loss.reason.contains("compute limit") {
            eprintln!(
                "hint: --rpc-compute-limit SECONDS raises the limit (now {} s) for a server that computes one graph \
                 for longer",
                sd_backends::rpc::compute_limit().as_secs_f64()
            );
        } else if loss.reason.contains("deadline") {
            eprintln!(
                "hint: --rpc-timeout SECONDS raises the deadline (now {} s) for a server that is only slow",
                sd_backends::rpc::timeout().as_secs_f64()
            );
        }
        return ExitCode::from(EXIT_DEVICE_LOST);
    }
    match result {
        Ok(code) => code,
        Err(e) if errors::is_bad_input(&e) => ExitCode::from(2),
        Err(_) => ExitCode::FAILURE,
    }
}

/// Whether the top-level command takes flag `arg` (`--steps`, `-W`, `--steps=3`).
fn takes_flag(arg: &str) -> bool {
    use clap::CommandFactory as _;
    let flag = arg.split_once('=').map_or(arg, |(f, _)| f);
    Cli::command().get_arguments().any(|a| match flag.strip_prefix("--") {
        Some(long) => a.get_long_and_visible_aliases().is_some_and(|l| l.contains(&long)),
        None => flag.strip_prefix('-').and_then(|s| s.chars().next()).is_some_and(|c| a.get_short() == Some(c)),
    })
}

/// Prints `e` and the hints that name flags for it; returns the printed message.
fn print_error(e: &anyhow::Error) -> String {
    let msg = printable(&report(e));
    eprintln!("error: {msg}");
    for hint in errors::hints(e) {
        eprintln!("hint: {}", printable(&hint));
    }
    msg
}

/// `s` with its control characters (an escape sequence, a carriage return, a bell in a path
/// or a flag's value) written as escapes (`\u{1b}`, `\r`), so that a message cannot move the
/// terminal's cursor or recolour it; line breaks and tabs stay.
fn printable(s: &str) -> String {
    if !s.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return s.to_string();
    }
    s.chars()
        .map(|c| if c.is_control() && c != '\n' && c != '\t' { c.escape_default().to_string() } else { c.to_string() })
        .collect()
}

/// The error and its causes, joined with `: ` (each error describes its own layer only, so
/// nothing repeats).
fn report(e: &anyhow::Error) -> String {
    // a marker layer (`errors::BadInput`) has no text
    e.chain().map(|cause| cause.to_string()).filter(|s| !s.is_empty()).collect::<Vec<_>>().join(": ")
}

#[cfg(test)]
mod tests {
    use super::{printable, report};

    #[test]
    fn control_characters_are_escaped_and_text_kept() {
        assert_eq!(printable("-o 'a\u{1b}[31mred\r.png'"), "-o 'a\\u{1b}[31mred\\r.png'");
        assert_eq!(printable("two\nlines\tand é"), "two\nlines\tand é");
        assert_eq!(printable("\u{7f}\u{9b}"), "\\u{7f}\\u{9b}");
    }

    #[test]
    fn the_chain_is_printed_outermost_first() {
        let inner = std::io::Error::other("disk on fire");
        let e = anyhow::Error::new(inner).context("reading model.safetensors").context("loading");
        assert_eq!(report(&e), "loading: reading model.safetensors: disk on fire");
    }

    #[test]
    fn bad_input_is_marked_without_changing_the_message_or_the_causes() {
        let inner = std::io::Error::other("no such file");
        let e = anyhow::Error::new(inner).context("-m model.safetensors");
        assert!(!crate::errors::is_bad_input(&e));
        let e = crate::errors::bad_input(e);
        assert!(crate::errors::is_bad_input(&e));
        assert_eq!(report(&e), "-m model.safetensors: no such file");
        assert!(e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some()), "hints still find the causes");
    }
}
