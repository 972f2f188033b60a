//! The driver's decisions, apart from its I/O: how a command job is torn
//! down and when a silent worker counts as lost. Each is a state machine
//! fed events with the time they happened (`on_event(event, now) ->
//! actions`), so every path is tested without processes or clocks.

use std::time::{Duration, Instant};

/// How a rank failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cause {
    /// The rank's command ended by itself or by a signal (exit code 0 is
    /// the one cause that is no failure).
    Exited {
        /// Its exit code, if it exited.
        code: Option<i32>,
        /// The signal's number, if one killed it.
        signal: Option<i32>,
    },
    /// The command could not be started; `code` follows the shell (127, 126).
    StartFailed {
        /// Why, for the user.
        message: String,
        /// The exit code the job takes from it.
        code: i32,
    },
    /// The worker itself was lost.
    Lost(String),
}

impl Cause {
    /// The shell's exit code for this failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            Cause::Exited { code: Some(code), .. } => *code,
            Cause::Exited { signal: Some(signal), .. } => 128 + signal,
            Cause::Exited { .. } | Cause::Lost(_) => 1,
            Cause::StartFailed { code, .. } => *code,
        }
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cause::Exited { code: Some(code), .. } => write!(f, "exited with code {code}"),
            Cause::Exited { signal: Some(sig), .. } => {
                let name = nix::sys::signal::Signal::try_from(*sig).map(|s| s.as_str()).unwrap_or("unknown signal");
                write!(f, "was killed by signal {sig} ({name})")
            }
            Cause::Exited { .. } => write!(f, "ended"),
            Cause::StartFailed { message, .. } => f.write_str(message),
            Cause::Lost(reason) => write!(f, "was lost: {reason}"),
        }
    }
}

/// What happens to a command job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobEvent {
    /// A rank's command ended (successfully or not).
    Ended {
        /// The rank whose command ended.
        rank: u32,
        /// How it ended.
        cause: Cause,
    },
    /// kolo was asked to stop (the signal's number).
    Interrupted(i32),
    /// kolo was asked to stop again while stopping (a second Ctrl-C):
    /// what still runs is killed now, as mpirun does.
    Hurried(i32),
    /// Time passed (a deadline this machine asked for came).
    Tick,
}

/// What the driver must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobAction {
    /// SIGTERM to every rank's command.
    Terminate,
    /// SIGKILL to every rank's command.
    Kill,
}

/// Teardown of a command job: the first failure (or an interruption)
/// terminates every rank, and what still runs a grace period later is
/// killed. The job is over when every rank has ended.
#[derive(Debug)]
pub struct Teardown {
    running: Vec<bool>,
    grace: Duration,
    failure: Option<(u32, Cause)>,
    interrupted_by: Option<i32>,
    kill_at: Option<Instant>,
    killed: bool,
}

impl Teardown {
    /// A job of `ranks` running ranks, with `grace` between SIGTERM and
    /// SIGKILL.
    pub fn new(ranks: usize, grace: Duration) -> Teardown {
        Teardown {
            running: vec![true; ranks],
            grace,
            failure: None,
            interrupted_by: None,
            kill_at: None,
            killed: false,
        }
    }

    /// Takes in what happened at `now`; returns what the driver must do
    /// (in order).
    pub fn on_event(&mut self, event: JobEvent, now: Instant) -> Vec<JobAction> {
        let mut actions = Vec::new();
        match event {
            JobEvent::Ended { rank, cause } => {
                let Some(slot) = self.running.get_mut(rank as usize) else { return actions };
                if !std::mem::replace(slot, false) {
                    return actions;
                }
                let failed = cause != Cause::Exited { code: Some(0), signal: None };
                if failed && self.failure.is_none() && self.interrupted_by.is_none() {
                    self.failure = Some((rank, cause));
                    self.begin(now, &mut actions);
                }
            }
            JobEvent::Interrupted(signal) => {
                if self.interrupted_by.is_none() {
                    self.interrupted_by = Some(signal);
                    self.begin(now, &mut actions);
                }
            }
            JobEvent::Hurried(signal) => {
                if self.interrupted_by.is_none() && self.failure.is_none() {
                    self.interrupted_by = Some(signal);
                }
                if !self.killed && !self.done() {
                    self.killed = true;
                    actions.push(JobAction::Kill);
                }
            }
            JobEvent::Tick => {}
        }
        if let Some(at) = self.kill_at {
            if now >= at && !self.killed && !self.done() {
                self.killed = true;
                actions.push(JobAction::Kill);
            }
        }
        actions
    }

