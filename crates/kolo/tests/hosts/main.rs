//! kolo across real hosts: the three test hosts of tests/hosts/
//! (network namespaces with sshd and a Slurm cluster). kolo is driven from
//! inside h1. These need the hosts up (`bash .ci/run` brings them up), so
//! they are ignored in a plain `cargo nextest run`.
//!
//! One binary, a module per engine or feature; the helpers they share are
//! here.

#[path = "../common.rs"]
mod common;
mod elastic;
mod frameworks;
mod security;
mod slurm;
mod ssh;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;

fn testhosts() -> PathBuf {
    let t = PathBuf::from(std::env::var("KOLO_TESTHOSTS").unwrap_or_else(|_| "/tmp/kolo-testhosts".into()));
    assert!(t.join("hx").exists(), "the test hosts are not up: run sh tests/hosts/up as root (or bash .ci/run)");
    t
}

/// `CMD` inside h1, with the test cluster's Slurm config.
fn command_in_h1(cmd: &[&str]) -> Command {
    let t = testhosts();
    let mut command = Command::new(t.join("hx"));
    command.arg("h1").args(cmd).env("SLURM_CONF", t.join("slurm/slurm.conf"));
    command
}

/// `kolo ARGS` inside h1, with the test cluster's Slurm config.
fn kolo_command_in_h1(args: &[&str]) -> Command {
    let mut command = command_in_h1(&[env!("CARGO_BIN_EXE_kolo")]);
    command.args(args);
    command
}

/// Runs `kolo ARGS` inside h1.
fn kolo_in_h1(args: &[&str]) -> Output {
    kolo_command_in_h1(args).output_within(JOB_DEADLINE)
}

/// `salloc ALLOCATION kolo run ARGS`, for [`in_h1`]: `kolo run` in a Slurm
/// allocation (`-N3 --ntasks-per-node=1`, say).
fn salloc_kolo_run<'a>(allocation: &[&'a str], args: &[&'a str]) -> Vec<&'a str> {
    [&["salloc"][..], allocation, &[env!("CARGO_BIN_EXE_kolo"), "run"], args].concat()
}

fn ssh_config() -> String {
    testhosts().join("ssh/ssh_config").to_string_lossy().into_owned()
}

fn example(name: &str) -> String {
    let kolo = PathBuf::from(env!("CARGO_BIN_EXE_kolo"));
    let path = kolo.parent().unwrap().join("examples").join(name);
    assert!(path.exists(), "{} is missing: build the examples", path.display());
    path.to_string_lossy().into_owned()
}

/// Processes of the kind a job starts that still run on a host.
fn leftovers(host: &str) -> Vec<String> {
    let out = Command::new("ip").args(["netns", "pids", &format!("kolo-{host}")]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|pid| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            let comm = comm.trim();
            let ours =
                matches!(comm, "kolo" | "sleep" | "sh" | "train" | "allreduce_check") || comm.starts_with("python");
            (alive(pid.parse().ok()?) && ours).then(|| format!("{pid} {comm}"))
        })
        .collect()
}

/// What `look` finds once it finds nothing, or after two seconds: what is
/// on its way out gets a moment.
fn settled(mut look: impl FnMut() -> Vec<String>) -> Vec<String> {
    let mut found = look();
    for _ in 0..200 {
        if found.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        found = look();
    }
    found
}

fn assert_nothing_left() {
    for host in ["h1", "h2", "h3"] {
        let left = settled(|| leftovers(host));
        assert!(left.is_empty(), "left running on {host}: {left:?}");
    }
}

