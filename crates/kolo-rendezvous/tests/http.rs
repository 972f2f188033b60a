//! The server's HTTP semantics, checked over real sockets: a raw HTTP/1.1
//! speaker for the wire details, kolo's client for the rest.

use std::time::Duration;

use kolo_rendezvous::{Client, ClientConfig, RendezvousServer, ServerConfig};
use kolo_topology::{host_assignments, parse_host_list, Slot};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

fn plan(hosts: &str, np: u64) -> Vec<Slot> {
    host_assignments(&parse_host_list(hosts).unwrap(), np, Some(np)).unwrap()
}

async fn server(plan: &[Slot]) -> RendezvousServer {
    RendezvousServer::start(config(), plan).await.unwrap()
}

/// The address of a server that stopped: nothing answers there.
async fn stopped_server_addr() -> std::net::SocketAddr {
    let server = server(&[]).await;
    let addr = server.addr();
    server.stop().await;
    addr
}

/// A server of `plan` and a raw connection to it.
async fn connected(plan: &[Slot]) -> (RendezvousServer, Raw) {
    let server = server(plan).await;
    let c = Raw::connect(&server).await;
    (server, c)
}

fn config() -> ServerConfig {
    ServerConfig::new("127.0.0.1:0".parse().unwrap())
}

/// Bounds the waits of a test that would otherwise hang on a server that
/// fails to time something out.
async fn within<T>(limit: Duration, what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(limit, f).await.unwrap_or_else(|_| panic!("{what}: not within {limit:?}"))
}

/// A raw keep-alive HTTP/1.1 connection.
struct Raw {
    reader: BufReader<TcpStream>,
}

impl Raw {
    async fn connect(server: &RendezvousServer) -> Raw {
        Raw { reader: BufReader::new(TcpStream::connect(server.addr()).await.unwrap()) }
    }

    async fn send(&mut self, head: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let stream = self.reader.get_mut();
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(body).await.unwrap();
        self.read_response().await
    }

    async fn read_response(&mut self) -> (u16, Vec<u8>) {
        let mut status_line = String::new();
        self.reader.read_line(&mut status_line).await.unwrap();
        assert!(status_line.starts_with("HTTP/1.1 "), "status line {status_line:?}");
        let status: u16 = status_line[9..12].parse().unwrap();
        let mut length = None;
        loop {
            let mut line = String::new();
            self.reader.read_line(&mut line).await.unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = Some(value.trim().parse::<usize>().unwrap());
                }
            }
        }
        let length = length.expect("every answer carries Content-Length");
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body).await.unwrap();
        (status, body)
    }

    async fn request(&mut self, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let head = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", body.len());
        self.send(&head, body).await
    }

    /// A request on a connection of its own, for answers that close it.
    async fn once(server: &RendezvousServer, method: &str, path: &str, body: &[u8]) -> (u16, String) {
        let (status, body) = Raw::connect(server).await.request(method, path, body).await;
        (status, String::from_utf8(body).unwrap())
    }

    /// Whether the server closed the connection (reads to end of stream).
    async fn closed(&mut self) -> bool {
        let mut rest = Vec::new();
        self.reader.read_to_end(&mut rest).await.is_ok() && rest.is_empty()
    }
}

#[tokio::test]
async fn put_get_overwrite_and_404_on_one_connection() {
    let (_server, mut c) = connected(&[]).await;
    assert_eq!(c.request("GET", "/s/k", b"").await, (404, vec![]));
    assert_eq!(c.request("PUT", "/s/k", b"\x00bytes\xff").await, (200, vec![]));
    assert_eq!(c.request("GET", "/s/k", b"").await, (200, b"\x00bytes\xff".to_vec()));
    assert_eq!(c.request("PUT", "/s/k", b"new").await, (200, vec![]));
    assert_eq!(c.request("GET", "/s/k", b"").await, (200, b"new".to_vec()));
    assert_eq!(c.request("PUT", "/s/empty", b"").await, (200, vec![]));
    assert_eq!(c.request("GET", "/s/empty", b"").await, (200, vec![]));
    // scopes are separate
    assert_eq!(c.request("GET", "/t/k", b"").await.0, 404);
}

