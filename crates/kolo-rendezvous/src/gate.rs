//! Who may connect to a server whose protocol has no secret (Gloo's HTTP
//! client and torch's TCPStore client cannot present one): the server
//! asks its [`PeerGate`] about each connection before it reads a byte of
//! it, and closes the connection unless the gate admits it. The job's
//! driver knows what the protocols do not (the job's user, its hosts, an
//! agent on each host), so the answer is its to give.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What a gate answers: admitted, or why not.
pub type GateAnswer = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// Decides on a connection from `peer` to the server's `local` address.
#[derive(Clone)]
pub struct PeerGate {
    decide: Arc<dyn Fn(SocketAddr, SocketAddr) -> GateAnswer + Send + Sync>,
    /// How long a decision may take; past it the connection is refused.
    pub timeout: Duration,
    refused: Arc<AtomicU64>,
}

impl PeerGate {
    /// A gate that asks `decide(peer, local)` about each connection and
    /// waits up to 10 s for its answer.
    pub fn new(decide: impl Fn(SocketAddr, SocketAddr) -> GateAnswer + Send + Sync + 'static) -> Self {
        PeerGate { decide: Arc::new(decide), timeout: Duration::from_secs(10), refused: Arc::default() }
    }

    /// Whether the connection may go on; a refusal is logged (the first
    /// few, then at powers of two) under the server's `name`.
    pub async fn admits(&self, name: &str, peer: SocketAddr, local: SocketAddr) -> bool {
        let why = match tokio::time::timeout(self.timeout, (self.decide)(peer, local)).await {
            Ok(Ok(())) => return true,
            Ok(Err(why)) => why,
            Err(_) => format!("no answer on who it is within {:?}", self.timeout),
        };
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if n <= 5 || n.is_power_of_two() {
            tracing::warn!("{name}: refused {peer}: {why} ({n} refused so far)");
        }
        false
    }
}

impl std::fmt::Debug for PeerGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerGate").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}
