//! kolo-comm: collective communication for the workers of a kolo job.
//!
//! A [`Communicator`] is bootstrapped from the job's environment (the
//! rendezvous store and ranks kolo sets): each rank publishes its address
//! once, rank 0 publishes the table, everyone reads it. Ranks on the same
//! host talk through shared-memory rings, ranks on different hosts through
//! TCP on the interface kolo detected. Collectives: allreduce (sum, prod,
//! min, max, avg), broadcast, allgather(v), reduce-scatter, reduce,
//! barrier, send/recv, over f32, f64, f16, bf16, i32, i64 and u8.
//!
//! ```no_run
//! use kolo_comm::{Communicator, ReduceOp};
//! let mut comm = Communicator::from_env()?;
//! let grads = vec![1.0f32; 1024];
//! let mut sum = vec![0.0f32; 1024];
//! comm.allreduce(&grads, &mut sum, ReduceOp::Sum)?;
//! assert_eq!(sum[0], comm.size() as f32);
//! # Ok::<(), kolo_comm::CommError>(())
//! ```

#![warn(missing_docs)]

mod bootstrap;
mod comm;
mod dtype;
pub mod elastic;
mod interrupt;
mod link;
mod schedule;
mod shm;

pub use bootstrap::{AddressBook, Config, Transport};
pub use comm::{Communicator, Tuning};
pub use dtype::{DType, Element, ReduceOp};
pub use interrupt::Interrupt;
/// The job secret and handshake errors, from kolo-auth (what [`Config`] takes).
pub use kolo_auth::{AuthError, Secret};
pub use schedule::split_counts;

/// `half`, for [`with_element_type!`]'s callers.
#[doc(hidden)]
pub use half as __half;

/// Runs `$body` with `$t` the Rust element type of `$dtype` (a
/// [`DType`]): one generic call for every element type kolo-comm moves.
#[macro_export]
macro_rules! with_element_type {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::DType::F16 => {
                type $t = $crate::__half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $t = $crate::__half::bf16;
                $body
            }
            $crate::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::DType::I64 => {
                type $t = i64;
                $body
            }
            $crate::DType::U8 => {
                type $t = u8;
                $body
            }
            $crate::DType::I8 => {
                type $t = i8;
                $body
            }
        }
    };
}

