//! kolo-rendezvous: the job's key-value store, speaking Horovod's HTTP
//! rendezvous protocol so that Gloo (through Horovod's C++ client) and
//! kolo's own clients rendezvous on it alike.
//!
//! Paths are `/<scope>/<key>`; `PUT` stores, `GET` answers 200 or 404,
//! `DELETE /<scope>/<rank>` marks a rank finished with a scope. Scopes
//! sized by the job's plan (`global`, `local_<host>`, `cross_<local_rank>`)
//! are cleared once all their ranks finished (each rank counted once, so a
//! retried DELETE is harmless); other scopes lose the key.
//!
//! The server bounds what a client can make it hold (see [`ServerConfig`]):
//! 414 for a long path, 413 for a large value, 507 when the store is full,
//! 408 for a slow body, 503 past the connection cap.

#![forbid(unsafe_code)]

//!
//! [`TorchStoreServer`] serves the same job's store to PyTorch, in the
//! wire protocol of c10d's `TCPStore`.
//!
//! Features: `server` (the server, on tokio and hyper) and `async-client`
//! (the async [`Client`], likewise), both default. Without them the crate
//! is the [`BlockingClient`] over `std::net` alone, for workers that must
//! not pull an async runtime (kolo-comm).

pub mod blocking;
#[cfg(feature = "async-client")]
mod client;
mod config;
pub mod elastic;
#[cfg(feature = "server")]
mod gate;
#[cfg(feature = "server")]
mod server;
#[cfg(feature = "server")]
mod torch_store;

pub use blocking::BlockingClient;
#[cfg(feature = "async-client")]
pub use client::Client;
pub use config::ClientConfig;
#[cfg(feature = "server")]
pub use gate::{GateAnswer, PeerGate};
#[cfg(feature = "server")]
pub use server::{AcceptFailures, RendezvousServer, ServerConfig, SECRET_HEADER};
#[cfg(feature = "server")]
pub use torch_store::{TorchStoreConfig, TorchStoreServer};

/// The header that carries the job secret (the server's, without the server).
#[cfg(not(feature = "server"))]
pub const SECRET_HEADER: &str = "x-kolo-secret";

/// Errors of the rendezvous server and client.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: std::net::SocketAddr, source: std::io::Error },
    #[error("rendezvous server {addr} unreachable: {source}")]
    Connect { addr: String, source: std::io::Error },
    /// `reason` says what the last attempt met; `source` is that attempt's
    /// underlying error, where there was one (not for a timeout or a 5xx).
    #[error("rendezvous request {method} {path} failed: {reason}")]
    Request {
        method: &'static str,
        path: String,
        reason: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    #[error("rendezvous request {method} {path} answered {status}: {body}")]
    Status { method: &'static str, path: String, status: u16, body: String },
    #[error("timed out after {waited_s:.1} s waiting for keys {missing:?} in scope '{scope}' at {addr}")]
    WaitTimeout { addr: String, scope: String, missing: Vec<String>, waited_s: f64 },
    #[error("invalid rendezvous URL '{0}': expected http://HOST:PORT")]
    BadUrl(String),
}
