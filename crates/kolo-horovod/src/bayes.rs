//! Bayesian optimisation over a Gaussian process (upstream's
//! `optim/bayesian_optimization.cc` and `optim/gaussian_process.cc`), the
//! search that autotune runs: the GP models the score over the unit cube
//! of the free parameters, and the next point tried is the one of largest
//! expected improvement over the best mean seen.
//!
//! kolo's own, where upstream differs: inputs are scaled to [0, 1] per
//! dimension (upstream fits one length scale over megabytes and
//! milliseconds alike); the kernel's length and height are the best of a
//! fixed grid by marginal likelihood (upstream runs L-BFGS from (1, 1));
//! the acquisition's maximum is searched from seeded random candidates and
//! refined by a shrinking pattern search (upstream: L-BFGS from 25 random
//! starts). Everything is deterministic given the seed.

/// Upstream's exploration margin in the expected improvement (`xi`).
const XI: f64 = 0.01;
/// Random candidates drawn per proposal.
const CANDIDATES: usize = 512;
/// Kernel length scales (over the unit cube) and heights tried.
const LENGTHS: [f64; 9] = [0.05, 0.08, 0.12, 0.18, 0.25, 0.35, 0.5, 0.8, 1.2];
const HEIGHTS: [f64; 6] = [0.3, 0.6, 1.0, 1.5, 2.2, 3.0];

/// A small seeded generator (splitmix64): the proposals repeat given the seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A Gaussian process fitted to samples: squared exponential kernel,
/// `noise` squared on the diagonal (upstream's `alpha`).
#[derive(Clone, Debug)]
pub struct Gp {
    xs: Vec<Vec<f64>>,
    length: f64,
    height: f64,
    noise: f64,
    /// Lower Cholesky factor of the kernel matrix.
    chol: Vec<Vec<f64>>,
    /// The kernel matrix's inverse times the targets.
    weights: Vec<f64>,
}

fn kernel(a: &[f64], b: &[f64], length: f64, height: f64) -> f64 {
    let d2: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    height * height * (-0.5 * d2 / (length * length)).exp()
}

/// The lower factor of a symmetric positive definite matrix; None if it is not.
fn cholesky(m: &[Vec<f64>]) -> Option<Vec<Vec<f64>>> {
    let n = m.len();
    let mut l = vec![vec![0.0; n]; n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = (0..j).map(|k| l[i][k] * l[j][k]).sum();
            if i == j {
                let d = m[i][i] - s;
                if d <= 0.0 || !d.is_finite() {
                    return None;
                }
                l[i][i] = d.sqrt();
            } else {
                l[i][j] = (m[i][j] - s) / l[j][j];
            }
        }
    }
    Some(l)
}

/// Solves `L y = b` (forward).
fn forward(l: &[Vec<f64>], b: &[f64]) -> Vec<f64> {
    let mut y = vec![0.0; b.len()];
    for i in 0..b.len() {
        y[i] = (b[i] - (0..i).map(|k| l[i][k] * y[k]).sum::<f64>()) / l[i][i];
    }
    y
}

/// Solves `Lᵀ x = y` (backward).
fn backward(l: &[Vec<f64>], y: &[f64]) -> Vec<f64> {
    let n = y.len();
    let mut x = vec![0.0; n];
    for i in (0..n).rev() {
        x[i] = (y[i] - (i + 1..n).map(|k| l[k][i] * x[k]).sum::<f64>()) / l[i][i];
    }
    x
}

impl Gp {
    fn with(xs: &[Vec<f64>], ys: &[f64], length: f64, height: f64, noise: f64) -> Option<(Gp, f64)> {
        let n = xs.len();
        let mut k = vec![vec![0.0; n]; n];
        for i in 0..n {
            for j in 0..n {
                k[i][j] = kernel(&xs[i], &xs[j], length, height);
            }
            // a little jitter keeps a noiseless fit factorable
            k[i][i] += noise * noise + 1e-10;
        }
        let chol = cholesky(&k)?;
        let weights = backward(&chol, &forward(&chol, ys));
        let fit: f64 = ys.iter().zip(&weights).map(|(y, w)| y * w).sum();
        let log_det: f64 = (0..n).map(|i| chol[i][i].ln()).sum();
        let likelihood = -0.5 * fit - log_det - 0.5 * n as f64 * (2.0 * std::f64::consts::PI).ln();
        Some((Gp { xs: xs.to_vec(), length, height, noise, chol, weights }, likelihood))
    }

    /// Fits `ys` at `xs`, the kernel's length and height chosen by
    /// marginal likelihood; None without samples.
    pub fn fit(xs: &[Vec<f64>], ys: &[f64], noise: f64) -> Option<Gp> {
        let mut best: Option<(Gp, f64)> = None;
        for &length in &LENGTHS {
            for &height in &HEIGHTS {
                if let Some((gp, likelihood)) = Gp::with(xs, ys, length, height, noise) {
                    if best.as_ref().is_none_or(|(_, b)| likelihood > *b) {
                        best = Some((gp, likelihood));
                    }
                }
            }
        }
        best.map(|(gp, _)| gp)
    }