/// Why a kolo-comm call failed.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// The configuration is missing or wrong: an unset or malformed
    /// variable, a rank not below the size, an interface without an address.
    #[error("kolo-comm environment: {0}")]
    Env(String),
    /// A system call needed to read the environment failed.
    #[error("kolo-comm environment: {what}: {source}")]
    EnvSys {
        /// What was being done.
        what: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The job secret is missing or empty.
    #[error("kolo-comm environment: {0}")]
    Secret(#[source] kolo_auth::AuthError),
    /// Bringing a communicator up failed: a rank or the address table did
    /// not come in time or was malformed (in an elastic job: the round too).
    #[error("kolo-comm bootstrap: {0}")]
    Bootstrap(String),
    /// An I/O error while the links were set up.
    #[error("kolo-comm bootstrap: {what}: {source}")]
    BootstrapIo {
        /// What was being done.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The rendezvous store failed or refused a request.
    #[error("kolo-comm bootstrap: rendezvous store: {0}")]
    Store(#[source] kolo_rendezvous::RendezvousError),
    /// The handshake of a link failed (wrong secret, not a kolo peer, ...).
    #[error("kolo-comm bootstrap: link to rank {rank}: {source}")]
    Auth {
        /// The rank at the other end of the link.
        rank: usize,
        /// Why the handshake failed.
        #[source]
        source: kolo_auth::AuthError,
    },
    /// A collective or point-to-point call made no progress for the
    /// configured timeout.
    #[error("timed out after {seconds:.1} s without progress, waiting on ranks {waiting:?}")]
    Timeout {
        /// The timeout that ran out, in seconds.
        seconds: f64,
        /// The ranks whose messages had not gone through, sorted.
        waiting: Vec<usize>,
    },
    /// The process of a rank on this host is gone.
    #[error("rank {rank} (pid {pid}) died")]
    PeerDied {
        /// The rank whose process died.
        rank: usize,
        /// That process's id.
        pid: u32,
    },
    /// Reading or writing the link to a rank failed.
    #[error("link to rank {rank} failed: {source}")]
    Io {
        /// The rank at the other end of the link.
        rank: usize,
        /// The I/O error.
        source: std::io::Error,
    },
    /// There is no link to the rank a message is for.
    #[error("no link to rank {0}")]
    NoLink(usize),
    /// Ranks called the collectives of their communicators in different
    /// orders (say one thread per communicator): the message that came is
    /// not the one expected.
    #[error("rank {rank} sent a message of {theirs} while this rank is in {ours}: every rank must call the collectives of its communicators in the same order")]
    Mismatch {
        /// The rank whose message came.
        rank: usize,
        /// The collective or message this rank is in.
        ours: String,
        /// The one the other rank's message belongs to.
        theirs: String,
    },
    /// Ranks called the same collective with different sizes, types, ops
    /// or roots.
    #[error("rank {rank} called {theirs} while this rank called {ours}: every rank must call each collective with the same size, type, op and root")]
    Disagree {
        /// The other rank, in this communicator.
        rank: usize,
        /// This rank's call.
        ours: String,
        /// The other rank's call.
        theirs: String,
    },
    /// The arguments of a call are wrong (sizes, roots, peers), or data
    /// could not be encoded or decoded.
    #[error("{0}")]
    BadArgs(String),
    /// The job's membership changed (an elastic job's driver started round
    /// `round`): this communicator's round is over.
    #[error("interrupted: the job moved on to round {round}")]
    Interrupted {
        /// The round the job moved on to.
        round: u64,
    },
    /// Hosts were added or removed: [`elastic::State::commit`] says so, so
    /// that the loop joins the new round (Horovod's `HostsUpdatedInterrupt`).
    #[error("the hosts changed: round {round} is starting")]
    HostsUpdated {
        /// The round that is starting.
        round: u64,
    },
    /// This process has no place in the elastic job's new round (its host
    /// was removed); it should exit.
    #[error("this worker ({id}) has no place in round {round} of the elastic job")]
    Removed {
        /// This worker's id in the elastic job.
        id: String,
        /// The round it has no place in.
        round: u64,
    },
}

impl CommError {
    /// Whether an elastic job gets past this by joining the next round:
    /// a peer died, vanished or was too slow, or the round moved on.
    pub fn is_membership(&self) -> bool {
        matches!(
            self,
            CommError::Interrupted { .. }
                | CommError::HostsUpdated { .. }
                | CommError::PeerDied { .. }
                | CommError::Io { .. }
                | CommError::NoLink(_)
                | CommError::Timeout { .. }
                | CommError::Bootstrap(_)
                | CommError::BootstrapIo { .. }
                | CommError::Auth { .. }
        )
    }
}

/// Pins this process to one CPU, chosen by `local_rank` among the CPUs it
/// may use (what `mpirun --bind-to core` does). Ranks that spin while they
/// wait run best one to a core; call it before the communicator when there
/// are no more ranks on a host than cores.
pub fn bind_to_core(local_rank: usize) -> Result<(), CommError> {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    let err = |e: nix::Error| CommError::EnvSys { what: "cannot set CPU affinity".into(), source: e.into() };
    let allowed = sched_getaffinity(Pid::from_raw(0)).map_err(err)?;
    let cpus: Vec<usize> = (0..CpuSet::count()).filter(|&c| allowed.is_set(c).unwrap_or(false)).collect();
    let Some(&cpu) = cpus.get(local_rank % cpus.len().max(1)) else { return Ok(()) };
    let mut one = CpuSet::new();
    one.set(cpu).map_err(err)?;
    sched_setaffinity(Pid::from_raw(0), &one).map_err(err)
}
