//! The job's stores and listeners as other users and other hosts see
//! them.

use std::process::Command;
use std::time::Duration;

use super::*;
use crate::common::*;

/// `store_client.py KIND ADDR PORT` inside `host`, as user `nobody` or as root.
fn store_client_in(host: &str, python: &str, kind: &str, addr: &str, port: &str, as_nobody: bool) -> String {
    let hx = testhosts().join("hx");
    store_client(&[&hx.to_string_lossy(), host], python, kind, addr, port, as_nobody)
}

/// A job over ssh on h1 and h2 whose ranks write their env and wait for
/// `done` in `dir`; the stores' addresses once both ranks run.
fn waiting_job(dir: &std::path::Path, hosts: &str, np: &str) -> (std::process::Child, String) {
    let cfg = ssh_config();
    let d = dir.display();
    let script = format!(
        "env > {d}/$RANK.env.tmp && mv {d}/$RANK.env.tmp {d}/$RANK.env; while [ ! -e {d}/done ]; do sleep 0.05; done"
    );
    let job = spawn_in_h1(&["run", "-np", np, "-H", hosts, "--ssh-config", &cfg], &script);
    let ranks: usize = np.parse().unwrap();
    wait_for("every rank to start", Duration::from_secs(60), || {
        (0..ranks).all(|r| dir.join(format!("{r}.env")).exists())
    });
    (job, std::fs::read_to_string(dir.join("0.env")).unwrap())
}

fn env_var(env: &str, name: &str) -> String {
    env.lines().find_map(|l| l.strip_prefix(&format!("{name}="))).unwrap_or_else(|| panic!("{name} in {env}")).into()
}

/// The stores serve no other user on any of the job's hosts (h1 runs the
/// driver: the kernel's socket tables say whose a connection is; h2's
/// agent answers for h2), and nobody on h3, which is not a job host.
#[test]
#[ignore = "needs the test hosts"]
fn the_jobs_stores_refuse_other_users_on_its_hosts_and_other_hosts() {
    let torch = python_with("torch");
    let python = torch.clone().unwrap_or_else(|| "python3".into());
    let dir = TempDir::new("hosts-stores");
    let (job, env) = waiting_job(dir.path(), "h1:1,h2:1", "2");
    let _reap = KillOnDrop(job.id());
    let http = (env_var(&env, "HOROVOD_GLOO_RENDEZVOUS_ADDR"), env_var(&env, "HOROVOD_GLOO_RENDEZVOUS_PORT"));
    let master = (env_var(&env, "MASTER_ADDR"), env_var(&env, "MASTER_PORT"));
    let mut stores = vec![("http", &python, &http)];
    if let Some(torch) = &torch {
        stores.push(("torch", torch, &master));
    }
    for (kind, python, (addr, port)) in stores {
        for host in ["h1", "h2"] {
            let said = store_client_in(host, python, kind, addr, port, true);
            assert!(said.starts_with("refused"), "nobody on {host} used the {kind} store: {said}");
            let said = store_client_in(host, python, kind, addr, port, false);
            assert_eq!(said, "wrote", "the job's user on {host} was refused the {kind} store");
        }
        let said = store_client_in("h3", python, kind, addr, port, false);
        assert!(said.starts_with("refused"), "h3, not a job host, used the {kind} store: {said}");
    }
    std::fs::write(dir.path().join("done"), "").unwrap();
    let out = output_within(job, JOB_DEADLINE);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("belongs to user 65534 of host h2"), "{err}");
    assert!(err.contains("not a host of the job"), "{err}");
    assert_nothing_left();
}

/// Listening TCP sockets of kolo processes on `host` bound to every address.
fn kolo_wildcard_listeners(host: &str) -> Vec<String> {
    let out = Command::new("ip").args(["netns", "exec", &format!("kolo-{host}"), "ss", "-Hltnp"]).output().unwrap();
    stdout(&out)
        .lines()
        .filter(|l| l.contains("\"kolo\""))
        .filter(|l| {
            l.split_whitespace()
                .nth(3)
                .is_some_and(|a| a.starts_with("0.0.0.0:") || a.starts_with("*:") || a.starts_with("[::]:"))
        })
        .map(String::from)
        .collect()
}

/// Once a job runs, no kolo process listens on every address of a host:
/// the interface probes' listeners are closed with the probes.
#[test]
#[ignore = "needs the test hosts"]
fn no_kolo_process_listens_on_every_address_once_the_job_runs() {
    let dir = TempDir::new("hosts-listeners");
    let (job, _) = waiting_job(dir.path(), "h1:2,h2:2", "4");
    let _reap = KillOnDrop(job.id());
    for host in ["h1", "h2"] {
        // the driver's ProbeDone reaches the agents within moments of the start
        let open = settled(|| kolo_wildcard_listeners(host));
        assert!(open.is_empty(), "on {host}: {open:?}");
    }
    std::fs::write(dir.path().join("done"), "").unwrap();
    let out = output_within(job, JOB_DEADLINE);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_nothing_left();
}
