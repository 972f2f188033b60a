//! Load on a rendezvous server as Gloo's full-mesh connect makes it: each
//! of N simulated ranks PUTs its address, then for every other rank polls
//! GET until the key is there (404s every 10 ms) and GETs it, then after a
//! barrier DELETEs its rank. Runs against a fresh `kolo rendezvous` or any
//! server URL (e.g. Horovod's Python server).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use kolo_rendezvous::{Client, ClientConfig};
use serde_json::json;
use tokio::sync::Barrier;

use crate::Table;

#[derive(Args, Debug)]
pub struct RendezvousBenchArgs {
    /// Simulated ranks; repeat for several (default: 64, 256 and 1024).
    #[arg(short = 'n', long = "ranks")]
    ranks: Vec<u32>,
    /// Server to load, http://HOST:PORT (default: a fresh `kolo rendezvous` per size).
    #[arg(long)]
    url: Option<String>,
    /// Bytes each rank stores.
    #[arg(long, default_value_t = 64)]
    value_bytes: usize,
    /// Give up on a size after this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    #[arg(long)]
    json: bool,
}

struct ServerProcess(Child);

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_kolo_server(ranks: u32) -> Result<(ServerProcess, String)> {
    let exe = crate::kolo_binary()?;
    let mut child = Command::new(exe)
        .args(["rendezvous", "--port", "0", "--plan", &format!("localhost:{ranks}")])
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start kolo rendezvous")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("no stdout")?).read_line(&mut line)?;
    if line.trim().is_empty() {
        bail!("kolo rendezvous printed no address");
    }
    Ok((ServerProcess(child), line.trim().to_string()))
}

pub(crate) async fn run(args: RendezvousBenchArgs) -> Result<i32> {
    let sizes = if args.ranks.is_empty() { vec![64, 256, 1024] } else { args.ranks.clone() };
    if sizes.contains(&0) {
        bail!("--ranks must be at least 1");
    }
    let table = Table::new(args.json, &["ranks", "requests", "seconds", "requests/s", "server"]);
    for n in sizes {
        let (_server, addr, label) = match &args.url {
            Some(url) => (None, ClientConfig::from_url(url)?.addr, url.clone()),
            None => {
                let (server, addr) = start_kolo_server(n)?;
                (Some(server), addr, "kolo".to_string())
            }
        };
        let limit = Duration::from_secs(args.timeout);
        let (requests, seconds) = tokio::time::timeout(limit, full_mesh(&addr, n, args.value_bytes))
            .await
            .with_context(|| format!("{n} ranks did not finish within {} s", args.timeout))??;
        table.row(&[json!(n), json!(requests), json!(seconds), json!(requests as f64 / seconds), json!(label)]);
    }
    Ok(0)
}

async fn full_mesh(addr: &str, n: u32, value_bytes: usize) -> Result<(u64, f64)> {
    let barrier = Arc::new(Barrier::new(n as usize));
    let value = bytes::Bytes::from(vec![b'a'; value_bytes]);
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for rank in 0..n {
        let mut config = ClientConfig::new(addr);
        config.request_timeout = Duration::from_secs(60);
        let client = Client::new(config);
        let (barrier, value) = (barrier.clone(), value.clone());
        tasks.spawn(async move {
            let me = rank.to_string();
            client.put("global", &me, value).await?;
            for peer in (0..n).filter(|&p| p != rank) {
                let key = peer.to_string();
                // Gloo: wait() polls until present, then get() reads it
                client.wait("global", &[&key], Duration::from_secs(600)).await?;
                client.get("global", &key).await?;
            }
            barrier.wait().await;
            client.delete("global", &me).await?;
            Ok::<u64, kolo_rendezvous::RendezvousError>(client.requests())
        });
    }
    let mut total = 0;
    while let Some(joined) = tasks.join_next().await {
        total += joined.context("a simulated rank panicked")??;
    }
    Ok((total, start.elapsed().as_secs_f64()))
}
