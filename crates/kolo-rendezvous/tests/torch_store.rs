//! The TCPStore server against clients speaking the bytes torch 2.15 sends
//! (docs/pytorch-store-protocol.md, whose section 9 these exchanges replay),
//! and against clients that break the protocol or its bounds.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use kolo_rendezvous::{TorchStoreConfig, TorchStoreServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MAGIC: u32 = 0x3C85_F7CE;

/// A request, encoded as torch's client does.
#[derive(Default)]
struct Req(Vec<u8>);

impl Req {
    fn new(kind: u8) -> Self {
        Req(vec![kind])
    }
    fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(&(b.len() as u64).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    fn u64(mut self, n: u64) -> Self {
        self.0.extend_from_slice(&n.to_le_bytes());
        self
    }
    fn u32(mut self, n: u32) -> Self {
        self.0.extend_from_slice(&n.to_le_bytes());
        self
    }
}

fn s(b: &[u8]) -> Vec<u8> {
    let mut v = (b.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(b);
    v
}

fn i64le(n: i64) -> Vec<u8> {
    n.to_le_bytes().to_vec()
}

async fn server() -> TorchStoreServer {
    TorchStoreServer::start(TorchStoreConfig::new("127.0.0.1:0".parse().unwrap())).await.unwrap()
}

/// A validated connection, as every torch client opens one.
async fn client(addr: SocketAddr) -> TcpStream {
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(&Req::new(0).u32(MAGIC).0).await.unwrap();
    c.write_all(&Req::new(13).u32(4242).0).await.unwrap();
    assert_eq!(read(&mut c, 4).await, 4242u32.to_le_bytes());
    c
}

async fn read(c: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    tokio::time::timeout(Duration::from_secs(10), c.read_exact(&mut buf)).await.expect("no reply").unwrap();
    buf
}

async fn ask(c: &mut TcpStream, req: Req, reply_len: usize) -> Vec<u8> {
    c.write_all(&req.0).await.unwrap();
    read(c, reply_len).await
}

/// The connection ends (the server closed it) without another byte.
async fn closed(c: &mut TcpStream) {
    let mut buf = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf)).await.expect("still open");
    assert!(matches!(n, Ok(0) | Err(_)), "got a byte instead of the end");
}

#[tokio::test]
async fn every_store_call_of_torch_answers_as_torchs_own_server() {
    let srv = server().await;
    let mut c = client(srv.addr()).await;
    // SET, then the WAIT + GET a torch get() sends
    c.write_all(&Req::new(1).bytes(b"/k").bytes(b"v1").0).await.unwrap();
    assert_eq!(ask(&mut c, Req::new(6).u64(1).bytes(b"/k"), 1).await, [0]);
    assert_eq!(ask(&mut c, Req::new(3).bytes(b"/k"), 10).await, s(b"v1"));
    assert_eq!(ask(&mut c, Req::new(4).bytes(b"/n").u64(5), 8).await, i64le(5));
    assert_eq!(ask(&mut c, Req::new(2).bytes(b"/k").bytes(b"v1").bytes(b"v2"), 10).await, s(b"v2"));
    assert_eq!(ask(&mut c, Req::new(5).u64(2).bytes(b"/k").bytes(b"/missing"), 1).await, [1]);
    assert_eq!(ask(&mut c, Req::new(7), 8).await, i64le(2));
    assert_eq!(ask(&mut c, Req::new(8).bytes(b"/n"), 8).await, i64le(1));
    assert_eq!(ask(&mut c, Req::new(8).bytes(b"/n"), 8).await, i64le(0));
    c.write_all(&Req::new(9).bytes(b"/k").bytes(b"++").0).await.unwrap();
    assert_eq!(ask(&mut c, Req::new(10).u64(1).bytes(b"/k"), 12).await, s(b"v2++"));
    c.write_all(&Req::new(11).u64(2).bytes(b"/a").bytes(b"1").bytes(b"/b").bytes(b"22").0).await.unwrap();
    assert_eq!(ask(&mut c, Req::new(10).u64(2).bytes(b"/a").bytes(b"/b"), 19).await, [s(b"1"), s(b"22")].concat());
    // a wait that times out: the client cancels and must read 01
    c.write_all(&Req::new(6).u64(1).bytes(b"/never").0).await.unwrap();
    assert_eq!(ask(&mut c, Req::new(12), 1).await, [1]);
    // a cancel with nothing pending is still answered 01
    assert_eq!(ask(&mut c, Req::new(12), 1).await, [1]);
    // queues
    c.write_all(&Req::new(14).bytes(b"/q").bytes(b"x").0).await.unwrap();
    assert_eq!(ask(&mut c, Req::new(16).bytes(b"/q"), 8).await, i64le(1));
    assert_eq!(ask(&mut c, Req::new(6).u64(1).bytes(b"/q"), 1).await, [0]);
    assert_eq!(ask(&mut c, Req::new(15).bytes(b"/q"), 17).await, [i64le(1), s(b"x")].concat());
    assert_eq!(ask(&mut c, Req::new(15).bytes(b"/q"), 8).await, i64le(0));
    // list keys: /k /a /b, any order
    let head = ask(&mut c, Req::new(17), 8).await;
    assert_eq!(head, i64le(3));
    let mut keys = HashSet::new();
    for _ in 0..3 {
        let len = u64::from_le_bytes(read(&mut c, 8).await.try_into().unwrap()) as usize;
        keys.insert(read(&mut c, len).await);
    }
    assert_eq!(keys, [b"/k".to_vec(), b"/a".to_vec(), b"/b".to_vec()].into_iter().collect());
    assert_eq!(ask(&mut c, Req::new(18).bytes(b"/bar").u64(1), 1).await, [0]);
    // compare-set on a missing key with a non-empty expectation answers it
    assert_eq!(ask(&mut c, Req::new(2).bytes(b"/none").bytes(b"e").bytes(b"d"), 9).await, s(b"e"));
    srv.stop().await;
}

