//! Telling a hung job from a slow one, and naming who holds it back: pure
//! logic over what the agents sample (collectives entered and done, steps,
//! the age of each rank's last output line), no I/O.

use std::time::{Duration, Instant};

use kolo_proto::proto::Progress;

/// One rank as a look at the job saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct RankView {
    /// The rank's world rank.
    pub rank: u32,
    /// Its host, for naming it.
    pub host: String,
    /// What its Python hook counted; none where it has no hook (not
    /// Python, hooks off) or its agent did not answer.
    pub progress: Option<Progress>,
    /// Since its last line of output or reported value.
    pub since_output: Duration,
    /// Its CPU use over the agent's last second, where known.
    pub cpu_percent: Option<f64>,
    /// Its command ended: it holds nobody back by running.
    pub ended: bool,
    /// Its Horovod core's last stall warning (the coordinator's: it names
    /// the tensors and the ranks that have not submitted them).
    pub stall: Option<String>,
}

/// Watches for a job in which nothing moves: no rank completes a
/// collective or a step or writes a line for `timeout`.
pub struct HangWatch {
    timeout: Duration,
    last_move: Instant,
    last_look: Instant,
    seen: Vec<Option<(u64, u64, u64)>>,
}

/// CPU % above which a rank that counts nothing is taken to be working.
const BUSY: f64 = 5.0;

fn key(p: &Progress) -> (u64, u64, u64) {
    (p.entered, p.done, p.steps)
}

impl HangWatch {
    /// A watch that calls the job hung after `timeout` without a move,
    /// counted from `now`.
    pub fn new(timeout: Duration, now: Instant) -> HangWatch {
        HangWatch { timeout, last_move: now, last_look: now, seen: Vec::new() }
    }

    /// Takes a look; once nothing has moved for the timeout, how long.
    pub fn observe(&mut self, ranks: &[RankView], now: Instant) -> Option<Duration> {
        let window = now.saturating_duration_since(self.last_look);
        let keys: Vec<Option<(u64, u64, u64)>> = ranks.iter().map(|r| r.progress.as_ref().map(key)).collect();
        let counted = keys.len() != self.seen.len() || keys.iter().zip(&self.seen).any(|(k, seen)| k != seen);
        let wrote = ranks.iter().any(|r| !r.ended && r.since_output < window);
        // a rank that counts nothing yet (importing torch on a loaded
        // machine, or not Python) moves while it computes; once it counts,
        // only its counts do (a collective may spin while it hangs)
        let busy = ranks.iter().any(|r| !r.ended && r.progress.is_none() && r.cpu_percent.is_some_and(|c| c >= BUSY));
        if counted || wrote || busy {
            self.last_move = now;
        }
        self.seen = keys;
        self.last_look = now;
        let still = now.saturating_duration_since(self.last_move);
        (still >= self.timeout).then_some(still)
    }
}

fn who(ranks: &[&RankView]) -> String {
    let ids: Vec<String> = ranks.iter().map(|r| r.rank.to_string()).collect();
    let mut hosts: Vec<&str> = ranks.iter().map(|r| r.host.as_str()).collect();
    hosts.dedup();
    match ranks {
        [one] => format!("rank {} (host {})", one.rank, one.host),
        _ => format!("ranks {} (hosts {})", ids.join(","), hosts.join(",")),
    }
}

/// The hang report's first line: that the job hung, and who holds it
/// back; then the stall warnings of the ranks' Horovod cores.
pub fn explain(ranks: &[RankView], still: Duration) -> String {
    let mut text = who_holds_back(ranks, still);
    for r in ranks.iter().filter(|r| !r.ended) {
        if let Some(stall) = &r.stall {
            text.push_str(&format!("\nHorovod's stall inspector on rank {}: {stall}", r.rank));
        }
    }
    text
}

