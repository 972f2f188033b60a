//! A job's plan, made once before anything starts: where each worker goes,
//! which GPUs it holds, its ranks (Horovod's Coordinator over the workers
//! in creation order) and the environment it will receive. `--dry-run`
//! prints it, and the driver starts exactly it.

use std::collections::BTreeMap;

use crate::{
    cuda_visible_devices, place, rank_env, Coordinator, HostResources, JobEnv, Placement, RankInfo, Slot,
    TopologyError, WorkerResources, MAX_PROCESSES,
};

/// One worker of a plan; its index is its world rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedWorker {
    /// The host the worker runs on.
    pub host: HostResources,
    /// The GPU ids this worker holds on its host.
    pub gpus: Vec<u32>,
    /// Its world, local and cross ranks.
    pub ranks: RankInfo,
    /// The node's shared `CUDA_VISIBLE_DEVICES`, when it has GPUs.
    pub visible_devices: Option<String>,
}

/// Every worker of a job, in rank order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The workers, indexed by world rank.
    pub workers: Vec<PlannedWorker>,
}

impl Plan {
    /// Places the workers on `hosts` and gives them their ranks.
    pub fn new(placement: Placement, need: WorkerResources, hosts: &[HostResources]) -> Result<Plan, TopologyError> {
        let asked = match placement {
            Placement::Pack { num_workers } => u64::from(num_workers),
            Placement::Colocated { num_hosts, workers_per_host } => u64::from(num_hosts) * u64::from(workers_per_host),
        };
        if asked > u64::from(MAX_PROCESSES) {
            return Err(TopologyError::TooManyProcesses(asked));
        }
        let placed = place(placement, need, hosts)?;
        let mut coordinator = Coordinator::new();
        for (index, p) in placed.iter().enumerate() {
            let host = &hosts[p.host];
            coordinator.register(&host.hostname, &host.node_id, index as u32);
        }
        let infos = coordinator.finalize()?;
        let nodes: Vec<&str> = placed.iter().map(|p| hosts[p.host].node_id.as_str()).collect();
        let gpus: Vec<Vec<u32>> = placed.iter().map(|p| p.gpu_ids.clone()).collect();
        let visible = cuda_visible_devices(&nodes, &gpus);
        let workers = placed
            .into_iter()
            .zip(infos)
            .zip(visible)
            .map(|((p, ranks), visible_devices)| PlannedWorker {
                host: hosts[p.host].clone(),
                gpus: p.gpu_ids,
                ranks,
                visible_devices,
            })
            .collect();
        Ok(Plan { workers })
    }

    /// Number of workers (the world size).
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether the plan has no workers.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// The slots the rendezvous server sizes its scopes from (hosts named
    /// by node id, as `HOROVOD_HOSTNAME` names them).
    pub fn slots(&self) -> Vec<Slot> {
        self.workers.iter().map(|w| Slot { host: w.host.node_id.clone(), info: w.ranks.clone() }).collect()
    }

    /// Every variable kolo sets for `rank`, with the job-wide values of
    /// `job` and the caller's `extra` variables on top; `caller` looks up
    /// the caller's environment, whose values win over kolo's defaults.
    pub fn env(
        &self,
        rank: usize,
        job: &JobEnv,
        extra: &[(String, String)],
        caller: impl Fn(&str) -> Option<String>,
    ) -> BTreeMap<String, String> {
        let w = &self.workers[rank];
        let mut env = rank_env(&w.ranks, &w.host.node_id, job, w.visible_devices.as_deref());
        if let Some(visible) = &w.visible_devices {
            // JAX numbers the devices CUDA_VISIBLE_DEVICES shows: this
            // worker's GPUs are their positions in that list
            let shown: Vec<&str> = visible.split(',').collect();
            let own: Vec<String> = w
                .gpus
                .iter()
                .filter_map(|g| shown.iter().position(|s| *s == g.to_string()))
                .map(|p| p.to_string())
                .collect();
            if !own.is_empty() {
                env.insert("JAX_LOCAL_DEVICE_IDS".into(), own.join(","));
            }
        }
        crate::caller_defaults(&mut env, caller);
        env.extend(extra.iter().cloned());
        env
    }

    /// One worker per distinct node, the first of each in rank order.
    pub fn node_representatives(&self) -> Vec<usize> {
        let mut reps: Vec<usize> = Vec::new();
        for (i, w) in self.workers.iter().enumerate() {
            if !reps.iter().any(|&r| self.workers[r].host.node_id == w.host.node_id) {
                reps.push(i);
            }
        }
        reps
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{host_assignments, parse_host_list, HostSpec};

    fn hosts(list: &str) -> Vec<HostResources> {
        parse_host_list(list).unwrap().iter().map(HostSpec::resources).collect()
    }

    #[test]
    fn a_packed_plan_is_horovods_host_assignment() {
        for (list, np) in [("a:2,b:2", 4), ("a:2,b:2", 3), ("a:1,b:2", 3), ("a:3,b:1,c:2", 5)] {
            let plan =
                Plan::new(Placement::Pack { num_workers: np }, WorkerResources::default(), &hosts(list)).unwrap();
            let horovod =
                host_assignments(&parse_host_list(list).unwrap(), u64::from(np), Some(u64::from(np))).unwrap();
            assert_eq!(plan.slots(), horovod, "{list} -np {np}");
        }
    }

    #[test]
    fn env_carries_ranks_gpus_and_extra_variables() {
        let mut hs = hosts("a:2,b:1");
        hs[0].gpus = vec![0, 1, 2, 3];
        hs[1].gpus = vec![0, 1];
        let need = WorkerResources { cpus: 1, gpus: 2 };
        let plan = Plan::new(Placement::Pack { num_workers: 3 }, need, &hs).unwrap();
        let env = plan.env(1, &JobEnv::placeholder(), &[("EXTRA".into(), "x".into())], |_| None);
        assert_eq!(env["HOROVOD_RANK"], "1");
        assert_eq!(env["HOROVOD_HOSTNAME"], "a");
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "0,1,2,3");
        assert_eq!(env["EXTRA"], "x");
        assert_eq!(env["OMP_NUM_THREADS"], "1");
        assert_eq!(plan.env(2, &JobEnv::placeholder(), &[], |_| None)["CUDA_VISIBLE_DEVICES"], "0,1");
        assert!(!plan.env(2, &JobEnv::placeholder(), &[], |_| None).contains_key("OMP_NUM_THREADS"));
        assert_eq!(plan.workers[1].gpus, [2, 3]);
        assert_eq!(
            plan.env(1, &JobEnv::placeholder(), &[], |_| None).get("JAX_LOCAL_DEVICE_IDS").map(String::as_str),
            Some("2,3")
        );
        assert_eq!(plan.node_representatives(), [0, 2]);
    }

    #[test]
    fn absurd_sizes_are_refused_before_placement() {
        let err = Plan::new(Placement::Pack { num_workers: 10_000_000 }, WorkerResources::default(), &hosts("a:1"))
            .unwrap_err();
        assert_eq!(err, TopologyError::TooManyProcesses(10_000_000));
        let colocated = Placement::Colocated { num_hosts: u32::MAX, workers_per_host: u32::MAX };
        assert!(matches!(
            Plan::new(colocated, WorkerResources::default(), &hosts("a:1")),
            Err(TopologyError::TooManyProcesses(_))
        ));
    }
}
