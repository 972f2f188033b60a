//! The driver side: `kolo.Executor`'s arguments translated into kolo-job's
//! one job description (`Job`, checked when the Executor is made), and
//! kolo-exec's Executor on its own runtime (`Driver`), fixed or elastic.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;
use tokio::sync::watch;

use kolo_engine::{BridgeHost, EngineOptions, HostSource, RayOptions, RunsBridge, SshOptions, WorkerRequest};
use kolo_exec::{Executor, Settings};
use kolo_job::elastic::{ElasticEvent, ElasticJob, RestartJob, StopCause, TaskWork};
use kolo_job::{ElasticMode, ElasticOptions, JobSpec, OptionNames, Slots, StartOptions, Workers};
use kolo_sys::lock;

use crate::worker::{registry, PyCall, PyWorker};
use crate::{error, exec_error, HangError, JobStopped, WorkerLost};

/// How `kolo.Executor`'s messages name its arguments: horovod.ray's names.
const PYTHON_NAMES: OptionNames = OptionNames::HOROVOD_RAY;

/// A count given in Python: a positive integer, or a ValueError naming it.
fn count(name: &str, value: Option<i64>) -> PyResult<Option<u32>> {
    match value {
        None => Ok(None),
        Some(v) => u32::try_from(v)
            .ok()
            .filter(|&v| v >= 1)
            .map(Some)
            .ok_or_else(|| value_error(format!("{name} must be a positive integer, got {v}"))),
    }
}

fn value_error(e: impl std::fmt::Display) -> PyErr {
    pyo3::exceptions::PyValueError::new_err(e.to_string())
}

/// A `kolo.Executor`'s job, checked when the Executor is made.
#[pyclass(module = "kolo._kolo")]
pub(crate) struct Job {
    /// Checked when made, as horovod.ray checks its arguments.
    job: kolo_job::Job,
}

