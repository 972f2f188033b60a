//! Blocking client for the rendezvous store, over `std::net` alone (no
//! async runtime): for workers, which may run it from any thread, async
//! code included. One keep-alive connection, re-dialled when the server
//! closed it; `attempts` tries `retry_delay` apart on transport errors and
//! 5xx; `wait` polls 404s every `poll_interval`, like Gloo's store. Every
//! request is bounded in time (`request_timeout`) and its response in size.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::{ClientConfig, RendezvousError, SECRET_HEADER};

/// Largest response head (status line and headers).
const MAX_HEAD_BYTES: usize = 16 << 10;
/// Largest response body by default: the server takes values of up to 8 MiB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 16 << 20;

/// A blocking client of the rendezvous store: one connection, reused.
pub struct BlockingClient {
    config: ClientConfig,
    conn: Option<BufReader<TcpStream>>,
    max_response: usize,
    requests: u64,
}

/// A response: status and body.
struct Response {
    status: u16,
    body: Vec<u8>,
    /// The server will close the connection after it.
    close: bool,
}

/// A failed exchange; `stale` when a reused connection gave nothing back
/// (the server closed it while idle), which costs a re-dial, not an attempt.
struct Failure {
    reason: String,
    stale: bool,
    source: Option<io::Error>,
}

impl BlockingClient {
    /// A client for `config`; it connects on its first request.
    pub fn new(config: ClientConfig) -> Self {
        BlockingClient { config, conn: None, max_response: DEFAULT_MAX_RESPONSE_BYTES, requests: 0 }
    }

    /// Refuses responses with a body larger than `bytes`.
    pub fn with_max_response(mut self, bytes: usize) -> Self {
        self.max_response = bytes;
        self
    }

    /// The settings it was made with.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// Requests sent so far, retries and re-dials included.
    pub fn requests(&self) -> u64 {
        self.requests
    }

    /// Stores `value` under `key` in `scope`, replacing any earlier value.
    pub fn put(&mut self, scope: &str, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        self.request("PUT", scope, key, value).map(drop)
    }

    /// The value, or `None` when the key is absent.
    pub fn get(&mut self, scope: &str, key: &str) -> Result<Option<Vec<u8>>, RendezvousError> {
        self.request("GET", scope, key, &[])
    }

    /// Marks `key` (a rank) finished with `scope`.
    pub fn delete(&mut self, scope: &str, key: &str) -> Result<(), RendezvousError> {
        self.request("DELETE", scope, key, &[]).map(drop)
    }

