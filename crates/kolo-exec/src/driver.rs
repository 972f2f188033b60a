//! The Executor: RayExecutor's API in Rust. It places worker agents through
//! an engine, registers them, gives each its ranks and environment, runs the
//! rendezvous server, starts an executable (a Rust type or an OS command) in
//! every worker, runs calls on all of them and tears everything down.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::future::Future;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kolo_rendezvous::{RendezvousServer, ServerConfig};
use kolo_topology::{
    cuda_visible_devices, place, rank_env, resolve_gpus_per_worker, Coordinator, JobEnv, Placement, RankInfo, Slot,
    TopologyError, WorkerResources,
};
use nix::sys::signal::Signal;
use serde::de::DeserializeOwned;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::engine::{Engine, LocalEngine, WorkerLaunch};
use crate::output::{LineSplitter, OutputOptions, OutputSink, Stream};
use crate::proto::{self, CallKind, Challenge, Hello, ToDriver, ToWorker, Welcome, MAGIC, PROTOCOL_VERSION};
use crate::registry::{name_of, Executable, Function, Task};
use crate::{worker, ExecError};

/// How a job runs. `Settings::default()` gives upstream's defaults and a
/// fresh secret.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Workers must connect and register within this (upstream `timeout_s`).
    pub start_timeout: Duration,
    /// Placement must be satisfiable within this (upstream `placement_group_timeout_s`).
    pub placement_timeout: Duration,
    /// Interfaces to use instead of detecting them.
    pub nics: Option<Vec<String>>,
    /// How [`Executor::on_hosts`] reaches other machines (identity file,
    /// port, config file, options).
    pub ssh: crate::SshOptions,
    pub verbose: bool,
    /// How often driver and workers send heartbeats.
    pub heartbeat_interval: Duration,
    /// A worker silent this long is reported lost (and a worker whose
    /// driver is silent this long exits).
    pub heartbeat_timeout: Duration,
    /// Between SIGTERM and SIGKILL when stopping executables.
    pub kill_grace: Duration,
    pub output: OutputOptions,
    /// The program started in worker mode (default: this binary).
    pub worker_program: Option<PathBuf>,
    /// The rendezvous server refuses requests without the job secret.
    pub rendezvous_require_secret: bool,
    secret: String,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            start_timeout: Duration::from_secs(30),
            placement_timeout: Duration::from_secs(100),
            nics: None,
            ssh: crate::SshOptions::default(),
            verbose: false,
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(5),
            kill_grace: Duration::from_secs(5),
            output: OutputOptions::default(),
            worker_program: None,
            rendezvous_require_secret: false,
            secret: random_hex(32),
        }
    }
}

impl Settings {
    /// Replaces the job secret (a fresh one is made by default).
    pub fn with_secret(mut self, secret: impl Into<String>) -> Self {
        self.secret = secret.into();
        self
    }
}

/// How many workers and what each needs (RayExecutor's arguments).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerRequest {
    pub placement: Placement,
    pub resources: WorkerResources,
}

impl WorkerRequest {
    /// `num_workers` packed onto as few hosts as fit.
    pub fn pack(num_workers: u32) -> Self {
        WorkerRequest { placement: Placement::Pack { num_workers }, resources: WorkerResources::default() }
    }

    /// `num_hosts` distinct hosts with `workers_per_host` workers each.
    pub fn colocated(num_hosts: u32, workers_per_host: u32) -> Self {
        WorkerRequest {
            placement: Placement::Colocated { num_hosts, workers_per_host },
            resources: WorkerResources::default(),
        }
    }

    /// Upstream's argument set, validated the same way.
    pub fn from_args(
        num_workers: Option<u32>,
        num_hosts: Option<u32>,
        num_workers_per_host: Option<u32>,
        cpus_per_worker: u32,
        use_gpu: bool,
        gpus_per_worker: Option<u32>,
    ) -> Result<Self, ExecError> {
        let placement = Placement::from_counts(num_workers, num_hosts, num_workers_per_host)?;
        let gpus = resolve_gpus_per_worker(use_gpu, gpus_per_worker)?;
        if cpus_per_worker == 0 {
            return Err(TopologyError::BadRequest("cpus_per_worker must be at least 1".into()).into());
        }
        Ok(WorkerRequest { placement, resources: WorkerResources { cpus: cpus_per_worker, gpus } })
    }

    pub fn cpus_per_worker(mut self, cpus: u32) -> Self {
        self.resources.cpus = cpus;
        self
    }

    pub fn gpus_per_worker(mut self, gpus: u32) -> Self {
        self.resources.gpus = gpus;
        self
    }

    pub fn num_workers(&self) -> u32 {
        self.placement.num_workers()
    }
}

/// A registered worker and its place in the job.
#[derive(Clone, Debug)]
pub struct WorkerInfo {
    pub rank: u32,
    pub hostname: String,
    pub node_id: String,
    pub pid: u32,
    pub gpus: Vec<u32>,
    pub ranks: RankInfo,
    /// Every variable kolo set for this worker.
    pub env: BTreeMap<String, String>,
}

/// The rank that failed first in a command job.
#[derive(Clone, Debug)]
pub struct Failure {
    pub rank: u32,
    pub host: String,
    pub cause: Cause,
    pub stderr_tail: Vec<String>,
}

