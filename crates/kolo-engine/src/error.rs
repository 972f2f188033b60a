//! The job's error: defined here, in the lowest crate that returns it (the
//! engines), and re-exported by kolo-exec, whose driver adds most of its
//! variants' causes.

use std::path::PathBuf;

/// What went wrong in a job: bad input (the message names it and the fix),
/// a worker or host that failed, or an engine that could not place workers.
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
        kolo_proto::PROTOCOL_VERSION
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
