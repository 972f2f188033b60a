//! Elastic jobs in place (Horovod's elastic mode), for commands (`kolo run
//! --in-place`) and for functions (the elastic Executor, in Rust and
//! Python). When a process fails, a host is lost or discovery adds hosts,
//! the processes that survive keep running: the driver starts a new round
//! on the rendezvous server (the store afresh, `rank_and_size` answering
//! each process's new ranks), the survivors' kolo-comm collectives end, and
//! they join it (`kolo_comm::elastic`) and go on from their last commit.
//!
//! Membership has Horovod's rule here: a host where a process failed is
//! blacklisted at once (for good, or for its cooldown), so failures cannot
//! loop. Which processes are in which round is `rounds`' bookkeeping; this
//! actor feeds it events and carries out its actions. Processes are
//! started in cohorts, one executor each (the first one's rendezvous
//! server is the job's); they share the job's secret, store, id and
//! interfaces.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kolo_topology::{host_assignments, Decision, ElasticConfig, ElasticEnv, Event, HostSpec, Membership, World};
use nix::sys::signal::Signal;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::rounds::{Action, End, Ended as ProcEnded, Rounds};
use super::work::{BoxFuture, Ends, Launch, ProcessEnd};
use super::{Discovery, ElasticEvent, ElasticWork};
use kolo_engine::ExecError;
use kolo_exec::{Executor, Report, SharedJob};

/// How much longer than the elastic timeout a process waits for a round.
const PROCESS_WAIT_GRACE_S: u64 = 10;

/// What a cohort's (or a restarted world's) executor is made for.
#[derive(Clone, Debug)]
pub struct Cohort {
    /// The hosts its processes start on, with their slots.
    pub hosts: Vec<HostSpec>,
    /// Processes (the hosts' slots).
    pub np: u64,
    /// The job's secret: every cohort's workers share it.
    pub secret: String,
    /// Processes started before this cohort: its output labels follow
    /// theirs (`OutputOptions::first_label`).
    pub first_process: usize,
    /// What its processes are told of the job (the round they start for,
    /// or the restarts so far); the elastic job gives it, with `shared`, to
    /// the executor the factory makes (`Executor::join_elastic`).
    pub elastic: ElasticEnv,
    /// For every cohort after the first, the job's store, id and
    /// interfaces, taken from the first cohort's executor; `None` for the
    /// first cohort and in restart mode.
    pub shared: Option<SharedJob>,
}

/// Makes an executor for a cohort.
pub type CohortFactory = Arc<dyn Fn(Cohort) -> BoxFuture<'static, Result<Executor, ExecError>> + Send + Sync>;

/// How an elastic job ended.
#[derive(Debug)]
pub struct ElasticOutcome<O> {
    /// The last round's members' results, in rank order (those that
    /// succeeded).
    pub results: Vec<O>,
    /// Why membership stopped the job, if it did.
    pub stopped: Option<StopCause>,
    /// Interrupted by this signal.
    pub interrupted_by: Option<Signal>,
}

/// Why an elastic job stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopCause {
    /// Membership's limits (spelled by the front end).
    Limit(kolo_topology::StopReason),
    /// A process the job was finishing with failed.
    FailedWhileFinishing {
        /// The host it ran on.
        host: String,
        /// What happened, worded to follow "a process on host H".
        reason: String,
    },
}

impl StopCause {
    /// The cause's kind: the limit's (`StopReason::kind`), or
    /// `failed_while_finishing`.
    pub fn kind(&self) -> &'static str {
        match self {
            StopCause::Limit(reason) => reason.kind(),
            StopCause::FailedWhileFinishing { .. } => "failed_while_finishing",
        }
    }

    /// Why the job stopped, naming the limits as the user gave them.
    pub fn explain(&self, names: &crate::OptionNames) -> String {
        match self {
            StopCause::Limit(reason) => names.explain(reason),
            StopCause::FailedWhileFinishing { host, reason } => {
                format!("a process on host {host} {reason} while the job was finishing")
            }
        }
    }
}

