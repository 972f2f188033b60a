//! The SSH engine (what horovodrun does): workers started on the hosts of
//! a host list with the system `ssh` client, connections multiplexed per
//! host, all hosts started in parallel after a reachability check that
//! names every host it could not reach. The secret travels on stdin. ssh
//! does not stop remote processes when it ends, but kolo's workers stop by
//! themselves as soon as their driver connection goes.

use std::io::Write;
use std::net::{IpAddr, ToSocketAddrs, UdpSocket};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use kolo_topology::{HostResources, HostSpec};

use crate::engine::{Engine, WorkerLaunch};
use crate::worker;
use crate::ExecError;

/// How to reach the hosts.
#[derive(Clone, Debug, Default)]
pub struct SshOptions {
    pub port: Option<u16>,
    pub identity_file: Option<PathBuf>,
    /// An ssh client config file (`ssh -F`).
    pub config_file: Option<PathBuf>,
    /// More `-o Key=Value` options.
    pub options: Vec<String>,
    /// Seconds allowed to reach each host in the check before start.
    pub connect_timeout: Option<u64>,
}

pub struct SshEngine {
    hosts: Vec<HostSpec>,
    options: SshOptions,
    control_dir: PathBuf,
    children: Vec<(u32, Child)>,
    driver_ip: Option<IpAddr>,
    checked: bool,
}

/// The address this machine uses toward `host` (what workers there can
/// dial back to); all addresses if the route cannot be found.
pub(crate) fn route_to(host: &str, port: u16) -> IpAddr {
    let probe = || -> Option<IpAddr> {
        let target = (host, port).to_socket_addrs().ok()?.next()?;
        let socket = UdpSocket::bind(if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }).ok()?;
        socket.connect(target).ok()?;
        Some(socket.local_addr().ok()?.ip())
    };
    probe().unwrap_or(IpAddr::from([0, 0, 0, 0]))
}

/// Quotes a word for the remote shell.
fn quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

impl SshEngine {
    pub fn new(hosts: Vec<HostSpec>, options: SshOptions) -> Self {
        let control_dir = std::env::temp_dir().join(format!("kolo-ssh-{}", std::process::id()));
        SshEngine { hosts, options, control_dir, children: Vec::new(), driver_ip: None, checked: false }
    }

    fn ssh(&self, host: &str) -> Command {
        let mut c = Command::new("ssh");
        if let Some(file) = &self.options.config_file {
            c.arg("-F").arg(file);
        }
        if let Some(port) = self.options.port {
            c.arg("-p").arg(port.to_string());
        }
        if let Some(id) = &self.options.identity_file {
            c.arg("-i").arg(id);
        }
        // one connection per host, shared by its workers
        c.args(["-o", "BatchMode=yes", "-o", "ControlMaster=auto", "-o", "ControlPersist=60"]);
        c.arg("-o").arg(format!("ControlPath={}/%C", self.control_dir.display()));
        if let Some(t) = self.options.connect_timeout {
            c.arg("-o").arg(format!("ConnectTimeout={t}"));
        }
        for o in &self.options.options {
            c.arg("-o").arg(o);
        }
        c.arg(host);
        c
    }

    /// Reaches every host in parallel; names each that could not be reached.
    fn check_hosts(&mut self) -> Result<(), ExecError> {
        std::fs::create_dir_all(&self.control_dir)
            .map_err(|source| ExecError::Io { what: format!("creating {}", self.control_dir.display()), source })?;
        let mut probes = Vec::new();
        for h in &self.hosts {
            let child = self
                .ssh(&h.name)
                .arg("true")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|source| ExecError::Io { what: "running ssh (is an ssh client installed?)".into(), source })?;
            probes.push((h.name.clone(), child));
        }
        let mut unreachable = Vec::new();
        for (host, child) in probes {
            let out =
                child.wait_with_output().map_err(|source| ExecError::Io { what: format!("ssh {host}"), source })?;
            if !out.status.success() {
                let why = String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("").trim().to_string();
                unreachable.push(format!("{host} ({})", if why.is_empty() { out.status.to_string() } else { why }));
            }
        }
        if !unreachable.is_empty() {
            return Err(ExecError::Unreachable(unreachable.join(", ")));
        }
        Ok(())
    }
}

impl Engine for SshEngine {
    fn name(&self) -> &'static str {
        "ssh"
    }

    fn hosts(&mut self) -> Result<Vec<HostResources>, ExecError> {
        if !self.checked {
            self.check_hosts()?;
            self.checked = true;
        }
        Ok(self
            .hosts
            .iter()
            .map(|h| HostResources {
                hostname: h.name.clone(),
                node_id: h.name.clone(),
                cpus: h.slots,
                gpus: (0..h.gpus.unwrap_or(0)).collect(),
            })
            .collect())
    }

    fn driver_addr(&self) -> IpAddr {
        if let Some(ip) = self.driver_ip {
            return ip;
        }
        route_to(self.hosts.first().map(|h| h.name.as_str()).unwrap_or("localhost"), self.options.port.unwrap_or(22))
    }

    fn default_nics(&self) -> Vec<String> {
        Vec::new()
    }

    fn spawn(&mut self, workers: Vec<WorkerLaunch>) -> Result<(), ExecError> {
        self.driver_ip = Some(self.driver_addr());
        let cwd = std::env::current_dir().ok();
        for w in workers {
            let mut remote = String::from("exec env");
            for (k, v) in w.env.iter().filter(|(k, _)| k != worker::env::SECRET) {
                remote.push_str(&format!(" {k}={}", quote(v)));
            }
            remote.push_str(&format!(" {}=1 {}", worker::env::SECRET_ON_STDIN, quote(&w.program.to_string_lossy())));
            for a in &w.args {
                remote.push(' ');
                remote.push_str(&quote(&a.to_string_lossy()));
            }
            if let Some(dir) = &cwd {
                remote = format!("cd {} 2>/dev/null; {remote}", quote(&dir.to_string_lossy()));
            }
            let secret =
                w.env.iter().find(|(k, _)| k == worker::env::SECRET).map(|(_, v)| v.clone()).unwrap_or_default();
            let mut child = self
                .ssh(&w.host.hostname)
                .arg(remote)
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|source| ExecError::Io { what: format!("ssh {}", w.host.hostname), source })?;
            if let Some(mut stdin) = child.stdin.take() {
                let _ = writeln!(stdin, "{secret}");
            }
            self.children.push((w.index, child));
        }
        Ok(())
    }

    fn exited(&mut self) -> Vec<(u32, String)> {
        self.children
            .iter_mut()
            .filter_map(|(index, child)| match child.try_wait() {
                Ok(Some(status)) => Some((*index, format!("ssh {}", crate::process::describe(status)))),
                _ => None,
            })
            .collect()
    }

    fn all_exited(&mut self) -> bool {
        self.children.iter_mut().all(|(_, child)| matches!(child.try_wait(), Ok(Some(_))))
    }

    fn kill_all(&mut self) {
        // the remote workers stop when their driver connection closes
        for (_, child) in &mut self.children {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        self.children.clear();
    }
}

impl Drop for SshEngine {
    fn drop(&mut self) {
        self.kill_all();
        // close the shared connections
        if self.control_dir.exists() {
            for h in &self.hosts {
                let _ = self
                    .ssh(&h.name)
                    .args(["-O", "exit"])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
            let _ = std::fs::remove_dir_all(&self.control_dir);
        }
    }
}
