//! The background thread (upstream's `BackgroundThreadLoop` and
//! `RunLoopOnce` in `operations.cc`): it cycles each process set this
//! rank belongs to, in id order: the controller agrees on what to run
//! (`controller`), then it runs exactly that (`perform`), in the same
//! order on every rank. It ends when the ranks agree to shut down, or on
//! the first failure, and fails whatever is pending either way.
//!
//! A cycle starts at once when something is queued here, else one cycle
//! time after the last began, so that an idle job costs one small
//! allreduce per set and cycle, and a job whose ranks submit together
//! waits on no timer.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kolo_comm::Communicator;

use crate::autotune::Params;
use crate::controller::{SetLoop, Stop};
use crate::entry::{Entry, Failure, Output};
use crate::exec::Aligned;
use crate::job_timeline::Running;
use crate::message::{Response, Stopping};
use crate::perform::{perform, take_all, SetChange};
use crate::queue::{fail_all, SHUT_DOWN};
use crate::state::Shared;
use crate::timeline::Trace;
use crate::tuned::{configured, Tuned};

/// The background thread's own state.
pub(crate) struct Background {
    shared: Arc<Shared>,
    /// The job's communicator until the loop starts (then set 0's).
    global: Option<Communicator>,
    sets: BTreeMap<u32, SetLoop>,
    fusion: Aligned,
    started: Instant,
    sets_made: u64,
    /// A stall past its shutdown time found here as some set's
    /// coordinator: asked of every rank through the next global cycle.
    stall_stop: Option<Stopping>,
    /// Tensors run per set, for the job's timeline.
    traced: BTreeMap<u32, u64>,
    /// `HOROVOD_AUTOTUNE`'s tuner, and the parameters in force.
    tuned: Option<Tuned>,
    params: Params,
}

/// After this many cycles with nothing in flight anywhere, the loop
/// cycles `QUIET_SLOWDOWN` times less often.
const QUIET_AFTER_CYCLES: u32 = 10;
const QUIET_SLOWDOWN: u32 = 10;

/// How one set's cycle ended.
struct CycleEnd {
    /// The job shuts down after this cycle: who asked, and why.
    shutdown: Option<Stopping>,
    /// No rank of the set had anything in flight (known with the cache on).
    quiet: bool,
}

impl Background {
    pub(crate) fn new(shared: Arc<Shared>, comm: Communicator) -> Background {
        let tuned = Tuned::new(&shared.settings, shared.rank);
        let params = tuned.as_ref().map_or_else(|| configured(&shared.settings), Tuned::params);
        Background {
            tuned,
            params,
            shared,
            global: Some(comm),
            sets: BTreeMap::new(),
            fusion: Aligned::default(),
            started: Instant::now(),
            sets_made: 0,
            stall_stop: None,
            traced: BTreeMap::new(),
        }
    }

