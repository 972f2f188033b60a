//! Waiting on a condition, the one way kolo does it: look every `every`
//! until it holds or the deadline passes. The waits kolo has no setting
//! for are named here with their reasons.

use std::time::{Duration, Instant};

/// One look at `done`: whether it held or the deadline passed, or how
/// long to pause before the next look.
fn look(deadline: Instant, every: Duration, done: &mut impl FnMut() -> bool) -> Result<bool, Duration> {
    if done() {
        return Ok(true);
    }
    let now = Instant::now();
    if now >= deadline {
        return Ok(false);
    }
    Err(every.min(deadline - now))
}

/// Polls `done` every `every` until it holds or `deadline` passes
/// (blocking); whether it held.
pub fn wait_until(deadline: Instant, every: Duration, mut done: impl FnMut() -> bool) -> bool {
    loop {
        match look(deadline, every, &mut done) {
            Ok(held) => return held,
            Err(pause) => std::thread::sleep(pause),
        }
    }
}

/// As [`wait_until`], on the async runtime.
pub async fn wait_until_async(deadline: Instant, every: Duration, mut done: impl FnMut() -> bool) -> bool {
    loop {
        match look(deadline, every, &mut done) {
            Ok(held) => return held,
            Err(pause) => tokio::time::sleep(pause).await,
        }
    }
}

/// How often a process that was told to end is looked at: ending takes a
/// few milliseconds, and looking costs a system call.
pub const EXIT_POLL: Duration = Duration::from_millis(5);

/// After SIGKILL, how long the driver waits for the engine's processes to
/// be reaped before it lets the janitor take over: a killed process is
/// gone within milliseconds unless its host is.
pub const KILLED_REAP: Duration = Duration::from_secs(2);

/// After the kill grace, how long stopping workers may take to close
/// their connections (their last output comes first).
pub const STOP_DRAIN: Duration = Duration::from_secs(2);

/// After Stop, how long workers that run functions (kolo.Executor's) may
/// take to close their connections: each ends itself at once, even in the
/// middle of a call, forwarding its last output (a worker holds its exit at
/// most 1 s for that); one still there is stopped, frozen or cut off, and
/// is killed, so that Ctrl-C ends the driver within a second whatever its
/// workers do (horovod.ray kills its actors outright).
pub const FUNCTIONS_DRAIN: Duration = Duration::from_millis(500);

/// How long a handshake may take, at most (within the start timeout): a
/// peer that says nothing must not hold a slot.
pub const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

/// How long a worker agent waits for the driver's welcome: the driver
/// answers at once, unless it is gone.
pub const WELCOME_WAIT: Duration = Duration::from_secs(30);

/// Workers that exited before connecting are named after this long, so
/// that hosts failing together (unreachable ones time out alike) are all
/// named in one error.
pub const FAILED_TOGETHER: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_ends_when_its_condition_holds_or_at_its_deadline() {
        let mut n = 0;
        assert!(wait_until(Instant::now() + Duration::from_secs(10), Duration::from_millis(1), || {
            n += 1;
            n == 3
        }));
        assert_eq!(n, 3);
        let start = Instant::now();
        assert!(!wait_until(start + Duration::from_millis(20), Duration::from_secs(1), || false));
        // the deadline bounds the last sleep, not the interval
        assert!(start.elapsed() < Duration::from_millis(500));
    }
}
