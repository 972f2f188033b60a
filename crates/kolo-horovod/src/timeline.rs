//! Horovod's timeline (upstream's `timeline.cc`): rank 0 writes, in
//! Chrome's tracing format (a JSON array, whole after every write), what
//! its core did with each tensor: the negotiation (`NEGOTIATE_<OP>`, with
//! a mark as each rank's request reached the coordinator), then the op
//! (`ALLREDUCE`...) and its activities, one trace "process" per tensor.
//!
//! The core tells it what happens through [`Event`]s at a few points
//! (`controller`, `background`, `perform`, `exec`), through a [`Trace`]
//! that is a `None` when nothing records: an off timeline costs a branch.
//! Recording formats a record and hands it to a writer thread over a
//! bounded queue; the loop never waits on the disk (a full queue drops the
//! record, and the file says how many were dropped).
//!
//! Activities, kolo's names where upstream's name its transports:
//! `QUEUE` (agreed, waiting for the responses before it in the cycle),
//! `MEMCPY_IN_FUSION_BUFFER`, `KOLO_<OP>` (the collective on kolo-comm:
//! `KOLO_ALLREDUCE`, `KOLO_ALLGATHER`, `KOLO_BROADCAST`, `KOLO_ALLTOALL`,
//! `KOLO_REDUCESCATTER`), `MEMCPY_OUT_FUSION_BUFFER`, and
//! `KOLO_DEVICE_<OP>` for tensors the device executor runs (it waits for
//! their data itself, so upstream's `WAIT_FOR_DATA` has no place here).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::message::{DataType, Response, ResponseType};
use crate::state::Shared;

mod writer;

use writer::{json_text, write_loop, Msg, Record};

/// `HOROVOD_TIMELINE`: where rank 0 records from the start, or
/// `DYNAMIC`: nothing until `hvd.start_timeline`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TimelineTarget {
    /// Record into this file from `hvd.init()`.
    File(PathBuf),
    /// Record only between `start_timeline` and `stop_timeline`.
    Dynamic,
}

/// The activity of a tensor agreed on and waiting for its turn.
pub(crate) const QUEUE: &str = "QUEUE";
/// Copying fused tensors into the fusion buffer.
pub(crate) const MEMCPY_IN_FUSION_BUFFER: &str = "MEMCPY_IN_FUSION_BUFFER";
/// Copying fused results out of it.
pub(crate) const MEMCPY_OUT_FUSION_BUFFER: &str = "MEMCPY_OUT_FUSION_BUFFER";
/// kolo-comm's allreduce (fused or alone).
pub(crate) const KOLO_ALLREDUCE: &str = "KOLO_ALLREDUCE";
/// How many records wait for the writer at most (upstream's queue holds 2^20).
const QUEUE_CAPACITY: usize = 1 << 16;

