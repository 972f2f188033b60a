//! One process set's cycle (upstream's `controller.cc`:
//! `ComputeResponseList`): the ranks agree on what is ready, through the
//! response cache's bits when every name is cached, else through the
//! set's coordinator, and each rank comes away with the same list of
//! responses, fused, in the same order. Joined ranks, the stall inspector
//! and a rank's request to shut down all take part here; running the
//! list is `perform`'s.

use std::time::Duration;

use kolo_comm::{CommError, Communicator};

use crate::autotune::Params;
use crate::cache::{CacheCoordinator, CacheState, ResponseCache, TensorParams};
use crate::entry::{Failure, FailureKind};
use crate::fusion::fuse;
use crate::message::{Request, RequestList, RequestType, Response, ResponseList, ResponseType, Stopping};
use crate::negotiate::Coordinator;
use crate::settings::Settings;
use crate::stall::{Stall, StallInspector};
use crate::state::{Shared, Stats};
use crate::timeline::{self, Event, Trace};

/// One set as the background thread holds it.
#[derive(Debug)]
pub(crate) struct SetLoop {
    pub(crate) comm: Communicator,
    cache: ResponseCache,
    /// The set's rank 0 negotiates for all.
    coordinator: Option<Coordinator>,
    stall: StallInspector,
    global_ranks: Vec<u32>,
    /// Which making of a set this is (ids are reused).
    pub(crate) serial: u64,
    /// In force now (autotune changes it between cycles, on every rank alike).
    fusion_threshold: i64,
    /// `HOROVOD_CACHE_CAPACITY`, for when autotune turns the cache back on.
    cache_capacity: usize,
}

/// What ended the loop.
pub(crate) enum Stop {
    /// Every rank agreed to stop; who asked and why.
    ShutDown(Stopping),
    Failed(Failure),
}

impl From<CommError> for Stop {
    fn from(e: CommError) -> Stop {
        Stop::Failed(Failure { kind: FailureKind::Internal, membership: e.is_membership(), message: e.to_string() })
    }
}

/// What a set's ranks agreed on in one cycle.
pub(crate) struct Agreed {
    /// What every rank of the set runs now, in this order.
    pub(crate) responses: Vec<Response>,
    /// The job shuts down after this cycle: who asked, and why.
    pub(crate) shutdown: Option<Stopping>,
    /// No rank of the set had anything in flight (known with the cache on).
    pub(crate) quiet: bool,
    /// This rank, as the set's coordinator, found a stall past its
    /// shutdown time: it asks every rank to stop.
    pub(crate) stall_stop: Option<Stopping>,
}

/// What this rank brings to a cycle, taken from the set's queue.
struct Taken {
    requests: Vec<Request>,
    /// This rank has joined (it stands in for the others' allreduces).
    joined: bool,
    /// Anything submitted and not yet done, in any set of this rank.
    in_flight: bool,
}

impl SetLoop {
    /// A set over `comm`, whose ranks are `global_ranks` of the job.
    pub(crate) fn new(comm: Communicator, global_ranks: Vec<u32>, settings: &Settings, serial: u64) -> SetLoop {
        let coordinator = (comm.rank() == 0).then(|| Coordinator::new(global_ranks.clone(), settings.fusion_threshold));
        SetLoop {
            serial,
            comm,
            cache: ResponseCache::new(settings.cache_capacity),
            coordinator,
            stall: StallInspector::new(settings.stall),
            global_ranks,
            fusion_threshold: settings.fusion_threshold as i64,
            cache_capacity: settings.cache_capacity,
        }
    }

    /// Puts autotune's parameters in force from the next cycle; every rank
    /// of the set does so between the same two cycles. A cache switched
    /// starts empty: every name is negotiated once more.
    pub(crate) fn retune(&mut self, params: &Params) {
        self.fusion_threshold = params.fusion_threshold as i64;
        let capacity = if params.cache_enabled { self.cache_capacity } else { 0 };
        if capacity != self.cache.capacity() {
            self.cache = ResponseCache::new(capacity);
            self.stall.forget_cached();
        }
    }

