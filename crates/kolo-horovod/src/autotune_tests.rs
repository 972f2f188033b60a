use super::*;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |name| map.get(name).cloned()
}

fn configured() -> Params {
    Params { fusion_threshold: 128 << 20, cycle_time_ms: 1.0, cache_enabled: true, active: false }
}

fn quick(warmup: u32, steps: u32, max: u32) -> AutotuneSettings {
    AutotuneSettings { warmup_samples: warmup, steps_per_sample: steps, max_samples: max, ..Default::default() }
}

const STEP_BYTES: u64 = 4 << 20;

/// One training step: tensors "a" and "b" allreduced in one cycle,
/// taking as long as `throughput` (bytes per µs) of the parameters in
/// force says. True: a score was taken.
fn step(tuner: &mut Tuner, now: &mut Duration, throughput: &impl Fn(&Params) -> f64) -> bool {
    let micros = STEP_BYTES as f64 / throughput(&tuner.params());
    *now += Duration::from_secs_f64(micros / 1e6);
    tuner.update(["a", "b"], STEP_BYTES, *now)
}

/// Runs until the tuner settles (the coordinator syncing with itself).
fn run(tuner: &mut Tuner, throughput: impl Fn(&Params) -> f64) -> (Vec<Params>, usize) {
    let mut now = Duration::from_secs(1);
    let mut tried = vec![tuner.params()];
    let mut steps = 0;
    while tuner.active() {
        steps += 1;
        assert!(steps < 100_000, "the tuner never settled");
        if step(tuner, &mut now, &throughput) {
            let p = tuner.params();
            tuner.synced(p, now);
            tried.push(p);
        }
    }
    (tried, steps)
}

#[test]
fn autotune_is_off_unless_asked_and_reads_upstreams_variables_and_defaults() {
    assert_eq!(AutotuneSettings::from_lookup(env(&[])).unwrap(), None);
    assert_eq!(AutotuneSettings::from_lookup(env(&[("HOROVOD_AUTOTUNE", "0")])).unwrap(), None);
    let on = AutotuneSettings::from_lookup(env(&[("HOROVOD_AUTOTUNE", "1")])).unwrap().unwrap();
    assert_eq!((on.warmup_samples, on.steps_per_sample, on.max_samples, on.noise), (3, 10, 20, 0.8));
    assert!(!on.fixed_fusion && !on.fixed_cycle && !on.fixed_cache && on.log.is_none());
    let set = AutotuneSettings::from_lookup(env(&[
        ("HOROVOD_AUTOTUNE", "1"),
        ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "0"),
        ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "2"),
        ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "7"),
        ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "0.5"),
        ("HOROVOD_AUTOTUNE_LOG", "/tmp/at.csv"),
        ("HOROVOD_FUSION_THRESHOLD", "1048576"),
        ("HOROVOD_CACHE_CAPACITY", "0"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!((set.warmup_samples, set.steps_per_sample, set.max_samples, set.noise), (0, 2, 7, 0.5));
    assert_eq!(set.log, Some(PathBuf::from("/tmp/at.csv")));
    assert!(set.fixed_fusion && !set.fixed_cycle && set.fixed_cache);
}

