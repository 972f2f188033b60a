//! Membership's rules, each tested alone and, by proptest, over random
//! sequences of events.

use super::*;
use proptest::prelude::*;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn hosts(spec: &[(&str, u32)]) -> Vec<HostSpec> {
    spec.iter().map(|&(n, s)| HostSpec::new(n, s)).collect()
}

fn world_of(d: &Decision) -> Vec<(&str, u32)> {
    match d {
        Decision::Reform(w) => w.hosts.iter().map(|(h, n)| (h.as_str(), *n)).collect(),
        other => panic!("expected a new world, got {other:?}"),
    }
}

fn config(min: u32, max: u32) -> ElasticConfig {
    ElasticConfig::new(min, max).unwrap()
}

#[test]
fn in_place_a_failed_rank_blacklists_its_host_at_once() {
    let mut c = ElasticConfig::new(1, 4).unwrap();
    c.blacklist_failed_hosts = true;
    let mut m = Membership::new(c.clone());
    m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2)])), secs(0));
    assert_eq!(world_of(&m.on(Event::RankFailed("b"), secs(1))), [("a", 2)]);
    assert_eq!(m.blacklisted(), [("b", None)]);
    // with a cooldown it comes back, then doubles
    c.cooldown = Some(Cooldown::new(secs(10), secs(100)).unwrap());
    let mut m = Membership::new(c);
    m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2)])), secs(0));
    assert_eq!(world_of(&m.on(Event::RankFailed("b"), secs(1))), [("a", 2)]);
    // out for 10·2 s and up to 10 s of jitter: back by 31 s, not at 20
    let back_at = match m.blacklisted()[..] {
        [("b", Some(until))] => until,
        ref other => panic!("{other:?}"),
    };
    assert!(back_at >= secs(21) && back_at < secs(31), "{back_at:?}");
    assert_eq!(m.on(Event::Tick, secs(20)), Decision::Continue);
    assert_eq!(world_of(&m.on(Event::Tick, back_at)), [("a", 2), ("b", 2)]);
    assert_eq!(world_of(&m.on(Event::RankFailed("b"), secs(40))), [("a", 2)]);
    // then 10·4 s and the jitter
    let again = m.blacklisted()[0].1.unwrap();
    assert!(again >= secs(80) && again < secs(90), "{again:?}");
}

#[test]
fn in_place_a_failure_on_every_host_of_the_world_stops_the_job() {
    let mut c = ElasticConfig::new(1, 4).unwrap();
    c.blacklist_failed_hosts = true;
    c.cooldown = Some(Cooldown::new(secs(10), secs(100)).unwrap());
    let mut m = Membership::new(c);
    m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2)])), secs(0));
    // c is discovered later: not in the world, so it does not save it
    m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2), ("c", 1)])), secs(0));
    assert_eq!(world_of(&m.on(Event::RankFailed("a"), secs(1))), [("b", 2), ("c", 1)]);
    let stopped = m.on(Event::RankFailed("b"), secs(2));
    assert_eq!(world_of(&stopped), [("c", 1)], "b and c form the world after a: b failing leaves c");
    let stopped = m.on(Event::RankFailed("c"), secs(3));
    assert_eq!(stopped, Decision::Stop(StopReason::AllHostsFailed { hosts: vec!["c".into()] }));
    assert_eq!(StopReason::AllHostsFailed { hosts: vec!["c".into()] }.kind(), "all_hosts_failed");
}

#[test]
fn in_place_every_rank_failing_one_after_another_stops_while_the_job_waits() {
    // without a cooldown: a's failure leaves too few slots (the job
    // waits), then b's failure is heard and ends it
    let mut c = ElasticConfig::new(2, 2).unwrap();
    c.blacklist_failed_hosts = true;
    let mut m = Membership::new(c);
    assert_eq!(world_of(&m.on(Event::Discovered(&hosts(&[("a", 1), ("b", 1)])), secs(0))), [("a", 1), ("b", 1)]);
    assert!(matches!(m.on(Event::RankFailed("a"), secs(1)), Decision::Wait { available: 1, needed: 2, .. }));
    let stopped = m.on(Event::RankFailed("b"), secs(1));
    assert_eq!(stopped, Decision::Stop(StopReason::AllHostsFailed { hosts: vec!["a".into(), "b".into()] }));
}

