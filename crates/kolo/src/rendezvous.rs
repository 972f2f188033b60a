//! `kolo rendezvous`: the rendezvous store on its own.

use anyhow::{bail, Result};
use kolo_rendezvous::{RendezvousServer, ServerConfig};
use kolo_topology::env_names::SECRET;
use kolo_topology::{host_assignments, parse_host_list, total_slots};

use crate::cli::RendezvousArgs;
use crate::out::say;
use crate::run::stop_signal;

pub(crate) async fn rendezvous(args: RendezvousArgs) -> Result<i32> {
    let plan = match &args.plan {
        Some(list) => {
            let hosts = parse_host_list(list)?;
            let np = args.np.unwrap_or_else(|| total_slots(&hosts));
            host_assignments(&hosts, np, Some(np))?
        }
        None => Vec::new(),
    };
    let mut config = ServerConfig::new(std::net::SocketAddr::new(args.bind, args.port));
    config.max_body_bytes = args.max_body_bytes;
    config.max_store_bytes = args.max_store_bytes;
    config.max_keys = args.max_keys;
    config.max_connections = args.max_connections;
    config.secret = std::env::var(SECRET).ok().filter(|s| !s.is_empty());
    if args.require_secret && config.secret.is_none() {
        bail!("--require-secret needs the secret in ${SECRET}");
    }
    config.require_secret = args.require_secret;
    let stop = stop_signal();
    let server = RendezvousServer::start(config, &plan).await?;
    say(&server.addr().to_string())?;
    let signal = stop.await;
    tracing::debug!("rendezvous server stopping on {}", signal.as_str());
    server.stop().await;
    Ok(0)
}
