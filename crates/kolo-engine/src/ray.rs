//! The Ray engine: workers placed on a Ray cluster through Ray's public API,
//! as horovod.ray's strategies place them. A small Python bridge
//! (`ray_bridge.py`, run with a Python that has Ray) makes the placement
//! group (one bundle per host with STRICT_SPREAD for colocated, one per
//! worker with PACK), which holds the resources; it starts the agents of
//! its own node itself and those of every other node through a launcher
//! actor there (one per bundle when bundles have GPUs, whose ids Ray tells
//! only the actor holding them). Everything after that (registration,
//! ranks, rendezvous, collectives) is kolo's; Ray carries none of the
//! job's traffic.
//!
//! Faults: an agent's stdin is its lifeline to its launcher, so an actor or
//! node that dies takes its agents with it, and the bridge reports it. The
//! bridge ends with the driver (end of its stdin, or the janitor's
//! SIGTERM), and Ray removes what a finished job held.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kolo_topology::{HostResources, Placement, WorkerResources};
use serde_json::{json, Value};

use super::{Engine, WorkerLaunch};
use crate::{ExecError, WorkerRequest};
use kolo_proto::launch as worker;
use kolo_sys::guard::Guard;

const BRIDGE: &str = include_str!("ray_bridge.py");

/// Time for the bridge to start Python, import Ray and connect, on top of
/// the placement timeout.
const BRIDGE_START: Duration = Duration::from_secs(120);
/// How long the bridge may take to clean up before it is killed.
const BRIDGE_CLOSE: Duration = Duration::from_secs(15);
/// How often a closing bridge is looked at.
const BRIDGE_POLL: Duration = Duration::from_millis(20);
/// How long Ray may take to start the agents: its actors start Python
/// processes, seconds each on a busy node.
const AGENTS_START: Duration = Duration::from_secs(90);

/// Where the Ray cluster is and how to reach it.
#[derive(Clone, Debug)]
pub struct RayOptions {
    /// Ray's address (`ray.init(address=...)`); none: `RAY_ADDRESS`, else
    /// the cluster running on this machine.
    pub address: Option<String>,
    /// A Python that has Ray; it runs kolo's bridge.
    pub python: PathBuf,
    /// The hex id of a placement group to use instead of making one
    /// (horovod.ray's `use_current_placement_group`).
    pub placement_group: Option<String>,
    /// Runs the bridge in a Python connected to Ray already (the driver's
    /// own, in kolo.Executor) instead of starting `python`.
    pub bridge_host: Option<BridgeHost>,
}

/// Runs the bridge's source on a thread of a Python that has imported Ray
/// and connected (kolo-py's driver): starting a Python for it imports Ray
/// again and connects again, half a second of a start on one node.
pub trait RunsBridge: Send + Sync {
    /// Starts `source` in the background, reading requests from
    /// `requests` and writing answers and events to `answers`, each
    /// through a copy of its own (the caller closes its ends when this
    /// returns, whatever happened); the bridge cleans up and closes its
    /// `answers` when `requests` ends.
    fn start(&self, source: &str, requests: BorrowedFd<'_>, answers: BorrowedFd<'_>) -> std::io::Result<()>;
}

/// A `RunsBridge`, shared by the engines of one driver.
#[derive(Clone)]
pub struct BridgeHost(pub Arc<dyn RunsBridge>);

impl std::fmt::Debug for BridgeHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BridgeHost(in process)")
    }
}

impl Default for RayOptions {
    fn default() -> Self {
        RayOptions { address: None, python: "python3".into(), placement_group: None, bridge_host: None }
    }
}

/// Places workers on a Ray cluster through the bridge: in a placement
/// group (made, or the one named in the options), or on pinned nodes.
pub struct RayEngine {
    options: RayOptions,
    request: WorkerRequest,
    /// The nodes (Ray node ids) and workers on each an elastic job's
    /// cohort asked for (`on_nodes`); none: a placement group places them.
    pinned: Option<Vec<kolo_topology::HostSpec>>,
    bridge: Option<Bridge>,
    /// The node of each bundle of the placement group, in bundle order.
    bundle_nodes: Vec<String>,
    /// Workers each bundle takes, in bundle order.
    bundle_slots: Vec<u32>,
    gcs_host: Option<String>,
    spawned: Vec<u32>,
    reported: HashSet<u32>,
    kill_sent: Option<Instant>,
}

