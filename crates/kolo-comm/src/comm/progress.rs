//! Point-to-point progress: the links shared by a communicator and those
//! split from it, the tag every message carries, and moving a set of
//! messages to completion (interleaved, with the timeout and dead-peer
//! checks).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{lock, process_alive, Communicator, Tuning};
use crate::dtype::{reduce_into, reduce_to, reduce_to_streaming, stream_copy, DType, ReduceOp};
use crate::link::{padded, Abort, Rx, Tx, HEAD};
use crate::CommError;

/// Links and state shared by a communicator and those split from it.
pub(crate) struct Shared {
    pub me: usize,
    /// Held for a whole collective, so that the messages of two calls
    /// never interleave on a link.
    pub links: Mutex<Links>,
    /// Pid of every rank on this host (to notice a dead peer early), 0 elsewhere.
    pub local_pids: Vec<u32>,
    pub timeout: Duration,
    pub tuning: Tuning,
    /// Ends waits when an elastic job's round is over.
    pub interrupt: Option<crate::Interrupt>,
    /// Names of the communicators this rank made, by id, for errors.
    pub names: Mutex<HashMap<u64, String>>,
}

/// A link per peer in each direction (by global rank), and the scratch
/// space of the collectives.
pub(crate) struct Links {
    pub tx: Vec<Option<Tx>>,
    pub rx: Vec<Option<Rx>>,
    pub scratch: Vec<u64>,
}

/// What a collective holds while it runs: the links, and the tag its
/// messages carry.
pub(crate) struct Io<'a> {
    pub(super) links: &'a mut Links,
    pub(super) tag: Tag,
}

impl Io<'_> {
    /// Poisons every link, so the peers fail at once too instead of
    /// waiting for their timeout.
    fn abort_all(&self) {
        for tx in self.links.tx.iter().flatten() {
            tx.abort();
        }
        for rx in self.links.rx.iter().flatten() {
            rx.abort();
        }
    }

    /// `result`, having poisoned every link if it is a failure.
    pub(super) fn poisoned_on_failure<R>(&self, result: Result<R, CommError>) -> Result<R, CommError> {
        if result.is_err() {
            self.abort_all();
        }
        result
    }
}

/// (communicator id, sequence number, what the call is): every message
/// carries the tag of the call it belongs to, and a receiver checks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tag {
    pub(super) comm: u64,
    pub(super) seq: u64,
    pub(super) call: Call,
}

/// What a call is, as every rank must agree on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Call {
    pub(crate) kind: Kind,
    pub(crate) dtype: Option<DType>,
    pub(crate) op: Option<ReduceOp>,
    pub(crate) root: u32,
    /// Elements every rank passes (0 where they may differ, as in allgatherv).
    pub(crate) count: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    Unknown = 0,
    Barrier,
    Allreduce,
    ReduceScatter,
    Allgather,
    Broadcast,
    Reduce,
    Alltoall,
    Gather,
    Scatter,
    PointToPoint,
    Adasum,
}

impl Kind {
    const ALL: [Kind; 12] = [
        Kind::Unknown,
        Kind::Barrier,
        Kind::Allreduce,
        Kind::ReduceScatter,
        Kind::Allgather,
        Kind::Broadcast,
        Kind::Reduce,
        Kind::Alltoall,
        Kind::Gather,
        Kind::Scatter,
        Kind::PointToPoint,
        Kind::Adasum,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Unknown => "an unknown call",
            Kind::Barrier => "barrier",
            Kind::Allreduce => "allreduce",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Allgather => "allgather",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::Alltoall => "alltoall",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::PointToPoint => "send/recv",
            Kind::Adasum => "adasum",
        }
    }
}

impl Call {
    pub(crate) fn new(kind: Kind) -> Call {
        Call { kind, dtype: None, op: None, root: 0, count: 0 }
    }

    pub(crate) fn of(kind: Kind, dtype: DType, count: usize) -> Call {
        Call { dtype: Some(dtype), count: count as u64, ..Call::new(kind) }
    }

    pub(crate) fn op(self, op: ReduceOp) -> Call {
        Call { op: Some(op), ..self }
    }