#[test]
fn cooldowns_are_horovods_backoff_within_the_range() {
    let c = Cooldown::new(secs(10), secs(100)).unwrap();
    // min·2^n, plus up to min of jitter, within min..=max
    let got: Vec<u64> = (1..=5).map(|s| c.after(s, 0.0).as_secs()).collect();
    assert_eq!(got, [20, 40, 80, 100, 100]);
    assert_eq!(c.after(1, 0.5), secs(25));
    assert_eq!(c.after(3, 0.99), secs(90) - Duration::from_millis(100));
    assert_eq!(c.after(u32::MAX, 0.5), secs(100));
    // a range narrower than the first doubling is its max
    assert_eq!(Cooldown::new(secs(1), secs(2)).unwrap().after(1, 0.7), secs(2));
    assert!(Cooldown::new(secs(0), secs(1)).is_err());
    assert!(Cooldown::new(secs(5), secs(1)).is_err());
    assert!(Cooldown::new(secs(1), secs(3601)).unwrap_err().to_string().contains("<= 3600"));
}

#[test]
fn the_jitter_is_a_fraction_repeated_by_its_seed() {
    let mut c = ElasticConfig::new(1, 4).unwrap();
    c.jitter_seed = 42;
    let (mut a, mut b) = (Membership::new(c.clone()), Membership::new(c));
    let draws: Vec<f64> = (0..1000).map(|_| a.next_jitter()).collect();
    assert!(draws.iter().all(|j| (0.0..1.0).contains(j)));
    assert!(draws.iter().any(|&j| j < 0.1) && draws.iter().any(|&j| j > 0.9));
    assert_eq!(draws, (0..1000).map(|_| b.next_jitter()).collect::<Vec<_>>());
}

#[test]
fn bad_bounds_name_the_fix() {
    assert!(ElasticConfig::new(0, 2).unwrap_err().to_string().contains("1 <= min-np <= max-np"));
    assert!(ElasticConfig::new(3, 2).is_err());
    assert!(ElasticConfig::new(1, crate::MAX_PROCESSES + 1).is_err());
}

#[test]
fn discovery_output_is_hosts_with_slots() {
    let got = parse_discovery("h1:4\n\n  h2 \nh3:1\n", 2).unwrap();
    assert_eq!(got, hosts(&[("h1", 4), ("h2", 2), ("h3", 1)]));
    assert_eq!(parse_discovery("", 1).unwrap(), vec![]);
    assert_eq!(parse_discovery("[::1]:3\n[fe80::1]", 2).unwrap(), hosts(&[("::1", 3), ("fe80::1", 2)]));
    for bad in ["h1:x", "h1:0", "h1,h2", "h1\nh1:2", "h1:2:3"] {
        let e = parse_discovery(bad, 1).unwrap_err().to_string();
        assert!(e.contains("discovery script prints"), "{bad}: {e}");
    }
    assert!(parse_discovery("ok\nh1:x", 1).unwrap_err().to_string().contains("line 2"));
}

#[test]
fn the_first_world_fills_hosts_in_order_up_to_max_np() {
    let mut m = Membership::new(config(2, 5));
    let d = m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2), ("c", 2)])), secs(0));
    assert_eq!(world_of(&d), [("a", 2), ("b", 2), ("c", 1)]);
    assert!(matches!(d, Decision::Reform(World { round: 0, resets: 0, restarts: 0, .. })));
    // the same discovery again changes nothing
    assert_eq!(m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2), ("c", 2)])), secs(1)), Decision::Continue);
    assert_eq!(m.on(Event::Tick, secs(2)), Decision::Continue);
}

