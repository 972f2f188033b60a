//! Large allreduces among ranks of one host, reading the peers' buffers
//! directly (`process_vm_readv`, Linux's cross-memory attach) instead of
//! streaming every byte through the shared-memory rings.
//!
//! The ring moves each byte through a ring buffer twice per step (the
//! sender's copy in, the receiver's copy out) over 2(n-1) steps; here each
//! rank reduces its own part of the buffer from the peers' memory, a
//! cache-sized piece at a time, and then copies the other parts, already
//! reduced, straight from their owners: less than half the memory traffic,
//! and three meeting points per call instead of 2(n-1) hand-offs, which
//! matters most when ranks outnumber cores.
//!
//! A call, for every member at once:
//! 1. each tells every peer where its buffers are (a small message that
//!    carries the call's tag, so ranks that disagree still fail naming it);
//! 2. each reduces its part, reading the peers' inputs;
//! 3. all meet (every part is reduced);
//! 4. each copies the other parts from their owners;
//! 5. all meet again (no rank may return, and let its buffer change, while
//!    another still reads it).
//!
//! Whether the kernel lets ranks read each other (same user, dumpable
//! processes, no stricter ptrace policy such as Yama's
//! `kernel.yama.ptrace_scope` >= 1, no seccomp filter refusing it) is
//! found on a communicator's first large call: every rank reads each
//! peer's announcement back from the peer's memory and checks it is the
//! same bytes (which also proves the pid is the peer's and not a
//! stranger's in another pid namespace), and all ranks agree. Where any
//! pair cannot, the communicator keeps using the rings, never weakening the
//! machine's ptrace policy to get there.

use std::io::IoSliceMut;

use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::Pid;

use super::progress::{Io, Op, Sink};
use super::Communicator;
use crate::dtype::{divide, reduce_into, reduce_to, DType, ReduceOp};
use crate::link::HEAD;
use crate::schedule::parts;
use crate::CommError;

/// Bytes reduced at a time: this rank's piece of the result and the
/// piece read from a peer stay in its core's cache while every peer's
/// piece is folded in.
const PIECE: usize = 128 * 1024;

/// Whether this communicator's ranks can read each other's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Not every member is on this host, or it is turned off.
    Never,
    /// Not tried yet: the first large allreduce finds out.
    Untried,
    Yes,
    No,
}

/// What a rank tells its peers: where its input and result are, where
/// this very announcement lies in its memory (for the first call's check),
/// and a number that differs from call to call and communicator to
/// communicator, so that the check cannot pass on stale memory.
type Announce = [u64; 4];
const INPUT: usize = 0;
const RESULT: usize = 1;
const ITSELF: usize = 2;

impl Communicator {
    /// Allreduce of `recv` (in place, or from `send`) by direct reads;
    /// `Ok(false)` when the members found they cannot read each other (the
    /// caller then uses the rings, as every member does). Averages are
    /// complete on return.
    pub(super) fn direct_allreduce(
        &self,
        io: &mut Io<'_>,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        average: bool,
    ) -> Result<bool, CommError> {
        let (n, r) = (self.size(), self.rank);
        let input_ptr = send.map_or(recv.as_ptr(), |s| s.as_ptr());
        let nonce = self.id.rotate_left(32) ^ self.seq ^ (recv.len() as u64).rotate_left(17);
        let mut mine: Announce = [input_ptr as u64, recv.as_ptr() as u64, 0, nonce];
        mine[ITSELF] = mine.as_ptr() as u64;
        let mut theirs = vec![[0u64; 4]; n];
        self.meet(io, bytemuck::cast_slice(&mine), bytemuck::cast_slice_mut(&mut theirs))?;

        if self.reach.get() == Reach::Untried {
            let can = (0..n).filter(|&m| m != r).all(|m| self.reads_back(m, &theirs[m]));
            let mut flags = vec![0u64; n];
            self.meet(io, &u64::from(can).to_le_bytes(), bytemuck::cast_slice_mut(&mut flags))?;
            // peers read `mine` until they send their flag: keep it where it is
            std::hint::black_box(&mine);
            let all = can && (0..n).filter(|&m| m != r).all(|m| flags[m] == 1);
            tracing::debug!(rank = self.rank, can, all, "direct reads among this host's ranks");
            self.reach.set(if all { Reach::Yes } else { Reach::No });
            if !all {
                return Ok(false);
            }
        }

        let at = parts(recv.len(), dtype.size(), n);

        // 2. this rank's part, a piece at a time, peers in rank order after it
        self.with_scratch(io, PIECE, |io, scratch| {
            let part = at[r]..at[r + 1];
            let mut reduce_part = || -> Result<(), CommError> {
                let mut start = part.start;
                while start < part.end {
                    let end = (start + PIECE).min(part.end);
                    let piece = &mut scratch[..end - start];
                    for k in 1..n {
                        let m = (r + k) % n;
                        self.read_from(m, theirs[m][INPUT], start, piece)?;
                        let dst = &mut recv[start..end];
                        match send {
                            Some(input) if k == 1 => reduce_to(dtype, op, dst, &input[start..end], piece),
                            _ => reduce_into(dtype, op, dst, piece),
                        }
                    }
                    if average {
                        divide(dtype, &mut recv[start..end], n);
                    }
                    start = end;
                }
                Ok(())
            };
            io.poisoned_on_failure(reduce_part())
        })?;

        // 3. every part is reduced
        let mut tokens = vec![0u64; n];
        self.meet(io, &[0u8; 8], bytemuck::cast_slice_mut(&mut tokens))?;

        // 4. the other parts, from their owners
        let gathered = (1..n)
            .map(|k| (r + k) % n)
            .try_for_each(|m| self.read_from(m, theirs[m][RESULT], at[m], &mut recv[at[m]..at[m + 1]]));
        io.poisoned_on_failure(gathered)?;

        // 5. nobody reads this rank's buffer any more
        self.meet(io, &[0u8; 8], bytemuck::cast_slice_mut(&mut tokens))?;
        Ok(true)
    }

