//! Who owns a TCP connection on this host: the kernel's socket tables
//! (`/proc/net/tcp` and `tcp6`, per network namespace) list every socket
//! with its addresses and the user that made it. The job's stores speak
//! protocols without a secret (torch's and Gloo's clients cannot present
//! one), so a store asks this, before it reads a byte, of the host a
//! connection comes from.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The user that owns the socket connected from `client` to `server`, as
/// this host's socket tables have it; `None` where no such socket is listed.
pub fn owner_uid(client: SocketAddr, server: SocketAddr) -> std::io::Result<Option<u32>> {
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = match std::fs::read_to_string(table) {
            Ok(text) => text,
            // a kernel without IPv6 has no tcp6 table
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if let Some(uid) = find_owner(&text, client, server) {
            return Ok(Some(uid));
        }
    }
    Ok(None)
}

/// This user's id, as the socket tables write owners.
pub fn this_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Admits the connection from `client` to `server` if this host's socket
/// tables list it as this user's; otherwise says why not, naming `host`.
pub fn owned_by_this_user(client: SocketAddr, server: SocketAddr, host: &str) -> Result<(), String> {
    match owner_uid(client, server) {
        Ok(Some(uid)) if uid == this_uid() => Ok(()),
        Ok(Some(uid)) => Err(format!("it belongs to user {uid} of {host}, not the job's")),
        Ok(None) => Err(format!("{host} lists no such connection")),
        Err(e) => Err(format!("cannot read the socket tables of {host}: {e}")),
    }
}

/// The uid of the row whose local address is `client` and remote address
/// is `server` (IPv4-mapped IPv6 addresses match their IPv4 form).
pub fn find_owner(table: &str, client: SocketAddr, server: SocketAddr) -> Option<u32> {
    let canonical = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let (client, server) = (canonical(client), canonical(server));
    table.lines().skip(1).find_map(|row| {
        let fields: Vec<&str> = row.split_whitespace().collect();
        // sl local rem st queues timer retransmits uid ...
        let (local, remote, uid) = (fields.get(1)?, fields.get(2)?, fields.get(7)?);
        (parse_addr(local)? == client && parse_addr(remote)? == server).then(|| uid.parse().ok())?
    })
}

/// `0100007F:1F90` (IPv4) or 32 hex digits and a port (IPv6): the address
/// as the kernel's words in this machine's byte order, the port big-endian.
fn parse_addr(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |hex: &str| u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes);
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(ip)?)),
        32 => {
            let mut octets = [0u8; 16];
            for (i, chunk) in octets.chunks_mut(4).enumerate() {
                chunk.copy_from_slice(&word(ip.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(octets))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip.to_canonical(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex_v4(a: SocketAddr) -> String {
        let IpAddr::V4(ip) = a.ip() else { unreachable!() };
        format!("{:08X}:{:04X}", u32::from_ne_bytes(ip.octets()), a.port())
    }

    fn hex_v6(a: SocketAddr) -> String {
        let ip = match a.ip() {
            IpAddr::V6(ip) => ip,
            IpAddr::V4(ip) => ip.to_ipv6_mapped(),
        };
        let words: String =
            ip.octets().chunks(4).map(|c| format!("{:08X}", u32::from_ne_bytes(c.try_into().unwrap()))).collect();
        format!("{words}:{:04X}", a.port())
    }

    #[test]
    fn rows_are_matched_by_both_addresses_in_either_table_format() {
        let client: SocketAddr = "127.0.0.1:41234".parse().unwrap();
        let server: SocketAddr = "127.0.0.1:29500".parse().unwrap();
        let other: SocketAddr = "10.77.0.12:41234".parse().unwrap();
        let header =
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";
        let row = |n: u32, l: String, r: String, uid: u32| {
            format!("   {n}: {l} {r} 01 00000000:00000000 00:00000000 00000000  {uid}        0 123 1 0 20 4 30 10 -1\n")
        };
        let table = format!(
            "{header}{}{}{}",
            row(0, hex_v4(server), hex_v4(client), 1000),
            row(1, hex_v4(other), hex_v4(server), 65534),
            row(2, hex_v4(client), hex_v4(server), 1000)
        );
        // the server's end of the same connection is not the client's
        assert_eq!(find_owner(&table, client, server), Some(1000));
        assert_eq!(find_owner(&table, other, server), Some(65534));
        assert_eq!(find_owner(&table, server, other), None);
        let v6 = format!("{header}{}", row(0, hex_v6(client), hex_v6(server), 7));
        assert_eq!(find_owner(&v6, client, server), Some(7));
        let mapped = SocketAddr::new(IpAddr::V6(Ipv4Addr::new(127, 0, 0, 1).to_ipv6_mapped()), 41234);
        assert_eq!(find_owner(&v6, mapped, server), Some(7));
        assert_eq!(find_owner("garbage\n1: x y z\n", client, server), None);
    }

    #[test]
    fn a_real_connection_on_this_host_is_owned_by_this_user() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let server = listener.local_addr().unwrap();
        let stream = std::net::TcpStream::connect(server).unwrap();
        let client = stream.local_addr().unwrap();
        let _accepted = listener.accept().unwrap();
        assert_eq!(owner_uid(client, server).unwrap(), Some(this_uid()));
        // nothing connects from the server's own address to the client
        assert_eq!(owner_uid(SocketAddr::new(client.ip(), 1), server).unwrap(), None);
    }
}
