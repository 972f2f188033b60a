//! `kolo-bench ...`: kolo's figures side by side with their references,
//! printed as a table, or with `--json` one JSON object per row. The
//! collectives and executor benchmarks run through kolo's own Executor,
//! with this binary as their worker program.

#![forbid(unsafe_code)]

mod collective;
mod executor;
mod launch;
mod rendezvous;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "kolo-bench", version, about = "Measure kolo against its references")]
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

fn main() -> ExitCode {
    // started by the Executor as a worker: serve it, never return
    kolo_agent::serve_if_worker(worker_registry());
    // `-np 4` as mpirun and kolo run users type it
    let args = BenchArgs::parse_from(std::env::args_os().map(|a| if a == "-np" { "--np".into() } else { a }));
    tracing_subscriber::fmt().with_max_level(tracing::Level::WARN).with_writer(std::io::stderr).init();
    // the executor benchmarks measure kolo's driver as `kolo` runs it: on
    // one thread; the rendezvous load generator wants every core
    let mut builder = if args.wants_threads() {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kolo-bench: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(bench(args)) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("kolo-bench: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// The `kolo` binary beside this one (both are built into the same folder).
pub fn kolo_binary() -> Result<std::path::PathBuf> {
    use anyhow::Context;
    let me = std::env::current_exe().context("cannot find this program")?;
    let kolo = me.with_file_name("kolo");
    anyhow::ensure!(kolo.exists(), "{} is missing: build it (cargo build --release -p kolo)", kolo.display());
    Ok(kolo)
}

/// What this program's workers can run for the benchmarks.
pub fn worker_registry() -> kolo_proto::Registry {
    collective::register(executor::register(kolo_proto::Registry::new()))
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
