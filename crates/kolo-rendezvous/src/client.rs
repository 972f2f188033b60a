//! Async client for the rendezvous store: one keep-alive connection,
//! re-dialled when the server closes it, retries on transport errors and
//! server errors, and `wait` that polls 404s like Gloo's store does.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::Mutex;

use crate::{ClientConfig, RendezvousError, SECRET_HEADER};

/// An async client of the rendezvous store: one connection, reused, that
/// concurrent requests take turns on.
pub struct Client {
    config: ClientConfig,
    conn: Mutex<Option<SendRequest<Full<Bytes>>>>,
    requests: AtomicU64,
}

impl Client {
    /// A client for `config`; it connects on its first request.
    pub fn new(config: ClientConfig) -> Self {
        Client { config, conn: Mutex::new(None), requests: AtomicU64::new(0) }
    }

    /// Requests sent so far, retries included.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Stores `value` under `key` in `scope`, replacing any earlier value.
    pub async fn put(&self, scope: &str, key: &str, value: impl Into<Bytes>) -> Result<(), RendezvousError> {
        self.request(Method::PUT, scope, key, value.into()).await.map(drop)
    }

    /// The value, or `None` when the key is absent.
    pub async fn get(&self, scope: &str, key: &str) -> Result<Option<Bytes>, RendezvousError> {
        self.request(Method::GET, scope, key, Bytes::new()).await
    }

    /// Marks `key` (a rank) finished with `scope`.
    pub async fn delete(&self, scope: &str, key: &str) -> Result<(), RendezvousError> {
        self.request(Method::DELETE, scope, key, Bytes::new()).await.map(drop)
    }

    /// Waits until every key is present, polling a missing one every
    /// `poll_interval`, and returns the values in the order asked.
    pub async fn wait(&self, scope: &str, keys: &[&str], timeout: Duration) -> Result<Vec<Bytes>, RendezvousError> {
        let start = Instant::now();
        let mut values = Vec::with_capacity(keys.len());
        for key in keys {
            loop {
                if let Some(value) = self.get(scope, key).await? {
                    values.push(value);
                    break;
                }
                if start.elapsed() >= timeout {
                    let missing = keys[values.len()..].iter().map(|k| k.to_string()).collect();
                    return Err(RendezvousError::WaitTimeout {
                        addr: self.config.addr.clone(),
                        scope: scope.into(),
                        missing,
                        waited_s: start.elapsed().as_secs_f64(),
                    });
                }
                tokio::time::sleep(self.config.poll_interval).await;
            }
        }
        Ok(values)
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, std::io::Error> {
        let stream = TcpStream::connect(&self.config.addr).await?;
        stream.set_nodelay(true)?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream)).await.map_err(std::io::Error::other)?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }

    async fn request(
        &self,
        method: Method,
        scope: &str,
        key: &str,
        body: Bytes,
    ) -> Result<Option<Bytes>, RendezvousError> {
        let path = format!("/{scope}/{key}");
        let method_name = static_name(&method);
        let mut last_failure = Failure::from(String::new());
        for attempt in 0..self.config.attempts.max(1) {
            if attempt > 0 {
                tokio::time::sleep(self.config.retry_delay).await;
            }
            let outcome =
                tokio::time::timeout(self.config.request_timeout, self.send_once(method.clone(), &path, body.clone()))
                    .await
                    .unwrap_or_else(|_| Err(format!("no answer within {:?}", self.config.request_timeout).into()));
            match outcome {
                Ok((StatusCode::OK, bytes)) => return Ok(Some(bytes)),
                Ok((StatusCode::NOT_FOUND, _)) => return Ok(None),
                Ok((status, bytes)) if status.is_client_error() => {
                    return Err(RendezvousError::Status {
                        method: method_name,
                        path,
                        status: status.as_u16(),
                        body: String::from_utf8_lossy(&bytes).trim().to_string(),
                    });
                }
                Ok((status, bytes)) => {
                    last_failure = format!("status {status}: {}", String::from_utf8_lossy(&bytes).trim()).into();
                }
                Err(reason) => {
                    *self.conn.lock().await = None;
                    last_failure = reason;
                }
            }
            tracing::debug!(attempt, %path, "rendezvous request failed: {}", last_failure.what);
        }
        Err(RendezvousError::Request {
            method: method_name,
            path,
            reason: format!("{} attempts failed; last: {}", self.config.attempts.max(1), last_failure.what),
            source: last_failure.source,
        })
    }

    async fn send_once(&self, method: Method, path: &str, body: Bytes) -> Result<(StatusCode, Bytes), Failure> {
        let mut guard = self.conn.lock().await;
        // a server that closed the kept-alive connection (or speaks HTTP/1.0)
        // costs a re-dial, not an attempt
        let usable = match guard.as_mut() {
            Some(sender) => sender.ready().await.is_ok(),
            None => false,
        };
        if !usable {
            let connected = self.connect().await;
            *guard = Some(connected.map_err(|e| Failure::new(format!("connect to {}", self.config.addr), e))?);
        }
        let sender = guard.as_mut().expect("connection set above");
        let mut builder = Request::builder().method(method).uri(path).header("host", &self.config.addr);
        if let Some(secret) = &self.config.secret {
            builder = builder.header(SECRET_HEADER, secret);
        }
        let request = builder.body(Full::new(body)).map_err(|e| Failure::new("building the request", e))?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        let response = sender.send_request(request).await.map_err(|e| Failure::new("sending", e))?;
        let status = response.status();
        let bytes = response.into_body().collect().await.map_err(|e| Failure::new("reading the answer", e))?.to_bytes();
        Ok((status, bytes))
    }
}

/// Why one attempt failed, keeping the underlying error where there is one.
struct Failure {
    what: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl Failure {
    fn new(doing: impl std::fmt::Display, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Failure { what: format!("{doing}: {e}"), source: Some(Box::new(e)) }
    }
}

impl From<String> for Failure {
    fn from(what: String) -> Self {
        Failure { what, source: None }
    }
}

fn static_name(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        _ => "request",
    }
}
