//! `kolo run` on the local engine: every host of the list is a node on this
//! machine (hosts other than this one are simulated nodes with their own
//! node id), so colocation and local/cross ranks work on one machine.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::future::Future;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use kolo_rendezvous::{RendezvousServer, ServerConfig};
use kolo_topology::{host_assignments, rank_env, HostSpec, JobEnv, Slot, ENV_SECRET};
use nix::sys::signal::Signal;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::output::{LineSplitter, OutputOptions, OutputSink, Stream};
use crate::process::{describe, exit_code, group_alive, signal_group};
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
    Ok(slots
        .into_iter()
        .map(|slot| {
            // the local engine: a host's name is its node id
            let node_id = slot.host.clone();
            let mut env = rank_env(&slot.info, &node_id, job, None);
            env.extend(spec.extra_env.iter().cloned());
            RankPlan { slot, node_id, env }
        })
        .collect())
}

/// The rank that failed first.
#[derive(Clone, Debug)]
pub struct Failure {
    pub rank: u32,
    pub host: String,
    pub cause: Cause,
    pub stderr_tail: Vec<String>,
}

/// How a rank failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cause {
    Exited(std::process::ExitStatus),
    /// The process could not be started; `code` follows the shell (127, 126).
    StartFailed {
        message: String,
        code: i32,
    },
    Lost(String),
}

impl Cause {
    /// The shell's exit code for this failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            Cause::Exited(status) => exit_code(*status),
            Cause::StartFailed { code, .. } => *code,
            Cause::Lost(_) => 1,
        }
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cause::Exited(status) => f.write_str(&describe(*status)),
            Cause::StartFailed { message, .. } => f.write_str(message),
            Cause::Lost(message) => f.write_str(message),
        }
    }
}

#[derive(Clone, Debug)]
pub struct JobOutcome {
    /// What `kolo run` exits with: 0, the first failure's code, or 128 + the
    /// signal that interrupted kolo.
    pub exit_code: i32,
    pub failure: Option<Failure>,
    pub interrupted_by: Option<Signal>,
}

/// Runs the job to its end. `interrupt` resolves when kolo is asked to stop
/// (SIGINT/SIGTERM); the job is then torn down like on a failure.
pub async fn run_job(
    spec: LaunchSpec,
    interrupt: impl Future<Output = Signal>,
) -> Result<JobOutcome, ExecError> {
    if spec.command.is_empty() {
        return Err(ExecError::NoCommand);
    }
    let secret = random_hex(16);
    let mut server_config = ServerConfig::new("127.0.0.1:0".parse().expect("literal address"));
    server_config.secret = Some(secret.clone());
    server_config.require_secret = spec.require_secret;
    let server = RendezvousServer::start(server_config, &[]).await?;
    let job = JobEnv {
        rendezvous_addr: server.addr().ip().to_string(),
        rendezvous_port: server.addr().port(),
        ifaces: vec!["lo".into()],
        timeout_s: spec.start_timeout.as_secs().max(1),
        master_addr: "127.0.0.1".into(),
        master_port: free_port()?,
        elastic: false,
        job_id: random_hex(8),
    };
    let plan = plan_job(&spec, &job)?;
    let slots: Vec<Slot> = plan.iter().map(|r| r.slot.clone()).collect();
    server.init(&slots);
    tracing::debug!(ranks = plan.len(), rendezvous = %server.addr(), "starting job");

    let sink = Arc::new(OutputSink::new(spec.output.clone(), plan.len())?);
    let mut supervisor = Supervisor::new(sink.clone(), spec.grace);
    for rank in &plan {
        if let Err(failure) = supervisor.spawn(&spec, rank, &secret) {
            supervisor.fail(failure);
            break;
        }
    }
    let outcome = supervisor.wait(interrupt).await;
    server.stop().await;
    Ok(outcome)
}

struct Supervisor {
    sink: Arc<OutputSink>,
    grace: Duration,
    /// Process group (= pid of the rank's process) of every started rank.
    groups: Vec<u32>,
    hosts: Vec<String>,
    exits: JoinSet<(u32, std::io::Result<std::process::ExitStatus>)>,
    pumps: JoinSet<()>,
    failure: Option<Failure>,
}

impl Supervisor {
    fn new(sink: Arc<OutputSink>, grace: Duration) -> Self {
        Supervisor {
            sink,
            grace,
            groups: Vec::new(),
            hosts: Vec::new(),
            exits: JoinSet::new(),
            pumps: JoinSet::new(),
            failure: None,
        }
    }

    fn spawn(&mut self, spec: &LaunchSpec, rank: &RankPlan, secret: &str) -> Result<(), Failure> {
        let program = &spec.command[0];
        let mut command = Command::new(program);
        command.args(&spec.command[1..]);
        for (name, _) in std::env::vars_os() {
            if !name
                .to_str()
                .is_some_and(kolo_topology::forwards_caller_var)
            {
                command.env_remove(&name);
            }
        }
        command.envs(&rank.env).env(ENV_SECRET, secret);
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command.process_group(0);
        let r = rank.slot.info.rank;
        let mut child = command.spawn().map_err(|e| Failure {
            rank: r,
            host: rank.slot.host.clone(),
            cause: Cause::StartFailed {
                message: format!("could not start '{}': {e}", program.to_string_lossy()),
                code: if e.kind() == std::io::ErrorKind::PermissionDenied {
                    126
                } else {
                    127
                },
            },
            stderr_tail: Vec::new(),
        })?;
        self.groups
            .push(child.id().expect("a just-spawned child has a pid"));
        self.hosts.push(rank.slot.host.clone());
        self.pump(&mut child, r);
        self.exits.spawn(async move { (r, child.wait().await) });
        Ok(())
    }

