//! Elastic jobs in place for Python: in the workers, kolo-comm's elastic
//! API (`ElasticWorker` joins rounds, `Comm` is the round's communicator);
//! in the driver, kolo-job's `ElasticJob` running the pickled function
//! in every process of every cohort. `kolo.elastic` and `kolo.Executor`
//! wrap these.

use std::sync::Mutex;

use kolo_comm::elastic::Elastic;
use kolo_comm::{CommError, Communicator, ReduceOp};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{comm_error, HostsUpdated, MembershipError, Removed};

/// This process in an elastic job: joins rounds.
#[pyclass(module = "kolo._kolo")]
pub struct ElasticWorker {
    inner: Mutex<Elastic>,
}

#[pymethods]
impl ElasticWorker {
    /// From the variables kolo sets for an elastic job's processes.
    #[staticmethod]
    fn from_env() -> PyResult<Self> {
        Ok(ElasticWorker { inner: Mutex::new(Elastic::from_env().map_err(comm_error)?) })
    }

    /// Waits for the next round that has a place for this process and
    /// joins it; raises `Removed` when the round has none.
    fn join(&self, py: Python<'_>) -> PyResult<Comm> {
        let comm = py.allow_threads(|| self.lock().join()).map_err(comm_error)?;
        Ok(Comm { inner: Mutex::new(comm) })
    }

    /// Like `join`, for torch (kolo.torch.elastic, kolo.horovod.torch):
    /// the round's communicator behind the queue that torch's calls use.
    fn join_torch(&self, py: Python<'_>) -> PyResult<crate::torch::TorchComm> {
        let comm = py.allow_threads(|| self.lock().join()).map_err(comm_error)?;
        crate::torch::TorchComm::started(comm)
    }

    /// Horovod's core for the round joined last, over a communicator of
    /// its own (collective: every member of the round calls it).
    #[pyo3(signature = (process_sets=Vec::new()))]
    fn horovod_core(&self, py: Python<'_>, process_sets: Vec<Vec<i64>>) -> PyResult<crate::horovod::HorovodCore> {
        let comm = py.allow_threads(|| self.lock().connect_again("hvd")).map_err(comm_error)?;
        crate::horovod::HorovodCore::start(py, comm, process_sets)
    }

    /// This process's six Horovod numbers in the round joined last (rank,
    /// size, local rank, local size, cross rank, cross size).
    #[getter]
    fn assignment(&self) -> Option<(usize, usize, usize, usize, usize, usize)> {
        self.lock().assignment().map(|a| (a.rank, a.size, a.local_rank, a.local_size, a.cross_rank, a.cross_size))
    }

    /// Waits up to `timeout_s` for a round newer than the one joined last
    /// (a peer's death reaches the driver first; its round follows).
    fn wait_newer_round(&self, py: Python<'_>, timeout_s: f64) -> Option<u64> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs_f64(timeout_s.clamp(0.0, 1e9));
        py.allow_threads(|| {
            let mut newer = None;
            kolo_sys::wait::wait_until(deadline, std::time::Duration::from_millis(5), || {
                newer = self.lock().newer_round();
                newer.is_some()
            });
            newer
        })
    }

    /// The round joined last.
    #[getter]
    fn round(&self) -> Option<u64> {
        self.lock().round()
    }

    /// A round started after the one joined last (hosts came or went), if any.
    fn newer_round(&self, py: Python<'_>) -> Option<u64> {
        py.allow_threads(|| self.lock().newer_round())
    }
}

impl ElasticWorker {
    fn lock(&self) -> std::sync::MutexGuard<'_, Elastic> {
        kolo_sys::lock(&self.inner)
    }
}

/// A round's communicator: kolo-comm's collectives over bytes.
#[pyclass(module = "kolo._kolo")]
pub struct Comm {
    inner: Mutex<Communicator>,
}

fn op_of(op: &str) -> PyResult<ReduceOp> {
    Ok(match op {
        "sum" => ReduceOp::Sum,
        "avg" | "mean" => ReduceOp::Avg,
        "min" => ReduceOp::Min,
        "max" => ReduceOp::Max,
        "prod" => ReduceOp::Prod,
        other => return Err(PyValueError::new_err(format!("unknown op '{other}': use sum, avg, min, max or prod"))),
    })
}

