//! The HTTP server. One tokio task per connection, HTTP/1.1 keep-alive,
//! a large listen backlog, and a bound on everything a client can make it
//! hold: paths, values, keys, store bytes, header and body read time, and
//! connections.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use crate::elastic::{JOINED_SCOPE, RANK_AND_SIZE, ROUND_KEY};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONNECTION, CONTENT_LENGTH};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use kolo_topology::Slot;
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::RendezvousError;

/// Header in which kolo's own clients present the job's secret.
pub const SECRET_HEADER: &str = "x-kolo-secret";

/// What the server listens on and the limits it holds its clients to.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The address to listen on; port 0 picks a free one.
    pub bind: SocketAddr,
    /// Largest value a PUT may carry; larger ones get 413. Default 8 MiB.
    pub max_body_bytes: usize,
    /// Longest request path, `/<scope>/<key>` with any query string;
    /// longer ones get 414. Default 1 KiB.
    pub max_path_bytes: usize,
    /// Most keys the store holds over all scopes; a PUT of a new key past it
    /// gets 507. Default 262144 (256 Ki).
    pub max_keys: usize,
    /// Most bytes the store holds: scope, key and value bytes of every key,
    /// plus the announced length of every PUT body still arriving (so a PUT
    /// that overwrites needs room for its new value until it lands). A PUT
    /// that does not fit gets 507. Default 256 MiB.
    pub max_store_bytes: usize,
    /// When set, a request that presents a secret must present this one.
    pub secret: Option<String>,
    /// Refuse requests that present no secret (kolo-only jobs). Off by
    /// default, since Horovod's C++ client cannot present one.
    pub require_secret: bool,
    /// The listening socket's backlog of connections not yet accepted.
    /// Default 8192.
    pub backlog: u32,
    /// How long a client may take to send a request's headers; also how
    /// long a connection may sit idle before its first or next request
    /// (hyper starts this timer whenever it waits for a request). Default 30 s.
    pub header_timeout: Duration,
    /// How long a client may take to send a PUT's body; a slower one gets
    /// 408 and its connection is closed. Default 30 s.
    pub body_timeout: Duration,
    /// Most connections served at once; past it a new connection gets 503
    /// and is closed at once, so the clients already served keep working.
    /// Default 16384.
    pub max_connections: usize,
    /// Asked about each connection before it is served (the protocol has
    /// no secret that Gloo's client could present); `None` serves anyone
    /// who can reach `bind`.
    pub gate: Option<crate::PeerGate>,
}

impl ServerConfig {
    /// A server on `bind` with the defaults above: no secret, no gate.
    pub fn new(bind: SocketAddr) -> Self {
        ServerConfig {
            bind,
            max_body_bytes: 8 << 20,
            max_path_bytes: 1 << 10,
            max_keys: 1 << 18,
            max_store_bytes: 256 << 20,
            secret: None,
            require_secret: false,
            backlog: 8192,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
            max_connections: 16384,
            gate: None,
        }
    }
}

/// What one key costs the store's byte budget.
fn entry_bytes(scope: &str, key: &str, value_len: usize) -> usize {
    scope.len() + key.len() + value_len
}

#[derive(Default)]
struct Store {
    scopes: HashMap<String, HashMap<String, Bytes>>,
    /// Size of each scope the plan defines.
    plan_sizes: HashMap<String, usize>,
    /// Ranks (keys) that finished (DELETE) each plan scope since it was last
    /// cleared: a set, so that a retried DELETE counts once.
    finished: HashMap<String, HashSet<String>>,
    plan: Vec<Slot>,
    /// The elastic round the plan belongs to (`GET /rank_and_size/round`).
    round: u64,
    /// Keys held over all scopes.
    keys: usize,
    /// Bytes held, as [`entry_bytes`] counts them.
    bytes: usize,
    /// Bytes promised to PUT bodies still arriving.
    reserved: usize,
}

impl Store {
    fn init(&mut self, plan: &[Slot]) {
        // PUTs in flight still hold their reservations and give them back later
        let (reserved, round) = (self.reserved, self.round);
        *self = Store { reserved, round, ..Store::default() };
        for slot in plan {
            let i = &slot.info;
            self.plan_sizes.insert("global".into(), i.size as usize);
            self.plan_sizes.insert(format!("local_{}", slot.host), i.local_size as usize);
            self.plan_sizes.insert(format!("cross_{}", i.local_rank), i.cross_size as usize);
        }
        self.plan = plan.to_vec();
    }

