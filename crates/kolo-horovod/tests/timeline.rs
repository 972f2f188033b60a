//! The timeline as rank 0's core writes it in a real job: ranks as threads
//! of this process, each with its own core, meeting on a real rendezvous
//! store.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kolo_comm::{Communicator, Config, Secret};
use kolo_horovod::{Buffer, Core, DataType, ReduceOp, RequestType, Settings, Submit, TimelineTarget};
use kolo_rendezvous::{RendezvousServer, ServerConfig};

fn run_job(n: usize, settings: Settings, f: impl Fn(usize, &Core) + Send + Sync + 'static) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let server =
        runtime.block_on(RendezvousServer::start(ServerConfig::new("127.0.0.1:0".parse().unwrap()), &[])).unwrap();
    let f = Arc::new(f);
    let threads: Vec<_> = (0..n)
        .map(|r| {
            let config = Config::new(r, n, "this-host", server.addr().to_string(), Secret::new("s").unwrap(), "tl")
                .unwrap()
                .with_timeout(Duration::from_secs(20));
            let (f, settings) = (f.clone(), settings.clone());
            std::thread::spawn(move || {
                let core = Core::start(Communicator::connect(config).unwrap(), settings, &[]).unwrap();
                f(r, &core);
                core.shutdown();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

fn allreduce(core: &Core, name: &str) {
    let mut v = vec![1.0f32; 4];
    let mut s =
        Submit::new(RequestType::Allreduce, name, DataType::Float32, vec![4], Buffer::new(v.as_mut_ptr() as usize, 16));
    s.reduce_op = ReduceOp::Sum;
    let handle = core.submit(0, vec![s]).unwrap();
    assert!(handle.wait_for(Duration::from_secs(30)));
    handle.outcomes().unwrap().remove(0).unwrap();
}

fn events(path: &Path) -> Vec<serde_json::Value> {
    // the file is whole JSON whenever it is read, the job running or not
    serde_json::from_str::<Vec<serde_json::Value>>(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `(phase, name)` of a tensor's events.
fn of_tensor(events: &[serde_json::Value], tensor: &str) -> Vec<(String, String)> {
    let pid = events.iter().find(|e| e["name"] == "process_name" && e["args"]["name"] == tensor).map(|e| &e["pid"]);
    let Some(pid) = pid else { return Vec::new() };
    events
        .iter()
        .filter(|e| &e["pid"] == pid && e["ph"] != "M")
        .map(|e| (e["ph"].as_str().unwrap().to_string(), e["name"].as_str().unwrap().to_string()))
        .collect()
}

fn temp_file(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kolo-tl-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("timeline.json")
}

#[test]
fn the_coordinator_marks_each_rank_ready_the_late_one_last_and_cached_names_negotiate_through_the_bits() {
    let path = temp_file("late");
    let settings = Settings {
        timeline: Some(TimelineTarget::File(path.clone())),
        timeline_mark_cycles: true,
        ..Settings::default()
    };
    let watched = path.clone();
    run_job(3, settings, move |rank, core| {
        if rank == 0 {
            // rank 0 comes last: once the others' requests are on its timeline
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let marks = of_tensor(&events(&watched), "allreduce.late");
                if marks.iter().filter(|(ph, _)| ph == "X").count() == 2 {
                    break;
                }
                assert!(Instant::now() < deadline, "the others' requests never showed: {marks:?}");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        allreduce(core, "allreduce.late");
        for _ in 0..3 {
            allreduce(core, "allreduce.steady");
        }
    });
    let events = events(&path);
    let late = of_tensor(&events, "allreduce.late");
    let marks: Vec<&str> = late.iter().filter(|(ph, _)| ph == "X").map(|(_, n)| n.as_str()).collect();
    assert_eq!(marks.len(), 3, "{late:?}");
    assert_eq!(marks[2], "0", "rank 0 came last: {late:?}");
    let names: Vec<&str> = late.iter().filter(|(ph, _)| ph == "B").map(|(_, n)| n.as_str()).collect();
    assert_eq!(names, ["NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE", "KOLO_ALLREDUCE"]);
    let steady = of_tensor(&events, "allreduce.steady");
    let negotiations = steady.iter().filter(|(ph, n)| ph == "B" && n == "NEGOTIATE_ALLREDUCE").count();
    assert_eq!(negotiations, 3, "{steady:?}");
    assert_eq!(steady.iter().filter(|(ph, n)| ph == "B" && n == "ALLREDUCE").count(), 3, "{steady:?}");
    assert!(events.iter().any(|e| e["name"] == "CYCLE_START"));
}

#[test]
fn without_a_timeline_setting_start_is_refused_with_upstreams_message_and_dynamic_waits_for_start() {
    let path = temp_file("dynamic");
    let started = path.clone();
    run_job(2, Settings::default(), |_, core| {
        let refused = core.start_timeline(Path::new("/tmp/never.json"), false).unwrap_err();
        assert_eq!(refused.message, "Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.");
    });
    let settings = Settings { timeline: Some(TimelineTarget::Dynamic), ..Settings::default() };
    run_job(2, settings, move |_, core| {
        allreduce(core, "allreduce.before");
        core.start_timeline(&started, false).unwrap();
        allreduce(core, "allreduce.during");
        core.stop_timeline();
        allreduce(core, "allreduce.after");
    });
    let events = events(&path);
    let tensors: Vec<&str> = events
        .iter()
        .filter(|e| e["name"] == "process_name" && e["pid"] != 0)
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(tensors, ["allreduce.during"]);
    // the op ended on the timeline before its caller saw it done and stopped it
    let during = of_tensor(&events, "allreduce.during");
    let count = |phase: &str| during.iter().filter(|(ph, _)| ph == phase).count();
    assert_eq!((count("B"), count("E")), (4, 4), "{during:?}");
}