#[pymethods]
impl Job {
    /// horovod.ray's arguments (and kolo's: `hosts`, `engine`, and the
    /// elastic ones); raises ValueError naming a bad one and the fix.
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (num_workers=None, num_hosts=None, num_workers_per_host=1, cpus_per_worker=1, use_gpu=false, gpus_per_worker=None, hosts=None, engine=None, timeout_s=30.0, placement_group_timeout_s=100.0, nics=None, ssh_config_file=None, min_workers=None, max_workers=None, max_restarts=None, reset_limit=None, cooldown_range=None, elastic_timeout=600.0, host_discovery_script=None, discovery_interval=1.0, host_discovery=None))]
    fn new(
        num_workers: Option<i64>,
        num_hosts: Option<i64>,
        num_workers_per_host: i64,
        cpus_per_worker: i64,
        use_gpu: bool,
        gpus_per_worker: Option<i64>,
        hosts: Option<String>,
        engine: Option<String>,
        timeout_s: f64,
        placement_group_timeout_s: f64,
        nics: Option<Vec<String>>,
        ssh_config_file: Option<String>,
        min_workers: Option<i64>,
        max_workers: Option<i64>,
        max_restarts: Option<i64>,
        reset_limit: Option<i64>,
        cooldown_range: Option<(f64, f64)>,
        elastic_timeout: f64,
        host_discovery_script: Option<String>,
        discovery_interval: f64,
        host_discovery: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let (mut num_workers, num_hosts) = (count("num_workers", num_workers)?, count("num_hosts", num_hosts)?);
        let (min_workers, max_workers) = (count("min_workers", min_workers)?, count("max_workers", max_workers)?);
        // a restart limit of 0 is a limit: counts of the others start at 1
        let max_restarts = max_restarts
            .map(|v| u32::try_from(v).map_err(|_| value_error(format!("max_restarts must be 0 or more, got {v}"))))
            .transpose()?;
        let reset_limit = reset_limit
            .map(|v| u32::try_from(v).map_err(|_| value_error(format!("reset_limit must be 0 or more, got {v}"))))
            .transpose()?;
        // horovod.ray's elastic executor: min_workers makes it so (in
        // place); max_restarts asks for restart mode
        let mode = match (max_restarts, min_workers) {
            (Some(_), _) => Some(ElasticMode::Restart),
            (None, Some(_)) => Some(ElasticMode::InPlace),
            (None, None) => None,
        };
        if mode.is_none() && (max_workers.is_some() || host_discovery_script.is_some() || host_discovery.is_some()) {
            return Err(value_error(
                "max_workers, host_discovery_script and host_discovery are for elastic executors: give min_workers too",
            ));
        }
        if host_discovery_script.is_some() && host_discovery.is_some() {
            return Err(value_error("give host_discovery_script or host_discovery, not both"));
        }
        if mode.is_some() && num_hosts.is_some() {
            return Err(value_error("an elastic executor places workers by host slots: give hosts, not num_hosts"));
        }
        if mode == Some(ElasticMode::InPlace) {
            // its most workers are its size; it runs as many as it finds
            num_workers = max_workers.or(num_workers).or(min_workers);
        } else if mode == Some(ElasticMode::Restart) {
            num_workers = num_workers.or(max_workers).or(min_workers);
        }
        let per_host = count("num_workers_per_host", Some(num_workers_per_host))?;
        let cpus = count("cpus_per_worker", Some(cpus_per_worker))?.unwrap_or(1);
        // horovod.ray: gpus_per_worker=0 without use_gpu is no request
        let gpus_per_worker = gpus_per_worker.filter(|&g| use_gpu || g != 0);
        let gpus_per_worker = gpus_per_worker
            .map(|g| u32::try_from(g).map_err(|_| value_error(format!("gpus_per_worker must be 0 or more, got {g}"))))
            .transpose()?;
        let request =
            WorkerRequest::from_args(num_workers, num_hosts, num_hosts.and(per_host), cpus, use_gpu, gpus_per_worker)
                .map_err(exec_error)?;
        let workers = match request.placement {
            kolo_topology::Placement::Pack { num_workers } => Workers::Pack(Some(num_workers)),
            kolo_topology::Placement::Colocated { num_hosts, workers_per_host } => {
                Workers::Colocated { hosts: num_hosts, per_host: workers_per_host }
            }
        };
        let mut settings = Settings::default();
        settings.start_timeout = kolo_job::seconds("timeout_s", timeout_s).map_err(exec_error)?;
        settings.placement_timeout =
            kolo_job::seconds("placement_group_timeout_s", placement_group_timeout_s).map_err(exec_error)?;
        settings.nics = nics;
        let elastic = match mode {
            None => None,
            Some(mode) => {
                let mut options = ElasticOptions::new(mode);
                options.min_np = min_workers;
                // horovod.ray's elastic executor on a Ray cluster's nodes:
                // without max_workers, every slot the cluster has
                let on_ray_nodes = engine.as_deref() == Some("ray") && host_discovery_script.is_none();
                options.max_np = match (max_workers, mode) {
                    (None, ElasticMode::InPlace) if on_ray_nodes => Some(kolo_topology::MAX_PROCESSES),
                    _ => max_workers,
                };
                options.max_restarts = max_restarts;
                options.reset_limit = reset_limit;
                options.elastic_timeout = kolo_job::seconds("elastic_timeout", elastic_timeout).map_err(exec_error)?;
                if let Some((lo, hi)) = cooldown_range {
                    let lo = kolo_job::seconds("cooldown_range", lo).map_err(exec_error)?;
                    let hi = kolo_job::seconds("cooldown_range", hi).map_err(exec_error)?;
                    options.cooldown = Some((lo, hi));
                }
                options.discovery_script = host_discovery_script.map(Into::into);
                options.host_source = host_discovery.map(|d| Arc::new(PyDiscovery(d)) as Arc<dyn HostSource>);
                options.discovery_interval =
                    kolo_job::seconds("discovery_interval", discovery_interval).map_err(exec_error)?;
                Some(options)
            }
        };
        let spec = JobSpec {
            engine: engine.as_deref().unwrap_or("auto").parse().map_err(exec_error)?,
            hosts: hosts.as_deref().map(kolo_topology::parse_host_list).transpose().map_err(value_error)?,
            slots: Slots::Cpus,
            workers,
            resources: request.resources,
            settings,
            engine_options: EngineOptions {
                ssh: SshOptions { config_file: ssh_config_file.map(Into::into), ..SshOptions::default() },
                ..EngineOptions::default()
            },
            env: Vec::new(),
            elastic,
            hang_timeout_s: None,
            names: PYTHON_NAMES,
        };
        Ok(Job { job: spec.check().map_err(exec_error)? })
    }

    /// Whether the job is elastic (its functions run with `run` only).
    #[getter]
    fn elastic(&self) -> bool {
        self.job.is_elastic()
    }

    /// The engine asked for, by name.
    #[getter]
    fn engine(&self) -> String {
        self.job.spec().engine.to_string()
    }
}

