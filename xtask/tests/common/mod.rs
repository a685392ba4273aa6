//! Helpers shared by xtask's integration tests.

use std::process::{Command, Output};

/// Runs `cmd` and returns its output; a failure shows the command, its status and its output.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