    /// The thread's body: cycles, then fails what is pending with why the
    /// cycles ended.
    pub(crate) fn run(&mut self, static_sets: Vec<(u32, Vec<u32>)>) {
        // a bug here must fail the waiters, not leave them waiting
        // the job's timeline records tensors here, not the fused collectives
        kolo_timeline::quiet_on_this_thread();
        let cycles = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_cycles(static_sets)));
        let stop = match cycles {
            Ok(Ok(cause)) => Stop::ShutDown(cause),
            Ok(Err(stop)) => stop,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Stop::Failed(Failure::internal(format!("the Horovod core's background thread failed: {what}")))
            }
        };
        match stop {
            Stop::ShutDown(by) => {
                let failure = Failure::internal(format!("{SHUT_DOWN} (kolo: shut down by {}.)", by.reason));
                fail_all(&self.shared, failure, Some(&by));
            }
            Stop::Failed(failure) => fail_all(&self.shared, failure, None),
        }
    }

    /// Cycles until the ranks agree to shut down: who asked, and why.
    fn run_cycles(&mut self, static_sets: Vec<(u32, Vec<u32>)>) -> Result<Stopping, Stop> {
        self.start_global_set();
        for (id, ranks) in static_sets {
            self.make_set(id, ranks)?;
        }
        let mut next = Instant::now();
        let mut quiet_cycles = 0u32;
        loop {
            self.wait_for_cycle(next);
            if let Some(timeline) = &self.shared.timeline {
                timeline.cycle_start();
            }
            // a job with nothing in flight on any rank (between steps, in
            // the forward pass) cycles less often: idle cycles of ranks
            // that outnumber the cores take CPU from the training. A
            // submission wakes its own loop at once, and every rank cycles
            // at the full rate again from the first cycle that sees it.
            let slowdown = if quiet_cycles >= QUIET_AFTER_CYCLES { QUIET_SLOWDOWN } else { 1 };
            next = Instant::now() + self.params.cycle_time() * slowdown;
            // a set removed and another made under its id in this
            // iteration's global cycle waits for the next iteration on
            // every rank: its old members must not cycle it before the rest
            let ids: Vec<(u32, u64)> = self.sets.iter().map(|(&id, s)| (id, s.serial)).collect();
            // read once a cycle: the global set, which every rank cycles
            // first, then carries it to all, and all stop after this cycle
            // (a stall past its shutdown time found by the coordinator of
            // any set goes the same way, a cycle later: a set's own verdict
            // would stop its members only)
            let asked = self.shared.lock().shutdown_asked.clone().or_else(|| self.stall_stop.clone());
            let mut shutdown = None;
            for (id, serial) in ids {
                if self.sets.get(&id).is_some_and(|s| s.serial == serial) {
                    let ended = self.cycle(id, asked.clone())?;
                    // the global set's cycle speaks for every rank's sets
                    if id == 0 {
                        shutdown = ended.shutdown;
                        quiet_cycles = if ended.quiet { quiet_cycles.saturating_add(1) } else { 0 };
                    }
                }
            }
            if let Some(cause) = shutdown {
                return Ok(cause);
            }
        }
    }

    /// Set 0, of every rank, over the job's communicator.
    fn start_global_set(&mut self) {
        let global = self.global.take().expect("the global communicator");
        let ranks: Vec<u32> = (0..self.shared.size).collect();
        let set = self.set_loop(global, ranks);
        self.sets.insert(0, set);
    }

    fn set_loop(&mut self, comm: Communicator, global_ranks: Vec<u32>) -> SetLoop {
        self.sets_made += 1;
        let mut set = SetLoop::new(comm, global_ranks, &self.shared.settings, self.sets_made);
        set.retune(&self.params);
        set
    }

    /// Splits the global communicator for a new set: every rank takes part,
    /// the members keep theirs.
    fn make_set(&mut self, id: u32, ranks: Vec<u32>) -> Result<(), Stop> {
        let member = ranks.contains(&self.shared.rank);
        let global = &mut self.sets.get_mut(&0).expect("the global set").comm;
        let comm = global.split(u32::from(member), self.shared.rank)?;
        if member {
            let set = self.set_loop(comm, ranks);
            self.sets.insert(id, set);
        }
        Ok(())
    }

    /// Until the next cycle is due, or something is queued here, or a
    /// shutdown was asked for.
    fn wait_for_cycle(&self, due: Instant) {
        let mut state = self.shared.lock();
        loop {
            let queued = state.sets.values().any(|s| !s.queue.is_empty());
            let now = Instant::now();
            if queued || state.shutdown_asked.is_some() || now >= due {
                return;
            }
            state = self.shared.wake.wait_timeout(state, due - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// One set's part of a cycle: agree, then run what was agreed.
    fn cycle(&mut self, id: u32, shutdown_asked: Option<Stopping>) -> Result<CycleEnd, Stop> {
        let now = self.now();
        let set = self.sets.get_mut(&id).expect("a set this loop holds");
        let agreed = set.cycle(&self.shared, id, now, shutdown_asked)?;
        Trace::of(&self.shared).agreed(&self.shared, id, &agreed.responses);
        if self.stall_stop.is_none() {
            self.stall_stop = agreed.stall_stop;
        }
        let tuning = id == 0 && self.tuned.as_ref().is_some_and(Tuned::active);
        let observed = tuning.then(|| Tuned::observe(&agreed.responses));
        for response in agreed.responses {
            self.execute(id, response)?;
        }
        if let Some(observed) = observed {
            self.after_tuning_cycle(observed)?;
        }
        Ok(CycleEnd { shutdown: agreed.shutdown, quiet: agreed.quiet })
    }

    /// Autotune's part of a global cycle: new parameters, when a score was
    /// due, in force on every rank before any set's next cycle.
    fn after_tuning_cycle(&mut self, observed: (Vec<String>, u64)) -> Result<(), Stop> {
        let now = self.now();
        let comm = &mut self.sets.get_mut(&0).expect("the global set").comm;
        let tuned = self.tuned.as_mut().expect("tuning");
        if let Some(params) = tuned.after_cycle(comm, observed, now)? {
            self.params = params;
            for set in self.sets.values_mut() {
                set.retune(&params);
            }
        }
        Ok(())
    }

    fn execute(&mut self, id: u32, response: Response) -> Result<(), Stop> {
        let mut entries: Vec<Option<Entry>> = {
            let mut state = self.shared.lock();
            let set = state.sets.get_mut(&id).expect("held");
            response.names.iter().map(|name| set.table.remove(name)).collect()
        };
        // taken out of the table, the loop's failure would not reach them:
        // those a failed execution left unfinished get its error (an
        // elastic job needs to see that it was the membership that failed)
        let executed = self.execute_entries(id, response, &mut entries);
        if let Err(Stop::Failed(failure)) = &executed {
            for entry in entries.into_iter().flatten() {
                entry.finish(Err(failure.clone()));
            }
        }
        executed
    }

    fn execute_entries(&mut self, id: u32, response: Response, entries: &mut [Option<Entry>]) -> Result<(), Stop> {
        let set = self.sets.get_mut(&id).expect("held");
        let traced = Running::of(id, &response, entries, &mut self.traced);
        let performed = perform(set, &self.shared, id, response, &mut self.fusion, entries);
        if let Some(traced) = traced {
            traced.ended(performed.is_ok());
        }
        match performed? {
            None => {}
            Some(SetChange::Added { id: new_id, ranks }) => {
                self.make_set(new_id, ranks)?;
                for entry in take_all(entries) {
                    entry.finish(Ok(Output { dims: vec![i64::from(new_id)], ..Output::default() }));
                }
            }
            Some(SetChange::Removed(gone)) => {
                self.sets.remove(&gone);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::Core;
    use crate::entry::{Buffer, Submit};
    use crate::message::{DataType, ReduceOp, RequestType, ResponseType};
    use crate::settings::Settings;
    use kolo_comm::{Config, Secret};
    use kolo_rendezvous::{RendezvousServer, ServerConfig};

    /// Two ranks' communicators, over TCP (each on a host of its own).
    fn two_communicators() -> (Communicator, Communicator, tokio::runtime::Runtime, RendezvousServer) {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let server =
            runtime.block_on(RendezvousServer::start(ServerConfig::new("127.0.0.1:0".parse().unwrap()), &[])).unwrap();
        let config = |r: usize| {
            Config::new(r, 2, format!("host-{r}"), server.addr().to_string(), Secret::new("s").unwrap(), "execute")
                .unwrap()
                .with_timeout(Duration::from_secs(20))
        };
        let other = {
            let config = config(1);
            std::thread::spawn(move || Communicator::connect(config).unwrap())
        };
        let first = Communicator::connect(config(0)).unwrap();
        (first, other.join().unwrap(), runtime, server)
    }

    #[test]
    fn work_taken_out_for_execution_gets_the_error_that_ended_it_not_a_wait_forever() {
        let (comm, peer, _runtime, _server) = two_communicators();
        let (shared, mut background, _) = Core::prepare(comm, Settings::default(), &[]).unwrap();
        background.start_global_set();
        let mut values = vec![1.0f32; 1 << 20];
        let mut submit = Submit::new(
            RequestType::Allreduce,
            "grad",
            DataType::Float32,
            vec![values.len() as i64],
            Buffer::new(values.as_mut_ptr() as usize, values.len() * 4),
        );
        submit.reduce_op = ReduceOp::Sum;
        let handle = shared.lock().sets.get_mut(&0).unwrap().enqueue(0, vec![submit]).unwrap();
        // the peer is gone after negotiation: the execution fails part way
        drop(peer);
        let mut response = Response::new(ResponseType::Allreduce, "grad");
        response.dtype = DataType::Float32;
        response.sizes = vec![values.len() as i64];
        response.devices = vec![-1, -1];
        assert!(background.execute(0, response).is_err());
        assert!(handle.is_done(), "the entry's waiter was left waiting");
        let outcome = handle.outcomes().unwrap().remove(0);
        let failure = outcome.expect_err("the allreduce cannot have succeeded");
        assert!(!failure.message.contains("abandoned"), "the failure is the communicator's: {}", failure.message);
    }
}
