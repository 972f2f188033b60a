//! The job's trace (Chrome's trace event format, which Perfetto and
//! chrome://tracing open): a process per rank, a track per source, a
//! slice per collective from its submission to its end, and inside it
//! the time the rank waited for the last rank to submit, named after
//! that rank. Then the summary `kolo timeline` prints, read back from
//! the trace alone.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde_json::{json, Value};

use crate::{Record, Source};

/// What one rank recorded, and how far its host's clock is off.
#[derive(Clone, Debug)]
pub struct RankTimeline {
    /// Its rank in the job.
    pub rank: u32,
    /// The host it ran on.
    pub host: String,
    /// Its host's clock minus the driver's (ns), as measured.
    pub clock_offset_ns: i64,
    /// Its collectives.
    pub records: Vec<Record>,
    /// Collectives it could not keep (its file was full).
    pub dropped: u64,
}

const COLLECTIVE: &str = "kolo.collective";
const WAIT: &str = "kolo.wait";

fn tid(source: Source) -> u64 {
    match source {
        Source::Comm => 1,
        Source::Horovod => 2,
    }
}

fn shown(r: &Record) -> String {
    match r.source {
        Source::Horovod if !r.name.is_empty() => r.name.clone(),
        _ => r.op.clone(),
    }
}

/// The job's trace, every rank's clock moved onto the driver's.
pub fn job_trace(ranks: &[RankTimeline]) -> Value {
    // (rank index, record), times on the driver's clock
    let mut all: Vec<(usize, Record)> = Vec::new();
    for (i, rank) in ranks.iter().enumerate() {
        for r in &rank.records {
            let mut r = r.clone();
            r.submitted_ns -= rank.clock_offset_ns;
            r.started_ns -= rank.clock_offset_ns;
            r.ended_ns -= rank.clock_offset_ns;
            // a clock that stepped mid-collective must not draw backwards
            r.started_ns = r.started_ns.max(r.submitted_ns);
            r.ended_ns = r.ended_ns.max(r.started_ns);
            all.push((i, r));
        }
    }
    let t0 = all.iter().map(|(_, r)| r.submitted_ns).min().unwrap_or(0);
    let us = |ns: i64| (ns - t0) as f64 / 1000.0;
    let mut groups: HashMap<(Source, (u64, u64)), Vec<usize>> = HashMap::new();
    for (at, (_, r)) in all.iter().enumerate() {
        groups.entry((r.source, r.key)).or_default().push(at);
    }
    let mut events = Vec::new();
    for (i, rank) in ranks.iter().enumerate() {
        let label = format!("rank {} ({})", rank.rank, rank.host);
        events.push(
            json!({"ph": "M", "name": "process_name", "pid": rank.rank, "args": {"name": label, "host": rank.host}}),
        );
        events.push(
            json!({"ph": "M", "name": "process_sort_index", "pid": rank.rank, "args": {"sort_index": rank.rank}}),
        );
        let mut sources: Vec<Source> = all.iter().filter(|(j, _)| *j == i).map(|(_, r)| r.source).collect();
        sources.sort();
        sources.dedup();
        for source in sources {
            events.push(json!({"ph": "M", "name": "thread_name", "pid": rank.rank, "tid": tid(source),
                "args": {"name": source.name()}}));
        }
    }
    let mut keys: Vec<_> = groups.keys().copied().collect();
    keys.sort();
    for group_key in keys {
        let members = &groups[&group_key];
        let last =
            *members.iter().max_by_key(|&&at| (all[at].1.submitted_ns, ranks[all[at].0].rank)).expect("a member");
        let last_rank = ranks[all[last].0].rank;
        let last_submitted = all[last].1.submitted_ns;
        for &at in members {
            let (i, r) = &all[at];
            let pid = ranks[*i].rank;
            let waited = (last_submitted - r.submitted_ns).clamp(0, r.ended_ns - r.submitted_ns);
            let name = shown(r);
            let key = format!("{}:{}:{}", r.source.name(), r.key.0, r.key.1);
            events.push(json!({
                "ph": "X", "cat": COLLECTIVE, "name": name, "pid": pid, "tid": tid(r.source),
                "ts": us(r.submitted_ns), "dur": (r.ended_ns - r.submitted_ns) as f64 / 1000.0,
                "args": {"key": key, "op": r.op, "bytes": r.bytes, "ranks": members.len(),
                         "started_us": us(r.started_ns), "last_rank": last_rank,
                         "waited_us": waited as f64 / 1000.0, "failed": r.failed},
            }));
            if waited > 0 && members.len() > 1 {
                events.push(json!({
                    "ph": "X", "cat": WAIT, "name": format!("waiting for rank {last_rank}"), "pid": pid,
                    "tid": tid(r.source), "ts": us(r.submitted_ns), "dur": waited as f64 / 1000.0,
                    "args": {"collective": name},
                }));
            }
        }
    }
    let dropped: BTreeMap<String, u64> =
        ranks.iter().filter(|r| r.dropped > 0).map(|r| (r.rank.to_string(), r.dropped)).collect();
    let offsets: BTreeMap<String, i64> = ranks.iter().map(|r| (r.rank.to_string(), r.clock_offset_ns)).collect();
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"kolo": {"ranks": ranks.len(), "dropped": dropped, "clock_offsets_ns": offsets}},
    })
}

