//! The rendezvous server as workers and users meet it: from inside a job,
//! and as `kolo rendezvous` on its own.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Stdio;

use common::*;

/// A Gloo-like exchange in Python: every rank PUTs its value into the
/// `global` scope, polls until it has read everyone's, then DELETEs.
const GLOO_LIKE: &str = r#"
import os, http.client, time
addr, port = os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"], int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])
rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
conn = http.client.HTTPConnection(addr, port)
def req(method, path, body=None):
    conn.request(method, path, body=body)
    r = conn.getresponse()
    return r.status, r.read()
assert req("PUT", f"/global/{rank}", str(rank * 10).encode())[0] == 200
total = 0
for i in range(size):
    while True:
        status, data = req("GET", f"/global/{i}")
        if status == 200:
            total += int(data)
            break
        assert status == 404, status
        time.sleep(0.01)
assert req("DELETE", f"/global/{rank}")[0] == 200
print("sum", total)
"#;

#[test]
fn workers_rendezvous_on_the_jobs_server() {
    let out = run(&["run", "--engine", "local", "-np", "4", "-H", "a:2,b:2", "--", "python3", "-c", GLOO_LIKE]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let sums: Vec<&str> = text.lines().filter(|l| l.ends_with("sum 60")).collect();
    assert_eq!(sums.len(), 4, "{}", stdout(&out));
}

fn http(addr: &str, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n", body.len())
        .unwrap();
    s.write_all(body).unwrap();
    let mut response = Vec::new();
    s.read_to_end(&mut response).unwrap();
    let text = String::from_utf8_lossy(&response);
    let status = text[9..12].parse().unwrap();
    let body_at = text.find("\r\n\r\n").unwrap() + 4;
    (status, response[body_at..].to_vec())
}

#[test]
fn kolo_rendezvous_serves_until_stopped() {
    let mut server = kolo()
        .args(["rendezvous", "--bind", "127.0.0.1", "--port", "0", "--plan", "h1:2,h2:1"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(server.stdout.take().unwrap()).read_line(&mut first).unwrap();
    let addr = first.trim().to_string();
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    assert_eq!(http(&addr, "PUT", "/local_h1/k", b"v"), (200, vec![]));
    assert_eq!(http(&addr, "GET", "/local_h1/k", b""), (200, b"v".to_vec()));
    assert_eq!(http(&addr, "DELETE", "/local_h1/0", b"").0, 200);
    assert_eq!(http(&addr, "GET", "/local_h1/k", b"").0, 200);
    assert_eq!(http(&addr, "DELETE", "/local_h1/1", b"").0, 200);
    assert_eq!(http(&addr, "GET", "/local_h1/k", b"").0, 404);
    assert_eq!(http(&addr, "GET", "/rank_and_size/h2:0", b""), (200, b"2,3,0,1,1,2".to_vec()));
    assert_eq!(http(&addr, "GET", "/nokey", b"").0, 400);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(server.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(wait_within(&mut server, JOB_DEADLINE).success());
}

#[test]
fn kolo_rendezvous_rejects_bad_arguments() {
    let out = run(&["rendezvous", "--plan", "a:zero"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("host list 'a:zero'"), "{}", stderr(&out));
    let out = kolo().args(["rendezvous", "--require-secret"]).env_remove("KOLO_SECRET").output_within(JOB_DEADLINE);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("KOLO_SECRET"), "{}", stderr(&out));
}
