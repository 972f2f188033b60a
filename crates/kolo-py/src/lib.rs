//! `kolo._kolo`, the extension module of kolo's Python package. It adds no
//! logic of its own: the `kolo` command is the Rust binary's `main`, a
//! Python worker agent is kolo-agent's agent, and `kolo.Executor` drives
//! kolo-exec's Executor through kolo-job's one job description. Python
//! objects cross as pickled bytes; the worker side calls into
//! `kolo._remote` with the GIL held only for the call.
//!
//! - `worker`: a worker's Python state, the pickled calls, `kolo.report`
//! - `driver`: `kolo.Executor`'s job and its driver, fixed or elastic
//! - `elastic`: kolo-comm's elastic API for the workers, events as dicts
//! - `horovod`: Horovod's core (kolo-horovod) for `kolo.horovod.torch`

#![warn(missing_docs)]

use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

mod communicators;
mod driver;
mod dtypes;
mod elastic;
mod errors;
mod horovod;
mod ordered;
mod tensorflow;
mod torch;
mod worker;

/// Runs kolo's command line (`argv[0]` is the program's name) and returns
/// its exit code; workers are started as `worker_program worker_args...`
/// (the Python package passes its interpreter and `-m kolo._worker`).
#[pyfunction]
#[pyo3(signature = (argv, worker_program=None, worker_args=Vec::new()))]
fn main(py: Python<'_>, argv: Vec<String>, worker_program: Option<String>, worker_args: Vec<String>) -> i32 {
    let worker = kolo::WorkerProgram { program: worker_program.map(Into::into), args: worker_args };
    // kolo blocks on its own runtime; Python's other threads keep running
    py.allow_threads(|| {
        kolo_agent::serve_if_worker(worker::registry());
        kolo::main(argv.into_iter().map(Into::into).collect(), worker)
    })
}

/// Serves as a worker agent and exits, if this process was started as one;
/// returns at once otherwise.
#[pyfunction]
fn serve_worker(py: Python<'_>) {
    py.allow_threads(|| kolo_agent::serve_if_worker(worker::registry()));
}

/// The path through which this worker's Python counts its collectives
/// and steps (kolo.Executor's workers: `kolo status`, `hang_timeout_s`).
#[pyfunction]
fn own_progress_file() -> PyResult<String> {
    kolo_agent::own_progress_file().map_err(error)
}

/// One rank's `HOROVOD_*` local and cross ranks, by name.
type RankRow = Vec<(&'static str, u32)>;

/// horovod.ray's `Coordinator.finalize_registration`: every rank's local
/// and cross ranks from `(hostname, node_id, world_rank)` registrations,
/// by kolo-topology's rank math, as `HOROVOD_*` names to values, in rank
/// order; and the `node:count` string of the nodes in registration order.
#[pyfunction]
fn rank_table(registrations: Vec<(String, String, u32)>) -> PyResult<(Vec<RankRow>, String)> {
    let mut coordinator = kolo_topology::Coordinator::new();
    for (hostname, node_id, rank) in &registrations {
        coordinator.register(hostname, node_id, *rank);
    }
    let table = coordinator.finalize().map_err(|e| PyValueError::new_err(e.to_string()))?;
    let rows = table
        .iter()
        .map(|r| {
            vec![
                ("HOROVOD_CROSS_RANK", r.cross_rank),
                ("HOROVOD_CROSS_SIZE", r.cross_size),
                ("HOROVOD_LOCAL_RANK", r.local_rank),
                ("HOROVOD_LOCAL_SIZE", r.local_size),
            ]
        })
        .collect();
    Ok((rows, coordinator.node_id_string()))
}

fn error(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

pyo3::create_exception!(
    _kolo,
    PlacementError,
    pyo3::exceptions::PyValueError,
    "The workers asked for do not fit on the hosts (a ValueError)."
);
pyo3::create_exception!(
    _kolo,
    WorkerLost,
    PyRuntimeError,
    "A worker died, or its host stopped answering, during a call (a RuntimeError)."
);
pyo3::create_exception!(
    _kolo,
    HangError,
    PyRuntimeError,
    "No worker made progress (a collective, a step, a line of output, a report) for the executor's hang_timeout_s: the message says which rank held the others back and every rank's stacks (a RuntimeError)."
);
pyo3::create_exception!(
    _kolo,
    JobStopped,
    PyRuntimeError,
    "An elastic job stopped: its limits were reached (a RuntimeError)."
);

/// How a Python user gets past a placement that does not fit.
const PLACEMENT_HINT: &str = "ask for fewer workers (num_workers) or fewer CPUs or GPUs each (cpus_per_worker, \
    gpus_per_worker), or give the hosts' slots yourself, e.g. hosts=\"localhost:4\" to run 4 workers on this \
    machine whatever its cores";

/// kolo's errors as the exceptions Python users catch: a placement that
/// does not fit is a `PlacementError` (a `ValueError`), other bad input a
/// `ValueError`, workers that did not come in time a `TimeoutError`, a
/// worker lost during a call a `WorkerLost` (a `RuntimeError`).
fn exec_error(e: kolo_engine::ExecError) -> PyErr {
    use kolo_engine::ExecError as E;
    use kolo_topology::TopologyError as T;
    match &e {
        E::Topology(T::Infeasible { .. } | T::NotEnoughSlots { .. }) => {
            PlacementError::new_err(format!("{e}; {PLACEMENT_HINT}"))
        }
        E::Topology(_) | E::BadSettings(_) | E::NoCommand => PyValueError::new_err(e.to_string()),
        E::StartTimeout { .. } | E::PlacementTimeout { .. } => PyTimeoutError::new_err(e.to_string()),
        E::WorkerLost { .. } => WorkerLost::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

#[pymodule]
fn _kolo(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_function(wrap_pyfunction!(serve_worker, m)?)?;
    m.add_function(wrap_pyfunction!(worker::report, m)?)?;
    m.add_function(wrap_pyfunction!(own_progress_file, m)?)?;
    m.add_function(wrap_pyfunction!(rank_table, m)?)?;
    m.add("PYTHON_HOOKS", kolo_agent::PYTHON_HOOKS)?;
    // the names of kolo's variables, from their one table
    let env = pyo3::types::PyDict::new(m.py());
    for (key, name) in kolo_topology::env_names::ALL {
        env.set_item(key, name)?;
    }
    m.add("ENV", env)?;
    m.add_class::<driver::Job>()?;
    m.add_class::<driver::Driver>()?;
    m.add("PlacementError", m.py().get_type::<PlacementError>())?;
    m.add("WorkerLost", m.py().get_type::<WorkerLost>())?;
    m.add("JobStopped", m.py().get_type::<JobStopped>())?;
    m.add("HangError", m.py().get_type::<HangError>())?;
    elastic::register(m)?;
    torch::register(m)?;
    horovod::register(m)?;
    tensorflow::register_module(m)?;
    Ok(())
}
