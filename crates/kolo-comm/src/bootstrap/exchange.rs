//! The address swap: each rank's record (host, TCP address, pid, unix
//! socket name) through the rendezvous store, or the caller's address
//! book; rank 0 reads them all and publishes the table every rank reads.
//! Linear traffic, over a blocking client (no async runtime).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kolo_rendezvous::{BlockingClient, ClientConfig, RendezvousError};

use super::{AddressBook, Book, Config};
use crate::interrupt::{check_interrupt, Interrupt};
use crate::CommError;

pub(super) struct Peer {
    pub(super) node: usize,
    pub(super) addr: SocketAddr,
    pub(super) pid: u32,
    /// Abstract unix socket name for same-host links ("-" when none).
    pub(super) unix: String,
}

/// Waits for one key, asking `interrupt` between slices of the wait.
fn wait_key(
    client: &mut BlockingClient,
    scope: &str,
    key: &str,
    deadline: Instant,
    interrupt: &Option<Interrupt>,
) -> Result<Result<Vec<u8>, RendezvousError>, CommError> {
    let slice = if interrupt.is_some() { Duration::from_millis(20) } else { Duration::MAX };
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        match client.wait(scope, &[key], remaining.min(slice)) {
            Ok(mut values) => return Ok(Ok(values.remove(0))),
            Err(RendezvousError::WaitTimeout { .. }) if remaining > slice => check_interrupt(interrupt)?,
            Err(e) => return Ok(Err(e)),
        }
    }
}

/// A client of the job's store, with the secret, its requests bounded by
/// the configured timeout (at most 30 s).
pub(crate) fn store_client(config: &Config) -> BlockingClient {
    let mut client = ClientConfig::new(config.store.clone());
    client.secret = Some(config.secret.expose().to_string());
    client.request_timeout = config.timeout.min(Duration::from_secs(30));
    BlockingClient::new(client)
}

/// Rank records through the store: each rank PUTs its own, rank 0 reads
/// them all and PUTs the table, every other rank reads the table once.
pub(super) fn exchange_addresses(
    config: &Config,
    addr: &SocketAddr,
    unix: &str,
    deadline: Instant,
) -> Result<Vec<Peer>, CommError> {
    if let Some(Book(book)) = &config.book {
        return exchange_in_book(config, book.as_ref(), addr, unix, deadline);
    }
    let mut client = store_client(config);
    let scope = format!("kolo-comm-{}", config.job_id);
    let record = format!("{}\t{addr}\t{}\t{unix}", config.node_id, std::process::id());
    client.put(&scope, &config.rank.to_string(), record.as_bytes()).map_err(CommError::Store)?;
    let table = if config.rank == 0 {
        let mut records = Vec::with_capacity(config.size);
        for r in 0..config.size {
            match wait_key(&mut client, &scope, &r.to_string(), deadline, &config.interrupt)? {
                Ok(v) => records.push(String::from_utf8_lossy(&v).into_owned()),
                Err(RendezvousError::WaitTimeout { .. }) => {
                    let mut missing = Vec::new();
                    for m in r..config.size {
                        if client.get(&scope, &m.to_string()).map_err(CommError::Store)?.is_none() {
                            missing.push(m);
                        }
                    }
                    return Err(CommError::Bootstrap(format!(
                        "ranks {missing:?} did not show up within {:.1} s",
                        config.timeout.as_secs_f64()
                    )));
                }
                Err(e) => return Err(CommError::Store(e)),
            }
        }
        let table = records.join("\n");
        client.put(&scope, "table", table.as_bytes()).map_err(CommError::Store)?;
        table
    } else {
        match wait_key(&mut client, &scope, "table", deadline, &config.interrupt)? {
            Ok(v) => String::from_utf8_lossy(&v).into_owned(),
            Err(RendezvousError::WaitTimeout { .. }) => {
                return Err(CommError::Bootstrap(format!(
                    "no address table from rank 0 within {:.1} s: rank 0 or another rank did not show up",
                    config.timeout.as_secs_f64()
                )))
            }
            Err(e) => return Err(CommError::Store(e)),
        }
    };
    // our record is read (rank 0 read them all before the table existed)
    let _ = client.delete(&scope, &config.rank.to_string());
    parse_table(&table, config.size)
}

/// [`exchange_addresses`] through the caller's [`AddressBook`]: the same
/// records and table, under the keys `kolo-comm/<rank>` and `kolo-comm/table`.
fn exchange_in_book(
    config: &Config,
    book: &dyn AddressBook,
    addr: &SocketAddr,
    unix: &str,
    deadline: Instant,
) -> Result<Vec<Peer>, CommError> {
    let failed = |e: String| CommError::Bootstrap(format!("address book: {e}"));
    let record = format!("{}\t{addr}\t{}\t{unix}", config.node_id, std::process::id());
    book.put(&format!("kolo-comm/{}", config.rank), record.as_bytes()).map_err(failed)?;
    // short slices, so that an interrupt (an elastic round moving on) is seen
    let wait = |key: &str| -> Result<Option<Vec<u8>>, CommError> {
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let slice = if config.interrupt.is_some() { remaining.min(Duration::from_millis(200)) } else { remaining };
            if let Some(v) = book.wait(key, slice).map_err(failed)? {
                return Ok(Some(v));
            }
            check_interrupt(&config.interrupt)?;
            if slice >= remaining {
                return Ok(None);
            }
        }
    };
    let table = if config.rank == 0 {
        let mut records = Vec::with_capacity(config.size);
        for r in 0..config.size {
            match wait(&format!("kolo-comm/{r}"))? {
                Some(v) => records.push(String::from_utf8_lossy(&v).into_owned()),
                None => {
                    let mut missing = vec![r];
                    for m in r + 1..config.size {
                        if book.wait(&format!("kolo-comm/{m}"), Duration::ZERO).map_err(failed)?.is_none() {
                            missing.push(m);
                        }
                    }
                    return Err(CommError::Bootstrap(format!(
                        "ranks {missing:?} did not show up within {:.1} s",
                        config.timeout.as_secs_f64()
                    )));
                }
            }
        }
        let table = records.join("\n");
        book.put("kolo-comm/table", table.as_bytes()).map_err(failed)?;
        table
    } else {
        match wait("kolo-comm/table")? {
            Some(v) => String::from_utf8_lossy(&v).into_owned(),
            None => {
                return Err(CommError::Bootstrap(format!(
                    "no address table from rank 0 within {:.1} s: rank 0 or another rank did not show up",
                    config.timeout.as_secs_f64()
                )))
            }
        }
    };
    parse_table(&table, config.size)
}

fn parse_table(table: &str, size: usize) -> Result<Vec<Peer>, CommError> {
    let mut node_index: HashMap<String, usize> = HashMap::new();
    let mut peers = Vec::with_capacity(size);
    for line in table.lines() {
        let bad = || CommError::Bootstrap(format!("malformed address record '{line}'"));
        let mut parts = line.split('\t');
        let (Some(node), Some(addr), Some(pid), Some(unix)) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let next = node_index.len();
        let node = *node_index.entry(node.to_string()).or_insert(next);
        peers.push(Peer {
            node,
            addr: addr.parse().map_err(|_| bad())?,
            pid: pid.parse().map_err(|_| bad())?,
            unix: unix.to_string(),
        });
    }
    if peers.len() != size {
        return Err(CommError::Bootstrap(format!("address table has {} ranks, expected {size}", peers.len())));
    }
    Ok(peers)
}