macro_rules! reduce_as {
    ($t:ty, $comm:expr, $data:expr, $op:expr) => {{
        const SIZE: usize = std::mem::size_of::<$t>();
        if !$data.len().is_multiple_of(SIZE) {
            return Err(PyValueError::new_err(format!("{} bytes are not whole {}-byte elements", $data.len(), SIZE)));
        }
        let mut values: Vec<$t> =
            $data.chunks_exact(SIZE).map(|c| <$t>::from_ne_bytes(c.try_into().expect("SIZE"))).collect();
        $comm.allreduce_in_place(&mut values, $op).map_err(comm_error)?;
        values.iter().flat_map(|v| v.to_ne_bytes()).collect::<Vec<u8>>()
    }};
}

#[pymethods]
impl Comm {
    #[getter]
    fn rank(&self) -> usize {
        self.lock().rank()
    }

    #[getter]
    fn size(&self) -> usize {
        self.lock().size()
    }

    /// Reduces `data` (the bytes of `dtype` elements, numpy's names) over
    /// every rank; the result's bytes.
    fn allreduce<'py>(
        &self,
        py: Python<'py>,
        data: PyBackedBytes,
        dtype: &str,
        op: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let op = op_of(op)?;
        let dtype = crate::dtypes::comm_type(dtype)?;
        let out = py.allow_threads(|| -> PyResult<Vec<u8>> {
            let mut comm = self.lock();
            Ok(kolo_comm::with_element_type!(dtype, T => reduce_as!(T, comm, data, op)))
        })?;
        Ok(PyBytes::new(py, &out))
    }

    /// `root`'s bytes, on every rank (others pass anything, or None).
    #[pyo3(signature = (data, root=0))]
    fn broadcast<'py>(
        &self,
        py: Python<'py>,
        data: Option<PyBackedBytes>,
        root: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let out = py.allow_threads(|| -> Result<Vec<u8>, CommError> {
            let mut comm = self.lock();
            let mut bytes = data.map(|d| d.to_vec()).unwrap_or_default();
            comm.broadcast_bytes(&mut bytes, root)?;
            Ok(bytes)
        });
        Ok(PyBytes::new(py, &out.map_err(comm_error)?))
    }

    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        py.allow_threads(|| self.lock().barrier()).map_err(comm_error)
    }
}

impl Comm {
    fn lock(&self) -> std::sync::MutexGuard<'_, Communicator> {
        kolo_sys::lock(&self.inner)
    }
}

/// An elastic event as the Python callbacks get it: a dict with `event`
/// and its fields, and `message`, the line kolo would print.
pub(crate) fn event_dict<'py>(
    py: Python<'py>,
    event: &kolo_job::elastic::ElasticEvent,
) -> PyResult<Bound<'py, PyDict>> {
    use kolo_job::elastic::ElasticEvent as E;
    let d = PyDict::new(py);
    d.set_item("message", event.to_string())?;
    match event {
        E::Round { round, hosts } => {
            d.set_item("event", "round")?;
            d.set_item("round", round)?;
            d.set_item("hosts", hosts.clone())?;
            d.set_item("size", hosts.iter().map(|(_, n)| n).sum::<u32>())?;
        }
        E::Failed { rank, host, reason } => {
            d.set_item("event", "failed")?;
            d.set_item("rank", rank)?;
            d.set_item("host", host)?;
            d.set_item("reason", reason)?;
        }
        E::Blacklisted { host, duration } => {
            d.set_item("event", "blacklisted")?;
            d.set_item("host", host)?;
            d.set_item("seconds", duration.map(|d| d.as_secs_f64()))?;
        }
        E::Starting { hosts } => {
            d.set_item("event", "starting")?;
            d.set_item("hosts", hosts.clone())?;
        }
        E::Waiting { needed, available, left } => {
            d.set_item("event", "waiting")?;
            d.set_item("needed", needed)?;
            d.set_item("available", available)?;
            d.set_item("seconds_left", left.as_secs_f64())?;
        }
        E::Reported { rank, .. } => {
            d.set_item("event", "reported")?;
            d.set_item("rank", rank)?;
        }
        E::Joined { round, host, local_rank } => {
            d.set_item("event", "joined")?;
            d.set_item("round", round)?;
            d.set_item("host", host)?;
            d.set_item("local_rank", local_rank)?;
        }
        E::Reforming { round } => {
            d.set_item("event", "reforming")?;
            d.set_item("round", round)?;
        }
        E::Restarting { rank, host, reason } => {
            d.set_item("event", "restarting")?;
            d.set_item("rank", rank)?;
            d.set_item("host", host)?;
            d.set_item("reason", reason)?;
        }
    }
    Ok(d)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ElasticWorker>()?;
    m.add_class::<Comm>()?;
    m.add("MembershipError", m.py().get_type::<MembershipError>())?;
    m.add("HostsUpdated", m.py().get_type::<HostsUpdated>())?;
    m.add("Removed", m.py().get_type::<Removed>())?;
    Ok(())
}
