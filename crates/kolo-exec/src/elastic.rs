//! Elastic jobs in place (Horovod's elastic mode), for commands (`kolo run
//! --in-place`) and for functions (the elastic Executor, in Rust and
//! Python). When a process fails, a host is lost or discovery adds hosts,
//! the processes that survive keep running: the driver starts a new round
//! on the rendezvous server (the store afresh, `rank_and_size` answering
//! each process's new ranks), the survivors' kolo-comm collectives end, and
//! they join it (`kolo_comm::elastic`) and go on from their last commit.
//!
//! Membership (limits, blacklisting, cooldowns, timeouts) is kolo-topology's
//! `Membership`, with Horovod's rule: a host where a process failed is
//! blacklisted at once (for good, or for its cooldown), so failures cannot
//! loop. A host is in a round with all the processes last started there,
//! or not at all: the others there are removed; a host back from its
//! cooldown, like an added host, gets a fresh set of processes, which
//! joins a later round (at the survivors' next commit). Processes are started in
//! cohorts, one executor each (the first one's rendezvous server is the
//! job's); they share the job's secret, store and interfaces.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kolo_topology::{host_assignments, parse_discovery, Decision, ElasticConfig, Event, HostSpec, Membership, World};
use nix::sys::signal::Signal;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::policy::Cause;
use crate::proto::CallKind;
use crate::registry::{Executable, Function, Task};
use crate::{ExecError, Executor, Report};

/// Variables kolo-comm's elastic API reads (`kolo_comm::elastic`).
pub const ENV_ROUND: &str = "KOLO_ELASTIC_ROUND";
pub const ENV_TIMEOUT: &str = "KOLO_ELASTIC_TIMEOUT_SECONDS";

/// Variables a later cohort takes from the first, so that all processes
/// meet on one store, as one job, over the same interfaces.
const SHARED_VARS: &[&str] = &[
    "KOLO_RENDEZVOUS_ADDR",
    "KOLO_RENDEZVOUS_PORT",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_GLOO_RENDEZVOUS_PORT",
    "KOLO_JOB_ID",
    "KOLO_IFACES",
    "HOROVOD_GLOO_IFACE",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
];

/// The longest a discovery script may run.
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// Hosts from a source other than a script or a list (a Ray cluster's
/// nodes: `RayNodes`). Blocking: called off the runtime.
pub trait HostSource: Send + Sync + std::fmt::Debug {
    fn hosts(&self) -> Result<Vec<HostSpec>, ExecError>;
}

/// Where the hosts come from and how often to ask.
#[derive(Clone, Debug)]
pub struct Discovery {
    /// A script printing `host[:slots]` lines; none: `source`, else `fixed`.
    pub script: Option<PathBuf>,
    pub source: Option<Arc<dyn HostSource>>,
    pub fixed: Vec<HostSpec>,
    pub interval: Duration,
    /// Slots of a host the script prints without `:slots`.
    pub slots_per_host: u32,
}

impl Discovery {
    /// A fixed host list, looked at every second.
    pub fn fixed(hosts: Vec<HostSpec>) -> Discovery {
        Discovery { script: None, source: None, fixed: hosts, interval: Duration::from_secs(1), slots_per_host: 1 }
    }

    /// Whether the hosts never change (a fixed list).
    pub fn is_fixed(&self) -> bool {
        self.script.is_none() && self.source.is_none()
    }

