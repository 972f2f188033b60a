//! The blocking client against the real server (run on a tokio runtime of
//! its own, as the launcher does), from plain threads.

use std::time::{Duration, Instant};

use kolo_rendezvous::{BlockingClient, ClientConfig, RendezvousError, RendezvousServer, ServerConfig};
use kolo_topology::{host_assignments, parse_host_list, Slot};

fn plan(hosts: &str, np: u64) -> Vec<Slot> {
    host_assignments(&parse_host_list(hosts).unwrap(), np, Some(np)).unwrap()
}

/// The server and the runtime that drives it.
fn server(config: ServerConfig) -> (tokio::runtime::Runtime, RendezvousServer) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let server = runtime.block_on(RendezvousServer::start(config, &plan("localhost:2", 2))).unwrap();
    (runtime, server)
}

fn local() -> ServerConfig {
    ServerConfig::new("127.0.0.1:0".parse().unwrap())
}

#[test]
fn put_get_delete_and_wait() {
    let (runtime, server) = server(local());
    let addr = server.addr().to_string();
    let mut client = BlockingClient::new(ClientConfig::new(addr.clone()));
    assert_eq!(client.get("job", "a").unwrap(), None);
    client.put("job", "a", b"1").unwrap();
    assert_eq!(client.get("job", "a").unwrap().as_deref(), Some(&b"1"[..]));
    client.put("job", "a", b"").unwrap();
    assert_eq!(client.get("job", "a").unwrap().as_deref(), Some(&b""[..]));
    client.delete("job", "a").unwrap();
    assert_eq!(client.get("job", "a").unwrap(), None);

    // a key that appears later, from another thread with its own client
    let writer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        let mut other = BlockingClient::new(ClientConfig::new(addr));
        other.put("job", "late", b"here").unwrap();
    });
    client.put("job", "early", b"first").unwrap();
    let got = client.wait("job", &["early", "late"], Duration::from_secs(10)).unwrap();
    assert_eq!(got, vec![b"first".to_vec(), b"here".to_vec()]);
    writer.join().unwrap();
    // one kept-alive connection, polling a missing key every 10 ms or so
    assert!(client.requests() < 40, "{} requests", client.requests());
    runtime.block_on(server.stop());
}

#[test]
fn wait_names_the_missing_keys() {
    let (runtime, server) = server(local());
    let mut client = BlockingClient::new(ClientConfig::new(server.addr().to_string()));
    client.put("s", "0", b"x").unwrap();
    let start = Instant::now();
    let e = client.wait("s", &["0", "1", "2"], Duration::from_millis(200)).unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(200) && start.elapsed() < Duration::from_secs(3));
    match &e {
        RendezvousError::WaitTimeout { missing, scope, .. } => {
            assert_eq!(missing, &["1", "2"]);
            assert_eq!(scope, "s");
        }
        other => panic!("{other}"),
    }
    runtime.block_on(server.stop());
}

#[test]
fn the_secret_travels_in_its_header() {
    let mut config = local();
    config.secret = Some("job-secret".into());
    config.require_secret = true;
    let (runtime, server) = server(config);
    let addr = server.addr().to_string();
    let e = BlockingClient::new(ClientConfig::new(addr.clone())).put("s", "k", b"v").unwrap_err();
    assert!(matches!(e, RendezvousError::Status { status: 401, .. }), "{e}");
    let mut wrong = ClientConfig::new(addr.clone());
    wrong.secret = Some("other".into());
    assert!(BlockingClient::new(wrong).get("s", "k").is_err());
    let mut right = ClientConfig::new(addr);
    right.secret = Some("job-secret".into());
    let mut client = BlockingClient::new(right);
    client.put("s", "k", b"v").unwrap();
    assert_eq!(client.get("s", "k").unwrap().as_deref(), Some(&b"v"[..]));
    runtime.block_on(server.stop());
}

#[test]
fn an_unreachable_server_fails_after_the_attempts() {
    let (runtime, server) = server(local());
    let addr = server.addr().to_string();
    runtime.block_on(server.stop());
    let mut config = ClientConfig::new(addr);
    config.retry_delay = Duration::from_millis(20);
    let e = BlockingClient::new(config).get("s", "k").unwrap_err().to_string();
    assert!(e.contains("3 attempts failed") && e.contains("connect to"), "{e}");
}
