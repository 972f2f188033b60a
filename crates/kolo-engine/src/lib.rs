//! Engines place worker processes and report where they landed; everything
//! else (registration, ranks, rendezvous, env) is the driver's, the same on
//! every engine.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod error;
mod local;
mod ray;
mod request;
mod slurm;
mod ssh;

pub use error::ExecError;
pub use request::WorkerRequest;

pub use local::LocalEngine;
pub use ray::{BridgeHost, RayEngine, RayNodes, RayOptions, RunsBridge};
pub use slurm::{SlurmEngine, SlurmOptions};
pub use ssh::{SshEngine, SshOptions};

use std::ffi::OsString;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use kolo_topology::{HostResources, HostSpec};

use kolo_sys::guard::Guard;

/// One worker process to start, as the plan placed it.
#[derive(Clone, Debug)]
pub struct WorkerLaunch {
    /// The worker's index in creation order (its world rank).
    pub index: u32,
    /// The host it goes on, with what the plan takes of it.
    pub host: HostResources,
    /// The program to start in worker mode (this one, or `--worker-program`).
    pub program: PathBuf,
    /// Arguments for that program.
    pub args: Vec<OsString>,
    /// Variables that put the process in worker mode (`worker::env`).
    pub env: Vec<(String, String)>,
    /// The job secret: each engine passes it out of sight of `ps` and of
    /// the environment where it can (stdin), and says so where it cannot.
    pub secret: String,
    /// Between SIGTERM and SIGKILL when a command must be ended.
    pub kill_grace: Duration,
    /// The agent only starts an OS command: no code of the user's runs in
    /// it, so it may share its process with its host's other agents
    /// (`worker::env::INDICES`), where the engine starts them itself.
    pub command_only: bool,
}

/// What an engine does. The driver calls these off its async runtime
/// where they may block (`hosts`, `driver_addr`, `spawn`); `exited`,
/// `all_exited` and `kill_all` never block.
pub trait Engine: Send + Sync {
    /// The engine's name, as `EngineChoice` spells it (`local`, `ssh`, ...).
    fn name(&self) -> &'static str;
    /// What the engine can place workers on; an engine that waits for
    /// resources (a Slurm queue) gives up after `placement_timeout`.
    fn hosts(&mut self, placement_timeout: Duration) -> Result<Vec<HostResources>, ExecError>;
    /// Where the driver listens so that every worker can reach it.
    fn driver_addr(&self) -> IpAddr;
    /// Interfaces the workers share when nothing better is known.
    fn default_nics(&self) -> Vec<String>;
    /// Starts the worker processes; whatever must not outlive the driver
    /// (process groups, files, an allocation) is registered with `janitor`,
    /// which cleans it up even if the driver is killed.
    fn spawn(&mut self, workers: Vec<WorkerLaunch>, janitor: &Guard) -> Result<(), ExecError>;
    /// Whether the engine itself ends the command of an agent that dies or
    /// stops (it learns each command's process group before the command
    /// runs); agents of other engines fork a guard for that.
    fn guards_commands(&self) -> bool {
        false
    }
    /// Whether an agent whose command ended may exit while the others run.
    /// Not where the launcher takes a task that ends for a sign that the
    /// others should (srun ends the rest `WaitTime` after the first).
    fn agents_may_leave_early(&self) -> bool {
        false
    }
    /// Workers whose process ended, with how.
    fn exited(&mut self) -> Vec<(u32, String)>;
    /// Whether every worker process has ended.
    fn all_exited(&mut self) -> bool;
    /// Sends SIGKILL to whatever is left of the worker processes (reaped
    /// by later `exited`/`all_exited` calls).
    fn kill_all(&mut self);
}

/// Hosts from a source other than a script or a list (a Ray cluster's
/// nodes: `RayNodes`), for an elastic job's discovery. Blocking: called
/// off the runtime.
pub trait HostSource: Send + Sync + std::fmt::Debug {
    /// The hosts available now, with their slots.
    fn hosts(&self) -> Result<Vec<HostSpec>, ExecError>;
}

/// Which engine places the workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineChoice {
    /// Slurm inside an allocation, ssh when the host list names other
    /// machines, local processes otherwise.
    Auto,
    /// Processes on this machine.
    Local,
    /// Processes started over ssh on the listed hosts.
    Ssh,
    /// Tasks of a Slurm job step (srun), in the current allocation or a new one.
    Slurm,
    /// Workers placed on a Ray cluster (never chosen by `Auto`).
    Ray,
}

/// Every engine by its name: the one table both ways.
const ENGINE_NAMES: [(&str, EngineChoice); 5] = [
    ("auto", EngineChoice::Auto),
    ("local", EngineChoice::Local),
    ("ssh", EngineChoice::Ssh),
    ("slurm", EngineChoice::Slurm),
    ("ray", EngineChoice::Ray),
];

impl std::str::FromStr for EngineChoice {
    type Err = ExecError;
    fn from_str(name: &str) -> Result<Self, ExecError> {
        match ENGINE_NAMES.iter().find(|(n, _)| *n == name) {
            Some((_, choice)) => Ok(*choice),
            None => Err(ExecError::BadSettings(format!("engine must be auto, local, ssh, slurm or ray, got '{name}'"))),
        }
    }
}

