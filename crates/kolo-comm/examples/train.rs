//! Data-parallel training with kolo-comm: logistic regression on a
//! synthetic dataset. Every worker builds the same dataset from a seed,
//! trains on its shard, and averages gradients with an allreduce each step;
//! rank 0 prints the loss per epoch and the throughput.
//!
//!     cargo build --release --bins --examples
//!     target/release/kolo run -np 4 -- target/release/examples/train
//!
//! Options: --epochs N (10), --samples N (65536), --features N (32),
//! --batch N (256 per worker), --lr X (0.5), --step-ms N (0: extra time
//! per step, as a bigger model would take), --straggler R with
//! --straggler-ms N (rank R takes N ms more per step: a slow host, as
//! `kolo run --timeline` shows it), --commit-every N (16 steps, in
//! elastic mode). Exits non-zero unless the final loss is below half of the
//! starting loss.
//!
//! Elastic mode, in place (`kolo run --in-place`, e.g. with `--min-np 2`):
//! the weights and the position in the data are kolo-comm's elastic
//! `State`, committed every few steps; when a rank dies or hosts come and
//! go, the others keep their process, join the new round, take rank 0's
//! state and go on from the last commit, sharding the data anew.

use std::time::Instant;

use kolo_comm::elastic::{Elastic, State};
use kolo_comm::{CommError, Communicator, ReduceOp};
use rand::{Rng, SeedableRng};

struct Options {
    epochs: usize,
    samples: usize,
    features: usize,
    batch: usize,
    lr: f32,
    step_ms: u64,
    straggler: Option<usize>,
    straggler_ms: u64,
    commit_every: usize,
}

impl Options {
    /// The extra time this rank takes per step, if any.
    fn pause(&self, rank: usize) {
        let ms = self.step_ms + if self.straggler == Some(rank) { self.straggler_ms } else { 0 };
        if ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
    }
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        epochs: 10,
        samples: 65536,
        features: 32,
        batch: 256,
        lr: 0.5,
        step_ms: 0,
        straggler: None,
        straggler_ms: 0,
        commit_every: 16,
    };
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
            "--step-ms" => o.step_ms = value.parse().map_err(|_| bad())?,
            "--straggler" => o.straggler = Some(value.parse().map_err(|_| bad())?),
            "--straggler-ms" => o.straggler_ms = value.parse().map_err(|_| bad())?,
            "--commit-every" => o.commit_every = value.parse().map_err(|_| bad())?,
            other => return Err(format!("unknown option '{other}'")),
        }
    }
    if o.epochs == 0 || o.samples == 0 || o.features == 0 || o.batch == 0 || o.commit_every == 0 {
        return Err("epochs, samples, features, batch and commit-every must be at least 1".into());
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
    let result = match std::env::var_os(kolo_topology::env_names::ELASTIC_ROUND) {
        Some(_) => train_elastic(&o),
        None => train(&o),
    };
    if let Err(e) = result {
        eprintln!("train: {e}");
        std::process::exit(1);
    }
}

/// One step of SGD on `batch`: the local gradient, averaged over the ranks.
#[allow(clippy::too_many_arguments)]
fn step(
    comm: &mut Communicator,
    x: &[f32],
    y: &[f32],
    w: &mut [f32],
    batch: &[usize],
    grad: &mut [f32],
    avg: &mut [f32],
    lr: f32,
) -> Result<(), CommError> {
    let d = w.len() - 1;
    grad.fill(0.0);
    for &i in batch {
        let row = &x[i * d..(i + 1) * d];
        let z: f32 = row.iter().zip(w.iter()).map(|(a, b)| a * b).sum::<f32>() + w[d];
        let err = sigmoid(z) - y[i];
        for (g, a) in grad.iter_mut().zip(row) {
            *g += err * a;
        }
        grad[d] += err;
    }
    let scale = 1.0 / batch.len().max(1) as f32;
    grad.iter_mut().for_each(|g| *g *= scale);
    // the data-parallel step: every rank ends with the mean gradient
    comm.allreduce(grad, avg, ReduceOp::Avg)?;
    for (wi, g) in w.iter_mut().zip(avg.iter()) {
        *wi -= lr * g;
    }
    Ok(())
}

