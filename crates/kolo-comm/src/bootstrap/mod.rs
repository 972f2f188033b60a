//! Bringing a communicator up: the ranks swap addresses (`exchange`),
//! then each pair makes its link (`links`), then the world's barrier and
//! the hierarchy; `config` is what a rank needs to join.

mod config;
mod exchange;
mod links;

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use config::Book;
pub use config::{AddressBook, Config, Transport};
pub(crate) use exchange::store_client;

use crate::comm::{Communicator, Links, Shared, Tuning};
use crate::interrupt::check_interrupt;
use crate::CommError;
use exchange::exchange_addresses;
use links::{bind_unix, unix_name, Kind, Setup};

impl Communicator {
    /// Joins the job's communicator from the environment `kolo run` sets
    /// ([`Config::from_env`]). Blocking; no async runtime involved, so it
    /// may be called from any thread.
    pub fn from_env() -> Result<Communicator, CommError> {
        Communicator::connect(Config::from_env()?)
    }

    /// Joins with explicit settings. Collective: every rank calls it.
    pub fn connect(config: Config) -> Result<Communicator, CommError> {
        let deadline = Instant::now() + config.timeout;
        let listener = TcpListener::bind((config.listen, 0))
            .map_err(|source| CommError::BootstrapIo { what: format!("cannot listen on {}", config.listen), source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| CommError::BootstrapIo { what: "no listening address".into(), source })?;
        let unix = if config.transport == Transport::Auto {
            let name = unix_name();
            let l = bind_unix(&name).map_err(|source| CommError::BootstrapIo {
                what: "cannot listen on an abstract unix socket".into(),
                source,
            })?;
            Some((name, l))
        } else {
            None
        };
        let unix_name = unix.as_ref().map_or("-", |(n, _)| n.as_str());
        let peers = exchange_addresses(&config, &addr, unix_name, deadline)?;
        let n = config.size;
        let my_node = peers[config.rank].node;
        let local = |p: usize| {
            p != config.rank && peers[p].node == my_node && config.transport == Transport::Auto && peers[p].unix != "-"
        };
        let local_count = (0..n).filter(|&p| local(p)).count();
        // rings shrink as ranks per host grow, so their memory stays bounded
        let capacity = (64usize << 20)
            .checked_div(local_count)
            .map_or(0, |c| c.clamp(256 << 10, config.tuning.ring_bytes.max(256 << 10)) & !7);
        let mut setup = Setup {
            config: &config,
            deadline,
            capacity,
            links: Links {
                tx: (0..n).map(|_| None).collect(),
                rx: (0..n).map(|_| None).collect(),
                scratch: Vec::new(),
            },
        };

        // the lower rank dials, the higher one listens
        for (p, peer) in peers.iter().enumerate().skip(config.rank + 1) {
            setup.dial(p, peer, if local(p) { Kind::Unix } else { Kind::Tcp })?;
        }
        let mut missing: Vec<usize> = (0..config.rank).collect();
        let mut last_check = Instant::now();
        listener.set_nonblocking(true).map_err(|source| CommError::BootstrapIo { what: "listener".into(), source })?;
        if let Some((_, l)) = &unix {
            l.set_nonblocking(true)
                .map_err(|source| CommError::BootstrapIo { what: "unix listener".into(), source })?;
        }
        while !missing.is_empty() {
            let mut accepted = false;
            match listener.accept() {
                Ok((mut stream, _)) => {
                    accepted = true;
                    let _ = stream.set_nonblocking(false);
                    let remote: Vec<usize> = missing.iter().copied().filter(|&m| !local(m)).collect();
                    if let Some(peer) = setup.accept(&mut stream, Kind::Tcp, &remote) {
                        setup.tcp_link(peer, stream)?;
                        missing.retain(|&m| m != peer);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(source) => return Err(CommError::BootstrapIo { what: "accept failed".into(), source }),
            }
            if let Some((_, l)) = &unix {
                match l.accept() {
                    Ok((mut stream, _)) => {
                        accepted = true;
                        let _ = stream.set_nonblocking(false);
                        let same_host: Vec<usize> = missing.iter().copied().filter(|&m| local(m)).collect();
                        if let Some(peer) = setup.accept(&mut stream, Kind::Unix, &same_host) {
                            setup.unix_link(peer, stream)?;
                            missing.retain(|&m| m != peer);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(source) => return Err(CommError::BootstrapIo { what: "accept failed".into(), source }),
                }
            }
            if !accepted {
                if last_check.elapsed() > Duration::from_millis(50) {
                    last_check = Instant::now();
                    check_interrupt(&config.interrupt)?;
                }
                if Instant::now() >= deadline {
                    return Err(CommError::Bootstrap(format!(
                        "ranks {missing:?} did not connect within {:.1} s",
                        config.timeout.as_secs_f64()
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        drop(unix);
        drop(listener);

        let nodes: Vec<usize> = peers.iter().map(|p| p.node).collect();
        let local_pids: Vec<u32> = (0..n).map(|p| if peers[p].node == my_node { peers[p].pid } else { 0 }).collect();
        const WORLD: u64 = 1;
        let shared = Arc::new(Shared {
            me: config.rank,
            links: Mutex::new(setup.links),
            local_pids,
            timeout: config.timeout,
            tuning: Tuning {
                // TCP even within a host means no shortcut through peers' memory either
                direct_bytes: config.tuning.direct_bytes.filter(|_| config.transport == Transport::Auto),
                ..config.tuning.clone()
            },
            interrupt: config.interrupt.clone(),
            names: Mutex::new(HashMap::from([(WORLD, "world".to_string())])),
        });
        let mut comm = Communicator::new(shared, WORLD, (0..n).collect(), config.rank, nodes);
        comm.barrier()?;
        comm.build_hierarchy()?;
        tracing::debug!(rank = comm.shared.me, size = n, local = local_count, "communicator up");
        Ok(comm)
    }
}
