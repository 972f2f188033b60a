//! Starting a job: the plan's workers are spawned by the engine, dial
//! back, prove the secret, and get their environment.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use kolo_rendezvous::{RendezvousServer, ServerConfig, TorchStoreConfig, TorchStoreServer};
use kolo_topology::{JobEnv, Plan};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::link::{read_worker, send_heartbeats, watch_heartbeats, Link};
use super::progress::Progress;
use super::{peers, Executor, Running, WorkerInfo};
use crate::output::OutputWriter;
use crate::policy::Liveness;
use crate::settings::random_hex;
use kolo_engine::ExecError;
use kolo_engine::WorkerLaunch;
use kolo_proto::launch as worker;
use kolo_proto::proto::{
    self, Challenge, HelloBody, HelloHeader, ToDriver, ToWorker, Welcome, MAGIC, PROTOCOL_VERSION,
};
use kolo_sys::guard::{Guard, GuardOptions};

/// A worker that connected and proved the secret.
pub(super) struct Hello {
    pub header: HelloHeader,
    pub body: HelloBody,
    pub stream: TcpStream,
}

/// Handshakes in flight at once: unauthenticated peers cannot make the
/// driver hold more than this many connections, each with a 4 KiB frame.
const MAX_HANDSHAKES: usize = 256;
/// Refused connections logged one by one; past this, only counted.
const LOGGED_REFUSALS: u32 = 5;

impl Executor {
    /// Starts the workers without an executable (RayExecutor's
    /// `executable_cls=None`): `run` and `run_remote_function` work.
    pub async fn start_workers(&mut self, extra_env: &[(String, String)]) -> Result<(), ExecError> {
        self.start_agents(extra_env, false).await
    }

    /// Starts the agents; those that will run an OS command fork their
    /// guard first thing.
    pub(super) async fn start_agents(
        &mut self,
        extra_env: &[(String, String)],
        command: bool,
    ) -> Result<(), ExecError> {
        if self.running.is_some() {
            return Err(ExecError::AlreadyStarted);
        }
        match self.start_inner(extra_env, command).await {
            Ok(running) => {
                self.running = Some(running);
                Ok(())
            }
            Err(e) => {
                self.stop_engine().await;
                Err(e)
            }
        }
    }

