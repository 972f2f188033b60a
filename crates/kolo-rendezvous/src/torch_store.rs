//! A server for PyTorch's store: the wire protocol of c10d's `TCPStore` as
//! torch 2.x clients speak it (described in kolo's
//! `docs/pytorch-store-protocol.md`), so that every rank of a job connects
//! to the driver's store as a client, the way torchrun's agent serves it
//! (`TORCHELASTIC_USE_AGENT_STORE=True`).
//!
//! The protocol has no authentication of its own. The server takes
//! connections only from the peers it is told about (the job's hosts) and
//! that its gate admits (the job's user on them, see [`crate::PeerGate`]), and
//! bounds everything a client can make it hold: key and value sizes, the
//! number of keys, the store's bytes (requests reserve their bytes before
//! they are read), the connections, and the time a request may take once
//! begun. A client that breaks a bound or the protocol is disconnected (the
//! protocol has no error reply) and the reason is logged.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::server::{listen, AcceptFailures, Serving};
use crate::RendezvousError;

/// The first request's magic number (VALIDATE).
const MAGIC: u32 = 0x3C85_F7CE;

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const COMPARE_SET: u8 = 2;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const GET_NUM_KEYS: u8 = 7;
const DELETE_KEY: u8 = 8;
const APPEND: u8 = 9;
const MULTI_GET: u8 = 10;
const MULTI_SET: u8 = 11;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;
const QUEUE_PUSH: u8 = 14;
const QUEUE_POP: u8 = 15;
const QUEUE_LEN: u8 = 16;
const LIST_KEYS: u8 = 17;
const BARRIER: u8 = 18;

/// CHECK replies.
const READY: u8 = 0;
const NOT_READY: u8 = 1;
/// WAIT, BARRIER and CANCEL_WAIT replies.
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// What the store server listens on and the limits it holds its clients to.
#[derive(Clone, Debug)]
pub struct TorchStoreConfig {
    /// The address to listen on; port 0 picks a free one.
    pub bind: SocketAddr,
    /// Longest key. Default 8 KiB (torch's own server's bound).
    pub max_key_bytes: usize,
    /// Largest value. Default 8 MiB (likewise).
    pub max_value_bytes: usize,
    /// Most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET. Default 128 Ki.
    pub max_keys_per_request: u64,
    /// Most keys and queued items the store holds. Default 256 Ki.
    pub max_keys: usize,
    /// Most bytes the store holds (keys, values, queued items) plus the
    /// bytes of requests being read. Default 256 MiB.
    pub max_store_bytes: usize,
    /// Most connections at once; past it new ones are closed. Default 16384.
    pub max_connections: usize,
    /// How long a request may take to arrive once its first byte has.
    /// Connections may idle between requests for the whole job. Default 30 s.
    pub request_timeout: Duration,
    /// Peers allowed to connect; `None` lets anyone who can reach `bind`.
    pub allowed_peers: Option<HashSet<IpAddr>>,
    /// Asked about each allowed peer's connection before a byte of it is
    /// read; `None` admits them all.
    pub gate: Option<crate::PeerGate>,
}

impl TorchStoreConfig {
    /// A server on `bind` with the defaults above, open to every peer.
    pub fn new(bind: SocketAddr) -> Self {
        TorchStoreConfig {
            bind,
            max_key_bytes: 8 << 10,
            max_value_bytes: 8 << 20,
            max_keys_per_request: 128 << 10,
            max_keys: 256 << 10,
            max_store_bytes: 256 << 20,
            max_connections: 16384,
            request_timeout: Duration::from_secs(30),
            allowed_peers: None,
            gate: None,
        }
    }
}

/// A running store server; stopped by [`TorchStoreServer::stop`] or on drop.
pub struct TorchStoreServer {
    addr: SocketAddr,
    serving: Serving,
    shared: Arc<Shared>,
}