    /// Every member sends `out` to every other and receives theirs into
    /// its slot of `slots` (`out.len()` bytes per member).
    fn meet(&self, io: &mut Io<'_>, out: &[u8], slots: &mut [u8]) -> Result<(), CommError> {
        let (n, r, len) = (self.size(), self.rank, out.len());
        let tag = io.tag;
        let mut ops = Vec::with_capacity(2 * n);
        for (m, slot) in slots.chunks_mut(len).enumerate().filter(|(m, _)| *m != r) {
            let peer = self.global(m);
            ops.push(Op::Send { peer, data: out, done: 0, tag });
            ops.push(Op::Recv { peer, len, done: 0, sink: Sink::Copy(slot), tag, head: [0; HEAD] });
        }
        self.exchange(io, &mut ops)
    }

    /// Whether member `m`'s announcement reads back from its memory as
    /// the bytes it sent.
    fn reads_back(&self, m: usize, said: &Announce) -> bool {
        let mut back: Announce = [0; 4];
        match self.read_from(m, said[ITSELF], 0, bytemuck::cast_slice_mut(&mut back)) {
            Ok(()) => back == *said,
            Err(e) => {
                tracing::debug!(rank = self.rank, peer = m, error = %e, "cannot read a peer's memory; using the rings");
                false
            }
        }
    }

    /// Copies `into.len()` bytes from member `m`'s memory, `offset` bytes
    /// past the `base` it announced.
    fn read_from(&self, m: usize, base: u64, offset: usize, into: &mut [u8]) -> Result<(), CommError> {
        let global = self.global(m);
        let pid = self.shared.local_pids[global];
        // the address comes from the peer: an absurd one is its error, not a panic here
        let address = usize::try_from(base).ok().and_then(|b| b.checked_add(offset));
        let Some(address) = address.filter(|a| a.checked_add(into.len()).is_some()) else {
            return Err(CommError::Io {
                rank: global,
                source: std::io::Error::other(format!("it announced a buffer at {base:#x}, past the address space")),
            });
        };
        let mut done = 0;
        while done < into.len() {
            let remote = [RemoteIoVec { base: address + done, len: into.len() - done }];
            let mut local = [IoSliceMut::new(&mut into[done..])];
            match process_vm_readv(Pid::from_raw(pid as i32), &mut local, &remote) {
                Ok(0) => {
                    return Err(CommError::Io {
                        rank: global,
                        source: std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "its memory ended early"),
                    })
                }
                Ok(got) => done += got,
                Err(nix::errno::Errno::ESRCH) => return Err(CommError::PeerDied { rank: global, pid }),
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    return Err(CommError::Io {
                        rank: global,
                        source: std::io::Error::other(format!("cannot read its memory: {e}")),
                    })
                }
            }
        }
        Ok(())
    }
}