    pub(crate) fn root(self, root: usize) -> Call {
        Call { root: root as u32, ..self }
    }

    fn bytes(self) -> [u8; 16] {
        let code = |i: Option<usize>| i.map_or(0, |i| i as u8 + 1);
        let mut b = [0u8; 16];
        b[0] = self.kind as u8;
        b[1] = code(self.dtype.and_then(|d| DType::ALL.iter().position(|x| *x == d)));
        b[2] = code(self.op.and_then(|o| ReduceOp::ALL.iter().position(|x| *x == o)));
        b[4..8].copy_from_slice(&self.root.to_le_bytes());
        b[8..].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8]) -> Call {
        let pick = |code: u8| (code as usize).checked_sub(1);
        Call {
            kind: Kind::ALL.get(b[0] as usize).copied().unwrap_or(Kind::Unknown),
            dtype: pick(b[1]).and_then(|i| DType::ALL.get(i).copied()),
            op: pick(b[2]).and_then(|i| ReduceOp::ALL.get(i).copied()),
            root: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            count: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        }
    }
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.kind.name())?;
        if let Some(op) = self.op {
            write!(f, "({})", op.name())?;
        }
        if matches!(self.kind, Kind::Broadcast | Kind::Reduce | Kind::Gather | Kind::Scatter) {
            write!(f, " with root {}", self.root)?;
        }
        match (self.count, self.dtype) {
            (0, Some(d)) => write!(f, " of {}", d.name()),
            (n, Some(d)) => write!(f, " of {n} {}", d.name()),
            _ => Ok(()),
        }
    }
}

/// Sequence numbers of point-to-point messages have this bit set: they
/// count per peer, collectives per communicator.
pub(super) const P2P: u64 = 1 << 63;

impl Tag {
    pub(super) fn bytes(self) -> [u8; HEAD] {
        let mut b = [0u8; HEAD];
        b[..8].copy_from_slice(&self.comm.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..].copy_from_slice(&self.call.bytes());
        b
    }

    pub(super) fn from_bytes(b: &[u8; HEAD]) -> Tag {
        Tag {
            comm: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            seq: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            call: Call::from_bytes(&b[16..]),
        }
    }
}

