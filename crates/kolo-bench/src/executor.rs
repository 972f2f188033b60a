//! The Executor's own costs: start to first result, one `execute` round
//! over all workers (median, p99), and shutdown, on the local engine.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;
use kolo_engine::{LocalEngine, WorkerRequest};
use kolo_exec::{Executor, Settings};
use kolo_proto::{Executable, Registry, Task, UserError, WorkerContext};
use kolo_topology::HostSpec;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::{median, Table};

#[derive(Args, Debug)]
pub struct ExecutorArgs {
    /// Workers; repeat for several (default: 4 and 16).
    #[arg(short = 'n', long = "np")]
    np: Vec<u32>,
    /// `execute` rounds timed per size.
    #[arg(long, default_value_t = 2000)]
    rounds: u32,
    #[arg(long)]
    json: bool,
}

/// The smallest executable: it only answers.
pub(crate) struct Idle;

impl Executable for Idle {
    const NAME: &'static str = "bench-idle";
    type Args = ();
    fn create(_: (), _: &WorkerContext) -> Result<Self, UserError> {
        Ok(Idle)
    }
}

/// A call that does nothing but return the rank.
#[derive(Serialize, Deserialize)]
pub(crate) struct Ping;

impl Task<Idle> for Ping {
    const NAME: &'static str = "bench-ping";
    type Output = u32;
    fn run(self, _: &mut Idle, ctx: &WorkerContext) -> Result<u32, UserError> {
        Ok(ctx.rank())
    }
}

pub(crate) fn register(registry: Registry) -> Registry {
    registry.executable::<Idle>().task::<Idle, Ping>()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) async fn run(args: ExecutorArgs) -> Result<i32> {
    let sizes = if args.np.is_empty() { vec![4, 16] } else { args.np.clone() };
    if args.rounds == 0 || sizes.contains(&0) {
        bail!("--rounds and --np must be at least 1");
    }
    let table = Table::new(args.json, &["workers", "start_ms", "execute_p50_us", "execute_p99_us", "shutdown_ms"]);
    for n in sizes {
        let engine = LocalEngine::with_hosts(vec![HostSpec::new("localhost", n)]);
        let mut executor = Executor::with_engine(Settings::default(), WorkerRequest::pack(n), Box::new(engine))?;
        let begin = Instant::now();
        executor.start::<Idle>(&(), &[]).await?;
        let first = executor.execute(&Ping).await?;
        let start = begin.elapsed();
        if first != (0..n).collect::<Vec<_>>() {
            bail!("results out of rank order: {first:?}");
        }
        let mut rounds = Vec::with_capacity(args.rounds as usize);
        for _ in 0..args.rounds {
            let t = Instant::now();
            let results = executor.execute(&Ping).await?;
            rounds.push(t.elapsed().as_secs_f64() * 1e6);
            if results.len() != n as usize {
                bail!("{} results from {n} workers", results.len());
            }
        }
        let p99 = {
            let mut sorted = rounds.clone();
            sorted.sort_by(f64::total_cmp);
            sorted[((sorted.len() as f64 * 0.99).ceil() as usize).saturating_sub(1)]
        };
        let p50 = median(&mut rounds);
        let t = Instant::now();
        executor.shutdown().await;
        let shutdown = t.elapsed();
        table.row(&[json!(n), json!(ms(start)), json!(p50), json!(p99), json!(ms(shutdown))]);
    }
    Ok(0)
}
