//! What an agent sees of its rank's process: state, CPU and memory from
//! `/proc`, and every thread's Python stack through py-spy (a well-kept
//! sampler; kolo does not read another process's memory itself).

use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kolo_proto::proto::RankSample;

/// How long py-spy may take to dump a process.
const DUMP_WAIT: Duration = Duration::from_secs(10);

/// `/proc/PID/stat`'s state letter in words.
fn state_name(letter: char) -> &'static str {
    match letter {
        'R' => "running",
        'S' => "sleeping",
        'D' => "disk-wait",
        'T' => "stopped",
        't' => "traced",
        'Z' => "zombie",
        'X' => "dead",
        'I' => "idle",
        _ => "unknown",
    }
}

/// State, CPU time (clock ticks) and resident memory of process `pid`.
pub(crate) fn sample(pid: u32) -> Result<(RankSample, u64), String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| format!("pid {pid}: {e}"))?;
    let (_, rest) = stat.rsplit_once(')').ok_or_else(|| format!("pid {pid}: unreadable stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // after the command: state(0) ... utime(11) stime(12) ... rss(21), in pages
    let number = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    let state = fields.first().and_then(|s| s.chars().next()).map_or("unknown", state_name);
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).ok().flatten().unwrap_or(4096) as u64;
    let sample = RankSample {
        pid,
        state: state.to_string(),
        cpu_percent: None,
        rss_bytes: number(21) * page,
        stacks: None,
        progress: None,
        gpu_percent: None,
        gpu_memory_bytes: None,
        stall: None,
    };
    Ok((sample, number(11) + number(12)))
}

/// The variable that names a rank's progress file.
pub(crate) const PROGRESS_FILE_VAR: &str = kolo_topology::env_names::PROGRESS_FILE;
/// Its size: little-endian u64s, entered, done, wait_ns, steps, 1 once a
/// hook counts, and room.
const PROGRESS_LEN: usize = 64;

/// Makes the rank's progress file (zeros, 0600) in its private directory.
pub(crate) fn create_progress_file(dir: &std::path::Path, guard: Option<&kolo_sys::guard::Guard>) -> Option<PathBuf> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let file = dir.join("progress");
    if let Some(guard) = guard {
        let _ = guard.remove_path(&file);
    }
    let mut out = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&file).ok()?;
    out.write_all(&[0u8; PROGRESS_LEN]).ok()?;
    Some(file)
}

/// What the rank's hook counted so far; none until a hook counts (the
/// rank is not Python, or has not imported torch).
pub(crate) fn read_progress(file: &std::path::Path) -> Option<kolo_proto::proto::Progress> {
    parse_progress(&std::fs::read(file).ok()?)
}

/// The counters of a worker that runs calls in its own Python
/// (`kolo.Executor`'s): in memory only, so that nothing is left behind
/// whatever ends the worker.
static OWN_PROGRESS: std::sync::OnceLock<std::fs::File> = std::sync::OnceLock::new();

/// The path by which this process's Python hook opens its own counters
/// (`/proc/self/fd/N` of an anonymous file); made once.
pub fn own_progress_file() -> std::io::Result<String> {
    if OWN_PROGRESS.get().is_none() {
        let fd = nix::sys::memfd::memfd_create(c"kolo-progress", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?;
        let file = std::fs::File::from(fd);
        file.set_len(PROGRESS_LEN as u64)?;
        let _ = OWN_PROGRESS.set(file);
    }
    let file = OWN_PROGRESS.get().expect("made above");
    Ok(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(file)))
}

/// The variable that names the file a rank's Horovod core writes its last
/// stall warning to, for the hang report.
pub(crate) const STALL_FILE_VAR: &str = kolo_topology::env_names::STALL_FILE;
/// Most of a stall warning read back (a long list of names is cut).
const STALL_MAX: u64 = 16 << 10;

/// Where the rank in `dir` writes its stall warning (made by its core).
pub(crate) fn stall_file(dir: &std::path::Path) -> PathBuf {
    dir.join("horovod-stall")
}

/// The rank's last stall warning, if its core wrote one.
pub(crate) fn read_stall(file: &std::path::Path) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(file).ok()?.take(STALL_MAX).read_to_string(&mut text).ok()?;
    let text = text.trim_end();
    (!text.is_empty()).then(|| text.to_string())
}

