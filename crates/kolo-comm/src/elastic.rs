//! Elastic jobs in place (Horovod's elastic mode, for programs that use
//! kolo-comm): when a worker dies, a host is lost or hosts are added,
//! the surviving processes keep running; kolo's driver starts a new round
//! (`kolo run --in-place`), every member joins it with its new rank, a
//! fresh [`Communicator`] is built, the training state is synced from the
//! new rank 0, and the loop goes on from its last commit.
//!
//! ```no_run
//! use kolo_comm::elastic::{Elastic, State};
//! use kolo_comm::ReduceOp;
//! #[derive(Clone, serde::Serialize, serde::Deserialize)]
//! struct Progress { step: u64, weights: Vec<f32> }
//!
//! let mut elastic = Elastic::from_env()?;
//! let mut state = State::new(Progress { step: 0, weights: vec![0.0; 8] });
//! elastic.run(&mut state, |state, comm| {
//!     while state.step < 1000 {
//!         let grads = vec![1.0f32; 8];
//!         let mut mean = vec![0.0f32; 8];
//!         comm.allreduce(&grads, &mut mean, ReduceOp::Avg)?; // a lost peer: an error, soon
//!         state.weights.iter_mut().zip(&mean).for_each(|(w, g)| *w -= 0.1 * g);
//!         state.step += 1;
//!         if state.step % 10 == 0 {
//!             state.commit()?; // also: hosts were added, join the new round
//!         }
//!     }
//!     Ok(())
//! })?;
//! # Ok::<(), kolo_comm::CommError>(())
//! ```
//!
//! How a process learns its place: kolo's rendezvous server answers
//! `GET /rank_and_size/round` with the current round's number and `GET
//! /rank_and_size/<host>:<local_rank>` with the process's ranks in it
//! (Horovod's protocol; `-1`s for a process the round left out). A process
//! is named by the host and local rank it was started with
//! (`HOROVOD_HOSTNAME`, `HOROVOD_LOCAL_RANK`); it joins rounds from
//! `KOLO_ELASTIC_ROUND` on, the round kolo started it for.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kolo_rendezvous::elastic::{JOINED_SCOPE, RANK_AND_SIZE, ROUND_KEY};
use kolo_rendezvous::BlockingClient;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::bootstrap::store_client;
use crate::interrupt::Interrupt;
use crate::{CommError, Communicator, Config};

// Set by `kolo run --in-place`: the first round this process belongs to,
// and how long it waits for a round that includes it (default 600 s,
// kolo's `--elastic-timeout`).
use kolo_topology::env_names::{ELASTIC_ROUND as ENV_ROUND, ELASTIC_TIMEOUT_SECONDS as ENV_TIMEOUT};
/// How often a waiting collective asks whether its round is over.
const CHECK_EVERY: Duration = Duration::from_millis(20);

/// One process's place in one round (Horovod's six numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// This process's rank in the round, below `size`.
    pub rank: usize,
    /// How many processes the round has.
    pub size: usize,
    /// This process's rank among those on its host.
    pub local_rank: usize,
    /// How many processes of the round are on this host.
    pub local_size: usize,
    /// This process's rank among the processes with its `local_rank` (one
    /// per host).
    pub cross_rank: usize,
    /// How many processes have this `local_rank` (the hosts that have one).
    pub cross_size: usize,
}

/// Parses `rank,size,local_rank,local_size,cross_rank,cross_size`; `None`
/// for Horovod's all `-1` (no place in the round).
pub fn parse_assignment(text: &str) -> Result<Option<Assignment>, CommError> {
    let bad = || CommError::Bootstrap(format!("malformed rank assignment '{text}'"));
    let numbers: Vec<i64> =
        text.trim().split(',').map(|n| n.trim().parse().map_err(|_| bad())).collect::<Result<_, _>>()?;
    let [rank, size, local_rank, local_size, cross_rank, cross_size] = numbers[..] else { return Err(bad()) };
    if numbers.iter().all(|&n| n == -1) {
        return Ok(None);
    }
    let n = |v: i64| usize::try_from(v).map_err(|_| bad());
    let a = Assignment {
        rank: n(rank)?,
        size: n(size)?,
        local_rank: n(local_rank)?,
        local_size: n(local_size)?,
        cross_rank: n(cross_rank)?,
        cross_size: n(cross_size)?,
    };
    if a.rank >= a.size || a.local_rank >= a.local_size || a.cross_rank >= a.cross_size {
        return Err(bad());
    }
    Ok(Some(a))
}

