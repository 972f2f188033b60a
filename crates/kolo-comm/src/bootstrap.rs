//! Bringing a communicator up from the job's environment: addresses
//! through the rendezvous store (linear traffic), then a link per peer:
//! shared-memory rings within a host, authenticated TCP between hosts.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use kolo_rendezvous::{Client, ClientConfig};
use sha2::Sha256;

use crate::comm::{Communicator, Shared, Tuning};
use crate::link::{Rx, TcpRx, Tx};
use crate::shm::Ring;
use crate::CommError;

/// How ranks on the same host talk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// Shared memory within a host, TCP between hosts.
    Auto,
    /// TCP everywhere (`KOLO_COMM_TRANSPORT=tcp`), e.g. to test the TCP path on one host.
    Tcp,
}

/// Everything a rank needs to join.
#[derive(Clone, Debug)]
pub struct Config {
    pub rank: usize,
    pub size: usize,
    /// Ranks with the same node id share a host.
    pub node_id: String,
    /// `host:port` of the rendezvous store.
    pub store: String,
    pub secret: Option<String>,
    pub job_id: String,
    pub timeout: Duration,
    pub transport: Transport,
    /// Address this rank listens on for TCP links.
    pub listen: IpAddr,
    pub tuning: Tuning,
}

fn var(name: &str) -> Result<String, CommError> {
    std::env::var(name).map_err(|_| CommError::Env(format!("{name} is not set; start the job with kolo run")))
}

fn number<T: std::str::FromStr>(name: &str) -> Result<T, CommError> {
    let v = var(name)?;
    v.parse().map_err(|_| CommError::Env(format!("{name}='{v}' is not a number")))
}

impl Config {
    /// From the variables `kolo run` sets (`KOLO_RANK`, `KOLO_SIZE`,
    /// `KOLO_NODE_ID`, `KOLO_RENDEZVOUS_ADDR`/`_PORT`, `KOLO_SECRET`,
    /// `KOLO_JOB_ID`, `KOLO_TIMEOUT_SECONDS`, `KOLO_IFACES`), plus
    /// `KOLO_COMM_TRANSPORT` (`auto` or `tcp`) and `KOLO_COMM_TIMEOUT_SECONDS`.
    pub fn from_env() -> Result<Config, CommError> {
        let rank: usize = number("KOLO_RANK")?;
        let size: usize = number("KOLO_SIZE")?;
        if rank >= size {
            return Err(CommError::Env(format!("KOLO_RANK {rank} is not below KOLO_SIZE {size}")));
        }
        let transport = match std::env::var("KOLO_COMM_TRANSPORT").as_deref() {
            Err(_) | Ok("auto") | Ok("") => Transport::Auto,
            Ok("tcp") => Transport::Tcp,
            Ok(other) => return Err(CommError::Env(format!("KOLO_COMM_TRANSPORT='{other}': use auto or tcp"))),
        };
        let timeout_s: f64 = match std::env::var("KOLO_COMM_TIMEOUT_SECONDS") {
            Ok(_) => number("KOLO_COMM_TIMEOUT_SECONDS")?,
            Err(_) => number::<u64>("KOLO_TIMEOUT_SECONDS").unwrap_or(30) as f64,
        };
        let iface = std::env::var("KOLO_IFACES").ok().and_then(|l| l.split(',').next().map(String::from));
        Ok(Config {
            rank,
            size,
            node_id: var("KOLO_NODE_ID")?,
            store: format!("{}:{}", var("KOLO_RENDEZVOUS_ADDR")?, var("KOLO_RENDEZVOUS_PORT")?),
            secret: std::env::var("KOLO_SECRET").ok(),
            job_id: std::env::var("KOLO_JOB_ID").unwrap_or_else(|_| "job".into()),
            timeout: Duration::from_secs_f64(timeout_s.max(0.001)),
            transport,
            listen: listen_address(iface.as_deref())?,
            tuning: Tuning::from_env()?,
        })
    }
}