/// How a rank failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cause {
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// The command could not be started; `code` follows the shell (127, 126).
    StartFailed {
        message: String,
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
                let name = Signal::try_from(*sig).map(|s| s.as_str()).unwrap_or("unknown signal");
                write!(f, "was killed by signal {sig} ({name})")
            }
            Cause::Exited { .. } => write!(f, "ended"),
            Cause::StartFailed { message, .. } => f.write_str(message),
            Cause::Lost(reason) => write!(f, "was lost: {reason}"),
        }
    }
}

/// How a command job ended.
#[derive(Clone, Debug)]
pub struct JobOutcome {
    /// 0, the first failure's code, or 128 + the signal that interrupted the job.
    pub exit_code: i32,
    pub failure: Option<Failure>,
    pub interrupted_by: Option<Signal>,
}

/// A call's bytes, or why there are none.
enum CallError {
    /// The user's code failed (its message).
    Task(String),
    /// The worker was lost (why).
    Lost(String),
}

type CallResult = Result<Vec<u8>, CallError>;

enum Event {
    Exited { rank: u32, code: Option<i32>, signal: Option<i32> },
    StartFailed { rank: u32, message: String, code: i32 },
    Lost { rank: u32, reason: String },
}

/// The driver's side of one worker's connection.
struct Link {
    info: WorkerInfo,
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Mutex<HashMap<u64, oneshot::Sender<CallResult>>>,
    created: Mutex<Option<oneshot::Sender<Result<(), String>>>>,
    lost: Mutex<Option<String>>,
    /// When the worker was last heard from, in ms since `epoch`; checked by
    /// the watchdog (a timer per frame would cost more than the frame).
    last_heard_ms: AtomicU64,
    epoch: std::time::Instant,
}

impl Link {
    fn describe(&self) -> String {
        format!("rank {} on host {}", self.info.rank, self.info.hostname)
    }

    fn lost_reason(&self) -> Option<String> {
        self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    async fn send(&self, message: &ToWorker) -> Result<(), ExecError> {
        if let Some(reason) = self.lost_reason() {
            return Err(self.lost_error(reason));
        }
        let frame =
            proto::encode(message).map_err(|source| ExecError::Io { what: "encoding a message".into(), source })?;
        let mut writer = self.writer.lock().await;
        writer.write_all(&frame).await.map_err(|e| self.lost_error(format!("cannot send to it: {e}")))
    }

    fn lost_error(&self, reason: String) -> ExecError {
        ExecError::WorkerLost { rank: self.info.rank, host: self.info.hostname.clone(), reason }
    }

    /// Marks the worker lost and fails everything waiting on it.
    fn mark_lost(&self, reason: &str) -> bool {
        let mut lost = self.lost.lock().unwrap_or_else(|p| p.into_inner());
        if lost.is_some() {
            return false;
        }
        *lost = Some(reason.to_string());
        drop(lost);
        let message = format!("worker {} was lost: {reason}", self.describe());
        for (_, tx) in self.pending.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            let _ = tx.send(Err(CallError::Lost(reason.to_string())));
        }
        if let Some(tx) = self.created.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = tx.send(Err(message));
        }
        true
    }
}

struct Running {
    links: Vec<Arc<Link>>,
    server: RendezvousServer,
    sink: Arc<OutputSink>,
    events: mpsc::UnboundedReceiver<Event>,
    /// One reader per worker; they end when the workers' connections do.
    readers: JoinSet<()>,
    /// Heartbeats and the watchdog; they run until shutdown.
    background: JoinSet<()>,
    stopping: Arc<std::sync::atomic::AtomicBool>,
}

/// Runs user code on a set of worker processes; see the crate docs.
pub struct Executor {
    settings: Settings,
    request: WorkerRequest,
    engine: Box<dyn Engine>,
    running: Option<Running>,
    next_id: AtomicU64,
    nic_report: Vec<crate::nics::PairReport>,
}

impl Executor {
    /// An executor on this machine (the local engine).
    pub fn new(settings: Settings, request: WorkerRequest) -> Result<Self, ExecError> {
        Self::with_engine(settings, request, Box::new(LocalEngine::this_machine()))
    }

