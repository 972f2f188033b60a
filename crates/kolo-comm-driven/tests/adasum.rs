//! Adasum on real worker processes that kolo's Executor starts: fused
//! buffers of several tensors in f16, f32 and f64 at 1, 2 and 4 ranks
//! (shared memory and TCP) against the formula applied pairwise up the
//! same tree here, in f64; a rank count that is not a power of two, and
//! an element type Adasum cannot combine, refused on every rank.

use std::time::Duration;

use half::f16;
use kolo_comm::{CommError, Communicator, Element};
use kolo_engine::{LocalEngine, WorkerRequest};
use kolo_exec::{Executor, Settings};
use kolo_proto::{Function, Registry, UserError, WorkerContext};
use libtest_mimic::{Arguments, Failed, Trial};
use serde::{Deserialize, Serialize};

trait Real: Element + Copy {
    fn of(v: f64) -> Self;
    fn get(self) -> f64;
    /// How far from the reference a result may be, relative to the
    /// tensor's largest magnitude: partial dot products add up in another
    /// order here, which may move an intermediate rounding by an ulp.
    const TOLERANCE: f64;
}
impl Real for f16 {
    fn of(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn get(self) -> f64 {
        self.to_f64()
    }
    const TOLERANCE: f64 = 8e-3;
}
impl Real for f32 {
    fn of(v: f64) -> Self {
        v as f32
    }
    fn get(self) -> f64 {
        f64::from(self)
    }
    const TOLERANCE: f64 = 1e-5;
}
impl Real for f64 {
    fn of(v: f64) -> Self {
        v
    }
    fn get(self) -> f64 {
        self
    }
    const TOLERANCE: f64 = 1e-12;
}

/// The tensors of one fused buffer: empty, tiny, odd, large ones, and
/// which of them are special (see `value`).
const COUNTS: [usize; 7] = [0, 1, 7, 1000, 3, 70_001, 12];

/// Rank `r`'s element `i` of tensor `t`: a shared part plus a rank's own,
/// so the gradients partly agree; tensor 4 is zero on rank 1 (a zero norm)
/// and tensor 6 is the same on every rank (Adasum leaves it as it is).
fn value(r: usize, t: usize, i: usize) -> f64 {
    if t == 4 && r == 1 {
        return 0.0;
    }
    let shared = ((t * 131 + i * 37) % 97) as f64 / 48.0 - 1.0;
    if t == 6 {
        return shared;
    }
    let own = ((r * 7919 + t * 104_729 + i * 31) % 2003) as f64 / 1001.0 - 1.0;
    shared + own * (1.0 + r as f64 * 0.5)
}

fn coefficient(dot: f64, norm_sq: f64) -> f64 {
    if norm_sq >= f64::MIN_POSITIVE.sqrt() {
        1.0 - dot / (2.0 * norm_sq)
    } else {
        1.0
    }
}

/// The formula on two whole vectors, rounded to `T` as each level stores.
fn pair<T: Real>(a: &[f64], b: &[f64]) -> Vec<f64> {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let (na, nb): (f64, f64) = (a.iter().map(|x| x * x).sum(), b.iter().map(|x| x * x).sum());
    let (ca, cb) = (coefficient(dot, na), coefficient(dot, nb));
    a.iter().zip(b).map(|(x, y)| T::of(ca * x + cb * y).get()).collect()
}

/// Adasum of tensor `t` over `n` ranks: neighbours at distance 1, then 2...
fn reference<T: Real>(n: usize, t: usize) -> Vec<f64> {
    let mut vals: Vec<Vec<f64>> =
        (0..n).map(|r| (0..COUNTS[t]).map(|i| T::of(value(r, t, i)).get()).collect()).collect();
    let mut step = 1;
    while step < n {
        for r in (0..n).step_by(2 * step) {
            vals[r] = pair::<T>(&vals[r], &vals[r + step]);
        }
        step *= 2;
    }
    vals.swap_remove(0)
}

fn check<T: Real>(comm: &mut Communicator) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let mut buf: Vec<T> = Vec::new();
    for (t, &c) in COUNTS.iter().enumerate() {
        buf.extend((0..c).map(|i| T::of(value(r, t, i))));
    }
    comm.adasum(&mut buf, &COUNTS).map_err(|e| e.to_string())?;
    let mut at = 0;
    for (t, &c) in COUNTS.iter().enumerate() {
        let want = reference::<T>(n, t);
        let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs())).max(1e-30);
        for (i, (g, w)) in buf[at..at + c].iter().zip(&want).enumerate() {
            if (g.get() - w).abs() > T::TOLERANCE * scale {
                return Err(format!(
                    "{} at {n} ranks: tensor {t} element {i} is {}, the formula gives {w}",
                    T::DTYPE.name(),
                    g.get()
                ));
            }
        }
        if t == 6 && buf[at..at + c].iter().zip(&want).any(|(g, w)| g.get() != *w) {
            return Err(format!("{}: a tensor equal on every rank must come back unchanged", T::DTYPE.name()));
        }
        at += c;
    }
    Ok(())
}

