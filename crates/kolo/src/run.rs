//! `kolo run` and `kolo rendezvous`.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use kolo_exec::elastic::Discovery;
use kolo_exec::{EngineChoice, OutputOptions, SshOptions};
use kolo_rendezvous::{RendezvousServer, ServerConfig};
use kolo_topology::{host_assignments, parse_host_list, parse_hostfile, total_slots, HostSpec, JobEnv, ENV_SECRET};
use nix::sys::signal::Signal;

use crate::cli::{EngineArg, NicsArgs, RendezvousArgs, RunArgs};
use crate::elastic::{run_elastic, ElasticSpec};
use crate::launch::{run_job, LaunchSpec};
use crate::out::{say, tell, Said};

pub async fn run(args: RunArgs, worker: crate::WorkerProgram) -> Result<i32> {
    let mut spec = launch_spec(&args)?;
    if spec.worker_program.is_none() {
        spec.worker_program = worker.program;
        spec.worker_args = worker.args;
    }
    if let Some(elastic) = elastic_spec(&args, &spec)? {
        if args.dry_run {
            bail!("--dry-run shows a fixed job: drop the elastic options (--in-place, --min-np, --max-np, --max-restarts, --host-discovery-script)");
        }
        return run_elastic_job(spec, elastic).await;
    }
    if args.dry_run {
        return dry_run(&spec).await;
    }
    let outcome = run_job(spec, stop_signal()).await?;
    report(&outcome);
    Ok(outcome.exit_code)
}

/// The elastic options, if any was given (restart mode).
fn elastic_spec(args: &RunArgs, spec: &LaunchSpec) -> Result<Option<ElasticSpec>> {
    let (np, hosts) = (spec.np, &spec.hosts);
    let elastic = args.in_place
        || args.min_np.is_some()
        || args.max_np.is_some()
        || args.max_restarts.is_some()
        || args.reset_limit.is_some()
        || args.host_discovery_script.is_some();
    if !elastic {
        return Ok(None);
    }
    let ray = args.engine == EngineArg::Ray;
    if ray && args.workers_per_host.is_some() {
        bail!("--workers-per-host is for fixed Ray jobs: an elastic job on Ray fills each node it is given");
    }
    if args.engine == EngineArg::Slurm && !kolo_exec::SlurmEngine::in_allocation() {
        bail!("an elastic job under Slurm runs inside an allocation (salloc or sbatch): kolo does not grow one it asked for");
    }
    let np = u32::try_from(np).context("-np is too large")?;
    let min_np = args.min_np.unwrap_or(np);
    let max_np = match (args.max_np, &args.host_discovery_script) {
        (Some(max), _) => max,
        (None, Some(_)) => kolo_topology::MAX_PROCESSES,
        (None, None) => np.max(min_np),
    };
    let mut config = kolo_topology::ElasticConfig::new(min_np, max_np)?;
    // in place, failures re-form the job like any change (Horovod has no
    // restart limit; --reset-limit bounds both)
    config.max_restarts = match args.in_place {
        true => args.max_restarts,
        false => Some(args.max_restarts.unwrap_or(0)),
    };
    config.reset_limit = args.reset_limit;
    config.elastic_timeout = Duration::from_secs(args.elastic_timeout);
    if let Some(range) = &args.cooldown_range {
        let (lo, hi) = range
            .split_once(':')
            .and_then(|(a, b)| Some((a.trim().parse::<f64>().ok()?, b.trim().parse::<f64>().ok()?)))
            .filter(|(a, b)| a.is_finite() && b.is_finite() && *a > 0.0 && a <= b)
            .with_context(|| format!("--cooldown-range '{range}': give MIN:MAX seconds, e.g. 10:300"))?;
        config.cooldown = Some(kolo_topology::Cooldown::new(Duration::from_secs_f64(lo), Duration::from_secs_f64(hi))?);
    }
    if !(args.discovery_interval.is_finite() && args.discovery_interval >= 0.01) {
        bail!("--discovery-interval must be at least 0.01 seconds, got {}", args.discovery_interval);
    }
    if args.slots_per_host == 0 {
        bail!("--slots-per-host must be at least 1");
    }
    Ok(Some(ElasticSpec {
        config,
        discovery: Discovery {
            // on Ray, the cluster's alive nodes, asked at every poll
            source: match args.host_discovery_script {
                None => spec.engine.host_source(
                    &spec.engine_options(),
                    kolo_topology::WorkerResources { cpus: 1, gpus: spec.gpus_per_worker },
                ),
                Some(_) => None,
            },
            script: args.host_discovery_script.clone(),
            fixed: hosts.to_vec(),
            interval: Duration::from_secs_f64(args.discovery_interval),
            slots_per_host: args.slots_per_host,
        },
        in_place: args.in_place,
    }))
}

