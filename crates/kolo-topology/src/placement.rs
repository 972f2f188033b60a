//! Placement strategies (Horovod's `ColocatedStrategy` and `PGStrategy`):
//! which host each worker goes to and which GPU ids it holds, given what
//! every host offers. GPU sharing within a node is here too.

use crate::TopologyError;

/// What one host offers to the job, as its engine reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostResources {
    /// The name workers on the host are reached by.
    pub hostname: String,
    /// The engine's id of the node; workers with the same id share a node
    /// (its local ranks, its `local_` scope and its GPUs).
    pub node_id: String,
    /// Worker slots (CPUs) the host offers.
    pub cpus: u32,
    /// The host's GPU ids.
    pub gpus: Vec<u32>,
}

/// How many workers, and how they spread over hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// `num_workers` one-worker bundles packed onto as few hosts as fit.
    Pack {
        /// Workers in the job.
        num_workers: u32,
    },
    /// `num_hosts` distinct hosts with `workers_per_host` workers each.
    Colocated {
        /// Distinct hosts the job uses.
        num_hosts: u32,
        /// Workers on each of those hosts.
        workers_per_host: u32,
    },
}

impl Placement {
    /// Upstream's rule: `num_workers` XOR (`num_hosts` and `num_workers_per_host`).
    pub fn from_counts(
        num_workers: Option<u32>,
        num_hosts: Option<u32>,
        workers_per_host: Option<u32>,
    ) -> Result<Self, TopologyError> {
        let bad = |m: &str| Err(TopologyError::BadRequest(m.to_string()));
        match (num_workers, num_hosts, workers_per_host) {
            (Some(0), None, None) => bad("num_workers must be a positive integer (at least 1), got 0"),
            (Some(n), None, None) if n > crate::MAX_PROCESSES => Err(TopologyError::TooManyProcesses(n.into())),
            (Some(n), None, None) => Ok(Placement::Pack { num_workers: n }),
            (None, Some(h), Some(w)) if h == 0 || w == 0 => {
                bad("num_hosts and num_workers_per_host must be positive integers")
            }
            (None, Some(h), Some(w)) if u64::from(h) * u64::from(w) > u64::from(crate::MAX_PROCESSES) => {
                Err(TopologyError::TooManyProcesses(u64::from(h) * u64::from(w)))
            }
            (None, Some(h), Some(w)) => Ok(Placement::Colocated { num_hosts: h, workers_per_host: w }),
            (Some(_), _, _) => bad("Both `num_workers` and `num_hosts` cannot be set: give num_workers, or num_hosts with num_workers_per_host, not both"),
            (None, Some(_), None) => bad("num_hosts needs num_workers_per_host too"),
            (None, None, Some(_)) => bad("num_workers_per_host needs num_hosts too"),
            (None, None, None) => bad("Either `num_workers` or `num_hosts` must be set: give num_workers, or num_hosts with num_workers_per_host"),
        }
    }

    /// Workers in the job (saturating, for counts past `u32`).
    pub fn num_workers(&self) -> u32 {
        match *self {
            Placement::Pack { num_workers } => num_workers,
            Placement::Colocated { num_hosts, workers_per_host } => num_hosts.saturating_mul(workers_per_host),
        }
    }
}

/// What each worker needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerResources {
    /// CPUs (slots) per worker; at least 1.
    pub cpus: u32,
    /// GPUs per worker; 0 for none.
    pub gpus: u32,
}

impl Default for WorkerResources {
    fn default() -> Self {
        WorkerResources { cpus: 1, gpus: 0 }
    }
}

/// Upstream's GPU rule: `gpus_per_worker` without `use_gpu` is an error;
/// with `use_gpu` it defaults to 1.
pub fn resolve_gpus_per_worker(use_gpu: bool, gpus_per_worker: Option<u32>) -> Result<u32, TopologyError> {
    match (use_gpu, gpus_per_worker) {
        (false, None) => Ok(0),
        (false, Some(_)) => Err(TopologyError::BadRequest(
            "gpus_per_worker is set, but use_gpu is False. use_gpu must be True if gpus_per_worker is set.".into(),
        )),
        (true, None) => Ok(1),
        (true, Some(0)) => Err(TopologyError::BadRequest(
            "use_gpu with gpus_per_worker 0; give at least 1 GPU per worker or drop use_gpu".into(),
        )),
        (true, Some(n)) => Ok(n),
    }
}

/// Where one worker landed: the index of its host and the GPU ids it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacedWorker {
    /// Index into the hosts the placement was given.
    pub host: usize,
    /// The GPU ids of that host the worker holds.
    pub gpu_ids: Vec<u32>,
}