/// The IPv4 address of the interface kolo chose (loopback for `lo`).
fn listen_address(iface: Option<&str>) -> Result<IpAddr, CommError> {
    let Some(iface) = iface.filter(|i| *i != "lo") else { return Ok(IpAddr::from([127, 0, 0, 1])) };
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| CommError::Env(format!("cannot list interfaces: {e}")))?;
    for a in addrs.filter(|a| a.interface_name == iface) {
        if let Some(v4) = a.address.as_ref().and_then(|s| s.as_sockaddr_in()) {
            return Ok(IpAddr::V4(v4.ip()));
        }
    }
    Err(CommError::Env(format!("interface '{iface}' (KOLO_IFACES) has no IPv4 address on this host")))
}

struct Peer {
    node: usize,
    addr: SocketAddr,
    pid: u32,
}

fn tag(secret: &[u8], job: &str, a: usize, b: usize) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("any key length");
    mac.update(b"kolo-comm");
    mac.update(job.as_bytes());
    mac.update(&(a as u64).to_be_bytes());
    mac.update(&(b as u64).to_be_bytes());
    mac.finalize().into_bytes().into()
}

const MAGIC: u32 = 0x6b63_6f6d; // "kcom"

impl Communicator {
    /// Joins the job's communicator from the environment `kolo run` sets.
    pub fn from_env() -> Result<Communicator, CommError> {
        Communicator::connect(Config::from_env()?)
    }

    /// Joins with explicit settings. Collective: every rank calls it.
    pub fn connect(config: Config) -> Result<Communicator, CommError> {
        let deadline = Instant::now() + config.timeout;
        let listener = TcpListener::bind((config.listen, 0))
            .map_err(|e| CommError::Bootstrap(format!("cannot listen on {}: {e}", config.listen)))?;
        let me = Peer {
            node: 0,
            addr: listener.local_addr().map_err(|e| CommError::Bootstrap(e.to_string()))?,
            pid: std::process::id(),
        };
        let peers = exchange_addresses(&config, &me.addr, deadline)?;
        let n = config.size;
        let mut tx: Vec<Mutex<Option<Tx>>> = (0..n).map(|_| Mutex::new(None)).collect();
        let mut rx: Vec<Mutex<Option<Rx>>> = (0..n).map(|_| Mutex::new(None)).collect();
        let my_node = peers[config.rank].node;
        let local = |p: usize| p != config.rank && peers[p].node == my_node && config.transport == Transport::Auto;
        let local_count = (0..n).filter(|&p| local(p)).count();

        // shared memory: each rank makes its inbound rings, then maps its peers'
        let dir =
            if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let ring_path = |from: usize, to: usize| dir.join(format!("kolo-{}-{from}-to-{to}", config.job_id));
        // rings shrink as ranks per host grow, so their memory stays bounded
        let capacity = (64usize << 20)
            .checked_div(local_count)
            .map_or(0, |c| c.clamp(256 << 10, config.tuning.ring_bytes.max(256 << 10)) & !7);
        let mut created = Vec::new();
        for p in (0..n).filter(|&p| local(p)) {
            let ring = Ring::create(&ring_path(p, config.rank), capacity).map_err(|e| {
                CommError::Bootstrap(format!("cannot create a shared-memory ring in {}: {e}", dir.display()))
            })?;
            created.push(p);
            *rx[p].get_mut().expect("fresh") = Some(Rx::Shm(ring));
        }
        for p in (0..n).filter(|&p| local(p)) {
            let path = ring_path(config.rank, p);
            let ring = loop {
                match Ring::open(&path) {
                    Ok(ring) => break ring,
                    Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
                    Err(e) => {
                        return Err(CommError::Bootstrap(format!(
                            "rank {p} never made its ring {}: {e}",
                            path.display()
                        )))
                    }
                }
            };
            *tx[p].get_mut().expect("fresh") = Some(Tx::Shm(ring));
        }

        // TCP: the lower rank dials, proving it knows the job secret
        let secret = config.secret.clone().unwrap_or_default();
        for p in (config.rank + 1..n).filter(|&p| !local(p)) {
            let mut stream = dial(peers[p].addr, deadline)
                .map_err(|e| CommError::Bootstrap(format!("cannot reach rank {p} at {}: {e}", peers[p].addr)))?;
            let mut hello = Vec::with_capacity(40);
            hello.extend_from_slice(&MAGIC.to_be_bytes());
            hello.extend_from_slice(&(config.rank as u32).to_be_bytes());
            hello.extend_from_slice(&tag(secret.as_bytes(), &config.job_id, config.rank, p));
            stream.write_all(&hello).map_err(|e| CommError::Io { rank: p, source: e })?;
            let mut ok = [0u8; 1];
            stream
                .read_exact(&mut ok)
                .map_err(|_| CommError::Bootstrap(format!("rank {p} refused the link (a different job secret?)")))?;
            install_tcp(&mut tx, &mut rx, p, stream)?;
        }
        let expected: Vec<usize> = (0..config.rank).filter(|&p| !local(p)).collect();
        accept_links(&listener, &config, &expected, secret.as_bytes(), deadline, &mut tx, &mut rx)?;

        let nodes: Vec<usize> = peers.iter().map(|p| p.node).collect();
        let local_pids: Vec<u32> = (0..n).map(|p| if peers[p].node == my_node { peers[p].pid } else { 0 }).collect();
        let shared = Arc::new(Shared {
            me: config.rank,
            tx,
            rx,
            local_pids,
            timeout: config.timeout,
            scratch: Mutex::new(Vec::new()),
            tuning: config.tuning.clone(),
        });
        let mut comm = Communicator { shared, group: (0..n).collect(), rank: config.rank, nodes, hierarchy: None };
        // every ring is mapped once everyone passed this: the files can go
        comm.barrier()?;
        for p in created {
            if let Some(Rx::Shm(ring)) = comm.shared.rx[p].lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                ring.unlink();
            }
        }
        comm.build_hierarchy()?;
        tracing::debug!(rank = comm.shared.me, size = n, local = local_count, "communicator up");
        Ok(comm)
    }
}

