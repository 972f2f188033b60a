//! The job's stores (torch's TCPStore and the Horovod-compatible HTTP
//! store) speak protocols without a secret; kolo serves them only to the
//! job's user on the job's hosts. Tried here as another user of this
//! machine (`nobody`, through setpriv: needs root), with the clients the
//! ranks use, against a running job that must not notice.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

fn try_store(python: &str, kind: &str, addr: &str, port: &str, as_nobody: bool) -> String {
    store_client(&[], python, kind, addr, port, as_nobody)
}

fn can_switch_users() -> bool {
    let root = nix::unistd::geteuid().is_root();
    let setpriv = Command::new("setpriv").arg("--version").output().is_ok_and(|o| o.status.success());
    if !(root && setpriv) {
        eprintln!("skipped: trying the stores as another user needs root and setpriv");
    }
    root && setpriv
}

#[test]
fn another_user_of_the_machine_can_neither_read_nor_write_the_jobs_stores() {
    if !can_switch_users() {
        return;
    }
    let torch = python_with("torch");
    let python = torch.clone().unwrap_or_else(|| "python3".into());
    let as_nobody = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--", &python, "-c", "pass"])
        .current_dir("/")
        .output();
    if !as_nobody.is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: user nobody cannot run {python} (set KOLO_TEST_PYTHON to a Python all users can run)");
        return;
    }
    let dir = TempDir::new("stores");
    let d = dir.path().display();
    let script = format!(
        "env > {d}/$RANK.env.tmp && mv {d}/$RANK.env.tmp {d}/$RANK.env; while [ ! -e {d}/done ]; do sleep 0.05; done"
    );
    let job = kolo().args(["run", "-np", "1", "--", "sh", "-c", &script]).start(Stdio::piped(), Stdio::piped());
    let _reap = KillOnDrop(job.id());
    let env_file = dir.path().join("0.env");
    wait_for("the rank to start", Duration::from_secs(30), || env_file.exists());
    let env = std::fs::read_to_string(&env_file).unwrap();
    let var = |name: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("{name} in {env}"))
            .to_string()
    };
    let http = (var("HOROVOD_GLOO_RENDEZVOUS_ADDR"), var("HOROVOD_GLOO_RENDEZVOUS_PORT"));
    let master = (var("MASTER_ADDR"), var("MASTER_PORT"));

    let said = try_store(&python, "http", &http.0, &http.1, true);
    assert!(said.starts_with("refused"), "nobody used the HTTP store: {said}");
    let said = try_store(&python, "http", &http.0, &http.1, false);
    assert_eq!(said, "wrote", "the job's user was refused the HTTP store");
    if let Some(torch) = &torch {
        let said = try_store(torch, "torch", &master.0, &master.1, true);
        assert!(said.starts_with("refused"), "nobody used torch's store: {said}");
        let said = try_store(torch, "torch", &master.0, &master.1, false);
        assert_eq!(said, "wrote", "the job's user was refused torch's store");
    }

    std::fs::write(dir.path().join("done"), "").unwrap();
    let out = output_within(job, JOB_DEADLINE);
    assert!(out.status.success(), "{}", stderr(&out));
    // each refusal was said, naming whose the connection was
    assert_stderr_has(&out, "belongs to user 65534");
}
