//! kolo-topology: the pure part of a job's layout.
//!
//! Host lists and host files, Horovod's slot plans and the Coordinator's rank
//! arithmetic, placement strategies with CPU/GPU requests, GPU sharing within
//! a node, and the environment every worker receives. No I/O and no clock
//! here, so all of it is tested exhaustively.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod elastic;
mod env;
mod hosts;
mod placement;
mod plan;
mod ranks;
mod slurm;

/// The most processes one job (and one host) may have. Larger requests are
/// refused before anything is allocated for them: a typo such as
/// `-H host:10000000` must be an error, not an out-of-memory kill.
pub const MAX_PROCESSES: u32 = 65536;

pub use elastic::{
    format_seconds, parse_discovery, Cooldown, Decision, ElasticConfig, Event, Membership, StopReason, World,
};
pub use env::{
    caller_defaults, forwards_caller_var, names as env_names, rank_env, ElasticEnv, JobEnv, CHOSEN_AT_START,
    IFACE_VARS, OMP_NUM_THREADS,
};
pub use hosts::{parse_host_list, parse_hostfile, total_slots, HostSpec};
pub use placement::{
    cuda_visible_devices, place, resolve_gpus_per_worker, HostResources, PlacedWorker, Placement, WorkerResources,
};
pub use plan::{Plan, PlannedWorker};
pub use ranks::{host_assignments, Coordinator, RankInfo, Slot};
pub use slurm::{expand_nodelist, expand_tasks_per_node};

/// Everything a user can get wrong about a job's layout, each naming the
/// input and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// A host list (`-H`, or a Slurm node list) that does not parse.
    #[error("host list '{input}': {reason}")]
    BadHost {
        /// The list as given (empty for a host file without hosts).
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A line of a host file or of a discovery script's output that does
    /// not parse.
    #[error("host file line {line} '{text}': {reason}")]
    BadHostfileLine {
        /// 1-based line number.
        line: usize,
        /// The line's text, trimmed.
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The same host name appears twice in a host list or file.
    #[error("host '{0}' is listed twice; list each host once with its total slots")]
    DuplicateHost(String),
    /// `-np` (or `--min-np`) asks for more processes than the hosts have slots.
    #[error("Requested more processes ({requested}) than there are available slots ({available})")]
    NotEnoughSlots {
        /// Processes asked for.
        requested: u64,
        /// Slots the hosts offer in total.
        available: u64,
    },
    /// A job of zero processes.
    #[error("the number of processes must be at least 1, got {0}")]
    NoProcesses(u64),
    /// More processes than [`MAX_PROCESSES`].
    #[error("{0} processes are over kolo's limit of {max} per job", max = MAX_PROCESSES)]
    TooManyProcesses(u64),
    /// A placement or elastic request that contradicts itself (a count of
    /// zero, options that exclude each other).
    #[error("invalid placement request: {0}")]
    BadRequest(String),
    /// A valid request that the given hosts cannot hold.
    #[error("cannot place {asked}: {available}")]
    Infeasible {
        /// The request, described for the message.
        asked: String,
        /// What the hosts offer, described for the message.
        available: String,
    },
    /// The Coordinator got a rank out of range or the same rank twice.
    #[error("rank registration: {0}")]
    Registration(String),
}

impl TopologyError {
    /// The reason alone, without the input it is about.
    pub fn reason(&self) -> String {
        match self {
            TopologyError::BadHost { reason, .. } => reason.clone(),
            TopologyError::BadHostfileLine { reason, .. } => reason.clone(),
            other => other.to_string(),
        }
    }
}
