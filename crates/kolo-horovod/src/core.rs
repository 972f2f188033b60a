//! The core: tensors submitted by name from any thread, and one background
//! thread per process that cycles (upstream's `BackgroundThreadLoop` and
//! `RunLoopOnce`): for each process set this rank belongs to, in id order,
//! it agrees with the set's other ranks on what is ready (the response
//! cache's bits, or the coordinator's negotiation), then runs exactly that,
//! in the same order on every rank, on the set's communicator.
//!
//! A cycle starts at once when something is queued here, else one cycle
//! time after the last began, so that an idle job costs one small
//! allreduce per set and cycle, and a job whose ranks submit together
//! waits on no timer.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use kolo_comm::{CommError, Communicator};

use crate::cache::{CacheCoordinator, CacheState, ResponseCache, TensorParams};
use crate::device::{self, DeviceExecutor, DeviceWork};
use crate::entry::{Entry, Failure, FailureKind, Handle, Output, Submit};
use crate::exec::{self, Aligned};
use crate::fusion::fuse;
use crate::message::{
    Request, RequestList, RequestType, Response, ResponseList, ResponseType, Stopping, JOIN_TENSOR_NAME,
};
use crate::negotiate::Coordinator;
use crate::process_sets::{checked_ranks, SetError, SetTable};
use crate::stall::{StallInspector, StallSettings};

/// Upstream's text for everything pending or submitted once the core stopped.
pub const SHUT_DOWN: &str = "Horovod has been shut down. This was caused by an exception on one of the ranks or an \
                             attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished \
                             execution. If the shutdown was caused by an exception, you should see the exception in \
                             the log before the first shutdown message.";

/// Upstream's duplicate-name text (two spaces after "processed.").
pub const DUPLICATE_NAME: &str = "Requested to allreduce, allgather, or broadcast a tensor with the same name as \
                                  another tensor that is currently being processed.  If you want to request another \
                                  tensor, use a different tensor name.";

/// The knobs upstream reads from the environment once, at start.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// `HOROVOD_CYCLE_TIME` (ms, default 1).
    pub cycle_time: Duration,
    /// `HOROVOD_FUSION_THRESHOLD` (bytes, default 128 MiB; 0: no fusion).
    pub fusion_threshold: u64,
    /// `HOROVOD_CACHE_CAPACITY` (default 1024; 0: no cache).
    pub cache_capacity: usize,
    /// The stall inspector's switches and times (`HOROVOD_STALL_*`).
    pub stall: StallSettings,
    /// `HOROVOD_DYNAMIC_PROCESS_SETS`: sets may come and go after start.
    pub dynamic_sets: bool,
    /// Where the coordinator writes its last stall warning for kolo's hang
    /// report (`KOLO_STALL_FILE`, set by the rank's agent).
    pub stall_file: Option<std::path::PathBuf>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            cycle_time: Duration::from_millis(1),
            fusion_threshold: 128 << 20,
            cache_capacity: 1024,
            stall: StallSettings::default(),
            dynamic_sets: false,
            stall_file: None,
        }
    }
}

impl Settings {
    /// From `HOROVOD_*` as upstream reads them (booleans are set when a
    /// number above 0); a value that is not a number is an error naming it.
    pub fn from_env() -> Result<Settings, String> {
        Settings::from_lookup(|name| std::env::var(name).ok())
    }

    /// As [`from_env`](Self::from_env), reading each variable through `var`
    /// (tests pass a map).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Settings, String> {
        let mut s = Settings::default();
        let number = |name: &str| -> Result<Option<f64>, String> {
            match var(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty()) {
                None => Ok(None),
                Some(v) => v
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .map(Some)
                    .ok_or_else(|| format!("{name}='{v}' is not a number of 0 or more")),
            }
        };
        if let Some(ms) = number("HOROVOD_CYCLE_TIME")? {
            s.cycle_time = Duration::from_secs_f64(ms / 1000.0);
        }
        if let Some(b) = number("HOROVOD_FUSION_THRESHOLD")? {
            s.fusion_threshold = b as u64;
        }
        if let Some(c) = number("HOROVOD_CACHE_CAPACITY")? {
            s.cache_capacity = c as usize;
        }
        let flag = |name: &str| number(name).map(|v| v.is_some_and(|v| v > 0.0));
        s.dynamic_sets = flag("HOROVOD_DYNAMIC_PROCESS_SETS")?;
        s.stall.enabled = !flag("HOROVOD_STALL_CHECK_DISABLE")?;
        if let Some(t) = number("HOROVOD_STALL_CHECK_TIME_SECONDS")? {
            s.stall.warning = Duration::from_secs(t as u64);
        }
        if let Some(t) = number("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")? {
            s.stall.shutdown = Duration::from_secs(t as u64);
        }
        s.stall_file = var(kolo_topology::env_names::STALL_FILE).filter(|f| !f.is_empty()).map(Into::into);
        Ok(s)
    }
}

/// Why a submission was refused at once (it never reached the others).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refused {
    /// Which exception the caller raises.
    pub kind: FailureKind,
    /// The text the caller raises (upstream's where it has one).
    pub message: String,
}

