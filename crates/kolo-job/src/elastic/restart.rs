//! Restart mode (torchrun's elastic semantics), for commands and for
//! functions: the world runs until a rank fails, a host is lost or
//! discovery changes the hosts; then every rank is stopped, `Membership`
//! decides the next world, and every rank starts again with its new ranks
//! and the restart count (`TORCHELASTIC_RESTART_COUNT`). Programs resume
//! from their own checkpoints.

use std::future::Future;
use std::time::Instant;

use kolo_topology::{Decision, ElasticConfig, ElasticEnv, Event, Membership, StopReason, World};
use nix::sys::signal::Signal;
use tokio::sync::mpsc;

use super::in_place::{Cohort, CohortFactory};
use super::work::{CommandWork, ElasticWork, FunctionWork, Launch, ProcessEnd, TaskWork};
use super::{Discovery, ElasticEvent};
use kolo_engine::ExecError;
use kolo_exec::Cause;
use kolo_exec::{JobOutcome, Report};
use kolo_proto::{Executable, Function, Task};

/// The rank of a world that failed first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorldFailure {
    /// Its rank in the world.
    pub rank: u32,
    /// Its host as the world names it (the plan's node id).
    pub host: String,
    /// The host itself is gone (its worker was lost).
    pub lost: bool,
    /// "exited with code 3", "raised ...".
    pub reason: String,
}

/// How one world ended.
#[derive(Debug)]
pub struct WorldEnd<O> {
    /// Every rank's result, in rank order, when all succeeded.
    pub results: Vec<O>,
    /// The rank that failed first, if one did.
    pub failure: Option<WorldFailure>,
    /// Stopped by this signal (also when discovery changed the hosts).
    pub interrupted_by: Option<Signal>,
    /// A command job's own account (its exit code, the failed rank's
    /// output).
    pub command: Option<JobOutcome>,
}

/// What every rank of a restarted job runs.
pub trait RestartWork: Send + Sync {
    /// What one rank returns when it succeeds.
    type Output: Send;
    /// Starts the work where `at` says and runs the world until it ends or
    /// `stop` resolves (then the world is torn down).
    #[allow(async_fn_in_trait)]
    async fn run_world(
        &self,
        at: Launch<'_>,
        stop: impl Future<Output = Signal> + Send,
    ) -> Result<WorldEnd<Self::Output>, ExecError>;
}

impl RestartWork for CommandWork {
    type Output = ();
    async fn run_world(
        &self,
        at: Launch<'_>,
        stop: impl Future<Output = Signal> + Send,
    ) -> Result<WorldEnd<()>, ExecError> {
        let executor = at.executor;
        self.start_command(executor, at.env).await?;
        let nodes: Vec<String> = executor.plan().await?.workers.iter().map(|w| w.host.node_id.clone()).collect();
        let outcome = executor.wait_command(stop).await?;
        let failure = outcome.failure.as_ref().map(|f| WorldFailure {
            rank: f.rank,
            host: nodes.get(f.rank as usize).cloned().unwrap_or_else(|| f.host.clone()),
            lost: matches!(f.cause, Cause::Lost(_)),
            reason: f.cause.to_string(),
        });
        Ok(WorldEnd { results: Vec::new(), failure, interrupted_by: outcome.interrupted_by, command: Some(outcome) })
    }
}

/// Work that is a call in every worker (a task or a function): a world
/// of it ends with every rank's result or the first failure.
pub trait CallWork: ElasticWork {}

impl<E, T> CallWork for TaskWork<E, T>
where
    TaskWork<E, T>: ElasticWork,
    E: Executable,
    T: Task<E>,
{
}

impl<F: Function> CallWork for FunctionWork<F> where FunctionWork<F>: ElasticWork {}

impl<W: CallWork> RestartWork for W {
    type Output = W::Output;
    /// A world of calls: every rank's result, or the first that failed.
    async fn run_world(
        &self,
        at: Launch<'_>,
        stop: impl Future<Output = Signal> + Send,
    ) -> Result<WorldEnd<W::Output>, ExecError> {
        tokio::pin!(stop);
        let mut ends = self.start(Launch { executor: &mut *at.executor, env: at.env, reports: at.reports }).await?;
        let workers = at.executor.workers();
        let mut results: Vec<Option<W::Output>> = workers.iter().map(|_| None).collect();
        let mut left = workers.len();
        let mut end = WorldEnd { results: Vec::new(), failure: None, interrupted_by: None, command: None };
        while left > 0 {
            tokio::select! {
                next = ends.recv() => {
                    let Some((rank, process_end)) = next else { break };
                    let host = workers.get(rank as usize).map(|w| w.node_id.clone()).unwrap_or_default();
                    let (lost, reason) = match process_end {
                        ProcessEnd::Succeeded(output) => {
                            if let Some(slot) = results.get_mut(rank as usize) {
                                if slot.replace(output).is_none() {
                                    left -= 1;
                                }
                            }
                            continue;
                        }
                        ProcessEnd::Failed(reason) => (false, reason),
                        ProcessEnd::Lost(reason) => (true, format!("was lost: {reason}")),
                    };
                    end.failure = Some(WorldFailure { rank, host, lost, reason });
                    break;
                }
                signal = &mut stop => {
                    end.interrupted_by = Some(signal);
                    break;
                }
            }
        }
        if left == 0 {
            end.results = results.into_iter().flatten().collect();
        }
        Ok(end)
    }
}

