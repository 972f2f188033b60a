//! A job's private control endpoint: a unix socket in a directory of the
//! user's own (0700), through which `kolo ps`, `kolo status` and `kolo
//! stack` ask the driver about its ranks. No TCP: only the job's user on
//! the driver's machine can ask, and the driver answers for every rank,
//! wherever it runs (its agents sample their ranks).
//!
//! Beside each socket, `<job>.json` says what `kolo ps` lists (the job,
//! its driver's pid, its command, its ranks, when it started). Requests are
//! one JSON line (`{"op": "status"}`, `{"op": "stack", "rank": R}`), at most
//! [`MAX_REQUEST`] bytes; the answer is one JSON line.

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::link::Link;

/// The longest request line taken.
pub const MAX_REQUEST: usize = 4096;
/// How long a client may take to send its request.
const REQUEST_WAIT: Duration = Duration::from_secs(5);
/// How long the agents get to sample their ranks (stacks take longer).
const SAMPLE_WAIT: Duration = Duration::from_secs(3);
const STACK_WAIT: Duration = Duration::from_secs(15);
/// Clients served at once; more wait in the kernel's backlog.
const MAX_CLIENTS: usize = 16;

/// The directory of this user's job endpoints: `$XDG_RUNTIME_DIR/kolo`
/// when that is set, else `/tmp/kolo-<uid>`; made 0700, and refused when
/// it is someone else's or open to others (another user made it first).
pub fn endpoint_dir() -> io::Result<PathBuf> {
    let uid = nix::unistd::getuid().as_raw();
    let dir = match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).filter(|d| d.is_dir()) {
        Some(runtime) => runtime.join("kolo"),
        None => std::env::temp_dir().join(format!("kolo-{uid}")),
    };
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(&dir)?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
        return Err(io::Error::other(format!(
            "{} is not a private directory of this user (owner {}, mode {:o}): remove it, or set XDG_RUNTIME_DIR",
            dir.display(),
            meta.uid(),
            meta.permissions().mode() & 0o777
        )));
    }
    Ok(dir)
}

/// Removes what drivers killed with their janitors left in `dir`
/// (listings whose driver is gone, and their sockets); the live jobs'
/// listings, in the order they started.
pub fn sweep(dir: &Path) -> Vec<(JobListing, PathBuf)> {
    let mut live = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let Some(listing) = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice::<JobListing>(&b).ok())
        else {
            continue;
        };
        let socket = path.with_extension("sock");
        let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(listing.driver_pid as i32), None).is_ok();
        if alive {
            live.push((listing, socket));
        } else {
            let _ = std::fs::remove_file(&path);
            let _ = std::fs::remove_file(&socket);
        }
    }
    live.sort_by(|a, b| a.0.started.total_cmp(&b.0.started));
    live
}

/// What `kolo ps` shows of a job.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobListing {
    /// The job's id.
    pub job: String,
    /// The driver's process id.
    pub driver_pid: u32,
    /// What the job runs, as `kolo ps` prints it.
    pub command: String,
    /// How many ranks it has.
    pub ranks: usize,
    /// Its hosts, each once, in plan order.
    pub hosts: Vec<String>,
    /// Seconds since the Unix epoch.
    pub started: f64,
}

/// One rank as `kolo status` shows it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankStatus {
    /// The rank's world rank.
    pub rank: u32,
    /// Its host.
    pub host: String,
    /// The rank's process: its command's, or the worker's own.
    pub pid: Option<u32>,
    /// `running`, `sleeping`, `stopped`, `zombie`, `disk-wait`, `ended`, `lost`.
    pub state: String,
    /// Its CPU use over its agent's last heartbeat interval, where known.
    pub cpu_percent: Option<f64>,
    /// Its resident memory, where known.
    pub rss_bytes: Option<u64>,
    /// Seconds since the rank last wrote a line (or since the job started).
    pub last_output_s: f64,
    /// Collectives the rank completed, where kolo can count them.
    pub collectives: Option<u64>,
    /// The share of time the rank spent waiting in collectives.
    pub wait_fraction: Option<f64>,
    /// Optimizer steps the rank took, where kolo can count them.
    pub steps: Option<u64>,
    /// The utilisation of the busiest GPU the rank runs on, where NVML is.
    pub gpu_percent: Option<f64>,
    /// GPU memory the rank's processes hold, where NVML is.
    pub gpu_memory_bytes: Option<u64>,
    /// Why the sample is missing, if it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A request on the endpoint.