#[tokio::test]
async fn malformed_paths_get_400_and_the_connection_lives_on() {
    let (_server, mut c) = connected(&[]).await;
    for path in ["/", "/onlyscope", "/a/", "//key", "/a/b/c", "/a/b/"] {
        for method in ["GET", "PUT", "DELETE"] {
            let (status, body) = c.request(method, path, b"").await;
            assert_eq!(status, 400, "{method} {path}");
            let text = String::from_utf8(body).unwrap();
            assert!(text.contains(path) && text.contains("/<scope>/<key>"), "{text}");
        }
    }
    assert_eq!(c.request("PUT", "/a/b", b"ok").await.0, 200);
    assert_eq!(c.request("POST", "/a/b", b"").await.0, 405);
}

#[tokio::test]
async fn put_needs_length_and_bounded_body() {
    let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap());
    config.max_body_bytes = 1024;
    let server = RendezvousServer::start(config, &[]).await.unwrap();
    let mut c = Raw::connect(&server).await;
    let chunked = "PUT /a/b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
    let (status, body) = c.send(chunked, b"3\r\nabc\r\n0\r\n\r\n").await;
    assert_eq!(status, 411, "{}", String::from_utf8_lossy(&body));
    let mut c = Raw::connect(&server).await;
    assert_eq!(c.request("PUT", "/a/b", &[7; 1024]).await.0, 200);
    let mut c = Raw::connect(&server).await;
    let head = "PUT /a/b HTTP/1.1\r\nHost: x\r\nContent-Length: 1025\r\n\r\n";
    let (status, body) = c.send(head, b"").await;
    assert_eq!(status, 413);
    assert!(String::from_utf8_lossy(&body).contains("1025 bytes"));
    let mut c = Raw::connect(&server).await;
    assert_eq!(c.request("GET", "/a/b", b"").await, (200, vec![7; 1024]));
}

#[tokio::test]
async fn plan_scopes_clear_once_every_rank_finished() {
    let plan = plan("a:2,b:2", 4);
    let (server, mut c) = connected(&plan).await;
    for round in 0..2 {
        for r in 0..4 {
            assert_eq!(c.request("PUT", &format!("/global/{r}"), b"addr").await.0, 200);
        }
        for r in 0..3 {
            assert_eq!(c.request("DELETE", &format!("/global/{r}"), b"").await.0, 200);
            // keys stay until the last rank is done
            assert_eq!(c.request("GET", "/global/3", b"").await.0, 200, "round {round}");
        }
        assert_eq!(c.request("DELETE", "/global/3", b"").await.0, 200);
        for r in 0..4 {
            assert_eq!(c.request("GET", &format!("/global/{r}"), b"").await.0, 404, "round {round}");
        }
    }
    // local_<host> is sized by the host's local size, cross_<lr> by the cross size
    for scope in ["local_a", "cross_1"] {
        c.request("PUT", &format!("/{scope}/x"), b"v").await;
        c.request("DELETE", &format!("/{scope}/0"), b"").await;
        assert_eq!(c.request("GET", &format!("/{scope}/x"), b"").await.0, 200, "{scope}");
        c.request("DELETE", &format!("/{scope}/1"), b"").await;
        assert_eq!(c.request("GET", &format!("/{scope}/x"), b"").await.0, 404, "{scope}");
    }
    // a new plan resets the store
    c.request("PUT", "/global/0", b"v").await;
    server.init(&plan_of_one());
    assert_eq!(c.request("GET", "/global/0", b"").await.0, 404);
    c.request("PUT", "/global/0", b"v").await;
    c.request("DELETE", "/global/0", b"").await;
    assert_eq!(c.request("GET", "/global/0", b"").await.0, 404);
}