    async fn start_inner(&mut self, extra_env: &[(String, String)], command: bool) -> Result<Running, ExecError> {
        let settings = self.settings.clone();
        // 1. the plan (asks the engine for hosts the first time)
        let plan = self.plan().await?.clone();
        let n = plan.len();
        tracing::debug!(workers = n, "planned");
        check_descriptors(n)?;
        // 2. workers, told where to dial back
        let driver_ip = self.with_engine_blocking(|engine| Ok(engine.driver_addr())).await?;
        let listener = TcpListener::bind(SocketAddr::new(driver_ip, 0))
            .await
            .map_err(|source| ExecError::Io { what: "listening for workers".into(), source })?;
        let control =
            listener.local_addr().map_err(|source| ExecError::Io { what: "listening for workers".into(), source })?;
        let program = match &settings.worker_program {
            Some(p) => p.clone(),
            None => std::env::current_exe()
                .map_err(|source| ExecError::Io { what: "finding this program".into(), source })?,
        };
        // agents guard their commands themselves where the engine does not
        let agent_guards = command && !self.engine().is_some_and(|e| e.guards_commands());
        let launches: Vec<WorkerLaunch> = plan
            .workers
            .iter()
            .enumerate()
            .map(|(index, w)| WorkerLaunch {
                index: index as u32,
                env: [
                    (worker::env::DRIVER.into(), control.to_string()),
                    (worker::env::INDEX.into(), index.to_string()),
                ]
                .into_iter()
                .chain(agent_guards.then(|| (worker::env::GUARD.to_string(), "1".to_string())))
                .collect(),
                host: w.host.clone(),
                program: program.clone(),
                args: settings.worker_args.iter().map(Into::into).collect(),
                secret: settings.secret().to_string(),
                kill_grace: settings.kill_grace,
                command_only: command,
            })
            .collect();
        let janitor = Guard::spawn(GuardOptions { grace: settings.kill_grace + Duration::from_secs(1), silence: None })
            .map_err(|source| ExecError::Io { what: "starting the janitor process".into(), source })?;
        let janitor = self.janitor.insert(Arc::new(janitor)).clone();
        self.with_engine_blocking(move |engine| engine.spawn(launches, &janitor)).await?;
        tracing::debug!(workers = n, %control, "workers spawned");

        // 3. every worker connects and proves the secret
        let mut hellos = self.accept_workers(&listener, &plan, &program).await?;
        tracing::debug!("every worker registered");
        check_nics(&settings.nics, &plan, &hellos)?;

        // 4. rendezvous server sized by the plan
        let mut server_config = ServerConfig::new(SocketAddr::new(driver_ip, 0));
        server_config.secret = Some(settings.secret().to_string());
        server_config.require_secret = settings.rendezvous_require_secret;
        server_config.gate = Some(peers::gate(settings.secret()));
        let server = RendezvousServer::start(server_config, &plan.slots()).await?;

        // 5. interfaces, then each rank's env from the plan
        let default_nics = self.engine.as_ref().map(|e| e.default_nics()).unwrap_or_default();
        let (nics, report) = match (&settings.shared, &settings.nics) {
            (Some(shared), _) => (shared.ifaces.clone(), Vec::new()),
            (None, Some(nics)) => (nics.clone(), Vec::new()),
            (None, None) => {
                let deadline = Instant::now() + settings.start_timeout;
                detect_nics(&plan, &mut hellos, deadline, default_nics).await?
            }
        };
        self.nic_report = report;
        // torch's store is the driver's, like torchrun's agent's, open to
        // the job's hosts only (its protocol has no secret)
        let peers = hellos.iter().filter_map(|h| h.stream.peer_addr().ok()).map(|a| a.ip().to_canonical());
        let torch_store = match &settings.shared {
            // a later cohort of an elastic job: its ranks meet the others
            // on the job's store
            Some(shared) => {
                shared.torch_store.0.allow(peers);
                shared.torch_store.0.clone()
            }
            None => {
                let mut store_config = TorchStoreConfig::new(SocketAddr::new(driver_ip, 0));
                store_config.allowed_peers = Some(peers.collect());
                store_config.gate = Some(peers::gate(settings.secret()));
                std::sync::Arc::new(TorchStoreServer::start(store_config).await?)
            }
        };
        // JAX's coordinator lives in rank 0, wherever it runs: its address
        // on the shared interface and a port free there
        let deadline = Instant::now() + settings.start_timeout;
        let (jax_coordinator_addr, jax_coordinator_port) = rank0_port(&plan, &mut hellos, &nics, deadline).await?;
        tracing::debug!("stores up, interfaces and rank 0's port known");
        let (rendezvous, job_id) = match &settings.shared {
            Some(shared) => (shared.rendezvous, shared.job_id.clone()),
            None => (server.addr(), random_hex(8)),
        };
        let job = JobEnv {
            rendezvous_addr: rendezvous.ip().to_string(),
            rendezvous_port: rendezvous.port(),
            ifaces: nics,
            timeout_s: settings.start_timeout.as_secs().max(1),
            master_addr: torch_store.addr().ip().to_string(),
            master_port: torch_store.addr().port(),
            jax_coordinator_addr,
            jax_coordinator_port,
            elastic: settings.elastic.clone(),
            job_id,
        };
        let output = OutputWriter::start(settings.output.clone(), n)?;
        let (event_tx, events) = mpsc::unbounded_channel();
        let stopping = Arc::new(AtomicBool::new(false));
        let (mut readers, mut background) = (JoinSet::new(), JoinSet::new());
        let mut links = Vec::with_capacity(n);
        let mut watched = Vec::with_capacity(n);
        for (rank, hello) in hellos.into_iter().enumerate() {
            let planned = &plan.workers[rank];
            let info = WorkerInfo {
                rank: rank as u32,
                hostname: planned.host.hostname.clone(),
                node_id: planned.host.node_id.clone(),
                pid: hello.body.pid,
                gpus: planned.gpus.clone(),
                ranks: planned.ranks.clone(),
                env: plan.env(rank, &job, extra_env, |name| std::env::var(name).ok()),
            };
            let host_addr = hello.stream.peer_addr().ok().map(|a| a.ip());
            let (reader, writer) = hello.stream.into_split();
            let link = Arc::new(Link::new(info, writer, host_addr));
            let reading =
                readers.spawn(read_worker(link.clone(), reader, output.queue(), event_tx.clone(), stopping.clone()));
            background.spawn(send_heartbeats(link.clone(), settings.heartbeat_interval));
            watched.push((link.clone(), reading));
            links.push(link);
        }
        // before any rank learns where the stores are
        peers::register(settings.secret(), &links);
        let liveness = Liveness { timeout: settings.heartbeat_timeout };
        background.spawn(watch_heartbeats(watched, liveness, event_tx, stopping.clone()));
        // 6. env pushed to every worker (the job secret goes to kolo's own clients)
        let forwarded: Vec<(String, String)> = std::env::vars()
            .filter(|(name, _)| kolo_topology::forwards_caller_var(name) && !name.starts_with("KOLO_WORKER_"))
            .collect();
        for link in &links {
            let mut vars = forwarded.clone();
            vars.extend(link.info.env.clone());
            vars.push((kolo_topology::env_names::SECRET.into(), settings.secret().to_string()));
            link.send(&ToWorker::SetEnv(vars)).await?;
        }
        tracing::debug!("every worker has its environment");
        let listing = super::control::JobListing {
            job: job.job_id.clone(),
            driver_pid: std::process::id(),
            command: self.description.clone(),
            ranks: links.len(),
            hosts: {
                let mut hosts: Vec<String> = Vec::new();
                for w in &plan.workers {
                    if !hosts.contains(&w.host.hostname) {
                        hosts.push(w.host.hostname.clone());
                    }
                }
                hosts
            },
            started: super::control::unix_now(),
        };
        // the job runs without it if it cannot open: said, not fatal
        let control = super::control::open(listing, links.clone(), self.janitor.as_deref())
            .map_err(|e| tracing::warn!("no control endpoint for kolo status and kolo stack: {e}"))
            .ok();
        Ok(Running {
            links,
            server,
            torch_store,
            output,
            events,
            readers,
            background,
            stopping,
            job,
            control,
            commands: command,
        })
    }