    fn finish(&mut self, scope: &str, key: &str) {
        if let Some(&size) = self.plan_sizes.get(scope) {
            let done = self.finished.entry(scope.to_string()).or_default();
            done.insert(key.to_string());
            if done.len() >= size {
                // every rank is done: the scope starts afresh for the next round
                self.finished.remove(scope);
                if let Some(keys) = self.scopes.remove(scope) {
                    for (key, value) in keys {
                        self.forget(scope, &key, &value);
                    }
                }
            }
        } else if let Some(keys) = self.scopes.get_mut(scope) {
            if let Some(value) = keys.remove(key) {
                if keys.is_empty() {
                    self.scopes.remove(scope);
                }
                self.forget(scope, key, &value);
            }
        }
    }

    fn forget(&mut self, scope: &str, key: &str, value: &Bytes) {
        self.keys -= 1;
        self.bytes -= entry_bytes(scope, key, value.len());
    }

    fn holds(&self, scope: &str, key: &str) -> bool {
        self.scopes.get(scope).is_some_and(|keys| keys.contains_key(key))
    }

    fn check_keys(&self, config: &ServerConfig, scope: &str, key: &str) -> Result<(), String> {
        if self.keys >= config.max_keys && !self.holds(scope, key) {
            return Err(format!(
                "store full: it holds {} keys, the limit; delete keys or raise the server's max_keys",
                self.keys
            ));
        }
        Ok(())
    }

    /// Admits a PUT of `length` bytes before its body is read, reserving
    /// its bytes so that concurrent PUTs cannot together pass the bound.
    fn reserve(&mut self, config: &ServerConfig, scope: &str, key: &str, length: usize) -> Result<usize, String> {
        self.check_keys(config, scope, key)?;
        let needed = entry_bytes(scope, key, length);
        let in_use = self.bytes + self.reserved;
        if in_use.saturating_add(needed) > config.max_store_bytes {
            return Err(format!(
                "store full: {in_use} of {} bytes held or arriving and this key needs {needed}; \
                 delete keys or raise the server's max_store_bytes",
                config.max_store_bytes
            ));
        }
        self.reserved += needed;
        Ok(needed)
    }

    /// Stores a value whose bytes [`Store::reserve`] set aside.
    fn put(&mut self, config: &ServerConfig, scope: String, key: String, value: Bytes) -> Result<(), String> {
        // keys may have been added since the reservation
        self.check_keys(config, &scope, &key)?;
        let name_bytes = scope.len() + key.len();
        self.bytes += name_bytes + value.len();
        match self.scopes.entry(scope).or_default().insert(key, value) {
            // overwriting replaces the old value's bytes
            Some(old) => self.bytes -= name_bytes + old.len(),
            None => self.keys += 1,
        }
        Ok(())
    }

    /// `rank,size,local_rank,local_size,cross_rank,cross_size` of the plan's
    /// slot `host:local_rank`, or all -1 for a slot the plan does not have.
    fn rank_and_size(&self, key: &str) -> Option<String> {
        if key == ROUND_KEY {
            return Some(self.round.to_string());
        }
        let (host, local_rank) = key.rsplit_once(':')?;
        let local_rank: u32 = local_rank.parse().ok()?;
        let answer = match self.plan.iter().find(|s| s.host == host && s.info.local_rank == local_rank) {
            Some(s) => {
                let i = &s.info;
                format!("{},{},{},{},{},{}", i.rank, i.size, i.local_rank, i.local_size, i.cross_rank, i.cross_size)
            }
            None => "-1,-1,-1,-1,-1,-1".into(),
        };
        Some(answer)
    }
}

struct Shared {
    store: Mutex<Store>,
    config: ServerConfig,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        // a panic while holding the lock cannot leave the map half-written
        self.store.lock().unwrap_or_else(|poison| poison.into_inner())
    }
}

/// Store bytes set aside for a PUT body still arriving; given back when
/// the PUT lands or fails, or when the connection drops mid-body.
struct Reservation<'a> {
    shared: &'a Shared,
    bytes: usize,
}

impl Reservation<'_> {
    /// Stores the value and ends the reservation under one lock.
    fn land(mut self, scope: String, key: String, value: Bytes) -> Result<(), String> {
        let mut store = self.shared.store();
        store.reserved -= std::mem::take(&mut self.bytes);
        store.put(&self.shared.config, scope, key, value)
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.shared.store().reserved -= self.bytes;
        }
    }
}

