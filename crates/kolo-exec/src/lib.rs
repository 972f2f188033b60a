//! kolo-exec: kolo's job driver.
//!
//! The [`Executor`] is RayExecutor's API in Rust: it places worker agents
//! through an [`Engine`], registers them, gives each its ranks and
//! environment, runs the rendezvous server, starts an executable in every
//! worker (a Rust type, or an OS command for `kolo run`), runs calls on all
//! of them and tears everything down.
//!
//! Workers are the same binary in worker mode: call [`serve_if_worker`]
//! first thing in `main` with a [`Registry`] of what workers may run.
//!
//! ```no_run
//! use kolo_exec::{Executable, Executor, Registry, Settings, Task, UserError, WorkerContext, WorkerRequest};
//! use serde::{Deserialize, Serialize};
//!
//! struct Counter(u64);
//! impl Executable for Counter {
//!     type Args = u64;
//!     const NAME: &'static str = "counter";
//!     fn create(start: u64, _ctx: &WorkerContext) -> Result<Self, UserError> {
//!         Ok(Counter(start))
//!     }
//! }
//!
//! #[derive(Serialize, Deserialize)]
//! struct Add(u64);
//! impl Task<Counter> for Add {
//!     const NAME: &'static str = "add";
//!     type Output = (u32, u64);
//!     fn run(self, counter: &mut Counter, ctx: &WorkerContext) -> Result<(u32, u64), UserError> {
//!         counter.0 += self.0;
//!         Ok((ctx.rank(), counter.0))
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), kolo_exec::ExecError> {
//!     kolo_exec::serve_if_worker(Registry::new().executable::<Counter>().task::<Counter, Add>());
//!     let mut executor = Executor::new(Settings::default(), WorkerRequest::pack(2))?;
//!     executor.start::<Counter>(&10, &[]).await?;
//!     let results = executor.execute(&Add(5)).await?;
//!     assert_eq!(results, vec![(0, 15), (1, 15)]);
//!     executor.shutdown().await;
//!     Ok(())
//! }
//! ```

pub mod control;
mod driver;
mod engine;
mod gpu;
mod guard;
pub mod hang;
mod hurry;
mod inspect;
mod nics;
mod output;
pub mod policy;
mod process;
mod proto;
mod registry;
mod settings;
mod sockets;
pub mod wait;
mod worker;

pub use driver::{CallHandle, Executor, Failure, JobOutcome, RankError, RankEvent, Report, WorkerInfo, REPORTS_QUEUED};
pub use engine::{
    is_this_machine, BridgeHost, Engine, EngineChoice, EngineOptions, HostSource, LocalEngine, RayEngine, RayNodes,
    RayOptions, RunsBridge, SlurmEngine, SlurmOptions, SshEngine, SshOptions, WorkerLaunch,
};
pub use guard::{Guard, GuardOptions};
pub use hurry::{calm, hurried, hurry};
pub use inspect::{own_progress_file, own_stall_file, py_spy_on_path};
pub use nics::PairReport;
pub use output::{LineSplitter, OutputOptions, OutputSink, Stream, MAX_LINE};
pub use policy::Cause;
pub use proto::{Progress, PROTOCOL_VERSION};
pub use registry::{
    build_id, set_build_id, Executable, Function, Registry, ReportError, Reporter, Task, UserError, WorkerContext,
    MAX_REPORT,
};
pub use settings::{Settings, SharedJob, SharedTorchStore, WorkerRequest};
pub use worker::{env as worker_env, serve_if_worker};

/// The Python hooks of kolo's ranks: the `sitecustomize` of every command
/// kolo starts, whose functions `kolo.Executor`'s workers call themselves.
pub const PYTHON_HOOKS: &str = include_str!("worker/sitecustomize.py");

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Topology(#[from] kolo_topology::TopologyError),
    #[error(transparent)]
    Rendezvous(#[from] kolo_rendezvous::RendezvousError),
    #[error("cannot write output to {path}: {source}")]
    OutputDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no command given; put it after '--', e.g. kolo run -np 2 -- python train.py")]
    NoCommand,
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// Bad input: what the user asked for cannot be (the message names it
    /// and the fix).
    #[error("invalid settings: {0}")]
    BadSettings(String),
    /// A blocking engine call is still running.
    #[error("the engine is busy with another call")]
    EngineBusy,
    /// An elastic job's hosts could not be discovered.
    #[error("{0}")]
    Discovery(String),
    #[error("the executor is not started; call start first")]
    NotStarted,
    #[error("the executor is started already; shut it down before starting again")]
    AlreadyStarted,
    /// Workers exited before they connected; `hosts`: every host where one did.
    #[error("worker {index} on host {host} could not start: {reason}")]
    WorkerStart { index: u32, host: String, reason: String, hosts: Vec<String> },
    /// `hosts`: where the workers that did not connect run.
    #[error("timed out after {seconds:.1} s waiting for workers to connect: {missing} did not (raise the start timeout if they are slow)")]
    StartTimeout { seconds: f64, missing: String, hosts: Vec<String> },
    #[error(
        "worker {index} speaks protocol version {worker}, the driver {}; use the same kolo version everywhere",
        proto::PROTOCOL_VERSION
    )]
    Version { index: u32, worker: u32 },
    #[error("the worker program {} on host {host} is another build ({worker}) than the driver ({driver}); run the same program build everywhere (--worker-program)", program.display())]
    Build { program: PathBuf, host: String, worker: String, driver: String },
    #[error("{workers} workers need about {needed} file descriptors in the driver, but it may open only {limit} (ulimit -n); raise the limit, e.g. ulimit -n {needed}")]
    DescriptorLimit { workers: usize, needed: u64, limit: u64 },
    #[error("the driver ran out of file descriptors while {workers} workers connected (raise ulimit -n)")]
    Descriptors {
        workers: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("worker rank {rank} on host {host} was lost: {reason}")]
    WorkerLost { rank: u32, host: String, reason: String },
    #[error("task failed on rank {rank} (host {host}): {message}")]
    Task { rank: u32, host: String, message: String },
    #[error("slurm: {what}: {detail}")]
    Slurm { what: String, detail: String },
    #[error("ray: {0}")]
    Ray(String),
    /// `host`: the host it is about, if one.
    #[error("network interface detection: {message}")]
    Nics { host: Option<String>, message: String },
    #[error("cannot encode a value: {0}")]
    Encode(#[source] postcard::Error),
    #[error("cannot decode the result of rank {rank}: {source}")]
    Decode {
        rank: u32,
        #[source]
        source: postcard::Error,
    },
    #[error("the call was cancelled")]
    Cancelled,
}

impl ExecError {
    /// The hosts this error is about, where it is about some and not the
    /// whole job (an elastic job leaves those out and goes on).
    pub fn hosts(&self) -> Vec<String> {
        match self {
            ExecError::WorkerStart { hosts, .. } | ExecError::StartTimeout { hosts, .. } => hosts.clone(),
            ExecError::Nics { host: Some(host), .. }
            | ExecError::WorkerLost { host, .. }
            | ExecError::Build { host, .. }
            | ExecError::Task { host, .. } => vec![host.clone()],
            _ => Vec::new(),
        }
    }
}

/// Locks `mutex` even if a thread panicked while holding it: what kolo
/// keeps behind its locks is whole at every point a panic could happen,
/// and one panicking task must not take the driver or an agent down.
pub fn lock<T: ?Sized>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
