//! kolo across real hosts: the three test hosts of tests/hosts/
//! (network namespaces with sshd and a Slurm cluster). kolo is driven from
//! inside h1. These need the hosts up (`bash .ci/run` brings them up), so
//! they are ignored in a plain `cargo nextest run`.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use common::*;

fn testhosts() -> PathBuf {
    let t = PathBuf::from(std::env::var("KOLO_TESTHOSTS").unwrap_or_else(|_| "/tmp/kolo-testhosts".into()));
    assert!(t.join("hx").exists(), "the test hosts are not up: run sh tests/hosts/up as root (or bash .ci/run)");
    t
}

/// Runs `kolo ARGS` inside h1.
fn kolo_in_h1(args: &[&str]) -> Output {
    let t = testhosts();
    Command::new(t.join("hx"))
        .arg("h1")
        .arg(env!("CARGO_BIN_EXE_kolo"))
        .args(args)
        .env("SLURM_CONF", t.join("slurm/slurm.conf"))
        .output()
        .expect("hx runs")
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

#[test]
#[ignore = "needs the test hosts"]
fn ssh_six_workers_on_three_hosts() {
    let cfg = ssh_config();
    let out = kolo_in_h1(&[
        "run",
        "-np",
        "6",
        "-H",
        "h1:2,h2:2,h3:2",
        "--ssh-config",
        &cfg,
        "--",
        "sh",
        "-c",
        "echo $(hostname) $HOROVOD_RANK $HOROVOD_LOCAL_RANK $HOROVOD_CROSS_RANK $HOROVOD_HOSTNAME $HOROVOD_GLOO_IFACE",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut lines: Vec<String> = stdout(&out).lines().map(String::from).collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            "[0]<stdout>:h1 0 0 0 h1 eth0",
            "[1]<stdout>:h1 1 1 0 h1 eth0",
            "[2]<stdout>:h2 2 0 1 h2 eth0",
            "[3]<stdout>:h2 3 1 1 h2 eth0",
            "[4]<stdout>:h3 4 0 2 h3 eth0",
            "[5]<stdout>:h3 5 1 2 h3 eth0",
        ]
    );
    assert_nothing_left();
}

#[test]
#[ignore = "needs the test hosts"]
fn allreduce_and_training_across_three_hosts() {
    let cfg = ssh_config();
    let check = example("allreduce_check");
    let out = kolo_in_h1(&["run", "-np", "6", "-H", "h1:2,h2:2,h3:2", "--ssh-config", &cfg, "--", &check]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let ok = stdout(&out).lines().filter(|l| l.contains("on 3 hosts: allreduce sums ok (21)")).count();
    assert_eq!(ok, 6, "{}", stdout(&out));
    let train = example("train");
    let out =
        kolo_in_h1(&["run", "-np", "6", "-H", "h1:2,h2:2,h3:2", "--ssh-config", &cfg, "--", &train, "--epochs", "3"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains("[0]<stdout>:final loss"), "{}", stdout(&out));
    assert_nothing_left();
}

#[test]
#[ignore = "needs the test hosts"]
fn nic_detection_finds_the_shared_interfaces() {
    let cfg = ssh_config();
    let out = kolo_in_h1(&["nics", "-H", "h1,h2,h3", "--ssh-config", &cfg]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("common: eth0\n"), "{}", stdout(&out));
    assert!(stdout(&out).contains("h3 -> h1: eth0 (10.77.0.11) ok"), "{}", stdout(&out));
    let out = kolo_in_h1(&["nics", "-H", "h1,h2", "--ssh-config", &cfg]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("common: eth0,eth1\n"), "{}", stdout(&out));
    assert_nothing_left();
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

#[test]
#[ignore = "needs the test hosts"]
fn a_cut_off_host_fails_the_start_naming_it() {
    let cfg = ssh_config();
    let _cut = LinkDown::cut("h3");
    let out = kolo_in_h1(&[
        "run",
        "-np",
        "6",
        "-H",
        "h1:2,h2:2,h3:2",
        "--ssh-config",
        &cfg,
        "--start-timeout",
        "10",
        "--",
        "true",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("h3"), "{err}");
    assert!(!err.contains("h1 (") && !err.contains("h2 ("), "only h3 is unreachable: {err}");
    assert_nothing_left();
}

#[test]
#[ignore = "needs the test hosts"]
fn a_worker_killed_on_h2_ends_the_job_naming_h2() {
    let cfg = ssh_config();
    let dir = TempDir::new("hosts-kill");
    let script = format!("echo $$ > {}/$HOROVOD_RANK.pid; exec sleep 1000", dir.path().display());
    let t = testhosts();
    let child = Command::new(t.join("hx"))
        .args(["h1", env!("CARGO_BIN_EXE_kolo"), "run", "-np", "6", "-H", "h1:2,h2:2,h3:2", "--ssh-config", &cfg])
        .args(["--kill-grace", "1", "--", "sh", "-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("six ranks to start", Duration::from_secs(30), || pids_in(dir.path()).len() == 6);
    let victim: i32 = std::fs::read_to_string(dir.path().join("2.pid")).unwrap().trim().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim), nix::sys::signal::Signal::SIGKILL).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(137), "{}", stderr(&out));
    assert!(stderr(&out).contains("rank 2 on host h2 was killed by signal 9"), "{}", stderr(&out));
    for pid in pids_in(dir.path()) {
        assert!(!alive(pid), "rank process {pid} outlived the job");
    }
    assert_nothing_left();
}

/// Starts `kolo ARGS -- sh -c SCRIPT` inside h1 (stderr piped for the report).
fn spawn_in_h1(args: &[&str], script: &str) -> std::process::Child {
    let t = testhosts();
    Command::new(t.join("hx"))
        .arg("h1")
        .arg(env!("CARGO_BIN_EXE_kolo"))
        .args(args)
        .args(["--", "sh", "-c", script])
        .env("SLURM_CONF", t.join("slurm/slurm.conf"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Runs a command inside h1 with the test cluster's Slurm config.
fn in_h1(cmd: &[&str]) -> Output {
    let t = testhosts();
    Command::new(t.join("hx")).arg("h1").args(cmd).env("SLURM_CONF", t.join("slurm/slurm.conf")).output().unwrap()
}

fn slurm_jobs() -> String {
    stdout(&in_h1(&["squeue", "-h", "-o", "%i %j %T"]))
}

#[test]
#[ignore = "needs the test hosts"]
fn slurm_inside_an_allocation_three_nodes_two_tasks_each() {
    let kolo = env!("CARGO_BIN_EXE_kolo");
    let out = in_h1(&[
        "salloc",
        "-N3",
        "--ntasks-per-node=2",
        kolo,
        "run",
        "--",
        "sh",
        "-c",
        "echo $(hostname) $HOROVOD_RANK $HOROVOD_LOCAL_RANK $HOROVOD_CROSS_RANK $HOROVOD_GLOO_IFACE",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut lines: Vec<String> = stdout(&out).lines().filter(|l| l.starts_with('[')).map(String::from).collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            "[0]<stdout>:h1 0 0 0 eth0",
            "[1]<stdout>:h1 1 1 0 eth0",
            "[2]<stdout>:h2 2 0 1 eth0",
            "[3]<stdout>:h2 3 1 1 eth0",
            "[4]<stdout>:h3 4 0 2 eth0",
            "[5]<stdout>:h3 5 1 2 eth0",
        ]
    );
    let check = example("allreduce_check");
    let out = in_h1(&["salloc", "-N3", "--ntasks-per-node=2", kolo, "run", "--", &check]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(stdout(&out).lines().filter(|l| l.contains("allreduce sums ok (21)")).count(), 6, "{}", stdout(&out));
    assert_nothing_left();
}

#[test]
#[ignore = "needs the test hosts"]
fn slurm_outside_an_allocation_asks_for_one_and_gives_it_back() {
    let out = kolo_in_h1(&["run", "--engine", "slurm", "-np", "6", "--slurm-nodes", "3", "--", "sh", "-c", "hostname"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut hosts: Vec<String> = stdout(&out).lines().map(|l| l.rsplit(':').next().unwrap().to_string()).collect();
    hosts.sort();
    assert_eq!(hosts, ["h1", "h1", "h2", "h2", "h3", "h3"]);
    wait_for("the allocation to be given back", Duration::from_secs(20), || slurm_jobs().trim().is_empty());
    assert_nothing_left();
}

#[test]
#[ignore = "needs the test hosts"]
fn scancel_ends_a_slurm_job_with_a_report() {
    let dir = TempDir::new("hosts-scancel");
    let script = format!("echo $$ > {}/$HOROVOD_RANK.pid; exec sleep 1000", dir.path().display());
    let child =
        spawn_in_h1(&["run", "--engine", "slurm", "-np", "6", "--slurm-nodes", "3", "--kill-grace", "1"], &script);
    wait_for("six ranks to start", Duration::from_secs(30), || pids_in(dir.path()).len() == 6);
    let jobs = slurm_jobs();
    let job = jobs.split_whitespace().next().expect("a running job").to_string();
    assert!(in_h1(&["scancel", &job]).status.success());
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("rank") && err.contains("on host h"), "{err}");
    for pid in pids_in(dir.path()) {
        assert!(!alive(pid), "rank process {pid} outlived the job");
    }
    wait_for("the allocation to end", Duration::from_secs(30), || slurm_jobs().trim().is_empty());
    assert_nothing_left();
}

#[test]
#[ignore = "needs the test hosts"]
fn a_busy_slurm_cluster_fails_within_the_placement_timeout() {
    // every CPU of every node taken as often as the partition shares it
    // (OverSubscribe=FORCE:4): a new allocation has to wait in the queue
    let mut blockers = Vec::new();
    for _ in 0..4 {
        let out = in_h1(&["salloc", "--no-shell", "-N3", "--ntasks-per-node=4", "-t", "5"]);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stderr(&out);
        let id = text.split_whitespace().skip_while(|w| *w != "allocation").nth(1).expect("a job id").to_string();
        blockers.push(id);
    }
    let start = std::time::Instant::now();
    let out = kolo_in_h1(&["run", "--engine", "slurm", "-np", "1", "--placement-timeout", "2", "--", "true"]);
    let waited = start.elapsed();
    for id in &blockers {
        in_h1(&["scancel", id]);
    }
    assert!(!out.status.success());
    assert!(waited < Duration::from_secs(20), "waited {waited:?}");
    let err = stderr(&out);
    assert!(err.contains("within the placement timeout (2 s)"), "{err}");
    wait_for("the cluster to be empty", Duration::from_secs(30), || slurm_jobs().trim().is_empty());
    assert_nothing_left();
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
    let t = testhosts();
    let child = Command::new(t.join("hx"))
        .arg("h1")
        .arg(env!("CARGO_BIN_EXE_kolo"))
        .args(&args)
        .args(["--", "sh", "-c", &script])
        .env("SLURM_CONF", t.join("slurm/slurm.conf"))
        .env("TMPDIR", tmp.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("six ranks to start", Duration::from_secs(30), || pids_in(dir.path()).len() == 12);
    let text = std::fs::read_to_string(dir.path().join("2.pid")).unwrap();
    let agent: i32 = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(agent), signal).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("rank 2 on host h2 was lost"), "{}", stderr(&out));
    wait_for("every rank and agent to end", Duration::from_secs(20), || pids_in(dir.path()).iter().all(|&p| !alive(p)));
    wait_for("the cluster to be empty", Duration::from_secs(30), || slurm_jobs().trim().is_empty());
    wait_for("the ranks' private directories to go", Duration::from_secs(20), || {
        std::fs::read_dir(tmp.path()).unwrap().next().is_none()
    });
    assert_nothing_left();
}

#[test]
#[ignore = "needs the test hosts"]
fn a_killed_or_stopped_agent_leaves_nothing_over_ssh() {
    let cfg = ssh_config();
    for signal in [nix::sys::signal::Signal::SIGKILL, nix::sys::signal::Signal::SIGSTOP] {
        agent_fault_leaves_nothing(&["-H", "h1:2,h2:2,h3:2", "--ssh-config", &cfg], signal);
    }
}

#[test]
#[ignore = "needs the test hosts"]
fn a_killed_or_stopped_agent_leaves_nothing_under_slurm() {
    for signal in [nix::sys::signal::Signal::SIGKILL, nix::sys::signal::Signal::SIGSTOP] {
        agent_fault_leaves_nothing(&["--engine", "slurm", "--slurm-nodes", "3"], signal);
    }
}

#[test]
#[ignore = "needs the test hosts"]
fn a_killed_driver_gives_back_its_slurm_allocation_and_leaves_no_file() {
    let dir = TempDir::new("hosts-driver-killed");
    let tmp = TempDir::new("hosts-driver-killed-tmp");
    let script = format!("echo $$ > {}/$HOROVOD_RANK.pid; exec sleep 1000", dir.path().display());
    let t = testhosts();
    let mut child = Command::new(t.join("hx"))
        .args(["h1", env!("CARGO_BIN_EXE_kolo"), "run", "--engine", "slurm", "-np", "6", "--slurm-nodes", "3"])
        .args(["--", "sh", "-c", &script])
        .env("SLURM_CONF", t.join("slurm/slurm.conf"))
        .env("TMPDIR", tmp.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for("six ranks to start", Duration::from_secs(30), || pids_in(dir.path()).len() == 6);
    assert!(!slurm_jobs().trim().is_empty());
    // hx execs its way to kolo: this kills the driver itself
    child.kill().unwrap();
    child.wait().unwrap();
    wait_for("the janitor to give the allocation back", Duration::from_secs(30), || slurm_jobs().trim().is_empty());
    wait_for("every rank to end", Duration::from_secs(30), || pids_in(dir.path()).iter().all(|&p| !alive(p)));
    wait_for("the janitor to remove its files", Duration::from_secs(10), || {
        std::fs::read_dir(tmp.path()).unwrap().next().is_none()
    });
    assert_nothing_left();
}

/// Launched from h1 onto h2 and h3: rank 0 is on h2, and every rank must
/// reach JAX_COORDINATOR_ADDRESS there (where JAX's process 0 opens its
/// coordinator), not the driver's host.
#[test]
#[ignore = "needs the test hosts"]
fn rank_zero_away_from_the_driver_is_reachable_at_the_jax_coordinator() {
    let cfg = ssh_config();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/rank0_reachable.py");
    let script = script.to_string_lossy().into_owned();
    let out = kolo_in_h1(&["run", "-np", "4", "-H", "h2:2,h3:2", "--ssh-config", &cfg, "--", "python3", &script]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("rank 0 on h2 served 3 ranks at 10.77.0.12:"), "{text}");
    assert_eq!(text.lines().filter(|l| l.contains("reached rank 0 at 10.77.0.12:")).count(), 3, "{text}");
    assert_nothing_left();
}

/// Runs `script` on 4 ranks launched from h1 onto h2 and h3 (rank 0 on
/// h2) with the Python that has `module`; its stdout, or `None` when that
/// Python is missing (skipped).
fn across_hosts(module: &str, script: &str, extra: &[&str]) -> Option<String> {
    let python = python_with(module)?;
    let (cfg, script) = (ssh_config(), repo_file(script));
    let mut args = vec!["run", "-np", "4", "-H", "h2:2,h3:2", "--ssh-config", &cfg];
    args.extend(extra);
    args.extend(["--", &python, &script]);
    let out = kolo_in_h1(&args);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert_nothing_left();
    Some(text)
}

/// PyTorch DDP from h1 onto h2 and h3: every rank, rank 0 (on h2) included,
/// uses the store kolo serves on h1.
#[test]
#[ignore = "needs the test hosts"]
fn pytorch_ddp_across_hosts_with_rank_zero_away_from_the_driver() {
    let Some(text) = across_hosts("torch", "examples/ddp.py", &[]) else { return };
    assert!(text.contains("rank 0/4 on h2"), "{text}");
    assert_eq!(text.lines().filter(|l| l.contains("store 10.77.0.11:")).count(), 4, "{text}");
    let params: std::collections::HashSet<&str> =
        text.lines().filter_map(|l| l.split("params ").nth(1)?.split(',').next()).collect();
    assert_eq!(params.len(), 1, "{text}");
}

/// JAX's no-argument initialize across hosts, process 0 on h2.
#[test]
#[ignore = "needs the test hosts"]
fn jax_across_hosts_with_process_zero_away_from_the_driver() {
    let Some(text) = across_hosts("jax", "examples/jax_check.py", &["-x", "JAX_PLATFORMS=cpu"]) else { return };
    assert!(text.contains("process 0/4 on h2"), "{text}");
    assert_eq!(text.lines().filter(|l| l.contains("gathered [0, 1, 2, 3]")).count(), 4, "{text}");
}

/// PyTorch DDP through the Slurm engine: the store is the driver's there too.
#[test]
#[ignore = "needs the test hosts"]
fn pytorch_ddp_under_slurm() {
    let Some(python) = python_with("torch") else { return };
    let kolo = env!("CARGO_BIN_EXE_kolo");
    let script = repo_file("examples/ddp.py");
    let out = in_h1(&["salloc", "-N2", "--ntasks-per-node=2", kolo, "run", "--", &python, &script]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert_eq!(text.lines().filter(|l| l.contains("/4 on h") && l.contains("store 10.77.0.11:")).count(), 4, "{text}");
    assert_nothing_left();
}

/// The lines `examples/executor_ddp.py` prints: rank lines must show 4
/// ranks with one set of parameters, on `hosts`, and rank 0's losses must
/// have reached the driver's callback.
fn check_executor_ddp(out: &Output, hosts: &[&str]) {
    let text = stdout(out);
    assert!(out.status.success(), "{text}{}", stderr(out));
    let ranks: Vec<&str> = text.lines().filter(|l| l.starts_with("rank ")).collect();
    assert_eq!(ranks.len(), 4, "{text}");
    for (i, line) in ranks.iter().enumerate() {
        assert!(line.starts_with(&format!("rank {i}/4 on ")), "{text}");
    }
    for host in hosts {
        assert_eq!(ranks.iter().filter(|l| l.contains(&format!(" on {host} "))).count(), 2, "{text}");
    }
    let params: std::collections::HashSet<&str> = ranks.iter().filter_map(|l| l.split("params ").nth(1)).collect();
    assert_eq!(params.len(), 1, "{text}");
    let steps: Vec<&str> = text.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(steps.len(), 5, "{text}");
    assert_nothing_left();
}

/// kolo.Executor from h1 over ssh onto h2 and h3, PyTorch DDP in
/// `executor.run`; the key comes as `ssh_str` (the ssh config names none),
/// and no copy of it is left behind.
#[test]
#[ignore = "needs the test hosts"]
fn python_executor_ddp_over_ssh_with_the_key_given_as_text() {
    let Some(python) = python_with("torch, kolo") else { return };
    let t = testhosts();
    let config = std::fs::read_to_string(t.join("ssh/ssh_config")).unwrap();
    let keyless = std::env::temp_dir().join(format!("kolo-keyless-ssh-config-{}", std::process::id()));
    let keyless_config: String =
        config.lines().filter(|l| !l.contains("IdentityFile")).map(|l| format!("{l}\n")).collect();
    std::fs::write(&keyless, keyless_config).unwrap();
    let key = t.join("ssh/id_ed25519").to_string_lossy().into_owned();
    let keys_before = kolo_ssh_dirs();
    let out = in_h1(&[
        &python,
        &repo_file("examples/executor_ddp.py"),
        "--engine",
        "ssh",
        "--hosts",
        "h2:2,h3:2",
        "--ssh-config",
        &keyless.to_string_lossy(),
        "--ssh-key-text-of",
        &key,
    ]);
    let _ = std::fs::remove_file(&keyless);
    check_executor_ddp(&out, &["h2", "h3"]);
    assert_eq!(kolo_ssh_dirs(), keys_before, "a copy of the key was left");
}

/// The private directories `ssh_str`'s key lives in during a start.
fn kolo_ssh_dirs() -> Vec<String> {
    let mut dirs: Vec<String> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("kolo-ssh-"))
        .collect();
    dirs.sort();
    dirs
}

/// kolo.Executor inside a Slurm allocation of two nodes: it places its
/// workers through Slurm with no engine named, as `kolo run` does.
#[test]
#[ignore = "needs the test hosts"]
fn python_executor_ddp_under_slurm() {
    let Some(python) = python_with("torch, kolo") else { return };
    let script = repo_file("examples/executor_ddp.py");
    let out = in_h1(&["salloc", "-N2", "--ntasks-per-node=2", &python, &script]);
    let text = stdout(&out);
    let nodes: std::collections::HashSet<&str> =
        text.lines().filter_map(|l| l.strip_prefix("rank ")?.split(" on ").nth(1)?.split(' ').next()).collect();
    assert_eq!(nodes.len(), 2, "{text}{}", stderr(&out));
    let nodes: Vec<&str> = nodes.into_iter().collect();
    check_executor_ddp(&out, &nodes);
}

/// kolo.Executor's elastic mode inside `salloc -N3`: the worker on h2
/// fails, the others go on in place on h1 and h3 and finish, and the
/// allocation is given back.
#[test]
#[ignore = "needs the test hosts"]
fn python_elastic_executor_inside_a_slurm_allocation() {
    let Some(python) = python_with("numpy, kolo") else { return };
    let script = repo_file("examples/elastic_executor.py");
    let args = ["--fail-on", "h2:50", "--steps", "150"];
    let out = in_h1(&[&["salloc", "-N3", "--ntasks-per-node=1", &python, &script][..], &args[..]].concat());
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(text.contains("round 0: 3 processes on h1:1,h2:1,h3:1"), "{text}");
    assert!(text.contains("host h2 is blacklisted for the rest of the job"), "{text}");
    assert!(text.contains("round 1: 2 processes on h1:1,h3:1"), "{text}");
    assert!(text.contains("step 140: loss") && text.contains("on 2 workers"), "{text}");
    let finals: Vec<&str> = text.lines().filter(|l| l.starts_with("rank ") && l.contains(": step 150,")).collect();
    assert_eq!(finals.len(), 2, "{text}");
    assert!(finals[0].starts_with("rank 0 on h1") && finals[1].starts_with("rank 1 on h3"), "{text}");
    wait_for("the allocation to be given back", Duration::from_secs(20), || slurm_jobs().trim().is_empty());
    assert_nothing_left();
}

/// Restart mode over ssh: h3 cut off mid-job (`ip link set eth0 down`) is
/// lost, left out, and the job finishes on h1 and h2; once h3 is back, its
/// agent and command are gone too (they lost their driver).
#[test]
#[ignore = "needs the test hosts"]
fn restart_mode_goes_on_without_a_cut_off_host() {
    let cfg = ssh_config();
    let dir = TempDir::new("hosts-elastic-cut");
    let script = format!(
        "echo $$ > {}/$RANK.$KOLO_RESTART_COUNT.pid; [ $KOLO_RESTART_COUNT = 1 ] && \
         echo size $WORLD_SIZE on $(hostname) && exit 0; exec sleep 1000",
        dir.path().display()
    );
    let t = testhosts();
    let child = Command::new(t.join("hx"))
        .args(["h1", env!("CARGO_BIN_EXE_kolo"), "run", "-H", "h1:2,h2:2,h3:2", "-np", "6", "--min-np", "4"])
        .args(["--max-restarts", "1", "--ssh-config", &cfg, "--", "sh", "-c", &script])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // a failing assertion must not leave the job to fail the next tests
    let _reap = KillOnDrop(child.id());
    // a pid file exists before the shell has written the pid into it
    let first = |rank: u32| -> Option<i32> {
        std::fs::read_to_string(dir.path().join(format!("{rank}.0.pid"))).ok()?.trim().parse().ok()
    };
    wait_for("the first world", Duration::from_secs(30), || (0..6).all(|r| first(r).is_some()));
    let on_h3: Vec<i32> = (4..6).filter_map(first).collect();
    let cut = LinkDown::cut("h3");
    let out = child.wait_with_output().unwrap();
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(stderr(&out).contains("on host h3 was lost"), "{}", stderr(&out));
    assert_eq!(text.matches("size 4 on h").count(), 4, "{text}");
    assert!(!text.contains("on h3"), "{text}");
    drop(cut);
    wait_for("h3's command to end", Duration::from_secs(30), || on_h3.iter().all(|&p| !alive(p)));
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

#[test]
#[ignore = "needs the test hosts"]
fn in_place_training_goes_on_without_a_killed_host_and_a_cut_off_one() {
    let cfg = ssh_config();
    let train = example("train");
    let job = Streaming::start(&[
        "run",
        "--in-place",
        "-H",
        "h1:1,h2:1,h3:1",
        "--min-np",
        "1",
        "--ssh-config",
        &cfg,
        "--",
        &train,
        "--epochs",
        "12",
        "--samples",
        "32768",
        "--step-ms",
        "5",
        "--commit-every",
        "8",
    ]);
    job.wait_for("epoch   2");
    // every process of the job on h2, agent and rank, dies at once
    let on_h2 = job_processes("h2");
    assert!(on_h2.len() >= 2, "h2 runs {on_h2:?}");
    for pid in on_h2 {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
    job.wait_for("round 1: 2 processes on h1:1,h3:1");
    let on_h3 = job_processes("h3");
    // h3 vanishes without closing anything: h1's collective waits on it
    // until kolo's driver starts a round without it
    let cut = LinkDown::cut("h3");
    job.wait_for("round 2: 1 process on h1:1");
    let (ok, text) = job.finish();
    assert!(ok, "{text}");
    assert!(text.contains("on host h2 was lost") && text.contains("on host h3 was lost"), "{text}");
    assert!(text.contains("1 ranks from epoch"), "{text}");
    let loss: f32 = text.split("final loss ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    assert!(loss < 0.35, "{text}");
    drop(cut);
    wait_for("h3's processes to end", Duration::from_secs(30), || on_h3.iter().all(|&p| !alive(p)));
    assert_nothing_left();
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
        let t = testhosts();
        let mut child = Command::new(t.join("hx"))
            .arg("h1")
            .args(cmd)
            .env("SLURM_CONF", t.join("slurm/slurm.conf"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
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

    fn wait_for(&self, what: &str) {
        wait_for(&format!("'{what}'"), Duration::from_secs(60), || self.text.lock().unwrap().contains(what));
    }

    fn finish(mut self) -> (bool, String) {
        let ok = self.child.wait().unwrap().success();
        for reader in self.readers.drain(..) {
            reader.join().unwrap();
        }
        let text = self.text.lock().unwrap().clone();
        (ok, text)
    }
}

#[test]
#[ignore = "needs the test hosts"]
fn restart_mode_over_ssh_survives_a_killed_rank_and_grows_by_discovery() {
    let cfg = ssh_config();
    let dir = TempDir::new("hosts-restart-grow");
    let grow = dir.path().join("grow");
    let discover = discovery_on_hosts(dir.path(), &grow);
    let script = format!(
        "echo $$ > {}/$RANK.$KOLO_RESTART_COUNT.pid; [ $WORLD_SIZE = 3 ] && echo grown $RANK on $(hostname) && exit 0; \
         exec sleep 1000",
        dir.path().display()
    );
    let job = Streaming::start(&[
        "run",
        "--min-np",
        "2",
        "--max-np",
        "3",
        "--max-restarts",
        "2",
        "--host-discovery-script",
        &discover,
        "--discovery-interval",
        "0.2",
        "--ssh-config",
        &cfg,
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let pid = |rank: u32, restart: u32| dir.path().join(format!("{rank}.{restart}.pid"));
    wait_for("the first world", Duration::from_secs(30), || pid(0, 0).exists() && pid(1, 0).exists());
    let on_h2: i32 = std::fs::read_to_string(pid(1, 0)).unwrap().trim().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(on_h2), nix::sys::signal::Signal::SIGKILL).unwrap();
    wait_for("the restarted world", Duration::from_secs(30), || pid(0, 1).exists() && pid(1, 1).exists());
    std::fs::write(&grow, "").unwrap();
    let (ok, text) = job.finish();
    assert!(ok, "{text}");
    assert!(text.contains("rank 1 on host h2 was killed by signal 9 (SIGKILL); restarting the job"), "{text}");
    assert!(text.contains("the hosts changed; re-forming the job"), "{text}");
    for host in ["h1", "h2", "h3"] {
        assert!(text.contains(&format!(" on {host}\n")), "{host} did not run in the grown world: {text}");
    }
    assert_eq!(text.matches("grown").count(), 3, "{text}");
    assert_nothing_left();
}

#[test]
#[ignore = "needs the test hosts"]
fn in_place_over_ssh_survives_a_killed_rank_and_grows_by_discovery() {
    let cfg = ssh_config();
    let dir = TempDir::new("hosts-in-place-grow");
    let grow = dir.path().join("grow");
    let discover = discovery_on_hosts(dir.path(), &grow);
    let train = example("train");
    let job = Streaming::start(&[
        "run",
        "--in-place",
        "--min-np",
        "1",
        "--max-np",
        "3",
        "--host-discovery-script",
        &discover,
        "--discovery-interval",
        "0.2",
        "--ssh-config",
        &cfg,
        "--",
        &train,
        "--epochs",
        "30",
        "--step-ms",
        "5",
        "--commit-every",
        "8",
    ]);
    job.wait_for("epoch   2");
    let on_h1: Vec<i32> = job_processes("h1");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(training_rank_on("h2")), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    job.wait_for("round 1: 1 process on h1:1");
    std::fs::write(&grow, "").unwrap();
    job.wait_for("round 2: 2 processes on h1:1,h3:1");
    assert!(on_h1.iter().all(|&p| alive(p)), "h1's processes were restarted");
    let (ok, text) = job.finish();
    assert!(ok, "{text}");
    assert!(text.contains("rank 1 on host h2 was killed by signal 9 (SIGKILL)"), "{text}");
    assert!(text.contains("host h2 is blacklisted for the rest of the job"), "{text}");
    assert!(text.contains("2 ranks from epoch"), "h3 did not join: {text}");
    let loss: f32 = text.split("final loss ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    assert!(loss < 0.35, "{text}");
    assert_nothing_left();
}

#[test]
#[ignore = "needs the test hosts"]
fn both_elastic_modes_inside_a_slurm_allocation() {
    let kolo = env!("CARGO_BIN_EXE_kolo");
    // restart mode: every rank starts again on the allocation's nodes
    let out = in_h1(&[
        "salloc",
        "-N3",
        "--ntasks-per-node=1",
        kolo,
        "run",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        "[ $KOLO_RESTART_COUNT = 1 ] && echo restarted $RANK on $(hostname) && exit 0; [ $RANK = 1 ] && exit 4; \
         exec sleep 100",
    ]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(stderr(&out).contains("rank 1 on host h2 exited with code 4; restarting the job"), "{}", stderr(&out));
    for (rank, host) in [(0, "h1"), (1, "h2"), (2, "h3")] {
        assert!(text.contains(&format!("restarted {rank} on {host}")), "{text}");
    }
    // in place: h2 leaves for its cooldown and comes back in a step of its own
    let train = example("train");
    let job = Streaming::in_h1(&[
        "salloc",
        "-N3",
        "--ntasks-per-node=1",
        kolo,
        "run",
        "--in-place",
        "--min-np",
        "1",
        "--cooldown-range",
        "1:1",
        "--",
        &train,
        "--epochs",
        "40",
        "--samples",
        "16384",
        "--step-ms",
        "5",
    ]);
    job.wait_for("epoch   2");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(training_rank_on("h2")), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    let (ok, text) = job.finish();
    assert!(ok, "{text}");
    assert!(text.contains("round 1: 2 processes on h1:1,h3:1"), "{text}");
    assert!(text.contains("round 2: 3 processes on h1:1,h3:1,h2:1"), "{text}");
    assert!(text.contains("final loss"), "{text}");
    wait_for("the allocations to be given back", Duration::from_secs(20), || slurm_jobs().trim().is_empty());
    assert_nothing_left();
}

/// `store_client.py KIND ADDR PORT` inside `host`, as user `nobody` or as root.
fn store_client_in(host: &str, python: &str, kind: &str, addr: &str, port: &str, as_nobody: bool) -> String {
    let hx = testhosts().join("hx");
    store_client(&[&hx.to_string_lossy(), host], python, kind, addr, port, as_nobody)
}

/// A job over ssh on h1 and h2 whose ranks write their env and wait for
/// `done` in `dir`; the stores' addresses once both ranks run.
fn waiting_job(dir: &std::path::Path, hosts: &str, np: &str) -> (std::process::Child, String) {
    let cfg = ssh_config();
    let d = dir.display();
    let script = format!(
        "env > {d}/$RANK.env.tmp && mv {d}/$RANK.env.tmp {d}/$RANK.env; while [ ! -e {d}/done ]; do sleep 0.05; done"
    );
    let job = spawn_in_h1(&["run", "-np", np, "-H", hosts, "--ssh-config", &cfg], &script);
    let ranks: usize = np.parse().unwrap();
    wait_for("every rank to start", Duration::from_secs(60), || {
        (0..ranks).all(|r| dir.join(format!("{r}.env")).exists())
    });
    (job, std::fs::read_to_string(dir.join("0.env")).unwrap())
}

fn env_var(env: &str, name: &str) -> String {
    env.lines().find_map(|l| l.strip_prefix(&format!("{name}="))).unwrap_or_else(|| panic!("{name} in {env}")).into()
}

/// The stores serve no other user on any of the job's hosts (h1 runs the
/// driver: the kernel's socket tables say whose a connection is; h2's
/// agent answers for h2), and nobody on h3, which is not a job host.
#[test]
#[ignore = "needs the test hosts"]
fn the_jobs_stores_refuse_other_users_on_its_hosts_and_other_hosts() {
    let torch = python_with("torch");
    let python = torch.clone().unwrap_or_else(|| "python3".into());
    let dir = TempDir::new("hosts-stores");
    let (job, env) = waiting_job(dir.path(), "h1:1,h2:1", "2");
    let _reap = KillOnDrop(job.id());
    let http = (env_var(&env, "HOROVOD_GLOO_RENDEZVOUS_ADDR"), env_var(&env, "HOROVOD_GLOO_RENDEZVOUS_PORT"));
    let master = (env_var(&env, "MASTER_ADDR"), env_var(&env, "MASTER_PORT"));
    let mut stores = vec![("http", &python, &http)];
    if let Some(torch) = &torch {
        stores.push(("torch", torch, &master));
    }
    for (kind, python, (addr, port)) in stores {
        for host in ["h1", "h2"] {
            let said = store_client_in(host, python, kind, addr, port, true);
            assert!(said.starts_with("refused"), "nobody on {host} used the {kind} store: {said}");
            let said = store_client_in(host, python, kind, addr, port, false);
            assert_eq!(said, "wrote", "the job's user on {host} was refused the {kind} store");
        }
        let said = store_client_in("h3", python, kind, addr, port, false);
        assert!(said.starts_with("refused"), "h3, not a job host, used the {kind} store: {said}");
    }
    std::fs::write(dir.path().join("done"), "").unwrap();
    let out = job.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("belongs to user 65534 of host h2"), "{err}");
    assert!(err.contains("not a host of the job"), "{err}");
    assert_nothing_left();
}

/// Listening TCP sockets of kolo processes on `host` bound to every address.
fn kolo_wildcard_listeners(host: &str) -> Vec<String> {
    let out = Command::new("ip").args(["netns", "exec", &format!("kolo-{host}"), "ss", "-Hltnp"]).output().unwrap();
    stdout(&out)
        .lines()
        .filter(|l| l.contains("\"kolo\""))
        .filter(|l| {
            l.split_whitespace()
                .nth(3)
                .is_some_and(|a| a.starts_with("0.0.0.0:") || a.starts_with("*:") || a.starts_with("[::]:"))
        })
        .map(String::from)
        .collect()
}

/// Once a job runs, no kolo process listens on every address of a host:
/// the interface probes' listeners are closed with the probes.
#[test]
#[ignore = "needs the test hosts"]
fn no_kolo_process_listens_on_every_address_once_the_job_runs() {
    let dir = TempDir::new("hosts-listeners");
    let (job, _) = waiting_job(dir.path(), "h1:2,h2:2", "4");
    let _reap = KillOnDrop(job.id());
    for host in ["h1", "h2"] {
        // the driver's ProbeDone reaches the agents within moments of the start
        let open = settled(|| kolo_wildcard_listeners(host));
        assert!(open.is_empty(), "on {host}: {open:?}");
    }
    std::fs::write(dir.path().join("done"), "").unwrap();
    let out = job.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_nothing_left();
}
