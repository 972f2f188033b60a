//! Elastic membership: which hosts make up each round of an elastic job.
//! Discovery results, failures and the time come in as values; a decision
//! comes out: go on, re-form the world with these hosts, wait for enough
//! slots, or stop with a reason. No I/O and no clock, so that every rule
//! below is tested exhaustively.
//!
//! The rules (Horovod's elastic driver where it is sound, not where it is
//! not; torchrun's restart counting):
//! - A world is filled from the available hosts in order, up to `max_np`
//!   slots; fewer than `min_np` is a wait, and a wait longer than the
//!   elastic timeout stops the job.
//! - The order: the hosts of the last world that are still there, in their
//!   order (so their ranks stay where they can), then every other host in
//!   the order discovery first reported it. Upstream appends new hosts in
//!   a set's order and fails a re-formed world that keeps none of the
//!   previous hosts ("No hosts from previous set remaining"); here such a
//!   world simply forms.
//! - A lost host (its agents killed, cut off, stopped) is blacklisted at
//!   once; with a cooldown range, a host whose ranks fail in two rounds in
//!   a row is too (one failing script is not the host's fault, and without
//!   a cooldown that would be for good). A blacklisted host comes back
//!   after its cooldown, `min`, `2 min`, `4 min`... at most `max`, once
//!   discovery lists it again; without a cooldown range it stays out.
//! - A failure past the restart limit stops the job before anything else.
//! - Every re-formed world is a reset (Horovod's `reset_limit`); those
//!   caused by a failure are restarts (torchrun's `--max-restarts`, which
//!   membership changes do not use up).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::{HostSpec, TopologyError};

/// How long a blacklisted host stays out: Horovod's backoff, `min`·2^n
/// plus up to `min` of jitter after its n-th strike, kept within
/// `min..=max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cooldown {
    /// The cooldown after a host's first strike.
    pub min: Duration,
    /// The longest cooldown, however many strikes.
    pub max: Duration,
}

impl Cooldown {
    /// The shortest cooldown a range may start at (Horovod's bound).
    pub const LOWEST: Duration = Duration::from_secs(1);
    /// The longest cooldown a range may end at (Horovod's bound).
    pub const HIGHEST: Duration = Duration::from_secs(3600);

    /// The range `min..=max`; refused unless `1 s <= min <= max <= 3600 s`.
    pub fn new(min: Duration, max: Duration) -> Result<Self, TopologyError> {
        if min < Self::LOWEST || min > max || max > Self::HIGHEST {
            return Err(TopologyError::BadRequest(format!(
                "cooldown range {}..{} s: give MIN..MAX seconds with 1 <= MIN <= MAX <= 3600",
                min.as_secs_f64(),
                max.as_secs_f64()
            )));
        }
        Ok(Cooldown { min, max })
    }

    /// The cooldown after the host's `strikes`-th blacklisting (1-based),
    /// with `jitter` in `0.0..1.0` (a fraction of `min` added).
    pub fn after(&self, strikes: u32, jitter: f64) -> Duration {
        let doubled = self.min.saturating_mul(1u32 << strikes.min(31));
        let jitter = self.min.mul_f64(jitter.clamp(0.0, 1.0));
        doubled.saturating_add(jitter).clamp(self.min, self.max)
    }
}

/// What an elastic job may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElasticConfig {
    /// The fewest slots a world may have; below it the job waits.
    pub min_np: u32,
    /// The most slots a world takes, however many are available.
    pub max_np: u32,
    /// Re-formed worlds allowed, for any reason (Horovod's `reset_limit`).
    pub reset_limit: Option<u32>,
    /// Re-formed worlds allowed after failures (torchrun's `--max-restarts`).
    pub max_restarts: Option<u32>,
    /// Blacklisted hosts come back after this; `None`: never.
    pub cooldown: Option<Cooldown>,
    /// The longest wait for `min_np` slots.
    pub elastic_timeout: Duration,
    /// Horovod's rule: a host where a rank failed is blacklisted at once
    /// (in place, where nothing else bounds failures); otherwise only a
    /// host failing two rounds in a row, and only with a cooldown.
    pub blacklist_failed_hosts: bool,
    /// Discovery is a fixed list, so it never adds a host: a wait that no
    /// cooldown can end is pointless and stops the job at once.
    pub fixed_hosts: bool,
    /// Seeds the cooldowns' jitter (the caller picks it at random; a test,
    /// to repeat a run).
    pub jitter_seed: u64,
}

