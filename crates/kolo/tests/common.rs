//! Helpers shared by the integration tests: the real `kolo` binary, waits
//! on conditions with a deadline instead of fixed sleeps, and waits on
//! processes whose deadline first prints every stack of the stuck process
//! (and of its kolo job), so that a hang in CI is diagnosable from its log.

#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

pub(crate) fn kolo() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kolo"))
}

/// No kolo job a test starts takes a third of this; one that does is stuck.
pub(crate) const JOB_DEADLINE: Duration = Duration::from_secs(300);

pub(crate) fn run(args: &[&str]) -> Output {
    kolo().args(args).output_within(JOB_DEADLINE)
}

/// `output()` and `wait_with_output()` with a deadline: past it, the
/// stacks of the process and of all it started are printed, with `kolo
/// stack` of the kolo jobs among them, then all of them are killed and
/// the test fails.
pub(crate) trait Within {
    fn output_within(&mut self, limit: Duration) -> Output;
}

impl Within for Command {
    fn output_within(&mut self, limit: Duration) -> Output {
        let child = self.start(Stdio::piped(), Stdio::piped());
        output_within(child, limit)
    }
}

/// `spawn()` with stdout and stderr as given: `Stdio::piped()` for what
/// the test reads, `Stdio::null()` for what it drops.
pub(crate) trait Start {
    fn start(&mut self, stdout: Stdio, stderr: Stdio) -> Child;
}

impl Start for Command {
    fn start(&mut self, stdout: Stdio, stderr: Stdio) -> Child {
        self.stdout(stdout).stderr(stderr).spawn().expect("the command starts")
    }
}

/// `child.wait_with_output()`, with `Within`'s deadline.
pub(crate) fn output_within(mut child: Child, limit: Duration) -> Output {
    fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    }
    let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let status = wait_within(&mut child, limit);
    Output { status, stdout: stdout.join().unwrap(), stderr: stderr.join().unwrap() }
}

/// `child.wait()`, with `Within`'s deadline.
pub(crate) fn wait_within(child: &mut Child, limit: Duration) -> ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("waiting on the child") {
            return status;
        }
        if Instant::now() >= deadline {
            let pid = child.id();
            eprint!("{}", stacks(pid, &format!("process {pid} still ran after {limit:?}")));
            kill_tree(pid);
            let _ = child.wait();
            panic!("process {pid} still ran after {limit:?}: killed (its stacks are above)");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `root` and every live process below it, parents first.
pub(crate) fn process_tree(root: u32) -> Vec<u32> {
    let mut children: std::collections::HashMap<u32, Vec<u32>> = Default::default();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, r)| r).split_whitespace().collect();
        if fields.len() > 1 && fields[0] != "Z" && fields[0] != "X" {
            if let Ok(parent) = fields[1].parse() {
                children.entry(parent).or_default().push(pid);
            }
        }
    }
    let (mut found, mut next) = (Vec::new(), std::collections::VecDeque::from([root]));
    while let Some(pid) = next.pop_front() {
        found.push(pid);
        let mut below = children.remove(&pid).unwrap_or_default();
        below.sort();
        next.extend(below);
    }
    found
}

fn kill_tree(root: u32) {
    for pid in process_tree(root).into_iter().rev() {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
    }
}

/// py-spy: `KOLO_TEST_PYTHON`'s (its venv's), else on PATH.
fn py_spy() -> Option<PathBuf> {
    let beside = std::env::var_os("KOLO_TEST_PYTHON")
        .map(PathBuf::from)
        .and_then(|python| Some(python.parent()?.join("py-spy")));
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join("py-spy"));
    beside.into_iter().chain(on_path).find(|p| p.is_file())
}