    async fn accept_workers(
        &mut self,
        listener: &TcpListener,
        plan: &Plan,
        program: &std::path::Path,
    ) -> Result<Vec<Hello>, ExecError> {
        let n = plan.len();
        let host = |i: usize| plan.workers[i].host.hostname.clone();
        let deadline = Instant::now() + self.settings.start_timeout;
        let mut registered: Vec<Option<Hello>> = (0..n).map(|_| None).collect();
        let mut handshakes = JoinSet::new();
        let slots = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        let mut poll = tokio::time::interval(Duration::from_millis(50));
        let mut failed_since: Option<Instant> = None;
        // workers that are in wait for the rest; they must hear from us meanwhile
        let heartbeat =
            proto::encode(&ToWorker::Heartbeat).map_err(|source| ExecError::Io { what: "encoding".into(), source })?;
        let mut next_heartbeat = Instant::now() + self.settings.heartbeat_interval;
        let mut progress = Progress::new("waiting for workers to connect");
        let welcome = Welcome {
            tag: [0; 32],
            heartbeat_interval_ms: self.settings.heartbeat_interval.as_millis() as u64,
            heartbeat_timeout_ms: self.settings.heartbeat_timeout.as_millis() as u64,
            kill_grace_ms: self.settings.kill_grace.as_millis() as u64,
        };
        let handshake_limit = self.settings.start_timeout.min(kolo_sys::wait::HANDSHAKE_LIMIT);
        let build_id = kolo_proto::registry::build_id();
        let secret = Arc::new(
            kolo_auth::Secret::new(self.settings.secret()).map_err(|e| ExecError::BadSettings(e.to_string()))?,
        );
        let mut refused: u32 = 0;
        let mut out_of_descriptors: Option<std::io::Error> = None;
        // after an accept error, accepting pauses, longer each time in a row
        let (mut accept_pause, mut failures) = (Duration::ZERO, kolo_rendezvous::AcceptFailures::new("the driver"));
        while registered.iter().any(Option::is_none) {
            tokio::select! {
                accepted = listener.accept(), if accept_pause.is_zero() => match accepted {
                    Ok((stream, peer)) => {
                        failures.recovered();
                        // past the bound, a connection is closed unread
                        let Ok(permit) = slots.clone().try_acquire_owned() else { continue };
                        let (secret, welcome) = (secret.clone(), welcome.clone());
                        handshakes.spawn(async move {
                            let result = tokio::time::timeout(handshake_limit, handshake(stream, &secret, welcome, n)).await;
                            drop(permit);
                            (peer, result.unwrap_or_else(|_| Err(Refusal::Quiet("no hello in time".into()))))
                        });
                    }
                    Err(e) => {
                        // back off (no busy loop); out of descriptors is
                        // remembered for the error
                        accept_pause = failures.failed(&e);
                        if matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) {
                            out_of_descriptors = Some(e);
                        }
                    }
                },
                _ = tokio::time::sleep(accept_pause), if !accept_pause.is_zero() => accept_pause = Duration::ZERO,
                Some(done) = handshakes.join_next(), if !handshakes.is_empty() => {
                    let Ok((peer, result)) = done else { continue };
                    match result {
                        Ok(hello) => {
                            if hello.body.build_id != build_id {
                                return Err(ExecError::Build {
                                    program: program.to_path_buf(),
                                    host: host(hello.header.index as usize),
                                    worker: hello.body.build_id,
                                    driver: build_id,
                                });
                            }
                            let slot = &mut registered[hello.header.index as usize];
                            if slot.is_some() {
                                tracing::warn!(%peer, index = hello.header.index, "refused a second worker with the same index");
                                continue;
                            }
                            tracing::debug!(index = hello.header.index, host = %hello.body.hostname, pid = hello.body.pid, "worker registered");
                            *slot = Some(hello);
                        }
                        Err(Refusal::Logged(why)) | Err(Refusal::Quiet(why)) => {
                            refused += 1;
                            if refused <= LOGGED_REFUSALS {
                                tracing::warn!(%peer, "refused a control connection: {why}");
                            }
                        }
                        Err(Refusal::Fatal(e)) => return Err(e),
                    }
                }
                _ = poll.tick() => {
                    let connected = registered.iter().filter(|r| r.is_some()).count();
                    progress.show(&format!("{connected} of {n}"), self.settings.start_timeout);
                    if Instant::now() >= next_heartbeat {
                        next_heartbeat = Instant::now() + self.settings.heartbeat_interval;
                        for hello in registered.iter_mut().flatten() {
                            let _ = hello.stream.write_all(&heartbeat).await;
                        }
                    }
                    let exited = self.engine().map(|e| e.exited()).unwrap_or_default();
                    let failed: Vec<(u32, String)> =
                        exited.into_iter().filter(|(i, _)| registered[*i as usize].is_none()).collect();
                    if !failed.is_empty() {
                        // hosts fail together (unreachable ones time out alike):
                        // a moment more names them all
                        let first_seen = *failed_since.get_or_insert_with(Instant::now);
                        if first_seen.elapsed() >= kolo_sys::wait::FAILED_TOGETHER || Instant::now() >= deadline {
                            let mut reasons: Vec<String> = Vec::new();
                            let mut hosts: Vec<String> = Vec::new();
                            for (index, how) in &failed {
                                let name = host(*index as usize);
                                let line = format!("host {name}: {how}");
                                if !reasons.contains(&line) {
                                    reasons.push(line);
                                }
                                if !hosts.contains(&name) {
                                    hosts.push(name);
                                }
                            }
                            let (index, _) = failed[0];
                            return Err(ExecError::WorkerStart {
                                index,
                                host: host(index as usize),
                                reason: format!("workers exited before connecting: {}", reasons.join("; ")),
                                hosts,
                            });
                        }
                    }
                    if Instant::now() >= deadline {
                        let absent: Vec<usize> =
                            registered.iter().enumerate().filter(|(_, r)| r.is_none()).map(|(i, _)| i).collect();
                        let missing: Vec<String> =
                            absent.iter().map(|&i| format!("worker {i} on host {}", host(i))).collect();
                        let mut hosts: Vec<String> = absent.iter().map(|&i| host(i)).collect();
                        hosts.dedup();
                        if let Some(source) = out_of_descriptors {
                            return Err(ExecError::Descriptors { workers: n, source });
                        }
                        let seconds = self.settings.start_timeout.as_secs_f64();
                        return Err(ExecError::StartTimeout { seconds, missing: missing.join(", "), hosts });
                    }
                }
            }
        }
        drop(progress);
        if refused > LOGGED_REFUSALS {
            tracing::warn!("refused {refused} control connections in all (wrong secret or not kolo workers)");
        }
        Ok(registered.into_iter().map(|r| r.expect("all registered")).collect())
    }
}