/// Watches the round number on the store: what [`State::commit`] and the
/// communicators' [`Interrupt`] ask.
struct RoundWatch {
    client: Mutex<(BlockingClient, Option<Instant>)>,
    joined: u64,
}

impl RoundWatch {
    /// The newer round, if the driver has started one; asks the store at
    /// most every [`CHECK_EVERY`]. A store that cannot be reached says
    /// nothing: the driver is gone, and kolo ends this process anyway.
    fn newer(&self) -> Option<u64> {
        let mut guard = self.client.lock().unwrap_or_else(|p| p.into_inner());
        let (client, last) = &mut *guard;
        if last.is_some_and(|at| at.elapsed() < CHECK_EVERY) {
            return None;
        }
        *last = Some(Instant::now());
        let round = read_round(client).ok()?;
        (round > self.joined).then_some(round)
    }
}

fn read_round(client: &mut BlockingClient) -> Result<u64, CommError> {
    let value = client.get(RANK_AND_SIZE, ROUND_KEY).map_err(CommError::Store)?;
    let text = value.map(|v| String::from_utf8_lossy(&v).into_owned()).unwrap_or_default();
    text.trim().parse().map_err(|_| CommError::Bootstrap(format!("the store's round is '{text}', not a number")))
}

/// A process of an in-place elastic job: joins rounds, runs the training
/// loop through them.
pub struct Elastic {
    /// `<host>:<local_rank>` as the process was started.
    id: String,
    base: Config,
    client: BlockingClient,
    /// The round this process last joined (or tried to); none until a
    /// round has a place for it.
    joined: Option<u64>,
    first_round: u64,
    wait_timeout: Duration,
    assignment: Option<Assignment>,
    /// Watches for a round after the one joined last.
    watch: Option<Arc<RoundWatch>>,
}

impl Elastic {
    /// From the variables `kolo run --in-place` sets ([`Config::from_env`]'s,
    /// `KOLO_ELASTIC_ROUND`, `HOROVOD_HOSTNAME` and `HOROVOD_LOCAL_RANK`).
    pub fn from_env() -> Result<Elastic, CommError> {
        let var = |name: &str| {
            std::env::var(name).map_err(|_| {
                CommError::Env(format!("{name} is not set: start an in-place elastic job with kolo run --in-place"))
            })
        };
        let first_round: u64 =
            var(ENV_ROUND)?.parse().map_err(|_| CommError::Env(format!("{ENV_ROUND} is not a number")))?;
        let id = format!("{}:{}", var("HOROVOD_HOSTNAME")?, var("HOROVOD_LOCAL_RANK")?);
        let wait_timeout = match std::env::var(ENV_TIMEOUT) {
            Ok(v) => Duration::from_secs_f64(
                v.parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .ok_or_else(|| CommError::Env(format!("{ENV_TIMEOUT}='{v}' is not a number of seconds")))?,
            ),
            Err(_) => Duration::from_secs(600),
        };
        Elastic::new(Config::from_env()?, id, first_round, wait_timeout)
    }

    /// Explicit settings: `base` gives the store, secret, job, host and
    /// transport (its rank and size are ignored); `id` is this process's
    /// `<host>:<local_rank>`.
    pub fn new(base: Config, id: String, first_round: u64, wait_timeout: Duration) -> Result<Elastic, CommError> {
        let client = store_client(&base);
        Ok(Elastic { id, base, client, joined: None, first_round, wait_timeout, assignment: None, watch: None })
    }

    /// The round joined last, if any.
    pub fn round(&self) -> Option<u64> {
        self.joined
    }

    /// The number of a round the driver started after the one joined last
    /// (hosts came or went), if any; asks the store at most every 20 ms.
    pub fn newer_round(&self) -> Option<u64> {
        self.watch.as_ref().and_then(|w| w.newer())
    }

