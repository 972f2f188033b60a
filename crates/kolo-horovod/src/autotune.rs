//! Horovod's autotune (upstream's `parameter_manager.cc`; the search is
//! `bayes`): with `HOROVOD_AUTOTUNE=1` the early steps of a job try
//! fusion thresholds and cycle times (then the response cache on and off)
//! and score each by bytes allreduced per microsecond of wall time; once
//! done, the best is kept for the rest of the job.
//!
//! Every rank runs a `Tuner` over the same agreed responses of the global
//! set, so every rank finds a score due in the same cycle; only the
//! coordinator's (global rank 0's) timings and search count, and its
//! parameters go to every rank at that cycle (`tuned`). Pure: time is
//! passed in, log rows are handed out.
//!
//! kolo's own, where upstream differs: the cache stays as configured
//! while the threshold and cycle time are searched (upstream's runs with
//! it off then), and is then tried the other way at the best point found;
//! kolo has no hierarchical or torus algorithms to switch, so those
//! columns of the log are 0.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::bayes::BayesianOptimization;
use crate::message::double_text;

/// Upstream's defaults.
pub const DEFAULT_WARMUP_SAMPLES: u32 = 3;
/// Steps (of the busiest tensor) per sample.
pub const DEFAULT_STEPS_PER_SAMPLE: u32 = 10;
/// Scores the Bayesian search takes at most (one more than this, as upstream).
pub const DEFAULT_MAX_SAMPLES: u32 = 20;
/// The Gaussian process's noise (`alpha`).
pub const DEFAULT_NOISE: f64 = 0.8;
/// Samples whose median is one score.
pub const SAMPLES_PER_SCORE: usize = 5;
/// The autotune log's first line, as upstream writes it.
pub const LOG_HEADER: &str =
    "hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms,tensor_fusion_threshold,score";
/// Upstream's search space: fusion threshold (MiB) and cycle time (ms).
const FUSION_MB: (f64, f64) = (0.0, 64.0);
const CYCLE_MS: (f64, f64) = (1.0, 100.0);
/// Upstream's first points, tried in order before the search proposes any.
const TEST_POINTS: [(f64, f64); 4] = [(4.0, 5.0), (32.0, 50.0), (16.0, 25.0), (8.0, 10.0)];
const MIB: f64 = 1024.0 * 1024.0;

/// How autotune runs (`HOROVOD_AUTOTUNE_*`), and what the user fixed.
#[derive(Clone, Debug, PartialEq)]
pub struct AutotuneSettings {
    /// Scores discarded first (`HOROVOD_AUTOTUNE_WARMUP_SAMPLES`).
    pub warmup_samples: u32,
    /// Steps per sample (`HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE`).
    pub steps_per_sample: u32,
    /// `HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`.
    pub max_samples: u32,
    /// `HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE`.
    pub noise: f64,
    /// `HOROVOD_AUTOTUNE_LOG`: the CSV the coordinator writes.
    pub log: Option<PathBuf>,
    /// `HOROVOD_FUSION_THRESHOLD` was set: held fixed.
    pub fixed_fusion: bool,
    /// `HOROVOD_CYCLE_TIME` was set: held fixed.
    pub fixed_cycle: bool,
    /// `HOROVOD_CACHE_CAPACITY` was set: the cache stays as set.
    pub fixed_cache: bool,
    /// The search's seed (the same proposals for the same scores).
    pub seed: u64,
}

impl Default for AutotuneSettings {
    fn default() -> Self {
        AutotuneSettings {
            warmup_samples: DEFAULT_WARMUP_SAMPLES,
            steps_per_sample: DEFAULT_STEPS_PER_SAMPLE,
            max_samples: DEFAULT_MAX_SAMPLES,
            noise: DEFAULT_NOISE,
            log: None,
            fixed_fusion: false,
            fixed_cycle: false,
            fixed_cache: false,
            seed: 0x6b6f_6c6f,
        }
    }
}