    /// Asks the script or source once: its hosts, or why not.
    pub async fn hosts(&self) -> Result<Vec<HostSpec>, ExecError> {
        if let (None, Some(source)) = (&self.script, &self.source) {
            let source = source.clone();
            return tokio::task::spawn_blocking(move || source.hosts())
                .await
                .map_err(|e| ExecError::BadSettings(format!("host discovery: {e}")))?;
        }
        let Some(script) = &self.script else { return Ok(self.fixed.clone()) };
        let bad = |what: String| ExecError::BadSettings(format!("host discovery script {}: {what}", script.display()));
        let run = tokio::process::Command::new(script).kill_on_drop(true).output();
        let out = tokio::time::timeout(DISCOVERY_TIMEOUT, run)
            .await
            .map_err(|_| bad(format!("ran longer than {DISCOVERY_TIMEOUT:?}")))?
            .map_err(|e| {
                ExecError::BadSettings(format!(
                    "cannot run host discovery script {} (is it executable?): {e}",
                    script.display()
                ))
            })?;
        if !out.status.success() {
            return Err(bad(format!("failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim())));
        }
        let text = String::from_utf8(out.stdout).map_err(|_| bad("printed something not UTF-8".into()))?;
        parse_discovery(&text, self.slots_per_host).map_err(|e| bad(e.to_string()))
    }

    /// Asks again and tells `membership`; a failing script keeps the last
    /// hosts (and says so).
    pub async fn poll(&self, membership: &mut Membership, now: Duration) -> Decision {
        match self.hosts().await {
            Ok(hosts) => membership.on(Event::Discovered(&hosts), now),
            Err(e) => {
                tracing::warn!("{e}; keeping the hosts discovered before");
                membership.on(Event::Tick, now)
            }
        }
    }
}

/// What the driver of an elastic job tells its caller as it goes.
#[derive(Clone, Debug, PartialEq)]
pub enum ElasticEvent {
    /// Round `round` started with these hosts and processes per host, in
    /// rank order.
    Round { round: u64, hosts: Vec<(String, u32)> },
    /// A process failed (`rank` in the current round, if it had one).
    Failed { rank: Option<u32>, host: String, reason: String },
    /// A host is left out (`None`: for the rest of the job).
    Blacklisted { host: String, duration: Option<Duration> },
    /// New processes are starting on these hosts.
    Starting { hosts: Vec<String> },
    /// Not enough slots; the job waits up to `left` for them.
    Waiting { needed: u32, available: u32, left: Duration },
    /// A process reported a value (`WorkerContext::report`), as it sent it
    /// (`rank`: its rank in the current round, if it has one).
    Reported { rank: Option<u32>, data: Vec<u8> },
}

impl ElasticEvent {
    /// A reported value, as `WorkerContext::report` sent it; None for
    /// other events.
    pub fn reported<T: DeserializeOwned>(&self) -> Option<Result<T, postcard::Error>> {
        match self {
            ElasticEvent::Reported { data, .. } => Some(postcard::from_bytes(data)),
            _ => None,
        }
    }
}

impl std::fmt::Display for ElasticEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ElasticEvent::Round { round, hosts } => {
                let n: u32 = hosts.iter().map(|(_, n)| n).sum();
                let names: Vec<String> = hosts.iter().map(|(h, n)| format!("{h}:{n}")).collect();
                let processes = if n == 1 { "process" } else { "processes" };
                write!(f, "round {round}: {n} {processes} on {}", names.join(","))
            }
            ElasticEvent::Failed { rank: Some(rank), host, reason } => write!(f, "rank {rank} on host {host} {reason}"),
            ElasticEvent::Failed { rank: None, host, reason } => {
                write!(f, "a process starting on host {host} {reason}")
            }
            ElasticEvent::Blacklisted { host, duration: Some(d) } => {
                let precision = if d.as_secs() < 10 { 1 } else { 0 };
                write!(f, "host {host} is blacklisted for {:.*} s", precision, d.as_secs_f64())
            }
            ElasticEvent::Blacklisted { host, duration: None } => {
                write!(f, "host {host} is blacklisted for the rest of the job")
            }
            ElasticEvent::Starting { hosts } => write!(f, "starting processes on {}", hosts.join(",")),
            ElasticEvent::Waiting { needed, available, left } => {
                write!(f, "waiting for {needed} slots, {available} available; up to {:.0} s more", left.as_secs_f64())
            }
            ElasticEvent::Reported { rank: Some(rank), data } => write!(f, "rank {rank} reported {} bytes", data.len()),
            ElasticEvent::Reported { rank: None, data } => write!(f, "a process reported {} bytes", data.len()),
        }
    }
}

/// How one process of a cohort ended.
pub enum ProcessEnd<O> {
    Succeeded(O),
    /// Failed: why, as "exited with code 3" or the error.
    Failed(String),
    /// Its worker was lost (the host is gone).
    Lost(String),
}

