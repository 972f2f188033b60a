//! The Executor in a few lines: start 4 workers (this same program in worker
//! mode), keep state in each, run calls on all of them, shut down.
//!
//!     cargo run --release -p kolo-exec --example executor

use kolo_engine::WorkerRequest;
use kolo_exec::{Executor, Settings};
use kolo_proto::{Executable, Function, Registry, Task, UserError, WorkerContext};
use serde::{Deserialize, Serialize};

/// Lives in every worker between calls: a running total.
struct Accumulator(f64);

impl Executable for Accumulator {
    const NAME: &'static str = "accumulator";
    type Args = f64;
    fn create(start: f64, _ctx: &WorkerContext) -> Result<Self, UserError> {
        Ok(Accumulator(start))
    }
}

/// Adds the rank-scaled value and returns the new total.
#[derive(Serialize, Deserialize)]
struct AddScaled(f64);

impl Task<Accumulator> for AddScaled {
    const NAME: &'static str = "add-scaled";
    type Output = f64;
    fn run(self, acc: &mut Accumulator, ctx: &WorkerContext) -> Result<f64, UserError> {
        acc.0 += self.0 * f64::from(ctx.rank() + 1);
        Ok(acc.0)
    }
}

/// A plain function: where am I?
#[derive(Serialize, Deserialize)]
struct Where;

impl Function for Where {
    const NAME: &'static str = "where";
    type Output = String;
    fn call(self, ctx: &WorkerContext) -> Result<String, UserError> {
        Ok(format!(
            "rank {}/{} local {}/{} on {} (pid {})",
            ctx.rank(),
            ctx.size(),
            ctx.local_rank(),
            ctx.local_size(),
            ctx.env("HOROVOD_HOSTNAME").unwrap_or("?"),
            std::process::id()
        ))
    }
}

#[tokio::main]
async fn main() -> Result<(), kolo_engine::ExecError> {
    // in a worker process this serves the driver and never returns
    kolo_agent::serve_if_worker(
        Registry::new().executable::<Accumulator>().task::<Accumulator, AddScaled>().function::<Where>(),
    );

    let engine = kolo_engine::LocalEngine::with_hosts(kolo_topology::parse_host_list("node-a:2,node-b:2")?);
    let mut executor = Executor::with_engine(Settings::default(), WorkerRequest::colocated(2, 2), Box::new(engine))?;
    executor.start::<Accumulator>(&100.0, &[]).await?;
    for line in executor.run(&Where).await? {
        println!("{line}");
    }
    println!("after one call:  {:?}", executor.execute(&AddScaled(1.0)).await?);
    let handles = executor.run_remote(&AddScaled(0.5)).await?;
    for handle in handles {
        let rank = handle.rank();
        println!("rank {rank} answered {}", handle.join().await?);
    }
    println!("rank 0 alone:    {}", executor.execute_single(&AddScaled(0.0)).await?);
    executor.shutdown().await;
    Ok(())
}