async fn run_elastic_job(spec: LaunchSpec, elastic: ElasticSpec) -> Result<i32> {
    let outcome = match elastic.in_place {
        true => crate::in_place::run_in_place(spec, elastic, stop_signal()).await?,
        false => run_elastic(spec, elastic, stop_signal()).await?,
    };
    if let Some(last) = &outcome.last {
        if outcome.exit_code != 0 {
            report(last);
        }
    }
    if let Some(reason) = &outcome.stopped {
        tell(&format!("kolo: elastic job stopped: {reason}"));
    }
    Ok(outcome.exit_code)
}

/// Says how a job ended, on stderr.
fn report(outcome: &kolo_exec::JobOutcome) {
    if let Some(f) = &outcome.failure {
        tell(&format!("kolo: rank {} on host {} {}; it failed first, so the job was stopped", f.rank, f.host, f.cause));
        if let Some(error) = &f.error {
            // the rank's own account (PyTorch's error file): the traceback
            // says more than the last lines of stderr
            tell(&format!("kolo: rank {} raised {}", f.rank, error.message));
            for line in error.traceback.lines() {
                tell(&format!("kolo:   {line}"));
            }
        } else if !f.stderr_tail.is_empty() {
            tell(&format!("kolo: last lines of rank {}'s stderr:", f.rank));
            for line in &f.stderr_tail {
                tell(&format!("kolo:   {line}"));
            }
        }
    }
    if let Some(signal) = outcome.interrupted_by {
        tell(&format!("kolo: stopped by {}; every rank was terminated", signal.as_str()));
    }
}

fn launch_spec(args: &RunArgs) -> Result<LaunchSpec> {
    let ray = args.engine == EngineArg::Ray;
    // Ray places the workers on its nodes: a host list is an error there
    let hosts = if ray && args.hosts.is_none() && args.hostfile.is_none() { Vec::new() } else { hosts(args)? };
    if args.workers_per_host.is_some() && !ray {
        bail!("--workers-per-host places workers through Ray: use it with --engine ray");
    }
    let np = match args.np {
        Some(0) => bail!("-np must be at least 1, got 0"),
        Some(np) => np,
        // every slot of the host list; inside an allocation, whose nodes
        // are the hosts (`hosts`), every task Slurm gave
        None if args.hosts.is_some()
            || args.hostfile.is_some()
            || (matches!(args.engine, EngineArg::Auto | EngineArg::Slurm)
                && kolo_exec::SlurmEngine::in_allocation()) =>
        {
            total_slots(&hosts)
        }
        None if ray => bail!("give the number of processes with -np N"),
        None if args.min_np.is_some() => u64::from(args.min_np.unwrap_or(1)),
        None => {
            bail!("give the number of processes with -np N (and hosts with -H host1:4,host2:4)")
        }
    };
    if let Some(w) = args.workers_per_host {
        if w == 0 || np % u64::from(w) != 0 {
            bail!("--workers-per-host {w} must divide -np {np} (np/W nodes with W workers each)");
        }
    }
    if args.command.is_empty() {
        bail!("no command given; put it after '--', e.g. kolo run -np 2 -- python train.py");
    }
    if !(args.kill_grace.is_finite() && args.kill_grace >= 0.0) {
        bail!("--kill-grace must be a non-negative number of seconds, got {}", args.kill_grace);
    }
    if args.start_timeout == 0 {
        bail!("--start-timeout must be at least 1 second");
    }
    if args.placement_timeout == 0 {
        bail!("--placement-timeout must be at least 1 second");
    }
    Ok(LaunchSpec {
        command: args.command.clone(),
        hosts,
        np,
        start_timeout: Duration::from_secs(args.start_timeout),
        placement_timeout: Duration::from_secs(args.placement_timeout),
        grace: Duration::from_secs_f64(args.kill_grace),
        extra_env: extra_env(&args.export, &args.env)?,
        output: OutputOptions {
            output_dir: args.output_filename.clone(),
            timestamp: args.prefix_output_with_timestamp,
            disable_prefix: args.disable_prefix,
            first_label: 0,
        },
        require_secret: args.require_secret,
        gpus_per_worker: args.gpus_per_worker,
        engine: engine_choice(args.engine),
        ssh: SshOptions {
            port: args.ssh_port,
            identity_file: args.ssh_identity_file.clone(),
            config_file: args.ssh_config.clone(),
            options: args.ssh_options.clone(),
            connect_timeout: Some(args.start_timeout.min(30)),
        },
        nics: match &args.nics {
            Some(list) => {
                let nics: Vec<String> =
                    list.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
                if nics.is_empty() {
                    bail!("--nics '{list}': give interface names, e.g. --nics eth0,eth1");
                }
                Some(nics)
            }
            None => None,
        },
        worker_program: args.worker_program.clone(),
        worker_args: Vec::new(),
        elastic_world: false,
        workers_per_host: args.workers_per_host,
        ray: kolo_exec::RayOptions {
            address: args.ray_address.clone(),
            python: args.ray_python.clone(),
            placement_group: None,
        },
        slurm: kolo_exec::SlurmOptions {
            nodes: args.slurm_nodes,
            partition: args.slurm_partition.clone(),
            time_limit: args.slurm_time.clone(),
            extra: Vec::new(),
        },
    })
}

