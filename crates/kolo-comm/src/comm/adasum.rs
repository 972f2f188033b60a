//! Adasum (Horovod's `ops/adasum`): an allreduce that adds two gradients
//! less what they share, `a' = (1 - a.b / 2|a|²) a + (1 - a.b / 2|b|²) b`,
//! so that agreeing gradients average and orthogonal ones add.
//!
//! The ranks combine pairwise up a binary tree by vector halving and
//! distance doubling: at level `l` (1, 2, 4...) a rank swaps half of its
//! current window with rank `rank ^ l` and combines the half it keeps;
//! each tensor's dot product and squared norms are partial on every rank
//! holding a piece of it, so they are summed (in f64) over the `2l` ranks
//! that share the window before the coefficients are taken. The windows
//! then travel back by distance halving, as in an allgather. A buffer may
//! hold several tensors back to back: each keeps its own coefficients.
//! As upstream, only a power-of-two number of ranks can run it.

use half::f16;

use super::progress::{Call, Io, Kind, Sink};
use super::Communicator;
use crate::dtype::{DType, Element};
use crate::CommError;

/// The element types Adasum combines, read and written through f64.
trait Real: bytemuck::Pod {
    fn wide(self) -> f64;
    fn narrow(v: f64) -> Self;
}

impl Real for f32 {
    fn wide(self) -> f64 {
        f64::from(self)
    }
    fn narrow(v: f64) -> Self {
        v as f32
    }
}

impl Real for f64 {
    fn wide(self) -> f64 {
        self
    }
    fn narrow(v: f64) -> Self {
        v
    }
}

impl Real for f16 {
    fn wide(self) -> f64 {
        self.to_f64()
    }
    fn narrow(v: f64) -> Self {
        f16::from_f64(v)
    }
}

macro_rules! with_real {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            other => unreachable!("Adasum refuses {} before it starts", other.name()),
        }
    };
}

/// `[a.b, |a|², |b|²]`, accumulated in f64 (four lanes, for speed; the
/// order is fixed, so every run gives the same bits).
fn dots<T: Real>(a: &[T], b: &[T]) -> [f64; 3] {
    let mut lanes = [[0.0f64; 3]; 4];
    let (ac, bc) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x4, y4) in ac.zip(bc) {
        for k in 0..4 {
            let (x, y) = (x4[k].wide(), y4[k].wide());
            lanes[k][0] += x * y;
            lanes[k][1] += x * x;
            lanes[k][2] += y * y;
        }
    }
    for (k, (x, y)) in ar.iter().zip(br).enumerate() {
        let (x, y) = (x.wide(), y.wide());
        lanes[k][0] += x * y;
        lanes[k][1] += x * x;
        lanes[k][2] += y * y;
    }
    let mut out = [0.0; 3];
    for lane in lanes {
        for (o, v) in out.iter_mut().zip(lane) {
            *o += v;
        }
    }
    out
}

/// The coefficient of a vector of squared norm `norm_sq` against a dot
/// product `dot`: 1 for a vector too small to divide by (upstream's bound,
/// the square root of the smallest normal f64), so zeros add plainly.
pub(crate) fn coefficient(dot: f64, norm_sq: f64) -> f64 {
    if norm_sq >= f64::MIN_POSITIVE.sqrt() {
        1.0 - dot / norm_sq * 0.5
    } else {
        1.0
    }
}

/// `a = ca a + cb b`, in f64, rounded once to the element type.
fn combine<T: Real>(a: &mut [T], ca: f64, b: &[T], cb: f64) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = T::narrow(ca * x.wide() + cb * y.wide());
    }
}

