//! Command-line interface, with the names horovodrun and mpirun users know.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use kolo_engine::EngineChoice;

#[derive(Parser, Debug)]
#[command(name = "kolo", version, about = "Start and run data-parallel training jobs across machines")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    pub(crate) fn verbose(&self) -> bool {
        match &self.command {
            Command::Run(a) => a.verbose,
            Command::Rendezvous(a) => a.verbose,
            Command::Nics(a) => a.verbose,
            Command::Ps(_) | Command::Status(_) | Command::Stack(_) | Command::Top(_) | Command::Timeline(_) => false,
        }
    }
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Run COMMAND as N ranks of a job (like horovodrun / mpirun).
    Run(Box<RunArgs>),
    /// Serve the rendezvous key-value store on its own until stopped.
    Rendezvous(RendezvousArgs),
    /// Find the network interfaces every host can use to reach the next.
    Nics(NicsArgs),
    /// List your running jobs on this machine (job id, ranks, age, command).
    Ps(PsArgs),
    /// Show every rank of a job: host, pid, state, CPU, memory, last output.
    Status(StatusArgs),
    /// Print the Python stacks of every thread of every rank (py-spy),
    /// identical stacks merged, the ranks that differ first.
    Stack(StackArgs),
    /// Watch a job's ranks, refreshed every second (q quits).
    Top(TopArgs),
    /// Summarize a job's timeline (`kolo run --timeline FILE`): the
    /// collectives that cost most, the ranks the others waited for.
    Timeline(TimelineArgs),
}

#[derive(Args, Debug)]
pub(crate) struct TimelineArgs {
    /// The trace `kolo run --timeline` wrote.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
}

#[derive(Args, Debug)]
pub(crate) struct TopArgs {
    /// The job's id (or its start); may be left out when one job runs.
    pub job: Option<String>,
}