/// Why a connection was refused.
enum Refusal {
    /// Worth a warning (it spoke, but not with the secret).
    Logged(String),
    /// Not even a hello.
    Quiet(String),
    /// A real worker of this job that cannot work with this driver.
    Fatal(ExecError),
}

/// The driver's side of the handshake: challenge, then the worker's
/// header is checked (magic, tag) before anything else in its frame is
/// believed; only an authenticated worker can fail the job (a version or
/// build mismatch).
async fn handshake(
    mut stream: TcpStream,
    secret: &kolo_auth::Secret,
    mut welcome: Welcome,
    workers: usize,
) -> Result<Hello, Refusal> {
    let quiet = |why: String| Refusal::Quiet(why);
    stream.set_nodelay(true).map_err(|e| quiet(e.to_string()))?;
    let nonce = kolo_auth::nonce();
    let challenge = Challenge { magic: MAGIC, version: PROTOCOL_VERSION, nonce };
    stream.write_all(&challenge.frame()).await.map_err(|e| quiet(e.to_string()))?;
    let frame = proto::read_frame_async(&mut stream, proto::MAX_PREAUTH_FRAME)
        .await
        .map_err(|e| quiet(format!("no hello: {e}")))?;
    let (header, body) = proto::parse_hello(&frame).ok_or_else(|| Refusal::Logged("not a kolo worker".into()))?;
    if header.magic != MAGIC {
        return Err(Refusal::Logged("not a kolo worker".into()));
    }
    let proof = |role| proto::ControlProof {
        role,
        nonces: (&nonce, &header.nonce),
        version: header.version,
        index: header.index,
        body,
    };
    if !proof(proto::Role::Dialer).verifies(secret, &header.tag) {
        return Err(Refusal::Logged(format!(
            "a peer claiming to be worker {} does not know the job secret",
            header.index
        )));
    }
    // authenticated from here on
    if header.version != PROTOCOL_VERSION {
        return Err(Refusal::Fatal(ExecError::Version { index: header.index, worker: header.version }));
    }
    let body: HelloBody = proto::decode(body).map_err(|e| Refusal::Logged(format!("unreadable hello: {e}")))?;
    if header.index as usize >= workers {
        return Err(Refusal::Logged(format!("worker index {} is out of range", header.index)));
    }
    welcome.tag = proof(proto::Role::Listener).tag(secret);
    let frame = proto::encode(&welcome).map_err(|e| quiet(e.to_string()))?;
    stream.write_all(&frame).await.map_err(|e| quiet(e.to_string()))?;
    Ok(Hello { header, body, stream })
}

