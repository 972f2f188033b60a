//! `kolo run --dry-run`: the plan the job would run, from the code that
//! runs it.

use anyhow::{bail, Result};
use kolo_engine::EngineChoice;
use kolo_job::Job;
use kolo_topology::env_names::SECRET;
use kolo_topology::{JobEnv, CHOSEN_AT_START, IFACE_VARS};

use crate::out::{say, Said};

/// The plan the job would run, one JSON object per rank: exactly what
/// `kolo run` starts, with the values chosen at start marked `<...>`.
pub(crate) async fn dry_run(job: &Job) -> Result<i32> {
    if job.spec().engine == EngineChoice::Slurm && !kolo_engine::SlurmEngine::in_allocation() {
        bail!("--dry-run cannot show where Slurm places ranks before it grants the nodes; run it inside salloc");
    }
    let mut executor = job.executor().await?;
    let settings = job.settings();
    let plan = executor.plan().await?.clone();
    let multi_node = plan.node_representatives().len() > 1;
    let ifaces = match (&settings.nics, multi_node) {
        (Some(nics), _) => nics.clone(),
        (None, true) => vec!["<detected at start>".to_string()],
        (None, false) => vec!["lo".to_string()],
    };
    let job_env = JobEnv { timeout_s: settings.start_timeout.as_secs(), ifaces, ..JobEnv::placeholder() };
    for (rank, worker) in plan.workers.iter().enumerate() {
        let i = &worker.ranks;
        let mut env = plan.env(rank, &job_env, job.env(), |name| std::env::var(name).ok());
        env.insert(SECRET.into(), String::new());
        for key in CHOSEN_AT_START {
            if let Some(value) = env.get_mut(key) {
                *value = format!("<{} chosen at start>", key.to_lowercase());
            }
        }
        if multi_node && settings.nics.is_none() {
            for key in IFACE_VARS {
                env.insert(key.into(), "<detected at start>".into());
            }
        }
        let line = serde_json::json!({
            "rank": i.rank,
            "size": i.size,
            "local_rank": i.local_rank,
            "local_size": i.local_size,
            "cross_rank": i.cross_rank,
            "cross_size": i.cross_size,
            "host": worker.host.hostname,
            "node_id": worker.host.node_id,
            "gpus": worker.gpus,
            "env": env,
        });
        if say(&line.to_string())? == Said::Closed {
            break;
        }
    }
    Ok(0)
}
