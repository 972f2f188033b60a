//! PyTorch, JAX and kolo.Executor across the hosts, over ssh and
//! under Slurm, with rank 0 away from the driver.

use std::process::Output;
use std::time::Duration;

use super::*;
use crate::common::*;

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
    let text = succeeded(&out);
    assert!(text.contains("rank 0 on h2 served 3 ranks at 10.77.0.12:"), "{text}");
    assert_eq!(text.lines().filter(|l| l.contains("reached rank 0 at 10.77.0.12:")).count(), 3, "{text}");
    assert_nothing_left();
}

/// Runs `script` on 4 ranks launched from h1 onto h2 and h3 (rank 0 on
/// h2) with the Python that has `module`; its stdout, or `None` when that
/// Python is missing (skipped).
fn across_hosts(module: &str, script: &str, extra: &[&str]) -> Option<String> {
    across_hosts_with(module, script, extra, &[])
}

/// [`across_hosts`], with arguments for the script.
fn across_hosts_with(module: &str, script: &str, extra: &[&str], script_args: &[&str]) -> Option<String> {
    let python = python_with(module)?;
    let (cfg, script) = (ssh_config(), repo_file(script));
    let mut args = vec!["run", "-np", "4", "-H", "h2:2,h3:2", "--ssh-config", &cfg];
    args.extend(extra);
    args.extend(["--", &python, &script]);
    args.extend(script_args);
    let text = succeeded(&kolo_in_h1(&args));
    assert_nothing_left();
    Some(text)
}

/// Runs `script` through `kolo run` in a Slurm allocation of two nodes,
/// two tasks each, with the Python that has `module` (skipped when that
/// Python is missing): four rank lines (`.../4 on h...`) must show `each`.
fn four_ranks_under_slurm(module: &str, script: &str, each: &str) {
    let Some(python) = python_with(module) else { return };
    let script = repo_file(script);
    let text = succeeded(&in_h1(&salloc_kolo_run(&["-N2", "--ntasks-per-node=2"], &["--", &python, &script])));
    assert_eq!(text.lines().filter(|l| l.contains("/4 on h") && l.contains(each)).count(), 4, "{text}");
    assert_nothing_left();
}

/// Every rank printed the same parameters (`params P,...`).
#[track_caller]
fn assert_one_set_of_params(text: &str) {
    let params: std::collections::HashSet<&str> =
        text.lines().filter_map(|l| l.split("params ").nth(1)?.split(',').next()).collect();
    assert_eq!(params.len(), 1, "{text}");
}

/// `first` (rank 0's line, on h2) in `text`, and `each` (every rank's)
/// on four lines.
#[track_caller]
fn assert_rank_zero_and_four_ranks(text: &str, first: &str, each: &str) {
    assert!(text.contains(first), "{text}");
    assert_eq!(text.lines().filter(|l| l.contains(each)).count(), 4, "{text}");
}

/// Runs the Horovod `script` across hosts (see [`across_hosts`]): it must
/// print four rank lines (`.../4 on h...`), rank 0's on h2, all with the
/// same weights (`weights W`).
fn horovod_script_across_hosts(module: &str, script: &str) {
    let Some(text) = across_hosts(module, script, &[]) else { return };
    let ranks: Vec<&str> = text.lines().filter(|l| l.contains("/4 on h")).collect();
    assert_eq!(ranks.len(), 4, "{text}");
    assert!(ranks.iter().any(|l| l.contains("rank 0/4 on h2")), "{text}");
    let weights: std::collections::HashSet<&str> = ranks.iter().filter_map(|l| l.split("weights ").nth(1)).collect();
    assert_eq!(weights.len(), 1, "{text}");
}

/// PyTorch DDP from h1 onto h2 and h3: every rank, rank 0 (on h2) included,
/// uses the store kolo serves on h1.
#[test]
#[ignore = "needs the test hosts"]
fn pytorch_ddp_across_hosts_with_rank_zero_away_from_the_driver() {
    let Some(text) = across_hosts("torch", "examples/ddp.py", &[]) else { return };
    assert_rank_zero_and_four_ranks(&text, "rank 0/4 on h2", "store 10.77.0.11:");
    assert_one_set_of_params(&text);
}

/// DDP on kolo's own torch.distributed backend across hosts: kolo-comm
/// links between the hosts over the interface kolo chose, set up through
/// torch's store on h1.
#[test]
#[ignore = "needs the test hosts"]
fn pytorch_ddp_on_the_kolo_backend_across_hosts() {
    let Some(text) = across_hosts_with("torch, kolo", "examples/ddp.py", &[], &["kolo"]) else { return };
    assert_rank_zero_and_four_ranks(&text, "rank 0/4 on h2 (kolo)", "(kolo)");
    assert_one_set_of_params(&text);
}