/// The stall warning file of a worker that runs calls in its own Python
/// (`kolo.Executor`'s): in memory, as its progress counters are.
static OWN_STALL: std::sync::OnceLock<std::fs::File> = std::sync::OnceLock::new();

/// A path this process's Horovod core can write its stall warning to.
pub fn own_stall_file() -> std::io::Result<String> {
    if OWN_STALL.get().is_none() {
        let fd = nix::sys::memfd::memfd_create(c"kolo-stall", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?;
        let _ = OWN_STALL.set(std::fs::File::from(fd));
    }
    let file = OWN_STALL.get().expect("made above");
    Ok(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(file)))
}

pub(crate) fn read_own_stall() -> Option<String> {
    let file = OWN_STALL.get()?;
    read_stall(std::path::Path::new(&format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(file))))
}

/// What this process's own hook counted, where it has one.
pub(crate) fn read_own_progress() -> Option<kolo_proto::proto::Progress> {
    let mut bytes = [0u8; PROGRESS_LEN];
    std::os::unix::fs::FileExt::read_exact_at(OWN_PROGRESS.get()?, &mut bytes, 0).ok()?;
    parse_progress(&bytes)
}

fn parse_progress(bytes: &[u8]) -> Option<kolo_proto::proto::Progress> {
    let word = |i: usize| Some(u64::from_le_bytes(bytes.get(i * 8..i * 8 + 8)?.try_into().ok()?));
    if word(4)? != 1 {
        return None;
    }
    Some(kolo_proto::proto::Progress { entered: word(0)?, done: word(1)?, wait_ns: word(2)?, steps: word(3)? })
}

/// CPU use of one process between two looks.
#[derive(Default)]
pub(crate) struct CpuWatch {
    last: Option<(u32, Instant, u64)>,
    percent: Option<f64>,
}

impl CpuWatch {
    /// Takes a look at `pid` (the agent's heartbeat thread, every interval).
    pub(crate) fn look(&mut self, pid: u32) {
        let Ok((_, ticks)) = sample(pid) else {
            self.percent = None;
            return;
        };
        let now = Instant::now();
        let per_s = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as f64;
        if let Some((last_pid, at, last_ticks)) = self.last {
            let elapsed = now.duration_since(at).as_secs_f64();
            if last_pid == pid && elapsed > 0.0 {
                self.percent = Some(ticks.saturating_sub(last_ticks) as f64 / per_s / elapsed * 100.0);
            }
        }
        self.last = Some((pid, now, ticks));
    }

    pub(crate) fn percent(&self, pid: u32) -> Option<f64> {
        self.last.filter(|(p, _, _)| *p == pid).and(self.percent)
    }
}

/// Where py-spy is: `KOLO_PY_SPY`, the asking user's (`hint`), beside the
/// rank's interpreter (`pid`'s: a rank running a virtualenv's
/// `bin/python` finds the py-spy that `pip install kolo` put there), beside
/// this program as started (a virtualenv's `bin/python`, which
/// `current_exe` resolves to the Python it links to) or as it is, or on
/// `PATH`.
fn py_spy(hint: Option<&str>, pid: u32) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("KOLO_PY_SPY") {
        return Some(PathBuf::from(path));
    }
    if let Some(hint) = hint.map(PathBuf::from).filter(|p| p.is_absolute() && p.is_file()) {
        return Some(hint);
    }
    let started_as = std::env::args_os().next().map(PathBuf::from).filter(|p| p.is_absolute());
    let programs = started_as.into_iter().chain(std::env::current_exe().ok());
    let mut beside = programs_of(pid).into_iter().chain(programs).filter_map(|exe| Some(exe.parent()?.join("py-spy")));
    beside.find(|p| p.is_file()).or_else(py_spy_on_path)
}