impl Refused {
    fn invalid(message: impl Into<String>) -> Refused {
        Refused { kind: FailureKind::Invalid, message: message.into() }
    }

    fn internal(message: impl Into<String>) -> Refused {
        Refused { kind: FailureKind::Internal, message: message.into() }
    }
}

/// One process set as the submitting threads see it.
#[derive(Debug)]
struct SetShared {
    ranks: Vec<u32>,
    /// This process's rank in the set, if it is a member.
    my_rank: Option<u32>,
    /// New requests, first in first out, taken by the next cycle.
    queue: VecDeque<Request>,
    /// Tensors in flight, by name: from submission until their response runs.
    table: HashMap<String, Entry>,
    /// Every name submitted, with its handle: a name stays taken until its
    /// caller has seen the handle done or dropped it (see `Handle`).
    held: HashMap<String, Weak<Handle>>,
    /// `held` is swept of freed names when it grows past this.
    sweep_at: usize,
    joined: bool,
}

#[derive(Debug)]
struct State {
    sets: BTreeMap<u32, SetShared>,
    ids: SetTable,
    /// This process asked the job to shut down, and why.
    shutdown_asked: Option<Stopping>,
    /// The loop has stopped; why, for what comes after.
    stopped: Option<Failure>,
    /// It stopped because the ranks agreed to shut down (this one or a
    /// peer asked, or a stall passed its shutdown time), not on a failure,
    /// and no rank that asked is exiting: every rank may start anew.
    restartable: bool,
}

#[derive(Debug)]
struct Shared {
    rank: u32,
    size: u32,
    settings: Settings,
    state: Mutex<State>,
    wake: Condvar,
    stats: Mutex<Stats>,
    /// Runs the collectives of device tensors; none: they are refused.
    device: Mutex<Option<Arc<dyn DeviceExecutor>>>,
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
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

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
    fn prepare(
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
            settings: settings.clone(),
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
        });
        let background = Background::new(shared.clone(), comm, settings);
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
        let mut requests = Vec::with_capacity(tensors.len());
        for t in &tensors {
            let op = op_title(t.kind);
            let Some(my_rank) = shared.my_rank else {
                return Err(Refused::invalid(format!(
                    "{op}: Rank {global_rank} is not a member of the provided process set."
                )));
            };
            if matches!(t.kind, RequestType::Allreduce | RequestType::Reducescatter)
                && crate::exec::comm_dtype(t.dtype).is_none()
            {
                // the loop could not reduce it: refused here, never there
                return Err(Refused::invalid(format!("Tensor type {} is not supported.", t.dtype.name())));
            }
            let mut request = Request::new(my_rank, t.kind, t.dtype, t.name.clone(), t.shape.clone());
            request.device = t.device;
            request.prescale = t.prescale;
            request.postscale = t.postscale;
            request.reduce_op = t.reduce_op;
            match t.kind {
                RequestType::Broadcast => {
                    let root = shared.ranks.iter().position(|&r| i64::from(r) == t.root_rank);
                    let Some(root) = root else {
                        return Err(Refused::invalid(format!(
                            "broadcast received invalid root rank {} for provided process set",
                            t.root_rank
                        )));
                    };
                    request.root_rank = root as u32;
                }
                RequestType::Alltoall => check_splits(t, shared.ranks.len())?,
                RequestType::Reducescatter => {
                    use crate::message::ReduceOp;
                    match t.reduce_op {
                        // an average sums, then divides by the set's size
                        ReduceOp::Average => {
                            request.reduce_op = ReduceOp::Sum;
                            request.postscale /= shared.ranks.len() as f64;
                        }
                        ReduceOp::Sum => {}
                        _ => return Err(Refused::internal("Reducescatter currently only supports AVERAGE and SUM.")),
                    }
                    if t.shape.is_empty() {
                        return Err(Refused::invalid("Reducescatter does not support scalar inputs"));
                    }
                }
                _ => {}
            }
            requests.push(request);
        }
        // the duplicate check, before any of the group is queued: upstream
        // queues those before the first duplicate, whose memory nothing
        // would then keep alive here (the caller gets no handle)
        let table_name =
            |t: &Submit| if t.kind == RequestType::Join { JOIN_TENSOR_NAME.to_string() } else { t.name.clone() };
        let mut names = std::collections::HashSet::with_capacity(tensors.len());
        for t in &tensors {
            let name = table_name(t);
            if shared.table.contains_key(&name) || shared.is_held(&name) || !names.insert(name) {
                return Err(Refused::invalid(DUPLICATE_NAME));
            }
        }
        let handle = Handle::new(tensors.len());
        shared.hold(names, &handle);
        for (index, (t, request)) in tensors.into_iter().zip(requests).enumerate() {
            let name = table_name(&t);
            let mut submit = t;
            if let RequestType::Reducescatter = submit.kind {
                submit.reduce_op = request.reduce_op;
                submit.postscale = request.postscale;
            }
            if submit.kind == RequestType::Broadcast {
                submit.root_rank = i64::from(request.root_rank);
            }
            if submit.kind == RequestType::Join {
                shared.joined = true;
            }
            let mut request = request;
            request.name = name.clone();
            shared.table.insert(name, Entry { submit, handle: handle.clone(), index });
            shared.queue.push_back(request);
        }
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

