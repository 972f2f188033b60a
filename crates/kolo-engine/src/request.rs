//! What a job asks for: how many workers and what each needs.

use kolo_topology::{resolve_gpus_per_worker, Placement, TopologyError, WorkerResources};

use crate::ExecError;

/// How many workers and what each needs (RayExecutor's arguments).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerRequest {
    /// How many workers, and how they spread over hosts.
    pub placement: Placement,
    /// What each worker takes of its host (CPUs, GPUs).
    pub resources: WorkerResources,
}

impl WorkerRequest {
    /// `num_workers` packed onto as few hosts as fit.
    pub fn pack(num_workers: u32) -> Self {
        WorkerRequest { placement: Placement::Pack { num_workers }, resources: WorkerResources::default() }
    }

    /// `num_hosts` distinct hosts with `workers_per_host` workers each.
    pub fn colocated(num_hosts: u32, workers_per_host: u32) -> Self {
        WorkerRequest {
            placement: Placement::Colocated { num_hosts, workers_per_host },
            resources: WorkerResources::default(),
        }
    }

    /// Upstream's argument set, validated the same way.
    pub fn from_args(
        num_workers: Option<u32>,
        num_hosts: Option<u32>,
        num_workers_per_host: Option<u32>,
        cpus_per_worker: u32,
        use_gpu: bool,
        gpus_per_worker: Option<u32>,
    ) -> Result<Self, ExecError> {
        let placement = Placement::from_counts(num_workers, num_hosts, num_workers_per_host)?;
        let gpus = resolve_gpus_per_worker(use_gpu, gpus_per_worker)?;
        if cpus_per_worker == 0 {
            return Err(TopologyError::BadRequest("cpus_per_worker must be at least 1".into()).into());
        }
        Ok(WorkerRequest { placement, resources: WorkerResources { cpus: cpus_per_worker, gpus } })
    }

    /// The same request with `cpus` CPUs per worker.
    pub fn cpus_per_worker(mut self, cpus: u32) -> Self {
        self.resources.cpus = cpus;
        self
    }

    /// The same request with `gpus` GPUs per worker.
    pub fn gpus_per_worker(mut self, gpus: u32) -> Self {
        self.resources.gpus = gpus;
        self
    }

    /// How many workers in all.
    pub fn num_workers(&self) -> u32 {
        self.placement.num_workers()
    }
}
