//! `kolo ps`, `kolo status` and `kolo stack` against real jobs of the real
//! binary. Each test keeps its jobs' endpoints in a runtime directory of
//! its own (XDG_RUNTIME_DIR), so that tests running at once do not see
//! each other's jobs.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// A job started with its own runtime directory, without py-spy on PATH
/// (kolo built with cargo, as a developer runs it): where a rank's Python
/// has one beside it, the agents find it there.
struct Job {
    child: Child,
    runtime: TempDir,
}

impl Job {
    fn start(name: &str, np: &str, command: &[&str]) -> Job {
        let runtime = TempDir::new(name);
        let child = kolo()
            .env("XDG_RUNTIME_DIR", runtime.path())
            .env("PATH", path_without_py_spy())
            .args(["run", "-np", np, "--"])
            .args(command)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let job = Job { child, runtime };
        // the listing is written last: what clients take for a job ready to answer
        wait_for("the job's listing", Duration::from_secs(30), || job.listing().is_some());
        job
    }

    fn kolo(&self, args: &[&str]) -> std::process::Output {
        let path = path_without_py_spy();
        kolo().env("XDG_RUNTIME_DIR", self.runtime.path()).env("PATH", path).args(args).output_within(JOB_DEADLINE)
    }

    fn dir(&self) -> std::path::PathBuf {
        self.runtime.path().join("kolo")
    }

    fn socket(&self) -> Option<std::path::PathBuf> {
        self.file_ending("sock")
    }

    fn listing(&self) -> Option<std::path::PathBuf> {
        self.file_ending("json")
    }

    fn file_ending(&self, extension: &str) -> Option<std::path::PathBuf> {
        let entries = std::fs::read_dir(self.dir()).ok()?;
        entries.flatten().map(|e| e.path()).find(|p| p.extension().is_some_and(|e| e == extension))
    }

