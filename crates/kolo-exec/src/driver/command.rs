//! Supervising an OS command job (`kolo run`): events from the ranks go
//! through the teardown policy, whose actions are signals to every rank.

use std::future::Future;

use nix::sys::signal::Signal;

use super::link::RankEvent;
use super::Executor;
use crate::policy::{Cause, JobAction, JobEvent, Teardown};
use kolo_engine::ExecError;
use kolo_proto::proto::ToWorker;

/// The rank that failed first in a command job.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The rank.
    pub rank: u32,
    /// Its host.
    pub host: String,
    /// How it failed.
    pub cause: Cause,
    /// Its last lines on stderr, oldest first.
    pub stderr_tail: Vec<String>,
    /// What the rank reported of its exception, where it did (`@record`).
    pub error: Option<super::link::RankError>,
}

/// How a command job ended.
#[derive(Clone, Debug)]
pub struct JobOutcome {
    /// 0, the first failure's code, or 128 + the signal that interrupted the job.
    pub exit_code: i32,
    /// The rank that failed first, if one did before any interruption.
    pub failure: Option<Failure>,
    /// The signal that asked kolo to stop, if one did.
    pub interrupted_by: Option<Signal>,
}

impl Executor {
    /// Waits for the OS command of every worker to end. The first failure
    /// (or `interrupt`) stops the others: SIGTERM, then SIGKILL after the
    /// grace period.
    pub async fn wait_command(&mut self, interrupt: impl Future<Output = Signal>) -> Result<JobOutcome, ExecError> {
        let grace = self.settings.kill_grace;
        let release = self.engine().is_some_and(|e| e.agents_may_leave_early());
        let running = self.running.as_mut().ok_or(ExecError::NotStarted)?;
        tokio::pin!(interrupt);
        let mut teardown = Teardown::new(running.links.len(), grace);
        let mut interrupted = false;
        let mut hurried = false;
        while !teardown.done() {
            let deadline = teardown.deadline().map(tokio::time::Instant::from_std);
            let event = tokio::select! {
                ended = running.events.recv() => match ended {
                    Some(RankEvent { rank, cause }) => {
                        if release && !matches!(cause, Cause::Lost(_)) {
                            if let Some(link) = running.links.iter().find(|l| l.info.rank == rank) {
                                link.release().await;
                            }
                        }
                        JobEvent::Ended { rank, cause }
                    }
                    None => break,
                },
                signal = &mut interrupt, if !interrupted => {
                    interrupted = true;
                    JobEvent::Interrupted(signal as i32)
                }
                signal = kolo_sys::hurry::hurried(), if !hurried => {
                    hurried = true;
                    JobEvent::Hurried(signal)
                }
                _ = sleep_until_opt(deadline) => JobEvent::Tick,
            };
            for action in teardown.on_event(event, std::time::Instant::now()) {
                let signal = match action {
                    JobAction::Terminate => Signal::SIGTERM,
                    JobAction::Kill => {
                        tracing::warn!("ranks still running {grace:?} after SIGTERM; sending SIGKILL");
                        Signal::SIGKILL
                    }
                };
                for link in &running.links {
                    let _ = link.send(&ToWorker::SignalCommand { signal: signal as i32 }).await;
                }
            }
        }
        tracing::debug!("every rank's command ended");
        let failure = match teardown.failure() {
            Some((rank, cause)) => {
                // the report shows the rank's last lines: write what came first
                running.output.flush().await;
                Some(Failure {
                    rank: *rank,
                    host: running.links[*rank as usize].info.hostname.clone(),
                    cause: cause.clone(),
                    stderr_tail: running.output.stderr_tail(*rank as usize),
                    error: kolo_sys::lock(&running.links[*rank as usize].command_error).clone(),
                })
            }
            None => None,
        };
        let interrupted_by = teardown.interrupted_by().and_then(|s| Signal::try_from(s).ok());
        Ok(JobOutcome { exit_code: teardown.exit_code(), failure, interrupted_by })
    }
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
