//! kolo under Slurm: inside an allocation, asking for one, scancel,
//! a busy cluster, a killed agent or driver.

use std::time::Duration;

use super::*;
use crate::common::*;

#[test]
#[ignore = "needs the test hosts"]
fn slurm_inside_an_allocation_three_nodes_two_tasks_each() {
    let script = "echo $(hostname) $HOROVOD_RANK $HOROVOD_LOCAL_RANK $HOROVOD_CROSS_RANK $HOROVOD_GLOO_IFACE";
    let out = in_h1(&salloc_kolo_run(&["-N3", "--ntasks-per-node=2"], &["--", "sh", "-c", script]));
    let lines: Vec<String> = sorted_lines(&out).into_iter().filter(|l| l.starts_with('[')).collect();
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
    let text = succeeded(&in_h1(&salloc_kolo_run(&["-N3", "--ntasks-per-node=2"], &["--", &check])));
    assert_eq!(text.lines().filter(|l| l.contains("allreduce sums ok (21)")).count(), 6, "{text}");
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
    let out = output_within(child, JOB_DEADLINE);
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
    let mut child = kolo_command_in_h1(&["run", "--engine", "slurm", "-np", "6", "--slurm-nodes", "3"])
        .args(["--", "sh", "-c", &script])
        .env("TMPDIR", tmp.path())
        .start(Stdio::null(), Stdio::null());
    wait_for("six ranks to start", Duration::from_secs(30), || pids_in(dir.path()).len() == 6);
    assert!(!slurm_jobs().trim().is_empty());
    // hx execs its way to kolo: this kills the driver itself
    child.kill().unwrap();
    wait_within(&mut child, JOB_DEADLINE);
    wait_for("the janitor to give the allocation back", Duration::from_secs(30), || slurm_jobs().trim().is_empty());
    wait_for("every rank to end", Duration::from_secs(30), || pids_in(dir.path()).iter().all(|&p| !alive(p)));
    wait_for("the janitor to remove its files", Duration::from_secs(10), || {
        std::fs::read_dir(tmp.path()).unwrap().next().is_none()
    });
    assert_nothing_left();
}
