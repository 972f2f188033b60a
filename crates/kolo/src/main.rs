//! The `kolo` command (the library's `main`), which is also its own worker
//! agent.

#![forbid(unsafe_code)]

use std::process::ExitCode;

fn main() -> ExitCode {
    // started by an engine as a worker agent: serve the driver, never return
    // (kolo's workers run commands; Rust executables are for library users)
    kolo_agent::serve_if_worker(kolo_proto::Registry::new());
    ExitCode::from(kolo::main(std::env::args_os().collect(), kolo::WorkerProgram::default()) as u8)
}
