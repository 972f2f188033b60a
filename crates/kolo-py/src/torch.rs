//! kolo-comm for torch.distributed's `kolo` backend (`kolo.torch`): a
//! communicator bootstrapped through the process group's own store, and
//! collectives that read and write tensors' memory in place.
//!
//! The Python side passes each tensor as (address, element count, dtype)
//! of contiguous memory it keeps alive for the call; the collectives run
//! with the GIL released.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kolo_comm::{with_element_type, AddressBook, CommError, Communicator, Config, DType, ReduceOp};
use kolo_sys::lock;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;

use crate::errors::CollectiveError;
use crate::ordered::{Done, Failure, Ordered, Run};

/// A membership change (a peer lost, the round over) is a
/// `MembershipError`, a subclass: elastic loops go on after it.
fn failed(e: CommError) -> PyErr {
    crate::errors::comm_error(e)
}

fn queued_failed(f: Failure) -> PyErr {
    crate::errors::collective_failed(f.message, f.membership)
}

/// The process group's store, as kolo-comm's address book: a Python object
/// with `put(key, value)` and `wait(key, timeout_s) -> bytes | None`.
struct PyBook(Py<PyAny>);

impl AddressBook for PyBook {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), String> {
        Python::with_gil(|py| {
            self.0.call_method1(py, "put", (key, PyBytes::new(py, value))).map(drop).map_err(|e| e.to_string())
        })
    }

    fn wait(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>, String> {
        Python::with_gil(|py| {
            let got = self.0.call_method1(py, "wait", (key, timeout.as_secs_f64())).map_err(|e| e.to_string())?;
            got.extract::<Option<PyBackedBytes>>(py).map(|b| b.map(|b| b.to_vec())).map_err(|e| e.to_string())
        })
    }
}

fn dtype_of(name: &str) -> PyResult<DType> {
    crate::dtypes::comm_type(name)
}

fn op_of(name: &str) -> PyResult<ReduceOp> {
    name.parse().map_err(PyValueError::new_err)
}

/// `count` elements at `addr`.
///
/// # Safety
/// `addr` is the start of `count` live, aligned elements of `T` that
/// nothing else touches during the call (kolo.torch passes contiguous
/// tensors it holds).
unsafe fn view<'a, T>(addr: usize, count: usize) -> &'a mut [T] {
    if count == 0 {
        return &mut [];
    }
    // SAFETY: as the caller promised
    unsafe { std::slice::from_raw_parts_mut(addr as *mut T, count) }
}

/// `count` elements at `send` that do not alias the `recv_count` at
/// `recv`, and a view of those: torch has in-place forms (an all_gather's
/// input inside its output, FSDP's habit), whose input is copied into
/// `owned` first.
///
/// # Safety
/// As for [`view`], for both ranges.
unsafe fn operands<'a, T: Copy>(
    (send, count): (usize, usize),
    (recv, recv_count): (usize, usize),
    owned: &'a mut Vec<T>,
) -> (&'a [T], &'a mut [T]) {
    let size = std::mem::size_of::<T>();
    let overlap = count > 0 && recv_count > 0 && send < recv + recv_count * size && recv < send + count * size;
    // SAFETY: as the caller promised; an overlapping input is copied before
    // the output's view is made, so the two never alias.
    let input: &'a [T] = unsafe { view::<T>(send, count) };
    let input = if overlap {
        *owned = input.to_vec();
        owned
    } else {
        input
    };
    // SAFETY: as the caller promised
    (input, unsafe { view::<T>(recv, recv_count) })
}

/// A call of one buffer, `$buf` as `(address, count)`, handed to `$run` as
/// a slice of `$dtype`'s elements.
macro_rules! one_buffer {
    ($dtype:expr, $buf:expr, |$c:ident, $slice:ident| $run:expr) => {
        Call::of(move |$c| {
            let (addr, count) = $buf;
            with_element_type!($dtype, T => {
                // SAFETY: `addr` holds `count` elements per the memory
                // contract above; the view is the call's only reference to
                // them.
                let $slice = unsafe { view::<T>(addr, count) };
                $run
            })
        })
    };
}