/// Places the workers in creation (= world rank) order.
pub fn place(
    placement: Placement,
    need: WorkerResources,
    hosts: &[HostResources],
) -> Result<Vec<PlacedWorker>, TopologyError> {
    if need.cpus == 0 {
        return Err(TopologyError::BadRequest("cpus_per_worker must be at least 1".into()));
    }
    let infeasible =
        || TopologyError::Infeasible { asked: describe_request(placement, need), available: describe_hosts(hosts) };
    let mut placed = Vec::with_capacity(placement.num_workers() as usize);
    match placement {
        Placement::Colocated { num_hosts, workers_per_host } => {
            let (cpus, gpus) = (need.cpus * workers_per_host, need.gpus * workers_per_host);
            let fitting =
                hosts.iter().enumerate().filter(|(_, h)| h.cpus >= cpus && h.gpus.len() as u64 >= u64::from(gpus));
            let chosen: Vec<(usize, &HostResources)> = fitting.take(num_hosts as usize).collect();
            if chosen.len() < num_hosts as usize {
                return Err(infeasible());
            }
            for (index, host) in chosen {
                for worker in 0..workers_per_host as usize {
                    let g = need.gpus as usize;
                    placed
                        .push(PlacedWorker { host: index, gpu_ids: host.gpus[worker * g..(worker + 1) * g].to_vec() });
                }
            }
        }
        Placement::Pack { num_workers } => {
            let mut used: Vec<(u32, usize)> = vec![(0, 0); hosts.len()];
            for _ in 0..num_workers {
                let fit = hosts
                    .iter()
                    .enumerate()
                    .find(|(i, h)| used[*i].0 + need.cpus <= h.cpus && used[*i].1 + need.gpus as usize <= h.gpus.len());
                let (index, host) = fit.ok_or_else(infeasible)?;
                let first_gpu = used[index].1;
                used[index].0 += need.cpus;
                used[index].1 += need.gpus as usize;
                placed.push(PlacedWorker { host: index, gpu_ids: host.gpus[first_gpu..used[index].1].to_vec() });
            }
        }
    }
    Ok(placed)
}

fn plural(n: u32, one: &str) -> String {
    if n == 1 {
        format!("{n} {one}")
    } else {
        format!("{n} {one}s")
    }
}

fn describe_request(placement: Placement, need: WorkerResources) -> String {
    let each = format!("{} and {} each", plural(need.cpus, "CPU"), plural(need.gpus, "GPU"));
    match placement {
        Placement::Pack { num_workers } => format!("{} with {each}", plural(num_workers, "worker")),
        Placement::Colocated { num_hosts, workers_per_host } => format!(
            "{} x {} per host (one host each) with {each}",
            plural(num_hosts, "host"),
            plural(workers_per_host, "worker")
        ),
    }
}

fn describe_hosts(hosts: &[HostResources]) -> String {
    if hosts.is_empty() {
        return "no hosts are available".into();
    }
    let parts: Vec<String> = hosts
        .iter()
        .map(|h| format!("{} ({}, {})", h.hostname, plural(h.cpus, "CPU"), plural(h.gpus.len() as u32, "GPU")))
        .collect();
    format!("available are {}", parts.join(", "))
}