/// A cohort's processes ending, by rank in the cohort.
pub type Ends<O> = mpsc::UnboundedReceiver<(u32, ProcessEnd<O>)>;

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What every process of an elastic job runs: started in each cohort's
/// executor, its processes' ends reported.
pub trait ElasticWork: Send + Sync + 'static {
    type Output: Send + 'static;
    /// Starts the work; what its processes report (`WorkerContext::report`)
    /// goes to `reports`.
    fn start<'a>(
        &'a self,
        executor: &'a mut Executor,
        env: &'a [(String, String)],
        reports: &'a mpsc::Sender<Report>,
    ) -> BoxFuture<'a, Result<Ends<Self::Output>, ExecError>>;
}

/// An OS command in every process (`kolo run --in-place`).
pub struct CommandWork {
    pub argv: Vec<std::ffi::OsString>,
}

impl ElasticWork for CommandWork {
    type Output = ();
    fn start<'a>(
        &'a self,
        executor: &'a mut Executor,
        env: &'a [(String, String)],
        _reports: &'a mpsc::Sender<Report>,
    ) -> BoxFuture<'a, Result<Ends<()>, ExecError>> {
        Box::pin(async move {
            executor.start_command(&self.argv, env).await?;
            let mut events = executor.take_rank_events().ok_or(ExecError::NotStarted)?;
            let (tx, ends) = mpsc::unbounded_channel();
            tokio::spawn(async move {
                while let Some(event) = events.recv().await {
                    let end = match event.cause {
                        Cause::Exited { code: Some(0), .. } => ProcessEnd::Succeeded(()),
                        Cause::Lost(reason) => ProcessEnd::Lost(reason),
                        other => ProcessEnd::Failed(other.to_string()),
                    };
                    if tx.send((event.rank, end)).is_err() {
                        return;
                    }
                }
            });
            Ok(ends)
        })
    }
}

/// A task on an executable `E` created in every process from `args`
/// (RayExecutor's `start(executable_cls)` then `execute`).
pub struct TaskWork<E: Executable, T: Task<E>> {
    pub args: E::Args,
    pub task: T,
}

impl<E, T> ElasticWork for TaskWork<E, T>
where
    E: Executable,
    E::Args: Send + Sync,
    T: Task<E> + Send + Sync + 'static,
    T::Output: DeserializeOwned + Send + 'static,
{
    type Output = T::Output;
    fn start<'a>(
        &'a self,
        executor: &'a mut Executor,
        env: &'a [(String, String)],
        reports: &'a mpsc::Sender<Report>,
    ) -> BoxFuture<'a, Result<Ends<T::Output>, ExecError>> {
        Box::pin(async move {
            executor.start::<E>(&self.args, env).await?;
            let handles = executor.call_all(CallKind::Task, T::NAME, &self.task, None, Some(reports)).await?;
            Ok(ends_of(handles))
        })
    }
}

/// A plain function in every process (`run`).
pub struct FunctionWork<F: Function> {
    pub function: F,
}

impl<F> ElasticWork for FunctionWork<F>
where
    F: Function + Send + Sync + 'static,
    F::Output: DeserializeOwned + Send + 'static,
{
    type Output = F::Output;
    fn start<'a>(
        &'a self,
        executor: &'a mut Executor,
        env: &'a [(String, String)],
        reports: &'a mpsc::Sender<Report>,
    ) -> BoxFuture<'a, Result<Ends<F::Output>, ExecError>> {
        Box::pin(async move {
            executor.start_workers(env).await?;
            let handles = executor.call_all(CallKind::Function, F::NAME, &self.function, None, Some(reports)).await?;
            Ok(ends_of(handles))
        })
    }
}

fn ends_of<O: DeserializeOwned + Send + 'static>(handles: Vec<crate::CallHandle<O>>) -> Ends<O> {
    let (tx, ends) = mpsc::unbounded_channel();
    for handle in handles {
        let tx = tx.clone();
        tokio::spawn(async move {
            let rank = handle.rank();
            let end = match handle.join().await {
                Ok(output) => ProcessEnd::Succeeded(output),
                Err(ExecError::WorkerLost { reason, .. }) => ProcessEnd::Lost(reason),
                Err(ExecError::Task { message, .. }) => ProcessEnd::Failed(format!("raised {message}")),
                Err(e) => ProcessEnd::Failed(e.to_string()),
            };
            let _ = tx.send((rank, end));
        });
    }
    ends
}

