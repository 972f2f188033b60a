//! Collective bandwidth, nccl-tests style: `kolo bench allreduce -np N`
//! starts N workers through kolo's own Executor, each joins a kolo-comm
//! communicator from the environment kolo gives it, and times the
//! collective over growing sizes. Every result is checked.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use half::{bf16, f16};
use kolo_comm::{split_counts, Communicator, DType, Element, ReduceOp};
use kolo_engine::{LocalEngine, WorkerRequest};
use kolo_exec::{Executor, Settings};
use kolo_proto::{Executable, Registry, Task, UserError, WorkerContext};
use kolo_topology::HostSpec;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::Table;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub(crate) enum Collective {
    Allreduce,
    Allgather,
    ReduceScatter,
    Broadcast,
    Reduce,
}

impl Collective {
    /// nccl-tests' bus bandwidth factor.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::Allreduce => 2.0 * (n - 1.0) / n,
            Collective::Allgather | Collective::ReduceScatter => (n - 1.0) / n,
            Collective::Broadcast | Collective::Reduce => 1.0,
        }
    }
}

#[derive(Args, Debug)]
pub struct CollectiveArgs {
    /// Ranks.
    #[arg(short = 'n', long = "np", default_value_t = 2)]
    np: u32,
    #[arg(long, default_value_t = 4096)]
    min_bytes: usize,
    #[arg(long, default_value_t = 256 << 20)]
    max_bytes: usize,
    /// Reduction (allreduce, reduce-scatter, reduce).
    #[arg(long, default_value = "sum")]
    op: String,
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// TCP between all ranks, even on one host (kolo-comm's KOLO_COMM_TRANSPORT=tcp).
    #[arg(long)]
    tcp: bool,
    /// Leave ranks unpinned (by default each is pinned to a CPU by local
    /// rank, as mpirun's default --bind-to core does).
    #[arg(long)]
    no_bind: bool,
    /// Start the ranks over ssh on the hosts of -H (with this ssh config file),
    /// instead of simulated hosts on this machine.
    #[arg(long, value_name = "FILE")]
    ssh_config: Option<std::path::PathBuf>,
    /// Hosts (host:slots,...) to spread the ranks over: simulated on this
    /// machine, or real ones with --ssh-config.
    #[arg(short = 'H', long = "hosts")]
    hosts: Option<String>,
    #[arg(long)]
    json: bool,
}

/// A worker's communicator, kept between sweeps.
pub(crate) struct CommBench {
    comm: Communicator,
}

impl Executable for CommBench {
    const NAME: &'static str = "bench-comm";
    type Args = bool;
    fn create(bind: bool, ctx: &WorkerContext) -> Result<Self, UserError> {
        if bind {
            kolo_comm::bind_to_core(ctx.local_rank() as usize)?;
        }
        Ok(CommBench { comm: Communicator::from_env()? })
    }
}

/// Times one collective over sizes; returns (bytes, iters, mean seconds) rows.
#[derive(Serialize, Deserialize)]
pub(crate) struct Sweep {
    collective: Collective,
    sizes: Vec<usize>,
    op: String,
    dtype: String,
}

impl Task<CommBench> for Sweep {
    const NAME: &'static str = "bench-sweep";
    type Output = Vec<(usize, u64, f64)>;
    fn run(self, bench: &mut CommBench, _: &WorkerContext) -> Result<Self::Output, UserError> {
        let op: ReduceOp = self.op.parse()?;
        let dtype: DType = self.dtype.parse()?;
        let mut rows = Vec::new();
        for &bytes in &self.sizes {
            let row =
                kolo_comm::with_element_type!(dtype, T => time::<T>(&mut bench.comm, self.collective, bytes, op))?;
            rows.push((bytes, row.0, row.1));
        }
        Ok(rows)
    }
}

trait One: Element + PartialEq + std::fmt::Debug {
    fn one() -> Self;
    fn of(n: usize) -> Self;
}
macro_rules! one {
    ($($t:ty: $one:expr, $of:expr),*) => {$(impl One for $t {
        fn one() -> Self { $one }
        fn of(n: usize) -> Self { let f: fn(usize) -> $t = $of; f(n) }
    })*};
}
one!(f32: 1.0, |n| n as f32, f64: 1.0, |n| n as f64, f16: f16::ONE, |n| f16::from_f32(n as f32),
     bf16: bf16::ONE, |n| bf16::from_f32(n as f32), i32: 1, |n| n as i32, i64: 1, |n| n as i64, u8: 1, |n| n as u8,
     i8: 1, |n| n as i8);

