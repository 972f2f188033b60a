//! Workers' output: split into lines (`\n` or `\r` ends one), prefixed
//! `[rank]<stdout>:` as horovodrun does, written to the terminal and
//! optionally to `DIR/rank.NN/stdout|stderr`, with the last stderr lines of
//! every rank kept for the failure report.
//!
//! Writing may block (a slow or paused reader of kolo's output), so it
//! happens on a thread of its own, fed through a bounded queue: a full
//! queue holds up only the ranks that produce output (their pipes fill and
//! they block), never heartbeats, calls or teardown.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use kolo_engine::ExecError;

/// Which of a worker's streams a line came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

impl Stream {
    /// `stdout` or `stderr`, as prefixes show it.
    pub fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// Lines longer than this are split: a line with no end must not make
/// kolo buffer without bound.
pub const MAX_LINE: usize = 64 * 1024;

/// Splits a byte stream into lines, each ending with its `\n` or `\r`;
/// what is left without an end comes out of [`LineSplitter::finish`].
/// A line longer than [`MAX_LINE`] comes out in pieces of that size.
#[derive(Default)]
pub struct LineSplitter {
    pending: Vec<u8>,
}

impl LineSplitter {
    /// Feeds bytes and calls `emit` for every complete line (and every
    /// [`MAX_LINE`] bytes of an over-long one).
    pub fn push(&mut self, mut bytes: &[u8], mut emit: impl FnMut(&[u8])) {
        while let Some(end) = bytes.iter().position(|&b| b == b'\n' || b == b'\r') {
            let (line, rest) = bytes.split_at(end + 1);
            if self.pending.is_empty() {
                emit(line);
            } else {
                self.pending.extend_from_slice(line);
                emit(&self.pending);
                self.pending.clear();
            }
            bytes = rest;
        }
        self.pending.extend_from_slice(bytes);
        if self.pending.len() >= MAX_LINE {
            let mut at = 0;
            while self.pending.len() - at >= MAX_LINE {
                emit(&self.pending[at..at + MAX_LINE]);
                at += MAX_LINE;
            }
            self.pending.drain(..at);
        }
    }

    /// The last partial line, if any.
    pub fn finish(&mut self) -> Option<Vec<u8>> {
        (!self.pending.is_empty()).then(|| std::mem::take(&mut self.pending))
    }
}

/// How the ranks' output is written.
#[derive(Clone, Debug, Default)]
pub struct OutputOptions {
    /// Write each rank's raw output to `DIR/rank.NN/stdout|stderr` too.
    pub output_dir: Option<PathBuf>,
    /// Start each prefix with the time, in Horovod's format.
    pub timestamp: bool,
    /// Write lines as they are, with no `[rank]<stream>:` prefix (and so
    /// no time either).
    pub disable_prefix: bool,
    /// Added to each rank in prefixes and file names: an elastic job's
    /// later cohorts number their processes after the earlier ones'.
    pub first_label: usize,
}

/// Last stderr lines kept per rank for the failure report.
const TAIL_LINES: usize = 10;

struct RankFiles {
    stdout: File,
    stderr: File,
}

/// Where every rank's lines go. Whole lines are written under a lock, so
/// lines of different ranks never interleave.
pub struct OutputSink {
    options: OutputOptions,
    files: Vec<Mutex<Option<RankFiles>>>,
    tails: Vec<Mutex<VecDeque<String>>>,
    terminal: Mutex<()>,
    /// Set once a terminal stream is closed (`kolo run ... | head`): the
    /// job goes on, that stream's lines are dropped.
    closed: [std::sync::atomic::AtomicBool; 2],
}

impl OutputSink {
    /// A sink for `ranks` ranks; opens their files at once when there is
    /// an output directory.
    pub fn new(options: OutputOptions, ranks: usize) -> Result<Self, ExecError> {
        let mut files = Vec::with_capacity(ranks);
        let width = (ranks.saturating_sub(1)).to_string().len();
        for rank in 0..ranks {
            let opened = match &options.output_dir {
                Some(dir) => Some(open_rank_files(dir, options.first_label + rank, width)?),
                None => None,
            };
            files.push(Mutex::new(opened));
        }
        Ok(OutputSink {
            options,
            files,
            tails: (0..ranks).map(|_| Mutex::new(VecDeque::new())).collect(),
            terminal: Mutex::new(()),
            closed: Default::default(),
        })
    }