/// What a cohort's executor is made for.
#[derive(Clone, Debug)]
pub struct Cohort {
    pub hosts: Vec<HostSpec>,
    /// Processes (the hosts' slots).
    pub np: u64,
    /// The job's secret: every cohort's workers share it.
    pub secret: String,
    /// Processes started before this cohort: its output labels follow
    /// theirs (`OutputOptions::first_label`).
    pub first_process: usize,
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
    pub stopped: Option<String>,
    /// Interrupted by this signal.
    pub interrupted_by: Option<Signal>,
}

impl<O> ElasticOutcome<O> {
    pub fn succeeded(&self) -> bool {
        self.stopped.is_none() && self.interrupted_by.is_none()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    Running,
    Succeeded,
    Failed,
    /// Left out of the rounds and told to stop.
    Removed,
}

struct Proc {
    cohort: usize,
    /// Its rank in its cohort (the executor's numbering).
    rank: u32,
    /// Its host as the plan names it (`HOROVOD_HOSTNAME`).
    host: String,
    /// The local rank it was started with: with the host, its name in
    /// `rank_and_size`.
    local_rank: u32,
    life: Life,
}

/// A cohort that came up: its executor, each rank's (host, local rank),
/// and its processes' ends.
struct Started<O> {
    executor: Executor,
    procs: Vec<(String, u32)>,
    ends: Ends<O>,
}

type Spawning<O> = Option<(JoinHandle<Result<Started<O>, ExecError>>, Vec<String>)>;

/// An elastic job in place: see the module docs.
pub struct ElasticJob<W: ElasticWork> {
    work: Arc<W>,
    factory: CohortFactory,
    discovery: Discovery,
    extra_env: Vec<(String, String)>,
    secret: String,
    cohorts: Vec<Executor>,
    procs: Vec<Proc>,
    results: HashMap<usize, W::Output>,
    /// Each host's processes of the cohort that last started there.
    generation: HashMap<String, Vec<usize>>,
    /// Members of every round published, by round, in rank order.
    rounds: Vec<Vec<usize>>,
    /// Once a process has succeeded: the members of the last round that
    /// came together, whose end ends the job.
    finishing: Option<Vec<usize>>,
    ends: mpsc::UnboundedSender<(usize, u32, ProcessEnd<W::Output>)>,
    /// What processes report, with their cohort.
    reports: Option<mpsc::Sender<(usize, Report)>>,
    spawning: Spawning<W::Output>,
    membership: Membership,
    started: Instant,
    on_event: Box<dyn FnMut(ElasticEvent) + Send>,
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
        let (reports_tx, mut reports) = mpsc::channel(crate::driver::calls::REPORTS_QUEUED);
        // in place nothing else bounds failures: Horovod's rule
        let mut config = config;
        config.blacklist_failed_hosts = true;
        config.fixed_hosts = discovery.is_fixed();
        let mut job = ElasticJob {
            work: Arc::new(work),
            factory,
            discovery,
            extra_env,
            secret: crate::Settings::generate_secret(),
            membership: Membership::new(config),
            cohorts: Vec::new(),
            procs: Vec::new(),
            results: HashMap::new(),
            generation: HashMap::new(),
            rounds: Vec::new(),
            finishing: None,
            ends: ends_tx,
            reports: Some(reports_tx),
            spawning: None,
            started: Instant::now(),
            on_event: Box::new(on_event),
        };
        let first = job.discovery.hosts().await?;
        let decision = job.membership.on(Event::Discovered(&first), job.started.elapsed());
        let mut ended = job.apply(decision).await;
        let mut ticks = tokio::time::interval(job.discovery.interval);
        ticks.tick().await;
        while ended.is_none() {
            ended = tokio::select! {
                Some((cohort, rank, end)) = ends.recv() => job.on_end(cohort, rank, end).await,
                Some((cohort, report)) = reports.recv() => {
                    job.tell_report(cohort, report);
                    None
                }
                spawned = spawn_done(&mut job.spawning) => job.on_spawned(spawned).await,
                _ = ticks.tick() => {
                    let decision = job.discovery.poll(&mut job.membership, job.started.elapsed()).await;
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
        let _ = tokio::time::timeout(Duration::from_secs(2), drain).await;
        let outcome = match ended.expect("the loop ends with an outcome") {
            Ended::Done => {
                let finals = job.finishing.clone().unwrap_or_default();
                let results = finals.iter().filter_map(|p| job.results.remove(p)).collect();
                ElasticOutcome { results, stopped: None, interrupted_by: None }
            }
            Ended::Stopped(reason) => {
                ElasticOutcome { results: Vec::new(), stopped: Some(reason), interrupted_by: None }
            }
            Ended::Interrupted(signal) => {
                ElasticOutcome { results: Vec::new(), stopped: None, interrupted_by: Some(signal) }
            }
        };
        Ok(outcome)
    }

    /// Tells what a cohort's process reported, with its rank in the last
    /// round (if it has one).
    fn tell_report(&mut self, cohort: usize, report: Report) {
        let p = self.procs.iter().position(|p| p.cohort == cohort && p.rank == report.rank);
        let rank = p.and_then(|p| self.members().iter().position(|&m| m == p)).and_then(|r| u32::try_from(r).ok());
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
                self.reform(&world).await;
                None
            }
            Decision::Wait { available, needed, deadline, announce } => {
                if announce {
                    let left = deadline.saturating_sub(self.started.elapsed());
                    self.tell(ElasticEvent::Waiting { needed, available, left });
                }
                None
            }
            Decision::Stop(reason) => Some(Ended::Stopped(reason.explain(&self.membership.config().names))),
        }
    }

