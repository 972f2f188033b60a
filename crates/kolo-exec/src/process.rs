//! Worker processes in their own process groups, so that signalling the
//! group reaches everything a worker started.

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

/// Sends `signal` to the process group led by `pgid`; false once the group
/// is gone.
pub fn signal_group(pgid: u32, signal: Signal) -> bool {
    killpg(Pid::from_raw(pgid as i32), signal).is_ok()
}

/// Whether any process of the group is still alive (zombies included).
pub fn group_alive(pgid: u32) -> bool {
    killpg(Pid::from_raw(pgid as i32), None).is_ok()
}

/// How a process ended, in words.
pub fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => {
            let name = Signal::try_from(sig).map(|s| s.as_str()).unwrap_or("unknown signal");
            format!("was killed by signal {sig} ({name})")
        }
        _ => "ended".into(),
    }
}
