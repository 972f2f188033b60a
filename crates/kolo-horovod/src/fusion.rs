//! Tensor fusion (upstream's `Controller::FuseResponses`): greedy, in list
//! order, with a look-ahead past responses that do not fit, so that many
//! small reductions of one type run as one collective over a fusion
//! buffer. Every rank that fuses a list fuses it alike: the inputs are the
//! list and each tensor's row size, the same on every rank.

use std::collections::VecDeque;

use crate::message::{Response, ResponseType};

/// What fusion needs of a tensor this rank holds: for an allgather, the
/// bytes of one row (the tensor's size over its first dimension).
pub trait RowBytes {
    /// The bytes of one row of this rank's tensor `name`.
    fn row_bytes(&self, name: &str) -> i64;
}

impl<F: Fn(&str) -> i64> RowBytes for F {
    fn row_bytes(&self, name: &str) -> i64 {
        self(name)
    }
}

fn reduction_bytes(r: &Response) -> i64 {
    r.sizes.first().map_or(0, |&n| n * r.dtype.size() as i64)
}

/// Each rank's bytes of an allgather response.
fn gathered_bytes(r: &Response, rows: &impl RowBytes) -> Vec<i64> {
    let row = rows.row_bytes(&r.names[0]);
    r.sizes.iter().map(|&d| d * row).collect()
}

fn same_reduction(a: &Response, b: &Response) -> bool {
    a.kind == b.kind
        && a.devices == b.devices
        && a.dtype == b.dtype
        && a.prescale == b.prescale
        && a.postscale == b.postscale
        && a.reduce_op == b.reduce_op
}