    /// Says which hosts were newly left out, and for how long.
    fn announce_blacklist(&mut self) {
        for (host, duration) in self.membership.take_blacklisted_news(self.started.elapsed()) {
            self.tell(ElasticEvent::Blacklisted { host, duration });
        }
    }

    /// Makes the next round from `world`: hosts whose processes all run
    /// keep them; the others get new processes (a cohort), which join a
    /// later round. The round is published at once if it has enough
    /// processes, so survivors go on while new ones start.
    async fn reform(&mut self, world: &World) {
        if self.finishing.is_some() {
            return;
        }
        let mut members = Vec::new();
        let mut to_start = Vec::new();
        for (host, slots) in &world.hosts {
            match self.generation.get(host) {
                Some(procs) if procs.iter().all(|&p| self.procs[p].life == Life::Running) => {
                    let mut procs = procs.clone();
                    procs.sort_by_key(|&p| self.procs[p].local_rank);
                    members.extend(procs.into_iter().take(*slots as usize));
                }
                _ => to_start.push((host.clone(), *slots)),
            }
        }
        let leaving: Vec<usize> =
            (0..self.procs.len()).filter(|p| self.procs[*p].life == Life::Running && !members.contains(p)).collect();
        if members.len() as u32 >= self.membership.config().min_np && members != self.members() {
            self.publish(members);
        }
        for p in leaving {
            self.remove(p).await;
        }
        let starting: HashSet<&String> = self.spawning.iter().flat_map(|(_, hosts)| hosts).collect();
        to_start.retain(|(host, _)| !starting.contains(host));
        // one cohort at a time: a world that changes meanwhile is looked at
        // again once it is up
        if !to_start.is_empty() && self.spawning.is_none() {
            self.start_cohort(to_start);
        }
    }

    /// Members of the round published last, in rank order.
    fn members(&self) -> &[usize] {
        self.rounds.last().map_or(&[], Vec::as_slice)
    }

    /// The number the next round gets.
    fn next_round(&self) -> u64 {
        self.rounds.len() as u64
    }

    /// Starts the next round with `members` (in rank order).
    fn publish(&mut self, members: Vec<usize>) {
        let Some(server) = self.cohorts.first().and_then(|c| c.rendezvous_server()) else { return };
        let mut hosts: Vec<HostSpec> = Vec::new();
        for &p in &members {
            let host = &self.procs[p].host;
            match hosts.last_mut() {
                Some(last) if &last.name == host => last.slots += 1,
                _ => hosts.push(HostSpec::new(host.clone(), 1)),
            }
        }
        let np = members.len() as u64;
        let slots = match host_assignments(&hosts, np, Some(np)) {
            Ok(slots) => slots,
            Err(e) => {
                tracing::error!("cannot assign ranks for the next round: {e}");
                return;
            }
        };
        let round = self.next_round();
        server.set_round(round, &slots);
        self.rounds.push(members);
        self.tell(ElasticEvent::Round { round, hosts: hosts.into_iter().map(|h| (h.name, h.slots)).collect() });
    }

