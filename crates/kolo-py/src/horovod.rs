//! kolo-horovod for `kolo.horovod.torch`: the core of a job (from the
//! environment, or an elastic round's), submissions of tensors by name as
//! (address, bytes) of memory the Python side keeps alive until the
//! handle is done, and handles to wait on with the GIL released.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kolo_comm::Communicator;
use kolo_horovod::message::ResponseType;
use kolo_horovod::{
    Buffer, Core, DeviceExecutor, DeviceWork, Failure, FailureKind, Handle, ReduceOp, RequestType, Settings, Submit,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};

use crate::communicators;
use crate::dtypes::element_type;

fn request_type(kind: &str) -> PyResult<RequestType> {
    Ok(match kind {
        "allreduce" => RequestType::Allreduce,
        "allgather" => RequestType::Allgather,
        "broadcast" => RequestType::Broadcast,
        "alltoall" => RequestType::Alltoall,
        "reducescatter" => RequestType::Reducescatter,
        "barrier" => RequestType::Barrier,
        "join" => RequestType::Join,
        other => return Err(PyValueError::new_err(format!("unknown Horovod op '{other}'"))),
    })
}

fn reduce_op(op: i64) -> PyResult<ReduceOp> {
    Ok(match op {
        0 => ReduceOp::Average,
        1 => ReduceOp::Sum,
        2 => ReduceOp::Adasum,
        3 => ReduceOp::Min,
        4 => ReduceOp::Max,
        5 => ReduceOp::Product,
        other => return Err(PyValueError::new_err(format!("unknown reduction op {other}"))),
    })
}

/// The Python side's runner of device collectives: called from the core's
/// thread with each agreed response over device tensors, as `(kind,
/// process_set, names, inputs, sizes, dtype, reduce_op, prescale,
/// postscale, devices)` (`inputs`: the address this rank submitted under
/// each name, None where it joined); an exception stops the core with
/// its text.
#[derive(Debug)]
struct PythonDeviceExecutor(Py<PyAny>);

impl DeviceExecutor for PythonDeviceExecutor {
    fn execute(&self, work: &DeviceWork<'_>) -> Result<(), String> {
        let r = work.response;
        let kind = match r.kind {
            ResponseType::Allreduce => "allreduce",
            ResponseType::Adasum => "adasum",
            ResponseType::Allgather => "allgather",
            ResponseType::Broadcast => "broadcast",
            ResponseType::Alltoall => "alltoall",
            ResponseType::Reducescatter => "reducescatter",
            other => return Err(format!("a {other:?} response has no device collective")),
        };
        Python::with_gil(|py| {
            let args = (
                kind,
                work.set,
                r.names.clone(),
                work.inputs.clone(),
                r.sizes.clone(),
                r.dtype.name(),
                // upstream's numbering, as Python's ops take it
                r.reduce_op as i64,
                r.prescale,
                r.postscale,
                r.devices.clone(),
            );
            self.0.call1(py, args).map(drop).map_err(|e| format!("a device collective ({kind}) failed: {e}"))
        })
    }
}

/// A failure as the exception upstream raises: bad input a `ValueError`,
/// the rest kolo's `CollectiveError` (a `MembershipError` when the job's
/// membership changed), which the Python side raises as
/// `HorovodInternalError`.
fn failure(f: Failure) -> PyErr {
    match (f.kind, f.membership) {
        (FailureKind::Invalid, _) => PyValueError::new_err(f.message),
        (FailureKind::Internal, membership) => crate::errors::collective_failed(f.message, membership),
    }
}

fn refused(r: kolo_horovod::Refused) -> PyErr {
    failure(Failure { kind: r.kind, message: r.message, membership: false })
}

fn settings() -> PyResult<Settings> {
    let mut settings = Settings::from_env().map_err(PyValueError::new_err)?;
    if settings.stall_file.is_none() {
        // a kolo.Executor worker is the rank its agent inspects: the
        // warning stays in this process's memory, where the agent reads it
        settings.stall_file = kolo_agent::own_stall_file().ok().map(Into::into);
    }
    Ok(settings)
}

/// One tensor of a submission to the core, checked as it is made: which
/// collective (`"allreduce"`...), the name every rank submits it under,
/// its element type (numpy's names: `"float32"`, `"bfloat16"`...), its
/// shape, and its memory as `(address, bytes)`, which the caller keeps
/// alive until the handle is done; the rest as upstream's ops take them.
#[pyclass(module = "kolo._kolo", frozen)]
pub struct Submission(Submit);

