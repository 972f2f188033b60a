//! Real PyTorch and JAX jobs under `kolo run`, unchanged scripts, on one
//! machine and on two simulated nodes (the test hosts run them across
//! machines: hosts.rs).

mod common;

use common::*;

/// The lines of a job's stdout that carry `marker`.
fn lines_with(text: &str, marker: &str) -> usize {
    text.lines().filter(|l| l.contains(marker)).count()
}

/// Runs `script` on 4 ranks with the Python that has `module` (on two
/// simulated nodes when `hosts` says so); its stdout, or `None` when that
/// Python is missing (skipped).
fn four_ranks(module: &str, script: &str, extra: &[&str], hosts: Option<&str>) -> Option<String> {
    let python = python_with(module)?;
    let script = repo_file(script);
    let mut args = vec!["run", "-np", "4"];
    args.extend(extra);
    if let Some(hosts) = hosts {
        args.extend(["--engine", "local", "-H", hosts, "--nics", "lo"]);
    }
    args.extend(["--", &python, &script]);
    let out = run(&args);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    Some(text)
}

fn ddp(hosts: Option<&str>) {
    let Some(text) = four_ranks("torch", "examples/ddp.py", &[], hosts) else { return };
    assert_eq!(lines_with(&text, "/4 on "), 4, "{text}");
    // the same parameters on every rank (the script checks; so does this)
    let params: std::collections::HashSet<&str> =
        text.lines().filter_map(|l| l.split("params ").nth(1)?.split(',').next()).collect();
    assert_eq!(params.len(), 1, "{text}");
}

#[test]
fn pytorch_ddp_on_four_ranks() {
    ddp(None);
}

#[test]
fn pytorch_ddp_on_two_simulated_nodes() {
    ddp(Some("node-a:2,node-b:2"));
}

#[test]
fn every_call_of_torchs_store_client_is_served() {
    let Some(python) = python_with("torch") else { return };
    let out = run(&["run", "-np", "1", "--", &python, &repo_file("crates/kolo/tests/python/torch_store_calls.py")]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains("every store call answered"), "{}", stdout(&out));
}

#[test]
fn a_rank_raising_under_record_has_its_traceback_in_the_report() {
    let Some(python) = python_with("torch") else { return };
    let out = run(&["run", "-np", "2", "--", &python, &repo_file("crates/kolo/tests/python/raises.py")]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("kolo: rank 1 raised ValueError: rank 1 found a bad batch"), "{err}");
    // the traceback, down to the line that raised
    assert!(err.contains("in find_bad_batch"), "{err}");
    assert!(err.contains(r#"raise ValueError(f"rank {rank} found a bad batch")"#), "{err}");
}

fn jax(hosts: Option<&str>) {
    let Some(text) = four_ranks("jax", "examples/jax_check.py", &["-x", "JAX_PLATFORMS=cpu"], hosts) else { return };
    assert_eq!(lines_with(&text, "gathered [0, 1, 2, 3]"), 4, "{text}");
}

#[test]
fn jax_initialize_without_arguments_on_four_processes() {
    jax(None);
}

#[test]
fn jax_initialize_without_arguments_on_two_simulated_nodes() {
    jax(Some("node-a:2,node-b:2"));
}

/// The final loss `examples/elastic_ddp.py` printed.
fn final_loss(text: &str) -> f64 {
    let line = text.lines().find(|l| l.contains("final loss ")).unwrap_or_else(|| panic!("no final loss: {text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Restart mode with a PyTorch DDP script that checkpoints: a rank killed
/// mid-training restarts every rank, which resume from the checkpoint and
/// end with the model a run without faults ends with; nothing of the first
/// world is left.
#[test]
fn pytorch_ddp_with_a_checkpoint_survives_a_killed_rank_in_restart_mode() {
    let Some(python) = python_with("torch") else { return };
    let script = repo_file("examples/elastic_ddp.py");
    let dir = TempDir::new("elastic-ddp");
    let env = |name: &str| dir.path().join(name).to_string_lossy().into_owned();
    let job = |ckpt: &str| {
        let mut c = kolo();
        c.args(["run", "-np", "4", "--max-restarts", "2", "--", &python, &script])
            .env("CKPT", env(ckpt))
            .env("STEPS", "30")
            .env("STEP_SLEEP", "0.1")
            .env("PROGRESS", env("progress"))
            .env("PIDS", dir.path());
        c
    };
    let clean = job("clean.pt").output_within(JOB_DEADLINE);
    assert!(clean.status.success(), "{}", stderr(&clean));
    let _ = std::fs::remove_file(env("progress"));
    let child =
        job("faulty.pt").stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let step = || std::fs::read_to_string(env("progress")).ok().and_then(|s| s.trim().parse::<u32>().ok());
    wait_for("training to reach step 10", std::time::Duration::from_secs(120), || step().is_some_and(|s| s >= 10));
    let pid_of = |rank: u32, restart: u32| -> i32 {
        std::fs::read_to_string(dir.path().join(format!("{rank}.{restart}.pid"))).unwrap().trim().parse().unwrap()
    };
    let first_world: Vec<i32> = (0..4).map(|r| pid_of(r, 0)).collect();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(first_world[2]), nix::sys::signal::Signal::SIGKILL).unwrap();
    let faulty = output_within(child, JOB_DEADLINE);
    let text = stdout(&faulty);
    assert!(faulty.status.success(), "{text}{}", stderr(&faulty));
    assert!(stderr(&faulty).contains("rank 2 on host localhost was killed by signal 9 (SIGKILL); restarting"));
    let resumed = text.lines().find(|l| l.contains("restart 1,")).unwrap_or_else(|| panic!("no restart: {text}"));
    let from: u32 = resumed.split("resumed at step ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(from >= 10, "resumed from step {from}: {text}");
    let (a, b) = (final_loss(&stdout(&clean)), final_loss(&text));
    assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "final loss {b} after a fault, {a} without");
    assert!(first_world.iter().all(|&p| !alive(p)), "a rank of the first world outlived it");
}