#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum Request {
    Status,
    Stack { rank: Option<u32>, py_spy: Option<String> },
}

/// The endpoint of a running job; its socket and listing go when it is dropped.
pub(crate) struct Endpoint {
    socket: PathBuf,
    listing: PathBuf,
    task: tokio::task::JoinHandle<()>,
    job: Arc<Job>,
}

impl Endpoint {
    pub(crate) fn inspector(&self) -> Inspector {
        Inspector(self.job.clone())
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(&self.listing);
        // the directory too once no other job of the user's is in it
        if let Some(dir) = self.socket.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// What the endpoint answers from.
struct Job {
    listing: JobListing,
    links: Vec<Arc<Link>>,
    started: Instant,
}

/// Opens the job's endpoint and serves it until dropped; `janitor`
/// removes its files (and the directory, once empty) if the driver is
/// killed.
pub(crate) fn open(
    listing: JobListing,
    links: Vec<Arc<Link>>,
    janitor: Option<&kolo_sys::guard::Guard>,
) -> io::Result<Endpoint> {
    // an elastic job's cohorts are executors of one job: one endpoint each
    static OPENED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = OPENED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("{}.{}.{n}", sanitized(&listing.job), std::process::id());
    let mut tries = 0;
    let (dir, listener) = loop {
        let dir = endpoint_dir()?;
        sweep(&dir);
        if let Some(janitor) = janitor {
            // the directory before what it holds: the janitor removes it last
            let _ = janitor.remove_path(&dir);
        }
        match UnixListener::bind(dir.join(format!("{name}.sock"))) {
            Ok(listener) => break (dir, listener),
            // another job's end removed the empty directory meanwhile
            Err(e) if e.kind() == io::ErrorKind::NotFound && tries == 0 => tries += 1,
            Err(e) => return Err(e),
        }
    };
    let socket = dir.join(format!("{name}.sock"));
    let listing_path = dir.join(format!("{name}.json"));
    if let Some(janitor) = janitor {
        let _ = janitor.remove_path(&socket);
        let _ = janitor.remove_path(&listing_path);
        let _ = janitor.remove_path(&partial(&listing_path));
    }
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))?;
    write_private(&listing_path, &serde_json::to_vec(&listing).map_err(io::Error::other)?)?;
    let job = Arc::new(Job { listing, links, started: Instant::now() });
    let task = tokio::spawn(serve(listener, job.clone()));
    Ok(Endpoint { socket, listing: listing_path, task, job })
}

/// A job id as a file name.
pub fn sanitized(job: &str) -> String {
    job.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

/// Writes `path` whole or not at all: clients take a listing for a job
/// ready to answer, so none may read it half written.
fn write_private(path: &Path, data: &[u8]) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let partial = partial(path);
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&partial)?;
    f.write_all(data)?;
    std::fs::rename(&partial, path)
}

/// Where a listing is written before it is renamed into place.
fn partial(listing: &Path) -> PathBuf {
    listing.with_extension("json.partial")
}

async fn serve(listener: UnixListener, job: Arc<Job>) {
    let clients = Arc::new(tokio::sync::Semaphore::new(MAX_CLIENTS));
    let mut failures = kolo_rendezvous::AcceptFailures::new("the control endpoint");
    loop {
        let Ok(permit) = clients.clone().acquire_owned().await else { return };
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tokio::time::sleep(failures.failed(&e)).await;
                continue;
            }
        };
        let job = job.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let _ = answer(stream, &job).await;
        });
    }
}

