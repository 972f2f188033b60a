//! `kolo ps`, `kolo status` and `kolo stack`: this user's running jobs on
//! this machine, asked through their drivers' control endpoints
//! (`kolo_exec::control`).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use kolo_exec::control::{endpoint_dir, sweep, JobListing};

/// How long a driver may take to answer (a stack dump of every rank).
const ANSWER_WAIT: Duration = Duration::from_secs(30);
/// The longest answer read.
const MAX_ANSWER: u64 = 64 << 20;

/// A running driver's endpoint: what it lists, where to ask.
struct Endpoint {
    listing: JobListing,
    socket: PathBuf,
}

/// Every live endpoint of this user's jobs; what killed drivers left is
/// removed on the way.
fn endpoints() -> Result<Vec<Endpoint>> {
    let dir = endpoint_dir().context("the directory of kolo's job endpoints")?;
    Ok(sweep(&dir).into_iter().map(|(listing, socket)| Endpoint { listing, socket }).collect())
}

/// The endpoints of `job` (an id or its start), or of the one job running.
fn chosen(job: Option<&str>) -> Result<Vec<Endpoint>> {
    let all = endpoints()?;
    let mut ids: Vec<String> = all.iter().map(|e| e.listing.job.clone()).collect();
    ids.dedup();
    let id = match job {
        Some(wanted) => {
            let matching: Vec<&String> = ids.iter().filter(|id| id.starts_with(wanted)).collect();
            match matching.as_slice() {
                [one] => (*one).clone(),
                [] if ids.is_empty() => bail!("no kolo job of yours runs on this machine"),
                [] => bail!("no job '{wanted}' runs here; jobs: {}", ids.join(", ")),
                many => bail!(
                    "'{wanted}' names {} jobs: {}; give more of the id",
                    many.len(),
                    many.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                ),
            }
        }
        None => match ids.as_slice() {
            [one] => one.clone(),
            [] => bail!("no kolo job of yours runs on this machine"),
            _ => bail!("{} jobs run; name one (kolo ps lists them): {}", ids.len(), ids.join(", ")),
        },
    };
    Ok(all.into_iter().filter(|e| e.listing.job == id).collect())
}

fn ask(endpoint: &Endpoint, request: &serde_json::Value) -> Result<serde_json::Value> {
    let mut stream = UnixStream::connect(&endpoint.socket).with_context(|| {
        format!("cannot reach job {}'s driver at {}", endpoint.listing.job, endpoint.socket.display())
    })?;
    stream.set_read_timeout(Some(ANSWER_WAIT))?;
    let mut line = serde_json::to_vec(request)?;
    line.push(b'\n');
    stream.write_all(&line)?;
    let mut answer = Vec::new();
    BufReader::new(std::io::Read::take(&stream, MAX_ANSWER))
        .read_until(b'\n', &mut answer)
        .with_context(|| format!("job {}'s driver did not answer", endpoint.listing.job))?;
    if answer.is_empty() {
        bail!("job {}'s driver closed the connection without an answer (it is ending?)", endpoint.listing.job);
    }
    let value: serde_json::Value = serde_json::from_slice(&answer).context("the driver's answer")?;
    if let Some(error) = value.get("error").and_then(|e| e.as_str()) {
        return Err(anyhow!("job {}: {error}", endpoint.listing.job));
    }
    Ok(value)
}

/// `kolo ps`.
pub(crate) fn ps(json: bool) -> Result<i32> {
    let all = endpoints()?;
    // an elastic job's cohorts are one job
    let mut jobs: BTreeMap<String, (JobListing, usize)> = BTreeMap::new();
    for e in all {
        let entry = jobs.entry(e.listing.job.clone()).or_insert((e.listing.clone(), 0));
        entry.1 += e.listing.ranks;
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    if json {
        let rows: Vec<serde_json::Value> = jobs
            .values()
            .map(|(l, ranks)| {
                serde_json::json!({"job": l.job, "ranks": ranks, "command": l.command, "hosts": l.hosts,
                    "age_s": (now - l.started).max(0.0), "driver_pid": l.driver_pid})
            })
            .collect();
        println!("{}", serde_json::Value::Array(rows));
        return Ok(0);
    }
    println!("{:<24} {:>5} {:>8}  {:<16} COMMAND", "JOB", "RANKS", "AGE", "HOSTS");
    for (l, ranks) in jobs.values() {
        let age = (now - l.started).max(0.0);
        println!("{:<24} {:>5} {:>8}  {:<16} {}", l.job, ranks, age_text(age), l.hosts.join(","), l.command);
    }
    Ok(0)
}

pub(crate) fn gpu_percent_text(rank: &serde_json::Value) -> String {
    rank["gpu_percent"].as_f64().map_or("-".to_string(), |p| format!("{p:.0}"))
}

pub(crate) fn gpu_memory_text(rank: &serde_json::Value) -> String {
    rank["gpu_memory_bytes"].as_u64().map_or("-".to_string(), |b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64))
}

