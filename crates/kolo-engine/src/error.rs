//! The job's error: defined here, in the lowest crate that returns it (the
//! engines); kolo-exec's driver, which returns it too, adds most of its
//! variants' causes.

use std::path::PathBuf;

/// What went wrong in a job: bad input (the message names it and the fix),
/// a worker or host that failed, or an engine that could not place workers.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// Something wrong in the job's layout: its host list or file, slots,
    /// sizes.
    #[error(transparent)]
    Topology(#[from] kolo_topology::TopologyError),
    /// The rendezvous server or a client of it failed.
    #[error(transparent)]
    Rendezvous(#[from] kolo_rendezvous::RendezvousError),
    /// A file or directory for the ranks' output could not be made or
    /// written.
    #[error("cannot write output to {path}: {source}")]
    OutputDir {
        /// The file or directory.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// A command job with an empty command line.
    #[error("no command given; put it after '--', e.g. kolo run -np 2 -- python train.py")]
    NoCommand,
    /// The driver's own I/O failed (listening, encoding, a thread).
    #[error("{what}: {source}")]
    Io {
        /// What the driver was doing, for the message.
        what: String,
        /// What failed.
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
    /// A call or query that needs running workers, before `start`.
    #[error("the executor is not started; call start first")]
    NotStarted,
    /// `start` on an executor whose workers already run.
    #[error("the executor is started already; shut it down before starting again")]
    AlreadyStarted,
    /// Workers exited before they connected.
    #[error("worker {index} on host {host} could not start: {reason}")]
    WorkerStart {
        /// The first such worker's index.
        index: u32,
        /// Its host.
        host: String,
        /// How each host's workers ended, one line per host.
        reason: String,
        /// Every host where a worker exited so.
        hosts: Vec<String>,
    },
    /// Not every worker connected within the start timeout.
    #[error("timed out after {seconds:.1} s waiting for workers to connect: {missing} did not (raise the start timeout if they are slow)")]
    StartTimeout {
        /// The start timeout.
        seconds: f64,
        /// The workers that did not connect, with their hosts, for the message.
        missing: String,
        /// Where the workers that did not connect run.
        hosts: Vec<String>,
    },
    /// A worker that proved the secret speaks another protocol version.
    #[error(
        "worker {index} speaks protocol version {worker}, the driver {}; use the same kolo version everywhere",
        kolo_proto::PROTOCOL_VERSION
    )]
    Version {
        /// The worker's index.
        index: u32,
        /// The version it speaks.
        worker: u32,
    },
    /// A worker runs another build of the program (other registered names).
    #[error("the worker program {} on host {host} is another build ({worker}) than the driver ({driver}); run the same program build everywhere (--worker-program)", program.display())]
    Build {
        /// The program the workers were started from.
        program: PathBuf,
        /// The worker's host.
        host: String,
        /// The worker's build id.
        worker: String,
        /// The driver's build id.
        driver: String,
    },
    /// The job would need more file descriptors than the driver may open,
    /// found before starting.
    #[error("{workers} workers need about {needed} file descriptors in the driver, but it may open only {limit} (ulimit -n); raise the limit, e.g. ulimit -n {needed}")]
    DescriptorLimit {
        /// The job's workers.
        workers: usize,
        /// About how many descriptors they need.
        needed: u64,
        /// The limit, raised as far as it would go.
        limit: u64,
    },
    /// Accepting workers ran out of file descriptors, and not all of them
    /// connected in time.
    #[error("the driver ran out of file descriptors while {workers} workers connected (raise ulimit -n)")]
    Descriptors {
        /// The job's workers.
        workers: usize,
        /// The accept error (EMFILE or ENFILE).
        #[source]
        source: std::io::Error,
    },
    /// A registered worker went away (connection closed, heartbeats
    /// stopped, its command ended unexpectedly).
    #[error("worker rank {rank} on host {host} was lost: {reason}")]
    WorkerLost {
        /// The worker's rank.
        rank: u32,
        /// Its host.
        host: String,
        /// How the driver found out.
        reason: String,
    },
    /// A task or function returned an error or panicked on a worker.
    #[error("task failed on rank {rank} (host {host}): {message}")]
    Task {
        /// The rank it failed on.
        rank: u32,
        /// That rank's host.
        host: String,
        /// The error or panic message, from the worker.
        message: String,
    },
    /// The Slurm engine could not place or run workers.
    #[error("slurm: {what}: {detail}")]
    Slurm {
        /// What the engine was doing.
        what: String,
        /// What went wrong (often Slurm's own message).
        detail: String,
    },
    /// The Ray engine could not place or run workers (the message).
    #[error("ray: {0}")]
    Ray(String),
    /// The engine could not get the resources the job asked for within
    /// the placement timeout (horovod.ray raises `TimeoutError` for it).
    #[error("{engine}: {detail}")]
    PlacementTimeout {
        /// The engine that waited.
        engine: &'static str,
        /// What was asked for and what there is.
        detail: String,
    },
    /// Finding the network interfaces every host can use failed.
    #[error("network interface detection: {message}")]
    Nics {
        /// The host it is about, if one.
        host: Option<String>,
        /// What failed, and where.
        message: String,
    },
    /// Arguments to send to the workers could not be encoded.
    #[error("cannot encode a value: {0}")]
    Encode(#[source] postcard::Error),
    /// A rank's result does not decode as the call's output type.
    #[error("cannot decode the result of rank {rank}: {source}")]
    Decode {
        /// The rank whose result it was.
        rank: u32,
        /// postcard's error.
        #[source]
        source: postcard::Error,
    },
    /// The call's result is gone: taken already, or the call given up.
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