    /// One line of a rank (with its end, or none for a last partial line).
    pub fn line(&self, rank: usize, stream: Stream, line: &[u8]) {
        if let Some(files) = kolo_sys::lock(&self.files[rank]).as_mut() {
            let file = match stream {
                Stream::Stdout => &mut files.stdout,
                Stream::Stderr => &mut files.stderr,
            };
            // a full disk must not take the job down; the terminal still has it
            let _ = file.write_all(line);
        }
        if stream == Stream::Stderr {
            let mut tail = kolo_sys::lock(&self.tails[rank]);
            if tail.len() == TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(String::from_utf8_lossy(line).trim_end().to_string());
        }
        let mut text = Vec::with_capacity(line.len() + 48);
        if !self.options.disable_prefix {
            if self.options.timestamp {
                // Horovod's format: asctime() right before the rank
                let now = chrono::Local::now().format("%a %b %e %H:%M:%S %Y");
                let _ = write!(text, "{now}");
            }
            let _ = write!(text, "[{}]<{}>:", self.options.first_label + rank, stream.name());
        }
        text.extend_from_slice(line);
        if !line.ends_with(b"\n") && !line.ends_with(b"\r") {
            text.push(b'\n');
        }
        let closed = &self.closed[(stream == Stream::Stderr) as usize];
        if closed.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let _guard = kolo_sys::lock(&self.terminal);
        let written = match stream {
            Stream::Stdout => write_flush(&mut io::stdout().lock(), &text),
            Stream::Stderr => write_flush(&mut io::stderr().lock(), &text),
        };
        // a closed terminal (e.g. `kolo run ... | head`) must not stop the job
        if written.is_err() {
            closed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The last stderr lines of a rank, oldest first.
    pub fn stderr_tail(&self, rank: usize) -> Vec<String> {
        kolo_sys::lock(&self.tails[rank]).iter().cloned().collect()
    }
}

/// What the output thread is asked to do, in order.
pub(crate) enum Chunk {
    /// Raw bytes of one rank's stream.
    Data { rank: u32, stream: Stream, bytes: Vec<u8> },
    /// The rank's command ended: its last partial lines go out.
    End { rank: u32 },
    /// Answered once everything queued before it is written.
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// Chunks the queue holds at most (each at most one read of a worker's
/// pipe, 64 KiB): the output memory bound, whatever the ranks print.
const QUEUE_CHUNKS: usize = 64;

/// The output thread and its queue.
pub(crate) struct OutputWriter {
    queue: tokio::sync::mpsc::Sender<Chunk>,
    sink: std::sync::Arc<OutputSink>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl OutputWriter {
    pub(crate) fn start(options: OutputOptions, ranks: usize) -> Result<OutputWriter, ExecError> {
        let sink = std::sync::Arc::new(OutputSink::new(options, ranks)?);
        let (queue, mut chunks) = tokio::sync::mpsc::channel::<Chunk>(QUEUE_CHUNKS);
        let writer = sink.clone();
        let thread = std::thread::Builder::new()
            .name("kolo-output".into())
            .spawn(move || {
                let mut splitters: Vec<[LineSplitter; 2]> = (0..ranks).map(|_| Default::default()).collect();
                while let Some(chunk) = chunks.blocking_recv() {
                    match chunk {
                        Chunk::Data { rank, stream, bytes } => {
                            let r = rank as usize;
                            splitters[r][(stream == Stream::Stderr) as usize]
                                .push(&bytes, |line| writer.line(r, stream, line));
                        }
                        Chunk::End { rank } => {
                            for (i, splitter) in splitters[rank as usize].iter_mut().enumerate() {
                                if let Some(rest) = splitter.finish() {
                                    let stream = if i == 1 { Stream::Stderr } else { Stream::Stdout };
                                    writer.line(rank as usize, stream, &rest);
                                }
                            }
                        }
                        Chunk::Flush(done) => {
                            let _ = done.send(());
                        }
                    }
                }
            })
            .map_err(|source| ExecError::Io { what: "starting the output thread".into(), source })?;
        Ok(OutputWriter { queue, sink, thread: Some(thread) })
    }

    pub(crate) fn queue(&self) -> tokio::sync::mpsc::Sender<Chunk> {
        self.queue.clone()
    }

    /// Waits until everything queued so far is written.
    pub(crate) async fn flush(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.queue.send(Chunk::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }

    pub(crate) fn stderr_tail(&self, rank: usize) -> Vec<String> {
        self.sink.stderr_tail(rank)
    }

    /// Writes what is queued and ends the thread. Returns once the senders
    /// still held elsewhere are gone too.
    pub(crate) async fn finish(mut self) {
        self.flush().await;
        let thread = self.thread.take();
        drop(self);
        if let Some(thread) = thread {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

fn write_flush(out: &mut impl Write, text: &[u8]) -> io::Result<()> {
    out.write_all(text)?;
    out.flush()
}

fn open_rank_files(dir: &Path, rank: usize, width: usize) -> Result<RankFiles, ExecError> {
    let rank_dir = dir.join(format!("rank.{rank:0width$}"));
    let io_err = |path: &Path, source| ExecError::OutputDir { path: path.to_path_buf(), source };
    std::fs::create_dir_all(&rank_dir).map_err(|e| io_err(&rank_dir, e))?;
    let open = |name: &str| {
        let path = rank_dir.join(name);
        File::create(&path).map_err(|e| io_err(&path, e))
    };
    Ok(RankFiles { stdout: open("stdout")?, stderr: open("stderr")? })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(chunks: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut s = LineSplitter::default();
        let mut out = Vec::new();
        for c in chunks {
            s.push(c, |l| out.push(l.to_vec()));
        }
        out.extend(s.finish());
        out
    }

    #[test]
    fn lines_end_at_newline_or_carriage_return() {
        assert_eq!(split(&[b"a\nb\rc"]), [b"a\n".to_vec(), b"b\r".to_vec(), b"c".to_vec()]);
        assert_eq!(split(&[b"pa", b"rt", b"ial\n", b"\n"]), [b"partial\n".to_vec(), b"\n".to_vec()]);
        assert_eq!(split(&[b"x\r\n"]), [b"x\r".to_vec(), b"\n".to_vec()]);
        assert!(split(&[b""]).is_empty());
    }

    #[test]
    fn over_long_lines_come_out_in_bounded_pieces() {
        let long = vec![b'y'; MAX_LINE * 2 + 10];
        let mut s = LineSplitter::default();
        let mut pieces = Vec::new();
        for chunk in long.chunks(1000) {
            s.push(chunk, |l| pieces.push(l.len()));
            assert!(s.pending.len() < MAX_LINE);
        }
        pieces.extend(s.finish().map(|rest| rest.len()));
        assert_eq!(pieces, [MAX_LINE, MAX_LINE, 10]);
    }

    #[test]
    fn rank_dirs_are_zero_padded_to_the_width_of_the_last_rank() {
        let dir = std::env::temp_dir().join(format!("kolo-output-test-{}", std::process::id()));
        let sink = OutputSink::new(OutputOptions { output_dir: Some(dir.clone()), ..Default::default() }, 11).unwrap();
        sink.line(3, Stream::Stdout, b"three\n");
        sink.line(10, Stream::Stderr, b"ten");
        assert_eq!(std::fs::read(dir.join("rank.03/stdout")).unwrap(), b"three\n");
        assert_eq!(std::fs::read(dir.join("rank.10/stderr")).unwrap(), b"ten");
        assert_eq!(sink.stderr_tail(10), ["ten"]);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