struct Bridge {
    /// The bridge's process; none where it runs in the driver's Python.
    child: Option<Child>,
    stdin: Option<std::fs::File>,
    /// The bridge closed its answers (it ended, wherever it runs).
    closed: Arc<AtomicBool>,
    // in mutexes only so that an engine may be shared between threads (Sync)
    answers: Mutex<Receiver<Value>>,
    events: Mutex<Receiver<(u32, String)>>,
    stderr_tail: Arc<Mutex<Vec<String>>>,
}

fn ray_err(detail: impl std::fmt::Display) -> ExecError {
    ExecError::Ray(detail.to_string())
}

impl Bridge {
    /// The bridge for `options`: in the driver's own Python where it has
    /// one connected to Ray, else a new `python`.
    fn start(options: &RayOptions) -> Result<Bridge, ExecError> {
        let (stdin, answers, stderr, child): (std::fs::File, std::fs::File, _, _) = match &options.bridge_host {
            Some(host) => {
                let pipe = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from);
                let ((requests, to_bridge), (from_bridge, answers)) = pipe()
                    .and_then(|requests| Ok((requests, pipe()?)))
                    .map_err(|e| ray_err(format!("cannot make pipes for the Ray bridge: {e}")))?;
                host.0
                    .start(BRIDGE, requests.as_fd(), answers.as_fd())
                    .map_err(|e| ray_err(format!("cannot start the Ray bridge in this Python: {e}")))?;
                (std::fs::File::from(to_bridge), std::fs::File::from(from_bridge), None, None)
            }
            None => {
                let mut child = Command::new(&options.python)
                    .arg("-c")
                    .arg(BRIDGE)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    // its own group: a Ctrl-C meant for kolo reaches kolo, which
                    // tears the job down in order
                    .process_group(0)
                    .spawn()
                    .map_err(|e| {
                        ray_err(format!(
                            "cannot run {} for the Ray bridge: {e} (give a Python with Ray)",
                            options.python.display()
                        ))
                    })?;
                let stdin = std::fs::File::from(OwnedFd::from(child.stdin.take().expect("piped")));
                let stdout = std::fs::File::from(OwnedFd::from(child.stdout.take().expect("piped")));
                let stderr = child.stderr.take();
                (stdin, stdout, stderr, Some(child))
            }
        };
        let (answer_tx, answers_rx) = mpsc::channel();
        let (event_tx, events) = mpsc::channel();
        let closed = Arc::new(AtomicBool::new(false));
        let reading = closed.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(answers).lines().map_while(Result::ok) {
                let Ok(message) = serde_json::from_str::<Value>(&line) else { continue };
                match (message.get("exited").and_then(Value::as_u64), message.get("reason").and_then(Value::as_str)) {
                    (Some(index), Some(reason)) => {
                        let _ = event_tx.send((index as u32, reason.to_string()));
                    }
                    _ => {
                        let _ = answer_tx.send(message);
                    }
                }
            }
            reading.store(true, Ordering::Release);
        });
        let stderr_tail = Arc::new(Mutex::new(Vec::new()));
        if let Some(stderr) = stderr {
            let tail = stderr_tail.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    tracing::debug!(target: "kolo_exec::ray_bridge", "{line}");
                    let mut tail = kolo_sys::lock(&tail);
                    tail.push(line);
                    let excess = tail.len().saturating_sub(20);
                    tail.drain(..excess);
                }
            });
        }
        Ok(Bridge {
            stdin: Some(stdin),
            child,
            closed,
            answers: Mutex::new(answers_rx),
            events: Mutex::new(events),
            stderr_tail,
        })
    }

    fn send(&mut self, message: &Value) -> Result<(), ExecError> {
        let stdin = self.stdin.as_mut().ok_or_else(|| ray_err("the bridge is closed"))?;
        writeln!(stdin, "{message}")
            .and_then(|_| stdin.flush())
            .map_err(|e| ray_err(format!("the bridge is gone ({e}){}", self.last_words())))
    }

    /// The answer to the request just sent, within `limit`.
    fn answer(&mut self, what: &str, limit: Duration) -> Result<Value, ExecError> {
        let answer = match kolo_sys::lock(&self.answers).recv_timeout(limit) {
            Ok(answer) => answer,
            Err(RecvTimeoutError::Timeout) => {
                return Err(ray_err(format!(
                    "no answer from the bridge to {what} within {} s{}",
                    limit.as_secs(),
                    self.last_words()
                )))
            }
            Err(RecvTimeoutError::Disconnected) => {
                if let Some(child) = self.child.as_mut() {
                    let _ = child.wait();
                }
                return Err(ray_err(format!("the bridge exited during {what}{}", self.last_words())));
            }
        };
        match answer.get("error").and_then(Value::as_str) {
            Some(error) if answer.get("timed_out").and_then(Value::as_bool) == Some(true) => {
                Err(ExecError::PlacementTimeout { engine: "ray", detail: error.to_string() })
            }
            Some(error) => Err(ray_err(error)),
            None => Ok(answer),
        }
    }

    fn last_words(&self) -> String {
        let tail = kolo_sys::lock(&self.stderr_tail);
        // the end of a Python traceback says what went wrong
        let said: Vec<&str> = tail.iter().rev().filter(|l| !l.trim().is_empty()).take(3).map(String::as_str).collect();
        if said.is_empty() {
            String::new()
        } else {
            format!(": {}", said.into_iter().rev().collect::<Vec<_>>().join(" / "))
        }
    }

    fn exited(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(Some(_))),
            None => self.closed.load(Ordering::Acquire),
        }
    }

    /// Ends a bridge that did not finish in time: its process is killed;
    /// one in the driver's Python has its requests closed and finishes by
    /// itself (nothing else can end a thread of it).
    fn kill(&mut self) {
        self.stdin = None;
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl RayEngine {
    /// An engine that places `request` with a placement group (the bridge
    /// starts when the driver first asks for hosts).
    pub fn new(options: RayOptions, request: WorkerRequest) -> Self {
        RayEngine {
            options,
            request,
            pinned: None,
            bridge: None,
            bundle_nodes: Vec::new(),
            bundle_slots: Vec::new(),
            gcs_host: None,
            spawned: Vec::new(),
            reported: HashSet::new(),
            kill_sent: None,
        }
    }

    /// Workers on the given Ray nodes (`HostSpec` names are node ids, slots
    /// the workers there), each node's held by kolo's launcher on it, not
    /// by a placement group: an elastic job's cohort, on the nodes its
    /// membership chose.
    pub fn on_nodes(options: RayOptions, request: WorkerRequest, nodes: Vec<kolo_topology::HostSpec>) -> Self {
        let mut engine = RayEngine::new(options, request);
        engine.pinned = Some(nodes);
        engine
    }

    /// The bundles to ask for, Ray's strategy for them, and the workers
    /// each takes: horovod.ray's bundle per host or per worker; on pinned
    /// nodes, one per node (per worker with GPUs, whose ids only the actor
    /// holding them learns).
    fn bundles_asked(&self) -> (Vec<Value>, &'static str, Vec<u32>) {
        let WorkerResources { cpus, gpus } = self.request.resources;
        let bundle = |workers: u32| {
            let mut b = serde_json::Map::new();
            b.insert("CPU".into(), json!(cpus * workers));
            // Ray refuses resources of zero in a bundle
            if gpus > 0 {
                b.insert("GPU".into(), json!(gpus * workers));
            }
            Value::Object(b)
        };
        if let Some(nodes) = &self.pinned {
            let (mut bundles, mut slots) = (Vec::new(), Vec::new());
            for node in nodes {
                let (count, each) = if gpus > 0 { (node.slots, 1) } else { (1, node.slots) };
                bundles.extend(std::iter::repeat_n(bundle(each), count as usize));
                slots.extend(std::iter::repeat_n(each, count as usize));
            }
            return (bundles, "NODES", slots);
        }
        match self.request.placement {
            Placement::Pack { num_workers } => {
                (vec![bundle(1); num_workers as usize], "PACK", vec![1; num_workers as usize])
            }
            Placement::Colocated { num_hosts, workers_per_host } => (
                vec![bundle(workers_per_host); num_hosts as usize],
                "STRICT_SPREAD",
                vec![workers_per_host; num_hosts as usize],
            ),
        }
    }

    /// The node of each bundle on pinned nodes, in bundle order.
    fn pinned_bundle_nodes(&self) -> Option<Vec<String>> {
        let nodes = self.pinned.as_ref()?;
        let per_worker = self.request.resources.gpus > 0;
        Some(
            nodes
                .iter()
                .flat_map(|n| std::iter::repeat_n(n.name.clone(), if per_worker { n.slots as usize } else { 1 }))
                .collect(),
        )
    }
}

impl Engine for RayEngine {
    fn name(&self) -> &'static str {
        "ray"
    }

    /// Places the job on the cluster: the nodes its bundles landed on, in
    /// bundle order, with their CPUs and the GPU ids Ray gave them.
    fn hosts(&mut self, placement_timeout: Duration) -> Result<Vec<HostResources>, ExecError> {
        let (bundles, strategy, bundle_slots) = self.bundles_asked();
        let mut bridge = Bridge::start(&self.options)?;
        bridge.send(&json!({
            "op": "place",
            "address": self.options.address,
            "bundles": bundles,
            "strategy": strategy,
            "placement_group": self.options.placement_group,
            "nodes": self.pinned_bundle_nodes(),
            "timeout_s": placement_timeout.as_secs_f64(),
        }))?;
        self.bundle_slots = bundle_slots;
        self.bridge = Some(bridge);
        let bridge = self.bridge.as_mut().expect("just set");
        let answer = bridge.answer("placement", placement_timeout + BRIDGE_START)?;
        self.gcs_host = answer.get("gcs_host").and_then(Value::as_str).map(String::from);
        let placed = answer
            .get("placed")
            .and_then(Value::as_array)
            .ok_or_else(|| ray_err("the bridge's placement answer has no bundles"))?;
        let cpus_per_worker = self.request.resources.cpus;
        let mut hosts: Vec<HostResources> = Vec::new();
        for (p, &slots) in placed.iter().zip(&self.bundle_slots) {
            let field = |name: &str| p.get(name).and_then(Value::as_str).map(String::from);
            let node_id = field("node_id").ok_or_else(|| ray_err("a bundle without a node id"))?;
            let gpu_ids: Vec<u32> = p
                .get("gpu_ids")
                .and_then(Value::as_array)
                .map(|ids| ids.iter().filter_map(Value::as_u64).map(|g| g as u32).collect())
                .unwrap_or_default();
            self.bundle_nodes.push(node_id.clone());
            match hosts.iter_mut().find(|h| h.node_id == node_id) {
                Some(host) => {
                    host.cpus += slots * cpus_per_worker;
                    host.gpus.extend(gpu_ids);
                }
                None => hosts.push(HostResources {
                    hostname: field("hostname").unwrap_or_else(|| node_id.clone()),
                    node_id,
                    cpus: slots * cpus_per_worker,
                    gpus: gpu_ids,
                }),
            }
        }
        Ok(hosts)
    }

    fn driver_addr(&self) -> IpAddr {
        super::ssh::route_to(self.gcs_host.as_deref().unwrap_or("127.0.0.1"), 6379)
    }

    fn default_nics(&self) -> Vec<String> {
        Vec::new()
    }

    fn spawn(&mut self, workers: Vec<WorkerLaunch>, janitor: &Guard) -> Result<(), ExecError> {
        let mut free = self.bundle_slots.clone();
        let bridge = self.bridge.as_mut().ok_or_else(|| ray_err("spawn before placement"))?;
        if let Some(child) = &bridge.child {
            let _ = janitor.watch_group(child.id());
        }
        let mut launches = Vec::with_capacity(workers.len());
        for w in &workers {
            let bundle = (0..self.bundle_nodes.len())
                .find(|&b| free[b] > 0 && self.bundle_nodes[b] == w.host.node_id)
                .ok_or_else(|| ray_err(format!("no bundle left on node {} for worker {}", w.host.node_id, w.index)))?;
            free[bundle] -= 1;
            let mut env: serde_json::Map<String, Value> = w.env.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
            env.insert(worker::env::SECRET_ON_STDIN.into(), json!("1"));
            env.insert(worker::env::STDIN_LIFELINE.into(), json!("1"));
            launches.push(json!({
                "index": w.index,
                "bundle": bundle,
                "program": w.program.to_string_lossy(),
                "args": w.args.iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>(),
                "env": env,
            }));
        }
        let secret = workers.first().map(|w| w.secret.clone()).unwrap_or_default();
        bridge.send(&json!({"op": "spawn", "secret": secret, "workers": launches}))?;
        bridge.answer("starting the agents", AGENTS_START)?;
        self.spawned = workers.iter().map(|w| w.index).collect();
        Ok(())
    }

    fn exited(&mut self) -> Vec<(u32, String)> {
        let Some(bridge) = self.bridge.as_mut() else { return Vec::new() };
        let mut out: Vec<(u32, String)> =
            kolo_sys::lock(&bridge.events).try_iter().filter(|(i, _)| self.reported.insert(*i)).collect();
        if self.kill_sent.is_none() && bridge.exited() {
            let why = format!("kolo's Ray bridge exited{}", bridge.last_words());
            for &index in &self.spawned {
                if self.reported.insert(index) {
                    out.push((index, why.clone()));
                }
            }
        }
        out
    }

    fn all_exited(&mut self) -> bool {
        let Some(bridge) = self.bridge.as_mut() else { return true };
        if bridge.exited() {
            return true;
        }
        // a bridge that does not finish cleaning up in time is killed; Ray
        // then removes what its job held
        if self.kill_sent.is_some_and(|sent| sent.elapsed() > BRIDGE_CLOSE) {
            bridge.kill();
        }
        false
    }

    fn kill_all(&mut self) {
        let Some(bridge) = self.bridge.as_mut() else { return };
        if self.kill_sent.is_none() {
            self.kill_sent = Some(Instant::now());
            let _ = bridge.send(&json!({"op": "kill"}));
            bridge.stdin = None;
        }
    }
}

