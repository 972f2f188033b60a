//! What a caller submits (the memory of its tensors and how to treat
//! them), and the handle through which it learns the outcome: upstream's
//! `TensorTableEntry` and `HandleManager`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::message::{DataType, ReduceOp, RequestType};
use crate::timeline::{Event, Timeline};

/// Bytes the caller owns and keeps valid, unmoved and otherwise untouched
/// until the handle that covers them is done (the contract of upstream's
/// asynchronous ops).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buffer {
    /// The first byte's address.
    pub addr: usize,
    /// How many bytes (0: no memory is touched, whatever the address).
    pub len: usize,
}

impl Buffer {
    /// The `len` bytes at `addr`, under the contract above.
    pub fn new(addr: usize, len: usize) -> Buffer {
        Buffer { addr, len }
    }

    /// # Safety
    /// The caller's contract above: valid for `len` bytes, nothing else
    /// reading or writing it meanwhile.
    pub(crate) unsafe fn bytes<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

/// One tensor of a submission.
#[derive(Clone, Debug)]
pub struct Submit {
    /// Which collective.
    pub kind: RequestType,
    /// The name every rank submits it under (the caller prefixes the op).
    pub name: String,
    /// The elements' type.
    pub dtype: DataType,
    /// The tensor's dimensions.
    pub shape: Vec<i64>,
    /// Where the tensor lives: `CPU_DEVICE_ID`, `HOST_EXECUTOR_DEVICE_ID`
    /// or a GPU's index.
    pub device: i32,
    /// Broadcast's root, as a global rank.
    pub root_rank: i64,
    /// How a reduction combines the ranks' values (reducescatter: Sum or
    /// Average only).
    pub reduce_op: ReduceOp,
    /// A reduction's input is multiplied by this first.
    pub prescale: f64,
    /// A reduction's result is multiplied by this at the end.
    pub postscale: f64,
    /// The tensor's memory.
    pub input: Buffer,
    /// Where the result goes when its size is known beforehand (allreduce,
    /// reducescatter); none: in place (allreduce_, broadcast) or made by
    /// the core (allgather, alltoall).
    pub output: Option<Buffer>,
    /// Alltoall: rows to each rank (empty: equal parts).
    pub splits: Vec<i64>,
}

impl Submit {
    /// A tensor in host memory with upstream's defaults (root 0, Sum, scale
    /// factors 1, result in place or made by the core, equal splits).
    pub fn new(kind: RequestType, name: impl Into<String>, dtype: DataType, shape: Vec<i64>, input: Buffer) -> Submit {
        Submit {
            kind,
            name: name.into(),
            dtype,
            shape,
            device: crate::message::CPU_DEVICE_ID,
            root_rank: 0,
            reduce_op: ReduceOp::Sum,
            prescale: 1.0,
            postscale: 1.0,
            input,
            output: None,
            splits: Vec::new(),
        }
    }
}

/// What a completed tensor gives back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Output {
    /// The result, where the core made it (allgather, alltoall).
    pub data: Option<Vec<u8>>,
    /// Allgather: the result's first dimension. Alltoall: the rows
    /// received from each rank.
    pub dims: Vec<i64>,
    /// Join: the global rank that joined last.
    pub last_joined_rank: i32,
}

/// How a tensor failed, by the exception upstream's frameworks raise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The ranks disagreed (an error response), or the job cannot go on:
    /// upstream's `HorovodInternalError`.
    Internal,
    /// Bad input found when it was submitted: a `ValueError`.
    Invalid,
}

/// Why a tensor failed: what the caller raises.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// Which exception it becomes.
    pub kind: FailureKind,
    /// The text every rank raises (upstream's where it has one).
    pub message: String,
    /// A change of the job's membership (a lost peer, an elastic round
    /// moving on): an elastic job gets past it.
    pub membership: bool,
}

impl Failure {
    /// An internal failure (not a membership change).
    pub fn internal(message: impl Into<String>) -> Failure {
        Failure { kind: FailureKind::Internal, message: message.into(), membership: false }
    }

