//! Who may use a job's stores. Their protocols carry no secret (Gloo's
//! HTTP client, torch's TCPStore client), so the driver answers for them:
//! a connection from this machine must be a socket of the driver's user
//! (the kernel's socket tables say whose it is); one from another host
//! must come from a host of the job, and that host's agent, which runs as
//! the job's user there, must find it is its user's. Anything else is
//! closed before a byte of it is read.
//!
//! A job may span several executors (an elastic job's cohorts meet on the
//! first one's store): they share the job's secret, and with it the list
//! of agents the gate asks.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, Weak};

use kolo_rendezvous::PeerGate;

use super::link::Link;

/// Every live job's agents in this process, by job secret.
static JOBS: Mutex<Vec<(String, Vec<Weak<Link>>)>> = Mutex::new(Vec::new());

/// Adds a job's agents; dead entries (executors gone) are dropped meanwhile.
pub(super) fn register(secret: &str, links: &[Arc<Link>]) {
    let mut jobs = kolo_sys::lock(&JOBS);
    for (_, agents) in jobs.iter_mut() {
        agents.retain(|a| a.strong_count() > 0);
    }
    jobs.retain(|(_, agents)| !agents.is_empty());
    let added = links.iter().map(Arc::downgrade);
    match jobs.iter_mut().find(|(s, _)| s == secret) {
        Some((_, agents)) => agents.extend(added),
        None => jobs.push((secret.to_string(), added.collect())),
    }
}

/// A live agent of the job whose control connection came from `host`.
fn agent_on(secret: &str, host: IpAddr) -> Option<Arc<Link>> {
    let jobs = kolo_sys::lock(&JOBS);
    let (_, agents) = jobs.iter().find(|(s, _)| s == secret)?;
    agents.iter().filter_map(Weak::upgrade).find(|l| l.host_addr == Some(host) && l.lost_reason().is_none())
}

/// The gate of the stores of the job with this secret.
pub(super) fn gate(secret: &str) -> PeerGate {
    let secret = secret.to_string();
    PeerGate::new(move |peer, server| {
        let secret = secret.clone();
        Box::pin(async move {
            let host = peer.ip().to_canonical();
            if kolo_engine::is_own_address(host) {
                let client = SocketAddr::new(host, peer.port());
                let check = move || kolo_sys::sockets::owned_by_this_user(client, server, "the driver's machine");
                return tokio::task::spawn_blocking(check).await.map_err(|e| e.to_string())?;
            }
            let Some(agent) = agent_on(&secret, host) else { return Err("not a host of the job".into()) };
            agent.ask_owner(SocketAddr::new(host, peer.port()), server).await
        })
    })
}