#[test]
fn too_few_slots_wait_and_then_stop_at_the_elastic_timeout() {
    let mut c = config(4, 8);
    c.elastic_timeout = secs(30);
    let mut m = Membership::new(c);
    let d = m.on(Event::Discovered(&hosts(&[("a", 2)])), secs(5));
    assert_eq!(d, Decision::Wait { available: 2, needed: 4, deadline: secs(35), announce: true });
    assert!(matches!(m.on(Event::Tick, secs(34)), Decision::Wait { .. }));
    // enough in time: the world forms
    let mut early = m.clone();
    assert_eq!(world_of(&early.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2)])), secs(20))), [("a", 2), ("b", 2)]);
    let Decision::Stop(reason) = m.on(Event::Tick, secs(35)) else { panic!("no stop") };
    assert_eq!(reason, StopReason::Timeout { needed: 4, available: 2, timeout: secs(30) });
    assert!(reason.to_string().contains("waiting for 4 slots with 2 available"), "{reason}");
    // and it stays stopped
    assert!(matches!(m.on(Event::Discovered(&hosts(&[("a", 9)])), secs(36)), Decision::Stop(_)));
}

#[test]
fn a_lost_host_is_left_out_and_the_survivors_keep_their_order() {
    let mut m = Membership::new(config(1, 8));
    m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2), ("c", 2)])), secs(0));
    let d = m.on(Event::HostLost("b"), secs(1));
    assert_eq!(world_of(&d), [("a", 2), ("c", 2)]);
    assert!(matches!(d, Decision::Reform(World { round: 1, resets: 1, restarts: 1, .. })));
    // without a cooldown it never comes back, even when discovered
    assert_eq!(m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2), ("c", 2)])), secs(1000)), Decision::Continue);
    assert_eq!(m.blacklisted(), [("b", None)]);
}

#[test]
fn new_hosts_are_appended_in_discovery_order_and_grow_the_world() {
    let mut m = Membership::new(config(1, 16));
    m.on(Event::Discovered(&hosts(&[("b", 1), ("a", 1)])), secs(0));
    let d = m.on(Event::Discovered(&hosts(&[("z", 1), ("a", 1), ("b", 1), ("c", 1)])), secs(1));
    assert_eq!(world_of(&d), [("b", 1), ("a", 1), ("z", 1), ("c", 1)]);
    // a membership change is a reset, not a restart
    assert!(matches!(d, Decision::Reform(World { resets: 1, restarts: 0, .. })));
}

#[test]
fn at_max_np_more_hosts_change_nothing() {
    let mut m = Membership::new(config(1, 2));
    m.on(Event::Discovered(&hosts(&[("a", 2)])), secs(0));
    assert_eq!(m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 4)])), secs(1)), Decision::Continue);
}

#[test]
fn a_world_with_none_of_the_previous_hosts_still_forms() {
    // upstream: "No hosts from previous set remaining" and the job ends
    let mut m = Membership::new(config(2, 4));
    m.on(Event::Discovered(&hosts(&[("a", 2)])), secs(0));
    let d = m.on(Event::Discovered(&hosts(&[("x", 2), ("y", 2)])), secs(1));
    assert_eq!(world_of(&d), [("x", 2), ("y", 2)]);
}

#[test]
fn a_host_whose_ranks_fail_twice_in_a_row_is_blacklisted_until_its_cooldown() {
    let mut c = config(1, 8);
    c.cooldown = Some(Cooldown::new(secs(10), secs(100)).unwrap());
    let mut m = Membership::new(c);
    m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2)])), secs(0));
    // one failure: the same hosts again
    assert_eq!(world_of(&m.on(Event::RankFailed("b"), secs(1))), [("a", 2), ("b", 2)]);
    // the next round fails on b too: b is out for 20 s and the jitter
    assert_eq!(world_of(&m.on(Event::RankFailed("b"), secs(2))), [("a", 2)]);
    let until = m.blacklisted()[0].1.unwrap();
    assert!(until >= secs(22) && until < secs(32), "{until:?}");
    assert_eq!(m.on(Event::Tick, secs(21)), Decision::Continue);
    // back after the cooldown, appended
    assert_eq!(world_of(&m.on(Event::Tick, until)), [("a", 2), ("b", 2)]);
    // lost again: its second strike doubles the cooldown
    assert_eq!(world_of(&m.on(Event::HostLost("b"), secs(40))), [("a", 2)]);
    let until = m.blacklisted()[0].1.unwrap();
    assert!(until >= secs(80) && until < secs(90), "{until:?}");
    // a failure on a host that a failure in another round does not
    // follow is not a strike
    let mut fresh = Membership::new(config(1, 8));
    fresh.on(Event::Discovered(&hosts(&[("a", 1), ("b", 1)])), secs(0));
    fresh.on(Event::RankFailed("a"), secs(1));
    fresh.on(Event::RankFailed("b"), secs(2));
    assert!(fresh.blacklisted().is_empty());
}