    /// Tells a process it has no place any more (its `rank_and_size` says
    /// so already) by ending it.
    async fn remove(&mut self, p: usize) {
        self.procs[p].life = Life::Removed;
        let (cohort, rank) = (self.procs[p].cohort, self.procs[p].rank);
        if let Some(executor) = self.cohorts.get(cohort) {
            executor.stop_rank(rank).await;
        }
    }

    fn start_cohort(&mut self, hosts: Vec<(String, u32)>) {
        let specs: Vec<HostSpec> = hosts.iter().map(|(name, slots)| HostSpec::new(name.clone(), *slots)).collect();
        let np: u64 = hosts.iter().map(|(_, s)| u64::from(*s)).sum();
        let mut env = vec![
            ("HOROVOD_ELASTIC".to_string(), "1".to_string()),
            (ENV_ROUND.to_string(), self.next_round().to_string()),
            (ENV_TIMEOUT.to_string(), self.membership.config().elastic_timeout.as_secs().max(1).to_string()),
        ];
        if let Some(first) = self.cohorts.first().and_then(|c| c.workers().into_iter().next()) {
            env.extend(SHARED_VARS.iter().filter_map(|k| first.env.get(*k).map(|v| (k.to_string(), v.clone()))));
        }
        let mut extra = self.extra_env.clone();
        extra.retain(|(k, _)| !env.iter().any(|(e, _)| e == k));
        extra.extend(env);
        let names: Vec<String> = hosts.iter().map(|(h, _)| h.clone()).collect();
        if !self.cohorts.is_empty() {
            self.tell(ElasticEvent::Starting { hosts: names.clone() });
        }
        let (factory, work) = (self.factory.clone(), self.work.clone());
        let job_reports = self.reports.clone();
        // cohorts start one at a time and take the next index if they come up
        let index = self.cohorts.len();
        let (reports, mut cohort_reports) = mpsc::channel(crate::driver::calls::REPORTS_QUEUED);
        tokio::spawn(async move {
            let Some(job_reports) = job_reports else { return };
            while let Some(report) = cohort_reports.recv().await {
                if job_reports.send((index, report)).await.is_err() {
                    return;
                }
            }
        });
        let cohort = Cohort { hosts: specs, np, secret: self.secret.clone(), first_process: self.procs.len() };
        let handle = tokio::spawn(async move {
            let mut executor = factory(cohort).await?;
            let ends = match work.start(&mut executor, &extra, &reports).await {
                Ok(ends) => ends,
                Err(e) => {
                    executor.shutdown().await;
                    return Err(e);
                }
            };
            let procs = executor.workers().iter().map(|w| (w.node_id.clone(), w.ranks.local_rank)).collect();
            Ok(Started { executor, procs, ends })
        });
        self.spawning = Some((handle, names));
    }