    /// The posterior mean and standard deviation at `x`.
    pub fn predict(&self, x: &[f64]) -> (f64, f64) {
        let ks: Vec<f64> = self.xs.iter().map(|xi| kernel(xi, x, self.length, self.height)).collect();
        let mean = ks.iter().zip(&self.weights).map(|(k, w)| k * w).sum();
        let v = forward(&self.chol, &ks);
        let var = self.height * self.height + 1e-8 - v.iter().map(|a| a * a).sum::<f64>();
        (mean, var.max(0.0).sqrt())
    }

    /// The kernel's length scale and height chosen.
    pub fn kernel_params(&self) -> (f64, f64, f64) {
        (self.length, self.height, self.noise)
    }
}

/// The complementary error function (Numerical Recipes' Chebyshev fit,
/// relative error under 1.2e-7: ample for an acquisition function).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98 + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

fn normal_cdf(x: f64) -> f64 {
    0.5 * erfc(-x / std::f64::consts::SQRT_2)
}

fn normal_pdf(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// Expected improvement of a point with posterior `mean` and `sigma` over `best`.
pub fn expected_improvement(mean: f64, sigma: f64, best: f64) -> f64 {
    if sigma <= 1e-12 {
        return 0.0;
    }
    let improvement = mean - best - XI;
    let z = improvement / sigma;
    improvement * normal_cdf(z) + sigma * normal_pdf(z)
}

/// The optimiser: samples over bounded real parameters, proposals by
/// expected improvement.
#[derive(Clone, Debug)]
pub struct BayesianOptimization {
    bounds: Vec<(f64, f64)>,
    noise: f64,
    xs: Vec<Vec<f64>>,
    ys: Vec<f64>,
    rng: Rng,
}

impl BayesianOptimization {
    /// Over `bounds` (min, max per dimension), with the GP's `noise`.
    pub fn new(bounds: Vec<(f64, f64)>, noise: f64, seed: u64) -> BayesianOptimization {
        BayesianOptimization { bounds, noise, xs: Vec::new(), ys: Vec::new(), rng: Rng::new(seed) }
    }

    /// How many parameters are searched.
    pub fn dims(&self) -> usize {
        self.bounds.len()
    }

    /// Samples taken so far.
    pub fn samples(&self) -> usize {
        self.ys.len()
    }

    fn to_unit(&self, x: &[f64]) -> Vec<f64> {
        x.iter().zip(&self.bounds).map(|(v, (lo, hi))| if hi > lo { (v - lo) / (hi - lo) } else { 0.0 }).collect()
    }

    fn scaled_back(&self, u: &[f64]) -> Vec<f64> {
        u.iter().zip(&self.bounds).map(|(v, (lo, hi))| lo + v.clamp(0.0, 1.0) * (hi - lo)).collect()
    }

    /// Records that `x` scored `y`.
    pub fn add_sample(&mut self, x: &[f64], y: f64) {
        self.xs.push(self.to_unit(x));
        self.ys.push(y);
    }

    /// The targets standardised (as upstream does once there are three).
    fn standardised(&self) -> Vec<f64> {
        let n = self.ys.len() as f64;
        let (mut mean, mut sd) = (0.0, 1.0);
        if self.ys.len() >= 3 {
            mean = self.ys.iter().sum::<f64>() / n;
            let var = self.ys.iter().map(|y| (y - mean) * (y - mean)).sum::<f64>() / n;
            if var > 0.0 {
                sd = var.sqrt();
            }
        }
        self.ys.iter().map(|y| (y - mean) / sd).collect()
    }

    /// The next point to try: the expected improvement's largest value
    /// found. Without samples (or a fit), a random point.
    pub fn next_sample(&mut self) -> Vec<f64> {
        let dims = self.dims();
        let random: Vec<Vec<f64>> = (0..CANDIDATES).map(|_| (0..dims).map(|_| self.rng.unit()).collect()).collect();
        let Some(gp) = Gp::fit(&self.xs, &self.standardised(), self.noise) else {
            return self.scaled_back(&random[0]);
        };
        let best_mean = self.xs.iter().map(|x| gp.predict(x).0).fold(f64::NEG_INFINITY, f64::max);
        let ei = |u: &[f64]| {
            let (mean, sigma) = gp.predict(u);
            expected_improvement(mean, sigma, best_mean)
        };
        let mut best = random[0].clone();
        let mut best_ei = f64::NEG_INFINITY;
        for u in random.iter().chain(&self.xs) {
            let e = ei(u);
            if e > best_ei {
                best_ei = e;
                best = u.clone();
            }
        }
        // refine: steps along each axis while they help, then smaller steps
        let mut step = 0.05;
        while step > 1e-3 {
            let mut moved = false;
            for d in 0..dims {
                for sign in [-1.0, 1.0] {
                    let mut u = best.clone();
                    u[d] = (u[d] + sign * step).clamp(0.0, 1.0);
                    let e = ei(&u);
                    if e > best_ei {
                        best_ei = e;
                        best = u;
                        moved = true;
                    }
                }
            }
            if !moved {
                step /= 2.0;
            }
        }
        self.scaled_back(&best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_repeats_given_its_seed_and_stays_in_the_unit_interval() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..1000 {
            let x = a.unit();
            assert_eq!(x, b.unit());
            assert!((0.0..1.0).contains(&x));
        }
        assert_ne!(Rng::new(7).unit(), Rng::new(8).unit());
    }

    #[test]
    fn the_normal_distribution_is_right_to_the_precision_the_search_needs() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.0) - 0.841_344_746).abs() < 1e-6);
        assert!((normal_cdf(-1.96) - 0.024_997_895).abs() < 1e-6);
        assert!((normal_pdf(0.0) - 0.398_942_28).abs() < 1e-7);
    }

    #[test]
    fn cholesky_solves_a_positive_definite_system_and_refuses_an_indefinite_one() {
        let m = vec![vec![4.0, 2.0], vec![2.0, 3.0]];
        let l = cholesky(&m).unwrap();
        let x = backward(&l, &forward(&l, &[2.0, 1.0]));
        // 4x + 2y = 2, 2x + 3y = 1: x = 0.5, y = 0
        assert!((x[0] - 0.5).abs() < 1e-12 && x[1].abs() < 1e-12, "{x:?}");
        assert!(cholesky(&[vec![1.0, 2.0], vec![2.0, 1.0]]).is_none());
    }

    #[test]
    fn a_nearly_noiseless_gp_passes_through_its_samples_and_is_unsure_far_from_them() {
        let xs = vec![vec![0.0], vec![0.5], vec![1.0]];
        let ys = vec![-1.0, 1.0, 0.0];
        let gp = Gp::fit(&xs, &ys, 1e-3).unwrap();
        for (x, y) in xs.iter().zip(&ys) {
            let (mean, sigma) = gp.predict(x);
            assert!((mean - y).abs() < 0.05, "{mean} at {x:?}");
            assert!(sigma < 0.1);
        }
        let near = gp.predict(&[0.5]).1;
        let between = gp.predict(&[0.25]).1;
        assert!(between > near);
    }

    #[test]
    fn expected_improvement_grows_with_the_mean_and_with_doubt() {
        assert_eq!(expected_improvement(5.0, 0.0, 0.0), 0.0);
        assert!(expected_improvement(1.0, 0.5, 0.0) > expected_improvement(0.5, 0.5, 0.0));
        assert!(expected_improvement(0.0, 1.0, 0.0) > expected_improvement(0.0, 0.1, 0.0));
        assert!(expected_improvement(-3.0, 0.1, 0.0) < 1e-6);
    }

    #[test]
    fn proposals_stay_in_bounds_and_repeat_given_the_seed() {
        let run = |seed| {
            let mut bo = BayesianOptimization::new(vec![(0.0, 64.0), (1.0, 100.0)], 0.8, seed);
            let mut out = Vec::new();
            for (x, y) in [([4.0, 5.0], 1.0), ([32.0, 50.0], 3.0), ([16.0, 25.0], 2.0), ([8.0, 10.0], 1.5)] {
                bo.add_sample(&x, y);
            }
            for _ in 0..3 {
                let x = bo.next_sample();
                assert!((0.0..=64.0).contains(&x[0]) && (1.0..=100.0).contains(&x[1]), "{x:?}");
                bo.add_sample(&x, 2.5);
                out.push(x);
            }
            out
        };
        assert_eq!(run(3), run(3));
    }

    #[test]
    fn the_search_finds_the_peak_of_a_smooth_function() {
        let f = |x: &[f64]| -((x[0] - 0.7) * (x[0] - 0.7) + (x[1] - 0.2) * (x[1] - 0.2));
        let mut bo = BayesianOptimization::new(vec![(0.0, 1.0), (0.0, 1.0)], 0.1, 11);
        for x in [[0.1, 0.1], [0.9, 0.9], [0.5, 0.5], [0.2, 0.8]] {
            bo.add_sample(&x, f(&x));
        }
        let mut best = f64::NEG_INFINITY;
        for _ in 0..15 {
            let x = bo.next_sample();
            best = best.max(f(&x));
            bo.add_sample(&x, f(&x));
        }
        assert!(best > -0.01, "best found {best}");
    }
}