    /// Set `id`'s cycle: what its ranks run now. `stopping`: why this
    /// rank stops the job, if it does (every rank learns it).
    pub(crate) fn cycle(
        &mut self,
        shared: &Shared,
        id: u32,
        now: Duration,
        stopping: Option<Stopping>,
    ) -> Result<Agreed, Stop> {
        let taken = take_queue(shared, id);
        let mut coord = self.cache_bits(&taken, now);
        coord.busy = taken.in_flight || !taken.requests.is_empty();
        let stall_stop = self.inspect_stalls(shared, now, &mut coord);
        // a rank that stops makes every rank negotiate this cycle
        coord.uncached |= stopping.is_some();
        let send = self.agree_on_bits(shared, id, &mut coord, taken.requests)?;
        let capacity = self.cache.capacity();
        let fast = capacity > 0 && !coord.uncached;
        count(shared, |stats| {
            stats.cycles += 1;
            if !fast {
                stats.negotiated += 1;
                stats.requests_sent += send.len() as u64;
            }
        });
        let threshold = self.fusion_threshold;
        let list = if fast {
            let responses: Vec<Response> = coord.hits.iter().map(|&bit| self.cache.get(bit)).collect();
            // a rank that stops makes the cycle a negotiated one: not here
            ResponseList { responses: fuse(responses, threshold, &row_bytes_of(shared, id)), shutdown: None }
        } else {
            let mine = RequestList { requests: send, shutdown: stopping };
            let list = self.negotiate(shared, id, &mine, &coord, now)?;
            // every rank caches what was negotiated, in list order
            if capacity > 0 {
                self.put_in_cache(shared, id, &list, taken.joined);
            }
            list
        };
        self.cache.update_bits();
        count(shared, |stats| {
            stats.responses += list.responses.len() as u64;
            stats.tensors += list.responses.iter().map(|r| r.names.len() as u64).sum::<u64>();
        });
        // without the cache there is no AND to learn the others' state from
        let quiet = fast && !coord.busy && list.responses.is_empty();
        Ok(Agreed { responses: list.responses, shutdown: list.shutdown, quiet, stall_stop })
    }

    /// What this rank's requests say of the cache: hits, invalid bits, and
    /// whether anything needs the coordinator.
    fn cache_bits(&mut self, taken: &Taken, now: Duration) -> CacheCoordinator {
        let mut coord = CacheCoordinator::new(self.cache.num_active_bits());
        let capacity = self.cache.capacity();
        for r in &taken.requests {
            if matches!(r.kind, RequestType::Join | RequestType::Barrier)
                || matches!(r.kind, RequestType::AddProcessSet | RequestType::RemoveProcessSet)
            {
                coord.uncached = true;
                continue;
            }
            if capacity == 0 {
                coord.uncached = true;
                continue;
            }
            match self.cache.cached(r) {
                CacheState::Hit => {
                    coord.hits.insert(self.cache.bit_of(&r.name).expect("a hit has a bit"));
                    self.stall.record_cached(&r.name, now);
                }
                state => {
                    if state == CacheState::Invalid {
                        coord.invalid.insert(self.cache.bit_of(&r.name).expect("cached"));
                    }
                    coord.uncached = true;
                    self.stall.remove_cached(&r.name);
                }
            }
        }
        if taken.joined && capacity > 0 {
            // a joined rank stands in for the others' cached allreduces
            // (with zeros); any other cached op cannot run beside it:
            // erased on every rank, it goes to the coordinator, which
            // answers it with upstream's error
            for bit in self.cache.all_bits() {
                match self.cache.peek(bit).kind {
                    ResponseType::Allreduce | ResponseType::Adasum => {
                        coord.hits.insert(bit);
                    }
                    _ => {
                        coord.invalid.insert(bit);
                        coord.uncached = true;
                    }
                }
            }
        }
        coord
    }

