//! The control protocol between the driver and its worker agents.
//!
//! Frames are a 4-byte big-endian length and a postcard-encoded message.
//! A connection opens with a handshake that proves both sides know the
//! job's secret: the driver sends a nonce, the worker answers with
//! HMAC-SHA256(secret, "worker" | driver nonce | worker nonce) and its own
//! nonce, and the driver proves itself with HMAC(secret, "driver" | ...).
//! The worker's first frame starts with a fixed binary header (magic,
//! version, index, nonce, tag) so that the driver checks the tag before it
//! trusts anything else in it, whatever version the peer speaks: an
//! unauthenticated peer cannot make the driver fail the job. Before a peer
//! has proved the secret its frames are at most [`MAX_PREAUTH_FRAME`].

use std::io::{self, Read};

pub use kolo_auth::Role;
use kolo_auth::Secret;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// Bumped whenever a message changes shape.
pub const PROTOCOL_VERSION: u32 = 5;
/// Frames larger than this are refused (a task's arguments or result).
pub const MAX_FRAME: usize = 256 << 20;
/// Frames before authentication are at most this: nobody can make the
/// driver buffer more without the secret.
pub const MAX_PREAUTH_FRAME: usize = 4096;
/// Sent first on every connection so that a stray client is recognised.
pub const MAGIC: u32 = 0x6b6f_6c6f; // "kolo"

pub use kolo_auth::{Nonce, Tag};

/// Driver → worker, first frame: fixed layout, the same in every version.
#[derive(Debug, Clone)]
pub struct Challenge {
    pub magic: u32,
    pub version: u32,
    pub nonce: Nonce,
}

impl Challenge {
    pub fn frame(&self) -> Vec<u8> {
        let mut f = Vec::with_capacity(44);
        f.extend_from_slice(&40u32.to_be_bytes());
        f.extend_from_slice(&self.magic.to_be_bytes());
        f.extend_from_slice(&self.version.to_be_bytes());
        f.extend_from_slice(&self.nonce);
        f
    }

    pub fn parse(body: &[u8]) -> Option<Challenge> {
        let body: &[u8; 40] = body.try_into().ok()?;
        Some(Challenge {
            magic: u32::from_be_bytes(body[0..4].try_into().ok()?),
            version: u32::from_be_bytes(body[4..8].try_into().ok()?),
            nonce: body[8..40].try_into().ok()?,
        })
    }
}

/// Worker → driver, the fixed start of the first frame.
#[derive(Debug, Clone)]
pub struct HelloHeader {
    pub magic: u32,
    pub version: u32,
    pub index: u32,
    pub nonce: Nonce,
    /// [`worker_tag`] over the nonces, version, index and body.
    pub tag: Tag,
}

const HELLO_HEADER: usize = 4 + 4 + 4 + 32 + 32;

/// Worker → driver, the rest of the first frame (postcard; trusted only
/// once the header's tag checked out).
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct HelloBody {
    /// The host name the worker really runs on.
    pub hostname: String,
    pub pid: u32,
    /// The program's build (version and what it registered).
    pub build_id: String,
    /// This host's interface names (for checking `--nics`).
    pub interfaces: Vec<String>,
}

/// The worker's first frame: header then body.
pub fn hello_frame(header: &HelloHeader, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(4 + HELLO_HEADER + body.len());
    f.extend_from_slice(&((HELLO_HEADER + body.len()) as u32).to_be_bytes());
    f.extend_from_slice(&header.magic.to_be_bytes());
    f.extend_from_slice(&header.version.to_be_bytes());
    f.extend_from_slice(&header.index.to_be_bytes());
    f.extend_from_slice(&header.nonce);
    f.extend_from_slice(&header.tag);
    f.extend_from_slice(body);
    f
}

/// Splits a first frame into its header and (unchecked) body.
pub fn parse_hello(frame: &[u8]) -> Option<(HelloHeader, &[u8])> {
    if frame.len() < HELLO_HEADER {
        return None;
    }
    let word = |at: usize| u32::from_be_bytes(frame[at..at + 4].try_into().expect("4 bytes"));
    let header = HelloHeader {
        magic: word(0),
        version: word(4),
        index: word(8),
        nonce: frame[12..44].try_into().ok()?,
        tag: frame[44..76].try_into().ok()?,
    };
    Some((header, &frame[HELLO_HEADER..]))
}

/// Driver → worker, answers a good Hello.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct Welcome {
    pub tag: Tag,
    pub heartbeat_interval_ms: u64,
    pub heartbeat_timeout_ms: u64,
    /// Between SIGTERM and SIGKILL when the worker stops its command.
    pub kill_grace_ms: u64,
}