/// Fuses single-tensor responses up to `threshold` bytes each.
pub fn fuse(responses: Vec<Response>, threshold: i64, rows: &impl RowBytes) -> Vec<Response> {
    let mut queue: VecDeque<Response> = responses.into();
    let mut fused = Vec::new();
    while let Some(mut head) = queue.pop_front() {
        let mut skipped: Vec<Response> = Vec::new();
        match head.kind {
            ResponseType::Allreduce | ResponseType::Adasum | ResponseType::Reducescatter => {
                let mut bytes = reduction_bytes(&head);
                let mut skipped_bytes = 0;
                while let Some(next) = queue.front() {
                    let next_bytes = reduction_bytes(next);
                    if same_reduction(&head, next) && bytes + next_bytes <= threshold {
                        let next = queue.pop_front().expect("peeked");
                        bytes += next_bytes;
                        head.names.extend(next.names);
                        head.sizes.extend(next.sizes);
                        continue;
                    }
                    // look past what does not fit, while what was passed
                    // would still have fit
                    skipped_bytes += match next.kind {
                        ResponseType::Allgather => gathered_bytes(next, rows).iter().sum(),
                        _ => next_bytes,
                    };
                    if bytes + skipped_bytes > threshold {
                        break;
                    }
                    skipped.push(queue.pop_front().expect("peeked"));
                }
            }
            ResponseType::Allgather => {
                let mut per_rank = gathered_bytes(&head, rows);
                let mut skipped_bytes = 0;
                while let Some(next) = queue.front() {
                    if matches!(next.kind, ResponseType::Barrier | ResponseType::Join) {
                        break;
                    }
                    let next_per_rank = match next.kind {
                        ResponseType::Allgather => gathered_bytes(next, rows),
                        _ => Vec::new(),
                    };
                    let total: i64 = per_rank.iter().zip(&next_per_rank).map(|(a, b)| a + b).sum();
                    let fits = next.kind == ResponseType::Allgather
                        && next.devices == head.devices
                        && next.dtype == head.dtype
                        && total <= threshold;
                    if fits {
                        let next = queue.pop_front().expect("peeked");
                        for (a, b) in per_rank.iter_mut().zip(&next_per_rank) {
                            *a += b;
                        }
                        head.names.extend(next.names);
                        head.sizes.extend(next.sizes);
                        continue;
                    }
                    skipped_bytes += match next.kind {
                        ResponseType::Allgather => next_per_rank.iter().sum(),
                        _ => reduction_bytes(next),
                    };
                    if per_rank.iter().sum::<i64>() + skipped_bytes > threshold {
                        break;
                    }
                    skipped.push(queue.pop_front().expect("peeked"));
                }
            }
            // broadcast, alltoall, join, barrier and errors run alone
            _ => {}
        }
        for s in skipped.into_iter().rev() {
            queue.push_front(s);
        }
        fused.push(head);
    }
    fused
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{DataType, CPU_DEVICE_ID};

    fn reduce(name: &str, elements: i64, dtype: DataType) -> Response {
        let mut r = Response::new(ResponseType::Allreduce, name);
        r.sizes = vec![elements];
        r.dtype = dtype;
        r.devices = vec![CPU_DEVICE_ID; 2];
        r
    }

    fn gather(name: &str, dims: &[i64]) -> Response {
        let mut r = Response::new(ResponseType::Allgather, name);
        r.sizes = dims.to_vec();
        r.dtype = DataType::Float32;
        r.devices = vec![CPU_DEVICE_ID; 2];
        r
    }

    fn names(list: &[Response]) -> Vec<Vec<&str>> {
        list.iter().map(|r| r.names.iter().map(String::as_str).collect()).collect()
    }

    const F32: DataType = DataType::Float32;
    const F64: DataType = DataType::Float64;

    #[test]
    fn reductions_of_one_kind_fuse_up_to_the_threshold() {
        let rows = |_: &str| 4;
        let list = vec![reduce("a", 10, F32), reduce("b", 10, F32), reduce("c", 10, F32)];
        assert_eq!(names(&fuse(list.clone(), 80, &rows)), [vec!["a", "b"], vec!["c"]]);
        let fused = fuse(list.clone(), 1 << 20, &rows);
        assert_eq!(names(&fused), [vec!["a", "b", "c"]]);
        assert_eq!(fused[0].sizes, vec![10, 10, 10]);
        assert_eq!(names(&fuse(list, 0, &rows)), [vec!["a"], vec!["b"], vec!["c"]], "0 turns fusion off");
        // a tensor over the threshold still runs, alone
        assert_eq!(names(&fuse(vec![reduce("big", 1000, F32)], 8, &rows)), [vec!["big"]]);
    }

    #[test]
    fn fusion_looks_past_other_types_while_what_it_passed_would_have_fit() {
        let rows = |_: &str| 4;
        let list = vec![reduce("a", 10, F32), reduce("h", 10, F64), reduce("b", 10, F32)];
        // 40 + 80 (passed) fits 200: a and b fuse, h runs after, in its place
        assert_eq!(names(&fuse(list.clone(), 200, &rows)), [vec!["a", "b"], vec!["h"]]);
        // 40 + 80 > 100: the look-ahead stops at h
        assert_eq!(names(&fuse(list, 100, &rows)), [vec!["a"], vec!["h"], vec!["b"]]);
        let mut other_op = reduce("o", 10, F32);
        other_op.postscale = 0.5;
        let list = vec![reduce("a", 1, F32), other_op, reduce("b", 1, F32)];
        assert_eq!(names(&fuse(list, 1000, &rows)), [vec!["a", "b"], vec!["o"]]);
    }

    #[test]
    fn allgathers_fuse_by_each_ranks_bytes_and_stop_at_a_barrier() {
        let rows = |_: &str| 8;
        let list = vec![gather("x", &[1, 3]), gather("y", &[2, 2]), gather("z", &[4, 4])];
        // per rank: x+y = (3, 5) rows = 64 bytes; + z = 128
        assert_eq!(names(&fuse(list.clone(), 64, &rows)), [vec!["x", "y"], vec!["z"]]);
        let fused = fuse(list.clone(), 1000, &rows);
        assert_eq!(fused[0].sizes, vec![1, 3, 2, 2, 4, 4]);
        let barrier = Response::new(ResponseType::Barrier, "barrier");
        let list = vec![gather("x", &[1, 1]), barrier, gather("y", &[1, 1])];
        assert_eq!(names(&fuse(list, 1000, &rows)), [vec!["x"], vec!["barrier"], vec!["y"]]);
    }

    #[test]
    fn an_allreduce_may_pass_a_barrier_as_upstreams_does() {
        let rows = |_: &str| 4;
        let barrier = Response::new(ResponseType::Barrier, "barrier");
        let list = vec![reduce("a", 1, F32), barrier, reduce("b", 1, F32)];
        assert_eq!(names(&fuse(list, 1000, &rows)), [vec!["a", "b"], vec!["barrier"]]);
    }
}