impl<O> ElasticOutcome<O> {
    /// Whether the job ended on its own: neither stopped by membership nor
    /// interrupted.
    pub fn succeeded(&self) -> bool {
        self.stopped.is_none() && self.interrupted_by.is_none()
    }
}

/// A cohort that came up: its executor, each rank's (host, local rank),
/// and its processes' ends.
struct Started<O> {
    executor: Executor,
    procs: Vec<(String, u32)>,
    ends: Ends<O>,
}

/// How often the store is looked at for processes that joined the
/// current round (a map lookup per member not yet heard of).
const JOIN_LOOK: Duration = Duration::from_millis(50);

type Spawning<O> = Option<JoinHandle<Result<Started<O>, ExecError>>>;

/// An elastic job in place: see the module docs.
pub struct ElasticJob<W: ElasticWork> {
    work: Arc<W>,
    factory: CohortFactory,
    discovery: Discovery,
    extra_env: Vec<(String, String)>,
    secret: String,
    cohorts: Vec<Executor>,
    rounds: Rounds,
    /// Results of the processes that succeeded, by process.
    results: std::collections::HashMap<usize, W::Output>,
    ends: mpsc::UnboundedSender<(usize, u32, ProcessEnd<W::Output>)>,
    /// What processes report, with their cohort.
    reports: Option<mpsc::Sender<(usize, Report)>>,
    spawning: Spawning<W::Output>,
    membership: Membership,
    started: Instant,
    on_event: Box<dyn FnMut(ElasticEvent) + Send>,
    /// Processes told to have joined the current round (`Joined`).
    joined_told: std::collections::HashSet<(u64, usize)>,
}

enum Ended {
    Done,
    Stopped(StopCause),
    Interrupted(Signal),
}

impl<W: ElasticWork> ElasticJob<W> {
    /// Runs `work` in place until every member of the last round that came
    /// together has succeeded, `interrupt` resolves, or membership says
    /// stop. `factory` makes each cohort's executor; `extra_env` goes to
    /// every process; `on_event` hears what happens.
    pub async fn run(
        work: W,
        config: ElasticConfig,
        discovery: Discovery,
        factory: CohortFactory,
        extra_env: Vec<(String, String)>,
        on_event: impl FnMut(ElasticEvent) + Send + 'static,
        interrupt: impl Future<Output = Signal>,
    ) -> Result<ElasticOutcome<W::Output>, ExecError> {
        tokio::pin!(interrupt);
        let (ends_tx, mut ends) = mpsc::unbounded_channel();
        // bounded: a listener slower than the reports holds the processes back
        let (reports_tx, mut reports) = mpsc::channel(kolo_exec::REPORTS_QUEUED);
        // in place nothing else bounds failures: Horovod's rule
        let mut config = config;
        config.blacklist_failed_hosts = true;
        config.fixed_hosts = discovery.is_fixed();
        let mut job = ElasticJob {
            work: Arc::new(work),
            factory,
            discovery,
            extra_env,
            secret: kolo_exec::Settings::generate_secret(),
            membership: Membership::new(config),
            cohorts: Vec::new(),
            rounds: Rounds::default(),
            results: Default::default(),
            ends: ends_tx,
            reports: Some(reports_tx),
            spawning: None,
            started: Instant::now(),
            on_event: Box::new(on_event),
            joined_told: Default::default(),
        };
        let first = job.discovery.hosts().await?;
        let decision = job.membership.on(Event::Discovered(&first), job.started.elapsed());
        let mut ended = job.apply(decision).await;
        // discovery runs beside the job: a slow script or object (one that
        // waits for the job's processes, as horovod.ray's tests' does)
        // never holds back what the job hears meanwhile
        let mut discovered = job.discovery.watch();
        let mut ticks = tokio::time::interval(job.discovery.interval);
        ticks.tick().await;
        let mut join_looks = tokio::time::interval(JOIN_LOOK);
        while ended.is_none() {
            ended = tokio::select! {
                Some((cohort, rank, end)) = ends.recv() => job.on_end(cohort, rank, end).await,
                Some((cohort, report)) = reports.recv() => {
                    job.tell_report(cohort, report);
                    None
                }
                spawned = spawn_done(&mut job.spawning) => job.on_spawned(spawned).await,
                Some(found) = discovered.recv() => {
                    let decision = Discovery::decide(found, &mut job.membership, job.started.elapsed());
                    job.apply(decision).await
                }
                _ = join_looks.tick() => {
                    job.tell_joins();
                    None
                }
                _ = ticks.tick() => {
                    let decision = job.membership.on(Event::Tick, job.started.elapsed());
                    job.apply(decision).await
                }
                signal = &mut interrupt => Some(Ended::Interrupted(signal)),
            };
        }
        job.shutdown().await;
        // what processes reported before they ended is not lost: with the
        // cohorts gone, their senders go and the channel closes (bounded,
        // should a sender linger)
        job.reports = None;
        let drain = async {
            while let Some((cohort, report)) = reports.recv().await {
                job.tell_report(cohort, report);
            }
        };
        let _ = tokio::time::timeout(REPORT_DRAIN, drain).await;
        let outcome = match ended.expect("the loop ends with an outcome") {
            Ended::Done => {
                let results = job.rounds.finals().iter().filter_map(|p| job.results.remove(p)).collect();
                ElasticOutcome { results, stopped: None, interrupted_by: None }
            }
            Ended::Stopped(cause) => ElasticOutcome { results: Vec::new(), stopped: Some(cause), interrupted_by: None },
            Ended::Interrupted(signal) => {
                ElasticOutcome { results: Vec::new(), stopped: None, interrupted_by: Some(signal) }
            }
        };
        Ok(outcome)
    }

