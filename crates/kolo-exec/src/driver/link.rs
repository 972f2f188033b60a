//! The driver's side of each worker's connection: sending, one reader task
//! per worker (output to the output thread, results to waiting calls,
//! command events to the job), heartbeats, and the watchdog that marks
//! silent workers lost.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};

use super::{Report, WorkerInfo};
use crate::output::{Chunk, Stream};
use crate::policy::{Cause, Liveness};
use kolo_engine::ExecError;
use kolo_proto::proto::{self, RankSample, ToDriver, ToWorker};
use kolo_proto::registry::MAX_REPORT;

/// A call's bytes, or why there are none.
pub(crate) enum CallError {
    /// The user's code failed (its message).
    Task(String),
    /// The worker was lost (why).
    Lost(String),
}

pub(crate) type CallResult = Result<Vec<u8>, CallError>;

/// A rank's command ended (or could not start, or its worker was lost).
#[derive(Clone, Debug)]
pub struct RankEvent {
    /// The rank it happened to.
    pub rank: u32,
    /// What happened.
    pub cause: Cause,
}

/// Largest output chunk a worker may send (its pipe reads are 64 KiB).
const MAX_OUTPUT_CHUNK: usize = 1 << 20;

pub(crate) struct Link {
    pub info: WorkerInfo,
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pub pending: Mutex<HashMap<u64, oneshot::Sender<CallResult>>>,
    pub created: Mutex<Option<oneshot::Sender<Result<(), String>>>>,
    /// Where the reports of running calls go, by call id (calls made with
    /// `execute_reporting`; others' reports are dropped).
    pub reports: Mutex<HashMap<u64, mpsc::Sender<Report>>>,
    lost: Mutex<Option<String>>,
    /// When the worker was last heard from, in ms since `epoch`; checked by
    /// the watchdog (a timer per frame would cost more than the frame).
    last_heard_ms: AtomicU64,
    epoch: std::time::Instant,
    /// The reader waits for room in the output queue: the driver is not
    /// listening to this worker, so its silence means nothing.
    held_back: AtomicBool,
    /// The exception the command reported before it exited, if any.
    pub command_error: Mutex<Option<RankError>>,
    /// The address the worker's control connection came from: its host,
    /// as the job's stores see connections from there.
    pub host_addr: Option<std::net::IpAddr>,
    /// `WhoOwns` questions waiting for their answer, by id.
    owner_questions: Mutex<HashMap<u64, oneshot::Sender<Result<(), String>>>>,
    next_question: AtomicU64,
    /// Told to stop because its command ended: its going is no loss.
    released: AtomicBool,
    /// The driver told the worker to stop (a process an elastic round left
    /// out): its end is still an event, but not news worth a warning.
    pub(super) told_to_stop: AtomicBool,
    /// `Inspect` questions waiting for their answer, by id.
    inspections: Mutex<HashMap<u64, oneshot::Sender<Result<RankSample, String>>>>,
    /// When the rank last wrote output, in ms after `epoch`.
    last_output_ms: AtomicU64,
    /// When it last reported a value (`kolo.report`), likewise.
    last_report_ms: AtomicU64,
    /// `ClockProbe`s waiting for their reading (the host's clock, and this
    /// one's when it came).
    clock_probes: Mutex<HashMap<u64, oneshot::Sender<(i64, i64)>>>,
    /// The host's clock against this one, once measured.
    pub clock: Mutex<Option<ClockOffset>>,
    /// What the rank recorded for the job's timeline (`kolo run --timeline`).
    pub timeline: Mutex<Vec<u8>>,
}

/// Most bytes of timeline a rank may send: its file's room and a margin.
const MAX_TIMELINE: usize = 64 << 20;

/// How far a host's clock is from the driver's: the reading with the
/// shortest round trip of a few (NTP's estimate), in ns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ClockOffset {
    /// The host's clock minus the driver's.
    pub(crate) offset_ns: i64,
    /// The round trip of the reading it came from: the offset is right
    /// to within half of it.
    pub(crate) round_trip_ns: i64,
}

/// A failed rank's own account of its failure (PyTorch's error file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankError {
    /// The exception, as `Type: message`.
    pub message: String,
    /// Its traceback, from the same file (cut to a bound).
    pub traceback: String,
}