/// Every rank's Adasum checked; or, at a rank count Adasum refuses, the
/// error every rank got.
#[derive(Serialize, Deserialize)]
struct CheckAdasum;

impl Function for CheckAdasum {
    const NAME: &'static str = "check-adasum";
    type Output = String;
    fn call(self, _: &WorkerContext) -> Result<String, UserError> {
        let mut comm = Communicator::from_env()?;
        let mut ints = vec![1i32; 4];
        let refused = match comm.adasum(&mut ints, &[4]) {
            Err(CommError::BadArgs(m)) if m.contains("not i32") => m,
            other => return Err(format!("adasum over i32 must be refused, got {other:?}").into()),
        };
        if !comm.size().is_power_of_two() {
            let mut v = vec![1.0f32; 8];
            return match comm.adasum(&mut v, &[8]) {
                Err(CommError::BadArgs(m)) => Ok(m),
                other => Err(format!("adasum at {} ranks must be refused, got {other:?}", comm.size()).into()),
            };
        }
        check::<f16>(&mut comm)?;
        check::<f32>(&mut comm)?;
        check::<f64>(&mut comm)?;
        // the communicator still works for what follows
        let mut v = vec![1.0f32; 5];
        comm.allreduce_in_place(&mut v, kolo_comm::ReduceOp::Sum)?;
        Ok(refused)
    }
}

fn run(n: u32, transport: &'static str) -> Result<Vec<String>, Failed> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async move {
        let mut settings = Settings::default();
        settings.heartbeat_timeout = Duration::from_secs(60);
        let engine = Box::new(LocalEngine::with_hosts(vec![kolo_topology::HostSpec::new("node", 16)]));
        let mut ex = Executor::with_engine(settings, WorkerRequest::pack(n), engine)?;
        ex.start_workers(&[("KOLO_COMM_TRANSPORT".to_string(), transport.to_string())]).await?;
        let result = ex.run(&CheckAdasum).await;
        ex.shutdown().await;
        Ok(result?)
    })
}

fn main() {
    kolo_agent::serve_if_worker(Registry::new().function::<CheckAdasum>());
    let args = Arguments::from_args();
    let mut tests = Vec::new();
    for (n, transport) in [(1, "auto"), (2, "auto"), (4, "auto"), (2, "tcp"), (4, "tcp")] {
        tests.push(Trial::test(format!("adasum_matches_the_formula_at_{n}_ranks_{transport}"), move || {
            run(n, transport).map(drop)
        }));
    }
    tests.push(Trial::test("adasum_at_3_ranks_is_refused_naming_the_count_and_the_fix", || {
        let messages = run(3, "auto")?;
        for m in messages {
            if !(m.contains("has 3") && m.contains("run it on 2 or 4 ranks")) {
                return Err(format!("unclear refusal: {m}").into());
            }
        }
        Ok(())
    }));
    libtest_mimic::run(&args, tests).exit();
}
