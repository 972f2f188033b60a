//! Ranks as threads of this process, against a real rendezvous store:
//! authentication of links, misuse detection, and bootstrapping from
//! inside async code, without starting worker processes.

use std::time::Duration;

use kolo_comm::Secret;
use kolo_comm::{CommError, Communicator, Config, ReduceOp, Transport};
use kolo_rendezvous::{RendezvousServer, ServerConfig};

fn store() -> (tokio::runtime::Runtime, RendezvousServer) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let server =
        runtime.block_on(RendezvousServer::start(ServerConfig::new("127.0.0.1:0".parse().unwrap()), &[])).unwrap();
    (runtime, server)
}

/// Runs `test` against a store of its own, then stops the store.
fn with_store(test: impl FnOnce(&tokio::runtime::Runtime, &RendezvousServer)) {
    let (runtime, server) = store();
    test(&runtime, &server);
    runtime.block_on(server.stop());
}

fn config(server: &RendezvousServer, rank: usize, size: usize, secret: &str, job: &str) -> Config {
    Config::new(rank, size, "this-host", server.addr().to_string(), Secret::new(secret).unwrap(), job)
        .unwrap()
        .with_timeout(Duration::from_secs(3))
}

/// The configs of the `size` ranks of `job`.
fn world(server: &RendezvousServer, size: usize, secret: &str, job: &str) -> Vec<Config> {
    (0..size).map(|r| config(server, r, size, secret, job)).collect()
}

/// [`world`], its links over `transport`.
fn world_over(transport: Transport, server: &RendezvousServer, size: usize, secret: &str, job: &str) -> Vec<Config> {
    world(server, size, secret, job).into_iter().map(|c| c.with_transport(transport)).collect()
}

/// Runs `f` as every rank, one thread each; the results in rank order.
fn ranks<R: Send + 'static>(
    configs: Vec<Config>,
    f: impl Fn(usize, Result<Communicator, CommError>) -> R + Send + Sync + Copy + 'static,
) -> Vec<R> {
    let threads: Vec<_> = configs
        .into_iter()
        .enumerate()
        .map(|(r, c)| std::thread::spawn(move || f(r, Communicator::connect(c))))
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// [`ranks`], each connected.
fn connected_ranks<R: Send + 'static>(
    configs: Vec<Config>,
    f: impl Fn(usize, Communicator) -> R + Send + Sync + Copy + 'static,
) -> Vec<R> {
    ranks(configs, move |r, comm| f(r, comm.unwrap()))
}

fn shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

#[test]
fn ranks_in_threads_reduce_over_shared_memory_and_tcp_leaving_nothing_in_dev_shm() {
    with_store(|_, server| {
        let before = shm_entries();
        for (job, transport) in [("shm", Transport::Auto), ("tcp", Transport::Tcp)] {
            let sums = connected_ranks(world_over(transport, server, 3, "s3cret", job), |r, mut comm| {
                let mut v = vec![r as f32 + 1.0; 100_003];
                comm.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap();
                v[100_002]
            });
            assert_eq!(sums, vec![6.0; 3], "{job}");
        }
        let after = shm_entries();
        assert!(after.iter().all(|e| before.contains(e)), "new in /dev/shm: {after:?}");
    });
}

#[test]
fn a_rank_without_the_job_secret_gets_no_link() {
    with_store(|_, server| {
        for (job, transport) in [("shm", Transport::Auto), ("tcp", Transport::Tcp)] {
            let configs = vec![
                config(server, 0, 2, "right", job).with_transport(transport),
                config(server, 1, 2, "wrong", job).with_transport(transport),
            ];
            let results = ranks(configs, |_, comm| comm.map(drop).map_err(|e| e.to_string()));
            // rank 0 dials and is refused; rank 1 waits for it in vain
            let e0 = results[0].clone().unwrap_err();
            assert!(e0.contains("link to rank 1") && e0.contains("job secret"), "{job}: rank 0: {e0}");
            let e1 = results[1].clone().unwrap_err();
            assert!(e1.contains("ranks [0] did not connect"), "{job}: rank 1: {e1}");
        }
    });
}

