//! One description of a job, whichever front end asked for it: `kolo run`
//! and `kolo.Executor` translate their arguments into a [`JobSpec`], which
//! checks them once, picks the hosts and the engine, and makes the
//! executors of a fixed job, of each world of a restarted job and of each
//! cohort of an in-place one.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kolo_topology::{
    total_slots, Cooldown, ElasticConfig, HostSpec, Placement, StopReason, TopologyError, WorkerResources,
};

use crate::elastic::{Cohort, CohortFactory, Discovery};
use kolo_engine::{
    Engine, EngineChoice, EngineOptions, ExecError, LocalEngine, RayOptions, SlurmEngine, WorkerRequest,
};
use kolo_exec::{Executor, Settings};

/// How a front end spells the options its messages name (`--min-np` on
/// the command line, `min_workers` in Python).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptionNames {
    /// The number of processes (`-np`, `num_workers`).
    pub np: &'static str,
    /// The fewest processes of an elastic job.
    pub min_np: &'static str,
    /// The most processes of an elastic job.
    pub max_np: &'static str,
    /// The limit on re-formed worlds.
    pub reset_limit: &'static str,
    /// The limit on restarts after failures.
    pub max_restarts: &'static str,
    /// The longest wait for enough slots.
    pub elastic_timeout: &'static str,
    /// The blacklist cooldown range.
    pub cooldown: &'static str,
    /// The host discovery script.
    pub discovery: &'static str,
    /// How often discovery runs.
    pub discovery_interval: &'static str,
    /// Slots of a discovered host that names none.
    pub slots_per_host: &'static str,
    /// The host list.
    pub hosts: &'static str,
    /// The engine choice.
    pub engine: &'static str,
    /// The hang watch's timeout.
    pub hang_timeout: &'static str,
    /// The time workers have to start and connect.
    pub start_timeout: &'static str,
    /// The time an engine may wait for resources.
    pub placement_timeout: &'static str,
    /// What the front end calls a job (`jobs`, `executors`).
    pub jobs: &'static str,
    /// The elastic options, as a list for messages.
    pub elastic_options: &'static str,
}

impl OptionNames {
    /// horovod.ray's argument names, which `kolo.Executor` takes.
    pub const HOROVOD_RAY: OptionNames = OptionNames {
        np: "num_workers",
        min_np: "min_workers",
        max_np: "max_workers",
        reset_limit: "reset_limit",
        max_restarts: "max_restarts",
        elastic_timeout: "elastic_timeout",
        cooldown: "cooldown_range",
        discovery: "host_discovery_script",
        discovery_interval: "discovery_interval",
        slots_per_host: "slots_per_host",
        hosts: "hosts",
        engine: "engine",
        hang_timeout: "hang_timeout_s",
        start_timeout: "timeout_s",
        placement_timeout: "placement_group_timeout_s",
        jobs: "executors",
        elastic_options: "the elastic arguments (min_workers, max_workers, max_restarts)",
    };

    /// `kolo run`'s option names (horovodrun's).
    pub const KOLO_RUN: OptionNames = OptionNames {
        np: "-np",
        min_np: "--min-np",
        max_np: "--max-np",
        reset_limit: "--reset-limit",
        max_restarts: "--max-restarts",
        elastic_timeout: "--elastic-timeout",
        cooldown: "--cooldown-range",
        discovery: "--host-discovery-script",
        discovery_interval: "--discovery-interval",
        slots_per_host: "--slots-per-host",
        hosts: "-H/--hostfile",
        engine: "--engine",
        hang_timeout: "--hang-timeout",
        start_timeout: "--start-timeout",
        placement_timeout: "--placement-timeout",
        jobs: "jobs",
        elastic_options:
            "the elastic options (--in-place, --min-np, --max-np, --max-restarts, --host-discovery-script)",
    };
}

