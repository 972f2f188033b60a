//! Horovod's core as its callers see it (upstream's `operations.cc`:
//! `horovod_init`, the `Enqueue*` calls, process sets, `horovod_shutdown`):
//! tensors submitted by name from any thread go to the background thread
//! (`background`), which every rank's core starts over the job's
//! communicator.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kolo_comm::Communicator;

use crate::background::Background;
use crate::device::DeviceExecutor;
use crate::entry::{Failure, FailureKind, Handle, Submit};
use crate::message::{RequestType, Stopping};
use crate::process_sets::{checked_ranks, SetError, SetTable};
use crate::queue::{fail_all, op_title, Refused, SHUT_DOWN};
use crate::settings::Settings;
use crate::state::{SetShared, Shared, State, Stats};
use crate::timeline::Timeline;

/// Horovod's core over a kolo-comm communicator of the job's ranks.
#[derive(Debug)]
pub struct Core {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// How long `shutdown` waits for the loop's last cycle: its peers' loops
/// cycle whatever their main threads do, so only a frozen or cut-off peer
/// makes it wait this long.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(30);

impl Core {
    /// Starts the background thread over `comm` (the global set) and the
    /// static process sets `sets` (each a list of global ranks, registered
    /// in order before any collective runs; every rank passes the same).
    pub fn start(comm: Communicator, settings: Settings, sets: &[Vec<i64>]) -> Result<Core, Refused> {
        let (shared, mut background, static_sets) = Core::prepare(comm, settings, sets)?;
        let thread = std::thread::Builder::new()
            .name("kolo-horovod".into())
            .spawn(move || background.run(static_sets))
            .map_err(|e| Refused::internal(format!("cannot start Horovod's background thread: {e}")))?;
        Ok(Core { shared, thread: Mutex::new(Some(thread)) })
    }

    /// The state `start` shares with its background loop, and the loop.
    #[allow(clippy::type_complexity)]
    pub(crate) fn prepare(
        comm: Communicator,
        settings: Settings,
        sets: &[Vec<i64>],
    ) -> Result<(Arc<Shared>, Background, Vec<(u32, Vec<u32>)>), Refused> {
        let (rank, size) = (comm.rank() as u32, comm.size() as u32);
        let mut ids = SetTable::new(size as usize);
        let mut static_sets = Vec::new();
        for (i, ranks) in sets.iter().enumerate() {
            let checked = checked_ranks(ranks, size as usize).map_err(|e| Refused::invalid(e.to_string()))?;
            if ids.find(&checked).is_some() {
                return Err(Refused::invalid(format!(
                    "Horovod could not be initialized because process_sets entry number {i} is a duplicate: {ranks:?}"
                )));
            }
            let id = ids.add(ranks).map_err(|e| Refused::invalid(e.to_string()))?;
            static_sets.push((id, checked));
        }
        let mut shared_sets = BTreeMap::new();
        for id in ids.ids() {
            let ranks = ids.ranks(id).expect("listed").to_vec();
            shared_sets.insert(id, SetShared::new(ranks, rank));
        }
        let shared = Arc::new(Shared {
            rank,
            size,
            state: Mutex::new(State {
                sets: shared_sets,
                ids,
                shutdown_asked: None,
                stopped: None,
                restartable: false,
            }),
            wake: Condvar::new(),
            stats: Mutex::new(Stats::default()),
            device: Mutex::new(None),
            // rank 0 records, as upstream's coordinator does
            timeline: match (&settings.timeline, rank) {
                (Some(target), 0) => Some(Timeline::start(target, settings.timeline_mark_cycles)),
                _ => None,
            },
            settings,
        });
        let background = Background::new(shared.clone(), comm);
        Ok((shared, background, static_sets))
    }

    /// This process's rank in the job (the global set).
    pub fn rank(&self) -> u32 {
        self.shared.rank
    }

    /// How many ranks the job has.
    pub fn size(&self) -> u32 {
        self.shared.size
    }

    /// Submits tensors as one group (they are queued together); the handle
    /// covers them all. Refused at once for what upstream refuses when
    /// submitting: an unknown set, a rank outside it, a bad root or
    /// splits, a name in flight.
    pub fn submit(&self, set: u32, tensors: Vec<Submit>) -> Result<Arc<Handle>, Refused> {
        let mut state = self.shared.lock();
        if let Some(stopped) = &state.stopped {
            return Err(Refused { kind: FailureKind::Internal, message: stopped.message.clone() });
        }
        if state.shutdown_asked.is_some() {
            return Err(Refused::internal(SHUT_DOWN));
        }
        let global_rank = self.shared.rank;
        let Some(shared) = state.sets.get_mut(&set) else {
            let op = tensors.first().map_or("Allreduce", |t| op_title(t.kind));
            return Err(Refused::invalid(format!(
                "{op}: Process set provided does not exist, or has not been registered."
            )));
        };
        let handle = shared.enqueue(global_rank, tensors)?;
        drop(state);
        self.shared.wake.notify_one();
        Ok(handle)
    }

    /// The ranks of set `id`, if it is registered.
    pub fn process_set_ranks(&self, id: u32) -> Option<Vec<u32>> {
        self.shared.lock().ids.ranks(id).map(<[u32]>::to_vec)
    }