#[test]
fn a_script_failing_every_round_on_one_host_hits_the_restart_limit_not_a_wait() {
    let mut c = config(2, 2);
    c.max_restarts = Some(3);
    let mut m = Membership::new(c);
    m.on(Event::Discovered(&hosts(&[("localhost", 2)])), secs(0));
    for round in 1..=3 {
        assert_eq!(world_of(&m.on(Event::RankFailed("localhost"), secs(round))), [("localhost", 2)]);
    }
    assert!(m.blacklisted().is_empty());
    assert_eq!(m.on(Event::RankFailed("localhost"), secs(4)), Decision::Stop(StopReason::RestartLimit { limit: 3 }));
    // with a cooldown the host is out after two failing rounds, but
    // the limit still comes first
    let mut c = config(2, 2);
    c.max_restarts = Some(1);
    c.cooldown = Some(Cooldown::new(secs(5), secs(5)).unwrap());
    let mut m = Membership::new(c);
    m.on(Event::Discovered(&hosts(&[("localhost", 2)])), secs(0));
    m.on(Event::RankFailed("localhost"), secs(1));
    assert_eq!(m.on(Event::RankFailed("localhost"), secs(2)), Decision::Stop(StopReason::RestartLimit { limit: 1 }));
}

#[test]
fn failures_outside_the_world_change_nothing_but_a_lost_host_is_noted() {
    let mut m = Membership::new(config(1, 1));
    m.on(Event::Discovered(&hosts(&[("a", 1), ("b", 1)])), secs(0));
    assert_eq!(m.on(Event::RankFailed("b"), secs(1)), Decision::Continue);
    assert_eq!(m.on(Event::HostLost("b"), secs(1)), Decision::Continue);
    assert_eq!(m.blacklisted(), [("b", None)]);
    // a then fails: b is out, nothing is left, the job waits
    assert!(matches!(m.on(Event::HostLost("a"), secs(2)), Decision::Wait { available: 0, needed: 1, .. }));
}

#[test]
fn the_reset_and_restart_limits_stop_the_job_saying_which() {
    let mut c = config(1, 8);
    c.reset_limit = Some(2);
    let mut m = Membership::new(c);
    m.on(Event::Discovered(&hosts(&[("a", 1)])), secs(0));
    m.on(Event::Discovered(&hosts(&[("a", 1), ("b", 1)])), secs(1));
    m.on(Event::Discovered(&hosts(&[("a", 1), ("b", 1), ("c", 1)])), secs(2));
    let Decision::Stop(reason) = m.on(Event::RankFailed("a"), secs(3)) else { panic!() };
    assert_eq!(reason, StopReason::ResetLimit { limit: 2 });
    assert!(reason.to_string().contains("reset limit"));

    let mut c = config(1, 8);
    c.max_restarts = Some(1);
    let mut m = Membership::new(c);
    m.on(Event::Discovered(&hosts(&[("a", 1), ("b", 1)])), secs(0));
    assert!(matches!(m.on(Event::RankFailed("a"), secs(1)), Decision::Reform(World { restarts: 1, .. })));
    // membership changes do not use restarts up
    assert!(matches!(
        m.on(Event::Discovered(&hosts(&[("a", 1), ("b", 1), ("c", 1)])), secs(2)),
        Decision::Reform(World { restarts: 1, resets: 2, .. })
    ));
    let Decision::Stop(reason) = m.on(Event::RankFailed("b"), secs(3)) else { panic!() };
    assert_eq!(reason, StopReason::RestartLimit { limit: 1 });
    assert!(reason.to_string().contains("restart limit"));
}

