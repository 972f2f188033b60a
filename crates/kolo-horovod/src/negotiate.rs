//! The coordinator's side of a cycle (upstream's `Controller::
//! ComputeResponseList`, `IncrementTensorCount`, `ConstructResponse`):
//! it counts each name's requests across the set's ranks, and once every
//! rank (less those that joined) has submitted a name, decides what it
//! becomes: an operation every rank runs, or one error every rank raises,
//! with upstream's checks in upstream's order and its messages.

use std::collections::HashMap;
use std::time::Duration;

use crate::message::{
    double_text, shape_text, Request, RequestType, Response, ResponseType, CPU_DEVICE_ID, HOST_EXECUTOR_DEVICE_ID,
    JOIN_TENSOR_NAME,
};
use crate::stall::StallInspector;

/// The coordinator's memory of one process set, across cycles.
#[derive(Debug)]
pub struct Coordinator {
    /// Each set rank's global rank (what messages print).
    global_ranks: Vec<u32>,
    /// Requests per name, in the order they came; names in first-seen order.
    table: HashMap<String, Vec<Request>>,
    order: Vec<String>,
    joined_size: usize,
    last_joined_rank: i32,
    fusion_threshold: u64,
}

impl Coordinator {
    /// The coordinator of a set whose members have these global ranks (in
    /// set-rank order); fused responses stay under `fusion_threshold` bytes.
    pub fn new(global_ranks: Vec<u32>, fusion_threshold: u64) -> Coordinator {
        Coordinator {
            global_ranks,
            table: HashMap::new(),
            order: Vec::new(),
            joined_size: 0,
            last_joined_rank: -1,
            fusion_threshold,
        }
    }

    fn size(&self) -> usize {
        self.global_ranks.len()
    }

    /// How many ranks have joined since the last join response.
    pub fn joined_size(&self) -> usize {
        self.joined_size
    }

    /// Names some ranks submitted and others have not yet.
    pub fn pending(&self) -> usize {
        self.table.len()
    }

    /// One cycle's requests, `lists[r]` from set rank `r` in its queue's
    /// order: the responses for the names now ready, in the order every
    /// rank runs them (rank 0's requests first, then rank 1's, ...), then
    /// the join response once every rank joined. `all_joined_hits`: there
    /// are cached responses to run before these (upstream skips them once
    /// everyone joined; the caller puts them in front).
    pub fn on_cycle(&mut self, lists: &[Vec<Request>], stall: &mut StallInspector, now: Duration) -> Vec<Response> {
        let mut ready: Vec<String> = Vec::new();
        for (set_rank, list) in lists.iter().enumerate() {
            for request in list {
                if request.kind == RequestType::Join {
                    self.joined_size += 1;
                    self.last_joined_rank = self.global_ranks[set_rank] as i32;
                    continue;
                }
                stall.record_uncached(&request.name, request.rank, now);
                if self.count(request.clone()) {
                    ready.push(request.name.clone());
                }
            }
        }
        // names pending from earlier cycles that the joins made ready; and
        // what cannot run beside a joined rank fails at once for whoever
        // submitted it: it could only become ready once every rank had
        // joined, which a rank waiting in it never does (and unnamed ops
        // of ranks that took different branches before joining never meet)
        if self.joined_size > 0 {
            let needed = self.size() - self.joined_size;
            for name in &self.order {
                let requests = &self.table[name];
                let refused_beside_join = matches!(
                    requests[0].kind,
                    RequestType::Allgather
                        | RequestType::Alltoall
                        | RequestType::Broadcast
                        | RequestType::Reducescatter
                );
                if (requests.len() == needed || refused_beside_join) && !ready.contains(name) {
                    ready.push(name.clone());
                }
            }
        }
        let mut responses: Vec<Response> = ready.iter().map(|name| self.respond(name, stall)).collect();
        if self.joined_size == self.size() {
            let mut join = Response::new(ResponseType::Join, JOIN_TENSOR_NAME);
            join.last_joined_rank = self.last_joined_rank;
            responses.push(join);
            self.joined_size = 0;
            self.last_joined_rank = -1;
        }
        responses
    }

    /// Whether every rank still expected has now submitted the name.
    fn count(&mut self, request: Request) -> bool {
        let name = request.name.clone();
        let requests = match self.table.get_mut(&name) {
            Some(requests) => requests,
            None => {
                self.order.push(name.clone());
                self.table.entry(name.clone()).or_default()
            }
        };
        requests.push(request);
        requests.len() == self.size() - self.joined_size
    }