impl OptionNames {
    /// Why membership stopped the job, naming the limits as the user gave them.
    pub fn explain(&self, reason: &StopReason) -> String {
        match reason {
            StopReason::ResetLimit { limit } => format!(
                "the job was re-formed {limit} times, its reset limit; raise {} to allow more",
                self.reset_limit
            ),
            StopReason::RestartLimit { limit } => format!(
                "ranks failed and the job was restarted {limit} times, its {}; raise it to allow more",
                self.max_restarts
            ),
            StopReason::Timeout { needed, available, timeout } => format!(
                "timed out after {} waiting for {needed} slots ({}) with {available} available on hosts not \
                 blacklisted; add hosts or lower {}, or raise {}",
                kolo_topology::format_seconds(*timeout),
                self.min_np,
                self.min_np,
                self.elastic_timeout
            ),
            StopReason::NoSlotsLeft { needed, available } => format!(
                "{available} slots are left on hosts not blacklisted, fewer than the {needed} of {}, and no more can \
                 come: the host list is fixed and blacklisted hosts stay out; give {} to let them back or {} to add \
                 hosts, or lower {}",
                self.min_np, self.cooldown, self.discovery, self.min_np
            ),
            StopReason::AllHostsFailed { .. } => format!("{reason}: the job failed"),
        }
    }
}

/// What a host's slots count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slots {
    /// Processes (horovodrun's): `-np` may not exceed the hosts' slots,
    /// and a job that names no host has as many slots here as processes.
    Processes,
    /// CPUs (the Executor's): workers take `cpus_per_worker` each, and a
    /// job that names no host has this machine's cores.
    Cpus,
}

/// How many workers, and how they share hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workers {
    /// This many, packed onto as few hosts as fit; none: every slot of the
    /// hosts given (or of the Slurm allocation).
    Pack(Option<u32>),
    /// `per_host` workers on each of `hosts` distinct hosts.
    Colocated {
        /// Distinct hosts.
        hosts: u32,
        /// Workers on each.
        per_host: u32,
    },
}

/// Horovod's elastic modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElasticMode {
    /// Survivors keep running and join a new round (Horovod's elastic mode).
    InPlace,
    /// Every rank stops and the job starts again, restart count and all
    /// (torchrun's elastic semantics).
    Restart,
}

/// What makes a job elastic; unset limits take their defaults from the
/// job's size.
#[derive(Clone, Debug)]
pub struct ElasticOptions {
    /// In place or restart.
    pub mode: ElasticMode,
    /// Fewest processes (default: the job's size).
    pub min_np: Option<u32>,
    /// Most processes (default: the job's size; with a discovery script
    /// or a `host_source`, every slot found).
    pub max_np: Option<u32>,
    /// Restarts after failures (default: none in restart mode; in place
    /// only the reset limit bounds them, as in Horovod).
    pub max_restarts: Option<u32>,
    /// Re-formed worlds allowed for any reason; none: no limit.
    pub reset_limit: Option<u32>,
    /// The longest wait for `min_np` slots before the job stops.
    pub elastic_timeout: Duration,
    /// Blacklisted hosts come back after MIN..MAX; none: never.
    pub cooldown: Option<(Duration, Duration)>,
    /// A program printing the available hosts; none: `host_source`, else
    /// the host list (or, on Ray, the cluster's alive nodes).
    pub discovery_script: Option<PathBuf>,
    /// Hosts from the caller's own source (horovod.ray's discovery
    /// object), asked every `discovery_interval` when there is no script.
    pub host_source: Option<std::sync::Arc<dyn kolo_engine::HostSource>>,
    /// How often the hosts are discovered again.
    pub discovery_interval: Duration,
    /// Slots of a host the script prints without `:slots`.
    pub slots_per_host: u32,
}

impl ElasticOptions {
    /// Options of `mode` with every limit unset, a 600 s elastic timeout,
    /// discovery every second and one slot per discovered host.
    pub fn new(mode: ElasticMode) -> Self {
        ElasticOptions {
            mode,
            min_np: None,
            max_np: None,
            max_restarts: None,
            reset_limit: None,
            elastic_timeout: Duration::from_secs(600),
            cooldown: None,
            discovery_script: None,
            host_source: None,
            discovery_interval: Duration::from_secs(1),
            slots_per_host: 1,
        }
    }
}