    fn begin(&mut self, now: Instant, actions: &mut Vec<JobAction>) {
        if self.kill_at.is_none() && !self.done() {
            self.kill_at = Some(now + self.grace);
            actions.push(JobAction::Terminate);
        }
    }

    /// When the machine next wants a `Tick`.
    pub fn deadline(&self) -> Option<Instant> {
        self.kill_at.filter(|_| !self.killed && !self.done())
    }

    /// Every rank has ended.
    pub fn done(&self) -> bool {
        !self.running.iter().any(|&r| r)
    }

    /// The first rank that failed, and how, unless an interruption came
    /// first.
    pub fn failure(&self) -> Option<&(u32, Cause)> {
        self.failure.as_ref()
    }

    /// The signal that first asked kolo to stop, if one did.
    pub fn interrupted_by(&self) -> Option<i32> {
        self.interrupted_by
    }

    /// 0, the first failure's code, or 128 + the interrupting signal.
    pub fn exit_code(&self) -> i32 {
        match (&self.failure, self.interrupted_by) {
            (_, Some(signal)) => 128 + signal,
            (Some((_, cause)), None) => cause.exit_code(),
            (None, None) => 0,
        }
    }
}

/// When a worker counts as lost: silent for longer than the timeout,
/// unless the driver itself is not listening to it (its output is held
/// back by a slow reader of kolo's output), which says nothing about the
/// worker.
#[derive(Clone, Copy, Debug)]
pub struct Liveness {
    /// The longest silence allowed (the heartbeat timeout).
    pub timeout: Duration,
}