/// Splits per-tensor counts (summing to the window) at element `at`: the
/// counts of the head `[0, at)` and of the tail, tensor by tensor.
pub(crate) fn split_at(counts: &[usize], at: usize) -> (Vec<usize>, Vec<usize>) {
    let mut before = 0;
    let mut head = Vec::with_capacity(counts.len());
    let mut tail = Vec::with_capacity(counts.len());
    for &c in counts {
        let h = c.min(at.saturating_sub(before));
        head.push(h);
        tail.push(c - h);
        before += c;
    }
    (head, tail)
}

impl Communicator {
    /// Adasum over `buf` in place, on every rank: `buf` holds tensors of
    /// `counts` elements back to back (the same counts on every rank),
    /// each combined with its own dot products and norms. For f16, f32
    /// and f64 (the products and norms in f64), on a power-of-two number
    /// of ranks, as Horovod's Adasum.
    pub fn adasum<T: Element>(&mut self, buf: &mut [T], counts: &[usize]) -> Result<(), CommError> {
        let n = self.size();
        if !matches!(T::DTYPE, DType::F16 | DType::F32 | DType::F64) {
            return Err(self.bad(format!(
                "adasum combines f16, f32 and f64 elements only, not {}: reduce {} with a sum or an average",
                T::DTYPE.name(),
                T::DTYPE.name()
            )));
        }
        if !n.is_power_of_two() {
            let below = 1usize << n.ilog2();
            return Err(self.bad(format!(
                "adasum needs a power-of-two number of ranks, as Horovod's Adasum does; this communicator has {n}: run \
                 it on {below} or {} ranks",
                below * 2
            )));
        }
        if counts.iter().sum::<usize>() != buf.len() {
            return Err(self.bad(format!(
                "adasum: the tensors' counts {counts:?} must sum to the buffer's length ({})",
                buf.len()
            )));
        }
        let call = Call::of(Kind::Adasum, T::DTYPE, buf.len());
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        self.collective(call, |c, io| with_real!(T::DTYPE, R => c.adasum_typed::<R>(io, bytes, counts)))
    }

    fn adasum_typed<T: Real>(&self, io: &mut Io<'_>, buf: &mut [u8], counts: &[usize]) -> Result<(), CommError> {
        let (n, r, es) = (self.size(), self.rank, std::mem::size_of::<T>());
        // this rank's window of the buffer, in elements, and its tensors' parts
        let (mut lo, mut len) = (0usize, buf.len() / es);
        let mut mine = counts.to_vec();
        // the elements handed to the neighbour at each level, to take back
        let mut given = Vec::new();
        let mut level = 1;
        while level < n {
            let peer = r ^ level;
            let low = r & level == 0;
            let half = len / 2;
            let (head, tail) = split_at(&mine, half);
            let (keep, give, kept) = match low {
                true => (lo..lo + half, lo + half..lo + len, head),
                false => (lo + half..lo + len, lo..lo + half, tail),
            };
            given.push(give.len());
            let bytes = |r: &std::ops::Range<usize>| r.start * es..r.end * es;
            let keep_bytes = bytes(&keep);
            self.with_scratch(io, keep_bytes.len(), |io, theirs| -> Result<(), CommError> {
                let klen = theirs.len();
                self.send_recv(io, Some((peer, &buf[bytes(&give)])), Some((peer, klen, Sink::Copy(theirs))))?;
                let ours: &mut [T] = bytemuck::cast_slice_mut(&mut buf[keep_bytes]);
                let theirs: &[T] = bytemuck::cast_slice(theirs);
                // per tensor: the dot product, then the lower rank's side's
                // squared norm, then the upper's, so the sums line up
                let mut sums = Vec::with_capacity(kept.len() * 3);
                let mut at = 0;
                for &k in &kept {
                    let [dot, own, other] = dots(&ours[at..at + k], &theirs[at..at + k]);
                    sums.extend(if low { [dot, own, other] } else { [dot, other, own] });
                    at += k;
                }
                self.sum_within(io, &mut sums, level)?;
                let mut at = 0;
                for (i, &k) in kept.iter().enumerate() {
                    let (dot, lower, upper) = (sums[3 * i], sums[3 * i + 1], sums[3 * i + 2]);
                    let (own, other) = if low { (lower, upper) } else { (upper, lower) };
                    combine(&mut ours[at..at + k], coefficient(dot, own), &theirs[at..at + k], coefficient(dot, other));
                    at += k;
                }
                Ok(())
            })?;
            lo = keep.start;
            len = keep.len();
            mine = kept;
            level <<= 1;
        }
        // back down: each level's neighbour returns the part it combined
        let mut level = n / 2;
        while level > 0 {
            let peer = r ^ level;
            let theirs = given.pop().expect("one per level");
            let their_range = if r & level == 0 { lo + len..lo + len + theirs } else { lo - theirs..lo };
            let (ours, dst) = super::collectives::disjoint(
                buf,
                lo * es..(lo + len) * es,
                their_range.start * es..their_range.end * es,
            );
            let dlen = dst.len();
            self.send_recv(io, Some((peer, ours)), Some((peer, dlen, Sink::Copy(dst))))?;
            lo = lo.min(their_range.start);
            len += theirs;
            level >>= 1;
        }
        Ok(())
    }

