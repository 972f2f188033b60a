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

//!
//! [`TorchStoreServer`] serves the same job's store to PyTorch, in the
//! wire protocol of c10d's `TCPStore`.
//!
//! Features: `server` (the server, on tokio and hyper) and `async-client`
//! (the async [`Client`], likewise), both default. Without them the crate
//! is the [`BlockingClient`] over `std::net` alone, for workers that must
//! not pull an async runtime (kolo-comm).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

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
    /// The server could not bind its listening socket.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address it tried to listen on.
        addr: std::net::SocketAddr,
        /// The error from creating, binding or listening on the socket.
        source: std::io::Error,
    },
    /// The server could not be reached.
    #[error("rendezvous server {addr} unreachable: {source}")]
    Connect {
        /// `host:port` of the server.
        addr: String,
        /// The connection's error.
        source: std::io::Error,
    },
    /// A request failed on every attempt (no connection, a timeout, a 5xx).
    /// `reason` says what the last attempt met; `source` is that attempt's
    /// underlying error, where there was one (not for a timeout or a 5xx).
    #[error("rendezvous request {method} {path} failed: {reason}")]
    Request {
        /// The HTTP method (`GET`, `PUT`, `DELETE`).
        method: &'static str,
        /// The request's path, `/<scope>/<key>`.
        path: String,
        /// How many attempts failed, and what the last one met.
        reason: String,
        /// The last attempt's underlying error, if any.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The server refused a request with a 4xx status other than 404,
    /// which retrying would not change.
    #[error("rendezvous request {method} {path} answered {status}: {body}")]
    Status {
        /// The HTTP method.
        method: &'static str,
        /// The request's path, `/<scope>/<key>`.
        path: String,
        /// The HTTP status code.
        status: u16,
        /// The answer's body, trimmed: the server's explanation.
        body: String,
    },
    /// Waiting for keys took longer than the caller allowed.
    #[error("timed out after {waited_s:.1} s waiting for keys {missing:?} in scope '{scope}' at {addr}")]
    WaitTimeout {
        /// `host:port` of the server.
        addr: String,
        /// The scope the keys were awaited in.
        scope: String,
        /// The keys still missing when the wait ended.
        missing: Vec<String>,
        /// How long the wait lasted, in seconds.
        waited_s: f64,
    },
    /// A URL that is not `http://HOST:PORT`.
    #[error("invalid rendezvous URL '{0}': expected http://HOST:PORT")]
    BadUrl(String),
}
