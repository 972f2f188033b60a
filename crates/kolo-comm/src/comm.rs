//! The Communicator: point-to-point progress over the links, and the
//! collective algorithms built on it.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::dtype::{divide, reduce_into, reduce_to, reduce_to_streaming, stream_copy, DType, Element, ReduceOp};

/// From this many bytes per buffer, results are written with non-temporal
/// stores: two ranks' buffers no longer fit the last-level cache.
const STREAM_BYTES: usize = 8 << 20;
use crate::link::{padded, Abort, Rx, Tx, HEAD};
use crate::schedule;
use crate::CommError;

/// Algorithm choices, by size and rank count; overridable with
/// environment variables.
///
/// Measured on the 2-core development machine (`kolo bench allreduce` with
/// the variables below): with 2 ranks the ring beats recursive doubling
/// from 16 KiB (1.8 vs 2.9 us) and at 64 KiB (5.3 vs 8.9 us); with 4 ranks
/// recursive doubling wins up to 64 KiB (48 vs 113 us) and the ring beats
/// Rabenseifner from 256 KiB. Rabenseifner pays off from 8 ranks, where
/// its log2(n) steps save most over the ring's 2(n-1).
#[derive(Clone, Debug)]
pub struct Tuning {
    /// Allreduce of at most this many bytes uses recursive doubling
    /// (`KOLO_COMM_SMALL_BYTES`; default 8 KiB for 2 ranks, 64 KiB beyond).
    pub small_bytes: Option<usize>,
    /// Allreduce of at most this many bytes (and above the small size) uses
    /// recursive halving-doubling (Rabenseifner); larger ones the ring
    /// (`KOLO_COMM_MID_BYTES`; default 1 MiB from 8 ranks, none below).
    pub mid_bytes: Option<usize>,
    /// Hierarchical allreduce across hosts from this many bytes
    /// (`KOLO_COMM_HIER_BYTES`).
    pub hierarchical_bytes: usize,
    /// Most bytes of shared-memory ring per direction (`KOLO_COMM_RING_BYTES`);
    /// rings shrink as ranks per host grow.
    pub ring_bytes: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning { small_bytes: None, mid_bytes: None, hierarchical_bytes: 256 * 1024, ring_bytes: 2 << 20 }
    }
}

impl Tuning {
    /// Largest allreduce done by recursive doubling among `n` ranks.
    pub fn small_for(&self, n: usize) -> usize {
        self.small_bytes.unwrap_or(if n <= 2 { 8 << 10 } else { 64 << 10 })
    }

    /// Largest allreduce done by Rabenseifner among `n` ranks.
    pub fn mid_for(&self, n: usize) -> usize {
        self.mid_bytes.unwrap_or(if n >= 8 { 1 << 20 } else { 0 })
    }

    pub fn from_env() -> Result<Tuning, CommError> {
        let mut t = Tuning::default();
        let bytes = |name: &str| -> Result<Option<usize>, CommError> {
            match std::env::var(name) {
                Ok(v) => v.parse().map(Some).map_err(|_| CommError::Env(format!("{name}='{v}' is not a byte count"))),
                Err(_) => Ok(None),
            }
        };
        t.small_bytes = bytes("KOLO_COMM_SMALL_BYTES")?;
        t.mid_bytes = bytes("KOLO_COMM_MID_BYTES")?;
        for (name, field) in
            [("KOLO_COMM_HIER_BYTES", &mut t.hierarchical_bytes), ("KOLO_COMM_RING_BYTES", &mut t.ring_bytes)]
        {
            if let Ok(v) = std::env::var(name) {
                *field = v.parse().map_err(|_| CommError::Env(format!("{name}='{v}' is not a byte count")))?;
            }
        }
        Ok(t)
    }
}

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
    links: &'a mut Links,
    tag: Tag,
}

/// (communicator id, sequence number): every message carries the tag of
/// the call it belongs to, and a receiver checks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tag {
    comm: u64,
    seq: u64,
}

/// Sequence numbers of point-to-point messages have this bit set: they
/// count per peer, collectives per communicator.
const P2P: u64 = 1 << 63;

