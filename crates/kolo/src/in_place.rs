//! `kolo run --in-place`: Horovod's elastic mode, for programs that use
//! kolo-comm's elastic API (or Horovod's `rank_and_size` protocol). When a
//! rank fails, a host is lost or discovery adds hosts, the processes that
//! survive keep running: kolo starts a new round on the rendezvous server
//! (the store afresh, `rank_and_size` answering each process's new ranks),
//! the survivors' collectives end, and they join it and go on from their
//! last commit.
//!
//! Membership (limits, blacklisting, cooldowns, timeouts) is kolo-topology's
//! `Membership`, as in restart mode. A host is in a round with all the
//! processes kolo last started there, or not at all (Horovod's rule): when
//! one of them fails, the others there are removed and the host gets a
//! fresh set of processes, which joins a later round, as added hosts do.
//! Processes are started in cohorts, one executor each (the first one's
//! rendezvous server is the job's); they share the job's secret, store and
//! interfaces.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::Instant;

use anyhow::Result;
use kolo_exec::{Cause, Executor, RankEvent, Settings};
use kolo_topology::{host_assignments, Decision, Event, HostSpec, Membership, World};
use nix::sys::signal::Signal;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::elastic::{discover, rediscover, ElasticOutcome, ElasticSpec};
use crate::launch::{executor_with_secret, LaunchSpec};
use crate::out::tell;

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

/// A cohort that came up: its executor and each rank's (host, local rank).
type Spawned = Result<(Executor, Vec<(String, u32)>)>;

struct Job {
    spec: LaunchSpec,
    elastic: ElasticSpec,
    secret: String,
    cohorts: Vec<Executor>,
    procs: Vec<Proc>,
    /// Each host's processes of the cohort that last started there.
    generation: HashMap<String, Vec<usize>>,
    /// Members of the round published last, in rank order.
    members: Vec<usize>,
    /// Members of every round published, by round.
    rounds: Vec<Vec<usize>>,
    /// Once a process has succeeded: the members of the last round that
    /// came together, whose end ends the job.
    finishing: Option<Vec<usize>>,
    next_round: u64,
    events: mpsc::UnboundedSender<(usize, RankEvent)>,
    /// A cohort being started, and its hosts.
    spawning: Option<(JoinHandle<Spawned>, Vec<String>)>,
    /// The world changed while a cohort was starting: look again once it is up.
    look_again: bool,
    membership: Membership,
    /// Hosts said to be blacklisted.
    blacklisted: HashSet<String>,
    started: Instant,
}

/// Runs `spec.command` in place until every member of the current round
/// has succeeded, the job is interrupted, or membership says stop.
pub async fn run_in_place(
    spec: LaunchSpec,
    elastic: ElasticSpec,
    interrupt: impl Future<Output = Signal>,
) -> Result<ElasticOutcome> {
    tokio::pin!(interrupt);
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let mut job = Job {
        membership: Membership::new(elastic.config.clone()),
        spec,
        elastic,
        secret: Settings::generate_secret(),
        cohorts: Vec::new(),
        procs: Vec::new(),
        generation: HashMap::new(),
        members: Vec::new(),
        rounds: Vec::new(),
        finishing: None,
        next_round: 0,
        events: events_tx,
        spawning: None,
        look_again: false,
        blacklisted: HashSet::new(),
        started: Instant::now(),
    };
    let first = discover(&job.elastic, &job.spec.hosts).await?;
    let decision = job.membership.on(Event::Discovered(&first), job.started.elapsed());
    let mut ended = job.apply(decision).await;
    let mut ticks = tokio::time::interval(job.elastic.discovery_interval);
    ticks.tick().await;
    while ended.is_none() {
        ended = tokio::select! {
            Some((cohort, event)) = events.recv() => job.on_rank_event(cohort, event).await,
            spawned = spawn_done(&mut job.spawning) => job.on_spawned(spawned).await,
            _ = ticks.tick() => {
                let decision = rediscover(&job.elastic, &job.spec, &mut job.membership, job.started).await;
                job.apply(decision).await
            }
            signal = &mut interrupt => Some(ElasticOutcome { last: None, stopped: None, exit_code: 128 + signal as i32 }),
        };
    }
    job.shutdown().await;
    Ok(ended.expect("the loop ends with an outcome"))
}

async fn spawn_done(spawning: &mut Option<(JoinHandle<Spawned>, Vec<String>)>) -> (Spawned, Vec<String>) {
    let Some((handle, _)) = spawning.as_mut() else { return std::future::pending().await };
    let result = match handle.await {
        Ok(result) => result,
        Err(e) => Err(anyhow::anyhow!("starting processes failed: {e}")),
    };
    let (_, hosts) = spawning.take().expect("awaited above");
    (result, hosts)
}

