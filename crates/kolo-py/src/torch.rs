//! kolo-comm for torch.distributed's `kolo` backend (`kolo.torch`): a
//! communicator bootstrapped through the process group's own store, and
//! collectives that read and write tensors' memory in place.
//!
//! The Python side passes each tensor as (address, element count, dtype)
//! of contiguous memory it keeps alive for the call; the collectives run
//! with the GIL released.

use std::sync::Arc;
use std::time::Duration;

use kolo_comm::{AddressBook, CommError, Communicator, Config, DType, ReduceOp};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;

use crate::book::LocalBook;
use crate::errors::CollectiveError;
use crate::ordered::{Done, Failure, Ordered};

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
    name.parse().map_err(PyValueError::new_err)
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
/// `recv`: torch has in-place forms (an all_gather's input inside its
/// output, FSDP's habit), whose input is copied into `owned` first.
///
/// # Safety
/// As for [`view`], for both ranges.
unsafe fn input<'a, T: Copy>(
    send: usize,
    count: usize,
    recv: usize,
    recv_count: usize,
    owned: &'a mut Vec<T>,
) -> &'a [T] {
    let size = std::mem::size_of::<T>();
    let overlap = count > 0 && recv_count > 0 && send < recv + recv_count * size && recv < send + count * size;
    // SAFETY: as the caller promised
    let slice: &'a [T] = unsafe { view::<T>(send, count) };
    if overlap {
        *owned = slice.to_vec();
        return owned;
    }
    slice
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

/// A call queued with `later=True`: wait for it, or ask if it ended.
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

    /// Runs `run` now (GIL released), or queues it when `later` (or a
    /// `then` callback) is given: the caller goes on, `then(error or
    /// None)` is called once it ended.
    fn issue(
        &self,
        py: Python<'_>,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
        run: impl FnOnce(&mut Communicator) -> Result<(), CommError> + Send + 'static,
    ) -> PyResult<Option<Pending>> {
        if later || then.is_some() {
            if keep.is_none() {
                return Err(PyValueError::new_err(
                    "a queued call needs keep=: what owns the memory it uses, held until it ends",
                ));
            }
            return Ok(Some(Pending { done: self.ordered.later(run, then, keep) }));
        }
        let ordered = self.ordered.clone();
        py.allow_threads(move || ordered.now(run)).map_err(queued_failed)?;
        Ok(None)
    }
}