/// Whether the peer of `stream` is this process's user (the directory's
/// mode says so already; this holds even if someone loosens it).
fn same_user(stream: &UnixStream) -> bool {
    stream.peer_cred().is_ok_and(|cred| cred.uid() == nix::unistd::getuid().as_raw())
}

async fn answer(stream: UnixStream, job: &Job) -> io::Result<()> {
    if !same_user(&stream) {
        return Ok(());
    }
    let (read, mut write) = stream.into_split();
    let mut line = Vec::new();
    let mut reader = BufReader::new(read.take(MAX_REQUEST as u64 + 1));
    let got = tokio::time::timeout(REQUEST_WAIT, reader.read_until(b'\n', &mut line)).await;
    let reply = match got {
        Err(_) => return Ok(()),
        Ok(Err(e)) => return Err(e),
        Ok(Ok(_)) if line.len() > MAX_REQUEST => error_reply("the request is too long"),
        Ok(Ok(_)) => match serde_json::from_slice::<Request>(&line) {
            Ok(request) => respond(request, job).await,
            Err(e) => error_reply(&format!("not a request: {e}")),
        },
    };
    let mut out = serde_json::to_vec(&reply).map_err(io::Error::other)?;
    out.push(b'\n');
    write.write_all(&out).await
}

fn error_reply(message: &str) -> serde_json::Value {
    serde_json::json!({ "error": message })
}

async fn respond(request: Request, job: &Job) -> serde_json::Value {
    match request {
        Request::Status => {
            let ranks = status(job).await;
            let stragglers = stragglers(&ranks);
            serde_json::json!({
                "job": job.listing.job,
                "command": job.listing.command,
                "age_s": job.started.elapsed().as_secs_f64(),
                "ranks": ranks,
                "stragglers": stragglers,
            })
        }
        Request::Stack { rank, py_spy } => {
            if let Some(r) = rank.filter(|r| *r as usize >= job.links.len()) {
                return error_reply(&format!("rank {r} is not in the job: it has ranks 0 to {}", job.links.len() - 1));
            }
            let chosen: Vec<&Arc<Link>> = job.links.iter().filter(|l| rank.is_none_or(|r| r == l.info.rank)).collect();
            let py_spy = &py_spy;
            let stacks = futures_join(chosen.iter().map(|link| async move {
                let answer = match tokio::time::timeout(STACK_WAIT, link.inspect(true, py_spy.clone())).await {
                    Ok(Ok(sample)) => sample.stacks.unwrap_or_else(|| "no stacks came back".into()),
                    Ok(Err(e)) => format!("cannot sample it: {e}"),
                    Err(_) => format!("no answer within {} s", STACK_WAIT.as_secs()),
                };
                serde_json::json!({ "rank": link.info.rank, "host": link.info.hostname, "stacks": answer })
            }))
            .await;
            serde_json::json!({ "job": job.listing.job, "ranks": stacks })
        }
    }
}

async fn status(job: &Job) -> Vec<RankStatus> {
    futures_join(job.links.iter().map(|link| async move {
        let last_output_s = link.since_output().as_secs_f64();
        let mut status = RankStatus {
            rank: link.info.rank,
            host: link.info.hostname.clone(),
            pid: None,
            state: "lost".into(),
            cpu_percent: None,
            rss_bytes: None,
            last_output_s,
            collectives: None,
            wait_fraction: None,
            steps: None,
            gpu_percent: None,
            gpu_memory_bytes: None,
            error: None,
        };
        if let Some(reason) = link.lost_reason() {
            status.state = if link.is_released() { "ended".into() } else { "lost".into() };
            status.error = Some(reason);
            return status;
        }
        match tokio::time::timeout(SAMPLE_WAIT, link.inspect(false, None)).await {
            Ok(Ok(sample)) => {
                status.pid = Some(sample.pid);
                status.state = sample.state;
                status.cpu_percent = sample.cpu_percent;
                status.rss_bytes = Some(sample.rss_bytes);
                status.gpu_percent = sample.gpu_percent;
                status.gpu_memory_bytes = sample.gpu_memory_bytes;
                if let Some(p) = sample.progress {
                    status.collectives = Some(p.done);
                    status.steps = Some(p.steps);
                    let lived = link.age().as_nanos().max(1) as f64;
                    status.wait_fraction = Some((p.wait_ns as f64 / lived).min(1.0));
                }
            }
            Ok(Err(e)) => status.error = Some(e),
            Err(_) => status.error = Some(format!("no answer within {} s", SAMPLE_WAIT.as_secs())),
        }
        status
    }))
    .await
}