impl AutotuneSettings {
    /// None unless `HOROVOD_AUTOTUNE` is a number above 0; a value that is
    /// not a number (or out of range) is an error naming it.
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Option<AutotuneSettings>, String> {
        let text = |name: &str| var(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let number = |name: &str, least: f64| -> Result<Option<f64>, String> {
            match text(name) {
                None => Ok(None),
                Some(v) => v
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= least)
                    .map(Some)
                    .ok_or_else(|| format!("{name}='{v}' is not a number of {least} or more")),
            }
        };
        if !number("HOROVOD_AUTOTUNE", 0.0)?.is_some_and(|v| v > 0.0) {
            return Ok(None);
        }
        let mut s = AutotuneSettings::default();
        if let Some(n) = number("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", 0.0)? {
            s.warmup_samples = n as u32;
        }
        if let Some(n) = number("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", 1.0)? {
            s.steps_per_sample = n as u32;
        }
        if let Some(n) = number("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", 1.0)? {
            s.max_samples = n as u32;
        }
        if let Some(x) = number("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", 0.0)? {
            s.noise = x;
        }
        s.log = text("HOROVOD_AUTOTUNE_LOG").map(PathBuf::from);
        s.fixed_fusion = text("HOROVOD_FUSION_THRESHOLD").is_some();
        s.fixed_cycle = text("HOROVOD_CYCLE_TIME").is_some();
        s.fixed_cache = text("HOROVOD_CACHE_CAPACITY").is_some();
        Ok(Some(s))
    }
}

/// The parameters in force; what the coordinator sends every rank.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Params {
    /// Bytes.
    pub fusion_threshold: u64,
    /// Milliseconds.
    pub cycle_time_ms: f64,
    /// The response cache is on.
    pub cache_enabled: bool,
    /// Still tuning: every rank keeps scoring.
    pub active: bool,
}

impl Params {
    /// The cycle time as a duration.
    pub fn cycle_time(&self) -> Duration {
        Duration::from_secs_f64(self.cycle_time_ms.max(0.0) / 1000.0)
    }

    fn fusion_mb(&self) -> f64 {
        self.fusion_threshold as f64 / MIB
    }

