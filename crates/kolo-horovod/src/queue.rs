//! Submission (upstream's `tensor_queue.cc` and the checks of
//! `operations.cc`'s `Enqueue*`): a group of tensors is checked as
//! upstream checks it, then queued for the next cycle and tabled by name
//! until its response runs; and, once the loop stops, everything pending
//! fails.

use std::collections::HashSet;
use std::sync::Arc;

use crate::entry::{Entry, Failure, FailureKind, Handle, Submit};
use crate::message::{DataType, ReduceOp, Request, RequestType, Stopping, JOIN_TENSOR_NAME};
use crate::state::{SetShared, Shared};

/// Upstream's text for everything pending or submitted once the core stopped.
pub const SHUT_DOWN: &str = "Horovod has been shut down. This was caused by an exception on one of the ranks or an \
                             attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished \
                             execution. If the shutdown was caused by an exception, you should see the exception in \
                             the log before the first shutdown message.";

/// Upstream's duplicate-name text (two spaces after "processed.").
pub const DUPLICATE_NAME: &str = "Requested to allreduce, allgather, or broadcast a tensor with the same name as \
                                  another tensor that is currently being processed.  If you want to request another \
                                  tensor, use a different tensor name.";

/// Why a submission was refused at once (it never reached the others).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refused {
    /// Which exception the caller raises.
    pub kind: FailureKind,
    /// The text the caller raises (upstream's where it has one).
    pub message: String,
}

impl Refused {
    pub(crate) fn invalid(message: impl Into<String>) -> Refused {
        Refused { kind: FailureKind::Invalid, message: message.into() }
    }

    pub(crate) fn internal(message: impl Into<String>) -> Refused {
        Refused { kind: FailureKind::Internal, message: message.into() }
    }
}

impl SetShared {
    /// Checks `tensors` as one group for this set and queues them all, or
    /// none; the handle covers them all. `global_rank`: this process's.
    pub(crate) fn enqueue(&mut self, global_rank: u32, tensors: Vec<Submit>) -> Result<Arc<Handle>, Refused> {
        let mut requests = Vec::with_capacity(tensors.len());
        for t in &tensors {
            let op = op_title(t.kind);
            let Some(my_rank) = self.my_rank else {
                return Err(Refused::invalid(format!(
                    "{op}: Rank {global_rank} is not a member of the provided process set."
                )));
            };
            if matches!(t.kind, RequestType::Allreduce | RequestType::Reducescatter) && t.dtype.comm().is_none() {
                // the loop could not reduce it: refused here, never there
                return Err(Refused::invalid(format!("Tensor type {} is not supported.", t.dtype.name())));
            }
            let mut request = Request::new(my_rank, t.kind, t.dtype, t.name.clone(), t.shape.clone());
            request.device = t.device;
            request.prescale = t.prescale;
            request.postscale = t.postscale;
            request.reduce_op = t.reduce_op;
            if t.kind == RequestType::Allreduce && t.reduce_op == ReduceOp::Adasum {
                // upstream's Adasum is a request type of its own
                request.kind = RequestType::Adasum;
                check_adasum(t, self.ranks.len())?;
            }
            match t.kind {
                RequestType::Broadcast => {
                    let root = self.ranks.iter().position(|&r| i64::from(r) == t.root_rank);
                    let Some(root) = root else {
                        return Err(Refused::invalid(format!(
                            "broadcast received invalid root rank {} for provided process set",
                            t.root_rank
                        )));
                    };
                    request.root_rank = root as u32;
                }
                RequestType::Alltoall => check_splits(t, self.ranks.len())?,
                RequestType::Reducescatter => {
                    match t.reduce_op {
                        // an average sums, then divides by the set's size
                        ReduceOp::Average => {
                            request.reduce_op = ReduceOp::Sum;
                            request.postscale /= self.ranks.len() as f64;
                        }
                        ReduceOp::Sum => {}
                        _ => return Err(Refused::internal("Reducescatter currently only supports AVERAGE and SUM.")),
                    }
                    if t.shape.is_empty() {
                        return Err(Refused::invalid("Reducescatter does not support scalar inputs"));
                    }
                }
                _ => {}
            }
            requests.push(request);
        }
        // the duplicate check, before any of the group is queued: upstream
        // queues those before the first duplicate, whose memory nothing
        // would then keep alive here (the caller gets no handle)
        let table_name =
            |t: &Submit| if t.kind == RequestType::Join { JOIN_TENSOR_NAME.to_string() } else { t.name.clone() };
        let mut names = HashSet::with_capacity(tensors.len());
        for t in &tensors {
            let name = table_name(t);
            if self.table.contains_key(&name) || self.is_held(&name) || !names.insert(name) {
                return Err(Refused::invalid(DUPLICATE_NAME));
            }
        }
        let handle = Handle::new(tensors.len());
        self.hold(names, &handle);
        for (index, (t, request)) in tensors.into_iter().zip(requests).enumerate() {
            let name = table_name(&t);
            let mut submit = t;
            if let RequestType::Reducescatter = submit.kind {
                submit.reduce_op = request.reduce_op;
                submit.postscale = request.postscale;
            }
            if submit.kind == RequestType::Broadcast {
                submit.root_rank = i64::from(request.root_rank);
            }
            if submit.kind == RequestType::Join {
                self.joined = true;
            }
            let mut request = request;
            request.name = name.clone();
            let submitted_ns = if kolo_timeline::recording() { kolo_timeline::now_ns() } else { 0 };
            self.table.insert(name, Entry { submit, handle: handle.clone(), index, submitted_ns, traced: None });
            self.queue.push_back(request);
        }
        Ok(handle)
    }
}