    /// An executor on a host list: local processes when every host is this
    /// machine, ssh (with `settings.ssh`) otherwise, Slurm inside an allocation.
    pub fn on_hosts(
        settings: Settings,
        request: WorkerRequest,
        hosts: Vec<kolo_topology::HostSpec>,
    ) -> Result<Self, ExecError> {
        let engine: Box<dyn Engine> = match crate::EngineChoice::Auto.resolve(&hosts) {
            crate::EngineChoice::Slurm => Box::new(crate::SlurmEngine::from_allocation()?),
            crate::EngineChoice::Ssh => Box::new(crate::SshEngine::new(hosts, settings.ssh.clone())),
            _ => Box::new(LocalEngine::with_hosts(hosts)),
        };
        Self::with_engine(settings, request, engine)
    }

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
        Ok(Executor { settings, request, engine, running: None, next_id: AtomicU64::new(1), nic_report: Vec::new() })
    }

    /// The workers in rank order (after `start`).
    pub fn workers(&self) -> Vec<WorkerInfo> {
        self.running.as_ref().map(|r| r.links.iter().map(|l| l.info.clone()).collect()).unwrap_or_default()
    }

    /// What interface detection found, host by host around the ring (after
    /// `start`; empty when the interfaces were given or all workers share a host).
    pub fn nic_report(&self) -> &[crate::nics::PairReport] {
        &self.nic_report
    }

    /// The rendezvous server's address (after `start`).
    pub fn rendezvous_addr(&self) -> Option<SocketAddr> {
        self.running.as_ref().map(|r| r.server.addr())
    }

    /// Starts the workers and creates the executable `E` in each from `args`.
    pub async fn start<E: Executable>(
        &mut self,
        args: &E::Args,
        extra_env: &[(String, String)],
    ) -> Result<(), ExecError> {
        let encoded = postcard::to_stdvec(args).map_err(|e| ExecError::Encode(e.to_string()))?;
        self.start_workers(extra_env).await?;
        let result = self.create(name_of::<E>(), encoded).await;
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
        self.start_workers(extra_env).await?;
        let argv: Vec<Vec<u8>> = argv.iter().map(|a| a.as_bytes().to_vec()).collect();
        let message = ToWorker::StartCommand { argv };
        for link in &self.running()?.links {
            link.send(&message).await?;
        }
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
            *link.created.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
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

    /// Runs `task` on every worker's executable; results in rank order.
    pub async fn execute<E: Executable, T: Task<E>>(&self, task: &T) -> Result<Vec<T::Output>, ExecError> {
        let handles = self.call_all(CallKind::Task, name_of::<T>(), task, None).await?;
        join_all(handles).await
    }

    /// Runs `task` on rank 0 only.
    pub async fn execute_single<E: Executable, T: Task<E>>(&self, task: &T) -> Result<T::Output, ExecError> {
        let mut handles = self.call_all(CallKind::Task, name_of::<T>(), task, Some(0)).await?;
        handles.remove(0).join().await
    }

    /// Runs the plain function `function` on every worker; results in rank order.
    pub async fn run<F: Function>(&self, function: &F) -> Result<Vec<F::Output>, ExecError> {
        let handles = self.call_all(CallKind::Function, name_of::<F>(), function, None).await?;
        join_all(handles).await
    }

    /// Starts `task` on every worker and returns a handle per rank at once.
    pub async fn run_remote<E: Executable, T: Task<E>>(
        &self,
        task: &T,
    ) -> Result<Vec<CallHandle<T::Output>>, ExecError> {
        self.call_all(CallKind::Task, name_of::<T>(), task, None).await
    }

    /// Starts the plain function on every worker and returns a handle per rank.
    pub async fn run_remote_function<F: Function>(
        &self,
        function: &F,
    ) -> Result<Vec<CallHandle<F::Output>>, ExecError> {
        self.call_all(CallKind::Function, name_of::<F>(), function, None).await
    }

    async fn call_all<A: serde::Serialize, O: DeserializeOwned>(
        &self,
        kind: CallKind,
        name: &str,
        args: &A,
        only: Option<u32>,
    ) -> Result<Vec<CallHandle<O>>, ExecError> {
        let running = self.running()?;
        let args = postcard::to_stdvec(args).map_err(|e| ExecError::Encode(e.to_string()))?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let message = ToWorker::Call { id, kind, name: name.to_string(), args };
        let frame =
            proto::encode(&message).map_err(|source| ExecError::Io { what: "encoding a call".into(), source })?;
        let mut handles = Vec::new();
        for link in running.links.iter().filter(|l| only.is_none_or(|r| r == l.info.rank)) {
            let (tx, rx) = oneshot::channel();
            link.pending.lock().unwrap_or_else(|p| p.into_inner()).insert(id, tx);
            if let Some(reason) = link.lost_reason() {
                link.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                return Err(link.lost_error(reason));
            }
            let sent = link.writer.lock().await.write_all(&frame).await;
            if let Err(e) = sent {
                link.mark_lost(&format!("cannot send to it: {e}"));
                return Err(link.lost_error(format!("cannot send to it: {e}")));
            }
            handles.push(CallHandle { link: link.clone(), id, rx: Some(rx), _output: PhantomData });
        }
        Ok(handles)
    }

    /// Starts the workers without an executable (RayExecutor's
    /// `executable_cls=None`): `run` and `run_remote_function` work.
    pub async fn start_workers(&mut self, extra_env: &[(String, String)]) -> Result<(), ExecError> {
        if self.running.is_some() {
            return Err(ExecError::AlreadyStarted);
        }
        match self.start_inner(extra_env).await {
            Ok(running) => {
                self.running = Some(running);
                Ok(())
            }
            Err(e) => {
                self.engine.kill_all();
                Err(e)
            }
        }
    }

    async fn start_inner(&mut self, extra_env: &[(String, String)]) -> Result<Running, ExecError> {
        let settings = self.settings.clone();
        let n = self.request.num_workers() as usize;
        // 1. placement
        let hosts = self.engine.hosts()?;
        let placed = place(self.request.placement, self.request.resources, &hosts)?;
        // 2. workers, told where to dial back
        let listener = TcpListener::bind(SocketAddr::new(self.engine.driver_addr(), 0))
            .await
            .map_err(|source| ExecError::Io { what: "listening for workers".into(), source })?;
        let control =
            listener.local_addr().map_err(|source| ExecError::Io { what: "listening for workers".into(), source })?;
        let program = match &settings.worker_program {
            Some(p) => p.clone(),
            None => std::env::current_exe()
                .map_err(|source| ExecError::Io { what: "finding this program".into(), source })?,
        };
        let launches: Vec<WorkerLaunch> = placed
            .iter()
            .enumerate()
            .map(|(index, p)| {
                let host = hosts[p.host].clone();
                let gpus: Vec<String> = p.gpu_ids.iter().map(u32::to_string).collect();
                WorkerLaunch {
                    index: index as u32,
                    env: vec![
                        (worker::env::DRIVER.into(), control.to_string()),
                        (worker::env::INDEX.into(), index.to_string()),
                        (worker::env::SECRET.into(), settings.secret.clone()),
                        (worker::env::HOSTNAME.into(), host.hostname.clone()),
                        (worker::env::NODE_ID.into(), host.node_id.clone()),
                        (worker::env::GPUS.into(), gpus.join(",")),
                    ],
                    host,
                    gpus: p.gpu_ids.clone(),
                    program: program.clone(),
                    args: Vec::new(),
                }
            })
            .collect();
        let expected_hosts: Vec<String> = launches.iter().map(|l| l.host.hostname.clone()).collect();
        self.engine.spawn(launches)?;
        tracing::debug!(workers = n, %control, engine = self.engine.name(), "workers spawned");

        // 3. every worker connects and proves the secret
        let mut hellos = self.accept_workers(&listener, n, &expected_hosts).await?;
        hellos.sort_by_key(|(hello, _)| hello.index);

        // 4. ranks: registration in creation order
        let mut coordinator = Coordinator::new();
        for (hello, _) in &hellos {
            coordinator.register(&hello.hostname, &hello.node_id, hello.index);
        }
        let infos = coordinator.finalize()?;

        // 5. rendezvous server sized by the plan
        let slots: Vec<Slot> = hellos
            .iter()
            .zip(&infos)
            .map(|((hello, _), info)| Slot { host: hello.node_id.clone(), info: info.clone() })
            .collect();
        let mut server_config = ServerConfig::new(SocketAddr::new(self.engine.driver_addr(), 0));
        server_config.secret = Some(settings.secret.clone());
        server_config.require_secret = settings.rendezvous_require_secret;
        let server = RendezvousServer::start(server_config, &slots).await?;

        // 6. env: ranks, rendezvous, extra env, then interfaces
        let (nics, report) = match &settings.nics {
            Some(nics) => (nics.clone(), Vec::new()),
            None => {
                let deadline = Instant::now() + settings.start_timeout;
                detect_nics(&mut hellos, deadline, self.engine.default_nics()).await?
            }
        };
        self.nic_report = report;
        let job = JobEnv {
            rendezvous_addr: server.addr().ip().to_string(),
            rendezvous_port: server.addr().port(),
            ifaces: nics,
            timeout_s: settings.start_timeout.as_secs().max(1),
            master_addr: self.engine.driver_addr().to_string(),
            master_port: free_port(self.engine.driver_addr())?,
            elastic: false,
            job_id: random_hex(8),
        };
        let nodes: Vec<&str> = hellos.iter().map(|(h, _)| h.node_id.as_str()).collect();
        let gpus: Vec<Vec<u32>> = hellos.iter().map(|(h, _)| h.gpus.clone()).collect();
        let visible = cuda_visible_devices(&nodes, &gpus);
        let sink = Arc::new(OutputSink::new(settings.output.clone(), n)?);
        let (event_tx, events) = mpsc::unbounded_channel();
        let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (mut readers, mut background) = (JoinSet::new(), JoinSet::new());
        let mut links = Vec::with_capacity(n);
        let mut watched = Vec::with_capacity(n);
        for (((hello, stream), info), visible) in hellos.into_iter().zip(infos).zip(visible) {
            let mut env = rank_env(&info, &hello.node_id, &job, visible.as_deref());
            env.extend(extra_env.iter().cloned());
            let (reader, writer) = stream.into_split();
            let link = Arc::new(Link {
                info: WorkerInfo {
                    rank: hello.index,
                    hostname: hello.hostname,
                    node_id: hello.node_id,
                    pid: hello.pid,
                    gpus: hello.gpus,
                    ranks: info,
                    env,
                },
                writer: tokio::sync::Mutex::new(writer),
                pending: Mutex::new(HashMap::new()),
                created: Mutex::new(None),
                lost: Mutex::new(None),
                last_heard_ms: AtomicU64::new(0),
                epoch: std::time::Instant::now(),
            });
            let reading =
                readers.spawn(read_worker(link.clone(), reader, sink.clone(), event_tx.clone(), stopping.clone()));
            background.spawn(send_heartbeats(link.clone(), settings.heartbeat_interval));
            watched.push((link.clone(), reading));
            links.push(link);
        }
        background.spawn(watch_heartbeats(watched, settings.heartbeat_timeout, event_tx, stopping.clone()));
        // 7. env pushed to every worker (the job secret goes to kolo's own clients)
        let forwarded: Vec<(String, String)> = std::env::vars()
            .filter(|(name, _)| kolo_topology::forwards_caller_var(name) && !name.starts_with("KOLO_WORKER_"))
            .collect();
        for link in &links {
            let mut vars = forwarded.clone();
            vars.extend(link.info.env.clone());
            vars.push((kolo_topology::ENV_SECRET.into(), settings.secret.clone()));
            link.send(&ToWorker::SetEnv(vars)).await?;
        }
        Ok(Running { links, server, sink, events, readers, background, stopping })
    }

    async fn accept_workers(
        &mut self,
        listener: &TcpListener,
        n: usize,
        hosts: &[String],
    ) -> Result<Vec<(Hello, TcpStream)>, ExecError> {
        let deadline = Instant::now() + self.settings.start_timeout;
        let mut registered: Vec<Option<(Hello, TcpStream)>> = (0..n).map(|_| None).collect();
        let mut handshakes = JoinSet::new();
        let mut poll = tokio::time::interval(Duration::from_millis(50));
        let mut failed_since: Option<Instant> = None;
        // workers that are in wait for the rest; they must hear from us meanwhile
        let heartbeat =
            proto::encode(&ToWorker::Heartbeat).map_err(|source| ExecError::Io { what: "encoding".into(), source })?;
        let mut next_heartbeat = Instant::now() + self.settings.heartbeat_interval;
        let mut progress = Progress::new("waiting for workers to connect");
        let welcome = Welcome {
            tag: [0; 32],
            heartbeat_interval_ms: self.settings.heartbeat_interval.as_millis() as u64,
            heartbeat_timeout_ms: self.settings.heartbeat_timeout.as_millis() as u64,
            kill_grace_ms: self.settings.kill_grace.as_millis() as u64,
        };
        while registered.iter().any(Option::is_none) {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((stream, peer)) = accepted else { continue };
                    let (secret, welcome) = (self.settings.secret.clone(), welcome.clone());
                    handshakes.spawn(async move {
                        let limit = Duration::from_secs(10);
                        let result = tokio::time::timeout(limit, handshake(stream, secret.as_bytes(), welcome, n)).await;
                        (peer, result.unwrap_or_else(|_| Err(HandshakeError::Refused("no hello in time".into()))))
                    });
                }
                Some(done) = handshakes.join_next(), if !handshakes.is_empty() => {
                    let Ok((peer, result)) = done else { continue };
                    match result {
                        Ok((hello, stream)) => {
                            let slot = &mut registered[hello.index as usize];
                            if slot.is_some() {
                                tracing::warn!(%peer, index = hello.index, "refused a second worker with the same index");
                                continue;
                            }
                            tracing::debug!(index = hello.index, host = %hello.hostname, pid = hello.pid, "worker registered");
                            *slot = Some((hello, stream));
                        }
                        Err(HandshakeError::Refused(why)) => tracing::warn!(%peer, "refused a control connection: {why}"),
                        Err(HandshakeError::Fatal(e)) => return Err(e),
                    }
                }
                _ = poll.tick() => {
                    let connected = registered.iter().filter(|r| r.is_some()).count();
                    progress.show(&format!("{connected} of {n}"), self.settings.start_timeout);
                    if Instant::now() >= next_heartbeat {
                        next_heartbeat = Instant::now() + self.settings.heartbeat_interval;
                        for (_, stream) in registered.iter_mut().flatten() {
                            let _ = stream.write_all(&heartbeat).await;
                        }
                    }
                    let failed: Vec<(u32, String)> =
                        self.engine.exited().into_iter().filter(|(i, _)| registered[*i as usize].is_none()).collect();
                    if !failed.is_empty() {
                        // hosts fail together (unreachable ones time out alike):
                        // a moment more names them all
                        let first_seen = *failed_since.get_or_insert_with(Instant::now);
                        if first_seen.elapsed() >= Duration::from_secs(1) || Instant::now() >= deadline {
                            let mut reasons: Vec<String> = Vec::new();
                            for (index, how) in &failed {
                                let line = format!("host {}: {how}", hosts[*index as usize]);
                                if !reasons.contains(&line) {
                                    reasons.push(line);
                                }
                            }
                            let (index, _) = failed[0];
                            return Err(ExecError::WorkerStart {
                                index,
                                host: hosts[index as usize].clone(),
                                reason: format!("workers exited before connecting: {}", reasons.join("; ")),
                            });
                        }
                    }
                    if Instant::now() >= deadline {
                        let missing: Vec<String> = registered
                            .iter()
                            .enumerate()
                            .filter(|(_, r)| r.is_none())
                            .map(|(i, _)| format!("worker {i} on host {}", hosts[i]))
                            .collect();
                        return Err(ExecError::StartTimeout { seconds: self.settings.start_timeout.as_secs_f64(), missing: missing.join(", ") });
                    }
                }
            }
        }
        drop(progress);
        Ok(registered.into_iter().map(|r| r.expect("all registered")).collect())
    }

    /// Waits for the OS command of every worker to end. The first failure
    /// (or `interrupt`) stops the others: SIGTERM, then SIGKILL after the
    /// grace period.
    pub async fn wait_command(&mut self, interrupt: impl Future<Output = Signal>) -> Result<JobOutcome, ExecError> {
        let grace = self.settings.kill_grace;
        let running = self.running.as_mut().ok_or(ExecError::NotStarted)?;
        tokio::pin!(interrupt);
        let mut remaining: Vec<bool> = vec![true; running.links.len()];
        let mut failure: Option<Failure> = None;
        let mut interrupted_by = None;
        let mut kill_at: Option<Instant> = None;
        while remaining.iter().any(|&r| r) {
            let mut teardown = false;
            tokio::select! {
                event = running.events.recv() => {
                    let Some(event) = event else { break };
                    let (rank, cause) = match event {
                        Event::Exited { rank, code: Some(0), .. } => { remaining[rank as usize] = false; continue; }
                        Event::Exited { rank, code, signal } => (rank, Cause::Exited { code, signal }),
                        Event::StartFailed { rank, message, code } => (rank, Cause::StartFailed { message, code }),
                        Event::Lost { rank, reason } => (rank, Cause::Lost(reason)),
                    };
                    if !std::mem::replace(&mut remaining[rank as usize], false) {
                        continue;
                    }
                    if failure.is_none() && interrupted_by.is_none() {
                        let host = running.links[rank as usize].info.hostname.clone();
                        failure = Some(Failure { rank, host, cause, stderr_tail: Vec::new() });
                        teardown = kill_at.is_none();
                    }
                }
                signal = &mut interrupt, if interrupted_by.is_none() => {
                    tracing::warn!("received {}; stopping the job", signal.as_str());
                    interrupted_by = Some(signal);
                    teardown = kill_at.is_none();
                }
                _ = sleep_until_opt(kill_at) => {
                    tracing::warn!("ranks still running {grace:?} after SIGTERM; sending SIGKILL");
                    signal_commands(&running.links, Signal::SIGKILL).await;
                    kill_at = Some(Instant::now() + Duration::from_secs(3600));
                }
            }
            if teardown {
                signal_commands(&running.links, Signal::SIGTERM).await;
                kill_at = Some(Instant::now() + grace);
            }
        }
        let failure = failure.map(|mut f| {
            f.stderr_tail = running.sink.stderr_tail(f.rank as usize);
            f
        });
        let exit_code = match (&failure, interrupted_by) {
            (_, Some(signal)) => 128 + signal as i32,
            (Some(f), None) => f.cause.exit_code(),
            (None, None) => 0,
        };
        Ok(JobOutcome { exit_code, failure, interrupted_by })
    }

    /// Stops executables and workers and the rendezvous server; waits up to
    /// the grace period (plus a little) before killing what is left.
    pub async fn shutdown(&mut self) {
        let Some(mut running) = self.running.take() else {
            self.engine.kill_all();
            return;
        };
        running.stopping.store(true, Ordering::Relaxed);
        running.background.abort_all();
        for link in &running.links {
            let _ = link.send(&ToWorker::Stop).await;
        }
        let deadline = Instant::now() + self.settings.kill_grace + Duration::from_secs(2);
        while !self.engine.all_exited() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.engine.kill_all();
        // let the readers forward the workers' last output
        let drain = async { while running.readers.join_next().await.is_some() {} };
        let limit = Duration::from_millis(500);
        if tokio::time::timeout(limit, drain).await.is_err() {
            running.readers.abort_all();
        }
        running.server.stop().await;
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        // no await here: kill outright; the rendezvous server stops on drop
        self.engine.kill_all();
    }
}

