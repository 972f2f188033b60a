//! kolo-auth: one mutual authentication for every kolo connection.
//!
//! Both ends prove that they know the job secret without revealing it, by
//! HMAC-SHA256 over fresh nonces from both sides, the side's [`Role`] and a
//! `context` that names what the connection is for (say `b"kolo-comm-tcp"`,
//! the job id and both ranks), so that a tag is good for one connection,
//! one direction and one purpose only: it cannot be replayed on another
//! connection, reflected back at its sender, or moved to another use.
//!
//! The wire protocol of [`handshake`]:
//!
//! ```text
//! listener -> dialer   MAGIC (4) | listener nonce (32)
//! dialer   -> listener dialer nonce (32) | tag(Dialer) (32)
//!                      the listener verifies before it proves anything
//! listener -> dialer   tag(Listener) (32)
//!                      the dialer verifies
//! ```
//!
//! Every read before authentication is fixed-size and tiny (36 or 64
//! bytes), so an unauthenticated peer cannot make either side allocate or
//! wait beyond the handshake's time limit. The primitives ([`nonce`],
//! [`tag`], [`verify`], [`Listener`], [`Dialer`]) do no I/O, for callers
//! with their own event loop.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes in a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes in a tag (an HMAC-SHA256 output).
pub const TAG_LEN: usize = 32;
/// What a listener sends first, so that a dialer that reached something
/// else says so instead of failing on a bad tag.
pub const MAGIC: [u8; 4] = *b"kAu1";
/// Listener's opening: magic and nonce.
pub const HELLO_LEN: usize = MAGIC.len() + NONCE_LEN;
/// Dialer's answer: nonce and tag.
pub const ANSWER_LEN: usize = NONCE_LEN + TAG_LEN;

/// Keeps every kolo-auth tag apart from any other HMAC under the same key.
const DOMAIN: &[u8] = b"kolo-auth v1 mutual handshake\0";

/// Random bytes each side contributes, so that no two handshakes prove the same thing.
pub type Nonce = [u8; NONCE_LEN];
/// One side's proof that it knows the secret, for one connection and role.
pub type Tag = [u8; TAG_LEN];

/// Why a handshake (or a secret) failed.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The environment variable that should hold the secret is not set.
    #[error("no job secret: {var} is not set (kolo run sets it for its workers)")]
    MissingSecret {
        /// The variable's name.
        var: String,
    },
    /// The secret given is the empty string.
    #[error("the job secret is empty{}: an empty key authenticates nothing", .var.as_ref().map(|v| format!(" ({v})")).unwrap_or_default())]
    EmptySecret {
        /// The variable it came from, if it came from the environment.
        var: Option<String>,
    },
    /// The peer's first bytes are not kolo's magic: something else answered.
    #[error("not a kolo peer: the connection did not open with kolo's handshake")]
    NotKoloPeer,
    /// The peer's tag is wrong: it does not know the secret, or it proved it
    /// for another connection or purpose (another context).
    #[error("the peer does not know the job secret")]
    PeerUnauthenticated,
    /// The connection was closed or reset before the handshake finished.
    #[error("the peer closed the connection during the handshake: it refused our proof of the job secret (a different job secret?) or is not a kolo peer")]
    ClosedByPeer,
    /// The handshake did not finish within the time limit it carries.
    #[error("handshake timed out after {0:.1?}")]
    Timeout(Duration),
    /// Any other I/O error on the stream.
    #[error("handshake failed: {0}")]
    Io(#[source] io::Error),
}

/// The job's secret: never empty, never printed.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    /// Takes `secret` as the job's secret; an empty one is refused.
    pub fn new(secret: impl Into<String>) -> Result<Secret, AuthError> {
        let secret = secret.into();
        if secret.is_empty() {
            return Err(AuthError::EmptySecret { var: None });
        }
        Ok(Secret(secret))
    }

    /// From the environment variable `var` (kolo's is `KOLO_SECRET`); a
    /// missing or empty variable is an error, never an empty key.
    pub fn from_env(var: &str) -> Result<Secret, AuthError> {
        match std::env::var(var) {
            Ok(s) if s.is_empty() => Err(AuthError::EmptySecret { var: Some(var.into()) }),
            Ok(s) => Ok(Secret(s)),
            Err(_) => Err(AuthError::MissingSecret { var: var.into() }),
        }
    }

    /// The secret itself, e.g. for the rendezvous store's header.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Which end of a connection a tag speaks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Accepted the connection; sends the first nonce and proves itself last.
    Listener,
    /// Opened the connection; proves itself first.
    Dialer,
}

impl Role {
    fn byte(self) -> u8 {
        match self {
            Role::Listener => b'L',
            Role::Dialer => b'D',
        }
    }
}