impl ElasticConfig {
    /// A config for worlds of `min_np..=max_np` slots, with no limits, no
    /// cooldown and a 600 s elastic timeout; refused unless
    /// `1 <= min_np <= max_np <= MAX_PROCESSES`.
    pub fn new(min_np: u32, max_np: u32) -> Result<Self, TopologyError> {
        if min_np == 0 || min_np > max_np {
            return Err(TopologyError::BadRequest(format!(
                "--min-np {min_np} and --max-np {max_np}: give 1 <= min-np <= max-np"
            )));
        }
        if max_np > crate::MAX_PROCESSES {
            return Err(TopologyError::TooManyProcesses(max_np.into()));
        }
        Ok(ElasticConfig {
            min_np,
            max_np,
            reset_limit: None,
            max_restarts: None,
            cooldown: None,
            elastic_timeout: Duration::from_secs(600),
            blacklist_failed_hosts: false,
            fixed_hosts: false,
            jitter_seed: 0,
        })
    }
}

/// Parses a host discovery script's output: a `host` or `host:slots` a
/// line (a bare host has `default_slots`), blank lines ignored. An empty
/// output is no hosts, not an error.
pub fn parse_discovery(output: &str, default_slots: u32) -> Result<Vec<HostSpec>, TopologyError> {
    let mut hosts: Vec<HostSpec> = Vec::new();
    for (number, line) in output.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = |reason: &str| TopologyError::BadHostfileLine {
            line: number + 1,
            text: line.to_string(),
            reason: format!("{reason} (a discovery script prints 'host' or 'host:slots' a line)"),
        };
        let mut parsed = crate::parse_host_list(line).map_err(|e| bad(&e.to_string()))?;
        if parsed.len() != 1 {
            return Err(bad("one host a line"));
        }
        let mut host = parsed.remove(0);
        if !line.contains(':') || line.ends_with(']') {
            host.slots = default_slots;
        }
        if host.slots == 0 {
            return Err(bad("a host needs at least one slot"));
        }
        if hosts.iter().any(|h| h.name == host.name) {
            return Err(bad("the host is listed twice"));
        }
        hosts.push(host);
    }
    Ok(hosts)
}

/// What happened, as the engine and the workers report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event<'a> {
    /// Discovery's latest answer: every host with its slots, in its order.
    Discovered(&'a [HostSpec]),
    /// A rank's process on this host failed (a non-zero exit).
    RankFailed(&'a str),
    /// This host's agents were lost: killed, cut off, stopped.
    HostLost(&'a str),
    /// Time passed: waits time out, cooldowns end.
    Tick,
}

/// One round's world: its hosts in rank order and the slots used on each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct World {
    /// 0 for the first world, one more for each re-formed one.
    pub round: u32,
    /// Host names in rank order, each with the slots the world uses on it.
    pub hosts: Vec<(String, u32)>,
    /// Re-formed worlds so far (resets), and those after failures.
    pub resets: u32,
    /// Re-formed worlds so far that followed a failure.
    pub restarts: u32,
}

impl World {
    /// Slots in the world, which is its number of ranks.
    pub fn size(&self) -> u32 {
        self.hosts.iter().map(|(_, n)| n).sum()
    }

    /// The world as host specs, for the plan.
    pub fn host_specs(&self) -> Vec<HostSpec> {
        self.hosts.iter().map(|(name, slots)| HostSpec::new(name.clone(), *slots)).collect()
    }
}

/// Why an elastic job stops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The world needs re-forming again, but it was re-formed as often as
    /// `reset_limit` allows.
    ResetLimit {
        /// The reset limit reached.
        limit: u32,
    },
    /// A rank failed, or a host of the world was lost, after as many
    /// restarts as `max_restarts` allows.
    RestartLimit {
        /// The restart limit reached.
        limit: u32,
    },
    /// Too few slots for longer than the elastic timeout.
    Timeout {
        /// Slots needed (`min_np`).
        needed: u32,
        /// Slots available on hosts not blacklisted.
        available: u32,
        /// The elastic timeout it waited out: the limit the user set, not
        /// the measured wait, which a busy driver overshoots.
        timeout: Duration,
    },
    /// Every host of the running world failed and was blacklisted
    /// (Horovod's rule for in-place jobs: the job failed, whatever else
    /// discovery lists).
    AllHostsFailed {
        /// The world's hosts.
        hosts: Vec<String>,
    },
    /// Too few slots, and no way for more to come (`fixed_hosts`, and
    /// every blacklisted host out for good).
    NoSlotsLeft {
        /// Slots needed (`min_np`).
        needed: u32,
        /// Slots available on hosts not blacklisted.
        available: u32,
    },
}