/// Binds a listening socket (address reuse on), for a server.
pub(crate) fn listen(bind: SocketAddr, backlog: u32) -> Result<(tokio::net::TcpListener, SocketAddr), RendezvousError> {
    let bind_err = |source| RendezvousError::Bind { addr: bind, source };
    let socket = if bind.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }.map_err(bind_err)?;
    socket.set_reuseaddr(true).map_err(bind_err)?;
    socket.bind(bind).map_err(bind_err)?;
    let listener = socket.listen(backlog).map_err(bind_err)?;
    let addr = listener.local_addr().map_err(bind_err)?;
    Ok((listener, addr))
}

/// A server's accept loop on the current runtime: `stop` ends it and waits
/// for its connections to close; dropping aborts it.
pub(crate) struct Serving {
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Serving {
    /// Spawns `serve`, which must return once its receiver says stop.
    pub(crate) fn spawn<F>(serve: impl FnOnce(watch::Receiver<bool>) -> F) -> Serving
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let (stop, stopped) = watch::channel(false);
        Serving { stop, task: Some(tokio::spawn(serve(stopped))) }
    }

    pub(crate) async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A running rendezvous server; stopped by [`RendezvousServer::stop`] or on drop.
pub struct RendezvousServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    serving: Serving,
}

impl RendezvousServer {
    /// Binds and starts serving on the current tokio runtime; scopes are
    /// sized from `plan` (which may be empty and set later with `init`).
    pub async fn start(config: ServerConfig, plan: &[Slot]) -> Result<Self, RendezvousError> {
        let (listener, addr) = listen(config.bind, config.backlog)?;
        let mut store = Store::default();
        store.init(plan);
        let shared = Arc::new(Shared { store: Mutex::new(store), config });
        let serving = Serving::spawn(|stopped| accept_loop(listener, shared.clone(), stopped));
        tracing::debug!(%addr, "rendezvous server listening");
        Ok(RendezvousServer { addr, shared, serving })
    }

    /// The address it listens on (with the port chosen, if `bind` had 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Resets the store and sizes the scopes from a new plan (a new round).
    pub fn init(&self, plan: &[Slot]) {
        self.shared.store().init(plan);
    }

    /// Starts elastic round `round`: the store afresh, scopes and
    /// `rank_and_size` answers from `plan`, and `GET /rank_and_size/round`
    /// answering `round`, all under one lock, so a worker that sees the new
    /// round number finds the new assignments.
    pub fn set_round(&self, round: u64, plan: &[Slot]) {
        let mut store = self.shared.store();
        let joined = store.scopes.remove(JOINED_SCOPE).unwrap_or_default();
        store.init(plan);
        store.round = round;
        for (key, value) in joined {
            // the store was emptied: what it held before fits again
            let _ = store.put(&self.shared.config, JOINED_SCOPE.to_string(), key, value);
        }
    }

    /// The value of `key` in `scope`, as a GET would answer it.
    pub fn value(&self, scope: &str, key: &str) -> Option<Bytes> {
        self.shared.store().scopes.get(scope).and_then(|keys| keys.get(key)).cloned()
    }

    /// Stops accepting, closes every connection and waits for the tasks to end.
    pub async fn stop(self) {
        self.serving.stop().await;
    }
}

async fn accept_loop(listener: tokio::net::TcpListener, shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    // connection tasks live in the set, so ending this loop ends them all
    let mut connections = JoinSet::new();
    let mut failures = AcceptFailures::default();
    let mut at_cap = false;
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    failures.recovered();
                    while connections.try_join_next().is_some() {}
                    let max = shared.config.max_connections;
                    if connections.len() >= max {
                        if !at_cap {
                            tracing::warn!("rendezvous server at its limit of {max} connections (max_connections): refusing new ones");
                            at_cap = true;
                        }
                        refuse(stream, max);
                        continue;
                    }
                    at_cap = false;
                    connections.spawn(serve_connection(stream, shared.clone()));
                }
                // out of descriptors or similar: back off instead of spinning,
                // longer while it lasts; timeouts free descriptors meanwhile
                Err(e) => if !failures.back_off(&e, &mut stopped).await {
                    break;
                },
            },
        }
    }
    connections.shutdown().await;
}

/// A burst of failed accepts (out of descriptors, mostly): logged once
/// when it starts and once when it ends, with a wait before each next
/// accept that doubles while it lasts. Every accept loop of kolo's servers
/// and of its driver backs off with it.
pub struct AcceptFailures {
    /// Who accepts, for the log ("rendezvous", "the driver").
    what: &'static str,
    count: u64,
    delay: Duration,
}

