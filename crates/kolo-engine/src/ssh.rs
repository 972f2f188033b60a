//! The SSH engine (what horovodrun does): workers started on the hosts of
//! a host list with the system `ssh` client, one session per host for all
//! of its workers, every host at once; a host that cannot be reached is
//! named with ssh's own reason. The secret travels on stdin. ssh does not
//! stop remote processes when it ends, but kolo's workers stop by
//! themselves as soon as their driver connection goes. No connection
//! sharing (ControlMaster): one session per host needs none, and it would
//! leave control sockets behind a killed driver.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, ToSocketAddrs, UdpSocket};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kolo_topology::{HostResources, HostSpec};

use super::{Engine, WorkerLaunch};
use crate::ExecError;
use kolo_proto::launch as worker;
use kolo_sys::guard::Guard;

/// How to reach the hosts.
#[derive(Clone, Debug, Default)]
pub struct SshOptions {
    /// The hosts' ssh port (`ssh -p`); none: ssh's default.
    pub port: Option<u16>,
    /// The private key to log in with (`ssh -i`).
    pub identity_file: Option<PathBuf>,
    /// An ssh client config file (`ssh -F`).
    pub config_file: Option<PathBuf>,
    /// More `-o Key=Value` options.
    pub options: Vec<String>,
    /// Seconds allowed to reach each host in the check before start.
    pub connect_timeout: Option<u64>,
}

/// Starts workers over ssh: one session per host, running its workers.
pub struct SshEngine {
    hosts: Vec<HostSpec>,
    options: SshOptions,
    /// One ssh session per host, with the indices of its workers.
    children: Vec<(Vec<u32>, Child)>,
    driver_ip: Option<IpAddr>,
    /// The last line each session wrote on stderr (ssh's reason for failing).
    last_words: Vec<Arc<Mutex<String>>>,
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
    /// An engine for these hosts; nothing is reached until it is used.
    pub fn new(hosts: Vec<HostSpec>, options: SshOptions) -> Self {
        SshEngine { hosts, options, children: Vec::new(), driver_ip: None, last_words: Vec::new() }
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
        c.args(["-o", "BatchMode=yes"]);
        if let Some(t) = self.options.connect_timeout {
            c.arg("-o").arg(format!("ConnectTimeout={t}"));
        }
        for o in &self.options.options {
            c.arg("-o").arg(o);
        }
        c.arg(host);
        c
    }
}

impl Engine for SshEngine {
    fn agents_may_leave_early(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        "ssh"
    }

    fn hosts(&mut self, _: Duration) -> Result<Vec<HostResources>, ExecError> {
        Ok(self.hosts.iter().map(HostSpec::resources).collect())
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

    /// One ssh session per host starts all of that host's workers: the
    /// remote shell reads the secret once from stdin and hands it to each.
    fn spawn(&mut self, workers: Vec<WorkerLaunch>, janitor: &Guard) -> Result<(), ExecError> {
        self.driver_ip = Some(self.driver_addr());
        let cwd = std::env::current_dir().ok();
        let secret = workers.first().map(|w| w.secret.clone()).unwrap_or_default();
        let mut hosts: Vec<&str> = Vec::new();
        for w in &workers {
            if !hosts.contains(&w.host.hostname.as_str()) {
                hosts.push(&w.host.hostname);
            }
        }
        for host in hosts {
            let mine: Vec<&WorkerLaunch> = workers.iter().filter(|w| w.host.hostname == host).collect();
            let mut script = String::from("read -r KOLO_S; ");
            if let Some(dir) = &cwd {
                script.push_str(&format!("cd {} 2>/dev/null; ", quote(&dir.to_string_lossy())));
            }
            for w in &mine {
                let mut line = String::from("printf '%s\\n' \"$KOLO_S\" | env");
                for (k, v) in &w.env {
                    line.push_str(&format!(" {k}={}", quote(v)));
                }
                line.push_str(&format!(" {}=1 {}", worker::env::SECRET_ON_STDIN, quote(&w.program.to_string_lossy())));
                for a in &w.args {
                    line.push(' ');
                    line.push_str(&quote(&a.to_string_lossy()));
                }
                script.push_str(&line);
                script.push_str(" & ");
            }
            // the session lasts as long as the host's workers
            script.push_str("wait");
            let mut child = self
                .ssh(host)
                .arg(format!("sh -c {}", quote(&script)))
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                // its own group: a Ctrl-C meant for kolo reaches kolo, which
                // tears the job down in order
                .process_group(0)
                .spawn()
                .map_err(|source| ExecError::Io { what: "running ssh (is an ssh client installed?)".into(), source })?;
            let _ = janitor.watch_group(child.id());
            if let Some(mut stdin) = child.stdin.take() {
                let _ = writeln!(stdin, "{secret}");
            }
            // pass the session's stderr on, keeping its last line for the report
            let last = Arc::new(Mutex::new(String::new()));
            if let Some(stderr) = child.stderr.take() {
                let last = last.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                        eprintln!("{line}");
                        *kolo_sys::lock(&last) = line;
                    }
                });
            }
            self.last_words.push(last);
            self.children.push((mine.iter().map(|w| w.index).collect(), child));
        }
        Ok(())
    }

    fn exited(&mut self) -> Vec<(u32, String)> {
        let mut out = Vec::new();
        for ((indices, child), last) in self.children.iter_mut().zip(&self.last_words) {
            if let Ok(Some(status)) = child.try_wait() {
                let said = kolo_sys::lock(last).trim().to_string();
                let how = if said.is_empty() {
                    format!("its ssh session {}", kolo_sys::process::describe(status))
                } else {
                    format!("its ssh session {} ({said})", kolo_sys::process::describe(status))
                };
                out.extend(indices.iter().map(|&i| (i, how.clone())));
            }
        }
        out
    }

    fn all_exited(&mut self) -> bool {
        self.children.iter_mut().all(|(_, child)| matches!(child.try_wait(), Ok(Some(_))))
    }

    fn kill_all(&mut self) {
        // the remote workers stop when their driver connection closes
        for (_, child) in &mut self.children {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
        }
    }
}

impl Drop for SshEngine {
    fn drop(&mut self) {
        self.kill_all();
        for (_, child) in &mut self.children {
            let _ = child.wait();
        }
    }
}
