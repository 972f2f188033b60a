//! `kolo run --timeline FILE` (the job's trace, written at its end from
//! what every rank recorded) and `kolo timeline FILE` (its summary).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::{Context, Result};

use crate::out::tell;

/// Before the job starts: the trace's file can be made (a job that
/// trains for hours must not lose its timeline to a typo at the end).
pub(crate) fn check_writable(file: &Path) -> Result<()> {
    if file.is_dir() {
        anyhow::bail!("--timeline {}: is a directory; give a file name, such as job.json", file.display());
    }
    let dir = match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        anyhow::bail!("--timeline {}: directory {} does not exist; create it first", file.display(), dir.display());
    }
    can_write_in(dir)
        .with_context(|| format!("--timeline {}: cannot write in directory {}", file.display(), dir.display()))
}

fn can_write_in(dir: &Path) -> std::io::Result<()> {
    let probe = dir.join(format!(".kolo-timeline-probe-{}", std::process::id()));
    std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&probe)?;
    std::fs::remove_file(&probe)
}

/// Writes the job's trace from what the ranks sent, saying where and how
/// to read it; problems are said, never fatal to the job's own outcome.
pub(crate) fn write(file: &Path, executor: &kolo_exec::Executor) {
    let (ranks, problems) = executor.timelines();
    for problem in &problems {
        tell(&format!("kolo: timeline: {problem}"));
    }
    let trace = kolo_timeline::job_trace(&ranks);
    let written = (|| -> std::io::Result<()> {
        // the user's to share or not: private until they choose
        let mut out = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(file)?;
        serde_json::to_writer(std::io::BufWriter::new(&mut out), &trace)?;
        out.flush()
    })();
    match written {
        Err(e) => tell(&format!("kolo: cannot write the job's timeline to {}: {e}", file.display())),
        Ok(()) => {
            let collectives: usize = ranks.iter().map(|r| r.records.len()).sum();
            let aligned = match executor.clock_uncertainty() {
                Some(within) => format!(", clocks aligned to within {:.0} µs", within.as_secs_f64() * 1e6),
                None => String::new(),
            };
            tell(&format!(
                "kolo: the job's timeline ({} ranks, {collectives} collectives{aligned}) is in {}: open it in \
                 https://ui.perfetto.dev or summarize it with `kolo timeline {}`",
                ranks.len(),
                file.display(),
                file.display()
            ));
        }
    }
}

/// `kolo timeline FILE`.
pub(crate) fn summarize(file: &Path) -> Result<i32> {
    let text = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let trace: serde_json::Value = serde_json::from_slice(&text)
        .with_context(|| format!("{} is not JSON (a trace of kolo run --timeline is)", file.display()))?;
    let summary = kolo_timeline::Summary::of_trace(&trace).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    print!("{summary}");
    Ok(0)
}
