//! The stall inspector (upstream's `stall_inspector.cc`): the coordinator
//! notices names that some ranks submitted and others have not for longer
//! than the warning time, and names the missing ranks. Pure: the caller
//! passes the time (since any fixed instant).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

/// `HOROVOD_STALL_CHECK_*`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StallSettings {
    /// Off with `HOROVOD_STALL_CHECK_DISABLE`.
    pub enabled: bool,
    /// Warn after this (`HOROVOD_STALL_CHECK_TIME_SECONDS`, 60).
    pub warning: Duration,
    /// Shut down after this, if set (`HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`, 0: never).
    pub shutdown: Duration,
}

impl Default for StallSettings {
    fn default() -> Self {
        StallSettings { enabled: true, warning: Duration::from_secs(60), shutdown: Duration::ZERO }
    }
}

/// What a check found.
#[derive(Clone, Debug, PartialEq)]
pub struct Stall {
    /// Upstream's text (a WARNING, or an ERROR when shutting down).
    pub message: String,
    /// Some rank is past the shutdown time: the job shuts down.
    pub shut_down: bool,
    /// Each missing rank (global) and the names it has not submitted.
    pub missing: BTreeMap<u32, BTreeSet<String>>,
}

/// One process set's stall inspector: when names became pending, and
/// when the last check ran.
#[derive(Debug, Default)]
pub struct StallInspector {
    settings: StallSettings,
    /// Uncached names on the coordinator: who submitted them, since when.
    uncached: HashMap<String, (Vec<u32>, Duration)>,
    /// Cached names waiting on this rank, since when.
    cached: HashMap<String, Duration>,
    last_check: Duration,
}

impl StallInspector {
    /// An inspector that nothing has been recorded in.
    pub fn new(settings: StallSettings) -> Self {
        StallInspector { settings, ..Default::default() }
    }

    /// The settings it was made with.
    pub fn settings(&self) -> StallSettings {
        self.settings
    }

    /// Coordinator: set rank `set_rank` submitted `name`, which went through
    /// negotiation; the name's clock starts at its first submission.
    pub fn record_uncached(&mut self, name: &str, set_rank: u32, now: Duration) {
        self.uncached.entry(name.to_string()).or_insert_with(|| (Vec::new(), now)).0.push(set_rank);
    }

    /// Coordinator: `name` is no longer pending (it got its response).
    pub fn remove_uncached(&mut self, name: &str) {
        self.uncached.remove(name);
    }

    /// This rank's `name` hit the cache and waits for every rank to hit it;
    /// the clock starts the first time (nothing is kept when the check is
    /// off).
    pub fn record_cached(&mut self, name: &str, now: Duration) {
        if self.settings.enabled {
            self.cached.entry(name.to_string()).or_insert(now);
        }
    }

    /// `name` no longer waits on a cache hit (it ran or was invalidated).
    pub fn remove_cached(&mut self, name: &str) {
        self.cached.remove(name);
    }

    /// Forgets every cached name (the cache was switched: they go through
    /// the coordinator, or are cached anew).
    pub fn forget_cached(&mut self) {
        self.cached.clear();
    }

    /// Whether a check is due (at most one per warning interval).
    pub fn check_due(&self, now: Duration) -> bool {
        self.settings.enabled && now.saturating_sub(self.last_check) > self.settings.warning
    }

    /// Notes that a check ran at `now`, for [`check_due`](Self::check_due).
    pub fn checked(&mut self, now: Duration) {
        self.last_check = now;
    }

    /// Cached names pending past the warning time: invalidated, so that
    /// they go through the coordinator, where a check sees them.
    pub fn stalled_cached(&self, now: Duration) -> Vec<String> {
        let mut names: Vec<String> = self
            .cached
            .iter()
            .filter(|(_, &since)| now.saturating_sub(since) > self.settings.warning)
            .map(|(name, _)| name.clone())
            .collect();
        names.sort();
        names
    }

