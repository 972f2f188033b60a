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
//!     fn create(start: u64, _ctx: &WorkerContext) -> Result<Self, UserError> {
//!         Ok(Counter(start))
//!     }
//! }
//!
//! #[derive(Serialize, Deserialize)]
//! struct Add(u64);
//! impl Task<Counter> for Add {
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

mod driver;
mod engine;
mod launch;
mod nics;
mod output;
mod process;
mod proto;
mod registry;
mod slurm;
mod ssh;
mod worker;

pub use driver::{CallHandle, Cause, Executor, Failure, JobOutcome, Settings, WorkerInfo, WorkerRequest};
pub use engine::{Engine, LocalEngine, WorkerLaunch};
pub use launch::{is_this_machine, plan_job, run_job, EngineChoice, LaunchSpec, RankPlan};
pub use nics::PairReport;
pub use output::{LineSplitter, OutputOptions, OutputSink, Stream};
pub use proto::PROTOCOL_VERSION;
pub use registry::{Executable, Function, Registry, Task, UserError, WorkerContext};
pub use slurm::{SlurmEngine, SlurmOptions};
pub use ssh::{SshEngine, SshOptions};
pub use worker::{env as worker_env, serve_if_worker};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Topology(#[from] kolo_topology::TopologyError),
    #[error(transparent)]
    Rendezvous(#[from] kolo_rendezvous::RendezvousError),
    #[error("cannot write output to {path}: {source}")]
    OutputDir { path: PathBuf, source: std::io::Error },
    #[error("no command given; put it after '--', e.g. kolo run -np 2 -- python train.py")]
    NoCommand,
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("invalid settings: {0}")]
    BadSettings(String),
    #[error("the executor is not started; call start first")]
    NotStarted,
    #[error("the executor is started already; shut it down before starting again")]
    AlreadyStarted,
    #[error("worker {index} on host {host} could not start: {reason}")]
    WorkerStart { index: u32, host: String, reason: String },
    #[error("timed out after {seconds:.1} s waiting for workers to connect: {missing} did not (raise the start timeout if they are slow)")]
    StartTimeout { seconds: f64, missing: String },
    #[error("worker {index} on host {host} speaks protocol version {worker}, the driver {}; use the same kolo version everywhere", proto::PROTOCOL_VERSION)]
    Version { index: u32, host: String, worker: u32 },
    #[error("worker rank {rank} on host {host} was lost: {reason}")]
    WorkerLost { rank: u32, host: String, reason: String },
    #[error("task failed on rank {rank} (host {host}): {message}")]
    Task { rank: u32, host: String, message: String },
    #[error("slurm: {0}")]
    Slurm(String),
    #[error("network interface detection: {0}")]
    Nics(String),
    #[error("cannot encode or decode a value: {0}")]
    Encode(String),
    #[error("the call was cancelled")]
    Cancelled,
}
