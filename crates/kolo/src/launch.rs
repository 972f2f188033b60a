//! `kolo run`'s policy: which engine places the ranks, how many, and the
//! Executor running the command in every worker. The plan the Executor
//! makes is the one `--dry-run` prints.

use std::ffi::OsString;
use std::future::Future;
use std::time::Duration;

use kolo_exec::{
    EngineChoice, EngineOptions, Executor, JobOutcome, OutputOptions, RayOptions, Settings, SlurmOptions, SshOptions,
    WorkerRequest,
};
use kolo_topology::{total_slots, HostSpec, TopologyError};
use nix::sys::signal::Signal;

/// Everything `kolo run` was asked for.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    pub command: Vec<OsString>,
    pub hosts: Vec<HostSpec>,
    pub np: u64,
    /// Bounds start-up; also Gloo's rendezvous timeout in the workers.
    pub start_timeout: Duration,
    /// How long an engine may wait for resources (a Slurm queue).
    pub placement_timeout: Duration,
    /// Between SIGTERM and SIGKILL at teardown.
    pub grace: Duration,
    /// Variables set on top of kolo's own (`-x`, `--env`).
    pub extra_env: Vec<(String, String)>,
    pub output: OutputOptions,
    /// Rendezvous refuses requests without the job secret (kolo-only workers).
    pub require_secret: bool,
    /// GPUs each rank holds, out of those its host declares (`gpus=N`).
    pub gpus_per_worker: u32,
    pub engine: EngineChoice,
    pub ssh: SshOptions,
    pub slurm: SlurmOptions,
    pub ray: RayOptions,
    /// With Ray: this many workers on each of np/W distinct nodes.
    pub workers_per_host: Option<u32>,
    /// Interfaces to use instead of detecting them.
    pub nics: Option<Vec<String>>,
    /// The program started as the worker agent (default: this binary).
    pub worker_program: Option<std::path::PathBuf>,
    /// Its arguments (`python -m kolo._worker`).
    pub worker_args: Vec<String>,
    /// `hosts` are those an elastic job's membership chose for a world or
    /// cohort (`EngineChoice::elastic_engine`: on Ray, node ids).
    pub elastic_world: bool,
}

impl LaunchSpec {
    /// How each engine reaches its machines, as this launch says.
    pub fn engine_options(&self) -> EngineOptions {
        EngineOptions { ssh: self.ssh.clone(), slurm: self.slurm.clone(), ray: self.ray.clone() }
    }
}

/// The Executor for a launch: its engine chosen (host names are looked up
/// off the async runtime), its request checked with Horovod's messages.
pub async fn executor(spec: &LaunchSpec) -> anyhow::Result<Executor> {
    executor_with_secret(spec, None).await
}

/// An executor whose workers share `secret` (with other executors' workers).
pub async fn executor_with_secret(spec: &LaunchSpec, secret: Option<&str>) -> anyhow::Result<Executor> {
    let np = u32::try_from(spec.np)
        .ok()
        .filter(|&n| n <= kolo_topology::MAX_PROCESSES)
        .ok_or(TopologyError::TooManyProcesses(spec.np))?;
    let (choice, hosts) = {
        let (choice, hosts) = (spec.engine, spec.hosts.clone());
        tokio::task::spawn_blocking(move || (choice.resolve(&hosts), hosts)).await?
    };
    // Slurm's allocation and Ray's cluster are the host list there;
    // elsewhere, Horovod's check
    let available = total_slots(&hosts);
    if !matches!(choice, EngineChoice::Slurm | EngineChoice::Ray) && spec.np > available {
        return Err(TopologyError::NotEnoughSlots { requested: spec.np, available }.into());
    }
    // one slot = one CPU: packing fills the hosts in order, as horovodrun does
    let request = match spec.workers_per_host {
        Some(w) => WorkerRequest::colocated(np / w, w),
        None => WorkerRequest::pack(np),
    }
    .gpus_per_worker(spec.gpus_per_worker);
    let options = spec.engine_options();
    let engine = match spec.elastic_world {
        true => choice.elastic_engine(hosts, &request, options)?,
        false => choice.engine(hosts, &request, options)?,
    };
    let mut settings = Settings::default();
    settings.start_timeout = spec.start_timeout;
    settings.placement_timeout = spec.placement_timeout;
    settings.kill_grace = spec.grace;
    settings.output = spec.output.clone();
    settings.rendezvous_require_secret = spec.require_secret;
    settings.nics = spec.nics.clone();
    settings.worker_program = spec.worker_program.clone();
    settings.worker_args = spec.worker_args.clone();
    if let Some(secret) = secret {
        settings = settings.with_secret(secret);
    }
    Ok(Executor::with_engine(settings, request, engine)?)
}

/// Runs the job to its end. `interrupt` resolves when kolo is asked to stop
/// (SIGINT/SIGTERM); the job is then torn down like on a failure.
pub async fn run_job(spec: LaunchSpec, interrupt: impl Future<Output = Signal>) -> anyhow::Result<JobOutcome> {
    tokio::pin!(interrupt);
    let mut executor = tokio::select! {
        made = executor(&spec) => made?,
        signal = &mut interrupt => return Ok(interrupted(signal)),
    };
    let started = tokio::select! {
        started = executor.start_command(&spec.command, &spec.extra_env) => started,
        signal = &mut interrupt => {
            executor.shutdown().await;
            return Ok(interrupted(signal));
        }
    };
    if let Err(e) = started {
        executor.shutdown().await;
        return Err(e.into());
    }
    note_omp_default(&spec, &executor);
    let outcome = executor.wait_command(interrupt).await;
    executor.shutdown().await;
    Ok(outcome?)
}

fn interrupted(signal: Signal) -> JobOutcome {
    JobOutcome { exit_code: 128 + signal as i32, failure: None, interrupted_by: Some(signal) }
}

/// Says once, as torchrun does, that ranks sharing a host got
/// `OMP_NUM_THREADS=1`, where that changes how fast the command runs: it
/// is Python or links an OpenMP runtime, and the user did not choose.
pub fn note_omp_default(spec: &LaunchSpec, executor: &Executor) {
    use kolo_topology::OMP_NUM_THREADS;
    static SAID: std::sync::Once = std::sync::Once::new();
    if SAID.is_completed() {
        // said already: no need to read the program again (restart mode)
        return;
    }
    let defaulted = executor.workers().iter().any(|w| w.env.get(OMP_NUM_THREADS).is_some_and(|v| v == "1"));
    let chosen =
        std::env::var_os(OMP_NUM_THREADS).is_some() || spec.extra_env.iter().any(|(k, _)| k == OMP_NUM_THREADS);
    if defaulted && !chosen && spec.command.first().is_some_and(|program| threads_with_openmp(program)) {
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