/// A job as asked for. Fill it in, then [`JobSpec::check`] it once.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// The engine asked for (`Auto` picks one from the hosts and the
    /// environment).
    pub engine: EngineChoice,
    /// The hosts given (`-H`, a host file, `hosts=`); none: the Slurm
    /// allocation this runs in, the Ray cluster, or this machine.
    pub hosts: Option<Vec<HostSpec>>,
    /// What the hosts' slots count: processes or CPUs.
    pub slots: Slots,
    /// How many workers, and how they share hosts.
    pub workers: Workers,
    /// CPUs and GPUs each worker needs.
    pub resources: WorkerResources,
    /// How the job runs (timeouts, output, the secret...), handed to the
    /// executors.
    pub settings: Settings,
    /// How each engine reaches its machines.
    pub engine_options: EngineOptions,
    /// Variables every worker gets on top of kolo's own.
    pub env: Vec<(String, String)>,
    /// What makes the job elastic; none: a fixed job.
    pub elastic: Option<ElasticOptions>,
    /// Watch the job for hangs: seconds without progress on every rank
    /// before kolo reports and ends it (fixed jobs only).
    pub hang_timeout_s: Option<f64>,
    /// How the front end spells its options, for messages.
    pub names: OptionNames,
}

/// A checked job: its hosts and size are known.
#[derive(Clone, Debug)]
pub struct Job {
    spec: JobSpec,
    /// The hosts it runs on; empty where the engine finds them itself (a
    /// Ray cluster, this machine's CPUs, an allocation Slurm will grant).
    hosts: Vec<HostSpec>,
    request: WorkerRequest,
}

fn bad(message: impl Into<String>) -> ExecError {
    ExecError::BadSettings(message.into())
}

/// `seconds` as a duration, if it is a positive number (`what` names it).
pub fn seconds(what: &str, seconds: f64) -> Result<Duration, ExecError> {
    if seconds.is_finite() && seconds > 0.0 {
        Ok(Duration::from_secs_f64(seconds))
    } else {
        Err(bad(format!("{what} must be a positive number of seconds, got {seconds}")))
    }
}

impl JobSpec {
    /// The durations the front ends take: the hang watch (at least a
    /// second, fixed jobs only), the start and placement timeouts.
    fn check_times(&self) -> Result<(), ExecError> {
        let names = self.names;
        if let Some(s) = self.hang_timeout_s {
            if !(s.is_finite() && s >= 1.0) {
                return Err(bad(format!("{} must be a number of seconds of at least 1, not {s}", names.hang_timeout)));
            }
            if self.elastic.is_some() {
                return Err(bad(format!(
                    "{} watches fixed {}: drop it or {}",
                    names.hang_timeout, names.jobs, names.elastic_options
                )));
            }
        }
        for (what, value) in [
            (names.start_timeout, self.settings.start_timeout),
            (names.placement_timeout, self.settings.placement_timeout),
        ] {
            if value.is_zero() {
                return Err(bad(format!("{what} must be more than 0 seconds")));
            }
        }
        Ok(())
    }