/// A command's output, or why there is none, within `limit`.
fn quick(command: &mut Command, limit: Duration) -> String {
    let child = command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) => return format!("  ({e})\n"),
    };
    let deadline = Instant::now() + limit;
    while child.try_wait().ok().flatten().is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return format!("  (took over {limit:?})\n");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("ended");
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Every process of `root`'s tree with its Python and native stacks
/// (py-spy), or its threads' kernel waits where py-spy cannot read it;
/// then `kolo stack` of every kolo job one of them drives.
pub(crate) fn stacks(root: u32, why: &str) -> String {
    const LOOK: Duration = Duration::from_secs(30);
    let pids = process_tree(root);
    let mut out = format!("==== {why}: the stacks of process {root} and the {} below it ====\n", pids.len() - 1);
    let py_spy = py_spy();
    for &pid in &pids {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        out += &format!("---- process {pid}: {}\n", cmdline.chars().take(300).collect::<String>());
        let dumped = py_spy.as_ref().map(|p| {
            let mut command = Command::new(p);
            command.args(["dump", "--native", "--pid", &pid.to_string()]);
            quick(&mut command, LOOK)
        });
        match dumped {
            Some(text) if text.contains("Thread ") => out += &text,
            other => {
                out += &other.unwrap_or_else(|| "  (no py-spy beside KOLO_TEST_PYTHON or on PATH)\n".into());
                out += &kernel_waits(pid);
            }
        }
    }
    out + &kolo_stacks(&pids)
}

/// Each thread's name, state and kernel wait channel.
fn kernel_waits(pid: u32) -> String {
    let mut out = String::new();
    let mut tids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
        .collect();
    tids.sort();
    for tid in tids {
        let read = |what: &str| std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/{what}")).unwrap_or_default();
        let state = read("stat").rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next().map(String::from));
        out += &format!(
            "  thread {tid} {:?}: state {}, waiting in {}\n",
            read("comm").trim(),
            state.unwrap_or_default(),
            read("wchan").trim()
        );
    }
    out
}

/// `kolo stack` of the kolo jobs whose drivers are among `pids`, asked with
/// the drivers' own `XDG_RUNTIME_DIR` and `TMPDIR` (where their endpoints are).
fn kolo_stacks(pids: &[u32]) -> String {
    let place = |pid: u32| {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let var = |name: &str| {
            environ
                .split(|b| *b == 0)
                .find_map(|entry| String::from_utf8_lossy(entry).strip_prefix(&format!("{name}=")).map(String::from))
        };
        (var("XDG_RUNTIME_DIR"), var("TMPDIR"))
    };
    let mut places: Vec<(Option<String>, Option<String>)> = pids.iter().map(|&p| place(p)).collect();
    places.sort();
    places.dedup();
    let mut out = String::new();
    for (runtime, tmp) in places {
        let ask = |args: &[&str]| {
            let mut command = kolo();
            command.args(args).env_remove("XDG_RUNTIME_DIR").env_remove("TMPDIR");
            for (name, value) in [("XDG_RUNTIME_DIR", &runtime), ("TMPDIR", &tmp)] {
                if let Some(value) = value {
                    command.env(name, value);
                }
            }
            quick(&mut command, Duration::from_secs(60))
        };
        let jobs: Vec<serde_json::Value> = serde_json::from_str(&ask(&["ps", "--json"])).unwrap_or_default();
        let ours = jobs.iter().filter(|j| j["driver_pid"].as_u64().is_some_and(|d| pids.contains(&(d as u32))));
        for job in ours {
            let id = job["job"].as_str().unwrap_or_default();
            out += &format!("==== kolo stack {id} ====\n{}", ask(&["stack", id]));
        }
    }
    out
}

pub(crate) fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub(crate) fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Its stdout, once it succeeded; else the test fails showing its stdout
/// and stderr.
#[track_caller]
pub(crate) fn succeeded(o: &Output) -> String {
    let text = stdout(o);
    assert!(o.status.success(), "{text}{}", stderr(o));
    text
}

/// Its stdout's lines, sorted, once it succeeded; else the test fails
/// showing its stderr.
#[track_caller]
pub(crate) fn sorted_lines(o: &Output) -> Vec<String> {
    assert!(o.status.success(), "{}", stderr(o));
    let mut lines: Vec<String> = stdout(o).lines().map(String::from).collect();
    lines.sort();
    lines
}

/// Its stderr, once it ended with `code`; else the test fails showing it.
#[track_caller]
pub(crate) fn failed_with(o: &Output, code: i32) -> String {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(code), "{err}");
    err
}