/// Warm-up, barrier, timed loop (like the Open MPI reference), then a check
/// of the last result.
fn time<T: One>(
    comm: &mut Communicator,
    what: Collective,
    bytes: usize,
    op: ReduceOp,
) -> Result<(u64, f64), UserError> {
    let (n, r) = (comm.size(), comm.rank());
    let count = bytes / std::mem::size_of::<T>();
    let iters = ((512usize << 20) / bytes.max(1)).clamp(5, 1000) as u64;
    let send = vec![T::one(); count];
    let counts = split_counts(count, n);
    let out_len = match what {
        Collective::Allreduce | Collective::Broadcast | Collective::Reduce => count,
        Collective::Allgather => count * n,
        Collective::ReduceScatter => counts[r],
    };
    let mut recv = vec![T::of(0); out_len];
    let once = |comm: &mut Communicator, recv: &mut Vec<T>| -> Result<(), kolo_comm::CommError> {
        match what {
            Collective::Allreduce => comm.allreduce(&send, recv, op),
            Collective::Allgather => comm.allgather(&send, recv),
            Collective::ReduceScatter => comm.reduce_scatter(&send, recv, op),
            Collective::Broadcast => comm.broadcast(recv, 0),
            Collective::Reduce => comm.reduce(&send, recv, op, 0),
        }
    };
    if what == Collective::Broadcast && r == 0 {
        recv.fill(T::one());
    }
    for _ in 0..iters / 10 + 1 {
        once(comm, &mut recv)?;
    }
    comm.barrier()?;
    let start = Instant::now();
    for _ in 0..iters {
        once(comm, &mut recv)?;
    }
    let seconds = start.elapsed().as_secs_f64() / iters as f64;
    let want = match (what, op) {
        (Collective::Allgather | Collective::Broadcast, _) => T::one(),
        (Collective::Reduce, _) if r != 0 => return Ok((iters, seconds)),
        (_, ReduceOp::Sum) => T::of(n),
        _ => T::one(),
    };
    if let Some(i) = recv.iter().position(|v| *v != want) {
        return Err(format!(
            "rank {r}: wrong result at element {i} of {bytes} bytes: {:?}, expected {want:?}",
            recv[i]
        )
        .into());
    }
    Ok((iters, seconds))
}

pub(crate) fn register(registry: Registry) -> Registry {
    registry.executable::<CommBench>().task::<CommBench, Sweep>()
}

pub(crate) async fn run(collective: Collective, args: CollectiveArgs) -> Result<i32> {
    let op: ReduceOp = args.op.parse().map_err(anyhow::Error::msg)?;
    let dtype: DType = args.dtype.parse().map_err(anyhow::Error::msg)?;
    if args.np == 0 || args.min_bytes == 0 || args.min_bytes > args.max_bytes {
        bail!("need --np >= 1 and 0 < --min-bytes <= --max-bytes");
    }
    let esize = dtype.size();
    let mut sizes = Vec::new();
    let mut b = args.min_bytes;
    while b <= args.max_bytes {
        sizes.push(b / esize * esize);
        b *= 4;
    }
    let hosts = match &args.hosts {
        Some(list) => kolo_topology::parse_host_list(list)?,
        None => vec![HostSpec::new("localhost", args.np)],
    };
    let mut settings = Settings::default();
    settings.heartbeat_timeout = std::time::Duration::from_secs(120);
    let engine: Box<dyn kolo_engine::Engine> = match &args.ssh_config {
        Some(config) => {
            let ssh = kolo_engine::SshOptions { config_file: Some(config.clone()), ..Default::default() };
            Box::new(kolo_engine::SshEngine::new(hosts, ssh))
        }
        None => Box::new(LocalEngine::with_hosts(hosts)),
    };
    let mut executor = Executor::with_engine(settings, WorkerRequest::pack(args.np), engine)?;
    let env = if args.tcp { vec![("KOLO_COMM_TRANSPORT".to_string(), "tcp".to_string())] } else { Vec::new() };
    executor.start::<CommBench>(&!args.no_bind, &env).await?;
    let table = Table::new(args.json, &["bytes", "iters", "time_us", "algbw_GB/s", "busbw_GB/s"]);
    // one size at a time so rows appear as they are measured
    for &size in &sizes {
        let one = Sweep { collective, sizes: vec![size], op: op.name().into(), dtype: dtype.name().into() };
        let per_rank = match executor.execute(&one).await {
            Ok(r) => r,
            Err(e) => {
                executor.shutdown().await;
                return Err(e.into());
            }
        };
        // the slowest rank's mean, as the reference does
        let (bytes, iters, _) = per_rank[0][0];
        let seconds = per_rank.iter().map(|rows| rows[0].2).fold(0.0, f64::max);
        let algbw = bytes as f64 / seconds / 1e9;
        let busbw = algbw * collective.bus_factor(args.np as usize);
        table.row(&[json!(bytes), json!(iters), json!(seconds * 1e6), json!(algbw), json!(busbw)]);
    }
    executor.shutdown().await;
    Ok(0)
}
