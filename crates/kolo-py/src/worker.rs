//! The worker side: a Python worker's state, the pickled calls it runs,
//! and `kolo.report`.

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;
use serde::{Deserialize, Serialize};

use kolo_proto::{Executable, Registry, Task, UserError, WorkerContext};

/// The Python state in each worker (what `start(executable_cls)` made).
pub(crate) struct PyWorker {
    state: Py<PyAny>,
    /// `kolo._remote.call` and `call_elastic`, looked up once.
    call: Py<PyAny>,
    call_elastic: Py<PyAny>,
}

impl Executable for PyWorker {
    const NAME: &'static str = "kolo.python";
    /// Pickled `(cls, args, kwargs)`, or empty for none.
    type Args = Vec<u8>;
    fn create(args: Vec<u8>, ctx: &WorkerContext) -> Result<Self, UserError> {
        // Python's os.environ is a copy taken at start: it learns the
        // rank's variables from here
        let env: Vec<(String, String)> = ctx.vars().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        if let Some(reporter) = ctx.reporter() {
            let _ = REPORTER.set(reporter);
        }
        Python::with_gil(|py| {
            let remote = py.import("kolo._remote")?;
            let state = remote.call_method1("create", (PyBytes::new(py, &args), env))?;
            Ok(PyWorker {
                state: state.unbind(),
                call: remote.getattr("call")?.unbind(),
                call_elastic: remote.getattr("call_elastic")?.unbind(),
            })
        })
        .map_err(|e: PyErr| e.to_string().into())
    }
}

/// How `kolo.report` reaches the driver: this process's agent, set when
/// the worker's state is created.
static REPORTER: std::sync::OnceLock<kolo_proto::Reporter> = std::sync::OnceLock::new();

/// Sends pickled bytes to the driver's callbacks; false where no call of a
/// kolo worker is running (the caller warns).
#[pyfunction]
pub(crate) fn report(py: Python<'_>, data: PyBackedBytes) -> PyResult<bool> {
    let Some(reporter) = REPORTER.get() else { return Ok(false) };
    // waits while the driver is behind: other Python threads go on
    match py.allow_threads(|| reporter.report_bytes(data.to_vec())) {
        Ok(()) => Ok(true),
        Err(kolo_proto::ReportError::NoCall) => Ok(false),
        Err(e) => Err(crate::error(e)),
    }
}

/// A pickled call. Its answer is pickled too: a value, or the exception
/// with its traceback (Python errors travel as answers); in an elastic
/// job, an exception is a failure of the process instead, as Horovod's
/// elastic driver sees a worker that raised.
#[derive(Serialize, Deserialize)]
pub(crate) struct PyCall {
    pub payload: Vec<u8>,
    pub elastic: bool,
}

impl Task<PyWorker> for PyCall {
    const NAME: &'static str = "kolo.python.call";
    type Output = Vec<u8>;
    fn run(self, worker: &mut PyWorker, _: &WorkerContext) -> Result<Vec<u8>, UserError> {
        Python::with_gil(|py| {
            let function = if self.elastic { &worker.call_elastic } else { &worker.call };
            let args = (worker.state.bind(py), PyBytes::new(py, &self.payload));
            // as bytes, not as a sequence of ints (pyo3's Vec<u8>: an int per byte)
            let answer = function.bind(py).call1(args).and_then(|a| Ok(a.downcast::<PyBytes>()?.as_bytes().to_vec()));
            // the exception's own text: what the function raised, and where
            answer.map_err(|e| UserError::from(if self.elastic { e.value(py).to_string() } else { e.to_string() }))
        })
    }
}

/// What a Python worker can run: the same in the driver (its build id) and
/// in the agents.
pub(crate) fn registry() -> Registry {
    Registry::new().executable::<PyWorker>().task::<PyWorker, PyCall>()
}
