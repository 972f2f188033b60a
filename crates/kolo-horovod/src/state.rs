//! What the callers' threads and the background loop share (upstream's
//! `global_state.h`): each process set's queue of new requests and table
//! of tensors in flight, the names still held, and the loop's counters.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use crate::device::DeviceExecutor;
use crate::entry::{Entry, Failure, Handle};
use crate::message::{Request, Stopping};
use crate::process_sets::SetTable;
use crate::settings::Settings;
use crate::timeline::Timeline;

/// One process set as the submitting threads see it.
#[derive(Debug)]
pub(crate) struct SetShared {
    pub(crate) ranks: Vec<u32>,
    /// This process's rank in the set, if it is a member.
    pub(crate) my_rank: Option<u32>,
    /// New requests, first in first out, taken by the next cycle.
    pub(crate) queue: VecDeque<Request>,
    /// Tensors in flight, by name: from submission until their response runs.
    pub(crate) table: HashMap<String, Entry>,
    /// Every name submitted, with its handle: a name stays taken until its
    /// caller has seen the handle done or dropped it (see `Handle`).
    pub(crate) held: HashMap<String, Weak<Handle>>,
    /// `held` is swept of freed names when it grows past this.
    pub(crate) sweep_at: usize,
    pub(crate) joined: bool,
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) sets: BTreeMap<u32, SetShared>,
    pub(crate) ids: SetTable,
    /// This process asked the job to shut down, and why.
    pub(crate) shutdown_asked: Option<Stopping>,
    /// The loop has stopped; why, for what comes after.
    pub(crate) stopped: Option<Failure>,
    /// It stopped because the ranks agreed to shut down (this one or a
    /// peer asked, or a stall passed its shutdown time), not on a failure,
    /// and no rank that asked is exiting: every rank may start anew.
    pub(crate) restartable: bool,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) rank: u32,
    pub(crate) size: u32,
    pub(crate) settings: Settings,
    pub(crate) state: Mutex<State>,
    pub(crate) wake: Condvar,
    pub(crate) stats: Mutex<Stats>,
    /// Runs the collectives of device tensors; none: they are refused.
    pub(crate) device: Mutex<Option<Arc<dyn DeviceExecutor>>>,
    /// Rank 0's timeline, when `HOROVOD_TIMELINE` is set (see `Trace`).
    pub(crate) timeline: Option<Arc<Timeline>>,
}

/// What the loop has done: for tests, benchmarks and `kolo status`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Cycles of any set.
    pub cycles: u64,
    /// Cycles that went through the coordinator (a gather and a broadcast).
    pub negotiated: u64,
    /// Requests this rank sent to a coordinator.
    pub requests_sent: u64,
    /// Collectives run for responses (a fused response is one).
    pub responses: u64,
    /// Tensors those responses covered.
    pub tensors: u64,
    /// The coordinator's last stall warning, if any.
    pub stall: Option<String>,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl SetShared {
    pub(crate) fn new(ranks: Vec<u32>, global_rank: u32) -> SetShared {
        let my_rank = ranks.iter().position(|&r| r == global_rank).map(|p| p as u32);
        SetShared {
            ranks,
            my_rank,
            queue: VecDeque::new(),
            table: HashMap::new(),
            held: HashMap::new(),
            sweep_at: HELD_SWEEP_MIN,
            joined: false,
        }
    }

    /// Whether `name`'s last submission is one its caller has not yet seen done.
    pub(crate) fn is_held(&self, name: &str) -> bool {
        self.held.get(name).and_then(Weak::upgrade).is_some_and(|h| !h.seen())
    }

    /// Takes `names` for `handle`; sweeps out the freed names now and then
    /// (unnamed tensors get a new name each), so that the map stays the
    /// size of what is unseen, amortised.
    pub(crate) fn hold(&mut self, names: HashSet<String>, handle: &Arc<Handle>) {
        for name in names {
            self.held.insert(name, Arc::downgrade(handle));
        }
        if self.held.len() >= self.sweep_at {
            self.held.retain(|_, h| h.upgrade().is_some_and(|h| !h.seen()));
            self.sweep_at = (self.held.len() * 2).max(HELD_SWEEP_MIN);
        }
    }
}

/// The smallest size at which the held names are swept.
const HELD_SWEEP_MIN: usize = 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::Output;
    use std::time::Duration;

    #[test]
    fn a_name_is_held_until_its_handle_is_seen_done_or_dropped_and_the_held_names_stay_few() {
        let mut set = SetShared::new(vec![0, 1], 0);
        let names = |n: &str| std::iter::once(n.to_string()).collect();
        let unseen = Handle::new(1);
        set.hold(names("a"), &unseen);
        assert!(set.is_held("a"));
        unseen.finish(0, Ok(Output::default()));
        assert!(set.is_held("a"), "done, but its caller has not seen it");
        assert!(unseen.is_done());
        assert!(!set.is_held("a"), "seen done");
        let dropped = Handle::new(1);
        set.hold(names("b"), &dropped);
        drop(dropped);
        assert!(!set.is_held("b"), "its handle is gone");
        // unnamed tensors: a new name each; seen ones are swept out
        for i in 0..10 * HELD_SWEEP_MIN {
            let h = Handle::new(1);
            set.hold(names(&format!("noname.{i}")), &h);
            h.finish(0, Ok(Output::default()));
            assert!(h.wait_for(Duration::ZERO));
        }
        assert!(set.held.len() <= HELD_SWEEP_MIN, "{} names held", set.held.len());
    }
}
