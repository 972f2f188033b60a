//! `kolo run` under the conditions real terminals, faults and careless
//! users create: slow readers, killed and stopped agents, endless lines,
//! closed pipes, too few descriptors, a killed driver.

mod common;

use std::io::Read;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;

/// Pid of each rank's command and of its agent (the command's parent),
/// written by the ranks as "$$ $PPID".
fn commands_and_agents(dir: &std::path::Path, ranks: usize) -> Vec<(i32, i32)> {
    wait_for("every rank to write its pids", Duration::from_secs(20), || pids_in(dir).len() == 2 * ranks);
    pids_in(dir).chunks(2).map(|p| (p[0], p[1])).collect()
}

#[test]
fn a_paused_reader_of_kolos_output_holds_back_only_the_rank_that_prints() {
    // 2 MB of output, then silence longer than the heartbeat timeout (5 s)
    // while nobody reads kolo's stdout: the job must live and lose nothing
    let mut child = kolo()
        .args(["run", "-np", "2", "--", "sh", "-c", "[ $RANK = 0 ] && yes | head -c 2000000; sleep 7; echo finished"])
        .start(Stdio::piped(), Stdio::piped());
    // the pause is the scenario itself (a reader that is busy elsewhere)
    std::thread::sleep(Duration::from_secs(6));
    let mut out = String::new();
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    let status = wait_within(&mut child, JOB_DEADLINE);
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(status.success(), "{err}");
    assert_eq!(out.lines().filter(|l| *l == "[0]<stdout>:y").count(), 1_000_000);
    assert_eq!(out.lines().filter(|l| l.ends_with(":finished")).count(), 2, "{err}");
}

/// `kolo run -np 2` of ranks that sleep, with each rank's command and agent.
fn two_sleeping_ranks(dir: &std::path::Path) -> (std::process::Child, Vec<(i32, i32)>) {
    let script = format!("echo $$ $PPID > {}/$RANK.pid; exec sleep 1000", dir.display());
    let child = kolo().args(["run", "-np", "2", "--", "sh", "-c", &script]).start(Stdio::null(), Stdio::piped());
    (child, commands_and_agents(dir, 2))
}

#[test]
fn a_killed_agent_takes_its_rank_with_it() {
    let dir = TempDir::new("agent-killed");
    let (child, ranks) = two_sleeping_ranks(dir.path());
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(ranks[1].1), nix::sys::signal::Signal::SIGKILL).unwrap();
    let out = output_within(child, JOB_DEADLINE);
    let err = failed_with(&out, 1);
    assert!(err.contains("rank 1 on host localhost was lost"), "{err}");
    wait_for("every rank's command to end", Duration::from_secs(10), || ranks.iter().all(|&(cmd, _)| !alive(cmd)));
}

#[test]
fn a_stopped_agent_is_reported_and_leaves_nothing_running() {
    let dir = TempDir::new("agent-stopped");
    let (child, ranks) = two_sleeping_ranks(dir.path());
    let start = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(ranks[0].1), nix::sys::signal::Signal::SIGSTOP).unwrap();
    let out = output_within(child, JOB_DEADLINE);
    assert!(start.elapsed() < Duration::from_secs(15), "took {:?}", start.elapsed());
    let err = failed_with(&out, 1);
    assert!(err.contains("rank 0 on host localhost was lost: no heartbeat"), "{err}");
    wait_for("the ranks and the stopped agent to end", Duration::from_secs(15), || {
        ranks.iter().all(|&(cmd, agent)| !alive(cmd) && !alive(agent))
    });
}

/// `kolo run -np NP -- sh -c SCRIPT` with its temporary files in a TMPDIR
/// of its own (`NAME-tmp`), so that nothing else's can mix in; its output
/// is dropped.
fn quiet_job(name: &str, np: &str, script: &str) -> (std::process::Child, TempDir) {
    let tmp = TempDir::new(&format!("{name}-tmp"));
    let child = kolo()
        .env("TMPDIR", tmp.path())
        .args(["run", "-np", np, "--", "sh", "-c", script])
        .start(Stdio::null(), Stdio::null());
    (child, tmp)
}

#[test]
fn a_killed_driver_leaves_no_process_and_no_file() {
    let dir = TempDir::new("driver-killed");
    let script = format!("sleep 1000 & echo $$ $! > {}/$RANK.pid; wait", dir.path().display());
    let (mut child, tmp) = quiet_job("driver-killed", "3", &script);
    let ranks = commands_and_agents(dir.path(), 3);
    child.kill().unwrap();
    wait_within(&mut child, JOB_DEADLINE);
    wait_for("every rank and its children to end", Duration::from_secs(15), || {
        ranks.iter().all(|&(sh, sleeper)| !alive(sh) && !alive(sleeper))
    });
    // the guard removes the rank's directory after its group is gone, so
    // the directory may outlive the ranks by a moment
    let left = || std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().path()).collect::<Vec<_>>();
    let start = Instant::now();
    while !left().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(15), "left in TMPDIR: {:?}", left());
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn an_endless_line_is_split_instead_of_buffered() {
    let out = run(&["run", "-np", "1", "--", "sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' y"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.iter().all(|l| l.len() <= 64 * 1024 + "[0]<stdout>:".len()), "a line over the bound");
    let ys: usize = lines.iter().map(|l| l.trim_start_matches("[0]<stdout>:").len()).sum();
    assert_eq!(ys, 3_000_000);
}

#[test]
fn a_closed_pipe_ends_kolo_quietly() {
    let mut child = kolo()
        .args(["run", "--dry-run", "-H", "localhost:4000", "-np", "4000", "--", "true"])
        .start(Stdio::piped(), Stdio::piped());
    let mut first = [0u8; 100];
    child.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    drop(child.stdout.take());
    let out = output_within(child, JOB_DEADLINE);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
}

#[test]
fn absurd_sizes_are_refused_at_once() {
    let start = Instant::now();
    let out = run(&["run", "--dry-run", "-H", "localhost:10000000", "--", "true"]);
    assert!(start.elapsed() < Duration::from_secs(2));
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("slot count 10000000 is over kolo's limit of 65536"), "{}", stderr(&out));
    let out = run(&["run", "--dry-run", "-np", "70000", "--", "true"]);
    assert!(stderr(&out).contains("over kolo's limit"), "{}", stderr(&out));
}

