//! Point to point and the collectives: allreduce (recursive doubling,
//! halving-doubling, ring, hierarchical, by size), reduce-scatter,
//! allgather, broadcast, reduce, all-to-all, gather, scatter and barrier.

use super::direct::Reach;
use super::progress::{Call, Io, Kind, Sink, Tag, P2P};
use super::{lock, Communicator, STREAM_BYTES};
use crate::dtype::{divide, reduce_into, DType, Element, ReduceOp};
use crate::schedule::{self, split_counts};
use crate::CommError;

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
pub(super) fn disjoint(
    buf: &mut [u8],
    read: std::ops::Range<usize>,
    write: std::ops::Range<usize>,
) -> (&[u8], &mut [u8]) {
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
    // ---- point to point ---------------------------------------------------

    /// Sends `buf` to member `peer`, who must `recv` as many elements.
    pub fn send<T: Element>(&mut self, buf: &[T], peer: usize) -> Result<(), CommError> {
        self.check_peer(peer)?;
        self.sent[peer] += 1;
        let tag =
            Tag { comm: self.id, seq: P2P | self.sent[peer], call: Call::of(Kind::PointToPoint, T::DTYPE, buf.len()) };
        let mut links = lock(&self.shared.links);
        self.send_recv(&mut Io { links: &mut links, tag }, Some((peer, as_bytes(buf))), None)
    }

    /// Receives into `buf` from member `peer`.
    pub fn recv<T: Element>(&mut self, buf: &mut [T], peer: usize) -> Result<(), CommError> {
        self.check_peer(peer)?;
        self.received[peer] += 1;
        let tag = Tag {
            comm: self.id,
            seq: P2P | self.received[peer],
            call: Call::of(Kind::PointToPoint, T::DTYPE, buf.len()),
        };
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
        self.collective(Call::new(Kind::Barrier), |c, io| {
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
        let call = Call::of(Kind::Allreduce, T::DTYPE, send.len()).op(op);
        self.collective(call, |c, io| c.allreduce_bytes(io, Some(as_bytes(send)), as_bytes_mut(recv), T::DTYPE, op))
    }

    /// `buf = op over all ranks' buf`, in place.
    pub fn allreduce_in_place<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let call = Call::of(Kind::Allreduce, T::DTYPE, buf.len()).op(op);
        self.collective(call, |c, io| c.allreduce_bytes(io, None, as_bytes_mut(buf), T::DTYPE, op))
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
        let direct = matches!(self.reach.get(), Reach::Untried | Reach::Yes)
            && tuning.direct_bytes.is_some_and(|b| recv.len() >= b.max(tuning.small_for(n) + 1));
        if direct && self.direct_allreduce(io, send, recv, dtype, reduce_op, op == ReduceOp::Avg)? {
            return Ok(());
        }
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
        let call = Call::of(Kind::ReduceScatter, T::DTYPE, send.len()).op(op);
        self.collective(call, |c, io| c.reduce_scatter_bytes(io, as_bytes(send), recv, counts, T::DTYPE, reduce_op))?;
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
        let call = Call::of(Kind::Allgather, T::DTYPE, recv.len());
        self.collective(call, |c, io| c.ring_allgather_chunks(io, recv, &at, c.rank))
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
        let call = Call::of(Kind::Broadcast, T::DTYPE, buf.len()).root(root);
        let buf = as_bytes_mut(buf);
        self.collective(call, |c, io| {
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
        let call = Call::of(Kind::Reduce, dtype, send.len() / dtype.size()).op(op).root(root);
        self.collective(call, |c, io| {
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

    /// Each rank sends `send_counts[p]` elements to rank p (the parts of
    /// `send` in rank order) and receives `recv_counts[p]` elements from
    /// rank p into `recv` (in rank order): a shifted pairwise exchange,
    /// one send and one receive in flight per step.
    pub fn alltoallv<T: Element>(
        &mut self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let (n, r) = (self.size(), self.rank);
        if send_counts.len() != n
            || recv_counts.len() != n
            || send_counts.iter().sum::<usize>() != send.len()
            || recv_counts.iter().sum::<usize>() != recv.len()
            || send_counts[r] != recv_counts[r]
        {
            return Err(self.bad(format!(
                "alltoall: send counts {send_counts:?} and recv counts {recv_counts:?} must have one entry per rank ({n}), sum to the send ({}) and recv ({}) lengths, and agree on this rank's own part",
                send.len(),
                recv.len()
            )));
        }
        let esize = std::mem::size_of::<T>();
        let (sat, rat) = (offsets(send_counts, esize), offsets(recv_counts, esize));
        let (send, recv) = (as_bytes(send), as_bytes_mut(recv));
        recv[rat[r]..rat[r + 1]].copy_from_slice(&send[sat[r]..sat[r + 1]]);
        self.collective(Call::of(Kind::Alltoall, T::DTYPE, 0), |c, io| {
            for k in 1..n {
                let (to, from) = ((r + k) % n, (r + n - k) % n);
                let dst = &mut recv[rat[from]..rat[from + 1]];
                let len = dst.len();
                c.send_recv(io, Some((to, &send[sat[to]..sat[to + 1]])), Some((from, len, Sink::Copy(dst))))?;
            }
            Ok(())
        })
    }

    /// A gather's or scatter's arguments checked (`root` a member, a count
    /// per member, this rank's part `part` elements long and, at the root,
    /// the whole buffer `whole` long), and each member's byte offset in the
    /// whole, of elements of `T`.
    fn rooted_offsets<T>(
        &self,
        what: &str,
        root: usize,
        counts: &[usize],
        (part, whole): (usize, usize),
    ) -> Result<Vec<usize>, CommError> {
        let (n, r) = (self.size(), self.rank);
        if root >= n || counts.len() != n || counts[r] != part {
            return Err(self.bad(format!(
                "{what}: root {root} must be a rank of this {n}-rank communicator, and counts {counts:?} have one entry per rank, this rank's equal to its part ({part} elements)"
            )));
        }
        if r == root && counts.iter().sum::<usize>() != whole {
            return Err(
                self.bad(format!("{what}: counts {counts:?} must sum to the root's whole buffer ({whole} elements)"))
            );
        }
        Ok(offsets(counts, std::mem::size_of::<T>()))
    }

    /// Rank `root` gets every rank's `send` in rank order (`counts[p]`
    /// elements from rank p) in `recv`; `recv` is left alone elsewhere.
    pub fn gatherv<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        root: usize,
    ) -> Result<(), CommError> {
        let at = self.rooted_offsets::<T>("gather", root, counts, (send.len(), recv.len()))?;
        let (n, r, send) = (self.size(), self.rank, as_bytes(send));
        let call = Call::of(Kind::Gather, T::DTYPE, 0).root(root);
        if r != root {
            return self.collective(call, |c, io| c.send_recv(io, Some((root, send)), None));
        }
        let recv = as_bytes_mut(recv);
        recv[at[r]..at[r + 1]].copy_from_slice(send);
        self.collective(call, |c, io| {
            for p in (0..n).filter(|&p| p != root) {
                let dst = &mut recv[at[p]..at[p + 1]];
                let len = dst.len();
                c.send_recv(io, None, Some((p, len, Sink::Copy(dst))))?;
            }
            Ok(())
        })
    }

    /// Each rank gets its part of rank `root`'s `send` (`counts[p]`
    /// elements for rank p, in rank order) in `recv`.
    pub fn scatterv<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        root: usize,
    ) -> Result<(), CommError> {
        let at = self.rooted_offsets::<T>("scatter", root, counts, (recv.len(), send.len()))?;
        let (n, r, recv) = (self.size(), self.rank, as_bytes_mut(recv));
        let call = Call::of(Kind::Scatter, T::DTYPE, 0).root(root);
        if r != root {
            let len = recv.len();
            return self.collective(call, |c, io| c.send_recv(io, None, Some((root, len, Sink::Copy(recv)))));
        }
        let send = as_bytes(send);
        recv.copy_from_slice(&send[at[r]..at[r + 1]]);
        self.collective(call, |c, io| {
            for p in (0..n).filter(|&p| p != root) {
                c.send_recv(io, Some((p, &send[at[p]..at[p + 1]])), None)?;
            }
            Ok(())
        })
    }
}