impl Tag {
    fn bytes(self) -> [u8; HEAD] {
        let mut b = [0u8; HEAD];
        b[..8].copy_from_slice(&self.comm.to_le_bytes());
        b[8..].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8; HEAD]) -> Tag {
        Tag {
            comm: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            seq: u64::from_le_bytes(b[8..].try_into().expect("8 bytes")),
        }
    }
}

/// The id of a communicator split from `parent`: the same on every member
/// (they all count the same splits of the parent and give the same color).
fn child_id(parent: u64, split: u64, color: u32) -> u64 {
    // splitmix64 over the three
    let mut z = parent ^ split.rotate_left(21) ^ (u64::from(color) << 40) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) & !P2P
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where received bytes go.
enum Sink<'a> {
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
    fn reduce_to(stream: bool, dst: &'a mut [u8], a: &'a [u8], dtype: DType, op: ReduceOp) -> Sink<'a> {
        if stream {
            Sink::StreamReduceTo(dst, a, dtype, op)
        } else {
            Sink::ReduceTo(dst, a, dtype, op)
        }
    }

    fn take(&mut self, offset: usize, bytes: &[u8]) {
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
enum Op<'a> {
    Send { peer: usize, data: &'a [u8], done: usize, tag: Tag },
    Recv { peer: usize, len: usize, done: usize, sink: Sink<'a>, tag: Tag, head: [u8; HEAD] },
}

impl Op<'_> {
    fn finished(&self) -> bool {
        match self {
            Op::Send { data, done, .. } => *done >= HEAD + padded(data.len()),
            Op::Recv { len, done, .. } => *done >= HEAD + padded(*len),
        }
    }
}

/// A group of ranks that run collectives together. Every member must call
/// the same collectives in the same order; ranks that call the collectives
/// of different communicators in different orders get an error that names
/// them ([`CommError::Mismatch`]), not wrong data.
///
/// Collectives take `&mut self`: a communicator is used by one thread at a
/// time. It is `Send`, not `Sync`:
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<kolo_comm::Communicator>();
/// ```
pub struct Communicator {
    pub(crate) shared: Arc<Shared>,
    /// The same on every member; carried by every message.
    pub(crate) id: u64,
    /// Collectives called so far.
    pub(crate) seq: u64,
    /// Communicators split from this one so far.
    pub(crate) splits: u64,
    /// Point-to-point messages sent to and received from each member.
    pub(crate) sent: Vec<u64>,
    pub(crate) received: Vec<u64>,
    pub(crate) _not_sync: PhantomData<std::cell::Cell<()>>,
    /// Global rank of each member, in this communicator's rank order.
    pub(crate) group: Vec<usize>,
    pub(crate) rank: usize,
    /// Node index of each member.
    pub(crate) nodes: Vec<usize>,
    /// (intra-node, inter-node) communicators for hierarchical algorithms.
    pub(crate) hierarchy: Option<Box<(Communicator, Communicator)>>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("name", &self.name())
            .field("rank", &self.rank)
            .field("size", &self.group.len())
            .finish()
    }
}

/// Element counts of `n` near-equal parts of `count` (the first parts one larger).
pub fn split_counts(count: usize, n: usize) -> Vec<usize> {
    (0..n).map(|i| count / n + usize::from(i < count % n)).collect()
}

fn offsets(counts: &[usize], esize: usize) -> Vec<usize> {
    let mut at = 0;
    let mut out = Vec::with_capacity(counts.len() + 1);
    for c in counts {
        out.push(at);
        at += c * esize;
    }
    out.push(at);
    out
}

/// A shared view of one range and a mutable view of another, disjoint range.
fn disjoint(buf: &mut [u8], read: std::ops::Range<usize>, write: std::ops::Range<usize>) -> (&[u8], &mut [u8]) {
    if read.is_empty() {
        return (&[], &mut buf[write]);
    }
    if write.is_empty() {
        return (&buf[read], &mut []);
    }
    if read.start < write.start {
        let (a, b) = buf.split_at_mut(write.start);
        (&a[read], &mut b[..write.len()])
    } else {
        let (a, b) = buf.split_at_mut(read.start);
        (&b[..read.len()], &mut a[write])
    }
}

fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