impl TorchStoreServer {
    /// Binds and serves on the current tokio runtime.
    pub async fn start(mut config: TorchStoreConfig) -> Result<Self, RendezvousError> {
        let (listener, addr) = listen(config.bind, 1024)?;
        let (changed, _) = watch::channel(0u64);
        // from here on the list lives (and grows) in `Shared::allowed` only
        let allowed = std::sync::RwLock::new(config.allowed_peers.take());
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::default()),
            changed,
            config,
            allowed,
            faults: AtomicU64::new(0),
        });
        let serving = Serving::spawn({
            let shared = shared.clone();
            |stopped| accept_loop(listener, shared, stopped)
        });
        tracing::debug!(%addr, "torch store listening");
        Ok(TorchStoreServer { addr, serving, shared })
    }

    /// The address it listens on (with the port chosen, if `bind` had 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Lets `peers` connect too (where the store admits listed peers only):
    /// the hosts an elastic job takes in after its start.
    pub fn allow(&self, peers: impl IntoIterator<Item = IpAddr>) {
        let mut allowed = self.shared.allowed.write().unwrap_or_else(|p| p.into_inner());
        if let Some(allowed) = allowed.as_mut() {
            allowed.extend(peers.into_iter().map(|ip| ip.to_canonical()));
        }
    }

    /// Stops accepting, closes every connection and waits for the tasks to end.
    pub async fn stop(self) {
        self.serving.stop().await;
    }
}

struct Shared {
    store: Mutex<Store>,
    /// Bumped on every change that can make a waiter ready.
    changed: watch::Sender<u64>,
    config: TorchStoreConfig,
    /// The peers allowed to connect (what `config.allowed_peers` was, and
    /// those allowed since); `None`: anyone.
    allowed: std::sync::RwLock<Option<HashSet<IpAddr>>>,
    /// Disconnected clients, for rate-limited logging.
    faults: AtomicU64,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn log_fault(&self, peer: SocketAddr, fault: &Fault) {
        let n = self.faults.fetch_add(1, Ordering::Relaxed);
        if n < 5 || n.is_power_of_two() {
            tracing::warn!("torch store: disconnected {peer}: {fault} ({} such so far)", n + 1);
        }
    }
}

#[derive(Default)]
struct Store {
    values: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// Keys plus queued items.
    entries: usize,
    /// Bytes held plus bytes reserved by requests being read.
    bytes: usize,
}

impl Store {
    fn present(&self, key: &[u8]) -> bool {
        self.values.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// Stores `value` under `key`, giving back an old value's bytes; true
    /// for a new key. The caller accounts for the new bytes (`keep`).
    fn put(&mut self, key: Vec<u8>, value: Vec<u8>, limits: &TorchStoreConfig) -> Result<bool, Fault> {
        let fresh = !self.values.contains_key(&key);
        if fresh && self.entries >= limits.max_keys {
            return Err(Fault::Limit(format!("the store holds {} keys, its limit (max_keys)", limits.max_keys)));
        }
        if let Some(old) = self.values.insert(key, value) {
            self.bytes -= old.len();
        } else {
            self.entries += 1;
        }
        Ok(fresh)
    }
}

/// Why a connection was closed.
#[derive(Debug)]
enum Fault {
    Protocol(String),
    Limit(String),
    Timeout,
    Io(std::io::Error),
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Protocol(what) => write!(f, "not the TCPStore protocol: {what}"),
            Fault::Limit(what) => write!(f, "over a bound: {what}"),
            Fault::Timeout => write!(f, "a request took longer than the request timeout"),
            Fault::Io(e) => write!(f, "{e}"),
        }
    }
}

impl From<std::io::Error> for Fault {
    fn from(e: std::io::Error) -> Self {
        Fault::Io(e)
    }
}

