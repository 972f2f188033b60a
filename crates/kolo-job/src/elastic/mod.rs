//! Elastic jobs: Horovod's mode in place (`in_place`: survivors keep
//! running and join a new round) and torchrun's restart mode (`restart`:
//! every rank starts again), for commands (`kolo run`) and for functions
//! (the Executor, from Rust and Python).
//!
//! - `discovery`: where the hosts come from (a script, a Ray cluster, a list)
//! - `work`: what every process runs, and how its end is reported
//! - `rounds`: the in-place round bookkeeping, pure
//! - `in_place`: the in-place job's actor, carrying out what `rounds` says
//! - `restart`: restart mode
//!
//! Membership (limits, blacklisting, cooldowns, timeouts) is kolo-topology's
//! `Membership` in both modes. Both report through [`ElasticEvent`]s;
//! printing them is the front ends' business.

mod discovery;
mod in_place;
mod restart;
mod rounds;
mod work;

use std::time::Duration;

use serde::de::DeserializeOwned;

pub use discovery::{Discovery, HostSource};
pub use in_place::{Cohort, CohortFactory, ElasticJob, ElasticOutcome, StopCause};
pub use restart::{CallWork, RestartJob, RestartOutcome, RestartWork, WorldEnd, WorldFailure};
pub use work::{CommandWork, ElasticWork, Ends, FunctionWork, Launch, OnStarted, ProcessEnd, TaskWork};

/// What the driver of an elastic job tells its caller as it goes.
#[derive(Clone, Debug, PartialEq)]
pub enum ElasticEvent {
    /// Round `round` started with these hosts and processes per host, in
    /// rank order.
    Round {
        /// The round's number, counted from 0.
        round: u64,
        /// Host names with the processes each runs.
        hosts: Vec<(String, u32)>,
    },
    /// A process failed (`rank` in the current round, if it had one).
    Failed {
        /// Its rank; `None` for a process that had not joined a round.
        rank: Option<u32>,
        /// The host it ran on.
        host: String,
        /// What happened, worded to follow "rank N on host H".
        reason: String,
    },
    /// A host is left out (`None`: for the rest of the job).
    Blacklisted {
        /// The host left out.
        host: String,
        /// How long it stays out; `None`: for the rest of the job.
        duration: Option<Duration>,
    },
    /// New processes are starting on these hosts.
    Starting {
        /// The hosts the new processes start on.
        hosts: Vec<String>,
    },
    /// Not enough slots; the job waits up to `left` for them.
    Waiting {
        /// Slots needed to form a world.
        needed: u32,
        /// Slots available on hosts not blacklisted.
        available: u32,
        /// How much longer the job waits before it stops.
        left: Duration,
    },
    /// A process reported a value (`WorkerContext::report`), as it sent it
    /// (`rank`: its rank in the current round, if it has one).
    Reported {
        /// The sender's rank in the current round, if it has one.
        rank: Option<u32>,
        /// The value, serialized with postcard (see [`ElasticEvent::reported`]).
        data: Vec<u8>,
    },
    /// Restart mode: the hosts changed, so every process starts again in
    /// round `round`.
    Reforming {
        /// The round the processes start again in.
        round: u32,
    },
    /// In place: a process of the current round joined it (its
    /// collectives can go on), as it recorded on the job's store.
    Joined {
        /// The round.
        round: u64,
        /// The process's host.
        host: String,
        /// Its local rank there.
        local_rank: u32,
    },
    /// Restart mode: a rank failed, so every process starts again.
    Restarting {
        /// The rank that failed.
        rank: u32,
        /// The host it ran on.
        host: String,
        /// What happened, worded to follow "rank N on host H".
        reason: String,
    },
}

impl ElasticEvent {
    /// A reported value, as `WorkerContext::report` sent it; None for
    /// other events.
    pub fn reported<T: DeserializeOwned>(&self) -> Option<Result<T, postcard::Error>> {
        match self {
            ElasticEvent::Reported { data, .. } => Some(postcard::from_bytes(data)),
            _ => None,
        }
    }
}

impl std::fmt::Display for ElasticEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ElasticEvent::Round { round, hosts } => {
                let n: u32 = hosts.iter().map(|(_, n)| n).sum();
                let names: Vec<String> = hosts.iter().map(|(h, n)| format!("{h}:{n}")).collect();
                let processes = if n == 1 { "process" } else { "processes" };
                write!(f, "round {round}: {n} {processes} on {}", names.join(","))
            }
            ElasticEvent::Failed { rank: Some(rank), host, reason } => write!(f, "rank {rank} on host {host} {reason}"),
            ElasticEvent::Failed { rank: None, host, reason } => {
                write!(f, "a process starting on host {host} {reason}")
            }
            ElasticEvent::Blacklisted { host, duration: Some(d) } => {
                let precision = if d.as_secs() < 10 { 1 } else { 0 };
                write!(f, "host {host} is blacklisted for {:.*} s", precision, d.as_secs_f64())
            }
            ElasticEvent::Blacklisted { host, duration: None } => {
                write!(f, "host {host} is blacklisted for the rest of the job")
            }
            ElasticEvent::Starting { hosts } => write!(f, "starting processes on {}", hosts.join(",")),
            ElasticEvent::Waiting { needed, available, left } => {
                write!(f, "waiting for {needed} slots, {available} available; up to {:.0} s more", left.as_secs_f64())
            }
            ElasticEvent::Reported { rank: Some(rank), data } => write!(f, "rank {rank} reported {} bytes", data.len()),
            ElasticEvent::Reported { rank: None, data } => write!(f, "a process reported {} bytes", data.len()),
            ElasticEvent::Reforming { round } => write!(f, "the hosts changed; re-forming the job (round {round})"),
            ElasticEvent::Joined { round, host, local_rank } => {
                write!(f, "the process on host {host} with local rank {local_rank} joined round {round}")
            }
            ElasticEvent::Restarting { rank, host, reason } => {
                write!(f, "rank {rank} on host {host} {reason}; restarting the job")
            }
        }
    }
}
