//! The worker agent: the user's binary (or `kolo`) started by an engine in
//! worker mode. It dials the driver, proves it knows the job's secret,
//! reports where it runs, then takes commands: environment, an OS command
//! or a Rust executable, calls, stop. If the driver goes away, the worker
//! stops what it started and exits.

mod command;
mod rank_dir;
mod reader;
mod reading;

use std::any::Any;
use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::guard::Guard;
use crate::process::{signal_group, stop_group};
use crate::proto::{
    self, CallKind, Challenge, HelloBody, HelloHeader, ToDriver, ToWorker, Welcome, MAGIC, PROTOCOL_VERSION,
};
use crate::registry::{Registry, ReportError, Reporter, WorkerContext};
use reader::FrameReader;
use reading::Reading;

/// Variables an engine sets to start a process in worker mode.
pub mod env {
    /// `host:port` of the driver's control socket.
    pub const DRIVER: &str = "KOLO_WORKER_DRIVER";
    /// The worker's index in creation order (its world rank).
    pub const INDEX: &str = "KOLO_WORKER_INDEX";
    /// Set instead of `INDEX` by an engine that starts one process for
    /// several agents of a host (the local engine, for OS commands):
    /// their indices, comma-separated. Each agent keeps its own
    /// connection; one exec and one runtime start serve them all.
    pub const INDICES: &str = "KOLO_WORKER_INDICES";
    /// The job secret, for engines that cannot pass it on stdin (Slurm).
    pub use kolo_topology::ENV_SECRET as SECRET;
    /// `INDEX` set to this means: the index is Slurm's task id (`SLURM_PROCID`).
    pub const INDEX_FROM_SLURM: &str = "SLURM_PROCID";
    /// Set when the secret comes on the first line of stdin instead.
    pub const SECRET_ON_STDIN: &str = "KOLO_WORKER_SECRET_ON_STDIN";
    /// Set for command jobs: the agent forks its guard first thing, while
    /// it is still one small thread (the cheapest fork there is).
    pub const GUARD: &str = "KOLO_WORKER_GUARD";
    /// Set by an engine that guards commands itself (the local engine):
    /// the agent's stdout is a pipe to the driver, on which each command
    /// says "my group is N" before it runs, and the agent "N is gone".
    pub const GROUPS_ON_STDOUT: &str = "KOLO_WORKER_GROUPS_ON_STDOUT";
    /// Set by an engine whose launcher holds the agent's stdin open for as
    /// long as the agent may run (Ray's actors): end of file on stdin means
    /// the launcher is gone, and the agent stops as if the driver were.
    pub const STDIN_LIFELINE: &str = "KOLO_WORKER_STDIN_LIFELINE";
}