fn plan_of_one() -> Vec<Slot> {
    plan("solo:1", 1)
}

#[tokio::test]
async fn ad_hoc_scopes_delete_the_key() {
    let (_server, mut c) = connected(&plan("a:2", 2)).await;
    c.request("PUT", "/procset_1/0", b"x").await;
    c.request("PUT", "/procset_1/1", b"y").await;
    assert_eq!(c.request("DELETE", "/procset_1/0", b"").await.0, 200);
    assert_eq!(c.request("GET", "/procset_1/0", b"").await.0, 404);
    assert_eq!(c.request("GET", "/procset_1/1", b"").await, (200, b"y".to_vec()));
    // deleting what is not there is fine
    assert_eq!(c.request("DELETE", "/nothing/here", b"").await.0, 200);
}

#[tokio::test]
async fn rank_and_size_is_answered_from_the_plan() {
    let (_server, mut c) = connected(&plan("worker-0:1,worker-1:2", 3)).await;
    assert_eq!(c.request("GET", "/rank_and_size/worker-1:1", b"").await, (200, b"2,3,1,2,0,1".to_vec()));
    assert_eq!(c.request("GET", "/rank_and_size/worker-0:0", b"").await, (200, b"0,3,0,1,0,2".to_vec()));
    assert_eq!(c.request("GET", "/rank_and_size/worker-0:1", b"").await, (200, b"-1,-1,-1,-1,-1,-1".to_vec()));
    assert_eq!(c.request("GET", "/rank_and_size/nohost", b"").await.0, 400);
    assert_eq!(c.request("PUT", "/rank_and_size/worker-0:0", b"1").await.0, 403);
}

#[tokio::test]
async fn a_new_round_answers_rank_and_size_from_its_own_plan() {
    let (server, mut c) = connected(&plan("a:2,b:2", 4)).await;
    assert_eq!(c.request("GET", "/rank_and_size/round", b"").await, (200, b"0".to_vec()));
    assert_eq!(c.request("PUT", "/global/0", b"old").await.0, 200);
    // host a is gone: b keeps its slots and becomes ranks 0 and 1
    server.set_round(3, &plan("b:2", 2));
    assert_eq!(c.request("GET", "/rank_and_size/round", b"").await, (200, b"3".to_vec()));
    assert_eq!(c.request("GET", "/rank_and_size/b:1", b"").await, (200, b"1,2,1,2,0,1".to_vec()));
    assert_eq!(c.request("GET", "/rank_and_size/a:0", b"").await, (200, b"-1,-1,-1,-1,-1,-1".to_vec()));
    // the old round's keys are gone, and the scopes are sized anew
    assert_eq!(c.request("GET", "/global/0", b"").await.0, 404);
    assert_eq!(c.request("PUT", "/global/0", b"x").await.0, 200);
    assert_eq!(c.request("PUT", "/global/1", b"y").await.0, 200);
    assert_eq!(c.request("DELETE", "/global/0", b"").await.0, 200);
    assert_eq!(c.request("DELETE", "/global/1", b"").await.0, 200);
    assert_eq!(c.request("GET", "/global/1", b"").await.0, 404);
    // where processes record the round they joined outlives rounds
    assert_eq!(c.request("PUT", "/kolo_elastic_joined/b:0", b"3").await.0, 200);
    server.set_round(4, &plan("b:2", 2));
    assert_eq!(server.value("kolo_elastic_joined", "b:0").as_deref(), Some(&b"3"[..]));
    assert_eq!(c.request("GET", "/kolo_elastic_joined/b:0", b"").await, (200, b"3".to_vec()));
    // a plain init (a restarted job) keeps the round number
    server.init(&plan("a:1", 1));
    assert_eq!(c.request("GET", "/rank_and_size/round", b"").await, (200, b"4".to_vec()));
}