    /// The stall check, at most once per interval: the coordinator warns
    /// of names some ranks have not submitted; a cached name stalled here
    /// goes to the coordinator. A stall past its shutdown time: the
    /// request to stop that this rank then makes.
    fn inspect_stalls(&mut self, shared: &Shared, now: Duration, coord: &mut CacheCoordinator) -> Option<Stopping> {
        if !self.stall.check_due(now) {
            return None;
        }
        let mut stop = None;
        if self.coordinator.is_some() {
            if let Some(stall) = self.stall.check(&self.global_ranks, now) {
                stop = report_stall(shared, stall);
            }
        }
        if self.cache.capacity() > 0 {
            for name in self.stall.stalled_cached(now) {
                if let Some(bit) = self.cache.bit_of(&name) {
                    coord.invalid.insert(bit);
                    coord.uncached = true;
                }
            }
        }
        self.stall.checked(now);
        stop
    }

    /// The cache's bit vectors, allreduced (AND, then OR when some rank
    /// needs it): the hits every rank has run from the cache; this rank's
    /// hits the others lack go back to the queue for a later cycle. What
    /// is left goes to the coordinator.
    fn agree_on_bits(
        &mut self,
        shared: &Shared,
        id: u32,
        coord: &mut CacheCoordinator,
        mut send: Vec<Request>,
    ) -> Result<Vec<Request>, Stop> {
        if self.cache.capacity() == 0 {
            return Ok(send);
        }
        let mut and = coord.and_vector();
        let status_and_hits = and.len();
        // with a timeline (on every rank alike), a second section tells
        // which bits some rank hit, as upstream's timeline bits do: 0 where
        // this rank hit, so that the AND is 0 where any rank did
        let bits = self.cache.num_active_bits() as u32;
        let timeline_bits = shared.settings.timeline.is_some();
        if timeline_bits {
            and.extend((0..bits).map(|b| u8::from(!coord.hits.contains(&b))));
        }
        self.comm.allreduce_in_place::<u8>(&mut and, kolo_comm::ReduceOp::Min)?;
        let some_hit = &and[status_and_hits..];
        coord.take_and(&and[..status_and_hits]);
        if coord.needs_or(&and) {
            let mut or = coord.or_vector();
            self.comm.allreduce_in_place::<u8>(&mut or, kolo_comm::ReduceOp::Max)?;
            coord.take_or(&or);
            for &bit in &coord.invalid {
                self.cache.erase(bit);
            }
        }
        let trace = Trace::of(shared);
        if trace.on() && timeline_bits {
            // a cached name's negotiation begins with the first rank's hit
            // and ends once every rank has it (no per-rank marks: the bits
            // do not say who)
            for bit in (0..bits).filter(|&b| some_hit[b as usize] == 0 && !coord.invalid.contains(&b)) {
                let response = self.cache.peek(bit);
                let op = timeline::op_name(response.kind);
                trace.record(Event::NegotiateStart { name: &response.names[0], op });
            }
            for &bit in &coord.hits {
                trace.record(Event::NegotiateEnd { name: &self.cache.peek(bit).names[0] });
            }
        }
        let mut again = Vec::new();
        send.retain(|r| {
            if self.cache.cached(r) != CacheState::Hit {
                self.stall.remove_cached(&r.name);
                return true;
            }
            let bit = self.cache.bit_of(&r.name).expect("a hit");
            if !coord.hits.contains(&bit) {
                again.push(r.clone());
            } else {
                self.stall.remove_cached(&r.name);
            }
            false
        });
        if !again.is_empty() {
            let mut state = shared.lock();
            let queue = &mut state.sets.get_mut(&id).expect("held").queue;
            for r in again.into_iter().rev() {
                queue.push_front(r);
            }
        }
        Ok(send)
    }

