//! Every collective x dtype x size class x rank count 1..5, on shared
//! memory and on TCP, checked against a reference computed here; and the
//! failure paths. Workers are real processes started by kolo's Executor
//! (this test binary in worker mode), bootstrapped from the env kolo sets.

use std::time::Duration;

use half::{bf16, f16};
use kolo_comm::{split_counts, CommError, Communicator, DType, Element, ReduceOp};
use kolo_engine::{LocalEngine, WorkerRequest};
use kolo_exec::{Executor, Settings};
use kolo_proto::{Function, Registry, UserError, WorkerContext};
use kolo_topology::HostSpec;
use libtest_mimic::{Arguments, Failed, Trial};
use serde::{Deserialize, Serialize};

/// Small integers, so every sum and product is exact in every dtype and
/// the reference may add in any order.
trait Val: Element + PartialEq + std::fmt::Debug {
    fn from_i(v: i64) -> Self;
}
macro_rules! val {
    ($($t:ty: $e:expr),*) => { $(impl Val for $t { fn from_i(v: i64) -> Self { let f: fn(i64) -> $t = $e; f(v) } })* };
}
val!(f32: |v| v as f32, f64: |v| v as f64, f16: |v| f16::from_f32(v as f32), bf16: |v| bf16::from_f32(v as f32),
     i32: |v| v as i32, i64: |v| v, u8: |v| v as u8);

fn input(op: ReduceOp, rank: usize, i: usize) -> i64 {
    match op {
        ReduceOp::Prod => 1 + ((rank + i) % 2) as i64,
        _ => ((rank * 7 + i * 3) % 11) as i64 - if op == ReduceOp::Sum || op == ReduceOp::Avg { 0 } else { 5 },
    }
}

fn expected<T: Val>(op: ReduceOp, size: usize, i: usize) -> T {
    let wrap = |v: i64| if T::DTYPE == DType::U8 { v.rem_euclid(256) } else { v };
    let vals: Vec<i64> = (0..size).map(|r| wrap(input(op, r, i))).collect();
    match op {
        ReduceOp::Sum => T::from_i(wrap(vals.iter().sum())),
        ReduceOp::Prod => T::from_i(wrap(vals.iter().product())),
        ReduceOp::Min => T::from_i(*vals.iter().min().unwrap()),
        ReduceOp::Max => T::from_i(*vals.iter().max().unwrap()),
        ReduceOp::Avg => {
            let sum: i64 = vals.iter().sum();
            match T::DTYPE {
                DType::F32 | DType::F64 | DType::F16 | DType::BF16 => {
                    let f = sum as f64 / size as f64;
                    // the kernel divides in the element's own precision
                    let v: T = T::from_i(0);
                    let _ = v;
                    float_of::<T>(f)
                }
                _ => T::from_i(wrap(sum) / size as i64),
            }
        }
    }
}

fn float_of<T: Val>(f: f64) -> T {
    let bytes: Vec<u8> = match T::DTYPE {
        DType::F32 => (f as f32).to_ne_bytes().to_vec(),
        DType::F64 => f.to_ne_bytes().to_vec(),
        DType::F16 => f16::from_f32(f as f32).to_bits().to_ne_bytes().to_vec(),
        DType::BF16 => bf16::from_f32(f as f32).to_bits().to_ne_bytes().to_vec(),
        _ => unreachable!(),
    };
    *bytemuck::from_bytes(&bytes)
}

fn check_eq<T: Val>(what: &str, got: &[T], want: impl Fn(usize) -> T) -> Result<(), String> {
    for (i, g) in got.iter().enumerate() {
        let w = want(i);
        if *g != w {
            return Err(format!("{what}: element {i} of {} is {g:?}, expected {w:?}", got.len()));
        }
    }
    Ok(())
}

const SIZES: [usize; 5] = [0, 1, 7, 1000, 70_001];

