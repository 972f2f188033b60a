//! `kolo bench ...`: figures side by side with their references, printed
//! as a table, or with `--json` one JSON object per row.

mod collective;
mod executor;
mod launch;
mod rendezvous;

use anyhow::Result;
use clap::{Args, Subcommand};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchCommand,
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Start-up of `kolo run -np N` of a trivial command against `mpirun -np N`.
    Launch(launch::LaunchArgs),
    /// Gloo's full-mesh rendezvous traffic for N simulated ranks against a server.
    Rendezvous(rendezvous::RendezvousBenchArgs),
    /// The Executor's start, execute round and shutdown times.
    Executor(executor::ExecutorArgs),
    /// kolo-comm allreduce bandwidth (nccl-tests columns).
    Allreduce(collective::CollectiveArgs),
    /// kolo-comm allgather bandwidth.
    Allgather(collective::CollectiveArgs),
    /// kolo-comm reduce-scatter bandwidth.
    ReduceScatter(collective::CollectiveArgs),
    /// kolo-comm broadcast bandwidth.
    Broadcast(collective::CollectiveArgs),
    /// kolo-comm reduce bandwidth.
    Reduce(collective::CollectiveArgs),
}

impl BenchArgs {
    /// Whether the benchmark needs a multi-threaded runtime.
    pub fn wants_threads(&self) -> bool {
        matches!(self.what, BenchCommand::Rendezvous(_))
    }
}

/// What `kolo` workers can run for the benchmarks.
pub fn worker_registry() -> kolo_exec::Registry {
    collective::register(executor::register(kolo_exec::Registry::new()))
}

pub async fn bench(args: BenchArgs) -> Result<i32> {
    match args.what {
        BenchCommand::Launch(a) => launch::run(a).await,
        BenchCommand::Rendezvous(a) => rendezvous::run(a).await,
        BenchCommand::Executor(a) => executor::run(a).await,
        BenchCommand::Allreduce(a) => collective::run(collective::Collective::Allreduce, a).await,
        BenchCommand::Allgather(a) => collective::run(collective::Collective::Allgather, a).await,
        BenchCommand::ReduceScatter(a) => collective::run(collective::Collective::ReduceScatter, a).await,
        BenchCommand::Broadcast(a) => collective::run(collective::Collective::Broadcast, a).await,
        BenchCommand::Reduce(a) => collective::run(collective::Collective::Reduce, a).await,
    }
}

/// A table row: printed aligned, or as one JSON object.
pub struct Table {
    json: bool,
    columns: Vec<&'static str>,
}

impl Table {
    pub fn new(json: bool, columns: &[&'static str]) -> Table {
        let table = Table { json, columns: columns.to_vec() };
        if !json {
            let head: Vec<String> = table.columns.iter().map(|c| format!("{c:>14}")).collect();
            println!("{}", head.join(" "));
        }
        table
    }

    pub fn row(&self, values: &[serde_json::Value]) {
        if self.json {
            let object: serde_json::Map<String, serde_json::Value> =
                self.columns.iter().map(|c| c.to_string()).zip(values.iter().cloned()).collect();
            println!("{}", serde_json::Value::Object(object));
        } else {
            let cells: Vec<String> = values
                .iter()
                .map(|v| match v {
                    serde_json::Value::Number(n) if n.is_f64() => {
                        format!("{:>14.3}", n.as_f64().unwrap_or(0.0))
                    }
                    serde_json::Value::String(s) => format!("{s:>14}"),
                    other => format!("{:>14}", other.to_string()),
                })
                .collect();
            println!("{}", cells.join(" "));
        }
    }
}

pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}