impl Drop for RayEngine {
    fn drop(&mut self) {
        self.kill_all();
        kolo_sys::wait::wait_until(Instant::now() + BRIDGE_CLOSE, BRIDGE_POLL, || self.all_exited());
        if let Some(bridge) = self.bridge.as_mut() {
            bridge.kill();
        }
    }
}

/// The Ray cluster's alive nodes as an elastic job's hosts, each with as
/// many slots as workers of `resources` fit in its CPUs (and GPUs), as
/// horovod.ray's elastic discovery counts them. Named by node id: nodes
/// may share a host name and an address. One bridge answers every poll.
pub struct RayNodes {
    options: RayOptions,
    resources: WorkerResources,
    bridge: Mutex<Option<Bridge>>,
}

impl std::fmt::Debug for RayNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RayNodes").field("address", &self.options.address).finish()
    }
}

impl RayNodes {
    /// Nodes counted in slots of workers that each take `resources`.
    pub fn new(options: RayOptions, resources: WorkerResources) -> Self {
        RayNodes { options, resources, bridge: Mutex::new(None) }
    }

    /// Slots of a node with these resources (Ray counts CPUs as floats).
    fn slots(&self, cpus: f64, gpus: f64) -> u32 {
        let WorkerResources { cpus: per_cpu, gpus: per_gpu } = self.resources;
        let by_cpu = (cpus / f64::from(per_cpu.max(1))).floor();
        let slots = if per_gpu > 0 { by_cpu.min((gpus / f64::from(per_gpu)).floor()) } else { by_cpu };
        slots.clamp(0.0, f64::from(kolo_topology::MAX_PROCESSES)) as u32
    }

