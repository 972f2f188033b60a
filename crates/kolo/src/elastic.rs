//! `kolo run` in restart mode (torchrun's elastic semantics, for any
//! command): the world runs until a rank fails, a host is lost or
//! discovery changes the hosts; then every rank is stopped, kolo-topology's
//! `Membership` decides the next world, and every rank starts again with
//! its new ranks and the restart count. Scripts resume from their own
//! checkpoints.

use std::future::Future;
use std::time::Instant;

use anyhow::Result;
use kolo_exec::elastic::Discovery;
use kolo_exec::{Cause, JobOutcome};
use kolo_topology::{Decision, ElasticConfig, Event, Membership, World};
use nix::sys::signal::Signal;

use crate::launch::{executor, LaunchSpec};
use crate::out::tell;

/// An elastic job's limits, where its hosts come from, and its mode.
#[derive(Clone, Debug)]
pub struct ElasticSpec {
    pub config: ElasticConfig,
    /// The discovery script, or the host list, fixed.
    pub discovery: Discovery,
    /// Horovod's mode: survivors keep running and join a new round
    /// (`crate::in_place`), instead of every rank starting again.
    pub in_place: bool,
}

/// How an elastic job ended: the last round's outcome, or why it stopped.
pub struct ElasticOutcome {
    pub last: Option<JobOutcome>,
    pub stopped: Option<String>,
    pub exit_code: i32,
}

/// Runs `spec.command` elastically until a round succeeds, the job is
/// interrupted, or membership says stop.
pub async fn run_elastic(
    spec: LaunchSpec,
    elastic: ElasticSpec,
    interrupt: impl Future<Output = Signal>,
) -> Result<ElasticOutcome> {
    tokio::pin!(interrupt);
    let started = Instant::now();
    let mut config = elastic.config.clone();
    config.fixed_hosts = elastic.discovery.is_fixed();
    let mut membership = Membership::new(config);
    let first = elastic.discovery.hosts().await?;
    let mut decision = membership.on(Event::Discovered(&first), started.elapsed());
    let mut last: Option<JobOutcome> = None;
    loop {
        for (host, duration) in membership.take_blacklisted_news(started.elapsed()) {
            tell(&format!("kolo: {}", kolo_exec::elastic::ElasticEvent::Blacklisted { host, duration }));
        }
        let world = match decision {
            Decision::Reform(world) => world,
            Decision::Stop(reason) => {
                let code = last.as_ref().map_or(1, |o| o.exit_code.max(1));
                return Ok(ElasticOutcome { last, stopped: Some(reason.to_string()), exit_code: code });
            }
            Decision::Wait { available, needed, deadline, announce } => {
                if announce {
                    tell(&format!(
                        "kolo: waiting for {needed} slots, {available} available; up to {:.0} s more",
                        deadline.saturating_sub(started.elapsed()).as_secs_f64()
                    ));
                }
                tokio::select! {
                    _ = tokio::time::sleep(elastic.discovery.interval) => {}
                    signal = &mut interrupt => return Ok(interrupted(last, signal)),
                }
                decision = elastic.discovery.poll(&mut membership, started.elapsed()).await;
                continue;
            }
            Decision::Continue => {
                decision = elastic.discovery.poll(&mut membership, started.elapsed()).await;
                continue;
            }
        };
        let (outcome, nodes, changed) =
            run_round(&spec, &elastic, &world, &mut membership, started, &mut interrupt).await?;
        if let Some(signal) = outcome.interrupted_by.filter(|_| changed.is_none()) {
            return Ok(interrupted(Some(outcome), signal));
        }
        if let Some(next) = changed {
            tell(&format!("kolo: the hosts changed; re-forming the job (round {})", world.round + 1));
            last = Some(outcome);
            decision = next;
            continue;
        }
        let Some(failure) = &outcome.failure else {
            // every rank succeeded
            return Ok(ElasticOutcome { exit_code: 0, last: Some(outcome), stopped: None });
        };
        // the host as the world names it (the plan's), not as the worker sees itself
        let host = nodes.get(failure.rank as usize).cloned().unwrap_or_else(|| failure.host.clone());
        let event = match failure.cause {
            Cause::Lost(_) => Event::HostLost(&host),
            _ => Event::RankFailed(&host),
        };
        decision = membership.on(event, started.elapsed());
        if !matches!(decision, Decision::Stop(_)) {
            tell(&format!("kolo: rank {} on host {host} {}; restarting the job", failure.rank, failure.cause));
        }
        last = Some(outcome);
    }
}

fn interrupted(last: Option<JobOutcome>, signal: Signal) -> ElasticOutcome {
    ElasticOutcome { last, stopped: None, exit_code: 128 + signal as i32 }
}

/// One round: the world runs until it ends, or discovery changes the hosts
/// (then it is stopped and the new decision comes back). Also each rank's
/// host, from the round's plan.
async fn run_round(
    spec: &LaunchSpec,
    elastic: &ElasticSpec,
    world: &World,
    membership: &mut Membership,
    started: Instant,
    interrupt: &mut std::pin::Pin<&mut impl Future<Output = Signal>>,
) -> Result<(JobOutcome, Vec<String>, Option<Decision>)> {
    let mut round = spec.clone();
    round.hosts = world.host_specs();
    round.elastic_world = true;
    round.np = world.size().into();
    let restarts = world.restarts.to_string();
    let max_restarts = elastic.config.max_restarts.unwrap_or(0).to_string();
    for (k, v) in [
        ("HOROVOD_ELASTIC", "1"),
        ("KOLO_RESTART_COUNT", restarts.as_str()),
        ("TORCHELASTIC_RESTART_COUNT", restarts.as_str()),
        ("TORCHELASTIC_MAX_RESTARTS", max_restarts.as_str()),
    ] {
        round.extra_env.retain(|(name, _)| name != k);
        round.extra_env.push((k.to_string(), v.to_string()));
    }
    let mut executor = executor(&round).await?;
    if let Err(e) = executor.start_command(&round.command, &round.extra_env).await {
        executor.shutdown().await;
        return Err(e.into());
    }
    crate::launch::note_omp_default(&round, &executor);
    let nodes: Vec<String> = executor.plan().await?.workers.iter().map(|w| w.host.node_id.clone()).collect();
    let mut changed: Option<Decision> = None;
    let stop = async {
        let mut ticks = tokio::time::interval(elastic.discovery.interval);
        ticks.tick().await;
        loop {
            tokio::select! {
                signal = &mut *interrupt => return signal,
                _ = ticks.tick() => {
                    let decision = elastic.discovery.poll(membership, started.elapsed()).await;
                    if decision != Decision::Continue {
                        changed = Some(decision);
                        return Signal::SIGTERM;
                    }
                }
            }
        }
    };
    let outcome = executor.wait_command(stop).await;
    executor.shutdown().await;
    Ok((outcome?, nodes, changed))
}
