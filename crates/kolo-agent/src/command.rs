//! The OS command a worker runs (what `kolo run` starts in every rank): its
//! own process group, output pumped to the driver, exit reported. If the
//! agent dies or stops, its guard process ends the group, or on the
//! driver's own host the driver does, so no rank outlives its agent.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kolo_proto::proto::ToDriver;
use kolo_sys::guard::{Guard, GuardOptions};

use crate::Agent;

/// How a command registers its group: a guard's record, or the driver's
/// (`kolo_proto::launch::group_record`).
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
    let early = kolo_sys::lock(&agent.guard).take();
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
    // (once per process: the agents sharing one would each sweep the others')
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(|| drop(crate::rank_dir::sweep_abandoned(&crate::rank_dir::base())));
    let rank_dir = crate::rank_dir::RankDir::create(guard.as_deref());
    let lookup = |name: &str| {
        env.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.clone()).or_else(|| std::env::var(name).ok())
    };
    let mut error_file = false;
    let mut progress = None;
    let mut timeline = None;
    if let Some(dir) = &rank_dir {
        if lookup(kolo_timeline::WANTED_VAR).as_deref() == Some("1") {
            // the rank records there; sent to the driver once it ended
            let file = dir.path().join("timeline");
            if let Some(guard) = &guard {
                let _ = guard.remove_path(&file);
            }
            command.env(kolo_timeline::FILE_VAR, &file);
            timeline = Some(file);
        }
        // on the driver's host the driver removes it if this agent dies
        if let (Some(registry), Some(record)) = (&agent.group_registry, kolo_proto::launch::dir_record(dir.path())) {
            let _ = nix::unistd::write(registry, &record);
        }
        if lookup(ERROR_FILE_VAR).is_none() {
            error_file = true;
            command.env(ERROR_FILE_VAR, dir.path().join("error.json"));
            if let Some(guard) = &guard {
                let _ = guard.remove_path(&dir.path().join("error.json"));
            }
        }
        if lookup(kolo_topology::env_names::PYTHON_HOOKS).as_deref() != Some("0") {
            // where the rank's Python hook counts its collectives and steps
            if let Some(file) = crate::inspect::create_progress_file(dir.path(), guard.as_deref()) {
                command.env(crate::inspect::PROGRESS_FILE_VAR, &file);
                progress = Some(file);
            }
            // where its Horovod core writes a stall warning (removed
            // before the directory, if this agent dies)
            let stall = crate::inspect::stall_file(dir.path());
            if let Some(guard) = &guard {
                let _ = guard.remove_path(&stall);
            }
            command.env(crate::inspect::STALL_FILE_VAR, &stall);
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
    // SAFETY: the hook runs between fork and exec and only calls getpid,
    // write, getppid and prctl (async-signal-safe system calls)
    unsafe {
        command.pre_exec(move || {
            let pid = libc::getpid() as u32;
            let mut guard_record = [kolo_sys::guard::GROUP_RECORD, 0, 4, 0, 0, 0, 0];
            guard_record[3..].copy_from_slice(&pid.to_be_bytes());
            let driver_record = kolo_proto::launch::group_record(pid);
            let bytes = match record {
                RegistryRecord::Guard => &guard_record[..],
                RegistryRecord::Driver => &driver_record[..],
            };
            libc::write(registry_fd, bytes.as_ptr().cast(), bytes.len());
            // the agent (and py-spy, its child) may trace the rank for
            // `kolo stack` under Yama's ptrace_scope 1
            libc::prctl(libc::PR_SET_PTRACER, libc::getppid() as libc::c_ulong, 0, 0, 0);
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
    *kolo_sys::lock(&agent.command) = Some(crate::Running {
        group: child.id(),
        guard,
        dir: rank_dir.as_ref().map(|d| d.path().to_path_buf()),
        stopped_since: lookup(kolo_topology::env_names::ELASTIC_ROUND).map(|_| None),
        progress,
    });
    let _ = agent.send(&ToDriver::CommandStarted { pid: child.id() });
    let outputs: Vec<(File, bool)> = [
        (child.stdout.take().map(|o| File::from(OwnedFd::from(o))), false),
        (child.stderr.take().map(|o| File::from(OwnedFd::from(o))), true),
    ]
    .into_iter()
    .filter_map(|(file, stderr)| Some((file?, stderr)))
    .collect();
    let agent = agent.clone();
    // one thread for the command: its output and its end
    std::thread::spawn(move || {
        let status = pump_until_exit(&agent, &mut child, outputs);
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
        if let Some(file) = &timeline {
            send_timeline(&agent, file);
        }
        drop(rank_dir);
        let _ = agent.send(&ToDriver::CommandExited { code, signal });
    });
}

/// What the rank recorded for the job's timeline, in frames of a bounded
/// size; nothing if it recorded nothing (it made no collective).
pub(crate) fn send_timeline(agent: &Agent, file: &std::path::Path) {
    use std::io::Read;
    const CHUNK: usize = 4 << 20;
    let Ok(mut file) = File::open(file) else { return };
    let mut header = [0u8; kolo_timeline::HEADER_BYTES];
    if file.read_exact(&mut header).is_err() {
        return;
    }
    let Some(len) = kolo_timeline::recorded_len(&header) else { return };
    let mut bytes = header.to_vec();
    if file.take((len - header.len()) as u64).read_to_end(&mut bytes).is_err() {
        return;
    }
    for data in kolo_timeline::used_bytes(&bytes).chunks(CHUNK) {
        if agent.send(&ToDriver::Timeline { data: data.to_vec() }).is_err() {
            return;
        }
    }
}

/// Sends the command's output to the driver until the command has exited
/// and its pipes are drained. A background child that still holds the
/// pipes gets `LAST_OUTPUT` after the command's exit, not longer: the last
/// lines must reach the driver before the exit does, the exit must not
/// wait on a stray process.
fn pump_until_exit(
    agent: &Agent,
    child: &mut std::process::Child,
    mut outputs: Vec<(File, bool)>,
) -> io::Result<std::process::ExitStatus> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::io::Read;
    use std::os::fd::AsFd;
    const LAST_OUTPUT: Duration = Duration::from_millis(300);
    // a pidfd says when the command exits (Linux 5.3); without one, the
    // pipes are polled with a short timeout and the command checked
    let pidfd = pidfd(child.id());
    let mut exited = None;
    let mut deadline: Option<Instant> = None;
    let mut buf = vec![0u8; 64 * 1024];
    while !outputs.is_empty() {
        let timeout = match (deadline, &pidfd) {
            (Some(at), _) => {
                let ms = at.saturating_duration_since(Instant::now()).as_millis().min(i32::MAX as u128);
                PollTimeout::try_from(ms as i32).unwrap_or(PollTimeout::MAX)
            }
            (None, Some(_)) => PollTimeout::NONE,
            (None, None) => PollTimeout::from(20u8),
        };
        let mut fds: Vec<PollFd> = outputs.iter().map(|(f, _)| PollFd::new(f.as_fd(), PollFlags::POLLIN)).collect();
        if let (Some(pidfd), None) = (&pidfd, exited) {
            fds.push(PollFd::new(pidfd.as_fd(), PollFlags::POLLIN));
        }
        match poll(&mut fds, timeout) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
        let ready: Vec<bool> = fds.iter().map(|f| f.revents().is_some_and(|r| !r.is_empty())).collect();
        drop(fds);
        let mut closed = Vec::new();
        for (i, (file, stderr)) in outputs.iter_mut().enumerate() {
            if !ready[i] {
                continue;
            }
            match file.read(&mut buf) {
                Ok(0) | Err(_) => closed.push(i),
                Ok(n) => {
                    if agent.send(&ToDriver::Output { stderr: *stderr, data: buf[..n].to_vec() }).is_err() {
                        closed.push(i);
                    }
                }
            }
        }
        for i in closed.into_iter().rev() {
            outputs.remove(i);
        }
        if exited.is_none() {
            exited = child.try_wait()?;
            if exited.is_some() {
                deadline = Some(Instant::now() + LAST_OUTPUT);
            }
        }
        if deadline.is_some_and(|at| Instant::now() >= at) {
            break;
        }
    }
    match exited {
        Some(status) => Ok(status),
        None => child.wait(),
    }
}

/// A descriptor that becomes readable when `pid` exits, where the kernel
/// has them.
fn pidfd(pid: u32) -> Option<OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // or -1; nothing else is touched
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: a descriptor the kernel just gave us, owned by nobody else
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
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
/// the file): written into the rank's directory, whose path it returns for
/// `PYTHONPATH` (nothing else there is a module Python could import).
fn write_python_hooks(dir: &std::path::Path, guard: Option<&Guard>) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = dir.join("sitecustomize.py");
    if let Some(guard) = guard {
        let _ = guard.remove_path(&file);
    }
    let mut out = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&file).ok()?;
    std::io::Write::write_all(&mut out, crate::PYTHON_HOOKS.as_bytes()).ok()?;
    Some(dir.to_path_buf())
}