    /// The negotiated path: every rank's requests go to the set's
    /// coordinator, which answers every rank with the same list.
    fn negotiate(
        &mut self,
        shared: &Shared,
        id: u32,
        mine: &RequestList,
        coord: &CacheCoordinator,
        now: Duration,
    ) -> Result<ResponseList, Stop> {
        let size = self.comm.size();
        let mine = postcard::to_stdvec(mine)
            .map_err(|e| Stop::Failed(Failure::internal(format!("cannot encode a request list: {e}"))))?;
        let mut lengths = vec![0i64; size];
        self.comm.allgather(&[mine.len() as i64], &mut lengths)?;
        let counts: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
        let mut all = vec![0u8; if self.comm.rank() == 0 { counts.iter().sum() } else { 0 }];
        self.comm.gatherv(&mine, &mut all, &counts, 0)?;
        let mut bytes = Vec::new();
        if let Some(coordinator) = self.coordinator.as_mut() {
            let mut lists: Vec<Vec<Request>> = Vec::with_capacity(size);
            let mut at = 0;
            let mut stopping = Vec::new();
            let mut exiting = false;
            for (set_rank, &len) in counts.iter().enumerate() {
                let list: RequestList = postcard::from_bytes(&all[at..at + len])
                    .map_err(|e| Stop::Failed(Failure::internal(format!("a request list did not decode: {e}"))))?;
                if let Some(asked) = list.shutdown {
                    exiting |= asked.exiting;
                    stopping.push((self.global_ranks[set_rank], asked.reason));
                }
                lists.push(list.requests);
                at += len;
            }
            let shutdown = (!stopping.is_empty()).then(|| Stopping { reason: shutdown_cause(&stopping), exiting });
            let mut responses = Vec::new();
            // the common cache hits first; not once everyone joined, this
            // cycle's joins counted (they would only reduce zeros everywhere)
            let joining = lists.iter().flatten().filter(|r| r.kind == RequestType::Join).count();
            if coordinator.joined_size() + joining < size {
                responses.extend(coord.hits.iter().map(|&bit| self.cache.peek(bit).clone()));
            }
            let trace = Trace::of(shared);
            if trace.on() {
                // each rank's request reached the coordinator now
                for (set_rank, list) in lists.iter().enumerate() {
                    for r in list.iter().filter(|r| r.kind != RequestType::Join) {
                        trace.record(Event::NegotiateStart { name: &r.name, op: r.kind.name() });
                        trace.record(Event::RankReady { name: &r.name, rank: self.global_ranks[set_rank] });
                    }
                }
            }
            let ready = coordinator.on_cycle(&lists, &mut self.stall, now);
            for name in ready.iter().flat_map(|r| &r.names) {
                trace.record(Event::NegotiateEnd { name });
            }
            responses.extend(ready);
            let threshold = self.fusion_threshold;
            let list = ResponseList { responses: fuse(responses, threshold, &row_bytes_of(shared, id)), shutdown };
            bytes = postcard::to_stdvec(&list)
                .map_err(|e| Stop::Failed(Failure::internal(format!("cannot encode a response list: {e}"))))?;
        }
        self.comm.broadcast_bytes(&mut bytes, 0)?;
        let list: ResponseList = postcard::from_bytes(&bytes)
            .map_err(|e| Stop::Failed(Failure::internal(format!("the response list did not decode: {e}"))))?;
        Ok(list)
    }

    /// Every rank caches the cacheable responses of a negotiated list, in order.
    fn put_in_cache(&mut self, shared: &Shared, id: u32, list: &ResponseList, joined: bool) {
        let size = self.comm.size();
        let state = shared.lock();
        let table = &state.sets.get(&id).expect("held").table;
        for response in &list.responses {
            if !response.kind.cacheable() || response.devices.len() != size {
                continue;
            }
            let per = response.sizes.len() / response.names.len().max(1);
            let params = |i: usize| match table.get(&response.names[i]) {
                Some(e) => {
                    TensorParams { device: e.submit.device, dtype: e.submit.dtype, shape: e.submit.shape.clone() }
                }
                // a joined rank knows the element count only
                None => TensorParams {
                    device: response.devices.first().copied().unwrap_or(crate::message::CPU_DEVICE_ID),
                    dtype: response.dtype,
                    shape: response.sizes[i * per..(i + 1) * per].to_vec(),
                },
            };
            match self.cache.put(response, params, joined) {
                Ok(Some(warning)) => tracing::warn!("{warning}"),
                Ok(None) => {}
                Err(e) => tracing::error!("{e}"),
            }
        }
    }
}

