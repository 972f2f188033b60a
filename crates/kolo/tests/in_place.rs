//! `kolo run --in-place` on real processes (local engine, simulated
//! nodes) with the training demo in its elastic mode: a killed rank, a
//! lost host, a host discovery adds, the reset limit and the elastic
//! timeout. Survivors keep their processes; nothing is left behind.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn train() -> PathBuf {
    let kolo = PathBuf::from(env!("CARGO_BIN_EXE_kolo"));
    let train = kolo.parent().unwrap().join("examples").join("train");
    assert!(train.exists(), "{} is missing: build it with cargo build --examples", train.display());
    train
}

/// A running `kolo run` whose output is collected as it comes.
struct Job {
    child: Child,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Job {
    fn start(args: &[&str]) -> Job {
        let mut child = kolo().args(args).start(Stdio::piped(), Stdio::piped());
        let (stdout, stderr) = (Arc::new(Mutex::new(String::new())), Arc::new(Mutex::new(String::new())));
        let mut readers = Vec::new();
        for (pipe, text) in [
            (Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>, stdout.clone()),
            (Box::new(child.stderr.take().unwrap()), stderr.clone()),
        ] {
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let mut t = text.lock().unwrap();
                    t.push_str(&line);
                    t.push('\n');
                }
            }));
        }
        Job { child, stdout, stderr, readers }
    }

    fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    fn wait_for_output(&self, what: &str, limit: Duration) {
        wait_for_showing(
            &format!("'{what}' in kolo's output"),
            limit,
            || self.stdout().contains(what) || self.stderr().contains(what),
            || format!("==== kolo's stdout so far ====\n{}==== its stderr ====\n{}", self.stdout(), self.stderr()),
        );
    }

    /// Waits for kolo to exit: its status, stdout and stderr.
    fn finish(mut self) -> (std::process::ExitStatus, String, String) {
        let status = wait_within(&mut self.child, JOB_DEADLINE);
        for reader in self.readers.drain(..) {
            reader.join().unwrap();
        }
        (status, self.stdout(), self.stderr())
    }
}

