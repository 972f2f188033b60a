//! The core with real communicators: ranks as threads of this process,
//! meeting on a real rendezvous store, talking over shared memory.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kolo_comm::{Communicator, Config, Secret};
use kolo_horovod::{Buffer, Core, DataType, FailureKind, Handle, ReduceOp, RequestType, Settings, Submit};
use kolo_rendezvous::{RendezvousServer, ServerConfig};

struct Job {
    server: RendezvousServer,
    // after the server, which stops with it
    _runtime: tokio::runtime::Runtime,
}

impl Job {
    fn new() -> Job {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let server =
            runtime.block_on(RendezvousServer::start(ServerConfig::new("127.0.0.1:0".parse().unwrap()), &[])).unwrap();
        Job { server, _runtime: runtime }
    }

    /// Runs `f` as each of `n` ranks (a thread each, with its own core);
    /// the results in rank order.
    fn run<R: Send + 'static>(
        &self,
        n: usize,
        settings: Settings,
        sets: Vec<Vec<i64>>,
        f: impl Fn(usize, &Core) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        let job = format!("job-{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let f = Arc::new(f);
        let threads: Vec<_> = (0..n)
            .map(|r| {
                let config =
                    Config::new(r, n, "this-host", self.server.addr().to_string(), Secret::new("s").unwrap(), &job)
                        .unwrap()
                        .with_timeout(Duration::from_secs(20));
                let (f, settings, sets) = (f.clone(), settings.clone(), sets.clone());
                std::thread::spawn(move || {
                    let comm = Communicator::connect(config).unwrap();
                    let core = Core::start(comm, settings, &sets).unwrap();
                    let result = f(r, &core);
                    core.shutdown();
                    // every rank's loop ended with the shutdown every rank
                    // agreed on, not with a peer that stopped cycling first
                    let stopped = core.stopped().expect("stopped").message;
                    assert!(stopped.starts_with(kolo_horovod::SHUT_DOWN), "rank {r}: {stopped}");
                    result
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }
}

static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn settings() -> Settings {
    Settings { dynamic_sets: true, ..Settings::default() }
}

fn buf<T>(v: &mut [T]) -> Buffer {
    Buffer::new(v.as_mut_ptr() as usize, std::mem::size_of_val(v))
}

fn allreduce_submit(name: &str, v: &mut [f32], op: ReduceOp) -> Submit {
    let mut s = Submit::new(RequestType::Allreduce, name, DataType::Float32, vec![v.len() as i64], buf(v));
    s.reduce_op = op;
    s
}

fn wait(handle: &Handle) {
    assert!(handle.wait_for(Duration::from_secs(30)), "the handle never completed");
}

/// Submits and waits; the error's text if it failed.
fn allreduce(core: &Core, set: u32, name: &str, v: &mut [f32], op: ReduceOp) -> Result<(), String> {
    outcome(core, set, allreduce_submit(name, v, op))
}

/// Submits one tensor to `set` and waits; the error's text if it failed.
fn outcome(core: &Core, set: u32, submit: Submit) -> Result<(), String> {
    let handle = core.submit(set, vec![submit]).map_err(|e| e.message)?;
    wait(&handle);
    handle.outcomes().unwrap().remove(0).map(drop).map_err(|f| f.message)
}

#[test]
fn named_tensors_submitted_in_different_orders_and_sizes_meet_by_name_and_a_steady_loop_stays_off_the_coordinator() {
    let job = Job::new();
    let results = job.run(3, settings(), vec![], |rank, core| {
        let names = ["a", "b", "c"];
        let sizes = [10usize, 1000, 3];
        let mut sent_after_warmup = 0;
        for step in 0..30 {
            // each rank submits the names in its own order
            let order: Vec<usize> = (0..3).map(|i| (i + rank) % 3).collect();
            let mut data: Vec<Vec<f32>> =
                sizes.iter().map(|&n| vec![(rank + 1) as f32 * (step + 1) as f32; n]).collect();
            let handles: Vec<_> = order
                .iter()
                .map(|&i| {
                    let name = format!("allreduce.{}", names[i]);
                    core.submit(0, vec![allreduce_submit(&name, &mut data[i], ReduceOp::Sum)]).unwrap()
                })
                .collect();
            for h in &handles {
                wait(h);
                assert!(h.outcomes().unwrap()[0].is_ok());
            }
            for (i, d) in data.iter().enumerate() {
                let want = 6.0 * (step + 1) as f32;
                assert!(d.iter().all(|&x| x == want), "step {step} {}: {} != {want}", names[i], d[0]);
            }
            if step == 9 {
                sent_after_warmup = core.stats().requests_sent;
            }
        }
        core.stats().requests_sent - sent_after_warmup
    });
    // cached: the last 20 steps sent nothing to the coordinator
    assert_eq!(results, vec![0, 0, 0]);
}

#[test]
fn a_quiet_job_cycles_less_often_and_the_first_submission_after_it_is_served() {
    let job = Job::new();
    let results = job.run(2, settings(), vec![], |rank, core| {
        // past the quiet threshold, ten cycles take at least ten slow
        // waits: a lower bound, which a loaded machine cannot break
        wait_until(|| core.stats().cycles >= 30);
        let (before, since) = (core.stats().cycles, Instant::now());
        wait_until(|| core.stats().cycles >= before + 10);
        let quiet = since.elapsed();
        let mut v = vec![rank as f32 + 1.0; 100];
        allreduce(core, 0, "after.quiet", &mut v, ReduceOp::Sum).unwrap();
        assert!(v.iter().all(|&x| x == 3.0));
        quiet
    });
    for (rank, quiet) in results.iter().enumerate() {
        // the default cycle is 1 ms: ten of them would take 10 ms
        assert!(*quiet >= Duration::from_millis(50), "rank {rank}: ten quiet cycles in {quiet:?}");
    }
}

#[test]
fn a_mismatch_fails_alike_on_every_rank_and_the_next_collective_succeeds() {
    let job = Job::new();
    let results = job.run(3, settings(), vec![], |rank, core| {
        let mut v = vec![1.0f32; if rank == 1 { 3 } else { 4 }];
        let failed = allreduce(core, 0, "allreduce.x", &mut v, ReduceOp::Sum).unwrap_err();
        let mut ok = vec![rank as f32; 5];
        allreduce(core, 0, "allreduce.y", &mut ok, ReduceOp::Max).unwrap();
        // and the mismatched name is free again
        let mut again = vec![1.0f32; 4];
        allreduce(core, 0, "allreduce.x", &mut again, ReduceOp::Sum).unwrap();
        (failed, ok[0], again[0])
    });
    // upstream's message names first the shape of the request the
    // coordinator saw first: either rank may be first on a busy machine
    let message = |a, b| {
        format!("Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [{a}], but another rank sent a tensor of shape [{b}].")
    };
    let first = results[0].0.clone();
    assert!(first == message(4, 3) || first == message(3, 4), "{first}");
    for (failed, max, sum) in results {
        assert_eq!(failed, first, "every rank gets the same error");
        assert_eq!((max, sum), (2.0, 3.0));
    }
}

#[test]
fn int8_reduces_and_a_type_the_loop_cannot_reduce_is_refused_when_submitted_not_in_the_loop() {
    let job = Job::new();
    let results = job.run(2, settings(), vec![], |rank, core| {
        let mut v = vec![-3i8 + rank as i8; 4];
        let len = v.len();
        let mut s = Submit::new(RequestType::Allreduce, "allreduce.i8", DataType::Int8, vec![4], buf(&mut v));
        s.reduce_op = ReduceOp::Sum;
        outcome(core, 0, s).unwrap();
        let mut flags = vec![1u8; 4];
        let refused = core
            .submit(
                0,
                vec![Submit::new(RequestType::Allreduce, "allreduce.bool", DataType::Bool, vec![4], buf(&mut flags))],
            )
            .unwrap_err();
        // the loop goes on
        let mut ok = vec![1.0f32; 2];
        allreduce(core, 0, "allreduce.after", &mut ok, ReduceOp::Sum).unwrap();
        (v[..len].to_vec(), refused.message, ok[0])
    });
    for (summed, refused, after) in results {
        assert_eq!(summed, vec![-5i8; 4]);
        assert_eq!(refused, "Tensor type bool is not supported.");
        assert_eq!(after, 2.0);
    }
}

#[test]
fn a_name_in_flight_is_refused_as_a_duplicate_and_free_once_done() {
    let job = Job::new();
    let results = job.run(2, settings(), vec![], |rank, core| {
        let mut v = vec![1.0f32; 4];
        let mut w = vec![1.0f32; 4];
        let mut refused = None;
        if rank == 0 {
            let first = core.submit(0, vec![allreduce_submit("allreduce.d", &mut v, ReduceOp::Sum)]).unwrap();
            let second = core.submit(0, vec![allreduce_submit("allreduce.d", &mut w, ReduceOp::Sum)]).unwrap_err();
            refused = Some((second.kind, second.message));
            DUPLICATE_TRIED.store(true, Ordering::SeqCst);
            wait(&first);
        } else {
            // rank 1 comes once rank 0 tried: its first was in flight meanwhile
            wait_until(|| DUPLICATE_TRIED.load(Ordering::SeqCst));
            allreduce(core, 0, "allreduce.d", &mut v, ReduceOp::Sum).unwrap();
        }
        (refused, v[0])
    });
    assert_eq!(results[0].0, Some((FailureKind::Invalid, kolo_horovod::DUPLICATE_NAME.to_string())));
    assert_eq!((results[0].1, results[1].1), (2.0, 2.0));
}

#[test]
fn a_name_stays_taken_until_its_handle_is_seen_done_even_when_its_collective_already_ran() {
    // the fast case upstream's cycle timer never shows: the peer's
    // submission is already with the coordinator, so the op runs at once
    let job = Job::new();
    let results = job.run(2, settings(), vec![], |rank, core| {
        let (mut d, mut again, mut sync, mut after) = (vec![1.0f32; 4], vec![1.0f32; 4], vec![0.0f32; 1], [0.0f32; 1]);
        if rank == 1 {
            let first = core.submit(0, vec![allreduce_submit("allreduce.d", &mut d, ReduceOp::Sum)]).unwrap();
            // queued after "d": once it is done, the coordinator has "d"
            allreduce(core, 0, "allreduce.sync", &mut sync, ReduceOp::Sum).unwrap();
            wait(&first);
            allreduce(core, 0, "allreduce.after", &mut after, ReduceOp::Sum).unwrap();
            wait_until(|| RESUBMITTED.load(Ordering::SeqCst));
            allreduce(core, 0, "allreduce.d", &mut again, ReduceOp::Sum).unwrap();
            return (None, d[0]);
        }
        allreduce(core, 0, "allreduce.sync", &mut sync, ReduceOp::Sum).unwrap();
        let first = core.submit(0, vec![allreduce_submit("allreduce.d", &mut d, ReduceOp::Sum)]).unwrap();
        // responses run in order: once "after" is done here, so is "d"
        allreduce(core, 0, "allreduce.after", &mut after, ReduceOp::Sum).unwrap();
        let refused = core.submit(0, vec![allreduce_submit("allreduce.d", &mut again, ReduceOp::Sum)]).unwrap_err();
        // seen done, the name is free
        assert!(first.is_done());
        let second = core.submit(0, vec![allreduce_submit("allreduce.d", &mut again, ReduceOp::Sum)]).unwrap();
        RESUBMITTED.store(true, Ordering::SeqCst);
        wait(&second);
        (Some((refused.kind, refused.message)), d[0])
    });
    assert_eq!(results[0].0, Some((FailureKind::Invalid, kolo_horovod::DUPLICATE_NAME.to_string())));
    assert_eq!((results[0].1, results[1].1), (2.0, 2.0));
}

#[test]
fn a_dropped_handle_frees_its_names() {
    let job = Job::new();
    let results = job.run(2, settings(), vec![], |_, core| {
        let mut v = vec![1.0f32; 4];
        let handle = core.submit(0, vec![allreduce_submit("allreduce.dropped", &mut v, ReduceOp::Sum)]).unwrap();
        let mut after = [0.0f32; 1];
        allreduce(core, 0, "allreduce.after", &mut after, ReduceOp::Sum).unwrap();
        drop(handle);
        allreduce(core, 0, "allreduce.dropped", &mut v, ReduceOp::Sum).map(|_| v[0])
    });
    assert_eq!(results, vec![Ok(4.0), Ok(4.0)]);
}

#[test]
fn a_tensor_one_rank_leaves_unmatched_stalls_alone_while_every_other_collective_runs() {
    let job = Job::new();
    let mut s = settings();
    s.stall.warning = Duration::from_secs(1);
    let results = job.run(2, s, vec![], |rank, core| {
        // a failed step on rank 1 left this behind; its memory stays valid
        // until the handle is done (it never runs)
        let orphan = (rank == 1).then(|| {
            let memory: &'static mut [f32] = Box::leak(vec![1.0f32; 4].into_boxed_slice());
            core.submit(0, vec![allreduce_submit("allreduce.orphan", memory, ReduceOp::Sum)]).unwrap()
        });
        let mut sums = Vec::new();
        let mut step = 0;
        // the other collectives go on, before the warning and after it
        loop {
            let mut v = vec![(rank + 1) as f32; 8];
            allreduce(core, 0, &format!("allreduce.step{step}"), &mut v, ReduceOp::Sum).unwrap();
            sums.push(v[0]);
            step += 1;
            let warned = if rank == 0 { core.stats().stall.is_some() } else { STALL_WARNED.load(Ordering::SeqCst) };
            if rank == 0 && warned {
                STALL_WARNED.store(true, Ordering::SeqCst);
            }
            // rank 0 decides when to stop: a step both ranks take
            let mut more = [f32::from(!warned || step < 3)];
            allreduce(core, 0, &format!("allreduce.more{step}"), &mut more, ReduceOp::Max).unwrap();
            if more[0] == 0.0 {
                break;
            }
        }
        (sums, core.stats().stall, orphan)
    });
    for (rank, (sums, _, _)) in results.iter().enumerate() {
        assert!(sums.iter().all(|&x| x == 3.0), "rank {rank}: {sums:?}");
    }
    let warning = results[0].1.clone().expect("rank 0 warned");
    assert!(warning.ends_with("Missing ranks:\n0: [allreduce.orphan]"), "{warning}");
    // the shutdown at the end fails it, naming who shut down
    let orphan = results[1].2.as_ref().unwrap();
    let failure = orphan.outcomes().unwrap().remove(0).unwrap_err();
    assert!(failure.message.starts_with(kolo_horovod::SHUT_DOWN), "{}", failure.message);
    // both ranks shut down at the end: one of them, or both, in one cycle
    assert!(failure.message.contains("(kolo: shut down by rank"), "{}", failure.message);
    assert!(
        failure.message.ends_with("(its core was shut down) while allreduce.orphan was pending here.)"),
        "{}",
        failure.message
    );
}

#[test]
fn a_stall_past_its_shutdown_time_stops_every_rank_naming_the_tensor_and_the_missing_rank() {
    let job = Job::new();
    let mut s = settings();
    s.stall.warning = Duration::from_secs(1);
    s.stall.shutdown = Duration::from_secs(2);
    let results = job.run(2, s, vec![], |rank, core| {
        let mut v = vec![1.0f32; 4];
        if rank == 1 {
            let handle = core.submit(0, vec![allreduce_submit("allreduce.alone", &mut v, ReduceOp::Sum)]).unwrap();
            wait(&handle);
            return handle.outcomes().unwrap().remove(0).unwrap_err().message;
        }
        wait_until(|| core.stopped().is_some());
        core.stopped().unwrap().message
    });
    for message in &results {
        assert!(message.starts_with(kolo_horovod::SHUT_DOWN), "{message}");
        assert!(message.contains("shut down by rank 0 (its stall inspector found tensors waiting past"), "{message}");
        assert!(message.contains("0!: [allreduce.alone]"), "{message}");
    }
}

static RESUBMITTED: AtomicBool = AtomicBool::new(false);
static STALL_WARNED: AtomicBool = AtomicBool::new(false);
static DUPLICATE_TRIED: AtomicBool = AtomicBool::new(false);
static STALL_SEEN: AtomicBool = AtomicBool::new(false);

fn wait_until(cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn join(core: &Core) -> i32 {
    let handle =
        core.submit(0, vec![Submit::new(RequestType::Join, "join", DataType::Uint8, vec![], Buffer::new(0, 0))]);
    let handle = handle.unwrap();
    wait(&handle);
    handle.outcomes().unwrap().remove(0).unwrap().last_joined_rank
}

#[test]
fn join_lets_ranks_with_more_data_go_on_against_zeros_and_every_rank_learns_the_last_to_join() {
    let job = Job::new();
    let results = job.run(3, settings(), vec![], |rank, core| {
        // rank r has r + 1 batches: the others contribute zeros once joined
        let mut sums = Vec::new();
        for step in 0..=rank {
            let mut v = vec![(rank + 1) as f32; 6];
            allreduce(core, 0, &format!("allreduce.step{step}"), &mut v, ReduceOp::Sum).unwrap();
            sums.push(v[0]);
        }
        (sums, join(core))
    });
    assert_eq!(results[0].0, vec![6.0]);
    assert_eq!(results[1].0, vec![6.0, 5.0]);
    assert_eq!(results[2].0, vec![6.0, 5.0, 3.0]);
    assert!(results.iter().all(|(_, last)| *last == 2), "{results:?}");
}

#[test]
fn process_sets_negotiate_among_their_members_only_and_come_and_go_alike() {
    let job = Job::new();
    let results = job.run(4, settings(), vec![vec![0, 2]], |rank, core| {
        let mut got = Vec::new();
        let mut v = vec![(rank + 1) as f32; 3];
        if rank % 2 == 0 {
            allreduce(core, 1, "allreduce.even", &mut v, ReduceOp::Sum).unwrap();
            got.push(v[0]);
        } else {
            let refused = core.submit(1, vec![allreduce_submit("allreduce.even", &mut v, ReduceOp::Sum)]).unwrap_err();
            assert_eq!(refused.message, format!("Allreduce: Rank {rank} is not a member of the provided process set."));
        }
        let unknown = core.submit(7, vec![allreduce_submit("x", &mut v, ReduceOp::Sum)]).unwrap_err();
        assert_eq!(unknown.message, "Allreduce: Process set provided does not exist, or has not been registered.");
        // every rank adds {1, 3}, then removes it
        let added = core.add_process_set(&[3, 1]).unwrap();
        wait(&added);
        let id = added.outcomes().unwrap()[0].clone().unwrap().dims[0] as u32;
        assert_eq!(core.process_set_ranks(id), Some(vec![1, 3]));
        if rank % 2 == 1 {
            let mut w = vec![(rank + 1) as f32; 2];
            allreduce(core, id, "allreduce.odd", &mut w, ReduceOp::Sum).unwrap();
            got.push(w[0]);
        }
        let removed = core.remove_process_set(id).unwrap().unwrap();
        wait(&removed);
        assert_eq!(core.process_set_ranks(id), None);
        assert!(core.remove_process_set(id).unwrap().is_none(), "an unknown set");
        (id, got)
    });
    assert_eq!(results[0], (2, vec![4.0]));
    assert_eq!(results[1], (2, vec![6.0]));
    assert_eq!(results[2], (2, vec![4.0]));
    assert_eq!(results[3], (2, vec![6.0]));
}

#[test]
fn the_stall_inspector_names_the_rank_that_has_not_submitted() {
    let job = Job::new();
    let mut s = settings();
    s.stall.warning = Duration::from_secs(1);
    let results = job.run(2, s, vec![], |rank, core| {
        let mut v = vec![1.0f32; 2];
        if rank == 0 {
            let h = core.submit(0, vec![allreduce_submit("allreduce.late", &mut v, ReduceOp::Sum)]).unwrap();
            wait_until(|| core.stats().stall.is_some());
            let stall = core.stats().stall;
            STALL_SEEN.store(true, Ordering::SeqCst);
            wait(&h);
            assert_eq!(v[0], 2.0);
            stall
        } else {
            // rank 1 submits once rank 0's coordinator has warned
            wait_until(|| STALL_SEEN.load(Ordering::SeqCst));
            allreduce(core, 0, "allreduce.late", &mut v, ReduceOp::Sum).unwrap();
            None
        }
    });
    let stall = results[0].clone().expect("rank 0 warned");
    assert!(stall.contains("Missing ranks:\n1: [allreduce.late]"), "{stall}");
}

#[test]
fn allgather_broadcast_alltoall_reducescatter_and_barrier_move_what_upstreams_do() {
    let job = Job::new();
    let results = job.run(3, settings(), vec![], |rank, core| {
        let r = rank as i32;
        // allgather: rank r has r + 1 rows of two values
        let mut rows: Vec<i32> = (0..(r + 1) * 2).map(|i| r * 100 + i).collect();
        let mut g = Submit::new(
            RequestType::Allgather,
            "allgather.g",
            DataType::Int32,
            vec![i64::from(r + 1), 2],
            buf(&mut rows),
        );
        g.device = kolo_horovod::CPU_DEVICE_ID;
        let h = core.submit(0, vec![g]).unwrap();
        wait(&h);
        let out = h.outcomes().unwrap().remove(0).unwrap();
        let gathered: Vec<i32> = bytemuck_ints(out.data.as_ref().unwrap());
        assert_eq!(out.dims, vec![6]);
        assert_eq!(gathered, vec![0, 1, 100, 101, 102, 103, 200, 201, 202, 203, 204, 205]);
        // broadcast from rank 1 (a global rank)
        let mut b = vec![r; 4];
        let mut bs = Submit::new(RequestType::Broadcast, "broadcast.b", DataType::Int32, vec![4], buf(&mut b));
        bs.root_rank = 1;
        let h = core.submit(0, vec![bs]).unwrap();
        wait(&h);
        assert!(h.outcomes().unwrap()[0].is_ok());
        assert_eq!(b, vec![1; 4]);
        // alltoall: rank r sends rows [r, r] to each rank d (d + 1 of them)
        let splits: Vec<i64> = vec![1, 2, 3];
        let mut send: Vec<i32> =
            splits.iter().enumerate().flat_map(|(d, &n)| vec![r * 10 + d as i32; n as usize]).collect();
        let mut a = Submit::new(RequestType::Alltoall, "alltoall.a", DataType::Int32, vec![6], buf(&mut send));
        a.splits = splits;
        let h = core.submit(0, vec![a]).unwrap();
        wait(&h);
        let out = h.outcomes().unwrap().remove(0).unwrap();
        assert_eq!(out.dims, vec![rank as i64 + 1; 3]);
        let got = bytemuck_ints(out.data.as_ref().unwrap());
        let want: Vec<i32> = (0..3).flat_map(|s| vec![s * 10 + r; rank + 1]).collect();
        assert_eq!(got, want);
        // reducescatter of 4 rows: ranks 0 gets 2, ranks 1 and 2 one each
        let mut input: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let mine = if rank == 0 { 2 } else { 1 };
        let mut output = vec![0f32; mine * 2];
        let mut rs =
            Submit::new(RequestType::Reducescatter, "reducescatter.r", DataType::Float32, vec![4, 2], buf(&mut input));
        rs.output = Some(buf(&mut output));
        rs.reduce_op = ReduceOp::Average;
        let h = core.submit(0, vec![rs]).unwrap();
        wait(&h);
        assert!(h.outcomes().unwrap()[0].is_ok());
        let start = [0, 4, 6][rank];
        let want: Vec<f32> = (start..start + mine * 2).map(|i| i as f32).collect();
        assert_eq!(output, want);
        // barrier
        let h = core
            .submit(0, vec![Submit::new(RequestType::Barrier, "barrier", DataType::Uint8, vec![], Buffer::new(0, 0))])
            .unwrap();
        wait(&h);
        assert!(h.outcomes().unwrap()[0].is_ok());
        true
    });
    assert_eq!(results, vec![true; 3]);
}

fn bytemuck_ints(bytes: &[u8]) -> Vec<i32> {
    bytes.chunks_exact(4).map(|c| i32::from_ne_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn a_group_of_small_reductions_runs_as_one_fused_collective() {
    let job = Job::new();
    let results = job.run(2, settings(), vec![], |rank, core| {
        let mut data: Vec<Vec<f32>> = (0..20).map(|i| vec![(rank + i) as f32; 16]).collect();
        let before = core.stats();
        let submits = data
            .iter_mut()
            .enumerate()
            .map(|(i, v)| allreduce_submit(&format!("allreduce.group.{i}"), v, ReduceOp::Average))
            .collect();
        let h = core.submit(0, submits).unwrap();
        wait(&h);
        assert!(h.outcomes().unwrap().iter().all(|o| o.is_ok()));
        for (i, v) in data.iter().enumerate() {
            assert_eq!(v[0], i as f32 + 0.5);
        }
        let after = core.stats();
        (after.responses - before.responses, after.tensors - before.tensors)
    });
    assert_eq!(results, vec![(1, 20); 2]);
}

#[test]
fn after_one_rank_shuts_down_the_others_pending_work_fails_with_upstreams_message() {
    let job = Job::new();
    let results = job.run(2, settings(), vec![], |rank, core| {
        if rank == 0 {
            core.shutdown();
            return None;
        }
        let mut v = vec![1.0f32; 2];
        match core.submit(0, vec![allreduce_submit("allreduce.never", &mut v, ReduceOp::Sum)]) {
            Err(refused) => Some(refused.message),
            Ok(h) => {
                wait(&h);
                Some(h.outcomes().unwrap()[0].clone().unwrap_err().message)
            }
        }
    });
    // upstream's text, then who stopped the job and why
    let message = results[1].clone().unwrap();
    assert!(message.starts_with(kolo_horovod::SHUT_DOWN), "{message}");
    assert!(message.contains("(kolo: shut down by rank 0 (its core was shut down)"), "{message}");
}

#[test]
fn a_shutdown_every_rank_agreed_on_may_be_followed_by_a_new_core_unless_a_rank_that_asked_is_exiting() {
    let job = Job::new();
    for exiting in [false, true] {
        let results = job.run(2, settings(), vec![], move |rank, core| {
            if rank == 0 {
                core.shutdown_because("its process is exiting", exiting);
            } else {
                wait_until(|| core.stopped().is_some());
            }
            (core.restartable(), core.stopped().unwrap().message)
        });
        for (rank, (restartable, message)) in results.iter().enumerate() {
            assert_eq!(*restartable, !exiting, "rank {rank}, exiting {exiting}: {message}");
            assert!(message.ends_with("(kolo: shut down by rank 0 (its process is exiting).)"), "{message}");
        }
    }
}

#[test]
fn a_stall_past_its_shutdown_time_in_a_process_set_stops_every_rank_of_the_job() {
    // rank 1 coordinates the set {1, 2}; rank 0, outside it, stops too
    let job = Job::new();
    let mut s = settings();
    s.stall.warning = Duration::from_secs(1);
    s.stall.shutdown = Duration::from_secs(2);
    let results = job.run(3, s, vec![vec![1, 2]], |rank, core| {
        if rank == 1 {
            let memory: &'static mut [f32] = Box::leak(vec![1.0f32; 4].into_boxed_slice());
            core.submit(1, vec![allreduce_submit("allreduce.in_set", memory, ReduceOp::Sum)]).unwrap();
        }
        wait_until(|| core.stopped().is_some());
        (core.restartable(), core.stopped().unwrap().message)
    });
    for (rank, (restartable, message)) in results.iter().enumerate() {
        assert!(restartable, "rank {rank}");
        assert!(message.contains("shut down by rank 1 (its stall inspector found tensors waiting past"), "{message}");
        assert!(message.contains("2!: [allreduce.in_set]"), "rank {rank}: {message}");
    }
}

fn allgather_submit(name: &str, rows: &mut [i32]) -> Submit {
    let mut g = Submit::new(RequestType::Allgather, name, DataType::Int32, vec![rows.len() as i64], buf(rows));
    g.device = kolo_horovod::CPU_DEVICE_ID;
    g
}

fn alltoall_submit(name: &str, send: &mut [i32]) -> Submit {
    let mut a = Submit::new(RequestType::Alltoall, name, DataType::Int32, vec![send.len() as i64], buf(send));
    a.splits = vec![1; send.len()];
    a
}

#[test]
fn cached_allgathers_and_alltoalls_beside_a_joined_rank_fail_with_upstreams_error_not_a_hang() {
    let job = Job::new();
    let results = job.run(2, settings(), vec![], |rank, core| {
        // in the response cache after the first of each
        for _ in 0..3 {
            outcome(core, 0, allgather_submit("allgather.cached", &mut [rank as i32; 2])).unwrap();
            outcome(core, 0, alltoall_submit("alltoall.cached", &mut [rank as i32; 2])).unwrap();
        }
        if rank == 1 {
            return (join(core), Vec::new());
        }
        let errors = vec![
            outcome(core, 0, allgather_submit("allgather.cached", &mut [0; 2])).unwrap_err(),
            outcome(core, 0, alltoall_submit("alltoall.cached", &mut [0; 2])).unwrap_err(),
        ];
        // and an allreduce still runs against the joined rank's zeros
        let mut v = vec![5.0f32; 3];
        allreduce(core, 0, "allreduce.beside", &mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, vec![5.0; 3]);
        (join(core), errors)
    });
    let errors = &results[0].1;
    assert!(errors[0].starts_with("Allgather is not supported with Join"), "{errors:?}");
    assert_eq!(errors[1], "Alltoall is not supported with Join at this time.");
    assert_eq!((results[0].0, results[1].0), (0, 0), "rank 0 joined last");
}

#[test]
fn a_set_removed_and_another_made_under_its_id_in_one_cycle_starts_alike_on_every_rank() {
    let job = Job::new();
    let results = job.run(3, settings(), vec![], |rank, core| {
        let first = core.add_process_set(&[0, 1]).unwrap();
        wait(&first);
        let id = first.outcomes().unwrap()[0].clone().unwrap().dims[0] as u32;
        // the loop runs a large allreduce while the removal and the new
        // set queue behind it: both go in the same cycle on every rank
        let mut busy = vec![1.0f32; 8 << 20];
        let busy = core.submit(0, vec![allreduce_submit("allreduce.busy", &mut busy, ReduceOp::Sum)]).unwrap();
        let removed = core.remove_process_set(id).unwrap().unwrap();
        let second = core.add_process_set(&[1, 2]).unwrap();
        for h in [&busy, &removed, &second] {
            wait(h);
        }
        let reused = second.outcomes().unwrap()[0].clone().unwrap().dims[0] as u32;
        let mut v = vec![rank as f32; 2];
        if rank > 0 {
            allreduce(core, reused, "allreduce.new", &mut v, ReduceOp::Sum).unwrap();
        }
        // rank 0 must not shut down (which ends the job for all, as
        // Horovod's does) before the others' last allreduce ran
        allreduce(core, 0, "allreduce.done", &mut [0.0; 1], ReduceOp::Sum).unwrap();
        (id, reused, v[0])
    });
    // the id was reused (else this test would not test the case)
    assert!(results.iter().all(|&(id, reused, _)| id == reused), "{results:?}");
    assert_eq!(results.iter().map(|r| r.2).collect::<Vec<_>>(), vec![0.0, 3.0, 3.0]);
}

#[test]
fn a_group_refused_for_a_name_in_flight_queues_none_of_its_tensors() {
    let job = Job::new();
    job.run(2, settings(), vec![], |rank, core| {
        let (mut x, mut y) = (vec![1.0f32; 4], vec![2.0f32; 4]);
        if rank == 0 {
            let x_handle = core.submit(0, vec![allreduce_submit("allreduce.x", &mut x, ReduceOp::Sum)]).unwrap();
            let mut y2 = vec![2.0f32; 4];
            let group = vec![
                allreduce_submit("allreduce.y", &mut y2, ReduceOp::Sum),
                allreduce_submit("allreduce.x", &mut x.clone(), ReduceOp::Sum),
            ];
            let refused = core.submit(0, group).unwrap_err();
            assert_eq!(refused.message, kolo_horovod::DUPLICATE_NAME);
            // y was not left queued by the refused group: it is free
            let y_handle = core.submit(0, vec![allreduce_submit("allreduce.y", &mut y, ReduceOp::Sum)]).unwrap();
            GROUP_REFUSED.store(true, Ordering::SeqCst);
            wait(&x_handle);
            wait(&y_handle);
        } else {
            wait_until(|| GROUP_REFUSED.load(Ordering::SeqCst));
            allreduce(core, 0, "allreduce.x", &mut x, ReduceOp::Sum).unwrap();
            allreduce(core, 0, "allreduce.y", &mut y, ReduceOp::Sum).unwrap();
        }
        assert_eq!((x[0], y[0]), (2.0, 4.0), "rank {rank}");
    });
}

static GROUP_REFUSED: AtomicBool = AtomicBool::new(false);

/// What a device executor was handed: each response's names and which of
/// them this rank submitted.
#[derive(Debug, Default)]
struct DeviceLog(std::sync::Mutex<Vec<(Vec<String>, Vec<bool>)>>);

impl kolo_horovod::DeviceExecutor for DeviceLog {
    fn execute(&self, work: &kolo_horovod::DeviceWork<'_>) -> Result<(), String> {
        let present = work.inputs.iter().map(Option::is_some).collect();
        self.0.lock().unwrap().push((work.response.names.clone(), present));
        Ok(())
    }
}

fn device_submit(name: &str, elements: i64) -> Submit {
    // memory the core must never touch: no host address at all
    let mut s = Submit::new(RequestType::Allreduce, name, DataType::Float32, vec![elements], Buffer::new(0, 0));
    s.device = 0;
    s
}

#[test]
fn device_tensors_go_to_the_device_executor_in_one_order_on_every_rank_a_joined_rank_without_its_own() {
    let job = Job::new();
    let results = job.run(3, settings(), vec![], |rank, core| {
        let log = Arc::new(DeviceLog::default());
        core.set_device_executor(Some(log.clone()));
        for step in 0..5 {
            // each rank submits the names in its own order
            let handles: Vec<_> = (0..4)
                .map(|i| {
                    let name = format!("allreduce.step{step}.{}", (i + rank) % 4);
                    core.submit(0, vec![device_submit(&name, 8)]).unwrap()
                })
                .collect();
            for h in &handles {
                wait(h);
                assert!(h.outcomes().unwrap()[0].is_ok());
            }
        }
        // rank 2 joins; the others' next device reduction runs on it too
        if rank == 2 {
            join(core);
        } else {
            outcome(core, 0, device_submit("allreduce.after-join", 8)).unwrap();
            join(core);
        }
        let handed = log.0.lock().unwrap().clone();
        handed
    });
    let names = |log: &[(Vec<String>, Vec<bool>)]| -> Vec<String> { log.iter().flat_map(|(n, _)| n.clone()).collect() };
    // every name once, in one order everywhere
    assert_eq!(names(&results[0]).len(), 21, "{:?}", results[0]);
    assert!(results.iter().all(|r| names(r) == names(&results[0])), "{results:?}");
    let last = |r: &[(Vec<String>, Vec<bool>)]| r.last().unwrap().clone();
    assert_eq!(last(&results[0]), (vec!["allreduce.after-join".to_string()], vec![true]));
    assert_eq!(last(&results[2]), (vec!["allreduce.after-join".to_string()], vec![false]));
}

#[test]
fn a_device_tensor_without_a_device_executor_fails_on_every_rank_and_the_next_collective_succeeds() {
    let job = Job::new();
    let results = job.run(2, settings(), vec![], |rank, core| {
        let refused = outcome(core, 0, device_submit("allreduce.on-a-gpu", 4));
        let mut v = vec![rank as f32 + 1.0; 4];
        allreduce(core, 0, "allreduce.next", &mut v, ReduceOp::Sum).unwrap();
        (refused, v[0])
    });
    for (refused, sum) in results {
        assert!(refused.unwrap_err().contains("nothing runs device collectives"));
        assert_eq!(sum, 3.0);
    }
}
