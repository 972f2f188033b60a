//! Rank arithmetic: Horovod's `Coordinator` (ranks grouped by node in the
//! order nodes first registered) and `get_host_assignments` (slots filled in
//! host order), which are the same rule applied to different inputs.

use crate::{hosts::HostSpec, TopologyError};

/// A rank's place in the job.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RankInfo {
    /// World rank.
    pub rank: u32,
    /// World size: ranks in the job.
    pub size: u32,
    /// Rank among the ranks of the same node.
    pub local_rank: u32,
    /// Ranks on this rank's node.
    pub local_size: u32,
    /// Rank among the ranks that share this rank's local rank (one a node),
    /// in node order.
    pub cross_rank: u32,
    /// Ranks that share this rank's local rank (one per node that has it).
    pub cross_size: u32,
    /// Index of the rank's node in registration order (torchrun's GROUP_RANK).
    pub node_rank: u32,
    /// How many nodes the job spans (torchrun's GROUP_WORLD_SIZE).
    pub num_nodes: u32,
}

/// Registers workers (hostname, node id, world rank) and derives local and
/// cross ranks: nodes in the order they first registered, ranks within a
/// node in registration order.
#[derive(Debug, Default, Clone)]
pub struct Coordinator {
    nodes: Vec<(String, Vec<u32>)>,
    hostnames: Vec<String>,
}

impl Coordinator {
    /// A coordinator with nothing registered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that world rank `world_rank` runs on `hostname`, in node
    /// `node_id`; a node seen for the first time goes after the others.
    pub fn register(&mut self, hostname: &str, node_id: &str, world_rank: u32) {
        if !self.hostnames.iter().any(|h| h == hostname) {
            self.hostnames.push(hostname.to_string());
        }
        match self.nodes.iter_mut().find(|(id, _)| id == node_id) {
            Some((_, ranks)) => ranks.push(world_rank),
            None => self.nodes.push((node_id.to_string(), vec![world_rank])),
        }
    }

    /// Distinct hostnames, in registration order.
    pub fn hostnames(&self) -> &[String] {
        &self.hostnames
    }

    /// `"nodeA:2,nodeB:2"` in node order.
    pub fn node_id_string(&self) -> String {
        let parts: Vec<String> = self.nodes.iter().map(|(id, ranks)| format!("{id}:{}", ranks.len())).collect();
        parts.join(",")
    }

    /// Node ids in node order with their world ranks.
    pub fn nodes(&self) -> &[(String, Vec<u32>)] {
        &self.nodes
    }

    /// Every rank's info, indexed by world rank. Fails unless the registered
    /// ranks are exactly 0..n, each once.
    pub fn finalize(&self) -> Result<Vec<RankInfo>, TopologyError> {
        let size: usize = self.nodes.iter().map(|(_, r)| r.len()).sum();
        let mut out: Vec<Option<RankInfo>> = vec![None; size];
        let mut cross_sizes: Vec<u32> = Vec::new();
        let mut cross_ranks: Vec<u32> = vec![0; size];
        for (_, ranks) in &self.nodes {
            for (local_rank, &rank) in ranks.iter().enumerate() {
                let slot = cross_ranks.get_mut(rank as usize).ok_or_else(|| {
                    TopologyError::Registration(format!("rank {rank} registered but the job has only {size} ranks"))
                })?;
                if cross_sizes.len() <= local_rank {
                    cross_sizes.resize(local_rank + 1, 0);
                }
                *slot = cross_sizes[local_rank];
                cross_sizes[local_rank] += 1;
            }
        }
        for (node_rank, (_, ranks)) in self.nodes.iter().enumerate() {
            for (local_rank, &rank) in ranks.iter().enumerate() {
                let entry = &mut out[rank as usize];
                if entry.is_some() {
                    return Err(TopologyError::Registration(format!("rank {rank} registered twice")));
                }
                *entry = Some(RankInfo {
                    rank,
                    size: size as u32,
                    local_rank: local_rank as u32,
                    local_size: ranks.len() as u32,
                    cross_rank: cross_ranks[rank as usize],
                    cross_size: cross_sizes[local_rank],
                    node_rank: node_rank as u32,
                    num_nodes: self.nodes.len() as u32,
                });
            }
        }
        // size entries and no duplicates means every rank 0..size is present
        Ok(out.into_iter().map(|r| r.expect("each rank exactly once")).collect())
    }
}

