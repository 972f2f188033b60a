//! A link per peer, each mutually authenticated by the job secret
//! (kolo-auth) over the job, the link's kind and both ranks: within a
//! host, shared-memory rings in anonymous memory files passed over
//! abstract unix sockets; between hosts, TCP. The lower rank dials.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use kolo_auth::{handshake, Role};

use super::exchange::Peer;
use super::Config;
use crate::comm::Links;
use crate::interrupt::{check_interrupt, Interrupt};
use crate::link::{Rx, TcpRx, Tx};
use crate::shm::Ring;
use crate::CommError;

/// What a dialer sends first: this, then its rank (u32, big-endian), so
/// that the listener knows which context to authenticate it in.
const CLAIM: [u8; 4] = *b"kcom";
/// Longest a single handshake may take (within the bootstrap's deadline).
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy)]
pub(super) enum Kind {
    Tcp,
    Unix,
}

/// What a link's handshake proves besides the secret: the job, the kind of
/// link and both ranks.
fn context(kind: Kind, job: &str, listener: usize, dialer: usize) -> Vec<u8> {
    let mut c = match kind {
        Kind::Tcp => b"kolo-comm-tcp\0".to_vec(),
        Kind::Unix => b"kolo-comm-unix\0".to_vec(),
    };
    c.extend_from_slice(&(job.len() as u64).to_be_bytes());
    c.extend_from_slice(job.as_bytes());
    c.extend_from_slice(&(listener as u64).to_be_bytes());
    c.extend_from_slice(&(dialer as u64).to_be_bytes());
    c
}

fn handshake_limit(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(100), HANDSHAKE_LIMIT)
}

/// A random name in the abstract namespace (nothing in any file system).
pub(super) fn unix_name() -> String {
    let n = kolo_auth::nonce();
    let hex: String = n[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("kolo-comm-{hex}")
}

pub(super) fn bind_unix(name: &str) -> std::io::Result<UnixListener> {
    UnixListener::bind_addr(&UnixAddr::from_abstract_name(name.as_bytes())?)
}

/// Sends one descriptor (and one byte) over a unix stream.
fn send_fd(stream: &UnixStream, fd: RawFd) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let fds = [fd];
    let iov = [IoSlice::new(b"R")];
    sendmsg::<()>(stream.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)?;
    Ok(())
}

/// Receives exactly one descriptor (within the stream's read timeout).
fn recv_fd(stream: &UnixStream) -> std::io::Result<OwnedFd> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut byte = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([RawFd; 2]);
    let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut got: Vec<OwnedFd> = Vec::new();
    for cmsg in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            // SAFETY: the kernel just installed these descriptors for us:
            // each is open and owned by nothing else, so each gets one owner.
            got.extend(fds.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    if msg.bytes == 0 && got.is_empty() {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the peer closed the socket"));
    }
    if got.len() != 1 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("expected one ring, got {}", got.len()),
        ));
    }
    Ok(got.pop().expect("one"))
}

/// Everything a bootstrap needs while it sets up links.
pub(super) struct Setup<'a> {
    pub(super) config: &'a Config,
    pub(super) deadline: Instant,
    pub(super) capacity: usize,
    pub(super) links: Links,
}

