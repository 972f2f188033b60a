//! `kolo run` on the local engine, driven through the real binary.

mod common;

use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::Duration;

use common::*;
use serde_json::Value;

#[test]
fn four_ranks_print_prefixed_lines() {
    let out = run(&["run", "-np", "4", "--", "sh", "-c", "echo $HOROVOD_RANK $HOROVOD_SIZE $LOCAL_RANK"]);
    assert_eq!(
        sorted_lines(&out),
        ["[0]<stdout>:0 4 0", "[1]<stdout>:1 4 1", "[2]<stdout>:2 4 2", "[3]<stdout>:3 4 3"]
    );
}

fn dry_run(args: &[&str]) -> Vec<Value> {
    let mut all = vec!["run", "--dry-run"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", "true"]);
    let out = run(&all);
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn rows(plan: &[Value]) -> String {
    let row = |r: &Value| {
        let env = &r["env"];
        let n = |k: &str| env[k].as_str().unwrap().to_string();
        format!(
            "{},{},{},{},{},{}",
            n("HOROVOD_RANK"),
            n("HOROVOD_SIZE"),
            n("HOROVOD_LOCAL_RANK"),
            n("HOROVOD_LOCAL_SIZE"),
            n("HOROVOD_CROSS_RANK"),
            n("HOROVOD_CROSS_SIZE")
        )
    };
    plan.iter().map(row).collect::<Vec<_>>().join(" | ")
}

/// A host file of `text` in a directory of its own (gone with the
/// `TempDir`), and its path.
fn host_file(name: &str, text: &str) -> (TempDir, String) {
    let dir = TempDir::new(name);
    let file = dir.path().join("hosts");
    std::fs::write(&file, text).unwrap();
    let path = file.to_str().unwrap().to_string();
    (dir, path)
}

#[test]
fn dry_run_follows_horovods_host_assignment() {
    for (hosts, np, expected) in [
        ("worker-0:2,worker-1:2", "4", "0,4,0,2,0,2 | 1,4,1,2,0,2 | 2,4,0,2,1,2 | 3,4,1,2,1,2"),
        ("worker-0:2,worker-1:2", "2", "0,2,0,2,0,1 | 1,2,1,2,0,1"),
        ("worker-0:1,worker-1:2", "3", "0,3,0,1,0,2 | 1,3,0,2,1,2 | 2,3,1,2,0,1"),
        ("a:3,b:1,c:2", "5", "0,5,0,3,0,3 | 1,5,1,3,0,1 | 2,5,2,3,0,1 | 3,5,0,1,1,3 | 4,5,0,1,2,3"),
    ] {
        let plan = dry_run(&["-np", np, "-H", hosts]);
        assert_eq!(rows(&plan), expected, "{hosts} -np {np}");
        for (rank, r) in plan.iter().enumerate() {
            assert_eq!(r["rank"], rank);
            assert_eq!(r["env"]["RANK"], rank.to_string());
            assert_eq!(r["env"]["HOROVOD_HOSTNAME"], r["node_id"]);
            assert_eq!(r["env"]["WORLD_SIZE"], np);
            assert_eq!(r["env"]["HOROVOD_CONTROLLER"], "gloo");
            assert!(r["host"].is_string());
        }
    }
    let plan = dry_run(&["-np", "3", "-H", "a:2,b:2"]);
    let hosts: Vec<&str> = plan.iter().map(|r| r["host"].as_str().unwrap()).collect();
    assert_eq!(hosts, ["a", "a", "b"]);
    assert_eq!(plan[2]["env"]["GROUP_RANK"], "1");
    assert_eq!(plan[2]["env"]["LOCAL_WORLD_SIZE"], "1");
}

#[test]
fn dry_run_reads_host_files_and_defaults_np_to_the_slots() {
    let (_dir, hf) = host_file("hostfile", "# two nodes\nnode-a slots=2\n\nnode-b:1  # small\n");
    let plan = dry_run(&["--hostfile", &hf]);
    assert_eq!(rows(&plan), "0,3,0,2,0,2 | 1,3,1,2,0,1 | 2,3,0,1,1,2");
    let plan = dry_run(&["-H", "x:2,y"]);
    assert_eq!(plan.len(), 3);
}

#[test]
fn bad_input_is_a_clear_error() {
    let (_dir, hf) = host_file("badinput", "a slots=2\nb slots=zero\n");
    let hf = hf.as_str();
    for (args, needle) in [
        (
            vec!["run", "-np", "5", "-H", "a:2,b:2", "--", "true"],
            "Requested more processes (5) than there are available slots (4)",
        ),
        (
            vec!["run", "-np", "2", "-H", "a:x", "--", "true"],
            "host list 'a:x': slot count must be a positive integer, got 'x'",
        ),
        (vec!["run", "-np", "2", "-H", "a:0", "--", "true"], "got '0'"),
        (vec!["run", "-np", "2", "-H", ":2", "--", "true"], "host name is empty"),
        (vec!["run", "-np", "2", "-H", "a:1,a:1", "--", "true"], "'a' is listed twice"),
        (vec!["run", "--hostfile", hf, "--", "true"], "line 2 'b slots=zero'"),
        (vec!["run", "--hostfile", "/nonexistent/hosts", "--", "true"], "cannot read host file /nonexistent/hosts"),
        (vec!["run", "-np", "0", "--", "true"], "-np must be at least 1"),
        (vec!["run", "-np", "2"], "no command given"),
        (vec!["run", "--", "true"], "give the number of processes with -np"),
        (
            vec!["run", "-np", "1", "-x", "KOLO_TEST_SURELY_UNSET", "--", "true"],
            "KOLO_TEST_SURELY_UNSET is not set here",
        ),
        (vec!["run", "-np", "1", "--env", "NOEQUALS", "--", "true"], "expected KEY=VALUE"),
        (vec!["run", "-np", "1", "--env", "1BAD=x", "--", "true"], "not a valid variable name"),
        (vec!["run", "-np", "1", "--kill-grace", "-1", "--", "true"], "kill-grace"),
        (vec!["run", "-np", "x", "--", "true"], "invalid value 'x'"),
    ] {
        let out = run(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = stderr(&out);
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// A directory of its own for the ranks' pid files, and `script` with
/// `{d}` standing for it.
fn pid_dir(name: &str, script: &str) -> (TempDir, String) {
    let dir = TempDir::new(name);
    let script = script.replace("{d}", &dir.path().display().to_string());
    (dir, script)
}

#[test]
fn a_failing_rank_stops_the_job_with_its_code_and_stderr() {
    let (dir, script) = pid_dir(
        "fail",
        "echo $$ > {d}/$RANK.pid; if [ $RANK = 2 ]; then echo 'bad things' >&2; echo 'worse' >&2; exit 3; fi; exec sleep 1000",
    );
    let out = run(&["run", "-np", "4", "--", "sh", "-c", &script]);
    let err = failed_with(&out, 3);
    assert!(err.contains("rank 2 on host localhost exited with code 3"), "{err}");
    assert!(err.contains("kolo:   bad things\nkolo:   worse"), "{err}");
    assert!(err.contains("[2]<stderr>:bad things"), "{err}");
    for pid in pids_in(dir.path()) {
        assert!(!alive(pid), "rank process {pid} outlived the job");
    }
}

#[test]
fn a_rank_killed_by_a_signal_is_reported_with_128_plus_the_signal() {
    let out = run(&["run", "-np", "2", "--", "sh", "-c", "[ $RANK = 1 ] && kill -9 $$; exec sleep 1000"]);
    let err = failed_with(&out, 137);
    assert!(err.contains("rank 1 on host localhost was killed by signal 9 (SIGKILL)"), "{err}");
}

#[test]
fn no_process_is_left_behind_when_ranks_leave_children() {
    // every rank starts a background grandchild and exits at once
    let (dir, script) = pid_dir("orphans", "sleep 1000 & echo $! > {d}/$RANK.pid");
    let out = run(&["run", "-np", "3", "--kill-grace", "0.5", "--", "sh", "-c", &script]);
    assert!(out.status.success(), "{}", stderr(&out));
    let pids = pids_in(dir.path());
    assert_eq!(pids.len(), 3);
    for pid in pids {
        assert!(!alive(pid), "grandchild {pid} outlived the job");
    }
}

#[test]
fn ranks_ignoring_sigterm_are_killed_after_the_grace_period() {
    let (dir, script) = pid_dir(
        "stubborn",
        "trap '' TERM; echo $$ > {d}/$RANK.pid; [ $RANK = 0 ] && exit 4; while :; do sleep 0.05; done",
    );
    let out = run(&["run", "-np", "3", "--kill-grace", "0.3", "--", "sh", "-c", &script]);
    failed_with(&out, 4);
    for pid in pids_in(dir.path()) {
        assert!(!alive(pid), "{pid} survived SIGKILL");
    }
}

#[test]
fn sigterm_and_sigint_to_kolo_tear_the_job_down() {
    for (signal, code) in [(nix::sys::signal::Signal::SIGTERM, 143), (nix::sys::signal::Signal::SIGINT, 130)] {
        let dir = TempDir::new(&format!("sig{}", signal as i32));
        let script = format!("sleep 1000 & echo $$ $! > {}/$RANK.pid; wait", dir.path().display());
        let child = kolo().args(["run", "-np", "3", "--", "sh", "-c", &script]).start(Stdio::null(), Stdio::piped());
        wait_for("all ranks to start", Duration::from_secs(20), || pids_in(dir.path()).len() == 6);
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal).unwrap();
        let out = output_within(child, JOB_DEADLINE);
        let err = failed_with(&out, code);
        assert!(err.contains(&format!("stopped by {}", signal.as_str())), "{err}");
        for pid in pids_in(dir.path()) {
            assert!(!alive(pid), "{pid} outlived kolo's {signal}");
        }
    }
}

#[test]
fn a_second_sigint_kills_ranks_that_ignore_sigterm_without_waiting_out_the_grace() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    use std::io::BufRead;
    let dir = TempDir::new("twice");
    let script = format!("trap '' TERM; echo $$ > {}/$RANK.pid; while :; do sleep 0.05; done", dir.path().display());
    // a grace far longer than the test may take: only the second SIGINT can end it
    let mut child = kolo()
        .args(["run", "-np", "2", "--kill-grace", "600", "--", "sh", "-c", &script])
        .start(Stdio::null(), Stdio::piped());
    let _reap = KillOnDrop(child.id());
    wait_for("both ranks to start", Duration::from_secs(20), || pids_in(dir.path()).len() == 2);
    let kolo_pid = Pid::from_raw(child.id() as i32);
    kill(kolo_pid, Signal::SIGINT).unwrap();
    let mut stderr_lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in stderr_lines.by_ref() {
        let line = line.unwrap();
        seen.push(line.clone());
        if line.contains("stopping the job") {
            break;
        }
    }
    assert!(seen.iter().any(|l| l.contains("stopping the job")), "{seen:?}");
    kill(kolo_pid, Signal::SIGINT).unwrap();
    let mut status = None;
    wait_for("kolo to end after the second SIGINT", Duration::from_secs(60), || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    let rest: Vec<String> = stderr_lines.map_while(Result::ok).collect();
    let status = status.unwrap();
    assert_eq!(status.code(), Some(130), "{seen:?} {rest:?}");
    assert!(rest.iter().any(|l| l.contains("SIGINT again; killing every rank now")), "{rest:?}");
    for pid in pids_in(dir.path()) {
        assert!(!alive(pid), "{pid} outlived the second SIGINT");
    }
}

#[test]
fn a_command_that_cannot_start_is_a_clear_error() {
    let out = run(&["run", "-np", "2", "--", "/nonexistent/program", "arg"]);
    assert_eq!(out.status.code(), Some(127));
    assert!(
        stderr(&out).contains("could not start '/nonexistent/program': No such file or directory"),
        "{}",
        stderr(&out)
    );
    let dir = TempDir::new("noexec");
    let file = dir.path().join("not-executable");
    std::fs::write(&file, "#!/bin/sh\n").unwrap();
    let out = run(&["run", "-np", "1", "--", file.to_str().unwrap()]);
    failed_with(&out, 126);
}

#[test]
fn output_options() {
    let dir = TempDir::new("outfiles");
    let out_dir = dir.path().join("logs");
    let out = run(&[
        "run",
        "-np",
        "11",
        "--output-filename",
        out_dir.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        "echo out $RANK; echo err $RANK >&2",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(out_dir.join("rank.03/stdout")).unwrap(), "out 3\n");
    assert_eq!(std::fs::read_to_string(out_dir.join("rank.10/stderr")).unwrap(), "err 10\n");
    assert!(stdout(&out).contains("[10]<stdout>:out 10\n"));

    // \r ends a line too, and a last partial line keeps its prefix
    let out = run(&["run", "-np", "1", "--", "printf", "a\\rb\\nc"]);
    assert_eq!(stdout(&out), "[0]<stdout>:a\r[0]<stdout>:b\n[0]<stdout>:c\n");

    let out = run(&["run", "-np", "1", "--disable-prefix", "--", "echo", "plain"]);
    assert_eq!(stdout(&out), "plain\n");

    let out = run(&["run", "-np", "1", "--prefix-output-with-timestamp", "--", "echo", "t"]);
    let line = stdout(&out);
    // asctime, e.g. "Wed Dec  2 14:01:33 2026[0]<stdout>:t"
    let (time, rest) = line.split_at(24);
    assert_eq!(rest, "[0]<stdout>:t\n", "{line}");
    assert_eq!(time.split_whitespace().count(), 5, "{line}");
}

#[test]
fn environment_forwarding_and_overrides() {
    let out = kolo()
        .args([
            "run", "-np", "2", "-x", "FROM_HERE", "-x", "SET_BY_X=xv", "--env", "SET_BY_ENV=ev", "--",
            "sh", "-c",
            "echo \"$KEEP|${CUDA_VISIBLE_DEVICES-unset}|${OLDPWD-unset}|$FROM_HERE|$SET_BY_X|$SET_BY_ENV|$PYTHONUNBUFFERED|${KOLO_SECRET:+secret}|$(env | grep -c KOLO_WORKER_)\"",
        ])
        .env("KEEP", "kept")
        .env("FROM_HERE", "fh")
        .env("CUDA_VISIBLE_DEVICES", "7")
        .env("OLDPWD", "/old")
        .output_within(JOB_DEADLINE);
    assert!(out.status.success(), "{}", stderr(&out));
    for line in stdout(&out).lines() {
        assert!(line.ends_with(":kept|unset|unset|fh|xv|ev|1|secret|0"), "{line}");
    }
}

#[test]
fn simulated_nodes_get_their_own_node_ids_and_ranks() {
    let out = run(&[
        "run",
        "--engine",
        "local",
        "-np",
        "4",
        "-H",
        "node-a:2,node-b:2",
        "--",
        "sh",
        "-c",
        "echo $HOROVOD_HOSTNAME $HOROVOD_LOCAL_RANK $HOROVOD_CROSS_RANK $GROUP_RANK",
    ]);
    assert_eq!(
        sorted_lines(&out),
        [
            "[0]<stdout>:node-a 0 0 0",
            "[1]<stdout>:node-a 1 0 0",
            "[2]<stdout>:node-b 0 1 1",
            "[3]<stdout>:node-b 1 1 1",
        ]
    );
}

#[test]
fn gpus_declared_in_the_host_file_are_shared_per_node() {
    let (_dir, hf) = host_file("gpus", "a slots=2 gpus=4\nb slots=1 gpus=3\n");
    let hf = hf.as_str();
    let out = run(&[
        "run",
        "--engine",
        "local",
        "--hostfile",
        hf,
        "--gpus-per-worker",
        "2",
        "--",
        "sh",
        "-c",
        "echo $HOROVOD_HOSTNAME $LOCAL_RANK $CUDA_VISIBLE_DEVICES",
    ]);
    assert_eq!(sorted_lines(&out), ["[0]<stdout>:a 0 0,1,2,3", "[1]<stdout>:a 1 0,1,2,3", "[2]<stdout>:b 0 0,1"]);
    let plan = dry_run(&["--hostfile", hf, "--gpus-per-worker", "1"]);
    let visible: Vec<&str> = plan.iter().map(|r| r["env"]["CUDA_VISIBLE_DEVICES"].as_str().unwrap()).collect();
    assert_eq!(visible, ["0,1", "0,1", "0"]);
    let out = run(&["run", "--engine", "local", "--hostfile", hf, "--gpus-per-worker", "4", "--", "true"]);
    assert!(!out.status.success());
    assert_stderr_has(&out, "cannot place 3 workers with 1 CPU and 4 GPUs each");
    assert_stderr_has(&out, "b (1 CPU, 3 GPUs)");
}

/// The training demo (kolo-comm's `train` example) through `kolo run`:
/// it must converge, on one host and on two simulated hosts.
#[test]
fn the_training_demo_converges() {
    let kolo = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kolo"));
    let train = kolo.parent().unwrap().join("examples").join("train");
    assert!(train.exists(), "{} is missing: build it with cargo build --examples", train.display());
    for hosts in ["localhost:4", "a:2,b:2"] {
        let out =
            run(&["run", "--engine", "local", "-np", "4", "-H", hosts, "--", train.to_str().unwrap(), "--epochs", "5"]);
        assert!(out.status.success(), "{hosts}: {}{}", stdout(&out), stderr(&out));
        let text = stdout(&out);
        let last = text.lines().find(|l| l.starts_with("[0]<stdout>:final loss")).expect("a final loss line");
        let loss: f32 = last.split_whitespace().nth(2).unwrap().parse().unwrap();
        assert!(loss < 0.35, "{hosts}: {last}");
        assert_eq!(text.lines().filter(|l| l.contains("epoch")).count(), 5, "{text}");
    }
}

/// `kolo run ARGS -- sh -c ...` whose ranks write "their pid, their
/// agent's pid" into `dir`; those for which `done` (a shell test) holds
/// then exit, the others wait for `go` in `dir` and then run `then`.
fn ranks_waiting_for_go(dir: &Path, args: &[&str], done: &str, then: &str) -> Child {
    let script = format!(
        "echo $$ $PPID > {d}/$RANK.pid; {done} && exit 0; while [ ! -e {go} ]; do sleep 0.01; done{then}",
        d = dir.display(),
        go = dir.join("go").display()
    );
    kolo().args(args).args(["--", "sh", "-c", &script]).start(Stdio::piped(), Stdio::piped())
}

/// Lets the ranks of [`ranks_waiting_for_go`] go: the job must end well,
/// with no rank lost.
fn let_go(dir: &Path, child: Child) -> Output {
    std::fs::write(dir.join("go"), "").unwrap();
    let out = output_within(child, JOB_DEADLINE);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("lost"), "{}", stderr(&out));
    out
}

/// A rank that is done no longer needs its agent: the agent goes while the
/// others still run (not all at the job's end), and its going is no loss.
/// The ranks are on two (simulated) nodes, so each has an agent process
/// of its own.
#[test]
fn the_agent_of_a_finished_rank_exits_while_the_others_run() {
    let dir = TempDir::new("released-agent");
    // rank 1 waits for `go`
    let args = ["run", "--engine", "local", "-H", "a:1,b:1", "--nics", "lo", "-np", "2"];
    let child = ranks_waiting_for_go(dir.path(), &args, "[ $RANK = 0 ]", "");
    let _kill = KillOnDrop(child.id());
    wait_for("both ranks to write their pids", Duration::from_secs(20), || pids_in(dir.path()).len() == 4);
    let read = |rank: u32| std::fs::read_to_string(dir.path().join(format!("{rank}.pid"))).unwrap();
    let agent_of = |rank: u32| read(rank).split_whitespace().nth(1).unwrap().parse::<i32>().unwrap();
    let (first, second) = (agent_of(0), agent_of(1));
    wait_for("rank 0's agent to exit", Duration::from_secs(20), || !alive(first));
    assert!(alive(second), "rank 1's agent went before its rank ended");
    let_go(dir.path(), child);
}

/// The agents of one node's commands share one process (one start instead
/// of one per rank); ranks that end early leave the others running, and
/// the job ends well.
#[test]
fn the_ranks_of_a_node_share_one_agent_process() {
    let dir = TempDir::new("shared-agent");
    // ranks 0 and 1 end at once; ranks 2 and 3 wait for `go`
    let child = ranks_waiting_for_go(dir.path(), &["run", "-np", "4"], "[ $RANK -lt 2 ]", "; echo done");
    let _kill = KillOnDrop(child.id());
    wait_for("every rank to write its pids", Duration::from_secs(20), || pids_in(dir.path()).len() == 8);
    let pids = |rank: u32| -> Vec<i32> {
        let text = std::fs::read_to_string(dir.path().join(format!("{rank}.pid"))).unwrap();
        text.split_whitespace().map(|p| p.parse().unwrap()).collect()
    };
    let agents: Vec<i32> = (0..4).map(|rank| pids(rank)[1]).collect();
    assert!(agents.iter().all(|a| *a == agents[0]), "one agent process for the node's ranks: {agents:?}");
    wait_for("ranks 0 and 1 to end", Duration::from_secs(20), || !alive(pids(0)[0]) && !alive(pids(1)[0]));
    // their agents leave: they stop beating, and say nothing of it
    let beating = |rank: u32| {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", agents[0])).unwrap();
        tasks.flatten().any(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == format!("kolo-beat-{rank}"))
        })
    };
    wait_for("the agents of ranks 0 and 1 to leave", Duration::from_secs(20), || !beating(0) && !beating(1));
    assert!(beating(2) && beating(3), "the agents of the waiting ranks left");
    assert!(alive(agents[0]) && alive(pids(2)[0]) && alive(pids(3)[0]), "the waiting ranks or their agent ended");
    let out = let_go(dir.path(), child);
    assert_eq!(String::from_utf8_lossy(&out.stdout).matches(":done").count(), 2);
    wait_for("the agent process to end", Duration::from_secs(10), || !alive(agents[0]));
}

/// A rank's private directory (its error file, its Python hook) is in
/// `TMPDIR` when set, else in memory (`/dev/shm`), and gone with the job.
#[test]
fn rank_directories_are_in_tmpdir_when_set_else_in_memory() {
    let tmp = TempDir::new("rank-dir-base");
    let script = "echo \"$TORCHELASTIC_ERROR_FILE\"";
    let in_tmp = kolo()
        .env("TMPDIR", tmp.path())
        .args(["run", "--disable-prefix", "-np", "1", "--", "sh", "-c", script])
        .output_within(JOB_DEADLINE);
    let unset = kolo()
        .env_remove("TMPDIR")
        .args(["run", "--disable-prefix", "-np", "1", "--", "sh", "-c", script])
        .output_within(JOB_DEADLINE);
    for (out, base) in [(&in_tmp, tmp.path().to_path_buf()), (&unset, std::path::PathBuf::from("/dev/shm"))] {
        assert!(out.status.success(), "{}", stderr(out));
        let file = std::path::PathBuf::from(stdout(out).trim());
        let dir = file.parent().unwrap();
        assert_eq!(dir.parent(), Some(base.as_path()), "{}", file.display());
        assert!(dir.file_name().unwrap().to_string_lossy().starts_with("kolo-rank-"), "{}", file.display());
        assert!(!dir.exists(), "{} outlived its job", dir.display());
    }
}