impl Job {
    async fn apply(&mut self, decision: Decision) -> Option<ElasticOutcome> {
        self.announce_blacklist();
        match decision {
            Decision::Continue => None,
            Decision::Reform(world) => {
                self.reform(&world).await;
                None
            }
            Decision::Wait { available, needed, deadline } => {
                tell(&format!(
                    "kolo: waiting for {needed} slots, {available} available; up to {:.0} s more",
                    deadline.saturating_sub(self.started.elapsed()).as_secs_f64()
                ));
                None
            }
            Decision::Stop(reason) => {
                Some(ElasticOutcome { last: None, stopped: Some(reason.to_string()), exit_code: 1 })
            }
        }
    }

    /// Says which hosts were newly left out, and for how long.
    fn announce_blacklist(&mut self) {
        let now = self.started.elapsed();
        let out: HashSet<String> = self.membership.blacklisted().iter().map(|(h, _)| h.to_string()).collect();
        for (host, until) in self.membership.blacklisted() {
            if !self.blacklisted.contains(host) {
                let how_long = match until {
                    Some(until) => format!("for {:.0} s", until.saturating_sub(now).as_secs_f64()),
                    None => "for the rest of the job".into(),
                };
                tell(&format!("kolo: host {host} is blacklisted {how_long}"));
            }
        }
        self.blacklisted = out;
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
        if members.len() as u32 >= self.membership.config().min_np && members != self.members {
            self.publish(members);
        }
        for p in leaving {
            self.remove(p).await;
        }
        let starting: HashSet<&String> = self.spawning.iter().flat_map(|(_, hosts)| hosts).collect();
        to_start.retain(|(host, _)| !starting.contains(host));
        if to_start.is_empty() {
            return;
        }
        if self.spawning.is_some() {
            self.look_again = true;
            return;
        }
        self.start_cohort(to_start);
    }

