//! Bringing a communicator up: addresses through the rendezvous store
//! (linear traffic, blocking client: no async runtime), then a link per
//! peer, every one mutually authenticated by the job secret (kolo-auth):
//! within a host, shared-memory rings in anonymous memory files passed over
//! abstract unix sockets; between hosts, TCP.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kolo_auth::{handshake, Role, Secret};
use kolo_rendezvous::{BlockingClient, ClientConfig, RendezvousError};
use kolo_topology::env_names as names;

use crate::comm::{Communicator, Links, Shared, Tuning};
use crate::link::{Rx, TcpRx, Tx};
use crate::shm::Ring;
use crate::CommError;

/// How ranks on the same host talk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// Shared memory within a host, TCP between hosts.
    Auto,
    /// TCP everywhere (`KOLO_COMM_TRANSPORT=tcp`), e.g. to test the TCP path on one host.
    Tcp,
}

/// Everything a rank needs to join. Make one with [`Config::new`] and the
/// `with_*` methods, or from a kolo job's environment with
/// [`Config::from_env`].
#[derive(Clone, Debug)]
pub struct Config {
    /// This process's rank, below `size`.
    pub rank: usize,
    /// How many ranks the communicator has.
    pub size: usize,
    /// Ranks with the same node id share a host.
    pub node_id: String,
    /// `host:port` of the rendezvous store.
    pub store: String,
    /// The job's secret: for the store, and to authenticate every link.
    pub secret: Secret,
    /// Names the job in the store's keys and in every link's handshake, so
    /// that two jobs on one store or one host never mix.
    pub job_id: String,
    /// For the bootstrap, and for a collective without progress.
    pub timeout: Duration,
    /// Whether ranks on one host use shared memory or TCP.
    pub transport: Transport,
    /// Address this rank listens on for TCP links.
    pub listen: IpAddr,
    /// Sizes and thresholds that pick algorithms and buffers.
    pub tuning: Tuning,
    /// Asked while the bootstrap and the collectives wait (elastic jobs).
    pub interrupt: Option<Interrupt>,
    /// Where the ranks swap addresses: kolo's rendezvous store (`store`)
    /// when `None`.
    pub book: Option<Book>,
}

/// A key-value store the caller already has, for the bootstrap's address
/// swap instead of kolo's rendezvous store: torch.distributed hands its
/// process groups one. Keys are written once; values are small.
pub trait AddressBook: Send + Sync {
    /// Stores `value` under `key`, for every rank to wait for.
    fn put(&self, key: &str, value: &[u8]) -> Result<(), String>;
    /// The value once a rank has put it; `None` when `timeout` passed first.
    fn wait(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>, String>;
}

/// An [`AddressBook`] in a [`Config`].
#[derive(Clone)]
pub struct Book(pub Arc<dyn AddressBook>);

impl std::fmt::Debug for Book {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AddressBook")
    }
}

/// Ends the waits of a communicator when its round is over: asked every
/// few tens of milliseconds while a bootstrap or a collective makes no
/// progress, it answers the new round's number once there is one, and the
/// wait fails with [`CommError::Interrupted`]. An elastic job's
/// communicators carry one ([`crate::elastic`]), so that a collective stuck
/// on a peer that vanished without closing its sockets (a host cut off)
/// ends as soon as kolo's driver has started a round without it.
#[derive(Clone)]
pub struct Interrupt(Arc<dyn Fn() -> Option<u64> + Send + Sync>);

impl Interrupt {
    /// Wraps `check`, which answers the new round's number once there is
    /// one and `None` until then.
    pub fn new(check: impl Fn() -> Option<u64> + Send + Sync + 'static) -> Interrupt {
        Interrupt(Arc::new(check))
    }