#[test]
fn a_fixed_host_list_stops_at_once_when_no_slot_can_come() {
    let mut c = config(4, 4);
    c.fixed_hosts = true;
    let no_slots = |available| Decision::Stop(StopReason::NoSlotsLeft { needed: 4, available });
    // too few from the start
    assert_eq!(Membership::new(c.clone()).on(Event::Discovered(&hosts(&[("a", 2)])), secs(0)), no_slots(2));
    // a host lost for good
    let mut m = Membership::new(c.clone());
    m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2)])), secs(0));
    let Decision::Stop(reason) = m.on(Event::HostLost("b"), secs(1)) else { panic!("no stop") };
    assert_eq!(Decision::Stop(reason.clone()), no_slots(2));
    assert!(reason.to_string().contains("no more can come"), "{reason}");
    // a host out for a while, or discovery that may add hosts: a wait
    let mut cooling = c.clone();
    cooling.cooldown = Some(Cooldown::new(secs(5), secs(5)).unwrap());
    let mut discovering = c.clone();
    discovering.fixed_hosts = false;
    for c in [cooling, discovering] {
        let mut m = Membership::new(c);
        m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2)])), secs(0));
        assert!(matches!(m.on(Event::HostLost("b"), secs(1)), Decision::Wait { available: 2, .. }));
    }
}

#[test]
fn each_blacklisting_is_news_once() {
    let mut c = config(1, 4);
    c.cooldown = Some(Cooldown::new(secs(5), secs(5)).unwrap());
    let mut m = Membership::new(c);
    m.on(Event::Discovered(&hosts(&[("a", 1), ("b", 1)])), secs(0));
    assert!(m.take_blacklisted_news(secs(0)).is_empty());
    m.on(Event::HostLost("b"), secs(1));
    assert_eq!(m.take_blacklisted_news(secs(2)), [("b".to_string(), Some(secs(4)))]);
    assert!(m.take_blacklisted_news(secs(3)).is_empty());
    // back after its cooldown, then out again: news again
    m.on(Event::Tick, secs(6));
    assert!(m.take_blacklisted_news(secs(6)).is_empty());
    m.on(Event::HostLost("b"), secs(7));
    assert_eq!(m.take_blacklisted_news(secs(7)), [("b".to_string(), Some(secs(5)))]);
}

#[test]
fn a_long_wait_is_announced_when_it_changes_and_now_and_then() {
    let mut m = Membership::new(config(4, 8));
    let announced = |d: Decision| match d {
        Decision::Wait { announce, .. } => announce,
        other => panic!("expected a wait, got {other:?}"),
    };
    assert!(announced(m.on(Event::Discovered(&hosts(&[("a", 2)])), secs(0))));
    assert!(!announced(m.on(Event::Tick, secs(1))));
    assert!(!announced(m.on(Event::Tick, secs(29))));
    assert!(announced(m.on(Event::Tick, secs(30))));
    assert!(announced(m.on(Event::Discovered(&hosts(&[("a", 3)])), secs(31))));
    assert!(!announced(m.on(Event::Tick, secs(32))));
    // a world in between: the next wait is news again
    m.on(Event::Discovered(&hosts(&[("a", 4)])), secs(33));
    assert!(announced(m.on(Event::HostLost("a"), secs(34))));
}

#[test]
fn a_host_that_shrinks_or_vanishes_from_discovery_reforms_the_world() {
    let mut m = Membership::new(config(1, 8));
    m.on(Event::Discovered(&hosts(&[("a", 2), ("b", 2)])), secs(0));
    assert_eq!(world_of(&m.on(Event::Discovered(&hosts(&[("a", 1), ("b", 2)])), secs(1))), [("a", 1), ("b", 2)]);
    let d = m.on(Event::Discovered(&hosts(&[("b", 2)])), secs(2));
    assert_eq!(world_of(&d), [("b", 2)]);
    // not blacklisted: it may return
    assert_eq!(world_of(&m.on(Event::Discovered(&hosts(&[("b", 2), ("a", 2)])), secs(3))), [("b", 2), ("a", 2)]);
}

fn event_strategy() -> impl Strategy<Value = (u8, Vec<(u8, u32)>, u8)> {
    (0u8..4, prop::collection::vec((0u8..6, 1u32..4), 0..6), 0u8..6)
}