/// A fresh random nonce.
pub fn nonce() -> Nonce {
    use rand::RngCore;
    let mut n = [0u8; NONCE_LEN];
    rand::rng().fill_bytes(&mut n);
    n
}

/// HMAC-SHA256(secret, DOMAIN | len(context) | context | role | listener nonce | dialer nonce).
pub fn tag(secret: &Secret, context: &[u8], role: Role, listener_nonce: &Nonce, dialer_nonce: &Nonce) -> Tag {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.0.as_bytes()).expect("HMAC takes keys of any length");
    mac.update(DOMAIN);
    mac.update(&(context.len() as u64).to_be_bytes());
    mac.update(context);
    mac.update(&[role.byte()]);
    mac.update(listener_nonce);
    mac.update(dialer_nonce);
    mac.finalize().into_bytes().into()
}

/// Whether `claimed` is `role`'s tag, compared in constant time.
pub fn verify(
    secret: &Secret,
    context: &[u8],
    role: Role,
    listener_nonce: &Nonce,
    dialer_nonce: &Nonce,
    claimed: &[u8],
) -> bool {
    let want = tag(secret, context, role, listener_nonce, dialer_nonce);
    subtle::ConstantTimeEq::ct_eq(claimed, &want[..]).into()
}

/// The listener's side of the handshake, without I/O.
pub struct Listener<'a> {
    secret: &'a Secret,
    context: &'a [u8],
    nonce: Nonce,
}

impl<'a> Listener<'a> {
    /// A listener with a fresh nonce, for a connection described by `context`.
    pub fn new(secret: &'a Secret, context: &'a [u8]) -> Self {
        Listener { secret, context, nonce: nonce() }
    }

    /// What the listener sends first.
    pub fn hello(&self) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[..4].copy_from_slice(&MAGIC);
        out[4..].copy_from_slice(&self.nonce);
        out
    }

    /// Checks the dialer's answer; only then gives the listener's proof to send.
    pub fn answer(&self, answer: &[u8; ANSWER_LEN]) -> Result<Tag, AuthError> {
        let dialer_nonce: Nonce = answer[..NONCE_LEN].try_into().expect("32 bytes");
        if !verify(self.secret, self.context, Role::Dialer, &self.nonce, &dialer_nonce, &answer[NONCE_LEN..]) {
            return Err(AuthError::PeerUnauthenticated);
        }
        Ok(tag(self.secret, self.context, Role::Listener, &self.nonce, &dialer_nonce))
    }
}

/// The dialer's side of the handshake, without I/O.
pub struct Dialer<'a> {
    secret: &'a Secret,
    context: &'a [u8],
    nonce: Nonce,
    listener_nonce: Option<Nonce>,
}

impl<'a> Dialer<'a> {
    /// A dialer with a fresh nonce, for a connection described by `context`.
    pub fn new(secret: &'a Secret, context: &'a [u8]) -> Self {
        Dialer { secret, context, nonce: nonce(), listener_nonce: None }
    }

    /// Takes the listener's hello; gives the answer to send.
    pub fn hello(&mut self, hello: &[u8; HELLO_LEN]) -> Result<[u8; ANSWER_LEN], AuthError> {
        if hello[..4] != MAGIC {
            return Err(AuthError::NotKoloPeer);
        }
        let listener_nonce: Nonce = hello[4..].try_into().expect("32 bytes");
        self.listener_nonce = Some(listener_nonce);
        let mut out = [0u8; ANSWER_LEN];
        out[..NONCE_LEN].copy_from_slice(&self.nonce);
        out[NONCE_LEN..].copy_from_slice(&tag(self.secret, self.context, Role::Dialer, &listener_nonce, &self.nonce));
        Ok(out)
    }

    /// Checks the listener's proof.
    pub fn finish(&self, proof: &[u8; TAG_LEN]) -> Result<(), AuthError> {
        let Some(listener_nonce) = self.listener_nonce else { return Err(AuthError::NotKoloPeer) };
        if verify(self.secret, self.context, Role::Listener, &listener_nonce, &self.nonce, proof) {
            Ok(())
        } else {
            Err(AuthError::PeerUnauthenticated)
        }
    }
}

/// A blocking stream whose reads and writes can be given a time limit.
pub trait Timeouts {
    /// Sets both the read and the write timeout (`None`: block forever).
    fn set_timeouts(&self, limit: Option<Duration>) -> io::Result<()>;
}

impl Timeouts for std::net::TcpStream {
    fn set_timeouts(&self, limit: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(limit)?;
        self.set_write_timeout(limit)
    }
}

impl Timeouts for std::os::unix::net::UnixStream {
    fn set_timeouts(&self, limit: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(limit)?;
        self.set_write_timeout(limit)
    }
}