#[tokio::test]
async fn waits_and_barriers_release_when_other_clients_arrive() {
    let srv = server().await;
    let (mut a, mut b) = (client(srv.addr()).await, client(srv.addr()).await);
    // a waits for two keys; b sets them one by one
    a.write_all(&Req::new(6).u64(2).bytes(b"/x").bytes(b"/y").0).await.unwrap();
    b.write_all(&Req::new(1).bytes(b"/x").bytes(b"1").0).await.unwrap();
    assert_eq!(ask(&mut b, Req::new(5).u64(1).bytes(b"/x"), 1).await, [0]);
    let mut early = [0u8; 1];
    assert!(tokio::time::timeout(Duration::from_millis(200), a.read(&mut early)).await.is_err(), "woke too early");
    assert_eq!(ask(&mut b, Req::new(4).bytes(b"/y").u64(1), 8).await, i64le(1));
    assert_eq!(read(&mut a, 1).await, [0]);
    // a barrier of two: the first waits for the second
    a.write_all(&Req::new(18).bytes(b"/bar").u64(2).0).await.unwrap();
    b.write_all(&Req::new(18).bytes(b"/bar").u64(2).0).await.unwrap();
    assert_eq!(read(&mut a, 1).await, [0]);
    assert_eq!(read(&mut b, 1).await, [0]);
    // torch's init/ counter, as every rank's client adds itself
    for (c, n) in [(&mut a, 1), (&mut b, 2)] {
        assert_eq!(ask(c, Req::new(4).bytes(b"init/").u64(1), 8).await, i64le(n));
    }
    srv.stop().await;
}

#[tokio::test]
async fn requests_split_across_packets_and_several_in_one_are_both_read() {
    let srv = server().await;
    let mut c = client(srv.addr()).await;
    let set = Req::new(1).bytes(b"/slow").bytes(&[7u8; 100_000]).0;
    for part in set.chunks(1440) {
        c.write_all(part).await.unwrap();
        c.flush().await.unwrap();
    }
    let mut many = Vec::new();
    for i in 0..50u8 {
        many.extend_from_slice(&Req::new(1).bytes(&[b'/', i]).bytes(&[i]).0);
    }
    many.extend_from_slice(&Req::new(7).0);
    c.write_all(&many).await.unwrap();
    assert_eq!(read(&mut c, 8).await, i64le(51));
    let value = ask(&mut c, Req::new(3).bytes(b"/slow"), 8 + 100_000).await;
    assert_eq!(&value[8..], &[7u8; 100_000][..]);
    srv.stop().await;
}

#[tokio::test]
async fn garbage_and_broken_rules_close_only_that_connection() {
    let srv = server().await;
    let mut good = client(srv.addr()).await;
    // no VALIDATE first
    let mut c = TcpStream::connect(srv.addr()).await.unwrap();
    c.write_all(&Req::new(1).bytes(b"/k").bytes(b"v").0).await.unwrap();
    closed(&mut c).await;
    // wrong magic
    let mut c = TcpStream::connect(srv.addr()).await.unwrap();
    c.write_all(&Req::new(0).u32(0xdead_beef).0).await.unwrap();
    closed(&mut c).await;
    // an unknown request type
    let mut c = client(srv.addr()).await;
    c.write_all(&[200]).await.unwrap();
    closed(&mut c).await;
    // ADD to text
    let mut c = client(srv.addr()).await;
    c.write_all(&Req::new(1).bytes(b"/t").bytes(b"text").0).await.unwrap();
    c.write_all(&Req::new(4).bytes(b"/t").u64(1).0).await.unwrap();
    closed(&mut c).await;
    // random bytes
    let mut c = TcpStream::connect(srv.addr()).await.unwrap();
    let noise: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let _ = c.write_all(&noise).await;
    closed(&mut c).await;
    // the well-behaved client never noticed
    assert_eq!(ask(&mut good, Req::new(4).bytes(b"/n").u64(2), 8).await, i64le(2));
    srv.stop().await;
}

