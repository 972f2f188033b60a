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

fn config(server: &RendezvousServer, rank: usize, size: usize, secret: &str, job: &str) -> Config {
    Config::new(rank, size, "this-host", server.addr().to_string(), Secret::new(secret).unwrap(), job)
        .unwrap()
        .with_timeout(Duration::from_secs(3))
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

fn shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

#[test]
fn ranks_in_threads_reduce_over_shared_memory_and_tcp_leaving_nothing_in_dev_shm() {
    let (runtime, server) = store();
    let before = shm_entries();
    for (job, transport) in [("shm", Transport::Auto), ("tcp", Transport::Tcp)] {
        let configs = (0..3).map(|r| config(&server, r, 3, "s3cret", job).with_transport(transport)).collect();
        let sums = ranks(configs, |r, comm| {
            let mut comm = comm.unwrap();
            let mut v = vec![r as f32 + 1.0; 100_003];
            comm.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap();
            v[100_002]
        });
        assert_eq!(sums, vec![6.0; 3], "{job}");
    }
    let after = shm_entries();
    assert!(after.iter().all(|e| before.contains(e)), "new in /dev/shm: {after:?}");
    runtime.block_on(server.stop());
}

#[test]
fn a_rank_without_the_job_secret_gets_no_link() {
    let (runtime, server) = store();
    for (job, transport) in [("shm", Transport::Auto), ("tcp", Transport::Tcp)] {
        let configs = vec![
            config(&server, 0, 2, "right", job).with_transport(transport),
            config(&server, 1, 2, "wrong", job).with_transport(transport),
        ];
        let results = ranks(configs, |_, comm| comm.map(drop).map_err(|e| e.to_string()));
        // rank 0 dials and is refused; rank 1 waits for it in vain
        let e0 = results[0].clone().unwrap_err();
        assert!(e0.contains("link to rank 1") && e0.contains("job secret"), "{job}: rank 0: {e0}");
        let e1 = results[1].clone().unwrap_err();
        assert!(e1.contains("ranks [0] did not connect"), "{job}: rank 1: {e1}");
    }
    runtime.block_on(server.stop());
}

#[test]
fn collectives_of_two_communicators_in_different_orders_fail_naming_them() {
    let (runtime, server) = store();
    let configs = (0..2).map(|r| config(&server, r, 2, "s", "order")).collect();
    let errors = ranks(configs, |r, comm| {
        let mut world = comm.unwrap();
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
    runtime.block_on(server.stop());
}

#[test]
fn point_to_point_messages_pair_up_per_peer() {
    let (runtime, server) = store();
    let configs = (0..3).map(|r| config(&server, r, 3, "s", "p2p")).collect();
    let got = ranks(configs, |r, comm| {
        let mut comm = comm.unwrap();
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
    runtime.block_on(server.stop());
}

#[test]
fn a_communicator_comes_up_inside_async_code() {
    let (runtime, server) = store();
    let c = config(&server, 0, 1, "s", "async");
    // the old bootstrap built a tokio runtime of its own and panicked here
    let mut comm = runtime.block_on(async move { Communicator::connect(c) }).unwrap();
    let mut v = [3u8; 5];
    comm.allreduce_in_place(&mut v, ReduceOp::Avg).unwrap();
    assert_eq!(v, [3; 5]);
    runtime.block_on(server.stop());
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
