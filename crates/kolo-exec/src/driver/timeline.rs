//! The job's timeline (`kolo run --timeline`, the Python Executor's
//! `job_timeline`): the workers record (their agents give each a file),
//! every host's clock is measured against this one's before they start,
//! and at shutdown what each sent is merged into one trace (kolo-timeline).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{Executor, Running};

/// Where the trace goes, and what writing it said.
pub(super) struct JobTimeline {
    file: PathBuf,
    said: Vec<String>,
}

impl Executor {
    /// Records the job's timeline: the workers started after this record
    /// their collectives, and `shutdown` writes every rank's on one trace
    /// to `file`; `timeline_report` then says where, or why not.
    pub fn record_timeline(&mut self, file: PathBuf) {
        self.timeline = Some(JobTimeline { file, said: Vec::new() });
    }

    /// After `shutdown`: lines for the user (the trace's file and how to
    /// read it, or what went wrong).
    pub fn timeline_report(&mut self) -> Vec<String> {
        self.timeline.as_mut().map(|t| std::mem::take(&mut t.said)).unwrap_or_default()
    }

    /// The workers' environment, with the variable that has them record.
    pub(super) fn with_timeline_env(&self, extra_env: &[(String, String)]) -> Vec<(String, String)> {
        let mut env = extra_env.to_vec();
        if self.timeline.is_some() {
            env.push((kolo_timeline::WANTED_VAR.to_string(), "1".to_string()));
        }
        env
    }

    /// Puts every worker's host clock against this one's (a worker that
    /// cannot say is drawn on its own clock, with a warning).
    pub(super) async fn measure_clocks(&self) {
        const PROBES: usize = 8;
        let Some(running) = self.running.as_ref().filter(|_| self.timeline.is_some()) else { return };
        let mut measuring = tokio::task::JoinSet::new();
        for link in &running.links {
            let link = link.clone();
            measuring.spawn(async move {
                match link.clock_offset(PROBES).await {
                    Ok(offset) => *kolo_sys::lock(&link.clock) = Some(offset),
                    Err(e) => tracing::warn!("the job's timeline shows {} on its own clock: {e}", link.describe()),
                }
            });
        }
        while measuring.join_next().await.is_some() {}
    }

    /// At shutdown, once the workers are gone: the trace, written.
    pub(super) fn write_timeline(&mut self, running: &Running) {
        let Some(timeline) = self.timeline.as_mut() else { return };
        let (ranks, mut said) = rank_timelines(running);
        let trace = kolo_timeline::job_trace(&ranks);
        match write_private(&timeline.file, &trace) {
            Err(e) => said.push(format!("cannot write the job's timeline to {}: {e}", timeline.file.display())),
            Ok(()) => {
                let collectives: usize = ranks.iter().map(|r| r.records.len()).sum();
                let aligned = match clock_uncertainty(running) {
                    Some(within) => format!(", clocks aligned to within {:.0} µs", within.as_secs_f64() * 1e6),
                    None => String::new(),
                };
                let file = timeline.file.display();
                said.push(format!(
                    "the job's timeline ({} ranks, {collectives} collectives{aligned}) is in {file}: open it in \
                     https://ui.perfetto.dev or summarize it with `kolo timeline {file}`",
                    ranks.len()
                ));
            }
        }
        timeline.said = said;
    }
}

/// The user's to share or not: private until they choose.
fn write_private(file: &Path, trace: &serde_json::Value) -> std::io::Result<()> {
    let mut out = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(file)?;
    let mut buffered = std::io::BufWriter::new(&mut out);
    serde_json::to_writer(&mut buffered, trace)?;
    buffered.flush()
}

/// What each rank recorded; ranks that sent nothing readable are named.
fn rank_timelines(running: &Running) -> (Vec<kolo_timeline::RankTimeline>, Vec<String>) {
    let (mut timelines, mut problems) = (Vec::new(), Vec::new());
    for link in &running.links {
        let bytes = std::mem::take(&mut *kolo_sys::lock(&link.timeline));
        if bytes.is_empty() {
            problems.push(format!("{} sent no timeline (it ended before it recorded one?)", link.describe()));
            continue;
        }
        match kolo_timeline::decode(&bytes) {
            Ok((records, dropped)) => timelines.push(kolo_timeline::RankTimeline {
                rank: link.info.rank,
                host: link.info.hostname.clone(),
                clock_offset_ns: kolo_sys::lock(&link.clock).map_or(0, |c| c.offset_ns),
                records,
                dropped,
            }),
            Err(e) => problems.push(format!("{}'s timeline is unreadable: {e}", link.describe())),
        }
    }
    (timelines, problems)
}

/// The worst clock measurement's half round trip: the trace is aligned
/// to within it.
fn clock_uncertainty(running: &Running) -> Option<Duration> {
    let worst = running.links.iter().filter_map(|l| *kolo_sys::lock(&l.clock)).map(|c| c.round_trip_ns).max()?;
    Some(Duration::from_nanos(worst.max(0) as u64 / 2))
}