fn hosts(args: &RunArgs) -> Result<Vec<HostSpec>> {
    Ok(match (&args.hosts, &args.hostfile) {
        (Some(list), _) => parse_host_list(list)?,
        (None, Some(path)) => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("cannot read host file {}", path.display()))?;
            parse_hostfile(&text).with_context(|| format!("host file {}", path.display()))?
        }
        (None, None) => {
            // inside an allocation: its nodes are the hosts there are
            let allocation = match args.engine {
                EngineArg::Auto | EngineArg::Slurm => kolo_exec::SlurmEngine::allocation_hosts()?,
                _ => Vec::new(),
            };
            if allocation.is_empty() {
                let slots = u32::try_from(args.np.unwrap_or(1).max(1)).context("-np is too large")?;
                vec![HostSpec::new("localhost", slots)]
            } else {
                allocation
            }
        }
    })
}

/// `-x NAME` takes the value from here, `-x NAME=VALUE` and `--env` set it.
fn extra_env(exports: &[String], envs: &[String]) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for item in exports {
        match item.split_once('=') {
            Some((name, value)) => out.push((checked_name(name, "-x")?, value.to_string())),
            None => {
                let value = std::env::var(item).with_context(|| {
                    format!("-x {item}: {item} is not set here; use -x {item}=VALUE to give a value")
                })?;
                out.push((checked_name(item, "-x")?, value));
            }
        }
    }
    for item in envs {
        let (name, value) = item.split_once('=').with_context(|| format!("--env '{item}': expected KEY=VALUE"))?;
        out.push((checked_name(name, "--env")?, value.to_string()));
    }
    Ok(out)
}

fn checked_name(name: &str, flag: &str) -> Result<String> {
    let valid = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid {
        bail!("{flag} '{name}': not a valid variable name (letters, digits and '_', not starting with a digit)");
    }
    if name == ENV_SECRET || name.starts_with("KOLO_WORKER_") {
        bail!("{flag} {name}: kolo sets {name} itself for every job (a fresh secret each time); it cannot be given");
    }
    Ok(name.to_string())
}

/// Values chosen when the job starts, shown as such by `--dry-run`.
const CHOSEN_AT_START: [&str; 10] = [
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_GLOO_RENDEZVOUS_PORT",
    "KOLO_RENDEZVOUS_ADDR",
    "KOLO_RENDEZVOUS_PORT",
    "MASTER_ADDR",
    "MASTER_PORT",
    "JAX_COORDINATOR_ADDRESS",
    "KOLO_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "KOLO_SECRET",
];
const IFACE_VARS: [&str; 3] = ["HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME", "KOLO_IFACES"];