/// This rank's new requests for set `id`, and what else the cycle needs
/// to know of this rank.
fn take_queue(shared: &Shared, id: u32) -> Taken {
    let mut state = shared.lock();
    let in_flight = state.sets.values().any(|s| !s.table.is_empty());
    let set = state.sets.get_mut(&id).expect("a set this loop holds");
    Taken { requests: std::mem::take(&mut set.queue).into(), joined: set.joined, in_flight }
}

fn count(shared: &Shared, update: impl FnOnce(&mut Stats)) {
    update(&mut shared.stats.lock().unwrap_or_else(|p| p.into_inner()));
}

/// Says what the coordinator's stall check found: printed when it changes,
/// not at every check (a line of output is a sign of life to kolo's hang
/// watch, which must still see a stalled job as hung), and left for kolo's
/// hang report. Past the shutdown time: why this rank stops the job.
fn report_stall(shared: &Shared, stall: Stall) -> Option<Stopping> {
    let mut stats = shared.stats.lock().unwrap_or_else(|p| p.into_inner());
    if stall.shut_down || stats.stall.as_deref() != Some(&stall.message) {
        eprintln!("[{}]: {}", if stall.shut_down { "ERROR" } else { "WARNING" }, stall.message);
        if let Some(file) = &shared.settings.stall_file {
            write_stall(file, &stall.message);
        }
    }
    let stop = stall.shut_down.then(|| Stopping {
        reason: format!(
            "its stall inspector found tensors waiting past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: {}",
            stall.message
        ),
        exiting: false,
    });
    stats.stall = Some(stall.message);
    stop
}

/// Leaves the warning where kolo's hang report reads it: private to the
/// job's user, replacing the one before.
fn write_stall(file: &std::path::Path, text: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(file)
        .and_then(|mut f| f.write_all(text.as_bytes()));
    if let Err(e) = written {
        tracing::warn!("cannot write the stall warning to {}: {e}", file.display());
    }
}

/// An allgathered tensor's row bytes, from this rank's own entry.
fn row_bytes_of(shared: &Shared, id: u32) -> impl Fn(&str) -> i64 + '_ {
    move |name: &str| {
        let state = shared.lock();
        let entry = state.sets.get(&id).and_then(|s| s.table.get(name));
        entry.map_or(0, |e| e.submit.shape.iter().skip(1).product::<i64>() * e.submit.dtype.size() as i64)
    }
}

/// Who stopped the job and why, for every rank's errors: `(global rank,
/// reason)` in rank order; ranks with the same reason are named together
/// ("rank 1 (hvd.shutdown() was called)").
fn shutdown_cause(stopping: &[(u32, String)]) -> String {
    let mut by_reason: Vec<(&str, Vec<u32>)> = Vec::new();
    for (rank, reason) in stopping {
        match by_reason.iter_mut().find(|(r, _)| r == reason) {
            Some((_, ranks)) => ranks.push(*rank),
            None => by_reason.push((reason, vec![*rank])),
        }
    }
    let parts: Vec<String> = by_reason
        .iter()
        .map(|(reason, ranks)| {
            let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
            let who = if ranks.len() == 1 { "rank" } else { "ranks" };
            format!("{who} {} ({reason})", list.join(", "))
        })
        .collect();
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shutdown_cause_names_each_rank_with_its_reason() {
        let one = shutdown_cause(&[(1, "hvd.shutdown() was called".into())]);
        assert_eq!(one, "rank 1 (hvd.shutdown() was called)");
        let many = shutdown_cause(&[
            (0, "its process is exiting".into()),
            (1, "hvd.shutdown() was called".into()),
            (3, "its process is exiting".into()),
        ]);
        assert_eq!(many, "ranks 0, 3 (its process is exiting); rank 1 (hvd.shutdown() was called)");
    }
}