    /// Starts round `next_round` with `members` (in rank order).
    fn publish(&mut self, members: Vec<usize>) {
        let Some(first) = self.cohorts.first() else { return };
        let Some(server) = first.rendezvous_server() else { return };
        let mut hosts: Vec<HostSpec> = Vec::new();
        for &p in &members {
            let host = &self.procs[p].host;
            match hosts.last_mut() {
                Some(last) if &last.name == host => last.slots += 1,
                _ => hosts.push(HostSpec { name: host.clone(), slots: 1, gpus: None }),
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
        let round = self.next_round;
        self.next_round += 1;
        server.set_round(round, &slots);
        self.rounds.push(members.clone());
        let names: Vec<String> = hosts.iter().map(|h| format!("{}:{}", h.name, h.slots)).collect();
        let processes = if np == 1 { "process" } else { "processes" };
        tell(&format!("kolo: round {round}: {np} {processes} on {}", names.join(",")));
        self.members = members;
    }

    /// Tells a process it has no place any more (its `rank_and_size` says
    /// so already) by ending its command.
    async fn remove(&mut self, p: usize) {
        self.procs[p].life = Life::Removed;
        let (cohort, rank) = (self.procs[p].cohort, self.procs[p].rank);
        if let Some(executor) = self.cohorts.get(cohort) {
            let _ = executor.signal_rank(rank, Signal::SIGTERM).await;
        }
    }

    fn start_cohort(&mut self, hosts: Vec<(String, u32)>) {
        let mut spec = self.spec.clone();
        spec.hosts =
            hosts.iter().map(|(name, slots)| HostSpec { name: name.clone(), slots: *slots, gpus: None }).collect();
        spec.np = hosts.iter().map(|(_, s)| u64::from(*s)).sum();
        let mut env = vec![
            ("HOROVOD_ELASTIC".to_string(), "1".to_string()),
            (kolo_comm_env::ROUND.to_string(), self.next_round.to_string()),
            (kolo_comm_env::TIMEOUT.to_string(), self.elastic.config.elastic_timeout.as_secs().max(1).to_string()),
        ];
        if let Some(first) = self.cohorts.first().and_then(|c| c.workers().into_iter().next()) {
            env.extend(SHARED_VARS.iter().filter_map(|k| first.env.get(*k).map(|v| (k.to_string(), v.clone()))));
        }
        spec.extra_env.retain(|(k, _)| !env.iter().any(|(e, _)| e == k));
        spec.extra_env.extend(env);
        let names: Vec<String> = hosts.iter().map(|(h, _)| h.clone()).collect();
        if !self.cohorts.is_empty() {
            tell(&format!("kolo: starting processes on {}", names.join(",")));
        }
        let secret = self.secret.clone();
        let handle = tokio::spawn(async move {
            let mut executor = executor_with_secret(&spec, Some(&secret)).await?;
            if let Err(e) = executor.start_command(&spec.command, &spec.extra_env).await {
                executor.shutdown().await;
                return Err(e.into());
            }
            let procs = executor.workers().iter().map(|w| (w.node_id.clone(), w.ranks.local_rank)).collect();
            Ok((executor, procs))
        });
        self.spawning = Some((handle, names));
    }

    async fn on_spawned(&mut self, (spawned, hosts): (Spawned, Vec<String>)) -> Option<ElasticOutcome> {
        match spawned {
            Ok((mut executor, procs)) => {
                let cohort = self.cohorts.len();
                if let Some(mut events) = executor.take_rank_events() {
                    let forward = self.events.clone();
                    tokio::spawn(async move {
                        while let Some(event) = events.recv().await {
                            if forward.send((cohort, event)).is_err() {
                                return;
                            }
                        }
                    });
                }
                self.cohorts.push(executor);
                let mut fresh: HashMap<String, Vec<usize>> = HashMap::new();
                for (rank, (host, local_rank)) in procs.into_iter().enumerate() {
                    fresh.entry(host.clone()).or_default().push(self.procs.len());
                    self.procs.push(Proc { cohort, rank: rank as u32, host, local_rank, life: Life::Running });
                }
                for (host, procs) in fresh {
                    if let Some(old) = self.generation.insert(host, procs) {
                        for p in old {
                            if self.procs[p].life == Life::Running {
                                self.remove(p).await;
                            }
                        }
                    }
                }
            }
            Err(e) => {
                tell(&format!("kolo: cannot start processes on {}: {e:#}", hosts.join(",")));
                for host in &hosts {
                    let decision = self.membership.on(Event::HostLost(host), self.started.elapsed());
                    if let stop @ Some(_) = self.apply_quietly(decision).await {
                        return stop;
                    }
                }
            }
        }
        self.look_again = false;
        let world = self.membership.world().cloned();
        match world {
            Some(world) => {
                self.reform(&world).await;
                None
            }
            None => None,
        }
    }

    /// `apply`, except that a new world is looked at once the cohort is handled.
    async fn apply_quietly(&mut self, decision: Decision) -> Option<ElasticOutcome> {
        match decision {
            Decision::Reform(_) | Decision::Continue => None,
            other => self.apply(other).await,
        }
    }

    async fn on_rank_event(&mut self, cohort: usize, event: RankEvent) -> Option<ElasticOutcome> {
        let p = self.procs.iter().position(|p| p.cohort == cohort && p.rank == event.rank)?;
        if matches!(self.procs[p].life, Life::Removed | Life::Succeeded | Life::Failed) {
            return None;
        }
        let succeeded = matches!(event.cause, Cause::Exited { code: Some(0), .. });
        self.procs[p].life = if succeeded { Life::Succeeded } else { Life::Failed };
        let host = self.procs[p].host.clone();
        if succeeded && self.finishing.is_none() {
            self.finishing = Some(self.last_joined_round());
        }
        if let Some(finals) = &self.finishing {
            if !succeeded && finals.contains(&p) {
                let stopped = format!("a process on host {host} {} while the job was finishing", event.cause);
                return Some(ElasticOutcome { last: None, stopped: Some(stopped), exit_code: 1 });
            }
            let done = finals.iter().all(|&m| self.procs[m].life != Life::Running);
            return done.then_some(ElasticOutcome { last: None, stopped: None, exit_code: 0 });
        }
        let rank = self.members.iter().position(|&m| m == p);
        let who = match rank {
            Some(rank) => format!("rank {rank} on host {host}"),
            None => format!("a process starting on host {host}"),
        };
        let cause = event.cause.to_string();
        let event = match event.cause {
            Cause::Lost(_) => Event::HostLost(&host),
            _ => Event::RankFailed(&host),
        };
        let decision = self.membership.on(event, self.started.elapsed());
        if !matches!(decision, Decision::Stop(_)) {
            tell(&format!("kolo: {who} {cause}; the others go on in place"));
        }
        self.apply(decision).await
    }

    /// The members of the last round whose processes joined it (each
    /// records the round it joined on the store); those that started for
    /// a later round that never came together are not waited for.
    fn last_joined_round(&self) -> Vec<usize> {
        let server = self.cohorts.first().and_then(|c| c.rendezvous_server());
        let joined = |p: usize| -> Option<u64> {
            let proc = &self.procs[p];
            let key = format!("{}:{}", proc.host, proc.local_rank);
            let value = server?.value(kolo_rendezvous::JOINED_SCOPE, &key)?;
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
            None => self.members.clone(),
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

/// The variables kolo-comm's elastic API reads (`kolo_comm::elastic`).
mod kolo_comm_env {
    pub const ROUND: &str = "KOLO_ELASTIC_ROUND";
    pub const TIMEOUT: &str = "KOLO_ELASTIC_TIMEOUT_SECONDS";
}