async fn accept_loop(listener: tokio::net::TcpListener, shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let mut connections = JoinSet::new();
    let mut failures = AcceptFailures::default();
    let mut refused = 0u64;
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    failures.recovered();
                    let allowed = shared
                        .allowed
                        .read()
                        .unwrap_or_else(|p| p.into_inner())
                        .as_ref()
                        .is_none_or(|a| a.contains(&peer.ip().to_canonical()));
                    if !allowed || connections.len() >= shared.config.max_connections {
                        refused += 1;
                        if refused <= 5 || refused.is_power_of_two() {
                            let why = if allowed { "at its connection limit (max_connections)" } else { "not a host of the job" };
                            tracing::warn!("torch store: refused {peer}: {why} ({refused} refused so far)");
                        }
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    connections.spawn(serve(stream, peer, shared.clone()));
                }
                Err(e) => if !failures.back_off(&e, &mut stopped).await {
                    break;
                },
            },
        }
    }
    connections.shutdown().await;
}

async fn serve(stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>) {
    if let (Some(gate), Ok(local)) = (&shared.config.gate, stream.local_addr()) {
        if !gate.admits("torch store", peer, local).await {
            return;
        }
    }
    let (read, mut write) = stream.into_split();
    let mut conn = Connection { read: BufReader::with_capacity(4 << 10, read), shared: &shared, reserved: 0 };
    let result = conn.run(&mut write).await;
    conn.release();
    match result {
        Ok(()) => {}
        Err(Fault::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
        Err(Fault::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(fault) => shared.log_fault(peer, &fault),
    }
}

/// One client's connection: its reader and the store bytes its current
/// request holds.
struct Connection<'a> {
    read: BufReader<tokio::net::tcp::OwnedReadHalf>,
    shared: &'a Shared,
    reserved: usize,
}

/// A parsed request.
enum Request {
    Validate(u32),
    Set(Vec<u8>, Vec<u8>),
    CompareSet(Vec<u8>, Vec<u8>, Vec<u8>),
    Get(Vec<u8>),
    Add(Vec<u8>, i64),
    Check(Vec<Vec<u8>>),
    Wait(Vec<Vec<u8>>),
    GetNumKeys,
    DeleteKey(Vec<u8>),
    Append(Vec<u8>, Vec<u8>),
    MultiGet(Vec<Vec<u8>>),
    MultiSet(Vec<(Vec<u8>, Vec<u8>)>),
    CancelWait,
    Ping(u32),
    QueuePush(Vec<u8>, Vec<u8>),
    QueuePop(Vec<u8>),
    QueueLen(Vec<u8>),
    ListKeys,
    Barrier(Vec<u8>, i64),
}

impl Connection<'_> {
    async fn run(&mut self, write: &mut tokio::net::tcp::OwnedWriteHalf) -> Result<(), Fault> {
        let mut validated = false;
        loop {
            let kind = match self.read.read_u8().await {
                Ok(kind) => kind,
                // a client that is done closes between requests
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            let timeout = self.shared.config.request_timeout;
            let request = tokio::time::timeout(timeout, self.request(kind)).await.map_err(|_| Fault::Timeout)??;
            if !validated {
                match request {
                    Request::Validate(MAGIC) => validated = true,
                    Request::Validate(magic) => return Err(Fault::Protocol(format!("wrong magic {magic:#x}"))),
                    _ => return Err(Fault::Protocol(format!("first request of type {kind}, not VALIDATE"))),
                }
                continue;
            }
            let reply = self.apply(request, write).await?;
            self.release();
            if !reply.is_empty() {
                write.write_all(&reply).await?;
            }
        }
    }

    /// Gives back the bytes the request reserved and did not store.
    fn release(&mut self) {
        if self.reserved > 0 {
            self.shared.store().bytes -= self.reserved;
            self.reserved = 0;
        }
    }

    /// Reserves `len` bytes of the store's budget for what is being read.
    fn reserve(&mut self, len: usize) -> Result<(), Fault> {
        let max = self.shared.config.max_store_bytes;
        let mut store = self.shared.store();
        if store.bytes + len > max {
            return Err(Fault::Limit(format!(
                "{len} more bytes would pass the store's {max} (max_store_bytes; {} held)",
                store.bytes
            )));
        }
        store.bytes += len;
        self.reserved += len;
        Ok(())
    }

    /// Moves `len` reserved bytes into the store (they are now held).
    fn keep(&mut self, len: usize) {
        self.reserved -= len;
    }

    async fn bytes(&mut self, max: usize, what: &str) -> Result<Vec<u8>, Fault> {
        let len = self.read.read_u64_le().await?;
        if len > max as u64 {
            return Err(Fault::Limit(format!("a {what} of {len} bytes (at most {max})")));
        }
        self.reserve(len as usize)?;
        let mut buf = vec![0u8; len as usize];
        self.read.read_exact(&mut buf).await?;
        Ok(buf)
    }

    async fn key(&mut self) -> Result<Vec<u8>, Fault> {
        self.bytes(self.shared.config.max_key_bytes, "key").await
    }

    async fn value(&mut self) -> Result<Vec<u8>, Fault> {
        self.bytes(self.shared.config.max_value_bytes, "value").await
    }

    async fn count(&mut self) -> Result<usize, Fault> {
        let n = self.read.read_u64_le().await?;
        let max = self.shared.config.max_keys_per_request;
        if n > max {
            return Err(Fault::Limit(format!("{n} keys in one request (at most {max})")));
        }
        Ok(n as usize)
    }

    async fn keys(&mut self) -> Result<Vec<Vec<u8>>, Fault> {
        let n = self.count().await?;
        let mut keys = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            keys.push(self.key().await?);
        }
        Ok(keys)
    }

    async fn request(&mut self, kind: u8) -> Result<Request, Fault> {
        Ok(match kind {
            VALIDATE => Request::Validate(self.read.read_u32_le().await?),
            SET => Request::Set(self.key().await?, self.value().await?),
            COMPARE_SET => Request::CompareSet(self.key().await?, self.value().await?, self.value().await?),
            GET => Request::Get(self.key().await?),
            ADD => Request::Add(self.key().await?, self.read.read_i64_le().await?),
            CHECK => Request::Check(self.keys().await?),
            WAIT => Request::Wait(self.keys().await?),
            GET_NUM_KEYS => Request::GetNumKeys,
            DELETE_KEY => Request::DeleteKey(self.key().await?),
            APPEND => Request::Append(self.key().await?, self.value().await?),
            MULTI_GET => Request::MultiGet(self.keys().await?),
            MULTI_SET => {
                let n = self.count().await?;
                let mut pairs = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    pairs.push((self.key().await?, self.value().await?));
                }
                Request::MultiSet(pairs)
            }
            CANCEL_WAIT => Request::CancelWait,
            PING => Request::Ping(self.read.read_u32_le().await?),
            QUEUE_PUSH => Request::QueuePush(self.key().await?, self.value().await?),
            QUEUE_POP => Request::QueuePop(self.key().await?),
            QUEUE_LEN => Request::QueueLen(self.key().await?),
            LIST_KEYS => Request::ListKeys,
            BARRIER => Request::Barrier(self.key().await?, self.read.read_i64_le().await?),
            other => return Err(Fault::Protocol(format!("unknown request type {other}"))),
        })
    }

    /// Carries out a request; the reply's bytes (empty: none).
    async fn apply(&mut self, request: Request, write: &mut tokio::net::tcp::OwnedWriteHalf) -> Result<Vec<u8>, Fault> {
        let config = &self.shared.config;
        let mut reply = Vec::new();
        match request {
            Request::Validate(_) => return Err(Fault::Protocol("VALIDATE twice".into())),
            Request::Set(key, value) => {
                self.set(key, value)?;
                self.shared.wake();
            }
            Request::CompareSet(key, expected, desired) => {
                let mut store = self.shared.store();
                let current = store.values.get(&key).cloned();
                let stores = match &current {
                    None => expected.is_empty(),
                    Some(current) => *current == expected,
                };
                let answer = if stores {
                    let (key_len, len) = (key.len(), desired.len());
                    let fresh = store.put(key, desired.clone(), config)?;
                    drop(store);
                    self.keep(len + if fresh { key_len } else { 0 });
                    // only a key that appears can make a waiter ready
                    if fresh {
                        self.shared.wake();
                    }
                    desired
                } else {
                    // a missing key answers `expected` (the caller sees it
                    // is not `desired`), a present one its value
                    current.unwrap_or(expected)
                };
                put_bytes(&mut reply, &answer);
            }
            Request::Get(key) => {
                let value = self.shared.store().values.get(&key).cloned().unwrap_or_default();
                put_bytes(&mut reply, &value);
            }
            Request::Add(key, delta) => {
                let total = self.add(key, delta)?;
                reply.extend_from_slice(&total.to_le_bytes());
                self.shared.wake();
            }
            Request::Check(keys) => {
                let store = self.shared.store();
                reply.push(if keys.iter().all(|k| store.present(k)) { READY } else { NOT_READY });
            }
            Request::Wait(keys) => {
                let answer = self.wait_until(write, |store| keys.iter().all(|k| store.present(k))).await?;
                reply.push(answer);
            }
            Request::GetNumKeys => reply.extend_from_slice(&(self.shared.store().values.len() as i64).to_le_bytes()),
            Request::DeleteKey(key) => {
                let mut store = self.shared.store();
                let removed = store.values.remove(&key).map(|value| {
                    store.bytes -= key.len() + value.len();
                    store.entries -= 1;
                });
                reply.extend_from_slice(&(removed.is_some() as i64).to_le_bytes());
            }
            Request::Append(key, tail) => {
                let mut store = self.shared.store();
                let len = tail.len();
                match store.values.get_mut(&key) {
                    Some(value) => {
                        if value.len() + len > config.max_value_bytes {
                            return Err(Fault::Limit(format!(
                                "appending makes a value over {} bytes",
                                config.max_value_bytes
                            )));
                        }
                        value.extend_from_slice(&tail);
                        drop(store);
                        self.keep(len);
                    }
                    None => {
                        let key_len = key.len();
                        store.put(key, tail, config)?;
                        drop(store);
                        self.keep(key_len + len);
                    }
                }
                self.shared.wake();
            }
            Request::MultiGet(keys) => {
                let store = self.shared.store();
                for key in &keys {
                    put_bytes(&mut reply, store.values.get(key).map_or(&[][..], |v| v));
                }
            }
            Request::MultiSet(pairs) => {
                for (key, value) in pairs {
                    self.set(key, value)?;
                }
                self.shared.wake();
            }
            Request::CancelWait => reply.push(WAIT_CANCELED),
            Request::Ping(nonce) => reply.extend_from_slice(&nonce.to_le_bytes()),
            Request::QueuePush(key, item) => {
                let mut store = self.shared.store();
                if store.entries >= config.max_keys {
                    return Err(Fault::Limit(format!("the store holds {} entries (max_keys)", config.max_keys)));
                }
                store.entries += 1;
                let len = item.len();
                let fresh = !store.queues.contains_key(&key);
                let key_len = key.len();
                store.queues.entry(key).or_default().push_back(item);
                drop(store);
                // a queue's name is held once, with its first item
                self.keep(len + if fresh { key_len } else { 0 });
                self.shared.wake();
            }
            Request::QueuePop(key) => {
                let mut store = self.shared.store();
                let before = store.queues.get(&key).map_or(0, VecDeque::len);
                reply.extend_from_slice(&(before as i64).to_le_bytes());
                if let Some(item) = store.queues.get_mut(&key).and_then(VecDeque::pop_front) {
                    store.entries -= 1;
                    store.bytes -= item.len();
                    if store.queues.get(&key).is_some_and(VecDeque::is_empty) {
                        store.queues.remove(&key);
                        store.bytes -= key.len();
                    }
                    put_bytes(&mut reply, &item);
                }
            }
            Request::QueueLen(key) => {
                let len = self.shared.store().queues.get(&key).map_or(0, VecDeque::len);
                reply.extend_from_slice(&(len as i64).to_le_bytes());
            }
            Request::ListKeys => {
                let store = self.shared.store();
                reply.extend_from_slice(&(store.values.len() as i64).to_le_bytes());
                for key in store.values.keys() {
                    put_bytes(&mut reply, key);
                }
            }
            Request::Barrier(key, world_size) => {
                self.add(key.clone(), 1)?;
                self.shared.wake();
                let reached = |store: &Store| counter(store.values.get(&key)).is_some_and(|n| n >= world_size);
                reply.push(self.wait_until(write, reached).await?);
            }
        }
        Ok(reply)
    }

    fn set(&mut self, key: Vec<u8>, value: Vec<u8>) -> Result<(), Fault> {
        let (key_len, len) = (key.len(), value.len());
        let fresh = self.shared.store().put(key, value, &self.shared.config)?;
        // an overwritten key is held already: this request's copy is given back
        self.keep(len + if fresh { key_len } else { 0 });
        Ok(())
    }

    /// ADD: the counter kept as decimal text; a missing key counts 0.
    fn add(&mut self, key: Vec<u8>, delta: i64) -> Result<i64, Fault> {
        let mut store = self.shared.store();
        let current = match store.values.get(&key) {
            None => 0,
            Some(text) => {
                counter(Some(text)).ok_or_else(|| Fault::Protocol("ADD to a key whose value is not a number".into()))?
            }
        };
        let total = current.checked_add(delta).ok_or_else(|| Fault::Protocol("ADD overflows".into()))?;
        let text = total.to_string().into_bytes();
        // the key's bytes were reserved as it was read; the text is new
        if store.bytes + text.len() > self.shared.config.max_store_bytes {
            return Err(Fault::Limit("the store is full (max_store_bytes)".into()));
        }
        let (key_len, text_len) = (key.len(), text.len());
        let fresh = store.put(key, text, &self.shared.config)?;
        store.bytes += text_len;
        drop(store);
        if fresh {
            self.keep(key_len);
        }
        Ok(total)
    }

    /// Answers STOP_WAITING once `ready` holds, or WAIT_CANCELED when the
    /// client cancels first.
    async fn wait_until(
        &mut self,
        write: &mut tokio::net::tcp::OwnedWriteHalf,
        ready: impl Fn(&Store) -> bool,
    ) -> Result<u8, Fault> {
        // subscribe before looking, so no change between is missed
        let mut changes = self.shared.changed.subscribe();
        loop {
            if ready(&self.shared.store()) {
                return Ok(STOP_WAITING);
            }
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        return Err(Fault::Io(std::io::ErrorKind::BrokenPipe.into()));
                    }
                }
                next = self.read.read_u8() => match next? {
                    // the client gave up: the cancel's answer is the wait's
                    CANCEL_WAIT => return Ok(WAIT_CANCELED),
                    other => {
                        let _ = write.flush().await;
                        return Err(Fault::Protocol(format!("request type {other} while waiting (only CANCEL_WAIT may come)")));
                    }
                },
            }
        }
    }
}

/// A counter's value: its decimal text.
fn counter(text: Option<&Vec<u8>>) -> Option<i64> {
    std::str::from_utf8(text?).ok()?.trim().parse().ok()
}

fn put_bytes(reply: &mut Vec<u8>, bytes: &[u8]) {
    reply.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    reply.extend_from_slice(bytes);
}