// The memory contract of the collectives below, on which every `view` and
// `input` in them rests. Rust cannot check it: the addresses come from
// Python as integers. Their one caller, kolo.torch's process group
// (python/kolo/torch/__init__.py), passes `data_ptr()` and `numel()` of
// contiguous CPU tensors of the dtype it names (or their uint8 byte views),
// aligned for that type as torch allocates them, and the tensors stay alive
// and untouched until the call ends: a blocking call holds the caller in
// this method until `Ordered::now` returns, and a queued one (`later=` or
// `then=`) cannot be issued without `keep=`, which kolo.torch fills with
// those tensors and `Done` holds until the call has run. Calls run one at a
// time (`Ordered`), so no two calls' views of the same tensor are live
// together. Every `T` of `with_element_type!` is a plain number type for
// which any bit pattern is a valid value.
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
        let timeout = Duration::from_secs_f64(timeout_s.clamp(0.001, 1e9));
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
        let comm = py
            .allow_threads(|| {
                let mut config = Config::from_env()?;
                config.job_id = format!("{}-g{generation}", config.job_id);
                if let Some(s) = timeout_s {
                    config = config.with_timeout(Duration::from_secs_f64(s.clamp(0.001, 1e9)));
                }
                Communicator::connect(config)
            })
            .map_err(failed)?;
        TorchComm::started(comm)
    }

    /// A communicator of one rank: a process outside any job.
    #[staticmethod]
    fn single(py: Python<'_>) -> PyResult<TorchComm> {
        let book: Arc<dyn AddressBook> = Arc::new(LocalBook::default());
        let comm = py
            .allow_threads(|| {
                let secret = kolo_comm::Secret::new("single").map_err(CommError::Secret)?;
                Communicator::connect(Config::new(0, 1, "this-host", "", secret, "single")?.with_book(book))
            })
            .map_err(failed)?;
        TorchComm::started(comm)
    }

    /// In place: `count` elements at `addr` reduced over every rank.
    #[pyo3(signature = (addr, count, dtype, op, later=false, then=None, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn allreduce(
        &self,
        py: Python<'_>,
        addr: usize,
        count: usize,
        dtype: &str,
        op: &str,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Pending>> {
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        self.issue(
            py,
            later,
            then,
            keep,
            // SAFETY: `addr` holds `count` elements of `dtype` per the memory
            // contract above; the view is the call's only reference to them.
            move |c| kolo_comm::with_element_type!(dtype, T => c.allreduce_in_place(unsafe { view::<T>(addr, count) }, op)),
        )
    }

    /// In place: several tensors of one type, `(addr, count)` each, reduced
    /// over every rank as one call (Horovod's tensor fusion): copied into
    /// one buffer, reduced, copied back, with no Python step per tensor.
    #[pyo3(signature = (parts, dtype, op, later=false, then=None, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn allreduce_fused(
        &self,
        py: Python<'_>,
        parts: Vec<(usize, usize)>,
        dtype: &str,
        op: &str,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Pending>> {
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        self.issue(py, later, then, keep, move |c| {
            kolo_comm::with_element_type!(dtype, T => {
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
        })
    }

    /// In place: rank `root`'s elements, on every rank.
    #[pyo3(signature = (addr, count, dtype, root, later=false, then=None, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn broadcast(
        &self,
        py: Python<'_>,
        addr: usize,
        count: usize,
        dtype: &str,
        root: usize,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Pending>> {
        let dtype = dtype_of(dtype)?;
        self.issue(
            py,
            later,
            then,
            keep,
            // SAFETY: `addr` holds `count` elements of `dtype` per the memory
            // contract above; the view is the call's only reference to them.
            move |c| kolo_comm::with_element_type!(dtype, T => c.broadcast(unsafe { view::<T>(addr, count) }, root)),
        )
    }

    /// `counts[p]` elements from rank p, in rank order, into `recv`.
    #[pyo3(signature = (send, recv, counts, dtype, later=false, then=None, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn allgather(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        counts: Vec<usize>,
        dtype: &str,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Pending>> {
        let dtype = dtype_of(dtype)?;
        let (mine, total) = (counts.get(self.rank).copied().unwrap_or(0), counts.iter().sum());
        self.issue(py, later, then, keep, move |c| {
            kolo_comm::with_element_type!(dtype, T => {
                let mut owned = Vec::new();
                // SAFETY: `send` holds `mine` and `recv` `total` elements per
                // the memory contract above; `input` is evaluated first and
                // copies `send` if it overlaps `recv`, so the two never alias.
                c.allgatherv(unsafe { input::<T>(send, mine, recv, total, &mut owned) }, unsafe { view::<T>(recv, total) }, &counts)
            })
        })
    }

    /// This rank's part (`counts[rank]` elements) of the reduction of
    /// every rank's `send` (`sum(counts)` elements).
    #[pyo3(signature = (send, recv, counts, dtype, op, later=false, then=None, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        counts: Vec<usize>,
        dtype: &str,
        op: &str,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Pending>> {
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        let (mine, total) = (counts.get(self.rank).copied().unwrap_or(0), counts.iter().sum());
        self.issue(py, later, then, keep, move |c| {
            kolo_comm::with_element_type!(dtype, T => {
                let mut owned = Vec::new();
                // SAFETY: `send` holds `total` and `recv` `mine` elements per
                // the memory contract above; `input` is evaluated first and
                // copies `send` if it overlaps `recv`, so the two never alias.
                c.reduce_scatter_counts(unsafe { input::<T>(send, total, recv, mine, &mut owned) }, unsafe { view::<T>(recv, mine) }, &counts, op)
            })
        })
    }

    #[pyo3(signature = (send, send_counts, recv, recv_counts, dtype, later=false, then=None, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn alltoall(
        &self,
        py: Python<'_>,
        send: usize,
        send_counts: Vec<usize>,
        recv: usize,
        recv_counts: Vec<usize>,
        dtype: &str,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Pending>> {
        let dtype = dtype_of(dtype)?;
        let (sn, rn) = (send_counts.iter().sum(), recv_counts.iter().sum());
        self.issue(py, later, then, keep, move |c| {
            kolo_comm::with_element_type!(dtype, T => {
                let mut owned = Vec::new();
                // SAFETY: `send` holds `sn` and `recv` `rn` elements per the
                // memory contract above; `input` is evaluated first and
                // copies `send` if it overlaps `recv`, so the two never alias.
                c.alltoallv(unsafe { input::<T>(send, sn, recv, rn, &mut owned) }, &send_counts, unsafe { view::<T>(recv, rn) }, &recv_counts)
            })
        })
    }

    /// At `root`: `recv` = op over every rank's `send` (`count` elements
    /// each; `send` may be `recv`).
    #[pyo3(signature = (send, recv, count, dtype, op, root, later=false, then=None, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        count: usize,
        dtype: &str,
        op: &str,
        root: usize,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Pending>> {
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        let is_root = self.rank == root;
        self.issue(py, later, then, keep, move |c| {
            kolo_comm::with_element_type!(dtype, T => {
                // in place: the input is copied first, as the two may not alias
                // SAFETY: `send` holds `count` elements per the memory contract
                // above; the view ends with this copy, before `recv`'s is made.
                let input: Vec<T> = unsafe { view::<T>(send, count) }.to_vec();
                // SAFETY: at the root `recv` holds `count` elements per the
                // memory contract above, and `send`'s view is gone; elsewhere
                // `recv` is not touched.
                let out = if is_root { unsafe { view::<T>(recv, count) } } else { &mut [] };
                c.reduce(&input, out, op, root)
            })
        })
    }

    /// At `root`: `counts[p]` elements from rank p, in rank order.
    #[pyo3(signature = (send, recv, counts, dtype, root, later=false, then=None, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        counts: Vec<usize>,
        dtype: &str,
        root: usize,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Pending>> {
        let dtype = dtype_of(dtype)?;
        let mine = counts.get(self.rank).copied().unwrap_or(0);
        let total = if self.rank == root { counts.iter().sum() } else { 0 };
        self.issue(py, later, then, keep, move |c| {
            kolo_comm::with_element_type!(dtype, T => {
                let mut owned = Vec::new();
                // SAFETY: `send` holds `mine` and, at the root, `recv` `total`
                // elements per the memory contract above (elsewhere `total` is
                // 0 and `view` does not touch `recv`, which kolo.torch passes
                // as 0); `input` copies `send` if it overlaps `recv`.
                c.gatherv(unsafe { input::<T>(send, mine, recv, total, &mut owned) }, unsafe { view::<T>(recv, total) }, &counts, root)
            })
        })
    }

    /// From `root`'s `send`: `counts[rank]` elements into this rank's `recv`.
    #[pyo3(signature = (send, recv, counts, dtype, root, later=false, then=None, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn scatter(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        counts: Vec<usize>,
        dtype: &str,
        root: usize,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Pending>> {
        let dtype = dtype_of(dtype)?;
        let mine = counts.get(self.rank).copied().unwrap_or(0);
        let total = if self.rank == root { counts.iter().sum() } else { 0 };
        self.issue(py, later, then, keep, move |c| {
            kolo_comm::with_element_type!(dtype, T => {
                let mut owned = Vec::new();
                // SAFETY: `recv` holds `mine` and, at the root, `send` `total`
                // elements per the memory contract above (elsewhere `total` is
                // 0 and `view` does not touch `send`, which kolo.torch passes
                // as 0); `input` copies `send` if it overlaps `recv`.
                c.scatterv(unsafe { input::<T>(send, total, recv, mine, &mut owned) }, unsafe { view::<T>(recv, mine) }, &counts, root)
            })
        })
    }

    #[pyo3(signature = (addr, count, dtype, peer, later=false, then=None, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        py: Python<'_>,
        addr: usize,
        count: usize,
        dtype: &str,
        peer: usize,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Pending>> {
        let dtype = dtype_of(dtype)?;
        self.issue(
            py,
            later,
            then,
            keep,
            // SAFETY: `addr` holds `count` elements of `dtype` per the memory
            // contract above; the view is the call's only reference to them.
            move |c| kolo_comm::with_element_type!(dtype, T => c.send(unsafe { view::<T>(addr, count) }, peer)),
        )
    }

    #[pyo3(signature = (addr, count, dtype, peer, later=false, then=None, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn recv(
        &self,
        py: Python<'_>,
        addr: usize,
        count: usize,
        dtype: &str,
        peer: usize,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Pending>> {
        let dtype = dtype_of(dtype)?;
        self.issue(
            py,
            later,
            then,
            keep,
            // SAFETY: `addr` holds `count` elements of `dtype` per the memory
            // contract above; the view is the call's only reference to them.
            move |c| kolo_comm::with_element_type!(dtype, T => c.recv(unsafe { view::<T>(addr, count) }, peer)),
        )
    }

    #[pyo3(signature = (later=false, then=None, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn barrier(
        &self,
        py: Python<'_>,
        later: bool,
        then: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Pending>> {
        self.issue(py, later, then, keep, |c| c.barrier())
    }

    /// Closes the links (peers still in a collective with this rank fail
    /// at once); later calls raise.
    fn shutdown(&self, py: Python<'_>) {
        let ordered = self.ordered.clone();
        py.allow_threads(move || ordered.shutdown());
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TorchComm>()?;
    m.add_class::<Pending>()?;
    m.add("CollectiveError", m.py().get_type::<CollectiveError>())?;
    Ok(())
}
