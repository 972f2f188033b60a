//! `kolo run`: a fixed job, or an elastic one in place or in restart
//! mode, built from the one job description (`spec`); what happens is
//! said on stderr.

use anyhow::Result;
use kolo_exec::JobOutcome;
use kolo_job::elastic::{CommandWork, ElasticEvent, ElasticJob, RestartJob};
use kolo_job::{ElasticMode, Job};
use nix::sys::signal::Signal;

use crate::cli::RunArgs;
use crate::out::tell;
use crate::spec::CLI_NAMES;

pub(crate) async fn run(args: RunArgs, worker: crate::WorkerProgram) -> Result<i32> {
    let mut ended = Ended::default();
    let code = run_to_end(&args, worker, &mut ended).await;
    if let Some(path) = &args.outcome_file {
        ended.exit_code = *code.as_ref().unwrap_or(&2);
        if let Err(e) = &code {
            ended.error = Some(format!("{e:#}"));
        }
        std::fs::write(path, serde_json::to_vec(&ended)?)
            .map_err(|e| anyhow::anyhow!("cannot write --outcome-file {}: {e}", path.display()))?;
    }
    code
}

/// How a job ended, for `--outcome-file`.
#[derive(Default, serde::Serialize)]
struct Ended {
    exit_code: i32,
    /// The rank that failed first in a fixed job: (rank, host, how).
    failed: Option<(u32, String, String)>,
    /// Why an elastic job stopped: the limit's kind and the sentence.
    stopped: Option<(&'static str, String)>,
    /// The signal that stopped the job.
    interrupted_by: Option<&'static str>,
    /// An error that ended kolo before or instead of the job.
    error: Option<String>,
}

async fn run_to_end(args: &RunArgs, worker: crate::WorkerProgram, ended: &mut Ended) -> Result<i32> {
    let job = crate::spec::job(args, &worker)?;
    if args.dry_run {
        if job.is_elastic() {
            anyhow::bail!("--dry-run shows a fixed job: drop {}", crate::spec::CLI_NAMES.elastic_options);
        }
        return crate::dry_run::dry_run(&job).await;
    }
    let hang = job.hang_timeout();
    if let Some(file) = &args.timeline {
        if job.is_elastic() {
            anyhow::bail!("--timeline records a fixed job; drop it or {}", CLI_NAMES.elastic_options);
        }
        // a job that trains for hours must not lose its timeline to a typo
        kolo_timeline::check_trace_file(file).map_err(|e| anyhow::anyhow!("--timeline {e}"))?;
    }
    match job.elastic_mode() {
        Some(ElasticMode::InPlace) => run_in_place(&job, &args.command, ended).await,
        Some(ElasticMode::Restart) => run_restarting(&job, &args.command, ended).await,
        None => {
            let hung = std::sync::Arc::new(std::sync::Mutex::new(None));
            let outcome =
                run_job(&job, &args.command, stop_signal(), hang, hung.clone(), args.timeline.as_deref()).await?;
            let report_text = hung.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(text) = report_text {
                // the hang is the news, not the SIGTERM that ended it
                for line in text.lines() {
                    tell(&format!("kolo: {line}"));
                }
                return Ok(1);
            }
            report(&outcome);
            ended.failed = outcome.failure.as_ref().map(|f| (f.rank, f.host.clone(), f.cause.to_string()));
            ended.interrupted_by = outcome.interrupted_by.map(|s| s.as_str());
            Ok(outcome.exit_code)
        }
    }
}

/// Runs a fixed job to its end. `interrupt` resolves when kolo is asked
/// to stop (SIGINT/SIGTERM); the job is then torn down like on a failure.
async fn run_job(
    job: &Job,
    command: &[std::ffi::OsString],
    interrupt: impl std::future::Future<Output = Signal>,
    hang_timeout: Option<std::time::Duration>,
    hung: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    timeline: Option<&std::path::Path>,
) -> Result<JobOutcome> {
    tokio::pin!(interrupt);
    let mut executor = tokio::select! {
        made = job.executor() => made?,
        signal = &mut interrupt => return Ok(interrupted(signal)),
    };
    if let Some(file) = timeline {
        executor.record_timeline(file.to_path_buf());
    }
    let started = tokio::select! {
        started = executor.start_command(command, job.env()) => started,
        signal = &mut interrupt => {
            executor.shutdown().await;
            return Ok(interrupted(signal));
        }
    };
    if let Err(e) = started {
        executor.shutdown().await;
        return Err(e.into());
    }
    note_omp_default(command, job.env(), &executor);
    // a hang ends the job as a signal would, its report kept for the end
    let watch = watch_for_hang(executor.inspector(), hang_timeout, hung);
    let tally = std::sync::Arc::new(std::sync::Mutex::new(kolo_exec::hang::StragglerTally::default()));
    let stragglers = tally_stragglers(executor.inspector(), tally.clone());
    let started = std::time::Instant::now();
    let interrupt = async move {
        tokio::select! {
            signal = interrupt => signal,
            () = watch => Signal::SIGTERM,
            () = stragglers => unreachable!("the tally never ends"),
        }
    };
    let outcome = executor.wait_command(interrupt).await;
    if started.elapsed() >= STRAGGLER_SUMMARY_AFTER {
        if let Some(line) = tally.lock().unwrap_or_else(|p| p.into_inner()).summary() {
            tell(&format!("kolo: {line}"));
        }
    }
    executor.shutdown().await;
    for line in executor.timeline_report() {
        tell(&format!("kolo: {line}"));
    }
    Ok(outcome?)
}

/// Jobs at least this long say at their end which rank, if one, the
/// others waited for most of the time.
const STRAGGLER_SUMMARY_AFTER: std::time::Duration = std::time::Duration::from_secs(60);
/// How often the ranks' waiting is tallied for that line.
const STRAGGLER_WINDOW: std::time::Duration = std::time::Duration::from_secs(5);

/// Tallies, window by window, which rank the others waited for; never ends.
async fn tally_stragglers(
    inspector: Option<kolo_exec::control::Inspector>,
    tally: std::sync::Arc<std::sync::Mutex<kolo_exec::hang::StragglerTally>>,
) {
    let Some(inspector) = inspector else { return std::future::pending().await };
    let mut last = std::time::Instant::now();
    loop {
        tokio::time::sleep(STRAGGLER_WINDOW).await;
        let views = inspector.views().await;
        let now = std::time::Instant::now();
        tally.lock().unwrap_or_else(|p| p.into_inner()).window(&views, now.duration_since(last));
        last = now;
    }
}

/// Resolves once no rank has made progress for `timeout`, with the hang
/// report in `hung`; never without a timeout.
async fn watch_for_hang(
    inspector: Option<kolo_exec::control::Inspector>,
    timeout: Option<std::time::Duration>,
    hung: std::sync::Arc<std::sync::Mutex<Option<String>>>,
) {
    let (Some(inspector), Some(timeout)) = (inspector, timeout) else { return std::future::pending().await };
    let report = inspector.hang_report(timeout).await;
    *hung.lock().unwrap_or_else(|p| p.into_inner()) = Some(report);
}

fn interrupted(signal: Signal) -> JobOutcome {
    JobOutcome { exit_code: 128 + signal as i32, failure: None, interrupted_by: Some(signal) }
}

/// The command, saying once what kolo set for it where that matters.
fn command_work(job: &Job, command: &[std::ffi::OsString]) -> CommandWork {
    let (argv, env) = (command.to_vec(), job.env().to_vec());
    let mut work = CommandWork::new(command.to_vec());
    work.on_started = Some(Box::new(move |executor| note_omp_default(&argv, &env, executor)));
    work
}

/// `--in-place`: Horovod's elastic mode for commands.
async fn run_in_place(job: &Job, command: &[std::ffi::OsString], ended: &mut Ended) -> Result<i32> {
    let outcome = ElasticJob::run(
        command_work(job, command),
        job.elastic_config()?,
        job.discovery()?,
        job.cohort_factory(),
        job.env().to_vec(),
        // a line per process per round would drown the rest
        |event| {
            if !matches!(event, ElasticEvent::Joined { .. }) {
                tell(&format!("kolo: {event}"))
            }
        },
        stop_signal(),
    )
    .await?;
    if let Some(cause) = &outcome.stopped {
        let why = cause.explain(&CLI_NAMES);
        tell(&format!("kolo: elastic job stopped: {why}"));
        ended.stopped = Some((cause.kind(), why));
    }
    ended.interrupted_by = outcome.interrupted_by.map(|s| s.as_str());
    Ok(match (&outcome.stopped, outcome.interrupted_by) {
        (_, Some(signal)) => 128 + signal as i32,
        (Some(_), None) => 1,
        (None, None) => 0,
    })
}

/// Restart mode: torchrun's elastic semantics for any command.
async fn run_restarting(job: &Job, command: &[std::ffi::OsString], ended: &mut Ended) -> Result<i32> {
    let work = command_work(job, command);
    let outcome = RestartJob::run(
        &work,
        job.elastic_config()?,
        job.discovery()?,
        job.cohort_factory(),
        job.env().to_vec(),
        |event: ElasticEvent| tell(&format!("kolo: {event}")),
        stop_signal(),
    )
    .await?;
    let last = outcome.last.as_ref().and_then(|l| l.command.as_ref());
    let code = match (&outcome.stopped, outcome.interrupted_by) {
        (_, Some(signal)) => 128 + signal as i32,
        (Some(_), None) => last.map_or(1, |o| o.exit_code.max(1)),
        (None, None) => last.map_or(0, |o| o.exit_code),
    };
    if let Some(last) = last {
        if code != 0 {
            report(last);
        }
    }
    if let Some(reason) = &outcome.stopped {
        let why = CLI_NAMES.explain(reason);
        tell(&format!("kolo: elastic job stopped: {why}"));
        ended.stopped = Some((reason.kind(), why));
    }
    ended.failed = last.and_then(|o| o.failure.as_ref()).map(|f| (f.rank, f.host.clone(), f.cause.to_string()));
    ended.interrupted_by = outcome.interrupted_by.map(|s| s.as_str());
    Ok(code)
}

/// Says how a job ended, on stderr.
fn report(outcome: &JobOutcome) {
    if let Some(f) = &outcome.failure {
        tell(&format!("kolo: rank {} on host {} {}; it failed first, so the job was stopped", f.rank, f.host, f.cause));
        if let Some(error) = &f.error {
            // the rank's own account (PyTorch's error file): the traceback
            // says more than the last lines of stderr
            tell(&format!("kolo: rank {} raised {}", f.rank, error.message));
            for line in error.traceback.lines() {
                tell(&format!("kolo:   {line}"));
            }
        } else if !f.stderr_tail.is_empty() {
            tell(&format!("kolo: last lines of rank {}'s stderr:", f.rank));
            for line in &f.stderr_tail {
                tell(&format!("kolo:   {line}"));
            }
        }
    }
    if let Some(signal) = outcome.interrupted_by {
        tell(&format!("kolo: stopped by {}; every rank was terminated", signal.as_str()));
    }
}

/// Says once, as torchrun does, that ranks sharing a host got
/// `OMP_NUM_THREADS=1`, where that changes how fast the command runs: it
/// is Python or links an OpenMP runtime, and the user did not choose.
fn note_omp_default(command: &[std::ffi::OsString], env: &[(String, String)], executor: &kolo_exec::Executor) {
    use kolo_topology::OMP_NUM_THREADS;
    static SAID: std::sync::Once = std::sync::Once::new();
    if SAID.is_completed() {
        // said already: no need to read the program again (restart mode)
        return;
    }
    let defaulted = executor.workers().iter().any(|w| w.env.get(OMP_NUM_THREADS).is_some_and(|v| v == "1"));
    let chosen = std::env::var_os(OMP_NUM_THREADS).is_some() || env.iter().any(|(k, _)| k == OMP_NUM_THREADS);
    if defaulted && !chosen && command.first().is_some_and(|program| threads_with_openmp(program)) {
        SAID.call_once(|| {
            crate::out::tell(
                "kolo: ranks that share a host get OMP_NUM_THREADS=1, so that they do not oversubscribe its \
                 cores; set OMP_NUM_THREADS (or -x OMP_NUM_THREADS=N) to choose another",
            )
        });
    }
}

/// Whether `program` is a Python (named so, or a script whose `#!` line
/// names one) or a binary that links an OpenMP runtime.
fn threads_with_openmp(program: &std::ffi::OsStr) -> bool {
    use std::io::Read;
    let path = std::path::Path::new(program);
    let is_python = |name: &str| name.starts_with("python");
    if path.file_name().and_then(|n| n.to_str()).is_some_and(is_python) {
        return true;
    }
    let found = match path.components().count() {
        1 => std::env::var_os("PATH")
            .and_then(|dirs| std::env::split_paths(&dirs).map(|d| d.join(path)).find(|p| p.is_file())),
        _ => Some(path.to_path_buf()),
    };
    let Some(file) = found.and_then(|p| std::fs::File::open(p).ok()) else { return false };
    // the dynamic section's library names sit in the first megabytes
    let mut head = Vec::new();
    if file.take(4 << 20).read_to_end(&mut head).is_err() {
        return false;
    }
    if let Some(line) = head.strip_prefix(b"#!").and_then(|rest| rest.split(|&b| b == b'\n').next()) {
        return String::from_utf8_lossy(line).split(['/', ' ']).any(is_python);
    }
    [&b"libgomp.so"[..], b"libomp.so", b"libiomp5.so"].iter().any(|lib| head.windows(lib.len()).any(|w| w == *lib))
}

/// Resolves with the first SIGINT, SIGTERM or SIGHUP kolo receives. The
/// handlers are installed on the call, not on the first poll, so a signal
/// that comes right after is not lost to the default action.
pub(crate) fn stop_signal() -> impl std::future::Future<Output = Signal> {
    use tokio::signal::unix::{signal, SignalKind};
    let streams = (signal(SignalKind::interrupt()), signal(SignalKind::terminate()), signal(SignalKind::hangup()));
    async move {
        let (Ok(int), Ok(term), Ok(hup)) = streams else {
            tracing::warn!("cannot install signal handlers; kolo will not forward SIGINT/SIGTERM");
            return std::future::pending().await;
        };
        let mut streams = StopSignals { int, term, hup };
        let signal = streams.next().await;
        // here, not where the job stops: an elastic job also stops a
        // world to re-form it, which no signal asked for
        tracing::warn!("received {}; stopping the job", signal.as_str());
        // a second one means now: no more waiting for the kill grace
        tokio::spawn(async move {
            let again = streams.next().await;
            tell(&format!("kolo: {} again; killing every rank now", again.as_str()));
            kolo_sys::hurry(again as i32);
        });
        signal
    }
}

/// The signals that ask kolo to stop.
struct StopSignals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl StopSignals {
    async fn next(&mut self) -> Signal {
        tokio::select! {
            _ = self.int.recv() => Signal::SIGINT,
            _ = self.term.recv() => Signal::SIGTERM,
            _ = self.hup.recv() => Signal::SIGHUP,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::threads_with_openmp;

    #[test]
    fn pythons_and_openmp_programs_are_told_from_others() {
        let dir = std::env::temp_dir().join(format!("kolo-omp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = |name: &str, text: &[u8]| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path.into_os_string()
        };
        assert!(threads_with_openmp("python3".as_ref()));
        assert!(threads_with_openmp("/opt/venv/bin/python3.11".as_ref()));
        assert!(threads_with_openmp(&script("train", b"#!/usr/bin/env python3\nimport torch\n")));
        assert!(threads_with_openmp(&script("solver", b"\x7fELF....libgomp.so.1\0libc.so.6\0")));
        assert!(!threads_with_openmp(&script("job.sh", b"#!/bin/sh\necho python\n")));
        assert!(!threads_with_openmp("true".as_ref()));
        assert!(!threads_with_openmp("/nonexistent/program".as_ref()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
