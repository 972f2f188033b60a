//! kolo-proto: what kolo's driver and its worker agents say to each other,
//! and nothing about what either does with it: the control frames and the
//! handshake ([`proto`]), the registry of user executables, tasks and
//! functions that both sides name alike ([`registry`]), and how an engine
//! starts a process in worker mode and reads what it registers
//! ([`launch`]).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod launch;
pub mod proto;
pub mod registry;

pub use proto::{Progress, PROTOCOL_VERSION};
pub use registry::{
    build_id, set_build_id, Executable, Function, Registry, ReportError, Reporter, Task, UserError, WorkerContext,
    MAX_REPORT,
};