    async fn on_spawned(
        &mut self,
        (spawned, hosts): (Result<Started<W::Output>, ExecError>, Vec<String>),
    ) -> Option<Ended> {
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
                let mut fresh: HashMap<String, Vec<usize>> = HashMap::new();
                for (rank, (host, local_rank)) in procs.into_iter().enumerate() {
                    fresh.entry(host.clone()).or_default().push(self.procs.len());
                    self.procs.push(Proc { cohort, rank: rank as u32, host, local_rank, life: Life::Running });
                }
                for (host, procs) in fresh {
                    for p in self.generation.insert(host, procs).unwrap_or_default() {
                        if self.procs[p].life == Life::Running {
                            self.remove(p).await;
                        }
                    }
                }
            }
            Err(e) => {
                // a start that failed on some hosts (named in the error) costs
                // only those; otherwise every host of the cohort
                let message = e.to_string();
                let named: Vec<String> = hosts.iter().filter(|h| names_host(&message, h)).cloned().collect();
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
                    self.reform(&world).await;
                    None
                }
                None => None,
            },
            other => self.apply(other).await,
        }
    }

    async fn on_end(&mut self, cohort: usize, rank: u32, end: ProcessEnd<W::Output>) -> Option<Ended> {
        let p = self.procs.iter().position(|p| p.cohort == cohort && p.rank == rank)?;
        if self.procs[p].life != Life::Running {
            return None;
        }
        let host = self.procs[p].host.clone();
        let (event, reason) = match end {
            ProcessEnd::Succeeded(output) => {
                self.procs[p].life = Life::Succeeded;
                self.results.insert(p, output);
                if self.finishing.is_none() {
                    self.finishing = Some(self.last_joined_round());
                }
                return self.finished();
            }
            ProcessEnd::Failed(reason) => (Event::RankFailed(&host), reason),
            ProcessEnd::Lost(reason) => (Event::HostLost(&host), format!("was lost: {reason}")),
        };
        self.procs[p].life = Life::Failed;
        if let Some(finals) = &self.finishing {
            if finals.contains(&p) {
                return Some(Ended::Stopped(format!("a process on host {host} {reason} while the job was finishing")));
            }
            return self.finished();
        }
        let rank = self.members().iter().position(|&m| m == p).map(|r| r as u32);
        self.tell(ElasticEvent::Failed { rank, host: host.clone(), reason });
        let decision = self.membership.on(event, self.started.elapsed());
        self.apply(decision).await
    }

    /// Done once every process the job is finishing with has ended.
    fn finished(&self) -> Option<Ended> {
        let finals = self.finishing.as_ref()?;
        finals.iter().all(|&m| self.procs[m].life != Life::Running).then_some(Ended::Done)
    }

    /// The members of the last round whose processes joined it (each
    /// records the round it joined on the store); those that started for
    /// a later round that never came together are not waited for.
    fn last_joined_round(&self) -> Vec<usize> {
        let server = self.cohorts.first().and_then(|c| c.rendezvous_server());
        let joined = |p: usize| -> Option<u64> {
            let proc = &self.procs[p];
            let key = format!("{}:{}", proc.host, proc.local_rank);
            let value = server?.value(kolo_rendezvous::elastic::JOINED_SCOPE, &key)?;
            std::str::from_utf8(&value).ok()?.trim().parse().ok()
        };
        let last = self
            .rounds
            .iter()
            .enumerate()
            .rev()
            .find(|(round, members)| members.iter().any(|&m| joined(m) == Some(*round as u64)));
        match last {
            Some((_, members)) => members.clone(),
            None => self.members().to_vec(),
        }
    }

    async fn shutdown(&mut self) {
        if let Some((handle, _)) = self.spawning.take() {
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

/// Whether `message` names `host` as a word (not inside a longer name).
fn names_host(message: &str, host: &str) -> bool {
    let word = |c: char| c.is_alphanumeric() || c == '-' || c == '_' || c == '.';
    message.match_indices(host).any(|(at, _)| {
        let before = message[..at].chars().next_back();
        let after = message[at + host.len()..].chars().next();
        !before.is_some_and(word) && !after.is_some_and(|c| word(c) && c != '.')
    })
}

enum Ended {
    Done,
    Stopped(String),
    Interrupted(Signal),
}

async fn spawn_done<O>(spawning: &mut Spawning<O>) -> (Result<Started<O>, ExecError>, Vec<String>) {
    let Some((handle, _)) = spawning.as_mut() else { return std::future::pending().await };
    let result = match handle.await {
        Ok(result) => result,
        Err(e) => Err(ExecError::Io { what: "starting processes".into(), source: std::io::Error::other(e) }),
    };
    let (_, hosts) = spawning.take().expect("awaited above");
    (result, hosts)
}

#[cfg(test)]
mod tests {
    use super::names_host;

    #[test]
    fn a_start_error_names_the_hosts_it_is_about() {
        let e = "worker 2 on host h1 could not start: ssh: connect to host h1 port 22: No route to host.";
        assert!(names_host(e, "h1"));
        assert!(!names_host(e, "h"));
        assert!(!names_host("host h10 is down", "h1"));
        assert!(names_host("on host node-a.", "node-a"));
        assert!(!names_host("on host node-ab", "node-a"));
    }
}