/// Descriptors the driver needs per worker: its control connection and
/// its rendezvous traffic, with room for the rest of the process.
fn descriptors_needed(workers: usize) -> u64 {
    3 * workers as u64 + 64
}

/// Raises the descriptor limit toward its hard limit, as servers do, and
/// refuses a job that cannot fit, naming the limit.
fn check_descriptors(workers: usize) -> Result<(), ExecError> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let needed = descriptors_needed(workers);
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return Ok(()) };
    let mut soft = soft;
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        soft = hard;
    }
    if soft < needed {
        return Err(ExecError::DescriptorLimit { workers, needed, limit: soft });
    }
    Ok(())
}

fn nics_error(host: &str, message: String) -> ExecError {
    ExecError::Nics { host: Some(host.to_string()), message }
}

/// `--nics` names must exist on every host of the job.
fn check_nics(nics: &Option<Vec<String>>, plan: &Plan, hellos: &[Hello]) -> Result<(), ExecError> {
    let Some(nics) = nics else { return Ok(()) };
    for rep in plan.node_representatives() {
        let have = &hellos[rep].body.interfaces;
        if let Some(missing) = nics.iter().find(|n| !have.contains(n)) {
            let host = &plan.workers[rep].host.hostname;
            let message =
                format!("interface '{missing}' (--nics) does not exist on host {host}; it has: {}", have.join(", "));
            return Err(nics_error(host, message));
        }
    }
    Ok(())
}

/// Reads frames until `pick` accepts one (heartbeats and early output are
/// skipped), within `deadline`.
async fn await_reply<T>(
    stream: &mut TcpStream,
    deadline: Instant,
    what: &str,
    host: &str,
    mut pick: impl FnMut(ToDriver) -> Option<T>,
) -> Result<T, ExecError> {
    loop {
        let frame = tokio::time::timeout_at(deadline, proto::read_frame_async(stream, proto::MAX_FRAME))
            .await
            .map_err(|_| nics_error(host, format!("host {host} did not answer the {what} before the start timeout")))?
            .map_err(|e| nics_error(host, format!("host {host} was lost during the {what}: {e}")))?;
        let message: ToDriver = proto::decode(&frame)
            .map_err(|e| nics_error(host, format!("host {host}: unreadable {what} answer: {e}")))?;
        if let Some(reply) = pick(message) {
            return Ok(reply);
        }
    }
}

