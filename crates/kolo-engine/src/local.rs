//! The local engine: worker processes on this machine.

use std::collections::HashSet;
use std::io::Write;
use std::net::IpAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kolo_topology::{HostResources, HostSpec};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::{Engine, WorkerLaunch};
use crate::ExecError;
use kolo_proto::launch::{self as worker, take_records, Record};
use kolo_sys::guard::{GroupWriter, Guard};
use kolo_sys::process;

/// Processes on this machine. Every host of its list is a node here: hosts
/// other than this machine are simulated nodes with their own node id, so
/// colocation, local/cross ranks and GPU sharing work on one machine.
pub struct LocalEngine {
    hosts: Vec<HostSpec>,
    /// Each process with the workers (indices) it serves.
    children: Vec<(Vec<u32>, Child)>,
    /// Threads still watching or ending commands (`CommandWatch`): the
    /// workers are not all gone before they are done.
    watching: Arc<AtomicUsize>,
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
        LocalEngine { hosts, children: Vec::new(), watching: Arc::new(AtomicUsize::new(0)) }
    }
}

impl Engine for LocalEngine {
    fn agents_may_leave_early(&self) -> bool {
        true
    }

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
        let mut registries = Vec::with_capacity(workers.len());
        let grace = workers.first().map_or(Duration::ZERO, |w| w.kill_grace);
        for group in sharing_a_process(workers) {
            let w = &group[0];
            let indices: Vec<u32> = group.iter().map(|w| w.index).collect();
            let mut command = Command::new(&w.program);
            command.args(&w.args);
            for (name, _) in std::env::vars_os() {
                if !name.to_str().is_some_and(kolo_topology::forwards_caller_var) {
                    command.env_remove(&name);
                }
            }
            command.envs(w.env.iter().map(|(k, v)| (k, v)));
            if indices.len() > 1 {
                let list = indices.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
                command.env_remove(worker::env::INDEX).env(worker::env::INDICES, list);
            }
            command.env(worker::env::SECRET_ON_STDIN, "1").env(worker::env::GROUPS_ON_STDOUT, "1");
            // the worker's own output goes to the driver over the protocol;
            // what it prints before that (a crash at start) reaches our
            // stderr; its stdout carries its commands' process groups
            command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
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
            if let Some(stdout) = child.stdout.take() {
                registries.push(Registered::new(OwnedFd::from(stdout), indices.len()));
            }
            self.children.push((indices, child));
        }
        let watch =
            CommandWatch { registries, janitor: janitor.group_writer().ok(), grace, busy: Busy::enter(&self.watching) };
        std::thread::Builder::new()
            .name("kolo-command-watch".into())
            .spawn(move || watch.run())
            .map_err(|source| ExecError::Io { what: "starting the command watcher".into(), source })?;
        Ok(())
    }

    fn guards_commands(&self) -> bool {
        true
    }

    fn exited(&mut self) -> Vec<(u32, String)> {
        self.children
            .iter_mut()
            .filter_map(|(indices, child)| match child.try_wait() {
                Ok(Some(status)) => Some(indices.iter().map(move |i| (*i, kolo_sys::process::describe(status)))),
                _ => None,
            })
            .flatten()
            .collect()
    }

    fn all_exited(&mut self) -> bool {
        self.children.iter_mut().all(|(_, child)| matches!(child.try_wait(), Ok(Some(_))))
            && self.watching.load(Ordering::Acquire) == 0
    }

    fn kill_all(&mut self) {
        for (_, child) in &mut self.children {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            }
        }
    }
}

