//! The `kolo` command as a library: the binary and the Python package's
//! `kolo` command run the same code (a thin layer of argument parsing over
//! kolo-exec and kolo-rendezvous, with `kolo run`'s launch policy).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod cli;
mod dry_run;
mod inspect;
mod nics;
mod out;
mod rendezvous;
mod run;
mod spec;
mod timeline;
mod top;

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Parser;

/// The program an engine starts as the worker agent, with its arguments:
/// by default this very program, without any.
#[derive(Clone, Debug, Default)]
pub struct WorkerProgram {
    /// The agent's program; `None`: this program. `--worker-program`
    /// overrides it.
    pub program: Option<PathBuf>,
    /// Its arguments (the Python package's `-m kolo._worker`); unused when
    /// `--worker-program` is given.
    pub args: Vec<String>,
}

/// Runs the command line `args` (program name first) and returns the exit
/// code. A process that may be started as a worker agent must call
/// `kolo_agent::serve_if_worker` before this.
pub fn main(args: Vec<OsString>, worker: WorkerProgram) -> i32 {
    let cli = match cli::Cli::try_parse_from(cli::normalize_args(args)) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    init_logging(cli.verbose());
    raise_fd_limit();
    // a driver is latency-bound: one thread that polls every socket itself
    // answers calls faster than a pool handing wake-ups across threads;
    // the rendezvous server wants every core
    let mut builder = match &cli.command {
        cli::Command::Rendezvous(_) => tokio::runtime::Builder::new_multi_thread(),
        _ => tokio::runtime::Builder::new_current_thread(),
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            out::tell(&format!("kolo: cannot start the async runtime: {e}"));
            return 1;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            cli::Command::Run(args) => run::run(*args, worker).await,
            cli::Command::Rendezvous(args) => rendezvous::rendezvous(args).await,
            cli::Command::Nics(args) => nics::nics(args).await,
            cli::Command::Ps(args) => inspect::ps(args.json),
            cli::Command::Status(args) => inspect::status(args.job.as_deref(), args.json),
            cli::Command::Stack(args) => inspect::stack(args.job.as_deref(), args.rank),
            cli::Command::Top(args) => top::top(args.job.as_deref()),
            cli::Command::Timeline(args) => timeline::summarize(&args.file),
        }
    });
    // not a plain drop, which waits for blocking threads without limit: an
    // engine call cut short by a signal (Ray placing the workers, Slurm's
    // queue) may block for its whole timeout; the janitor cleans up after it
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    match result {
        Ok(code) => code.clamp(0, 255),
        Err(e) => {
            out::tell(&format!("kolo: error: {e:#}"));
            2
        }
    }
}

fn init_logging(verbose: bool) {
    // a second run in one process (Python) keeps the first subscriber
    let level = if verbose { tracing::Level::DEBUG } else { tracing::Level::WARN };
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Many ranks and many rendezvous connections need descriptors; take what
/// the hard limit allows.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
}
