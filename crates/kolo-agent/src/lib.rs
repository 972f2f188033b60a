//! The worker agent: the user's binary (or `kolo`) started by an engine in
//! worker mode. It dials the driver, proves it knows the job's secret,
//! reports where it runs, then takes commands: environment, an OS command
//! or a Rust executable, calls, stop. If the driver goes away, the worker
//! stops what it started and exits.

#![warn(missing_docs)]

mod command;
mod gpu;
mod handshake;
mod inspect;
pub mod nics;
mod own_output;
mod rank_dir;
mod reader;
mod reading;
mod serve;

pub use inspect::{own_progress_file, own_stall_file, py_spy_on_path};
pub use kolo_proto::launch::env;
pub use nics::PairReport;

/// The Python hooks of kolo's ranks: the `sitecustomize` of every command
/// kolo starts, whose functions `kolo.Executor`'s workers call themselves.
pub const PYTHON_HOOKS: &str = include_str!("sitecustomize.py");

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use handshake::{connect, handshake, real_hostname};
use kolo_proto::launch::{group_record, GROUP_GONE};
use kolo_proto::proto::{self, ToDriver};
use kolo_proto::registry::Registry;
use kolo_sys::guard::Guard;
use kolo_sys::process::{signal_group, stop_group};
use own_output::OwnOutput;
use serve::{heartbeat, libc_signal, serve, Calls};

/// Serves as a worker and exits if this process was started as one;
/// returns at once otherwise. Call it first thing in `main`.
pub fn serve_if_worker(registry: Registry) {
    // the driver is this program too: it names its build the same way
    kolo_proto::registry::set_build_id(registry.build_id());
    let Ok(driver) = std::env::var(env::DRIVER) else {
        return;
    };
    let code = match run_agent(Arc::new(registry), &driver) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kolo worker: {e}");
            1
        }
    };
    std::process::exit(code);
}

struct Agent {
    index: u32,
    secret: Arc<kolo_auth::Secret>,
    writer: Mutex<TcpStream>,
    /// The OS command, once started.
    command: Mutex<Option<Running>>,
    /// The guard forked at start (command jobs), until a command takes it.
    guard: Mutex<Option<Arc<Guard>>>,
    /// Where commands register their process groups with the driver
    /// (`env::GROUPS_ON_STDOUT`).
    group_registry: Option<OwnedFd>,
    started: Instant,
    last_heard_ms: AtomicU64,
    /// The id of the call running now (0: none), for its reports.
    current_call: AtomicU64,
    /// Constructors and calls queued or running, and calls cancelled
    /// before they ran.
    calls: Calls,
    /// Set while the thread that reads the driver's messages acts on one
    /// (an interface probe may take seconds): the driver is not silent then.
    not_reading: std::sync::atomic::AtomicBool,
    kill_grace: Duration,
    heartbeat_interval: Duration,
    heartbeat_timeout: Duration,
    diagnostics: Mutex<File>,
    exiting: Mutex<()>,
    own_output: Mutex<Option<OwnOutput>>,
    /// The rank's CPU use, looked at every heartbeat.
    cpu: Mutex<crate::inspect::CpuWatch>,
    /// The agents this process serves, when it serves several
    /// (`env::INDICES`): an agent that ends leaves, the last one exits.
    host: Option<Arc<Host>>,
    /// Set when this agent left a process its host's other agents still
    /// use: its threads go quiet (its connection is closed on purpose).
    left: std::sync::atomic::AtomicBool,
    /// Where this process's own collectives are recorded for the job's
    /// timeline (an executor's worker, whose calls run here), sent at exit.
    own_timeline: Mutex<Option<(crate::rank_dir::RankDir, std::path::PathBuf)>>,
}

/// The agents of one process started for several (`env::INDICES`). They
/// only start OS commands: nothing process-wide (the environment, fds 1
/// and 2) is any one agent's.
struct Host {
    agents: Mutex<Vec<Arc<Agent>>>,
    /// Agents not yet ended, and the highest exit code of those that did.
    left: Mutex<(usize, i32)>,
}