impl StopReason {
    /// The reason's kind, a word programs match on (`kolo run
    /// --outcome-file`, the `kind` of Python's `JobStopped`).
    pub fn kind(&self) -> &'static str {
        match self {
            StopReason::ResetLimit { .. } => "reset_limit",
            StopReason::RestartLimit { .. } => "restart_limit",
            StopReason::Timeout { .. } => "timeout",
            StopReason::NoSlotsLeft { .. } => "no_slots_left",
            StopReason::AllHostsFailed { .. } => "all_hosts_failed",
        }
    }
}

/// A duration as users give it: whole seconds as "1 s", fractions to a tenth.
pub fn format_seconds(duration: Duration) -> String {
    if duration.subsec_nanos() == 0 {
        format!("{} s", duration.as_secs())
    } else {
        format!("{:.1} s", duration.as_secs_f64())
    }
}

/// Said neutrally: the front ends name the limits as their users gave
/// them (kolo-job's `OptionNames::explain`).
impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::ResetLimit { limit } => write!(f, "the job was re-formed {limit} times, its reset limit"),
            StopReason::RestartLimit { limit } => {
                write!(f, "ranks failed and the job was restarted {limit} times, its restart limit")
            }
            StopReason::Timeout { needed, available, timeout } => write!(
                f,
                "timed out after {} waiting for {needed} slots with {available} available on hosts not blacklisted",
                format_seconds(*timeout)
            ),
            StopReason::NoSlotsLeft { needed, available } => write!(
                f,
                "{available} slots are left on hosts not blacklisted, fewer than the {needed} needed, and no more can come"
            ),
            StopReason::AllHostsFailed { hosts } => {
                write!(f, "a process failed on every host of the job ({}), so each was blacklisted", hosts.join(", "))
            }
        }
    }
}

impl std::error::Error for StopReason {}

/// What to do now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The running world stays as it is.
    Continue,
    /// Stop the running world (if any) and start this one.
    Reform(World),
    /// Too few slots: no world runs until there are `needed` (or until
    /// `deadline`, counted from the job's start, when the job stops).
    Wait {
        /// Slots available now on hosts not blacklisted.
        available: u32,
        /// Slots needed (`min_np`).
        needed: u32,
        /// When the wait times out, counted from the job's start.
        deadline: Duration,
        /// Worth telling the user: the first wait, a change, or a while
        /// since the last notice (a wait is decided at every poll).
        announce: bool,
    },
    /// The job stops for good; every later event gets the same decision.
    Stop(StopReason),
}

/// The membership of an elastic job across its rounds.
#[derive(Clone, Debug)]
pub struct Membership {
    config: ElasticConfig,
    discovered: Vec<HostSpec>,
    /// Every host discovery ever named, in the order it first did.
    seen: Vec<String>,
    /// The last world formed, and whether it runs.
    world: Option<World>,
    running: bool,
    /// Times each host was blacklisted; those out now, until when.
    strikes: BTreeMap<String, u32>,
    out_until: BTreeMap<String, Option<Duration>>,
    failed_last_round: BTreeSet<String>,
    failed_this_round: BTreeSet<String>,
    failure_pending: bool,
    resets: u32,
    restarts: u32,
    short_since: Option<Duration>,
    /// The last wait announced: needed, available, when.
    wait_announced: Option<(u32, u32, Duration)>,
    /// Blacklisted hosts already told (`take_blacklisted_news`).
    blacklist_told: BTreeSet<String>,
    stopped: Option<StopReason>,
    /// The jitter's generator (xorshift64*, from `jitter_seed`).
    jitter: u64,
}