/// How a restarted job ended: its last world's end, and why it stopped.
#[derive(Debug)]
pub struct RestartOutcome<O> {
    /// How the last world that ran ended; none if no world ran.
    pub last: Option<WorldEnd<O>>,
    /// Membership's limits stopped it.
    pub stopped: Option<StopReason>,
    /// Interrupted by this signal.
    pub interrupted_by: Option<Signal>,
}

impl<O> RestartOutcome<O> {
    /// Whether the last world ran to the end with every rank succeeding,
    /// and nothing stopped or interrupted the job.
    pub fn succeeded(&self) -> bool {
        self.stopped.is_none()
            && self.interrupted_by.is_none()
            && self.last.as_ref().is_some_and(|l| l.failure.is_none() && l.interrupted_by.is_none())
    }
}

/// A job in restart mode; see the module docs.
pub struct RestartJob;

impl RestartJob {
    /// Runs `work` world after world until one succeeds, `interrupt`
    /// resolves, or membership says stop. `factory` makes each world's
    /// executor; `extra_env` goes to every rank; `on_event` hears what
    /// happens.
    pub async fn run<W: RestartWork>(
        work: &W,
        config: ElasticConfig,
        discovery: Discovery,
        factory: CohortFactory,
        extra_env: Vec<(String, String)>,
        mut on_event: impl FnMut(ElasticEvent) + Send,
        interrupt: impl Future<Output = Signal> + Send,
    ) -> Result<RestartOutcome<W::Output>, ExecError> {
        tokio::pin!(interrupt);
        let started = Instant::now();
        let mut config = config;
        config.fixed_hosts = discovery.is_fixed();
        let max_restarts = config.max_restarts.unwrap_or(0);
        let mut membership = Membership::new(config);
        let first = discovery.hosts().await?;
        let mut decision = membership.on(Event::Discovered(&first), started.elapsed());
        let mut last: Option<WorldEnd<W::Output>> = None;
        // what ranks report, as events (channel bounded: slow listeners hold ranks back)
        let (reports_tx, mut reports) = mpsc::channel::<Report>(kolo_exec::REPORTS_QUEUED);
        loop {
            for (host, duration) in membership.take_blacklisted_news(started.elapsed()) {
                on_event(ElasticEvent::Blacklisted { host, duration });
            }
            let world: World = match decision {
                Decision::Reform(world) => world,
                Decision::Stop(reason) => {
                    return Ok(RestartOutcome { last, stopped: Some(reason), interrupted_by: None });
                }
                Decision::Wait { available, needed, deadline, announce } => {
                    if announce {
                        let left = deadline.saturating_sub(started.elapsed());
                        on_event(ElasticEvent::Waiting { needed, available, left });
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(discovery.interval) => {}
                        signal = &mut interrupt => {
                            return Ok(RestartOutcome { last, stopped: None, interrupted_by: Some(signal) });
                        }
                    }
                    decision = discovery.poll(&mut membership, started.elapsed()).await;
                    continue;
                }
                Decision::Continue => {
                    decision = discovery.poll(&mut membership, started.elapsed()).await;
                    continue;
                }
            };
            let cohort = Cohort {
                hosts: world.host_specs(),
                np: world.size().into(),
                secret: kolo_exec::Settings::generate_secret(),
                first_process: 0,
                elastic: ElasticEnv::Restart { restarts: world.restarts, max_restarts },
                shared: None,
            };
            let (elastic, shared) = (cohort.elastic.clone(), cohort.shared.clone());
            let mut executor = factory(cohort).await?;
            executor.join_elastic(elastic, shared);
            let mut changed: Option<Decision> = None;
            let stop = async {
                let mut ticks = tokio::time::interval(discovery.interval);
                ticks.tick().await;
                loop {
                    tokio::select! {
                        signal = &mut interrupt => return signal,
                        _ = ticks.tick() => {
                            let decision = discovery.poll(&mut membership, started.elapsed()).await;
                            if decision != Decision::Continue {
                                changed = Some(decision);
                                return Signal::SIGTERM;
                            }
                        }
                    }
                }
            };
            let ended = {
                let run =
                    work.run_world(Launch { executor: &mut executor, env: &extra_env, reports: &reports_tx }, stop);
                tokio::pin!(run);
                // reports are heard while the world runs
                loop {
                    tokio::select! {
                        ended = &mut run => break ended,
                        Some(report) = reports.recv() => {
                            on_event(ElasticEvent::Reported { rank: Some(report.rank), data: report.data });
                        }
                    }
                }
            };
            executor.shutdown().await;
            while let Ok(report) = reports.try_recv() {
                on_event(ElasticEvent::Reported { rank: Some(report.rank), data: report.data });
            }
            let end = ended?;
            if let Some(next) = changed {
                on_event(ElasticEvent::Reforming { round: world.round + 1 });
                last = Some(end);
                decision = next;
                continue;
            }
            if let Some(signal) = end.interrupted_by {
                return Ok(RestartOutcome { last: Some(end), stopped: None, interrupted_by: Some(signal) });
            }
            let Some(failure) = &end.failure else {
                // every rank succeeded
                return Ok(RestartOutcome { last: Some(end), stopped: None, interrupted_by: None });
            };
            let event = match failure.lost {
                true => Event::HostLost(&failure.host),
                false => Event::RankFailed(&failure.host),
            };
            decision = membership.on(event, started.elapsed());
            if !matches!(decision, Decision::Stop(_)) {
                let (rank, host, reason) = (failure.rank, failure.host.clone(), failure.reason.clone());
                on_event(ElasticEvent::Restarting { rank, host, reason });
            }
            last = Some(end);
        }
    }
}
