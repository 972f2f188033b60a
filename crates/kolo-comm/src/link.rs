//! One direction of a connection between two ranks: a shared-memory ring
//! within a host, a TCP stream between hosts. Both move messages padded to
//! 8 bytes, without blocking; the progress loop in `comm` drives them.

use std::io::{self, Read, Write};
use std::net::TcpStream;

use crate::shm::{Ring, SEGMENT};

pub(crate) fn padded(len: usize) -> usize {
    len.next_multiple_of(8)
}

pub(crate) enum Tx {
    Shm(Ring),
    Tcp(TcpStream),
}

pub(crate) enum Rx {
    Shm(Ring),
    Tcp(TcpRx),
}

pub(crate) struct TcpRx {
    stream: TcpStream,
    /// Read-ahead, in u64 so that what it hands out is 8-byte aligned.
    stage: Vec<u64>,
    start: usize,
    end: usize,
}

impl TcpRx {
    pub(crate) fn new(stream: TcpStream) -> TcpRx {
        TcpRx { stream, stage: vec![0u64; (4 * SEGMENT) / 8], start: 0, end: 0 }
    }
}

const ZEROS: [u8; 8] = [0; 8];

fn aborted() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "it gave up on the collective after an error")
}

/// Poisons a connection so the peer fails at once instead of waiting.
pub(crate) trait Abort {
    fn abort(&self);
}

impl Abort for Tx {
    fn abort(&self) {
        match self {
            Tx::Shm(ring) => ring.abort(),
            Tx::Tcp(s) => {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

impl Abort for Rx {
    fn abort(&self) {
        match self {
            Rx::Shm(ring) => ring.abort(),
            Rx::Tcp(rx) => {
                let _ = rx.stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

/// Every message opens with this many bytes: the communicator's id, the
/// sequence number of the call it belongs to, and what that call is
/// (kind, type, op, root, size), so that ranks that disagree fail, naming
/// it, instead of mixing up data.
pub(crate) const HEAD: usize = 32;

impl Tx {
    /// Sends more of `head` followed by `data` (padded to 8), `done` bytes
    /// of them being sent already; returns how many more went out.
    pub(crate) fn progress_message(&mut self, head: &[u8; HEAD], data: &[u8], done: usize) -> io::Result<usize> {
        if done >= HEAD {
            return self.progress(data, done - HEAD);
        }
        match self {
            Tx::Shm(ring) => {
                let n = ring.push(&head[done..], HEAD - done);
                if n == 0 {
                    return if ring.aborted() { Err(aborted()) } else { Ok(0) };
                }
                if done + n < HEAD {
                    return Ok(n);
                }
                Ok(n + self.progress(data, 0)?)
            }
            Tx::Tcp(stream) => {
                // head and (the start of) the data in one system call
                let first = &data[..data.len().min(SEGMENT)];
                let pad = if first.len() == data.len() { padded(data.len()) - data.len() } else { 0 };
                let parts = [io::IoSlice::new(&head[done..]), io::IoSlice::new(first), io::IoSlice::new(&ZEROS[..pad])];
                match stream.write_vectored(&parts) {
                    Ok(0) => Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed")),
                    Ok(n) => Ok(n),
                    Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Ok(0),
                    Err(e) => Err(e),
                }
            }
        }
    }

    /// Sends more of `data` (padded to 8), `done` padded bytes of it being
    /// sent already; returns how many more went out.
    pub(crate) fn progress(&mut self, data: &[u8], done: usize) -> io::Result<usize> {
        let total = padded(data.len());
        match self {
            Tx::Shm(ring) => match ring.push(&data[done.min(data.len())..], total - done) {
                0 if ring.aborted() => Err(aborted()),
                n => Ok(n),
            },
            Tx::Tcp(stream) => {
                let piece: &[u8] = if done < data.len() {
                    &data[done..data.len().min(done + SEGMENT)]
                } else {
                    &ZEROS[..total - done]
                };
                match stream.write(piece) {
                    Ok(0) => Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed")),
                    Ok(n) => Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(0),
                    Err(e) => Err(e),
                }
            }
        }
    }
}

impl Rx {
    /// Receives more of a `len`-byte message (padded to 8), `done` padded
    /// bytes of it received already; `sink(offset, bytes)` gets the data
    /// (never the padding). Returns how many more came in.
    pub(crate) fn progress(
        &mut self,
        len: usize,
        done: usize,
        mut sink: impl FnMut(usize, &[u8]),
    ) -> io::Result<usize> {
        let want = padded(len) - done;
        let mut offset = done;
        let mut deliver = |piece: &[u8]| {
            if offset < len {
                let useful = piece.len().min(len - offset);
                sink(offset, &piece[..useful]);
            }
            offset += piece.len();
        };
        match self {
            Rx::Shm(ring) => match ring.pop(want, deliver) {
                0 if ring.aborted() => Err(aborted()),
                n => Ok(n),
            },
            Rx::Tcp(rx) => {
                // read only when what is staged cannot make a full piece
                if rx.end - rx.start < want.min(SEGMENT) {
                    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut rx.stage);
                    if rx.start > 0 && rx.end + SEGMENT > bytes.len() {
                        bytes.copy_within(rx.start..rx.end, 0);
                        rx.end -= rx.start;
                        rx.start = 0;
                    }
                    match rx.stream.read(&mut bytes[rx.end..]) {
                        Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed")),
                        Ok(n) => rx.end += n,
                        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {}
                        Err(e) => return Err(e),
                    }
                }
                let n = (rx.end - rx.start).min(want) & !7;
                if n == 0 {
                    return Ok(0);
                }
                let bytes: &[u8] = bytemuck::cast_slice(&rx.stage);
                deliver(&bytes[rx.start..rx.start + n]);
                rx.start += n;
                if rx.start == rx.end {
                    rx.start = 0;
                    rx.end = 0;
                }
                Ok(n)
            }
        }
    }
}