/// A collective (by name, or by op and size) and what its calls cost.
#[derive(Clone, Debug, PartialEq)]
struct Costly {
    what: String,
    calls: usize,
    /// From the first rank's submission to the last rank's end, summed.
    total_us: f64,
    /// What the ranks that were not last waited, summed.
    waiting_us: f64,
}

/// A rank the others waited for.
#[derive(Clone, Debug, PartialEq)]
struct Straggler {
    rank: u64,
    host: String,
    last_in: usize,
    /// What the others waited for it, summed.
    caused_us: f64,
}

/// What `kolo timeline` prints first: the collectives that cost most, and
/// the ranks that made the others wait most.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    ranks: usize,
    collectives: usize,
    shared: usize,
    span_us: f64,
    dropped: u64,
    costly: Vec<Costly>,
    stragglers: Vec<Straggler>,
}

struct Call {
    what: String,
    first_us: f64,
    end_us: f64,
    waiting_us: f64,
    last_rank: u64,
    members: usize,
}

impl Summary {
    /// Reads a trace [`job_trace`] wrote; an error says what is missing.
    pub fn of_trace(trace: &Value) -> Result<Summary, String> {
        let events = trace
            .get("traceEvents")
            .and_then(Value::as_array)
            .ok_or("not a trace: it has no traceEvents array (was it written by kolo run --timeline?)")?;
        let mut hosts: BTreeMap<u64, String> = BTreeMap::new();
        let mut calls: HashMap<String, Call> = HashMap::new();
        let mut span = (f64::MAX, f64::MIN);
        for e in events {
            let field = |name: &str| e.get(name).and_then(Value::as_f64);
            if e.get("ph") == Some(&json!("M")) && e.get("name") == Some(&json!("process_name")) {
                let host = e["args"].get("host").and_then(Value::as_str).unwrap_or("?");
                hosts.insert(e.get("pid").and_then(Value::as_u64).unwrap_or(0), host.to_string());
            }
            if e.get("cat").and_then(Value::as_str) != Some(COLLECTIVE) {
                continue;
            }
            let bad = || format!("a collective's event lacks a field kolo writes: {e}");
            let (ts, dur) = (field("ts").ok_or_else(bad)?, field("dur").ok_or_else(bad)?);
            let args = e.get("args").ok_or_else(bad)?;
            let key = args.get("key").and_then(Value::as_str).ok_or_else(bad)?;
            let waited = args.get("waited_us").and_then(Value::as_f64).ok_or_else(bad)?;
            let last_rank = args.get("last_rank").and_then(Value::as_u64).ok_or_else(bad)?;
            let name = e.get("name").and_then(Value::as_str).ok_or_else(bad)?;
            let size = args.get("bytes").and_then(Value::as_u64).unwrap_or(0);
            let what = if key.starts_with("horovod:") || size == 0 {
                name.to_string()
            } else {
                format!("{name} of {}", bytes(size))
            };
            span = (span.0.min(ts), span.1.max(ts + dur));
            let call = calls.entry(key.to_string()).or_insert(Call {
                what,
                first_us: ts,
                end_us: ts + dur,
                waiting_us: 0.0,
                last_rank,
                members: 0,
            });
            call.first_us = call.first_us.min(ts);
            call.end_us = call.end_us.max(ts + dur);
            call.waiting_us += waited;
            call.members += 1;
        }
        let mut costly: BTreeMap<String, Costly> = BTreeMap::new();
        let mut stragglers: BTreeMap<u64, Straggler> = BTreeMap::new();
        let mut shared = 0;
        for call in calls.values() {
            let c = costly.entry(call.what.clone()).or_insert(Costly {
                what: call.what.clone(),
                calls: 0,
                total_us: 0.0,
                waiting_us: 0.0,
            });
            c.calls += 1;
            c.total_us += call.end_us - call.first_us;
            c.waiting_us += call.waiting_us;
            if call.members > 1 {
                shared += 1;
                if call.waiting_us > 0.0 {
                    let s = stragglers.entry(call.last_rank).or_insert(Straggler {
                        rank: call.last_rank,
                        host: hosts.get(&call.last_rank).cloned().unwrap_or_else(|| "?".into()),
                        last_in: 0,
                        caused_us: 0.0,
                    });
                    s.last_in += 1;
                    s.caused_us += call.waiting_us;
                }
            }
        }
        let mut costly: Vec<Costly> = costly.into_values().collect();
        costly.sort_by(|a, b| b.total_us.total_cmp(&a.total_us).then(a.what.cmp(&b.what)));
        let mut stragglers: Vec<Straggler> = stragglers.into_values().collect();
        stragglers.sort_by(|a, b| b.caused_us.total_cmp(&a.caused_us).then(a.rank.cmp(&b.rank)));
        let dropped = trace
            .pointer("/otherData/kolo/dropped")
            .and_then(Value::as_object)
            .map(|d| d.values().filter_map(Value::as_u64).sum())
            .unwrap_or(0);
        Ok(Summary {
            ranks: hosts.len(),
            collectives: calls.len(),
            shared,
            span_us: if calls.is_empty() { 0.0 } else { span.1 - span.0 },
            dropped,
            costly,
            stragglers,
        })
    }