/// What an elastic run commits: the weights and where in the data it is.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Progress {
    epoch: usize,
    step: usize,
    w: Vec<f32>,
    first_loss: Option<f32>,
    last_loss: Option<f32>,
}

fn train_elastic(o: &Options) -> Result<(), Box<dyn std::error::Error>> {
    let mut elastic = Elastic::from_env()?;
    let (x, y) = dataset(o);
    let d = o.features;
    let mut state = State::new(Progress { epoch: 1, step: 0, w: vec![0.0; d + 1], first_loss: None, last_loss: None });
    let (mut grad, mut avg) = (vec![0.0f32; d + 1], vec![0.0f32; d + 1]);
    let started = Instant::now();
    let result = elastic.run(&mut state, |state, comm| {
        let (rank, size) = (comm.rank(), comm.size());
        let shard: Vec<usize> = (rank..o.samples).step_by(size).collect();
        if state.first_loss.is_none() {
            state.first_loss = Some(loss(comm, &x, &y, &state.w, &shard)?);
        }
        if rank == 0 {
            println!(
                "{size} ranks from epoch {} step {} ({:.3} s in)",
                state.epoch,
                state.step,
                started.elapsed().as_secs_f64()
            );
        }
        let steps = shard.len().div_ceil(o.batch);
        let trained = train_round(o, state, comm, &x, &y, &shard, steps, &mut grad, &mut avg);
        if let (0, Err(e)) = (rank, &trained) {
            println!("round ended at epoch {} step {}: {e}", state.epoch, state.step);
        }
        trained.map(|()| rank)
    });
    let rank = match result {
        Ok(rank) => rank,
        // left out of the job's new round (its host was removed): not a failure
        Err(CommError::Removed { .. }) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let (first, last) = (state.first_loss.unwrap_or(f32::NAN), state.last_loss.unwrap_or(f32::NAN));
    if rank == 0 {
        println!("final loss {last:.4} (from {first:.4})");
    }
    if last.partial_cmp(&(first / 2.0)) != Some(std::cmp::Ordering::Less) {
        return Err(format!("did not converge: loss {last:.4} from {first:.4}").into());
    }
    Ok(())
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
        for step_index in 0..steps {
            let batch = &shard[step_index * o.batch..((step_index + 1) * o.batch).min(shard.len())];
            step(&mut comm, &x, &y, &mut w, batch, &mut grad, &mut avg, o.lr)?;
            o.pause(comm.rank());
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

/// The epochs of one round, from where `state` is.
#[allow(clippy::too_many_arguments)]
fn train_round(
    o: &Options,
    state: &mut State<Progress>,
    comm: &mut Communicator,
    x: &[f32],
    y: &[f32],
    shard: &[usize],
    steps: usize,
    grad: &mut [f32],
    avg: &mut [f32],
) -> Result<(), CommError> {
    let (rank, size) = (comm.rank(), comm.size());
    while state.epoch <= o.epochs {
        let epoch_start = Instant::now();
        while state.step < steps {
            let batch = &shard[state.step * o.batch..((state.step + 1) * o.batch).min(shard.len())];
            let p = &mut **state;
            step(comm, x, y, &mut p.w, batch, grad, avg, o.lr)?;
            p.step += 1;
            o.pause(rank);
            if state.step.is_multiple_of(o.commit_every) {
                state.commit()?;
            }
        }
        let last = loss(comm, x, y, &state.w, shard)?;
        if rank == 0 {
            let rate = shard.len() as f64 * size as f64 / epoch_start.elapsed().as_secs_f64();
            println!("epoch {:3}  loss {last:.4}  {rate:.0} samples/s  ({size} ranks)", state.epoch);
        }
        state.epoch += 1;
        state.step = 0;
        state.last_loss = Some(last);
        state.commit()?;
    }
    Ok(())
}
