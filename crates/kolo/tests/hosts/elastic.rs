//! Elastic jobs across the hosts: restart mode and in place, over ssh
//! and inside a Slurm allocation, with killed ranks, cut-off hosts and
//! hosts added by discovery.

use std::time::Duration;

use super::*;
use crate::common::*;

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
    let child = kolo_command_in_h1(&["run", "-H", "h1:2,h2:2,h3:2", "-np", "6", "--min-np", "4"])
        .args(["--max-restarts", "1", "--ssh-config", &cfg, "--", "sh", "-c", &script])
        .start(Stdio::piped(), Stdio::piped());
    // a failing assertion must not leave the job to fail the next tests
    let _reap = KillOnDrop(child.id());
    // a pid file exists before the shell has written the pid into it
    let first = |rank: u32| -> Option<i32> {
        std::fs::read_to_string(dir.path().join(format!("{rank}.0.pid"))).ok()?.trim().parse().ok()
    };
    wait_for("the first world", Duration::from_secs(30), || (0..6).all(|r| first(r).is_some()));
    let on_h3: Vec<i32> = (4..6).filter_map(first).collect();
    let cut = LinkDown::cut("h3");
    let out = output_within(child, JOB_DEADLINE);
    let text = succeeded(&out);
    assert_stderr_has(&out, "on host h3 was lost");
    assert_eq!(text.matches("size 4 on h").count(), 4, "{text}");
    assert!(!text.contains("on h3"), "{text}");
    drop(cut);
    wait_for("h3's command to end", Duration::from_secs(30), || on_h3.iter().all(|&p| !alive(p)));
    assert_nothing_left();
}

/// The training demo's final loss is that of a run that converged.
#[track_caller]
fn assert_converged(text: &str) {
    let loss: f32 = text.split("final loss ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    assert!(loss < 0.35, "{text}");
}

#[test]
#[ignore = "needs the test hosts"]
fn in_place_training_goes_on_without_a_killed_host_and_a_cut_off_one() {
    let train = example("train");
    let job = in_place_on_three_hosts(&[
        "--min-np",
        "1",
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
    assert_converged(&text);
    drop(cut);
    wait_for("h3's processes to end", Duration::from_secs(30), || on_h3.iter().all(|&p| !alive(p)));
    assert_nothing_left();
}

/// Starts `kolo run ARGS` over ssh from h1 on the hosts a discovery script
/// in `dir` gives, looked at every 0.2 s: h1 and h2, and h3 too once the
/// file it returns exists.
fn discovering_job(dir: &std::path::Path, args: &[&str]) -> (Streaming, std::path::PathBuf) {
    let (cfg, grow) = (ssh_config(), dir.join("grow"));
    let discover = discovery_on_hosts(dir, &grow);
    let mut all =
        vec!["run", "--host-discovery-script", &discover, "--discovery-interval", "0.2", "--ssh-config", &cfg];
    all.extend_from_slice(args);
    (Streaming::start(&all), grow)
}

#[test]
#[ignore = "needs the test hosts"]
fn restart_mode_over_ssh_survives_a_killed_rank_and_grows_by_discovery() {
    let dir = TempDir::new("hosts-restart-grow");
    let script = format!(
        "echo $$ > {}/$RANK.$KOLO_RESTART_COUNT.pid; [ $WORLD_SIZE = 3 ] && echo grown $RANK on $(hostname) && exit 0; \
         exec sleep 1000",
        dir.path().display()
    );
    let (job, grow) = discovering_job(
        dir.path(),
        &["--min-np", "2", "--max-np", "3", "--max-restarts", "2", "--", "sh", "-c", &script],
    );
    let pid = |rank: u32, restart: u32| dir.path().join(format!("{rank}.{restart}.pid"));
    wait_for("the first world", Duration::from_secs(30), || {
        line_in(&pid(0, 0)).is_some() && line_in(&pid(1, 0)).is_some()
    });
    let on_h2: i32 = line_in(&pid(1, 0)).unwrap().parse().unwrap();
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
    let train = example("train");
    let dir = TempDir::new("hosts-in-place-grow");
    let (job, grow) = discovering_job(
        dir.path(),
        &[
            "--in-place",
            "--min-np",
            "1",
            "--max-np",
            "3",
            "--",
            &train,
            "--epochs",
            "30",
            "--step-ms",
            "5",
            "--commit-every",
            "8",
        ],
    );
    job.wait_for("epoch   2");
    let on_h1: Vec<i32> = job_processes("h1");
    kill_the_training_rank_on("h2");
    job.wait_for("round 1: 1 process on h1:1");
    std::fs::write(&grow, "").unwrap();
    job.wait_for("round 2: 2 processes on h1:1,h3:1");
    assert!(on_h1.iter().all(|&p| alive(p)), "h1's processes were restarted");
    let (ok, text) = job.finish();
    assert!(ok, "{text}");
    assert!(text.contains("rank 1 on host h2 was killed by signal 9 (SIGKILL)"), "{text}");
    assert!(text.contains("host h2 is blacklisted for the rest of the job"), "{text}");
    assert!(text.contains("2 ranks from epoch"), "h3 did not join: {text}");
    assert_converged(&text);
    assert_nothing_left();
}

#[test]
#[ignore = "needs the test hosts"]
fn both_elastic_modes_inside_a_slurm_allocation() {
    // restart mode: every rank starts again on the allocation's nodes
    let script =
        "[ $KOLO_RESTART_COUNT = 1 ] && echo restarted $RANK on $(hostname) && exit 0; [ $RANK = 1 ] && exit 4; \
                  exec sleep 100";
    let out =
        in_h1(&salloc_kolo_run(&["-N3", "--ntasks-per-node=1"], &["--max-restarts", "1", "--", "sh", "-c", script]));
    let text = succeeded(&out);
    assert_stderr_has(&out, "rank 1 on host h2 exited with code 4; restarting the job");
    for (rank, host) in [(0, "h1"), (1, "h2"), (2, "h3")] {
        assert!(text.contains(&format!("restarted {rank} on {host}")), "{text}");
    }
    // in place: h2 leaves for its cooldown and comes back in a step of its own
    let train = example("train");
    let job = Streaming::in_h1(&salloc_kolo_run(
        &["-N3", "--ntasks-per-node=1"],
        &[
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
        ],
    ));
    job.wait_for("epoch   2");
    kill_the_training_rank_on("h2");
    let (ok, text) = job.finish();
    assert!(ok, "{text}");
    assert!(text.contains("round 1: 2 processes on h1:1,h3:1"), "{text}");
    assert!(text.contains("round 2: 3 processes on h1:1,h3:1,h2:1"), "{text}");
    assert!(text.contains("final loss"), "{text}");
    wait_for("the allocations to be given back", Duration::from_secs(20), || slurm_jobs().trim().is_empty());
    assert_nothing_left();
}
