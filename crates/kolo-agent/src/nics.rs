//! Finding the network interfaces every host can use to reach the next
//! (Horovod's NIC detection, done in parallel and authenticated): one agent
//! per host lists its interfaces and listens; in a ring, each agent probes
//! every address of the next host and keeps an interface when the probe
//! got through, the next agent proved the job secret, and the connection
//! left through the interface of the same name. The result is the names
//! common to every pair.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use kolo_auth::Secret;

/// Interface names with their IPv4 addresses.
pub type Interfaces = Vec<(String, Vec<String>)>;

/// This host's interfaces with IPv4 addresses (loopback left out).
pub fn interfaces() -> Interfaces {
    let mut out: Interfaces = Vec::new();
    let Ok(all) = nix::ifaddrs::getifaddrs() else { return out };
    for a in all {
        let Some(v4) = a.address.as_ref().and_then(|s| s.as_sockaddr_in()).map(|s| s.ip()) else { continue };
        if v4.is_loopback() {
            continue;
        }
        match out.iter_mut().find(|(n, _)| *n == a.interface_name) {
            Some((_, addrs)) => addrs.push(v4.to_string()),
            None => out.push((a.interface_name.clone(), vec![v4.to_string()])),
        }
    }
    out
}

/// Every interface name of this host (loopback included), sorted.
pub fn interface_names() -> Vec<String> {
    let mut names: Vec<String> = match nix::ifaddrs::getifaddrs() {
        Ok(all) => all.map(|a| a.interface_name).collect(),
        Err(_) => Vec::new(),
    };
    names.sort();
    names.dedup();
    names
}

fn interface_of(ip: IpAddr) -> Option<String> {
    let all = nix::ifaddrs::getifaddrs().ok()?;
    for a in all {
        if let Some(v4) = a.address.as_ref().and_then(|s| s.as_sockaddr_in()) {
            if IpAddr::V4(v4.ip()) == ip {
                return Some(a.interface_name);
            }
        }
    }
    None
}

/// Each probe proves the job secret both ways (kolo-auth), bound to the
/// probed agent's index.
fn probe_context(index: u32) -> Vec<u8> {
    let mut context = b"kolo-nic-probe".to_vec();
    context.extend_from_slice(&index.to_be_bytes());
    context
}

/// Set to stop the probe listener this process runs (an agent runs at
/// most one, for the job's start).
static STOP_LISTENING: std::sync::Mutex<Option<Arc<std::sync::atomic::AtomicBool>>> = std::sync::Mutex::new(None);

/// How long a probe listener waits at most for the driver's word that the
/// probes are over (a driver that died meanwhile).
const LISTEN_AT_MOST: Duration = Duration::from_secs(60);

/// Listens for probes on this host's listed addresses only, one port for
/// all of them, one handshake at a time, until [`stop_listening`] (or a
/// minute at most).
pub fn listen(index: u32, secret: Arc<Secret>) -> std::io::Result<(u16, Interfaces)> {
    let listed = interfaces();
    let addrs: Vec<IpAddr> = listed.iter().flat_map(|(_, a)| a.iter()).filter_map(|a| a.parse().ok()).collect();
    let listeners = bind_all(&addrs)?;
    let port = match listeners.first() {
        Some(l) => l.local_addr()?.port(),
        // nothing to probe on this host: the probes of it fail and say so
        None => 0,
    };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(earlier) = kolo_sys::lock(&STOP_LISTENING).replace(stop.clone()) {
        earlier.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    std::thread::spawn(move || {
        use std::os::fd::AsFd;
        let until = std::time::Instant::now() + LISTEN_AT_MOST;
        let context = probe_context(index);
        while std::time::Instant::now() < until && !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let mut fds: Vec<nix::poll::PollFd> =
                listeners.iter().map(|l| nix::poll::PollFd::new(l.as_fd(), nix::poll::PollFlags::POLLIN)).collect();
            // woken every 50 ms to see the stop flag
            if nix::poll::poll(&mut fds, 50u16).unwrap_or(0) == 0 {
                continue;
            }
            for listener in &listeners {
                if let Ok((mut s, _)) = listener.accept() {
                    let _ = s.set_nonblocking(false);
                    // a peer that fails the handshake is simply dropped
                    let _ = kolo_auth::handshake(
                        &mut s,
                        kolo_auth::Role::Listener,
                        &secret,
                        &context,
                        Duration::from_secs(5),
                    );
                }
            }
        }
    });
    Ok((port, listed))
}

