//! A communicator behind a queue: collectives run in the order they were
//! issued, either at once on the calling thread (when nothing is queued,
//! the fast path of a synchronous call) or on the communicator's own
//! thread (an asynchronous call: DDP's buckets, Horovod's handles), so that
//! the caller computes while they move. Every rank issues the same calls
//! in the same order; the queue keeps that order.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use kolo_comm::{CommError, Communicator};
use kolo_sys::lock;
use pyo3::prelude::*;

/// A call, on the communicator.
pub(crate) type Run = Box<dyn FnOnce(&mut Communicator) -> Result<(), CommError> + Send>;

struct Job {
    run: Run,
    done: Arc<Done>,
}

/// Why a call failed, and whether an elastic job gets past it by joining
/// the next round (`CommError::is_membership`).
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    pub(crate) message: String,
    pub(crate) membership: bool,
}

impl From<CommError> for Failure {
    fn from(e: CommError) -> Failure {
        Failure { membership: e.is_membership(), message: e.to_string() }
    }
}

fn shut_down() -> Failure {
    Failure { message: "the process group was shut down".into(), membership: false }
}

/// What an issued call became.
pub(crate) struct Done {
    result: Mutex<Option<Result<(), Failure>>>,
    ready: Condvar,
    /// Called (with the GIL) once the call has ended: `(None, False)`, or
    /// the error and whether it is a membership change.
    then: Option<Py<PyAny>>,
    /// What owns the memory the call reads and writes (the tensors), held
    /// until it has ended whatever the caller does meanwhile.
    keep: Mutex<Option<Py<PyAny>>>,
}

impl Done {
    fn finish(&self, result: Result<(), Failure>) {
        let (error, membership) = match &result {
            Ok(()) => (None, false),
            Err(f) => (Some(f.message.clone()), f.membership),
        };
        *lock(&self.result) = Some(result);
        self.ready.notify_all();
        if let Some(then) = &self.then {
            Python::with_gil(|py| {
                if let Err(e) = then.call1(py, (error, membership)) {
                    e.print(py);
                }
            });
        }
        drop(lock(&self.keep).take());
    }

    /// Blocks (without the GIL, the caller releases it) until the call ended.
    pub(crate) fn wait(&self) -> Result<(), Failure> {
        let mut result = lock(&self.result);
        loop {
            if let Some(r) = result.as_ref() {
                return r.clone();
            }
            result = self.ready.wait(result).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        lock(&self.result).is_some()
    }
}

struct Queue {
    jobs: VecDeque<Job>,
    /// The thread is running a job (its callback included).
    busy: bool,
    closed: bool,
    /// Jobs the thread has ended, callbacks included: a drain's progress.
    ended: u64,
    /// Callers of `wait_idle` waiting: the thread tells them when it is idle.
    draining: usize,
}

impl Queue {
    fn idle(&self) -> bool {
        !self.busy && self.jobs.is_empty()
    }
}

pub(crate) struct Ordered {
    comm: Mutex<Option<Communicator>>,
    queue: Mutex<Queue>,
    wake: Condvar,
    idle: Condvar,
    /// The process that started the thread: a forked child has none.
    pid: u32,
}

/// Every queue started, for `drain_all`.
static STARTED: Mutex<Vec<Weak<Ordered>>> = Mutex::new(Vec::new());

/// How long a drain waits for a queue in which no call ends.
const DRAIN_PATIENCE: Duration = Duration::from_secs(10);
/// How often a drain lets Python see a signal (Ctrl-C).
const DRAIN_SLICE: Duration = Duration::from_millis(100);

/// Waits, without the GIL, until no queue of this process has a call
/// queued or running, callbacks included. Run at the interpreter's exit
/// before it finalizes: a callback still running then (torch completing an
/// asynchronous call's future, which lets go of the GIL and takes it
/// again) would find the interpreter finalizing, and Python ends such a
/// thread by unwinding it through torch's C++ frames, which aborts the
/// process. Queued calls also still meet their peers' instead of being cut
/// off. A queue in which no call ends for `DRAIN_PATIENCE` (a peer that
/// never makes its call) is left, saying so; a signal ends the wait.
pub(crate) fn drain_all(py: Python<'_>) -> PyResult<()> {
    let me = std::process::id();
    let started: Vec<Arc<Ordered>> = lock(&STARTED).iter().filter_map(Weak::upgrade).filter(|o| o.pid == me).collect();
    for ordered in started {
        let mut progress = (u64::MAX, Instant::now());
        loop {
            let (idle, ended, left) = py.allow_threads(|| ordered.wait_idle(DRAIN_SLICE));
            if idle {
                break;
            }
            py.check_signals()?;
            if ended != progress.0 {
                progress = (ended, Instant::now());
            } else if progress.1.elapsed() >= DRAIN_PATIENCE {
                eprintln!(
                    "kolo: exiting with {left} torch collective call(s) still queued or running: none ended in {} s (a peer that never made them?)",
                    DRAIN_PATIENCE.as_secs()
                );
                break;
            }
        }
    }
    Ok(())
}

impl Ordered {
    pub(crate) fn start(comm: Communicator) -> std::io::Result<Arc<Ordered>> {
        let ordered = Arc::new(Ordered {
            comm: Mutex::new(Some(comm)),
            queue: Mutex::new(Queue { jobs: VecDeque::new(), busy: false, closed: false, ended: 0, draining: 0 }),
            wake: Condvar::new(),
            idle: Condvar::new(),
            pid: std::process::id(),
        });
        let mut started = lock(&STARTED);
        started.retain(|o| o.strong_count() > 0);
        started.push(Arc::downgrade(&ordered));
        drop(started);
        let worker = ordered.clone();
        std::thread::Builder::new().name("kolo-collectives".into()).spawn(move || worker.work())?;
        Ok(ordered)
    }