/// A call of two buffers of one element type: the input `$send` and the
/// output `$recv`, each `(address, count)`, handed to `$run` as slices.
macro_rules! two_buffers {
    ($dtype:expr, $send:expr, $recv:expr, |$c:ident, $input:ident, $output:ident| $run:expr) => {
        Call::of(move |$c| {
            with_element_type!($dtype, T => {
                let mut owned = Vec::new();
                // SAFETY: both ranges hold their elements per the memory
                // contract above.
                let ($input, $output) = unsafe { operands::<T>($send, $recv, &mut owned) };
                $run
            })
        })
    };
}

/// One torch process group's communicator, behind its queue.
#[pyclass(module = "kolo._kolo")]
pub struct TorchComm {
    ordered: Arc<Ordered>,
    #[pyo3(get)]
    rank: usize,
    #[pyo3(get)]
    size: usize,
}

/// A call queued with `TorchComm.queue`: wait for it, or ask if it ended.
#[pyclass(module = "kolo._kolo")]
pub struct Pending {
    done: Arc<Done>,
}

#[pymethods]
impl Pending {
    /// Blocks until the call ended; raises `CollectiveError` if it failed.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let done = self.done.clone();
        py.allow_threads(move || done.wait()).map_err(queued_failed)
    }

    fn done(&self) -> bool {
        self.done.is_done()
    }
}

impl TorchComm {
    pub(crate) fn started(comm: Communicator) -> PyResult<TorchComm> {
        let (rank, size) = (comm.rank(), comm.size());
        let ordered = Ordered::start(comm)
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the collectives thread: {e}")))?;
        Ok(TorchComm { ordered, rank, size })
    }

    /// This rank's part and the whole of an allgather or reduce-scatter.
    fn mine_of(&self, counts: &[usize]) -> (usize, usize) {
        (counts.get(self.rank).copied().unwrap_or(0), counts.iter().sum())
    }

    /// This rank's part and, at the root, the whole of a gather or scatter
    /// (elsewhere the whole is not touched: 0).
    fn rooted(&self, counts: &[usize], root: usize) -> (usize, usize) {
        let (mine, whole) = self.mine_of(counts);
        (mine, if self.rank == root { whole } else { 0 })
    }
}

/// A collective made with its memory (a `TorchComm` method), to run once:
/// now (`TorchComm.run`) or queued (`TorchComm.queue`).
#[pyclass(module = "kolo._kolo", frozen)]
pub struct Call {
    run: Mutex<Option<Run>>,
}

impl Call {
    fn of(run: impl FnOnce(&mut Communicator) -> Result<(), CommError> + Send + 'static) -> Call {
        // on the job's timeline a queued call waits from when torch asked
        let submitted_ns = kolo_timeline::recording().then(kolo_timeline::now_ns);
        let run: Run = match submitted_ns {
            Some(at) => Box::new(move |comm: &mut Communicator| kolo_timeline::with_submitted_at(at, || run(comm))),
            None => Box::new(run),
        };
        Call { run: Mutex::new(Some(run)) }
    }

    fn take(&self) -> PyResult<Run> {
        lock(&self.run).take().ok_or_else(|| PyValueError::new_err("this call has already been run or queued"))
    }
}

// The memory contract of the calls below, on which every `view` and
// `operands` in them rests. Rust cannot check it: the addresses come from
// Python as integers. Their callers, kolo.torch's process group
// (python/kolo/torch/__init__.py) and kolo.torch.elastic's state sync
// (python/kolo/torch/elastic.py), pass `data_ptr()` and `numel()` of
// contiguous CPU tensors of the dtype it names (or their uint8 byte views),
// aligned for that type as torch allocates them, and runs or queues each
// call at once, keeping the tensors alive and untouched until it ends: `run`
// holds the caller until `Ordered::now` returns, and `queue` takes `keep`,
// which kolo.torch fills with those tensors and `Done` holds until the call
// has run. Calls run one at a time (`Ordered`), so no two calls' views of
// the same tensor are live together. Every `T` of `with_element_type!` is a
// plain number type for which any bit pattern is a valid value.
#[pymethods]
impl TorchComm {
    /// Joins rank `rank` of `size` through `book` (collective: every rank
    /// of the group calls it). `toward`: the store's host, to pick the
    /// interface outside a kolo job.
    #[staticmethod]
    #[pyo3(signature = (book, rank, size, timeout_s, toward=None))]
    fn connect(
        py: Python<'_>,
        book: Py<PyAny>,
        rank: usize,
        size: usize,
        timeout_s: f64,
        toward: Option<String>,
    ) -> PyResult<TorchComm> {
        if size == 0 || rank >= size {
            return Err(PyValueError::new_err(format!("rank {rank} is not below the group size {size}")));
        }
        let timeout = crate::communicators::seconds(timeout_s);
        let book: Arc<dyn AddressBook> = Arc::new(PyBook(book));
        let comm = py
            .allow_threads(|| Communicator::connect(Config::from_book(rank, size, book, timeout, toward.as_deref())?))
            .map_err(failed)?;
        TorchComm::started(comm)
    }