struct Io<'s, S> {
    stream: &'s mut S,
    deadline: Instant,
    timeout: Duration,
}

impl<S: Read + Write + Timeouts> Io<'_, S> {
    fn arm(&mut self) -> Result<(), AuthError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(AuthError::Timeout(self.timeout));
        }
        self.stream.set_timeouts(Some(left)).map_err(AuthError::Io)
    }

    fn fail(&self, e: io::Error) -> AuthError {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => AuthError::Timeout(self.timeout),
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
                AuthError::ClosedByPeer
            }
            _ => AuthError::Io(e),
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<(), AuthError> {
        self.arm()?;
        self.stream.read_exact(buf).map_err(|e| self.fail(e))
    }

    fn write(&mut self, buf: &[u8]) -> Result<(), AuthError> {
        self.arm()?;
        self.stream.write_all(buf).and_then(|()| self.stream.flush()).map_err(|e| self.fail(e))
    }

    fn done(self) -> Result<(), AuthError> {
        self.stream.set_timeouts(None).map_err(AuthError::Io)
    }
}

/// Runs `role`'s end of the handshake over `stream`: a listener (the
/// accepting end) proves itself only to a dialer that proved itself first.
/// The stream must be in blocking mode; its timeouts are cleared on
/// success.
pub fn handshake<S: Read + Write + Timeouts>(
    stream: &mut S,
    role: Role,
    secret: &Secret,
    context: &[u8],
    timeout: Duration,
) -> Result<(), AuthError> {
    let mut io = Io { stream, deadline: Instant::now() + timeout, timeout };
    match role {
        Role::Listener => listen(&mut io, Listener::new(secret, context))?,
        Role::Dialer => dial(&mut io, Dialer::new(secret, context))?,
    }
    io.done()
}

fn listen<S: Read + Write + Timeouts>(io: &mut Io<'_, S>, me: Listener<'_>) -> Result<(), AuthError> {
    io.write(&me.hello())?;
    let mut answer = [0u8; ANSWER_LEN];
    io.read(&mut answer)?;
    let proof = me.answer(&answer)?;
    io.write(&proof)
}

