//! `kolo._kolo`, the extension module of kolo's Python package. It adds no
//! logic of its own: the `kolo` command is the Rust binary's `main`, and a
//! Python worker agent is kolo-exec's agent.

use pyo3::prelude::*;

/// Runs kolo's command line (`argv[0]` is the program's name) and returns
/// its exit code; workers are started as `worker_program worker_args...`
/// (the Python package passes its interpreter and `-m kolo._worker`).
#[pyfunction]
#[pyo3(signature = (argv, worker_program=None, worker_args=Vec::new()))]
fn main(py: Python<'_>, argv: Vec<String>, worker_program: Option<String>, worker_args: Vec<String>) -> i32 {
    let worker = kolo::WorkerProgram { program: worker_program.map(Into::into), args: worker_args };
    // kolo blocks on its own runtime; Python's other threads keep running
    py.allow_threads(|| kolo::main(argv.into_iter().map(Into::into).collect(), worker))
}

/// Serves as a worker agent and exits, if this process was started as one;
/// returns at once otherwise.
#[pyfunction]
fn serve_worker(py: Python<'_>) {
    py.allow_threads(|| kolo_exec::serve_if_worker(kolo_exec::Registry::new()));
}

#[pymodule]
fn _kolo(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_function(wrap_pyfunction!(serve_worker, m)?)?;
    Ok(())
}
