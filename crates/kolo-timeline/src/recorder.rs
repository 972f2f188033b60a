//! The process's recorder: on when the rank's agent named a file
//! (`KOLO_TIMELINE_FILE`), else a single check per collective.
//!
//! What a thread records: the outermost collective only (a hierarchical
//! allreduce runs others inside it), nothing on a thread that records
//! its own way (Horovod's background thread records tensors, not the
//! fused collectives it runs), and the caller's submission time where the
//! collective runs later on another thread (the torch backend's queue).

use std::cell::Cell;
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use memmap2::MmapMut;

use crate::format::{encode, header, set_counts, HEADER_BYTES, RECORD_BYTES};
use crate::Source;

/// The variable naming the file a rank records into (set by its agent).
pub const FILE_VAR: &str = "KOLO_TIMELINE_FILE";

/// Records a rank keeps (about 38 MiB of file, only as much written as
/// used); later ones are counted as dropped.
const CAPACITY: u32 = 200_000;

/// One collective, as recorded.
#[derive(Clone, Copy, Debug)]
pub struct Span<'a> {
    /// Who records it.
    pub source: Source,
    /// `allreduce`, `broadcast`...
    pub op: &'a str,
    /// Horovod's tensor name, or empty.
    pub name: &'a str,
    /// The same on every rank for the same collective.
    pub key: (u64, u64),
    /// This rank's bytes in.
    pub bytes: u64,
    /// When it was asked for ([`now_ns`]).
    pub submitted_ns: i64,
    /// When this rank began it.
    pub started_ns: i64,
    /// When it ended here.
    pub ended_ns: i64,
    /// It ended in an error.
    pub failed: bool,
}

struct Writer {
    map: MmapMut,
    capacity: usize,
    count: usize,
    dropped: u64,
}

struct Recorder(Mutex<Writer>);

static RECORDER: OnceLock<Option<Recorder>> = OnceLock::new();

fn recorder() -> Option<&'static Recorder> {
    RECORDER.get_or_init(|| std::env::var_os(FILE_VAR).filter(|p| !p.is_empty()).and_then(open)).as_ref()
}

fn open(path: std::ffi::OsString) -> Option<Recorder> {
    let made = (|| -> std::io::Result<MmapMut> {
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).mode(0o600).open(&path)?;
        file.set_len((HEADER_BYTES + CAPACITY as usize * RECORD_BYTES) as u64)?;
        // SAFETY: the file is this process's own (its agent made the
        // directory private and names a fresh path per command); nothing
        // else writes it while the map lives, and the agent reads it only
        // once the process has ended
        let mut map = unsafe { MmapMut::map_mut(&file)? };
        map[..HEADER_BYTES].copy_from_slice(&header(CAPACITY));
        Ok(map)
    })();
    match made {
        Ok(map) => Some(Recorder(Mutex::new(Writer { map, capacity: CAPACITY as usize, count: 0, dropped: 0 }))),
        Err(e) => {
            eprintln!("kolo: cannot record this rank's timeline in {}: {e}", path.to_string_lossy());
            None
        }
    }
}

/// Whether this process records its collectives.
pub fn recording() -> bool {
    recorder().is_some()
}

/// Now, on this host's clock, in ns since the epoch (what records hold).
pub fn now_ns() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as i64).unwrap_or(0)
}

fn record(span: &Span<'_>) {
    let Some(Recorder(writer)) = recorder() else { return };
    let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
    if w.count == w.capacity {
        w.dropped += 1;
    } else {
        let at = HEADER_BYTES + w.count * RECORD_BYTES;
        encode(span, &mut w.map[at..at + RECORD_BYTES]);
        w.count += 1;
    }
    let (count, dropped) = (w.count as u64, w.dropped);
    set_counts(&mut w.map[..HEADER_BYTES], count, dropped);
}

thread_local! {
    /// Collectives this thread is inside (only the outermost is recorded).
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// This thread records its own way: its communicators' collectives not.
    static QUIET: Cell<bool> = const { Cell::new(false) };
    /// When the caller asked for the collective this thread runs next.
    static SUBMITTED: Cell<Option<i64>> = const { Cell::new(None) };
}

/// This thread's communicator collectives are not recorded (Horovod's
/// background thread records each tensor instead).
pub fn quiet_on_this_thread() {
    QUIET.with(|q| q.set(true));
}

/// Runs `f`, whose first collective was asked for at `submitted_ns`
/// (by a caller on another thread), so that its wait shows from then.
pub fn with_submitted_at<R>(submitted_ns: i64, f: impl FnOnce() -> R) -> R {
    let before = SUBMITTED.with(|s| s.replace(recording().then_some(submitted_ns)));
    let out = f();
    SUBMITTED.with(|s| s.set(before));
    out
}

/// A communicator's collective in progress: recorded when it ends (failed
/// if dropped without [`Collective::end`]). None where nothing is recorded.
pub struct Collective {
    op: &'static str,
    key: (u64, u64),
    bytes: u64,
    submitted_ns: i64,
    started_ns: i64,
    ended: bool,
}

impl Collective {
    /// Begins `op` of communicator `key.0`, its `key.1`th collective.
    pub fn begin(op: &'static str, key: (u64, u64), bytes: u64) -> Option<Collective> {
        if !recording() || QUIET.with(Cell::get) {
            return None;
        }
        if DEPTH.with(|d| d.replace(d.get() + 1)) > 0 {
            DEPTH.with(|d| d.set(d.get() - 1));
            return None;
        }
        let started_ns = now_ns();
        let submitted_ns = SUBMITTED.with(|s| s.take()).unwrap_or(started_ns).min(started_ns);
        Some(Collective { op, key, bytes, submitted_ns, started_ns, ended: false })
    }

    /// It ended, well or not.
    pub fn end(mut self, ok: bool) {
        self.finish(!ok);
    }

    fn finish(&mut self, failed: bool) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        record(&Span {
            source: Source::Comm,
            op: self.op,
            name: "",
            key: self.key,
            bytes: self.bytes,
            submitted_ns: self.submitted_ns,
            started_ns: self.started_ns,
            ended_ns: now_ns(),
            failed,
        });
    }
}

impl Drop for Collective {
    fn drop(&mut self) {
        self.finish(true);
    }
}

/// Records a span of another source (Horovod's tensors).
pub fn record_span(span: &Span<'_>) {
    record(span);
}