    /// One log row, as upstream writes it (its `", "` before the cache
    /// column included: tools that read upstream's logs read these).
    pub fn log_row(&self, score: f64) -> String {
        format!(
            "0,0,0, {},{},{},{}",
            u8::from(self.cache_enabled),
            double_text(self.cycle_time_ms),
            double_text(self.fusion_mb()),
            double_text(score)
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The Bayesian search over the free ones of threshold and cycle time.
    Search,
    /// The cache the other way, at the best point.
    Cache,
    Done,
}

/// One rank's autotuner.
#[derive(Debug)]
pub struct Tuner {
    settings: AutotuneSettings,
    coordinator: bool,
    current: Params,
    best: Option<(Params, f64)>,
    warmup_remaining: u32,
    /// Of the sample under way: each name's count, the bytes, the start.
    counts: HashMap<String, u32>,
    bytes: u64,
    started: Option<Duration>,
    scores: Vec<f64>,
    search: BayesianOptimization,
    /// Scores the search has taken.
    iteration: u32,
    phase: Phase,
    log: Vec<String>,
}

impl Tuner {
    /// A tuner starting from `initial` (the configured values: the fixed
    /// ones stay); `coordinator`: this rank searches and logs.
    pub fn new(settings: AutotuneSettings, initial: Params, coordinator: bool) -> Tuner {
        let mut bounds = Vec::new();
        if !settings.fixed_fusion {
            bounds.push(FUSION_MB);
        }
        if !settings.fixed_cycle {
            bounds.push(CYCLE_MS);
        }
        let search = BayesianOptimization::new(bounds, settings.noise, settings.seed);
        let mut tuner = Tuner {
            warmup_remaining: settings.warmup_samples,
            coordinator,
            current: Params { active: true, ..initial },
            best: None,
            counts: HashMap::new(),
            bytes: 0,
            started: None,
            scores: Vec::new(),
            search,
            iteration: 0,
            phase: Phase::Search,
            log: Vec::new(),
            settings,
        };
        if tuner.search.dims() == 0 && tuner.settings.fixed_cache {
            // nothing to tune
            tuner.phase = Phase::Done;
            tuner.current.active = false;
        } else if tuner.search.dims() > 0 {
            tuner.set_point(TEST_POINTS[0]);
        }
        tuner
    }

    /// The parameters to run with now.
    pub fn params(&self) -> Params {
        self.current
    }

    /// Still tuning.
    pub fn active(&self) -> bool {
        self.current.active
    }

    /// The best parameters and their score so far (the coordinator's).
    pub fn best(&self) -> Option<(Params, f64)> {
        self.best
    }

    /// Log rows written since the last call (the coordinator's only).
    pub fn take_log(&mut self) -> Vec<String> {
        std::mem::take(&mut self.log)
    }

    /// The free ones of a (MiB, ms) point into the current parameters.
    fn set_point(&mut self, (mb, ms): (f64, f64)) {
        if !self.settings.fixed_fusion {
            self.current.fusion_threshold = (mb.max(0.0) * MIB) as u64;
        }
        if !self.settings.fixed_cycle {
            self.current.cycle_time_ms = ms;
        }
    }

    fn point(&self) -> Vec<f64> {
        let mut x = Vec::new();
        if !self.settings.fixed_fusion {
            x.push(self.current.fusion_mb());
        }
        if !self.settings.fixed_cycle {
            x.push(self.current.cycle_time_ms);
        }
        x
    }

    fn set_from(&mut self, x: &[f64]) {
        let mut it = x.iter().copied();
        let mb = if self.settings.fixed_fusion { 0.0 } else { it.next().expect("a fusion value") };
        let ms = if self.settings.fixed_cycle { 0.0 } else { it.next().expect("a cycle value") };
        self.set_point((mb, ms));
    }

    /// After a cycle of the global set ran: the names of the allreduced
    /// tensors and their bytes, at `now`. True: a score was taken and every
    /// rank must take the coordinator's parameters now (`synced`).
    pub fn update<'a>(&mut self, names: impl IntoIterator<Item = &'a str>, bytes: u64, now: Duration) -> bool {
        if !self.current.active {
            return false;
        }
        let started = *self.started.get_or_insert(now);
        self.bytes += bytes;
        // a sample ends with the cycle in which some tensor was seen
        // `steps_per_sample` more times; counted over the whole score, not
        // per sample, so that a step whose tensors span cycles does not
        // end samples a step apart
        let due = (self.scores.len() as u32 + 1) * self.settings.steps_per_sample;
        let mut ended = false;
        for name in names {
            let count = self.counts.entry(name.to_string()).or_insert(0);
            *count += 1;
            ended |= *count >= due;
        }
        if !ended {
            return false;
        }
        // a zero-length sample counts as a microsecond
        let micros = now.saturating_sub(started).as_secs_f64() * 1e6;
        self.scores.push(self.bytes as f64 / micros.max(1.0));
        self.bytes = 0;
        self.started = Some(now);
        if self.scores.len() < SAMPLES_PER_SCORE {
            return false;
        }
        self.restart_sample(now);
        let mut scores = std::mem::take(&mut self.scores);
        scores.sort_by(f64::total_cmp);
        let median = scores[SAMPLES_PER_SCORE / 2];
        if self.warmup_remaining > 0 {
            self.warmup_remaining -= 1;
            return false;
        }
        if self.coordinator {
            self.log.push(self.current.log_row(median));
            self.tune(median);
        }
        true
    }

    fn restart_sample(&mut self, now: Duration) {
        self.counts.clear();
        self.bytes = 0;
        self.started = Some(now);
    }

    /// Every rank, once the coordinator's parameters reached it (the
    /// coordinator passes its own): they are in force from now.
    pub fn synced(&mut self, params: Params, now: Duration) {
        self.current = params;
        self.scores.clear();
        self.restart_sample(now);
    }

    /// The coordinator: `score` for the current parameters; the next to try.
    fn tune(&mut self, score: f64) {
        if self.best.is_none_or(|(_, b)| score > b) {
            self.best = Some((self.current, score));
        }
        match self.phase {
            // nothing to search: the configured point was the one score
            Phase::Search if self.search.dims() == 0 => self.end_search(),
            Phase::Search => {
                self.search.add_sample(&self.point(), score);
                self.iteration += 1;
                if self.iteration > self.settings.max_samples {
                    self.end_search();
                } else if let Some(&point) = TEST_POINTS.get(self.iteration as usize) {
                    self.set_point(point);
                } else {
                    let x = self.search.next_sample();
                    self.set_from(&x);
                }
            }
            Phase::Cache | Phase::Done => self.finish(),
        }
    }

    fn end_search(&mut self) {
        let (best, _) = self.best.expect("scored");
        self.current = best;
        if self.settings.fixed_cache {
            self.finish();
        } else {
            self.phase = Phase::Cache;
            self.current.cache_enabled = !best.cache_enabled;
        }
    }

    fn finish(&mut self) {
        let (best, score) = self.best.expect("scored");
        self.phase = Phase::Done;
        self.current = Params { active: false, ..best };
        self.log.push(self.current.log_row(score));
    }
}

#[cfg(test)]
#[path = "autotune_tests.rs"]
mod tests;
