//! `kolo run`: the Executor running an OS command in every worker, placed
//! on the local engine by Horovod's host assignment.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::future::Future;
use std::time::Duration;

use kolo_topology::{
    cuda_visible_devices, host_assignments, place, rank_env, HostResources, HostSpec, JobEnv, Placement, Slot,
    WorkerResources,
};
use nix::sys::signal::Signal;

use crate::driver::{Executor, JobOutcome, Settings, WorkerRequest};
use crate::engine::LocalEngine;
use crate::output::OutputOptions;
use crate::slurm::{SlurmEngine, SlurmOptions};
use crate::ssh::{SshEngine, SshOptions};
use crate::ExecError;

/// Everything `kolo run` was asked for.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    pub command: Vec<OsString>,
    pub hosts: Vec<HostSpec>,
    pub np: u64,
    /// Bounds start-up; also Gloo's rendezvous timeout in the workers.
    pub start_timeout: Duration,
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
    /// Interfaces to use instead of detecting them.
    pub nics: Option<Vec<String>>,
    /// The program started as the worker agent (default: this binary).
    pub worker_program: Option<std::path::PathBuf>,
}

/// Which engine places the workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineChoice {
    /// Slurm inside an allocation, ssh when the host list names other
    /// machines, local processes otherwise.
    Auto,
    Local,
    Ssh,
    Slurm,
}

impl EngineChoice {
    /// The engine `Auto` stands for with these hosts.
    pub fn resolve(self, hosts: &[HostSpec]) -> EngineChoice {
        match self {
            EngineChoice::Auto if SlurmEngine::in_allocation() => EngineChoice::Slurm,
            EngineChoice::Auto if hosts.iter().all(|h| is_this_machine(&h.name)) => EngineChoice::Local,
            EngineChoice::Auto => EngineChoice::Ssh,
            other => other,
        }
    }
}

/// Whether `host` names this machine: `localhost`, its host name, or one
/// of its addresses.
pub fn is_this_machine(host: &str) -> bool {
    use std::net::ToSocketAddrs;
    if host == "localhost" {
        return true;
    }
    let own = nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok());
    if own.as_deref() == Some(host) {
        return true;
    }
    let Ok(addrs) = (host, 0).to_socket_addrs() else { return false };
    let local: Vec<std::net::IpAddr> = nix::ifaddrs::getifaddrs()
        .map(|all| {
            all.filter_map(|a| {
                let a = a.address?;
                a.as_sockaddr_in()
                    .map(|v4| std::net::IpAddr::V4(v4.ip()))
                    .or_else(|| a.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip())))
            })
            .collect()
        })
        .unwrap_or_default();
    addrs.into_iter().any(|a| a.ip().is_loopback() || local.contains(&a.ip()))
}

/// One rank of a planned job.
#[derive(Clone, Debug)]
pub struct RankPlan {
    pub slot: Slot,
    pub node_id: String,
    /// Every variable kolo sets for the rank.
    pub env: BTreeMap<String, String>,
}

/// Plans the ranks: Horovod's host assignment for exactly `np` processes,
/// and each rank's environment for the given job-wide settings.
pub fn plan_job(spec: &LaunchSpec, job: &JobEnv) -> Result<Vec<RankPlan>, ExecError> {
    let slots = host_assignments(&spec.hosts, spec.np, Some(spec.np))?;
    let visible = gpu_plan(spec)?;
    Ok(slots
        .into_iter()
        .zip(visible)
        .map(|(slot, visible)| {
            // the local engine: a host's name is its node id
            let node_id = slot.host.clone();
            let mut env = rank_env(&slot.info, &node_id, job, visible.as_deref());
            env.extend(spec.extra_env.iter().cloned());
            RankPlan { slot, node_id, env }
        })
        .collect())
}

/// Each rank's `CUDA_VISIBLE_DEVICES`, as the executor hands GPUs out.
fn gpu_plan(spec: &LaunchSpec) -> Result<Vec<Option<String>>, ExecError> {
    let np = spec.np as usize;
    if spec.gpus_per_worker == 0 {
        return Ok(vec![None; np]);
    }
    let hosts: Vec<HostResources> = spec.hosts.iter().map(HostSpec::resources).collect();
    let need = WorkerResources { cpus: 1, gpus: spec.gpus_per_worker };
    let placed = place(Placement::Pack { num_workers: spec.np as u32 }, need, &hosts)?;
    let nodes: Vec<&str> = placed.iter().map(|p| hosts[p.host].node_id.as_str()).collect();
    let gpus: Vec<Vec<u32>> = placed.into_iter().map(|p| p.gpu_ids).collect();
    Ok(cuda_visible_devices(&nodes, &gpus))
}

/// Runs the job to its end. `interrupt` resolves when kolo is asked to stop
/// (SIGINT/SIGTERM); the job is then torn down like on a failure.
pub async fn run_job(spec: LaunchSpec, interrupt: impl Future<Output = Signal>) -> Result<JobOutcome, ExecError> {
    if spec.command.is_empty() {
        return Err(ExecError::NoCommand);
    }
    let np = u32::try_from(spec.np).map_err(|_| ExecError::BadSettings(format!("-np {} is too large", spec.np)))?;
    let mut spec = spec;
    let engine: Box<dyn crate::Engine> = match spec.engine.resolve(&spec.hosts) {
        EngineChoice::Slurm => {
            let mut slurm = if SlurmEngine::in_allocation() {
                SlurmEngine::from_allocation()?
            } else {
                SlurmEngine::allocate(np, &spec.slurm)?
            };
            // the allocation's nodes are the host list
            spec.hosts = crate::Engine::hosts(&mut slurm)?
                .into_iter()
                .map(|h| HostSpec { name: h.hostname, slots: h.cpus, gpus: None })
                .collect();
            Box::new(slurm)
        }
        EngineChoice::Ssh => Box::new(SshEngine::new(spec.hosts.clone(), spec.ssh.clone())),
        _ => Box::new(LocalEngine::with_hosts(spec.hosts.clone())),
    };
    // Horovod's checks and messages ("Requested more processes ..."), and the GPUs
    plan_job(&spec, &JobEnv::placeholder())?;
    let mut settings = Settings::default();
    settings.start_timeout = spec.start_timeout;
    settings.kill_grace = spec.grace;
    settings.output = spec.output.clone();
    settings.rendezvous_require_secret = spec.require_secret;
    settings.nics = spec.nics.clone();
    settings.worker_program = spec.worker_program.clone();
    // one slot = one CPU: packing fills the hosts in order, as horovodrun does
    let request = WorkerRequest::pack(np).gpus_per_worker(spec.gpus_per_worker);
    let mut executor = Executor::with_engine(settings, request, engine)?;
    tokio::pin!(interrupt);
    let started = tokio::select! {
        started = executor.start_command(&spec.command, &spec.extra_env) => started,
        signal = &mut interrupt => {
            executor.shutdown().await;
            return Ok(JobOutcome { exit_code: 128 + signal as i32, failure: None, interrupted_by: Some(signal) });
        }
    };
    if let Err(e) = started {
        executor.shutdown().await;
        return Err(e);
    }
    let outcome = executor.wait_command(interrupt).await;
    executor.shutdown().await;
    outcome
}
