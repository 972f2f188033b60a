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
//! `process_sets`. `core` is the thread and its cycles; `exec` runs a
//! response on a communicator; `device` hands those over device memory
//! to the process's device executor.

#![warn(missing_docs)]

pub mod cache;
pub mod core;
pub mod device;
pub mod entry;
mod exec;
pub mod fusion;
pub mod message;
pub mod negotiate;
pub mod process_sets;
pub mod stall;

pub use crate::core::{Core, Refused, Settings, Stats, DUPLICATE_NAME, SHUT_DOWN};
pub use device::{DeviceExecutor, DeviceWork};
pub use entry::{Buffer, Failure, FailureKind, Handle, Outcome, Output, Submit};
pub use message::{DataType, ReduceOp, RequestType, CPU_DEVICE_ID, HOST_EXECUTOR_DEVICE_ID};
