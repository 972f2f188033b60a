//! kolo-exec: the job driver. Plans a job on an engine, starts the
//! rendezvous server, starts every rank's process with its environment,
//! streams output with rank prefixes, and tears everything down.

mod launch;
mod output;
mod process;

pub use launch::{plan_job, run_job, Cause, Failure, JobOutcome, LaunchSpec, RankPlan};
pub use output::{LineSplitter, OutputOptions, OutputSink, Stream};

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
        source: std::io::Error,
    },
    #[error("no command given; put it after '--', e.g. kolo run -np 2 -- python train.py")]
    NoCommand,
    #[error("{0}")]
    BadEnv(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}