/// One process slot of a host plan.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Slot {
    /// The host the slot is on, by the name that also names its `local_`
    /// scope (`HOROVOD_HOSTNAME`: the node id in a plan).
    pub host: String,
    /// The ranks of the process in this slot.
    #[serde(flatten)]
    pub info: RankInfo,
}

/// Horovod's `get_host_assignments`: fill hosts in list order, ranks
/// consecutive within a host, stopping at `max_np`; fewer than `min_np`
/// slots is an error.
pub fn host_assignments(hosts: &[HostSpec], min_np: u64, max_np: Option<u64>) -> Result<Vec<Slot>, TopologyError> {
    let available = crate::hosts::total_slots(hosts);
    let size = max_np.map_or(available, |m| m.min(available));
    if size < min_np {
        return Err(TopologyError::NotEnoughSlots { requested: min_np, available });
    }
    if size == 0 {
        return Err(TopologyError::NoProcesses(size));
    }
    if size > u64::from(crate::MAX_PROCESSES) {
        return Err(TopologyError::TooManyProcesses(size));
    }
    let mut coordinator = Coordinator::new();
    let mut host_of_rank = Vec::with_capacity(size as usize);
    'hosts: for host in hosts {
        for _ in 0..host.slots {
            if host_of_rank.len() as u64 == size {
                break 'hosts;
            }
            let rank = host_of_rank.len() as u32;
            coordinator.register(&host.name, &host.name, rank);
            host_of_rank.push(host.name.clone());
        }
    }
    let infos = coordinator.finalize()?;
    Ok(host_of_rank.into_iter().zip(infos).map(|(host, info)| Slot { host, info }).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_host_list;
    use proptest::prelude::*;

    fn tuples(infos: &[RankInfo]) -> Vec<(u32, u32, u32, u32)> {
        infos.iter().map(|i| (i.local_rank, i.local_size, i.cross_rank, i.cross_size)).collect()
    }

    fn coordinate(nodes: &[&str]) -> Coordinator {
        let mut c = Coordinator::new();
        for (rank, node) in nodes.iter().enumerate() {
            c.register(&format!("host-{node}"), node, rank as u32);
        }
        c
    }

    #[test]
    fn coordinator_examples_from_horovod() {
        let c = coordinate(&["a", "b", "a", "b"]);
        assert_eq!(tuples(&c.finalize().unwrap()), [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]);
        assert_eq!(c.node_id_string(), "a:2,b:2");

        let c = coordinate(&["a", "a", "b"]);
        assert_eq!(tuples(&c.finalize().unwrap()), [(0, 2, 0, 2), (1, 2, 0, 1), (0, 1, 1, 2)]);
        assert_eq!(c.node_id_string(), "a:2,b:1");

        let names = ["n0", "n1", "n2"];
        let nodes: Vec<&str> = (0..12).map(|r| names[r % 3]).collect();
        let infos = coordinate(&nodes).finalize().unwrap();
        assert!(infos.iter().all(|i| i.local_size == 4 && i.cross_size == 3 && i.size == 12));
    }

    #[test]
    fn coordinator_rejects_gaps_and_duplicates() {
        let mut c = Coordinator::new();
        c.register("h", "a", 0);
        c.register("h", "a", 2);
        assert!(c.finalize().unwrap_err().to_string().contains("rank 2"));
        let mut c = Coordinator::new();
        c.register("h", "a", 0);
        c.register("h", "b", 0);
        assert!(c.finalize().unwrap_err().to_string().contains("twice"));
    }

    fn rows(hosts: &str, min: u64, max: Option<u64>) -> String {
        let slots = host_assignments(&parse_host_list(hosts).unwrap(), min, max).unwrap();
        let rows: Vec<String> = slots
            .iter()
            .map(|s| {
                let i = &s.info;
                format!("{},{},{},{},{},{}", i.rank, i.size, i.local_rank, i.local_size, i.cross_rank, i.cross_size)
            })
            .collect();
        rows.join(" | ")
    }

    #[test]
    fn host_assignment_examples_from_horovod() {
        assert_eq!(rows("worker-0:2,worker-1:2", 4, Some(4)), "0,4,0,2,0,2 | 1,4,1,2,0,2 | 2,4,0,2,1,2 | 3,4,1,2,1,2");
        assert_eq!(rows("worker-0:2,worker-1:2", 1, Some(2)), "0,2,0,2,0,1 | 1,2,1,2,0,1");
        assert_eq!(rows("worker-0:1,worker-1:2", 3, Some(3)), "0,3,0,1,0,2 | 1,3,0,2,1,2 | 2,3,1,2,0,1");
        // no maximum: one process per slot
        assert_eq!(rows("a:1,b:1", 1, None), "0,2,0,1,0,2 | 1,2,0,1,1,2");
    }

    #[test]
    fn too_many_processes_is_horovods_error() {
        let hosts = parse_host_list("a:2,b:2").unwrap();
        let err = host_assignments(&hosts, 5, Some(5)).unwrap_err();
        assert_eq!(err.to_string(), "Requested more processes (5) than there are available slots (4)");
        assert!(matches!(host_assignments(&hosts, 0, Some(0)), Err(TopologyError::NoProcesses(0))));
    }

    proptest! {
        #[test]
        fn coordinator_invariants(nodes in proptest::collection::vec(0u8..6, 1..64)) {
            let names: Vec<String> = nodes.iter().map(|n| format!("n{n}")).collect();
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            let infos = coordinate(&refs).finalize().unwrap();
            prop_assert_eq!(infos.len(), nodes.len());
            for (rank, info) in infos.iter().enumerate() {
                prop_assert_eq!(info.rank as usize, rank);
                // local rank: position among earlier ranks of the same node
                let same: Vec<usize> = (0..nodes.len()).filter(|&r| nodes[r] == nodes[rank]).collect();
                prop_assert_eq!(info.local_size as usize, same.len());
                prop_assert_eq!(info.local_rank as usize, same.iter().position(|&r| r == rank).unwrap());
                // cross: nodes having a worker at this local rank, in node order
                let peers: Vec<&RankInfo> = infos.iter().filter(|o| o.local_rank == info.local_rank).collect();
                prop_assert_eq!(info.cross_size as usize, peers.len());
                let earlier = peers.iter().filter(|o| o.node_rank < info.node_rank).count();
                prop_assert_eq!(info.cross_rank as usize, earlier);
            }
        }

        #[test]
        fn host_plan_invariants(slots in proptest::collection::vec(1u32..6, 1..8), np in 1u64..40) {
            let hosts: Vec<HostSpec> = slots.iter().enumerate().map(|(i, &s)| HostSpec::new(format!("h{i}"), s)).collect();
            let total: u64 = slots.iter().map(|&s| u64::from(s)).sum();
            match host_assignments(&hosts, np, Some(np)) {
                Err(e) => {
                    prop_assert!(np > total);
                    prop_assert_eq!(e, TopologyError::NotEnoughSlots { requested: np, available: total });
                }
                Ok(plan) => {
                    prop_assert_eq!(plan.len() as u64, np);
                    let mut expected_host = hosts.iter().flat_map(|h| std::iter::repeat_n(h.name.clone(), h.slots as usize));
                    for (rank, slot) in plan.iter().enumerate() {
                        prop_assert_eq!(slot.info.rank as usize, rank);
                        prop_assert_eq!(Some(slot.host.clone()), expected_host.next());
                        prop_assert!(slot.info.local_rank < slot.info.local_size);
                        prop_assert!(slot.info.cross_rank < slot.info.cross_size);
                        let on_host = plan.iter().filter(|s| s.host == slot.host).count() as u32;
                        prop_assert_eq!(slot.info.local_size, on_host);
                    }
                }
            }
        }
    }
}