    /// Checks the job once, for every front end: the hosts it runs on,
    /// its size, and its elastic limits.
    pub fn check(self) -> Result<Job, ExecError> {
        let names = self.names;
        self.check_times()?;
        let in_allocation = SlurmEngine::in_allocation();
        let ray = self.engine == EngineChoice::Ray;
        if ray && self.hosts.is_some() {
            return Err(bad(format!(
                "the Ray engine places workers on the Ray cluster's nodes itself: give no host list ({})",
                names.hosts
            )));
        }
        if self.resources.cpus == 0 {
            return Err(TopologyError::BadRequest("cpus_per_worker must be at least 1".into()).into());
        }
        let allocation = matches!(self.engine, EngineChoice::Auto | EngineChoice::Slurm) && in_allocation;
        let hosts = match &self.hosts {
            Some(hosts) => hosts.clone(),
            None if allocation => SlurmEngine::allocation_hosts()?,
            None => Vec::new(),
        };
        let placement = match self.workers {
            Workers::Pack(Some(0)) => return Err(bad(format!("{} must be at least 1, got 0", names.np))),
            Workers::Pack(Some(np)) => Placement::from_counts(Some(np), None, None)?,
            // every slot of the hosts given, or of the allocation
            Workers::Pack(None) if !hosts.is_empty() => {
                let slots = total_slots(&hosts);
                let np = u32::try_from(slots).map_err(|_| TopologyError::TooManyProcesses(slots))?;
                Placement::from_counts(Some(np), None, None)?
            }
            // an elastic job on no hosts given starts with its fewest
            Workers::Pack(None) => match self.elastic.as_ref().and_then(|e| e.min_np) {
                Some(min_np) => Placement::from_counts(Some(min_np), None, None)?,
                None => return Err(bad(format!("give the number of processes with {}", names.np))),
            },
            Workers::Colocated { hosts, per_host } => Placement::from_counts(None, Some(hosts), Some(per_host))?,
        };
        let np = placement.num_workers();
        // the hosts given bound the job (Horovod's check); an allocation
        // and a Ray cluster are checked when they place it
        if self.slots == Slots::Processes
            && self.hosts.is_some()
            && self.engine != EngineChoice::Slurm
            && self.elastic.is_none()
        {
            let available = total_slots(&hosts);
            if u64::from(np) > available {
                return Err(TopologyError::NotEnoughSlots { requested: np.into(), available }.into());
            }
        }
        let request = WorkerRequest { placement, resources: self.resources };
        if let Some(elastic) = &self.elastic {
            if matches!(self.workers, Workers::Colocated { .. }) {
                return Err(bad(format!(
                    "an elastic job places workers by host slots: give {} and {}, not hosts times workers per host",
                    names.np, names.hosts
                )));
            }
            if self.engine == EngineChoice::Slurm && !in_allocation {
                return Err(bad(
                    "an elastic job under Slurm runs inside an allocation (salloc or sbatch): kolo does not grow \
                     one it asked for",
                ));
            }
            if let Some((lo, hi)) = elastic.cooldown {
                if lo.is_zero() || lo > hi {
                    return Err(bad(format!(
                        "{} '{}:{}': give MIN and MAX seconds with 0 < MIN <= MAX, e.g. 10 and 300",
                        names.cooldown,
                        lo.as_secs_f64(),
                        hi.as_secs_f64()
                    )));
                }
            }
            if elastic.discovery_interval < Duration::from_millis(10) {
                return Err(bad(format!(
                    "{} must be at least 0.01 seconds, got {}",
                    names.discovery_interval,
                    elastic.discovery_interval.as_secs_f64()
                )));
            }
            if elastic.slots_per_host == 0 {
                return Err(bad(format!("{} must be at least 1", names.slots_per_host)));
            }
        }
        let job = Job { spec: self, hosts, request };
        if job.is_elastic() {
            job.elastic_config()?;
        }
        Ok(job)
    }
}

/// What only a job's start knows, for a front end that makes the job
/// before it starts it (kolo.Executor: horovod.ray's constructor checks
/// the arguments, `start` brings the worker program, the ssh key, the Ray
/// cluster and the hang watch).
#[derive(Clone, Debug, Default)]
pub struct StartOptions {
    /// The program the workers run, and its arguments.
    pub worker_program: Option<PathBuf>,
    /// The worker program's arguments.
    pub worker_args: Vec<String>,
    /// The ssh engine's key.
    pub ssh_identity_file: Option<PathBuf>,
    /// The Ray cluster and how to reach it.
    pub ray: RayOptions,
    /// Seconds without progress before the hang watch ends the job.
    pub hang_timeout_s: Option<f64>,
}

impl Job {
    /// This job with what its start knows; only those parts are checked
    /// here, the rest was when the job was.
    pub fn started_with(&self, start: StartOptions) -> Result<Job, ExecError> {
        let mut job = self.clone();
        let spec = &mut job.spec;
        spec.hang_timeout_s = start.hang_timeout_s;
        spec.engine_options.ssh.identity_file = start.ssh_identity_file;
        spec.engine_options.ray = start.ray;
        spec.settings.worker_program = start.worker_program;
        spec.settings.worker_args = start.worker_args;
        spec.check_times()?;
        Ok(job)
    }

    /// The hang watch's timeout, if the job asked for one (checked).
    pub fn hang_timeout(&self) -> Option<Duration> {
        self.spec.hang_timeout_s.map(Duration::from_secs_f64)
    }

    /// The description the job was checked from.
    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// How the job runs.
    pub fn settings(&self) -> &Settings {
        &self.spec.settings
    }

    /// The processes of the job (of its first world, if elastic).
    pub fn np(&self) -> u32 {
        self.request.num_workers()
    }

    /// The variables every worker gets on top of kolo's own.
    pub fn env(&self) -> &[(String, String)] {
        &self.spec.env
    }

    /// Whether the job was asked to be elastic.
    pub fn is_elastic(&self) -> bool {
        self.spec.elastic.is_some()
    }

    /// The elastic mode, if the job is elastic.
    pub fn elastic_mode(&self) -> Option<ElasticMode> {
        self.spec.elastic.as_ref().map(|e| e.mode)
    }