fn age_text(s: f64) -> String {
    match s as u64 {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// `kolo status`: one JSON object for the job (every cohort's ranks).
pub(crate) fn status_value(job: Option<&str>) -> Result<serde_json::Value> {
    let endpoints = chosen(job)?;
    let mut merged: Option<serde_json::Value> = None;
    for endpoint in &endpoints {
        let answer = ask(endpoint, &serde_json::json!({"op": "status"}))?;
        match merged.as_mut() {
            None => merged = Some(answer),
            Some(m) => {
                let more = answer["ranks"].as_array().cloned().unwrap_or_default();
                if let Some(ranks) = m["ranks"].as_array_mut() {
                    ranks.extend(more);
                }
            }
        }
    }
    merged.ok_or_else(|| anyhow!("no kolo job of yours runs on this machine"))
}

pub(crate) fn status(job: Option<&str>, json: bool) -> Result<i32> {
    let value = status_value(job)?;
    if json {
        println!("{value}");
        return Ok(0);
    }
    println!("job {}: {}", value["job"].as_str().unwrap_or("?"), value["command"].as_str().unwrap_or(""));
    // GPU columns where NVML answered for some rank
    let gpus = value["ranks"].as_array().into_iter().flatten().any(|r| r["gpu_memory_bytes"].is_u64());
    let gpu_header = if gpus { format!(" {:>5} {:>10}", "GPU%", "GPU MEM") } else { String::new() };
    println!(
        "{:>5} {:<16} {:>8} {:<10} {:>6} {:>10} {:>12}{gpu_header}",
        "RANK", "HOST", "PID", "STATE", "CPU%", "RSS", "LAST OUTPUT"
    );
    for r in value["ranks"].as_array().into_iter().flatten() {
        let pid = r["pid"].as_u64().map_or("-".to_string(), |p| p.to_string());
        let cpu = r["cpu_percent"].as_f64().map_or("-".to_string(), |c| format!("{c:.0}"));
        let rss = r["rss_bytes"].as_u64().map_or("-".to_string(), |b| format!("{:.1} MiB", b as f64 / 1048576.0));
        let last = r["last_output_s"].as_f64().map_or("-".to_string(), |s| format!("{} ago", age_text(s)));
        let gpu = match gpus {
            false => String::new(),
            true => format!(" {:>5} {:>10}", gpu_percent_text(r), gpu_memory_text(r)),
        };
        println!(
            "{:>5} {:<16} {:>8} {:<10} {:>6} {:>10} {:>12}{gpu}",
            r["rank"].as_u64().unwrap_or(0),
            r["host"].as_str().unwrap_or("?"),
            pid,
            r["state"].as_str().unwrap_or("?"),
            cpu,
            rss,
            last
        );
        if let Some(e) = r["error"].as_str() {
            println!("      {e}");
        }
    }
    Ok(0)
}

/// `kolo stack`: every rank's stacks, identical ones merged, the ranks
/// that differ from the most first.
pub(crate) fn stack(job: Option<&str>, rank: Option<u32>) -> Result<i32> {
    let endpoints = chosen(job)?;
    let mut request = serde_json::json!({"op": "stack"});
    // this user's py-spy, for agents that find none of their own
    if let Some(path) = kolo_agent::py_spy_on_path().and_then(|p| p.canonicalize().ok()) {
        request["py_spy"] = path.to_string_lossy().into_owned().into();
    }
    if let Some(r) = rank {
        request["rank"] = r.into();
    }
    let mut ranks = Vec::new();
    for endpoint in &endpoints {
        let answer = ask(endpoint, &request)?;
        ranks.extend(answer["ranks"].as_array().cloned().unwrap_or_default());
    }
    print!("{}", kolo_exec::hang::merged_stacks(&ranks));
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_as_people_write_them() {
        assert_eq!(age_text(5.2), "5s");
        assert_eq!(age_text(125.0), "2m05s");
        assert_eq!(age_text(7300.0), "2h01m");
    }
}