/// What a call runs on the worker.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// A task on the worker's executable.
    Task,
    /// A plain function.
    Function,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub enum ToWorker {
    Heartbeat,
    /// Overlaid on the worker's environment (and the command's).
    SetEnv(Vec<(String, String)>),
    /// Run an OS command as the executable (what `kolo run` does).
    StartCommand {
        argv: Vec<Vec<u8>>,
    },
    /// Send a signal to the command's process group.
    SignalCommand {
        signal: i32,
    },
    /// Create the Rust executable registered under `name`.
    Create {
        name: String,
        args: Vec<u8>,
    },
    Call {
        id: u64,
        kind: CallKind,
        name: String,
        args: Vec<u8>,
    },
    /// Skip this call if it has not started; drop its result otherwise.
    Cancel {
        id: u64,
    },
    /// Stop the executable and exit.
    Stop,
    /// Open a listener for interface probes and list this host's interfaces.
    ProbeListen,
    /// The probes are over: close that listener.
    ProbeDone,
    /// Whose is the TCP connection from `client` (on the agent's host) to
    /// the driver's `server`? Asked for each connection to the job's
    /// stores from that host; answered at once, even during a call.
    WhoOwns {
        id: u64,
        client: std::net::SocketAddr,
        server: std::net::SocketAddr,
    },
    /// Find `count` ports free on this host (rank 0's: the frameworks'
    /// coordinators listen there) and list its interfaces.
    ReservePorts {
        count: u8,
    },
    /// What the rank does now (`kolo status`, `kolo stack`): its process's
    /// state and use, with `stacks` its threads' stacks too. Answered off
    /// the thread that reads these, even during a call.
    Inspect {
        id: u64,
        stacks: bool,
        /// Where the asking user's py-spy is, tried first (a shared
        /// virtualenv is often at the same path on every host).
        py_spy: Option<String>,
    },
    /// Probe these (interface, address, port) of worker `index`'s listener.
    Probe {
        index: u32,
        targets: Vec<(String, String, u16)>,
        timeout_ms: u64,
    },
}

/// A rank's process as its agent sees it.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct RankSample {
    pub pid: u32,
    /// `running`, `sleeping`, `stopped`, `zombie`, `disk-wait`, ...
    pub state: String,
    /// Over the agent's last heartbeat interval.
    pub cpu_percent: Option<f64>,
    pub rss_bytes: u64,
    /// Every thread's stack, as `kolo stack` prints it, or why there is none.
    pub stacks: Option<String>,
    /// What the rank's Python hook counted, where it runs.
    pub progress: Option<Progress>,
    /// Its GPUs' utilisation (the busiest) and the memory it holds, where NVML is.
    pub gpu_percent: Option<f64>,
    pub gpu_memory_bytes: Option<u64>,
    /// The last stall warning of the rank's Horovod core, where it has one.
    #[serde(default)]
    pub stall: Option<String>,
}

/// A rank's collectives and steps, as its Python hook counts them in its
/// progress file (`KOLO_PROGRESS_FILE`).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// Collectives called, and of those returned.
    pub entered: u64,
    pub done: u64,
    /// Nanoseconds spent inside collective calls.
    pub wait_ns: u64,
    /// Optimizer steps.
    pub steps: u64,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub enum ToDriver {
    Heartbeat,
    /// The answer to `WhoOwns`: the connection is the job user's, or why not.
    SocketOwner {
        id: u64,
        answer: Result<(), String>,
    },
    Output {
        stderr: bool,
        data: Vec<u8>,
    },
    CommandStarted {
        pid: u32,
    },
    CommandStartFailed {
        message: String,
        code: i32,
    },
    /// The command failed and left an error report (PyTorch's error file,
    /// written by `@record`): the exception and its traceback. Sent before
    /// `CommandExited`.
    CommandError {
        message: String,
        traceback: String,
    },
    /// The command ended: its exit code, or the signal that killed it.
    CommandExited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    Created {
        result: Result<(), String>,
    },
    Done {
        id: u64,
        result: Result<Vec<u8>, String>,
    },
    /// A value the running call `id` reports (callbacks), before its `Done`.
    Report {
        id: u64,
        data: Vec<u8>,
    },
    /// The probe listener's port and this host's interfaces with their IPv4 addresses.
    PortsReserved {
        ports: Vec<u16>,
        interfaces: Vec<(String, Vec<String>)>,
    },
    ProbeReady {
        port: u16,
        interfaces: Vec<(String, Vec<String>)>,
    },
    /// The answer to `Inspect`.
    Inspected {
        id: u64,
        answer: Result<RankSample, String>,
    },
    /// Per target (interface, address): `None` when the probe got through
    /// on the interface of that name, else why not.
    ProbeResult {
        results: Vec<(String, String, Option<String>)>,
    },
}

/// What the control handshake's tags bind besides the nonces: the
/// protocol version, the worker's index and the rest of its first frame.
fn control_context(version: u32, index: u32, body: &[u8]) -> Vec<u8> {
    let mut context = Vec::with_capacity(20 + body.len());
    context.extend_from_slice(b"kolo-control");
    context.extend_from_slice(&version.to_be_bytes());
    context.extend_from_slice(&index.to_be_bytes());
    context.extend_from_slice(body);
    context
}