/// `CUDA_VISIBLE_DEVICES` per rank: every rank of a node sees the GPU ids of
/// all that node's ranks, in rank order; `None` where the node has no GPUs.
pub fn cuda_visible_devices<S: AsRef<str>>(node_of_rank: &[S], gpus_of_rank: &[Vec<u32>]) -> Vec<Option<String>> {
    node_of_rank
        .iter()
        .map(|node| {
            let ids: Vec<String> = node_of_rank
                .iter()
                .zip(gpus_of_rank)
                .filter(|(n, _)| n.as_ref() == node.as_ref())
                .flat_map(|(_, gpus)| gpus.iter().map(u32::to_string))
                .collect();
            (!ids.is_empty()).then(|| ids.join(","))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn host(name: &str, cpus: u32, gpus: u32) -> HostResources {
        HostResources { hostname: name.into(), node_id: name.into(), cpus, gpus: (0..gpus).collect() }
    }

    #[test]
    fn counts_follow_upstream_rules() {
        assert_eq!(Placement::from_counts(Some(4), None, None).unwrap(), Placement::Pack { num_workers: 4 });
        assert_eq!(Placement::from_counts(None, Some(2), Some(3)).unwrap().num_workers(), 6);
        for (w, h, p, needle) in [
            (Some(4), Some(2), Some(2), "not both"),
            (None, Some(2), None, "needs num_workers_per_host"),
            (None, None, Some(2), "needs num_hosts"),
            (None, None, None, "give num_workers"),
            (Some(0), None, None, "at least 1"),
        ] {
            let e = Placement::from_counts(w, h, p).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
        assert_eq!(resolve_gpus_per_worker(true, None).unwrap(), 1);
        assert_eq!(resolve_gpus_per_worker(true, Some(2)).unwrap(), 2);
        assert_eq!(resolve_gpus_per_worker(false, None).unwrap(), 0);
        assert!(resolve_gpus_per_worker(false, Some(1)).unwrap_err().to_string().contains("use_gpu"));
    }

    #[test]
    fn colocated_takes_distinct_hosts_in_order() {
        let hosts = [host("a", 1, 0), host("b", 4, 2), host("c", 4, 2), host("d", 8, 4)];
        let need = WorkerResources { cpus: 2, gpus: 1 };
        let placed = place(Placement::Colocated { num_hosts: 2, workers_per_host: 2 }, need, &hosts).unwrap();
        let hosts_of: Vec<usize> = placed.iter().map(|p| p.host).collect();
        assert_eq!(hosts_of, [1, 1, 2, 2]);
        assert_eq!(placed[0].gpu_ids, [0]);
        assert_eq!(placed[1].gpu_ids, [1]);
        let err = place(Placement::Colocated { num_hosts: 4, workers_per_host: 2 }, need, &hosts).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("4 hosts x 2 workers per host"), "{msg}");
        assert!(msg.contains("a (1 CPU, 0 GPUs)"), "{msg}");
    }

    #[test]
    fn pack_fills_hosts_in_order() {
        let hosts = [host("a", 3, 0), host("b", 4, 0)];
        let placed = place(Placement::Pack { num_workers: 5 }, WorkerResources::default(), &hosts).unwrap();
        let hosts_of: Vec<usize> = placed.iter().map(|p| p.host).collect();
        assert_eq!(hosts_of, [0, 0, 0, 1, 1]);
        let err = place(Placement::Pack { num_workers: 8 }, WorkerResources::default(), &hosts).unwrap_err();
        assert!(err.to_string().starts_with("cannot place 8 workers with 1 CPU and 0 GPUs each"), "{err}");
        let gpu = [host("g", 8, 3)];
        let err = place(Placement::Pack { num_workers: 2 }, WorkerResources { cpus: 1, gpus: 2 }, &gpu).unwrap_err();
        assert!(err.to_string().contains("g (8 CPUs, 3 GPUs)"), "{err}");
    }

    #[test]
    fn gpu_sharing_per_node_in_rank_order() {
        let nodes = ["a", "b", "a", "b"];
        let gpus = vec![vec![0], vec![3], vec![1], vec![2]];
        let vis = cuda_visible_devices(&nodes, &gpus);
        assert_eq!(vis, [Some("0,1".into()), Some("3,2".into()), Some("0,1".into()), Some("3,2".into())]);
        assert_eq!(cuda_visible_devices(&["a"], &[vec![]]), [None]);
    }

    proptest! {
        #[test]
        fn placement_respects_capacity(
            caps in proptest::collection::vec((1u32..9, 0u32..5), 1..6),
            cpus in 1u32..3, gpus in 0u32..2, n in 1u32..20, colocate in any::<bool>(), wph in 1u32..4,
        ) {
            let hosts: Vec<HostResources> = caps.iter().enumerate().map(|(i, &(c, g))| host(&format!("h{i}"), c, g)).collect();
            let need = WorkerResources { cpus, gpus };
            let placement = if colocate {
                Placement::Colocated { num_hosts: n.min(6), workers_per_host: wph }
            } else {
                Placement::Pack { num_workers: n }
            };
            if let Ok(placed) = place(placement, need, &hosts) {
                prop_assert_eq!(placed.len() as u32, placement.num_workers());
                for (i, h) in hosts.iter().enumerate() {
                    let mine: Vec<&PlacedWorker> = placed.iter().filter(|p| p.host == i).collect();
                    prop_assert!(mine.len() as u32 * cpus <= h.cpus);
                    let mut ids: Vec<u32> = mine.iter().flat_map(|p| p.gpu_ids.clone()).collect();
                    prop_assert!(mine.iter().all(|p| p.gpu_ids.len() as u32 == gpus));
                    ids.sort_unstable();
                    ids.dedup();
                    prop_assert_eq!(ids.len(), mine.len() * gpus as usize, "a GPU was given twice");
                    if let Placement::Colocated { workers_per_host, .. } = placement {
                        prop_assert!(mine.is_empty() || mine.len() as u32 == workers_per_host);
                    }
                }
            } else {
                // infeasible only when capacity really is short
                let fits = |h: &HostResources, k: u32| h.cpus >= k * cpus && h.gpus.len() as u32 >= k * gpus;
                match placement {
                    Placement::Pack { num_workers } => {
                        let cap: u32 = hosts.iter().map(|h| (0..=64).take_while(|&k| fits(h, k)).last().unwrap_or(0)).sum();
                        prop_assert!(cap < num_workers);
                    }
                    Placement::Colocated { num_hosts, workers_per_host } => {
                        prop_assert!((hosts.iter().filter(|h| fits(h, workers_per_host)).count() as u32) < num_hosts);
                    }
                }
            }
        }
    }
}
