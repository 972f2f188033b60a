//! An in-place job's round bookkeeping, pure: which processes exist, which
//! are in which round, which must go and where new ones must start. The
//! actor (`in_place`) feeds it what happened and carries out what it says;
//! nothing here waits, starts or stops anything, so it is tested over
//! random event sequences without processes.

use std::collections::{HashMap, HashSet};

use kolo_topology::HostSpec;

/// Where a process is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Life {
    Running,
    Succeeded,
    Failed,
    /// Left out of the rounds and told to stop.
    Removed,
}

/// One process of the job, by its index in [`Rounds::procs`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Proc {
    pub cohort: usize,
    /// Its rank in its cohort (the cohort executor's numbering).
    pub rank: u32,
    /// Its host as the plan names it (`HOROVOD_HOSTNAME`).
    pub host: String,
    /// The local rank it was started with: with the host, its name in
    /// `rank_and_size`.
    pub local_rank: u32,
    pub life: Life,
}

/// What the actor must do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Start round `round` with `members` (process indices, in rank order)
    /// on `hosts` (each with its processes, in rank order).
    Publish { round: u64, members: Vec<usize>, hosts: Vec<HostSpec> },
    /// End process `p`: it has no place any more.
    Remove(usize),
    /// Start a cohort of new processes on these hosts, for round `round`.
    StartCohort { hosts: Vec<(String, u32)>, round: u64 },
}

/// How a process ended, as the bookkeeping needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum End {
    Succeeded,
    Failed,
    Lost,
}

/// What an ended process means for the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// Nothing to do (a process already out, or the job still finishing).
    Nothing,
    /// Every process the job was finishing with has ended.
    Done,
    /// A process the job was finishing with failed: the job stops.
    FailedWhileFinishing,
    /// A running process failed: membership must hear of its host
    /// (`lost`: the host itself is gone), and the caller of `rank` in the
    /// current round (if it had one).
    Failed { host: String, rank: Option<u32>, lost: bool },
}

/// The bookkeeping; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct Rounds {
    procs: Vec<Proc>,
    /// Each host's processes of the cohort that last started there.
    generation: HashMap<String, Vec<usize>>,
    /// Members of every round published, by round, in rank order.
    rounds: Vec<Vec<usize>>,
    /// Once a process has succeeded: the members of the last round that
    /// came together, whose end ends the job.
    finishing: Option<Vec<usize>>,
    /// The hosts of the cohort starting now (one at a time).
    spawning: Option<Vec<String>>,
    /// Cohorts that came up.
    cohorts: usize,
}

impl Rounds {
    pub(super) fn procs(&self) -> &[Proc] {
        &self.procs
    }

    /// Members of the round published last, in rank order.
    pub(super) fn members(&self) -> &[usize] {
        self.rounds.last().map_or(&[], Vec::as_slice)
    }

    /// The number the next round gets.
    pub(super) fn next_round(&self) -> u64 {
        self.rounds.len() as u64
    }

    #[cfg(test)]
    fn is_finishing(&self) -> bool {
        self.finishing.is_some()
    }

    /// The processes whose results the job ends with, once finishing.
    pub(super) fn finals(&self) -> &[usize] {
        self.finishing.as_deref().unwrap_or(&[])
    }

    /// The process of `cohort` with rank `rank` there.
    pub(super) fn find(&self, cohort: usize, rank: u32) -> Option<usize> {
        self.procs.iter().position(|p| p.cohort == cohort && p.rank == rank)
    }

    /// Its rank in the current round, if it has one.
    pub(super) fn round_rank(&self, p: usize) -> Option<u32> {
        self.members().iter().position(|&m| m == p).and_then(|r| u32::try_from(r).ok())
    }

