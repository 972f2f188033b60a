//! kolo-exec: kolo's job driver.
//!
//! The [`Executor`] is RayExecutor's API in Rust: it places worker agents
//! through an [`Engine`](kolo_engine::Engine), registers them, gives each its ranks and
//! environment, runs the rendezvous server, starts an executable in every
//! worker (a Rust type, or an OS command for `kolo run`), runs calls on all
//! of them and tears everything down.
//!
//! Workers are the same binary in worker mode: call
//! [`serve_if_worker`](kolo_agent::serve_if_worker)
//! first thing in `main` with a [`Registry`](kolo_proto::Registry) of what
//! workers may run.
//!
//! ```no_run
//! use kolo_engine::WorkerRequest;
//! use kolo_exec::{Executor, Settings};
//! use kolo_proto::{Executable, Registry, Task, UserError, WorkerContext};
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
//! async fn main() -> Result<(), kolo_engine::ExecError> {
//!     kolo_agent::serve_if_worker(Registry::new().executable::<Counter>().task::<Counter, Add>());
//!     let mut executor = Executor::new(Settings::default(), WorkerRequest::pack(2))?;
//!     executor.start::<Counter>(&10, &[]).await?;
//!     let results = executor.execute(&Add(5)).await?;
//!     assert_eq!(results, vec![(0, 15), (1, 15)]);
//!     executor.shutdown().await;
//!     Ok(())
//! }
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod driver;
pub mod hang;
mod output;
pub mod policy;
mod settings;

pub use driver::control;
pub use driver::{CallHandle, Executor, Failure, JobOutcome, RankError, RankEvent, Report, WorkerInfo, REPORTS_QUEUED};
pub use output::{LineSplitter, OutputOptions, OutputSink, Stream, MAX_LINE};
pub use policy::Cause;
pub use settings::{Settings, SharedJob, SharedTorchStore};
