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
    let hosts: Vec<HostResources> = spec
        .hosts
        .iter()
        .map(|h| HostResources {
            hostname: h.name.clone(),
            node_id: h.name.clone(),
            cpus: h.slots,
            gpus: (0..h.gpus.unwrap_or(0)).collect(),
        })
        .collect();
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
    // Horovod's checks and messages ("Requested more processes ..."), and the GPUs
    plan_job(&spec, &JobEnv::placeholder())?;
    let np = u32::try_from(spec.np).map_err(|_| ExecError::BadSettings(format!("-np {} is too large", spec.np)))?;
    let mut settings = Settings::default();
    settings.start_timeout = spec.start_timeout;
    settings.kill_grace = spec.grace;
    settings.output = spec.output.clone();
    settings.rendezvous_require_secret = spec.require_secret;
    // one slot = one CPU: packing fills the hosts in order, as horovodrun does
    let engine = Box::new(LocalEngine::with_hosts(spec.hosts.clone()));
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