#[test]
fn collectives_of_two_communicators_in_different_orders_fail_naming_them() {
    with_store(|_, server| {
        let errors = connected_ranks(world(server, 2, "s", "order"), |r, mut world| {
            let mut pair = world.split(0, r as u32).unwrap();
            let mut a = vec![1i64; 64];
            let mut b = vec![2i64; 64];
            // rank 0: world then pair; rank 1: pair then world
            let (first, second) = if r == 0 { (&mut world, &mut pair) } else { (&mut pair, &mut world) };
            let one = first.allreduce_in_place(&mut a, ReduceOp::Sum);
            let two = second.allreduce_in_place(&mut b, ReduceOp::Sum);
            [one, two]
                .into_iter()
                .filter_map(Result::err)
                .map(|e| (matches!(e, CommError::Mismatch { .. }), e.to_string()))
                .collect::<Vec<_>>()
        });
        let all: Vec<&(bool, String)> = errors.iter().flatten().collect();
        assert!(!all.is_empty(), "calls in different orders went through");
        let mismatch = all.iter().find(|(m, _)| *m).unwrap_or_else(|| panic!("no mismatch reported: {all:?}"));
        let message = &mismatch.1;
        assert!(message.contains("'world'") && message.contains("split 0"), "{message}");
        assert!(message.contains("same order"), "{message}");
    });
}

#[test]
fn point_to_point_messages_pair_up_per_peer() {
    with_store(|_, server| {
        let got = connected_ranks(world(server, 3, "s", "p2p"), |r, mut comm| {
            // 0 and 2 each send twice to 1; 1 receives from 2 first
            let mut got = Vec::new();
            if r == 1 {
                for from in [2, 0, 2, 0] {
                    let mut v = [0i32; 3];
                    comm.recv(&mut v, from).unwrap();
                    got.push(v[0]);
                }
            } else {
                for i in 0..2 {
                    comm.send(&[(r * 10 + i) as i32; 3], 1).unwrap();
                }
            }
            comm.barrier().unwrap();
            got
        });
        assert_eq!(got[1], vec![20, 0, 21, 1]);
    });
}

#[test]
fn a_communicator_comes_up_inside_async_code() {
    with_store(|runtime, server| {
        let c = config(server, 0, 1, "s", "async");
        // the old bootstrap built a tokio runtime of its own and panicked here
        let mut comm = runtime.block_on(async move { Communicator::connect(c) }).unwrap();
        let mut v = [3u8; 5];
        comm.allreduce_in_place(&mut v, ReduceOp::Avg).unwrap();
        assert_eq!(v, [3; 5]);
    });
}

#[test]
fn a_missing_job_secret_is_an_error_not_an_empty_key() {
    // SAFETY (of the test): no other test of this binary reads these
    // variables, and nextest runs each test in its own process
    for (k, v) in [
        ("KOLO_RANK", "0"),
        ("KOLO_SIZE", "1"),
        ("KOLO_NODE_ID", "n"),
        ("KOLO_RENDEZVOUS_ADDR", "127.0.0.1"),
        ("KOLO_RENDEZVOUS_PORT", "1"),
    ] {
        std::env::set_var(k, v);
    }
    std::env::remove_var("KOLO_SECRET");
    let e = Config::from_env().unwrap_err();
    assert!(matches!(e, CommError::Secret(_)), "{e}");
    assert!(e.to_string().contains("KOLO_SECRET is not set"), "{e}");
    std::env::set_var("KOLO_SECRET", "");
    let e = Config::from_env().unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
    std::env::set_var("KOLO_SECRET", "x");
    let c = Config::from_env().unwrap();
    assert!(!format!("{c:?}").contains("secret: \"x\""));
}

mod elastic {
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use kolo_comm::elastic::{Elastic, State};
    use kolo_comm::{CommError, ReduceOp};
    use kolo_rendezvous::RendezvousServer;
    use kolo_topology::{host_assignments, parse_host_list, Slot};