#[test]
fn too_few_descriptors_is_named_as_the_problem() {
    use std::os::unix::process::CommandExt;
    let mut command = kolo();
    command.args(["run", "-np", "300", "--start-timeout", "10", "--", "true"]);
    // SAFETY: setrlimit is async-signal-safe; `ulimit -n 256` in the child
    unsafe {
        command.pre_exec(|| {
            let limit = 256;
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, limit, limit)
                .map_err(std::io::Error::from)
        });
    }
    let start = Instant::now();
    let out = command.output_within(JOB_DEADLINE);
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("file descriptors") && stderr(&out).contains("ulimit -n"), "{}", stderr(&out));
}

#[test]
fn unknown_interfaces_in_nics_are_named() {
    let out = run(&["run", "--engine", "local", "-H", "a:1,b:1", "--nics", "eth9", "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("interface 'eth9' (--nics) does not exist on host a"), "{}", stderr(&out));
}

/// `--dry-run` prints exactly what runs: every variable it shows, a rank
/// gets, with the same value, except those it marks as chosen at start.
#[test]
fn the_dry_run_is_what_runs() {
    let args = ["--engine", "local", "-np", "4", "-H", "node-a:2,node-b:2", "--nics", "lo", "-x", "EXTRA=1"];
    let mut dry = vec!["run", "--dry-run"];
    dry.extend(args);
    dry.extend(["--", "true"]);
    let planned = run(&dry);
    assert!(planned.status.success(), "{}", stderr(&planned));
    let mut real = vec!["run", "--disable-prefix"];
    real.extend(args);
    real.extend(["--", "sh", "-c", "env | sed \"s/^/$RANK /\""]);
    let ran = run(&real);
    assert!(ran.status.success(), "{}", stderr(&ran));
    let got = stdout(&ran);
    for line in stdout(&planned).lines() {
        let plan: serde_json::Value = serde_json::from_str(line).unwrap();
        let rank = plan["rank"].as_u64().unwrap();
        for (key, value) in plan["env"].as_object().unwrap() {
            let value = value.as_str().unwrap();
            let prefix = format!("{rank} {key}=");
            let seen = got.lines().find_map(|l| l.strip_prefix(&prefix));
            assert!(seen.is_some(), "rank {rank} lacks {key}");
            if !value.starts_with('<') {
                assert_eq!(seen, Some(value), "rank {rank} {key}");
            }
        }
    }
}

/// Every thread of `pid` in a group stop (or the process gone).
fn stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return true };
    tasks.flatten().all(|task| {
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        matches!(stat_state(&stat), None | Some("T" | "Z" | "X"))
    })
}

#[test]
fn rank_directories_of_a_job_whose_every_process_was_killed_go_with_the_next_job() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let dir = TempDir::new("all-killed");
    let script = format!("echo $$ $PPID > {}/$RANK.pid; exec sleep 1000", dir.path().display());
    let (mut child, tmp) = quiet_job("all-killed", "2", &script);
    commands_and_agents(dir.path(), 2);
    // stopped first, so that none of them sees another die and cleans up
    let everyone: Vec<i32> = process_tree(child.id()).into_iter().map(|p| p as i32).collect();
    let before: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().map(|e| e.path()).collect();
    let comms: Vec<String> =
        everyone.iter().map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default()).collect();
    assert!(everyone.len() >= 5, "driver, agents and ranks: {everyone:?}");
    for &pid in &everyone {
        let _ = kill(Pid::from_raw(pid), Signal::SIGSTOP);
    }
    // kill() returns before the stop takes hold: a thread already running
    // (a busy machine) goes on until the stopping thread is scheduled, and
    // an agent's reaper that sees its rank die first removes the directory
    wait_for("every process of the job to stop", Duration::from_secs(10), || everyone.iter().all(|&p| stopped(p)));
    // the driver last: a stopped agent whose parent dies first is in an
    // orphaned process group, which the kernel sends SIGHUP and SIGCONT,
    // and the agent would clean up in the gap before its SIGKILL
    for &pid in everyone.iter().rev() {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    wait_within(&mut child, JOB_DEADLINE);
    wait_for("every process of the job to end", Duration::from_secs(10), || everyone.iter().all(|&p| !alive(p)));
    let abandoned: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().map(|e| e.path()).collect();
    // each rank's directory, and the job's control endpoint (its janitor died too)
    assert_eq!(abandoned.len(), 3, "abandoned: {abandoned:?} before {before:?} {comms:#?}");

    let out = kolo().env("TMPDIR", tmp.path()).args(["run", "-np", "1", "--", "true"]).output_within(JOB_DEADLINE);
    assert!(out.status.success(), "{}", stderr(&out));
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().map(|e| e.path()).collect();
    assert!(left.is_empty(), "left in TMPDIR after the next job: {left:?}");
}
