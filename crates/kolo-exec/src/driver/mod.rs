//! The Executor: RayExecutor's API in Rust. It plans the job once, places
//! worker agents through an engine, registers them, gives each its ranks
//! and environment, runs the rendezvous server, starts an executable (a
//! Rust type or an OS command) in every worker, runs calls on all of them
//! and tears everything down.
//!
//! - `start`: plan, spawn, accept and authenticate, register, env
//! - `link`: each worker's connection: reader, heartbeats, watchdog
//! - `calls`: execute / run / run_remote and their handles
//! - `command`: supervising an OS command job (teardown policy in `policy`)

pub(crate) mod calls;
mod command;
pub mod control;
mod link;
mod peers;
mod progress;
mod start;
mod timeline;

pub use calls::{CallHandle, Report, REPORTS_QUEUED};
pub use command::{Failure, JobOutcome};
pub use link::{RankError, RankEvent};

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kolo_rendezvous::{RendezvousServer, TorchStoreServer};
use kolo_topology::{HostSpec, Plan, RankInfo, TopologyError};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use crate::output::OutputWriter;
use crate::settings::Settings;
use kolo_engine::ExecError;
use kolo_engine::WorkerRequest;
use kolo_engine::{Engine, EngineChoice, EngineOptions, LocalEngine};
use kolo_proto::proto::ToWorker;
use kolo_proto::registry::Executable;
use kolo_sys::guard::Guard;
pub(crate) use link::Link;

/// A registered worker and its place in the job.
#[derive(Clone, Debug)]
pub struct WorkerInfo {
    /// The worker's world rank.
    pub rank: u32,
    /// The host the plan put it on (its engine's name for the host).
    pub hostname: String,
    /// The engine's id of its node; workers with the same id share a node.
    pub node_id: String,
    /// The worker agent's process id, as it reported it.
    pub pid: u32,
    /// The GPU ids it holds on its host.
    pub gpus: Vec<u32>,
    /// Its local and cross ranks and sizes.
    pub ranks: RankInfo,
    /// Every variable kolo set for this worker.
    pub env: BTreeMap<String, String>,
}

struct Running {
    links: Vec<Arc<Link>>,
    server: RendezvousServer,
    torch_store: std::sync::Arc<TorchStoreServer>,
    output: OutputWriter,
    events: mpsc::UnboundedReceiver<RankEvent>,
    /// One reader per worker; they end when the workers' connections do.
    readers: JoinSet<()>,
    /// Heartbeats and the watchdog; they run until shutdown.
    background: JoinSet<()>,
    stopping: Arc<AtomicBool>,
    /// What is the same for every rank.
    job: kolo_topology::JobEnv,
    /// The workers run an OS command each (`kolo run`), not functions.
    commands: bool,
    /// `kolo status` and `kolo stack` ask here (none where it could not open).
    control: Option<super::control::Endpoint>,
}

/// Runs user code on a set of worker processes; see the crate docs.
pub struct Executor {
    settings: Settings,
    request: WorkerRequest,
    /// `None` only while a blocking engine call runs off the runtime.
    engine: Option<Box<dyn Engine>>,
    plan: Option<Plan>,
    /// Cleans up after the engine if this process is killed.
    janitor: Option<Arc<Guard>>,
    running: Option<Running>,
    next_id: AtomicU64,
    nic_report: Vec<kolo_agent::nics::PairReport>,
    /// What `kolo ps` says the job runs.
    description: String,
    /// `record_timeline`'s file, and what writing it said.
    timeline: Option<timeline::JobTimeline>,
}

impl Executor {
    /// An executor on this machine (the local engine).
    pub fn new(settings: Settings, request: WorkerRequest) -> Result<Self, ExecError> {
        Self::with_engine(settings, request, Box::new(LocalEngine::this_machine()))
    }

    /// An executor on a host list: local processes when every host is this
    /// machine, ssh (with `settings.ssh`) otherwise, Slurm inside an
    /// allocation. Looks host names up: call it before the async work.
    pub fn on_hosts(settings: Settings, request: WorkerRequest, hosts: Vec<HostSpec>) -> Result<Self, ExecError> {
        let options = EngineOptions { ssh: settings.ssh.clone(), ..EngineOptions::default() };
        let engine = EngineChoice::Auto.engine(hosts, &request, options)?;
        Self::with_engine(settings, request, engine)
    }

    /// An executor on the given engine; refuses a request for no workers
    /// or no CPUs, and settings that cannot work (heartbeats, secret).
    pub fn with_engine(settings: Settings, request: WorkerRequest, engine: Box<dyn Engine>) -> Result<Self, ExecError> {
        if request.num_workers() == 0 {
            return Err(TopologyError::BadRequest("at least one worker is needed".into()).into());
        }
        if request.resources.cpus == 0 {
            return Err(TopologyError::BadRequest("cpus_per_worker must be at least 1".into()).into());
        }
        if settings.heartbeat_timeout <= settings.heartbeat_interval {
            return Err(ExecError::BadSettings(format!(
                "heartbeat_timeout ({:?}) must be longer than heartbeat_interval ({:?})",
                settings.heartbeat_timeout, settings.heartbeat_interval
            )));
        }
        if settings.secret().is_empty() {
            return Err(ExecError::BadSettings("the job secret is empty".into()));
        }
        Ok(Executor {
            settings,
            request,
            engine: Some(engine),
            plan: None,
            janitor: None,
            running: None,
            next_id: AtomicU64::new(1),
            nic_report: Vec::new(),
            description: "functions (kolo.Executor)".into(),
            timeline: None,
        })
    }

