//! Data-parallel training with kolo-comm: logistic regression on a
//! synthetic dataset. Every worker builds the same dataset from a seed,
//! trains on its shard, and averages gradients with an allreduce each step;
//! rank 0 prints the loss per epoch and the throughput.
//!
//!     cargo build --release --bins --examples
//!     target/release/kolo run -np 4 -- target/release/examples/train
//!
//! Options: --epochs N (10), --samples N (65536), --features N (32),
//! --batch N (256 per worker), --lr X (0.5). Exits non-zero unless the
//! final loss is below half of the starting loss.

use std::time::Instant;

use kolo_comm::{Communicator, ReduceOp};
use rand::{Rng, SeedableRng};

struct Options {
    epochs: usize,
    samples: usize,
    features: usize,
    batch: usize,
    lr: f32,
}

fn options() -> Result<Options, String> {
    let mut o = Options { epochs: 10, samples: 65536, features: 32, batch: 256, lr: 0.5 };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let [flag, value] = pair else { return Err(format!("'{}' needs a value", pair[0])) };
        let bad = || format!("{flag} '{value}' is not a valid number");
        match flag.as_str() {
            "--epochs" => o.epochs = value.parse().map_err(|_| bad())?,
            "--samples" => o.samples = value.parse().map_err(|_| bad())?,
            "--features" => o.features = value.parse().map_err(|_| bad())?,
            "--batch" => o.batch = value.parse().map_err(|_| bad())?,
            "--lr" => o.lr = value.parse().map_err(|_| bad())?,
            other => return Err(format!("unknown option '{other}'")),
        }
    }
    if o.epochs == 0 || o.samples == 0 || o.features == 0 || o.batch == 0 {
        return Err("epochs, samples, features and batch must be at least 1".into());
    }
    Ok(o)
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// The same data on every rank: features ~ U(-1, 1), labels from a hidden
/// weight vector with some label noise.
fn dataset(o: &Options) -> (Vec<f32>, Vec<f32>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let truth: Vec<f32> = (0..o.features).map(|_| rng.random_range(-2.0..2.0)).collect();
    let mut x = Vec::with_capacity(o.samples * o.features);
    let mut y = Vec::with_capacity(o.samples);
    for _ in 0..o.samples {
        let row: Vec<f32> = (0..o.features).map(|_| rng.random_range(-1.0..1.0)).collect();
        let z: f32 = row.iter().zip(&truth).map(|(a, b)| a * b).sum();
        let noisy = rng.random_range(0.0..1.0) < 0.05;
        y.push(if (z > 0.0) != noisy { 1.0 } else { 0.0 });
        x.extend(row);
    }
    (x, y)
}

/// Mean log-loss over the whole dataset (each rank sums its shard).
fn loss(
    comm: &mut Communicator,
    x: &[f32],
    y: &[f32],
    w: &[f32],
    shard: &[usize],
) -> Result<f32, kolo_comm::CommError> {
    let d = w.len() - 1;
    let mut local = [0.0f64, 0.0];
    for &i in shard {
        let z: f32 = x[i * d..(i + 1) * d].iter().zip(w).map(|(a, b)| a * b).sum::<f32>() + w[d];
        let p = sigmoid(z).clamp(1e-7, 1.0 - 1e-7);
        local[0] -= f64::from(if y[i] > 0.5 { p.ln() } else { (1.0 - p).ln() });
        local[1] += 1.0;
    }
    let mut total = [0.0f64; 2];
    comm.allreduce(&local, &mut total, ReduceOp::Sum)?;
    Ok((total[0] / total[1]) as f32)
}

fn main() {
    let o = match options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("train: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = train(&o) {
        eprintln!("train: {e}");
        std::process::exit(1);
    }
}

fn train(o: &Options) -> Result<(), Box<dyn std::error::Error>> {
    let mut comm = Communicator::from_env()?;
    let (rank, size) = (comm.rank(), comm.size());
    let (x, y) = dataset(o);
    let d = o.features;
    let shard: Vec<usize> = (rank..o.samples).step_by(size).collect();
    let mut w = vec![0.0f32; d + 1];
    let mut grad = vec![0.0f32; d + 1];
    let mut avg = vec![0.0f32; d + 1];
    let first = loss(&mut comm, &x, &y, &w, &shard)?;
    if rank == 0 {
        println!(
            "ranks {size}, {} samples x {d} features, batch {} per rank; initial loss {first:.4}",
            o.samples, o.batch
        );
    }
    let steps = shard.len().div_ceil(o.batch);
    let mut last = first;
    for epoch in 1..=o.epochs {
        let start = Instant::now();
        for step in 0..steps {
            grad.fill(0.0);
            let batch = &shard[step * o.batch..((step + 1) * o.batch).min(shard.len())];
            for &i in batch {
                let row = &x[i * d..(i + 1) * d];
                let z: f32 = row.iter().zip(&w).map(|(a, b)| a * b).sum::<f32>() + w[d];
                let err = sigmoid(z) - y[i];
                for (g, a) in grad.iter_mut().zip(row) {
                    *g += err * a;
                }
                grad[d] += err;
            }
            let scale = 1.0 / batch.len().max(1) as f32;
            grad.iter_mut().for_each(|g| *g *= scale);
            // the data-parallel step: every rank ends with the mean gradient
            comm.allreduce(&grad, &mut avg, ReduceOp::Avg)?;
            for (wi, g) in w.iter_mut().zip(&avg) {
                *wi -= o.lr * g;
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        last = loss(&mut comm, &x, &y, &w, &shard)?;
        if rank == 0 {
            let rate = o.samples as f64 / seconds;
            println!("epoch {epoch:3}  loss {last:.4}  {rate:.0} samples/s");
        }
    }
    // every rank holds the same weights
    let mut check = vec![0.0f32; d + 1];
    comm.allreduce(&w, &mut check, ReduceOp::Max)?;
    if check != w {
        return Err("ranks ended with different weights".into());
    }
    if rank == 0 {
        println!("final loss {last:.4} (from {first:.4})");
    }
    // NaN counts as not converged
    let converged = last.partial_cmp(&(first / 2.0)) == Some(std::cmp::Ordering::Less);
    if !converged {
        return Err(format!("did not converge: loss {last:.4} from {first:.4}").into());
    }
    Ok(())
}
