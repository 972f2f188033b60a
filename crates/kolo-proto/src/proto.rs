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
pub const PROTOCOL_VERSION: u32 = 6;
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
    /// [`MAGIC`], so that a worker knows it reached a kolo driver.
    pub magic: u32,
    /// The driver's [`PROTOCOL_VERSION`].
    pub version: u32,
    /// The driver's fresh nonce, which the worker's proof must cover.
    pub nonce: Nonce,
}

impl Challenge {
    /// The challenge as a whole frame, length prefix included.
    pub fn frame(&self) -> Vec<u8> {
        let mut f = Vec::with_capacity(44);
        f.extend_from_slice(&40u32.to_be_bytes());
        f.extend_from_slice(&self.magic.to_be_bytes());
        f.extend_from_slice(&self.version.to_be_bytes());
        f.extend_from_slice(&self.nonce);
        f
    }

    /// Reads a challenge from a frame's body; `None` unless it is exactly
    /// 40 bytes.
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
    /// [`MAGIC`], so that a stray client is turned away at once.
    pub magic: u32,
    /// The protocol version the worker speaks.
    pub version: u32,
    /// The worker's index (its world rank), as its engine set it.
    pub index: u32,
    /// The worker's fresh nonce, which the driver's proof must cover.
    pub nonce: Nonce,
    /// The worker's [`ControlProof`] (the dialer's) over the nonces, version,
    /// index and body.
    pub tag: Tag,
}

const HELLO_HEADER: usize = 4 + 4 + 4 + 32 + 32;

/// Worker → driver, the rest of the first frame (postcard; trusted only
/// once the header's tag checked out).
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct HelloBody {
    /// The host name the worker really runs on.
    pub hostname: String,
    /// The worker agent's process id.
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
    /// The driver's proof that it knows the secret (the listener's
    /// [`ControlProof`] over the worker's hello).
    pub tag: Tag,
    /// How often the worker sends a heartbeat.
    pub heartbeat_interval_ms: u64,
    /// How long the worker may go without hearing from the driver before
    /// it takes the driver for gone.
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

/// Driver → worker, every frame after the handshake.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub enum ToWorker {
    /// "Still here": keeps the worker from taking the driver for gone.
    Heartbeat,
    /// Overlaid on the worker's environment (and the command's).
    SetEnv(Vec<(String, String)>),
    /// Run an OS command as the executable (what `kolo run` does).
    StartCommand {
        /// The program and its arguments, as raw bytes (not always UTF-8).
        argv: Vec<Vec<u8>>,
    },
    /// Send a signal to the command's process group.
    SignalCommand {
        /// The signal's number.
        signal: i32,
    },
    /// Create the Rust executable registered under `name`.
    Create {
        /// The name the executable was registered under.
        name: String,
        /// Its creation arguments, postcard-encoded.
        args: Vec<u8>,
    },
    /// Run a task or function registered under `name`; answered with `Done`.
    Call {
        /// The driver's number for the call, repeated in its answers.
        id: u64,
        /// Whether `name` is a task or a function.
        kind: CallKind,
        /// The name the task or function was registered under.
        name: String,
        /// Its arguments, postcard-encoded.
        args: Vec<u8>,
    },
    /// Skip this call if it has not started; drop its result otherwise.
    Cancel {
        /// The call's `id`.
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
        /// The question's number, repeated in the answer.
        id: u64,
        /// The connection's end on the agent's host.
        client: std::net::SocketAddr,
        /// The connection's end at the driver.
        server: std::net::SocketAddr,
    },
    /// Find `count` ports free on this host (rank 0's: the frameworks'
    /// coordinators listen there) and list its interfaces.
    ReservePorts {
        /// How many ports.
        count: u8,
    },
    /// What the rank does now (`kolo status`, `kolo stack`): its process's
    /// state and use, with `stacks` its threads' stacks too. Answered off
    /// the thread that reads these, even during a call.
    Inspect {
        /// The question's number, repeated in the answer.
        id: u64,
        /// Whether to sample the threads' stacks as well.
        stacks: bool,
        /// Where the asking user's py-spy is, tried first (a shared
        /// virtualenv is often at the same path on every host).
        py_spy: Option<String>,
    },
    /// Probe these (interface, address, port) of worker `index`'s listener.
    Probe {
        /// The probed worker's index, which its listener's proof covers.
        index: u32,
        /// What to probe: (interface name, IPv4 address, port).
        targets: Vec<(String, String, u16)>,
        /// How long each probe may take.
        timeout_ms: u64,
    },
    /// "What time is it?" (`kolo run --timeline` puts every host's clock
    /// onto the driver's): answered at once with `ClockReading`.
    ClockProbe {
        /// Matches the answer.
        id: u64,
    },
}