fn who_holds_back(ranks: &[RankView], still: Duration) -> String {
    let running: Vec<&RankView> = ranks.iter().filter(|r| !r.ended).collect();
    let waiting: Vec<&RankView> =
        running.iter().copied().filter(|r| r.progress.is_some_and(|p| p.entered > p.done)).collect();
    let secs = still.as_secs_f64();
    if waiting.is_empty() {
        return format!("the job hung: no rank made progress (a collective, a step, a line of output) for {secs:.0} s");
    }
    let newest = waiting.iter().filter_map(|r| r.progress.map(|p| p.entered)).max().unwrap_or(0);
    let behind: Vec<&RankView> = running
        .iter()
        .copied()
        .filter(|r| r.progress.is_some_and(|p| p.entered == p.done && p.entered < newest))
        .collect();
    if !behind.is_empty() {
        let verb = if behind.len() == 1 { "is" } else { "are" };
        let done: Vec<u64> = behind.iter().filter_map(|r| r.progress.map(|p| p.done)).collect();
        let others = waiting.len();
        let plural = if others == 1 { "rank waits" } else { "ranks wait" };
        return format!(
            "the job hung: {} {verb} not in the collective the other {others} {plural} in (their collective #{newest}; \
             done: {}), for {secs:.0} s",
            who(&behind),
            done.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
        );
    }
    let mut by_call: Vec<(u64, Vec<&RankView>)> = Vec::new();
    for r in &waiting {
        let entered = r.progress.map_or(0, |p| p.entered);
        match by_call.iter_mut().find(|(e, _)| *e == entered) {
            Some((_, members)) => members.push(r),
            None => by_call.push((entered, vec![r])),
        }
    }
    if by_call.len() > 1 {
        by_call.sort_by_key(|(e, _)| *e);
        let parts: Vec<String> =
            by_call.iter().map(|(e, members)| format!("{} in collective #{e}", who(members))).collect();
        return format!("the job hung: ranks wait in different collectives ({}) for {secs:.0} s", parts.join("; "));
    }
    format!(
        "the job hung: every rank waits in collective #{newest} and none came out for {secs:.0} s (a peer that never \
         sends: see the stacks)"
    )
}

/// Ranks that wait markedly less in collectives than the others do, from
/// `(rank, share of time waiting)`: the ones the others wait for. Under
/// half the median of the rest, where the rest wait a tenth of their time
/// or more.
pub fn stragglers(waits: &[(u32, f64)]) -> Vec<u32> {
    if waits.len() < 2 {
        return Vec::new();
    }
    waits
        .iter()
        .filter(|(rank, wait)| {
            let mut others: Vec<f64> = waits.iter().filter(|(r, _)| r != rank).map(|(_, w)| *w).collect();
            others.sort_by(f64::total_cmp);
            let median = others[others.len() / 2];
            median >= 0.1 && *wait < median / 2.0
        })
        .map(|(rank, _)| *rank)
        .collect()
}

/// Which rank the others waited for, window after window (for the line a
/// job prints at its end when one rank was persistently the slowest).
#[derive(Default)]
pub struct StragglerTally {
    last: Option<Vec<Option<u64>>>,
    windows: u32,
    slowest: std::collections::BTreeMap<u32, u32>,
    /// Per rank, the share of the windows' time it waited in collectives.
    waited: std::collections::BTreeMap<u32, (f64, u32)>,
}

impl StragglerTally {
    /// Takes the ranks' progress at the end of a window of `length`.
    pub fn window(&mut self, ranks: &[RankView], length: Duration) {
        let now: Vec<Option<u64>> = ranks.iter().map(|r| r.progress.map(|p| p.wait_ns)).collect();
        let Some(last) = self.last.replace(now.clone()) else { return };
        if last.len() != now.len() || length.is_zero() {
            return;
        }
        let shares: Vec<(u32, f64)> = ranks
            .iter()
            .zip(now.iter().zip(&last))
            .filter_map(|(r, (n, l))| {
                Some((r.rank, n.as_ref()?.saturating_sub(*l.as_ref()?) as f64 / length.as_nanos() as f64))
            })
            .collect();
        if shares.len() < 2 {
            return;
        }
        self.windows += 1;
        for (rank, share) in &shares {
            let entry = self.waited.entry(*rank).or_default();
            entry.0 += share;
            entry.1 += 1;
        }
        // the one waited for most: the straggler that waited least
        let (rank, _) = shares.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1)).expect("two or more");
        if stragglers(&shares).contains(&rank) {
            *self.slowest.entry(rank).or_default() += 1;
        }
    }

    /// The line to print, when one rank was the one waited for in at
    /// least three quarters of three or more windows.
    pub fn summary(&self) -> Option<String> {
        if self.windows < 3 {
            return None;
        }
        let (rank, times) = self.slowest.iter().max_by_key(|(_, n)| **n)?;
        let share = f64::from(*times) / f64::from(self.windows);
        if share < 0.75 {
            return None;
        }
        let mean = |r: &u32| self.waited.get(r).map_or(0.0, |(sum, n)| sum / f64::from((*n).max(1)));
        let others: Vec<f64> = self.waited.keys().filter(|r| *r != rank).map(mean).collect();
        let others = others.iter().sum::<f64>() / others.len().max(1) as f64;
        Some(format!(
            "rank {rank} was the slowest in {:.0}% of the job's windows: it waited {:.0}% of the time in \
             collectives, the others {:.0}% (waiting for it)",
            share * 100.0,
            mean(rank) * 100.0,
            others * 100.0
        ))
    }
}