/// Hosts from a Python object's `find_available_hosts_and_slots()`
/// (horovod.ray's and horovodrun's `HostDiscovery`): `{host: slots}`.
struct PyDiscovery(Py<PyAny>);

impl std::fmt::Debug for PyDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a Python discovery object")
    }
}

impl HostSource for PyDiscovery {
    fn hosts(&self) -> Result<Vec<kolo_topology::HostSpec>, kolo_engine::ExecError> {
        let found: PyResult<Vec<(String, i64)>> = Python::with_gil(|py| {
            let answer = self.0.call_method0(py, "find_available_hosts_and_slots")?;
            answer.bind(py).call_method0("items")?.try_iter()?.map(|item| item?.extract()).collect()
        });
        let found = found.map_err(|e| {
            kolo_engine::ExecError::Discovery(format!(
                "the discovery object's find_available_hosts_and_slots() raised {e}"
            ))
        })?;
        let mut hosts = Vec::new();
        for (name, slots) in found {
            let slots = u32::try_from(slots).map_err(|_| {
                kolo_engine::ExecError::Discovery(format!("the discovery object gave host {name} {slots} slots"))
            })?;
            // a host without slots is not available (horovod.ray's discovery lists them so)
            if slots > 0 {
                hosts.push(kolo_topology::HostSpec::new(name, slots));
            }
        }
        Ok(hosts)
    }
}

/// What ended a wait of the driver's early.
enum Interrupted {
    /// Python's signal handlers raised this (Ctrl-C: KeyboardInterrupt),
    /// or a callback of the user's did.
    Signal(PyErr),
    /// `shutdown()` was called on another thread.
    ShutDown,
}

impl Interrupted {
    fn into_err(self) -> PyErr {
        match self {
            Interrupted::Signal(e) => e,
            Interrupted::ShutDown => WorkerLost::new_err(
                "the executor was shut down (shutdown() on another thread) while this call ran: its workers were stopped",
            ),
        }
    }
}

/// How the driver's waits end early: Ctrl-C (looked for every
/// `SIGNAL_CHECK`: the GIL is released meanwhile, and only the main thread
/// runs Python's signal handlers), a KeyboardInterrupt a callback of the
/// user's raised, or `shutdown()` on another thread.
struct Interrupts {
    stop: watch::Sender<bool>,
    /// What a callback raised that ends the wait (a KeyboardInterrupt).
    raised: Arc<Mutex<Option<PyErr>>>,
    /// The last wait ended early: the job ends with it.
    fired: AtomicBool,
}

impl Interrupts {
    fn new() -> Self {
        Interrupts { stop: watch::channel(false).0, raised: Default::default(), fired: AtomicBool::new(false) }
    }

    async fn interrupted(&self) -> Interrupted {
        let mut stop = self.stop.subscribe();
        loop {
            tokio::select! {
                _ = stop.wait_for(|asked| *asked) => return Interrupted::ShutDown,
                _ = tokio::time::sleep(SIGNAL_CHECK) => {
                    let raised = lock(&self.raised).take();
                    if let Some(e) = raised.map_or_else(|| Python::with_gil(|py| py.check_signals()).err(), Some) {
                        return Interrupted::Signal(e);
                    }
                }
            }
        }
    }