#[derive(Args, Debug)]
pub(crate) struct PsArgs {
    /// One JSON array instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct StatusArgs {
    /// The job's id (or its start); may be left out when one job runs.
    pub job: Option<String>,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct StackArgs {
    /// The job's id (or its start); may be left out when one job runs.
    pub job: Option<String>,
    /// Only this rank.
    #[arg(long, value_name = "R")]
    pub rank: Option<u32>,
}

#[derive(Args, Debug)]
pub(crate) struct NicsArgs {
    /// Hosts to probe: host1,host2,... (slots are ignored: one agent per host).
    #[arg(short = 'H', long = "hosts", value_name = "HOSTS")]
    pub hosts: String,
    #[arg(long, default_value = "auto", value_parser = parse_engine, value_name = "ENGINE")]
    pub engine: EngineChoice,
    #[arg(long, value_name = "FILE")]
    pub ssh_config: Option<PathBuf>,
    #[arg(long, value_name = "PORT")]
    pub ssh_port: Option<u16>,
    #[arg(long, value_name = "FILE")]
    pub ssh_identity_file: Option<PathBuf>,
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    pub start_timeout: u64,
    #[arg(long)]
    pub json: bool,
    #[arg(short, long)]
    pub verbose: bool,
}

#[derive(Args, Debug)]
pub(crate) struct RunArgs {
    /// Number of processes (horovodrun's -np); defaults to the slots of the host list.
    #[arg(short = 'n', long = "np", visible_alias = "num-proc", value_name = "N")]
    pub np: Option<u64>,
    /// Hosts and slots: host1:4,host2:4 (a host without :N has one slot).
    #[arg(short = 'H', long = "hosts", visible_alias = "host", value_name = "HOSTS", conflicts_with = "hostfile")]
    pub hosts: Option<String>,
    /// File with one host a line: 'host slots=N' or 'host:N'.
    #[arg(long = "hostfile", visible_alias = "hostfile-path", value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// Seconds to wait for every worker to start and rendezvous.
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    pub start_timeout: u64,
    /// Seconds an engine may wait for resources (Slurm's queue).
    #[arg(long, default_value_t = 100, value_name = "SECONDS")]
    pub placement_timeout: u64,
    /// Seconds between SIGTERM and SIGKILL when the job is torn down.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    pub kill_grace: f64,
    /// Also write each rank's output to DIR/rank.N/stdout and stderr.
    #[arg(long, value_name = "DIR")]
    pub output_filename: Option<PathBuf>,
    /// Start each output line with the time.
    #[arg(long)]
    pub prefix_output_with_timestamp: bool,
    /// Print output lines without the [rank]<stream>: prefix.
    #[arg(long)]
    pub disable_prefix: bool,
    /// Pass a variable to the workers: -x NAME (its value here) or -x NAME=VALUE.
    #[arg(short = 'x', value_name = "VAR[=VALUE]")]
    pub export: Vec<String>,
    /// Set a variable in the workers.
    #[arg(long = "env", value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// GPUs for each rank, out of those its host declares (host file 'gpus=N');
    /// every rank of a node sees the node's GPUs in CUDA_VISIBLE_DEVICES.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub gpus_per_worker: u32,
    /// Where workers run: auto (slurm inside an allocation, ssh when the
    /// hosts include other machines, local otherwise), local (every host a
    /// simulated node here), ssh, slurm, ray (a Ray cluster's nodes).
    #[arg(long, default_value = "auto", value_parser = parse_engine, value_name = "ENGINE")]
    pub engine: EngineChoice,
    /// The Ray cluster for --engine ray (default: RAY_ADDRESS, else the
    /// cluster running on this machine).
    #[arg(long, value_name = "ADDRESS")]
    pub ray_address: Option<String>,
    /// A Python that has Ray, to run kolo's bridge to it.
    #[arg(long, default_value = "python3", value_name = "PATH")]
    pub ray_python: PathBuf,
    /// With --engine ray: W workers on each of np/W distinct nodes (one
    /// bundle per node, STRICT_SPREAD) instead of packing one-worker
    /// bundles onto as few nodes as fit.
    #[arg(long, value_name = "W")]
    pub workers_per_host: Option<u32>,
    /// Elastic in place (Horovod's mode): when a rank fails or hosts come
    /// and go, the surviving processes keep running and join a new round
    /// with new ranks, instead of every rank starting again. For programs
    /// that use kolo-comm's elastic API or Horovod's rank_and_size.
    #[arg(long)]
    pub in_place: bool,
    /// Elastic (restart mode): the fewest processes the job runs with
    /// (default: -np); it waits for them up to --elastic-timeout.
    #[arg(long, value_name = "N")]
    pub min_np: Option<u32>,
    /// Elastic: the most processes (default: -np; all discovered slots
    /// with a discovery script).
    #[arg(long, value_name = "N")]
    pub max_np: Option<u32>,
    /// Elastic: how many times failed ranks may restart the job (torchrun's
    /// --max-restarts; host changes do not count). Default 0 unless elastic.
    #[arg(long, value_name = "N")]
    pub max_restarts: Option<u32>,
    /// Elastic: how many times the job may be re-formed for any reason
    /// (Horovod's reset limit); default: no limit.
    #[arg(long, value_name = "N")]
    pub reset_limit: Option<u32>,
    /// Elastic: a program printing the available hosts, 'host' or
    /// 'host:slots' a line; run every --discovery-interval.
    #[arg(long, value_name = "PATH")]
    pub host_discovery_script: Option<PathBuf>,
    /// Elastic: seconds between runs of the discovery script.
    #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
    pub discovery_interval: f64,
    /// Elastic: slots of a host the discovery script prints without ':slots'.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub slots_per_host: u32,
    /// Elastic: seconds a failing host stays blacklisted, MIN:MAX
    /// (1 <= MIN <= MAX <= 3600): Horovod's backoff, MIN·2^n plus up to MIN
    /// of jitter after its n-th failure, at most MAX (default: for good).
    #[arg(long, value_name = "MIN:MAX", visible_alias = "blacklist-cooldown-range")]
    pub cooldown_range: Option<String>,
    /// Elastic: seconds to wait for --min-np slots before giving up.
    #[arg(long, default_value_t = 600, value_name = "SECONDS")]
    pub elastic_timeout: u64,
    /// Nodes to ask Slurm for (with --engine slurm outside an allocation).
    #[arg(long, value_name = "N")]
    pub slurm_nodes: Option<u32>,
    /// Slurm partition for the allocation kolo asks for.
    #[arg(long, value_name = "NAME")]
    pub slurm_partition: Option<String>,
    /// Time limit of the allocation kolo asks for (Slurm's format).
    #[arg(long, value_name = "TIME")]
    pub slurm_time: Option<String>,
    /// ssh port of the hosts.
    #[arg(long, value_name = "PORT")]
    pub ssh_port: Option<u16>,
    /// ssh identity file.
    #[arg(long, value_name = "FILE")]
    pub ssh_identity_file: Option<PathBuf>,
    /// ssh client config file (ssh -F).
    #[arg(long, value_name = "FILE")]
    pub ssh_config: Option<PathBuf>,
    /// More ssh options, as for ssh -o (repeatable).
    #[arg(long = "ssh-option", value_name = "KEY=VALUE")]
    pub ssh_options: Vec<String>,
    /// Network interfaces for the workers' traffic (comma-separated),
    /// instead of detecting the ones all hosts share.
    #[arg(long, value_name = "IFACES")]
    pub nics: Option<String>,
    /// The program to start as the worker agent on every host (default:
    /// this kolo, at the same path).
    #[arg(long, value_name = "PATH")]
    pub worker_program: Option<PathBuf>,
    /// Print the plan, one JSON object per rank, instead of running.
    #[arg(long)]
    pub dry_run: bool,
    /// End the job with a report (who holds it back, every rank's stacks)
    /// when no rank has made progress (a collective, a step, a line of
    /// output) for this many seconds.
    #[arg(long, value_name = "SECONDS")]
    pub hang_timeout: Option<f64>,
    /// Record every rank's collectives (Horovod's tensors, the torch
    /// backend's calls, kolo-comm's) and write the whole job's timeline to
    /// FILE at its end, the hosts' clocks aligned: Chrome's trace format,
    /// for Perfetto or chrome://tracing; `kolo timeline FILE` summarizes it.
    #[arg(long, value_name = "FILE")]
    pub timeline: Option<PathBuf>,
    /// Make the rendezvous server refuse requests without the job secret
    /// (only for jobs whose workers all use kolo's clients).
    #[arg(long)]
    pub require_secret: bool,
    /// Write how the job ended to FILE as JSON (exit code, the first
    /// failure, why an elastic job stopped): what horovodrun's Python API
    /// (`horovod.runner.launch._run`) raises its errors from.
    #[arg(long, value_name = "FILE", hide = true)]
    pub outcome_file: Option<PathBuf>,
    #[arg(short, long)]
    pub verbose: bool,
    /// The command each rank runs.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Engines by the names kolo-exec knows them by.
fn parse_engine(name: &str) -> Result<EngineChoice, kolo_engine::ExecError> {
    name.parse()
}

#[derive(Args, Debug)]
pub(crate) struct RendezvousArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub bind: std::net::IpAddr,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Size the scopes from this host list (host1:2,host2:2).
    #[arg(long, value_name = "HOSTS")]
    pub plan: Option<String>,
    /// Ranks in the plan (default: all slots of --plan).
    #[arg(long = "np", short = 'n', requires = "plan")]
    pub np: Option<u64>,
    /// Largest value a PUT may store.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Most bytes the store holds in all (keys and values).
    #[arg(long, default_value_t = 256 << 20)]
    pub max_store_bytes: usize,
    /// Most keys the store holds.
    #[arg(long, default_value_t = 256 * 1024)]
    pub max_keys: usize,
    /// Most connections served at once.
    #[arg(long, default_value_t = 16384)]
    pub max_connections: usize,
    /// Refuse requests without the secret given in $KOLO_SECRET.
    #[arg(long)]
    pub require_secret: bool,
    /// Write how the job ended to FILE as JSON (exit code, the first
    /// failure, why an elastic job stopped): what horovodrun's Python API
    /// (`horovod.runner.launch._run`) raises its errors from.
    #[arg(long, value_name = "FILE", hide = true)]
    pub outcome_file: Option<PathBuf>,
    #[arg(short, long)]
    pub verbose: bool,
}

/// `-np 4` is what horovodrun and mpirun users type; clap knows `--np`.
/// Only options before the command are touched.
pub(crate) fn normalize_args(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut in_command = false;
    for arg in args {
        if arg == "--" {
            in_command = true;
        }
        if !in_command && arg == "-np" {
            out.push(OsString::from("--np"));
        } else if let Some(rest) = arg.to_str().and_then(|s| s.strip_prefix("-np=")).filter(|_| !in_command) {
            out.push(OsString::from(format!("--np={rest}")));
        } else {
            out.push(arg);
        }
    }
    out
}
