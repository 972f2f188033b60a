//! The send/receive schedules of the in-place allreduce algorithms, as pure
//! functions of (rank count, rank, buffer length): per step, what this rank
//! sends to whom, and what it receives from whom and how it lands (copied
//! or reduced in). `comm` runs them over the links; the tests here run them
//! for every rank at once in memory and check the results, exhaustively
//! over small rank counts and odd lengths.
//!
//! Within a step the send reads the buffer as it was before the step, and
//! the received bytes land after it (through scratch space when the two
//! ranges overlap).

use std::ops::Range;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Apply {
    Copy,
    Reduce,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Step {
    /// (peer, byte range of the buffer to send)
    pub send: Option<(usize, Range<usize>)>,
    /// (peer, byte range of the buffer that receives, how)
    pub recv: Option<(usize, Range<usize>, Apply)>,
}

fn exchange(peer: usize, send: Range<usize>, recv: Range<usize>, apply: Apply) -> Step {
    Step { send: Some((peer, send)), recv: Some((peer, recv, apply)) }
}

/// Byte offsets of `n` near-equal parts of `len` bytes of `esize`-byte elements.
pub(crate) fn parts(len: usize, esize: usize, n: usize) -> Vec<usize> {
    let mut at = vec![0];
    for c in split_counts(len / esize, n) {
        at.push(at.last().expect("non-empty") + c * esize);
    }
    at
}

/// Ranks beyond the largest power of two `p` fold into a partner first:
/// even ranks below `2 * extra` hand over their buffer and wait for the
/// result; the rest go on as ranks `0..p`.
struct Fold {
    p: usize,
    extra: usize,
}

impl Fold {
    fn new(n: usize) -> Fold {
        let p = 1 << (usize::BITS - 1 - n.max(1).leading_zeros());
        Fold { p, extra: n - p }
    }

    /// This rank among the `p`, or `None` for one that folds away.
    fn new_rank(&self, r: usize) -> Option<usize> {
        if r < 2 * self.extra {
            (r % 2 == 1).then_some(r / 2)
        } else {
            Some(r - self.extra)
        }
    }

    fn real(&self, nr: usize) -> usize {
        if nr < self.extra {
            nr * 2 + 1
        } else {
            nr + self.extra
        }
    }

    /// The steps around `inner` (the steps among the `p`).
    fn wrap(&self, r: usize, len: usize, inner: impl FnOnce(usize) -> Vec<Step>) -> Vec<Step> {
        let whole = 0..len;
        let Some(new_rank) = self.new_rank(r) else {
            return vec![
                Step { send: Some((r + 1, whole.clone())), recv: None },
                Step { send: None, recv: Some((r + 1, whole, Apply::Copy)) },
            ];
        };
        let folded = r < 2 * self.extra;
        let mut steps = Vec::new();
        if folded {
            steps.push(Step { send: None, recv: Some((r - 1, whole.clone(), Apply::Reduce)) });
        }
        steps.extend(inner(new_rank));
        if folded {
            steps.push(Step { send: Some((r - 1, whole)), recv: None });
        }
        steps
    }
}

/// Latency-bound sizes: log2(p) exchanges of the whole buffer.
pub(crate) fn recursive_doubling(n: usize, r: usize, len: usize) -> Vec<Step> {
    let fold = Fold::new(n);
    fold.wrap(r, len, |new_rank| {
        let mut steps = Vec::new();
        let mut mask = 1;
        while mask < fold.p {
            steps.push(exchange(fold.real(new_rank ^ mask), 0..len, 0..len, Apply::Reduce));
            mask <<= 1;
        }
        steps
    })
}

/// Mid sizes (Rabenseifner): reduce-scatter by recursive halving, then
/// allgather by recursive doubling.
pub(crate) fn halving_doubling(n: usize, r: usize, len: usize, esize: usize) -> Vec<Step> {
    let fold = Fold::new(n);
    let p = fold.p;
    let at = parts(len, esize, p);
    fold.wrap(r, len, |new_rank| {
        let mut steps = Vec::new();
        let (mut lo, mut hi) = (0, p);
        let mut mask = p >> 1;
        while mask > 0 {
            let mid = (lo + hi) / 2;
            let (keep, give) = if new_rank & mask == 0 { ((lo, mid), (mid, hi)) } else { ((mid, hi), (lo, mid)) };
            let partner = fold.real(new_rank ^ mask);
            steps.push(exchange(partner, at[give.0]..at[give.1], at[keep.0]..at[keep.1], Apply::Reduce));
            (lo, hi) = keep;
            mask >>= 1;
        }
        let mut mask = 1;
        while mask < p {
            let width = hi - lo;
            let other = if new_rank & mask == 0 { (hi, hi + width) } else { (lo - width, lo) };
            let partner = fold.real(new_rank ^ mask);
            steps.push(exchange(partner, at[lo]..at[hi], at[other.0]..at[other.1], Apply::Copy));
            (lo, hi) = (lo.min(other.0), hi.max(other.1));
            mask <<= 1;
        }
        steps
    })
}

/// Bandwidth-bound sizes: ring reduce-scatter, then ring allgather.
pub(crate) fn ring(n: usize, r: usize, len: usize, esize: usize) -> Vec<Step> {
    let at = parts(len, esize, n);
    let range = |c: usize| at[c]..at[c + 1];
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let mut steps = Vec::with_capacity(2 * n);
    for s in 0..n.saturating_sub(1) {
        let (out, inc) = ((r + n - s) % n, (r + 2 * n - s - 1) % n);
        steps.push(Step { send: Some((next, range(out))), recv: Some((prev, range(inc), Apply::Reduce)) });
    }
    let own = (r + 1) % n;
    for s in 0..n.saturating_sub(1) {
        let (out, inc) = ((own + n - s) % n, (own + 2 * n - s - 1) % n);
        steps.push(Step { send: Some((next, range(out))), recv: Some((prev, range(inc), Apply::Copy)) });
    }
    steps
}

// safe code only, and exhaustive: not worth Miri's time
#[cfg(all(test, not(miri)))]
mod tests {
    use super::*;
    use std::collections::{HashMap, VecDeque};

    const E: usize = 8; // i64 elements

    /// Runs every rank's steps at once over in-memory FIFO links; returns
    /// each rank's buffer. Fails on a bad peer or range, a message whose
    /// length does not match its receive, a deadlock, or a message left over.
    fn simulate(n: usize, count: usize, steps: impl Fn(usize) -> Vec<Step>) -> Vec<Vec<i64>> {
        let len = count * E;
        let steps: Vec<Vec<Step>> = (0..n).map(&steps).collect();
        let mut bufs: Vec<Vec<i64>> =
            (0..n).map(|r| (0..count).map(|i| ((r + 1) * 1000 + i * 7) as i64).collect()).collect();
        let mut links: HashMap<(usize, usize), VecDeque<Vec<i64>>> = HashMap::new();
        let (mut pc, mut sent) = (vec![0; n], vec![false; n]);
        let check = |r: usize, peer: usize, range: &Range<usize>| {
            assert!(peer < n && peer != r, "n {n}: rank {r} talks to {peer}");
            assert!(range.start <= range.end && range.end <= len, "n {n}: rank {r}: range {range:?} of {len}");
            assert!(
                range.start.is_multiple_of(E) && range.end.is_multiple_of(E),
                "n {n}: rank {r}: unaligned {range:?}"
            );
        };
        loop {
            let mut progressed = false;
            for r in 0..n {
                while let Some(step) = steps[r].get(pc[r]) {
                    if !sent[r] {
                        if let Some((to, range)) = &step.send {
                            check(r, *to, range);
                            links
                                .entry((r, *to))
                                .or_default()
                                .push_back(bufs[r][range.start / E..range.end / E].to_vec());
                        }
                        sent[r] = true;
                        progressed = true;
                    }
                    if let Some((from, range, apply)) = &step.recv {
                        check(r, *from, range);
                        let Some(msg) = links.entry((*from, r)).or_default().pop_front() else { break };
                        assert_eq!(msg.len() * E, range.len(), "n {n}: rank {r} step {}: length", pc[r]);
                        let dst = &mut bufs[r][range.start / E..range.end / E];
                        for (d, m) in dst.iter_mut().zip(msg) {
                            *d = match apply {
                                Apply::Copy => m,
                                Apply::Reduce => d.wrapping_add(m),
                            };
                        }
                    }
                    pc[r] += 1;
                    sent[r] = false;
                    progressed = true;
                }
            }
            if (0..n).all(|r| pc[r] == steps[r].len()) {
                break;
            }
            assert!(progressed, "n {n} count {count}: deadlock at steps {pc:?}");
        }
        assert!(links.values().all(|q| q.is_empty()), "n {n} count {count}: messages left over");
        bufs
    }

    fn check_sums(name: &str, steps: impl Fn(usize, usize, usize) -> Vec<Step>) {
        for n in 1..=17 {
            for count in [0, 1, 2, 3, 5, 7, 16, 17, 31, 33, 100, 257] {
                let bufs = simulate(n, count, |r| steps(n, r, count * E));
                for (r, buf) in bufs.iter().enumerate() {
                    for (i, v) in buf.iter().enumerate() {
                        let want: i64 = (0..n).map(|q| ((q + 1) * 1000 + i * 7) as i64).sum();
                        assert_eq!(*v, want, "{name}: n {n} count {count}: rank {r} element {i}");
                    }
                }
            }
        }
    }

    #[test]
    fn recursive_doubling_sums_on_every_rank() {
        check_sums("recursive doubling", recursive_doubling);
    }

    #[test]
    fn halving_doubling_sums_on_every_rank() {
        check_sums("halving-doubling", |n, r, len| halving_doubling(n, r, len, E));
    }

    #[test]
    fn ring_sums_on_every_rank() {
        check_sums("ring", |n, r, len| ring(n, r, len, E));
    }

    /// What lets the ring run out of place: only its first send reads a
    /// range this rank has not received into yet.
    #[test]
    fn the_ring_sends_only_what_it_received_after_its_first_step() {
        for n in 2..=17 {
            for r in 0..n {
                let steps = ring(n, r, n * 3 * E, E);
                let mut received: Vec<Range<usize>> = Vec::new();
                for (i, step) in steps.iter().enumerate() {
                    let (_, sent) = step.send.as_ref().unwrap();
                    assert!(i == 0 || received.contains(sent), "n {n} rank {r} step {i}");
                    let (_, got, _) = step.recv.as_ref().unwrap();
                    assert!(sent.end <= got.start || got.end <= sent.start, "n {n} rank {r} step {i}: overlap");
                    received.push(got.clone());
                }
            }
        }
    }

    #[test]
    fn step_counts() {
        assert_eq!(ring(5, 2, 80, 8).len(), 8);
        assert_eq!(recursive_doubling(8, 3, 8).len(), 3);
        // a folded-away rank sends its buffer and waits for the result
        assert_eq!(recursive_doubling(6, 0, 8).len(), 2);
        assert_eq!(recursive_doubling(6, 1, 8).len(), 4);
    }
}

/// Element counts of `n` near-equal parts of `count` (the first parts one larger).
pub fn split_counts(count: usize, n: usize) -> Vec<usize> {
    (0..n).map(|i| count / n + usize::from(i < count % n)).collect()
}