    fn work(&self) {
        loop {
            let job = {
                let mut q = lock(&self.queue);
                if q.busy {
                    q.busy = false;
                    q.ended += 1;
                }
                if q.draining > 0 && q.jobs.is_empty() {
                    self.idle.notify_all();
                }
                loop {
                    if let Some(job) = q.jobs.pop_front() {
                        q.busy = true;
                        break job;
                    }
                    if q.closed {
                        return;
                    }
                    q = self.wake.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            let result = self.run_now(job.run);
            job.done.finish(result.map_err(Failure::from));
        }
    }

    fn run_now(&self, run: Run) -> Result<(), CommError> {
        let mut comm = lock(&self.comm);
        let comm = comm.as_mut().ok_or_else(|| CommError::BadArgs("the process group was shut down".into()))?;
        run(comm)
    }

    /// Runs `run` in order: on this thread when nothing is queued or
    /// running, else after what is. Call without the GIL.
    pub(crate) fn now(&self, run: Run) -> Result<(), Failure> {
        let q = lock(&self.queue);
        if q.jobs.is_empty() && !q.busy {
            // holding the comm before letting go of the queue: a job queued
            // meanwhile waits for this one, as its order says
            let mut comm = lock(&self.comm);
            drop(q);
            let comm = comm.as_mut().ok_or_else(shut_down)?;
            return run(comm).map_err(Failure::from);
        }
        drop(q);
        self.later(run, None, None).wait()
    }

    /// Queues `run`; `then` is called once it has ended.
    pub(crate) fn later(&self, run: Run, then: Option<Py<PyAny>>, keep: Option<Py<PyAny>>) -> Arc<Done> {
        let done = Arc::new(Done { result: Mutex::new(None), ready: Condvar::new(), then, keep: Mutex::new(keep) });
        let mut q = lock(&self.queue);
        if q.closed {
            drop(q);
            done.finish(Err(shut_down()));
            return done;
        }
        q.jobs.push_back(Job { run, done: done.clone() });
        drop(q);
        self.wake.notify_one();
        done
    }

    /// Blocks until nothing is queued or running, callbacks included, or
    /// `limit` passed: (idle, jobs ended so far, jobs left). Call without
    /// the GIL.
    fn wait_idle(&self, limit: Duration) -> (bool, u64, usize) {
        let mut q = lock(&self.queue);
        q.draining += 1;
        let deadline = Instant::now() + limit;
        while !q.idle() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            q = self.idle.wait_timeout(q, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        q.draining -= 1;
        (q.idle(), q.ended, q.jobs.len() + usize::from(q.busy))
    }

    /// Ends the queue (queued calls fail) and closes the links.
    pub(crate) fn shutdown(&self) {
        let dropped: Vec<Job> = {
            let mut q = lock(&self.queue);
            q.closed = true;
            q.jobs.drain(..).collect()
        };
        self.wake.notify_all();
        for job in dropped {
            job.done.finish(Err(shut_down()));
        }
        self.idle.notify_all();
        drop(lock(&self.comm).take());
    }
}