/// Serves as a worker and exits if this process was started as one;
/// returns at once otherwise. Call it first thing in `main`.
pub fn serve_if_worker(registry: Registry) {
    // the driver is this program too: it names its build the same way
    crate::registry::set_build_id(registry.build_id());
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
        let mut left = crate::lock(&self.left);
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
        if !crate::process::is_stopped(self.group) {
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

/// Records on the group registry: this tag, then a process group
/// (big-endian) with `GROUP_GONE` set once the group is gone. The tag keeps
/// anything else written to the agent's stdout (by a runtime starting up
/// before the agent) from passing for a record.
pub(crate) const GROUP_TAG: [u8; 4] = *b"kolo";
pub(crate) const GROUP_GONE: u32 = 1 << 31;

/// A rank's private directory: this tag, the path's length (big-endian)
/// and the path, in one write no longer than a pipe writes whole.
pub(crate) const DIR_TAG: [u8; 4] = *b"kdir";
pub(crate) const MAX_DIR_RECORD: usize = 4096 - 8;

pub(crate) fn dir_record(dir: &std::path::Path) -> Option<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let path = dir.as_os_str().as_bytes();
    if path.len() > MAX_DIR_RECORD {
        return None;
    }
    let mut record = DIR_TAG.to_vec();
    record.extend_from_slice(&(path.len() as u32).to_be_bytes());
    record.extend_from_slice(path);
    Some(record)
}

pub(crate) fn group_record(group: u32) -> [u8; 8] {
    let mut record = [0u8; 8];
    record[..4].copy_from_slice(&GROUP_TAG);
    record[4..].copy_from_slice(&group.to_be_bytes());
    record
}

/// The agent's own stdout/stderr, redirected into pipes that are forwarded.
struct OwnOutput {
    pumps: mpsc::Receiver<()>,
}

impl Agent {
    /// The rank's process: its command's, or this one (a worker that runs
    /// calls is the rank itself).
    fn rank_pid(&self) -> u32 {
        crate::lock(&self.command).as_ref().map_or(std::process::id(), |running| running.group)
    }

    /// What `kolo status` and `kolo stack` show of the rank.
    /// `stacks`: with every thread's stack (`Some(py-spy hint)`).
    fn inspect(&self, stacks: Option<Option<String>>) -> Result<crate::proto::RankSample, String> {
        let pid = self.rank_pid();
        let (mut sample, _) = crate::inspect::sample(pid)?;
        sample.cpu_percent = crate::lock(&self.cpu).percent(pid);
        if let Some(gpu) = crate::gpu::usage(pid) {
            sample.gpu_percent = Some(gpu.percent);
            sample.gpu_memory_bytes = Some(gpu.memory_bytes);
        }
        sample.progress = match crate::lock(&self.command).as_ref() {
            Some(running) => running.progress.as_deref().and_then(crate::inspect::read_progress),
            // a worker that runs calls is the rank: its own counters
            None => crate::inspect::read_own_progress(),
        };
        sample.stall = match crate::lock(&self.command).as_ref() {
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
        let mut writer = crate::lock(&self.writer);
        writer.write_all(&frame)
    }

    fn say(&self, text: &str) {
        if self.left.load(Ordering::SeqCst) {
            return;
        }
        // one write: the agents of a job share the terminal
        let line = format!("kolo worker {}: {text}\n", self.index);
        let _ = crate::lock(&self.diagnostics).write_all(line.as_bytes());
    }

    fn heard(&self) {
        self.last_heard_ms.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Stops the command's process group (SIGTERM, then SIGKILL after
    /// `grace`), forwards the last output and exits.
    fn exit(&self, code: i32, grace: Duration) -> ! {
        let _once = crate::lock(&self.exiting);
        if let Some(running) = crate::lock(&self.command).take() {
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
                let _ = crate::lock(&self.writer).shutdown(std::net::Shutdown::Both);
                loop {
                    std::thread::park();
                }
            };
            std::process::exit(code)
        }
        if let Some(own) = crate::lock(&self.own_output).take() {
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

/// Attempts to reach the driver, and the pause between them: a driver
/// that listens before it spawns is reached at once; these ride out a
/// network that is slow to come up (5 s in all).
const CONNECT_ATTEMPTS: u32 = 50;
const CONNECT_PAUSE: Duration = Duration::from_millis(100);

fn connect(driver: &str) -> io::Result<TcpStream> {
    let mut attempt = 1;
    loop {
        match TcpStream::connect(driver) {
            Ok(stream) => return Ok(stream),
            Err(e) if attempt >= CONNECT_ATTEMPTS => return Err(e),
            Err(_) => attempt += 1,
        }
        std::thread::sleep(CONNECT_PAUSE);
    }
}

fn run_agent(registry: Arc<Registry>, driver: &str) -> Result<i32, String> {
    let hosted = std::env::var(env::INDICES).ok();
    let guard = match std::env::var_os(env::GUARD) {
        Some(_) if hosted.is_some() => return Err(format!("{} and {} exclude each other", env::GUARD, env::INDICES)),
        Some(_) => Some(
            Guard::spawn(crate::guard::GuardOptions { grace: Duration::ZERO, silence: None })
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
                    crate::lock(&host.agents).push(agent.clone());
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
            let agents = crate::lock(&host.agents).clone();
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
    stream.set_read_timeout(Some(crate::wait::WELCOME_WAIT)).map_err(|e| e.to_string())?;
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

fn handshake(stream: &mut TcpStream, index: u32, secret: &kolo_auth::Secret) -> Result<Welcome, String> {
    let challenge = Challenge::parse(&proto::read_frame(stream, proto::MAX_PREAUTH_FRAME).map_err(|e| e.to_string())?)
        .ok_or("not a kolo driver")?;
    if challenge.magic != MAGIC {
        return Err("not a kolo driver".into());
    }
    let nonce = kolo_auth::nonce();
    let body = HelloBody {
        hostname: real_hostname(),
        pid: std::process::id(),
        build_id: crate::registry::build_id(),
        interfaces: crate::nics::interface_names(),
    };
    let body = postcard::to_stdvec(&body).map_err(|e| e.to_string())?;
    let header = HelloHeader {
        magic: MAGIC,
        version: PROTOCOL_VERSION,
        index,
        nonce,
        tag: proto::control_tag(
            secret,
            proto::Role::Dialer,
            (&challenge.nonce, &nonce),
            PROTOCOL_VERSION,
            index,
            &body,
        ),
    };
    stream.write_all(&proto::hello_frame(&header, &body)).map_err(|e| e.to_string())?;
    if challenge.version != PROTOCOL_VERSION {
        return Err(format!(
            "the driver speaks protocol version {}, this worker {PROTOCOL_VERSION}; use the same kolo version everywhere",
            challenge.version
        ));
    }
    let frame = proto::read_frame(stream, proto::MAX_PREAUTH_FRAME)
        .map_err(|e| format!("the driver refused this worker ({e})"))?;
    let welcome: Welcome = proto::decode(&frame).map_err(|e| e.to_string())?;
    let nonces = (&challenge.nonce, &nonce);
    if !proto::control_verifies(secret, proto::Role::Listener, nonces, PROTOCOL_VERSION, index, &body, &welcome.tag) {
        return Err("the driver could not prove it knows the job secret".into());
    }
    Ok(welcome)
}

fn real_hostname() -> String {
    nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "localhost".into())
}

/// Points fds 1 and 2 at pipes whose contents go to the driver as output.
fn redirect_own_output(agent: &Arc<Agent>) -> io::Result<()> {
    let (done_tx, done_rx) = mpsc::channel();
    for stderr in [false, true] {
        let (read, write) = nix::unistd::pipe().map_err(io::Error::from)?;
        if stderr {
            nix::unistd::dup2_stderr(write.as_fd()).map_err(io::Error::from)?;
        } else {
            nix::unistd::dup2_stdout(write.as_fd()).map_err(io::Error::from)?;
        }
        drop(write);
        let (agent, done) = (agent.clone(), done_tx.clone());
        std::thread::spawn(move || {
            pump(&agent, File::from(read), stderr);
            let _ = done.send(());
        });
    }
    *crate::lock(&agent.own_output) = Some(OwnOutput { pumps: done_rx });
    Ok(())
}

fn pump(agent: &Agent, mut from: impl Read, stderr: bool) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if agent.send(&ToDriver::Output { stderr, data: buf[..n].to_vec() }).is_err() {
                    return;
                }
            }
        }
    }
}

fn heartbeat(agent: &Agent, interval: Duration, timeout: Duration) {
    loop {
        std::thread::sleep(interval);
        if agent.left.load(Ordering::SeqCst) {
            return;
        }
        let ended = crate::lock(&agent.command).as_mut().and_then(|running| running.end_if_stopped(timeout));
        if let Some(why) = ended {
            agent.say(&why);
        }
        let pid = agent.rank_pid();
        crate::lock(&agent.cpu).look(pid);
        if let Err(e) = agent.send(&ToDriver::Heartbeat) {
            agent.say(&format!("lost the driver ({e}); stopping"));
            agent.exit(1, Duration::ZERO);
        }
        let silent =
            agent.started.elapsed().saturating_sub(Duration::from_millis(agent.last_heard_ms.load(Ordering::Relaxed)));
        if silent > timeout && !agent.not_reading.load(Ordering::Relaxed) {
            agent.say(&format!("no word from the driver for {:.1} s; stopping", silent.as_secs_f64()));
            agent.exit(1, Duration::ZERO);
        }
    }
}

/// What the worker holds between calls.
struct State {
    env: Vec<(String, String)>,
    ctx: WorkerContext,
    executable: Option<Box<dyn Any + Send>>,
}

/// Calls (and constructors) queued or running, and the calls cancelled
/// before they ran: the threads that read the driver's messages and the
/// thread that runs calls share them.
#[derive(Default)]
struct Calls {
    pending: AtomicU64,
    cancelled: Mutex<HashSet<u64>>,
}

/// Acts on the driver's messages in order, on this thread (calls run here:
/// Python's signal handlers need its main thread), and reads them itself
/// while no call runs. Once the user's code has run (an executable's
/// constructor, a call), a helper thread stands by to read during calls
/// that run long (`reading`), so that what must not wait for the user's
/// code does not: the driver's heartbeats, `Cancel`, `WhoOwns`,
/// `Inspect`, and `Stop`, which ends a call that runs or waits (the driver
/// is shutting the job down, as horovod.ray's shutdown kills its actors
/// mid-call). A command job never needs the helper.
fn serve(agent: &Arc<Agent>, registry: &Registry, stream: TcpStream) -> Result<i32, String> {
    let calls = &agent.calls;
    let mut state = State { env: Vec::new(), ctx: WorkerContext::default(), executable: None };
    let mut first_reader = Some(FrameReader::new(stream));
    let mut reading: Option<Arc<Reading>> = None;
    loop {
        let queued = reading.as_ref().and_then(|r| r.next_queued());
        let message = match queued {
            Some(message) => message,
            None => {
                let mut user_code = None;
                let mut own_reader;
                let reader = match (&reading, &mut first_reader) {
                    (Some(r), _) => {
                        own_reader = r.reader();
                        &mut *own_reader
                    }
                    (None, Some(reader)) => reader,
                    (None, None) => unreachable!("the reader is in `reading` once there"),
                };
                let read = read_batch(agent, reader, true, |message| {
                    if runs_user_code(&message) {
                        // the rest of what was read stays in the reader
                        calls.pending.fetch_add(1, Ordering::SeqCst);
                        user_code.get_or_insert(message);
                        return Ok(false);
                    }
                    agent.not_reading.store(true, Ordering::Relaxed);
                    handle(agent, registry, &mut state, message);
                    // what arrived meanwhile is read next: count the driver heard
                    agent.heard();
                    agent.not_reading.store(false, Ordering::Relaxed);
                    Ok(true)
                });
                if let Err(e) = read {
                    lost_driver(agent, &e);
                }
                match user_code {
                    Some(message) => message,
                    None => continue,
                }
            }
        };
        if !runs_user_code(&message) {
            // read by the helper during a call, after it: in order
            handle(agent, registry, &mut state, message);
            continue;
        }
        let reading = match &reading {
            Some(reading) => reading.clone(),
            None => reading.insert(start_reading(agent, first_reader.take().expect("read until now"))?).clone(),
        };
        let skip = match &message {
            ToWorker::Call { id, .. } => crate::lock(&calls.cancelled).remove(id),
            _ => false,
        };
        if !skip {
            reading.call_starts().map_err(|e| format!("cannot arm the reading timer: {e}"))?;
            handle(agent, registry, &mut state, message);
            reading.call_ended().map_err(|e| format!("cannot take the reading back: {e}"))?;
        }
        calls.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Before the user's code first runs: its output goes to the driver, and
/// the helper that reads during long calls stands by.
fn start_reading(agent: &Arc<Agent>, reader: FrameReader) -> Result<Arc<Reading>, String> {
    if agent.host.is_some() {
        agent.say("an agent that shares its process with others runs OS commands only, not calls; stopping");
        agent.exit(1, Duration::ZERO);
    }
    if let Err(e) = redirect_own_output(agent) {
        agent.say(&format!("cannot redirect output: {e}; stopping"));
        agent.exit(1, Duration::ZERO);
    }
    let reading = Reading::new(reader).map_err(|e| format!("cannot set up reading during calls: {e}"))?;
    let (helper_agent, helper_reading) = (agent.clone(), reading.clone());
    std::thread::Builder::new()
        .name(format!("kolo-read-{}", agent.index))
        .spawn(move || {
            let agent = helper_agent;
            let served = helper_reading.serve_helper(|reader, queue| {
                read_batch(&agent, reader, false, |message| {
                    if runs_user_code(&message) {
                        agent.calls.pending.fetch_add(1, Ordering::SeqCst);
                    }
                    queue(message);
                    Ok(true)
                })
            });
            if let Err(e) = served {
                lost_driver(&agent, &e);
            }
        })
        .map_err(|e| format!("cannot start the reading helper: {e}"))?;
    Ok(reading)
}

fn lost_driver(agent: &Agent, e: &io::Error) -> ! {
    agent.say(&format!("lost the driver ({e}); stopping"));
    agent.exit(1, Duration::ZERO)
}

/// Calls and the executable's constructor run the user's code, which may
/// take as long as it likes: a `Stop` does not wait for them.
fn runs_user_code(message: &ToWorker) -> bool {
    matches!(message, ToWorker::Call { .. } | ToWorker::Create { .. })
}

/// Reads what has arrived (waiting for it if `block`), answers at once what must not
/// wait for the user's code, and gives the rest to `then` in order, while
/// it says to go on.
fn read_batch(
    agent: &Arc<Agent>,
    reader: &mut FrameReader,
    block: bool,
    mut then: impl FnMut(ToWorker) -> io::Result<bool>,
) -> io::Result<()> {
    let calls = &agent.calls;
    // frames left from the last batch come first, without waiting
    if !(block && reader.has_frame()) {
        reader.fill(block)?;
        agent.heard();
    }
    while let Some(message) = reader.frame()? {
        match message {
            ToWorker::Heartbeat => {}
            ToWorker::Cancel { id } => {
                crate::lock(&calls.cancelled).insert(id);
            }
            ToWorker::Stop if calls.pending.load(Ordering::SeqCst) > 0 => agent.exit(0, agent.kill_grace),
            ToWorker::ProbeDone => crate::nics::stop_listening(),
            ToWorker::WhoOwns { id, client, server } => {
                let host = format!("host {}", real_hostname());
                let answer = crate::sockets::owned_by_this_user(client, server, &host);
                agent.send(&ToDriver::SocketOwner { id, answer })?;
            }
            ToWorker::Inspect { id, stacks, py_spy } => {
                // a stack dump takes a while: not on this thread
                let agent = agent.clone();
                std::thread::spawn(move || {
                    let answer = agent.inspect(stacks.then_some(py_spy));
                    let _ = agent.send(&ToDriver::Inspected { id, answer });
                });
            }
            other => {
                if !then(other)? {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

fn handle(agent: &Arc<Agent>, registry: &Registry, state: &mut State, message: ToWorker) {
    let reply = match message {
        ToWorker::Heartbeat
        | ToWorker::Cancel { .. }
        | ToWorker::ProbeDone
        | ToWorker::WhoOwns { .. }
        | ToWorker::Inspect { .. } => return,
        ToWorker::SetEnv(vars) => {
            // user code in this process reads its rank from the environment;
            // SetEnv comes once, right after the handshake, while this
            // thread is the only one that touches the environment. Agents
            // that share a process run no code of the user's in it
            if agent.host.is_none() {
                for (k, v) in &vars {
                    std::env::set_var(k, v);
                }
            }
            state.env.extend(vars);
            state.ctx =
                WorkerContext::new(state.env.iter().cloned().collect::<BTreeMap<_, _>>(), Some(reporter(agent)));
            return;
        }
        ToWorker::StartCommand { argv } => return command::start_command(agent, &argv, &state.env),
        ToWorker::SignalCommand { signal } => {
            let group = crate::lock(&agent.command).as_ref().map(|r| r.group);
            if let (Some(group), Ok(signal)) = (group, Signal::try_from(signal)) {
                signal_group(group, signal);
            }
            return;
        }
        ToWorker::Stop => agent.exit(0, agent.kill_grace),
        ToWorker::ProbeListen => match crate::nics::listen(agent.index, agent.secret.clone()) {
            Ok((port, interfaces)) => ToDriver::ProbeReady { port, interfaces },
            Err(e) => {
                agent.say(&format!("cannot listen for interface probes: {e}"));
                ToDriver::ProbeReady { port: 0, interfaces: Vec::new() }
            }
        },
        ToWorker::ReservePorts { count } => {
            // bound together so they differ, released for the frameworks
            let listeners: Vec<std::net::TcpListener> =
                (0..count).filter_map(|_| std::net::TcpListener::bind("0.0.0.0:0").ok()).collect();
            let ports = listeners.iter().filter_map(|l| l.local_addr().ok()).map(|a| a.port()).collect();
            ToDriver::PortsReserved { ports, interfaces: crate::nics::interfaces() }
        }
        ToWorker::Probe { index, targets, timeout_ms } => ToDriver::ProbeResult {
            results: crate::nics::probe(index, &targets, &agent.secret, Duration::from_millis(timeout_ms)),
        },
        ToWorker::Create { name, args } => {
            let result = registry.create(&name, &args, &state.ctx).map(|made| state.executable = Some(made));
            ToDriver::Created { result }
        }
        ToWorker::Call { id, kind, name, args } => {
            agent.current_call.store(id, Ordering::Relaxed);
            let result = match kind {
                CallKind::Task => registry.run_task(&name, &args, state.executable.as_deref_mut(), &state.ctx),
                CallKind::Function => registry.run_function(&name, &args, &state.ctx),
            };
            agent.current_call.store(0, Ordering::Relaxed);
            ToDriver::Done { id, result }
        }
    };
    // what the call printed goes out before its result
    let _ = io::stdout().flush();
    if let Err(e) = agent.send(&reply) {
        agent.say(&format!("lost the driver ({e}); stopping"));
        agent.exit(1, Duration::ZERO);
    }
}

/// Reports go out tagged with the call running when they are made.
fn reporter(agent: &Arc<Agent>) -> Reporter {
    let agent = Arc::clone(agent);
    Reporter::new(move |data| match agent.current_call.load(Ordering::Relaxed) {
        0 => Err(ReportError::NoCall),
        id => Ok(agent.send(&ToDriver::Report { id, data })?),
    })
}

fn libc_signal(signal: Signal) -> i32 {
    signal as i32
}
