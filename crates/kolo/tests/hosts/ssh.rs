//! kolo over ssh: placement on three hosts, allreduce and training,
//! interface detection, and the faults of a host or an agent.

use std::time::Duration;

use super::*;
use crate::common::*;

/// Runs `kolo run -np 6` over ssh on h1, h2 and h3, two slots each, from
/// h1: those options, then `rest` (more options, `--` and the command).
fn six_ranks_on_three_hosts(rest: &[&str]) -> Output {
    let cfg = ssh_config();
    let mut args = vec!["run", "-np", "6", "-H", "h1:2,h2:2,h3:2", "--ssh-config", &cfg];
    args.extend_from_slice(rest);
    kolo_in_h1(&args)
}

#[test]
#[ignore = "needs the test hosts"]
fn ssh_six_workers_on_three_hosts() {
    let out = six_ranks_on_three_hosts(&[
        "--",
        "sh",
        "-c",
        "echo $(hostname) $HOROVOD_RANK $HOROVOD_LOCAL_RANK $HOROVOD_CROSS_RANK $HOROVOD_HOSTNAME $HOROVOD_GLOO_IFACE",
    ]);
    assert_eq!(
        sorted_lines(&out),
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
    let check = example("allreduce_check");
    let text = succeeded(&six_ranks_on_three_hosts(&["--", &check]));
    let ok = text.lines().filter(|l| l.contains("on 3 hosts: allreduce sums ok (21)")).count();
    assert_eq!(ok, 6, "{text}");
    let train = example("train");
    let text = succeeded(&six_ranks_on_three_hosts(&["--", &train, "--epochs", "3"]));
    assert!(text.contains("[0]<stdout>:final loss"), "{text}");
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

#[test]
#[ignore = "needs the test hosts"]
fn a_cut_off_host_fails_the_start_naming_it() {
    let _cut = LinkDown::cut("h3");
    let out = six_ranks_on_three_hosts(&["--start-timeout", "10", "--", "true"]);
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
    let child =
        spawn_in_h1(&["run", "-np", "6", "-H", "h1:2,h2:2,h3:2", "--ssh-config", &cfg, "--kill-grace", "1"], &script);
    wait_for("six ranks to start", Duration::from_secs(30), || pids_in(dir.path()).len() == 6);
    let victim: i32 = std::fs::read_to_string(dir.path().join("2.pid")).unwrap().trim().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim), nix::sys::signal::Signal::SIGKILL).unwrap();
    let out = output_within(child, JOB_DEADLINE);
    let err = failed_with(&out, 137);
    assert!(err.contains("rank 2 on host h2 was killed by signal 9"), "{err}");
    for pid in pids_in(dir.path()) {
        assert!(!alive(pid), "rank process {pid} outlived the job");
    }
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