/// "Allreduce", "Allgather", ...: how upstream's submission errors name ops.
pub(crate) fn op_title(kind: RequestType) -> &'static str {
    match kind {
        RequestType::Allreduce | RequestType::Adasum => "Allreduce",
        RequestType::Allgather => "Allgather",
        RequestType::Broadcast => "Broadcast",
        RequestType::Alltoall => "Alltoall",
        RequestType::Reducescatter => "Reducescatter",
        RequestType::Barrier => "Barrier",
        RequestType::Join => "Join",
        RequestType::AddProcessSet | RequestType::RemoveProcessSet => "Process set",
    }
}

/// What Adasum can combine: floats (upstream fails on others as it runs
/// them), over a power-of-two number of ranks (upstream's front ends
/// refuse others).
fn check_adasum(t: &Submit, set_size: usize) -> Result<(), Refused> {
    if !matches!(t.dtype, DataType::Float16 | DataType::Float32 | DataType::Float64) {
        return Err(Refused::invalid(format!(
            "Adasum combines float16, float32 and float64 tensors only; {} is {}: reduce it with op=Sum or Average",
            t.name,
            t.dtype.name()
        )));
    }
    if !set_size.is_power_of_two() {
        return Err(Refused::invalid(format!(
            "Running Adasum with non-power of 2 ranks is not supported yet: this process set has {set_size} ranks; \
             run on a power-of-two number of ranks (such as {}) or use op=Average",
            1usize << set_size.max(1).ilog2()
        )));
    }
    Ok(())
}

fn check_splits(t: &Submit, set_size: usize) -> Result<(), Refused> {
    let dim0 = t.shape.first().copied().unwrap_or(0);
    if t.splits.is_empty() {
        if set_size == 0 || dim0 % set_size as i64 != 0 {
            return Err(Refused::invalid(
                "splits not provided, but first dimension of tensor is not an even multiple of the number of workers.",
            ));
        }
        return Ok(());
    }
    if t.splits.len() != set_size {
        return Err(Refused::invalid("Number of entries in splits does not equal number of workers."));
    }
    if t.splits.iter().sum::<i64>() > dim0 {
        return Err(Refused::invalid("Sum of splits entries is greater than the first dimension of tensor."));
    }
    Ok(())
}

/// Fails everything pending with `failure` and marks the core stopped;
/// after a shutdown every rank agreed on (`shut_down_by`: who asked, and
/// why) each pending tensor's error names it too.
pub(crate) fn fail_all(shared: &Shared, failure: Failure, shut_down_by: Option<&Stopping>) {
    let entries: Vec<Entry> = {
        let mut state = shared.lock();
        if state.stopped.is_none() {
            state.stopped = Some(failure.clone());
            state.restartable = shut_down_by.is_some_and(|s| !s.exiting);
        }
        state
            .sets
            .values_mut()
            .flat_map(|s| {
                s.queue.clear();
                s.table.drain().map(|(_, e)| e)
            })
            .collect()
    };
    for entry in entries {
        let failure = match shut_down_by {
            Some(by) => Failure::internal(format!(
                "{SHUT_DOWN} (kolo: shut down by {} while {} was pending here.)",
                by.reason, entry.submit.name
            )),
            None => failure.clone(),
        };
        entry.finish(Err(failure));
    }
}
