//! The environment every worker receives, built in one place: Horovod's
//! names (gloo controller), torchrun's names, and kolo's own.

use std::collections::BTreeMap;

use crate::{HostSpec, RankInfo};

/// The names of kolo's own variables, in one place: `rank_env` writes
/// them, kolo-comm, kolo-horovod and the agent read them, and kolo's
/// Python reads them from `kolo._kolo.ENV` (made from [`names::ALL`]).
pub mod names {
    /// The rank's place: world rank and size, on its host, across hosts.
    pub const RANK: &str = "KOLO_RANK";
    /// The job's size.
    pub const SIZE: &str = "KOLO_SIZE";
    /// The rank on its host.
    pub const LOCAL_RANK: &str = "KOLO_LOCAL_RANK";
    /// The ranks on its host.
    pub const LOCAL_SIZE: &str = "KOLO_LOCAL_SIZE";
    /// The rank among the hosts' ranks of its local rank.
    pub const CROSS_RANK: &str = "KOLO_CROSS_RANK";
    /// The hosts with a rank of its local rank.
    pub const CROSS_SIZE: &str = "KOLO_CROSS_SIZE";
    /// The host's id in the plan (ranks with the same id share memory).
    pub const NODE_ID: &str = "KOLO_NODE_ID";
    /// The host's index among the job's hosts.
    pub const NODE_RANK: &str = "KOLO_NODE_RANK";
    /// The rendezvous store's address.
    pub const RENDEZVOUS_ADDR: &str = "KOLO_RENDEZVOUS_ADDR";
    /// The rendezvous store's port.
    pub const RENDEZVOUS_PORT: &str = "KOLO_RENDEZVOUS_PORT";
    /// The job's secret, for kolo's own clients; never forwarded from the
    /// caller's environment.
    pub const SECRET: &str = "KOLO_SECRET";
    /// The job's id (also the communicator's).
    pub const JOB_ID: &str = "KOLO_JOB_ID";
    /// The start timeout in seconds: how long ranks wait for each other.
    pub const TIMEOUT_SECONDS: &str = "KOLO_TIMEOUT_SECONDS";
    /// Interfaces every host reaches the next on, comma-separated.
    pub const IFACES: &str = "KOLO_IFACES";
    /// kolo-comm's links: `auto` (shared memory on a host) or `tcp`.
    pub const COMM_TRANSPORT: &str = "KOLO_COMM_TRANSPORT";
    /// kolo-comm's timeout in seconds, instead of the start timeout.
    pub const COMM_TIMEOUT_SECONDS: &str = "KOLO_COMM_TIMEOUT_SECONDS";
    /// In place: the round the process starts for.
    pub const ELASTIC_ROUND: &str = "KOLO_ELASTIC_ROUND";
    /// In place: how long a process waits for a round.
    pub const ELASTIC_TIMEOUT_SECONDS: &str = "KOLO_ELASTIC_TIMEOUT_SECONDS";
    /// Restart mode: the world's restarts so far.
    pub const RESTART_COUNT: &str = "KOLO_RESTART_COUNT";
    /// Where the rank counts its progress (read by its agent).
    pub const PROGRESS_FILE: &str = "KOLO_PROGRESS_FILE";
    /// Where the Horovod core writes its stall report (read by the agent).
    pub const STALL_FILE: &str = "KOLO_STALL_FILE";
    /// `0`: no Python hooks in the rank's interpreter.
    pub const PYTHON_HOOKS: &str = "KOLO_PYTHON_HOOKS";

