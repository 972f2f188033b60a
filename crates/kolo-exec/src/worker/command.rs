//! The OS command a worker runs (what `kolo run` starts in every rank): its
//! own process group, output pumped to the driver, exit reported. If the
//! agent dies or stops, its guard process ends the group, or on the
//! driver's own host the driver does, so no rank outlives its agent.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::guard::{Guard, GuardOptions};
use crate::proto::ToDriver;

use super::{pump, Agent};

/// How a command registers its group: a guard's record, or the driver's
/// (`super::group_record`).
#[derive(Clone, Copy)]
enum RegistryRecord {
    Guard,
    Driver,
}

pub(super) fn start_command(agent: &Arc<Agent>, argv: &[Vec<u8>], env: &[(String, String)]) {
    use std::os::unix::ffi::OsStrExt;
    let args: Vec<&std::ffi::OsStr> = argv.iter().map(|a| std::ffi::OsStr::from_bytes(a)).collect();
    let Some((program, rest)) = args.split_first() else {
        let _ = agent.send(&ToDriver::CommandStartFailed { message: "empty command".into(), code: 127 });
        return;
    };
    // the guard, where this agent has one: from the moment the command
    // exists, something outside this process knows to end it. It waits out
    // twice the heartbeat timeout: the driver notices a stopped agent first
    // and says so; the guard is for when nobody else is left to act. Where
    // the driver guards commands (its own host), the command registers its
    // group with the driver instead, also before it runs
    let silence = Some(agent.heartbeat_timeout * 2);
    let early = agent.guard.lock().unwrap_or_else(|p| p.into_inner()).take();
    let guard = match early {
        Some(guard) => guard.arm(agent.kill_grace, silence).map(|()| Some(guard)),
        None if agent.group_registry.is_some() => Ok(None),
        None => Guard::spawn(GuardOptions { grace: agent.kill_grace, silence }).map(|g| Some(Arc::new(g))),
    };
    let guard = match guard {
        Ok(guard) => guard,
        Err(e) => {
            let message = format!("cannot start the guard process: {e}");
            let _ = agent.send(&ToDriver::CommandStartFailed { message, code: 126 });
            return;
        }
    };
    let mut command = Command::new(program);
    // the agent's own variables are not the rank's: a command that is
    // itself a kolo program must not take itself for a worker
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(|n| n.starts_with("KOLO_WORKER_")) {
            command.env_remove(&name);
        }
    }
    command.args(rest).envs(env.iter().map(|(k, v)| (k, v)));
    command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    // a private directory for what kolo gives the rank: torchrun's error
    // file (`@record` writes a failing rank's exception there, and the
    // driver's report shows it) unless the caller chose one, and the
    // Python hook that lets JAX find the job; gone with the command
    // (and first, those of jobs on this host whose every process was killed)
    super::rank_dir::sweep_abandoned(&std::env::temp_dir());
    let rank_dir = super::rank_dir::RankDir::create(guard.as_deref());
    let lookup = |name: &str| {
        env.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.clone()).or_else(|| std::env::var(name).ok())
    };
    let mut error_file = false;
    if let Some(dir) = &rank_dir {
        // on the driver's host the driver removes it if this agent dies
        if let (Some(registry), Some(record)) = (&agent.group_registry, super::dir_record(dir.path())) {
            let _ = nix::unistd::write(registry, &record);
        }
        if lookup(ERROR_FILE_VAR).is_none() {
            error_file = true;
            command.env(ERROR_FILE_VAR, dir.path().join("error.json"));
            if let Some(guard) = &guard {
                let _ = guard.remove_path(&dir.path().join("error.json"));
            }
        }
        if lookup("KOLO_PYTHON_HOOKS").as_deref() != Some("0") {
            if let Some(hooks) = write_python_hooks(dir.path(), guard.as_deref()) {
                let path = match lookup("PYTHONPATH").filter(|p| !p.is_empty()) {
                    Some(rest) => format!("{}:{rest}", hooks.display()),
                    None => hooks.display().to_string(),
                };
                command.env("PYTHONPATH", path);
            }
        }
    }
    // the child registers its own group, with the guard or the driver,
    // before the program starts: there is no moment when a killed agent
    // leaves an unguarded command
    let (registry_fd, record) = match (&guard, &agent.group_registry) {
        (Some(guard), _) => (guard.pipe_fd().unwrap_or(-1), RegistryRecord::Guard),
        (None, Some(registry)) => (registry.as_raw_fd(), RegistryRecord::Driver),
        (None, None) => (-1, RegistryRecord::Driver),
    };
    // SAFETY: the hook runs between fork and exec and only calls getpid and
    // write (async-signal-safe)
    unsafe {
        command.pre_exec(move || {
            let pid = libc::getpid() as u32;
            let mut guard_record = [crate::guard::GROUP_RECORD, 0, 4, 0, 0, 0, 0];
            guard_record[3..].copy_from_slice(&pid.to_be_bytes());
            let driver_record = super::group_record(pid);
            let bytes = match record {
                RegistryRecord::Guard => &guard_record[..],
                RegistryRecord::Driver => &driver_record[..],
            };
            libc::write(registry_fd, bytes.as_ptr().cast(), bytes.len());
            Ok(())
        });
    }
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            if let Some(guard) = guard.and_then(|g| Arc::try_unwrap(g).ok()) {
                guard.release();
            }
            let code = if e.kind() == io::ErrorKind::PermissionDenied { 126 } else { 127 };
            let message = format!("could not start '{}': {e}", program.to_string_lossy());
            let _ = agent.send(&ToDriver::CommandStartFailed { message, code });
            return;
        }
    };
    if let Some(guard) = &guard {
        // beats from a thread of their own: they stop only when this whole
        // process is stopped or hung, never when the driver is slow
        let (guard, interval) = (Arc::downgrade(guard), agent.heartbeat_interval);
        let _ = std::thread::Builder::new().name("kolo-guard-beat".into()).spawn(move || {
            while guard.upgrade().is_some_and(|g| g.beat().is_ok()) {
                std::thread::sleep(interval);
            }
        });
    }
    *agent.command.lock().unwrap_or_else(|p| p.into_inner()) =
        Some(super::Running { group: child.id(), guard, dir: rank_dir.as_ref().map(|d| d.path().to_path_buf()) });
    let _ = agent.send(&ToDriver::CommandStarted { pid: child.id() });
    let (done_tx, done_rx) = mpsc::channel();
    let outputs: [(Option<OwnedFd>, bool); 2] =
        [(child.stdout.take().map(OwnedFd::from), false), (child.stderr.take().map(OwnedFd::from), true)];
    for (fd, stderr) in outputs {
        let Some(fd) = fd else { continue };
        let (agent, done) = (agent.clone(), done_tx.clone());
        std::thread::spawn(move || {
            pump(&agent, File::from(fd), stderr);
            let _ = done.send(());
        });
    }
    let agent = agent.clone();
    std::thread::spawn(move || {
        let status = child.wait();
        // the last lines must reach the driver before the exit does; a
        // background child still holding the pipes must not delay it long
        let deadline = Instant::now() + Duration::from_millis(300);
        for _ in 0..2 {
            let _ = done_rx.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        }
        use std::os::unix::process::ExitStatusExt;
        let (code, signal) = match status {
            Ok(s) => (s.code(), s.signal()),
            Err(_) => (None, None),
        };
        if code != Some(0) {
            if let Some((message, traceback)) =
                rank_dir.as_ref().filter(|_| error_file).and_then(|d| read_error_file(d.path()))
            {
                let _ = agent.send(&ToDriver::CommandError { message, traceback });
            }
        }
        drop(rank_dir);
        let _ = agent.send(&ToDriver::CommandExited { code, signal });
    });
}