    fn plan(hosts: &str) -> Vec<Slot> {
        let hosts = parse_host_list(hosts).unwrap();
        let np = kolo_topology::total_slots(&hosts);
        host_assignments(&hosts, np, Some(np)).unwrap()
    }

    /// A store (on a runtime of its own) whose job is at round 0 on
    /// `hosts`, to share with the members' threads.
    fn store_at_round_zero(hosts: &str) -> (tokio::runtime::Runtime, Arc<RendezvousServer>) {
        let (runtime, server) = super::store();
        server.set_round(0, &plan(hosts));
        (runtime, Arc::new(server))
    }

    /// A process named `host:0` of the job, from round `first` on; a
    /// collective that makes no progress would wait `timeout`.
    fn member(server: &RendezvousServer, host: &str, first: u64, timeout: Duration) -> Elastic {
        let base = super::config(server, 0, 1, "s3cret", "elastic").with_timeout(timeout);
        Elastic::new(base, format!("{host}:0"), first, Duration::from_secs(30)).unwrap()
    }

    #[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Progress {
        step: u64,
        /// Sum of every step's allreduce of ones: the world size at each step.
        total: f64,
    }

    /// Steps to `until`, each an allreduce of ones, committing every `every`
    /// steps; `at_step` runs after each step (a test's hook).
    fn train(
        state: &mut State<Progress>,
        comm: &mut kolo_comm::Communicator,
        until: u64,
        every: u64,
        errors: &Mutex<Vec<String>>,
        mut at_step: impl FnMut(u64) -> Result<(), CommError>,
    ) -> Result<Progress, CommError> {
        while state.step < until {
            let mut ones = [1.0f64];
            comm.allreduce_in_place(&mut ones, ReduceOp::Sum)
                .inspect_err(|e| errors.lock().unwrap().push(e.to_string()))?;
            state.total += ones[0];
            state.step += 1;
            if state.step.is_multiple_of(every) {
                state.commit()?;
            }
            at_step(state.step)?;
        }
        Ok(state.clone())
    }

    #[test]
    fn a_stuck_collective_ends_with_the_round_and_survivors_go_on_from_the_last_commit() {
        let (runtime, server) = store_at_round_zero("a,b,c");
        let errors = Arc::new(Mutex::new(Vec::new()));
        let (vanished_tx, vanished) = mpsc::channel();
        let (release_tx, release) = mpsc::channel::<()>();
        let release = Arc::new(Mutex::new(release));
        // a peer that stops answering keeps its sockets open: only the
        // driver's new round (not a closed link) can end the others' wait;
        // the collective timeout is far longer than the test may take
        let slow = Duration::from_secs(600);
        let survivors: Vec<_> = ["a", "b"]
            .into_iter()
            .map(|host| {
                let mut elastic = member(&server, host, 0, slow);
                let errors = errors.clone();
                std::thread::spawn(move || {
                    let mut state = State::new(Progress { step: 0, total: 0.0 });
                    let result = elastic.run(&mut state, |s, comm| train(s, comm, 50, 5, &errors, |_| Ok(())));
                    (result.unwrap(), elastic.round())
                })
            })
            .collect();
        let mut elastic = member(&server, "c", 0, slow);
        let lost = std::thread::spawn(move || {
            let mut state = State::new(Progress { step: 0, total: 0.0 });
            elastic.run(&mut state, |s, comm| {
                train(s, comm, 50, 5, &Mutex::new(Vec::new()), |step| {
                    if step == 22 {
                        vanished_tx.send(()).unwrap();
                        let _ = release.lock().unwrap().recv();
                        return Err(CommError::Timeout { seconds: 0.0, waiting: vec![] });
                    }
                    Ok(())
                })
            })
        });
        vanished.recv().unwrap();
        server.set_round(1, &plan("a,b"));
        for survivor in survivors {
            let (progress, round) = survivor.join().unwrap();
            // 20 committed steps of three, then 30 of two; steps 21 and 22 were lost
            assert_eq!(progress, Progress { step: 50, total: 20.0 * 3.0 + 30.0 * 2.0 });
            assert_eq!(round, Some(1));
        }
        let errors = errors.lock().unwrap().clone();
        assert!(
            errors.len() == 2 && errors.iter().all(|e| e.contains("interrupted: the job moved on to round 1")),
            "survivors' collectives ended by: {errors:?}"
        );
        release_tx.send(()).unwrap();
        match lost.join().unwrap() {
            Err(CommError::Removed { id, round }) => assert_eq!((id.as_str(), round), ("c:0", 1)),
            other => panic!("the removed process got {other:?}"),
        }
        runtime.block_on(Arc::try_unwrap(server).ok().unwrap().stop());
    }

    #[test]
    fn added_hosts_are_joined_at_a_commit_and_a_new_process_takes_the_state_of_those_that_committed() {
        let (runtime, server) = store_at_round_zero("a,b");
        let errors = Arc::new(Mutex::new(Vec::new()));
        let (reached_tx, reached) = mpsc::channel();
        let timeout = Duration::from_secs(20);
        let first: Vec<_> = ["a", "b"]
            .into_iter()
            .map(|host| {
                let mut elastic = member(&server, host, 0, timeout);
                let (errors, reached) = (errors.clone(), reached_tx.clone());
                std::thread::spawn(move || {
                    let mut state = State::new(Progress { step: 0, total: 0.0 });
                    let result = elastic.run(&mut state, |s, comm| {
                        train(s, comm, 100, 1, &errors, |step| {
                            if step == 10 {
                                let _ = reached.send(());
                            }
                            std::thread::sleep(Duration::from_millis(5));
                            Ok(())
                        })
                    });
                    (result.unwrap(), elastic.round())
                })
            })
            .collect();
        reached.recv().unwrap();
        // the driver started c for round 1, and publishes round 1 with it
        let mut elastic = member(&server, "c", 1, timeout);
        let joiner = std::thread::spawn(move || {
            let mut state = State::new(Progress { step: 0, total: 0.0 });
            let result = elastic.run(&mut state, |s, comm| {
                let joined_at = s.step;
                train(s, comm, 100, 1, &Mutex::new(Vec::new()), |_| Ok(())).map(|p| (p, joined_at))
            });
            result.unwrap()
        });
        // the new host first: its process is round 1's rank 0, yet the
        // state comes from the processes that committed (the sync rule)
        server.set_round(1, &plan("c,a,b"));
        let (progress, joined_at) = joiner.join().unwrap();
        // it started from the others' state, not from zero
        assert!(joined_at >= 10, "the new process started at step {joined_at}");
        assert_eq!(progress.step, 100);
        assert_eq!(progress.total, joined_at as f64 * 2.0 + (100 - joined_at) as f64 * 3.0);
        for member in first {
            assert_eq!(member.join().unwrap(), (progress.clone(), Some(1)));
        }
        // each member checks for a new round at its own commit: one that
        // has not seen it yet may be in a collective the round interrupts,
        // which ends at the same commit; no collective fails otherwise
        let errors = errors.lock().unwrap();
        assert!(errors.iter().all(|e| e == "interrupted: the job moved on to round 1"), "{errors:?}");
        runtime.block_on(Arc::try_unwrap(server).ok().unwrap().stop());
    }
}