fn run_all<T: Val>(comm: &mut Communicator, large: bool) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let name = T::DTYPE.name();
    let mut sizes = SIZES.to_vec();
    if large {
        sizes.push(600_003);
        if T::DTYPE == DType::F32 {
            // past the size where results are written with non-temporal stores
            sizes.push(2_200_001);
        }
    }
    for &len in &sizes {
        for op in ReduceOp::ALL {
            let send: Vec<T> = (0..len).map(|i| T::from_i(input(op, r, i))).collect();
            let mut recv = vec![T::from_i(0); len];
            comm.allreduce(&send, &mut recv, op).map_err(|e| e.to_string())?;
            check_eq(&format!("allreduce {name} {} len {len}", op.name()), &recv, |i| expected::<T>(op, n, i))?;
            let mut inplace = send.clone();
            comm.allreduce_in_place(&mut inplace, op).map_err(|e| e.to_string())?;
            check_eq(&format!("allreduce in place {name} {} len {len}", op.name()), &inplace, |i| {
                expected::<T>(op, n, i)
            })?;
        }
        if len > 70_001 {
            continue;
        }
        let op = ReduceOp::Sum;
        // reduce-scatter: this rank's near-equal part
        let send: Vec<T> = (0..len).map(|i| T::from_i(input(op, r, i))).collect();
        let counts = split_counts(len, n);
        let start: usize = counts[..r].iter().sum();
        let mut part = vec![T::from_i(0); counts[r]];
        comm.reduce_scatter(&send, &mut part, op).map_err(|e| e.to_string())?;
        check_eq(&format!("reduce_scatter {name} len {len}"), &part, |i| expected::<T>(op, n, start + i))?;
        // reduce to each root in turn
        for root in 0..n {
            let mut out = vec![T::from_i(0); if r == root { len } else { 0 }];
            comm.reduce(&send, &mut out, ReduceOp::Max, root).map_err(|e| e.to_string())?;
            let maxes: Vec<T> = (0..len).map(|i| T::from_i(input(ReduceOp::Max, r, i))).collect();
            let _ = maxes;
            if r == root {
                check_eq(&format!("reduce {name} root {root} len {len}"), &out, |i| {
                    T::from_i((0..n).map(|q| input(op, q, i)).max().unwrap())
                })?;
            }
        }
        // broadcast from the last rank
        let root = n - 1;
        let mut buf: Vec<T> = (0..len).map(|i| T::from_i(if r == root { (i % 100) as i64 } else { -1 })).collect();
        comm.broadcast(&mut buf, root).map_err(|e| e.to_string())?;
        check_eq(&format!("broadcast {name} len {len}"), &buf, |i| T::from_i((i % 100) as i64))?;
        // allgather, equal and variable sizes
        let mine: Vec<T> = (0..len).map(|i| T::from_i(((r + i) % 50) as i64)).collect();
        let mut all = vec![T::from_i(0); len * n];
        comm.allgather(&mine, &mut all).map_err(|e| e.to_string())?;
        check_eq(&format!("allgather {name} len {len}"), &all, |i| {
            T::from_i(((i / len.max(1) + i % len.max(1)) % 50) as i64)
        })?;
        let counts: Vec<usize> = (0..n).map(|q| (len + q * 3) % 17).collect();
        let mine: Vec<T> = (0..counts[r]).map(|i| T::from_i((r * 10 + i) as i64 % 100)).collect();
        let mut all = vec![T::from_i(0); counts.iter().sum()];
        comm.allgatherv(&mine, &mut all, &counts).map_err(|e| e.to_string())?;
        let mut want = Vec::new();
        for (q, &c) in counts.iter().enumerate() {
            want.extend((0..c).map(|i| T::from_i((q * 10 + i) as i64 % 100)));
        }
        check_eq(&format!("allgatherv {name} len {len}"), &all, |i| want[i])?;
    }
    Ok(())
}

fn point_to_point_and_split(comm: &mut Communicator) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    comm.barrier().map_err(|e| e.to_string())?;
    if n > 1 {
        // a ring of sends: even ranks send first, odd ranks receive first
        let out: Vec<i64> = (0..1003).map(|i| (r * 1000 + i) as i64).collect();
        let mut got = vec![0i64; 1003];
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        if r % 2 == 0 {
            comm.send(&out, next).map_err(|e| e.to_string())?;
            comm.recv(&mut got, prev).map_err(|e| e.to_string())?;
        } else {
            comm.recv(&mut got, prev).map_err(|e| e.to_string())?;
            comm.send(&out, next).map_err(|e| e.to_string())?;
        }
        check_eq("send/recv", &got, |i| (prev * 1000 + i) as i64)?;
        if !matches!(comm.send(&out, r), Err(CommError::BadArgs(_))) {
            return Err("sending to oneself must be refused".into());
        }
    }
    // split into even and odd ranks, then reduce within each half
    let mut half = comm.split((r % 2) as u32, r as u32).map_err(|e| e.to_string())?;
    let members: Vec<usize> = (0..n).filter(|q| q % 2 == r % 2).collect();
    if half.size() != members.len() || members[half.rank()] != r {
        return Err(format!("split: rank {r} got rank {} of {}", half.rank(), half.size()));
    }
    let mut v = vec![r as i32; 5];
    half.allreduce_in_place(&mut v, ReduceOp::Sum).map_err(|e| e.to_string())?;
    let want: i32 = members.iter().map(|&q| q as i32).sum();
    check_eq("split allreduce", &v, |_| want)?;
    let local = comm.split_local().map_err(|e| e.to_string())?;
    let per_host = n / comm.num_nodes();
    if local.size() != per_host {
        return Err(format!("the local communicator has {} ranks, expected {per_host}", local.size()));
    }
    Ok(())
}