    /// This process's ranks in the round joined last.
    pub fn assignment(&self) -> Option<Assignment> {
        self.assignment
    }

    /// Waits for a round newer than the last one joined (the first: the one
    /// this process was started for) and joins it: a communicator with this
    /// process's ranks in it. [`CommError::Removed`] when the round has no
    /// place for this process.
    pub fn join(&mut self) -> Result<Communicator, CommError> {
        let deadline = Instant::now() + self.wait_timeout;
        loop {
            let (round, assignment) = self.next_round(deadline)?;
            self.joined = Some(round);
            let Some(a) = assignment else {
                return Err(CommError::Removed { id: self.id.clone(), round });
            };
            let watch = Arc::new(self.watch(round));
            self.watch = Some(watch.clone());
            match Communicator::connect(self.round_config(a, format!("r{round}"), watch)) {
                Ok(comm) => {
                    self.assignment = Some(a);
                    // the driver ends a finishing job once this round's members are done
                    self.client.put(JOINED_SCOPE, &self.id, round.to_string().as_bytes()).map_err(CommError::Store)?;
                    return Ok(comm);
                }
                Err(e) if e.is_membership() => {
                    tracing::info!(round, "kolo-comm: joining round {round} failed ({e}); waiting for the next");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Another communicator of the round joined last, with the same ranks
    /// and interrupted alike, for a second user of the round (Horovod's core
    /// beside the torch group's): collective, every member calls it with
    /// the same `tag`.
    pub fn connect_again(&self, tag: &str) -> Result<Communicator, CommError> {
        let (Some(round), Some(a), Some(watch)) = (self.joined, self.assignment, self.watch.clone()) else {
            return Err(CommError::Bootstrap("no round joined yet: join one first".into()));
        };
        Communicator::connect(self.round_config(a, format!("r{round}-{tag}"), watch))
    }

    /// A communicator's config for `a`'s ranks, named `suffix` in the job,
    /// interrupted once `watch` sees a newer round.
    fn round_config(&self, a: Assignment, suffix: String, watch: Arc<RoundWatch>) -> Config {
        let job_id = format!("{}-{suffix}", self.base.job_id);
        Config { rank: a.rank, size: a.size, job_id, ..self.base.clone() }
            .with_interrupt(Interrupt::new(move || watch.newer()))
    }

    /// The next round and this process's place in it, read so that both
    /// belong to the same round.
    fn next_round(&mut self, deadline: Instant) -> Result<(u64, Option<Assignment>), CommError> {
        let mut wanted = self.joined.map_or(self.first_round, |r| r + 1);
        loop {
            let round = read_round(&mut self.client)?;
            if round >= wanted {
                let text = self.client.get(RANK_AND_SIZE, &self.id).map_err(CommError::Store)?.unwrap_or_default();
                let assignment = parse_assignment(&String::from_utf8_lossy(&text))?;
                if read_round(&mut self.client)? != round {
                    continue;
                }
                // a process started for a later round is not in the rounds
                // published while it started: it waits, it is not removed
                if assignment.is_some() || self.joined.is_some() {
                    return Ok((round, assignment));
                }
                wanted = round + 1;
            }
            if Instant::now() >= deadline {
                return Err(CommError::Bootstrap(format!(
                    "no round {wanted} of the elastic job within {:.0} s",
                    self.wait_timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn watch(&self, joined: u64) -> RoundWatch {
        RoundWatch { client: Mutex::new((store_client(&self.base), None)), joined }
    }

    /// Runs `train` through rounds until it returns: joins a round, syncs
    /// `state` (from the process that committed most: [`State::sync`]),
    /// runs `train`; when a peer is lost
    /// or the round ends, restores the last commit and does it again; when
    /// hosts were added ([`CommError::HostsUpdated`] from `commit`), joins
    /// the new round keeping the state just committed. Other errors, and
    /// [`CommError::Removed`], end it.
    pub fn run<T, R>(
        &mut self,
        state: &mut State<T>,
        mut train: impl FnMut(&mut State<T>, &mut Communicator) -> Result<R, CommError>,
    ) -> Result<R, CommError>
    where
        T: Clone + Serialize + DeserializeOwned,
    {
        loop {
            let mut comm = self.join()?;
            state.watch = self.watch.clone();
            let result = state.sync(&mut comm).and_then(|()| train(state, &mut comm));
            match result {
                Ok(done) => return Ok(done),
                Err(CommError::HostsUpdated { round }) => {
                    tracing::info!("kolo-comm: the hosts changed; joining round {round}");
                }
                Err(e) if e.is_membership() => {
                    tracing::info!("kolo-comm: {e}; going back to the last commit");
                    state.restore();
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Training state that survives rounds (Horovod's `ObjectState`): what
/// the loop changes, the copy taken at the last [`commit`](State::commit),
/// and [`sync`](State::sync) from the process that committed most when a
/// round starts. Derefs to the value.
pub struct State<T> {
    value: T,
    committed: T,
    commits: u64,
    watch: Option<Arc<RoundWatch>>,
}

impl<T: Clone + Serialize + DeserializeOwned> State<T> {
    /// `value`, committed as it is.
    pub fn new(value: T) -> State<T> {
        State { committed: value.clone(), value, commits: 0, watch: None }
    }

    /// Keeps a copy of the value to go back to; then, if the driver has
    /// started a newer round (hosts added or removed), says so with
    /// [`CommError::HostsUpdated`], which [`Elastic::run`] answers by
    /// joining it.
    pub fn commit(&mut self) -> Result<(), CommError> {
        self.committed = self.value.clone();
        self.commits += 1;
        match self.watch.as_ref().and_then(|w| w.newer()) {
            Some(round) => Err(CommError::HostsUpdated { round }),
            None => Ok(()),
        }
    }

    /// Goes back to the last commit.
    pub fn restore(&mut self) {
        self.value = self.committed.clone();
    }

    /// Commits made so far by this process.
    pub fn commits(&self) -> u64 {
        self.commits
    }

    /// Every rank takes the value of the process that committed most, the
    /// lowest rank among equals (and commits it): survivors hold their
    /// last commit, a process new to the job has committed nothing, and in
    /// the first round that is rank 0. The rule of every kolo elastic loop
    /// (Python's `kolo._rounds` too).
    pub fn sync(&mut self, comm: &mut Communicator) -> Result<(), CommError> {
        let mut counts = vec![0i64; comm.size()];
        counts[comm.rank()] = i64::try_from(self.commits).unwrap_or(i64::MAX);
        comm.allreduce_in_place(&mut counts, crate::ReduceOp::Sum)?;
        let most = counts.iter().copied().max().unwrap_or(0);
        let root = counts.iter().position(|&c| c == most).unwrap_or(0);
        let mut bytes = if comm.rank() == root {
            postcard::to_stdvec(&self.value).map_err(|e| CommError::BadArgs(format!("cannot encode the state: {e}")))?
        } else {
            Vec::new()
        };
        comm.broadcast_bytes(&mut bytes, root)?;
        if comm.rank() != root {
            self.value = postcard::from_bytes(&bytes)
                .map_err(|e| CommError::BadArgs(format!("cannot decode rank {root}'s state: {e}")))?;
        }
        self.committed = self.value.clone();
        self.commits = u64::try_from(most).unwrap_or(0);
        Ok(())
    }

    /// The current value (committed or not).
    pub fn into_inner(self) -> T {
        self.value
    }
}

impl<T> Deref for State<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> DerefMut for State<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assignments_parse_and_removed_slots_are_none() {
        assert_eq!(
            parse_assignment("2,3,1,2,0,1").unwrap(),
            Some(Assignment { rank: 2, size: 3, local_rank: 1, local_size: 2, cross_rank: 0, cross_size: 1 })
        );
        assert_eq!(parse_assignment("-1,-1,-1,-1,-1,-1").unwrap(), None);
        for bad in ["", "1,2", "3,3,0,1,0,1", "0,1,0,1,0,x", "0,1,0,1,0,1,0", "-1,1,0,1,0,1"] {
            assert!(parse_assignment(bad).is_err(), "{bad}");
        }
    }
}
