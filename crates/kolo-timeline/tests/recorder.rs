//! The recorder in a process of its own (it reads its file's name once):
//! only outermost collectives, nothing from a quiet thread, the caller's
//! submission time, a failure when dropped unfinished, a private file
//! readable while the process still holds it.

use std::os::unix::fs::PermissionsExt;

use kolo_timeline::{decode, Collective, Source, Span};

#[test]
fn what_a_rank_records_is_in_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("timeline");
    std::env::set_var(kolo_timeline::FILE_VAR, &path);
    assert!(kolo_timeline::recording());

    let outer = Collective::begin("allreduce", (7, 0), 64).unwrap();
    // a hierarchical allreduce's steps inside it are not recorded
    assert!(Collective::begin("broadcast", (8, 0), 64).is_none());
    outer.end(true);

    let submitted = kolo_timeline::now_ns() - 5_000_000;
    kolo_timeline::with_submitted_at(submitted, || Collective::begin("allgather", (7, 1), 32).unwrap().end(true));
    // dropped unfinished: an error unwound through it
    drop(Collective::begin("barrier", (7, 2), 0));
    std::thread::spawn(|| {
        kolo_timeline::quiet_on_this_thread();
        assert!(Collective::begin("allreduce", (9, 0), 1).is_none());
    })
    .join()
    .unwrap();
    let now = kolo_timeline::now_ns();
    kolo_timeline::record_span(&Span {
        source: Source::Horovod,
        op: "allreduce",
        name: "allreduce.grad.w",
        key: (0, 0),
        bytes: 16,
        submitted_ns: now,
        started_ns: now,
        ended_ns: now,
        failed: false,
    });

    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let file = std::fs::read(&path).unwrap();
    let used = kolo_timeline::used_bytes(&file);
    assert_eq!(used.len(), kolo_timeline::HEADER_BYTES + 4 * kolo_timeline::RECORD_BYTES);
    let (records, dropped) = decode(used).unwrap();
    assert_eq!(dropped, 0);
    let ops: Vec<(&str, (u64, u64), bool)> = records.iter().map(|r| (r.op.as_str(), r.key, r.failed)).collect();
    assert_eq!(
        ops,
        [
            ("allreduce", (7, 0), false),
            ("allgather", (7, 1), false),
            ("barrier", (7, 2), true),
            ("allreduce", (0, 0), false)
        ]
    );
    assert_eq!(records[1].submitted_ns, submitted);
    assert!(records[1].started_ns >= submitted + 5_000_000);
    assert!(records.iter().all(|r| r.submitted_ns <= r.started_ns && r.started_ns <= r.ended_ns));
    assert_eq!(records[3].name, "allreduce.grad.w");
}