#[tokio::test]
async fn secret_is_checked_when_presented_or_required() {
    let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap());
    config.secret = Some("s3cret".into());
    let server = RendezvousServer::start(config.clone(), &[]).await.unwrap();
    let mut c = Raw::connect(&server).await;
    // Horovod's C++ client presents nothing and is served
    assert_eq!(c.request("PUT", "/a/b", b"v").await.0, 200);
    let wrong = "GET /a/b HTTP/1.1\r\nHost: x\r\nx-kolo-secret: guess\r\n\r\n";
    assert_eq!(c.send(wrong, b"").await.0, 401);
    let right = "GET /a/b HTTP/1.1\r\nHost: x\r\nx-kolo-secret: s3cret\r\n\r\n";
    assert_eq!(c.send(right, b"").await, (200, b"v".to_vec()));

    config.require_secret = true;
    let strict = RendezvousServer::start(config, &[]).await.unwrap();
    let mut c = Raw::connect(&strict).await;
    assert_eq!(c.request("GET", "/a/b", b"").await.0, 401);
    let mut client_config = ClientConfig::new(strict.addr().to_string());
    client_config.secret = Some("s3cret".into());
    let client = Client::new(client_config.clone());
    client.put("a", "b", "v").await.unwrap();
    assert_eq!(client.get("a", "b").await.unwrap().as_deref(), Some(&b"v"[..]));
    client_config.secret = Some("nope".into());
    let err = Client::new(client_config).get("a", "b").await.unwrap_err().to_string();
    assert!(err.contains("401"), "{err}");
}