/// Reads frames until `pick` accepts one (heartbeats and early output are
/// skipped), within `deadline`.
async fn await_reply<T>(
    stream: &mut TcpStream,
    deadline: Instant,
    what: &str,
    host: &str,
    mut pick: impl FnMut(ToDriver) -> Option<T>,
) -> Result<T, ExecError> {
    loop {
        let frame = tokio::time::timeout_at(deadline, proto::read_frame_async(stream))
            .await
            .map_err(|_| ExecError::Nics(format!("host {host} did not answer the {what} before the start timeout")))?
            .map_err(|e| ExecError::Nics(format!("host {host} was lost during the {what}: {e}")))?;
        let message: ToDriver = proto::decode(&frame)
            .map_err(|e| ExecError::Nics(format!("host {host}: unreadable {what} answer: {e}")))?;
        if let Some(reply) = pick(message) {
            return Ok(reply);
        }
    }
}

/// One agent per host lists and probes interfaces in a ring; see `nics`.
/// All workers on one host use `single_host` (loopback by default).
async fn detect_nics(
    hellos: &mut [(Hello, TcpStream)],
    deadline: Instant,
    single_host: Vec<String>,
) -> Result<(Vec<String>, Vec<crate::nics::PairReport>), ExecError> {
    let mut reps: Vec<usize> = Vec::new();
    for (i, (hello, _)) in hellos.iter().enumerate() {
        if !reps.iter().any(|&r| hellos[r].0.node_id == hello.node_id) {
            reps.push(i);
        }
    }
    if reps.len() < 2 {
        let nics = if single_host.is_empty() { vec!["lo".to_string()] } else { single_host };
        return Ok((nics, Vec::new()));
    }
    let frame = |m: &ToWorker| proto::encode(m).map_err(|source| ExecError::Io { what: "encoding".into(), source });
    let listen = frame(&ToWorker::ProbeListen)?;
    for &r in &reps {
        let host = hellos[r].0.hostname.clone();
        hellos[r].1.write_all(&listen).await.map_err(|e| ExecError::Nics(format!("host {host}: {e}")))?;
    }
    let mut listeners = Vec::new();
    for &r in &reps {
        let host = hellos[r].0.hostname.clone();
        let ready = await_reply(&mut hellos[r].1, deadline, "interface listing", &host, |m| match m {
            ToDriver::ProbeReady { port, interfaces } => Some((port, interfaces)),
            _ => None,
        })
        .await?;
        listeners.push(ready);
    }
    // every probe gets what is left of the start timeout
    let timeout_ms = deadline.saturating_duration_since(Instant::now()).as_millis().max(100) as u64;
    for (k, &r) in reps.iter().enumerate() {
        let next = (k + 1) % reps.len();
        let (port, interfaces) = &listeners[next];
        let targets: Vec<(String, String, u16)> = interfaces
            .iter()
            .flat_map(|(name, addrs)| addrs.iter().map(move |a| (name.clone(), a.clone(), *port)))
            .collect();
        let probe = frame(&ToWorker::Probe { index: hellos[reps[next]].0.index, targets, timeout_ms })?;
        let host = hellos[r].0.hostname.clone();
        hellos[r].1.write_all(&probe).await.map_err(|e| ExecError::Nics(format!("host {host}: {e}")))?;
    }
    let mut pairs = Vec::new();
    for (k, &r) in reps.iter().enumerate() {
        let host = hellos[r].0.hostname.clone();
        let results =
            await_reply(&mut hellos[r].1, deadline + Duration::from_secs(1), "interface probe", &host, |m| match m {
                ToDriver::ProbeResult { results } => Some(results),
                _ => None,
            })
            .await?;
        let to = hellos[reps[(k + 1) % reps.len()]].0.hostname.clone();
        pairs.push(crate::nics::PairReport { from: host, to, results });
    }
    let common = crate::nics::common(&pairs).map_err(ExecError::Nics)?;
    Ok((common, pairs))
}