    /// Runs `work` on `runtime` with the GIL released until it is done or
    /// interrupted: a call into the workers may take as long as the
    /// user's function does.
    fn run<T>(
        &self,
        runtime: &tokio::runtime::Runtime,
        work: impl std::future::Future<Output = PyResult<T>>,
    ) -> PyResult<T> {
        runtime.block_on(async {
            tokio::select! {
                done = work => done,
                why = self.interrupted() => {
                    self.fired.store(true, Ordering::SeqCst);
                    Err(why.into_err())
                }
            }
        })
    }

    fn run_exec<T>(
        &self,
        runtime: &tokio::runtime::Runtime,
        work: impl std::future::Future<Output = Result<T, kolo_engine::ExecError>>,
    ) -> PyResult<T> {
        self.run(runtime, async { work.await.map_err(exec_error) })
    }

    fn raised_by_callback(&self, e: PyErr) -> Option<PyErr> {
        raised_by_callback(&self.raised, e)
    }
}

/// What a callback of the user's raised: a KeyboardInterrupt ends the wait
/// it ran in (kept in `raised`), anything else is the caller's to raise
/// once the wait is done.
fn raised_by_callback(raised: &Mutex<Option<PyErr>>, e: PyErr) -> Option<PyErr> {
    if Python::with_gil(|py| e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py)) {
        *lock(raised) = Some(e);
        return None;
    }
    Some(e)
}

/// Runs a teardown to its end; once `armed` says so, a Ctrl-C meanwhile
/// hurries it (what still runs is killed at once, not after the kill
/// grace), as with `kolo run` and mpirun. That Ctrl-C's exception, if any.
async fn hurried_by_ctrl_c<T>(
    teardown: impl std::future::Future<Output = T>,
    armed: impl Fn() -> bool,
) -> (T, Option<PyErr>) {
    tokio::pin!(teardown);
    let mut caught = None;
    let done = loop {
        tokio::select! {
            done = &mut teardown => break done,
            _ = tokio::time::sleep(SIGNAL_CHECK), if caught.is_none() => {
                if armed() {
                    if let Err(e) = Python::with_gil(|py| py.check_signals()) {
                        caught = Some(e);
                        kolo_sys::hurry(nix::sys::signal::Signal::SIGINT as i32);
                    }
                }
            }
        }
    };
    if caught.is_some() {
        // this process goes on (its caller may catch KeyboardInterrupt):
        // later teardowns take their grace again
        kolo_sys::calm();
    }
    (done, caught)
}

/// Stops the workers (hurried by Ctrl-C) and ends the runtime; the Ctrl-C
/// that hurried it, if one did.
fn teardown(runtime: tokio::runtime::Runtime, mut executor: Executor) -> Option<PyErr> {
    let ((), caught) = runtime.block_on(hurried_by_ctrl_c(executor.shutdown(), || true));
    for line in executor.timeline_report() {
        eprintln!("kolo: {line}");
    }
    drop(executor);
    end_runtime(runtime);
    caught
}

/// A driver's runtime: one thread of its own, so that heartbeats and
/// output go on while Python is busy between calls, not only while it
/// waits in one.
fn driver_runtime() -> PyResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("kolo-driver")
        .enable_all()
        .build()
        .map_err(error)
}

/// Ends a driver's runtime without waiting on its blocking threads for
/// longer than `RUNTIME_END` (dropping it would wait for them without
/// limit): an engine call interrupted mid-way (Ray placing the workers,
/// Slurm's queue) may block for its whole timeout; what it holds is the
/// janitor's to clean up.
fn end_runtime(runtime: tokio::runtime::Runtime) {
    runtime.shutdown_timeout(RUNTIME_END);
}

/// How long a driver's ending runtime waits for its blocking threads.
const RUNTIME_END: Duration = Duration::from_millis(200);

/// How often a driver waiting on the workers looks for Ctrl-C.
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

/// How often `shutdown()` looks whether a call on another thread has
/// torn the job down (and for Ctrl-C meanwhile).
const TEARDOWN_LOOK: Duration = Duration::from_millis(10);