    /// The id of the set with these ranks, if one is registered.
    pub fn process_set_id(&self, ranks: &[i64]) -> Option<u32> {
        let ranks = checked_ranks(ranks, self.shared.size as usize).ok()?;
        self.shared.lock().ids.find(&ranks)
    }

    /// The ids of the registered process sets, ascending (0, the global set,
    /// first).
    pub fn process_set_ids(&self) -> Vec<u32> {
        self.shared.lock().ids.ids()
    }

    /// Registers a process set with every rank (each calls this alike, in
    /// the same order); its id once every rank has it.
    pub fn add_process_set(&self, ranks: &[i64]) -> Result<Arc<Handle>, Refused> {
        if !self.shared.settings.dynamic_sets {
            return Err(Refused::invalid(
                "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after Horovod initialization.",
            ));
        }
        let checked = checked_ranks(ranks, self.shared.size as usize).map_err(|e| Refused::invalid(e.to_string()))?;
        if self.shared.lock().ids.find(&checked).is_some() {
            return Err(Refused::invalid(SetError::Existing(checked).to_string()));
        }
        let shape = checked.iter().map(|&r| i64::from(r)).collect();
        let request = Submit::new(
            RequestType::AddProcessSet,
            "process_set.add",
            crate::message::DataType::Uint8,
            shape,
            crate::entry::Buffer::new(0, 0),
        );
        self.submit(0, vec![request])
    }

    /// Removes a process set with every rank; `Ok(None)` for an unknown id.
    pub fn remove_process_set(&self, id: u32) -> Result<Option<Arc<Handle>>, Refused> {
        if !self.shared.settings.dynamic_sets {
            return Err(Refused::invalid(
                "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets after Horovod initialization.",
            ));
        }
        if id == 0 {
            return Err(Refused::invalid(SetError::RemoveGlobal.to_string()));
        }
        if self.shared.lock().ids.ranks(id).is_none() {
            return Ok(None);
        }
        let request = Submit::new(
            RequestType::RemoveProcessSet,
            "process_set.remove",
            crate::message::DataType::Uint8,
            vec![i64::from(id)],
            crate::entry::Buffer::new(0, 0),
        );
        self.submit(0, vec![request]).map(Some)
    }

    /// Asks every rank to stop (through the next cycle) and waits for this
    /// rank's loop; what is pending fails with `SHUT_DOWN`.
    pub fn shutdown(&self) {
        self.shutdown_because("its core was shut down", false);
    }

    /// As [`shutdown`](Self::shutdown), saying why: every rank's pending
    /// work fails with `SHUT_DOWN` followed by this rank and `reason`.
    /// `exiting`: this process ends, so its peers must not wait for it to
    /// start a core again (see [`restartable`](Self::restartable)).
    pub fn shutdown_because(&self, reason: &str, exiting: bool) {
        {
            let mut state = self.shared.lock();
            state.shutdown_asked.get_or_insert_with(|| Stopping { reason: reason.to_string(), exiting });
        }
        self.shared.wake.notify_all();
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(thread) = thread {
            let deadline = Instant::now() + SHUTDOWN_WAIT;
            while !thread.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if thread.is_finished() {
                let _ = thread.join();
            } else {
                // a peer is frozen or cut off: this rank stops waiting
                tracing::warn!("Horovod's background thread did not stop within {SHUTDOWN_WAIT:?}; leaving it");
                fail_all(&self.shared, Failure::internal(SHUT_DOWN), None);
            }
        }
        // the file finished with all the loop recorded
        if let Some(timeline) = &self.shared.timeline {
            timeline.shutdown();
        }
    }

    /// Records the timeline into `path` from now on (`hvd.start_timeline`;
    /// rank 0 writes, the other ranks have nothing to do). Refused, with
    /// upstream's message, unless `HOROVOD_TIMELINE` was set at start; on
    /// rank 0, a file that cannot be written is refused naming it.
    pub fn start_timeline(&self, path: &std::path::Path, mark_cycles: bool) -> Result<(), Refused> {
        if self.shared.settings.timeline.is_none() {
            return Err(Refused::invalid("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage."));
        }
        if let Some(timeline) = &self.shared.timeline {
            timeline.open(path).map_err(Refused::invalid)?;
            timeline.set_mark_cycles(mark_cycles);
        }
        Ok(())
    }

    /// Stops recording the timeline (`hvd.stop_timeline`), the file
    /// finished with what was recorded; nothing to do if none records.
    pub fn stop_timeline(&self) {
        if let Some(timeline) = &self.shared.timeline {
            timeline.close();
        }
    }

    /// Sets what runs the collectives of tensors outside host memory
    /// (see `device`); until then a response over them fails.
    pub fn set_device_executor(&self, executor: Option<Arc<dyn DeviceExecutor>>) {
        *self.shared.device.lock().unwrap_or_else(|p| p.into_inner()) = executor;
    }

    /// A copy of the loop's counters now.
    pub fn stats(&self) -> Stats {
        self.shared.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether the loop has stopped (shut down or failed), and why.
    pub fn stopped(&self) -> Option<Failure> {
        self.shared.lock().stopped.clone()
    }

    /// Whether the loop stopped because the ranks agreed to shut down (this
    /// rank or a peer asked, or a stall passed its shutdown time), with no
    /// rank that asked exiting: every rank's loop ended at the same cycle
    /// and every rank is still there, so all may start a core anew.
    pub fn restartable(&self) -> bool {
        self.shared.lock().restartable
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        self.shutdown();
    }
}