    fn pump(&mut self, child: &mut Child, rank: u32) {
        let streams: [(Option<Box<dyn tokio::io::AsyncRead + Unpin + Send>>, Stream); 2] = [
            (
                child.stdout.take().map(|s| Box::new(s) as _),
                Stream::Stdout,
            ),
            (
                child.stderr.take().map(|s| Box::new(s) as _),
                Stream::Stderr,
            ),
        ];
        for (reader, stream) in streams {
            let Some(mut reader) = reader else { continue };
            let sink = self.sink.clone();
            self.pumps.spawn(async move {
                let mut splitter = LineSplitter::default();
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = reader.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    splitter.push(&buf[..n], |line| sink.line(rank as usize, stream, line));
                }
                if let Some(rest) = splitter.finish() {
                    sink.line(rank as usize, stream, &rest);
                }
            });
        }
    }

    fn fail(&mut self, failure: Failure) {
        self.failure.get_or_insert(failure);
    }

    fn signal_all(&self, signal: Signal) {
        for &group in &self.groups {
            signal_group(group, signal);
        }
    }

    /// Waits for every rank; the first failure or an interrupt starts the
    /// teardown: SIGTERM to every group, SIGKILL after the grace period.
    async fn wait(mut self, interrupt: impl Future<Output = Signal>) -> JobOutcome {
        tokio::pin!(interrupt);
        let mut interrupted_by = None;
        let mut kill_at: Option<Instant> = None;
        if self.failure.is_some() {
            kill_at = Some(self.begin_teardown());
        }
        while !self.exits.is_empty() {
            tokio::select! {
                Some(joined) = self.exits.join_next() => {
                    let Ok((rank, status)) = joined else { continue };
                    let cause = match status {
                        Ok(status) if status.success() => continue,
                        Ok(status) => Cause::Exited(status),
                        Err(e) => Cause::Lost(format!("could not be waited for: {e}")),
                    };
                    if self.failure.is_none() && interrupted_by.is_none() {
                        let host = self.hosts[rank as usize].clone();
                        self.failure = Some(Failure { rank, host, cause, stderr_tail: Vec::new() });
                        kill_at = Some(self.begin_teardown());
                    }
                }
                signal = &mut interrupt, if interrupted_by.is_none() => {
                    tracing::warn!("received {}; stopping the job", signal.as_str());
                    interrupted_by = Some(signal);
                    if kill_at.is_none() {
                        kill_at = Some(self.begin_teardown());
                    }
                }
                _ = sleep_until_opt(kill_at) => {
                    tracing::warn!("ranks still running {:?} after SIGTERM; sending SIGKILL", self.grace);
                    self.signal_all(Signal::SIGKILL);
                    kill_at = None;
                }
            }
        }
        self.reap_stragglers().await;
        // output of escaped grandchildren holding the pipes must not hold kolo
        let drain = async { while self.pumps.join_next().await.is_some() {} };
        if tokio::time::timeout(Duration::from_secs(2), drain)
            .await
            .is_err()
        {
            self.pumps.abort_all();
        }
        let failure = self.failure.take().map(|mut f| {
            f.stderr_tail = self.sink.stderr_tail(f.rank as usize);
            f
        });
        let exit_code = match (&failure, interrupted_by) {
            (_, Some(signal)) => 128 + signal as i32,
            (Some(f), None) => f.cause.exit_code(),
            (None, None) => 0,
        };
        JobOutcome {
            exit_code,
            failure,
            interrupted_by,
        }
    }

    fn begin_teardown(&self) -> Instant {
        self.signal_all(Signal::SIGTERM);
        Instant::now() + self.grace
    }

    /// Every rank has exited; what its children left in its group goes too.
    async fn reap_stragglers(&self) {
        let alive: Vec<u32> = self
            .groups
            .iter()
            .copied()
            .filter(|&g| group_alive(g))
            .collect();
        if alive.is_empty() {
            return;
        }
        for &g in &alive {
            signal_group(g, Signal::SIGTERM);
        }
        let deadline = Instant::now() + self.grace;
        while Instant::now() < deadline && alive.iter().any(|&g| group_alive(g)) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for &g in &alive {
            signal_group(g, Signal::SIGKILL);
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn free_port() -> Result<u16, ExecError> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|source| ExecError::Io {
        what: "finding a free port".into(),
        source,
    })?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|source| ExecError::Io {
            what: "finding a free port".into(),
            source,
        })
}

fn random_hex(bytes: usize) -> String {
    use rand::RngCore;
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    buf.iter().map(|b| format!("{b:02x}")).collect()
}