impl Liveness {
    /// How long the worker has been silent, if that makes it lost.
    pub fn lost(&self, last_heard: Instant, now: Instant, not_listening: bool) -> Option<Duration> {
        let silent = now.saturating_duration_since(last_heard);
        (!not_listening && silent > self.timeout).then_some(silent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: Cause = Cause::Exited { code: Some(0), signal: None };

    fn ended(rank: u32, cause: Cause) -> JobEvent {
        JobEvent::Ended { rank, cause }
    }

    #[test]
    fn a_job_whose_ranks_all_succeed_ends_with_zero_and_no_signals() {
        let now = Instant::now();
        let mut t = Teardown::new(3, Duration::from_secs(5));
        for rank in 0..3 {
            assert!(t.on_event(ended(rank, OK), now).is_empty());
        }
        assert!(t.done());
        assert_eq!(t.exit_code(), 0);
        assert_eq!(t.deadline(), None);
    }

    #[test]
    fn the_first_failure_terminates_then_kills_after_the_grace() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(5);
        let mut t = Teardown::new(3, grace);
        let bad = Cause::Exited { code: Some(3), signal: None };
        assert_eq!(t.on_event(ended(1, bad.clone()), t0), [JobAction::Terminate]);
        assert_eq!(t.deadline(), Some(t0 + grace));
        // a later failure is not the first; no second TERM
        let killed = Cause::Exited { code: None, signal: Some(15) };
        assert!(t.on_event(ended(0, killed), t0 + Duration::from_secs(1)).is_empty());
        assert!(t.on_event(JobEvent::Tick, t0 + Duration::from_secs(4)).is_empty());
        assert_eq!(t.on_event(JobEvent::Tick, t0 + grace), [JobAction::Kill]);
        assert!(t.on_event(JobEvent::Tick, t0 + grace * 2).is_empty());
        assert!(!t.done());
        t.on_event(ended(2, Cause::Exited { code: None, signal: Some(9) }), t0 + grace);
        assert!(t.done());
        assert_eq!(t.failure(), Some(&(1, bad)));
        assert_eq!(t.exit_code(), 3);
    }

    #[test]
    fn an_interruption_wins_over_later_failures_and_names_the_signal() {
        let t0 = Instant::now();
        let mut t = Teardown::new(2, Duration::from_millis(100));
        assert_eq!(t.on_event(JobEvent::Interrupted(2), t0), [JobAction::Terminate]);
        assert!(t.on_event(JobEvent::Interrupted(15), t0).is_empty());
        t.on_event(ended(0, Cause::Exited { code: None, signal: Some(15) }), t0);
        t.on_event(ended(1, Cause::Lost("gone".into())), t0);
        assert!(t.done());
        assert_eq!(t.failure(), None);
        assert_eq!(t.exit_code(), 130);
    }

    #[test]
    fn a_second_interruption_kills_at_once_and_only_once() {
        let t0 = Instant::now();
        let mut t = Teardown::new(2, Duration::from_secs(10));
        assert_eq!(t.on_event(JobEvent::Interrupted(2), t0), [JobAction::Terminate]);
        let soon = t0 + Duration::from_millis(500);
        assert_eq!(t.on_event(JobEvent::Hurried(2), soon), [JobAction::Kill]);
        assert_eq!(t.deadline(), None);
        assert!(t.on_event(JobEvent::Hurried(2), soon).is_empty());
        assert!(t.on_event(JobEvent::Tick, t0 + Duration::from_secs(10)).is_empty());
        t.on_event(ended(0, Cause::Exited { code: None, signal: Some(9) }), soon);
        t.on_event(ended(1, Cause::Exited { code: None, signal: Some(9) }), soon);
        assert!(t.done());
        assert_eq!(t.exit_code(), 130);
        // while a failure tears the job down, the failure stays what is reported
        let mut t = Teardown::new(2, Duration::from_secs(10));
        let bad = Cause::Exited { code: Some(3), signal: None };
        t.on_event(ended(0, bad.clone()), t0);
        assert_eq!(t.on_event(JobEvent::Hurried(15), soon), [JobAction::Kill]);
        assert_eq!(t.failure(), Some(&(0, bad)));
        // after the last rank ended there is nothing to kill
        let mut t = Teardown::new(1, Duration::from_secs(10));
        t.on_event(ended(0, OK), t0);
        assert!(t.on_event(JobEvent::Hurried(2), soon).is_empty());
    }

    #[test]
    fn a_failure_after_everything_else_ended_sends_nothing() {
        let t0 = Instant::now();
        let mut t = Teardown::new(2, Duration::from_secs(1));
        t.on_event(ended(0, OK), t0);
        assert!(t.on_event(ended(1, Cause::StartFailed { message: "no".into(), code: 127 }), t0).is_empty());
        assert_eq!(t.exit_code(), 127);
        // events for ranks that do not exist or ended already change nothing
        assert!(t.on_event(ended(7, OK), t0).is_empty());
        assert!(t.on_event(ended(1, OK), t0).is_empty());
    }

    #[test]
    fn silence_counts_only_while_the_driver_listens() {
        let live = Liveness { timeout: Duration::from_secs(5) };
        let t0 = Instant::now();
        assert_eq!(live.lost(t0, t0 + Duration::from_secs(5), false), None);
        assert_eq!(live.lost(t0, t0 + Duration::from_secs(6), false), Some(Duration::from_secs(6)));
        assert_eq!(live.lost(t0, t0 + Duration::from_secs(60), true), None);
        assert_eq!(live.lost(t0 + Duration::from_secs(1), t0, false), None);
    }
}