    pub(crate) fn check(&self) -> Result<(), CommError> {
        match (self.0)() {
            Some(round) => Err(CommError::Interrupted { round }),
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for Interrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Interrupt")
    }
}

fn check_interrupt(interrupt: &Option<Interrupt>) -> Result<(), CommError> {
    interrupt.as_ref().map_or(Ok(()), Interrupt::check)
}

fn var(name: &str) -> Result<String, CommError> {
    std::env::var(name).map_err(|_| not_set(name))
}

fn not_set(name: &str) -> CommError {
    CommError::Env(format!("{name} is not set; start the job with kolo run"))
}

fn number<T: std::str::FromStr>(name: &str) -> Result<T, CommError> {
    let v = var(name)?;
    v.parse().map_err(|_| CommError::Env(format!("{name}='{v}' is not a number")))
}

impl Config {
    /// Rank `rank` of `size`, on host `node_id`, with the store at
    /// `store` (`host:port`); a 30 s timeout, [`Transport::Auto`], TCP on
    /// loopback, default tuning until changed with the `with_*` methods.
    pub fn new(
        rank: usize,
        size: usize,
        node_id: impl Into<String>,
        store: impl Into<String>,
        secret: Secret,
        job_id: impl Into<String>,
    ) -> Result<Config, CommError> {
        if rank >= size {
            return Err(CommError::Env(format!("rank {rank} is not below the size {size}")));
        }
        Ok(Config {
            rank,
            size,
            node_id: node_id.into(),
            store: store.into(),
            secret,
            job_id: job_id.into(),
            timeout: Duration::from_secs(30),
            transport: Transport::Auto,
            listen: IpAddr::from([127, 0, 0, 1]),
            tuning: Tuning::default(),
            interrupt: None,
            book: None,
        })
    }

    /// Swaps addresses through `book` instead of kolo's rendezvous store
    /// (`store` is then unused).
    pub fn with_book(mut self, book: Arc<dyn AddressBook>) -> Config {
        self.book = Some(Book(book));
        self
    }

    /// Waits of the bootstrap and of every collective end when `interrupt` says so.
    pub fn with_interrupt(mut self, interrupt: Interrupt) -> Config {
        self.interrupt = Some(interrupt);
        self
    }

