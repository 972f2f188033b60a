//! Settings shared by the async and the blocking client.

use std::time::Duration;

use crate::RendezvousError;

/// Where a client finds the server, with what secret, and how patiently
/// it retries and polls.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// `host:port` of the server.
    pub addr: String,
    /// The job's secret, sent with every request in [`SECRET_HEADER`](crate::SECRET_HEADER);
    /// `None` sends none.
    pub secret: Option<String>,
    /// Attempts per request (Horovod's client: 3).
    pub attempts: u32,
    /// Pause between attempts (Horovod's client: 500 ms).
    pub retry_delay: Duration,
    /// Pause between polls of a missing key (Gloo: 10 ms).
    pub poll_interval: Duration,
    /// Limit on one request, connection included.
    pub request_timeout: Duration,
}

impl ClientConfig {
    /// A client of the server at `addr` (`host:port`), with no secret and
    /// Horovod's client's retries.
    pub fn new(addr: impl Into<String>) -> Self {
        ClientConfig {
            addr: addr.into(),
            secret: None,
            attempts: 3,
            retry_delay: Duration::from_millis(500),
            poll_interval: Duration::from_millis(10),
            request_timeout: Duration::from_secs(30),
        }
    }

    /// From `http://HOST:PORT` (a trailing `/` is allowed).
    pub fn from_url(url: &str) -> Result<Self, RendezvousError> {
        let rest = url.strip_prefix("http://").ok_or_else(|| RendezvousError::BadUrl(url.into()))?;
        let addr = rest.trim_end_matches('/');
        let valid = addr.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        if !valid || addr.contains('/') {
            return Err(RendezvousError::BadUrl(url.into()));
        }
        Ok(ClientConfig::new(addr))
    }
}