/// What the core tells a recorder, at the points upstream tells its
/// timeline; every field borrowed, so that nothing is made unless a
/// recorder records.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Event<'a> {
    /// The coordinator saw a name's first request (or, from the cache's
    /// bits, some rank's hit); `op` as upstream names request types.
    NegotiateStart { name: &'a str, op: &'static str },
    /// The coordinator has `rank`'s (global) request for `name`.
    RankReady { name: &'a str, rank: u32 },
    /// Every rank has submitted `name`.
    NegotiateEnd { name: &'a str },
    /// `name` was agreed on and runs on this rank.
    Start { name: &'a str, op: ResponseType, dtype: DataType, shape: &'a [i64] },
    /// `name`'s current activity, if any, ends, and `activity` begins.
    Activity { name: &'a str, activity: &'static str },
    /// `name`'s current activity ends.
    ActivityEnd { name: &'a str },
    /// `name` is done here.
    End { name: &'a str },
}

/// Upstream's name of a response type (the op's event in the trace).
pub(crate) fn op_name(kind: ResponseType) -> &'static str {
    match kind {
        ResponseType::Allreduce => "ALLREDUCE",
        ResponseType::Allgather => "ALLGATHER",
        ResponseType::Broadcast => "BROADCAST",
        ResponseType::Join => "JOIN",
        ResponseType::Adasum => "ADASUM",
        ResponseType::Alltoall => "ALLTOALL",
        ResponseType::Barrier => "BARRIER",
        ResponseType::Reducescatter => "REDUCESCATTER",
        ResponseType::AddProcessSet => "ADD_PROCESS_SET",
        ResponseType::RemoveProcessSet => "REMOVE_PROCESS_SET",
        ResponseType::Error => "ERROR",
    }
}

/// The activity of a response's collective on kolo-comm (host memory).
pub(crate) fn collective_name(kind: ResponseType) -> &'static str {
    match kind {
        ResponseType::Allreduce | ResponseType::Adasum => KOLO_ALLREDUCE,
        ResponseType::Allgather => "KOLO_ALLGATHER",
        ResponseType::Broadcast => "KOLO_BROADCAST",
        ResponseType::Alltoall => "KOLO_ALLTOALL",
        ResponseType::Reducescatter => "KOLO_REDUCESCATTER",
        _ => "KOLO_COLLECTIVE",
    }
}

/// The activity of a response the device executor runs.
pub(crate) fn device_name(kind: ResponseType) -> &'static str {
    match kind {
        ResponseType::Allreduce | ResponseType::Adasum => "KOLO_DEVICE_ALLREDUCE",
        ResponseType::Allgather => "KOLO_DEVICE_ALLGATHER",
        ResponseType::Broadcast => "KOLO_DEVICE_BROADCAST",
        ResponseType::Alltoall => "KOLO_DEVICE_ALLTOALL",
        ResponseType::Reducescatter => "KOLO_DEVICE_REDUCESCATTER",
        _ => "KOLO_DEVICE_COLLECTIVE",
    }
}

/// Ops that get a span of their own (upstream leaves out joins and
/// barriers; kolo also the process-set changes).
fn traced(kind: ResponseType) -> bool {
    !matches!(
        kind,
        ResponseType::Join | ResponseType::Barrier | ResponseType::AddProcessSet | ResponseType::RemoveProcessSet
    )
}

/// Where the core's hook points send events: nothing (`None`) unless a
/// timeline records now, so that the hooks cost one branch when off.
#[derive(Clone, Copy)]
pub(crate) struct Trace<'a>(Option<&'a Timeline>);

impl<'a> Trace<'a> {
    /// This process's timeline, if it records now.
    pub(crate) fn of(shared: &'a Shared) -> Trace<'a> {
        Trace(shared.timeline.as_deref().filter(|t| t.recording()))
    }

    pub(crate) fn on(&self) -> bool {
        self.0.is_some()
    }

    pub(crate) fn record(&self, event: Event<'_>) {
        if let Some(t) = self.0 {
            t.record(event);
        }
    }

    /// `activity` begins for each of `names`.
    pub(crate) fn activity<'n>(&self, names: impl IntoIterator<Item = &'n str>, activity: &'static str) {
        if let Some(t) = self.0 {
            for name in names {
                t.record(Event::Activity { name, activity });
            }
        }
    }

    /// The current activity of each of `names` ends.
    pub(crate) fn activity_end<'n>(&self, names: impl IntoIterator<Item = &'n str>) {
        if let Some(t) = self.0 {
            for name in names {
                t.record(Event::ActivityEnd { name });
            }
        }
    }

    /// `run` as the activity `activity` of `names`.
    pub(crate) fn around<T>(&self, names: &[String], activity: &'static str, run: impl FnOnce() -> T) -> T {
        self.activity(names.iter().map(String::as_str), activity);
        let out = run();
        self.activity_end(names.iter().map(String::as_str));
        out
    }

    /// The cycle agreed on `responses` of set `id`: each traced tensor this
    /// rank has begins its op, and waits (`QUEUE`) for its turn; its entry
    /// records its end when it is finished.
    pub(crate) fn agreed(&self, shared: &Shared, id: u32, responses: &[Response]) {
        let (Some(_), Some(timeline)) = (self.0, shared.timeline.as_ref()) else { return };
        let mut state = shared.lock();
        let Some(set) = state.sets.get_mut(&id) else { return };
        for response in responses.iter().filter(|r| traced(r.kind)) {
            for name in &response.names {
                if let Some(entry) = set.table.get_mut(name) {
                    let (dtype, shape) = (entry.submit.dtype, entry.submit.shape.as_slice());
                    self.record(Event::Start { name, op: response.kind, dtype, shape });
                    self.record(Event::Activity { name, activity: QUEUE });
                    entry.traced = Some(timeline.clone());
                }
            }
        }
    }
}

