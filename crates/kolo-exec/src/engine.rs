//! Engines place worker processes and report where they landed; everything
//! else (registration, ranks, rendezvous, env) is the driver's, the same on
//! every engine.

use std::ffi::OsString;
use std::net::IpAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use kolo_topology::{HostResources, HostSpec};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use crate::ExecError;

/// One worker process to start.
#[derive(Clone, Debug)]
pub struct WorkerLaunch {
    pub index: u32,
    pub host: HostResources,
    pub gpus: Vec<u32>,
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// Variables that put the process in worker mode (`worker::env`).
    pub env: Vec<(String, String)>,
}

pub trait Engine: Send {
    fn name(&self) -> &'static str;
    /// What the engine can place workers on.
    fn hosts(&mut self) -> Result<Vec<HostResources>, ExecError>;
    /// Where the driver listens so that every worker can reach it.
    fn driver_addr(&self) -> IpAddr;
    /// Interfaces the workers share when nothing better is known.
    fn default_nics(&self) -> Vec<String>;
    /// Starts the worker processes.
    fn spawn(&mut self, workers: Vec<WorkerLaunch>) -> Result<(), ExecError>;
    /// Workers whose process ended, with how (without blocking).
    fn exited(&mut self) -> Vec<(u32, String)>;
    /// Whether every worker process has ended.
    fn all_exited(&mut self) -> bool;
    /// Kills whatever is left of the worker processes.
    fn kill_all(&mut self);
}

/// Processes on this machine. Every host of its list is a node here: hosts
/// other than this machine are simulated nodes with their own node id, so
/// colocation, local/cross ranks and GPU sharing work on one machine.
pub struct LocalEngine {
    hosts: Vec<HostSpec>,
    children: Vec<(u32, Child)>,
}

impl LocalEngine {
    /// This machine under its host name, with one slot per CPU.
    pub fn this_machine() -> Self {
        let name =
            nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "localhost".into());
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        LocalEngine::with_hosts(vec![HostSpec::new(name, cpus)])
    }

    /// Simulated nodes: each host's slots are its CPUs, `gpus=N` its GPU ids 0..N.
    pub fn with_hosts(hosts: Vec<HostSpec>) -> Self {
        LocalEngine { hosts, children: Vec::new() }
    }
}

impl Engine for LocalEngine {
    fn name(&self) -> &'static str {
        "local"
    }

    fn hosts(&mut self) -> Result<Vec<HostResources>, ExecError> {
        Ok(self.hosts.iter().map(HostSpec::resources).collect())
    }

    fn driver_addr(&self) -> IpAddr {
        IpAddr::from([127, 0, 0, 1])
    }

    fn default_nics(&self) -> Vec<String> {
        vec!["lo".into()]
    }

    fn spawn(&mut self, workers: Vec<WorkerLaunch>) -> Result<(), ExecError> {
        for w in workers {
            let mut command = Command::new(&w.program);
            command.args(&w.args);
            for (name, _) in std::env::vars_os() {
                if !name.to_str().is_some_and(kolo_topology::forwards_caller_var) {
                    command.env_remove(&name);
                }
            }
            command.envs(w.env.iter().map(|(k, v)| (k, v)));
            // the worker's own output goes to the driver over the protocol;
            // what it prints before that (a crash at start) reaches our stderr
            command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
            command.process_group(0);
            let child = command.spawn().map_err(|source| ExecError::Io {
                what: format!("starting worker {} ({})", w.index, w.program.display()),
                source,
            })?;
            self.children.push((w.index, child));
        }
        Ok(())
    }

    fn exited(&mut self) -> Vec<(u32, String)> {
        self.children
            .iter_mut()
            .filter_map(|(index, child)| match child.try_wait() {
                Ok(Some(status)) => Some((*index, crate::process::describe(status))),
                _ => None,
            })
            .collect()
    }

    fn all_exited(&mut self) -> bool {
        self.children.iter_mut().all(|(_, child)| matches!(child.try_wait(), Ok(Some(_))))
    }

    fn kill_all(&mut self) {
        for (_, child) in &mut self.children {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
                let _ = child.wait();
            }
        }
    }
}

impl Drop for LocalEngine {
    fn drop(&mut self) {
        self.kill_all();
    }
}