/// A Horovod script (SyncBatchNorm, DistributedOptimizer) across hosts
/// over ssh: `import horovod.torch` is kolo's there.
#[test]
#[ignore = "needs the test hosts"]
fn a_horovod_script_across_hosts() {
    horovod_script_across_hosts("torch, kolo", "examples/horovod_train.py");
}

/// A Horovod Keras script (TensorFlow 2.21, Keras 3: model.fit with
/// DistributedOptimizer, SyncBatchNormalization, the callbacks) across
/// hosts over ssh: `import horovod.tensorflow.keras` is kolo's there.
#[test]
#[ignore = "needs the test hosts"]
fn a_horovod_keras_script_across_hosts() {
    horovod_script_across_hosts("tensorflow, keras, kolo", "examples/horovod_keras.py");
}

/// The same Horovod script through the Slurm engine.
#[test]
#[ignore = "needs the test hosts"]
fn a_horovod_script_under_slurm() {
    four_ranks_under_slurm("torch, kolo", "examples/horovod_train.py", "weights ");
}

/// JAX's no-argument initialize across hosts, process 0 on h2.
#[test]
#[ignore = "needs the test hosts"]
fn jax_across_hosts_with_process_zero_away_from_the_driver() {
    let Some(text) = across_hosts("jax", "examples/jax_check.py", &["-x", "JAX_PLATFORMS=cpu"]) else { return };
    assert_rank_zero_and_four_ranks(&text, "process 0/4 on h2", "gathered [0, 1, 2, 3]");
}

/// PyTorch DDP through the Slurm engine: the store is the driver's there too.
#[test]
#[ignore = "needs the test hosts"]
fn pytorch_ddp_under_slurm() {
    four_ranks_under_slurm("torch", "examples/ddp.py", "store 10.77.0.11:");
}

/// The lines `examples/executor_ddp.py` prints: rank lines must show 4
/// ranks with one set of parameters, on `hosts`, and rank 0's losses must
/// have reached the driver's callback.
fn check_executor_ddp(out: &Output, hosts: &[&str]) {
    let text = succeeded(out);
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
    let text = succeeded(&out);
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

/// What `tests/python/elastic_torch_ranks.py` left in `dir` as the
/// survivors on h1 and h2.
fn survivors_results(dir: &std::path::Path) -> Vec<serde_json::Value> {
    ["h1-0", "h2-0"]
        .iter()
        .map(|p| {
            let file = std::fs::read_to_string(dir.join(format!("{p}.json"))).expect("a survivor's result");
            serde_json::from_str::<serde_json::Value>(&file).unwrap()
        })
        .collect()
}

/// The samples a rank's result says it saw, in order.
fn samples_seen(result: &serde_json::Value) -> Vec<u64> {
    result["seen"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect()
}

/// Each epoch of `seen` (`samples` long) saw every sample once; else the
/// test fails showing `context`.
#[track_caller]
fn assert_every_sample_once_an_epoch(seen: &[u64], samples: u64, context: &str) {
    for epoch in seen.chunks(samples as usize) {
        let mut sorted = epoch.to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..samples).collect::<Vec<u64>>(), "{context}");
    }
}

/// In-place PyTorch across the hosts over ssh: h3 is cut off mid-training
/// (`ip link set eth0 down`: no process dies, nothing closes). Its peers'
/// collectives end when the driver, missing h3's heartbeats, starts the
/// next round; h1 and h2 finish with the same weights, and once h3 is back
/// its processes are gone too (they lost their driver). Horovod's elastic
/// API and DDP on the kolo backend.
#[test]
#[ignore = "needs the test hosts"]
fn in_place_pytorch_goes_on_without_a_cut_off_host() {
    let Some(python) = python_with("kolo.torch.elastic") else { return };
    let ranks = repo_file("tests/python/elastic_torch_ranks.py");
    for flavour in ["hvd", "kolo"] {
        let out = TempDir::new("hosts-torch-in-place");
        let dir = out.path().to_string_lossy().into_owned();
        let job = in_place_on_three_hosts(&[
            "--min-np",
            "2",
            "-x",
            "TIMES=1",
            "-x",
            "STEP_SLEEP=0.2",
            "-x",
            "EPOCHS=3",
            "--",
            &python,
            &ranks,
            flavour,
            &dir,
        ]);
        job.wait_for("step 3 size 3");
        let cut = LinkDown::cut("h3");
        let (ok, text) = job.finish();
        assert!(ok, "{flavour}: {text}");
        assert!(text.contains("rank 2 on host h3 was lost: no heartbeat"), "{flavour}: {text}");
        assert!(text.contains("round 1: 2 processes on h1:1,h2:1"), "{flavour}: {text}");
        let results = survivors_results(out.path());
        assert_eq!(results[0]["weights"], results[1]["weights"], "{flavour}: the survivors disagree");
        // the ranks' 96 samples (their default) once an epoch over the committed steps
        let seen = samples_seen(&results[0]);
        assert_eq!(seen.len(), 96 * 3, "{flavour}: {text}");
        assert_every_sample_once_an_epoch(&seen, 96, &format!("{flavour}: {text}"));
        assert!(!out.path().join("h3-0.json").exists(), "{flavour}: h3 finished while cut off");
        drop(cut);
        assert_nothing_left();
    }
}

