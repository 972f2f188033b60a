//! `kolo._kolo`, the extension module of kolo's Python package. It adds no
//! logic of its own: the `kolo` command is the Rust binary's `main`, a
//! Python worker agent is kolo-exec's agent, and `kolo.Executor` drives
//! kolo-exec's Executor. Python objects cross as pickled bytes; the worker
//! side calls into `kolo._remote` with the GIL held only for the call.

use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde::{Deserialize, Serialize};

use kolo_exec::{
    EngineChoice, Executable, Executor, Registry, Settings, Task, UserError, WorkerContext, WorkerRequest,
};

mod elastic;

/// The Python state in each worker (what `start(executable_cls)` made).
struct PyWorker {
    state: Py<PyAny>,
    /// `kolo._remote.call`, looked up once.
    call: Py<PyAny>,
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
            Ok(PyWorker { state: state.unbind(), call: remote.getattr("call")?.unbind() })
        })
        .map_err(|e: PyErr| e.to_string().into())
    }
}

/// How `kolo.report` reaches the driver: this process's agent, set when
/// the worker's state is created.
static REPORTER: std::sync::OnceLock<kolo_exec::Reporter> = std::sync::OnceLock::new();

/// Sends pickled bytes to the driver's callbacks; false where no call of a
/// kolo worker is running (the caller warns).
#[pyfunction]
fn report(py: Python<'_>, data: Vec<u8>) -> PyResult<bool> {
    let Some(reporter) = REPORTER.get() else { return Ok(false) };
    // waits while the driver is behind: other Python threads go on
    match py.allow_threads(|| reporter.report_bytes(data)) {
        Ok(()) => Ok(true),
        Err(kolo_exec::ReportError::NoCall) => Ok(false),
        Err(e) => Err(error(e)),
    }
}

/// A pickled call; its answer is pickled too (a value, or the exception
/// with its traceback: Python errors travel as answers).
#[derive(Serialize, Deserialize)]
struct PyCall {
    payload: Vec<u8>,
}

impl Task<PyWorker> for PyCall {
    const NAME: &'static str = "kolo.python.call";
    type Output = Vec<u8>;
    fn run(self, worker: &mut PyWorker, _: &WorkerContext) -> Result<Vec<u8>, UserError> {
        Python::with_gil(|py| {
            let answer = worker.call.bind(py).call1((worker.state.bind(py), PyBytes::new(py, &self.payload)))?;
            answer.extract::<Vec<u8>>()
        })
        .map_err(|e: PyErr| e.to_string().into())
    }
}

/// A pickled call of an elastic job: the pickled value, or, if the
/// function raised, a failure (the process failed, as Horovod's elastic
/// driver sees a worker that raised).
#[derive(Serialize, Deserialize)]
struct PyElasticCall {
    payload: Vec<u8>,
}

impl Task<PyWorker> for PyElasticCall {
    const NAME: &'static str = "kolo.python.elastic-call";
    type Output = Vec<u8>;
    fn run(self, worker: &mut PyWorker, _: &WorkerContext) -> Result<Vec<u8>, UserError> {
        Python::with_gil(|py| {
            let call = || -> PyResult<Vec<u8>> {
                let remote = py.import("kolo._remote")?;
                let args = (worker.state.bind(py), PyBytes::new(py, &self.payload));
                remote.call_method1("call_elastic", args)?.extract::<Vec<u8>>()
            };
            // the exception's own text: what the function raised, and where
            call().map_err(|e| UserError::from(e.value(py).to_string()))
        })
    }
}

/// What a Python worker can run: the same in the driver (its build id) and
/// in the agents.
fn registry() -> Registry {
    Registry::new().executable::<PyWorker>().task::<PyWorker, PyCall>().task::<PyWorker, PyElasticCall>()
}

/// Runs kolo's command line (`argv[0]` is the program's name) and returns
/// its exit code; workers are started as `worker_program worker_args...`
/// (the Python package passes its interpreter and `-m kolo._worker`).
#[pyfunction]
#[pyo3(signature = (argv, worker_program=None, worker_args=Vec::new()))]
fn main(py: Python<'_>, argv: Vec<String>, worker_program: Option<String>, worker_args: Vec<String>) -> i32 {
    let worker = kolo::WorkerProgram { program: worker_program.map(Into::into), args: worker_args };
    // kolo blocks on its own runtime; Python's other threads keep running
    py.allow_threads(|| {
        kolo_exec::serve_if_worker(registry());
        kolo::main(argv.into_iter().map(Into::into).collect(), worker)
    })
}