/// The processes whose environment holds `KOLO_TEST_TAG=<tag>`, with
/// their environment.
fn tagged(tag: &str) -> Vec<(i32, BTreeMap<String, String>)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().filter_map(Result::ok) {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
        let env: BTreeMap<String, String> = environ
            .split(|&b| b == 0)
            .filter_map(|kv| {
                let kv = String::from_utf8_lossy(kv);
                kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect();
        let is_train = std::fs::read_to_string(entry.path().join("comm")).is_ok_and(|c| c.trim() == "train");
        if is_train && env.get("KOLO_TEST_TAG").map(String::as_str) == Some(tag) {
            found.push((pid, env));
        }
    }
    found
}

/// The pid of the training process started as `host:local_rank`.
fn process(tag: &str, host: &str, local_rank: u32) -> i32 {
    let matches: Vec<i32> = tagged(tag)
        .into_iter()
        .filter(|(_, env)| {
            env.get("HOROVOD_HOSTNAME").map(String::as_str) == Some(host)
                && env.get("HOROVOD_LOCAL_RANK") == Some(&local_rank.to_string())
        })
        .map(|(pid, _)| pid)
        .collect();
    assert_eq!(matches.len(), 1, "processes {host}:{local_rank} of {tag}: {matches:?}");
    matches[0]
}

fn final_loss(stdout: &str) -> f32 {
    let line = stdout.lines().find(|l| l.contains("final loss")).unwrap_or_else(|| panic!("no final loss: {stdout}"));
    line.split("final loss ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap()
}

fn nothing_left(tag: &str) {
    wait_for("the job's processes to be gone", Duration::from_secs(10), || tagged(tag).is_empty());
}

const EPOCHS: &str = "8";

/// The demo's final loss on four ranks without faults.
fn reference_loss() -> f32 {
    let train = train();
    let out = run(&["run", "--engine", "local", "-H", "a:2,b:2", "--", train.to_str().unwrap(), "--epochs", EPOCHS]);
    assert!(out.status.success(), "{}", stderr(&out));
    final_loss(&stdout(&out))
}

fn in_place_job(tag: &str, extra: &[&str]) -> Job {
    let train = train();
    let tag_var = format!("KOLO_TEST_TAG={tag}");
    let mut args = vec!["run", "--in-place", "--engine", "local", "-x", &tag_var];
    args.extend_from_slice(extra);
    args.extend(["--", train.to_str().unwrap(), "--epochs", EPOCHS, "--step-ms", "3", "--commit-every", "8"]);
    Job::start(&args)
}

/// An in-place job of `sh -c SCRIPT` on hosts a and b, a slot each (one
/// process is enough), its processes tagged `tag`.
fn shell_job_on_a_and_b(tag: &str, extra: &[&str], script: &str) -> Job {
    let tag_var = format!("KOLO_TEST_TAG={tag}");
    let mut args = vec!["run", "--in-place", "--engine", "local", "-H", "a:1,b:1", "--min-np", "1"];
    args.extend_from_slice(extra);
    args.extend(["-x", &tag_var, "--", "sh", "-c", script]);
    Job::start(&args)
}

/// Waits for the shells of [`shell_job_on_a_and_b`] to be gone.
fn no_shell_left(tag: &str) {
    wait_for("the job's processes to be gone", Duration::from_secs(10), || pids_of_tagged_shells(tag).is_empty());
}

#[test]
fn a_killed_rank_leaves_the_others_running_and_the_demo_ends_where_a_clean_run_does() {
    let reference = reference_loss();
    let tag = "in-place-killed";
    let job = in_place_job(tag, &["-H", "a:2,b:2", "-np", "4", "--min-np", "2"]);
    job.wait_for_output("epoch   2", Duration::from_secs(60));
    let survivors = [process(tag, "a", 0), process(tag, "a", 1)];
    let on_b = process(tag, "b", 0);
    kill(Pid::from_raw(process(tag, "b", 1)), Signal::SIGKILL).unwrap();
    // Horovod's rule: host b is out, with its other process
    job.wait_for_output("round 1: 2 processes on a:2", Duration::from_secs(30));
    wait_for("b:0 to be removed", Duration::from_secs(10), || !alive(on_b));
    assert!(survivors.iter().all(|&p| alive(p)), "host a's processes were restarted");
    let (status, out, err) = job.finish();
    assert!(status.success(), "{out}{err}");
    assert!(err.contains("rank 3 on host b was killed by signal 9 (SIGKILL)"), "{err}");
    assert!(err.contains("host b is blacklisted for the rest of the job"), "{err}");
    assert!(!err.contains("round 2"), "{err}");
    assert!(out.contains("round ended at epoch"), "{out}");
    assert!(out.contains("2 ranks from epoch"), "{out}");
    let loss = final_loss(&out);
    assert!((loss - reference).abs() < 0.01, "final loss {loss}, {reference} without the fault\n{out}");
    nothing_left(tag);
}

#[test]
fn a_lost_host_is_left_out_and_the_survivors_finish_on_their_own() {
    let tag = "in-place-lost";
    let job = in_place_job(tag, &["-H", "a:2,b:2", "-np", "4", "--min-np", "2"]);
    job.wait_for_output("epoch   2", Duration::from_secs(60));
    let survivors = [process(tag, "a", 0), process(tag, "a", 1)];
    // the agent of b:0 (its rank's parent) dies: kolo loses host b
    let agent = std::fs::read_to_string(format!("/proc/{}/stat", process(tag, "b", 0))).unwrap();
    let agent: i32 = agent.rsplit(')').next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kill(Pid::from_raw(agent), Signal::SIGKILL).unwrap();
    job.wait_for_output("round 1: 2 processes on a:2", Duration::from_secs(30));
    assert!(survivors.iter().all(|&p| alive(p)), "host a's processes were restarted");
    let (status, out, err) = job.finish();
    assert!(status.success(), "{out}{err}");
    assert!(err.contains("on host b was lost"), "{err}");
    assert!(!err.contains("round 2"), "host b came back: {err}");
    assert!(out.contains("2 ranks from epoch"), "{out}");
    assert!(final_loss(&out) < 0.35, "{out}");
    nothing_left(tag);
}

#[test]
fn a_host_discovery_adds_joins_at_the_next_commit() {
    let tag = "in-place-grow";
    let dir = TempDir::new("in-place-grow");
    let grow = dir.path().join("grow");
    let script = dir.path().join("discover.sh");
    std::fs::write(&script, format!("#!/bin/sh\necho a:2\n[ -e {} ] && echo b:2\nexit 0\n", grow.display())).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let script = script.to_string_lossy().into_owned();
    let args = ["--min-np", "2", "--max-np", "4", "--host-discovery-script", &script, "--discovery-interval", "0.1"];
    let job = in_place_job(tag, &args);
    job.wait_for_output("epoch   2", Duration::from_secs(60));
    let first = [process(tag, "a", 0), process(tag, "a", 1)];
    std::fs::write(&grow, "").unwrap();
    job.wait_for_output("round 1: 4 processes on a:2,b:2", Duration::from_secs(30));
    let (status, out, err) = job.finish();
    assert!(status.success(), "{out}{err}");
    assert!(out.contains("2 ranks from epoch 1 step 0"), "{out}");
    assert!(out.contains("4 ranks from epoch"), "{out}");
    // growing loses no work: the round ends at a commit, the next starts there
    let ended = out.lines().find(|l| l.contains("round ended at")).expect("the first round's end");
    // the rank hears of the new round either from its own check of the
    // hosts or from the job having moved on first; both end at a commit
    assert!(
        ended.contains("the hosts changed: round 1 is starting") || ended.contains("the job moved on to round 1"),
        "{out}"
    );
    let at = ended.split("round ended at ").nth(1).unwrap().split(':').next().unwrap();
    assert!(out.contains(&format!("4 ranks from {at} (")), "resumed elsewhere than {at}: {out}");
    assert!(final_loss(&out) < 0.35, "{out}");
    assert!(first.iter().all(|&p| !alive(p)));
    nothing_left(tag);
}

#[test]
fn past_the_reset_limit_the_job_stops_saying_so_and_leaves_nothing() {
    let tag = "in-place-reset";
    // every process kolo starts on b fails at once
    let job = shell_job_on_a_and_b(
        tag,
        &["--reset-limit", "2", "--cooldown-range", "1:1", "--discovery-interval", "0.05"],
        "[ $HOROVOD_HOSTNAME = b ] && exit 5; exec sleep 1000",
    );
    let (status, out, err) = job.finish();
    assert_eq!(status.code(), Some(1), "{out}{err}");
    assert_eq!(err.matches("rank 1 on host b exited with code 5").count(), 2, "{err}");
    assert!(err.contains("--reset-limit"), "{err}");
    no_shell_left(tag);
}

#[test]
fn a_host_that_keeps_failing_is_blacklisted_and_comes_back_after_its_cooldown() {
    let tag = "in-place-cooldown";
    let dir = TempDir::new("in-place-cooldown");
    // b's first two processes fail, each sending b out for its cooldown;
    // the third succeeds and lets a finish
    let script = format!(
        "cd {}; if [ $HOROVOD_HOSTNAME = b ]; then echo try; echo x >> tries; [ $(wc -l < tries) -le 2 ] && exit 5; touch done; exit 0; fi; \
         while [ ! -e done ]; do sleep 0.05; done",
        dir.path().display()
    );
    let job = shell_job_on_a_and_b(tag, &["--cooldown-range", "1:1", "--discovery-interval", "0.1"], &script);
    let (status, out, err) = job.finish();
    assert!(status.success(), "{out}{err}");
    assert_eq!(err.matches("rank 1 on host b exited with code 5").count(), 2, "{err}");
    // each cohort's processes are labelled after the earlier ones'
    for label in 1..=3 {
        assert!(out.contains(&format!("[{label}]<stdout>:try")), "{out}");
    }
    // out after each failure, back after the cooldown
    assert_eq!(err.matches("host b is blacklisted for 1.0 s").count(), 2, "{err}");
    let blacklisted = err.find("host b is blacklisted for 1.0 s").unwrap_or_else(|| panic!("{err}"));
    let without_b = err.find("round 3: 1 process on a:1").unwrap_or_else(|| panic!("{err}"));
    let back = err.find("round 4: 2 processes on a:1,b:1").unwrap_or_else(|| panic!("{err}"));
    assert!(blacklisted < back && without_b < back, "{err}");
    no_shell_left(tag);
}

/// Shell and sleep processes of a job (the reset test's ranks).
fn pids_of_tagged_shells(tag: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().filter_map(Result::ok) {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
        if environ.split(|&b| b == 0).any(|kv| kv == format!("KOLO_TEST_TAG={tag}").as_bytes()) {
            found.push(pid);
        }
    }
    found
}

#[test]
fn too_few_processes_for_longer_than_the_elastic_timeout_stop_the_job_saying_so() {
    let tag = "in-place-timeout";
    // b's cooldown outlasts the timeout: a wait that could end, but not in time
    let job = in_place_job(tag, &["-H", "a:2,b:2", "-np", "4", "--elastic-timeout", "1", "--cooldown-range", "60:60"]);
    job.wait_for_output("epoch   1", Duration::from_secs(60));
    let agent = std::fs::read_to_string(format!("/proc/{}/stat", process(tag, "b", 1))).unwrap();
    let agent: i32 = agent.rsplit(')').next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kill(Pid::from_raw(agent), Signal::SIGKILL).unwrap();
    let (status, out, err) = job.finish();
    assert_eq!(status.code(), Some(1), "{out}{err}");
    assert!(err.contains("waiting for 4 slots, 2 available"), "{err}");
    assert!(err.contains("timed out after 1 s waiting for 4 slots (--min-np) with 2 available"), "{err}");
    nothing_left(tag);
}

#[test]
fn processes_that_cannot_start_take_their_host_out_once_and_the_job_stops_saying_why() {
    let out = run(&[
        "run",
        "--in-place",
        "--engine",
        "local",
        "-H",
        "a:1",
        "--worker-program",
        "/nonexistent/agent",
        "--elastic-timeout",
        "1",
        "--",
        "true",
    ]);
    let err = failed_with(&out, 1);
    // once: a start that failed is not retried in a loop
    assert_eq!(err.matches("could not start").count(), 1, "{err}");
    assert!(err.contains("host a is blacklisted for the rest of the job"), "{err}");
    // nothing can bring a slot back: no waiting out the elastic timeout
    assert!(err.contains("0 slots are left on hosts not blacklisted, fewer than the 1 of --min-np"), "{err}");
    assert!(!err.contains("waiting for"), "{err}");
}