proptest! {
    /// Any sequence of events: every world is within the bounds, made
    /// of discovered hosts that are not blacklisted, with no more slots
    /// than discovered; survivors keep their order; rounds count up by
    /// one; the limits hold.
    #[test]
    fn worlds_always_keep_the_rules(
        min in 1u32..4,
        extra in 0u32..6,
        reset_limit in prop::option::of(0u32..6),
        max_restarts in prop::option::of(0u32..4),
        in_place in any::<bool>(),
        cooldown in any::<bool>(),
        fixed in any::<bool>(),
        events in prop::collection::vec(event_strategy(), 1..40),
    ) {
        let mut c = ElasticConfig::new(min, min + extra).unwrap();
        c.blacklist_failed_hosts = in_place;
        c.reset_limit = reset_limit;
        c.max_restarts = max_restarts;
        c.cooldown = cooldown.then(|| Cooldown::new(secs(3), secs(20)).unwrap());
        c.fixed_hosts = fixed;
        c.elastic_timeout = secs(15);
        let name = |i: u8| format!("h{i}");
        let mut m = Membership::new(c.clone());
        let mut discovered: Vec<HostSpec> = Vec::new();
        let mut last: Option<World> = None;
        let mut stopped = false;
        // a world formed and running (no wait or stop since)
        let mut running = false;
        for (step, (kind, listed, host)) in events.into_iter().enumerate() {
            let now = secs(step as u64 * 2);
            let decision = match kind {
                0 => {
                    discovered.clear();
                    for (h, s) in listed {
                        if !discovered.iter().any(|d| d.name == name(h)) {
                            discovered.push(HostSpec::new(name(h), s));
                        }
                    }
                    m.on(Event::Discovered(&discovered), now)
                }
                1 => {
                    let was_in = running && last.as_ref().is_some_and(|w| w.hosts.iter().any(|(h, _)| *h == name(host)));
                    let decision = m.on(Event::RankFailed(&name(host)), now);
                    if let (true, true, Decision::Reform(w)) = (in_place, was_in, &decision) {
                        // in place, a host where a rank failed is out at once
                        prop_assert!(w.hosts.iter().all(|(h, _)| *h != name(host)), "{} kept", name(host));
                    }
                    decision
                }
                2 => m.on(Event::HostLost(&name(host)), now),
                _ => m.on(Event::Tick, now),
            };
            prop_assert!(!stopped || matches!(decision, Decision::Stop(_)), "went on after a stop");
            match decision {
                Decision::Reform(w) => {
                    prop_assert!(w.size() >= c.min_np && w.size() <= c.max_np, "size {}", w.size());
                    let out: Vec<&str> = m.blacklisted().iter().map(|(h, _)| *h).collect();
                    for (h, n) in &w.hosts {
                        prop_assert!(!out.contains(&h.as_str()), "blacklisted {h} in a world");
                        let d = discovered.iter().find(|d| &d.name == h);
                        prop_assert!(d.is_some_and(|d| *n >= 1 && *n <= d.slots), "{h}:{n} not as discovered");
                    }
                    if let Some(prev) = &last {
                        prop_assert_eq!(w.round, prev.round + 1);
                        let kept: Vec<&String> = prev.hosts.iter().map(|(h, _)| h)
                            .filter(|h| w.hosts.iter().any(|(x, _)| x == *h)).collect();
                        let order: Vec<&String> = w.hosts.iter().map(|(h, _)| h)
                            .filter(|h| prev.hosts.iter().any(|(x, _)| x == *h)).collect();
                        prop_assert_eq!(&kept, &order, "survivors reordered");
                        prop_assert_eq!(&order[..], &w.hosts.iter().map(|(h, _)| h).take(order.len()).collect::<Vec<_>>()[..], "survivors not first");
                    } else {
                        prop_assert_eq!(w.round, 0);
                    }
                    prop_assert!(reset_limit.is_none_or(|l| w.resets <= l));
                    prop_assert!(max_restarts.is_none_or(|l| w.restarts <= l));
                    prop_assert!(w.restarts <= w.resets);
                    last = Some(w);
                    running = true;
                }
                Decision::Stop(reason) => {
                    if let StopReason::NoSlotsLeft { needed, available } = reason {
                        // only when nothing could ever end the wait
                        prop_assert!(fixed && available < needed);
                        prop_assert!(m.blacklisted().iter().all(|(_, until)| until.is_none()));
                    }
                    stopped = true;
                    running = false;
                }
                Decision::Wait { available, needed, .. } => {
                    prop_assert!(available < needed);
                    running = false;
                }
                Decision::Continue => {}
            }
        }
    }
}
