//! An elastic job of functions in place (`kolo_job::elastic` driving,
//! `kolo_comm::elastic` in the workers): real worker processes (this test
//! binary in worker mode, local engine, simulated hosts); a worker dies
//! mid-training, the others go on from their last commit, the job's
//! results come from the last round, and the driver reports each change.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kolo_comm::elastic::{Elastic, State};
use kolo_comm::{CommError, ReduceOp};
use kolo_engine::{LocalEngine, WorkerRequest};
use kolo_exec::{Executor, Settings};
use kolo_job::elastic::{Cohort, CohortFactory, Discovery, ElasticEvent, ElasticJob, FunctionWork};
use kolo_proto::{Function, Registry, UserError, WorkerContext};
use kolo_topology::{ElasticConfig, HostSpec};
use libtest_mimic::{Arguments, Failed, Trial};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Progress {
    step: u64,
    /// Sum of each step's allreduce of ones: the world size at each step.
    total: f64,
}

/// Steps to `steps`, committing after each; the process on `victim` dies
/// (taking its worker with it) after committing step `die_after`.
#[derive(Serialize, Deserialize)]
struct Train {
    steps: u64,
    victim: String,
    die_after: u64,
}

impl Function for Train {
    const NAME: &'static str = "elastic-train";
    type Output = (Progress, u64, usize);
    fn call(self, ctx: &WorkerContext) -> Result<Self::Output, UserError> {
        let mut elastic = Elastic::from_env()?;
        let me = std::env::var("HOROVOD_HOSTNAME").unwrap_or_default();
        let mut state = State::new(Progress { step: 0, total: 0.0 });
        let rank = elastic.run(&mut state, |state, comm| {
            while state.step < self.steps {
                if me == self.victim && state.step == self.die_after {
                    std::process::exit(9);
                }
                let mut ones = [1.0f64];
                comm.allreduce_in_place(&mut ones, ReduceOp::Sum)?;
                state.total += ones[0];
                state.step += 1;
                state.commit()?;
                if comm.rank() == 0 {
                    let _ = ctx.report(&(state.step, comm.size() as u32));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Ok::<usize, CommError>(comm.rank())
        })?;
        Ok((state.into_inner(), elastic.round().unwrap_or(0), rank))
    }
}

fn registry() -> Registry {
    Registry::new().function::<Train>()
}

fn factory() -> CohortFactory {
    Arc::new(|cohort: Cohort| {
        Box::pin(async move {
            let settings = Settings::default().with_secret(cohort.secret);
            let engine = Box::new(LocalEngine::with_hosts(cohort.hosts));
            Executor::with_engine(settings, WorkerRequest::pack(cohort.np as u32), engine)
        })
    })
}

fn a_dead_worker_leaves_the_others_going_from_their_last_commit() -> Result<(), Failed> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let events = Arc::new(Mutex::new(Vec::new()));
    let heard = events.clone();
    let hosts = vec![HostSpec::new("a", 1), HostSpec::new("b", 1), HostSpec::new("c", 1)];
    let mut config = ElasticConfig::new(2, 3)?;
    config.elastic_timeout = Duration::from_secs(30);
    let outcome = runtime.block_on(ElasticJob::run(
        FunctionWork { function: Train { steps: 60, victim: "c".into(), die_after: 20 } },
        config,
        Discovery::fixed(hosts),
        factory(),
        Vec::new(),
        move |event| heard.lock().unwrap().push(event),
        std::future::pending(),
    ))?;
    let events = events.lock().unwrap().clone();
    if !outcome.succeeded() {
        return Err(format!("the job did not succeed: {outcome:?}; events {events:?}").into());
    }
    // 20 steps of three, then 40 of two: nothing committed was lost, nothing counted twice
    let want = Progress { step: 60, total: 20.0 * 3.0 + 40.0 * 2.0 };
    let got: Vec<_> = outcome.results.iter().map(|(p, round, rank)| (p.clone(), *round, *rank)).collect();
    if got != vec![(want.clone(), 1, 0), (want, 1, 1)] {
        return Err(format!("results {got:?}; events {events:?}").into());
    }
    let round = |round, hosts: &[(&str, u32)]| ElasticEvent::Round {
        round,
        hosts: hosts.iter().map(|(h, n)| (h.to_string(), *n)).collect(),
    };
    let lost = events.iter().any(|e| matches!(e, ElasticEvent::Failed { rank: Some(2), host, .. } if host == "c"));
    let blacklisted = events.contains(&ElasticEvent::Blacklisted { host: "c".into(), duration: None });
    let rounds: Vec<&ElasticEvent> = events.iter().filter(|e| matches!(e, ElasticEvent::Round { .. })).collect();
    if !lost || !blacklisted || rounds != [&round(0, &[("a", 1), ("b", 1), ("c", 1)]), &round(1, &[("a", 1), ("b", 1)])]
    {
        return Err(format!("events {events:?}").into());
    }
    // rank 0's reports reach the driver from both rounds, with their round rank
    let reports: Vec<(Option<u32>, (u64, u32))> = events
        .iter()
        .filter_map(|e| match e {
            ElasticEvent::Reported { rank, .. } => Some((*rank, e.reported()?.ok()?)),
            _ => None,
        })
        .collect();
    let sizes = |size| reports.iter().filter(|(_, (_, s))| *s == size).count();
    let last = reports.last().map(|(_, r)| *r);
    if reports.iter().any(|(rank, _)| *rank != Some(0)) || sizes(3) < 10 || sizes(2) < 30 || last != Some((60, 2)) {
        return Err(format!("reports {reports:?}").into());
    }
    Ok(())
}

fn main() {
    kolo_agent::serve_if_worker(registry());
    let args = Arguments::from_args();
    let tests = vec![Trial::test(
        "a_dead_worker_leaves_the_others_going_from_their_last_commit",
        a_dead_worker_leaves_the_others_going_from_their_last_commit,
    )];
    libtest_mimic::run(&args, tests).exit();
}
