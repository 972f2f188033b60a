//! Workers and strangers that do not follow the protocol: a wrong secret,
//! a future protocol version, another build, connections without the
//! secret. Each is refused with the reason named, and changes nothing.

use super::*;
use kolo_agent::env as worker_env;
use kolo_engine::{Engine, WorkerLaunch};
use kolo_sys::Guard;
use kolo_topology::HostResources;

/// How the last worker misbehaves.
#[derive(Clone, Copy, PartialEq)]
enum Mischief {
    /// It is started with a wrong secret.
    WrongSecret,
    /// A fake that knows the secret but speaks a future protocol version.
    FutureVersion,
    /// A fake that knows the secret but is another build of the program.
    OtherBuild,
    /// Every worker is real; strangers without the secret also connect.
    Strangers,
}

struct Tampering {
    inner: LocalEngine,
    mischief: Mischief,
}

impl Engine for Tampering {
    fn name(&self) -> &'static str {
        "tampering"
    }
    fn hosts(&mut self, timeout: Duration) -> Result<Vec<HostResources>, ExecError> {
        self.inner.hosts(timeout)
    }
    fn driver_addr(&self) -> std::net::IpAddr {
        self.inner.driver_addr()
    }
    fn default_nics(&self) -> Vec<String> {
        self.inner.default_nics()
    }
    fn spawn(&mut self, mut workers: Vec<WorkerLaunch>, janitor: &Guard) -> Result<(), ExecError> {
        let last = workers.last_mut().unwrap();
        let driver = last.env.iter().find(|(k, _)| k == worker_env::DRIVER).unwrap().1.clone();
        let (index, secret) = (last.index, last.secret.clone());
        match self.mischief {
            Mischief::WrongSecret => last.secret = "not-the-secret".into(),
            Mischief::FutureVersion => {
                workers.pop();
                std::thread::spawn(move || fake_worker(&driver, index, &secret, 999, "kolo test build"));
            }
            Mischief::OtherBuild => {
                workers.pop();
                std::thread::spawn(move || fake_worker(&driver, index, &secret, kolo_proto::PROTOCOL_VERSION, "other"));
            }
            Mischief::Strangers => {
                // the last worker starts only after the strangers had their go
                let last = workers.pop().unwrap();
                let hosts = vec![HostSpec::new(last.host.hostname.clone(), 4)];
                std::thread::spawn(move || {
                    strangers(&driver, index);
                    let mut late = LocalEngine::with_hosts(hosts);
                    let guard = Guard::spawn(kolo_sys::GuardOptions { grace: Duration::ZERO, silence: None }).unwrap();
                    late.spawn(vec![last], &guard).unwrap();
                    // keep the late worker's engine until the test process ends
                    std::mem::forget((late, guard));
                });
            }
        }
        self.inner.spawn(workers, janitor)
    }
    fn exited(&mut self) -> Vec<(u32, String)> {
        // the refused worker exits; keep waiting so the driver's view is tested
        Vec::new()
    }
    fn all_exited(&mut self) -> bool {
        self.inner.all_exited()
    }
    fn kill_all(&mut self) {
        self.inner.kill_all()
    }
}

/// The worker's first frame as the protocol defines it: a fixed header
/// (magic, version, index, nonce, HMAC tag) and a postcard body.
fn hello(challenge: &[u8], index: u32, secret: &[u8], version: u32, build: &str) -> Vec<u8> {
    let driver_nonce: [u8; 32] = challenge[8..40].try_into().unwrap();
    let nonce = [7u8; 32];
    let mut body = Vec::new();
    let text = |t: &str, out: &mut Vec<u8>| {
        out.push(t.len() as u8);
        out.extend_from_slice(t.as_bytes());
    };
    text("fake-host", &mut body);
    body.push(1); // pid 1 (a varint)
    text(build, &mut body);
    body.push(0); // no interfaces
                  // the control context kolo-auth's tag binds: version, index, body
    let mut context = b"kolo-control".to_vec();
    context.extend_from_slice(&version.to_be_bytes());
    context.extend_from_slice(&index.to_be_bytes());
    context.extend_from_slice(&body);
    let secret = kolo_auth::Secret::new(String::from_utf8(secret.to_vec()).unwrap()).unwrap();
    let tag = kolo_auth::tag(&secret, &context, kolo_auth::Role::Dialer, &driver_nonce, &nonce);
    let mut frame = Vec::new();
    frame.extend_from_slice(&((76 + body.len()) as u32).to_be_bytes());
    frame.extend_from_slice(&0x6b6f_6c6fu32.to_be_bytes());
    frame.extend_from_slice(&version.to_be_bytes());
    frame.extend_from_slice(&index.to_be_bytes());
    frame.extend_from_slice(&nonce);
    frame.extend_from_slice(&tag);
    frame.extend_from_slice(&body);
    frame
}

