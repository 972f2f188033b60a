//! The timeline's writer thread and the trace's text (upstream's
//! `TimelineWriter`): records come over the queue and go to the file in
//! batches, one write each, the file a whole JSON array after every one.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

/// One line of the trace, as the writer formats it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Record {
    /// A tensor's event: `phase` is Chrome's (`B`, `E`, `X`).
    Event { tensor: String, phase: char, name: String, args: Option<String>, ts: u64 },
    /// A job-wide instant (`CYCLE_START`).
    Marker { name: &'static str, args: Option<String>, ts: u64 },
}

/// What the recorder sends the writer thread.
pub(super) enum Msg {
    Record(Record),
    /// Switch to a new file (truncated), answering whether it opened.
    Open(PathBuf, SyncSender<Result<(), String>>),
    /// Finish the file (after what was queued before), answering when done.
    Close(SyncSender<()>),
}

/// A JSON string of `s`.
pub(super) fn json_text(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// The trace's text (upstream's `TimelineWriter`), kept a whole JSON
/// array: the file ends in `]`, and each write replaces that last byte
/// with the next events and a new `]`. Tensors get a trace process each,
/// numbered from 1 as they first appear.
#[derive(Debug, Default)]
pub(crate) struct TraceText {
    pids: HashMap<String, u32>,
    pending: String,
}

impl TraceText {
    /// A new file's text: the array with the job's own process, which
    /// carries the wall-clock time the trace's times count from.
    pub(crate) fn header(epoch_us: i64) -> String {
        format!(
            "[\n{{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, \"args\": {{\"name\": \"Horovod (kolo)\", \
             \"start_time_since_epoch_in_micros\": {epoch_us}}}}},\n{{\"name\": \"process_sort_index\", \"ph\": \
             \"M\", \"pid\": 0, \"args\": {{\"sort_index\": 0}}}}]"
        )
    }

    /// Adds a record to what the next write appends.
    pub(crate) fn push(&mut self, record: &Record) {
        use std::fmt::Write;
        let p = &mut self.pending;
        match record {
            Record::Event { tensor, phase, name, args, ts } => {
                let pid = match self.pids.get(tensor) {
                    Some(&pid) => pid,
                    None => {
                        let pid = self.pids.len() as u32 + 1;
                        self.pids.insert(tensor.clone(), pid);
                        let _ = write!(
                            p,
                            ",\n{{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": {pid}, \"args\": {{\"name\": \
                             {}}}}},\n{{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": {pid}, \"args\": \
                             {{\"sort_index\": {pid}}}}}",
                            json_text(tensor)
                        );
                        pid
                    }
                };
                let _ =
                    write!(p, ",\n{{\"ph\": \"{phase}\", \"name\": {}, \"ts\": {ts}, \"pid\": {pid}", json_text(name));
                if *phase == 'X' {
                    p.push_str(", \"dur\": 0");
                }
                if let Some(args) = args {
                    let _ = write!(p, ", \"args\": {{{args}}}");
                }
                p.push('}');
            }
            Record::Marker { name, args, ts } => {
                let _ = write!(
                    p,
                    ",\n{{\"ph\": \"i\", \"name\": {}, \"ts\": {ts}, \"pid\": 0, \"s\": \"g\"",
                    json_text(name)
                );
                if let Some(args) = args {
                    let _ = write!(p, ", \"args\": {{{args}}}");
                }
                p.push('}');
            }
        }
    }

    /// What to write over the file's last byte (its `]`), if anything was
    /// pushed: the events, then `]`.
    pub(crate) fn take(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let mut text = std::mem::take(&mut self.pending);
        text.push(']');
        Some(text)
    }
}

/// The file being written: its text's state and length.
struct Output {
    file: File,
    path: PathBuf,
    text: TraceText,
    len: u64,
}

impl Output {
    fn open(path: &Path, epoch_us: i64) -> Result<Output, String> {
        let cannot = |e: std::io::Error| {
            format!(
                "cannot write the timeline to {}: {e} (give a file in a directory that exists and is writable)",
                path.display()
            )
        };
        let file = File::create(path).map_err(cannot)?;
        let header = TraceText::header(epoch_us);
        file.write_all_at(header.as_bytes(), 0).map_err(cannot)?;
        Ok(Output { file, path: path.to_path_buf(), text: TraceText::default(), len: header.len() as u64 })
    }

    /// Writes what was pushed, in one write: the file stays whole.
    fn flush(&mut self) -> Result<(), String> {
        let Some(text) = self.text.take() else { return Ok(()) };
        self.file
            .write_all_at(text.as_bytes(), self.len - 1)
            .map_err(|e| format!("cannot write the timeline to {}: {e}", self.path.display()))?;
        self.len += text.len() as u64 - 1;
        Ok(())
    }
}

/// The writer thread: takes what is queued, a batch at a time, and writes
/// each batch in one write.
pub(super) fn write_loop(rx: Receiver<Msg>, epoch_us: i64, dropped: Arc<AtomicU64>) {
    let mut out: Option<Output> = None;
    let flush = |out: &mut Option<Output>| {
        if let Some(o) = out.as_mut() {
            let lost = dropped.swap(0, Ordering::Relaxed);
            if lost > 0 {
                let args = Some(format!("\"events\": {lost}"));
                o.text.push(&Record::Marker { name: "TIMELINE_EVENTS_DROPPED", args, ts: 0 });
            }
            if let Err(e) = o.flush() {
                eprintln!("[kolo] Horovod's timeline: {e}; it stops here");
                *out = None;
            }
        }
    };
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        let mut records = false;
        while let Some(msg) = next.take() {
            match msg {
                Msg::Record(r) => {
                    if let Some(o) = out.as_mut() {
                        o.text.push(&r);
                        records = true;
                    }
                }
                Msg::Open(path, ack) => {
                    flush(&mut out);
                    let opened = Output::open(&path, epoch_us);
                    let answer = opened.as_ref().map(|_| ()).map_err(Clone::clone);
                    out = opened.ok();
                    let _ = ack.send(answer);
                }
                Msg::Close(ack) => {
                    flush(&mut out);
                    out = None;
                    let _ = ack.send(());
                }
            }
            next = rx.try_recv().ok();
        }
        flush(&mut out);
        if records {
            // while events come, they gather for a moment: one write and
            // no wake-up of this thread per event (a sender wakes it only
            // when it waits in `recv`)
            std::thread::sleep(BATCH_PAUSE);
        }
    }
    flush(&mut out);
}