    /// The next round from the world membership chose: hosts whose
    /// processes all run keep them; the others get new processes (a
    /// cohort), which join a later round. The round is published at once
    /// if it has `min_np` processes, so survivors go on while new ones
    /// start.
    pub(super) fn reform(&mut self, world: &[(String, u32)], min_np: u32) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.finishing.is_some() {
            return actions;
        }
        let mut members = Vec::new();
        let mut to_start = Vec::new();
        for (host, slots) in world {
            match self.generation.get(host) {
                Some(procs) if procs.iter().all(|&p| self.procs[p].life == Life::Running) => {
                    let mut procs = procs.clone();
                    procs.sort_by_key(|&p| self.procs[p].local_rank);
                    members.extend(procs.into_iter().take(*slots as usize));
                }
                _ => to_start.push((host.clone(), *slots)),
            }
        }
        let leaving: Vec<usize> =
            (0..self.procs.len()).filter(|p| self.procs[*p].life == Life::Running && !members.contains(p)).collect();
        // the first cohort serves the store: no round before it is up
        if self.cohorts > 0 && members.len() as u32 >= min_np && members != self.members() {
            actions.push(self.publish(members));
        }
        for p in leaving {
            self.procs[p].life = Life::Removed;
            actions.push(Action::Remove(p));
        }
        let starting: HashSet<&String> = self.spawning.iter().flatten().collect();
        to_start.retain(|(host, _)| !starting.contains(host));
        // one cohort at a time: a world that changes meanwhile is looked at
        // again once it is up
        if !to_start.is_empty() && self.spawning.is_none() {
            self.spawning = Some(to_start.iter().map(|(h, _)| h.clone()).collect());
            actions.push(Action::StartCohort { hosts: to_start, round: self.next_round() });
        }
        actions
    }

    fn publish(&mut self, members: Vec<usize>) -> Action {
        let mut hosts: Vec<HostSpec> = Vec::new();
        for &p in &members {
            let host = &self.procs[p].host;
            match hosts.last_mut() {
                Some(last) if &last.name == host => last.slots += 1,
                _ => hosts.push(HostSpec::new(host.clone(), 1)),
            }
        }
        let round = self.next_round();
        self.rounds.push(members.clone());
        Action::Publish { round, members, hosts }
    }

    /// The hosts of the cohort starting now, if one is.
    pub(super) fn spawning(&self) -> Option<&[String]> {
        self.spawning.as_deref()
    }

    /// The cohort came up with these processes, each `(host, local rank)`
    /// in its rank order; processes its hosts had before must go.
    pub(super) fn cohort_started(&mut self, procs: Vec<(String, u32)>) -> Vec<Action> {
        self.spawning = None;
        let cohort = self.cohorts;
        self.cohorts += 1;
        let mut fresh: Vec<(String, Vec<usize>)> = Vec::new();
        for (rank, (host, local_rank)) in procs.into_iter().enumerate() {
            let p = self.procs.len();
            match fresh.iter_mut().find(|(h, _)| *h == host) {
                Some((_, ps)) => ps.push(p),
                None => fresh.push((host.clone(), vec![p])),
            }
            self.procs.push(Proc { cohort, rank: rank as u32, host, local_rank, life: Life::Running });
        }
        let mut actions = Vec::new();
        for (host, procs) in fresh {
            for p in self.generation.insert(host, procs).unwrap_or_default() {
                if self.procs[p].life == Life::Running {
                    self.procs[p].life = Life::Removed;
                    actions.push(Action::Remove(p));
                }
            }
        }
        actions
    }

    /// The cohort could not start.
    pub(super) fn cohort_failed(&mut self) {
        self.spawning = None;
    }

    /// Process `p` ended. `joined` tells the round a process last joined
    /// (as it recorded on the store), to know, at the first success, which
    /// round the job finishes with.
    pub(super) fn ended(&mut self, p: usize, end: End, joined: impl Fn(&Proc) -> Option<u64>) -> Ended {
        if self.procs[p].life != Life::Running {
            return Ended::Nothing;
        }
        if end == End::Succeeded {
            self.procs[p].life = Life::Succeeded;
            if self.finishing.is_none() {
                self.finishing = Some(self.last_joined_round(joined));
            }
            return self.finished();
        }
        self.procs[p].life = Life::Failed;
        if let Some(finals) = &self.finishing {
            if finals.contains(&p) {
                return Ended::FailedWhileFinishing;
            }
            return self.finished();
        }
        Ended::Failed { host: self.procs[p].host.clone(), rank: self.round_rank(p), lost: end == End::Lost }
    }

    /// Done once every process the job is finishing with has ended.
    fn finished(&self) -> Ended {
        match &self.finishing {
            Some(finals) if finals.iter().all(|&m| self.procs[m].life != Life::Running) => Ended::Done,
            _ => Ended::Nothing,
        }
    }

    /// The members of the last round whose processes joined it; those
    /// that started for a later round that never came together are not
    /// waited for.
    fn last_joined_round(&self, joined: impl Fn(&Proc) -> Option<u64>) -> Vec<usize> {
        let last = self
            .rounds
            .iter()
            .enumerate()
            .rev()
            .find(|(round, members)| members.iter().any(|&m| joined(&self.procs[m]) == Some(*round as u64)));
        match last {
            Some((_, members)) => members.clone(),
            None => self.members().to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn world(hosts: &[(&str, u32)]) -> Vec<(String, u32)> {
        hosts.iter().map(|(h, n)| (h.to_string(), *n)).collect()
    }

    fn started(hosts: &[(String, u32)]) -> Vec<(String, u32)> {
        hosts.iter().flat_map(|(h, n)| (0..*n).map(move |l| (h.clone(), l))).collect()
    }

    #[test]
    fn the_first_cohort_starts_then_its_round_is_published() {
        let mut r = Rounds::default();
        let w = world(&[("a", 2), ("b", 1)]);
        let actions = r.reform(&w, 2);
        assert_eq!(actions, [Action::StartCohort { hosts: w.clone(), round: 0 }]);
        // a world seen again while it starts starts nothing more
        assert_eq!(r.reform(&w, 2), []);
        assert_eq!(r.cohort_started(started(&w)), []);
        let actions = r.reform(&w, 2);
        let hosts = vec![HostSpec::new("a", 2), HostSpec::new("b", 1)];
        assert_eq!(actions, [Action::Publish { round: 0, members: vec![0, 1, 2], hosts }]);
        assert_eq!(r.round_rank(2), Some(2));
    }

    #[test]
    fn a_failed_host_is_replaced_while_the_survivors_go_on() {
        let mut r = Rounds::default();
        let w = world(&[("a", 1), ("b", 1), ("c", 1)]);
        r.reform(&w, 2);
        r.cohort_started(started(&w));
        r.reform(&w, 2);
        assert_eq!(r.ended(1, End::Failed, |_| None), Ended::Failed { host: "b".into(), rank: Some(1), lost: false });
        // membership keeps b (say, after its cooldown): survivors first, b restarts
        let actions = r.reform(&w, 2);
        let survivors = vec![HostSpec::new("a", 1), HostSpec::new("c", 1)];
        assert_eq!(
            actions,
            [
                Action::Publish { round: 1, members: vec![0, 2], hosts: survivors },
                Action::StartCohort { hosts: world(&[("b", 1)]), round: 2 },
            ]
        );
        assert_eq!(r.cohort_started(vec![("b".into(), 0)]), []);
        let actions = r.reform(&w, 2);
        assert!(matches!(&actions[..], [Action::Publish { round: 2, members, .. }] if members == &[0, 3, 2]));
    }

    #[test]
    fn the_job_finishes_with_the_last_round_that_came_together() {
        let mut r = Rounds::default();
        let w = world(&[("a", 1), ("b", 1)]);
        r.reform(&w, 1);
        r.cohort_started(started(&w));
        r.reform(&w, 1);
        // b fails; round 1 (a alone) is published and a joins it; b's
        // replacement is started for round 2, which never comes together
        r.ended(1, End::Failed, |_| None);
        r.reform(&w, 1);
        r.cohort_started(vec![("b".into(), 0)]);
        r.reform(&w, 1);
        assert_eq!(r.members(), [0, 2]);
        let joined = |p: &Proc| (p.host == "a").then_some(1);
        assert_eq!(r.ended(0, End::Succeeded, joined), Ended::Done);
        assert_eq!(r.finals(), [0]);
        // what ends afterwards changes nothing
        assert_eq!(r.ended(2, End::Failed, joined), Ended::Done);
    }

    /// What happens to an in-place job, at random.
    #[derive(Clone, Debug)]
    enum Step {
        /// Membership chose a world of these hosts (of 4) and slots.
        World(Vec<(u8, u32)>),
        /// The cohort starting comes up, or fails.
        CohortDone(bool),
        /// The n-th process (mod their number) ends so.
        End(usize, u8),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            prop::collection::vec((0u8..4, 1u32..4), 1..4).prop_map(Step::World),
            any::<bool>().prop_map(Step::CohortDone),
            (any::<usize>(), 0u8..3).prop_map(|(n, e)| Step::End(n, e)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn rounds_hold_their_invariants(min_np in 1u32..4, steps in prop::collection::vec(step(), 1..60)) {
            let mut r = Rounds::default();
            let mut starting: Option<Vec<(String, u32)>> = None;
            let mut last_round: Option<u64> = None;
            for step in steps {
                let actions = match step {
                    Step::World(hosts) => {
                        let mut w: Vec<(String, u32)> = Vec::new();
                        for (h, n) in hosts {
                            let name = format!("h{h}");
                            if !w.iter().any(|(x, _)| *x == name) {
                                w.push((name, n));
                            }
                        }
                        r.reform(&w, min_np)
                    }
                    Step::CohortDone(up) => match starting.take() {
                        Some(hosts) if up => r.cohort_started(started(&hosts)),
                        Some(_) => {
                            r.cohort_failed();
                            Vec::new()
                        }
                        None => Vec::new(),
                    },
                    Step::End(n, e) if !r.procs().is_empty() => {
                        let p = n % r.procs().len();
                        let was = r.procs()[p].life;
                        let end = [End::Succeeded, End::Failed, End::Lost][e as usize];
                        let outcome = r.ended(p, end, |_| None);
                        if was != Life::Running {
                            prop_assert_eq!(&outcome, &Ended::Nothing);
                        }
                        if let Ended::Failed { rank: Some(rank), .. } = outcome {
                            prop_assert_eq!(r.members()[rank as usize], p);
                        }
                        Vec::new()
                    }
                    Step::End(..) => Vec::new(),
                };
                for action in actions {
                    match action {
                        Action::Publish { round, members, hosts } => {
                            // rounds are numbered in order, each published once
                            prop_assert_eq!(Some(round), last_round.map_or(Some(0), |l| Some(l + 1)));
                            last_round = Some(round);
                            prop_assert!(members.len() as u32 >= min_np);
                            let distinct: HashSet<_> = members.iter().collect();
                            prop_assert_eq!(distinct.len(), members.len());
                            prop_assert_eq!(hosts.iter().map(|h| h.slots as usize).sum::<usize>(), members.len());
                            for &m in &members {
                                // only running processes of their host's latest cohort
                                let proc = &r.procs()[m];
                                prop_assert_eq!(proc.life, Life::Running);
                                prop_assert!(r.generation[&proc.host].contains(&m));
                            }
                            // a host's processes are consecutive ranks
                            let mut seen: Vec<&str> = Vec::new();
                            for &m in &members {
                                let host = r.procs()[m].host.as_str();
                                if seen.last() != Some(&host) {
                                    prop_assert!(!seen.contains(&host));
                                    seen.push(host);
                                }
                            }
                        }
                        Action::Remove(p) => {
                            // out for good: no later round has it (Publish checks
                            // that every member runs)
                            prop_assert_eq!(r.procs()[p].life, Life::Removed);
                        }
                        Action::StartCohort { hosts, round } => {
                            // one cohort at a time, for the round to come
                            prop_assert!(starting.is_none());
                            prop_assert_eq!(round, r.next_round());
                            prop_assert!(!hosts.is_empty());
                            starting = Some(hosts);
                        }
                    }
                }
                prop_assert_eq!(starting.is_some(), r.spawning().is_some());
                // a finishing job is done exactly when its finals have ended
                if r.is_finishing() {
                    let all_ended = r.finals().iter().all(|&m| r.procs()[m].life != Life::Running);
                    let probe = r.finished();
                    prop_assert_eq!(probe == Ended::Done, all_ended);
                }
            }
        }
    }
}