/// `work`, unless no rank moves for `timeout` first (a hang): then
/// `HangError` with the report (who holds the job back, every stack).
async fn unless_hung<T>(
    work: impl std::future::Future<Output = Result<T, kolo_engine::ExecError>>,
    watch: Option<(kolo_exec::control::Inspector, Duration)>,
) -> PyResult<T> {
    let Some((inspector, timeout)) = watch else { return work.await.map_err(exec_error) };
    tokio::select! {
        done = work => done.map_err(exec_error),
        report = inspector.hang_report(timeout) => Err(HangError::new_err(format!(
            "{report}kolo stopped the executor's workers (hang_timeout_s={}): start() a new executor",
            timeout.as_secs_f64()
        ))),
    }
}

/// kolo-exec's Executor on its own runtime, for `kolo.Executor`.
#[pyclass(module = "kolo._kolo")]
pub(crate) struct Driver {
    /// Held by a running call: `shutdown()` on another thread asks it to
    /// end through `interrupts` first.
    inner: Mutex<Option<(tokio::runtime::Runtime, Executor)>>,
    /// The job, for an elastic job's worlds and cohorts.
    job: kolo_job::Job,
    /// What `status()` asks, once the workers run: apart from `inner`,
    /// which a running call holds.
    view: Mutex<Option<(tokio::runtime::Handle, kolo_exec::control::Inspector)>>,
    /// Calls end with a hang report once no rank moved for this long.
    hang_timeout: Option<Duration>,
    interrupts: Interrupts,
}

impl Driver {
    /// What watches a call for a hang, if anything does.
    fn hang_watch(&self, ex: &Executor) -> Option<(kolo_exec::control::Inspector, Duration)> {
        Some((ex.inspector()?, self.hang_timeout?))
    }

    fn with<T: Send>(
        &self,
        py: Python<'_>,
        work: impl FnOnce(&tokio::runtime::Runtime, &mut Executor) -> PyResult<T> + Send,
    ) -> PyResult<T> {
        py.allow_threads(|| {
            let mut inner = lock(&self.inner);
            let (runtime, executor) = inner.as_mut().ok_or_else(|| error("the executor was shut down"))?;
            self.interrupts.fired.store(false, Ordering::SeqCst);
            let result = work(runtime, executor);
            // interrupted (Ctrl-C, shutdown() elsewhere) or hung: nothing
            // of the job outlives the call
            let hung = result.as_ref().is_err_and(|e| Python::with_gil(|py| e.is_instance_of::<HangError>(py)));
            if self.interrupts.fired.swap(false, Ordering::SeqCst) || hung {
                lock(&self.view).take();
                if let Some((runtime, executor)) = inner.take() {
                    // a second Ctrl-C hurries it; the first's exception is raised
                    drop(teardown(runtime, executor));
                }
            }
            result
        })
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // collected without shutdown(): kill outright, wait for nothing
        let inner = self.inner.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some((runtime, executor)) = inner {
            let entered = runtime.enter();
            drop(executor);
            drop(entered);
            end_runtime(runtime);
        }
    }
}

/// The Ray bridge on a thread of this Python (`kolo._ray_bridge.start`),
/// which the caller connected to Ray already.
struct PyBridge(Py<PyAny>);

impl RunsBridge for PyBridge {
    fn start(&self, source: &str, requests: BorrowedFd<'_>, answers: BorrowedFd<'_>) -> std::io::Result<()> {
        // Python opens copies of its own: who closes which is never in doubt
        let (requests, answers) = (requests.as_raw_fd(), answers.as_raw_fd());
        Python::with_gil(|py| self.0.call1(py, (source, requests, answers)).map(drop))
            .map_err(|e| std::io::Error::other(e.to_string()))
    }
}