    /// The time limit for the bootstrap and for a collective that makes no
    /// progress (at least 1 ms).
    pub fn with_timeout(mut self, timeout: Duration) -> Config {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Uses `transport` between ranks of a host.
    pub fn with_transport(mut self, transport: Transport) -> Config {
        self.transport = transport;
        self
    }

    /// Listens for TCP links on this address.
    pub fn with_listen(mut self, addr: IpAddr) -> Config {
        self.listen = addr;
        self
    }

    /// Listens for TCP links on the IPv4 address of interface `iface`
    /// (loopback for `lo`).
    pub fn with_iface(mut self, iface: &str) -> Result<Config, CommError> {
        self.listen = listen_address(Some(iface))?;
        Ok(self)
    }

    /// Uses `tuning` instead of the defaults.
    pub fn with_tuning(mut self, tuning: Tuning) -> Config {
        self.tuning = tuning;
        self
    }

    /// From the variables `kolo run` sets (`KOLO_RANK`, `KOLO_SIZE`,
    /// `KOLO_NODE_ID`, `KOLO_RENDEZVOUS_ADDR`/`_PORT`, `KOLO_SECRET`,
    /// `KOLO_JOB_ID`, `KOLO_TIMEOUT_SECONDS`, `KOLO_IFACES`), plus
    /// `KOLO_COMM_TRANSPORT` (`auto` or `tcp`), `KOLO_COMM_TIMEOUT_SECONDS`
    /// and the tuning variables. A missing or empty `KOLO_SECRET` is an error.
    pub fn from_env() -> Result<Config, CommError> {
        let rank: usize = number(names::RANK)?;
        let size: usize = number(names::SIZE)?;
        if rank >= size {
            return Err(CommError::Env(format!("{} {rank} is not below {} {size}", names::RANK, names::SIZE)));
        }
        let job = JobVars::read()?;
        let timeout = match job.comm_timeout {
            Some(timeout) => timeout,
            None => Duration::from_secs(number::<u64>(names::TIMEOUT_SECONDS).unwrap_or(30)),
        };
        let secret = Secret::from_env(names::SECRET).map_err(CommError::Secret)?;
        let store = format!("{}:{}", var(names::RENDEZVOUS_ADDR)?, var(names::RENDEZVOUS_PORT)?);
        let node_id = job.node_id.ok_or_else(|| not_set(names::NODE_ID))?;
        Ok(Config::new(rank, size, node_id, store, secret, job.job_id.unwrap_or_else(|| "job".into()))?
            .with_timeout(timeout)
            .with_transport(job.transport)
            .with_listen(listen_address(job.iface.as_deref())?)
            .with_tuning(Tuning::from_env()?))
    }
}

/// What a job's variables say about its communicators, read by one parser
/// for both ways of making one ([`Config::from_env`], [`Config::from_book`]).
struct JobVars {
    transport: Transport,
    comm_timeout: Option<Duration>,
    /// The first of `KOLO_IFACES`.
    iface: Option<String>,
    job_id: Option<String>,
    node_id: Option<String>,
}

impl JobVars {
    fn read() -> Result<JobVars, CommError> {
        let set = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let transport = match set(names::COMM_TRANSPORT).as_deref() {
            None | Some("auto") => Transport::Auto,
            Some("tcp") => Transport::Tcp,
            Some(other) => return Err(CommError::Env(format!("{}='{other}': use auto or tcp", names::COMM_TRANSPORT))),
        };
        let comm_timeout = match set(names::COMM_TIMEOUT_SECONDS) {
            Some(_) => Some(Duration::from_secs_f64(number::<f64>(names::COMM_TIMEOUT_SECONDS)?.max(0.001))),
            None => None,
        };
        let iface = set(names::IFACES).and_then(|l| l.split(',').next().map(String::from)).filter(|i| !i.is_empty());
        Ok(JobVars { transport, comm_timeout, iface, job_id: set(names::JOB_ID), node_id: set(names::NODE_ID) })
    }
}

/// How a group made through an [`AddressBook`] (torch.distributed's
/// store) finds what `kolo run` would have set.
impl Config {
    /// Rank `rank` of `size`, swapping addresses through `book`. Inside a
    /// kolo job the job's secret, host id, interface, transport and tuning
    /// come from its variables; elsewhere rank 0 makes a secret and hands
    /// it out through `book` (so links are as private as that store), the
    /// host id is the host name, and links listen on the address that
    /// reaches `toward` (the store's host; loopback when that is local).
    pub fn from_book(
        rank: usize,
        size: usize,
        book: Arc<dyn AddressBook>,
        timeout: Duration,
        toward: Option<&str>,
    ) -> Result<Config, CommError> {
        let in_job = std::env::var_os(names::SECRET).is_some_and(|s| !s.is_empty());
        let secret = if in_job {
            Secret::from_env(names::SECRET).map_err(CommError::Secret)?
        } else {
            book_secret(rank, book.as_ref(), timeout)?
        };
        let job = JobVars::read()?;
        let node_id = match job.node_id {
            Some(id) => id,
            None => nix::unistd::gethostname()
                .map(|h| h.to_string_lossy().into_owned())
                .map_err(|e| CommError::EnvSys { what: "cannot read the host name".into(), source: e.into() })?,
        };
        let listen = match job.iface {
            Some(iface) => listen_address(Some(&iface))?,
            None => toward.map_or(Ok(IpAddr::from([127, 0, 0, 1])), address_toward)?,
        };
        Ok(Config::new(rank, size, node_id, "", secret, job.job_id.unwrap_or_else(|| "group".into()))?
            .with_timeout(job.comm_timeout.unwrap_or(timeout))
            .with_transport(job.transport)
            .with_listen(listen)
            .with_tuning(Tuning::from_env()?)
            .with_book(book))
    }
}

/// Outside a kolo job: rank 0's fresh secret, through the book.
fn book_secret(rank: usize, book: &dyn AddressBook, timeout: Duration) -> Result<Secret, CommError> {
    let failed = |e: String| CommError::Bootstrap(format!("address book: {e}"));
    let text = if rank == 0 {
        let hex: String = kolo_auth::nonce().iter().map(|b| format!("{b:02x}")).collect();
        book.put("kolo-comm/secret", hex.as_bytes()).map_err(failed)?;
        hex
    } else {
        let v = book.wait("kolo-comm/secret", timeout).map_err(failed)?.ok_or_else(|| {
            CommError::Bootstrap(format!("rank 0 did not show up within {:.1} s", timeout.as_secs_f64()))
        })?;
        String::from_utf8_lossy(&v).into_owned()
    };
    Secret::new(text).map_err(CommError::Secret)
}

/// The local address the kernel picks to reach `host` (no packet is sent).
fn address_toward(host: &str) -> Result<IpAddr, CommError> {
    use std::net::{ToSocketAddrs, UdpSocket};
    let err = |source| CommError::EnvSys { what: format!("cannot find a route to {host}"), source };
    let target = (host, 9)
        .to_socket_addrs()
        .map_err(err)?
        .find(|a| a.is_ipv4())
        .ok_or_else(|| CommError::Env(format!("{host} has no IPv4 address")))?;
    if target.ip().is_loopback() {
        return Ok(IpAddr::from([127, 0, 0, 1]));
    }
    let socket = UdpSocket::bind(("0.0.0.0", 0)).map_err(err)?;
    socket.connect(target).map_err(err)?;
    Ok(socket.local_addr().map_err(err)?.ip())
}

/// The IPv4 address of the interface kolo chose (loopback for `lo`).
fn listen_address(iface: Option<&str>) -> Result<IpAddr, CommError> {
    let Some(iface) = iface.filter(|i| *i != "lo") else { return Ok(IpAddr::from([127, 0, 0, 1])) };
    let addrs = nix::ifaddrs::getifaddrs()
        .map_err(|e| CommError::EnvSys { what: "cannot list interfaces".into(), source: e.into() })?;
    for a in addrs.filter(|a| a.interface_name == iface) {
        if let Some(v4) = a.address.as_ref().and_then(|s| s.as_sockaddr_in()) {
            return Ok(IpAddr::V4(v4.ip()));
        }
    }
    Err(CommError::Env(format!("interface '{iface}' ({}) has no IPv4 address on this host", names::IFACES)))
}

struct Peer {
    node: usize,
    addr: SocketAddr,
    pid: u32,
    /// Abstract unix socket name for same-host links ("-" when none).
    unix: String,
}

/// What a dialer sends first: this, then its rank (u32, big-endian), so
/// that the listener knows which context to authenticate it in.
const CLAIM: [u8; 4] = *b"kcom";
/// Longest a single handshake may take (within the bootstrap's deadline).
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy)]
enum Kind {
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
fn unix_name() -> String {
    let n = kolo_auth::nonce();
    let hex: String = n[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("kolo-comm-{hex}")
}

fn bind_unix(name: &str) -> std::io::Result<UnixListener> {
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
struct Setup<'a> {
    config: &'a Config,
    deadline: Instant,
    capacity: usize,
    links: Links,
}

impl Setup<'_> {
    fn io_err(&self, what: String) -> impl FnOnce(std::io::Error) -> CommError {
        move |source| CommError::BootstrapIo { what, source }
    }

    /// Same host: after the handshake each side sends the ring it reads
    /// from (a fresh memfd) and maps the one it writes to.
    fn unix_link(&mut self, peer: usize, stream: UnixStream) -> Result<(), CommError> {
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

    fn tcp_link(&mut self, peer: usize, stream: TcpStream) -> Result<(), CommError> {
        let io = |e| CommError::Io { rank: peer, source: e };
        stream.set_nodelay(true).map_err(io)?;
        stream.set_nonblocking(true).map_err(io)?;
        let reader = stream.try_clone().map_err(io)?;
        self.links.tx[peer] = Some(Tx::Tcp(stream));
        self.links.rx[peer] = Some(Rx::Tcp(TcpRx::new(reader)));
        Ok(())
    }

    /// Dials a higher rank: claim, then prove, then check its proof.
    fn dial(&mut self, peer: usize, p: &Peer, kind: Kind) -> Result<(), CommError> {
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
    fn accept<S: Read + Write + kolo_auth::Timeouts>(
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

impl Communicator {
    /// Joins the job's communicator from the environment `kolo run` sets
    /// ([`Config::from_env`]). Blocking; no async runtime involved, so it
    /// may be called from any thread.
    pub fn from_env() -> Result<Communicator, CommError> {
        Communicator::connect(Config::from_env()?)
    }

    /// Joins with explicit settings. Collective: every rank calls it.
    pub fn connect(config: Config) -> Result<Communicator, CommError> {
        let deadline = Instant::now() + config.timeout;
        let listener = TcpListener::bind((config.listen, 0))
            .map_err(|source| CommError::BootstrapIo { what: format!("cannot listen on {}", config.listen), source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| CommError::BootstrapIo { what: "no listening address".into(), source })?;
        let unix = if config.transport == Transport::Auto {
            let name = unix_name();
            let l = bind_unix(&name).map_err(|source| CommError::BootstrapIo {
                what: "cannot listen on an abstract unix socket".into(),
                source,
            })?;
            Some((name, l))
        } else {
            None
        };
        let unix_name = unix.as_ref().map_or("-", |(n, _)| n.as_str());
        let peers = exchange_addresses(&config, &addr, unix_name, deadline)?;
        let n = config.size;
        let my_node = peers[config.rank].node;
        let local = |p: usize| {
            p != config.rank && peers[p].node == my_node && config.transport == Transport::Auto && peers[p].unix != "-"
        };
        let local_count = (0..n).filter(|&p| local(p)).count();
        // rings shrink as ranks per host grow, so their memory stays bounded
        let capacity = (64usize << 20)
            .checked_div(local_count)
            .map_or(0, |c| c.clamp(256 << 10, config.tuning.ring_bytes.max(256 << 10)) & !7);
        let mut setup = Setup {
            config: &config,
            deadline,
            capacity,
            links: Links {
                tx: (0..n).map(|_| None).collect(),
                rx: (0..n).map(|_| None).collect(),
                scratch: Vec::new(),
            },
        };

        // the lower rank dials, the higher one listens
        for (p, peer) in peers.iter().enumerate().skip(config.rank + 1) {
            setup.dial(p, peer, if local(p) { Kind::Unix } else { Kind::Tcp })?;
        }
        let mut missing: Vec<usize> = (0..config.rank).collect();
        let mut last_check = Instant::now();
        listener.set_nonblocking(true).map_err(|source| CommError::BootstrapIo { what: "listener".into(), source })?;
        if let Some((_, l)) = &unix {
            l.set_nonblocking(true)
                .map_err(|source| CommError::BootstrapIo { what: "unix listener".into(), source })?;
        }
        while !missing.is_empty() {
            let mut accepted = false;
            match listener.accept() {
                Ok((mut stream, _)) => {
                    accepted = true;
                    let _ = stream.set_nonblocking(false);
                    let remote: Vec<usize> = missing.iter().copied().filter(|&m| !local(m)).collect();
                    if let Some(peer) = setup.accept(&mut stream, Kind::Tcp, &remote) {
                        setup.tcp_link(peer, stream)?;
                        missing.retain(|&m| m != peer);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(source) => return Err(CommError::BootstrapIo { what: "accept failed".into(), source }),
            }
            if let Some((_, l)) = &unix {
                match l.accept() {
                    Ok((mut stream, _)) => {
                        accepted = true;
                        let _ = stream.set_nonblocking(false);
                        let same_host: Vec<usize> = missing.iter().copied().filter(|&m| local(m)).collect();
                        if let Some(peer) = setup.accept(&mut stream, Kind::Unix, &same_host) {
                            setup.unix_link(peer, stream)?;
                            missing.retain(|&m| m != peer);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(source) => return Err(CommError::BootstrapIo { what: "accept failed".into(), source }),
                }
            }
            if !accepted {
                if last_check.elapsed() > Duration::from_millis(50) {
                    last_check = Instant::now();
                    check_interrupt(&config.interrupt)?;
                }
                if Instant::now() >= deadline {
                    return Err(CommError::Bootstrap(format!(
                        "ranks {missing:?} did not connect within {:.1} s",
                        config.timeout.as_secs_f64()
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        drop(unix);
        drop(listener);

        let nodes: Vec<usize> = peers.iter().map(|p| p.node).collect();
        let local_pids: Vec<u32> = (0..n).map(|p| if peers[p].node == my_node { peers[p].pid } else { 0 }).collect();
        const WORLD: u64 = 1;
        let shared = Arc::new(Shared {
            me: config.rank,
            links: Mutex::new(setup.links),
            local_pids,
            timeout: config.timeout,
            tuning: Tuning {
                // TCP even within a host means no shortcut through peers' memory either
                direct_bytes: config.tuning.direct_bytes.filter(|_| config.transport == Transport::Auto),
                ..config.tuning.clone()
            },
            interrupt: config.interrupt.clone(),
            names: Mutex::new(HashMap::from([(WORLD, "world".to_string())])),
        });
        let mut comm = Communicator::new(shared, WORLD, (0..n).collect(), config.rank, nodes);
        comm.barrier()?;
        comm.build_hierarchy()?;
        tracing::debug!(rank = comm.shared.me, size = n, local = local_count, "communicator up");
        Ok(comm)
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

/// Waits for one key, asking `interrupt` between slices of the wait.
fn wait_key(
    client: &mut BlockingClient,
    scope: &str,
    key: &str,
    deadline: Instant,
    interrupt: &Option<Interrupt>,
) -> Result<Result<Vec<u8>, RendezvousError>, CommError> {
    let slice = if interrupt.is_some() { Duration::from_millis(20) } else { Duration::MAX };
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        match client.wait(scope, &[key], remaining.min(slice)) {
            Ok(mut values) => return Ok(Ok(values.remove(0))),
            Err(RendezvousError::WaitTimeout { .. }) if remaining > slice => check_interrupt(interrupt)?,
            Err(e) => return Ok(Err(e)),
        }
    }
}

/// A client of the job's store, with the secret, its requests bounded by
/// the configured timeout (at most 30 s).
pub(crate) fn store_client(config: &Config) -> BlockingClient {
    let mut client = ClientConfig::new(config.store.clone());
    client.secret = Some(config.secret.expose().to_string());
    client.request_timeout = config.timeout.min(Duration::from_secs(30));
    BlockingClient::new(client)
}

/// Rank records through the store: each rank PUTs its own, rank 0 reads
/// them all and PUTs the table, every other rank reads the table once.
fn exchange_addresses(
    config: &Config,
    addr: &SocketAddr,
    unix: &str,
    deadline: Instant,
) -> Result<Vec<Peer>, CommError> {
    if let Some(Book(book)) = &config.book {
        return exchange_in_book(config, book.as_ref(), addr, unix, deadline);
    }
    let mut client = store_client(config);
    let scope = format!("kolo-comm-{}", config.job_id);
    let record = format!("{}\t{addr}\t{}\t{unix}", config.node_id, std::process::id());
    client.put(&scope, &config.rank.to_string(), record.as_bytes()).map_err(CommError::Store)?;
    let table = if config.rank == 0 {
        let mut records = Vec::with_capacity(config.size);
        for r in 0..config.size {
            match wait_key(&mut client, &scope, &r.to_string(), deadline, &config.interrupt)? {
                Ok(v) => records.push(String::from_utf8_lossy(&v).into_owned()),
                Err(RendezvousError::WaitTimeout { .. }) => {
                    let mut missing = Vec::new();
                    for m in r..config.size {
                        if client.get(&scope, &m.to_string()).map_err(CommError::Store)?.is_none() {
                            missing.push(m);
                        }
                    }
                    return Err(CommError::Bootstrap(format!(
                        "ranks {missing:?} did not show up within {:.1} s",
                        config.timeout.as_secs_f64()
                    )));
                }
                Err(e) => return Err(CommError::Store(e)),
            }
        }
        let table = records.join("\n");
        client.put(&scope, "table", table.as_bytes()).map_err(CommError::Store)?;
        table
    } else {
        match wait_key(&mut client, &scope, "table", deadline, &config.interrupt)? {
            Ok(v) => String::from_utf8_lossy(&v).into_owned(),
            Err(RendezvousError::WaitTimeout { .. }) => {
                return Err(CommError::Bootstrap(format!(
                    "no address table from rank 0 within {:.1} s: rank 0 or another rank did not show up",
                    config.timeout.as_secs_f64()
                )))
            }
            Err(e) => return Err(CommError::Store(e)),
        }
    };
    // our record is read (rank 0 read them all before the table existed)
    let _ = client.delete(&scope, &config.rank.to_string());
    parse_table(&table, config.size)
}

/// [`exchange_addresses`] through the caller's [`AddressBook`]: the same
/// records and table, under the keys `kolo-comm/<rank>` and `kolo-comm/table`.
fn exchange_in_book(
    config: &Config,
    book: &dyn AddressBook,
    addr: &SocketAddr,
    unix: &str,
    deadline: Instant,
) -> Result<Vec<Peer>, CommError> {
    let failed = |e: String| CommError::Bootstrap(format!("address book: {e}"));
    let record = format!("{}\t{addr}\t{}\t{unix}", config.node_id, std::process::id());
    book.put(&format!("kolo-comm/{}", config.rank), record.as_bytes()).map_err(failed)?;
    // short slices, so that an interrupt (an elastic round moving on) is seen
    let wait = |key: &str| -> Result<Option<Vec<u8>>, CommError> {
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let slice = if config.interrupt.is_some() { remaining.min(Duration::from_millis(200)) } else { remaining };
            if let Some(v) = book.wait(key, slice).map_err(failed)? {
                return Ok(Some(v));
            }
            check_interrupt(&config.interrupt)?;
            if slice >= remaining {
                return Ok(None);
            }
        }
    };
    let table = if config.rank == 0 {
        let mut records = Vec::with_capacity(config.size);
        for r in 0..config.size {
            match wait(&format!("kolo-comm/{r}"))? {
                Some(v) => records.push(String::from_utf8_lossy(&v).into_owned()),
                None => {
                    let mut missing = vec![r];
                    for m in r + 1..config.size {
                        if book.wait(&format!("kolo-comm/{m}"), Duration::ZERO).map_err(failed)?.is_none() {
                            missing.push(m);
                        }
                    }
                    return Err(CommError::Bootstrap(format!(
                        "ranks {missing:?} did not show up within {:.1} s",
                        config.timeout.as_secs_f64()
                    )));
                }
            }
        }
        let table = records.join("\n");
        book.put("kolo-comm/table", table.as_bytes()).map_err(failed)?;
        table
    } else {
        match wait("kolo-comm/table")? {
            Some(v) => String::from_utf8_lossy(&v).into_owned(),
            None => {
                return Err(CommError::Bootstrap(format!(
                    "no address table from rank 0 within {:.1} s: rank 0 or another rank did not show up",
                    config.timeout.as_secs_f64()
                )))
            }
        }
    };
    parse_table(&table, config.size)
}

fn parse_table(table: &str, size: usize) -> Result<Vec<Peer>, CommError> {
    let mut node_index: HashMap<String, usize> = HashMap::new();
    let mut peers = Vec::with_capacity(size);
    for line in table.lines() {
        let bad = || CommError::Bootstrap(format!("malformed address record '{line}'"));
        let mut parts = line.split('\t');
        let (Some(node), Some(addr), Some(pid), Some(unix)) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let next = node_index.len();
        let node = *node_index.entry(node.to_string()).or_insert(next);
        peers.push(Peer {
            node,
            addr: addr.parse().map_err(|_| bad())?,
            pid: pid.parse().map_err(|_| bad())?,
            unix: unix.to_string(),
        });
    }
    if peers.len() != size {
        return Err(CommError::Bootstrap(format!("address table has {} ranks, expected {size}", peers.len())));
    }
    Ok(peers)
}