impl Link {
    pub(super) fn new(info: WorkerInfo, writer: OwnedWriteHalf, host_addr: Option<std::net::IpAddr>) -> Link {
        Link {
            info,
            writer: tokio::sync::Mutex::new(writer),
            pending: Mutex::new(HashMap::new()),
            created: Mutex::new(None),
            reports: Mutex::new(HashMap::new()),
            lost: Mutex::new(None),
            last_heard_ms: AtomicU64::new(0),
            epoch: std::time::Instant::now(),
            held_back: AtomicBool::new(false),
            command_error: Mutex::new(None),
            host_addr: host_addr.map(|a| a.to_canonical()),
            owner_questions: Mutex::new(HashMap::new()),
            next_question: AtomicU64::new(1),
            released: AtomicBool::new(false),
            told_to_stop: AtomicBool::new(false),
            inspections: Mutex::new(HashMap::new()),
            last_output_ms: AtomicU64::new(0),
            last_report_ms: AtomicU64::new(0),
            clock_probes: Mutex::new(HashMap::new()),
            clock: Mutex::new(None),
            timeline: Mutex::new(Vec::new()),
        }
    }

    /// Measures the worker's host clock against this one's: `probes`
    /// readings one after another, the one with the shortest round trip kept.
    pub(crate) async fn clock_offset(&self, probes: usize) -> Result<ClockOffset, String> {
        let mut best: Option<ClockOffset> = None;
        for _ in 0..probes {
            let id = self.next_question.fetch_add(1, Ordering::Relaxed);
            let (tx, rx) = oneshot::channel();
            let sent_ns = kolo_timeline::now_ns();
            kolo_sys::lock(&self.clock_probes).insert(id, tx);
            if let Err(e) = self.send(&ToWorker::ClockProbe { id }).await {
                kolo_sys::lock(&self.clock_probes).remove(&id);
                return Err(e.to_string());
            }
            let answer = tokio::time::timeout(Duration::from_secs(5), rx).await;
            let Ok(Ok((host_ns, received_ns))) = answer else {
                kolo_sys::lock(&self.clock_probes).remove(&id);
                return Err(format!("{} did not answer a clock probe", self.describe()));
            };
            let reading = ClockOffset {
                offset_ns: host_ns - (sent_ns + (received_ns - sent_ns) / 2),
                round_trip_ns: received_ns - sent_ns,
            };
            if best.is_none_or(|b| reading.round_trip_ns < b.round_trip_ns) {
                best = Some(reading);
            }
        }
        best.ok_or_else(|| "no clock probe was made".to_string())
    }

    /// Asks the worker's agent whether the connection from `client` (on
    /// its host) to `server` is its user's.
    pub(super) async fn ask_owner(
        &self,
        client: std::net::SocketAddr,
        server: std::net::SocketAddr,
    ) -> Result<(), String> {
        let id = self.next_question.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        kolo_sys::lock(&self.owner_questions).insert(id, tx);
        let sent = self.send(&ToWorker::WhoOwns { id, client, server }).await;
        if let Err(e) = sent {
            kolo_sys::lock(&self.owner_questions).remove(&id);
            return Err(format!("cannot ask {} about it: {e}", self.describe()));
        }
        rx.await.unwrap_or_else(|_| Err(format!("{} was lost before it answered", self.describe())))
    }

    /// Stops an agent whose command ended: it has nothing left to do, and
    /// it exits while the other ranks run rather than with them all at the
    /// job's end.
    pub(super) async fn release(&self) {
        self.released.store(true, Ordering::Relaxed);
        let _ = self.send(&ToWorker::Stop).await;
    }

    pub(super) fn describe(&self) -> String {
        format!("rank {} on host {}", self.info.rank, self.info.hostname)
    }

    /// Asks the agent what its rank is doing (`stacks`: its threads' stacks too).
    pub(crate) async fn inspect(&self, stacks: bool, py_spy: Option<String>) -> Result<RankSample, String> {
        let id = self.next_question.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        kolo_sys::lock(&self.inspections).insert(id, tx);
        if let Err(e) = self.send(&ToWorker::Inspect { id, stacks, py_spy }).await {
            kolo_sys::lock(&self.inspections).remove(&id);
            return Err(e.to_string());
        }
        rx.await.unwrap_or_else(|_| Err(format!("{} was lost before it answered", self.describe())))
    }

    /// How long since the rank last wrote output (since it registered if never).
    pub(crate) fn since_output(&self) -> Duration {
        let at = Duration::from_millis(self.last_output_ms.load(Ordering::Relaxed));
        self.epoch.elapsed().saturating_sub(at)
    }

    /// How long since the rank last reported a value (since it registered if never).
    pub(crate) fn since_report(&self) -> Duration {
        let at = Duration::from_millis(self.last_report_ms.load(Ordering::Relaxed));
        self.epoch.elapsed().saturating_sub(at)
    }

