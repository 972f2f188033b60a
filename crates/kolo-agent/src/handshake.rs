//! Reaching the driver: dialling it, and the handshake that proves both
//! sides know the job's secret before anything else is said.

use std::io::{self, Write};
use std::net::TcpStream;
use std::time::Duration;

use kolo_proto::proto::{self, Challenge, HelloBody, HelloHeader, Welcome, MAGIC, PROTOCOL_VERSION};

/// Attempts to reach the driver, and the pause between them: a driver
/// that listens before it spawns is reached at once; these ride out a
/// network that is slow to come up (5 s in all).
pub(crate) const CONNECT_ATTEMPTS: u32 = 50;
pub(crate) const CONNECT_PAUSE: Duration = Duration::from_millis(100);

pub(crate) fn connect(driver: &str) -> io::Result<TcpStream> {
    let mut attempt = 1;
    loop {
        match TcpStream::connect(driver) {
            Ok(stream) => return Ok(stream),
            Err(e) if attempt >= CONNECT_ATTEMPTS => return Err(e),
            Err(_) => attempt += 1,
        }
        std::thread::sleep(CONNECT_PAUSE);
    }
}

pub(crate) fn handshake(stream: &mut TcpStream, index: u32, secret: &kolo_auth::Secret) -> Result<Welcome, String> {
    let challenge = Challenge::parse(&proto::read_frame(stream, proto::MAX_PREAUTH_FRAME).map_err(|e| e.to_string())?)
        .ok_or("not a kolo driver")?;
    if challenge.magic != MAGIC {
        return Err("not a kolo driver".into());
    }
    let nonce = kolo_auth::nonce();
    let body = HelloBody {
        hostname: real_hostname(),
        pid: std::process::id(),
        build_id: kolo_proto::registry::build_id(),
        interfaces: crate::nics::interface_names(),
    };
    let body = postcard::to_stdvec(&body).map_err(|e| e.to_string())?;
    let hello_proof = |role| proto::ControlProof {
        role,
        nonces: (&challenge.nonce, &nonce),
        version: PROTOCOL_VERSION,
        index,
        body: &body,
    };
    let header = HelloHeader {
        magic: MAGIC,
        version: PROTOCOL_VERSION,
        index,
        nonce,
        tag: hello_proof(proto::Role::Dialer).tag(secret),
    };
    stream.write_all(&proto::hello_frame(&header, &body)).map_err(|e| e.to_string())?;
    if challenge.version != PROTOCOL_VERSION {
        return Err(format!(
            "the driver speaks protocol version {}, this worker {PROTOCOL_VERSION}; use the same kolo version everywhere",
            challenge.version
        ));
    }
    let frame = proto::read_frame(stream, proto::MAX_PREAUTH_FRAME)
        .map_err(|e| format!("the driver refused this worker ({e})"))?;
    let welcome: Welcome = proto::decode(&frame).map_err(|e| e.to_string())?;
    if !hello_proof(proto::Role::Listener).verifies(secret, &welcome.tag) {
        return Err("the driver could not prove it knows the job secret".into());
    }
    Ok(welcome)
}

pub(crate) fn real_hostname() -> String {
    nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "localhost".into())
}