/// The program process `pid` runs: as it was started (its `argv[0]`, found
/// the way its own `PATH` and working directory found it), then as it is
/// (`/proc/PID/exe`, a virtualenv's Python resolved to the one it links to).
fn programs_of(pid: u32) -> Vec<PathBuf> {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let cmdline = std::fs::read(proc.join("cmdline")).unwrap_or_default();
    let argv0 = cmdline.split(|b| *b == 0).next().unwrap_or_default();
    let environ = std::fs::read(proc.join("environ")).unwrap_or_default();
    let path = environ.split(|b| *b == 0).find_map(|var| var.strip_prefix(b"PATH="));
    let cwd = std::fs::read_link(proc.join("cwd")).ok();
    let started = started_as(std::ffi::OsStr::from_bytes(argv0), path.map(std::ffi::OsStr::from_bytes), cwd);
    started.into_iter().chain(std::fs::read_link(proc.join("exe")).ok()).collect()
}

/// Where a process started as `argv0` found its program: a path as it is
/// (from `cwd` when relative), a bare name in the first directory of
/// `path` that has it.
fn started_as(argv0: &std::ffi::OsStr, path: Option<&std::ffi::OsStr>, cwd: Option<PathBuf>) -> Option<PathBuf> {
    if argv0.is_empty() {
        return None;
    }
    let named = std::path::Path::new(argv0);
    if named.components().count() > 1 || named.is_absolute() {
        return Some(if named.is_absolute() { named.to_path_buf() } else { cwd?.join(named) });
    }
    std::env::split_paths(path?).map(|dir| dir.join(named)).find(|p| p.is_file())
}

/// `py-spy` in the first of `PATH`'s directories that has it.
pub fn py_spy_on_path() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join("py-spy")).find(|p| p.is_file())
}

/// Every thread's stack of process `pid`, innermost call first, as text
/// that is the same for ranks doing the same thing (no pids, no thread
/// ids); or a line saying why there is none. `native`: with native frames
/// where py-spy can unwind them.
pub(crate) fn stacks(pid: u32, host: &str, hint: Option<&str>, native: bool) -> String {
    let Some(py_spy) = py_spy(hint, pid) else {
        return format!("py-spy is not installed on host {host}: pip install py-spy (or set KOLO_PY_SPY)");
    };
    let dump = |native: bool| {
        let mut command = Command::new(&py_spy);
        command.args(["dump", "--json", "--pid", &pid.to_string()]);
        if native {
            command.arg("--native");
        }
        let output = command.stdin(Stdio::null()).output_within(DUMP_WAIT)?;
        let threads =
            serde_json::from_slice::<serde_json::Value>(&output.stdout).ok().filter(|_| output.status.success());
        Ok::<_, std::io::Error>((threads, output))
    };
    // native frames (where a collective's C++ waits) where py-spy can
    // unwind them, else Python's alone
    let mut failed = None;
    let tries: &[bool] = if native { &[true, false] } else { &[false] };
    for &native in tries {
        match dump(native) {
            Ok((Some(threads), _)) => return render(&threads),
            Ok((None, output)) => failed = Some(output),
            Err(e) => return format!("py-spy ({}) failed: {e}", py_spy.display()),
        }
    }
    let output = failed.expect("both dumps failed");
    let why = String::from_utf8_lossy(&output.stderr);
    let why = why.lines().find(|l| !l.trim().is_empty()).unwrap_or("no output").trim().to_string();
    let program = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    if why.to_lowercase().contains("python") {
        let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
        let waits = if wchan.is_empty() || wchan == "0" { String::new() } else { format!(", waiting in {wchan}") };
        format!("no Python in this rank (pid {pid}, {}{waits})", program.trim())
    } else {
        format!("py-spy could not read pid {pid} ({}): {why}", program.trim())
    }
}

/// py-spy's JSON dump as text: a block per thread.
fn render(threads: &serde_json::Value) -> String {
    let mut out = String::new();
    for thread in threads.as_array().into_iter().flatten() {
        // no thread ids: they differ between ranks doing the same thing
        let name = thread["thread_name"].as_str().map(|n| format!(" {n}")).unwrap_or_default();
        let activity = if thread["active"].as_bool().unwrap_or(false) { "active" } else { "idle" };
        let gil = if thread["owns_gil"].as_bool().unwrap_or(false) { ", holds the GIL" } else { "" };
        out.push_str(&format!("Thread{name} ({activity}{gil})\n"));
        for frame in thread["frames"].as_array().into_iter().flatten() {
            let mut function = frame["name"].as_str().unwrap_or("?");
            // an unresolved native frame's address differs between
            // processes (ASLR): ranks in the same place must read alike
            if function.strip_prefix("0x").is_some_and(|hex| u64::from_str_radix(hex, 16).is_ok()) {
                function = "??";
            }
            let file = frame["short_filename"].as_str().or_else(|| frame["filename"].as_str()).unwrap_or("?");
            match frame["line"].as_i64().unwrap_or(0) {
                // native frames have no line
                0 => out.push_str(&format!("    {function} ({file})\n")),
                line => out.push_str(&format!("    {function} ({file}:{line})\n")),
            }
        }
    }
    if out.is_empty() {
        out.push_str("no threads\n");
    }
    out
}