    /// Every name, with the key Python finds it under in `kolo._kolo.ENV`.
    pub const ALL: [(&str, &str); 22] = [
        ("RANK", RANK),
        ("SIZE", SIZE),
        ("LOCAL_RANK", LOCAL_RANK),
        ("LOCAL_SIZE", LOCAL_SIZE),
        ("CROSS_RANK", CROSS_RANK),
        ("CROSS_SIZE", CROSS_SIZE),
        ("NODE_ID", NODE_ID),
        ("NODE_RANK", NODE_RANK),
        ("RENDEZVOUS_ADDR", RENDEZVOUS_ADDR),
        ("RENDEZVOUS_PORT", RENDEZVOUS_PORT),
        ("SECRET", SECRET),
        ("JOB_ID", JOB_ID),
        ("TIMEOUT_SECONDS", TIMEOUT_SECONDS),
        ("IFACES", IFACES),
        ("COMM_TRANSPORT", COMM_TRANSPORT),
        ("COMM_TIMEOUT_SECONDS", COMM_TIMEOUT_SECONDS),
        ("ELASTIC_ROUND", ELASTIC_ROUND),
        ("ELASTIC_TIMEOUT_SECONDS", ELASTIC_TIMEOUT_SECONDS),
        ("RESTART_COUNT", RESTART_COUNT),
        ("PROGRESS_FILE", PROGRESS_FILE),
        ("STALL_FILE", STALL_FILE),
        ("PYTHON_HOOKS", PYTHON_HOOKS),
    ];
}

/// Variables whose values are chosen when the job starts (addresses,
/// ports, ids, the secret): a plan shown before (`--dry-run`) marks them.
pub const CHOSEN_AT_START: [&str; 10] = [
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_GLOO_RENDEZVOUS_PORT",
    names::RENDEZVOUS_ADDR,
    names::RENDEZVOUS_PORT,
    "MASTER_ADDR",
    "MASTER_PORT",
    "JAX_COORDINATOR_ADDRESS",
    names::JOB_ID,
    "TORCHELASTIC_RUN_ID",
    names::SECRET,
];

/// Variables naming the interfaces, detected at start on several hosts.
pub const IFACE_VARS: [&str; 4] = ["HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME", names::IFACES, "GLOO_SOCKET_IFNAME"];

/// What an elastic job's processes are told of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ElasticEnv {
    /// In place: the round the processes start for, and how long they
    /// wait for a round.
    InPlace {
        /// The round the processes start for (`KOLO_ELASTIC_ROUND`).
        round: u64,
        /// Seconds a process waits for a round.
        timeout_s: u64,
        /// That round's hosts in rank order, each with its slots: a
        /// process starts with the ranks it will have in the round
        /// (Horovod's host assignment), not its rank among the processes
        /// started with it. Empty: the processes' own plan.
        world: Vec<HostSpec>,
    },
    /// Restart mode: this world's restarts so far, and the most allowed.
    Restart {
        /// Restarts of this world so far (`KOLO_RESTART_COUNT`).
        restarts: u32,
        /// The most restarts the job allows.
        max_restarts: u32,
    },
}

/// What is the same for every rank of a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobEnv {
    /// Address of the job's rendezvous server, as every worker reaches it.
    pub rendezvous_addr: String,
    /// Port of the job's rendezvous server.
    pub rendezvous_port: u16,
    /// Interfaces every host can use to reach the next; the first one is
    /// Gloo's (it takes a single interface).
    pub ifaces: Vec<String>,
    /// Gloo's rendezvous timeout (horovodrun passes its start timeout).
    pub timeout_s: u64,
    /// torchrun's store: the driver serves it (as torchrun's agent does) at
    /// an address every rank reaches.
    pub master_addr: String,
    /// Port of torchrun's store (`MASTER_PORT`).
    pub master_port: u16,
    /// JAX's coordinator runs in rank 0: its host and a port free there.
    pub jax_coordinator_addr: String,
    /// The port JAX's coordinator listens on, on rank 0's host.
    pub jax_coordinator_port: u16,
    /// What the processes of an elastic job are told of it; `None` for a
    /// fixed job.
    pub elastic: Option<ElasticEnv>,
    /// The job's id (`KOLO_JOB_ID`, and torchrun's `TORCHELASTIC_RUN_ID`).
    pub job_id: String,
}

impl JobEnv {
    /// Loopback addresses and ports 0: the values are chosen when a job
    /// starts, so a plan shown before (`--dry-run`) carries these.
    pub fn placeholder() -> Self {
        JobEnv {
            rendezvous_addr: "127.0.0.1".into(),
            rendezvous_port: 0,
            ifaces: vec!["lo".into()],
            timeout_s: 30,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            jax_coordinator_addr: "127.0.0.1".into(),
            jax_coordinator_port: 0,
            elastic: None,
            job_id: "dry-run".into(),
        }
    }
}