impl Default for AcceptFailures {
    fn default() -> Self {
        AcceptFailures::new("rendezvous")
    }
}

impl AcceptFailures {
    const FIRST_DELAY: Duration = Duration::from_millis(5);
    const MAX_DELAY: Duration = Duration::from_millis(100);

    /// No failures yet; `what` names the accepting server in the log.
    pub fn new(what: &'static str) -> Self {
        AcceptFailures { what, count: 0, delay: Duration::ZERO }
    }

    /// Counts a failure and waits before the next accept; false when told
    /// to stop meanwhile.
    pub(crate) async fn back_off(&mut self, e: &std::io::Error, stopped: &mut watch::Receiver<bool>) -> bool {
        let delay = self.failed(e);
        tokio::select! {
            _ = stopped.changed() => false,
            _ = tokio::time::sleep(delay) => true,
        }
    }

    /// Counts a failure and says how long to wait before the next accept.
    pub fn failed(&mut self, e: &std::io::Error) -> Duration {
        if self.count == 0 {
            let errno = e.raw_os_error().map(nix::errno::Errno::from_raw);
            if matches!(errno, Some(nix::errno::Errno::EMFILE | nix::errno::Errno::ENFILE)) {
                let limit = match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE) {
                    Ok((soft, hard)) => format!("the process may open {soft} (hard limit {hard})"),
                    Err(_) => "the limit is unknown".into(),
                };
                tracing::warn!(
                    "{} accept failed: {e}; out of file descriptors ({limit}): \
                     waiting for connections to close; raise `ulimit -n` or lower max_connections",
                    self.what
                );
            } else {
                tracing::warn!("{} accept failed: {e}; retrying", self.what);
            }
            self.delay = Self::FIRST_DELAY;
        } else {
            self.delay = (self.delay * 2).min(Self::MAX_DELAY);
        }
        self.count += 1;
        self.delay
    }

    /// An accept succeeded: the burst, if any, is over.
    pub fn recovered(&mut self) {
        if self.count > 0 {
            tracing::info!("{} accepting again after {} failed accepts", self.what, self.count);
            *self = AcceptFailures::new(self.what);
        }
    }
}

/// Answers 503 without waiting and closes: the connection is over the cap.
fn refuse(stream: TcpStream, max: usize) {
    let body = format!(
        "too many connections: the server serves at most {max}; retry later or raise the server's max_connections\n"
    );
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    // a fresh socket's send buffer takes this at once; if not, closing is enough
    let _ = stream.try_write(response.as_bytes());
}