    /// The coordinator's check: the names waiting past the warning time and
    /// the set ranks (printed as `global_ranks[r]`) that have not submitted
    /// them; `None` when nothing stalls.
    pub fn check(&self, global_ranks: &[u32], now: Duration) -> Option<Stall> {
        let warning = self.settings.warning;
        let mut shutdown = self.settings.shutdown;
        let mut prefix = String::new();
        if !shutdown.is_zero() && shutdown < warning {
            prefix = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than HOROVOD_STALL_CHECK_TIME_SECONDS, will not \
                      shutdown.\n"
                .into();
            shutdown = Duration::ZERO;
        }
        let mut missing: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
        let mut past_shutdown: BTreeSet<u32> = BTreeSet::new();
        for (name, (ranks, since)) in &self.uncached {
            let lag = now.saturating_sub(*since);
            if lag <= warning {
                continue;
            }
            for rank in 0..global_ranks.len() as u32 {
                if !ranks.contains(&rank) {
                    missing.entry(rank).or_default().insert(name.clone());
                    if !shutdown.is_zero() && lag > shutdown {
                        past_shutdown.insert(rank);
                    }
                }
            }
        }
        if missing.is_empty() {
            return None;
        }
        let mut message = format!(
            "{prefix}One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and \
             are waiting for remainder of ranks for more than {} seconds. This may indicate that different ranks are \
             trying to submit different tensors or that only subset of ranks is submitting tensors, which will cause \
             deadlock. \nMissing ranks:",
            warning.as_secs()
        );
        for (rank, names) in &missing {
            let mark = if past_shutdown.contains(rank) { "!" } else { "" };
            // at most six names, and " ..." after the sixth (upstream's rule)
            let mut shown: Vec<&str> = names.iter().take(6).map(String::as_str).collect::<Vec<_>>();
            let more = if names.len() >= 6 { " ..." } else { "" };
            if shown.is_empty() {
                shown.push("");
            }
            message.push_str(&format!("\n{}{mark}: [{}{more}]", global_ranks[*rank as usize], shown.join(", ")));
        }
        let shut_down = !past_shutdown.is_empty();
        if shut_down {
            message.push_str(&format!(
                "\nOne or more rank (marked by \"!\") is stalled for longer than {} seconds. Will shutdown.",
                shutdown.as_secs()
            ));
        }
        let missing = missing.into_iter().map(|(r, names)| (global_ranks[r as usize], names)).collect();
        Some(Stall { message, shut_down, missing })
    }

    /// Whether anything is waiting on the coordinator.
    pub fn is_empty(&self) -> bool {
        self.uncached.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn names_the_missing_ranks_and_their_tensors_past_the_warning_time() {
        let mut inspector =
            StallInspector::new(StallSettings { enabled: true, warning: secs(2), shutdown: Duration::ZERO });
        inspector.record_uncached("allreduce.b", 0, secs(10));
        inspector.record_uncached("allreduce.a", 0, secs(10));
        inspector.record_uncached("allreduce.a", 2, secs(11));
        assert_eq!(inspector.check(&[4, 5, 6], secs(12)), None, "not yet past the warning time");
        let stall = inspector.check(&[4, 5, 6], secs(13)).unwrap();
        assert!(!stall.shut_down);
        assert!(stall.message.starts_with("One or more tensors were submitted"), "{}", stall.message);
        assert!(stall.message.contains("for more than 2 seconds."), "{}", stall.message);
        assert!(
            stall.message.ends_with("Missing ranks:\n5: [allreduce.a, allreduce.b]\n6: [allreduce.b]"),
            "{}",
            stall.message
        );
        inspector.remove_uncached("allreduce.b");
        let stall = inspector.check(&[4, 5, 6], secs(13)).unwrap();
        assert!(stall.message.ends_with("Missing ranks:\n5: [allreduce.a]"), "{}", stall.message);
    }

    #[test]
    fn past_the_shutdown_time_the_rank_is_marked_and_the_job_shuts_down() {
        let mut inspector = StallInspector::new(StallSettings { enabled: true, warning: secs(2), shutdown: secs(5) });
        inspector.record_uncached("x", 0, secs(0));
        let stall = inspector.check(&[0, 1], secs(6)).unwrap();
        assert!(stall.shut_down);
        assert!(stall.message.contains("\n1!: [x]"), "{}", stall.message);
        assert!(stall.message.ends_with("is stalled for longer than 5 seconds. Will shutdown."), "{}", stall.message);
        // a shutdown time below the warning time is ignored, saying so
        let mut inspector = StallInspector::new(StallSettings { enabled: true, warning: secs(5), shutdown: secs(2) });
        inspector.record_uncached("x", 0, secs(0));
        let stall = inspector.check(&[0, 1], secs(60)).unwrap();
        assert!(!stall.shut_down && stall.message.starts_with("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than"));
    }

    #[test]
    fn at_most_six_names_are_printed_and_then_dots() {
        let mut inspector = StallInspector::new(StallSettings { enabled: true, warning: secs(1), shutdown: secs(0) });
        for i in 0..8 {
            inspector.record_uncached(&format!("t{i}"), 0, secs(0));
        }
        let stall = inspector.check(&[0, 1], secs(5)).unwrap();
        assert!(stall.message.ends_with("1: [t0, t1, t2, t3, t4, t5 ...]"), "{}", stall.message);
    }

    #[test]
    fn checks_come_once_per_warning_interval_and_stalled_cached_names_are_found() {
        let mut inspector = StallInspector::new(StallSettings { enabled: true, warning: secs(2), shutdown: secs(0) });
        assert!(inspector.check_due(secs(3)));
        inspector.checked(secs(3));
        assert!(!inspector.check_due(secs(4)) && inspector.check_due(secs(6)));
        inspector.record_cached("c", secs(1));
        inspector.record_cached("c", secs(2));
        assert!(inspector.stalled_cached(secs(3)).is_empty());
        assert_eq!(inspector.stalled_cached(secs(4)), vec!["c".to_string()]);
        inspector.remove_cached("c");
        assert!(inspector.stalled_cached(secs(9)).is_empty());
    }
}