/// Serves as a worker agent and exits, if this process was started as one;
/// returns at once otherwise.
#[pyfunction]
fn serve_worker(py: Python<'_>) {
    py.allow_threads(|| kolo_exec::serve_if_worker(registry()));
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

/// How a Python user gets past a placement that does not fit.
const PLACEMENT_HINT: &str = "ask for fewer workers (num_workers) or fewer CPUs or GPUs each (cpus_per_worker, \
    gpus_per_worker), or give the hosts' slots yourself, e.g. hosts=\"localhost:4\" to run 4 workers on this \
    machine whatever its cores";

/// kolo's errors as the exceptions Python users catch: a placement that
/// does not fit is a `PlacementError` (a `ValueError`), other bad input a
/// `ValueError`, workers that did not come in time a `TimeoutError`.
fn exec_error(e: kolo_exec::ExecError) -> PyErr {
    use kolo_exec::ExecError as E;
    use kolo_topology::TopologyError as T;
    match &e {
        E::Topology(T::Infeasible { .. } | T::NotEnoughSlots { .. }) => {
            PlacementError::new_err(format!("{e}; {PLACEMENT_HINT}"))
        }
        E::Topology(_) | E::BadSettings(_) | E::NoCommand => PyValueError::new_err(e.to_string()),
        E::StartTimeout { .. } => PyTimeoutError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// kolo-exec's Executor on its own runtime, for `kolo.Executor`.
#[pyclass]
struct Driver {
    inner: std::sync::Mutex<Option<(tokio::runtime::Runtime, Executor)>>,
    /// How to make more executors like it (an elastic job's cohorts).
    spec: CohortSpec,
}

#[derive(Clone)]
struct CohortSpec {
    settings: Settings,
    cpus_per_worker: u32,
    gpus_per_worker: u32,
    choice: EngineChoice,
    hosts: Vec<kolo_topology::HostSpec>,
    options: kolo_exec::EngineOptions,
}

/// Waits for `work` with the GIL released, looking for Python's signals
/// (Ctrl-C) every 100 ms: a call into the workers may take as long as the
/// user's function does.
fn interruptible<T>(
    runtime: &tokio::runtime::Runtime,
    work: impl std::future::Future<Output = Result<T, kolo_exec::ExecError>>,
) -> PyResult<T> {
    runtime.block_on(async {
        tokio::pin!(work);
        loop {
            tokio::select! {
                done = &mut work => return done.map_err(exec_error),
                _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {
                    Python::with_gil(|py| py.check_signals())?;
                }
            }
        }
    })
}

impl Driver {
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        work: impl FnOnce(&tokio::runtime::Runtime, &mut Executor) -> PyResult<T> + Send,
    ) -> PyResult<T> {
        py.allow_threads(|| {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let (runtime, executor) = inner.as_mut().ok_or_else(|| error("the executor was shut down"))?;
            let result = work(runtime, executor);
            // interrupted (Ctrl-C): nothing of the job outlives the call
            if result
                .as_ref()
                .is_err_and(|e| Python::with_gil(|py| e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py)))
            {
                if let Some((runtime, mut executor)) = inner.take() {
                    runtime.block_on(executor.shutdown());
                }
            }
            result
        })
    }
}

#[pymethods]
impl Driver {
    /// `hosts` is kolo's `-H` list (`h1:2,h2:2`); `colocated` places
    /// `workers_per_host` on each of `num_hosts` distinct hosts.
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (num_workers, num_hosts, workers_per_host, cpus_per_worker, gpus_per_worker, hosts, engine, start_timeout_s, worker_program, worker_args, placement_timeout_s=100.0, nics=None, ssh_identity_file=None, ssh_config_file=None, ray_address=None, ray_placement_group=None))]
    fn new(
        num_workers: Option<u32>,
        num_hosts: Option<u32>,
        workers_per_host: u32,
        cpus_per_worker: u32,
        gpus_per_worker: u32,
        hosts: Option<String>,
        engine: Option<String>,
        start_timeout_s: f64,
        worker_program: String,
        worker_args: Vec<String>,
        placement_timeout_s: f64,
        nics: Option<Vec<String>>,
        ssh_identity_file: Option<String>,
        ssh_config_file: Option<String>,
        ray_address: Option<String>,
        ray_placement_group: Option<String>,
    ) -> PyResult<Self> {
        let request = match (num_workers, num_hosts) {
            (Some(n), None) => WorkerRequest::pack(n),
            (None, Some(h)) => WorkerRequest::colocated(h, workers_per_host),
            _ => return Err(value_error("give num_workers or num_hosts, not both")),
        }
        .cpus_per_worker(cpus_per_worker)
        .gpus_per_worker(gpus_per_worker);
        let mut settings = Settings::default();
        if !(start_timeout_s.is_finite() && start_timeout_s > 0.0) {
            return Err(value_error(format!("timeout_s must be a positive number of seconds, got {start_timeout_s}")));
        }
        settings.start_timeout = std::time::Duration::from_secs_f64(start_timeout_s);
        if !(placement_timeout_s.is_finite() && placement_timeout_s > 0.0) {
            return Err(value_error(format!("placement_group_timeout_s must be positive, got {placement_timeout_s}")));
        }
        settings.placement_timeout = std::time::Duration::from_secs_f64(placement_timeout_s);
        settings.nics = nics;
        settings.ssh.identity_file = ssh_identity_file.map(Into::into);
        settings.ssh.config_file = ssh_config_file.map(Into::into);
        // the workers' Python runs the Ray bridge too: it has Ray if the caller does
        let ray = kolo_exec::RayOptions {
            address: ray_address,
            python: worker_program.clone().into(),
            placement_group: ray_placement_group,
        };
        settings.worker_program = Some(worker_program.into());
        settings.worker_args = worker_args;
        let host_list = match &hosts {
            Some(list) => kolo_topology::parse_host_list(list).map_err(value_error)?,
            None => Vec::new(),
        };
        let choice = match engine.as_deref() {
            None => EngineChoice::Auto,
            Some("local") => EngineChoice::Local,
            Some("ssh") => EngineChoice::Ssh,
            Some("slurm") => EngineChoice::Slurm,
            Some("ray") => EngineChoice::Ray,
            Some(other) => return Err(value_error(format!("unknown engine '{other}': use local, ssh, slurm or ray"))),
        };
        let this_machine = match choice {
            EngineChoice::Local => true,
            // as `kolo run`: inside a Slurm allocation, its nodes
            EngineChoice::Auto => !kolo_exec::SlurmEngine::in_allocation(),
            _ => false,
        };
        let options = kolo_exec::EngineOptions { ssh: settings.ssh.clone(), ray, ..Default::default() };
        let spec = CohortSpec {
            settings: settings.clone(),
            cpus_per_worker,
            gpus_per_worker,
            choice,
            hosts: host_list.clone(),
            options: options.clone(),
        };
        let executor = if host_list.is_empty() && this_machine {
            // no host list: this machine
            Executor::new(settings, request)
        } else {
            choice
                .engine(host_list, &request, options)
                .and_then(|engine| Executor::with_engine(settings, request, engine))
        }
        .map_err(exec_error)?;
        // the workers are `python -m kolo._worker` with this registry
        kolo_exec::set_build_id(registry().build_id());
        // one thread of its own: heartbeats and output go on while Python
        // is busy between calls, not only while it waits in one
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kolo-driver")
            .enable_all()
            .build()
            .map_err(error)?;
        Ok(Driver { inner: std::sync::Mutex::new(Some((runtime, executor))), spec })
    }

    /// Starts the workers and creates each one's state from `args`.
    fn start(&self, py: Python<'_>, args: Vec<u8>, env: Vec<(String, String)>) -> PyResult<()> {
        self.with(py, |rt, ex| interruptible(rt, ex.start::<PyWorker>(&args, &env)))
    }

    /// Runs the pickled call on every worker; the answers in rank order.
    /// `on_report(rank, bytes)` gets what workers report meanwhile; if it
    /// raises, it is not called again and its exception is raised once
    /// the call is done.
    #[pyo3(signature = (payload, on_report=None))]
    fn execute(&self, py: Python<'_>, payload: Vec<u8>, on_report: Option<Py<PyAny>>) -> PyResult<Vec<Py<PyBytes>>> {
        let call = PyCall { payload };
        let answers = self.with(py, |rt, ex| match &on_report {
            None => interruptible(rt, ex.execute::<PyWorker, PyCall>(&call)),
            Some(callback) => {
                let mut failed: Option<PyErr> = None;
                let answers = interruptible(
                    rt,
                    ex.execute_reporting::<PyWorker, PyCall>(&call, |report| {
                        if failed.is_none() {
                            Python::with_gil(|py| {
                                let data = PyBytes::new(py, &report.data);
                                failed = callback.call1(py, (report.rank, data)).err();
                            });
                        }
                    }),
                )?;
                failed.map_or(Ok(answers), Err)
            }
        })?;
        Ok(answers.iter().map(|a| PyBytes::new(py, a).unbind()).collect())
    }

    /// Runs the pickled call on rank 0 only.
    fn execute_single(&self, py: Python<'_>, payload: Vec<u8>) -> PyResult<Py<PyBytes>> {
        let call = PyCall { payload };
        let answer = self.with(py, |rt, ex| interruptible(rt, ex.execute_single::<PyWorker, PyCall>(&call)))?;
        Ok(PyBytes::new(py, &answer).unbind())
    }

    /// Runs the pickled call in place, elastically (Horovod's elastic
    /// executor): workers are started per cohort on the hosts (or those a
    /// discovery script prints) with state `args` and `env`; the answers
    /// of the last round's members, in rank order. `on_event(dict)` hears
    /// each membership change and `on_report(rank, bytes)` each value
    /// reported (`rank` in the current round, or None); if one raises,
    /// neither is called again and its exception is raised at the end.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (args, env, payload, min_workers, max_workers, reset_limit=None, cooldown_range=None, elastic_timeout_s=600.0, discovery_script=None, discovery_interval_s=1.0, slots_per_host=1, on_event=None, on_report=None))]
    fn run_elastic(
        &self,
        py: Python<'_>,
        args: Vec<u8>,
        env: Vec<(String, String)>,
        payload: Vec<u8>,
        min_workers: u32,
        max_workers: u32,
        reset_limit: Option<u32>,
        cooldown_range: Option<(f64, f64)>,
        elastic_timeout_s: f64,
        discovery_script: Option<String>,
        discovery_interval_s: f64,
        slots_per_host: u32,
        on_event: Option<Py<PyAny>>,
        on_report: Option<Py<PyAny>>,
    ) -> PyResult<Vec<Py<PyBytes>>> {
        use kolo_exec::elastic::{Discovery, ElasticEvent, ElasticJob, TaskWork};
        use std::time::Duration;
        let in_allocation = kolo_exec::SlurmEngine::in_allocation();
        match self.spec.choice {
            EngineChoice::Slurm if !in_allocation => {
                return Err(error(
                    "an elastic executor under Slurm runs inside an allocation (salloc or sbatch): kolo does not grow one it asked for",
                ))
            }
            _ => {}
        }
        let seconds = |what: &str, s: f64| {
            (s.is_finite() && s > 0.0)
                .then(|| Duration::from_secs_f64(s))
                .ok_or_else(|| value_error(format!("{what} must be a positive number of seconds, got {s}")))
        };
        let mut config = kolo_topology::ElasticConfig::new(min_workers, max_workers).map_err(value_error)?;
        config.reset_limit = reset_limit;
        config.names = kolo_topology::OptionNames::PYTHON;
        config.elastic_timeout = seconds("elastic_timeout", elastic_timeout_s)?;
        if let Some((lo, hi)) = cooldown_range {
            config.cooldown = Some(
                kolo_topology::Cooldown::new(seconds("cooldown_range", lo)?, seconds("cooldown_range", hi)?)
                    .map_err(value_error)?,
            );
        }
        // with no host list: inside an allocation its nodes (each cohort a
        // step on them), else this machine
        let choice = match self.spec.choice {
            EngineChoice::Auto if self.spec.hosts.is_empty() && in_allocation => EngineChoice::Slurm,
            EngineChoice::Auto if self.spec.hosts.is_empty() => EngineChoice::Local,
            other => other,
        };
        let fixed = match (self.spec.hosts.is_empty(), choice) {
            (false, _) => self.spec.hosts.clone(),
            (true, EngineChoice::Slurm) => kolo_exec::SlurmEngine::allocation_hosts().map_err(error)?,
            (true, EngineChoice::Ray) => Vec::new(),
            (true, _) => vec![kolo_topology::HostSpec::new("localhost", max_workers)],
        };
        let resources =
            kolo_topology::WorkerResources { cpus: self.spec.cpus_per_worker, gpus: self.spec.gpus_per_worker };
        let source = match discovery_script {
            None => choice.host_source(&self.spec.options, resources),
            Some(_) => None,
        };
        let discovery = Discovery {
            script: discovery_script.map(Into::into),
            source,
            fixed,
            interval: seconds("discovery_interval", discovery_interval_s)?,
            slots_per_host: slots_per_host.max(1),
        };
        let spec = self.spec.clone();
        let factory: kolo_exec::elastic::CohortFactory = std::sync::Arc::new(move |cohort| {
            let spec = spec.clone();
            let kolo_exec::elastic::Cohort { hosts, np, secret, first_process } = cohort;
            Box::pin(async move {
                let request = WorkerRequest::pack(np as u32)
                    .cpus_per_worker(spec.cpus_per_worker)
                    .gpus_per_worker(spec.gpus_per_worker);
                let mut settings = spec.settings.clone().with_secret(secret);
                settings.output.first_label = first_process;
                // engines look host names up: off the runtime
                let engine = tokio::task::spawn_blocking(move || {
                    choice.elastic_engine(hosts, &request, spec.options).map(|e| (e, request))
                })
                .await
                .map_err(|e| kolo_exec::ExecError::BadSettings(e.to_string()))?;
                let (engine, request) = engine?;
                Executor::with_engine(settings, request, engine)
            })
        });
        let failed: std::sync::Arc<std::sync::Mutex<Option<PyErr>>> = Default::default();
        let last_failure: std::sync::Arc<std::sync::Mutex<Option<String>>> = Default::default();
        let (heard, failure) = (failed.clone(), last_failure.clone());
        let listener = move |event: ElasticEvent| {
            if let ElasticEvent::Failed { .. } = &event {
                *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(event.to_string());
            }
            let mut failed = heard.lock().unwrap_or_else(|p| p.into_inner());
            if failed.is_some() {
                return;
            }
            Python::with_gil(|py| {
                *failed = match (&event, &on_report, &on_event) {
                    (ElasticEvent::Reported { rank, data }, Some(callback), _) => {
                        callback.call1(py, (*rank, PyBytes::new(py, data))).err()
                    }
                    (ElasticEvent::Reported { .. }, None, _) | (_, _, None) => None,
                    (_, _, Some(callback)) => {
                        elastic::event_dict(py, &event).and_then(|d| callback.call1(py, (d,))).err()
                    }
                };
            });
        };
        let work = TaskWork::<PyWorker, PyElasticCall> { args, task: PyElasticCall { payload } };
        let answers = py.allow_threads(|| {
            let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let (runtime, _) = inner.as_ref().ok_or_else(|| error("the executor was shut down"))?;
            let job = ElasticJob::run(work, config, discovery, factory, env, listener, std::future::pending());
            interruptible(runtime, job)
        })?;
        if let Some(e) = failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(e);
        }
        if let Some(reason) = answers.stopped {
            let last = match last_failure.lock().unwrap_or_else(|p| p.into_inner()).take() {
                Some(failure) => format!("; the last failure: {failure}"),
                None => String::new(),
            };
            return Err(error(format!("the elastic job stopped: {reason}{last}")));
        }
        Ok(answers.results.iter().map(|a| PyBytes::new(py, a).unbind()).collect())
    }

    /// `(rank, host)` of every worker, in rank order.
    fn workers(&self, py: Python<'_>) -> PyResult<Vec<(u32, String)>> {
        self.with(py, |_, ex| Ok(ex.workers().into_iter().map(|w| (w.rank, w.hostname)).collect()))
    }

    /// Stops the workers; the driver cannot be used afterwards.
    fn shutdown(&self, py: Python<'_>) {
        py.allow_threads(|| {
            if let Some((runtime, mut executor)) = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take() {
                runtime.block_on(executor.shutdown());
            }
        })
    }
}

#[pymodule]
fn _kolo(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_function(wrap_pyfunction!(serve_worker, m)?)?;
    m.add_function(wrap_pyfunction!(report, m)?)?;
    m.add_class::<Driver>()?;
    m.add("PlacementError", m.py().get_type::<PlacementError>())?;
    elastic::register(m)?;
    Ok(())
}
