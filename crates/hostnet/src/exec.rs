//! Running the rule tools (`nft`, `iptables-restore`, ...) as child processes.

use std::process::Stdio;

use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use crate::error::CommandError;

/// Runs `program args..`, feeding it `stdin`, and returns its standard output. A non-zero exit
/// is an error carrying the program's standard error.
pub(crate) async fn run(
    program: &str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<String, CommandError> {
    let spawn_error = |source| CommandError::Spawn {
        program: program.to_owned(),
        source,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(spawn_error)?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).await.map_err(spawn_error)?;
        // Dropping the pipe closes it: the program sees end of input.
    }
    let output = child.wait_with_output().await.map_err(spawn_error)?;
    if !output.status.success() {
        return Err(CommandError::Failed {
            program: program.to_owned(),
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Whether `program` is an executable file somewhere on `$PATH`.
pub(crate) fn installed(program: &str) -> bool {
    let Some(path) = std::env::var_os("PATH") else {
        return false;
    };
    std::env::split_paths(&path).any(|dir| dir.join(program).is_file())
}
