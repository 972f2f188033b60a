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

mod bootstrap;
mod comm;
mod dtype;
pub mod elastic;
mod link;
mod schedule;
mod shm;

pub use bootstrap::{AddressBook, Config, Interrupt, Transport};
pub use comm::{Communicator, Tuning};
pub use dtype::{DType, Element, ReduceOp};
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

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("kolo-comm environment: {0}")]
    Env(String),
    #[error("kolo-comm environment: {what}: {source}")]
    EnvSys {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("kolo-comm environment: {0}")]
    Secret(#[source] kolo_auth::AuthError),
    #[error("kolo-comm bootstrap: {0}")]
    Bootstrap(String),
    #[error("kolo-comm bootstrap: {what}: {source}")]
    BootstrapIo {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("kolo-comm bootstrap: rendezvous store: {0}")]
    Store(#[source] kolo_rendezvous::RendezvousError),
    #[error("kolo-comm bootstrap: link to rank {rank}: {source}")]
    Auth {
        rank: usize,
        #[source]
        source: kolo_auth::AuthError,
    },
    #[error("timed out after {seconds:.1} s without progress, waiting on ranks {waiting:?}")]
    Timeout { seconds: f64, waiting: Vec<usize> },
    #[error("rank {rank} (pid {pid}) died")]
    PeerDied { rank: usize, pid: u32 },
    #[error("link to rank {rank} failed: {source}")]
    Io { rank: usize, source: std::io::Error },
    #[error("no link to rank {0}")]
    NoLink(usize),
    /// Ranks called the collectives of their communicators in different
    /// orders (say one thread per communicator): the message that came is
    /// not the one expected.
    #[error("rank {rank} sent a message of {theirs} while this rank is in {ours}: every rank must call the collectives of its communicators in the same order")]
    Mismatch { rank: usize, ours: String, theirs: String },
    /// Ranks called the same collective with different sizes, types, ops
    /// or roots.
    #[error("rank {rank} called {theirs} while this rank called {ours}: every rank must call each collective with the same size, type, op and root")]
    Disagree { rank: usize, ours: String, theirs: String },
    #[error("{0}")]
    BadArgs(String),
    /// The job's membership changed (an elastic job's driver started round
    /// `round`): this communicator's round is over.
    #[error("interrupted: the job moved on to round {round}")]
    Interrupted { round: u64 },
    /// Hosts were added or removed: [`elastic::State::commit`] says so, so
    /// that the loop joins the new round (Horovod's `HostsUpdatedInterrupt`).
    #[error("the hosts changed: round {round} is starting")]
    HostsUpdated { round: u64 },
    /// This process has no place in the elastic job's new round (its host
    /// was removed); it should exit.
    #[error("this worker ({id}) has no place in round {round} of the elastic job")]
    Removed { id: String, round: u64 },
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