/// `Command::output`, giving up (and killing the child) after `limit`.
trait OutputWithin {
    fn output_within(&mut self, limit: Duration) -> std::io::Result<std::process::Output>;
}

impl OutputWithin for Command {
    fn output_within(&mut self, limit: Duration) -> std::io::Result<std::process::Output> {
        let mut child = self.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
        // py-spy's output is small: the pipes do not fill before it exits
        let mut exited = Ok(false);
        kolo_sys::wait::wait_until(Instant::now() + limit, Duration::from_millis(20), || {
            exited = child.try_wait().map(|status| status.is_some());
            !matches!(exited, Ok(false))
        });
        match exited {
            Ok(true) => child.wait_with_output(),
            Err(e) => Err(e),
            Ok(false) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(std::io::Error::other(format!("no answer within {} s", limit.as_secs())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ranks_program_is_found_as_its_own_path_and_directory_found_it() {
        let dir = std::env::temp_dir().join(format!("kolo-started-as-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("venv/bin")).unwrap();
        std::fs::write(dir.join("venv/bin/python"), "").unwrap();
        let os = std::ffi::OsStr::new;
        let path = format!("/nonexistent:{}", dir.join("venv/bin").display());
        // a bare name: the first directory of the rank's PATH that has it
        assert_eq!(started_as(os("python"), Some(os(&path)), None), Some(dir.join("venv/bin/python")));
        assert_eq!(started_as(os("python"), Some(os("/nonexistent")), None), None);
        assert_eq!(started_as(os("python"), None, None), None);
        // a path: as it is, from the rank's working directory when relative
        assert_eq!(started_as(os("/opt/py/bin/python3"), None, None), Some(PathBuf::from("/opt/py/bin/python3")));
        assert_eq!(started_as(os("venv/bin/python"), None, Some(dir.clone())), Some(dir.join("venv/bin/python")));
        assert_eq!(started_as(os("venv/bin/python"), None, None), None);
        assert_eq!(started_as(os(""), Some(os(&path)), None), None);
        // and what this test process runs, by pid
        let programs = programs_of(std::process::id());
        assert!(programs.contains(&std::env::current_exe().unwrap()), "{programs:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_dump_renders_without_pids_or_thread_ids() {
        let dump = serde_json::json!([{
            "pid": 4242, "thread_id": 140000, "thread_name": "MainThread", "os_thread_id": 4242,
            "active": true, "owns_gil": true,
            "frames": [
                {"name": "recv", "filename": "/lib/libgloo.so", "short_filename": "libgloo.so", "line": 0},
                {"name": "wait", "filename": "/x/y/dist.py", "short_filename": "dist.py", "line": 12},
                {"name": "<module>", "filename": "/x/train.py", "short_filename": "train.py", "line": 3},
                {"name": "0x7f7e8424524a", "filename": "/lib/libc.so.6", "short_filename": "libc.so.6", "line": 0}
            ]
        }]);
        let text = render(&dump);
        assert_eq!(
            text,
            "Thread MainThread (active, holds the GIL)\n    recv (libgloo.so)\n    wait (dist.py:12)\n    \
             <module> (train.py:3)\n    ?? (libc.so.6)\n"
        );
        assert!(!text.contains("4242"));
    }

    #[test]
    fn this_process_samples_as_alive_with_memory() {
        let (me, _) = sample(std::process::id()).unwrap();
        // the process's state is its main thread's: the test harness's may
        // be waiting for this test's thread
        assert!(["running", "sleeping"].contains(&me.state.as_str()), "{}", me.state);
        assert!(me.rss_bytes > 0);
        assert!(sample(u32::MAX).is_err());
    }
}
