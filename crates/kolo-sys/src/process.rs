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

/// Whether process `pid` is stopped by a signal (`T` in `/proc/PID/stat`;
/// not `t`, a tracer's stop: a debugger or a stack sampler).
pub fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('T')))
        .unwrap_or(false)
}

/// SIGTERM to the group, SIGKILL to what is left of it after `grace`
/// (blocking: call it from a thread of its own or a process on its way out).
pub fn stop_group(group: u32, grace: std::time::Duration) {
    if !signal_group(group, Signal::SIGTERM) {
        return;
    }
    // a stopped process cannot act on SIGTERM
    signal_group(group, Signal::SIGCONT);
    crate::wait::wait_until(std::time::Instant::now() + grace, crate::wait::EXIT_POLL, || !group_alive(group));
    signal_group(group, Signal::SIGKILL);
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