/// Ranks grouped by identical stacks: the smallest groups (the ranks
/// that differ) first.
pub fn merged_stacks(ranks: &[serde_json::Value]) -> String {
    let mut groups: Vec<(String, Vec<(u64, String)>)> = Vec::new();
    for r in ranks {
        let stacks = r["stacks"].as_str().unwrap_or("").to_string();
        let who = (r["rank"].as_u64().unwrap_or(0), r["host"].as_str().unwrap_or("?").to_string());
        match groups.iter_mut().find(|(s, _)| *s == stacks) {
            Some((_, members)) => members.push(who),
            None => groups.push((stacks, vec![who])),
        }
    }
    groups.sort_by_key(|(_, members)| (members.len(), members[0].0));
    let mut out = String::new();
    for (stacks, members) in groups {
        let ids: Vec<String> = members.iter().map(|(r, _)| r.to_string()).collect();
        let mut hosts: Vec<&str> = members.iter().map(|(_, h)| h.as_str()).collect();
        hosts.dedup();
        let noun = if members.len() == 1 { "rank" } else { "ranks" };
        out.push_str(&format!("{noun} {} (host {}):\n", ids.join(","), hosts.join(",")));
        for line in stacks.lines() {
            out.push_str(&format!("  {line}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_stacks_merge_and_the_odd_rank_comes_first() {
        let rank = |r: u64, stacks: &str| serde_json::json!({"rank": r, "host": "h", "stacks": stacks});
        let text = merged_stacks(&[rank(0, "A\n"), rank(1, "A\n"), rank(2, "B\n"), rank(3, "A\n")]);
        assert_eq!(text, "rank 2 (host h):\n  B\nranks 0,1,3 (host h):\n  A\n");
    }

    fn rank(rank: u32, entered: u64, done: u64) -> RankView {
        RankView {
            rank,
            host: format!("h{rank}"),
            progress: Some(Progress { entered, done, wait_ns: 0, steps: 0 }),
            since_output: Duration::from_secs(100),
            cpu_percent: Some(0.0),
            ended: false,
            stall: None,
        }
    }

    #[test]
    fn the_rank_outside_the_collective_the_others_wait_in_is_named() {
        let ranks = [rank(0, 5, 4), rank(1, 5, 4), rank(2, 4, 4), rank(3, 5, 4)];
        let line = explain(&ranks, Duration::from_secs(8));
        assert!(
            line.starts_with("the job hung: rank 2 (host h2) is not in the collective the other 3 ranks wait in"),
            "{line}"
        );
        assert!(line.contains("their collective #5"), "{line}");
    }

    #[test]
    fn several_behind_ranks_and_mismatched_collectives_are_told_apart() {
        let line = explain(&[rank(0, 3, 2), rank(1, 2, 2), rank(2, 2, 2)], Duration::from_secs(9));
        assert!(line.contains("ranks 1,2 (hosts h1,h2) are not in the collective the other 1 rank waits in"), "{line}");
        let line = explain(&[rank(0, 3, 2), rank(1, 4, 3)], Duration::from_secs(9));
        assert!(line.contains("different collectives (rank 0 (host h0) in collective #3; rank 1 (host h1)"), "{line}");
        let line = explain(&[rank(0, 3, 2), rank(1, 3, 2)], Duration::from_secs(9));
        assert!(line.contains("every rank waits in collective #3"), "{line}");
        let mut quiet = rank(0, 0, 0);
        quiet.progress = None;
        assert!(explain(&[quiet], Duration::from_secs(9)).contains("no rank made progress"));
    }

    #[test]
    fn the_stall_warning_of_a_horovod_core_follows_the_first_line() {
        let mut coordinator = rank(0, 3, 2);
        coordinator.stall = Some("One or more tensors were submitted...\nMissing ranks:\n1: [allreduce.w]".into());
        let text = explain(&[coordinator, rank(1, 2, 2)], Duration::from_secs(9));
        let (first, rest) = text.split_once('\n').expect("two parts");
        assert!(first.contains("rank 1 (host h1) is not in the collective"), "{text}");
        assert!(rest.starts_with("Horovod's stall inspector on rank 0: One or more"), "{text}");
        assert!(rest.ends_with("1: [allreduce.w]"), "{text}");
    }

    fn waited(rank: u32, wait_ms: u64) -> RankView {
        let mut r = super::tests::rank(rank, 0, 0);
        r.progress = Some(Progress { entered: 0, done: 0, wait_ns: wait_ms * 1_000_000, steps: 0 });
        r
    }

    #[test]
    fn a_rank_the_others_wait_for_window_after_window_is_summed_up() {
        let mut tally = StragglerTally::default();
        let window = Duration::from_secs(1);
        let mut totals = [0u64; 3];
        for _ in 0..5 {
            // each second ranks 0 and 2 wait 500 ms for rank 1, which waits 20
            totals[0] += 500;
            totals[1] += 20;
            totals[2] += 500;
            tally.window(&[waited(0, totals[0]), waited(1, totals[1]), waited(2, totals[2])], window);
        }
        let line = tally.summary().expect("a summary");
        assert!(line.starts_with("rank 1 was the slowest in 100% of the job's windows: it waited 2%"), "{line}");
        // balanced ranks: nothing to say
        let mut even = StragglerTally::default();
        for i in 1..6 {
            even.window(&[waited(0, i * 300), waited(1, i * 310)], window);
        }
        assert_eq!(even.summary(), None);
    }

    #[test]
    fn a_job_is_hung_only_after_nothing_moved_for_the_timeout() {
        let start = Instant::now();
        let mut watch = HangWatch::new(Duration::from_secs(8), start);
        let at = |s: u64| start + Duration::from_secs(s);
        let mut ranks = vec![rank(0, 1, 1), rank(1, 1, 1)];
        assert_eq!(watch.observe(&ranks, at(1)), None);
        // a collective done at 5 s: the clock starts again
        ranks[1] = rank(1, 2, 2);
        assert_eq!(watch.observe(&ranks, at(5)), None);
        assert_eq!(watch.observe(&ranks, at(12)), None);
        // a line of output at 12.5 s counts too
        ranks[0].since_output = Duration::from_millis(500);
        assert_eq!(watch.observe(&ranks, at(13)), None);
        ranks[0].since_output = Duration::from_secs(100);
        assert_eq!(watch.observe(&ranks, at(20)), None);
        assert_eq!(watch.observe(&ranks, at(21)), Some(Duration::from_secs(8)));
        // a rank still starting (no counts yet) that computes holds the clock
        let mut starting = HangWatch::new(Duration::from_secs(8), start);
        let mut busy = rank(0, 0, 0);
        busy.progress = None;
        busy.cpu_percent = Some(90.0);
        assert_eq!(starting.observe(&[busy.clone()], at(30)), None);
        busy.cpu_percent = Some(0.0);
        assert_eq!(starting.observe(&[busy.clone()], at(37)), None);
        assert_eq!(starting.observe(&[busy.clone()], at(38)), Some(Duration::from_secs(8)));
        // one that counts does not, however it spins
        let mut spinning = rank(0, 3, 2);
        spinning.cpu_percent = Some(100.0);
        let mut counted = HangWatch::new(Duration::from_secs(8), start);
        assert_eq!(counted.observe(&[spinning.clone()], at(1)), None);
        assert_eq!(counted.observe(&[spinning], at(9)), Some(Duration::from_secs(8)));
    }
}
