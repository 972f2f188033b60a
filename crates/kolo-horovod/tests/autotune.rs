//! Autotune with real communicators: ranks as threads of this process,
//! meeting on a real rendezvous store. The parameters change as the
//! coordinator searches, every rank fuses alike all along (the sums stay
//! right and every rank runs the same collectives), and the log is
//! upstream's.

use std::sync::Arc;
use std::time::Duration;

use kolo_comm::{Communicator, Config, Secret};
use kolo_horovod::autotune::{AutotuneSettings, LOG_HEADER};
use kolo_horovod::{Buffer, Core, DataType, ReduceOp, RequestType, Settings, Stats, Submit};
use kolo_rendezvous::{RendezvousServer, ServerConfig};

static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Runs `f` as each of `n` ranks (a thread each, with its own core) on a
/// fresh rendezvous store; the results in rank order.
fn run<R: Send + 'static>(
    n: usize,
    settings: Settings,
    sets: Vec<Vec<i64>>,
    f: impl Fn(usize, &Core) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let server =
        runtime.block_on(RendezvousServer::start(ServerConfig::new("127.0.0.1:0".parse().unwrap()), &[])).unwrap();
    let job = format!("autotune-{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let f = Arc::new(f);
    let threads: Vec<_> = (0..n)
        .map(|r| {
            let config = Config::new(r, n, "this-host", server.addr().to_string(), Secret::new("s").unwrap(), &job)
                .unwrap()
                .with_timeout(Duration::from_secs(30));
            let (f, settings, sets) = (f.clone(), settings.clone(), sets.clone());
            std::thread::spawn(move || {
                let comm = Communicator::connect(config).unwrap();
                let core = Core::start(comm, settings, &sets).unwrap();
                let result = f(r, &core);
                core.shutdown();
                result
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Steps of eight 1 MiB allreduces into each of `sets` (id, member
/// ranks), each checked; this rank's counters after.
fn train(core: &Core, rank: usize, sets: &[(u32, &[usize])], steps: usize) -> Stats {
    for step in 0..steps {
        for &(set, members) in sets {
            let mut data: Vec<Vec<f32>> = (0..8).map(|_| vec![(rank + step) as f32; 1 << 18]).collect();
            let handles: Vec<_> = data
                .iter_mut()
                .enumerate()
                .map(|(i, d)| {
                    let buffer = Buffer::new(d.as_mut_ptr() as usize, d.len() * 4);
                    let name = format!("grad.{set}.{i}");
                    let mut s = Submit::new(RequestType::Allreduce, name, DataType::Float32, vec![1 << 18], buffer);
                    s.reduce_op = ReduceOp::Sum;
                    core.submit(set, vec![s]).unwrap()
                })
                .collect();
            for h in &handles {
                assert!(h.wait_for(Duration::from_secs(60)), "step {step} never completed");
                assert!(h.outcomes().unwrap()[0].is_ok());
            }
            let want: f32 = members.iter().map(|&r| (r + step) as f32).sum();
            for d in &data {
                assert!(d.iter().all(|&x| x == want), "set {set} step {step}: {} != {want}", d[0]);
            }
        }
    }
    core.stats()
}

fn tuning(log: &std::path::Path, fixed_fusion: bool) -> Settings {
    let autotune = AutotuneSettings {
        warmup_samples: 1,
        steps_per_sample: 2,
        max_samples: 5,
        log: Some(log.to_path_buf()),
        fixed_fusion,
        ..AutotuneSettings::default()
    };
    Settings { autotune: Some(autotune), dynamic_sets: true, ..Settings::default() }
}

fn rows(log: &std::path::Path) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(log).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(LOG_HEADER));
    lines.map(|l| l.split(',').map(|c| c.trim().to_string()).collect()).collect()
}

fn temp_log(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kolo-autotune-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("autotune.csv")
}

// a score takes 5 samples of 2 steps; 1 warm-up, 6 search, 1 cache, and a margin
const STEPS: usize = 10 * 9 + 20;

#[test]
fn the_coordinators_parameters_reach_every_rank_at_one_cycle_and_the_sums_stay_right() {
    let log = temp_log("agree");
    let stats = run(3, tuning(&log, false), vec![vec![1, 2]], |rank, core| {
        // the global set, and a set whose coordinator is not rank 0, alike
        let all: (u32, &[usize]) = (0, &[0, 1, 2]);
        let pair: (u32, &[usize]) = (1, &[1, 2]);
        let sets = if rank == 0 { vec![all] } else { vec![all, pair] };
        let stats = train(core, rank, &sets, STEPS);
        // rank 0 stays until the pair is done
        train(core, rank, &[all], 1);
        stats
    });
    // the pair ran the same collectives: fused alike in every cycle
    let ran = |s: &Stats| (s.responses, s.tensors);
    assert_eq!(ran(&stats[1]), ran(&stats[2]));
    let rows = rows(&log);
    // the search's six, the cache the other way, then the best
    assert_eq!(rows.len(), 6 + 1 + 1, "{rows:?}");
    for row in &rows {
        assert_eq!(row.len(), 7);
        assert_eq!(&row[..3], ["0", "0", "0"]);
        assert!(row[6].parse::<f64>().unwrap() > 0.0, "a score of bytes per microsecond: {row:?}");
    }
    // upstream's first test points, in order
    assert_eq!((&*rows[0][4], &*rows[0][5]), ("5", "4"));
    assert_eq!((&*rows[1][4], &*rows[1][5]), ("50", "32"));
    let thresholds: std::collections::HashSet<&str> = rows.iter().map(|r| &*r[5]).collect();
    assert!(thresholds.len() >= 4, "{rows:?}");
    // the last row is the best of those tried
    let best = rows.last().unwrap();
    let top =
        rows[..rows.len() - 1].iter().max_by(|a, b| a[6].parse::<f64>().unwrap().total_cmp(&b[6].parse().unwrap()));
    assert_eq!(&best[3..], &top.unwrap()[3..]);
}

#[test]
fn a_threshold_the_user_set_stays_in_every_row() {
    let log = temp_log("fixed");
    let settings = Settings { fusion_threshold: 2 << 20, ..tuning(&log, true) };
    run(2, settings, vec![], |rank, core| train(core, rank, &[(0, &[0, 1])], STEPS));
    let rows = rows(&log);
    assert_eq!(rows.len(), 8, "{rows:?}");
    assert!(rows.iter().all(|r| r[5] == "2"), "{rows:?}");
    let cycles: std::collections::HashSet<&str> = rows.iter().map(|r| &*r[4]).collect();
    assert!(cycles.len() >= 4, "the cycle time was still tuned: {rows:?}");
}
