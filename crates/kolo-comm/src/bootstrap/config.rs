//! What a rank needs to join ([`Config`]): set by the caller, or read from
//! the variables `kolo run` sets, or from a caller's address book
//! (torch.distributed's store) with what a job's variables add.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use kolo_auth::Secret;
use kolo_topology::env_names as names;

use crate::comm::Tuning;
use crate::interrupt::Interrupt;
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
pub(super) fn listen_address(iface: Option<&str>) -> Result<IpAddr, CommError> {
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
