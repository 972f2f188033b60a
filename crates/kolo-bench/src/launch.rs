//! Start-up of a job: `kolo run -np N -- true` against `mpirun -np N true`,
//! alternating runs on the same machine, compared by their medians.

use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use serde_json::json;

use crate::{median, Table};

#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Processes per job; repeat for several (default: 4 and 16).
    #[arg(short = 'n', long = "np")]
    np: Vec<u32>,
    /// Runs of each launcher per size.
    #[arg(long, default_value_t = 10)]
    runs: u32,
    /// Leave out the mpirun reference.
    #[arg(long)]
    no_mpirun: bool,
    #[arg(long)]
    json: bool,
}

fn time_once(command: &mut Command) -> Result<f64> {
    let start = Instant::now();
    let status = command.stdout(Stdio::null()).stderr(Stdio::null()).status()?;
    let seconds = start.elapsed().as_secs_f64();
    if !status.success() {
        bail!("{command:?} failed: {status}");
    }
    Ok(seconds * 1e3)
}

pub(crate) async fn run(args: LaunchArgs) -> Result<i32> {
    let sizes = if args.np.is_empty() { vec![4, 16] } else { args.np.clone() };
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let kolo = crate::kolo_binary()?;
    let mpirun = !args.no_mpirun;
    if mpirun && Command::new("mpirun").arg("--version").stdout(Stdio::null()).status().is_err() {
        bail!("mpirun not found: install Open MPI (../shared/bench/anchors does) or pass --no-mpirun");
    }
    let table = Table::new(args.json, &["np", "runs", "kolo_ms", "mpirun_ms", "mpirun/kolo"]);
    for np in sizes {
        let n = np.to_string();
        let kolo_cmd = || {
            let mut c = Command::new(&kolo);
            c.args(["run", "-np", &n, "--", "true"]);
            c
        };
        let mpi_cmd = || {
            let mut c = Command::new("mpirun");
            c.args(["-np", &n, "--bind-to", "none", "--oversubscribe", "true"])
                .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
            c
        };
        // one warm-up each, then alternate so both see the same machine
        time_once(&mut kolo_cmd())?;
        if mpirun {
            time_once(&mut mpi_cmd())?;
        }
        let (mut k, mut m) = (Vec::new(), Vec::new());
        for _ in 0..args.runs {
            k.push(time_once(&mut kolo_cmd())?);
            if mpirun {
                m.push(time_once(&mut mpi_cmd())?);
            }
        }
        let (km, mm) = (median(&mut k), median(&mut m));
        let ratio = if mpirun { json!(mm / km) } else { json!("-") };
        let mm = if mpirun { json!(mm) } else { json!("-") };
        table.row(&[json!(np), json!(args.runs), json!(km), mm, ratio]);
    }
    Ok(0)
}