/// Where a tensor is in the trace (upstream's `TimelineState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Negotiating,
    Op,
    Activity,
}

/// Rank 0's timeline: the tensors' phases, and the queue to its writer.
pub(crate) struct Timeline {
    started: Instant,
    recording: AtomicBool,
    mark_cycles: AtomicBool,
    inner: Mutex<Inner>,
    dropped: Arc<AtomicU64>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct Inner {
    phases: HashMap<String, Phase>,
    /// The file recorded into now.
    path: Option<PathBuf>,
    /// None once shut down.
    tx: Option<SyncSender<Msg>>,
}

impl std::fmt::Debug for Timeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timeline").field("recording", &self.recording()).finish()
    }
}

impl Timeline {
    /// Starts the writer; with a file, records into it from now (a file
    /// that cannot be opened is said on stderr, and nothing records).
    pub(crate) fn start(target: &TimelineTarget, mark_cycles: bool) -> Arc<Timeline> {
        let started = Instant::now();
        let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let epoch_us = since_epoch.as_micros() as i64 - started.elapsed().as_micros() as i64;
        let (tx, rx) = mpsc::sync_channel(QUEUE_CAPACITY);
        let dropped = Arc::new(AtomicU64::new(0));
        let writer = {
            let dropped = dropped.clone();
            std::thread::Builder::new()
                .name("kolo-hvd-timeline".into())
                .spawn(move || write_loop(rx, epoch_us, dropped))
                .ok()
        };
        let timeline = Arc::new(Timeline {
            started,
            recording: AtomicBool::new(false),
            mark_cycles: AtomicBool::new(mark_cycles),
            inner: Mutex::new(Inner { phases: HashMap::new(), path: None, tx: writer.is_some().then_some(tx) }),
            dropped,
            writer: Mutex::new(writer),
        });
        if let TimelineTarget::File(path) = target {
            if let Err(e) = timeline.open(path) {
                eprintln!("[kolo] Horovod's timeline: {e}; HOROVOD_TIMELINE records nothing");
            }
        }
        timeline
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether events are recorded now.
    pub(crate) fn recording(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    /// Records into `path` from now on (`hvd.start_timeline`): the same
    /// file goes on; another one is made anew, after the last one is
    /// finished.
    pub(crate) fn open(&self, path: &Path) -> Result<(), String> {
        let answer = {
            let mut inner = self.lock();
            if inner.path.as_deref() == Some(path) && self.recording() {
                return Ok(());
            }
            self.recording.store(false, Ordering::Relaxed);
            inner.phases.clear();
            inner.path = None;
            let Some(tx) = inner.tx.clone() else { return Err("the timeline was shut down".into()) };
            let (ack, answer) = mpsc::sync_channel(1);
            tx.send(Msg::Open(path.to_path_buf(), ack)).map_err(|_| "the timeline's writer has stopped")?;
            answer
        };
        answer.recv().map_err(|_| "the timeline's writer has stopped".to_string())??;
        let mut inner = self.lock();
        inner.path = Some(path.to_path_buf());
        self.recording.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Stops recording (`hvd.stop_timeline`) and finishes the file with
    /// what was recorded before.
    pub(crate) fn close(&self) {
        let answer = {
            let mut inner = self.lock();
            self.recording.store(false, Ordering::Relaxed);
            inner.phases.clear();
            inner.path = None;
            let Some(tx) = inner.tx.clone() else { return };
            let (ack, answer) = mpsc::sync_channel(1);
            if tx.send(Msg::Close(ack)).is_err() {
                return;
            }
            answer
        };
        let _ = answer.recv();
    }

    /// Finishes the file and stops the writer (the core shuts down).
    pub(crate) fn shutdown(&self) {
        self.close();
        self.lock().tx = None;
        let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(writer) = writer {
            let _ = writer.join();
        }
    }

    /// Whether cycles are marked (`HOROVOD_TIMELINE_MARK_CYCLES`, or
    /// `start_timeline`'s `mark_cycles`).
    pub(crate) fn set_mark_cycles(&self, on: bool) {
        self.mark_cycles.store(on, Ordering::Relaxed);
    }

    /// A cycle begins: a `CYCLE_START` mark, if cycles are marked.
    pub(crate) fn cycle_start(&self) {
        if self.recording() && self.mark_cycles.load(Ordering::Relaxed) {
            let ts = self.now();
            let inner = self.lock();
            self.send(&inner, Record::Marker { name: "CYCLE_START", args: None, ts });
        }
    }

    fn now(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    fn send(&self, inner: &Inner, record: Record) {
        let Some(tx) = &inner.tx else { return };
        if let Err(TrySendError::Full(_)) = tx.try_send(Msg::Record(record)) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One event, through the tensor's phases as upstream's: each begin
    /// has its end, and an event that does not fit where the tensor is
    /// (it began before this file) is left out.
    pub(crate) fn record(&self, event: Event<'_>) {
        let ts = self.now();
        let mut inner = self.lock();
        if !self.recording() {
            return;
        }
        let mut out: Vec<Record> = Vec::with_capacity(2);
        let ev = |tensor: &str, phase: char, name: &str, args: Option<String>| Record::Event {
            tensor: tensor.to_string(),
            phase,
            name: name.to_string(),
            args,
            ts,
        };
        let phases = &mut inner.phases;
        match event {
            Event::NegotiateStart { name, op } => {
                // a name negotiated over several cycles (or first seen as
                // some rank's cache hit) begins once
                if !phases.contains_key(name) {
                    out.push(ev(name, 'B', &format!("NEGOTIATE_{op}"), None));
                    phases.insert(name.to_string(), Phase::Negotiating);
                }
            }
            Event::RankReady { name, rank } => {
                if phases.get(name) == Some(&Phase::Negotiating) {
                    out.push(ev(name, 'X', &rank.to_string(), None));
                }
            }
            Event::NegotiateEnd { name } => {
                if phases.get(name) == Some(&Phase::Negotiating) {
                    out.push(ev(name, 'E', "", None));
                    phases.remove(name);
                }
            }
            Event::Start { name, op, dtype, shape } => {
                if phases.get(name) == Some(&Phase::Negotiating) {
                    out.push(ev(name, 'E', "", None));
                }
                let shape = crate::message::shape_text(shape);
                let args = format!("\"dtype\": {}, \"shape\": {}", json_text(dtype.name()), json_text(&shape));
                out.push(ev(name, 'B', op_name(op), Some(args)));
                phases.insert(name.to_string(), Phase::Op);
            }
            Event::Activity { name, activity } => match phases.get(name) {
                Some(Phase::Op) | Some(Phase::Activity) => {
                    if phases[name] == Phase::Activity {
                        out.push(ev(name, 'E', "", None));
                    }
                    out.push(ev(name, 'B', activity, None));
                    phases.insert(name.to_string(), Phase::Activity);
                }
                _ => {}
            },
            Event::ActivityEnd { name } => {
                if phases.get(name) == Some(&Phase::Activity) {
                    out.push(ev(name, 'E', "", None));
                    phases.insert(name.to_string(), Phase::Op);
                }
            }
            Event::End { name } => match phases.get(name) {
                Some(Phase::Op) | Some(Phase::Activity) => {
                    if phases[name] == Phase::Activity {
                        out.push(ev(name, 'E', "", None));
                    }
                    out.push(ev(name, 'E', "", None));
                    phases.remove(name);
                }
                _ => {}
            },
        }
        for record in out {
            self.send(&inner, record);
        }
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Vec<serde_json::Value> {
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(serde_json::Value::Array(events)) => events,
            other => panic!("not a JSON array ({other:?}):\n{text}"),
        }
    }

    /// A timeline recording into a file of a temporary directory.
    fn recording(mark_cycles: bool) -> (Arc<Timeline>, PathBuf) {
        let dir = std::env::temp_dir().join(format!("kolo-timeline-{}-{:?}", std::process::id(), Instant::now()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("timeline.json");
        (Timeline::start(&TimelineTarget::File(path.clone()), mark_cycles), path)
    }

    fn phases_of(events: &[serde_json::Value], pid: u64) -> Vec<String> {
        events
            .iter()
            .filter(|e| e["pid"] == pid && e["ph"] != "M")
            .map(|e| format!("{}:{}", e["ph"].as_str().unwrap(), e["name"].as_str().unwrap()))
            .collect()
    }

    #[test]
    fn a_tensor_goes_through_negotiation_its_op_and_activities_each_begin_with_its_end() {
        let (timeline, path) = recording(true);
        let name = "allreduce.grad";
        timeline.record(Event::NegotiateStart { name, op: "ALLREDUCE" });
        timeline.record(Event::RankReady { name, rank: 0 });
        timeline.cycle_start();
        timeline.record(Event::NegotiateStart { name, op: "ALLREDUCE" });
        timeline.record(Event::RankReady { name, rank: 1 });
        timeline.record(Event::NegotiateEnd { name });
        let shape = [2i64, 3];
        timeline.record(Event::Start { name, op: ResponseType::Allreduce, dtype: DataType::Float32, shape: &shape });
        timeline.record(Event::Activity { name, activity: QUEUE });
        timeline.record(Event::Activity { name, activity: KOLO_ALLREDUCE });
        timeline.record(Event::ActivityEnd { name });
        timeline.record(Event::End { name });
        // an end with no beginning in this file is left out
        timeline.record(Event::End { name: "allreduce.other" });
        timeline.shutdown();
        let events = parse(&std::fs::read_to_string(&path).unwrap());
        assert_eq!(
            phases_of(&events, 1),
            [
                "B:NEGOTIATE_ALLREDUCE",
                "X:0",
                "X:1",
                "E:",
                "B:ALLREDUCE",
                "B:QUEUE",
                "E:",
                "B:KOLO_ALLREDUCE",
                "E:",
                "E:"
            ]
        );
        let op = events.iter().find(|e| e["name"] == "ALLREDUCE").unwrap();
        assert_eq!((op["args"]["dtype"].as_str(), op["args"]["shape"].as_str()), (Some("float32"), Some("[2, 3]")));
        assert!(events.iter().any(|e| e["name"] == "CYCLE_START"));
        let ts: Vec<u64> = events.iter().filter_map(|e| e["ts"].as_u64()).collect();
        assert!(ts.windows(2).all(|w| w[0] <= w[1]), "times in order: {ts:?}");
        assert!(!events.iter().any(|e| e["args"]["name"] == "allreduce.other"));
    }

    #[test]
    fn a_stopped_timeline_records_nothing_and_a_new_file_starts_whole() {
        let (timeline, first) = recording(false);
        let name = "broadcast.w";
        timeline.cycle_start();
        timeline.record(Event::NegotiateStart { name, op: "BROADCAST" });
        timeline.close();
        assert!(!timeline.recording());
        timeline.record(Event::NegotiateEnd { name });
        let events = parse(&std::fs::read_to_string(&first).unwrap());
        assert_eq!(phases_of(&events, 1), ["B:NEGOTIATE_BROADCAST"]);
        assert!(!events.iter().any(|e| e["name"] == "CYCLE_START"), "cycles are not marked");
        let second = first.with_file_name("second.json");
        timeline.set_mark_cycles(true);
        timeline.open(&second).unwrap();
        timeline.cycle_start();
        // the negotiation began in the other file: its end is left out here
        timeline.record(Event::NegotiateEnd { name });
        timeline.shutdown();
        let events = parse(&std::fs::read_to_string(&second).unwrap());
        assert!(events.iter().any(|e| e["name"] == "CYCLE_START"));
        assert_eq!(events.iter().filter(|e| e["ph"] == "M").count(), 2, "no tensor in this file");
        let bad = Path::new("/nonexistent-kolo-dir/t.json");
        let (timeline, _) = recording(false);
        let e = timeline.open(bad).unwrap_err();
        assert!(e.contains("/nonexistent-kolo-dir/t.json") && e.contains("writable"), "{e}");
        assert!(!timeline.recording());
    }
}