/// Closes the probe listener of this process, if one runs.
pub fn stop_listening() {
    if let Some(stop) = kolo_sys::lock(&STOP_LISTENING).take() {
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Non-blocking listeners on every address, on one port (tried a few
/// times: another program may hold the first one's port elsewhere).
fn bind_all(addrs: &[IpAddr]) -> std::io::Result<Vec<TcpListener>> {
    let mut last = None;
    for _ in 0..8 {
        let mut listeners: Vec<TcpListener> = Vec::new();
        let mut port = 0;
        let bound = addrs.iter().try_for_each(|ip| {
            let listener = TcpListener::bind(SocketAddr::new(*ip, port))?;
            listener.set_nonblocking(true)?;
            port = listener.local_addr()?.port();
            listeners.push(listener);
            Ok::<(), std::io::Error>(())
        });
        match bound {
            Ok(()) => return Ok(listeners),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("tried at least once"))
}

fn probe_one(index: u32, iface: &str, addr: &str, port: u16, secret: &Secret, timeout: Duration) -> Option<String> {
    let ip: IpAddr = match addr.parse() {
        Ok(ip) => ip,
        Err(_) => return Some(format!("'{addr}' is not an address")),
    };
    let mut s = match TcpStream::connect_timeout(&SocketAddr::new(ip, port), timeout) {
        Ok(s) => s,
        Err(e) => return Some(format!("cannot connect: {e}")),
    };
    if let Err(e) = kolo_auth::handshake(&mut s, kolo_auth::Role::Dialer, secret, &probe_context(index), timeout) {
        return Some(format!("reached something that is not the next host's agent ({e})"));
    }
    let local = s.local_addr().map(|a| a.ip()).ok();
    match local.and_then(interface_of) {
        Some(name) if name == iface => None,
        Some(name) => Some(format!("left through {name}, not {iface}")),
        None => Some("left through an unknown interface".into()),
    }
}

/// Probes every target in parallel.
pub fn probe(
    index: u32,
    targets: &[(String, String, u16)],
    secret: &Secret,
    timeout: Duration,
) -> Vec<(String, String, Option<String>)> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = targets
            .iter()
            .map(|(iface, addr, port)| {
                scope
                    .spawn(move || (iface.clone(), addr.clone(), probe_one(index, iface, addr, *port, secret, timeout)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("probe thread")).collect()
    })
}

/// What one host found probing the next.
#[derive(Clone, Debug)]
pub struct PairReport {
    /// The probing host.
    pub from: String,
    /// The host it probed (the next in the ring).
    pub to: String,
    /// (interface, address, None if it carried traffic, else why not)
    pub results: Vec<(String, String, Option<String>)>,
}

impl PairReport {
    /// The interfaces over which at least one probe got through.
    pub fn working(&self) -> BTreeSet<String> {
        self.results.iter().filter(|(_, _, e)| e.is_none()).map(|(i, _, _)| i.clone()).collect()
    }
}

/// The interfaces that work for every pair, or an error naming each pair
/// with what failed there.
pub fn common(pairs: &[PairReport]) -> Result<Vec<String>, String> {
    let mut common: Option<BTreeSet<String>> = None;
    for p in pairs {
        let working = p.working();
        common = Some(match common {
            None => working,
            Some(c) => c.intersection(&working).cloned().collect(),
        });
    }
    let common = common.unwrap_or_default();
    if common.is_empty() {
        let mut why = Vec::new();
        for p in pairs {
            let failed: Vec<String> =
                p.results.iter().filter_map(|(i, a, e)| e.as_ref().map(|e| format!("{i} ({a}): {e}"))).collect();
            if !failed.is_empty() || p.results.is_empty() {
                let detail =
                    if failed.is_empty() { "the next host lists no interfaces".into() } else { failed.join("; ") };
                why.push(format!("{} -> {}: {detail}", p.from, p.to));
            }
        }
        return Err(format!("no network interface connects every host to the next: {}", why.join(" | ")));
    }
    Ok(common.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(from: &str, to: &str, results: &[(&str, Option<&str>)]) -> PairReport {
        PairReport {
            from: from.into(),
            to: to.into(),
            results: results.iter().map(|(i, e)| (i.to_string(), "10.0.0.1".into(), e.map(String::from))).collect(),
        }
    }

    #[test]
    fn common_interfaces_over_the_ring() {
        let pairs = [
            pair("h1", "h2", &[("eth0", None), ("eth1", None)]),
            pair("h2", "h3", &[("eth0", None)]),
            pair("h3", "h1", &[("eth0", None), ("eth1", Some("timed out"))]),
        ];
        assert_eq!(common(&pairs).unwrap(), ["eth0"]);
        assert_eq!(common(&pairs[..1]).unwrap(), ["eth0", "eth1"]);
        let broken = [pair("h1", "h2", &[("eth0", None)]), pair("h2", "h3", &[("eth0", Some("cannot connect"))])];
        let err = common(&broken).unwrap_err();
        assert!(err.contains("h2 -> h3: eth0 (10.0.0.1): cannot connect"), "{err}");
    }
}