    /// Waits until every key is present, polling a missing one every
    /// `poll_interval`, and returns the values in the order asked.
    pub fn wait(&mut self, scope: &str, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>, RendezvousError> {
        let start = Instant::now();
        let mut values = Vec::with_capacity(keys.len());
        for key in keys {
            loop {
                if let Some(value) = self.get(scope, key)? {
                    values.push(value);
                    break;
                }
                if start.elapsed() >= timeout {
                    return Err(RendezvousError::WaitTimeout {
                        addr: self.config.addr.clone(),
                        scope: scope.into(),
                        missing: keys[values.len()..].iter().map(|k| k.to_string()).collect(),
                        waited_s: start.elapsed().as_secs_f64(),
                    });
                }
                std::thread::sleep(self.config.poll_interval.min(timeout.saturating_sub(start.elapsed())));
            }
        }
        Ok(values)
    }

    fn request(
        &mut self,
        method: &'static str,
        scope: &str,
        key: &str,
        body: &[u8],
    ) -> Result<Option<Vec<u8>>, RendezvousError> {
        let path = format!("/{scope}/{key}");
        let attempts = self.config.attempts.max(1);
        let mut last_failure = String::new();
        let mut last_source: Option<io::Error> = None;
        for attempt in 0..attempts {
            if attempt > 0 {
                std::thread::sleep(self.config.retry_delay);
            }
            let mut outcome = self.send_once(method, &path, body);
            if let Err(Failure { stale: true, .. }) = outcome {
                outcome = self.send_once(method, &path, body);
            }
            match outcome {
                Ok(r) if r.status == 200 => return Ok(Some(r.body)),
                Ok(r) if r.status == 404 => return Ok(None),
                Ok(r) if (400..500).contains(&r.status) => {
                    return Err(RendezvousError::Status {
                        method,
                        path,
                        status: r.status,
                        body: String::from_utf8_lossy(&r.body).trim().to_string(),
                    });
                }
                Ok(r) => {
                    last_failure = format!("status {}: {}", r.status, String::from_utf8_lossy(&r.body).trim());
                    last_source = None;
                }
                Err(f) => {
                    self.conn = None;
                    last_failure = f.reason;
                    last_source = f.source;
                }
            }
            tracing::debug!(attempt, %path, "rendezvous request failed: {last_failure}");
        }
        Err(RendezvousError::Request {
            method,
            path,
            reason: format!("{attempts} attempts failed; last: {last_failure}"),
            source: last_source.map(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>),
        })
    }

    fn connect(&self) -> io::Result<TcpStream> {
        let mut last = io::Error::new(io::ErrorKind::NotFound, "the address resolves to nothing");
        for addr in self.config.addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, self.config.request_timeout) {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    return Ok(stream);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn send_once(&mut self, method: &str, path: &str, body: &[u8]) -> Result<Response, Failure> {
        let reused = self.conn.is_some();
        if !reused {
            let stream = self.connect().map_err(|e| Failure {
                reason: format!("connect to {}: {e}", self.config.addr),
                stale: false,
                source: Some(e),
            })?;
            self.conn = Some(BufReader::new(stream));
        }
        let conn = self.conn.as_mut().expect("connected above");
        let limit = Some(self.config.request_timeout.max(Duration::from_millis(1)));
        let timeouts = conn.get_ref().set_read_timeout(limit).and_then(|()| conn.get_ref().set_write_timeout(limit));
        if let Err(e) = timeouts {
            return Err(Failure { reason: e.to_string(), stale: false, source: Some(e) });
        }
        let mut head =
            format!("{method} {path} HTTP/1.1\r\nhost: {}\r\ncontent-length: {}\r\n", self.config.addr, body.len());
        if let Some(secret) = &self.config.secret {
            head.push_str(&format!("{SECRET_HEADER}: {secret}\r\n"));
        }
        head.push_str("\r\n");
        self.requests += 1;
        let mut got_any = false;
        let result = (|| -> io::Result<Response> {
            let stream = conn.get_mut();
            stream.write_all(head.as_bytes())?;
            stream.write_all(body)?;
            read_response(conn, method == "HEAD", self.max_response, &mut got_any)
        })();
        match result {
            Ok(r) => {
                if r.close {
                    self.conn = None;
                }
                Ok(r)
            }
            Err(e) => {
                self.conn = None;
                let timed_out = matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut);
                let reason = if timed_out {
                    format!("no answer within {:?}", self.config.request_timeout)
                } else {
                    e.to_string()
                };
                Err(Failure { reason, stale: reused && !got_any && !timed_out, source: Some(e) })
            }
        }
    }
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Reads one response: status line, headers, and a body of
/// `content-length` bytes (or up to EOF without one), within bounds.
fn read_response(
    conn: &mut BufReader<TcpStream>,
    head_only: bool,
    max_body: usize,
    got_any: &mut bool,
) -> io::Result<Response> {
    let mut head_bytes = 0;
    let mut line = Vec::new();
    let mut next_line = |conn: &mut BufReader<TcpStream>, line: &mut Vec<u8>| -> io::Result<()> {
        line.clear();
        let room = (MAX_HEAD_BYTES - head_bytes) as u64;
        let n = conn.by_ref().take(room).read_until(b'\n', line)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the server closed the connection"));
        }
        *got_any = true;
        head_bytes += n;
        if !line.ends_with(b"\n") {
            return Err(bad(format!("response head over {MAX_HEAD_BYTES} bytes, or cut short")));
        }
        while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            line.pop();
        }
        Ok(())
    };
    next_line(conn, &mut line)?;
    let status_line = String::from_utf8_lossy(&line).into_owned();
    let mut parts = status_line.splitn(3, ' ');
    let (version, status) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let status: u16 = match (version.starts_with("HTTP/1."), status.parse()) {
        (true, Ok(s)) => s,
        _ => return Err(bad(format!("not an HTTP response: {status_line:?}"))),
    };
    let mut close = version == "HTTP/1.0";
    let mut length: Option<usize> = None;
    loop {
        next_line(conn, &mut line)?;
        if line.is_empty() {
            break;
        }
        let header = String::from_utf8_lossy(&line);
        let Some((name, value)) = header.split_once(':') else { return Err(bad(format!("bad header {header:?}"))) };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        match name.as_str() {
            "content-length" => {
                length = Some(value.parse().map_err(|_| bad(format!("bad content-length {value:?}")))?);
            }
            "connection" => close = value.eq_ignore_ascii_case("close"),
            "transfer-encoding" if !value.eq_ignore_ascii_case("identity") => {
                return Err(bad(format!("unsupported transfer-encoding {value:?}")));
            }
            _ => {}
        }
    }
    let no_body = head_only || status == 204 || status == 304 || (100..200).contains(&status);
    let body = match length {
        _ if no_body => Vec::new(),
        Some(n) if n > max_body => return Err(bad(format!("response of {n} bytes is over the limit of {max_body}"))),
        Some(n) => {
            let mut body = vec![0u8; n];
            conn.read_exact(&mut body)?;
            body
        }
        None => {
            close = true;
            let mut body = Vec::new();
            conn.by_ref().take(max_body as u64 + 1).read_to_end(&mut body)?;
            if body.len() > max_body {
                return Err(bad(format!("response over the limit of {max_body} bytes")));
            }
            body
        }
    };
    Ok(Response { status, body, close })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A scripted HTTP server: `respond(request number, request head)` gives
    /// the raw reply and whether to close the connection after it.
    fn fake_server(
        respond: impl Fn(usize, &str) -> (String, bool) + Send + 'static,
    ) -> (String, Arc<AtomicUsize>, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let count = Arc::new(AtomicUsize::new(0));
        let seen = count.clone();
        let handle = std::thread::spawn(move || {
            listener.set_nonblocking(true).unwrap();
            let idle = Instant::now();
            // serve until no connection came for a while
            while idle.elapsed() < Duration::from_secs(5) {
                let Ok((stream, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                stream.set_nonblocking(false).unwrap();
                stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut reader = BufReader::new(stream);
                loop {
                    let mut head = String::new();
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            break;
                        }
                        head.push_str(&line);
                        if line == "\r\n" {
                            break;
                        }
                    }
                    if head.is_empty() {
                        break;
                    }
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    let mut body = vec![0u8; length];
                    reader.read_exact(&mut body).unwrap();
                    let n = seen.fetch_add(1, Ordering::SeqCst);
                    if head.contains("/quit/") {
                        return;
                    }
                    let (reply, close) = respond(n, &head);
                    reader.get_mut().write_all(reply.as_bytes()).unwrap();
                    if close {
                        break;
                    }
                }
            }
        });
        (addr, count, handle)
    }

