//! `kolo run` in restart mode on real processes (local engine, simulated
//! nodes): failed and killed ranks, lost hosts, hosts a discovery script
//! adds, the limits and the elastic timeout; nothing left behind.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Stdio;
use std::time::Duration;

use common::*;

/// A discovery script printing `a:2`, and `b:2` too once `grow` exists.
fn discovery_script(dir: &std::path::Path, grow: &std::path::Path) -> String {
    let path = dir.join("discover.sh");
    std::fs::write(&path, format!("#!/bin/sh\necho a:2\n[ -e {} ] && echo b:2\nexit 0\n", grow.display())).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.to_string_lossy().into_owned()
}

#[test]
fn a_failed_rank_restarts_every_rank_with_the_restart_count() {
    let out = run(&[
        "run",
        "--engine",
        "local",
        "-H",
        "a:2,b:2",
        "-np",
        "4",
        "--max-restarts",
        "2",
        "--",
        "sh",
        "-c",
        "echo rank $RANK restart $KOLO_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS elastic $HOROVOD_ELASTIC; \
         [ $KOLO_RESTART_COUNT = 0 ] && [ $RANK = 1 ] && exit 3; exit 0",
    ]);
    let text = succeeded(&out);
    // the first round ends as soon as rank 1 fails: others may not have printed
    assert!(text.contains("rank 1 restart 0 0 of 2 elastic 1"), "{text}");
    for rank in 0..4 {
        assert!(text.contains(&format!("rank {rank} restart 1 1 of 2 elastic 1")), "{text}");
    }
    assert_stderr_has(&out, "rank 1 on host a exited with code 3; restarting the job");
}

#[test]
fn past_max_restarts_the_job_stops_with_the_ranks_code_and_says_why() {
    let out = run(&["run", "-np", "2", "--max-restarts", "1", "--", "sh", "-c", "[ $RANK = 0 ] && exit 7; sleep 30"]);
    let err = failed_with(&out, 7);
    assert_eq!(err.matches("restarting the job").count(), 1, "{err}");
    assert!(err.contains("rank 0 on host localhost exited with code 7; it failed first"), "{err}");
    assert!(err.contains("restarted 1 times, its --max-restarts"), "{err}");
}

#[test]
fn a_killed_rank_restarts_the_world_and_nothing_of_the_old_one_is_left() {
    let dir = TempDir::new("elastic-killed");
    let script = format!(
        "echo $$ > {}/$RANK.$KOLO_RESTART_COUNT.pid; [ $KOLO_RESTART_COUNT = 1 ] && exit 0; exec sleep 1000",
        dir.path().display()
    );
    let child = kolo()
        .args(["run", "--engine", "local", "-H", "a:2,b:2", "-np", "4", "--max-restarts", "1", "--"])
        .args(["sh", "-c", &script])
        .start(Stdio::null(), Stdio::piped());
    let first_round = |i: u32| dir.path().join(format!("{i}.0.pid"));
    wait_for("the first round's ranks", Duration::from_secs(20), || (0..4).all(|i| line_in(&first_round(i)).is_some()));
    let pids: Vec<i32> = (0..4).map(|i| line_in(&first_round(i)).unwrap().parse().unwrap()).collect();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pids[2]), nix::sys::signal::Signal::SIGKILL).unwrap();
    let out = output_within(child, JOB_DEADLINE);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_stderr_has(&out, "rank 2 on host b was killed by signal 9 (SIGKILL); restarting");
    assert!((0..4).all(|i| dir.path().join(format!("{i}.1.pid")).exists()));
    assert!(pids.iter().all(|&p| !alive(p)), "a rank of the first world outlived it");
}

#[test]
fn a_lost_host_is_left_out_of_the_next_world() {
    let dir = TempDir::new("elastic-lost");
    // each rank writes its shell's and its agent's pid
    let script = format!(
        "echo $$ $PPID > {}/$RANK.$KOLO_RESTART_COUNT.pid; [ $KOLO_RESTART_COUNT = 1 ] && \
         echo size $WORLD_SIZE host $HOROVOD_HOSTNAME && exit 0; exec sleep 1000",
        dir.path().display()
    );
    let child = kolo()
        .args(["run", "--engine", "local", "-H", "a:2,b:2", "-np", "4", "--min-np", "2", "--max-restarts", "1"])
        .args(["--", "sh", "-c", &script])
        .start(Stdio::piped(), Stdio::piped());
    let file = |i: u32| dir.path().join(format!("{i}.0.pid"));
    wait_for("the first round's ranks", Duration::from_secs(20), || (0..4).all(|i| line_in(&file(i)).is_some()));
    let agent_of_3: i32 = line_in(&file(3)).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(agent_of_3), nix::sys::signal::Signal::SIGKILL).unwrap();
    let out = output_within(child, JOB_DEADLINE);
    let text = succeeded(&out);
    assert_stderr_has(&out, "rank 3 on host b was lost");
    assert_eq!(text.matches("size 2 host a").count(), 2, "{text}");
    assert!(!text.contains("host b"), "{text}");
}

