//! How a job runs ([`Settings`]); what it asks for is kolo-engine's
//! [`WorkerRequest`](kolo_engine::WorkerRequest).

use std::path::PathBuf;
use std::time::Duration;

use crate::output::OutputOptions;

/// How a job runs. `Settings::default()` gives upstream's defaults and a
/// fresh secret.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Workers must connect and register within this (upstream `timeout_s`).
    pub start_timeout: Duration,
    /// Engines that can wait for resources (a Slurm queue) give up after
    /// this (upstream `placement_group_timeout_s`).
    pub placement_timeout: Duration,
    /// Interfaces to use instead of detecting them.
    pub nics: Option<Vec<String>>,
    /// How [`Executor::on_hosts`](crate::Executor::on_hosts) reaches other machines (identity file,
    /// port, config file, options).
    pub ssh: kolo_engine::SshOptions,
    /// How often driver and workers send heartbeats.
    pub heartbeat_interval: Duration,
    /// A worker silent this long is reported lost (and a worker whose
    /// driver is silent this long exits).
    pub heartbeat_timeout: Duration,
    /// Between SIGTERM and SIGKILL when stopping executables.
    pub kill_grace: Duration,
    /// How the ranks' output is written (prefixes, time, files).
    pub output: OutputOptions,
    /// The program started in worker mode (default: this binary).
    pub worker_program: Option<PathBuf>,
    /// Arguments of the worker program (an interpreter's module to run).
    pub worker_args: Vec<String>,
    /// The rendezvous server refuses requests without the job secret.
    pub rendezvous_require_secret: bool,
    /// What the workers are told of the elastic job they are part of.
    pub elastic: Option<kolo_topology::ElasticEnv>,
    /// The job these workers join (an in-place job's later cohorts): they
    /// meet on its store, under its id, over its interfaces.
    pub shared: Option<SharedJob>,
    secret: String,
}

/// What a job's later executors share with its first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedJob {
    /// The first executor's rendezvous server.
    pub rendezvous: std::net::SocketAddr,
    /// torch's store (`MASTER_ADDR:MASTER_PORT`): the ranks of every
    /// executor meet on the first's, which lets the later ones' hosts in.
    pub torch_store: SharedTorchStore,
    /// The job's id, which every cohort's ranks are given.
    pub job_id: String,
    /// The network interfaces the job uses (not detected again).
    pub ifaces: Vec<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            start_timeout: Duration::from_secs(30),
            placement_timeout: Duration::from_secs(100),
            nics: None,
            ssh: kolo_engine::SshOptions::default(),
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(5),
            kill_grace: Duration::from_secs(5),
            output: OutputOptions::default(),
            worker_program: None,
            worker_args: Vec::new(),
            rendezvous_require_secret: false,
            elastic: None,
            shared: None,
            secret: random_hex(32),
        }
    }
}

impl Settings {
    /// Replaces the job secret (a fresh one is made by default).
    pub fn with_secret(mut self, secret: impl Into<String>) -> Self {
        self.secret = secret.into();
        self
    }

    /// A fresh random secret, for jobs of several executors that must
    /// trust each other's workers (an in-place elastic job's cohorts).
    pub fn generate_secret() -> String {
        random_hex(32)
    }

    pub(crate) fn secret(&self) -> &str {
        &self.secret
    }
}

pub(crate) fn random_hex(bytes: usize) -> String {
    use rand::RngCore;
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// The first executor's torch store, held by every executor of the job.
#[derive(Clone)]
pub struct SharedTorchStore(pub(crate) std::sync::Arc<kolo_rendezvous::TorchStoreServer>);

impl std::fmt::Debug for SharedTorchStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedTorchStore({})", self.0.addr())
    }
}

impl PartialEq for SharedTorchStore {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for SharedTorchStore {}