    /// The executor of a fixed job (host names are looked up off the
    /// async runtime).
    pub async fn executor(&self) -> Result<Executor, ExecError> {
        let (spec, hosts, request) = (self.spec.clone(), self.hosts.clone(), self.request);
        let engine = tokio::task::spawn_blocking(move || fixed_engine(&spec, hosts, &request))
            .await
            .map_err(|e| ExecError::Io { what: "choosing the engine".into(), source: std::io::Error::other(e) })??;
        Executor::with_engine(self.spec.settings.clone(), self.request, engine)
    }

    /// Membership's limits for an elastic job (none for a fixed one).
    pub fn elastic_config(&self) -> Result<ElasticConfig, ExecError> {
        let Some(elastic) = &self.spec.elastic else {
            return Err(bad("the job is not elastic"));
        };
        let names = self.spec.names;
        let np = self.np();
        let min_np = elastic.min_np.unwrap_or(np);
        // hosts the caller discovers (a script, a source of theirs) bound
        // the job, not its size
        let discovered = elastic.discovery_script.is_some() || elastic.host_source.is_some();
        let max_np = match (elastic.max_np, discovered) {
            (Some(max), _) => max,
            (None, true) => kolo_topology::MAX_PROCESSES,
            (None, false) => np.max(min_np),
        };
        if min_np == 0 {
            return Err(bad(format!("{} must be a positive integer, got 0", names.min_np)));
        }
        if min_np > max_np {
            let bare = |name: &'static str| name.trim_start_matches('-');
            return Err(bad(format!(
                "{} ({min_np}) must not be more than {} ({max_np}): give 1 <= {} <= {}",
                names.min_np,
                names.max_np,
                bare(names.min_np),
                bare(names.max_np)
            )));
        }
        let mut config = ElasticConfig::new(min_np, max_np)?;
        config.max_restarts = match elastic.mode {
            ElasticMode::InPlace => elastic.max_restarts,
            ElasticMode::Restart => Some(elastic.max_restarts.unwrap_or(0)),
        };
        config.reset_limit = elastic.reset_limit;
        config.elastic_timeout = elastic.elastic_timeout;
        if let Some((lo, hi)) = elastic.cooldown {
            config.cooldown = Some(Cooldown::new(lo, hi)?);
        }
        // the cooldowns' jitter differs from job to job, as Horovod's
        config.jitter_seed = {
            use std::hash::{BuildHasher, Hasher};
            std::collections::hash_map::RandomState::new().build_hasher().finish()
        };
        // in place nothing else bounds failures: Horovod's rule
        config.blacklist_failed_hosts = elastic.mode == ElasticMode::InPlace;
        config.fixed_hosts = self.discovery()?.is_fixed();
        Ok(config)
    }

    /// Where an elastic job's hosts come from: the discovery script, the
    /// Ray cluster's nodes, or the hosts, fixed.
    pub fn discovery(&self) -> Result<Discovery, ExecError> {
        let Some(elastic) = &self.spec.elastic else {
            return Err(bad("the job is not elastic"));
        };
        let choice = self.spec.engine;
        let source = match (&elastic.discovery_script, &elastic.host_source) {
            (Some(_), _) => None,
            (None, Some(source)) => Some(source.clone()),
            (None, None) => choice.host_source(&self.spec.engine_options, self.request.resources),
        };
        let fixed = match (&self.spec.hosts, self.hosts.is_empty(), choice) {
            (_, false, _) => self.hosts.clone(),
            (None, true, EngineChoice::Ray) => Vec::new(),
            // this machine, with a slot for each process
            _ => vec![HostSpec::new("localhost", self.np().max(elastic.max_np.unwrap_or(0)))],
        };
        Ok(Discovery {
            script: elastic.discovery_script.clone(),
            source,
            fixed,
            interval: elastic.discovery_interval,
            slots_per_host: elastic.slots_per_host,
        })
    }