    /// The job's plan: where each worker goes, its ranks, GPUs and
    /// environment. Asks the engine for its hosts the first time (which
    /// may wait for an allocation); `start` runs exactly this plan.
    pub async fn plan(&mut self) -> Result<&Plan, ExecError> {
        if self.plan.is_none() {
            let timeout = self.settings.placement_timeout;
            let hosts = self.with_engine_blocking(move |engine| engine.hosts(timeout)).await?;
            let plan = Plan::new(self.request.placement, self.request.resources, &hosts)?;
            self.plan = Some(plan);
        }
        Ok(self.plan.as_ref().expect("planned above"))
    }

    /// Runs an engine call that may block on a blocking thread.
    async fn with_engine_blocking<T: Send + 'static>(
        &mut self,
        call: impl FnOnce(&mut Box<dyn Engine>) -> Result<T, ExecError> + Send + 'static,
    ) -> Result<T, ExecError> {
        let mut engine = self.engine.take().ok_or(ExecError::EngineBusy)?;
        let joined = tokio::task::spawn_blocking(move || {
            let result = call(&mut engine);
            (engine, result)
        })
        .await;
        match joined {
            Ok((engine, result)) => {
                self.engine = Some(engine);
                result
            }
            Err(e) => Err(ExecError::Io { what: "an engine call".into(), source: std::io::Error::other(e) }),
        }
    }

    fn engine(&mut self) -> Option<&mut Box<dyn Engine>> {
        self.engine.as_mut()
    }

    /// The workers in rank order (after `start`).
    pub fn workers(&self) -> Vec<WorkerInfo> {
        self.running.as_ref().map(|r| r.links.iter().map(|l| l.info.clone()).collect()).unwrap_or_default()
    }

    /// What interface detection found, host by host around the ring (after
    /// `start`; empty when the interfaces were given or all workers share a host).
    pub fn nic_report(&self) -> &[kolo_agent::nics::PairReport] {
        &self.nic_report
    }

    /// The rendezvous server's address (after `start`).
    pub fn rendezvous_addr(&self) -> Option<SocketAddr> {
        self.running.as_ref().map(|r| r.server.addr())
    }

    /// The rendezvous server (after `start`): an elastic driver starts its
    /// rounds there ([`RendezvousServer::set_round`]).
    pub fn rendezvous_server(&self) -> Option<&RendezvousServer> {
        self.running.as_ref().map(|r| &r.server)
    }

    /// Makes the workers part of an elastic job (before `start`): what they
    /// are told of it, and the job they join, if it runs already.
    pub fn join_elastic(&mut self, elastic: kolo_topology::ElasticEnv, shared: Option<crate::SharedJob>) {
        self.settings.elastic = Some(elastic);
        self.settings.shared = shared;
    }

    /// What the job's later executors share with this one (after `start`):
    /// its store, id and interfaces.
    pub fn shared_job(&self) -> Option<crate::SharedJob> {
        let running = self.running.as_ref()?;
        Some(crate::SharedJob {
            rendezvous: running.server.addr(),
            torch_store: crate::SharedTorchStore(running.torch_store.clone()),
            job_id: running.job.job_id.clone(),
            ifaces: running.job.ifaces.clone(),
        })
    }

    /// Takes the stream of rank events of a command job (a rank's command
    /// ended, could not start, or its worker was lost), for a caller that
    /// supervises the ranks itself (an in-place elastic job) instead of
    /// [`Executor::wait_command`], which has nothing to wait on afterwards.
    pub fn take_rank_events(&mut self) -> Option<mpsc::UnboundedReceiver<RankEvent>> {
        let running = self.running.as_mut()?;
        let (_, empty) = mpsc::unbounded_channel();
        Some(std::mem::replace(&mut running.events, empty))
    }

    /// Stops one rank's worker: its command (SIGTERM, then SIGKILL after
    /// the grace), then the worker itself; a call it runs (or has queued)
    /// is abandoned.
    pub async fn stop_rank(&self, rank: u32) {
        if let Some(link) = self.running.as_ref().and_then(|r| r.links.get(rank as usize)) {
            link.told_to_stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let _ = link.send(&ToWorker::Stop).await;
        }
    }

    /// What watches the ranks from outside the driver's calls (hang
    /// detection), once the workers run with a control endpoint.
    pub fn inspector(&self) -> Option<super::control::Inspector> {
        self.running.as_ref()?.control.as_ref().map(|c| c.inspector())
    }

    /// Starts the workers and creates the executable `E` in each from `args`.
    pub async fn start<E: Executable>(
        &mut self,
        args: &E::Args,
        extra_env: &[(String, String)],
    ) -> Result<(), ExecError> {
        let encoded = postcard::to_stdvec(args).map_err(ExecError::Encode)?;
        self.start_workers(&self.with_timeline_env(extra_env)).await?;
        self.measure_clocks().await;
        let result = self.create(E::NAME, encoded).await;
        if result.is_err() {
            self.shutdown().await;
        }
        result
    }

    /// Starts the workers and an OS command in each (what `kolo run` does).
    pub async fn start_command(&mut self, argv: &[OsString], extra_env: &[(String, String)]) -> Result<(), ExecError> {
        use std::os::unix::ffi::OsStrExt;
        if argv.is_empty() {
            return Err(ExecError::NoCommand);
        }
        self.description = argv.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ");
        self.start_agents(&self.with_timeline_env(extra_env), true).await?;
        self.measure_clocks().await;
        let argv: Vec<Vec<u8>> = argv.iter().map(|a| a.as_bytes().to_vec()).collect();
        let message = ToWorker::StartCommand { argv };
        for link in &self.running()?.links {
            link.send(&message).await?;
        }
        tracing::debug!("every worker told to start the command");
        Ok(())
    }

    fn running(&self) -> Result<&Running, ExecError> {
        self.running.as_ref().ok_or(ExecError::NotStarted)
    }

    async fn create(&mut self, name: &str, args: Vec<u8>) -> Result<(), ExecError> {
        let running = self.running()?;
        let mut waits = Vec::new();
        let message = ToWorker::Create { name: name.to_string(), args };
        for link in &running.links {
            let (tx, rx) = oneshot::channel();
            *kolo_sys::lock(&link.created) = Some(tx);
            link.send(&message).await?;
            waits.push((link.clone(), rx));
        }
        for (link, rx) in waits {
            match rx.await {
                Ok(Ok(())) => {}
                Ok(Err(message)) => {
                    return Err(ExecError::Task { rank: link.info.rank, host: link.info.hostname.clone(), message })
                }
                Err(_) => return Err(link.lost_error("its connection ended".into())),
            }
        }
        Ok(())
    }

    /// Stops executables and workers and the rendezvous server: calls
    /// still running are abandoned (their handles fail), commands get the
    /// grace period; waits up to the grace (plus a little) before killing
    /// what is left, less after a second interrupt (`hurry`), and
    /// writes out the workers' last output.
    pub async fn shutdown(&mut self) {
        let Some(mut running) = self.running.take() else {
            self.stop_engine().await;
            return;
        };
        tracing::debug!("shutting down");
        running.stopping.store(true, Ordering::Relaxed);
        running.background.abort_all();
        for link in &running.links {
            let _ = link.send(&ToWorker::Stop).await;
        }
        // a worker that stops closes its connection after its last output;
        // the readers of lost workers have ended already
        let drain = async { while running.readers.join_next().await.is_some() {} };
        // commands get the kill grace (their agents SIGTERM them first);
        // workers that run functions end themselves at Stop
        let limit = match running.commands {
            true => self.settings.kill_grace + kolo_sys::wait::STOP_DRAIN,
            false => kolo_sys::wait::FUNCTIONS_DRAIN,
        };
        let drained = tokio::select! {
            drained = tokio::time::timeout(limit, drain) => drained.is_ok(),
            // asked twice to stop: what is left is killed now
            _ = kolo_sys::hurry::hurried() => false,
        };
        if !drained {
            running.readers.abort_all();
        }
        tracing::debug!(drained, "workers gone");
        self.write_timeline(&running);
        self.stop_engine().await;
        tracing::debug!("engine stopped");
        drop(running.links);
        running.server.stop().await;
        // an elastic job's other executors may still use it (they hold it,
        // in their settings too): then it stops when the last lets it go
        if let Ok(store) = std::sync::Arc::try_unwrap(running.torch_store) {
            store.stop().await;
        }
        running.output.finish().await;
    }

    /// Kills what is left of the workers, waits for them briefly, and lets
    /// the janitor go (nothing is left for it).
    async fn stop_engine(&mut self) {
        if let Some(engine) = self.engine() {
            engine.kill_all();
        }
        let deadline = std::time::Instant::now() + kolo_sys::wait::KILLED_REAP;
        let engine = &mut self.engine;
        kolo_sys::wait::wait_until_async(deadline, Duration::from_millis(1), || {
            engine.as_mut().is_none_or(|e| e.all_exited())
        })
        .await;
        if let Some(janitor) = self.janitor.take() {
            // the engine's resources go with the engine (scancel, files):
            // drop it first, then the janitor has nothing to do
            if let (true, Ok(janitor)) = (self.engine().is_none_or(|e| e.all_exited()), Arc::try_unwrap(janitor)) {
                Guard::reap(janitor.release());
            }
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        // no await here: kill outright; the janitor (dropped after) cleans
        // up whatever the engine leaves; the rendezvous server stops on drop
        if let Some(engine) = self.engine.as_mut() {
            engine.kill_all();
        }
    }
}