/// The ranks the others wait for, by their share of time in collectives
/// ([`crate::hang::stragglers`]).
pub fn stragglers(ranks: &[RankStatus]) -> Vec<u32> {
    let waits: Vec<(u32, f64)> = ranks.iter().filter_map(|r| Some((r.rank, r.wait_fraction?))).collect();
    crate::hang::stragglers(&waits)
}

/// What a driver's own callers (hang detection) ask of the ranks.
#[derive(Clone)]
pub struct Inspector(Arc<Job>);

impl Inspector {
    /// Every rank's progress and output age, for [`crate::hang::HangWatch`].
    pub async fn views(&self) -> Vec<crate::hang::RankView> {
        futures_join(self.0.links.iter().map(|link| async move {
            let ended = link.lost_reason().is_some();
            let (progress, cpu_percent, stall) = if ended {
                (None, None, None)
            } else {
                match tokio::time::timeout(SAMPLE_WAIT, link.inspect(false, None)).await {
                    Ok(Ok(sample)) => (sample.progress, sample.cpu_percent, sample.stall),
                    _ => (None, None, None),
                }
            };
            crate::hang::RankView {
                rank: link.info.rank,
                host: link.info.hostname.clone(),
                progress,
                // a value reported is a sign of life as a line is
                since_output: link.since_output().min(link.since_report()),
                cpu_percent,
                ended,
                stall,
            }
        }))
        .await
    }

    /// Every rank's stacks, as `kolo stack` gets them.
    pub async fn stacks(&self) -> Vec<serde_json::Value> {
        let answer = respond(Request::Stack { rank: None, py_spy: None }, &self.0).await;
        answer["ranks"].as_array().cloned().unwrap_or_default()
    }

    /// What `kolo status --json` prints.
    pub async fn status(&self) -> serde_json::Value {
        respond(Request::Status, &self.0).await
    }

    /// Resolves once no rank has made progress for `timeout`, with the
    /// hang report: who holds the job back, then every rank's stacks.
    pub async fn hang_report(&self, timeout: Duration) -> String {
        let mut watch = crate::hang::HangWatch::new(timeout, Instant::now());
        let look_every = (timeout / 4).clamp(Duration::from_millis(250), Duration::from_secs(1));
        loop {
            tokio::time::sleep(look_every).await;
            let views = self.views().await;
            if let Some(still) = watch.observe(&views, Instant::now()) {
                let mut text = crate::hang::explain(&views, still);
                text.push_str("\nstacks of every rank:\n");
                text.push_str(&crate::hang::merged_stacks(&self.stacks().await));
                return text;
            }
        }
    }
}

/// Runs the futures together (they borrow the job, so they are polled
/// here rather than spawned), results in their order.
async fn futures_join<F: std::future::Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut pending: Vec<std::pin::Pin<Box<F>>> = futures.map(Box::pin).collect();
    let mut results: Vec<Option<F::Output>> = Vec::new();
    results.resize_with(pending.len(), || None);
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (i, f) in pending.iter_mut().enumerate() {
            if results[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => results[i] = Some(v),
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    results.into_iter().map(|r| r.expect("every future finished")).collect()
}

/// Seconds since the epoch, for listings.
pub(crate) fn unix_now() -> f64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}
