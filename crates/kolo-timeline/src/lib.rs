//! kolo-timeline: the job-wide timeline of `kolo run --timeline`.
//!
//! Each rank records every collective it takes part in (when it was
//! submitted, started and ended, on this host's clock) into a file its
//! agent names (`KOLO_TIMELINE_FILE`): fixed-size records in a shared
//! memory map, so recording costs no system call and what was recorded
//! survives the process, however it ends. The agent sends the file to the
//! driver when the rank's command ends; the driver aligns the hosts'
//! clocks and writes one Chrome-tracing trace of every rank
//! ([`job_trace`]), which `kolo timeline` summarizes ([`Summary`]).
//!
//! - `format`: the file's layout, written and read here alone
//! - `recorder`: the process's recorder and the per-thread rules of what
//!   is recorded (the outermost collective, not the steps inside it)
//! - `trace`: the merged trace and its summary (pure)

mod format;
mod recorder;
mod trace;

pub use format::{decode, recorded_len, used_bytes, Record, Source, HEADER_BYTES, RECORD_BYTES};
pub use recorder::{
    now_ns, quiet_on_this_thread, record_span, recording, with_submitted_at, Collective, Span, FILE_VAR,
};
pub use trace::{job_trace, RankTimeline, Summary};

/// The variable `kolo run --timeline` sets for every rank's command; the
/// rank's agent then gives it a file to record into.
pub const WANTED_VAR: &str = "KOLO_TIMELINE";

/// Before a job starts: its trace's file can be made (a job that trains
/// for hours must not lose its timeline to a typo at its end). The error
/// names the file and the fix.
pub fn check_trace_file(file: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    if file.is_dir() {
        return Err(format!("{}: is a directory; give a file name, such as job.json", file.display()));
    }
    let dir = match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    if !dir.is_dir() {
        return Err(format!("{}: directory {} does not exist; create it first", file.display(), dir.display()));
    }
    let probe = dir.join(format!(".kolo-timeline-probe-{}", std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&probe)
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|e| format!("{}: cannot write in directory {}: {e}", file.display(), dir.display()))
}
