//! `kolo nics`: which interfaces every host can use to reach the next.

use std::time::Duration;

use anyhow::{bail, Result};
use kolo_engine::{EngineChoice, SshOptions};
use kolo_topology::{parse_host_list, HostSpec};

use crate::cli::NicsArgs;
use crate::out::{say, Said};

/// `kolo nics`: one agent per host, interface detection, a line per host pair.
pub(crate) async fn nics(args: NicsArgs) -> Result<i32> {
    let hosts: Vec<HostSpec> = parse_host_list(&args.hosts)?.into_iter().map(|h| HostSpec { slots: 1, ..h }).collect();
    let ssh = SshOptions {
        port: args.ssh_port,
        identity_file: args.ssh_identity_file.clone(),
        config_file: args.ssh_config.clone(),
        options: Vec::new(),
        connect_timeout: Some(args.start_timeout.min(30)),
    };
    let mut settings = kolo_exec::Settings::default();
    settings.start_timeout = Duration::from_secs(args.start_timeout.max(1));
    settings.ssh = ssh;
    let request = kolo_engine::WorkerRequest::colocated(hosts.len() as u32, 1);
    let mut executor = match args.engine {
        // host names are looked up off the async runtime
        EngineChoice::Auto => {
            tokio::task::spawn_blocking(move || kolo_exec::Executor::on_hosts(settings, request, hosts)).await??
        }
        EngineChoice::Ssh => {
            let engine = Box::new(kolo_engine::SshEngine::new(hosts, settings.ssh.clone()));
            kolo_exec::Executor::with_engine(settings, request, engine)?
        }
        EngineChoice::Slurm => {
            kolo_exec::Executor::with_engine(settings, request, Box::new(kolo_engine::SlurmEngine::from_allocation()?))?
        }
        EngineChoice::Local => {
            kolo_exec::Executor::with_engine(settings, request, Box::new(kolo_engine::LocalEngine::with_hosts(hosts)))?
        }
        EngineChoice::Ray => bail!("kolo nics probes the hosts of -H; Ray places workers itself: use ssh or local"),
    };
    let started = executor.start_workers(&[]).await;
    if let Err(e) = started {
        executor.shutdown().await;
        return Err(e.into());
    }
    let common = executor.workers().first().and_then(|w| w.env.get("KOLO_IFACES").cloned()).unwrap_or_default();
    for pair in executor.nic_report() {
        if args.json {
            let results: Vec<serde_json::Value> = pair
                .results
                .iter()
                .map(|(iface, addr, err)| serde_json::json!({"iface": iface, "addr": addr, "ok": err.is_none(), "error": err}))
                .collect();
            let line = serde_json::json!({"from": pair.from, "to": pair.to, "results": results});
            if say(&line.to_string())? == Said::Closed {
                break;
            }
        } else {
            let parts: Vec<String> = pair
                .results
                .iter()
                .map(|(iface, addr, err)| match err {
                    None => format!("{iface} ({addr}) ok"),
                    Some(e) => format!("{iface} ({addr}) failed: {e}"),
                })
                .collect();
            if say(&format!("{} -> {}: {}", pair.from, pair.to, parts.join(", ")))? == Said::Closed {
                break;
            }
        }
    }
    if args.json {
        say(&serde_json::json!({"common": common.split(',').collect::<Vec<_>>()}).to_string())?;
    } else {
        say(&format!("common: {common}"))?;
    }
    executor.shutdown().await;
    Ok(0)
}