impl SetShared {
    fn new(ranks: Vec<u32>, global_rank: u32) -> SetShared {
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
    fn is_held(&self, name: &str) -> bool {
        self.held.get(name).and_then(Weak::upgrade).is_some_and(|h| !h.seen())
    }

    /// Takes `names` for `handle`; sweeps out the freed names now and then
    /// (unnamed tensors get a new name each), so that the map stays the
    /// size of what is unseen, amortised.
    fn hold(&mut self, names: std::collections::HashSet<String>, handle: &Arc<Handle>) {
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

/// "Allreduce", "Allgather", ...: how upstream's submission errors name ops.
fn op_title(kind: RequestType) -> &'static str {
    match kind {
        RequestType::Allreduce | RequestType::Adasum => "Allreduce",
        RequestType::Allgather => "Allgather",
        RequestType::Broadcast => "Broadcast",
        RequestType::Alltoall => "Alltoall",
        RequestType::Reducescatter => "Reducescatter",
        RequestType::Barrier => "Barrier",
        RequestType::Join => "Join",
        RequestType::AddProcessSet | RequestType::RemoveProcessSet => "Process set",
    }
}

fn check_splits(t: &Submit, set_size: usize) -> Result<(), Refused> {
    let dim0 = t.shape.first().copied().unwrap_or(0);
    if t.splits.is_empty() {
        if set_size == 0 || dim0 % set_size as i64 != 0 {
            return Err(Refused::invalid(
                "splits not provided, but first dimension of tensor is not an even multiple of the number of workers.",
            ));
        }
        return Ok(());
    }
    if t.splits.len() != set_size {
        return Err(Refused::invalid("Number of entries in splits does not equal number of workers."));
    }
    if t.splits.iter().sum::<i64>() > dim0 {
        return Err(Refused::invalid("Sum of splits entries is greater than the first dimension of tensor."));
    }
    Ok(())
}

/// Leaves the warning where kolo's hang report reads it: private to the
/// job's user, replacing the one before.
fn write_stall(file: &std::path::Path, text: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(file)
        .and_then(|mut f| f.write_all(text.as_bytes()));
    if let Err(e) = written {
        tracing::warn!("cannot write the stall warning to {}: {e}", file.display());
    }
}

/// Fails everything pending with `failure` and marks the core stopped;
/// after a shutdown every rank agreed on (`shut_down_by`: who asked, and
/// why) each pending tensor's error names it too.
fn fail_all(shared: &Shared, failure: Failure, shut_down_by: Option<&Stopping>) {
    let entries: Vec<Entry> = {
        let mut state = shared.lock();
        if state.stopped.is_none() {
            state.stopped = Some(failure.clone());
            state.restartable = shut_down_by.is_some_and(|s| !s.exiting);
        }
        state
            .sets
            .values_mut()
            .flat_map(|s| {
                s.queue.clear();
                s.table.drain().map(|(_, e)| e)
            })
            .collect()
    };
    for entry in entries {
        let failure = match shut_down_by {
            Some(by) => Failure::internal(format!(
                "{SHUT_DOWN} (kolo: shut down by {} while {} was pending here.)",
                by.reason, entry.submit.name
            )),
            None => failure.clone(),
        };
        entry.finish(Err(failure));
    }
}

/// One set as the background thread holds it.
#[derive(Debug)]
struct SetLoop {
    comm: Communicator,
    cache: ResponseCache,
    coordinator: Option<Coordinator>,
    stall: StallInspector,
    global_ranks: Vec<u32>,
    /// Which making of a set this is (ids are reused).
    serial: u64,
}

/// The background thread's own state.
struct Background {
    shared: Arc<Shared>,
    global: Option<Communicator>,
    sets: BTreeMap<u32, SetLoop>,
    settings: Settings,
    fusion: Aligned,
    started: Instant,
    sets_made: u64,
    /// A stall past its shutdown time found here as some set's
    /// coordinator: asked of every rank through the next global cycle.
    stall_stop: Option<Stopping>,
}

/// After this many cycles with nothing in flight anywhere, the loop
/// cycles `QUIET_SLOWDOWN` times less often.
const QUIET_AFTER_CYCLES: u32 = 10;
const QUIET_SLOWDOWN: u32 = 10;

/// How one set's cycle ended.
struct CycleEnd {
    /// The job shuts down after this cycle: who asked, and why.
    shutdown: Option<Stopping>,
    /// No rank of the set had anything in flight (known with the cache on).
    quiet: bool,
}

/// What ended the loop.
enum Stop {
    /// Every rank agreed to stop; who asked and why.
    ShutDown(Stopping),
    Failed(Failure),
}

impl From<CommError> for Stop {
    fn from(e: CommError) -> Stop {
        Stop::Failed(Failure { kind: FailureKind::Internal, membership: e.is_membership(), message: e.to_string() })
    }
}

impl Background {
    fn new(shared: Arc<Shared>, comm: Communicator, settings: Settings) -> Background {
        Background {
            shared,
            global: Some(comm),
            sets: BTreeMap::new(),
            settings,
            fusion: Aligned::default(),
            started: Instant::now(),
            sets_made: 0,
            stall_stop: None,
        }
    }

    fn run(&mut self, static_sets: Vec<(u32, Vec<u32>)>) {
        // a bug here must fail the waiters, not leave them waiting
        let cycles = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_cycles(static_sets)));
        let stop = match cycles {
            Ok(Ok(cause)) => Stop::ShutDown(cause),
            Ok(Err(stop)) => stop,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Stop::Failed(Failure::internal(format!("the Horovod core's background thread failed: {what}")))
            }
        };
        match stop {
            Stop::ShutDown(by) => {
                let failure = Failure::internal(format!("{SHUT_DOWN} (kolo: shut down by {}.)", by.reason));
                fail_all(&self.shared, failure, Some(&by));
            }
            Stop::Failed(failure) => fail_all(&self.shared, failure, None),
        }
    }

    /// Cycles until the ranks agree to shut down: who asked, and why.
    fn run_cycles(&mut self, static_sets: Vec<(u32, Vec<u32>)>) -> Result<Stopping, Stop> {
        let global = self.global.take().expect("the global communicator");
        let ranks: Vec<u32> = (0..self.shared.size).collect();
        let set = self.set_loop(global, ranks);
        self.sets.insert(0, set);
        for (id, ranks) in static_sets {
            self.make_set(id, ranks)?;
        }
        let mut next = Instant::now();
        let mut quiet_cycles = 0u32;
        loop {
            self.wait_for_cycle(next);
            // a job with nothing in flight on any rank (between steps, in
            // the forward pass) cycles less often: idle cycles of ranks
            // that outnumber the cores take CPU from the training. A
            // submission wakes its own loop at once, and every rank cycles
            // at the full rate again from the first cycle that sees it.
            let wait = if quiet_cycles >= QUIET_AFTER_CYCLES {
                self.settings.cycle_time * QUIET_SLOWDOWN
            } else {
                self.settings.cycle_time
            };
            next = Instant::now() + wait;
            // a set removed and another made under its id in this
            // iteration's global cycle waits for the next iteration on
            // every rank: its old members must not cycle it before the rest
            let ids: Vec<(u32, u64)> = self.sets.iter().map(|(&id, s)| (id, s.serial)).collect();
            // read once a cycle: the global set, which every rank cycles
            // first, then carries it to all, and all stop after this cycle
            // (a stall past its shutdown time found by the coordinator of
            // any set goes the same way, a cycle later: a set's own verdict
            // would stop its members only)
            let asked = self.shared.lock().shutdown_asked.clone().or_else(|| self.stall_stop.clone());
            let mut shutdown = None;
            for (id, serial) in ids {
                if self.sets.get(&id).is_some_and(|s| s.serial == serial) {
                    let ended = self.cycle(id, asked.as_ref())?;
                    // the global set's cycle speaks for every rank's sets
                    if id == 0 {
                        shutdown = ended.shutdown;
                        quiet_cycles = if ended.quiet { quiet_cycles.saturating_add(1) } else { 0 };
                    }
                }
            }
            if let Some(cause) = shutdown {
                return Ok(cause);
            }
        }
    }

    fn set_loop(&mut self, comm: Communicator, global_ranks: Vec<u32>) -> SetLoop {
        let coordinator =
            (comm.rank() == 0).then(|| Coordinator::new(global_ranks.clone(), self.settings.fusion_threshold));
        self.sets_made += 1;
        SetLoop {
            serial: self.sets_made,
            comm,
            cache: ResponseCache::new(self.settings.cache_capacity),
            coordinator,
            stall: StallInspector::new(self.settings.stall),
            global_ranks,
        }
    }

    /// Splits the global communicator for a new set: every rank takes part,
    /// the members keep theirs.
    fn make_set(&mut self, id: u32, ranks: Vec<u32>) -> Result<(), Stop> {
        let member = ranks.contains(&self.shared.rank);
        let global = &mut self.sets.get_mut(&0).expect("the global set").comm;
        let comm = global.split(u32::from(member), self.shared.rank)?;
        if member {
            let set = self.set_loop(comm, ranks);
            self.sets.insert(id, set);
        }
        Ok(())
    }

    /// Until the next cycle is due, or something is queued here, or a
    /// shutdown was asked for.
    fn wait_for_cycle(&self, due: Instant) {
        let mut state = self.shared.lock();
        loop {
            let queued = state.sets.values().any(|s| !s.queue.is_empty());
            let now = Instant::now();
            if queued || state.shutdown_asked.is_some() || now >= due {
                return;
            }
            state = self.shared.wake.wait_timeout(state, due - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// One set's part of a cycle.
    fn cycle(&mut self, id: u32, shutdown_asked: Option<&Stopping>) -> Result<CycleEnd, Stop> {
        let now = self.now();
        let (mut popped, joined, in_flight) = {
            let mut state = self.shared.lock();
            // anything submitted and not yet done, in any set of this rank
            let in_flight = state.sets.values().any(|s| !s.table.is_empty());
            let set = state.sets.get_mut(&id).expect("a set this loop holds");
            (std::mem::take(&mut set.queue), set.joined, in_flight)
        };
        let set = self.sets.get_mut(&id).expect("a set this loop holds");
        let size = set.comm.size();
        let capacity = set.cache.capacity();
        let mut coord = CacheCoordinator::new(set.cache.num_active_bits());
        // why this rank stops the job: it goes to the coordinator (so the
        // cycle is negotiated), and from there to every rank's errors
        let stopping = shutdown_asked.cloned();
        coord.busy = in_flight || !popped.is_empty();
        for r in &popped {
            if matches!(r.kind, RequestType::Join | RequestType::Barrier)
                || matches!(r.kind, RequestType::AddProcessSet | RequestType::RemoveProcessSet)
            {
                coord.uncached = true;
                continue;
            }
            if capacity > 0 {
                match set.cache.cached(r) {
                    CacheState::Hit => {
                        coord.hits.insert(set.cache.bit_of(&r.name).expect("a hit has a bit"));
                        set.stall.record_cached(&r.name, now);
                    }
                    state => {
                        if state == CacheState::Invalid {
                            coord.invalid.insert(set.cache.bit_of(&r.name).expect("cached"));
                        }
                        coord.uncached = true;
                        set.stall.remove_cached(&r.name);
                    }
                }
            } else {
                coord.uncached = true;
            }
        }
        if joined && capacity > 0 {
            // a joined rank stands in for the others' cached allreduces
            // (with zeros); any other cached op cannot run beside it:
            // erased on every rank, it goes to the coordinator, which
            // answers it with upstream's error
            for bit in set.cache.all_bits() {
                match set.cache.peek(bit).kind {
                    ResponseType::Allreduce | ResponseType::Adasum => {
                        coord.hits.insert(bit);
                    }
                    _ => {
                        coord.invalid.insert(bit);
                        coord.uncached = true;
                    }
                }
            }
        }
        // the stall check: the coordinator's, at most once per interval
        if set.stall.check_due(now) {
            if set.coordinator.is_some() {
                if let Some(stall) = set.stall.check(&set.global_ranks, now) {
                    // printed when it changes, not at every check: a line
                    // of output is a sign of life to kolo's hang watch,
                    // which must still see a stalled job as hung
                    let mut stats = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
                    if stall.shut_down || stats.stall.as_deref() != Some(&stall.message) {
                        eprintln!("[{}]: {}", if stall.shut_down { "ERROR" } else { "WARNING" }, stall.message);
                        if let Some(file) = &self.settings.stall_file {
                            write_stall(file, &stall.message);
                        }
                    }
                    if stall.shut_down && self.stall_stop.is_none() {
                        let reason = format!(
                            "its stall inspector found tensors waiting past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: {}",
                            stall.message
                        );
                        self.stall_stop = Some(Stopping { reason, exiting: false });
                    }
                    stats.stall = Some(stall.message);
                }
            }
            if capacity > 0 {
                for name in set.stall.stalled_cached(now) {
                    if let Some(bit) = set.cache.bit_of(&name) {
                        coord.invalid.insert(bit);
                        coord.uncached = true;
                    }
                }
            }
            set.stall.checked(now);
        }
        // a rank that stops makes every rank negotiate this cycle
        coord.uncached |= stopping.is_some();
        let mut send = popped.drain(..).collect::<Vec<_>>();
        if capacity > 0 {
            let mut and = coord.and_vector();
            set.comm.allreduce_in_place::<u8>(&mut and, kolo_comm::ReduceOp::Min)?;
            coord.take_and(&and);
            if coord.needs_or(&and) {
                let mut or = coord.or_vector();
                set.comm.allreduce_in_place::<u8>(&mut or, kolo_comm::ReduceOp::Max)?;
                coord.take_or(&or);
                for &bit in &coord.invalid {
                    set.cache.erase(bit);
                }
            }
            // local hits the others do not have yet wait for a later cycle
            let mut again = Vec::new();
            send.retain(|r| {
                if set.cache.cached(r) != CacheState::Hit {
                    set.stall.remove_cached(&r.name);
                    return true;
                }
                let bit = set.cache.bit_of(&r.name).expect("a hit");
                if !coord.hits.contains(&bit) {
                    again.push(r.clone());
                } else {
                    set.stall.remove_cached(&r.name);
                }
                false
            });
            if !again.is_empty() {
                let mut state = self.shared.lock();
                let queue = &mut state.sets.get_mut(&id).expect("held").queue;
                for r in again.into_iter().rev() {
                    queue.push_front(r);
                }
            }
        }
        let fast = capacity > 0 && !coord.uncached;
        {
            let mut stats = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
            stats.cycles += 1;
            if !fast {
                stats.negotiated += 1;
                stats.requests_sent += send.len() as u64;
            }
        }
        let list = if fast {
            let responses: Vec<Response> = coord.hits.iter().map(|&bit| set.cache.get(bit)).collect();
            let rows = row_bytes_of(&self.shared, id);
            // a rank that stops makes the cycle a negotiated one: not here
            ResponseList { responses: fuse(responses, self.settings.fusion_threshold as i64, &rows), shutdown: None }
        } else {
            let mine = RequestList { requests: send, shutdown: stopping };
            let list = negotiate(set, &self.shared, id, &mine, &coord, now, self.settings.fusion_threshold)?;
            // every rank caches what was negotiated, in list order
            if capacity > 0 {
                put_in_cache(set, &self.shared, id, &list, joined, size);
            }
            list
        };
        set.cache.update_bits();
        let shutdown = list.shutdown.clone();
        {
            let mut stats = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
            stats.responses += list.responses.len() as u64;
            stats.tensors += list.responses.iter().map(|r| r.names.len() as u64).sum::<u64>();
        }
        // without the cache there is no AND to learn the others' state from
        let quiet = fast && !coord.busy && list.responses.is_empty();
        for response in list.responses {
            self.execute(id, response)?;
        }
        Ok(CycleEnd { shutdown, quiet })
    }

    fn execute(&mut self, id: u32, response: Response) -> Result<(), Stop> {
        let mut entries: Vec<Option<Entry>> = {
            let mut state = self.shared.lock();
            let set = state.sets.get_mut(&id).expect("held");
            response.names.iter().map(|name| set.table.remove(name)).collect()
        };
        // taken out of the table, the loop's failure would not reach them:
        // those a failed execution left unfinished get its error (an
        // elastic job needs to see that it was the membership that failed)
        let executed = self.execute_entries(id, response, &mut entries);
        if let Err(Stop::Failed(failure)) = &executed {
            for entry in entries.into_iter().flatten() {
                entry.finish(Err(failure.clone()));
            }
        }
        executed
    }

    /// Runs one response; each entry is taken from `entries` as it finishes.
    fn execute_entries(&mut self, id: u32, response: Response, entries: &mut [Option<Entry>]) -> Result<(), Stop> {
        let set = self.sets.get_mut(&id).expect("held");
        let take_all =
            |entries: &mut [Option<Entry>]| -> Vec<Entry> { entries.iter_mut().filter_map(Option::take).collect() };
        if device::on_device(&response) {
            let executor = self.shared.device.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let Some(executor) = executor else {
                let no = "a tensor outside host memory came to Horovod's core, and nothing runs device collectives in \
                          this process";
                for entry in take_all(entries) {
                    entry.finish(Err(Failure::invalid(no)));
                }
                return Ok(());
            };
            let inputs = entries.iter().map(|e| e.as_ref().map(|e| e.submit.input.addr)).collect();
            executor
                .execute(&DeviceWork { set: id, response: &response, inputs })
                .map_err(|message| Stop::Failed(Failure::internal(message)))?;
            for entry in take_all(entries) {
                entry.finish(Ok(Output::default()));
            }
            return Ok(());
        }
        match response.kind {
            ResponseType::Error => {
                for entry in take_all(entries) {
                    entry.finish(Err(Failure::internal(response.error.clone())));
                }
            }
            ResponseType::Allreduce | ResponseType::Adasum => {
                let refs: Vec<Option<&Entry>> = entries.iter().map(Option::as_ref).collect();
                let outputs = exec::allreduce(&mut set.comm, &response, &refs, &mut self.fusion)?;
                finish_all(entries.iter_mut().map(Option::take), outputs);
            }
            ResponseType::Allgather => {
                let refs: Vec<&Entry> = entries.iter().flatten().collect();
                let outputs = exec::allgather(&mut set.comm, &response, &refs)?;
                finish_all(entries.iter_mut().filter_map(Option::take).map(Some), outputs);
            }
            ResponseType::Broadcast => run_each(entries, |_, entry| exec::broadcast(&mut set.comm, entry))?,
            ResponseType::Alltoall => run_each(entries, |_, entry| exec::alltoall(&mut set.comm, entry))?,
            ResponseType::Reducescatter => {
                let per = response.sizes.len() / response.names.len().max(1);
                run_each(entries, |i, entry| {
                    let mut single = response.clone();
                    single.names = vec![response.names[i].clone()];
                    single.sizes = response.sizes[i * per..(i + 1) * per].to_vec();
                    exec::reducescatter(&mut set.comm, &single, entry)
                })?
            }
            ResponseType::Barrier => {
                set.comm.barrier()?;
                for entry in take_all(entries) {
                    entry.finish(Ok(Output::default()));
                }
            }
            ResponseType::Join => {
                {
                    let mut state = self.shared.lock();
                    state.sets.get_mut(&id).expect("held").joined = false;
                }
                for entry in take_all(entries) {
                    entry.finish(Ok(Output { last_joined_rank: response.last_joined_rank, ..Output::default() }));
                }
            }
            ResponseType::AddProcessSet => {
                let ranks: Vec<u32> = response.sizes.iter().map(|&r| r as u32).collect();
                let added = {
                    let mut state = self.shared.lock();
                    let added = state.ids.add(&response.sizes);
                    if let Ok(new_id) = added {
                        let set = SetShared::new(ranks.clone(), self.shared.rank);
                        state.sets.insert(new_id, set);
                    }
                    added
                };
                match added {
                    Ok(new_id) => {
                        self.make_set(new_id, ranks)?;
                        for entry in take_all(entries) {
                            entry.finish(Ok(Output { dims: vec![i64::from(new_id)], ..Output::default() }));
                        }
                    }
                    Err(e) => {
                        for entry in take_all(entries) {
                            entry.finish(Err(Failure::invalid(e.to_string())));
                        }
                    }
                }
            }
            ResponseType::RemoveProcessSet => {
                let gone = response.sizes.first().copied().unwrap_or(0) as u32;
                let pending: Vec<Entry> = {
                    let mut state = self.shared.lock();
                    let _ = state.ids.remove(gone);
                    state.sets.remove(&gone).map(|s| s.table.into_values().collect()).unwrap_or_default()
                };
                self.sets.remove(&gone);
                for entry in pending {
                    entry.finish(Err(Failure::internal("Process set has been removed")));
                }
                for entry in take_all(entries) {
                    entry.finish(Ok(Output::default()));
                }
            }
        }
        Ok(())
    }
}

/// Runs each present entry's collective in order (`run` gets its index),
/// finishing it as soon as it is done; the first failure stops the rest.
fn run_each(
    entries: &mut [Option<Entry>],
    mut run: impl FnMut(usize, &Entry) -> Result<Output, CommError>,
) -> Result<(), CommError> {
    for (i, slot) in entries.iter_mut().enumerate() {
        let Some(entry) = slot.as_ref() else { continue };
        let out = run(i, entry)?;
        slot.take().expect("present").finish(Ok(out));
    }
    Ok(())
}

fn finish_all(entries: impl IntoIterator<Item = Option<Entry>>, outputs: Vec<Output>) {
    for (entry, output) in entries.into_iter().zip(outputs) {
        if let Some(entry) = entry {
            entry.finish(Ok(output));
        }
    }
}

/// An allgathered tensor's row bytes, from this rank's own entry.
fn row_bytes_of(shared: &Shared, id: u32) -> impl Fn(&str) -> i64 + '_ {
    move |name: &str| {
        let state = shared.lock();
        let entry = state.sets.get(&id).and_then(|s| s.table.get(name));
        entry.map_or(0, |e| e.submit.shape.iter().skip(1).product::<i64>() * e.submit.dtype.size() as i64)
    }
}

/// The negotiated path: every rank's requests go to the set's coordinator,
/// which answers every rank with the same list.
fn negotiate(
    set: &mut SetLoop,
    shared: &Shared,
    id: u32,
    mine: &RequestList,
    coord: &CacheCoordinator,
    now: Duration,
    threshold: u64,
) -> Result<ResponseList, Stop> {
    let size = set.comm.size();
    let mine = postcard::to_stdvec(mine)
        .map_err(|e| Stop::Failed(Failure::internal(format!("cannot encode a request list: {e}"))))?;
    let mut lengths = vec![0i64; size];
    set.comm.allgather(&[mine.len() as i64], &mut lengths)?;
    let counts: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
    let mut all = vec![0u8; if set.comm.rank() == 0 { counts.iter().sum() } else { 0 }];
    set.comm.gatherv(&mine, &mut all, &counts, 0)?;
    let mut bytes = Vec::new();
    if let Some(coordinator) = set.coordinator.as_mut() {
        let mut lists = Vec::with_capacity(size);
        let mut at = 0;
        let mut stopping = Vec::new();
        let mut exiting = false;
        for (set_rank, &len) in counts.iter().enumerate() {
            let list: RequestList = postcard::from_bytes(&all[at..at + len])
                .map_err(|e| Stop::Failed(Failure::internal(format!("a request list did not decode: {e}"))))?;
            if let Some(asked) = list.shutdown {
                exiting |= asked.exiting;
                stopping.push((set.global_ranks[set_rank], asked.reason));
            }
            lists.push(list.requests);
            at += len;
        }
        let shutdown = (!stopping.is_empty()).then(|| Stopping { reason: shutdown_cause(&stopping), exiting });
        let mut responses = Vec::new();
        // the common cache hits first; not once everyone joined, this
        // cycle's joins counted (they would only reduce zeros everywhere)
        let joining = lists.iter().flatten().filter(|r| r.kind == RequestType::Join).count();
        if coordinator.joined_size() + joining < size {
            responses.extend(coord.hits.iter().map(|&bit| set.cache.peek(bit).clone()));
        }
        responses.extend(coordinator.on_cycle(&lists, &mut set.stall, now));
        let rows = row_bytes_of(shared, id);
        let list = ResponseList { responses: fuse(responses, threshold as i64, &rows), shutdown };
        bytes = postcard::to_stdvec(&list)
            .map_err(|e| Stop::Failed(Failure::internal(format!("cannot encode a response list: {e}"))))?;
    }
    set.comm.broadcast_bytes(&mut bytes, 0)?;
    let list: ResponseList = postcard::from_bytes(&bytes)
        .map_err(|e| Stop::Failed(Failure::internal(format!("the response list did not decode: {e}"))))?;
    Ok(list)
}

/// Who stopped the job and why, for every rank's errors: `(global rank,
/// reason)` in rank order; ranks with the same reason are named together
/// ("rank 1 (hvd.shutdown() was called)").
fn shutdown_cause(stopping: &[(u32, String)]) -> String {
    let mut by_reason: Vec<(&str, Vec<u32>)> = Vec::new();
    for (rank, reason) in stopping {
        match by_reason.iter_mut().find(|(r, _)| r == reason) {
            Some((_, ranks)) => ranks.push(*rank),
            None => by_reason.push((reason, vec![*rank])),
        }
    }
    let parts: Vec<String> = by_reason
        .iter()
        .map(|(reason, ranks)| {
            let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
            let who = if ranks.len() == 1 { "rank" } else { "ranks" };
            format!("{who} {} ({reason})", list.join(", "))
        })
        .collect();
    parts.join("; ")
}

/// Every rank caches the cacheable responses of a negotiated list, in order.
fn put_in_cache(set: &mut SetLoop, shared: &Shared, id: u32, list: &ResponseList, joined: bool, size: usize) {
    let state = shared.lock();
    let table = &state.sets.get(&id).expect("held").table;
    for response in &list.responses {
        if !response.kind.cacheable() || response.devices.len() != size {
            continue;
        }
        let per = response.sizes.len() / response.names.len().max(1);
        let params = |i: usize| match table.get(&response.names[i]) {
            Some(e) => TensorParams { device: e.submit.device, dtype: e.submit.dtype, shape: e.submit.shape.clone() },
            // a joined rank knows the element count only
            None => TensorParams {
                device: response.devices.first().copied().unwrap_or(crate::message::CPU_DEVICE_ID),
                dtype: response.dtype,
                shape: response.sizes[i * per..(i + 1) * per].to_vec(),
            },
        };
        match set.cache.put(response, params, joined) {
            Ok(Some(warning)) => tracing::warn!("{warning}"),
            Ok(None) => {}
            Err(e) => tracing::error!("{e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::Buffer;
    use crate::message::{DataType, ReduceOp};
    use kolo_comm::{Config, Secret};
    use kolo_rendezvous::{RendezvousServer, ServerConfig};

    /// Two ranks' communicators, over TCP (each on a host of its own).
    fn two_communicators() -> (Communicator, Communicator, tokio::runtime::Runtime, RendezvousServer) {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let server =
            runtime.block_on(RendezvousServer::start(ServerConfig::new("127.0.0.1:0".parse().unwrap()), &[])).unwrap();
        let config = |r: usize| {
            Config::new(r, 2, format!("host-{r}"), server.addr().to_string(), Secret::new("s").unwrap(), "execute")
                .unwrap()
                .with_timeout(Duration::from_secs(20))
        };
        let other = {
            let config = config(1);
            std::thread::spawn(move || Communicator::connect(config).unwrap())
        };
        let first = Communicator::connect(config(0)).unwrap();
        (first, other.join().unwrap(), runtime, server)
    }

    #[test]
    fn the_shutdown_cause_names_each_rank_with_its_reason() {
        let one = shutdown_cause(&[(1, "hvd.shutdown() was called".into())]);
        assert_eq!(one, "rank 1 (hvd.shutdown() was called)");
        let many = shutdown_cause(&[
            (0, "its process is exiting".into()),
            (1, "hvd.shutdown() was called".into()),
            (3, "its process is exiting".into()),
        ]);
        assert_eq!(many, "ranks 0, 3 (its process is exiting); rank 1 (hvd.shutdown() was called)");
    }

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

    #[test]
    fn work_taken_out_for_execution_gets_the_error_that_ended_it_not_a_wait_forever() {
        let (comm, peer, _runtime, _server) = two_communicators();
        let (shared, mut background, _) = Core::prepare(comm, Settings::default(), &[]).unwrap();
        let global = background.global.take().unwrap();
        let set = background.set_loop(global, vec![0, 1]);
        background.sets.insert(0, set);
        let core = Core { shared, thread: Mutex::new(None) };
        let mut values = vec![1.0f32; 1 << 20];
        let mut submit = Submit::new(
            RequestType::Allreduce,
            "grad",
            DataType::Float32,
            vec![values.len() as i64],
            Buffer::new(values.as_mut_ptr() as usize, values.len() * 4),
        );
        submit.reduce_op = ReduceOp::Sum;
        let handle = core.submit(0, vec![submit]).unwrap();
        // the peer is gone after negotiation: the execution fails part way
        drop(peer);
        let mut response = Response::new(ResponseType::Allreduce, "grad");
        response.dtype = DataType::Float32;
        response.sizes = vec![values.len() as i64];
        response.devices = vec![-1, -1];
        assert!(background.execute(0, response).is_err());
        assert!(handle.is_done(), "the entry's waiter was left waiting");
        let outcome = handle.outcomes().unwrap().remove(0);
        let failure = outcome.expect_err("the allreduce cannot have succeeded");
        assert!(!failure.message.contains("abandoned"), "the failure is the communicator's: {}", failure.message);
    }
}