#[test]
fn alltoall_gather_and_scatter_move_every_part_to_its_rank() {
    with_store(|_, server| {
        for (job, transport) in [("a2a-shm", Transport::Auto), ("a2a-tcp", Transport::Tcp)] {
            let results = connected_ranks(world_over(transport, server, 3, "s", job), |r, mut comm| {
                // rank r sends r+1+p elements of value 10r+p to rank p
                let send_counts: Vec<usize> = (0..3).map(|p| r + 1 + p).collect();
                let send: Vec<i64> =
                    (0..3).flat_map(|p| std::iter::repeat_n((10 * r + p) as i64, send_counts[p])).collect();
                let recv_counts: Vec<usize> = (0..3).map(|p| p + 1 + r).collect();
                let mut recv = vec![-1i64; recv_counts.iter().sum()];
                comm.alltoallv(&send, &send_counts, &mut recv, &recv_counts).unwrap();
                // gather: rank p's p+1 values of p, at rank 1
                let mine = vec![r as f32; r + 1];
                let mut gathered = vec![-1.0f32; if r == 1 { 6 } else { 0 }];
                comm.gatherv(&mine, &mut gathered, &[1, 2, 3], 1).unwrap();
                // scatter from rank 2: rank p gets p+1 values of 100+p
                let whole: Vec<u8> = if r == 2 { vec![100, 101, 101, 102, 102, 102] } else { vec![] };
                let mut part = vec![0u8; r + 1];
                comm.scatterv(&whole, &mut part, &[1, 2, 3], 2).unwrap();
                (recv, gathered, part)
            });
            for (r, (recv, gathered, part)) in results.into_iter().enumerate() {
                let expected: Vec<i64> =
                    (0..3).flat_map(|p| std::iter::repeat_n((10 * p + r) as i64, p + 1 + r)).collect();
                assert_eq!(recv, expected, "{job}: alltoall at rank {r}");
                if r == 1 {
                    assert_eq!(gathered, vec![0.0, 1.0, 1.0, 2.0, 2.0, 2.0], "{job}: gather");
                }
                assert_eq!(part, vec![100 + r as u8; r + 1], "{job}: scatter at rank {r}");
            }
        }
    });
}