impl std::fmt::Display for EngineChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = ENGINE_NAMES.iter().find(|(_, c)| c == self).map_or("auto", |(n, _)| n);
        f.write_str(name)
    }
}

/// How each engine reaches its machines.
#[derive(Clone, Debug, Default)]
pub struct EngineOptions {
    /// For the ssh engine.
    pub ssh: SshOptions,
    /// For the Slurm engine.
    pub slurm: SlurmOptions,
    /// For the Ray engine.
    pub ray: RayOptions,
}

impl EngineChoice {
    /// The engine `Auto` stands for with these hosts (may look host names
    /// up: call it off the async runtime).
    pub fn resolve(self, hosts: &[HostSpec]) -> EngineChoice {
        match self {
            EngineChoice::Auto if SlurmEngine::in_allocation() => EngineChoice::Slurm,
            EngineChoice::Auto if hosts.iter().all(|h| is_this_machine(&h.name)) => EngineChoice::Local,
            EngineChoice::Auto => EngineChoice::Ssh,
            other => other,
        }
    }

    /// The engine this choice stands for, resolved with `resolve` first:
    /// Slurm's allocation when inside one (the hosts of it named, if any),
    /// else one asked for, sized for
    /// the request; Ray places the request itself and takes no host list.
    pub fn engine(
        self,
        hosts: Vec<HostSpec>,
        request: &WorkerRequest,
        options: EngineOptions,
    ) -> Result<Box<dyn Engine>, ExecError> {
        Ok(match self.resolve(&hosts) {
            EngineChoice::Ray if !hosts.is_empty() => {
                return Err(ExecError::BadSettings(
                    "the Ray engine places workers on the Ray cluster's nodes itself: give no host list".into(),
                ))
            }
            EngineChoice::Ray => Box::new(RayEngine::new(options.ray, *request)),
            EngineChoice::Slurm if SlurmEngine::in_allocation() => Box::new(SlurmEngine::within_allocation(&hosts)?),
            EngineChoice::Slurm => Box::new(SlurmEngine::allocate(request.num_workers(), options.slurm)),
            EngineChoice::Ssh => Box::new(SshEngine::new(hosts, options.ssh)),
            _ => Box::new(LocalEngine::with_hosts(hosts)),
        })
    }

    /// The engine for one world (or cohort) of an elastic job, on the
    /// hosts its membership chose: as `engine`, but on Ray the hosts are
    /// node ids and the workers go there (`RayEngine::on_nodes`).
    pub fn elastic_engine(
        self,
        hosts: Vec<HostSpec>,
        request: &WorkerRequest,
        options: EngineOptions,
    ) -> Result<Box<dyn Engine>, ExecError> {
        match self {
            EngineChoice::Ray => Ok(Box::new(RayEngine::on_nodes(options.ray, *request, hosts))),
            other => other.engine(hosts, request, options),
        }
    }

    /// Where an elastic job on this engine finds its hosts when no
    /// discovery script is given: on Ray, the cluster's alive nodes with
    /// the slots workers of `resources` take; elsewhere none (the host list).
    pub fn host_source(
        self,
        options: &EngineOptions,
        resources: kolo_topology::WorkerResources,
    ) -> Option<std::sync::Arc<dyn HostSource>> {
        match self {
            EngineChoice::Ray => Some(std::sync::Arc::new(RayNodes::new(options.ray.clone(), resources))),
            _ => None,
        }
    }
}

/// Whether `host` names this machine: `localhost`, its host name, or one
/// of its addresses (looks the name up).
pub fn is_this_machine(host: &str) -> bool {
    use std::net::ToSocketAddrs;
    if host == "localhost" {
        return true;
    }
    let own = nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok());
    if own.as_deref() == Some(host) {
        return true;
    }
    let Ok(addrs) = (host, 0).to_socket_addrs() else { return false };
    let local = local_addresses();
    addrs.into_iter().any(|a| a.ip().is_loopback() || local.contains(&a.ip()))
}

/// Whether `ip` is one of this machine's own addresses (loopback included).
pub fn is_own_address(ip: IpAddr) -> bool {
    ip.is_loopback() || local_addresses().contains(&ip)
}

/// The addresses of this machine's interfaces, IPv4 and IPv6.
fn local_addresses() -> Vec<IpAddr> {
    nix::ifaddrs::getifaddrs()
        .map(|all| {
            all.filter_map(|a| {
                let a = a.address?;
                a.as_sockaddr_in()
                    .map(|v4| IpAddr::V4(v4.ip()))
                    .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
            })
            .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_are_named_once() {
        for (name, choice) in [
            ("auto", EngineChoice::Auto),
            ("local", EngineChoice::Local),
            ("ssh", EngineChoice::Ssh),
            ("slurm", EngineChoice::Slurm),
            ("ray", EngineChoice::Ray),
        ] {
            assert_eq!(name.parse::<EngineChoice>().unwrap(), choice);
            assert_eq!(choice.to_string(), name);
        }
        assert!("mpi".parse::<EngineChoice>().unwrap_err().to_string().contains("engine must be auto, local"));
    }
}