/// The workers in the processes that serve them: the agents of one node
/// that only start OS commands share one (one exec and one start-up
/// instead of one per rank: most of what starting a job of small commands
/// costs); any other agent has its own (the user's code runs in it).
fn sharing_a_process(workers: Vec<WorkerLaunch>) -> Vec<Vec<WorkerLaunch>> {
    let mut groups: Vec<Vec<WorkerLaunch>> = Vec::new();
    // a command agent's launch but for its index -> its group
    let mut group_of: std::collections::HashMap<_, usize> = std::collections::HashMap::new();
    for w in workers {
        if !w.command_only {
            groups.push(vec![w]);
            continue;
        }
        let env: Vec<(String, String)> = w.env.iter().filter(|(k, _)| k != worker::env::INDEX).cloned().collect();
        let key = (w.host.node_id.clone(), w.program.clone(), w.args.clone(), w.secret.clone(), env);
        match group_of.get(&key) {
            Some(&at) => groups[at].push(w),
            None => {
                group_of.insert(key, groups.len());
                groups.push(vec![w]);
            }
        }
    }
    groups
}

/// Ends the commands of agents that die: each agent's command registers
/// its process group on the agent's stdout before it runs (and the agent
/// says when the group is gone; `worker::group_record`), so when an agent's stdout closes with a
/// group still registered, the agent died (or was killed, stopped) without
/// ending it, and this does. The janitor learns the groups too, for when
/// the driver itself is killed.
struct CommandWatch {
    registries: Vec<Registered>,
    janitor: Option<GroupWriter>,
    grace: Duration,
    busy: Busy,
}