/// How long the writer lets events gather after writing some.
const BATCH_PAUSE: std::time::Duration = std::time::Duration::from_millis(2);

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Vec<serde_json::Value> {
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(serde_json::Value::Array(events)) => events,
            other => panic!("not a JSON array ({other:?}):\n{text}"),
        }
    }

    fn event(tensor: &str, phase: char, name: &str, ts: u64) -> Record {
        Record::Event { tensor: tensor.into(), phase, name: name.into(), args: None, ts }
    }

    #[test]
    fn the_text_is_a_whole_json_array_after_every_write_with_a_process_per_tensor() {
        let mut file = TraceText::header(1_700_000_000_000_000).into_bytes();
        assert_eq!(parse(std::str::from_utf8(&file).unwrap()).len(), 2);
        let mut text = TraceText::default();
        let records = [
            event("allreduce.a", 'B', "NEGOTIATE_ALLREDUCE", 1),
            event("allreduce.a", 'X', "0", 2),
            event("allreduce.\"odd\\name", 'B', "NEGOTIATE_ALLREDUCE", 3),
            Record::Marker { name: "CYCLE_START", args: None, ts: 4 },
            event("allreduce.a", 'E', "", 5),
        ];
        for record in &records {
            text.push(record);
            let write = text.take().expect("something to write");
            // the write replaces the last byte, as the writer's pwrite does
            file.truncate(file.len() - 1);
            file.extend_from_slice(write.as_bytes());
            parse(std::str::from_utf8(&file).unwrap());
        }
        assert!(text.take().is_none(), "nothing pushed, nothing written");
        let events = parse(std::str::from_utf8(&file).unwrap());
        let meta: Vec<_> = events.iter().filter(|e| e["ph"] == "M" && e["name"] == "process_name").collect();
        assert_eq!(meta.len(), 3, "the job's process and one per tensor");
        assert_eq!(meta[0]["args"]["start_time_since_epoch_in_micros"], 1_700_000_000_000_000i64);
        assert_eq!(meta[1]["args"]["name"], "allreduce.a");
        assert_eq!(meta[2]["args"]["name"], "allreduce.\"odd\\name");
        let sort: Vec<_> = events.iter().filter(|e| e["name"] == "process_sort_index").collect();
        assert_eq!(sort.iter().map(|e| e["args"]["sort_index"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2]);
        let rank_ready = events.iter().find(|e| e["ph"] == "X").unwrap();
        assert_eq!((rank_ready["pid"].as_u64(), rank_ready["dur"].as_u64()), (Some(1), Some(0)));
        let cycle = events.iter().find(|e| e["ph"] == "i").unwrap();
        assert_eq!((cycle["name"].as_str(), cycle["s"].as_str()), (Some("CYCLE_START"), Some("g")));
        for e in &events {
            assert!(e["ph"].is_string() && e["name"].is_string() && e["pid"].is_u64(), "{e}");
            assert!(e["ph"] == "M" || e["ts"].is_u64(), "{e}");
        }
    }
}
