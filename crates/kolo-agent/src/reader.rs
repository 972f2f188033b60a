//! Frames from the driver, read ahead in one buffer, so that one system
//! call takes in whatever has arrived.

use std::io;
use std::net::TcpStream;

use kolo_proto::proto::{self, ToWorker};

/// Frames from the driver, read ahead in one buffer.
pub(super) struct FrameReader {
    stream: TcpStream,
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl FrameReader {
    pub(super) fn new(stream: TcpStream) -> Self {
        FrameReader { stream, buf: vec![0; 256 * 1024], start: 0, end: 0 }
    }

    pub(super) fn socket(&self) -> &TcpStream {
        &self.stream
    }

    /// Whether a whole frame is already read (a blocking read would wait
    /// for more while it sits here).
    pub(super) fn has_frame(&self) -> bool {
        let buffered = &self.buf[self.start..self.end];
        buffered.len() >= 4
            && buffered.len() - 4 >= u32::from_be_bytes([buffered[0], buffered[1], buffered[2], buffered[3]]) as usize
    }

    /// Reads what the socket has; blocks for it only if `block`.
    pub(super) fn fill(&mut self, block: bool) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        if self.end == self.buf.len() {
            // one frame larger than the buffer
            let grown = self.buf.len() * 2;
            self.buf.resize(grown, 0);
        }
        let flags = if block { nix::sys::socket::MsgFlags::empty() } else { nix::sys::socket::MsgFlags::MSG_DONTWAIT };
        match nix::sys::socket::recv(self.stream.as_raw_fd(), &mut self.buf[self.end..], flags) {
            Ok(0) => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed")),
            Ok(n) => {
                self.end += n;
                Ok(())
            }
            Err(nix::errno::Errno::EAGAIN) | Err(nix::errno::Errno::EINTR) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The next whole frame already read, if any.
    pub(super) fn frame(&mut self) -> io::Result<Option<ToWorker>> {
        let buffered = &self.buf[self.start..self.end];
        if buffered.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([buffered[0], buffered[1], buffered[2], buffered[3]]) as usize;
        if len > proto::MAX_FRAME {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("frame of {len} bytes is over the limit")));
        }
        if buffered.len() < 4 + len {
            if 4 + len > self.buf.len() {
                self.buf.resize(4 + len, 0);
            }
            return Ok(None);
        }
        let message = proto::decode(&buffered[4..4 + len])?;
        self.start += 4 + len;
        Ok(Some(message))
    }
}
