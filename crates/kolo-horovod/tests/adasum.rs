//! Adasum through the core: ranks as threads of this process with their
//! own cores, on a real rendezvous store. Submitted as an allreduce with
//! op Adasum, it is negotiated as upstream's ADASUM, fused with its like,
//! run by kolo-comm's Adasum with each tensor's own coefficients, and
//! served from the response cache on later steps.

use std::sync::Arc;
use std::time::Duration;

use kolo_comm::{Communicator, Config, Secret};
use kolo_horovod::{Buffer, Core, DataType, ReduceOp, RequestType, Settings, Submit};
use kolo_rendezvous::{RendezvousServer, ServerConfig};

/// Runs `f` as each of `n` ranks, each with its own core; results in rank order.
fn run<R: Send + 'static>(n: usize, f: impl Fn(usize, &Core) -> R + Send + Sync + 'static) -> Vec<R> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let server =
        runtime.block_on(RendezvousServer::start(ServerConfig::new("127.0.0.1:0".parse().unwrap()), &[])).unwrap();
    let f = Arc::new(f);
    let threads: Vec<_> = (0..n)
        .map(|r| {
            let config = Config::new(r, n, "this-host", server.addr().to_string(), Secret::new("s").unwrap(), "adasum")
                .unwrap()
                .with_timeout(Duration::from_secs(20));
            let f = f.clone();
            std::thread::spawn(move || {
                let core = Core::start(Communicator::connect(config).unwrap(), Settings::default(), &[]).unwrap();
                let result = f(r, &core);
                core.shutdown();
                result
            })
        })
        .collect();
    let results = threads.into_iter().map(|t| t.join().unwrap()).collect();
    runtime.block_on(server.stop());
    results
}

fn adasum_submit<T>(name: &str, dtype: DataType, v: &mut [T]) -> Submit {
    let bytes = std::mem::size_of_val(v);
    let mut s = Submit::new(
        RequestType::Allreduce,
        name,
        dtype,
        vec![v.len() as i64],
        Buffer::new(v.as_mut_ptr() as usize, bytes),
    );
    s.reduce_op = ReduceOp::Adasum;
    s
}

fn coefficient(dot: f64, norm_sq: f64) -> f64 {
    if norm_sq >= f64::MIN_POSITIVE.sqrt() {
        1.0 - dot / (2.0 * norm_sq)
    } else {
        1.0
    }
}

/// Upstream's formula for two ranks' vectors, in f64.
fn formula(a: &[f64], b: &[f64]) -> Vec<f64> {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let (na, nb): (f64, f64) = (a.iter().map(|x| x * x).sum(), b.iter().map(|x| x * x).sum());
    a.iter().zip(b).map(|(x, y)| coefficient(dot, na) * x + coefficient(dot, nb) * y).collect()
}

/// Tensor `t` of rank `r` at `step`: three small ones (fused together),
/// then a large one (reduced alone, in its own memory).
fn tensor(r: usize, t: usize, step: usize) -> Vec<f64> {
    let len = [5, 64, 3, 300_000][t];
    (0..len).map(|i| ((i * 7 + t * 13 + r * 29 + step * 3) % 17) as f64 - 8.0 + r as f64 * (t as f64 - 1.5)).collect()
}

#[test]
fn adasum_fuses_small_tensors_keeps_each_tensors_coefficients_and_is_served_from_the_cache() {
    let results = run(2, |rank, core| {
        for step in 0..3 {
            let mut small: Vec<Vec<f32>> =
                (0..3).map(|t| tensor(rank, t, step).iter().map(|&x| x as f32).collect()).collect();
            let mut large = tensor(rank, 3, step);
            let mut submits: Vec<Submit> = small
                .iter_mut()
                .enumerate()
                .map(|(t, v)| adasum_submit(&format!("grad.{t}"), DataType::Float32, v))
                .collect();
            submits.push(adasum_submit("grad.large", DataType::Float64, &mut large));
            let handle = core.submit(0, submits).unwrap();
            assert!(handle.wait_for(Duration::from_secs(30)));
            assert!(handle.outcomes().unwrap().iter().all(|o| o.is_ok()));
            for (t, got) in small.iter().enumerate() {
                let want = formula(&tensor(0, t, step), &tensor(1, t, step));
                for (g, w) in got.iter().zip(&want) {
                    assert!((f64::from(*g) - w).abs() <= 1e-5 * w.abs().max(1.0), "step {step} tensor {t}: {g} != {w}");
                }
            }
            let want = formula(&tensor(0, 3, step), &tensor(1, 3, step));
            assert!(large.iter().zip(&want).all(|(g, w)| (g - w).abs() <= 1e-12 * w.abs().max(1.0)), "step {step}");
        }
        core.stats()
    });
    for stats in results {
        // each step: the three small tensors as one response, the large one alone
        assert_eq!(stats.tensors, 12, "{stats:?}");
        assert!(stats.responses <= 6, "{stats:?}");
        // only the first step's four went to the coordinator
        assert_eq!(stats.requests_sent, 4, "{stats:?}");
    }
}

#[test]
fn adasum_over_integers_or_a_rank_count_not_a_power_of_two_is_refused_when_submitted() {
    let results = run(3, |_, core| {
        let mut floats = vec![1.0f32; 4];
        let uneven = core.submit(0, vec![adasum_submit("g", DataType::Float32, &mut floats)]).unwrap_err().message;
        let mut ints = vec![1i32; 4];
        let ints = core.submit(0, vec![adasum_submit("i", DataType::Int32, &mut ints)]).unwrap_err().message;
        (uneven, ints)
    });
    for (uneven, ints) in results {
        assert!(uneven.contains("non-power of 2") && uneven.contains("has 3 ranks"), "{uneven}");
        assert!(ints.contains("int32") && ints.contains("op=Sum"), "{ints}");
    }
}
