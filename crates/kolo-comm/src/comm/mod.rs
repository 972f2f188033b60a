//! The Communicator: a group of ranks that run collectives together.
//!
//! - `tuning`: which algorithm for which size (measured, overridable)
//! - `progress`: the links, message tags, and moving messages to completion
//! - `collectives`: point to point, allreduce and friends
//! - `direct`: large allreduces within a host by reading peers' memory
//! - `adasum`: Horovod's Adasum, an allreduce that combines by agreement
//! - `split`: communicators made from others (local, cross, by color)

mod adasum;
mod collectives;
mod direct;
mod progress;
mod split;
mod tuning;

use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};

pub(crate) use progress::{Links, Shared};
pub use tuning::Tuning;

use crate::CommError;

/// From this many bytes per buffer, results are written with non-temporal
/// stores: two ranks' buffers no longer fit the last-level cache.
const STREAM_BYTES: usize = 8 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A group of ranks that run collectives together. Every member must call
/// the same collectives in the same order; ranks that call the collectives
/// of different communicators in different orders get an error that names
/// them ([`CommError::Mismatch`]), not wrong data.
///
/// Collectives take `&mut self`: a communicator is used by one thread at a
/// time. It is `Send`, not `Sync`:
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<kolo_comm::Communicator>();
/// ```
pub struct Communicator {
    pub(crate) shared: Arc<Shared>,
    /// The same on every member; carried by every message.
    pub(crate) id: u64,
    /// Collectives called so far.
    pub(crate) seq: u64,
    /// Communicators split from this one so far.
    pub(crate) splits: u64,
    /// Point-to-point messages sent to and received from each member.
    pub(crate) sent: Vec<u64>,
    pub(crate) received: Vec<u64>,
    pub(crate) _not_sync: PhantomData<std::cell::Cell<()>>,
    /// Global rank of each member, in this communicator's rank order.
    pub(crate) group: Vec<usize>,
    pub(crate) rank: usize,
    /// Node index of each member.
    pub(crate) nodes: Vec<usize>,
    /// (intra-node, inter-node) communicators for hierarchical algorithms.
    pub(crate) hierarchy: Option<Box<(Communicator, Communicator)>>,
    /// Whether the members can read each other's memory (`direct`).
    pub(crate) reach: std::cell::Cell<direct::Reach>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("name", &self.name())
            .field("rank", &self.rank)
            .field("size", &self.group.len())
            .finish()
    }
}

impl Communicator {
    /// This process's rank within this communicator (not the job's rank
    /// when the communicator was split off another).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks are members of this communicator.
    pub fn size(&self) -> usize {
        self.group.len()
    }

    /// Whether large allreduces among these ranks read the peers' memory
    /// directly (see `KOLO_COMM_DIRECT`): `None` until the first one finds
    /// out whether the kernel lets them, and always where the members are
    /// not all on this host or it is turned off.
    pub fn direct_reads(&self) -> Option<bool> {
        match self.reach.get() {
            direct::Reach::Yes => Some(true),
            direct::Reach::No => Some(false),
            direct::Reach::Never | direct::Reach::Untried => None,
        }
    }

    /// Number of distinct hosts among the members.
    pub fn num_nodes(&self) -> usize {
        let mut n = self.nodes.clone();
        n.sort_unstable();
        n.dedup();
        n.len()
    }

    fn bad(&self, what: String) -> CommError {
        CommError::BadArgs(what)
    }

    pub(crate) fn new(shared: Arc<Shared>, id: u64, group: Vec<usize>, rank: usize, nodes: Vec<usize>) -> Communicator {
        let n = group.len();
        let all_here = group.iter().all(|&g| shared.local_pids[g] != 0);
        let reach = if all_here && shared.tuning.direct_bytes.is_some() {
            direct::Reach::Untried
        } else {
            direct::Reach::Never
        };
        Communicator {
            shared,
            id,
            seq: 0,
            splits: 0,
            sent: vec![0; n],
            received: vec![0; n],
            _not_sync: PhantomData,
            group,
            rank,
            nodes,
            hierarchy: None,
            reach: std::cell::Cell::new(reach),
        }
    }
}

fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()), Some("Z" | "X")),
        Err(_) => false,
    }
}