    fn respond(&mut self, name: &str, stall: &mut StallInspector) -> Response {
        let requests = self.table.remove(name).expect("a ready name is in the table");
        self.order.retain(|n| n != name);
        stall.remove_uncached(name);
        construct_response(name, &requests, self.joined_size, &self.global_ranks, self.fusion_threshold)
    }
}

/// Upstream's `ConstructResponse`: the first failing check becomes an
/// error every rank raises; otherwise what every rank does.
/// `requests[0]` is "one rank", the first mismatching one "another rank".
pub fn construct_response(
    name: &str,
    requests: &[Request],
    joined_size: usize,
    global_ranks: &[u32],
    fusion_threshold: u64,
) -> Response {
    let first = &requests[0];
    let kind = first.kind;
    let op = kind.name();
    let mut error: Option<String> = None;
    // the join and scalar checks append without looking for an earlier
    // error, as upstream's do: two messages can run together
    let append = |error: &mut Option<String>, text: String| match error {
        Some(e) => e.push_str(&text),
        None => *error = Some(text),
    };
    if let Some(other) = requests.iter().find(|r| r.dtype != first.dtype) {
        error = Some(format!(
            "Mismatched data types: One rank had type {}, but another rank had type {}.",
            first.dtype.name(),
            other.dtype.name()
        ));
    }
    if error.is_none() {
        if let Some(other) = requests.iter().find(|r| r.kind != kind) {
            error = Some(format!(
                "Mismatched operations: One rank did an {op}, but another rank did an {}.",
                other.kind.name()
            ));
        }
    }
    let reduces = matches!(kind, RequestType::Allreduce | RequestType::Adasum | RequestType::Reducescatter);
    if error.is_none() && (reduces || kind == RequestType::Broadcast) {
        if let Some(other) = requests.iter().find(|r| r.shape != first.shape) {
            error = Some(format!(
                "Mismatched {op} tensor shapes: One rank sent a tensor of shape {}, but another rank sent a tensor \
                 of shape {}.",
                shape_text(&first.shape),
                shape_text(&other.shape)
            ));
        }
    }
    if error.is_none() && reduces {
        if let Some(other) = requests.iter().find(|r| r.prescale != first.prescale || r.postscale != first.postscale) {
            error = Some(format!(
                "Mismatched prescale and/or postscale factors: One rank sent factors ({}, {}), but another rank sent \
                 factors ({}, {}).",
                double_text(first.prescale),
                double_text(first.postscale),
                double_text(other.prescale),
                double_text(other.postscale)
            ));
        }
    }
    if error.is_none() && kind == RequestType::Allreduce {
        if let Some(other) = requests.iter().find(|r| r.reduce_op != first.reduce_op) {
            error = Some(format!(
                "Mismatched reduction operation: One rank sent reduction op {}, but another rank sent reduction op {}.",
                first.reduce_op as i32, other.reduce_op as i32
            ));
        }
    }
    let set_size = global_ranks.len();
    let mut sizes: Vec<i64> = Vec::new();
    if matches!(kind, RequestType::Allgather | RequestType::Alltoall) {
        if joined_size > 0 {
            let text = match kind {
                RequestType::Allgather => {
                    "Allgather is not supported with Join at this time. Specify \
                                          sparse_to_dense=True if using DistributedOptimizer"
                }
                _ => "Alltoall is not supported with Join at this time.",
            };
            append(&mut error, text.to_string());
        }
        sizes = vec![0; set_size];
        if first.shape.is_empty() {
            append(&mut error, format!("Process-set rank zero tried to {op} a rank-zero tensor."));
        } else {
            sizes[first.rank as usize] = first.shape[0];
        }
        for other in &requests[1..] {
            if error.is_some() {
                break;
            }
            if other.shape.len() != first.shape.len() {
                error = Some(format!(
                    "Mismatched {op} tensor shapes: One rank sent a tensor of rank {}, but another rank sent a \
                     tensor of rank {}.",
                    first.shape.len(),
                    other.shape.len()
                ));
                break;
            }
            if let Some(dim) = (1..first.shape.len()).find(|&d| first.shape[d] != other.shape[d]) {
                error = Some(format!(
                    "Mismatched {op} tensor shapes: One rank sent a tensor with dimension {dim} equal to {}, but \
                     another rank sent a tensor with dimension {dim} equal to {}.",
                    first.shape[dim], other.shape[dim]
                ));
                break;
            }
            if kind == RequestType::Allgather {
                sizes[other.rank as usize] = other.shape[0];
            }
        }
    }
    if kind == RequestType::Reducescatter {
        if joined_size > 0 {
            append(&mut error, "Reducescatter is not supported with Join at this time.".into());
        }
        if first.shape.is_empty() {
            append(&mut error, format!("Process-set rank zero tried to {op} a rank-zero tensor."));
        } else {
            sizes.push(first.elements());
        }
        if first.prescale != 1.0 {
            let bytes = first.elements() as u64 * first.dtype.size() as u64;
            if bytes > fusion_threshold {
                append(
                    &mut error,
                    format!(
                        "Reducescatter with prescale_factor == {} != 1.0: The fusion buffer is not large enough to \
                         hold the input tensor ({bytes} bytes); increase HOROVOD_FUSION_THRESHOLD.",
                        double_text(first.prescale)
                    ),
                );
            }
        }
    }
    if matches!(kind, RequestType::Allreduce | RequestType::Adasum) {
        sizes.push(first.elements());
    }
    if kind == RequestType::Broadcast {
        if joined_size > 0 {
            append(&mut error, "Broadcast is not supported with Join at this time.".into());
        }
        if error.is_none() {
            if let Some(other) = requests.iter().find(|r| r.root_rank != first.root_rank) {
                let global = |r: u32| global_ranks.get(r as usize).map_or(r as i64, |&g| g as i64);
                error = Some(format!(
                    "Mismatched {op} root ranks: One rank specified root rank {}, but another rank specified root \
                     rank {}.",
                    global(first.root_rank),
                    global(other.root_rank)
                ));
            }
        }
    }
    if error.is_none() {
        let place = |r: &Request| match r.device {
            CPU_DEVICE_ID => "CPU",
            HOST_EXECUTOR_DEVICE_ID => "CPU (through the device executor)",
            _ => "GPU",
        };
        if let Some(other) = requests.iter().find(|r| place(r) != place(first)) {
            error = Some(format!(
                "Mismatched {op} CPU/GPU device selection: One rank specified device {}, but another rank specified \
                 device {}.",
                place(first),
                place(other)
            ));
        }
    }
    let mut devices = vec![CPU_DEVICE_ID; set_size];
    for r in requests {
        if let Some(d) = devices.get_mut(r.rank as usize) {
            *d = r.device;
        }
    }
    if error.is_none() && matches!(kind, RequestType::AddProcessSet | RequestType::RemoveProcessSet) {
        if requests.iter().any(|r| r.shape.len() != first.shape.len()) {
            error = Some("Attempted to register process set with mismatching size on different ranks".into());
        } else if requests.iter().any(|r| r.shape != first.shape) {
            error = Some("Attempted to register process set with mismatching values on different ranks".into());
        }
    }
    let mut response = match error {
        Some(message) => Response::error(name, message),
        None => {
            let mut response = Response::new(ResponseType::of(kind), name);
            if matches!(
                kind,
                RequestType::Allgather | RequestType::Allreduce | RequestType::Adasum | RequestType::Reducescatter
            ) {
                response.sizes = sizes;
            }
            if matches!(kind, RequestType::AddProcessSet | RequestType::RemoveProcessSet) {
                response.sizes = first.shape.clone();
            }
            response.dtype = first.dtype;
            if reduces {
                response.prescale = first.prescale;
                response.postscale = first.postscale;
            }
            if matches!(kind, RequestType::Allreduce | RequestType::Adasum) {
                response.reduce_op = first.reduce_op;
            }
            response
        }
    };
    response.devices = devices;
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{DataType, ReduceOp};
    use crate::stall::StallSettings;

    fn req(rank: u32, kind: RequestType, name: &str, shape: &[i64]) -> Request {
        Request::new(rank, kind, DataType::Float32, name, shape.to_vec())
    }

    fn respond(requests: &[Request]) -> Response {
        let size = requests.iter().map(|r| r.rank).max().unwrap() + 1;
        construct_response(&requests[0].name, requests, 0, &(0..size).collect::<Vec<_>>(), 1 << 27)
    }

    fn error_of(requests: &[Request]) -> String {
        let r = respond(requests);
        assert_eq!(r.kind, ResponseType::Error, "{r:?}");
        r.error
    }

    #[test]
    fn each_mismatch_gets_upstreams_message_and_the_first_failing_check_wins() {
        let a = req(0, RequestType::Allreduce, "x", &[17, 3]);
        let mut b = req(1, RequestType::Allreduce, "x", &[17, 3]);
        b.dtype = DataType::Int32;
        b.shape = vec![2];
        assert_eq!(
            error_of(&[a.clone(), b.clone()]),
            "Mismatched data types: One rank had type float32, but another rank had type int32."
        );
        b.dtype = DataType::Float32;
        assert_eq!(
            error_of(&[a.clone(), b.clone()]),
            "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [17, 3], but another rank sent a \
             tensor of shape [2]."
        );
        let mut c = req(1, RequestType::Allgather, "x", &[17, 3]);
        assert_eq!(
            error_of(&[a.clone(), c.clone()]),
            "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER."
        );
        c = a.clone();
        c.rank = 1;
        c.prescale = 0.5;
        assert_eq!(
            error_of(&[a.clone(), c.clone()]),
            "Mismatched prescale and/or postscale factors: One rank sent factors (1, 1), but another rank sent \
             factors (0.5, 1)."
        );
        c.prescale = 1.0;
        c.reduce_op = ReduceOp::Max;
        assert_eq!(
            error_of(&[a.clone(), c.clone()]),
            "Mismatched reduction operation: One rank sent reduction op 1, but another rank sent reduction op 4."
        );
        c.reduce_op = ReduceOp::Sum;
        c.device = 0;
        assert_eq!(
            error_of(&[a.clone(), c.clone()]),
            "Mismatched ALLREDUCE CPU/GPU device selection: One rank specified device CPU, but another rank \
             specified device GPU."
        );
        // host memory the device executor runs meets only its own kind:
        // two ranks would otherwise run one collective through two libraries
        let mut d = c.clone();
        d.device = HOST_EXECUTOR_DEVICE_ID;
        assert_eq!(
            error_of(&[c, d]),
            "Mismatched ALLREDUCE CPU/GPU device selection: One rank specified device GPU, but another rank \
             specified device CPU (through the device executor)."
        );
    }

    #[test]
    fn allgather_lets_the_first_dimension_differ_and_collects_it_per_rank() {
        let requests = [
            req(2, RequestType::Allgather, "g", &[5, 2]),
            req(0, RequestType::Allgather, "g", &[1, 2]),
            req(1, RequestType::Allgather, "g", &[3, 2]),
        ];
        let r = respond(&requests);
        assert_eq!(r.kind, ResponseType::Allgather);
        assert_eq!(r.sizes, vec![1, 3, 5]);
        let mut bad = requests.clone();
        bad[1].shape = vec![1, 4];
        assert_eq!(
            error_of(&bad),
            "Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 1 equal to 2, but another rank \
             sent a tensor with dimension 1 equal to 4."
        );
        bad[1].shape = vec![1, 2, 1];
        assert_eq!(
            error_of(&bad),
            "Mismatched ALLGATHER tensor shapes: One rank sent a tensor of rank 2, but another rank sent a tensor of \
             rank 3."
        );
        let scalar = [req(0, RequestType::Allgather, "s", &[]), req(1, RequestType::Allgather, "s", &[])];
        assert_eq!(error_of(&scalar), "Process-set rank zero tried to ALLGATHER a rank-zero tensor.");
    }

    #[test]
    fn broadcast_roots_are_compared_and_printed_as_global_ranks() {
        let mut a = req(0, RequestType::Broadcast, "b", &[4]);
        let mut b = req(1, RequestType::Broadcast, "b", &[4]);
        a.root_rank = 0;
        b.root_rank = 1;
        let r = construct_response("b", &[a, b], 0, &[3, 7], 1 << 27);
        assert_eq!(
            r.error,
            "Mismatched BROADCAST root ranks: One rank specified root rank 3, but another rank specified root rank 7."
        );
    }

    #[test]
    fn joined_ranks_refuse_everything_but_reductions_and_messages_may_run_together() {
        let requests = [req(0, RequestType::Allgather, "g", &[])];
        let r = construct_response("g", &requests, 1, &[0, 1], 1 << 27);
        assert_eq!(
            r.error,
            "Allgather is not supported with Join at this time. Specify sparse_to_dense=True if using \
             DistributedOptimizer\
             Process-set rank zero tried to ALLGATHER a rank-zero tensor."
        );
        let b = construct_response("b", &[req(0, RequestType::Broadcast, "b", &[2])], 1, &[0, 1], 1 << 27);
        assert_eq!(b.error, "Broadcast is not supported with Join at this time.");
        let s = construct_response("s", &[req(0, RequestType::Reducescatter, "s", &[4])], 1, &[0, 1], 1 << 27);
        assert_eq!(s.error, "Reducescatter is not supported with Join at this time.");
        let a = construct_response("a", &[req(0, RequestType::Allreduce, "a", &[4])], 1, &[0, 1], 1 << 27);
        assert_eq!((a.kind, a.sizes), (ResponseType::Allreduce, vec![4]));
    }

    #[test]
    fn beside_a_joined_rank_an_allgather_fails_for_each_rank_that_submits_it_whatever_its_name() {
        let mut c = Coordinator::new(vec![0, 1, 2], 1 << 27);
        let mut stall = StallInspector::new(StallSettings::default());
        let t = Duration::ZERO;
        let join = req(1, RequestType::Join, "", &[]);
        let got = c.on_cycle(&[vec![req(0, RequestType::Allgather, "g.5", &[2])], vec![join], vec![]], &mut stall, t);
        assert_eq!(got.len(), 1);
        assert!(got[0].error.starts_with("Allgather is not supported with Join"), "{:?}", got[0]);
        // rank 2's differs in name (it took another branch before): the same error
        let got = c.on_cycle(&[vec![], vec![], vec![req(2, RequestType::Allgather, "g.6", &[2])]], &mut stall, t);
        assert_eq!((got.len(), got[0].names[0].as_str()), (1, "g.6"));
        assert!(got[0].error.starts_with("Allgather is not supported with Join"), "{:?}", got[0]);
        // an allreduce still waits for the ranks that have not joined
        let got = c.on_cycle(&[vec![req(0, RequestType::Allreduce, "a", &[2])], vec![], vec![]], &mut stall, t);
        assert!(got.is_empty(), "{got:?}");
        assert_eq!(c.pending(), 1);
    }

    #[test]
    fn a_prescaled_reducescatter_must_fit_the_fusion_buffer() {
        let mut a = req(0, RequestType::Reducescatter, "r", &[1000]);
        a.prescale = 2.0;
        let r = construct_response("r", &[a], 0, &[0], 1000);
        assert_eq!(
            r.error,
            "Reducescatter with prescale_factor == 2 != 1.0: The fusion buffer is not large enough to hold the input \
             tensor (4000 bytes); increase HOROVOD_FUSION_THRESHOLD."
        );
    }

    #[test]
    fn the_coordinator_runs_names_once_every_rank_submitted_them_in_rank_zeros_order() {
        let mut c = Coordinator::new(vec![0, 1], 1 << 27);
        let mut stall = StallInspector::new(StallSettings::default());
        let t = Duration::ZERO;
        // rank 0 submits a then b; rank 1 only b: b is ready, a waits
        let got = c.on_cycle(
            &[
                vec![req(0, RequestType::Allreduce, "a", &[1]), req(0, RequestType::Allreduce, "b", &[1])],
                vec![req(1, RequestType::Allreduce, "b", &[1])],
            ],
            &mut stall,
            t,
        );
        assert_eq!(got.iter().map(|r| r.names[0].as_str()).collect::<Vec<_>>(), ["b"]);
        assert_eq!(c.pending(), 1);
        // rank 1's a comes a cycle later, with c first on rank 1's queue
        let got = c.on_cycle(
            &[
                vec![req(0, RequestType::Allreduce, "c", &[1])],
                vec![req(1, RequestType::Allreduce, "c", &[1]), req(1, RequestType::Allreduce, "a", &[1])],
            ],
            &mut stall,
            t,
        );
        assert_eq!(got.iter().map(|r| r.names[0].as_str()).collect::<Vec<_>>(), ["c", "a"]);
        assert!(stall.is_empty() && c.pending() == 0);
    }

    #[test]
    fn joins_release_what_the_others_submitted_and_end_with_the_last_joiner() {
        let mut c = Coordinator::new(vec![10, 11, 12], 1 << 27);
        let mut stall = StallInspector::new(StallSettings::default());
        let t = Duration::ZERO;
        let join = |r: u32| req(r, RequestType::Join, "", &[]);
        // ranks 0 and 1 reduce x; rank 2 joins: x runs without it
        let got = c.on_cycle(
            &[
                vec![req(0, RequestType::Allreduce, "x", &[2])],
                vec![req(1, RequestType::Allreduce, "x", &[2])],
                vec![join(2)],
            ],
            &mut stall,
            t,
        );
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].names, ["x"]);
        // rank 1 submits y, then ranks 0 and 1 join in one cycle: y runs,
        // then the join, naming the last rank scanned
        let got = c.on_cycle(
            &[vec![join(0)], vec![req(1, RequestType::Allreduce, "y", &[2]), join(1)], vec![]],
            &mut stall,
            t,
        );
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].names, ["y"]);
        assert_eq!((got[1].kind, got[1].last_joined_rank), (ResponseType::Join, 11));
        assert_eq!(c.joined_size(), 0);
    }
}