    /// The kolo job's communicator, from the variables kolo sets its ranks
    /// (Horovod's `init()`); `generation` tells apart the communicators of
    /// successive inits of the same processes (every rank counts them alike).
    /// `timeout_s`: how long a bootstrap or a collective may wait without
    /// progress (the job's start timeout when not given).
    #[staticmethod]
    #[pyo3(signature = (generation, timeout_s=None))]
    fn from_env(py: Python<'_>, generation: u64, timeout_s: Option<f64>) -> PyResult<TorchComm> {
        let comm = crate::communicators::from_job_env(py, "g", generation, timeout_s)?;
        TorchComm::started(comm)
    }

    /// A communicator of one rank: a process outside any job.
    #[staticmethod]
    fn single(py: Python<'_>) -> PyResult<TorchComm> {
        let comm = crate::communicators::single(py, "single")?;
        TorchComm::started(comm)
    }

    /// Runs `call` now (GIL released), after any queued before it.
    fn run(&self, py: Python<'_>, call: &Call) -> PyResult<()> {
        let (run, ordered) = (call.take()?, self.ordered.clone());
        py.allow_threads(move || ordered.now(run)).map_err(queued_failed)
    }

    /// Queues `call`: the caller goes on; `keep` (what owns the memory the
    /// call uses) is held until it ended, then `then(error or None,
    /// membership)` is called.
    #[pyo3(signature = (call, keep, then=None))]
    fn queue(&self, call: &Call, keep: Py<PyAny>, then: Option<Py<PyAny>>) -> PyResult<Pending> {
        Ok(Pending { done: self.ordered.later(call.take()?, then, Some(keep)) })
    }

    /// In place: `count` elements at `addr` reduced over every rank.
    fn allreduce(&self, addr: usize, count: usize, dtype: &str, op: &str) -> PyResult<Call> {
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        Ok(one_buffer!(dtype, (addr, count), |c, buf| c.allreduce_in_place(buf, op)))
    }

    /// In place: several tensors of one type, `(addr, count)` each, reduced
    /// over every rank as one call (Horovod's tensor fusion): copied into
    /// one buffer, reduced, copied back, with no Python step per tensor.
    fn allreduce_fused(&self, parts: Vec<(usize, usize)>, dtype: &str, op: &str) -> PyResult<Call> {
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        Ok(Call::of(move |c| {
            with_element_type!(dtype, T => {
                let mut fused: Vec<T> = Vec::with_capacity(parts.iter().map(|&(_, count)| count).sum());
                for &(addr, count) in &parts {
                    // SAFETY: each `(addr, count)` is a tensor per the memory
                    // contract above (which no caller in this repository
                    // exercises yet: nothing calls allreduce_fused); the view
                    // lives only for this copy into `fused`, this closure's own
                    // buffer.
                    fused.extend_from_slice(unsafe { view::<T>(addr, count) });
                }
                c.allreduce_in_place(&mut fused, op).inspect(|_| {
                    let mut rest = &fused[..];
                    for &(addr, count) in &parts {
                        let (mine, others) = rest.split_at(count);
                        // SAFETY: as above; one part's view at a time, so
                        // even overlapping parts never alias a live view.
                        unsafe { view::<T>(addr, count) }.copy_from_slice(mine);
                        rest = others;
                    }
                })
            })
        }))
    }

    /// In place: rank `root`'s elements, on every rank.
    fn broadcast(&self, addr: usize, count: usize, dtype: &str, root: usize) -> PyResult<Call> {
        let dtype = dtype_of(dtype)?;
        Ok(one_buffer!(dtype, (addr, count), |c, buf| c.broadcast(buf, root)))
    }

    /// `counts[p]` elements from rank p, in rank order, into `recv`.
    fn allgather(&self, send: usize, recv: usize, counts: Vec<usize>, dtype: &str) -> PyResult<Call> {
        let (dtype, (mine, total)) = (dtype_of(dtype)?, self.mine_of(&counts));
        Ok(two_buffers!(dtype, (send, mine), (recv, total), |c, input, out| c.allgatherv(input, out, &counts)))
    }

