//! Helpers shared by the integration tests: the real `kolo` binary, and
//! waits on conditions with a deadline instead of fixed sleeps.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub(crate) fn kolo() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kolo"))
}

pub(crate) fn run(args: &[&str]) -> Output {
    kolo().args(args).output().expect("kolo runs")
}

pub(crate) fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub(crate) fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Waits until `cond` holds, failing the test after `limit`.
pub(crate) fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Alive and not a zombie.
pub(crate) fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
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