impl Setup<'_> {
    fn io_err(&self, what: String) -> impl FnOnce(std::io::Error) -> CommError {
        move |source| CommError::BootstrapIo { what, source }
    }

    /// Same host: after the handshake each side sends the ring it reads
    /// from (a fresh memfd) and maps the one it writes to.
    pub(super) fn unix_link(&mut self, peer: usize, stream: UnixStream) -> Result<(), CommError> {
        let limit = handshake_limit(self.deadline);
        let _ = stream.set_read_timeout(Some(limit));
        let _ = stream.set_write_timeout(Some(limit));
        let (inbound, fd) = Ring::create(self.capacity)
            .map_err(self.io_err("cannot create a shared-memory ring (memfd_create)".into()))?;
        send_fd(&stream, fd.as_fd().as_raw_fd()).map_err(|e| CommError::Io { rank: peer, source: e })?;
        drop(fd);
        let outbound =
            recv_fd(&stream).and_then(Ring::open).map_err(self.io_err(format!("rank {peer} sent no usable ring")))?;
        self.links.rx[peer] = Some(Rx::Shm(inbound));
        self.links.tx[peer] = Some(Tx::Shm(outbound));
        Ok(())
    }

    pub(super) fn tcp_link(&mut self, peer: usize, stream: TcpStream) -> Result<(), CommError> {
        let io = |e| CommError::Io { rank: peer, source: e };
        stream.set_nodelay(true).map_err(io)?;
        stream.set_nonblocking(true).map_err(io)?;
        let reader = stream.try_clone().map_err(io)?;
        self.links.tx[peer] = Some(Tx::Tcp(stream));
        self.links.rx[peer] = Some(Rx::Tcp(TcpRx::new(reader)));
        Ok(())
    }

    /// Dials a higher rank: claim, then prove, then check its proof.
    pub(super) fn dial(&mut self, peer: usize, p: &Peer, kind: Kind) -> Result<(), CommError> {
        let config = self.config;
        let ctx = context(kind, &config.job_id, peer, config.rank);
        let mut claim = [0u8; 8];
        claim[..4].copy_from_slice(&CLAIM);
        claim[4..].copy_from_slice(&(config.rank as u32).to_be_bytes());
        let auth = |source| CommError::Auth { rank: peer, source };
        match kind {
            Kind::Tcp => {
                let mut stream = dial_tcp(p.addr, self.deadline, &config.interrupt)?
                    .map_err(self.io_err(format!("cannot reach rank {peer} at {}", p.addr)))?;
                stream.write_all(&claim).map_err(|e| CommError::Io { rank: peer, source: e })?;
                handshake(&mut stream, Role::Dialer, &config.secret, &ctx, handshake_limit(self.deadline))
                    .map_err(auth)?;
                self.tcp_link(peer, stream)
            }
            Kind::Unix => {
                let addr = UnixAddr::from_abstract_name(p.unix.as_bytes())
                    .map_err(self.io_err(format!("bad unix socket name of rank {peer}")))?;
                let mut stream = UnixStream::connect_addr(&addr)
                    .map_err(self.io_err(format!("cannot reach rank {peer} on this host (unix socket)")))?;
                stream.write_all(&claim).map_err(|e| CommError::Io { rank: peer, source: e })?;
                handshake(&mut stream, Role::Dialer, &config.secret, &ctx, handshake_limit(self.deadline))
                    .map_err(auth)?;
                self.unix_link(peer, stream)
            }
        }
    }

    /// Reads a dialer's claim and authenticates it; `None` (logged) for a
    /// connection that fails, which is dropped.
    pub(super) fn accept<S: Read + Write + kolo_auth::Timeouts>(
        &self,
        stream: &mut S,
        kind: Kind,
        missing: &[usize],
    ) -> Option<usize> {
        let config = self.config;
        let _ = stream.set_timeouts(Some(handshake_limit(self.deadline)));
        let mut claim = [0u8; 8];
        if stream.read_exact(&mut claim).is_err() || claim[..4] != CLAIM {
            tracing::warn!("kolo-comm: dropped a connection that is not a kolo peer");
            return None;
        }
        let peer = u32::from_be_bytes(claim[4..].try_into().expect("4 bytes")) as usize;
        if !missing.contains(&peer) {
            tracing::warn!(claimed = peer, "kolo-comm: dropped a connection from an unexpected rank");
            return None;
        }
        let ctx = context(kind, &config.job_id, config.rank, peer);
        match handshake(stream, Role::Listener, &config.secret, &ctx, handshake_limit(self.deadline)) {
            Ok(()) => Some(peer),
            Err(e) => {
                tracing::warn!(claimed = peer, "kolo-comm: refused a link: {e}");
                None
            }
        }
    }
}

/// The outer error: the round ended while dialing; the inner: the dial failed.
fn dial_tcp(
    addr: SocketAddr,
    deadline: Instant,
    interrupt: &Option<Interrupt>,
) -> Result<std::io::Result<TcpStream>, CommError> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(s) => return Ok(Ok(s)),
            Err(e) if Instant::now() >= deadline => return Ok(Err(e)),
            Err(_) => {
                check_interrupt(interrupt)?;
                std::thread::sleep(Duration::from_millis(5))
            }
        }
    }
}