/// Runs every check in a worker.
#[derive(Serialize, Deserialize)]
struct CheckAll {
    large: bool,
    /// What `direct_reads()` must say after the large allreduces (`None`:
    /// not checked, the machine's ptrace policy may refuse).
    direct: Option<Option<bool>>,
}

impl Function for CheckAll {
    const NAME: &'static str = "check-all";
    type Output = ();
    fn call(self, _: &WorkerContext) -> Result<(), UserError> {
        let mut comm = Communicator::from_env()?;
        run_all::<f32>(&mut comm, self.large)?;
        if let Some(want) = self.direct {
            if comm.direct_reads() != want {
                return Err(format!(
                    "direct_reads() is {:?} after large allreduces, expected {want:?}",
                    comm.direct_reads()
                )
                .into());
            }
        }
        run_all::<f64>(&mut comm, false)?;
        run_all::<f16>(&mut comm, false)?;
        run_all::<bf16>(&mut comm, self.large)?;
        run_all::<i32>(&mut comm, false)?;
        run_all::<i64>(&mut comm, false)?;
        run_all::<u8>(&mut comm, false)?;
        point_to_point_and_split(&mut comm)?;
        Ok(())
    }
}

/// One rank fails the others, which must say so: the error each of them
/// got.
#[derive(Serialize, Deserialize)]
enum Fault {
    /// `victim` exits while the others are in an allreduce; they must fail.
    DieMidway { victim: u32 },
    /// `missing` never joins; the others must name it.
    Absent { missing: u32 },
}

impl Function for Fault {
    const NAME: &'static str = "fault";
    type Output = String;
    fn call(self, ctx: &WorkerContext) -> Result<String, UserError> {
        match self {
            Fault::DieMidway { victim } => {
                let mut comm = Communicator::from_env()?;
                if ctx.rank() == victim {
                    std::process::exit(3);
                }
                let send = vec![1.0f32; 1 << 20];
                let mut recv = vec![0.0f32; 1 << 20];
                match comm.allreduce(&send, &mut recv, ReduceOp::Sum) {
                    Ok(()) => Err("the allreduce finished without a rank".into()),
                    Err(e) => Ok(e.to_string()),
                }
            }
            Fault::Absent { missing } => {
                if ctx.rank() == missing {
                    return Ok(String::new());
                }
                match Communicator::from_env() {
                    Ok(_) => Err("joined without every rank".into()),
                    Err(e) => Ok(e.to_string()),
                }
            }
        }
    }
}

fn registry() -> Registry {
    Registry::new().function::<CheckAll>().function::<Fault>()
}

fn executor(n: u32, env: &[(&str, &str)]) -> impl std::future::Future<Output = Result<Executor, Failed>> {
    on_hosts(n, vec![HostSpec::new("node", 16)], env)
}

fn on_hosts(
    n: u32,
    hosts: Vec<HostSpec>,
    env: &[(&str, &str)],
) -> impl std::future::Future<Output = Result<Executor, Failed>> {
    let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    async move {
        let mut settings = Settings::default();
        settings.heartbeat_timeout = Duration::from_secs(60);
        let engine = Box::new(LocalEngine::with_hosts(hosts));
        let mut ex = Executor::with_engine(settings, WorkerRequest::pack(n), engine)?;
        ex.start_workers(&env).await?;
        Ok(ex)
    }
}

fn block(f: impl std::future::Future<Output = Result<(), Failed>>) -> Result<(), Failed> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
}