    fn ask(bridge: &mut Bridge, address: &Option<String>) -> Result<Value, ExecError> {
        bridge.send(&json!({"op": "nodes", "address": address}))?;
        bridge.answer("listing the Ray cluster's nodes", BRIDGE_START)
    }
}

impl super::HostSource for RayNodes {
    fn hosts(&self) -> Result<Vec<kolo_topology::HostSpec>, ExecError> {
        let mut held = kolo_sys::lock(&self.bridge);
        if held.as_mut().is_none_or(Bridge::exited) {
            *held = Some(Bridge::start(&self.options)?);
        }
        let bridge = held.as_mut().expect("just started");
        let answer = match Self::ask(bridge, &self.options.address) {
            Ok(answer) => answer,
            Err(e) => {
                // a late answer would be taken for the next one: start afresh
                if let Some(mut gone) = held.take() {
                    gone.kill();
                }
                return Err(e);
            }
        };
        let nodes =
            answer.get("nodes").and_then(Value::as_array).ok_or_else(|| ray_err("the bridge listed no nodes"))?;
        let mut hosts = Vec::new();
        for node in nodes {
            let Some(id) = node.get("node_id").and_then(Value::as_str) else { continue };
            let number = |name: &str| node.get(name).and_then(Value::as_f64).unwrap_or(0.0);
            let slots = self.slots(number("cpus"), number("gpus"));
            if slots > 0 {
                hosts.push(kolo_topology::HostSpec::new(id.to_string(), slots));
            }
        }
        Ok(hosts)
    }
}

impl Drop for RayNodes {
    fn drop(&mut self) {
        let held = self.bridge.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(mut bridge) = held.take() {
            let _ = bridge.send(&json!({"op": "kill"}));
            bridge.stdin = None;
            kolo_sys::wait::wait_until(Instant::now() + BRIDGE_CLOSE, BRIDGE_POLL, || bridge.exited());
            bridge.kill();
        }
    }
}