/// A one-line progress report on stderr for waits over a second, shown
/// only when stderr is a terminal and erased when the wait ends.
struct Progress {
    what: &'static str,
    since: Instant,
    shown: bool,
    tty: bool,
    last: String,
}

impl Progress {
    fn new(what: &'static str) -> Self {
        use std::io::IsTerminal;
        Progress {
            what,
            since: Instant::now(),
            shown: false,
            tty: std::io::stderr().is_terminal(),
            last: String::new(),
        }
    }

    fn show(&mut self, state: &str, limit: Duration) {
        let waited = self.since.elapsed();
        if self.tty && waited > Duration::from_secs(1) {
            let line = format!("kolo: {}: {state} ({} s of {:.0} s)", self.what, waited.as_secs(), limit.as_secs_f64());
            if line != self.last {
                eprint!("\r{line}\x1b[K");
                self.last = line;
                self.shown = true;
            }
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if self.shown {
            eprint!("\r\x1b[K");
        }
    }
}

/// A call running on one worker.
pub struct CallHandle<T> {
    link: Arc<Link>,
    id: u64,
    rx: Option<oneshot::Receiver<CallResult>>,
    _output: PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned> CallHandle<T> {
    /// The rank the call runs on.
    pub fn rank(&self) -> u32 {
        self.link.info.rank
    }

    /// Waits for the result.
    pub async fn join(mut self) -> Result<T, ExecError> {
        let rx = self.rx.take().ok_or(ExecError::Cancelled)?;
        let result = rx.await.map_err(|_| self.link.lost_error("its connection ended".into()))?;
        self.decode(result)
    }

    /// The result if it is there, without waiting; `None` while running.
    pub fn try_result(&mut self) -> Option<Result<T, ExecError>> {
        let rx = self.rx.as_mut()?;
        match rx.try_recv() {
            Ok(result) => {
                self.rx = None;
                Some(self.decode(result))
            }
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => {
                self.rx = None;
                Some(Err(self.link.lost_error("its connection ended".into())))
            }
        }
    }

    /// Gives the call up: it is skipped if it has not started, and its
    /// result is dropped otherwise.
    pub async fn cancel(mut self) -> Result<(), ExecError> {
        self.rx = None;
        self.link.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
        self.link.send(&ToWorker::Cancel { id: self.id }).await
    }

    fn decode(&self, result: CallResult) -> Result<T, ExecError> {
        let bytes = result.map_err(|e| match e {
            CallError::Task(message) => {
                ExecError::Task { rank: self.link.info.rank, host: self.link.info.hostname.clone(), message }
            }
            CallError::Lost(reason) => self.link.lost_error(reason),
        })?;
        postcard::from_bytes(&bytes)
            .map_err(|e| ExecError::Encode(format!("result of rank {}: {e}", self.link.info.rank)))
    }
}

async fn join_all<T: DeserializeOwned>(handles: Vec<CallHandle<T>>) -> Result<Vec<T>, ExecError> {
    // wait for every rank so the executor is idle again, then report the
    // first failure in rank order
    let mut results = Vec::with_capacity(handles.len());
    for handle in handles {
        results.push(handle.join().await);
    }
    results.into_iter().collect()
}

enum HandshakeError {
    /// This connection is refused; others may still come.
    Refused(String),
    /// The job cannot go on (a version mismatch).
    Fatal(ExecError),
}

async fn handshake(
    mut stream: TcpStream,
    secret: &[u8],
    mut welcome: Welcome,
    workers: usize,
) -> Result<(Hello, TcpStream), HandshakeError> {
    let refused = |why: String| HandshakeError::Refused(why);
    stream.set_nodelay(true).map_err(|e| refused(e.to_string()))?;
    let nonce = proto::random_nonce();
    let challenge = Challenge { magic: MAGIC, version: PROTOCOL_VERSION, nonce };
    let frame = proto::encode(&challenge).map_err(|e| refused(e.to_string()))?;
    stream.write_all(&frame).await.map_err(|e| refused(e.to_string()))?;
    let body = proto::read_frame_async(&mut stream).await.map_err(|e| refused(format!("no hello: {e}")))?;
    let hello: Hello = proto::decode(&body).map_err(|e| refused(format!("not a kolo worker: {e}")))?;
    if hello.magic != MAGIC {
        return Err(refused("not a kolo worker".into()));
    }
    if hello.version != PROTOCOL_VERSION {
        return Err(HandshakeError::Fatal(ExecError::Version {
            index: hello.index,
            host: hello.hostname,
            worker: hello.version,
        }));
    }
    if !proto::tags_match(&hello.tag, &proto::worker_tag(secret, &nonce, &hello.nonce)) {
        return Err(refused(format!(
            "worker {} on {} (pid {}) does not know the job secret",
            hello.index, hello.hostname, hello.pid
        )));
    }
    if hello.index as usize >= workers {
        return Err(refused(format!("worker index {} is out of range", hello.index)));
    }
    welcome.tag = proto::driver_tag(secret, &nonce, &hello.nonce);
    let frame = proto::encode(&welcome).map_err(|e| refused(e.to_string()))?;
    stream.write_all(&frame).await.map_err(|e| refused(e.to_string()))?;
    Ok((hello, stream))
}

async fn read_worker(
    link: Arc<Link>,
    reader: OwnedReadHalf,
    sink: Arc<OutputSink>,
    events: mpsc::UnboundedSender<Event>,
    stopping: Arc<std::sync::atomic::AtomicBool>,
) {
    let rank = link.info.rank;
    // one read takes in whatever the worker sent, not a frame header at a time
    let mut reader = tokio::io::BufReader::with_capacity(256 * 1024, reader);
    let mut splitters = [LineSplitter::default(), LineSplitter::default()];
    let reason = loop {
        let frame = match proto::read_frame_async(&mut reader).await {
            Ok(frame) => frame,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset) => {
                break "its connection closed (the worker process died?)".to_string()
            }
            Err(e) => break format!("its connection failed: {e}"),
        };
        link.last_heard_ms.store(link.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
        let message: ToDriver = match proto::decode(&frame) {
            Ok(m) => m,
            Err(e) => break format!("it sent an unreadable message: {e}"),
        };
        match message {
            ToDriver::Heartbeat
            | ToDriver::CommandStarted { .. }
            | ToDriver::ProbeReady { .. }
            | ToDriver::ProbeResult { .. } => {}
            ToDriver::Output { stderr, data } => {
                let stream = if stderr { Stream::Stderr } else { Stream::Stdout };
                splitters[stderr as usize].push(&data, |line| sink.line(rank as usize, stream, line));
            }
            ToDriver::CommandStartFailed { message, code } => {
                let _ = events.send(Event::StartFailed { rank, message, code });
            }
            ToDriver::CommandExited { code, signal } => {
                flush_partial(&mut splitters, &sink, rank);
                let _ = events.send(Event::Exited { rank, code, signal });
            }
            ToDriver::Created { result } => {
                if let Some(tx) = link.created.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    let _ = tx.send(result);
                }
            }
            ToDriver::Done { id, result } => {
                if let Some(tx) = link.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&id) {
                    let _ = tx.send(result.map_err(CallError::Task));
                }
            }
        }
    };
    flush_partial(&mut splitters, &sink, rank);
    let expected = stopping.load(Ordering::Relaxed);
    if link.mark_lost(if expected { "the executor was shut down" } else { &reason }) && !expected {
        tracing::warn!("worker {} was lost: {reason}", link.describe());
        let _ = events.send(Event::Lost { rank, reason });
    }
}