/// Every variable kolo sets for one rank. `node_id` is the rank's node
/// (`HOROVOD_HOSTNAME`, which also names the rank's `local_` scope);
/// `cuda_visible_devices` is the node's shared GPU list, if it has GPUs.
pub fn rank_env(
    info: &RankInfo,
    node_id: &str,
    job: &JobEnv,
    cuda_visible_devices: Option<&str>,
) -> BTreeMap<String, String> {
    // in place, a process's ranks are those of the round it starts for
    let in_round = match &job.elastic {
        Some(ElasticEnv::InPlace { world, .. }) if !world.is_empty() => crate::host_assignments(world, 0, None)
            .ok()
            .and_then(|slots| slots.into_iter().find(|s| s.host == node_id && s.info.local_rank == info.local_rank))
            .map(|slot| slot.info),
        _ => None,
    };
    let info = in_round.as_ref().unwrap_or(info);
    let mut env = BTreeMap::new();
    let mut set = |k: &str, v: String| {
        env.insert(k.to_string(), v);
    };
    let ranks = [
        ("HOROVOD_RANK", names::RANK, info.rank),
        ("HOROVOD_SIZE", names::SIZE, info.size),
        ("HOROVOD_LOCAL_RANK", names::LOCAL_RANK, info.local_rank),
        ("HOROVOD_LOCAL_SIZE", names::LOCAL_SIZE, info.local_size),
        ("HOROVOD_CROSS_RANK", names::CROSS_RANK, info.cross_rank),
        ("HOROVOD_CROSS_SIZE", names::CROSS_SIZE, info.cross_size),
    ];
    for (horovod, kolo, value) in ranks {
        set(horovod, value.to_string());
        set(kolo, value.to_string());
    }
    set("HOROVOD_HOSTNAME", node_id.to_string());
    set("HOROVOD_GLOO_RENDEZVOUS_ADDR", job.rendezvous_addr.clone());
    set("HOROVOD_GLOO_RENDEZVOUS_PORT", job.rendezvous_port.to_string());
    set("HOROVOD_CONTROLLER", "gloo".into());
    set("HOROVOD_CPU_OPERATIONS", "gloo".into());
    set("HOROVOD_GLOO_TIMEOUT_SECONDS", job.timeout_s.to_string());
    if let Some(first) = job.ifaces.first() {
        set("HOROVOD_GLOO_IFACE", first.clone());
        set("NCCL_SOCKET_IFNAME", job.ifaces.join(","));
        set(names::IFACES, job.ifaces.join(","));
    }
    if job.elastic.is_some() {
        set("HOROVOD_ELASTIC", "1".into());
    }
    set("PYTHONUNBUFFERED", "1".into());

    // torchrun's names: one role ("default") whose ranks are the world's,
    // one group per node, the first attempt of a run that is not restarted
    set("RANK", info.rank.to_string());
    set("WORLD_SIZE", info.size.to_string());
    set("LOCAL_RANK", info.local_rank.to_string());
    set("LOCAL_WORLD_SIZE", info.local_size.to_string());
    set("GROUP_RANK", info.node_rank.to_string());
    set("GROUP_WORLD_SIZE", info.num_nodes.to_string());
    set("ROLE_NAME", "default".into());
    set("ROLE_RANK", info.rank.to_string());
    set("ROLE_WORLD_SIZE", info.size.to_string());
    set("TORCHELASTIC_RUN_ID", job.job_id.clone());
    match &job.elastic {
        Some(ElasticEnv::Restart { restarts, max_restarts }) => {
            set(names::RESTART_COUNT, restarts.to_string());
            set("TORCHELASTIC_RESTART_COUNT", restarts.to_string());
            set("TORCHELASTIC_MAX_RESTARTS", max_restarts.to_string());
        }
        Some(ElasticEnv::InPlace { round, timeout_s, .. }) => {
            set(names::ELASTIC_ROUND, round.to_string());
            set(names::ELASTIC_TIMEOUT_SECONDS, timeout_s.to_string());
            set("TORCHELASTIC_RESTART_COUNT", "0".into());
            set("TORCHELASTIC_MAX_RESTARTS", "0".into());
        }
        None => {
            set("TORCHELASTIC_RESTART_COUNT", "0".into());
            set("TORCHELASTIC_MAX_RESTARTS", "0".into());
        }
    }
    set("MASTER_ADDR", job.master_addr.clone());
    set("MASTER_PORT", job.master_port.to_string());
    // every rank, rank 0 included, is a client of the store kolo serves
    set("TORCHELASTIC_USE_AGENT_STORE", "True".into());
    if !job.ifaces.is_empty() {
        // PyTorch's gloo backend takes a comma list, as NCCL does
        set("GLOO_SOCKET_IFNAME", job.ifaces.join(","));
    }
    // several ranks on one host: one thread each unless the caller says
    // otherwise (torchrun's default; see `caller_defaults`)
    if info.local_size > 1 {
        set(OMP_NUM_THREADS, "1".into());
    }
    // JAX's launcher convention (jax.distributed.initialize reads these)
    set("JAX_COORDINATOR_ADDRESS", join_host_port(&job.jax_coordinator_addr, job.jax_coordinator_port));
    set("JAX_NUM_PROCESSES", info.size.to_string());
    set("JAX_PROCESS_ID", info.rank.to_string());

    set(names::NODE_ID, node_id.to_string());
    set(names::NODE_RANK, info.node_rank.to_string());
    set(names::RENDEZVOUS_ADDR, job.rendezvous_addr.clone());
    set(names::RENDEZVOUS_PORT, job.rendezvous_port.to_string());
    set(names::TIMEOUT_SECONDS, job.timeout_s.to_string());
    set(names::JOB_ID, job.job_id.clone());
    if let Some(devices) = cuda_visible_devices {
        set("CUDA_VISIBLE_DEVICES", devices.to_string());
    }
    env
}