async fn serve_connection(stream: TcpStream, shared: Arc<Shared>) {
    if let (Some(gate), Ok(peer), Ok(local)) = (&shared.config.gate, stream.peer_addr(), stream.local_addr()) {
        if !gate.admits("rendezvous server", peer, local).await {
            return;
        }
    }
    let _ = stream.set_nodelay(true);
    let timeout = shared.config.header_timeout;
    let service = service_fn(move |req| {
        let shared = shared.clone();
        async move { Ok::<_, Infallible>(handle(req, &shared).await) }
    });
    // hyper 1 runs the header timer from the moment it waits for a request,
    // so it also closes connections idle before or between requests
    let _ = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(timeout)
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

fn reply(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
}

fn error(status: StatusCode, message: String) -> Response<Full<Bytes>> {
    reply(status, message + "\n")
}

/// An error after which the connection closes: the body was not read, so
/// the client must not send its next request on this connection.
fn error_closing(status: StatusCode, message: String) -> Response<Full<Bytes>> {
    let mut response = error(status, message);
    response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Splits `/<scope>/<key>`; anything else is malformed.
fn split_path(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix('/')?;
    let (scope, key) = rest.split_once('/')?;
    (!scope.is_empty() && !key.is_empty() && !key.contains('/')).then_some((scope, key))
}

fn authorized(req: &Request<Incoming>, config: &ServerConfig) -> bool {
    match (req.headers().get(SECRET_HEADER), &config.secret) {
        (Some(given), Some(secret)) => constant_time_eq(given.as_bytes(), secret.as_bytes()),
        (Some(_), None) => true,
        (None, _) => !config.require_secret,
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(a, b).into()
}

async fn handle(req: Request<Incoming>, shared: &Shared) -> Response<Full<Bytes>> {
    let config = &shared.config;
    if !authorized(&req, config) {
        tracing::warn!(path = %req.uri(), "rendezvous request refused: wrong or missing secret");
        return error(StatusCode::UNAUTHORIZED, "wrong or missing job secret".into());
    }
    // Horovod keys keep any query string, as its server does
    let path = req.uri().path_and_query().map_or("", |p| p.as_str());
    if path.len() > config.max_path_bytes {
        return error_closing(
            StatusCode::URI_TOO_LONG,
            format!(
                "path of {} bytes is over the limit of {} bytes; use shorter scopes and keys or raise the server's max_path_bytes",
                path.len(),
                config.max_path_bytes
            ),
        );
    }
    let path = path.to_string();
    let Some((scope, key)) = split_path(&path) else {
        return error(StatusCode::BAD_REQUEST, format!("malformed path '{path}': expected /<scope>/<key>"));
    };
    let (scope, key) = (scope.to_string(), key.to_string());
    match *req.method() {
        Method::GET if scope == RANK_AND_SIZE => match shared.store().rank_and_size(&key) {
            Some(answer) => reply(StatusCode::OK, answer),
            None => error(StatusCode::BAD_REQUEST, format!("malformed slot '{key}': expected <host>:<local_rank>")),
        },
        Method::GET => match shared.store().scopes.get(&scope).and_then(|s| s.get(&key)) {
            Some(value) => reply(StatusCode::OK, value.clone()),
            None => reply(StatusCode::NOT_FOUND, Bytes::new()),
        },
        Method::PUT if scope == RANK_AND_SIZE => {
            error(StatusCode::FORBIDDEN, format!("scope '{RANK_AND_SIZE}' is reserved for elastic rank assignment"))
        }
        Method::PUT => {
            let length = req.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            let Some(length) = length else {
                return error(StatusCode::LENGTH_REQUIRED, "PUT needs a Content-Length header".into());
            };
            if length > config.max_body_bytes as u64 {
                return error_closing(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "value of {length} bytes is over the limit of {} bytes; store smaller values or raise the server's max_body_bytes",
                        config.max_body_bytes
                    ),
                );
            }
            let length = length as usize;
            // the bytes are set aside before a single one is read
            let reserved = shared.store().reserve(config, &scope, &key, length);
            let reservation = match reserved {
                Ok(bytes) => Reservation { shared, bytes },
                Err(message) => return error_closing(StatusCode::INSUFFICIENT_STORAGE, message),
            };
            let body = match tokio::time::timeout(config.body_timeout, read_body(req.into_body(), length)).await {
                Ok(Ok(body)) => body,
                Ok(Err(e)) => return error_closing(StatusCode::BAD_REQUEST, format!("reading the body failed: {e}")),
                Err(_) => {
                    return error_closing(
                        StatusCode::REQUEST_TIMEOUT,
                        format!(
                            "the body of {length} bytes did not arrive within {:?}; send it faster or raise the server's body_timeout",
                            config.body_timeout
                        ),
                    )
                }
            };
            match reservation.land(scope, key, body) {
                Ok(()) => reply(StatusCode::OK, Bytes::new()),
                Err(message) => error(StatusCode::INSUFFICIENT_STORAGE, message),
            }
        }
        Method::DELETE => {
            shared.store().finish(&scope, &key);
            reply(StatusCode::OK, Bytes::new())
        }
        _ => {
            let mut r = error(StatusCode::METHOD_NOT_ALLOWED, format!("method {} not supported", req.method()));
            r.headers_mut().insert("allow", HeaderValue::from_static("GET, PUT, DELETE"));
            r
        }
    }
}

/// Reads a body of `length` bytes into one buffer allocated up front,
/// since `length` was admitted already.
async fn read_body(mut body: Incoming, length: usize) -> Result<Bytes, String> {
    let mut buffer = BytesMut::with_capacity(length);
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.map_err(|e| e.to_string())?.into_data() {
            // hyper frames by Content-Length, but a body framed otherwise
            // (chunked) must not grow past what was admitted either
            if data.len() > length - buffer.len() {
                return Err(format!("body longer than its Content-Length of {length} bytes"));
            }
            buffer.extend_from_slice(&data);
        }
    }
    Ok(buffer.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_split() {
        assert_eq!(split_path("/global/0"), Some(("global", "0")));
        assert_eq!(split_path("/a/b?x=1"), Some(("a", "b?x=1")));
        for bad in ["", "/", "/a", "/a/", "//b", "/a/b/c", "/a/b/", "a/b"] {
            assert_eq!(split_path(bad), None, "{bad}");
        }
    }
}
