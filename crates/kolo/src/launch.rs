//! `kolo run`'s policy: which engine places the ranks, how many, and the
//! Executor running the command in every worker. The plan the Executor
//! makes is the one `--dry-run` prints.

use std::ffi::OsString;
use std::future::Future;
use std::time::Duration;

use kolo_exec::{
    EngineChoice, EngineOptions, Executor, JobOutcome, OutputOptions, RayOptions, Settings, SlurmOptions, SshOptions,
    WorkerRequest,
};
use kolo_topology::{total_slots, HostSpec, TopologyError};
use nix::sys::signal::Signal;

/// Everything `kolo run` was asked for.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    pub command: Vec<OsString>,
    pub hosts: Vec<HostSpec>,
    pub np: u64,
    /// Bounds start-up; also Gloo's rendezvous timeout in the workers.
    pub start_timeout: Duration,
    /// How long an engine may wait for resources (a Slurm queue).
    pub placement_timeout: Duration,
    /// Between SIGTERM and SIGKILL at teardown.
    pub grace: Duration,
    /// Variables set on top of kolo's own (`-x`, `--env`).
    pub extra_env: Vec<(String, String)>,
    pub output: OutputOptions,
    /// Rendezvous refuses requests without the job secret (kolo-only workers).
    pub require_secret: bool,
    /// GPUs each rank holds, out of those its host declares (`gpus=N`).
    pub gpus_per_worker: u32,
    pub engine: EngineChoice,
    pub ssh: SshOptions,
    pub slurm: SlurmOptions,
    pub ray: RayOptions,
    /// With Ray: this many workers on each of np/W distinct nodes.
    pub workers_per_host: Option<u32>,
    /// Interfaces to use instead of detecting them.
    pub nics: Option<Vec<String>>,
    /// The program started as the worker agent (default: this binary).
    pub worker_program: Option<std::path::PathBuf>,
    /// Its arguments (`python -m kolo._worker`).
    pub worker_args: Vec<String>,
    /// `hosts` are those an elastic job's membership chose for a world or
    /// cohort (`EngineChoice::elastic_engine`: on Ray, node ids).
    pub elastic_world: bool,
}

impl LaunchSpec {
    /// How each engine reaches its machines, as this launch says.
    pub fn engine_options(&self) -> EngineOptions {
        EngineOptions { ssh: self.ssh.clone(), slurm: self.slurm.clone(), ray: self.ray.clone() }
    }
}

/// The Executor for a launch: its engine chosen (host names are looked up
/// off the async runtime), its request checked with Horovod's messages.
pub async fn executor(spec: &LaunchSpec) -> anyhow::Result<Executor> {
    executor_with_secret(spec, None).await
}

/// An executor whose workers share `secret` (with other executors' workers).
pub async fn executor_with_secret(spec: &LaunchSpec, secret: Option<&str>) -> anyhow::Result<Executor> {
    let np = u32::try_from(spec.np)
        .ok()
        .filter(|&n| n <= kolo_topology::MAX_PROCESSES)
        .ok_or(TopologyError::TooManyProcesses(spec.np))?;
    let (choice, hosts) = {
        let (choice, hosts) = (spec.engine, spec.hosts.clone());
        tokio::task::spawn_blocking(move || (choice.resolve(&hosts), hosts)).await?
    };
    // Slurm's allocation and Ray's cluster are the host list there;
    // elsewhere, Horovod's check
    let available = total_slots(&hosts);
    if !matches!(choice, EngineChoice::Slurm | EngineChoice::Ray) && spec.np > available {
        return Err(TopologyError::NotEnoughSlots { requested: spec.np, available }.into());
    }
    // one slot = one CPU: packing fills the hosts in order, as horovodrun does
    let request = match spec.workers_per_host {
        Some(w) => WorkerRequest::colocated(np / w, w),
        None => WorkerRequest::pack(np),
    }
    .gpus_per_worker(spec.gpus_per_worker);
    let options = spec.engine_options();
    let engine = match spec.elastic_world {
        true => choice.elastic_engine(hosts, &request, options)?,
        false => choice.engine(hosts, &request, options)?,
    };
    let mut settings = Settings::default();
    settings.start_timeout = spec.start_timeout;
    settings.placement_timeout = spec.placement_timeout;
    settings.kill_grace = spec.grace;
    settings.output = spec.output.clone();
    settings.rendezvous_require_secret = spec.require_secret;
    settings.nics = spec.nics.clone();
    settings.worker_program = spec.worker_program.clone();
    settings.worker_args = spec.worker_args.clone();
    if let Some(secret) = secret {
        settings = settings.with_secret(secret);
    }
    Ok(Executor::with_engine(settings, request, engine)?)
}

/// Runs the job to its end. `interrupt` resolves when kolo is asked to stop
/// (SIGINT/SIGTERM); the job is then torn down like on a failure.
pub async fn run_job(spec: LaunchSpec, interrupt: impl Future<Output = Signal>) -> anyhow::Result<JobOutcome> {
    tokio::pin!(interrupt);
    let mut executor = tokio::select! {
        made = executor(&spec) => made?,
        signal = &mut interrupt => return Ok(interrupted(signal)),
    };
    let started = tokio::select! {
        started = executor.start_command(&spec.command, &spec.extra_env) => started,
        signal = &mut interrupt => {
            executor.shutdown().await;
            return Ok(interrupted(signal));
        }
    };
    if let Err(e) = started {
        executor.shutdown().await;
        return Err(e.into());
    }
    let outcome = executor.wait_command(interrupt).await;
    executor.shutdown().await;
    Ok(outcome?)
}

fn interrupted(signal: Signal) -> JobOutcome {
    JobOutcome { exit_code: 128 + signal as i32, failure: None, interrupted_by: Some(signal) }
}