#[test]
fn ranks_that_disagree_on_a_collectives_size_or_op_fail_naming_both() {
    with_store(|_, server| {
        let errors = connected_ranks(world(server, 2, "s", "disagree"), |r, mut comm| {
            let mut v = vec![1.0f32; 1000 + r * 24];
            comm.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap_err().to_string()
        });
        assert!(
            errors[0]
                .contains("rank 1 called allreduce(sum) of 1024 f32 while this rank called allreduce(sum) of 1000 f32"),
            "{}",
            errors[0]
        );
        assert!(errors[1].contains("rank 0 called allreduce(sum) of 1000 f32"), "{}", errors[1]);
        let errors = connected_ranks(world(server, 2, "s", "disagree-op"), |r, mut comm| {
            let mut v = vec![1i64; 8];
            let op = if r == 0 { ReduceOp::Max } else { ReduceOp::Min };
            comm.allreduce_in_place(&mut v, op).unwrap_err().to_string()
        });
        assert!(
            errors[0].contains("called allreduce(min) of 8 i64 while this rank called allreduce(max)"),
            "{}",
            errors[0]
        );

        // sizes that read peers' memory directly are checked the same way
        let errors = connected_ranks(world(server, 2, "s", "disagree-large"), |r, mut comm| {
            let mut v = vec![1.0f32; (1 << 20) + r];
            comm.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap_err().to_string()
        });
        assert!(
            errors[0].contains(
                "rank 1 called allreduce(sum) of 1048577 f32 while this rank called allreduce(sum) of 1048576 f32"
            ),
            "{}",
            errors[0]
        );
    });
}

/// A store the caller brings (torch.distributed's, in kolo's backend): here a map.
struct MapBook(std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>, std::sync::Condvar);

impl kolo_comm::AddressBook for MapBook {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), String> {
        self.0.lock().unwrap().insert(key.to_string(), value.to_vec());
        self.1.notify_all();
        Ok(())
    }
    fn wait(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>, String> {
        let map = self.0.lock().unwrap();
        let (map, _) = self.1.wait_timeout_while(map, timeout, |m| !m.contains_key(key)).unwrap();
        Ok(map.get(key).cloned())
    }
}

/// The configs of ranks `0..present` of `job` (`size` ranks), which
/// bootstrap through an address book of their own within `timeout`.
fn through_a_book(present: usize, size: usize, job: &str, timeout: Duration) -> Vec<Config> {
    let book = std::sync::Arc::new(MapBook(Default::default(), Default::default()));
    (0..present)
        .map(|r| {
            Config::new(r, size, "this-host", "unused:0", Secret::new("s").unwrap(), job)
                .unwrap()
                .with_timeout(timeout)
                .with_book(book.clone())
        })
        .collect()
}

