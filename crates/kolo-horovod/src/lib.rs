//! Horovod's core on kolo-comm: tensors are submitted by name from any
//! thread; a background thread per process agrees with the other ranks on
//! which names every rank has submitted (a coordinator's negotiation, or
//! the response cache's bits once a name was seen), runs them in one
//! order on every rank, fuses small reductions, answers a mismatch with the
//! same error on every rank and goes on; join and process sets as upstream
//! (`horovod/common/`) has them.
//!
//! The decisions are pure and tested on their own: `negotiate` (readiness,
//! order, upstream's checks and messages), `cache`, `fusion`, `stall`,
//! `process_sets`. Around them, each file with its upstream counterpart:
//! `core` the API (`operations.cc`), `settings`, `state` what callers and
//! the loop share (`global_state.h`), `queue` submission
//! (`tensor_queue.cc`), `background` the thread's loop, `controller` one
//! set's cycle (`controller.cc`), `perform` running what was agreed,
//! `exec` a response's collective on a communicator, `device` those over
//! device memory, through the process's device executor; `timeline` what
//! rank 0 records of it all for `HOROVOD_TIMELINE`; `job_timeline` each
//! tensor on every rank for `kolo run --timeline`.

#![warn(missing_docs)]

pub mod autotune;
mod background;
pub mod bayes;
pub mod cache;
mod controller;
pub mod core;
pub mod device;
pub mod entry;
mod exec;
pub mod fusion;
mod job_timeline;
pub mod message;
pub mod negotiate;
mod perform;
pub mod process_sets;
mod queue;
pub mod settings;
pub mod stall;
mod state;
pub mod timeline;
mod tuned;

pub use crate::core::Core;
pub use device::{DeviceExecutor, DeviceWork};
pub use entry::{Buffer, Failure, FailureKind, Handle, Outcome, Output, Submit};
pub use message::{DataType, ReduceOp, RequestType, CPU_DEVICE_ID, HOST_EXECUTOR_DEVICE_ID};
pub use queue::{Refused, DUPLICATE_NAME, SHUT_DOWN};
pub use settings::Settings;
pub use state::Stats;
pub use timeline::TimelineTarget;