/// Counts a thread as busy while it lives.
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn enter(count: &Arc<AtomicUsize>) -> Busy {
        count.fetch_add(1, Ordering::AcqRel);
        Busy(count.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl CommandWatch {
    fn run(self) {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut open = self.registries;
        while !open.is_empty() {
            let ready: Vec<bool> = {
                let mut fds: Vec<PollFd> = open.iter().map(|r| PollFd::new(r.fd.as_fd(), PollFlags::POLLIN)).collect();
                if let Err(e) = poll(&mut fds, PollTimeout::NONE) {
                    if e == nix::errno::Errno::EINTR {
                        continue;
                    }
                    return;
                }
                fds.iter().map(|fd| fd.revents().is_some_and(|r| !r.is_empty())).collect()
            };
            let mut closed = Vec::new();
            for (at, Registered { fd, pending, groups, trusted, dirs, most }) in
                open.iter_mut().enumerate().filter(|(at, _)| ready[*at])
            {
                let mut buf = [0u8; 512];
                match nix::unistd::read(fd.as_fd(), &mut buf) {
                    Ok(0) | Err(_) => closed.push(at),
                    Ok(n) => {
                        pending.extend_from_slice(&buf[..n]);
                        for record in take_records(pending, trusted) {
                            match record {
                                Record::Group(group) if groups.len() < *most => {
                                    groups.insert(group);
                                    if let Some(janitor) = &self.janitor {
                                        let _ = janitor.watch_group(group);
                                    }
                                }
                                Record::Group(_) => {}
                                Record::Gone(group) => {
                                    groups.remove(&group);
                                }
                                Record::Dir(dir) if dirs.len() < *most => dirs.push(dir),
                                Record::Dir(_) => {}
                            }
                        }
                    }
                }
            }
            for at in closed.into_iter().rev() {
                let Registered { groups, dirs, .. } = open.swap_remove(at);
                // what a dead agent leaves of its ranks' private directories
                for dir in dirs {
                    let _ = std::fs::remove_dir_all(dir);
                }
                if !groups.is_empty() {
                    let (grace, busy) = (self.grace, Busy::enter(&self.busy.0));
                    std::thread::spawn(move || {
                        groups.into_iter().for_each(|group| process::stop_group(group, grace));
                        drop(busy);
                    });
                }
            }
        }
    }
}

/// One agent's registry as the watcher reads it.
struct Registered {
    fd: OwnedFd,
    /// Bytes of a record not yet whole.
    pending: Vec<u8>,
    groups: HashSet<u32>,
    /// False once it sent something that is not a record.
    trusted: bool,
    dirs: Vec<std::path::PathBuf>,
    /// Groups (and directories) it may register: a bound for a registry
    /// that misbehaves, generous for the commands of its agents.
    most: usize,
}

impl Registered {
    fn new(fd: OwnedFd, agents: usize) -> Self {
        let most = 64 * agents.max(1);
        Registered { fd, pending: Vec::new(), groups: HashSet::new(), trusted: true, dirs: Vec::new(), most }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::time::Instant;

    /// A process group (a shell and its background sleeper), as a rank's
    /// command would be.
    fn command_group() -> Child {
        let child = Command::new("sh").args(["-c", "sleep 1000 & wait"]).process_group(0).spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while running_members(child.id()) < 2 {
            assert!(Instant::now() < deadline, "the shell did not start its sleeper");
            std::thread::sleep(Duration::from_millis(5));
        }
        child
    }

    fn watch(records: &[u8]) -> (Arc<AtomicUsize>, std::thread::JoinHandle<()>) {
        let (read, write) = nix::unistd::pipe().unwrap();
        nix::unistd::write(&write, records).unwrap();
        // the agent's end closes: it died
        drop(write);
        let watching = Arc::new(AtomicUsize::new(0));
        let watch = CommandWatch {
            registries: vec![Registered::new(read, 1)],
            janitor: None,
            grace: Duration::from_secs(1),
            busy: Busy::enter(&watching),
        };
        (watching.clone(), std::thread::spawn(move || watch.run()))
    }

    /// Processes of the group that still run (a zombie has ended: this
    /// sandbox's init may not reap the sleeper once its shell is gone).
    fn running_members(pgid: u32) -> usize {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("stat")).ok())
            .filter(|stat| {
                let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, r)| r).split_whitespace().collect();
                fields.len() > 2 && fields[0] != "Z" && fields[2] == pgid.to_string()
            })
            .count()
    }

    fn wait_idle(watching: &AtomicUsize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while watching.load(Ordering::Acquire) != 0 {
            assert!(Instant::now() < deadline, "the watcher did not finish");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_dead_agents_registered_command_group_is_ended() {
        let mut group = command_group();
        let (watching, thread) = watch(&worker::group_record(group.id()));
        thread.join().unwrap();
        wait_idle(&watching);
        let deadline = Instant::now() + Duration::from_secs(10);
        while running_members(group.id()) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let left = running_members(group.id());
        process::signal_group(group.id(), Signal::SIGKILL);
        group.wait().unwrap();
        assert_eq!(left, 0, "the command's group outlived its agent");
    }

    #[test]
    fn a_dead_agents_rank_directory_is_removed_and_other_paths_are_not() {
        let base = tempfile::tempdir().unwrap();
        let rank_dir = base.path().join("kolo-rank-test");
        std::fs::create_dir_all(rank_dir.join("python")).unwrap();
        std::fs::write(rank_dir.join("python/sitecustomize.py"), "").unwrap();
        let other = base.path().join("precious");
        std::fs::create_dir(&other).unwrap();
        let mut records = worker::dir_record(&rank_dir).unwrap();
        records.extend(worker::dir_record(&other).unwrap());
        records.extend(worker::dir_record(std::path::Path::new("kolo-rank-relative")).unwrap());
        let (watching, thread) = watch(&records);
        thread.join().unwrap();
        wait_idle(&watching);
        assert!(!rank_dir.exists(), "the rank's directory outlived its agent");
        assert!(other.exists(), "a path that is no rank's directory was removed");
    }

    #[test]
    fn a_group_its_agent_reported_gone_and_garbage_are_left_alone() {
        let (mut gone, mut garbage) = (command_group(), command_group());
        let mut records = worker::group_record(gone.id()).to_vec();
        records.extend_from_slice(&worker::group_record(gone.id() | worker::GROUP_GONE));
        // what a runtime might print on the agent's stdout before the agent runs
        records.extend_from_slice(format!("hello {}\n", garbage.id()).as_bytes());
        records.extend_from_slice(&worker::group_record(garbage.id()));
        let (watching, thread) = watch(&records);
        thread.join().unwrap();
        wait_idle(&watching);
        let alive = (running_members(gone.id()) == 2, running_members(garbage.id()) == 2);
        for child in [&mut gone, &mut garbage] {
            process::signal_group(child.id(), Signal::SIGKILL);
            child.wait().unwrap();
        }
        assert_eq!(alive, (true, true), "a group was ended that its agent had not left behind");
    }
}