#[test]
fn ranks_bootstrap_through_an_address_book_of_their_own_and_name_the_missing() {
    let configs = through_a_book(3, 3, "book", Duration::from_secs(3));
    let sums = ranks(configs, |r, comm| {
        let mut v = [r as i32 + 1];
        comm.unwrap().allreduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        v[0]
    });
    assert_eq!(sums, vec![6; 3]);

    // rank 2 never comes: rank 0 names it
    let configs = through_a_book(2, 3, "book-missing", Duration::from_millis(500));
    let errors = ranks(configs, |_, comm| comm.unwrap_err().to_string());
    assert!(errors[0].contains("ranks [2] did not show up"), "{}", errors[0]);
}

/// Makes the kernel refuse `process_vm_readv` to this thread, as a
/// container runtime's seccomp profile may.
fn refuse_reading_other_processes() {
    use libc::{sock_filter, sock_fprog};
    let stmt = |code: u32, k: u32| sock_filter { code: code as u16, jt: 0, jf: 0, k };
    let filter = [
        // the syscall number is the first field of seccomp_data
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
        sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: libc::SYS_process_vm_readv as u32,
        },
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
    ];
    let program = sock_fprog { len: filter.len() as u16, filter: filter.as_ptr() as *mut sock_filter };
    // SAFETY: plain prctl calls; the program outlives the call, which copies it
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &program as *const sock_fprog), 0);
    }
}

#[test]
fn large_allreduces_read_peers_directly_and_fall_back_to_the_rings_where_the_kernel_refuses() {
    with_store(|_, server| {
        // 1 MiB of f32 (past the direct size), odd so the parts are uneven, in
        // place and not, every op; a small call first (it never tries)
        let check = |r: usize, comm: &mut Communicator| -> Option<bool> {
            let mut small = vec![1i64; 10];
            comm.allreduce_in_place(&mut small, ReduceOp::Sum).unwrap();
            assert_eq!(comm.direct_reads(), None, "a small call tried direct reads");
            let len = (1 << 18) + 3;
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Prod] {
                let send: Vec<f32> = (0..len).map(|i| ((i + r) % 3) as f32 + 1.0).collect();
                let mut out = vec![0f32; len];
                comm.allreduce(&send, &mut out, op).unwrap();
                let mut inplace = send.clone();
                comm.allreduce_in_place(&mut inplace, op).unwrap();
                for i in (0..len).step_by(997).chain([len - 1]) {
                    let vals = (0..3).map(|q| ((i + q) % 3) as f32 + 1.0);
                    let want = match op {
                        ReduceOp::Sum => vals.sum(),
                        ReduceOp::Avg => vals.sum::<f32>() / 3.0,
                        ReduceOp::Max => vals.fold(f32::MIN, f32::max),
                        _ => vals.product(),
                    };
                    assert_eq!((out[i], inplace[i]), (want, want), "{op:?} element {i} on rank {r}");
                }
            }
            comm.direct_reads()
        };
        let reads = connected_ranks(world(server, 3, "s3cret", "direct"), move |r, mut comm| check(r, &mut comm));
        assert_eq!(reads, vec![Some(true); 3]);
        let reads = connected_ranks(world(server, 3, "s3cret", "refused"), move |r, mut comm| {
            if r == 1 {
                refuse_reading_other_processes();
            }
            check(r, &mut comm)
        });
        assert_eq!(reads, vec![Some(false); 3], "every rank must fall back when one cannot read");
        // and turned off: never tried
        let off = kolo_comm::Tuning { direct_bytes: None, ..Default::default() };
        let configs = world(server, 3, "s3cret", "off").into_iter().map(|c| c.with_tuning(off.clone())).collect();
        let reads = connected_ranks(configs, move |r, mut comm| check(r, &mut comm));
        assert_eq!(reads, vec![None; 3]);
    });
}