/// Where received bytes go.
pub(super) enum Sink<'a> {
    Copy(&'a mut [u8]),
    /// Copy with non-temporal stores (results larger than the caches).
    StreamCopy(&'a mut [u8]),
    /// `dst op= incoming`
    Reduce(&'a mut [u8], DType, ReduceOp),
    /// `dst = a op incoming`
    ReduceTo(&'a mut [u8], &'a [u8], DType, ReduceOp),
    /// `ReduceTo` with non-temporal stores.
    StreamReduceTo(&'a mut [u8], &'a [u8], DType, ReduceOp),
}

impl<'a> Sink<'a> {
    pub(super) fn reduce_to(stream: bool, dst: &'a mut [u8], a: &'a [u8], dtype: DType, op: ReduceOp) -> Sink<'a> {
        if stream {
            Sink::StreamReduceTo(dst, a, dtype, op)
        } else {
            Sink::ReduceTo(dst, a, dtype, op)
        }
    }

    pub(super) fn take(&mut self, offset: usize, bytes: &[u8]) {
        let end = offset + bytes.len();
        match self {
            Sink::Copy(dst) => dst[offset..end].copy_from_slice(bytes),
            Sink::Reduce(dst, dtype, op) => reduce_into(*dtype, *op, &mut dst[offset..end], bytes),
            Sink::ReduceTo(dst, a, dtype, op) => reduce_to(*dtype, *op, &mut dst[offset..end], &a[offset..end], bytes),
            Sink::StreamCopy(dst) => stream_copy(&mut dst[offset..end], bytes),
            Sink::StreamReduceTo(dst, a, dtype, op) => {
                reduce_to_streaming(*dtype, *op, &mut dst[offset..end], &a[offset..end], bytes)
            }
        }
    }
}

/// One message to move; `done` counts its head too.
pub(super) enum Op<'a> {
    Send { peer: usize, data: &'a [u8], done: usize, tag: Tag },
    Recv { peer: usize, len: usize, done: usize, sink: Sink<'a>, tag: Tag, head: [u8; HEAD] },
}

impl Op<'_> {
    pub(super) fn finished(&self) -> bool {
        match self {
            Op::Send { data, done, .. } => *done >= HEAD + padded(data.len()),
            Op::Recv { len, done, .. } => *done >= HEAD + padded(*len),
        }
    }
}

impl Communicator {
    /// Moves every op to completion; on failure every link is poisoned, so
    /// the peers fail at once too instead of waiting for their timeout. The
    /// communicator is unusable afterwards.
    pub(super) fn exchange(&self, io: &mut Io<'_>, ops: &mut [Op<'_>]) -> Result<(), CommError> {
        let result = self.progress(io.links, ops);
        io.poisoned_on_failure(result)
    }

    /// Moves every op to completion, interleaving them; fails when nothing
    /// moves for the timeout, or at once when a peer is gone.
    pub(super) fn progress(&self, links: &mut Links, ops: &mut [Op<'_>]) -> Result<(), CommError> {
        let shared = &*self.shared;
        let mut idle_rounds: u32 = 0;
        let mut idle_since: Option<Instant> = None;
        let mut last_check = Instant::now();
        loop {
            let mut progressed = false;
            let mut all_done = true;
            for op in ops.iter_mut() {
                if op.finished() {
                    continue;
                }
                match op {
                    Op::Send { peer, data, done, tag } => {
                        let tx = links.tx[*peer].as_mut().ok_or(CommError::NoLink(*peer))?;
                        let n = tx
                            .progress_message(&tag.bytes(), data, *done)
                            .map_err(|e| CommError::Io { rank: *peer, source: e })?;
                        *done += n;
                        progressed |= n > 0;
                    }
                    Op::Recv { peer, len, done, sink, tag, head } => {
                        let rx = links.rx[*peer].as_mut().ok_or(CommError::NoLink(*peer))?;
                        let io_err = |e| CommError::Io { rank: *peer, source: e };
                        if *done < HEAD {
                            let n = rx
                                .progress(HEAD, *done, |off, bytes| head[off..off + bytes.len()].copy_from_slice(bytes))
                                .map_err(io_err)?;
                            *done += n;
                            progressed |= n > 0;
                            if *done < HEAD {
                                all_done = false;
                                continue;
                            }
                            let theirs = Tag::from_bytes(head);
                            if theirs != *tag {
                                return Err(self.mismatch(*peer, *tag, theirs));
                            }
                        }
                        let n = rx.progress(*len, *done - HEAD, |off, bytes| sink.take(off, bytes)).map_err(io_err)?;
                        *done += n;
                        progressed |= n > 0;
                    }
                }
                all_done &= op.finished();
            }
            if all_done {
                return Ok(());
            }
            if progressed {
                idle_rounds = 0;
                idle_since = None;
                continue;
            }
            idle_rounds += 1;
            // spin, then yield, then nap: fast when peers are running,
            // polite when ranks outnumber cores
            if idle_rounds < 256 {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            let since = *idle_since.get_or_insert(now);
            // yielding (not sleeping) for the first milliseconds keeps two
            // ranks that share a core handing it back and forth quickly
            if now.duration_since(since) < shared.tuning.yield_window {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
            if now.duration_since(last_check) > Duration::from_millis(50) {
                last_check = now;
                self.check_peers(ops)?;
                if let Some(interrupt) = &shared.interrupt {
                    interrupt.check()?;
                }
            }
            if now.duration_since(since) > shared.timeout {
                let mut waiting: Vec<usize> = ops
                    .iter()
                    .filter(|o| !o.finished())
                    .map(|o| match o {
                        Op::Send { peer, .. } | Op::Recv { peer, .. } => *peer,
                    })
                    .collect();
                waiting.sort_unstable();
                waiting.dedup();
                return Err(CommError::Timeout { seconds: shared.timeout.as_secs_f64(), waiting });
            }
        }
    }

    /// Names what each side was in when their messages did not match.
    pub(super) fn mismatch(&self, peer: usize, ours: Tag, theirs: Tag) -> CommError {
        if (ours.comm, ours.seq) == (theirs.comm, theirs.seq) {
            return CommError::Disagree {
                rank: self.group.iter().position(|&g| g == peer).unwrap_or(peer),
                ours: ours.call.to_string(),
                theirs: theirs.call.to_string(),
            };
        }
        let names = lock(&self.shared.names);
        let describe = |t: Tag| {
            let comm = match names.get(&t.comm) {
                Some(name) => format!("communicator '{name}'"),
                None => format!("a communicator unknown here (id {:#x})", t.comm),
            };
            if t.seq & P2P != 0 {
                format!("point-to-point message #{} of {comm}", t.seq & !P2P)
            } else {
                format!("collective #{} of {comm}", t.seq)
            }
        };
        CommError::Mismatch { rank: peer, ours: describe(ours), theirs: describe(theirs) }
    }

    /// A peer on this host whose process is gone will never move its ring.
    pub(super) fn check_peers(&self, ops: &[Op<'_>]) -> Result<(), CommError> {
        for op in ops.iter().filter(|o| !o.finished()) {
            let (Op::Send { peer, .. } | Op::Recv { peer, .. }) = op;
            let pid = self.shared.local_pids[*peer];
            if pid != 0 && !process_alive(pid) {
                return Err(CommError::PeerDied { rank: *peer, pid });
            }
        }
        Ok(())
    }

    pub(super) fn global(&self, member: usize) -> usize {
        self.group[member]
    }

    pub(super) fn send_recv(
        &self,
        io: &mut Io<'_>,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, usize, Sink<'_>)>,
    ) -> Result<(), CommError> {
        let tag = io.tag;
        match (send, recv) {
            (Some((to, data)), Some((from, len, sink))) => {
                let mut ops = [
                    Op::Send { peer: self.global(to), data, done: 0, tag },
                    Op::Recv { peer: self.global(from), len, done: 0, sink, tag, head: [0; HEAD] },
                ];
                self.exchange(io, &mut ops)
            }
            (Some((to, data)), None) => {
                self.exchange(io, &mut [Op::Send { peer: self.global(to), data, done: 0, tag }])
            }
            (None, Some((from, len, sink))) => {
                self.exchange(io, &mut [Op::Recv { peer: self.global(from), len, done: 0, sink, tag, head: [0; HEAD] }])
            }
            (None, None) => Ok(()),
        }
    }

    pub(super) fn with_scratch<R>(
        &self,
        io: &mut Io<'_>,
        bytes: usize,
        f: impl FnOnce(&mut Io<'_>, &mut [u8]) -> R,
    ) -> R {
        let mut scratch = std::mem::take(&mut io.links.scratch);
        if scratch.len() * 8 < bytes {
            // grows to the largest size used, once; never per call
            scratch.resize(bytes.div_ceil(8), 0);
        }
        let bytes_view: &mut [u8] = bytemuck::cast_slice_mut(&mut scratch[..]);
        let result = f(io, &mut bytes_view[..bytes]);
        io.links.scratch = scratch;
        result
    }

    /// Runs one collective: its own sequence number, and the links held
    /// throughout (internal hierarchical steps run under the same hold).
    pub(super) fn collective<R>(
        &mut self,
        call: Call,
        f: impl FnOnce(&Self, &mut Io<'_>) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        self.seq += 1;
        let bytes = call.count * call.dtype.map_or(0, |d| d.size() as u64);
        // `kolo run --timeline`: one check when off
        let traced = kolo_timeline::Collective::begin(call.kind.name(), (self.id, self.seq), bytes);
        let tag = Tag { comm: self.id, seq: self.seq, call };
        let mut links = lock(&self.shared.links);
        let out = f(self, &mut Io { links: &mut links, tag });
        if let Some(traced) = traced {
            traced.end(out.is_ok());
        }
        out
    }

    /// This communicator's name in errors: "world", or how it was split.
    pub fn name(&self) -> String {
        lock(&self.shared.names).get(&self.id).cloned().unwrap_or_else(|| format!("{:#x}", self.id))
    }
}