    /// Sums `values` over the `2 * level` ranks that share this rank's
    /// bits above `level` (recursive doubling: each pair adds the same two
    /// numbers, so every rank ends with the same bits).
    fn sum_within(&self, io: &mut Io<'_>, values: &mut [f64], level: usize) -> Result<(), CommError> {
        let mut incoming = vec![0.0f64; values.len()];
        let mut step = 1;
        while step <= level {
            let peer = self.rank ^ step;
            let out: &[u8] = bytemuck::cast_slice(values);
            let sink: &mut [u8] = bytemuck::cast_slice_mut(&mut incoming);
            let len = sink.len();
            self.send_recv(io, Some((peer, out)), Some((peer, len, Sink::Copy(sink))))?;
            for (v, w) in values.iter_mut().zip(&incoming) {
                *v += w;
            }
            step <<= 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_split_tensor_by_tensor_at_any_point() {
        assert_eq!(split_at(&[3, 0, 4], 5), (vec![3, 0, 2], vec![0, 0, 2]));
        assert_eq!(split_at(&[3, 4], 0), (vec![0, 0], vec![3, 4]));
        assert_eq!(split_at(&[3, 4], 7), (vec![3, 4], vec![0, 0]));
        assert_eq!(split_at(&[], 0), (vec![], vec![]));
    }

    #[test]
    fn parallel_vectors_average_orthogonal_ones_add_and_zeros_add_plainly() {
        let (mut a, b) = (vec![2.0f64, 4.0], vec![2.0f64, 4.0]);
        let [dot, na, nb] = dots(&a, &b);
        combine(&mut a, coefficient(dot, na), &b, coefficient(dot, nb));
        assert_eq!(a, [2.0, 4.0]);
        let (mut a, b) = (vec![1.0f32, 0.0], vec![0.0f32, 3.0]);
        let [dot, na, nb] = dots(&a, &b);
        combine(&mut a, coefficient(dot, na), &b, coefficient(dot, nb));
        assert_eq!(a, [1.0, 3.0]);
        let (mut a, b) = (vec![f16::from_f32(1.5); 9], vec![f16::ZERO; 9]);
        let [dot, na, nb] = dots(&a, &b);
        assert_eq!((dot, na, nb), (0.0, 9.0 * 2.25, 0.0));
        combine(&mut a, coefficient(dot, na), &b, coefficient(dot, nb));
        assert_eq!(a, vec![f16::from_f32(1.5); 9]);
    }

    #[test]
    fn dot_products_accumulate_in_f64() {
        // f32 accumulation would lose the ones after the first 2^24
        let a = vec![1.0f32; (1 << 24) + 8];
        assert_eq!(dots(&a, &a)[0], ((1u64 << 24) + 8) as f64);
    }
}