/// Horovod's elastic API in place inside a Slurm allocation: h3's rank
/// dies mid-step, h1 and h2 finish with the same weights and every sample
/// of each epoch done once.
#[test]
#[ignore = "needs the test hosts"]
fn horovods_elastic_api_in_place_under_slurm() {
    let Some(python) = python_with("kolo.torch.elastic") else { return };
    let ranks = repo_file("tests/python/elastic_torch_ranks.py");
    let out_dir = TempDir::new("hosts-hvd-slurm");
    let dir = out_dir.path().to_string_lossy().into_owned();
    let out = in_h1(&salloc_kolo_run(
        &["-N3", "--ntasks-per-node=1"],
        &[
            "--in-place",
            "--min-np",
            "2",
            "-x",
            "FAULT=kill",
            "-x",
            "FAULT_AT=h3:0:3",
            "-x",
            "SAMPLES=48",
            "--",
            &python,
            &ranks,
            "hvd",
            &dir,
        ],
    ));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("round 1: 2 processes on h1:1,h2:1"), "{text}");
    let results = survivors_results(out_dir.path());
    assert_eq!(results[0]["weights"], results[1]["weights"], "{text}");
    // 48 samples: 12 a step on three ranks, 8 on two; every one once an epoch
    assert_every_sample_once_an_epoch(&samples_seen(&results[0]), 48, &text);
    wait_for("the allocation to be given back", Duration::from_secs(20), || slurm_jobs().trim().is_empty());
    assert_nothing_left();
}

/// `kolo stack` and `kolo status` on a job whose ranks run on h2 and h3,
/// asked on h1 where its driver runs: every rank answers through its agent.
#[test]
#[ignore = "needs the test hosts"]
fn stack_and_status_across_hosts() {
    let Some(python) = python_with("torch") else { return };
    let bin = std::path::Path::new(&python).parent().unwrap().to_string_lossy().into_owned();
    let cfg = ssh_config();
    let runtime = TempDir::new("hosts-stack");
    let xdg = format!("XDG_RUNTIME_DIR={}", runtime.path().display());
    let path = format!("PATH={bin}:/usr/local/bin:/usr/bin:/bin");
    let script = "import os, time\n\
                  def on_h2():\n    time.sleep(1000)\n\
                  def on_h3():\n    time.sleep(1000)\n\
                  print('up', flush=True)\n\
                  on_h2() if os.environ['HOROVOD_HOSTNAME'] == 'h2' else on_h3()\n";
    let t = testhosts();
    let mut child = Command::new(t.join("hx"))
        .args(["h1", "env", &xdg, &path, env!("CARGO_BIN_EXE_kolo"), "run", "-H", "h2:1,h3:1", "--ssh-config", &cfg])
        .args(["--", &python, "-c", script])
        .start(Stdio::piped(), Stdio::piped());
    let _reap = KillOnDrop(child.id());
    let ask = |args: &[&str]| {
        Command::new(t.join("hx"))
            .args(["h1", "env", &xdg, &path, env!("CARGO_BIN_EXE_kolo")])
            .args(args)
            .output_within(JOB_DEADLINE)
    };
    wait_for("both ranks up and asleep", Duration::from_secs(60), || {
        let out = ask(&["status", "--json"]);
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&stdout(&out)) else { return false };
        v["ranks"].as_array().is_some_and(|r| r.len() == 2 && r.iter().all(|r| r["state"] == "sleeping"))
    });
    let status: serde_json::Value = serde_json::from_str(&stdout(&ask(&["status", "--json"]))).unwrap();
    let hosts: Vec<&str> = status["ranks"].as_array().unwrap().iter().map(|r| r["host"].as_str().unwrap()).collect();
    assert_eq!(hosts, ["h2", "h3"]);
    let out = ask(&["stack"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{}", stderr(&out));
    // py-spy names the main thread only where threading was imported
    let (h2, h3) = (text.find("rank 0 (host h2):").expect(&text), text.find("rank 1 (host h3):").expect(&text));
    assert!(h2 < h3, "{text}");
    // each rank's own Python frame, under the native ones (time.sleep's C)
    assert!(text[h2..h3].contains("(idle)\n") && text[h2..h3].contains("      on_h2 (<string>:3)\n"), "{text}");
    assert!(text[h3..].contains("(idle)\n") && text[h3..].contains("      on_h3 (<string>:5)\n"), "{text}");
    assert!(text.contains("      time_sleep ("), "no native frames: {text}");
    let _ = child.kill();
    let _ = child.wait();
    assert_nothing_left();
}