#[tokio::test]
async fn bounds_on_keys_values_the_store_and_slow_requests() {
    let mut config = TorchStoreConfig::new("127.0.0.1:0".parse().unwrap());
    config.max_store_bytes = 1 << 20;
    config.max_keys = 100;
    config.request_timeout = Duration::from_millis(300);
    let srv = TorchStoreServer::start(config).await.unwrap();
    // a key over 8 KiB: closed before its bytes are taken in
    let mut c = client(srv.addr()).await;
    c.write_all(&Req::new(3).u64(9 << 10).0).await.unwrap();
    closed(&mut c).await;
    // a value announcing 1 TiB
    let mut c = client(srv.addr()).await;
    c.write_all(&Req::new(1).bytes(b"/k").u64(1 << 40).0).await.unwrap();
    closed(&mut c).await;
    // a WAIT on 2^60 keys
    let mut c = client(srv.addr()).await;
    c.write_all(&Req::new(6).u64(1 << 60).0).await.unwrap();
    closed(&mut c).await;
    // the store's bytes: 900 KiB fits, 200 KiB more does not
    let mut c = client(srv.addr()).await;
    c.write_all(&Req::new(1).bytes(b"/big").bytes(&vec![1u8; 900 << 10]).0).await.unwrap();
    assert_eq!(ask(&mut c, Req::new(5).u64(1).bytes(b"/big"), 1).await, [0]);
    let mut d = client(srv.addr()).await;
    let _ = d.write_all(&Req::new(1).bytes(b"/more").bytes(&vec![1u8; 200 << 10]).0).await;
    closed(&mut d).await;
    // overwriting frees the old value's bytes
    c.write_all(&Req::new(1).bytes(b"/big").bytes(b"small").0).await.unwrap();
    c.write_all(&Req::new(1).bytes(b"/more").bytes(&vec![1u8; 200 << 10]).0).await.unwrap();
    assert_eq!(ask(&mut c, Req::new(7), 8).await, i64le(2));
    // the number of keys
    for i in 0..98u32 {
        c.write_all(&Req::new(1).bytes(format!("/{i}").as_bytes()).bytes(b"v").0).await.unwrap();
    }
    assert_eq!(ask(&mut c, Req::new(7), 8).await, i64le(100));
    c.write_all(&Req::new(1).bytes(b"/one-more").bytes(b"v").0).await.unwrap();
    closed(&mut c).await;
    // a request that stops halfway is timed out
    let mut e = client(srv.addr()).await;
    e.write_all(&Req::new(1).bytes(b"/half").u64(100).0).await.unwrap();
    e.write_all(&[0u8; 10]).await.unwrap();
    closed(&mut e).await;
    // and the server still serves
    let mut f = client(srv.addr()).await;
    assert_eq!(ask(&mut f, Req::new(7), 8).await, i64le(100));
    srv.stop().await;
}

#[tokio::test]
async fn only_the_jobs_hosts_may_connect() {
    let mut config = TorchStoreConfig::new("127.0.0.1:0".parse().unwrap());
    config.allowed_peers = Some(["10.0.0.1".parse().unwrap()].into_iter().collect());
    let srv = TorchStoreServer::start(config).await.unwrap();
    let mut c = TcpStream::connect(srv.addr()).await.unwrap();
    let _ = c.write_all(&Req::new(0).u32(MAGIC).0).await;
    closed(&mut c).await;
    // a host the job takes in later (an elastic job's new cohort)
    srv.allow(["127.0.0.1".parse().unwrap()]);
    let mut d = client(srv.addr()).await;
    d.write_all(&Req::new(1).bytes(b"/in").bytes(b"1").0).await.unwrap();
    assert_eq!(ask(&mut d, Req::new(7), 8).await, i64le(1));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_clients_wait_on_one_key() {
    let srv = server().await;
    let mut waiters = Vec::new();
    for _ in 0..1000 {
        let mut c = client(srv.addr()).await;
        c.write_all(&Req::new(6).u64(1).bytes(b"/go").0).await.unwrap();
        waiters.push(c);
    }
    let mut setter = client(srv.addr()).await;
    setter.write_all(&Req::new(1).bytes(b"/go").bytes(b"1").0).await.unwrap();
    for c in &mut waiters {
        assert_eq!(read(c, 1).await, [0]);
    }
    srv.stop().await;
}
