//! `sd-server`: the name stable-diffusion.cpp's server goes by, for `sd-cli serve`.
//!
//! Front-ends and scripts written for the reference start `sd-server -m MODEL -l IP
//! --listen-port PORT ...`; this binary runs the `sd-cli` installed beside it as
//! `sd-cli serve ARGS...`, so the flags, their checks and the exit statuses are that
//! command's (one implementation, one `--help`).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

/// The `sd-cli` beside this executable.
fn sd_cli() -> Result<PathBuf, String> {
    let me = std::env::current_exe().map_err(|e| format!("cannot find this executable's path: {e}"))?;
    let name = format!("sd-cli{}", std::env::consts::EXE_SUFFIX);
    let cli = me.with_file_name(&name);
    if cli.is_file() {
        Ok(cli)
    } else {
        Err(format!("'{}' is missing: sd-server runs the sd-cli installed beside it", cli.display()))
    }
}

fn main() -> ExitCode {
    let cli = match sd_cli() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let args: Vec<OsString> = std::iter::once(OsString::from("serve")).chain(std::env::args_os().skip(1)).collect();
    let mut cmd = Command::new(&cli);
    cmd.args(&args);
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt as _;
        // Replaces this process: signals, the exit status and the listening socket are
        // sd-cli's own.
        let e = cmd.exec();
        eprintln!("error: cannot run '{}': {e}", cli.display());
        ExitCode::FAILURE
    }
    #[cfg(not(unix))]
    match cmd.status() {
        Ok(s) => ExitCode::from(s.code().unwrap_or(1).clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("error: cannot run '{}': {e}", cli.display());
            ExitCode::FAILURE
        }
    }
}