impl Host {
    /// Counts an agent out; the process's exit code once it was the last.
    fn leave(&self, code: i32) -> Option<i32> {
        let mut left = kolo_sys::lock(&self.left);
        left.0 = left.0.saturating_sub(1);
        left.1 = left.1.max(code);
        (left.0 == 0).then_some(left.1)
    }
}

/// A started command: its process group and the guard watching over it
/// (none where the driver does).
struct Running {
    group: u32,
    guard: Option<Arc<Guard>>,
    /// The command's private directory (error file, Python hook).
    dir: Option<std::path::PathBuf>,
    /// In an in-place elastic job, a rank stopped (SIGSTOP, SIGTSTP) holds
    /// every other rank's collectives while its agent goes on beating:
    /// since when the command has been seen stopped.
    stopped_since: Option<Option<Instant>>,
    /// The file the rank's Python hook counts its progress in.
    progress: Option<std::path::PathBuf>,
}

impl Running {
    /// Ends the command if it has been stopped for longer than `limit`
    /// (in-place jobs only): its peers are waiting on it, and only its end
    /// lets the driver start the next round without it. Says why, once.
    fn end_if_stopped(&mut self, limit: Duration) -> Option<String> {
        let since = self.stopped_since.as_mut()?;
        if !kolo_sys::process::is_stopped(self.group) {
            *since = None;
            return None;
        }
        let first_seen = *since.get_or_insert_with(Instant::now);
        if first_seen.elapsed() < limit {
            return None;
        }
        self.stopped_since = None;
        signal_group(self.group, Signal::SIGKILL);
        Some(format!(
            "its command (pid {}) was stopped for over {:.0} s while the other ranks waited; ending it so that \
             the job goes on without it",
            self.group,
            limit.as_secs_f64()
        ))
    }
}

impl Agent {
    /// This process records its collectives for the job's timeline (the
    /// variable set before any of the user's code runs here).
    fn record_own_timeline(&self) {
        let Some(dir) = crate::rank_dir::RankDir::create(None) else { return };
        let file = dir.path().join("timeline");
        std::env::set_var(kolo_timeline::FILE_VAR, &file);
        *kolo_sys::lock(&self.own_timeline) = Some((dir, file));
    }

    /// The rank's process: its command's, or this one (a worker that runs
    /// calls is the rank itself).
    fn rank_pid(&self) -> u32 {
        kolo_sys::lock(&self.command).as_ref().map_or(std::process::id(), |running| running.group)
    }