fn dial<S: Read + Write + Timeouts>(io: &mut Io<'_, S>, mut me: Dialer<'_>) -> Result<(), AuthError> {
    let mut hello = [0u8; HELLO_LEN];
    // the magic alone first: something else that answers is named at once
    io.read(&mut hello[..MAGIC.len()])?;
    if hello[..MAGIC.len()] != MAGIC {
        return Err(AuthError::NotKoloPeer);
    }
    io.read(&mut hello[MAGIC.len()..])?;
    let answer = me.hello(&hello)?;
    io.write(&answer)?;
    let mut proof = [0u8; TAG_LEN];
    io.read(&mut proof)?;
    me.finish(&proof)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn secret(s: &str) -> Secret {
        Secret::new(s).unwrap()
    }

    const T: Duration = Duration::from_secs(5);

    /// Runs both ends over a socket pair; (listener's result, dialer's result).
    fn pair(
        listener_secret: &str,
        listener_context: &[u8],
        dialer_secret: &str,
        dialer_context: &[u8],
    ) -> (Result<(), AuthError>, Result<(), AuthError>) {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let (ls, lc) = (secret(listener_secret), listener_context.to_vec());
        let listener = std::thread::spawn(move || {
            let r = handshake(&mut a, Role::Listener, &ls, &lc, T);
            drop(a); // a refused dialer sees the connection close
            r
        });
        let dialed = handshake(&mut b, Role::Dialer, &secret(dialer_secret), dialer_context, T);
        (listener.join().unwrap(), dialed)
    }

    #[test]
    fn same_secret_and_context_authenticate_both_ways() {
        let (l, d) = pair("s3cret", b"ctx", "s3cret", b"ctx");
        l.unwrap();
        d.unwrap();
    }

    #[test]
    fn a_dialer_with_the_wrong_secret_is_refused_before_the_listener_proves_anything() {
        let (l, d) = pair("right", b"ctx", "wrong", b"ctx");
        assert!(matches!(l, Err(AuthError::PeerUnauthenticated)), "{l:?}");
        assert!(matches!(d, Err(AuthError::ClosedByPeer)), "{d:?}");
        assert!(l.unwrap_err().to_string().contains("the peer does not know the job secret"));
    }

    #[test]
    fn a_listener_with_the_wrong_secret_is_refused_by_the_dialer() {
        // the dialer proves itself first, so a listener without the secret
        // is caught by the listener's own check: simulate one that skips it
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let impostor = std::thread::spawn(move || {
            let wrong = secret("wrong");
            let ln = nonce();
            a.write_all(&MAGIC).unwrap();
            a.write_all(&ln).unwrap();
            let mut answer = [0u8; ANSWER_LEN];
            a.read_exact(&mut answer).unwrap();
            let dn: Nonce = answer[..32].try_into().unwrap();
            a.write_all(&tag(&wrong, b"ctx", Role::Listener, &ln, &dn)).unwrap();
        });
        let d = handshake(&mut b, Role::Dialer, &secret("right"), b"ctx", T);
        impostor.join().unwrap();
        assert!(matches!(d, Err(AuthError::PeerUnauthenticated)), "{d:?}");
    }

    #[test]
    fn another_context_is_refused() {
        let (l, d) = pair("s", b"kolo-comm-tcp job 0 1", "s", b"kolo-comm-tcp job 0 2");
        assert!(matches!(l, Err(AuthError::PeerUnauthenticated)));
        assert!(d.is_err());
    }

    #[test]
    fn not_a_kolo_peer_is_named() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        a.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
        let d = handshake(&mut b, Role::Dialer, &secret("s"), b"ctx", T);
        assert!(matches!(d, Err(AuthError::NotKoloPeer)), "{d:?}");
        assert!(d.unwrap_err().to_string().contains("not a kolo peer"));
    }

    #[test]
    fn a_silent_peer_times_out() {
        let (_a, mut b) = UnixStream::pair().unwrap();
        let start = Instant::now();
        let d = handshake(&mut b, Role::Dialer, &secret("s"), b"ctx", Duration::from_millis(100));
        assert!(matches!(d, Err(AuthError::Timeout(_))), "{d:?}");
        assert!(start.elapsed() < Duration::from_secs(2));
        assert!(d.unwrap_err().to_string().contains("timed out"));
    }

    #[test]
    fn tags_bind_secret_context_role_and_both_nonces() {
        let s = secret("s");
        let (ln, dn) = (nonce(), nonce());
        assert_ne!(ln, dn);
        let t = tag(&s, b"ctx", Role::Dialer, &ln, &dn);
        assert!(verify(&s, b"ctx", Role::Dialer, &ln, &dn, &t));
        assert!(!verify(&secret("t"), b"ctx", Role::Dialer, &ln, &dn, &t));
        assert!(!verify(&s, b"ctx2", Role::Dialer, &ln, &dn, &t));
        assert!(!verify(&s, b"ctx", Role::Listener, &ln, &dn, &t), "a tag of one role is refused as the other");
        assert!(!verify(&s, b"ctx", Role::Dialer, &dn, &ln, &t), "the nonces are not interchangeable");
        assert!(!verify(&s, b"ctx", Role::Dialer, &nonce(), &dn, &t));
        assert!(!verify(&s, b"ctx", Role::Dialer, &ln, &nonce(), &t));
        assert!(!verify(&s, b"ctx", Role::Dialer, &ln, &dn, &t[..31]), "a short tag never matches");
        // the context is length-prefixed: no ambiguity at its end
        assert_ne!(tag(&s, b"ab", Role::Dialer, &ln, &dn), tag(&s, b"a", Role::Dialer, &ln, &dn));
    }

    #[test]
    fn a_reflected_tag_is_refused() {
        // an attacker without the secret, as listener, hands the dialer's own
        // tag back as its proof (or the other way round): both are refused
        let s = secret("s");
        let mut dialer = Dialer::new(&s, b"ctx");
        let listener = Listener::new(&s, b"ctx");
        let answer = dialer.hello(&listener.hello()).unwrap();
        let dialer_tag: Tag = answer[NONCE_LEN..].try_into().unwrap();
        assert!(matches!(dialer.finish(&dialer_tag), Err(AuthError::PeerUnauthenticated)));
        // and a listener's proof replayed as a dialer's answer
        let proof = listener.answer(&answer).unwrap();
        let mut replay = [0u8; ANSWER_LEN];
        replay[..NONCE_LEN].copy_from_slice(&answer[..NONCE_LEN]);
        replay[NONCE_LEN..].copy_from_slice(&proof);
        assert!(matches!(listener.answer(&replay), Err(AuthError::PeerUnauthenticated)));
        dialer.finish(&proof).unwrap();
    }

    #[test]
    fn secrets_are_never_empty_nor_printed() {
        assert!(matches!(Secret::new(""), Err(AuthError::EmptySecret { .. })));
        let s = secret("hunter2");
        assert!(!format!("{s:?}").contains("hunter2"));
        assert_eq!(s.expose(), "hunter2");
        let missing = Secret::from_env("KOLO_AUTH_TEST_SURELY_UNSET").unwrap_err();
        assert!(matches!(missing, AuthError::MissingSecret { .. }));
        assert!(missing.to_string().contains("KOLO_AUTH_TEST_SURELY_UNSET is not set"), "{missing}");
    }
}
