//! The autotuner in the loop (upstream's `RunLoopOnce` calls into the
//! parameter manager, and `Controller::SynchronizeParameters`): after each
//! cycle of the global set, every rank's tuner sees the allreduces that
//! cycle ran; when a score is due (the same cycle on every rank: it
//! follows from the agreed responses alone) global rank 0 broadcasts its
//! parameters over the global set, and every rank puts them in force
//! before its next set's cycle. The coordinator appends the log.

use std::io::Write;
use std::time::Duration;

use kolo_comm::Communicator;

use crate::autotune::{Params, Tuner, LOG_HEADER};
use crate::controller::Stop;
use crate::entry::Failure;
use crate::message::{Response, ResponseType};
use crate::settings::Settings;

/// The tuner and its log file.
#[derive(Debug)]
pub(crate) struct Tuned {
    tuner: Tuner,
    log: Option<std::fs::File>,
}

/// The parameters the settings give, untuned.
pub(crate) fn configured(settings: &Settings) -> Params {
    Params {
        fusion_threshold: settings.fusion_threshold,
        cycle_time_ms: settings.cycle_time.as_secs_f64() * 1000.0,
        cache_enabled: settings.cache_capacity > 0,
        active: false,
    }
}

impl Tuned {
    /// With `HOROVOD_AUTOTUNE` on; rank 0 opens the log (a log that cannot
    /// be written is a warning: tuning goes on without it).
    pub(crate) fn new(settings: &Settings, rank: u32) -> Option<Tuned> {
        let at = settings.autotune.clone()?;
        let coordinator = rank == 0;
        let log = match (&at.log, coordinator) {
            (Some(path), true) => {
                match std::fs::File::create(path).and_then(|mut f| writeln!(f, "{LOG_HEADER}").map(|_| f)) {
                    Ok(f) => Some(f),
                    Err(e) => {
                        eprintln!(
                            "[WARNING]: kolo: cannot write the autotune log HOROVOD_AUTOTUNE_LOG={}: {e}; \
                             tuning without it (set it to a writable path)",
                            path.display()
                        );
                        None
                    }
                }
            }
            _ => None,
        };
        Some(Tuned { tuner: Tuner::new(at, configured(settings), coordinator), log })
    }

    /// The parameters to start with.
    pub(crate) fn params(&self) -> Params {
        self.tuner.params()
    }

    pub(crate) fn active(&self) -> bool {
        self.tuner.active()
    }

    /// What a cycle's responses give the tuner: the names and this rank's
    /// bytes of its allreduces (as upstream, allreduces only).
    pub(crate) fn observe(responses: &[Response]) -> (Vec<String>, u64) {
        let mut names = Vec::new();
        let mut bytes = 0u64;
        for r in responses.iter().filter(|r| r.kind == ResponseType::Allreduce) {
            names.extend(r.names.iter().cloned());
            bytes += r.sizes.iter().map(|&n| n.max(0) as u64).sum::<u64>() * r.dtype.size() as u64;
        }
        (names, bytes)
    }

    /// After a cycle of the global set: the parameters every rank takes
    /// now, when a score was due (a broadcast from rank 0 over `comm`).
    pub(crate) fn after_cycle(
        &mut self,
        comm: &mut Communicator,
        observed: (Vec<String>, u64),
        now: Duration,
    ) -> Result<Option<Params>, Stop> {
        let (names, bytes) = observed;
        if !self.tuner.update(names.iter().map(String::as_str), bytes, now) {
            return Ok(None);
        }
        let mut wire = Vec::new();
        if comm.rank() == 0 {
            wire = postcard::to_stdvec(&self.tuner.params())
                .map_err(|e| Stop::Failed(Failure::internal(format!("cannot encode the tuned parameters: {e}"))))?;
        }
        comm.broadcast_bytes(&mut wire, 0)?;
        let params: Params = postcard::from_bytes(&wire)
            .map_err(|e| Stop::Failed(Failure::internal(format!("the tuned parameters did not decode: {e}"))))?;
        self.tuner.synced(params, now);
        self.write_log();
        Ok(Some(params))
    }

    fn write_log(&mut self) {
        let rows = self.tuner.take_log();
        if let Some(file) = self.log.as_mut() {
            let written = rows.iter().try_for_each(|row| writeln!(file, "{row}")).and_then(|_| file.flush());
            if let Err(e) = written {
                eprintln!("[WARNING]: kolo: cannot write the autotune log: {e}");
                self.log = None;
            }
        }
        for row in rows {
            tracing::info!("autotune: {row}");
        }
    }
}