    /// This rank's part (`counts[rank]` elements) of the reduction of
    /// every rank's `send` (`sum(counts)` elements).
    fn reduce_scatter(&self, send: usize, recv: usize, counts: Vec<usize>, dtype: &str, op: &str) -> PyResult<Call> {
        let (dtype, op, (mine, total)) = (dtype_of(dtype)?, op_of(op)?, self.mine_of(&counts));
        Ok(two_buffers!(dtype, (send, total), (recv, mine), |c, input, out| c
            .reduce_scatter_counts(input, out, &counts, op)))
    }

    /// `send_counts[p]` elements to rank p, `recv_counts[p]` from it.
    fn alltoall(
        &self,
        send: usize,
        send_counts: Vec<usize>,
        recv: usize,
        recv_counts: Vec<usize>,
        dtype: &str,
    ) -> PyResult<Call> {
        let (dtype, sent, received) = (dtype_of(dtype)?, send_counts.iter().sum(), recv_counts.iter().sum());
        Ok(two_buffers!(dtype, (send, sent), (recv, received), |c, input, out| {
            c.alltoallv(input, &send_counts, out, &recv_counts)
        }))
    }

    /// At `root`: `recv` = op over every rank's `send` (`count` elements
    /// each; `send` may be `recv`).
    fn reduce(&self, send: usize, recv: usize, count: usize, dtype: &str, op: &str, root: usize) -> PyResult<Call> {
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        // elsewhere than at the root `recv` is not touched
        let recv_count = if self.rank == root { count } else { 0 };
        Ok(two_buffers!(dtype, (send, count), (recv, recv_count), |c, input, out| c.reduce(input, out, op, root)))
    }

    /// At `root`: `counts[p]` elements from rank p, in rank order.
    fn gather(&self, send: usize, recv: usize, counts: Vec<usize>, dtype: &str, root: usize) -> PyResult<Call> {
        let (dtype, (mine, whole)) = (dtype_of(dtype)?, self.rooted(&counts, root));
        Ok(two_buffers!(dtype, (send, mine), (recv, whole), |c, input, out| c.gatherv(input, out, &counts, root)))
    }

    /// From `root`'s `send`: `counts[rank]` elements into this rank's `recv`.
    fn scatter(&self, send: usize, recv: usize, counts: Vec<usize>, dtype: &str, root: usize) -> PyResult<Call> {
        let (dtype, (mine, whole)) = (dtype_of(dtype)?, self.rooted(&counts, root));
        Ok(two_buffers!(dtype, (send, whole), (recv, mine), |c, input, out| c.scatterv(input, out, &counts, root)))
    }

    /// `count` elements at `addr` to rank `peer`.
    fn send(&self, addr: usize, count: usize, dtype: &str, peer: usize) -> PyResult<Call> {
        let dtype = dtype_of(dtype)?;
        Ok(one_buffer!(dtype, (addr, count), |c, buf| c.send(buf, peer)))
    }

    /// `count` elements from rank `peer` into `addr`.
    fn recv(&self, addr: usize, count: usize, dtype: &str, peer: usize) -> PyResult<Call> {
        let dtype = dtype_of(dtype)?;
        Ok(one_buffer!(dtype, (addr, count), |c, buf| c.recv(buf, peer)))
    }

    /// Every rank waits for every other.
    fn barrier(&self) -> Call {
        Call::of(|c| c.barrier())
    }

    /// Closes the links (peers still in a collective with this rank fail
    /// at once); later calls raise.
    fn shutdown(&self, py: Python<'_>) {
        let ordered = self.ordered.clone();
        py.allow_threads(move || ordered.shutdown());
    }
}

/// Waits until every communicator's queued calls and their callbacks are
/// done (registered with `atexit`; see `ordered::drain_all`).
#[pyfunction]
fn _drain_collectives(py: Python<'_>) -> PyResult<()> {
    crate::ordered::drain_all(py)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_drain_collectives, m)?)?;
    m.py().import("atexit")?.call_method1("register", (m.getattr("_drain_collectives")?,))?;
    m.add_class::<TorchComm>()?;
    m.add_class::<Pending>()?;
    m.add_class::<Call>()?;
    m.add("CollectiveError", m.py().get_type::<CollectiveError>())?;
    Ok(())
}