#[pymethods]
impl Driver {
    /// The driver of `job`, its workers `worker_program worker_args...`;
    /// `ssh_identity_file` and the Ray cluster are known when it starts.
    #[new]
    #[pyo3(signature = (job, worker_program, worker_args, ssh_identity_file=None, ray_address=None, ray_placement_group=None, ray_bridge=None, hang_timeout_s=None, job_timeline=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        job: &Job,
        worker_program: String,
        worker_args: Vec<String>,
        ssh_identity_file: Option<String>,
        ray_address: Option<String>,
        ray_placement_group: Option<String>,
        ray_bridge: Option<Py<PyAny>>,
        hang_timeout_s: Option<f64>,
        job_timeline: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        if let Some(file) = &job_timeline {
            kolo_timeline::check_trace_file(file)
                .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("job_timeline {e}")))?;
            if job.job.is_elastic() {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "job_timeline records a fixed executor, not an elastic one",
                ));
            }
        }
        let start = StartOptions {
            worker_program: Some(worker_program.clone().into()),
            worker_args,
            ssh_identity_file: ssh_identity_file.map(Into::into),
            // the workers' Python runs the Ray bridge too: it has Ray if the caller does
            ray: RayOptions {
                address: ray_address,
                python: worker_program.into(),
                placement_group: ray_placement_group,
                bridge_host: ray_bridge.map(|start| BridgeHost(Arc::new(PyBridge(start)))),
            },
            hang_timeout_s,
        };
        let job = job.job.started_with(start).map_err(exec_error)?;
        let hang_timeout = job.hang_timeout();
        // the workers are `python -m kolo._worker` with this registry
        kolo_proto::set_build_id(registry().build_id());
        let interrupts = Interrupts::new();
        // an elastic job's executors are made per world or cohort
        let inner = match job.is_elastic() {
            true => None,
            false => {
                // which may wait for an allocation (Slurm)
                let runtime = driver_runtime()?;
                match py.allow_threads(|| interrupts.run_exec(&runtime, job.executor())) {
                    Ok(mut executor) => {
                        if let Some(file) = job_timeline {
                            executor.record_timeline(file);
                        }
                        Some((runtime, executor))
                    }
                    Err(e) => {
                        end_runtime(runtime);
                        return Err(e);
                    }
                }
            }
        };
        Ok(Driver { inner: Mutex::new(inner), job, view: Mutex::new(None), hang_timeout, interrupts })
    }

    /// Starts the workers and creates each one's state from `args`.
    fn start(&self, py: Python<'_>, args: PyBackedBytes, env: Vec<(String, String)>) -> PyResult<()> {
        let args = args.to_vec();
        self.with(py, |rt, ex| {
            self.interrupts.run_exec(rt, ex.start::<PyWorker>(&args, &env))?;
            *lock(&self.view) = ex.inspector().map(|inspector| (rt.handle().clone(), inspector));
            Ok(())
        })
    }

    /// Runs the pickled call on every worker; the answers in rank order.
    /// `on_report(rank, bytes)` gets what workers report meanwhile; if it
    /// raises, it is not called again and its exception is raised once
    /// the call is done.
    /// With `fail_fast`, the first rank whose function raises ends the
    /// call with a RuntimeError naming it (the caller shuts the executor
    /// down: the other ranks' calls are still running), as a failed
    /// process ends a horovodrun job.
    #[pyo3(signature = (payload, on_report=None, fail_fast=false))]
    fn execute(
        &self,
        py: Python<'_>,
        payload: PyBackedBytes,
        on_report: Option<Py<PyAny>>,
        fail_fast: bool,
    ) -> PyResult<Vec<Py<PyBytes>>> {
        let call = PyCall { payload: payload.to_vec(), elastic: fail_fast };
        let answers = self.with(py, |rt, ex| match &on_report {
            None if fail_fast => {
                let watch = self.hang_watch(ex);
                self.interrupts.run(rt, unless_hung(ex.execute_until_failure::<PyWorker, PyCall>(&call), watch))
            }
            Some(_) if fail_fast => Err(pyo3::exceptions::PyValueError::new_err("fail_fast takes no on_report")),
            None => {
                let watch = self.hang_watch(ex);
                self.interrupts.run(rt, unless_hung(ex.execute::<PyWorker, PyCall>(&call), watch))
            }
            Some(callback) => {
                let mut failed: Option<PyErr> = None;
                let watch = self.hang_watch(ex);
                let answers = self.interrupts.run(
                    rt,
                    unless_hung(
                        ex.execute_reporting::<PyWorker, PyCall>(&call, |report| {
                            if failed.is_none() {
                                Python::with_gil(|py| {
                                    let data = PyBytes::new(py, &report.data);
                                    let raised = callback.call1(py, (report.rank, data)).err();
                                    failed = raised.and_then(|e| self.interrupts.raised_by_callback(e));
                                });
                            }
                        }),
                        watch,
                    ),
                )?;
                failed.map_or(Ok(answers), Err)
            }
        })?;
        Ok(answers.iter().map(|a| PyBytes::new(py, a).unbind()).collect())
    }

    /// Runs the pickled call on rank 0 only.
    fn execute_single(&self, py: Python<'_>, payload: PyBackedBytes) -> PyResult<Py<PyBytes>> {
        let call = PyCall { payload: payload.to_vec(), elastic: false };
        let answer = self.with(py, |rt, ex| {
            let watch = self.hang_watch(ex);
            self.interrupts.run(rt, unless_hung(ex.execute_single::<PyWorker, PyCall>(&call), watch))
        })?;
        Ok(PyBytes::new(py, &answer).unbind())
    }

    /// Runs the pickled call elastically: in place (Horovod's elastic
    /// executor: workers are started per cohort on the hosts, or those a
    /// discovery script prints, and the answers are those of the last
    /// round's members) or in restart mode (every worker starts again
    /// after a failure; the answers are those of the world that
    /// succeeded), each worker's state made from `args` and `env`.
    /// `on_event(dict)` hears each membership change and
    /// `on_report(rank, bytes)` each value reported (`rank` in the current
    /// round, or None); if one raises, neither is called again and its
    /// exception is raised at the end.
    #[pyo3(signature = (args, env, payload, on_event=None, on_report=None))]
    fn run_elastic(
        &self,
        py: Python<'_>,
        args: PyBackedBytes,
        env: Vec<(String, String)>,
        payload: PyBackedBytes,
        on_event: Option<Py<PyAny>>,
        on_report: Option<Py<PyAny>>,
    ) -> PyResult<Vec<Py<PyBytes>>> {
        let job = &self.job;
        let mode = job.elastic_mode().ok_or_else(|| error("the executor is not elastic"))?;
        let failed: Arc<Mutex<Option<PyErr>>> = Default::default();
        let last_failure: Arc<Mutex<Option<String>>> = Default::default();
        let (heard, failure) = (failed.clone(), last_failure.clone());
        let raised = self.interrupts.raised.clone();
        let listener = move |event: ElasticEvent| {
            if let ElasticEvent::Failed { .. } | ElasticEvent::Restarting { .. } = &event {
                *lock(&failure) = Some(event.to_string());
            }
            let mut failed = lock(&heard);
            if failed.is_some() {
                return;
            }
            Python::with_gil(|py| {
                let raised_here = match (&event, &on_report, &on_event) {
                    (ElasticEvent::Reported { rank, data }, Some(callback), _) => {
                        callback.call1(py, (*rank, PyBytes::new(py, data))).err()
                    }
                    (ElasticEvent::Reported { .. }, None, _) | (_, _, None) => None,
                    (_, _, Some(callback)) => {
                        crate::elastic::event_dict(py, &event).and_then(|d| callback.call1(py, (d,))).err()
                    }
                };
                *failed = raised_here.and_then(|e| raised_by_callback(&raised, e));
            });
        };
        let work = TaskWork::<PyWorker, PyCall> {
            args: args.to_vec(),
            task: PyCall { payload: payload.to_vec(), elastic: true },
        };
        let (config, discovery) = (job.elastic_config().map_err(exec_error)?, job.discovery().map_err(exec_error)?);
        let (factory, env) = (job.cohort_factory(), [job.env(), &env[..]].concat());
        // the job's own runtime: there is no executor to hold one
        let runtime = driver_runtime()?;
        // Ctrl-C or shutdown() ends the job as a signal ends `kolo run`'s:
        // the cohorts are stopped, a second Ctrl-C hurries that
        let caught: Mutex<Option<Interrupted>> = Mutex::new(None);
        let interrupt = async {
            let why = self.interrupts.interrupted().await;
            *lock(&caught) = Some(why);
            nix::sys::signal::Signal::SIGINT
        };
        let interrupted = || lock(&caught).is_some();
        let ended = py.allow_threads(|| {
            runtime.block_on(async {
                match mode {
                    ElasticMode::InPlace => {
                        let run = ElasticJob::run(work, config, discovery, factory, env, listener, interrupt);
                        let (outcome, _) = hurried_by_ctrl_c(run, interrupted).await;
                        outcome.map(|o| (o.results, o.stopped.map(|c: StopCause| (c.kind(), c.explain(&PYTHON_NAMES)))))
                    }
                    ElasticMode::Restart => {
                        let run = RestartJob::run(&work, config, discovery, factory, env, listener, interrupt);
                        let (outcome, _) = hurried_by_ctrl_c(run, interrupted).await;
                        outcome.map(|o| {
                            let stopped =
                                o.stopped.as_ref().map(|reason| (reason.kind(), PYTHON_NAMES.explain(reason)));
                            (o.last.map(|l| l.results).unwrap_or_default(), stopped)
                        })
                    }
                }
            })
        });
        end_runtime(runtime);
        if let Some(why) = lock(&caught).take() {
            return Err(why.into_err());
        }
        let (results, stopped): (Vec<Vec<u8>>, Option<(&str, String)>) = ended.map_err(exec_error)?;
        if let Some(e) = lock(&failed).take() {
            return Err(e);
        }
        if let Some((kind, reason)) = stopped {
            let last = match lock(&last_failure).take() {
                Some(failure) => format!("; the last failure: {failure}"),
                None => String::new(),
            };
            // `kind` says which limit, for callers that match on it
            let e = JobStopped::new_err(format!("the elastic job stopped: {reason}{last}"));
            e.value(py).setattr("kind", kind)?;
            return Err(e);
        }
        Ok(results.iter().map(|a| PyBytes::new(py, a).unbind()).collect())
    }

    /// `(rank, host)` of every worker, in rank order.
    fn workers(&self, py: Python<'_>) -> PyResult<Vec<(u32, String)>> {
        self.with(py, |_, ex| Ok(ex.workers().into_iter().map(|w| (w.rank, w.hostname)).collect()))
    }

    /// `kolo status --json`'s object for this job, as JSON text.
    fn status(&self, py: Python<'_>) -> PyResult<String> {
        py.allow_threads(|| {
            // held while asking: shutdown waits for it rather than ending
            // the runtime under it
            let view = lock(&self.view);
            let (handle, inspector) = view
                .as_ref()
                .ok_or_else(|| error("the executor's workers are not running (not started, shut down, or without a control endpoint: see the warning at start)"))?;
            Ok(handle.block_on(inspector.status()).to_string())
        })
    }

    /// Stops the workers, ending a call that runs on another thread; the
    /// driver cannot be used afterwards. Ctrl-C meanwhile hurries it (and
    /// is raised).
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        self.interrupts.stop.send_replace(true);
        py.allow_threads(|| {
            lock(&self.view).take();
            // a call on another thread holds the executor until it has torn
            // the job down; Ctrl-C meanwhile hurries that teardown
            let mut caught = None;
            let taken = loop {
                match self.inner.try_lock() {
                    Ok(mut inner) => break inner.take(),
                    Err(std::sync::TryLockError::Poisoned(poisoned)) => break poisoned.into_inner().take(),
                    Err(std::sync::TryLockError::WouldBlock) => {}
                }
                std::thread::sleep(TEARDOWN_LOOK);
                if caught.is_none() {
                    if let Err(e) = Python::with_gil(|py| py.check_signals()) {
                        caught = Some(e);
                        kolo_sys::hurry(nix::sys::signal::Signal::SIGINT as i32);
                    }
                }
            };
            let from_teardown = taken.and_then(|(runtime, executor)| teardown(runtime, executor));
            if caught.is_some() {
                kolo_sys::calm();
            }
            caught.or(from_teardown).map_or(Ok(()), Err)
        })
    }
}