/// A wait that goes on unchanged is announced again after this.
const WAIT_NOTICE_EVERY: Duration = Duration::from_secs(30);

impl Membership {
    /// A job that has formed no world yet and knows no hosts.
    pub fn new(config: ElasticConfig) -> Self {
        Membership {
            discovered: Vec::new(),
            seen: Vec::new(),
            world: None,
            running: false,
            strikes: BTreeMap::new(),
            out_until: BTreeMap::new(),
            failed_last_round: BTreeSet::new(),
            failed_this_round: BTreeSet::new(),
            failure_pending: false,
            resets: 0,
            restarts: 0,
            short_since: None,
            wait_announced: None,
            blacklist_told: BTreeSet::new(),
            stopped: None,
            // xorshift must not start at 0
            jitter: config.jitter_seed | 1,
            config,
        }
    }

    /// The next jitter fraction, in `0.0..1.0`.
    fn next_jitter(&mut self) -> f64 {
        let mut x = self.jitter;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.jitter = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The rules this membership follows.
    pub fn config(&self) -> &ElasticConfig {
        &self.config
    }

    /// The last world formed (running or not).
    pub fn world(&self) -> Option<&World> {
        self.world.as_ref()
    }

    /// The hosts out now, with when they may come back (`None`: never).
    pub fn blacklisted(&self) -> Vec<(&str, Option<Duration>)> {
        self.out_until.iter().map(|(h, until)| (h.as_str(), *until)).collect()
    }

    /// Hosts blacklisted since the last call, each with how long it stays
    /// out from `now` (`None`: for good), for the user to be told once.
    pub fn take_blacklisted_news(&mut self, now: Duration) -> Vec<(String, Option<Duration>)> {
        self.blacklist_told.retain(|h| self.out_until.contains_key(h));
        let mut news = Vec::new();
        for (host, until) in &self.out_until {
            if self.blacklist_told.insert(host.clone()) {
                news.push((host.clone(), until.map(|u| u.saturating_sub(now))));
            }
        }
        news
    }

    /// Takes in what happened at `now` (time since the job started) and
    /// decides.
    pub fn on(&mut self, event: Event<'_>, now: Duration) -> Decision {
        if let Some(reason) = &self.stopped {
            return Decision::Stop(reason.clone());
        }
        match event {
            Event::Discovered(hosts) => {
                self.discovered.clear();
                for host in hosts {
                    if !self.discovered.iter().any(|h| h.name == host.name) {
                        self.discovered.push(host.clone());
                    }
                    if !self.seen.contains(&host.name) {
                        self.seen.push(host.name.clone());
                    }
                }
            }
            Event::RankFailed(host) => {
                // the last world's processes still count while it waits for
                // hosts after an earlier failure: each that fails is heard
                if self.in_world(host) {
                    // without a cooldown a blacklisting is for good: a
                    // failing script must not exile every host
                    let again = self.failed_last_round.contains(host) && self.config.cooldown.is_some();
                    if again || self.config.blacklist_failed_hosts {
                        self.blacklist(host, now);
                    }
                    self.failed_this_round.insert(host.to_string());
                    self.failure_pending = true;
                }
            }
            Event::HostLost(host) => {
                self.blacklist(host, now);
                if self.running && self.in_world(host) {
                    self.failure_pending = true;
                }
            }
            Event::Tick => {}
        }
        // cooldowns that ended: the host is back when discovery lists it
        self.out_until.retain(|_, until| until.is_none_or(|t| t > now));
        self.decide(now)
    }

    fn in_world(&self, host: &str) -> bool {
        self.world.as_ref().is_some_and(|w| w.hosts.iter().any(|(h, _)| h == host))
    }

    fn blacklist(&mut self, host: &str, now: Duration) {
        if self.out_until.contains_key(host) {
            return;
        }
        let strikes = self.strikes.entry(host.to_string()).or_insert(0);
        *strikes += 1;
        let strikes = *strikes;
        let jitter = self.next_jitter();
        let until = self.config.cooldown.map(|c| now + c.after(strikes, jitter));
        self.out_until.insert(host.to_string(), until);
    }

    /// The next world's hosts: the last world's survivors in their order,
    /// then the rest in the order discovery first named them, up to max_np.
    fn next_hosts(&self) -> Vec<(String, u32)> {
        let slots_of = |name: &str| {
            (!self.out_until.contains_key(name))
                .then(|| self.discovered.iter().find(|h| h.name == name).map(|h| h.slots))
                .flatten()
        };
        let survivors = self.world.iter().flat_map(|w| w.hosts.iter().map(|(h, _)| h.as_str()));
        let others = self.seen.iter().map(String::as_str).filter(|h| !self.in_world(h));
        let mut hosts = Vec::new();
        let mut left = self.config.max_np;
        for name in survivors.chain(others) {
            if left == 0 {
                break;
            }
            if let Some(slots) = slots_of(name) {
                let used = slots.min(left);
                left -= used;
                hosts.push((name.to_string(), used));
            }
        }
        hosts
    }

    fn decide(&mut self, now: Duration) -> Decision {
        // (a fixed list whose blacklisted hosts never come back stops below,
        // with a message that names the way out)
        let none_can_come_back = self.config.fixed_hosts && self.config.cooldown.is_none();
        if self.failure_pending && self.config.blacklist_failed_hosts && !none_can_come_back {
            let failed_everywhere =
                self.world.as_ref().filter(|w| w.hosts.iter().all(|(h, _)| self.out_until.contains_key(h)));
            if let Some(world) = failed_everywhere {
                let hosts = world.hosts.iter().map(|(h, _)| h.clone()).collect();
                return self.stop(StopReason::AllHostsFailed { hosts });
            }
        }
        if self.failure_pending {
            if let Some(limit) = self.config.max_restarts.filter(|&l| self.restarts >= l) {
                return self.stop(StopReason::RestartLimit { limit });
            }
        }
        let next = self.next_hosts();
        let available: u32 = next.iter().map(|(_, n)| n).sum();
        if available < self.config.min_np {
            // whatever ran cannot go on without the hosts it lost
            if self.running && (self.failure_pending || self.world.as_ref().is_some_and(|w| w.hosts != next)) {
                self.running = false;
            }
            if self.running {
                return Decision::Continue;
            }
            let needed = self.config.min_np;
            if self.config.fixed_hosts && self.out_until.values().all(Option::is_none) {
                return self.stop(StopReason::NoSlotsLeft { needed, available });
            }
            let since = *self.short_since.get_or_insert(now);
            let timeout = self.config.elastic_timeout;
            if now.saturating_sub(since) >= timeout {
                return self.stop(StopReason::Timeout { needed, available, timeout });
            }
            let announce = !matches!(self.wait_announced,
                Some((n, a, at)) if n == needed && a == available && now < at + WAIT_NOTICE_EVERY);
            if announce {
                self.wait_announced = Some((needed, available, now));
            }
            return Decision::Wait { available, needed, deadline: since + self.config.elastic_timeout, announce };
        }
        self.short_since = None;
        self.wait_announced = None;
        let same = self.world.as_ref().is_some_and(|w| w.hosts == next);
        if self.running && same && !self.failure_pending {
            return Decision::Continue;
        }
        let reform = self.world.is_some();
        if reform {
            if let Some(limit) = self.config.reset_limit.filter(|&l| self.resets >= l) {
                return self.stop(StopReason::ResetLimit { limit });
            }
            if self.failure_pending {
                self.restarts += 1;
            }
            self.resets += 1;
        }
        let round = self.world.as_ref().map_or(0, |w| w.round + 1);
        self.failed_last_round = std::mem::take(&mut self.failed_this_round);
        self.failure_pending = false;
        self.running = true;
        let world = World { round, hosts: next, resets: self.resets, restarts: self.restarts };
        self.world = Some(world.clone());
        Decision::Reform(world)
    }

    fn stop(&mut self, reason: StopReason) -> Decision {
        self.running = false;
        self.stopped = Some(reason.clone());
        Decision::Stop(reason)
    }
}

#[cfg(test)]
mod tests;