impl Communicator {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.group.len()
    }

    /// Number of distinct hosts among the members.
    pub fn num_nodes(&self) -> usize {
        let mut n = self.nodes.clone();
        n.sort_unstable();
        n.dedup();
        n.len()
    }

    fn bad(&self, what: String) -> CommError {
        CommError::BadArgs(what)
    }

    /// Moves every op to completion; on failure every link is poisoned, so
    /// the peers fail at once too instead of waiting for their timeout. The
    /// communicator is unusable afterwards.
    fn exchange(&self, io: &mut Io<'_>, ops: &mut [Op<'_>]) -> Result<(), CommError> {
        let result = self.progress(io.links, ops);
        if result.is_err() {
            for tx in io.links.tx.iter().flatten() {
                tx.abort();
            }
            for rx in io.links.rx.iter().flatten() {
                rx.abort();
            }
        }
        result
    }

    /// Moves every op to completion, interleaving them; fails when nothing
    /// moves for the timeout, or at once when a peer is gone.
    fn progress(&self, links: &mut Links, ops: &mut [Op<'_>]) -> Result<(), CommError> {
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
            if now.duration_since(since) < Duration::from_millis(5) {
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
    fn mismatch(&self, peer: usize, ours: Tag, theirs: Tag) -> CommError {
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
    fn check_peers(&self, ops: &[Op<'_>]) -> Result<(), CommError> {
        for op in ops.iter().filter(|o| !o.finished()) {
            let (Op::Send { peer, .. } | Op::Recv { peer, .. }) = op;
            let pid = self.shared.local_pids[*peer];
            if pid != 0 && !process_alive(pid) {
                return Err(CommError::PeerDied { rank: *peer, pid });
            }
        }
        Ok(())
    }

    fn global(&self, member: usize) -> usize {
        self.group[member]
    }

    fn send_recv(
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

    fn with_scratch<R>(&self, io: &mut Io<'_>, bytes: usize, f: impl FnOnce(&mut Io<'_>, &mut [u8]) -> R) -> R {
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
    fn collective<R>(&mut self, f: impl FnOnce(&Self, &mut Io<'_>) -> Result<R, CommError>) -> Result<R, CommError> {
        self.seq += 1;
        let tag = Tag { comm: self.id, seq: self.seq };
        let mut links = lock(&self.shared.links);
        f(self, &mut Io { links: &mut links, tag })
    }

    /// This communicator's name in errors: "world", or how it was split.
    pub fn name(&self) -> String {
        lock(&self.shared.names).get(&self.id).cloned().unwrap_or_else(|| format!("{:#x}", self.id))
    }

    // ---- point to point ---------------------------------------------------

    /// Sends `buf` to member `peer`, who must `recv` as many elements.
    pub fn send<T: Element>(&mut self, buf: &[T], peer: usize) -> Result<(), CommError> {
        self.check_peer(peer)?;
        self.sent[peer] += 1;
        let tag = Tag { comm: self.id, seq: P2P | self.sent[peer] };
        let mut links = lock(&self.shared.links);
        self.send_recv(&mut Io { links: &mut links, tag }, Some((peer, as_bytes(buf))), None)
    }

    /// Receives into `buf` from member `peer`.
    pub fn recv<T: Element>(&mut self, buf: &mut [T], peer: usize) -> Result<(), CommError> {
        self.check_peer(peer)?;
        self.received[peer] += 1;
        let tag = Tag { comm: self.id, seq: P2P | self.received[peer] };
        let b = as_bytes_mut(buf);
        let mut links = lock(&self.shared.links);
        self.send_recv(&mut Io { links: &mut links, tag }, None, Some((peer, b.len(), Sink::Copy(b))))
    }

    fn check_peer(&self, peer: usize) -> Result<(), CommError> {
        if peer >= self.size() || peer == self.rank {
            return Err(self.bad(format!("peer {peer} is not another rank of this {}-rank communicator", self.size())));
        }
        Ok(())
    }

    // ---- collectives ------------------------------------------------------

    /// Every rank waits until all have arrived.
    pub fn barrier(&mut self) -> Result<(), CommError> {
        self.collective(|c, io| {
            let (n, r) = (c.size(), c.rank);
            let token = [0u8; 8];
            let mut sink = [0u8; 8];
            let mut k = 1;
            while k < n {
                c.send_recv(io, Some(((r + k) % n, &token)), Some(((r + n - k) % n, 8, Sink::Copy(&mut sink))))?;
                k <<= 1;
            }
            Ok(())
        })
    }

    /// `recv = op over all ranks' send`, out of place.
    pub fn allreduce<T: Element>(&mut self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        if send.len() != recv.len() {
            return Err(self.bad(format!("allreduce: send has {} elements, recv {}", send.len(), recv.len())));
        }
        self.collective(|c, io| c.allreduce_bytes(io, Some(as_bytes(send)), as_bytes_mut(recv), T::DTYPE, op))
    }

    /// `buf = op over all ranks' buf`, in place.
    pub fn allreduce_in_place<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.collective(|c, io| c.allreduce_bytes(io, None, as_bytes_mut(buf), T::DTYPE, op))
    }

    pub(crate) fn allreduce_bytes(
        &self,
        io: &mut Io<'_>,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let n = self.size();
        if n == 1 || recv.is_empty() {
            if let Some(send) = send {
                recv.copy_from_slice(send);
            }
            return Ok(());
        }
        let tuning = &self.shared.tuning;
        let reduce_op = op.combining();
        match (&self.hierarchy, recv.len()) {
            (_, len) if len <= tuning.small_for(n) => {
                if let Some(s) = send {
                    recv.copy_from_slice(s);
                }
                self.recursive_doubling(io, recv, dtype, reduce_op)?;
            }
            (Some(h), len) if len >= tuning.hierarchical_bytes => {
                self.hierarchical(io, send, recv, dtype, reduce_op, h)?;
            }
            (_, len) if len <= tuning.mid_for(n) => {
                if let Some(s) = send {
                    recv.copy_from_slice(s);
                }
                self.halving_doubling(io, recv, dtype, reduce_op)?;
            }
            // the ring reads an out-of-place input directly: no copy first
            _ => self.ring_allreduce(io, send, recv, dtype, reduce_op)?,
        }
        if op == ReduceOp::Avg {
            divide(dtype, recv, n);
        }
        Ok(())
    }

    /// Latency-bound sizes: log2(n) exchanges of the whole buffer; ranks
    /// beyond the largest power of two fold into a partner first.
    fn recursive_doubling(&self, io: &mut Io<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), CommError> {
        let steps = schedule::recursive_doubling(self.size(), self.rank, buf.len());
        self.run_schedule(io, &steps, None, buf, dtype, op)
    }

    /// Mid sizes (Rabenseifner): reduce-scatter by recursive halving, then
    /// allgather by recursive doubling: log2(n) steps moving n-1/n of the
    /// buffer. Ranks beyond the largest power of two fold in first.
    fn halving_doubling(&self, io: &mut Io<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), CommError> {
        let steps = schedule::halving_doubling(self.size(), self.rank, buf.len(), dtype.size());
        self.run_schedule(io, &steps, None, buf, dtype, op)
    }

    /// Bandwidth-bound sizes: ring reduce-scatter then ring allgather, each
    /// step streamed through the links in segments. Out of place, the ring
    /// reads the input directly: no copy first.
    fn ring_allreduce(
        &self,
        io: &mut Io<'_>,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let steps = schedule::ring(self.size(), self.rank, recv.len(), dtype.size());
        self.run_schedule(io, &steps, send, recv, dtype, op)
    }

    /// Runs this rank's steps of a schedule over `buf`. With an
    /// out-of-place `input`, a reduce step computes `input op incoming`
    /// and the first step sends from `input` (the ring's shape: every later
    /// send reads a range received before, which the schedule tests check).
    fn run_schedule(
        &self,
        io: &mut Io<'_>,
        steps: &[schedule::Step],
        input: Option<&[u8]>,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        use schedule::Apply;
        let stream = buf.len() >= STREAM_BYTES;
        for (i, step) in steps.iter().enumerate() {
            let overlap = match (&step.send, &step.recv) {
                (Some((_, s)), Some((_, r, _))) => s.start < r.end && r.start < s.end,
                _ => false,
            };
            if overlap {
                // the same bytes go out and come in: receive aside, then apply
                let (Some((to, sr)), Some((from, rr, apply))) = (&step.send, &step.recv) else { unreachable!() };
                let len = rr.len();
                self.with_scratch(io, len, |io, scratch| -> Result<(), CommError> {
                    self.send_recv(io, Some((*to, &buf[sr.clone()])), Some((*from, len, Sink::Copy(scratch))))?;
                    match (apply, input) {
                        (Apply::Copy, _) => buf[rr.clone()].copy_from_slice(scratch),
                        (Apply::Reduce, None) => reduce_into(dtype, op, &mut buf[rr.clone()], scratch),
                        (Apply::Reduce, Some(_)) => unreachable!("out of place only with disjoint ranges"),
                    }
                    Ok(())
                })?;
                continue;
            }
            let empty = 0..0;
            let sr = step.send.as_ref().map_or(empty.clone(), |(_, r)| r.clone());
            let rr = step.recv.as_ref().map_or(empty, |(_, r, _)| r.clone());
            let (from_buf, dst) = disjoint(buf, sr.clone(), rr.clone());
            let data = match input {
                Some(input) if i == 0 => &input[sr],
                _ => from_buf,
            };
            let send = step.send.as_ref().map(|(to, _)| (*to, data));
            let recv = step.recv.as_ref().map(|(from, _, apply)| {
                let len = dst.len();
                let sink = match (apply, input) {
                    (Apply::Copy, _) if stream => Sink::StreamCopy(dst),
                    (Apply::Copy, _) => Sink::Copy(dst),
                    (Apply::Reduce, None) => Sink::Reduce(dst, dtype, op),
                    (Apply::Reduce, Some(input)) => Sink::reduce_to(stream, dst, &input[rr.clone()], dtype, op),
                };
                (*from, len, sink)
            });
            self.send_recv(io, send, recv)?;
        }
        Ok(())
    }

    /// Ring allgather over `buf` split at `at`; this rank starts owning chunk `own`.
    fn ring_allgather_chunks(
        &self,
        io: &mut Io<'_>,
        buf: &mut [u8],
        at: &[usize],
        own: usize,
    ) -> Result<(), CommError> {
        let (n, r) = (self.size(), self.rank);
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let stream = buf.len() >= STREAM_BYTES;
        for s in 0..n - 1 {
            let out = (own + n - s) % n;
            let inc = (own + 2 * n - s - 1) % n;
            let (data, dst) = disjoint(buf, at[out]..at[out + 1], at[inc]..at[inc + 1]);
            let len = dst.len();
            let sink = if stream { Sink::StreamCopy(dst) } else { Sink::Copy(dst) };
            self.send_recv(io, Some((next, data)), Some((prev, len, sink)))?;
        }
        Ok(())
    }

    /// Across hosts: reduce-scatter within each host, allreduce of each
    /// shard between hosts, allgather within each host.
    fn hierarchical(
        &self,
        io: &mut Io<'_>,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        (local, cross): &(Communicator, Communicator),
    ) -> Result<(), CommError> {
        let esize = dtype.size();
        let counts = split_counts(recv.len() / esize, local.size());
        let at = offsets(&counts, esize);
        let mine = at[local.rank]..at[local.rank + 1];
        match send {
            Some(input) => local.reduce_scatter_bytes(io, input, &mut recv[mine.clone()], &counts, dtype, op)?,
            None => {
                let input = recv.to_vec();
                local.reduce_scatter_bytes(io, &input, &mut recv[mine.clone()], &counts, dtype, op)?
            }
        }
        cross.allreduce_bytes(io, None, &mut recv[mine], dtype, op)?;
        local.ring_allgather_chunks(io, recv, &at, local.rank)
    }

    /// Each rank gets its part (`counts` elements per rank) of the reduction.
    /// `recv` holds `counts[rank]` elements.
    pub fn reduce_scatter_counts<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        if counts.len() != self.size() || counts.iter().sum::<usize>() != send.len() || recv.len() != counts[self.rank]
        {
            return Err(self.bad(format!(
                "reduce_scatter: counts {counts:?} must have one entry per rank ({}), sum to the send length ({}) and give this rank's recv length ({})",
                self.size(),
                send.len(),
                recv.len()
            )));
        }
        let recv = as_bytes_mut(recv);
        let reduce_op = op.combining();
        self.collective(|c, io| c.reduce_scatter_bytes(io, as_bytes(send), recv, counts, T::DTYPE, reduce_op))?;
        if op == ReduceOp::Avg {
            divide(T::DTYPE, recv, self.size());
        }
        Ok(())
    }

    /// Near-equal parts: rank r gets `split_counts(send.len(), size)[r]` elements.
    pub fn reduce_scatter<T: Element>(&mut self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.reduce_scatter_counts(send, recv, &split_counts(send.len(), self.size()), op)
    }

    fn reduce_scatter_bytes(
        &self,
        io: &mut Io<'_>,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (n, r) = (self.size(), self.rank);
        let at = offsets(counts, dtype.size());
        let range = |c: usize| at[c]..at[c + 1];
        if n == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        self.with_scratch(io, send.len(), |io, acc| -> Result<(), CommError> {
            for s in 0..n - 1 {
                let out = (r + 2 * n - s - 1) % n;
                let inc = (r + 2 * n - s - 2) % n;
                let last = s == n - 2;
                // the last step lands in the caller's buffer
                let (data, dst): (&[u8], &mut [u8]) = if s == 0 {
                    (&send[range(out)], if last { &mut *recv } else { &mut acc[range(inc)] })
                } else if last {
                    (&acc[range(out)], &mut *recv)
                } else {
                    disjoint(acc, range(out), range(inc))
                };
                let len = dst.len();
                self.send_recv(
                    io,
                    Some((next, data)),
                    Some((prev, len, Sink::ReduceTo(dst, &send[range(inc)], dtype, op))),
                )?;
            }
            Ok(())
        })
    }

    /// Every rank gets every rank's `send`, in rank order (equal sizes).
    pub fn allgather<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        self.allgatherv(send, recv, &vec![send.len(); self.size()])
    }

    /// Every rank gets every rank's `send` (`counts[r]` elements from rank r).
    pub fn allgatherv<T: Element>(&mut self, send: &[T], recv: &mut [T], counts: &[usize]) -> Result<(), CommError> {
        if counts.len() != self.size() || counts[self.rank] != send.len() || counts.iter().sum::<usize>() != recv.len()
        {
            return Err(self.bad(format!(
                "allgather: counts {counts:?} must have one entry per rank ({}), this rank's equal to its send length ({}), and sum to the recv length ({})",
                self.size(),
                send.len(),
                recv.len()
            )));
        }
        let at = offsets(counts, std::mem::size_of::<T>());
        let recv = as_bytes_mut(recv);
        recv[at[self.rank]..at[self.rank + 1]].copy_from_slice(as_bytes(send));
        self.collective(|c, io| c.ring_allgather_chunks(io, recv, &at, c.rank))
    }

    /// Rank `root`'s bytes, of a length only it knows, to every rank: the
    /// length first, then the bytes. Other ranks' `bytes` are replaced.
    pub fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        let mut len = [if self.rank == root { bytes.len() as i64 } else { 0 }];
        self.broadcast(&mut len, root)?;
        let len = usize::try_from(len[0])
            .map_err(|_| CommError::BadArgs(format!("rank {root} sent a negative length ({})", len[0])))?;
        bytes.resize(len, 0);
        self.broadcast(bytes, root)
    }

    /// Rank `root`'s `buf` to every rank (binomial tree).
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        let n = self.size();
        if root >= n {
            return Err(self.bad(format!("broadcast: root {root} is not a rank of this {n}-rank communicator")));
        }
        let buf = as_bytes_mut(buf);
        self.collective(|c, io| {
            let vr = (c.rank + n - root) % n;
            let real = |v: usize| (v + root) % n;
            let mut mask = 1;
            while mask < n {
                if vr & mask != 0 {
                    let len = buf.len();
                    c.send_recv(io, None, Some((real(vr - mask), len, Sink::Copy(buf))))?;
                    break;
                }
                mask <<= 1;
            }
            mask >>= 1;
            while mask > 0 {
                if vr + mask < n {
                    c.send_recv(io, Some((real(vr + mask), buf)), None)?;
                }
                mask >>= 1;
            }
            Ok(())
        })
    }

    /// `recv` on rank `root` = op over all ranks' `send` (binomial tree);
    /// `recv` is left alone elsewhere.
    pub fn reduce<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CommError> {
        let n = self.size();
        if root >= n {
            return Err(self.bad(format!("reduce: root {root} is not a rank of this {n}-rank communicator")));
        }
        if self.rank == root && recv.len() != send.len() {
            return Err(self.bad(format!("reduce: send has {} elements, the root's recv {}", send.len(), recv.len())));
        }
        let dtype = T::DTYPE;
        let reduce_op = op.combining();
        let send = as_bytes(send);
        let vr = (self.rank + n - root) % n;
        let real = |v: usize| (v + root) % n;
        let is_root = self.rank == root;
        self.collective(|c, io| {
            let run = |io: &mut Io<'_>, acc: &mut [u8]| -> Result<(), CommError> {
                acc.copy_from_slice(send);
                let len = acc.len();
                let mut mask = 1;
                while mask < n {
                    if vr & mask == 0 {
                        if vr | mask < n {
                            c.send_recv(io, None, Some((real(vr | mask), len, Sink::Reduce(acc, dtype, reduce_op))))?;
                        }
                    } else {
                        return c.send_recv(io, Some((real(vr & !mask), acc)), None);
                    }
                    mask <<= 1;
                }
                Ok(())
            };
            if is_root {
                let recv = as_bytes_mut(recv);
                run(io, recv)?;
                if op == ReduceOp::Avg {
                    divide(dtype, recv, n);
                }
                Ok(())
            } else {
                c.with_scratch(io, send.len(), run)
            }
        })
    }

    /// A communicator of the members that gave the same `color`, ordered by
    /// `key` (then by rank). Collective: every member calls it.
    pub fn split(&mut self, color: u32, key: u32) -> Result<Communicator, CommError> {
        self.split_named(color, key, &format!("split {color}"))
    }

    fn split_named(&mut self, color: u32, key: u32, what: &str) -> Result<Communicator, CommError> {
        let mine = [(u64::from(color) << 32 | u64::from(key)) as i64];
        let mut all = vec![0i64; self.size()];
        self.allgather(&mine, &mut all)?;
        let mut members: Vec<(u32, usize)> =
            (0..self.size()).filter(|&m| (all[m] as u64 >> 32) as u32 == color).map(|m| (all[m] as u32, m)).collect();
        members.sort_unstable();
        let rank = members.iter().position(|&(_, m)| m == self.rank).expect("this rank gave its own color");
        self.splits += 1;
        let id = child_id(self.id, self.splits, color);
        let name = format!("{}/{what} #{}", self.name(), self.splits);
        lock(&self.shared.names).insert(id, name);
        Ok(Communicator::new(
            self.shared.clone(),
            id,
            members.iter().map(|&(_, m)| self.group[m]).collect(),
            rank,
            members.iter().map(|&(_, m)| self.nodes[m]).collect(),
        ))
    }

    pub(crate) fn new(shared: Arc<Shared>, id: u64, group: Vec<usize>, rank: usize, nodes: Vec<usize>) -> Communicator {
        let n = group.len();
        Communicator {
            shared,
            id,
            seq: 0,
            splits: 0,
            sent: vec![0; n],
            received: vec![0; n],
            _not_sync: PhantomData,
            group,
            rank,
            nodes,
            hierarchy: None,
        }
    }

    /// The members on this host.
    pub fn split_local(&mut self) -> Result<Communicator, CommError> {
        self.split_named(self.nodes[self.rank] as u32, self.rank as u32, "local")
    }

    /// The members with the same local rank on every host.
    pub fn split_cross(&mut self) -> Result<Communicator, CommError> {
        let local_rank = (0..self.rank).filter(|&m| self.nodes[m] == self.nodes[self.rank]).count();
        self.split_named(local_rank as u32, self.rank as u32, "cross")
    }

    /// Sets up hierarchical algorithms when the members span hosts with the
    /// same number of ranks on each (collective).
    pub(crate) fn build_hierarchy(&mut self) -> Result<(), CommError> {
        let nodes = self.num_nodes();
        if nodes < 2 || nodes == self.size() {
            return Ok(());
        }
        let per_node: Vec<usize> = (0..nodes).map(|i| self.nodes.iter().filter(|&&n| n == i).count()).collect();
        if per_node.iter().any(|&c| c != per_node[0]) {
            return Ok(());
        }
        let local = self.split_local()?;
        let cross = self.split_cross()?;
        self.hierarchy = Some(Box::new((local, cross)));
        Ok(())
    }
}

fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()), Some("Z" | "X")),
        Err(_) => false,
    }
}