#[test]
fn a_bad_autotune_value_is_an_error_naming_the_variable() {
    let bad = |name, value| AutotuneSettings::from_lookup(env(&[("HOROVOD_AUTOTUNE", "1"), (name, value)]));
    let e = bad("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "0").unwrap_err();
    assert!(e.contains("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE='0'"), "{e}");
    let e = bad("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "loud").unwrap_err();
    assert!(e.contains("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE='loud'"), "{e}");
    assert!(AutotuneSettings::from_lookup(env(&[("HOROVOD_AUTOTUNE", "yes")]))
        .unwrap_err()
        .contains("HOROVOD_AUTOTUNE"));
}

#[test]
fn a_log_row_is_written_as_upstream_writes_it() {
    let p = Params { fusion_threshold: 4 << 20, cycle_time_ms: 5.0, cache_enabled: true, active: true };
    assert_eq!(p.log_row(123.456), "0,0,0, 1,5,4,123.456");
    let p =
        Params { fusion_threshold: (23.5 * MIB) as u64, cycle_time_ms: 12.345678, cache_enabled: false, active: true };
    assert_eq!(p.log_row(1234567.0), "0,0,0, 0,12.3457,23.5,1.23457e+06");
    assert_eq!(LOG_HEADER.split(',').count(), 7);
}

#[test]
fn the_first_point_is_upstreams_first_test_point_and_the_search_starts_active() {
    let t = Tuner::new(quick(0, 1, 5), configured(), true);
    let p = t.params();
    assert!(p.active);
    assert_eq!((p.fusion_threshold, p.cycle_time_ms, p.cache_enabled), (4 << 20, 5.0, true));
}

#[test]
fn a_sample_is_the_bytes_per_microsecond_of_its_steps_and_a_score_their_median() {
    // warm-up none, two steps a sample: five samples make a score
    let mut t = Tuner::new(quick(0, 2, 5), configured(), true);
    let mut now = Duration::from_secs(10);
    // the first update starts the clock
    let mut scored = Vec::new();
    let mut micros = [100u64, 200, 400, 800, 1600].into_iter().flat_map(|m| [m, m]);
    for i in 0..10 {
        now += Duration::from_micros(micros.next().unwrap());
        scored.push(t.update(["g"], 1000, now));
        assert!(t.take_log().is_empty() || i == 9);
    }
    assert_eq!(scored.iter().filter(|&&s| s).count(), 1, "{scored:?}");
    assert!(scored[9]);
    // the first sample: 2000 bytes over the 100 µs after its first update
    // (its first update started the clock), then 2000 / 400, 800, 1600, 3200:
    // samples 20, 5, 2.5, 1.25, 0.625; median 2.5
    assert_eq!(t.best().unwrap().1, 2.5);
}

#[test]
fn a_step_whose_tensors_span_cycles_still_makes_samples_of_whole_steps() {
    // each step: "a" and "b" in one cycle, "c" and "d" in the next
    let mut t = Tuner::new(quick(0, 2, 5), configured(), true);
    let mut now = Duration::ZERO;
    let mut scored_at = Vec::new();
    for step in 0..30 {
        for (half, names) in [["a", "b"], ["c", "d"]].into_iter().enumerate() {
            now += Duration::from_millis(1);
            if t.update(names, 10, now) {
                scored_at.push((step, half));
            }
        }
    }
    // five samples of two steps: a score every ten steps (within the half
    // step by which a new score's first sample may start in mid-step)
    let halves: Vec<usize> = scored_at.iter().map(|(step, half)| 2 * step + half).collect();
    assert_eq!(halves[0], 18, "{scored_at:?}");
    assert!(halves.windows(2).all(|w| (19..=20).contains(&(w[1] - w[0]))), "{scored_at:?}");
    assert_eq!(halves.len(), 3, "{scored_at:?}");
}

#[test]
fn warm_up_scores_are_discarded_and_no_rank_syncs_for_them() {
    let mut t = Tuner::new(quick(2, 1, 3), configured(), true);
    let mut now = Duration::ZERO;
    let mut syncs = Vec::new();
    for i in 0..20 {
        now += Duration::from_millis(1);
        if t.update(["x"], 10, now) {
            syncs.push(i);
        }
    }
    // five one-step samples a score: scores end at steps 4, 9, 14, 19;
    // the first two are warm-up
    assert_eq!(syncs, vec![14, 19]);
    assert_eq!(t.take_log().len(), 2);
}

#[test]
fn every_rank_finds_scores_due_in_the_same_cycles_and_takes_the_coordinators_parameters() {
    let mut root = Tuner::new(quick(1, 3, 4), configured(), true);
    let mut other = Tuner::new(quick(1, 3, 4), configured(), false);
    let (mut t0, mut t1) = (Duration::ZERO, Duration::ZERO);
    let mut cycle = 0;
    while root.active() {
        cycle += 1;
        assert!(cycle < 10_000);
        // the ranks' clocks differ; the names do not
        t0 += Duration::from_micros(100 + (cycle % 7) * 13);
        t1 += Duration::from_micros(300);
        let names: Vec<&str> = if cycle % 3 == 0 { vec!["a"] } else { vec!["a", "b"] };
        let a = root.update(names.iter().copied(), 100, t0);
        let b = other.update(names.iter().copied(), 100, t1);
        assert_eq!(a, b, "cycle {cycle}");
        if a {
            let p = root.params();
            root.synced(p, t0);
            other.synced(p, t1);
            assert_eq!(other.params(), p);
        }
        assert!(other.take_log().is_empty(), "only the coordinator logs");
    }
    assert!(!other.active());
    assert!(!other.update(["a"], 1, t1 + Duration::from_secs(1)));
}

#[test]
fn the_tuner_settles_on_the_best_of_a_score_function() {
    // fastest near 40 MiB and 12 ms
    let throughput = |p: &Params| {
        let mb = p.fusion_threshold as f64 / MIB;
        1000.0 * (-((mb - 40.0) / 25.0).powi(2) - ((p.cycle_time_ms - 12.0) / 40.0).powi(2)).exp() + 10.0
    };
    let mut t = Tuner::new(quick(1, 2, 20), configured(), true);
    let (tried, _) = run(&mut t, throughput);
    let settled = t.params();
    assert!(!settled.active);
    let best_tried = tried.iter().map(throughput).fold(0.0, f64::max);
    assert_eq!(throughput(&settled), best_tried, "settles on the best tried");
    assert!(throughput(&settled) > 0.9 * 1010.0, "settled at {settled:?}: {}", throughput(&settled));
    // four test points, then the search's own, the cache off once, the best
    assert_eq!(tried.len(), 1 + 21 + 1);
    assert!(settled.cache_enabled, "the cache was as fast either way: kept as it was");
    let mut log = t.take_log();
    assert_eq!(log.len(), 21 + 1 + 1);
    let last = log.pop().unwrap();
    assert_eq!(last, settled.log_row(t.best().unwrap().1));
}

#[test]
fn the_cache_is_tried_off_at_the_best_point_and_kept_off_if_faster() {
    let throughput = |p: &Params| if p.cache_enabled { 100.0 } else { 150.0 };
    let mut t = Tuner::new(quick(0, 1, 4), configured(), true);
    let (tried, _) = run(&mut t, throughput);
    assert!(tried[..tried.len() - 2].iter().all(|p| p.cache_enabled));
    assert!(!tried[tried.len() - 2].cache_enabled);
    assert!(!t.params().cache_enabled);
    let log = t.take_log();
    assert!(log.last().unwrap().starts_with("0,0,0, 0,"), "{log:?}");
}

#[test]
fn fixed_parameters_stay_as_the_user_set_them() {
    let fixed = Params { fusion_threshold: 3 << 20, cycle_time_ms: 2.5, cache_enabled: false, active: false };
    let throughput = |p: &Params| 50.0 + p.cycle_time_ms;
    let settings = AutotuneSettings { fixed_fusion: true, fixed_cache: true, ..quick(0, 1, 6) };
    let mut t = Tuner::new(settings, fixed, true);
    let (tried, _) = run(&mut t, throughput);
    assert!(tried.iter().all(|p| p.fusion_threshold == 3 << 20 && !p.cache_enabled));
    assert!(tried.iter().any(|p| p.cycle_time_ms != tried[0].cycle_time_ms), "the cycle time was tuned");
    for row in t.take_log() {
        let cols: Vec<&str> = row.split(',').collect();
        assert_eq!((cols[3], cols[5]), (" 0", "3"), "{row}");
    }
    // the cycle time fixed, the threshold searched alone
    let settings = AutotuneSettings { fixed_cycle: true, ..quick(0, 1, 6) };
    let mut t = Tuner::new(settings, fixed, true);
    let (tried, _) = run(&mut t, |p| 10.0 + p.fusion_threshold as f64 / MIB);
    assert!(tried.iter().all(|p| p.cycle_time_ms == 2.5));
    assert!(tried.iter().any(|p| p.fusion_threshold != tried[1].fusion_threshold));
}

#[test]
fn with_everything_fixed_there_is_nothing_to_tune() {
    let settings = AutotuneSettings { fixed_fusion: true, fixed_cycle: true, fixed_cache: true, ..quick(0, 1, 6) };
    let mut t = Tuner::new(settings, configured(), true);
    assert!(!t.active());
    assert_eq!(t.params(), configured());
    assert!(!t.update(["a"], 1, Duration::from_secs(1)));
    // only the cache free: the configured point, then the cache the other way
    let settings = AutotuneSettings { fixed_fusion: true, fixed_cycle: true, ..quick(0, 1, 6) };
    let mut t = Tuner::new(settings, configured(), true);
    let (tried, _) = run(&mut t, |p| if p.cache_enabled { 5.0 } else { 1.0 });
    let caches: Vec<bool> = tried.iter().map(|p| p.cache_enabled).collect();
    assert_eq!(caches, vec![true, false, true]);
}