/// Fails the test, showing its stderr, unless that holds `what`.
#[track_caller]
pub(crate) fn assert_stderr_has(o: &Output, what: &str) {
    let err = stderr(o);
    assert!(err.contains(what), "{err}");
}

/// Waits until `cond` holds, failing the test after `limit` with the
/// stacks of every process this test started (its kolo jobs among them).
pub(crate) fn wait_for(what: &str, limit: Duration, cond: impl FnMut() -> bool) {
    wait_for_showing(what, limit, cond, String::new);
}

/// `wait_for`, failing with `seen()` (what the test has read so far) too.
pub(crate) fn wait_for_showing(what: &str, limit: Duration, mut cond: impl FnMut() -> bool, seen: impl Fn() -> String) {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() >= limit {
            let why = format!("timed out after {limit:?} waiting for {what}");
            panic!("{why}\n{}{}", seen(), stacks(std::process::id(), &why));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The state letter of a `/proc/.../stat` line (after the command name,
/// which may hold spaces and parentheses).
pub(crate) fn stat_state(stat: &str) -> Option<&str> {
    stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next())
}

/// Alive and not a zombie.
pub(crate) fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat_state(&stat);
            state != Some("Z") && state != Some("X")
        }
        Err(_) => false,
    }
}

/// SIGKILLs a process when dropped, so that a failing assertion does not
/// leave it (its janitor then ends the job's other processes).
pub(crate) struct KillOnDrop(pub u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.0 as i32), nix::sys::signal::Signal::SIGKILL);
    }
}

pub(crate) struct TempDir(pub PathBuf);

impl TempDir {
    pub(crate) fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("kolo-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The line a rank wrote into `path` (`echo ... > path`), once it is
/// there whole: the shell creates the file before it writes.
pub(crate) fn line_in(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.ends_with('\n').then(|| text.trim().to_string())
}

/// Pids written one a file into `dir` by the ranks.
pub(crate) fn pids_in(dir: &Path) -> Vec<i32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "pid") {
            for word in std::fs::read_to_string(&path).unwrap().split_whitespace() {
                pids.push(word.parse().unwrap());
            }
        }
    }
    pids
}

/// The Python that has `module` (PyTorch's `torch`, `jax`): `KOLO_TEST_PYTHON`
/// or `python3`. Without it the test is skipped with a line saying so,
/// unless `KOLO_REQUIRE_FRAMEWORKS` is set (CI installs them), where that
/// is a failure.
pub(crate) fn python_with(module: &str) -> Option<String> {
    let python = std::env::var("KOLO_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let found = Command::new(&python).args(["-c", &format!("import {module}")]).output();
    if found.is_ok_and(|o| o.status.success()) {
        return Some(python);
    }
    let why = format!("{python} cannot import {module} (set KOLO_TEST_PYTHON; .ci/run installs it)");
    assert!(std::env::var_os("KOLO_REQUIRE_FRAMEWORKS").is_none(), "{why}");
    eprintln!("skipped: {why}");
    None
}

/// A file of this repository, by its path from the root.
pub(crate) fn repo_file(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path).to_string_lossy().into_owned()
}

/// Runs `crates/kolo/tests/python/store_client.py KIND ADDR PORT` with
/// `python`, through `launcher` (none, or `hx HOST` for a test host), as
/// user `nobody` (setpriv) or as this user; its one-line answer, `wrote`
/// or `refused: WHY`.
pub(crate) fn store_client(
    launcher: &[&str],
    python: &str,
    kind: &str,
    addr: &str,
    port: &str,
    as_nobody: bool,
) -> String {
    let script = repo_file("crates/kolo/tests/python/store_client.py");
    let mut argv: Vec<&str> = launcher.to_vec();
    if as_nobody {
        argv.extend(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]);
    }
    argv.extend([python, &script, kind, addr, port]);
    // nobody has no home; nothing of this user's may leak in
    let out = Command::new(argv[0]).args(&argv[1..]).env("HOME", "/").current_dir("/").output().unwrap();
    // the answer is stdout's; torch warns on stderr
    match stdout(&out).trim() {
        "" => format!("no answer: {}", stderr(&out)),
        answer => answer.to_string(),
    }
}