#[test]
fn a_host_the_discovery_script_adds_grows_the_world() {
    let dir = TempDir::new("elastic-grow");
    let grow = dir.path().join("grow");
    let discover = discovery_script(dir.path(), &grow);
    let script =
        format!("[ $WORLD_SIZE = 4 ] && echo grown $RANK && exit 0; touch {}; exec sleep 1000", grow.display());
    let out = run(&[
        "run",
        "--engine",
        "local",
        "--min-np",
        "2",
        "--max-np",
        "4",
        "--host-discovery-script",
        &discover,
        "--discovery-interval",
        "0.1",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let text = succeeded(&out);
    assert_eq!(text.matches("grown").count(), 4, "{text}");
    assert_stderr_has(&out, "the hosts changed; re-forming the job");
}

#[test]
fn too_few_slots_for_longer_than_the_elastic_timeout_stop_the_job_saying_so() {
    let dir = TempDir::new("elastic-timeout");
    let discover = discovery_script(dir.path(), &dir.path().join("never"));
    let out = run(&[
        "run",
        "--min-np",
        "3",
        "--host-discovery-script",
        &discover,
        "--discovery-interval",
        "0.1",
        "--elastic-timeout",
        "1",
        "--",
        "true",
    ]);
    let err = failed_with(&out, 1);
    assert!(err.contains("waiting for 3 slots, 2 available"), "{err}");
    assert!(err.contains("timed out after 1 s waiting for 3 slots (--min-np) with 2 available"), "{err}");
}

#[test]
fn bad_elastic_options_are_refused_naming_them() {
    for (args, says) in [
        (&["--min-np", "3", "--max-np", "2"][..], "1 <= min-np <= max-np"),
        (&["-np", "2", "--max-restarts", "1", "--cooldown-range", "9:3"][..], "--cooldown-range '9:3'"),
        (&["-np", "2", "--max-restarts", "1", "--discovery-interval", "0"][..], "--discovery-interval"),
        (&["-np", "2", "--max-restarts", "1", "--dry-run"][..], "--dry-run shows a fixed job"),
        (&["-np", "2", "--host-discovery-script", "/nonexistent/discover"][..], "cannot run host discovery script"),
        (
            &["-np", "2", "--in-place", "--engine", "ray", "--workers-per-host", "1"][..],
            "--workers-per-host is for fixed Ray jobs",
        ),
        (&["-np", "2", "--max-restarts", "1", "--engine", "slurm"][..], "runs inside an allocation"),
    ] {
        let mut all = vec!["run"];
        all.extend_from_slice(args);
        all.extend(["--", "true"]);
        let out = run(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn a_host_failing_two_rounds_in_a_row_is_blacklisted_and_comes_back_after_its_cooldown() {
    // b's rank fails in the first two worlds; alone, a waits for b to come
    // back (the world re-forms when it does); together, both finish
    let script = "if [ $HOROVOD_HOSTNAME = b ] && [ $KOLO_RESTART_COUNT -lt 2 ]; then exit 3; fi; \
                  if [ $HOROVOD_SIZE = 1 ]; then exec sleep 60; fi; \
                  echo done $HOROVOD_HOSTNAME after $KOLO_RESTART_COUNT restarts";
    let out = run(&[
        "run",
        "--engine",
        "local",
        "-H",
        "a:1,b:1",
        "--min-np",
        "1",
        "--max-restarts",
        "5",
        "--cooldown-range",
        "1:1",
        "--",
        "sh",
        "-c",
        script,
    ]);
    let (text, err) = (stdout(&out), stderr(&out));
    assert!(out.status.success(), "{text}{err}");
    // once is a failing script, twice in a row is the host
    assert_eq!(err.matches("on host b exited with code 3; restarting the job").count(), 2, "{err}");
    assert_eq!(err.matches("host b is blacklisted for 1.0 s").count(), 1, "{err}");
    assert!(err.contains("the hosts changed; re-forming the job"), "{err}");
    // kolo stopped that world itself: no signal to speak of
    assert!(!err.contains("received SIGTERM"), "{err}");
    assert!(text.contains("done a after 2 restarts") && text.contains("done b after 2 restarts"), "{text}{err}");
}
