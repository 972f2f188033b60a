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
//! let comm = Communicator::from_env()?;
//! let grads = vec![1.0f32; 1024];
//! let mut sum = vec![0.0f32; 1024];
//! comm.allreduce(&grads, &mut sum, ReduceOp::Sum)?;
//! assert_eq!(sum[0], comm.size() as f32);
//! # Ok::<(), kolo_comm::CommError>(())
//! ```

mod bootstrap;
mod comm;
mod dtype;
mod link;
mod shm;

pub use bootstrap::{Config, Transport};
pub use comm::{split_counts, Communicator, Tuning};
pub use dtype::{DType, Element, ReduceOp};

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("kolo-comm environment: {0}")]
    Env(String),
    #[error("kolo-comm bootstrap: {0}")]
    Bootstrap(String),
    #[error("timed out after {seconds:.1} s without progress, waiting on ranks {waiting:?}")]
    Timeout { seconds: f64, waiting: Vec<usize> },
    #[error("rank {rank} (pid {pid}) died")]
    PeerDied { rank: usize, pid: u32 },
    #[error("link to rank {rank} failed: {source}")]
    Io { rank: usize, source: std::io::Error },
    #[error("no link to rank {0}")]
    NoLink(usize),
    #[error("{0}")]
    BadArgs(String),
}

/// Pins this process to one CPU, chosen by `local_rank` among the CPUs it
/// may use (what `mpirun --bind-to core` does). Ranks that spin while they
/// wait run best one to a core; call it before the communicator when there
/// are no more ranks on a host than cores.
pub fn bind_to_core(local_rank: usize) -> Result<(), CommError> {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    let err = |e: nix::Error| CommError::Env(format!("cannot set CPU affinity: {e}"));
    let allowed = sched_getaffinity(Pid::from_raw(0)).map_err(err)?;
    let cpus: Vec<usize> = (0..CpuSet::count()).filter(|&c| allowed.is_set(c).unwrap_or(false)).collect();
    let Some(&cpu) = cpus.get(local_rank % cpus.len().max(1)) else { return Ok(()) };
    let mut one = CpuSet::new();
    one.set(cpu).map_err(err)?;
    sched_setaffinity(Pid::from_raw(0), &one).map_err(err)
}

fn link_tags_match(a: &[u8], b: &[u8; 32]) -> bool {
    subtle::ConstantTimeEq::ct_eq(a, &b[..]).into()
}
