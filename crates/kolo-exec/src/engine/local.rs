//! The local engine: worker processes on this machine.

use std::io::Write;
use std::net::IpAddr;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kolo_topology::{HostResources, HostSpec};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::{Engine, WorkerLaunch};
use crate::guard::Guard;
use crate::{worker, ExecError};

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

    fn hosts(&mut self, _: Duration) -> Result<Vec<HostResources>, ExecError> {
        Ok(self.hosts.iter().map(HostSpec::resources).collect())
    }

    fn driver_addr(&self) -> IpAddr {
        IpAddr::from([127, 0, 0, 1])
    }

    fn default_nics(&self) -> Vec<String> {
        vec!["lo".into()]
    }

    fn spawn(&mut self, workers: Vec<WorkerLaunch>, janitor: &Guard) -> Result<(), ExecError> {
        for w in workers {
            let mut command = Command::new(&w.program);
            command.args(&w.args);
            for (name, _) in std::env::vars_os() {
                if !name.to_str().is_some_and(kolo_topology::forwards_caller_var) {
                    command.env_remove(&name);
                }
            }
            command.envs(w.env.iter().map(|(k, v)| (k, v)));
            command.env(worker::env::SECRET_ON_STDIN, "1");
            // the worker's own output goes to the driver over the protocol;
            // what it prints before that (a crash at start) reaches our stderr
            command.stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::inherit());
            command.process_group(0);
            let mut child = command.spawn().map_err(|source| ExecError::Io {
                what: format!("starting worker {} ({})", w.index, w.program.display()),
                source,
            })?;
            // the secret on stdin, out of sight of the environment; a line
            // fits the pipe, so this never blocks
            if let Some(mut stdin) = child.stdin.take() {
                let _ = writeln!(stdin, "{}", w.secret);
            }
            let _ = janitor.watch_group(child.id());
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
            }
        }
    }
}

impl Drop for LocalEngine {
    fn drop(&mut self) {
        self.kill_all();
        // SIGKILLed processes go at once; reaping them is quick
        for (_, child) in &mut self.children {
            let _ = child.wait();
        }
    }
}