/// The plan the job would run, one JSON object per rank: exactly what
/// `kolo run` starts, with the values chosen at start marked `<...>`.
async fn dry_run(spec: &LaunchSpec) -> Result<i32> {
    if matches!(spec.engine, EngineChoice::Slurm) && !kolo_exec::SlurmEngine::in_allocation() {
        bail!("--dry-run cannot show where Slurm places ranks before it grants the nodes; run it inside salloc");
    }
    let mut executor = crate::launch::executor(spec).await?;
    let plan = executor.plan().await?.clone();
    let multi_node = plan.node_representatives().len() > 1;
    let ifaces = match (&spec.nics, multi_node) {
        (Some(nics), _) => nics.clone(),
        (None, true) => vec!["<detected at start>".to_string()],
        (None, false) => vec!["lo".to_string()],
    };
    let job = JobEnv { timeout_s: spec.start_timeout.as_secs(), ifaces, ..JobEnv::placeholder() };
    for (rank, worker) in plan.workers.iter().enumerate() {
        let i = &worker.ranks;
        let mut env = plan.env(rank, &job, &spec.extra_env, |name| std::env::var(name).ok());
        env.insert(ENV_SECRET.into(), String::new());
        for key in CHOSEN_AT_START {
            if let Some(value) = env.get_mut(key) {
                *value = format!("<{} chosen at start>", key.to_lowercase());
            }
        }
        if multi_node && spec.nics.is_none() {
            for key in IFACE_VARS {
                env.insert(key.into(), "<detected at start>".into());
            }
        }
        let line = serde_json::json!({
            "rank": i.rank,
            "size": i.size,
            "local_rank": i.local_rank,
            "local_size": i.local_size,
            "cross_rank": i.cross_rank,
            "cross_size": i.cross_size,
            "host": worker.host.hostname,
            "node_id": worker.host.node_id,
            "gpus": worker.gpus,
            "env": env,
        });
        if say(&line.to_string())? == Said::Closed {
            break;
        }
    }
    Ok(0)
}

/// Resolves with the first SIGINT, SIGTERM or SIGHUP kolo receives. The
/// handlers are installed on the call, not on the first poll, so a signal
/// that comes right after is not lost to the default action.
pub fn stop_signal() -> impl std::future::Future<Output = Signal> {
    use tokio::signal::unix::{signal, SignalKind};
    let streams = (signal(SignalKind::interrupt()), signal(SignalKind::terminate()), signal(SignalKind::hangup()));
    async move {
        let (Ok(int), Ok(term), Ok(hup)) = streams else {
            tracing::warn!("cannot install signal handlers; kolo will not forward SIGINT/SIGTERM");
            return std::future::pending().await;
        };
        let mut streams = StopSignals { int, term, hup };
        let signal = streams.next().await;
        // here, not where the job stops: an elastic job also stops a
        // world to re-form it, which no signal asked for
        tracing::warn!("received {}; stopping the job", signal.as_str());
        // a second one means now: no more waiting for the kill grace
        tokio::spawn(async move {
            let again = streams.next().await;
            tell(&format!("kolo: {} again; killing every rank now", again.as_str()));
            kolo_exec::hurry(again as i32);
        });
        signal
    }
}

/// The signals that ask kolo to stop.
struct StopSignals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl StopSignals {
    async fn next(&mut self) -> Signal {
        tokio::select! {
            _ = self.int.recv() => Signal::SIGINT,
            _ = self.term.recv() => Signal::SIGTERM,
            _ = self.hup.recv() => Signal::SIGHUP,
        }
    }
}