    fn status(&self) -> serde_json::Value {
        let out = self.kolo(&["status", "--json"]);
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_str(&stdout(&out)).unwrap()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn ps_lists_a_running_job_and_forgets_it_once_it_ended() {
    let job = Job::start("ps", "2", &["sleep", "1000"]);
    let out = job.kolo(&["ps", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let jobs: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let jobs = jobs.as_array().unwrap();
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs[0]["ranks"], 2);
    assert_eq!(jobs[0]["command"], "sleep 1000");
    assert_eq!(jobs[0]["driver_pid"], job.child.id());
    let table = stdout(&job.kolo(&["ps"]));
    assert!(table.contains("sleep 1000") && table.contains(jobs[0]["job"].as_str().unwrap()), "{table}");
    // SIGINT: the job ends as it would at a Ctrl-C, its endpoint with it
    let mut job = job;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(job.child.id() as i32), nix::sys::signal::Signal::SIGINT)
        .unwrap();
    wait_within(&mut job.child, JOB_DEADLINE);
    // the directory too, once no job of the user's is in it
    assert!(
        !job.dir().exists(),
        "left: {:?}",
        std::fs::read_dir(job.dir()).map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
    );
    assert_eq!(stdout(&job.kolo(&["ps", "--json"])).trim(), "[]");
    let out = job.kolo(&["status"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no kolo job of yours runs on this machine"), "{}", stderr(&out));
}

#[test]
fn status_gives_every_rank_with_its_process_and_last_output() {
    let job = Job::start("status", "3", &["sh", "-c", "echo started; exec sleep 1000"]);
    wait_for("every rank's first line and a CPU sample", Duration::from_secs(20), || {
        let s = job.status();
        s["ranks"].as_array().unwrap().iter().all(|r| r["state"] == "sleeping" && r["cpu_percent"].is_number())
    });
    let s = job.status();
    let ranks = s["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 3);
    for (i, r) in ranks.iter().enumerate() {
        assert_eq!(r["rank"], i as u64);
        for key in ["host", "pid", "state", "cpu_percent", "rss_bytes", "last_output_s", "collectives", "wait_fraction"]
        {
            assert!(r.get(key).is_some(), "{key} missing in {r}");
        }
        // `sleep` holds no GPU, NVML or not: the fields are there, null
        for key in ["gpu_percent", "gpu_memory_bytes"] {
            assert_eq!(r.get(key), Some(&serde_json::Value::Null), "{key} in {r}");
        }
        let pid = r["pid"].as_u64().unwrap() as i32;
        assert!(alive(pid));
        // the rank's own process: sleep, after the shell exec'd it
        assert_eq!(std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap().trim(), "sleep");
        assert!(r["rss_bytes"].as_u64().unwrap() > 0);
        assert!(r["last_output_s"].as_f64().unwrap() < 60.0);
    }
    assert!(s["stragglers"].is_array());
    let table = stdout(&job.kolo(&["status"]));
    assert!(table.contains("sleeping") && table.contains("RANK"), "{table}");
}

#[test]
fn stack_says_when_a_rank_is_not_python_and_names_a_bad_rank() {
    let job = Job::start("stack-native", "2", &["sleep", "1000"]);
    let out = job.kolo(&["stack"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    // py-spy present or not, the answer says what there is for both ranks
    assert!(text.starts_with("ranks 0,1 (host "), "{text}");
    assert!(text.contains("no Python in this rank") || text.contains("py-spy is not installed"), "{text}");
    let out = job.kolo(&["stack", "--rank", "7"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("rank 7 is not in the job: it has ranks 0 to 1"), "{}", stderr(&out));
}

/// This PATH without its directories that hold a py-spy.
fn path_without_py_spy() -> String {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let kept: Vec<_> = std::env::split_paths(&path).filter(|dir| !dir.join("py-spy").exists()).collect();
    std::env::join_paths(kept).unwrap().to_string_lossy().into_owned()
}

/// With py-spy (the Python that has torch in CI has it), the rank that
/// waits somewhere else is shown first, the others merged.
#[test]
fn stack_merges_the_ranks_that_wait_alike_and_shows_the_odd_one_first() {
    let Some(python) = python_with("kolo") else { return };
    let bin = std::path::Path::new(&python).parent().unwrap().to_path_buf();
    if !bin.join("py-spy").exists() {
        assert!(std::env::var_os("KOLO_REQUIRE_FRAMEWORKS").is_none(), "py-spy is not beside {python}");
        eprintln!("skipped: no py-spy beside {python}");
        return;
    }
    let script = "import os, time\n\
                  def wait_in_step():\n    time.sleep(1000)\n\
                  def straggle():\n    time.sleep(1000)\n\
                  print('up', flush=True)\n\
                  straggle() if os.environ['RANK'] == '2' else wait_in_step()\n";
    let job = Job::start("stack-python", "4", &[&python, "-c", script]);
    wait_for("every rank up", Duration::from_secs(30), || {
        job.status()["ranks"].as_array().unwrap().iter().all(|r| r["last_output_s"].as_f64().unwrap() < 30.0)
            && job.status()["ranks"].as_array().unwrap().iter().all(|r| r["state"] == "sleeping")
    });
    // py-spy nowhere on PATH: the agents find the one beside the ranks' Python
    let out = job.kolo(&["stack"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{}", stderr(&out));
    let odd = text.find("rank 2 (host ").expect(&text);
    let rest = text.find("ranks 0,1,3 (host ").expect(&text);
    assert!(odd < rest, "{text}");
    assert!(text[odd..rest].contains("straggle (<string>:"), "{text}");
    assert!(text[rest..].contains("wait_in_step (<string>:"), "{text}");
}

/// The endpoint is the user's alone; garbage and oversized requests get an
/// error and the connection closed; the job goes on.
#[test]
fn the_endpoint_refuses_other_users_and_garbage() {
    let job = Job::start("endpoint", "1", &["sleep", "1000"]);
    let socket = job.socket().unwrap();
    let mode = std::fs::metadata(job.dir()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(mode.permissions().mode() & 0o777, 0o700);
    // another user cannot even reach the socket
    let probe = format!(
        "import socket; s = socket.socket(socket.AF_UNIX); s.connect({:?}); s.sendall(b'{{\"op\": \"status\"}}\\n'); print(s.recv(100))",
        socket.display().to_string()
    );
    let other = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "python3", "-c", &probe])
        .output()
        .unwrap();
    assert!(!other.status.success(), "another user got in: {}", stdout(&other));
    assert!(stderr(&other).contains("Permission denied"), "{}", stderr(&other));
    // garbage, then an endless line
    for request in [b"hello\n".to_vec(), vec![b'x'; 10_000]] {
        let mut s = UnixStream::connect(&socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(&request);
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        assert!(answer.contains("\"error\""), "{answer}");
    }
    assert_eq!(job.status()["ranks"][0]["state"], "sleeping");
}

/// Asked while the job ends, status answers or says why not; it never
/// hangs or panics.
#[test]
fn status_during_teardown_answers_or_says_why_not() {
    let mut job = Job::start("teardown", "2", &["sh", "-c", "trap 'sleep 0.5; exit 0' TERM; sleep 1000 & wait"]);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(job.child.id() as i32), nix::sys::signal::Signal::SIGTERM)
        .unwrap();
    let mut answers = 0;
    while job.child.try_wait().unwrap().is_none() {
        let out = job.kolo(&["status", "--json"]);
        let err = stderr(&out);
        assert!(!err.contains("panicked"), "{err}");
        if out.status.success() {
            answers += 1;
        } else {
            assert!(err.starts_with("kolo: error: "), "{err}");
        }
    }
    assert!(answers > 0 || job.child.try_wait().unwrap().is_some());
}

/// A 4-rank gloo job whose rank 2 never reaches an all_reduce: with
/// `--hang-timeout 8` kolo names rank 2, shows where every rank is, ends
/// the job with a non-zero code, and leaves nothing.
#[test]
fn a_hang_is_reported_naming_the_rank_outside_the_collective_with_the_stacks() {
    let Some(python) = python_with("torch") else { return };
    let beside = std::path::Path::new(&python).with_file_name("py-spy");
    assert!(beside.exists(), "{python} has no py-spy beside it (pip install py-spy there)");
    let script = "import os, time\n\
                  import torch, torch.distributed as dist\n\
                  dist.init_process_group('gloo')\n\
                  t = torch.ones(4)\n\
                  for _ in range(3):\n    dist.all_reduce(t)\n\
                  print('three steps', flush=True)\n\
                  def stuck_before_the_all_reduce():\n    time.sleep(1000)\n\
                  if dist.get_rank() == 2:\n    stuck_before_the_all_reduce()\n\
                  dist.all_reduce(t)\n";
    let runtime = TempDir::new("hang");
    let started = std::time::Instant::now();
    // py-spy nowhere on PATH (kolo built with cargo, as a developer runs it):
    // the agents find the one beside the ranks' Python, which has kolo's
    let out = kolo()
        .env("XDG_RUNTIME_DIR", runtime.path())
        .env("PATH", path_without_py_spy())
        .args(["run", "-np", "4", "--hang-timeout", "8", "--", &python, "-c", script])
        .output_within(JOB_DEADLINE);
    let took = started.elapsed();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("kolo: the job hung: rank 2 (host localhost) is not in the collective the other 3 ranks wait in"),
        "{err}"
    );
    let odd = err.find("kolo: rank 2 (host localhost):").expect(&err);
    let rest = err.find("kolo: ranks 0,1,3 (host localhost):").expect(&err);
    assert!(odd < rest, "{err}");
    assert!(err[odd..rest].contains("stuck_before_the_all_reduce"), "{err}");
    assert!(err[rest..].contains("all_reduce (torch/distributed/distributed_c10d.py"), "{err}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    assert_eq!(stdout(&out).matches("three steps").count(), 4, "{}", stdout(&out));
    let left = Command::new("pgrep").args(["-f", "stuck_before_the_all_reduce"]).output().unwrap();
    assert!(stdout(&left).trim().is_empty(), "left running: {}", stdout(&left));
}

/// One rank doing five times the work per step waits least in the
/// all_reduce: status lists it as the straggler, and counts collectives
/// and steps for every rank.
#[test]
fn status_names_the_rank_the_others_wait_for() {
    let Some(python) = python_with("torch") else { return };
    let script = "import os, time\n\
                  import torch, torch.distributed as dist\n\
                  dist.init_process_group('gloo')\n\
                  model = torch.nn.Linear(4, 1)\n\
                  opt = torch.optim.SGD(model.parameters(), lr=0.01)\n\
                  work = 0.1 if dist.get_rank() == 1 else 0.02\n\
                  print('up', flush=True)\n\
                  for step in range(100000):\n    time.sleep(work)\n    opt.zero_grad()\n    model(torch.ones(2, 4)).sum().backward()\n    for p in model.parameters():\n        dist.all_reduce(p.grad)\n    opt.step()\n";
    let job = Job::start("straggler", "3", &[&python, "-c", script]);
    wait_for("a few steps on every rank", Duration::from_secs(60), || {
        job.status()["ranks"].as_array().unwrap().iter().all(|r| r["steps"].as_u64().unwrap_or(0) >= 5)
    });
    // the shares settle as steps accumulate; what follows is read from the
    // status that named it
    let mut named = serde_json::Value::Null;
    wait_for("rank 1 named as the straggler", Duration::from_secs(60), || {
        named = job.status();
        named["stragglers"] == serde_json::json!([1])
    });
    for r in named["ranks"].as_array().unwrap() {
        assert!(r["collectives"].as_u64().unwrap() >= 10, "{r}");
        let wait = r["wait_fraction"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&wait), "{r}");
    }
    let waits: Vec<f64> =
        named["ranks"].as_array().unwrap().iter().map(|r| r["wait_fraction"].as_f64().unwrap()).collect();
    assert!(waits[1] < waits[0].max(waits[2]) / 2.0, "{waits:?}");
    assert!(waits[0] > waits[1] && waits[2] > waits[1], "{waits:?}");
}

/// `kolo top` in a real terminal (tmux): every rank's row, a narrow
/// terminal that still draws, and `q` to quit.
#[test]
fn top_draws_every_rank_in_a_terminal_and_quits_on_q() {
    if Command::new("tmux").arg("-V").output().is_err() {
        assert!(std::env::var_os("CI").is_none(), "tmux is missing (.ci/run installs it)");
        eprintln!("skipped: no tmux");
        return;
    }
    let job = Job::start("top", "3", &["sleep", "1000"]);
    let server = format!("kolo-top-test-{}", std::process::id());
    let tmux = |args: &[&str]| Command::new("tmux").arg("-L").arg(&server).args(args).output().unwrap();
    let command = format!("env XDG_RUNTIME_DIR={} {} top", job.runtime.path().display(), env!("CARGO_BIN_EXE_kolo"));
    let out = tmux(&["new-session", "-d", "-s", "top", "-x", "120", "-y", "20", &command]);
    assert!(out.status.success(), "{}", stderr(&out));
    struct Server<'a>(&'a dyn Fn(&[&str]) -> std::process::Output);
    impl Drop for Server<'_> {
        fn drop(&mut self) {
            (self.0)(&["kill-server"]);
        }
    }
    let _server = Server(&tmux);
    let screen = || stdout(&tmux(&["capture-pane", "-p", "-t", "top"]));
    wait_for("every rank's row", Duration::from_secs(20), || {
        let s = screen();
        s.contains("kolo top: job")
            && (0..3).all(|r| s.lines().any(|l| l.starts_with(&format!("│{r} ")) && l.contains("sleeping")))
    });
    assert!(screen().contains("RANK") && screen().contains("q quits"), "{}", screen());
    // narrow: the table is cut, not the program
    tmux(&["resize-window", "-t", "top", "-x", "40", "-y", "8"]);
    wait_for("the narrow screen", Duration::from_secs(10), || {
        screen().lines().next().is_some_and(|l| l.chars().count() == 40)
    });
    assert!(screen().contains("│0 "), "{}", screen());
    tmux(&["send-keys", "-t", "top", "q"]);
    wait_for("kolo top to quit", Duration::from_secs(10), || !tmux(&["has-session", "-t", "top"]).status.success());
    // the job goes on meanwhile
    assert_eq!(job.status()["ranks"][0]["state"], "sleeping");
}

#[test]
fn top_without_a_terminal_says_what_to_use_instead() {
    let job = Job::start("top-pipe", "1", &["sleep", "1000"]);
    let out = job.kolo(&["top"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("kolo top draws on a terminal; for a pipe or a file use kolo status --json"),
        "{}",
        stderr(&out)
    );
}

/// A job of over a minute whose rank 1 does five times the work per step
/// ends with a line naming it; the others are not named.
#[test]
fn a_long_job_says_at_its_end_which_rank_the_others_waited_for() {
    let Some(python) = python_with("torch") else { return };
    let script = "import time\n\
                  import torch, torch.distributed as dist\n\
                  dist.init_process_group('gloo')\n\
                  work = 0.1 if dist.get_rank() == 1 else 0.02\n\
                  t = torch.ones(4)\n\
                  began = time.time()\n\
                  while True:\n    time.sleep(work)\n    dist.all_reduce(t)\n    stop = torch.tensor([float(time.time() - began > 65)])\n    dist.all_reduce(stop)\n    if stop.item() > 0:\n        break\n\
                  dist.destroy_process_group()\n";
    let runtime = TempDir::new("straggler-summary");
    let out = kolo()
        .env("XDG_RUNTIME_DIR", runtime.path())
        .args(["run", "-np", "3", "--", &python, "-c", script])
        .output_within(JOB_DEADLINE);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("kolo: rank 1 was the slowest in "), "{err}");
    assert!(!err.contains("kolo: rank 0 was the slowest") && !err.contains("kolo: rank 2 was the slowest"), "{err}");
}