fn read_challenge(s: &mut TcpStream) -> Vec<u8> {
    use std::io::Read;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut challenge = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut challenge).unwrap();
    challenge
}

/// A worker that knows the secret but is of another version or build.
fn fake_worker(driver: &str, index: u32, secret: &str, version: u32, build: &str) {
    use std::io::{Read, Write};
    let mut s = TcpStream::connect(driver).unwrap();
    let challenge = read_challenge(&mut s);
    s.write_all(&hello(&challenge, index, secret.as_bytes(), version, build)).unwrap();
    let _ = s.read(&mut [0u8; 4]);
}

/// Peers without the secret: a hello of a future version with a made-up
/// tag, garbage, a frame that announces 256 MiB, and silence. None may
/// change the job.
fn strangers(driver: &str, index: u32) {
    use std::io::{Read, Write};
    let mut future = TcpStream::connect(driver).unwrap();
    let challenge = read_challenge(&mut future);
    future.write_all(&hello(&challenge, index, b"a guess", 2 + 1000, "x")).unwrap();
    let mut garbage = TcpStream::connect(driver).unwrap();
    read_challenge(&mut garbage);
    garbage.write_all(&[0, 0, 0, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
    let mut huge = TcpStream::connect(driver).unwrap();
    read_challenge(&mut huge);
    huge.write_all(&(256u32 << 20).to_be_bytes()).unwrap();
    // the driver hangs up on the huge frame at once, having buffered nothing
    huge.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let closed = match huge.read(&mut [0u8; 1]) {
        Ok(0) => true,
        Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
        Ok(_) => false,
    };
    HUGE_FRAME_REFUSED.store(closed, std::sync::atomic::Ordering::SeqCst);
    // a silent one stays connected while the job starts
    std::mem::forget(TcpStream::connect(driver).unwrap());
}

static HUGE_FRAME_REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Two workers on one node, the last one up to `mischief`.
fn tampered(settings: Settings, mischief: Mischief) -> Result<Executor, ExecError> {
    let engine = Tampering { inner: LocalEngine::with_hosts(vec![HostSpec::new("node", 4)]), mischief };
    Executor::with_engine(settings, WorkerRequest::pack(2), Box::new(engine))
}

pub(crate) async fn a_wrong_secret_is_refused() -> Result<(), Failed> {
    let mut settings = quick_settings();
    settings.start_timeout = Duration::from_secs(2);
    let mut ex = tampered(settings, Mischief::WrongSecret)?;
    let err = ex.start::<Counter>(&0, &[]).await.unwrap_err().to_string();
    check(err.contains("worker 1 on host node"), err)
}

pub(crate) async fn a_protocol_version_mismatch_is_named() -> Result<(), Failed> {
    let mut ex = tampered(quick_settings(), Mischief::FutureVersion)?;
    let err = ex.start::<Counter>(&0, &[]).await.unwrap_err().to_string();
    check(err.contains("protocol version 999") && err.contains("same kolo version"), err)
}

pub(crate) async fn another_build_of_the_worker_program_is_named() -> Result<(), Failed> {
    let mut ex = tampered(quick_settings(), Mischief::OtherBuild)?;
    let err = ex.start::<Counter>(&0, &[]).await.unwrap_err().to_string();
    check(err.contains("another build (other)") && err.contains("--worker-program"), err)
}

pub(crate) async fn strangers_without_the_secret_change_nothing() -> Result<(), Failed> {
    let mut ex = tampered(quick_settings(), Mischief::Strangers)?;
    ex.start::<Counter>(&1, &[]).await?;
    let got = ex.execute(&Add(1)).await?;
    check(got == vec![(0, 2), (1, 2)], format!("{got:?}"))?;
    ex.shutdown().await;
    check(
        HUGE_FRAME_REFUSED.load(std::sync::atomic::Ordering::SeqCst),
        "the driver kept a connection that announced a 256 MiB frame",
    )
}