/// A rank's process as its agent sees it.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct RankSample {
    /// The rank's process id.
    pub pid: u32,
    /// `running`, `sleeping`, `stopped`, `zombie`, `disk-wait`, ...
    pub state: String,
    /// Over the agent's last heartbeat interval.
    pub cpu_percent: Option<f64>,
    /// Its resident memory.
    pub rss_bytes: u64,
    /// Every thread's stack, as `kolo stack` prints it, or why there is none.
    pub stacks: Option<String>,
    /// What the rank's Python hook counted, where it runs.
    pub progress: Option<Progress>,
    /// Its GPUs' utilisation (the busiest) and the memory it holds, where NVML is.
    pub gpu_percent: Option<f64>,
    /// The GPU memory its process holds, where NVML is.
    pub gpu_memory_bytes: Option<u64>,
    /// The last stall warning of the rank's Horovod core, where it has one.
    #[serde(default)]
    pub stall: Option<String>,
}

/// A rank's collectives and steps, as its Python hook counts them in its
/// progress file (`KOLO_PROGRESS_FILE`).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// Collectives called.
    pub entered: u64,
    /// Collectives that returned (`entered` less those still running).
    pub done: u64,
    /// Nanoseconds spent inside collective calls.
    pub wait_ns: u64,
    /// Optimizer steps.
    pub steps: u64,
}

