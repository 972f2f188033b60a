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