fn correctness(n: u32, transport: &'static str) -> Result<(), Failed> {
    block(async move {
        // odd rank counts also take Rabenseifner for mid sizes (by default
        // only from 8 ranks), so every algorithm meets every size class
        let mid = if n % 2 == 1 { "1048576" } else { "0" };
        // up to 3 ranks the large sizes read peers' memory directly and the
        // 70,001-element ones take the rings; from 4, every dtype's
        // 70,001 elements read directly
        let direct = if n >= 4 { "65536" } else { "1048576" };
        let env =
            [("KOLO_COMM_TRANSPORT", transport), ("KOLO_COMM_MID_BYTES", mid), ("KOLO_COMM_DIRECT_BYTES", direct)];
        let mut ex = executor(n, &env).await?;
        // ranks of one host read each other's memory for large allreduces,
        // unless forced onto TCP (or alone)
        let direct = match (transport, n) {
            ("tcp", _) | (_, 1) => Some(None),
            _ if kernel_lets_siblings_read() => Some(Some(true)),
            _ => None,
        };
        let result = ex.run(&CheckAll { large: n <= 3, direct }).await;
        ex.shutdown().await;
        result?;
        Ok(())
    })
}

/// Two simulated hosts of two ranks: shared memory within, TCP between,
/// and the hierarchical allreduce for large buffers.
fn two_hosts() -> Result<(), Failed> {
    block(async move {
        let hosts = vec![HostSpec::new("host-a", 2), HostSpec::new("host-b", 2)];
        let mut ex = on_hosts(4, hosts, &[]).await?;
        let result = ex.run(&CheckAll { large: true, direct: Some(None) }).await;
        ex.shutdown().await;
        result?;
        Ok(())
    })
}

/// Root, or no Yama policy stricter than the classic same-user rule.
fn kernel_lets_siblings_read() -> bool {
    let yama = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").unwrap_or_else(|_| "0".into());
    nix::unistd::geteuid().is_root() || yama.trim() == "0"
}

fn a_dead_rank_fails_the_others(transport: &'static str) -> Result<(), Failed> {
    block(async move {
        let mut ex = executor(3, &[("KOLO_COMM_TRANSPORT", transport), ("KOLO_COMM_TIMEOUT_SECONDS", "20")]).await?;
        let handles = ex.run_remote_function(&Fault::DieMidway { victim: 1 }).await?;
        let mut messages = Vec::new();
        for h in handles {
            let rank = h.rank();
            match h.join().await {
                Ok(message) => messages.push((rank, message)),
                Err(e) if rank == 1 => assert!(e.to_string().contains("rank 1"), "{e}"),
                Err(e) => return Err(format!("rank {rank}: {e}").into()),
            }
        }
        ex.shutdown().await;
        // the dead rank's neighbours see it go; the others see them give up
        for (rank, message) in messages {
            let named = message.contains("rank 1") || message.contains("rank 2") || message.contains("rank 0");
            if !(named && (message.contains("died") || message.contains("failed"))) {
                return Err(format!("rank {rank} reported: {message}").into());
            }
        }
        Ok(())
    })
}

fn a_missing_rank_is_named() -> Result<(), Failed> {
    block(async move {
        let mut ex = executor(3, &[("KOLO_COMM_TIMEOUT_SECONDS", "2")]).await?;
        let result = ex.run(&Fault::Absent { missing: 2 }).await;
        ex.shutdown().await;
        let messages = result?;
        if !messages[0].contains("ranks [2] did not show up") {
            return Err(format!("rank 0: {}", messages[0]).into());
        }
        if !messages[1].contains("no address table from rank 0") {
            return Err(format!("rank 1: {}", messages[1]).into());
        }
        Ok(())
    })
}

fn main() {
    kolo_agent::serve_if_worker(registry());
    let args = Arguments::from_args();
    let mut tests = Vec::new();
    for transport in ["auto", "tcp"] {
        for n in 1..=5u32 {
            tests.push(Trial::test(format!("every_op_dtype_and_size_{n}_ranks_{transport}"), move || {
                correctness(n, transport)
            }));
        }
        tests.push(Trial::test(format!("a_dead_rank_fails_the_others_{transport}"), move || {
            a_dead_rank_fails_the_others(transport)
        }));
    }
    tests.push(Trial::test("a_missing_rank_is_named", a_missing_rank_is_named));
    tests.push(Trial::test("every_op_dtype_and_size_on_two_hosts_hierarchical", two_hosts));
    libtest_mimic::run(&args, tests).exit();
}