    /// Makes the executor of each world or cohort of an elastic job, on the
    /// hosts its membership chose, sharing the job's secret.
    pub fn cohort_factory(&self) -> CohortFactory {
        let job = self.clone();
        Arc::new(move |cohort: Cohort| {
            let job = job.clone();
            Box::pin(async move {
                let request = WorkerRequest::pack(cohort.np as u32)
                    .cpus_per_worker(job.request.resources.cpus)
                    .gpus_per_worker(job.request.resources.gpus);
                let mut settings = job.spec.settings.clone().with_secret(cohort.secret);
                settings.output.first_label = cohort.first_process;
                let (choice, options) = (job.spec.engine, job.spec.engine_options.clone());
                let hosts = cohort.hosts;
                // engines look host names up: off the runtime
                let engine = tokio::task::spawn_blocking(move || choice.elastic_engine(hosts, &request, options))
                    .await
                    .map_err(|e| ExecError::Io {
                        what: "choosing the engine".into(),
                        source: std::io::Error::other(e),
                    })??;
                Executor::with_engine(settings, request, engine)
            })
        })
    }
}

/// The engine of a fixed job: blocking (names are looked up).
fn fixed_engine(spec: &JobSpec, hosts: Vec<HostSpec>, request: &WorkerRequest) -> Result<Box<dyn Engine>, ExecError> {
    let choice = spec.engine.resolve(&hosts);
    let this_machine = spec.hosts.is_none() && hosts.is_empty();
    match (this_machine, choice, spec.slots) {
        // no host list and no allocation: this machine, its cores its slots
        (true, EngineChoice::Local, Slots::Cpus) => Ok(Box::new(LocalEngine::this_machine())),
        // or a slot for each process (horovodrun's)
        (true, EngineChoice::Local | EngineChoice::Ssh, _) => {
            let here = HostSpec::new("localhost", request.num_workers());
            choice.engine(vec![here], request, spec.engine_options.clone())
        }
        _ => choice.engine(hosts, request, spec.engine_options.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLI: OptionNames = OptionNames::KOLO_RUN;

    #[test]
    fn stop_reasons_name_the_limits_as_each_front_end_spells_them() {
        let timeout = StopReason::Timeout { needed: 4, available: 2, timeout: Duration::from_secs(30) };
        assert!(CLI.explain(&timeout).contains("waiting for 4 slots (--min-np) with 2 available"));
        let python = OptionNames::HOROVOD_RAY.explain(&timeout);
        assert!(python.contains("(min_workers)") && python.contains("raise elastic_timeout"), "{python}");
        assert!(!python.contains("--"), "{python}");
        let none_left = StopReason::NoSlotsLeft { needed: 2, available: 1 };
        let cli = CLI.explain(&none_left);
        assert!(cli.contains("give --cooldown-range") && cli.contains("--host-discovery-script"), "{cli}");
        let python = OptionNames::HOROVOD_RAY.explain(&none_left);
        assert!(python.contains("give cooldown_range") && python.contains("or lower min_workers"), "{python}");
        assert!(CLI.explain(&StopReason::ResetLimit { limit: 2 }).contains("--reset-limit"));
        assert!(CLI.explain(&StopReason::RestartLimit { limit: 2 }).contains("--max-restarts"));
    }

    fn spec(workers: Workers, hosts: Option<&str>) -> JobSpec {
        JobSpec {
            engine: EngineChoice::Local,
            hosts: hosts.map(|h| kolo_topology::parse_host_list(h).unwrap()),
            slots: Slots::Processes,
            workers,
            resources: WorkerResources::default(),
            settings: Settings::default(),
            engine_options: EngineOptions::default(),
            env: Vec::new(),
            elastic: None,
            hang_timeout_s: None,
            names: CLI,
        }
    }

    #[test]
    fn a_job_is_sized_from_its_hosts_and_checked_once() {
        // every slot of the hosts given
        assert_eq!(spec(Workers::Pack(None), Some("a:2,b:3")).check().unwrap().np(), 5);
        let over = spec(Workers::Pack(Some(6)), Some("a:2,b:3")).check().unwrap_err();
        assert!(matches!(over, ExecError::Topology(TopologyError::NotEnoughSlots { requested: 6, available: 5 })));
        // the executor's slots are CPUs: the placement decides, later
        let cpus = JobSpec { slots: Slots::Cpus, ..spec(Workers::Pack(Some(6)), Some("a:2,b:3")) };
        assert_eq!(cpus.check().unwrap().np(), 6);
        let none = spec(Workers::Pack(None), None).check().unwrap_err().to_string();
        assert!(none.contains("give the number of processes with -np"), "{none}");
        let zero = spec(Workers::Pack(Some(0)), None).check().unwrap_err().to_string();
        assert!(zero.contains("-np must be at least 1"), "{zero}");
        let ray = JobSpec { engine: EngineChoice::Ray, ..spec(Workers::Pack(Some(2)), Some("a:2")) };
        assert!(ray.check().unwrap_err().to_string().contains("give no host list"));
        assert_eq!(spec(Workers::Colocated { hosts: 2, per_host: 3 }, None).check().unwrap().np(), 6);
    }

    #[test]
    fn elastic_limits_default_from_the_job_and_are_named_when_wrong() {
        let mut elastic = ElasticOptions::new(ElasticMode::Restart);
        elastic.min_np = Some(3);
        let job = JobSpec { elastic: Some(elastic.clone()), ..spec(Workers::Pack(None), Some("a:2,b:2")) };
        let config = job.check().unwrap().elastic_config().unwrap();
        assert_eq!((config.min_np, config.max_np, config.max_restarts), (3, 4, Some(0)));
        assert!(!config.blacklist_failed_hosts);
        // no -np and no hosts: the fewest
        let job = JobSpec { elastic: Some(elastic.clone()), ..spec(Workers::Pack(None), None) };
        assert_eq!(job.check().unwrap().np(), 3);
        elastic.max_np = Some(2);
        let bad = JobSpec { elastic: Some(elastic.clone()), ..spec(Workers::Pack(Some(2)), None) };
        let e = bad.check().unwrap_err().to_string();
        assert!(e.contains("--min-np (3) must not be more than --max-np (2): give 1 <= min-np <= max-np"), "{e}");
        let mut in_place = ElasticOptions::new(ElasticMode::InPlace);
        in_place.cooldown = Some((Duration::from_secs(9), Duration::from_secs(3)));
        let bad = JobSpec {
            elastic: Some(in_place.clone()),
            names: OptionNames::HOROVOD_RAY,
            ..spec(Workers::Pack(Some(2)), None)
        };
        assert!(bad.check().unwrap_err().to_string().contains("cooldown_range '9:3'"));
        in_place.cooldown = None;
        let job = JobSpec { elastic: Some(in_place), ..spec(Workers::Pack(Some(2)), None) };
        let config = job.check().unwrap().elastic_config().unwrap();
        assert!(config.blacklist_failed_hosts && config.fixed_hosts && config.max_restarts.is_none());
    }

    #[test]
    fn the_hang_watch_and_the_timeouts_are_checked_once_and_named_as_given() {
        let fixed = |seconds| JobSpec { hang_timeout_s: Some(seconds), ..spec(Workers::Pack(Some(2)), None) };
        assert_eq!(fixed(1.0).check().unwrap().hang_timeout(), Some(Duration::from_secs(1)));
        assert_eq!(spec(Workers::Pack(Some(2)), None).check().unwrap().hang_timeout(), None);
        for bad in [0.5, 0.0, -3.0, f64::NAN, f64::INFINITY] {
            let e = fixed(bad).check().unwrap_err().to_string();
            assert!(e.contains("--hang-timeout must be a number of seconds of at least 1"), "{bad}: {e}");
        }
        let python = JobSpec { names: OptionNames::HOROVOD_RAY, ..fixed(0.5) };
        assert!(python.check().unwrap_err().to_string().contains("hang_timeout_s must be"));
        let elastic = JobSpec { elastic: Some(ElasticOptions::new(ElasticMode::InPlace)), ..fixed(5.0) };
        let e = elastic.clone().check().unwrap_err().to_string();
        assert!(e.contains("--hang-timeout watches fixed jobs: drop it or the elastic options"), "{e}");
        let e = JobSpec { names: OptionNames::HOROVOD_RAY, ..elastic }.check().unwrap_err().to_string();
        assert!(e.contains("hang_timeout_s watches fixed executors: drop it or the elastic arguments"), "{e}");
        let mut settings = Settings::default();
        settings.start_timeout = Duration::ZERO;
        let e = JobSpec { settings, ..spec(Workers::Pack(Some(2)), None) }.check().unwrap_err().to_string();
        assert!(e.contains("--start-timeout must be more than 0 seconds"), "{e}");
        let mut settings = Settings::default();
        settings.placement_timeout = Duration::ZERO;
        let e = JobSpec { settings, names: OptionNames::HOROVOD_RAY, ..spec(Workers::Pack(Some(2)), None) }
            .check()
            .unwrap_err()
            .to_string();
        assert!(e.contains("placement_group_timeout_s must be more than 0 seconds"), "{e}");
    }
}