    /// What `kolo status` and `kolo stack` show of the rank.
    /// `stacks`: with every thread's stack (`Some(py-spy hint)`).
    fn inspect(&self, stacks: Option<Option<String>>) -> Result<kolo_proto::proto::RankSample, String> {
        let pid = self.rank_pid();
        let (mut sample, _) = crate::inspect::sample(pid)?;
        sample.cpu_percent = kolo_sys::lock(&self.cpu).percent(pid);
        if let Some(gpu) = crate::gpu::usage(pid) {
            sample.gpu_percent = Some(gpu.percent);
            sample.gpu_memory_bytes = Some(gpu.memory_bytes);
        }
        sample.progress = match kolo_sys::lock(&self.command).as_ref() {
            Some(running) => running.progress.as_deref().and_then(crate::inspect::read_progress),
            // a worker that runs calls is the rank: its own counters
            None => crate::inspect::read_own_progress(),
        };
        sample.stall = match kolo_sys::lock(&self.command).as_ref() {
            Some(running) => {
                running.dir.as_deref().and_then(|d| crate::inspect::read_stall(&crate::inspect::stall_file(d)))
            }
            None => crate::inspect::read_own_stall(),
        };
        if let Some(hint) = stacks {
            if pid == std::process::id() {
                // py-spy, a child of this process, may trace it (Yama's
                // ptrace_scope 1 lets only ancestors trace otherwise)
                // SAFETY: prctl with these arguments only sets a flag
                unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::c_ulong::from(pid), 0, 0, 0) };
            }
            // a worker's own calls come from kolo's Rust, which py-spy
            // cannot unwind into Python's frames: Python's alone there
            let native = pid != std::process::id();
            sample.stacks = Some(crate::inspect::stacks(pid, &real_hostname(), hint.as_deref(), native));
        }
        Ok(sample)
    }

    fn send(&self, message: &ToDriver) -> io::Result<()> {
        let frame = proto::encode(message)?;
        let mut writer = kolo_sys::lock(&self.writer);
        writer.write_all(&frame)
    }

    fn say(&self, text: &str) {
        if self.left.load(Ordering::SeqCst) {
            return;
        }
        // one write: the agents of a job share the terminal
        let line = format!("kolo worker {}: {text}\n", self.index);
        let _ = kolo_sys::lock(&self.diagnostics).write_all(line.as_bytes());
    }

    fn heard(&self) {
        self.last_heard_ms.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Stops the command's process group (SIGTERM, then SIGKILL after
    /// `grace`), forwards the last output and exits.
    fn exit(&self, code: i32, grace: Duration) -> ! {
        let _once = kolo_sys::lock(&self.exiting);
        if let Some((dir, file)) = kolo_sys::lock(&self.own_timeline).take() {
            command::send_timeline(self, &file);
            drop(dir);
        }
        if let Some(running) = kolo_sys::lock(&self.command).take() {
            stop_group(running.group, grace);
            // the group is gone: the guard has nothing left to do
            if let Some(guard) = running.guard.and_then(|g| Arc::try_unwrap(g).ok()) {
                guard.release();
            }
            if let Some(registry) = &self.group_registry {
                let _ = nix::unistd::write(registry, &group_record(running.group | GROUP_GONE));
            }
            // exiting ends the thread that would have removed it
            if let Some(dir) = &running.dir {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
        let _ = io::stdout().flush();
        let _ = io::stderr().flush();
        if let Some(host) = &self.host {
            let Some(code) = host.leave(code) else {
                // the driver sees this agent's end as its connection's;
                // the process stays for the host's other agents
                self.left.store(true, Ordering::SeqCst);
                let _ = kolo_sys::lock(&self.writer).shutdown(std::net::Shutdown::Both);
                loop {
                    std::thread::park();
                }
            };
            std::process::exit(code)
        }
        if let Some(own) = kolo_sys::lock(&self.own_output).take() {
            // closing our ends lets the pumps see EOF and forward the rest
            if let Ok(null) = File::open("/dev/null") {
                let _ = nix::unistd::dup2_stdout(null.as_fd());
                let _ = nix::unistd::dup2_stderr(null.as_fd());
            }
            for _ in 0..2 {
                let _ = own.pumps.recv_timeout(Duration::from_millis(500));
            }
        }
        if self.calls.pending.load(Ordering::SeqCst) > 0 {
            // the user's code runs (or is about to) on another thread (a
            // Python call): no exit handlers of its runtime may run under
            // its feet
            // SAFETY: _exit only ends the process
            unsafe { libc::_exit(code) };
        }
        std::process::exit(code)
    }
}

fn run_agent(registry: Arc<Registry>, driver: &str) -> Result<i32, String> {
    let hosted = std::env::var(env::INDICES).ok();
    let guard = match std::env::var_os(env::GUARD) {
        Some(_) if hosted.is_some() => return Err(format!("{} and {} exclude each other", env::GUARD, env::INDICES)),
        Some(_) => Some(
            Guard::spawn(kolo_sys::guard::GuardOptions { grace: Duration::ZERO, silence: None })
                .map_err(|e| format!("cannot start the guard process: {e}"))?,
        ),
        None => None,
    };
    let indices: Vec<u32> = match &hosted {
        Some(list) => list
            .split(',')
            .map(|i| i.parse().ok())
            .collect::<Option<Vec<u32>>>()
            .filter(|all| !all.is_empty())
            .ok_or_else(|| format!("{} must list worker indices, got '{list}'", env::INDICES))?,
        None => vec![std::env::var(env::INDEX)
            .ok()
            .and_then(|v| if v == env::INDEX_FROM_SLURM { std::env::var(env::INDEX_FROM_SLURM).ok() } else { Some(v) })
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{} is missing or not a number", env::INDEX))?],
    };
    let secret = match std::env::var(env::SECRET_ON_STDIN) {
        // remote engines pass the secret on stdin, out of sight of `ps`
        Ok(_) => {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).map_err(|e| format!("cannot read the job secret from stdin: {e}"))?;
            line.trim_end().to_string()
        }
        Err(_) => {
            let secret = std::env::var(env::SECRET).map_err(|_| format!("{} is not set", env::SECRET))?;
            // still one thread: the commands and calls of this worker get
            // the secret from the driver's SetEnv, not from here
            std::env::remove_var(env::SECRET);
            secret
        }
    };
    let secret = Arc::new(kolo_auth::Secret::new(secret).map_err(|e| e.to_string())?);
    // SIGTERM/SIGINT/SIGHUP stop the command cleanly; handlers (unlike a
    // blocked mask) do not pass on to the command
    let mut signals = signal_hook::iterator::Signals::new([
        libc_signal(Signal::SIGTERM),
        libc_signal(Signal::SIGINT),
        libc_signal(Signal::SIGHUP),
    ])
    .map_err(|e| format!("cannot handle signals: {e}"))?;
    let original_stderr = io::stderr().as_fd().try_clone_to_owned().map_err(|e| e.to_string())?;
    // taken before fd 1 is pointed elsewhere; close-on-exec, so a command
    // holds it only until it runs
    let mut group_registries = Vec::with_capacity(indices.len());
    for _ in &indices {
        group_registries.push(match std::env::var_os(env::GROUPS_ON_STDOUT) {
            Some(_) => Some(io::stdout().as_fd().try_clone_to_owned().map_err(|e| e.to_string())?),
            None => None,
        });
    }
    // the agent's own fd 1 and 2 go to the driver from when the user's code
    // first runs in it (`serve`): a command job never needs the two pipes
    // and threads. Until then nothing may write into the group registry
    if std::env::var_os(env::GROUPS_ON_STDOUT).is_some() {
        let null = File::options().write(true).open("/dev/null").map_err(|e| e.to_string())?;
        nix::unistd::dup2_stdout(null.as_fd()).map_err(|e| e.to_string())?;
    }
    let start = |index: u32, group_registry: Option<OwnedFd>, guard: Option<Guard>, host: Option<Arc<Host>>| {
        let diagnostics = original_stderr.try_clone().map_err(|e| e.to_string())?;
        let launch = Launch { index, secret: secret.clone(), group_registry, guard, diagnostics, host };
        start_agent(driver, launch)
    };

    if hosted.is_none() {
        let (agent, stream) = start(indices[0], group_registries.pop().flatten(), guard, None)?;
        {
            let agent = agent.clone();
            std::thread::spawn(move || {
                if let Some(signal) = signals.forever().next() {
                    agent.exit(128 + signal, agent.kill_grace);
                }
            });
        }
        if std::env::var_os(env::STDIN_LIFELINE).is_some() {
            let agent = agent.clone();
            std::thread::spawn(move || {
                let mut sink = [0u8; 256];
                while matches!(io::stdin().read(&mut sink), Ok(n) if n > 0) {}
                agent.say("its launcher is gone (stdin closed); stopping");
                agent.exit(1, agent.kill_grace);
            });
        }
        return serve(&agent, &registry, stream);
    }

    // several agents, one thread each; the last to end exits the process
    let host = Arc::new(Host { agents: Mutex::new(Vec::new()), left: Mutex::new((indices.len(), 0)) });
    std::thread::scope(|scope| {
        for (index, group_registry) in indices.iter().zip(group_registries) {
            let (host, registry, start) = (host.clone(), registry.clone(), &start);
            scope.spawn(move || match start(*index, group_registry, None, Some(host.clone())) {
                Ok((agent, stream)) => {
                    kolo_sys::lock(&host.agents).push(agent.clone());
                    let code = serve(&agent, &registry, stream).unwrap_or(1);
                    agent.exit(code, Duration::ZERO)
                }
                Err(e) => {
                    // the driver learns of it as of every agent here: the
                    // process ends, and the engine names its exit
                    eprintln!("kolo worker {index}: {e}");
                    std::process::exit(1)
                }
            });
        }
        if let Some(signal) = signals.forever().next() {
            let agents = kolo_sys::lock(&host.agents).clone();
            if agents.len() < indices.len() {
                // not every agent registered: no command has started
                std::process::exit(128 + signal);
            }
            for agent in agents {
                std::thread::spawn(move || agent.exit(128 + signal, agent.kill_grace));
            }
        }
        loop {
            std::thread::park();
        }
    })
}

/// What one agent starts with.
struct Launch {
    index: u32,
    secret: Arc<kolo_auth::Secret>,
    group_registry: Option<OwnedFd>,
    guard: Option<Guard>,
    diagnostics: OwnedFd,
    host: Option<Arc<Host>>,
}

/// Dials the driver, proves the secret and starts the agent's heartbeat.
fn start_agent(driver: &str, launch: Launch) -> Result<(Arc<Agent>, TcpStream), String> {
    let Launch { index, secret, group_registry, guard, diagnostics, host } = launch;
    let mut stream = connect(driver).map_err(|e| format!("cannot reach the driver at {driver}: {e}"))?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(kolo_sys::wait::WELCOME_WAIT)).map_err(|e| e.to_string())?;
    let welcome = handshake(&mut stream, index, &secret).map_err(|e| format!("driver {driver}: {e}"))?;
    stream.set_read_timeout(None).map_err(|e| e.to_string())?;
    let interval = Duration::from_millis(welcome.heartbeat_interval_ms.max(1));
    let timeout = Duration::from_millis(welcome.heartbeat_timeout_ms.max(1));
    let agent = Arc::new(Agent {
        index,
        secret,
        writer: Mutex::new(stream.try_clone().map_err(|e| e.to_string())?),
        command: Mutex::new(None),
        guard: Mutex::new(guard.map(Arc::new)),
        group_registry,
        started: Instant::now(),
        last_heard_ms: AtomicU64::new(0),
        current_call: AtomicU64::new(0),
        calls: Calls::default(),
        not_reading: std::sync::atomic::AtomicBool::new(false),
        kill_grace: Duration::from_millis(welcome.kill_grace_ms),
        heartbeat_interval: interval,
        heartbeat_timeout: timeout,
        diagnostics: Mutex::new(File::from(diagnostics)),
        exiting: Mutex::new(()),
        own_output: Mutex::new(None),
        cpu: Mutex::new(crate::inspect::CpuWatch::default()),
        host,
        left: std::sync::atomic::AtomicBool::new(false),
        own_timeline: Mutex::new(None),
    });
    {
        let agent = agent.clone();
        std::thread::Builder::new()
            .name(format!("kolo-beat-{index}"))
            .spawn(move || heartbeat(&agent, interval, timeout))
            .map_err(|e| format!("cannot start the heartbeat: {e}"))?;
    }
    Ok((agent, stream))
}

#[cfg(test)]
mod tests {
    /// The ranks' Python hooks run before kolo can be imported, so they
    /// spell kolo's variables out: each must be one kolo writes.
    #[test]
    fn the_python_hooks_read_only_variables_kolo_names() {
        let known: Vec<&str> = kolo_topology::env_names::ALL.iter().map(|(_, name)| *name).collect();
        let mut read = Vec::new();
        for piece in super::PYTHON_HOOKS.split('"').skip(1).step_by(2) {
            if piece.starts_with("KOLO_") && piece.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
                read.push(piece);
            }
        }
        assert!(read.contains(&"KOLO_JOB_ID"), "the parser found no variable: {read:?}");
        let unknown: Vec<&&str> = read.iter().filter(|name| !known.contains(name)).collect();
        assert!(unknown.is_empty(), "the hooks read variables kolo does not name: {unknown:?}");
    }
}
