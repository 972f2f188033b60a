//! `kolo run`'s arguments, translated into kolo-job's one job
//! description (`JobSpec`), which checks them.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use kolo_engine::{EngineChoice, EngineOptions, RayOptions, SlurmOptions, SshOptions};
use kolo_exec::{OutputOptions, Settings};
use kolo_job::{ElasticMode, ElasticOptions, Job, JobSpec, OptionNames, Slots, Workers};
use kolo_topology::env_names::SECRET;
use kolo_topology::{parse_host_list, parse_hostfile, HostSpec, WorkerResources};

use crate::cli::RunArgs;

/// How `kolo run`'s messages name its options.
pub(crate) const CLI_NAMES: OptionNames = OptionNames::KOLO_RUN;

/// The job `kolo run` was asked for, checked; the worker program is this
/// one unless `--worker-program` says otherwise.
pub(crate) fn job(args: &RunArgs, worker: &crate::WorkerProgram) -> Result<Job> {
    if args.command.is_empty() {
        bail!("no command given; put it after '--', e.g. kolo run -np 2 -- python train.py");
    }
    let ray = args.engine == EngineChoice::Ray;
    if args.workers_per_host.is_some() && !ray {
        bail!("--workers-per-host places workers through Ray: use it with --engine ray");
    }
    let elastic = elastic_options(args)?;
    if ray && elastic.is_some() && args.workers_per_host.is_some() {
        bail!("--workers-per-host is for fixed Ray jobs: an elastic job on Ray fills each node it is given");
    }
    let np = match args.np {
        Some(np) => Some(u32::try_from(np).map_err(|_| kolo_topology::TopologyError::TooManyProcesses(np))?),
        None => None,
    };
    let workers = match (args.workers_per_host, np) {
        (Some(w), Some(np)) => {
            if w == 0 || np % w != 0 {
                bail!("--workers-per-host {w} must divide -np {np} (np/W nodes with W workers each)");
            }
            Workers::Colocated { hosts: np / w, per_host: w }
        }
        _ => Workers::Pack(np),
    };
    if !(args.kill_grace.is_finite() && args.kill_grace >= 0.0) {
        bail!("--kill-grace must be a non-negative number of seconds, got {}", args.kill_grace);
    }
    let ssh = SshOptions {
        port: args.ssh_port,
        identity_file: args.ssh_identity_file.clone(),
        config_file: args.ssh_config.clone(),
        options: args.ssh_options.clone(),
        connect_timeout: Some(args.start_timeout.min(30)),
    };
    let mut settings = Settings::default();
    settings.start_timeout = Duration::from_secs(args.start_timeout);
    settings.placement_timeout = Duration::from_secs(args.placement_timeout);
    settings.kill_grace = Duration::from_secs_f64(args.kill_grace);
    settings.output = OutputOptions {
        output_dir: args.output_filename.clone(),
        timestamp: args.prefix_output_with_timestamp,
        disable_prefix: args.disable_prefix,
        first_label: 0,
    };
    settings.rendezvous_require_secret = args.require_secret;
    settings.nics = nics(args.nics.as_deref())?;
    settings.worker_program = args.worker_program.clone().or_else(|| worker.program.clone());
    if args.worker_program.is_none() {
        settings.worker_args = worker.args.clone();
    }
    let spec = JobSpec {
        engine: args.engine,
        hosts: hosts(args)?,
        slots: Slots::Processes,
        workers,
        resources: WorkerResources { cpus: 1, gpus: args.gpus_per_worker },
        settings,
        engine_options: EngineOptions {
            ssh,
            slurm: SlurmOptions {
                nodes: args.slurm_nodes,
                partition: args.slurm_partition.clone(),
                time_limit: args.slurm_time.clone(),
                extra: Vec::new(),
            },
            ray: RayOptions {
                address: args.ray_address.clone(),
                python: args.ray_python.clone(),
                placement_group: None,
                bridge_host: None,
            },
        },
        env: extra_env(&args.export, &args.env)?,
        elastic,
        hang_timeout_s: args.hang_timeout,
        names: CLI_NAMES,
    };
    Ok(spec.check()?)
}

/// The elastic options, if any was given.
fn elastic_options(args: &RunArgs) -> Result<Option<ElasticOptions>> {
    let elastic = args.in_place
        || args.min_np.is_some()
        || args.max_np.is_some()
        || args.max_restarts.is_some()
        || args.reset_limit.is_some()
        || args.host_discovery_script.is_some();
    if !elastic {
        return Ok(None);
    }
    let mut options = ElasticOptions::new(if args.in_place { ElasticMode::InPlace } else { ElasticMode::Restart });
    options.min_np = args.min_np;
    options.max_np = args.max_np;
    options.max_restarts = args.max_restarts;
    options.reset_limit = args.reset_limit;
    options.elastic_timeout = Duration::from_secs(args.elastic_timeout);
    if let Some(range) = &args.cooldown_range {
        let (lo, hi) = range
            .split_once(':')
            .and_then(|(a, b)| Some((a.trim().parse::<f64>().ok()?, b.trim().parse::<f64>().ok()?)))
            .and_then(|(a, b)| Some((Duration::try_from_secs_f64(a).ok()?, Duration::try_from_secs_f64(b).ok()?)))
            .with_context(|| format!("--cooldown-range '{range}': give MIN:MAX seconds, e.g. 10:300"))?;
        options.cooldown = Some((lo, hi));
    }
    options.discovery_interval = Duration::try_from_secs_f64(args.discovery_interval).with_context(|| {
        format!("--discovery-interval must be at least 0.01 seconds, got {}", args.discovery_interval)
    })?;
    options.discovery_script = args.host_discovery_script.clone();
    options.slots_per_host = args.slots_per_host;
    Ok(Some(options))
}

/// The hosts given (`-H` or `--hostfile`), if any.
fn hosts(args: &RunArgs) -> Result<Option<Vec<HostSpec>>> {
    Ok(match (&args.hosts, &args.hostfile) {
        (Some(list), _) => Some(parse_host_list(list)?),
        (None, Some(path)) => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("cannot read host file {}", path.display()))?;
            Some(parse_hostfile(&text).with_context(|| format!("host file {}", path.display()))?)
        }
        (None, None) => None,
    })
}

fn nics(list: Option<&str>) -> Result<Option<Vec<String>>> {
    let Some(list) = list else { return Ok(None) };
    let nics: Vec<String> = list.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
    if nics.is_empty() {
        bail!("--nics '{list}': give interface names, e.g. --nics eth0,eth1");
    }
    Ok(Some(nics))
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
    if name == SECRET || name.starts_with("KOLO_WORKER_") {
        bail!("{flag} {name}: kolo sets {name} itself for every job (a fresh secret each time); it cannot be given");
    }
    Ok(name.to_string())
}