fn install_tcp(
    tx: &mut [Mutex<Option<Tx>>],
    rx: &mut [Mutex<Option<Rx>>],
    peer: usize,
    stream: TcpStream,
) -> Result<(), CommError> {
    let io = |e| CommError::Io { rank: peer, source: e };
    stream.set_nodelay(true).map_err(io)?;
    stream.set_nonblocking(true).map_err(io)?;
    let reader = stream.try_clone().map_err(io)?;
    *tx[peer].get_mut().expect("fresh") = Some(Tx::Tcp(stream));
    *rx[peer].get_mut().expect("fresh") = Some(Rx::Tcp(TcpRx::new(reader)));
    Ok(())
}

fn dial(addr: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

fn accept_links(
    listener: &TcpListener,
    config: &Config,
    expected: &[usize],
    secret: &[u8],
    deadline: Instant,
    tx: &mut [Mutex<Option<Tx>>],
    rx: &mut [Mutex<Option<Rx>>],
) -> Result<(), CommError> {
    let mut missing: Vec<usize> = expected.to_vec();
    listener.set_nonblocking(true).map_err(|e| CommError::Bootstrap(e.to_string()))?;
    while !missing.is_empty() {
        let (mut stream, from) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(CommError::Bootstrap(format!(
                        "ranks {missing:?} did not connect within {:.1} s",
                        config.timeout.as_secs_f64()
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) => return Err(CommError::Bootstrap(format!("accept failed: {e}"))),
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let mut hello = [0u8; 40];
        if stream.read_exact(&mut hello).is_err() {
            tracing::warn!(%from, "kolo-comm: dropped a connection that sent no hello");
            continue;
        }
        let magic = u32::from_be_bytes(hello[0..4].try_into().expect("4 bytes"));
        let peer = u32::from_be_bytes(hello[4..8].try_into().expect("4 bytes")) as usize;
        let want = missing.iter().position(|&m| m == peer);
        let good = magic == MAGIC
            && want.is_some()
            && crate::link_tags_match(&hello[8..40], &tag(secret, &config.job_id, peer, config.rank));
        if !good {
            tracing::warn!(%from, claimed = peer, "kolo-comm: refused a link without the job secret");
            continue;
        }
        stream.write_all(&[1]).map_err(|e| CommError::Io { rank: peer, source: e })?;
        let _ = stream.set_read_timeout(None);
        install_tcp(tx, rx, peer, stream)?;
        missing.remove(want.expect("checked"));
    }
    Ok(())
}

/// Rank records through the store: each rank PUTs its own, rank 0 reads
/// them all and PUTs the table, every other rank reads the table once.
fn exchange_addresses(config: &Config, addr: &SocketAddr, deadline: Instant) -> Result<Vec<Peer>, CommError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CommError::Bootstrap(format!("cannot start a runtime: {e}")))?;
    let mut client_config = ClientConfig::new(config.store.clone());
    client_config.secret = config.secret.clone();
    let client = Client::new(client_config);
    let scope = format!("kolo_comm_{}", config.job_id);
    let record = format!("{}\t{addr}\t{}", config.node_id, std::process::id());
    let store_err = |e: kolo_rendezvous::RendezvousError| CommError::Bootstrap(format!("rendezvous store: {e}"));
    runtime.block_on(async {
        client.put(&scope, &config.rank.to_string(), record.clone()).await.map_err(store_err)?;
        let remaining = || deadline.saturating_duration_since(Instant::now());
        let table = if config.rank == 0 {
            let mut records = Vec::with_capacity(config.size);
            for r in 0..config.size {
                match client.wait(&scope, &[&r.to_string()], remaining()).await {
                    Ok(mut v) => records.push(String::from_utf8_lossy(&v.remove(0)).into_owned()),
                    Err(kolo_rendezvous::RendezvousError::WaitTimeout { .. }) => {
                        let mut missing = Vec::new();
                        for m in r..config.size {
                            if client.get(&scope, &m.to_string()).await.map_err(store_err)?.is_none() {
                                missing.push(m);
                            }
                        }
                        return Err(CommError::Bootstrap(format!(
                            "ranks {missing:?} did not show up within {:.1} s",
                            config.timeout.as_secs_f64()
                        )));
                    }
                    Err(e) => return Err(store_err(e)),
                }
            }
            let table = records.join("\n");
            client.put(&scope, "table", table.clone()).await.map_err(store_err)?;
            table
        } else {
            match client.wait(&scope, &["table"], remaining()).await {
                Ok(mut v) => String::from_utf8_lossy(&v.remove(0)).into_owned(),
                Err(kolo_rendezvous::RendezvousError::WaitTimeout { .. }) => {
                    return Err(CommError::Bootstrap(format!(
                        "no address table from rank 0 within {:.1} s: rank 0 or another rank did not show up",
                        config.timeout.as_secs_f64()
                    )))
                }
                Err(e) => return Err(store_err(e)),
            }
        };
        // our record is read (rank 0 read them all before the table existed)
        let _ = client.delete(&scope, &config.rank.to_string()).await;
        parse_table(&table, config.size)
    })
}

fn parse_table(table: &str, size: usize) -> Result<Vec<Peer>, CommError> {
    let mut node_index: HashMap<String, usize> = HashMap::new();
    let mut peers = Vec::with_capacity(size);
    for line in table.lines() {
        let bad = || CommError::Bootstrap(format!("malformed address record '{line}'"));
        let mut parts = line.split('\t');
        let (Some(node), Some(addr), Some(pid)) = (parts.next(), parts.next(), parts.next()) else { return Err(bad()) };
        let next = node_index.len();
        let node = *node_index.entry(node.to_string()).or_insert(next);
        peers.push(Peer { node, addr: addr.parse().map_err(|_| bad())?, pid: pid.parse().map_err(|_| bad())? });
    }
    if peers.len() != size {
        return Err(CommError::Bootstrap(format!("address table has {} ranks, expected {size}", peers.len())));
    }
    Ok(peers)
}