/// Puts h3's eth0 back up even when the test fails.
struct LinkDown(&'static str);

impl LinkDown {
    fn cut(host: &'static str) -> LinkDown {
        let ok =
            Command::new("ip").args(["-n", &format!("kolo-{host}"), "link", "set", "eth0", "down"]).status().unwrap();
        assert!(ok.success());
        LinkDown(host)
    }
}

impl Drop for LinkDown {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["-n", &format!("kolo-{}", self.0), "link", "set", "eth0", "up"]).status();
        // failed neighbour entries would keep the host unreachable for a while
        for host in ["h1", "h2", "h3"] {
            let _ = Command::new("ip").args(["-n", &format!("kolo-{host}"), "neigh", "flush", "all"]).status();
        }
        let cfg = ssh_config();
        let t = testhosts();
        wait_for("the host to be reachable again", Duration::from_secs(30), || {
            Command::new(t.join("hx"))
                .args(["h1", "ssh", "-F", &cfg, "-o", "ConnectTimeout=2", self.0, "true"])
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
    }
}

/// Starts `kolo ARGS -- sh -c SCRIPT` inside h1 (stderr piped for the report).
fn spawn_in_h1(args: &[&str], script: &str) -> std::process::Child {
    kolo_command_in_h1(args).args(["--", "sh", "-c", script]).start(Stdio::null(), Stdio::piped())
}

/// Runs a command inside h1 with the test cluster's Slurm config.
fn in_h1(cmd: &[&str]) -> Output {
    command_in_h1(cmd).output_within(JOB_DEADLINE)
}

fn slurm_jobs() -> String {
    stdout(&in_h1(&["squeue", "-h", "-o", "%i %j %T"]))
}

/// Kills (or stops) the agent of rank 2 (on h2) and checks that the job
/// ends naming it and that nothing of the job is left on any host.
fn agent_fault_leaves_nothing(engine: &[&str], signal: nix::sys::signal::Signal) {
    let dir = TempDir::new("hosts-agent");
    // where the driver and, through srun, Slurm's agents make the ranks'
    // private directories (ssh passes no TMPDIR: those go to /tmp)
    let tmp = TempDir::new("hosts-agent-tmp");
    let script = format!("echo $$ $PPID > {}/$HOROVOD_RANK.pid; exec sleep 1000", dir.path().display());
    let mut args = vec!["run", "-np", "6", "--kill-grace", "1"];
    args.extend_from_slice(engine);
    let child = kolo_command_in_h1(&args)
        .args(["--", "sh", "-c", &script])
        .env("TMPDIR", tmp.path())
        .start(Stdio::null(), Stdio::piped());
    wait_for("six ranks to start", Duration::from_secs(30), || pids_in(dir.path()).len() == 12);
    let text = std::fs::read_to_string(dir.path().join("2.pid")).unwrap();
    let agent: i32 = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(agent), signal).unwrap();
    let out = output_within(child, JOB_DEADLINE);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("rank 2 on host h2 was lost"), "{}", stderr(&out));
    wait_for("every rank and agent to end", Duration::from_secs(20), || pids_in(dir.path()).iter().all(|&p| !alive(p)));
    wait_for("the cluster to be empty", Duration::from_secs(30), || slurm_jobs().trim().is_empty());
    wait_for("the ranks' private directories to go", Duration::from_secs(20), || {
        std::fs::read_dir(tmp.path()).unwrap().next().is_none()
    });
    assert_nothing_left();
}

/// The pids of kolo's processes (agents and ranks) on `host`.
fn job_processes(host: &str) -> Vec<i32> {
    leftovers(host)
        .into_iter()
        .filter(|p| p.ends_with(" kolo") || p.ends_with(" train"))
        .filter_map(|p| p.split_whitespace().next()?.parse().ok())
        .collect()
}

/// SIGKILLs the one training process (the demo) on `host`.
fn kill_the_training_rank_on(host: &str) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(training_rank_on(host)), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
}

/// The pid of the one training process (the demo) on `host`.
fn training_rank_on(host: &str) -> i32 {
    let ranks: Vec<i32> = job_processes(host)
        .into_iter()
        .filter(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "train"))
        .collect();
    assert_eq!(ranks.len(), 1, "training processes on {host}: {ranks:?}");
    ranks[0]
}

/// A discovery script printing h1 and h2, and h3 too once `grow` exists.
fn discovery_on_hosts(dir: &std::path::Path, grow: &std::path::Path) -> String {
    let path = dir.join("discover.sh");
    std::fs::write(&path, format!("#!/bin/sh\necho h1:1\necho h2:1\n[ -e {} ] && echo h3:1\nexit 0\n", grow.display()))
        .unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    path.to_string_lossy().into_owned()
}

/// `kolo run --in-place` over ssh on h1, h2 and h3, a slot each, from h1:
/// those options, then `rest` (more options, `--` and the command).
fn in_place_on_three_hosts(rest: &[&str]) -> Streaming {
    let cfg = ssh_config();
    let mut args = vec!["run", "--in-place", "-H", "h1:1,h2:1,h3:1", "--ssh-config", &cfg];
    args.extend_from_slice(rest);
    Streaming::start(&args)
}

/// A command in h1 (`kolo ARGS`, or any) with its stdout and stderr
/// collected as they come.
struct Streaming {
    child: std::process::Child,
    text: std::sync::Arc<std::sync::Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Streaming {
    fn start(args: &[&str]) -> Streaming {
        let mut cmd = vec![env!("CARGO_BIN_EXE_kolo")];
        cmd.extend_from_slice(args);
        Streaming::in_h1(&cmd)
    }

    fn in_h1(cmd: &[&str]) -> Streaming {
        let mut child = command_in_h1(cmd).start(Stdio::piped(), Stdio::piped());
        let text = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let pipes: [Box<dyn std::io::Read + Send>; 2] =
            [Box::new(child.stdout.take().unwrap()), Box::new(child.stderr.take().unwrap())];
        let readers = pipes
            .into_iter()
            .map(|pipe| {
                let text = text.clone();
                std::thread::spawn(move || {
                    use std::io::BufRead;
                    for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                        text.lock().unwrap().push_str(&(line + "\n"));
                    }
                })
            })
            .collect();
        Streaming { child, text, readers }
    }

    /// Until the job has printed `what`, failing with what it printed so
    /// far (a job that is slow reads apart from one that is stuck).
    fn wait_for(&self, what: &str) {
        wait_for_showing(
            &format!("'{what}'"),
            Duration::from_secs(60),
            || self.text.lock().unwrap().contains(what),
            || format!("the job printed:\n{}\n", self.text.lock().unwrap()),
        );
    }

    fn finish(mut self) -> (bool, String) {
        let ok = wait_within(&mut self.child, JOB_DEADLINE).success();
        for reader in self.readers.drain(..) {
            reader.join().unwrap();
        }
        let text = self.text.lock().unwrap().clone();
        (ok, text)
    }
}
