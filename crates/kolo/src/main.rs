//! The `kolo` command: a thin layer of argument parsing over kolo-exec and
//! kolo-rendezvous, with `kolo run`'s launch policy.

mod cli;
mod launch;
mod out;
mod run;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // started by an engine as a worker agent: serve the driver, never return
    // (kolo's workers run commands; Rust executables are for library users)
    kolo_exec::serve_if_worker(kolo_exec::Registry::new());
    let cli = cli::Cli::parse_from(cli::normalize_args(std::env::args_os()));
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
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            cli::Command::Run(args) => run::run(*args).await,
            cli::Command::Rendezvous(args) => run::rendezvous(args).await,
            cli::Command::Nics(args) => run::nics(args).await,
        }
    });
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            out::tell(&format!("kolo: error: {e:#}"));
            ExitCode::from(2)
        }
    }
}

fn init_logging(verbose: bool) {
    let level = if verbose { tracing::Level::DEBUG } else { tracing::Level::WARN };
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
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