/// A control handshake proof: the worker's is kolo-auth's dialer tag over
/// the control context, the driver's the listener tag, given only to a
/// worker that proved itself.
pub fn control_tag(
    secret: &Secret,
    role: Role,
    nonces: (&Nonce, &Nonce),
    version: u32,
    index: u32,
    body: &[u8],
) -> Tag {
    let (driver_nonce, worker_nonce) = nonces;
    kolo_auth::tag(secret, &control_context(version, index, body), role, driver_nonce, worker_nonce)
}

/// Whether `claimed` is `role`'s control proof (compared in constant time
/// by kolo-auth).
pub fn control_verifies(
    secret: &Secret,
    role: Role,
    nonces: (&Nonce, &Nonce),
    version: u32,
    index: u32,
    body: &[u8],
    claimed: &Tag,
) -> bool {
    let (driver_nonce, worker_nonce) = nonces;
    kolo_auth::verify(secret, &control_context(version, index, body), role, driver_nonce, worker_nonce, claimed)
}

pub fn encode<T: Serialize>(message: &T) -> io::Result<Vec<u8>> {
    let body = postcard::to_stdvec(message).map_err(io::Error::other)?;
    if body.len() > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("message of {} bytes is over the {MAX_FRAME}-byte frame limit", body.len()),
        ));
    }
    let mut frame = Vec::with_capacity(body.len() + 4);
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

pub fn decode<T: DeserializeOwned>(body: &[u8]) -> io::Result<T> {
    postcard::from_bytes(body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("bad message: {e}")))
}

fn check_length(len: usize, max: usize) -> io::Result<usize> {
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes is over the limit of {max} bytes"),
        ));
    }
    Ok(len)
}

/// Blocking frame I/O, for the worker agent; frames over `max` are refused.
pub fn read_frame(r: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let mut body = vec![0u8; check_length(u32::from_be_bytes(len) as usize, max)?];
    r.read_exact(&mut body)?;
    Ok(body)
}

/// Async frame reading, for the driver; frames over `max` are refused.
pub async fn read_frame_async(r: &mut (impl tokio::io::AsyncRead + Unpin), max: usize) -> io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let mut body = vec![0u8; check_length(u32::from_be_bytes(len) as usize, max)?];
    r.read_exact(&mut body).await?;
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_header_parses_whatever_follows() {
        let header = HelloHeader { magic: MAGIC, version: 9, index: 3, nonce: [1; 32], tag: [2; 32] };
        let frame = hello_frame(&header, b"anything at all");
        let body = read_frame(&mut &frame[..], MAX_PREAUTH_FRAME).unwrap();
        let (parsed, rest) = parse_hello(&body).unwrap();
        assert_eq!((parsed.magic, parsed.version, parsed.index), (MAGIC, 9, 3));
        assert_eq!((parsed.nonce, parsed.tag), ([1; 32], [2; 32]));
        assert_eq!(rest, b"anything at all");
        assert!(parse_hello(&body[..10]).is_none());
        let c = Challenge { magic: MAGIC, version: 2, nonce: [7; 32] };
        let parsed = Challenge::parse(&c.frame()[4..]).unwrap();
        assert_eq!((parsed.magic, parsed.version, parsed.nonce), (MAGIC, 2, [7; 32]));
    }

    #[test]
    fn frames_round_trip_and_are_bounded() {
        let msg = ToWorker::Call { id: 7, kind: CallKind::Task, name: "t".into(), args: vec![1, 2, 3] };
        let frame = encode(&msg).unwrap();
        let body = read_frame(&mut &frame[..], MAX_FRAME).unwrap();
        match decode::<ToWorker>(&body).unwrap() {
            ToWorker::Call { id, args, .. } => assert_eq!((id, args), (7, vec![1, 2, 3])),
            other => panic!("{other:?}"),
        }
        let huge = ((MAX_FRAME + 1) as u32).to_be_bytes();
        assert!(read_frame(&mut &huge[..], MAX_FRAME).unwrap_err().to_string().contains("over the limit"));
        let big = ((MAX_PREAUTH_FRAME + 1) as u32).to_be_bytes();
        assert!(read_frame(&mut &big[..], MAX_PREAUTH_FRAME).is_err());
        assert!(decode::<ToWorker>(&[250, 1]).is_err());
    }

    #[test]
    fn tags_depend_on_secret_role_and_nonces() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let (s, x) = (Secret::new("s").unwrap(), Secret::new("x").unwrap());
        let t = control_tag(&s, Role::Dialer, (&a, &b), 2, 0, b"body");
        let dialer = |s: &Secret, n: (&Nonce, &Nonce), version, index, body: &[u8]| {
            control_verifies(s, Role::Dialer, n, version, index, body, &t)
        };
        assert!(dialer(&s, (&a, &b), 2, 0, b"body"));
        assert!(!dialer(&x, (&a, &b), 2, 0, b"body"));
        assert!(!control_verifies(&s, Role::Listener, (&a, &b), 2, 0, b"body", &t));
        assert!(!dialer(&s, (&b, &a), 2, 0, b"body"));
        assert!(!dialer(&s, (&a, &b), 3, 0, b"body"));
        assert!(!dialer(&s, (&a, &b), 2, 1, b"body"));
        assert!(!dialer(&s, (&a, &b), 2, 0, b"bodz"));
    }
}