    /// Tells which members of the current round have joined it since the
    /// last look, from what they recorded on the job's store.
    fn tell_joins(&mut self) {
        let Some(server) = self.cohorts.first().and_then(|c| c.rendezvous_server()) else { return };
        let round = self.rounds.next_round().saturating_sub(1);
        let mut joined = Vec::new();
        for &p in self.rounds.members() {
            let proc = &self.rounds.procs()[p];
            if self.joined_told.contains(&(round, p)) {
                continue;
            }
            let key = format!("{}:{}", proc.host, proc.local_rank);
            let value = server.value(kolo_rendezvous::elastic::JOINED_SCOPE, &key);
            let in_round = value.and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<u64>().ok());
            if in_round == Some(round) {
                joined.push((p, proc.host.clone(), proc.local_rank));
            }
        }
        for (p, host, local_rank) in joined {
            self.joined_told.insert((round, p));
            self.tell(ElasticEvent::Joined { round, host, local_rank });
        }
    }

    /// Tells what a cohort's process reported, with its rank in the last
    /// round (if it has one).
    fn tell_report(&mut self, cohort: usize, report: Report) {
        // a process joins its round before it reports in it: what the
        // listener hears keeps that order, whatever the next look's timing
        self.tell_joins();
        let rank = self.rounds.find(cohort, report.rank).and_then(|p| self.rounds.round_rank(p));
        self.tell(ElasticEvent::Reported { rank, data: report.data });
    }

    fn tell(&mut self, event: ElasticEvent) {
        (self.on_event)(event);
    }

    async fn apply(&mut self, decision: Decision) -> Option<Ended> {
        self.announce_blacklist();
        match decision {
            Decision::Continue => None,
            Decision::Reform(world) => {
                // the joins of the round that ends are told before it ends
                self.tell_joins();
                self.reform(&world.hosts).await;
                None
            }
            Decision::Wait { available, needed, deadline, announce } => {
                if announce {
                    let left = deadline.saturating_sub(self.started.elapsed());
                    self.tell(ElasticEvent::Waiting { needed, available, left });
                }
                None
            }
            Decision::Stop(reason) => Some(Ended::Stopped(StopCause::Limit(reason))),
        }
    }

    /// Says which hosts were newly left out, and for how long.
    fn announce_blacklist(&mut self) {
        for (host, duration) in self.membership.take_blacklisted_news(self.started.elapsed()) {
            self.tell(ElasticEvent::Blacklisted { host, duration });
        }
    }

    async fn reform(&mut self, world: &[(String, u32)]) {
        let actions = self.rounds.reform(world, self.membership.config().min_np);
        self.carry_out(actions).await;
    }

    async fn carry_out(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Publish { round, members, hosts } => self.publish(round, members.len() as u64, hosts),
                Action::Remove(p) => {
                    // its `rank_and_size` says so already; ending it tells it
                    let proc = &self.rounds.procs()[p];
                    if let Some(executor) = self.cohorts.get(proc.cohort) {
                        executor.stop_rank(proc.rank).await;
                    }
                }
                Action::StartCohort { hosts, round } => self.start_cohort(hosts, round),
            }
        }
    }

    /// Starts round `round` on the store: `np` processes on `hosts`.
    fn publish(&mut self, round: u64, np: u64, hosts: Vec<HostSpec>) {
        let Some(server) = self.cohorts.first().and_then(|c| c.rendezvous_server()) else { return };
        match host_assignments(&hosts, np, Some(np)) {
            Ok(slots) => server.set_round(round, &slots),
            Err(e) => {
                tracing::error!("cannot assign ranks for round {round}: {e}");
                return;
            }
        }
        self.tell(ElasticEvent::Round { round, hosts: hosts.into_iter().map(|h| (h.name, h.slots)).collect() });
    }

    fn start_cohort(&mut self, hosts: Vec<(String, u32)>, round: u64) {
        let specs: Vec<HostSpec> = hosts.iter().map(|(name, slots)| HostSpec::new(name.clone(), *slots)).collect();
        let np: u64 = hosts.iter().map(|(_, s)| u64::from(*s)).sum();
        let names: Vec<String> = hosts.iter().map(|(h, _)| h.clone()).collect();
        if !self.cohorts.is_empty() {
            self.tell(ElasticEvent::Starting { hosts: names });
        }
        let (factory, work, extra) = (self.factory.clone(), self.work.clone(), self.extra_env.clone());
        let job_reports = self.reports.clone();
        // cohorts start one at a time and take the next index if they come up
        let index = self.cohorts.len();
        let (reports, mut cohort_reports) = mpsc::channel(kolo_exec::REPORTS_QUEUED);
        tokio::spawn(async move {
            let Some(job_reports) = job_reports else { return };
            while let Some(report) = cohort_reports.recv().await {
                if job_reports.send((index, report)).await.is_err() {
                    return;
                }
            }
        });
        // a process waits for its next round the job's elastic timeout and
        // a grace more: the driver decides (a timeout stops the job, saying
        // so) before a waiting process gives up and exits as a failure;
        // the process's own limit is for a driver that is gone
        let timeout_s = self.membership.config().elastic_timeout.as_secs().max(1) + PROCESS_WAIT_GRACE_S;
        // the round's hosts: the processes start with their ranks in it
        let world = self.membership.world().filter(|w| u64::from(w.round) == round).map(World::host_specs);
        let world = world.unwrap_or_default();
        let cohort = Cohort {
            hosts: specs,
            np,
            secret: self.secret.clone(),
            first_process: self.rounds.procs().len(),
            elastic: ElasticEnv::InPlace { round, timeout_s, world },
            shared: self.cohorts.first().and_then(Executor::shared_job),
        };
        let handle = tokio::spawn(async move {
            let (elastic, shared) = (cohort.elastic.clone(), cohort.shared.clone());
            let mut executor = factory(cohort).await?;
            executor.join_elastic(elastic, shared);
            let ends = match work.start(Launch { executor: &mut executor, env: &extra, reports: &reports }).await {
                Ok(ends) => ends,
                Err(e) => {
                    executor.shutdown().await;
                    return Err(e);
                }
            };
            let procs = executor.workers().iter().map(|w| (w.node_id.clone(), w.ranks.local_rank)).collect();
            Ok(Started { executor, procs, ends })
        });
        self.spawning = Some(handle);
    }

    async fn on_spawned(&mut self, spawned: Result<Started<W::Output>, ExecError>) -> Option<Ended> {
        let hosts = self.rounds.spawning().map(<[String]>::to_vec).unwrap_or_default();
        match spawned {
            Ok(Started { executor, procs, mut ends }) => {
                let cohort = self.cohorts.len();
                let forward = self.ends.clone();
                tokio::spawn(async move {
                    while let Some((rank, end)) = ends.recv().await {
                        if forward.send((cohort, rank, end)).is_err() {
                            return;
                        }
                    }
                });
                self.cohorts.push(executor);
                let actions = self.rounds.cohort_started(procs);
                self.carry_out(actions).await;
            }
            Err(e) => {
                self.rounds.cohort_failed();
                // a start that failed on some hosts costs only those;
                // otherwise every host of the cohort
                let named: Vec<String> = e.hosts().into_iter().filter(|h| hosts.contains(h)).collect();
                let hosts = if named.is_empty() { hosts } else { named };
                let mut decision = Decision::Continue;
                for host in &hosts {
                    let reason = format!("could not start: {e}");
                    self.tell(ElasticEvent::Failed { rank: None, host: host.clone(), reason });
                    decision = self.membership.on(Event::HostLost(host), self.started.elapsed());
                    if matches!(decision, Decision::Stop(_)) {
                        break;
                    }
                }
                return self.apply(decision).await;
            }
        }
        // the world as membership sees it now (hosts may have gone meanwhile)
        match self.membership.on(Event::Tick, self.started.elapsed()) {
            Decision::Continue => match self.membership.world().cloned() {
                Some(world) => {
                    self.reform(&world.hosts).await;
                    None
                }
                None => None,
            },
            other => self.apply(other).await,
        }
    }

    async fn on_end(&mut self, cohort: usize, rank: u32, end: ProcessEnd<W::Output>) -> Option<Ended> {
        // a process that joined and then ended was still heard to join
        self.tell_joins();
        let p = self.rounds.find(cohort, rank)?;
        let server = self.cohorts.first().and_then(|c| c.rendezvous_server());
        // the round each process last joined, as it recorded on the store
        let joined = |proc: &super::rounds::Proc| -> Option<u64> {
            let key = format!("{}:{}", proc.host, proc.local_rank);
            let value = server?.value(kolo_rendezvous::elastic::JOINED_SCOPE, &key)?;
            std::str::from_utf8(&value).ok()?.trim().parse().ok()
        };
        let (kind, reason, output) = match end {
            ProcessEnd::Succeeded(output) => (End::Succeeded, String::new(), Some(output)),
            ProcessEnd::Failed(reason) => (End::Failed, reason, None),
            ProcessEnd::Lost(reason) => (End::Lost, format!("was lost: {reason}"), None),
        };
        let running = self.rounds.procs()[p].life == super::rounds::Life::Running;
        if let (Some(output), true) = (output, running) {
            self.results.insert(p, output);
        }
        let host = self.rounds.procs()[p].host.clone();
        match self.rounds.ended(p, kind, joined) {
            ProcEnded::Nothing => None,
            ProcEnded::Done => Some(Ended::Done),
            ProcEnded::FailedWhileFinishing => Some(Ended::Stopped(StopCause::FailedWhileFinishing { host, reason })),
            ProcEnded::Failed { host, rank, lost } => {
                self.tell(ElasticEvent::Failed { rank, host: host.clone(), reason });
                let event = if lost { Event::HostLost(&host) } else { Event::RankFailed(&host) };
                let decision = self.membership.on(event, self.started.elapsed());
                self.apply(decision).await
            }
        }
    }

    async fn shutdown(&mut self) {
        if let Some(handle) = self.spawning.take() {
            // dropping its executor kills what it started
            handle.abort();
            let _ = handle.await;
        }
        // the first cohort serves the store: it goes last
        while let Some(mut executor) = self.cohorts.pop() {
            executor.shutdown().await;
        }
    }
}

/// How long reports still queued when the job ends may take to be heard.
const REPORT_DRAIN: Duration = Duration::from_secs(2);

async fn spawn_done<O>(spawning: &mut Spawning<O>) -> Result<Started<O>, ExecError> {
    let Some(handle) = spawning.as_mut() else { return std::future::pending().await };
    let result = match handle.await {
        Ok(result) => result,
        Err(e) => Err(ExecError::Io { what: "starting processes".into(), source: std::io::Error::other(e) }),
    };
    *spawning = None;
    result
}