/// `host:port`, with IPv6 addresses in brackets.
fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Set by kolo as a default only: the caller's own value wins.
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";

/// Puts back the caller's value of every variable kolo only sets as a
/// default (`OMP_NUM_THREADS`); true if a default stayed.
pub fn caller_defaults(env: &mut BTreeMap<String, String>, caller: impl Fn(&str) -> Option<String>) -> bool {
    match (env.contains_key(OMP_NUM_THREADS), caller(OMP_NUM_THREADS)) {
        (true, Some(value)) => {
            env.insert(OMP_NUM_THREADS.into(), value);
            false
        }
        (kept, None) => kept,
        (false, Some(_)) => false,
    }
}

/// Whether a variable of the caller's environment is passed on to workers
/// (horovodrun's rule: everything but shell functions, `OLDPWD`, any
/// `*CUDA_VISIBLE_DEVICES` and the job secret).
pub fn forwards_caller_var(name: &str) -> bool {
    !(name.starts_with("BASH_FUNC_")
        || name == "OLDPWD"
        || name.ends_with("CUDA_VISIBLE_DEVICES")
        || name == names::SECRET
        || name == "HOROVOD_SECRET_KEY")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> JobEnv {
        JobEnv {
            rendezvous_addr: "10.0.0.1".into(),
            rendezvous_port: 4000,
            ifaces: vec!["eth0".into(), "eth1".into()],
            timeout_s: 30,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            jax_coordinator_addr: "10.0.0.2".into(),
            jax_coordinator_port: 29501,
            elastic: None,
            job_id: "j".into(),
        }
    }

    #[test]
    fn horovod_and_torch_names() {
        let info = RankInfo {
            rank: 3,
            size: 4,
            local_rank: 1,
            local_size: 2,
            cross_rank: 1,
            cross_size: 2,
            node_rank: 1,
            num_nodes: 2,
        };
        let env = rank_env(&info, "b", &job(), Some("0,1"));
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!(get("HOROVOD_RANK"), Some("3"));
        assert_eq!(get("HOROVOD_SIZE"), Some("4"));
        assert_eq!(get("HOROVOD_LOCAL_RANK"), Some("1"));
        assert_eq!(get("HOROVOD_LOCAL_SIZE"), Some("2"));
        assert_eq!(get("HOROVOD_CROSS_RANK"), Some("1"));
        assert_eq!(get("HOROVOD_CROSS_SIZE"), Some("2"));
        assert_eq!(get("HOROVOD_HOSTNAME"), Some("b"));
        assert_eq!(get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), Some("10.0.0.1"));
        assert_eq!(get("HOROVOD_GLOO_RENDEZVOUS_PORT"), Some("4000"));
        assert_eq!(get("HOROVOD_CONTROLLER"), Some("gloo"));
        assert_eq!(get("HOROVOD_CPU_OPERATIONS"), Some("gloo"));
        assert_eq!(get("HOROVOD_GLOO_IFACE"), Some("eth0"));
        assert_eq!(get("NCCL_SOCKET_IFNAME"), Some("eth0,eth1"));
        assert_eq!(get("HOROVOD_GLOO_TIMEOUT_SECONDS"), Some("30"));
        assert_eq!(get("HOROVOD_ELASTIC"), None);
        assert_eq!(get("PYTHONUNBUFFERED"), Some("1"));
        assert_eq!(get("RANK"), Some("3"));
        assert_eq!(get("WORLD_SIZE"), Some("4"));
        assert_eq!(get("LOCAL_RANK"), Some("1"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("2"));
        assert_eq!(get("GROUP_RANK"), Some("1"));
        assert_eq!(get("MASTER_ADDR"), Some("10.0.0.1"));
        assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), Some("True"));
        assert_eq!(get("MASTER_PORT"), Some("29500"));
        assert_eq!(get("GROUP_WORLD_SIZE"), Some("2"));
        assert_eq!(get("ROLE_NAME"), Some("default"));
        assert_eq!(get("ROLE_RANK"), Some("3"));
        assert_eq!(get("ROLE_WORLD_SIZE"), Some("4"));
        assert_eq!(get("TORCHELASTIC_RUN_ID"), Some("j"));
        assert_eq!(get("TORCHELASTIC_RESTART_COUNT"), Some("0"));
        assert_eq!(get("TORCHELASTIC_MAX_RESTARTS"), Some("0"));
        assert_eq!(get("GLOO_SOCKET_IFNAME"), Some("eth0,eth1"));
        assert_eq!(get("JAX_COORDINATOR_ADDRESS"), Some("10.0.0.2:29501"));
        assert_eq!(get("JAX_NUM_PROCESSES"), Some("4"));
        assert_eq!(get("JAX_PROCESS_ID"), Some("3"));
        assert_eq!(get("OMP_NUM_THREADS"), Some("1"));
        let mut env = env.clone();
        assert!(!caller_defaults(&mut env, |_| Some("8".into())));
        assert_eq!(env["OMP_NUM_THREADS"], "8");
        let alone = RankInfo { local_size: 1, local_rank: 0, ..info.clone() };
        assert!(!rank_env(&alone, "b", &job(), None).contains_key("OMP_NUM_THREADS"));
        assert_eq!(get("KOLO_RANK"), Some("3"));
        assert_eq!(get("CUDA_VISIBLE_DEVICES"), Some("0,1"));
        let restart = ElasticEnv::Restart { restarts: 2, max_restarts: 3 };
        let elastic = rank_env(&info, "b", &JobEnv { elastic: Some(restart), ..job() }, None);
        assert_eq!(elastic.get("HOROVOD_ELASTIC").map(String::as_str), Some("1"));
        assert!(!elastic.contains_key("CUDA_VISIBLE_DEVICES"));
        assert_eq!(elastic.get("KOLO_RESTART_COUNT").map(String::as_str), Some("2"));
        assert_eq!(elastic.get("TORCHELASTIC_RESTART_COUNT").map(String::as_str), Some("2"));
        assert_eq!(elastic.get("TORCHELASTIC_MAX_RESTARTS").map(String::as_str), Some("3"));
        let in_place = ElasticEnv::InPlace { round: 4, timeout_s: 600, world: Vec::new() };
        let elastic = rank_env(&info, "b", &JobEnv { elastic: Some(in_place), ..job() }, None);
        assert_eq!(elastic.get("HOROVOD_ELASTIC").map(String::as_str), Some("1"));
        assert_eq!(elastic.get(names::ELASTIC_ROUND).map(String::as_str), Some("4"));
        assert_eq!(elastic.get(names::ELASTIC_TIMEOUT_SECONDS).map(String::as_str), Some("600"));
        // a later cohort's process starts with its ranks in the round it joins
        let world = vec![HostSpec::new("a", 2), HostSpec::new("b", 2)];
        let first_on_b = RankInfo {
            rank: 0,
            size: 2,
            local_rank: 0,
            local_size: 2,
            cross_rank: 0,
            cross_size: 1,
            node_rank: 0,
            num_nodes: 1,
        };
        let joining = ElasticEnv::InPlace { round: 1, timeout_s: 600, world };
        let joining = rank_env(&first_on_b, "b", &JobEnv { elastic: Some(joining), ..job() }, None);
        let get = |k: &str| joining.get(k).map(String::as_str);
        assert_eq!((get("HOROVOD_RANK"), get("HOROVOD_SIZE"), get("RANK")), (Some("2"), Some("4"), Some("2")));
        assert_eq!((get("HOROVOD_CROSS_RANK"), get("HOROVOD_CROSS_SIZE")), (Some("1"), Some("2")));
        assert_eq!((get("HOROVOD_LOCAL_RANK"), get("HOROVOD_HOSTNAME")), (Some("0"), Some("b")));
        // every kolo variable a rank gets is in the one table of names
        let mut written: Vec<&String> = [env.keys(), elastic.keys()].into_iter().flatten().collect();
        written.retain(|k| k.starts_with("KOLO_"));
        let known: Vec<&str> = names::ALL.iter().map(|(_, name)| *name).collect();
        for name in written {
            assert!(known.contains(&name.as_str()), "{name} is written but not in env::names::ALL");
        }
        let keys: std::collections::BTreeSet<&str> = names::ALL.iter().map(|(key, _)| *key).collect();
        assert_eq!(keys.len(), names::ALL.len(), "a key of env::names::ALL twice");
        assert!(names::ALL.iter().all(|(key, name)| name.strip_prefix("KOLO_") == Some(key)));
    }

    /// The variables a plan marks as chosen at start are exactly those
    /// that differ between two starts of one job.
    #[test]
    fn the_start_time_variables_are_those_that_change_between_starts() {
        let info = RankInfo {
            rank: 0,
            size: 2,
            local_rank: 0,
            local_size: 1,
            cross_rank: 0,
            cross_size: 2,
            node_rank: 0,
            num_nodes: 2,
        };
        let other = JobEnv {
            rendezvous_addr: "10.0.0.9".into(),
            rendezvous_port: 4001,
            master_addr: "10.0.0.8".into(),
            master_port: 29502,
            jax_coordinator_addr: "10.0.0.7".into(),
            jax_coordinator_port: 29503,
            job_id: "k".into(),
            ..job()
        };
        let (a, b) = (rank_env(&info, "a", &job(), None), rank_env(&info, "a", &other, None));
        let changed: Vec<&str> = a.keys().filter(|k| a[*k] != b[*k]).map(String::as_str).collect();
        let mut marked: Vec<&str> = CHOSEN_AT_START.iter().copied().filter(|k| *k != names::SECRET).collect();
        marked.sort();
        assert_eq!(changed, marked);
        let other_ifaces = rank_env(&info, "a", &JobEnv { ifaces: vec!["ib0".into()], ..job() }, None);
        let mut changed: Vec<&str> = a.keys().filter(|k| a[*k] != other_ifaces[*k]).map(String::as_str).collect();
        changed.sort();
        let mut ifaces = IFACE_VARS.to_vec();
        ifaces.sort();
        assert_eq!(changed, ifaces);
    }

    #[test]
    fn caller_env_filter() {
        for name in ["BASH_FUNC_x%%", "OLDPWD", "CUDA_VISIBLE_DEVICES", "NV_CUDA_VISIBLE_DEVICES", names::SECRET] {
            assert!(!forwards_caller_var(name), "{name}");
        }
        for name in ["PATH", "HOME", "PYTHONPATH", "OMP_NUM_THREADS"] {
            assert!(forwards_caller_var(name), "{name}");
        }
    }
}