#[tokio::test]
async fn client_waits_for_keys_and_times_out_naming_them() {
    let server = server(&[]).await;
    let addr = server.addr().to_string();
    let client = Client::new(ClientConfig::new(addr.clone()));
    let writer = Client::new(ClientConfig::new(addr));
    let waiting = client.wait("global", &["0", "1"], Duration::from_secs(20));
    let writing = async {
        writer.put("global", "1", "one").await.unwrap();
        // the waiter is polling 404s for key 0 by now or soon
        while client.requests() < 3 {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        writer.put("global", "0", "zero").await.unwrap();
    };
    let (values, ()) = tokio::join!(waiting, writing);
    assert_eq!(values.unwrap(), vec![bytes::Bytes::from("zero"), bytes::Bytes::from("one")]);
    let err = client.wait("global", &["0", "7", "8"], Duration::from_millis(50)).await.unwrap_err().to_string();
    assert!(err.contains("[\"7\", \"8\"]") && err.contains("'global'"), "{err}");
}

#[tokio::test]
async fn client_reports_an_unreachable_server_after_its_attempts() {
    let addr = stopped_server_addr().await;
    let mut config = ClientConfig::new(addr.to_string());
    config.retry_delay = Duration::from_millis(10);
    let client = Client::new(config);
    let err = client.get("a", "b").await.unwrap_err().to_string();
    assert!(err.contains("3 attempts failed") && err.contains(&addr.to_string()), "{err}");
}

#[tokio::test]
async fn a_failed_request_keeps_the_underlying_error_as_its_source() {
    let addr = stopped_server_addr().await;
    let mut config = ClientConfig::new(addr.to_string());
    config.attempts = 1;
    let err = Client::new(config).put("a", "b", "v").await.unwrap_err();
    let source = std::error::Error::source(&err).expect("the connect error as source");
    let io = source.downcast_ref::<std::io::Error>().expect("an io::Error");
    assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused, "{io}");
    // a refusal by status has no underlying error
    let server = server(&[]).await;
    let err =
        Client::new(ClientConfig::new(server.addr().to_string())).put("rank_and_size", "x", "v").await.unwrap_err();
    assert!(err.to_string().contains("403") && std::error::Error::source(&err).is_none(), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_concurrent_keep_alive_connections() {
    let server = server(&[]).await;
    let addr = server.addr().to_string();
    let n = 2000;
    let clients: Vec<Client> = (0..n).map(|_| Client::new(ClientConfig::new(addr.clone()))).collect();
    // every client holds its connection open while all the others work
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    let tasks = clients.into_iter().enumerate().map(|(i, client)| {
        let barrier = barrier.clone();
        tokio::spawn(async move {
            client.put("many", &i.to_string(), i.to_string()).await.unwrap();
            barrier.wait().await;
            let other = (i + 1) % n;
            let value = client.get("many", &other.to_string()).await.unwrap().unwrap();
            assert_eq!(value, other.to_string());
            client.requests()
        })
    });
    let counts = futures_join_all(tasks.collect()).await;
    assert!(counts.iter().all(|&c| c == 2), "one connection, no retries: {counts:?}");
}

async fn futures_join_all(handles: Vec<tokio::task::JoinHandle<u64>>) -> Vec<u64> {
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test]
async fn store_bounds_answer_clearly_and_the_store_keeps_serving() {
    let mut config = config();
    config.max_body_bytes = 1000;
    config.max_store_bytes = 1000;
    config.max_path_bytes = 64;
    let server = RendezvousServer::start(config, &[]).await.unwrap();
    let long = format!("/s/{}", "k".repeat(62));
    for method in ["GET", "PUT", "DELETE"] {
        let (status, body) = Raw::once(&server, method, &long, b"v").await;
        assert_eq!(status, 414, "{method}");
        assert!(body.contains("65 bytes") && body.contains("max_path_bytes") && body.lines().count() == 1, "{body}");
    }
    // 64 bytes is fine; each key costs scope + key + value bytes
    assert_eq!(Raw::once(&server, "PUT", &long[..64], b"").await.0, 200);
    assert_eq!(Raw::once(&server, "DELETE", &long[..64], b"").await.0, 200);
    let mut c = Raw::connect(&server).await;
    assert_eq!(c.request("PUT", "/s/a", &[1; 400]).await.0, 200); // 402 held
    assert_eq!(c.request("PUT", "/s/a", &[2; 400]).await.0, 200); // overwritten: still 402
    assert_eq!(c.request("PUT", "/s/b", &[3; 400]).await.0, 200); // 804
    let (status, body) = Raw::once(&server, "PUT", "/s/c", &[4; 400]).await;
    assert_eq!(status, 507, "{body}");
    assert!(body.contains("store full") && body.contains("max_store_bytes") && body.lines().count() == 1, "{body}");
    let mut c = Raw::connect(&server).await;
    assert_eq!(c.request("GET", "/s/a", b"").await, (200, vec![2; 400]));
    assert_eq!(c.request("PUT", "/s/a", &[5; 100]).await.0, 200); // 504
    assert_eq!(c.request("PUT", "/s/c", &[6; 400]).await.0, 200); // 906
    assert_eq!(c.request("PUT", "/s/d", &[7; 92]).await.0, 200); // 1000: full to the byte
    assert_eq!(Raw::once(&server, "PUT", "/s/e", b"").await.0, 507);
    // deleting frees
    let mut c = Raw::connect(&server).await;
    assert_eq!(c.request("DELETE", "/s/b", b"").await.0, 200); // 598
    assert_eq!(c.request("PUT", "/s/e", &[8; 400]).await.0, 200); // 1000
    assert_eq!(c.request("GET", "/s/c", b"").await, (200, vec![6; 400]));
    // a value over the value limit is refused without reading it
    let head = "PUT /s/f HTTP/1.1\r\nHost: x\r\nContent-Length: 8388608\r\n\r\n";
    let (status, body) = Raw::connect(&server).await.send(head, b"").await;
    assert_eq!(status, 413);
    assert!(String::from_utf8_lossy(&body).contains("max_body_bytes"));
}

#[tokio::test]
async fn the_key_count_is_bounded_and_cleared_scopes_free_their_keys() {
    let mut config = config();
    config.max_keys = 3;
    let server = RendezvousServer::start(config, &plan("a:2", 2)).await.unwrap();
    let mut c = Raw::connect(&server).await;
    for key in ["/global/0", "/global/1", "/x/y"] {
        assert_eq!(c.request("PUT", key, b"v").await.0, 200, "{key}");
    }
    let (status, body) = Raw::once(&server, "PUT", "/x/z", b"v").await;
    assert_eq!(status, 507, "{body}");
    assert!(body.contains("3 keys") && body.contains("max_keys") && body.lines().count() == 1, "{body}");
    // overwriting adds no key
    let mut c = Raw::connect(&server).await;
    assert_eq!(c.request("PUT", "/x/y", b"w").await.0, 200);
    // a plan scope cleared by its last rank frees its keys
    assert_eq!(c.request("DELETE", "/global/0", b"").await.0, 200);
    assert_eq!(c.request("DELETE", "/global/1", b"").await.0, 200);
    assert_eq!(c.request("PUT", "/x/z", b"v").await.0, 200);
    assert_eq!(c.request("PUT", "/global/0", b"v").await.0, 200);
    assert_eq!(Raw::once(&server, "PUT", "/global/1", b"v").await.0, 507);
    // a new plan empties the store
    server.init(&plan("a:2", 2));
    let mut c = Raw::connect(&server).await;
    for key in ["/global/0", "/global/1", "/x/y"] {
        assert_eq!(c.request("PUT", key, b"v").await.0, 200, "{key}");
    }
}

#[tokio::test]
async fn a_slow_body_gets_408_and_its_reserved_bytes_back() {
    let mut config = config();
    config.body_timeout = Duration::from_millis(200);
    config.max_store_bytes = 1000;
    let server = RendezvousServer::start(config, &[]).await.unwrap();
    let mut slow = Raw::connect(&server).await;
    let head = "PUT /s/k HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n\r\n";
    let (status, body) = within(Duration::from_secs(10), "408", slow.send(head, b"only ten..")).await;
    assert_eq!(status, 408);
    let body = String::from_utf8(body).unwrap();
    assert!(body.contains("900 bytes") && body.contains("body_timeout") && body.lines().count() == 1, "{body}");
    assert!(within(Duration::from_secs(10), "close after 408", slow.closed()).await);
    // the 900 bytes set aside for it are free again, as they are for a
    // client that hangs up mid-body
    let mut gone = Raw::connect(&server).await;
    gone.reader.get_mut().write_all(head.as_bytes()).await.unwrap();
    gone.reader.get_mut().write_all(b"ten bytes.").await.unwrap();
    drop(gone);
    within(Duration::from_secs(10), "the store to have room again", async {
        while Raw::once(&server, "PUT", "/s/k", &[1; 900]).await.0 != 200 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert_eq!(Raw::connect(&server).await.request("GET", "/s/k", b"").await, (200, vec![1; 900]));
}

#[tokio::test]
async fn idle_connections_are_closed_before_and_between_requests() {
    let mut config = config();
    config.header_timeout = Duration::from_millis(200);
    let server = RendezvousServer::start(config, &[]).await.unwrap();
    let mut silent = Raw::connect(&server).await;
    let mut used = Raw::connect(&server).await;
    assert_eq!(used.request("PUT", "/s/k", b"v").await.0, 200);
    assert!(within(Duration::from_secs(10), "close a silent connection", silent.closed()).await);
    assert!(within(Duration::from_secs(10), "close an idle keep-alive connection", used.closed()).await);
}

#[tokio::test]
async fn connections_past_the_cap_get_503_and_the_others_keep_working() {
    let mut config = config();
    config.max_connections = 2;
    let server = RendezvousServer::start(config, &[]).await.unwrap();
    let mut a = Raw::connect(&server).await;
    let mut b = Raw::connect(&server).await;
    assert_eq!(a.request("PUT", "/s/a", b"1").await.0, 200);
    assert_eq!(b.request("PUT", "/s/b", b"2").await.0, 200);
    let mut over = Raw::connect(&server).await;
    let (status, body) = within(Duration::from_secs(10), "503", over.read_response()).await;
    assert_eq!(status, 503);
    let body = String::from_utf8(body).unwrap();
    assert!(body.contains("at most 2") && body.contains("max_connections") && body.lines().count() == 1, "{body}");
    assert!(over.closed().await);
    assert_eq!(a.request("GET", "/s/b", b"").await, (200, b"2".to_vec()));
    assert_eq!(b.request("GET", "/s/a", b"").await, (200, b"1".to_vec()));
    // a closed connection makes room
    drop(a);
    within(Duration::from_secs(10), "room for a new connection", async {
        loop {
            let mut c = Raw::connect(&server).await;
            let head = "GET /s/a HTTP/1.1\r\nHost: x\r\n\r\n";
            if c.reader.get_mut().write_all(head.as_bytes()).await.is_ok() && c.read_response().await.0 == 200 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

#[tokio::test]
async fn serving_resumes_once_slow_clients_holding_every_descriptor_time_out() {
    use nix::errno::Errno;
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let mut config = config();
    config.header_timeout = Duration::from_millis(300);
    config.body_timeout = Duration::from_millis(300);
    let server = RendezvousServer::start(config, &[]).await.unwrap();
    // nextest runs each test in a process of its own, so the limit is ours
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, 128.min(soft), hard).unwrap();
    // slow clients announce a body and never finish it, until the process
    // (clients and server alike) has no descriptor left; each goes away
    // once the server closes its connection
    let mut slow = tokio::task::JoinSet::new();
    loop {
        match TcpStream::connect(server.addr()).await {
            Ok(mut stream) => {
                let head = "PUT /slow/k HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nten bytes.";
                stream.write_all(head.as_bytes()).await.unwrap();
                slow.spawn(async move {
                    let mut answer = Vec::new();
                    let _ = stream.read_to_end(&mut answer).await;
                });
            }
            Err(e) if e.raw_os_error() == Some(Errno::EMFILE as i32) => break,
            Err(e) => panic!("connect failed: {e}"),
        }
        assert!(slow.len() < 1000, "never ran out of descriptors");
    }
    within(Duration::from_secs(20), "a PUT and GET once descriptors free up", async {
        let stream = loop {
            match TcpStream::connect(server.addr()).await {
                Ok(stream) => break stream,
                Err(e) if e.raw_os_error() == Some(Errno::EMFILE as i32) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => panic!("connect failed: {e}"),
            }
        };
        let mut c = Raw { reader: BufReader::new(stream) };
        assert_eq!(c.request("PUT", "/s/k", b"back").await.0, 200);
        assert_eq!(c.request("GET", "/s/k", b"").await, (200, b"back".to_vec()));
    })
    .await;
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
}

#[tokio::test]
async fn a_retried_delete_counts_once() {
    let (_server, mut c) = connected(&plan("a:2", 2)).await;
    assert_eq!(c.request("PUT", "/global/0", b"x").await.0, 200);
    assert_eq!(c.request("PUT", "/global/1", b"y").await.0, 200);
    assert_eq!(c.request("DELETE", "/global/0", b"").await.0, 200);
    assert_eq!(c.request("DELETE", "/global/0", b"").await.0, 200);
    assert_eq!(c.request("GET", "/global/1", b"").await, (200, b"y".to_vec()), "rank 1 has not finished");
    assert_eq!(c.request("DELETE", "/global/1", b"").await.0, 200);
    assert_eq!(c.request("GET", "/global/1", b"").await.0, 404);
}
