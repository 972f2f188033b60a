//! `kolo run --timeline` and `kolo timeline`, through the real binary:
//! the training demo with one rank slowed on purpose, on two simulated
//! hosts; the trace is read back as JSON and summarized.

mod common;

use std::os::unix::fs::PermissionsExt;

use common::*;
use serde_json::Value;

fn train() -> String {
    let kolo = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kolo"));
    let train = kolo.parent().unwrap().join("examples").join("train");
    assert!(train.exists(), "{} is missing: build it with cargo build --examples", train.display());
    train.to_string_lossy().into_owned()
}

#[test]
fn the_job_timeline_shows_every_rank_and_names_the_one_the_others_waited_for() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("job.json");
    let file = file.to_str().unwrap();
    let train = train();
    let args = ["--epochs", "4", "--samples", "12288", "--lr", "2", "--straggler", "2", "--straggler-ms", "20"];
    let mut all = vec!["run", "--engine", "local", "-np", "3", "-H", "a:2,b:1", "--timeline", file, "--", &train];
    all.extend_from_slice(&args);
    let out = run(&all);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_stderr_has(&out, "kolo: the job's timeline (3 ranks, ");
    assert_stderr_has(&out, &format!("summarize it with `kolo timeline {file}`"));
    assert_eq!(std::fs::metadata(file).unwrap().permissions().mode() & 0o777, 0o600);

    let trace: Value = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for e in events {
        let ph = e["ph"].as_str().unwrap();
        assert!(e["pid"].is_u64() && e["name"].is_string(), "{e}");
        if ph == "X" {
            assert!(e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0, "{e}");
        } else {
            assert_eq!(ph, "M", "{e}");
        }
    }
    let names: Vec<&str> =
        events.iter().filter(|e| e["name"] == "process_name").map(|e| e["args"]["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["rank 0 (a)", "rank 1 (a)", "rank 2 (b)"]);
    // each step's allreduce: ranks 0 and 1 wait for rank 2
    let waits = events.iter().filter(|e| e["cat"] == "kolo.wait").count();
    let named_two = events.iter().filter(|e| e["name"] == "waiting for rank 2").count();
    assert!(waits > 0 && named_two * 10 >= waits * 9, "{named_two} of {waits} waits are for rank 2");

    let summary = kolo().args(["timeline", file]).output_within(JOB_DEADLINE);
    let text = stdout(&summary);
    assert!(summary.status.success(), "{text}{}", stderr(&summary));
    assert!(text.starts_with("3 ranks, "), "{text}");
    let ranks = text.split("waited for (the last to submit):\n").nth(1).unwrap();
    assert!(ranks.starts_with("  rank 2 on b: last in "), "{text}");
    assert!(text.contains("allreduce of "), "{text}");
}

#[test]
fn timeline_mistakes_are_named_before_or_without_a_job() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no/such/dir/job.json");
    let out = run(&["run", "-np", "1", "--timeline", missing.to_str().unwrap(), "--", "true"]);
    let err = failed_with(&out, 2);
    assert!(err.contains("does not exist; create it first"), "{err}");
    let out = run(&["run", "-np", "1", "--timeline", dir.path().to_str().unwrap(), "--", "true"]);
    assert!(failed_with(&out, 2).contains("is a directory"));
    let out = run(&["run", "-np", "1", "--min-np", "1", "--timeline", "x.json", "--", "true"]);
    assert!(failed_with(&out, 2).contains("--timeline records a fixed job"));

    let out = kolo().args(["timeline", missing.to_str().unwrap()]).output_within(JOB_DEADLINE);
    assert!(failed_with(&out, 2).contains("cannot read"));
    let not_json = dir.path().join("x.json");
    std::fs::write(&not_json, "hello").unwrap();
    let out = kolo().args(["timeline", not_json.to_str().unwrap()]).output_within(JOB_DEADLINE);
    assert!(failed_with(&out, 2).contains("is not JSON"));
    std::fs::write(&not_json, "{\"a\": 1}").unwrap();
    let out = kolo().args(["timeline", not_json.to_str().unwrap()]).output_within(JOB_DEADLINE);
    assert!(failed_with(&out, 2).contains("no traceEvents"));
}

#[test]
fn a_job_without_collectives_still_writes_a_trace_saying_so() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("job.json");
    let out = run(&["run", "-np", "2", "--timeline", file.to_str().unwrap(), "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let summary = kolo().args(["timeline", file.to_str().unwrap()]).output_within(JOB_DEADLINE);
    assert!(stdout(&summary).contains("no collective was recorded"), "{}", stdout(&summary));
}
