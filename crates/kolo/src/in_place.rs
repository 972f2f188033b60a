//! `kolo run --in-place`: Horovod's elastic mode for commands, through
//! kolo-exec's `ElasticJob` (see `kolo_exec::elastic`): each cohort is an
//! executor made from the launch spec, and kolo says what happens.

use std::future::Future;
use std::sync::Arc;

use anyhow::Result;
use kolo_exec::elastic::{Cohort, CohortFactory, CommandWork, ElasticJob};
use nix::sys::signal::Signal;

use crate::elastic::{ElasticOutcome, ElasticSpec};
use crate::launch::{executor_with_secret, LaunchSpec};
use crate::out::tell;

/// Runs `spec.command` in place until every member of the last round that
/// came together has succeeded, the job is interrupted, or membership says
/// stop.
pub async fn run_in_place(
    spec: LaunchSpec,
    elastic: ElasticSpec,
    interrupt: impl Future<Output = Signal>,
) -> Result<ElasticOutcome> {
    let template = spec.clone();
    let factory: CohortFactory = Arc::new(move |cohort: Cohort| {
        let mut spec = template.clone();
        spec.hosts = cohort.hosts;
        spec.elastic_world = true;
        spec.np = cohort.np;
        spec.output.first_label = cohort.first_process;
        Box::pin(async move {
            executor_with_secret(&spec, Some(&cohort.secret))
                .await
                .map_err(|e| kolo_exec::ExecError::BadSettings(format!("{e:#}")))
        })
    });
    let work = CommandWork { argv: spec.command.clone() };
    let outcome = ElasticJob::run(
        work,
        elastic.config,
        elastic.discovery,
        factory,
        spec.extra_env.clone(),
        |event| tell(&format!("kolo: {event}")),
        interrupt,
    )
    .await?;
    let exit_code = match (&outcome.stopped, outcome.interrupted_by) {
        (_, Some(signal)) => 128 + signal as i32,
        (Some(_), None) => 1,
        (None, None) => 0,
    };
    Ok(ElasticOutcome { last: None, stopped: outcome.stopped, exit_code })
}