    fn quit(addr: &str) {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /quit/now HTTP/1.1\r\n\r\n").unwrap();
    }

    fn fast(addr: &str) -> ClientConfig {
        let mut c = ClientConfig::new(addr);
        c.retry_delay = Duration::from_millis(10);
        c.request_timeout = Duration::from_secs(2);
        c
    }

    fn ok(body: &str) -> String {
        format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len())
    }

    #[test]
    fn a_connection_the_server_closed_is_redialled_without_costing_an_attempt() {
        // closes after every response without saying so, like an idle timeout
        let (addr, count, server) = fake_server(|_, _| (ok("v"), true));
        let mut config = fast(&addr);
        config.attempts = 1;
        let mut client = BlockingClient::new(config);
        for _ in 0..3 {
            assert_eq!(client.get("s", "k").unwrap().as_deref(), Some(&b"v"[..]));
        }
        quit(&addr);
        server.join().unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn server_errors_are_retried_and_client_errors_are_not() {
        let (addr, count, server) = fake_server(|n, head| {
            if head.contains("/bad/") {
                return ("HTTP/1.1 400 Bad Request\r\ncontent-length: 4\r\n\r\nnope".into(), false);
            }
            if n < 2 {
                return ("HTTP/1.1 503 Busy\r\ncontent-length: 4\r\n\r\nbusy".into(), false);
            }
            (ok("fine"), false)
        });
        let mut client = BlockingClient::new(fast(&addr));
        assert_eq!(client.get("s", "k").unwrap().as_deref(), Some(&b"fine"[..]));
        assert_eq!(count.load(Ordering::SeqCst), 3);
        let e = client.put("bad", "k", b"x").unwrap_err();
        assert!(matches!(e, RendezvousError::Status { status: 400, .. }), "{e}");
        assert_eq!(count.load(Ordering::SeqCst), 4);
        quit(&addr);
        server.join().unwrap();
    }

    #[test]
    fn three_failures_give_up_naming_the_last() {
        let (addr, count, server) =
            fake_server(|_, _| ("HTTP/1.1 500 Oops\r\ncontent-length: 4\r\n\r\noops".into(), false));
        let mut client = BlockingClient::new(fast(&addr));
        let e = client.get("s", "k").unwrap_err().to_string();
        assert!(e.contains("3 attempts failed") && e.contains("oops"), "{e}");
        assert_eq!(count.load(Ordering::SeqCst), 3);
        quit(&addr);
        server.join().unwrap();
    }

    #[test]
    fn responses_are_bounded() {
        let (addr, _, server) = fake_server(|_, _| (ok(&"x".repeat(1000)), false));
        let mut config = fast(&addr);
        config.attempts = 1;
        let mut client = BlockingClient::new(config).with_max_response(100);
        let e = client.get("s", "k").unwrap_err().to_string();
        assert!(e.contains("over the limit"), "{e}");
        quit(&addr);
        server.join().unwrap();
    }

    #[test]
    fn a_silent_server_times_out() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut config = fast(&listener.local_addr().unwrap().to_string());
        config.attempts = 1;
        config.request_timeout = Duration::from_millis(100);
        let start = Instant::now();
        let e = BlockingClient::new(config).get("s", "k").unwrap_err().to_string();
        assert!(e.contains("no answer within"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(2));
    }
}