    /// A failure of bad input.
    pub fn invalid(message: impl Into<String>) -> Failure {
        Failure { kind: FailureKind::Invalid, message: message.into(), membership: false }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// One tensor's outcome: what it gives back, or why it failed.
pub type Outcome = Result<Output, Failure>;

/// The outcome of one submission (one tensor, or a group of them).
///
/// Its names stay taken (a second submission under one of them is a
/// duplicate) until the caller has seen it done: `is_done` or `wait_for`
/// answering yes, `outcomes` answering, or the handle dropped. Upstream's
/// names are free once the op ran, which its cycle timer keeps from
/// happening within a millisecond of the submission; kolo's loop can run a
/// ready op within microseconds, so a name is held as long as its caller
/// cannot tell whether it ran.
#[derive(Debug)]
pub struct Handle {
    slots: Mutex<Slots>,
    done: Condvar,
    seen: AtomicBool,
}

struct Slots {
    outcomes: Vec<Option<Outcome>>,
    left: usize,
    /// Called once, when the last tensor is done.
    then: Option<Box<dyn FnOnce() + Send>>,
}

impl std::fmt::Debug for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slots").field("outcomes", &self.outcomes).field("left", &self.left).finish()
    }
}

impl Handle {
    /// A handle for `tensors` tensors, none done yet.
    pub fn new(tensors: usize) -> Arc<Handle> {
        Arc::new(Handle {
            slots: Mutex::new(Slots { outcomes: vec![None; tensors], left: tensors, then: None }),
            done: Condvar::new(),
            seen: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `then` once every tensor is done (at once if they are).
    pub fn on_done(&self, then: Box<dyn FnOnce() + Send>) {
        let mut slots = self.lock();
        if slots.left == 0 {
            drop(slots);
            then();
        } else {
            slots.then = Some(then);
        }
    }

    pub(crate) fn finish(&self, index: usize, outcome: Outcome) {
        let then = {
            let mut slots = self.lock();
            if slots.outcomes[index].is_some() {
                return;
            }
            slots.outcomes[index] = Some(outcome);
            slots.left -= 1;
            if slots.left > 0 {
                return;
            }
            slots.then.take()
        };
        self.done.notify_all();
        if let Some(then) = then {
            then();
        }
    }

    /// Whether every tensor is done (a yes frees its names).
    pub fn is_done(&self) -> bool {
        self.saw(self.is_complete())
    }

    /// Whether every tensor is done, for the machinery around the caller
    /// (the caller itself has not seen it: its names stay taken).
    pub fn is_complete(&self) -> bool {
        self.lock().left == 0
    }

    /// Waits up to `limit` for every tensor; whether they are done (a yes
    /// frees its names).
    pub fn wait_for(&self, limit: Duration) -> bool {
        let slots = self.lock();
        let (slots, _) = self.done.wait_timeout_while(slots, limit, |s| s.left > 0).unwrap_or_else(|p| p.into_inner());
        let done = slots.left == 0;
        drop(slots);
        self.saw(done)
    }

    /// Every tensor's outcome, once done (which frees its names); a
    /// grouped handle fails with its last tensor's failure, as upstream's
    /// does.
    pub fn outcomes(&self) -> Option<Vec<Outcome>> {
        let slots = self.lock();
        if slots.left > 0 {
            return None;
        }
        let outcomes = slots.outcomes.iter().map(|o| o.clone().expect("done")).collect();
        drop(slots);
        self.saw(true);
        Some(outcomes)
    }

    fn saw(&self, done: bool) -> bool {
        if done {
            self.seen.store(true, Ordering::Release);
        }
        done
    }

    /// Whether its caller has seen it done: until then its names are in
    /// flight for the duplicate check.
    pub(crate) fn seen(&self) -> bool {
        self.seen.load(Ordering::Acquire)
    }
}

/// A tensor in flight: its request and where its outcome goes.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) submit: Submit,
    pub(crate) handle: Arc<Handle>,
    pub(crate) index: usize,
    /// When it was submitted, for the job's timeline (0 when not recording).
    pub(crate) submitted_ns: i64,
    /// The timeline that began this tensor's op: its end is recorded
    /// before the caller can see it done (and stop the timeline).
    pub(crate) traced: Option<Arc<Timeline>>,
}

impl Entry {
    pub(crate) fn finish(mut self, outcome: Outcome) {
        self.end_trace();
        self.handle.finish(self.index, outcome);
    }

    fn end_trace(&mut self) {
        if let Some(timeline) = self.traced.take() {
            timeline.record(Event::End { name: &self.submit.name });
        }
    }
}

/// An entry dropped unfinished (its execution failed part way) fails
/// rather than leaving its waiter waiting forever; after `finish` this
/// is a no-op, the slot being set.
impl Drop for Entry {
    fn drop(&mut self) {
        self.end_trace();
        self.handle.finish(self.index, Err(Failure::internal("the collective was abandoned before it completed")));
    }
}