#[pymethods]
impl Submission {
    #[new]
    #[pyo3(signature = (
        op, name, dtype, shape, data, *, device=kolo_horovod::CPU_DEVICE_ID, root_rank=0, reduce_op=1,
        prescale=1.0, postscale=1.0, output=None, splits=Vec::new()
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        op: &str,
        name: String,
        dtype: &str,
        shape: Vec<i64>,
        data: (usize, usize),
        device: i32,
        root_rank: i64,
        reduce_op: i64,
        prescale: f64,
        postscale: f64,
        output: Option<(usize, usize)>,
        splits: Vec<i64>,
    ) -> PyResult<Submission> {
        let mut s = Submit::new(request_type(op)?, name, element_type(dtype)?, shape, Buffer::new(data.0, data.1));
        s.device = device;
        s.root_rank = root_rank;
        s.reduce_op = self::reduce_op(reduce_op)?;
        s.prescale = prescale;
        s.postscale = postscale;
        s.output = output.map(|(addr, len)| Buffer::new(addr, len));
        s.splits = splits;
        Ok(Submission(s))
    }

    /// The name it is submitted under.
    #[getter]
    fn name(&self) -> &str {
        &self.0.name
    }

    fn __repr__(&self) -> String {
        let s = &self.0;
        format!("Submission({:?}, {:?}, {}, {:?})", s.kind, s.name, s.dtype.name(), s.shape)
    }
}

/// Horovod's core of this process.
#[pyclass(module = "kolo._kolo")]
pub struct HorovodCore {
    core: Arc<Core>,
}

impl HorovodCore {
    pub(crate) fn start(py: Python<'_>, comm: Communicator, process_sets: Vec<Vec<i64>>) -> PyResult<HorovodCore> {
        let settings = settings()?;
        let core = py.allow_threads(|| Core::start(comm, settings, &process_sets)).map_err(refused)?;
        Ok(HorovodCore { core: Arc::new(core) })
    }
}

#[pymethods]
impl HorovodCore {
    /// The kolo job's core, over a communicator of its own (`generation`
    /// tells apart successive inits of the same processes); `process_sets`
    /// are registered before anything runs (every rank passes the same).
    #[staticmethod]
    #[pyo3(signature = (generation, timeout_s=None, process_sets=Vec::new()))]
    fn from_env(
        py: Python<'_>,
        generation: u64,
        timeout_s: Option<f64>,
        process_sets: Vec<Vec<i64>>,
    ) -> PyResult<HorovodCore> {
        let comm = communicators::from_job_env(py, "hvd", generation, timeout_s)?;
        HorovodCore::start(py, comm, process_sets)
    }

    /// The core of one process alone (Horovod without a job).
    #[staticmethod]
    #[pyo3(signature = (process_sets=Vec::new()))]
    fn single(py: Python<'_>, process_sets: Vec<Vec<i64>>) -> PyResult<HorovodCore> {
        let comm = communicators::single(py, "single-hvd")?;
        HorovodCore::start(py, comm, process_sets)
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.core.rank()
    }

    #[getter]
    fn size(&self) -> u32 {
        self.core.size()
    }

    /// Submits `tensors` (`Submission`s) as one group. `keep` (what owns
    /// their memory) is held until the handle is done.
    #[pyo3(signature = (process_set, tensors, keep=None))]
    fn submit(
        &self,
        process_set: u32,
        tensors: Vec<PyRef<'_, Submission>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<HorovodHandle> {
        let submits = tensors.iter().map(|t| t.0.clone()).collect();
        let handle = self.core.submit(process_set, submits).map_err(refused)?;
        Ok(HorovodHandle::new(handle, keep))
    }

    /// Registers a process set with every rank (each calls this alike).
    fn add_process_set(&self, ranks: Vec<i64>) -> PyResult<HorovodHandle> {
        Ok(HorovodHandle::new(self.core.add_process_set(&ranks).map_err(refused)?, None))
    }

    /// Removes a process set with every rank; None for an unknown id.
    fn remove_process_set(&self, id: u32) -> PyResult<Option<HorovodHandle>> {
        Ok(self.core.remove_process_set(id).map_err(refused)?.map(|h| HorovodHandle::new(h, None)))
    }

    fn process_set_ranks(&self, id: u32) -> Option<Vec<u32>> {
        self.core.process_set_ranks(id)
    }

    fn process_set_id(&self, ranks: Vec<i64>) -> Option<u32> {
        self.core.process_set_id(&ranks)
    }

    fn process_set_ids(&self) -> Vec<u32> {
        self.core.process_set_ids()
    }

    /// Sets the runner of collectives over device tensors (None: such
    /// tensors fail); see `PythonDeviceExecutor`.
    fn set_device_executor(&self, executor: Option<Py<PyAny>>) {
        let executor = executor.map(|e| Arc::new(PythonDeviceExecutor(e)) as Arc<dyn DeviceExecutor>);
        self.core.set_device_executor(executor);
    }

    /// Makes this the core that kolo's TensorFlow ops submit to (see
    /// `tensorflow`), with the local rank and size their topology ops report.
    fn serve_tensorflow(&self, local_rank: i32, local_size: i32) {
        crate::tensorflow::serve(Some(self.core.clone()), local_rank, local_size);
    }