    /// The rank the others waited for most, if any waited.
    pub fn worst_straggler(&self) -> Option<u64> {
        self.stragglers.first().map(|s| s.rank)
    }
}

fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

fn duration(us: f64) -> String {
    if us >= 1e6 {
        format!("{:.3} s", us / 1e6)
    } else if us >= 1e3 {
        format!("{:.1} ms", us / 1e3)
    } else {
        format!("{us:.0} µs")
    }
}

/// How many lines of each table are printed.
const SHOWN: usize = 10;

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} ranks, {} collectives over {} of trace", self.ranks, self.collectives, duration(self.span_us))?;
        if self.dropped > 0 {
            writeln!(f, "({} collectives were not recorded: the ranks' timeline files were full)", self.dropped)?;
        }
        if self.costly.is_empty() {
            return writeln!(f, "no collective was recorded");
        }
        writeln!(f, "\nThe collectives that cost most (first rank's submission to last rank's end, all calls):")?;
        writeln!(f, "{:>11} {:>7} {:>10} {:>11}  collective", "total", "calls", "mean", "waiting")?;
        for c in self.costly.iter().take(SHOWN) {
            writeln!(
                f,
                "{:>11} {:>7} {:>10} {:>11}  {}",
                duration(c.total_us),
                c.calls,
                duration(c.total_us / c.calls as f64),
                duration(c.waiting_us),
                c.what
            )?;
        }
        writeln!(f, "\nThe ranks the others waited for (the last to submit):")?;
        if self.stragglers.is_empty() {
            return writeln!(f, "  none: no rank waited for another");
        }
        for s in self.stragglers.iter().take(SHOWN) {
            writeln!(
                f,
                "  rank {} on {}: last in {} of {} collectives; the others waited {} for it in all",
                s.rank,
                s.host,
                s.last_in,
                self.shared,
                duration(s.caused_us)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(source: Source, seq: u64, submitted_ms: i64, ended_ms: i64) -> Record {
        Record {
            source,
            op: "allreduce".into(),
            name: if source == Source::Horovod { "allreduce.grad".into() } else { String::new() },
            key: (1, seq),
            bytes: 4096,
            submitted_ns: submitted_ms * 1_000_000,
            started_ns: submitted_ms * 1_000_000,
            ended_ns: ended_ms * 1_000_000,
            failed: false,
        }
    }

    fn rank(rank: u32, offset_ms: i64, records: Vec<Record>) -> RankTimeline {
        RankTimeline { rank, host: format!("h{rank}"), clock_offset_ns: offset_ms * 1_000_000, records, dropped: 0 }
    }

    /// Three ranks, rank 2 late to every collective by 30 ms; rank 1's
    /// clock runs 500 ms ahead, which the offset takes back.
    fn late_rank_two() -> Vec<RankTimeline> {
        let mut ranks = Vec::new();
        for r in 0..3u32 {
            let (late, offset) = match r {
                2 => (30, 0),
                1 => (0, 500),
                _ => (0, 0),
            };
            let records = (0..4)
                .map(|seq| {
                    let t = 100 * seq as i64 + late + offset;
                    rec(Source::Horovod, seq, t, 100 * seq as i64 + 35 + offset)
                })
                .collect();
            ranks.push(rank(r, offset, records));
        }
        ranks
    }

    fn events<'a>(trace: &'a Value, cat: &str) -> Vec<&'a Value> {
        trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["cat"] == cat).collect()
    }

    #[test]
    fn each_rank_is_a_process_and_its_waits_name_the_last_rank_on_one_clock() {
        let trace = job_trace(&late_rank_two());
        let meta: Vec<_> = trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "M").collect();
        assert!(meta.iter().any(|e| e["name"] == "process_name" && e["args"]["name"] == "rank 1 (h1)"));
        assert!(meta.iter().any(|e| e["name"] == "thread_name" && e["args"]["name"] == "horovod"));
        let collectives = events(&trace, COLLECTIVE);
        assert_eq!(collectives.len(), 12);
        assert!(collectives.iter().all(|e| e["args"]["last_rank"] == 2), "{collectives:?}");
        // rank 1's slices start where rank 0's do, its clock offset taken out
        let first_of = |pid: u64| collectives.iter().find(|e| e["pid"] == pid).unwrap()["ts"].as_f64().unwrap();
        assert_eq!(first_of(0), 0.0);
        assert_eq!(first_of(1), 0.0);
        assert_eq!(first_of(2), 30_000.0);
        let waits = events(&trace, WAIT);
        assert_eq!(waits.len(), 8, "ranks 0 and 1 wait in each of the 4");
        assert!(waits.iter().all(|e| e["name"] == "waiting for rank 2" && e["dur"] == 30_000.0));
    }

    #[test]
    fn the_summary_names_the_rank_the_others_waited_for_and_the_costliest_collective() {
        let mut ranks = late_rank_two();
        for r in &mut ranks {
            // a cheap collective of another source each rank makes at once
            let at = r.clock_offset_ns / 1_000_000 + 1000;
            r.records.push(rec(Source::Comm, 9, at, at + 1));
        }
        let summary = Summary::of_trace(&job_trace(&ranks)).unwrap();
        assert_eq!(summary.worst_straggler(), Some(2));
        let text = summary.to_string();
        assert!(text.starts_with("3 ranks, 5 collectives over 1.001 s of trace"), "{text}");
        assert!(
            text.contains("rank 2 on h2: last in 4 of 5 collectives; the others waited 240.0 ms for it in all"),
            "{text}"
        );
        let rows: Vec<&str> = text.lines().skip_while(|l| !l.ends_with("  collective")).skip(1).take(2).collect();
        assert!(rows[0].ends_with("allreduce.grad") && rows[0].contains("140.0 ms"), "{text}");
        assert!(rows[1].ends_with("allreduce of 4.0 KiB"), "{text}");
    }

    #[test]
    fn ranks_that_submit_together_wait_for_nobody() {
        let ranks: Vec<_> = (0..2).map(|r| rank(r, 0, vec![rec(Source::Comm, 0, 10, 20)])).collect();
        let trace = job_trace(&ranks);
        assert!(events(&trace, WAIT).is_empty());
        let text = Summary::of_trace(&trace).unwrap().to_string();
        assert!(text.contains("none: no rank waited for another"), "{text}");
    }

    #[test]
    fn a_wait_never_outlasts_the_collective_and_nothing_draws_backwards() {
        // rank 1 submitted after rank 0 had ended (a clock stepped): rank
        // 0's wait is cut at its end; started before submitted is moved
        let mut early = rec(Source::Comm, 0, 10, 12);
        early.started_ns = 5_000_000;
        let ranks = vec![rank(0, 0, vec![early]), rank(1, 0, vec![rec(Source::Comm, 0, 50, 60)])];
        let trace = job_trace(&ranks);
        let waits = events(&trace, WAIT);
        assert_eq!(waits.len(), 1);
        assert_eq!(waits[0]["dur"], 2_000.0);
        let c = events(&trace, COLLECTIVE);
        assert!(c.iter().all(|e| e["args"]["started_us"].as_f64().unwrap() >= e["ts"].as_f64().unwrap()));
    }

    #[test]
    fn an_empty_job_and_a_file_that_is_no_trace_are_said_plainly() {
        let text = Summary::of_trace(&job_trace(&[rank(0, 0, vec![])])).unwrap().to_string();
        assert!(text.contains("no collective was recorded"), "{text}");
        let err = Summary::of_trace(&json!({"a": 1})).unwrap_err();
        assert!(err.contains("no traceEvents"), "{err}");
        let err = Summary::of_trace(&json!({"traceEvents": [{"cat": COLLECTIVE, "ts": 1}]})).unwrap_err();
        assert!(err.contains("lacks a field"), "{err}");
    }
}