/// One agent per node lists and probes interfaces in a ring; see `nics`.
/// All workers on one node use `single_host` (loopback by default).
async fn detect_nics(
    plan: &Plan,
    hellos: &mut [Hello],
    deadline: Instant,
    single_host: Vec<String>,
) -> Result<(Vec<String>, Vec<kolo_agent::nics::PairReport>), ExecError> {
    let reps = plan.node_representatives();
    if reps.len() < 2 {
        let nics = if single_host.is_empty() { vec!["lo".to_string()] } else { single_host };
        return Ok((nics, Vec::new()));
    }
    let host = |i: usize| plan.workers[i].host.hostname.clone();
    let frame = |m: &ToWorker| proto::encode(m).map_err(|source| ExecError::Io { what: "encoding".into(), source });
    let listen = frame(&ToWorker::ProbeListen)?;
    for &r in &reps {
        hellos[r]
            .stream
            .write_all(&listen)
            .await
            .map_err(|e| nics_error(&host(r), format!("host {}: {e}", host(r))))?;
    }
    let mut listeners = Vec::new();
    for &r in &reps {
        let ready = await_reply(&mut hellos[r].stream, deadline, "interface listing", &host(r), |m| match m {
            ToDriver::ProbeReady { port, interfaces } => Some((port, interfaces)),
            _ => None,
        })
        .await?;
        listeners.push(ready);
    }
    // every probe gets what is left of the start timeout
    let timeout_ms = deadline.saturating_duration_since(Instant::now()).as_millis().max(100) as u64;
    for (k, &r) in reps.iter().enumerate() {
        let next = (k + 1) % reps.len();
        let (port, interfaces) = &listeners[next];
        let targets: Vec<(String, String, u16)> = interfaces
            .iter()
            .flat_map(|(name, addrs)| addrs.iter().map(move |a| (name.clone(), a.clone(), *port)))
            .collect();
        let probe = frame(&ToWorker::Probe { index: reps[next] as u32, targets, timeout_ms })?;
        hellos[r].stream.write_all(&probe).await.map_err(|e| nics_error(&host(r), format!("host {}: {e}", host(r))))?;
    }
    let mut pairs = Vec::new();
    for (k, &r) in reps.iter().enumerate() {
        let later = deadline + Duration::from_secs(1);
        let results = await_reply(&mut hellos[r].stream, later, "interface probe", &host(r), |m| match m {
            ToDriver::ProbeResult { results } => Some(results),
            _ => None,
        })
        .await?;
        pairs.push(kolo_agent::nics::PairReport { from: host(r), to: host(reps[(k + 1) % reps.len()]), results });
    }
    // the listeners are for these probes only
    let done = frame(&ToWorker::ProbeDone)?;
    for &r in &reps {
        hellos[r].stream.write_all(&done).await.map_err(|e| nics_error(&host(r), format!("host {}: {e}", host(r))))?;
    }
    let common = kolo_agent::nics::common(&pairs).map_err(|message| ExecError::Nics { host: None, message })?;
    Ok((common, pairs))
}

/// Rank 0's address on the first shared interface (loopback when the job
/// stays on one host or no shared interface has an address there) and a
/// port free on its host, asked of rank 0's agent.
async fn rank0_port(
    plan: &Plan,
    hellos: &mut [Hello],
    nics: &[String],
    deadline: Instant,
) -> Result<(String, u16), ExecError> {
    let host = plan.workers[0].host.hostname.clone();
    let ask = proto::encode(&ToWorker::ReservePorts { count: 1 })
        .map_err(|source| ExecError::Io { what: "encoding".into(), source })?;
    let stream = &mut hellos[0].stream;
    stream.write_all(&ask).await.map_err(|e| nics_error(&host, format!("host {host}: {e}")))?;
    let (ports, interfaces) = await_reply(stream, deadline, "port reservation", &host, |m| match m {
        ToDriver::PortsReserved { ports, interfaces } => Some((ports, interfaces)),
        _ => None,
    })
    .await?;
    let [port] = ports[..] else {
        return Err(nics_error(&host, format!("host {host} found no free port for rank 0")));
    };
    let multi_node = plan.node_representatives().len() > 1;
    let address = nics
        .iter()
        .filter(|_| multi_node)
        .find_map(|nic| interfaces.iter().find(|(name, _)| name == nic).and_then(|(_, addrs)| addrs.first().cloned()))
        .unwrap_or_else(|| "127.0.0.1".to_string());
    Ok((address, port))
}
