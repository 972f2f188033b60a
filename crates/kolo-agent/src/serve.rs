//! The serve loop: the driver's messages acted on in order, calls run on
//! this thread, heartbeats both ways, and what must not wait for a call.

use std::any::Any;
use std::collections::{BTreeMap, HashSet};
use std::io::{self, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;

use kolo_proto::proto::{CallKind, ToDriver, ToWorker};
use kolo_proto::registry::{Registry, ReportError, Reporter, WorkerContext};
use kolo_sys::process::signal_group;

use crate::handshake::real_hostname;
use crate::own_output::redirect_own_output;
use crate::{command, Agent};

use crate::reader::FrameReader;
use crate::reading::Reading;

pub(crate) fn heartbeat(agent: &Agent, interval: Duration, timeout: Duration) {
    loop {
        std::thread::sleep(interval);
        if agent.left.load(Ordering::SeqCst) {
            return;
        }
        let ended = kolo_sys::lock(&agent.command).as_mut().and_then(|running| running.end_if_stopped(timeout));
        if let Some(why) = ended {
            agent.say(&why);
        }
        let pid = agent.rank_pid();
        kolo_sys::lock(&agent.cpu).look(pid);
        if let Err(e) = agent.send(&ToDriver::Heartbeat) {
            agent.say(&format!("lost the driver ({e}); stopping"));
            agent.exit(1, Duration::ZERO);
        }
        let silent =
            agent.started.elapsed().saturating_sub(Duration::from_millis(agent.last_heard_ms.load(Ordering::Relaxed)));
        if silent > timeout && !agent.not_reading.load(Ordering::Relaxed) {
            agent.say(&format!("no word from the driver for {:.1} s; stopping", silent.as_secs_f64()));
            agent.exit(1, Duration::ZERO);
        }
    }
}

/// What the worker holds between calls.
pub(crate) struct State {
    env: Vec<(String, String)>,
    ctx: WorkerContext,
    executable: Option<Box<dyn Any + Send>>,
}

/// Calls (and constructors) queued or running, and the calls cancelled
/// before they ran: the threads that read the driver's messages and the
/// thread that runs calls share them.
#[derive(Default)]
pub(crate) struct Calls {
    pub(crate) pending: AtomicU64,
    pub(crate) cancelled: Mutex<HashSet<u64>>,
}

/// Acts on the driver's messages in order, on this thread (calls run here:
/// Python's signal handlers need its main thread), and reads them itself
/// while no call runs. Once the user's code has run (an executable's
/// constructor, a call), a helper thread stands by to read during calls
/// that run long (`reading`), so that what must not wait for the user's
/// code does not: the driver's heartbeats, `Cancel`, `WhoOwns`,
/// `Inspect`, and `Stop`, which ends a call that runs or waits (the driver
/// is shutting the job down, as horovod.ray's shutdown kills its actors
/// mid-call). A command job never needs the helper.
pub(crate) fn serve(agent: &Arc<Agent>, registry: &Registry, stream: TcpStream) -> Result<i32, String> {
    let calls = &agent.calls;
    let mut state = State { env: Vec::new(), ctx: WorkerContext::default(), executable: None };
    let mut first_reader = Some(FrameReader::new(stream));
    let mut reading: Option<Arc<Reading>> = None;
    loop {
        let queued = reading.as_ref().and_then(|r| r.next_queued());
        let message = match queued {
            Some(message) => message,
            None => {
                let mut user_code = None;
                let mut own_reader;
                let reader = match (&reading, &mut first_reader) {
                    (Some(r), _) => {
                        own_reader = r.reader();
                        &mut *own_reader
                    }
                    (None, Some(reader)) => reader,
                    (None, None) => unreachable!("the reader is in `reading` once there"),
                };
                let read = read_batch(agent, reader, true, |message| {
                    if runs_user_code(&message) {
                        // the rest of what was read stays in the reader
                        calls.pending.fetch_add(1, Ordering::SeqCst);
                        user_code.get_or_insert(message);
                        return Ok(false);
                    }
                    agent.not_reading.store(true, Ordering::Relaxed);
                    handle(agent, registry, &mut state, message);
                    // what arrived meanwhile is read next: count the driver heard
                    agent.heard();
                    agent.not_reading.store(false, Ordering::Relaxed);
                    Ok(true)
                });
                if let Err(e) = read {
                    lost_driver(agent, &e);
                }
                match user_code {
                    Some(message) => message,
                    None => continue,
                }
            }
        };
        if !runs_user_code(&message) {
            // read by the helper during a call, after it: in order
            handle(agent, registry, &mut state, message);
            continue;
        }
        let reading = match &reading {
            Some(reading) => reading.clone(),
            None => reading.insert(start_reading(agent, first_reader.take().expect("read until now"))?).clone(),
        };
        let skip = match &message {
            ToWorker::Call { id, .. } => kolo_sys::lock(&calls.cancelled).remove(id),
            _ => false,
        };
        if !skip {
            reading.call_starts().map_err(|e| format!("cannot arm the reading timer: {e}"))?;
            handle(agent, registry, &mut state, message);
            reading.call_ended().map_err(|e| format!("cannot take the reading back: {e}"))?;
        }
        calls.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Before the user's code first runs: its output goes to the driver, and
/// the helper that reads during long calls stands by.
pub(crate) fn start_reading(agent: &Arc<Agent>, reader: FrameReader) -> Result<Arc<Reading>, String> {
    if agent.host.is_some() {
        agent.say("an agent that shares its process with others runs OS commands only, not calls; stopping");
        agent.exit(1, Duration::ZERO);
    }
    if let Err(e) = redirect_own_output(agent) {
        agent.say(&format!("cannot redirect output: {e}; stopping"));
        agent.exit(1, Duration::ZERO);
    }
    let reading = Reading::new(reader).map_err(|e| format!("cannot set up reading during calls: {e}"))?;
    let (helper_agent, helper_reading) = (agent.clone(), reading.clone());
    std::thread::Builder::new()
        .name(format!("kolo-read-{}", agent.index))
        .spawn(move || {
            let agent = helper_agent;
            let served = helper_reading.serve_helper(|reader, queue| {
                read_batch(&agent, reader, false, |message| {
                    if runs_user_code(&message) {
                        agent.calls.pending.fetch_add(1, Ordering::SeqCst);
                    }
                    queue(message);
                    Ok(true)
                })
            });
            if let Err(e) = served {
                lost_driver(&agent, &e);
            }
        })
        .map_err(|e| format!("cannot start the reading helper: {e}"))?;
    Ok(reading)
}

pub(crate) fn lost_driver(agent: &Agent, e: &io::Error) -> ! {
    agent.say(&format!("lost the driver ({e}); stopping"));
    agent.exit(1, Duration::ZERO)
}

/// Calls and the executable's constructor run the user's code, which may
/// take as long as it likes: a `Stop` does not wait for them.
pub(crate) fn runs_user_code(message: &ToWorker) -> bool {
    matches!(message, ToWorker::Call { .. } | ToWorker::Create { .. })
}

/// Reads what has arrived (waiting for it if `block`), answers at once what must not
/// wait for the user's code, and gives the rest to `then` in order, while
/// it says to go on.
pub(crate) fn read_batch(
    agent: &Arc<Agent>,
    reader: &mut FrameReader,
    block: bool,
    mut then: impl FnMut(ToWorker) -> io::Result<bool>,
) -> io::Result<()> {
    let calls = &agent.calls;
    // frames left from the last batch come first, without waiting
    if !(block && reader.has_frame()) {
        reader.fill(block)?;
        agent.heard();
    }
    while let Some(message) = reader.frame()? {
        match message {
            ToWorker::Heartbeat => {}
            ToWorker::Cancel { id } => {
                kolo_sys::lock(&calls.cancelled).insert(id);
            }
            ToWorker::Stop if calls.pending.load(Ordering::SeqCst) > 0 => agent.exit(0, agent.kill_grace),
            ToWorker::ProbeDone => crate::nics::stop_listening(),
            ToWorker::ClockProbe { id } => {
                agent.send(&ToDriver::ClockReading { id, unix_ns: kolo_timeline::now_ns() })?;
            }
            ToWorker::WhoOwns { id, client, server } => {
                let host = format!("host {}", real_hostname());
                let answer = kolo_sys::sockets::owned_by_this_user(client, server, &host);
                agent.send(&ToDriver::SocketOwner { id, answer })?;
            }
            ToWorker::Inspect { id, stacks, py_spy } => {
                // a stack dump takes a while: not on this thread
                let agent = agent.clone();
                std::thread::spawn(move || {
                    let answer = agent.inspect(stacks.then_some(py_spy));
                    let _ = agent.send(&ToDriver::Inspected { id, answer });
                });
            }
            other => {
                if !then(other)? {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

pub(crate) fn handle(agent: &Arc<Agent>, registry: &Registry, state: &mut State, message: ToWorker) {
    let reply = match message {
        ToWorker::Heartbeat
        | ToWorker::Cancel { .. }
        | ToWorker::ProbeDone
        | ToWorker::ClockProbe { .. }
        | ToWorker::WhoOwns { .. }
        | ToWorker::Inspect { .. } => return,
        ToWorker::SetEnv(vars) => {
            // user code in this process reads its rank from the environment;
            // SetEnv comes once, right after the handshake, while this
            // thread is the only one that touches the environment. Agents
            // that share a process run no code of the user's in it
            if agent.host.is_none() {
                for (k, v) in &vars {
                    std::env::set_var(k, v);
                }
                // an executor's worker runs its calls here; a command job's
                // agent (the one with a guard) gives its command a file instead
                let functions = kolo_sys::lock(&agent.guard).is_none();
                if functions && vars.iter().any(|(k, v)| k == kolo_timeline::WANTED_VAR && v == "1") {
                    agent.record_own_timeline();
                }
            }
            state.env.extend(vars);
            state.ctx =
                WorkerContext::new(state.env.iter().cloned().collect::<BTreeMap<_, _>>(), Some(reporter(agent)));
            return;
        }
        ToWorker::StartCommand { argv } => return command::start_command(agent, &argv, &state.env),
        ToWorker::SignalCommand { signal } => {
            let group = kolo_sys::lock(&agent.command).as_ref().map(|r| r.group);
            if let (Some(group), Ok(signal)) = (group, Signal::try_from(signal)) {
                signal_group(group, signal);
            }
            return;
        }
        ToWorker::Stop => agent.exit(0, agent.kill_grace),
        ToWorker::ProbeListen => match crate::nics::listen(agent.index, agent.secret.clone()) {
            Ok((port, interfaces)) => ToDriver::ProbeReady { port, interfaces },
            Err(e) => {
                agent.say(&format!("cannot listen for interface probes: {e}"));
                ToDriver::ProbeReady { port: 0, interfaces: Vec::new() }
            }
        },
        ToWorker::ReservePorts { count } => {
            // bound together so they differ, released for the frameworks
            let listeners: Vec<std::net::TcpListener> =
                (0..count).filter_map(|_| std::net::TcpListener::bind("0.0.0.0:0").ok()).collect();
            let ports = listeners.iter().filter_map(|l| l.local_addr().ok()).map(|a| a.port()).collect();
            ToDriver::PortsReserved { ports, interfaces: crate::nics::interfaces() }
        }
        ToWorker::Probe { index, targets, timeout_ms } => ToDriver::ProbeResult {
            results: crate::nics::probe(index, &targets, &agent.secret, Duration::from_millis(timeout_ms)),
        },
        ToWorker::Create { name, args } => {
            let result = registry.create(&name, &args, &state.ctx).map(|made| state.executable = Some(made));
            ToDriver::Created { result }
        }
        ToWorker::Call { id, kind, name, args } => {
            agent.current_call.store(id, Ordering::Relaxed);
            let result = match kind {
                CallKind::Task => registry.run_task(&name, &args, state.executable.as_deref_mut(), &state.ctx),
                CallKind::Function => registry.run_function(&name, &args, &state.ctx),
            };
            agent.current_call.store(0, Ordering::Relaxed);
            ToDriver::Done { id, result }
        }
    };
    // what the call printed goes out before its result
    let _ = io::stdout().flush();
    if let Err(e) = agent.send(&reply) {
        agent.say(&format!("lost the driver ({e}); stopping"));
        agent.exit(1, Duration::ZERO);
    }
}

/// Reports go out tagged with the call running when they are made.
pub(crate) fn reporter(agent: &Arc<Agent>) -> Reporter {
    let agent = Arc::clone(agent);
    Reporter::new(move |data| match agent.current_call.load(Ordering::Relaxed) {
        0 => Err(ReportError::NoCall),
        id => Ok(agent.send(&ToDriver::Report { id, data })?),
    })
}

pub(crate) fn libc_signal(signal: Signal) -> i32 {
    signal as i32
}