/// torchrun's variable naming the file `@record` writes a failure into.
const ERROR_FILE_VAR: &str = "TORCHELASTIC_ERROR_FILE";

/// The exception and traceback of an error file, each cut to a bound (the
/// file is the rank's, so it is read with care).
fn read_error_file(dir: &std::path::Path) -> Option<(String, String)> {
    use std::io::Read;
    const MAX_FILE: u64 = 1 << 20;
    const MAX_MESSAGE: usize = 4 << 10;
    const MAX_TRACEBACK: usize = 64 << 10;
    let mut text = String::new();
    File::open(dir.join("error.json")).ok()?.take(MAX_FILE).read_to_string(&mut text).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    // {"message": {"message": "...", "extraInfo": {"py_callstack": "..."}}},
    // or a bare message string in torch's newer form
    let report = json.get("message")?;
    let (message, traceback) = match report {
        serde_json::Value::String(message) => (message.clone(), String::new()),
        report => (
            report.get("message").and_then(|m| m.as_str()).unwrap_or_default().to_string(),
            report.pointer("/extraInfo/py_callstack").and_then(|t| t.as_str()).unwrap_or_default().to_string(),
        ),
    };
    Some((truncate(message, MAX_MESSAGE), truncate(traceback, MAX_TRACEBACK)))
}

/// Keeps the end of `text` (a traceback's last lines matter most).
fn truncate(text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("...{}", &text[start..])
}

/// The `sitecustomize` that registers kolo's JAX cluster environment (see
/// the file): written into `dir/python`, whose path it returns.
fn write_python_hooks(dir: &std::path::Path, guard: Option<&Guard>) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    let hooks = dir.join("python");
    let file = hooks.join("sitecustomize.py");
    if let Some(guard) = guard {
        let _ = guard.remove_path(&hooks);
        let _ = guard.remove_path(&file);
    }
    std::fs::create_dir(&hooks).ok()?;
    let mut out = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&file).ok()?;
    std::io::Write::write_all(&mut out, include_bytes!("sitecustomize.py")).ok()?;
    Some(hooks)
}