pub async fn rendezvous(args: RendezvousArgs) -> Result<i32> {
    let plan = match &args.plan {
        Some(list) => {
            let hosts = parse_host_list(list)?;
            let np = args.np.unwrap_or_else(|| total_slots(&hosts));
            host_assignments(&hosts, np, Some(np))?
        }
        None => Vec::new(),
    };
    let mut config = ServerConfig::new(std::net::SocketAddr::new(args.bind, args.port));
    config.max_body_bytes = args.max_body_bytes;
    config.max_store_bytes = args.max_store_bytes;
    config.max_keys = args.max_keys;
    config.max_connections = args.max_connections;
    config.secret = std::env::var(ENV_SECRET).ok().filter(|s| !s.is_empty());
    if args.require_secret && config.secret.is_none() {
        bail!("--require-secret needs the secret in ${ENV_SECRET}");
    }
    config.require_secret = args.require_secret;
    let stop = stop_signal();
    let server = RendezvousServer::start(config, &plan).await?;
    say(&server.addr().to_string())?;
    let signal = stop.await;
    tracing::debug!("rendezvous server stopping on {}", signal.as_str());
    server.stop().await;
    Ok(0)
}

/// `kolo nics`: one agent per host, interface detection, a line per host pair.
pub async fn nics(args: NicsArgs) -> Result<i32> {
    let hosts: Vec<HostSpec> = parse_host_list(&args.hosts)?.into_iter().map(|h| HostSpec { slots: 1, ..h }).collect();
    let ssh = SshOptions {
        port: args.ssh_port,
        identity_file: args.ssh_identity_file.clone(),
        config_file: args.ssh_config.clone(),
        options: Vec::new(),
        connect_timeout: Some(args.start_timeout.min(30)),
    };
    let mut settings = kolo_exec::Settings::default();
    settings.start_timeout = Duration::from_secs(args.start_timeout.max(1));
    settings.ssh = ssh;
    let request = kolo_exec::WorkerRequest::colocated(hosts.len() as u32, 1);
    let mut executor = match engine_choice(args.engine) {
        // host names are looked up off the async runtime
        EngineChoice::Auto => {
            tokio::task::spawn_blocking(move || kolo_exec::Executor::on_hosts(settings, request, hosts)).await??
        }
        EngineChoice::Ssh => {
            let engine = Box::new(kolo_exec::SshEngine::new(hosts, settings.ssh.clone()));
            kolo_exec::Executor::with_engine(settings, request, engine)?
        }
        EngineChoice::Slurm => {
            kolo_exec::Executor::with_engine(settings, request, Box::new(kolo_exec::SlurmEngine::from_allocation()?))?
        }
        EngineChoice::Local => {
            kolo_exec::Executor::with_engine(settings, request, Box::new(kolo_exec::LocalEngine::with_hosts(hosts)))?
        }
        EngineChoice::Ray => bail!("kolo nics probes the hosts of -H; Ray places workers itself: use ssh or local"),
    };
    let started = executor.start_workers(&[]).await;
    if let Err(e) = started {
        executor.shutdown().await;
        return Err(e.into());
    }
    let common = executor.workers().first().and_then(|w| w.env.get("KOLO_IFACES").cloned()).unwrap_or_default();
    for pair in executor.nic_report() {
        if args.json {
            let results: Vec<serde_json::Value> = pair
                .results
                .iter()
                .map(|(iface, addr, err)| serde_json::json!({"iface": iface, "addr": addr, "ok": err.is_none(), "error": err}))
                .collect();
            let line = serde_json::json!({"from": pair.from, "to": pair.to, "results": results});
            if say(&line.to_string())? == Said::Closed {
                break;
            }
        } else {
            let parts: Vec<String> = pair
                .results
                .iter()
                .map(|(iface, addr, err)| match err {
                    None => format!("{iface} ({addr}) ok"),
                    Some(e) => format!("{iface} ({addr}) failed: {e}"),
                })
                .collect();
            if say(&format!("{} -> {}: {}", pair.from, pair.to, parts.join(", ")))? == Said::Closed {
                break;
            }
        }
    }
    if args.json {
        say(&serde_json::json!({"common": common.split(',').collect::<Vec<_>>()}).to_string())?;
    } else {
        say(&format!("common: {common}"))?;
    }
    executor.shutdown().await;
    Ok(0)
}

fn engine_choice(arg: EngineArg) -> EngineChoice {
    match arg {
        EngineArg::Auto => EngineChoice::Auto,
        EngineArg::Local => EngineChoice::Local,
        EngineArg::Ssh => EngineChoice::Ssh,
        EngineArg::Slurm => EngineChoice::Slurm,
        EngineArg::Ray => EngineChoice::Ray,
    }
}