fn flush_partial(splitters: &mut [LineSplitter; 2], sink: &OutputSink, rank: u32) {
    for (i, splitter) in splitters.iter_mut().enumerate() {
        if let Some(rest) = splitter.finish() {
            sink.line(rank as usize, if i == 1 { Stream::Stderr } else { Stream::Stdout }, &rest);
        }
    }
}

/// Reports a worker lost once it has been silent for `timeout` (hung,
/// stopped, or cut off without its connection closing).
async fn watch_heartbeats(
    links: Vec<(Arc<Link>, tokio::task::AbortHandle)>,
    timeout: Duration,
    events: mpsc::UnboundedSender<Event>,
    stopping: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut ticks = tokio::time::interval((timeout / 10).max(Duration::from_millis(10)));
    loop {
        ticks.tick().await;
        if stopping.load(Ordering::Relaxed) {
            return;
        }
        for (link, reading) in &links {
            let heard = Duration::from_millis(link.last_heard_ms.load(Ordering::Relaxed));
            let silent = link.epoch.elapsed().saturating_sub(heard);
            if silent > timeout {
                let reason = format!("no heartbeat for {:.1} s (hung or stopped?)", silent.as_secs_f64());
                reading.abort();
                if link.mark_lost(&reason) {
                    tracing::warn!("worker {} was lost: {reason}", link.describe());
                    let _ = events.send(Event::Lost { rank: link.info.rank, reason });
                }
            }
        }
        if links.iter().all(|(l, _)| l.lost_reason().is_some()) {
            return;
        }
    }
}

async fn send_heartbeats(link: Arc<Link>, interval: Duration) {
    let mut ticks = tokio::time::interval(interval);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        if link.send(&ToWorker::Heartbeat).await.is_err() {
            return;
        }
    }
}

async fn signal_commands(links: &[Arc<Link>], signal: Signal) {
    for link in links {
        let _ = link.send(&ToWorker::SignalCommand { signal: signal as i32 }).await;
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn free_port(ip: std::net::IpAddr) -> Result<u16, ExecError> {
    let io = |source| ExecError::Io { what: "finding a free port".into(), source };
    let listener = std::net::TcpListener::bind(SocketAddr::new(ip, 0)).map_err(io)?;
    Ok(listener.local_addr().map_err(io)?.port())
}

pub(crate) fn random_hex(bytes: usize) -> String {
    use rand::RngCore;
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    buf.iter().map(|b| format!("{b:02x}")).collect()
}