    /// Since the worker registered.
    pub(crate) fn age(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Its command ended and the driver let its agent go.
    pub(crate) fn is_released(&self) -> bool {
        self.released.load(Ordering::Relaxed)
    }

    pub(crate) fn lost_reason(&self) -> Option<String> {
        kolo_sys::lock(&self.lost).clone()
    }

    pub(super) async fn send(&self, message: &ToWorker) -> Result<(), ExecError> {
        let frame =
            proto::encode(message).map_err(|source| ExecError::Io { what: "encoding a message".into(), source })?;
        self.send_frame(&frame).await
    }

    pub(super) async fn send_frame(&self, frame: &[u8]) -> Result<(), ExecError> {
        if let Some(reason) = self.lost_reason() {
            return Err(self.lost_error(reason));
        }
        let mut writer = self.writer.lock().await;
        if let Err(e) = writer.write_all(frame).await {
            let reason = format!("cannot send to it: {e}");
            self.mark_lost(&reason);
            return Err(self.lost_error(reason));
        }
        Ok(())
    }

    pub(super) fn lost_error(&self, reason: String) -> ExecError {
        ExecError::WorkerLost { rank: self.info.rank, host: self.info.hostname.clone(), reason }
    }

    fn heard(&self) {
        self.last_heard_ms.store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Marks the worker lost and fails everything waiting on it; false if
    /// it was lost already.
    pub(super) fn mark_lost(&self, reason: &str) -> bool {
        let mut lost = kolo_sys::lock(&self.lost);
        if lost.is_some() {
            return false;
        }
        *lost = Some(reason.to_string());
        drop(lost);
        let message = format!("worker {} was lost: {reason}", self.describe());
        for (_, tx) in kolo_sys::lock(&self.pending).drain() {
            let _ = tx.send(Err(CallError::Lost(reason.to_string())));
        }
        if let Some(tx) = kolo_sys::lock(&self.created).take() {
            let _ = tx.send(Err(message));
        }
        kolo_sys::lock(&self.reports).clear();
        kolo_sys::lock(&self.owner_questions).clear();
        kolo_sys::lock(&self.inspections).clear();
        true
    }
}

/// Reads one worker's frames until its connection ends.
pub(crate) async fn read_worker(
    link: Arc<Link>,
    reader: OwnedReadHalf,
    output: mpsc::Sender<Chunk>,
    events: mpsc::UnboundedSender<RankEvent>,
    stopping: Arc<AtomicBool>,
) {
    let rank = link.info.rank;
    // one read takes in whatever the worker sent, not a frame header at a time
    let mut reader = tokio::io::BufReader::with_capacity(256 * 1024, reader);
    let reason = loop {
        let frame = match proto::read_frame_async(&mut reader, proto::MAX_FRAME).await {
            Ok(frame) => frame,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset) => {
                break "its connection closed (the worker process died?)".to_string()
            }
            Err(e) => break format!("its connection failed: {e}"),
        };
        link.heard();
        let message: ToDriver = match proto::decode(&frame) {
            Ok(m) => m,
            Err(e) => break format!("it sent an unreadable message: {e}"),
        };
        match message {
            ToDriver::Heartbeat
            | ToDriver::CommandStarted { .. }
            | ToDriver::ProbeReady { .. }
            | ToDriver::ProbeResult { .. }
            | ToDriver::PortsReserved { .. } => {}
            ToDriver::Output { stderr, data } => {
                if data.len() > MAX_OUTPUT_CHUNK {
                    break format!("it sent {} bytes of output at once, over the limit", data.len());
                }
                link.last_output_ms.store(link.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
                let stream = if stderr { Stream::Stderr } else { Stream::Stdout };
                if forward(&link, &output, Chunk::Data { rank, stream, bytes: data }).await.is_err() {
                    break "the driver stopped taking output".into();
                }
            }
            ToDriver::CommandStartFailed { message, code } => {
                let _ = events.send(RankEvent { rank, cause: Cause::StartFailed { message, code } });
            }
            ToDriver::CommandError { message, traceback } => {
                *kolo_sys::lock(&link.command_error) = Some(RankError { message, traceback });
            }
            ToDriver::CommandExited { code, signal } => {
                let _ = forward(&link, &output, Chunk::End { rank }).await;
                let _ = events.send(RankEvent { rank, cause: Cause::Exited { code, signal } });
            }
            ToDriver::ClockReading { id, unix_ns } => {
                let received_ns = kolo_timeline::now_ns();
                if let Some(tx) = kolo_sys::lock(&link.clock_probes).remove(&id) {
                    let _ = tx.send((unix_ns, received_ns));
                }
            }
            ToDriver::Timeline { data } => {
                let mut timeline = kolo_sys::lock(&link.timeline);
                if timeline.len() + data.len() > MAX_TIMELINE {
                    break format!("it sent more than {MAX_TIMELINE} bytes of timeline");
                }
                timeline.extend_from_slice(&data);
            }
            ToDriver::Inspected { id, answer } => {
                if let Some(tx) = kolo_sys::lock(&link.inspections).remove(&id) {
                    let _ = tx.send(answer);
                }
            }
            ToDriver::SocketOwner { id, answer } => {
                if let Some(tx) = kolo_sys::lock(&link.owner_questions).remove(&id) {
                    let _ = tx.send(answer);
                }
            }
            ToDriver::Created { result } => {
                if let Some(tx) = kolo_sys::lock(&link.created).take() {
                    let _ = tx.send(result);
                }
            }
            ToDriver::Report { id, data } => {
                if data.len() > MAX_REPORT {
                    break format!("it reported {} bytes at once, over the limit of {MAX_REPORT}", data.len());
                }
                link.last_report_ms.store(link.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
                let sink = kolo_sys::lock(&link.reports).get(&id).cloned();
                if let Some(sink) = sink {
                    // a caller that stopped listening loses its reports, nothing else
                    let _ = forward(&link, &sink, Report { rank, data }).await;
                }
            }
            ToDriver::Done { id, result } => {
                kolo_sys::lock(&link.reports).remove(&id);
                if let Some(tx) = kolo_sys::lock(&link.pending).remove(&id) {
                    let _ = tx.send(result.map_err(CallError::Task));
                }
            }
        }
    };
    let _ = forward(&link, &output, Chunk::End { rank }).await;
    let released = link.released.load(Ordering::Relaxed);
    let expected = stopping.load(Ordering::Relaxed) || released;
    let reason = match (stopping.load(Ordering::Relaxed), released) {
        (true, _) => "the executor was shut down".to_string(),
        (false, true) => "its command ended".to_string(),
        (false, false) => reason,
    };
    if link.mark_lost(&reason) && !expected {
        if !link.told_to_stop.load(Ordering::Relaxed) {
            tracing::warn!("worker {} was lost: {reason}", link.describe());
        }
        let _ = events.send(RankEvent { rank, cause: Cause::Lost(reason) });
    }
}

/// Queues output for the output thread, or a report for its caller. A full
/// queue holds this worker back (its pipes fill, its reports wait), not the
/// driver: heartbeats and calls of others go on, and this worker's silence
/// meanwhile is not held against it.
async fn forward<T>(link: &Link, queue: &mpsc::Sender<T>, item: T) -> Result<(), ()> {
    match queue.try_send(item) {
        Ok(()) => Ok(()),
        Err(mpsc::error::TrySendError::Full(item)) => {
            link.held_back.store(true, Ordering::Relaxed);
            let sent = queue.send(item).await.map_err(drop);
            link.heard();
            link.held_back.store(false, Ordering::Relaxed);
            sent
        }
        Err(mpsc::error::TrySendError::Closed(_)) => Err(()),
    }
}

/// Reports a worker lost once it has been silent for the timeout (hung,
/// stopped, or cut off without its connection closing).
pub(crate) async fn watch_heartbeats(
    links: Vec<(Arc<Link>, tokio::task::AbortHandle)>,
    liveness: Liveness,
    events: mpsc::UnboundedSender<RankEvent>,
    stopping: Arc<AtomicBool>,
) {
    let mut ticks = tokio::time::interval((liveness.timeout / 10).max(Duration::from_millis(10)));
    loop {
        ticks.tick().await;
        if stopping.load(Ordering::Relaxed) {
            return;
        }
        for (link, reading) in &links {
            let heard = link.epoch + Duration::from_millis(link.last_heard_ms.load(Ordering::Relaxed));
            let held_back = link.held_back.load(Ordering::Relaxed);
            if let Some(silent) = liveness.lost(heard, std::time::Instant::now(), held_back) {
                let reason = format!("no heartbeat for {:.1} s (hung or stopped?)", silent.as_secs_f64());
                reading.abort();
                if link.mark_lost(&reason) {
                    tracing::warn!("worker {} was lost: {reason}", link.describe());
                    let _ = events.send(RankEvent { rank: link.info.rank, cause: Cause::Lost(reason) });
                }
            }
        }
        if links.iter().all(|(l, _)| l.lost_reason().is_some()) {
            return;
        }
    }
}

pub(crate) async fn send_heartbeats(link: Arc<Link>, interval: Duration) {
    let frame = match proto::encode(&ToWorker::Heartbeat) {
        Ok(frame) => frame,
        Err(_) => return,
    };
    let mut ticks = tokio::time::interval(interval);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        if link.send_frame(&frame).await.is_err() {
            return;
        }
    }
}