/// Worker → driver, every frame after the handshake.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub enum ToDriver {
    /// "Still here": keeps the driver from taking the worker for lost.
    Heartbeat,
    /// The answer to `WhoOwns`: the connection is the job user's, or why not.
    SocketOwner {
        /// The question's `id`.
        id: u64,
        /// `Ok` when the job's user owns it, else why not.
        answer: Result<(), String>,
    },
    /// Output of the command or of the worker's own code, a chunk at a time.
    Output {
        /// From stderr rather than stdout.
        stderr: bool,
        /// The bytes, as written.
        data: Vec<u8>,
    },
    /// The command of `StartCommand` runs.
    CommandStarted {
        /// Its process id (also its process group's).
        pid: u32,
    },
    /// The command of `StartCommand` could not start.
    CommandStartFailed {
        /// Why, for the user.
        message: String,
        /// The exit code a shell would give (126: not permitted, 127: not
        /// found or other).
        code: i32,
    },
    /// The command failed and left an error report (PyTorch's error file,
    /// written by `@record`): the exception and its traceback. Sent before
    /// `CommandExited`.
    CommandError {
        /// The exception, cut to a bound.
        message: String,
        /// Its traceback, cut to a bound.
        traceback: String,
    },
    /// The command ended: its exit code, or the signal that killed it.
    CommandExited {
        /// The exit code, if it exited.
        code: Option<i32>,
        /// The signal's number, if one killed it.
        signal: Option<i32>,
    },
    /// The answer to `Create`.
    Created {
        /// `Ok` once the executable exists, else why not (the user's
        /// error, or a name not registered).
        result: Result<(), String>,
    },
    /// The answer to `Call`: the call ended.
    Done {
        /// The call's `id`.
        id: u64,
        /// Its postcard-encoded output, or why it failed (the user's error,
        /// or a name not registered).
        result: Result<Vec<u8>, String>,
    },
    /// A value the running call `id` reports (callbacks), before its `Done`.
    Report {
        /// The running call's `id`.
        id: u64,
        /// The reported bytes, as the worker's code gave them.
        data: Vec<u8>,
    },
    /// The answer to `ReservePorts`.
    PortsReserved {
        /// Ports that were free together (bound, then let go for the
        /// frameworks); fewer than asked where binding failed.
        ports: Vec<u16>,
        /// This host's interfaces with their IPv4 addresses.
        interfaces: Vec<(String, Vec<String>)>,
    },
    /// The answer to `ProbeListen`.
    ProbeReady {
        /// The probe listener's port (0: it could not listen).
        port: u16,
        /// This host's interfaces with their IPv4 addresses.
        interfaces: Vec<(String, Vec<String>)>,
    },
    /// The answer to `Inspect`.
    Inspected {
        /// The question's `id`.
        id: u64,
        /// What the agent saw of the rank, or why it could not look.
        answer: Result<RankSample, String>,
    },
    /// Per target (interface, address): `None` when the probe got through
    /// on the interface of that name, else why not.
    ProbeResult {
        /// (interface, address, `None` or why the probe failed).
        results: Vec<(String, String, Option<String>)>,
    },
    /// The answer to `ClockProbe`: this host's clock when the agent read it.
    ClockReading {
        /// The probe's `id`.
        id: u64,
        /// Nanoseconds since the Unix epoch.
        unix_ns: i64,
    },
    /// Part of what the rank recorded for the job's timeline, sent when its
    /// command has ended, before `CommandExited`.
    Timeline {
        /// The next bytes of the rank's timeline file.
        data: Vec<u8>,
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

/// What a control handshake proof binds: whose proof it is, both nonces
/// (the driver's, the worker's), the protocol version, the worker's index
/// and the rest of its first frame. The worker's proof is kolo-auth's
/// dialer tag over it, the driver's the listener tag, given only to a
/// worker that proved itself.
pub struct ControlProof<'a> {
    /// Whose proof: the worker's (`Dialer`) or the driver's (`Listener`).
    pub role: Role,
    /// The driver's nonce, then the worker's.
    pub nonces: (&'a Nonce, &'a Nonce),
    /// The protocol version the worker speaks.
    pub version: u32,
    /// The worker's index.
    pub index: u32,
    /// The rest of the worker's first frame.
    pub body: &'a [u8],
}

impl ControlProof<'_> {
    /// The proof, made with `secret`.
    pub fn tag(&self, secret: &Secret) -> Tag {
        let (driver_nonce, worker_nonce) = self.nonces;
        kolo_auth::tag(secret, &self.context(), self.role, driver_nonce, worker_nonce)
    }

    /// Whether `claimed` is this proof (compared in constant time by
    /// kolo-auth).
    pub fn verifies(&self, secret: &Secret, claimed: &Tag) -> bool {
        let (driver_nonce, worker_nonce) = self.nonces;
        kolo_auth::verify(secret, &self.context(), self.role, driver_nonce, worker_nonce, claimed)
    }

    fn context(&self) -> Vec<u8> {
        control_context(self.version, self.index, self.body)
    }
}

/// A message as a whole frame: its length, then its postcard encoding;
/// refused over [`MAX_FRAME`].
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

/// Reads a message from a frame's body (without its length).
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
        let proof = |role, nonces, version, index, body| ControlProof { role, nonces, version, index, body };
        let t = proof(Role::Dialer, (&a, &b), 2, 0, b"body").tag(&s);
        assert!(proof(Role::Dialer, (&a, &b), 2, 0, b"body").verifies(&s, &t));
        assert!(!proof(Role::Dialer, (&a, &b), 2, 0, b"body").verifies(&x, &t));
        assert!(!proof(Role::Listener, (&a, &b), 2, 0, b"body").verifies(&s, &t));
        assert!(!proof(Role::Dialer, (&b, &a), 2, 0, b"body").verifies(&s, &t));
        assert!(!proof(Role::Dialer, (&a, &b), 3, 0, b"body").verifies(&s, &t));
        assert!(!proof(Role::Dialer, (&a, &b), 2, 1, b"body").verifies(&s, &t));
        assert!(!proof(Role::Dialer, (&a, &b), 2, 0, b"bodz").verifies(&s, &t));
    }
}