    /// Records Horovod's timeline into `path` from now on (rank 0 writes;
    /// needs `HOROVOD_TIMELINE` set at init, `DYNAMIC` to start none).
    #[pyo3(signature = (path, mark_cycles=false))]
    fn start_timeline(&self, py: Python<'_>, path: std::path::PathBuf, mark_cycles: bool) -> PyResult<()> {
        let core = self.core.clone();
        py.allow_threads(move || core.start_timeline(&path, mark_cycles)).map_err(refused)
    }

    /// Stops recording the timeline; its file is finished.
    fn stop_timeline(&self, py: Python<'_>) {
        let core = self.core.clone();
        py.allow_threads(move || core.stop_timeline());
    }

    /// Stops the core with every rank (waiting for this rank's loop);
    /// `reason` goes into every rank's errors for what was pending;
    /// `exiting`: this process ends (its peers will not wait for it).
    #[pyo3(signature = (reason="hvd.shutdown() was called", exiting=false))]
    fn shutdown(&self, py: Python<'_>, reason: &str, exiting: bool) {
        crate::tensorflow::stop_serving(&self.core);
        let core = self.core.clone();
        py.allow_threads(move || core.shutdown_because(reason, exiting));
    }

    /// Whether the loop stopped because the ranks agreed to shut down (a
    /// peer's `hvd.shutdown()`, a stall past its shutdown time) and no rank
    /// that asked is exiting: every rank may start a new core.
    #[getter]
    fn restartable(&self) -> bool {
        self.core.restartable()
    }

    /// What the loop has done: cycles, negotiated cycles, requests sent to
    /// the coordinator, responses run and the tensors they covered, the
    /// last stall warning.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core.stats();
        let d = PyDict::new(py);
        d.set_item("cycles", s.cycles)?;
        d.set_item("negotiated", s.negotiated)?;
        d.set_item("requests_sent", s.requests_sent)?;
        d.set_item("responses", s.responses)?;
        d.set_item("tensors", s.tensors)?;
        d.set_item("stall", s.stall)?;
        Ok(d)
    }
}

impl Drop for HorovodCore {
    fn drop(&mut self) {
        // the core's thread may be waiting for the GIL (a device collective
        // it hands to Python): stop it with the GIL released
        if Arc::strong_count(&self.core) == 1 {
            let core = self.core.clone();
            Python::with_gil(|py| py.allow_threads(move || core.shutdown()));
        }
    }
}

/// The outcome of a submission.
#[pyclass(module = "kolo._kolo")]
pub struct HorovodHandle {
    handle: Arc<Handle>,
    keep: Arc<Mutex<Option<Py<PyAny>>>>,
}

impl HorovodHandle {
    fn new(handle: Arc<Handle>, keep: Option<Py<PyAny>>) -> HorovodHandle {
        let keep = Arc::new(Mutex::new(keep));
        // the memory goes once the core is done with it, whatever the
        // caller does with the handle
        let held = keep.clone();
        handle.on_done(Box::new(move || {
            held.lock().unwrap_or_else(|p| p.into_inner()).take();
        }));
        HorovodHandle { handle, keep }
    }
}

/// A tensor's result in Python: its data where the core made it, its
/// dims, the last rank to join.
type TensorResult<'py> = (Option<Bound<'py, PyByteArray>>, Vec<i64>, i32);

/// How often a wait looks for Ctrl-C.
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

#[pymethods]
impl HorovodHandle {
    /// Whether it is done; a yes frees its names for a new submission.
    fn poll(&self) -> bool {
        self.handle.is_done()
    }

    /// Whether it is done, leaving its names taken (the caller has not
    /// looked): for kolo's own bookkeeping.
    #[getter]
    fn complete(&self) -> bool {
        self.handle.is_complete()
    }

    /// Waits until every tensor is done (Ctrl-C interrupts the wait).
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        loop {
            let handle = self.handle.clone();
            if py.allow_threads(move || handle.wait_for(SIGNAL_CHECK)) {
                return Ok(());
            }
            py.check_signals()?;
        }
    }

    /// Each tensor's `(data as a bytearray, or None; dims; last_joined_rank)` once done;
    /// raises the first failure (upstream's grouped handles fail as one).
    fn results<'py>(&self, py: Python<'py>) -> PyResult<Vec<TensorResult<'py>>> {
        self.wait(py)?;
        let outcomes = self.handle.outcomes().expect("waited");
        let mut results = Vec::with_capacity(outcomes.len());
        for outcome in outcomes {
            let out = outcome.map_err(failure)?;
            results.push((out.data.map(|d| PyByteArray::new(py, &d)), out.dims, out.last_joined_rank));
        }
        drop(self.keep.lock().unwrap_or_else(|p| p.into_inner()).take());
        Ok(results)
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<HorovodCore>()?;
    m.add_class::<Submission>()?;
    m.add_class::<HorovodHandle>()?;
    // the device a CPU tensor is submitted with to go through the executor
    m.add("HOROVOD_HOST_EXECUTOR_DEVICE", kolo_horovod::HOST_EXECUTOR_DEVICE_ID)?;
    Ok(())
}
